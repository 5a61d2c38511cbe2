"""The leaves of a checkpoint: as stored, as expected, and how one becomes the other.

`Checkpointer` compares the shape and dtype of every stored array with the
target's before reading any data (`leaf_problems` finds every mismatch at once),
writes typed PRNG keys as their raw key data, and fits what it read to the
target's dtypes and shardings. Paths are tuples of state-dict keys.

Example:
  >>> import jax.numpy as jnp
  >>> flatten({'target': {'w': jnp.ones(2)}, 'state': {'param_states': {}}})
  {('target', 'w'): Array([1., 1.], dtype=float32)}
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import traverse_util
from flax.core import FrozenDict

from t5x_optim._core import state_dict as _state_dict
from t5x_optim._core.interface import Optimizer
from t5x_optim._keypaths import key_path_str
from t5x_optim._nnx import to_pure
from t5x_optim._training.train_state import TrainState

__all__ = [
  "CheckpointError",
  "HostRead",
  "Path",
  "array_key",
  "as_read",
  "as_stored",
  "checked_step",
  "class_problems",
  "empty_leaf",
  "fit_read",
  "flatten",
  "leaf_problems",
  "listed",
  "optimizer_state_classes",
  "orbax_restore_args",
  "place",
  "rewrap_keys",
  "root_cause",
  "rounded_floats",
  "saveable",
  "shared_names",
  "state_classes",
  "without_nnx_nodes",
  "zero_size_record",
  "zero_size_stored",
]


Path = tuple[str, ...]


class CheckpointError(ValueError):
  """A checkpoint's stored data is missing, unreadable or corrupt, or in use.

  Raised for every storage failure (a missing, truncated or corrupt file, a
  tensorstore error, an array whose checksum differs from the one recorded at
  save time) and for a second writer into a directory in use. The message
  names the step and directory and, where one is at fault, the array path.

  Attributes:
    step: the checkpoint step concerned.
  """

  def __init__(self, message: str, *, step: int):
    super().__init__(message)
    self.step = step


def checked_step(step: Any) -> int:
  """`step` as an int, when it is a non-negative integer (a Python, numpy or 0-d jax one).

  Checkpoint directories are named by step and listed as integers, so a
  step is never rounded (``2.9``), read from a string or a bool, or negative
  (which no listing finds).

  Raises:
    ValueError: for anything else, naming it.

  Example:
    >>> checked_step(3), checked_step(np.int64(4))
    (3, 4)
    >>> checked_step(2.9)
    Traceback (most recent call last):
    ...
    ValueError: A checkpoint step must be a non-negative integer, got 2.9 (float).
  """
  value = step
  if isinstance(step, np.ndarray | jax.Array) and np.ndim(step) == 0:
    value = step.item() if np.issubdtype(step.dtype, np.integer) else None
  elif isinstance(step, np.integer):
    value = int(step)
  if isinstance(value, bool) or not isinstance(value, int) or value < 0:
    raise ValueError(
      f"A checkpoint step must be a non-negative integer, got {step!r} ({type(step).__name__})."
    )
  return value


def root_cause(error: BaseException) -> str:
  """The innermost error behind `error`, without tensorstore's spec dump."""
  while (error.__cause__ or error.__context__) is not None:
    error = error.__cause__ or error.__context__
  return f"{type(error).__name__}: {str(error).split(' [tensorstore_spec=')[0]}"


def flatten(tree: Mapping[str, Any]) -> dict[Path, Any]:
  """A nested state dict's arrays as ``{path: leaf}``.

  Empty mappings and None leaves (no state: a frozen param's in T5X's
  MultiOptimizer layout) hold no array and are dropped; a restore takes
  them from the target's own state dict.

  Example:
    >>> flatten({'state': {'param_states': {'norm': {'scale': None}}, 'step': 1}})
    {('state', 'step'): 1}
  """
  flat = traverse_util.flatten_dict(_state_dict.prune_empty(tree))
  return {path: leaf for path, leaf in flat.items() if leaf is not None}


