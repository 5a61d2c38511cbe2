"""Implementation of `t5x_optim.t5x_checkpoints`, documented there."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping
from typing import Any, Protocol, Self

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath
from flax import serialization, traverse_util

from t5x_optim._checkpoint import storage
from t5x_optim._checkpoint.leaves import (
  checked_step,
  class_problems,
  listed,
  optimizer_state_classes,
)
from t5x_optim._core import state_dict as _state_dict
from t5x_optim._keypaths import key_path_str

__all__ = [
  "latest_t5x_step",
  "locate",
  "OpenedStep",
  "open_step",
  "restore_opened",
  "restore_t5x_checkpoint",
  "t5x_checkpoint_steps",
]

Path = tuple[str, ...]
_STEP_DIR = re.compile(r"checkpoint_([0-9]+)")
MSGPACK_FILE = "checkpoint"
# t5x_optim's record of the optimizer state's classes, beside T5X's files (T5X ignores it).
STATE_CLASSES_FILE = "t5x_optim_state_classes.json"
_ORBAX_ITEM = "state"
TS_CONTEXT = ts.Context({"file_io_concurrency": {"limit": 128}})


class T5XState(Protocol):
  """What is restored or saved: a `TrainState` or an `Optimizer`."""

  def state_dict(self) -> dict[str, Any]:
    """The T5X-layout state dict."""

  def restore_state(self, state_dict: Mapping[str, Any]) -> Self:
    """A copy restored from a T5X-layout state dict."""


@dataclasses.dataclass(frozen=True)
class _Stored:
  """One array of a checkpoint: its shape and dtype, and how to read it.

  Exactly one of `value` (stored inline) and `store` (an open tensorstore
  array) is set, or neither for an orbax leaf (read by orbax).
  """

  shape: tuple[int, ...]
  dtype: np.dtype
  value: Any = None
  store: ts.TensorStore | None = None


# ---------------------------------------------------------------- locating


def _format(step_dir: epath.Path) -> str | None:
  """'legacy', 'orbax' or None (not a T5X step directory)."""
  if (step_dir / MSGPACK_FILE).is_file():
    return "legacy"
  if (step_dir / _ORBAX_ITEM).is_dir():
    return "orbax"
  return None


def _step_dirs(model_dir: epath.Path) -> dict[int, epath.Path]:
  """``{step: directory}`` of the complete T5X checkpoints in `model_dir`.

  T5X writes a step to a temporary directory (``checkpoint_<step>.tmp-*`` or
  orbax's own) renamed when complete, so only exact ``checkpoint_<step>``
  names in a known format count.
  """
  if not model_dir.is_dir():
    return {}
  found = {}
  for child in model_dir.iterdir():
    match = _STEP_DIR.fullmatch(child.name)
    if match and child.is_dir() and _format(child) is not None:
      step = int(match.group(1))
      if step in found:
        raise ValueError(
          f"{found[step]} and {child} are both checkpoints of step {step}: keep one."
        )
      found[step] = child
  return dict(sorted(found.items()))


def t5x_checkpoint_steps(model_dir: str | os.PathLike[str]) -> list[int]:
  """The steps of the T5X checkpoints (either format) in `model_dir`, ascending.

  Example:
    >>> import tempfile
    >>> t5x_checkpoint_steps(tempfile.mkdtemp())
    []
  """
  return list(_step_dirs(storage.as_path(model_dir)))


def latest_t5x_step(model_dir: str | os.PathLike[str]) -> int | None:
  """The newest step of `t5x_checkpoint_steps`, or None when there is none.

  Example:
    >>> import tempfile
    >>> latest_t5x_step(tempfile.mkdtemp()) is None
    True
  """
  steps = t5x_checkpoint_steps(model_dir)
  return steps[-1] if steps else None


def locate(path: str | os.PathLike[str], step: int | None) -> tuple[epath.Path, str]:
  """The step directory and format that `path` (and `step`) name.

  `path` is a model directory, a ``checkpoint_<step>`` directory, or a
  legacy checkpoint's ``checkpoint`` file.
  """
  where = storage.as_path(path)
  if where.is_file():
    if where.name != MSGPACK_FILE:
      raise ValueError(f"{where} is not a T5X checkpoint file (named '{MSGPACK_FILE}').")
    where = where.parent
  if not where.is_dir():
    raise FileNotFoundError(f"No T5X checkpoint at {where}: no such directory.")
  dirs = _step_dirs(where)
  fmt = _format(where)
  if fmt is not None and not dirs:
    if step is not None:
      raise ValueError(f"{where} is one step's directory; give its model directory with step=.")
    return where, fmt
  if not dirs:
    raise FileNotFoundError(
      f"No T5X checkpoint in {where}: no checkpoint_<step> directory holds a "
      f"'{MSGPACK_FILE}' file (legacy format) or a '{_ORBAX_ITEM}' directory (Orbax format)."
    )
  step = list(dirs)[-1] if step is None else checked_step(step)
  if step not in dirs:
    raise FileNotFoundError(
      f"No T5X checkpoint for step {step} in {where}; the steps are {list(dirs)}."
    )
  step_dir = dirs[step]
  return step_dir, _format(step_dir)


# ---------------------------------------------------------------- reading


def _is_ts_spec(node: Mapping[str, Any]) -> bool:
  """Whether a msgpack mapping is a tensorstore spec rather than a subtree."""
  return isinstance(node.get("driver"), str) and ("kvstore" in node or "path" in node)


def _flatten_stored(tree: Any, path: Path = ()) -> dict[Path, Any]:
  """A msgpack state dict as ``{path: leaf}``; spec dicts are leaves.

  Empty mappings and None (no state: optax's empty states, T5X's
  MultiOptimizer holes) hold no data and are left out.
  """
  if tree is None:
    return {}
  if not isinstance(tree, Mapping) or _is_ts_spec(tree):
    return {path: tree}
  flat = {}
  for key, value in tree.items():
    flat.update(_flatten_stored(value, (*path, str(key))))
  return flat


def _open_spec(step_dir: epath.Path, spec: Mapping[str, Any], where: str) -> Any:
  """Opens a stored array (a future) from its spec's path, relative to `step_dir` (an absolute
  path is refused).

  As T5X does, only the path is taken from the spec (chunks and compressor
  come from the stored ``.zarray``); a path written for GCS is read from
  `step_dir` too. A missing chunk file is an error when read, not zeros:
  T5X's arrays have no fill value, so every chunk was written
  (`_without_fill_value_check` reopens an array that has one).
  """
  kvstore = spec.get("kvstore")
  relative = kvstore.get("path") if isinstance(kvstore, Mapping) else None
  relative = relative or spec.get("path")
  if not isinstance(relative, str) or not relative:
    raise ValueError(
      f"The T5X checkpoint in {step_dir} has a spec without a path at '{where}': {spec}."
    )
  if relative.startswith("/"):
    raise ValueError(
      f"The T5X checkpoint in {step_dir} has a spec with an absolute path at '{where}': "
      f"{relative!r}; T5X writes each path relative to the step directory."
    )
  return ts.open(
    _full_spec(step_dir, spec["driver"], relative), open=True, read=True, context=TS_CONTEXT
  )


def _full_spec(step_dir: epath.Path, driver: str, relative: str, *, strict: bool = True) -> dict:
  """The tensorstore spec of a stored array; `strict`: a missing chunk fails its read."""
  full = {"driver": driver, "kvstore": storage.kvstore_spec(storage.join(step_dir, relative))}
  if strict:
    full["fill_missing_data_reads"] = False
  return full


def _without_fill_value_check(step_dir: epath.Path, spec: Mapping[str, Any], store: Any) -> Any:
  """`store` as opened, or reopened reading missing chunks as its fill value when it has one.

  A writer that declares a fill value may leave chunks equal to it unwritten.
  """
  if store.fill_value is None:
    return store
  kvstore = spec.get("kvstore")
  relative = (kvstore.get("path") if isinstance(kvstore, Mapping) else None) or spec.get("path")
  full = _full_spec(step_dir, spec["driver"], relative, strict=False)
  return ts.open(full, open=True, read=True, context=TS_CONTEXT).result()


def read_legacy_metadata(step_dir: epath.Path) -> dict[Path, _Stored]:
  """Every array of a legacy checkpoint, opened (headers only, no data)."""
  file = step_dir / MSGPACK_FILE
  try:
    contents = serialization.msgpack_restore(file.read_bytes())
  except Exception as e:  # msgpack raises many types on corrupt input.
    raise ValueError(f"{file} is not a readable T5X checkpoint: {e}") from e
  if not isinstance(contents, Mapping):
    raise ValueError(f"{file} is not a T5X checkpoint: it holds a {type(contents).__name__}.")
  version = contents.get("version", 0)
  if version == 0:
    tree = contents  # A plain flax state dict, which T5X also reads.
  elif version < 2 or "optimizer" not in contents:
    raise ValueError(f"{file} is a T5X checkpoint of version {version}; versions 2 and 3 are read.")
  else:
    tree = contents["optimizer"]
  leaves = _flatten_stored(tree)
  opening = {
    path: _open_spec(step_dir, leaf, key_path_str(path))
    for path, leaf in leaves.items()
    if isinstance(leaf, Mapping)
  }
  stored, unreadable = {}, []
  for path, leaf in leaves.items():
    if path not in opening:
      value = np.asarray(leaf)
      stored[path] = _Stored(value.shape, value.dtype, value=value)
      continue
    try:
      store = _without_fill_value_check(step_dir, leaves[path], opening[path].result())
    except (OSError, ValueError) as e:
      unreadable.append(f"'{key_path_str(path)}' ({e})")
      continue
    stored[path] = _Stored(tuple(store.shape), np.dtype(store.dtype.numpy_dtype), store=store)
  if unreadable:
    raise ValueError(
      f"The T5X checkpoint in {step_dir} has unreadable arrays: {'; '.join(unreadable)}."
    )
  return stored


def read_orbax_metadata(step_dir: epath.Path) -> dict[Path, _Stored]:
  """Every array of an Orbax-format checkpoint, from orbax's tree metadata."""
  item = step_dir / _ORBAX_ITEM
  try:
    tree = ocp.PyTreeCheckpointHandler().metadata(item).tree
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise ValueError(f"{item} has no readable orbax metadata: {e}") from e
  return {
    path: _Stored(tuple(leaf.shape), np.dtype(leaf.dtype))
    for path, leaf in _flatten_stored(tree).items()
  }


