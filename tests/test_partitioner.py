"""Tests for Partitioner on 8 simulated CPU devices."""

import functools

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from t5x_optim import OptaxWrapper, Optimizer, OptimizerState
from t5x_optim._training.partitioner import is_optimizer_state_path
from t5x_optim.partitioning import (
  Partitioner,
  StateRulesFallback,
  UnknownAxis,
  abstract_train_state,
  build_plan,
  create_mesh,
  format_bytes,
  format_table,
  init_sharded,
  logical_to_mesh_axes_tree,
  optimizer_state_mesh_axes_tree,
  plan_to_json,
  standard_logical_axis_rules,
)

MESHES = [(2, 4), (4, 2)]

PARAM_AXES = {
  "dense1": {"kernel": P("embed", "mlp"), "bias": P("mlp")},
  "dense2": {"kernel": P("mlp", "embed"), "bias": P("embed")},
}
BATCH_AXES = {"x": P("batch", "embed"), "y": P("batch", "embed")}
EMBED, MLP, BATCH = 8, 16, 8


def _partitioner(data, model, **rule_flags):
  mesh = create_mesh(shape={"data": data, "model": model})
  return Partitioner(mesh, standard_logical_axis_rules(**rule_flags))


def _normal(rng, shape, scale=1.0):
  return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)


def _params():
  rng = np.random.default_rng(0)
  return {
    "dense1": {"kernel": _normal(rng, (EMBED, MLP), 0.25), "bias": jnp.zeros(MLP)},
    "dense2": {"kernel": _normal(rng, (MLP, EMBED), 0.25), "bias": jnp.zeros(EMBED)},
  }


def _batch(step):
  rng = np.random.default_rng(step + 1)
  return {"x": _normal(rng, (BATCH, EMBED)), "y": _normal(rng, (BATCH, EMBED))}


def _loss(params, batch):
  h = nn.relu(batch["x"] @ params["dense1"]["kernel"] + params["dense1"]["bias"])
  out = h @ params["dense2"]["kernel"] + params["dense2"]["bias"]
  return jnp.mean((out - batch["y"]) ** 2)


TX = optax.adamw(1e-2)
STATE_AXES = (
  optax.ScaleByAdamState(count=None, mu=PARAM_AXES, nu=PARAM_AXES),
  optax.EmptyState(),
  optax.EmptyState(),
)


def _train_step(params, opt_state, batch):
  loss, grads = jax.value_and_grad(_loss)(params, batch)
  updates, opt_state = TX.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def _unsharded_run(steps):
  params, opt_state = _params(), TX.init(_params())
  losses = []
  for step in range(steps):
    params, opt_state, loss = _train_step(params, opt_state, _batch(step))
    losses.append(loss)
  return params, losses


def _specs(tree):
  return jax.tree.map(lambda x: x.sharding.spec, tree)


@pytest.mark.parametrize(
  "data, model", [pytest.param(*MESHES[0], marks=pytest.mark.slow), MESHES[1]]
)
def test_partitioned_matmul_matches_unjitted(data, model):
  partitioner = _partitioner(data, model)

  def fn(x, w):
    return {"h": x @ w, "col": w.sum(0)}

  out_axes = {"h": P("batch", "mlp"), "col": P("mlp")}
  partitioned = partitioner.partition(fn, (P("batch", "embed"), P("embed", "mlp")), out_axes)
  x, w = _batch(0)["x"], _params()["dense1"]["kernel"]
  out = partitioned(x, w)
  assert _specs(out) == {"h": P("data", "model"), "col": P("model")}
  assert out["h"].sharding == NamedSharding(partitioner.mesh, P("data", "model"))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), out, fn(x, w))


def test_static_and_prefix_axis_resources():
  partitioner = _partitioner(2, 4)
  scale = partitioner.partition(
    lambda k, batch: jax.tree.map(lambda v: k * v, batch), P("batch"), P("batch"), static_argnums=0
  )
  out = scale(3.0, _batch(0))
  assert _specs(out) == {"x": P("data"), "y": P("data")}
  np.testing.assert_allclose(out["x"], 3.0 * _batch(0)["x"], rtol=1e-6)


def test_none_axis_resources_are_replicated():
  partitioner = _partitioner(2, 4)
  tree = {"a": None, "b": P("batch", "embed"), "e": optax.EmptyState()}
  shardings = partitioner.mesh_sharding(tree)
  assert shardings["a"].spec == P() and shardings["b"].spec == P("data", None)
  assert shardings["e"] == optax.EmptyState()


def test_repeated_mesh_axis_is_resolved_by_rule_order():
  partitioner = _partitioner(2, 4, parameter_partitioning_dims=2)
  assert partitioner.mesh_sharding(P("batch", "embed")).spec == P("data", None)
  assert partitioner.mesh_sharding(P("embed", "mlp")).spec == P("data", "model")


