"""`OptaxWrapper`: any optax `GradientTransformation` as an `OptimizerDef`."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from t5x_optim._axes import engine as _state_rules
from t5x_optim._axes.auto import auto_axes_like, in_update_layouts
from t5x_optim._axes.kernel_axes import AxesKey, axes_key
from t5x_optim._core.interface import Optimizer, OptimizerDef, OptimizerState, trained_params
from t5x_optim._keypaths import key_path_str
from t5x_optim._layouts.fused import FusedUpdate
from t5x_optim._layouts.stacked import StackedOptimizerDef, StackedParams
from t5x_optim._warn import warn

__all__ = [
  "OPTAX_EXTRA_ARGS",
  "AxesAwareTransformation",
  "OptaxHyperParams",
  "OptaxWrapper",
  "axes_aware_chain",
  "chain",
  "checked_transformation",
  "inject_hyperparams",
  "is_transformation",
  "takes_param_axes",
  "trains_lookahead_params",
]

_LEARNING_RATE = "learning_rate"

FusedOption = FusedUpdate | str | bool
"""What ``fused=`` takes: a `FusedUpdate`, its string value or a bool."""

# The extra update arguments optax's own transformations read: `value`
# (reduce_on_plateau, momo), `grad` and `value_fn` (L-BFGS line search),
# `obj_fn` (sophia). Transformations reading others name them with
# `OptaxWrapper(..., extra_args=...)`.
OPTAX_EXTRA_ARGS = frozenset({"value", "grad", "value_fn", "obj_fn"})


def loss_extra_args(
  names: Collection[str], loss: Any, grads: Any, loss_fn: Callable[[Any], Any]
) -> dict[str, Any]:
  """optax's extra update arguments among `names`, for a loss and its gradient.

  ``value`` is `loss`, ``grad`` is `grads`, ``value_fn`` and ``obj_fn`` are `loss_fn` (the
  loss as a function of the params). optax's line searches give their ``value_fn`` every
  extra argument its signature names and refuse any other, so ``value_fn`` names ``obj_fn``
  (which sophia reads) and ignores it.

  Example:
    >>> args = loss_extra_args({'value', 'value_fn', 'lr'}, 2.0, None, lambda p: p * p)
    >>> sorted(args), args['value_fn'](3.0, obj_fn=None)
    (['value', 'value_fn'], 9.0)
  """

  def value_fn(params: Any, obj_fn: Any = None) -> Any:
    del obj_fn
    return loss_fn(params)

  given = {"value": loss, "grad": grads, "value_fn": value_fn, "obj_fn": loss_fn}
  return {name: given[name] for name in sorted(names) if name in given}


def _strongly_typed(leaf: Any) -> Any:
  """`leaf` of its own dtype but not weakly typed (an array or a tracer; others as given)."""
  if getattr(getattr(leaf, "aval", None), "weak_type", False):
    return jax.lax.convert_element_type(leaf, leaf.dtype)
  return leaf


def check_learning_rate(learning_rate: Any) -> None:
  """Checks that a `learning_rate=` override is a real scalar.

  Raises:
    TypeError: for a string, a bool, a complex number, a non-numeric value
      or anything that is not a scalar (a list, a shaped array).

  Example:
    >>> check_learning_rate(0.1)
  """
  problem = None
  if isinstance(learning_rate, bool) or not isinstance(
    learning_rate, int | float | np.ndarray | np.generic | jax.Array
  ):
    problem = f"a {type(learning_rate).__name__}"
  elif jnp.ndim(learning_rate) != 0:
    problem = f"an array of shape {jnp.shape(learning_rate)}"
  else:
    dtype = jnp.result_type(learning_rate)
    if not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)):
      problem = f"a scalar of dtype {dtype}"
  if problem is not None:
    raise TypeError(
      f"learning_rate= must be a real scalar (a Python number or a 0-d real array); "
      f"got {problem}: {learning_rate!r}."
    )


class AxesAwareTransformation(optax.GradientTransformationExtraArgs):
  """An optax transformation that needs the params' logical axes, and is built again with them.

  ``init`` and ``update`` are those of the transformation as built so far
  (with no axes, or those given when it was made); `with_param_axes`
  builds it again for given axes. `OptaxWrapper` and `chain` (for each of
  their transformations that is one) take the axes in ``set_param_axes``,
  T5X's hook, which T5X's train state, `TrainState.create` and
  `partitioning.init_sharded` call; `MultiOptimizer` forwards it. Make one
  with `of`. `low_precision` returns one when a rule of its ``param_modes``
  selects params by logical axis.

  Example:
    >>> import optax
    >>> built = []
    >>> def build(param_axes):
    ...   built.append(param_axes)
    ...   return optax.sgd(0.1)
    >>> tx = AxesAwareTransformation.of(optax.sgd(0.1), build)
    >>> opt_def = OptaxWrapper(tx)
    >>> opt_def.set_param_axes({'w': ('embed',)})
    >>> built
    [{'w': ('embed',)}]
  """

  @classmethod
  def of(
    cls,
    tx: optax.GradientTransformation,
    build: Callable[[Any], optax.GradientTransformation],
  ) -> AxesAwareTransformation:
    """``tx``, which ``build(param_axes)`` builds again for the params' logical axes."""
    tx = optax.with_extra_args_support(tx)
    out = cls(tx.init, tx.update)
    out._build = build
    return out

  def with_param_axes(self, param_axes: Any) -> optax.GradientTransformation:
    """The transformation built for ``param_axes`` (any form `logical_axes_from` accepts)."""
    return self._build(param_axes)


