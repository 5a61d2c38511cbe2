"""Model directories on ``gs://``, against a local GCS emulator (tests/_gcs_emulator.py).

The emulator runs on a free 127.0.0.1 port for this module, with a fresh
bucket; tensorstore and gcsfs reach it through ``TENSORSTORE_GCS_HTTP_URL``
and ``STORAGE_EMULATOR_HOST``. The commands are docs/cloud-storage.md's
ones.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
import time
import types
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts
from _gcs_emulator import Emulator  # Before gcsfs loads: it configures it.
from _ocdbt import flip_bytes
from _subprocesses import with_xla_flags
from etils import epath
from tensorboard.backend.event_processing import event_accumulator
from test_readme import _expected
from test_t5x_checkpoints import DATA, _assert_bit_for_bit, _partitioner, _target

import t5x_optim
from t5x_optim import optimizers
from t5x_optim._checkpoint import storage
from t5x_optim._checkpoint.lease import LEASE_FILE, Lease
from t5x_optim.checkpoints import Checkpointer, CheckpointError, WriterLock
from t5x_optim.cli import main
from t5x_optim.cli.loop import train as _train
from t5x_optim.cli.loop.metrics import MetricWriters

pytest.importorskip("gcsfs")
pytest.importorskip("gcp_storage_emulator")

REPO = Path(__file__).resolve().parents[1]
TINY = ["--gin_file", "examples/tiny.gin"]
CONSTANT_RATE = ["--gin_bindings", "LEARNING_RATE = 5e-3"]
"""No schedule over TOTAL_STEPS: a start that trains further runs the same train step."""


@pytest.fixture(scope="module")
def emulator():
  with Emulator() as running:
    yield running


@pytest.fixture(scope="module")
def bucket(emulator) -> str:
  """A fresh bucket of this module, as ``gs://<name>``."""
  name = f"t5x-optim-{uuid.uuid4().hex[:8]}"
  emulator.create_bucket(name)
  return f"gs://{name}"


@pytest.fixture
def where(bucket, request) -> str:
  """A directory of its own for each test."""
  return f"{bucket}/{request.node.name.replace('[', '-').rstrip(']')}"


def _subprocess_env() -> dict[str, str]:
  """This environment (the emulator's included) for a fresh interpreter on one CPU device."""
  env = with_xla_flags(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
  return env


def _upload(local: Path, remote: str) -> None:
  for file in local.rglob("*"):
    if file.is_file():
      (epath.Path(remote) / file.relative_to(local).as_posix()).write_bytes(file.read_bytes())


def _names(remote: str) -> list[str]:
  return sorted(p.name for p in epath.Path(remote).iterdir())


def _opt(scale: float = 1.0):
  return optimizers.adam(0.1).create({"w": jnp.full((64, 32), scale), "b": jnp.arange(8.0)})


def _equal(a, b) -> bool:
  return all(np.array_equal(a.target[k], b.target[k]) for k in ("w", "b"))


@pytest.mark.slow
def test_checkpointer_saves_restores_and_falls_back(where):
  with Checkpointer(where, async_save=False) as ckpt:
    ckpt.save(1, _opt(1.0))
    ckpt.save(2, _opt(2.0))
    assert ckpt.all_steps() == [1, 2]
    assert LEASE_FILE in _names(where)
  assert _names(where) == ["1", "2"]  # Closing deleted the lease.
  with Checkpointer(where) as reader:
    assert _equal(reader.restore(_opt(0.0)), _opt(2.0))
  # Corrupt the arrays of step 2: fallback restores step 1.
  objects = ts.KvStore.open(storage.kvstore_spec(f"{where}/2/")).result().list().result()
  for key in objects:
    if b"/d/" in key:
      (epath.Path(f"{where}/2") / key.decode()).write_bytes(b"garbage")
  with Checkpointer(where) as reader:
    with pytest.raises(CheckpointError, match="Checkpoint step 2 in gs://"):
      reader.restore(_opt(0.0))
    assert _equal(reader.restore(_opt(0.0), fallback=True), _opt(1.0))
    assert reader.restored_step == 1


def test_files_under_and_seeking_reads(where):
  for name in ["a.txt", "d/b.txt", "d/e/c.txt"]:
    (epath.Path(where) / name).write_text(name)
  files = storage.files_under(where)
  assert [storage.file_size(p) for p in files] == [5, 7, 9]
  assert [os.fspath(p) for p in files] == [
    f"{where}/{n}" for n in ["a.txt", "d/b.txt", "d/e/c.txt"]
  ]
  with files[2].open("rb") as stream:
    stream.seek(2)
    assert stream.read() == b"e/c.txt"


def test_files_under_lists_a_tree_in_one_order_on_every_storage(where, tmp_path):
  """'books/vol1.txt' came before 'books.txt' on local disk and after it on gs://: one corpus
  copied to a bucket was another byte stream, held out other text and resumed as other data."""
  names = ["books.txt", "books/vol1.txt", "books-2.txt", "a/b/c.txt", "a.b"]
  for name in names:
    (epath.Path(where) / name).write_text(name)
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).write_text(name)
  local = [p.relative_to(tmp_path).as_posix() for p in storage.files_under(tmp_path)]
  remote = [os.fspath(p)[len(where) + 1 :] for p in storage.files_under(where)]
  assert remote == local, (remote, local)


