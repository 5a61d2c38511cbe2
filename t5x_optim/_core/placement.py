"""Where a restore or conversion puts what it reads: the devices of its target's leaves.

Example:
  >>> import jax, jax.numpy as jnp
  >>> on_context_mesh({'w': jnp.ones(2)})['w'].tolist()
  [1.0, 1.0]
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import numpy as np

from t5x_optim._keypaths import key_path_str

__all__ = ["host_scalar", "on_context_mesh", "placed_as_target"]

_F = TypeVar("_F", bound=Callable[..., Any])


def on_context_mesh(target: Any) -> Any:
  """``target`` with each leaf sharded over an abstract mesh sharded over the devices of the
  mesh in context (`jax.set_mesh`) instead: what a restore or conversion places values on.

  `jax.eval_shape` of arrays on a mesh with Explicit axes gives shardings over an abstract
  mesh, which names no devices.

  Under `jax.jit`, ``target`` as it is.

  Raises:
    ValueError: naming the leaf, where no mesh in context matches its abstract mesh.
  """

  def abstract(leaf: Any) -> bool:
    mesh = getattr(getattr(leaf, "sharding", None), "mesh", None)
    return isinstance(mesh, jax.sharding.AbstractMesh)

  def place(path: Any, leaf: Any) -> Any:
    if not abstract(leaf):
      return leaf
    sharding = leaf.sharding
    mesh = sharding.mesh
    if concrete.axis_names and concrete.abstract_mesh == mesh:
      return leaf.update(sharding=jax.sharding.NamedSharding(concrete, sharding.spec))
    raise ValueError(
      f"the target's leaf '{key_path_str(path)}' is sharded over an abstract mesh ({mesh}), "
      "which names no devices to place values on (jax.eval_shape gives one on a mesh with "
      "Explicit axes). Run under jax.set_mesh(mesh) of that mesh, or give the target concrete "
      "shardings (t5x_optim.partitioning.abstract_train_state does). Nothing was read."
    )

  if not any(abstract(leaf) for leaf in jax.tree.leaves(target)):
    return target
  try:
    concrete = jax.sharding.get_mesh()
  except ValueError:  # Under jax.jit, which places traced values by their types.
    return target
  return jax.tree.map_with_path(place, target)


def host_scalar(value: Any) -> Any:
  """A replicated scalar array as a host value, to combine with values on any device (a count
  on one device) or to compare in any process; anything else as it is.

  Example:
    >>> import jax.numpy as jnp
    >>> type(host_scalar(jnp.float32(0.9))).__name__, host_scalar([1, 2])
    ('ndarray', [1, 2])
  """
  if (
    isinstance(value, jax.Array)
    and not isinstance(value, jax.core.Tracer)
    and value.ndim == 0
    and value.is_fully_replicated
  ):
    return np.asarray(value.addressable_data(0))
  return value


def placed_as_target(fn: _F) -> _F:
  """``fn`` (a restore or a conversion) with its ``target`` and ``source`` arguments through
  `on_context_mesh`, run with no mesh in context: it places what it reads by the target's
  shardings, and jax refuses, under a mesh in context, a leaf on other devices (an
  optimizer's step on one device beside params on the mesh) or on another mesh.

  Example:
    >>> @placed_as_target
    ... def read(target):
    ...   return jax.sharding.get_mesh().axis_names
    >>> with jax.set_mesh(jax.make_mesh((1,), ('x',))):
    ...   read({})
    ()
  """
  signature = inspect.signature(fn)

  @functools.wraps(fn)
  def placed(*args: Any, **kwargs: Any) -> Any:
    bound = signature.bind(*args, **kwargs)
    for name in ("target", "source"):
      if name in bound.arguments:
        bound.arguments[name] = on_context_mesh(bound.arguments[name])
    with _no_mesh():
      return fn(*bound.args, **bound.kwargs)

  return placed  # type: ignore[return-value]


def _no_mesh() -> contextlib.AbstractContextManager:
  """No mesh in context (`jax.set_mesh`); under `jax.jit`, which refuses to change it and
  places traced values by their types, the context as it is."""
  try:
    return jax.set_mesh(None)
  except ValueError:
    return contextlib.nullcontext()
