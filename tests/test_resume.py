"""`t5x-optim train` on a model directory that already holds checkpoints: the same job or none.

Each test runs the command (in this process, as tests/test_cli.py does, or in a
subprocess where the device count must differ) on a run of examples/tiny.gin.
"""

from __future__ import annotations

import errno
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from _ocdbt import flip_bytes
from test_cli import _checkpoint_steps, _env, _restored, _scalars

import t5x_optim
from t5x_optim._checkpoint.lock import WriterLock
from t5x_optim._low_precision import low_precision as low_precision_module
from t5x_optim.cli import main
from t5x_optim.cli.demo import text as _text
from t5x_optim.cli.loop import config as _config
from t5x_optim.cli.loop import train as _train
from t5x_optim.cli.loop.job import OPTIMIZER_NAMING, config_digest

pytestmark = [pytest.mark.usefixtures("clean_gin", "run_compilation_cache"), pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
TINY = ["--gin_file", "examples/tiny.gin"]
EVERY_2 = ["--gin_bindings", "cli.TrainJob.checkpoint_every = 2"]
ADAM = [
  "--gin_bindings",
  "optimizers.chain.transformations = [@optax.clip_by_global_norm(), @optax.adam()]",
  "--gin_bindings",
  "optax.adam.learning_rate = %LEARNING_RATE",
]
ADABELIEF = [
  "--gin_bindings",
  "optimizers.chain.transformations = [@optax.clip_by_global_norm(), @optax.adabelief()]",
  "--gin_bindings",
  "optax.adabelief.learning_rate = %LEARNING_RATE",
]
HEADS_4X8 = [
  "--gin_bindings",
  "cli.TransformerConfig.num_heads = 4",
  "--gin_bindings",
  "cli.TransformerConfig.head_dim = 8",
]


def _steps(total: int) -> list[str]:
  return ["--gin_bindings", f"TOTAL_STEPS = {total}"]


def _train_run(model_dir: Path, *flags: str, capsys) -> tuple[int, str, str]:
  code = main(["train", *TINY, "--model_dir", str(model_dir), *flags])
  out, err = capsys.readouterr()
  return code, out, err


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory) -> Path:
  """A finished run of tiny.gin to step 4, checkpoints at 2 and 4."""
  model_dir = tmp_path_factory.mktemp("resume") / "run"
  code = main(["train", *TINY, *_steps(4), *EVERY_2, "--model_dir", str(model_dir)])
  assert code == 0
  return model_dir


def _copy(run: Path, tmp_path: Path) -> Path:
  model_dir = tmp_path / "run"
  shutil.copytree(run, model_dir)
  return model_dir


def _one_line_error(code: int, err: str) -> str:
  assert code == 2, err
  assert len(err.splitlines()) == 1, err
  return err


def test_resume_with_another_optimizer_is_refused_naming_both(tmp_path, capsys):
  model_dir = tmp_path / "run"
  assert _train_run(model_dir, *_steps(2), *ADAM, capsys=capsys)[0] == 0
  code, _, err = _train_run(model_dir, *_steps(4), *ADABELIEF, capsys=capsys)
  err = _one_line_error(code, err)
  assert "holds another job: at its checkpoint step 2 the optimizer is " in err, err
  assert "optax.adam]) there, " in err and "optax.adabelief]) now" in err, err
  assert f"--init_from {model_dir} and a new --model_dir" in err, err
  assert _checkpoint_steps(model_dir) == [2]


def test_a_resume_refused_for_another_model_offers_no_init_from(tmp_path):
  """--init_from starts a run of the same model with another optimizer: a resume refused over
  a model change advised --init_from and a new --model_dir, which refused the same change."""
  model = {"num_layers": 2, "vocab_size": 256}
  job = {"model": model, "optimizer": "optax.adam", "optimizer_naming": OPTIMIZER_NAMING}
  with pytest.raises(_train.UsageError) as refused:
    _train._refuse_another_job(job, {**job, "model": {**model, "num_layers": 1}}, tmp_path, 4)
  assert "cli.TransformerConfig.num_layers is 2 there, 1 now" in str(refused.value)
  assert "its checkpoint cannot start a run of another model" in str(refused.value)
  assert "--init_from" not in str(refused.value)
  with pytest.raises(_train.UsageError, match=f"pass --init_from {tmp_path} and a new"):
    _train._refuse_another_job(job, {**job, "optimizer": "optax.lion"}, tmp_path, 4)


def test_a_checkpoint_whose_params_do_not_fit_offers_no_init_from(tmp_path):
  """A restore that fails over the params (``target/``) is another model: --init_from would
  refuse it too; one that fails over the optimizer state alone may start from --init_from."""
  params = ValueError("shape mismatch at 'target/decoder/kernel': the target has ...")
  message = _train._mismatch_message(params, 4, tmp_path)
  assert "its checkpoint cannot start a run of another model" in message, message
  assert "--init_from" not in message, message
  state = ValueError("missing key 'state/param_states/0/mu/decoder/kernel' (the target ...)")
  assert f"pass --init_from {tmp_path} and a new" in _train._mismatch_message(state, 4, tmp_path)


ADAMAXW_OF_THE_JOB = [
  "--gin_bindings",
  "cli.TrainJob.optimizer = @other/optimizers.chain()",
  "--gin_bindings",
  "other/optimizers.chain.transformations = [@optax.clip_by_global_norm(), @optax.adamaxw()]",
  "--gin_bindings",
  "optax.adamaxw.learning_rate = %LEARNING_RATE",
]
"""A chain with adamaxw bound to the train job itself, ``%OPTIMIZER`` left the default's."""


def test_resume_with_another_optimizer_bound_to_the_job_is_refused(four_steps, tmp_path, capsys):
  """A record that names ``%OPTIMIZER``'s optimizer was taken for one an earlier version wrote
  (they named it whatever the job bound), also when this version wrote it: a resume of a run
  of the default chain with adamw, with ``cli.TrainJob.optimizer`` bound to a chain with
  adamaxw, trained adamaxw on adamw's state. A record without ``optimizer_naming``, as earlier
  versions wrote it, is still taken for the job's (the state's layout is still compared)."""
  model_dir = _copy(four_steps, tmp_path)
  code, _, err = _train_run(model_dir, *_steps(6), *EVERY_2, *ADAMAXW_OF_THE_JOB, capsys=capsys)
  err = _one_line_error(code, err)
  assert "holds another job: at its checkpoint step 4 the optimizer is " in err, err
  assert "optax.adamw]) there, " in err and "optax.adamaxw]) now" in err, err
  assert _checkpoint_steps(model_dir) == [2, 4]
  for step in (2, 4):
    record = model_dir / "checkpoints" / str(step) / "job" / "metadata"
    earlier = json.loads(record.read_text())
    del earlier["optimizer_naming"]
    record.write_text(json.dumps(earlier))
  code, _, err = _train_run(model_dir, *_steps(6), *EVERY_2, *ADAMAXW_OF_THE_JOB, capsys=capsys)
  assert code == 0, err
  assert _checkpoint_steps(model_dir) == [2, 4, 6]


def test_resume_with_same_shapes_of_another_model_is_refused(four_steps, tmp_path, capsys):
  """2 heads of 16 and 4 heads of 8 give kernels of the same shapes."""
  model_dir = _copy(four_steps, tmp_path)
  config = (model_dir / "config.gin").read_text()
  code, _, err = _train_run(model_dir, *_steps(6), *EVERY_2, *HEADS_4X8, capsys=capsys)
  err = _one_line_error(code, err)
  assert (
    "at its checkpoint step 4 cli.TransformerConfig.head_dim is 16 there, 8 now; "
    "cli.TransformerConfig.num_heads is 2 there, 4 now;"
  ) in err, err
  assert "its checkpoint cannot start a run of another model" in err, err
  assert "--init_from" not in err, err  # It starts only a run of the same model.
  assert _checkpoint_steps(model_dir) == [2, 4]
  assert (model_dir / "config.gin").read_text() == config  # nothing half-written


