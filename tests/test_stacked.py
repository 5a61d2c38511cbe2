"""Params and optimizer state kept stacked by shape (`stack_params`), against per-leaf optax.

Numerics run over the one optimizer table against hand-written optax loops on
the per-leaf params; sharding runs sharded `jax.jit` steps on 8 simulated CPU
devices against unsharded ones; state dicts and restores are compared with
those of per-leaf params.
"""

from __future__ import annotations

import functools
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from optimizer_table import TABLE, Case, tree_equal
from test_fused import leaf_scale_ulps

import t5x_optim
from t5x_optim import OptaxWrapper, StackedParams, stack_params
from t5x_optim.partitioning import (
  create_mesh,
  logical_to_mesh_axes_tree,
  optimizer_state_mesh_axes_tree,
  standard_logical_axis_rules,
)

pytestmark = pytest.mark.usefixtures("shared_compilation_cache")

EMBED, MLP, LAYERS, STEPS = 8, 16, 2, 3
# Every case the analysis proves elementwise matches the optax loop within
# the fused path's bound (ulps of each leaf's largest value); measured: exact.
ULPS = 2.0
# A global norm sums the buffers in another order than the leaves (or than
# the unsharded buffers): the clip factor differs by a rounding, squared in
# adam's nu (measured: 0.5 ulp on the params, 5 on the state after STEPS steps).
GLOBAL_NORM_ULPS = 8.0
GLOBAL_NORM = {"chain"}
MUST_STACK = {"adam", "adamw", "lion", "sgd", "rmsprop", "adagrad", "yogi", "chain", "schedule"}
MUST_REFUSE = {
  "adafactor_factored",
  "muon",
  "lbfgs",
  "lamb",
  "masked",
  "lookahead",
  "reduce_on_plateau",
}
LAYER_AXES = {"wi": P("embed", "mlp"), "bi": P("mlp"), "wo": P("mlp", "embed")}
AXES = {f"layers_{i}": LAYER_AXES for i in range(LAYERS)}


def make_params(seed: int = 0) -> dict[str, Any]:
  """Two MLP layers: three buffers of two leaves each when stacked."""
  rng = np.random.default_rng(seed)
  shapes = {"wi": (EMBED, MLP), "bi": (MLP,), "wo": (MLP, EMBED)}
  return {
    f"layers_{i}": {
      k: jnp.asarray(rng.normal(size=s) * 0.3, jnp.float32) for k, s in shapes.items()
    }
    for i in range(LAYERS)
  }


_RNG = np.random.default_rng(1)
_X = jnp.asarray(_RNG.normal(size=(16, EMBED)), jnp.float32)
_Y = jnp.asarray(_RNG.normal(size=(16, EMBED)), jnp.float32)


def loss(params: Any) -> jax.Array:
  x = _X
  for i in range(LAYERS):
    layer = params[f"layers_{i}"]
    x = x + jnp.tanh(x @ layer["wi"] + layer["bi"]) @ layer["wo"]
  return jnp.mean((x - _Y) ** 2)


def stacked_loss(stacked: StackedParams) -> jax.Array:
  return loss(stacked.unstack())


def unstacked(tree: Any) -> Any:
  return jax.tree.map(
    lambda n: n.unstack() if isinstance(n, StackedParams) else n,
    tree,
    is_leaf=lambda n: isinstance(n, StackedParams),
  )


@jax.jit
def _stacked_step(opt):
  return opt.apply_gradient(jax.grad(stacked_loss)(opt.target))


def _optax_loop(tx: optax.GradientTransformation, params: Any, steps: int):
  """The reference: plain optax on the per-leaf params, one (params, state) per step."""
  state = tx.init(params)

  @jax.jit
  def step(params, state):
    updates, state = tx.update(jax.grad(loss)(params), state, params)
    return optax.apply_updates(params, updates), state

  out = []
  for _ in range(steps):
    params, state = step(params, state)
    out.append((params, state))
  return out


@functools.cache
def _stacked_run(case: Case) -> tuple[list, str | None]:
  """STEPS stacked steps of `case` (the per-leaf target and state), or the refusal."""
  tx = case.make()
  try:
    opt = OptaxWrapper(tx).create(stack_params(make_params(), tx=tx))
  except ValueError as error:
    return [], str(error)
  out = []
  for _ in range(STEPS):
    opt = _stacked_step(opt)
    out.append((opt.target.unstack(), unstacked(opt.state.param_states)))
  return out, None