@pytest.mark.slow
def test_one_writer_by_lease_and_a_stale_lease_is_taken_over(where, monkeypatch):
  monkeypatch.setattr(Lease, "seconds", 1.5)  # A live writer renews it every 0.5 s.
  with Checkpointer(where) as first, Checkpointer(where) as second:
    first.save(1, _opt())
    started = time.monotonic()
    with pytest.raises(CheckpointError, match=rf"{where} is in use by another writer \(pid "):
      second.save(2, _opt())
    assert time.monotonic() - started >= 1.5  # Tried for one lease period.
  # A writer killed without releasing its lease: the next one's first save waits it out.
  killed = {"holder": "pid 1 on gone", "expires": time.time() + 0.7}
  lease_dir = ts.KvStore.open(storage.kvstore_spec(f"{where}/")).result()
  lease_dir.write(LEASE_FILE, json.dumps(killed).encode()).result()
  with Checkpointer(where, async_save=False) as writer:
    writer.save(2, _opt())
  stale = {"holder": "pid 1 on gone", "expires": time.time() - 1}
  lease_dir.write(LEASE_FILE, json.dumps(stale).encode()).result()
  with Checkpointer(where, async_save=False) as writer:
    writer.save(3, _opt())
    holder = json.loads((epath.Path(where) / LEASE_FILE).read_text())["holder"]
    assert holder == f"pid {os.getpid()} on {os.uname().nodename}"


@pytest.mark.slow
def test_a_writer_whose_lease_was_taken_over_refuses_to_save(where, monkeypatch):
  monkeypatch.setattr(Lease, "seconds", 0.3)  # Renewed every 0.1 s.
  with Checkpointer(where, async_save=False) as writer:
    writer.save(1, _opt())
    # Another writer found the lease expired (a long stall, say) and took it.
    other = {"holder": "pid 2 on other", "expires": time.time() + 60}
    lease_dir = ts.KvStore.open(storage.kvstore_spec(f"{where}/")).result()
    lease_dir.write(LEASE_FILE, json.dumps(other).encode()).result()
    lease = writer._open.lock._lease
    deadline = time.monotonic() + 30
    while not lease.lost and time.monotonic() < deadline:  # The next renewal finds it gone.
      time.sleep(0.05)
    with pytest.raises(
      CheckpointError, match="lost its writer lease .*another writer took it over"
    ):
      writer.save(2, _opt())
  assert json.loads((epath.Path(where) / LEASE_FILE).read_text())["holder"] == "pid 2 on other"


@pytest.mark.slow
def test_a_run_lock_waits_out_the_lease_of_a_killed_run_but_not_a_live_one(where, monkeypatch):
  """A run killed without releasing its lease (SIGKILL) holds it until it expires; a live run
  renews it. `WriterLock.take(wait_out_stale=True)` waits one lease period to tell them apart,
  so a job restarted at once takes its directory over, and a second job is still refused."""
  monkeypatch.setattr(Lease, "seconds", 1.5)  # Renewed every 0.5 s.
  killed = {"holder": "pid 1 on gone", "expires": time.time() + 0.7}
  lease_dir = ts.KvStore.open(storage.kvstore_spec(f"{where}/")).result()
  lease_dir.write(LEASE_FILE, json.dumps(killed).encode()).result()
  assert WriterLock(where).take().startswith("is in use by another writer (pid 1 on gone")
  restarted = WriterLock(where)
  started = time.monotonic()
  assert restarted.take(wait_out_stale=True) == ""
  assert 0.3 < time.monotonic() - started < 1.5
  second = WriterLock(where)
  started = time.monotonic()
  assert second.take(wait_out_stale=True).startswith("is in use by another writer (pid ")
  assert time.monotonic() - started >= 1.5
  restarted.release()


