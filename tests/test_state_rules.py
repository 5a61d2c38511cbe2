"""Tests for logical partition specs of optax optimizer states."""

from __future__ import annotations

import math
import warnings
from typing import Any, NamedTuple

import flax
import flax.linen as nn
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _optional import import_kfac_jax
from flax.linen import partitioning as flax_partitioning
from jax.example_libraries import optimizers as jax_example_optimizers
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from optax import contrib
from optimizer_table import DISCOVERED

from t5x_optim import (
  ExampleLibOptimizerDef,
  MultiOptimizer,
  OptaxWrapper,
  Quantized4Leaf,
  QuantizedLeaf,
  low_precision,
)
from t5x_optim.partitioning import (
  OptaxStatePartitionRules,
  StateRulesFallback,
  logical_axes_from,
  register_state_rule,
)

pytestmark = pytest.mark.usefixtures("shared_compilation_cache")

derive = OptaxStatePartitionRules.derive_optax_logical_axes
RULES = (("embed", "data"), ("mlp", "model"), ("heads", "model"), ("kv", None))
AXES = {
  "dense": {"kernel": P("embed", "mlp"), "bias": P("mlp")},
  "attn": {"query": P("embed", "heads", "kv")},
  "norm": {"scale": P("embed")},
  "gate": None,
}
SHAPES = {
  "dense": {"kernel": (8, 16), "bias": (16,)},
  "attn": {"query": (8, 4, 16)},
  "norm": {"scale": (8,)},
  "gate": (),
}
is_spec = lambda x: x is None or isinstance(x, P)  # noqa: E731


def make_params(shapes=SHAPES, seed=0):
  leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
  rng = np.random.default_rng(seed)
  return treedef.unflatten([jnp.asarray(rng.standard_normal(s), jnp.float32) for s in leaves])


@pytest.fixture(scope="module")
def mesh():
  return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))


def to_mesh(specs, mesh):
  def one(spec):
    mesh_spec = P() if spec is None else nn.logical_to_mesh_axes(spec, RULES)
    return NamedSharding(mesh, mesh_spec)

  return jax.tree.map(one, specs, is_leaf=is_spec)


def model_params(p):
  return p.fast if isinstance(p, optax.LookaheadParams) else p


def loss(p):
  return sum(
    jnp.sum(jnp.cos(x) * (i + 1.0)) for i, x in enumerate(jax.tree.leaves(model_params(p)))
  )


# Extra update arguments (docs/design.md, "Extra update arguments"). L-BFGS's line search forwards every
# extra argument to ``value_fn`` and rejects ones it does not take, so
# ``obj_fn`` goes only to the transformations that need it.
NEEDS_OBJ_FN = ("sophia",)


def make_step(tx, *, obj_fn: bool = False):
  tx = optax.with_extra_args_support(tx)
  extra = {"obj_fn": loss} if obj_fn else {}

  def step(p, s):
    value, grad = jax.value_and_grad(loss)(p)
    grad = model_params(grad)
    updates, s = tx.update(grad, s, p, value=value, grad=grad, value_fn=loss, **extra)
    return optax.apply_updates(p, updates), s

  return step


def assert_specs_fit(state, specs):
  flat_state = jax.tree.leaves_with_path(state)
  flat_specs = jax.tree.structure(state).flatten_up_to(specs)
  assert jax.tree.structure(specs, is_leaf=is_spec) == jax.tree.structure(
    jax.tree.map(lambda _: 0, state)
  ), "spec tree must mirror the state"
  for (path, leaf), spec in zip(flat_state, flat_specs):
    where = jax.tree_util.keystr(path)
    assert spec is None or isinstance(spec, P), where
    if spec is not None:
      assert len(spec) == np.ndim(leaf), (where, spec, np.shape(leaf))
      names = [n for e in spec for n in ((e,) if isinstance(e, str) else e or ())]
      assert len(names) == len(set(names)) and names, (where, spec)


def assert_bytes_per_device(state, specs):
  flat_specs = jax.tree.structure(state).flatten_up_to(specs)
  for leaf, spec in zip(jax.tree.leaves(state), flat_specs):
    mesh_spec = P() if spec is None else nn.logical_to_mesh_axes(spec, RULES)
    axes = [a for e in mesh_spec for a in ((e,) if isinstance(e, str) else e or ())]
    shards = math.prod(leaf.sharding.mesh.shape[a] for a in axes)
    assert leaf.addressable_shards[0].data.nbytes * shards == leaf.nbytes, (spec, leaf.shape)


def as_numpy(x):
  if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  return np.asarray(x)


