"""t5x_optim: every optax optimizer behind T5X's OptimizerDef interface.

Example:
  >>> import jax.numpy as jnp, optax, t5x_optim
  >>> opt = t5x_optim.OptaxWrapper(optax.adamw(1e-3)).create({'w': jnp.ones(2)})
  >>> opt = opt.apply_gradient({'w': jnp.ones(2)})
"""

from t5x_optim import optimizers
from t5x_optim._discovery import optax_optimizer_factories
from t5x_optim._optax_wrapper import OptaxHyperParams, OptaxWrapper, chain, wrap_optax_optimizer
from t5x_optim._optimizer import Optimizer, OptimizerDef, OptimizerState

__all__ = [
    "OptaxHyperParams",
    "OptaxWrapper",
    "Optimizer",
    "OptimizerDef",
    "OptimizerState",
    "chain",
    "optax_optimizer_factories",
    "optimizers",
    "wrap_optax_optimizer",
]
