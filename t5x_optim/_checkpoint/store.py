"""Implementation of `t5x_optim.checkpoints`, documented there."""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import logging
import numbers
import os
import signal
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NoReturn, Protocol, Self

import jax
import orbax.checkpoint as ocp
from etils import epath
from flax import traverse_util
from jax.experimental import multihost_utils

from t5x_optim._checkpoint import storage
from t5x_optim._checkpoint import t5x_read as t5x_checkpoints
from t5x_optim._checkpoint.checksums import (
  CHECKSUMS_FILE,
  ChecksumsArgs,
  ChecksumsHandler,
  dispatch_checksums,
  fetch,
  x32_values,
  x64_words,
)
from t5x_optim._checkpoint.headers import open_stored
from t5x_optim._checkpoint.leaves import (
  CheckpointError,
  Path,
  as_read,
  as_stored,
  checked_step,
  class_problems,
  empty_leaf,
  fit_read,
  flatten,
  leaf_problems,
  listed,
  optimizer_state_classes,
  orbax_restore_args,
  rewrap_keys,
  root_cause,
  rounded_floats,
  saveable,
  shared_names,
  zero_size_record,
  zero_size_stored,
)
from t5x_optim._checkpoint.lock import WriterLock
from t5x_optim._convert.convert import fresh_state
from t5x_optim._core.interface import Optimizer
from t5x_optim._core.placement import placed_as_target
from t5x_optim._keypaths import key_path_str
from t5x_optim._training.train_state import TrainState
from t5x_optim._warn import warn

__all__ = ["CheckpointError", "CheckpointState", "Checkpointer", "is_committed_step"]

ANOTHER_OPTIMIZER = (
  " (another optimizer: restore with params_only=True to start its state afresh, "
  "or with convert_from= to convert it)"
)
"""The advice on a state-class mismatch, which a restore with ``convert_from=`` leaves out."""

_log = logging.getLogger("t5x_optim.checkpoints")

_TARGET = "target"
_STATE = "state"
_STEP = "step"
_PARAM_STATES = "param_states"
_FLAX_MUTABLES = "flax_mutables"
_ARRAYS = ocp.checkpoint_manager.DEFAULT_ITEM_NAME
_CHECKSUMS = "checksums"
_STATE_CLASSES = "state_classes"
_JOB = "job"
# The zero-size arrays of a step, which orbax cannot write: their paths, shapes and dtypes.
_ZERO_SIZE = "zero_size_arrays"
# The file orbax's JsonCheckpointHandler writes an item to.
_JSON_FILE = "metadata"
# A replicated array whose slice per replica would be smaller is written whole
# by one replica (`_arrays_handler`).
_MIN_REPLICA_SLICE_BYTES = 1 << 20
# What orbax writes into a step's directory when its save completes (locally, and on
# object stores, where nothing is renamed).
_COMMIT_RECORDS = ("_CHECKPOINT_METADATA", "commit_success.txt")
"""Files of a committed step: where orbax renames a complete step into place, either one; on
``gs://`` it writes the step in place, ``_CHECKPOINT_METADATA`` first, so only `_GCS_COMMIT`."""
_GCS_COMMIT = ("commit_success.txt",)
_SYNC_CALLS = itertools.count(1)
"""The number of each `Checkpointer.reached_preemption` call in this process, from 1: jax's
preemption sync point counts calls, not steps."""


def is_committed_step(directory: str | os.PathLike[str]) -> bool:
  """Whether `directory`, a step of a checkpoint directory, holds orbax's record of a completed
  save: on ``gs://`` `_GCS_COMMIT`, elsewhere either of `_COMMIT_RECORDS`.

  A step directory without it (an empty or partly copied ``<step>/``, or on
  ``gs://`` a save that was cut short) is not a checkpoint, whatever its name.

  Example:
    >>> import pathlib, tempfile
    >>> step = pathlib.Path(tempfile.mkdtemp()) / '3'
    >>> step.mkdir()
    >>> is_committed_step(step)
    False
    >>> _ = (step / 'commit_success.txt').write_text('')
    >>> is_committed_step(step)
    True
  """
  path = storage.as_path(directory)
  records = _GCS_COMMIT if storage.scheme_of(path) == "gs" else _COMMIT_RECORDS
  return any((path / name).exists() for name in records)


class CheckpointState(Protocol):
  """What `Checkpointer` saves and restores: a `TrainState` or an `Optimizer`."""

  def state_dict(self) -> dict[str, Any]:
    """The T5X-layout state dict."""

  def restore_state(self, state_dict: Mapping[str, Any]) -> Self:
    """A copy restored from a T5X-layout state dict."""


def optimizer_of(target: CheckpointState) -> Optimizer:
  if isinstance(target, TrainState):
    return target.optimizer
  if isinstance(target, Optimizer):
    return target
  raise TypeError(
    f"params_only=True needs a TrainState or an Optimizer, got {type(target).__name__}."
  )


