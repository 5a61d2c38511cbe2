"""Tests for `KfacOptimizerDef` (kfac-jax K-FAC behind `OptimizerDef`)."""

import threading
import warnings

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _optional import import_kfac_jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

kfac_jax = import_kfac_jax()

# kfac-jax 0.0.8 still uses jax.core names that jax 0.10 deprecates.
# Most tests run kfac-jax steps through a shared fixture: seconds each.
pytestmark = [
  pytest.mark.filterwarnings(r"ignore:jax\.core\.\w+ is deprecated:DeprecationWarning"),
  pytest.mark.slow,
]

from kfac_jax._src import tag_graph_matcher  # noqa: E402

from t5x_optim import KfacOptimizerDef, OptaxWrapper, convert_state  # noqa: E402
from t5x_optim._adapters import kfac as kfac_adapter  # noqa: E402 - the shim, on purpose
from t5x_optim._adapters import kfac_state  # noqa: E402
from t5x_optim.partitioning import StateRulesFallback, register_state_rule  # noqa: E402

_NUM_STEPS = 6
_BATCH = 32
_HYPER = dict(learning_rate=0.5, momentum=0.0, damping=3e-2)
_AXES = {
  "dense1": {"kernel": P("embed", "mlp")},
  "dense2": {"kernel": P("mlp", "vocab"), "bias": P("vocab")},
}


def _logits(params, x):
  hidden = jnp.tanh(x @ params["dense1"]["kernel"])
  return hidden @ params["dense2"]["kernel"] + params["dense2"]["bias"]


def _plain_loss(params, batch):
  x, y = batch
  log_probs = jax.nn.log_softmax(_logits(params, x))
  return -jnp.mean(jnp.take_along_axis(log_probs, y[:, None], axis=1))


def _registered_loss(params, batch):
  kfac_jax.register_softmax_cross_entropy_loss(_logits(params, batch[0]), batch[1])
  return _plain_loss(params, batch)


def _params():
  k1, k2 = jax.random.split(jax.random.key(0))
  return {
    "dense1": {"kernel": jax.random.normal(k1, (4, 8)) * 0.5},
    "dense2": {"kernel": jax.random.normal(k2, (8, 4)) * 0.5, "bias": jnp.zeros(4)},
  }


def _batches():
  """Ill-conditioned inputs (feature scales 0.1 ... 10): K-FAC's home ground."""
  keys = jax.random.split(jax.random.key(42), 2)
  scales = jnp.array([10.0, 3.0, 1.0, 0.1])
  x = jax.random.normal(keys[0], (_NUM_STEPS * _BATCH, 4)) * scales
  y = jnp.argmax(x / scales @ jax.random.normal(keys[1], (4, 4)), axis=1)
  return [
    (x[i * _BATCH : (i + 1) * _BATCH], y[i * _BATCH : (i + 1) * _BATCH]) for i in range(_NUM_STEPS)
  ]


def _rngs():
  return list(jax.random.split(jax.random.key(7), _NUM_STEPS))


def _copy(tree):
  return jax.tree.map(jnp.copy, tree)


@pytest.fixture(scope="module")
def kfac():
  """One kfac-jax optimizer for all tests (its compiled steps are cached per instance)."""
  return kfac_jax.Optimizer(
    value_and_grad_func=jax.value_and_grad(_registered_loss),
    l2_reg=0.0,
    num_burnin_steps=0,
    inverse_update_period=2,
  )


@pytest.fixture(scope="module")
def opt_def(kfac):
  return KfacOptimizerDef(kfac, init_batch=_batches()[0], init_rng=jax.random.key(1), **_HYPER)


@pytest.fixture(scope="module")
def adapter_run(opt_def):
  """`_NUM_STEPS` steps through the adapter: copies of the optimizer and stats after each.

  kfac-jax donates params and state, so each step consumes its input.
  """
  opt = opt_def.create(_copy(_params()))
  history = []
  for batch, rng in zip(_batches(), _rngs()):
    opt, stats = opt_def.apply_batch(opt, batch=batch, rng=rng)
    history.append((_copy(opt), stats))
  return history


