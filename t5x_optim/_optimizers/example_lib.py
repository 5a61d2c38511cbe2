"""`ExampleLibOptimizerDef`: `jax.example_libraries.optimizers` triples as an `OptimizerDef`.

A triple's packed state holds, for every param, a small pytree that includes
the param itself (adam's ``(x, m, v)``). The definition stores only the other
parts, as nested dicts keyed like the params (``param_states/dense/kernel/m``),
and rebuilds the packed state from the target at every step, so the memory is
the native triple's. Which state array holds the param is found by tracing the
triple's own ``get_params``; Python values in the state (sm3's ``x_shape``)
are rebuilt from the params' shapes.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.example_libraries import optimizers as example_lib
from jax.sharding import PartitionSpec

from t5x_optim._axes import specs as specs_lib
from t5x_optim._axes.engine import StateRulesFallback, derive_state_specs, logical_axes_from
from t5x_optim._axes.registry import StateRuleContext, register_state_rule
from t5x_optim._axes.rules import is_spec_leaf
from t5x_optim._optimizers.interface import (
  Optimizer,
  OptimizerDef,
  OptimizerState,
  structure_mismatch,
  tree_like,
)

__all__ = [
  "EXAMPLE_LIB_OPTIMIZERS",
  "ExampleLibHyperParams",
  "ExampleLibOptimizerDef",
  "example_lib_optimizer_makers",
  "wrap_example_lib_optimizer",
]

_STEP_SIZE = "step_size"

_SLOT_NAMES: dict[str, tuple[str, ...]] = {
  "momentum": ("x", "velocity"),
  "nesterov": ("x", "velocity"),
  "adagrad": ("x", "g_sq", "m"),
  "rmsprop": ("x", "avg_sq_grad"),
  "rmsprop_momentum": ("x", "avg_sq_grad", "mom"),
  "adam": ("x", "m", "v"),
  "adamax": ("x", "m", "u"),
  "sm3": ("x", "m", "vs", "x_shape"),
}
"""Names of the per-param state positions of jax's own triples, from their source."""

_DECORATED_CODE = example_lib.optimizer(lambda: None).__code__


def example_lib_optimizer_makers() -> dict[str, Callable[..., example_lib.Optimizer]]:
  """Every maker in `jax.example_libraries.optimizers` decorated with `@optimizer`.

  Example:
    >>> sorted(example_lib_optimizer_makers())[:3]
    ['adagrad', 'adam', 'adamax']
  """
  return {
    name: obj
    for name, obj in sorted(vars(example_lib).items())
    if not name.startswith("_") and getattr(obj, "__code__", None) is _DECORATED_CODE
  }


@struct.dataclass
class ExampleLibHyperParams:
  """Hyper-params of an `ExampleLibOptimizerDef`.

  The triple keeps its step size (or schedule) in its closures; a non-None
  `learning_rate` rebuilds the triple with that constant step size for the
  step, which needs a definition made by `wrap_example_lib_optimizer` (or
  `ExampleLibOptimizerDef.from_maker`) from a constant step size.
  """

  learning_rate: Any = None


class _Slot(enum.Enum):
  PARAM = "param"
  PART = "part"
  STATIC = "static"


