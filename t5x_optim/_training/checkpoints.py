"""Implementation of `t5x_optim.checkpoints`, documented there."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import os
import socket
import weakref
from collections.abc import Callable, Mapping
from typing import Any, NoReturn, Protocol, Self

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath
from jax.experimental import multihost_utils

try:
  import fcntl
except ImportError:  # Not POSIX (Windows): directories are not locked.
  fcntl = None
from flax import serialization, traverse_util

from t5x_optim._optimizers import state_dict as _state_dict
from t5x_optim._optimizers.interface import Optimizer
from t5x_optim._training import t5x_checkpoints
from t5x_optim._training.train_state import TrainState

__all__ = ["CheckpointError", "Checkpointer", "CheckpointState"]

_log = logging.getLogger("t5x_optim.checkpoints")

Path = tuple[str, ...]
_TARGET = "target"
_STATE = "state"
_STEP = "step"
_PARAM_STATES = "param_states"
_FLAX_MUTABLES = "flax_mutables"
_ARRAYS = ocp.checkpoint_manager.DEFAULT_ITEM_NAME
_CHECKSUMS = "checksums"
_CHECKSUMS_FILE = "checksums.json"
_LOCK_FILE = ".t5x_optim.lock"


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


class CheckpointState(Protocol):
  """What `Checkpointer` saves and restores: a `TrainState` or an `Optimizer`."""

  def state_dict(self) -> dict[str, Any]:
    """The T5X-layout state dict."""

  def restore_state(self, state_dict: Mapping[str, Any]) -> Self:
    """A copy restored from a T5X-layout state dict."""


@dataclasses.dataclass
class _Unread(ocp.metadata.Metadata):
  """A stored array whose header was not read: not wanted, or unreadable.

  Attributes:
    error: why the header could not be read; None when it was not wanted.
  """

  error: BaseException | None = None


class _ReadsHeaders:
  """Makes an orbax type handler's `metadata` read only array headers.

  orbax's `jax.Array` handler also reads and parses every array's sharding
  file, one after another: 1.1-1.4 s for a checkpoint of 2,101 small arrays,
  against 0.24-0.50 s here (benchmarks/README.md). The restore takes its
  shardings from the target, so only the shape and dtype are needed. Every
  wanted array is opened with orbax's own read spec and the batch is awaited
  once. An array that is not wanted, or whose header cannot be read, becomes
  an `_Unread` entry, so that every unreadable path can be named at once.

  Args:
    wanted: which arrays to open. It is given orbax's name of an array (its
      path joined by ".") split at "."; for the predicates `restore` uses,
      which look at the first key and at ``("state", "step")``, that opens
      every array whose path they want (and, where a first key holds a ".",
      perhaps some more, which the caller drops).
  """

  def __init__(self, wanted: Callable[[Path], bool]):
    super().__init__()
    self._wanted = wanted

  async def metadata(self, infos: list[ocp.type_handlers.ParamInfo]) -> list[ocp.metadata.Metadata]:
    if not infos:
      return []
    opening = {
      info.name: ts.open(
        ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=bool(info.is_ocdbt_checkpoint)),
        open=True,
        context=info.ts_context,
      )
      for info in infos
      if self._wanted(tuple(info.name.split(".")))
    }
    return await asyncio.to_thread(_headers, infos, opening)


class _ArrayHeaders(_ReadsHeaders, ocp.type_handlers.ArrayHandler):
  """`jax.Array` metadata: headers only (see `_ReadsHeaders`)."""


class _NumpyHeaders(_ReadsHeaders, ocp.type_handlers.NumpyHandler):
  """`np.ndarray` metadata: headers only (see `_ReadsHeaders`)."""


class _ScalarHeaders(_ReadsHeaders, ocp.type_handlers.ScalarHandler):
  """Scalar metadata: headers only (see `_ReadsHeaders`)."""


_HEADER_READERS = {
  ocp.type_handlers.ArrayHandler: _ArrayHeaders,
  ocp.type_handlers.NumpyHandler: _NumpyHeaders,
  ocp.type_handlers.ScalarHandler: _ScalarHeaders,
}


def _headers(
  infos: list[ocp.type_handlers.ParamInfo], opening: Mapping[str, Any]
) -> list[ocp.metadata.Metadata]:
  """The header of each array of `infos`, once `opening` (by name) is done."""
  directory = infos[0].parent_dir  # The item's: one directory for all of them.
  headers = []
  for info in infos:
    entry = _Unread(info.name, directory)
    if info.name in opening:
      try:
        array = opening[info.name].result()
      except Exception as e:  # noqa: BLE001 - tensorstore raises bare Exceptions.
        entry.error = e
      else:
        entry = ocp.metadata.ArrayMetadata(
          name=info.name,
          directory=directory,
          shape=array.shape,
          dtype=jnp.dtype(array.dtype.name),
          sharding=None,
        )
    headers.append(entry)
  return headers


def _header_reading_handler(wanted: Callable[[Path], bool]) -> ocp.PyTreeCheckpointHandler:
  """orbax's PyTree handler, its array and scalar handlers reading headers only."""
  handlers = []
  for ty in ocp.type_handlers.supported_types():
    handler = ocp.type_handlers.get_type_handler(ty)
    reader = _HEADER_READERS.get(type(handler))
    handlers.append((ty, handler if reader is None else reader(wanted)))
  registry = ocp.type_handlers.create_type_handler_registry(*handlers)
  return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)


