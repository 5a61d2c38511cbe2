"""Where a `jax.example_libraries.optimizers` state keeps each param's values.

An example-libraries state is a flat tuple of "parts" per param (momentum,
second moments, ...), each possibly a tuple again, built by functions the
adapter cannot read. `trace_layout` traces the triple's ``init`` and
``get_params`` to find, per param, which parts are arrays of the param's
shape, which have one of its dimensions (SM3's per-dimension accumulators)
and which are static Python values; the state rule gives each part its
logical spec from that.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import numpy as np
from jax.example_libraries import optimizers as example_lib
from jax.sharding import PartitionSpec

from t5x_optim._axes import specs as specs_lib
from t5x_optim._axes.registry import StateRuleContext, register_state_rule
from t5x_optim._axes.rules import is_spec_leaf
from t5x_optim._core.interface import structure_mismatch
from t5x_optim._keypaths import key_path_str

__all__ = ["Layout", "PartsNode", "leaf_name", "trace_layout"]


class _Slot(enum.Enum):
  PARAM = "param"
  PART = "part"
  STATIC = "static"


@dataclasses.dataclass(frozen=True)
class _LeafLayout:
  """Where one param's packed state keeps the param, its parts and Python values.

  Attributes:
    treedef: the structure of the param's state in the packed state.
    slots: per flat state leaf, `(_Slot.PARAM, shape)`, `(_Slot.PART, names)`
      (its path in the parts dict) or `(_Slot.STATIC, value)`.
  """

  treedef: Any
  slots: tuple[tuple[_Slot, Any], ...]

  def pack(self, param: Any, parts: Mapping[str, Any]) -> list[Any]:
    """The param's flat packed state, rebuilt from `param` and its `parts`."""
    flat = []
    for kind, data in self.slots:
      if kind is _Slot.PARAM:
        flat.append(param if np.shape(param) == data else jnp.reshape(param, data))
      elif kind is _Slot.PART:
        flat.append(functools.reduce(lambda node, name: node[name], data, parts))
      else:
        flat.append(data)
    return flat

  def unpack(
    self, flat: Sequence[Any], *, where: str, like: Sequence[Any] | None = None
  ) -> dict[str, Any]:
    """The parts dict of a flat packed state (the param copy left out).

    With `like` (the flat state before an update), parts keep its dtypes.

    Raises:
      ValueError: if the update changed a Python value of the state (it is
        rebuilt from the params, so the change would be lost).
    """
    parts: dict[str, Any] = {}
    for k, ((kind, data), leaf) in enumerate(zip(self.slots, flat, strict=True)):
      if kind is _Slot.PART:
        if like is not None:
          leaf = leaf.astype(jnp.result_type(like[k]))
        node = parts
        for name in data[:-1]:
          node = node.setdefault(name, {})
        node[data[-1]] = leaf
      elif kind is _Slot.STATIC and (_is_array(leaf) or leaf != data):
        raise ValueError(
          f"The triple's update changed the Python value {data!r} in the state of "
          f"param '{where}' to {leaf!r}; ExampleLibOptimizerDef rebuilds Python "
          "values from the params, so state that changes must be arrays."
        )
    return parts


@dataclasses.dataclass(frozen=True)
class Layout:
  """The per-param layouts for one params structure (shapes and dtypes)."""

  params_def: Any
  paths: tuple[str, ...]
  leaves: tuple[_LeafLayout, ...]

  def parts(self, params: Any, param_states: Any) -> list[Any]:
    """Each param's parts dict; dicts and FrozenDicts are interchangeable."""
    try:
      return self.params_def.flatten_up_to(param_states)
    except (TypeError, ValueError):
      pass
    try:
      thawed_def = jax.tree.structure(specs_lib.thaw(params))
      return thawed_def.flatten_up_to(specs_lib.thaw(param_states))
    except (TypeError, ValueError) as error:
      raise ValueError(
        "The optimizer state does not fit the params: "
        f"{structure_mismatch(param_states, params, name='state')}."
      ) from error

  def pack(self, params: Any, param_states: Any) -> example_lib.OptimizerState:
    """The triple's packed state for `params` and the stored parts."""
    parts = self.parts(params, param_states)
    flat_params = self.params_def.flatten_up_to(params)
    return example_lib.OptimizerState(
      [leaf.pack(p, s) for leaf, p, s in zip(self.leaves, flat_params, parts, strict=True)],
      self.params_def,
      [leaf.treedef for leaf in self.leaves],
    )

  def unpack(
    self, packed: example_lib.OptimizerState, *, like: example_lib.OptimizerState | None = None
  ) -> Any:
    """The stored form of a packed state: parts dicts in the params' structure.

    With `like` (the packed state before an update), parts keep its dtypes.
    """
    likes = [None] * len(self.leaves) if like is None else like.packed_state
    return self.params_def.unflatten(
      leaf.unpack(flat, where=path, like=old)
      for leaf, flat, path, old in zip(
        self.leaves, packed.packed_state, self.paths, likes, strict=True
      )
    )