@dataclasses.dataclass(frozen=True)
class _LeafLayout:
  """Where one param's packed state keeps the param, its parts and Python values.

  Attributes:
    treedef: the structure of the param's state in the packed state.
    slots: per flat state leaf, `(_Slot.PARAM, shape)`, `(_Slot.PART, names)`
      (its path in the parts dict) or `(_Slot.STATIC, value)`.
  """

  treedef: Any
  slots: tuple[tuple[_Slot, Any], ...]

  def pack(self, param: Any, parts: Mapping[str, Any]) -> list[Any]:
    """The param's flat packed state, rebuilt from `param` and its `parts`."""
    flat = []
    for kind, data in self.slots:
      if kind is _Slot.PARAM:
        flat.append(param if np.shape(param) == data else jnp.reshape(param, data))
      elif kind is _Slot.PART:
        flat.append(functools.reduce(lambda node, name: node[name], data, parts))
      else:
        flat.append(data)
    return flat

  def unpack(
    self, flat: Sequence[Any], *, where: str, like: Sequence[Any] | None = None
  ) -> dict[str, Any]:
    """The parts dict of a flat packed state (the param copy left out).

    With `like` (the flat state before an update), parts keep its dtypes.

    Raises:
      ValueError: if the update changed a Python value of the state (it is
        rebuilt from the params, so the change would be lost).
    """
    parts: dict[str, Any] = {}
    for k, ((kind, data), leaf) in enumerate(zip(self.slots, flat, strict=True)):
      if kind is _Slot.PART:
        if like is not None:
          leaf = leaf.astype(jnp.result_type(like[k]))
        node = parts
        for name in data[:-1]:
          node = node.setdefault(name, {})
        node[data[-1]] = leaf
      elif kind is _Slot.STATIC and (_is_array(leaf) or leaf != data):
        raise ValueError(
          f"The triple's update changed the Python value {data!r} in the state of "
          f"param {where} to {leaf!r}; ExampleLibOptimizerDef rebuilds Python "
          "values from the params, so state that changes must be arrays."
        )
    return parts


@dataclasses.dataclass(frozen=True)
class _Layout:
  """The per-param layouts for one params structure (shapes and dtypes)."""

  params_def: Any
  paths: tuple[str, ...]
  leaves: tuple[_LeafLayout, ...]

  def parts(self, params: Any, param_states: Any) -> list[Any]:
    """Each param's parts dict; dicts and FrozenDicts are interchangeable."""
    try:
      return self.params_def.flatten_up_to(param_states)
    except (TypeError, ValueError):
      pass
    try:
      thawed_def = jax.tree.structure(specs_lib.thaw(params))
      return thawed_def.flatten_up_to(specs_lib.thaw(param_states))
    except (TypeError, ValueError) as error:
      raise ValueError(
        "The optimizer state does not fit the params: "
        f"{structure_mismatch(param_states, params, name='state')}."
      ) from error

  def pack(self, params: Any, param_states: Any) -> example_lib.OptimizerState:
    """The triple's packed state for `params` and the stored parts."""
    parts = self.parts(params, param_states)
    flat_params = self.params_def.flatten_up_to(params)
    return example_lib.OptimizerState(
      [leaf.pack(p, s) for leaf, p, s in zip(self.leaves, flat_params, parts, strict=True)],
      self.params_def,
      [leaf.treedef for leaf in self.leaves],
    )

  def unpack(
    self, packed: example_lib.OptimizerState, *, like: example_lib.OptimizerState | None = None
  ) -> Any:
    """The stored form of a packed state: parts dicts in the params' structure.

    With `like` (the packed state before an update), parts keep its dtypes.
    """
    likes = [None] * len(self.leaves) if like is None else like.packed_state
    return self.params_def.unflatten(
      leaf.unpack(flat, where=path, like=old)
      for leaf, flat, path, old in zip(
        self.leaves, packed.packed_state, self.paths, likes, strict=True
      )
    )


def _is_array(value: Any) -> bool:
  return isinstance(value, jax.Array | np.ndarray | np.generic)


def _key_name(key: Any) -> str:
  for attribute in ("name", "key", "idx"):
    if hasattr(key, attribute):
      return str(getattr(key, attribute))
  return str(key)


def _part_names(path: Sequence[Any], slot_names: Sequence[str] | None) -> tuple[str, ...]:
  names = [_key_name(key) for key in path]
  first = getattr(path[0], "idx", None) if path else None
  if slot_names is not None and first is not None and first < len(slot_names):
    names[0] = slot_names[first]
  return tuple(names)


