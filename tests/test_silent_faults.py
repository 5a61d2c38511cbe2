"""No restore or save hands back a silently wrong state.

Each test is one way a careful user reached a wrong result without an
error: frozen params in T5X's per-param MultiOptimizer layout, integers
narrowed on their way to the devices, abstract stacked targets restored
onto one device, another optimizer's checkpoint restored because its keys
match, step numbers that are not non-negative integers, logical names
handed to the mesh, and missing array files read as zeros. Sharded cases
run on the 8 simulated CPU devices of conftest.py.
"""

from __future__ import annotations

import os
import re
from typing import Any, NamedTuple

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import struct, traverse_util
from flax.core import FrozenDict
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from t5x_optim import (
  CheckpointError,
  MultiOptimizer,
  OptaxWrapper,
  OptimizerDef,
  OptimizerState,
  restore_t5x_checkpoint,
  save_t5x_checkpoint,
  stack_params,
)
from t5x_optim._checkpoint.checksums import dispatch_checksums, fetch, x64_words
from t5x_optim.checkpoints import Checkpointer
from t5x_optim.partitioning import (
  Partitioner,
  create_mesh,
  init_sharded,
  standard_logical_axis_rules,
)


@struct.dataclass
class _HyperParams:
  learning_rate: float = 0.1


@struct.dataclass
class _ParamState:
  momentum: jax.Array


class PerParamMomentum(OptimizerDef):
  """A T5X-style legacy definition: one state subtree per param."""

  def __init__(self, learning_rate: float = 0.1):
    super().__init__(_HyperParams(learning_rate))

  def init_state(self, params: Any) -> OptimizerState:
    states = jax.tree.map(lambda p: _ParamState(jnp.zeros_like(p)), params)
    return OptimizerState(jnp.asarray(0, jnp.int32), states)

  def apply_gradient(self, hyper_params, params, state, grads):
    momentum = jax.tree.map(lambda g, s: 0.9 * s.momentum + g, grads, state.param_states)
    new_params = jax.tree.map(lambda p, m: p - hyper_params.learning_rate * m, params, momentum)
    states = jax.tree.map(_ParamState, momentum)
    return new_params, OptimizerState(state.step + 1, states)


def _mesh() -> Mesh:
  return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))


def _params(container: type = dict) -> Any:
  params = {
    "dense": {"kernel": jnp.arange(32.0).reshape(4, 8), "bias": jnp.ones(8)},
    "norm": {"scale": jnp.full(8, 2.0)},
  }
  return FrozenDict(params) if container is FrozenDict else params


def _stepped(opt: Any) -> Any:
  return opt.apply_gradient(jax.tree.map(lambda p: jnp.full_like(p, 0.5), opt.target))


def _same(a: Any, b: Any) -> bool:
  leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(leaves_a) == len(leaves_b) and all(
    np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(leaves_a, leaves_b)
  )


def _abstract(tree: Any) -> Any:
  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree
  )


def _checkpointer_round_trip(tmp_path, opt, target):
  with Checkpointer(tmp_path / "ckpt", async_save=False) as ckpt:
    ckpt.save(1, opt)
    return ckpt.restore(target)


def _t5x_round_trip(tmp_path, opt, target):
  save_t5x_checkpoint(tmp_path / "t5x", opt, step=1)
  return restore_t5x_checkpoint(tmp_path / "t5x", target)


ROUND_TRIPS = {"checkpointer": _checkpointer_round_trip, "t5x_legacy": _t5x_round_trip}


# ---------------------------------------------------------------- frozen params


def _frozen_multi() -> MultiOptimizer:
  return MultiOptimizer([("dense/kernel", PerParamMomentum(0.1)), ("bias", PerParamMomentum(0.2))])


