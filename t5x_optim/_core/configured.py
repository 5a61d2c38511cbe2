"""Optimizer-state leaves that only the config sets, and a state with them as the config gives them now.

Some optax states keep a setting among their leaves and read it there at each update:
Muon's Newton-Schulz coefficients (``ns_coeffs``), schedule-free's ``b1``, momo's
lower bound, the constants of ``inject_hyperparams``. A restored state holds them as
the config that wrote it gave them, so a resume under a changed config would update
with the old values. `reapply_config` sets them anew.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from t5x_optim._core.interface import Optimizer

__all__ = ["configured_leaves", "reapply_config"]


def _dependents(jaxpr: Any) -> set:
  """The variables of `jaxpr` that its inputs reach (any equation with such an operand)."""
  reached = set(jaxpr.invars)
  for eqn in jaxpr.eqns:
    if any(isinstance(v, jax.extend.core.Var) and v in reached for v in eqn.invars):
      reached.update(eqn.outvars)
  return reached


def configured_leaves(optimizer: Optimizer, grads: Any = None, **extra: Any) -> list[bool]:
  """For each leaf of ``optimizer.state.param_states``, whether only the config sets it.

  Such a leaf is one that the definition's ``init_state`` computes without
  reading the params' values and that ``apply_gradient`` returns as it got it,
  both read from the traced functions (no values computed).

  Args:
    optimizer: the optimizer whose state to read.
    grads: gradients of the update's structure; zeros like the target if None.
    **extra: the update's extra arguments (optax's ``value=``, ...).

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from t5x_optim import OptaxWrapper
    >>> opt = OptaxWrapper(optax.contrib.schedule_free_adamw(1e-3)).create({'w': jnp.ones(2)})
    >>> paths = jax.tree_util.tree_leaves_with_path(opt.state.param_states)
    >>> [jax.tree_util.keystr(p) for (p, _), c in zip(paths, configured_leaves(opt)) if c]
    ['.b1']
  """
  grads = jax.tree.map(jnp.zeros_like, optimizer.target) if grads is None else grads
  definition = optimizer.optimizer_def
  init = jax.make_jaxpr(lambda target: jax.tree.leaves(definition.init_state(target).param_states))
  init_jaxpr = init(optimizer.target).jaxpr
  reached = _dependents(init_jaxpr)
  leaves, treedef = jax.tree.flatten(optimizer.state.param_states)

  def update(leaves: list[Any]) -> list[Any]:
    state = optimizer.state.replace(param_states=jax.tree.unflatten(treedef, leaves))
    updated = optimizer.replace(state=state).apply_gradient(grads, **extra)
    return jax.tree.leaves(updated.state.param_states)

  update_jaxpr = jax.make_jaxpr(update)(leaves).jaxpr
  return [
    kept is given and not (isinstance(made, jax.extend.core.Var) and made in reached)
    for made, given, kept in zip(
      init_jaxpr.outvars, update_jaxpr.invars, update_jaxpr.outvars, strict=True
    )
  ]


def reapply_config(optimizer: Optimizer, grads: Any = None, **extra: Any) -> Optimizer:
  """`optimizer` with the state leaves that only the config sets (`configured_leaves`) as its
  definition's ``init_state`` gives them now, in each leaf's dtype and sharding.

  For a state restored under a changed config. The new values are computed
  in one jitted init whose moments XLA leaves out.

  Args:
    optimizer: the optimizer, e.g. just restored.
    grads: gradients of the update's structure; zeros like the target if None.
    **extra: the update's extra arguments (optax's ``value=``, ...).

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from t5x_optim import OptaxWrapper
    >>> params = {'w': jnp.ones(2)}
    >>> saved = OptaxWrapper(optax.contrib.schedule_free_adamw(1e-3, b1=0.9)).create(params)
    >>> now = OptaxWrapper(optax.contrib.schedule_free_adamw(1e-3, b1=0.5))
    >>> float(reapply_config(saved.replace(optimizer_def=now)).state.param_states.b1)
    0.5
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
  return optimizer.replace(state=state)
