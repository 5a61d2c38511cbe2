"""Conversion of `low_precision` states: bfloat16, 8-bit and 4-bit moments are decoded and encoded.

Every pair of storages (float32, bfloat16, 8-bit, 4-bit) converts as the float32 state does:
the source decoded with `low_precision_to_float32` and converted in float32 gives the
float32 target exactly, and a compressed target is that float32 result encoded
(`float32_to_low_precision`), within the codec's error of it. The sources are
hand-written optax loops of `low_precision(adam)` on random gradients.
"""

from __future__ import annotations

import functools
import itertools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from optimizer_table import assert_same_bits

import t5x_optim
from t5x_optim import OptaxWrapper, low_precision, low_precision_to_float32, partitioning

pytestmark = pytest.mark.usefixtures("shared_compilation_cache")

STORAGES = ("float32", "bfloat16", "8bit", "4bit")
STEPS = 3
RNG = np.random.default_rng(0)
PARAMS = {
  "dense": {
    "kernel": jnp.asarray(RNG.normal(size=(4, 512)), jnp.float32),
    "bias": jnp.asarray(RNG.normal(size=(256,)), jnp.float32),
  }
}
GRADS = [
  jax.tree.map(lambda p: jnp.asarray(RNG.normal(size=p.shape), jnp.float32), PARAMS)
  for _ in range(STEPS)
]
TARGETS = {
  "adam_b2": (lambda: optax.adam(1e-3, b2=0.95), {"b2": 0.95}, ("mu", "nu")),
  "lion": (lambda: optax.lion(1e-3), {}, ("mu",)),
  "sgd_momentum": (lambda: optax.sgd(1e-3, momentum=0.9), {}, ("trace",)),
}
# The codec's error, as a fraction of a leaf's largest magnitude: 8 bits with a block's
# absolute maximum for scale, bfloat16's 8-bit significand rounded stochastically, 4 bits:
# half the widest gap of the signed map (0.6625 to 0.8875) of a block's scale, which is its
# largest magnitude over 0.8875 where a negative element holds that, or a linear step (1/15).
CODEC_ERROR = {"float32": 0.0, "bfloat16": 2.0**-7, "8bit": 2e-2, "4bit": 0.1125 / 0.8875 + 1e-6}


def _stored(inner: optax.GradientTransformation, storage: str) -> optax.GradientTransformation:
  if storage == "float32":
    return inner
  return t5x_optim.low_precision(inner, storage, min_size=0, block_size=128)


@functools.cache
def _trained(storage: str) -> t5x_optim.Optimizer:
  """Adam stored in `storage`, after STEPS steps of optax's own loop (built once: 8-bit is slow)."""
  tx = _stored(optax.adam(1e-3), storage)
  state, params = tx.init(PARAMS), PARAMS
  for grads in GRADS:
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  optimizer = OptaxWrapper(tx).create(PARAMS)
  return optimizer.replace(target=params, state=t5x_optim.OptimizerState(jnp.int32(STEPS), state))


def _as_float32(source: t5x_optim.Optimizer) -> t5x_optim.Optimizer:
  """The same optimizer as plain float32 adam, its state decoded."""
  optimizer = OptaxWrapper(optax.adam(1e-3)).create(source.target)
  state = low_precision_to_float32(source.state.param_states)
  return optimizer.replace(state=t5x_optim.OptimizerState(source.state.step, state))


def _assert_leaves(got, want, atol, what):
  flat_got = jax.tree.flatten_with_path(got)[0]
  flat_want = jax.tree.leaves(want)
  assert len(flat_got) == len(flat_want), what
  for (path, a), b in zip(flat_got, flat_want, strict=True):
    bound = atol * float(np.max(np.abs(b))) if np.ndim(b) else 0.0
    np.testing.assert_allclose(a, b, rtol=0, atol=bound, err_msg=f"{what}{path}")


# The quick loop: adam_b2 encoded into bfloat16 and decoded from it; the rest is slow (8
# bits: the 8-bit source alone takes seconds, and each 8-bit codec compiles for seconds).
QUICK_PAIRS = {("adam_b2", "float32", "bfloat16"), ("adam_b2", "bfloat16", "float32")}


