"""T5X's calling protocol, in our own words (no T5X code).

Each test is one way T5X's own modules call an optimizer (docs/design.md, "How
T5X calls an optimizer"): `state_dict()`/`restore_state()` as a tree replace with
None, PartitionSpec, empty-node, ShapeDtypeStruct and lazy-array leaves,
whole train-state dicts, `restore_dtype` casts, legacy per-param
`OptimizerDef` subclasses with `set_param_axes`, and T5X's MultiOptimizer
state-dict layout. T5X's own test files, run by hand against the same code,
pass too (docs/t5x.md); this module keeps CI guarding the contract.
"""

from __future__ import annotations

import asyncio
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import struct, traverse_util
from flax.linen import partitioning as flax_partitioning
from jax.sharding import PartitionSpec as P

from t5x_optim import MultiOptimizer, OptaxWrapper, OptimizerDef, OptimizerState, TrainState

AXES = {"dense": {"kernel": P("embed", "mlp"), "bias": P("mlp")}, "head": {"bias": P("vocab")}}
RULES = (("embed", None), ("mlp", "model"), ("vocab", "model"))


def make_params(dtype: Any = jnp.float32) -> dict[str, Any]:
  return {
    "dense": {"kernel": jnp.full((4, 8), 0.5, dtype), "bias": jnp.zeros(8, dtype)},
    "head": {"bias": jnp.ones(1, dtype)},
  }


def grads_for(params: Any) -> Any:
  return jax.tree.map(lambda p: jnp.full_like(p, 0.25), params)


@struct.dataclass
class _HyperParams:
  learning_rate: float
  beta: float


@struct.dataclass
class _ParamState:
  momentum: jax.Array
  scale: jax.Array


class _PerParamMomentumRule:
  """A legacy T5X-style definition: one state per param, axes from the model.

  Written the way T5X's `Adafactor` is: `set_param_axes` records the model's
  axes, and `derive_logical_axes` replaces leaves of `state_dict()` and calls
  `restore_state` with PartitionSpec / None leaves. `state_type` is the
  `OptimizerState` class of the interface the definition is written against.
  """

  state_type: type = OptimizerState

  def __init__(self, learning_rate: float = 0.1, beta: float = 0.9):
    super().__init__(_HyperParams(learning_rate, beta))
    self.param_axes = None

  def set_param_axes(self, param_logical_axes: Any) -> None:
    self.param_axes = param_logical_axes

  def init_state(self, params: Any) -> Any:
    states = jax.tree.map(lambda p: _ParamState(jnp.zeros_like(p), jnp.ones((1,), p.dtype)), params)
    return self.state_type(jnp.asarray(0, jnp.int32), states)

  def apply_gradient(self, hyper_params, params, state, grads):
    def update(p, s, g):
      momentum = hyper_params.beta * s.momentum + g
      return p - hyper_params.learning_rate * momentum, s.replace(momentum=momentum)

    treedef = jax.tree.structure(params)
    out = [
      update(p, s, g)
      for p, s, g in zip(
        treedef.flatten_up_to(params),
        treedef.flatten_up_to(state.param_states),
        treedef.flatten_up_to(grads),
      )
    ]
    new_params = treedef.unflatten([p for p, _ in out])
    new_states = treedef.unflatten([s for _, s in out])
    return new_params, self.state_type(state.step + 1, new_states)

  def derive_logical_axes(self, optimizer, param_logical_axes):
    axes = jax.tree.map(lambda x: None, optimizer.state_dict())
    axes["target"] = flax.core.unfreeze(param_logical_axes)
    axes["state"]["param_states"] = jax.tree.map(
      lambda spec, _: {"momentum": spec, "scale": None},
      flax.core.unfreeze(param_logical_axes),
      optimizer.state_dict()["state"]["param_states"],
      is_leaf=lambda x: isinstance(x, P),
    )
    return optimizer.restore_state(axes)


class PerParamMomentum(_PerParamMomentumRule, OptimizerDef):
  """The legacy definition on our `OptimizerDef` (T5X's modules replaced by ours)."""


@struct.dataclass
class ForeignOptimizerState:
  """T5X's own `OptimizerState`: a class of its own, not ours."""

  step: jax.Array
  param_states: Any


