"""`MultiOptimizer`: different optimizer definitions for subsets of the params.

Each `(traversal, optimizer_def)` pair owns the params its traversal selects.
A sub-optimizer sees its params as a tree with the params' nesting that holds
only the selected leaves, and keeps its own `OptimizerState`. Params that no
traversal selects are frozen: they never change and have no state.

A traversal is a `PathFilter` (regexes searched in the '/'-joined param path,
gin-friendly), a regex or list of regexes (shorthand for a `PathFilter`), or a
`flax.traverse_util.ModelParamTraversal` (T5X configs; its filter gets the
path with a leading '/' and the param's value).

State layout. In memory, `param_states` is a tuple with one sub-optimizer
`OptimizerState` per pair, in constructor order. The state dict has one of
two layouts, chosen from the sub-optimizers' states:

* T5X's, when every sub-optimizer keeps one state subtree per param (T5X's
  legacy `Adafactor` and other per-param `OptimizerDef`s): one tree over all
  params, each sub-optimizer filling its own paths and frozen params None,
  so checkpoints move between T5X's `MultiOptimizer` and this one::

    {'target': <all params>,
     'state': {'step': <int32 scalar>,
               'param_states': {'dense': {'kernel': <kernel's state>,
                                          'bias': <bias's state>},
                                'frozen': None}}}

* otherwise (optax sub-optimizers, whose states are not per param, which
  T5X's layout cannot express), each sub-optimizer's own state dict (the
  ``'state'`` part of what its `state_dict` returns, so T5X's layout inside)
  under its index::

    {'target': <all params, nested dicts>,
     'state': {'step': <int32 scalar>,
               'param_states': {'0': {'step': ..., 'param_states': ...},
                                '1': {'step': ..., 'param_states': ...}}}}

  For `MultiOptimizer([(kernels, adam), (biases, sgd)])` the flattened keys
  are `state/step`, `state/param_states/0/step`,
  `state/param_states/0/param_states/0/mu/dense/kernel`, ...,
  `state/param_states/1/step`, ...; frozen params appear only under
  `target`.
"""

from __future__ import annotations

import copy
import functools
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
from flax import serialization, traverse_util

from t5x_optim._adapters.param_subsets import (
  Partition,
  PathFilter,
  Traversal,
  as_traversal,
  describe_traversal,
  format_paths,
  is_none,
  subset,
  traversal_mask,
)
from t5x_optim._axes.engine import StateRulesFallback, logical_axes_from
from t5x_optim._axes.kernel_axes import AxesKey, axes_key
from t5x_optim._axes.rules import is_spec_leaf
from t5x_optim._core import state_dict as _state_dict
from t5x_optim._core.interface import (
  Optimizer,
  OptimizerDef,
  OptimizerState,
  hyper_param_names_of,
  missing_def_methods,
)
from t5x_optim._keypaths import key_path_str
from t5x_optim._nnx import refuse
from t5x_optim._warn import warn

__all__ = ["MultiOptimizer", "PathFilter"]


def _own_copy(value: Any) -> Any:
  """A copy of array data (a jax array keeps its sharding); placeholders as they are."""
  if isinstance(value, jax.Array):
    return jnp.copy(value)
  if isinstance(value, np.ndarray | np.generic):
    return np.copy(value)
  return value


def _extra_arg_names(opt_def: Any) -> frozenset[str]:
  """The update's extra keywords `opt_def` takes (none for T5X's own definitions)."""
  return frozenset(getattr(opt_def, "extra_arg_names", ()))


def _with_context(error: Exception, context: str) -> Exception:
  kind = ValueError if isinstance(error, ValueError) else TypeError
  return kind(f"{context}: {error}")


def _of_own_params(
  fn: Callable[..., Any], partition: Partition, leaves: list[Any], i: int
) -> Callable[..., Any]:
  """`fn` of the whole params (whose leaves are `leaves`) as a function of sub-optimizer `i`'s,
  the others held at their values; its signature is `fn`'s, which optax's line searches read."""

  @functools.wraps(fn)
  def of_own(own_params: Any, *args: Any, **kwargs: Any) -> Any:
    subtrees = partition.split(leaves)
    subtrees[i] = own_params
    return fn(partition.merge(leaves, subtrees), *args, **kwargs)

  return of_own


