"""The package's rooms import only rooms below them (docs/design.md, "Rooms").

From the bottom:

0. key paths, warnings and flax NNX state trees (``t5x_optim/_keypaths.py``,
   ``t5x_optim/_warn.py``, ``t5x_optim/_nnx.py``, which names paths with the first),
   which every room may import;
1. axes (``_axes``): logical-axis rules and optimizer-state specs;
2. core (``_core``): T5X's optimizer interface and state dicts;
3. layouts (``_layouts``): the fused and the stacked update;
4. adapters (``_adapters``): optax, MultiOptimizer, example_libraries, kfac;
5. low precision (``_low_precision``);
6. conversion (``_convert``);
7. training (``_training``): train state, mesh, partitioner, init, plan;
8. checkpoints (``_checkpoint``);
9. the public faces (``optimizers``, ``partitioning``, ``checkpoints``,
   ``t5x_checkpoints``, ``distributed``, ``storage``);
10. the package itself (``t5x_optim/__init__.py``), which re-exports them;
11. the command line (``cli``, ``__main__``), which imports only public modules.

Every import of a t5x_optim module is checked, those inside functions too,
and no modules import each other in a circle. Inside the layouts room the
fused update is layered too (program < kernel < analysis < sharding <
package), and only its kernel module imports Pallas.
"""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import optax
import pytest

import t5x_optim
from t5x_optim._layouts.fused import FusedUpdate
from t5x_optim._layouts.stacked import StackedOptimizerDef, stack_params

PACKAGE_DIR = pathlib.Path(t5x_optim.__file__).parent

LAYERS = {
  "t5x_optim._keypaths": 0,
  "t5x_optim._warn": 0,
  "t5x_optim._nnx": 0,
  "t5x_optim._axes": 1,
  "t5x_optim._core": 2,
  "t5x_optim._layouts": 3,
  "t5x_optim._adapters": 4,
  "t5x_optim._low_precision": 5,
  "t5x_optim._convert": 6,
  "t5x_optim._training": 7,
  "t5x_optim._checkpoint": 8,
  "t5x_optim.optimizers": 9,
  "t5x_optim.partitioning": 9,
  "t5x_optim.checkpoints": 9,
  "t5x_optim.t5x_checkpoints": 9,
  "t5x_optim.distributed": 9,
  "t5x_optim.storage": 9,
  "t5x_optim": 10,
  "t5x_optim.cli": 11,
  "t5x_optim.__main__": 11,
}
PUBLIC = {name for name, layer in LAYERS.items() if layer >= 9}


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


def test_axes_layer_imports_no_other_t5x_optim_module_but_room_0():
  for path in (PACKAGE_DIR / "_axes").rglob("*.py"):
    name = module_name(path)
    others = [m for _, m in imported_modules(path.read_text(), name) if layer_of(m) not in (0, 1)]
    assert others == [], name


@pytest.mark.parametrize(
  "name, allowed", [("_keypaths", []), ("_warn", []), ("_nnx", ["t5x_optim._keypaths"])]
)
def test_room_0_imports_only_key_paths(name, allowed):
  source = (PACKAGE_DIR / f"{name}.py").read_text()
  assert [m for _, m in imported_modules(source, f"t5x_optim.{name}")] == allowed


