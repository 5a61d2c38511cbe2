"""Paths on local disk and on object stores, as the checkpointer and the CLI read them.

A path with a scheme (``gs://``, ``s3://``) goes through epath and
tensorstore's kvstores; any other is a local path. `check_reachable` and
`StorageError` turn a missing credential or bucket into one line naming the
path.

Example:
  >>> from t5x_optim import storage
  >>> storage.is_object_store("gs://bucket/run"), storage.scheme_of("/tmp/run")
  (True, None)
"""

from t5x_optim._checkpoint.storage import (
  SCHEMES,
  AnyPath,
  StorageError,
  as_path,
  check_reachable,
  file_size,
  files_under,
  is_object_store,
  join,
  kvstore_spec,
  scheme_of,
)

__all__ = [
  "SCHEMES",
  "AnyPath",
  "StorageError",
  "as_path",
  "check_reachable",
  "file_size",
  "files_under",
  "is_object_store",
  "join",
  "kvstore_spec",
  "scheme_of",
]
