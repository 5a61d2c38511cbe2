"""The fused multi-tensor update, `OptaxWrapper(fused=...)`, against the plain path.

Numerics run over the one optimizer table in Pallas interpret mode (the
kernel a GPU runs, executed by XLA:CPU); sharding runs
sharded `jax.jit` steps on 8 simulated CPU devices against unsharded plain
steps, under Auto (custom_partitioning) and Explicit (shard_map) mesh axes.
"""

from __future__ import annotations

import functools
import re
import warnings
from typing import Any

import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from optimizer_table import (
  TABLE,
  Case,
  grads_and_extras,
  initial_params,
  make_params,
  tree_equal,
  wrapper_step,
)
from test_low_precision_sharded import split_a, split_a_step

from t5x_optim import FusedUpdate, MultiOptimizer, OptaxWrapper, PathFilter, fusion_report
from t5x_optim._layouts import fused as fused_module

pytestmark = pytest.mark.usefixtures("shared_compilation_cache")

STEPS = 3
# The documented bound: one fused step and one plain step from the same
# params, state and gradients agree, element by element, within this many
# float32 ulps of the largest magnitude in the leaf (measured: at most 1;
# most optimizers are bit-exact).
ULPS = 2.0
# Names the analysis must find elementwise, or not; the table itself comes
# from introspecting optax and optax.contrib.
MUST_FUSE = {"adam", "adamw", "lion", "sgd", "rmsprop", "adagrad", "adabelief", "yogi", "chain"}
MUST_NOT_FUSE = {"adafactor_factored", "muon", "lbfgs", "masked", "multisteps", "lookahead"}


def leaf_scale_ulps(fused: Any, plain: Any) -> float:
  """The largest difference, in ulps of each plain leaf's largest magnitude."""
  worst = 0.0
  for a, b in zip(jax.tree.leaves(fused), jax.tree.leaves(plain), strict=True):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    if not np.issubdtype(b.dtype, np.floating):
      assert np.array_equal(a, b)
      continue
    if not b.size:
      continue
    scale = np.spacing(np.max(np.abs(b)).astype(b.dtype)).astype(np.float64)
    worst = max(worst, float(np.max(np.abs(a.astype(np.float64) - b)) / scale))
  return worst


