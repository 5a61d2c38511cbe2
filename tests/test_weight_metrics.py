"""Per-parameter metrics (``metrics_every``): values, collectives, TensorBoard."""

from __future__ import annotations

import collections
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tensorboard.backend.event_processing import event_accumulator

from t5x_optim import low_precision, low_precision_to_float32, optimizers, partitioning
from t5x_optim.cli import main
from t5x_optim.cli.demo.model import TransformerConfig
from t5x_optim.cli.demo.text import TextTask
from t5x_optim.cli.loop import train as _train
from t5x_optim.cli.loop.config import TrainJob
from t5x_optim.cli.loop.weight_metrics import metric_vector

pytestmark = pytest.mark.usefixtures("clean_gin", "run_compilation_cache")

TINY_MODEL = TransformerConfig(
  vocab_size=256, embed_dim=32, num_heads=2, head_dim=16, mlp_dim=64, num_layers=1, max_length=8
)


def _prepare(optimizer) -> _train.Setup:
  mesh = partitioning.create_mesh(num_partitions=2)
  job = TrainJob(
    optimizer,
    partitioning.Partitioner(mesh),
    model=TINY_MODEL,
    task=TextTask(path="hamlet.txt", length=8, batch_size=8),
    total_steps=2,
    metrics_every=1,
  )
  return _train.prepare(job)


@pytest.fixture(scope="module")
def setup() -> _train.Setup:
  return _prepare(optimizers.adamw(1e-2))


def _chain(adamw) -> optimizers.OptimizerDef:
  return optimizers.chain([optax.clip_by_global_norm(1.0), adamw])


def _rms(x) -> float:
  x = np.asarray(x, np.float64)
  return float(np.sqrt(np.mean(np.square(x))))


@pytest.mark.slow
def test_metrics_equal_the_rms_of_the_gathered_arrays(setup):
  state = setup.create(*setup.init_args)
  old = jax.device_get(state.params)
  new_state, metrics = setup.weights_step_fn(state, setup.train_batch(0))
  values = dict(zip(setup.weight_tags, jax.device_get(metrics["weights"]).tolist(), strict=True))
  new = jax.device_get(new_state.params)
  states = jax.device_get(new_state.param_states)
  wi = ("layers_0", "mlp", "wi")

  def pick(tree):
    for key in wi:
      tree = tree[key]
    return tree

  np.testing.assert_allclose(values["weight_rms/layers_0/mlp/wi"], _rms(pick(new)), rtol=1e-5)
  np.testing.assert_allclose(
    values["weight_update_rms/layers_0/mlp/wi"], _rms(pick(new) - pick(old)), rtol=1e-4
  )
  np.testing.assert_allclose(
    values["optimizer_state_rms/mu/layers_0/mlp/wi"], _rms(pick(states[0].mu)), rtol=1e-5
  )
  # Adam's first moment after one step is (1 - b1) * gradient.
  np.testing.assert_allclose(
    values["weight_gradient_rms/layers_0/mlp/wi"] * 0.1, _rms(pick(states[0].mu)), rtol=1e-4
  )
  # Three per param, and Adam's mu and nu.
  assert len(values) == 5 * len(jax.tree.leaves(new)) and all(v > 0 for v in values.values())


def _collectives(fn, setup) -> dict[str, int]:
  batch = _train.abstract_batch(setup.job.task)
  text = fn.lower(setup.abstract_state, batch).compile().as_text()
  ops = r"all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all"
  return collections.Counter(re.findall(rf"= \S+ ({ops})(?:-start)?\(", text))


@pytest.mark.slow
def test_metrics_add_one_all_reduce_and_gather_nothing(setup):
  plain = _collectives(setup.step_fn, setup)
  with_metrics = _collectives(setup.weights_step_fn, setup)
  assert with_metrics == {**plain, "all-reduce": plain["all-reduce"] + 1}


@pytest.mark.slow
def test_metrics_are_written_under_train_every_n_steps(tmp_path, capsys):
  model_dir = tmp_path / "run"
  argv = ["train", "--gin_file", "examples/tiny.gin", "--data", "hamlet.txt"]
  argv += ["--metrics_every", "15", "--model_dir", str(model_dir)]
  assert main(argv) == 0
  capsys.readouterr()
  accumulator = event_accumulator.EventAccumulator(str(model_dir / "train"))
  accumulator.Reload()
  tags = set(accumulator.Tags()["scalars"])
  prefixes = ("weight_rms", "weight_gradient_rms", "weight_update_rms")
  for prefix in prefixes:
    assert f"{prefix}/layers_0/attention/query" in tags
    assert f"{prefix}/token_embedding" in tags
  assert {"optimizer_state_rms/mu/logits", "optimizer_state_rms/nu/logits", "loss"} <= tags
  steps = [event.step for event in accumulator.Scalars("weight_update_rms/logits")]
  assert steps == [15, 30]
  assert all(event.value > 0 for event in accumulator.Scalars("weight_rms/logits"))


@pytest.mark.slow
def test_metrics_of_a_low_precision_state_are_those_of_the_values_it_stores():
  """Under the float32 state's tags, the RMS of the moments, not of codes and scales."""
  stored = _prepare(_chain(low_precision(optax.adamw(1e-2), "8bit", min_size=0)))
  state = stored.create(*stored.init_args)
  new_state, metrics = stored.weights_step_fn(state, stored.train_batch(0))
  values = dict(zip(stored.weight_tags, jax.device_get(metrics["weights"]).tolist(), strict=True))
  assert stored.weight_tags == _prepare(_chain(optax.adamw(1e-2))).weight_tags
  moments = low_precision_to_float32(new_state.param_states)[1][0]
  for name in ("mu", "nu"):
    for path, leaf in jax.tree.flatten_with_path(getattr(moments, name))[0]:
      tag = f"optimizer_state_rms/{name}/" + jax.tree_util.keystr(path, simple=True, separator="/")
      np.testing.assert_allclose(values[tag], _rms(leaf), rtol=1e-5, err_msg=tag)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["8bit", "4bit"])
def test_metrics_of_a_sharded_low_precision_state_gather_nothing(mode):
  """The metrics alone, jitted on the command's 2 x 4 mesh: each device decodes its own
  shards of the codes and scales (all-reduces, no all-gather)."""
  stored = _prepare(_chain(low_precision(optax.adamw(1e-2), mode, min_size=0)))
  state = stored.abstract_state
  shardings = stored.job.partitioner.get_shardings(state)
  fn = functools.partial(
    metric_vector, param_shardings=shardings.params, state_shardings=shardings.param_states
  )
  text = jax.jit(fn).lower(state.params, state.params, state.params, state.param_states)
  ops = collections.Counter(re.findall(r"= \S+ (all-\w+)(?:-start)?\(", text.compile().as_text()))
  assert ops["all-reduce"] > 0 and set(ops) == {"all-reduce"}, ops


def test_metrics_of_an_8bit_state_hold_no_float32_copy_of_it():
  """Jitted alone on a (4096, 1024) param: one chunk of 2**20 values in float32 (4 MiB),
  not Adam's moments whole (32 MiB)."""
  tx = low_precision(optax.adam(1e-3), "8bit")
  params = {"w": jax.ShapeDtypeStruct((4096, 1024), jnp.float32)}
  states = (jax.eval_shape(tx.init, params),)
  compiled = jax.jit(metric_vector).lower(params, params, params, states).compile()
  assert compiled.memory_analysis().temp_size_in_bytes <= 5 << 20
