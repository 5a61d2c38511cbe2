"""`t5x-optim train` and `t5x-optim plan`, end to end."""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import types
import warnings
from collections.abc import Sequence
from pathlib import Path

import gin
import jax
import numpy as np
import optax
import pytest
from _subprocesses import communicate_all, with_run_compilation_cache, with_xla_flags
from tensorboard.backend.event_processing import event_accumulator

import t5x_optim
from t5x_optim import Checkpointer, TrainState
from t5x_optim.cli import main
from t5x_optim.cli.demo import model as _model
from t5x_optim.cli.demo.model import SyntheticTask, TransformerConfig
from t5x_optim.cli.demo.text import TextTask
from t5x_optim.cli.loop import config as _config
from t5x_optim.cli.loop import progress as _progress
from t5x_optim.cli.loop import train as _train
from t5x_optim.cli.loop.interrupt import Interrupt
from t5x_optim.cli.loop.job import config_changes, identity_problem, state_layout
from t5x_optim.partitioning import format_bytes, init_sharded

pytestmark = pytest.mark.usefixtures("clean_gin", "run_compilation_cache")

REPO = Path(__file__).resolve().parents[1]
TINY = ["--gin_file", "examples/tiny.gin"]
ADAFACTOR = [*TINY, "--gin_file", "optimizers/adafactor.gin"]
TIMEOUT = 240
EXAMPLE_FILES = sorted(p.name for p in (_config.GIN_DIR / "examples").glob("*.gin"))
INCLUDED = {
  name
  for example in EXAMPLE_FILES
  for name in re.findall(
    r"^include 'optimizers/(\S+)'", (_config.GIN_DIR / "examples" / example).read_text(), re.M
  )
}
OPTIMIZER_FILES = sorted(p.name for p in (_config.GIN_DIR / "optimizers").glob("*.gin"))
"""Every optimizer file; those an example includes train in the example's test."""


