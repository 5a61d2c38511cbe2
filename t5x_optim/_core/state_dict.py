"""T5X-layout state dicts: empty-node pruning, validation and restoration.

A state dict is what `flax.serialization.to_state_dict` makes of a pytree:
nested dicts with string keys (tuples and lists keyed ``'0'``, ``'1'``, ...,
NamedTuples by field name) and arrays at the leaves. T5X writes optimizer
states with every empty container removed (``optax.EmptyState()`` leaves no
key); restoring puts the empty nodes back from the reference structure.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from flax import serialization, traverse_util
from jax.sharding import PartitionSpec

from t5x_optim._keypaths import key_path_str
from t5x_optim._nnx import restore_like, to_pure
from t5x_optim._warn import warn

__all__ = [
  "Fit",
  "build_state_dict",
  "fit_on_host",
  "holds_no_data",
  "is_prng_key",
  "key_path_parts",
  "key_path_str",
  "leaf_fit",
  "optimizer_part",
  "prune_empty",
  "range_problem",
  "reads_on_host",
  "restore_into",
  "restore_state_dict",
  "to_pruned_state_dict",
  "values_fit",
]


def prune_empty(tree: Any) -> Any:
  """Returns `tree` with every empty (or empty-only) mapping removed.

  Example:
    >>> prune_empty({'0': {'count': 1}, '1': {}, '2': {'a': {}}})
    {'0': {'count': 1}}
  """
  if not isinstance(tree, Mapping):
    return tree
  pruned = {}
  for key, value in tree.items():
    value = prune_empty(value)
    if isinstance(value, Mapping) and not value:
      continue
    pruned[key] = value
  return pruned


def to_pruned_state_dict(tree: Any) -> Any:
  """`flax.serialization.to_state_dict` with empty containers removed, a flax
  ``nnx.State`` or ``nnx.Variable`` written as the values its Variables store (keyed as
  ``nnx.to_pure_dict``), not those a ``get_value`` override reads back."""
  return prune_empty(serialization.to_state_dict(to_pure(tree)))


def _is_empty(tree: Any) -> bool:
  return tree is traverse_util.empty_node or (isinstance(tree, Mapping) and not prune_empty(tree))


def holds_no_data(tree: Any) -> bool:
  """Whether `tree` holds no array: None, an empty node, or mappings of only those.

  A frozen param's state in T5X's MultiOptimizer layout is such a subtree
  (``{'scale': None}``): checkpoints write no array for it, and a restore
  takes it from the optimizer's own state dict when it is absent.

  Example:
    >>> holds_no_data({'norm': {'scale': None}, 'empty': {}}), holds_no_data({'a': 0})
    (True, False)
  """
  if tree is None or tree is traverse_util.empty_node:
    return True
  return isinstance(tree, Mapping) and all(holds_no_data(value) for value in tree.values())


def key_path_parts(path: Sequence[Any]) -> tuple[str, ...]:
  """A jax key path as the tuple of its keys as strings, as state dicts name them.

  The keys are written as `key_path_str` writes them.

  Example:
    >>> key_path_parts(jax.tree.flatten_with_path({"a": [1]})[0][0][0])
    ('a', '0')
  """
  return tuple(jax.tree_util.keystr((key,), simple=True) for key in path)


def _is_array(value: Any) -> bool:
  """Whether `value` is concrete array data (numpy, jax or a Python number)."""
  return isinstance(value, np.ndarray | np.generic | jax.Array | bool | int | float | complex)


def _is_lazy_array(value: Any) -> bool:
  """A lazily read array (T5X's `LazyArray`), recognised by its interface."""
  return (
    callable(getattr(value, "get_async", None))
    and hasattr(value, "shape")
    and hasattr(value, "dtype")
  )


def _is_placeholder(value: Any) -> bool:
  """Whether `value` stands where an array goes without being array data.

  T5X fills state dicts with these and restores them as a tree replace: None
  (replicated, or absent from a checkpoint), logical or mesh
  `PartitionSpec`s, shardings, `jax.ShapeDtypeStruct`s and lazily read arrays.

  Example:
    >>> from jax.sharding import PartitionSpec
    >>> _is_placeholder(None), _is_placeholder(PartitionSpec("embed")), _is_placeholder(1.0)
    (True, True, False)
  """
  return (
    value is None
    or isinstance(value, PartitionSpec | jax.sharding.Sharding | jax.ShapeDtypeStruct)
    or _is_lazy_array(value)
  )


def _is_masked(node: Any) -> bool:
  return isinstance(node, optax.MaskedNode)


def _shape_of(value: Any) -> tuple[int, ...] | None:
  """The shape of an array, abstract array or lazy array; None for metadata."""
  if _is_array(value):
    return np.shape(value)
  if isinstance(value, jax.ShapeDtypeStruct) or _is_lazy_array(value):
    return tuple(value.shape)
  return None


def _describe(value: Any) -> str:
  if value is None:
    return "None"
  if isinstance(value, Mapping):
    return f"a subtree with keys {sorted(value)}"
  if isinstance(value, PartitionSpec):
    return f"the spec {value!r}"
  shape = _shape_of(value)
  if shape is None:
    return f"a {type(value).__name__}"
  return f"shape {shape} dtype {_dtype_of(value)}"


def _dtype_of(value: Any) -> np.dtype:
  dtype = getattr(value, "dtype", None)
  return np.dtype(dtype) if dtype is not None else np.asarray(value).dtype


class Fit(enum.Enum):
  """Whether stored data of one shape and dtype may restore into an array leaf.

  `leaf_fit` decides it; `restore_into` (so `Optimizer.restore_state`) and
  `t5x_optim.checkpoints.Checkpointer.restore` both follow it.
  """

  EXACT = "exact"
  """Same shape; the same dtype or one numpy casts to "safely" (every value exactly)."""
  ROUNDS = "rounds"
  """Same shape; floating data into another floating dtype whose largest
  finite value is at least the data's dtype's (float16 into bfloat16):
  allowed, and may round, as T5X casts params to its ``restore_dtype``."""
  IF_IN_RANGE = "if_in_range"
  """Same shape; floating data into a floating dtype whose largest finite
  value is smaller (float32 into float16, a float8 type or bfloat16, whose
  largest is 3.39e38 to float32's 3.40e38): allowed only when every finite
  value is within the target's range (`values_fit`), since a cast would
  turn the others into infinities."""
  IF_VALUES_FIT = "if_values_fit"
  """Same shape; integer data into a narrower integer dtype, or floating
  data into an integer dtype: allowed only when every value is a whole
  number in the integer dtype's range (`values_fit`), which needs the data.
  T5X's orbax checkpointer casts every restored array, step counters
  included, to its ``save_dtype`` (float32), so a step comes back as
  ``3.0`` and restores as the integer 3."""
  OTHER_DTYPE = "other_dtype"
  """Same shape; a change of kind that no value survives unchanged (complex
  to real, integer to bool, an integer to a floating dtype that cannot hold
  it exactly): refused."""
  OTHER_SHAPE = "other_shape"
  """Another shape: refused."""

  @property
  def values_decide(self) -> bool:
    """Whether the data's values decide (`values_fit`): `IF_VALUES_FIT` and `IF_IN_RANGE`."""
    return self in (Fit.IF_VALUES_FIT, Fit.IF_IN_RANGE)

  @property
  def misfit(self) -> str:
    """How values that `values_fit` refused miss the target's dtype, said before it."""
    return "whole numbers within" if self is Fit.IF_VALUES_FIT else "within the range of"


def _is_float(dtype: np.dtype) -> bool:
  return bool(jax.dtypes.issubdtype(dtype, np.floating))


def _is_int(dtype: np.dtype) -> bool:
  return bool(jax.dtypes.issubdtype(dtype, np.integer))


def leaf_fit(shape: Sequence[int], dtype: Any, ref_shape: Sequence[int], ref_dtype: Any) -> Fit:
  """Whether data of `shape` and `dtype` may restore into a leaf of `ref_shape`, `ref_dtype`.

  The one rule for every restore (state dicts and checkpoints alike). It
  follows T5X: floating data restores into any floating dtype (T5X casts
  params to ``restore_dtype``; optimizer-state leaves keep their own
  dtype, so stored data is cast to it), when every finite value is within
  the target's range if its largest finite value is smaller; an integer restores into a
  narrower integer, and floating data into an integer (a step counter
  that T5X's checkpointer saved as float32), only when every value is a
  whole number that fits; any other change of kind is refused, so a
  restore never silently changes what a value means.

  Example:
    >>> import numpy as np, jax.numpy as jnp
    >>> [leaf_fit((2,), src, (2,), dst).name for src, dst in [
    ...   (np.float16, jnp.bfloat16), (np.int32, np.int8), (np.float32, np.int32),
    ...   (np.complex64, np.float32)]]
    ['ROUNDS', 'IF_VALUES_FIT', 'IF_VALUES_FIT', 'OTHER_DTYPE']
    >>> [leaf_fit((2,), np.float32, (2,), dst).name for dst in (np.float16, jnp.bfloat16)]
    ['IF_IN_RANGE', 'IF_IN_RANGE']
  """
  if tuple(shape) != tuple(ref_shape):
    return Fit.OTHER_SHAPE
  src, dst = np.dtype(dtype), np.dtype(ref_dtype)
  if src == dst or np.can_cast(src, dst, casting="safe"):
    return Fit.EXACT
  if _is_float(src) and _is_float(dst):
    if jax.numpy.finfo(dst).max < jax.numpy.finfo(src).max:
      return Fit.IF_IN_RANGE
    return Fit.ROUNDS
  if _is_int(dst) and (_is_int(src) or _is_float(src)):
    return Fit.IF_VALUES_FIT
  return Fit.OTHER_DTYPE


def values_fit(value: Any, dtype: Any) -> bool:
  """Whether every value of `value` is a whole number in integer `dtype`'s range.

  `value` is integer or floating data; a floating value fits when it is
  finite and integral (``3.0`` fits int8, ``3.5``, ``nan`` and ``inf`` do
  not). For a floating `dtype`, every finite value must be within its
  range (a non-finite one stays what it is). A `jax.Array` is reduced where
  its shards live (so this also works for arrays spread over several
  processes); other data on the host.

  Example:
    >>> import numpy as np
    >>> values_fit(np.array([1, 127]), np.int8), values_fit(np.array([128]), np.int8)
    (True, False)
    >>> values_fit(np.float32(3.0), np.int32), values_fit(np.array([0.0, 1.5]), np.int32)
    (True, False)
    >>> values_fit(np.array([np.inf, 65510.0]), np.float16), values_fit(np.array([65520.0]), np.float16)
    (True, False)
  """
  if np.size(value) == 0:
    return True
  xp = jax.numpy if isinstance(value, jax.Array) else np
  if _is_float(np.dtype(dtype)):
    return _largest_finite(value) < _rounds_within(dtype)
  info = jax.numpy.iinfo(dtype)
  if _is_float(_dtype_of(value)):
    finite = xp.isfinite(value)
    if not bool(xp.all(finite)) or not bool(xp.all(xp.floor(value) == value)):
      return False
  return info.min <= int(xp.min(value)) and int(xp.max(value)) <= info.max


def reads_on_host(stored_dtype: Any, ref_dtype: Any) -> bool:
  """Whether stored data must be checked on the host before it goes to a device.

  Integer data whose values decide whether it restores (`Fit.IF_VALUES_FIT`),
  and any dtype the devices cannot hold (int64 without ``jax_enable_x64``):
  placing such data on a device first would narrow it silently (``2**32 + 3``
  becomes 3), so every restore reads it on the host and checks it there
  (`fit_on_host`).

  Example:
    >>> import numpy as np
    >>> reads_on_host(np.int64, np.int32), reads_on_host(np.float32, np.float32)
    (True, False)
  """
  src = np.dtype(stored_dtype)
  if jax.dtypes.canonicalize_dtype(src) != src:
    return True
  return leaf_fit((), src, (), ref_dtype) is Fit.IF_VALUES_FIT


def _largest_finite(value: Any) -> float:
  """The largest magnitude among `value`'s finite values (0 for none), reduced where it lives."""
  xp = jax.numpy if isinstance(value, jax.Array) else np
  return float(xp.max(xp.where(xp.isfinite(value), xp.abs(value), 0)))


def _rounds_within(dtype: Any) -> float:
  """The magnitude from which a value rounds beyond floating `dtype`'s largest finite value
  (half an ulp above it: to inf, or NaN in a float8 type without inf)."""
  info = jax.numpy.finfo(dtype)
  return float(info.max) + float(info.eps) * 2.0 ** (info.maxexp - 1) / 2


def range_problem(value: Any, dtype: Any) -> str | None:
  """Why casting floating `value` to a floating `dtype` of narrower range would overflow it,
  or None (a cast that fits, of other kinds, or of traced values, which hold no numbers).

  Example:
    >>> import numpy as np
    >>> range_problem(np.array([1.0, 7e4], np.float32), np.float16)
    "values up to 7e+04, beyond float16's largest, 6.55e+04"
    >>> range_problem(np.array([1.0, np.inf], np.float32), np.float16) is None
    True
  """
  src = _dtype_of(value)
  if leaf_fit((), src, (), dtype) is not Fit.IF_IN_RANGE or isinstance(value, jax.core.Tracer):
    return None
  largest = _largest_finite(value) if np.size(value) else 0.0
  if largest < _rounds_within(dtype):
    return None
  top = float(jax.numpy.finfo(dtype).max)
  return f"values up to {largest:.3g}, beyond {np.dtype(dtype)}'s largest, {top:.3g}"


def fit_on_host(value: Any, ref_dtype: Any, path: Sequence[str]) -> np.ndarray:
  """Host data `value` checked against a leaf of dtype `ref_dtype`, cast where the rule says.

  `leaf_fit`'s rule, applied before any device sees the data: integer or
  floating data restores into an integer dtype only when every value is a
  whole number in its range (and is then cast to it); other data is
  returned unchanged (a float is cast where it is placed, as before).

  Raises:
    ValueError: naming the path, the stored dtype and range and the target
      dtype, when a value does not fit, or the kind may not change (the
      message is a clause, for callers that list several).

  Example:
    >>> import numpy as np
    >>> fit_on_host(np.array([3], np.int64), np.int32, ('state', 'step')).dtype
    dtype('int32')
    >>> fit_on_host(np.array([2**32 + 3]), np.int32, ('state', 'step'))
    Traceback (most recent call last):
    ...
    ValueError: Value mismatch at 'state/step': the stored int64 values (from 4294967299 to 4294967299) are not all whole numbers within the target's int32
  """
  value = np.asarray(value)
  fit = leaf_fit(value.shape, value.dtype, value.shape, ref_dtype)
  where = key_path_str(tuple(path))
  if fit is Fit.OTHER_DTYPE:
    raise ValueError(
      f"Dtype mismatch at '{where}': the stored {value.dtype} cannot be cast safely to the "
      f"target's {np.dtype(ref_dtype)}"
    )
  if not fit.values_decide:
    return value
  if not values_fit(value, ref_dtype):
    span = f" (from {value.min()} to {value.max()})" if value.size else ""
    raise ValueError(
      f"Value mismatch at '{where}': the stored {value.dtype} values{span} are not all "
      f"{fit.misfit} the target's {np.dtype(ref_dtype)}"
    )
  return value.astype(ref_dtype) if fit is Fit.IF_VALUES_FIT else value


def _castable(value: Any, fit: Fit, dst: np.dtype) -> bool:
  """Whether `value`, whose dtype fits `dst` as `fit` says, may restore into `dst`.

  `leaf_fit`'s rule; a Python scalar may also change kind when it converts
  exactly (T5X state dicts may hold a plain ``int`` step, for instance).
  """
  if fit.values_decide:
    return values_fit(value, dst)
  if fit is Fit.OTHER_DTYPE:
    return (
      isinstance(value, bool | int | float | complex)
      and _as_python_number(np.asarray(value).astype(dst)) == value
    )
  return True


def _as_python_number(value: np.ndarray) -> bool | int | float | complex:
  """The Python number a 0-d array holds (ml_dtypes' scalars read as a float), compared exactly
  with another Python number where numpy would first cast the other to the array's dtype."""
  item = value.item()
  return item if isinstance(item, bool | int | float | complex) else float(item)


def is_prng_key(value: Any) -> bool:
  """Whether `value` (an array or `jax.ShapeDtypeStruct`) holds typed PRNG keys."""
  dtype = getattr(value, "dtype", None)
  return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _convert_key(reference: Any, value: Any, where: str) -> jax.Array:
  """Restores a typed PRNG key from a key array or its raw `key_data`."""
  if not is_prng_key(value):
    if not isinstance(reference, jax.Array):
      raise ValueError(
        f"State dict mismatch at '{where}': the optimizer has an abstract PRNG "
        f"key of dtype {reference.dtype}; restore it from a typed key array."
      )
    data_shape = jax.eval_shape(jax.random.key_data, reference).shape
    if np.shape(value) != data_shape:
      raise ValueError(
        f"Shape mismatch at '{where}': the optimizer's PRNG key data has shape "
        f"{data_shape}, the state dict has shape {np.shape(value)}."
      )
    value = jax.random.wrap_key_data(_key_data(value, where), impl=jax.random.key_impl(reference))
  if value.dtype != reference.dtype or value.shape != reference.shape:
    raise ValueError(
      f"PRNG key mismatch at '{where}': the optimizer has {reference.dtype} "
      f"{reference.shape}, the state dict has {value.dtype} {value.shape}."
    )
  return _placed_like(reference, value)


def _key_data(value: Any, where: str) -> np.ndarray:
  """Raw PRNG key data `value` as uint32, refused unless it holds integers that fit exactly
  (key bits stored as floats may have rounded, and wider integers would wrap)."""
  data = np.asarray(value)
  if not _is_int(data.dtype) or not values_fit(data, np.uint32):
    span = f", from {data.min()} to {data.max()}" if data.size and data.dtype.kind in "iuf" else ""
    raise ValueError(
      f"Dtype mismatch at '{where}': PRNG key data restores from integers within uint32; the "
      f"state dict has {data.dtype}{span}."
    )
  return data.astype(np.uint32)


def _device_array(value: Any, dtype: Any) -> jax.Array:
  """`value` as a jax array of `dtype`: a jax array as it is where it has the dtype; host data
  copied on the host before it goes to a device, since jax on CPU may take an aligned numpy
  array's memory as its own, which the caller may go on to refill."""
  if isinstance(value, jax.Array):
    return jax.numpy.asarray(value, dtype=dtype)
  return jax.numpy.asarray(np.array(value, copy=True), dtype=dtype)


def _placed_like(reference: Any, value: jax.Array) -> jax.Array:
  """`value` on `reference`'s sharding; on its device but not committed to it when neither is
  committed (a step jitted for the reference then takes it without compiling again)."""
  sharding = getattr(reference, "sharding", None)
  if sharding is None:
    return value
  if getattr(reference, "committed", True) or getattr(value, "committed", False):
    return jax.device_put(value, sharding)
  if value.devices() == reference.devices():
    return value
  with jax.default_device(next(iter(reference.devices()))):
    return jax.numpy.array(value)  # An uncommitted array moves to the default device.


_LISTED = 4
"""How many leaves a warning of narrowed data names of each kind before counting the rest."""


class _Narrowed(NamedTuple):
  """Data that a restore took and that may have been rounded before it (`_narrowing`)."""

  note: str
  """The leaf's path and what it got, as the warning names it."""
  dtype: np.dtype
  """The data's floating dtype."""
  integer: bool
  """Whether the leaf is an integer (else floating) one."""


def _whole_up_to(dtype: np.dtype) -> int:
  """The whole number up to which floating `dtype` holds every whole number exactly (256 for
  bfloat16, 2048 for float16): the next one rounds to it or beyond."""
  return 2 ** (int(jax.numpy.finfo(dtype).nmant) + 1)


def _narrowing(
  value: Any, dtype: np.dtype, ref_dtype: np.dtype, path: tuple[str, ...]
) -> _Narrowed | None:
  """Whether data `value` of `dtype`, taken into a leaf of `ref_dtype` at `path`, may have
  been rounded before the restore: whole floats into an integer leaf, from the first whole
  number that their dtype may have rounded another to (`_whole_up_to`); optimizer-state data
  of a floating dtype that cannot hold every value of the leaf's (bfloat16 into float32).
  Params are left out: they keep the dtype they are given, on purpose."""
  if not _is_float(dtype) or isinstance(value, jax.core.Tracer) or np.size(value) == 0:
    return None
  where = key_path_str(path)
  if _is_int(ref_dtype):
    largest = _largest_finite(value)
    if largest < _whole_up_to(dtype):
      return None
    shown = f"{largest:.0f}" if np.size(value) == 1 else f"up to {largest:.0f}"
    return _Narrowed(f"{where} ({dtype} {shown})", dtype, integer=True)
  if path[:1] == ("state",) and not np.can_cast(ref_dtype, dtype, casting="safe"):
    return _Narrowed(f"{where} ({dtype} into {ref_dtype})", dtype, integer=False)
  return None


def _warn_of_narrowed(narrowed: Sequence[_Narrowed]) -> None:
  """Warns once of the data a restore took that may have been rounded before it, naming the
  first few leaves of each kind (`_narrowing`)."""

  def named(integer: bool) -> str:
    notes = [each.note for each in narrowed if each.integer is integer]
    more = len(notes) - _LISTED
    return ", ".join(notes[:_LISTED]) + (f" and {more} more" if more > 0 else "")

  kinds = []
  integers = sorted({each.dtype for each in narrowed if each.integer}, key=str)
  if integers:
    holds = ", ".join(
      f"{dtype} holds every whole number only up to {(n := _whole_up_to(dtype))}, to which it "
      f"rounds {n + 1}"
      for dtype in integers
    )
    kinds.append(f"integer leaves from whole floats ({holds}): {named(True)}")
  floats = any(not each.integer for each in narrowed)
  if floats:
    kinds.append(f"optimizer-state leaves from a narrower floating dtype: {named(False)}")
  advice = (
    " Where the config sets such a leaf (Muon's ns_coeffs, inject_hyperparams' "
    "hyper-parameters), t5x_optim.reapply_config(optimizer) sets the config's values again."
    if floats
    else ""
  )
  warn(
    f"The restore took {'; and '.join(kinds)}. Their values may have been rounded before the "
    "restore, e.g. by T5X's RestoreCheckpointConfig.dtype, which casts the arrays it has no "
    "partitioning for (the step, counters and hyper-parameters), as it does for T5X's own "
    f"optimizers; they are taken as they are.{advice}"
  )


def _convert_array(
  reference: Any, value: Any, path: tuple[str, ...], *, narrowed: list[_Narrowed]
) -> Any:
  """Checks array data `value` against the array `reference` and converts it.

  The dtype rule is `leaf_fit`'s: floating data may restore into any
  floating dtype (params under ``target`` keep the state dict's dtype,
  because T5X's checkpointer casts them on purpose with ``restore_dtype``;
  optimizer-state arrays are cast to the state's own dtype); an integer
  into a narrower integer, or a float into an integer, only when every
  value is a whole number that fits (it comes back in the optimizer's
  integer dtype); no other change of kind, except for a Python scalar
  that converts exactly. Data that may have been rounded before the restore
  (`_narrowing`) is noted in `narrowed`.
  """
  where = key_path_str(path)
  if is_prng_key(reference):
    return _convert_key(reference, value, where)
  ref_shape, ref_dtype = _shape_of(reference), _dtype_of(reference)
  shape, dtype = np.shape(value), _dtype_of(value)
  fit = leaf_fit(shape, dtype, ref_shape, ref_dtype)
  if fit is Fit.OTHER_SHAPE:
    raise ValueError(
      f"Shape mismatch at '{where}': the optimizer has shape {ref_shape}, the "
      f"state dict has shape {shape}."
    )
  floats = _is_float(dtype) and _is_float(ref_dtype)
  keeps_dtype = floats and path[:1] == ("target",) and hasattr(value, "dtype")
  if not keeps_dtype and not _castable(value, fit, ref_dtype):
    why = {
      Fit.IF_VALUES_FIT: " (not every value is a whole number in its range)",
      Fit.IF_IN_RANGE: " (a finite value is beyond its range and would not stay finite)",
    }.get(fit, "")
    raise ValueError(
      f"Dtype mismatch at '{where}': the state dict has {dtype}, which cannot "
      f"be cast safely to the optimizer's {ref_dtype}{why}."
    )
  out_dtype = dtype if keeps_dtype else ref_dtype
  on_devices = isinstance(reference, jax.Array | jax.ShapeDtypeStruct)
  held = jax.dtypes.canonicalize_dtype(out_dtype) if on_devices else out_dtype
  if keeps_dtype and held != out_dtype and not values_fit(value, held):
    # The devices hold 64-bit data in 32 bits (jax_enable_x64 off): a value beyond float32's
    # range would come back inf, without a word.
    raise ValueError(
      f"Dtype mismatch at '{where}': the state dict has {dtype}, which the devices hold as "
      f"{held} (jax_enable_x64 is off), and a finite value is beyond its range and would not "
      "stay finite."
    )
  note = None if keeps_dtype else _narrowing(value, dtype, ref_dtype, path)
  if note is not None:
    narrowed.append(note)
  if isinstance(reference, np.ndarray | np.generic) or _is_lazy_array(reference):
    return np.asarray(value, dtype=out_dtype)
  if isinstance(reference, jax.Array | jax.ShapeDtypeStruct):
    return _placed_like(reference, _device_array(value, out_dtype))
  return type(reference)(np.asarray(value).item())


def _convert_leaf(
  reference: Any, value: Any, path: tuple[str, ...], *, narrowed: list[_Narrowed]
) -> Any:
  """Returns `value` for the reference leaf `reference`, checked.

  Array data restored into an array is checked (`_convert_array`); a
  placeholder (`_is_placeholder`) is placed as given, after a shape check
  where both sides have one; array data restored into a spec or sharding (a
  tree replace of specs) is placed as given. Anything else, array data where
  the optimizer has no state (None) included, is an error.
  """
  where = key_path_str(path)
  if reference is None and _is_empty(value):
    return None
  if _is_placeholder(value):
    ref_shape, shape = _shape_of(reference), _shape_of(value)
    if ref_shape is not None and shape is not None and ref_shape != shape:
      raise ValueError(
        f"Shape mismatch at '{where}': the optimizer has shape {ref_shape}, the "
        f"state dict has {_describe(value)}."
      )
    return value
  if reference is None or not _is_array(value):
    expected = "None (no state)" if reference is None else _describe(reference)
    if _shape_of(reference) is not None:
      expected = f"an array with {expected}"
    raise ValueError(
      f"State dict mismatch at '{where}': expected {expected}, got {_describe(value)}."
    )
  if _shape_of(reference) is None:
    return value
  return _convert_array(reference, value, path, narrowed=narrowed)


def _check_and_fill(
  reference: Any,
  given: Any,
  path: tuple[str, ...],
  *,
  holes: frozenset[tuple[str, ...]],
  problems: list[str],
  narrowed: list[_Narrowed],
) -> Any:
  """Checks `given` against the full `reference` state dict, adding mismatches to `problems`
  and data that may have been rounded before the restore to `narrowed` (`_narrowing`).

  Keys whose reference subtree is empty may be absent from `given` (T5X drops
  them) and are taken from the reference; keys of `given` that hold nothing
  (empty subtrees, `traverse_util.empty_node`, None) may be extra. `holes`
  are the paths where the reference holds an ``optax.MaskedNode``.
  """
  if given is traverse_util.empty_node:
    given = {}
  if path in holes and not holds_no_data(given):
    these = "these params" if isinstance(given, Mapping) else "this param"
    problems.append(
      f"State dict mismatch at '{key_path_str(path)}': the optimizer's mask leaves {these} out "
      f"(its state there is a MaskedNode), the state dict has {_describe(given)}."
    )
    return reference
  if not isinstance(reference, Mapping):
    try:
      return _convert_leaf(reference, given, path, narrowed=narrowed)
    except ValueError as e:
      problems.append(str(e))
      return reference
  if not isinstance(given, Mapping):
    if not (given is None and holds_no_data(reference)):
      problems.append(
        f"State dict mismatch at '{key_path_str(path)}': expected "
        f"{_describe(prune_empty(reference))}, got {_describe(given)}."
      )
    return reference
  unexpected = sorted(
    str(key) for key, value in given.items() if key not in reference and not holds_no_data(value)
  )
  if unexpected:
    problems.append(
      f"Unexpected keys {unexpected} at '{key_path_str(path)}' in the state dict; the "
      f"optimizer has keys {sorted(prune_empty(reference))} there."
    )
  filled = {}
  for key, ref_value in reference.items():
    sub_path = (*path, str(key))
    if key not in given:
      if not holds_no_data(ref_value):
        problems.append(
          f"Missing key '{key_path_str(sub_path)}' in the state dict: the optimizer "
          f"has {_describe(prune_empty(ref_value))} there."
        )
      filled[key] = ref_value
      continue
    filled[key] = _check_and_fill(
      ref_value, given[key], sub_path, holes=holes, problems=problems, narrowed=narrowed
    )
  return filled


def optimizer_part(state_dict: Any) -> dict[str, Any]:
  """The ``target`` and ``state`` entries of an optimizer state dict.

  T5X passes whole train-state dicts (with ``flax_mutables`` beside them) to
  `Optimizer.restore_state`; like T5X, the other keys are ignored.

  Raises:
    ValueError: when `state_dict` is not a mapping.

  Example:
    >>> optimizer_part({"target": {}, "state": {}, "flax_mutables": {}})
    {'target': {}, 'state': {}}
  """
  if not isinstance(state_dict, Mapping):
    raise ValueError(
      f"State dict mismatch at '<root>': expected a subtree with keys ['state', "
      f"'target'], got {_describe(state_dict)}."
    )
  return {key: state_dict[key] for key in ("target", "state") if key in state_dict}


def restore_into(reference: Any, state_dict: Mapping[str, Any]) -> Any:
  """Restores `state_dict` into a pytree shaped like `reference`.

  Args:
    reference: the pytree whose structure, shapes and dtypes are expected (its
      arrays may be real or `jax.ShapeDtypeStruct`s; their shardings are kept).
    state_dict: a state dict in `flax.serialization` form, possibly with empty
      nodes removed (or marked with `traverse_util.empty_node`). Leaves may
      be numpy or jax arrays or Python scalars (a typed PRNG key may also
      come as its raw `jax.random.key_data`), or placeholders
      (`_is_placeholder`: None, `PartitionSpec`s, `ShapeDtypeStruct`s, lazy
      arrays), which are placed as given: T5X restores trees of specs and
      abstract values this way.

  Returns:
    A new pytree of `reference`'s type; `reference` is left unchanged. A flax
    ``nnx.State`` or ``nnx.Variable`` in `reference` is restored as its
    ``nnx.to_pure_dict`` form, checked leaf by leaf, and handed back as an
    NNX object of the same metadata.

  The structure is always checked. Shapes are checked wherever both sides
  have one; dtypes where array data is restored into an array, by
  `leaf_fit`'s rule: floating data restores into any floating dtype (params
  keep the state dict's dtype, as T5X's ``restore_dtype`` intends;
  optimizer-state arrays take the state's dtype); an integer restores into a
  narrower integer, and a float into an integer (T5X's float32 step
  counters), when every value is a whole number that fits; other changes
  of kind (complex to real, an integer into a float that cannot hold it)
  are refused, except for Python scalars that convert exactly. Data that may
  have been rounded before the restore is taken as it is, with one warning
  naming the leaves: whole floats into an integer leaf from the first whole
  number their dtype may have rounded another to (256 in bfloat16, into which
  T5X's ``RestoreCheckpointConfig.dtype`` casts the step and counters), and
  optimizer-state data of a floating dtype narrower than its leaf's (bfloat16
  into float32).

  Raises:
    ValueError: on a missing or unexpected key, a subtree where a leaf
      belongs (or the reverse), a value that is neither array data nor a
      placeholder, a shape mismatch or a dtype that cannot be cast safely;
      the message names the full path and both sides of every mismatch, one
      per line when there are several, and a slot that `reference` holds as
      an ``optax.MaskedNode`` as one its mask leaves out.

  Example:
    >>> import numpy as np
    >>> restore_into({'w': np.zeros(2)}, {'w': np.ones(2)})
    {'w': array([1., 1.])}
  """
  pure = to_pure(reference)
  holes = frozenset(
    key_path_parts(path)
    for path, node in jax.tree.leaves_with_path(pure, is_leaf=_is_masked)
    if _is_masked(node)
  )
  problems: list[str] = []
  narrowed: list[_Narrowed] = []
  filled = _check_and_fill(
    serialization.to_state_dict(pure),
    state_dict,
    (),
    holes=holes,
    problems=problems,
    narrowed=narrowed,
  )
  if len(problems) == 1:
    raise ValueError(problems[0])
  if problems:
    listed = "\n".join(f"- {problem}" for problem in problems)
    raise ValueError(
      f"The state dict does not fit the optimizer in {len(problems)} places:\n{listed}"
    )
  if narrowed:
    _warn_of_narrowed(narrowed)
  return restore_like(reference, serialization.from_state_dict(pure, filled))


def build_state_dict(target: Any, step: Any, param_states: Any) -> dict[str, Any]:
  """The T5X layout of an optimizer: ``{'target': ..., 'state': {'step', 'param_states'}}``.

  Every optimizer definition builds its state dict here. `target` (the
  params) is converted with `flax.serialization.to_state_dict`, a flax
  ``nnx.State`` written as its ``nnx.to_pure_dict`` values; `step` is
  placed as given; `param_states` must already be in state-dict form (nested
  dicts with string keys): each definition chooses its own layout of them,
  typically `to_pruned_state_dict` of its state. As in T5X's `OptaxWrapper`,
  no empty subtree is left: an optimizer without state (sgd) has no
  ``param_states`` key at all, which T5X's checkpointer needs.

  Example:
    >>> build_state_dict({"w": 1.0}, 3, {"0": {"count": 3}})
    {'target': {'w': 1.0}, 'state': {'step': 3, 'param_states': {'0': {'count': 3}}}}
    >>> build_state_dict({"w": 1.0}, 3, {})
    {'target': {'w': 1.0}, 'state': {'step': 3}}
  """
  return {
    "target": serialization.to_state_dict(to_pure(target)),
    "state": prune_empty({"step": step, "param_states": param_states}),
  }


def restore_state_dict(
  target: Any, step: Any, param_states: Any, state_dict: Mapping[str, Any]
) -> tuple[Any, Any, Any]:
  """Restores `build_state_dict`'s layout into references, validating it first.

  Args:
    target: the reference params.
    step: the reference step counter.
    param_states: the reference optimizer state, in the form the definition
      hands to `build_state_dict` (unpruned) or as the pytree whose
      `to_pruned_state_dict` it hands there.
    state_dict: the state dict; keys beside ``target`` and ``state`` (a
      train state's ``flax_mutables``) are ignored (`optimizer_part`).

  Returns:
    ``(target, step, param_states)`` restored into the references' types by
    `restore_into`, whose rules (tree replace of placeholders, `leaf_fit`'s
    dtype rule) apply; the inputs are never modified.

  Raises:
    ValueError: naming the full path and both sides, on any missing or
      unexpected key, shape mismatch or dtype that may not restore; or
      naming ``state/step``, on a negative step counter (it counts updates).

  Example:
    >>> import numpy as np
    >>> target, step, param_states = restore_state_dict(
    ...   {"w": np.zeros(1)}, np.int32(0), {}, {"target": {"w": np.ones(1)}, "state": {"step": 2}})
    >>> target, int(step), param_states
    ({'w': array([1.])}, 2, {})
  """
  reference = {"target": target, "state": {"step": step, "param_states": param_states}}
  restored = restore_into(reference, optimizer_part(state_dict))
  step = restored["state"]["step"]
  least = _least(step)
  if least is not None and least < 0:
    raise ValueError(
      f"Value mismatch at 'state/step': the step counter counts updates, and the state dict's "
      f"is {least}"
    )
  return restored["target"], step, restored["state"]["param_states"]


def _least(value: Any) -> int | float | None:
  """The least value of numeric data `value`, reduced where it lives; None for placeholders
  (None, `PartitionSpec`s, `jax.ShapeDtypeStruct`s, lazy arrays) and traced values."""
  numeric = isinstance(value, int | float | np.ndarray | np.generic | jax.Array)
  if not numeric or isinstance(value, bool | jax.core.Tracer) or np.size(value) == 0:
    return None
  return (jax.numpy if isinstance(value, jax.Array) else np).min(value).item()
