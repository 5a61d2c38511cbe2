"""TensorBoard event files on any storage: tensorboardX record writers that write through `epath`.

tensorboardX opens an event file by the prefix of its path: local files with
`open`, ``gs://`` with google-cloud-storage's own client, ``s3://`` with
boto3. `event_dir` routes every scheme of `storage.SCHEMES` through `epath`
instead (the backend every other file of a run uses, with its credentials
and ``STORAGE_EMULATOR_HOST``). An object cannot be appended to, so each
flush rewrites the event file whole (as TensorFlow's GCS file system does);
event files of scalars stay small.

Example:
  >>> event_dir('/tmp/run', 'train')
  '/tmp/run/train'
"""

from __future__ import annotations

import io
import os

from etils import epath
from tensorboardX import record_writer

from t5x_optim import storage

__all__ = ["event_dir"]


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
      self._path.write_bytes(self._buffer.getvalue())
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