def test_resume_with_another_jax_enable_x64_is_refused_naming_it(four_steps, tmp_path, capsys):
  """A resume that differed only in JAX_ENABLE_X64 was refused as another job, naming leaf
  dtypes, or (with a state that does not mirror the params) trained on in float64."""
  model_dir = _copy(four_steps, tmp_path)
  with jax.enable_x64(True):
    code, _, err = _train_run(model_dir, *_steps(6), *EVERY_2, capsys=capsys)
  err = _one_line_error(code, err)
  assert "checkpoint step 4 was written with jax_enable_x64 False, this run has True" in err
  assert "JAX_ENABLE_X64=0" in err and "another job" not in err, err
  assert _checkpoint_steps(model_dir) == [2, 4]


def test_a_checkpoint_of_a_newer_version_is_refused_and_kept(four_steps, tmp_path, capsys):
  """A job record of a format this version does not know was compared field by field as if
  it were its own: a newer version's record, read as this one's, resumed without a word.
  Its fields are not read as this version's either: --init_from took its config digest (here
  one this version would not compute) for this version's and refused the step because its
  config had changed."""
  model_dir = _copy(four_steps, tmp_path)
  record = model_dir / "checkpoints" / "4" / "job" / "metadata"
  newer = {**json.loads(record.read_text()), "format": 2, "config_sha256": "sha3-256:0"}
  record.write_text(json.dumps(newer))
  code, _, err = _train_run(model_dir, *_steps(6), *EVERY_2, capsys=capsys)
  err = _one_line_error(code, err)
  assert (
    f"--model_dir {model_dir}: its checkpoint step 4 was written by a newer t5x-optim "
    "(job record format 2; this version reads format 1)"
  ) in err, err
  assert _checkpoint_steps(model_dir) == [2, 4]
  assert json.loads(record.read_text())["format"] == 2
  # Nor is it converted: --init_from read its arrays with this version's optimizer.
  code, _, err = _train_run(
    tmp_path / "next", *_steps(6), "--init_from", str(model_dir), capsys=capsys
  )
  err = _one_line_error(code, err)
  assert err.startswith(
    f"t5x-optim train: error: --init_from {model_dir}: checkpoint step 4 was written by a newer "
    "t5x-optim (job record format 2; this version reads format 1); convert it with that version."
  ), err


def test_resume_may_change_steps_and_cadences_and_keeps_every_config(four_steps, tmp_path, capsys):
  model_dir = _copy(four_steps, tmp_path)
  flags = [*_steps(6), *EVERY_2, "--gin_bindings", "cli.TrainJob.eval_every = 3"]
  flags += ["--gin_bindings", "OPTIMIZER/optax.adamw.b1 = 0.8"]
  code, out, err = _train_run(model_dir, *flags, capsys=capsys)
  assert code == 0, err
  lines = out.splitlines()
  assert lines[0] == f"model_dir:       {model_dir} (resuming from the checkpoint at step 4)"
  assert lines[1] == (
    "config:          changed since step 4 (config_0.gin): OPTIMIZER/optax.adamw.b1 0.9 -> 0.8, "
    "TOTAL_STEPS 4 -> 6, cli.TrainJob.eval_every 20 -> 3"
  ), out
  assert lines[2].startswith("devices:"), out  # the same versions (and no text data): no line
  assert "TOTAL_STEPS = 4" in (model_dir / "config_0.gin").read_text()
  assert "TOTAL_STEPS = 6" in (model_dir / "config_4.gin").read_text()
  assert (model_dir / "config.gin").read_text() == (model_dir / "config_4.gin").read_text()
  with t5x_optim.Checkpointer(model_dir / "checkpoints") as checkpointer:
    assert checkpointer.recorded_job(4)["config_file"] == "config_0.gin"
    assert checkpointer.recorded_job(6)["config_file"] == "config_4.gin"
    assert checkpointer.recorded_job(6)["model"]["num_heads"] == 2


def test_the_config_change_line_lists_every_change(four_steps, tmp_path, capsys):
  """It showed six and "and 1 more": a seventh change (the data's seed) went unnamed."""
  model_dir = _copy(four_steps, tmp_path)
  bindings = {
    f"OPTIMIZER/optax.adamw.{name}": value
    for name, value in [("b1", "0.8"), ("b2", "0.99"), ("eps", "1e-6"), ("weight_decay", "0.01")]
  }
  bindings |= {"cli.TrainJob.eval_every": "3", "cli.SyntheticTask.seed": "7"}
  flags = [*_steps(6), *EVERY_2]
  for name, value in bindings.items():
    flags += ["--gin_bindings", f"{name} = {value}"]
  code, out, err = _train_run(model_dir, *flags, capsys=capsys)
  assert code == 0, err
  (line,) = [line for line in out.splitlines() if line.startswith("config:")]
  assert "more" not in line, line
  for name in [*bindings, "TOTAL_STEPS"]:
    assert f"{name} " in line, (name, line)


def test_an_edited_config_gin_is_kept_and_the_resume_says_it_was_not_read(
  four_steps, tmp_path, capsys
):
  """config.gin edited by hand (b1 = 0.5), then a resume: the edit went unused and the file
  was overwritten, without a word. An edited config.gin the run reads (given, found in a
  search path, included) is no such edit."""
  model_dir = _copy(four_steps, tmp_path)
  edited = (model_dir / "config.gin").read_text().replace("b1 = 0.9", "b1 = 0.5")
  (model_dir / "config.gin").write_text(edited)
  code, out, err = _train_run(model_dir, *_steps(6), *EVERY_2, capsys=capsys)
  assert code == 0, err
  kept = model_dir / "config_edited.gin"
  assert kept.read_text() == edited
  assert (
    f"config.gin:      edited by hand, not read (a run reads --gin_file and --gin_bindings); "
    f"kept as {kept}"
  ) in out.splitlines(), out
  assert "b1 = 0.9" in (model_dir / "config.gin").read_text()
  # Unedited: no line, nothing set aside.
  code, out, err = _train_run(model_dir, *_steps(8), *EVERY_2, capsys=capsys)
  assert code == 0, err
  assert "config.gin:" not in out and not (model_dir / "config_edited-2.gin").exists(), out
  # Edited and read with --gin_file: the run trains with it, nothing to say.
  config = model_dir / "config.gin"
  config.write_text(config.read_text().replace("TOTAL_STEPS = 8", "TOTAL_STEPS = 10"))
  code, out, err = _train_run(model_dir, "--gin_file", str(config), *EVERY_2, capsys=capsys)
  assert code == 0, err
  assert "config.gin:" not in out and not (model_dir / "config_edited-2.gin").exists(), out
  assert "TOTAL_STEPS 8 -> 10" in out, out
  # Edited and read as --gin_file config.gin found in --gin_search_paths: the same.
  config.write_text(config.read_text().replace("TOTAL_STEPS = 10", "TOTAL_STEPS = 12"))
  flags = ["--gin_search_paths", str(model_dir), "--gin_file", "config.gin"]
  code, out, err = _train_run(model_dir, *flags, *EVERY_2, capsys=capsys)
  assert code == 0, err
  assert "config.gin:" not in out and not (model_dir / "config_edited-2.gin").exists(), out
  assert "TOTAL_STEPS 10 -> 12" in out, out
  # Edited and read through an include, in a --gin_file or in a binding: the same.
  wrapper = tmp_path / "wrapper.gin"
  wrapper.write_text(f"include '{config}'\n")
  include = f"include '{config}'"
  for steps, flags in [(14, ["--gin_file", str(wrapper)]), (16, ["--gin_bindings", include])]:
    config.write_text(config.read_text().replace(f"STEPS = {steps - 2}", f"STEPS = {steps}"))
    code, out, err = _train_run(model_dir, *flags, *EVERY_2, capsys=capsys)
    assert code == 0, err
    assert "config.gin:" not in out and not (model_dir / "config_edited-2.gin").exists(), out
    assert f"TOTAL_STEPS {steps - 2} -> {steps}" in out, out