class MultiOptimizer(OptimizerDef):
  """Applies a different optimizer definition to each subset of the params.

  Args:
    traversals_and_optimizers: `(traversal, optimizer_def)` pairs. A
      traversal is a `PathFilter`, a regex or list of regexes (made into a
      `PathFilter`), or a `flax.traverse_util.ModelParamTraversal`.
    fallback: `OptimizerDef`'s setting for state leaves without a valid
      spec. None (the default) keeps each sub-optimizer's own setting; a
      value overrides every sub-optimizer's in `derive_logical_axes` (the
      sub-optimizers themselves are not changed).

  Hyper-parameter overrides passed to `Optimizer.apply_gradient` (e.g. T5X's
  `learning_rate=`) go to every sub-optimizer that has a hyper-parameter of
  that name; `hyper_params=` takes one hyper-params object per sub-optimizer.
  Other keywords (e.g. optax's `value=`) go to every sub-optimizer whose
  `extra_arg_names` has them, of its own params: optax's `grad=` split as the
  grads are, `value_fn=` and `obj_fn=` as functions of its params alone (the
  others held at their values), so that a line search searches its own.
  `set_param_axes` exists only when a sub-optimizer defines it (T5X then
  requires a `params_axes` collection).

  The split of leaves between sub-optimizers is computed once per params tree
  structure. Filters of flax traversals see the leaf values (arrays or
  tracers) and must depend on nothing but their shapes and dtypes.

  A traversal that selects no params is allowed, as in T5X, with a warning;
  its sub-optimizer gets an empty tree. See the module docstring for the two
  state-dict layouts.

  Raises:
    ValueError: when a param is selected by more than one traversal (the
      message lists those paths); checked on the first params seen.
    TypeError: when the params hold a flax NNX state: pass its
      ``nnx.to_pure_dict``.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from t5x_optim import OptaxWrapper
    >>> opt_def = MultiOptimizer([
    ...     (PathFilter('kernel$'), OptaxWrapper(optax.adam(1e-3))),
    ...     (PathFilter('bias$'), OptaxWrapper(optax.sgd(0.1))),
    ... ])
    >>> params = {'dense': {'kernel': jnp.ones((2, 2)), 'bias': jnp.ones(2)},
    ...           'embed': jnp.ones(3)}
    >>> opt = opt_def.create(params).apply_gradient(jax.tree.map(jnp.ones_like, params))
    >>> opt.target['dense']['bias'], opt.target['embed']
    (Array([0.9, 0.9], dtype=float32), Array([1., 1., 1.], dtype=float32))
  """

  def __init__(
    self,
    traversals_and_optimizers: Sequence[tuple[Traversal, OptimizerDef]],
    *,
    fallback: StateRulesFallback | str | None = None,
  ):
    pairs = list(traversals_and_optimizers)
    if not pairs:
      raise ValueError("MultiOptimizer needs at least one (traversal, optimizer_def) pair.")
    self.traversals = tuple(as_traversal(t, i) for i, (t, _) in enumerate(pairs))
    self.sub_optimizers = tuple(opt_def for _, opt_def in pairs)
    for i, opt_def in enumerate(self.sub_optimizers):
      missing = missing_def_methods(opt_def)
      if missing:
        raise TypeError(
          f"The optimizer of pair {i} is a {type(opt_def).__name__}, not an OptimizerDef "
          f"(it has no {', '.join(missing)}); wrap optax transformations in OptaxWrapper "
          "(or use t5x_optim.optimizers)."
        )
    self.extra_arg_names = frozenset().union(*map(_extra_arg_names, self.sub_optimizers))
    self._path_only = all(isinstance(t, PathFilter) for t in self.traversals)
    self._partitions: dict[Any, Partition] = {}
    if any(hasattr(opt, "set_param_axes") for opt in self.sub_optimizers):
      self.set_param_axes = self._set_param_axes
    super().__init__(hyper_params=tuple(opt.hyper_params for opt in self.sub_optimizers))
    self.fallback = None if fallback is None else StateRulesFallback(fallback)

  def __copy__(self) -> MultiOptimizer:
    """A copy whose sub-optimizers are copies too (one shared by two filters stays shared),
    so axes given to it leave this definition's as they are."""
    return _copied_def(self, {})

  def __repr__(self) -> str:
    pairs = ", ".join(
      f"({describe_traversal(i, t)}, {type(o).__name__})"
      for i, (t, o) in enumerate(zip(self.traversals, self.sub_optimizers))
    )
    return f"MultiOptimizer([{pairs}])"

  def _compute_partition(self, tree: Any) -> Partition:
    """Splits `tree`'s leaves between the traversals and checks the split.

    None leaves (replicated axes, absent values) count as leaves.
    """
    path_leaves, treedef = jax.tree.flatten_with_path(tree, is_leaf=is_none)
    keys = [_state_dict.key_path_parts(path) for path, _ in path_leaves]
    paths = ["/".join(key) for key in keys]
    masks = [
      [t.matches(p) for p in paths] if isinstance(t, PathFilter) else traversal_mask(t, keys, tree)
      for t in self.traversals
    ]
    owners: list[list[int]] = [[] for _ in paths]
    for i, mask in enumerate(masks):
      for j, selected in enumerate(mask):
        if selected:
          owners[j].append(i)
    overlaps = [f"{paths[j]} (filters {owner})" for j, owner in enumerate(owners) if len(owner) > 1]
    if overlaps:
      raise ValueError(
        f"MultiOptimizer filters overlap: {len(overlaps)} params are selected by more "
        f"than one filter: {format_paths(overlaps)}. Filters: "
        f"{[describe_traversal(i, t) for i, t in enumerate(self.traversals)]}."
      )
    groups = [tuple(j for j in range(len(paths)) if owners[j] == [i]) for i in range(len(masks))]
    for i, group in enumerate(groups):
      if not group:
        warn(
          f"MultiOptimizer {describe_traversal(i, self.traversals[i])} selects no params, so its "
          "optimizer gets an empty tree; "
          + (f"the params are {format_paths(paths)}." if paths else "the params tree is empty.")
        )
    index_tree = treedef.unflatten(range(len(paths)))
    subtrees = [subset(index_tree, frozenset(group), ()) for group in groups]
    return Partition(
      treedef=treedef,
      plain_treedef=jax.tree.structure(flax.core.unfreeze(index_tree)),
      groups=tuple(tuple(jax.tree.leaves(s)) for s in subtrees),
      sub_treedefs=tuple(jax.tree.structure(s) for s in subtrees),
    )

  def _partition(self, params: Any) -> tuple[Partition, list[Any]]:
    """The (cached) partition for `params`' structure and `params`' leaves."""
    leaves, treedef = jax.tree.flatten(params, is_leaf=is_none)
    key = treedef
    if not self._path_only:
      key = (treedef, tuple(_signature(x) for x in leaves))
    partition = self._partitions.get(key)
    if partition is None:
      partition = self._partitions[key] = self._compute_partition(params)
    return partition, leaves

  def hyper_param_names(self) -> frozenset[str]:
    names = set().union(*map(hyper_param_names_of, self.sub_optimizers))
    return frozenset(names | {"hyper_params"})

  def update_hyper_params(self, **hyper_param_overrides: Any) -> tuple[Any, ...]:
    """Returns one hyper-params object per sub-optimizer, overrides applied.

    `hyper_params=` gives one hyper-params object per sub-optimizer; any
    other keyword goes to each sub-optimizer that has a hyper-parameter of
    that name.

    Raises:
      ValueError: when `hyper_params` has the wrong length.
      TypeError: when `hyper_params` is not a list or tuple.
      TypeError: for a keyword no sub-optimizer knows.
    """
    hyper_params = hyper_param_overrides.pop("hyper_params", self.hyper_params)
    if not isinstance(hyper_params, list | tuple):
      raise TypeError(
        f"hyper_params= is a list or tuple with one entry per sub-optimizer "
        f"({len(self.sub_optimizers)}), not {type(hyper_params).__name__} {hyper_params!r}."
      )
    if len(hyper_params) != len(self.sub_optimizers):
      raise ValueError(
        f"hyper_params= needs one entry per sub-optimizer ({len(self.sub_optimizers)}), "
        f"got {len(hyper_params)}."
      )
    unknown = sorted(set(hyper_param_overrides) - self.hyper_param_names())
    if unknown:
      raise TypeError(f"No sub-optimizer of the MultiOptimizer has hyper-parameters {unknown}.")
    updated = []
    for opt, hp in zip(self.sub_optimizers, hyper_params):
      names = hyper_param_names_of(opt)
      overrides = {k: v for k, v in hyper_param_overrides.items() if k in names}
      updated.append(opt.update_hyper_params(hyper_params=hp, **overrides))
    return tuple(updated)

  def init_state(self, params: Any) -> OptimizerState:
    refuse(params, "params", "MultiOptimizer")
    partition, leaves = self._partition(params)
    sub_states = tuple(
      opt.init_state(sub_params)
      for opt, sub_params in zip(self.sub_optimizers, partition.split(leaves))
    )
    return OptimizerState(step=jnp.zeros((), jnp.int32), param_states=sub_states)

  def apply_gradient(
    self,
    hyper_params: Sequence[Any],
    params: Any,
    state: OptimizerState,
    grads: Any,
    **extra_args: Any,
  ) -> tuple[Any, OptimizerState]:
    partition, leaves = self._partition(params)
    grad_leaves = partition.leaves_of(grads, name="grads", reference=params)
    new_subtrees, new_states = [], []
    for i, (opt, hp, sub_state, sub_params, sub_grads) in enumerate(
      zip(
        self.sub_optimizers,
        hyper_params,
        state.param_states,
        partition.split(leaves),
        partition.split(grad_leaves),
      )
    ):
      extras = self._own_extra_args(extra_args, params, partition, leaves, i)
      # As T5X's: each sub-optimizer steps at this optimizer's step (`TrainState.replace_step`
      # sets that one alone).
      sub_state = sub_state.replace(step=state.step)
      try:
        new_params, new_state = opt.apply_gradient(hp, sub_params, sub_state, sub_grads, **extras)
      except (TypeError, ValueError) as error:
        context = f"MultiOptimizer sub-optimizer {i} ({describe_traversal(i, self.traversals[i])})"
        raise _with_context(error, context) from error
      new_subtrees.append(new_params)
      new_states.append(new_state)
    new_target = partition.merge(leaves, new_subtrees)
    return new_target, OptimizerState(step=state.step + 1, param_states=tuple(new_states))

  def _own_extra_args(
    self, extra_args: Mapping[str, Any], params: Any, partition: Partition, leaves: list, i: int
  ) -> dict[str, Any]:
    """The extra arguments sub-optimizer `i` takes, of its own params (`partition` and
    `leaves` are `params`', from `_partition`).

    optax's ``grad`` (a tree like the params) is split as the grads are; ``value_fn`` and
    ``obj_fn`` (functions of the params) become functions of sub-optimizer `i`'s params,
    the others held at their values, with the signature a line search reads; others
    (``value``, a user's own) are passed as given.
    """
    own = {}
    for name, value in extra_args.items():
      if name not in _extra_arg_names(self.sub_optimizers[i]):
        continue
      if name == "grad":
        value = partition.split(partition.leaves_of(value, name="grad", reference=params))[i]
      elif name in ("value_fn", "obj_fn") and callable(value):
        value = _of_own_params(value, partition, leaves, i)
      own[name] = value
    return own

  def _sub_targets(self, target: Any) -> list[Any]:
    partition, leaves = self._partition(target)
    return partition.split(leaves)

  @staticmethod
  def _param_states_dict(
    target: Any,
    sub_targets: Sequence[Any],
    sub_dicts: Sequence[Mapping[str, Any]],
    *,
    per_param: bool,
  ) -> dict[str, Any]:
    """The state dict's `param_states`: T5X's layout if `per_param`, else indexed."""
    if not per_param:
      return {str(i): sub_dict for i, sub_dict in enumerate(sub_dicts)}
    flat = {path: None for path in _param_paths(target)}
    for sub_target, sub_dict in zip(sub_targets, sub_dicts):
      for path in _param_paths(sub_target):
        flat[path] = _get(sub_dict.get("param_states", {}), path)
    return traverse_util.unflatten_dict(flat)

  def _per_param(
    self,
    sub_targets: Sequence[Any],
    sub_states: Sequence[Any],
    sub_dicts: Sequence[Mapping[str, Any]],
  ) -> bool:
    """Whether every sub-optimizer keeps one state subtree per param.

    Decided on the states themselves (`keeps_per_param_states`), never on
    the keys of their state dicts, which params named ``'0'``, ``'1'``
    make look like an optax state's.
    """
    return all(
      keeps_per_param_states(opt, sub_target, sub_state, sub_dict)
      for opt, sub_target, sub_state, sub_dict in zip(
        self.sub_optimizers, sub_targets, sub_states, sub_dicts
      )
    )

  def _sub_state_dicts(self, sub_targets: Sequence[Any], state: OptimizerState) -> list[Any]:
    return [
      opt.state_dict(sub_target, sub_state)["state"]
      for opt, sub_target, sub_state in zip(self.sub_optimizers, sub_targets, state.param_states)
    ]

  def _layout(self, target: Any, state: OptimizerState) -> tuple[list[Any], bool, dict[str, Any]]:
    """The sub-targets, whether the layout is per param, and `param_states` in it."""
    sub_targets = self._sub_targets(target)
    sub_dicts = self._sub_state_dicts(sub_targets, state)
    per_param = self._per_param(sub_targets, state.param_states, sub_dicts)
    param_states = self._param_states_dict(target, sub_targets, sub_dicts, per_param=per_param)
    return sub_targets, per_param, param_states

  def state_dict(self, target: Any, state: OptimizerState) -> dict[str, Any]:
    """The state dict; see the module docstring for its two layouts."""
    _, _, param_states = self._layout(target, state)
    return _state_dict.build_state_dict(target, state.step, param_states)

  def restore_state(
    self, opt_target: Any, opt_state: OptimizerState, state_dict: Mapping[str, Any]
  ) -> tuple[Any, OptimizerState]:
    """Restores `(target, state)` from a state dict in either layout.

    The layout is the one `state_dict` gives for this optimizer. The whole
    state dict is validated (against this optimizer's own state dict)
    before any sub-optimizer restores its part; T5X's placeholders (None,
    specs, abstract and lazy arrays) are placed as `OptimizerDef.restore_state`
    places them.

    Raises:
      ValueError: naming the full path and both sides, on a missing or
        unexpected key, shape mismatch or unsafe dtype cast. The inputs are
        never modified.
    """
    sub_targets, per_param, reference = self._layout(opt_target, opt_state)
    target, step, param_states = _state_dict.restore_state_dict(
      opt_target, opt_state.step, reference, state_dict
    )
    restored_states = []
    for i, (opt, ref_target, sub_state, new_target) in enumerate(
      zip(self.sub_optimizers, sub_targets, opt_state.param_states, self._sub_targets(target))
    ):
      if per_param:
        sub_states = _pick(param_states, _param_paths(ref_target))
        # Each sub-optimizer counts in an array of its own: one buffer in two
        # places of a train state cannot be donated to a jitted step.
        sub_states = {"step": _own_copy(step), "param_states": sub_states}
        where = "its params' paths under 'state/param_states'"
      else:
        sub_states = param_states[str(i)]
        where = f"'state/param_states/{i}'"
      sub_dict = {"target": serialization.to_state_dict(new_target), "state": sub_states}
      try:
        _, restored = opt.restore_state(ref_target, sub_state, sub_dict)
      except ValueError as error:
        raise ValueError(
          f"Restoring sub-optimizer {i} (its state dict is at {where}): {error}"
        ) from error
      restored_states.append(restored)
    return target, OptimizerState(step=step, param_states=tuple(restored_states))

  def derive_logical_axes(self, optimizer: Optimizer, param_logical_axes: Any) -> Optimizer:
    """Each sub-optimizer's logical axes, derived on its subset of the params.

    The target becomes the params' logical axes and `step` None;
    `param_states` holds each sub-optimizer's derived state. Frozen params
    have no state, so they appear only in the target. Each sub-optimizer's
    leaves without a valid spec go to its own `fallback`, or to this one's
    when it is set.
    """
    partition, leaves = self._partition(optimizer.target)
    axes = logical_axes_from(param_logical_axes)
    axes_leaves = partition.leaves_of(axes, name="param logical axes", reference=optimizer.target)
    sub_states = []
    for opt, sub_target, sub_axes, sub_state in zip(
      self.sub_optimizers,
      partition.split(leaves),
      partition.split(axes_leaves),
      optimizer.state.param_states,
    ):
      opt = self._with_fallback(opt)
      sub_optimizer = Optimizer(optimizer_def=opt, state=sub_state, target=sub_target)
      sub_states.append(opt.derive_logical_axes(sub_optimizer, sub_axes).state)
    return optimizer.replace(
      target=partition.treedef.unflatten(axes_leaves),
      state=OptimizerState(step=None, param_states=tuple(sub_states)),
    )

  def _with_fallback(self, opt: OptimizerDef) -> OptimizerDef:
    """`opt`, or a shallow copy of it with this definition's `fallback` if set.

    A sub-optimizer without the setting (a T5X-style legacy definition) is
    left as it is: it derives its axes its own way.
    """
    if self.fallback is None or getattr(opt, "fallback", self.fallback) is self.fallback:
      return opt
    overridden = copy.copy(opt)
    overridden.fallback = self.fallback
    return overridden

  def describe_params(self, params: Any) -> list[str]:
    """One line per param: the filter and sub-optimizer that update it, or ``frozen [no
    filter]``.

    A sub-optimizer that places its params by their logical axes (``muon``
    after `set_param_axes`) says where each of its params goes, and a nested
    `MultiOptimizer` names its own filters and sub-optimizers; the others
    are named by their class.

    Raises:
      ValueError: as the split of `params` between the filters.
    """
    partition, leaves = self._partition(params)
    lines = []
    for i, (opt, subtree) in enumerate(zip(self.sub_optimizers, partition.split(leaves))):
      where = describe_traversal(i, self.traversals[i])
      if isinstance(opt, MultiOptimizer) or getattr(opt, "param_specs", None) is not None:
        lines += [f"{line} [{where}]" for line in opt.describe_params(subtree)]
      else:
        paths = jax.tree.flatten_with_path(subtree, is_leaf=is_none)[0]
        lines += [f"{key_path_str(path)}: {type(opt).__name__} [{where}]" for path, _ in paths]
    selected = {j for group in partition.groups for j in group}
    paths = jax.tree.flatten_with_path(params, is_leaf=is_none)[0]
    lines += [
      f"{key_path_str(path)}: frozen [no filter]"
      for j, (path, _) in enumerate(paths)
      if j not in selected
    ]
    return sorted(lines)

  def _takers_of_axes(self, within: str = "") -> list[tuple[str, OptimizerDef]]:
    """``(filters, definition)`` of each sub-optimizer, a nested `MultiOptimizer`'s
    included, that defines `set_param_axes`; a nested one's filters after its own."""
    found = []
    for i, (traversal, opt) in enumerate(zip(self.traversals, self.sub_optimizers)):
      where = within + describe_traversal(i, traversal)
      if isinstance(opt, MultiOptimizer):
        found += opt._takers_of_axes(f"{where} / ")
      elif hasattr(opt, "set_param_axes"):
        found.append((where, opt))
    return found

  def _set_param_axes(self, param_logical_axes: Any) -> None:
    """Gives each sub-optimizer that defines `set_param_axes` its axes.

    The split is computed on the axes tree itself; filters of flax
    traversals see the `PartitionSpec` as the value (an empty one for None).

    Raises:
      ValueError: one such definition under two filters (nested ones'
        included), whose axes would replace each other's, naming both.
    """
    taken: dict[int, str] = {}
    for where, opt in self._takers_of_axes():
      first = taken.setdefault(id(opt), where)
      if first != where:
        raise ValueError(
          f"MultiOptimizer: {first} and {where} share one {type(opt).__name__}, which places "
          "its params by their logical axes: each filter's axes would replace the other's. "
          "Build one definition per filter (call its factory, optimizers.muon(...) say, once for "
          "each)."
        )
    axes = logical_axes_from(param_logical_axes)
    specs = jax.tree.map(_spec_or_replicated, axes, is_leaf=is_spec_leaf)
    partition = self._compute_partition(specs)
    leaves = jax.tree.leaves(axes, is_leaf=is_spec_leaf)
    for opt, sub_axes in zip(self.sub_optimizers, partition.split(leaves)):
      if hasattr(opt, "set_param_axes"):
        opt.set_param_axes(sub_axes)


