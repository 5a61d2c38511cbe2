"""Sharded training through TrainState + Partitioner on 8 simulated CPU devices.

Device-count errors are covered by tests/test_mesh.py::test_layout_errors.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.linen import partitioning as flax_partitioning
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from t5x_optim import OptaxWrapper, QuantizedLeaf, TrainState, low_precision
from t5x_optim._axes.auto import auto_axes_like, update_layouts
from t5x_optim.optimizers import example_lib_adam, example_lib_sm3
from t5x_optim.partitioning import (
  Partitioner,
  abstract_train_state,
  create_mesh,
  init_sharded,
  logical_to_mesh_axes_tree,
  optimizer_state_mesh_axes_tree,
  standard_logical_axis_rules,
)

pytestmark = pytest.mark.usefixtures("shared_compilation_cache")

EMBED, MLP, BATCH, STEPS = 16, 32, 8, 3
BATCH_AXES = {"x": P("batch", "embed"), "y": P("batch", "embed")}


class AxesMLP(nn.Module):
  """T5X style: param_with_axes and a params_axes collection."""

  mlp_axis: str = "mlp"
  mlp: int = MLP

  @nn.compact
  def __call__(self, x):
    def param(name, shape, axes, init=nn.initializers.lecun_normal()):
      return flax_partitioning.param_with_axes(name, init, shape, axes=axes)

    wi = param("wi", (EMBED, self.mlp), ("embed", self.mlp_axis))
    bi = param("bi", (self.mlp,), (self.mlp_axis,), nn.initializers.zeros)
    wo = param("wo", (self.mlp, EMBED), (self.mlp_axis, "embed"))
    return nn.relu(x @ wi + bi) @ wo


class BoxedMLP(nn.Module):
  """Flax style: nn.with_logical_partitioning boxes."""

  @nn.compact
  def __call__(self, x):
    def dense(features, axes, name):
      return nn.Dense(
        features,
        name=name,
        kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), axes),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, axes[1:]),
      )

    return dense(EMBED, ("mlp", "embed"), "wo")(nn.relu(dense(MLP, ("embed", "mlp"), "wi")(x)))


OPTIMIZERS = {
  "adamw": lambda: optax.adamw(1e-2),
  "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=EMBED),
  "multisteps_adamw": lambda: optax.MultiSteps(optax.adamw(1e-2), every_k_schedule=2),
  "clip_adamw": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)),
}
# Optimizers run through the fused update (the Pallas kernel in interpret mode);
# their unsharded reference is the plain path.
FUSED = {"fused_clip_adamw": "clip_adamw"}
MODELS = {"axes": AxesMLP(), "boxed": BoxedMLP()}
MESHES = [(1, 8), (2, 4), (4, 2)]
CASES = [
  ("axes", "adamw"),
  ("axes", "adafactor"),
  ("axes", "multisteps_adamw"),
  ("boxed", "adamw"),
  ("axes", "fused_clip_adamw"),
]


@functools.cache
def _opt_def(name):
  if name in FUSED:
    return OptaxWrapper(OPTIMIZERS[FUSED[name]](), fused="interpret")
  return OptaxWrapper(OPTIMIZERS[name]())


def _batch(step):
  rng = np.random.default_rng(step + 1)
  return {
    "x": jnp.asarray(rng.standard_normal((BATCH, EMBED)), jnp.float32),
    "y": jnp.asarray(rng.standard_normal((BATCH, EMBED)), jnp.float32),
  }


def _train_step(model, state, batch):
  def loss_fn(params):
    out = model.apply({"params": params}, batch["x"])
    return jnp.mean((out - batch["y"]) ** 2)

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradient(grads), loss


def _init_args():
  return jax.random.key(0), jnp.ones((BATCH, EMBED))


def _run(state, step_fn):
  losses = []
  for step in range(STEPS):
    state, loss = step_fn(state, _batch(step))
    losses.append(float(loss))
  return state, losses


@functools.cache
def _variables(model_name):
  """The model's initial variables, on the host (so every run starts from copies)."""
  return jax.device_get(MODELS[model_name].init(*_init_args()))


