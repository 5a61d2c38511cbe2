"""The writer lease of a checkpoint directory on an object store, where there is no flock.

The lease is one object, ``<directory>/.t5x_optim.lease``, holding its
holder and the time it expires. It is only ever written conditionally on
the generation last read (tensorstore's ``if_equal``, GCS's
``ifGenerationMatch``), so of two writers racing for it exactly one wins:
creating it requires it to be absent, taking over an expired one requires
it unchanged since it was read, and renewing or deleting it requires it to
be the holder's own write. The holder renews it every third of
`Lease.seconds` from a background thread; a crashed holder's lease expires
`Lease.seconds` after its last renewal, and the next writer takes it over.

Example:
  >>> import tempfile
  >>> first, second = Lease(tempfile.mkdtemp()), None
  >>> first.acquire()
  ''
  >>> second = Lease(first.directory)
  >>> second.acquire().startswith('is in use by another writer')
  True
  >>> first.release(); second.acquire()
  ''
  >>> second.release()
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from typing import Any

import tensorstore as ts

from t5x_optim._checkpoint import storage

__all__ = ["LEASE_FILE", "Lease"]

LEASE_FILE = ".t5x_optim.lease"


def _kvstore(directory: str) -> ts.KvStore:
  spec = storage.kvstore_spec(directory)
  path = spec["path"].rstrip("/")
  spec["path"] = f"{path}/" if path else ""
  return ts.KvStore.open(spec).result()


def _utc(seconds: float) -> str:
  return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))


class Lease:
  """A writer lease on `directory` (any kvstore: ``gs://``, ``s3://`` or local).

  Args:
    directory: the checkpoint directory.
    seconds: how long the lease lasts without a renewal.
  """

  seconds: float = 60.0

  def __init__(self, directory: str | os.PathLike[str], seconds: float | None = None):
    self.directory = os.fspath(directory)
    if seconds is not None:
      self.seconds = seconds
    self.holder = f"pid {os.getpid()} on {socket.gethostname()}"
    self.lost = ""  # Why the held lease was lost, if it was.
    self._store: ts.KvStore | None = None
    self._generation: bytes | None = None
    self._expires = 0.0
    self._stop = threading.Event()
    self._renewer: threading.Thread | None = None

  def _write(self, renew: bool, if_equal: bytes) -> bytes:
    """Writes (or deletes) the lease if its generation is `if_equal`; b'' when it is not."""
    expires = time.time() + self.seconds
    value = json.dumps({"holder": self.holder, "expires": expires}).encode() if renew else None
    generation = self._store.write(LEASE_FILE, value, if_equal=if_equal).result().generation
    if renew and generation:
      self._expires = expires
    return generation

  def acquire(self, *, patience: float = 0.0) -> str:
    """Takes the lease: '' on success, else why not ('is in use by ...').

    A lease held by another is tried again for up to `patience` seconds; one
    whose holder died expires in the meantime, as one renewed does not.
    """
    deadline = time.monotonic() + patience
    while True:
      problem = self._try_acquire()
      if not problem.startswith("is in use") or time.monotonic() >= deadline:
        return problem
      time.sleep(min(self.seconds / 12, max(deadline - time.monotonic(), 0.0)))

  def _try_acquire(self) -> str:
    try:
      self._store = self._store or _kvstore(self.directory)
      read = self._store.read(LEASE_FILE).result()
      if read.state == "value":
        other = _parse(read.value)
        if other.get("expires", 0) > time.time():
          holder = other.get("holder", "another process")
          until = _utc(other["expires"])
          return f"is in use by another writer ({holder}; its lease lasts until {until})"
      generation = self._write(True, read.stamp.generation)
    except (ValueError, OSError) as e:
      return f"cannot be locked ({str(e).splitlines()[0]})"
    if not generation:
      return "is in use by another writer (it took the lease at the same time)"
    self._generation, self.lost = generation, ""
    self._stop.clear()
    self._renewer = threading.Thread(target=self._renew_until_stopped, daemon=True)
    self._renewer.start()
    return ""

  def _renew_until_stopped(self) -> None:
    while not self._stop.wait(self.seconds / 3):
      try:
        generation = self._write(True, self._generation)
      except (ValueError, OSError) as e:
        if time.time() > self._expires:
          self.lost = f"it expired while it could not be renewed ({str(e).splitlines()[0]})"
        continue
      if not generation:
        self.lost = "another writer took it over after it expired"
        return
      self._generation = generation

  def release(self) -> None:
    """Stops renewing and deletes the lease if it is still this holder's."""
    self._stop.set()
    if self._renewer is not None:
      self._renewer.join()
      self._renewer = None
    if self._generation is not None and not self.lost:
      try:
        self._write(False, self._generation)
      except (ValueError, OSError):
        pass  # It expires on its own.
    self._generation = None


def _parse(value: bytes) -> dict[str, Any]:
  try:
    record = json.loads(value)
  except ValueError:
    return {}
  return record if isinstance(record, dict) else {}