def _shape_dtype(leaf: Any) -> tuple[tuple[int, ...], np.dtype]:
  if _state_dict.is_prng_key(leaf):
    data = jax.eval_shape(jax.random.key_data, leaf)
    return tuple(data.shape), np.dtype(data.dtype)
  dtype = getattr(leaf, "dtype", None)
  return tuple(np.shape(leaf)), np.dtype(dtype if dtype is not None else np.asarray(leaf).dtype)


def _describe(shape: tuple[int, ...], dtype: np.dtype) -> str:
  return f"{dtype}{list(shape)}"


def _problems(expected: Mapping[Path, Any], stored: Mapping[Path, _Stored]) -> list[str]:
  """Every missing key, unexpected key and shape or dtype-kind mismatch, by path.

  Dtypes follow `state_dict.leaf_fit`, the rule of every restore: what it
  refuses outright (a change of kind) is reported here, before any read;
  integers narrowed are checked by value after reading (`restore_state`).
  """
  problems = []
  for path, leaf in expected.items():
    shape, dtype = _shape_dtype(leaf)
    where = key_path_str(path)
    if path not in stored:
      problems.append(f"missing key '{where}' (the target has {_describe(shape, dtype)})")
      continue
    fit = _state_dict.leaf_fit(stored[path].shape, stored[path].dtype, shape, dtype)
    if fit in (_state_dict.Fit.OTHER_SHAPE, _state_dict.Fit.OTHER_DTYPE):
      problems.append(
        f"{'shape' if fit is _state_dict.Fit.OTHER_SHAPE else 'dtype'} mismatch at '{where}': "
        f"the target has {_describe(shape, dtype)}, the "
        f"checkpoint has {_describe(stored[path].shape, stored[path].dtype)}"
      )
  problems += [
    f"unexpected key '{key_path_str(path)}' (the checkpoint has {_describe(leaf.shape, leaf.dtype)}; "
    "the target has no such array)"
    for path, leaf in stored.items()
    if path not in expected
  ]
  return problems