def check_sharded_step(tx, params, axes, mesh, steps=2, obj_fn=False):
  """Derives specs; runs a jitted sharded step; compares with unsharded."""
  abstract = jax.eval_shape(lambda: params)
  state = tx.init(params)
  specs = derive(
    jax.eval_shape(tx.init, abstract),
    axes,
    transformation=tx,
    params=abstract,
    fallback=StateRulesFallback.RAISE,
  )
  assert_specs_fit(state, specs)
  p_sh, s_sh = to_mesh(axes, mesh), to_mesh(specs, mesh)
  step = make_step(tx, obj_fn=obj_fn)
  sharded = jax.jit(step, in_shardings=(p_sh, s_sh), out_shardings=(p_sh, s_sh))
  p_ref, s_ref = params, state
  p_sh_val, s_sh_val = jax.device_put((params, state), (p_sh, s_sh))
  assert_bytes_per_device(s_sh_val, specs)
  unsharded = jax.jit(step)
  for _ in range(steps):
    p_ref, s_ref = unsharded(p_ref, s_ref)
    p_sh_val, s_sh_val = sharded(p_sh_val, s_sh_val)
  assert_bytes_per_device(s_sh_val, specs)
  for ref, got in zip(jax.tree.leaves((p_ref, s_ref)), jax.tree.leaves((p_sh_val, s_sh_val))):
    np.testing.assert_allclose(as_numpy(got), as_numpy(ref), rtol=2e-4, atol=2e-5)
  return specs


# ---------------------------------------------------------------------------
# The case table: introspected optax factories plus wrappers.


# Every optax / optax.contrib optimizer factory the package wraps that builds
# from a learning rate alone: the one discovered table all tests share.
FACTORIES = {case.name: case.make for case in DISCOVERED}


class RowScaleState(NamedTuple):
  """A user-defined state: a per-row statistic and a step count."""

  count: jax.Array
  row_sq: Any


def row_scale() -> optax.GradientTransformation:
  """A user's transformation keeping mean squared gradient per leading row."""

  def init(params):
    row = lambda p: jnp.zeros_like(jnp.mean(p, axis=-1)) if p.ndim else p * 0  # noqa: E731
    return RowScaleState(jnp.zeros([], jnp.int32), jax.tree.map(row, params))

  def update(updates, state, params=None):
    del params
    row = lambda g: jnp.mean(g * g, axis=-1) if g.ndim else g * g  # noqa: E731
    row_sq = jax.tree.map(lambda r, g: 0.9 * r + 0.1 * row(g), state.row_sq, updates)
    scaled = jax.tree.map(
      lambda g, r: g / (jnp.sqrt(r)[..., None] + 1.0) if g.ndim else g, updates, row_sq
    )
    return scaled, RowScaleState(state.count + 1, row_sq)

  return optax.GradientTransformation(init, update)


def _label(params):
  return jax.tree.map(lambda p: "a" if p.ndim >= 2 else "b", params)


WRAPPERS = {
  "chain": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
  "masked": lambda: optax.masked(
    optax.adam(1e-2), lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)
  ),
  "multi_transform": lambda: optax.multi_transform(
    {"a": optax.adam(1e-2), "b": optax.sgd(1e-2, momentum=0.9)}, _label
  ),
  "partition": lambda: optax.partition({"a": optax.lion(1e-2), "b": optax.adam(1e-2)}, _label),
  "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2),
  "inject_stateful_hyperparams": lambda: optax.inject_stateful_hyperparams(optax.adamw)(
    learning_rate=optax.linear_schedule(1e-2, 1e-3, 10)
  ),
  "multi_steps_skip": lambda: optax.MultiSteps(
    optax.adam(1e-2), 2, should_skip_update_fn=optax.skip_not_finite
  ).gradient_transformation(),
  "apply_if_finite": lambda: optax.apply_if_finite(optax.adam(1e-2), 3),
  "conditionally_transform": lambda: optax.conditionally_transform(
    optax.adam(1e-2), lambda step: step % 2 == 0
  ),
  "conditionally_mask": lambda: optax.conditionally_mask(
    optax.adam(1e-2), lambda step: step % 2 == 0
  ),
  "schedule_free": lambda: contrib.schedule_free(optax.adam(1.0), 1e-2),
  "reduce_on_plateau_in_chain": lambda: optax.chain(optax.adam(1e-2), contrib.reduce_on_plateau()),
  "ema": lambda: optax.ema(0.9),
  "add_noise": lambda: optax.add_noise(0.01, 0.55, 0),
  "zero_nans": lambda: optax.chain(optax.zero_nans(), optax.sgd(1e-2)),
  "adafactor_factored": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=4),
  "adafactor_momentum": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=4, momentum=0.9),
  "lbfgs": lambda: optax.lbfgs(),
  "galore": lambda: contrib.galore(1e-2, rank=4),
  "user_namedtuple_state": row_scale,
}
CASES = {**FACTORIES, **WRAPPERS}


def test_table_is_broad():
  assert len(FACTORIES) >= 30, sorted(FACTORIES)
  assert {"adamw", "adafactor", "sm3", "muon", "galore"} <= set(FACTORIES)


# optax's sm3 update raises IndexError on rank-0 params (its init gives them
# no accumulator); that is independent of sharding, so sm3 gets no scalar.
NO_SCALAR_PARAMS = {"sm3"}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_sharded_step_matches_unsharded(name, mesh):
  params, axes = make_params(), AXES
  if name in NO_SCALAR_PARAMS:
    params, axes = ({k: v for k, v in t.items() if k != "gate"} for t in (params, axes))
  check_sharded_step(CASES[name](), params, axes, mesh, obj_fn=any(n in name for n in NEEDS_OBJ_FN))


