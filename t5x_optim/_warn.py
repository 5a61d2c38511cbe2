"""Warnings attributed to the caller's line, however deep in the package they arise.

A fixed ``stacklevel`` names the right line from one call path only: the same
warning reached through `Optimizer.apply_gradient`, a `jax.jit` trace or a
T5X train state names a line inside the package, inside jax, or ``sys:1``.
`warn` walks out of the package and the libraries it calls back through
(jax, flax, optax, and gin, which calls what a config builds, through
``copy.deepcopy`` for a reference's value), so
``-W error::UserWarning:my_module`` filters and the printed location are the
user's. It imports no other t5x_optim module.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import sys
import warnings

import flax
import gin
import jax
import optax

__all__ = ["warn"]

_INSIDE = (
  os.path.dirname(__file__) + os.sep,
  *(os.path.dirname(module.__file__) + os.sep for module in (jax, flax, optax, gin)),
  contextlib.__file__,
  copy.__file__,
  functools.__file__,
)


def warn(message: str, category: type[Warning] = UserWarning) -> None:
  """``warnings.warn`` at the first frame outside the package, jax, flax, optax and gin.

  Example:
    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...   warnings.simplefilter("always")
    ...   warn("careful")
    >>> str(caught[0].message)
    'careful'
  """
  frame, level = sys._getframe(0), 1
  while frame is not None and frame.f_code.co_filename.startswith(_INSIDE):
    frame, level = frame.f_back, level + 1
  warnings.warn(message, category, stacklevel=level)
