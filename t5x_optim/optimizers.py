"""Drop-in namespace for `t5x.optimizers`.

A T5X gin file that says ``from t5x import optimizers`` works after changing
only that line to ``from t5x_optim import optimizers``. Besides the interface
classes it holds a wrapped factory (`wrap_optax_optimizer`) for every optax
and optax.contrib optimizer factory, found by introspection at import, under
optax's own name (``adamw``, ``adafactor``, ``lion``, ...), `chain`, which
takes a list, `low_precision` (a transformation storing another's state in
bfloat16, 8 or 4 bits), and the `jax.example_libraries.optimizers` triples as
``example_lib_<name>`` (``example_lib_adam``, ``example_lib_sm3``, ...).

Example:
  >>> import optax
  >>> from t5x_optim import optimizers
  >>> opt_def = optimizers.chain([optax.clip_by_global_norm(1.0), optax.adamw(1e-3)])
  >>> isinstance(optimizers.adamw(learning_rate=1e-3), optimizers.OptaxWrapper)
  True
"""

import optax

from t5x_optim._adapters.discovery import optax_optimizer_factories
from t5x_optim._adapters.example_lib import (
  EXAMPLE_LIB_OPTIMIZERS,
  ExampleLibOptimizerDef,
  wrap_example_lib_optimizer,
)
from t5x_optim._adapters.kernel_axes import KernelAxesOptaxWrapper, wrap_optax_optimizer
from t5x_optim._adapters.multi_optimizer import MultiOptimizer, PathFilter
from t5x_optim._adapters.optax_wrapper import (
  OptaxHyperParams,
  OptaxWrapper,
  chain,
  inject_hyperparams,
)
from t5x_optim._axes.engine import OptaxStatePartitionRules
from t5x_optim._axes.kernel_axes import KernelAxesRule, UnplaceableParamsError
from t5x_optim._core.interface import Optimizer, OptimizerDef, OptimizerState
from t5x_optim._layouts.fused import FusedUpdate, fusion_report
from t5x_optim._low_precision.low_precision import low_precision

OptimizerType = Optimizer
OptimizerStateType = OptimizerState
OptimizerDefType = OptimizerDef