@pytest.mark.slow
def test_lookahead_with_lookahead_params(mesh):
  tx = optax.lookahead(optax.adam(1e-2), sync_period=2, slow_step_size=0.5)
  params = optax.LookaheadParams.init_synced(make_params())
  axes = optax.LookaheadParams(fast=AXES, slow=AXES)
  specs = check_sharded_step(tx, params, axes, mesh, steps=3)
  adam_axes = {**AXES, "gate": None}
  assert specs == optax.LookaheadState(
    fast_state=(optax.ScaleByAdamState(count=None, mu=adam_axes, nu=adam_axes), optax.EmptyState()),
    steps_since_sync=None,
  )


def test_lookahead_specs_are_derived_without_optaxs_warning(caplog):
  """The derivation's probe is a dict of params: given to lookahead's init, optax warned
  (`params` has no attribute `fast`) at every start of a lookahead run."""
  params = optax.LookaheadParams.init_synced({"a": jnp.ones((4, 8)), "b": jnp.ones((4, 8))})
  axes = optax.LookaheadParams.init_synced({"a": P("embed", "mlp"), "b": P("embed", "mlp")})
  opt_def = OptaxWrapper(optax.lookahead(optax.adam(1e-2), sync_period=2, slow_step_size=0.5))
  with caplog.at_level("WARNING"):
    specs = opt_def.derive_logical_axes(opt_def.create(params), axes).state.param_states
  assert not caplog.records, [r.getMessage() for r in caplog.records]
  assert specs.fast_state[0].mu == axes.fast


# ---------------------------------------------------------------------------
# Exact spec trees.


def abstract_params():
  return jax.tree.map(
    lambda s: jax.ShapeDtypeStruct(s, jnp.float32), SHAPES, is_leaf=lambda x: isinstance(x, tuple)
  )


def exact(tx):
  params = abstract_params()
  return derive(
    jax.eval_shape(tx.init, params),
    AXES,
    transformation=tx,
    params=params,
    fallback=StateRulesFallback.RAISE,
  )


def test_adamw_is_t5x_form():
  for specs in (exact(optax.adamw(1e-3)), derive(optax.adamw(1e-3).init(make_params()), AXES)):
    assert specs == (
      optax.ScaleByAdamState(count=None, mu=AXES, nu=AXES),
      optax.EmptyState(),
      optax.EmptyState(),
    )


def test_adafactor_factored_keeps_dims():
  specs = exact(optax.adafactor(1e-3, min_dim_size_to_factor=4))
  factored = specs[0]
  assert factored.count is None
  assert factored.v_row == {
    "dense": {"kernel": P("embed"), "bias": None},
    "attn": {"query": P("embed", "heads")},
    "norm": {"scale": None},
    "gate": None,
  }
  assert factored.v_col == {
    "dense": {"kernel": P("mlp"), "bias": None},
    "attn": {"query": P("heads", "kv")},
    "norm": {"scale": None},
    "gate": None,
  }
  assert factored.v == {
    "dense": {"kernel": None, "bias": P("mlp")},
    "attn": {"query": None},
    "norm": {"scale": P("embed")},
    "gate": None,
  }


def test_adafactor_v_row_is_sharded_along_embed(mesh):
  tx = optax.adafactor(1e-2, min_dim_size_to_factor=4)
  params = make_params()
  specs = exact(tx)
  state = jax.device_put(tx.init(params), to_mesh(specs, mesh))
  v_row = state[0].v_row["dense"]["kernel"]
  assert v_row.shape == (8,)
  assert v_row.sharding.spec == P("data")
  assert v_row.addressable_shards[0].data.shape == (4,)
  assert v_row.addressable_shards[0].data.nbytes == v_row.nbytes // 2


@pytest.mark.parametrize("context", ["set_mesh", "use_abstract_mesh"])
def test_specs_are_the_same_inside_the_users_mesh_context(mesh, context):
  """Deriving inside ``with jax.set_mesh(mesh):``, as jax and Flax users run, changes nothing."""
  tx = optax.adafactor(1e-2, min_dim_size_to_factor=4)
  outside = exact(tx)
  enter = jax.set_mesh(mesh) if context == "set_mesh" else None
  if enter is None:
    enter = jax.sharding.use_abstract_mesh(mesh.abstract_mesh)
  with enter:
    assert exact(tx) == outside


def test_sm3_per_dimension_accumulators():
  specs = exact(optax.sm3(1e-3))
  assert specs[0].mu == {
    "dense": {"kernel": [P("embed"), P("mlp")], "bias": [P("mlp")]},
    "attn": {"query": [P("embed"), P("heads"), P("kv")]},
    "norm": {"scale": [P("embed")]},
    "gate": [],
  }
  assert specs[0].nu == AXES


