"""What `t5x-optim train` survives: preemption (SIGTERM), divergence and crashes in the loop.

docs/reliability.md's table names these tests. The slow ones run the real
command in fresh processes and signal them at chosen phases.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import pty
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _subprocesses import communicate_all, free_port
from tensorboard.backend.event_processing import event_accumulator
from test_cli import REPO, TIMEOUT, TINY, _checkpoint_steps, _command, _env, _run, _scalars

from t5x_optim import Checkpointer, OptaxWrapper, optimizers, partitioning
from t5x_optim.cli import SyntheticTask, TransformerConfig, _main, main
from t5x_optim.cli.loop import config as _config
from t5x_optim.cli.loop import job as _job
from t5x_optim.cli.loop import train as _train
from t5x_optim.cli.loop.interrupt import EXIT_PREEMPTED, Interrupt
from t5x_optim.cli.loop.metrics import MetricWriters
from t5x_optim.cli.loop.progress import Clock
from t5x_optim.cli.loop.summary import TrainSummary

pytestmark = pytest.mark.usefixtures("clean_gin", "run_compilation_cache")

LONG = ["--gin_bindings", "TOTAL_STEPS = 100000"]
GIN_HEADER = "from __gin__ import dynamic_registration\nimport optax\n"


class _Run:
  """`t5x-optim train` in a subprocess whose output lines are collected as they come."""

  def __init__(self, *args: str, cwd: Path = REPO):
    self.process = subprocess.Popen(
      _command("train", *args),
      cwd=cwd,
      env=_env(),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    self.lines: list[str] = []
    self.errors: list[str] = []
    self._readers = [
      threading.Thread(target=self._read, args=(stream, lines), daemon=True)
      for stream, lines in ((self.process.stdout, self.lines), (self.process.stderr, self.errors))
    ]
    for reader in self._readers:
      reader.start()

  @staticmethod
  def _read(stream, lines: list[str]) -> None:
    for line in stream:
      lines.append(line)

  def wait_for(self, pattern: str, timeout: float = TIMEOUT) -> re.Match:
    """The first output line matching `pattern` (fails when the process ends first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      for line in list(self.lines):
        if match := re.search(pattern, line):
          return match
      if self.process.poll() is not None and not self._readers[0].is_alive():
        pytest.fail(f"exit {self.process.returncode} before {pattern!r}: {self.finish()}")
      time.sleep(0.05)
    self.process.kill()
    pytest.fail(f"no {pattern!r} in {timeout} s: {''.join(self.lines)}")

  def finish(self, timeout: float = TIMEOUT) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) once the process ends."""
    try:
      self.process.wait(timeout=timeout)
    finally:
      self.process.kill()
    for reader in self._readers:
      reader.join(timeout=10)
    return self.process.returncode, "".join(self.lines), "".join(self.errors)


def _latest_restores(model_dir: Path, gin_files: list[str]) -> int:
  """The latest complete step of `model_dir`, after restoring it and checking it is finite."""
  _config.parse_config(gin_files=gin_files, macros=_config.device_macros(8))
  setup = _train.prepare(_config.build_job())
  with Checkpointer(model_dir / "checkpoints") as checkpointer:
    state = checkpointer.restore(setup.abstract_state)
  leaves = jax.tree.leaves(jax.device_get(state.params))
  assert all(np.isfinite(leaf).all() for leaf in leaves)
  return int(state.step)


def _tmp_steps(model_dir: Path) -> list[str]:
  return [p.name for p in (model_dir / "checkpoints").iterdir() if "orbax-checkpoint-tmp" in p.name]


def _gin_file(tmp_path: Path, name: str, text: str) -> str:
  path = tmp_path / name
  path.write_text(GIN_HEADER + text)
  return str(path)


# Preemption -------------------------------------------------------------------------------


@pytest.mark.slow
def test_sigterm_mid_loop_saves_that_step_and_exits_143(tmp_path):
  model_dir = tmp_path / "run"
  # A grace far above the second it takes, so a loaded machine cannot run it out.
  args = [*TINY, *LONG, "--metrics_every", "0", "--preemption_grace_seconds", "120"]
  run = _Run(*args, "--model_dir", str(model_dir))
  run.wait_for(r"^step 10/")
  run.process.send_signal(signal.SIGTERM)
  signalled = time.monotonic()
  code, out, err = run.finish()
  took = time.monotonic() - signalled
  assert code == EXIT_PREEMPTED, err
  assert "Traceback" not in err, err
  stopped = int(re.search(r"^preempted at step (\d+)$", out, re.M).group(1))
  assert stopped >= 10 and _checkpoint_steps(model_dir)[-1] == stopped
  assert _latest_restores(model_dir, TINY[1::2]) == stopped
  print(f"SIGTERM to exit 143: {took:.2f} s")


@pytest.mark.slow
def test_sighup_saves_the_step_and_exits_143(tmp_path):
  """A closed terminal or ssh session: SIGHUP killed the run at once, losing every step since
  the last checkpoint."""
  model_dir = tmp_path / "run"
  args = [*TINY, *LONG, "--metrics_every", "0", "--preemption_grace_seconds", "120"]
  run = _Run(*args, "--model_dir", str(model_dir))
  run.wait_for(r"^step 10/")
  run.process.send_signal(signal.SIGHUP)
  code, out, err = run.finish()
  assert code == EXIT_PREEMPTED, err
  assert "SIGHUP, taken for SIGTERM; saving at the next step" in err, err
  stopped = int(re.search(r"^preempted at step (\d+)$", out, re.M).group(1))
  assert stopped >= 10 and _checkpoint_steps(model_dir)[-1] == stopped


@pytest.mark.slow
def test_a_closed_terminal_saves_the_step_and_exits_143(tmp_path):
  """The terminal itself closed: SIGHUP, then every write to it fails (EIO), and the run
  crashed at its next step line with nothing saved."""
  model_dir = tmp_path / "run"
  args = [*TINY, *LONG, "--metrics_every", "0", "--preemption_grace_seconds", "120"]
  command, env = _command("train", *args, "--model_dir", str(model_dir)), _env()
  stderr = os.open(tmp_path / "stderr", os.O_WRONLY | os.O_CREAT)
  pid, terminal = pty.fork()
  if pid == 0:  # the child: stdout on the terminal, stderr to a file
    os.dup2(stderr, 2)
    os.chdir(REPO)
    os.execve(command[0], command, env)
  os.close(stderr)
  seen = b""
  deadline = time.monotonic() + TIMEOUT
  while seen.count(b"step ") < 3 and time.monotonic() < deadline:
    seen += os.read(terminal, 4096)
  os.close(terminal)  # the hangup
  _, status = os.waitpid(pid, 0)
  err = (tmp_path / "stderr").read_text()
  assert os.waitstatus_to_exitcode(status) == EXIT_PREEMPTED, err
  assert _checkpoint_steps(model_dir), err


@pytest.mark.slow
def test_sigterms_while_the_command_exits_keep_its_status(tmp_path):
  """A scheduler repeating SIGTERM: Python's shutdown puts the default handler back, and jax's
  teardown takes a second, so the finished run died by the signal (-15), not with its 143."""
  args = [*TINY, *LONG, "--metrics_every", "0", "--preemption_grace_seconds", "120"]
  run = _Run(*args, "--model_dir", str(tmp_path / "run"))
  run.wait_for(r"^step 10/")
  run.process.send_signal(signal.SIGTERM)
  run.wait_for(r"^checkpoint: ")
  while run.process.poll() is None:
    run.process.send_signal(signal.SIGTERM)
    time.sleep(0.005)
  code, _, err = run.finish()
  assert code == EXIT_PREEMPTED, err


@pytest.fixture(scope="module")
def finished_tiny(tmp_path_factory) -> Path:
  """A finished 40-step tiny run (checkpoints 20 and 40)."""
  model_dir = tmp_path_factory.mktemp("tiny") / "run"
  code, _, err = _Run(*TINY, "--model_dir", str(model_dir)).finish()
  assert code == 0, err
  return model_dir


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["importing", "restoring"])
def test_sigterm_during_start_up_keeps_the_latest_checkpoint(phase, finished_tiny, tmp_path):
  model_dir = tmp_path / "run"
  shutil.copytree(finished_tiny, model_dir)
  run = _Run(*TINY, *LONG, "--model_dir", str(model_dir))
  if phase == "importing":
    time.sleep(1.0)  # the launcher has installed its handlers; jax is being imported
  else:
    run.wait_for(r"^model_dir: ")
  run.process.send_signal(signal.SIGTERM)
  code, out, err = run.finish()
  assert code == EXIT_PREEMPTED, err
  assert "Traceback" not in err
  stopped = re.search(r"^preempted at step (\d+)$", out, re.M)
  latest = int(stopped.group(1)) if stopped else 40
  if not stopped:
    assert "preempted (SIGTERM) before the first step; nothing was saved" in err, err
  assert _checkpoint_steps(model_dir)[-1] == latest
  assert _latest_restores(model_dir, TINY[1::2]) == latest


def _wait_for_a_save_in_flight(run: _Run, model_dir: Path) -> None:
  deadline = time.monotonic() + TIMEOUT
  checkpoints = model_dir / "checkpoints"
  while not checkpoints.is_dir() or not _checkpoint_steps(model_dir) or not _tmp_steps(model_dir):
    assert run.process.poll() is None and time.monotonic() < deadline, run.finish()
    time.sleep(0.005)


SAVES_OFTEN = [*TINY, *LONG, "--gin_bindings", "cli.TrainJob.checkpoint_every = 3"]


@pytest.mark.slow
def test_sigterm_during_a_save_finishes_it_and_saves_the_step(tmp_path):
  model_dir = tmp_path / "run"
  run = _Run(*SAVES_OFTEN, "--model_dir", str(model_dir))
  run.wait_for(r"^step 5/")
  _wait_for_a_save_in_flight(run, model_dir)
  run.process.send_signal(signal.SIGTERM)
  code, out, err = run.finish()
  assert code == EXIT_PREEMPTED, err
  stopped = int(re.search(r"^preempted at step (\d+)$", out, re.M).group(1))
  assert _checkpoint_steps(model_dir)[-1] == stopped and not _tmp_steps(model_dir)
  assert _latest_restores(model_dir, TINY[1::2]) == stopped


@pytest.mark.slow
def test_grace_running_out_during_a_save_keeps_the_previous_checkpoint(tmp_path):
  model_dir = tmp_path / "run"
  run = _Run(*SAVES_OFTEN, "--model_dir", str(model_dir), "--preemption_grace_seconds", "0.001")
  run.wait_for(r"^step 5/")
  _wait_for_a_save_in_flight(run, model_dir)
  run.process.send_signal(signal.SIGTERM)
  code, _, err = run.finish()
  assert code == EXIT_PREEMPTED, err
  assert "the preemption grace of 0.001 s ran out; exiting now" in err, err
  complete = _checkpoint_steps(model_dir)
  latest = _latest_restores(model_dir, TINY[1::2])
  assert latest == complete[-1]
  # The next run resumes from that step, whatever the killed save left behind.
  code, out, err = _Run(
    *TINY, "--model_dir", str(model_dir), "--gin_bindings", f"TOTAL_STEPS = {latest + 2}"
  ).finish()
  assert code == 0, err
  assert f"(resuming from the checkpoint at step {latest})" in out
  assert not _tmp_steps(model_dir)


# Divergence -------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_diverging_run_stops_and_never_saves_a_nonfinite_state(tmp_path):
  blowup = _gin_file(
    tmp_path,
    "blowup.gin",
    "LEARNING_RATE = @optax.piecewise_constant_schedule()\n"
    "optax.piecewise_constant_schedule.init_value = 1e-2\n"
    "optax.piecewise_constant_schedule.boundaries_and_scales = {60: 1e30}\n",
  )
  model_dir = tmp_path / "run"
  args = [*TINY, "--gin_file", blowup, "--gin_bindings", "TOTAL_STEPS = 140"]
  code, out, err = _Run(*args, "--model_dir", str(model_dir)).finish()
  assert code == 3, err
  assert len(err.splitlines()) == 1, err
  step = int(
    re.match(
      r"t5x-optim train: error: the loss, gradient norm, updated params or optimizer state are "
      r"not finite at "
      r"step (\d+) \(loss \S+, grad_norm \S+\); stopped: the latest checkpoint is step 60 in ",
      err,
    ).group(1)
  )
  assert 60 < step < 70, err
  assert _checkpoint_steps(model_dir) == [20, 40, 60]
  assert _latest_restores(model_dir, [*TINY[1::2], blowup]) == 60


@dataclasses.dataclass(frozen=True)
class _PoisonedTask(SyntheticTask):
  """The synthetic task, whose batch `poisoned` has targets out of the vocabulary (a NaN loss)."""

  poisoned: int = -1

  def batch(self, step: int, rows: slice | None = None) -> dict[str, np.ndarray]:
    batch = super().batch(step, rows)
    if step == self.poisoned:
      batch = dict(batch, targets=np.full_like(batch["targets"], 10**6))
    return batch


def _poisoned_job(total_steps: int, on_nonfinite: str) -> _config.TrainJob:
  mesh = partitioning.create_mesh(devices=jax.devices()[:1])
  return _config.TrainJob(
    optimizers.adamw(1e-2),
    partitioning.Partitioner(mesh),
    model=TransformerConfig(vocab_size=16, num_layers=1, max_length=8, embed_dim=16, mlp_dim=32),
    task=_PoisonedTask(vocab_size=16, length=8, batch_size=4, poisoned=30),
    total_steps=total_steps,
    checkpoint_every=10,
    log_every=5,
    eval_every=100,
    on_nonfinite=on_nonfinite,
  )


def _train_to(model_dir: Path, total_steps: int, on_nonfinite: str = "skip") -> tuple[Any, str]:
  stream = io.StringIO()
  setup = _train.prepare(_poisoned_job(total_steps, on_nonfinite))
  summary = _train.train(
    setup, model_dir=model_dir, interrupt=Interrupt(), stream=stream, write_events=False
  )
  return summary, stream.getvalue()


@dataclasses.dataclass(frozen=True)
class _StoppingTask(SyntheticTask):
  """The synthetic task, which presses Ctrl-C (a SIGINT in `pending`) as batch `stop` is read."""

  stop: int | None = None
  pending: list[int] = dataclasses.field(default_factory=list, compare=False, hash=False)

  def batch(self, step: int, rows: slice | None = None) -> dict[str, np.ndarray]:
    if step == self.stop:
      self.pending.append(signal.SIGINT)
    return super().batch(step, rows)


def _loss_events(
  model_dir: Path, total_steps: int, *, stop: int | None = None
) -> list[tuple[int, float]]:
  """The train loss in `model_dir`'s event files after a run to `total_steps` (logged every 5),
  with `stop` stopped after step `stop` + 1 and resumed to the end."""
  pending: list[int] = []
  task = _StoppingTask(vocab_size=16, length=8, batch_size=4, stop=stop, pending=pending)
  setup = _train.prepare(dataclasses.replace(_poisoned_job(total_steps, "stop"), task=task))
  interrupt = Interrupt(pending, quiet=True)
  _train.train(setup, model_dir=model_dir, interrupt=interrupt, stream=io.StringIO())
  if pending:
    pending.clear()
    _train.train(setup, model_dir=model_dir, interrupt=interrupt, stream=io.StringIO())
  return _scalars(model_dir / "train")["loss"]


@pytest.mark.slow
def test_a_run_stopped_between_log_lines_logs_the_steps_since_the_last(tmp_path):
  """A run stopped at step 13 (log every 5, SIGTERM or Ctrl-C) wrote no point for steps 11-13,
  and the resumed run's point at step 15 covered steps 14 and 15 only: steps 11-13 were in no
  event file. The stopped run writes their mean at step 13, so every step is in one point."""
  whole = dict(_loss_events(tmp_path / "whole", 20))
  stopped = dict(_loss_events(tmp_path / "stopped", 20, stop=12))
  assert sorted(whole) == [5, 10, 15, 20] and sorted(stopped) == [5, 10, 13, 15, 20]
  assert (3 * stopped[13] + 2 * stopped[15]) / 5 == pytest.approx(whole[15], rel=1e-5)
  assert [stopped[s] for s in (5, 10, 20)] == pytest.approx([whole[s] for s in (5, 10, 20)])


@pytest.mark.slow
def test_skips_in_an_interval_without_a_logged_step_reach_the_event_files(tmp_path):
  """Step 31, the last, is skipped: no log line follows it, which wrote skipped_steps."""
  setup = _train.prepare(_poisoned_job(31, "skip"))
  summary = _train.train(setup, model_dir=tmp_path, interrupt=Interrupt(), stream=io.StringIO())
  assert summary.skipped_steps == 1
  assert _scalars(tmp_path / "train")["skipped_steps"] == [(31, 1.0)]


def _params(model_dir: Path, step: int) -> list[np.ndarray]:
  setup = _train.prepare(_poisoned_job(step, "skip"))
  with Checkpointer(model_dir / "checkpoints") as checkpointer:
    state = checkpointer.restore(setup.abstract_state, step)
  assert int(state.step) == step
  return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(state.params))]


@pytest.mark.slow
def test_a_nonfinite_step_is_skipped_when_asked(tmp_path):
  summary, _ = _train_to(tmp_path, 30)
  assert summary.skipped_steps == 0 and summary.checkpoint_step == 30
  summary, log = _train_to(tmp_path, 40)
  assert summary.skipped_steps == 1 and summary.end_step == 40, log
  assert re.search(
    r"^step 31: not finite \(loss nan, grad_norm \S+\); skipped: params and optimizer state "
    r"unchanged \(1 skipped in all\)$",
    log,
    re.M,
  ), log
  assert "skipped 1 non-finite steps" in summary.format()
  # Step 31 is the batch that was skipped: its params are step 30's, its counter moved on.
  summary, _ = _train_to(tmp_path / "again", 30)
  summary, _ = _train_to(tmp_path / "again", 31)
  for before, after in zip(_params(tmp_path / "again", 30), _params(tmp_path / "again", 31)):
    np.testing.assert_array_equal(before, after)
  assert all(np.isfinite(x).all() for x in _params(tmp_path, 40))


@pytest.mark.slow
def test_the_rate_logged_after_a_skipped_step_is_the_one_the_optimizer_uses():
  """A skipped step leaves the optimizer state, and so its schedule's count, as it was."""
  schedule = optax.linear_schedule(0.01, 0.0, 10)
  job = dataclasses.replace(
    _poisoned_job(8, "skip"),
    optimizer=optimizers.adamw(schedule),
    learning_rate=schedule,
    task=_PoisonedTask(vocab_size=16, length=8, batch_size=4, poisoned=3),
  )
  setup = _train.prepare(job)
  state, rates, finite = setup.create(*setup.init_args), [], []
  for step in range(6):
    batch = jax.device_put(job.task.batch(step), setup.batch_sharding)
    state, metrics = setup.step_fn(state, batch)
    rates.append(float(metrics["learning_rate"]))
    finite.append(bool(metrics["finite"]))
  assert finite == [True, True, True, False, True, True]
  # Steps 1-3 use counts 0-2; step 4 would have used 3 and was skipped; steps 5 and 6 use 3, 4.
  assert rates == pytest.approx([float(schedule(c)) for c in (0, 1, 2, 3, 3, 4)])


