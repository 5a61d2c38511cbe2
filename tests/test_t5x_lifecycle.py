"""tools/t5x_lifecycle.py: its checkpoint reader and comparison, and (with T5X at hand) a job.

The runner's verdicts rest on `read_checkpoint` and `compare`, tested here on
checkpoints `save_t5x_checkpoint` writes in T5X's legacy layout. The job
itself (T5X's own train.py in fresh processes) runs only where a T5X git
directory (T5X_SRC) and T5X's dependencies (tensorflow, seqio, clu) are at
hand; CI has neither and skips it.
"""

from __future__ import annotations

import functools
import importlib.util
import math
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
    for p, x in jax.tree.leaves_with_path(opt.state_dict())
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


# Params named and laid out as T5X's T5 network names them, with their logical axes.
T5_PARAMS = {
  "token_embedder/embedding": ((24, 8), ("vocab", "embed")),
  "encoder/layers_0/attention/query/kernel": ((8, 8), ("embed", "joined_kv")),
  "encoder/layers_0/mlp/wi/kernel": ((8, 16), ("embed", "mlp")),
  "encoder/layers_0/pre_mlp_layer_norm/scale": ((8,), ("embed",)),
  "encoder/relpos_bias/rel_embedding": ((2, 32), ("heads", "relpos_buckets")),
  "decoder/logits_dense/kernel": ((8, 24), ("embed", "vocab")),
}


def _muon_arrays():
  """The state-dict arrays of Muon over `T5_PARAMS`, placed by their axes."""
  params, axes = {}, {}
  for path, (shape, names) in T5_PARAMS.items():
    *parents, name = path.split("/")
    p, a = params, axes
    for key in parents:
      p, a = p.setdefault(key, {}), a.setdefault(key, {})
    p[name], a[name] = jnp.ones(shape), jax.sharding.PartitionSpec(*names)
  opt = t5x_optim.optimizers.muon(learning_rate=0.02, param_axes=axes).create(params)
  flat = jax.tree.leaves_with_path(opt.state_dict())
  return {jax.tree_util.keystr(p, simple=True, separator="/"): np.asarray(x) for p, x in flat}


def test_muon_layout_checks_kernels_go_to_muon_and_the_rest_to_adam():
  ok, text = lifecycle.muon_layout(_muon_arrays())
  assert ok, text
  assert text == "Muon on 2 kernels (rank 2), Adam on 4"
  assert lifecycle.expected_branch("decoder/logits_dense/kernel") == "adam"


def test_muon_layout_refuses_optax_default():
  """Without the params' axes optax sends every 2-D param, embeddings included, to Muon."""
  muon = t5x_optim.optimizers.OptaxWrapper(optax.contrib.muon(learning_rate=0.02))
  params = {"token_embedder": {"embedding": jnp.ones((24, 8))}, "mlp": {"kernel": jnp.ones((8, 4))}}
  flat = jax.tree.leaves_with_path(muon.create(params).state_dict())
  arrays = {jax.tree_util.keystr(p, simple=True, separator="/"): np.asarray(x) for p, x in flat}
  ok, text = lifecycle.muon_layout(arrays)
  assert not ok
  assert text.endswith("misplaced 1: token_embedder/embedding: muon")


def test_muon_resume_checks_the_restart_step_and_the_uninterrupted_run():
  arrays = _muon_arrays()
  reference = lifecycle.Result(True, losses={"2": 3.0, "8": 2.0}, arrays=arrays)
  resumed = lifecycle.Result(True, losses=dict(reference.losses), arrays=arrays, first_step=4)
  lifecycle._check_resumed(resumed, reference)
  assert resumed.checks == [(True, "restarted at step 4"), (True, "= uninterrupted")]
  from_scratch = lifecycle.Result(True, losses={"2": 3.0, "8": 2.5}, arrays=arrays, first_step=0)
  lifecycle._check_resumed(from_scratch, reference)
  assert from_scratch.checks == [
    (False, "restarted at step 0"),
    (False, "loss differs (max |d| 0.5)"),
  ]
  cell = lifecycle.cell(from_scratch, None, "gin")
  assert cell == "ok loss 2.500000; FAILED restarted at step 0; FAILED loss differs (max |d| 0.5)"


@functools.cache
def _low_precision_arrays(mode, *, steps=2, grad=1.0):
  """The state-dict arrays of `tools/t5x_lifecycle.py`'s low-precision adamw over `T5_PARAMS`."""
  params = lifecycle._nested(
    {
      path: jnp.linspace(-1.0, 1.0, math.prod(shape)).reshape(shape)
      for path, (shape, _) in T5_PARAMS.items()
    }
  )
  tx = t5x_optim.low_precision(optax.adamw(0.01), mode, min_size=64)
  opt = t5x_optim.OptaxWrapper(tx).create(params)
  apply = jax.jit(lambda opt, grads: opt.apply_gradient(grads))
  for step in range(steps):
    opt = apply(opt, jax.tree.map(lambda p: grad * jnp.cos(p + step), params))
  flat = jax.tree.leaves_with_path(opt.state_dict())
  return {jax.tree_util.keystr(p, simple=True, separator="/"): np.asarray(x) for p, x in flat}


@pytest.mark.slow
@pytest.mark.parametrize(
  ("mode", "summary"),
  [
    ("8bit", "5 params 8bit, 1 params float32"),
    ("4bit", "2 params 4bit, 4 params float32"),
    ("bfloat16", "5 params bfloat16, 1 params float32"),
  ],
)
def test_low_precision_layout_reads_each_mode_from_the_checkpoint(mode, summary):
  """Params of 64 values or more are compressed where the mode has a block for them."""
  assert lifecycle.low_precision_layout(_low_precision_arrays(mode), mode) == (True, summary)