def test_the_config_change_line_compares_with_the_config_that_wrote_the_step(
  four_steps, tmp_path, capsys
):
  """The step's config copy edited or gone: the line was computed against the edited copy
  (here hiding the change of b1) or left out, without a word."""
  flags = [*_steps(6), *EVERY_2, "--gin_bindings", "OPTIMIZER/optax.adamw.b1 = 0.8"]

  def config_line(model_dir: Path, *run_flags: str) -> str | None:
    code, out, err = _train_run(model_dir, *run_flags, capsys=capsys)
    assert code == 0, err
    return next((line for line in out.splitlines() if line.startswith("config:")), None)

  # Its own copy gone: config.gin, the latest start's copy, has the step's digest.
  model_dir = _copy(four_steps, tmp_path)
  (model_dir / "config_0.gin").unlink()
  assert config_line(model_dir, *flags) == (
    "config:          changed since step 4 (config.gin): OPTIMIZER/optax.adamw.b1 0.9 -> 0.8, "
    "TOTAL_STEPS 4 -> 6"
  )
  # Both copies edited to read like the new config: the change is there, unlisted.
  model_dir = _copy(four_steps, tmp_path / "edited")
  for name in ("config_0.gin", "config.gin"):
    copy = model_dir / name
    edited = copy.read_text().replace("b1 = 0.9", "b1 = 0.8").replace("STEPS = 4", "STEPS = 6")
    copy.write_text(edited)
  digest = config_digest((four_steps / "config_0.gin").read_text())[:12]
  assert config_line(model_dir, *flags) == (
    "config:          changed since step 4, not listed: the config that wrote it, "
    f"config_0.gin, has changed since (sha256 {digest} recorded with the step, "
    f"{config_digest(edited)[:12]} now), and config.gin is another config"
  )
  # Unchanged since the step (a resume from step 2 of 4): no line, whatever became of the copies.
  model_dir = _copy(four_steps, tmp_path / "same")
  shutil.rmtree(model_dir / "checkpoints" / "4")
  for gone in ("config_0.gin", "config.gin"):
    (model_dir / gone).unlink()
  code, out, err = _train_run(model_dir, *_steps(4), *EVERY_2, capsys=capsys)
  assert code == 0, err
  assert out.startswith(f"model_dir:       {model_dir} (resuming from the checkpoint at step 2)\n")
  assert "config:" not in out, out
  # Changed since, and both copies gone (step 4's start is now the resume from step 2).
  for gone in ("config_2.gin", "config.gin"):
    (model_dir / gone).unlink()
  assert config_line(model_dir, *flags) == (
    "config:          changed since step 4, not listed: the config that wrote it, "
    "config_2.gin, is gone, and config.gin is gone"
  )


def test_resume_that_would_drop_accumulated_gradients_is_refused(tmp_path, capsys):
  """A step saved between two updates of optax.MultiSteps (every 4) holds 3 accumulated
  gradients; resumed with every 2, optax's mini-step (3 mod 2) never emits them: they were
  dropped without a word (the change line named every_k_schedule alone)."""
  model_dir = tmp_path / "run"
  multisteps = ["--gin_file", "optimizers/multisteps.gin"]
  every = ["--gin_bindings", "cli.TrainJob.checkpoint_every = 3"]
  assert _train_run(model_dir, *multisteps, *_steps(3), *every, capsys=capsys)[0] == 0
  fewer = ["--gin_bindings", "optax.MultiSteps.every_k_schedule = 2"]
  code, _, err = _train_run(model_dir, *multisteps, *_steps(6), *every, *fewer, capsys=capsys)
  err = _one_line_error(code, err)
  assert (
    f"--model_dir {model_dir}: its checkpoint step 3 holds 3 gradients that optax.MultiSteps "
    "accumulated towards its next update, which every_k_schedule 2 now would never apply"
  ) in err, err
  assert _checkpoint_steps(model_dir) == [3]
  # Every 4 again: step 4 applies the 4 gradients.
  code, out, err = _train_run(model_dir, *multisteps, *_steps(4), *every, capsys=capsys)
  assert code == 0, err
  # Saved at an update (mini-step 0): any every_k_schedule goes on.
  code, out, err = _train_run(model_dir, *multisteps, *_steps(6), *every, *fewer, capsys=capsys)
  assert code == 0, err


def _plateau(**settings: int) -> list[str]:
  """reduce_on_plateau after adam, never seeing an improvement after its first check."""
  bindings = [
    "optimizers.chain.transformations = [@optax.adam(), @optax.contrib.reduce_on_plateau()]",
    "optax.adam.learning_rate = %LEARNING_RATE",
    "optax.contrib.reduce_on_plateau.atol = 1e9",
    *(f"optax.contrib.reduce_on_plateau.{name} = {value}" for name, value in settings.items()),
  ]
  return [flag for binding in bindings for flag in ("--gin_bindings", binding)]


@pytest.mark.parametrize(
  ("saved", "resumed", "message"),
  [
    (
      {"accumulation_size": 3},
      {"accumulation_size": 2},
      "holds the average of 2 losses that optax.contrib.reduce_on_plateau accumulates towards "
      "its next check, which accumulation_size 2 now would never make (it checks when its "
      "count equals it)",
    ),
    (
      {"accumulation_size": 1, "patience": 5},
      {"accumulation_size": 1, "patience": 1},
      "holds a count of 1 checks without improvement of optax.contrib.reduce_on_plateau, which "
      "patience 1 now would never act on until the loss improves (it reduces the scale when "
      "its count equals it)",
    ),
  ],
  ids=["accumulation_size", "patience"],
)
def test_resume_that_would_stall_reduce_on_plateau_is_refused(
  saved, resumed, message, tmp_path, capsys
):
  """reduce_on_plateau acts when a counter equals its setting: resumed with a setting at or
  below the counter saved, it never checked (or reduced) again, without a word."""
  model_dir = tmp_path / "run"
  assert _train_run(model_dir, *_steps(2), *EVERY_2, *_plateau(**saved), capsys=capsys)[0] == 0
  code, _, err = _train_run(model_dir, *_steps(4), *EVERY_2, *_plateau(**resumed), capsys=capsys)
  err = _one_line_error(code, err)
  assert f"--model_dir {model_dir}: its checkpoint step 2 {message}; nothing was changed" in err
  assert _checkpoint_steps(model_dir) == [2]
  code, _, err = _train_run(model_dir, *_steps(4), *EVERY_2, *_plateau(**saved), capsys=capsys)
  assert code == 0, err


@pytest.mark.slow
def test_a_resume_trains_with_the_injected_hyperparameters_the_config_gives_now(tmp_path, capsys):
  """inject_hyperparams keeps its constants in the optimizer state: a resume with another
  learning rate said "LEARNING_RATE 0.003 -> 1e-05" and trained on at 0.003."""
  flags = [*TINY, "--gin_file", "optimizers/inject_hyperparams.gin", "--model_dir", str(tmp_path)]
  flags += ["--gin_bindings", "cli.TrainJob.log_every = 1"]
  assert main(["train", *flags, "--gin_bindings", "TOTAL_STEPS = 2"]) == 0
  capsys.readouterr()
  changed = ["--gin_bindings", "LEARNING_RATE = 1e-5", "--gin_bindings", "TOTAL_STEPS = 3"]
  assert main(["train", *flags, *changed]) == 0
  out = capsys.readouterr().out
  assert "LEARNING_RATE 0.003 -> 1e-05" in out, out
  assert re.search(r"^step 3/3 .* lr 1e-05 ", out, re.M), out
  _config.parse_config(gin_files=[*TINY[1::2], "optimizers/inject_hyperparams.gin"])
  setup = _train.prepare(_config.build_job())
  with t5x_optim.Checkpointer(tmp_path / "checkpoints") as checkpointer:
    state = checkpointer.restore(setup.abstract_state, 3)
  hyperparams = state.param_states.hyperparams
  assert float(hyperparams["learning_rate"]) == pytest.approx(1e-5)
  assert float(hyperparams["b1"]) == pytest.approx(0.9)