_KILLED_MID_SAVE = """
import os, signal, sys, time
import jax.numpy as jnp
import tensorstore as ts
from t5x_optim import optimizers
from t5x_optim._checkpoint import storage
from t5x_optim._checkpoint.lease import Lease
from t5x_optim.checkpoints import Checkpointer
Lease.seconds = 1.0
ckpt = Checkpointer(sys.argv[1])
ckpt.save(1, optimizers.sgd(0.1).create({"w": jnp.ones((8,))}))
ckpt.wait_until_finished()
big = optimizers.adam(0.1).create({f"w{i}": jnp.full((256, 256), 2.0) for i in range(32)})
ckpt.save(2, big)  # Returns once the arrays are off the devices; the writes go on.
listing = ts.KvStore.open(storage.kvstore_spec(sys.argv[1] + "/")).result()
while not any(key.startswith(b"2") for key in listing.list().result()):
  time.sleep(0.005)
print("killed with", len(listing.list().result()), "objects", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.slow
def test_a_save_killed_midway_leaves_the_previous_step(where, emulator):
  code = textwrap.dedent(_KILLED_MID_SAVE)
  result = subprocess.run(
    [sys.executable, "-c", code, where],
    env=_subprocess_env(),
    capture_output=True,
    text=True,
    timeout=120,
    check=False,
  )
  assert result.returncode == -9 and "killed with" in result.stdout, result.stderr[-2000:]
  assert any(name.startswith("2") for name in _names(where))  # Step 2 was begun.
  target = optimizers.sgd(0.1).create({"w": jnp.zeros((8,))})
  with Checkpointer(where, async_save=False) as ckpt:
    assert ckpt.all_steps() == [1]
    assert ckpt.restore(target).target["w"].tolist() == [1.0] * 8
    # At once: the new writer waits the dead one's lease out (1 s), takes it over and
    # removes the partial step.
    ckpt.save(2, target)
    assert ckpt.all_steps() == [1, 2]


def test_a_step_whose_save_began_only_is_not_committed(where):
  """On gs:// orbax writes a step in place, its metadata first: only commit_success.txt,
  written last, says the save completed."""
  with Checkpointer(where, async_save=False) as ckpt:
    ckpt.save(1, _opt(1.0))
    metadata = epath.Path(where) / "1" / "_CHECKPOINT_METADATA"
    (epath.Path(where) / "2" / "_CHECKPOINT_METADATA").write_bytes(metadata.read_bytes())
    assert [ckpt.is_committed(step) for step in (1, 2)] == [True, False]
    assert ckpt.all_steps() == [1]


@pytest.mark.usefixtures("clean_gin")
@pytest.mark.parametrize(
  ("files", "below", "message"),
  [
    (["5/default/x", "5/commit_success.txt"], "5/sub", "is inside {run}/checkpoints/5, step 5 of"),
    (
      ["2/commit_success.txt", "2/checksums/checksums.json"],
      "4/sub",
      "is inside {run}/checkpoints/4, the directory of step 4 still to come of the run in {run},",
    ),
    (["5/_CHECKPOINT_METADATA"], "5/sub", None),  # a save on gs:// that began only
  ],
  ids=["committed", "to_come", "begun"],
)
def test_a_model_dir_in_a_step_of_a_run_on_gs_is_refused(files, below, message, where, capsys):
  """A --model_dir in a committed step of another run on gs://, or in one still to come, was
  taken (only a local one was refused); the other run's rotation then deleted it."""
  run = f"{where}/A"
  for name in [*files, "../config.gin"]:
    epath.Path(f"{run}/checkpoints/{name}".replace("checkpoints/../", "")).write_text("{}")
  bad = ["--gin_bindings", "cli.TrainJob.total_stepz = 3"]
  assert main(["train", *TINY, *bad, "--model_dir", f"{run}/checkpoints/{below}"]) == 2
  err = capsys.readouterr().err
  assert len(err.strip().splitlines()) == 1, err
  if message is None:
    assert "total_stepz" in err and "is inside" not in err, err
  else:
    assert message.format(run=run) in err, err
    assert not epath.Path(f"{run}/checkpoints/{below}").exists()