def _nan_in_state_at(count: int) -> optax.GradientTransformation:
  """Passes updates on, and writes NaN into its own state at its `count`-th update."""

  def init(params: Any) -> dict[str, jax.Array]:
    del params
    return {"count": jnp.zeros((), jnp.int32), "tracker": jnp.zeros(())}

  def update(updates: Any, state: dict[str, jax.Array], params: Any = None) -> Any:
    del params
    tracker = jnp.where(state["count"] == count, jnp.nan, state["tracker"] + 1.0)
    return updates, {"count": state["count"] + 1, "tracker": tracker}

  return optax.GradientTransformation(init, update)


@pytest.mark.slow
def test_a_step_that_writes_nan_only_into_the_optimizer_state_is_not_finite():
  """Finite loss, gradient norm and params, a NaN in the state (dadapt_adamw's estim_lr with a
  warmup from 0): the step was taken and saved; the next steps' params became NaN. States that
  hold an infinity by design (reduce_on_plateau's best value before its first check) are not
  refused."""
  poisoned = OptaxWrapper(optax.chain(optax.adamw(1e-2), _nan_in_state_at(2)))
  plateau = OptaxWrapper(optax.chain(optax.adamw(1e-2), optax.contrib.reduce_on_plateau()))
  for optimizer, expected in (poisoned, [True, True, False, False]), (plateau, [True] * 4):
    job = dataclasses.replace(_poisoned_job(8, "skip"), optimizer=optimizer)
    setup = _train.prepare(job)
    state, finite = setup.create(*setup.init_args), []
    for step in range(4):
      batch = jax.device_put(job.task.batch(step), setup.batch_sharding)
      state, metrics = setup.step_fn(state, batch)
      finite.append(bool(metrics["finite"]))
    assert finite == expected
    assert not any(np.isnan(np.asarray(x)).any() for x in jax.tree.leaves(state.param_states))