def _abstract_init(
  triple: example_lib.Optimizer, params: Any
) -> tuple[list[list[Any]], list[list[Any]], list[Any]]:
  """Traces `init_fn` on abstract params.

  Returns:
    per param: the shapes of its state arrays, the flat state with `None` at
    array positions and Python values elsewhere, and its state treedef.
  """
  captured: dict[str, Any] = {}

  def init_arrays(abstract_params: Any) -> list[list[Any]]:
    states_flat, _, subtree_defs = triple.init_fn(abstract_params)
    captured["statics"] = [[None if _is_array(v) else v for v in flat] for flat in states_flat]
    captured["treedefs"] = list(subtree_defs)
    return [[v for v in flat if _is_array(v)] for flat in states_flat]

  shapes = jax.eval_shape(init_arrays, params)
  return shapes, captured["statics"], captured["treedefs"]


def _merge(statics: Sequence[Any], arrays: Sequence[Any]) -> list[Any]:
  it = iter(arrays)
  return [next(it) if v is None else v for v in statics]


def _param_sources(
  triple: example_lib.Optimizer,
  params_def: Any,
  shapes: list[list[Any]],
  statics: list[list[Any]],
  treedefs: list[Any],
) -> list[set[tuple[int, int]]]:
  """For each param, the `(param index, array index)` state arrays `get_params` reads."""
  owners = [(i, j) for i, row in enumerate(shapes) for j in range(len(row))]

  def params_from(arrays: list[list[Any]]) -> list[Any]:
    flats = [_merge(s, a) for s, a in zip(statics, arrays, strict=True)]
    return params_def.flatten_up_to(
      triple.params_fn(example_lib.OptimizerState(flats, params_def, treedefs))
    )

  jaxpr = jax.make_jaxpr(params_from)(shapes).jaxpr
  deps: dict[Any, frozenset[int]] = {v: frozenset({k}) for k, v in enumerate(jaxpr.invars)}
  for eqn in jaxpr.eqns:
    used = frozenset().union(
      *(deps.get(v, frozenset()) for v in eqn.invars if isinstance(v, jax_core.Var))
    )
    deps.update((v, used) for v in eqn.outvars)
  return [
    {owners[k] for k in deps.get(v, ())} if isinstance(v, jax_core.Var) else set()
    for v in jaxpr.outvars
  ]


def _leaf_layout(
  index: int,
  param: Any,
  path: str,
  shapes: Sequence[Any],
  statics: Sequence[Any],
  treedef: Any,
  sources: set[tuple[int, int]],
  slot_names: Sequence[str] | None,
) -> _LeafLayout:
  """The layout of one param's state; raises unless it holds the param once."""
  if len(sources) != 1 or next(iter(sources))[0] != index:
    raise ValueError(
      f"The triple's get_params reads param {path} from state arrays "
      f"{sorted(sources)} (param, array); ExampleLibOptimizerDef needs each "
      "param kept once in its own per-param state, as every "
      "jax.example_libraries optimizer keeps it."
    )
  [(_, param_array)] = sources
  source = shapes[param_array]
  if source.size != np.size(param) or source.dtype != jnp.result_type(param):
    raise ValueError(
      f"The triple stores param {path} (shape {np.shape(param)}, dtype "
      f"{jnp.result_type(param)}) as shape {source.shape} dtype {source.dtype}; "
      "only a reshape can be rebuilt from the params."
    )
  key_paths = [
    p
    for p, _ in jax.tree_util.tree_flatten_with_path(
      jax.tree.unflatten(treedef, range(treedef.num_leaves))
    )[0]
  ]
  slots = []
  array_index = 0
  for key_path, static in zip(key_paths, statics, strict=True):
    if static is not None:
      slots.append((_Slot.STATIC, static))
      continue
    if array_index == param_array:
      slots.append((_Slot.PARAM, tuple(source.shape)))
    else:
      slots.append((_Slot.PART, _part_names(key_path, slot_names)))
    array_index += 1
  return _LeafLayout(treedef=treedef, slots=tuple(slots))


