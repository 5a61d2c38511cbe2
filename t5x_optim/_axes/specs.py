"""Small pure helpers on logical PartitionSpecs and pytree definitions.

Shared by the state-rule engine, the generic derivation and the built-in rules.
A *canonical* spec is either ``None`` (replicated) or a ``PartitionSpec`` whose
length equals the rank of the array it describes, that names at least one
logical axis and that names no axis twice.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np
from flax.core import frozen_dict
from jax.sharding import PartitionSpec


class _Underived:
  """Marker for a state leaf whose spec has not been derived (yet)."""

  _instance: _Underived | None = None

  def __new__(cls) -> _Underived:
    if cls._instance is None:
      cls._instance = super().__new__(cls)
    return cls._instance

  def __repr__(self) -> str:
    return "UNDERIVED"

  def __reduce__(self) -> str:
    return "UNDERIVED"


UNDERIVED = _Underived()
"""The one "not derived" marker: a spec-tree leaf whose spec is not known (yet).

State rules receive it for leaves not derived so far and may keep it (the
fallback policy then decides) or replace it. It is a pytree leaf, so
``rules.is_spec_leaf`` walks spec trees that hold it.
"""


def entry_names(entry: Any) -> tuple[str, ...]:
  """The logical names in one entry of a PartitionSpec (None, a name or a tuple)."""
  if entry is None:
    return ()
  if isinstance(entry, str):
    return (entry,)
  if isinstance(entry, tuple):
    return tuple(name for name in entry if isinstance(name, str))
  return ()


def spec_names(spec: PartitionSpec | None) -> tuple[str, ...]:
  """All logical names a spec uses, in order, repeats included."""
  if spec is None:
    return ()
  return tuple(name for entry in spec for name in entry_names(entry))


@functools.lru_cache(maxsize=4096)
def drop_repeated_names(spec: PartitionSpec | None) -> PartitionSpec | None:
  """Keeps the first use of every name; later uses become None.

  This matches ``flax.linen.logical_to_mesh_axes``, which assigns a mesh axis to
  the first logical dimension that asks for it.

  >>> drop_repeated_names(PartitionSpec('embed', 'embed'))
  P('embed', None)
  """
  if spec is None:
    return None
  seen: set[str] = set()
  entries = []
  for entry in spec:
    kept = tuple(n for n in entry_names(entry) if n not in seen)
    seen.update(kept)
    if not kept:
      entries.append(None)
    elif isinstance(entry, tuple):
      entries.append(kept)
    else:
      entries.append(kept[0])
  return PartitionSpec(*entries)


@functools.lru_cache(maxsize=4096)
def one_name_per_dim(spec: PartitionSpec | None) -> PartitionSpec | None:
  """Keeps the first (major) logical name of an entry that names several.

  Sharding-in-types gives a dimension merged from several (a param
  flattened by ``reshape(-1)``) all their names, ``P(('embed', 'mlp'))``.
  A logical spec names one axis per dimension: rule tables
  (``flax.linen.logical_to_mesh_axes``) would pass a tuple through as mesh
  axes. The major name shards the merged dimension in contiguous blocks,
  as that param dimension is sharded.

  >>> one_name_per_dim(PartitionSpec(('embed', 'mlp'), None))
  P('embed', None)
  """
  if spec is None:
    return None
  entries = []
  for entry in spec:
    names = entry_names(entry)
    entries.append(names[0] if names else None)
  return PartitionSpec(*entries)


@functools.lru_cache(maxsize=4096)
def canonical(spec: PartitionSpec | None, rank: int) -> PartitionSpec | None:
  """Pads ``spec`` to ``rank`` and maps a spec naming no axis to None.

  Specs longer than ``rank`` are returned unchanged so that validation reports
  them.

  >>> canonical(PartitionSpec('embed'), 2)
  P('embed', None)
  >>> canonical(PartitionSpec(None, None), 2) is None
  True
  """
  if spec is None or not spec_names(spec):
    return None
  if len(spec) < rank:
    return PartitionSpec(*spec, *([None] * (rank - len(spec))))
  return spec


def spec_problem(spec: Any, shape: Sequence[int]) -> str | None:
  """Why ``spec`` cannot describe an array of ``shape``, or None if it can."""
  if spec is None:
    return None
  return _spec_problem(spec, len(shape))


@functools.lru_cache(maxsize=4096)
def _spec_problem(spec: Any, rank: int) -> str | None:
  if spec is UNDERIVED:
    return "no spec could be derived"
  if not isinstance(spec, PartitionSpec):
    return f"{type(spec).__name__} is not a PartitionSpec"
  if len(spec) != rank:
    return f"spec has {len(spec)} entries for a rank-{rank} leaf"
  names = spec_names(spec)
  if len(set(names)) != len(names):
    return "spec names an axis twice"
  return None


def leaf_shape(leaf: Any) -> tuple[int, ...]:
  """The shape of an array, ShapeDtypeStruct or Python scalar."""
  shape = getattr(leaf, "shape", None)
  return tuple(shape) if shape is not None else tuple(np.shape(leaf))


def thaw(tree: Any) -> Any:
  """Replaces every (nested) FrozenDict by a dict; other nodes are kept."""
  if isinstance(tree, (dict, frozen_dict.FrozenDict)):
    return {k: thaw(v) for k, v in tree.items()}
  return tree


def freeze_top(tree: Any) -> Any:
  """The FrozenDict form of a dict tree (FrozenDict freezes nested dicts)."""
  if isinstance(tree, dict):
    return frozen_dict.FrozenDict(tree)
  return tree


def subtree_offsets(
  treedef: jax.tree_util.PyTreeDef, match
) -> Iterator[tuple[int, jax.tree_util.PyTreeDef]]:
  """Pre-order ``(leaf offset, node)`` of the outermost nodes ``match`` accepts.

  Args:
    treedef: the structure to walk.
    match: predicate on a node's PyTreeDef; matching nodes are not entered.

  Yields:
    the flat-leaf offset where each matching node starts, and the node.

  >>> d = jax.tree.structure((1, {'a': 2}))
  >>> [o for o, _ in subtree_offsets(d, lambda n: n.num_leaves == 1)]
  [0, 1]
  """
  stack = [(treedef, 0)]
  while stack:
    node, offset = stack.pop()
    if match(node):
      yield offset, node
      continue
    children = node.children()
    starts = np.cumsum([0] + [c.num_leaves for c in children[:-1]]) + offset
    stack.extend(reversed(list(zip(children, starts.tolist()))))