def _public_name(fn: Any) -> str:
  """``optax.adam`` for optax's own functions, else the function's module and name."""
  name = getattr(fn, "__qualname__", None) or repr(fn)
  for namespace in (optax, optax.contrib):
    if getattr(namespace, name, None) is fn:
      return f"{namespace.__name__}.{name}"
  return f"{getattr(fn, '__module__', None) or '?'}.{name}"


def is_transformation(value: Any) -> bool:
  """Whether `value` is an optax transformation: it has callable ``init`` and ``update``."""
  return callable(getattr(value, "init", None)) and callable(getattr(value, "update", None))


def checked_transformation(value: Any, where: str) -> Any:
  """`value` when it is an optax transformation (callable ``init`` and ``update``).

  Raises:
    TypeError: naming `where` and what it got, for instance the function
      that builds a transformation (gin's ``@optax.adam`` without ``()``).

  Example:
    >>> checked_transformation(optax.adam, 'OptaxWrapper')
    Traceback (most recent call last):
    ...
    TypeError: OptaxWrapper takes an optax transformation (with init and update), got the function optax.adam, which builds one: call it (optax.adam(...); in gin @optax.adam(), with the parentheses).
  """
  if is_transformation(value):
    return value
  if isinstance(value, OptimizerDef) and hasattr(value, "optax_optimizer"):
    got = (
      f"an {type(value).__name__}, an optimizer definition already: give its transformation "
      "(optax_optimizer), or give the definition where one is taken"
    )
  elif isinstance(value, OptimizerDef):
    got = f"an {type(value).__name__}, an optimizer definition that holds no optax transformation"
  elif callable(value):
    name = _public_name(value)
    got = (
      f"the function {name}, which builds one: call it ({name}(...); in gin @{name}(), with "
      "the parentheses)"
    )
  else:
    got = repr(value) if value is None else f"{type(value).__name__} {value!r}"
  raise TypeError(f"{where} takes an optax transformation (with init and update), got {got}.")


def takes_param_axes(tx: Any) -> bool:
  """Whether ``tx`` is an `AxesAwareTransformation`."""
  return isinstance(tx, AxesAwareTransformation) and hasattr(tx, "_build")


def trains_lookahead_params(optimizer_def: Any) -> bool:
  """Whether ``optimizer_def`` wraps ``optax.lookahead``, which trains `optax.LookaheadParams`.

  Example:
    >>> trains_lookahead_params(OptaxWrapper(optax.lookahead(optax.sgd(0.1), 2, 0.5)))
    True
  """
  init = getattr(getattr(optimizer_def, "optax_optimizer", None), "init", None)
  return getattr(init, "__qualname__", "").startswith("lookahead.")


def _is_lookahead_state(node: Any) -> bool:
  return isinstance(node, optax.LookaheadState)


def _holds_lookahead_state(state: Any) -> bool:
  return any(map(_is_lookahead_state, jax.tree.leaves(state, is_leaf=_is_lookahead_state)))


