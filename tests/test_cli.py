"""`t5x-optim train` and `t5x-optim plan`, end to end."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from t5x_optim.cli import _config, _train, main
from t5x_optim.partitioning import init_sharded

pytestmark = pytest.mark.usefixtures("clean_gin")

REPO = Path(__file__).resolve().parents[1]
TINY = ["--gin_file", "examples/tiny.gin"]
ADAFACTOR = [*TINY, "--gin_file", "optimizers/adafactor.gin"]
TIMEOUT = 240


def _run(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  return subprocess.run([sys.executable, "-m", "t5x_optim", *args], cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=TIMEOUT, check=False)


def _losses(stdout: str) -> tuple[float, float]:
  first, final = re.search(r"^loss (\S+) -> (\S+)$", stdout, re.M).groups()
  return float(first), float(final)


def _steps(stdout: str) -> tuple[int, int]:
  start, end = re.search(r"^steps (\d+) -> (\d+) ", stdout, re.M).groups()
  return int(start), int(end)


def _checkpoint_steps(model_dir: Path) -> list[int]:
  return sorted(int(p.name) for p in (model_dir / "checkpoints").iterdir() if p.name.isdigit())


def test_train_learns_checkpoints_and_resumes(tmp_path, capsys):
  first = _run("train", *TINY, "--model_dir", str(tmp_path))
  assert first.returncode == 0, first.stderr
  assert _steps(first.stdout) == (0, 40)
  start_loss, end_loss = _losses(first.stdout)
  assert end_loss < start_loss - 0.3
  assert "step 40/40  loss" in first.stderr and "steps/s" in first.stderr
  assert re.search(r"optimizer state: [\d.]+ \w+ per device", first.stdout)
  assert _checkpoint_steps(tmp_path) == [20, 40]

  assert main(["train", *TINY, "--model_dir", str(tmp_path)]) == 2
  assert "already holds checkpoints up to step 40: pass --resume" in capsys.readouterr().err

  resumed = _run("train", *TINY, "--model_dir", str(tmp_path), "--resume",
                 "--gin_bindings", "TOTAL_STEPS = 50")
  assert resumed.returncode == 0, resumed.stderr
  assert _steps(resumed.stdout) == (40, 50)
  assert _losses(resumed.stdout)[0] < start_loss - 0.3
  assert _checkpoint_steps(tmp_path)[-1] == 50


def test_resume_with_another_optimizer_is_a_clear_error(tmp_path, capsys):
  assert main(["train", *TINY, "--model_dir", str(tmp_path),
               "--gin_bindings", "TOTAL_STEPS = 8"]) == 0
  capsys.readouterr()
  assert main(["train", *TINY, "--gin_file", "optimizers/lion.gin", "--model_dir",
               str(tmp_path), "--resume", "--gin_bindings", "TOTAL_STEPS = 10"]) == 2
  err = capsys.readouterr().err
  assert "--resume: Checkpoint step 8" in err and "does not fit the target" in err
  assert "Traceback" not in err


def test_ctrl_c_saves_and_exits_cleanly(tmp_path):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  process = subprocess.Popen(
      [sys.executable, "-m", "t5x_optim", "train", *TINY, "--model_dir", str(tmp_path),
       "--gin_bindings", "TOTAL_STEPS = 100000", "--gin_bindings",
       "cli.TrainJob.checkpoint_every = 100000"],
      cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    for line in process.stderr:
      if line.startswith("step "):
        process.send_signal(signal.SIGINT)
        break
    stdout, stderr = process.communicate(timeout=TIMEOUT)
  finally:
    process.kill()
  assert process.returncode == 130, stderr
  assert "Traceback" not in stderr
  stopped = int(re.search(r"^interrupted at step (\d+)$", stdout, re.M).group(1))
  assert _checkpoint_steps(tmp_path) == [stopped]


def test_resume_without_checkpoint_is_a_clear_error(tmp_path, capsys):
  assert main(["train", *TINY, "--model_dir", str(tmp_path), "--resume"]) == 2
  assert "--resume: no checkpoint in" in capsys.readouterr().err


def test_plan_shows_factored_leaves_with_dropped_dims():
  result = _run("plan", *ADAFACTOR, "--warn_replicated_bytes", "1024")
  assert result.returncode == 0, result.stderr
  out = result.stdout
  assert "mesh data=4 x model=2 (8 devices)" in out
  row = next(line for line in out.splitlines() if "0/v_row/layers_0/mlp/wi " in line)
  assert re.search(r"\(32,\)\s+float32\s+\(embed\)\s+replicated\s+128 B\s+"
                   r"factored: drops mlp of \(32, 64\)", row)
  col = next(line for line in out.splitlines() if "0/v_col/layers_0/mlp/wi " in line)
  assert re.search(r"\(64,\)\s+float32\s+\(mlp\)\s+\(model\)\s+128 B\s+factored: drops embed", col)
  assert "[0/v_row]" in out and "[0/v_col]" in out and "per device:" in out
  assert "warnings (" in out and "replicated on all 8 devices" in out


def _state_bytes(state) -> tuple[int, int, dict[str, tuple[list[int], str, int]]]:
  per_device = total = 0
  leaves = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(state.param_states):
    shard = leaf.addressable_shards[0].data.nbytes
    per_device += shard
    total += leaf.nbytes
    key = "/".join(str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k)))) for k in path)
    leaves[key] = (list(leaf.shape), leaf.dtype.name, shard)
  return per_device, total, leaves


@pytest.mark.parametrize("extra", [[], ["--gin_file", "partitioning/zero.gin"]],
                         ids=["1d", "zero"])
def test_plan_json_matches_a_real_init(extra, capsys):
  assert main(["plan", *ADAFACTOR, *extra, "--format", "json"]) == 0
  plan = json.loads(capsys.readouterr().out)
  _config.parse_config(gin_files=[*ADAFACTOR[1::2], *extra[1::2]])
  setup = _train.prepare(_config.build_job())
  job = setup.job
  state = init_sharded(job.partitioner, job.optimizer, setup.model.init, *setup.init_args)
  per_device, total, leaves = _state_bytes(state)
  assert plan["totals"]["bytes_per_device"] == per_device
  assert plan["totals"]["total_bytes"] == total
  assert plan["num_devices"] == 8 and plan["mesh"] == {"data": 4, "model": 2}
  assert {leaf["path"]: (leaf["shape"], leaf["dtype"], leaf["bytes_per_device"])
          for leaf in plan["leaves"]} == leaves
  factored = [leaf for leaf in plan["leaves"] if leaf["dropped_axes"]]
  assert {leaf["group"] for leaf in factored} == {"0/v_row", "0/v_col"}


BAD_CONFIGS = {
    "unknown_name": (["--gin_bindings", "optax.adamww.learning_rate = 1.0"],
                     "adamww"),
    "unknown_parameter": (["--gin_bindings", "cli.TrainJob.total_stepz = 3"],
                          "total_stepz"),
    "wrong_type": (["--gin_bindings", "cli.TrainJob.total_steps = 'ten'"],
                   "TrainJob.total_steps must be an int >= 1, got 'ten' (str)"),
    "optax_not_optimizer_def": (["--gin_bindings", "OPTIMIZER = @optax.adam()",
                                 "--gin_bindings", "optax.adam.learning_rate = 0.1"],
                                "optimizer is an optax GradientTransformation, not an OptimizerDef"),
    "wrong_hyperparameter_type": (["--gin_bindings", "optax.adamw.learning_rate = 'fast'"],
                                  "Tracing one train step failed, so the optimizer is misconfigured"),
    "missing_file": (["--gin_file", "optimizers/nope.gin"], "gin file 'optimizers/nope.gin' not found"),
    "vocab_mismatch": (["--gin_bindings", "cli.SyntheticTask.vocab_size = 7"],
                       "TransformerConfig.vocab_size=32 differs from SyntheticTask.vocab_size=7"),
}


@pytest.mark.parametrize("command", ["train", "plan"])
@pytest.mark.parametrize("name", sorted(BAD_CONFIGS))
def test_bad_config_is_one_clear_error(name, command, capsys, tmp_path):
  flags, message = BAD_CONFIGS[name]
  extra = ["--model_dir", str(tmp_path)] if command == "train" else []
  assert main([command, *flags, *extra]) == 2
  err = capsys.readouterr().err
  assert err.startswith(f"t5x-optim {command}: error: ")
  assert message in err
  assert "Traceback" not in err
  assert not (tmp_path / "checkpoints").exists()


def test_bad_gin_in_a_subprocess_exits_without_traceback():
  result = _run("train", "--gin_bindings", "optax.adamww.learning_rate = 1.0")
  assert result.returncode == 2
  assert "Traceback" not in result.stderr
  assert "adamww" in result.stderr and len(result.stderr.splitlines()) < 6
