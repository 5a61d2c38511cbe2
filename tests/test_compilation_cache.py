"""`t5x-optim train`'s compilation cache: a restart loads its compiled steps, and trains the same."""

from __future__ import annotations

import argparse
import hashlib
import json
import zlib
from pathlib import Path

import jax
import numpy as np
import pytest

from t5x_optim import Checkpointer
from t5x_optim.cli import main
from t5x_optim.cli._main import _cache_directory
from t5x_optim.cli.loop import config as _config
from t5x_optim.cli.loop import train as _train
from t5x_optim.cli.loop.compilation_cache import compilation_cache, remove_damaged

pytestmark = pytest.mark.usefixtures("clean_gin")

EIGHT_BIT = ["--gin_file", "examples/tiny.gin", "--gin_file", "optimizers/adamw_8bit.gin"]
LOADED = "compilation cache: "
CONSTANT_RATE = ["--gin_bindings", "LEARNING_RATE = 5e-3"]
"""No schedule over TOTAL_STEPS: a start that trains further runs the same program, as the
restart of a preempted job does."""


@pytest.fixture
def cache_everything():
  """jax caches every program (the tiny job's compile in well under jax's default 1 s)."""
  previous = jax.config.jax_persistent_cache_min_compile_time_secs
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  yield
  jax.config.update("jax_persistent_cache_min_compile_time_secs", previous)


def _train_to(model_dir: Path, steps: int, *flags: str) -> int:
  return main(
    ["train", *EIGHT_BIT, *CONSTANT_RATE, "--model_dir", str(model_dir)]
    + ["--gin_bindings", f"TOTAL_STEPS = {steps}"]
    + list(flags)
  )


def _loaded_line(out: str) -> str | None:
  return next((line for line in out.splitlines() if line.startswith(LOADED)), None)


def _entries(model_dir: Path) -> list[Path]:
  return sorted((model_dir / "compilation_cache").glob("*-cache"))


def _final_state(model_dir: Path):
  _config.parse_config(
    gin_files=EIGHT_BIT[1::2], gin_bindings=CONSTANT_RATE[1::2], macros=_config.device_macros(8)
  )
  setup = _train.prepare(_config.build_job())
  with Checkpointer(model_dir / "checkpoints") as checkpointer:
    return checkpointer.restore(setup.abstract_state)


@pytest.mark.slow
@pytest.mark.usefixtures("cache_everything")
def test_a_restart_loads_its_compiled_steps_and_trains_bit_for_bit_the_same(tmp_path, capsys):
  cached, uncached = tmp_path / "cached", tmp_path / "uncached"
  assert _train_to(cached, 2) == 0
  first = capsys.readouterr().out
  assert f"compile cache:   {cached / 'compilation_cache'}" in first
  assert _loaded_line(first) is None
  assert any(p.name.startswith("jit__train_step-") for p in _entries(cached))
  assert _train_to(cached, 4) == 0
  loaded = _loaded_line(capsys.readouterr().out)
  assert loaded is not None and f" loaded from {cached / 'compilation_cache'} " in loaded
  # The train step at least (this process holds the rest of what the first run compiled in
  # memory), loaded: no second entry of it.
  assert int(loaded.split()[2]) >= 1
  assert len([p for p in _entries(cached) if p.name.startswith("jit__train_step-")]) == 1
  assert _train_to(uncached, 4, "--compilation_cache", "none") == 0
  out = capsys.readouterr().out
  assert "compile cache:   none" in out and _loaded_line(out) is None
  assert not (uncached / "compilation_cache").exists()
  # jax's settings are back: a later compile in this process writes no entry.
  assert jax.config.jax_compilation_cache_dir is None
  before = _entries(cached)
  jax.jit(lambda x: x * 3 + 1).lower(np.zeros(7)).compile()
  assert _entries(cached) == before
  a, b = _final_state(cached), _final_state(uncached)
  assert int(a.step) == int(b.step) == 4
  a, b = jax.tree.leaves(a.state_dict()), jax.tree.leaves(b.state_dict())
  assert len(a) == len(b) > 0
  for x, y in zip(a, b, strict=True):
    np.testing.assert_array_equal(x, y)


