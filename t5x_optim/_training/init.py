"""Sharded initialisation of a `TrainState` without materialising replicas.

The train state is first built abstractly (`jax.eval_shape`, nothing is
allocated), its shardings are derived from its logical axes by the
`Partitioner`, and the initialisation is then jitted with those shardings as
`out_shardings`: every device only ever holds its own shard of each leaf, so
a model that only fits sharded can be initialised.

On a mesh with Explicit axes the model's initialisation runs with them Auto
(`jax.sharding.auto_axes`): Flax's logical constraints (`param_with_axes`,
`with_logical_partitioning` boxes) call `with_sharding_constraint`, which
under Explicit axes asserts that a new param already has its target sharding
instead of placing it there. The results come back typed with their target
shardings, as on any mesh.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
from jax.sharding import AxisType, Mesh

from t5x_optim._core.interface import OptimizerDef
from t5x_optim._training.partitioner import Partitioner
from t5x_optim._training.train_state import TrainState

__all__ = ["abstract_train_state", "init_sharded"]


def _create_fn(
  optimizer_def: OptimizerDef, init_fn: Callable[..., Any], kwargs: dict[str, Any]
) -> Callable[..., TrainState]:
  def create(*args: Any) -> TrainState:
    return TrainState.create(optimizer_def, init_fn(*args, **kwargs))

  return create


def _all_auto(mesh: Mesh) -> Mesh:
  """``mesh`` with every axis Auto (the mesh itself if none is Explicit)."""
  if AxisType.Explicit not in mesh.axis_types:
    return mesh
  return mesh.update(axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def _eval_shape(partitioner: Partitioner, fn: Callable[..., Any], *args: Any) -> Any:
  """`jax.eval_shape` under the partitioner's rules and mesh (its axes Auto), as in its jit."""
  rules = tuple(partitioner.logical_axis_rules)
  with jax.set_mesh(_all_auto(partitioner.mesh)), nn.logical_axis_rules(rules):
    return jax.eval_shape(fn, *args)


def abstract_train_state(
  partitioner: Partitioner,
  optimizer_def: OptimizerDef,
  init_fn: Callable[..., Any],
  *args: Any,
  **kwargs: Any,
) -> TrainState:
  """The train state as `jax.ShapeDtypeStruct`s carrying their target shardings.

  Nothing is allocated. The result is what orbax needs to restore a
  checkpoint straight into the partitioner's layout.

  Args:
    partitioner: gives the mesh, the rules and the shardings.
    optimizer_def: the optimizer definition.
    init_fn: returns the model variables, e.g. `model.init`.
    *args: positional arguments of `init_fn` (e.g. a PRNG key and a batch).
    **kwargs: keyword arguments of `init_fn`.

  Returns:
    A `TrainState` whose leaves are `jax.ShapeDtypeStruct`s with `.sharding`.

  Raises:
    ValueError: from `Partitioner.get_shardings`, naming the leaf, for an
      unknown logical axis name or an indivisible dimension.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from t5x_optim import optimizers
    >>> from t5x_optim.partitioning import create_mesh
    >>> mesh = create_mesh(devices=jax.devices()[:1])
    >>> state = abstract_train_state(
    ...     Partitioner(mesh), optimizers.adamw(1e-3), lambda: {'params': {'w': jnp.ones(4)}})
    >>> state.params['w'].shape, state.params['w'].sharding.spec
    ((4,), P())
  """
  create = _create_fn(optimizer_def, init_fn, kwargs)
  abstract = _eval_shape(partitioner, create, *args)
  shardings = partitioner.get_shardings(abstract)
  return jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings
  )


def init_sharded(
  partitioner: Partitioner,
  optimizer_def: OptimizerDef,
  init_fn: Callable[..., Any],
  *args: Any,
  **kwargs: Any,
) -> TrainState:
  """Initialises a train state directly into its shardings.

  `TrainState.create(optimizer_def, init_fn(*args, **kwargs))` is traced once
  abstractly to derive the shardings (`Partitioner.get_shardings`: params by
  the rules, optimizer state also over the data axis with ZeRO rules), then
  run under `jax.jit` with those `out_shardings`, its arguments replicated.
  On a mesh with Explicit axes it runs with them Auto and its results come
  back typed with their target shardings.

  Args:
    partitioner: gives the mesh, the rules and the shardings.
    optimizer_def: the optimizer definition.
    init_fn: returns the model variables, e.g. `model.init`.
    *args: positional arguments of `init_fn` (e.g. a PRNG key and a batch).
    **kwargs: keyword arguments of `init_fn` (static).

  Returns:
    The train state, each leaf a `jax.Array` with its target sharding.

  Raises:
    ValueError: from `Partitioner.get_shardings`, naming the leaf, for an
      unknown logical axis name or an indivisible dimension.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from t5x_optim import optimizers, partitioning
    >>> p = partitioning.Partitioner(partitioning.create_mesh(devices=jax.devices()[:1]))
    >>> state = partitioning.init_sharded(
    ...     p, optimizers.sgd(0.1), lambda: {'params': {'w': jnp.ones(4)}})
    >>> state.params['w'].sharding.spec
    P()
  """
  create = _create_fn(optimizer_def, init_fn, kwargs)
  shardings = partitioner.get_shardings(_eval_shape(partitioner, create, *args))
  if AxisType.Explicit in partitioner.mesh.axis_types:
    specs = jax.tree.map(lambda s: s.spec, shardings)
    create = jax.sharding.auto_axes(create, out_sharding=specs)
  return partitioner.partition(create, None, shardings)(*args)
