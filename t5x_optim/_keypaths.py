"""Key paths as every message of the package writes them: '/'-joined.

The one helper for naming a leaf of a tree (params, grads, optimizer
states, state dicts, checkpoints) in errors, warnings and checksums. It
imports no other t5x_optim module, so every layer may import it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

__all__ = ["key_path_str", "leaf_paths"]


def key_path_str(path: Sequence[Any]) -> str:
  """A path '/'-joined, as errors and checksums about state dicts name it.

  `path` is a jax key path (`DictKey`, `SequenceKey`, `GetAttrKey`, ...
  entries) or a tuple of state-dict keys; each key is written as
  `jax.tree_util.keystr` writes it with ``simple=True``. The empty path is
  ``<root>``.

  Example:
    >>> key_path_str(jax.tree.flatten_with_path({"a": [1]})[0][0][0])
    'a/0'
    >>> key_path_str(("state", "step")), key_path_str(())
    ('state/step', '<root>')
  """
  return jax.tree_util.keystr(tuple(path), simple=True, separator="/") or "<root>"


def leaf_paths(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> set[str]:
  """The paths of `tree`'s leaves, as `key_path_str` writes them.

  Example:
    >>> sorted(leaf_paths({"a": [1, 2], "b": 3}))
    ['a/0', 'a/1', 'b']
  """
  return {key_path_str(path) for path, _ in jax.tree.flatten_with_path(tree, is_leaf=is_leaf)[0]}