@functools.cache
def _run(case: Case, fused: str) -> tuple[list, list, str]:
  """STEPS jitted plain steps, and a `fused` step from each plain step's input.

  Returns the plain optimizers after each step, the fused step's results
  from the same inputs, and the fused step's jaxpr.
  """
  tx = case.make()
  opt = OptaxWrapper(tx).create(initial_params(case))
  fused_def = OptaxWrapper(tx, fused=fused)
  # One jitted function steps both: where the fused optimizer takes the plain path, its
  # program is the plain one, and the module's compilation cache loads it instead of
  # compiling it again.
  step = jax.jit(wrapper_step)
  plain, fused_out = [], []
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", "OptaxWrapper\\(fused=")
    jaxpr = str(jax.make_jaxpr(wrapper_step)(opt.replace(optimizer_def=fused_def)))
    for _ in range(STEPS):
      fused_out.append(step(opt.replace(optimizer_def=fused_def)))
      opt = step(opt)
      plain.append(opt)
  return plain, fused_out, jaxpr


def _assert_steps_agree(case: Case, fused: str) -> None:
  plain, fused_out, _ = _run(case, fused)
  for want, got in zip(plain, fused_out, strict=True):
    assert leaf_scale_ulps(got.target, want.target) <= ULPS
    assert leaf_scale_ulps(got.state.param_states, want.state.param_states) <= ULPS
    assert int(got.state.step) == int(want.state.step)


@functools.cache
def _report(case: Case):
  tx, params = case.make(), initial_params(case)
  grads, extras = grads_and_extras(tx, params)
  return fusion_report(tx, params, grads=grads, extra_args=extras)


@pytest.mark.slow
@pytest.mark.parametrize("case", TABLE, ids=repr)
def test_fused_matches_plain_over_the_table(case: Case):
  """Fusible updates run the Pallas kernel within ULPS; the rest run plain, bit for bit."""
  plain, fused_out, jaxpr = _run(case, "interpret")
  if _report(case).fusible:
    assert "pallas_call" in jaxpr
    _assert_steps_agree(case, "interpret")
  else:
    assert "pallas_call" not in jaxpr
    for want, got in zip(plain, fused_out, strict=True):
      assert tree_equal(got.target, want.target)
      assert tree_equal(got.state, want.state)


@pytest.mark.slow
def test_the_elementwise_set_is_found_by_analysis():
  names = {case.name: case for case in TABLE}
  assert MUST_FUSE | MUST_NOT_FUSE <= set(names)
  for name in MUST_FUSE:
    report = _report(names[name])
    assert report.fusible and report.reason is None, (name, report.reason)
    assert report.groups == (("dense/bias", "dense/kernel", "out/kernel"),), name
  for name in MUST_NOT_FUSE:
    report = _report(names[name])
    assert not report.fusible and report.groups == () and report.reason, name
  fusible = sum(_report(case).fusible for case in TABLE)
  assert fusible >= len(TABLE) // 2


@pytest.mark.slow
@pytest.mark.parametrize(
  "tx, reason",
  [
    (optax.adafactor(1e-2, min_dim_size_to_factor=4), r"reads a non-scalar value"),
    (optax.novograd(1e-2), r"'cond' combines the leaves dense/bias, dense/kernel, out/kernel"),
    (optax.contrib.muon(1e-2), r"on leaf dense/kernel"),
  ],
)
def test_not_fusible_warns_with_the_reason_and_runs_plain(tx, reason):
  params = make_params()
  grads = jax.tree.map(jnp.ones_like, params)
  plain = OptaxWrapper(tx).create(params).apply_gradient(grads)
  with pytest.warns(UserWarning, match=r"fused='interpret'.*cannot run fused \(.*" + reason):
    fused = OptaxWrapper(tx, fused="interpret").create(params).apply_gradient(grads)
  assert tree_equal(fused.target, plain.target)
  assert re.search(reason, fusion_report(tx, params).reason)


@pytest.mark.slow
def test_leaves_larger_than_a_block_and_padding(monkeypatch):
  """Several Pallas blocks per group, a padded tail, and groups cut by size."""
  monkeypatch.setattr(fused_module.analysis, "_GROUP_ELEMENTS", 5000)
  params = {"a": jnp.linspace(-1.0, 1.0, 4099), "b": jnp.ones((3, 5)), "c": jnp.full((1500,), 0.5)}
  tx = optax.adamw(1e-2)
  assert fusion_report(tx, params).groups == (("a", "b"), ("c",))
  grads = jax.tree.map(lambda x: jnp.cos(3.0 * x), params)
  plain = OptaxWrapper(tx).create(params)
  fused = OptaxWrapper(tx, fused="interpret").create(params)
  for _ in range(2):
    plain, fused = plain.apply_gradient(grads), fused.apply_gradient(grads)
  assert leaf_scale_ulps(fused.target, plain.target) <= ULPS
  assert leaf_scale_ulps(fused.state.param_states, plain.state.param_states) <= ULPS


@pytest.mark.slow
def test_dtypes_form_their_own_groups():
  params = {"f32": jnp.ones((4, 4)), "bf16": jnp.ones((8,), jnp.bfloat16), "g": jnp.ones(3)}
  tx = optax.adam(1e-2, mu_dtype=jnp.bfloat16)
  assert fusion_report(tx, params).groups == (("bf16",), ("f32", "g"))
  grads = jax.tree.map(
    lambda x: (0.1 * jnp.arange(x.size).reshape(x.shape)).astype(x.dtype), params
  )
  plain = OptaxWrapper(tx).create(params).apply_gradient(grads)
  fused = OptaxWrapper(tx, fused="interpret").create(params).apply_gradient(grads)
  assert jax.tree.map(lambda x: x.dtype, fused.state) == jax.tree.map(
    lambda x: x.dtype, plain.state
  )
  assert leaf_scale_ulps(fused.target, plain.target) <= ULPS


@pytest.mark.slow
def test_state_dict_and_specs_are_the_plain_paths():
  params = make_params()
  grads = jax.tree.map(jnp.ones_like, params)
  plain = OptaxWrapper(optax.adamw(1e-2)).create(params).apply_gradient(grads)
  fused = OptaxWrapper(optax.adamw(1e-2), fused="interpret").create(params).apply_gradient(grads)
  as_shapes = functools.partial(jax.tree.map, lambda x: (x.shape, x.dtype))
  assert as_shapes(fused.state_dict()) == as_shapes(plain.state_dict())
  restored = fused.restore_state(plain.state_dict())
  assert tree_equal(restored.state, plain.state)
  axes = jax.tree.map(lambda x: P(*([None] * (x.ndim - 1)), "mlp"), params)
  assert fused.optimizer_def.derive_logical_axes(fused, axes) == (
    plain.optimizer_def.derive_logical_axes(plain, axes).replace(optimizer_def=fused.optimizer_def)
  )


@pytest.mark.parametrize(
  "value, mode",
  [
    ("off", FusedUpdate.OFF),
    (True, FusedUpdate.AUTO),
    (False, FusedUpdate.OFF),
    ("interpret", FusedUpdate.INTERPRET),
  ],
)
def test_fused_values(value, mode):
  assert OptaxWrapper(optax.sgd(0.1), fused=value).fused is mode


def test_fused_value_errors():
  with pytest.raises(ValueError, match=r"fused= must be a bool or one of \['off', 'auto'"):
    OptaxWrapper(optax.sgd(0.1), fused="fast")
  opt = OptaxWrapper(optax.sgd(0.1), fused="pallas").create({"w": jnp.ones(2)})
  with pytest.raises(ValueError, match=r"fused='pallas' needs a GPU; the default backend is 'cpu'"):
    opt.apply_gradient({"w": jnp.ones(2)})


def test_auto_takes_the_plain_path_off_gpu():
  opt = OptaxWrapper(optax.adamw(1e-2), fused="auto").create(make_params())
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    jaxpr = str(jax.make_jaxpr(wrapper_step)(opt))
  assert "custom_partitioning" not in jaxpr and "pallas_call" not in jaxpr


# Sharded: params with different specs (one transposed), ZeRO state over "data".
SHAPES = {"a": (16, 8), "b": (8, 16), "c": (16,)}
PARAM_SPECS = {"a": P("data", "model"), "b": P("model", None), "c": P()}
ZERO_SPECS = {"a": P("data", "model"), "b": P("model", "data"), "c": P("data")}
TXS = {
  "adamw": lambda: optax.adamw(1e-2),
  "clip_adamw": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2)),
}


