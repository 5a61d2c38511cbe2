"""TensorBoard event files on any storage: tensorboardX record writers that write through `epath`.

tensorboardX opens an event file by the prefix of its path: local files with
`open`, ``gs://`` with google-cloud-storage's own client, ``s3://`` with
boto3. `event_dir` routes every scheme of `storage.SCHEMES` through `epath`
instead (the backend every other file of a run uses, with its credentials
and ``STORAGE_EMULATOR_HOST``). An object cannot be appended to, so each
flush rewrites the event file whole (as TensorFlow's GCS file system does);
event files of scalars stay small.

`drop_events_after` removes the events an earlier run wrote after a step
(those of steps it never saved) from the files themselves, where a purge
step (a ``SessionLog.START`` event) hides them from TensorBoard's Python
loader only: its default loader, the Rust data server, ignores purge steps.
It rewrites a file with `write_at_once`, as a run writes its config files.

Example:
  >>> event_dir('/tmp/run', 'train')
  '/tmp/run/train'
"""

from __future__ import annotations

import io
import os
import struct

from etils import epath
from google.protobuf.message import DecodeError
from tensorboardX import record_writer
from tensorboardX.proto.event_pb2 import Event

from t5x_optim import storage

__all__ = ["drop_events_after", "event_dir", "write_at_once"]

_HEADER = struct.Struct("<QI")
"""A record's length and the masked CRC-32C of those 8 bytes; its data and their CRC follow."""


class _EpathRecordWriter:
  """An event file written whole through `epath` at every flush (from the caller's thread)."""

  def __init__(self, path: str):
    self._path = epath.Path(path)
    self._buffer = io.BytesIO()
    self._flushed = -1

  def write(self, data: bytes) -> None:
    self._buffer.write(data)

  def flush(self) -> None:
    if self._buffer.tell() != self._flushed:
      try:
        self._path.write_bytes(self._buffer.getvalue())
      except Exception as error:  # noqa: BLE001 - gcsfs's HttpError is no OSError
        raise OSError(f"writing the event file {self._path}: {error}") from error
      self._flushed = self._buffer.tell()

  def close(self) -> None:
    self.flush()


class _EpathWriterFactory:
  """tensorboardX's writer factory protocol (`open`, `directory_check`)."""

  def open(self, path: str) -> _EpathRecordWriter:
    return _EpathRecordWriter(path)

  def directory_check(self, path: str) -> None:
    del path  # Object stores have no directories to create.


def event_dir(model_dir: str | os.PathLike[str], kind: str) -> str:
  """The log directory ``<model_dir>/<kind>`` as tensorboardX takes it, writable at any scheme."""
  scheme = storage.scheme_of(model_dir)
  if scheme is not None:
    record_writer.register_writer_factory(scheme, _EpathWriterFactory())
  return storage.join(model_dir, kind)


def _records(data: bytes) -> list[tuple[bytes, Event]] | None:
  """The records of an event file (each whole, and its event), up to one cut short by a kill;
  None where a length's checksum is wrong or an event does not parse."""
  records = []
  at = 0
  while at + _HEADER.size <= len(data):
    length, checksum = _HEADER.unpack_from(data, at)
    if checksum != record_writer.masked_crc32c(data[at : at + 8]):
      return None
    end = at + _HEADER.size + length + 4
    if end > len(data):
      break
    try:
      records.append((data[at:end], Event.FromString(data[at + _HEADER.size : end - 4])))
    except DecodeError:
      return None
    at = end
  return records


def drop_events_after(directory: str, step: int) -> None:
  """Removes the events of steps after `step` from the event files in `directory`.

  A file that keeps no summary (the scalars) is deleted. The others are replaced whole: on a
  local disk by renaming a complete copy over them, on an object store by one
  upload (an object is replaced at once). A file this cannot read is left as
  it is.

  Args:
    directory: a log directory (``<model_dir>/train``), any scheme `event_dir` takes.
    step: the last step kept; -1 removes every event.
  """
  root = storage.as_path(directory)
  if not root.exists():
    return
  for path in sorted(root.glob("*tfevents*")):
    data = path.read_bytes()
    records = _records(data)
    if records is None:
      continue
    kept = [(record, event) for record, event in records if event.step <= step]
    if not any(event.HasField("summary") for _, event in kept):
      path.unlink()
    elif len(kept) < len(records) or sum(len(record) for record, _ in records) < len(data):
      write_at_once(path, b"".join(record for record, _ in kept))


def write_at_once(path: storage.AnyPath, data: bytes) -> None:
  """Writes `data` as `path` at once: a renamed copy (named so no reader takes it for an event
  file) on a local disk, one upload on an object store. A write that fails (a full disk)
  leaves `path` as it was.

  Raises:
    OSError: the copy could not be written or renamed, or the upload failed; it names `path`.

  Example:
    >>> import tempfile
    >>> path = storage.as_path(tempfile.mkdtemp()) / 'config.gin'
    >>> write_at_once(path, b'A = 1')
    >>> path.read_text()
    'A = 1'
  """
  if storage.is_object_store(path):
    try:
      path.write_bytes(data)
    except Exception as error:  # noqa: BLE001 - gcsfs's HttpError is no OSError
      raise OSError(f"writing {path}: {error}") from error
    return
  copy = path.with_name(".rewrite.tmp")
  try:
    copy.write_bytes(data)
    os.replace(copy, path)
  except OSError as error:
    copy.unlink(missing_ok=True)
    raise OSError(error.errno, error.strerror, os.fspath(path)) from error
