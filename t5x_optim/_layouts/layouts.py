"""How an `OptaxWrapper` lays out its update: plain, fused or stacked.

`UpdateLayout` is the wrapper's one hook into the two layouts that live
outside it:

- the fused (multi-tensor) update of `t5x_optim._layouts.fused`, chosen
  by ``OptaxWrapper(fused=...)``, which runs an elementwise update as one
  kernel per group of leaves;
- the stacked layer of `t5x_optim._layouts.stacked`, chosen by the
  target: `create` puts it around the wrapper when the params are
  `StackedParams`.

The wrapper asks the hook to create its `Optimizer` and to run its update;
it names neither layout itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import optax

from t5x_optim._core.interface import Optimizer, OptimizerDef
from t5x_optim._layouts import stacked as _stacked
from t5x_optim._layouts.fused import FusedUpdate

__all__ = ["FusedOption", "UpdateLayout"]

FusedOption = FusedUpdate | str | bool
"""What ``fused=`` takes: a `FusedUpdate`, its string value or a bool."""


class UpdateLayout:
  """The layout of one definition's update: its fused mode and the stacked layer.

  Args:
    fused: the fused mode (`FusedUpdate.of` reads it); ``"off"`` runs the
      plain optax update.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> layout = UpdateLayout(fused="off")
    >>> params, grads = {'w': jnp.ones(2)}, {'w': jnp.ones(2)}
    >>> tx = optax.sgd(0.5)
    >>> layout.update(tx, params, grads, tx.init(params), {})[0]['w']
    Array([0.5, 0.5], dtype=float32)
  """

  def __init__(self, fused: FusedOption = FusedUpdate.OFF):
    self.fused = FusedUpdate.of(fused)

  def unfused(self) -> UpdateLayout:
    """This layout with the plain update (what the stacked layer runs inside)."""
    return UpdateLayout(FusedUpdate.OFF)

  def create(
    self, opt_def: OptimizerDef, target: Any, create_plain: Callable[[Any], Optimizer]
  ) -> Optimizer:
    """`opt_def`'s `Optimizer` for `target`: in the stacked layer for `StackedParams`.

    Args:
      opt_def: the definition being created.
      target: the params.
      create_plain: the definition's own `create`, for any other target.
    """
    if isinstance(target, _stacked.StackedParams):
      return _stacked.StackedOptimizerDef(opt_def).create(target)
    return create_plain(target)

  def update(
    self,
    tx: optax.GradientTransformation,
    params: Any,
    grads: Any,
    states: Any,
    extra_args: Mapping[str, Any],
  ) -> tuple[Any, Any]:
    """One step of `tx`: ``(new_params, new_states)``, fused when the mode says so."""
    return self.fused.update(tx, params, grads, states, extra_args)

  def __repr__(self) -> str:
    return f"UpdateLayout(fused={self.fused.value!r})"
