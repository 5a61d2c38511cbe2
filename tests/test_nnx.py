"""Flax NNX state trees (nnx.State of nnx.Param) as an optimizer's params."""

from __future__ import annotations

import json
from typing import Any

import flax
import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from optimizer_table import assert_same_bits

from t5x_optim import (
  Checkpointer,
  OptaxWrapper,
  TrainState,
  _nnx,
  convert_state,
  leaf_storage,
  optimizers,
  partitioning,
  restore_converted,
)
from t5x_optim.t5x_checkpoints import restore_t5x_checkpoint, save_t5x_checkpoint


@pytest.fixture(autouse=True)
def _no_eager_sharding():
  """Models built with sharding metadata and no mesh (flax shards variables eagerly by
  default)."""
  with flax.config.temp_flip_flag("always_shard_variable", False):
    yield


def _linear(features: int = 8) -> nnx.State:
  return nnx.state(nnx.Linear(4, features, rngs=nnx.Rngs(0)), nnx.Param)


def _state_dict(params: dict, step: int = 7) -> dict:
  """An adamw state dict in T5X's layout over the plain dict `params`."""
  moments = {"count": np.int32(step), "mu": params, "nu": params}
  return {"target": params, "state": {"step": np.int32(step), "param_states": {"0": moments}}}


@pytest.mark.slow
def test_restore_state_into_an_nnx_target_checks_every_leaf_and_keeps_the_state():
  opt = optimizers.adamw(1e-2).create(_linear(16))
  with pytest.raises(ValueError, match=r"Shape mismatch at 'target/kernel'.*\(4, 16\)"):
    opt.restore_state(_state_dict(_linear(8).to_pure_dict()))
  params = jax.tree.map(lambda a: np.asarray(a) + 1, _linear(16).to_pure_dict())
  restored = opt.restore_state(_state_dict(params))
  assert isinstance(restored.target, nnx.State)
  assert isinstance(restored.target["kernel"], nnx.Param)
  np.testing.assert_array_equal(restored.target["kernel"].get_value(), params["kernel"])
  assert isinstance(restored.state.param_states[0].mu, nnx.State)
  assert int(restored.state.step) == 7
  complex_mu = _state_dict(params)
  complex_mu["state"]["param_states"]["0"]["mu"] = jax.tree.map(
    lambda a: np.asarray(a, np.complex64), params
  )
  with pytest.raises(ValueError, match="param_states/0/mu/kernel"):
    opt.restore_state(complex_mu)


@pytest.mark.slow
def test_state_dict_holds_values_and_restores_through_the_checkpointer(tmp_path):
  opt = optimizers.adamw(1e-2).create(_linear())
  opt = opt.apply_gradient(jax.tree.map(np.ones_like, opt.target))
  state_dict = opt.state_dict()
  mu = state_dict["state"]["param_states"]["0"]["mu"]
  for part in state_dict["target"], mu:
    assert type(part) is dict and sorted(part) == ["bias", "kernel"]
    assert isinstance(part["kernel"], jax.Array)
  fresh = optimizers.adamw(1e-2).create(_linear())
  restored = fresh.restore_state(state_dict)
  assert isinstance(restored.state.param_states[0].nu, nnx.State)
  assert_same_bits((restored.target, restored.state), (opt.target, opt.state))
  with Checkpointer(tmp_path) as checkpointer:
    checkpointer.save(1, opt)
    checkpointer.wait_until_finished()
    from_disk = checkpointer.restore(fresh)
  assert isinstance(from_disk.target, nnx.State)
  assert_same_bits((from_disk.target, from_disk.state), (opt.target, opt.state))


def _8bit() -> OptaxWrapper:
  return OptaxWrapper(optimizers.low_precision(optax.adam(1e-2), "8bit", min_size=0))