@pytest.mark.slow
def test_the_summary_starts_at_the_first_trained_steps_loss(tmp_path):
  """A run whose first step is skipped (here a resumed run's) said `loss nan -> ...`."""
  task = _PoisonedTask(vocab_size=16, length=8, batch_size=4, poisoned=10)
  for total_steps in 10, 20:
    job = dataclasses.replace(_poisoned_job(total_steps, "skip"), task=task)
    stream = io.StringIO()
    summary = _train.train(
      _train.prepare(job),
      model_dir=tmp_path,
      interrupt=Interrupt(),
      stream=stream,
      write_events=False,
    )
  assert summary.skipped_steps == 1, stream.getvalue()
  assert math.isfinite(summary.first_loss), stream.getvalue()


@pytest.mark.slow
def test_a_nonfinite_step_stops_the_run_by_default(tmp_path):
  summary, _ = _train_to(tmp_path, 20, "stop")
  with pytest.raises(_train.Diverged, match=r"not finite at step 31 \(loss nan") as error:
    _train_to(tmp_path, 40, "stop")
  assert error.value.saved == 30
  assert _checkpoint_steps(tmp_path) == [10, 20, 30]


# Crashes ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_crash_in_the_loop_saves_the_last_state_and_exits_1(tmp_path):
  data = tmp_path / "hamlet.txt"
  shutil.copy(REPO / "t5x_optim" / "data" / "hamlet.txt", data)
  model_dir = tmp_path / "run"
  args = [*TINY, *LONG, "--data", str(data), "--model_dir", str(model_dir)]
  run = _Run(*args, "--gin_bindings", "cli.TrainJob.checkpoint_every = 1000")
  run.wait_for(r"^step 30/")
  with data.open("r+b") as f:
    f.truncate(200)
  code, out, err = run.finish()
  assert code == 1, err
  assert len(err.splitlines()) == 1, err
  match = re.match(
    rf"t5x-optim train: error at step (\d+): ValueError: text data {data}: the file shrank "
    rf"while training\.; the latest checkpoint is step (\d+) in {model_dir}/checkpoints; "
    rf"traceback in {model_dir}/traceback\.txt$",
    err.strip(),
  )
  assert match and match.group(1) == match.group(2), err
  crashed = int(match.group(1))
  assert "the file shrank" in (model_dir / "traceback.txt").read_text()
  assert _checkpoint_steps(model_dir) == [crashed]