class ForeignOptimizerDef:
  """T5X's own `OptimizerDef` base class, as T5X writes it, subclassing nothing of ours.

  With T5X installed and only a gin import changed, T5X's `adafactor.Adafactor`
  is a subclass of this, not of our `OptimizerDef`.
  """

  def __init__(self, hyper_params: Any):
    self.hyper_params = hyper_params

  def update_hyper_params(self, **hyper_param_overrides: Any) -> Any:
    hyper_params = hyper_param_overrides.pop("hyper_params", self.hyper_params)
    return hyper_params.replace(**hyper_param_overrides) if hyper_param_overrides else hyper_params

  def create(self, target: Any) -> Any:
    raise AssertionError("T5X's own Optimizer is not at hand here")

  def state_dict(self, target: Any, state: Any) -> dict[str, Any]:
    return flax.serialization.to_state_dict(
      {"target": flax.serialization.to_state_dict(target), "state": state}
    )

  def restore_state(self, opt_target: Any, opt_state: Any, state_dict: Any) -> tuple[Any, Any]:
    return (
      flax.serialization.from_state_dict(opt_target, state_dict["target"]),
      flax.serialization.from_state_dict(opt_state, state_dict["state"]),
    )


class ForeignPerParamMomentum(_PerParamMomentumRule, ForeignOptimizerDef):
  """The legacy definition on T5X's own base classes (T5X installed, gin import changed)."""

  state_type = ForeignOptimizerState


class Lazy:
  """A lazily read array, as T5X's checkpointer hands them out (shape, dtype, get)."""

  def __init__(self, value: np.ndarray):
    self._value = value
    self.shape, self.dtype = value.shape, value.dtype

  async def get_async(self) -> np.ndarray:
    return self._value

  def get(self) -> np.ndarray:
    return asyncio.run(self.get_async())


def adamw_opt():
  opt = OptaxWrapper(optax.adamw(0.1)).create(make_params())
  return opt.apply_gradient(grads_for(make_params()))


def train_state(opt_def: OptimizerDef) -> TrainState:
  """T5X-style model variables: params, their params_axes and a mutable collection."""
  params_axes = {
    module: {
      f"{name}_axes": flax_partitioning.AxisMetadata(names=tuple(spec))
      for name, spec in specs.items()
    }
    for module, specs in AXES.items()
  }
  variables = {
    "params": make_params(),
    "params_axes": params_axes,
    "stats": {"count": jnp.zeros(2)},
  }
  return TrainState.create(opt_def, variables)


def leaves(tree: Any) -> list[Any]:
  return jax.tree.leaves(tree, is_leaf=lambda x: x is None or isinstance(x, P))


def test_get_logical_axes_default_restores_all_none_into_abstract_state():
  """T5X partitioning.py:877: restore_state(tree.map(lambda x: None, state_dict()))."""
  abstract = jax.eval_shape(lambda: train_state(OptaxWrapper(optax.adamw(0.1))))
  nones = abstract.restore_state(jax.tree.map(lambda x: None, abstract.state_dict()))
  assert all(x is None for x in leaves(nones))
  assert jax.tree.structure(nones, is_leaf=lambda x: x is None) == jax.tree.structure(
    abstract, is_leaf=lambda x: x is None
  )


@pytest.mark.parametrize(
  "opt_def", [OptaxWrapper(optax.adamw(0.1)), PerParamMomentum()], ids=["optax", "legacy"]
)
def test_get_mesh_axes_maps_the_flattened_logical_state_dict(opt_def):
  """T5X partitioning.py:1142: flatten (keep_empty_nodes), map specs, restore_state."""
  opt = opt_def.create(make_params())
  logical = opt.optimizer_def.derive_logical_axes(opt, AXES)

  def to_mesh(value):
    if value is None or value is traverse_util.empty_node:
      return value
    return flax_partitioning.logical_to_mesh_axes(value, RULES)

  flat = traverse_util.flatten_dict(logical.state_dict(), keep_empty_nodes=True, sep="/")
  mesh_axes = logical.restore_state(
    traverse_util.unflatten_dict({k: to_mesh(v) for k, v in flat.items()}, sep="/")
  )
  assert mesh_axes.target["dense"]["kernel"] == P(None, "model")
  assert mesh_axes.state.step is None
  momentum_like = (
    mesh_axes.state.param_states[0].mu
    if isinstance(opt_def, OptaxWrapper)
    else jax.tree.map(
      lambda s: s.momentum,
      mesh_axes.state.param_states,
      is_leaf=lambda x: isinstance(x, _ParamState),
    )
  )
  assert momentum_like["dense"]["kernel"] == P(None, "model")
  assert momentum_like["head"]["bias"] == P("model")