@pytest.mark.slow
def test_a_low_precision_checkpoint_restores_over_an_nnx_state_or_its_pure_dict(tmp_path):
  params = _linear()
  pure = params.to_pure_dict()
  for index, (source, target) in enumerate([(params, pure), (pure, params)]):
    opt = _8bit().create(source)
    opt = opt.apply_gradient(jax.tree.map(np.ones_like, opt.target))
    with Checkpointer(tmp_path / str(index)) as checkpointer:
      checkpointer.save(1, opt)
      checkpointer.wait_until_finished()
      restored = checkpointer.restore(_8bit().create(target))
    assert type(restored.target) is type(target)
    assert_same_bits(restored.state_dict(), opt.state_dict())
    save_t5x_checkpoint(tmp_path / f"t5x{index}", opt)
    from_t5x = restore_t5x_checkpoint(tmp_path / f"t5x{index}", _8bit().create(target))
    assert_same_bits(from_t5x.state_dict(), opt.state_dict())


def _paths(tree: dict, prefix: tuple = ()) -> set[tuple]:
  """The key paths of the leaves of the nested dict `tree`."""
  paths = set()
  for key, value in tree.items():
    path = (*prefix, str(key))
    paths |= _paths(value, path) if isinstance(value, dict) else {path}
  return paths


@pytest.mark.slow
def test_leaf_storage_over_an_nnx_state_is_keyed_by_state_dict_paths():
  tx = optimizers.low_precision(
    optax.adam(1e-2), "8bit", min_size=0, param_modes=[("bias", "float32")]
  )
  params = _linear()
  opt = OptaxWrapper(tx).create(params)
  storage = leaf_storage(opt.state.param_states)
  assert storage == leaf_storage(tx.init(nnx.to_pure_dict(params)))
  assert set(storage) == _paths(opt.state_dict()["state"]["param_states"])
  assert storage[("inner_state", "0", "mu", "kernel", "codes")] == "8bit codes"
  assert storage[("inner_state", "0", "nu", "bias")] == "float32: param_modes 'bias'"


class _Kernel(nnx.Param):
  """A param of its own class."""


@pytest.mark.slow
def test_a_checkpoint_restores_into_params_of_another_variable_class(tmp_path):
  opt = optimizers.adamw(1e-2).create(_linear())
  opt = opt.apply_gradient(jax.tree.map(np.ones_like, opt.target))
  params = _linear()
  params["kernel"] = _Kernel(params["kernel"].get_value())
  with Checkpointer(tmp_path) as checkpointer:
    checkpointer.save(1, opt)
    checkpointer.wait_until_finished()
    restored = checkpointer.restore(optimizers.adamw(1e-2).create(params))
  assert isinstance(restored.target["kernel"], _Kernel)
  assert_same_bits(restored.state_dict(), opt.state_dict())


class _Positive(nnx.Param):
  """Stores an unconstrained value and reads back its softplus, a positive scale."""

  def get_value(self, **kwargs):
    return jax.nn.softplus(super().get_value(**kwargs))


def _positive_params() -> nnx.State:
  return nnx.State(
    {
      "scale": _Positive(np.linspace(-1, 1, 512, dtype=np.float32).reshape(2, 256)),
      "w": nnx.Param(np.ones(3, np.float32)),
    }
  )


def _stored(tree) -> dict:
  """The values `tree`'s nnx.Variables store (their pytree leaves), by path."""
  return {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree.leaves_with_path(tree)}


@pytest.mark.slow
@pytest.mark.parametrize(
  "optimizer",
  [
    pytest.param(lambda: optax.adam(1e-2), id="adam"),
    pytest.param(lambda: optimizers.low_precision(optax.adam(1e-2), "8bit", min_size=0), id="8bit"),
  ],
)
def test_params_of_a_class_overriding_get_value_save_and_restore_their_stored_values(
  optimizer, tmp_path
):
  params = _positive_params()
  fresh = OptaxWrapper(optimizer()).create(params)
  grads = jax.tree.map(lambda a: np.full_like(a, 0.5), params)
  opt = fresh.apply_gradient(grads)
  state_dict = opt.state_dict()
  np.testing.assert_array_equal(state_dict["target"]["scale"], opt.target["scale"].get_raw_value())
  assert_same_bits(_stored(fresh.restore_state(state_dict)), _stored(opt))
  with Checkpointer(tmp_path) as checkpointer:
    checkpointer.save(1, opt)
    checkpointer.wait_until_finished()
    assert_same_bits(_stored(checkpointer.restore(fresh)), _stored(opt))
  plain = optimizer()
  updates, _ = plain.update(grads, plain.init(params), params)
  assert_same_bits(_stored(opt.target), _stored(optax.apply_updates(params, updates)))