@pytest.mark.slow
@pytest.mark.parametrize("keep", [None, 1])
def test_a_save_that_fails_names_the_latest_committed_step(tmp_path, keep):
  """A save that fails (here files capped at 12 KiB, as a full disk: every step writes orbax's
  15 KiB _METADATA, while its data files' sizes vary with how orbax batches the writes) left
  step 4 uncommitted,
  and the run's last line said "the latest checkpoint is step 4"; with one checkpoint kept,
  it said "no checkpoint was written" though step 2 was intact."""
  pytest.importorskip("resource")  # POSIX only
  model_dir = tmp_path / "run"
  args = [*TINY, "--model_dir", str(model_dir), "--compilation_cache", "none"]
  args += ["--gin_bindings", "cli.TrainJob.checkpoint_every = 2"]
  if keep is not None:
    args += ["--gin_bindings", f"cli.TrainJob.keep_checkpoints = {keep}"]
  assert main(["train", *args, "--gin_bindings", "TOTAL_STEPS = 2"]) == 0
  capped = _run("train", *args, "--gin_bindings", "TOTAL_STEPS = 4", max_file_bytes=12 * 1024)
  assert capped.returncode == 1, capped.stderr[-3000:]
  errors = [x for x in capped.stderr.splitlines() if x.startswith("t5x-optim train: error")]
  assert errors, capped.stderr[-3000:]
  line = errors[0]
  assert "File too large" in line, line
  assert f"the latest checkpoint is step 2 in {model_dir}/checkpoints (not the last state" in line
  assert _checkpoint_steps(model_dir) == [2]


