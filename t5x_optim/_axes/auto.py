"""An update run with a mesh's Explicit axes made Auto.

Under Explicit mesh axes every operation checks its operands' shardings:
adding a gradient sharded as its param to a moment sharded over ``data`` as
well (ZeRO), or slicing one element out of a sharded dimension, is a type
error, where on an Auto mesh XLA's partitioner moves the data. An optimizer
update takes its leaves as they are sharded, so it runs with the axes Auto
and gives its results back sharded as the leaves they replace: the program
is the one an Auto mesh compiles. The params go in resharded to the layout
of their most sharded state (`in_update_layouts`), where XLA computes the
update on an Auto mesh too.

Example:
  >>> import jax.numpy as jnp
  >>> double = auto_axes_like(lambda x: 2 * x, jnp.ones(2))
  >>> double(jnp.ones(2))  # no Explicit axes: the function itself
  Array([2., 2.], dtype=float32)
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from t5x_optim._axes.engine import holey_mirror

__all__ = [
  "auto_axes_call",
  "auto_axes_like",
  "explicit_mesh",
  "in_update_layouts",
  "update_layouts",
]


def explicit_mesh(tree: Any) -> Any:
  """The mesh in the sharding types of ``tree``'s arrays if it has an Explicit axis, or None."""
  for x in jax.tree.leaves(tree):
    if isinstance(x, jax.Array):
      mesh = jax.typeof(x).sharding.mesh
      if not mesh.empty and AxisType.Explicit in mesh.axis_types:
        return mesh
  return None


def _spec(x: Any) -> PartitionSpec:
  """``x``'s spec in its sharding type; a host array's is replicated."""
  return jax.typeof(x).sharding.spec if isinstance(x, jax.Array) else PartitionSpec()


def update_layouts(params: Any, state: Any) -> list[PartitionSpec] | None:
  """Per param leaf, the spec of the most sharded of the param and its state's mirrors.

  A mirror is a subtree of ``state`` with the params' structure at its top
  (optax's moments; a compressed moment holds a subtree per param; a
  ``MaskedNode`` hole stands for a param or a whole subtree of them); its
  arrays of a param's shape at that param's position mirror it. With ZeRO a
  moment is sharded over ``data`` as well as its param. The param read in
  that layout, the update and the new param are computed there and only the
  new param is gathered, as XLA does on an Auto mesh; with the param held in
  its own layout, XLA gathers every leaf's update first, and the step's peak
  holds them all. None without an Explicit axis.

  Example:
    >>> import jax.numpy as jnp
    >>> update_layouts({'w': jnp.ones(2)}, {'mu': {'w': jnp.ones(2)}}) is None
    True
  """
  mesh = explicit_mesh((params, state))
  if mesh is None:
    return None
  param_leaves, param_def = jax.tree.flatten(params)
  best = [NamedSharding(mesh, _spec(p)) for p in param_leaves]

  one_array = param_def.num_nodes == 1  # every state array of its shape mirrors it

  def mirrored(node: Any) -> list[int] | None:
    if one_array:
      return None
    return holey_mirror(jax.tree.structure(node), param_def, subtrees=True)

  def shard_size(sharding: NamedSharding, shape: tuple[int, ...]) -> int:
    return math.prod(sharding.shard_shape(shape))

  for node in jax.tree.leaves(state, is_leaf=lambda x: mirrored(x) is not None):
    leaves = jax.tree.leaves(node)
    indices = [0] * len(leaves) if one_array else mirrored(node)
    if indices is None:
      continue
    for j, x in zip(indices, leaves, strict=True):
      param = param_leaves[j]
      if isinstance(x, jax.Array) and x.shape == param.shape and x.ndim:
        sharding = NamedSharding(mesh, _spec(x))
        if shard_size(sharding, x.shape) < shard_size(best[j], x.shape):
          best[j] = sharding
  return [sharding.spec for sharding in best]


