"""The one engine: logical partition specs for any optimizer state.

``OptaxStatePartitionRules.derive_optax_logical_axes`` maps an optax state to
a tree of the same structure whose leaves are logical ``PartitionSpec``s or
None (replicated). Derivation runs in four steps:

1. *Structure*: scalars are replicated; a subtree with the params'
   structure (a "mirror", like adam's ``mu``, ``MaskedNode`` holes allowed, a
   dict and a FrozenDict of the same keys alike) gives each leaf of its param's
   shape that param's spec, size-1 dimensions included (T5X keeps
   ``('output_head',)`` on a ``(1,)`` bias); other leaves whose dimensions all
   have size 1 are replicated. This is the fast path: adamw, sgd, lion, ... end here.
2. *Generic*: when ``transformation`` and ``params`` are given and leaves are
   left, ``transformation.init`` is traced on abstract params sharded over an
   abstract mesh of logical axes (sharding-in-types), so factored leaves
   (adafactor ``v_row``, SM3 accumulators) and states of user-defined
   transformations get the specs of the param dimensions they keep.
3. *Rules*: registered per-state-type rules override what the first two steps
   cannot know (L-BFGS history, GaLore projectors). Adapters whose states
   optax does not describe register a rule for a node type of their own and
   pass that node to ``derive_state_specs`` (example_libraries' per-param
   parts, K-FAC's curvature blocks).
4. *Validation*: every spec must fit its leaf (length == rank, no axis named
   twice); anything else, ``UNDERIVED`` leaves included, goes to the caller's
   ``StateRulesFallback`` through ``resolve``, the one fallback resolver.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import optax
from flax.core import frozen_dict, meta
from flax.linen import partitioning as flax_partitioning
from flax.linen import spmd
from jax.sharding import PartitionSpec

from t5x_optim._axes import builtin as _state_rules_builtin  # noqa: F401  (registers the built-in rules)
from t5x_optim._axes import generic, registry
from t5x_optim._axes import specs as specs_lib
from t5x_optim._axes.rules import is_spec_leaf
from t5x_optim._keypaths import key_path_str, leaf_paths
from t5x_optim._nnx import first_nnx_path, partition_specs
from t5x_optim._warn import warn

_MAX_PATHS_IN_WARNING = 5
_NO_SPEC_DERIVED = "no spec could be derived"


class StateRulesFallback(enum.Enum):
  """What to do with a state leaf whose spec cannot be derived or is invalid.

  Attributes:
    REPLICATE_WITH_WARNING: replicate the leaf (spec None) and warn once per
      derivation, naming the leaves.
    RAISE: raise a ValueError naming the leaf's tree path, shape and spec.
  """

  REPLICATE_WITH_WARNING = "replicate_with_warning"
  RAISE = "raise"

  def handle(
    self, leaves: Sequence[str], *, why: str = "", cause: BaseException | None = None
  ) -> None:
    """Applies the policy to leaves without a valid spec.

    With ``REPLICATE_WITH_WARNING`` it warns once, naming the leaves, and the
    caller replicates them (spec None); with ``RAISE`` it raises.

    Args:
      leaves: one description per leaf: its tree path, shape and the problem.
      why: appended to the message, e.g. why derivation failed.
      cause: chained to the ValueError.

    Raises:
      ValueError: with ``RAISE``, naming every leaf.

    >>> StateRulesFallback.RAISE.handle([])
    """
    if not leaves:
      return
    if self is StateRulesFallback.RAISE:
      raise ValueError(
        f"cannot derive a valid logical spec for {len(leaves)} optimizer state "
        f"leaves: {', '.join(leaves)}{why}"
      ) from cause
    more = len(leaves) - _MAX_PATHS_IN_WARNING
    warn(
      f"replicating {len(leaves)} optimizer state leaves without a valid "
      f"logical spec: {', '.join(leaves[:_MAX_PATHS_IN_WARNING])}"
      + (f" and {more} more" if more > 0 else "")
      + why
    )


def _is_axes_input_leaf(x: Any) -> bool:
  return x is None or isinstance(x, (PartitionSpec, meta.AxisMetadata)) or _is_names_tuple(x)


def _is_axes_input_leaf_or_collection(x: Any) -> bool:
  return _is_axes_input_leaf(x) or isinstance(x, flax_partitioning.AxisMetadata)


def _is_names_tuple(x: Any) -> bool:
  return type(x) is tuple and all(  # pylint: disable=unidiomatic-typecheck
    e is None or isinstance(e, str) or _is_names_tuple(e) for e in x
  )


def box_spec(box: meta.AxisMetadata, where: str) -> PartitionSpec | None:
  """The logical spec of a flax box: an ``nn.with_logical_partitioning`` box's names.

  Boxes that name no axes give None (replicated). A plain ``Partitioned`` box
  (``nn.with_partitioning``) names mesh axes, which no logical rule maps, so
  it is refused.

  Args:
    box: the box.
    where: the box's tree path, for the message.

  Raises:
    TypeError: for a plain ``Partitioned`` box, naming ``where``.

  >>> box_spec(spmd.LogicallyPartitioned(0.0, ('embed',)), 'w')
  P('embed',)
  """
  if isinstance(box, spmd.LogicallyPartitioned):
    return box.get_partition_spec()
  if isinstance(box, meta.Partitioned):
    raise TypeError(
      f"'{where}' is a flax Partitioned box (nn.with_partitioning), whose names "
      f"{box.names} are mesh axes, not logical ones: box it with "
      "nn.with_logical_partitioning, or give its names as logical axes (unboxed, with "
      "nn.get_partition_spec) with rules that map each mesh axis to itself"
    )
  return None


def _to_spec(path: Any, x: Any) -> PartitionSpec | None:
  if x is None or isinstance(x, PartitionSpec):
    return x
  if isinstance(x, meta.AxisMetadata):
    return box_spec(x, key_path_str(path))
  if _is_names_tuple(x):
    return PartitionSpec(*x)
  if hasattr(x, "shape"):
    return None
  raise TypeError(
    f"params_axes leaf at '{key_path_str(path)}' is a "
    f"{type(x).__name__}; expected a PartitionSpec, None, a tuple of axis "
    "names, a flax LogicallyPartitioned box or an array"
  )


def _is_axes_collection(tree: Any) -> bool:
  found = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, flax_partitioning.AxisMetadata))
  return bool(found) and all(isinstance(x, flax_partitioning.AxisMetadata) for x in found)


def logical_axes_from(params_axes: Any) -> Any:
  """Normalises param axes, in any form users have, to a PartitionSpec tree.

  Accepted forms:

  * a tree of ``PartitionSpec`` (or tuples of names) and None (T5X form; dict
    or FrozenDict, returned with its containers);
  * params boxed by ``nn.with_logical_partitioning`` (``LogicallyPartitioned``
    leaves become their spec; unboxed arrays become None, replicated); boxes of
    ``nn.with_partitioning``, whose names are mesh axes, are refused;
  * a flax ``nnx.State`` of ``nnx.Param``s (or a tree holding
    ``nnx.Variable``s): each takes the spec of its sharding metadata
    (``nnx.with_partitioning``'s names, taken as logical axes), as
    ``nnx.get_partition_spec`` gives it, returned with the State's structure;
    a variable without sharding metadata is replicated;
  * a T5X-style ``params_axes`` collection written by
    ``flax.linen.partitioning.param_with_axes`` (``AxisMetadata`` leaves under
    keys ending in ``_axes``), either the collection itself or
    ``{'params_axes': collection}``; it is returned as plain dicts keyed like
    the params.

  Args:
    params_axes: the param axes in one of the forms above.

  Returns:
    a tree with the params' structure whose leaves are ``PartitionSpec``s or
    None.

  Raises:
    TypeError: if a leaf is none of the above or a plain ``Partitioned`` box,
      naming its tree path.

  >>> logical_axes_from({'dense': {'kernel': ('embed', 'mlp'), 'bias': None}})
  {'dense': {'bias': None, 'kernel': P('embed', 'mlp')}}
  """
  if isinstance(params_axes, dict | frozen_dict.FrozenDict) and set(params_axes) == {"params_axes"}:
    params_axes = params_axes["params_axes"]
  if all(
    is_spec_leaf(x) for x in jax.tree.leaves(params_axes, is_leaf=_is_axes_input_leaf_or_collection)
  ):
    return params_axes
  if _is_axes_collection(params_axes):
    return specs_lib.thaw(flax_partitioning.get_axis_names(params_axes))
  if first_nnx_path(params_axes) is not None:
    return partition_specs(params_axes)
  return jax.tree.map_with_path(_to_spec, params_axes, is_leaf=_is_axes_input_leaf)


def is_box(x: Any) -> bool:
  """Whether `x` is a flax box (``nn.with_logical_partitioning``'s, an ``AxisMetadata``)."""
  return isinstance(x, meta.AxisMetadata)


def unbox_leaf(x: Any) -> Any:
  """A flax box's value, with no sharding constraint applied; anything else as it is."""
  if isinstance(x, meta.Partitioned):
    return x.unbox(apply_constraint=False)
  return x.unbox() if isinstance(x, meta.AxisMetadata) else x


def _unboxed(tree: Any) -> Any:
  """``tree`` with every flax box replaced by its value (`unbox_leaf`)."""
  return meta.map_axis_meta(lambda box: _unboxed(unbox_leaf(box)), tree)


class _ParamIndex:
  """Flat, aligned view of the params and their logical specs."""

  def __init__(self, params_axes: Any, params: Any | None):
    spec_tree = logical_axes_from(params_axes)
    raw, self.params_def = jax.tree.flatten(spec_tree, is_leaf=is_spec_leaf)
    self.specs: list[PartitionSpec | None] = [specs_lib.drop_repeated_names(s) for s in raw]
    self.mirror_defs = {self.params_def}
    self.params = params
    self.leaves: list[Any] | None = None
    self.shapes: list[tuple[int, ...]] | None = None
    if params is None:
      thawed = specs_lib.thaw(spec_tree)
      self.mirror_defs.add(jax.tree.structure(thawed, is_leaf=is_spec_leaf))
      self.mirror_defs.add(jax.tree.structure(specs_lib.freeze_top(thawed), is_leaf=is_spec_leaf))
    else:
      self._align(spec_tree)

  def _align(self, spec_tree: Any) -> None:
    leaves, params_def = jax.tree.flatten(self.params)
    if params_def != self.params_def:
      self.params = _unboxed(self.params)
      leaves, params_def = jax.tree.flatten(self.params)
    if params_def != self.params_def:
      spec_def = jax.tree.structure(specs_lib.thaw(spec_tree), is_leaf=is_spec_leaf)
      thawed = specs_lib.thaw(self.params)
      with_nones, nones_def = jax.tree.flatten(thawed, is_leaf=lambda x: x is None)
      if nones_def == spec_def:
        # A None param holds no array, so it has no axes: what params_axes has there is unused.
        self.specs = [s for s, p in zip(self.specs, with_nones) if p is not None]
      elif jax.tree.structure(thawed) != spec_def:
        axes_paths = leaf_paths(specs_lib.thaw(spec_tree), is_leaf=is_spec_leaf)
        params_paths = leaf_paths(thawed)
        raise ValueError(
          "params_axes does not have the structure of params: paths only in params_axes: "
          f"{sorted(axes_paths - params_paths)}; paths only in the params: "
          f"{sorted(params_paths - axes_paths)}; {spec_def} vs {params_def}"
        )
    self.leaves = leaves
    self.params_def = params_def
    self.mirror_defs = {params_def}
    self.shapes = [specs_lib.leaf_shape(p) for p in leaves]
    self.specs = [specs_lib.canonical(s, len(shape)) for s, shape in zip(self.specs, self.shapes)]

  def context(self) -> registry.StateRuleContext:
    return registry.StateRuleContext(
      param_specs=self.params_def.unflatten(self.specs), params=self.params
    )


_MAPPINGS = (dict, frozen_dict.FrozenDict)


def _same_node(a: Any, b: Any) -> bool:
  """Whether two ``node_data()`` are one node, a dict and a FrozenDict of the same keys too."""
  if a is not None and b is not None and a[0] in _MAPPINGS and b[0] in _MAPPINGS:
    return tuple(a[1]) == tuple(b[1])
  return a == b


def holey_mirror(
  node: jax.tree_util.PyTreeDef, params_def: jax.tree_util.PyTreeDef, *, subtrees: bool = False
) -> list[int] | None:
  """Param index of each leaf if ``node`` is the params with MaskedNode holes.

  A hole stands for a param or a whole subtree of them. Dicts and
  FrozenDicts of the same keys match each other, as the exact mirrors of
  params given only by their axes do. With ``subtrees``, a param's
  position may hold a subtree (a compressed moment's), whose leaves all
  have that param's index.
  """
  indices: list[int] = []
  stack = [(node, params_def)]
  next_param = 0
  while stack:
    s, p = stack.pop()
    if p.num_nodes == 1 and p.num_leaves == 1:
      data = s.node_data()
      if data is None:
        indices.append(next_param)
      elif subtrees:
        indices.extend([next_param] * s.num_leaves)
      elif data[0] is not optax.MaskedNode:
        return None
      next_param += 1
      continue
    data = s.node_data()
    if data is not None and data[0] is optax.MaskedNode:
      next_param += p.num_leaves
      continue
    if not _same_node(data, p.node_data()):
      return None
    stack.extend(reversed(list(zip(s.children(), p.children()))))
  return indices


def _scan(state_def: jax.tree_util.PyTreeDef, index: _ParamIndex, rule_types: Sequence[type]):
  """Finds params mirrors and rule-typed nodes in one walk.

  Returns:
    ``[(leaf offset, param index of each leaf)]`` for every subtree with the
    params' structure (MaskedNode holes allowed), and ``[(leaf offset, node)]``
    for every node whose type has a registered rule, outermost first.
  """
  mirrors: list[tuple[int, Sequence[int]]] = []
  ruled: list[tuple[int, jax.tree_util.PyTreeDef]] = []
  root_data = index.params_def.node_data()
  dense = range(index.params_def.num_leaves)
  stack = [(state_def, 0)]
  while stack:
    node, offset = stack.pop()
    if node in index.mirror_defs:
      mirrors.append((offset, dense))
      continue
    data = node.node_data()
    holey = (
      holey_mirror(node, index.params_def)
      if data is not None and _same_node(data, root_data)
      else None
    )
    if holey is not None:
      mirrors.append((offset, holey))
      continue
    if data is not None and data[0] in rule_types:
      ruled.append((offset, node))
    start = offset
    children = []
    for child in node.children():
      children.append((child, start))
      start += child.num_leaves
    stack.extend(reversed(children))
  return mirrors, ruled


def _known_param_shapes(index: _ParamIndex, mirrors, shapes, specs) -> list[Any]:
  """Param shapes; without params, the one shape all rank-matching mirrors share.

  Leaves already resolved (e.g. all-size-1 placeholders) do not count.
  """
  if index.shapes is not None:
    return index.shapes
  seen: list[set[tuple[int, ...]]] = [set() for _ in index.specs]
  for offset, params in mirrors:
    for k, j in enumerate(params):
      spec = index.specs[j]
      if (
        spec is not None
        and specs[offset + k] is specs_lib.UNDERIVED
        and len(shapes[offset + k]) == len(spec)
      ):
        seen[j].add(shapes[offset + k])
  return [s.pop() if len(s) == 1 else None for s in seen]


def _mirror_specs(
  index: _ParamIndex, mirrors, shapes: list[tuple[int, ...]], specs: list[Any]
) -> list[int]:
  """Fills mirror leaves in place: replicated params replicate their mirrors.

  Returns the leaves whose spec the shape alone cannot confirm: those with
  two dimensions of one size that the spec shards differently, which a
  transposed copy of a square param also has.
  """
  unsure = []
  param_shapes = _known_param_shapes(index, mirrors, shapes, specs)
  param_specs = index.specs
  if index.shapes is None:
    param_specs = [None if s is None else specs_lib.canonical(s, len(s)) for s in param_specs]
  for offset, params in mirrors:
    for k, j in enumerate(params):
      i = offset + k
      if specs[i] is not specs_lib.UNDERIVED:
        continue
      if param_specs[j] is None:
        specs[i] = None
      elif shapes[i] == param_shapes[j]:
        specs[i] = param_specs[j]
        if _permutable(shapes[i], specs[i]):
          unsure.append(i)
  return unsure


def _permutable(shape: tuple[int, ...], spec: Any) -> bool:
  """Whether two dimensions of `shape` have one size but different spec entries.

  >>> _permutable((8, 8), PartitionSpec('embed', 'mlp')), _permutable((8, 4), PartitionSpec('embed', 'mlp'))
  (True, False)
  """
  if not isinstance(spec, PartitionSpec):
    return False
  entries = list(spec) + [None] * (len(shape) - len(spec))
  return any(
    shape[a] == shape[b] and entries[a] != entries[b]
    for a in range(len(shape))
    for b in range(a + 1, len(shape))
  )


def _apply_rules(ruled, rules, state_leaves, specs, index, paths) -> None:
  """Runs registered rules on their nodes, innermost first, in place."""
  context = index.context()
  for offset, node in reversed(ruled):
    end = offset + node.num_leaves
    state_node = node.unflatten(state_leaves[offset:end])
    try:
      out = rules[node.node_data()[0]].rule(state_node, node.unflatten(specs[offset:end]), context)
    except Exception as e:
      e.add_note(f"raised by {_rule_at(state_node, node, paths, offset)}")
      raise
    try:
      specs[offset:end] = node.flatten_up_to(out)
    except (ValueError, TypeError) as e:
      raise ValueError(
        f"{_rule_at(state_node, node, paths, offset)} returned a tree that does not match "
        f"the state node: {out!r}"
      ) from e


def view_specs(view: Any, known: Sequence[Any], context: registry.StateRuleContext) -> list[Any]:
  """Specs of the leaves of ``view``: a state node in the form its transformation sees.

  A state rule whose node stores leaves in another form (``low_precision``'s
  compressed moments) derives them here on the form the wrapped
  transformation built, where its subtrees mirror the params and the rules
  of its nodes (GaLore's) find what they expect: the structure step on
  ``view``, then ``known`` where that gives no spec (or could be a transpose
  and ``known`` names axes), then the rules of ``view``'s nodes.

  Args:
    view: the node's leaves (arrays or ``jax.ShapeDtypeStruct``s) in the
      form the wrapped transformation built.
    known: one spec per leaf of ``view``, as derived on the stored form
      (``UNDERIVED`` where there is none).
    context: the context the node's rule was given.

  Returns:
    one spec per leaf of ``view``, ``UNDERIVED`` where none was found.

  >>> ctx = registry.StateRuleContext({'w': PartitionSpec('embed')}, None)
  >>> view_specs({'w': jax.ShapeDtypeStruct((4,), 'float32')}, [specs_lib.UNDERIVED], ctx)
  [P('embed',)]
  """
  index = _ParamIndex(context.param_specs, context.params)
  leaves, view_def = jax.tree.flatten(view)
  shapes = [specs_lib.leaf_shape(x) for x in leaves]
  specs: list[Any] = [None if not s else specs_lib.UNDERIVED for s in shapes]
  rules = registry.registered_rules()
  mirrors, ruled = _scan(view_def, index, tuple(rules))
  unsure = set(_mirror_specs(index, mirrors, shapes, specs))
  specs = [
    None if s is specs_lib.UNDERIVED and all(d == 1 for d in shape) else s
    for s, shape in zip(specs, shapes)
  ]
  specs = [
    k if s is specs_lib.UNDERIVED or (i in unsure and k not in (None, specs_lib.UNDERIVED)) else s
    for i, (s, k) in enumerate(zip(specs, known, strict=True))
  ]
  if ruled:
    _apply_rules(ruled, rules, leaves, specs, index, _lazy_paths(view, key_path_str))
  return specs


def _rule_at(state_node, node, paths, offset: int) -> str:
  """Names the rule of ``state_node`` and the path of its first leaf, for messages."""
  where = paths()[offset] if node.num_leaves else "(empty node)"
  return f"the state rule for {type(state_node).__qualname__} at {where}"


def _describe(name: str, shape: tuple[int, ...], spec: Any, problem: str) -> str:
  """One leaf of the fallback's message: its path, shape and spec problem."""
  if spec is specs_lib.UNDERIVED:
    return f"{name} (shape {shape})"
  return f"{name} (shape {shape}, spec {spec!r}: {problem})"


def _rule_reasons(ruled, rules) -> dict[int, str]:
  """The ``underived_reason`` registered for each leaf's rule (innermost node wins)."""
  reasons: dict[int, str] = {}
  for offset, node in ruled:
    reason = rules[node.node_data()[0]].underived_reason
    if reason is not None:
      reasons.update(dict.fromkeys(range(offset, offset + node.num_leaves), reason))
  return reasons


def resolve(
  specs: Sequence[Any],
  shapes: Sequence[tuple[int, ...]],
  paths: Callable[[], Sequence[str]],
  fallback: StateRulesFallback,
  *,
  reasons: Mapping[int, str] | None = None,
  cause: BaseException | None = None,
) -> list[Any]:
  """Validates every spec; invalid or ``UNDERIVED`` ones go to ``fallback``.

  This is the one place where derived specs meet the fallback policy. Each
  leaf without a valid spec is named by its path and shape (and, for a spec
  that does not fit, the spec and the problem); the message ends with why
  the underived ones have none and, when generic derivation failed, why.

  Args:
    specs: one spec per state leaf (canonical, None, ``UNDERIVED`` or invalid).
    shapes: the leaves' shapes.
    paths: returns the leaves' names (called only when some leaf is bad).
    fallback: the policy for the leaves without a valid spec.
    reasons: why an underived leaf has no spec, by leaf index (its state
      rule's ``underived_reason``); others get "no spec could be derived".
    cause: why generic derivation failed, if it did; appended and chained.

  Returns:
    the specs with every bad leaf replicated (None).

  Raises:
    ValueError: with ``StateRulesFallback.RAISE`` if a leaf is bad.

  >>> resolve([None, specs_lib.UNDERIVED], [(2,), (3,)], lambda: ['a', 'b'],
  ...         StateRulesFallback.RAISE)
  Traceback (most recent call last):
  ValueError: cannot derive a valid logical spec for 1 optimizer state leaves: b (shape (3,)): no spec could be derived
  """
  bad = [
    (i, p)
    for i, (s, shape) in enumerate(zip(specs, shapes))
    if (p := specs_lib.spec_problem(s, shape)) is not None
  ]
  if not bad:
    return list(specs)
  names = paths()
  reasons = reasons or {}
  underived = dict.fromkeys(
    reasons.get(i, _NO_SPEC_DERIVED) for i, _ in bad if specs[i] is specs_lib.UNDERIVED
  )
  why = f": {'; '.join(underived)}" if underived else ""
  fallback.handle(
    [_describe(names[i], shapes[i], specs[i], p) for i, p in bad],
    why=why + (f"; generic derivation: {cause}" if cause is not None else ""),
    cause=cause,
  )
  out = list(specs)
  for i, _ in bad:
    out[i] = None
  return out


def _lazy_paths(state: Any, leaf_name: Callable[[jax.tree_util.KeyPath], str]):
  cache: list[list[str]] = []

  def paths() -> list[str]:
    if not cache:
      flat, _ = jax.tree.flatten_with_path(state)
      cache.append([leaf_name(p) for p, _ in flat])
    return cache[0]

  return paths


def derive_state_specs(
  state: Any,
  params_axes: Any,
  *,
  transformation: optax.GradientTransformation | None = None,
  params: Any | None = None,
  fallback: StateRulesFallback = StateRulesFallback.REPLICATE_WITH_WARNING,
  leaf_name: Callable[[jax.tree_util.KeyPath], str] = key_path_str,
) -> Any:
  """The engine: logical specs for every leaf of any optimizer state.

  Runs the four steps of the module docstring on ``state``. Adapters whose
  states optax cannot describe (example_libraries triples, K-FAC) register a
  state rule for a node type of their own and pass that node here.

  Args:
    state: the optimizer state, or an adapter's node holding it.
    params_axes: the params' logical axes in any form ``logical_axes_from``
      accepts.
    transformation: the optax transformation that built ``state`` (enables
      generic derivation, with ``params``).
    params: the params the state was initialised with.
    fallback: what to do with leaves that cannot be given a valid spec.
    leaf_name: names a leaf from its key path in the fallback's message.

  Returns:
    ``state``'s structure with a canonical spec or None at every leaf; a flax
    box in ``state`` becomes the spec of its value.

  Raises:
    ValueError: see ``OptaxStatePartitionRules.derive_optax_logical_axes``.

  >>> derive_state_specs({'w': jax.ShapeDtypeStruct((4,), 'float32')},
  ...                    {'w': PartitionSpec('embed')})
  {'w': P('embed',)}
  """
  index = _ParamIndex(params_axes, params)
  state = _unboxed(state)
  state_leaves, state_def = jax.tree.flatten(state)
  shapes = [specs_lib.leaf_shape(x) for x in state_leaves]
  specs: list[Any] = [None if not s else specs_lib.UNDERIVED for s in shapes]
  rules = registry.registered_rules()
  mirrors, ruled = _scan(state_def, index, tuple(rules))
  unsure = _mirror_specs(index, mirrors, shapes, specs)
  specs = [
    None if s is specs_lib.UNDERIVED and all(d == 1 for d in shape) else s
    for s, shape in zip(specs, shapes)
  ]
  paths = _lazy_paths(state, leaf_name)
  cause = None
  if (
    transformation is not None
    and index.leaves is not None
    and (unsure or any(s is specs_lib.UNDERIVED for s in specs))
  ):
    try:
      derived = generic.derive_generic(
        transformation, index.leaves, index.params_def, index.specs, state_def, shapes
      )
    except generic.GenericDerivationError as e:
      if any(s is specs_lib.UNDERIVED for s in specs):
        cause = e
    else:
      # Tracing also decides the mirror leaves whose shape could be a transpose, where it
      # tells an orientation: a leaf that carries no sharding (built by jnp.zeros(p.shape),
      # not zeros_like) keeps its param's spec, as the other mirror leaves do.
      redo = set(unsure)
      specs = [
        d if s is specs_lib.UNDERIVED or (i in redo and d not in (None, specs_lib.UNDERIVED)) else s
        for i, (s, d) in enumerate(zip(specs, derived))
      ]
  if ruled:
    _apply_rules(ruled, rules, state_leaves, specs, index, paths)
  specs = resolve(specs, shapes, paths, fallback, reasons=_rule_reasons(ruled, rules), cause=cause)
  return state_def.unflatten(specs)


class OptaxStatePartitionRules:
  """Derives logical partition specs for optax optimizer states.

  Mirrors T5X's ``OptaxStatePartitionRules`` classmethod interface but covers
  any optax transformation (see the module docstring for how).
  """

  @classmethod
  def derive_optax_logical_axes(
    cls,
    optax_state: optax.OptState,
    params_axes: Any,
    *,
    transformation: optax.GradientTransformation | None = None,
    params: Any | None = None,
    fallback: StateRulesFallback | str = StateRulesFallback.REPLICATE_WITH_WARNING,
  ) -> Any:
    """Logical specs for every leaf of ``optax_state``.

    Args:
      optax_state: the state (arrays or ``jax.ShapeDtypeStruct``s, e.g. from
        ``jax.eval_shape(tx.init, params)``, possibly in flax boxes).
      params_axes: the params' logical axes in any form
        ``logical_axes_from`` accepts.
      transformation: the transformation that built ``optax_state``; with
        ``params``, enables exact generic derivation for any state.
      params: the params (arrays, ``jax.ShapeDtypeStruct``s or flax boxes) the
        state was initialised with. A None param holds no array and has no
        axes: ``params_axes`` may have a leaf there (None, as ``jax.tree.map``
        over the params gives), which is not used.
      fallback: what to do with leaves that cannot be given a valid spec (or its
        name, e.g. ``"raise"``).

    Returns:
      a tree with exactly the structure of ``optax_state`` (``EmptyState`` and
      ``MaskedNode`` kept) whose leaves are canonical logical
      ``PartitionSpec``s (one entry per array dimension, at least one axis
      named, no axis named twice) or None for replicated leaves. A state
      initialised on flax boxes holds boxes: each becomes the spec of its
      value, in its place, as ``nn.get_partition_spec`` puts the box's names
      (the spec is derived, so a factored leaf's keeps the dimensions it has).

    Raises:
      ValueError: with ``StateRulesFallback.RAISE``, for the first leaf
        without a valid spec (its tree path, shape and spec); or if
        ``params_axes`` and ``params`` have different structures.

    >>> import jax.numpy as jnp
    >>> params = {'w': jax.ShapeDtypeStruct((8, 16), jnp.float32)}
    >>> tx = optax.adamw(1e-3)
    >>> OptaxStatePartitionRules.derive_optax_logical_axes(
    ...     jax.eval_shape(tx.init, params), {'w': PartitionSpec('embed', 'mlp')},
    ...     transformation=tx, params=params)[0].mu
    {'w': P('embed', 'mlp')}
    """
    fallback = StateRulesFallback(fallback)
    return derive_state_specs(
      optax_state, params_axes, transformation=transformation, params=params, fallback=fallback
    )