def saveable(leaf: Any) -> Any:
  """Typed PRNG keys are written as their raw `key_data`."""
  return jax.random.key_data(leaf) if _state_dict.is_prng_key(leaf) else leaf


def as_stored(leaf: Any) -> Any:
  """How `leaf` looks on disk: a key as its `key_data`'s shape and dtype."""
  if not _state_dict.is_prng_key(leaf):
    return leaf
  data = jax.eval_shape(jax.random.key_data, leaf)
  return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=getattr(leaf, "sharding", None))


def _key_impl(dtype: Any) -> str:
  """The name of the PRNG implementation of key dtype `dtype`."""
  for name in ("threefry2x32", "rbg", "unsafe_rbg"):
    if jax.eval_shape(lambda: jax.random.key(0, impl=name)).dtype == dtype:
      return name
  raise ValueError(f"Unknown PRNG key dtype {dtype}.")


def _shape_dtype(leaf: Any) -> tuple[tuple[int, ...], np.dtype]:
  dtype = getattr(leaf, "dtype", None)
  return tuple(np.shape(leaf)), np.dtype(dtype if dtype is not None else np.asarray(leaf).dtype)


def _describe(leaf: Any) -> str:
  shape, dtype = _shape_dtype(leaf)
  return f"{dtype}{list(shape)}"


def _leaf_problem(path: Path, expected: Any, stored: Any) -> str | None:
  """Describes why the stored leaf cannot restore into `expected`, or None.

  `_state_dict.leaf_fit` decides, from the metadata; a stored integer that
  is wider than the target's passes here and has its values checked once
  read (`fit_read`).
  """
  shape, dtype = _shape_dtype(expected)
  stored_shape, stored_dtype = _shape_dtype(stored)
  fit = _state_dict.leaf_fit(stored_shape, stored_dtype, shape, dtype)
  where = key_path_str(path)
  if fit is _state_dict.Fit.OTHER_SHAPE:
    return (
      f"shape mismatch at '{where}': the target has {_describe(expected)}, the "
      f"checkpoint has {_describe(stored)}"
    )
  if fit is _state_dict.Fit.OTHER_DTYPE:
    return (
      f"dtype mismatch at '{where}': the checkpoint's {stored_dtype} cannot be "
      f"cast safely to the target's {dtype}"
    )
  return None


def leaf_problems(expected: Mapping[Path, Any], stored: Mapping[Path, Any]) -> list[str]:
  """Every missing key, unexpected key and shape or dtype mismatch, by path."""
  problems = [
    f"missing key '{key_path_str(path)}' (the target has {_describe(leaf)} there)"
    for path, leaf in expected.items()
    if path not in stored
  ]
  problems += [
    f"unexpected key '{key_path_str(path)}' ({_describe(leaf)})"
    for path, leaf in stored.items()
    if path not in expected
  ]
  for path, leaf in expected.items():
    if path in stored:
      problem = _leaf_problem(path, leaf, stored[path])
      if problem is not None:
        problems.append(problem)
  return problems


SHOWN_PROBLEMS = 8
"""How many problems a refusal lists before it counts the rest."""


def listed(problems: Sequence[str]) -> list[str]:
  """`problems`, at most `SHOWN_PROBLEMS` of them and then a count of the rest by kind: a
  checkpoint of another layout can differ at every leaf, and thousands of characters of
  paths bury what the first few say. Those outside the optimizer state (``'target/...'``,
  ``'flax_mutables/...'``: another model) come first, then shape, dtype and value
  mismatches, then missing and unexpected keys.

  Example:
    >>> listed([f"missing key 'state/{i}' (...)" for i in range(9)] + ["unexpected key 'x'"])
    ... # doctest: +ELLIPSIS
    ["unexpected key 'x'", "missing key 'state/0' (...)", ..., 'and 2 more (2 missing keys)']
  """
  if len(problems) <= SHOWN_PROBLEMS:
    return list(problems)
  ordered = sorted(problems, key=lambda problem: (_in_state(problem), _KINDS.index(_kind(problem))))
  kinds = collections.Counter(_kind(problem) for problem in ordered[SHOWN_PROBLEMS:])
  counted = ", ".join(
    f"{kinds[kind]} {kind}" if kinds[kind] == 1 else f"{kinds[kind]} {_plural(kind)}"
    for kind in _KINDS
    if kind in kinds
  )
  return [*ordered[:SHOWN_PROBLEMS], f"and {len(problems) - SHOWN_PROBLEMS} more ({counted})"]