_SCHEDULE_FREE = [
  "OPTIMIZER = @optimizers.schedule_free_adamw()",
  "optimizers.schedule_free_adamw.learning_rate = 1e-3",
  "optimizers.schedule_free_adamw.b1 = 0.9",
]


@pytest.mark.parametrize(
  "gin_files, bindings, change, held, new",
  [
    (
      ["optimizers/muon.gin"],
      [],
      "optimizers.muon.ns_coeffs = (3.0, -4.0, 2.0)",
      lambda states: states.inner_states["muon"].inner_state[0].ns_coeffs,
      [3.0, -4.0, 2.0],
    ),
    (
      [],
      _SCHEDULE_FREE,
      "optimizers.schedule_free_adamw.b1 = 0.5",
      lambda states: states.b1,
      [0.5],
    ),
  ],
  ids=["muon_ns_coeffs", "schedule_free_b1"],
)
def test_a_resume_trains_with_the_constants_the_optimizer_state_keeps_as_the_config_gives_now(
  tmp_path, capsys, gin_files, bindings, change, held, new
):
  """Muon keeps its Newton-Schulz coefficients in its state and schedule-free its b1, and
  their updates read them there: a resume that changed them said so and trained on with the
  old ones."""
  flags = [*EVERY_2]
  for gin_file in gin_files:
    flags += ["--gin_file", gin_file]
  for binding in bindings:
    flags += ["--gin_bindings", binding]
  assert _train_run(tmp_path, *flags, *_steps(2), capsys=capsys)[0] == 0
  code, out, err = _train_run(tmp_path, *flags, *_steps(4), "--gin_bindings", change, capsys=capsys)
  assert code == 0, err
  assert "config:          changed since step 2" in out, out
  _, state = _restored(tmp_path, [*TINY[1::2], *gin_files], [*bindings, change, "TOTAL_STEPS = 4"])
  assert int(state.step) == 4
  assert np.ravel(held(state.param_states)).tolist() == pytest.approx(new)


def test_a_resume_on_other_text_data_says_so(tmp_path, capsys):
  """The text under --data replaced between a run and its resume (same path): the resume
  read other batches than the run would have, without a word."""
  text = tmp_path / "text.txt"
  text.write_text(("the quick brown fox jumps over the lazy dog. " * 400).strip())
  model_dir = tmp_path / "run"
  data = ["--data", str(text)]
  assert _train_run(model_dir, *data, *_steps(2), *EVERY_2, capsys=capsys)[0] == 0
  code, out, err = _train_run(model_dir, *data, *_steps(4), *EVERY_2, capsys=capsys)
  assert code == 0, err
  assert "data:" not in out, out
  before = _text.data_summary(text)
  text.write_text(text.read_text().upper())
  code, out, err = _train_run(model_dir, *data, *_steps(6), *EVERY_2, capsys=capsys)
  assert code == 0, err
  assert out.splitlines()[2] == (
    f"data:            changed since step 4: {before} there, {_text.data_summary(text)} now"
  ), out


def test_a_resume_with_other_library_versions_says_which(four_steps, tmp_path, capsys):
  """A checkpoint written under another optax (a container rebuilt between a run and its
  resume) resumed without a word: a change of numerics after the resume had no trace."""
  model_dir = _copy(four_steps, tmp_path)
  record = model_dir / "checkpoints" / "4" / "job" / "metadata"
  job = json.loads(record.read_text())
  assert set(job["versions"]) >= {"t5x-optim", "jax", "jaxlib", "flax", "optax"}, job
  now = job["versions"]["optax"]
  record.write_text(json.dumps({**job, "versions": {**job["versions"], "optax": "0.1.0"}}))
  code, out, err = _train_run(model_dir, *_steps(6), *EVERY_2, capsys=capsys)
  assert code == 0, err
  assert f"\nversions:        changed since step 4: optax 0.1.0 -> {now}\n" in out, out


def test_init_from_into_a_model_dir_with_checkpoints_says_it_is_ignored(
  four_steps, tmp_path, capsys
):
  model_dir = _copy(four_steps, tmp_path)
  flags = [*_steps(6), *EVERY_2, "--init_from", str(four_steps)]
  code, out, err = _train_run(model_dir, *flags, capsys=capsys)
  assert code == 0, err
  assert out.splitlines()[1] == (
    f"init_from:       ignored: {model_dir} already holds checkpoints, so the run resumes "
    f"from them; to start from {four_steps}, use a new --model_dir"
  )


def _tree(directory: Path) -> dict[str, bytes]:
  return {
    str(path.relative_to(directory)): path.read_bytes() if path.is_file() else b""
    for path in sorted(directory.rglob("*"))
  }


def test_init_from_skips_an_incomplete_or_corrupt_newest_checkpoint_and_changes_no_file(
  four_steps, tmp_path, capsys
):
  source = _copy(four_steps, tmp_path)
  flip_bytes(source / "checkpoints" / "4", 1)
  (source / "checkpoints" / "6").mkdir()  # an interrupted copy
  before = _tree(source)
  flags = [*_steps(3), *ADAM, "--init_from", str(source)]
  code, out, err = _train_run(tmp_path / "new", *flags, capsys=capsys)
  assert code == 0, err
  skipped = [line for line in out.splitlines() if "skipped" in line]
  assert skipped[0] == (
    f"init_from:       skipped checkpoint step 6 of {source}: incomplete: its save or copy "
    "never completed"
  ), out
  assert re.fullmatch(
    rf"init_from:       skipped checkpoint step 4 of {source}: "
    r"Checkpoint step 4 in \S+ (is corrupt|could not be read|has unreadable).*",
    skipped[1],
  ), out
  assert f"init_from:       {source} at step 2\n" in out, out
  assert re.search(r"^steps 2 -> 3,", out, re.M), out
  assert _tree(source) == before


def test_init_from_a_run_still_training_lists_its_steps_again(
  four_steps, tmp_path, capsys, monkeypatch
):
  """The source still trains, keeping one checkpoint: its rotation deleted step 4 while
  --init_from read it, after saving step 6, and the start stopped with "holds no intact
  checkpoint (step 4: ... could not be read)". A step gone when its read fails is skipped as
  deleted, the steps are listed again, and the newest is read."""
  from t5x_optim.cli import _init_from  # noqa: PLC0415

  source = _copy(four_steps, tmp_path)
  checkpoints = source / "checkpoints"
  shutil.rmtree(checkpoints / "2")  # one checkpoint kept
  real = _init_from.restore_converted

  def rotated_under_the_read(directory, *args, step=None, **kwargs):
    if step == 4:  # the run saves step 6 (here a copy of 4) and deletes 4 while it is read
      shutil.copytree(checkpoints / "4", checkpoints / "6")
      shutil.rmtree(checkpoints / "4")
      raise t5x_optim.CheckpointError(f"Checkpoint step 4 in {directory} could not be read", step=4)
    return real(directory, *args, step=step, **kwargs)

  monkeypatch.setattr(_init_from, "restore_converted", rotated_under_the_read)
  flags = [*_steps(7), *ADAM, "--init_from", str(source)]
  code, out, err = _train_run(tmp_path / "new", *flags, capsys=capsys)
  assert code == 0, err
  assert (
    f"init_from:       skipped checkpoint step 4 of {source}: deleted while it was read (is "
    "the run that wrote it still training?)\n" in out
  ), out
  assert f"init_from:       {source} at step 4\n" in out, out


