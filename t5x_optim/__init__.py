"""t5x_optim: every optax optimizer behind T5X's OptimizerDef interface.

Example:
  >>> import jax.numpy as jnp, optax, t5x_optim
  >>> opt = t5x_optim.OptaxWrapper(optax.adamw(1e-3)).create({'w': jnp.ones(2)})
  >>> opt = opt.apply_gradient({'w': jnp.ones(2)})

`KfacOptimizerDef` and `KfacHyperParams` (K-FAC through kfac-jax) load on first
use and need the ``kfac`` extra: ``pip install 't5x-optim[kfac]'``.
"""

import importlib
from typing import Any

from t5x_optim import checkpoints, distributed, optimizers, partitioning, t5x_checkpoints
from t5x_optim._discovery import optax_optimizer_factories
from t5x_optim._example_lib import (
  ExampleLibHyperParams,
  ExampleLibOptimizerDef,
  example_lib_optimizer_makers,
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
from t5x_optim._train_state import TrainState
from t5x_optim.checkpoints import Checkpointer, CheckpointError
from t5x_optim.t5x_checkpoints import (
  latest_t5x_step,
  restore_t5x_checkpoint,
  save_t5x_checkpoint,
  t5x_checkpoint_steps,
)

__all__ = [
  "CheckpointError",
  "Checkpointer",
  "ExampleLibHyperParams",
  "ExampleLibOptimizerDef",
  "MultiOptimizer",
  "OptaxHyperParams",
  "OptaxWrapper",
  "Optimizer",
  "OptimizerDef",
  "OptimizerState",
  "PathFilter",
  "TrainState",
  "chain",
  "checkpoints",
  "distributed",
  "example_lib_optimizer_makers",
  "inject_hyperparams",
  "latest_t5x_step",
  "optax_optimizer_factories",
  "optimizers",
  "partitioning",
  "restore_t5x_checkpoint",
  "save_t5x_checkpoint",
  "t5x_checkpoint_steps",
  "t5x_checkpoints",
  "wrap_example_lib_optimizer",
  "wrap_optax_optimizer",
]

_LAZY = {"KfacHyperParams": "t5x_optim._kfac", "KfacOptimizerDef": "t5x_optim._kfac"}


def __getattr__(name: str) -> Any:
  if name in _LAZY:
    return getattr(importlib.import_module(_LAZY[name]), name)
  raise AttributeError(f"module 't5x_optim' has no attribute {name!r}")