_KINDS = (
  "shape mismatch",
  "dtype mismatch",
  "value mismatch",
  "missing key",
  "unexpected key",
  "other problem",
)


def _kind(problem: str) -> str:
  lowered = problem.lower()
  return next((kind for kind in _KINDS[:-1] if lowered.startswith(kind)), _KINDS[-1])


def _in_state(problem: str) -> bool:
  """Whether the first path `problem` names is in the optimizer state (``'state/...'``)."""
  quoted = problem.split("'")
  return len(quoted) > 1 and quoted[1].startswith("state/")


def _plural(kind: str) -> str:
  return kind + ("es" if kind.endswith("ch") else "s")


def rounded_floats(expected: Mapping[Path, Any], stored: Mapping[Path, Any]) -> list[str]:
  """Each leaf of `expected` whose stored floats its floating dtype rounds (`leaf_fit`'s
  ``ROUNDS`` or ``IF_IN_RANGE``: float32 data into bfloat16), by path and both dtypes."""
  rounded = []
  for path, leaf in expected.items():
    shape, dtype = _shape_dtype(leaf)
    stored_dtype = _shape_dtype(stored[path])[1]
    fit = _state_dict.leaf_fit(shape, stored_dtype, shape, dtype)
    if fit in (_state_dict.Fit.ROUNDS, _state_dict.Fit.IF_IN_RANGE):
      rounded.append(
        f"'{key_path_str(path)}' ({stored_dtype} in the checkpoint, {dtype} in the state read into)"
      )
  return rounded


@dataclasses.dataclass(frozen=True)
class HostRead:
  """A leaf read onto the host in its stored dtype, checked there before it is placed.

  See `_state_dict.reads_on_host`: integers whose values must fit the
  target's dtype, and dtypes the devices cannot hold.
  """

  shape: tuple[int, ...]
  dtype: np.dtype


def as_read(expected: Any, stored: Any) -> Any:
  """How to read a leaf: in the target's dtype when that cast is exact.

  Otherwise the leaf is read in its stored dtype, so its checksum is
  verified on the data as written, and `fit_read` casts it: a float that
  rounds on its devices, an integer whose values must be checked on the
  host (`HostRead`), before any device could narrow it.
  """
  shape, dtype = _shape_dtype(expected)
  stored_dtype = _shape_dtype(stored)[1]
  if _state_dict.reads_on_host(stored_dtype, dtype):
    return HostRead(shape, stored_dtype)
  if _state_dict.leaf_fit(shape, stored_dtype, shape, dtype) is _state_dict.Fit.EXACT:
    return expected
  return jax.ShapeDtypeStruct(shape, stored_dtype, sharding=getattr(expected, "sharding", None))


@functools.partial(jax.jit, static_argnames="dtype")
def _astype(x: jax.Array, dtype: np.dtype) -> jax.Array:
  return x.astype(dtype)


