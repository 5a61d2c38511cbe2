"""The package's layers import only downwards (DESIGN.md section 2).

1. axes (``t5x_optim/_axes``): logical-axis rules and optimizer-state specs;
2. optimizers (``t5x_optim/_optimizers``, ``t5x_optim.optimizers``);
3. training (``t5x_optim/_training`` and its public faces ``partitioning``,
   ``checkpoints``, ``t5x_checkpoints``, ``distributed``);
4. cli (``t5x_optim/cli``, ``t5x_optim.__main__``);
5. the package itself (``t5x_optim/__init__.py``), which re-exports all.

Every import of a t5x_optim module is checked, those inside functions too.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import t5x_optim

PACKAGE_DIR = pathlib.Path(t5x_optim.__file__).parent

LAYERS = {
  "t5x_optim._axes": 1,
  "t5x_optim._optimizers": 2,
  "t5x_optim.optimizers": 2,
  "t5x_optim._training": 3,
  "t5x_optim.partitioning": 3,
  "t5x_optim.checkpoints": 3,
  "t5x_optim.t5x_checkpoints": 3,
  "t5x_optim.distributed": 3,
  "t5x_optim.cli": 4,
  "t5x_optim.__main__": 4,
  "t5x_optim": 5,
}


def layer_of(module: str) -> int:
  """The layer of a module: that of its longest prefix in `LAYERS`."""
  parts = module.split(".")
  for end in range(len(parts), 0, -1):
    if (prefix := ".".join(parts[:end])) in LAYERS:
      return LAYERS[prefix]
  raise KeyError(module)


def module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, importer: str) -> list[tuple[int, str]]:
  """(line, module) for every t5x_optim module that `source` imports.

  ``from t5x_optim.x import y`` imports ``t5x_optim.x.y`` when that is a
  module and ``t5x_optim.x`` otherwise; relative imports are resolved.
  """
  out = []
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      out += [(node.lineno, alias.name) for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        anchor = importer.split(".")[: -node.level]
        base = ".".join([*anchor, base] if base else anchor)
      for alias in node.names:
        full = f"{base}.{alias.name}"
        out.append((node.lineno, full if _is_module(full) else base))
  return [(line, m) for line, m in out if m == "t5x_optim" or m.startswith("t5x_optim.")]


def _is_module(name: str) -> bool:
  path = PACKAGE_DIR.parent.joinpath(*name.split("."))
  return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def upward_imports(source: str, importer: str) -> list[str]:
  """Descriptions of the imports in `source` that reach a higher layer."""
  own = layer_of(importer)
  return [
    f"{importer}:{line} imports {target} (layer {layer_of(target)} > {own})"
    for line, target in imported_modules(source, importer)
    if layer_of(target) > own
  ]


MODULES = sorted(PACKAGE_DIR.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=[module_name(p) for p in MODULES])
def test_module_imports_only_its_own_layer_and_below(path):
  assert upward_imports(path.read_text(), module_name(path)) == []


def test_axes_layer_imports_no_other_t5x_optim_module():
  for path in (PACKAGE_DIR / "_axes").rglob("*.py"):
    name = module_name(path)
    others = [m for _, m in imported_modules(path.read_text(), name) if layer_of(m) != 1]
    assert others == [], name


def test_every_module_has_a_layer():
  names = [module_name(p) for p in MODULES]
  assert len(names) > 30
  for name in names:
    layer_of(name)


@pytest.mark.parametrize(
  ("importer", "source", "found"),
  [
    ("t5x_optim._axes.engine", "from t5x_optim._optimizers import interface", 1),
    ("t5x_optim._axes.engine", "def f():\n  from t5x_optim import partitioning", 1),
    ("t5x_optim._optimizers.kfac", "from ..checkpoints import Checkpointer", 1),
    ("t5x_optim._optimizers.kfac", "import t5x_optim.cli", 1),
    ("t5x_optim._training.init", "from t5x_optim import TrainState", 1),
    ("t5x_optim._training.init", "from t5x_optim.optimizers import adamw", 0),
    ("t5x_optim.cli._train", "from t5x_optim import checkpoints, partitioning", 0),
  ],
)
def test_the_check_sees_upward_imports(importer, source, found):
  assert len(upward_imports(source, importer)) == found