def _is_array(value: Any) -> bool:
  return isinstance(value, jax.Array | np.ndarray | np.generic)


def _key_name(key: Any) -> str:
  for attribute in ("name", "key", "idx"):
    if hasattr(key, attribute):
      return str(getattr(key, attribute))
  return str(key)


def _part_names(path: Sequence[Any], slot_names: Sequence[str] | None) -> tuple[str, ...]:
  names = [_key_name(key) for key in path]
  first = getattr(path[0], "idx", None) if path else None
  if slot_names is not None and first is not None and first < len(slot_names):
    names[0] = slot_names[first]
  return tuple(names)


def _abstract_init(
  triple: example_lib.Optimizer, params: Any
) -> tuple[list[list[Any]], list[list[Any]], list[Any]]:
  """Traces `init_fn` on abstract params.

  Returns:
    per param: the shapes of its state arrays, the flat state with `None` at
    array positions and Python values elsewhere, and its state treedef.
  """
  captured: dict[str, Any] = {}

  def init_arrays(abstract_params: Any) -> list[list[Any]]:
    states_flat, _, subtree_defs = triple.init_fn(abstract_params)
    captured["statics"] = [[None if _is_array(v) else v for v in flat] for flat in states_flat]
    captured["treedefs"] = list(subtree_defs)
    return [[v for v in flat if _is_array(v)] for flat in states_flat]

  shapes = jax.eval_shape(init_arrays, params)
  return shapes, captured["statics"], captured["treedefs"]


def _merge(statics: Sequence[Any], arrays: Sequence[Any]) -> list[Any]:
  it = iter(arrays)
  return [next(it) if v is None else v for v in statics]


_RESHAPES = frozenset({"reshape", "squeeze", "expand_dims", "copy", "copy_p"})
"""Primitives that only lay the same values out again: undone by a reshape of the param."""


def _op_names(eqn: Any) -> frozenset[str]:
  """The primitive of `eqn` unless it only lays its operand out again (same values)."""
  name = eqn.primitive.name
  if name in _RESHAPES:
    return frozenset()
  if name == "broadcast_in_dim" and eqn.outvars[0].aval.size == eqn.invars[0].aval.size:
    return frozenset()
  return frozenset({name})


def _param_sources(
  triple: example_lib.Optimizer,
  params_def: Any,
  shapes: list[list[Any]],
  statics: list[list[Any]],
  treedefs: list[Any],
) -> list[tuple[set[tuple[int, int]], frozenset[str]]]:
  """For each param, the `(param index, array index)` state arrays `get_params` reads, and
  the primitives other than reshapes it computes the param with."""
  owners = [(i, j) for i, row in enumerate(shapes) for j in range(len(row))]

  def params_from(arrays: list[list[Any]]) -> list[Any]:
    flats = [_merge(s, a) for s, a in zip(statics, arrays, strict=True)]
    return params_def.flatten_up_to(
      triple.params_fn(example_lib.OptimizerState(flats, params_def, treedefs))
    )

  jaxpr = jax.make_jaxpr(params_from)(shapes).jaxpr
  deps: dict[Any, frozenset[int]] = {v: frozenset({k}) for k, v in enumerate(jaxpr.invars)}
  ops: dict[Any, frozenset[str]] = {}
  for eqn in jaxpr.eqns:
    inputs = [v for v in eqn.invars if isinstance(v, jax_core.Var)]
    used = frozenset().union(*(deps.get(v, frozenset()) for v in inputs))
    applied = frozenset().union(_op_names(eqn), *(ops.get(v, frozenset()) for v in inputs))
    deps.update((v, used) for v in eqn.outvars)
    ops.update((v, applied) for v in eqn.outvars)
  return [
    ({owners[k] for k in deps.get(v, ())}, ops.get(v, frozenset()))
    if isinstance(v, jax_core.Var)
    else (set(), frozenset())
    for v in jaxpr.outvars
  ]


