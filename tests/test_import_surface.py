"""The public API: every name in `__all__` exists, nothing private leaks."""

from __future__ import annotations

import types

import pytest

import t5x_optim
from t5x_optim import checkpoints, optimizers, partitioning


@pytest.mark.parametrize(
  "module", [t5x_optim, optimizers, partitioning, checkpoints], ids=lambda m: m.__name__
)
def test_all_names_exist_and_are_public(module: types.ModuleType):
  assert module.__all__, module.__name__
  assert len(set(module.__all__)) == len(module.__all__)
  for name in module.__all__:
    assert not name.startswith("_"), name
    assert hasattr(module, name), name


def test_t5x_namespace_names():
  t5x_names = {
    "OptimizerState",
    "OptimizerDef",
    "Optimizer",
    "OptaxWrapper",
    "wrap_optax_optimizer",
    "chain",
    "adabelief",
    "adagrad",
    "adam",
    "adamw",
    "fromage",
    "lars",
    "lamb",
    "lion",
    "noisy_sgd",
    "radam",
    "rmsprop",
    "sgd",
    "yogi",
    "dpsgd",
  }
  assert t5x_names <= set(optimizers.__all__)


def test_root_reexports_interface():
  for name in (
    "Optimizer",
    "OptimizerDef",
    "OptimizerState",
    "OptaxWrapper",
    "chain",
    "wrap_optax_optimizer",
  ):
    assert getattr(t5x_optim, name) is getattr(optimizers, name)


def test_kfac_names_load_lazily():
  pytest.importorskip("kfac_jax")
  from t5x_optim import _kfac

  assert t5x_optim.KfacOptimizerDef is _kfac.KfacOptimizerDef
  assert t5x_optim.KfacHyperParams is _kfac.KfacHyperParams
  with pytest.raises(AttributeError, match="no attribute 'nope'"):
    getattr(t5x_optim, "nope")
