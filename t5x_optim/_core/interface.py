"""T5X's optimizer interface: `OptimizerState`, `Optimizer`, `OptimizerDef`."""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping
from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax
from flax import struct

from t5x_optim._axes.engine import StateRulesFallback
from t5x_optim._core import state_dict as _state_dict
from t5x_optim._keypaths import key_path_str, leaf_paths
from t5x_optim._nnx import nnx_kinds, refuse_non_params, to_pure

__all__ = ["Optimizer", "OptimizerDef", "OptimizerState", "trained_params"]


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
      grads: gradients with the target's structure, shapes and (real or
        complex) kind; dicts and FrozenDicts are interchangeable.
      **kwargs: hyper-parameter overrides (fields of the definition's
        `hyper_params`, e.g. T5X's `learning_rate=`, or `hyper_params=`), or
        extra arguments of the update rule the definition accepts
        (`OptimizerDef.extra_arg_names`, e.g. optax's `value=` for
        `reduce_on_plateau`).

    Raises:
      TypeError: for a keyword that is neither.
      ValueError: when `grads` does not fit the target, naming the paths and
        both sides; checked before anything runs (under `jax.jit` too).
    """
    overrides, extra_args = self.optimizer_def.split_apply_kwargs(kwargs)
    grads = self.optimizer_def.prepare_grads(self.target, grads)
    hyper_params = self.optimizer_def.update_hyper_params(**overrides)
    new_target, new_state = self.optimizer_def.apply_gradient(
      hyper_params, self.target, self.state, grads, **extra_args
    )
    return self.replace(target=new_target, state=new_state)

  def state_dict(self) -> dict[str, Any]:
    """The T5X-layout state dict: `{'target': ..., 'state': {...}}`."""
    return self.optimizer_def.state_dict(self.target, self.state)

  def restore_state(self, state: Mapping[str, Any]) -> Optimizer:
    """Returns a new optimizer restored from `state`; `self` is unchanged.

    `state` is a T5X-layout state dict; keys beside ``target`` and ``state``
    (a train state's ``flax_mutables``) are ignored, as T5X does. See
    `OptimizerDef.restore_state` for what is checked.
    """
    target, new_state = self.optimizer_def.restore_state(
      self.target, self.state, _state_dict.optimizer_part(state)
    )
    # A state dict may hold one array in two places (built by hand, or converted): each leaf
    # gets its own buffer, as `create` gives it, so that a jitted step may donate them all.
    target, new_state = own_buffers(target, new_state)
    return self.replace(target=target, state=new_state)


class OptimizerDef(abc.ABC):
  """Base class of optimizer definitions (T5X's `OptimizerDef` contract).

  Subclasses implement `init_state` and `apply_gradient`, and
  `derive_logical_axes` to be partitioned by logical axes (the base class
  has none, as in T5X, whose train state asks `hasattr` first). Definitions
  written against `t5x.optimizers` (T5X's legacy `Adafactor`, say) work
  unchanged. A definition whose `apply_gradient` takes extra keyword
  arguments lists their names in `extra_arg_names`.

  Args:
    hyper_params: the hyper-params struct (with `.replace`).
    fallback: what `derive_logical_axes` does with an optimizer-state leaf
      whose logical spec cannot be derived or does not fit it: replicate it
      and warn (the default), or raise naming the leaf's path and shape.
      Every adapter (optax, MultiOptimizer, example_libraries, K-FAC) takes
      it; `TrainState` and the partitioner call `derive_logical_axes`, so
      the definition's setting applies there too. Strings (`"raise"`) work,
      for gin.

  Example:
    >>> import optax
    >>> from t5x_optim import OptaxWrapper
    >>> OptaxWrapper(optax.sgd(0.1), fallback="raise").fallback
    <StateRulesFallback.RAISE: 'raise'>
  """

  extra_arg_names: frozenset[str] = frozenset()
  fallback: StateRulesFallback = StateRulesFallback.REPLICATE_WITH_WARNING

  def __init__(
    self,
    hyper_params: Any,
    *,
    fallback: StateRulesFallback | str = StateRulesFallback.REPLICATE_WITH_WARNING,
  ):
    self.hyper_params = hyper_params
    self.fallback = StateRulesFallback(fallback)

  @abc.abstractmethod
  def init_state(self, params: Any) -> OptimizerState:
    """Returns the initial state for `params`."""

  @abc.abstractmethod
  def apply_gradient(
    self, hyper_params: Any, params: Any, state: OptimizerState, grads: Any, **extra_args: Any
  ) -> tuple[Any, OptimizerState]:
    """Returns `(new_params, new_state)`."""

  def hyper_param_names(self) -> frozenset[str]:
    """The keywords `apply_gradient` treats as hyper-parameter overrides."""
    return _dataclass_hyper_param_names(self.hyper_params)

  def split_apply_kwargs(self, kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Splits `Optimizer.apply_gradient` keywords into overrides and extras.

    Raises:
      TypeError: for a keyword that is neither a hyper-parameter nor in
        `extra_arg_names`, listing the accepted ones.
    """
    names = self.hyper_param_names()
    unknown = sorted(set(kwargs) - names - self.extra_arg_names)
    if unknown:
      extras = sorted(self.extra_arg_names)
      raise TypeError(
        f"{type(self).__name__}.apply_gradient got unknown keyword arguments {unknown}; "
        f"it accepts the hyper-parameters {sorted(names)}"
        + (f" and the update's extra arguments {extras}." if extras else ".")
      )
    overrides = {k: v for k, v in kwargs.items() if k in names}
    extra_args = {k: v for k, v in kwargs.items() if k not in names}
    return overrides, extra_args

  def prepare_grads(self, params: Any, grads: Any) -> Any:
    """Checks `grads` against `params` and returns them as `apply_gradient` takes them.

    `Optimizer.apply_gradient` calls it once per step, before anything
    runs (under `jax.jit`, at trace time). Here the grads must have the
    params' structure, shapes and real or complex kind, and come back in the
    params' containers (dicts and FrozenDicts are interchangeable).
    Definitions whose grads have another form override it.

    Raises:
      ValueError: when `grads` does not fit, naming the paths and both sides.
    """
    check_grads(grads, params)
    return tree_like(grads, params)

  def update_hyper_params(self, **hyper_param_overrides: Any) -> Any:
    """Returns the hyper-params with overrides applied.

    `hyper_params=` replaces all of them; other keywords are `.replace`d.
    """
    hyper_params = hyper_param_overrides.pop("hyper_params", self.hyper_params)
    kind = type(self.hyper_params)
    if not isinstance(hyper_params, kind):
      raise TypeError(
        f"hyper_params= is {_article(kind.__name__)} {kind.__name__} (this optimizer's "
        f"`optimizer_def.hyper_params`, or its `.replace(...)`), not "
        f"{type(hyper_params).__name__} {hyper_params!r}."
      )
    if hyper_param_overrides:
      hyper_params = hyper_params.replace(**hyper_param_overrides)
    return hyper_params

  def create(self, target: Any) -> Optimizer:
    """Creates an `Optimizer` for `target` (the params).

    No two of its leaves share a device buffer (`own_buffers`), so a jitted step may donate
    it: lookahead's fast and slow params from ``optax.LookaheadParams.init_synced`` get two.
    Over params placed on one set of devices, the state's leaves made on no particular device
    (a step count, the moments of numpy params) are placed there too, replicated over a mesh
    (`on_params_mesh`).

    Raises:
      TypeError: `target` holds an ``nnx.Variable`` that is not an ``nnx.Param``
        (`_nnx.refuse_non_params`).
    """
    refuse_non_params(target, f"{type(self).__name__}.create")
    target, state = own_buffers(target, self.init_state(target))
    return Optimizer(optimizer_def=self, state=on_params_mesh(state, target), target=target)

  def state_dict(self, target: Any, state: OptimizerState) -> dict[str, Any]:
    """The T5X-layout state dict of `target` and `state`.

    `param_states` has every empty container removed, as T5X writes it.
    """
    return _state_dict.build_state_dict(
      target, state.step, _state_dict.to_pruned_state_dict(state.param_states)
    )

  def restore_state(
    self, opt_target: Any, opt_state: OptimizerState, state_dict: Mapping[str, Any]
  ) -> tuple[Any, OptimizerState]:
    """Restores `(target, state)` from a state dict, validating it first.

    T5X uses this as a tree replace as well as for arrays, so besides array
    data the leaves may be None, `PartitionSpec`s, `jax.ShapeDtypeStruct`s
    or lazy arrays, placed as given (`_state_dict.restore_into` has the
    rules). Keys beside ``target`` and ``state`` are ignored. Dtypes follow
    `_state_dict.leaf_fit`: floating params keep the state dict's floating
    dtype (T5X's ``restore_dtype``); optimizer-state arrays take the
    state's own dtypes; a float restores into an integer leaf (T5X's
    float32 step counters) only when every value is a whole number that
    fits; casts that change the kind otherwise (complex to real) or
    overflow are refused.

    Raises:
      ValueError: naming the path and both sides, on any missing or
        unexpected key, shape mismatch or unsafe dtype cast. The inputs are
        never modified.
    """
    target, step, param_states = _state_dict.restore_state_dict(
      opt_target, opt_state.step, opt_state.param_states, state_dict
    )
    return target, opt_state.replace(step=step, param_states=param_states)


_DEF_METHODS = (
  "init_state",
  "apply_gradient",
  "update_hyper_params",
  "state_dict",
  "restore_state",
)


def _buffers(leaf: Any) -> set[tuple[int, int]]:
  """The (device, address) of each device buffer of a concrete, live, non-empty array; none
  for anything else, or where the runtime does not give buffer addresses."""
  if (
    not isinstance(leaf, jax.Array)
    or isinstance(leaf, jax.core.Tracer)
    or leaf.is_deleted()
    or not leaf.size
  ):
    return set()
  try:
    return {
      (shard.device.id, shard.data.unsafe_buffer_pointer()) for shard in leaf.addressable_shards
    }
  except Exception:  # noqa: BLE001 - a runtime without addresses (a proxy) has none to compare.
    return set()


def on_params_mesh(state: Any, params: Any) -> Any:
  """``state`` with each leaf that jax placed on its default device, not asked to
  (`jax.Array.committed` False: an eagerly made step count, a GaLore projector, moments of
  numpy params), moved onto the devices of the params' placed arrays, where they are all on
  one set of this process's devices: onto that device, or replicated over a mesh of theirs.

  Such a leaf beside arrays on a mesh passes a jitted step, but a restore or a conversion
  that places it where it is commits it to that one device, which jax then refuses beside
  the mesh ("incompatible devices"). ``state`` as given where nothing moves.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> mesh = jax.make_mesh((1,), ('x',))
    >>> w = jax.device_put(jnp.ones(2), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('x')))
    >>> on_params_mesh({'count': jnp.zeros([])}, {'w': w})['count'].sharding.spec
    P()
  """
  arrays = [x for x in jax.tree.leaves(params) if isinstance(x, jax.Array)]
  if any(isinstance(x, jax.core.Tracer) for x in arrays):
    return state
  placed = [x.sharding for x in arrays if x.committed]
  if not placed or len({frozenset(s.device_set) for s in placed}) != 1:
    return state
  meshes = [s.mesh for s in placed if isinstance(getattr(s, "mesh", None), jax.sharding.Mesh)]
  if meshes:
    target = jax.sharding.NamedSharding(meshes[0], jax.sharding.PartitionSpec())
  else:
    target = jax.sharding.SingleDeviceSharding(next(iter(placed[0].device_set)))
  if not target.is_fully_addressable or target.num_devices != len(placed[0].device_set):
    return state
  leaves, treedef = jax.tree.flatten(state)
  loose = [
    isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and not x.committed
    for x in leaves
  ]
  if not any(loose):
    return state
  return treedef.unflatten(
    [jax.device_put(x, target) if move else x for x, move in zip(leaves, loose, strict=True)]
  )


def own_buffers(*trees: Any) -> tuple[Any, ...]:
  """`trees` with each array leaf that shares a device buffer with an earlier leaf (of the
  same tree or an earlier one) copied in its sharding, so a jitted step may donate them all.

  The first leaf in a buffer is kept, and a tree none of whose leaves is copied is returned
  as given (its dicts in their order).

  Example:
    >>> import jax.numpy as jnp
    >>> x = jnp.ones(3)
    >>> (a, b), c = own_buffers((x, x), {'w': x})
    >>> a is x, b is x, c['w'] is x, b.unsafe_buffer_pointer() != x.unsafe_buffer_pointer()
    (True, False, False, True)
  """
  seen: set[tuple[int, int]] = set()

  def own(leaf: Any) -> Any:
    buffers = _buffers(leaf)
    if not buffers.isdisjoint(seen):
      return jnp.array(leaf, copy=True)
    seen.update(buffers)
    return leaf

  owned = []
  for tree in trees:
    leaves, treedef = jax.tree.flatten(tree)
    copies = [own(leaf) for leaf in leaves]
    changed = any(new is not old for new, old in zip(copies, leaves, strict=True))
    owned.append(treedef.unflatten(copies) if changed else tree)
  return tuple(owned)


def missing_def_methods(opt_def: Any) -> list[str]:
  """What `opt_def` lacks of T5X's `OptimizerDef` interface (empty: it has it all).

  A definition is recognised by what it has, not by its base class: T5X's
  own `t5x.optimizers.OptimizerDef` subclasses (its legacy `Adafactor`, when
  T5X is installed beside this package) have the same methods as
  `OptimizerDef` and work wherever one is taken.

  Example:
    >>> import optax
    >>> from t5x_optim import OptaxWrapper
    >>> missing_def_methods(OptaxWrapper(optax.sgd(0.1))), missing_def_methods(optax.sgd(0.1))[:2]
    ([], ['hyper_params', 'init_state'])
  """
  missing = [] if hasattr(opt_def, "hyper_params") else ["hyper_params"]
  return missing + [name for name in _DEF_METHODS if not callable(getattr(opt_def, name, None))]


def _dataclass_hyper_param_names(hyper_params: Any) -> frozenset[str]:
  """``hyper_params`` and the fields of the hyper-params dataclass `hyper_params`."""
  names = {"hyper_params"}
  if dataclasses.is_dataclass(hyper_params):
    names.update(field.name for field in dataclasses.fields(hyper_params))
  return frozenset(names)


def hyper_param_names_of(opt_def: Any) -> frozenset[str]:
  """The keywords `opt_def.apply_gradient` treats as hyper-parameter overrides.

  The definition's own `hyper_param_names` where it has one (every
  `OptimizerDef`, and its overrides, `MultiOptimizer`'s among them); for
  T5X's own definitions, ``hyper_params`` and its dataclass's fields.
  """
  if callable(getattr(opt_def, "hyper_param_names", None)):
    return frozenset(opt_def.hyper_param_names())
  return _dataclass_hyper_param_names(opt_def.hyper_params)


def _article(word: str) -> str:
  return "an" if word[:1].lower() in "aeiou" else "a"


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


def structure_mismatch(
  value: Any, reference: Any, *, name: str, reference_name: str = "params"
) -> str | None:
  """Describes how `value`'s structure differs from `reference`'s, or None.

  The leaf paths only one side has; where both have the same leaves, the
  first container that differs (an empty dict, a list for a tuple). `name`
  and `reference_name` call the two sides in the description.

  Example:
    >>> structure_mismatch({'w': 1, 'e': {}}, {'w': 1}, name='grads')
    "at 'e': the grads have an empty dict, the params nothing"
  """
  value, reference = flax.core.unfreeze(value), flax.core.unfreeze(reference)
  value_def, ref_def = jax.tree.structure(value), jax.tree.structure(reference)
  if value_def == ref_def:
    return None
  value_paths, ref_paths = leaf_paths(value), leaf_paths(reference)
  if value_paths != ref_paths:
    return (
      f"paths only in the {name}: {sorted(value_paths - ref_paths)}; paths only in "
      f"the {reference_name}: {sorted(ref_paths - value_paths)}; {name} tree: {value_def}; "
      f"{reference_name} tree: {ref_def}"
    )
  where, have, want = _first_container_difference(value, reference, ())
  return f"at {where}: the {name} have {have}, the {reference_name} {want}"


def _container(x: Any) -> str:
  if isinstance(x, dict):
    return f"a dict of {len(x)}" if x else "an empty dict"
  if isinstance(x, list | tuple):
    kind = type(x).__name__
    return f"{_article(kind)} {kind} of {len(x)}" if x else f"an empty {kind}"
  if x is None:
    return "None"
  # Another node (flax's Partitioned, say) may differ in its metadata: its tree shows it.
  return f"{_article(type(x).__name__)} {type(x).__name__} {jax.tree.structure(x)}"


def _first_container_difference(value: Any, reference: Any, path: tuple) -> tuple[str, str, str]:
  """(where, value's node, reference's node) of the first node whose kind or keys differ."""
  where = f"'{key_path_str(path)}'" if path else "the root"
  same_kind = type(value) is type(reference)
  if same_kind and isinstance(value, dict) and set(value) == set(reference):
    children = [(key, value[key], reference[key]) for key in sorted(value, key=str)]
  elif same_kind and isinstance(value, list | tuple) and len(value) == len(reference):
    children = list(zip(range(len(value)), value, reference, strict=True))
  elif same_kind and isinstance(value, dict):
    for key in sorted(set(value) ^ set(reference), key=str):
      inner = f"'{key_path_str((*path, key))}'"
      return inner, _side(value, key), _side(reference, key)
  else:
    return where, _container(value), _container(reference)
  for key, a, b in children:
    if jax.tree.structure(a) != jax.tree.structure(b):
      return _first_container_difference(a, b, (*path, key))
  return where, _container(value), _container(reference)


def _side(node: dict, key: Any) -> str:
  return _container(node[key]) if key in node else "nothing"


def _kind(dtype: Any) -> str:
  return "complex" if jax.dtypes.issubdtype(dtype, jax.numpy.complexfloating) else "real"


def check_grads(grads: Any, params: Any) -> None:
  """Checks that `grads` fit `params`: structure, shapes and real/complex kind.

  Dicts and FrozenDicts are interchangeable. Under `jax.jit` the check runs at
  trace time (shapes are static).

  Raises:
    ValueError: naming the paths only one side has, or each leaf whose shape
      or kind differs, with both sides; where only one side holds flax NNX
      objects (an ``nnx.State``, bare Variables) where the other holds their
      pure form at the same paths, saying where and what to pass.

  Example:
    >>> import jax.numpy as jnp
    >>> check_grads({"w": jnp.ones(2)}, {"w": jnp.zeros(2)})
  """
  mismatch = structure_mismatch(grads, params, name="grads")
  if mismatch is not None:
    raise ValueError(f"The grads do not fit the params: {_nnx_form(grads, params) or mismatch}.")
  flat_params = jax.tree.flatten_with_path(flax.core.unfreeze(params))[0]
  bad = []
  for (path, param), grad in zip(flat_params, jax.tree.leaves(flax.core.unfreeze(grads))):
    grad_shape, param_shape = jax.numpy.shape(grad), jax.numpy.shape(param)
    grad_kind = _kind(jax.numpy.result_type(grad))
    param_kind = _kind(jax.numpy.result_type(param))
    if grad_shape != param_shape or (grad_kind == "complex" and param_kind == "real"):
      bad.append(
        f"'{key_path_str(path)}': grads {grad_kind} {grad_shape}, params {param_kind} {param_shape}"
      )
  if bad:
    leaves = "leaf" if len(bad) == 1 else "leaves"
    raise ValueError(f"The grads do not fit the params at {len(bad)} {leaves}: {'; '.join(bad)}.")


def _nnx_form(grads: Any, params: Any) -> str | None:
  """How `grads` and `params` differ when only one side holds flax NNX nodes at paths where
  the other holds their pure form (an ``nnx.State``'s ``nnx.to_pure_dict``, a Variable's
  value), with what to pass; else None.

  Example:
    >>> _nnx_form({"w": 1.0}, {"w": 2.0}) is None
    True
  """
  grads_kinds, params_kinds = nnx_kinds(grads), nnx_kinds(params)
  if bool(grads_kinds) == bool(params_kinds):
    return None
  if structure_mismatch(to_pure(grads), to_pure(params), name="grads") is not None:
    return None
  if params_kinds:
    return _nnx_advice("params", "grads", params_kinds)
  return _nnx_advice("grads", "params", grads_kinds)


def _nnx_advice(side: str, other: str, kinds: Mapping[str, str]) -> str:
  """What to pass where `side` (grads or params) holds the NNX objects `kinds` (by path,
  `nnx_kinds`) and `other` their pure form, at the same paths.

  Example:
    >>> _nnx_advice("grads", "params", {"a": "State"})
    "the grads hold an nnx.State at 'a' and the params a pure dict there, at the same paths: replace the nnx.State at 'a' in the grads with nnx.to_pure_dict of it, or create the optimizer over params with the nnx.State there"
  """
  if dict(kinds) == {"<root>": "State"}:
    fix = {
      "grads": "pass nnx.to_pure_dict(grads), or create the optimizer over the nnx.State",
      "params": "pass the grads as an nnx.State (nnx.grad, or jax.grad with respect to the "
      "State), or create the optimizer over nnx.to_pure_dict(state)",
    }[side]
    return f"the {side} are an nnx.State and the {other} a pure dict of the same paths: {fix}"
  states = ", ".join(f"'{path}'" for path, kind in kinds.items() if kind == "State")
  variables = ", ".join(f"'{path}'" for path, kind in kinds.items() if kind == "Variable")
  held, fixes = [], []
  if states:
    held.append(f"an nnx.State at {states}")
    fixes.append(
      {
        "grads": f"replace the nnx.State at {states} in the grads with nnx.to_pure_dict of it, "
        "or create the optimizer over params with the nnx.State there",
        "params": f"replace the pure dict at {states} in the grads with an nnx.State (nnx.grad, "
        "or jax.grad with respect to the State), or create the optimizer over params with "
        "nnx.to_pure_dict of the nnx.State there",
      }[side]
    )
  if variables:
    held.append(f"nnx.Variables at {variables}")
    fixes.append(
      {
        "grads": f"unwrap the Variables at {variables} in the grads (each to its value)",
        "params": f"wrap the grads at {variables} in the same Variables, or create the "
        "optimizer over the Variables' values",
      }[side]
    )
  return (
    f"the {side} hold {' and '.join(held)} and the {other} "
    f"{'a pure dict' if not variables else 'plain values'} there, at the same paths: "
    f"{'; '.join(fixes)}"
  )


def trained_params(params: Any) -> Any:
  """The params a loss is computed with: the fast copy of `optax.LookaheadParams`, else ``params``.

  Example:
    >>> trained_params(optax.LookaheadParams(fast={'w': 1.0}, slow={'w': 0.0}))
    {'w': 1.0}
    >>> trained_params({'w': 1.0})
    {'w': 1.0}
  """
  return params.fast if isinstance(params, optax.LookaheadParams) else params