def test_the_line_of_a_failed_save_stands_on_its_own_line(tmp_path, capsys):
  """After a save that failed, orbax's writer threads go on printing "Event loop is closed"
  tracebacks; one had written its indentation and not yet the rest when the run printed its
  line, so the line began with four spaces (test_a_save_that_fails_names_the_latest_committed_
  step missed it now and then)."""
  sys.stderr.write("    ")  # a traceback's line half written by another thread
  error = ValueError("OUT_OF_RANGE: File too large")
  failure = _train.LoopFailed(4, error, saved=2, note=f"saving it failed too: {error}")
  args = _main._parser().parse_args(["train"])
  assert _main._loop_failed(args, failure, tmp_path, primary=True) == _main.EXIT_FAILED
  assert capsys.readouterr().err.splitlines()[1:] == [
    f"t5x-optim train: error at step 4: ValueError: OUT_OF_RANGE: File too large; the latest "
    f"checkpoint is step 2 in {tmp_path}/checkpoints (not the last state: saving it failed "
    f"too: OUT_OF_RANGE: File too large); traceback in {tmp_path}/traceback.txt"
  ]


@pytest.mark.slow
def test_a_config_that_cannot_be_written_keeps_the_old_one_and_stops_in_one_line(tmp_path):
  """Files capped at 4 KiB (a full disk) as a resumed start rewrote config.gin: a traceback
  without the file's name, config.gin cut to 4 KiB, and the next start took it for one
  edited by hand."""
  pytest.importorskip("resource")  # POSIX only
  model_dir = tmp_path / "run"
  args = [*TINY, "--model_dir", str(model_dir), "--compilation_cache", "none"]
  args += ["--gin_bindings", "cli.TrainJob.checkpoint_every = 2"]
  assert main(["train", *args, "--gin_bindings", "TOTAL_STEPS = 2"]) == 0
  config = (model_dir / "config.gin").read_text()
  assert len(config) > 4096
  capped = _run("train", *args, "--gin_bindings", "TOTAL_STEPS = 4", max_file_bytes=4096)
  assert capped.returncode == 1, capped.stderr[-3000:]
  assert "Traceback" not in capped.stderr, capped.stderr[-3000:]
  errors = [x for x in capped.stderr.splitlines() if x.startswith("t5x-optim train: error")]
  assert len(errors) == 1, capped.stderr[-3000:]
  assert f"File too large: '{model_dir}/config_2.gin'" in errors[0], errors[0]
  assert f"the latest checkpoint is step 2 in {model_dir}/checkpoints" in errors[0], errors[0]
  assert (model_dir / "config.gin").read_text() == config
  assert sorted(p.name for p in model_dir.iterdir() if p.suffix == ".gin") == [
    "config.gin",
    "config_0.gin",
  ]
  assert _job.keep_edited_config(model_dir) is None


@pytest.mark.slow
def test_a_run_whose_background_save_failed_exits_without_waiting_for_orbax(tmp_path):
  """The checkpoint directory replaced by a file while the run trained: the background save
  failed, the run printed its error line, then the process stayed alive 300 s more (orbax's
  threads wait that long for a signal the failed save never sends)."""
  model_dir = tmp_path / "run"
  every = ["--gin_bindings", "cli.TrainJob.checkpoint_every = 20"]
  run = _Run(*TINY, *LONG, *every, "--model_dir", str(model_dir), "--compilation_cache", "none")
  deadline = time.monotonic() + TIMEOUT
  while not (model_dir / "checkpoints" / "20").is_dir() and time.monotonic() < deadline:
    time.sleep(0.1)
  (model_dir / "checkpoints").rename(model_dir / "moved")
  (model_dir / "checkpoints").write_text("a file where the checkpoints go")
  while not any("t5x-optim train: error" in x for x in run.errors) and time.monotonic() < deadline:
    time.sleep(0.1)
  failed = time.monotonic()
  code, _, err = run.finish(timeout=200)
  assert code == 1, err[-3000:]
  assert "t5x-optim train: error at step" in err and "Not a directory" in err, err[-3000:]
  assert time.monotonic() - failed < 90, err[-3000:]


# Quick checks of the parts ----------------------------------------------------------------


@pytest.mark.slow
def test_a_run_that_starts_at_step_0_drops_the_events_of_one_that_saved_nothing(tmp_path):
  """A run that diverged (or was killed) before its first checkpoint left its events; the
  next start at step 0 purged nothing, so TensorBoard showed each step twice, one of them
  at a learning rate of 1e30."""
  with MetricWriters(tmp_path, start_step=0) as writers:
    writers.write("train", 1, {"learning_rate": 1e30})
  with MetricWriters(tmp_path, start_step=0) as writers:
    for step in (1, 2):
      writers.write("train", step, {"learning_rate": 0.5})
  assert _scalars(tmp_path / "train")["learning_rate"] == [(1, 0.5), (2, 0.5)]


def test_starts_in_one_second_keep_each_others_events(tmp_path):
  """Event files were named by the second, the host and the process: a resume in the same
  second and process (a run stopped and resumed in one Python process) reopened the stopped
  run's file from empty, and its points were lost."""
  with MetricWriters(tmp_path, start_step=0) as writers:
    writers.write("train", 5, {"loss": 1.0})
  with MetricWriters(tmp_path, start_step=5) as writers:
    writers.write("train", 6, {"loss": 2.0})
  assert _scalars(tmp_path / "train")["loss"] == [(5, 1.0), (6, 2.0)]