def _env() -> dict[str, str]:
  env = with_xla_flags(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
  return with_run_compilation_cache(env)


def _command(*args: str) -> list[str]:
  return [sys.executable, "-m", "t5x_optim_launcher", *args]


def _run(
  *args: str, cwd: Path = REPO, max_file_bytes: int | None = None
) -> subprocess.CompletedProcess:
  """The command in a subprocess; with `max_file_bytes`, no file it writes may grow past that
  (``RLIMIT_FSIZE``, set by the interpreter before it runs the command in its place), and it
  compiles without the run's compilation cache, whose entries it would cut short."""
  command = _command(*args)
  env = _env()
  if max_file_bytes is not None:
    env = {k: v for k, v in env.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    cap = (
      f"import os, resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, ({max_file_bytes},) "
      "* 2); os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
    )
    command = [command[0], "-c", cap, *command[1:]]
  return subprocess.run(
    command,
    cwd=cwd,
    env=env,
    capture_output=True,
    text=True,
    timeout=TIMEOUT,
    check=False,
  )


def _losses(stdout: str) -> tuple[float, float]:
  first, final = re.search(r"^loss (\S+) -> ([\d.]+)", stdout, re.M).groups()
  return float(first), float(final)


def _steps(stdout: str) -> tuple[int, int]:
  start, end = re.search(r"^steps (\d+) -> (\d+),", stdout, re.M).groups()
  return int(start), int(end)


def _checkpoint_steps(model_dir: Path) -> list[int]:
  return sorted(int(p.name) for p in (model_dir / "checkpoints").iterdir() if p.name.isdigit())


def _scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
  """Every scalar in the event files of `directory`, read by TensorBoard's own reader."""
  accumulator = event_accumulator.EventAccumulator(str(directory))
  accumulator.Reload()
  return {
    tag: [(e.step, e.value) for e in accumulator.Scalars(tag)]
    for tag in accumulator.Tags()["scalars"]
  }


def _restored(
  model_dir: Path, gin_files: list[str], gin_bindings: Sequence[str] = ()
) -> tuple[_train.Setup, TrainState]:
  """The job of `gin_files` and `gin_bindings`, and the latest checkpoint of `model_dir`
  restored into it."""
  _config.parse_config(
    gin_files=gin_files, gin_bindings=gin_bindings, macros=_config.device_macros(8)
  )
  setup = _train.prepare(_config.build_job())
  with Checkpointer(model_dir / "checkpoints") as checkpointer:
    return setup, checkpointer.restore(setup.abstract_state)


def _restored_step(model_dir: Path, gin_files: list[str]) -> int:
  """Restores the latest checkpoint of `model_dir` into the job of `gin_files`."""
  return int(_restored(model_dir, gin_files)[1].step)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
  """One finished run of examples/tiny.gin (40 steps) in its own model_dir (tiny.gin's
  training test)."""
  model_dir = tmp_path_factory.mktemp("tiny") / "run"
  result = _run("train", *TINY, "--model_dir", str(model_dir))
  assert result.returncode == 0, result.stderr
  return model_dir, result


@pytest.mark.slow
def test_train_prints_the_run_then_learns(tiny_run):
  model_dir, result = tiny_run
  lines = result.stdout.splitlines()
  assert lines[0] == f"model_dir:       {model_dir} (new run)"
  assert [line.split(":")[0] for line in lines[1:6]] == [
    "devices",
    "mesh",
    "optimizer",
    "params",
    "optimizer state",
  ]
  assert lines[1] == "devices:         8 x cpu (simulated)"
  assert lines[2] == "mesh:            data=4 x model=2"
  assert lines[3].startswith("optimizer:       optimizers.chain(transformations=[optax.clip")
  assert re.fullmatch(r"params:\s+[\d,]+", lines[4])
  assert re.fullmatch(r"optimizer state: [\d.]+ \w+ per device .*", lines[5])
  assert _steps(result.stdout) == (0, 40)
  start_loss, end_loss = _losses(result.stdout)
  assert end_loss < start_loss - 0.3
  assert re.search(
    r"^step 40/40  loss [\d.]+  lr \S+  grad_norm \S+  [\d.]+ steps/s$", result.stdout, re.M
  )
  assert re.search(r"^eval step 20  loss [\d.]+$", result.stdout, re.M)
  assert _checkpoint_steps(model_dir) == [20, 40]
  assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_model_dir_holds_config_and_event_files(tiny_run):
  model_dir, _ = tiny_run
  train = _scalars(model_dir / "train")
  assert set(train) == {"loss", "learning_rate", "grad_norm", "steps_per_sec"}
  assert [step for step, _ in train["loss"]] == list(range(5, 45, 5))
  assert train["loss"][-1][1] < train["loss"][0][1]
  rates = [rate for _, rate in train["learning_rate"]]
  assert rates[0] == pytest.approx(1e-2, rel=0.01)  # warmup ends at step 4 of 40
  assert rates == sorted(rates, reverse=True) and rates[-1] < 1e-3
  assert all(rate > 0 for _, rate in train["steps_per_sec"])
  evaluated = _scalars(model_dir / "eval")
  assert set(evaluated) == {"loss"}
  assert [step for step, _ in evaluated["loss"]] == [20, 40]
  _config.parse_config(gin_files=[str(model_dir / "config.gin")])
  job = _config.build_job()
  assert (job.total_steps, job.model.num_layers, job.task.batch_size) == (40, 1, 16)
  assert dict(job.partitioner.mesh.shape) == {"data": 4, "model": 2}


@pytest.mark.slow
def test_second_run_reports_the_finished_run(tiny_run, capsys):
  model_dir, _ = tiny_run
  assert main(["train", *TINY, "--model_dir", str(model_dir)]) == 0
  assert capsys.readouterr().out == (
    f"model_dir: {model_dir} holds the finished run (checkpoint at step 40, total_steps=40); "
    "nothing to do. Raise TOTAL_STEPS to train further.\n"
  )
  assert _checkpoint_steps(model_dir) == [20, 40]


@pytest.mark.slow
def test_a_finished_run_of_another_job_is_refused_not_reported_finished(tiny_run, capsys):
  """Another optimizer pointed at a finished run said "nothing to do" and exited 0; with a
  higher TOTAL_STEPS the same command was refused as another job."""
  model_dir, _ = tiny_run
  flags = ["--gin_file", "optimizers/lion.gin", "--model_dir", str(model_dir)]
  assert main(["train", *TINY, *flags]) == 2
  err = capsys.readouterr().err
  assert err.startswith(
    f"t5x-optim train: error: --model_dir {model_dir} holds another job: at its checkpoint "
    "step 40 the optimizer is "
  ), err
  assert _checkpoint_steps(model_dir) == [20, 40]


@pytest.mark.slow
def test_an_optimizer_bound_in_its_scope_is_the_one_shown_logged_and_recorded(tmp_path, capsys):
  flags = [
    "--gin_bindings",
    "TOTAL_STEPS = 2",
    "--gin_bindings",
    "cli.TrainJob.log_every = 1",
    "--gin_bindings",
    "OPTIMIZER/optimizers.chain.transformations = [@optax.lion()]",
    "--gin_bindings",
    "OPTIMIZER/optax.lion.learning_rate = 0.003",
  ]
  assert main(["train", *TINY, "--model_dir", str(tmp_path), *flags]) == 0
  out = capsys.readouterr().out
  lines = out.splitlines()
  lion = "optimizers.chain(transformations=[optax.lion])"
  assert f"optimizer:       {lion}" in lines, out
  assert "learning rate:   OPTIMIZER/optax.lion.learning_rate = 0.003 (a constant)" in lines, out
  assert re.search(r"^step 2/2 .* lr 0\.003 ", out, re.M), out
  with Checkpointer(tmp_path / "checkpoints") as checkpointer:
    assert checkpointer.recorded_job(2)["optimizer"] == lion


@pytest.mark.slow
def test_one_device_run_in_a_fresh_dir_under_the_current_one(tmp_path, capsys, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert main(["train", *TINY, "--num_devices", "1", "--gin_bindings", "TOTAL_STEPS = 1"]) == 0
  (run,) = (tmp_path / "t5x_optim_runs").iterdir()
  lines = capsys.readouterr().out.splitlines()
  assert lines[:3] == [
    f"model_dir:       {run} (new run)",
    "devices:         1 x cpu (simulated)",
    "mesh:            data=1 x model=1",
  ]
  assert _checkpoint_steps(run) == [1]
  fresh = _train.default_model_dir()
  assert fresh.parent == run.parent and fresh != run and not fresh.exists()


@pytest.mark.slow
def test_resume_into_another_model_is_a_bounded_error(tiny_run, tmp_path, capsys):
  model_dir = tmp_path / "run"
  shutil.copytree(tiny_run[0], model_dir)
  assert (
    main(
      [
        "train",
        *TINY,
        "--gin_file",
        "optimizers/lion.gin",
        "--model_dir",
        str(model_dir),
        "--gin_bindings",
        "TOTAL_STEPS = 50",
        "--gin_bindings",
        "cli.TransformerConfig.num_layers = 2",
      ]
    )
    == 2
  )
  err = capsys.readouterr().err
  assert len(err.splitlines()) == 1 and len(err) < 700, err
  assert err.startswith(
    f"t5x-optim train: error: --model_dir {model_dir} holds another job: at its checkpoint "
    "step 40 cli.TransformerConfig.num_layers is 1 there, 2 now; a run resumes only with the "
    "model, optimizer and optimizer-state layout it started with"
  ), err
  assert "its checkpoint cannot start a run of another model" in err, err
  assert "--init_from" not in err, err


@pytest.mark.slow
def test_a_symlinked_step_is_refused_before_the_run_trains(tiny_run, tmp_path, capsys):
  """A step archived and linked back: every save failed rotating it away (exit 1, orbax's
  traceback), and the run kept every step after."""
  model_dir = tmp_path / "run"
  shutil.copytree(tiny_run[0], model_dir)
  first = model_dir / "checkpoints" / str(_checkpoint_steps(model_dir)[0])
  archived = tmp_path / "archive" / first.name
  archived.parent.mkdir()
  first.rename(archived)
  first.symlink_to(archived)
  argv = ["train", *TINY, "--model_dir", str(model_dir), "--gin_bindings", "TOTAL_STEPS = 50"]
  assert main(argv) == 2
  out, err = capsys.readouterr()
  assert len(err.splitlines()) == 1, err
  assert err.startswith(
    f"t5x-optim train: error: Cannot keep the newest 3 steps in {model_dir / 'checkpoints'}: "
    f"step {first.name} is a symbolic link ({first} -> {archived})"
  ), err
  assert "step 41" not in out and _checkpoint_steps(model_dir)[-1] == 40, out


@pytest.mark.slow
@pytest.mark.parametrize("delay", [1.0, 5.0], ids=["1s", "5s"])
def test_ctrl_c_exits_130_and_keeps_the_checkpoint(delay, tiny_run, tmp_path):
  model_dir = tmp_path / "run"
  shutil.copytree(tiny_run[0], model_dir)
  process = subprocess.Popen(
    _command(
      "train",
      *TINY,
      "--model_dir",
      str(model_dir),
      "--gin_bindings",
      "TOTAL_STEPS = 100000",
      "--gin_bindings",
      "cli.TrainJob.checkpoint_every = 100000",
    ),
    cwd=REPO,
    env=_env(),
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  try:
    time.sleep(delay)
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=TIMEOUT)
  finally:
    process.kill()
  assert process.returncode == 130, stderr
  assert "Traceback" not in stderr and "Segmentation" not in stderr
  if stdout:
    assert stdout.splitlines()[0] == (
      f"model_dir:       {model_dir} (resuming from the checkpoint at step 40)"
    )
  stopped = re.search(r"^interrupted at step (\d+)$", stdout, re.M)
  latest = _checkpoint_steps(model_dir)[-1]
  assert latest == (int(stopped.group(1)) if stopped else 40)
  assert _restored_step(model_dir, TINY[1::2]) == latest


def test_examples_include_optimizer_files():
  assert INCLUDED and INCLUDED < set(OPTIMIZER_FILES)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(OPTIMIZER_FILES) - INCLUDED))
def test_every_optimizer_file_trains(name, tmp_path, capsys):
  assert (
    main(
      [
        "train",
        *TINY,
        "--gin_file",
        f"optimizers/{name}",
        "--model_dir",
        str(tmp_path),
        "--gin_bindings",
        "TOTAL_STEPS = 2",
      ]
    )
    == 0
  )
  out = capsys.readouterr().out
  assert _steps(out) == (0, 2) and _checkpoint_steps(tmp_path) == [2]
  assert re.search(r"^eval step 2  loss [\d.]+", out, re.M)
  if name == "lookahead.gin":
    loss, slow = re.search(r"^eval step 2  loss ([\d.]+)  loss_slow ([\d.]+)$", out, re.M).groups()
    assert f"eval loss {loss}, loss_slow {slow}\n" in out
    assert "(lookahead: fast and slow copies)" in out


PLATEAU = [
  "optimizers.chain.transformations = [@optax.adamw(), @optax.contrib.reduce_on_plateau()]",
  # Never an improvement after the first step, so the scale halves at every later one.
  "optax.contrib.reduce_on_plateau.atol = 1e9",
  "optax.contrib.reduce_on_plateau.patience = 1",
  "optax.contrib.reduce_on_plateau.factor = 0.5",
  "optax.contrib.reduce_on_plateau.accumulation_size = 1",
]


@pytest.mark.slow
@pytest.mark.parametrize(
  ("bindings", "scale"),
  [
    pytest.param(PLATEAU, 0.25, id="reduce_on_plateau"),
    pytest.param(["OPTIMIZER = @optimizers.lbfgs()"], None, id="lbfgs"),
  ],
)
def test_an_optimizer_that_takes_the_loss_trains(bindings, scale, tmp_path, capsys):
  """optax's updates that read the loss (``value``), the gradient and the loss function
  (``value_fn``, ``obj_fn``: L-BFGS's line search) get them from the step: the run failed
  while tracing its first step (``update_fn() missing 1 required keyword-only argument:
  'value'``)."""
  bindings = ["TOTAL_STEPS = 3", "cli.TrainJob.log_every = 1", *bindings]
  flags = [f for binding in bindings for f in ("--gin_bindings", binding)]
  assert main(["train", *TINY, "--model_dir", str(tmp_path), *flags]) == 0, capsys.readouterr()
  out = capsys.readouterr().out
  assert _steps(out) == (0, 3)
  logged = re.findall(r"^step \d/3 .*", out, re.M)
  if scale is None:
    assert len(logged) == 3 and not any("lr_scale" in line for line in logged), out
  else:
    # The scale reduce_on_plateau gives the updates is logged beside the learning rate.
    assert [re.search(r" lr_scale (\S+) ", line)[1] for line in logged] == ["1", "0.5", "0.25"]
    tags = _scalars(tmp_path / "train")
    assert [value for _, value in tags["lr_scale"]] == [1.0, 0.5, 0.25]
    _, state = _restored(tmp_path, TINY[1::2], PLATEAU)
    (plateau,) = [
      node
      for node in jax.tree.leaves(state.param_states, is_leaf=lambda n: hasattr(n, "plateau_count"))
      if hasattr(node, "plateau_count")
    ]
    assert float(plateau.scale) == scale


def test_a_learning_rate_injected_in_a_multi_optimizers_sub_optimizer_is_found():
  """A MultiOptimizer keeps one OptimizerState per sub-optimizer: the rate injected in one
  of them is the state's, as in a plain OptaxWrapper's state."""
  params = {"w": jax.numpy.ones((2, 2)), "scale": jax.numpy.ones(2)}
  injected = t5x_optim.OptaxWrapper(optax.inject_hyperparams(optax.adamw)(learning_rate=3e-3))
  plain = t5x_optim.OptaxWrapper(optax.sgd(0.1))
  multi = t5x_optim.optimizers.MultiOptimizer([("^w$", injected), ("scale", plain)])
  rates = _train.injected_learning_rates(multi.create(params).state.param_states)
  assert [float(rate) for rate in rates] == pytest.approx([3e-3])


@pytest.mark.parametrize(
  "make",
  [
    optax.contrib.prodigy,
    optax.contrib.dadapt_adamw,
    optax.contrib.momo,
    optax.contrib.momo_adam,
    optax.contrib.madgrad,
  ],
)
def test_a_schedule_read_at_an_optimizers_own_count_is_read_there(make):
  """These optimizers call their learning-rate schedule at their own state's count, not at a
  ``scale_by_schedule`` state's: under MultiSteps that count is behind the step."""
  tx = optax.MultiSteps(make(optax.linear_schedule(1.0, 0.0, 4)), 4)
  state = tx.init({"w": jax.numpy.ones(3)})
  counted = lambda node: "count" in getattr(node, "_fields", ())  # noqa: E731
  inner = jax.tree.map(
    lambda node: node._replace(count=jax.numpy.int32(3)) if counted(node) else node,
    state.inner_opt_state,
    is_leaf=counted,
  )
  state = state._replace(inner_opt_state=inner)
  assert [int(count) for count in _train.schedule_counts(state)] == [3]


@pytest.mark.slow
@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("guard", ["accumulation", "plateau"])
def test_the_resume_guards_read_a_multi_optimizers_sub_optimizers(guard, nested):
  """A saved MultiSteps accumulation or reduce_on_plateau count that a sub-optimizer's setting
  now drops is named, as a plain OptaxWrapper's is; inside a MultiOptimizer, nested too, the
  guards found no optax transformation and let the resume go on."""
  params = {"w": jax.numpy.ones((2, 2)), "scale": jax.numpy.ones(2)}
  grads = jax.tree.map(jax.numpy.ones_like, params)
  MultiOptimizer = t5x_optim.optimizers.MultiOptimizer  # noqa: N806 - a class

  def optimizer(size: int) -> t5x_optim.OptimizerDef:
    if guard == "accumulation":
      tx = optax.MultiSteps(optax.adam(1e-3), size)
    else:
      tx = optax.chain(optax.adam(1e-3), optax.contrib.reduce_on_plateau(accumulation_size=size))
    multi = MultiOptimizer([("^w$", t5x_optim.OptaxWrapper(tx))])
    return MultiOptimizer([(".", multi)]) if nested else multi

  extra = {"value": jax.numpy.float32(1.0)} if guard == "plateau" else {}
  saved = optimizer(4).create(params)
  for _ in range(3):
    saved = saved.apply_gradient(grads, **extra)
  check = _train._dropped_accumulation if guard == "accumulation" else _train._stalled_plateau
  assert check(optimizer(4), saved.state) is None
  found = check(optimizer(2), saved.state)
  assert found is not None and found[1] == (
    "every_k_schedule" if guard == "accumulation" else "accumulation_size"
  )
  assert found[0].startswith("holds 3 gradients" if guard == "accumulation" else "holds the ")


_CLIP = optax.clip_by_global_norm(1.0)
_AROUND_MULTI_STEPS = {
  "chain": lambda ms: optax.chain(_CLIP, ms),
  "chain of its transformation": lambda ms: optax.chain(_CLIP, ms.gradient_transformation()),
  "named_chain": lambda ms: optax.named_chain(("clip", _CLIP), ("accumulate", ms)),
  "masked": lambda ms: optax.masked(ms, {"w": True, "scale": False}),
  "multi_transform": lambda ms: optax.multi_transform(
    {"a": ms, "b": optax.sgd(0.1)}, {"w": "a", "scale": "b"}
  ),
  "apply_if_finite": lambda ms: optax.apply_if_finite(ms, 3),
  "low_precision": lambda ms: t5x_optim.optimizers.low_precision(
    optax.chain(_CLIP, ms), state_dtype="bfloat16", min_size=0
  ),
}


@pytest.mark.slow
@pytest.mark.parametrize("around", list(_AROUND_MULTI_STEPS))
def test_the_accumulation_guard_finds_multi_steps_inside_other_transformations(around):
  """A MultiSteps inside a chain, a mask, a multi_transform or a wrapper, saved with 3 of 4
  gradients accumulated: every_k_schedule 2 drops them, as at the top of OptaxWrapper; the
  guard read only a MultiSteps at the top and let the resume go on."""
  params = {"w": jax.numpy.ones((2, 2)), "scale": jax.numpy.ones(2)}
  grads = jax.tree.map(jax.numpy.ones_like, params)

  def optimizer(every: int) -> t5x_optim.OptaxWrapper:
    return t5x_optim.OptaxWrapper(
      _AROUND_MULTI_STEPS[around](optax.MultiSteps(optax.adam(1e-3), every))
    )

  saved = optimizer(4).create(params)
  for _ in range(3):
    saved = saved.apply_gradient(grads)
  assert _train._dropped_accumulation(optimizer(4), saved.state) is None
  assert _train._dropped_accumulation(optimizer(2), saved.state) == (
    "holds 3 gradients that optax.MultiSteps accumulated towards its next update, which "
    "every_k_schedule 2 now would never apply",
    "every_k_schedule",
  )


def test_plan_lists_the_update_rule_of_muon_inside_a_nested_multi_optimizer():
  """Muon in a MultiOptimizer inside a MultiOptimizer places its params by their axes: the
  plan lists every param's rule (a frozen one too), where it listed none."""
  from t5x_optim.cli import _main  # noqa: PLC0415

  optimizers = t5x_optim.optimizers
  params = {"body": {"kernel": jax.numpy.ones((4, 6))}, "scale": jax.numpy.ones(4)}
  inner = optimizers.MultiOptimizer([("kernel$", optimizers.muon(learning_rate=0.02))])
  opt_def = optimizers.MultiOptimizer([("^body/", inner)])
  opt_def.set_param_axes({"body": {"kernel": jax.P("embed", "mlp")}, "scale": jax.P("embed")})
  state = types.SimpleNamespace(
    optimizer=types.SimpleNamespace(optimizer_def=opt_def), params=params
  )
  assert _main._param_routes(state) == [
    "body/kernel ('embed', 'mlp'): muon, inputs ('embed',), outputs ('mlp',) "
    "[filter 0 PathFilter('kernel$')] [filter 0 PathFilter('^body/')]",
    "scale: frozen [no filter]",
  ]


def test_a_log_line_takes_the_rates_in_effect_at_its_step_and_averages_the_rest():
  """reduce_on_plateau halving its scale at every step: the line of step 3 with
  ``log_every = 3`` showed the scales' mean (0.583), where ``log_every = 1`` showed 0.25 at
  step 3; the scale in effect is what the line names, as the learning rate's is."""
  records = [
    {"loss": loss, "grad_norm": 1.0, "learning_rate": rate, "lr_scale": scale}
    for loss, rate, scale in [(3.0, 0.3, 1.0), (2.0, 0.2, 0.5), (1.0, 0.1, 0.25)]
  ]
  assert _train._summarize(records) == pytest.approx(
    {"loss": 2.0, "grad_norm": 1.0, "learning_rate": 0.1, "lr_scale": 0.25}
  )


@pytest.mark.slow
def test_the_summary_gives_the_train_loss_of_the_first_and_the_last_step(tmp_path, capsys):
  """``loss A -> B``: B was the mean of the last log line's steps (steps 1 to 4 with
  ``log_every = 4``), A step 1's loss alone. Both are one step's, as a line every step
  shows them."""
  lines = {}
  for log_every in (4, 1):
    flags = ["--gin_bindings", "TOTAL_STEPS = 4", "--gin_bindings"]
    flags.append(f"cli.TrainJob.log_every = {log_every}")
    assert main(["train", *TINY, "--model_dir", str(tmp_path / str(log_every)), *flags]) == 0
    lines[log_every] = capsys.readouterr().out
  every = dict(re.findall(r"^step (\d+)/4  loss (\S+)  ", lines[1], re.M))
  summary = re.search(r"^loss (\S+) -> (\S+), ", lines[4], re.M).groups()
  assert [float(x) for x in summary] == pytest.approx(
    [float(every["1"]), float(every["4"])], abs=1e-4
  )


def _group_x(states, params):
  """Schedule-free's x for the params of the first `MultiOptimizer` group (those its ``z``
  holds), the others' params as they are."""
  free = states[0].param_states
  z = {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree.flatten_with_path(free.z)[0]}
  assert 0 < len(z) < len(jax.tree.leaves(params)), sorted(z)

  def one(path, y):
    at = z.get(jax.tree_util.keystr(path))
    return y if at is None else optax.contrib.schedule_free_eval_params(free._replace(z=at), y)

  return jax.tree.map_with_path(one, params)


_SCHEDULE_FREE = {
  "alone": (
    ["OPTIMIZER = @optimizers.schedule_free_adamw()"],
    "optimizers.schedule_free_adamw",
    optax.contrib.schedule_free_eval_params,
  ),
  "in MultiSteps": (
    [
      "OPTIMIZER = @optimizers.OptaxWrapper()",
      "optimizers.OptaxWrapper.optax_optimizer = @optax.MultiSteps()",
      "optax.MultiSteps.opt = @optax.contrib.schedule_free_adamw()",
      "optax.MultiSteps.every_k_schedule = 2",
    ],
    "optax.contrib.schedule_free_adamw",
    lambda states, params: optax.contrib.schedule_free_eval_params(states.inner_opt_state, params),
  ),
  "in a MultiOptimizer group": (
    [
      "OPTIMIZER = @optimizers.MultiOptimizer()",
      "optimizers.MultiOptimizer.traversals_and_optimizers = ["
      "(@matrices/optimizers.PathFilter(), @optimizers.schedule_free_adamw()), "
      "(@scales/optimizers.PathFilter(), @optimizers.adam())]",
      "matrices/optimizers.PathFilter.patterns = 'scale$'",
      "matrices/optimizers.PathFilter.invert = True",
      "scales/optimizers.PathFilter.patterns = 'scale$'",
      "optimizers.adam.learning_rate = 0.01",
    ],
    "optimizers.schedule_free_adamw",
    _group_x,
  ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(_SCHEDULE_FREE))
def test_schedule_free_is_evaluated_at_its_evaluation_params_too(case, tmp_path, capsys):
  """Schedule-free takes gradients at y and is evaluated at its average x (optax's
  ``schedule_free_eval_params``): the eval line showed y's loss alone, and nothing else
  where schedule-free was wrapped (in optax.MultiSteps) or trained a `MultiOptimizer` group.
  It shows x's as ``loss_x``, the loss of x computed from the checkpoint."""
  bindings, factory, evaluated = _SCHEDULE_FREE[case]
  bindings = [*bindings, "TOTAL_STEPS = 4", f"{factory}.learning_rate = 0.01"]
  flags = [f for binding in bindings for f in ("--gin_bindings", binding)]
  assert main(["train", *TINY, "--model_dir", str(tmp_path), *flags]) == 0
  out = capsys.readouterr().out
  loss, loss_x = map(
    float, re.search(r"^eval step 4  loss (\S+)  loss_x (\S+)$", out, re.M).groups()
  )
  setup, state = _restored(tmp_path, TINY[1::2], bindings)
  x = evaluated(state.param_states, state.params)
  losses = [setup.eval_fn(x, setup.eval_batch(i)) for i in range(setup.job.eval_batches)]
  assert loss_x == pytest.approx(float(np.mean(jax.device_get(losses))), abs=1e-4)
  assert loss_x != loss
  assert f"eval loss {loss:.4f}, loss_x {loss_x:.4f}\n" in out


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name in EXAMPLE_FILES if name != "tiny.gin"])
def test_every_example_file_trains(name, tmp_path, capsys):
  assert (
    main(
      [
        "train",
        "--gin_file",
        f"examples/{name}",
        *TINY,
        "--model_dir",
        str(tmp_path),
        "--gin_bindings",
        "TOTAL_STEPS = 1",
      ]
    )
    == 0
  )
  out = capsys.readouterr().out
  assert _steps(out) == (0, 1) and re.search(r"^eval step 1  loss [\d.]+$", out, re.M)
  assert _checkpoint_steps(tmp_path) == [1]