def _assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_matches_kfac_step_loop_bit_for_bit(kfac, opt_def, adapter_run):
  params = _copy(_params())
  state = kfac.init(params, jax.random.key(1), _batches()[0])
  for step, (batch, rng) in enumerate(zip(_batches(), _rngs())):
    params, state, stats = kfac.step(params, state, rng, batch=batch, **_HYPER)
    opt, adapter_stats = adapter_run[step]
    _assert_trees_equal(opt.target, params)
    _assert_trees_equal(opt.state.param_states, state)
    assert float(adapter_stats["loss"]) == float(stats["loss"])
    assert int(opt.state.step) == step + 1


def test_apply_gradient_matches_apply_batch_and_consumes_its_input(opt_def, adapter_run):
  before = opt_def.create(_copy(_params()))
  batch, rng = _batches()[0], _rngs()[0]
  after = before.apply_gradient(None, batch=batch, rng=rng, learning_rate=_HYPER["learning_rate"])
  _assert_trees_equal(after.target, adapter_run[0][0].target)
  assert before.target["dense1"]["kernel"].is_deleted()


def test_loss_falls_faster_than_best_sgd(opt_def, adapter_run):
  data = _batches()
  full = (jnp.concatenate([b[0] for b in data]), jnp.concatenate([b[1] for b in data]))
  kfac_loss = float(_plain_loss(adapter_run[-1][0].target, full))

  sgd = OptaxWrapper(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1))

  @jax.jit
  def sgd_step(opt, batch, lr):
    return opt.apply_gradient(jax.grad(_plain_loss)(opt.target, batch), learning_rate=lr)

  sgd_losses = {}
  for lr in (0.01, 0.03, 0.1, 0.3, 1.0, 3.0):
    opt = sgd.create(_params())
    for batch in data:
      opt = sgd_step(opt, batch, lr)
    sgd_losses[lr] = float(_plain_loss(opt.target, full))
  initial = float(_plain_loss(_params(), full))
  assert kfac_loss < initial
  assert kfac_loss < 0.9 * min(sgd_losses.values()), (kfac_loss, sgd_losses)


def test_state_dict_round_trip(opt_def, adapter_run):
  opt = adapter_run[2][0]
  state_dict = flax.serialization.msgpack_restore(
    flax.serialization.msgpack_serialize(opt.state_dict())
  )
  flat = flax.traverse_util.flatten_dict(state_dict, sep="/")
  assert "state/param_states/velocities/dense1/kernel" in flat
  assert "state/param_states/estimator_state/blocks_states/0/factors/1/value" in flat
  assert "state/param_states/estimator_state/blocks_states/1/cache/-1.0/0_factor" in flat
  assert int(flat["state/step"]) == 3

  fresh = opt_def.create(_copy(_params()))
  restored = fresh.restore_state(state_dict)
  _assert_trees_equal(restored.target, opt.target)
  _assert_trees_equal(restored.state, opt.state)
  batch, rng = _batches()[3], _rngs()[3]
  stepped, _ = opt_def.apply_batch(_copy(restored), batch=batch, rng=rng)
  _assert_trees_equal(stepped.state.param_states, adapter_run[3][0].state.param_states)


