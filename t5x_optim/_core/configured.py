"""Optimizer-state leaves that only the config sets, and a state with them as the config gives them now.

Some optax states keep a setting among their leaves and read it there at each update:
Muon's Newton-Schulz coefficients (``ns_coeffs``), schedule-free's ``b1``, momo's
lower bound, the constants of ``inject_hyperparams``. A restored state holds them as
the config that wrote it gave them, so a resume under a changed config would update
with the old values. `reapply_config` sets them anew, and moves the params a
schedule-free state takes gradients at where its ``b1`` changed, so that its average
stays the one trained.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from t5x_optim._core.interface import Optimizer, trained_params
from t5x_optim._core.placement import host_scalar

__all__ = ["configured_leaves", "reapply_config", "same_setting"]


def _dependents(jaxpr: Any) -> set:
  """The variables of `jaxpr` that its inputs reach (any equation with such an operand)."""
  reached = set(jaxpr.invars)
  for eqn in jaxpr.eqns:
    if any(isinstance(v, jax.extend.core.Var) and v in reached for v in eqn.invars):
      reached.update(eqn.outvars)
  return reached


_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "remat", "checkpoint"})
"""Primitives that call a jaxpr with their operands and return its results."""


def _forwarded(jaxpr: Any, inputs: Sequence[int | None]) -> list[int | None]:
  """For each output of `jaxpr`, the index in `inputs` of the input it returns as it got it,
  or None; ``inputs`` gives each of `jaxpr`'s inputs its index (None: none).

  An output is its input through equations that return an operand unchanged: a
  ``select_n`` whose cases are one value (``where(emit, new, old)`` where the new is the
  old), a ``convert_element_type`` or ``copy`` to the operand's own dtype, a call whose
  jaxpr forwards it, and a ``cond`` whose every branch forwards it.
  """
  origin = {var: index for var, index in zip(jaxpr.invars, inputs, strict=True)}

  def of(var: Any) -> int | None:
    return origin.get(var) if isinstance(var, jax.extend.core.Var) else None

  for eqn in jaxpr.eqns:
    name, operands = eqn.primitive.name, [of(var) for var in eqn.invars]
    outs: list[int | None] = [None] * len(eqn.outvars)
    if name == "select_n" and len(set(operands[1:])) == 1:
      outs = operands[1:2]
    elif name in ("convert_element_type", "copy", "copy_p"):
      if eqn.invars[0].aval.dtype == eqn.outvars[0].aval.dtype:
        outs = operands[:1]
    elif name == "cond":
      branches = [_forwarded(branch.jaxpr, operands[1:]) for branch in eqn.params["branches"]]
      outs = [found[0] if len(set(found)) == 1 else None for found in zip(*branches, strict=True)]
    elif name in _CALLS:
      called = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
      called = getattr(called, "jaxpr", called)
      if called is not None and len(called.invars) == len(operands):
        outs = _forwarded(called, operands)
    origin.update((var, index) for var, index in zip(eqn.outvars, outs, strict=True))
  return [of(var) for var in jaxpr.outvars]


def configured_leaves(optimizer: Optimizer, grads: Any = None, **extra: Any) -> list[bool]:
  """For each leaf of ``optimizer.state.param_states``, whether only the config sets it.

  Such a leaf is one that the definition's ``init_state`` computes without
  reading the params' values and that ``apply_gradient`` returns as it got it
  (`_forwarded`: through ``optax.MultiSteps``' choice between its new and its
  old inner state too), both read from the traced functions (no values
  computed).

  Args:
    optimizer: the optimizer whose state to read.
    grads: gradients of the update's structure; if None, zeros like the
      params it trains (`trained_params`: the fast ones of optax.lookahead).
    **extra: the update's extra arguments (optax's ``value=``, ...).

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from t5x_optim import OptaxWrapper
    >>> opt = OptaxWrapper(optax.contrib.schedule_free_adamw(1e-3)).create({'w': jnp.ones(2)})
    >>> paths = jax.tree_util.tree_leaves_with_path(opt.state.param_states)
    >>> [jax.tree_util.keystr(p) for (p, _), c in zip(paths, configured_leaves(opt)) if c]
    ['.b1']
  """
  if grads is None:
    grads = jax.tree.map(jnp.zeros_like, trained_params(optimizer.target))
  definition = optimizer.optimizer_def
  init = jax.make_jaxpr(lambda target: jax.tree.leaves(definition.init_state(target).param_states))
  init_jaxpr = init(optimizer.target).jaxpr
  reached = _dependents(init_jaxpr)
  leaves, treedef = jax.tree.flatten(optimizer.state.param_states)

  def update(leaves: list[Any]) -> list[Any]:
    state = optimizer.state.replace(param_states=jax.tree.unflatten(treedef, leaves))
    updated = optimizer.replace(state=state).apply_gradient(grads, **extra)
    return jax.tree.leaves(updated.state.param_states)

  kept = _forwarded(jax.make_jaxpr(update)(leaves).jaxpr, range(len(leaves)))
  return [
    index == leaf and not (isinstance(made, jax.extend.core.Var) and made in reached)
    for leaf, (made, index) in enumerate(zip(init_jaxpr.outvars, kept, strict=True))
  ]


def reapply_config(optimizer: Optimizer, grads: Any = None, **extra: Any) -> Optimizer:
  """`optimizer` with the state leaves that only the config sets (`configured_leaves`) as its
  definition's ``init_state`` gives them now, in each leaf's dtype and sharding.

  For a state restored under a changed config. The new values are computed
  in one jitted init whose moments XLA leaves out. Where a schedule-free
  state's ``b1`` changed, the params it takes gradients at become
  ``b1 x + (1 - b1) z`` by the new ``b1``, with its average ``x`` by the old
  one: optax recovers ``x`` from the params and ``z`` by the ``b1`` it is
  built with, so params kept as they were would move the average.

  Args:
    optimizer: the optimizer, e.g. just restored.
    grads: gradients of the update's structure; if None, zeros like the
      params it trains (`trained_params`: the fast ones of optax.lookahead).
    **extra: the update's extra arguments (optax's ``value=``, ...).

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from t5x_optim import OptaxWrapper
    >>> params = {'w': jnp.ones(2)}
    >>> saved = OptaxWrapper(optax.contrib.schedule_free_adamw(1e-3, b1=0.9)).create(params)
    >>> now = OptaxWrapper(optax.contrib.schedule_free_adamw(1e-3, b1=0.5))
    >>> float(reapply_config(saved.replace(optimizer_def=now)).state.param_states.b1)
    0.5

  Raises:
    ValueError: a schedule-free state whose ``b1`` changed holds a ``z`` of no
      param (no param of its path and shape), naming it.
  """
  configured = configured_leaves(optimizer, grads, **extra)
  if not any(configured):
    return optimizer
  definition = optimizer.optimizer_def

  def fresh(target: Any) -> list[Any]:
    leaves = jax.tree.leaves(definition.init_state(target).param_states)
    return [leaf for leaf, chosen in zip(leaves, configured, strict=True) if chosen]

  new = iter(jax.jit(fresh)(optimizer.target))
  leaves, treedef = jax.tree.flatten(optimizer.state.param_states)
  leaves = [
    jax.device_put(jnp.asarray(next(new), leaf.dtype), getattr(leaf, "sharding", None))
    if chosen
    else leaf
    for leaf, chosen in zip(leaves, configured, strict=True)
  ]
  state = optimizer.state.replace(param_states=jax.tree.unflatten(treedef, leaves))
  target = _schedule_free_params(optimizer.target, optimizer.state.param_states, state.param_states)
  return optimizer.replace(state=state, target=target)


def _is_schedule_free(node: Any) -> bool:
  return isinstance(node, optax.contrib.ScheduleFreeState)


def _schedule_free_params(target: Any, old_states: Any, new_states: Any) -> Any:
  """`target` with the params of each schedule-free state whose ``b1`` the config changed at
  ``y = b1 x + (1 - b1) z`` by the new ``b1``, ``x = (y - (1 - b1) z) / b1`` by the old one.

  optax's schedule-free keeps its params ``y`` and its ``z`` and recovers its average ``x``
  from them by the ``b1`` it is built with: kept as they were, the params would move ``x``,
  the params it is evaluated at. A param is matched to ``z`` by its path in the params it
  trains (`trained_params`: lookahead's fast ones), ``z`` over all of them or part
  (``optax.masked``' holes, a `MultiOptimizer` group's).

  Raises:
    ValueError: a changed ``b1`` in a state whose ``z`` has a path or shape that none of
      the params has, naming it.
  """
  pairs = [
    (old, new)
    for old, new in zip(
      jax.tree.leaves(old_states, is_leaf=_is_schedule_free),
      jax.tree.leaves(new_states, is_leaf=_is_schedule_free),
      strict=True,
    )
    if _is_schedule_free(old) and not same_setting(old.b1, new.b1)
  ]
  if not pairs:
    return target
  flat, treedef = jax.tree.flatten_with_path(trained_params(target))
  leaves = [leaf for _, leaf in flat]
  index = {jax.tree_util.keystr(path): i for i, (path, _) in enumerate(flat)}
  for old, new in pairs:
    for path, z in jax.tree.flatten_with_path(old.z, is_leaf=_is_hole)[0]:
      if _is_hole(z):
        continue
      i = index.get(jax.tree_util.keystr(path))
      if i is None or jnp.shape(leaves[i]) != jnp.shape(z):
        raise ValueError(
          f"Schedule-free's b1 changed ({old.b1} -> {new.b1}), but its z at "
          f"'{jax.tree_util.keystr(path)}' {jnp.shape(z)} is of no param of that path and shape: "
          "the params it takes gradients at cannot be moved to keep its average."
        )
      leaves[i] = _moved(leaves[i], z, old.b1, new.b1)
  moved = jax.tree.unflatten(treedef, leaves)
  return target._replace(fast=moved) if isinstance(target, optax.LookaheadParams) else moved


def _is_hole(node: Any) -> bool:
  return isinstance(node, optax.MaskedNode)


def same_setting(old: Any, new: Any) -> bool:
  """Whether two values of one setting are known to be equal: a schedule the same function,
  numbers the same in shape and value on the host. A traced value, or an array not all in this
  process, is not known, so not equal.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> same_setting(jnp.float32(0.9), jnp.float32(0.9)), same_setting(0.9, 0.5)
    (True, False)
    >>> same_setting(optax.constant_schedule(1.0), optax.constant_schedule(1.0))
    False
  """
  if callable(old) or callable(new):
    return old is new
  values = [host_scalar(value) for value in (old, new)]
  if any(isinstance(value, jax.core.Tracer) for value in values):
    return False
  if any(isinstance(value, jax.Array) and not value.is_fully_addressable for value in values):
    return False
  return bool(np.array_equal(np.asarray(values[0]), np.asarray(values[1])))


@jax.jit
def _moved(y: Any, z: Any, b1_old: Any, b1_new: Any) -> Any:
  """``y``, of the old ``b1``, as the point of the new ``b1`` between the same ``x`` and ``z``."""
  x = (y - (1 - b1_old) * z) / b1_old
  return jnp.where(b1_old == b1_new, y, b1_new * x + (1 - b1_new) * z).astype(y.dtype)