def test_config_changes_name_a_binding_changed_in_one_scope():
  """gin's operative config writes a value under its unscoped name and under each
  scope that calls it: a change in one scope is a change."""
  old = "optax.adamw.b1 = 0.9\nOPTIMIZER/optax.adamw.b1 = 0.9\nOPTIMIZER/optax.adamw.b2 = 0.99\n"
  new = "optax.adamw.b1 = 0.9\nOPTIMIZER/optax.adamw.b1 = 0.5\nOPTIMIZER/optax.adamw.b2 = 0.99\n"
  assert config_changes(old, new) == ["OPTIMIZER/optax.adamw.b1 0.9 -> 0.5"]


def test_config_changes_show_a_change_of_every_scope_once():
  old = "optax.adamw.b1 = 0.9\nOPTIMIZER/optax.adamw.b1 = 0.9\n"
  new = "optax.adamw.b1 = 0.5\nOPTIMIZER/optax.adamw.b1 = 0.5\n"
  assert config_changes(old, new) == ["optax.adamw.b1 0.9 -> 0.5"]
  other = "optax.adamw.b1 = 0.5\nOPTIMIZER/optax.adamw.b1 = 0.7\n"
  assert config_changes(old, other) == [
    "OPTIMIZER/optax.adamw.b1 0.9 -> 0.7",
    "optax.adamw.b1 0.9 -> 0.5",
  ]