@pytest.mark.slow
def test_a_checkpoint_recording_the_nnx_nodes_of_its_state_restores_into_the_same_optimizer(
  tmp_path,
):
  """Earlier versions recorded the nnx.State and nnx.Variable nodes of a state over an
  nnx.State, the class a Variable holds one level below it."""
  opt = _8bit().create(_linear())
  opt = opt.apply_gradient(jax.tree.map(np.ones_like, opt.target))
  recorded = {"": "LowPrecisionState", "inner_state/0": "ScaleByAdamState"}
  for moment in "mu", "nu":
    recorded[f"inner_state/0/{moment}"] = "State"
    for name in "bias", "kernel":
      recorded[f"inner_state/0/{moment}/{name}"] = "Param"
      recorded[f"inner_state/0/{moment}/{name}/value"] = "QuantizedLeaf"
  with Checkpointer(tmp_path) as checkpointer:
    checkpointer.save(1, opt)
    checkpointer.wait_until_finished()
    (tmp_path / "1" / "state_classes" / "metadata").write_text(json.dumps(recorded))
    restored = checkpointer.restore(_8bit().create(_linear()))
    assert_same_bits(restored.state_dict(), opt.state_dict())
    recorded["inner_state/0/mu/kernel/value"] = "Quantized4Leaf"
    (tmp_path / "1" / "state_classes" / "metadata").write_text(json.dumps(recorded))
    with pytest.raises(
      ValueError, match=r"mismatch at 'state/param_states/inner_state/0/mu/kernel'"
    ):
      checkpointer.restore(_8bit().create(_linear()), verify=False)


@pytest.mark.slow
def test_an_optimizer_refuses_nnx_variables_that_are_not_params():
  model = nnx.Sequential(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), nnx.BatchNorm(4, rngs=nnx.Rngs(0)))
  with pytest.raises(
    TypeError, match=r"create: the params hold a BatchStat at 'layers/1/mean'.*nnx.Param\)"
  ):
    optimizers.adamw(1e-2).create(nnx.state(model))
  optimizers.adamw(1e-2).create(nnx.state(model, nnx.Param))
  params = nnx.State({"w": _Kernel(np.ones(2, np.float32))})
  assert isinstance(optimizers.adamw(1e-2).create(params).target["w"], _Kernel)


@pytest.mark.slow
def test_a_param_holding_a_dict_saves_and_restores(tmp_path):
  """A Param whose value is a dict trained and saved, but its state dict (a key per array of
  the dict) did not restore into it: nnx.replace_by_pure_dict looks for a Variable per key."""
  params = nnx.State({"s": nnx.Param({"a": np.ones(2, np.float32), "b": np.zeros(3, np.float32)})})
  opt = optimizers.adamw(1e-2).create(params)
  opt = opt.apply_gradient(jax.tree.map(np.ones_like, opt.target))
  restored = optimizers.adamw(1e-2).create(params).restore_state(opt.state_dict())
  assert isinstance(restored.target["s"], nnx.Param)
  assert_same_bits((restored.target, restored.state), (opt.target, opt.state))
  with Checkpointer(tmp_path, async_save=False) as checkpointer:
    checkpointer.save(1, opt)
    from_disk = checkpointer.restore(optimizers.adamw(1e-2).create(params))
  assert_same_bits((from_disk.target, from_disk.state), (opt.target, opt.state))
  extra = opt.state_dict()
  extra["target"]["s"]["c"] = np.ones(1, np.float32)
  with pytest.raises(ValueError, match=r"Unexpected keys \['c'\] at 'target/s'.*\['a', 'b'\]"):
    opt.restore_state(extra)