def test_init_from_a_step_directory_restores_that_step_or_refuses(four_steps, tmp_path, capsys):
  flags = [*_steps(3), *ADAM, "--init_from", str(four_steps / "checkpoints" / "2")]
  code, out, err = _train_run(tmp_path / "new", *flags, capsys=capsys)
  assert code == 0, err
  assert f"init_from:       {four_steps} at step 2\n" in out, out
  assert re.search(r"^steps 2 -> 3,", out, re.M), out
  # A corrupt step that is named is refused, not replaced by another.
  source = _copy(four_steps, tmp_path)
  flip_bytes(source / "checkpoints" / "4", 1)
  flags = [*_steps(5), *ADAM, "--init_from", str(source / "checkpoints" / "4")]
  code, out, err = _train_run(tmp_path / "new_4", *flags, capsys=capsys)
  err = _one_line_error(code, err)
  assert re.match(
    rf"t5x-optim train: error: --init_from {source}: Checkpoint step 4 in \S+ "
    r"(is corrupt|could not be read|has unreadable)",
    err,
  ), err
  assert not any((tmp_path / "new_4" / "checkpoints").iterdir())


def test_init_from_a_runs_checkpoints_directory_is_that_run(four_steps, tmp_path, capsys):
  flags = [*_steps(5), *ADAM, "--init_from", str(four_steps / "checkpoints")]
  code, out, err = _train_run(tmp_path / "new", *flags, capsys=capsys)
  assert code == 0, err
  assert f"init_from:       {four_steps} at step 4\n" in out, out


def test_init_from_a_run_without_its_config_gin_reads_its_checkpoints(four_steps, tmp_path, capsys):
  source = _copy(four_steps, tmp_path)
  (source / "config.gin").unlink()
  flags = [*_steps(5), *ADAM, "--init_from", str(source)]
  code, _, err = _train_run(tmp_path / "new", *flags, capsys=capsys)
  err = _one_line_error(code, err)
  assert "pass --init_from_gin with a gin file of that optimizer" in err, err
  flags += ["--init_from_gin", "optimizers/adamw.gin"]
  code, out, err = _train_run(tmp_path / "new_2", *flags, capsys=capsys)
  assert code == 0, err
  assert f"init_from:       {source} at step 4\n" in out, out


def test_init_from_reads_the_hparams_of_the_start_that_wrote_the_step(tmp_path, capsys):
  """A run resumed with another b2: each step converts with the b2 that wrote it."""
  source = tmp_path / "run"
  for total, b2 in ((2, 0.98), (4, 0.9)):
    flags = [*_steps(total), *EVERY_2, *ADAM, "--gin_bindings", f"optax.adam.b2 = {b2}"]
    assert _train_run(source, *flags, capsys=capsys)[0] == 0
  lion = [*_steps(5), "--gin_file", "optimizers/lion.gin"]
  for init_from, step, b2 in ((source / "checkpoints" / "2", 2, 0.98), (source, 4, 0.9)):
    flags = [*lion, "--init_from", str(init_from)]
    code, out, err = _train_run(tmp_path / f"from_{step}", *flags, capsys=capsys)
    assert code == 0, err
    assert f"init_from:       {source} at step {step}\n" in out, out
    assert f"  hparams: old b1=0.9, b2={b2}, learning_rate=a schedule, new " in out, out
  # The first start's config copy edited or gone: step 2's b2 is unknown, not config.gin's.
  first = source / "config_0.gin"
  text = first.read_text()
  step_2 = ["--init_from", str(source / "checkpoints" / "2")]
  for edit in ("edited", "gone"):
    if edit == "edited":
      first.write_text(text.replace("optax.adam.b2 = 0.98", "optax.adam.b2 = 0.5"))
    else:
      first.unlink()
    code, out, err = _train_run(tmp_path / f"{edit}_2", *lion, *step_2, capsys=capsys)
    err = _one_line_error(code, err)
    assert err.startswith(
      f"t5x-optim train: error: --init_from {source}: checkpoint step 2 was written with the "
      f"config config_0.gin, which {'has changed since' if edit == 'edited' else 'is gone'}"
    ), err
    assert "--init_from_gin" in err, err
  # The first start's config no longer builds: only a restore of its step needs it.
  first.write_text(text.replace("@optax.adam()", "@optax.no_such_optimizer()"))
  record = source / "checkpoints" / "2" / "job" / "metadata"
  job = json.loads(record.read_text())
  job["config_sha256"] = config_digest(first.read_text())
  record.write_text(json.dumps(job))
  code, out, err = _train_run(tmp_path / "broken_2", *lion, *step_2, capsys=capsys)
  err = _one_line_error(code, err)
  assert err.startswith(f"t5x-optim train: error: --init_from {first} does not build"), err
  # Step 4's own copy gone: config.gin, the latest start's copy, has its digest.
  (source / "config_2.gin").unlink()
  code, out, err = _train_run(
    tmp_path / "broken_4", *lion, "--init_from", str(source), capsys=capsys
  )
  assert code == 0, err
  assert f"init_from:       {source} at step 4\n" in out, out
  assert "  hparams: old b1=0.9, b2=0.9, learning_rate=a schedule, new " in out, out


def test_a_corrupt_newest_checkpoint_is_skipped_and_kept(four_steps, tmp_path, capsys):
  model_dir = _copy(four_steps, tmp_path)
  flip_bytes(model_dir / "checkpoints" / "4", 1)
  flags = [*_steps(8), *EVERY_2, "--gin_bindings", "cli.TrainJob.keep_checkpoints = 1"]
  code, out, err = _train_run(model_dir, *flags, capsys=capsys)
  assert code == 0, err
  lines = out.splitlines()
  assert lines[0] == f"model_dir:       {model_dir} (resuming from the checkpoint at step 2)"
  assert re.fullmatch(
    rf"skipped:         checkpoint step 4, kept in {model_dir}/skipped_checkpoints/4: "
    r"Checkpoint step 4 in \S+ (is corrupt|could not be read|has unreadable).*",
    lines[1],
  ), out
  assert re.search(r"^steps 2 -> 8,", out, re.M), out
  # Rotation (keep 1) and the new save of step 4 left the skipped step alone.
  assert _checkpoint_steps(model_dir) == [8]
  kept = model_dir / "skipped_checkpoints"
  assert sorted(p.name for p in kept.iterdir()) == ["4", "4.txt"]
  assert (kept / "4" / "default").is_dir()
  assert "was skipped on resume" in (kept / "4.txt").read_text()


def test_a_skipped_checkpoint_is_moved_aside_from_another_file_system(
  four_steps, tmp_path, capsys, monkeypatch
):
  """checkpoints/ a link to another file system: the rename of a skipped step into
  skipped_checkpoints/ failed (EXDEV) in a traceback after the line saying where it was
  kept, and every later start failed the same way."""
  model_dir = _copy(four_steps, tmp_path)
  flip_bytes(model_dir / "checkpoints" / "4", 1)
  kept = model_dir / "skipped_checkpoints"
  rename = Path.rename

  def across_devices(self, target):
    if self.parent == model_dir / "checkpoints" and Path(target).parent == kept:
      raise OSError(errno.EXDEV, "Invalid cross-device link")
    return rename(self, target)

  def disk_full(source, target, **kwargs):
    Path(target).mkdir()
    (Path(target) / "part").write_text("cut short")
    raise OSError(errno.ENOSPC, "No space left on device")

  monkeypatch.setattr(Path, "rename", across_devices)
  with monkeypatch.context() as patch:
    patch.setattr(shutil, "copytree", disk_full)
    code, out, err = _train_run(model_dir, *_steps(6), *EVERY_2, capsys=capsys)
  err = _one_line_error(code, err)
  assert f"checkpoint step 4 is skipped, but it could not be moved to {kept}/4: " in err, err
  assert "No space left on device" in err and "kept in" not in out, out
  assert _checkpoint_steps(model_dir) == [2, 4] and list(kept.iterdir()) == []
  code, out, err = _train_run(model_dir, *_steps(6), *EVERY_2, capsys=capsys)
  assert code == 0, err
  assert out.splitlines()[1].startswith(
    f"skipped:         checkpoint step 4, kept in {kept}/4: Checkpoint step 4 in "
  ), out
  assert _checkpoint_steps(model_dir) == [2, 4, 6]
  assert sorted(p.name for p in kept.iterdir()) == ["4", "4.txt"]
  assert (kept / "4" / "default").is_dir()