def test_config_changes_leave_out_an_unscoped_call_of_a_configurable_called_in_a_scope():
  """An earlier version also called the optimizer unscoped, to describe it: its operative
  config lists ``optax.adamw`` beside ``OPTIMIZER/optax.adamw``; the run used only the latter."""
  scoped = "OPTIMIZER/optax.adamw.b1 = 0.8\nOPTIMIZER/optax.adamw.b2 = 0.99\n"
  old = "optax.adamw.b1 = 0.9\noptax.adamw.b2 = 0.99\nTOTAL_STEPS = 4\n" + scoped
  assert config_changes(old, scoped + "TOTAL_STEPS = 6\n") == ["TOTAL_STEPS 4 -> 6"]
  assert config_changes(scoped, old) == ["TOTAL_STEPS (unbound) -> 4"]
  assert config_changes(old, "optax.adamw.b1 = 0.9\noptax.adamw.b2 = 0.99\nTOTAL_STEPS = 4\n") == [
    "OPTIMIZER/optax.adamw.b1 0.8 -> (unbound)",
    "OPTIMIZER/optax.adamw.b2 0.99 -> (unbound)",
  ]


class _Terminal(io.StringIO):
  def isatty(self) -> bool:
    return True


def test_terminal_progress_keeps_log_lines_above_a_bar_with_eta():
  stream = _Terminal()
  progress = _progress.Progress(stream, start=0, total=100, redraw_seconds=0.0)
  progress.log("step 10/100  loss 2.0000", rate=20.0)
  progress.advance(20)
  progress.log("step 20/100  loss 1.5000", rate=10.0)
  empty, partly = "." * 30, "#" * 6 + "." * 24
  assert stream.getvalue() == (
    "\r\x1b[Kstep 10/100  loss 2.0000\n"
    f"\r[{empty}] 0/100  ETA 5s\x1b[K"
    f"\r[{partly}] 20/100  ETA 4s\x1b[K"
    "\r\x1b[Kstep 20/100  loss 1.5000\n"
    f"\r[{partly}] 20/100  ETA 8s\x1b[K"
  )


def test_non_terminal_progress_is_one_line_per_log():
  stream = io.StringIO()
  progress = _progress.Progress(stream, start=0, total=100)
  progress.advance(5)
  progress.log("step 10/100  loss 2.0000", rate=20.0)
  progress.close()
  assert stream.getvalue() == "step 10/100  loss 2.0000\n"


BAD_INPUT = {
  "pinned_mesh": (
    ["--num_devices", "1", "--gin_bindings", "partitioning.create_mesh.num_partitions = 2"],
    "the gin config pins partitioning.create_mesh.num_partitions = 2, which does "
    "not fit the 1 devices in use; what fits: num_partitions in (1,)",
  ),
  "pinned_shape": (
    ["--gin_bindings", "partitioning.create_mesh.shape = {'data': 2, 'model': 2}"],
    "the gin config pins partitioning.create_mesh.shape = {'data': 2, 'model': 2}, which does "
    "not fit the 8 devices in use; what fits: num_partitions in (1, 2, 4, 8)",
  ),
  "too_many_devices": (["--num_devices", "9"], "--num_devices 9: only 8 cpu devices"),
  "flag_against_binding": (
    ["--num_devices", "4", "--gin_bindings", "NUM_DEVICES = 8"],
    "--num_devices 4, but the gin config binds NUM_DEVICES = 8 (cli.mesh_devices.count)",
  ),
}


@pytest.mark.slow
@pytest.mark.parametrize(
  "pin, mesh",
  [
    ("partitioning.create_mesh.shape = {'data': 2, 'model': 4}", "mesh data=2 x model=4"),
    ("partitioning.create_mesh.model_parallel_submesh = (1, 1, 4, 1)", "mesh data=2 x model=4"),
  ],
  ids=["shape", "submesh"],
)
def test_a_mesh_pinned_by_shape_or_submesh_is_the_mesh(pin, mesh, capsys):
  """The default config binds num_partitions, so a fitting shape or submesh was refused as a
  second pin: "pins num_partitions = 2, shape = {'data': 2, 'model': 4}, which does not fit"."""
  assert main(["plan", *TINY, "--gin_bindings", pin]) == 0, capsys.readouterr().err
  assert mesh in capsys.readouterr().out


@pytest.mark.slow
def test_num_devices_beats_a_gin_file_that_binds_the_count(tmp_path, capsys):
  """A resumed run's config.gin binds NUM_DEVICES = 8: it overrode --num_devices 4 silently."""
  saved = tmp_path / "saved.gin"
  saved.write_text("NUM_DEVICES = 8\n")
  flags = ["--gin_file", str(saved), "--num_devices", "4"]
  assert main(["plan", *TINY, *flags]) == 0, capsys.readouterr().err
  out = capsys.readouterr().out
  assert out.startswith("Optimizer state on mesh data=2 x model=2 (4 devices)"), out


@pytest.mark.slow
@pytest.mark.parametrize("count, mesh", [("1", "data=1 x model=1"), ("4", "data=2 x model=2")])
def test_a_device_count_bound_in_gin_gets_the_default_mesh_of_that_count(count, mesh, capsys):
  """The default mesh's partitions followed the flag's (or every device's) count: NUM_DEVICES
  = 1 was refused as "the gin config pins num_partitions = 2", which nobody had pinned."""
  assert main(["plan", *TINY, "--gin_bindings", f"NUM_DEVICES = {count}"]) == 0, (
    capsys.readouterr().err
  )
  out = capsys.readouterr().out
  assert out.startswith(f"Optimizer state on mesh {mesh} ({count} devices)"), out