def test_restoring_into_a_state_names_a_path_only_one_side_has():
  state = nnx.State({"s": nnx.Param({"a": np.ones(2, np.float32)})})
  with pytest.raises(ValueError, match="no value at 's', where the nnx.State has one"):
    _nnx.restore_like(state, {})
  with pytest.raises(ValueError, match="a value at 't/a', where the nnx.State has none"):
    _nnx.restore_like(state, {"s": {"a": np.ones(2, np.float32)}, "t": {"a": 1.0}})


@pytest.mark.slow
def test_an_optimizer_refuses_params_held_in_array_refs():
  """Params made with ref=True were taken, and the first apply_gradient failed adding a Ref to
  an array."""
  params = nnx.State({"w": nnx.Param(np.ones(3, np.float32), ref=True)})
  with pytest.raises(TypeError, match=r"create: the params hold an array ref at 'w'.*to_pure_dict"):
    optimizers.adamw(1e-2).create(params)


@pytest.mark.slow
def test_a_converting_restore_refuses_an_nnx_target_naming_the_call(tmp_path):
  opt = optimizers.adamw(1e-2).create(_linear())
  opt = opt.apply_gradient(jax.tree.map(np.ones_like, opt.target))
  target = optimizers.lion(1e-2).create(_linear())
  save_t5x_checkpoint(tmp_path / "t5x", opt)
  with Checkpointer(tmp_path / "orbax") as checkpointer:
    checkpointer.save(1, opt)
    checkpointer.wait_until_finished()
    with pytest.raises(
      TypeError,
      match=r"^Checkpointer.restore with convert_from=: target.target .* at '<root>'.*to_pure_dict",
    ):
      checkpointer.restore(target, convert_from=optimizers.adamw(1e-2))
    pure = optimizers.lion(1e-2).create(_linear().to_pure_dict())
    restored = checkpointer.restore(pure, convert_from=optimizers.adamw(1e-2))
  assert_same_bits(restored.target, opt.target.to_pure_dict())
  with pytest.raises(TypeError, match=r"^restore_t5x_checkpoint with convert_from=: target.target"):
    restore_t5x_checkpoint(tmp_path / "t5x", target, convert_from=optimizers.adamw(1e-2))
  with pytest.raises(TypeError, match=r"^restore_converted: target.target"):
    restore_converted(tmp_path / "t5x", target, source=optimizers.adamw(1e-2))


def _forms() -> dict[str, Any]:
  """A linear layer's params as an nnx.State, its pure dict, each of them below the root
  (beside a plain array), and a dict of its bare Variables."""
  state = _linear()
  pure = nnx.to_pure_dict(state)
  return {
    "state": state,
    "pure": pure,
    "state below": {"a": state, "b": np.ones(2, np.float32)},
    "pure below": {"a": pure, "b": np.ones(2, np.float32)},
    "variables": {name: nnx.Param(value) for name, value in pure.items()},
  }


@pytest.mark.slow
@pytest.mark.parametrize(
  ("params_form", "grads_form", "message"),
  [
    (
      "state",
      "pure",
      r"the params are an nnx.State and the grads a pure dict of the same paths: pass the "
      r"grads as an nnx.State \(nnx.grad, or jax.grad with respect to the State\), or create "
      r"the optimizer over nnx.to_pure_dict\(state\)\.$",
    ),
    (
      "pure",
      "state",
      r"the grads are an nnx.State and the params a pure dict of the same paths: pass "
      r"nnx.to_pure_dict\(grads\), or create the optimizer over the nnx.State\.$",
    ),
    (
      "pure below",
      "state below",
      r"the grads hold an nnx.State at 'a' and the params a pure dict there, at the same "
      r"paths: replace the nnx.State at 'a' in the grads with nnx.to_pure_dict of it, or "
      r"create the optimizer over params with the nnx.State there\.$",
    ),
    (
      "state below",
      "pure below",
      r"the params hold an nnx.State at 'a' and the grads a pure dict there, at the same "
      r"paths: replace the pure dict at 'a' in the grads with an nnx.State \(nnx.grad, or "
      r"jax.grad with respect to the State\), or create the optimizer over params with "
      r"nnx.to_pure_dict of the nnx.State there\.$",
    ),
    (
      "pure",
      "variables",
      r"the grads hold nnx.Variables at 'bias', 'kernel' and the params plain values there, "
      r"at the same paths: unwrap the Variables at 'bias', 'kernel' in the grads \(each to its "
      r"value\)\.$",
    ),
  ],
)
def test_grads_in_the_other_form_than_an_nnx_params_say_so(params_form, grads_form, message):
  """Where the nnx.State sat below the root, the advice to pass nnx.to_pure_dict(grads)
  failed (the grads are no State); it names the path, and the Variables to unwrap."""
  forms = _forms()
  opt = optimizers.adamw(1e-2).create(forms[params_form])
  grads = jax.tree.map(np.ones_like, forms[grads_form])
  with pytest.raises(ValueError, match=r"^The grads do not fit the params: " + message):
    opt.apply_gradient(grads)
  if grads_form == "state below":
    opt.apply_gradient({**grads, "a": nnx.to_pure_dict(grads["a"])})