def test_a_finished_run_whose_last_checkpoint_is_corrupt_trains_it_again(
  four_steps, tmp_path, capsys
):
  model_dir = _copy(four_steps, tmp_path)
  flip_bytes(model_dir / "checkpoints" / "4", 1)
  code, out, err = _train_run(model_dir, *_steps(4), *EVERY_2, capsys=capsys)
  assert code == 0, err
  lines = out.splitlines()
  assert lines[0] == f"model_dir:       {model_dir} (resuming from the checkpoint at step 2)", out
  assert lines[1].startswith(f"skipped:         checkpoint step 4, kept in {model_dir}/"), out
  assert re.search(r"^steps 2 -> 4,", out, re.M), out
  assert _checkpoint_steps(model_dir) == [2, 4]


def test_a_model_dir_in_use_by_another_run_is_refused_before_anything_changes(
  four_steps, tmp_path, capsys
):
  model_dir = _copy(four_steps, tmp_path)
  other = WriterLock(str(model_dir))
  assert other.take() == ""
  # The compilation cache in the model directory (the default outside the tests) too: the
  # refused run rewrote its record of intact entries and deleted an entry being written.
  cache = model_dir / "compilation_cache"
  cache.mkdir()
  (cache / "jit_step-0123-cache").write_bytes(b"being written")
  before = {p.relative_to(model_dir): p.stat().st_mtime_ns for p in model_dir.rglob("*")}
  try:
    flags = ["--compilation_cache", str(cache)]
    code, out, err = _train_run(model_dir, *_steps(8), *EVERY_2, *flags, capsys=capsys)
  finally:
    other.release()
  err = _one_line_error(code, err)
  assert f"--model_dir {model_dir} is in use by another writer (pid " in err, err
  assert "nothing was changed" in err, err
  assert "step" not in out, out
  after = {p.relative_to(model_dir): p.stat().st_mtime_ns for p in model_dir.rglob("*")}
  assert after == before
  code, out, err = _train_run(model_dir, *_steps(6), *EVERY_2, capsys=capsys)
  assert code == 0, err
  assert _checkpoint_steps(model_dir) == [2, 4, 6]


def test_a_constant_learning_rate_in_place_of_the_schedule_says_how_to_keep_its_kind(
  four_steps, tmp_path, capsys
):
  model_dir = _copy(four_steps, tmp_path)
  constant = ["--gin_bindings", "LEARNING_RATE = 0.001"]
  code, _, err = _train_run(model_dir, *_steps(6), *EVERY_2, *constant, capsys=capsys)
  err = _one_line_error(code, err)
  assert "is ScaleByScheduleState there, EmptyState now" in err, err
  assert "`LEARNING_RATE = @optax.constant_schedule()` with `optax.constant_schedule.value" in err
  as_schedule = [
    "--gin_bindings",
    "LEARNING_RATE = @optax.constant_schedule()",
    "--gin_bindings",
    "optax.constant_schedule.value = 0.001",
  ]
  code, out, err = _train_run(model_dir, *_steps(6), *EVERY_2, *as_schedule, capsys=capsys)
  assert code == 0, err
  assert re.search(r"^step 6/6  loss \S+  lr 0.001  ", out, re.M), out


def test_init_from_a_run_of_another_model_names_what_differs(four_steps, tmp_path, capsys):
  flags = [*_steps(6), *HEADS_4X8, "--init_from", str(four_steps)]
  code, _, err = _train_run(tmp_path / "run", *flags, capsys=capsys)
  err = _one_line_error(code, err)
  assert err.startswith(
    f"t5x-optim train: error: --init_from {four_steps}: checkpoint step 4 holds another model: "
    "cli.TransformerConfig.head_dim is 16 there, 8 now; cli.TransformerConfig.num_heads is 2 "
    "there, 4 now"
  ), err
  assert len(err) < 600, err


def test_a_checkpoint_of_an_earlier_version_with_compressed_param_copies_says_so(
  tmp_path, capsys, monkeypatch
):
  """Earlier versions compressed a low_precision state leaf that copies the params
  (schedule-free's z); their checkpoints were refused as "another job" without a reason."""
  schedule_free = [
    "--gin_file",
    "optimizers/adamw_8bit.gin",
    "--gin_bindings",
    "optimizers.low_precision.inner = @optax.contrib.schedule_free_adamw()",
    "--gin_bindings",
    "optax.contrib.schedule_free_adamw.learning_rate = %LEARNING_RATE",
    "--gin_bindings",
    "optimizers.low_precision.min_size = 0",
  ]
  earlier = lambda init, params, state: [False] * len(jax.tree.leaves(state))  # noqa: E731
  with monkeypatch.context() as patched:
    patched.setattr(low_precision_module, "_param_copies", earlier)
    code, _, err = _train_run(tmp_path / "run", *_steps(2), *EVERY_2, *schedule_free, capsys=capsys)
  assert code == 0, err
  code, _, err = _train_run(tmp_path / "run", *_steps(4), *EVERY_2, *schedule_free, capsys=capsys)
  err = _one_line_error(code, err)
  assert "1/inner_state/z/" in err and "is QuantizedLeaf there" in err, err
  assert "earlier versions compressed it" in err, err


_EARLIER_COMPRESSED = {
  "accumulator": (
    [
      "optimizers.low_precision.inner = @optax.MultiSteps()",
      "optax.MultiSteps.opt = @optax.adamw()",
      "optax.adamw.learning_rate = %LEARNING_RATE",
      "optax.MultiSteps.every_k_schedule = 2",
    ],
    "_accumulators",
    False,
    "/acc_grads/",
    "MultiSteps's sum of gradients",
  ),
  "galore_projector": (
    [
      "optimizers.low_precision.inner = @optax.contrib.galore()",
      "optax.contrib.galore.learning_rate = %LEARNING_RATE",
    ],
    "_kept_fields",
    None,
    "/projector/",
    "GaLore's projector",
  ),
  "lbfgs_last_params": (
    ["optimizers.low_precision.inner = @optax.lbfgs()"],
    "_kept_fields",
    None,
    "/0/params/",
    "L-BFGS's last params and updates",
  ),
}


@pytest.mark.parametrize("kind", sorted(_EARLIER_COMPRESSED))
def test_a_checkpoint_of_an_earlier_version_with_a_leaf_it_compressed_says_so(
  kind, tmp_path, capsys, monkeypatch
):
  """Earlier versions compressed optax.MultiSteps's sum of gradients, and a GaLore projector of
  its param's shape (a kernel's at galore's default rank 128), inside low_precision; their
  checkpoints were refused as "another job" without a reason."""
  bindings, helper, unmarked, where, what = _EARLIER_COMPRESSED[kind]
  flags = ["--gin_file", "optimizers/adamw_8bit.gin"]
  for binding in [*bindings, "optimizers.low_precision.min_size = 0"]:
    flags += ["--gin_bindings", binding]
  earlier = lambda state: [unmarked] * len(jax.tree.leaves(state))  # noqa: E731
  with monkeypatch.context() as patched:
    patched.setattr(low_precision_module, helper, earlier)
    code, _, err = _train_run(tmp_path / "run", *_steps(2), *EVERY_2, *flags, capsys=capsys)
  assert code == 0, err
  code, _, err = _train_run(tmp_path / "run", *_steps(4), *EVERY_2, *flags, capsys=capsys)
  err = _one_line_error(code, err)
  assert where in err and "is QuantizedLeaf there" in err, err
  assert what in err and "earlier versions compressed it" in err, err


