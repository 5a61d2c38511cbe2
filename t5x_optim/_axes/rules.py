"""Logical axis rules: from logical axis names to mesh axes.

A *logical spec* names each array dimension with a model-level name
(``PartitionSpec('embed', 'mlp')``); *rules* map those names to mesh axes
(``('mlp', 'model')``); the result is a *mesh spec* (``PartitionSpec(None,
'model')``) that ``jax.sharding.NamedSharding`` understands.

Conversion follows ``flax.linen.logical_to_mesh_axes``: rules are tried in
order of precedence, and a rule applies only when its mesh axes are not yet
used by another dimension of the same spec. A logical name may therefore have
several rules (a fallback chain); a dimension whose rules all lose to
earlier ones stays replicated. That is how ``('batch', 'embed')`` under
2-D parameter rules becomes ``PartitionSpec('data', None)``: ``batch`` claims ``data``
first and ``embed`` falls back to replication, so a mesh spec never repeats a
mesh axis. Unlike flax, a name with no rule at all is an error unless the
caller asks for replication with :class:`UnknownAxis`.

ZeRO-style optimizer-state sharding (which T5X cannot do) is a property of the
rule set: :attr:`LogicalAxisRules.optimizer_state_axis` names a mesh axis (by
default ``'data'``) that each optimizer-state leaf is additionally sharded over,
on its first replicated dimension that the axis size divides, else joined to a
sharded dimension (:func:`add_optimizer_state_axis`). Parameters keep the plain
rules, so per-device optimizer state shrinks by the axis size while parameter
sharding is unchanged.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec

from t5x_optim._keypaths import key_path_str

MeshAxes = str | tuple[str, ...] | None
"""What one rule maps a logical name to: a mesh axis, several, or None."""

Rule = tuple[str, MeshAxes]
"""One ``(logical_name, mesh_axes)`` pair."""

_UNASSIGNED = object()


class UnknownAxis(enum.Enum):
  """What to do with a logical axis name that no rule mentions.

  Attributes:
    RAISE: raise a ``ValueError`` naming the axis (the default).
    REPLICATE: leave the dimension unsharded, as flax does.

  Example:
    >>> UnknownAxis('replicate') is UnknownAxis.REPLICATE
    True
  """

  RAISE = "raise"
  REPLICATE = "replicate"


@dataclasses.dataclass(frozen=True)
class LogicalAxisRules:
  """An ordered set of logical-axis rules plus the ZeRO option.

  Iterating yields the ``(logical_name, mesh_axes)`` pairs, so
  ``tuple(rules)`` is what ``flax.linen.logical_axis_rules`` expects.

  Attributes:
    rules: ``(logical_name, mesh_axes)`` pairs in order of precedence.
    optimizer_state_axis: mesh axis that optimizer-state leaves are also
      sharded over (ZeRO-style), or None to shard them like parameters.

  Example:
    >>> rules = LogicalAxisRules([('batch', 'data'), ('mlp', 'model')])
    >>> tuple(rules)
    (('batch', 'data'), ('mlp', 'model'))
  """

  rules: tuple[Rule, ...]
  optimizer_state_axis: str | None = None

  def __post_init__(self):
    object.__setattr__(self, "rules", _normalize_rules(self.rules))

  def __iter__(self) -> Iterator[Rule]:
    return iter(self.rules)

  def __len__(self) -> int:
    return len(self.rules)


def _normalize_rules(rules: Sequence[Sequence[Any]]) -> tuple[Rule, ...]:
  if isinstance(rules, str):
    raise ValueError(
      f"Logical axis rules are a sequence of (logical_name, mesh_axes) pairs, not the str "
      f"{rules!r}."
    )
  normalized = []
  for rule in rules:
    if isinstance(rule, str) or len(rule) != 2 or not isinstance(rule[0], str):
      raise ValueError(f"A logical axis rule is a (logical_name, mesh_axes) pair; got {rule!r}.")
    name, mesh_axes = rule
    if isinstance(mesh_axes, list):
      mesh_axes = tuple(mesh_axes)
    if not (
      mesh_axes is None
      or isinstance(mesh_axes, str)
      or (isinstance(mesh_axes, tuple) and all(isinstance(a, str) for a in mesh_axes))
    ):
      raise ValueError(
        f"Logical axis rule {(name, mesh_axes)!r}: mesh_axes is None, a mesh axis name or a "
        f"tuple of names, not {type(mesh_axes).__name__}."
      )
    normalized.append((name, mesh_axes))
  return tuple(normalized)


def as_logical_axis_rules(
  rules: LogicalAxisRules | Sequence[Sequence[Any]],
) -> LogicalAxisRules:
  """Returns ``rules`` as :class:`LogicalAxisRules` (a list of pairs has no ZeRO).

  Example:
    >>> as_logical_axis_rules([('batch', 'data')]).optimizer_state_axis is None
    True
  """
  if isinstance(rules, LogicalAxisRules):
    return rules
  return LogicalAxisRules(_normalize_rules(rules))


def standard_logical_axis_rules(
  *,
  activation_partitioning_dims: int = 1,
  parameter_partitioning_dims: int = 1,
  shard_optimizer_state_over_data: bool = False,
  additional_rules: Sequence[Rule] | None = None,
) -> LogicalAxisRules:
  """The standard rules for a ``('data', 'model')`` mesh, as in T5X.

  ``batch`` goes on ``data``; ``vocab``, ``mlp``, ``heads`` and ``joined_kv``
  on ``model``; ``embed`` and ``kv`` stay replicated. With 2-D activation
  partitioning ``embed`` goes on ``model`` (activations rarely have another
  ``model`` dimension); with 2-D parameter partitioning ``embed`` falls back
  to ``data`` (parameters have no ``batch``). Axes common in transformer
  codebases (``length``, ``layers``, ``relpos_buckets``, ...) are replicated.

  Args:
    activation_partitioning_dims: 1 or 2.
    parameter_partitioning_dims: 1 or 2.
    shard_optimizer_state_over_data: also shard every optimizer-state leaf
      over ``data`` (ZeRO); see :func:`add_optimizer_state_axis`.
    additional_rules: appended last, so they cannot override the rules above.

  Returns:
    The rules.

  Raises:
    ValueError: for partitioning dims other than 1 or 2.

  Example:
    >>> rules = standard_logical_axis_rules(parameter_partitioning_dims=2)
    >>> logical_to_mesh_axes(PartitionSpec('embed', 'mlp'), rules)
    P('data', 'model')
  """
  for name, dims in (
    ("activation_partitioning_dims", activation_partitioning_dims),
    ("parameter_partitioning_dims", parameter_partitioning_dims),
  ):
    if dims not in (1, 2):
      raise ValueError(f"{name} must be 1 or 2, got {dims}.")
  rules: list[Rule] = [
    ("batch", "data"),
    ("vocab", "model"),
    ("mlp", "model"),
    ("heads", "model"),
    ("joined_kv", "model"),
    ("kv", None),
  ]
  if activation_partitioning_dims == 2:
    rules.append(("embed", "model"))
  if parameter_partitioning_dims == 2:
    rules.append(("embed", "data"))
  rules.append(("embed", None))
  rules.extend(
    (name, None)
    for name in ("length", "layers", "stack", "relpos_buckets", "abspos_buckets", "mlp_activations")
  )
  rules.extend(additional_rules or ())
  return LogicalAxisRules(
    tuple(rules), optimizer_state_axis="data" if shard_optimizer_state_over_data else None
  )


def mesh_axis_names(mesh_axes: Any) -> set[str]:
  """The mesh axis names in one spec entry (a name, a tuple of names, None)."""
  if mesh_axes is None or mesh_axes is _UNASSIGNED or mesh_axes is PartitionSpec.UNCONSTRAINED:
    return set()
  if isinstance(mesh_axes, str):
    return {mesh_axes}
  return set(mesh_axes)


def logical_to_mesh_axes(
  spec: PartitionSpec | None,
  rules: LogicalAxisRules | Sequence[Rule],
  *,
  unknown: UnknownAxis | str = UnknownAxis.RAISE,
) -> PartitionSpec | None:
  """Maps one logical spec to a mesh spec.

  Rules apply in order; a rule is skipped when its mesh axes are already used
  by another dimension of ``spec``. ``None`` and ``PartitionSpec.UNCONSTRAINED``
  entries pass through; a ``None`` spec (replicated) stays ``None``.

  Args:
    spec: the logical spec.
    rules: the rules (``optimizer_state_axis`` plays no part here).
    unknown: what to do with a name that no rule mentions.

  Returns:
    The mesh spec, or None for a None spec.

  Raises:
    ValueError: a name without a rule (under ``UnknownAxis.RAISE``), or a
      name used twice in ``spec``.

  Example:
    >>> rules = [('batch', 'data'), ('embed', None), ('mlp', 'model')]
    >>> logical_to_mesh_axes(PartitionSpec('batch', 'embed', 'mlp'), rules)
    P('data', None, 'model')
  """
  if spec is None:
    return None
  unknown = UnknownAxis(unknown)
  names = tuple(spec)
  repeated = sorted(
    n for n, c in collections.Counter(names).items() if isinstance(n, str) and c > 1
  )
  if repeated:
    raise ValueError(f"Logical axis names {repeated} occur more than once in {spec}.")
  ruled = {name for name, _ in rules}
  for dim, entry in enumerate(names):
    if isinstance(entry, tuple) and ruled.intersection(entry):
      raise ValueError(
        f"dimension {dim} of {spec} names the logical axes {entry}; a logical spec names one "
        f"axis per dimension (a tuple of names without rules passes through as mesh axes)."
      )
  result: list[Any] = [_UNASSIGNED if isinstance(n, str) else n for n in names]
  known = set()
  for name, mesh_axes in rules:
    if name not in names:
      continue
    known.add(name)
    pos = names.index(name)
    used = set().union(*(mesh_axis_names(r) for r in result))
    if result[pos] is _UNASSIGNED and not (mesh_axis_names(mesh_axes) & used):
      result[pos] = mesh_axes
  missing = [n for n in names if isinstance(n, str) and n not in known]
  if missing and unknown is UnknownAxis.RAISE:
    raise ValueError(
      f"No logical axis rule for {missing} in {spec}; add a rule or pass "
      f"unknown=UnknownAxis.REPLICATE."
    )
  return PartitionSpec(*(None if r is _UNASSIGNED else r for r in result))


def add_optimizer_state_axis(
  spec: PartitionSpec | None,
  shape: Sequence[int],
  *,
  mesh_axis: str,
  mesh_shape: Mapping[str, int],
) -> PartitionSpec | None:
  """Adds ``mesh_axis`` to one dimension of an optimizer-state leaf (ZeRO).

  The axis goes on the first replicated dimension whose size is a positive
  multiple of the axis size. Failing that, it joins the first sharded
  dimension that the combined size divides (``'model'`` becomes
  ``('model', 'data')``), so a leaf sharded on every dimension shrinks too.
  The leaf is left as it is when ``mesh_axis`` already appears in ``spec``,
  when the axis has size 1, or when no dimension divides (scalars, odd sizes).

  Args:
    spec: the leaf's mesh spec (None means replicated).
    shape: the leaf's shape.
    mesh_axis: the mesh axis to add, usually ``'data'``.
    mesh_shape: mesh axis sizes, e.g. ``mesh.shape``.

  Returns:
    The new mesh spec (``spec`` itself when unchanged).

  Example:
    >>> mesh_shape = {'data': 2, 'model': 4}
    >>> add_optimizer_state_axis(PartitionSpec(None, 'model'), (6, 8),
    ...                          mesh_axis='data', mesh_shape=mesh_shape)
    P('data', 'model')
    >>> add_optimizer_state_axis(PartitionSpec('model'), (16,),
    ...                          mesh_axis='data', mesh_shape=mesh_shape)
    P(('model', 'data'),)
  """
  axis_size = mesh_shape[mesh_axis]
  entries = list(spec or ())
  if axis_size == 1 or any(mesh_axis in mesh_axis_names(e) for e in entries):
    return spec
  given = len(entries)
  entries += [None] * (len(shape) - given)
  for dim, (entry, size) in enumerate(zip(entries, shape)):
    if entry is None and size >= axis_size and size % axis_size == 0:
      entries[dim] = mesh_axis
      return PartitionSpec(*entries[: max(given, dim + 1)])
  for dim, (entry, size) in enumerate(zip(entries, shape)):
    names = mesh_axis_names(entry)
    if not names:
      continue
    combined = math.prod(mesh_shape[n] for n in names) * axis_size
    if size % combined == 0:
      entries[dim] = (*((entry,) if isinstance(entry, str) else entry), mesh_axis)
      return PartitionSpec(*entries)
  return spec


def drop_indivisible_axes(
  spec: PartitionSpec | None, shape: Sequence[int], mesh_shape: Mapping[str, int]
) -> PartitionSpec | None:
  """Drops from each dimension of ``spec`` the mesh axes its size does not divide.

  The last-named axes of a dimension go first, until the rest divide it; a
  dimension that no axis divides is replicated. The partitioner applies this
  to optimizer-state leaves only (a parameter's indivisible dimension is an
  error): a leaf derived from a parameter, such as the block scales of an
  8-bit moment with fewer blocks than a mesh axis has devices, is then
  replicated along that dimension instead of refusing the mesh.

  Example:
    >>> drop_indivisible_axes(PartitionSpec(('model', 'data')), (8,), {'data': 2, 'model': 16})
    P(None,)
    >>> drop_indivisible_axes(PartitionSpec(('model', 'data')), (16,), {'data': 4, 'model': 8})
    P('model',)
  """
  if spec is None:
    return None
  entries = []
  for entry, size in zip(spec, shape):
    if entry is PartitionSpec.UNCONSTRAINED:
      entries.append(entry)
      continue
    names = [entry] if isinstance(entry, str) else list(entry or ())
    while names and size % math.prod(mesh_shape[n] for n in names):
      names.pop()
    entries.append(None if not names else names[0] if len(names) == 1 else tuple(names))
  fitted = PartitionSpec(*entries, *spec[len(shape) :])
  return spec if fitted == spec else fitted


def _check_entries(
  where: str, shape: Sequence[int], spec: PartitionSpec, mesh_shape: Mapping[str, int]
) -> None:
  if len(spec) > len(shape):
    raise ValueError(
      f"{where}: sharding {spec} has {len(spec)} entries but the leaf has shape {tuple(shape)}."
    )
  for entry in spec:
    missing = sorted(mesh_axis_names(entry) - set(mesh_shape))
    if missing:
      raise ValueError(
        f"{where}: mesh axes {missing} of {spec} are not in the mesh {dict(mesh_shape)}."
      )


def check_leaf_spec(
  where: str, shape: Sequence[int], spec: PartitionSpec | None, mesh_shape: Mapping[str, int]
) -> None:
  """Raises ``ValueError`` naming ``where`` unless ``spec`` fits the leaf on the mesh.

  It fits when it has no more entries than the leaf has dimensions, names
  only axes of the mesh, and each dimension's size divides by its axes'.

  Example:
    >>> check_leaf_spec('w', (8, 6), PartitionSpec(None, 'model'), {'data': 2, 'model': 3})
  """
  spec = spec or PartitionSpec()
  _check_entries(where, shape, spec, mesh_shape)
  for dim, entry in enumerate(spec):
    size = math.prod(mesh_shape[a] for a in mesh_axis_names(entry))
    if shape[dim] % size:
      raise ValueError(
        f"{where}: dimension {dim} of shape {tuple(shape)} is not divisible by mesh "
        f"axis {entry!r} of size {size} (sharding {spec}, mesh {dict(mesh_shape)})."
      )


def fit_state_spec(
  where: str,
  spec: PartitionSpec | None,
  shape: Sequence[int],
  *,
  mesh_shape: Mapping[str, int],
  axis: str | None,
) -> PartitionSpec | None:
  """An optimizer-state leaf's mesh spec, fitted to its shape and the mesh.

  The mesh axes a dimension does not divide are dropped
  (:func:`drop_indivisible_axes`); then ``axis`` (ZeRO), when given, is added
  (:func:`add_optimizer_state_axis`).

  Raises:
    ValueError: naming ``where``, for a spec with more entries than the leaf
      has dimensions or with mesh axes that are not in the mesh.

  Example:
    >>> fit_state_spec('mu', PartitionSpec('model'), (6,), mesh_shape={'data': 2, 'model': 4},
    ...                axis='data')
    P('data',)
  """
  _check_entries(where, shape, spec or PartitionSpec(), mesh_shape)
  spec = drop_indivisible_axes(spec, shape, mesh_shape)
  if axis is None:
    return spec
  return add_optimizer_state_axis(spec, shape, mesh_axis=axis, mesh_shape=mesh_shape)


def is_spec_leaf(x: Any) -> bool:
  """True for the leaves of a logical or mesh axes tree (PartitionSpec or None)."""
  return x is None or isinstance(x, PartitionSpec)


def check_spec_leaf(path: jax.tree_util.KeyPath, leaf: Any) -> None:
  """Raises ``TypeError`` naming ``path`` unless ``leaf`` is a spec leaf."""
  if not is_spec_leaf(leaf):
    raise TypeError(
      f"{key_path_str(path)}: expected a PartitionSpec or None, got {type(leaf).__name__} {leaf!r}."
    )


def logical_to_mesh_axes_tree(
  logical_tree: Any,
  rules: LogicalAxisRules | Sequence[Rule],
  *,
  unknown: UnknownAxis | str = UnknownAxis.RAISE,
) -> Any:
  """Maps a tree of logical specs to a tree of mesh specs (for parameters).

  ``None`` leaves stay ``None`` (replicated). Empty nodes such as
  ``optax.EmptyState()`` and ``optax.MaskedNode()`` have no leaves and stay
  as they are.

  Args:
    logical_tree: a pytree with ``PartitionSpec`` or ``None`` leaves.
    rules: the rules.
    unknown: what to do with a name that no rule mentions.

  Returns:
    The tree of mesh specs.

  Raises:
    ValueError: a leaf that cannot be mapped; the message names its path.
    TypeError: a leaf that is not a ``PartitionSpec`` or ``None``.

  Example:
    >>> import optax
    >>> tree = {'w': PartitionSpec('embed', 'mlp'), 'b': None, 'e': optax.EmptyState()}
    >>> logical_to_mesh_axes_tree(tree, standard_logical_axis_rules())
    {'b': None, 'e': EmptyState(), 'w': P(None, 'model')}
  """

  def convert(path, spec):
    check_spec_leaf(path, spec)
    try:
      return logical_to_mesh_axes(spec, rules, unknown=unknown)
    except ValueError as e:
      raise ValueError(f"{key_path_str(path)}: {e}") from e

  return jax.tree.map_with_path(convert, logical_tree, is_leaf=is_spec_leaf)


def optimizer_state_mesh_axes_tree(
  logical_tree: Any,
  shapes: Any,
  rules: LogicalAxisRules | Sequence[Rule],
  *,
  mesh_shape: Mapping[str, int],
  unknown: UnknownAxis | str = UnknownAxis.RAISE,
) -> Any:
  """Maps optimizer-state logical specs to mesh specs, with ZeRO if enabled.

  Like :func:`logical_to_mesh_axes_tree`, with the mesh axes a leaf's
  dimension does not divide dropped (:func:`drop_indivisible_axes`); then,
  when ``rules.optimizer_state_axis`` is set, each leaf also gets that mesh
  axis (see :func:`add_optimizer_state_axis`).

  Args:
    logical_tree: a pytree with ``PartitionSpec`` or ``None`` leaves.
    shapes: a tree with ``logical_tree``'s structure whose leaves have a
      ``.shape`` (arrays or ``jax.ShapeDtypeStruct``).
    rules: the rules.
    mesh_shape: mesh axis sizes, e.g. ``mesh.shape``.
    unknown: what to do with a name that no rule mentions.

  Returns:
    The tree of mesh specs.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> rules = standard_logical_axis_rules(shard_optimizer_state_over_data=True)
    >>> mu = {'w': PartitionSpec('embed', 'mlp')}
    >>> shapes = {'w': jax.ShapeDtypeStruct((16, 32), jnp.float32)}
    >>> optimizer_state_mesh_axes_tree(mu, shapes, rules, mesh_shape={'data': 2, 'model': 4})
    {'w': P('data', 'model')}
  """
  rules = as_logical_axis_rules(rules)
  axis = rules.optimizer_state_axis
  if axis is not None and axis not in mesh_shape:
    raise ValueError(
      f"optimizer_state_axis {axis!r} is not a mesh axis; the mesh has {dict(mesh_shape)}."
    )

  def fit(path: jax.tree_util.KeyPath, spec: PartitionSpec | None, x: Any) -> Any:
    return fit_state_spec(key_path_str(path), spec, np.shape(x), mesh_shape=mesh_shape, axis=axis)

  return jax.tree.map_with_path(
    fit,
    logical_to_mesh_axes_tree(logical_tree, rules, unknown=unknown),
    shapes,
    is_leaf=is_spec_leaf,
  )
