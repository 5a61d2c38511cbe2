"""The persistent compilation cache of a `t5x-optim train` run: a restart loads its compiled steps.

A job on preemptible machines compiles its train and eval steps again at
every start; with a low-precision optimizer state that compile takes several
times float32's. Inside `compilation_cache`, jax keeps each program that took
at least ``jax_persistent_cache_min_compile_time_secs`` (1 s by default) to
compile in a directory (by default the run's ``MODEL_DIR/compilation_cache``,
on any storage the model directory is on), keyed by the program, the devices,
the compile options, XLA's flags and the jax and backend versions: a start
with the same config and devices loads them instead of compiling, and a
change that reaches a program compiles it anew. Only process 0 writes
entries; every process reads them.

jax writes an entry in place and never replaces one: an entry cut short (the
process killed while writing it) would fail to load at every later start.
`remove_damaged` deletes such entries first, so that the next compile of the
program writes it again. It reads only the entries written since the last
start: the names and sizes of those it found intact are kept beside them
(``intact-entries.json``), and an entry keeps its size until it is deleted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import re
import zlib
from collections.abc import Iterator
from typing import Any

import jax
from jax.experimental.compilation_cache import compilation_cache as _jax_cache

from t5x_optim import storage

__all__ = ["CacheUse", "compilation_cache", "remove_damaged"]

_log = logging.getLogger(__name__)
_HITS = "/jax/compilation_cache/cache_hits"
_SAVED = "/jax/compilation_cache/compile_time_saved_sec"
_ENTRY_NAME = re.compile(r".+-[0-9a-f]{64}-cache")
"""A jax cache entry's name: its program's module name, the SHA-256 of its key, ``-cache``.
Nothing else is read or deleted, since the directory may hold the user's own files too."""
_INTACT = "intact-entries.json"
_ZLIB_FIRST_BYTE = 0x78
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


@dataclasses.dataclass
class CacheUse:
  """What a run took from its compilation cache.

  Attributes:
    directory: the cache's directory.
    loaded: programs loaded instead of compiled.
    saved_seconds: the compile time they had taken (jax keeps whole seconds), less their
      loading time.
    removed: damaged entries deleted before the run (`remove_damaged`).

  Example:
    >>> CacheUse("/tmp/run/compilation_cache", loaded=2, saved_seconds=12.34).format()
    'compilation cache: 2 compiled programs loaded from /tmp/run/compilation_cache (about 12 s of compiling saved)'
    >>> CacheUse("/tmp/run/compilation_cache", loaded=1, removed=1).format()
    'compilation cache: 1 compiled program loaded from /tmp/run/compilation_cache (about 0 s of compiling saved); 1 damaged entry deleted'
  """

  directory: str
  loaded: int = 0
  saved_seconds: float = 0.0
  removed: int = 0

  def format(self) -> str:
    """One line for the run's summary: what was loaded, and any damaged entry deleted."""
    programs = "program" if self.loaded == 1 else "programs"
    text = (
      f"compilation cache: {self.loaded} compiled {programs} loaded from {self.directory} "
      f"(about {self.saved_seconds:.0f} s of compiling saved)"
    )
    if self.removed:
      entries = "entry" if self.removed == 1 else "entries"
      text += f"; {self.removed} damaged {entries} deleted"
    return text


def _zstd_decompressor() -> Any:
  """zstd's decompression where a zstd module is there (Python 3.14's, or zstandard), else None."""
  with contextlib.suppress(ImportError):
    from compression import zstd  # noqa: PLC0415 - Python 3.14's

    return zstd.decompress
  with contextlib.suppress(ImportError):
    import zstandard  # noqa: PLC0415 - optional, as for jax

    return zstandard.ZstdDecompressor().decompress
  return None


def _damaged(data: bytes) -> bool:
  """Whether an entry cannot be read back: empty, neither zlib nor zstd (jax compresses every
  entry), or its compressed stream cut short or corrupt.

  A zstd entry where no zstd module is at hand counts as intact: jax reads it as before.
  """
  if data[:1] == bytes([_ZLIB_FIRST_BYTE]):
    decompress = zlib.decompress
  elif data[:4] == _ZSTD_MAGIC:
    decompress = _zstd_decompressor()
    if decompress is None:
      return False
  else:
    return True  # empty, or in neither format
  try:
    decompress(data)
  except Exception:  # noqa: BLE001 - each codec raises its own error type
    return True
  return False


