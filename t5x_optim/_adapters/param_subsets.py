"""Which params each `MultiOptimizer` pair owns: traversals and the partition they make.

A traversal is a `PathFilter` (regexes searched in the '/'-joined param path,
gin-friendly), a regex or list of regexes (shorthand for a `PathFilter`), or a
`flax.traverse_util.ModelParamTraversal`. A `Partition` splits a params-like
tree into one subtree per traversal (with the params' nesting, holding only the
selected leaves) and merges the sub-optimizers' results back.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any, Protocol

import flax
import jax
from flax import traverse_util
from flax.core import FrozenDict

from t5x_optim._core import state_dict as _state_dict
from t5x_optim._core.interface import structure_mismatch

__all__ = [
  "FlaxTraversal",
  "Partition",
  "PathFilter",
  "Traversal",
  "as_traversal",
  "describe_traversal",
  "format_paths",
  "is_none",
  "subset",
  "traversal_mask",
]

_MAX_LISTED_PATHS = 10


class FlaxTraversal(Protocol):
  """What `MultiOptimizer` needs of a `flax.traverse_util.Traversal`."""

  def update(self, fn: Any, inputs: Any) -> Any:
    """Returns `inputs` with `fn` applied to every selected leaf."""


class PathFilter:
  """Selects params whose '/'-joined path matches a regex.

  Paths have no leading '/' (``'encoder/layers_0/mlp/wi/kernel'``). Each
  pattern is applied with `re.search`, so it matches anywhere in the path;
  anchor it with ``^`` and ``$`` to match the whole path. Built from plain
  constructor arguments, so gin can configure it.

  Args:
    patterns: a regex or a list of regexes; a path is selected when any of
      them matches.
    invert: select the paths that no pattern matches instead.

  Example:
    >>> kernels = PathFilter(r'kernel$')
    >>> kernels.matches('dense/kernel'), kernels.matches('dense/bias')
    (True, False)
    >>> PathFilter(['bias', 'scale'], invert=True).matches('dense/kernel')
    True
  """

  def __init__(self, patterns: str | Sequence[str], *, invert: bool = False):
    patterns = (patterns,) if isinstance(patterns, str) else tuple(patterns)
    if not patterns:
      raise ValueError("PathFilter needs at least one pattern.")
    try:
      self._regexes = tuple(re.compile(pattern) for pattern in patterns)
    except re.error as error:
      raise ValueError(f"PathFilter got an invalid regex in {list(patterns)}: {error}") from error
    self.patterns = patterns
    self.invert = invert

  def matches(self, path: str) -> bool:
    """True when the '/'-joined `path` is selected."""
    return any(regex.search(path) for regex in self._regexes) != self.invert

  def __repr__(self) -> str:
    patterns = self.patterns[0] if len(self.patterns) == 1 else list(self.patterns)
    invert = ", invert=True" if self.invert else ""
    return f"PathFilter({patterns!r}{invert})"

  def __eq__(self, other: object) -> bool:
    if not isinstance(other, PathFilter):
      return NotImplemented
    return (self.patterns, self.invert) == (other.patterns, other.invert)

  def __hash__(self) -> int:
    return hash((self.patterns, self.invert))


Traversal = PathFilter | FlaxTraversal | str | Sequence[str]


def as_traversal(traversal: Traversal, index: int) -> PathFilter | FlaxTraversal:
  if isinstance(traversal, str) or (
    isinstance(traversal, Sequence) and all(isinstance(p, str) for p in traversal)
  ):
    return PathFilter(traversal)
  if isinstance(traversal, PathFilter) or callable(getattr(traversal, "update", None)):
    return traversal
  raise TypeError(
    f"Traversal {index} is a {type(traversal).__name__}; expected a PathFilter, a regex "
    "or list of regexes, or a flax.traverse_util.ModelParamTraversal."
  )


def describe_traversal(index: int, traversal: PathFilter | FlaxTraversal) -> str:
  if isinstance(traversal, PathFilter):
    return f"filter {index} {traversal!r}"
  return f"filter {index} ({type(traversal).__name__})"


class _Selected:
  """Marks a leaf a flax traversal selected (an opaque pytree leaf)."""


def traversal_mask(traversal: FlaxTraversal, keys: list[tuple[str, ...]], tree: Any) -> list[bool]:
  """Which leaves a flax traversal selects, through its public `update`."""
  marked = traversal.update(lambda _: _Selected(), tree)
  flat = traverse_util.flatten_dict(flax.core.unfreeze(marked))
  selected = {tuple(map(str, key)) for key, value in flat.items() if isinstance(value, _Selected)}
  return [key in selected for key in keys]


def subset(node: Any, keep: frozenset[int], path: tuple[str, ...]) -> Any:
  """The part of an index tree whose leaves are in `keep`, same containers."""
  if isinstance(node, int):
    return node if node in keep else None
  if not isinstance(node, dict | FrozenDict):
    raise TypeError(
      f"MultiOptimizer params must be nested dicts or FrozenDicts; found a "
      f"{type(node).__name__} at '{_state_dict.key_path_str(path)}'."
    )
  kept = {}
  for key, child in node.items():
    child = subset(child, keep, (*path, str(key)))
    if child is not None:
      kept[key] = child
  if not kept and path:
    return None
  return FrozenDict(kept) if isinstance(node, FrozenDict) else kept


@dataclasses.dataclass(frozen=True)
class Partition:
  """Which leaves (by flat index) each sub-optimizer owns, for one treedef.

  Attributes:
    treedef: the params' treedef.
    plain_treedef: the same tree with plain dicts (to align FrozenDict trees).
    groups: per sub-optimizer, the flat indices of its leaves, in the order of
      its subtree's leaves.
    sub_treedefs: per sub-optimizer, the treedef of its subtree.
  """

  treedef: jax.tree_util.PyTreeDef
  plain_treedef: jax.tree_util.PyTreeDef
  groups: tuple[tuple[int, ...], ...]
  sub_treedefs: tuple[jax.tree_util.PyTreeDef, ...]

  def split(self, leaves: Sequence[Any]) -> list[Any]:
    """Builds each sub-optimizer's subtree from the full tree's leaves."""
    return [
      sub_def.unflatten([leaves[j] for j in group])
      for sub_def, group in zip(self.sub_treedefs, self.groups)
    ]

  def merge(self, leaves: Sequence[Any], subtrees: Sequence[Any]) -> Any:
    """The full tree with each sub-optimizer's leaves taken from `subtrees`."""
    merged = list(leaves)
    for i, (group, subtree) in enumerate(zip(self.groups, subtrees)):
      sub_leaves = jax.tree.leaves(subtree, is_leaf=is_none)
      if len(sub_leaves) != len(group):
        raise ValueError(
          f"Sub-optimizer {i} returned {len(sub_leaves)} params for its {len(group)}: "
          f"{jax.tree.structure(subtree)} instead of {self.sub_treedefs[i]}."
        )
      for j, leaf in zip(group, sub_leaves):
        merged[j] = leaf
    return self.treedef.unflatten(merged)

  def leaves_of(self, tree: Any, *, name: str, reference: Any) -> list[Any]:
    """`tree`'s leaves in the params' order; dicts and FrozenDicts mix freely.

    None leaves (e.g. replicated logical axes) count as leaves.

    Raises:
      ValueError: when `tree` does not have the params' structure, naming the
        paths only one of them has.
    """
    try:
      return self.treedef.flatten_up_to(tree)
    except (TypeError, ValueError):
      pass
    try:
      return self.plain_treedef.flatten_up_to(flax.core.unfreeze(tree))
    except (TypeError, ValueError) as error:
      mismatch = structure_mismatch(tree, reference, name=name)
      raise ValueError(f"The {name} do not fit the params: {mismatch}.") from error


def format_paths(paths: Sequence[str]) -> str:
  """The first paths of `paths`, comma-separated, and how many more there are."""
  listed = ", ".join(paths[:_MAX_LISTED_PATHS])
  more = len(paths) - _MAX_LISTED_PATHS
  return listed + (f" and {more} more" if more > 0 else "")


def is_none(x: Any) -> bool:
  """Whether `x` is None (an `is_leaf` that keeps None leaves in a flattened tree)."""
  return x is None