class _LM(nnx.Module):
  """A ('vocab', 'embed') embedding and an ('embed', 'mlp') kernel, by sharding metadata."""

  def __init__(self, rngs: nnx.Rngs):
    embedding_init = nnx.with_partitioning(nnx.initializers.normal(), ("vocab", "embed"))
    kernel_init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))
    self.embed = nnx.Embed(64, 8, rngs=rngs, embedding_init=embedding_init)
    self.wi = nnx.Linear(8, 16, use_bias=False, rngs=rngs, kernel_init=kernel_init)


@pytest.mark.slow
def test_an_nnx_state_as_axes_gives_its_sharding_metadata():
  params = nnx.state(_LM(nnx.Rngs(0)), nnx.Param)
  specs = nnx.get_partition_spec(params)
  assert partitioning.logical_axes_from(params) == specs
  opt_def = optimizers.adamw(1e-3)
  opt = opt_def.create(params)
  mu = opt_def.derive_logical_axes(opt, params).state.param_states[0].mu
  assert jax.tree.leaves(mu) == [P("vocab", "embed"), P("embed", "mlp")]
  assert optimizers.muon(learning_rate=0.02, param_axes=params).describe_params(params) == [
    "embed/embedding/value ('vocab', 'embed'): adam",
    "wi/kernel/value ('embed', 'mlp'): muon, inputs ('embed',), outputs ('mlp',)",
  ]


@pytest.mark.slow
def test_a_train_state_a_multi_optimizer_and_a_conversion_refuse_an_nnx_state_naming_it():
  params = _linear()
  with pytest.raises(TypeError, match=r"TrainState.create: model_variables .* at 'params'.*"):
    TrainState.create(optimizers.adamw(1e-3), {"params": params})
  mesh = partitioning.create_mesh(devices=jax.devices()[:1])
  with pytest.raises(TypeError, match=r"model_variables .*nn.LogicallyPartitioned"):
    partitioning.init_sharded(
      partitioning.Partitioner(mesh), optimizers.adamw(1e-3), lambda: {"params": params}
    )
  multi = optimizers.MultiOptimizer(
    [("kernel", optimizers.adamw(1e-3)), ("bias", optimizers.sgd(1e-3))]
  )
  with pytest.raises(TypeError, match=r"MultiOptimizer: params .* at '<root>'.*nnx.to_pure_dict"):
    multi.create(params)
  assert sorted(multi.create(params.to_pure_dict()).target) == ["bias", "kernel"]
  optimizer = optimizers.adamw(1e-3).create(params)
  with pytest.raises(TypeError, match=r"convert_state: source.target .* at '<root>'"):
    convert_state(optimizer, optimizers.lion(1e-3), missing="init")
  pure = optimizers.adamw(1e-3).create(params.to_pure_dict())
  with pytest.raises(TypeError, match=r"convert_state: param_axes .* at '<root>'"):
    convert_state(pure, optimizers.lion(1e-3), missing="init", param_axes=params)