_AXES_COPIES: dict[int, tuple[weakref.ref[OptimizerDef], dict[AxesKey, OptimizerDef]]] = {}
"""`with_param_axes`'s copies by the identity of their definition (one may compare by value
and be unhashable): ``{id(definition): (weak reference to it, {axes_key: copy})}``, an entry
dropped when its definition is collected."""


def _copies_of(opt_def: OptimizerDef) -> dict[AxesKey, OptimizerDef]:
  """`with_param_axes`'s copies of `opt_def` by their axes."""
  key = id(opt_def)
  entry = _AXES_COPIES.get(key)
  if entry is None or entry[0]() is not opt_def:
    ref = weakref.ref(opt_def, lambda _: _AXES_COPIES.pop(key, None))
    entry = _AXES_COPIES[key] = (ref, {})
  return entry[1]


def with_param_axes(opt_def: OptimizerDef, param_logical_axes: Any) -> OptimizerDef:
  """A copy of `opt_def` given the params' logical axes, or `opt_def` if it takes none.

  A definition that places its params by their axes (``set_param_axes``:
  Muon's, or a `MultiOptimizer` with such a sub-optimizer) gets them on a
  copy, a `MultiOptimizer`'s sub-optimizers copied too (one shared by two
  filters stays shared), so the caller's definitions keep their own axes.
  The same definition and axes give the same copy: an optimizer's definition
  is a static field, so the states made from it are one pytree structure
  (the shardings of one fit another, a step jitted for one runs the other).
  """
  if not hasattr(opt_def, "set_param_axes"):
    return opt_def
  copies = _copies_of(opt_def)
  key = axes_key(param_logical_axes)
  copied = copies.get(key)
  if copied is None:
    copied = copies[key] = _copied_def(opt_def, {})
  copied.set_param_axes(param_logical_axes)
  return copied