def _trace_layout(
  triple: example_lib.Optimizer, params: Any, slot_names: Sequence[str] | None
) -> _Layout:
  path_leaves, params_def = jax.tree_util.tree_flatten_with_path(params)
  paths = tuple(jax.tree_util.keystr(p) for p, _ in path_leaves)
  leaves = [leaf for _, leaf in path_leaves]
  shapes, statics, treedefs = _abstract_init(triple, params)
  sources = _param_sources(triple, params_def, shapes, statics, treedefs)
  return _Layout(
    params_def=params_def,
    paths=paths,
    leaves=tuple(
      _leaf_layout(i, *args, slot_names)
      for i, args in enumerate(zip(leaves, paths, shapes, statics, treedefs, sources, strict=True))
    ),
  )


def _is_per_dim(node: Mapping[str, Any], shape: tuple[int, ...]) -> bool:
  """Whether `node` holds one rank-1 vector per param dimension (sm3's `vs`)."""
  return (
    len(shape) > 0
    and set(node) == {str(d) for d in range(len(shape))}
    and all(specs_lib.leaf_shape(node[str(d)]) == (shape[d],) for d in range(len(shape)))
  )


def _part_specs(node: Any, shape: tuple[int, ...], spec: PartitionSpec | None) -> Any:
  """Logical specs of one param's parts; unmatched leaves stay `UNDERIVED`."""
  if isinstance(node, Mapping):
    if _is_per_dim(node, shape):
      return {
        key: None if spec is None else specs_lib.canonical(PartitionSpec(spec[int(key)]), 1)
        for key in node
      }
    return {key: _part_specs(value, shape, spec) for key, value in node.items()}
  part_shape = specs_lib.leaf_shape(node)
  if spec is None or all(d == 1 for d in part_shape):
    return None
  if part_shape == shape:
    return spec
  return specs_lib.UNDERIVED


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _PartsNode:
  """The node the engine derives an `ExampleLibOptimizerDef` state's specs on.

  Attributes:
    parts: each param's parts dict (nested dicts), in the params' structure.
  """

  parts: Any


def _parts_rule(state: _PartsNode, specs: _PartsNode, context: StateRuleContext) -> _PartsNode:
  """The state rule for `_PartsNode`: each param's parts from its shape and spec.

  A part with its param's shape gets the param's spec; a rank-1 vector per
  param dimension (sm3's `vs`) gets that dimension's entry; scalars and
  parts of replicated params get None; anything else stays `UNDERIVED`.
  """
  del specs
  return _PartsNode(
    jax.tree.map(
      lambda spec, param, parts: _part_specs(parts, specs_lib.leaf_shape(param), spec),
      context.param_specs,
      context.params,
      state.parts,
      is_leaf=is_spec_leaf,
    )
  )


register_state_rule(
  _PartsNode,
  _parts_rule,
  underived_reason="they have neither their param's shape nor one dimension of it",
)


def _leaf_name(path: jax.tree_util.KeyPath) -> str:
  """A parts leaf's path in `param_states` (`['dense']['kernel']['m']`)."""
  return jax.tree_util.keystr(path[1:])


def _reject_override(reason: str) -> Callable[[Any], example_lib.Optimizer]:
  def reject(learning_rate: Any) -> example_lib.Optimizer:
    raise ValueError(
      f"learning_rate={learning_rate!r} was passed to apply_gradient, but {reason} "
      "Pass learning_rate=None to use the triple's own step size."
    )

  return reject


def _step_size_rebuilder(
  maker: Callable[..., example_lib.Optimizer], bound: inspect.BoundArguments
) -> Callable[[Any], example_lib.Optimizer]:
  """Rebuilds `maker(*bound)` with another constant step size, where allowed."""
  if _STEP_SIZE not in bound.arguments:
    return _reject_override(f"{maker.__name__} has no step_size argument.")
  if callable(bound.arguments[_STEP_SIZE]):
    return _reject_override(
      f"{maker.__name__} was built with a step-size schedule, which an override would replace."
    )

  def with_step_size(step_size: Any) -> example_lib.Optimizer:
    new = bound.signature.bind(*bound.args, **bound.kwargs)
    new.arguments[_STEP_SIZE] = step_size
    return maker(*new.args, **new.kwargs)

  return with_step_size