@functools.cache
def _unsharded(model_name, opt_name):
  state = TrainState.create(_opt_def(opt_name), _variables(model_name))
  return _run(state, jax.jit(functools.partial(_train_step, MODELS[model_name])))


def _partitioner(data, model, *, zero, axis_types=AxisType.Auto):
  return Partitioner(
    create_mesh(shape={"data": data, "model": model}, axis_types=axis_types),
    standard_logical_axis_rules(shard_optimizer_state_over_data=zero),
  )


def _sharded(model_name, opt_name, partitioner):
  """Trains from the unsharded run's initial values, placed with the partitioner's shardings."""
  state = TrainState.create(_opt_def(opt_name), _variables(model_name))
  shardings = partitioner.get_shardings(state)
  step_fn = partitioner.partition(
    functools.partial(_train_step, MODELS[model_name]),
    (shardings, BATCH_AXES),
    (shardings, None),
    donate_argnums=0,
  )
  return _run(jax.device_put(state, shardings), step_fn)


def _expected_specs(state, partitioner):
  """The mesh specs the rules imply: params by the rules, state also with ZeRO."""
  logical = state.as_logical_axes()
  rules = partitioner.logical_axis_rules
  return (
    logical_to_mesh_axes_tree(logical.params, rules),
    optimizer_state_mesh_axes_tree(
      logical.param_states, state.param_states, rules, mesh_shape=partitioner.mesh.shape
    ),
  )


def _actual_specs(tree):
  return _normalized(jax.tree.map(lambda x: x.sharding.spec, tree))


def _normalized(specs):
  """None (replicated) as P(), trailing Nones dropped, so equal shardings compare equal."""

  def norm(spec):
    entries = list(spec or ())
    while entries and entries[-1] is None:
      entries.pop()
    return P(*entries)

  return jax.tree.map(norm, specs, is_leaf=lambda x: x is None or isinstance(x, P))


def _state_bytes_per_device(state):
  """Bytes of device 0's shards of the non-trivial optimizer-state leaves."""
  leaves = [x for x in jax.tree.leaves(state.param_states) if x.size > 1]
  return sum(x.addressable_shards[0].data.nbytes for x in leaves)


@pytest.mark.slow
@pytest.mark.filterwarnings("error:OptaxWrapper\\(fused=")  # the fused case must fuse
@pytest.mark.parametrize("data, model", MESHES)
@pytest.mark.parametrize("model_name, opt_name", CASES)
def test_sharded_training_matches_unsharded(model_name, opt_name, data, model):
  """With and without ZeRO; on a data axis of size 1 ZeRO changes nothing, so it is skipped."""
  _, expected_losses = _unsharded(model_name, FUSED.get(opt_name, opt_name))
  state_bytes = {}
  for zero in (False, True) if data > 1 else (False,):
    partitioner = _partitioner(data, model, zero=zero)
    state, losses = _sharded(model_name, opt_name, partitioner)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5, atol=1e-7)
    param_specs, state_specs = _expected_specs(state, partitioner)
    assert _actual_specs(state.params) == _normalized(param_specs)
    assert _actual_specs(state.param_states) == _normalized(state_specs)
    assert state.step.sharding.spec == P() and int(state.step) == STEPS
    state_bytes[zero] = _state_bytes_per_device(state)
  if data > 1:
    assert state_bytes[False] == data * state_bytes[True]


def _grads(params):
  return jax.tree.map(lambda x: jnp.sin(3.0 * x + 1.0), params)


def _optimizer_step(opt_def, axis_types, *, zero, extra_args=lambda grads: {}):
  """The jitted ``apply_gradient`` on a 2x4 mesh of ``axis_types``, and its inputs (the update
  alone: under Explicit axes the model's matmuls over a sharded ``mlp`` are type errors), with
  the update's extra arguments computed in the step from the grads."""
  partitioner = _partitioner(2, 4, zero=zero, axis_types=axis_types)
  state = TrainState.create(opt_def, _variables("axes"))
  shardings = partitioner.get_shardings(state)
  state, grads = jax.device_put((state, _grads(state.params)), (shardings, shardings.params))
  step = jax.jit(
    lambda s, g: s.apply_gradient(g, **extra_args(g)),
    in_shardings=(shardings, shardings.params),
    out_shardings=shardings,
    donate_argnums=0,
  )
  return step, state, grads


