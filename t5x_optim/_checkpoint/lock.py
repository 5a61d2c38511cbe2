"""The writer lock of a checkpoint directory: one `Checkpointer` writes at a time.

A local directory is locked with `fcntl.flock`; an object store (``gs://``)
has no flock, so there the lock is a lease object (`Lease`).
"""

from __future__ import annotations

import os
import socket

import jax
import numpy as np
from jax.experimental import multihost_utils

from t5x_optim._checkpoint import storage
from t5x_optim._checkpoint.lease import LEASE_FILE, Lease
from t5x_optim._checkpoint.leaves import CheckpointError

__all__ = ["WriterLock"]


try:
  import fcntl
except ImportError:  # Not POSIX (Windows): directories are not locked.
  fcntl = None

_LOCK_FILE = ".t5x_optim.lock"


class WriterLock:
  """An exclusive `fcntl.flock` on ``<directory>/.t5x_optim.lock``, or a lease on object stores.

  The kernel drops the flock when its file is closed or its process dies, so
  a crashed writer never leaves the directory locked. On an object store
  (``gs://...``) the lock is the lease object ``<directory>/.t5x_optim.lease``
  (see `Lease`): created and renewed by conditional writes, it expires
  `Lease.seconds` after a crashed writer's last renewal. Only the primary
  process of a multi-process job locks (it is the one that finalises steps);
  the outcome is broadcast so that every process fails together. Systems
  without ``fcntl`` do not lock local directories.

  `Checkpointer` locks its directory at its first save; a training loop may
  lock its own directory for the whole run with `take`, so that a second run
  there is refused before it reads or writes anything.

  Example:
    >>> import tempfile
    >>> first, second = WriterLock(d := tempfile.mkdtemp()), WriterLock(d)
    >>> first.take(), second.take().startswith('is in use by another writer (pid ')
    ('', True)
    >>> first.release(); second.take()
    ''
    >>> second.release()
  """

  def __init__(self, directory: str):
    remote = storage.is_object_store(directory)
    self._path = storage.join(directory, LEASE_FILE if remote else _LOCK_FILE)
    self._lease = Lease(directory) if remote else None
    self._file = None
    self.held = False

  def check(self, where: str, step: int) -> None:
    """Raises `CheckpointError` when the held lease was lost (taken over after expiring)."""
    if self._lease is not None and self._lease.lost:
      raise CheckpointError(
        f"Cannot save step {step}: {where} lost its writer lease {self._path}: {self._lease.lost}.",
        step=step,
      )

  def acquire(self, where: str, step: int) -> None:
    """Takes the lock, or raises `CheckpointError` saying why it cannot.

    A lease is waited out (`take`'s `wait_out_stale`): the first save of a
    job restarted at once after a SIGKILL meets the lease its killed run
    left, which expires meanwhile.
    """
    problem = self.take(wait_out_stale=True)
    if problem:
      raise CheckpointError(
        f"Cannot save step {step}: {where} {problem}. Only one Checkpointer may write into a "
        f"directory; its lock is {self._path}.",
        step=step,
      )

  def take(self, *, wait_out_stale: bool = False) -> str:
    """Takes the lock; or says why it cannot (``'is in use by another writer (pid 7 on h)'``).

    A flock dies with its process; a lease outlives a process killed without
    releasing it (SIGKILL) until it expires. With `wait_out_stale`, a lease
    held by another is tried again for one lease period (`Lease.seconds`):
    a dead holder's expires meanwhile, a live one renews it. A job restarted
    at once after being killed thus takes its directory over.
    """
    problem = ""
    if jax.process_index() == 0 and self._lease is not None:
      patience = self._lease.seconds * 1.1 if wait_out_stale else 0.0
      problem = self._lease.acquire(patience=patience)
    elif jax.process_index() == 0 and fcntl is not None:
      problem = self._try_lock()
    if jax.process_count() > 1:
      locked = multihost_utils.broadcast_one_to_all(np.int32(not problem))
      problem = problem or ("" if int(locked) else "is in use (seen by process 0)")
    self.held = not problem
    if problem:
      self.release()
    return problem

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
    """Releases the flock or the lease (a no-op when not held)."""
    self.held = False
    if self._lease is not None:
      self._lease.release()
    if self._file is not None:
      self._file.close()
      self._file = None