@pytest.mark.parametrize("container", [dict, FrozenDict], ids=["dict", "frozendict"])
@pytest.mark.parametrize("abstract", [False, True], ids=["real", "abstract"])
@pytest.mark.parametrize("round_trip", list(ROUND_TRIPS), ids=list(ROUND_TRIPS))
def test_frozen_params_of_the_per_param_layout_round_trip(
  tmp_path, round_trip, abstract, container
):
  opt = _stepped(_frozen_multi().create(_params(container)))
  flat = traverse_util.flatten_dict(opt.state_dict(), sep="/")
  assert flat["state/param_states/norm/scale"] is None
  template = _frozen_multi().create(_params(container))
  target = template.replace(state=_abstract(template.state)) if abstract else template
  restored = ROUND_TRIPS[round_trip](tmp_path, opt, target)
  assert _same(restored, opt)


def test_a_t5x_legacy_checkpoint_keeps_frozen_params_as_none(tmp_path):
  """T5X's own legacy checkpointer writes nil for a frozen param's state; so do we."""
  opt = _stepped(_frozen_multi().create(_params()))
  step_dir = save_t5x_checkpoint(tmp_path, opt, step=1)
  with open(os.path.join(step_dir, "checkpoint"), "rb") as f:
    contents = flax.serialization.msgpack_restore(f.read())
  assert contents["optimizer"]["state"]["param_states"]["norm"] == {"scale": None}


def test_a_t5x_orbax_checkpoint_with_frozen_params_restores(tmp_path):
  """T5X's Orbax format: an orbax PyTree of the state dict, None where params are frozen."""
  opt = _stepped(_frozen_multi().create(_params()))
  _save_t5x_orbax(tmp_path, opt)
  assert _same(restore_t5x_checkpoint(tmp_path, _frozen_multi().create(_params())), opt)


@pytest.mark.parametrize("names", [("0", "1"), ("a", "b")], ids=["digits", "letters"])
def test_the_state_dict_layout_does_not_depend_on_param_names(tmp_path, names):
  """optax sub-optimizers keep the indexed layout, whatever the params are called."""
  params = {names[0]: jnp.ones(4), names[1]: jnp.full(4, 2.0)}
  opt_def = MultiOptimizer([(f"^{names[0]}$", OptaxWrapper(optax.adam(0.1)))])
  opt = _stepped(opt_def.create(params))
  flat = traverse_util.flatten_dict(opt.state_dict(), sep="/")
  assert f"state/param_states/0/param_states/0/mu/{names[0]}" in flat
  for round_trip in ROUND_TRIPS.values():
    restored = round_trip(tmp_path / round_trip.__name__, opt, opt_def.create(params))
    assert _same(restored, opt)


# ---------------------------------------------------------------- integer ranges


def _with_step(opt: Any, step: Any) -> Any:
  return opt.replace(state=opt.state.replace(step=step))


def _replicated(opt: Any) -> Any:
  return jax.device_put(opt, NamedSharding(_mesh(), P()))


def _save_t5x_orbax(tmp_path, opt):
  ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).save(
    tmp_path / "checkpoint_1" / "state", jax.tree.map(np.asarray, opt.state_dict())
  )


def _restore_t5x(tmp_path, target):
  return restore_t5x_checkpoint(tmp_path, target)


def _restore_checkpointer(tmp_path, target):
  with Checkpointer(tmp_path, async_save=False) as ckpt:
    return ckpt.restore(target)


def _save_checkpointer(tmp_path, opt):
  with Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(1, opt)


WRITERS = {
  "checkpointer": (_save_checkpointer, _restore_checkpointer),
  "t5x_legacy": (lambda path, opt: save_t5x_checkpoint(path, opt, step=1), _restore_t5x),
  "t5x_orbax": (_save_t5x_orbax, _restore_t5x),
}


@pytest.mark.parametrize("value", [2**32 + 3, -(2**33)], ids=["above", "below"])
@pytest.mark.parametrize("abstract", [False, True], ids=["real", "abstract"])
@pytest.mark.parametrize("writer", list(WRITERS), ids=list(WRITERS))
def test_an_integer_out_of_the_targets_range_is_refused(tmp_path, writer, abstract, value):
  opt = optax_opt()
  save, restore = WRITERS[writer]
  save(tmp_path, _with_step(opt, np.int64(value)))
  target = _replicated(opt)
  if abstract:
    target = _abstract(target)
  with pytest.raises(ValueError, match=r"state/step.*whole numbers? .*int32|int32.*state/step"):
    restore(tmp_path, target)