# Every optimizer factory of optax / optax.contrib that discovery finds in the
# optax release the project is tested with, written out (as T5X writes its
# names) so that IDEs and type checkers see them; tests/test_import_surface.py
# keeps this list equal to what discovery finds.
acprop = wrap_optax_optimizer(optax.contrib.acprop)
adabelief = wrap_optax_optimizer(optax.adabelief)
adadelta = wrap_optax_optimizer(optax.adadelta)
adafactor = wrap_optax_optimizer(optax.adafactor)
adagrad = wrap_optax_optimizer(optax.adagrad)
adam = wrap_optax_optimizer(optax.adam)
adamax = wrap_optax_optimizer(optax.adamax)
adamaxw = wrap_optax_optimizer(optax.adamaxw)
adamw = wrap_optax_optimizer(optax.adamw)
adan = wrap_optax_optimizer(optax.adan)
ademamix = wrap_optax_optimizer(optax.contrib.ademamix)
adopt = wrap_optax_optimizer(optax.contrib.adopt)
amsgrad = wrap_optax_optimizer(optax.amsgrad)
cocob = wrap_optax_optimizer(optax.contrib.cocob)
dadapt_adamw = wrap_optax_optimizer(optax.contrib.dadapt_adamw)
dpsgd = wrap_optax_optimizer(optax.contrib.dpsgd)
fromage = wrap_optax_optimizer(optax.fromage)
galore = wrap_optax_optimizer(optax.contrib.galore)
lamb = wrap_optax_optimizer(optax.lamb)
lars = wrap_optax_optimizer(optax.lars)
lbfgs = wrap_optax_optimizer(optax.lbfgs)
lion = wrap_optax_optimizer(optax.lion)
madgrad = wrap_optax_optimizer(optax.contrib.madgrad)
momo = wrap_optax_optimizer(optax.contrib.momo)
momo_adam = wrap_optax_optimizer(optax.contrib.momo_adam)
muon = wrap_optax_optimizer(optax.contrib.muon)
nadam = wrap_optax_optimizer(optax.nadam)
nadamw = wrap_optax_optimizer(optax.nadamw)
noisy_sgd = wrap_optax_optimizer(optax.noisy_sgd)
novograd = wrap_optax_optimizer(optax.novograd)
polyak_sgd = wrap_optax_optimizer(optax.polyak_sgd)
prodigy = wrap_optax_optimizer(optax.contrib.prodigy)
radam = wrap_optax_optimizer(optax.radam)
rmsprop = wrap_optax_optimizer(optax.rmsprop)
rprop = wrap_optax_optimizer(optax.rprop)
scale_by_backtracking_linesearch = wrap_optax_optimizer(optax.scale_by_backtracking_linesearch)
scale_by_madgrad = wrap_optax_optimizer(optax.contrib.scale_by_madgrad)
scale_by_polyak = wrap_optax_optimizer(optax.scale_by_polyak)
scale_by_rprop = wrap_optax_optimizer(optax.scale_by_rprop)
scale_by_zoom_linesearch = wrap_optax_optimizer(optax.scale_by_zoom_linesearch)
schedule_free = wrap_optax_optimizer(optax.contrib.schedule_free)
schedule_free_adamw = wrap_optax_optimizer(optax.contrib.schedule_free_adamw)
schedule_free_sgd = wrap_optax_optimizer(optax.contrib.schedule_free_sgd)
sgd = wrap_optax_optimizer(optax.sgd)
sign_sgd = wrap_optax_optimizer(optax.sign_sgd)
signum = wrap_optax_optimizer(optax.signum)
simplified_ademamix = wrap_optax_optimizer(optax.contrib.simplified_ademamix)
sm3 = wrap_optax_optimizer(optax.sm3)
sophia = wrap_optax_optimizer(optax.contrib.sophia)
yogi = wrap_optax_optimizer(optax.yogi)

# The jax.example_libraries.optimizers triples, as `example_lib_<name>`.
example_lib_adagrad = EXAMPLE_LIB_OPTIMIZERS["example_lib_adagrad"]
example_lib_adam = EXAMPLE_LIB_OPTIMIZERS["example_lib_adam"]
example_lib_adamax = EXAMPLE_LIB_OPTIMIZERS["example_lib_adamax"]
example_lib_momentum = EXAMPLE_LIB_OPTIMIZERS["example_lib_momentum"]
example_lib_nesterov = EXAMPLE_LIB_OPTIMIZERS["example_lib_nesterov"]
example_lib_rmsprop = EXAMPLE_LIB_OPTIMIZERS["example_lib_rmsprop"]
example_lib_rmsprop_momentum = EXAMPLE_LIB_OPTIMIZERS["example_lib_rmsprop_momentum"]
example_lib_sgd = EXAMPLE_LIB_OPTIMIZERS["example_lib_sgd"]
example_lib_sm3 = EXAMPLE_LIB_OPTIMIZERS["example_lib_sm3"]

# Factories (and triples) a newer optax (or jax) adds are wrapped at import as
# well, so a new release needs no code change to be usable; static tools see
# them once the lists above are regenerated.
_FACTORIES = optax_optimizer_factories()
for _name, _factory in _FACTORIES.items():
  globals().setdefault(_name, wrap_optax_optimizer(_factory))
for _name, _maker in EXAMPLE_LIB_OPTIMIZERS.items():
  globals().setdefault(_name, _maker)

__all__ = [
  "ExampleLibOptimizerDef",
  "FusedUpdate",
  "KernelAxesOptaxWrapper",
  "KernelAxesRule",
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
  "UnplaceableParamsError",
  "chain",
  "fusion_report",
  "inject_hyperparams",
  "low_precision",
  "wrap_example_lib_optimizer",
  "wrap_optax_optimizer",
  *sorted(_FACTORIES),
  *sorted(EXAMPLE_LIB_OPTIMIZERS),
]