def optimizer_steps(opt_def, axis_types, *, zero, steps=2, extra_args=lambda grads: {}):
  """``steps`` calls of `_optimizer_step`."""
  step, state, grads = _optimizer_step(opt_def, axis_types, zero=zero, extra_args=extra_args)
  for _ in range(steps):
    state = step(state, grads)
  return state


def assert_explicit_as_auto(explicit, auto):
  """The same shardings and state; params to float32 rounding (XLA fuses the two apart)."""
  specs = [_normalized(x.sharding.spec) for x in jax.tree.leaves(explicit)]
  assert specs == [_normalized(x.sharding.spec) for x in jax.tree.leaves(auto)]
  for x, y in zip(jax.tree.leaves(explicit.param_states), jax.tree.leaves(auto.param_states)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  for x, y in zip(jax.tree.leaves(explicit.params), jax.tree.leaves(auto.params), strict=True):
    np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)


def _value(grads):
  """An extra update argument computed in the step: a loss-like scalar."""
  return {"value": jnp.sum(grads["wi"] ** 2)}


EXPLICIT_CASES = {
  **{name: (lambda name=name: _opt_def(name), lambda grads: {}) for name in [*OPTIMIZERS, *FUSED]},
  "reduce_on_plateau": (
    lambda: OptaxWrapper(optax.chain(optax.adam(1e-2), optax.contrib.reduce_on_plateau())),
    _value,
  ),
  "example_lib_sm3": (lambda: example_lib_sm3(1e-2), lambda grads: {}),
}


@pytest.mark.slow
@pytest.mark.parametrize(
  "case, zero, axis_types",
  [
    *[(case, zero, (AxisType.Explicit,) * 2) for case in EXPLICIT_CASES for zero in (False, True)],
    *[(case, True, (AxisType.Explicit, AxisType.Auto)) for case in ("adamw", "fused_clip_adamw")],
  ],
  ids=lambda value: {
    (AxisType.Explicit,) * 2: "explicit",
    (AxisType.Explicit, AxisType.Auto): "explicit_data_auto_model",
    False: "replicated_state",
    True: "zero",
  }.get(value),
)
def test_explicit_mesh_axes_update_as_auto(case, zero, axis_types):
  """On a mesh with Explicit axes (`jax.make_mesh`'s default) the update runs as on Auto axes.

  With ZeRO a moment is sharded over ``data`` and its gradient is not: under
  Explicit axes their sum is a type error unless the update runs with the axes Auto.
  An extra argument computed in the step (``value``) and a shape kept in a
  state (sm3's) pass through. A mesh may mix Explicit and Auto axes.
  """
  make, extra_args = EXPLICIT_CASES[case]
  explicit = optimizer_steps(make(), axis_types, zero=zero, extra_args=extra_args)
  assert jax.typeof(explicit.params["wi"]).sharding.mesh.axis_types == axis_types
  auto = optimizer_steps(make(), AxisType.Auto, zero=zero, extra_args=extra_args)
  assert_explicit_as_auto(explicit, auto)


@pytest.mark.slow
@pytest.mark.parametrize("zero", [False, True], ids=["replicated_state", "zero"])
def test_eager_apply_gradient_of_a_created_state_on_explicit_mesh_axes(zero):
  """``create`` of params placed on Explicit axes, then an unjitted ``apply_gradient``: optax's
  init makes the step count on one device, which goes onto the mesh with the axes Auto only
  in the mesh's context (it failed: "Please enter your `jit` into a mesh context")."""
  optimizers = {}
  for axis_types in (AxisType.Explicit, AxisType.Auto):
    partitioner = _partitioner(2, 4, zero=zero, axis_types=axis_types)
    fresh = TrainState.create(_opt_def("adamw"), _variables("axes"))
    params = jax.device_put(fresh.params, partitioner.get_shardings(fresh).params)
    optimizers[axis_types] = _opt_def("adamw").create(params).apply_gradient(_grads(params))
  explicit, auto = optimizers[AxisType.Explicit], optimizers[AxisType.Auto]
  assert jax.typeof(explicit.target["wi"]).sharding.spec == P(None, "model")
  for x, y in zip(jax.tree.leaves(explicit), jax.tree.leaves(auto), strict=True):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["float32", "8bit", "bfloat16", "example_lib"])
