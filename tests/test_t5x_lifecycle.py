"""tools/t5x_lifecycle.py: its checkpoint reader and comparison, and (with T5X at hand) a job.

The runner's verdicts rest on `read_checkpoint` and `compare`, tested here on
checkpoints `save_t5x_checkpoint` writes in T5X's legacy layout. The job
itself (T5X's own train.py in fresh processes) runs only where a T5X git
directory (T5X_SRC) and T5X's dependencies (tensorflow, seqio, clu) are at
hand; CI has neither and skips it.
"""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _t5x import t5x_at_hand

import t5x_optim

RUNNER = pathlib.Path(__file__).parents[1] / "tools" / "t5x_lifecycle.py"


def _load_runner():
  spec = importlib.util.spec_from_file_location("t5x_lifecycle", RUNNER)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses look their module up there
  spec.loader.exec_module(module)
  return module


lifecycle = _load_runner()


def _checkpoint(tmp_path, name, *, lr=0.1, steps=2, float_count=False):
  params = {"dense": {"kernel": jnp.arange(6.0).reshape(2, 3), "bias": jnp.ones(3)}}
  opt = t5x_optim.OptaxWrapper(optax.adam(lr)).create(params)
  for _ in range(steps):
    opt = opt.apply_gradient(jax.tree.map(jnp.ones_like, params))
  if float_count:
    state = opt.state.param_states
    count = state[0].count.astype(jnp.float32)
    opt = opt.replace(
      state=opt.state.replace(param_states=(state[0]._replace(count=count),) + state[1:])
    )
  t5x_optim.save_t5x_checkpoint(tmp_path / name, opt)
  return opt, str(tmp_path / name)


def _result(model_dir, losses):
  result = lifecycle.Result(True, losses=losses)
  result.arrays = lifecycle.read_checkpoint(model_dir)
  return result


def test_read_checkpoint_gives_every_array_of_the_latest_step(tmp_path):
  opt, model_dir = _checkpoint(tmp_path, "a")
  arrays = lifecycle.read_checkpoint(model_dir)
  expected = {
    jax.tree_util.keystr(p, simple=True, separator="/"): np.asarray(x)
    for p, x in jax.tree_util.tree_leaves_with_path(opt.state_dict())
  }
  assert sorted(arrays) == sorted(expected)
  for path, value in expected.items():
    np.testing.assert_array_equal(arrays[path], value)
    assert arrays[path].dtype == value.dtype


def test_compare_is_bit_exact(tmp_path):
  _, a = _checkpoint(tmp_path, "a")
  _, same = _checkpoint(tmp_path, "same")
  _, other = _checkpoint(tmp_path, "other", lr=0.1 + 1e-7)
  losses = {"2": 1.5}
  assert lifecycle.compare(_result(same, losses), _result(a, losses)) == "= t5x"
  assert lifecycle.compare(_result(a, {"2": 1.5000001}), _result(a, losses)).startswith(
    "loss differs"
  )
  differs = lifecycle.compare(_result(other, losses), _result(a, losses))
  assert differs.startswith("checkpoint differs (max |d|") and "target/dense" in differs


def test_compare_accepts_integer_counters_where_t5x_drifted_to_float32(tmp_path):
  _, ours = _checkpoint(tmp_path, "ours")
  _, t5x = _checkpoint(tmp_path, "t5x", float_count=True)
  verdict = lifecycle.compare(_result(ours, {}), _result(t5x, {}))
  assert verdict == "= t5x (1 int32 counters where T5X's are float32)"
  # Not the other way round: a float where T5X keeps an integer is a difference.
  assert "float32[] vs int32[]" in lifecycle.compare(_result(t5x, {}), _result(ours, {}))


def test_compare_explains_a_step_t5x_restored_in_bfloat16():
  ours = lifecycle.Result(True, losses={"8": 2.0}, arrays={"state/step": np.int32(8)})
  t5x = lifecycle.Result(
    True, losses={"8": 2.5}, arrays={"state/step": np.asarray(8, jnp.bfloat16)}
  )
  assert lifecycle.compare(ours, t5x).startswith("explained: T5X's step is bfloat16, ours int32")
  # Any other loss difference is one.
  t5x.arrays["state/step"] = np.int32(8)
  assert lifecycle.compare(ours, t5x) == "loss differs (max |d| 0.5)"


@pytest.mark.slow
@pytest.mark.skipif(not t5x_at_hand(), reason="needs T5X_SRC and T5X's dependencies")
def test_a_t5x_job_resumes_with_our_optimizers(tmp_path):
  command = [
    sys.executable,
    str(RUNNER),
    "--optimizers=adamw,legacy_adafactor",
    "--stages=pretrain,resume",
    f"--workdir={tmp_path}",
  ]
  proc = subprocess.run(command, capture_output=True, text=True, timeout=1800)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "SUMMARY: 0 cells" in proc.stdout
