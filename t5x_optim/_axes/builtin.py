"""Built-in state rules for states where generic derivation loses information.

* L-BFGS keeps ``memory_size`` past differences of params and updates, shaped
  ``(memory_size, *param.shape)``; ``init`` builds them with ``jnp.zeros`` so
  they come back replicated. Each gets ``(None, *param_spec)``.
* GaLore keeps per-matrix projectors and runs its base optimizer on low-rank
  proxies, all built with ``jnp.zeros``. A projector or proxy keeps the
  logical axis of the param dimension it shares with the param.
"""

from __future__ import annotations

from typing import Any

import jax
import optax
from jax.sharding import PartitionSpec
from optax import contrib

from t5x_optim._axes import registry
from t5x_optim._axes import specs as specs_lib
from t5x_optim._axes.rules import is_spec_leaf


def _with_memory_axis(spec: Any) -> Any:
  if spec is None or spec is specs_lib.UNDERIVED:
    return spec
  return PartitionSpec(None, *spec)


def lbfgs_rule(
  state: optax.ScaleByLBFGSState, specs: optax.ScaleByLBFGSState, context: registry.StateRuleContext
) -> optax.ScaleByLBFGSState:
  """History leaves of L-BFGS get ``(None, *spec of the matching param)``.

  The ``params`` field of the state mirrors the params, so its derived specs
  give the param specs wherever the L-BFGS state sits in a wrapper.

  >>> import jax.numpy as jnp
  >>> s = optax.scale_by_lbfgs(memory_size=3).init({'w': jnp.ones((4, 8))})
  >>> specs = s._replace(count=None, params={'w': PartitionSpec('a', 'b')})
  >>> lbfgs_rule(s, specs, None).diff_params_memory
  {'w': P(None, 'a', 'b')}
  """
  del state, context
  history = jax.tree.map(_with_memory_axis, specs.params, is_leaf=is_spec_leaf)
  return specs._replace(
    count=None, diff_params_memory=history, diff_updates_memory=history, weights_memory=None
  )


def _low_rank_specs(param: Any, spec: Any, projector: Any):
  """(projector spec, proxy shape, proxy spec) of one param, or None.

  Follows ``optax.contrib.scale_by_galore`` for 2-D params with the default
  dimension numbers: the left projector ``(m, r)`` is used when ``m >= n``
  (proxy ``(r, n)``), the right one ``(n, r)`` otherwise (proxy ``(m, r)``).
  """
  shape = specs_lib.leaf_shape(param)
  if isinstance(projector, optax.MaskedNode) or len(shape) != 2:
    return None
  m, n = shape
  rank = specs_lib.leaf_shape(projector)[-1]
  row, col = specs_lib.canonical(spec, 2) or PartitionSpec(None, None)
  if m >= n:
    expected, kept, proxy = (
      (m, rank),
      PartitionSpec(row, None),
      ((rank, n), PartitionSpec(None, col)),
    )
  else:
    expected, kept, proxy = (
      (n, rank),
      PartitionSpec(col, None),
      ((m, rank), PartitionSpec(row, None)),
    )
  if specs_lib.leaf_shape(projector) != expected:
    return None
  return (specs_lib.canonical(kept, 2), proxy[0], specs_lib.canonical(proxy[1], 2))


def galore_rule(state: Any, specs: Any, context: registry.StateRuleContext) -> Any:
  """Projectors and base-optimizer proxies of GaLore keep their param's axes.

  Applies when the GaLore state was initialised with the root params (as in
  ``optax.contrib.galore``); otherwise the derived specs are kept.
  """
  if context.params is None:
    return specs

  def masked(x):
    return isinstance(x, optax.MaskedNode)

  projectors, projector_def = jax.tree.flatten(state.projector, is_leaf=masked)
  params, params_def = jax.tree.flatten(context.params, is_leaf=masked)
  if projector_def != params_def:
    return specs
  param_specs = params_def.flatten_up_to(context.param_specs)
  derived = jax.tree.leaves(specs.projector, is_leaf=is_spec_leaf)
  real = [not masked(p) for p in projectors]
  low_rank = [
    _low_rank_specs(p, s, q) for p, s, q, keep in zip(params, param_specs, projectors, real) if keep
  ]
  new_projector = [d if lr is None else lr[0] for d, lr in zip(derived, low_rank)]
  proxies = [None if lr is None else lr[1:] for lr in low_rank]
  return specs._replace(
    projector=jax.tree.structure(state.projector).unflatten(new_projector),
    base_optimizer_state=_proxy_mirror_specs(
      state.base_optimizer_state,
      specs.base_optimizer_state,
      jax.tree.structure(state.projector),
      proxies,
    ),
  )


def _proxy_mirror_specs(
  base_state: Any, base_specs: Any, mirror_def: jax.tree_util.PyTreeDef, proxies: list[Any]
) -> Any:
  """Leaves of ``base_state`` mirroring the proxies get the proxies' specs."""
  leaves, base_def = jax.tree.flatten(base_state)
  flat = base_def.flatten_up_to(base_specs)
  for offset, _ in specs_lib.subtree_offsets(base_def, mirror_def.__eq__):
    for j, proxy in enumerate(proxies):
      if proxy is not None and specs_lib.leaf_shape(leaves[offset + j]) == proxy[0]:
        flat[offset + j] = proxy[1]
  return base_def.unflatten(flat)


registry.register_state_rule(optax.ScaleByLBFGSState, lbfgs_rule)
registry.register_state_rule(contrib.GaLoreState, galore_rule)