def _open_stored(
  item: epath.Path, where: str, step: int, wanted: Callable[[Path], bool]
) -> dict[Path, jax.ShapeDtypeStruct]:
  """The shape and dtype of the `wanted` arrays stored in the orbax item `item`.

  orbax's `metadata` reads the tree metadata file once, then opens the
  wanted arrays in one batch; tensorstore reads only their headers, no data.

  Args:
    item: the item directory of a step (``<directory>/<step>/default``).
    where: names the checkpoint in error messages.
    step: its step.
    wanted: which stored paths to open.

  Raises:
    CheckpointError: the tree metadata is unreadable, or some arrays'
      headers are, naming every such path.
  """
  handler = _header_reading_handler(wanted)
  try:
    tree = handler.metadata(item).tree
  except FileNotFoundError as e:
    raise CheckpointError(
      f"{where} has no readable tree metadata: No such file ({e})", step=step
    ) from e
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise CheckpointError(f"{where} has no readable tree metadata: {e}", step=step) from e
  finally:
    handler.close()
  stored, unreadable, first_error = {}, [], None
  for path, entry in traverse_util.flatten_dict(tree).items():
    if isinstance(entry, _Unread) and entry.error is not None and wanted(path):
      unreadable.append(f"'{_state_dict.key_path_str(path)}'")
      first_error = first_error or entry.error
    elif isinstance(entry, ocp.metadata.ArrayMetadata) and wanted(path):
      stored[path] = jax.ShapeDtypeStruct(entry.shape, entry.dtype)
  if unreadable:
    raise CheckpointError(
      f"{where} has unreadable metadata at {', '.join(unreadable)}: {_root_cause(first_error)}",
      step=step,
    ) from first_error
  return stored


def _root_cause(error: BaseException) -> str:
  """The innermost error behind `error`, without tensorstore's spec dump."""
  while (error.__cause__ or error.__context__) is not None:
    error = error.__cause__ or error.__context__
  return f"{type(error).__name__}: {str(error).split(' [tensorstore_spec=')[0]}"


def _flatten(tree: Mapping[str, Any]) -> dict[Path, Any]:
  """A nested state dict as ``{path: leaf}`` (empty mappings dropped)."""
  return traverse_util.flatten_dict(_state_dict.prune_empty(tree))


def _saveable(leaf: Any) -> Any:
  """Typed PRNG keys are written as their raw `key_data`."""
  return jax.random.key_data(leaf) if _state_dict.is_prng_key(leaf) else leaf


