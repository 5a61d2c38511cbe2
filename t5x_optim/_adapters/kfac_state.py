"""K-FAC optimizer states as T5X sees them: state dicts and logical axes.

`kfac_state_to_dict` writes a kfac-jax state as nested dicts keyed by field
name (the T5X state-dict layout), `kfac_state_from_dict` reads it back, and
`derive_kfac_logical_axes` gives every leaf its logical spec: velocities
their param's, Kronecker factors the names of the dimensions they span.
Imported by `t5x_optim._adapters.kfac` only, so it loads with kfac-jax.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec

try:
  import kfac_jax
except AttributeError as error:  # kfac-jax 0.0.8 reads jax.core names that jax 0.11 removed.
  raise ImportError(
    f"kfac-jax does not import with jax {jax.__version__} ({error}); K-FAC needs a kfac-jax "
    "release that supports this jax, or jax < 0.11."
  ) from error

from t5x_optim._axes.engine import StateRulesFallback, derive_state_specs
from t5x_optim._axes.registry import StateRuleContext, register_state_rule
from t5x_optim._axes.rules import is_spec_leaf
from t5x_optim._axes.specs import UNDERIVED
from t5x_optim._keypaths import key_path_str

__all__ = ["derive_kfac_logical_axes", "kfac_state_from_dict", "kfac_state_to_dict"]

_FACTOR_KEY = re.compile(r"^(\d+)_factor")


def kfac_state_to_dict(node: Any) -> Any:
  """A kfac-jax state as nested dicts keyed by field name, dict key or index.

  kfac-jax's state classes are dataclasses; their fields become keys, so the
  layout reads `velocities/...`, `estimator_state/blocks_states/0/factors/1/value`.
  Only plain tuples and lists are containers (a `PartitionSpec` is a leaf).

  Example:
    >>> import jax.numpy as jnp
    >>> kfac_state_to_dict({'a': (jnp.zeros(1), jnp.ones(()))})['a']['1']
    Array(1., dtype=float32)
  """
  if dataclasses.is_dataclass(node) and not isinstance(node, type):
    return {f.name: kfac_state_to_dict(getattr(node, f.name)) for f in dataclasses.fields(node)}
  if isinstance(node, Mapping):
    return {str(k): kfac_state_to_dict(v) for k, v in node.items()}
  if type(node) in (tuple, list):
    return {str(i): kfac_state_to_dict(v) for i, v in enumerate(node)}
  return node


def kfac_state_from_dict(reference: Any, nested: Any) -> Any:
  """Rebuilds a kfac-jax state of `reference`'s types from `kfac_state_to_dict` form."""
  if dataclasses.is_dataclass(reference) and not isinstance(reference, type):
    return dataclasses.replace(
      reference,
      **{
        f.name: kfac_state_from_dict(getattr(reference, f.name), nested[f.name])
        for f in dataclasses.fields(reference)
      },
    )
  if isinstance(reference, Mapping):
    return type(reference)(
      {k: kfac_state_from_dict(v, nested[str(k)]) for k, v in reference.items()}
    )
  if type(reference) in (tuple, list):
    return type(reference)(kfac_state_from_dict(v, nested[str(i)]) for i, v in enumerate(reference))
  return nested


def _dim_names(spec: PartitionSpec | None, rank: int) -> tuple[Any, ...]:
  """One logical name (or None) per dimension of a param."""
  entries = tuple(spec) if spec is not None else ()
  return entries + (None,) * (rank - len(entries))


def _rearrangement(rearrange_spec: str) -> tuple[str, list[str]]:
  """The source dims and, per output axis, the dims merged into it.

  `rearrange_spec` is kfac-jax's einops-style parameter rearrangement.

  Example:
    >>> _rearrangement('abc -> (ab)c'), _rearrangement('a -> 1a')
    (('abc', ['ab', 'c']), ('a', ['1', 'a']))
  """
  source, target = (side.strip() for side in rearrange_spec.split("->"))
  axes = [group or single for group, single in re.findall(r"\(([^)]*)\)|(\S)", target)]
  return source, axes