def _leaf_layout(
  index: int,
  param: Any,
  path: str,
  shapes: Sequence[Any],
  statics: Sequence[Any],
  treedef: Any,
  read: tuple[set[tuple[int, int]], frozenset[str]],
  slot_names: Sequence[str] | None,
) -> _LeafLayout:
  """The layout of one param's state; raises unless it holds the param once, as it is or
  reshaped."""
  sources, ops = read
  if len(sources) != 1 or next(iter(sources))[0] != index:
    raise ValueError(
      f"The triple's get_params reads param '{path}' from state arrays "
      f"{sorted(sources)} (param, array); ExampleLibOptimizerDef needs each "
      "param kept once in its own per-param state, as every "
      "jax.example_libraries optimizer keeps it."
    )
  if ops:
    raise ValueError(
      f"The triple's get_params computes param '{path}' from its state array by "
      f"{', '.join(sorted(ops))}; ExampleLibOptimizerDef rebuilds that array from the "
      "param, so it needs the param kept as it is or reshaped, as every "
      "jax.example_libraries optimizer keeps it."
    )
  [(_, param_array)] = sources
  source = shapes[param_array]
  if source.size != np.size(param) or source.dtype != jnp.result_type(param):
    raise ValueError(
      f"The triple stores param {path} (shape {np.shape(param)}, dtype "
      f"{jnp.result_type(param)}) as shape {source.shape} dtype {source.dtype}; "
      "only a reshape can be rebuilt from the params."
    )
  key_paths = [
    p
    for p, _ in jax.tree.flatten_with_path(jax.tree.unflatten(treedef, range(treedef.num_leaves)))[
      0
    ]
  ]
  slots = []
  array_index = 0
  for key_path, static in zip(key_paths, statics, strict=True):
    if static is not None:
      slots.append((_Slot.STATIC, static))
      continue
    if array_index == param_array:
      slots.append((_Slot.PARAM, tuple(source.shape)))
    else:
      slots.append((_Slot.PART, _part_names(key_path, slot_names)))
    array_index += 1
  return _LeafLayout(treedef=treedef, slots=tuple(slots))


def trace_layout(
  triple: example_lib.Optimizer, params: Any, slot_names: Sequence[str] | None
) -> Layout:
  path_leaves, params_def = jax.tree.flatten_with_path(params)
  paths = tuple(key_path_str(p) for p, _ in path_leaves)
  leaves = [leaf for _, leaf in path_leaves]
  shapes, statics, treedefs = _abstract_init(triple, params)
  sources = _param_sources(triple, params_def, shapes, statics, treedefs)
  return Layout(
    params_def=params_def,
    paths=paths,
    leaves=tuple(
      _leaf_layout(i, *args, slot_names)
      for i, args in enumerate(zip(leaves, paths, shapes, statics, treedefs, sources, strict=True))
    ),
  )


def _is_per_dim(node: Mapping[str, Any], shape: tuple[int, ...]) -> bool:
  """Whether `node` holds one rank-1 vector per param dimension (sm3's `vs`)."""
  return (
    len(shape) > 0
    and set(node) == {str(d) for d in range(len(shape))}
    and all(specs_lib.leaf_shape(node[str(d)]) == (shape[d],) for d in range(len(shape)))
  )


def _part_specs(node: Any, shape: tuple[int, ...], spec: PartitionSpec | None) -> Any:
  """Logical specs of one param's parts; unmatched leaves stay `UNDERIVED`."""
  if isinstance(node, Mapping):
    if _is_per_dim(node, shape):
      return {
        key: None if spec is None else specs_lib.canonical(PartitionSpec(spec[int(key)]), 1)
        for key in node
      }
    return {key: _part_specs(value, shape, spec) for key, value in node.items()}
  part_shape = specs_lib.leaf_shape(node)
  if spec is None or all(d == 1 for d in part_shape):
    return None
  if part_shape == shape:
    return spec
  return specs_lib.UNDERIVED


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PartsNode:
  """The node the engine derives an `ExampleLibOptimizerDef` state's specs on.

  Attributes:
    parts: each param's parts dict (nested dicts), in the params' structure.
  """

  parts: Any


def _parts_rule(state: PartsNode, specs: PartsNode, context: StateRuleContext) -> PartsNode:
  """The state rule for `PartsNode`: each param's parts from its shape and spec.

  A part with its param's shape gets the param's spec; a rank-1 vector per
  param dimension (sm3's `vs`) gets that dimension's entry; scalars and
  parts of replicated params get None; anything else stays `UNDERIVED`.
  """
  del specs
  return PartsNode(
    jax.tree.map(
      lambda spec, param, parts: _part_specs(parts, specs_lib.leaf_shape(param), spec),
      context.param_specs,
      context.params,
      state.parts,
      is_leaf=is_spec_leaf,
    )
  )


register_state_rule(
  PartsNode,
  _parts_rule,
  underived_reason="they have neither their param's shape nor one dimension of it",
)


def leaf_name(path: jax.tree_util.KeyPath) -> str:
  """A parts leaf's path in `param_states` (`dense/kernel/m`)."""
  return key_path_str(path[1:])