def test_adaptive_damping_restarts_from_a_fixed_damping_state(kfac, adapter_run):
  # kfac-jax keeps a placeholder damping (-1e10) in the state of a run with fixed damping;
  # adaptive damping restored from it starts at initial_damping instead.
  adaptive = KfacOptimizerDef(
    kfac_jax.Optimizer(
      value_and_grad_func=jax.value_and_grad(_registered_loss),
      l2_reg=0.0,
      num_burnin_steps=0,
      inverse_update_period=2,
      use_adaptive_damping=True,
      initial_damping=3e-2,
      damping_adaptation_interval=1,
    ),
    init_batch=_batches()[0],
    init_rng=jax.random.key(1),
    learning_rate=0.5,
    momentum=0.0,
  )
  state_dict = adapter_run[2][0].state_dict()
  assert float(state_dict["state"]["param_states"]["damping"]) == np.float32(-1e10)
  restored = adaptive.create(_copy(_params())).restore_state(state_dict)
  assert float(restored.state.param_states.damping) == np.float32(3e-2)
  _assert_trees_equal(restored.target, adapter_run[2][0].target)
  stepped, stats = adaptive.apply_batch(_copy(restored), batch=_batches()[3], rng=_rngs()[3])
  assert float(stats["damping"]) == np.float32(3e-2)
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(stepped.target))

  # A damping the state holds is kept.
  state_dict["state"]["param_states"]["damping"] = np.float32(0.25)
  restored = adaptive.create(_copy(_params())).restore_state(state_dict)
  assert float(restored.state.param_states.damping) == np.float32(0.25)


def test_restore_names_the_bad_path(adapter_run):
  opt = adapter_run[0][0]
  state_dict = opt.state_dict()
  factors = state_dict["state"]["param_states"]["estimator_state"]["blocks_states"]["0"]
  factors["factors"]["0"]["value"] = np.zeros((3, 3), np.float32)
  with pytest.raises(ValueError, match="blocks_states/0/factors/0/value"):
    opt.restore_state(state_dict)


def test_convert_state_into_kfac_names_or_initialises_its_states(opt_def, adapter_run):
  adam = OptaxWrapper(optax.adam(1e-2)).create(_copy(_params()))
  adam = adam.apply_gradient(jax.grad(_plain_loss)(adam.target, _batches()[0]))
  kfac_states = (
    "velocities (State.velocities)",
    "estimator_state/blocks_states/0/cache (State.cache)",
    "estimator_state/blocks_states/0/factors/0/value (WeightedMovingAverage.value)",
  )
  for source in (adam, adapter_run[2][0]):
    with pytest.raises(ValueError, match="cannot be fully converted") as raised:
      convert_state(source, opt_def)
    assert all(f"{state}: no converter" in str(raised.value) for state in kfac_states)
    new, report = convert_state(source, opt_def, missing="init")
    assert all(f"{state}: no converter" in report.initialised for state in kfac_states)
    assert int(new.state.step) == int(source.state.step)
    _assert_trees_equal(new.target, source.target)
    fresh = opt_def.create(_copy(_params()))
    _assert_trees_equal(new.state.param_states, fresh.state.param_states)
  assert "velocities (State.velocities)" in report.dropped
  _, stats = opt_def.apply_batch(_copy(new), batch=_batches()[3], rng=_rngs()[3])
  assert np.isfinite(float(stats["loss"]))


def _expected_block_specs(kfac):
  """Factor specs by block, in the estimator's block order."""
  by_first_param = {
    # dense1 (no bias): (in, in) -> embed, (out, out) -> mlp.
    ("dense1", "kernel"): [P("embed", None), P("mlp", None)],
    # dense2 (bias): (in + 1, in + 1) matches nothing, (out, out) -> vocab.
    ("dense2", "kernel"): [None, P("vocab", None)],
  }
  paths = [tuple(k.key for k in path) for path, _ in jax.tree.flatten_with_path(_params())[0]]
  return [by_first_param[paths[indices[0]]] for indices in kfac._estimator.jaxpr.layer_indices]  # pylint: disable=protected-access


def test_derive_logical_axes_shards_kronecker_factors(kfac, opt_def, adapter_run):
  opt = adapter_run[0][0]
  with pytest.warns(UserWarning, match=r"blocks_states/\d/factors/0/value \(shape \(9, 9\)\)"):
    axes = opt_def.derive_logical_axes(opt, _AXES)
  assert axes.state.step is None
  specs = axes.state.param_states
  assert specs.velocities == _AXES
  assert specs.step_counter is None and specs.damping is None
  for block, expected in zip(specs.estimator_state.blocks_states, _expected_block_specs(kfac)):
    assert [f.value for f in block.factors] == expected
    assert [f.weight for f in block.factors] == [None, None]
    assert [block.cache["-1.0"][f"{k}_factor"] for k in range(2)] == expected