@pytest.mark.slow
def test_metrics_are_on_disk_when_write_returns(tmp_path):
  """tensorboardX wrote events from a logging thread that flushed every 120 s, and `flush`
  flushed only what that thread had written: a process killed (SIGKILL, a lost machine)
  within two minutes of a write lost each writer's last points, the eval of a checkpoint
  step for good (the resume starts after it)."""
  write_and_die = (
    "import os, sys\n"
    "from pathlib import Path\n"
    "from t5x_optim.cli.loop.metrics import EVAL, TRAIN, MetricWriters\n"
    "writers = MetricWriters(Path(sys.argv[1]), start_step=0)\n"
    "for step in (5, 10):\n"
    "  writers.write(TRAIN, step, {'loss': step / 2})\n"
    "writers.write(EVAL, 10, {'loss': 3.5})\n"
    "os._exit(137)\n"
  )
  done = subprocess.run(
    [sys.executable, "-c", write_and_die, str(tmp_path)], env=_env(), timeout=TIMEOUT
  )
  assert done.returncode == 137
  assert _scalars(tmp_path / "train")["loss"] == [(5, 2.5), (10, 5.0)]
  assert _scalars(tmp_path / "eval")["loss"] == [(10, 3.5)]


def _unpurged(directory: Path) -> dict[str, list[tuple[int, float]]]:
  """Every scalar in `directory`'s event files as TensorBoard's default loader (its Rust data
  server) reads them: it ignores purge steps."""
  accumulator = event_accumulator.EventAccumulator(str(directory), purge_orphaned_data=False)
  accumulator.Reload()
  return {
    tag: [(e.step, e.value) for e in accumulator.Scalars(tag)]
    for tag in accumulator.Tags()["scalars"]
  }


@pytest.mark.slow
def test_a_start_removes_the_events_of_runs_that_never_saved_them(tmp_path):
  """TensorBoard's default loader ignores purge steps: a run killed at step 4 after its save of
  step 2 showed its steps 3 and 4 among the resumed run's, and a run killed before its first
  save showed its steps as the start of the curves of a run started with --init_from."""
  with MetricWriters(tmp_path, start_step=0) as writers:
    for step in range(1, 5):
      writers.write("train", step, {"loss": 10.0 + step})
    writers.write("eval", 4, {"loss": 9.0})
  with MetricWriters(tmp_path, start_step=2) as writers:
    writers.write("train", 3, {"loss": 1.0})
  assert _unpurged(tmp_path / "train") == {"loss": [(1, 11.0), (2, 12.0), (3, 1.0)]}
  assert _unpurged(tmp_path / "eval") == {}
  assert len(list((tmp_path / "eval").iterdir())) == 1  # the old one held nothing kept
  with MetricWriters(tmp_path, start_step=25, fresh=True) as writers:
    writers.write("train", 26, {"loss": 2.0})
  assert _unpurged(tmp_path / "train") == {"loss": [(26, 2.0)]}
  assert len(list((tmp_path / "train").iterdir())) == 1


def test_event_writers_that_fail_to_close_keep_the_error_that_stopped_the_run(
  tmp_path, monkeypatch
):
  """A full disk under the model directory: the event writers' OSError as they closed replaced
  the loop's failure (the run's one line), and the run ended in a 900-line traceback."""
  from tensorboardX.event_file_writer import EventsWriter  # noqa: PLC0415

  def disk_full(self):
    raise OSError(28, "No space left on device")

  writers = MetricWriters(tmp_path, start_step=0)
  monkeypatch.setattr(EventsWriter, "close", disk_full)
  with pytest.raises(RuntimeError, match="the loop's error"), writers:
    raise RuntimeError("the loop's error")
  with pytest.raises(OSError, match="No space left"), writers:
    pass


def test_sigterm_sets_the_preemption_flag_once_and_arms_the_grace():
  interrupt = Interrupt(quiet=True, grace_seconds=600)
  interrupt.handle(signal.SIGTERM, None)
  interrupt.handle(signal.SIGTERM, None)
  try:
    assert interrupt.pending == [signal.SIGTERM] and interrupt.preempted
    assert interrupt.exit_status == EXIT_PREEMPTED and interrupt._timer.is_alive()
  finally:
    interrupt.cancel()
  launched = Interrupt([signal.SIGTERM], quiet=True, grace_seconds=600)
  try:
    assert launched.preempted and launched._timer.is_alive()
  finally:
    launched.cancel()


def test_checkpointer_reached_preemption_in_one_process(tmp_path):
  before = signal.getsignal(signal.SIGTERM)
  seen = []
  signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
  try:
    with Checkpointer(tmp_path) as ckpt:
      assert not ckpt.reached_preemption(1)
      os.kill(os.getpid(), signal.SIGTERM)
      assert ckpt.reached_preemption(2) and ckpt.reached_preemption(3)
    assert seen == [signal.SIGTERM], "the handler it replaced still ran"
    assert signal.getsignal(signal.SIGTERM) is not None and not isinstance(
      signal.getsignal(signal.SIGTERM), type(ckpt.reached_preemption)
    )
  finally:
    signal.signal(signal.SIGTERM, before)


@pytest.mark.parametrize("first_closed", ["first_asked", "last_asked"])
@pytest.mark.parametrize("original", ["default", "python"])
def test_checkpointers_asked_about_preemption_put_the_handler_back_in_any_order(
  tmp_path, first_closed, original
):
  """Two checkpointers asked, then closed first-asked-first, left a closed one's handler
  installed, which passed SIGTERM on only to a Python handler: the process outlived SIGTERM."""
  before = signal.getsignal(signal.SIGTERM)
  seen = []
  handler = signal.SIG_DFL if original == "default" else lambda signum, frame: seen.append(signum)
  signal.signal(signal.SIGTERM, handler)
  try:
    a, b = Checkpointer(tmp_path / "a"), Checkpointer(tmp_path / "b")
    assert not a.reached_preemption(1) and not b.reached_preemption(1)
    if original == "python":
      os.kill(os.getpid(), signal.SIGTERM)
      assert a.reached_preemption(2) and b.reached_preemption(2)
      assert seen == [signal.SIGTERM]
    for ckpt in (a, b) if first_closed == "first_asked" else (b, a):
      ckpt.close()
    assert signal.getsignal(signal.SIGTERM) is handler
    with Checkpointer(tmp_path / "c") as c:
      assert not c.reached_preemption(1), "a SIGTERM heard before does not count again"
    assert signal.getsignal(signal.SIGTERM) is handler
  finally:
    signal.signal(signal.SIGTERM, before)


