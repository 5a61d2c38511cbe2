"""`t5x_optim.optimizers` with every `OptaxWrapper` fused, for T5X's own tests (run by hand).

T5X's own test files, run by a runner of T5X's test files (kept outside
this project) with this module as
`t5x.optimizers`, then exercise the fused update through T5X's train state,
partitioner and training loops. Every `OptaxWrapper` built here, directly or
by a wrapped optax factory (``optimizers.adamw(...)``), defaults to
``fused="interpret"``: the Pallas kernel in interpret mode, which runs on CPU.

Usage, from the project checkout:
  T5X_SRC=<t5x git dir> PYTHONPATH=tests/data/t5x_fused \\
    /tmp/t5xv/bin/python <T5X test runner> fused_optimizers \\
    --anchor-json /tmp/t5x-ref.json --files optimizers_test,train_state_test,partitioning_test
"""

import functools
from typing import Any

from t5x_optim import optimizers as _optimizers
from t5x_optim.optimizers import *  # noqa: F403
from t5x_optim.optimizers import Optimizer, OptimizerDef, OptimizerState  # noqa: F401

FUSED = "interpret"


class OptaxWrapper(_optimizers.OptaxWrapper):
  """`t5x_optim.OptaxWrapper` with ``fused="interpret"`` by default."""

  def __init__(self, optax_optimizer: Any, **kwargs: Any):
    kwargs.setdefault("fused", FUSED)
    super().__init__(optax_optimizer, **kwargs)


def wrap_optax_optimizer(optax_optimizer):
  """`t5x_optim.optimizers.wrap_optax_optimizer`, building the fused wrapper."""

  @functools.wraps(optax_optimizer)
  def wrapped_optimizer(*args, **kwargs):
    return OptaxWrapper(optax_optimizer(*args, **kwargs))

  return wrapped_optimizer


def chain(transformations):
  """`t5x_optim.optimizers.chain`, building the fused wrapper."""
  return OptaxWrapper(_optimizers.chain(transformations).optax_optimizer)


for _name in _optimizers.__all__:
  _factory = getattr(getattr(_optimizers, _name), "__wrapped__", None)
  if _factory is not None and _name not in ("chain", "wrap_optax_optimizer"):
    globals()[_name] = wrap_optax_optimizer(_factory)
