"""Byte-level text data (`TextTask`, ``--data``): reading, splits, bad input, a run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from t5x_optim.cli import TextTask, main
from t5x_optim.cli.demo import text as _text

pytestmark = pytest.mark.usefixtures("clean_gin")

TINY = ["--gin_file", "examples/tiny.gin"]


def _windows(batch: dict[str, np.ndarray]) -> list[bytes]:
  return [bytes(row.astype(np.uint8)) for row in batch["inputs"]]


def test_rows_of_a_batch_equal_the_same_rows_of_the_whole_batch():
  task = TextTask(path="hamlet.txt", length=16, batch_size=8)
  whole = task.batch(5)
  halves = [task.batch(5, slice(0, 4)), task.batch(5, slice(4, 8))]
  for name in ("inputs", "targets"):
    np.testing.assert_array_equal(np.concatenate([h[name] for h in halves]), whole[name])
  np.testing.assert_array_equal(task.batch(5)["inputs"], whole["inputs"])
  assert not np.array_equal(task.batch(6)["inputs"], whole["inputs"])


def test_a_directory_is_one_stream_and_eval_reads_only_its_tail(tmp_path):
  (tmp_path / "a.txt").write_text("a" * 300)
  (tmp_path / "b.txt").write_text("b" * 100)
  (tmp_path / ".hidden").write_text("h" * 1000)
  task = TextTask(path=str(tmp_path), length=8, batch_size=64, eval_fraction=0.25)
  assert task.num_bytes == 400 and task.eval_start == 300
  eval_text = b"".join(_windows(task.eval_batch(0)))
  assert set(eval_text) == {ord("b")}
  train_text = b"".join(_windows(task.batch(0)))
  assert ord("a") in set(train_text) and ord("h") not in set(train_text)
  # A window crossing the file boundary reads both files.
  assert task._bytes(296, 8) == b"aaaabbbb"


def _linked_corpus(root: Path) -> Path:
  """corpus/a.txt, and elsewhere/b.txt reached from corpus through a link to elsewhere
  ('rest'), a hidden one ('.old') and a link to corpus itself ('loop')."""
  (root / "corpus").mkdir()
  (root / "corpus" / "a.txt").write_text("a" * 300)
  (root / "elsewhere").mkdir()
  (root / "elsewhere" / "b.txt").write_text("b" * 100)
  os.symlink(root / "elsewhere", root / "corpus" / "rest")
  os.symlink(root / "elsewhere", root / "corpus" / ".old")
  os.symlink(root / "corpus", root / "corpus" / "loop")
  return root / "corpus"


def test_a_directory_reads_its_symlinked_directories_under_their_link_names(tmp_path):
  """The files under a linked directory were skipped: 'rest/b.txt' was never read. A loop
  ('loop', corpus itself) is not followed, and a hidden link is skipped as a hidden file is."""
  corpus = _linked_corpus(tmp_path)
  task = TextTask(path=str(corpus), length=8, batch_size=64, eval_fraction=0.25)
  assert [f.relative_to(corpus).as_posix() for f in task._index[0]] == ["a.txt", "rest/b.txt"]
  assert task.num_bytes == 400 and task._bytes(296, 8) == b"aaaabbbb"
  # The digest names each file by its path under the directory, link and all: a copy
  # with the same files at the same paths is the same text.
  copy = tmp_path / "copy"
  (copy / "rest").mkdir(parents=True)
  (copy / "a.txt").write_text("a" * 300)
  (copy / "rest" / "b.txt").write_text("b" * 100)
  assert _text.data_summary(corpus) == _text.data_summary(copy)
  assert _text.data_summary(corpus).startswith("2 files, 400 bytes, digest ")


def test_a_directory_holding_only_a_symlinked_directory_is_its_files(tmp_path):
  (tmp_path / "real").mkdir()
  (tmp_path / "real" / "b.txt").write_text("b" * 100)
  (tmp_path / "only").mkdir()
  os.symlink(tmp_path / "real", tmp_path / "only" / "link")
  files, starts = _text.scan_text(tmp_path / "only")
  assert files == [tmp_path / "only" / "link" / "b.txt"] and starts == [0, 100]


def test_shipped_text_is_found_by_name_and_is_plain_ascii():
  path = _text.resolve_data_path("hamlet.txt")
  assert path.parent == _text.DATA_DIR
  data = path.read_bytes()
  assert data.isascii() and 100_000 < len(data) < 500_000 and b"Elsinore" in data


@pytest.mark.slow
def test_a_relative_data_path_is_the_working_directorys_else_a_shipped_text(
  tmp_path, monkeypatch, capsys
):
  monkeypatch.chdir(tmp_path)
  assert main(["plan", *TINY, "--data", "hamlet.txt"]) == 0  # none here: the shipped one
  (tmp_path / "hamlet.txt").write_text("to be")  # here now, and too short
  capsys.readouterr()
  assert main(["plan", *TINY, "--data", "hamlet.txt"]) == 2
  local = (tmp_path / "hamlet.txt").resolve()
  assert f"{local}: 5 bytes are too few" in capsys.readouterr().err


def _bad(tmp_path: Path, kind: str) -> Path:
  path = tmp_path / f"{kind}.txt"
  if kind == "missing":
    return path
  if kind == "directory":
    path.mkdir()
    return path
  path.write_bytes(
    {"empty": b"", "binary": bytes(range(256)) * 8, "latin1": b"caf\xe9 " * 50}[kind]
  )
  return path


@pytest.mark.parametrize(
  "kind, message",
  [
    ("missing", "no such file or directory"),
    ("empty", "the file is empty"),
    ("binary", "binary data (NUL bytes), not text"),
    ("latin1", "not UTF-8 text (invalid byte at offset 3)"),
    ("directory", "the directory holds no files"),
  ],
)
def test_bad_data_is_one_line(kind, message, tmp_path, capsys):
  path = _bad(tmp_path, kind)
  assert main(["train", *TINY, "--data", str(path), "--model_dir", str(tmp_path / "run")]) == 2
  err = capsys.readouterr().err
  assert err == f"t5x-optim train: error: --data {path}: {message}.\n"


def test_too_little_text_names_the_window(tmp_path, capsys):
  path = tmp_path / "short.txt"
  path.write_text("to be")
  assert main(["plan", *TINY, "--data", str(path)]) == 2
  err = capsys.readouterr().err
  assert len(err.splitlines()) == 1 and "5 bytes are too few" in err, err
  # gin's note on where the value was built ("In call to configurable 'TextTask' ...") is
  # not the user's to read.
  assert err.endswith("each (eval_fraction=0.1).\n"), err


def test_a_model_dir_inside_the_data_directory_is_refused(tmp_path, capsys):
  """--data corp --model_dir corp/run trained, and every resume then failed on the run's own
  checkpoint files read as text ("binary data (NUL bytes)")."""
  corpus = tmp_path / "corp"
  corpus.mkdir()
  (corpus / "a.txt").write_text("to be or not to be " * 50)
  model_dir = corpus / "run"
  assert main(["train", *TINY, "--data", str(corpus), "--model_dir", str(model_dir)]) == 2
  assert capsys.readouterr().err == (
    f"t5x-optim train: error: --data {corpus} holds --model_dir {model_dir}: the run would "
    "read its own checkpoints and logs as text; put the model directory elsewhere.\n"
  )


@pytest.mark.slow
def test_text_training_learns_and_writes_the_text_config(tmp_path, capsys):
  model_dir = tmp_path / "run"
  argv = ["train", *TINY, "--data", "hamlet.txt", "--model_dir", str(model_dir)]
  argv += ["--gin_bindings", "TOTAL_STEPS = 30", "--num_devices", "2"]
  assert main(argv) == 0
  out = capsys.readouterr().out
  first, final = map(float, re.search(r"^loss (\S+) -> ([\d.]+)", out, re.M).groups())
  assert first > 5.0 and final < first - 1.5, out
  assert "eval loss" in out
  config = (model_dir / "config.gin").read_text()
  assert "cli.TextTask.path = " in config and str(_text.DATA_DIR / "hamlet.txt") in config


def test_batches_read_their_windows_only(tmp_path, monkeypatch):
  path = tmp_path / "big.txt"
  path.write_bytes(b"the quick brown fox jumps over the lazy dog\n" * 200_000)  # 8.8 MB
  task = TextTask(path=str(path), length=16, batch_size=8)
  read: list[int] = []
  opened = Path.open

  def counting_open(self, *args, **kwargs):
    stream = opened(self, *args, **kwargs)
    original = stream.read

    def read_some(size=-1):
      data = original(size)
      read.append(len(data))
      return data

    stream.read = read_some
    return stream

  monkeypatch.setattr(Path, "open", counting_open)
  task.batch(0)
  task.eval_batch(0, rows=slice(0, 2))
  assert sum(read) == 10 * 17


def _corpus(root: Path, texts: dict[str, str]) -> Path:
  for name, text in texts.items():
    (root / name).parent.mkdir(parents=True, exist_ok=True)
    (root / name).write_text(text)
  return root


_TEXTS = {"a.txt": "first file " * 50, "b/c.txt": "middle " * 50, "z.txt": "last file " * 50}


def test_the_data_summary_tells_a_stale_copy_from_a_copy(tmp_path):
  """What the processes of a job compare: equal for two copies of one corpus anywhere."""
  one = _text.data_summary(_corpus(tmp_path / "one", _TEXTS))
  assert one.startswith("3 files, 1,400 bytes, digest ")
  assert _text.data_summary(_corpus(tmp_path / "two", _TEXTS)) == one
  for name, text in [("b/c.txt", "middle " * 49), ("z.txt", "LAST file " * 50)]:
    stale = _corpus(tmp_path / f"stale_{len(name)}", {**_TEXTS, name: text})
    assert _text.data_summary(stale) != one, name


def test_the_data_summary_tells_text_edited_past_the_heads(tmp_path):
  """Names, sizes and the first 64 KiB of the first and last file: a corpus edited in place
  past them (same size) resumed as the same text, and trained on the other."""
  line = "".join(f"line {i} of a long corpus\n" for i in range(40_000))
  files = {"a.txt": line, "b.txt": line, "c.txt": line}
  one = _text.data_summary(_corpus(tmp_path / "one", files))
  for name in files:  # every file past its first 64 KiB, in upper case
    edited = {**files, name: line[: 1 << 16] + line[1 << 16 :].upper()}
    assert _text.data_summary(_corpus(tmp_path / f"edited_{name}", edited)) != one, name


def test_the_data_summary_names_an_empty_file(tmp_path):
  """Its windows read through an empty file between two others: "the file shrank while
  training", before any training."""
  corpus = _corpus(tmp_path, {"a.txt": "first " * 100, "b.txt": "", "c.txt": "last " * 100})
  with pytest.raises(ValueError, match=r"b.txt: the file is empty\."):
    _text.data_summary(corpus)


@pytest.mark.slow
def test_the_data_summary_does_not_depend_on_the_hash_seed(tmp_path):
  """Equal in any process: a set of paths iterated in hash order made it differ between them."""
  one = _text.data_summary(_corpus(tmp_path / "one", _TEXTS))
  code = f"from t5x_optim.cli.demo import text; print(text.data_summary({str(tmp_path / 'one')!r}))"
  for seed in ("1", "2"):
    env = {**os.environ, "PYTHONHASHSEED": seed, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
      [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == one