@pytest.mark.parametrize("chains", [False, True], ids=["replaces", "chains"])
def test_a_checkpointer_asked_after_another_handler_was_installed_hears_sigterm(tmp_path, chains):
  """A handler installed after one checkpointer was asked replaced the shared handler, and
  the next checkpointer asked never heard SIGTERM: only the first to listen installed it."""
  before = signal.getsignal(signal.SIGTERM)
  seen = []
  signal.signal(signal.SIGTERM, lambda signum, frame: seen.append("original"))
  try:
    a, b = Checkpointer(tmp_path / "a"), Checkpointer(tmp_path / "b")
    assert not a.reached_preemption(1)
    replaced = signal.getsignal(signal.SIGTERM)

    def later(signum, frame):
      seen.append("later")
      if chains:
        replaced(signum, frame)

    signal.signal(signal.SIGTERM, later)
    assert not b.reached_preemption(1)
    os.kill(os.getpid(), signal.SIGTERM)
    assert b.reached_preemption(2) and a.reached_preemption(2)
    assert seen == (["later", "original"] if chains else ["later"]), "each ran once"
    a.close()
    b.close()
    assert signal.getsignal(signal.SIGTERM) is later, "the handler installed between stays"
    seen.clear()
    os.kill(os.getpid(), signal.SIGTERM)
    assert seen == (["later", "original"] if chains else ["later"])
  finally:
    signal.signal(signal.SIGTERM, before)


@pytest.mark.slow
def test_a_handler_that_chains_to_a_closed_checkpointers_keeps_the_process(tmp_path):
  """A framework's handler installed over the shared one, calling the handler it replaced:
  once every checkpointer had closed, the shared one acted out the default action it had
  replaced and killed the process under the framework's handler."""
  script = f"""
import os, signal
from t5x_optim import Checkpointer
ckpt = Checkpointer({str(tmp_path)!r})
ckpt.reached_preemption(1)
replaced = signal.getsignal(signal.SIGTERM)
def framework(signum, frame):
  print("framework", flush=True)
  if callable(replaced):
    replaced(signum, frame)
signal.signal(signal.SIGTERM, framework)
ckpt.close()
os.kill(os.getpid(), signal.SIGTERM)
print("alive", flush=True)
"""
  done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stderr
  assert done.stdout.split() == ["framework", "alive"], done.stdout


@pytest.mark.slow
def test_a_sigterm_handler_not_installed_from_python_is_replaced_and_then_the_default(tmp_path):
  """A handler installed outside Python (an embedding program's: getsignal gives None) was
  taken for the shared one, so no checkpointer heard SIGTERM, and close raised TypeError
  putting None back; the default action takes its place, as Python cannot put it back."""
  script = f"""
import os, signal
getsignal = signal.getsignal
def from_c(signum):
  current = getsignal(signum)
  return None if signum == signal.SIGTERM and current == signal.SIG_DFL else current
signal.getsignal = from_c
from t5x_optim import Checkpointer
ckpt = Checkpointer({str(tmp_path)!r})
ckpt.reached_preemption(1)
os.kill(os.getpid(), signal.SIGTERM)
print("heard", ckpt.reached_preemption(2), flush=True)
ckpt.close()
print("default", getsignal(signal.SIGTERM) == signal.SIG_DFL, flush=True)
"""
  done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stderr
  assert done.stdout.split() == ["heard", "True", "default", "True"], done.stdout


def test_a_checkpointer_closed_outside_the_main_thread_passes_the_next_sigterm_back(tmp_path):
  before = signal.getsignal(signal.SIGTERM)
  seen = []

  def handler(signum, frame):
    seen.append(signum)

  signal.signal(signal.SIGTERM, handler)
  try:
    ckpt = Checkpointer(tmp_path)
    assert not ckpt.reached_preemption(1)
    closing = threading.Thread(target=ckpt.close)
    closing.start()
    closing.join()
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.01)
    assert seen == [signal.SIGTERM] and signal.getsignal(signal.SIGTERM) is handler
  finally:
    signal.signal(signal.SIGTERM, before)


@pytest.mark.parametrize(
  "binding, message",
  [
    ("cli.TrainJob.on_nonfinite = 'ignore'", "on_nonfinite must be one of ('stop', 'skip')"),
    ("cli.TrainJob.preemption_grace_seconds = 0", "preemption_grace_seconds must be a number"),
    ("cli.TrainJob.max_consecutive_skips = 0", "max_consecutive_skips must be an int >= 1"),
  ],
)
def test_bad_reliability_settings_are_one_line(binding, message, capsys):
  assert main(["plan", "--gin_bindings", binding]) == 2
  err = capsys.readouterr().err
  assert len(err.splitlines()) == 1 and message in err, err


def test_diverged_message_names_the_step_and_what_is_kept():
  error = _train.Diverged(62, 2.5, math.nan, saved=60, skipped=False)
  assert error.message("/run/checkpoints") == (
    "the loss, gradient norm, updated params or optimizer state are not finite at step 62 (loss "
    "2.5, grad_norm "
    "nan); stopped: the latest checkpoint is step 60 in /run/checkpoints; lower the learning "
    "rate (or skip such steps: --on_nonfinite skip)."
  )


# Two processes ----------------------------------------------------------------------------


@pytest.mark.slow
def test_sigterm_to_one_of_two_processes_stops_both_at_one_saved_step(tmp_path):
  from test_multiprocess import _checkpoint_steps as steps_of  # noqa: PLC0415
  from test_multiprocess import _long_run  # noqa: PLC0415

  model_dir, procs = _long_run(tmp_path)
  procs[1].send_signal(signal.SIGTERM)
  signalled = time.monotonic()
  results = communicate_all(procs, TIMEOUT)
  took = time.monotonic() - signalled
  assert [code for code, _, _ in results] == [EXIT_PREEMPTED] * 2, results[0][2][-3000:]
  stopped = int(re.search(r"^preempted at step (\d+)$", results[0][1], re.M).group(1))
  assert steps_of(model_dir)[-1] == stopped and not _tmp_steps(model_dir)
  assert took < 30, took
  print(f"2 processes, SIGTERM to process 1 to both exited 143: {took:.2f} s")