@pytest.mark.parametrize("writer", list(WRITERS), ids=list(WRITERS))
def test_an_integer_in_range_restores_into_a_sharded_target(tmp_path, writer):
  opt = optax_opt()
  save, restore = WRITERS[writer]
  save(tmp_path, _with_step(opt, np.int64(2**31 - 1)))
  restored = restore(tmp_path, _abstract(_replicated(opt)))
  assert restored.state.step.dtype == jnp.int32 and int(restored.state.step) == 2**31 - 1
  assert restored.state.step.sharding == NamedSharding(_mesh(), P())


def optax_opt() -> Any:
  return OptaxWrapper(optax.adam(0.1)).create({"w": jnp.ones((4, 8))})


# ---------------------------------------------------------------- stacked shardings


def _stacked_sharded():
  params = {"a": jnp.ones((4, 8)), "b": jnp.full((4, 8), 2.0)}
  opt = _stepped(OptaxWrapper(optax.adam(0.1)).create(stack_params(params)))
  sharding = NamedSharding(_mesh(), P(None, None, "model"))
  scalar = NamedSharding(_mesh(), P())
  return jax.tree.map(lambda x: jax.device_put(x, sharding if x.ndim == 3 else scalar), opt)


@pytest.mark.parametrize("round_trip", list(ROUND_TRIPS), ids=list(ROUND_TRIPS))
@pytest.mark.slow
def test_an_abstract_stacked_target_keeps_its_shardings(tmp_path, round_trip):
  opt = _stacked_sharded()
  restored = ROUND_TRIPS[round_trip](tmp_path, opt, _abstract(opt))
  assert _same(restored, opt)
  assert jax.tree.map(lambda x: x.sharding, restored) == jax.tree.map(lambda x: x.sharding, opt)


# ---------------------------------------------------------------- which optimizer wrote it


def test_a_checkpoint_of_another_optimizer_with_the_same_keys_is_refused(tmp_path):
  params = {"w": jnp.ones((4, 8))}
  adam = _stepped(OptaxWrapper(optax.adam(0.1)).create(params))
  adabelief = OptaxWrapper(optax.adabelief(0.1)).create(params)
  assert adam.state_dict().keys() == adabelief.state_dict().keys()
  with Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(1, adam)
    with pytest.raises(ValueError, match=r"ScaleByAdamState.*ScaleByBeliefState"):
      ckpt.restore(adabelief)
    # Switching optimizers on purpose restores the params only.
    restored = ckpt.restore(adabelief, params_only=True)
  assert _same(restored.target, adam.target)


# ---------------------------------------------------------------- step numbers


@pytest.mark.parametrize("step", [-1, 2.9, True, "3", np.float32(2.0)])
def test_a_step_that_is_not_a_non_negative_integer_is_refused(tmp_path, step):
  opt = optax_opt()
  with Checkpointer(tmp_path / "ckpt", async_save=False) as ckpt:
    with pytest.raises(ValueError, match="non-negative integer"):
      ckpt.save(step, opt)
  assert not any((tmp_path / "ckpt").iterdir()) or sorted(
    p.name for p in (tmp_path / "ckpt").iterdir()
  ) == [".t5x_optim.lock"]
  with pytest.raises(ValueError, match="non-negative integer"):
    save_t5x_checkpoint(tmp_path / "t5x", opt, step=step)
  assert not (tmp_path / "t5x").exists() or not any((tmp_path / "t5x").iterdir())


@pytest.mark.parametrize("step", [0, 3, np.int64(4), jnp.int32(5)])
def test_integer_steps_are_taken(tmp_path, step):
  with Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(step, optax_opt())
    assert ckpt.all_steps() == [int(step)]