def _as_stored(leaf: Any) -> Any:
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
  read (`_fit_read`).
  """
  shape, dtype = _shape_dtype(expected)
  stored_shape, stored_dtype = _shape_dtype(stored)
  fit = _state_dict.leaf_fit(stored_shape, stored_dtype, shape, dtype)
  where = _state_dict.key_path_str(path)
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


def _problems(expected: Mapping[Path, Any], stored: Mapping[Path, Any]) -> list[str]:
  """Every missing key, unexpected key and shape or dtype mismatch, by path."""
  problems = [
    f"missing key '{_state_dict.key_path_str(path)}' (the target has {_describe(leaf)} there)"
    for path, leaf in expected.items()
    if path not in stored
  ]
  problems += [
    f"unexpected key '{_state_dict.key_path_str(path)}' ({_describe(leaf)})"
    for path, leaf in stored.items()
    if path not in expected
  ]
  for path, leaf in expected.items():
    if path in stored:
      problem = _leaf_problem(path, leaf, stored[path])
      if problem is not None:
        problems.append(problem)
  return problems


def _as_read(expected: Any, stored: Any) -> Any:
  """How to read a leaf: in the target's dtype when that cast is exact.

  Otherwise (a float that rounds, an integer whose values must be checked)
  the leaf is read in its stored dtype, so its checksum is verified on the
  data as written, and `_fit_read` casts it.
  """
  shape, dtype = _shape_dtype(expected)
  stored_dtype = _shape_dtype(stored)[1]
  if _state_dict.leaf_fit(shape, stored_dtype, shape, dtype) is _state_dict.Fit.EXACT:
    return expected
  return jax.ShapeDtypeStruct(shape, stored_dtype, sharding=getattr(expected, "sharding", None))


@functools.partial(jax.jit, static_argnames="dtype")
def _astype(x: jax.Array, dtype: np.dtype) -> jax.Array:
  return x.astype(dtype)


def _fit_read(
  read: Mapping[Path, Any], expected: Mapping[Path, Any]
) -> tuple[dict[Path, Any], list[str]]:
  """The leaves read, each in its target dtype, and the values that do not fit it.

  A leaf read in another dtype (`_as_read`) is cast, in its sharding, when
  `_state_dict.leaf_fit` allows: always between floats, into integers when
  `_state_dict.values_fit`. Returns the cast leaves and a problem per leaf
  whose values do not fit.
  """
  cast, problems = {}, []
  for path, leaf in read.items():
    dtype = _shape_dtype(expected[path])[1]
    if leaf.dtype == dtype:
      cast[path] = leaf
      continue
    fit = _state_dict.leaf_fit(leaf.shape, leaf.dtype, leaf.shape, dtype)
    if fit is _state_dict.Fit.IF_VALUES_FIT and not _state_dict.values_fit(leaf, dtype):
      problems.append(
        f"dtype mismatch at '{_state_dict.key_path_str(path)}': the checkpoint's "
        f"{leaf.dtype} values are not all whole numbers within the target's {dtype}"
      )
    else:
      cast[path] = _astype(leaf, dtype)
  return cast, problems


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


def _restore_args(expected: Mapping[Path, Any]) -> tuple[dict[str, Any], Any]:
  """The orbax restore target (abstract arrays) and its per-leaf restore args."""
  abstract = traverse_util.unflatten_dict({p: _abstract_leaf(x) for p, x in expected.items()})
  return abstract, ocp.checkpoint_utils.construct_restore_args(abstract)


def _rewrap_keys(restored: Mapping[Path, Any], target: Mapping[Path, Any]) -> dict[Path, Any]:
  """Turns the `key_data` read for the target's typed PRNG keys back into keys."""
  return {
    path: jax.random.wrap_key_data(leaf, impl=_key_impl(target[path].dtype))
    if _state_dict.is_prng_key(target[path])
    else leaf
    for path, leaf in restored.items()
  }


def _optimizer_of(target: CheckpointState) -> Optimizer:
  if isinstance(target, TrainState):
    return target.optimizer
  if isinstance(target, Optimizer):
    return target
  raise TypeError(
    f"params_only=True needs a TrainState or an Optimizer, got {type(target).__name__}."
  )


def _fresh_param_states(target: CheckpointState, params: Mapping[str, Any]) -> Any:
  """The optimizer's initial per-param state for `params`, in the target's shardings.

  Runs the definition's `init_state` under `jax.jit` with the shardings of
  the target's optimizer state as `out_shardings`, so each device only ever
  holds its own shards.
  """
  optimizer = _optimizer_of(target)
  leaves, treedef = jax.tree.flatten(optimizer.state.param_states)
  shardings = [getattr(leaf, "sharding", None) for leaf in leaves]
  out_shardings = None if None in shardings else treedef.unflatten(shardings)
  init = jax.jit(
    lambda p: optimizer.optimizer_def.init_state(p).param_states, out_shardings=out_shardings
  )
  return init(serialization.from_state_dict(optimizer.target, params))


