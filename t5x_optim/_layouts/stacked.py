"""Params and optimizer state kept stacked by shape between steps.

An unscanned T5 has hundreds of leaves, and an optax update runs one kernel
(or more) per leaf, far from the memory-bandwidth limit on a GPU. The same
update over a few large buffers runs near it (docs/design.md, "Optimizer updates on one
H100": 0.90 of the limit for T5-base params stacked by shape). `stack_params` keeps the params
that way between steps: the leaves of one shape, dtype and partition spec
are stacked on a new leading axis, and the model reads them back per leaf
with `StackedParams.unstack`, whose gradient comes back stacked. optax then
initialises and updates the few buffers, so its state (``mu``, ``nu``...) is
stacked too.

For an update that is elementwise per leaf (adam, adamw, lion, sgd with
momentum, rmsprop...: the elementwise analysis of
`t5x_optim._layouts.fused.analysis` proves it, and `StackedOptimizerDef`
refuses anything else), updating a stacked buffer
equals updating each of its leaves, bit for bit; a global reduction such as
clipping by the global norm sums in another order (one rounding in the
clip factor: a few ulps, see ``tests/test_stacked.py``). Partition
specs are the leaves' specs behind an unsharded stacking axis, so each
device holds the stacked slices of the leaves it held before.

`StackedOptimizerDef` is the layer around `OptaxWrapper` for such params
(``OptaxWrapper(tx).create(stacked)`` builds it): its state dicts and
checkpoints are those of the per-leaf params.

Example:
  >>> import jax, jax.numpy as jnp, optax
  >>> params = {'a': jnp.ones((2, 3)), 'b': jnp.zeros((2, 3)), 'c': jnp.ones(3)}
  >>> stacked = stack_params(params)
  >>> [b.shape for b in stacked.buffers]
  [(2, 2, 3), (1, 3)]
  >>> loss = lambda s: sum(jnp.sum(x ** 2) for x in jax.tree.leaves(s.unstack()))
  >>> grads = jax.grad(loss)(stacked)
  >>> tx = optax.adam(0.1)
  >>> updates, state = tx.update(grads, tx.init(stacked), stacked)
  >>> sorted(optax.apply_updates(stacked, updates).unstack())
  ['a', 'b', 'c']
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.sharding import PartitionSpec

from t5x_optim._axes.engine import logical_axes_from
from t5x_optim._core.interface import Optimizer, OptimizerDef, OptimizerState, check_grads
from t5x_optim._keypaths import key_path_str
from t5x_optim._layouts.fused import FusedUpdate
from t5x_optim._layouts.fused.analysis import FusedPlan, NotFusible, plan_fused_update
from t5x_optim._layouts.fused.program import program_key

__all__ = [
  "StackedLayout",
  "StackedOptimizerDef",
  "StackedParams",
  "check_stacked_update",
  "stack_params",
]


def _is_spec_or_none(x: Any) -> bool:
  return x is None or isinstance(x, PartitionSpec | optax.MaskedNode)


def _flatten(tree: Any, treedef: Any, what: str) -> list[Any]:
  """What `tree` holds at each leaf of `treedef` (a None or a spec there too), in its order.

  A None that is no leaf of `treedef` (a param None, which holds no array) is
  None in `tree` too. Dicts and FrozenDicts are interchangeable.

  Raises:
    ValueError: naming both structures when `tree` does not have `treedef`'s.
  """
  reference = jax.tree.unflatten(treedef, [0] * treedef.num_leaves)
  unfrozen = jax.tree.structure(flax.core.unfreeze(reference))
  for given, wanted in (tree, treedef), (flax.core.unfreeze(tree), unfrozen):
    try:
      leaves = wanted.flatten_up_to(given)
    except (ValueError, TypeError):
      continue
    leaf = jax.tree.structure(0)
    if all(jax.tree.structure(x, is_leaf=_is_spec_or_none) == leaf for x in leaves):
      return leaves
  got = jax.tree.structure(tree, is_leaf=_is_spec_or_none)
  raise ValueError(
    f"The {what} do not have the structure of the stacked params: {got} vs {treedef}."
  )


@dataclasses.dataclass(frozen=True)
class StackedLayout:
  """Which leaves of a params tree share which stacked buffer.

  Attributes:
    treedef: the per-leaf params' tree structure.
    paths: each leaf's path (``'encoder/layers_0/mlp/wo/kernel'``).
    shapes: each leaf's shape.
    dtypes: each leaf's dtype name.
    groups: per buffer, the indices of its leaves, in stacking order.
  """

  treedef: Any
  paths: tuple[str, ...]
  shapes: tuple[tuple[int, ...], ...]
  dtypes: tuple[str, ...]
  groups: tuple[tuple[int, ...], ...]

  def __repr__(self) -> str:
    return f"StackedLayout({len(self.paths)} leaves in {len(self.groups)} buffers)"

  def abstract_params(self) -> Any:
    """The per-leaf params as `jax.ShapeDtypeStruct`s."""
    leaves = [jax.ShapeDtypeStruct(s, d) for s, d in zip(self.shapes, self.dtypes, strict=True)]
    return jax.tree.unflatten(self.treedef, leaves)

  def stack(self, tree: Any, *, what: str = "params") -> StackedParams:
    """Stacks a per-leaf tree: arrays, `jax.ShapeDtypeStruct`s or partition specs.

    A spec tree (a leaf's spec or None, replicated) becomes each buffer's spec:
    the leaves' common spec behind an unsharded stacking axis.

    Raises:
      ValueError: naming the paths, when `tree` does not have the params'
        structure, or leaves stacked together have different shapes, dtypes
        or specs.
      TypeError: for a leaf that is none of the kinds above.
    """
    leaves = _flatten(tree, self.treedef, what)
    return StackedParams(
      buffers=tuple(self._stack_group(group, leaves, what) for group in self.groups), layout=self
    )

  def _stack_group(self, group: Sequence[int], leaves: Sequence[Any], what: str) -> Any:
    members = [leaves[i] for i in group]
    names = [self.paths[i] for i in group]
    if all(isinstance(m, optax.MaskedNode) for m in members):
      return optax.MaskedNode()
    if all(_is_spec_or_none(m) for m in members):
      if all(m is None for m in members):
        return None
      specs = {PartitionSpec() if m is None else m for m in members}
      if len(specs) > 1:
        described = ", ".join(f"'{n}': {m}" for n, m in zip(names, members, strict=True))
        raise ValueError(
          f"The {what} give leaves stacked together different partition specs ({described}); "
          "pass the params' logical axes to stack_params(logical_axes=...) so that they are "
          "stacked apart."
        )
      return PartitionSpec(None, *specs.pop())
    for name, member in zip(names, members, strict=True):
      if not isinstance(member, jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct):
        raise TypeError(
          f"Cannot stack the {what} leaf '{name}': a {type(member).__name__} "
          "(arrays, jax.ShapeDtypeStructs and partition specs can be stacked)."
        )
    kinds = {(tuple(np.shape(m)), np.dtype(m.dtype)) for m in members}
    if len(kinds) > 1:
      described = ", ".join(
        f"'{n}': {np.dtype(m.dtype).name}{list(np.shape(m))}"
        for n, m in zip(names, members, strict=True)
      )
      raise ValueError(f"The {what} leaves stacked together differ in shape or dtype: {described}.")
    if isinstance(members[0], jax.ShapeDtypeStruct):
      shape, dtype = kinds.pop()
      shardings = {getattr(m, "sharding", None) for m in members}
      sharding = _stacked_sharding(shardings.pop(), len(shape)) if len(shardings) == 1 else None
      return jax.ShapeDtypeStruct((len(members), *shape), dtype, sharding=sharding)
    return jnp.stack(members)

  def unstack(self, buffers: Sequence[Any]) -> Any:
    """The per-leaf tree of stacked `buffers` (arrays, abstract values or specs).

    Arrays are split with `jax.lax.split`, whose transpose is a
    concatenation: the gradient of a loss of the unstacked params with
    respect to the buffers is the per-leaf gradients, stacked.
    """
    leaves: list[Any] = [None] * len(self.paths)
    for group, buffer in zip(self.groups, buffers, strict=True):
      for i, leaf in zip(group, _unstack_buffer(buffer, len(group)), strict=True):
        leaves[i] = leaf
    return jax.tree.unflatten(self.treedef, leaves)


def _stacked_sharding(sharding: Any, rank: int) -> jax.sharding.Sharding | None:
  """A leaf's sharding for the buffer stacking such leaves: an unsharded axis in front.

  A `NamedSharding` gains a leading None in its spec, a single device stays;
  None (and any other sharding, which says nothing per axis) gives None.

  Example:
    >>> mesh = jax.sharding.Mesh(jax.devices()[:1], ('model',))
    >>> _stacked_sharding(jax.sharding.NamedSharding(mesh, PartitionSpec('model')), 1).spec
    P(None, 'model')
  """
  if isinstance(sharding, jax.sharding.NamedSharding):
    spec = (*sharding.spec, *([None] * (rank - len(sharding.spec))))
    return jax.sharding.NamedSharding(
      sharding.mesh, PartitionSpec(None, *spec), memory_kind=sharding.memory_kind
    )
  if isinstance(sharding, jax.sharding.SingleDeviceSharding):
    return sharding
  return None


def _leaf_sharding(sharding: Any) -> jax.sharding.Sharding | None:
  """The sharding of one leaf of a buffer sharded so: the buffer's behind its stacking axis.

  A leaf of a buffer sharded along its stacking axis (ZeRO) lives on part
  of the devices; it is described replicated along that axis, and the
  buffer it is stacked back into is placed in its own sharding
  (`_placed_like`).

  Example:
    >>> mesh = jax.sharding.Mesh(jax.devices()[:1], ('model',))
    >>> _leaf_sharding(jax.sharding.NamedSharding(mesh, PartitionSpec(None, 'model'))).spec
    P('model',)
  """
  if isinstance(sharding, jax.sharding.NamedSharding):
    return jax.sharding.NamedSharding(
      sharding.mesh, PartitionSpec(*sharding.spec[1:]), memory_kind=sharding.memory_kind
    )
  if isinstance(sharding, jax.sharding.SingleDeviceSharding):
    return sharding
  return None


def _unstack_buffer(buffer: Any, n: int) -> list[Any]:
  if buffer is None or isinstance(buffer, optax.MaskedNode):
    return [buffer] * n
  if isinstance(buffer, PartitionSpec):
    return [PartitionSpec(*buffer[1:])] * n
  if isinstance(buffer, jax.ShapeDtypeStruct):
    sharding = _leaf_sharding(getattr(buffer, "sharding", None))
    return [jax.ShapeDtypeStruct(buffer.shape[1:], buffer.dtype, sharding=sharding)] * n
  shape = np.shape(buffer)[1:]
  if n == 1:
    return [jnp.reshape(buffer, shape)]
  return [jnp.reshape(part, shape) for part in jax.lax.split(buffer, [1] * n, axis=0)]


class StackedParams(struct.PyTreeNode):
  """Params kept as a few stacked buffers; a pytree whose leaves are the buffers.

  optax transformations, `jax.grad`, `jax.jit` shardings and `OptaxWrapper`
  take it as they take a params dict. `unstack()` gives the model its
  per-leaf params.

  Attributes:
    buffers: one array (or spec, or abstract value) per group of leaves.
    layout: which leaves each buffer holds (static).
  """

  buffers: tuple[Any, ...]
  layout: StackedLayout = struct.field(pytree_node=False)

  def unstack(self) -> Any:
    """The per-leaf params (arrays, specs or abstract values, as the buffers are)."""
    return self.layout.unstack(self.buffers)


def _plan(tx: optax.GradientTransformation, abstract_params: Any) -> FusedPlan:
  """The elementwise analysis of `tx` on `abstract_params`, groups without size limit.

  Raises:
    ValueError: saying why, when the update is not elementwise per leaf.
  """
  try:
    state = jax.eval_shape(tx.init, abstract_params)
    return plan_fused_update(tx, abstract_params, abstract_params, state, bounded_groups=False)
  except Exception as error:  # noqa: BLE001 - tx.init/update raise anything
    reason = str(error) if isinstance(error, NotFusible) else f"{type(error).__name__}: {error}"
    raise ValueError(
      f"The params cannot be kept stacked for this optax update: it is not elementwise per "
      f"leaf ({reason}). Stacked buffers would change its result; use per-leaf params."
    ) from None


def _leaf_programs(plan: FusedPlan) -> list[tuple[tuple, tuple[int, ...]]]:
  """Per leaf of `plan`: (what it computes, the value ids of its scalar residuals)."""
  programs: list[Any] = [None] * len(plan.paths)
  for group in plan.groups:
    for i in group.leaves:
      programs[i] = (program_key(group), group.residuals)
  return programs


def stack_params(
  params: Any,
  *,
  tx: optax.GradientTransformation | None = None,
  logical_axes: Any = None,
) -> StackedParams:
  """Stacks `params` by shape and dtype (and partition spec, and update program).

  Args:
    params: the per-leaf params (a dict or FrozenDict of real floating arrays;
      a None among them, as ``create`` takes it, holds no array and is in no
      buffer, and ``unstack`` gives it back).
    tx: the optax update that will run on them; leaves it treats differently
      (a weight-decay mask, `optax.multi_transform`) are then stacked apart.
      `OptaxWrapper` checks the layout against its transformation either way.
    logical_axes: the params' partition specs (a tree like `params` with
      `PartitionSpec`s or None, or flax's ``params_axes`` collection);
      leaves with different specs are stacked apart, so every buffer has one.

  Returns:
    The params as `StackedParams`, leaves grouped in first-seen order.

  Raises:
    ValueError: when `tx` is not elementwise per leaf (the reason named),
      or `logical_axes` does not fit `params`.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from jax.sharding import PartitionSpec as P
    >>> params = {'a': jnp.ones((4, 2)), 'b': jnp.ones((4, 2))}
    >>> s = stack_params(params, logical_axes={'a': P('embed'), 'b': P(None, 'mlp')})
    >>> len(s.buffers), s.layout.groups
    (2, ((0,), (1,)))
  """
  path_leaves, treedef = jax.tree.flatten_with_path(params)
  paths = tuple(key_path_str(path) for path, _ in path_leaves)
  leaves = [leaf for _, leaf in path_leaves]
  shapes = tuple(tuple(np.shape(leaf)) for leaf in leaves)
  dtypes = tuple(np.dtype(leaf.dtype).name for leaf in leaves)
  layout = StackedLayout(treedef, paths, shapes, dtypes, ())
  specs: list[Any] = [None] * len(leaves)
  if logical_axes is not None:
    specs = _flatten(logical_axes_from(logical_axes), treedef, "logical axes")
  program = [0] * len(leaves)
  if tx is not None:
    for k, group in enumerate(_plan(tx, layout.abstract_params()).groups):
      for i in group.leaves:
        program[i] = k
  keys: dict[tuple, list[int]] = {}
  for i in range(len(leaves)):
    spec = PartitionSpec() if specs[i] is None else specs[i]
    keys.setdefault((shapes[i], dtypes[i], spec, program[i]), []).append(i)
  layout = dataclasses.replace(layout, groups=tuple(tuple(g) for g in keys.values()))
  return layout.stack(params)


def check_stacked_update(tx: optax.GradientTransformation, params: StackedParams) -> None:
  """Checks that `tx` updates each buffer of `params` as it updates its leaves.

  The update is analysed twice, on the per-leaf params and on the buffers.
  Each buffer must compute what each of its leaves computes, from scalars
  shared as the leaves share them. A mask or a label function reads the
  tree it is given, so one that tells leaves apart by path or rank sees
  the buffers, not the leaves, and is refused here.

  Raises:
    ValueError: when the update is not elementwise per leaf, or a buffer
      would be updated otherwise than its leaves (naming them).
  """
  layout = params.layout
  per_leaf = _leaf_programs(_plan(tx, layout.abstract_params()))
  for group in layout.groups:
    if len({per_leaf[i] for i in group}) > 1:
      raise ValueError(
        f"The optax update treats leaves stacked together differently "
        f"({[layout.paths[i] for i in group]}): their elementwise programs or scalars "
        "differ (a weight-decay mask, say). Stack them with stack_params(params, tx=tx)."
      )
  abstract = layout.stack(layout.abstract_params())
  per_buffer = _leaf_programs(_plan(tx, abstract))
  shapes = [b.shape for b in abstract.buffers]
  state = jax.eval_shape(tx.init, abstract)
  for node in jax.tree.leaves(state, is_leaf=lambda n: isinstance(n, StackedParams)):
    if not isinstance(node, StackedParams):
      continue
    got = [getattr(b, "shape", shape) for b, shape in zip(node.buffers, shapes, strict=True)]
    if got != shapes:
      raise ValueError(
        "The optax state has a tree like the params whose leaves do not have the params' "
        f"shapes (buffers {got} for params {shapes}, as adafactor's unfactored v_row); it "
        "cannot be kept stacked and written per leaf."
      )
  shared: dict[tuple[int, ...], tuple[int, ...]] = {}
  for k, group in enumerate(layout.groups):
    names = [layout.paths[i] for i in group]
    leaf_program, leaf_residuals = per_leaf[group[0]]
    buffer_program, buffer_residuals = per_buffer[k]
    if (
      buffer_program != leaf_program
      or shared.setdefault(leaf_residuals, buffer_residuals) != buffer_residuals
    ):
      scalar = (
        " Or it updates a scalar otherwise than an array: jnp.where traces no broadcast for "
        "a scalar (adagrad, zero_nans), and a stacked scalar is an array."
        if layout.shapes[group[0]] == ()
        else ""
      )
      raise ValueError(
        f"The optax update computes the stacked buffer of {names} otherwise than those "
        "leaves: it tells leaves apart by their path, rank or shape (a mask or label "
        "function, say), and sees the buffers instead." + scalar + " Keep these params per "
        "leaf, or give such transformations masks that hold for the stacked buffers."
      )


class StackedOptimizerDef(OptimizerDef):
  """The stacked layer: an optax `OptimizerDef` whose target is `StackedParams`.

  ``OptaxWrapper(tx).create(stack_params(params))`` builds it around a
  plain copy of the wrapper. The transformation must be elementwise per leaf (checked by
  `init_state`); gradients may come stacked (the gradient of a loss of
  ``target.unstack()``) or per leaf; `derive_logical_axes` takes the
  per-leaf logical axes; `state_dict` and `restore_state` read and write the
  per-leaf layout, so checkpoints do not depend on the stacking. The update
  runs on the plain optax path: the buffers are already few and large, as
  the fused update would make them.

  Args:
    inner: the per-leaf definition, an `OptaxWrapper` with the plain update
      (``fused="off"``), which it runs on the stacked buffers.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from t5x_optim import OptaxWrapper
    >>> opt = OptaxWrapper(optax.adam(0.1)).create(stack_params({'a': jnp.ones(2)}))
    >>> type(opt.optimizer_def).__name__, sorted(opt.state_dict()['target'])
    ('StackedOptimizerDef', ['a'])
  """

  def __init__(self, inner: Any):
    super().__init__(inner.hyper_params, fallback=inner.fallback)
    if getattr(inner, "fused", None) is not FusedUpdate.OFF:
      raise ValueError(
        f"The stacked layer runs a plain definition (fused='off'); got fused={inner.fused!r}."
      )
    self.inner = inner
    self.optax_optimizer = inner.optax_optimizer
    self.extra_arg_names = inner.extra_arg_names

  def init_state(self, params: StackedParams) -> OptimizerState:
    """The inner definition's state, once the update is checked against the stacking.

    Raises:
      ValueError: when the transformation is not elementwise per leaf, or
        treats leaves stacked together differently.
    """
    check_stacked_update(self.optax_optimizer, params)
    return self.inner.init_state(params)

  def prepare_grads(self, params: StackedParams, grads: Any) -> StackedParams:
    """`grads` in `params`' stacked layout: stacked as they are, or per-leaf stacked.

    Raises:
      ValueError: naming the paths and both sides, when per-leaf grads do not
        fit the per-leaf params, or stacked grads have another layout or
        buffer shapes.
    """
    layout = params.layout
    if not isinstance(grads, StackedParams):
      check_grads(grads, layout.abstract_params())
      return layout.stack(grads, what="grads")
    if grads.layout != layout:
      raise ValueError(
        f"The stacked grads have another layout than the stacked params: groups "
        f"{grads.layout.groups} of {grads.layout.paths} vs {layout.groups} of {layout.paths}."
      )
    bad = [
      f"buffer {k} ({[layout.paths[i] for i in layout.groups[k]]}): grads {jnp.shape(g)}, "
      f"params {jnp.shape(p)}"
      for k, (g, p) in enumerate(zip(grads.buffers, params.buffers, strict=True))
      if jnp.shape(g) != jnp.shape(p)
    ]
    if bad:
      raise ValueError(f"The stacked grads do not fit the stacked params: {'; '.join(bad)}.")
    return grads

  def apply_gradient(
    self, hyper_params: Any, params: Any, state: OptimizerState, grads: Any, **extra_args: Any
  ) -> tuple[Any, OptimizerState]:
    return self.inner.apply_gradient(hyper_params, params, state, grads, **extra_args)

  def state_dict(self, target: StackedParams, state: OptimizerState) -> dict[str, Any]:
    """The per-leaf params' state dict."""
    return self.inner.state_dict(*_unstacked(target, state))

  def restore_state(
    self, opt_target: StackedParams, opt_state: OptimizerState, state_dict: Any
  ) -> tuple[StackedParams, OptimizerState]:
    """Restores per leaf, then stacks; errors name the per-leaf paths."""
    target, new_state = self.inner.restore_state(*_unstacked(opt_target, opt_state), state_dict)
    return _restacked(opt_state, target, new_state, opt_target)

  def derive_logical_axes(self, optimizer: Optimizer, param_logical_axes: Any) -> Optimizer:
    """The inner definition's logical axes, with the per-leaf (or stacked) params' axes.

    Each buffer gets its leaves' spec behind an unsharded stacking axis.

    Raises:
      ValueError: when leaves stacked together have different specs (naming
        them).
    """
    axes = param_logical_axes
    if not isinstance(axes, StackedParams):
      axes = optimizer.target.layout.stack(logical_axes_from(axes), what="logical axes")
    return self.inner.derive_logical_axes(optimizer, axes)


def per_leaf(optimizer: Optimizer) -> Optimizer:
  """An optimizer of stacked params as its inner definition's, per leaf: its params and state
  as its state dict and checkpoints hold them."""
  target, state = _unstacked(optimizer.target, optimizer.state)
  return Optimizer(optimizer_def=optimizer.optimizer_def.inner, state=state, target=target)


def stacked_like(optimizer: Optimizer, reference: Optimizer) -> Optimizer:
  """A per-leaf `optimizer` stacked as `reference` (a stacked optimizer of the same params and
  update) is, in its shardings."""
  target, state = _restacked(reference.state, optimizer.target, optimizer.state, reference.target)
  return Optimizer(optimizer_def=reference.optimizer_def, state=state, target=target)


def _unstacked(target: StackedParams, state: OptimizerState) -> tuple[Any, OptimizerState]:
  """`target` and `state` with every `StackedParams` subtree per leaf."""
  param_states = jax.tree.map(
    lambda node: node.unstack() if isinstance(node, StackedParams) else node,
    state.param_states,
    is_leaf=lambda node: isinstance(node, StackedParams),
  )
  return target.unstack(), state.replace(param_states=param_states)


def _restacked(
  reference: OptimizerState, target: Any, state: OptimizerState, reference_target: StackedParams
) -> tuple[StackedParams, OptimizerState]:
  """Inverse of `_unstacked`: stacks what `reference` holds as `StackedParams`."""
  nodes, outer = jax.tree.flatten(
    reference.param_states, is_leaf=lambda node: isinstance(node, StackedParams)
  )
  restored = outer.flatten_up_to(state.param_states)
  param_states = jax.tree.unflatten(
    outer,
    [
      _placed_like(node.layout.stack(value, what="optimizer state"), node)
      if isinstance(node, StackedParams)
      else value
      for node, value in zip(nodes, restored, strict=True)
    ],
  )
  _refuse_restored_dtypes(reference_target.layout, target)
  stacked_target = _placed_like(reference_target.layout.stack(target), reference_target)
  return stacked_target, state.replace(param_states=param_states)


def _refuse_restored_dtypes(layout: StackedLayout, target: Any) -> None:
  """Refuses restored per-leaf params that one buffer would hold in more than one dtype.

  A restore keeps the state dict's floating param dtypes (`leaf_fit`'s rule,
  T5X's ``restore_dtype``), and a buffer has one; casting some of them would
  break that rule for this layout alone.

  Raises:
    ValueError: naming the restore, each such param and its dtype.
  """
  leaves = _flatten(target, layout.treedef, "params")
  for group in layout.groups:
    dtypes = {
      layout.paths[i]: np.dtype(leaves[i].dtype) for i in group if hasattr(leaves[i], "dtype")
    }
    if len(set(dtypes.values())) > 1:
      described = ", ".join(f"'{path}': {dtype.name}" for path, dtype in dtypes.items())
      raise ValueError(
        "The restore keeps the state dict's floating param dtypes (T5X's restore_dtype), "
        f"and the params of one stacked buffer have one dtype; the state dict gives them "
        f"{described}. Give them one dtype in the state dict, or restore into per-leaf "
        "params (an optimizer created over params.unstack())."
      )


def _placed_like(stacked: StackedParams, reference: Any) -> StackedParams:
  """`stacked` with each array buffer in the sharding of `reference`'s buffer.

  The reference's buffers (real or `jax.ShapeDtypeStruct`s) say where a
  restored buffer belongs; stacking its leaves alone would leave it where
  they were computed. Placeholders (specs, abstract values) are kept.
  """
  if not isinstance(reference, StackedParams):
    return stacked
  buffers = []
  for buffer, ref in zip(stacked.buffers, reference.buffers, strict=True):
    sharding = getattr(ref, "sharding", None)
    if isinstance(buffer, jax.Array) and isinstance(sharding, jax.sharding.Sharding):
      buffer = jax.device_put(buffer, sharding)
    buffers.append(buffer)
  return stacked.replace(buffers=tuple(buffers))
