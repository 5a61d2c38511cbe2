"""The optimizer of a T5X model directory, from the operative config T5X's train.py wrote there.

T5X writes its operative gin config to ``<model_dir>/config.gin``. It imports T5X's
modules (models, networks, tasks), which t5x_optim cannot import, but its optimizer
is built from ``t5x.optimizers`` and optax alone. `optimizer_config` reads the config
with gin's parser (nothing is imported or called) and writes out only what builds the
optimizer: what a model's ``optimizer_def`` (or ``cli.TrainJob.optimizer``) or else
``OPTIMIZER`` is bound to, every binding and macro it reaches, with ``t5x.optimizers``
read as ``t5x_optim.optimizers``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

from gin import config_parser

__all__ = ["T5XOptimizer", "binding_statements", "optimizer_config", "optimizer_statements"]

_LEGACY_ADAFACTOR = "t5x.adafactor"
_MODULES = {
  "t5x.optimizers": "t5x_optim.optimizers",
  "t5x_optim.optimizers": "t5x_optim.optimizers",
  "optax": "optax",
}
"""The modules a T5X optimizer may be built from, and what t5x_optim imports for each."""


@dataclasses.dataclass(frozen=True)
class _Reference:
  name: str
  evaluate: bool


@dataclasses.dataclass(frozen=True)
class _Macro:
  name: str


class _Delegate(config_parser.ParserDelegate):
  def configurable_reference(self, scoped_configurable_name: str, evaluate: bool) -> _Reference:
    return _Reference(scoped_configurable_name, evaluate)

  def macro(self, macro_name: str) -> _Macro:
    return _Macro(macro_name)


class T5XOptimizer(NamedTuple):
  """What a T5X operative config says of its optimizer.

  Attributes:
    gin: a gin config for t5x_optim that binds ``OPTIMIZER`` to the same
      optimizer, or None for T5X's legacy ``adafactor.Adafactor`` (not in
      t5x_optim; its checkpoints are recognised by their layout).
    hparams: for the legacy Adafactor, its hyper-parameters bound to
      numbers (``beta1``, ``epsilon2``, ...); otherwise empty (gin's own
      evaluation of `gin` gives them).
  """

  gin: str | None
  hparams: Mapping[str, Any]


def _render(value: Any) -> str:
  if isinstance(value, _Reference):
    return f"@{value.name}{'()' if value.evaluate else ''}"
  if isinstance(value, _Macro):
    return f"%{value.name}"
  if isinstance(value, list):
    return "[" + ", ".join(_render(v) for v in value) + "]"
  if isinstance(value, tuple):
    return "(" + "".join(f"{_render(v)}, " for v in value) + ")"
  if isinstance(value, dict):
    return "{" + ", ".join(f"{_render(k)}: {_render(v)}" for k, v in value.items()) + "}"
  return repr(value)


def _children(value: Any) -> list[Any]:
  if isinstance(value, list | tuple):
    return list(value)
  if isinstance(value, dict):
    return [*value.keys(), *value.values()]
  return []


class _Reached(NamedTuple):
  """The statements an optimizer binding reaches in a gin config."""

  root: Any  # the bound value: ``@optimizers.adamw()``, say
  kept: list[config_parser.BindingStatement]  # bindings and macros reached, in order
  selectors: list[str]  # the configurables reached (unscoped selectors), in order
  modules: dict[str, str]  # the config's import names -> modules


def _module_of(selector: str, modules: Mapping[str, str]) -> str | None:
  """The imported module whose name starts `selector` (``optax`` of ``optax.contrib.muon``)."""
  parts = selector.split(".")[:-1]
  for end in range(len(parts), 0, -1):
    if ".".join(parts[:end]) in modules:
      return modules[".".join(parts[:end])]
  return None


def _parse(text: str) -> tuple[dict[str, str], list[config_parser.BindingStatement]]:
  """A gin config's imports (name -> module) and bindings, parsed without importing anything."""
  modules: dict[str, str] = {}
  bindings: list[config_parser.BindingStatement] = []
  for statement in config_parser.ConfigParser(text, _Delegate()):
    if isinstance(statement, config_parser.ImportStatement):
      head, _, last = statement.module.rpartition(".")
      name = statement.alias or (last if statement.is_from and head else statement.module)
      modules[name] = statement.module
    elif isinstance(statement, config_parser.BindingStatement):
      bindings.append(statement)
  return modules, bindings


def binding_statements(text: str) -> list[config_parser.BindingStatement]:
  """Every binding (and macro) of a gin config, parsed without importing anything."""
  return _parse(text)[1]