@struct.dataclass
class OptaxHyperParams:
  """Hyper-params of an `OptaxWrapper`.

  Optax keeps its hyper-parameters (and schedules) inside the transformation;
  the only override is T5X's `learning_rate`, which takes effect when the
  transformation was built with `optax.inject_hyperparams`.
  """

  learning_rate: Any = None


def _is_injected_state(node: Any) -> bool:
  """Structural test for optax's inject_(stateful_)hyperparams states."""
  fields = getattr(node, "_fields", ())
  return isinstance(node, tuple) and "hyperparams" in fields and "inner_state" in fields


def _constants(node: Any) -> dict[str, Any]:
  """The hyper-parameters an injected state holds as values, those a stateful schedule keeps
  state for (``hyperparams_states``) left out."""
  scheduled = getattr(node, "hyperparams_states", None) or {}
  return {name: value for name, value in node.hyperparams.items() if name not in scheduled}


def override_learning_rate(param_states: Any, learning_rate: Any) -> Any:
  """Sets `learning_rate` in every constant injected-hyperparams state of the tree.

  T5X's trainer passes its `learning_rate_fn` value to every
  `apply_gradient`, while optax keeps the learning rate (and its schedule)
  inside the transformation. Like T5X's own `OptaxWrapper`, the override is
  then ignored: when no state of the tree has an injectable constant
  learning rate (none was injected, or `inject_hyperparams` got a schedule)
  the states come back unchanged, with a warning that says so. Several
  injected rates all take the one value, with a warning naming them, those
  injected inside another injected state's transformation too.
  """
  found = []

  def set_rates(tree: Any, prefix: jax.tree_util.KeyPath) -> Any:
    return jax.tree.map_with_path(
      lambda path, node: set_rate(prefix + path, node), tree, is_leaf=_is_injected_state
    )

  def set_rate(path: jax.tree_util.KeyPath, node: Any) -> Any:
    if not _is_injected_state(node):
      return node
    inner = set_rates(node.inner_state, (*path, jax.tree_util.GetAttrKey("inner_state")))
    node = node._replace(inner_state=inner)
    if _LEARNING_RATE not in _constants(node):
      return node
    found.append(key_path_str(path))
    old = node.hyperparams[_LEARNING_RATE]
    dtype, given = jnp.result_type(old), jnp.result_type(learning_rate)
    if jnp.issubdtype(dtype, jnp.integer) and not jnp.issubdtype(given, jnp.integer):
      raise TypeError(
        f"learning_rate= of dtype {given} would be cut to the {dtype} learning rate injected "
        "here (a constant given as an integer, e.g. gin's learning_rate = 1): inject it as a "
        "float (learning_rate = 1.0)."
      )
    hyperparams = dict(node.hyperparams)
    hyperparams[_LEARNING_RATE] = jnp.asarray(learning_rate, dtype=dtype)
    return node._replace(hyperparams=hyperparams)

  new_states = set_rates(param_states, ())
  if len(found) > 1:
    warn(
      f"learning_rate= sets the {len(found)} injected learning rates of the optax state to "
      f"one value, whatever each held before: {', '.join(found)}. To keep rates apart "
      "(per parameter group), inject them as schedules (never overridden) or use a "
      "MultiOptimizer with an OptaxWrapper per group."
    )
  if not found:
    warn(
      "learning_rate= was passed to apply_gradient (T5X's trainer passes its "
      "learning_rate_fn value), but the optax transformation has no injectable "
      "constant learning rate, so the override is ignored and optax's own "
      "learning rate or schedule applies, as with T5X's OptaxWrapper. To "
      "override it per step, build the transformation with "
      "optax.inject_hyperparams and a constant learning rate."
    )
  return new_states