@pytest.mark.parametrize("step", [2.9, -1, "2"])
def test_a_restore_of_a_step_that_is_not_a_non_negative_integer_is_refused(tmp_path, step):
  opt = optax_opt()
  with Checkpointer(tmp_path / "ckpt", async_save=False) as ckpt:
    ckpt.save(2, opt)
    with pytest.raises(ValueError, match="non-negative integer"):
      ckpt.restore(opt, step=step)
  save_t5x_checkpoint(tmp_path / "t5x", opt, step=2)
  with pytest.raises(ValueError, match="non-negative integer"):
    restore_t5x_checkpoint(tmp_path / "t5x", opt, step=step)


# ---------------------------------------------------------------- spec derivation


class _FlatState(NamedTuple):
  flat: Any
  history: Any


def _flattening(history: int = 3) -> optax.GradientTransformation:
  """A user-defined state: each param flattened, and a small history buffer."""

  def init(params):
    return _FlatState(jax.tree.map(lambda p: p.reshape(-1), params), jnp.zeros(history))

  return optax.GradientTransformation(init, lambda updates, state, params=None: (updates, state))


def _logically_partitioned() -> dict[str, Any]:
  kernel = nn.LogicallyPartitioned(jnp.ones((16, 32)), ("embed", "mlp"))
  return {"params": {"dense": {"kernel": kernel}}}


@pytest.mark.parametrize(
  ("rules", "flat_spec"),
  [
    ((("embed", "model"), ("mlp", "data")), P("model")),
    (standard_logical_axis_rules(shard_optimizer_state_over_data=True), P("data")),
  ],
  ids=["embed_on_model", "zero"],
)
def test_a_flattened_param_gets_a_spec_the_mesh_takes(rules, flat_spec):
  """The merged dimension is sharded as the kernel's major (first) dimension."""
  mesh = create_mesh(shape={"data": 2, "model": 4})
  state = init_sharded(
    Partitioner(mesh, rules), OptaxWrapper(_flattening()), _logically_partitioned
  )
  flat = state.optimizer.state.param_states.flat["dense"]["kernel"]
  np.testing.assert_array_equal(np.asarray(flat), np.ones(16 * 32))
  assert flat.sharding.spec == flat_spec


def test_one_leaf_without_a_traced_spec_leaves_the_others_theirs():
  params = {"w": jnp.ones((4, 8))}
  opt_def = OptaxWrapper(_flattening(), fallback="replicate_with_warning")
  opt = opt_def.create(params)
  # The state's history has grown since init: tracing init gives it another shape.
  opt = opt.replace(
    state=opt.state.replace(param_states=opt.state.param_states._replace(history=jnp.zeros(5)))
  )
  with pytest.warns(UserWarning, match="history"):
    axes = opt_def.derive_logical_axes(opt, {"w": P("embed", "mlp")}).state.param_states
  assert axes.flat == {"w": P("embed")} and axes.history is None


# ---------------------------------------------------------------- missing chunk files


def test_a_legacy_t5x_checkpoint_missing_a_chunk_file_is_refused(tmp_path):
  opt = _stepped(optax_opt())
  step_dir = save_t5x_checkpoint(tmp_path, opt, step=1)
  array_dir = os.path.join(step_dir, "state.param_states.0.mu.w")
  chunks = [name for name in os.listdir(array_dir) if not name.startswith(".")]
  assert chunks
  os.remove(os.path.join(array_dir, chunks[0]))
  for target in (opt, _abstract(_replicated(opt))):
    with pytest.raises(ValueError, match=r"incomplete: the array at 'state/param_states/0/mu/w'"):
      restore_t5x_checkpoint(tmp_path, target)


def _transposing() -> optax.GradientTransformation:
  """A user-defined state holding each param transposed."""
  return optax.GradientTransformation(
    lambda params: jax.tree.map(jnp.transpose, params),
    lambda updates, state, params=None: (updates, state),
  )


@pytest.mark.parametrize("shape", [(8, 8), (8, 4)], ids=["square", "oblong"])
def test_a_transposed_state_gets_the_transposed_spec(shape):
  params = {"w": jnp.ones(shape)}
  opt = OptaxWrapper(_transposing()).create(params)
  axes = opt.optimizer_def.derive_logical_axes(opt, {"w": P("embed", "mlp")}).state.param_states
  assert axes == {"w": P("mlp", "embed")}


