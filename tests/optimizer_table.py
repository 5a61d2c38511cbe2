"""The one optimizer table the tests run over.

`DISCOVERED` holds every optax / optax.contrib optimizer factory that can be
built from a learning rate alone, under the name its learning-rate
parameter has (found by introspection, so a new optax
release is covered automatically); `WRAPPERS` holds optax's wrappers and
combinators. Each case builds a transformation and says whether its params
are `optax.LookaheadParams`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
import pytest

from t5x_optim import optax_optimizer_factories

LEARNING_RATE = 1e-2
SHAPES = {"dense": {"kernel": (8, 16), "bias": (16,)}, "out": {"kernel": (16, 4)}}
LOW_PRECISION_MODES = [
  pytest.param("8bit", marks=pytest.mark.slow),
  pytest.param("4bit", marks=pytest.mark.slow),
  "bfloat16",
]
"""`low_precision`'s modes: bfloat16 in the quick loop, the codecs (seconds to compile) with the
slow tests."""


@dataclasses.dataclass(frozen=True)
class Case:
  """One transformation under test."""

  name: str
  make: Callable[[], optax.GradientTransformation]
  lookahead: bool = False

  def __repr__(self) -> str:
    return self.name


def make_params(seed: int = 0) -> dict[str, Any]:
  """Small float32 params with the `SHAPES` layout."""
  leaves, treedef = jax.tree.flatten(SHAPES, is_leaf=lambda x: isinstance(x, tuple))
  rng = np.random.default_rng(seed)
  arrays = [jnp.asarray(rng.normal(size=shape), jnp.float32) * 0.3 for shape in leaves]
  return jax.tree.unflatten(treedef, arrays)


_BATCH = np.random.default_rng(1)
_X = jnp.asarray(_BATCH.normal(size=(32, 8)), jnp.float32)
_Y = jnp.asarray(_BATCH.normal(size=(32, 4)), jnp.float32)


def loss(params: Any) -> jax.Array:
  """A tiny two-layer MLP regression loss."""
  if isinstance(params, optax.LookaheadParams):
    params = params.fast
  hidden = jnp.tanh(_X @ params["dense"]["kernel"] + params["dense"]["bias"])
  return jnp.mean((hidden @ params["out"]["kernel"] - _Y) ** 2)


_EXTRA_ARG_SETS = (("value", "grad", "value_fn", "obj_fn"), ("value", "grad", "value_fn"))
_EXTRA_ARG_NAMES: dict[optax.GradientTransformation, tuple[str, ...]] = {}


def _extra_arg_names(tx: optax.GradientTransformation, params: Any) -> tuple[str, ...]:
  """The optax extra arguments `tx.update` takes.

  Optax transformations ignore extra arguments they do not use, except the
  line searches, which refuse any their `value_fn` does not take (`obj_fn`,
  which sophia needs); so the first set the update accepts (checked
  abstractly with `jax.eval_shape`, nothing runs) is the one to pass.
  """
  if not isinstance(tx, optax.GradientTransformationExtraArgs):
    return ()
  if tx not in _EXTRA_ARG_NAMES:
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    for names in _EXTRA_ARG_SETS:

      def probe(params, names=names):
        grads, extras = _gradient_and_extras(params, names)
        return tx.update(grads, tx.init(params), params, **extras)

      try:
        jax.eval_shape(probe, abstract)
      except TypeError:
        continue
      _EXTRA_ARG_NAMES[tx] = names
      break
    else:
      raise TypeError(f"No extra-argument set fits {tx}.")
  return _EXTRA_ARG_NAMES[tx]


def _gradient_and_extras(params: Any, names: tuple[str, ...]) -> tuple[Any, dict]:
  fast = params.fast if isinstance(params, optax.LookaheadParams) else params
  value, grads = jax.value_and_grad(loss)(fast)
  every = {"value": value, "grad": grads, "value_fn": loss, "obj_fn": loss}
  return grads, {name: every[name] for name in names}


def grads_and_extras(tx: optax.GradientTransformation, params: Any) -> tuple[Any, dict]:
  """Gradients (w.r.t. the fast params for lookahead) and optax extra args."""
  return _gradient_and_extras(params, _extra_arg_names(tx, params))


def wrapper_step(opt: Any) -> Any:
  """One `Optimizer.apply_gradient` on the table's loss, with the extra arguments its
  transformation takes.

  The one step function of the modules that step a wrapped optimizer over the table: jitted,
  its programs are named after it, so that a program one test compiled is loaded from the
  compilation cache where another test compiles the same program.
  """
  grads, extras = grads_and_extras(opt.optimizer_def.optax_optimizer, opt.target)
  return opt.apply_gradient(grads, **extras)


def initial_params(case: Case) -> Any:
  params = make_params()
  return optax.LookaheadParams.init_synced(params) if case.lookahead else params


def _rate_parameter(factory: Callable[..., Any]) -> str:
  """The name of the factory's learning-rate parameter (`max_learning_rate`...)."""
  names = inspect.signature(factory).parameters
  return (
    "learning_rate"
    if "learning_rate" in names
    else next(name for name in names if name.endswith("learning_rate"))
  )