def test_explicit_mesh_axes_zero_step_peaks_as_on_auto(mode):
  """The compiled step's peak: under Explicit axes each param is read in its ZeRO moment's
  layout, so XLA gathers the new params only, as on Auto axes (held in its own layout, every
  leaf's update was gathered first: 4,576 bytes per device where Auto's are 4,032 with adamw,
  5,940 where 4,916 with 8-bit states, 4,564 where 4,020 with example_lib's adam)."""
  if mode == "example_lib":
    opt_def = example_lib_adam(1e-2)
  elif mode == "float32":
    opt_def = OptaxWrapper(optax.adamw(1e-2))
  else:
    opt_def = OptaxWrapper(
      low_precision(optax.adamw(1e-2), mode, block_size=4, shard_multiple=4, min_size=0)
    )

  def peak(axis_types):
    step, state, grads = _optimizer_step(opt_def, axis_types, zero=True)
    m = step.lower(state, grads).compile().memory_analysis()
    return (
      m.argument_size_in_bytes
      + m.output_size_in_bytes
      + m.temp_size_in_bytes
      - m.alias_size_in_bytes
    )

  assert peak(AxisType.Explicit) == peak(AxisType.Auto)


def test_update_layouts_take_the_most_sharded_mirror_of_each_param():
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)

  def put(shape, spec):
    return jax.device_put(jnp.zeros(shape), jax.NamedSharding(mesh, spec))

  params = {"b": put((16,), P("model")), "w": put((8, 16), P())}
  state = {
    "mu": {"b": put((16,), P(("model", "data"))), "w": put((8, 16), P("data"))},
    "nu": {"b": put((16,), P()), "w": put((8, 16), P(None, "model"))},
    "elsewhere": put((8, 16), P(("data", "model"))),  # the shape of w, but no mirror
  }
  assert update_layouts(params, state) == [P(("model", "data")), P(None, "model")]
  assert update_layouts(params["w"], state) == [P(("data", "model"), None)]
  assert update_layouts(jax.device_get(params), jax.device_get(state)) is None


def test_update_layouts_find_a_mirror_with_a_whole_subtree_masked_out():
  """optax.masked with a mask that is a prefix of the params: a MaskedNode stands for the
  whole 'enc' subtree, and the moments still mirror 'dec', plain or compressed."""
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)

  def put(shape, spec):
    return jax.device_put(jnp.zeros(shape), jax.NamedSharding(mesh, spec))

  params = {"dec": {"w": put((8, 16), P())}, "enc": {"w": put((8, 16), P())}}
  zero = {"w": put((8, 16), P("data", "model"))}
  compressed = {"w": QuantizedLeaf(put((8, 16), P("data", "model")), put((8, 1), P("data")))}
  for moment in (zero, compressed):
    state = (optax.MaskedNode(), {"dec": moment, "enc": optax.MaskedNode()})
    assert update_layouts(params, state) == [P("data", "model"), P(None, None)]


def test_an_update_that_returns_other_leaves_than_it_replaces_is_refused():
  mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Explicit,))
  x = jax.device_put(jnp.ones(8), jax.NamedSharding(mesh, P("x")))
  twice = auto_axes_like(lambda x: (x, x), x)
  with pytest.raises(
    ValueError, match=r"'<lambda>' returned PyTreeDef\(\(\*, \*\)\) where the leaves"
  ):
    jax.jit(twice)(x)
  np.testing.assert_array_equal(jax.jit(auto_axes_like(lambda x: 2 * x, x))(x), 2 * np.ones(8))


