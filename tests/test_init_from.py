"""`t5x-optim train --init_from DIR`: a new run from another run's checkpoint, another optimizer."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from t5x_optim import Checkpointer
from t5x_optim.cli import _config, _init_from, _train, main

pytestmark = pytest.mark.usefixtures("clean_gin")

TINY = ["--gin_file", "examples/tiny.gin"]
ADAFACTOR = [*TINY, "--gin_file", "optimizers/adafactor.gin"]


def _params(model_dir, flags):
  _config.parse_config(gin_files=flags[1::2], macros=_config.device_macros(8))
  setup = _train.prepare(_config.build_job())
  with Checkpointer(model_dir / "checkpoints") as checkpointer:
    step = checkpointer.latest_step()
    return step, checkpointer.restore(setup.abstract_state, step)


@pytest.mark.slow
@pytest.mark.parametrize("source_flags", [[], ["--init_from_gin", "optimizers/adafactor.gin"]])
def test_init_from_converts_another_runs_adafactor_state_into_adamw(source_flags, tmp_path, capsys):
  old_dir, new_dir = tmp_path / "old", tmp_path / "new"
  adafactor = [*TINY, "--gin_file", "optimizers/adafactor.gin"]
  assert (
    main(["train", *adafactor, "--gin_bindings", "TOTAL_STEPS = 3", "--model_dir", str(old_dir)])
    == 0
  )
  capsys.readouterr()
  flags = ["--init_from", str(old_dir), *source_flags, "--model_dir", str(new_dir)]
  adamw = [*TINY, "--gin_file", "optimizers/adamw.gin"]
  assert main(["train", *adamw, "--gin_bindings", "TOTAL_STEPS = 5", *flags]) == 0
  out = capsys.readouterr().out
  assert f"init_from:       {old_dir} at step 3" in out
  # The new optimizer's b1 and b2 come from its gin file (optimizers/adamw.gin binds them).
  assert (
    "hparams: old learning_rate=a schedule, multiply_by_parameter_scale=False, "
    "new b1=0.9, b2=0.98, learning_rate=a schedule\n"
  ) in out, out
  assert re.search(r"ScaleByAdamState\)\.nu: \d+ params, from 0 \(FactoredState\)", out), out
  assert re.search(r"^steps 3 -> 5,", out, re.M), out
  step, old = _params(old_dir, ADAFACTOR)
  assert step == 3
  # The new run's first checkpoint is its last step; its adamw count went on from 3.
  _, new = _params(new_dir, TINY)
  assert int(new.param_states[1][0].count) == 5
  assert jax.tree.structure(new.params) == jax.tree.structure(old.params)
  assert not all(
    np.array_equal(a, b) for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(old.params))
  )  # it trained on from there


def test_bound_hparams_evaluate_macros_and_schedules():
  """adafactor.gin binds learning_rate = %LEARNING_RATE = @optax.linear_schedule()."""
  _config.parse_config(
    gin_files=["optimizers/adafactor.gin"],
    gin_bindings=["TOTAL_STEPS = 10", "B1 = 0.8", "optax.adamw.b1 = %B1"],
    macros=_config.device_macros(8),
  )
  hparams = _init_from.bound_hparams()
  assert sorted(hparams) == ["b1", "learning_rate", "multiply_by_parameter_scale"]
  assert hparams["b1"] == 0.8 and hparams["multiply_by_parameter_scale"] is False
  np.testing.assert_allclose([hparams["learning_rate"](s) for s in (0, 10)], [1e-2, 1e-3])


@pytest.mark.slow
def test_init_from_a_directory_without_checkpoints_is_one_line(tmp_path, capsys):
  assert (
    main(["train", *TINY, "--init_from", str(tmp_path), "--model_dir", str(tmp_path / "new")]) == 2
  )
  assert "holds no T5X checkpoint; pass source=" in capsys.readouterr().err
  assert not (tmp_path / "new" / "checkpoints").exists() or not any(
    (tmp_path / "new" / "checkpoints").iterdir()
  )