def _fresh_param_states(target: CheckpointState, params: Mapping[str, Any]) -> Any:
  """The state dict's ``param_states`` of the optimizer's initial state for `params`, in
  the shardings of the target's optimizer state (`fresh_state`); the definition's own
  `state_dict` lays it out (a MultiOptimizer's per-param layout included)."""
  optimizer = optimizer_of(target)
  # The definition lays the params out (a stacked layout stacks them); its state is kept as is.
  own_state = optimizer.state_dict()[_STATE]
  restored_params = optimizer.restore_state({_TARGET: params, _STATE: own_state}).target
  fresh = fresh_state(optimizer.optimizer_def, restored_params, optimizer.state)
  fresh = optimizer.state.replace(param_states=fresh.param_states)
  state = optimizer.optimizer_def.state_dict(restored_params, fresh)[_STATE]
  return state.get(_PARAM_STATES, {})


def _warn_of_narrowed_state(
  step: int, expected: Mapping[Path, Any], stored: Mapping[Path, Any]
) -> None:
  """Warns where the target holds an optimizer-state float in a dtype that cannot hold the
  checkpoint's exactly (float32 data, bfloat16 target): optax's adam keeps ``mu`` in float32
  after its first update when bfloat16 params get float32 gradients, while a freshly
  created target holds it in the params' dtype, so a resume would round it and drift."""
  narrowed = rounded_floats({p: x for p, x in expected.items() if p[0] == _STATE}, stored)
  if narrowed:
    more = f" and {len(narrowed) - 3} more" if len(narrowed) > 3 else ""
    warn(
      f"Restoring checkpoint step {step} rounds optimizer-state floats to a narrower dtype "
      f"at {', '.join(narrowed[:3])}{more}, so what follows goes on from rounded values, not "
      "bit for bit. optax's adam keeps mu in float32 after its first update when bfloat16 "
      "params get float32 gradients, while a freshly created optimizer holds it in the "
      "params' dtype: give Checkpointer.restore a target in the saved dtypes (those of the "
      "state after a step), or fix the moment's dtype in the optimizer (adam's mu_dtype) "
      "before the run that writes the checkpoints."
    )


def _is_params_only_path(path: Path) -> bool:
  return path[0] in (_TARGET, _FLAX_MUTABLES) or path == (_STATE, _STEP)


def _any_path(path: Path) -> bool:
  del path
  return True


class _SigtermFlag:
  """Records SIGTERM in a single process for the checkpointers that listen for it.

  One handler serves them all: the first to listen installs it, and one that starts
  listening after another handler replaced it installs it again, over that one. Each
  install runs the handler it replaced, so a handler installed in between still runs,
  once. The last to stop (whatever order they stop in) puts back the handler that the
  latest install replaced, if that install is still the process's handler: the one
  installed before the first install when no other came in between (the default action
  for a handler installed outside Python, which cannot be put back). A SIGTERM while any
  listens is `received` by every listener until the last stops.
  """

  def __init__(self) -> None:
    self.received = False
    self._installed: Any = None
    self._replaced: Any = None
    self._listeners = 0
    # Reentrant: a checkpointer collected while another starts listening stops in between.
    self._count = threading.RLock()

  def listen(self) -> bool:
    """Counts one more listener; False outside the main thread (signals go there only)."""
    if threading.current_thread() is not threading.main_thread():
      return False
    with self._count:
      if not self._listeners:
        self.received = False
      current = signal.getsignal(signal.SIGTERM)
      if self._installed is None or current is not self._installed:
        self._installed, self._replaced = self._handler(current), current
        signal.signal(signal.SIGTERM, self._installed)
      self._listeners += 1
    return True

  def _handler(self, replaced: Any) -> Callable[[int, Any], None]:
    """A handler that sets the flag while any listens, then runs `replaced` if it is a
    Python handler. While none listens it is as if it had never been installed: still the
    process's handler (the last stopped outside the main thread), it puts `replaced` back
    and passes the signal to it; run by a later handler, it runs `replaced` if callable."""

    def handle(signum: int, frame: Any) -> None:
      if self._listeners:
        self.received = True
      elif signal.getsignal(signum) is handle:
        signal.signal(signum, _settable(replaced))
        signal.raise_signal(signum)
        return
      if callable(replaced):
        replaced(signum, frame)

    return handle

  def stop_listening(self) -> None:
    """Counts one listener fewer; the last puts the replaced handler back, if this one is
    still the process's (outside the main thread, the next SIGTERM does so, then goes to it)."""
    with self._count:
      self._listeners -= 1
      if self._listeners:
        return
      if (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGTERM) is self._installed
      ):
        signal.signal(signal.SIGTERM, _settable(self._replaced))


def _settable(handler: Any) -> Any:
  """`handler`, or the default action for one Python cannot install again (a handler
  installed outside Python, which ``signal.getsignal`` gives as None)."""
  return signal.SIG_DFL if handler is None else handler


_SIGTERM = _SigtermFlag()
"""The process's SIGTERM flag, shared by its checkpointers (`Checkpointer.reached_preemption`)."""


