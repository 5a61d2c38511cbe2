"""The package's layers import only downwards (docs/design.md, "Layers").

0. key paths (``t5x_optim/_keypaths.py``), which every layer may import;
1. axes (``t5x_optim/_axes``): logical-axis rules and optimizer-state specs;
2. optimizers (``t5x_optim/_optimizers``, ``t5x_optim.optimizers``);
3. training (``t5x_optim/_training`` and its public faces ``partitioning``,
   ``checkpoints``, ``t5x_checkpoints``, ``distributed``);
4. cli (``t5x_optim/cli``, ``t5x_optim.__main__``);
5. the package itself (``t5x_optim/__init__.py``), which re-exports all.

Every import of a t5x_optim module is checked, those inside functions too.
Inside the optimizers layer, the fused update is layered too (program <
analysis < kernel < sharding), and only the fused subpackage's kernel module
imports Pallas.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import optax
import pytest

import t5x_optim
from t5x_optim._optimizers.fused import FusedUpdate
from t5x_optim._optimizers.layouts import UpdateLayout
from t5x_optim._optimizers.stacked import StackedOptimizerDef, stack_params

PACKAGE_DIR = pathlib.Path(t5x_optim.__file__).parent

LAYERS = {
  "t5x_optim._keypaths": 0,
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


def test_axes_layer_imports_no_other_t5x_optim_module_but_key_paths():
  for path in (PACKAGE_DIR / "_axes").rglob("*.py"):
    name = module_name(path)
    others = [m for _, m in imported_modules(path.read_text(), name) if layer_of(m) not in (0, 1)]
    assert others == [], name


def test_key_paths_import_no_t5x_optim_module():
  source = (PACKAGE_DIR / "_keypaths.py").read_text()
  assert imported_modules(source, "t5x_optim._keypaths") == []


FUSED = "t5x_optim._optimizers.fused"
FUSED_ORDER = [
  f"{FUSED}.program",
  f"{FUSED}.analysis",
  FUSED,
  f"{FUSED}.kernel",
  f"{FUSED}.sharding",
]


@pytest.mark.parametrize("module", FUSED_ORDER)
def test_fused_modules_import_only_those_before_them(module):
  path = PACKAGE_DIR.parent.joinpath(*module.split("."))
  path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
  rank = FUSED_ORDER.index(module)
  later = [
    f"line {line}: {target}"
    for line, target in imported_modules(path.read_text(), module)
    if target in FUSED_ORDER[rank + 1 :] and not _inside_function(path.read_text(), line)
  ]
  assert later == []


def _inside_function(source: str, line: int) -> bool:
  """Whether `line` of `source` is inside a function body (a deferred import)."""
  return any(
    isinstance(node, ast.FunctionDef) and node.lineno < line <= node.end_lineno
    for node in ast.walk(ast.parse(source))
  )


def test_stacked_params_need_only_the_elementwise_analysis():
  source = (PACKAGE_DIR / "_optimizers" / "stacked.py").read_text()
  fused = {m for _, m in imported_modules(source, "t5x_optim._optimizers.stacked") if "fused" in m}
  assert fused <= {FUSED, f"{FUSED}.analysis", f"{FUSED}.program"}


def _methods_naming(cls: ast.ClassDef, names: set[str]) -> set[str]:
  """The methods of `cls` whose body or signature mentions one of `names`."""
  return {
    method.name
    for method in cls.body
    if isinstance(method, ast.FunctionDef)
    for node in ast.walk(method)
    if getattr(node, "id", None) in names or getattr(node, "attr", None) in names
  }


def test_optax_wrapper_names_stacked_and_fused_types_only_in_its_layout_hook():
  """The wrapper reaches the fused and stacked layouts only through `UpdateLayout`."""
  path = PACKAGE_DIR / "_optimizers" / "optax_wrapper.py"
  source = path.read_text()
  imported = {m for _, m in imported_modules(source, "t5x_optim._optimizers.optax_wrapper")}
  assert not {m for m in imported if m.startswith((FUSED, "t5x_optim._optimizers.stacked"))}
  assert "t5x_optim._optimizers.layouts" in imported
  tree = ast.parse(source)
  stacked = {"_stacked", "StackedParams", "StackedOptimizerDef", "StackedLayout"}
  fused = {"FusedUpdate", "FusedPlan", "NotFusible", "plan_fused_update", "fused_apply"}
  named = {getattr(node, "id", None) for node in ast.walk(tree)}
  named |= {getattr(node, "attr", None) for node in ast.walk(tree)}
  assert not named & (stacked | fused)
  wrapper = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "OptaxWrapper")
  assert _methods_naming(wrapper, {"UpdateLayout"}) == {"__init__"}


def test_layout_hook_routes_stacked_targets_and_fused_modes():
  opt_def = t5x_optim.OptaxWrapper(optax.adam(0.1), fused="interpret")
  assert isinstance(opt_def.layout, UpdateLayout)
  assert opt_def.fused is FusedUpdate.INTERPRET
  stacked = opt_def.create(stack_params({"a": jnp.ones(2), "b": jnp.ones(2)}))
  assert isinstance(stacked.optimizer_def, StackedOptimizerDef)
  assert stacked.optimizer_def.inner.fused is FusedUpdate.OFF
  assert opt_def.fused is FusedUpdate.INTERPRET
  plain = opt_def.create({"a": jnp.ones(2)})
  assert plain.optimizer_def is opt_def


@pytest.mark.slow
def test_import_loads_no_pallas():
  """Pallas (and its Triton backend) load only when a fused update is asked for."""
  code = (
    "import sys, t5x_optim\n"
    "print(sorted(m for m in sys.modules if m.startswith('jax.experimental.pallas')"
    " or m.startswith(f'{t5x_optim.__name__}._optimizers.fused.')))"
  )
  out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
  assert out.stdout.split() == [
    "['t5x_optim._optimizers.fused.analysis',",
    "'t5x_optim._optimizers.fused.program']",
  ]