def _class_problems(step_dir: epath.Path, target: Any) -> list[str]:
  """`class_problems` of the classes recorded with a step (by `save_t5x_checkpoint`) and `target`'s.

  A step written by T5X records none: nothing to compare.
  """
  classes = optimizer_state_classes(target)
  file = step_dir / STATE_CLASSES_FILE
  if classes is None or not file.exists():
    return []
  try:
    recorded = json.loads(file.read_text())
    if not isinstance(recorded, dict):
      raise ValueError(f"expected a JSON object, got {type(recorded).__name__}")
  except (OSError, ValueError) as e:
    raise ValueError(f"{file} is not a readable record of the optimizer: {e}") from e
  return class_problems({str(k): str(v) for k, v in recorded.items()}, classes)


def _sharding(leaf: Any) -> jax.sharding.Sharding | None:
  """The target sharding of a target leaf (None: a host value)."""
  if _state_dict.is_prng_key(leaf):
    return None  # Keys are read as raw key data; `restore_state` rewraps them.
  sharding = getattr(leaf, "sharding", None)
  return sharding if isinstance(sharding, jax.sharding.Sharding) else None


def _start_shard_reads(
  store: ts.TensorStore, sharding: jax.sharding.Sharding, shape: tuple[int, ...]
) -> list[tuple[jax.Device, Any]]:
  """Starts reading this process's shards: ``(device, future)``, each region read once."""
  futures, reads = {}, []
  for device, index in sharding.addressable_devices_indices_map(shape).items():
    region = tuple((s.start, s.stop, s.step) for s in index)
    if region not in futures:
      futures[region] = store[index].read()
    reads.append((device, futures[region]))
  return reads