def test_inject_hyperparams():
  specs = exact(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9))
  assert specs == optax.InjectStatefulHyperparamsState(
    count=None,
    hyperparams={"learning_rate": None, "momentum": None},
    hyperparams_states={},
    inner_state=(optax.TraceState(trace=AXES), optax.EmptyState()),
  )


def test_multi_steps_with_skip_state():
  tx = optax.MultiSteps(
    optax.sgd(0.1, momentum=0.9), 2, should_skip_update_fn=optax.skip_not_finite
  )
  specs = exact(tx.gradient_transformation())
  assert specs == optax.MultiStepsState(
    mini_step=None,
    gradient_step=None,
    inner_opt_state=(optax.TraceState(trace=AXES), optax.EmptyState()),
    acc_grads=AXES,
    skip_state={"should_skip": None, "num_not_finite": None},
  )


def test_lbfgs_history_and_galore_projectors():
  specs = exact(optax.lbfgs())[0]
  assert specs.diff_params_memory["dense"] == {
    "kernel": P(None, "embed", "mlp"),
    "bias": P(None, "mlp"),
  }
  assert specs.diff_updates_memory == specs.diff_params_memory
  assert specs.weights_memory is None
  galore = exact(contrib.galore(1e-3, rank=4))[0]
  # kernel (8, 16): right projector (16, r) keeps 'mlp'; proxy (8, r) 'embed'.
  assert galore.projector["dense"]["kernel"] == P("mlp", None)
  assert galore.base_optimizer_state.mu["dense"]["kernel"] == P("embed", None)
  assert galore.base_optimizer_state.mu["dense"]["bias"] == P("mlp")


# GaLore inside low_precision: params of each orientation, a square one whose rank-16 proxy
# has its param's shape (so 8-bit and 4-bit compress it), a bias they compress at any rank.
GALORE_SHAPES = {"sq": (16, 16), "tall": (16, 4), "wide": (4, 16), "b": (16,)}
GALORE_AXES = {
  "sq": P("embed", "mlp"),
  "tall": P("mlp", "embed"),
  "wide": P("embed", "mlp"),
  "b": P("mlp"),
}


def _galore_specs(mu, projector):
  adam = optax.ScaleByAdamState(count=None, mu=mu, nu=mu)
  return contrib.GaLoreState(count=None, base_optimizer_state=adam, projector=projector)


_PROJECTED = {
  "b": P("mlp"),
  "sq": P(None, "mlp"),
  "tall": P(None, "embed"),
  "wide": P("embed", None),
}
_PROJECTORS = {"b": None, "sq": P("embed", None), "tall": P("mlp", None), "wide": P("mlp", None)}
# GaLore's own specs by (rank, params given). Without params its rule cannot run: leaves of
# the one shape their param's mirrors all share take the param's spec, the rest replicate.
GALORE_ALONE = {
  (16, True): _galore_specs(_PROJECTED, _PROJECTORS),
  (4, True): _galore_specs(_PROJECTED, _PROJECTORS),
  (16, False): _galore_specs(
    {"b": P("mlp"), "sq": P("embed", "mlp"), "tall": None, "wide": None},
    {"b": None, "sq": P("embed", "mlp"), "tall": None, "wide": None},
  ),
  (4, False): _galore_specs(
    {"b": P("mlp"), "sq": None, "tall": None, "wide": None}, dict.fromkeys(GALORE_SHAPES)
  ),
}
# The moments 8-bit and 4-bit compress, by (rank, params given): (codes, scales) specs, the
# codes taking the spec GaLore gives the moment; one block spans a row of the scales.
GALORE_COMPRESSED = {
  (16, True): {"b": (P("mlp"), None), "sq": (P(None, "mlp"), None)},
  (4, True): {"b": (P("mlp"), None)},
  (16, False): {"b": (P("mlp"), None), "sq": (P("embed", "mlp"), P("embed", None))},
  (4, False): {"b": (P("mlp"), None)},
}
COMPRESSED_LEAF = {"8bit": QuantizedLeaf, "4bit": Quantized4Leaf}


def _galore_in_low_precision_specs(mode, rank, with_params):
  alone = GALORE_ALONE[rank, with_params]
  if mode not in COMPRESSED_LEAF:
    return alone
  moments = {**alone.base_optimizer_state.mu}
  for name, specs in GALORE_COMPRESSED[rank, with_params].items():
    moments[name] = COMPRESSED_LEAF[mode](*specs)
  adam = alone.base_optimizer_state._replace(mu=moments, nu=moments)
  return alone._replace(base_optimizer_state=adam)


@pytest.mark.parametrize(
  ("mode", "rank", "with_params"),
  [
    pytest.param(
      mode, rank, with_params, marks=[pytest.mark.slow] if rank == 16 and with_params else []
    )
    for mode in ("8bit", "4bit", "bfloat16")
    for rank in (16, 4)
    for with_params in (True, False)
  ],
)
def test_galore_in_low_precision_keeps_galores_specs(mode, rank, with_params):
  """Each leaf kept as it is has GaLore's own spec; a compressed one's codes have it too."""
  params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in GALORE_SHAPES.items()}

  def specs(tx):
    given = {"transformation": tx, "params": params} if with_params else {}
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")  # Without params, the leaves left replicate with a warning.
      return derive(jax.eval_shape(tx.init, params), GALORE_AXES, **given)

  empty = (optax.EmptyState(), optax.EmptyState())
  assert specs(contrib.galore(1e-2, rank=rank)) == (GALORE_ALONE[rank, with_params], *empty)
  got = specs(low_precision(contrib.galore(1e-2, rank=rank), mode, min_size=0))
  assert got.count is None
  assert got.inner_state == (_galore_in_low_precision_specs(mode, rank, with_params), *empty)


