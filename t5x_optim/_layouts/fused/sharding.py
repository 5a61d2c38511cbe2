"""The fused update on sharded arrays, and under `jax.vmap`.

The multi-tensor update runs on each device's local shards, so no data
moves between devices. Under Explicit mesh axes the shardings are in the
arrays' types and `jax.shard_map` runs it; otherwise it is a
`custom_partitioning` op, to which XLA's partitioner gives every leaf's
sharding. Where a leaf's operands are sharded differently (ZeRO: state
sharded over ``data``, params replicated) it updates the most sharded
layout and XLA reshards around it, as it does for the plain path. Under
`jax.vmap` (an ensemble of optimizers) the update takes the plain path.

Example:
  >>> import jax.numpy as jnp, optax
  >>> from t5x_optim._layouts.fused.analysis import plan_fused_update
  >>> params, grads = {'w': jnp.ones(3)}, {'w': jnp.ones(3)}
  >>> tx = optax.sgd(0.5)
  >>> plan = plan_fused_update(tx, params, grads, tx.init(params), kernel="interpret")
  >>> fused_apply(plan, params, grads, tx.init(params))[0]['w']
  Array([0.5, 0.5, 0.5], dtype=float32)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.custom_batching
import jax.numpy as jnp
import optax
from jax.experimental.custom_partitioning import SdyShardingRule, custom_partitioning
from jax.interpreters import partial_eval
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from t5x_optim._axes.auto import auto_axes_like, explicit_mesh
from t5x_optim._layouts.fused.analysis import FusedPlan, eval_outside, split_extras
from t5x_optim._layouts.fused.kernel import local_update
from t5x_optim._layouts.fused.program import Lit

__all__ = ["fused_apply"]


def _most_sharded(shardings: Sequence[Any], shape: tuple) -> Any:
  """The sharding with the smallest shard of `shape` (the first on ties)."""
  return min(shardings, key=lambda s: math.prod(s.shard_shape(shape)))


def _shard_mapped(plan: FusedPlan, leaf_args: list, residuals: list, mesh: Any) -> list:
  """`local_update` under `jax.shard_map`, for arrays with Explicit sharding types.

  Each leaf is updated in the most sharded layout of its operands; every
  result then goes back to the layout of the operand it replaces.
  """
  width = 2 + plan.components
  specs = [jax.typeof(x).sharding.spec for x in leaf_args]
  args, in_specs, out_specs = [], [], []
  for i in range(len(leaf_args) // width):
    own = specs[i * width : (i + 1) * width]
    shape = jnp.shape(leaf_args[i * width])
    chosen = _most_sharded([NamedSharding(mesh, spec) for spec in own], shape).spec
    for x, spec in zip(leaf_args[i * width : (i + 1) * width], own, strict=True):
      args.append(x if spec == chosen else jax.sharding.reshard(x, NamedSharding(mesh, chosen)))
    in_specs.extend([chosen] * width)
    out_specs.extend([chosen] * (width - 1))
  outs = jax.shard_map(
    lambda *a: tuple(local_update(plan, a[: len(args)], a[len(args) :])),
    mesh=mesh,
    in_specs=(*in_specs, *(PartitionSpec() for _ in residuals)),
    out_specs=tuple(out_specs),
    check_vma=False,  # the program binds primitives itself, without pvary
  )(*args, *residuals)
  results = []
  for k, out in enumerate(outs):
    i, j = divmod(k, width - 1)
    want = specs[i * width + (0 if j == 0 else j + 1)]
    results.append(
      out if want == out_specs[k] else jax.sharding.reshard(out, NamedSharding(mesh, want))
    )
  return results


def _multi_tensor(plan: FusedPlan, leaf_args: list, residuals: list) -> list:
  """`local_update` on each device's local shards.

  Under Explicit mesh axes the shardings are in the types and `jax.shard_map`
  runs it; otherwise it is a `custom_partitioning` op, to which XLA's
  partitioner gives the shardings. On a mesh with some axes Explicit and some
  Auto the op runs with them all Auto (`auto_axes_like`).
  """
  mesh = explicit_mesh(leaf_args)
  if mesh is not None and all(t == AxisType.Explicit for t in mesh.axis_types):
    return _shard_mapped(plan, leaf_args, residuals, mesh)
  width = 2 + plan.components
  replaced = [
    leaf_args[i * width + (0 if j == 0 else j + 1)]
    for i in range(len(leaf_args) // width)
    for j in range(width - 1)
  ]
  return auto_axes_like(functools.partial(_partitioned, plan), replaced)(leaf_args, residuals)


def _partitioned(plan: FusedPlan, leaf_args: list, residuals: list) -> list:
  """`local_update` as a `custom_partitioning` op (`_multi_tensor`)."""
  width = 2 + plan.components
  n_leaf_args = len(leaf_args)

  def leaf_shardings(arg_shapes: Sequence[Any], mesh: Any) -> tuple[list, list]:
    arg_sh, out_sh = [], []
    for i in range(n_leaf_args // width):
      shape = arg_shapes[i * width].shape
      chosen = _most_sharded([s.sharding for s in arg_shapes[i * width : (i + 1) * width]], shape)
      arg_sh.extend([chosen] * width)
      out_sh.extend([chosen] * (width - 1))
    arg_sh.extend(NamedSharding(mesh, PartitionSpec()) for _ in residuals)
    return arg_sh, out_sh

  def partition(mesh, arg_shapes, result_shape):
    arg_sh, out_sh = leaf_shardings(arg_shapes, mesh)

    def lower(*args):
      return tuple(local_update(plan, args[:n_leaf_args], args[n_leaf_args:]))

    return mesh, lower, tuple(out_sh), tuple(arg_sh)

  def infer(mesh, arg_shapes, result_shape):
    return tuple(leaf_shardings(arg_shapes, mesh)[1])

  operand_maps, result_maps = [], []
  for i in range(n_leaf_args // width):
    factors = tuple(f"l{i}d{d}" for d in range(jnp.ndim(leaf_args[i * width])))
    operand_maps.extend([factors] * width)
    result_maps.extend([factors] * (width - 1))
  operand_maps.extend(() for _ in residuals)

  @custom_partitioning
  def update(*args):
    return tuple(local_update(plan, args[:n_leaf_args], args[n_leaf_args:]))

  update.def_partition(
    partition=partition,
    infer_sharding_from_operands=infer,
    sharding_rule=SdyShardingRule(tuple(operand_maps), tuple(result_maps)),
  )
  return list(update(*leaf_args, *residuals))


def _fused_leaves(
  plan: FusedPlan, params: Any, grads: Any, state: Any, extra_leaves: list
) -> tuple[Any, Any]:
  """`fused_apply` with the extra arguments' array leaves given."""
  p_leaves, params_def = jax.tree.flatten(params)
  g_leaves = jax.tree.leaves(grads)
  s_leaves, state_def = jax.tree.flatten(state)
  values = eval_outside(plan, [*p_leaves, *g_leaves, *s_leaves, *extra_leaves, *plan.consts])
  per_leaf = [[] for _ in p_leaves]
  for leaf, slot in zip(s_leaves, plan.slots, strict=True):
    if slot is not None:
      per_leaf[slot].append(leaf)
  leaf_args = [x for i, p in enumerate(p_leaves) for x in (p, g_leaves[i], *per_leaf[i])]
  residuals = [jnp.asarray(values[r]) for r in plan.residual_ids]
  outs = _multi_tensor(plan, leaf_args, residuals)
  width = 1 + plan.components
  new_p = [outs[i * width] for i in range(len(p_leaves))]
  taken = [1] * len(p_leaves)
  new_global = iter(a.value if isinstance(a, Lit) else values[a] for a in plan.global_outs)
  new_s = []
  for slot in plan.slots:
    if slot is None:
      new_s.append(next(new_global))
    else:
      new_s.append(outs[slot * width + taken[slot]])
      taken[slot] += 1
  return jax.tree.unflatten(params_def, new_p), jax.tree.unflatten(state_def, new_s)