@pytest.mark.slow
def test_the_banner_names_the_devices_the_config_uses(tmp_path, capsys):
  """The devices line came from --num_devices (or every device), not from the config."""
  saved = tmp_path / "saved.gin"
  saved.write_text("NUM_DEVICES = 4\n")
  flags = ["--gin_file", str(saved), "--gin_bindings", "TOTAL_STEPS = 1"]
  assert main(["train", *TINY, *flags, "--model_dir", str(tmp_path / "run")]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert "devices:         4 x cpu (simulated)" in lines, lines
  assert "mesh:            data=2 x model=2" in lines, lines


@pytest.mark.parametrize("name", sorted(BAD_INPUT))
def test_bad_devices_are_one_line(name, tmp_path, capsys):
  flags, message = BAD_INPUT[name]
  assert main(["train", *TINY, *flags, "--model_dir", str(tmp_path)]) == 2
  err = capsys.readouterr().err
  assert len(err.splitlines()) == 1 and message in err, err


@pytest.mark.parametrize(
  "where", ["file", "below_a_file", "checkpoints", "train", "eval", "skipped_checkpoints"]
)
def test_unusable_model_dir_is_one_line(where, tmp_path, capsys):
  """The model directory, or a directory a run keeps in it, is a file: refused before a step."""
  blocker = tmp_path / "blocker"
  if where in ("file", "below_a_file"):
    model_dir = blocker if where == "file" else blocker / "run"
  else:
    model_dir, blocker = tmp_path / "run", tmp_path / "run" / where
    model_dir.mkdir()
  blocker.write_text("")
  assert main(["train", *TINY, "--model_dir", str(model_dir)]) == 2
  out, err = capsys.readouterr()
  assert len(err.splitlines()) == 1 and err.startswith("t5x-optim train: error: --model_dir "), err
  assert "is a file, not a directory" in err or where == "below_a_file", err
  assert "step" not in out


@pytest.mark.parametrize("below", ["checkpoints/5", "checkpoints/5/sub"])
@pytest.mark.parametrize("record", ["_CHECKPOINT_METADATA", "commit_success.txt"])
def test_a_model_dir_in_another_runs_checkpoint_step_is_refused(below, record, tmp_path, capsys):
  """A run started in a committed step of another run (meant as the start) would be deleted
  with that step by the other run's rotation: refused in one line that offers --init_from the
  step, before anything is written there."""
  run = tmp_path / "A"
  (run / "checkpoints" / "5" / "default").mkdir(parents=True)
  (run / "checkpoints" / "5" / record).write_text("")
  before = sorted(tmp_path.rglob("*"))
  assert main(["train", *TINY, "--model_dir", str(run / below)]) == 2
  err = capsys.readouterr().err
  assert len(err.splitlines()) == 1 and err.startswith("t5x-optim train: error: --model_dir "), err
  step = (run / "checkpoints" / "5").resolve()
  assert f"is inside {step}, step 5 of the run in {run.resolve()}" in err, err
  assert f"--init_from {step} " in err, err
  assert sorted(tmp_path.rglob("*")) == before


@pytest.mark.parametrize("below", ["checkpoints/4", "checkpoints/4/sub"])
def test_a_model_dir_in_a_step_still_to_come_of_a_run_is_refused(below, tmp_path, capsys):
  """A run started in step 4 of a run that has saved step 2 was set aside, whole, as an
  incomplete checkpoint when that run saved step 4."""
  run = tmp_path / "A"
  (run / "checkpoints" / "2" / "checksums").mkdir(parents=True)
  (run / "checkpoints" / "2" / "checksums" / "checksums.json").write_text("{}")
  (run / "checkpoints" / "2" / "commit_success.txt").write_text("")
  (run / "config.gin").write_text("")
  assert main(["train", *TINY, "--model_dir", str(run / below)]) == 2
  err = capsys.readouterr().err
  step = (run / "checkpoints" / "4").resolve()
  assert f"is inside {step}, the directory of step 4 still to come of the run in " in err, err
  assert "--init_from" not in err and not step.exists(), err
  # A checkpoint copied in from elsewhere (no checksums of a t5x-optim run) makes no run.
  (run / "checkpoints" / "2" / "checksums" / "checksums.json").unlink()
  bad = ["--gin_bindings", "cli.TrainJob.total_stepz = 3"]
  assert main(["train", *bad, "--model_dir", str(run / below)]) == 2
  err = capsys.readouterr().err
  assert "total_stepz" in err and "is inside" not in err, err
  # A run that has saved nothing yet (no checkpoints directory) has no step to come.
  shutil.rmtree(run / "checkpoints")
  assert main(["train", *bad, "--model_dir", str(run / below)]) == 2
  err = capsys.readouterr().err
  assert "total_stepz" in err and "is inside" not in err, err


@pytest.mark.parametrize(
  "below",
  [
    "checkpoints",
    "checkpoints/new",
    "checkpoints/run1",
    "checkpoints/7",
    "checkpoints/2024/myrun",
    "checkpoints/1/sub",
  ],
)
def test_a_model_dir_in_no_step_of_a_run_is_taken(below, tmp_path, capsys):
  """Only a committed step is deleted by a run's rotation: a --model_dir in a project's
  ``checkpoints`` folder beside its config.gin (a run kept there by name, one resumed, a new
  one), in a numbered directory made beforehand or a folder of years, or in a folder of runs
  kept by number, is taken."""
  project = tmp_path / "project"
  (project / "checkpoints").mkdir(parents=True)
  (project / "config.gin").write_text("")
  (project / "checkpoints" / "run1" / "checkpoints" / "4").mkdir(parents=True)
  (project / "checkpoints" / "run1" / "checkpoints" / "4" / "_CHECKPOINT_METADATA").write_text("")
  (project / "checkpoints" / "7").mkdir()
  (project / "checkpoints" / "2024").mkdir()
  (project / "checkpoints" / "1" / "checkpoints" / "4").mkdir(parents=True)
  (project / "checkpoints" / "1" / "checkpoints" / "4" / "commit_success.txt").write_text("")
  bad = ["--gin_bindings", "cli.TrainJob.total_stepz = 3"]
  assert main(["train", *bad, "--model_dir", str(project / below)]) == 2
  err = capsys.readouterr().err
  assert "total_stepz" in err and "is inside" not in err, err


@pytest.mark.parametrize(
  "binding", ["cli.TrainJob.log_every = (", "cli.TrainJob.log_every = 1 2", "TOTAL_STEPS = "]
)
def test_a_binding_that_does_not_parse_is_named(binding, tmp_path, capsys):
  argv = ["train", *TINY, "--gin_bindings", "BATCH_SIZE = 8", "--gin_bindings", binding]
  assert main([*argv, "--model_dir", str(tmp_path / "run")]) == 2
  err = capsys.readouterr().err
  assert len(err.splitlines()) == 1, err
  assert err.startswith(f"t5x-optim train: error: --gin_bindings {binding!r} does not parse: "), err
  assert not re.search(r"line \d|\(\d+, \d+\)", err) and not (tmp_path / "run").exists(), err


@pytest.mark.parametrize(
  "binding, message",
  [
    ("optax.adamw.b11 = 0.5", "Configurable 'optax.adamw' doesn't have a parameter named 'b11'."),
    ("optax.adamz.b1 = 0.5", "Couldn't resolve selector optax.adamz; "),
    ("optax.adamw.b1 = @nosuch()", "'nosuch' was not provided by an import statement."),
  ],
)
def test_a_binding_gin_refuses_is_named(binding, message, tmp_path, capsys):
  """gin's refusal of a binding that parses (an unknown parameter or name) ended "In bindings
  string line 8 <binding>", the line counted after the imports put before each entry, and did
  not name the flag, as the refusal of one that does not parse does."""
  argv = ["train", *TINY, "--gin_bindings", "BATCH_SIZE = 8", "--gin_bindings", binding]
  assert main([*argv, "--model_dir", str(tmp_path / "run")]) == 2
  err = capsys.readouterr().err
  assert len(err.splitlines()) == 1, err
  assert err.startswith(f"t5x-optim train: error: --gin_bindings {binding!r}: {message}"), err
  assert "In bindings string" not in err and not (tmp_path / "run").exists(), err


@pytest.mark.parametrize(
  "flag, value, message",
  [
    ("--metrics_every", "-1", "argument --metrics_every: must be at least 0, got -1"),
    ("--num_devices", "0", "argument --num_devices: must be at least 1, got 0"),
  ],
)
def test_a_flag_out_of_range_is_named_as_the_flag(flag, value, message, capsys):
  with pytest.raises(SystemExit) as exit_status:
    main(["train", *TINY, flag, value])
  assert exit_status.value.code == 2
  err = capsys.readouterr().err
  assert err.splitlines()[-1].endswith(message) and "TrainJob" not in err, err


def _path_flags() -> list[tuple[str, str]]:
  """(command, flag) of every flag of the parser whose value is a path."""
  from t5x_optim.cli import _main  # noqa: PLC0415

  parser = _main._parser()
  commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
  return [
    (command, action.option_strings[0])
    for command, sub in commands.choices.items()
    for action in sub._actions
    if action.type in (_main._path_arg, _main._given)
  ]


def test_the_flags_of_paths_are_found():
  found = {flag for _, flag in _path_flags()}
  assert {"--model_dir", "--data", "--init_from", "--init_from_gin", "--gin_file"} <= found


@pytest.mark.parametrize("command, flag", _path_flags())
def test_an_empty_path_is_refused_not_taken_for_the_current_directory(
  command, flag, tmp_path, monkeypatch, capsys
):
  """A job's command with an unset variable (``--model_dir="$DIR"``): --model_dir wrote the
  run into the working directory and resumed the run there, --data trained on every file
  there, --init_from started from the run there, --compilation_cache filled it with entries."""
  monkeypatch.chdir(tmp_path)
  with pytest.raises(SystemExit) as exit_status:
    main([command, "--gin_file", str(_config.GIN_DIR / "examples" / "tiny.gin"), f"{flag}="])
  assert exit_status.value.code == 2
  err = capsys.readouterr().err
  message = f"argument {flag}: empty, which would be the current directory (is a variable"
  assert message in err.splitlines()[-1], err
  assert not list(tmp_path.iterdir())


def test_init_from_gin_without_init_from_is_refused(tmp_path, capsys):
  """--init_from_gin alone (the job's --init_from dropped) trained from scratch, exit 0, without
  a word, even for a file that does not exist."""
  argv = ["train", *TINY, "--init_from_gin", str(tmp_path / "old.gin")]
  assert main([*argv, "--model_dir", str(tmp_path / "run")]) == 2
  err = capsys.readouterr().err
  assert err == (
    "t5x-optim train: error: --init_from_gin configures the optimizer that wrote "
    "--init_from, which is not given: give --init_from too, or leave --init_from_gin out.\n"
  )
  assert not (tmp_path / "run").exists()


def test_help_says_gin_files_are_code(capsys):
  for argv in (["--help"], ["train", "--help"], ["plan", "--help"]):
    with pytest.raises(SystemExit):
      main(argv)
    assert "gin files are code" in " ".join(capsys.readouterr().out.split()).lower()


@pytest.mark.slow
def test_the_packages_warnings_are_one_line_of_the_command():
  """The package names its caller's line in a warning; as the command line, that was the
  launcher's (``t5x_optim_launcher.py:48: UserWarning: ...``) or ``<frozen runpy>:88``."""
  flags = ["plan", *TINY, "--gin_file", "optimizers/adamw_8bit.gin"]
  flags += ["--gin_bindings", "optimizers.low_precision.block_size = 4"]
  flags += ["--gin_bindings", "optimizers.low_precision.state_dtype = 'bfloat16'"]
  entries = [_command(*flags), [sys.executable, "-m", "t5x_optim", *flags]]
  procs = [
    subprocess.Popen(
      command, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    for command in entries
  ]
  message = "low_precision: block_size=4 is unused: it sizes 8-bit and 4-bit blocks"
  for code, out, err in communicate_all(procs, TIMEOUT):
    assert code == 0 and "Optimizer state on mesh" in out, err
    [line] = [line for line in err.splitlines() if message in line]
    assert line.startswith(f"t5x-optim: warning: {message}"), err


@pytest.mark.slow
def test_plan_shows_factored_leaves_with_dropped_dims():
  result = _run("plan", *ADAFACTOR, "--warn_replicated_bytes", "1024")
  assert result.returncode == 0, result.stderr
  out = result.stdout
  assert "mesh data=4 x model=2 (8 devices)" in out
  # 40 steps (tiny.gin) run no step with per-parameter metrics (every 50): the plain step's
  # peak is the run's.
  assert re.search(
    r"^train step: peak \S+ \S+ per device, every step \(XLA's memory analysis", out, re.M
  ), out
  row = next(line for line in out.splitlines() if "0/v_row/layers_0/mlp/wi " in line)
  assert re.search(
    r"\(32,\)\s+float32\s+\(embed\)\s+replicated\s+128 B\s+"
    r"factored: drops mlp of \(32, 64\)",
    row,
  )
  col = next(line for line in out.splitlines() if "0/v_col/layers_0/mlp/wi " in line)
  assert re.search(r"\(64,\)\s+float32\s+\(mlp\)\s+\(model\)\s+128 B\s+factored: drops embed", col)
  assert "[0/v_row]" in out and "[0/v_col]" in out and "per device:" in out
  assert "warnings (" in out and "replicated on all 8 devices" in out


def _state_bytes(state) -> tuple[int, int, dict[str, tuple[list[int], str, int]]]:
  per_device = total = 0
  leaves = {}
  for path, leaf in jax.tree.leaves_with_path(state.param_states):
    shard = leaf.addressable_shards[0].data.nbytes
    per_device += shard
    total += leaf.nbytes
    key = "/".join(str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k)))) for k in path)
    leaves[key] = (list(leaf.shape), leaf.dtype.name, shard)
  return per_device, total, leaves


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["--gin_file", "partitioning/zero.gin"]], ids=["1d", "zero"])
def test_plan_json_matches_a_real_init(extra, capsys):
  steps = ["--gin_bindings", "TOTAL_STEPS = 50"]
  assert main(["plan", *ADAFACTOR, *extra, *steps, "--format", "json"]) == 0
  plan = json.loads(capsys.readouterr().out)
  _config.parse_config(
    gin_files=[*ADAFACTOR[1::2], *extra[1::2]],
    gin_bindings=steps[1::2],
    macros=_config.device_macros(8),
  )
  setup = _train.prepare(_config.build_job())
  job = setup.job
  state = init_sharded(job.partitioner, job.optimizer, setup.model.init, *setup.init_args)
  per_device, total, leaves = _state_bytes(state)
  assert plan["totals"]["bytes_per_device"] == per_device
  assert plan["totals"]["total_bytes"] == total
  assert plan["num_devices"] == 8 and plan["mesh"] == {"data": 4, "model": 2}
  assert {
    leaf["path"]: (leaf["shape"], leaf["dtype"], leaf["bytes_per_device"])
    for leaf in plan["leaves"]
  } == leaves
  factored = [leaf for leaf in plan["leaves"] if leaf["dropped_axes"]]
  assert {leaf["group"] for leaf in factored} == {"0/v_row", "0/v_col"}
  memory = plan["train_step_bytes_per_device"]
  batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in job.task.batch(0).items()}
  plain, weights = (
    step.lower(setup.abstract_state, batch).compile().memory_analysis()
    for step in (setup.step_fn, setup.weights_step_fn)
  )
  # The 50 steps run the step with per-parameter metrics once (every 50), whose peak is the
  # larger: plan gave the plain step's, 23% below it with Adafactor.
  assert memory["steps"] == "the steps with per-parameter metrics (every 50)"
  assert memory["temporaries"] == weights.temp_size_in_bytes > plain.temp_size_in_bytes
  assert memory["peak"] == (
    memory["arguments"] + memory["outputs"] + memory["temporaries"] - memory["aliased"]
  )
  # The state, params and batch are arguments: the peak is at least the state at rest.
  assert memory["arguments"] > per_device