def _sharded_params():
  rng = np.random.default_rng(0)
  return {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in SHAPES.items()}


def _grads(step):
  rng = np.random.default_rng(step + 1)
  return {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in SHAPES.items()}


def _shardings(opt, mesh, zero):
  def named(specs):
    return {k: NamedSharding(mesh, spec) for k, spec in specs.items()}

  state_specs = named(ZERO_SPECS if zero else PARAM_SPECS)

  def state_leaf(path, x):
    key = jax.tree_util.keystr(path[-1:], simple=True)
    return state_specs[key] if np.ndim(x) else NamedSharding(mesh, P())

  param_states = jax.tree.map_with_path(state_leaf, opt.state.param_states)
  return opt.replace(
    target=named(PARAM_SPECS),
    state=opt.state.replace(step=NamedSharding(mesh, P()), param_states=param_states),
  ), named(PARAM_SPECS)


@functools.cache
def _unsharded_plain(tx_name):
  opt = OptaxWrapper(TXS[tx_name]()).create(_sharded_params())
  step = jax.jit(lambda o, g: o.apply_gradient(g))
  for i in range(STEPS):
    opt = step(opt, _grads(i))
  return opt


def _sharded_run(tx_name, fused, axis_type, zero):
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)
  opt = OptaxWrapper(TXS[tx_name](), fused=fused).create(_sharded_params())
  opt_sh, grad_sh = _shardings(opt, mesh, zero)
  step = jax.jit(
    lambda o, g: o.apply_gradient(g),
    in_shardings=(opt_sh, grad_sh),
    out_shardings=opt_sh,
    donate_argnums=0,
  )
  opt = jax.device_put(opt, opt_sh)
  hlo = step.lower(opt, jax.device_put(_grads(0), grad_sh)).compile().as_text()
  for i in range(STEPS):
    opt = step(opt, jax.device_put(_grads(i), grad_sh))
  collectives = sorted(re.findall(r"(all-gather|all-reduce|all-to-all|collective-permute)\(", hlo))
  return opt, collectives