def _build(factory: Callable[..., Any]) -> optax.GradientTransformation:
  return factory(**{_rate_parameter(factory): LEARNING_RATE})


def _buildable(factory: Callable[..., Any]) -> bool:
  try:
    _build(factory)
  except TypeError:
    return False
  return True


ALL_FACTORIES = optax_optimizer_factories()
# The wrapped optax factories `t5x.optimizers` exports by name.
T5X_OPTIMIZER_NAMES = frozenset(
  {
    "adabelief",
    "adagrad",
    "adam",
    "adamw",
    "fromage",
    "lars",
    "lamb",
    "lion",
    "noisy_sgd",
    "radam",
    "rmsprop",
    "sgd",
    "yogi",
    "dpsgd",
  }
)
DISCOVERED = [
  Case(name, functools.partial(_build, factory))
  for name, factory in ALL_FACTORIES.items()
  if _buildable(factory)
]


def _labels(params: Any) -> Any:
  return jax.tree.map_with_path(
    lambda path, _: "kernel" if "kernel" in jax.tree_util.keystr(path) else "bias", params
  )


class CountState(NamedTuple):
  """State of `scale_by_count`, a user-defined transformation."""

  count: jax.Array
  momentum: Any


def scale_by_count() -> optax.GradientTransformation:
  """A user's own transformation with a NamedTuple state of its own."""

  def init(params):
    return CountState(jnp.zeros([], jnp.int32), jax.tree.map(jnp.zeros_like, params))

  def update(updates, state, params=None):
    del params
    momentum = jax.tree.map(lambda m, g: 0.5 * m + g, state.momentum, updates)
    scale = 1.0 / (1.0 + state.count.astype(jnp.float32))
    return jax.tree.map(lambda m: -LEARNING_RATE * scale * m, momentum), CountState(
      state.count + 1, momentum
    )

  return optax.GradientTransformation(init, update)


def _is_even_step(step: jax.Array) -> jax.Array:
  return step % 2 == 0