class OptaxWrapper(OptimizerDef):
  """Exposes an optax `GradientTransformation` as a T5X `OptimizerDef`.

  The state is `OptimizerState(step, param_states)` where `step` is an int32
  array and `param_states` the optax state (an `optax.MultiSteps` is taken
  through its ``init`` and ``update``, which passes extra arguments on to
  its inner optimizer). Extra keyword arguments of
  `Optimizer.apply_gradient` (e.g. `value=` for `reduce_on_plateau`) are
  passed on to `update`. `fallback` (keyword-only) is `OptimizerDef`'s.

  `fused` (keyword-only, a `FusedUpdate` or its string; default ``"off"``)
  opts in to the multi-tensor update of `t5x_optim._layouts.fused`: an
  elementwise update (adam, adamw, lion, sgd with momentum, rmsprop, ...)
  then runs as one kernel per group of leaves. Updates that cannot (not
  elementwise, or needing a primitive the GPU kernel lacks) take the plain
  path with a warning saying why; the state, its partition specs and the
  state dict are the same either way.

  The target may be `StackedParams` (`t5x_optim.stack_params`: params kept
  stacked by shape between steps): `create` then builds the stacked layer,
  `t5x_optim._layouts.stacked.StackedOptimizerDef`, around a plain copy of
  this definition; it checks that the update is elementwise per leaf and
  keeps state dicts and checkpoints per leaf.

  The plain update is `apply_gradient`'s own: ``tx.update`` and
  ``optax.apply_updates``; a layout runs only when one was asked for.

  An `AxesAwareTransformation` (e.g. `low_precision` with a rule by logical
  axis) gives the definition T5X's ``set_param_axes``, which builds the
  transformation again for the params' logical axes; other
  transformations leave the definition without it, so T5X asks no axes of
  them.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> opt = OptaxWrapper(optax.adamw(1e-3)).create({'w': jnp.ones(3)})
    >>> opt = opt.apply_gradient({'w': jnp.ones(3)})
    >>> int(opt.state.step)
    1
  """

  def __init__(
    self,
    optax_optimizer: optax.GradientTransformation | optax.MultiSteps,
    *,
    extra_args: Collection[str] = OPTAX_EXTRA_ARGS,
    fallback: _state_rules.StateRulesFallback | str = (
      _state_rules.StateRulesFallback.REPLICATE_WITH_WARNING
    ),
    fused: FusedOption = "off",
  ):
    super().__init__(hyper_params=OptaxHyperParams(), fallback=fallback)
    self.fused = FusedUpdate.of(fused)
    if isinstance(optax_optimizer, optax.MultiSteps):
      # Its update passes extra arguments on; its gradient_transformation() does not say so.
      optax_optimizer = optax.GradientTransformationExtraArgs(
        optax_optimizer.init, optax_optimizer.update
      )
    self.optax_optimizer = checked_transformation(optax_optimizer, "OptaxWrapper")
    if isinstance(extra_args, str):
      raise TypeError(
        f"OptaxWrapper: extra_args takes a collection of names, got {extra_args!r} (one name "
        f"is [{extra_args!r}])."
      )
    takes_extra_args = isinstance(optax_optimizer, optax.GradientTransformationExtraArgs)
    self.extra_arg_names = frozenset(extra_args) if takes_extra_args else frozenset()
    self._axes_aware = optax_optimizer if takes_param_axes(optax_optimizer) else None
    self._axes: AxesKey | None = None
    self._created = False

  @property
  def set_param_axes(self) -> Callable[[Any], None]:
    """T5X's hook, only where the transformation is an `AxesAwareTransformation` (T5X asks
    no axes of a definition without it): takes the params' logical axes and builds the
    transformation for them."""
    if getattr(self, "_axes_aware", None) is None:
      raise AttributeError(
        f"{type(self).__name__}: its transformation takes no logical axes (no set_param_axes)"
      )
    return self._set_param_axes

  def _set_param_axes(self, param_logical_axes: Any) -> None:
    axes = axes_key(param_logical_axes)
    if self.new_axes(axes):
      self.optax_optimizer = self._axes_aware.with_param_axes(param_logical_axes)
      self._axes = axes

  def new_axes(self, axes: AxesKey) -> bool:
    """Whether `axes` (`axes_key`'s) differ from those the transformation was built for (the
    same axes again leave it as it is).

    Raises:
      ValueError: other axes once the definition has created an optimizer, whose
        state and jitted steps keep the placement of the axes it was created with.
    """
    if axes == self._axes:
      return False
    if self._created:
      raise ValueError(
        f"{type(self).__name__}: set_param_axes got logical axes other than those it had "
        "when it created an optimizer, which keeps the old placement (a step jitted for it "
        "too). Give the axes to a new definition: t5x_optim.with_param_axes(opt_def, axes) "
        "copies it, as TrainState.create does."
      )
    return True

  def __copy__(self) -> OptaxWrapper:
    """A shallow copy that has created no optimizer and builds its transformation again when
    given axes, the same too (a transformation built for the original may read its axes)."""
    copied = object.__new__(type(self))
    copied.__dict__.update(self.__dict__)
    return copied._uncreated()

  def __deepcopy__(self, memo: dict[int, Any]) -> OptaxWrapper:
    """A deep copy, as `__copy__`'s: its transformation is its original's (functions are not
    copied), which may read the original's axes, so it is built again when given axes."""
    copied = memo[id(self)] = object.__new__(type(self))
    copied.__dict__.update(copy.deepcopy(self.__dict__, memo))
    return copied._uncreated()

  def _uncreated(self) -> OptaxWrapper:
    """This copy as a definition that has created no optimizer and was given no axes."""
    self._created = False
    self._axes = None
    return self

  def create(self, target: Any) -> Optimizer:
    """Creates an `Optimizer` for `target`; `StackedParams` get the stacked layer."""
    self._created = True
    if isinstance(target, StackedParams):
      plain = OptaxWrapper(
        self.optax_optimizer, extra_args=self.extra_arg_names, fallback=self.fallback
      )
      return StackedOptimizerDef(plain).create(target)
    return super().create(target)

  def prepare_grads(self, params: Any, grads: Any) -> Any:
    """`OptimizerDef.prepare_grads`; for `optax.lookahead`, against the fast params."""
    return super().prepare_grads(trained_params(params), grads)

  def init_state(self, params: Any) -> OptimizerState:
    self._created = True
    if trains_lookahead_params(self) and not isinstance(params, optax.LookaheadParams):
      raise TypeError(
        "optax.lookahead trains a fast and a slow copy of the params: create the optimizer "
        "with optax.LookaheadParams.init_synced(params) (its update reads params.fast), got "
        f"{type(params).__name__}."
      )
    param_states = self.optax_optimizer.init(params)
    if not isinstance(params, optax.LookaheadParams) and _holds_lookahead_state(param_states):
      raise TypeError(
        "optax.lookahead inside another transformation was given plain params, not a fast and "
        "a slow copy of them (its update reads params.fast): create the optimizer with "
        "optax.LookaheadParams.init_synced(params), or put lookahead around the other "
        "transformations (optax.lookahead(optax.MultiSteps(...), ...)), to which the command "
        f"line and TrainState give both copies; got {type(params).__name__}."
      )
    # optax's updates return strongly typed states; a weakly typed initial leaf (L-BFGS's
    # line-search info) would make a jitted step compile again at the second step.
    param_states = jax.tree.map(_strongly_typed, param_states)
    return OptimizerState(step=jnp.zeros((), jnp.int32), param_states=param_states)

  def apply_gradient(
    self,
    hyper_params: OptaxHyperParams,
    params: Any,
    state: OptimizerState,
    grads: Any,
    **extra_args: Any,
  ) -> tuple[Any, OptimizerState]:
    param_states = state.param_states
    if hyper_params.learning_rate is not None:
      check_learning_rate(hyper_params.learning_rate)
      param_states = override_learning_rate(param_states, hyper_params.learning_rate)
    if self.fused is FusedUpdate.OFF:

      def update(params: Any, grads: Any, param_states: Any, extra_args: dict) -> tuple[Any, Any]:
        updates, new_param_states = self.optax_optimizer.update(
          grads, param_states, params, **extra_args
        )
        return optax.apply_updates(params, updates), new_param_states

      # Under Explicit mesh axes the update runs with them Auto, each param read in the layout
      # of its most sharded state (`auto_axes_like`, `in_update_layouts`).
      params, put_back = in_update_layouts(params, param_states)
      update = auto_axes_like(update, (params, param_states))
      new_params, new_param_states = update(params, grads, param_states, extra_args)
      new_params = put_back(new_params)
    else:
      new_params, new_param_states = self.fused.update(
        self.optax_optimizer, params, grads, param_states, extra_args
      )
    return new_params, OptimizerState(step=state.step + 1, param_states=new_param_states)

  def derive_logical_axes(self, optimizer: Optimizer, param_logical_axes: Any) -> Optimizer:
    """Returns `optimizer` with every leaf replaced by its logical spec.

    The target becomes the params' logical axes, `step` becomes `None` and
    every optax state leaf a `PartitionSpec` (or `None`, replicated); empty
    optax nodes stay as they are. Leaves without a valid spec go to
    `fallback`.
    """
    axes = _state_rules.logical_axes_from(param_logical_axes)
    param_states = _state_rules.OptaxStatePartitionRules.derive_optax_logical_axes(
      optimizer.state.param_states,
      axes,
      transformation=self.optax_optimizer,
      params=optimizer.target,
      fallback=self.fallback,
    )
    return optimizer.replace(
      target=axes, state=OptimizerState(step=None, param_states=param_states)
    )