@pytest.mark.parametrize(
  "target, source_storage, target_storage",
  [
    pytest.param(*case, marks=() if case in QUICK_PAIRS else pytest.mark.slow, id="-".join(case))
    for case in itertools.product(sorted(TARGETS), STORAGES, STORAGES)
  ],
)
@pytest.mark.slow
def test_every_storage_pair_converts_as_float32_does(target, source_storage, target_storage):
  make, hparams, fields = TARGETS[target]
  source = _trained(source_storage)
  reference, _ = t5x_optim.convert_state(
    _as_float32(source), OptaxWrapper(make()), target_hparams=hparams, missing="init"
  )
  new, report = t5x_optim.convert_state(
    source, OptaxWrapper(_stored(make(), target_storage)), target_hparams=hparams, missing="init"
  )
  what = f"{source_storage} -> {target_storage} {target}: "
  got = new.state.param_states
  if target_storage == "float32":
    _assert_leaves(got, reference.state.param_states, 0.0, what)
  else:
    assert isinstance(got, t5x_optim.LowPrecisionState)
    assert int(got.count) == STEPS
    encoded = t5x_optim.float32_to_low_precision(reference.state.param_states, got)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(encoded), strict=True):
      np.testing.assert_array_equal(a, b, err_msg=what)
    got = low_precision_to_float32(got)
    _assert_leaves(got, reference.state.param_states, CODEC_ERROR[target_storage], what)
  jax.tree.map(np.testing.assert_array_equal, new.target, source.target)
  assert int(new.state.step) == STEPS
  assert len(report.converted) == len(fields), report
  assert all(": 2 params, from " in line for line in report.converted), report
  assert not any(line.startswith(("0 ", "inner_state/0 ")) for line in report.initialised), report


@pytest.mark.slow
def test_eight_bit_adam_into_eight_bit_adam_with_another_b2_moves_the_params_as_float32():
  """The next step after 8-bit -> 8-bit (b2 0.999 -> 0.95) is the float32 conversion's step."""
  source = _trained("8bit")
  make, hparams, _ = TARGETS["adam_b2"]
  new, _ = t5x_optim.convert_state(
    source, OptaxWrapper(_stored(make(), "8bit")), target_hparams=hparams
  )
  reference, _ = t5x_optim.convert_state(
    _as_float32(source), OptaxWrapper(make()), target_hparams=hparams
  )
  grads = GRADS[0]
  moved = jax.tree.map(jnp.subtract, new.apply_gradient(grads).target, new.target)
  updates, _ = make().update(grads, reference.state.param_states, reference.target)
  _assert_leaves(moved, updates, 2e-2, "8-bit adam's next step: ")


@pytest.mark.slow
def test_four_bit_blocks_of_one_row_convert_into_blocks_of_several():
  """A 4-bit state whose blocks lie in one row (``block_size=32``) converts into the default
  blocks of 4 rows x 32 columns: decoded on read, encoded on write, as float32 does."""
  params = {"w": jnp.asarray(RNG.normal(size=(64, 256)), jnp.float32)}
  rows = low_precision(optax.adam(1e-3), "4bit", min_size=0, block_size=32)
  state = rows.update(params, rows.init(params), params)[1]
  assert state.inner_state[0].mu["w"].scales.shape == (64, 8)
  source = OptaxWrapper(rows).create(params)
  source = source.replace(state=t5x_optim.OptimizerState(jnp.int32(1), state))
  target = OptaxWrapper(low_precision(optax.adam(1e-3), "4bit", min_size=0))
  new, report = t5x_optim.convert_state(source, target)
  got = new.state.param_states
  assert got.inner_state[0].mu["w"].scales.shape == (16, 8)
  reference, _ = t5x_optim.convert_state(_as_float32(source), OptaxWrapper(optax.adam(1e-3)))
  float32 = reference.state.param_states
  assert_same_bits(got, t5x_optim.float32_to_low_precision(float32, got))
  _assert_leaves(low_precision_to_float32(got), float32, CODEC_ERROR["4bit"], "")
  assert report.converted == (
    "inner_state/0 (ScaleByAdamState): as it is, from inner_state/0, a state of its type",
  ), report


