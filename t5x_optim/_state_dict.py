"""T5X-layout state dicts: empty-node pruning, validation and restoration.

A state dict is what `flax.serialization.to_state_dict` makes of a pytree:
nested dicts with string keys (tuples and lists keyed ``'0'``, ``'1'``, ...,
NamedTuples by field name) and arrays at the leaves. T5X writes optimizer
states with every empty container removed (``optax.EmptyState()`` leaves no
key); restoring puts the empty nodes back from the reference structure.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import serialization

__all__ = ["is_prng_key", "prune_empty", "restore_into", "to_pruned_state_dict"]


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
  """`flax.serialization.to_state_dict` with empty containers removed."""
  return prune_empty(serialization.to_state_dict(tree))


def _is_empty(tree: Any) -> bool:
  return isinstance(tree, Mapping) and not prune_empty(tree)


def _join(path: tuple[str, ...]) -> str:
  return "/".join(path) if path else "<root>"


def _describe(value: Any) -> str:
  if value is None:
    return "None"
  if isinstance(value, Mapping):
    return f"a subtree with keys {sorted(value)}"
  shape, dtype = np.shape(value), _dtype_of(value)
  return f"shape {shape} dtype {dtype}"


def _dtype_of(value: Any) -> np.dtype:
  dtype = getattr(value, "dtype", None)
  return np.dtype(dtype) if dtype is not None else np.asarray(value).dtype


def _castable(value: Any, src: np.dtype, dst: np.dtype) -> bool:
  """True when `value` (of dtype `src`) converts to `dst` without loss."""
  if src == dst or np.can_cast(src, dst, casting="safe"):
    return True
  if np.issubdtype(src, np.integer) and np.issubdtype(dst, np.integer):
    info = np.iinfo(dst)
    host = np.asarray(value)
    return bool(host.size == 0 or (host.min() >= info.min and host.max() <= info.max))
  if isinstance(value, (bool, int, float, complex)):
    return bool(np.asarray(value).astype(dst) == value)
  return False


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
    value = jax.random.wrap_key_data(
        np.asarray(value, np.uint32), impl=jax.random.key_impl(reference)
    )
  if value.dtype != reference.dtype or value.shape != reference.shape:
    raise ValueError(
        f"PRNG key mismatch at '{where}': the optimizer has {reference.dtype} "
        f"{reference.shape}, the state dict has {value.dtype} {value.shape}."
    )
  sharding = getattr(reference, "sharding", None)
  return jax.device_put(value, sharding) if sharding is not None else value


def _convert_leaf(reference: Any, value: Any, path: tuple[str, ...]) -> Any:
  """Checks `value` against `reference` and returns it in the reference's form."""
  where = _join(path)
  if reference is None:
    if value is not None:
      raise ValueError(
          f"State dict mismatch at '{where}': expected None (no state), got "
          f"{_describe(value)}."
      )
    return None
  if value is None or isinstance(value, Mapping):
    raise ValueError(
        f"State dict mismatch at '{where}': expected an array with "
        f"{_describe(reference)}, got {_describe(value)}."
    )
  if is_prng_key(reference):
    return _convert_key(reference, value, where)
  ref_shape, ref_dtype = np.shape(reference), _dtype_of(reference)
  shape, dtype = np.shape(value), _dtype_of(value)
  if shape != ref_shape:
    raise ValueError(
        f"Shape mismatch at '{where}': the optimizer has shape {ref_shape}, the "
        f"state dict has shape {shape}."
    )
  if not _castable(value, dtype, ref_dtype):
    raise ValueError(
        f"Dtype mismatch at '{where}': the state dict has {dtype}, which cannot "
        f"be cast safely to the optimizer's {ref_dtype}."
    )
  sharding = getattr(reference, "sharding", None)
  if isinstance(reference, (jax.Array, jax.ShapeDtypeStruct)):
    array = jax.numpy.asarray(value, dtype=ref_dtype)
    return jax.device_put(array, sharding) if sharding is not None else array
  if isinstance(reference, np.ndarray | np.generic):
    return np.asarray(value, dtype=ref_dtype)
  return type(reference)(np.asarray(value).item())


def _check_and_fill(reference: Any, given: Any, path: tuple[str, ...]) -> Any:
  """Validates `given` against the full `reference` state dict.

  Keys whose reference subtree is empty may be absent from `given` (T5X drops
  them) and are taken from the reference.
  """
  if not isinstance(reference, Mapping):
    return _convert_leaf(reference, given, path)
  if not isinstance(given, Mapping):
    raise ValueError(
        f"State dict mismatch at '{_join(path)}': expected "
        f"{_describe(prune_empty(reference))}, got {_describe(given)}."
    )
  unexpected = sorted(
      key for key in given if key not in reference and not _is_empty(given[key])
  )
  if unexpected:
    raise ValueError(
        f"Unexpected keys {unexpected} at '{_join(path)}' in the state dict; the "
        f"optimizer has keys {sorted(prune_empty(reference))} there."
    )
  filled = {}
  for key, ref_value in reference.items():
    sub_path = (*path, str(key))
    if key not in given:
      if not (ref_value is None or _is_empty(ref_value)):
        raise ValueError(
            f"Missing key '{_join(sub_path)}' in the state dict: the optimizer "
            f"has {_describe(prune_empty(ref_value))} there."
        )
      filled[key] = ref_value
      continue
    filled[key] = _check_and_fill(ref_value, given[key], sub_path)
  return filled


def restore_into(reference: Any, state_dict: Mapping[str, Any]) -> Any:
  """Restores `state_dict` into a pytree shaped like `reference`.

  Args:
    reference: the pytree whose structure, shapes and dtypes are expected (its
      arrays may be real or `jax.ShapeDtypeStruct`s; their shardings are kept).
    state_dict: a state dict in `flax.serialization` form, possibly with empty
      nodes removed. Leaves may be numpy or jax arrays or Python scalars; a
      typed PRNG key may also come as its raw `jax.random.key_data`.

  Returns:
    A new pytree of `reference`'s type; `reference` is left unchanged.

  Raises:
    ValueError: on a missing or unexpected key, a shape mismatch or a dtype
      that cannot be cast safely; the message names the full path and both
      sides.

  Example:
    >>> import numpy as np
    >>> restore_into({'w': np.zeros(2)}, {'w': np.ones(2)})
    {'w': array([1., 1.])}
  """
  full_reference = serialization.to_state_dict(reference)
  filled = _check_and_fill(full_reference, state_dict, ())
  return serialization.from_state_dict(reference, filled)
