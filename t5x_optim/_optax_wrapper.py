"""`OptaxWrapper`: any optax `GradientTransformation` as an `OptimizerDef`."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct

from t5x_optim._optimizer import (
    Optimizer,
    OptimizerDef,
    OptimizerState,
    structure_mismatch,
    tree_like,
)
from t5x_optim.partitioning import _state_rules

__all__ = [
    "OptaxHyperParams",
    "OptaxWrapper",
    "chain",
    "inject_hyperparams",
    "wrap_optax_optimizer",
]

_LEARNING_RATE = "learning_rate"


@struct.dataclass
class OptaxHyperParams:
  """Hyper-params of an `OptaxWrapper`.

  Optax keeps its hyper-parameters (and schedules) inside the transformation;
  the only override is T5X's `learning_rate`, which takes effect when the
  transformation was built with `optax.inject_hyperparams`.
  """

  learning_rate: Any = None


def _is_injected_state(node: Any) -> bool:
  """Structural test for optax's inject_(stateful_)hyperparams states."""
  fields = getattr(node, "_fields", ())
  return isinstance(node, tuple) and "hyperparams" in fields and "inner_state" in fields


def override_learning_rate(param_states: Any, learning_rate: Any) -> Any:
  """Sets `learning_rate` in every injected-hyperparams state of the tree.

  Raises:
    ValueError: when no state has an injectable learning rate, or when the
      learning rate is scheduled inside the transformation (an override would
      be ignored).
  """
  found = []

  def set_rate(node: Any) -> Any:
    if not (_is_injected_state(node) and _LEARNING_RATE in node.hyperparams):
      return node
    if _LEARNING_RATE in (getattr(node, "hyperparams_states", None) or {}):
      raise ValueError(
          "learning_rate= was passed to apply_gradient, but the transformation "
          "schedules its learning rate itself (inject_hyperparams with a "
          "schedule), so an override would be ignored. Pass learning_rate=None, "
          "or inject a constant learning rate."
      )
    found.append(node)
    old = node.hyperparams[_LEARNING_RATE]
    hyperparams = dict(node.hyperparams)
    hyperparams[_LEARNING_RATE] = jnp.asarray(learning_rate, dtype=jnp.result_type(old))
    return node._replace(hyperparams=hyperparams)

  new_states = jax.tree.map(set_rate, param_states, is_leaf=_is_injected_state)
  if not found:
    raise ValueError(
        "learning_rate= was passed to apply_gradient, but the optax "
        "transformation has no injectable learning rate, so it cannot take "
        "an override. Build it with optax.inject_hyperparams, e.g. "
        "OptaxWrapper(optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3)), "
        "or pass learning_rate=None and schedule inside optax."
    )
  return new_states


class OptaxWrapper(OptimizerDef):
  """Exposes an optax `GradientTransformation` as a T5X `OptimizerDef`.

  The state is `OptimizerState(step, param_states)` where `step` is an int32
  array and `param_states` the optax state (an `optax.MultiSteps` is taken
  through its `gradient_transformation()`). Extra keyword arguments of
  `Optimizer.apply_gradient` (e.g. `value=` for `reduce_on_plateau`) are
  passed on to `update`.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> opt = OptaxWrapper(optax.adamw(1e-3)).create({'w': jnp.ones(3)})
    >>> opt = opt.apply_gradient({'w': jnp.ones(3)})
    >>> int(opt.state.step)
    1
  """

  accepts_extra_args = True

  def __init__(self, optax_optimizer: optax.GradientTransformation | optax.MultiSteps):
    super().__init__(hyper_params=OptaxHyperParams())
    if isinstance(optax_optimizer, optax.MultiSteps):
      optax_optimizer = optax_optimizer.gradient_transformation()
    self.optax_optimizer = optax_optimizer

  def init_state(self, params: Any) -> OptimizerState:
    return OptimizerState(
        step=jnp.zeros((), jnp.int32), param_states=self.optax_optimizer.init(params)
    )

  def apply_gradient(
      self,
      hyper_params: OptaxHyperParams,
      params: Any,
      state: OptimizerState,
      grads: Any,
      **extra_args: Any,
  ) -> tuple[Any, OptimizerState]:
    grads = tree_like(grads, params)
    param_states = state.param_states
    if hyper_params.learning_rate is not None:
      param_states = override_learning_rate(param_states, hyper_params.learning_rate)
    if extra_args and not isinstance(
        self.optax_optimizer, optax.GradientTransformationExtraArgs
    ):
      raise TypeError(
          f"Extra arguments {sorted(extra_args)} were passed to apply_gradient, "
          "but the optax transformation does not take extra arguments."
      )
    try:
      updates, new_param_states = self.optax_optimizer.update(
          grads, param_states, params, **extra_args
      )
      new_params = optax.apply_updates(params, updates)
    except (TypeError, ValueError) as error:
      mismatch = structure_mismatch(grads, params, name="grads")
      if mismatch is None:
        raise
      raise ValueError(f"The grads do not fit the params: {mismatch}.") from error
    return new_params, OptimizerState(step=state.step + 1, param_states=new_param_states)

  def derive_logical_axes(self, optimizer: Optimizer, param_logical_axes: Any) -> Optimizer:
    """Returns `optimizer` with every leaf replaced by its logical spec.

    The target becomes the params' logical axes, `step` becomes `None` and
    every optax state leaf a `PartitionSpec` (or `None`, replicated); empty
    optax nodes stay as they are.
    """
    axes = _state_rules.logical_axes_from(param_logical_axes)
    param_states = _state_rules.OptaxStatePartitionRules.derive_optax_logical_axes(
        optimizer.state.param_states,
        axes,
        transformation=self.optax_optimizer,
        params=optimizer.target,
    )
    return optimizer.replace(
        target=axes, state=OptimizerState(step=None, param_states=param_states)
    )