def _sharded_run(partitioner, steps):
  mesh_shape = partitioner.mesh.shape
  rules = partitioner.logical_axis_rules
  param_shardings = partitioner.mesh_sharding(PARAM_AXES)
  opt_state = TX.init(_params())
  state_shardings = partitioner.mesh_axes_to_sharding(
    optimizer_state_mesh_axes_tree(STATE_AXES, opt_state, rules, mesh_shape=mesh_shape)
  )
  step_fn = partitioner.partition(
    _train_step,
    (param_shardings, state_shardings, BATCH_AXES),
    (param_shardings, state_shardings, None),
    donate_argnums=(0, 1),
  )
  params = jax.device_put(_params(), param_shardings)
  opt_state = jax.device_put(opt_state, state_shardings)
  losses = []
  for step in range(steps):
    params, opt_state, loss = step_fn(params, opt_state, _batch(step))
    losses.append(loss)
  return params, opt_state, losses


def _per_device_bytes(tree):
  return sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(tree))


@pytest.mark.slow
@pytest.mark.parametrize("data, model", MESHES)
def test_sharded_adamw_train_step_matches_unsharded(data, model):
  steps = 3
  expected_params, expected_losses = _unsharded_run(steps)
  results = {}
  for zero in (False, True):
    partitioner = _partitioner(data, model, shard_optimizer_state_over_data=zero)
    params, opt_state, losses = _sharded_run(partitioner, steps)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), params, expected_params
    )
    expected_param_specs = logical_to_mesh_axes_tree(PARAM_AXES, partitioner.logical_axis_rules)
    assert _specs(params) == expected_param_specs
    expected_state_specs = optimizer_state_mesh_axes_tree(
      STATE_AXES, opt_state, partitioner.logical_axis_rules, mesh_shape=partitioner.mesh.shape
    )
    assert _specs(opt_state[0].mu) == expected_state_specs[0].mu
    assert opt_state[0].count.sharding.spec == P()
    results[zero] = _per_device_bytes((opt_state[0].mu, opt_state[0].nu))
  assert results[False] == data * results[True]


@flax.struct.dataclass
class _FakeTrainState:
  """Just enough of a train state for get_mesh_axes: params, step, param_states."""

  params: dict
  step: jax.Array
  param_states: tuple
  param_axes: dict = flax.struct.field(pytree_node=False, default=None)

  def as_logical_axes(self):
    return _FakeTrainState(
      params=self.param_axes,
      step=None,
      param_states=(
        optax.ScaleByAdamState(count=None, mu=self.param_axes, nu=self.param_axes),
        optax.EmptyState(),
        optax.EmptyState(),
      ),
      param_axes=self.param_axes,
    )


def _abstract_state(params, param_axes=PARAM_AXES):
  return jax.eval_shape(functools.partial(_fake_state, param_axes=param_axes), params)


def _fake_state(params, param_axes=PARAM_AXES):
  return _FakeTrainState(
    params=params,
    step=jnp.zeros((), jnp.int32),
    param_states=TX.init(params),
    param_axes=param_axes,
  )


@pytest.mark.parametrize(
  "zero, expected_mu_kernel1",
  [
    (False, P(None, "model")),
    (True, P("data", "model")),
  ],
)
def test_get_mesh_axes_maps_optimizer_state_with_zero_rules(zero, expected_mu_kernel1):
  partitioner = _partitioner(2, 4, shard_optimizer_state_over_data=zero)
  state = _abstract_state(_params())
  assert partitioner.get_logical_axes(state).params == PARAM_AXES
  mesh_axes = partitioner.get_mesh_axes(state)
  assert mesh_axes.params["dense1"]["kernel"] == P(None, "model")
  assert mesh_axes.step is None
  assert mesh_axes.param_states[0].mu["dense1"]["kernel"] == expected_mu_kernel1
  assert mesh_axes.param_states[1:] == (optax.EmptyState(), optax.EmptyState())
  shardings = partitioner.get_shardings(state)
  assert shardings.param_states[0].nu["dense1"]["kernel"].spec == expected_mu_kernel1
  assert shardings.step.spec == P()


def test_is_optimizer_state_path():
  leaves = jax.tree.leaves_with_path(_abstract_state(_params()))
  flagged = {jax.tree_util.keystr(path): is_optimizer_state_path(path) for path, _ in leaves}
  assert flagged[".params['dense1']['kernel']"] is False
  assert flagged[".step"] is False
  assert flagged[".param_states[0].mu['dense1']['kernel']"] is True