def _on_host(stored: Mapping[Path, _Stored], expected: Mapping[Path, Any]) -> set[Path]:
  """The leaves to read whole onto the host and check there (`state_dict.reads_on_host`)."""
  return {
    path
    for path, leaf in expected.items()
    if _state_dict.reads_on_host(stored[path].dtype, _shape_dtype(leaf)[1])
  }


def _fit_host_leaves(
  step_dir: epath.Path, read: Mapping[Path, Any], expected: Mapping[Path, Any], host: set[Path]
) -> dict[Path, Any]:
  """Checks the host-read leaves against the target (`state_dict.fit_on_host`), then places them.

  Raises:
    ValueError: naming the leaves whose values do not fit (`listed`); nothing is placed.
  """
  fitted, problems = dict(read), []
  for path in sorted(host):
    try:
      fitted[path] = _state_dict.fit_on_host(read[path], _shape_dtype(expected[path])[1], path)
    except ValueError as e:
      problems.append(str(e))
  if problems:
    raise ValueError(
      f"The T5X checkpoint in {step_dir} does not fit the target: "
      f"{'; '.join(listed(problems))}. Nothing was restored."
    )
  for path in host:
    sharding = _sharding(expected[path])
    if sharding is not None:
      value = fitted[path]
      fitted[path] = jax.make_array_from_callback(
        value.shape, sharding, lambda index, value=value: value[index]
      )
  return fitted


def _result(future: Any, path: Path) -> Any:
  """The data a started read gives; a failed read (a missing chunk file) names its array."""
  try:
    return future.result()
  except (OSError, ValueError) as e:
    raise ValueError(f"the array at '{key_path_str(path)}' could not be read: {e}") from e


def _read_legacy(
  stored: Mapping[Path, _Stored], expected: Mapping[Path, Any], host: set[Path]
) -> dict[Path, Any]:
  """Reads every expected leaf, each into its target sharding (its shards only).

  The `host` leaves are read whole onto the host instead, to be checked
  before they are placed. All reads are started before any is waited for.
  """
  started = {}
  for path, leaf in expected.items():
    item = stored[path]
    sharding = None if path in host else _sharding(leaf)
    if item.store is not None:
      started[path] = (
        item.store.read()
        if sharding is None
        else _start_shard_reads(item.store, sharding, item.shape)
      )
  restored = {}
  for path, leaf in expected.items():
    item = stored[path]
    sharding = None if path in host else _sharding(leaf)
    if item.store is None:
      value = item.value
      restored[path] = (
        value
        if sharding is None
        else jax.make_array_from_callback(
          item.shape, sharding, lambda index, value=value: value[index]
        )
      )
    elif sharding is None:
      restored[path] = _result(started[path], path)
    else:
      shards = [jax.device_put(_result(future, path), device) for device, future in started[path]]
      restored[path] = jax.make_array_from_single_device_arrays(item.shape, sharding, shards)
  return restored


def _read_orbax(
  step_dir: epath.Path,
  stored: Mapping[Path, _Stored],
  expected: Mapping[Path, Any],
  host: set[Path],
) -> dict[Path, Any]:
  """Reads every expected leaf with orbax, each into its target sharding.

  The `host` leaves are read as numpy arrays, to be checked before they are
  placed.
  """

  def abstract(path: Path) -> jax.ShapeDtypeStruct:
    sharding = _sharding(expected[path])
    if sharding is None:
      sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.ShapeDtypeStruct(stored[path].shape, stored[path].dtype, sharding=sharding)

  def restore_args(path: Path) -> ocp.RestoreArgs:
    if path in host:
      return ocp.RestoreArgs(restore_type=np.ndarray, dtype=stored[path].dtype)
    return ocp.checkpoint_utils.construct_restore_args(abstract(path))

  target = traverse_util.unflatten_dict({path: abstract(path) for path in expected})
  args = ocp.args.PyTreeRestore(
    target,
    restore_args=traverse_util.unflatten_dict({path: restore_args(path) for path in expected}),
    partial_restore=True,
  )
  try:
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
      restored = checkpointer.restore(step_dir / _ORBAX_ITEM, args=args)
  except (OSError, ValueError) as e:
    raise ValueError(f"The T5X checkpoint in {step_dir} could not be read: {e}") from e
  return traverse_util.flatten_dict(dict(restored))