def test_derive_logical_axes_raise_policy_and_replicated_params(kfac, adapter_run):
  opt = adapter_run[0][0]
  strict = KfacOptimizerDef(kfac, fallback=StateRulesFallback.RAISE)
  with pytest.raises(ValueError, match=r"blocks_states/\d/.*\(9, 9\)"):
    strict.derive_logical_axes(opt, _AXES)
  replicated = jax.tree.map(lambda _: None, _params())
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    specs = strict.derive_logical_axes(opt, replicated).state.param_states
  assert all(s is None for s in jax.tree.leaves(specs, is_leaf=lambda x: x is None))


def test_derive_logical_axes_of_a_diagonal_block():
  """A layer-norm scale gets a diagonal block, whose state has an empty (None) cache."""

  def loss(params, batch):
    x, y = batch
    h = jnp.tanh(x @ params["dense1"]["kernel"])
    h = (h - h.mean(-1, keepdims=True)) / (h.std(-1, keepdims=True) + 1e-6) * params["ln"]
    logits = h @ params["dense2"]["kernel"] + params["dense2"]["bias"]
    kfac_jax.register_softmax_cross_entropy_loss(logits, y)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))

  optimizer = kfac_jax.Optimizer(
    value_and_grad_func=jax.value_and_grad(loss), l2_reg=0.0, num_burnin_steps=0
  )
  opt_def = KfacOptimizerDef(
    optimizer, init_batch=_batches()[0], init_rng=jax.random.key(1), **_HYPER
  )
  params = {**_params(), "ln": jnp.ones(8)}
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)  # The unmatched (9, 9) factor of dense2.
    axes = opt_def.derive_logical_axes(
      jax.eval_shape(opt_def.create, params), {**_AXES, "ln": P("mlp")}
    )
  [diagonal] = [
    block
    for block in axes.state.param_states.estimator_state.blocks_states
    if hasattr(block, "diagonal_factors")
  ]
  assert diagonal.cache is None
  assert [f.value for f in diagonal.diagonal_factors] == [P("mlp")]


def _mesh_shardings(tree, mesh):
  rules = (("embed", None), ("mlp", "model"), ("vocab", None))
  specs = jax.tree.map(
    lambda s: P() if s is None else s, tree, is_leaf=lambda x: x is None or isinstance(x, P)
  )
  return flax.linen.logical_to_mesh_sharding(specs, mesh, rules)


def test_sharded_run_on_8_devices_matches_unsharded(kfac, opt_def, adapter_run):
  """T5X's flow: abstract init, derived axes, jit init with out_shardings, steps."""
  assert jax.device_count() == 8
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
  abstract = jax.eval_shape(opt_def.create, _params())
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    axes = opt_def.derive_logical_axes(abstract, _AXES)
  shardings = _mesh_shardings(axes, mesh)
  opt = jax.jit(opt_def.create, out_shardings=shardings)(_params())
  batch_sharding = NamedSharding(mesh, P("data"))
  for batch, rng in zip(_batches()[:3], _rngs()[:3]):
    opt = opt.apply_gradient(None, batch=jax.device_put(batch, batch_sharding), rng=rng)

  reference = adapter_run[2][0]
  for x, y in zip(jax.tree.leaves(opt), jax.tree.leaves(reference)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-4, atol=2e-5)
  dense1 = [i for i, specs in enumerate(_expected_block_specs(kfac)) if specs[1] == P("mlp", None)]
  block = opt.state.param_states.estimator_state.blocks_states[dense1[0]]
  assert block.factors[1].value.sharding.is_equivalent_to(NamedSharding(mesh, P("model", None)), 2)
  assert block.cache["-1.0"]["1_factor"].sharding.is_equivalent_to(
    NamedSharding(mesh, P("model", None)), 2
  )
  assert opt.target["dense1"]["kernel"].sharding.is_equivalent_to(
    NamedSharding(mesh, P(None, "model")), 2
  )
  assert len(opt.target["dense1"]["kernel"].sharding.device_set) == 8


