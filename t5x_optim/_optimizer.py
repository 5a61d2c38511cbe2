"""T5X's optimizer interface: `OptimizerState`, `Optimizer`, `OptimizerDef`."""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping
from typing import Any

import flax
import jax
from flax import struct

from t5x_optim import _state_dict

__all__ = ["Optimizer", "OptimizerDef", "OptimizerState"]


@struct.dataclass
class OptimizerState:
  """The optimizer's state: an int32 step counter and the per-param states."""

  step: Any
  param_states: Any


class Optimizer(struct.PyTreeNode):
  """An optimizer definition together with its target (params) and state.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from t5x_optim import OptaxWrapper
    >>> opt = OptaxWrapper(optax.sgd(0.1)).create({'w': jnp.ones(2)})
    >>> opt.apply_gradient({'w': jnp.ones(2)}).target['w']
    Array([0.9, 0.9], dtype=float32)
  """

  optimizer_def: OptimizerDef = struct.field(pytree_node=False)
  state: Any = struct.field(pytree_node=True)
  target: Any = struct.field(pytree_node=True)

  def apply_gradient(self, grads: Any, **kwargs: Any) -> Optimizer:
    """Applies `grads` and returns the optimizer with new target and state.

    Args:
      grads: gradients with the target's structure (dicts and FrozenDicts are
        interchangeable).
      **kwargs: hyper-parameter overrides (fields of the definition's
        `hyper_params`, e.g. T5X's `learning_rate=`, or `hyper_params=`); any
        other keyword is an extra argument for the update rule (e.g. optax's
        `value=` for `reduce_on_plateau`).
    """
    overrides, extra_args = self.optimizer_def.split_apply_kwargs(kwargs)
    hyper_params = self.optimizer_def.update_hyper_params(**overrides)
    new_target, new_state = self.optimizer_def.apply_gradient(
        hyper_params, self.target, self.state, grads, **extra_args
    )
    return self.replace(target=new_target, state=new_state)

  def state_dict(self) -> dict[str, Any]:
    """The T5X-layout state dict: `{'target': ..., 'state': {...}}`."""
    return self.optimizer_def.state_dict(self.target, self.state)

  def restore_state(self, state: Mapping[str, Any]) -> Optimizer:
    """Returns a new optimizer restored from `state`; `self` is unchanged."""
    target, new_state = self.optimizer_def.restore_state(self.target, self.state, state)
    return self.replace(target=target, state=new_state)


class OptimizerDef(abc.ABC):
  """Base class of optimizer definitions (T5X's `OptimizerDef` contract).

  Subclasses implement `init_state`, `apply_gradient` and
  `derive_logical_axes`. A definition whose `apply_gradient` accepts extra
  keyword arguments sets `accepts_extra_args = True`.
  """

  accepts_extra_args: bool = False

  def __init__(self, hyper_params: Any):
    self.hyper_params = hyper_params

  @abc.abstractmethod
  def init_state(self, params: Any) -> OptimizerState:
    """Returns the initial state for `params`."""

  @abc.abstractmethod
  def apply_gradient(
      self, hyper_params: Any, params: Any, state: OptimizerState, grads: Any, **extra_args: Any
  ) -> tuple[Any, OptimizerState]:
    """Returns `(new_params, new_state)`."""

  @abc.abstractmethod
  def derive_logical_axes(self, optimizer: Optimizer, param_logical_axes: Any) -> Optimizer:
    """Returns `optimizer` with every array replaced by its logical spec."""

  def hyper_param_names(self) -> frozenset[str]:
    """The keywords `apply_gradient` treats as hyper-parameter overrides."""
    names = {"hyper_params"}
    if dataclasses.is_dataclass(self.hyper_params):
      names.update(field.name for field in dataclasses.fields(self.hyper_params))
    return frozenset(names)

  def split_apply_kwargs(self, kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Splits `Optimizer.apply_gradient` keywords into overrides and extras."""
    names = self.hyper_param_names()
    overrides = {k: v for k, v in kwargs.items() if k in names}
    extra_args = {k: v for k, v in kwargs.items() if k not in names}
    if extra_args and not self.accepts_extra_args:
      raise TypeError(
          f"{type(self).__name__}.apply_gradient got unknown keyword arguments "
          f"{sorted(extra_args)}; its hyper-parameters are {sorted(names)}."
      )
    return overrides, extra_args

  def update_hyper_params(self, **hyper_param_overrides: Any) -> Any:
    """Returns the hyper-params with overrides applied.

    `hyper_params=` replaces all of them; other keywords are `.replace`d.
    """
    hyper_params = hyper_param_overrides.pop("hyper_params", self.hyper_params)
    if hyper_param_overrides:
      hyper_params = hyper_params.replace(**hyper_param_overrides)
    return hyper_params

  def create(self, target: Any) -> Optimizer:
    """Creates an `Optimizer` for `target` (the params)."""
    return Optimizer(optimizer_def=self, state=self.init_state(target), target=target)

  def state_dict(self, target: Any, state: OptimizerState) -> dict[str, Any]:
    """The T5X-layout state dict of `target` and `state`.

    `param_states` has every empty container removed, as T5X writes it.
    """
    return {
        "target": flax.serialization.to_state_dict(target),
        "state": {
            "step": state.step,
            "param_states": _state_dict.to_pruned_state_dict(state.param_states),
        },
    }

  def restore_state(
      self, opt_target: Any, opt_state: OptimizerState, state_dict: Mapping[str, Any]
  ) -> tuple[Any, OptimizerState]:
    """Restores `(target, state)` from a state dict, validating it first.

    Raises:
      ValueError: naming the path and both sides, on any missing or
        unexpected key, shape mismatch or unsafe dtype cast. The inputs are
        never modified.
    """
    reference = {"target": opt_target, "state": opt_state}
    restored = _state_dict.restore_into(reference, dict(state_dict))
    return restored["target"], restored["state"]


def _leaf_paths(tree: Any) -> set[str]:
  return {
      jax.tree_util.keystr(path)
      for path, _ in jax.tree_util.tree_flatten_with_path(flax.core.unfreeze(tree))[0]
  }


def tree_like(value: Any, reference: Any) -> Any:
  """Returns `value` in `reference`'s container types (dict vs FrozenDict).

  Trees that differ in more than the mapping type come back unchanged.
  """
  ref_def = jax.tree.structure(reference)
  if jax.tree.structure(value) == ref_def:
    return value
  if jax.tree.structure(flax.core.unfreeze(value)) != jax.tree.structure(
      flax.core.unfreeze(reference)
  ):
    return value
  return jax.tree.unflatten(ref_def, jax.tree.leaves(value))


def structure_mismatch(value: Any, reference: Any, *, name: str) -> str | None:
  """Describes how `value`'s structure differs from `reference`'s, or None."""
  value_def = jax.tree.structure(flax.core.unfreeze(value))
  ref_def = jax.tree.structure(flax.core.unfreeze(reference))
  if value_def == ref_def:
    return None
  value_paths, ref_paths = _leaf_paths(value), _leaf_paths(reference)
  return (
      f"paths only in the {name}: {sorted(value_paths - ref_paths)}; paths only in "
      f"the params: {sorted(ref_paths - value_paths)}; {name} tree: {value_def}; "
      f"params tree: {ref_def}"
  )
