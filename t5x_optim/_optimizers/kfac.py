"""`KfacOptimizerDef`: a kfac-jax K-FAC optimizer as a T5X `OptimizerDef`.

K-FAC computes the gradient itself: each step needs the loss function (given
to `kfac_jax.Optimizer` with its layers and losses registered), a batch and a
PRNG key. `Optimizer.apply_gradient(None, batch=..., rng=...)` runs one
`kfac_jax.Optimizer.step`; `state.param_states` is the kfac-jax state
(velocities and the curvature blocks' Kronecker factors).

kfac-jax 0.0.8 (the newest release on PyPI) still unpacks
`Primitive.get_bind_params` as `(subfuns, params)`; jax 0.10 returns the
params alone, so kfac-jax's graph matcher fails with "too many values to
unpack" when it traces the loss. There is no public hook for this, so the
adapter replaces kfac-jax's `tag_graph_matcher.eval_jaxpr_eqn` with a version
that handles both forms, and only while its own calls into kfac-jax run
(`init` and `step`, where the tracing happens; kfac-jax's compiled steps are
cached and do not trace again). Importing this module changes nothing; on a
jax whose `get_bind_params` still returns a pair nothing is replaced at all.
The replacement is a module attribute, so while an adapter call runs, other
threads calling kfac-jax directly see it too; it computes what the original
does wherever the original works. Overlapping adapter calls (threads, or a
call inside a call) share one replacement, counted under a lock: the first
installs it, the last to leave restores the original, also when a call
raises.

Two kfac-jax attributes are read that have no public accessor in 0.0.8: the
curvature estimator (`Optimizer._estimator`: its blocks and the indices of
their params, which `derive_kfac_logical_axes` maps to param axes) and the
constructor's `value_func_has_state` (`Optimizer._value_func_has_state`,
refused up front because `apply_gradient` has no place to return a function
state).
"""

from __future__ import annotations

import dataclasses
import re
import threading
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import kfac_jax
from flax import struct
from jax import extend as jex
from jax.sharding import PartitionSpec
from kfac_jax._src import tag_graph_matcher

from t5x_optim._axes.engine import StateRulesFallback, derive_state_specs, logical_axes_from
from t5x_optim._axes.registry import StateRuleContext, register_state_rule
from t5x_optim._axes.rules import is_spec_leaf
from t5x_optim._axes.specs import UNDERIVED
from t5x_optim._keypaths import key_path_str
from t5x_optim._optimizers import state_dict as _state_dict
from t5x_optim._optimizers.interface import Optimizer, OptimizerDef, OptimizerState

__all__ = ["KfacHyperParams", "KfacOptimizerDef"]

_FACTOR_KEY = re.compile(r"^(\d+)_factor")


def _eval_jaxpr_eqn(eqn: Any, in_values: list[Any]) -> list[Any]:
  """kfac-jax's `eval_jaxpr_eqn` for both forms of `get_bind_params`."""
  bind_params = eqn.primitive.get_bind_params(eqn.params)
  subfuns = ()
  if isinstance(bind_params, tuple):
    subfuns, bind_params = bind_params
  with jex.source_info_util.user_context(eqn.source_info.traceback):
    output = eqn.primitive.bind(*subfuns, *in_values, **bind_params)
  return output if isinstance(output, list) else [output]


def _bind_params_without_subfuns() -> bool:
  """True when jax's `get_bind_params` returns the params alone (jax >= 0.10)."""
  return not isinstance(jax.lax.add_p.get_bind_params({}), tuple)


class _GraphMatcherShim:
  """Installs `_eval_jaxpr_eqn` in kfac-jax for the duration of a `with` block.

  Blocks may overlap (threads, nesting): the first to enter installs it, the
  last to leave puts back what was there before, unless someone else has
  replaced it meanwhile. A no-op when jax does not need it.
  """

  def __init__(self):
    self._needed = _bind_params_without_subfuns()
    self._lock = threading.Lock()
    self._users = 0
    self._original = None

  def __enter__(self) -> None:
    if not self._needed:
      return
    with self._lock:
      if self._users == 0:
        self._original = tag_graph_matcher.eval_jaxpr_eqn
        tag_graph_matcher.eval_jaxpr_eqn = _eval_jaxpr_eqn
      self._users += 1

  def __exit__(self, *exc_info: object) -> None:
    if not self._needed:
      return
    with self._lock:
      self._users -= 1
      if self._users == 0:
        if tag_graph_matcher.eval_jaxpr_eqn is _eval_jaxpr_eqn:
          tag_graph_matcher.eval_jaxpr_eqn = self._original
        self._original = None