def test_misuse_raises(opt_def, kfac):
  opt = opt_def.create(_copy(_params()))
  batch, rng = _batches()[0], _rngs()[0]
  with pytest.raises(ValueError, match="computes gradients itself"):
    opt.apply_gradient(opt.target, batch=batch, rng=rng)
  with pytest.raises(ValueError, match="rng="):
    opt.apply_gradient(None, batch=batch)
  with pytest.raises(TypeError, match="unknown keyword"):
    opt.apply_gradient(None, batch=batch, rng=rng, value=1.0)
  with pytest.raises(TypeError, match="inside jax.jit"):
    jax.jit(lambda o: o.apply_gradient(None, batch=batch, rng=rng))(opt)
  with pytest.raises(ValueError, match="example batch"):
    KfacOptimizerDef(kfac).create(_params())


@pytest.mark.parametrize(
  ("option", "message"),
  [
    ({"multi_device": True}, "multi_device=False"),
    ({"value_func_has_state": True}, "value_func_has_state"),
  ],
)
def test_unsupported_kfac_modes_raise(option, message):
  kfac = kfac_jax.Optimizer(
    value_and_grad_func=jax.value_and_grad(_registered_loss), l2_reg=0.0, **option
  )
  with pytest.raises(ValueError, match=message):
    KfacOptimizerDef(kfac)


def test_state_rules_fallback_is_a_deprecated_alias_of_fallback(kfac):
  with pytest.warns(DeprecationWarning, match=r"state_rules_fallback=\.\.\.\) is deprecated"):
    opt_def = KfacOptimizerDef(kfac, state_rules_fallback="raise")
  assert opt_def.fallback is StateRulesFallback.RAISE
  with pytest.warns(DeprecationWarning, match="read fallback"):
    assert opt_def.state_rules_fallback is StateRulesFallback.RAISE
  with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="deprecated alias"):
    KfacOptimizerDef(
      kfac,
      fallback=StateRulesFallback.RAISE,
      state_rules_fallback=StateRulesFallback.REPLICATE_WITH_WARNING,
    )


def test_kfac_state_rule_is_registered_once():
  from t5x_optim._axes.registry import registered_rules

  node_type = kfac_state._KfacNode  # pylint: disable=protected-access
  with pytest.raises(ValueError, match="already registered; pass replace=True"):
    register_state_rule(node_type, registered_rules()[node_type].rule)


def _kfac_jax_own_eval_jaxpr_eqn_in_place() -> bool:
  return tag_graph_matcher.eval_jaxpr_eqn.__module__ == tag_graph_matcher.__name__


_needs_shim = pytest.mark.skipif(
  not kfac_adapter._bind_params_without_subfuns(), reason="this jax needs no shim"
)


@_needs_shim
def test_the_shim_evaluates_what_kfac_jax_cannot_on_this_jax():
  """If kfac-jax's own `eval_jaxpr_eqn` starts working, the shim can go."""
  eqn = jax.make_jaxpr(lambda x: x @ x)(jnp.eye(2)).eqns[0]
  assert eqn.primitive.name == "dot_general"
  operands = [2 * jnp.eye(2)] * 2
  with pytest.raises(ValueError, match="too many values to unpack"):
    tag_graph_matcher.eval_jaxpr_eqn(eqn, operands)
  np.testing.assert_array_equal(kfac_adapter._eval_jaxpr_eqn(eqn, operands)[0], 4 * jnp.eye(2))