@pytest.mark.slow
@pytest.mark.parametrize("rank", [16, 4])
def test_galore_in_8bit_sharded_step_matches_unsharded(rank, mesh):
  params = make_params(GALORE_SHAPES)
  tx = low_precision(contrib.galore(1e-2, rank=rank), "8bit", min_size=0)
  specs = check_sharded_step(tx, params, GALORE_AXES, mesh)
  assert specs.inner_state == (
    _galore_in_low_precision_specs("8bit", rank, True),
    *specs.inner_state[1:],
  )


def test_masked_mirrors_resolve_without_transformation():
  tx = optax.masked(optax.adam(1e-3), lambda p: jax.tree.map(lambda x: x.ndim >= 2, p))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    specs = derive(tx.init(make_params()), AXES)
  mu = specs.inner_state[0].mu
  assert mu["dense"] == {"kernel": P("embed", "mlp"), "bias": optax.MaskedNode()}


@pytest.mark.parametrize("frozen", ["params", "axes"])
def test_masked_mirrors_of_frozen_dicts_resolve_against_plain_dicts(frozen):
  # flax.core.freeze(variables)['params'] with nn.get_partition_spec's plain dicts, or the reverse.
  params, axes = make_params(), AXES
  if frozen == "params":
    params = flax.core.freeze(params)
  else:
    axes = flax.core.freeze(axes)
  tx = optax.masked(optax.adam(1e-3), jax.tree.map(lambda x: x.ndim >= 2, params))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    specs = derive(tx.init(params), axes)
  mu = specs.inner_state[0].mu
  assert mu["dense"]["kernel"] == P("embed", "mlp")
  assert mu["attn"]["query"] == P("embed", "heads", "kv")
  assert mu["norm"]["scale"] == optax.MaskedNode()


# ---------------------------------------------------------------------------
# Forms of params axes, abstract params, repeated names.


class Dense(nn.Module):
  @nn.compact
  def __call__(self, x):
    k = flax_partitioning.param_with_axes(
      "kernel", nn.initializers.ones, (8, 16), axes=("embed", "mlp")
    )
    return x @ k


class BoxedDense(nn.Module):
  @nn.compact
  def __call__(self, x):
    k = self.param(
      "kernel", nn.with_logical_partitioning(nn.initializers.ones, ("embed", "mlp")), (8, 16)
    )
    return x @ k


def test_params_axes_forms():
  expected = {"kernel": P("embed", "mlp")}
  variables = jax.eval_shape(Dense().init, jax.random.key(0), jnp.ones((1, 8)))
  assert logical_axes_from(variables["params_axes"]) == expected
  assert logical_axes_from({"params_axes": variables["params_axes"]}) == expected
  boxed = jax.eval_shape(BoxedDense().init, jax.random.key(0), jnp.ones((1, 8)))
  assert logical_axes_from(boxed["params"]) == expected
  assert logical_axes_from(flax.core.freeze(expected)) == flax.core.freeze(expected)
  assert logical_axes_from({"kernel": ("embed", "mlp")}) == expected
  tx = optax.adamw(1e-3)
  state = jax.eval_shape(tx.init, nn.unbox(boxed["params"]))
  specs = derive(state, boxed["params"], transformation=tx, params=boxed["params"])
  assert specs[0].mu == expected
  with pytest.raises(TypeError, match=r"params_axes leaf at 'kernel'"):
    logical_axes_from({"kernel": "embed"})


def test_mesh_axis_boxes_are_refused_naming_the_param():
  # nn.with_partitioning names mesh axes; read as logical names they would replicate.
  boxed = {"dense": {"kernel": nn.Partitioned(jnp.ones((8, 16)), ("data", "model"))}}
  refused = r"'dense/kernel' is a flax Partitioned box .*mesh axes.*nn.with_logical_partitioning"
  with pytest.raises(TypeError, match=refused):
    logical_axes_from(boxed)
  params = nn.unbox(boxed)
  tx = optax.adam(1e-3)
  with pytest.raises(TypeError, match=refused):
    derive(tx.init(params), boxed, transformation=tx, params=params)
  logical = {"dense": {"kernel": nn.LogicallyPartitioned(jnp.ones((8, 16)), ("embed", "mlp"))}}
  assert derive(tx.init(params), logical)[0].mu == {"dense": {"kernel": P("embed", "mlp")}}


