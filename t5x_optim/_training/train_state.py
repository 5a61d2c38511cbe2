"""`TrainState`: T5X's `FlaxOptimTrainState` on this package's `Optimizer`.

A train state holds an `Optimizer` (params as its target, the optimizer state)
and the model's other variable collections (`flax_mutables`, e.g. batch
statistics). The logical axes of params and mutables are kept as static
metadata, so `as_logical_axes()` can describe the whole state with logical
`PartitionSpec`s for a `Partitioner`.

Containers are normalised once, at the edges: whatever comes in (plain dicts
or FrozenDicts), params and mutables are stored as plain nested dicts, which
is what flax 0.12's `Module.init` returns.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax
import jax
import jax.numpy as jnp
from flax import struct, traverse_util
from flax.linen import partitioning as flax_partitioning
from jax.sharding import PartitionSpec

from t5x_optim._adapters.multi_optimizer import with_param_axes
from t5x_optim._axes.engine import box_spec, is_box, unbox_leaf
from t5x_optim._core import state_dict as _state_dict
from t5x_optim._core.interface import Optimizer, OptimizerDef, structure_mismatch
from t5x_optim._keypaths import key_path_str
from t5x_optim._nnx import refuse

__all__ = ["TrainState"]

_PARAMS = "params"
_AXES_SUFFIX = "_axes"
_FLAX_MUTABLES = "flax_mutables"

SpecLeaves = tuple[PartitionSpec | None, ...]
"""Logical specs aligned with `jax.tree.leaves` of a collection."""


def _box_spec(path: tuple[str, ...], x: Any) -> PartitionSpec | None:
  """A leaf's logical spec from its box; None (replicated) for an unboxed leaf."""
  return box_spec(x, key_path_str(path)) if is_box(x) else None


def _axes_by_path(axes_collection: Any) -> dict[tuple[str, ...], PartitionSpec | None]:
  """A T5X `<collection>_axes` collection as `{variable path: logical spec}`."""
  names = flax.core.unfreeze(flax_partitioning.get_axis_names(axes_collection))
  return traverse_util.flatten_dict(names)


def _split_collection(
  name: str, collection: Any, axes_collection: Any | None
) -> tuple[dict[str, Any], SpecLeaves | None]:
  """Unboxes one collection and finds the logical spec of each of its leaves.

  A leaf's spec comes from the T5X axes collection (`param_with_axes`), else
  from its `nn.with_logical_partitioning` box (a box and the collection that
  name other axes for one leaf are refused); unboxed leaves of a collection
  without an axes collection are replicated (None).

  Returns:
    The unboxed collection as plain dicts and the specs aligned with its
    leaves, or None for the specs when the collection has no axes at all.

  Raises:
    ValueError: when the axes collection does not cover exactly the
      collection's unboxed variables, or names other axes than a box; the
      message names the paths.
  """
  flat = traverse_util.flatten_dict(flax.core.unfreeze(collection), keep_empty_nodes=True)
  given = {} if axes_collection is None else _axes_by_path(axes_collection)
  unexpected = sorted(key_path_str(p) for p in given if p not in flat)
  unboxed = [p for p, x in flat.items() if not is_box(x) and x is not traverse_util.empty_node]
  missing = sorted(key_path_str(p) for p in unboxed if p not in given)
  if axes_collection is not None and (unexpected or missing):
    raise ValueError(
      f"The '{name}{_AXES_SUFFIX}' collection does not match the '{name}' "
      f"collection: axes without a variable: {unexpected}; variables without "
      f"axes: {missing}."
    )
  conflicts = [
    f"'{key_path_str((name, *p))}': box {x.get_partition_spec()}, collection {given[p]}"
    for p, x in flat.items()
    if p in given
    and isinstance(x, flax.linen.LogicallyPartitioned)
    and PartitionSpec(*x.get_partition_spec()) != PartitionSpec(*given[p])
  ]
  if conflicts:
    raise ValueError(
      f"Logical axes given twice, by a box and by the '{name}{_AXES_SUFFIX}' collection, "
      f"differ: {'; '.join(conflicts)}; give each variable's axes once."
    )
  if axes_collection is None and len(unboxed) == len(flat):
    specs_flat = None
  else:
    specs_flat = {
      p: x
      if x is traverse_util.empty_node
      else given[p]
      if p in given
      else _box_spec((name, *p), x)
      for p, x in flat.items()
    }
  values = traverse_util.unflatten_dict({p: unbox_leaf(x) for p, x in flat.items()})
  if specs_flat is None:
    return values, None
  specs = traverse_util.unflatten_dict(specs_flat)
  return values, tuple(jax.tree.structure(values).flatten_up_to(specs))