@pytest.mark.slow
@pytest.mark.parametrize(
  "task",
  [
    SyntheticTask(vocab_size=16, length=8, batch_size=4),
    SyntheticTask(vocab_size=1 << 18, length=8, batch_size=4),
    TextTask(path="hamlet.txt", length=8, batch_size=4),
  ],
  ids=["synthetic", "synthetic_large_vocabulary", "text"],
)
def test_the_abstract_batch_has_the_shapes_and_dtypes_of_the_real_batches(task):
  """Plan and the traced step read the batch's shapes from the task's fields: they are those
  of the batches train reads, train and eval, of either kind of task."""
  model = TransformerConfig(vocab_size=task.vocab_size, num_layers=1, max_length=8, embed_dim=8)
  partitioner = t5x_optim.partitioning.Partitioner(
    t5x_optim.partitioning.create_mesh(devices=jax.devices()[:2])
  )
  job = _config.TrainJob(t5x_optim.optimizers.sgd(0.1), partitioner, model=model, task=task)
  setup = _train.prepare(job)

  def layout(batch):
    return {k: (x.shape, x.dtype) for k, x in batch.items()}

  want = layout(_train.abstract_batch(task))
  assert layout(setup.train_batch(3)) == layout(setup.eval_batch(1)) == want


@pytest.mark.slow
def test_plan_samples_no_batch_even_of_a_large_vocabulary(monkeypatch, capsys):
  """Plan allocates nothing: it sampled batch 0 for its shapes, and the synthetic task's
  successor table for 262,144 tokens is 512 GiB (a MemoryError)."""

  def refuse(self, *args, **kwargs):
    raise AssertionError(f"plan sampled a batch of {self}")

  monkeypatch.setattr(SyntheticTask, "batch", refuse)
  monkeypatch.setattr(SyntheticTask, "eval_batch", refuse)
  vocab = ["--gin_bindings", "VOCAB_SIZE = 262144", "--num_devices", "1"]
  assert main(["plan", *TINY, *vocab]) == 0, capsys.readouterr().err
  assert "train step" in capsys.readouterr().out


@pytest.mark.parametrize(
  ("vocab", "first"),
  [(16, [13, 10, 14, 14, 7, 7, 9, 3]), (2048, [1742, 1304, 1086, 2012, 101, 1908, 1452, 681])],
)
def test_a_small_synthetic_vocabularys_successors_come_from_its_table(vocab, first):
  """Up to `_TABLE_ENTRIES` the successors are the table's: the data, and so every loss the
  docs show of the synthetic task, are as they were."""
  assert SyntheticTask(vocab_size=vocab).batch(0)["inputs"][0, :8].tolist() == first


def test_a_large_synthetic_vocabulary_hashes_its_successors(monkeypatch):
  """262,144 tokens: no (V, V, branching) table (512 GiB); each token is one of the
  `branching` successors of the two before it, and a batch is the same on every call."""
  monkeypatch.setattr(_model, "_successor_table", None)
  task = SyntheticTask(vocab_size=1 << 18, length=32, batch_size=64)
  batch = task.batch(5)
  tokens = np.concatenate([batch["inputs"], batch["targets"][:, -1:]], axis=1)
  assert tokens.dtype == np.int32 and 0 <= tokens.min() and tokens.max() < task.vocab_size
  np.testing.assert_array_equal(task.batch(5, slice(8, 16))["targets"], batch["targets"][8:16])
  successors = [
    _model._hashed_successors(task.vocab_size, task.seed, tokens[:, :-2], tokens[:, 1:-1], c)
    for c in range(task.branching)
  ]
  assert (np.equal(tokens[:, 2:], successors[0]) | np.equal(tokens[:, 2:], successors[1])).all()
  assert np.mean(successors[0] == successors[1]) < 0.01


NOISE = [
  *TINY,
  "--gin_bindings",
  "optimizers.chain.transformations = [@optax.add_noise(), @optax.adamw()]",
  "--gin_bindings",
  "optax.add_noise.eta = 0.01",
  "--gin_bindings",
  "optax.add_noise.gamma = 0.55",
  "--gin_bindings",
  "optax.add_noise.key = 0",
]
"""optax.add_noise before AdamW: its state holds a typed PRNG key (``key<fry>``)."""


@pytest.mark.slow
def test_plan_and_train_count_the_bytes_of_a_typed_prng_key(tmp_path, capsys):
  """A typed key has no numpy dtype: plan and train died on it with a raw TypeError."""
  assert main(["plan", *NOISE, "--format", "json"]) == 0
  plan = json.loads(capsys.readouterr().out)
  key = next(leaf for leaf in plan["leaves"] if leaf["dtype"] == "key<fry>")
  assert key["path"] == "0/rng_key" and key["total_bytes"] == key["bytes_per_device"] == 8
  per_device = format_bytes(plan["totals"]["bytes_per_device"])
  model_dir = str(tmp_path / "run")
  for steps in (2, 3):
    argv = ["train", *NOISE, "--gin_bindings", f"TOTAL_STEPS = {steps}"]
    assert main([*argv, "--model_dir", model_dir]) == 0
    out = capsys.readouterr().out
    assert f"optimizer state: {per_device} per device" in out
  assert "(resuming from the checkpoint at step 2)" in out and f"step {steps}/3" in out


BAD_CONFIGS = {
  "unknown_name": (["--gin_bindings", "optax.adamww.learning_rate = 1.0"], "adamww"),
  "unknown_parameter": (["--gin_bindings", "cli.TrainJob.total_stepz = 3"], "total_stepz"),
  "wrong_type": (
    ["--gin_bindings", "cli.TrainJob.total_steps = 'ten'"],
    "TrainJob.total_steps must be an int >= 1 and <= 2147483647 (the int32 step counter's "
    "largest), got 'ten' (str)",
  ),
  "steps_beyond_the_int32_counter": (
    ["--gin_bindings", "TOTAL_STEPS = 2147483648"],
    "TrainJob.total_steps must be an int >= 1 and <= 2147483647 (the int32 step counter's "
    "largest), got 2147483648 (int)",
  ),
  "optax_not_optimizer_def": (
    [
      "--gin_bindings",
      "OPTIMIZER = @optax.adam()",
      "--gin_bindings",
      "optax.adam.learning_rate = 0.1",
    ],
    "optimizer is an optax GradientTransformation, not an OptimizerDef",
  ),
  "wrong_hyperparameter_type": (
    ["--gin_bindings", "optax.adamw.learning_rate = 'fast'"],
    "Tracing one train step failed, so the optimizer is misconfigured",
  ),
  "missing_file": (
    ["--gin_file", "optimizers/nope.gin"],
    "gin file 'optimizers/nope.gin' not found",
  ),
  "missing_search_path": (
    ["--gin_search_paths", "no_such_dir", "--gin_file", "optimizers/adamw.gin"],
    "gin search path 'no_such_dir' is not a local directory.",
  ),
  "vocab_mismatch": (
    ["--gin_bindings", "cli.SyntheticTask.vocab_size = 7"],
    "TransformerConfig.vocab_size=32 differs from SyntheticTask.vocab_size=7",
  ),
  "binding_never_read": (
    [
      "--gin_bindings",
      "OPTIMIZER = @optimizers.lbfgs()",
      "--gin_bindings",
      "optax.lbfgs.memory_size = 5",
    ],
    "--gin_bindings 'optax.lbfgs.memory_size = 5' binds what this run never reads: no call of "
    "optax.lbfgs took memory_size from the bindings (did you mean "
    "optimizers.lbfgs?)",
  ),
  "data_shadowed": (
    [*TINY, "--data", "hamlet.txt", "--gin_bindings", "TASK/cli.TextTask.path = 'hamlet.txt'"],
    "--data hamlet.txt binds what this run never reads: every call of cli.TextTask took path "
    "from the more specific TASK/cli.TextTask.path",
  ),
  "binding_of_another_optimizer": (
    ["--gin_bindings", "optax.adam.b1 = 0.8"],
    "--gin_bindings 'optax.adam.b1 = 0.8' binds what this run never reads: no call of "
    "optax.adam took b1 from the bindings (did you mean optax.adamw?)",
  ),
  "macro_never_read": (
    ["--gin_bindings", "BATCH_SIZE = 8"],
    "--gin_bindings 'BATCH_SIZE = 8' binds what this run never reads: nothing refers to "
    "%BATCH_SIZE",
  ),
  "binding_of_the_wrong_type": (
    ["--gin_bindings", "optax.cosine_onecycle_schedule.transition_steps = '40'"],
    "'<=' not supported between instances of 'str' and 'int' (in the call of "
    "optax.cosine_onecycle_schedule in scope LEARNING_RATE; its bindings: transition_steps = "
    "'40', peak_value = 0.01,",
  ),
  "required_binding_left_unfilled": (
    ["--gin_bindings", "optax.cosine_onecycle_schedule.transition_steps = %gin.REQUIRED"],
    "(in the call of optax.cosine_onecycle_schedule in scope LEARNING_RATE; its bindings: "
    "transition_steps = %gin.REQUIRED,",
  ),
  "learning_rate_type": (
    ["--gin_bindings", "cli.TrainJob.learning_rate = 'high'"],
    "TrainJob.learning_rate must be a schedule, a number or None",
  ),
}