def _copied_def(opt_def: OptimizerDef, copies: dict[int, OptimizerDef]) -> OptimizerDef:
  """A shallow copy of `opt_def`; a `MultiOptimizer`'s own copies its sub-optimizers
  (`copies`: those copied so far, by id) and takes its axes itself."""
  if id(opt_def) in copies:
    return copies[id(opt_def)]
  if not isinstance(opt_def, MultiOptimizer):
    copied = copies[id(opt_def)] = copy.copy(opt_def)
    return copied
  copied = copies[id(opt_def)] = object.__new__(type(opt_def))
  copied.__dict__.update(opt_def.__dict__)
  copied.sub_optimizers = tuple(_copied_def(opt, copies) for opt in opt_def.sub_optimizers)
  if hasattr(opt_def, "set_param_axes"):
    copied.set_param_axes = copied._set_param_axes
  return copied


def _is_param_subtree_prefix(target: Any, param_states: Any) -> bool:
  """Whether `param_states` has `target`'s tree structure down to its leaves.

  Containers are compared as nested dicts (a FrozenDict target and a dict
  state agree); a param's subtree may be anything, None included.
  """
  treedef = jax.tree.structure(flax.core.unfreeze(target), is_leaf=is_none)
  try:
    treedef.flatten_up_to(flax.core.unfreeze(param_states))
  except (ValueError, TypeError):
    return False
  return True