@pytest.mark.slow
@pytest.mark.parametrize("case", TABLE, ids=repr)
def test_stacked_matches_the_optax_loop_over_the_table(case: Case):
  """Accepted updates match per-leaf optax within ULPS; refusals say why."""
  got, refusal = _stacked_run(case)
  if case.name in MUST_STACK:
    assert refusal is None
  if case.name in MUST_REFUSE:
    assert refusal is not None
  if refusal is not None:
    assert "stack" in refusal
    return
  want = _optax_loop(case.make(), make_params(), STEPS)
  bound = GLOBAL_NORM_ULPS if case.name in GLOBAL_NORM else ULPS
  for (params, state), (ref_params, ref_state) in zip(got, want, strict=True):
    assert leaf_scale_ulps(params, ref_params) <= bound
    assert leaf_scale_ulps(state, ref_state) <= bound


@pytest.mark.usefixtures("xla_optimized")
@pytest.mark.slow
def test_elementwise_updates_are_bit_exact():
  cases = {case.name: case for case in TABLE}
  for name in ("adam", "adamw", "lion", "sgd", "rmsprop", "yogi"):
    # Run here, not from the table test's cache: that ran with most optimizations disabled.
    got, _ = _stacked_run.__wrapped__(cases[name])
    want = _optax_loop(cases[name].make(), make_params(), STEPS)
    assert tree_equal(got[-1], want[-1]), name


def test_layout_groups_by_shape_dtype_spec_and_program():
  params = make_params()
  assert stack_params(params).layout.groups == ((0, 3), (1, 4), (2, 5))
  assert [b.shape for b in stack_params(params).buffers] == [
    (2, MLP),
    (2, EMBED, MLP),
    (2, MLP, EMBED),
  ]
  axes = {"layers_0": LAYER_AXES, "layers_1": {**LAYER_AXES, "wi": P(None, "mlp")}}
  assert stack_params(params, logical_axes=axes).layout.groups == ((0, 3), (1,), (2, 5), (4,))
  assert len(stack_params(params, tx=_by_layer()).layout.groups) == 6


def _by_layer() -> optax.GradientTransformation:
  """adamw decaying layers_0 only: a per-leaf mask, which the stacked buffers do not fit."""
  params = make_params()
  return optax.adamw(
    1e-2,
    mask={k: jax.tree.map(lambda _, k=k: k == "layers_0", v) for k, v in params.items()},
  )


@pytest.mark.slow
def test_unstack_gives_views_whose_gradient_is_stacked():
  params = make_params()
  stacked = stack_params(params)
  assert tree_equal(stacked.unstack(), params)
  grads = jax.grad(stacked_loss)(stacked)
  assert isinstance(grads, StackedParams) and grads.layout == stacked.layout
  assert tree_equal(grads.unstack(), jax.grad(loss)(params))


@pytest.mark.slow
def test_per_leaf_grads_are_stacked_in_the_step():
  opt = OptaxWrapper(optax.adamw(1e-2)).create(stack_params(make_params()))
  from_stacked = opt.apply_gradient(jax.grad(stacked_loss)(opt.target))
  from_leaves = opt.apply_gradient(jax.grad(loss)(opt.target.unstack()))
  assert tree_equal(from_stacked, from_leaves)


@pytest.mark.parametrize("container", [dict, flax.core.freeze])
@pytest.mark.slow
def test_state_dict_is_the_per_leaf_one(container):
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
  params = container(make_params())
  stacked = OptaxWrapper(tx).create(stack_params(params))
  plain = OptaxWrapper(tx).create(params)
  for _ in range(2):
    stacked = stacked.apply_gradient(jax.grad(stacked_loss)(stacked.target))
    plain = plain.apply_gradient(jax.grad(loss)(plain.target))
  got, want = stacked.state_dict(), plain.state_dict()
  assert jax.tree.structure(got) == jax.tree.structure(want)
  assert leaf_scale_ulps(got, want) <= GLOBAL_NORM_ULPS
  restored = stacked.restore_state(want)
  assert isinstance(restored.target, StackedParams)
  assert tree_equal(unstacked(restored.state), unstacked(plain.state))
  assert tree_equal(restored.target.unstack(), plain.target)
  assert tree_equal(plain.restore_state(got).state_dict(), got)


