"""The public API: every name in `__all__` exists, nothing private leaks."""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
import subprocess
import sys
import types

import pytest
from _optional import import_kfac_jax
from optimizer_table import T5X_OPTIMIZER_NAMES

import t5x_optim
from t5x_optim import checkpoints, optimizers, partitioning
from t5x_optim._adapters.example_lib import EXAMPLE_LIB_OPTIMIZERS


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
  interface = {
    "OptimizerState",
    "OptimizerDef",
    "Optimizer",
    "OptaxWrapper",
    "wrap_optax_optimizer",
    "chain",
  }
  assert interface | T5X_OPTIMIZER_NAMES <= set(optimizers.__all__)


def test_root_reexports_interface():
  for name in (
    "Optimizer",
    "OptimizerDef",
    "OptimizerState",
    "OptaxWrapper",
    "chain",
    "low_precision",
    "wrap_optax_optimizer",
  ):
    assert getattr(t5x_optim, name) is getattr(optimizers, name)


@pytest.mark.slow
def test_kfac_names_load_lazily():
  import_kfac_jax()
  script = (
    "import sys, t5x_optim\n"
    "assert 't5x_optim._adapters.kfac' not in sys.modules and 'kfac_jax' not in sys.modules\n"
    "from t5x_optim._adapters import kfac\n"
    "assert t5x_optim.KfacOptimizerDef is kfac.KfacOptimizerDef\n"
    "assert t5x_optim.KfacHyperParams is kfac.KfacHyperParams\n"
  )
  subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
  with pytest.raises(AttributeError, match="no attribute 'nope'"):
    getattr(t5x_optim, "nope")


@pytest.mark.slow
def test_importing_the_package_warns_of_nothing_it_does():
  """`optimizers.dpsgd` wrapped optax's deprecated alias: every import warned."""
  script = (
    "import warnings\n"
    "with warnings.catch_warnings(record=True) as caught:\n"
    "  warnings.simplefilter('always')\n"
    "  import t5x_optim, t5x_optim.optimizers, t5x_optim.cli\n"
    "print([f'{w.filename}: {w.message}' for w in caught if '/t5x_optim/' in w.filename])\n"
  )
  run = subprocess.run(
    [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120
  )
  assert run.stdout.strip() == "[]", run.stdout


def _explicit_names(call: str) -> set[str]:
  """Names `optimizers.py` assigns from `call` (written out, as static tools read them)."""
  tree = ast.parse(inspect.getsource(optimizers))
  return {
    target.id
    for node in tree.body
    if isinstance(node, ast.Assign) and call in ast.unparse(node.value)
    for target in node.targets
    if isinstance(target, ast.Name)
  }


def test_optimizers_namespace_is_written_out_as_discovery_finds_it():
  factories = t5x_optim.optax_optimizer_factories()
  assert _explicit_names("wrap_optax_optimizer(") == set(factories)
  assert _explicit_names("EXAMPLE_LIB_OPTIMIZERS[") == set(EXAMPLE_LIB_OPTIMIZERS)
  for name, factory in factories.items():
    assert getattr(optimizers, name).optax_factory is factory, name
  for name, maker in EXAMPLE_LIB_OPTIMIZERS.items():
    assert getattr(optimizers, name) is maker, name


def test_the_root_re_exports_every_public_module_the_api_reference_documents():
  """`t5x_optim.storage` had its API page but was neither an attribute nor in `__all__`."""
  pages = pathlib.Path(__file__).parent.parent / "docs" / "api"
  documented = {page.stem for page in pages.glob("*.md")} - {"t5x_optim"}
  assert documented, pages
  for name in sorted(documented):
    assert name in t5x_optim.__all__, name
    assert getattr(t5x_optim, name) is importlib.import_module(f"t5x_optim.{name}"), name


@pytest.mark.parametrize("name", ["KfacOptimizerDef", "KfacHyperParams"])
def test_the_kfac_adapter_without_kfac_jax_names_the_extra(name, monkeypatch):
  """Without the `kfac` extra the lazy import gave a bare `No module named 'kfac_jax'`."""
  for module in [m for m in sys.modules if m.startswith(("kfac_jax", "t5x_optim._adapters.kfac"))]:
    monkeypatch.delitem(sys.modules, module)
  monkeypatch.setitem(sys.modules, "kfac_jax", None)  # what an import finds when it is absent
  with pytest.raises(ImportError, match=r"kfac-jax.*pip install 't5x-optim\[kfac\]'"):
    getattr(t5x_optim, name)
