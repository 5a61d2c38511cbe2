"""The one path layer: files through etils `epath`, arrays through a tensorstore kvstore.

A path is local (``/data/run``, ``run``, ``~/run``) or has a scheme
(``gs://bucket/run``, ``s3://bucket/run``). A local path becomes an absolute
`pathlib.Path` (``~`` expanded), fixed where it is first read: orbax refuses a
relative directory, and one that followed the working directory would name
another place after a ``chdir``. A path with a scheme becomes an `epath.Path`, read and
written by the fsspec package of its scheme (``gcsfs`` for ``gs://``, or
TensorFlow's gfile where TensorFlow is installed; ``s3fs`` for ``s3://``),
and its arrays are opened with the tensorstore
kvstore driver of that scheme (`kvstore_spec`). A scheme without its package,
a missing bucket or missing credentials raise `StorageError`, one line that
names the path.

Example:
  >>> as_path('/tmp/run')
  PosixPath('/tmp/run')
  >>> kvstore_spec('/tmp/run/target.w')
  {'driver': 'file', 'path': '/tmp/run/target.w'}
  >>> kvstore_spec('gs://bkt/run/target.w')
  {'driver': 'gcs', 'bucket': 'bkt', 'path': 'run/target.w'}
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import urllib.parse
from typing import Any

from etils import epath

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

AnyPath = pathlib.Path | epath.Path

# scheme: (the fsspec package epath needs, the tensorstore kvstore driver).
SCHEMES: dict[str, tuple[str, str]] = {"gs": ("gcsfs", "gcs"), "s3": ("s3fs", "s3")}

_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")
_SCHEME_LIKE = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*):/?(?!/)")
"""A local path whose first part is a word and ``:``, the start of a scheme missing a ``/``."""


def _no_listing_caches() -> None:
  """Makes fsspec's object-store backends list afresh every time.

  gcsfs and s3fs cache directory listings forever by default, and do not see
  what tensorstore (another client) writes: a step written since the first
  listing would stay invisible. Set before any of their file systems exists.
  """
  try:
    import fsspec.config  # noqa: PLC0415 - epath's backend for paths with a scheme
  except ImportError:  # Then no scheme has a backend either.
    return
  for scheme in SCHEMES:
    fsspec.config.conf.setdefault(scheme, {}).setdefault("use_listings_cache", False)


_no_listing_caches()


class StorageError(ValueError):
  """A path that cannot be used: unknown scheme, missing package, bucket or credentials."""


def scheme_of(path: str | os.PathLike[str]) -> str | None:
  """The scheme of `path` (``'gs'``), or None for a local path.

  Example:
    >>> scheme_of('gs://bkt/run'), scheme_of('/tmp/run')
    ('gs', None)
  """
  match = _SCHEME.match(os.fspath(path))
  return match.group(1).lower() if match else None


def is_object_store(path: str | os.PathLike[str]) -> bool:
  """Whether `path` lives on an object store (it has a scheme), where there is no rename or flock.

  Example:
    >>> is_object_store('gs://bkt/run'), is_object_store('run')
    (True, False)
  """
  return scheme_of(path) is not None


def _check_backend(text: str, scheme: str) -> None:
  if scheme not in SCHEMES:
    supported = ", ".join(f"{s}://" for s in SCHEMES)
    raise StorageError(
      f"{text}: the scheme {scheme}:// is not supported (local paths, {supported})."
    )
  package = SCHEMES[scheme][0]
  # With TensorFlow installed, epath reads and writes gs:// through its gfile instead.
  backends = (package, "tensorflow") if scheme == "gs" else (package,)
  if all(importlib.util.find_spec(name) is None for name in backends):
    extra = " or pip install 't5x-optim[gcs]'" if scheme == "gs" else ""
    raise StorageError(
      f"{text}: {scheme}:// paths need the {package} package, which is not installed "
      f"(pip install {package}{extra})."
    )


def _check_url_path(text: str, scheme: str) -> None:
  """Refuses a path with a scheme that holds ``#`` or ``?``: orbax parses it as a URL, where
  they start a fragment or a query, and would store every step's arrays in what comes before
  (over those of the other steps, and of other runs there)."""
  if "#" in text or "?" in text:
    url = urllib.parse.urlsplit(text)
    raise StorageError(
      f"{text}: a {scheme}:// path cannot hold '#' or '?': orbax reads it as a URL, whose path "
      f"ends there, and would write the arrays of every step to {url.scheme}://{url.netloc}"
      f"{url.path}; choose a name without them."
    )


def _check_local_path(text: str) -> None:
  """Refuses a local path that starts as a supported scheme with one ``/`` or none
  (``gs:/bkt/run``), which would be a local directory ``./gs:``; ``./gs:/bkt/run`` is one."""
  typo = _SCHEME_LIKE.match(text)
  if typo is not None and typo.group(1).lower() in SCHEMES:
    head, scheme = typo.group(1), typo.group(1).lower()
    raise StorageError(
      f"{text}: a local path that starts with {head}: is a misspelt {scheme}:// path (did you "
      f"mean {scheme}://{text[typo.end() :]}?); write ./{text} for a local directory of that "
      "name."
    )


def as_path(path: str | os.PathLike[str]) -> AnyPath:
  """`path` as a path object: an absolute `pathlib.Path` when local, an `epath.Path` with a scheme.

  A local path is made absolute (``~`` expanded; ``~name`` of no user
  left as written, as the shell leaves it) against the working
  directory of this call. `pathlib.Path('gs://b/x')` would collapse the
  ``//`` into a local ``gs:/b/x``; this keeps the scheme. The package of
  the scheme is checked, and written in lower case (``GS://`` is ``gs://``).

  Raises:
    StorageError: an unsupported scheme, or its package is not installed;
      a path with a scheme that holds ``#`` or ``?``; a local path that
      starts as a supported scheme missing a ``/`` (``gs:/bkt/run``).

  Example:
    >>> as_path('/tmp/run') / 'checkpoints'
    PosixPath('/tmp/run/checkpoints')
    >>> import os; as_path('run') == as_path(os.path.join(os.getcwd(), 'run'))
    True
    >>> as_path('ftp://host/run')
    Traceback (most recent call last):
    ...
    t5x_optim._checkpoint.storage.StorageError: ftp://host/run: the scheme ftp:// is not supported (local paths, gs://, s3://).

    With gcsfs installed, ``str(as_path('gs://bkt/run') / 'checkpoints')``
    is ``'gs://bkt/run/checkpoints'``.
  """
  text = os.fspath(path)
  scheme = scheme_of(text)
  if scheme is None:
    _check_local_path(text)
    return pathlib.Path(os.path.expanduser(text)).absolute()
  _check_url_path(text, scheme)
  _check_backend(text, scheme)
  return epath.Path(scheme + text[len(scheme) :])


def join(path: str | os.PathLike[str], *names: str) -> str:
  """`path` joined with `names` by ``/``, keeping a scheme's ``//``.

  Each name is relative to `path`, alike on every storage.

  Raises:
    ValueError: a name starts with ``/``.

  Example:
    >>> join('gs://bkt/run/', 'checkpoint_3', 'target.w')
    'gs://bkt/run/checkpoint_3/target.w'
  """
  text = os.fspath(path)
  for name in names:
    if name.startswith("/"):
      raise ValueError(f"storage.join takes names relative to {text!r}: {name!r} is absolute.")
  if scheme_of(text) is None:
    return os.path.join(text, *names)
  return "/".join([text.rstrip("/"), *names])


def files_under(root: str | os.PathLike[str]) -> list[AnyPath]:
  """Every file below the directory `root`, recursively, sorted by path (component by
  component, on every storage alike).

  On local disk a symbolic link is followed, to a file or a directory, and what it reaches
  is listed under the link's path; a link to a directory that holds it (a loop) is not
  followed. `epath`'s ``rglob`` refuses object stores (a request per directory), and
  its ``walk`` drops the scheme; this lists them one directory at a time.

  Example:
    >>> import tempfile
    >>> root = pathlib.Path(tempfile.mkdtemp())
    >>> (root / 'd').mkdir(); _ = (root / 'd' / 'b.txt').write_text('b')
    >>> _ = (root / 'a.txt').write_text('a')
    >>> [p.relative_to(root).as_posix() for p in files_under(root)]
    ['a.txt', 'd/b.txt']
  """
  top = as_path(root)
  if scheme_of(top) is None:
    found = _local_files(top)
  else:
    found, pending = [], [top]
    while pending:
      for child in pending.pop().iterdir():
        (pending if child.is_dir() else found).append(child)
  # By path components below `root` (as paths sort), on every storage alike: sorted as
  # strings, 'books.txt' would come before 'books/vol1.txt' ('.' < '/').
  prefix = len(os.fspath(top).rstrip("/")) + 1
  return sorted(found, key=lambda path: os.fspath(path)[prefix:].split("/"))


def _local_files(top: pathlib.Path) -> list[pathlib.Path]:
  """The files below `top`, links followed; a directory that is also one of its parents
  (the same device and inode: a link into itself) is not listed again."""
  found, parents = [], {}
  for directory, subdirectories, names in os.walk(top, followlinks=True):
    real = os.stat(directory)
    outer = parents.get(os.path.dirname(directory), frozenset())
    if (real.st_dev, real.st_ino) in outer:
      subdirectories.clear()
      continue
    parents[directory] = outer | {(real.st_dev, real.st_ino)}
    found += [path for name in names if (path := pathlib.Path(directory, name)).is_file()]
  return found


def file_size(path: str | os.PathLike[str]) -> int:
  """The size of the file at `path` in bytes (`epath`'s stat has ``length``, not ``st_size``).

  Example:
    >>> import tempfile
    >>> file = pathlib.Path(tempfile.mkdtemp()) / 'a.txt'
    >>> _ = file.write_text('hello')
    >>> file_size(file)
    5
  """
  found = as_path(path)
  return found.stat().st_size if scheme_of(found) is None else found.stat().length


def _bucket_and_key(text: str) -> tuple[str, str]:
  rest = text.split("://", 1)[1]
  bucket, _, key = rest.partition("/")
  return bucket, key


def kvstore_spec(path: str | os.PathLike[str]) -> dict[str, Any]:
  """The tensorstore kvstore spec of `path`: ``file`` when local, the scheme's driver otherwise.

  Raises:
    StorageError: an unsupported scheme.

  Example:
    >>> kvstore_spec('s3://bkt/a/b')
    {'driver': 's3', 'bucket': 'bkt', 'path': 'a/b'}
  """
  text = os.fspath(path)
  scheme = scheme_of(text)
  if scheme is None:
    return {"driver": "file", "path": text}
  if scheme not in SCHEMES:
    raise StorageError(f"{text}: tensorstore cannot store arrays at {scheme}:// paths.")
  bucket, key = _bucket_and_key(text)
  return {"driver": SCHEMES[scheme][1], "bucket": bucket, "path": key}


def _check_gcs_credentials(text: str) -> None:
  """Raises `StorageError` when no Google credentials can be found (unless an emulator is used)."""
  if os.environ.get("STORAGE_EMULATOR_HOST"):
    return
  try:
    import google.auth  # noqa: PLC0415 - a dependency of gcsfs, only for gs:// paths

    google.auth.default()
  except Exception as e:  # noqa: BLE001 - google.auth raises several kinds
    raise StorageError(
      f"{text}: no Google Cloud credentials ({str(e).splitlines()[0]}); run "
      "`gcloud auth application-default login` or set GOOGLE_APPLICATION_CREDENTIALS."
    ) from e


def check_reachable(path: str | os.PathLike[str]) -> AnyPath:
  """`as_path(path)`, after checking that its bucket exists and can be reached.

  Local paths are returned unchecked. For ``gs://`` the credentials are
  checked first (skipped with ``STORAGE_EMULATOR_HOST``, an emulator).

  Raises:
    StorageError: no package for the scheme, no credentials, or no such
      bucket; one line naming the path.

  Example:
    >>> check_reachable('/tmp')
    PosixPath('/tmp')
  """
  result = as_path(path)
  scheme = scheme_of(path)
  if scheme is None:
    return result
  text = os.fspath(path)
  if scheme == "gs":
    _check_gcs_credentials(text)
  bucket, _ = _bucket_and_key(text)
  try:
    exists = epath.Path(f"{scheme}://{bucket}").exists()
  except Exception as e:  # noqa: BLE001 - fsspec backends raise their own errors
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    raise StorageError(f"{text}: the bucket {bucket} cannot be reached: {first}") from e
  if not exists:
    raise StorageError(f"{text}: the bucket {bucket} does not exist.")
  return result