def _split_variables(
  model_variables: Mapping[str, Any],
) -> tuple[dict[str, Any], SpecLeaves | None, dict[str, Any], SpecLeaves | None]:
  """Splits model variables into (params, their specs, mutables, their specs)."""
  variables = dict(flax.core.unfreeze(model_variables))
  if _PARAMS not in variables:
    raise ValueError(
      f"model_variables has no '{_PARAMS}' collection; its collections are {sorted(variables)}."
    )
  axes = {k[: -len(_AXES_SUFFIX)]: v for k, v in variables.items() if k.endswith(_AXES_SUFFIX)}
  orphans = sorted(f"{k}{_AXES_SUFFIX}" for k in axes if k not in variables)
  if orphans:
    raise ValueError(
      f"Axes collections {orphans} have no matching variable collection; the "
      f"collections are {sorted(variables)}."
    )
  params, param_specs = _split_collection(_PARAMS, variables[_PARAMS], axes.get(_PARAMS))
  mutables, mutable_specs = {}, []
  any_mutable_axes = False
  for name in sorted(k for k in variables if k != _PARAMS and not k.endswith(_AXES_SUFFIX)):
    values, specs = _split_collection(name, variables[name], axes.get(name))
    mutables[name] = values
    any_mutable_axes |= specs is not None
    mutable_specs.extend(specs or (None,) * len(jax.tree.leaves(values)))
  return params, param_specs, mutables, tuple(mutable_specs) if any_mutable_axes else None


def _unflatten_like(tree: Any, specs: SpecLeaves | None) -> Any:
  """`specs` in `tree`'s structure; None specs replicate every leaf."""
  treedef = jax.tree.structure(tree)
  return treedef.unflatten(specs if specs is not None else (None,) * treedef.num_leaves)


def _check_structure(value: Any, reference: Any, *, name: str, reference_name: str) -> None:
  """Raises ValueError unless `value` has `reference`'s structure and, leaf by leaf, shapes;
  naming the paths and both sides."""
  mismatch = structure_mismatch(value, reference, name=name, reference_name=reference_name)
  if mismatch is None:
    flat = jax.tree.flatten_with_path(flax.core.unfreeze(value))[0]
    shapes = [
      f"'{key_path_str(path)}': {name} {jnp.shape(new)}, the train state's {jnp.shape(old)}"
      for (path, new), old in zip(flat, jax.tree.leaves(flax.core.unfreeze(reference)))
      if jnp.shape(new) != jnp.shape(old)
    ]
    mismatch = "; ".join(shapes) or None
  if mismatch is not None:
    raise ValueError(f"The {name} do not fit the train state's: {mismatch}.")