@pytest.mark.slow
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
@pytest.mark.parametrize("zero", [False, True], ids=["replicated_state", "zero"])
@pytest.mark.parametrize("tx_name", list(TXS))
def test_sharded_fused_matches_unsharded_plain(tx_name, zero, axis_type):
  """8 devices: the values, shardings and collectives of sharded plain steps.

  Sharded plain steps themselves differ from unsharded ones where a sum is
  split across devices (the global norm), so both are held to unsharded
  plain within a tolerance, and the fused path to sharded plain within ULPS.
  """
  expected = _unsharded_plain(tx_name)
  plain, plain_collectives = _sharded_run(tx_name, "off", axis_type, zero)
  fused, collectives = _sharded_run(tx_name, "interpret", axis_type, zero)
  for got, want in [(fused, plain), (plain, expected), (fused, expected)]:
    for a, b in zip(jax.tree.leaves(got.target), jax.tree.leaves(want.target), strict=True):
      np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  assert leaf_scale_ulps(fused.target, plain.target) <= ULPS
  assert leaf_scale_ulps(fused.state.param_states, plain.state.param_states) <= ULPS
  specs = functools.partial(jax.tree.map, lambda x: x.sharding.spec)
  assert specs(fused.target) == specs(plain.target)
  assert specs(fused.state) == specs(plain.state)
  assert collectives == plain_collectives


@pytest.mark.slow
def test_a_shard_map_step_with_check_vma_runs_fused():
  """A fused update under a `jax.shard_map` of the user's (``check_vma``, JAX's default),
  a leaf split over the mesh beside a replicated one: the kernel's outputs had no varying
  type ("manual_axis_type ... must not be None"), and one buffer of both leaves would have
  made the replicated one's results vary. It equals the unsharded plain step."""
  params = {"a": jnp.linspace(-1.0, 1.0, 64 * 256).reshape(64, 256), "b": jnp.ones((64, 256))}
  grads = jax.tree.map(lambda x: jnp.cos(3.0 * x), params)
  opt = OptaxWrapper(optax.adamw(1e-2), fused="interpret").create(params)
  got = split_a_step(opt, grads)
  plain = OptaxWrapper(optax.adamw(1e-2)).create(params).apply_gradient(grads)
  assert leaf_scale_ulps(got.target, plain.target) <= ULPS
  assert leaf_scale_ulps(got.state.param_states, plain.state.param_states) <= ULPS


@pytest.mark.slow
def test_the_gpu_kernel_lowers_under_shard_map_with_check_vma():
  """The Triton kernel under a user's `jax.shard_map` with ``check_vma`` (lowered only): a
  kernel for the split leaf and one for the replicated leaf, which vary apart. It failed:
  "manual_axis_type on jax.ShapeDtypeStruct must not be None"."""
  from t5x_optim._layouts.fused import kernel, sharding

  mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
  params = {"a": jnp.ones((64, 256)), "b": jnp.ones((64, 256))}
  tx = optax.adam(1e-3)
  state = tx.init(params)
  plan = fused_module.plan_fused_update(tx, params, params, state, kernel="pallas", platform="cuda")
  specs = (split_a(params), split_a(params), split_a(state))
  step = jax.shard_map(
    functools.partial(sharding.fused_apply, plan),
    mesh=mesh,
    in_specs=specs,
    out_specs=(specs[0], specs[2]),
  )
  abstract = jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype, sharding=NamedSharding(mesh, s)),
    (params, params, state),
    specs,
  )
  with kernel._lowering_target("cuda"):
    exported = jax.export.export(
      jax.jit(step),
      platforms=("cuda",),
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(kernel._TRITON_CALL)],
    )(*abstract)
  assert exported.mlir_module().count(kernel._TRITON_CALL) == 2


