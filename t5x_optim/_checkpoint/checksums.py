"""Checksums of a checkpoint's arrays: computed where the shards live, saved as JSON.

`dispatch_checksums` computes a 32-bit checksum of every array on its
devices, at most a few programs at a time; `ChecksumsHandler` writes them
as ``checksums.json`` in the step's atomic commit, and `Checkpointer`
compares them with the arrays it restores.

Example:
  >>> import jax.numpy as jnp
  >>> sums = fetch(dispatch_checksums({('w',): jnp.ones(3)}))
  >>> list(sums), sums == fetch(dispatch_checksums({('w',): jnp.ones(3)}))
  (['w'], True)
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from t5x_optim._checkpoint.leaves import Path
from t5x_optim._keypaths import key_path_str

__all__ = [
  "CHECKSUMS_FILE",
  "ChecksumsArgs",
  "ChecksumsHandler",
  "dispatch_checksums",
  "fetch",
  "x32_values",
  "x64_words",
]


# The file of a step's checksums, in its "checksums" item.
CHECKSUMS_FILE = "checksums.json"


def _words(x: jax.Array) -> jax.Array:
  """The bit pattern of `x` as uint32 words (NaNs made canonical first).

  Values of at most 32 bits give one word each, 64-bit values two (a
  trailing axis), complex values their real and imaginary parts.
  """
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    x = jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)
  if jnp.issubdtype(x.dtype, jnp.floating):
    x = jnp.where(jnp.isnan(x), jnp.array(jnp.nan, x.dtype), x)
    if x.dtype.itemsize < 4:
      return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}")).astype(
        jnp.uint32
      )
  if x.dtype.itemsize in (4, 8) and not jnp.issubdtype(x.dtype, jnp.bool_):
    return jax.lax.bitcast_convert_type(x, jnp.uint32)
  return x.astype(jnp.uint32)


@functools.partial(jax.jit, static_argnames="dtype")
def _checksum(x: jax.Array, dtype: np.dtype | None = None) -> jax.Array:
  """A 32-bit checksum of `x`'s value (first cast to `dtype` if given).

  Each word of the value is mixed with its flat index and the results are
  summed modulo 2**32. Integer sums do not depend on the order of reduction,
  so the checksum is the same for every sharding, mesh and process count:
  it runs where the shards live, as one fused pass and an all-reduce. Any
  change of one word changes it; random corruption goes undetected with
  probability about 2**-32. Casting back to the stored `dtype` is exact for
  the safe casts restore allows, so a cast restore is verified too.
  """
  x = jnp.asarray(x)
  words = _words(x if dtype is None else x.astype(dtype))
  index = jnp.zeros(words.shape, jnp.uint32)
  stride = 1
  for axis in reversed(range(words.ndim)):
    index += jax.lax.broadcasted_iota(jnp.uint32, words.shape, axis) * jnp.uint32(stride % 2**32)
    stride *= words.shape[axis]
  mixed = words ^ (index * jnp.uint32(0x9E3779B9))
  mixed = (mixed ^ (mixed >> 16)) * jnp.uint32(0x85EBCA6B)
  mixed ^= mixed >> 13
  # Leading axes first: a reduction along rows vectorises on CPUs.
  rows = jnp.sum(mixed, axis=tuple(range(mixed.ndim - 1)), dtype=jnp.uint32)
  return jnp.sum(rows, dtype=jnp.uint32)


# Checksum programs dispatched before waiting: a hundred small programs with
# all-reduces in flight at once starve XLA:CPU's thread pool and deadlock,
# while one program for all arrays runs 3x slower than separate ones.
_IN_FLIGHT = 4


def _exact(leaf: Any) -> Any:
  """`leaf`, or the uint32 words of a host integer array a device would narrow.

  Without ``jax_enable_x64`` a device holds an int64 as int32; a checksum
  of the narrowed values would not see a change of the high words. Data
  whose values all fit the narrower dtype is checksummed as before (so
  checksums recorded earlier still verify); other data by its words.

  A Python int is such data too (jax refuses one beyond int32 outright).

  Example:
    >>> _exact(np.int64(3)), _exact(np.array([2**32 + 3])).tolist(), _exact(2**40).tolist()
    (np.int64(3), [[3, 1]], [[0, 256]])
  """
  if isinstance(leaf, int) and not isinstance(leaf, bool):
    leaf = np.int64(leaf)
  if not isinstance(leaf, np.ndarray | np.generic) or not np.issubdtype(leaf.dtype, np.integer):
    return leaf
  narrow = jax.dtypes.canonicalize_dtype(leaf.dtype)
  if narrow == leaf.dtype or np.array_equal(np.asarray(leaf).astype(narrow), leaf):
    return leaf
  value = np.ascontiguousarray(leaf)
  return value.view(np.uint32).reshape(*value.shape, value.dtype.itemsize // 4)


def x64_words(leaves: Mapping[Path, Any]) -> dict[Path, np.ndarray]:
  """The host arrays among `leaves` that the devices cannot hold, as the words x64 checksums.

  Without ``jax_enable_x64``, 64-bit data read onto the host (float64,
  int64, complex128) is checksummed as a device would narrow it
  (`_exact`), which is what a step saved with x64 off recorded; a step
  saved with x64 on recorded the checksum of its uint32 words (`_words`).
  These are those words, NaNs made canonical first, for the checksum to
  compare a step saved with x64 on against.

  Example:
    >>> x64_words({('w',): np.array([1.0]), ('b',): np.float32(2)})[('w',)].tolist()
    [[0, 1072693248]]
  """
  words = {}
  for path, leaf in leaves.items():
    if not isinstance(leaf, np.ndarray | np.generic):
      continue
    value = np.asarray(leaf)
    if jax.dtypes.canonicalize_dtype(value.dtype) == value.dtype:
      continue
    if np.issubdtype(value.dtype, np.complexfloating):
      value = np.stack([value.real, value.imag], axis=-1)
    if np.issubdtype(value.dtype, np.floating):
      value = np.where(np.isnan(value), np.array(np.nan, value.dtype), value)
    value = np.ascontiguousarray(value)
    words[path] = value.view(np.uint32).reshape(*value.shape, value.dtype.itemsize // 4)
  return words


_NARROWER = {
  np.dtype(np.float64): np.float32,
  np.dtype(np.complex128): np.complex64,
  np.dtype(np.int64): np.int32,
  np.dtype(np.uint64): np.uint32,
}


def x32_values(leaves: Mapping[Path, Any]) -> dict[Path, Any]:
  """With ``jax_enable_x64`` on, the 64-bit leaves as a device without it holds them.

  A step saved with x64 off recorded the checksum of its host 64-bit arrays
  (numpy params an optimizer keeps) as a device narrows them (`_exact`);
  read with x64 on, they are 64-bit. These are the narrowed values to
  compare that checksum against: floats rounded, integers only where every
  value fits (otherwise their words were recorded, which the 64-bit
  checksum is).

  Example:
    >>> x32_values({('w',): np.array([1.0])})  # x64 off: nothing to narrow
    {}
  """
  if not jax.config.jax_enable_x64:
    return {}
  narrowed = {}
  for path, leaf in leaves.items():
    narrow = _NARROWER.get(np.dtype(leaf.dtype)) if hasattr(leaf, "dtype") else None
    if narrow is None:
      continue
    value = jnp.asarray(leaf).astype(narrow)
    if np.issubdtype(narrow, np.integer) and not jnp.array_equal(value.astype(leaf.dtype), leaf):
      continue
    narrowed[path] = value
  return narrowed


def dispatch_checksums(
  leaves: Mapping[Path, Any], dtypes: Mapping[Path, np.dtype] | None = None
) -> dict[str, jax.Array]:
  """`_checksum` of every leaf, keyed by joined path.

  At most `_IN_FLIGHT` programs run at once; the last of them are returned
  still computing. Each runs where its leaf is, whatever mesh `jax.set_mesh`
  put in context (jax refuses a leaf on another mesh under it).
  """
  dtypes = dtypes or {}
  pending = {}
  with jax.set_mesh(None):
    for i, (path, leaf) in enumerate(leaves.items()):
      if i and i % _IN_FLIGHT == 0:
        jax.block_until_ready(list(pending.values())[-_IN_FLIGHT:])
      # Host float64 data beyond float32's range narrows to inf, as on a device.
      with np.errstate(over="ignore"):
        pending[key_path_str(path)] = _checksum(_exact(leaf), dtypes.get(path))
  return pending


def fetch(pending: Mapping[str, jax.Array]) -> dict[str, int]:
  return {path: int(value) for path, value in jax.device_get(dict(pending)).items()}


class ChecksumsHandler(ocp.AsyncCheckpointHandler):
  """Writes a step's checksums as JSON, in the background, once they are computed.

  The last checksums may still be computing on the devices when the save
  starts; the file is written once they are done, as part of the step's
  atomic commit. Only the primary process writes (the
  checksums are global).
  """

  def _write(self, directory: epath.Path, pending: Mapping[str, jax.Array]) -> None:
    checksums = fetch(pending)
    if jax.process_index() == 0:
      (directory / CHECKSUMS_FILE).write_text(json.dumps(checksums, sort_keys=True))

  async def _write_async(self, directory: epath.Path, pending: Mapping[str, jax.Array]) -> None:
    self._write(directory, pending)

  async def async_save(self, directory: epath.Path, args: ChecksumsArgs) -> list[ocp.future.Future]:
    return [
      ocp.future.CommitFutureAwaitingContractedSignals(
        self._write_async(directory, args.pending), name="t5x_optim_checksums"
      )
    ]

  def save(self, directory: epath.Path, args: ChecksumsArgs) -> None:
    self._write(directory, args.pending)

  def restore(self, directory: epath.Path, args: Any = None) -> dict[str, int]:
    del args
    return json.loads((directory / CHECKSUMS_FILE).read_text())


@ocp.args.register_with_handler(ChecksumsHandler, for_save=True, for_restore=True)
@dataclasses.dataclass
class ChecksumsArgs(ocp.args.CheckpointArgs):
  """The checksums of a step's arrays, by joined path, as pending jax scalars.

  Orbax needs one registered argument type per handler to save and to
  restore; restoring takes no arguments (`Checkpointer` reads the file).
  """

  pending: Mapping[str, jax.Array] = dataclasses.field(default_factory=dict)