def _kronecker_axis_names(
  block: kfac_jax.KroneckerFactored,
  param_specs: Sequence[PartitionSpec | None],
) -> list[Any]:
  """The logical name of each Kronecker factor of `block`.

  Factor `k` approximates the curvature along axis `k` of the block's
  rearranged parameter array. It gets a param dimension's logical name when
  every param of the block maps one single dimension with that name onto axis
  `k` and the factor has that dimension's size (None when that dimension is
  replicated). A bias-augmented input factor (`in + 1`) or a merged axis (conv
  `(h w in)`) matches nothing: `UNDERIVED`.
  """
  names = []
  for axis, size in enumerate(block.array_shape):
    candidates = set()
    for shape, rearrange, spec in zip(
      block.parameters_shapes, block.parameters_specs, param_specs, strict=True
    ):
      source, axes = _rearrangement(rearrange)
      token = axes[axis] if axis < len(axes) else ""
      if len(token) != 1 or token not in source:
        candidates.add(None)
        continue
      dim = source.index(token)
      name = _dim_names(spec, len(shape))[dim]
      candidates.add((name, shape[dim]))
    match = candidates.pop() if len(candidates) == 1 else None
    names.append(match[0] if match is not None and match[1] == size else UNDERIVED)
  return names


def _factor_index(keys: tuple[str, ...]) -> int | None:
  """Which factor (or param) a block-state leaf belongs to, from its path."""
  if len(keys) >= 2 and keys[0] in ("factors", "diagonal_factors"):
    return int(keys[1])
  for key in keys:
    found = _FACTOR_KEY.match(key)
    if found:
      return int(found.group(1))
  return None


def _map_with_keys(fn: Any, nested: Any, keys: tuple[str, ...] = ()) -> Any:
  """Maps `fn(keys, leaf)` over the leaves of nested dicts."""
  if isinstance(nested, dict):
    return {k: _map_with_keys(fn, v, (*keys, k)) for k, v in nested.items()}
  return fn(keys, nested)


@dataclasses.dataclass(frozen=True)
class _BlockAxes:
  """What a curvature block's state leaves can be sharded by."""

  param_shapes: tuple[tuple[int, ...], ...]
  param_specs: tuple[PartitionSpec | None, ...]
  factor_names: tuple[Any, ...] | None

  @classmethod
  def of(cls, block: Any, param_specs: Sequence[PartitionSpec | None]) -> _BlockAxes:
    factor_names = (
      tuple(_kronecker_axis_names(block, param_specs))
      if isinstance(block, kfac_jax.KroneckerFactored)
      else None
    )
    shapes = tuple(tuple(s) for s in block.parameters_shapes)
    return cls(param_shapes=shapes, param_specs=tuple(param_specs), factor_names=factor_names)

  def spec(self, keys: tuple[str, ...], shape: tuple[int, ...]) -> Any:
    """The spec of the block-state leaf at `keys` (relative to the block)."""
    if all(spec is None for spec in self.param_specs):
      return None
    factor = _factor_index(keys)
    if factor is None:
      return UNDERIVED
    if self.factor_names is not None:
      name = self.factor_names[factor]
      if name is None or name is UNDERIVED:
        return name
      return PartitionSpec(name, *([None] * (len(shape) - 1)))
    if factor < len(self.param_shapes) and shape == self.param_shapes[factor]:
      return self.param_specs[factor]
    return UNDERIVED


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _KfacNode:
  """The node the engine derives a K-FAC state's specs on.

  Attributes:
    state: the kfac-jax state in `kfac_state_to_dict` form, so leaves are
      named by their state-dict keys.
    optimizer: the finalized `kfac_jax.Optimizer` that built the state (its
      curvature blocks say what each factor is).
  """

  state: Any
  optimizer: Any = dataclasses.field(metadata={"static": True})


