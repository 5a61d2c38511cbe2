"""T5X-style gin configuration of optimizers."""

from __future__ import annotations

import gin
import jax
import jax.numpy as jnp
import optax
import pytest

from t5x_optim import OptaxWrapper

pytestmark = pytest.mark.usefixtures("clean_gin")

T5X_SNIPPET = """
from __gin__ import dynamic_registration
import optax
from t5x_optim import optimizers
OPTIMIZER = @optimizers.chain()
optimizers.chain:
  transformations = [@optax.clip_by_global_norm(), @optax.adamw()]
optax.clip_by_global_norm.max_norm = 1.0
optax.adamw:
  learning_rate = @optax.warmup_cosine_decay_schedule()
optax.warmup_cosine_decay_schedule:
  init_value = 0.0
  peak_value = 1e-2
  warmup_steps = 2
  decay_steps = 10
"""


def _build_optimizer(snippet: str) -> OptaxWrapper:
  gin.parse_config(snippet + "\nBUILT = %OPTIMIZER\n")
  with gin.config_scope(None):
    return gin.query_parameter("%BUILT").scoped_configurable_fn()


@pytest.mark.slow
def test_t5x_snippet_builds_a_working_optimizer():
  opt_def = _build_optimizer(T5X_SNIPPET)
  assert isinstance(opt_def, OptaxWrapper)
  params = {"w": jnp.ones(3)}
  opt = opt_def.create(params)
  reference = optax.chain(
    optax.clip_by_global_norm(1.0),
    optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10)),
  )
  state = reference.init(params)
  grads = {"w": jnp.asarray([0.5, -1.0, 2.0])}
  for _ in range(3):
    opt = opt.apply_gradient(grads)
    updates, state = reference.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  assert jnp.array_equal(opt.target["w"], params["w"])


def test_wrapped_factory_is_configurable_like_optax():
  opt_def = _build_optimizer(
    "from __gin__ import dynamic_registration\n"
    "from t5x_optim import optimizers\n"
    "OPTIMIZER = @optimizers.adafactor()\n"
    "optimizers.adafactor.learning_rate = 0.01\n"
    "optimizers.adafactor.momentum = 0.9\n"
  )
  state = opt_def.create({"w": jnp.ones((4, 4))}).state.param_states
  reference = optax.adafactor(learning_rate=0.01, momentum=0.9).init({"w": jnp.ones((4, 4))})
  assert jax.tree.structure(state) == jax.tree.structure(reference)
  assert isinstance(state[4], optax.EmaState)