@pytest.mark.slow
def test_a_none_param_holds_no_array_and_is_not_stacked():
  """A None in the params is no leaf, as OptaxWrapper.create takes it: stack_params refused
  such params (the None read as a leaf), with logical axes or without."""
  params = {**make_params(), "unused": None}
  for logical_axes in (None, {**AXES, "unused": None}):
    stacked = stack_params(params, logical_axes=logical_axes)
    assert stacked.layout.groups == stack_params(make_params()).layout.groups
    assert tree_equal(stacked.unstack(), params)
  opt = OptaxWrapper(optax.adamw(1e-2)).create(stacked)
  plain = OptaxWrapper(optax.adamw(1e-2)).create(params)
  grads = jax.grad(loss)(make_params()) | {"unused": None}
  assert tree_equal(opt.apply_gradient(grads).target.unstack(), plain.apply_gradient(grads).target)


def test_failed_restore_names_the_per_leaf_path_and_changes_nothing():
  opt = OptaxWrapper(optax.adam(1e-2)).create(stack_params(make_params()))
  before = jax.tree.map(np.asarray, opt)
  state_dict = opt.state_dict()
  state_dict["state"]["param_states"]["0"]["mu"]["layers_1"]["wo"] = np.zeros((3, 3), np.float32)
  with pytest.raises(ValueError, match=r"layers_1/wo.*\(16, 8\).*\(3, 3\)"):
    opt.restore_state(state_dict)
  assert tree_equal(opt, before)


def test_a_restore_of_params_one_buffer_holds_in_two_dtypes_is_refused_naming_them():
  """A restore keeps a state dict's floating param dtype; the stacked layer refused params of
  one buffer in bfloat16 and float32 with an error about stacking that named no restore."""
  params = {"a": {"kernel": jnp.ones((4, 8))}, "b": {"kernel": jnp.ones((4, 8))}}
  opt = OptaxWrapper(optax.adam(0.1)).create(stack_params(params))
  state_dict = opt.state_dict()
  state_dict["target"]["a"]["kernel"] = np.asarray(state_dict["target"]["a"]["kernel"]).astype(
    jnp.bfloat16
  )
  with pytest.raises(
    ValueError,
    match=r"restore keeps the state dict's floating param dtypes.*'a/kernel': bfloat16, "
    r"'b/kernel': float32",
  ):
    opt.restore_state(state_dict)
  state_dict["target"]["b"]["kernel"] = state_dict["target"]["a"]["kernel"]
  restored = opt.restore_state(state_dict).target.unstack()
  assert {leaf.dtype for leaf in jax.tree.leaves(restored)} == {jnp.dtype(jnp.bfloat16)}


@pytest.mark.slow
def test_wrong_grads_name_the_paths():
  opt = OptaxWrapper(optax.adam(1e-2)).create(stack_params(make_params()))
  grads = jax.grad(loss)(opt.target.unstack())
  grads["layers_0"]["bi"] = jnp.zeros(3)
  with pytest.raises(ValueError, match=r"layers_0/bi.*\(3,\).*\(16,\)"):
    opt.apply_gradient(grads)
  other = stack_params(make_params(), logical_axes={**AXES, "layers_0": LAYER_AXES | {"bi": None}})
  with pytest.raises(ValueError, match="another layout"):
    opt.apply_gradient(jax.grad(stacked_loss)(other))


def test_a_scalar_updated_otherwise_than_its_buffer_is_named_as_a_scalar():
  params = {"temperature": jnp.asarray(0.5), "w": jnp.ones((2, 3))}
  with pytest.raises(
    ValueError, match=r"\['temperature'\] .*updates a scalar otherwise than an array"
  ):
    OptaxWrapper(optax.adagrad(1e-2)).create(stack_params(params, tx=optax.adagrad(1e-2)))


@pytest.mark.parametrize(
  "tx, match",
  [
    (optax.adafactor(1e-2, min_dim_size_to_factor=4), "not elementwise per leaf"),
    (
      optax.adamw(1e-2, mask=lambda p: jax.tree.map(lambda x: x.ndim == 2, p)),
      r"buffer of \['layers_0/bi', 'layers_1/bi'\] otherwise than those leaves",
    ),
    (
      optax.multi_transform(
        {"a": optax.adam(1e-2), "b": optax.sgd(1e-2)},
        lambda p: jax.tree.map(lambda x: "a" if x.ndim == 2 else "b", p),
      ),
      "not elementwise per leaf",
    ),
  ],
)
def test_updates_that_would_change_are_refused(tx, match):
  with pytest.raises(ValueError, match=match):
    OptaxWrapper(tx).create(stack_params(make_params()))


def test_a_buffer_holding_leaves_the_update_tells_apart_is_refused():
  with pytest.raises(ValueError, match=r"treats leaves stacked together differently"):
    OptaxWrapper(_by_layer()).create(stack_params(make_params()))


