"""Optional packages the tests use when they import: kfac-jax."""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import pytest


@functools.cache
def kfac_jax_error() -> str | None:
  """Why kfac-jax cannot be used here, or None when it imports.

  kfac-jax 0.0.8 (the newest release) fails to import with jax 0.11
  (``jax.core.Effects`` was removed), which raises AttributeError, not
  ImportError.
  """
  try:
    importlib.import_module("kfac_jax")
  except (ImportError, AttributeError) as error:
    return f"kfac-jax does not import here: {type(error).__name__}: {error}"
  return None


def import_kfac_jax() -> ModuleType:
  """kfac-jax, or the calling test (or module) is skipped with the reason."""
  error = kfac_jax_error()
  if error is not None:
    pytest.skip(error, allow_module_level=True)
  return importlib.import_module("kfac_jax")