WRAPPERS = [
  Case("chain", lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(LEARNING_RATE))),
  Case(
    "masked",
    lambda: optax.masked(
      optax.adam(LEARNING_RATE), lambda p: jax.tree.map(lambda x: x.ndim == 2, p)
    ),
  ),
  Case(
    "multi_transform",
    lambda: optax.multi_transform(
      {"kernel": optax.adam(LEARNING_RATE), "bias": optax.sgd(LEARNING_RATE)}, _labels
    ),
  ),
  Case(
    "partition",
    lambda: optax.partition(
      {"kernel": optax.lion(LEARNING_RATE), "bias": optax.set_to_zero()}, _labels
    ),
  ),
  Case(
    "inject_hyperparams",
    lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=LEARNING_RATE, b1=0.8),
  ),
  Case(
    "inject_stateful_hyperparams",
    lambda: optax.inject_stateful_hyperparams(optax.sgd)(
      learning_rate=optax.WrappedSchedule(optax.linear_schedule(LEARNING_RATE, 0.0, 10)),
      momentum=0.9,
    ),
  ),
  Case(
    "multisteps",
    lambda: optax.MultiSteps(
      optax.adam(LEARNING_RATE), every_k_schedule=2
    ).gradient_transformation(),
  ),
  Case(
    "multisteps_skip_not_finite",
    lambda: optax.MultiSteps(
      optax.adam(LEARNING_RATE), every_k_schedule=2, should_skip_update_fn=optax.skip_not_finite
    ).gradient_transformation(),
  ),
  Case(
    "apply_if_finite",
    lambda: optax.apply_if_finite(optax.adam(LEARNING_RATE), max_consecutive_errors=3),
  ),
  Case(
    "conditionally_transform",
    lambda: optax.conditionally_transform(optax.adam(LEARNING_RATE), _is_even_step),
  ),
  Case(
    "conditionally_mask", lambda: optax.conditionally_mask(optax.adam(LEARNING_RATE), _is_even_step)
  ),
  Case(
    "lookahead",
    lambda: optax.lookahead(optax.adam(LEARNING_RATE), sync_period=2, slow_step_size=0.5),
    lookahead=True,
  ),
  Case(
    "schedule_free",
    lambda: optax.contrib.schedule_free(optax.adam(LEARNING_RATE, b1=0.0), LEARNING_RATE),
  ),
  Case(
    "reduce_on_plateau",
    lambda: optax.chain(
      optax.adam(LEARNING_RATE), optax.contrib.reduce_on_plateau(patience=1, cooldown=0)
    ),
  ),
  Case("ema", lambda: optax.chain(optax.ema(0.9), optax.sgd(LEARNING_RATE))),
  Case(
    "add_noise", lambda: optax.chain(optax.add_noise(0.01, 0.55, key=0), optax.sgd(LEARNING_RATE))
  ),
  Case("zero_nans", lambda: optax.chain(optax.zero_nans(), optax.adam(LEARNING_RATE))),
  Case(
    "schedule", lambda: optax.adamw(optax.warmup_cosine_decay_schedule(0.0, LEARNING_RATE, 2, 10))
  ),
  Case("adafactor_factored", lambda: optax.adafactor(LEARNING_RATE, min_dim_size_to_factor=4)),
  Case(
    "adafactor_momentum",
    lambda: optax.adafactor(LEARNING_RATE, min_dim_size_to_factor=4, momentum=0.9),
  ),
  Case("user_namedtuple_state", scale_by_count),
]

TABLE = DISCOVERED + WRAPPERS


def to_numpy(tree: Any) -> Any:
  """Every leaf as a numpy array (typed PRNG keys as their raw key data)."""

  def convert(x: Any) -> np.ndarray:
    if jax.dtypes.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    return np.asarray(x)

  return jax.tree.map(convert, tree)


def assert_same_bits(a: Any, b: Any) -> None:
  """Same structure, and every leaf equal bit for bit with the same dtype; a failure names
  the leaf's path."""
  a, b = to_numpy(a), to_numpy(b)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for (path, x), y in zip(jax.tree.leaves_with_path(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype, jax.tree_util.keystr(path)
    np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))


def tree_equal(a: Any, b: Any) -> bool:
  """Same structure, and every leaf equal bit for bit with the same dtype."""
  if jax.tree.structure(a) != jax.tree.structure(b):
    return False
  return all(
    x.dtype == y.dtype and np.array_equal(x, y, equal_nan=True)
    for x, y in zip(jax.tree.leaves(to_numpy(a)), jax.tree.leaves(to_numpy(b)))
  )