def _taking_turns(method: Callable[..., Any]) -> Callable[..., Any]:
  """`method` of a `Checkpointer`, run by one thread at a time (its `_Open.turn`)."""

  @functools.wraps(method)
  def one_at_a_time(self: Checkpointer, *args: Any, **kwargs: Any) -> Any:
    with self._open.turn:
      return method(self, *args, **kwargs)

  return one_at_a_time


class _Open:
  """A checkpointer's orbax manager, writer lock and SIGTERM listening: what closing releases."""

  def __init__(self, manager: ocp.CheckpointManager, lock: WriterLock):
    self.manager, self.lock = manager, lock
    self.hears_sigterm = False
    # One call at a time into the manager: saves from several threads take turns.
    self.turn = threading.RLock()

  def close(self) -> None:
    """Finishes pending saves, then releases the lock (also if they fail)."""
    try:
      self.manager.close()
    finally:
      self.lock.release()
      if self.hears_sigterm:
        self.hears_sigterm = False
        _SIGTERM.stop_listening()


def _arrays_handler() -> ocp.PyTreeCheckpointHandler:
  """orbax's PyTree handler, slicing only large replicated arrays.

  orbax writes a replicated array replica-parallel: one slice per replica,
  each copied off its own device. A small slice gains nothing from that and
  costs a device program per slice shape, compiled at the first save (1.9 s
  of a 1-step run of `examples/tiny.gin` on 8 CPU devices), and a dispatch per
  slice at every save. Below `_MIN_REPLICA_SLICE_BYTES` a replica, the array is
  written by one replica, as it is on GPUs, where orbax never slices.
  """
  default = ocp.type_handlers.get_type_handler(jax.Array)
  arrays = ocp.type_handlers.ArrayHandler(
    min_slice_bytes_for_replica_parallel=_MIN_REPLICA_SLICE_BYTES,
    # orbax's own array handler records each array's metadata in this store.
    array_metadata_store=getattr(default, "_array_metadata_store", None),
  )
  handlers = [
    (ty, arrays if ty is jax.Array else ocp.type_handlers.get_type_handler(ty))
    for ty in ocp.type_handlers.supported_types()
  ]
  registry = ocp.type_handlers.create_type_handler_registry(*handlers)
  return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)


def _close_before_threads_stop(close: Callable[[], Any]) -> None:
  """Runs `close` when the interpreter exits, before it stops the thread pools.

  ``weakref.finalize`` runs at ``atexit``, after Python has shut down the
  ``concurrent.futures`` pools that orbax commits an asynchronous save with:
  a save still pending then failed (or hung) and the script exited 0 with the
  step lost. Python runs the calls registered with ``threading``'s exit hook
  (where ``concurrent.futures`` registers its own shutdown) last first, so one
  registered after that module was imported runs while the pools still work.
  Where the hook is missing (another Python), ``atexit`` alone remains.
  """
  register = getattr(threading, "_register_atexit", None)
  if register is None:
    return
  with contextlib.suppress(RuntimeError):  # The interpreter is exiting already.
    register(close)