def _kfac_rule(node: _KfacNode, specs: _KfacNode, context: StateRuleContext) -> _KfacNode:
  """The state rule for `_KfacNode`; see `derive_kfac_logical_axes`."""
  del specs
  param_specs = jax.tree.leaves(context.param_specs, is_leaf=is_spec_leaf)
  estimator = node.optimizer._estimator  # pylint: disable=protected-access
  blocks = [
    _BlockAxes.of(block, [param_specs[i] for i in indices])
    for block, indices in zip(estimator.blocks, estimator.jaxpr.layer_indices, strict=True)
  ]
  velocity_specs = kfac_state_to_dict(context.param_specs)

  def spec(keys: tuple[str, ...], leaf: Any) -> Any:
    if leaf is None:  # A diagonal block's empty cache.
      return None
    shape = tuple(leaf.shape)
    if all(d == 1 for d in shape):
      return None
    if keys[0] == "velocities":
      found = velocity_specs
      for key in keys[1:]:
        found = found[key]
      return found
    if keys[:2] == ("estimator_state", "blocks_states"):
      return blocks[int(keys[2])].spec(keys[3:], shape)
    return UNDERIVED

  return _KfacNode(_map_with_keys(spec, node.state), node.optimizer)


register_state_rule(
  _KfacNode,
  _kfac_rule,
  underived_reason="K-FAC state leaves that match no single param dimension",
)


def _leaf_name(path: jax.tree_util.KeyPath) -> str:
  """A K-FAC state leaf's state-dict key (`estimator_state/blocks_states/0/...`)."""
  return key_path_str(path[1:])


def derive_kfac_logical_axes(
  kfac_optimizer: kfac_jax.Optimizer,
  kfac_state: Any,
  params: Any,
  param_logical_axes: Any,
  *,
  fallback: StateRulesFallback = StateRulesFallback.REPLICATE_WITH_WARNING,
) -> Any:
  """Logical specs for every leaf of a kfac-jax optimizer state.

  Velocities get their param's spec. Kronecker factor `k` of a block (and its
  cached inverse, eigenvectors and eigenvalues) is sharded along its first
  dimension by the logical name of the param dimension it corresponds to:
  for a dense kernel with axes `('embed', 'mlp')` the `(in, in)` factor is
  `('embed', None)` and the `(out, out)` factor `('mlp', None)`. Diagonal
  blocks' factors get their param's spec. Scalars and the blocks of
  replicated params are replicated; leaves that match no single param
  dimension (bias-augmented `(in + 1, in + 1)` factors, conv factors over
  merged dimensions, full blocks) go to `fallback`. The derivation is the
  state rule of the axes engine's registry for K-FAC states.

  Args:
    kfac_optimizer: the finalized `kfac_jax.Optimizer` that built the state.
    kfac_state: its state (arrays or `jax.ShapeDtypeStruct`s).
    params: the params (arrays or `jax.ShapeDtypeStruct`s).
    param_logical_axes: the params' axes, in any form `logical_axes_from`
      accepts.
    fallback: what to do with leaves that match no param dimension.

  Returns:
    a tree with `kfac_state`'s structure whose leaves are `PartitionSpec`s or
    None (replicated).

  Raises:
    ValueError: if the optimizer was not initialised yet, the axes do not fit
      the params, or (with `StateRulesFallback.RAISE`) a leaf matches nothing.
  """
  if not kfac_optimizer.finalized:
    raise ValueError(
      "The kfac_jax.Optimizer is not finalized: create the optimizer state "
      "(KfacOptimizerDef.create or jax.eval_shape of it) before deriving axes."
    )
  node = _KfacNode(kfac_state_to_dict(kfac_state), kfac_optimizer)
  nested_specs = derive_state_specs(
    node, param_logical_axes, params=params, fallback=fallback, leaf_name=_leaf_name
  ).state
  return kfac_state_from_dict(kfac_state, nested_specs)