def test_every_field_low_precision_keeps_is_named_in_the_refusal_of_earlier_checkpoints():
  """Each state field that low_precision keeps whatever its shape (L-BFGS's last params,
  MADGRAD's sum of gradients...) was compressed by earlier versions: a resume of their
  checkpoints says that earlier versions compressed it, naming the field, for the labels
  `_KEPT_SINCE_EARLIER_VERSIONS` lists."""
  labels = low_precision_module._KEPT_FIELD_LABELS
  assert labels <= set(_train._KEPT_SINCE_EARLIER_VERSIONS), labels


def test_an_empty_step_directory_is_not_a_checkpoint(four_steps, tmp_path, capsys):
  model_dir = _copy(four_steps, tmp_path)
  (model_dir / "checkpoints" / "6").mkdir()
  code, out, err = _train_run(model_dir, *_steps(6), *EVERY_2, capsys=capsys)
  assert code == 0, err
  lines = out.splitlines()
  assert lines[0] == f"model_dir:       {model_dir} (resuming from the checkpoint at step 4)"
  assert lines[1] == (
    f"skipped:         checkpoint step 6, kept in {model_dir}/skipped_checkpoints/6: "
    "incomplete: its save or copy never completed"
  )
  assert _checkpoint_steps(model_dir) == [2, 4, 6]
  with t5x_optim.Checkpointer(model_dir / "checkpoints") as checkpointer:
    assert checkpointer.is_committed(6)


def test_no_intact_checkpoint_is_one_line_and_changes_nothing(four_steps, tmp_path, capsys):
  model_dir = _copy(four_steps, tmp_path)
  for step in (2, 4):
    flip_bytes(model_dir / "checkpoints" / str(step), 1)
  code, _, err = _train_run(model_dir, *_steps(6), *EVERY_2, capsys=capsys)
  err = _one_line_error(code, err)
  assert f"--model_dir {model_dir} holds no intact checkpoint (step 4: " in err, err
  assert _checkpoint_steps(model_dir) == [2, 4]
  assert not (model_dir / "skipped_checkpoints").exists()


