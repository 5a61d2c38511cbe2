"""Drop-in namespace for `t5x.optimizers`.

A T5X gin file that says ``from t5x import optimizers`` works after changing
only that line to ``from t5x_optim import optimizers``. Besides the interface
classes it holds a wrapped factory (`wrap_optax_optimizer`) for every optax
and optax.contrib optimizer factory, found by introspection at import, under
optax's own name (``adamw``, ``adafactor``, ``lion``, ...), `chain`, which
takes a list, and the `jax.example_libraries.optimizers` triples as
``example_lib_<name>`` (``example_lib_adam``, ``example_lib_sm3``, ...).

Example:
  >>> import optax
  >>> from t5x_optim import optimizers
  >>> opt_def = optimizers.chain([optax.clip_by_global_norm(1.0), optax.adamw(1e-3)])
  >>> isinstance(optimizers.adamw(learning_rate=1e-3), optimizers.OptaxWrapper)
  True
"""

from t5x_optim._discovery import optax_optimizer_factories
from t5x_optim._example_lib import (
  EXAMPLE_LIB_OPTIMIZERS,
  ExampleLibOptimizerDef,
  wrap_example_lib_optimizer,
)
from t5x_optim._multi_optimizer import MultiOptimizer, PathFilter
from t5x_optim._optax_wrapper import (
  OptaxHyperParams,
  OptaxWrapper,
  chain,
  inject_hyperparams,
  wrap_optax_optimizer,
)
from t5x_optim._optimizer import Optimizer, OptimizerDef, OptimizerState
from t5x_optim.partitioning import OptaxStatePartitionRules

OptimizerType = Optimizer
OptimizerStateType = OptimizerState
OptimizerDefType = OptimizerDef

_WRAPPED = {
  name: wrap_optax_optimizer(factory) for name, factory in optax_optimizer_factories().items()
}
globals().update(_WRAPPED)
globals().update(EXAMPLE_LIB_OPTIMIZERS)

__all__ = [
  "ExampleLibOptimizerDef",
  "MultiOptimizer",
  "OptaxHyperParams",
  "OptaxStatePartitionRules",
  "OptaxWrapper",
  "Optimizer",
  "OptimizerDef",
  "OptimizerDefType",
  "OptimizerState",
  "OptimizerStateType",
  "OptimizerType",
  "PathFilter",
  "chain",
  "inject_hyperparams",
  "wrap_example_lib_optimizer",
  "wrap_optax_optimizer",
  *sorted(_WRAPPED),
  *sorted(EXAMPLE_LIB_OPTIMIZERS),
]
