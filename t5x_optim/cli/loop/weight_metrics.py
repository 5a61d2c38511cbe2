"""Per-parameter optimizer metrics, as T5X's `WeightMetricsComputer` writes them.

`weight_metrics` returns one scalar per parameter and per optimizer-state
leaf, named by its path:

- ``weight_rms/<param>``: RMS of the parameter after the step,
- ``weight_gradient_rms/<param>``: RMS of its gradient,
- ``weight_update_rms/<param>``: RMS of the step's change of the parameter,
- ``optimizer_state_rms/<state leaf>``: RMS of each optimizer-state leaf
  (Adam's ``mu`` and ``nu``, Adafactor's ``v_row`` and ``v_col``, ...),
  scalars such as step counts left out. A `low_precision` state counts as the
  float32 values it stores (`low_precision_to_float32`), under the tags of
  the wrapped optimizer's own state: the RMS of Adam's ``mu``, not of its
  8-bit codes and block scales, so a float32 and an 8-bit run chart alike.

Called inside the jitted train step with the shardings, every device sums
the squares of its own shards and one all-reduce of a vector (one entry per
tag) combines them, so no array is gathered to one device and the metrics
cost one collective, not one per tag. A low-precision state's leaves are
decoded a chunk of rows at a time, one leaf after another
(`low_precision_sum_squares`), so no float32 copy of them is held; their
sums take the compiler's own collectives (codes and scales are laid out
apart).

Example:
  >>> import jax.numpy as jnp
  >>> old = {'dense': {'kernel': jnp.ones((2, 2))}}
  >>> new = {'dense': {'kernel': jnp.full((2, 2), 3.0)}}
  >>> grads = {'dense': {'kernel': jnp.full((2, 2), 0.5)}}
  >>> states = ({'count': jnp.zeros([]), 'mu': grads},)
  >>> {k: float(v) for k, v in weight_metrics(old, new, grads, states).items()}
  {'weight_rms/dense/kernel': 3.0, 'weight_gradient_rms/dense/kernel': 0.5, 'weight_update_rms/dense/kernel': 2.0, 'optimizer_state_rms/mu/dense/kernel': 0.5}
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from t5x_optim import LowPrecisionState, low_precision_sum_squares, low_precision_to_float32

__all__ = ["metric_tags", "metric_vector", "weight_metrics"]


def _kept(leaf: Any) -> bool:
  """Whether `leaf` has a metric: a non-scalar, non-empty array."""
  return hasattr(leaf, "shape") and len(leaf.shape) > 0 and math.prod(leaf.shape) > 0


def _leaves(tree: Any, shardings: Any) -> list[tuple[tuple[str, ...], jax.Array, Any]]:
  """(path parts, leaf, its sharding or None) for every non-scalar array leaf."""
  leaves = jax.tree.flatten_with_path(tree)[0]
  specs = [None] * len(leaves) if shardings is None else jax.tree.leaves(shardings)
  if len(specs) != len(leaves):
    raise ValueError(f"{len(specs)} shardings for {len(leaves)} leaves.")
  return [
    (tuple(jax.tree_util.keystr((key,), simple=True) for key in path), leaf, spec)
    for (path, leaf), spec in zip(leaves, specs, strict=True)
    if _kept(leaf)
  ]


def holds_low_precision(param_states: Any) -> bool:
  """Whether ``param_states`` holds a `LowPrecisionState` (compressed or bfloat16 leaves)."""

  def is_node(x: Any) -> bool:
    return isinstance(x, LowPrecisionState)

  return any(is_node(x) for x in jax.tree.leaves(param_states, is_leaf=is_node))


def _names(paths: list[tuple[str, ...]]) -> list[str]:
  """Paths joined by ``/``, leading tuple indices dropped when that keeps them distinct."""
  short = []
  for parts in paths:
    first = next((i for i, part in enumerate(parts) if not part.isdigit()), 0)
    short.append("/".join(parts[first:]))
  if len(set(short)) == len(short):
    return short
  return ["/".join(parts) for parts in paths]


def _sum_squares(x: jax.Array) -> jax.Array:
  return jnp.sum(jnp.square(x.astype(jnp.float32)))


def _sum_squares_of(terms: tuple[jax.Array, ...]) -> jax.Array:
  """The sum of squares of ``terms[0]``, or of ``terms[0] - terms[1]`` (an update)."""
  if len(terms) == 1:
    return _sum_squares(terms[0])
  new, old = terms
  return jnp.sum(jnp.square(new.astype(jnp.float32) - old.astype(jnp.float32)))


def _sharded_sum_squares(
  terms: list[tuple[jax.Array, ...]], shardings: list[NamedSharding]
) -> jax.Array:
  """Every term's sum of squares, with one all-reduce for all of them.

  Each device sums the squares of its shard of every term (an update's
  difference inside the same loop, so it is never materialised); one
  ``psum`` over the whole mesh adds the per-device vectors, and each term's
  total is divided by how many devices hold each of its shards (its
  replication).
  """
  mesh = shardings[0].mesh
  replicas = []
  for term, sharding in zip(terms, shardings, strict=True):
    shards = len(
      {tuple(map(str, index)) for index in sharding.devices_indices_map(term[0].shape).values()}
    )
    replicas.append(mesh.size // shards)
  specs = tuple(tuple(sharding.spec for _ in term) for term, sharding in zip(terms, shardings))

  def local(*shards: tuple[jax.Array, ...]) -> jax.Array:
    partial = jnp.stack([_sum_squares_of(term) for term in shards])
    return jax.lax.psum(partial, tuple(mesh.axis_names))

  totals = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=False)(*terms)
  return totals / jnp.asarray(replicas, jnp.float32)


_PREFIXES = ("weight_rms", "weight_gradient_rms", "weight_update_rms", "optimizer_state_rms")


def _tags(groups: list[list[tuple[tuple[str, ...], Any, Any]]]) -> list[str]:
  return [
    f"{prefix}/{name}"
    for prefix, entries in zip(_PREFIXES, groups, strict=True)
    for name in _names([path for path, _, _ in entries])
  ]


def metric_tags(params: Any, param_states: Any) -> list[str]:
  """The tags of `metric_vector`'s entries, in order (params may be abstract).

  Example:
    >>> import jax.numpy as jnp
    >>> metric_tags({'w': jnp.ones(2)}, ({'mu': {'w': jnp.ones(2)}},))
    ['weight_rms/w', 'weight_gradient_rms/w', 'weight_update_rms/w', 'optimizer_state_rms/mu/w']
  """
  entries = _leaves(params, None)
  if holds_low_precision(param_states):
    param_states = jax.eval_shape(low_precision_to_float32, param_states)
  return _tags([entries, entries, entries, _leaves(param_states, None)])


def metric_vector(
  old_params: Any,
  new_params: Any,
  grads: Any,
  param_states: Any,
  *,
  param_shardings: Any = None,
  state_shardings: Any = None,
) -> jax.Array:
  """RMS of every param, its gradient and its update, and of every optimizer-state leaf.

  Args:
    old_params: the params before the step.
    new_params: the params after it (same structure).
    grads: the step's gradients (same structure).
    param_states: the optimizer state after the step (any pytree).
    param_shardings: the params' `NamedSharding`s (same structure), or None.
    state_shardings: `param_states`' `NamedSharding`s, or None.

  With both shardings, every device reduces its own shards and one
  all-reduce (a ``shard_map`` ``psum``) combines all the metrics; without,
  each RMS is a plain reduction (one all-reduce each, under jit).

  Returns:
    A float32 vector, one entry per tag of `metric_tags`.
  """
  if param_shardings is None or state_shardings is None:
    param_shardings = state_shardings = None
  else:
    grads = jax.lax.with_sharding_constraint(grads, param_shardings)
  news = _leaves(new_params, param_shardings)
  olds = [leaf for _, leaf, _ in _leaves(old_params, param_shardings)]
  entries = [
    *[((leaf,), sharding) for _, leaf, sharding in news],
    *[((leaf,), sharding) for _, leaf, sharding in _leaves(grads, param_shardings)],
    *[((leaf, old), sharding) for (_, leaf, sharding), old in zip(news, olds, strict=True)],
  ]
  sizes = [term[0].size for term, _ in entries]
  if holds_low_precision(param_states):
    state_totals, state_sizes = _low_precision_totals(param_states)
    sizes += state_sizes
  else:
    state = _leaves(param_states, state_shardings)
    entries += [((leaf,), sharding) for _, leaf, sharding in state]
    sizes += [leaf.size for _, leaf, _ in state]
    state_totals = []
  if not sizes:
    return jnp.zeros([0], jnp.float32)
  totals = [*_totals(entries), *state_totals]
  return jnp.sqrt(jnp.stack(totals) / jnp.asarray(sizes, jnp.float32))


def _low_precision_totals(param_states: Any) -> tuple[list[jax.Array], list[int]]:
  """The sums of squares of a low-precision state's float32 values, a chunk at a time
  (`low_precision_sum_squares`), and their sizes, for its leaves that have a metric."""
  shapes = jax.tree.leaves(jax.eval_shape(low_precision_to_float32, param_states))
  sums = jax.tree.leaves(low_precision_sum_squares(param_states))
  kept = [(total, shape) for total, shape in zip(sums, shapes, strict=True) if _kept(shape)]
  return [total for total, _ in kept], [math.prod(shape.shape) for _, shape in kept]


def _totals(entries: list[tuple[tuple[jax.Array, ...], Any]]) -> list[jax.Array]:
  """Each entry's sum of squares: with one all-reduce when every entry has a
  `NamedSharding` on one mesh (`_sharded_sum_squares`), else a reduction each."""
  if not entries:
    return []
  terms = [term for term, _ in entries]
  shardings = [sharding for _, sharding in entries]
  if all(isinstance(s, NamedSharding) for s in shardings) and len({s.mesh for s in shardings}) == 1:
    return list(_sharded_sum_squares(terms, shardings))
  return [_sum_squares_of(term) for term in terms]


def weight_metrics(
  old_params: Any, new_params: Any, grads: Any, param_states: Any, **shardings: Any
) -> dict[str, jax.Array]:
  """`metric_vector` as ``{tag: float32 scalar}``, tags as in the module docstring."""
  vector = metric_vector(old_params, new_params, grads, param_states, **shardings)
  tags = metric_tags(new_params, param_states)
  return {tag: vector[i] for i, tag in enumerate(tags)}