@pytest.mark.slow
@pytest.mark.usefixtures("cache_everything")
def test_an_entry_cut_short_is_deleted_and_written_again(tmp_path, capsys):
  """An entry jax was writing when the process was killed: without deleting it, every later
  start fails to read it and compiles again, and jax never writes it again."""
  assert _train_to(tmp_path, 2) == 0
  capsys.readouterr()
  entries = _entries(tmp_path)
  for entry in entries:
    entry.write_bytes(entry.read_bytes()[: len(entry.read_bytes()) // 2])
  assert _train_to(tmp_path, 3) == 0
  loaded = _loaded_line(capsys.readouterr().out)
  assert loaded.endswith(f"; {len(entries)} damaged entries deleted")
  assert loaded.startswith(f"{LOADED}0 compiled programs loaded")
  rewritten = _entries(tmp_path)
  assert [p for p in rewritten if p.name.startswith("jit__train_step-")] == [
    p for p in entries if p.name.startswith("jit__train_step-")
  ]
  for entry in rewritten:
    zlib.decompress(entry.read_bytes())
  assert _train_to(tmp_path, 4) == 0
  loaded = _loaded_line(capsys.readouterr().out)
  assert int(loaded.split()[2]) >= 1 and "damaged" not in loaded


@pytest.mark.parametrize(
  ("flag", "jax_dir", "jax_on", "expected"),
  [
    (None, None, True, ("{run}/compilation_cache", "{run}/compilation_cache")),
    ("{tmp}/shared", None, True, ("{tmp}/shared", "{tmp}/shared")),
    ("none", None, True, (None, "none")),
    (None, "{tmp}/own", True, (None, "{tmp}/own (jax's JAX_COMPILATION_CACHE_DIR)")),
    ("{tmp}/shared", "{tmp}/own", True, ("{tmp}/shared", "{tmp}/shared")),
    (None, None, False, (None, "none (jax's JAX_ENABLE_COMPILATION_CACHE is off)")),
  ],
)
def test_which_cache_a_run_keeps(flag, jax_dir, jax_on, expected, tmp_path):
  """The flag, else jax's own settings, else the model directory's; and the banner's words."""
  fill = {"tmp": tmp_path, "run": tmp_path / "run"}
  previous = (jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache)
  jax.config.update("jax_compilation_cache_dir", jax_dir and jax_dir.format(**fill))
  jax.config.update("jax_enable_compilation_cache", jax_on)
  try:
    flag = None if flag is None else Path(flag.format(**fill))
    directory, text = _cache_directory(argparse.Namespace(compilation_cache=flag), fill["run"])
  finally:
    jax.config.update("jax_compilation_cache_dir", previous[0])
    jax.config.update("jax_enable_compilation_cache", previous[1])
  want_dir, want_text = expected
  assert (None if directory is None else str(directory)) == (want_dir and want_dir.format(**fill))
  assert text == want_text.format(**fill)


def test_an_unusable_cache_directory_is_one_line_and_nothing_trained(tmp_path, capsys):
  blocker = tmp_path / "a_file"
  blocker.write_text("")
  status = _train_to(tmp_path / "run", 1, "--compilation_cache", str(blocker / "cache"))
  assert status == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1
  assert err[0].startswith(f"t5x-optim train: error: --compilation_cache {blocker / 'cache'} ")
  assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_a_default_cache_that_cannot_be_made_is_a_warning_and_the_run_goes_on(tmp_path, capsys):
  (tmp_path / "compilation_cache").write_text("a file where the cache would go")
  assert _train_to(tmp_path, 1) == 0
  out, err = capsys.readouterr()
  assert (
    f"t5x-optim train: warning: no compilation cache ({tmp_path / 'compilation_cache'}: " in err
  )
  # The banner named the directory it could not use as the run's cache.
  assert "compile cache:   none (the warning above says why)\n" in out, out
  assert (tmp_path / "checkpoints").is_dir()


def test_an_entry_that_cannot_be_deleted_is_logged_and_jax_compiles_anew(
  tmp_path, monkeypatch, caplog
):
  from t5x_optim.cli.loop import compilation_cache as module  # noqa: PLC0415

  def refuse(directory):
    raise PermissionError(13, "Permission denied", str(directory / _entry("a")))

  monkeypatch.setattr(module, "remove_damaged", refuse)
  with caplog.at_level("WARNING"), compilation_cache(tmp_path) as use:
    assert use.removed == 0
  assert "could not delete a damaged compilation-cache entry" in caplog.text


def _entry(name: str) -> str:
  """The name jax gives a cache entry: module name, key's SHA-256, ``-cache``."""
  return f"jit_{name}-{hashlib.sha256(name.encode()).hexdigest()}-cache"


def test_remove_damaged_reads_and_deletes_jaxs_entries_alone(tmp_path):
  """--compilation_cache pointed at a directory shared with other files deleted any file named
  ``*-cache`` that was not compressed data, and said "1 damaged entry deleted"."""
  (tmp_path / "build-cache").write_text("the user's own")
  (tmp_path / "jit_a-1-cache").write_bytes(b"")
  (tmp_path / _entry("b")).write_bytes(b"")
  assert remove_damaged(tmp_path) == 1
  assert sorted(p.name for p in tmp_path.iterdir()) == [
    "build-cache",
    "intact-entries.json",
    "jit_a-1-cache",
  ]


def test_remove_damaged_keeps_intact_entries_and_other_files(tmp_path):
  """jax compresses every entry (zstd, else zlib): an entry in neither format, such as one a
  crash left filled with zeros, was kept and recorded intact, and jax warned at every start
  that it could not read it and never cached that program again."""
  intact = zlib.compress(b"executable" * 100)
  (tmp_path / _entry("a")).write_bytes(intact)
  (tmp_path / _entry("b")).write_bytes(intact[:-3])
  (tmp_path / _entry("c")).write_bytes(b"")
  (tmp_path / _entry("d")).write_bytes(b"\x00unknown format")
  (tmp_path / _entry("f")).write_bytes(bytes(len(intact)))
  (tmp_path / "jit_e-5-atime").write_bytes(b"\x00" * 8)
  assert remove_damaged(tmp_path) == 4
  assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
    ["intact-entries.json", _entry("a"), "jit_e-5-atime"]
  )
  assert remove_damaged(tmp_path / "absent") == 0


def _reads(monkeypatch) -> list[bytes]:
  """The contents of each entry `remove_damaged` reads from now on, in order."""
  from t5x_optim.cli.loop import compilation_cache as module  # noqa: PLC0415

  read, damaged = [], module._damaged

  def counting(data):
    read.append(data)
    return damaged(data)

  monkeypatch.setattr(module, "_damaged", counting)
  return read


def test_an_entry_found_intact_is_not_read_at_the_next_start(tmp_path, monkeypatch):
  """Each start reads only the entries written since the last: jax never rewrites an entry."""
  (tmp_path / _entry("a")).write_bytes(zlib.compress(b"a" * 100))
  (tmp_path / _entry("b")).write_bytes(zlib.compress(b"b" * 100))
  read = _reads(monkeypatch)
  assert remove_damaged(tmp_path) == 0
  assert len(read) == 2
  (tmp_path / _entry("c")).write_bytes(zlib.compress(b"c" * 100))
  assert remove_damaged(tmp_path) == 0
  assert read[2:] == [zlib.compress(b"c" * 100)]
  assert remove_damaged(tmp_path) == 0
  assert len(read) == 3


def test_an_entry_whose_size_changed_is_checked_again(tmp_path):
  """Deleted and written again (cut short this time): its size differs from the one checked."""
  entry = tmp_path / _entry("a")
  entry.write_bytes(zlib.compress(b"a" * 100))
  assert remove_damaged(tmp_path) == 0
  entry.write_bytes(zlib.compress(b"a" * 100)[:-3])
  assert remove_damaged(tmp_path) == 1
  assert not entry.exists()
  assert json.loads((tmp_path / "intact-entries.json").read_text()) == {}


@pytest.mark.parametrize("record", ["{not json", '["a list"]', '{_entry("a"): "big"}'])
def test_an_unreadable_record_of_checked_entries_checks_every_entry(tmp_path, record):
  (tmp_path / _entry("a")).write_bytes(zlib.compress(b"a" * 100)[:-3])
  (tmp_path / "intact-entries.json").write_text(record)
  assert remove_damaged(tmp_path) == 1
  assert json.loads((tmp_path / "intact-entries.json").read_text()) == {}


def test_a_record_that_cannot_be_written_is_logged_and_entries_still_checked(tmp_path, caplog):
  (tmp_path / _entry("a")).write_bytes(b"")
  (tmp_path / "intact-entries.json").mkdir()
  with caplog.at_level("WARNING"):
    assert remove_damaged(tmp_path) == 1
  assert "could not record the intact compilation-cache entries" in caplog.text


def test_the_context_restores_jaxs_settings_when_its_body_fails(tmp_path):
  with pytest.raises(RuntimeError), compilation_cache(tmp_path):
    assert jax.config.jax_compilation_cache_dir == str(tmp_path)
    raise RuntimeError
  assert jax.config.jax_compilation_cache_dir is None
  assert jax.config.jax_enable_compilation_cache