@pytest.mark.parametrize(
  "zero, wi, mu_wi, mu_bi",
  [
    (False, P(None, "model"), P(None, "model"), P("model")),
    (True, P(None, "model"), P("data", "model"), P(("model", "data"))),
  ],
)
def test_adamw_shardings_on_2x4(zero, wi, mu_wi, mu_bi):
  state = abstract_train_state(
    _partitioner(2, 4, zero=zero), _opt_def("adamw"), AxesMLP().init, *_init_args()
  )
  assert state.params["wi"].sharding.spec == wi
  mu = state.param_states[0].mu
  assert (mu["wi"].sharding.spec, mu["bi"].sharding.spec) == (mu_wi, mu_bi)
  assert state.param_states[0].count.sharding.spec == P()


@pytest.mark.slow
@pytest.mark.parametrize("zero", [False, True])
def test_init_sharded_holds_no_full_replica_of_a_sharded_leaf(zero):
  partitioner = _partitioner(2, 4, zero=zero)
  opt_def = _opt_def("adafactor")
  abstract = abstract_train_state(partitioner, opt_def, AxesMLP().init, *_init_args())
  state = init_sharded(partitioner, opt_def, AxesMLP().init, *_init_args())
  targets = jax.tree.leaves(jax.tree.map(lambda x: x.sharding, abstract))
  leaves = jax.tree.leaves(state)
  assert [x.sharding for x in leaves] == targets
  sharded = [x for x in leaves if not x.sharding.is_fully_replicated]
  assert len(sharded) >= len(jax.tree.leaves(state.params))
  for leaf in sharded:
    shapes = {shard.data.shape for shard in leaf.addressable_shards}
    assert shapes == {leaf.sharding.shard_shape(leaf.shape)}
    assert leaf.shape not in shapes


@pytest.mark.slow
@pytest.mark.parametrize("model_name, zero", [("axes", True), ("boxed", False)])
def test_init_sharded_on_explicit_mesh_axes_as_on_auto(model_name, zero):
  """Flax's logical constraints assert under Explicit axes (the new param is replicated, its
  target is not); the initialisation runs with the axes Auto, and each leaf comes back with
  Auto's values and specs, typed Explicit."""
  states = {}
  for axis_types in (AxisType.Auto, AxisType.Explicit):
    partitioner = _partitioner(2, 4, zero=zero, axis_types=axis_types)
    init = MODELS[model_name].init
    abstract = abstract_train_state(partitioner, _opt_def("adamw"), init, *_init_args())
    state = init_sharded(partitioner, _opt_def("adamw"), init, *_init_args())
    assert [jax.typeof(x).sharding.mesh.axis_types for x in jax.tree.leaves(state)] == [
      (axis_types,) * 2
    ] * len(jax.tree.leaves(state))
    assert [x.sharding for x in jax.tree.leaves(state)] == [
      x.sharding for x in jax.tree.leaves(abstract)
    ]
    states[axis_types] = state
  auto, explicit = states[AxisType.Auto], states[AxisType.Explicit]
  specs = [_normalized(x.sharding.spec) for x in jax.tree.leaves(auto)]
  assert [_normalized(x.sharding.spec) for x in jax.tree.leaves(explicit)] == specs
  assert any(spec != P() for spec in specs)
  for x, y in zip(jax.tree.leaves(explicit), jax.tree.leaves(auto), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize(
  "module, match",
  [
    (
      AxesMLP(mlp_axis="expert"),
      r"_optimizer/state/param_states/0/mu/bi: No logical axis rule for \['expert'\]",
    ),
    (
      AxesMLP(mlp=6),
      # The param itself (its state would be replicated along the dimension).
      r"_optimizer/target/bi: dimension 0 of shape \(6,\) is not "
      r"divisible by mesh axis 'model' of size 4",
    ),
  ],
)
def test_init_errors_name_the_leaf(module, match):
  with pytest.raises(ValueError, match=match):
    init_sharded(_partitioner(2, 4, zero=False), _opt_def("adamw"), module.init, *_init_args())