def _refuse_linked_steps(directory: os.PathLike[str], keep: int) -> None:
  """Raises `CheckpointError` for a step directory in local `directory` that is a symbolic
  link: orbax's rotation fails on it at every save (``rmtree``) and keeps every step."""
  names = os.listdir(directory) if os.path.isdir(directory) else []
  links = sorted(
    int(name) for name in names if name.isdigit() and os.path.islink(os.path.join(directory, name))
  )
  if links:
    step = links[0]
    link = os.path.join(directory, str(step))
    raise CheckpointError(
      f"Cannot keep the newest {keep} steps in {directory}: step {step} is a symbolic link "
      f"({link} -> {os.readlink(link)}), which rotating it away cannot delete; replace it with "
      "a copy of what it links to, or remove it.",
      step=step,
    )


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
  `CheckpointError` at once, before anything is written. On an object store
  (``gs://bucket/dir``) the lock is a lease object written with generation
  preconditions, which a crashed writer leaves for at most a minute. Only a writer
  removes the partial steps left by a crash, so a reader never deletes a
  step that a writer is still completing.

  Args:
    directory: the checkpoint directory (created if missing): local (a
      relative one is below the working directory when the checkpointer
      is made) or with a scheme (``gs://bucket/dir``; see docs/cloud-storage.md).
    keep: keep only the newest `keep` steps (None keeps all).
    async_save: write in the background (`False` blocks in `save`).
    job: a JSON object describing the job that writes the checkpoints (its
      model, optimizer, config), recorded with every step this checkpointer
      saves, in the same atomic commit; `recorded_job` reads it back.

  Raises:
    ValueError: ``keep`` not a whole number >= 1, or a ``job`` that is not JSON.
    CheckpointError: with ``keep``, a local step directory that is a symbolic
      link, which rotating it away cannot delete.
    NotADirectoryError: a local ``directory`` that is a file.
    StorageError: an unsupported scheme, or an object store whose bucket or
      credentials are missing.

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
    self,
    directory: str | os.PathLike[str],
    *,
    keep: int | None = None,
    async_save: bool = True,
    job: Mapping[str, Any] | None = None,
  ):
    if keep is not None:
      if isinstance(keep, bool) or not isinstance(keep, numbers.Integral) or keep < 1:
        raise ValueError(f"keep must be None or an int >= 1, got {keep!r}.")
      keep = int(keep)
    if job is not None:
      try:
        json.dumps(dict(job))
      except (TypeError, ValueError) as e:
        raise ValueError(f"job is not JSON: {e}.") from e
    self._job = None if job is None else dict(job)
    # A local directory is absolute from here on: orbax refuses a relative one.
    path = storage.check_reachable(directory)
    if not storage.is_object_store(path) and path.exists() and not path.is_dir():
      raise NotADirectoryError(f"{path} is a file, not a checkpoint directory.")
    if keep is not None and not storage.is_object_store(path):
      _refuse_linked_steps(path, keep)
    self._directory = os.fspath(path)
    # How the manager names step directories by default (passing it as
    # `step_name_format` would make every restore list the directory).
    self._step_names = ocp.step.standard_name_format()
    self._keep, self._async_save = keep, async_save
    self._restored_step: int | None = None
    self._open = _Open(self._new_manager(writer=False), WriterLock(self._directory))
    # Closes a checkpointer that was never closed when it is collected or at
    # interpreter exit: pending saves finish, then the lock is released.
    self._finalizer = weakref.finalize(self, self._open.close)
    _close_before_threads_stop(self._finalizer)

  def _new_manager(self, *, writer: bool) -> ocp.CheckpointManager:
    """An orbax manager of the directory; only a writer's removes partial steps."""
    options = ocp.CheckpointManagerOptions(
      max_to_keep=self._keep,
      enable_async_checkpointing=self._async_save,
      cleanup_tmp_directories=writer,
      create=True,
    )
    handlers = {
      _ARRAYS: _arrays_handler(),
      _CHECKSUMS: ChecksumsHandler(),
      _STATE_CLASSES: ocp.JsonCheckpointHandler(),
      _JOB: ocp.JsonCheckpointHandler(),
      _ZERO_SIZE: ocp.JsonCheckpointHandler(),
    }
    return ocp.CheckpointManager(self._directory, options=options, item_handlers=handlers)

  @property
  def _manager(self) -> ocp.CheckpointManager:
    return self._open.manager

  @property
  def directory(self) -> str:
    """The checkpoint directory: absolute when local, with its scheme otherwise."""
    return self._directory

  def __enter__(self) -> Self:
    return self

  def __exit__(self, *exc_info: object) -> None:
    self.close()

  def all_steps(self) -> list[int]:
    """The saved steps, ascending.

    These are the complete checkpoints found on disk (partial ones from a
    crash never count) plus this checkpointer's own saves still in flight;
    call `wait_until_finished` first to list only complete ones. Until its
    first `save`, a checkpointer lists the directory at every call, so it sees
    the steps that others commit and remove (an evaluator polling
    `latest_step`); its writer, which no other may write beside, keeps the
    list of its own saves. In a multi-process job each process lists the
    directory itself: a step committed meanwhile may be listed in one process
    and not yet in another.
    """
    if self._open.lock.held:
      return sorted(self._manager.all_steps())
    return sorted(found.step for found in self._step_names.find_all(self._directory))

  def latest_step(self) -> int | None:
    """The newest of `all_steps`, or None when there is none."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  @_taking_turns
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
      ValueError: when `step` is not a non-negative integer or not newer
        than the latest saved step; nothing is written.
      CheckpointError: another checkpointer writes into this directory.
    """
    step = checked_step(step)
    arrays = {path: saveable(leaf) for path, leaf in flatten(state.state_dict()).items()}
    shared = shared_names(arrays)
    if shared:
      raise ValueError(
        f"Cannot save step {step} in {self._directory}: {'; '.join(shared)}. Nothing was "
        "written: rename one of them."
      )
    if not self._open.lock.held:
      self._become_writer(step)
    self._open.lock.check(f"checkpoint directory {self._directory}", step)
    latest = self.latest_step()
    if latest is not None and step <= latest:
      raise ValueError(
        f"Cannot save step {step} in {self._directory}: step {latest} is already saved "
        "and steps must increase."
      )
    zero_size = zero_size_record(arrays)
    empty = {tuple(entry["path"]) for entry in zero_size["arrays"]}
    arrays = {path: leaf for path, leaf in arrays.items() if path not in empty}
    checksums = dispatch_checksums(arrays)
    items = {
      _ARRAYS: ocp.args.PyTreeSave(traverse_util.unflatten_dict(arrays)),
      _CHECKSUMS: ChecksumsArgs(checksums),
    }
    if empty:
      items[_ZERO_SIZE] = ocp.args.JsonSave(zero_size)
    classes = optimizer_state_classes(state)
    if classes is not None:
      items[_STATE_CLASSES] = ocp.args.JsonSave(classes)
    if self._job is not None:
      items[_JOB] = ocp.args.JsonSave(self._job)
    with self._listed_again_on_failure():
      self._manager.save(step, args=ocp.args.Composite(**items), force=True)

  @contextlib.contextmanager
  def _listed_again_on_failure(self) -> Iterator[None]:
    """Lists the committed steps from the directory again when a save fails.

    orbax takes the steps a save rotates away off its list when the save starts; they stay
    on disk until it commits, so after a failed save (a full disk) they are still the
    checkpoints, and the next save rotates them away.
    """
    try:
      yield
    except BaseException:
      with contextlib.suppress(Exception):  # the save's error is the one to report
        self._manager.reload()
      raise

  def _become_writer(self, step: int) -> None:
    """Locks the directory, then reopens it as its writer (removing partial steps)."""
    self._open.lock.acquire(f"checkpoint directory {self._directory}", step)
    self._open.manager.close()
    self._open.manager = self._new_manager(writer=True)

  @_taking_turns
  def wait_until_finished(self) -> None:
    """Blocks until every pending asynchronous save is complete."""
    with self._listed_again_on_failure():
      self._manager.wait_until_finished()

  def reached_preemption(self, step: int) -> bool:
    """Whether the job is being preempted and `step` is the one to save before exiting.

    Call it after every train step, in every process, with the step just
    completed. Schedulers preempt with SIGTERM and a SIGKILL some seconds
    later (GKE: 30 s); once this is True, save `step`, call
    `wait_until_finished` and exit.

    In a multi-process job this is jax's preemption sync point
    (`jax.experimental.multihost_utils.reached_preemption_sync_point`, as
    orbax's ``CheckpointManager.reached_preemption``): when any process
    receives SIGTERM, the coordination service tells all of them, and this is
    True in every process at one and the same step, a step or a few after
    the signal (so all save the same step). It needs the processes to call it
    with the same steps. jax's sync point counts calls from the process's first
    (a notice before any call names the first), so the calls are numbered from
    1 whatever the step: a job resumed at step 40 and preempted during its
    restore stops at step 41. It is never True when jax's preemption service is
    disabled (``jax_enable_preemption_service``).

    In a single process the first call installs a SIGTERM handler (in the
    main thread; the Python handler it replaces still runs), and from then on
    this is True at every call after a SIGTERM. The checkpointers of a process
    share that handler: after a SIGTERM this is True in each of them until
    the last one asked is closed, and that `close` puts the replaced handler
    back, whichever of them closes first. A checkpointer's first call after
    another handler replaced the shared one installs it again over that one,
    which still runs; the last `close` then puts back the handler replaced
    last, so a handler installed in between stays. A SIGTERM before the first
    call ends the process as it would have.

    Example:
      >>> import tempfile, jax.numpy as jnp
      >>> from t5x_optim import optimizers
      >>> opt = optimizers.sgd(0.1).create({'w': jnp.ones(2)})
      >>> with Checkpointer(tempfile.mkdtemp()) as ckpt:
      ...   for step in range(1, 100):
      ...     opt = opt.apply_gradient({'w': jnp.ones(2)})
      ...     preempted = ckpt.reached_preemption(step)
      ...     if step % 50 == 0 or preempted:
      ...       ckpt.save(step, opt)
      ...     if preempted:
      ...       break
      ...   ckpt.wait_until_finished()
      ...   ckpt.all_steps()
      [50]
    """
    step = checked_step(step)
    if jax.process_count() > 1:
      try:
        return bool(multihost_utils.reached_preemption_sync_point(next(_SYNC_CALLS)))
      except RuntimeError:  # The preemption service is disabled.
        return False
    if not self._open.hears_sigterm:
      self._open.hears_sigterm = _SIGTERM.listen()
    return self._open.hears_sigterm and _SIGTERM.received

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
    path = self._item(step, _CHECKSUMS) / CHECKSUMS_FILE
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
    if self._manager.all_steps():
      return False
    self._manager.reload()
    return not self._manager.all_steps() and bool(
      t5x_checkpoints.t5x_checkpoint_steps(self._directory)
    )

  def _resolve_step(self, step: int | None) -> int:
    """The step to restore, from complete checkpoints only.

    Pending saves are finished first. An explicit step this checkpointer
    already knows (it saved or listed it) and that is still on disk needs no
    re-read of the directory; otherwise the directory is re-read, so steps
    written by other processes are seen.
    """
    self._manager.wait_until_finished()
    if step is not None:
      step = checked_step(step)
    if step is None or step not in self._manager.all_steps() or not self._item(step).exists():
      self._manager.reload()
    steps = sorted(self._manager.all_steps())
    if step is None:
      if not steps:
        raise FileNotFoundError(f"No complete checkpoint in {self._directory}.")
      return steps[-1]
    if step not in steps:
      raise FileNotFoundError(
        f"No complete checkpoint for step {step} in {self._directory}; the steps are {steps}."
      )
    return step

  def stored_leaves(self, step: int | None = None) -> dict[Path, jax.ShapeDtypeStruct]:
    """The shape and dtype of every array checkpoint `step` (None: the latest) holds.

    Read from the step's metadata and the arrays' headers; no data are read
    (a directory of T5X checkpoints, which `restore` reads too, included).
    Keys are the paths of the saved state dict's leaves.

    Example:
      >>> import tempfile, jax.numpy as jnp, optax
      >>> from t5x_optim import Checkpointer, OptaxWrapper
      >>> state = OptaxWrapper(optax.sgd(0.1)).create({'w': jnp.ones((2, 3))})
      >>> with Checkpointer(tempfile.mkdtemp(), async_save=False) as checkpointer:
      ...   checkpointer.save(1, state)
      ...   checkpointer.stored_leaves()[('target', 'w')]
      ShapeDtypeStruct(shape=(2, 3), dtype=float32)
    """
    if self._holds_only_t5x_checkpoints():
      stored = t5x_checkpoints.open_step(self._directory, step).stored
      return {path: jax.ShapeDtypeStruct(x.shape, x.dtype) for path, x in stored.items()}
    step = self._resolve_step(step)
    arrays, empty = self._opened(step, _any_path)
    return {**arrays, **empty}

  @_taking_turns
  def restore_fitted(
    self,
    fit: Callable[[Mapping[Path, jax.ShapeDtypeStruct]], CheckpointState],
    step: int | None = None,
  ) -> CheckpointState:
    """`restore` of checkpoint `step` (None: the latest) into the target `fit` makes of it.

    `fit` gets the step's `stored_leaves` and returns the target, for
    instance one whose optimizer state is in the dtypes saved. The step is
    looked up once and its headers opened once, so the target is made from
    the very step restored, also while other processes save newer ones.
    Every array is verified; a directory of T5X checkpoints is read as
    `restore` reads it.

    Example:
      >>> import tempfile, jax.numpy as jnp, optax
      >>> from t5x_optim import Checkpointer, OptaxWrapper
      >>> sgd = OptaxWrapper(optax.sgd(0.1))
      >>> def fit(stored):  # params of the shape and dtype saved
      ...   w = stored[('target', 'w')]
      ...   return sgd.create({'w': jnp.zeros(w.shape, w.dtype)})
      >>> with Checkpointer(tempfile.mkdtemp(), async_save=False) as checkpointer:
      ...   checkpointer.save(1, sgd.create({'w': jnp.ones(3, jnp.bfloat16)}))
      ...   checkpointer.restore_fitted(fit).target['w']
      Array([1, 1, 1], dtype=bfloat16)
    """
    if self._holds_only_t5x_checkpoints():
      t5x_step = t5x_checkpoints.open_step(self._directory, step)
      stored = {p: jax.ShapeDtypeStruct(x.shape, x.dtype) for p, x in t5x_step.stored.items()}
      return self._restore_t5x_opened(fit(stored), t5x_step)
    step = self._resolve_step(step)
    opened = self._opened(step, _any_path)
    return self._restore_opened(fit({**opened[0], **opened[1]}), step, opened)

  @placed_as_target
  def _restore_opened(
    self,
    target: CheckpointState,
    step: int,
    opened: tuple[dict[Path, Any], dict[Path, Any]],
  ) -> CheckpointState:
    """`restore_fitted` of step `step`, whose arrays are `opened`, into `target`."""
    restored = self._restore_step(target, step, params_only=False, verify=True, opened=opened)
    self._restored_step = step
    return restored

  @placed_as_target
  def _restore_t5x_opened(
    self, target: CheckpointState, opened: t5x_checkpoints.OpenedStep
  ) -> CheckpointState:
    """`restore_fitted` of a T5X step already opened into `target`."""
    restored = t5x_checkpoints.restore_opened(opened, target)
    self._restored_step = opened.step
    return restored

  def _opened(
    self, step: int, wanted: Callable[[Path], bool]
  ) -> tuple[dict[Path, jax.ShapeDtypeStruct], dict[Path, jax.ShapeDtypeStruct]]:
    """The `wanted` arrays of step `step`: those in its orbax item (headers opened, no data
    read), and the zero-size ones it recorded."""
    arrays = open_stored(self._item(step), self._where(step), step, wanted)
    empty = {p: x for p, x in self._recorded_zero_size(step).items() if wanted(p)}
    return arrays, empty

  def _recorded_zero_size(self, step: int) -> dict[Path, Any]:
    """The zero-size arrays saved with step `step` (`zero_size_record`), as stored arrays."""
    recorded = self._json_record(step, _ZERO_SIZE, "its zero-size arrays")
    if recorded is None:
      return {}
    try:
      return zero_size_stored(recorded)
    except (KeyError, TypeError, ValueError) as e:
      path = self._item(step, _ZERO_SIZE) / _JSON_FILE
      raise CheckpointError(
        f"{self._where(step)} has an unreadable record of its zero-size arrays ({path}): "
        f"{type(e).__name__}: {e}.",
        step=step,
      ) from e

  def _recorded_classes(self, step: int) -> dict[str, str]:
    """The state classes saved with step `step`; {} for a step saved before they were."""
    recorded = self._json_record(step, _STATE_CLASSES, "its optimizer")
    return {} if recorded is None else {str(k): str(v) for k, v in recorded.items()}

  def _json_record(self, step: int, item: str, what: str) -> dict[str, Any] | None:
    """The JSON object of `item` saved with step `step`; None when it was saved without one.

    Raises:
      CheckpointError: the record is unreadable, or the step's metadata lists it and it is
        gone (a copy of the step that left it out): the step is not whole.
    """
    path = self._item(step, item) / _JSON_FILE
    if not path.exists():
      if item in self._saved_items(step):
        raise CheckpointError(
          f"{self._where(step)} has lost its record of {what} ({path}): the step's metadata "
          "lists it, but it is not there (a copy of the step that left files out?).",
          step=step,
        )
      return None
    try:
      recorded = json.loads(path.read_text())
      if not isinstance(recorded, dict):
        raise ValueError(f"expected a JSON object, got {type(recorded).__name__}")
    except (OSError, ValueError) as e:
      raise CheckpointError(
        f"{self._where(step)} has an unreadable record of {what} ({path}): {e}.", step=step
      ) from e
    return recorded

  def _saved_items(self, step: int) -> frozenset[str]:
    """The items the step's metadata says its save wrote; none where it cannot be read."""
    try:
      handlers = self._manager.metadata(step).item_handlers
    except Exception:  # noqa: BLE001 - orbax raises its own types; the step's arrays decide
      return frozenset()
    return frozenset(handlers or ())

  def recorded_job(self, step: int) -> dict[str, Any] | None:
    """The `job` recorded with checkpoint `step`; None for a step saved without one.

    Raises:
      CheckpointError: the record is unreadable (a corrupt step).
    """
    return self._json_record(checked_step(step), _JOB, "its job")

  def is_committed(self, step: int) -> bool:
    """Whether checkpoint `step` is on disk and was committed (its save completed,
    `is_committed_step`)."""
    name = self._step_names.build_name(checked_step(step))
    return is_committed_step(storage.join(self._directory, name))

  def _check(
    self,
    step: int,
    expected: Mapping[Path, Any],
    stored: Mapping[Path, Any],
    classes: Mapping[str, str] | None,
  ) -> None:
    """Refuses a checkpoint whose leaves or optimizer state classes do not fit the target."""
    problems = listed(leaf_problems(expected, stored))
    if classes is not None:
      other = class_problems(self._recorded_classes(step), classes)
      if other:
        other[-1] += ANOTHER_OPTIMIZER
      problems += other
    if problems:
      self._refuse(step, problems)

  def _refuse(self, step: int, problems: list[str]) -> NoReturn:
    raise ValueError(
      f"{self._where(step)} does not fit the target: {'; '.join(problems)}. Nothing was restored."
    )

  def _read(self, step: int, expected: Mapping[Path, Any], *, partial: bool) -> dict[Path, Any]:
    """Reads the `expected` leaves of checkpoint `step` into their shardings."""
    abstract, restore_args = orbax_restore_args(expected)
    args = ocp.args.PyTreeRestore(abstract, restore_args=restore_args, partial_restore=partial)
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(**{_ARRAYS: args}))
    except Exception as e:  # noqa: BLE001 - tensorstore raises bare Exceptions.
      cause = root_cause(e)
      at = [f"'{key_path_str(p)}'" for p in expected if f'"{".".join(p)}/' in cause]
      raise CheckpointError(
        f"{self._where(step)} could not be read at {', '.join(at) or self._item(step)}: {cause}",
        step=step,
      ) from e
    return traverse_util.flatten_dict(dict(restored[_ARRAYS]))

  def _verify(
    self,
    step: int,
    pending: Mapping[str, jax.Array],
    other_x64: Mapping[str, jax.Array],
    recorded: Mapping[str, int],
  ) -> None:
    """Raises `CheckpointError` naming every array whose checksum differs.

    An array in `other_x64` (its `x64_words` with x64 off, its `x32_values`
    with x64 on) may match either checksum: the one its step recorded
    depends on whether it was saved with x64 on.
    """
    actual, words = fetch(pending), fetch(other_x64)
    wrong = [
      f"'{path}' (recorded {recorded[path]:#010x}, read {value:#010x})"
      for path, value in actual.items()
      if recorded[path] not in (value, words.get(path))
    ]
    if wrong:
      raise CheckpointError(
        f"{self._where(step)} is corrupt: the checksum differs at {', '.join(wrong)}.",
        step=step,
      )

  def _restore_step(
    self,
    target: CheckpointState,
    step: int,
    *,
    params_only: bool,
    verify: bool,
    opened: tuple[dict[Path, Any], dict[Path, Any]] | None = None,
  ) -> CheckpointState:
    """`restore` of exactly `step`: check, read, build the state, verify.

    `opened` is the step's `_opened` arrays when they were already opened.
    The checksums of the arrays read are computed on their devices while the
    state is built; a mismatch discards that state.
    """
    wanted = _is_params_only_path if params_only else _any_path
    arrays, empty = self._opened(step, wanted) if opened is None else opened
    stored = {**arrays, **empty}
    target_leaves = {p: x for p, x in flatten(target.state_dict()).items() if wanted(p)}
    expected = {path: as_stored(leaf) for path, leaf in target_leaves.items()}
    classes = None if params_only else optimizer_state_classes(target)
    self._check(step, expected, stored, classes)
    _warn_of_narrowed_state(step, expected, stored)
    if verify:
      recorded = self._recorded_checksums(step)
      unrecorded = [
        f"'{key_path_str(p)}'"
        for p in expected
        if key_path_str(p) not in recorded and p not in empty
      ]
      if unrecorded:
        raise CheckpointError(
          f"{self._where(step)} has no checksum recorded for {', '.join(unrecorded)}.",
          step=step,
        )
    to_read = {p: as_read(leaf, stored[p]) for p, leaf in expected.items() if p not in empty}
    restored = self._read(step, to_read, partial=params_only)
    if verify:
      # Checked in the stored dtype: the exact casts read in the target's dtype reverse exactly.
      dtypes = {p: stored[p].dtype for p, x in restored.items() if x.dtype != stored[p].dtype}
      pending = dispatch_checksums(restored, dtypes)
      other_x64 = dispatch_checksums({**x64_words(restored), **x32_values(restored)})
    restored, unfit = fit_read(restored, expected)
    restored.update({path: empty_leaf(expected[path]) for path in empty})
    if unfit:
      if verify:
        self._verify(step, pending, other_x64, recorded)  # Corrupt data is not the target's fault.
      self._refuse(step, listed(unfit))
    state_dict = traverse_util.unflatten_dict(rewrap_keys(restored, target_leaves))
    if params_only:
      state_dict[_STATE][_PARAM_STATES] = _fresh_param_states(target, state_dict[_TARGET])
    try:
      state = target.restore_state(state_dict)
    except ValueError:
      if verify:
        self._verify(step, pending, other_x64, recorded)  # A corrupt step counter, say.
      raise
    if verify:
      self._verify(step, pending, other_x64, recorded)
    return state

  @_taking_turns
  @placed_as_target
  def restore(
    self,
    target: CheckpointState,
    step: int | None = None,
    *,
    params_only: bool = False,
    fallback: bool = False,
    verify: bool = True,
  ) -> CheckpointState:
    """Restores checkpoint `step` into `target`'s structure and shardings.

    `target` is only a template and is never modified: its leaves may be real
    arrays or `jax.ShapeDtypeStruct`s with shardings (see
    `partitioning.abstract_train_state`). Each array is read straight into
    its target sharding, whatever mesh or device count the checkpoint was
    saved from; no unsharded copy is made. Every array read is checked
    against the checksum saved with it. Each leaf comes back in the
    target's dtype (params too, which `Optimizer.restore_state` keeps in
    their stored floating dtype, as T5X does), by the rule of `leaf_fit`:
    floating data may be cast to any floating dtype whose range holds
    every value (a float32 checkpoint restores into bfloat16 params), an
    integer to a narrower integer, or a float to an integer (a float32 step
    counter), when every value is a whole number that fits; another change
    of kind (complex to real) is refused. Arrays whose stored dtype casts exactly
    into the target's are read in the target's dtype and returned as read,
    without another device copy; the others are read as stored and cast
    on their devices. Pending saves of this checkpointer are finished
    first. The directory is re-read, so checkpoints written by other
    processes are seen, unless `step` is one this checkpointer already
    knows. The state comes back as saved, the settings it keeps included
    (Muon's ``ns_coeffs``, schedule-free's ``b1``): `reapply_config` sets
    those of a changed config.

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

    A directory that holds no t5x_optim checkpoint but T5X's
    ``checkpoint_<step>`` directories (legacy or Orbax format) is restored
    with `t5x_checkpoints.restore_t5x_checkpoint` (T5X's format has no
    checksums, and no `params_only` or `fallback`; its floating params keep
    the checkpoint's dtype, as T5X restores them without a ``restore_dtype``).

    Returns:
      A new object of `target`'s type holding real, sharded arrays.

    Raises:
      FileNotFoundError: no complete checkpoint (for `step`).
      ValueError: the checkpoint does not fit the target (missing or
        unexpected keys, e.g. another optimizer's state; other shapes;
        dtypes of another kind; an optimizer state of other classes where
        the keys agree, such as adam's checkpoint restored into adabelief:
        each step records the classes of its optimizer state's nodes, see
        `state_classes`), checked on the metadata before any array
        is read and naming the paths (the first `SHOWN_PROBLEMS`, then a
        count of the rest by kind); or a stored array whose values
        are not all whole numbers within the target's integer dtype, which
        can only be checked once read (after its checksum). Never retried by
        `fallback`: it is the target that is wrong.
      CheckpointError: the step's files are missing, unreadable or corrupt
        (with `fallback`: those of every step tried), naming the step and the
        array path.

    Under `jax.set_mesh`, a target leaf sharded over that mesh's abstract
    mesh (`jax.eval_shape` gives such leaves on a mesh with Explicit axes)
    is read onto its devices; the rest of the restore runs where the
    target's leaves are, whatever mesh is in context (`placed_as_target`).
    """
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