@pytest.mark.usefixtures("clean_gin")
@pytest.mark.parametrize(
  "config",
  [
    "OPTIMIZER = @optimizers.OptaxWrapper()\n"
    "optimizers.OptaxWrapper.optax_optimizer = @optax.lion()\n"
    "optimizers.OptaxWrapper.fused = 'interpret'\n",
    "OPTIMIZER = @optimizers.chain()\n"
    "optimizers.chain.transformations = [@optax.clip_by_global_norm(), @optax.lion()]\n"
    "optax.clip_by_global_norm.max_norm = 1.0\n"
    "optimizers.chain.fused = 'interpret'\n",
  ],
  ids=["OptaxWrapper", "chain"],
)
def test_gin_configures_fused(config):
  gin.parse_config(
    "from __gin__ import dynamic_registration\n"
    "import optax\n"
    "from t5x_optim import optimizers\n"
    "optax.lion.learning_rate = 1e-3\n" + config + "BUILT = %OPTIMIZER\n"
  )
  with gin.config_scope(None):
    opt_def = gin.query_parameter("%BUILT").scoped_configurable_fn()
  assert opt_def.fused is FusedUpdate.INTERPRET
  jaxpr = str(jax.make_jaxpr(lambda o: o.apply_gradient(o.target))(opt_def.create(make_params())))
  assert "pallas_call" in jaxpr


@pytest.mark.slow
def test_multi_optimizer_with_fused_sub_optimizers():
  params = make_params()
  grads = jax.tree.map(lambda x: jnp.sin(5.0 * x), params)

  def multi(fused):
    return MultiOptimizer(
      [
        (PathFilter(r"kernel$"), OptaxWrapper(optax.adamw(1e-2), fused=fused)),
        (PathFilter(r"bias$"), OptaxWrapper(optax.lion(1e-3), fused=fused)),
      ]
    ).create(params)

  plain, fused = multi("off"), multi("interpret")
  for _ in range(2):
    plain, fused = plain.apply_gradient(grads), fused.apply_gradient(grads)
  assert leaf_scale_ulps(fused.target, plain.target) <= ULPS
  assert leaf_scale_ulps(fused.state, plain.state) <= ULPS


@pytest.mark.parametrize(
  "params",
  [
    {"scalar": jnp.asarray(0.5), "empty": jnp.zeros((0, 3)), "w": jnp.ones((2, 3))},
    {"only_empty": jnp.zeros((0,))},
  ],
  ids=["scalar_and_empty_leaves", "empty_only"],
)
@pytest.mark.slow
def test_scalar_and_empty_leaves(params):
  tx = optax.adam(1e-2)
  assert fusion_report(tx, params).fusible
  grads = jax.tree.map(lambda x: jnp.full_like(x, 0.25), params)
  plain = OptaxWrapper(tx).create(params).apply_gradient(grads)
  fused = OptaxWrapper(tx, fused="interpret").create(params).apply_gradient(grads)
  assert leaf_scale_ulps(fused.target, plain.target) <= ULPS
  assert jax.tree.map(jnp.shape, fused.state) == jax.tree.map(jnp.shape, plain.state)


