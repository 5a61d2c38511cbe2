"""Sharding plan of an optimizer state, from abstract shapes only.

`build_plan` reads a train state whose leaves are `jax.ShapeDtypeStruct`s
carrying their target shardings (`partitioning.abstract_train_state`) and
describes every optimizer-state leaf: its path (the T5X state-dict key below
``param_states``), shape, dtype, logical axes, mesh axes and bytes per device.
Nothing is allocated. Leaves are grouped by the part of the state they belong
to (``0/mu``, ``1/v_row``, ...); the totals are compared with the ideal of
every byte stored exactly once over the mesh, and large leaves that stay
replicated are flagged.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from t5x_optim import optimizers, partitioning
  >>> p = partitioning.Partitioner(partitioning.create_mesh(devices=jax.devices()[:1]))
  >>> state = partitioning.abstract_train_state(
  ...     p, optimizers.adamw(1e-3), lambda: {'params': {'w': jnp.ones((4, 2))}})
  >>> plan = build_plan(state, logical=state.as_logical_axes())
  >>> [(row.path, row.bytes_per_device) for row in plan.rows]
  [('0/count', 4), ('0/mu/w', 32), ('0/nu/w', 32)]
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec

from t5x_optim._axes.rules import is_spec_leaf
from t5x_optim._core import state_dict as _state_dict
from t5x_optim._keypaths import key_path_str
from t5x_optim._low_precision import low_precision as _low_precision

__all__ = ["LeafRow", "Plan", "build_plan", "format_bytes", "format_table", "plan_to_json"]

_ROOT = "(root)"
_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


@dataclasses.dataclass(frozen=True)
class LeafRow:
  """One optimizer-state leaf.

  Attributes:
    path: '/'-joined path below ``param_states`` (the state-dict key).
    group: the part of the state the leaf belongs to (the path without the
      param's path, or without the leaf's own name).
    shape: global shape.
    dtype: dtype name (``key<fry>`` for a typed PRNG key, counted at its bytes).
    logical_axes: logical name (or None) per dimension; None: replicated.
    mesh_axes: mesh axes per dimension (a name, a tuple, or None).
    replicated: whether every device holds the whole leaf: it is sharded over no mesh axis
      of more than one device (``(None, 'model')`` is replicated on a mesh of model=1).
    bytes_per_device: bytes of the largest shard one device holds.
    total_bytes: bytes of the whole leaf.
    param: the path of the param the leaf mirrors, if any.
    param_shape: that param's shape.
    dropped_axes: the param's logical axes this leaf does not keep (e.g. the
      factored dimension of adafactor's ``v_row``).
    storage: inside a `low_precision` state, how the leaf is stored
      (``"8bit codes"``, ``"4bit cols"``, ``"bfloat16"``, ...) or why it is kept; else "".
  """

  path: str
  group: str
  shape: tuple[int, ...]
  dtype: str
  logical_axes: tuple[str | None, ...] | None
  mesh_axes: tuple[Any, ...]
  replicated: bool
  bytes_per_device: int
  total_bytes: int
  param: str | None
  param_shape: tuple[int, ...] | None
  dropped_axes: tuple[str, ...]
  storage: str = ""


@dataclasses.dataclass(frozen=True)
class Plan:
  """The plan of a whole optimizer state.

  Attributes:
    mesh_shape: mesh axis sizes.
    rows: one row per state leaf, in tree order.
    warn_replicated_bytes: replicated leaves at least this large are flagged.
  """

  mesh_shape: dict[str, int]
  rows: tuple[LeafRow, ...]
  warn_replicated_bytes: int

  @property
  def num_devices(self) -> int:
    return math.prod(self.mesh_shape.values())

  @property
  def total_bytes(self) -> int:
    return sum(row.total_bytes for row in self.rows)

  @property
  def bytes_per_device(self) -> int:
    return sum(row.bytes_per_device for row in self.rows)

  @property
  def ideal_bytes_per_device(self) -> float:
    """Every byte stored once over the mesh."""
    return self.total_bytes / self.num_devices

  @property
  def replicated_bytes_per_device(self) -> int:
    return sum(row.bytes_per_device for row in self.rows if row.replicated)

  def groups(self) -> dict[str, list[LeafRow]]:
    """Rows by group, groups in order of first appearance."""
    grouped: dict[str, list[LeafRow]] = collections.defaultdict(list)
    for row in self.rows:
      grouped[row.group].append(row)
    return dict(grouped)

  def warnings(self) -> list[str]:
    """One message per large replicated leaf (none on a single device)."""
    if self.num_devices == 1:
      return []
    return [
      f"{row.path}: {format_bytes(row.total_bytes)} replicated on all "
      f"{self.num_devices} devices (logical axes {_axes_text(row.logical_axes)}); "
      f"{_unreplicate_hint(row)} or shard the optimizer state over data "
      "(shard_optimizer_state_over_data=True)"
      for row in self.rows
      if row.replicated and row.total_bytes >= self.warn_replicated_bytes
    ]


def _unreplicate_hint(row: LeafRow) -> str:
  """How a replicated leaf could be sharded: a rule for its axes, or a mesh whose axes it is
  sharded over span more than one device."""
  if any(entry is not None for entry in row.mesh_axes):
    return (
      f"its mesh axes {_axes_text(row.mesh_axes)} span one device each on this mesh: use a "
      "mesh where they span more,"
    )
  return "add a logical axis rule for one of its dimensions"


def _spec_tuple(spec: PartitionSpec | None, ndim: int) -> tuple[Any, ...]:
  entries = tuple(spec or ())
  return entries + (None,) * (ndim - len(entries))


def _dropped(param_axes: tuple[Any, ...], leaf_axes: tuple[Any, ...] | None) -> tuple[str, ...]:
  """The param's axis names missing from the leaf's (as a multiset)."""
  remaining = collections.Counter(name for name in leaf_axes or () if name is not None)
  dropped = []
  for name in param_axes:
    if name is None:
      continue
    if remaining[name]:
      remaining[name] -= 1
    else:
      dropped.append(name)
  return tuple(dropped)


def _match_param(
  path: tuple[str, ...], param_paths: dict[tuple[str, ...], Any]
) -> tuple[str, ...] | None:
  """The longest param path that `path` ends with."""
  for start in range(len(path)):
    if path[start:] in param_paths:
      return path[start:]
  return None


def build_plan(state: Any, *, logical: Any, warn_replicated_bytes: int = 1 << 20) -> Plan:
  """Describes every optimizer-state leaf of an abstract, sharded train state.

  Args:
    state: a `TrainState` whose leaves are `jax.ShapeDtypeStruct`s with
      `NamedSharding`s (from `partitioning.abstract_train_state`).
    logical: `state.as_logical_axes()`.
    warn_replicated_bytes: flag replicated leaves of at least this size.

  Returns:
    The plan.

  Raises:
    ValueError: when a leaf has no `NamedSharding`.
  """
  params = {
    _state_dict.key_path_parts(p): leaf for p, leaf in jax.tree.leaves_with_path(state.params)
  }
  param_axes = {
    _state_dict.key_path_parts(p): spec
    for p, spec in jax.tree.leaves_with_path(logical.params, is_leaf=is_spec_leaf)
  }
  specs = jax.tree.leaves(logical.param_states, is_leaf=is_spec_leaf)
  storage = _low_precision.leaf_storage(state.param_states)
  leaves = jax.tree.leaves_with_path(state.param_states)
  rows = []
  mesh_shape: dict[str, int] = {}
  for (key_path, leaf), spec in zip(leaves, specs, strict=True):
    sharding = getattr(leaf, "sharding", None)
    path = _state_dict.key_path_parts(key_path)
    if sharding is None or not hasattr(sharding, "mesh"):
      raise ValueError(f"Optimizer-state leaf {key_path_str(key_path)} has no NamedSharding.")
    mesh_shape = dict(sharding.mesh.shape)
    shape = tuple(leaf.shape)
    itemsize = leaf.dtype.itemsize
    logical_axes = None if spec is None else _spec_tuple(spec, len(shape))
    stored = storage.get(path, "")
    part = stored.startswith(tuple(f"{mode} " for mode in _low_precision.QUANTIZED_MODES))
    param = _match_param(path[:-1] if part else path, params)
    group = path[: len(path) - len(param) - part] if param else path[:-1]
    param_logical = _spec_tuple(param_axes.get(param), len(params[param].shape)) if param else ()
    factored = not part and param and logical_axes is not None and len(shape) < len(param_logical)
    dropped = _dropped(param_logical, logical_axes) if factored else ()
    rows.append(
      LeafRow(
        path="/".join(path),
        group="/".join(group) or _ROOT,
        shape=shape,
        dtype=leaf.dtype.name,
        logical_axes=logical_axes,
        mesh_axes=_spec_tuple(sharding.spec, len(shape)),
        replicated=sharding.is_fully_replicated,
        bytes_per_device=math.prod(sharding.shard_shape(shape)) * itemsize,
        total_bytes=math.prod(shape) * itemsize,
        param="/".join(param) if param else None,
        param_shape=tuple(params[param].shape) if param else None,
        dropped_axes=dropped,
        storage=stored,
      )
    )
  return Plan(mesh_shape=mesh_shape, rows=tuple(rows), warn_replicated_bytes=warn_replicated_bytes)


def format_bytes(count: float) -> str:
  """Human-readable bytes: whole bytes, or KiB to PiB with one decimal.

  The unit is the first, from bytes up, in which the rounded count is below
  1024 (PiB has no bound), so a count just under a unit reads as one of it.

  Example:
    >>> format_bytes(512), format_bytes(1536), format_bytes(3 * 2**20), format_bytes(2**20 - 1)
    ('512 B', '1.5 KiB', '3.0 MiB', '1.0 MiB')
  """
  for unit in _BYTE_UNITS:
    text = f"{count:.0f}" if unit == "B" else f"{count:.1f}"
    if float(text) < 1024 or unit == _BYTE_UNITS[-1]:
      return f"{text} {unit}"
    count /= 1024
  raise AssertionError("unreachable")


def _axes_text(axes: Sequence[Any] | None) -> str:
  if axes is None:
    return "replicated"
  return (
    "("
    + ", ".join("-" if a is None else "+".join(a) if isinstance(a, tuple) else a for a in axes)
    + ")"
  )


def _note(row: LeafRow) -> str:
  notes = [row.storage] if row.storage and row.shape else []
  if row.dropped_axes:
    notes.append(f"factored: drops {', '.join(row.dropped_axes)} of {row.param_shape}")
  return "; ".join(notes)


def format_table(plan: Plan) -> str:
  """The plan as a text table, grouped by state part, with totals and warnings."""
  header = ("path", "shape", "dtype", "logical axes", "mesh axes", "bytes/device", "")
  lines_by_group = {
    group: [
      (
        row.path,
        str(row.shape),
        row.dtype,
        _axes_text(row.logical_axes),
        _axes_text(None if row.replicated else row.mesh_axes),
        format_bytes(row.bytes_per_device),
        _note(row),
      )
      for row in rows
    ]
    for group, rows in plan.groups().items()
  }
  cells = [header, *(line for lines in lines_by_group.values() for line in lines)]
  widths = [max(len(line[i]) for line in cells) for i in range(len(header))]

  def render(line: Sequence[str]) -> str:
    return "  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip()

  mesh = " x ".join(f"{name}={size}" for name, size in plan.mesh_shape.items())
  out = [
    f"Optimizer state on mesh {mesh} ({plan.num_devices} devices), {len(plan.rows)} leaves",
    "",
  ]
  groups = plan.groups()
  for group, lines in lines_by_group.items():
    group_bytes = sum(row.bytes_per_device for row in groups[group])
    out += [
      f"[{group}] {len(lines)} leaves, {format_bytes(group_bytes)} per device",
      "  " + render(header),
      *("  " + render(line) for line in lines),
      "",
    ]
  ideal = plan.ideal_bytes_per_device
  ratio = plan.bytes_per_device / ideal if ideal else 1.0
  out += [
    f"total:      {format_bytes(plan.total_bytes)}",
    f"per device: {format_bytes(plan.bytes_per_device)} "
    f"(ideal {format_bytes(ideal)}, {ratio:.2f}x ideal; "
    f"replicated {format_bytes(plan.replicated_bytes_per_device)})",
  ]
  warnings = plan.warnings()
  if warnings:
    out += ["", f"warnings ({len(warnings)}):", *(f"  {w}" for w in warnings)]
  return "\n".join(out)


def _json_axes(axes: Sequence[Any] | None) -> list[Any] | None:
  return None if axes is None else [list(a) if isinstance(a, tuple) else a for a in axes]


def plan_to_json(plan: Plan) -> dict[str, Any]:
  """The plan as JSON-ready data: mesh, leaves, per-group and overall totals, warnings."""
  return {
    "mesh": plan.mesh_shape,
    "num_devices": plan.num_devices,
    "leaves": [
      {
        "path": row.path,
        "group": row.group,
        "shape": list(row.shape),
        "dtype": row.dtype,
        "logical_axes": _json_axes(row.logical_axes),
        "mesh_axes": _json_axes(row.mesh_axes),
        "bytes_per_device": row.bytes_per_device,
        "total_bytes": row.total_bytes,
        "replicated": row.replicated,
        "param": row.param,
        "param_shape": None if row.param_shape is None else list(row.param_shape),
        "dropped_axes": list(row.dropped_axes),
        "storage": row.storage,
      }
      for row in plan.rows
    ],
    "groups": {
      group: {
        "leaves": len(rows),
        "bytes_per_device": sum(r.bytes_per_device for r in rows),
        "total_bytes": sum(r.total_bytes for r in rows),
      }
      for group, rows in plan.groups().items()
    },
    "totals": {
      "total_bytes": plan.total_bytes,
      "bytes_per_device": plan.bytes_per_device,
      "ideal_bytes_per_device": plan.ideal_bytes_per_device,
      "replicated_bytes_per_device": plan.replicated_bytes_per_device,
    },
    "warnings": plan.warnings(),
  }