@_needs_shim
def test_the_shim_is_in_place_only_during_adapter_calls(adapter_run):
  """Importing the adapter (above) and running steps leave kfac-jax's own function."""
  assert _kfac_jax_own_eval_jaxpr_eqn_in_place()
  seen = []

  def loss(params, batch):
    seen.append(tag_graph_matcher.eval_jaxpr_eqn)
    if batch[0].shape[0] != _BATCH:
      raise RuntimeError("a batch of the wrong size")
    return _registered_loss(params, batch)

  kfac = kfac_jax.Optimizer(
    value_and_grad_func=jax.value_and_grad(loss), l2_reg=0.0, num_burnin_steps=0
  )
  opt = KfacOptimizerDef(kfac, init_batch=_batches()[0], **_HYPER).create(_copy(_params()))
  assert seen and all(f is kfac_adapter._eval_jaxpr_eqn for f in seen)
  assert _kfac_jax_own_eval_jaxpr_eqn_in_place()
  x, y = _batches()[0]
  with pytest.raises(RuntimeError, match="wrong size"):
    opt.apply_gradient(None, batch=(x[:3], y[:3]), rng=_rngs()[0])
  assert _kfac_jax_own_eval_jaxpr_eqn_in_place()


@_needs_shim
def test_overlapping_adapter_calls_share_one_shim():
  shim, entered, leave = kfac_adapter._graph_matcher_shim, threading.Event(), threading.Event()

  def other_call():
    with shim:
      entered.set()
      leave.wait(10)

  other = threading.Thread(target=other_call)
  other.start()
  assert entered.wait(10)
  with shim:
    with shim:
      leave.set()
      other.join(10)
      assert tag_graph_matcher.eval_jaxpr_eqn is kfac_adapter._eval_jaxpr_eqn
    assert tag_graph_matcher.eval_jaxpr_eqn is kfac_adapter._eval_jaxpr_eqn
  assert not other.is_alive() and _kfac_jax_own_eval_jaxpr_eqn_in_place()


@pytest.mark.slow
def test_convert_state_of_sharded_params_into_a_strict_kfac_places_quietly(kfac):
  """Placing the new state by the params' shardings ran the definition's own fallback: a
  strict one refused the conversion, the default one warned of leaves no axes were asked for."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
  shardings = _mesh_shardings(_AXES, mesh)
  params = jax.tree.map(jax.device_put, _copy(_params()), shardings)
  adam = OptaxWrapper(optax.adam(1e-2)).create(params)
  for fallback in (StateRulesFallback.RAISE, StateRulesFallback.REPLICATE_WITH_WARNING):
    strict = KfacOptimizerDef(
      kfac, init_batch=_batches()[0], init_rng=jax.random.key(1), fallback=fallback, **_HYPER
    )
    with warnings.catch_warnings():
      warnings.simplefilter("error", UserWarning)
      new, _ = convert_state(adam, strict, missing="init")
    unsharded, _ = convert_state(jax.device_get(adam), strict, missing="init")
    _assert_trees_equal(new.state.param_states, unsharded.state.param_states)


@pytest.mark.slow
def test_an_eager_create_over_params_on_a_mesh_places_its_state_there(opt_def):
  """K-FAC's eager ``create`` over params on a mesh left its step and statistics on one device,
  uncommitted: a conversion into it committed them there, and its next step failed
  ("incompatible devices"). They are replicated over the params' mesh."""
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  params = jax.device_put(_copy(_params()), NamedSharding(mesh, P()))
  created = opt_def.create(params)
  assert all(x.sharding.device_set == set(mesh.devices.flat) for x in jax.tree.leaves(created))
  source = OptaxWrapper(optax.sgd(0.1, momentum=0.9)).create(params)
  converted, _ = convert_state(source, created, missing="init")
  stepped, _ = opt_def.apply_batch(converted, batch=_batches()[0], rng=_rngs()[0])
  assert int(stepped.state.step) == 1