def test_size_one_dims_keep_their_spec():
  """T5X optimizers_test test_logical_axes_adamw: a (1,) bias keeps ('vocab',)."""
  opt = OptaxWrapper(optax.adamw(0.1)).create(make_params())
  logical = opt.optimizer_def.derive_logical_axes(opt, AXES)
  assert logical.state.param_states[0].mu == AXES
  assert logical.state.param_states[0].nu == AXES
  assert logical.state.param_states[0].count is None


def test_legacy_definition_on_our_base_classes():
  """T5X's Adafactor subclasses OptimizerDef; such definitions work unchanged."""
  opt_def = PerParamMomentum()
  state = train_state(opt_def)
  assert state.optimizer.optimizer_def.param_axes == AXES
  state = state.apply_gradient(grads_for(state.params), learning_rate=0.5)
  expected = make_params()["dense"]["kernel"] - 0.5 * 0.25
  np.testing.assert_array_equal(state.params["dense"]["kernel"], expected)
  flat = traverse_util.flatten_dict(state.state_dict(), sep="/")
  assert "state/param_states/dense/kernel/momentum" in flat
  restored = state.restore_state(jax.tree.map(np.asarray, state.state_dict()))
  assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), restored, state))


@pytest.mark.slow
def test_whole_train_state_dict_passed_to_optimizer_restore_state():
  """T5X train_state.py:209: Optimizer.restore_state gets flax_mutables too."""
  opt = adamw_opt()
  state_dict = {**opt.state_dict(), "flax_mutables": {"stats": {"count": np.ones(2)}}}
  restored = opt.restore_state(state_dict)
  np.testing.assert_array_equal(restored.state.step, opt.state.step)


def test_replace_step_with_none_on_a_spec_tree():
  """T5X train_state.py:204 on a logical-axes state (test_utils.py:389)."""
  opt = adamw_opt()
  logical = opt.optimizer_def.derive_logical_axes(opt, AXES)
  state_dict = logical.state_dict()
  state_dict["state"]["step"] = None
  assert logical.restore_state(state_dict).state.step is None


@pytest.mark.parametrize("kind", ["spec", "abstract"])
def test_state_dict_of_spec_and_abstract_trees(kind):
  """T5X checkpoints.py:693/701: state_dict() of PartitionSpec and ShapeDtypeStruct trees."""
  opt = adamw_opt()
  if kind == "spec":
    tree = opt.optimizer_def.derive_logical_axes(opt, AXES)
  else:
    tree = jax.eval_shape(lambda: opt)
  flat = traverse_util.flatten_dict(tree.state_dict(), sep="/")
  assert set(flat) == set(traverse_util.flatten_dict(opt.state_dict(), sep="/"))
  assert tree.restore_state(tree.state_dict()) is not None


def test_lazy_arrays_are_placed_and_restore_dtype_is_kept():
  """T5X checkpoints.py:1153: lazy leaves; params cast to restore_dtype keep it."""
  opt = adamw_opt()
  state_dict = jax.tree.map(np.asarray, opt.state_dict())
  state_dict["target"] = jax.tree.map(lambda x: Lazy(x.astype(jnp.bfloat16)), state_dict["target"])
  lazy = opt.restore_state(state_dict)
  kernel = lazy.target["dense"]["kernel"]
  assert isinstance(kernel, Lazy) and kernel.dtype == jnp.bfloat16
  materialised = jax.tree.map(lambda x: x.get() if isinstance(x, Lazy) else x, state_dict)
  restored = opt.restore_state(materialised)
  assert restored.target["dense"]["kernel"].dtype == jnp.bfloat16
  assert restored.state.param_states[0].mu["dense"]["kernel"].dtype == jnp.float32


def test_lazy_array_of_wrong_shape_is_refused_with_its_path():
  opt = adamw_opt()
  state_dict = opt.state_dict()
  state_dict["target"]["head"]["bias"] = Lazy(np.zeros(3, np.float32))
  with pytest.raises(ValueError, match=r"Shape mismatch at 'target/head/bias'"):
    opt.restore_state(state_dict)


def test_none_for_absent_leaves_is_placed():
  """T5X checkpoints.py:2502 (Orbax path): None where a checkpoint has no value."""
  opt = adamw_opt()
  state_dict = opt.state_dict()
  state_dict["state"]["param_states"]["0"]["nu"]["head"]["bias"] = None
  assert opt.restore_state(state_dict).state.param_states[0].nu["head"]["bias"] is None


def test_empty_nodes_from_keep_empty_nodes_flattening_are_accepted():
  opt = adamw_opt()
  state_dict = opt.state_dict()
  state_dict["state"]["param_states"]["1"] = traverse_util.empty_node
  restored = opt.restore_state(state_dict)
  assert isinstance(restored.state.param_states[1], optax.EmptyState)