def test_a_state_built_from_boxed_params_gets_the_params_specs():
  # Flax's TrainState.create(params=boxed) inits the optax state on the boxes, so it holds boxes.
  boxed = BoxedDense().init(jax.random.key(0), jnp.ones((1, 8)))["params"]
  adam = optax.adam(1e-3)
  state = adam.init(boxed)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for specs in (derive(state, boxed, transformation=adam, params=boxed), derive(state, boxed)):
      assert specs[0].mu == nn.get_partition_spec(state)[0].mu == {"kernel": P("embed", "mlp")}
      assert all(is_spec(x) for x in jax.tree.leaves(specs, is_leaf=is_spec))
    # The boxes of a factored leaf keep the param's names; its spec keeps the dims it has.
    factored = optax.adafactor(1e-3, min_dim_size_to_factor=4)
    specs = derive(factored.init(boxed), boxed, transformation=factored, params=boxed)
  assert specs[0].v_row == {"kernel": P("embed")}
  assert specs[0].v_col == {"kernel": P("mlp")}


def test_repeated_names_and_short_specs():
  params = {
    "w": jax.ShapeDtypeStruct((8, 8), jnp.float32),
    "v": jax.ShapeDtypeStruct((8, 16), jnp.float32),
  }
  axes = {"w": P("embed", "embed"), "v": P("embed")}
  tx = optax.adafactor(1e-3, min_dim_size_to_factor=4)
  specs = derive(
    jax.eval_shape(tx.init, params),
    axes,
    transformation=tx,
    params=params,
    fallback=StateRulesFallback.RAISE,
  )[0]
  assert specs.v_row == {"w": P("embed"), "v": P("embed")}
  assert specs.v_col == {"w": None, "v": None}


# ---------------------------------------------------------------------------
# Fallback policy and registry.


class OddState(NamedTuple):
  history: jax.Array


def odd_transformation():
  return optax.GradientTransformation(
    lambda p: OddState(jnp.zeros((3, 5))), lambda u, s, p=None: (u, s)
  )


def test_fallback_replicate_with_warning_and_raise():
  state = optax.adamw(1e-3).init(make_params())
  broken = {**AXES, "norm": {"scale": P("embed", "mlp")}}  # too long for (8,)
  with pytest.warns(UserWarning, match=r"0/mu/norm/scale \(shape \(8,\)\)"):
    specs = derive(state, broken)
  assert specs[0].mu["norm"]["scale"] is None
  with pytest.raises(
    ValueError,
    match=r"0/mu/norm/scale.*"
    r"shape \(8,\).*P(artitionSpec)?\('embed', 'mlp'\)",
  ):
    derive(state, broken, params=make_params(), fallback=StateRulesFallback.RAISE)
  odd = odd_transformation().init(make_params())
  with pytest.raises(ValueError, match=r"history \(shape \(3, 5\)\)"):
    derive(odd, AXES, fallback=StateRulesFallback.RAISE)


def test_factored_state_without_transformation_falls_back():
  tx = optax.adafactor(1e-3, min_dim_size_to_factor=4)
  with pytest.raises(ValueError, match=r"v_row"):
    derive(tx.init(make_params()), AXES, fallback=StateRulesFallback.RAISE)


def test_registry_refuses_duplicates_and_applies_rules():
  def rule(state, specs, context):
    del state, context
    return specs._replace(history=P(None, "mlp"))

  register_state_rule(OddState, rule)
  with pytest.raises(ValueError, match="already registered"):
    register_state_rule(OddState, rule)
  with pytest.raises(ValueError, match="already registered"):
    register_state_rule(optax.ScaleByLBFGSState, rule)
  register_state_rule(OddState, rule, replace=True)
  odd = odd_transformation().init(make_params())
  assert derive(odd, AXES) == OddState(history=P(None, "mlp"))
  with pytest.raises(TypeError):
    register_state_rule("OddState", rule)


class FaultyState(NamedTuple):
  trace: jax.Array


def test_a_rule_that_fails_is_named_with_the_node_path():
  def raises(state, specs, context):
    del specs, context
    return state.trace.shape[5]  # a rule's own bug: IndexError

  def wrong_tree(state, specs, context):
    del state, specs, context
    return (P("mlp"), P("embed"))

  init = lambda p: {"inner": FaultyState(jnp.zeros((3, 5)))}  # noqa: E731
  state = optax.GradientTransformation(init, lambda u, s, p=None: (u, s)).init(make_params())
  register_state_rule(FaultyState, raises)
  with pytest.raises(IndexError) as raised:
    derive(state, AXES)
  assert "state rule for FaultyState at inner/trace" in "\n".join(
    getattr(raised.value, "__notes__", ())
  )
  register_state_rule(FaultyState, wrong_tree, replace=True)
  with pytest.raises(ValueError, match=r"state rule for FaultyState at inner/trace returned"):
    derive(state, AXES)


# ---------------------------------------------------------------------------
# Property test.

NAMES = ("embed", "mlp", "heads", "kv", None)
PROPERTY_OPTIMIZERS = {
  "adamw": lambda: optax.adamw(1e-2),
  "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=4),
  "sm3": lambda: optax.sm3(1e-2),
  "lion_masked": lambda: optax.masked(
    optax.lion(1e-2), lambda p: jax.tree.map(lambda x: x.ndim != 1, p)
  ),
  "user": row_scale,
}


