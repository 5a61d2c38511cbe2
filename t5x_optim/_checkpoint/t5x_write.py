"""Writing T5X's legacy checkpoint format (`save_t5x_checkpoint`), which T5X's own readers read.

The arrays are written first, shard by shard (one copy of each, never
gathered), then the ``checkpoint`` msgpack that names them. On a local disk
they go into a temporary directory that is renamed into place; an object
store (``gs://``) has no rename, so they go straight into the step directory
and the msgpack, one object written whole, is the commit record: readers
(T5X's and `t5x_checkpoints`) skip a step directory without it. Either way a
failed save leaves the earlier steps as they were and no readable new one.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import tensorstore as ts
from etils import epath
from flax import serialization, traverse_util

from t5x_optim._checkpoint import storage
from t5x_optim._checkpoint.leaves import array_key, checked_step, optimizer_state_classes
from t5x_optim._checkpoint.t5x_read import (
  MSGPACK_FILE,
  STATE_CLASSES_FILE,
  TS_CONTEXT,
  Path,
  T5XState,
)
from t5x_optim._core import state_dict as _state_dict
from t5x_optim._keypaths import key_path_str

__all__ = ["save_t5x_checkpoint"]

_VERSION = 3  # Of T5X's legacy msgpack layout.
_CHUNK_BYTES = 64 * 2**20  # T5X's target zarr chunk size.


def _smallest_factor(n: int) -> int:
  return next((f for f in range(2, math.isqrt(n) + 1) if n % f == 0), n)


def _chunk_shape(write_shape: tuple[int, ...], itemsize: int) -> list[int]:
  """Chunks that tile `write_shape` (a shard) and hold at most 64 MiB each.

  Each chunk lies inside one shard, so shards are written independently.
  """
  chunk = [max(int(n), 1) for n in write_shape]
  while math.prod(chunk) * itemsize > _CHUNK_BYTES and max(chunk) > 1:
    i = chunk.index(max(chunk))
    chunk[i] //= _smallest_factor(chunk[i])
  return chunk


def _spec(
  name: str, shape: tuple[int, ...], dtype: np.dtype, write_shape: tuple[int, ...]
) -> dict[str, Any]:
  """The tensorstore spec T5X stores in the msgpack (path relative to the step)."""
  return {
    "driver": "zarr",
    "dtype": np.dtype(dtype).name,
    "kvstore": {"driver": "file", "path": name},
    "metadata": {
      "compressor": {"id": "zstd", "level": 1},
      "shape": list(shape),
      "chunks": _chunk_shape(write_shape, np.dtype(dtype).itemsize),
    },
  }


def _pieces(leaf: Any) -> tuple[tuple[int, ...], list[tuple[Any, Any]]]:
  """The shape each writer writes and the ``(index, host data)`` pieces to write.

  A sharded array is written shard by shard (one copy of each), never
  gathered.
  """
  if isinstance(leaf, jax.Array):
    shards = [s for s in leaf.addressable_shards if s.replica_id == 0]
    write_shape = leaf.sharding.shard_shape(leaf.shape)
    return write_shape, [(s.index, s.data) for s in shards]
  value = np.asarray(leaf)
  return value.shape, [((), value)]


def _plan_writes(
  flat: Mapping[Path, Any],
) -> tuple[dict[Path, Any], dict[Path, list[tuple[Any, Any]]]]:
  """The msgpack leaves (inline values and specs) and the pieces of each zarr array.

  Checks every leaf before anything is written.
  """
  written, pieces, names = {}, {}, {}
  for path, leaf in flat.items():
    if leaf is None:
      written[path] = None  # No state (a frozen param's): nil, as T5X writes it.
      continue
    if isinstance(leaf, jax.ShapeDtypeStruct):
      raise ValueError(
        f"Cannot save the abstract leaf at '{key_path_str(path)}': give real arrays."
      )
    if _state_dict.is_prng_key(leaf):
      leaf = jax.random.key_data(leaf)
    if np.ndim(leaf) == 0 or np.size(leaf) == 1:
      # Inline, as T5X writes a leaf without mesh axes (Adafactor's (1,) placeholders): its
      # reader takes every tensorstore spec for an array with mesh axes.
      written[path] = np.asarray(leaf)
      continue
    name = ".".join(path)
    try:
      key = array_key(name, files=True)
    except ValueError as e:
      raise ValueError(
        f"Cannot save the array at '{key_path_str(path)}' (keys {path}): {e} ('\\' counts as "
        "'/'). Nothing was written: rename a key."
      ) from None
    if key in names:
      raise ValueError(
        f"'{key_path_str(path)}' and '{key_path_str(names[key])}' would share the file "
        f"{key[:-1]}. Nothing was written: rename one of them."
      )
    names[key] = path
    write_shape, pieces[path] = _pieces(leaf)
    written[path] = _spec(name, tuple(np.shape(leaf)), np.dtype(leaf.dtype), tuple(write_shape))
  return written, pieces


def _write_arrays(
  step_dir: epath.Path, written: Mapping[Path, Any], pieces: Mapping[Path, list[tuple[Any, Any]]]
) -> None:
  """Writes the `pieces` of each zarr array `_plan_writes` planned into `step_dir`.

  On an error, every I/O already started is waited for before raising, so
  nothing is written into `step_dir` afterwards.
  """
  started = []
  try:
    opening = {}
    for path in pieces:
      spec = written[path]
      kvstore = storage.kvstore_spec(storage.join(step_dir, spec["kvstore"]["path"]))
      full = {**spec, "kvstore": kvstore}
      opening[path] = ts.open(full, create=True, open=True, context=TS_CONTEXT)
      started.append(opening[path])
    writes = []
    for path, future in opening.items():
      store = future.result()
      for index, data in pieces[path]:
        writes.append(store[index].write(np.asarray(data)).commit)
        started.append(writes[-1])
    for write in writes:
      write.result()
  except BaseException:
    for future in started:
      future.exception()  # Waits; the first error is the one raised.
    raise


def save_t5x_checkpoint(
  model_dir: str | os.PathLike[str], state: T5XState, *, step: int | None = None
) -> str:
  """Writes `state` as a T5X checkpoint in the legacy format T5X's `Checkpointer` reads.

  The step directory ``<model_dir>/checkpoint_<step>`` holds the msgpack file
  ``checkpoint`` (``{'version': 3, 'optimizer': <state dict>}``, scalars
  and single-element arrays inline, as T5X writes Adafactor's (1,)
  placeholders, every other array as a tensorstore spec) and one zarr array
  per other leaf, written shard by shard from this process's devices (one
  copy of each shard; nothing is gathered), and, for a `TrainState` or an
  `Optimizer`, ``t5x_optim_state_classes.json``: the classes of its
  optimizer state's nodes, which `restore_t5x_checkpoint` compares with
  its target's (T5X ignores the file). On a local disk everything is
  written to ``checkpoint_<step>.tmp-<time>`` first and renamed when
  complete, as T5X does; on an object store (``gs://``) the msgpack is
  written last, as the commit record. Either way a failed save leaves no
  readable step and earlier steps untouched. Single process only.

  Args:
    model_dir: the T5X model directory (created if missing): a local path
      or one with a scheme (``gs://bucket/dir``, see `storage`).
    state: a `TrainState` or `Optimizer` (or anything with `state_dict`)
      holding real arrays, sharded or not.
    step: the step number of the directory; None takes the state's step.

  Returns:
    The path of the step directory.

  Raises:
    FileExistsError: the step directory exists already.
    ValueError: before anything is written: a step that is not a
      non-negative integer, a multi-process job, abstract leaves, a leaf
      whose file name tensorstore's file store refuses, or two leaves whose
      files would coincide (`leaves.array_key`); `storage.StorageError`
      (a `ValueError`): a missing bucket, credentials or package for the
      path's scheme.

  Example:
    >>> import tempfile, jax.numpy as jnp
    >>> from t5x_optim import optimizers
    >>> opt = optimizers.adam(1e-3).create({'w': jnp.ones((2, 3))})
    >>> path = save_t5x_checkpoint(tempfile.mkdtemp(), opt, step=5)
    >>> sorted(os.listdir(path))  # doctest: +NORMALIZE_WHITESPACE
    ['checkpoint', 'state.param_states.0.mu.w', 'state.param_states.0.nu.w',
     't5x_optim_state_classes.json', 'target.w']
  """
  if jax.process_count() > 1:
    raise ValueError("save_t5x_checkpoint writes from a single process only.")
  state_dict = state.state_dict()
  step = _state_step(state_dict) if step is None else checked_step(step)
  flat = traverse_util.flatten_dict(_state_dict.prune_empty(state_dict))
  written, pieces = _plan_writes(flat)
  root = storage.check_reachable(model_dir)
  final = root / f"checkpoint_{step}"
  if (final / MSGPACK_FILE).exists() or (final.exists() and not storage.is_object_store(root)):
    raise FileExistsError(f"Cannot save step {step}: {final} exists already.")
  classes = optimizer_state_classes(state)
  if storage.is_object_store(root):
    return _save_committed_last(final, written, pieces, classes)
  tmp = root / f"{final.name}.tmp-{time.time_ns()}"
  tmp.mkdir(parents=True)
  try:
    _write_arrays(tmp, written, pieces)
    payload = _payload(written)
    _write_classes(tmp, classes)
    with open(tmp / MSGPACK_FILE, "wb") as f:
      f.write(payload)
      f.flush()
      os.fsync(f.fileno())
    os.rename(tmp, final)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return os.fspath(final)


def _state_step(state_dict: Mapping[str, Any]) -> int:
  """The state's own step counter as a step number (a whole float32 one too, as T5X's Orbax
  checkpointer restores it).

  Raises:
    ValueError: when it is not a non-negative whole number.
  """
  step = np.asarray(state_dict["state"]["step"])
  if np.issubdtype(step.dtype, np.floating) and step.ndim == 0 and float(step).is_integer():
    step = step.astype(np.int64)
  return checked_step(step)


def _payload(written: Mapping[Path, Any]) -> bytes:
  """The ``checkpoint`` msgpack of the arrays `written`."""
  return serialization.msgpack_serialize(
    {"version": _VERSION, "optimizer": traverse_util.unflatten_dict(dict(written))}
  )


def _write_classes(step_dir: epath.Path, classes: Mapping[str, str] | None) -> None:
  """Records the optimizer state's classes beside T5X's files (`restore_t5x_checkpoint` checks them)."""
  if classes is not None:
    (step_dir / STATE_CLASSES_FILE).write_text(json.dumps(dict(classes), sort_keys=True))


def _save_committed_last(
  final: epath.Path,
  written: Mapping[Path, Any],
  pieces: Mapping[Path, list[tuple[Any, Any]]],
  classes: Mapping[str, str] | None,
) -> str:
  """Writes a step on an object store: arrays into `final`, then the msgpack as its commit.

  What an earlier crashed save left in `final` (arrays without a msgpack,
  invisible to readers) is removed first.
  """
  if final.exists():
    final.rmtree()
  _write_arrays(final, written, pieces)
  payload = _payload(written)
  _write_classes(final, classes)
  (final / MSGPACK_FILE).write_bytes(payload)
  return os.fspath(final)