def test_get_mesh_axes_indivisible_dim_names_path_shape_and_axis():
  params = {"dense": {"kernel": jnp.zeros((8, 6))}}
  state = _abstract_state(params, {"dense": {"kernel": P("embed", "mlp")}})
  match = (
    r"params/dense/kernel: dimension 1 of shape \(8, 6\) "
    r"is not divisible by mesh axis 'model' of size 4"
  )
  with pytest.raises(ValueError, match=match):
    _partitioner(2, 4).get_mesh_axes(state)


def test_get_mesh_axes_unknown_name_names_path():
  params = {"dense": {"kernel": jnp.zeros((8, 8))}}
  state = _abstract_state(params, {"dense": {"kernel": P("embed", "expert")}})
  match = r"params/dense/kernel: No logical axis rule for \['expert'\]"
  with pytest.raises(ValueError, match=match):
    _partitioner(2, 4).get_mesh_axes(state)
  mesh = create_mesh(num_partitions=4)
  replicating = Partitioner(mesh, standard_logical_axis_rules(), unknown_axis=UnknownAxis.REPLICATE)
  assert replicating.get_mesh_axes(state).params["dense"]["kernel"] == P(None, None)


@pytest.mark.parametrize(
  "in_axes, out_axes, shape, match",
  [
    (
      {"w": P("embed", "mlp")},
      None,
      (8, 6),
      r"args/0/w: dimension 1 of shape \(8, 6\) is not divisible by mesh axis 'model' "
      r"of size 4",
    ),
    (
      None,
      {"w": P("batch", "mlp")},
      (5, 8),
      r"output/w: dimension 0 of shape \(5, 8\) is not divisible by mesh axis 'data' "
      r"of size 2",
    ),
  ],
)
def test_partition_indivisible_dim_names_path_shape_and_axis(in_axes, out_axes, shape, match):
  partitioned = _partitioner(2, 4).partition(lambda tree: tree, (in_axes,), out_axes)
  with pytest.raises(ValueError, match=match):
    partitioned({"w": np.ones(shape, np.float32)})


def test_partition_runs_with_logical_constraints_inside():
  partitioner = _partitioner(2, 4)

  def fn(x):
    return nn.with_logical_constraint(x * 2, P("batch", "embed"))

  partitioned = partitioner.partition(fn, P("batch", "embed"), P("batch", "embed"))
  out = partitioned(np.ones((8, 8), np.float32))
  np.testing.assert_allclose(out, 2.0)
  assert out.sharding.spec == P("data", None)


def test_lower_and_mesh_axis_errors():
  partitioner = Partitioner(create_mesh(num_partitions=4), [("batch", "replica")])
  with pytest.raises(ValueError, match=r"^x: .*replica"):
    partitioner.mesh_sharding({"x": P("batch")})
  ok = _partitioner(2, 4).partition(lambda x: x + 1, P("batch"), P("batch"))
  assert "add" in ok.lower(np.ones(4, np.float32)).as_text()


class _LegacyDef:
  """A T5X-style definition: subclasses nothing of ours and has no `fallback`."""

  def create(self, target):
    state = OptimizerState(
      step=jnp.zeros((), jnp.int32), param_states=jax.tree.map(jnp.zeros_like, target)
    )
    return Optimizer(optimizer_def=self, state=state, target=target)

  def derive_logical_axes(self, optimizer, param_logical_axes):
    state = OptimizerState(step=None, param_states=param_logical_axes)
    return optimizer.replace(target=param_logical_axes, state=state)


def _boxed_variables():
  return {"params": {"w": nn.LogicallyPartitioned(jnp.ones((8, 4)), ("embed", "mlp"))}}


def test_abstract_train_state_passes_the_definitions_fallback_through():
  partitioner = Partitioner(create_mesh(num_partitions=2))
  strict = OptaxWrapper(optax.adam(0.1), fallback=StateRulesFallback.RAISE)
  too_long = lambda: {"params": {"w": nn.LogicallyPartitioned(jnp.ones(4), ("embed", "mlp"))}}  # noqa: E731
  with pytest.raises(ValueError, match=r"0/mu/w \(shape \(4,\), spec"):
    abstract_train_state(partitioner, strict, too_long)
  # A definition without the setting (T5X's own) goes through unchanged.
  state = abstract_train_state(partitioner, _LegacyDef(), _boxed_variables)
  assert state.param_states["w"].shape == (8, 4)
  assert state.param_states["w"].sharding.spec == partitioner.get_mesh_axes(state).param_states["w"]


