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

from t5x_optim import checkpoints, distributed, optimizers, partitioning, storage, t5x_checkpoints
from t5x_optim._adapters.discovery import optax_optimizer_factories
from t5x_optim._adapters.example_lib import (
  ExampleLibHyperParams,
  ExampleLibOptimizerDef,
  example_lib_optimizer_makers,
  wrap_example_lib_optimizer,
)
from t5x_optim._adapters.kernel_axes import KernelAxesOptaxWrapper, wrap_optax_optimizer
from t5x_optim._adapters.multi_optimizer import MultiOptimizer, PathFilter, with_param_axes
from t5x_optim._adapters.optax_wrapper import (
  OptaxHyperParams,
  OptaxWrapper,
  chain,
  inject_hyperparams,
  loss_extra_args,
  trains_lookahead_params,
)
from t5x_optim._axes.kernel_axes import KernelAxesRule, UnplaceableParamsError
from t5x_optim._checkpoint.converting import restore_converted
from t5x_optim._convert.convert import (
  BUILTIN_HPARAMS,
  HPARAM_ALIASES,
  ConversionContext,
  ConversionReport,
  Moments,
  SeveralValues,
  StateConverter,
  T5XAdafactorParamState,
  convert_state,
  register_state_converter,
  registered_converters,
  schedule_free_evaluation_params,
)
from t5x_optim._core.configured import configured_leaves, reapply_config
from t5x_optim._core.interface import Optimizer, OptimizerDef, OptimizerState, trained_params
from t5x_optim._layouts.fused import FusedUpdate, FusionReport, fusion_report
from t5x_optim._layouts.stacked import StackedLayout, StackedParams, stack_params
from t5x_optim._low_precision.low_precision import (
  LowPrecisionState,
  Quantized4Leaf,
  QuantizedLeaf,
  Rank1Quantized4Leaf,
  float32_to_low_precision,
  leaf_storage,
  low_precision,
  low_precision_sum_squares,
  low_precision_to_float32,
)
from t5x_optim._training.train_state import TrainState
from t5x_optim.checkpoints import Checkpointer, CheckpointError
from t5x_optim.t5x_checkpoints import (
  latest_t5x_step,
  restore_t5x_checkpoint,
  save_t5x_checkpoint,
  t5x_checkpoint_steps,
)

__all__ = [
  "BUILTIN_HPARAMS",
  "HPARAM_ALIASES",
  "CheckpointError",
  "Checkpointer",
  "ConversionContext",
  "ConversionReport",
  "ExampleLibHyperParams",
  "ExampleLibOptimizerDef",
  "FusedUpdate",
  "FusionReport",
  "KernelAxesOptaxWrapper",
  "KernelAxesRule",
  "LowPrecisionState",
  "Moments",
  "MultiOptimizer",
  "OptaxHyperParams",
  "OptaxWrapper",
  "Optimizer",
  "OptimizerDef",
  "OptimizerState",
  "PathFilter",
  "Quantized4Leaf",
  "QuantizedLeaf",
  "Rank1Quantized4Leaf",
  "SeveralValues",
  "StackedLayout",
  "StackedParams",
  "StateConverter",
  "T5XAdafactorParamState",
  "TrainState",
  "UnplaceableParamsError",
  "chain",
  "checkpoints",
  "configured_leaves",
  "convert_state",
  "distributed",
  "example_lib_optimizer_makers",
  "float32_to_low_precision",
  "fusion_report",
  "inject_hyperparams",
  "latest_t5x_step",
  "leaf_storage",
  "loss_extra_args",
  "low_precision",
  "low_precision_sum_squares",
  "low_precision_to_float32",
  "optax_optimizer_factories",
  "optimizers",
  "partitioning",
  "reapply_config",
  "register_state_converter",
  "registered_converters",
  "restore_converted",
  "restore_t5x_checkpoint",
  "save_t5x_checkpoint",
  "schedule_free_evaluation_params",
  "stack_params",
  "storage",
  "t5x_checkpoint_steps",
  "t5x_checkpoints",
  "trained_params",
  "trains_lookahead_params",
  "with_param_axes",
  "wrap_example_lib_optimizer",
  "wrap_optax_optimizer",
]

_KFAC = "t5x_optim._adapters.kfac"
_LAZY = {"KfacHyperParams": _KFAC, "KfacOptimizerDef": _KFAC}


def __getattr__(name: str) -> Any:
  if name in _LAZY:
    try:
      module = importlib.import_module(_LAZY[name])
    except ImportError as e:
      if e.name != "kfac_jax":
        raise
      raise ImportError(
        f"t5x_optim.{name} needs kfac-jax, which is not installed: pip install 't5x-optim[kfac]'."
      ) from e
    return getattr(module, name)
  raise AttributeError(f"module 't5x_optim' has no attribute {name!r}")