def restore_t5x_checkpoint(
  path: str | os.PathLike[str],
  target: T5XState,
  *,
  step: int | None = None,
) -> T5XState:
  """Restores a T5X checkpoint (legacy or Orbax format) into `target`.

  `target` is only a template and is never modified: a `TrainState` or an
  `Optimizer` (or anything with T5X's `state_dict`/`restore_state`) whose
  leaves may be real arrays or `jax.ShapeDtypeStruct`s with shardings (see
  `partitioning.abstract_train_state`), on any mesh. The checkpoint's keys
  and shapes are checked against the target's state dict before any array is
  read; each array is then read straight into the target leaf's sharding
  (only this process's shards), in its stored dtype, and the state dict is
  handed to the target's `restore_state`, which validates it again and
  applies its dtype rule.

  Args:
    path: a T5X model directory, one step's ``checkpoint_<step>`` directory,
      or a legacy checkpoint's ``checkpoint`` file; local or with a scheme
      (``gs://``, see `storage`).
    target: gives the structure, shapes, shardings and dtypes, except that
      a floating param keeps the checkpoint's dtype, as the target's
      `restore_state` keeps it.
    step: with a model directory, the step to restore (None: the latest).

  Returns:
    A new object of `target`'s type.

  Raises:
    FileNotFoundError: no T5X checkpoint (for `step`) at `path`.
    ValueError: the checkpoint does not fit the target (missing or unexpected
      keys, e.g. another model or optimizer; other shapes; an optimizer state
      of other classes where a step written by `save_t5x_checkpoint` records
      them, such as adam's restored into adabelief), naming the paths with
      both sides (the first `SHOWN_PROBLEMS`, then a count of the rest by
      kind); an unreadable checkpoint; or what the target's
      `restore_state` rejects.

  The public `t5x_optim.restore_t5x_checkpoint` (`api.py`) calls this one
  and has the example.
  """
  return restore_opened(open_step(path, step), target)


@dataclasses.dataclass(frozen=True)
class OpenedStep:
  """One step of a T5X checkpoint, located and its arrays opened (`open_step`).

  Attributes:
    step_dir: its ``checkpoint_<step>`` directory.
    fmt: ``'legacy'`` or ``'orbax'``.
    stored: every array by state-dict path: shape and dtype, and how to read
      it (a legacy file's inline values are decoded once, here).
  """

  step_dir: epath.Path
  fmt: str
  stored: dict[Path, _Stored]

  @property
  def step(self) -> int | None:
    """Its step, from its directory's name (None where the name holds none)."""
    match = _STEP_DIR.fullmatch(self.step_dir.name)
    return int(match.group(1)) if match else None


def open_step(path: str | os.PathLike[str], step: int | None) -> OpenedStep:
  """The step `path` (and `step`; None: the latest) names, its arrays opened, no data read."""
  step_dir, fmt = locate(path, step)
  read = read_legacy_metadata if fmt == "legacy" else read_orbax_metadata
  return OpenedStep(step_dir, fmt, read(step_dir))


def restore_opened(opened: OpenedStep, target: T5XState) -> T5XState:
  """`restore_t5x_checkpoint` of a step already opened."""
  step_dir, fmt, stored = opened.step_dir, opened.fmt, opened.stored
  flat_target = traverse_util.flatten_dict(_state_dict.prune_empty(target.state_dict()))
  expected = {p: leaf for p, leaf in flat_target.items() if leaf is not None}
  problems = listed(_problems(expected, stored)) + _class_problems(step_dir, target)
  if problems:
    raise ValueError(
      f"The T5X checkpoint in {step_dir} does not fit the target: {'; '.join(problems)}. "
      "Nothing was restored."
    )
  host = _on_host(stored, expected)
  if fmt == "legacy":
    try:
      restored = _read_legacy(stored, expected, host)
    except ValueError as e:
      raise ValueError(f"The T5X checkpoint in {step_dir} is incomplete: {e}") from e
  else:
    restored = _read_orbax(step_dir, stored, expected, host)
  restored = _fit_host_leaves(step_dir, restored, expected, host)
  return target.restore_state(traverse_util.unflatten_dict(restored))