@pytest.mark.slow
@pytest.mark.slow
def test_telling_adamax_from_adam_warns_of_nothing_the_caller_gave():
  """Adam's state type is told from adamax's by updating a copy of the params with two values
  per dimension; in 8 bits no block tiles those, and low_precision warned that its mode saves
  no memory, naming the caller's params, at every conversion of an 8-bit adamw (as an error
  under ``-W error``, which failed the conversion and `--init_from`)."""
  params = {"w": jnp.zeros((64, 256)), "b": jnp.zeros(256)}
  source = OptaxWrapper(low_precision(optax.adamw(1e-3), "8bit", min_size=0)).create(params)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    new, report = t5x_optim.convert_state(source, OptaxWrapper(optax.adamw(1e-3)))
  assert report.converted == (
    "0 (ScaleByAdamState): as it is, from inner_state/0, a state of its type",
  ), report


def test_an_eight_bit_leaf_outside_a_low_precision_state_is_refused_with_its_path():
  source = _trained("8bit")
  inner = source.state.param_states.inner_state  # 8-bit leaves without their wrapper
  bare = OptaxWrapper(optax.adam(1e-3)).create(PARAMS)
  bare = bare.replace(state=t5x_optim.OptimizerState(jnp.int32(STEPS), inner))
  with pytest.raises(ValueError, match=r"source state's leaf '0/mu/dense/bias' is 8-bit"):
    t5x_optim.convert_state(bare, OptaxWrapper(optax.lion(1e-3)))


@pytest.mark.slow
@pytest.mark.parametrize("target_storage", ["float32", "8bit"])
def test_an_eight_bit_checkpoint_restores_converted(tmp_path, target_storage):
  """restore_converted reads the checkpoint's 8-bit state as convert_state reads it in memory."""
  source = _trained("8bit")
  with t5x_optim.Checkpointer(tmp_path, async_save=False) as checkpointer:
    checkpointer.save(STEPS, source)
  target = OptaxWrapper(_stored(optax.lion(1e-3), target_storage))
  restored, report = t5x_optim.restore_converted(
    tmp_path, target.create(PARAMS), source=source.optimizer_def
  )
  in_memory, _ = t5x_optim.convert_state(source, target)
  assert report.converted == (
    f"{'inner_state/' if target_storage == '8bit' else ''}0 (ScaleByLionState).mu: 2 params, "
    "from inner_state/0 (ScaleByAdamState)",
  )
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(in_memory), strict=True):
    np.testing.assert_array_equal(a, b)


AXES = {"dense": {"kernel": ("embed", "mlp"), "bias": ("mlp",)}}


def _variables():
  boxed = jax.tree.map(lambda p, names: nn.LogicallyPartitioned(p, names), PARAMS, AXES,
                       is_leaf=lambda x: isinstance(x, tuple))  # fmt: skip
  return {"params": boxed}


def _partitioner(axis_types=AxisType.Auto, *, zero=False):
  mesh = partitioning.create_mesh(shape={"data": 2, "model": 4}, axis_types=axis_types)
  rules = partitioning.standard_logical_axis_rules(
    parameter_partitioning_dims=2, shard_optimizer_state_over_data=zero
  )
  return partitioning.Partitioner(mesh, rules)


def _assert_placed(state, want, target, what):
  """`state`'s leaves are `want`'s values in `target`'s shardings."""
  for (path, leaf), value, like in zip(
    jax.tree.flatten_with_path(state)[0],
    jax.tree.leaves(want),
    jax.tree.leaves(target),
    strict=True,
  ):
    np.testing.assert_array_equal(leaf, value, err_msg=f"{what} {path}")
    assert leaf.sharding.is_equivalent_to(like.sharding, leaf.ndim), (what, path, leaf.sharding)