def place(value: np.ndarray, sharding: jax.sharding.Sharding | None) -> Any:
  """Host data on the devices of `sharding` (each device given its own slice); as is if None."""
  if sharding is None:
    return value
  return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def fit_read(
  read: Mapping[Path, Any], expected: Mapping[Path, Any]
) -> tuple[dict[Path, Any], list[str]]:
  """The leaves read, each in its target dtype, and the values that do not fit it.

  A leaf read onto the host (`HostRead`) is checked there
  (`_state_dict.fit_on_host`), then placed in the target's sharding (kept
  on the host for a target leaf without one). A leaf
  read in another dtype on its devices (`as_read`) is cast there (floats
  only). Returns the cast leaves and a problem per leaf that does not fit.
  """
  cast, problems = {}, []
  for path, leaf in read.items():
    dtype = _shape_dtype(expected[path])[1]
    if isinstance(leaf, np.ndarray | np.generic):
      try:
        value = _state_dict.fit_on_host(leaf, dtype, path)
      except ValueError as e:
        problems.append(str(e))
        continue
      # A host target (numpy) keeps the host data: a device could not hold an int64.
      cast[path] = place(value, getattr(expected[path], "sharding", None))
      continue
    if leaf.dtype == dtype:
      cast[path] = leaf
      continue
    fit = _state_dict.leaf_fit(leaf.shape, leaf.dtype, leaf.shape, dtype)
    if fit.values_decide and not _state_dict.values_fit(leaf, dtype):
      problems.append(
        f"dtype mismatch at '{key_path_str(path)}': the checkpoint's "
        f"{leaf.dtype} values are not all {fit.misfit} the target's {dtype}"
      )
    else:
      cast[path] = _astype(leaf, dtype)
  return cast, problems


def array_key(name: str, *, files: bool = False) -> str:
  r"""The key under which tensorstore keeps the array named `name`: its zarr directory.

  tensorstore's zarr driver appends one ``/`` to an array's name unless it
  ends in one, so ``a`` and ``a/`` name one array; orbax's store (OCDBT)
  keeps that key as it is (``a//b/`` and ``a/b/`` are two). Its ``file``
  store (`files`: `save_t5x_checkpoint`'s arrays) reads ``\`` as ``/``
  first, and refuses a key with an empty, ``.`` or ``..`` part between its
  ``/``s, a part ending in ``.__lock`` (the suffix of its lock files) or a
  NUL.

  Raises:
    ValueError: with `files`, a name the file store refuses, saying why.

  Example:
    >>> array_key('target.a'), array_key('target.a/'), array_key('target.a//b')
    ('target.a/', 'target.a/', 'target.a//b/')
    >>> array_key('target.a\\b', files=True)
    'target.a/b/'
    >>> array_key('target.a//b', files=True)
    Traceback (most recent call last):
    ...
    ValueError: tensorstore's file store refuses the name 'target.a//b', which has an empty part
  """
  key = name.replace("\\", "/") if files else name
  key = key if key.endswith("/") else f"{key}/"
  if not files:
    return key
  for part in key[:-1].split("/"):
    if part in ("", ".", ".."):
      why = f"a part {part!r}" if part else "an empty part"
    elif part.endswith(".__lock"):
      why = "a part ending in '.__lock'"
    elif "\0" in part:
      why = "a NUL"
    else:
      continue
    raise ValueError(f"tensorstore's file store refuses the name {name!r}, which has {why}")
  return key


def shared_names(arrays: Mapping[Path, Any]) -> list[str]:
  """The pairs of paths that would share a name on disk, each said once.

  orbax names an array by its keys joined with ``.``, kept under its
  `array_key`, and a checksum is recorded under the path joined with ``/``:
  ``('a.b',)`` and ``('a', 'b')``, or ``('a',)`` and ``('a/',)``, would be
  written to one array, ``('a/b',)`` and ``('a', 'b')`` would share one
  checksum.

  Example:
    >>> shared_names({('a.b',): 1, ('a', 'b'): 2, ('c',): 3, ('c/',): 4})
    ["the paths ('a.b',) and ('a', 'b') would share the array file a.b", "the paths ('c',) and ('c/',) would share the array file c"]
  """
  names_of = {"array file": lambda path: array_key(".".join(path))[:-1], "checksum": "/".join}
  problems = []
  for what, join in names_of.items():
    seen: dict[str, Path] = {}
    for path in arrays:
      name = join(path)
      if name in seen:
        problems.append(f"the paths {seen[name]} and {path} would share the {what} {name}")
      seen.setdefault(name, path)
  return problems