@pytest.mark.parametrize(
  "tx",
  [optax.adagrad(1e-2), optax.chain(optax.zero_nans(), optax.adam(1e-2))],
  ids=["adagrad", "zero_nans_adam"],
)
def test_a_select_on_a_scalar_leaf_runs_fused(tx):
  """A scalar leaf's update traces ``jnp.where`` without a broadcast: its cases are
  scalars, while the kernel runs the leaf as a block."""
  params = {"temperature": jnp.asarray(0.5), "w": jnp.ones((2, 3))}
  grads = {"temperature": jnp.asarray(0.25), "w": jnp.full((2, 3), 0.25)}
  assert fusion_report(tx, params).fusible
  step = jax.jit(lambda o: o.apply_gradient(grads))
  plain = step(OptaxWrapper(tx).create(params))
  fused = step(OptaxWrapper(tx, fused="interpret").create(params))
  assert leaf_scale_ulps(fused.target, plain.target) <= ULPS
  assert leaf_scale_ulps(fused.state, plain.state) <= ULPS


@pytest.mark.slow
def test_learning_rate_override_reaches_the_kernel():
  tx = optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2)
  params = make_params()
  grads = jax.tree.map(jnp.ones_like, params)
  step = jax.jit(lambda o, lr: o.apply_gradient(grads, learning_rate=lr))
  plain = step(OptaxWrapper(tx).create(params), 0.5)
  fused = step(OptaxWrapper(tx, fused="interpret").create(params), 0.5)
  assert leaf_scale_ulps(fused.target, plain.target) <= ULPS
  assert float(fused.state.param_states.hyperparams["learning_rate"]) == 0.5


def test_complex_leaves_take_the_plain_path():
  params = {"z": jnp.ones(3, jnp.complex64)}
  assert fusion_report(optax.sgd(0.1), params).reason == (
    "leaf z has dtype complex64; the kernel updates real floating leaves"
  )


@pytest.mark.slow
def test_gpu_kernel_lowers_for_cuda():
  """Every fusible table case's Pallas kernel lowers to Triton for CUDA (no GPU needed)."""
  lowered = []
  for case in TABLE:
    if not _report(case).fusible:
      continue
    tx, params = case.make(), initial_params(case)
    grads, extras = grads_and_extras(tx, params)
    plan = fused_module.plan_fused_update(
      tx, params, grads, tx.init(params), extras, kernel="pallas", platform="cuda"
    )
    assert isinstance(plan, fused_module.FusedPlan), (case.name, plan)
    lowered.append(case.name)
  assert MUST_FUSE <= set(lowered)


@pytest.mark.parametrize(("size", "kernels"), [(3 * 4096, 1), (2**31 + 4096, 0)])
def test_a_buffer_past_32_bit_offsets_runs_without_the_kernel(size, kernels):
  """Triton's block offsets are 32-bit: a longer buffer would wrap onto its start (lowered only)."""
  from t5x_optim._layouts.fused import kernel, sharding

  params = {"w": jax.ShapeDtypeStruct((size,), jnp.float32)}
  tx = optax.adam(1e-3)
  state = jax.eval_shape(tx.init, params)
  plan = fused_module.plan_fused_update(tx, params, params, state, kernel="pallas", platform="cuda")
  with kernel._lowering_target("cuda"):
    exported = jax.export.export(
      jax.jit(functools.partial(sharding.fused_apply, plan)),
      platforms=("cuda",),
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(kernel._TRITON_CALL)],
    )(params, params, state)
  assert exported.mlir_module().count(kernel._TRITON_CALL) == kernels


@pytest.mark.slow
def test_a_buffer_past_the_kernels_length_gets_the_same_update(monkeypatch):
  from t5x_optim._layouts.fused import kernel

  monkeypatch.setattr(kernel, "_KERNEL_ELEMENTS", 16)
  params = {"long": jnp.linspace(-1.0, 1.0, 37), "short": jnp.linspace(0.5, 2.0, 16)}
  grads = jax.tree.map(lambda x: jnp.cos(3.0 * x), params)
  tx = optax.adamw(1e-2)
  plain = OptaxWrapper(tx).create(params).apply_gradient(grads)
  fused = OptaxWrapper(tx, fused="interpret").create(params).apply_gradient(grads)
  assert leaf_scale_ulps(fused.target, plain.target) <= ULPS
  assert leaf_scale_ulps(fused.state.param_states, plain.state.param_states) <= ULPS


