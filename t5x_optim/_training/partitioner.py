"""A partitioner: logical axes in, ``jax.jit`` with ``NamedSharding`` out.

Train states are duck-typed: anything with ``as_logical_axes()`` returning the
same pytree with every array replaced by a logical ``PartitionSpec`` or
``None`` works with :meth:`Partitioner.get_logical_axes` and
:meth:`Partitioner.get_mesh_axes`. Leaves below a node named ``param_states``
(the field of ``OptimizerState``) are optimizer state, and get the ZeRO axis
when the rules enable it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, Self

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from t5x_optim._axes import rules as _axis_rules
from t5x_optim._axes.rules import LogicalAxisRules, Rule, UnknownAxis
from t5x_optim._keypaths import key_path_str

OPTIMIZER_STATE_KEY = "param_states"


class HasLogicalAxes(Protocol):
  """A train state that can describe itself with logical axes."""

  def as_logical_axes(self) -> Self:
    """Returns the state with each array replaced by a logical spec or None."""


def _is_resource_leaf(x: Any) -> bool:
  return _axis_rules.is_spec_leaf(x) or isinstance(x, NamedSharding)


def _where(path: jax.tree_util.KeyPath) -> str:
  return key_path_str(path)


def _as_tuple(argnums: int | Sequence[int]) -> tuple[int, ...]:
  return (argnums,) if isinstance(argnums, int) else tuple(argnums)


def _key_name(key: Any) -> Any:
  for attr in ("name", "key"):
    if hasattr(key, attr):
      return getattr(key, attr)
  return None


def is_optimizer_state_path(path: jax.tree_util.KeyPath) -> bool:
  """True when ``path`` passes through a node named ``param_states``.

  Example:
    >>> from jax.tree_util import GetAttrKey, SequenceKey
    >>> is_optimizer_state_path((GetAttrKey('param_states'), SequenceKey(0)))
    True
  """
  return any(_key_name(key) == OPTIMIZER_STATE_KEY for key in path)


def check_divisible(values: Any, shardings: Any, *, name: str = "") -> None:
  """Checks that every sharded dimension is divisible by its mesh axes' size.

  Args:
    values: a pytree of arrays or ``jax.ShapeDtypeStruct``.
    shardings: a prefix of ``values`` with ``NamedSharding`` leaves.
    name: prepended to the leaf paths in error messages.

  Raises:
    ValueError: naming the leaf's path, its shape and the mesh axis and size.

  Example:
    >>> import numpy as np
    >>> from t5x_optim.partitioning import create_mesh
    >>> mesh = create_mesh(devices=jax.devices()[:1])
    >>> check_divisible({'w': np.ones((3, 2))}, {'w': NamedSharding(mesh, PartitionSpec('data'))})
  """

  def is_sharding(x):
    return isinstance(x, NamedSharding)

  full = jax.tree.broadcast(shardings, values, is_leaf=is_sharding)
  for (path, value), sharding in zip(
    jax.tree.leaves_with_path(values), jax.tree.leaves(full, is_leaf=is_sharding)
  ):
    where = key_path_str((name, *path)) if name else key_path_str(path)
    _axis_rules.check_leaf_spec(where, np.shape(value), sharding.spec, sharding.mesh.shape)


class PartitionedFunction:
  """A jitted function that checks shardings and runs under its mesh and rules.

  When jit rejects a call's shardings (before anything is compiled), the
  inputs are checked for a sharded dimension that does not divide its mesh
  axes, then the outputs the same way (with ``jax.eval_shape``), so the
  ``ValueError`` names the leaf; a call that jit takes costs no check. Calls run inside
  ``jax.set_mesh`` and ``flax.linen.logical_axis_rules``, so
  ``nn.with_logical_constraint`` inside ``fn`` uses the partitioner's rules.

  Attributes:
    fn: the wrapped function.
    jitted: the underlying ``jax.jit`` function.
    in_shardings: the ``NamedSharding`` tree for the positional, non-static
      arguments.
    out_shardings: the ``NamedSharding`` tree for the outputs.
  """

  def __init__(
    self,
    fn: Callable[..., Any],
    *,
    in_shardings: Any,
    out_shardings: Any,
    static_argnums: tuple[int, ...],
    donate_argnums: tuple[int, ...],
    mesh: Mesh,
    rules: LogicalAxisRules,
  ):
    self.fn = fn
    self.jitted = jax.jit(
      fn,
      in_shardings=in_shardings,
      out_shardings=out_shardings,
      static_argnums=static_argnums,
      donate_argnums=donate_argnums,
    )
    self.in_shardings = in_shardings
    self.out_shardings = out_shardings
    self._static_argnums = static_argnums
    self._mesh = mesh
    self._rules = rules

  def _split(self, args: tuple[Any, ...]) -> tuple[tuple[Any, ...], dict[int, Any]]:
    dynamic = tuple(a for i, a in enumerate(args) if i not in self._static_argnums)
    static = {i: a for i, a in enumerate(args) if i in self._static_argnums}
    return dynamic, static

  def _check_inputs(self, args: tuple[Any, ...]) -> None:
    dynamic, static = self._split(args)
    in_shardings = self.in_shardings
    if not isinstance(in_shardings, tuple):
      in_shardings = (in_shardings,) * len(dynamic)
    positions = [i for i in range(len(args)) if i not in static]
    for position, value, sharding in zip(positions, dynamic, in_shardings):
      check_divisible(value, sharding, name=f"args/{position}")

  def _check_outputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    dynamic, static = self._split(args)

    def with_static(*dynamic_args, **kw):
      it = iter(dynamic_args)
      full = (static[i] if i in static else next(it) for i in range(len(args)))
      return self.fn(*full, **kw)

    check_divisible(
      jax.eval_shape(with_static, *dynamic, **kwargs), self.out_shardings, name="output"
    )

  def _run(self, method: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    with jax.set_mesh(self._mesh), nn.logical_axis_rules(tuple(self._rules)):
      try:
        return method(*args, **kwargs)
      except ValueError as e:
        try:
          self._check_inputs(args)
          self._check_outputs(args, kwargs)
        except ValueError as named:
          raise named from e
        raise

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    return self._run(self.jitted, args, kwargs)

  def lower(self, *args: Any, **kwargs: Any) -> Any:
    """Lowers like ``jax.jit(...).lower``, under the mesh and rules."""
    return self._run(self.jitted.lower, args, kwargs)


class Partitioner:
  """Maps logical axes onto a mesh and partitions functions with ``jax.jit``.

  Args:
    mesh: the device mesh (see ``create_mesh``).
    logical_axis_rules: rules, or a list of ``(logical_name, mesh_axes)``
      pairs. Defaults to ``standard_logical_axis_rules()``.
    unknown_axis: what to do with a logical name that no rule mentions.

  Example:
    >>> from t5x_optim.partitioning import create_mesh
    >>> p = Partitioner(create_mesh(devices=jax.devices()[:1]))
    >>> p.mesh_sharding({'w': PartitionSpec('embed', 'mlp')})['w'].spec
    P(None, 'model')
  """

  def __init__(
    self,
    mesh: Mesh,
    logical_axis_rules: LogicalAxisRules | Sequence[Rule] | None = None,
    *,
    unknown_axis: UnknownAxis | str = UnknownAxis.RAISE,
  ):
    self._mesh = mesh
    self._rules = _axis_rules.as_logical_axis_rules(
      _axis_rules.standard_logical_axis_rules()
      if logical_axis_rules is None
      else logical_axis_rules
    )
    self._unknown_axis = UnknownAxis(unknown_axis)

  @property
  def mesh(self) -> Mesh:
    return self._mesh

  @property
  def logical_axis_rules(self) -> LogicalAxisRules:
    return self._rules

  @property
  def unknown_axis(self) -> UnknownAxis:
    return self._unknown_axis

  def logical_to_mesh_axes(self, logical_tree: Any) -> Any:
    """Maps a tree of logical specs to mesh specs with the parameter rules.

    Example:
      >>> from t5x_optim.partitioning import create_mesh
      >>> p = Partitioner(create_mesh(devices=jax.devices()[:1]))
      >>> p.logical_to_mesh_axes((PartitionSpec('batch', 'vocab'), None))
      (P('data', 'model'), None)
    """
    return _axis_rules.logical_to_mesh_axes_tree(
      logical_tree, self._rules, unknown=self._unknown_axis
    )

  def mesh_axes_to_sharding(self, mesh_axes_tree: Any) -> Any:
    """Turns a tree of mesh specs into ``NamedSharding``s (None: replicated).

    Example:
      >>> from t5x_optim.partitioning import create_mesh
      >>> p = Partitioner(create_mesh(devices=jax.devices()[:1]))
      >>> p.mesh_axes_to_sharding([None])[0].spec
      P()
    """

    def to_sharding(path, spec):
      if isinstance(spec, NamedSharding):
        return spec
      _axis_rules.check_spec_leaf(path, spec)
      try:
        return NamedSharding(self._mesh, spec or PartitionSpec())
      except ValueError as e:
        raise ValueError(f"{_where(path)}: {e}") from e

    return jax.tree.map_with_path(to_sharding, mesh_axes_tree, is_leaf=_is_resource_leaf)

  def mesh_sharding(self, logical_tree: Any) -> Any:
    """Turns a tree of logical specs into a tree of ``NamedSharding``s.

    ``None`` leaves become replicated shardings; ``NamedSharding`` leaves
    (e.g. from :meth:`get_shardings`, which may carry the ZeRO axis) are
    kept as they are.

    Example:
      >>> from t5x_optim.partitioning import create_mesh
      >>> p = Partitioner(create_mesh(devices=jax.devices()[:1]))
      >>> p.mesh_sharding(PartitionSpec('batch')).spec
      P('data',)
    """

    def convert(path, leaf):
      return leaf if isinstance(leaf, NamedSharding) else self._leaf_mesh_axes(path, leaf)

    mesh_axes = jax.tree.map_with_path(convert, logical_tree, is_leaf=_is_resource_leaf)
    return self.mesh_axes_to_sharding(mesh_axes)

  def _leaf_mesh_axes(self, path: jax.tree_util.KeyPath, spec: Any) -> PartitionSpec | None:
    _axis_rules.check_spec_leaf(path, spec)
    try:
      return _axis_rules.logical_to_mesh_axes(spec, self._rules, unknown=self._unknown_axis)
    except ValueError as e:
      raise ValueError(f"{_where(path)}: {e}") from e

  def partition(
    self,
    fn: Callable[..., Any],
    in_axis_resources: Any,
    out_axis_resources: Any,
    *,
    static_argnums: int | Sequence[int] = (),
    donate_argnums: int | Sequence[int] = (),
  ) -> PartitionedFunction:
    """Wraps ``fn`` in ``jax.jit`` with shardings given as logical axes.

    Args:
      fn: the function.
      in_axis_resources: logical specs for the positional arguments that
        are not static: a tuple with one prefix tree per argument, or one
        prefix tree for all of them. ``None`` leaves are replicated;
        ``NamedSharding`` leaves are used as they are.
      out_axis_resources: the same for the outputs.
      static_argnums: as in ``jax.jit``.
      donate_argnums: as in ``jax.jit``.

    Returns:
      The partitioned function; see :class:`PartitionedFunction`.

    Example:
      >>> from t5x_optim.partitioning import create_mesh
      >>> p = Partitioner(create_mesh(devices=jax.devices()[:1]))
      >>> batch = PartitionSpec('batch')
      >>> double = p.partition(lambda x: 2 * x, (batch,), batch)
      >>> double(np.ones(4)).tolist()
      [2.0, 2.0, 2.0, 2.0]
    """
    return PartitionedFunction(
      fn,
      in_shardings=self.mesh_sharding(in_axis_resources),
      out_shardings=self.mesh_sharding(out_axis_resources),
      static_argnums=_as_tuple(static_argnums),
      donate_argnums=_as_tuple(donate_argnums),
      mesh=self._mesh,
      rules=self._rules,
    )

  def get_logical_axes(self, train_state: HasLogicalAxes) -> Any:
    """Returns ``train_state.as_logical_axes()``."""
    return train_state.as_logical_axes()

  def get_mesh_axes(self, train_state: HasLogicalAxes) -> Any:
    """Returns the train state with each array replaced by its mesh spec.

    Parameters follow the rules; optimizer-state leaves (below
    ``param_states``) also get the ZeRO axis when the rules set
    ``optimizer_state_axis``, and are replicated along a dimension whose size
    a mesh axis of theirs does not divide (`drop_indivisible_axes`: the
    block scales of a low-precision moment restore onto any mesh its
    parameter fits). ``train_state`` may hold arrays or
    ``jax.ShapeDtypeStruct``s (from ``jax.eval_shape``); their shapes are
    checked against the mesh.

    Raises:
      ValueError: a leaf that cannot be mapped, or a parameter whose sharded
        dimension does not divide; the message names its path.
    """
    logical = self.get_logical_axes(train_state)
    axis = self._rules.optimizer_state_axis
    mesh_shape = self._mesh.shape
    if axis is not None and axis not in mesh_shape:
      raise ValueError(
        f"optimizer_state_axis {axis!r} is not a mesh axis; the mesh has {dict(mesh_shape)}."
      )

    def convert(path, spec, value):
      mesh_spec = self._leaf_mesh_axes(path, spec)
      shape = np.shape(value)
      if is_optimizer_state_path(path):
        mesh_spec = _axis_rules.fit_state_spec(
          _where(path), mesh_spec, shape, mesh_shape=mesh_shape, axis=axis
        )
      _axis_rules.check_leaf_spec(_where(path), shape, mesh_spec, mesh_shape)
      return mesh_spec

    return jax.tree.map_with_path(convert, logical, train_state, is_leaf=_axis_rules.is_spec_leaf)

  def get_shardings(self, train_state: HasLogicalAxes) -> Any:
    """Returns the train state with each array replaced by its ``NamedSharding``."""
    return self.mesh_axes_to_sharding(self.get_mesh_axes(train_state))