def test_multi_optimizer_uses_t5x_layout_for_per_param_states():
  """T5X's MultiOptimizer: state/param_states/<param path>/..., frozen params None."""
  opt_def = MultiOptimizer(
    [("kernel", PerParamMomentum(0.1)), ("dense/bias", PerParamMomentum(0.2))]
  )
  opt = opt_def.create(make_params()).apply_gradient(grads_for(make_params()))
  state_dict = opt.state_dict()
  flat = traverse_util.flatten_dict(state_dict, sep="/")
  assert sorted(k for k in flat if k.startswith("state/")) == [
    "state/param_states/dense/bias/momentum",
    "state/param_states/dense/bias/scale",
    "state/param_states/dense/kernel/momentum",
    "state/param_states/dense/kernel/scale",
    "state/param_states/head/bias",
    "state/step",
  ]
  assert flat["state/param_states/head/bias"] is None
  # A checkpoint of one per-param optimizer over the same params restores
  # into the MultiOptimizer and back.
  single = PerParamMomentum(0.1).create(make_params())
  single_dict = single.state_dict()
  single_dict["state"]["param_states"]["head"]["bias"] = None
  restored = opt.restore_state(jax.tree.map(np.asarray, single_dict))
  assert restored.state_dict()["state"]["param_states"]["dense"]["kernel"]["momentum"].sum() == 0
  again = opt.restore_state(jax.tree.map(np.asarray, state_dict))
  assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), again, opt))


def test_multi_optimizer_t5x_layout_errors_name_full_paths():
  opt_def = MultiOptimizer([("kernel", PerParamMomentum()), ("bias", PerParamMomentum())])
  opt = opt_def.create(make_params())
  state_dict = opt.state_dict()
  del state_dict["state"]["param_states"]["dense"]["kernel"]["momentum"]
  with pytest.raises(ValueError, match=r"Missing key 'state/param_states/dense/kernel/momentum'"):
    opt.restore_state(state_dict)


def test_multi_optimizer_of_optax_keeps_indexed_layout():
  opt_def = MultiOptimizer(
    [("kernel", OptaxWrapper(optax.adam(0.1))), ("bias", OptaxWrapper(optax.sgd(0.1)))]
  )
  flat = traverse_util.flatten_dict(opt_def.create(make_params()).state_dict(), sep="/")
  assert "state/param_states/0/param_states/0/mu/dense/kernel" in flat


def test_multi_optimizer_set_param_axes_and_logical_axes_with_legacy_definitions():
  """T5X's train state calls set_param_axes, then derive_logical_axes through sub-optimizers."""
  kernels, biases = PerParamMomentum(), PerParamMomentum()
  opt_def = MultiOptimizer([("kernel", kernels), ("bias", biases)])
  opt_def.set_param_axes(AXES)
  assert kernels.param_axes == {"dense": {"kernel": P("embed", "mlp")}}
  opt = opt_def.create(make_params())
  logical = opt_def.derive_logical_axes(opt, AXES)
  flat = traverse_util.flatten_dict(logical.state_dict(), sep="/")
  assert flat["state/param_states/head/bias/momentum"] == P("vocab")
  assert flat["state/param_states/dense/kernel/scale"] is None


def test_multi_optimizer_takes_definitions_on_t5xs_own_base_classes():
  """With T5X installed, gin's adafactor.Adafactor subclasses T5X's OptimizerDef, not ours."""
  kernels = ForeignPerParamMomentum(0.1)
  opt_def = MultiOptimizer([("kernel", kernels), ("bias", OptaxWrapper(optax.sgd(0.5)))])
  state = train_state(opt_def)
  given = state.optimizer.optimizer_def.sub_optimizers[0]
  assert given.param_axes == {"dense": {"kernel": P("embed", "mlp")}}
  with pytest.warns(UserWarning, match="the override is ignored"):
    state = state.apply_gradient(grads_for(state.params), learning_rate=0.2)
  np.testing.assert_array_equal(
    state.params["dense"]["kernel"], make_params()["dense"]["kernel"] - 0.2 * 0.25
  )
  # optax's own learning rate applies to an optax sub-optimizer, as in T5X.
  np.testing.assert_array_equal(state.params["dense"]["bias"], -0.5 * 0.25 * np.ones(8))
  assert isinstance(state._optimizer.state.param_states[0], ForeignOptimizerState)
  flat = traverse_util.flatten_dict(state.state_dict(), sep="/")
  assert "state/param_states/0/param_states/dense/kernel/momentum" in flat
  restored = state.restore_state(jax.tree.map(np.asarray, state.state_dict()))
  assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), restored, state))
  logical = opt_def.derive_logical_axes(state._optimizer, AXES)
  flat_axes = traverse_util.flatten_dict(logical.state_dict(), sep="/")
  assert flat_axes["state/param_states/0/param_states/dense/kernel/momentum"] == P("embed", "mlp")