@st.composite
def param_trees(draw):
  n = draw(st.integers(1, 4))
  shapes, axes = {}, {}
  for i in range(n):
    rank = draw(st.integers(0, 3))
    shapes[f"p{i}"] = tuple(draw(st.sampled_from((4, 8))) for _ in range(rank))
    names = [draw(st.sampled_from(NAMES)) for _ in range(rank)]
    axes[f"p{i}"] = None if draw(st.booleans()) and rank == 0 else P(*names)
  return shapes, axes


@pytest.mark.slow
@hypothesis.settings(
  max_examples=4,
  deadline=None,
  derandomize=True,
  suppress_health_check=[hypothesis.HealthCheck.too_slow],
)
@hypothesis.given(tree=param_trees(), optimizer=st.sampled_from(sorted(PROPERTY_OPTIMIZERS)))
def test_random_trees_shard(tree, optimizer):
  shapes, axes = tree
  hypothesis.assume(optimizer not in NO_SCALAR_PARAMS or all(shapes.values()))
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
  params = make_params(shapes)
  # Params themselves use the spec with repeated names dropped, as flax does.
  param_axes = jax.tree.map(
    lambda s: s if s is None else P(*(n if n not in s[:i] else None for i, n in enumerate(s))),
    axes,
    is_leaf=is_spec,
  )
  tx = PROPERTY_OPTIMIZERS[optimizer]()
  specs = check_sharded_step(tx, params, param_axes, mesh, steps=1)
  unnormalised = derive(
    jax.eval_shape(tx.init, params),
    axes,
    transformation=tx,
    params=params,
    fallback=StateRulesFallback.RAISE,
  )
  assert unnormalised == specs


# ---------------------------------------------------------------------------
# One `fallback` setting across every adapter, one registry.


@jax_example_optimizers.optimizer
def _triple_with_odd_state(step_size: float):
  """A triple whose per-param state holds a (3,) vector matching no param dimension."""
  return (
    lambda x: (x, jnp.zeros(3)),
    lambda i, g, s: (s[0] - step_size * g, s[1]),
    lambda s: s[0],
  )


def _kfac_case(fallback):
  """A K-FAC dense layer with bias: its (in + 1, in + 1) factor matches no dimension."""
  kfac_jax = import_kfac_jax()
  from t5x_optim import KfacOptimizerDef

  def loss(params, batch):
    x, y = batch
    logits = x @ params["w"] + params["b"]
    kfac_jax.register_softmax_cross_entropy_loss(logits, y)
    return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(4), y])

  kfac = kfac_jax.Optimizer(
    value_and_grad_func=jax.value_and_grad(loss), l2_reg=0.0, num_burnin_steps=0
  )
  batch = (jnp.ones((4, 3)), jnp.array([0, 1, 0, 1]))
  opt_def = KfacOptimizerDef(kfac, init_batch=batch, fallback=fallback)
  params = {"w": jnp.zeros((3, 2)), "b": jnp.zeros(2)}
  return opt_def, params, {"w": P("embed", "mlp"), "b": P("mlp")}


def _optax_case(fallback):
  # A spec naming more axes than the param has: mu and nu cannot keep it.
  return OptaxWrapper(optax.adam(0.1), fallback=fallback), {"w": jnp.ones(4)}, {"w": P("a", "b")}


def _multi_case(fallback):
  opt_def = MultiOptimizer([("w", OptaxWrapper(optax.adam(0.1)))], fallback=fallback)
  return opt_def, {"w": jnp.ones(4), "frozen": jnp.ones(2)}, {"w": P("a", "b"), "frozen": None}


def _example_lib_case(fallback):
  opt_def = ExampleLibOptimizerDef(_triple_with_odd_state(0.1), fallback=fallback)
  return opt_def, {"w": jnp.ones((4, 8))}, {"w": P("embed", "mlp")}


FALLBACK_CASES = {
  # adapter: (build(fallback) -> (opt_def, params, axes), bad leaf path regex, its replicated spec)
  "optax": (_optax_case, r"0/mu/w \(shape \(4,\), spec", lambda s: s[0].mu["w"]),
  "multi": (
    _multi_case,
    r"0/mu/w \(shape \(4,\), spec",
    lambda s: s[0].param_states[0].mu["w"],
  ),
  "example_lib": (
    _example_lib_case,
    r"w/1 \(shape \(3,\)\): they have neither",
    lambda s: s["w"]["1"],
  ),
  "kfac": (
    _kfac_case,
    r"estimator_state/blocks_states/0/factors/0/value \(shape \(4, 4\)\).*: K-FAC state",
    lambda s: s.estimator_state.blocks_states[0].factors[0].value,
  ),
}