def _in_two_processes(script: str, *args: str) -> list[tuple[int, str, str]]:
  """``(returncode, stdout, stderr)`` of `script` run as processes 0 and 1 of one job; each
  gets its process id, the coordinator's address and `args`."""
  address = f"127.0.0.1:{free_port()}"
  procs = [
    subprocess.Popen(
      [sys.executable, "-c", script, str(i), address, *args],
      env=_env(),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for i in range(2)
  ]
  return communicate_all(procs, TIMEOUT)


_PREEMPTED_BEFORE_THE_FIRST_CALL = """
import os, signal, sys, time
from t5x_optim import Checkpointer, distributed
process, address, directory = int(sys.argv[1]), sys.argv[2], sys.argv[3]
distributed.initialize(address, num_processes=2, process_id=process)
with Checkpointer(directory) as ckpt:
  if process == 1:
    os.kill(os.getpid(), signal.SIGTERM)
  time.sleep(3)  # the notice reaches every process before any step is done
  print(next((step for step in range(41, 51) if ckpt.reached_preemption(step)), None))
"""


@pytest.mark.slow
def test_a_preemption_before_a_resumed_jobs_first_step_stops_it_at_that_step(tmp_path):
  """A job resumed at step 40 and preempted during its restore, before any call, trained on
  to the end: jax's sync point was the first call's number, which absolute steps never hit."""
  results = _in_two_processes(_PREEMPTED_BEFORE_THE_FIRST_CALL, str(tmp_path))
  assert [out.split()[-1] for _, out, _ in results] == ["41", "41"], results


_CTRL_C_IN_ONE_PROCESS_AT_START_UP = """
import signal, sys
from t5x_optim import distributed
from t5x_optim.cli.loop import train
from t5x_optim.cli.loop.interrupt import Interrupt
process, address = int(sys.argv[1]), sys.argv[2]
distributed.initialize(address, num_processes=2, process_id=process)
interrupt = Interrupt([signal.SIGINT] if process == 1 else [], quiet=True)
print(train.agreed_stop(interrupt), interrupt.exit_status)
"""


@pytest.mark.slow
def test_ctrl_c_in_one_process_at_start_up_stops_every_process():
  """Each process checked its own Ctrl-C before the first step: the one interrupted left, and
  the other failed in its next collective with a raw traceback."""
  results = _in_two_processes(_CTRL_C_IN_ONE_PROCESS_AT_START_UP)
  assert [out.splitlines()[-1] for _, out, _ in results] == ["True 130"] * 2, results


@pytest.mark.slow
def test_a_second_run_in_a_model_dir_being_trained_is_refused_at_once(tmp_path):
  model_dir = tmp_path / "run"
  args = [*TINY, *LONG, "--metrics_every", "0", "--model_dir", str(model_dir)]
  first = _Run(*args)
  first.wait_for(r"^step 10/")
  config = (model_dir / "config.gin").read_text()
  code, out, err = _Run(*args).finish()
  assert code == 2, err
  assert err.startswith(f"t5x-optim train: error: --model_dir {model_dir} is in use by "), err
  assert len(err.splitlines()) == 1 and "model_dir" not in out, (out, err)
  assert (model_dir / "config.gin").read_text() == config
  assert not (model_dir / "traceback.txt").exists()
  first.process.send_signal(signal.SIGTERM)
  code, out, err = first.finish()
  assert code == EXIT_PREEMPTED, err
  stopped = int(re.search(r"^preempted at step (\d+)$", out, re.M).group(1))
  assert _checkpoint_steps(model_dir)[-1] == stopped


@pytest.mark.slow
def test_a_preempted_run_in_the_default_model_dir_says_how_to_resume(tmp_path):
  run = _Run(*TINY, *LONG, "--metrics_every", "0", cwd=tmp_path)
  model_dir = Path(run.wait_for(r"^model_dir: +(\S+) \(new run\)").group(1))
  run.wait_for(r"^step 10/")
  run.process.send_signal(signal.SIGTERM)
  code, out, err = run.finish()
  assert code == EXIT_PREEMPTED, err
  stopped = int(re.search(r"^preempted at step (\d+)$", out, re.M).group(1))
  assert out.splitlines()[-1] == f"to resume:       rerun with --model_dir {model_dir}", out
  assert model_dir.parent == tmp_path / "t5x_optim_runs"
  assert _checkpoint_steps(model_dir)[-1] == stopped


def test_a_step_left_out_of_the_clock_is_left_out_of_the_rate():
  """The first step with per-parameter metrics compiles its program, so its time is left out;
  it was still counted as a step, and the log said 1980.9 steps/s between steps at 114-150."""
  clock = Clock()
  clock.start(1)
  time.sleep(0.05)
  with clock.paused(steps=1):
    time.sleep(0.2)
  steps, seconds = clock.interval(3)
  assert steps == 1 and 0.04 < seconds < 0.15, (steps, seconds)


def test_the_summary_says_when_its_eval_loss_is_from_an_earlier_step():
  """Interrupted at step 142 with evals every 100 steps, the summary gave step 100's eval loss
  beside step 142's train loss as if both were the end's."""
  summary = TrainSummary(
    0, 142, 5.87, 2.58, 2.56, 141, 1.0, "/tmp/c", 140, True, False, eval_step=100
  )
  assert "loss 5.8700 -> 2.5800, eval loss 2.5600 (step 100)\n" in summary.format()
  at_end = dataclasses.replace(summary, eval_step=142)
  assert "eval loss 2.5600\n" in at_end.format()


def test_the_summary_gives_the_loss_where_the_optimizer_is_evaluated_too():
  """Schedule-free's summary gave the loss of the params it takes gradients at (y) alone,
  where its eval lines gave that of its average x as loss_x too; both are given."""
  summary = TrainSummary(
    0, 8, 3.11, 2.69, 2.7193, 7, 1.0, "/tmp/c", 8, False, False, eval_others=(("loss_x", 2.7284),)
  )
  assert "loss 3.1100 -> 2.6900, eval loss 2.7193, loss_x 2.7284\n" in summary.format()
  earlier = dataclasses.replace(summary, end_step=9, eval_step=8)
  assert "eval loss 2.7193, loss_x 2.7284 (step 8)\n" in earlier.format()