def wrap_optax_optimizer(
    optax_optimizer: Callable[..., optax.GradientTransformation],
) -> Callable[..., OptaxWrapper]:
  """Turns an optax factory into one that builds an `OptaxWrapper`.

  The result keeps the factory's name, docstring and signature, so gin can
  configure it.

  Example:
    >>> import optax
    >>> adamw = wrap_optax_optimizer(optax.adamw)
    >>> type(adamw(learning_rate=1e-3)).__name__
    'OptaxWrapper'
  """

  @functools.wraps(optax_optimizer)
  def wrapped_optimizer(*args: Any, **kwargs: Any) -> OptaxWrapper:
    return OptaxWrapper(optax_optimizer(*args, **kwargs))

  return wrapped_optimizer


def chain(transformations: Sequence[optax.GradientTransformation]) -> OptaxWrapper:
  """`optax.chain` over a list (gin cannot bind `*args`), as an `OptaxWrapper`.

  Example:
    >>> import optax
    >>> opt_def = chain([optax.clip_by_global_norm(1.0), optax.adam(1e-3)])
  """
  return OptaxWrapper(optax.chain(*transformations))


def inject_hyperparams(
    inner_factory: Callable[..., optax.GradientTransformation],
    *,
    hyperparams: Mapping[str, Any],
    static_args: Sequence[str] = (),
) -> optax.GradientTransformation:
  """`optax.inject_hyperparams(inner_factory)(**hyperparams)`, configurable by gin.

  Gin cannot call the function `optax.inject_hyperparams` returns; this does
  (in gin: ``@optimizers.inject_hyperparams()``).
  The result is a transformation: use it inside `optimizers.chain` or wrap it
  with `optimizers.OptaxWrapper`. A constant injected ``learning_rate`` can
  then be overridden per step (T5X's ``apply_gradient(learning_rate=...)``).

  Args:
    inner_factory: an optax factory (in gin, a reference without call:
      ``@optax.sgd``).
    hyperparams: the factory's arguments; numbers (or schedules) are
      injected into the state, other values are passed as they are.
    static_args: names of arguments that must stay static.

  Raises:
    TypeError: when `hyperparams` names an argument `inner_factory` lacks.

  Example:
    >>> import optax
    >>> tx = inject_hyperparams(optax.sgd, hyperparams={'learning_rate': 0.1})
    >>> round(float(tx.init({}).hyperparams['learning_rate']), 6)
    0.1
  """
  accepted = inspect.signature(inner_factory).parameters
  unknown = sorted(set(hyperparams) - set(accepted))
  if unknown:
    raise TypeError(
        f"inject_hyperparams: {getattr(inner_factory, '__name__', inner_factory)} has no "
        f"argument(s) {unknown}; it takes {sorted(accepted)}."
    )
  return optax.inject_hyperparams(inner_factory, static_args=tuple(static_args))(**hyperparams)