def _is_params_only_path(path: Path) -> bool:
  return path[0] in (_TARGET, _FLAX_MUTABLES) or path == (_STATE, _STEP)


def _any_path(path: Path) -> bool:
  del path
  return True


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


def _dispatch_checksums(
  leaves: Mapping[Path, Any], dtypes: Mapping[Path, np.dtype] | None = None
) -> dict[str, jax.Array]:
  """`_checksum` of every leaf, keyed by joined path.

  At most `_IN_FLIGHT` programs run at once; the last of them are returned
  still computing.
  """
  dtypes = dtypes or {}
  pending = {}
  for i, (path, leaf) in enumerate(leaves.items()):
    if i and i % _IN_FLIGHT == 0:
      jax.block_until_ready(list(pending.values())[-_IN_FLIGHT:])
    pending[_state_dict.key_path_str(path)] = _checksum(leaf, dtypes.get(path))
  return pending


def _fetch(pending: Mapping[str, jax.Array]) -> dict[str, int]:
  return {path: int(value) for path, value in jax.device_get(dict(pending)).items()}


class _ChecksumsHandler(ocp.AsyncCheckpointHandler):
  """Writes a step's checksums as JSON, in the background, once they are computed.

  The last checksums may still be computing on the devices when the save
  starts; the file is written once they are done, as part of the step's
  atomic commit. Only the primary process writes (the
  checksums are global).
  """

  def _write(self, directory: epath.Path, pending: Mapping[str, jax.Array]) -> None:
    checksums = _fetch(pending)
    if jax.process_index() == 0:
      (directory / _CHECKSUMS_FILE).write_text(json.dumps(checksums, sort_keys=True))

  async def _write_async(self, directory: epath.Path, pending: Mapping[str, jax.Array]) -> None:
    self._write(directory, pending)

  async def async_save(
    self, directory: epath.Path, args: _ChecksumsArgs
  ) -> list[ocp.future.Future]:
    return [
      ocp.future.CommitFutureAwaitingContractedSignals(
        self._write_async(directory, args.pending), name="t5x_optim_checksums"
      )
    ]

  def save(self, directory: epath.Path, args: _ChecksumsArgs) -> None:
    self._write(directory, args.pending)

  def restore(self, directory: epath.Path, args: Any = None) -> dict[str, int]:
    del args
    return json.loads((directory / _CHECKSUMS_FILE).read_text())


@ocp.args.register_with_handler(_ChecksumsHandler, for_save=True, for_restore=True)
@dataclasses.dataclass
class _ChecksumsArgs(ocp.args.CheckpointArgs):
  """The checksums of a step's arrays, by joined path, as pending jax scalars.

  Orbax needs one registered argument type per handler to save and to
  restore; restoring takes no arguments (`Checkpointer` reads the file).
  """

  pending: Mapping[str, jax.Array] = dataclasses.field(default_factory=dict)


class _WriterLock:
  """An exclusive `fcntl.flock` on ``<directory>/.t5x_optim.lock``.

  The kernel drops the lock when its file is closed or its process dies, so
  a crashed writer never leaves the directory locked. Only the primary
  process of a multi-process job locks (it is the one that finalises steps);
  the outcome is broadcast so that every process fails together. Paths with
  a scheme (``gs://...``) and systems without ``fcntl`` are not locked:
  object stores have no flock.
  """

  def __init__(self, directory: str):
    self._path = os.path.join(directory, _LOCK_FILE)
    self._file = None
    self.held = False

  def acquire(self, where: str, step: int) -> None:
    """Takes the lock, or raises `CheckpointError` saying why it cannot."""
    problem = ""
    if jax.process_index() == 0 and fcntl is not None and "://" not in self._path:
      problem = self._try_lock()
    if jax.process_count() > 1:
      locked = multihost_utils.broadcast_one_to_all(np.int32(not problem))
      problem = problem or ("" if int(locked) else "is in use (seen by process 0)")
    self.held = not problem
    if problem:
      self.release()
      raise CheckpointError(
        f"Cannot save step {step}: {where} {problem}. Only one Checkpointer may write into a "
        f"directory; its lock is {self._path}.",
        step=step,
      )

  def _try_lock(self) -> str:
    """Locks and records this process in the lock file; or says why it cannot."""
    try:
      file = open(self._path, "a+")  # noqa: SIM115 - held open while locked.
    except OSError as e:
      return f"cannot be locked ({e})"
    try:
      fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      file.seek(0)
      holder = file.read().strip() or "another process"
      file.close()
      return f"is in use by another writer ({holder})"
    file.seek(0)
    file.truncate()
    file.write(f"pid {os.getpid()} on {socket.gethostname()}")
    file.flush()
    self._file = file
    return ""

  def release(self) -> None:
    self.held = False
    if self._file is not None:
      self._file.close()
      self._file = None