@pytest.mark.slow
def test_low_precision_layout_refuses_a_state_of_another_mode_or_kept_float32():
  arrays = dict(_low_precision_arrays("8bit"))
  ok, text = lifecycle.low_precision_layout(arrays, "4bit")
  assert not ok and text.startswith("5 params 8bit, 1 params float32; wrong ")
  kept = lifecycle.LOW_PRECISION_STATE.format("nu") + "token_embedder/embedding"
  del arrays[kept + "/codes"], arrays[kept + "/scales"]
  arrays[kept] = np.zeros((24, 8), np.float32)
  ok, text = lifecycle.low_precision_layout(arrays, "8bit")
  assert not ok
  assert text.startswith("4 params 8bit, 1 params 8bit/float32, 1 params float32; wrong 3: ")
  assert f"{kept}: float32[24, 8] (planned missing)" in text


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["8bit", "4bit", "bfloat16"])
def test_finetuning_checks_that_t5x_restored_or_dropped_the_compressed_state(mode):
  """A fine-tuned run's moments are near the resumed run's; a state started afresh is not."""
  resumed = lifecycle.Result(True, arrays=_low_precision_arrays(mode, steps=4))
  restored = lifecycle.Result(True, arrays=_low_precision_arrays(mode, steps=4, grad=1.01))
  afresh = lifecycle.Result(True, arrays=_low_precision_arrays(mode, steps=1))
  (optimizer,) = [name for name, m in lifecycle.LOW_PRECISION_MODES.items() if m == mode]
  lifecycle._check_finetuned(restored, resumed, optimizer, "finetune")
  lifecycle._check_finetuned(afresh, resumed, optimizer, "finetune")
  assert restored.checks[0][0], restored.checks
  assert not afresh.checks[0][0], afresh.checks
  dropped = lifecycle.Result(True, arrays=afresh.arrays)
  lifecycle._check_finetuned(dropped, resumed, optimizer, "finetune_fresh")
  assert dropped.checks[0][0] and dropped.checks[0][1].startswith("state afresh: moments ")


def test_first_step_is_read_from_t5x_log():
  log = "I1125 train.py:607] Starting main loop over steps 4-8\n"
  assert lifecycle._first_step(log) == 4
  assert lifecycle._first_step("no loop") is None


@pytest.mark.usefixtures("xla_optimized")
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


def _ours_only_cells(tmp_path, optimizers: str, stages: str) -> dict[tuple[str, str], str]:
  """The runner's gin-column cells of optimizers T5X cannot run, by (stage, optimizer),
  once every cell has passed its checks."""
  command = [
    sys.executable,
    str(RUNNER),
    f"--optimizers={optimizers}",
    f"--stages={stages}",
    "--columns=gin",
    f"--workdir={tmp_path}",
  ]
  proc = subprocess.run(command, capture_output=True, text=True, timeout=2400)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "SUMMARY: 0 cells of optimizers T5X cannot run fail or fail a check." in proc.stdout
  rows = [line[2:].split(" | ") for line in proc.stdout.splitlines() if line.startswith("| ")]
  return {(row[0], row[1]): row[3] for row in rows[1:]}


@pytest.mark.usefixtures("xla_optimized")
@pytest.mark.slow
@pytest.mark.skipif(not t5x_at_hand(), reason="needs T5X_SRC and T5X's dependencies")
def test_a_t5x_job_trains_resumes_and_evaluates_with_muon(tmp_path):
  """Muon through T5X's train.py and eval.py (gin swap), unscanned and scanned layers."""
  cells = _ours_only_cells(tmp_path, "muon,muon_scanned", "pretrain,resume,resume_legacy,eval")
  layouts = {
    "muon": "Muon on 36 kernels (rank 2), Adam on 16",
    "muon_scanned": "Muon on 18 kernels (rank 3/4), Adam on 11",
  }
  for optimizer, layout in layouts.items():
    assert layout in cells[("pretrain", optimizer)]
    for stage in ("resume", "resume_legacy"):
      assert "restarted at step 4; = uninterrupted" in cells[(stage, optimizer)]
    assert cells[("eval", optimizer)].startswith("ok exact_match")


@pytest.mark.usefixtures("xla_optimized")
@pytest.mark.slow
@pytest.mark.skipif(not t5x_at_hand(), reason="needs T5X_SRC and T5X's dependencies")
def test_a_t5x_job_trains_resumes_and_finetunes_with_low_precision_states(tmp_path):
  """8-bit, 4-bit and bfloat16 adam moments through T5X's train.py (gin swap)."""
  cells = _ours_only_cells(
    tmp_path,
    ",".join(lifecycle.LOW_PRECISION_MODES),
    "pretrain,resume,finetune,finetune_fresh,partitions",
  )
  for optimizer, mode in lifecycle.LOW_PRECISION_MODES.items():
    assert f"40 params {mode}, 12 params float32" in cells[("pretrain", optimizer)]
    assert "restarted at step 4; = uninterrupted" in cells[("resume", optimizer)]
    assert "; state restored: moments " in cells[("finetune", optimizer)]
    assert "; state afresh: moments " in cells[("finetune_fresh", optimizer)]
    assert cells[("partitions", optimizer)].startswith("ok loss")
    assert f"params {mode}" in cells[("partitions", optimizer)]