def _found_intact(directory: Any) -> dict[str, int] | None:
  """The entries an earlier `remove_damaged` found intact, by name, with their sizes then.

  None where there is no such record or it cannot be read: every entry is then read.
  """
  try:
    record = json.loads((directory / _INTACT).read_text())
  except (OSError, ValueError):
    return None
  if not isinstance(record, dict) or not all(isinstance(n, int) for n in record.values()):
    return None
  return record


def remove_damaged(directory: Any) -> int:
  """Deletes the cache entries in ``directory`` that cannot be read back; returns how many.

  An entry found intact before, with the same size, is not read again (jax
  never rewrites an entry; one cut short is shorter): the names and sizes of
  the intact entries are kept in ``directory / "intact-entries.json"``. A
  record that cannot be read counts as empty (every entry is read, and the
  record written anew); one that cannot be written is logged, and the next
  start reads again the entries it lacks.

  Args:
    directory: a `pathlib.Path` or `etils.epath.Path`; absent: nothing to do.

  Example:
    >>> import tempfile, zlib
    >>> from pathlib import Path
    >>> d = Path(tempfile.mkdtemp())
    >>> _ = (d / f"jit_step-{'1' * 64}-cache").write_bytes(zlib.compress(b"x" * 1000))
    >>> _ = (d / f"jit_step-{'2' * 64}-cache").write_bytes(zlib.compress(b"x" * 1000)[:5])
    >>> _ = (d / "build-cache").write_text("the user's own")
    >>> remove_damaged(d), [p.name[:10] for p in sorted(d.iterdir())]
    (1, ['build-cach', 'intact-ent', 'jit_step-1'])
  """
  if not directory.exists():
    return 0
  before = _found_intact(directory)
  known = before or {}
  intact = {}
  removed = 0
  for entry in directory.iterdir():
    if not _ENTRY_NAME.fullmatch(entry.name):
      continue
    size = storage.file_size(entry)
    if known.get(entry.name) == size:
      intact[entry.name] = size
      continue
    data = entry.read_bytes()
    if _damaged(data):
      entry.unlink()
      removed += 1
    else:
      intact[entry.name] = len(data)
  if intact != before:
    try:
      (directory / _INTACT).write_text(json.dumps(intact, indent=0, sort_keys=True))
    except OSError as error:
      _log.warning(
        "could not record the intact compilation-cache entries in %s: %s", directory, error
      )
  return removed


@contextlib.contextmanager
def compilation_cache(directory: Any, *, primary: bool = True) -> Iterator[CacheUse]:
  """jax's persistent compilation cache in ``directory`` for the programs compiled inside.

  Sets ``jax_compilation_cache_dir`` (and enables the cache), and counts the
  programs loaded from it; on exit, restores jax's previous settings, so that
  later compiles in the process do not use this directory.

  Args:
    directory: a `pathlib.Path` or `etils.epath.Path`; created if absent.
    primary: whether this process deletes damaged entries (`remove_damaged`):
      one process of a job does, as only process 0 writes. One it cannot
      delete is logged: jax then compiles that program.

  Raises:
    OSError: the directory cannot be created.

  Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> with compilation_cache(Path(tempfile.mkdtemp())) as use:
    ...   _ = jax.jit(lambda x: x + 1)(1.0)
    >>> use.loaded
    0
  """
  directory.mkdir(parents=True, exist_ok=True)
  use = CacheUse(str(directory))
  if primary:
    try:
      use.removed = remove_damaged(directory)
    except OSError as error:
      # jax then fails to read the entry and compiles the program, warning of it.
      _log.warning("could not delete a damaged compilation-cache entry in %s: %s", directory, error)

  def on_event(event: str, **_: Any) -> None:
    if event == _HITS:
      use.loaded += 1

  def on_duration(event: str, seconds: float, **_: Any) -> None:
    if event == _SAVED:
      use.saved_seconds += max(seconds, 0.0)

  previous = {
    name: getattr(jax.config, name)
    for name in ("jax_compilation_cache_dir", "jax_enable_compilation_cache")
  }
  jax.config.update("jax_compilation_cache_dir", str(directory))
  jax.config.update("jax_enable_compilation_cache", True)
  _jax_cache.reset_cache()
  jax.monitoring.register_event_listener(on_event)
  jax.monitoring.register_event_duration_secs_listener(on_duration)
  try:
    yield use
  finally:
    jax.monitoring.unregister_event_listener(on_event)
    jax.monitoring.unregister_event_duration_listener(on_duration)
    for name, value in previous.items():
      jax.config.update(name, value)
    _jax_cache.reset_cache()