class TrainState(struct.PyTreeNode):
  """Params, optimizer state and other model variables, as in T5X.

  The equivalent of T5X's `FlaxOptimTrainState`. Build it with `create`; the
  logical axes of params and mutables are static metadata (not pytree
  leaves), so `jax.jit`, `jax.eval_shape` and a `Partitioner` see only the
  arrays.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from jax.sharding import PartitionSpec as P
    >>> from t5x_optim import optimizers
    >>> import flax.linen as nn
    >>> boxed = nn.LogicallyPartitioned(jnp.ones((2, 4)), ('embed', 'mlp'))
    >>> state = TrainState.create(optimizers.sgd(0.5), {'params': {'w': boxed}})
    >>> state = state.apply_gradient({'w': jnp.ones((2, 4))})
    >>> int(state.step), float(state.params['w'][0, 0])
    (1, 0.5)
    >>> state.as_logical_axes().params
    {'w': P('embed', 'mlp')}
  """

  _optimizer: Optimizer = struct.field(pytree_node=True)
  flax_mutables: dict[str, Any] = struct.field(pytree_node=True, default_factory=dict)
  param_axis_leaves: SpecLeaves | None = struct.field(pytree_node=False, default=None)
  mutable_axis_leaves: SpecLeaves | None = struct.field(pytree_node=False, default=None)

  @classmethod
  def create(cls, optimizer_def: OptimizerDef, model_variables: Mapping[str, Any]) -> TrainState:
    """Builds a train state from a model's variables (dicts or FrozenDicts).

    `params` may hold plain arrays or `nn.with_logical_partitioning` boxes
    (unboxed here, their axes kept), not `nn.with_partitioning` boxes, whose
    names are mesh axes. A T5X `params_axes` collection (from
    `flax.linen.partitioning.param_with_axes`) gives the params' axes; a
    `<collection>_axes` collection those of another collection. All other
    collections become `flax_mutables`. As in T5X, an optimizer definition
    with `set_param_axes` gets the params' axes and then requires them; they
    go to a copy (`with_param_axes`: the same copy for the same definition
    and axes), the state's ``optimizer.optimizer_def``, so the definition
    passed keeps its own.

    Args:
      optimizer_def: the optimizer definition.
      model_variables: the output of `Module.init`.

    Returns:
      The train state at step 0.

    Raises:
      ValueError: no `params` collection; an axes collection that does not
        match its collection (naming the paths); or an optimizer with
        `set_param_axes` and params without axes.
      TypeError: a `nn.with_partitioning` box (its names are mesh axes, not
        logical ones), naming its path; a flax ``nnx.State`` or
        ``nnx.Variable`` (pass ``nnx.to_pure_dict`` dicts), naming its path.
    """
    refuse(
      model_variables,
      "model_variables",
      "TrainState.create",
      how="pass {'params': nnx.to_pure_dict(state)}, each array boxed as "
      "nn.LogicallyPartitioned(array, names) where it has logical axes (the names of "
      "nnx.get_partition_spec(state))",
    )
    params, param_specs, mutables, mutable_specs = _split_variables(model_variables)
    if hasattr(optimizer_def, "set_param_axes"):
      if param_specs is None:
        raise ValueError(
          f"{type(optimizer_def).__name__} partitions by the params' logical axes "
          "(it has set_param_axes), but the model emits none: use "
          "param_with_axes or nn.with_logical_partitioning."
        )
      optimizer_def = with_param_axes(optimizer_def, _unflatten_like(params, param_specs))
    return cls(
      _optimizer=optimizer_def.create(params),
      flax_mutables=mutables,
      param_axis_leaves=param_specs,
      mutable_axis_leaves=mutable_specs,
    )

  @property
  def step(self) -> Any:
    """The step counter (an int32 scalar)."""
    return self._optimizer.state.step

  @property
  def params(self) -> Any:
    """The params (the optimizer's target)."""
    return self._optimizer.target

  @property
  def param_states(self) -> Any:
    """The optimizer's per-param state (e.g. the optax state)."""
    return self._optimizer.state.param_states

  @property
  def optimizer(self) -> Optimizer:
    """The `Optimizer` holding params and optimizer state."""
    return self._optimizer

  @property
  def params_axes(self) -> Any:
    """The params' logical specs in the params' structure (None: replicated)."""
    return _unflatten_like(self.params, self.param_axis_leaves)

  @property
  def flax_mutables_axes(self) -> Any:
    """The mutables' logical specs in their structure (None: replicated)."""
    return _unflatten_like(self.flax_mutables, self.mutable_axis_leaves)

  def apply_gradient(
    self,
    grads: Any,
    learning_rate: Any = None,
    *,
    flax_mutables: Mapping[str, Any] | None = None,
    **extra: Any,
  ) -> TrainState:
    """Applies `grads` and returns the new train state.

    Args:
      grads: gradients with the params' structure (dicts or FrozenDicts).
      learning_rate: T5X's learning-rate override, passed on as
        `learning_rate=` unless None.
      flax_mutables: the new mutable collections (e.g. updated batch
        statistics); None keeps the current ones.
      **extra: other hyper-parameter overrides or extra arguments of the
        update rule (e.g. optax's `value=`).

    Raises:
      ValueError: when `flax_mutables` does not have the structure of the
        current ones although their axes are known.
    """
    overrides = {} if learning_rate is None else {"learning_rate": learning_rate}
    state = self.replace(_optimizer=self._optimizer.apply_gradient(grads, **overrides, **extra))
    return state if flax_mutables is None else state.replace_flax_mutables(flax_mutables)

  def replace_params(self, params: Any) -> TrainState:
    """Returns the state with new params of the same structure and shapes.

    Raises:
      ValueError: naming each path where the structure or a shape differs (a
        param of another shape would broadcast against its moments at the next
        step).
    """
    params = flax.core.unfreeze(params)
    _check_structure(params, self.params, name="new params", reference_name="train state's params")
    return self.replace(_optimizer=self._optimizer.replace(target=params))

  def replace_step(self, step: Any) -> TrainState:
    """Returns the state with a new step counter."""
    state = self._optimizer.state.replace(step=step)
    return self.replace(_optimizer=self._optimizer.replace(state=state))

  def replace_flax_mutables(self, flax_mutables: Mapping[str, Any]) -> TrainState:
    """Returns the state with new mutable collections.

    Raises:
      ValueError: when their axes are known and the structure or a shape
        changes.
    """
    flax_mutables = flax.core.unfreeze(flax_mutables)
    if self.mutable_axis_leaves is not None:
      _check_structure(
        flax_mutables,
        self.flax_mutables,
        name="new flax_mutables",
        reference_name="train state's flax_mutables",
      )
    return self.replace(flax_mutables=flax_mutables)

  def state_dict(self) -> dict[str, Any]:
    """The T5X-layout state dict: the optimizer's, plus `flax_mutables` if any."""
    state_dict = self._optimizer.state_dict()
    if self.flax_mutables:
      state_dict[_FLAX_MUTABLES] = flax.serialization.to_state_dict(self.flax_mutables)
    return state_dict

  def restore_state(self, state_dict: Mapping[str, Any]) -> TrainState:
    """Returns a new state restored from a T5X-layout state dict.

    Raises:
      ValueError: on a missing or unexpected key, a shape mismatch or an
        unsafe dtype cast; the message names the path.
    """
    optimizer = self._optimizer.restore_state(state_dict)
    mutables = state_dict.get(_FLAX_MUTABLES, {})
    restored = _state_dict.restore_into(
      {_FLAX_MUTABLES: self.flax_mutables}, {_FLAX_MUTABLES: mutables}
    )
    return self.replace(_optimizer=optimizer, flax_mutables=restored[_FLAX_MUTABLES])

  def as_logical_axes(self) -> TrainState:
    """This state with every array replaced by its logical spec or None.

    Params get their axes, the optimizer state the specs its definition's
    `derive_logical_axes` gives, `step` None and the mutables their axes
    (None where unknown). The result has this state's pytree structure, as
    `Partitioner.get_mesh_axes` expects. State leaves without a valid spec
    are the definition's business: its own `fallback` setting (see
    `OptimizerDef`) decides, so nothing is passed here and definitions
    written for T5X, which have no such setting, work unchanged.
    """
    optimizer_def = self._optimizer.optimizer_def
    if not hasattr(optimizer_def, "derive_logical_axes"):
      raise ValueError(
        f"Optimizer '{type(optimizer_def).__name__}' has no derive_logical_axes method, "
        "which partitioning by logical axes needs."
      )
    optimizer = optimizer_def.derive_logical_axes(self._optimizer, self.params_axes)
    return self.replace(_optimizer=optimizer, flax_mutables=self.flax_mutables_axes)