def test_logical_axes_are_the_leaves_behind_a_stacking_axis():
  opt = OptaxWrapper(optax.adamw(1e-2)).create(stack_params(make_params(), logical_axes=AXES))
  axes = opt.optimizer_def.derive_logical_axes(opt, AXES)
  assert axes.target.buffers == (P(None, "mlp"), P(None, "embed", "mlp"), P(None, "mlp", "embed"))
  mu = axes.state.param_states[0].mu
  assert mu.buffers == axes.target.buffers
  per_leaf = OptaxWrapper(optax.adamw(1e-2)).create(make_params())
  assert (
    axes.state_dict() == per_leaf.optimizer_def.derive_logical_axes(per_leaf, AXES).state_dict()
  )


def test_leaves_stacked_together_need_one_spec():
  opt = OptaxWrapper(optax.adamw(1e-2)).create(stack_params(make_params()))
  axes = {**AXES, "layers_1": {**LAYER_AXES, "wi": P(None, "mlp")}}
  with pytest.raises(ValueError, match=r"'layers_0/wi': .*'embed', 'mlp'.*'layers_1/wi'"):
    opt.optimizer_def.derive_logical_axes(opt, axes)


def _shardings(opt, mesh, zero: bool):
  rules = standard_logical_axis_rules(shard_optimizer_state_over_data=zero)
  axes = opt.optimizer_def.derive_logical_axes(opt, AXES)
  target = logical_to_mesh_axes_tree(axes.target, rules)
  param_states = optimizer_state_mesh_axes_tree(
    axes.state.param_states, opt.state.param_states, rules, mesh_shape=mesh.shape
  )
  specs = axes.replace(target=target, state=axes.state.replace(step=P(), param_states=param_states))
  return jax.tree.map(
    lambda spec: NamedSharding(mesh, spec or P()),
    specs,
    is_leaf=lambda x: x is None or isinstance(x, P),
  )


@pytest.mark.slow
@pytest.mark.parametrize("zero", [False, True])
def test_stacked_steps_on_explicit_mesh_axes_as_on_auto(zero):
  """Under Explicit axes (grads computed elementwise: the model's matmuls are the user's)."""

  def run(axis_types):
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
    opt = OptaxWrapper(tx).create(stack_params(make_params(), logical_axes=AXES))
    shardings = _shardings(
      opt, create_mesh(shape={"data": 2, "model": 4}, axis_types=axis_types), zero
    )
    step = jax.jit(
      lambda o: o.apply_gradient(jax.tree.map(lambda x: jnp.sin(3.0 * x + 1.0), o.target)),
      in_shardings=(shardings,),
      out_shardings=shardings,
    )
    opt = jax.device_put(jax.tree.map(jnp.copy, opt), shardings)
    for _ in range(STEPS):
      opt = step(opt)
    return opt

  explicit, auto = run(AxisType.Explicit), run(AxisType.Auto)
  assert jax.typeof(explicit.target.buffers[0]).sharding.mesh.axis_types[0] == AxisType.Explicit
  specs = [x.sharding.spec for x in jax.tree.leaves(explicit)]
  assert specs == [x.sharding.spec for x in jax.tree.leaves(auto)]
  assert leaf_scale_ulps(explicit, auto) <= GLOBAL_NORM_ULPS


@pytest.mark.slow
@pytest.mark.parametrize("zero", [False, True])
def test_sharded_stacked_steps_match_unsharded(zero):
  """On a 2x4 mesh the buffers shard like their leaves behind the stacking axis."""
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
  opt = OptaxWrapper(tx).create(stack_params(make_params(), logical_axes=AXES))
  mesh = create_mesh(shape={"data": 2, "model": 4})
  shardings = _shardings(opt, mesh, zero)
  step = jax.jit(
    lambda o: o.apply_gradient(jax.grad(stacked_loss)(o.target)),
    in_shardings=(shardings,),
    out_shardings=shardings,
    donate_argnums=0,
  )
  sharded, unsharded = jax.device_put(jax.tree.map(jnp.copy, opt), shardings), opt
  for _ in range(STEPS):
    unsharded = _stacked_step(unsharded)
  for _ in range(STEPS):
    sharded = step(sharded)
  # The sharded global norm sums per device first: another order again.
  assert leaf_scale_ulps(sharded, unsharded) <= GLOBAL_NORM_ULPS
  specs = [b.sharding.spec for b in sharded.target.buffers]
  assert specs == [P(None, "model"), P(None, None, "model"), P(None, "model", None)]
  mu_specs = [b.sharding.spec for b in sharded.state.param_states[1][0].mu.buffers]
  zero_specs = [P("data", "model"), P("data", None, "model"), P("data", "model", None)]
  assert mu_specs == (zero_specs if zero else specs)