def auto_axes_call(fn: Callable[..., Any], out_shardings: Any, *arrays: Any) -> Any:
  """``fn(*arrays)`` with the mesh's Explicit axes Auto, its results in ``out_shardings``.

  Called eagerly, it runs in the context of the arrays' mesh: without it, an
  array made on one device (an optimizer's fresh step count) or from host
  constants does not go onto the mesh ("Please enter your `jit` into a mesh
  context").
  """
  call = jax.sharding.auto_axes(fn, out_sharding=out_shardings)
  leaves = jax.tree.leaves(arrays)
  if any(isinstance(x, jax.core.Tracer) for x in leaves):
    return call(*arrays)
  meshes = {
    x.sharding.mesh for x in leaves if isinstance(getattr(x, "sharding", None), NamedSharding)
  }
  with jax.set_mesh(*meshes) if len(meshes) == 1 else contextlib.nullcontext():
    return call(*arrays)


def auto_axes_like(fn: Callable[..., Any], like: Any) -> Callable[..., Any]:
  """``fn`` run with Explicit mesh axes Auto, its result's leaves sharded as ``like``'s.

  The result has as many leaves as ``like``, in the same order (the leaves
  they replace); where ``like`` holds a value that is not an array (a shape
  kept in a state), so does the result, and it comes back as it is. The
  arrays among ``fn``'s arguments go in with the axes Auto (an array closed
  over would keep its Explicit type, which operations with the axes Auto
  refuse). Without an Explicit axis in ``like``'s shardings, ``fn`` itself.
  """
  mesh = explicit_mesh(like)
  if mesh is None:
    return fn
  like_leaves = jax.tree.leaves(like)
  arrays_at = [i for i, x in enumerate(like_leaves) if isinstance(x, jax.Array | np.ndarray)]
  array_set = set(arrays_at)
  shardings = [NamedSharding(mesh, _spec(like_leaves[i])) for i in arrays_at]

  def call(*args: Any, **kwargs: Any) -> Any:
    leaves, treedef = jax.tree.flatten((args, kwargs))
    where = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
    result: list = []

    def run(*arrays: jax.Array) -> list:
      full = list(leaves)
      for i, x in zip(where, arrays, strict=True):
        full[i] = x
      args, kwargs = jax.tree.unflatten(treedef, full)
      out, definition = jax.tree.flatten(fn(*args, **kwargs))
      static = [i for i in range(len(out)) if i not in array_set]
      if len(out) != len(like_leaves) or any(isinstance(out[i], jax.Array) for i in static):
        raise ValueError(
          f"{getattr(fn, '__name__', fn)!r} returned {definition} where the leaves it "
          f"replaces are {jax.tree.structure(like)}, arrays at {arrays_at}."
        )
      result.extend([definition, out])
      return [out[i] for i in arrays_at]

    arrays = auto_axes_call(run, shardings, *(leaves[i] for i in where))
    definition, out = result
    for i, x in zip(arrays_at, arrays, strict=True):
      out[i] = x
    return jax.tree.unflatten(definition, out)

  return call


def in_update_layouts(params: Any, state: Any) -> tuple[Any, Callable[[Any], Any]]:
  """``params`` resharded to their `update_layouts`, and a function that puts new params back.

  Under Explicit axes an update that reads the params so computes in each
  moment's layout; the function gathers the new params into the shardings of
  ``params``. Without an Explicit axis, ``params`` and the identity.
  """
  layouts = update_layouts(params, state)
  if layouts is None:
    return params, lambda new_params: new_params
  mesh = explicit_mesh((params, state))
  leaves, definition = jax.tree.flatten(params)
  shardings = [NamedSharding(mesh, _spec(x)) for x in leaves]
  layouts = [NamedSharding(mesh, spec) for spec in layouts]

  def put(xs: list, specs: list) -> list:
    return [jax.sharding.reshard(x, spec) for x, spec in zip(xs, specs, strict=True)]

  def put_back(new_params: Any) -> Any:
    return jax.tree.unflatten(definition, put(jax.tree.leaves(new_params), shardings))

  return jax.tree.unflatten(definition, put(leaves, layouts)), put_back