def keeps_per_param_states(
  opt_def: Any, target: Any, state: Any, state_dict: Mapping[str, Any]
) -> bool:
  """Whether `opt_def`'s state over `target` is one subtree per param (T5X's layout).

  True when its in-memory `param_states` has the params' tree structure down
  to each param (T5X's legacy `Adafactor`) or, for a nested
  `MultiOptimizer`, when it writes T5X's layout itself; and when its state
  dict's ``param_states`` has a subtree at every param path. An optax state
  (a tuple of NamedTuples) never qualifies, whatever the params are named.
  A sub-optimizer without params qualifies when it has no state.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from t5x_optim import OptaxWrapper
    >>> params = {'0': jnp.ones(2)}
    >>> opt = OptaxWrapper(optax.adam(0.1)).create(params)
    >>> keeps_per_param_states(opt.optimizer_def, params, opt.state, opt.state_dict()['state'])
    False
  """
  param_states = state_dict.get("param_states", {})
  paths = _param_paths(target)
  if not isinstance(param_states, Mapping):
    return False
  if not paths:
    return not param_states
  if set(_top_paths(param_states, paths)) != set(paths):
    return False
  if isinstance(opt_def, MultiOptimizer):
    sub_targets = opt_def._sub_targets(target)
    sub_dicts = opt_def._sub_state_dicts(sub_targets, state)
    return opt_def._per_param(sub_targets, state.param_states, sub_dicts)
  return _is_param_subtree_prefix(target, getattr(state, "param_states", None))