# The quick loop reads the orbax format; the legacy one (many small objects) takes seconds.
@pytest.mark.parametrize("fmt", [pytest.param("legacy", marks=pytest.mark.slow), "orbax"])
def test_t5x_checkpoints_read_from_gs(fmt, where):
  _upload(DATA / fmt, where)
  expected = dict(np.load(DATA / "expected.npz"))
  assert t5x_optim.t5x_checkpoint_steps(where) == [2]
  _assert_bit_for_bit(
    t5x_optim.restore_t5x_checkpoint(where, _target(_partitioner(2, 4))), expected
  )


@pytest.mark.slow
def test_t5x_legacy_write_then_read(where):
  expected = dict(np.load(DATA / "expected.npz"))
  target = _target(_partitioner(2, 4))
  state = t5x_optim.restore_t5x_checkpoint(DATA / "legacy", target)
  path = t5x_optim.save_t5x_checkpoint(where, state, step=2)
  assert path == f"{where}/checkpoint_2"
  assert _names(where) == ["checkpoint_2"]
  _assert_bit_for_bit(t5x_optim.restore_t5x_checkpoint(where, target), expected)
  with pytest.raises(storage.StorageError, match="gs://no-such-bucket-t5x/x: the bucket"):
    t5x_optim.save_t5x_checkpoint("gs://no-such-bucket-t5x/x", state, step=2)
  with pytest.raises(FileExistsError, match="checkpoint_2 exists already"):
    t5x_optim.save_t5x_checkpoint(where, state, step=2)
  # A crashed save: arrays without their msgpack (the commit record) are no step, and
  # are replaced by the next save of that step.
  (epath.Path(path) / "checkpoint").unlink()
  assert t5x_optim.t5x_checkpoint_steps(where) == []
  t5x_optim.save_t5x_checkpoint(where, state, step=2)
  _assert_bit_for_bit(t5x_optim.restore_t5x_checkpoint(where, target), expected)