def zero_size_record(arrays: Mapping[Path, Any]) -> dict[str, Any]:
  """The path, shape and dtype of each zero-size array in `arrays`, as JSON.

  orbax refuses to write an array without elements (a layer of width 0), and
  there is nothing to write but its shape and dtype: `Checkpointer` records
  them here, next to the arrays it writes.

  Example:
    >>> import jax.numpy as jnp
    >>> zero_size_record({('w',): jnp.ones(2), ('b',): jnp.zeros((0, 3), jnp.bfloat16)})
    {'arrays': [{'path': ['b'], 'shape': [0, 3], 'dtype': 'bfloat16'}]}
  """
  return {
    "arrays": [
      {"path": list(path), "shape": list(shape), "dtype": dtype.name}
      for path, (shape, dtype) in ((p, _shape_dtype(x)) for p, x in arrays.items())
      if 0 in shape
    ]
  }


def zero_size_stored(record: Mapping[str, Any]) -> dict[Path, jax.ShapeDtypeStruct]:
  """The arrays of a `zero_size_record`, as stored arrays (what `open_stored` gives).

  Raises:
    ValueError: the record is not one `zero_size_record` writes.
  """
  stored = {}
  for entry in record["arrays"]:
    shape = tuple(int(n) for n in entry["shape"])
    if 0 not in shape:
      raise ValueError(f"the array at {entry['path']} has shape {list(shape)}, with elements")
    path = tuple(str(key) for key in entry["path"])
    stored[path] = jax.ShapeDtypeStruct(shape, jax.numpy.dtype(entry["dtype"]))
  return stored


def empty_leaf(expected: Any) -> Any:
  """A zero-size leaf as the target `expected` has it: its shape, dtype and sharding."""
  shape, dtype = _shape_dtype(expected)
  return jax.device_put(np.zeros(shape, dtype), _abstract_leaf(expected).sharding)


def _abstract_leaf(leaf: Any) -> jax.ShapeDtypeStruct:
  """What orbax restores `leaf` as: its shape, dtype and sharding.

  A leaf without a sharding (a numpy array or Python scalar) is read onto
  this process's first device.
  """
  shape, dtype = _shape_dtype(leaf)
  sharding = getattr(leaf, "sharding", None)
  if sharding is None:
    sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def orbax_restore_args(expected: Mapping[Path, Any]) -> tuple[dict[str, Any], Any]:
  """The orbax restore target (abstract arrays) and its per-leaf restore args.

  A `HostRead` leaf is read as a numpy array in its stored dtype.
  """
  abstract, args = {}, {}
  for path, leaf in expected.items():
    if isinstance(leaf, HostRead):
      abstract[path] = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
      args[path] = ocp.RestoreArgs(restore_type=np.ndarray, dtype=leaf.dtype)
    else:
      abstract[path] = _abstract_leaf(leaf)
      args[path] = ocp.checkpoint_utils.construct_restore_args(abstract[path])
  return traverse_util.unflatten_dict(abstract), traverse_util.unflatten_dict(args)


def _is_state_class(node: Any) -> bool:
  """Whether `node` is a pytree node of its own class (a NamedTuple, a dataclass, ...)."""
  if type(node) in (dict, list, tuple, FrozenDict) or node is None:
    return False
  return not jax.tree_util.treedef_is_leaf(jax.tree.structure(node))


def state_classes(param_states: Any) -> dict[str, str]:
  """The class of every state node of an optimizer state, by its '/'-joined path.

  Checkpoints record it: optimizers whose states have the same keys (adam's
  and adabelief's ``mu`` and ``nu``) differ in these classes. Plain
  containers (dicts, lists, tuples) and nodes without leaves (optax's
  `EmptyState`) are not recorded. A state over a flax NNX state is taken
  in its pure form (the values its Variables store, see `_nnx.to_pure`): its
  ``nnx.State`` and ``nnx.Variable`` nodes are not recorded, so the same
  optimizer over an ``nnx.State`` and over its pure dict records the same
  classes, whatever the class of each param's ``nnx.Variable``.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> state_classes(optax.adam(0.1).init({'w': jnp.ones(2)}))
    {'0': 'ScaleByAdamState'}
  """
  found: dict[str, str] = {}

  def walk(node: Any, prefix: tuple[str, ...]) -> None:
    children, _ = jax.tree.flatten_with_path(
      node, is_leaf=lambda x: x is not node and _is_state_class(x)
    )
    for path, child in children:
      if _is_state_class(child):
        where = (*prefix, *_state_dict.key_path_parts(path))
        found["/".join(where)] = type(child).__qualname__
        walk(child, where)

  pure = to_pure(param_states)
  if _is_state_class(pure):
    found[""] = type(pure).__qualname__
  walk(pure, ())
  return found