# ---------------------------------------------------------------- found on the way


def test_params_only_restores_into_the_per_param_layout(tmp_path):
  """The fresh optimizer state is laid out by the definition's own state_dict."""
  opt = _stepped(_frozen_multi().create(_params()))
  with Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(1, opt)
    restored = ckpt.restore(_frozen_multi().create(_params()), params_only=True)
  assert _same(restored.target, opt.target)
  fresh = _frozen_multi().create(_params()).state.param_states
  assert _same(
    [s.param_states for s in restored.state.param_states], [s.param_states for s in fresh]
  )


@pytest.mark.parametrize("writer", list(WRITERS), ids=list(WRITERS))
def test_an_int64_restores_whole_into_a_host_int64_target(tmp_path, writer):
  opt = _with_step(optax_opt(), np.int64(2**32 + 3))
  save, restore = WRITERS[writer]
  save(tmp_path, opt)
  restored = restore(tmp_path, opt)
  assert restored.state.step.dtype == np.int64 and int(restored.state.step) == 2**32 + 3


@pytest.mark.parametrize("writer", list(WRITERS), ids=list(WRITERS))
def test_a_python_int_beyond_int32_restores_whole(tmp_path, writer):
  opt = _with_step(optax_opt(), 2**40 + 3)
  save, restore = WRITERS[writer]
  save(tmp_path, opt)
  restored = restore(tmp_path, opt)
  assert type(restored.state.step) is int and restored.state.step == 2**40 + 3


def test_a_t5x_checkpoint_of_another_optimizer_with_the_same_keys_is_refused(tmp_path):
  """save_t5x_checkpoint records the optimizer's state classes beside T5X's files."""
  params = {"w": jnp.ones((4, 8))}
  adam = _stepped(OptaxWrapper(optax.adam(0.1)).create(params))
  save_t5x_checkpoint(tmp_path, adam, step=1)
  with pytest.raises(ValueError, match=r"ScaleByAdamState.*ScaleByBeliefState"):
    restore_t5x_checkpoint(tmp_path, OptaxWrapper(optax.adabelief(0.1)).create(params))
  with Checkpointer(tmp_path) as ckpt, pytest.raises(ValueError, match="ScaleByBeliefState"):
    ckpt.restore(OptaxWrapper(optax.adabelief(0.1)).create(params))
  assert _same(restore_t5x_checkpoint(tmp_path, adam), adam)


def test_checksums_see_the_high_words_of_host_integers():
  def checksum(value):
    return fetch(dispatch_checksums({("a",): value}))["a"]

  assert checksum(np.int64(2**32 + 3)) != checksum(np.int64(3))
  assert checksum(np.array([-(2**33)])) != checksum(np.array([0]))
  # Values that fit a device's int32 keep the checksums recorded before.
  assert checksum(np.int64(3)) == checksum(np.int32(3))
  assert checksum(2**40 + 3) == checksum(np.int64(2**40 + 3)) != checksum(3)
  assert checksum(3) == checksum(np.int32(3))


@pytest.mark.parametrize(
  "abstract", [pytest.param(False, marks=pytest.mark.slow), True], ids=["real", "abstract"]
)
def test_params_only_restores_into_a_stacked_target(tmp_path, abstract):
  """The definition lays the restored params out (stacks them) before the fresh state is made."""
  opt = _stacked_sharded()
  sgd = OptaxWrapper(optax.sgd(0.1, momentum=0.9)).create(opt.target)
  sgd = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(_mesh(), P())), sgd)
  with Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(1, opt)
    restored = ckpt.restore(_abstract(sgd) if abstract else sgd, params_only=True)
  assert _same(restored.target, opt.target)
  assert [b.sharding for b in restored.target.buffers] == [b.sharding for b in sgd.target.buffers]


def _saved_with_x64(tmp_path, params, step):
  """A checkpoint of sgd with `params` and `step`, saved with ``jax_enable_x64`` on."""
  with jax.enable_x64(True), Checkpointer(tmp_path, async_save=False) as ckpt:
    opt = OptaxWrapper(optax.sgd(0.1)).create(jax.tree.map(jnp.asarray, params))
    ckpt.save(1, _with_step(opt, jnp.asarray(step, jnp.int64)))