def test_multi_optimizer_names_what_a_non_definition_lacks():
  message = r"pair 1 is a \w+, not an OptimizerDef \(it has no hyper_params, init_state, "
  with pytest.raises(TypeError, match=message):
    MultiOptimizer([("kernel", PerParamMomentum()), ("bias", optax.sgd(0.1))])


@pytest.mark.parametrize(
  "opt_def",
  [
    OptaxWrapper(optax.adamw(0.1)),
    PerParamMomentum(),
    MultiOptimizer([("kernel", PerParamMomentum())]),
  ],
  ids=["optax", "legacy", "multi"],
)
def test_float32_counters_from_t5xs_orbax_checkpointer_restore_as_int32(opt_def):
  """T5X's Orbax checkpointer casts every restored array, step included, to float32."""
  state = train_state(opt_def).apply_gradient(grads_for(make_params()), learning_rate=0.1)
  state_dict = state.state_dict()
  saved = jax.tree.map(lambda x: np.asarray(x, np.float32), state_dict)
  restored = state.restore_state(saved)
  int_leaves = [x for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.integer)]
  assert int_leaves and restored.step.dtype == jnp.int32 and int(restored.step) == 1
  back = [x for x in jax.tree.leaves(restored) if jnp.issubdtype(x.dtype, jnp.integer)]
  assert [(x.dtype, int(x)) for x in back] == [(x.dtype, int(x)) for x in int_leaves]
  saved["state"]["step"] = np.float32(1.5)
  with pytest.raises(
    ValueError,
    match=r"Dtype mismatch at 'state/step': the state dict has "
    r"float32, which cannot be cast safely to the optimizer's int32 \(not every",
  ):
    state.restore_state(saved)


@pytest.mark.parametrize(
  "sub", [PerParamMomentum, ForeignPerParamMomentum], ids=["ours", "t5x_base_classes"]
)
def test_restored_multi_optimizer_state_donates_to_a_jitted_step(sub):
  """T5X's trainer donates the train state; a restored step must not sit in two places."""
  state = train_state(MultiOptimizer([("kernel", sub(0.1)), ("bias", sub(0.2))]))
  restored = state.restore_state(jax.tree.map(jnp.asarray, state.state_dict()))
  steps = [restored._optimizer.state.step] + [
    s.step for s in restored._optimizer.state.param_states
  ]
  assert len({x.unsafe_buffer_pointer() for x in steps}) == len(steps)
  step = jax.jit(lambda s, g: s.apply_gradient(g, learning_rate=0.1), donate_argnums=0)
  np.testing.assert_array_equal(step(restored, grads_for(make_params())).step, 1)


@pytest.mark.parametrize(
  "opt_def",
  [
    OptaxWrapper(optax.sgd(0.1)),
    MultiOptimizer(
      [("kernel", OptaxWrapper(optax.adam(0.1))), ("bias", OptaxWrapper(optax.sgd(0.1)))]
    ),
  ],
  ids=["sgd", "multi_of_adam_and_sgd"],
)
def test_state_dicts_hold_no_empty_subtree(opt_def):
  """T5X's OptaxWrapper removes every empty dict; T5X's checkpointer fails on them on resume."""
  flat = traverse_util.flatten_dict(
    opt_def.create(make_params()).state_dict(), keep_empty_nodes=True, sep="/"
  )
  assert [k for k, v in flat.items() if v is traverse_util.empty_node] == []
  assert not any(k.startswith("state/param_states/1/param_states") for k in flat)


def test_a_nested_multi_optimizer_passes_its_subs_hyper_parameters_on():
  """A sub-definition's own hyper_param_names (a MultiOptimizer's) is asked, not bypassed."""
  inner = MultiOptimizer([("kernel", PerParamMomentum(0.1)), ("dense/bias", PerParamMomentum())])
  outer = MultiOptimizer([("dense", inner), ("head", PerParamMomentum())])
  assert {"learning_rate", "beta"} <= outer.hyper_param_names()
  opt = outer.create(make_params()).apply_gradient(grads_for(make_params()), learning_rate=0.5)
  np.testing.assert_array_equal(opt.target["dense"]["kernel"], 0.5 - 0.5 * 0.25)
