"""`low_precision(..., param_modes=...)`: each param's state in its own mode, chosen by path."""

from __future__ import annotations

import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import test_gin_files
import test_sharded_training as st

from t5x_optim import OptaxWrapper, low_precision, low_precision_to_float32
from t5x_optim._low_precision.low_precision import leaf_storage
from t5x_optim._training import plan as plan_lib
from t5x_optim.partitioning import abstract_train_state

RULES = (("embed", "float32"), ("mlp", "4bit"), ("bias$", "bfloat16"))
SHAPES = {"embed": (64, 256), "mlp": {"wi": (64, 256)}, "attn": (64, 256), "bias": (256,)}
MODES = {"embed": "float32", "mlp": "4bit", "attn": "8bit", "bias": "bfloat16"}


def _params(seed=0):
  rng = np.random.default_rng(seed)
  return jax.tree.map(
    lambda s: jnp.asarray(rng.normal(size=s), jnp.float32),
    SHAPES,
    is_leaf=lambda x: isinstance(x, tuple),
  )


def _assert_close(got, want, name: str) -> None:
  """Within float32 rounding; bfloat16 within 2**-6 of the leaf's largest magnitude."""
  if MODES[name] == "bfloat16":
    np.testing.assert_allclose(got, want, rtol=0, atol=2.0**-6 * float(np.max(np.abs(want))))
  else:
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)


def test_each_params_state_takes_the_first_matching_rules_mode_and_says_why():
  state = low_precision(optax.adam(1e-3), "8bit", min_size=0, param_modes=RULES).init(_params())
  storage = {"/".join(k[3:]): v for k, v in leaf_storage(state).items() if k[2:3] == ("mu",)}
  assert storage == {
    "attn/codes": "8bit codes",
    "attn/scales": "8bit scales",
    "bias": "bfloat16 (param_modes 'bias$')",
    "embed": "float32: param_modes 'embed'",
    "mlp/wi/codes": "4bit codes (param_modes 'mlp')",
    "mlp/wi/scales": "4bit scales (param_modes 'mlp')",
    "mlp/wi/cols": "4bit cols (param_modes 'mlp')",
  }
  assert state.inner_state[0].mu["embed"].dtype == jnp.float32


@pytest.mark.slow
def test_a_mixed_step_is_each_modes_own_step():
  """Three jitted steps: each param's update and decoded state are those of adam wrapped in
  its own mode alone (adam's update is elementwise per param); bfloat16 to within its
  rounding, whose random bits hash the leaf's index in the state, another one alone."""
  params = _params()
  mixed = low_precision(optax.adam(1e-2), "8bit", min_size=0, param_modes=RULES)
  state = mixed.init(params)
  alone = {
    name: (
      low_precision(optax.adam(1e-2), mode, min_size=0) if mode != "float32" else optax.adam(1e-2)
    )
    for name, mode in MODES.items()
  }
  alone_states = {name: tx.init({name: params[name]}) for name, tx in alone.items()}
  for step in range(3):
    grads = _params(seed=step + 1)
    updates, state = jax.jit(mixed.update)(grads, state, params)
    for name, tx in alone.items():
      want, alone_states[name] = jax.jit(tx.update)(
        {name: grads[name]}, alone_states[name], {name: params[name]}
      )
      jax.tree.map(
        lambda a, b, name=name: _assert_close(a, b, name),
        updates[name],
        want[name],
      )
  decoded = low_precision_to_float32(state)[0]
  for name, tx in alone.items():
    own = alone_states[name]
    own = own[0] if MODES[name] == "float32" else low_precision_to_float32(own)[0]
    for field in ("mu", "nu"):
      jax.tree.map(
        lambda a, b, name=name: _assert_close(a, b, name),
        getattr(decoded, field)[name],
        getattr(own, field)[name],
      )


@pytest.mark.parametrize(
  "param_modes, match",
  [
    ((("embed", "int8"),), "param_modes maps 'embed' to 'int8'"),
    ((("(", "4bit"),), "missing \\)"),
  ],
)
def test_bad_param_modes_are_refused(param_modes, match):
  with pytest.raises(Exception, match=match):
    low_precision(optax.adam(1e-3), "8bit", param_modes=param_modes)


def test_plan_shows_each_params_mode_and_why():
  tx = low_precision(
    optax.adamw(1e-2),
    "4bit",
    block_size=4,
    shard_multiple=4,
    min_size=0,
    param_modes=(("wo", "float32"), ("bi", "8bit")),
  )
  partitioner = st._partitioner(2, 4, zero=True)
  state = abstract_train_state(partitioner, OptaxWrapper(tx), st.AxesMLP().init, *st._init_args())
  plan = plan_lib.build_plan(state, logical=state.as_logical_axes())
  by_param = {}
  for row in plan.rows:
    if row.param and row.group == "inner_state/0/nu":
      by_param.setdefault(row.param, set()).add(row.storage)
  assert by_param == {
    "wi": {"4bit codes", "4bit scales", "4bit cols"},
    "bi": {"8bit codes (param_modes 'bi')", "8bit scales (param_modes 'bi')"},
    "wo": {"float32: param_modes 'wo'"},
  }
  assert "float32: param_modes 'wo'" in plan_lib.format_table(plan)


def test_gin_binds_a_policy_onto_the_shipped_4bit_file(clean_gin):
  """adamw_4bit.gin with a param_modes binding: the rule reaches each param's state."""
  test_gin_files._parse_alone(test_gin_files.GIN_DIR / "optimizers" / "adamw_4bit.gin")
  gin.parse_config(
    "optimizers.low_precision.min_size = 0\n"
    "optimizers.low_precision.param_modes = [('embed', 'float32'), ('attn', '8bit')]"
  )
  opt_def = test_gin_files._build("OPTIMIZER")
  step = jax.jit(lambda optimizer, grads: optimizer.apply_gradient(grads))
  optimizer = step(opt_def.create(_params()), _params(seed=1))
  storage = leaf_storage(optimizer.state.param_states)
  nu = {"/".join(k[k.index("nu") + 1 :]): v for k, v in storage.items() if "nu" in k}
  assert nu["embed"] == "float32: param_modes 'embed'"
  assert nu["attn/codes"] == "8bit codes (param_modes 'attn')"
  assert nu["mlp/wi/codes"] == "4bit codes"