def optimizer_state_classes(state: Any) -> dict[str, str] | None:
  """`state_classes` of a `TrainState`'s or `Optimizer`'s optimizer state; None for other states.

  Example:
    >>> import jax.numpy as jnp
    >>> from t5x_optim import optimizers
    >>> optimizer_state_classes(optimizers.adam(0.1).create({'w': jnp.ones(2)}))
    {'0': 'ScaleByAdamState'}
  """
  if isinstance(state, TrainState):
    state = state.optimizer
  if not isinstance(state, Optimizer):
    return None
  return state_classes(state.state.param_states)


def class_problems(recorded: Mapping[str, str], target: Mapping[str, str]) -> list[str]:
  """Where the same state path holds another class in the checkpoint than in the target.

  Paths only one side has are not compared (a stacked layout's buffers
  restore into per-leaf params; their keys are checked on their own).
  Earlier versions recorded the NNX nodes of a state over an ``nnx.State``
  too: an ``nnx.Variable`` at a path, the class it holds at that path's
  ``value`` (``'0/mu/w': 'Param'``, ``'0/mu/w/value': 'QuantizedLeaf'``).
  Where `target` has no such ``value`` path, the class below the Variable is
  taken for the path's (`without_nnx_nodes`).

  Example:
    >>> class_problems({'0': 'ScaleByAdamState'}, {'0': 'ScaleByBeliefState'})
    ["state class mismatch at 'state/param_states/0': the checkpoint was written by an optimizer whose state has a ScaleByAdamState there, the target's has a ScaleByBeliefState"]
  """
  recorded = without_nnx_nodes(recorded, target)
  return [
    f"state class mismatch at '{'/'.join(('state', 'param_states', path)).rstrip('/')}': the "
    f"checkpoint was written by an optimizer whose state has a {recorded[path]} there, the "
    f"target's has a {target[path]}"
    for path in sorted(set(recorded) & set(target))
    if recorded[path] != target[path]
  ]


def without_nnx_nodes(recorded: Mapping[str, str], target: Mapping[str, str]) -> dict[str, str]:
  """`recorded` with the ``nnx.Variable`` nodes an earlier version recorded taken out.

  A Variable is a recorded path whose ``value`` below it is recorded and is
  not a path of `target`; the class it holds moves up to its path.

  Example:
    >>> without_nnx_nodes({'0/w': 'Param', '0/w/value': 'QuantizedLeaf'}, {'0/w': 'QuantizedLeaf'})
    {'0/w': 'QuantizedLeaf'}
  """
  variables = {
    path for path in recorded if f"{path}/value" in recorded and f"{path}/value" not in target
  }
  pure = {}
  for path, name in recorded.items():
    if path in variables:
      continue
    parts = path.split("/")
    kept = (
      part
      for i, part in enumerate(parts)
      if part != "value" or "/".join(parts[:i]) not in variables
    )
    pure["/".join(kept)] = name
  return pure


def rewrap_keys(restored: Mapping[Path, Any], target: Mapping[Path, Any]) -> dict[Path, Any]:
  """Turns the `key_data` read for the target's typed PRNG keys back into keys."""
  return {
    path: jax.random.wrap_key_data(leaf, impl=_key_impl(target[path].dtype))
    if _state_dict.is_prng_key(target[path])
    else leaf
    for path, leaf in restored.items()
  }