@pytest.mark.parametrize("fn", [jax.lax.erf, jax.lax.lgamma, jax.lax.round])
def test_pallas_refuses_what_its_gpu_lowering_lacks(fn):
  tx = optax.chain(optax.stateless(lambda u, p: jax.tree.map(fn, u)), optax.sgd(0.1))
  params = make_params()
  state = tx.init(params)
  with pytest.raises(fused_module.NotFusible) as refused:
    fused_module.plan_fused_update(tx, params, params, state, kernel="pallas", platform="cuda")
  reason = str(refused.value)
  assert reason.startswith("its Pallas kernel does not lower for cuda: ")
  assert fn.__name__ in reason
  assert isinstance(
    fused_module.plan_fused_update(tx, params, params, state), fused_module.FusedPlan
  )


@pytest.mark.slow
def test_vmap_takes_the_plain_path():
  """An ensemble under jax.vmap: per-member step counts are not scalars, so plain, exactly."""
  params = {"w": jnp.linspace(-1.0, 1.0, 60).reshape(3, 4, 5), "b": jnp.ones((3, 5))}
  grads = jax.tree.map(lambda x: jnp.cos(4.0 * x), params)

  def run(fused):
    opt = jax.vmap(OptaxWrapper(optax.adamw(1e-2), fused=fused).create)(params)
    return jax.jit(jax.vmap(lambda o, g: o.apply_gradient(g)))(opt, grads)

  assert tree_equal(run("interpret").target, run("off").target)
  assert tree_equal(run("interpret").state, run("off").state)


@pytest.mark.slow
@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jitted"])
def test_gradients_through_fused_steps_are_the_plain_paths(jitted):
  """`jax.grad` through fused steps (a meta-gradient, w.r.t. the initial params): the plain
  path's derivatives, the fused values. `custom_partitioning` has no derivative: it failed."""
  x = jnp.linspace(-1.0, 1.0, 48).reshape(4, 12)
  params = {"w": jnp.cos(jnp.arange(36.0)).reshape(12, 3) * 0.3, "b": jnp.zeros(3)}

  def loss(p):
    return jnp.mean(jnp.tanh(x @ p["w"] + p["b"]) ** 2)

  def meta(p, fused):
    opt = OptaxWrapper(optax.adamw(1e-2), fused=fused).create(p)
    for _ in range(2):
      opt = opt.apply_gradient(jax.grad(loss)(opt.target))
    return loss(opt.target), opt.target

  def run(fused):
    grad = jax.grad(meta, has_aux=True)
    return (jax.jit(grad, static_argnums=1) if jitted else grad)(params, fused)

  (got, target), (want, plain_target) = run("interpret"), run("off")
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8)
  assert leaf_scale_ulps(target, plain_target) <= ULPS


@pytest.mark.slow
@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jitted"])
def test_gradients_for_a_learning_rate_the_transformation_closes_over(jitted):
  """A learning rate given to ``optax.adamw`` and differentiated (its tracer in the update's
  closure, where a custom JVP may not reach: it escaped) takes the plain path."""
  x = jnp.linspace(-1.0, 1.0, 48).reshape(4, 12)
  params = {"w": jnp.cos(jnp.arange(36.0)).reshape(12, 3) * 0.3, "b": jnp.zeros(3)}

  def loss(p):
    return jnp.mean(jnp.tanh(x @ p["w"] + p["b"]) ** 2)

  def meta(lr, fused):
    opt = OptaxWrapper(optax.adamw(lr), fused=fused).create(params)
    for _ in range(2):
      opt = opt.apply_gradient(jax.grad(loss)(opt.target))
    return loss(opt.target)

  def run(fused):
    grad = jax.grad(meta)
    return float((jax.jit(grad, static_argnums=1) if jitted else grad)(1e-2, fused))

  np.testing.assert_allclose(run("interpret"), run("off"), rtol=1e-6)