@pytest.mark.filterwarnings(r"ignore:jax\.core\.\w+ is deprecated:DeprecationWarning")
@pytest.mark.parametrize("fallback", list(StateRulesFallback))
@pytest.mark.parametrize("adapter", sorted(FALLBACK_CASES))
def test_every_adapter_takes_the_one_fallback_setting(adapter, fallback):
  build, path, replicated = FALLBACK_CASES[adapter]
  opt_def, params, axes = build(fallback)
  assert opt_def.fallback is fallback
  opt = opt_def.create(params)
  if fallback is StateRulesFallback.RAISE:
    with pytest.raises(ValueError, match=r"cannot derive a valid logical spec.*" + path):
      opt_def.derive_logical_axes(opt, axes)
  else:
    with pytest.warns(UserWarning, match=r"replicating \d+ optimizer state leaves.*" + path):
      specs = opt_def.derive_logical_axes(opt, axes).state.param_states
    assert replicated(specs) is None


@pytest.mark.parametrize(
  ("multi_fallback", "sub_fallback", "raises"),
  [
    (None, StateRulesFallback.RAISE, True),  # None: each sub-optimizer keeps its own
    (None, StateRulesFallback.REPLICATE_WITH_WARNING, False),
    (StateRulesFallback.REPLICATE_WITH_WARNING, StateRulesFallback.RAISE, False),
    ("raise", StateRulesFallback.REPLICATE_WITH_WARNING, True),
  ],
)
def test_multi_optimizer_fallback_overrides_only_when_set(multi_fallback, sub_fallback, raises):
  sub = OptaxWrapper(optax.adam(0.1), fallback=sub_fallback)
  opt_def = MultiOptimizer([("w", sub)], fallback=multi_fallback)
  opt = opt_def.create({"w": jnp.ones(4)})
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    if raises:
      with pytest.raises(ValueError, match=r"0/mu/w \(shape"):
        opt_def.derive_logical_axes(opt, {"w": P("a", "b")})
    else:
      opt_def.derive_logical_axes(opt, {"w": P("a", "b")})
      assert any("replicating" in str(w.message) for w in caught)
  assert sub.fallback is sub_fallback


def test_bad_fallback_value_is_refused():
  with pytest.raises(ValueError, match="not a valid StateRulesFallback"):
    OptaxWrapper(optax.sgd(0.1), fallback="ignore")


def test_adapter_state_rules_are_registered_once():
  from t5x_optim._adapters.example_lib_layout import PartsNode
  from t5x_optim._axes.registry import registered_rules

  registered = registered_rules()
  types = [optax.ScaleByLBFGSState, contrib.GaLoreState, PartsNode]
  for state_type in types:
    assert state_type in registered
    with pytest.raises(ValueError, match="already registered; pass replace=True"):
      register_state_rule(state_type, registered[state_type].rule)
  assert registered_rules()[PartsNode] == registered[PartsNode]


def _zeros_momentum() -> optax.GradientTransformation:
  """A momentum whose state is built by ``jnp.zeros(p.shape)``, not ``zeros_like``."""

  def init(params):
    return {"m": jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype), params)}

  def update(updates, state, params=None):
    del params
    m = jax.tree.map(lambda m, g: 0.9 * m + g, state["m"], updates)
    return m, {"m": m}

  return optax.GradientTransformation(init, update)


def test_a_square_params_moment_keeps_its_spec_where_tracing_tells_nothing():
  """A moment built by jnp.zeros(p.shape) carries no sharding when traced: the moment of a
  square param, whose orientation its shape cannot confirm, came back replicated without a
  word (even with fallback RAISE), while a rectangular param's kept its spec."""
  tx = _zeros_momentum()
  params = {"square": jnp.ones((8, 8)), "rect": jnp.ones((4, 8))}
  axes = {"square": P("embed", "mlp"), "rect": P("embed", "mlp")}
  specs = OptaxStatePartitionRules.derive_optax_logical_axes(
    tx.init(params), axes, transformation=tx, params=params, fallback=StateRulesFallback.RAISE
  )
  assert specs == {"m": {"square": P("embed", "mlp"), "rect": P("embed", "mlp")}}
  # A transposed copy still takes its orientation from tracing.
  transposed = optax.GradientTransformation(
    lambda p: {"t": jax.tree.map(lambda x: x.T, p)}, lambda u, s, p=None: (u, s)
  )
  specs = OptaxStatePartitionRules.derive_optax_logical_axes(
    transposed.init(params), axes, transformation=transposed, params=params
  )
  assert specs["t"]["square"] == P("mlp", "embed")


def test_derive_optax_logical_axes_takes_the_fallback_by_name():
  """fallback="raise" ended in AttributeError: 'str' object has no attribute 'handle', as
  an unknown name did; OptaxWrapper already took names."""
  state = {"h": jnp.zeros((3, 4, 8))}
  with pytest.raises(ValueError, match=r"h"):
    OptaxStatePartitionRules.derive_optax_logical_axes(
      state, {"w": P("embed", "mlp")}, fallback="raise"
    )
  with pytest.raises(ValueError, match="not a valid StateRulesFallback"):
    OptaxStatePartitionRules.derive_optax_logical_axes(state, {"w": P("embed")}, fallback="ignore")