def _spec_or_replicated(x: jax.sharding.PartitionSpec | None) -> jax.sharding.PartitionSpec:
  return jax.sharding.PartitionSpec() if x is None else x


def _signature(leaf: Any) -> tuple[Any, ...]:
  """What a flax traversal's filter may see of a leaf: shape and dtype."""
  return (getattr(leaf, "shape", None), str(getattr(leaf, "dtype", type(leaf).__name__)))


def _param_paths(tree: Any) -> list[tuple[str, ...]]:
  """The '/'-split paths of a params tree's leaves (None leaves included)."""
  return list(traverse_util.flatten_dict(serialization.to_state_dict(tree)))


def _get(tree: Mapping[str, Any], path: tuple[str, ...]) -> Any:
  """The node at `path` of a nested state dict; {} where it was pruned away."""
  for key in path:
    if not isinstance(tree, Mapping) or key not in tree:
      return {}
    tree = tree[key]
  return tree


def _top_paths(tree: Mapping[str, Any], param_paths: Sequence[tuple[str, ...]]) -> list:
  """The paths of `tree` cut where they reach a param path (or a leaf)."""
  stops = set(param_paths)
  prefixes = {path[:n] for path in param_paths for n in range(len(path))}
  out = []

  def walk(node: Any, path: tuple[str, ...]) -> None:
    if path in stops or path not in prefixes or not isinstance(node, Mapping):
      out.append(path)
      return
    for key, child in node.items():
      walk(child, (*path, str(key)))

  walk(tree, ())
  return out


def _pick(tree: Mapping[str, Any], paths: Sequence[tuple[str, ...]]) -> dict[str, Any]:
  """The nested dict holding `tree`'s nodes at `paths`."""
  return traverse_util.unflatten_dict({path: _get(tree, path) for path in paths})