def _grouped(params: dict[str, Any], axes: dict[str, str]) -> StackedParams:
  """`params` stacked with the leaves of one logical axis (``axes``, per leaf) together."""
  return stack_params(params, logical_axes={k: P(axis) for k, axis in axes.items()})


@pytest.mark.slow
def test_conversion_between_stacked_layouts_matches_params_by_path():
  """Between two stacked optimizers whose layouts group the leaves otherwise (groups
  ((a, b), (c,)) into ((a, c), (b,)), buffers of equal shapes), the buffers were matched by
  their index: the converted params and moments of b and c were swapped, unreported. Each
  leaf takes its own params and moments, as between the same optimizers unstacked; buffers of
  other shapes (all three leaves in one) convert as well."""
  params = {k: jnp.full((4, 8), v) for k, v in (("a", 1.0), ("b", 2.0), ("c", 3.0))}
  grads = {k: jnp.full((4, 8), v) for k, v in (("a", 0.1), ("b", 0.2), ("c", 0.3))}
  adam, lion = OptaxWrapper(optax.adam(1e-2)), OptaxWrapper(optax.lion(1e-3, b2=0.999))
  expected, expected_report = t5x_optim.convert_state(
    adam.create(params).apply_gradient(grads), lion.create(params)
  )
  source = adam.create(_grouped(params, {"a": "embed", "b": "embed", "c": "mlp"}))
  source = source.apply_gradient(grads)
  for axes in ({"a": "embed", "b": "mlp", "c": "embed"}, dict.fromkeys(params, "embed")):
    target = lion.create(_grouped(params, axes))
    converted, report = t5x_optim.convert_state(source, target)
    assert converted.target.layout == target.target.layout
    assert tree_equal(converted.state_dict(), expected.state_dict())
    assert report == expected_report


def test_conversion_between_stacked_layouts_names_the_params_that_differ():
  """Stacked params whose leaf c has another shape in the target were refused naming the
  buffers ('buffers/1: the source's params have shape (1, 4, 8), the target's (1, 5, 8)'),
  not the param."""
  params = {"a": jnp.ones((4, 8)), "c": jnp.ones((4, 8))}
  adam = OptaxWrapper(optax.adam(1e-2))
  source = adam.create(_grouped(params, {"a": "embed", "c": "mlp"}))
  target = adam.create(_grouped({**params, "c": jnp.ones((5, 8))}, {"a": "embed", "c": "mlp"}))
  with pytest.raises(
    ValueError,
    match=r"params do not fit .*: c: the source's params have shape "
    r"\(4, 8\), the target's \(5, 8\)\.$",
  ):
    t5x_optim.convert_state(source, target)


def _layers(n: int = 3) -> dict[str, Any]:
  return {f"layer_{i}": {"kernel": jnp.full((4, 32), 0.5 * (i + 1))} for i in range(n)}


@pytest.mark.slow
def test_conversion_between_stacked_and_per_leaf_optimizers_in_memory():
  """A stacked optimizer into a per-leaf one (or back) was refused, naming the stacked buffers
  ('the source's params have buffers/0, which the target's do not'), while a checkpoint
  converted the same states: the two layouts differ only in how the params are kept."""
  params = _layers()
  grads = jax.tree.map(lambda x: x * 0.1, params)
  adam = optax.adam(1e-2)
  per_leaf = OptaxWrapper(adam).create(params).apply_gradient(grads)
  stacked = OptaxWrapper(adam).create(stack_params(params, tx=adam)).apply_gradient(grads)
  lion = optax.lion(1e-3, b2=0.999)

  into_per_leaf, report = t5x_optim.convert_state(stacked, OptaxWrapper(lion).create(params))
  expected, expected_report = t5x_optim.convert_state(per_leaf, OptaxWrapper(lion).create(params))
  assert tree_equal(into_per_leaf.state, expected.state), report
  assert report.converted == expected_report.converted

  stacked_lion = OptaxWrapper(lion).create(stack_params(params, tx=lion))
  into_stacked, _ = t5x_optim.convert_state(per_leaf, stacked_lion)
  assert isinstance(into_stacked.target, StackedParams)
  assert tree_equal(into_stacked.state_dict(), expected.state_dict())
  assert tree_equal(
    into_stacked.apply_gradient(grads).state_dict(), expected.apply_gradient(grads).state_dict()
  )