def chain(
  transformations: Sequence[optax.GradientTransformation],
  *,
  fused: FusedOption = "off",
) -> OptaxWrapper:
  """`optax.chain` over a list (gin cannot bind `*args`), as an `OptaxWrapper`.

  `fused` is `OptaxWrapper`'s (in gin: ``optimizers.chain.fused = 'auto'``).
  When a transformation of the list is an `AxesAwareTransformation`, the
  definition has ``set_param_axes``, which builds each such transformation
  again for the params' logical axes (`axes_aware_chain`).

  Example:
    >>> import optax
    >>> opt_def = chain([optax.clip_by_global_norm(1.0), optax.adam(1e-3)])
  """
  return OptaxWrapper(axes_aware_chain(transformations), fused=fused)


def axes_aware_chain(
  transformations: Sequence[optax.GradientTransformation],
) -> optax.GradientTransformationExtraArgs:
  """`optax.chain` of ``transformations``; an `AxesAwareTransformation` when one of them is.

  Example:
    >>> import optax
    >>> tx = AxesAwareTransformation.of(optax.sgd(0.1), lambda axes: optax.sgd(0.1))
    >>> takes_param_axes(axes_aware_chain([optax.clip(1.0), tx]))
    True
  """
  if is_transformation(transformations):  # an (init, update) tuple, not a list of them
    raise TypeError(
      "optimizers.chain's transformations takes a list of transformations, got one "
      "transformation: put it in a list (in gin, with the brackets: "
      "transformations = [@optax.adamw()])."
    )
  transformations = tuple(
    checked_transformation(tx, f"optimizers.chain's transformations[{i}]")
    for i, tx in enumerate(transformations)
  )
  chained = optax.chain(*transformations)
  if not any(map(takes_param_axes, transformations)):
    return chained

  def build(param_axes: Any) -> optax.GradientTransformation:
    return optax.chain(
      *(tx.with_param_axes(param_axes) if takes_param_axes(tx) else tx for tx in transformations)
    )

  return AxesAwareTransformation.of(chained, build)


