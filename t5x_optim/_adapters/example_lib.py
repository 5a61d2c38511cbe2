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

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.example_libraries import optimizers as example_lib

from t5x_optim._adapters.example_lib_layout import Layout, PartsNode, leaf_name, trace_layout
from t5x_optim._adapters.optax_wrapper import check_learning_rate
from t5x_optim._axes import specs as specs_lib
from t5x_optim._axes.auto import auto_axes_like, in_update_layouts
from t5x_optim._axes.engine import StateRulesFallback, derive_state_specs, logical_axes_from
from t5x_optim._axes.rules import is_spec_leaf
from t5x_optim._core.interface import (
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
  `ExampleLibOptimizerDef.from_maker`) from a constant step size. It must be
  a real scalar, as `OptaxWrapper`'s (a TypeError otherwise).
  """

  learning_rate: Any = None


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
  cast back to their dtypes, so the state is dtype-stable. The step is an
  int32 array, as in the triple's own loop under `jax.jit` with a traced step:
  with float32 params the result is bit-identical to that loop. An eager loop
  passing a Python int computes a step-dependent schedule such as
  `exponential_decay` in float64 (about 1 ulp apart), and with bfloat16 params
  the schedule computes in float32 before the cast.

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
    self._layouts: dict[Any, Layout] = {}

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

  def _layout(self, params: Any) -> Layout:
    leaves, params_def = jax.tree.flatten(params)
    key = (params_def, tuple((tuple(np.shape(x)), jnp.result_type(x)) for x in leaves))
    if key not in self._layouts:
      abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), params
      )
      self._layouts[key] = trace_layout(self.triple, abstract, self.slot_names)
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
      check_learning_rate(hyper_params.learning_rate)
      triple = example_lib.Optimizer(*self.with_step_size(hyper_params.learning_rate))
    grads = tree_like(grads, params)
    layout = self._layout(params)
    # Under Explicit mesh axes the update runs with them Auto, each param read in the layout
    # of its most sharded state (`auto_axes_like`, `in_update_layouts`).
    read, put_back = in_update_layouts(params, state.param_states)
    packed = layout.pack(read, state.param_states)
    update = auto_axes_like(triple.update_fn, packed)
    try:
      new_packed = update(state.step, grads, packed)
    except TypeError as error:
      mismatch = structure_mismatch(grads, params, name="grads")
      if mismatch is None:
        raise
      raise ValueError(f"The grads do not fit the params: {mismatch}.") from error
    new_params = jax.tree.map(
      lambda new, old: new.astype(jnp.result_type(old)),
      put_back(triple.params_fn(new_packed)),
      params,
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
    node = PartsNode(layout.params_def.unflatten(specs_lib.thaw(p) for p in parts))
    param_states = derive_state_specs(
      node, axes, params=optimizer.target, fallback=self.fallback, leaf_name=leaf_name
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