@pytest.mark.parametrize(
  "name, command",
  [
    # `plan` checks the configuration as `train` does, which the quick loop runs for one.
    (name, command)
    if command == "plan" or name == "unknown_parameter"
    else pytest.param(name, command, marks=pytest.mark.slow)
    for name in sorted(BAD_CONFIGS)
    for command in ("train", "plan")
  ],
)
def test_bad_config_is_one_clear_error(name, command, capsys, tmp_path):
  flags, message = BAD_CONFIGS[name]
  model_dir = tmp_path / "runs" / "run"
  extra = ["--model_dir", str(model_dir)] if command == "train" else []
  assert main([command, *flags, *extra]) == 2
  err = capsys.readouterr().err
  assert err.startswith(f"t5x-optim {command}: error: ")
  assert message in err
  assert "Traceback" not in err and len(err.splitlines()) == 1
  # Nothing was trained or saved, and nothing is left: not even the directories the run made.
  assert list(tmp_path.iterdir()) == []


def test_a_configuration_error_keeps_the_directories_that_were_there(tmp_path, capsys):
  """The directories a run made for --model_dir and --compilation_cache go again when a
  configuration error stops it; those the user made, and what they hold, stay."""
  bad = ["--gin_bindings", "cli.TrainJob.total_stepz = 3"]
  (tmp_path / "mine").mkdir()
  cache = tmp_path / "mine" / "cache" / "xla"
  assert (
    main(["train", *bad, "--model_dir", str(tmp_path / "mine"), "--compilation_cache", str(cache)])
    == 2
  )
  assert [p.name for p in tmp_path.rglob("*")] == ["mine"]
  run = tmp_path / "runs" / "run"
  assert main(["train", *bad, "--model_dir", str(run), "--compilation_cache", str(run / "cc")]) == 2
  assert [p.name for p in tmp_path.rglob("*")] == ["mine"]
  assert "total_stepz" in capsys.readouterr().err


def test_path_flags_given_with_a_tilde_are_in_the_home_directory(tmp_path, capsys, monkeypatch):
  """``~`` in --model_dir and --compilation_cache is the home directory, never a directory
  named ``~`` here; those a configuration error made there go again."""
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  monkeypatch.chdir(tmp_path)
  (tmp_path / "home").mkdir()
  bad = ["--gin_bindings", "cli.TrainJob.total_stepz = 3"]
  argv = ["train", *bad, "--model_dir", "~/new/run", "--compilation_cache", "~/cache/xla"]
  assert main(argv) == 2
  assert [p.name for p in tmp_path.rglob("*")] == ["home"]
  assert "total_stepz" in capsys.readouterr().err
  from t5x_optim.cli import _main  # noqa: PLC0415

  args = _main._parser().parse_args(["train", "--compilation_cache", "~/cache"])
  assert args.compilation_cache == tmp_path / "home" / "cache"


def test_gin_file_flags_given_with_a_tilde_are_in_the_home_directory(tmp_path, monkeypatch):
  from t5x_optim.cli import _main  # noqa: PLC0415

  monkeypatch.setenv("HOME", str(tmp_path))
  flags = ["--gin_file", "~/a.gin", "--gin_search_paths", "~/gin", "--init_from_gin", "~/b.gin"]
  args = _main._parser().parse_args(["train", *flags, "--gin_file", "examples/tiny.gin"])
  assert args.gin_file == [f"{tmp_path}/a.gin", "examples/tiny.gin"]
  assert (args.gin_search_paths, args.init_from_gin) == ([f"{tmp_path}/gin"], [f"{tmp_path}/b.gin"])


@pytest.mark.parametrize("flag", ["--data", "--model_dir"])
def test_a_path_flag_with_the_tilde_of_no_user_is_one_line(flag, tmp_path, capsys, monkeypatch):
  """``~name`` of no user stays as written, as the shell leaves it: pathlib's expansion
  raised, so the flag ended in a traceback (status 1)."""
  monkeypatch.chdir(tmp_path)
  given = "~t5x_optim_no_such_user/x"
  bad = ["--gin_bindings", "cli.TrainJob.total_stepz = 3"]
  assert main(["train", *TINY, *bad, flag, given]) == 2
  err = capsys.readouterr().err
  assert len(err.splitlines()) == 1, err
  expected = f"--data {given}: no such file or directory" if flag == "--data" else "total_stepz"
  assert expected in err, err


@pytest.mark.parametrize(
  ("binding", "raised_in"),
  [
    ("cli.TrainJob.total_stepz = 3", "parse_config"),  # while gin parses the bindings
    ("cli.TrainJob.total_steps = 'ten'", "__post_init__"),  # while the job is built
  ],
)
def test_traceback_flag_shows_where_a_configuration_error_was_raised(binding, raised_in, capsys):
  assert main(["plan", "--traceback", "--gin_bindings", binding]) == 2
  err = capsys.readouterr().err
  assert err.startswith("Traceback (most recent call last):")
  assert f"in {raised_in}" in err and "NoneType: None" not in err
  assert err.splitlines()[-1].startswith("t5x-optim plan: error: ")


@pytest.mark.slow
def test_bad_gin_in_a_subprocess_exits_without_traceback(tmp_path):
  result = _run("train", "--gin_bindings", "optax.adamww.learning_rate = 1.0", cwd=tmp_path)
  assert result.returncode == 2
  assert "Traceback" not in result.stderr
  assert "adamww" in result.stderr and len(result.stderr.splitlines()) == 1
  assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_another_state_layout_names_what_each_side_holds_at_the_node():
  """An 8-bit run resumed with bfloat16 states: the node was said to hold "nothing now", where
  it holds a bfloat16 array."""
  import optax  # noqa: PLC0415

  from t5x_optim import optimizers  # noqa: PLC0415

  params = {"w": jax.numpy.ones((64, 64))}

  def layout(mode):
    tx = optimizers.low_precision(optax.adam(0.1), mode, min_size=0)
    return {"state": state_layout(optimizers.OptaxWrapper(tx).create(params))}

  eight, bf16 = layout("8bit"), layout("bfloat16")
  assert identity_problem(eight, bf16).startswith(
    "the optimizer state's node inner_state/0/mu/w is QuantizedLeaf there, "
    "an array bfloat16[64,64] now;"
  )
  assert identity_problem(bf16, eight).startswith(
    "the optimizer state's node inner_state/0/mu/w is an array bfloat16[64,64] there, "
    "QuantizedLeaf now;"
  )


def test_an_update_that_needs_an_argument_the_step_does_not_give_is_named():
  """An update that needs an extra argument of the user's own: the error said only that the
  optimizer was misconfigured, "e.g. a hyper-parameter of the wrong type"."""

  def update(updates, state, params=None, *, weights, **extra_args):
    del params, extra_args
    return jax.tree.map(lambda u: u * weights, updates), state

  weighted = optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)
  optimizer = t5x_optim.OptaxWrapper(
    optax.chain(optax.adam(1e-3), weighted), extra_args={"value", "weights"}
  )
  _config.parse_config(gin_files=TINY[1::2], macros=_config.device_macros(8))
  job = dataclasses.replace(_config.build_job(), optimizer=optimizer)
  with pytest.raises(ValueError, match="missing 1 required keyword-only argument: 'weights'") as e:
    _train.prepare(job)
  assert str(e.value).endswith(
    "; of the extra arguments it takes, the train step gives those of optax's that come from "
    "the loss (value), not weights."
  ), e.value


@pytest.mark.parametrize(
  "factory", ["optax.contrib.schedule_free_adamw", "optimizers.schedule_free_sgd"]
)
def test_a_schedule_free_warmup_is_part_of_the_rate_logged(clean_gin, factory):
  """optax's schedule-free AdamW and SGD warm their learning rate up from 0 over
  ``warmup_steps`` (``warmup_constant_schedule``): the rate logged is that schedule."""
  bindings = [f"OPTIMIZER = @{factory}()", f"{factory}.learning_rate = 0.01"]
  _config.parse_config(gin_bindings=[*bindings, f"{factory}.warmup_steps = 4"])
  rate, where = _config.optimizer_learning_rate()
  assert [float(rate(step)) for step in range(6)] == pytest.approx(
    [0.0, 0.0025, 0.005, 0.0075, 0.01, 0.01]
  )
  assert where == (
    f"{factory}.learning_rate = 0.01, warmed up by optax.warmup_constant_schedule over "
    f"{factory}.warmup_steps = 4"
  )


def test_a_binding_that_every_caller_overrides_is_unread(clean_gin):
  """gin gives a call's own argument precedence over a binding, without a word; the binding
  is then unread, as one for a configurable nothing calls."""
  _config.parse_config(gin_bindings=["optax.adamw.b1 = 0.8", "optax.adamw.b2 = 0.9"])
  gin.get_configurable(optax.adamw)(learning_rate=0.1, b1=0.5)
  assert _config.unread_bindings() == [
    ("optax.adamw.b1 = 0.8", "no call of optax.adamw took b1 from the bindings")
  ]


def test_a_file_included_by_a_binding_is_not_checked_as_a_binding(clean_gin, tmp_path):
  """A binding that includes a gin file binds what the file binds, and a file's bindings are
  not checked (a file may configure what only some runs use, as tiny.gin binds both tasks);
  they were refused as the binding's own. Such an entry is taken as a file; the others are
  still checked."""
  text = "from __gin__ import dynamic_registration\nfrom t5x_optim import cli\n"
  (tmp_path / "text.gin").write_text(text + "cli.TextTask.length = 8\n")
  include = f"include '{tmp_path / 'text.gin'}'"
  _config.parse_config(gin_bindings=[include, "BATCH_SIZE = 8"], macros=_config.device_macros(8))
  _config.build_job()
  assert _config.unread_bindings() == [("BATCH_SIZE = 8", "nothing refers to %BATCH_SIZE")]