def import_graph() -> dict[str, set[str]]:
  """Every t5x_optim module and the t5x_optim modules it imports, inside functions too."""
  return {
    module_name(path): {m for _, m in imported_modules(path.read_text(), module_name(path))}
    - {module_name(path)}
    for path in MODULES
  }


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of `graph` with more than one module (Tarjan)."""
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  on_stack: set[str] = set()
  found = []

  def visit(node: str) -> None:
    index[node] = low[node] = len(index)
    stack.append(node)
    on_stack.add(node)
    for other in sorted(graph.get(node, ())):
      if other not in index:
        visit(other)
        low[node] = min(low[node], low[other])
      elif other in on_stack:
        low[node] = min(low[node], index[other])
    if low[node] == index[node]:
      component = []
      while True:
        member = stack.pop()
        on_stack.discard(member)
        component.append(member)
        if member == node:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for node in sorted(graph):
    if node not in index:
      visit(node)
  return found


def test_no_import_circles():
  assert circles(import_graph()) == []


def test_circles_are_found():
  graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
  assert circles(graph) == [["a", "b", "c"]]
  assert circles({"a": {"b"}, "b": set()}) == []


def test_cli_imports_only_public_modules():
  for path in (PACKAGE_DIR / "cli").rglob("*.py"):
    name = module_name(path)
    private = [
      f"{name}:{line} imports {target}"
      for line, target in imported_modules(path.read_text(), name)
      if not target.startswith("t5x_optim.cli")
      and layer_of(target) < min(LAYERS[m] for m in PUBLIC)
    ]
    assert private == []


def test_cli_demo_below_its_loop_below_its_command():
  """``cli/demo`` imports no other cli module; ``cli/loop`` only the demo and itself."""
  allowed = {"demo": ("t5x_optim.cli.demo",), "loop": ("t5x_optim.cli.demo", "t5x_optim.cli.loop")}
  for room, below in allowed.items():
    for path in (PACKAGE_DIR / "cli" / room).rglob("*.py"):
      name = module_name(path)
      above = [
        target
        for _, target in imported_modules(path.read_text(), name)
        if target.startswith("t5x_optim.cli") and not target.startswith(below)
      ]
      assert above == [], name


def test_no_private_room_holds_a_quarter_of_the_package():
  def lines(paths) -> int:
    return sum(len(p.read_text().splitlines()) for p in paths)

  total = lines(MODULES)
  for room in PACKAGE_DIR.iterdir():
    if room.is_dir() and room.name.startswith("_") and room.name != "__pycache__":
      assert lines(room.rglob("*.py")) <= total / 4, room.name


def test_the_code_layout_table_names_every_module_of_its_room():
  """docs/development.md's table of rooms: each room's row names each of its modules."""
  table = (PACKAGE_DIR.parent / "docs" / "development.md").read_text()
  rows = {
    match.group(1): match.group(2)
    for match in re.finditer(r"^\| \d+ [\w ]+ \| `t5x_optim/(\w+)/` \|(.*)\|$", table, re.M)
  }
  rooms = [p for p in PACKAGE_DIR.iterdir() if p.is_dir() and (p / "__init__.py").exists()]
  rooms = [room for room in rooms if room.name.startswith("_") or room.name == "cli"]
  assert sorted(rows) == sorted(room.name for room in rooms)
  for room in rooms:
    unnamed = [
      str(path.relative_to(room))
      for path in room.rglob("*.py")
      if path.name != "__init__.py" and f"{path.name}`" not in rows[room.name]
    ]
    assert unnamed == [], room.name


def test_no_module_imports_a_private_name_of_another():
  bad = []
  for path in MODULES:
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("t5x_optim"):
        for alias in node.names:
          if alias.name.startswith("_") and not _is_module(f"{node.module}.{alias.name}"):
            bad.append(f"{module_name(path)}:{node.lineno} {node.module}.{alias.name}")
  assert bad == []


FUSED = "t5x_optim._layouts.fused"
FUSED_ORDER = [
  f"{FUSED}.program",
  f"{FUSED}.kernel",
  f"{FUSED}.analysis",
  f"{FUSED}.sharding",
  FUSED,
]


@pytest.mark.parametrize("module", FUSED_ORDER)
def test_fused_modules_import_only_those_before_them(module):
  path = PACKAGE_DIR.parent.joinpath(*module.split("."))
  path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
  rank = FUSED_ORDER.index(module)
  later = [
    f"line {line}: {target}"
    for line, target in imported_modules(path.read_text(), module)
    if target in FUSED_ORDER[rank + 1 :]
  ]
  assert later == []


def test_stacked_params_need_only_the_elementwise_analysis():
  source = (PACKAGE_DIR / "_layouts" / "stacked.py").read_text()
  fused = {m for _, m in imported_modules(source, "t5x_optim._layouts.stacked") if "fused" in m}
  assert fused <= {FUSED, f"{FUSED}.analysis", f"{FUSED}.program"}


def _modules_entered(fn, *args) -> set[str]:
  """The t5x_optim modules whose code runs while `fn(*args)` is traced (a profile hook).

  Tracing runs all of the library's Python code of the call, without compiling it.
  """
  entered = set()
  root = str(PACKAGE_DIR)

  def hook(frame, event, arg):
    if event == "call" and frame.f_code.co_filename.startswith(root):
      entered.add(module_name(pathlib.Path(frame.f_code.co_filename)))

  sys.setprofile(hook)
  try:
    jax.eval_shape(fn, *args)
  finally:
    sys.setprofile(None)
  return entered


def test_a_plain_update_enters_no_layout_module():
  params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
  opt = t5x_optim.optimizers.adamw(1e-3).create(params)
  grads = jax_tree_ones(params)
  entered = _modules_entered(opt.apply_gradient, grads)
  assert "t5x_optim._adapters.optax_wrapper" in entered
  assert not {m for m in entered if m.startswith("t5x_optim._layouts")}, entered


def test_a_fused_update_enters_the_fused_layout():
  params = {"w": jnp.ones((3, 2))}
  opt = t5x_optim.OptaxWrapper(optax.adam(0.1), fused="interpret").create(params)
  entered = _modules_entered(opt.apply_gradient, jax_tree_ones(params))
  assert FUSED in entered


def jax_tree_ones(tree):
  return {k: jnp.ones_like(v) for k, v in tree.items()}


def test_stacked_targets_get_a_plain_wrapper_of_their_own():
  opt_def = t5x_optim.OptaxWrapper(optax.adam(0.1), fused="interpret")
  stacked = opt_def.create(stack_params({"a": jnp.ones(2), "b": jnp.ones(2)}))
  assert isinstance(stacked.optimizer_def, StackedOptimizerDef)
  assert stacked.optimizer_def.inner is not opt_def
  assert stacked.optimizer_def.inner.fused is FusedUpdate.OFF
  assert opt_def.fused is FusedUpdate.INTERPRET
  plain = opt_def.create({"a": jnp.ones(2)})
  assert plain.optimizer_def is opt_def


def test_the_stacked_layer_refuses_a_fused_definition():
  with pytest.raises(ValueError, match="fused='off'"):
    StackedOptimizerDef(t5x_optim.OptaxWrapper(optax.adam(0.1), fused="interpret"))


@pytest.mark.slow
def test_import_loads_no_pallas():
  """Pallas (and its Triton backend) load only when a fused update is asked for."""
  code = (
    "import sys, t5x_optim\n"
    "print(sorted(m for m in sys.modules if m.startswith('jax.experimental.pallas')"
    " or m.startswith(f'{t5x_optim.__name__}._layouts.fused.')))"
  )
  out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
  assert out.stdout.split() == [
    "['t5x_optim._layouts.fused.analysis',",
    "'t5x_optim._layouts.fused.program']",
  ]