_graph_matcher_shim = _GraphMatcherShim()


@struct.dataclass
class KfacHyperParams:
  """Step-time hyper-parameters of a `KfacOptimizerDef`.

  Each is passed to `kfac_jax.Optimizer.step`; leave one `None` when the
  kfac-jax optimizer schedules or adapts it itself (kfac-jax raises a
  `ValueError` when a value is given as well as a schedule, or neither).

  Attributes:
    learning_rate: the learning rate (T5X's `learning_rate=` override).
    momentum: the momentum coefficient.
    damping: the damping added to the curvature before inversion.
  """

  learning_rate: Any = None
  momentum: Any = None
  damping: Any = None


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


def _is_traced(tree: Any) -> bool:
  return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(tree))


class KfacOptimizerDef(OptimizerDef):
  """A `kfac_jax.Optimizer` behind T5X's `OptimizerDef` interface.

  K-FAC owns the gradient computation. `create(params)` initialises the
  kfac-jax state from an example batch and key (given here as `init_batch`
  and `init_rng`, or to `create`/`init_state` as `batch=`/`rng=`). Each
  `Optimizer.apply_gradient(None, batch=..., rng=...)` runs one
  `kfac_jax.Optimizer.step` (which computes loss and gradients with the
  optimizer's `value_and_grad_func`); the `grads` argument must be `None`,
  since K-FAC would discard gradients computed outside. Use `apply_batch` to
  get the step's statistics (loss, learning rate, ...) too.

  `apply_gradient` runs eagerly: kfac-jax reads the step counter on the host
  to choose the compiled program and compiles its own steps (with `jax.jit`),
  so it must not be called inside `jax.jit`. Sharded params, state and batch
  work: kfac-jax's jit propagates their shardings. kfac-jax donates the params
  and state buffers, so the optimizer a step is applied to is consumed (its
  arrays are deleted); copy it first to keep it.

  Example:
    >>> import jax, jax.numpy as jnp, kfac_jax
    >>> def loss(params, batch):
    ...   x, y = batch
    ...   logits = x @ params['w']
    ...   kfac_jax.register_softmax_cross_entropy_loss(logits, y)
    ...   return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(4), y])
    >>> kfac = kfac_jax.Optimizer(
    ...     value_and_grad_func=jax.value_and_grad(loss), l2_reg=0.0,
    ...     num_burnin_steps=0)
    >>> batch = (jnp.ones((4, 3)), jnp.array([0, 1, 0, 1]))
    >>> opt_def = KfacOptimizerDef(
    ...     kfac, init_batch=batch, learning_rate=0.1, momentum=0.0, damping=1e-3)
    >>> opt = opt_def.create({'w': jnp.zeros((3, 2))})
    >>> opt = opt.apply_gradient(None, batch=batch, rng=jax.random.key(1))
    >>> int(opt.state.step)
    1
  """

  extra_arg_names = frozenset({"batch", "rng", "data_iterator"})

  def __init__(
    self,
    kfac_optimizer: kfac_jax.Optimizer,
    *,
    init_batch: Any = None,
    init_rng: jax.Array | None = None,
    learning_rate: Any = None,
    momentum: Any = None,
    damping: Any = None,
    fallback: StateRulesFallback | str = StateRulesFallback.REPLICATE_WITH_WARNING,
    state_rules_fallback: StateRulesFallback | str | None = None,
  ):
    """Wraps `kfac_optimizer`.

    Args:
      kfac_optimizer: a `kfac_jax.Optimizer` with `multi_device=False` and
        `value_func_has_state=False`.
      init_batch: an example batch for `create(params)` (shapes are traced).
      init_rng: the key for `create(params)`; defaults to `jax.random.key(0)`.
      learning_rate: the step-time learning rate (None when scheduled).
      momentum: the step-time momentum (None when scheduled or adaptive).
      damping: the step-time damping (None when scheduled or adaptive).
      fallback: what `derive_logical_axes` does with state leaves that match
        no param dimension (see `OptimizerDef`).
      state_rules_fallback: deprecated alias of `fallback`.

    Raises:
      ValueError: for a multi-device (pmap) or stateful kfac-jax optimizer,
        or when `fallback` and `state_rules_fallback` disagree.
    """
    if state_rules_fallback is not None:
      warnings.warn(
        "KfacOptimizerDef(state_rules_fallback=...) is deprecated; pass fallback=..., "
        "the setting every OptimizerDef shares.",
        DeprecationWarning,
        stacklevel=2,
      )
      state_rules_fallback = StateRulesFallback(state_rules_fallback)
      if StateRulesFallback(fallback) not in (
        StateRulesFallback.REPLICATE_WITH_WARNING,
        state_rules_fallback,
      ):
        raise ValueError(
          f"KfacOptimizerDef got fallback={fallback} and its deprecated alias "
          f"state_rules_fallback={state_rules_fallback}; pass fallback= only."
        )
      fallback = state_rules_fallback
    super().__init__(
      hyper_params=KfacHyperParams(learning_rate=learning_rate, momentum=momentum, damping=damping),
      fallback=fallback,
    )
    if kfac_optimizer.multi_device:
      raise ValueError(
        "KfacOptimizerDef needs kfac_jax.Optimizer(multi_device=False): the "
        "pmap mode wants every array with a leading device axis, which T5X's "
        "jit-and-shardings train state does not have. Shard params and batch "
        "with jax.sharding instead."
      )
    # No public accessor in kfac-jax 0.0.8 (see the module docstring).
    if kfac_optimizer._value_func_has_state:  # pylint: disable=protected-access
      raise ValueError(
        "KfacOptimizerDef does not support value_func_has_state=True: "
        "Optimizer.apply_gradient has no place to return the function state."
      )
    self.kfac_optimizer = kfac_optimizer
    self.init_batch = init_batch
    self.init_rng = init_rng

  @property
  def state_rules_fallback(self) -> StateRulesFallback:
    """Deprecated alias of `fallback`."""
    warnings.warn(
      "KfacOptimizerDef.state_rules_fallback is deprecated; read fallback.",
      DeprecationWarning,
      stacklevel=2,
    )
    return self.fallback

  def init_state(
    self, params: Any, *, batch: Any = None, rng: jax.Array | None = None
  ) -> OptimizerState:
    """The initial state; `batch`/`rng` default to `init_batch`/`init_rng`.

    Raises:
      ValueError: when no example batch is given here or at construction.
    """
    batch = self.init_batch if batch is None else batch
    if batch is None:
      raise ValueError(
        "K-FAC traces the loss function at init and needs an example batch: "
        "pass KfacOptimizerDef(..., init_batch=batch) or "
        "create(params, batch=batch)."
      )
    rng = self.init_rng if rng is None else rng
    rng = jax.random.key(0) if rng is None else rng
    with _graph_matcher_shim:
      kfac_state = self.kfac_optimizer.init(params, rng, batch)
    return OptimizerState(step=jnp.zeros((), jnp.int32), param_states=kfac_state)

  def create(self, target: Any, *, batch: Any = None, rng: jax.Array | None = None) -> Optimizer:
    """Creates an `Optimizer` for `target`; see `init_state` for the keywords."""
    state = self.init_state(target, batch=batch, rng=rng)
    return Optimizer(optimizer_def=self, state=state, target=target)

  def prepare_grads(self, params: Any, grads: Any) -> Any:
    """`grads` as given: K-FAC computes the gradient itself and takes no grads tree."""
    del params
    return grads

  def _step(
    self,
    hyper_params: KfacHyperParams,
    params: Any,
    state: OptimizerState,
    *,
    rng: jax.Array,
    batch: Any = None,
    data_iterator: Iterator[Any] | None = None,
  ) -> tuple[Any, OptimizerState, dict[str, Any]]:
    if _is_traced((params, state.param_states)):
      raise TypeError(
        "K-FAC's step cannot run inside jax.jit (or another transformation): "
        "kfac-jax reads its step counter on the host and compiles its own "
        "steps. Call apply_gradient outside jit; sharded inputs are fine."
      )
    with _graph_matcher_shim:
      new_params, kfac_state, stats = self.kfac_optimizer.step(
        params,
        state.param_states,
        rng,
        data_iterator=data_iterator,
        batch=batch,
        learning_rate=hyper_params.learning_rate,
        momentum=hyper_params.momentum,
        damping=hyper_params.damping,
      )
    return new_params, OptimizerState(step=state.step + 1, param_states=kfac_state), stats

  def apply_gradient(
    self,
    hyper_params: KfacHyperParams,
    params: Any,
    state: OptimizerState,
    grads: Any,
    **extra_args: Any,
  ) -> tuple[Any, OptimizerState]:
    """One K-FAC step on `extra_args['batch']` with `extra_args['rng']`.

    Args:
      hyper_params: learning rate, momentum and damping for this step.
      params: the current params.
      state: the current state.
      grads: must be None: K-FAC computes the gradient itself.
      **extra_args: `rng=` (required) and `batch=` or `data_iterator=`
        (kfac-jax's burn-in at step 0 needs an iterator).

    Raises:
      ValueError: when `grads` is not None or `rng` is missing.
      TypeError: for unknown keywords, or when called inside `jax.jit`.
    """
    new_params, new_state, _ = self._step_checked(hyper_params, params, state, grads, extra_args)
    return new_params, new_state

  def _step_checked(
    self,
    hyper_params: KfacHyperParams,
    params: Any,
    state: OptimizerState,
    grads: Any,
    extra_args: Mapping[str, Any],
  ) -> tuple[Any, OptimizerState, dict[str, Any]]:
    if grads is not None:
      raise ValueError(
        "KfacOptimizerDef computes gradients itself (with the kfac_jax "
        "optimizer's value_and_grad_func); pass grads=None and the batch: "
        "optimizer.apply_gradient(None, batch=batch, rng=rng)."
      )
    unknown = sorted(set(extra_args) - {"batch", "rng", "data_iterator"})
    if unknown:
      raise TypeError(
        f"KfacOptimizerDef.apply_gradient got unknown keyword arguments {unknown}; "
        "it takes batch=, rng=, data_iterator= and the hyper-parameters "
        "learning_rate=, momentum=, damping=."
      )
    if extra_args.get("rng") is None:
      raise ValueError("K-FAC needs a PRNG key for every step: pass rng=.")
    return self._step(hyper_params, params, state, **extra_args)

  def apply_batch(
    self, optimizer: Optimizer, *, rng: jax.Array, batch: Any = None, **kwargs: Any
  ) -> tuple[Optimizer, dict[str, Any]]:
    """Like `optimizer.apply_gradient(None, ...)`, also returning kfac-jax's stats.

    Args:
      optimizer: an optimizer created by this definition.
      rng: the step's PRNG key.
      batch: the step's batch.
      **kwargs: hyper-parameter overrides and `data_iterator=`.

    Returns:
      the updated optimizer and the step's statistics (`loss`,
      `learning_rate`, `momentum`, `damping`, ...).
    """
    overrides, extra_args = self.split_apply_kwargs(kwargs)
    hyper_params = self.update_hyper_params(**overrides)
    new_target, new_state, stats = self._step_checked(
      hyper_params,
      optimizer.target,
      optimizer.state,
      None,
      {**extra_args, "rng": rng, "batch": batch},
    )
    return optimizer.replace(target=new_target, state=new_state), stats

  def state_dict(self, target: Any, state: OptimizerState) -> dict[str, Any]:
    """The T5X-layout state dict.

    `param_states` is the kfac-jax state as nested dicts: `velocities/...`,
    `estimator_state/blocks_states/<block>/factors/<k>/value`,
    `.../cache/<power>/<k>_factor`, `damping`, `data_seen`, `step_counter`.
    """
    return _state_dict.build_state_dict(
      target, state.step, _state_dict.prune_empty(kfac_state_to_dict(state.param_states))
    )

  def restore_state(
    self, opt_target: Any, opt_state: OptimizerState, state_dict: Mapping[str, Any]
  ) -> tuple[Any, OptimizerState]:
    """Restores `(target, state)`, validating shapes and dtypes against `opt_state`.

    Raises:
      ValueError: naming the path, on a missing or unexpected key, a shape
        mismatch or an unsafe dtype cast.
    """
    target, step, nested = _state_dict.restore_state_dict(
      opt_target, opt_state.step, kfac_state_to_dict(opt_state.param_states), state_dict
    )
    kfac_state = kfac_state_from_dict(opt_state.param_states, nested)
    return target, OptimizerState(step=step, param_states=kfac_state)

  def derive_logical_axes(self, optimizer: Optimizer, param_logical_axes: Any) -> Optimizer:
    """Returns `optimizer` with every leaf replaced by its logical spec.

    See `derive_kfac_logical_axes`; `step` becomes None.
    """
    axes = logical_axes_from(param_logical_axes)
    param_states = derive_kfac_logical_axes(
      self.kfac_optimizer,
      optimizer.state.param_states,
      optimizer.target,
      axes,
      fallback=self.fallback,
    )
    return optimizer.replace(
      target=axes, state=OptimizerState(step=None, param_states=param_states)
    )