@pytest.mark.parametrize("storage", [pytest.param(s, marks=pytest.mark.slow) for s in STORAGES[1:]])
def test_a_source_on_other_devices_converts_into_a_sharded_low_precision_state(storage):
  """A source on device 0 into a state sharded over 8: encoded on the target's devices.

  Adan's ``v`` (gradient differences) keeps its initial value, on the target's devices,
  beside moments converted from the source's.
  """
  source = jax.device_put(_trained("float32"), jax.devices()[0])
  target_def = OptaxWrapper(_stored(optax.adan(1e-3), storage))
  target = partitioning.abstract_train_state(_partitioner(), target_def, _variables).optimizer
  new, _ = t5x_optim.convert_state(source, target)
  unsharded, _ = t5x_optim.convert_state(_trained("float32"), target_def)
  _assert_placed(new.state.param_states, unsharded.state.param_states, target.state.param_states,
                 storage)  # fmt: skip


@pytest.mark.slow
def test_an_eight_bit_checkpoint_restores_converted_into_sharded_low_precision_states(tmp_path):
  """On a 2x4 mesh: 8-bit adam -> 8-bit lion and bfloat16 SGD, in the targets' shardings.

  Each is the float32 conversion of the decoded source, encoded.
  """
  partitioner = _partitioner()
  source_def = OptaxWrapper(_stored(optax.adam(1e-3), "8bit"))
  old = partitioning.init_sharded(partitioner, source_def, lambda key: _variables(), None)
  for grads in GRADS:
    old = old.apply_gradient(grads)
  with t5x_optim.Checkpointer(tmp_path, async_save=False) as checkpointer:
    checkpointer.save(STEPS, old)
  abstract_old = partitioning.abstract_train_state(partitioner, source_def, _variables)
  for make, storage in (
    (lambda: optax.lion(1e-3), "8bit"),
    (TARGETS["sgd_momentum"][0], "bfloat16"),
  ):
    target_def = OptaxWrapper(_stored(make(), storage))
    target = partitioning.abstract_train_state(partitioner, target_def, _variables)
    state, _ = t5x_optim.restore_converted(tmp_path, target, source=abstract_old)
    reference, _ = t5x_optim.convert_state(_as_float32(old.optimizer), OptaxWrapper(make()))
    like = jax.tree.map(np.asarray, state.param_states)  # on the reference's device
    encoded = t5x_optim.float32_to_low_precision(reference.state.param_states, like)
    _assert_placed(state.param_states, encoded, target.param_states, storage)


@pytest.mark.slow
def test_a_checkpoint_of_a_state_without_converter_restores_into_its_type_sharded(tmp_path):
  """adabelief's state has no converter: a float32 checkpoint of it on a 2x4 mesh restores
  into 8-bit adabelief as it is, encoded on the target's shardings, as convert_state gives
  it in memory; until then its moments started fresh."""
  partitioner = _partitioner()
  source_def = OptaxWrapper(optax.adabelief(1e-3))
  old = partitioning.init_sharded(partitioner, source_def, lambda key: _variables(), None)
  for grads in GRADS:
    old = old.apply_gradient(grads)
  with t5x_optim.Checkpointer(tmp_path, async_save=False) as checkpointer:
    checkpointer.save(STEPS, old)
  abstract_old = partitioning.abstract_train_state(partitioner, source_def, _variables)
  target_def = OptaxWrapper(_stored(optax.adabelief(1e-3), "8bit"))
  target = partitioning.abstract_train_state(partitioner, target_def, _variables)
  state, report = t5x_optim.restore_converted(tmp_path, target, source=abstract_old)
  assert report.converted == (
    "inner_state/0 (ScaleByBeliefState): as it is, from 0, a state of its type",
  ), report
  assert (report.initialised, report.dropped) == ((), ())
  like = jax.tree.map(np.asarray, state.param_states)
  encoded = t5x_optim.float32_to_low_precision(old.optimizer.state.param_states, like)
  _assert_placed(state.param_states, encoded, target.param_states, "8bit")