class ExampleLibOptimizerDef(OptimizerDef):
  """A `jax.example_libraries.optimizers` triple as a T5X `OptimizerDef`.

  `update_fn` gets the int32 `state.step` as its step index, so step-size
  schedules see the same index as in the triple's own loop. `param_states`
  holds, per param, a dict of the state parts other than the param (named by
  `slot_names` for positions of a tuple state, else by position), so a state
  dict reads `state/param_states/dense/kernel/m`. New params and parts are
  cast back to their dtypes, so the state is dtype-stable. (The step is an
  int32 array where the native loop passes a Python int, so with bfloat16
  params a step-dependent schedule computes in float32 before that cast; with
  float32 params the result is bit-identical.)

  Args:
    triple: the `(init_fn, update_fn, params_fn)` triple.
    slot_names: names of the positions of each param's tuple state (the
      param's own position included and ignored).
    with_step_size: rebuilds the triple with a given constant step size; it
      makes `learning_rate=` overrides work. Without it they raise.
    fallback: what `derive_logical_axes` does with a state leaf that has
      neither its param's shape nor one dimension of it (see `OptimizerDef`).

  Example:
    >>> import jax.numpy as jnp
    >>> from jax.example_libraries import optimizers
    >>> opt = ExampleLibOptimizerDef(optimizers.adam(0.1)).create({'w': jnp.ones(2)})
    >>> sorted(opt.apply_gradient({'w': jnp.ones(2)}).state.param_states['w'])
    ['1', '2']
  """

  def __init__(
    self,
    triple: example_lib.Optimizer | tuple[Callable[..., Any], ...],
    *,
    slot_names: Sequence[str] | None = None,
    with_step_size: Callable[[Any], example_lib.Optimizer] | None = None,
    fallback: StateRulesFallback | str = StateRulesFallback.REPLICATE_WITH_WARNING,
  ):
    super().__init__(hyper_params=ExampleLibHyperParams(), fallback=fallback)
    self.triple = example_lib.Optimizer(*triple)
    self.slot_names = None if slot_names is None else tuple(slot_names)
    self.with_step_size = with_step_size or _reject_override(
      "the triple was built without its maker, so its step size is baked in. "
      "Build it with wrap_example_lib_optimizer(maker)(...) to allow overrides."
    )
    self._layouts: dict[Any, _Layout] = {}

  @classmethod
  def from_maker(
    cls, maker: Callable[..., example_lib.Optimizer], *args: Any, **kwargs: Any
  ) -> ExampleLibOptimizerDef:
    """Builds `maker(*args, **kwargs)`, remembering how to change its step size.

    jax's own makers also get their state positions' names (`m`, `v`, ...).

    Example:
      >>> from jax.example_libraries import optimizers
      >>> ExampleLibOptimizerDef.from_maker(optimizers.adam, 1e-3).slot_names
      ('x', 'm', 'v')
    """
    bound = inspect.signature(maker).bind(*args, **kwargs)
    bound.apply_defaults()
    name = getattr(maker, "__name__", "")
    own = example_lib_optimizer_makers().get(name) is maker
    return cls(
      maker(*bound.args, **bound.kwargs),
      slot_names=_SLOT_NAMES.get(name) if own else None,
      with_step_size=_step_size_rebuilder(maker, bound),
    )

  def _layout(self, params: Any) -> _Layout:
    leaves, params_def = jax.tree.flatten(params)
    key = (params_def, tuple((tuple(np.shape(x)), jnp.result_type(x)) for x in leaves))
    if key not in self._layouts:
      abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), params
      )
      self._layouts[key] = _trace_layout(self.triple, abstract, self.slot_names)
    return self._layouts[key]

  def init_state(self, params: Any) -> OptimizerState:
    return OptimizerState(
      step=jnp.zeros((), jnp.int32),
      param_states=self._layout(params).unpack(self.triple.init_fn(params)),
    )

  def apply_gradient(
    self,
    hyper_params: ExampleLibHyperParams,
    params: Any,
    state: OptimizerState,
    grads: Any,
    **extra_args: Any,
  ) -> tuple[Any, OptimizerState]:
    del extra_args
    triple = self.triple
    if hyper_params.learning_rate is not None:
      triple = example_lib.Optimizer(*self.with_step_size(hyper_params.learning_rate))
    grads = tree_like(grads, params)
    layout = self._layout(params)
    packed = layout.pack(params, state.param_states)
    try:
      new_packed = triple.update_fn(state.step, grads, packed)
    except TypeError as error:
      mismatch = structure_mismatch(grads, params, name="grads")
      if mismatch is None:
        raise
      raise ValueError(f"The grads do not fit the params: {mismatch}.") from error
    new_params = jax.tree.map(
      lambda new, old: new.astype(jnp.result_type(old)), triple.params_fn(new_packed), params
    )
    return new_params, OptimizerState(
      step=state.step + 1, param_states=layout.unpack(new_packed, like=packed)
    )

  def derive_logical_axes(self, optimizer: Optimizer, param_logical_axes: Any) -> Optimizer:
    """Returns `optimizer` with every leaf replaced by its logical spec.

    A part with its param's shape gets the param's spec; a rank-1 vector per
    param dimension (sm3's `vs`) gets that dimension's entry; scalars and
    parts of replicated params get None. Anything else goes to `fallback`.

    Raises:
      ValueError: if the axes do not fit the params, or (with
        `StateRulesFallback.RAISE`) naming the unmatched state leaves.
    """
    axes = logical_axes_from(param_logical_axes)
    layout = self._layout(optimizer.target)
    if jax.tree.structure(specs_lib.thaw(axes), is_leaf=is_spec_leaf) != jax.tree.structure(
      specs_lib.thaw(optimizer.target)
    ):
      raise ValueError(
        "The param logical axes do not fit the params: "
        f"{structure_mismatch(axes, optimizer.target, name='axes')}."
      )
    parts = layout.parts(optimizer.target, optimizer.state.param_states)
    node = _PartsNode(layout.params_def.unflatten(specs_lib.thaw(p) for p in parts))
    param_states = derive_state_specs(
      node, axes, params=optimizer.target, fallback=self.fallback, leaf_name=_leaf_name
    ).parts
    return optimizer.replace(
      target=axes, state=OptimizerState(step=None, param_states=param_states)
    )