class _Open:
  """A checkpointer's orbax manager and writer lock: what closing releases."""

  def __init__(self, manager: ocp.CheckpointManager, lock: _WriterLock):
    self.manager, self.lock = manager, lock

  def close(self) -> None:
    """Finishes pending saves, then releases the lock (also if they fail)."""
    try:
      self.manager.close()
    finally:
      self.lock.release()


class Checkpointer:
  """Saves and restores train states or optimizers as sharded orbax checkpoints.

  Steps live in ``directory/<step>``. Saves are asynchronous by default:
  `save` returns once the arrays are copied off the devices and the files are
  written in the background; call `wait_until_finished` (or `close`) before
  relying on them. All processes of a multi-process job must call `save`,
  `restore` and `close` together with the same arguments.

  Any number of checkpointers may read a directory, but only one may write:
  the first `save` locks the directory until `close` (or the death of the
  process), and a `save` by another checkpointer meanwhile raises
  `CheckpointError` at once, before anything is written. Only a writer
  removes the partial steps left by a crash, so a reader never deletes a
  step that a writer is still completing.

  Args:
    directory: the checkpoint directory (created if missing).
    keep: keep only the newest `keep` steps (None keeps all).
    async_save: write in the background (`False` blocks in `save`).

  Example:
    >>> import tempfile, jax.numpy as jnp
    >>> from t5x_optim import optimizers
    >>> opt = optimizers.sgd(0.1).create({'w': jnp.ones(2)})
    >>> with Checkpointer(tempfile.mkdtemp(), async_save=False) as ckpt:
    ...   ckpt.save(7, opt)
    ...   ckpt.all_steps(), ckpt.latest_step()
    ([7], 7)
  """

  def __init__(
    self, directory: str | os.PathLike[str], *, keep: int | None = None, async_save: bool = True
  ):
    if keep is not None and keep < 1:
      raise ValueError(f"keep must be None or at least 1, got {keep}.")
    self._directory = os.fspath(directory)
    # How the manager names step directories by default (passing it as
    # `step_name_format` would make every restore list the directory).
    self._step_names = ocp.step.standard_name_format()
    self._keep, self._async_save = keep, async_save
    self._restored_step: int | None = None
    self._open = _Open(self._new_manager(writer=False), _WriterLock(self._directory))
    # Closes a checkpointer that was never closed when it is collected or at
    # interpreter exit: pending saves finish, then the lock is released.
    self._finalizer = weakref.finalize(self, self._open.close)

  def _new_manager(self, *, writer: bool) -> ocp.CheckpointManager:
    """An orbax manager of the directory; only a writer's removes partial steps."""
    options = ocp.CheckpointManagerOptions(
      max_to_keep=self._keep,
      enable_async_checkpointing=self._async_save,
      cleanup_tmp_directories=writer,
      create=True,
    )
    handlers = {
      _ARRAYS: ocp.PyTreeCheckpointHandler(),
      _CHECKSUMS: _ChecksumsHandler(),
    }
    return ocp.CheckpointManager(self._directory, options=options, item_handlers=handlers)

  @property
  def _manager(self) -> ocp.CheckpointManager:
    return self._open.manager

  @property
  def directory(self) -> str:
    """The checkpoint directory."""
    return self._directory

  def __enter__(self) -> Self:
    return self

  def __exit__(self, *exc_info: object) -> None:
    self.close()

  def all_steps(self) -> list[int]:
    """The saved steps, ascending.

    These are the complete checkpoints found on disk (partial ones from a
    crash never count) plus this checkpointer's own saves still in flight;
    call `wait_until_finished` first to list only complete ones.
    """
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    """The newest of `all_steps`, or None when there is none."""
    return self._manager.latest_step()

  def save(self, step: int, state: CheckpointState) -> None:
    """Saves `state`'s state dict as checkpoint `step`.

    Each process writes the shards it holds. With `async_save` this returns
    once the arrays are copied off the devices, before the files are
    complete; the step becomes a checkpoint directory only when they are.
    The checksum of every array is computed on its devices and saved in the
    same atomic commit.

    Args:
      step: the step number; must be newer than every saved step.
      state: a `TrainState` or an `Optimizer` (arrays may be sharded).

    Raises:
      ValueError: when `step` is not newer than the latest saved step.
      CheckpointError: another checkpointer writes into this directory.
    """
    step = int(step)
    if not self._open.lock.held:
      self._become_writer(step)
    latest = self.latest_step()
    if latest is not None and step <= latest:
      raise ValueError(
        f"Cannot save step {step} in {self._directory}: step {latest} is already saved "
        "and steps must increase."
      )
    state_dict = jax.tree.map(_saveable, state.state_dict())
    checksums = _dispatch_checksums(_flatten(state_dict))
    args = ocp.args.Composite(
      **{_ARRAYS: ocp.args.PyTreeSave(state_dict), _CHECKSUMS: _ChecksumsArgs(checksums)}
    )
    self._manager.save(step, args=args, force=True)

  def _become_writer(self, step: int) -> None:
    """Locks the directory, then reopens it as its writer (removing partial steps)."""
    self._open.lock.acquire(f"checkpoint directory {self._directory}", step)
    self._open.manager.close()
    self._open.manager = self._new_manager(writer=True)

  def wait_until_finished(self) -> None:
    """Blocks until every pending asynchronous save is complete."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Finishes pending saves, releases the manager's resources and the lock."""
    self._finalizer()

  @property
  def restored_step(self) -> int | None:
    """The step the last successful `restore` read (None before any)."""
    return self._restored_step

  def _where(self, step: int) -> str:
    return f"Checkpoint step {step} in {self._directory}"

  def _item(self, step: int, name: str = _ARRAYS) -> epath.Path:
    """The directory orbax writes item `name` of checkpoint `step` to."""
    return epath.Path(self._directory) / self._step_names.build_name(step) / name

  def _recorded_checksums(self, step: int) -> dict[str, int]:
    """The checksums saved with step `step`, by joined array path."""
    path = self._item(step, _CHECKSUMS) / _CHECKSUMS_FILE
    try:
      recorded = json.loads(path.read_text())
      if not isinstance(recorded, dict):
        raise ValueError(f"expected a JSON object, got {type(recorded).__name__}")
      return {str(key): int(value) for key, value in recorded.items()}
    except (OSError, ValueError, TypeError) as e:
      raise CheckpointError(
        f"{self._where(step)} has no readable checksums ({path}): {e}. A step written "
        "before checksums existed restores with verify=False, unverified.",
        step=step,
      ) from e

  def _holds_only_t5x_checkpoints(self) -> bool:
    """Whether the directory has T5X's checkpoints and none of ours."""
    self._manager.wait_until_finished()
    if self.all_steps():
      return False
    self._manager.reload()
    return not self.all_steps() and bool(t5x_checkpoints.t5x_checkpoint_steps(self._directory))

  def _resolve_step(self, step: int | None) -> int:
    """The step to restore, from complete checkpoints only.

    Pending saves are finished first. An explicit step this checkpointer
    already knows (it saved or listed it) and that is still on disk needs no
    re-read of the directory; otherwise the directory is re-read, so steps
    written by other processes are seen.
    """
    self._manager.wait_until_finished()
    if step is not None:
      step = int(step)
    if step is None or step not in self._manager.all_steps() or not self._item(step).exists():
      self._manager.reload()
    steps = self.all_steps()
    if step is None:
      if not steps:
        raise FileNotFoundError(f"No complete checkpoint in {self._directory}.")
      return steps[-1]
    if step not in steps:
      raise FileNotFoundError(
        f"No complete checkpoint for step {step} in {self._directory}; the steps are {steps}."
      )
    return step

  def _check(self, step: int, expected: Mapping[Path, Any], stored: Mapping[Path, Any]) -> None:
    problems = _problems(expected, stored)
    if problems:
      self._refuse(step, problems)

  def _refuse(self, step: int, problems: list[str]) -> NoReturn:
    raise ValueError(
      f"{self._where(step)} does not fit the target: {'; '.join(problems)}. Nothing was restored."
    )

  def _read(self, step: int, expected: Mapping[Path, Any], *, partial: bool) -> dict[Path, Any]:
    """Reads the `expected` leaves of checkpoint `step` into their shardings."""
    abstract, restore_args = _restore_args(expected)
    args = ocp.args.PyTreeRestore(abstract, restore_args=restore_args, partial_restore=partial)
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(**{_ARRAYS: args}))
    except Exception as e:  # noqa: BLE001 - tensorstore raises bare Exceptions.
      cause = _root_cause(e)
      at = [f"'{_state_dict.key_path_str(p)}'" for p in expected if f'"{".".join(p)}/' in cause]
      raise CheckpointError(
        f"{self._where(step)} could not be read at {', '.join(at) or self._item(step)}: {cause}",
        step=step,
      ) from e
    return traverse_util.flatten_dict(dict(restored[_ARRAYS]))

  def _verify(
    self, step: int, pending: Mapping[str, jax.Array], recorded: Mapping[str, int]
  ) -> None:
    """Raises `CheckpointError` naming every array whose checksum differs."""
    actual = _fetch(pending)
    wrong = [
      f"'{path}' (recorded {recorded[path]:#010x}, read {value:#010x})"
      for path, value in actual.items()
      if recorded[path] != value
    ]
    if wrong:
      raise CheckpointError(
        f"{self._where(step)} is corrupt: the checksum differs at {', '.join(wrong)}.",
        step=step,
      )

  def _restore_step(
    self, target: CheckpointState, step: int, *, params_only: bool, verify: bool
  ) -> CheckpointState:
    """`restore` of exactly `step`: check, read, build the state, verify.

    The checksums of the arrays read are computed on their devices while the
    state is built; a mismatch discards that state.
    """
    wanted = _is_params_only_path if params_only else _any_path
    stored = _open_stored(self._item(step), self._where(step), step, wanted)
    target_leaves = {p: x for p, x in _flatten(target.state_dict()).items() if wanted(p)}
    expected = {path: _as_stored(leaf) for path, leaf in target_leaves.items()}
    self._check(step, expected, stored)
    if verify:
      recorded = self._recorded_checksums(step)
      unrecorded = [
        f"'{_state_dict.key_path_str(p)}'"
        for p in expected
        if _state_dict.key_path_str(p) not in recorded
      ]
      if unrecorded:
        raise CheckpointError(
          f"{self._where(step)} has no checksum recorded for {', '.join(unrecorded)}.",
          step=step,
        )
    as_read = {path: _as_read(leaf, stored[path]) for path, leaf in expected.items()}
    restored = self._read(step, as_read, partial=params_only)
    if verify:
      # Checked in the stored dtype: the exact casts read in the target's dtype reverse exactly.
      dtypes = {p: stored[p].dtype for p, x in restored.items() if x.dtype != stored[p].dtype}
      pending = _dispatch_checksums(restored, dtypes)
    restored, unfit = _fit_read(restored, expected)
    if unfit:
      if verify:
        self._verify(step, pending, recorded)  # Corrupt data is not the target's fault.
      self._refuse(step, unfit)
    state_dict = traverse_util.unflatten_dict(_rewrap_keys(restored, target_leaves))
    if params_only:
      state_dict[_STATE][_PARAM_STATES] = _state_dict.to_pruned_state_dict(
        _fresh_param_states(target, state_dict[_TARGET])
      )
    state = target.restore_state(state_dict)
    if verify:
      self._verify(step, pending, recorded)
    return state

  def restore(
    self,
    target: CheckpointState,
    step: int | None = None,
    *,
    params_only: bool = False,
    fallback: bool = False,
    verify: bool = True,
    convert_from: Any = None,
  ) -> CheckpointState:
    """Restores checkpoint `step` into `target`'s structure and shardings.

    `target` is only a template and is never modified: its leaves may be real
    arrays or `jax.ShapeDtypeStruct`s with shardings (see
    `partitioning.abstract_train_state`). Each array is read straight into
    its target sharding, whatever mesh or device count the checkpoint was
    saved from; no unsharded copy is made. Every array read is checked
    against the checksum saved with it. Each leaf comes back in the
    target's dtype, by the rule `Optimizer.restore_state` follows: floating
    data may be cast to any floating dtype (a float32 checkpoint restores
    into bfloat16 params, as with T5X's ``restore_dtype``), an integer to a
    narrower integer, or a float to an integer (a float32 step counter),
    when every value is a whole number that fits; another change of kind
    (complex to real) is refused. Arrays whose stored dtype casts exactly
    into the target's are read in the target's dtype and returned as read,
    without another device copy; the others are read as stored and cast
    on their devices. Pending saves of this checkpointer are finished
    first. The directory is re-read, so checkpoints written by other
    processes are seen, unless `step` is one this checkpointer already
    knows.

    Args:
      target: a `TrainState` or `Optimizer` giving structure, dtypes and
        shardings.
      step: the step to restore; None means the latest.
      params_only: restore only the params (`target`), the step counter and
        the `flax_mutables`, and start the optimizer state afresh: the
        target optimizer's `init_state` of the restored params. For
        switching optimizers (e.g. to fine-tune): the checkpoint's optimizer
        state is neither checked nor read.
      fallback: when `step` (or the latest) raises `CheckpointError`, try
        the older steps, newest first, and restore the first intact one.
        Each step skipped is logged as a warning with its error; the step
        used is logged and is `restored_step` afterwards.
      verify: check every array against its recorded checksum. Only for
        steps written before checksums existed: False restores them
        unverified.
      convert_from: the optimizer that wrote the checkpoint, when `target`
        has another (its definition or an abstract state of it; True: T5X's
        legacy Adafactor): params restored exactly, the optimizer state
        converted, see `t5x_optim.restore_converted`.

    A directory that holds no t5x_optim checkpoint but T5X's
    ``checkpoint_<step>`` directories (legacy or Orbax format) is restored
    with `t5x_checkpoints.restore_t5x_checkpoint` (T5X's format has no
    checksums, and no `params_only` or `fallback`).

    Returns:
      A new object of `target`'s type holding real, sharded arrays.

    Raises:
      FileNotFoundError: no complete checkpoint (for `step`).
      ValueError: the checkpoint does not fit the target (missing or
        unexpected keys, e.g. another optimizer's state; other shapes;
        dtypes of another kind), checked on the metadata before any array
        is read and naming every such path; or a stored array whose values
        are not all whole numbers within the target's integer dtype, which
        can only be checked once read (after its checksum). Never retried by
        `fallback`: it is the target that is wrong.
      CheckpointError: the step's files are missing, unreadable or corrupt
        (with `fallback`: those of every step tried), naming the step and the
        array path.
    """
    if convert_from is not None:
      from t5x_optim._training import convert_checkpoint  # noqa: PLC0415 - it imports this one

      restored = convert_checkpoint.restore_with_conversion(
        self._directory, target, convert_from, step
      )
      self._restored_step = int(_optimizer_of(restored).state.step)
      return restored
    if self._holds_only_t5x_checkpoints():
      if params_only or fallback:
        raise ValueError(
          f"{self._directory} holds T5X checkpoints, which restore with neither "
          "params_only nor fallback."
        )
      restored = t5x_checkpoints.restore_t5x_checkpoint(self._directory, target, step=step)
      self._restored_step = (
        t5x_checkpoints.latest_t5x_step(self._directory) if step is None else step
      )
      return restored
    step = self._resolve_step(step)
    candidates = [s for s in reversed(self.all_steps()) if s <= step] if fallback else [step]
    errors = []
    for candidate in candidates:
      try:
        restored = self._restore_step(target, candidate, params_only=params_only, verify=verify)
      except CheckpointError as e:
        if not fallback:
          raise
        _log.warning("Skipping checkpoint step %d: %s", candidate, e)
        errors.append(e)
        continue
      self._restored_step = candidate
      if errors:
        _log.warning("Restored checkpoint step %d of %s instead.", candidate, self._directory)
      return restored
    raise CheckpointError(
      f"No intact checkpoint up to step {step} in {self._directory}: "
      + "; ".join(str(e) for e in errors),
      step=step,
    ) from errors[-1]