def _takes_the_optimizer(binding: config_parser.BindingStatement) -> bool:
  """Whether `binding` gives the job its optimizer: a T5X model's ``optimizer_def`` or a
  t5x-optim ``cli.TrainJob.optimizer``."""
  job = binding.arg_name == "optimizer" and binding.selector.rpartition(".")[2] == "TrainJob"
  return job or binding.arg_name == "optimizer_def"


def optimizer_statements(text: str) -> _Reached | None:
  """What builds the optimizer of a gin config, and every binding and macro it reaches;
  None if it binds no optimizer.

  The optimizer is what the job takes (a model's ``optimizer_def``, a
  ``cli.TrainJob.optimizer``), a macro it names read as the macro's value, or,
  where neither is bound, the ``OPTIMIZER`` macro.
  """
  modules, bindings = _parse(text)
  macros = {b.selector: b for b in bindings if not b.arg_name and not b.scope}
  taken = next((b.value for b in bindings if _takes_the_optimizer(b)), _Macro("OPTIMIZER"))
  seen: set[str] = set()
  if isinstance(taken, _Macro):
    if taken.name not in macros:
      return None
    seen.add(taken.name)
    taken = macros[taken.name].value
  reached = _Reached(taken, [], [], modules)

  def visit(value: Any) -> None:
    if isinstance(value, _Macro) and value.name not in seen:
      seen.add(value.name)
      if value.name in macros:
        reached.kept.append(macros[value.name])
        visit(macros[value.name].value)
    elif isinstance(value, _Reference) and value.name.rsplit("/", 1)[-1] not in seen:
      selector = value.name.rsplit("/", 1)[-1]
      seen.add(selector)
      reached.selectors.append(selector)
      for binding in bindings:
        if binding.selector == selector and binding.arg_name:
          reached.kept.append(binding)
          visit(binding.value)
    for child in _children(value):
      visit(child)

  visit(taken)
  return reached


def optimizer_config(text: str, where: str = "config.gin") -> T5XOptimizer:
  """The optimizer a T5X operative config binds, as a t5x_optim gin config.

  Args:
    text: the config (``<model_dir>/config.gin``, as T5X's train.py writes it).
    where: the config's name, for errors.

  Raises:
    ValueError: the config binds no optimizer, or builds it from a module
      other than ``t5x.optimizers``, optax and T5X's ``adafactor``.

  Example:
    >>> t5x = '''from __gin__ import dynamic_registration
    ... from t5x import optimizers
    ... from t5x import models
    ... OPTIMIZER = @optimizers.adamw()
    ... optimizers.adamw.learning_rate = %LR
    ... LR = 0.01
    ... models.EncoderDecoderModel.optimizer_def = %OPTIMIZER'''
    >>> print(optimizer_config(t5x).gin)
    from __gin__ import dynamic_registration
    from t5x_optim import optimizers
    OPTIMIZER = @optimizers.adamw()
    optimizers.adamw.learning_rate = %LR
    LR = 0.01
  """
  reached = optimizer_statements(text)
  if reached is None:
    raise ValueError(
      f"{where} binds no optimizer (no OPTIMIZER macro, optimizer_def or cli.TrainJob.optimizer)."
    )
  modules = {selector: _module_of(selector, reached.modules) for selector in reached.selectors}
  for selector, module in modules.items():
    if module not in (*_MODULES, _LEGACY_ADAFACTOR):
      raise ValueError(
        f"{where}: the optimizer uses {selector} from {module or 'a module it does not import'}"
        ", which t5x_optim cannot import; pass --init_from_gin with a gin file for the optimizer."
      )
  legacy = {selector for selector, module in modules.items() if module == _LEGACY_ADAFACTOR}
  if legacy:
    numbers = {
      b.arg_name: b.value
      for b in reached.kept
      if b.selector in legacy and isinstance(b.value, bool | int | float)
    }
    return T5XOptimizer(None, numbers)
  imports = ["from __gin__ import dynamic_registration"]
  for name in sorted(set(modules.values())):
    ours = _MODULES[name]
    alias = next(a for a, m in reached.modules.items() if m == name)
    head, _, last = ours.rpartition(".")
    plain = f"from {head} import {last}" if head else f"import {ours}"
    imports.append(plain if alias == (last if head else ours) else f"{plain} as {alias}")
  lines = [*imports, f"OPTIMIZER = {_render(reached.root)}"]
  for binding in reached.kept:
    scope = f"{binding.scope}/" if binding.scope else ""
    key = f"{scope}{binding.selector}.{binding.arg_name}" if binding.arg_name else binding.selector
    lines.append(f"{key} = {_render(binding.value)}")
  return T5XOptimizer("\n".join(lines), {})
