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

kfac-jax attributes are read that have no public accessor in 0.0.8: the
curvature estimator (`Optimizer._estimator`: its blocks and the indices of
their params, which `derive_kfac_logical_axes` maps to param axes), the
constructor's `value_func_has_state` (`Optimizer._value_func_has_state`,
refused up front because `apply_gradient` has no place to return a function
state) and its adaptive damping settings (`Optimizer._use_adaptive_damping`
and `Optimizer._initial_damping`, for `restore_state`).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from jax import extend as jex

from t5x_optim._adapters.kfac_state import (
  derive_kfac_logical_axes,
  kfac_state_from_dict,
  kfac_state_to_dict,
)
from t5x_optim._axes.engine import StateRulesFallback, logical_axes_from
from t5x_optim._core import state_dict as _state_dict
from t5x_optim._core.interface import Optimizer, OptimizerDef, OptimizerState, on_params_mesh
from t5x_optim._nnx import refuse_non_params

# isort: split
# After kfac_state, which turns kfac-jax's failure to import with this jax into an ImportError.
import kfac_jax
from kfac_jax._src import tag_graph_matcher

from t5x_optim._warn import warn

__all__ = ["KfacHyperParams", "KfacOptimizerDef"]

# The damping kfac-jax 0.0.8 keeps in the state of an optimizer without initial_damping.
_NO_DAMPING = -1e10


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
      warn(
        "KfacOptimizerDef(state_rules_fallback=...) is deprecated; pass fallback=..., "
        "the setting every OptimizerDef shares.",
        DeprecationWarning,
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
    warn("KfacOptimizerDef.state_rules_fallback is deprecated; read fallback.", DeprecationWarning)
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
    refuse_non_params(target, f"{type(self).__name__}.create")
    state = self.init_state(target, batch=batch, rng=rng)
    return Optimizer(optimizer_def=self, state=on_params_mesh(state, target), target=target)

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

    A state saved without adaptive damping holds kfac-jax's placeholder damping
    (-1e10) rather than a damping; restored into an optimizer with
    `use_adaptive_damping=True`, its damping starts at `initial_damping`.

    Raises:
      ValueError: naming the path, on a missing or unexpected key, a shape
        mismatch or an unsafe dtype cast.
    """
    target, step, nested = _state_dict.restore_state_dict(
      opt_target, opt_state.step, kfac_state_to_dict(opt_state.param_states), state_dict
    )
    kfac_state = kfac_state_from_dict(opt_state.param_states, nested)
    kfac = self.kfac_optimizer
    # No public accessors in kfac-jax 0.0.8 (see the module docstring).
    if kfac._use_adaptive_damping:  # pylint: disable=protected-access
      damping = kfac_state.damping
      initial = jnp.asarray(kfac._initial_damping, damping.dtype)  # pylint: disable=protected-access
      damping = jnp.where(damping == jnp.asarray(_NO_DAMPING, damping.dtype), initial, damping)
      kfac_state = dataclasses.replace(kfac_state, damping=damping)
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
