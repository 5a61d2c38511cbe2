"""Flax NNX state trees (``nnx.State``, ``nnx.Variable``) where they meet the package.

An ``nnx.State`` is a pytree whose leaves sit inside ``nnx.Variable`` nodes, so
`flax.serialization` keeps its ``Param`` objects as leaves and tree paths end
in ``/value``. The package's edges turn such trees into plain dicts of values
(`to_pure`), the form of ``nnx.to_pure_dict``, and back (`restore_like`).

flax.nnx is never imported here: a tree holds NNX objects only once the
caller has imported flax.nnx, so each check looks the module up in
``sys.modules`` and costs nothing otherwise.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import jax
from flax import traverse_util

from t5x_optim._keypaths import key_path_str

__all__ = [
  "first_nnx_path",
  "is_nnx",
  "nnx_kinds",
  "partition_specs",
  "refuse",
  "refuse_non_params",
  "restore_like",
  "to_pure",
]


def _nnx() -> Any:
  return sys.modules.get("flax.nnx")


def is_nnx(x: Any) -> bool:
  """Whether `x` is an ``nnx.State`` or an ``nnx.Variable`` (an ``nnx.Param``, say)."""
  nnx = _nnx()
  return nnx is not None and isinstance(x, nnx.State | nnx.Variable)


def first_nnx_path(tree: Any) -> str | None:
  """The '/'-joined path of the outermost NNX object in `tree` (``'<root>'`` for the
  tree itself), or None when it holds none.

  Example:
    >>> first_nnx_path({"w": 1.0}) is None
    True
  """
  if _nnx() is None:
    return None
  found = jax.tree.flatten_with_path(tree, is_leaf=is_nnx)[0]
  return next((key_path_str(path) for path, leaf in found if is_nnx(leaf)), None)


def nnx_kinds(tree: Any) -> dict[str, str]:
  """The '/'-joined path of each outermost NNX object in `tree` (``'<root>'`` for the tree
  itself), with its kind: ``'State'`` or ``'Variable'``.

  Example:
    >>> nnx_kinds({"w": 1.0})
    {}
  """
  if _nnx() is None:
    return {}
  found = jax.tree.flatten_with_path(tree, is_leaf=is_nnx)[0]
  return {
    key_path_str(path): "State" if isinstance(leaf, _nnx().State) else "Variable"
    for path, leaf in found
    if is_nnx(leaf)
  }


def _stored(x: Any) -> Any:
  """The value an ``nnx.Variable`` `x` stores, its pytree leaf (a ref read out), or `x`.

  Not its ``get_value()``: a Variable class may override ``get_value`` (or carry an
  ``on_get_value`` hook) to read back a transform of what it stores, as a param stored
  unconstrained reads back its softplus; a checkpoint of the transform would be restored
  as the stored value.
  """
  if not isinstance(x, _nnx().Variable):
    return x
  value = x.get_raw_value()
  return value[...] if _nnx().variablelib.is_array_ref(value) else value


def _pure(x: Any) -> Any:
  if isinstance(x, _nnx().State):
    return _nnx().to_pure_dict(x, extract_fn=_stored)
  return _stored(x)


def to_pure(tree: Any) -> Any:
  """`tree` with each ``nnx.State`` as its ``nnx.to_pure_dict`` and each ``nnx.Variable``
  as its value; a tree without NNX objects is returned as it is.

  The values are those the Variables store (their pytree leaves, what an optimizer
  trains), which `restore_like` stores back, not those their ``get_value()`` reads.

  Example:
    >>> to_pure({"w": 1.0})
    {'w': 1.0}
  """
  if first_nnx_path(tree) is None:
    return tree
  return jax.tree.map(lambda x: _pure(x) if is_nnx(x) else x, tree, is_leaf=is_nnx)


def _at(pure: Any, path: tuple[Any, ...]) -> Any:
  """The subtree of the pure dict `pure` at the State path `path` (an int key of the State
  may be its str in `pure`, as a state dict has it)."""
  node = pure
  for depth, key in enumerate(path):
    if not isinstance(node, Mapping) or (key not in node and str(key) not in node):
      where = "/".join(str(k) for k in path[: depth + 1])
      raise ValueError(f"The pure dict has no value at '{where}', where the nnx.State has one.")
    node = node[key] if key in node else node[str(key)]
  return node


def _replaced(state: Any, pure: Any) -> Any:
  """A copy of the ``nnx.State`` `state` with each Variable holding the subtree of `pure` at
  its path: a whole dict where the Variable's value is one (``nnx.replace_by_pure_dict``
  looks for a Variable per key of it).

  Raises:
    ValueError: `pure` lacks a Variable's path, or has a path under no Variable, naming it.
  """
  flat = list(_nnx().to_flat_state(state))
  held = {tuple(str(key) for key in path) for path, _ in flat}
  for path in traverse_util.flatten_dict(pure):
    keys = tuple(str(key) for key in path)
    if not any(keys[:size] in held for size in range(1, len(keys) + 1)):
      raise ValueError(
        f"The pure dict has a value at '{'/'.join(keys)}', where the nnx.State has none."
      )
  copy = jax.tree.map(lambda x: x, state)
  replaced = {
    path: leaf.replace(_at(pure, path)) if isinstance(leaf, _nnx().Variable) else _at(pure, path)
    for path, leaf in flat
  }
  copy.update(traverse_util.unflatten_dict(replaced))
  return copy


def _rebuilt(reference: Any, pure: Any) -> Any:
  """`reference` holding `pure`; ``nnx.Variable.replace`` stores a value as it is given."""
  if isinstance(reference, _nnx().State):
    return _replaced(reference, pure)
  return reference.replace(pure)


def restore_like(reference: Any, pure: Any) -> Any:
  """`pure`, a tree shaped like ``to_pure(reference)``, with the NNX objects of
  `reference` put back: each ``nnx.State`` and ``nnx.Variable`` of `reference`
  (its metadata kept) holds the values of `pure` at its place.

  Example:
    >>> restore_like({"w": 1.0}, {"w": 2.0})
    {'w': 2.0}
  """
  if first_nnx_path(reference) is None:
    return pure
  treedef = jax.tree.structure(reference, is_leaf=is_nnx)
  references = treedef.flatten_up_to(reference)
  parts = treedef.flatten_up_to(pure)
  return treedef.unflatten(
    _rebuilt(ref, part) if is_nnx(ref) else part for ref, part in zip(references, parts)
  )


def partition_specs(tree: Any) -> Any:
  """``nnx.get_partition_spec(tree)``: each ``nnx.Variable`` holding the `PartitionSpec`
  of its sharding metadata (``P()`` without any), its metadata kept."""
  return _nnx().get_partition_spec(tree)


_PLAIN = (
  "pass plain dicts of arrays (nnx.to_pure_dict(state)) and give their logical axes as "
  "nnx.get_partition_spec(state).to_pure_dict()"
)


def refuse(tree: Any, argument: str, where: str, *, how: str = _PLAIN) -> None:
  """Raises a TypeError when `tree` holds an NNX object, naming `argument` and the path.

  Args:
    tree: the argument's value.
    argument: the argument's name, as the message gives it.
    where: the function that takes it.
    how: what to pass instead, as the message says it.

  Raises:
    TypeError: naming `where`, `argument`, the path and `how`.

  Example:
    >>> refuse({"params": {"w": 1.0}}, "model_variables", "TrainState.create")
  """
  path = first_nnx_path(tree)
  if path is None:
    return
  raise TypeError(
    f"{where}: {argument} holds a flax NNX state at '{path}', which {where} does not take; {how}."
  )


def refuse_non_params(params: Any, where: str) -> None:
  """Raises a TypeError when `params` hold an ``nnx.Variable`` that is not an
  ``nnx.Param`` (a subclass of ``nnx.Param`` is one), or one whose value is an
  array ref (made with ``ref=True``), naming the first.

  An optimizer trains every leaf of its params: given ``nnx.state(model)``,
  it would move BatchNorm's running statistics (``nnx.BatchStat``) and the
  model's RNG state as if they were weights. Its update returns new arrays,
  which a ref, written in place, does not take.

  Args:
    params: the params an optimizer is created for.
    where: the function that takes them.

  Raises:
    TypeError: naming `where`, the path and the Variable's class.

  Example:
    >>> refuse_non_params({"w": 1.0}, "OptaxWrapper.create")
  """
  nnx = _nnx()
  if nnx is None:
    return
  found = jax.tree.flatten_with_path(params, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
  for path, leaf in found:
    if isinstance(leaf, nnx.Variable) and not isinstance(leaf, nnx.Param):
      raise TypeError(
        f"{where}: the params hold a {type(leaf).__name__} at '{key_path_str(path)}', an "
        "nnx.Variable that is not an nnx.Param, and an optimizer trains every leaf of its "
        "params; pass nnx.state(model, nnx.Param), or a pure dict of exactly the arrays to "
        "train."
      )
    if isinstance(leaf, nnx.Variable) and nnx.variablelib.is_array_ref(leaf.get_raw_value()):
      raise TypeError(
        f"{where}: the params hold an array ref at '{key_path_str(path)}' (an nnx.Variable "
        "made with ref=True), and an optimizer's update returns new arrays rather than "
        "writing refs; pass nnx.to_pure_dict(state), whose leaves are the arrays, and put the "
        "trained params back with nnx.replace_by_pure_dict."
      )