def _scalars(remote: str, local: Path) -> dict[str, list[int]]:
  """The steps of every scalar in `remote`'s event files, read by TensorBoard (through fsspec).

  Where TensorFlow is installed, TensorBoard reads gs:// through TensorFlow's gfile, which has
  no emulator endpoint: it then reads a copy in ``local``, made through epath (gcsfs).
  """
  if importlib.util.find_spec("tensorflow") is not None:
    for file in epath.Path(remote).iterdir():
      (local / file.name).write_bytes(file.read_bytes())
    remote = str(local)
  accumulator = event_accumulator.EventAccumulator(remote)
  accumulator.Reload()
  return {tag: [e.step for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


@pytest.mark.slow
def test_a_start_on_gs_removes_the_events_after_its_step(where, tmp_path):
  """The events a killed run wrote after its last save are removed from the objects too, where
  TensorBoard's default loader (which ignores purge steps) drew them beside the resumed run's."""
  with MetricWriters(where, start_step=0) as writers:
    for step in (1, 2, 3):
      writers.write("train", step, {"loss": float(step)})
  with MetricWriters(where, start_step=1) as writers:
    writers.write("train", 2, {"loss": 0.5})
  for file in epath.Path(where, "train").iterdir():
    (tmp_path / file.name).write_bytes(file.read_bytes())
  accumulator = event_accumulator.EventAccumulator(str(tmp_path), purge_orphaned_data=False)
  accumulator.Reload()
  assert [(e.step, e.value) for e in accumulator.Scalars("loss")] == [(1, 1.0), (2, 0.5)]


@pytest.mark.slow
def test_an_event_file_upload_refused_at_the_start_is_one_line(where, monkeypatch, capsys):
  """The writers open before the loop, whose errors are one line: a refused first upload
  ended the run in a raw traceback naming no object."""
  model_dir = f"{where}/run"
  gpath = type(epath.Path(model_dir))
  write_bytes = gpath.write_bytes

  def refuse_events(self, data):
    if "/train/events" in os.fspath(self):
      raise RuntimeError("injected, 503")  # gcsfs's HttpError is no OSError
    return write_bytes(self, data)

  monkeypatch.setattr(gpath, "write_bytes", refuse_events)
  assert main(["train", *TINY, "--gin_bindings", "TOTAL_STEPS = 2", "--model_dir", model_dir]) == 1
  line = capsys.readouterr().err.strip().splitlines()[-1]
  assert line.startswith("t5x-optim train: error at step 0: "), line
  assert f"{model_dir}/train/events" in line and "injected, 503" in line, line


@pytest.mark.slow
@pytest.mark.usefixtures("clean_gin")
def test_a_config_upload_refused_at_the_start_names_the_file(where, monkeypatch, capsys):
  """gcsfs's HttpError is no OSError and names no object: the line said only 'injected, 503'."""
  from gcsfs.retry import HttpError  # noqa: PLC0415 - after the emulator's settings (module top)

  model_dir = f"{where}/run"
  gpath = type(epath.Path(model_dir))
  write_bytes = gpath.write_bytes

  def refuse_config(self, data):
    if os.fspath(self) == f"{model_dir}/config.gin":
      raise HttpError({"code": 503, "message": "injected"})
    return write_bytes(self, data)

  monkeypatch.setattr(gpath, "write_bytes", refuse_config)
  assert main(["train", *TINY, "--gin_bindings", "TOTAL_STEPS = 2", "--model_dir", model_dir]) == 1
  line = capsys.readouterr().err.strip().splitlines()[-1]
  assert line.startswith("t5x-optim train: error at step 0: "), line
  assert f"{model_dir}/config.gin: injected, 503" in line, line
  assert [name for name in _names(model_dir) if name.endswith(".gin")] == ["config_0.gin"]


@pytest.mark.slow
@pytest.mark.usefixtures("clean_gin")
def test_a_corrupt_newest_checkpoint_on_gs_is_set_aside(where, tmp_path, capsys):
  """GCS has no folders: the rename of the corrupt step into an empty skipped_checkpoints/
  was refused ('folder ... does not exist'), and every start stopped on it."""
  local, model_dir = tmp_path / "run", f"{where}/run"
  flags = [*TINY, "--gin_bindings", "cli.TrainJob.checkpoint_every = 2", "--gin_bindings"]
  assert main(["train", *flags, "TOTAL_STEPS = 4", "--model_dir", str(local)]) == 0
  flip_bytes(local / "checkpoints" / "4", 1)
  _upload(local, model_dir)
  step = local / "checkpoints" / "4"
  corrupt = {p.relative_to(step).as_posix(): p.read_bytes() for p in step.rglob("*") if p.is_file()}
  capsys.readouterr()
  assert main(["train", *flags, "TOTAL_STEPS = 4", "--model_dir", model_dir]) == 0
  out = capsys.readouterr().out
  assert f"model_dir:       {model_dir} (resuming from the checkpoint at step 2)" in out, out
  kept = f"{model_dir}/skipped_checkpoints"
  assert f"skipped:         checkpoint step 4, kept in {kept}/4: " in out, out
  assert _names(kept) == ["4", "4.txt"]
  moved = storage.files_under(f"{kept}/4")
  assert {os.fspath(p).removeprefix(f"{kept}/4/"): p.read_bytes() for p in moved} == corrupt
  assert "was skipped on resume" in (epath.Path(kept) / "4.txt").read_text()
  assert [name for name in _names(f"{model_dir}/checkpoints") if name.isdigit()] == ["2", "4"]


def test_a_failed_copy_aside_on_gs_leaves_the_step_where_it_was(where, monkeypatch):
  """A step set aside on GCS is copied object by object: one copy refused (gcsfs's HttpError,
  no OSError) removes the copies made, keeps the step, and is an OSError for the one line."""
  from gcsfs.retry import HttpError  # noqa: PLC0415 - after the emulator's settings (module top)

  step, target = epath.Path(where, "checkpoints", "4"), epath.Path(where, "aside", "4")
  for name in ("a", "d/b", "d/c"):
    (step / name).write_text(name)
  gpath, copy = type(step), type(step).copy

  def refuse_c(self, dst, **kwargs):
    if self.name == "c":
      raise HttpError({"code": 503, "message": "injected"})
    return copy(self, dst, **kwargs)

  monkeypatch.setattr(gpath, "copy", refuse_c)
  with pytest.raises(OSError, match="injected, 503"):
    _train._move(step, target)
  assert not target.exists()
  assert [p.read_text() for p in storage.files_under(step)] == ["a", "d/b", "d/c"]


def _readme_commands() -> list[list[str]]:
  """The ``t5x-optim train`` lines of docs/cloud-storage.md's block."""
  text = (REPO / "docs" / "cloud-storage.md").read_text()
  block = re.search(r"<!-- cloud-commands -->\n```bash\n(.*?)^```", text, re.M | re.S).group(1)
  lines = block.splitlines()
  return [
    shlex.split(line, comments=True)[1:] for line in lines if line.startswith("t5x-optim train")
  ]


@pytest.mark.slow
@pytest.mark.usefixtures("clean_gin")
def test_readme_train_commands_run_resume_and_init_from_gs(bucket, capsys, tmp_path):
  new_run, resumed, init_from = [
    [arg.replace("gs://BUCKET", f"{bucket}/readme") for arg in command]
    for command in _readme_commands()
  ]
  where = f"{bucket}/readme/tiny"
  assert main(new_run) == 0
  assert f"model_dir:       {where} (new run)" in capsys.readouterr().out
  assert main(resumed) == 0
  assert "resuming from the checkpoint at step 40" in capsys.readouterr().out
  assert {"checkpoints", "config.gin", "train", "eval"} <= set(_names(where))
  assert _names(f"{where}/checkpoints") == ["40", "60", "80"]  # keep_checkpoints = 3
  assert "TOTAL_STEPS = 80" in (epath.Path(where) / "config.gin").read_text()
  assert _scalars(f"{where}/train", tmp_path)["loss"][-1] == 80
  assert main(init_from) == 0
  assert f"init_from:       {where} at step 80" in capsys.readouterr().out
  assert _names(f"{bucket}/readme/tiny-2/checkpoints") == ["100"]


@pytest.mark.slow
def test_readme_python_block_runs_on_gs(bucket, tmp_path):
  text = (REPO / "docs" / "cloud-storage.md").read_text()
  block = re.search(r"<!-- cloud-python -->\n```python\n(.*?)^```", text, re.M | re.S).group(1)
  result = subprocess.run(
    [sys.executable, "-c", block.replace("gs://BUCKET", f"{bucket}/readme-python")],
    cwd=tmp_path,
    env=_subprocess_env(),
    capture_output=True,
    text=True,
    timeout=120,
    check=False,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert [line.strip() for line in result.stdout.splitlines()] == _expected(block)


@pytest.mark.usefixtures("clean_gin")
@pytest.mark.parametrize(
  ("run", "env", "message"),
  [
    ("gs://no-such-bucket-t5x/run", {}, "the bucket no-such-bucket-t5x does not exist."),
    (
      "BUCKET/run",
      {"STORAGE_EMULATOR_HOST": None, "GOOGLE_APPLICATION_CREDENTIALS": "/nonexistent.json"},
      "no Google Cloud credentials (",
    ),
  ],
)
def test_a_missing_bucket_or_credential_is_one_line(run, env, message, bucket, monkeypatch, capsys):
  run = run.replace("BUCKET", bucket)
  for key, value in env.items():
    if value is None:
      monkeypatch.delenv(key)
    else:
      monkeypatch.setenv(key, value)
  assert main(["train", *TINY, "--model_dir", run]) == 2
  err = capsys.readouterr().err
  assert err.startswith(f"t5x-optim train: error: --model_dir {run}: {message}"), err
  assert len(err.strip().splitlines()) == 1, err


@pytest.mark.usefixtures("clean_gin")
@pytest.mark.parametrize(
  ("path", "message"),
  [
    ("s3://bkt/run", "s3://bkt/run: s3:// paths need the s3fs package, which is not installed"),
    ("hdfs://host/run", "hdfs://host/run: the scheme hdfs:// is not supported"),
  ],
)
@pytest.mark.parametrize("flag", ["--model_dir", "--init_from"])
def test_a_scheme_without_backend_is_one_line(flag, path, message, tmp_path, capsys):
  if path.startswith("s3") and storage.importlib.util.find_spec("s3fs") is not None:
    pytest.skip("s3fs is installed")
  with pytest.raises(storage.StorageError, match=message):
    storage.as_path(path)
  flags = [flag, path] if flag == "--model_dir" else [flag, path, "--model_dir", str(tmp_path)]
  assert main(["train", *TINY, *flags]) == 2
  err = capsys.readouterr().err
  assert err.startswith(f"t5x-optim train: error: {flag} {message}"), err
  assert len(err.strip().splitlines()) == 1, err


@pytest.mark.usefixtures("clean_gin")
@pytest.mark.parametrize(
  ("path", "message"),
  [
    (
      "gs://bkt/run#1",
      "gs://bkt/run#1: a gs:// path cannot hold '#' or '?': orbax reads it as a URL, whose path "
      "ends there, and would write the arrays of every step to gs://bkt/run",
    ),
    ("s3://bkt/a?b/run", "s3://bkt/a?b/run: a s3:// path cannot hold '#' or '?'"),
  ],
)
@pytest.mark.parametrize("flag", ["--model_dir", "--init_from", "--data", "--compilation_cache"])
def test_a_path_that_orbax_would_cut_short_is_one_line(flag, path, message, tmp_path, capsys):
  """orbax parses a gs:// path as a URL: '#' or '?' started a fragment or a query, and every
  step's arrays went to what came before, overwriting those of other steps and runs."""
  with pytest.raises(storage.StorageError, match=re.escape(message)):
    storage.as_path(path)
  with pytest.raises(storage.StorageError, match=re.escape(message)):
    Checkpointer(path)
  flags = [flag, path] if flag == "--model_dir" else [flag, path, "--model_dir", str(tmp_path)]
  assert main(["train", *TINY, *flags]) == 2
  err = capsys.readouterr().err
  assert err.startswith(f"t5x-optim train: error: {flag} {message}"), err
  assert len(err.strip().splitlines()) == 1, err
  assert list(tmp_path.iterdir()) == []


@pytest.mark.usefixtures("clean_gin")
@pytest.mark.parametrize(
  ("path", "message"),
  [
    (
      "gs:/bkt/run",
      "gs:/bkt/run: a local path that starts with gs: is a misspelt gs:// path (did you mean "
      "gs://bkt/run?); write ./gs:/bkt/run for a local directory of that name.",
    ),
    ("S3:bkt/run", "S3:bkt/run: a local path that starts with S3: is a misspelt s3:// path (did"),
  ],
)
@pytest.mark.parametrize("flag", ["--model_dir", "--init_from", "--data", "--compilation_cache"])
def test_a_scheme_with_one_slash_is_one_line(flag, path, message, tmp_path, capsys, monkeypatch):
  """``gs:/bkt/run`` was a local directory ``./gs:/bkt/run``: a run trained there, and every
  save failed, as orbax made a gs:// path of it again."""
  monkeypatch.chdir(tmp_path)
  with pytest.raises(storage.StorageError, match=re.escape(message)):
    storage.as_path(path)
  with pytest.raises(storage.StorageError, match=re.escape(message)):
    Checkpointer(path)
  flags = [flag, path] if flag == "--model_dir" else [flag, path, "--model_dir", "run"]
  assert main(["train", *TINY, *flags]) == 2
  err = capsys.readouterr().err
  assert err.startswith(f"t5x-optim train: error: {flag} {message}"), err
  assert len(err.strip().splitlines()) == 1, err
  assert list(tmp_path.iterdir()) == []
  assert storage.as_path(f"./{path}") == tmp_path / path


@pytest.mark.slow
@pytest.mark.usefixtures("clean_gin")
def test_an_upper_case_scheme_is_that_scheme(where, capsys):
  """``GS://bkt/run`` was taken for gs:// by some readers while epath raised KeyError 'GS://'."""
  upper = where.replace("gs://", "GS://")
  assert str(storage.as_path(upper)) == where
  with Checkpointer(upper, async_save=False) as ckpt:
    ckpt.save(1, _opt(1.0))
    assert ckpt.directory == where
  with Checkpointer(where) as reader:
    assert reader.all_steps() == [1]
  bad = ["--gin_bindings", "cli.TrainJob.total_stepz = 3"]
  assert main(["train", *TINY, *bad, "--model_dir", f"{upper}/run"]) == 2
  err = capsys.readouterr().err
  assert "total_stepz" in err and len(err.strip().splitlines()) == 1, err


def test_gs_without_gcsfs_names_the_extra(monkeypatch):
  absent = ("gcsfs", "tensorflow")
  find_spec = storage.importlib.util.find_spec
  monkeypatch.setattr(
    storage.importlib.util, "find_spec", lambda name: None if name in absent else find_spec(name)
  )
  with pytest.raises(
    storage.StorageError, match=r"pip install gcsfs or pip install 't5x-optim\[gcs\]'"
  ):
    storage.as_path("gs://bkt/run")


@pytest.mark.slow
@pytest.mark.usefixtures("clean_gin")
def test_train_on_text_data_from_gs(where, capsys):
  (epath.Path(where) / "text" / "hamlet.txt").write_bytes(
    (REPO / "t5x_optim/data/hamlet.txt").read_bytes()
  )
  flags = [
    "--data",
    f"{where}/text",
    "--gin_bindings",
    "TOTAL_STEPS = 2",
    "--model_dir",
    f"{where}/run",
  ]
  assert main(["train", *TINY, *flags]) == 0, capsys.readouterr().err
  assert _names(f"{where}/run/checkpoints") == ["2"]
  assert main(["train", *TINY, "--data", f"{where}/none", "--model_dir", f"{where}/run2"]) == 2
  assert "--data gs://" in capsys.readouterr().err


@pytest.fixture
def gcsfs_waits(monkeypatch) -> list[float]:
  """The waits gcsfs asks for before retrying a request, recorded, not waited for.

  gcsfs waits 1-2 s before its first retry; each flaky object would cost that.
  """
  import gcsfs.retry  # noqa: PLC0415 - after the emulator's settings (module top)

  waits = []

  async def record(seconds: float) -> None:
    waits.append(seconds)
    await asyncio.sleep(0)

  monkeypatch.setattr(gcsfs.retry, "asyncio", types.SimpleNamespace(sleep=record))
  return waits


@pytest.mark.slow
@pytest.mark.usefixtures("clean_gin")
def test_reads_retry_transient_errors(where, tmp_path, capsys, gcsfs_waits):
  # Every object under `flaky` answers its first download with 503 (tests/_gcs_emulator.py).
  # The checkpoint is saved locally and uploaded: its save's own reads would wait out
  # tensorstore's backoff too, and the restore meets every first download as a 503.
  root = epath.Path(where) / "flaky"
  (root / "probe").write_bytes(b"x")
  bucket, _, name = f"{root}/probe".removeprefix("gs://").partition("/")
  url = f"{os.environ['STORAGE_EMULATOR_HOST']}/storage/v1/b/{bucket}/o/"
  url += f"{urllib.parse.quote(name, safe='')}?alt=media"
  with pytest.raises(urllib.error.HTTPError, match="503"):
    urllib.request.urlopen(url)
  assert urllib.request.urlopen(url).read() == b"x"
  (root / "text" / "hamlet.txt").write_bytes((REPO / "t5x_optim/data/hamlet.txt").read_bytes())
  with Checkpointer(str(tmp_path / "ckpt"), async_save=False) as ckpt:
    ckpt.save(1, _opt(2.0))
  _upload(tmp_path / "ckpt", str(root / "ckpt"))
  start = time.monotonic()
  with Checkpointer(str(root / "ckpt")) as ckpt:
    assert _equal(ckpt.restore(_opt()), _opt(2.0))
  flags = ["--data", f"{root}/text", "--gin_bindings", "TOTAL_STEPS = 2"]
  assert main(["train", *TINY, *flags, "--model_dir", f"{where}/run"]) == 0, capsys.readouterr().err
  assert gcsfs_waits  # gcsfs met the 503s and retried
  print(f"restore and a 2-step run through 503s: {time.monotonic() - start:.1f} s")


@pytest.mark.slow
@pytest.mark.usefixtures("clean_gin")
def test_a_restart_loads_its_compiled_steps_from_gs(where, capsys):
  """The compilation cache beside the checkpoints on GCS: written by the first start, loaded
  by the next."""
  import jax  # noqa: PLC0415

  previous = jax.config.jax_persistent_cache_min_compile_time_secs
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  try:
    for steps in (1, 2):
      flags = ["--model_dir", where, *CONSTANT_RATE, "--gin_bindings", f"TOTAL_STEPS = {steps}"]
      assert main(["train", *TINY, *flags]) == 0, capsys.readouterr().err
  finally:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", previous)
  loaded = capsys.readouterr().out.splitlines()[-1]
  assert loaded.startswith("compilation cache: ")
  assert f" loaded from {where}/compilation_cache " in loaded
  entries = list(epath.Path(f"{where}/compilation_cache").glob("jit__train_step-*-cache"))
  assert len(entries) == 1
  # The second start found it intact, sized through GCS: the next start does not read it.
  intact = json.loads(epath.Path(f"{where}/compilation_cache/intact-entries.json").read_text())
  assert intact[entries[0].name] == len(entries[0].read_bytes())
