"""Finds optax's optimizer factories by introspection.

An optimizer factory is a public function of `optax` or `optax.contrib` (its
``__all__``, or its public names where it has none) that
returns a `GradientTransformation` and takes a learning rate (a parameter whose
name ends in ``learning_rate``). Deprecated aliases (served by the module's
``__getattr__`` with a warning, not stored in the module) are skipped, so
``dpsgd`` comes from `optax.contrib`. A new optax release adds factories here
without code changes.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable

import optax
import optax.contrib

__all__ = ["OPTAX_MODULES", "is_optimizer_factory", "optax_optimizer_factories"]

OPTAX_MODULES: tuple[types.ModuleType, ...] = (optax, optax.contrib)


def _returns_transformation(signature: inspect.Signature) -> bool:
  annotation = signature.return_annotation
  if isinstance(annotation, str):
    return annotation.rsplit(".", 1)[-1].startswith("GradientTransformation")
  return isinstance(annotation, type) and issubclass(annotation, optax.GradientTransformation)


def is_optimizer_factory(obj: object) -> bool:
  """Whether `obj` is an optax optimizer factory (see the module docstring)."""
  if inspect.isclass(obj) or not callable(obj):
    return False
  try:
    signature = inspect.signature(obj)
  except (TypeError, ValueError):
    return False
  takes_rate = any(name.endswith("learning_rate") for name in signature.parameters)
  return takes_rate and _returns_transformation(signature)


def _public_names(module: types.ModuleType) -> list[str]:
  names = getattr(module, "__all__", None)
  if names is None:
    names = [name for name in vars(module) if not name.startswith("_")]
  return list(names)


def optax_optimizer_factories() -> dict[str, Callable[..., optax.GradientTransformation]]:
  """Returns `{name: factory}` for every optax optimizer factory, sorted by name.

  Example:
    >>> 'adamw' in optax_optimizer_factories()
    True
  """
  found: dict[str, Callable[..., optax.GradientTransformation]] = {}
  for module in OPTAX_MODULES:
    members = vars(module)
    for name in _public_names(module):
      if name in found or name not in members:
        continue
      if is_optimizer_factory(members[name]):
        found[name] = members[name]
  return dict(sorted(found.items()))