def wrap_example_lib_optimizer(
  maker: Callable[..., example_lib.Optimizer],
) -> Callable[..., ExampleLibOptimizerDef]:
  """Turns a triple maker into one that builds an `ExampleLibOptimizerDef`.

  The result keeps the maker's docstring and signature, so gin can configure
  it, and supports `learning_rate=` overrides when built with a constant step
  size.

  Example:
    >>> from jax.example_libraries import optimizers
    >>> adam = wrap_example_lib_optimizer(optimizers.adam)
    >>> type(adam(step_size=1e-3)).__name__
    'ExampleLibOptimizerDef'
  """

  @functools.wraps(maker)
  def wrapped_maker(*args: Any, **kwargs: Any) -> ExampleLibOptimizerDef:
    return ExampleLibOptimizerDef.from_maker(maker, *args, **kwargs)

  return wrapped_maker


def _named_wrapper(name: str, maker: Callable[..., example_lib.Optimizer]) -> Callable[..., Any]:
  wrapped = wrap_example_lib_optimizer(maker)
  wrapped.__name__ = wrapped.__qualname__ = f"example_lib_{name}"
  return wrapped


EXAMPLE_LIB_OPTIMIZERS: dict[str, Callable[..., ExampleLibOptimizerDef]] = {
  f"example_lib_{name}": _named_wrapper(name, maker)
  for name, maker in example_lib_optimizer_makers().items()
}
"""Every discovered triple maker, wrapped, keyed `example_lib_<name>`."""

globals().update(EXAMPLE_LIB_OPTIMIZERS)
__all__ += sorted(EXAMPLE_LIB_OPTIMIZERS)