def test_a_64_bit_checkpoint_restores_with_x64_off(tmp_path):
  """Read on the host, 64-bit arrays are verified as stored, then cast by the restore rules."""
  w = np.array([0.5, 1.0 + 1e-12, np.nan, 1e-300])
  _saved_with_x64(tmp_path, {"w": w}, 7)
  target = OptaxWrapper(optax.sgd(0.1)).create({"w": jnp.zeros(4)})
  with Checkpointer(tmp_path) as ckpt:
    restored = ckpt.restore(target, fallback=True)
    assert ckpt.restored_step == 1
  assert restored.target["w"].dtype == jnp.float32 and int(restored.state.step) == 7
  np.testing.assert_array_equal(restored.target["w"], w.astype(np.float32))


@pytest.mark.slow
def test_64_bit_host_params_saved_with_x64_off_restore_with_x64_on(tmp_path):
  """Host float64 and int64 params (numpy arrays the optimizer keeps) are stored in their own
  dtypes, their checksums taken as a device without x64 narrows them; restored with x64 on
  they were read as 64-bit and the step was called corrupt. Either checksum verifies."""
  params = {"w": np.array([0.5, 1.0 + 1e-12, np.nan, 1e-300]), "n": np.arange(3, dtype=np.int64)}
  opt = OptaxWrapper(optax.masked(optax.sgd(0.1), {"w": True, "n": False})).create(params)
  with Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(1, opt)
  with jax.enable_x64(True), Checkpointer(tmp_path) as ckpt:
    restored = ckpt.restore(opt)
    assert restored.target["w"].dtype == np.float64
    np.testing.assert_array_equal(restored.target["w"], params["w"])
    np.testing.assert_array_equal(restored.target["n"], params["n"])


@pytest.mark.parametrize("fallback", [False, True])
def test_a_64_bit_value_beyond_a_32_bit_target_is_refused_not_corrupt(tmp_path, fallback):
  _saved_with_x64(tmp_path, {"w": np.array([1e300, 1.0])}, 7)
  target = OptaxWrapper(optax.sgd(0.1)).create({"w": jnp.zeros(2)})
  with Checkpointer(tmp_path) as ckpt, pytest.raises(ValueError) as e:
    ckpt.restore(target, fallback=fallback)
  assert not isinstance(e.value, CheckpointError)
  assert re.search(r"'target/w'.*float64.*float32", str(e.value))


def test_64_bit_host_data_has_the_checksums_of_either_x64_setting(tmp_path):
  """As a device without x64 narrows it (saved with x64 off), or by its words (with x64 on)."""

  def checksums(leaves):
    return fetch(dispatch_checksums(leaves))

  leaves = {("f",): np.array([0.25, -3.5, np.nan, 1e300]), ("i",): np.array([2**40, -3])}
  with jax.enable_x64(True):
    on_devices = checksums({path: jnp.asarray(x) for path, x in leaves.items()})
  assert checksums(x64_words(leaves)) == on_devices
  step = np.int64(7)
  with Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(1, _with_step(optax_opt(), step))
    assert int(ckpt.restore(optax_opt()).state.step) == 7


@pytest.mark.parametrize("step", [-1, np.int32(-1), jnp.asarray(-1), np.float32(-1.0)], ids=str)
def test_a_negative_step_counter_is_refused(step):
  opt = optax_opt()
  state_dict = opt.state_dict()
  with pytest.raises(ValueError, match=r"'state/step'.* -1"):
    opt.restore_state({**state_dict, "state": {**state_dict["state"], "step": step}})


def test_a_checkpoint_with_a_negative_step_counter_is_refused_not_retried(tmp_path):
  with Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(1, optax_opt())
    ckpt.save(2, _with_step(optax_opt(), jnp.asarray(-1)))
    with pytest.raises(ValueError, match=r"'state/step'.* -1") as e:
      ckpt.restore(optax_opt(), fallback=True)
  assert not isinstance(e.value, CheckpointError)