def test_a_binding_that_a_more_specific_scope_shadows_is_unread(clean_gin, tmp_path):
  """A run's config.gin binds what a macro reaches in the macro's scope
  (``OPTIMIZER/optax.adamw.b1``), and gin takes the most specific scope's binding: given with
  that file, ``optax.adamw.b1 = 0.5`` (or ``--data``'s path) changed nothing, yet was taken as
  read because a call of optax.adamw took b1. The binding that shadows it is named."""
  saved = tmp_path / "config.gin"
  saved.write_text(
    _config.BINDING_IMPORTS
    + "OPTIMIZER/optax.adamw.b1 = 0.9\nTASK = @cli.TextTask()\n"
    + f"TASK/cli.TextTask.path = {str(tmp_path / 'a.txt')!r}\nVOCAB_SIZE = 256\n"
  )
  (tmp_path / "a.txt").write_text("old text " * 40)
  given = ["optax.adamw.b1 = 0.5", "optax.adamw.b2 = 0.9", "cli.TextTask.path = 'b.txt'"]
  _config.parse_config(
    gin_files=[*TINY[1::2], str(saved)], gin_bindings=given, macros=_config.device_macros(8)
  )
  _config.build_job()
  assert _config.unread_bindings() == [
    (
      "optax.adamw.b1 = 0.5",
      "every call of optax.adamw took b1 from the more specific OPTIMIZER/optax.adamw.b1",
    ),
    (
      "cli.TextTask.path = 'b.txt'",
      "every call of cli.TextTask took path from the more specific TASK/cli.TextTask.path",
    ),
  ]


def test_a_scoped_binding_is_shadowed_by_one_of_a_scope_inside_it(clean_gin):
  """``a/optax.adamw.b1`` is read only by a call in scope ``a`` or below it that no binding of
  a scope inside ``a`` (``a/b/optax.adamw.b1``) overrides."""
  bindings = ["a/optax.adamw.b1 = 0.8", "a/b/optax.adamw.b1 = 0.7"]
  _config.parse_config(gin_bindings=bindings)
  with gin.config_scope("a/b"):
    gin.get_configurable(optax.adamw)(learning_rate=0.1)
  assert _config.unread_bindings() == [
    (
      "a/optax.adamw.b1 = 0.8",
      "every call of optax.adamw took b1 from the more specific a/b/optax.adamw.b1",
    )
  ]
  with gin.config_scope("a/c"):
    gin.get_configurable(optax.adamw)(learning_rate=0.1)
  assert _config.unread_bindings() == []


def test_gins_notes_name_the_innermost_call_and_its_bindings(clean_gin):
  """gin notes each call an error passes through, the innermost first; a function it wraps
  may be a functools.partial (optax.nadam), whose text holds parentheses."""
  _config.parse_config(gin_bindings=["optax.nadam.b1 = 'x'"])
  notes = (
    f"In call to configurable 'nadam' ({optax.nadam}) in scope 'OPTIMIZER' "
    f"In call to configurable 'TrainJob' ({_config.TrainJob})"
  )
  assert "(" in str(optax.nadam)
  assert _config.described_gin_error(f"bad {notes}") == (
    "bad (in the call of optax.nadam in scope OPTIMIZER; its bindings: b1 = 'x')"
  )
  assert _config.described_gin_error(f"bad {notes}", call=False) == "bad"


def _gin_prefixes() -> list[str]:
  return list(gin.config._LOCATION_PREFIXES)  # noqa: SLF001 - gin offers no reader


def test_each_parse_searches_its_own_search_paths_and_leaves_gins_as_they_were(
  tmp_path, monkeypatch
):
  """gin keeps its search paths for the process and clearing the config keeps them: each
  parse added its own, so a later command without them found an ``include`` in an earlier
  command's directory. A parse searches the current directory, its own search paths and the
  package's gin files, and leaves gin's search paths as it found them, after a failure too."""
  monkeypatch.chdir(tmp_path)
  (tmp_path / "elsewhere").mkdir()
  (tmp_path / "elsewhere" / "shared.gin").write_text("TOTAL_STEPS = 3\n")
  (tmp_path / "top.gin").write_text("include 'shared.gin'\n")
  before = _gin_prefixes()
  _config.parse_config(gin_files=["top.gin"], search_paths=[tmp_path / "elsewhere"])
  assert gin.query_parameter("%TOTAL_STEPS") == 3
  assert _gin_prefixes() == before
  with pytest.raises(OSError, match="shared.gin"):
    _config.parse_config(gin_files=["top.gin"])
  assert _gin_prefixes() == before


def test_a_parse_records_the_files_gin_read(clean_gin, tmp_path, monkeypatch):
  """The files the last parse read, resolved: those given (found here or in the package's gin
  files), those they include (found in a search path) and those a binding includes."""
  monkeypatch.chdir(tmp_path)
  (tmp_path / "elsewhere").mkdir()
  (tmp_path / "elsewhere" / "shared.gin").write_text("TOTAL_STEPS = 3\n")
  (tmp_path / "top.gin").write_text("include 'shared.gin'\n")
  (tmp_path / "bound.gin").write_text("BATCH_SIZE = 8\n")
  _config.parse_config(
    gin_files=["top.gin"],
    gin_bindings=["include 'bound.gin'"],
    search_paths=[tmp_path / "elsewhere"],
  )
  read = [tmp_path / "top.gin", tmp_path / "elsewhere" / "shared.gin", tmp_path / "bound.gin"]
  assert _config.files_read() == [path.resolve() for path in read]
  _config.parse_config(gin_files=TINY[1::2])
  assert _config.files_read() == [_config.GIN_DIR / "examples" / "tiny.gin"]


def test_a_command_leaves_gins_search_paths_as_it_found_them(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  (tmp_path / "elsewhere").mkdir()
  (tmp_path / "elsewhere" / "shared.gin").write_text("TOTAL_STEPS = 3\n")
  (tmp_path / "top.gin").write_text("include 'shared.gin'\n")
  before = _gin_prefixes()
  bad = ["--gin_bindings", "cli.TrainJob.total_steps = 'ten'"]
  assert main(["plan", "--gin_file", "top.gin", "--gin_search_paths", "elsewhere", *bad]) == 2
  assert "got 'ten'" in capsys.readouterr().err
  assert _gin_prefixes() == before
  assert main(["plan", "--gin_file", "top.gin", *bad]) == 2
  assert "shared.gin" in capsys.readouterr().err


_SIGNALS = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]


@pytest.fixture
def own_signal_handlers():
  """A handler of the test's own for SIGINT, SIGTERM and SIGHUP; pytest's put back after."""

  def mine(signum, frame):
    del signum, frame

  previous = {signum: signal.signal(signum, mine) for signum in _SIGNALS}
  yield mine
  for signum, handler in previous.items():
    signal.signal(signum, handler)


def test_a_command_puts_back_the_callers_signal_handlers(own_signal_handlers, monkeypatch, capsys):
  """A call given pending_signals installs the Ctrl-C, SIGTERM and SIGHUP handlers the
  command checks between steps; they stayed after it returned, so a later Ctrl-C was
  swallowed and a SIGTERM never reached the caller's handler. The caller's come back when
  the command returns, is interrupted before it starts, or raises."""
  from t5x_optim.cli import _main  # noqa: PLC0415

  bad = ["--gin_bindings", "cli.TrainJob.total_steps = 'ten'"]
  assert main(["plan", *bad], pending_signals=[]) == 2
  assert [signal.getsignal(signum) for signum in _SIGNALS] == [own_signal_handlers] * 3
  assert main(["plan"], pending_signals=[signal.SIGINT]) == 130
  assert [signal.getsignal(signum) for signum in _SIGNALS] == [own_signal_handlers] * 3

  def fail(args, interrupt):
    raise RuntimeError("inside the command")

  monkeypatch.setattr(_main, "_run", fail)
  with pytest.raises(RuntimeError, match="inside the command"):
    main(["plan"], pending_signals=[])
  assert [signal.getsignal(signum) for signum in _SIGNALS] == [own_signal_handlers] * 3
  assert "before the first step" in capsys.readouterr().err


def test_the_commands_process_keeps_its_signal_handlers_until_it_exits(
  own_signal_handlers, monkeypatch
):
  """As the process (the `t5x-optim` script, ``python -m t5x_optim``) the command's handlers
  stay while the process ends: a second Ctrl-C then still quits at once."""
  from t5x_optim.cli import _main  # noqa: PLC0415

  ended = []

  def exit_process(status):
    handlers = [getattr(signal.getsignal(signum), "__self__", None) for signum in _SIGNALS]
    ended.append((status, [type(handler) for handler in handlers]))

  monkeypatch.setattr(_main, "exit_process", exit_process)
  monkeypatch.setattr(sys, "argv", ["t5x-optim", "plan", "--gin_bindings", "TOTAL_STEPS = 0"])
  _main.console_main([])
  assert ended == [(2, [Interrupt] * 3)]


def test_each_command_shows_its_warnings_as_a_process_of_its_own(monkeypatch):
  """The package's warnings name the caller's line, and Python shows a warning once per line
  of a process: the next command of a sweep in the same process showed none of those the
  first had shown. Each command shows its warnings as a process of its own does, each line's
  once."""
  from t5x_optim import _warn  # noqa: PLC0415
  from t5x_optim.cli import _main  # noqa: PLC0415

  def warn_twice(args, interrupt):
    for _ in range(2):
      _warn.warn("a configuration that deserves a word")
    return 0

  monkeypatch.setattr(_main, "_run", warn_twice)
  with warnings.catch_warnings(record=True) as caught:
    warnings.resetwarnings()  # no filters: Python's default, once per line
    assert main(["plan"]) == 0
    assert main(["plan"]) == 0
  assert [str(warning.message) for warning in caught] == [
    "a configuration that deserves a word"
  ] * 2


def test_a_command_replaces_the_callers_gin_config(clean_gin, capsys):
  """gin keeps one config per process, with no way to set one aside: a command clears the
  caller's bindings, a finalized config's too, and leaves its own parsed (docs/cli.md)."""
  gin.parse_config("MINE = 0.5")
  gin.finalize()
  assert main(["plan", "--gin_bindings", "cli.TrainJob.total_steps = 'ten'"]) == 2
  assert "got 'ten'" in capsys.readouterr().err
  assert not gin.config_is_locked()
  with pytest.raises(ValueError, match="no bound parameters"):
    gin.query_parameter("%MINE")
  assert gin.query_parameter("%VOCAB_SIZE") == 32