def test_optimizer_state_leaf_is_replicated_along_a_dimension_its_mesh_axis_does_not_divide():
  """A param's indivisible dimension is an error (above); a state leaf's is replicated."""
  params = {"dense1": {"kernel": jnp.zeros((8, 16))}}
  axes = {"dense1": {"kernel": P("embed", "mlp")}}
  state = _abstract_state(params, axes)
  state = state.replace(
    param_states=(
      state.param_states[0]._replace(mu={"dense1": {"kernel": jax.ShapeDtypeStruct((8, 2), "f4")}}),
      *state.param_states[1:],
    )
  )
  for zero, want in ((False, P(None, None)), (True, P("data", None))):
    specs = _partitioner(2, 4, shard_optimizer_state_over_data=zero).get_mesh_axes(state)
    assert specs.param_states[0].mu["dense1"]["kernel"] == want
    assert specs.param_states[0].nu["dense1"]["kernel"] in (P(None, "model"), P("data", "model"))
    assert specs.params["dense1"]["kernel"] == P(None, "model")
    tree = optimizer_state_mesh_axes_tree(
      state.as_logical_axes().param_states,
      state.param_states,
      standard_logical_axis_rules(shard_optimizer_state_over_data=zero),
      mesh_shape={"data": 2, "model": 4},
    )
    assert tree[0].mu["dense1"]["kernel"] == want


def _mlp_variables():
  return {
    "params": {
      "wi": nn.LogicallyPartitioned(jnp.ones((EMBED, MLP)), ("embed", "mlp")),
      "bi": nn.LogicallyPartitioned(jnp.zeros(MLP), ("mlp",)),
      "scale": nn.LogicallyPartitioned(jnp.ones(EMBED), ("embed",)),
    }
  }


@pytest.mark.parametrize("data, model", [(8, 1), (4, 2)])
def test_plan_calls_replicated_every_leaf_each_device_holds_whole(data, model):
  """On data=8 x model=1 the leaves sharded over model are held whole by every device: the
  plan calls them replicated (table, JSON, totals, warnings), as the real arrays' shards are."""
  partitioner = _partitioner(data, model)
  opt_def = OptaxWrapper(optax.adam(0.1))
  state = abstract_train_state(partitioner, opt_def, _mlp_variables)
  plan = build_plan(state, logical=state.as_logical_axes(), warn_replicated_bytes=1)
  real = init_sharded(partitioner, opt_def, _mlp_variables).param_states
  whole = {
    row.path: all(s.data.nbytes == leaf.nbytes for s in leaf.addressable_shards)
    for row, leaf in zip(plan.rows, jax.tree.leaves(real), strict=True)
  }
  assert {row.path: row.replicated for row in plan.rows} == whole
  assert whole["0/mu/wi"] == (model == 1) and whole["0/mu/scale"]
  assert plan.replicated_bytes_per_device == sum(
    row.bytes_per_device for row in plan.rows if whole[row.path]
  )
  data_json = plan_to_json(plan)
  assert {leaf["path"]: leaf["replicated"] for leaf in data_json["leaves"]} == whole
  warned = {message.split(":")[0]: message for message in plan.warnings()}
  assert set(warned) == {path for path, held in whole.items() if held}
  if model == 1:  # It has its rules: the mesh is what keeps it whole.
    assert "its mesh axes (-, model) span one device each" in warned["0/mu/wi"]
  wi = next(line for line in format_table(plan).splitlines() if "0/mu/wi " in line)
  assert ("replicated" in wi.split("(embed, mlp)")[1]) == (model == 1), wi


@pytest.mark.parametrize(
  "count, text",
  [
    (1023, "1023 B"),
    (1023.6, "1.0 KiB"),
    (2**20 - 1, "1.0 MiB"),
    (2**20 - 52, "1023.9 KiB"),
    (2**30 - 1, "1.0 GiB"),
    (1.5 * 2**40, "1.5 TiB"),
    (2**50, "1.0 PiB"),
    (2**60, "1024.0 PiB"),
  ],
)
def test_format_bytes_picks_its_unit_after_rounding(count, text):
  """Just under a unit read '1024.0 KiB', and a TiB '1024.0 GiB'."""
  assert format_bytes(count) == text


def test_plan_counts_the_bytes_of_a_typed_prng_key():
  """optax.add_noise keeps a typed key (``key<fry>``, no numpy dtype) in its state: the plan
  counts its bytes, those of the real array's shards."""
  partitioner = _partitioner(4, 2)
  opt_def = OptaxWrapper(optax.chain(optax.add_noise(0.01, 0.55, 0), optax.adam(0.1)))
  state = abstract_train_state(partitioner, opt_def, _mlp_variables)
  plan = build_plan(state, logical=state.as_logical_axes())
  real = init_sharded(partitioner, opt_def, _mlp_variables).param_states
  rows = {row.path: row for row in plan.rows}
  assert rows["0/rng_key"].dtype == "key<fry>" and rows["0/rng_key"].replicated
  for row, leaf in zip(plan.rows, jax.tree.leaves(real), strict=True):
    assert row.total_bytes == leaf.nbytes, row.path
    assert row.bytes_per_device == leaf.addressable_shards[0].data.nbytes, row.path
  assert rows["0/rng_key"].total_bytes == 8
  assert "0/rng_key" in format_table(plan)