def fused_apply(
  plan: FusedPlan,
  params: Any,
  grads: Any,
  state: Any,
  extra_args: dict[str, Any] | None = None,
) -> tuple[Any, Any]:
  """One fused update: returns the new params and the new optax state.

  Under `jax.vmap` (an ensemble of optimizers) the global scalars (a step
  count per member) are no longer scalars, so the batched update takes the
  plain path: ``jax.vmap`` of ``tx.update`` + ``optax.apply_updates``.
  Differentiated (`jax.grad` or `jax.jvp` through the step, a meta-gradient),
  the values are the fused update's and the derivatives the plain path's:
  the kernel's `custom_partitioning` op has no derivative of its own.

  Args:
    plan: from `plan_fused_update` for these trees' structure and types.
    params, grads, state, extra_args: those the plan was built for.
  """
  extra_leaves, rebuild = split_extras(dict(extra_args or {}))

  def plain(params: Any, grads: Any, state: Any, extra_leaves: list) -> tuple[Any, Any]:
    updates, new_state = plan.tx.update(grads, state, params, **rebuild(extra_leaves))
    return optax.apply_updates(params, updates), new_state

  batched = jax.custom_batching.custom_vmap(lambda p, g, s, e: _fused_leaves(plan, p, g, s, e))

  @batched.def_vmap
  def _batched(axis_size, in_batched, params, grads, state, extra_leaves):
    in_axes = jax.tree.map(lambda batched: 0 if batched else None, tuple(in_batched))
    out = jax.vmap(plain, in_axes=in_axes, axis_size=axis_size)(params, grads, state, extra_leaves)
    return out, jax.tree.map(lambda _: True, out)

  operands = (params, grads, state, extra_leaves)
  if _closes_over_tracers(plan):
    # A hyperparameter the transformation closes over is being differentiated (or vmapped):
    # only the plain path carries its derivative.
    return plain(*operands)

  update = jax.custom_jvp(batched)

  @update.defjvp
  def _differentiated(primals: tuple, tangents: tuple) -> tuple[Any, Any]:
    return update(*primals), jax.jvp(plain, primals, tangents)[1]

  return update(*operands)


def _closes_over_tracers(plan: FusedPlan) -> bool:
  """Whether the update `plan` was traced from reads a tracer of a transformation other than
  `jax.jit` that it is not given (a learning rate under `jax.grad`): tracing hoisted it into
  the plan's constants, and a `jax.custom_jvp` function may not close over it."""
  return any(
    isinstance(c, jax.core.Tracer) and not isinstance(c, partial_eval.DynamicJaxprTracer)
    for c in plan.consts
  )