def test_the_logged_scheduled_rate_is_the_one_the_accumulating_optimizer_uses(tmp_path, capsys):
  """optax.MultiSteps updates adamw every 4th step: its schedule counts updates, not steps,
  and a step that only accumulates logs the rate of the update before it."""
  schedule = [
    "--gin_bindings",
    "LEARNING_RATE = @optax.linear_schedule()",
    "--gin_bindings",
    "optax.linear_schedule.init_value = 0.01",
    "--gin_bindings",
    "optax.linear_schedule.end_value = 0.0",
    "--gin_bindings",
    "optax.linear_schedule.transition_steps = 40",
  ]
  flags = [*_steps(40), "--gin_file", "optimizers/multisteps.gin", *schedule]
  code, out, err = _train_run(tmp_path / "run", *flags, capsys=capsys)
  assert code == 0, err
  rates = dict(_scalars(tmp_path / "run" / "train")["learning_rate"])
  # Step s (1-based) follows adamw's latest update, at its count s // 4 - 1 (0 before it).
  for step, rate in rates.items():
    assert rate == pytest.approx(0.01 * (1 - max(step // 4 - 1, 0) / 40), rel=1e-5), (step, rate)
  assert re.search(r"^step 40/40  loss \S+  lr 0.00775  ", out, re.M), out


_PRODIGY_EVERY_2 = """
from __gin__ import dynamic_registration
import optax
import optax.contrib
from t5x_optim import optimizers

OPTIMIZER = @optimizers.OptaxWrapper()
optimizers.OptaxWrapper.optax_optimizer = @optax.MultiSteps()
optax.MultiSteps.opt = @optax.contrib.prodigy()
optax.MultiSteps.every_k_schedule = 2
optax.contrib.prodigy.learning_rate = @optax.linear_schedule()
optax.linear_schedule.init_value = 1.0
optax.linear_schedule.end_value = 0.0
optax.linear_schedule.transition_steps = 4
"""


@pytest.mark.slow
def test_the_logged_rate_of_a_schedule_read_at_the_optimizers_own_count(tmp_path, capsys):
  """prodigy keeps the count its schedule is read at in its own state; under MultiSteps it
  counts updates, not steps. A step that only accumulates shows the rate of the update
  before it (before the first update, the first's)."""
  gin_file = tmp_path / "prodigy.gin"
  gin_file.write_text(_PRODIGY_EVERY_2)
  flags = [*_steps(6), "--gin_file", str(gin_file), "--gin_bindings", "cli.TrainJob.log_every = 1"]
  code, out, err = _train_run(tmp_path / "run", *flags, capsys=capsys)
  assert code == 0, err
  logged = [float(rate) for rate in re.findall(r"^step \d+/6  loss \S+  lr (\S+)  ", out, re.M)]
  assert logged == pytest.approx([1.0, 1.0, 1.0, 0.75, 0.75, 0.5]), out


_MULTI_STEPS_RATES = {
  "bound": [
    "optax.MultiSteps.opt = @optax.adamw()",
    "optax.adamw.learning_rate = @optax.linear_schedule()",
  ],
  "injected": [
    "optax.MultiSteps.opt = @optimizers.inject_hyperparams()",
    "optimizers.inject_hyperparams.inner_factory = @optax.adamw",
    "optimizers.inject_hyperparams.hyperparams = {'learning_rate': @optax.linear_schedule()}",
  ],
}


@pytest.mark.slow
def test_the_logged_rate_under_multi_steps_is_the_same_bound_or_injected(tmp_path, capsys):
  """Under optax.MultiSteps, a step that only accumulated logged the schedule at the next
  update's count when bound as adamw's learning_rate, the last update's when injected (read
  from the optimizer state). Both log the rate of the latest update."""
  logged = {}
  for how, bindings in _MULTI_STEPS_RATES.items():
    bindings = [
      "OPTIMIZER = @optimizers.OptaxWrapper()",
      "optimizers.OptaxWrapper.optax_optimizer = @optax.MultiSteps()",
      "optax.MultiSteps.every_k_schedule = 2",
      *bindings,
      "optax.linear_schedule.init_value = 0.008",
      "optax.linear_schedule.end_value = 0.0",
      "optax.linear_schedule.transition_steps = 4",
      "cli.TrainJob.log_every = 1",
    ]
    flags = [f for binding in bindings for f in ("--gin_bindings", binding)]
    code, out, err = _train_run(tmp_path / how, *_steps(6), *flags, capsys=capsys)
    assert code == 0, err
    logged[how] = [float(r) for r in re.findall(r"^step \d+/6  loss \S+  lr (\S+)  ", out, re.M)]
  want = [0.008, 0.008, 0.008, 0.006, 0.006, 0.004]
  assert logged == {"bound": pytest.approx(want), "injected": pytest.approx(want)}


@pytest.mark.slow
def test_the_logged_rate_of_schedule_free_adamw_is_its_warmup(tmp_path, capsys):
  flags = [*_steps(5), "--gin_bindings", "cli.TrainJob.log_every = 1", "--gin_bindings"]
  flags.append("OPTIMIZER = @optimizers.schedule_free_adamw()")
  for binding in ("learning_rate = 0.01", "warmup_steps = 4"):
    flags += ["--gin_bindings", f"optimizers.schedule_free_adamw.{binding}"]
  code, out, err = _train_run(tmp_path / "run", *flags, capsys=capsys)
  assert code == 0, err
  assert (
    "learning rate:   optimizers.schedule_free_adamw.learning_rate = 0.01, warmed up by "
    "optax.warmup_constant_schedule over optimizers.schedule_free_adamw.warmup_steps = 4 "
    "(a schedule, at its optimizer's count)\n"
  ) in out, out
  logged = [float(rate) for rate in re.findall(r"^step \d+/5  loss \S+  lr (\S+)  ", out, re.M)]
  assert logged == pytest.approx([0.0, 0.0025, 0.005, 0.0075, 0.01]), out


def test_the_logged_learning_rate_is_the_optimizers(tmp_path, capsys):
  model_dir = tmp_path / "run"
  flags = [*_steps(10), "--gin_bindings", "optax.adamw.learning_rate = 1e-5"]
  code, out, err = _train_run(model_dir, *flags, capsys=capsys)
  assert code == 0, err
  assert "learning rate:   optax.adamw.learning_rate = 1e-05 (a constant)\n" in out, out
  assert re.search(r"^step 10/10  loss \S+  lr 1e-05  ", out, re.M), out
  rates = [rate for _, rate in _scalars(model_dir / "train")["learning_rate"]]
  assert rates == pytest.approx([1e-5, 1e-5])


def test_a_learning_rate_in_the_optimizer_state_is_read_from_it(tmp_path, capsys):
  model_dir = tmp_path / "run"
  flags = [*_steps(5), "--gin_file", "optimizers/inject_hyperparams.gin"]
  flags += ["--gin_bindings", "LEARNING_RATE = 0.25"]
  code, out, err = _train_run(model_dir, *flags, capsys=capsys)
  assert code == 0, err
  assert "learning rate:   read from the optimizer state (inject_hyperparams'" in out, out
  assert re.search(r"^step 5/5  loss \S+  lr 0.25  ", out, re.M), out


_INJECTED_MULTI = """
from __gin__ import dynamic_registration
import optax
from t5x_optim import optimizers

OPTIMIZER = @optimizers.MultiOptimizer()
matrices/optimizers.PathFilter:
  patterns = 'scale$'
  invert = True
scales/optimizers.PathFilter.patterns = 'scale$'
fast/optimizers.OptaxWrapper.optax_optimizer = @fast/optimizers.inject_hyperparams()
slow/optimizers.OptaxWrapper.optax_optimizer = @slow/optimizers.inject_hyperparams()
optimizers.inject_hyperparams.inner_factory = @optax.adamw
fast/optimizers.inject_hyperparams.hyperparams = {'learning_rate': 3e-3}
slow/optimizers.inject_hyperparams.hyperparams = {'learning_rate': 1e-4}
"""


@pytest.mark.parametrize("scales", ["frozen", "injected"])
def test_a_multi_optimizers_injected_learning_rates_are_the_ones_logged(scales, tmp_path, capsys):
  """The rates injected in a MultiOptimizer's sub-optimizers: one (the norm scales frozen)
  is read from the state, two log none; both logged the default config's adamw schedule."""
  pairs = "(@matrices/optimizers.PathFilter(), @fast/optimizers.OptaxWrapper())"
  if scales == "injected":
    pairs += ", (@scales/optimizers.PathFilter(), @slow/optimizers.OptaxWrapper())"
  gin_file = tmp_path / "multi.gin"
  gin_file.write_text(
    _INJECTED_MULTI + f"optimizers.MultiOptimizer.traversals_and_optimizers = [{pairs}]\n"
  )
  model_dir = tmp_path / "run"
  flags = [*_steps(2), "--gin_file", str(gin_file), "--metrics_every", "0"]
  flags += ["--gin_bindings", "cli.TrainJob.log_every = 1"]
  code, out, err = _train_run(model_dir, *flags, capsys=capsys)
  assert code == 0, err
  rate_line = re.search(r"^learning rate: +(.*)$", out, re.M).group(1)
  step_lines = re.findall(r"^step \d/2 .*$", out, re.M)
  rates = _scalars(model_dir / "train").get("learning_rate", [])
  if scales == "frozen":
    assert rate_line.startswith("read from the optimizer state"), out
    assert all("  lr 0.003  " in line for line in step_lines), out
    assert [rate for _, rate in rates] == pytest.approx([3e-3, 3e-3])
  else:
    assert rate_line.startswith("not logged"), out
    assert not any(" lr " in line for line in step_lines), out
    assert rates == []


def test_init_from_builds_only_the_sources_optimizer(tmp_path, capsys):
  """The source ran on 8 devices with --data at a path that is gone: neither matters."""
  text = tmp_path / "moved.txt"
  shutil.copy(_config.GIN_DIR.parent / "data" / "hamlet.txt", text)
  source = tmp_path / "source"
  flags = [*_steps(2), "--data", str(text)]
  assert _train_run(source, *flags, capsys=capsys)[0] == 0
  text.unlink()
  result = subprocess.run(
    [sys.executable, "-m", "t5x_optim_launcher", "train", *TINY, *_steps(3), "--num_devices"]
    + ["2", "--data", "hamlet.txt", "--init_from", str(source), "--model_dir"]
    + [str(tmp_path / "new")],
    cwd=REPO,
    env=_env(),
    capture_output=True,
    text=True,
    timeout=240,
    check=False,
  )
  assert result.returncode == 0, result.stderr
  assert f"init_from:       {source} at step 2" in result.stdout, result.stdout


def test_init_from_a_t5x_directory_without_config_asks_for_init_from_gin(tmp_path, capsys):
  _config.parse_config(
    gin_files=["examples/tiny.gin"],
    gin_bindings=["OPTIMIZER = @optimizers.adamw()", "optimizers.adamw.learning_rate = 0.01"],
    macros=_config.device_macros(8),
  )
  setup = _train.prepare(_config.build_job())
  t5x_dir = tmp_path / "t5x"
  t5x_optim.save_t5x_checkpoint(t5x_dir, setup.create(*setup.init_args))
  code, _, err = _train_run(
    tmp_path / "new", *_steps(2), "--init_from", str(t5x_dir), capsys=capsys
  )
  err = _one_line_error(code, err)
  assert "source_def" not in err and "source=" not in err, err
  assert err.startswith(f"t5x-optim train: error: --init_from {t5x_dir}: "), err
  assert "pass --init_from_gin with a gin file of that optimizer" in err, err


def test_init_from_gin_that_builds_no_optimizer_names_the_flag(four_steps, tmp_path, capsys):
  bad = tmp_path / "bad.gin"
  bad.write_text("OPTIMIZER = @optimizers.no_such_optimizer()\n")
  flags = [*_steps(2), "--init_from", str(four_steps), "--init_from_gin", str(bad)]
  code, _, err = _train_run(tmp_path / "new", *flags, capsys=capsys)
  err = _one_line_error(code, err)
  assert f"--init_from {four_steps}: --init_from_gin {bad}" in err, err


def test_an_8_bit_run_resumes_with_its_own_config_gin(tmp_path, capsys):
  """Its config.gin binds the defaults the run read (``low_precision.param_modes = ()``),
  which made the optimizer 'another job' than the one the run recorded; both ways resume."""
  shipped = ["--gin_file", "optimizers/adamw_8bit.gin"]
  assert _train_run(tmp_path / "a", *shipped, *_steps(1), capsys=capsys)[0] == 0
  own = ["--gin_file", str(tmp_path / "a" / "config.gin")]
  code, _, err = _train_run(tmp_path / "a", *own, *_steps(2), capsys=capsys)
  assert code == 0, err
  assert _train_run(tmp_path / "b", *own, *_steps(1), capsys=capsys)[0] == 0
  code, _, err = _train_run(tmp_path / "b", *shipped, *_steps(2), capsys=capsys)
  assert code == 0, err