def inject_hyperparams(
  inner_factory: Callable[..., optax.GradientTransformation],
  *,
  hyperparams: Mapping[str, Any],
  static_args: str | Sequence[str] = (),
) -> optax.GradientTransformation:
  """`optax.inject_hyperparams(inner_factory)(**hyperparams)`, configurable by gin.

  Gin cannot call the function `optax.inject_hyperparams` returns; this does
  (in gin: ``@optimizers.inject_hyperparams()``).
  The result is a transformation: use it inside `optimizers.chain` or wrap it
  with `optimizers.OptaxWrapper`. A constant injected ``learning_rate`` can
  then be overridden per step (T5X's ``apply_gradient(learning_rate=...)``).

  Args:
    inner_factory: an optax factory (in gin, a reference without call:
      ``@optax.sgd``).
    hyperparams: the factory's arguments; numbers (or schedules) are
      injected into the state, other values are passed as they are.
    static_args: names of arguments that must stay static (or one name).

  Raises:
    TypeError: when `hyperparams` names an argument `inner_factory` lacks.

  Example:
    >>> import optax
    >>> tx = inject_hyperparams(optax.sgd, hyperparams={'learning_rate': 0.1})
    >>> round(float(tx.init({}).hyperparams['learning_rate']), 6)
    0.1
  """
  accepted = inspect.signature(inner_factory).parameters
  unknown = sorted(set(hyperparams) - set(accepted))
  if unknown:
    raise TypeError(
      f"inject_hyperparams: {getattr(inner_factory, '__name__', inner_factory)} has no "
      f"argument(s) {unknown}; it takes {sorted(accepted)}."
    )
  static = (static_args,) if isinstance(static_args, str) else tuple(static_args)
  return optax.inject_hyperparams(inner_factory, static_args=static)(**hyperparams)