@pytest.mark.slow
@pytest.mark.parametrize(
  "source_storage, target_storage", [("float32", "8bit"), ("8bit", "float32"), ("8bit", "4bit")]
)
def test_conversion_on_explicit_mesh_axes_as_on_auto(source_storage, target_storage):
  """ZeRO states on a 2x4 mesh with Explicit axes: the source decodes and the target encodes
  as on Auto axes, bit for bit, in the target's shardings (the quantized decoder and encoder
  failed there: a leaf's codes and scales are laid out apart, and Explicit axes refuse an
  operation on both)."""
  converted = {}

  def stored(inner, storage):
    # Blocks that span their shards: the scales are laid out apart from the codes (8 bits: the
    # kernel's (4, 2) sharded over ``data`` alone, its codes over both axes).
    if storage == "float32":
      return inner
    return t5x_optim.low_precision(inner, storage, min_size=0, shard_multiple=1)

  for axis_types in (AxisType.Explicit, AxisType.Auto):
    partitioner = _partitioner(axis_types, zero=True)
    source_def = OptaxWrapper(stored(optax.adam(1e-3), source_storage))
    source = partitioning.init_sharded(partitioner, source_def, lambda key: _variables(), None)
    shardings = jax.tree.map(lambda x: x.sharding, source.params)
    step = jax.jit(lambda state, grads: state.apply_gradient(grads))
    for grads in GRADS:
      source = step(source, jax.device_put(grads, shardings))
    target_def = OptaxWrapper(stored(TARGETS["adam_b2"][0](), target_storage))
    target = partitioning.abstract_train_state(partitioner, target_def, _variables).optimizer
    new, _ = t5x_optim.convert_state(source.optimizer, target, target_hparams={"b2": 0.95})
    assert jax.tree.structure(new.state) == jax.tree.structure(target.state)
    for leaf, like in zip(jax.tree.leaves(new.state), jax.tree.leaves(target.state), strict=True):
      assert leaf.sharding == like.sharding
    converted[axis_types] = new.state
  assert_same_bits(converted[AxisType.Explicit], converted[AxisType.Auto])


@pytest.mark.slow
def test_a_sharded_state_converts_into_a_sharded_four_bit_state_on_its_devices(monkeypatch):
  """ZeRO moments sharded otherwise than the 4-bit target's float32 view of them (its
  decoder's layout: a (256, 1024) kernel's over both axes on its second dimension) were
  copied whole to the host to be placed; they are resharded on the devices."""

  def variables():
    return {
      "params": {"kernel": nn.LogicallyPartitioned(jnp.ones((256, 1024)), AXES["dense"]["kernel"])}
    }

  partitioner = _partitioner(zero=True)
  source = partitioning.init_sharded(partitioner, OptaxWrapper(optax.adam(1e-3)), variables)
  target_def = OptaxWrapper(t5x_optim.low_precision(optax.adam(1e-3), "4bit", min_size=0))
  target = partitioning.abstract_train_state(partitioner, target_def, variables).optimizer
  array_type = type(source.params["kernel"])
  value = array_type._value
  read = []

  def spy(self):
    if len(self.sharding.device_set) > 1:
      read.append(self.shape)
    return value.fget(self)

  monkeypatch.setattr(array_type, "_value", property(spy))
  new, _ = t5x_optim.convert_state(source.optimizer, target)
  assert not read
  for leaf, like in zip(jax.tree.leaves(new.state), jax.tree.leaves(target.state), strict=True):
    assert leaf.sharding == like.sharding


@pytest.mark.parametrize("mode", ["8bit", "bfloat16"])
def test_schedule_free_evaluation_params_decode_nothing_of_another_optimizers_state(mode):
  """`t5x-optim train` asks at every eval whether the state is schedule-free's: it decoded
  the whole compressed state to float32 to find out (8 bytes per param at once, for nothing).
  Another optimizer's state is told apart without computing anything; schedule-free's is
  decoded, and gives its average."""
  params = {"w": jnp.ones((64, 64)), "b": jnp.ones(64)}
  state = low_precision(optax.adam(1e-3), mode, min_size=0).init(params)
  asked = jax.make_jaxpr(lambda s: t5x_optim.schedule_free_evaluation_params(s, params))(state)
  assert not asked.eqns, asked
  free = low_precision(optax.contrib.schedule_free_sgd(1.0, b1=0.5), mode, min_size=0)
  x = t5x_optim.schedule_free_evaluation_params(free.init(params), params)
  np.testing.assert_array_equal(np.asarray(x["w"]), np.ones((64, 64), np.float32))
