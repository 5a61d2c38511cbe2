"""Optimizer-state conversion: every converter against its written formula, round trips,
nested states, the registry, and restoring checkpoints (ours and T5X's) into another
optimizer.

Each optimizer's stored state is written here by hand from two moment trees, ``M``
(E[g]) and ``V`` (E[g^2], rank 1 on the matrix so Adafactor's factoring is exact), and a
count ``T``: converting the state of one optimizer must give the state the formulas say
the other stores for the same moments.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import pathlib
import subprocess
import sys
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _t5x import t5x_at_hand
from flax import traverse_util
from flax.core import FrozenDict
from flax.linen import partitioning as nn_partitioning
from jax.sharding import PartitionSpec
from optimizer_table import TABLE, assert_same_bits, initial_params, tree_equal, wrapper_step

import t5x_optim
from t5x_optim import OptaxWrapper, optimizers, partitioning
from t5x_optim._checkpoint import converting, store, t5x_read

pytestmark = pytest.mark.usefixtures("shared_compilation_cache")

T = 5
RNG = np.random.default_rng(0)
PARAMS = {
  "dense": {
    "kernel": jnp.asarray(RNG.normal(size=(4, 6)), jnp.float32),
    "bias": jnp.asarray(RNG.normal(size=(6,)), jnp.float32),
  }
}
M = jax.tree.map(lambda p: jnp.asarray(RNG.normal(size=p.shape), jnp.float32), PARAMS)
_ROW, _COL = RNG.uniform(0.5, 2.0, size=4), RNG.uniform(0.5, 2.0, size=6)
V = {
  "dense": {
    "kernel": jnp.asarray(np.outer(_ROW, _COL), jnp.float32),
    "bias": jnp.asarray(RNG.uniform(0.5, 2.0, size=6), jnp.float32),
  }
}
ZERO = jax.tree.map(jnp.zeros_like, PARAMS)


def _decay(b, t):
  return 1.0 - b**t


def _scaled(tree, factor):
  return jax.tree.map(lambda x: x * factor, tree)


@dataclasses.dataclass(frozen=True)
class Kind:
  """An optimizer, what its state knows, and its stored state for moments (mu, nu, t)."""

  name: str
  make: Callable[[], optax.GradientTransformation]
  quantities: frozenset[str]
  stored: Callable[[Any, Any, int], Any]
  mu_needs_nu: bool = False  # its mu is written only with nu (Adam divides one by the other)

  def usable(self, source: Kind) -> frozenset[str]:
    """The moments of `source` this kind's state is written from."""
    has = source.quantities & self.quantities
    return has - {"mu"} if self.mu_needs_nu and "nu" not in has else has

  def __repr__(self) -> str:
    return self.name


def _adam_stored(mu, nu, t):
  adam = optax.ScaleByAdamState(
    jnp.int32(t), _scaled(mu, _decay(0.9, t)), _scaled(nu, _decay(0.999, t))
  )
  return adam, optax.EmptyState()


def _adafactor_stored(mu, nu, t):
  del mu
  kernel, bias = nu["dense"]["kernel"], nu["dense"]["bias"]
  one = jnp.zeros((1,))
  return (
    optax.FactoredState(
      count=jnp.int32(t),
      # optax factors the two largest dims: d1 = 0 (rows, 4), d0 = 1 (columns, 6).
      v_row={"dense": {"kernel": kernel.mean(axis=1), "bias": one}},
      v_col={"dense": {"kernel": kernel.mean(axis=0), "bias": one}},
      v={"dense": {"kernel": one, "bias": bias}},
    ),
    *(optax.EmptyState(),) * 4,
  )


LEARNING_RATE = 1e-3
HPARAMS = {"learning_rate": LEARNING_RATE, "momentum": 0.9}
"""What the table's optimizers were made with and their states do not hold (SGD's
momentum and Adafactor's are both 0.9)."""


def _adafactor_momentum_stored(mu, nu, t):
  """optax Adafactor's EmaState averages the updates lr * max(rms(p), 1e-3) * g / sqrt(v)."""
  factored = _adafactor_stored(mu, nu, t)
  if mu is ZERO:  # no momentum to convert: the EMA starts fresh
    return (*factored[:4], optax.EmaState(jnp.int32(0), ZERO), optax.EmptyState())
  scale = jax.tree.map(lambda p: LEARNING_RATE * max(float(jnp.sqrt(jnp.mean(p**2))), 1e-3), PARAMS)
  ema = jax.tree.map(lambda m, v, s: m * s / jnp.sqrt(v) * _decay(0.9, t), mu, nu, scale)
  return (*factored[:4], optax.EmaState(jnp.int32(t), ema), optax.EmptyState())


KINDS = [
  Kind("adam", lambda: optax.adam(1e-3), frozenset({"mu", "nu"}), _adam_stored, mu_needs_nu=True),
  Kind(
    "amsgrad",
    lambda: optax.amsgrad(1e-3),
    frozenset({"mu", "nu"}),
    # nu_max: the largest nu so far, here the one there is.
    lambda mu, nu, t: (
      optax.ScaleByAmsgradState(*_adam_stored(mu, nu, t)[0], _scaled(nu, _decay(0.999, t))),
      optax.EmptyState(),
    ),
    mu_needs_nu=True,
  ),
  Kind(
    "adan",
    lambda: optax.adan(1e-3),
    frozenset({"mu", "nu"}),
    lambda mu, nu, t: (
      optax.ScaleByAdanState(
        m=_scaled(mu, _decay(0.98, t)), v=ZERO, n=_scaled(nu, _decay(0.99, t)), g=mu, t=jnp.int32(t)
      ),
      optax.EmptyState(),
      optax.EmptyState(),
    ),
    mu_needs_nu=True,
  ),
  Kind(
    "adamax",
    lambda: optax.adamax(1e-3),
    frozenset({"mu", "nu"}),
    # Adam's state type; nu is a running maximum of |g|, read as sqrt(E[g^2]).
    lambda mu, nu, t: (
      optax.ScaleByAdamState(
        jnp.int32(t), _scaled(mu, _decay(0.9, t)), jax.tree.map(jnp.sqrt, nu)
      ),
      optax.EmptyState(),
    ),
    mu_needs_nu=True,
  ),
  Kind(
    "lion",
    lambda: optax.lion(1e-3),
    frozenset({"mu"}),
    lambda mu, nu, t: (
      optax.ScaleByLionState(jnp.int32(t), _scaled(mu, _decay(0.99, t))),
      optax.EmptyState(),
      optax.EmptyState(),
    ),
  ),
  Kind(
    "sgd_momentum",
    lambda: optax.sgd(1e-3, momentum=0.9),
    frozenset({"mu"}),
    # The trace is a sum: g + 0.9 g' + ... = mu (1 - 0.9^t) / (1 - 0.9).
    lambda mu, nu, t: (optax.TraceState(_scaled(mu, _decay(0.9, t) / 0.1)), optax.EmptyState()),
  ),
  Kind(
    "rmsprop",
    lambda: optax.rmsprop(1e-3),
    frozenset({"nu"}),
    lambda mu, nu, t: (
      optax.ScaleByRmsState(_scaled(nu, _decay(0.9, t))),
      optax.EmptyState(),
      optax.EmptyState(),
    ),
  ),
  Kind("adafactor", lambda: optax.adafactor(1e-3, min_dim_size_to_factor=2), frozenset({"nu"}),
       _adafactor_stored),
  Kind("adafactor_momentum",
       lambda: optax.adafactor(LEARNING_RATE, min_dim_size_to_factor=2, momentum=0.9),
       frozenset({"mu", "nu"}), _adafactor_momentum_stored, mu_needs_nu=True),
]  # fmt: skip
BY_NAME = {kind.name: kind for kind in KINDS}


def _optimizer(kind: Kind, mu=M, nu=V, t=T) -> t5x_optim.Optimizer:
  """`kind`'s optimizer over PARAMS at step `t`, with the hand-made state of (mu, nu)."""
  opt = OptaxWrapper(kind.make()).create(PARAMS)
  state = t5x_optim.OptimizerState(step=jnp.int32(t), param_states=kind.stored(mu, nu, t))
  assert jax.tree.structure(state) == jax.tree.structure(opt.state), kind
  return opt.replace(state=state)


def _assert_close(got, want, what=""):
  flat_got = jax.tree.flatten_with_path(got)[0]
  flat_want = jax.tree.leaves(want)
  assert len(flat_got) == len(flat_want), what
  for (path, a), b in zip(flat_got, flat_want, strict=True):
    np.testing.assert_allclose(
      np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-7, err_msg=f"{what}{path}"
    )


PAIRS = [(a, b) for a in KINDS for b in KINDS if a is not b]


def _adam_pairs_quick(pairs):
  """The pairs with Adam (mu and nu) on one side stay in the quick loop: every kind's
  reader and writer; the pairs between two other kinds are slow (CI runs them)."""
  return [
    p if "adam" in (p[0].name, p[1].name) else pytest.param(*p, marks=pytest.mark.slow)
    for p in pairs
  ]


@pytest.fixture
def hparams_read(monkeypatch):
  """The names of the hyper-parameters the converters ask their context for."""
  names: set[str] = set()
  context = t5x_optim.ConversionContext
  hparam, rate = context.hparam, context.rate
  monkeypatch.setattr(context, "hparam", lambda c, n, d: names.add(n) or hparam(c, n, d))
  monkeypatch.setattr(context, "rate", lambda c, n="learning_rate": names.add(n) or rate(c, n))
  return names


@pytest.mark.parametrize(("source", "target"), _adam_pairs_quick(PAIRS), ids=lambda k: k.name)
def test_conversion_matches_the_formulas(source, target, hparams_read):
  has = target.usable(source)
  new, report = t5x_optim.convert_state(
    _optimizer(source),
    OptaxWrapper(target.make()),
    source_hparams=HPARAMS,
    target_hparams=HPARAMS,
    missing="init",
  )
  expected = target.stored(M if "mu" in has else ZERO, V if "nu" in has else ZERO, T if has else 0)
  _assert_close(new.state.param_states, expected, f"{source.name} -> {target.name}: ")
  assert int(new.state.step) == T
  _assert_close(new.target, PARAMS)
  assert bool(report.converted) == bool(has)
  # Adan's v starts at 0 by design, listed as initialised whatever the source.
  lacking = [line for line in report.initialised if "without a source value" in line]
  assert bool(lacking) == bool(target.quantities - source.quantities)
  # Every name a built-in converter reads is one `convert_state` knows (and the CLI reads).
  assert hparams_read <= t5x_optim.BUILTIN_HPARAMS, hparams_read - t5x_optim.BUILTIN_HPARAMS


@pytest.mark.parametrize(
  ("source", "target"),
  _adam_pairs_quick([(a, b) for a, b in PAIRS if b.quantities - a.quantities]),
  ids=lambda k: k.name,
)
def test_a_missing_moment_raises_unless_told(source, target):
  with pytest.raises(ValueError, match=r"cannot be fully converted.*missing='init'"):
    t5x_optim.convert_state(
      _optimizer(source),
      OptaxWrapper(target.make()),
      source_hparams=HPARAMS,
      target_hparams=HPARAMS,
    )


@pytest.mark.parametrize(
  ("start", "via", "kept"),
  [
    ("adam", "lion", ""),  # Lion keeps mu alone, which Adam carries only with its nu.
    ("lion", "sgd_momentum", "mu"),
    ("adam", "rmsprop", "nu"),
    ("adam", "adafactor", "nu"),
    ("adam", "adan", "mu nu"),
    ("adam", "adafactor_momentum", "mu nu"),
    # Slow: the round trips that do not start from Adam (the quick loop keeps those that do).
    pytest.param("adafactor", "adam", "nu", marks=pytest.mark.slow),
    pytest.param("sgd_momentum", "lion", "mu", marks=pytest.mark.slow),
    pytest.param("adafactor_momentum", "adan", "mu nu", marks=pytest.mark.slow),
  ],
)
def test_round_trip_returns_the_same_values(start, via, kept):
  original = _optimizer(BY_NAME[start])
  hparams = {"source_hparams": HPARAMS, "target_hparams": HPARAMS, "missing": "init"}
  there, _ = t5x_optim.convert_state(original, OptaxWrapper(BY_NAME[via].make()), **hparams)
  back, _ = t5x_optim.convert_state(there, OptaxWrapper(BY_NAME[start].make()), **hparams)
  kept_mu, kept_nu = "mu" in kept, "nu" in kept
  expected = BY_NAME[start].stored(M if kept_mu else ZERO, V if kept_nu else ZERO, T if kept else 0)
  _assert_close(back.state.param_states, expected, f"{start} -> {via} -> {start}: ")


def _noisy_grads(params, seed):
  """Gradients whose small mean is under noise: where a moment read in the wrong units misleads.

  From numpy's generator: jax's would compile a sampler into every step.
  """
  rng = np.random.default_rng(seed)
  return jax.tree.map(
    lambda p: (0.01 * rng.standard_normal(p.shape) + 0.003).astype(np.float32), params
  )


_APPLY_GRADIENT = jax.jit(lambda opt, grads: opt.apply_gradient(grads))


def _trained(tx, params, steps=20):
  """`tx` wrapped and run `steps` jitted updates on `_noisy_grads`."""
  opt = OptaxWrapper(tx).create(params)
  for seed in range(1, steps + 1):
    opt = _APPLY_GRADIENT(opt, _noisy_grads(params, seed))
  return opt


def _largest_step(opt):
  """The largest change of a param in `opt`'s next update."""
  moved = opt.apply_gradient(_noisy_grads(opt.target, 0)).target
  return max(
    float(jnp.max(jnp.abs(a - b))) for a, b in zip(*map(jax.tree.leaves, (moved, opt.target)))
  )


NOISY_PARAMS = {
  "w": 0.1 * np.random.default_rng(0).standard_normal((16, 24), np.float32),
  "b": np.zeros(24, np.float32),
}
MOMENTUM_ONLY = {k.name: k.make for k in KINDS if k.quantities == {"mu"}}
MOMENTUM_ONLY["muon"] = lambda: optax.contrib.muon(1e-3)  # Adam beside it for the bias


@pytest.mark.parametrize(
  "target",
  [
    k if k.name == "adam" else pytest.param(k, marks=pytest.mark.slow)  # the quick loop: Adam
    for k in KINDS
    if k.mu_needs_nu and "adafactor" not in k.name
  ],
  ids=str,
)
@pytest.mark.parametrize(
  "source",
  [s if s != "muon" else pytest.param(s, marks=pytest.mark.slow) for s in sorted(MOMENTUM_ONLY)],
)
def test_a_momentum_without_a_second_moment_starts_adams_moments_fresh(source, target):
  """A momentum (Lion's, SGD's, Muon's) carried into Adam's mu beside a fresh nu made the
  next update divide it by one small squared gradient: up to 27,000 times the learning rate."""
  old = _trained(MOMENTUM_ONLY[source](), NOISY_PARAMS)
  new, report = t5x_optim.convert_state(old, OptaxWrapper(target.make()), missing="init")
  assert any("(carried only with nu)" in line for line in report.initialised), report
  assert _largest_step(new) <= 1.5 * LEARNING_RATE


@functools.cache
def _trained_kind(name):
  return _trained(BY_NAME[name].make(), NOISY_PARAMS)


@pytest.mark.slow
@pytest.mark.parametrize(("source", "target"), PAIRS, ids=lambda k: k.name)
def test_a_converted_states_first_step_is_of_the_size_the_target_takes(source, target):
  """Every pair, trained by optax's own loop: a reading or writing in the wrong units shows
  in the next update (1,500 times the target's own step for adam -> adamax and 1/60 for
  adamax -> adam before adamax's state was told from Adam's)."""
  new, _ = t5x_optim.convert_state(
    _trained_kind(source.name),
    OptaxWrapper(target.make()),
    source_hparams=HPARAMS,
    target_hparams=HPARAMS,
    missing="init",
  )
  ratio = _largest_step(new) / _largest_step(_trained_kind(target.name))
  assert 0.02 < ratio < 5, ratio


@pytest.mark.slow
@pytest.mark.parametrize("direction", ["into", "from"])
def test_adamax_state_is_told_from_adams_by_one_update(direction):
  """Adamax stores Adam's state type, its nu a running maximum of |g|. Read as Adam's E[g^2],
  adam -> adamax moved params 650 times the learning rate on the next step; adamax -> adam
  60 times too little. Each side's first step after the conversion stays near its own."""
  old, new = optax.adam(1e-3), optax.adamax(1e-3)
  if direction == "from":
    old, new = new, old
  converted, report = t5x_optim.convert_state(
    _trained(old, NOISY_PARAMS), OptaxWrapper(new).create(NOISY_PARAMS)
  )
  assert any("(ScaleByAdamState of adamax)" in line for line in report.converted), report
  ratio = _largest_step(converted) / _largest_step(_trained(new, NOISY_PARAMS))
  assert 0.2 < ratio < 3, ratio


@pytest.mark.slow
@pytest.mark.parametrize("direction", ["into", "from"])
def test_adamax_state_of_scalar_params_only_is_told_from_adams(direction):
  """The probe compared two values of each leaf; over scalar params alone it had none, so
  adamax's running maximum of |g| converted into Adam's E[g^2] (670 times too large) and the
  report named Adam's state. A scalar converts as the same value in a one-element array does."""
  old, new = optax.adamax(1e-3), optax.adam(1e-3)
  if direction == "into":
    old, new = new, old
  got = {}
  for shape in [(), (1,)]:
    params = {"w": np.zeros(shape, np.float32)}
    source = OptaxWrapper(old).create(params)
    for g in (0.5, 0.25, 0.5):
      source = source.apply_gradient({"w": np.full(shape, g, np.float32)})
    converted, report = t5x_optim.convert_state(source, OptaxWrapper(new).create(params))
    assert any("(ScaleByAdamState of adamax)" in line for line in report.converted), report
    got[shape] = np.ravel(converted.state.param_states[0].nu["w"])
  np.testing.assert_array_equal(got[()], got[(1,)])


def _accumulating(inner: optax.GradientTransformation) -> optax.GradientTransformation:
  return optax.MultiSteps(inner, every_k_schedule=3).gradient_transformation()


@pytest.mark.slow
@pytest.mark.parametrize("direction", ["into", "from"])
def test_adamax_inside_multisteps_is_told_from_adam(direction):
  """MultiSteps updates its inner adamax every 3rd gradient: an adamax probe of one update saw
  Adam's state untouched and read it as Adam's, so adam -> MultiSteps(adamax) wrote E[g^2] as
  adamax's running maximum of |g|. Inside MultiSteps it converts as adamax does."""
  adam, adamax = optax.adam(1e-3), optax.adamax(1e-3)
  if direction == "into":
    source = _trained(adam, NOISY_PARAMS)
    want, _ = t5x_optim.convert_state(source, OptaxWrapper(adamax).create(NOISY_PARAMS))
    got, report = t5x_optim.convert_state(
      source, OptaxWrapper(_accumulating(adamax)).create(NOISY_PARAMS)
    )
    _assert_close(got.state.param_states.inner_opt_state[0].nu, want.state.param_states[0].nu)
  else:
    source = _trained(_accumulating(adamax), NOISY_PARAMS, steps=21)
    as_adamax = OptaxWrapper(adamax).create(source.target)
    as_adamax = as_adamax.replace(
      state=t5x_optim.OptimizerState(
        source.state.param_states.gradient_step, source.state.param_states.inner_opt_state
      )
    )
    want, _ = t5x_optim.convert_state(as_adamax, OptaxWrapper(adam).create(NOISY_PARAMS))
    got, report = t5x_optim.convert_state(source, OptaxWrapper(adam).create(NOISY_PARAMS))
    _assert_close(got.state.param_states[0].nu, want.state.param_states[0].nu)
  assert any("(ScaleByAdamState of adamax)" in line for line in report.converted), report


def _on_plateau(inner: optax.GradientTransformation) -> optax.GradientTransformation:
  """`inner` followed by a transformation whose update needs the loss (optax's ``value``)."""
  return optax.chain(inner, optax.contrib.reduce_on_plateau())


@pytest.mark.parametrize("direction", ["into", "from"])
def test_adamax_before_a_transformation_that_takes_the_loss_is_told_from_adam(direction):
  """reduce_on_plateau's update needs the loss: the probe updated without it, failed, and read
  adamax's state as Adam's: adamax -> adam wrote nu 0.023 where 1.0e-5 is right, adam -> adamax
  2.0e-6 where 0.010 is. The probe gives the update the extra arguments it takes."""
  adam, adamax = optax.adam(1e-3), optax.adamax(1e-3)
  if direction == "into":
    source = _trained(adam, NOISY_PARAMS)
    want, _ = t5x_optim.convert_state(source, OptaxWrapper(adamax).create(NOISY_PARAMS))
    target = OptaxWrapper(_on_plateau(adamax)).create(NOISY_PARAMS)
    got, report = t5x_optim.convert_state(source, target)
    _assert_close(got.state.param_states[0][0].nu, want.state.param_states[0].nu)
  else:
    trained = _trained(adamax, NOISY_PARAMS)
    source = OptaxWrapper(_on_plateau(adamax)).create(trained.target)
    states = (trained.state.param_states, source.state.param_states[1])
    source = source.replace(state=source.state.replace(param_states=states))
    want, _ = t5x_optim.convert_state(trained, OptaxWrapper(adam).create(NOISY_PARAMS))
    got, report = t5x_optim.convert_state(source, OptaxWrapper(adam).create(NOISY_PARAMS))
    _assert_close(got.state.param_states[0].nu, want.state.param_states[0].nu)
  assert any("(ScaleByAdamState of adamax)" in line for line in report.converted), report


def _weighted() -> optax.GradientTransformationExtraArgs:
  """Scales the updates by an extra argument ``weights`` that optax does not define."""

  def update(updates, state, params=None, *, weights, **extra_args):
    del params, extra_args
    return jax.tree.map(lambda u: u * weights, updates), state

  return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


@pytest.mark.parametrize("side", ["source", "target"])
def test_adams_state_under_an_update_the_probe_cannot_run_is_refused(side):
  """An update that needs an argument of its own: the probe could not tell adamax's state from
  Adam's and read it as Adam's, whichever it was. The conversion is refused, naming the state
  and why, and nothing is changed."""
  weighted = OptaxWrapper(optax.chain(optax.adamax(1e-3), _weighted()), extra_args={"weights"})
  plain = OptaxWrapper(optax.adam(1e-3))
  source, target = _trained(optax.adam(1e-3), NOISY_PARAMS), weighted
  if side == "source":
    trained = _trained(optax.adamax(1e-3), NOISY_PARAMS)
    states = (trained.state.param_states, optax.EmptyState())
    source = weighted.create(trained.target)
    source, target = source.replace(state=source.state.replace(param_states=states)), plain
  with pytest.raises(ValueError, match="weights") as raised:
    t5x_optim.convert_state(source, target)
  message = str(raised.value)
  assert f"the {side} optimizer's state" in message, message
  assert "0/0 (ScaleByAdamState)" in message, message


@pytest.mark.slow
@pytest.mark.parametrize(
  "wrap",
  [
    pytest.param(lambda tx: t5x_optim.low_precision(tx, "bfloat16", min_size=0), id="bfloat16"),
    pytest.param(
      lambda tx: _accumulating(t5x_optim.low_precision(tx, "bfloat16", min_size=0)),
      id="multisteps_of_bfloat16",
    ),
    pytest.param(
      lambda tx: t5x_optim.low_precision(_accumulating(tx), "bfloat16", min_size=0),
      id="bfloat16_of_multisteps",
    ),
  ],
)
def test_adamax_is_told_from_adam_inside_low_precision_and_multisteps(wrap):
  """The probe looks for Adam's state type in the definition's initial state, decoding a
  compressed one (looked for in abstract values, a bfloat16 state failed to decode and adamax
  was read as Adam's), and MultiSteps around or inside low_precision updates its adamax every
  3rd step."""
  source = _trained(optax.adam(1e-3), NOISY_PARAMS)
  target = OptaxWrapper(wrap(optax.adamax(1e-3))).create(NOISY_PARAMS)
  _, report = t5x_optim.convert_state(source, target)
  assert any("(ScaleByAdamState of adamax)" in line for line in report.converted), report


@pytest.mark.slow
def test_a_trace_after_a_stateful_transformation_is_not_a_gradient_momentum():
  """RMSProp's momentum sums updates already divided by its second moment and scaled by -lr:
  written from Adam's mu, its first step went against the gradient (+0.027 on gradients of
  mean +0.003) instead of along -lr g / sqrt(nu). It starts fresh, and is not read."""
  rmsprop = OptaxWrapper(optax.rmsprop(1e-3, momentum=0.9))
  new, report = t5x_optim.convert_state(_optimizer(BY_NAME["adam"]), rmsprop, missing="init")
  why = "a momentum of updates scaled by the ScaleByRmsState before it, not of gradients"
  assert report.initialised == (
    f"2 (TraceState).trace ({why}): 2 params without a source value (e.g. dense/bias)",
  )
  _assert_close(new.state.param_states[2].trace, ZERO)
  moved = jax.tree.map(jnp.subtract, new.apply_gradient(M).target, new.target)
  for step, grad in zip(jax.tree.leaves(moved), jax.tree.leaves(M), strict=True):
    assert np.all(np.sign(step) == -np.sign(grad))
  new = new.replace(
    state=new.state.replace(
      param_states=BY_NAME["rmsprop"].stored(M, V, T)[:2] + (optax.TraceState(M),)
    )
  )
  back, report = t5x_optim.convert_state(new, OptaxWrapper(optax.adam(1e-3)), missing="init")
  assert report.dropped == (f"2 (TraceState: {why})",)
  _assert_close(back.state.param_states[0].mu, ZERO)


@pytest.mark.slow
def test_adafactor_reconstruction_is_adafactors_own():
  """One optax Adafactor step's update is g / sqrt(nu) with the reconstructed nu."""
  tx = optax.scale_by_factored_rms(min_dim_size_to_factor=2)
  grads = jax.tree.map(lambda x: x * 3.0, M)
  state = tx.init(PARAMS)
  for _ in range(3):
    updates, state = tx.update(grads, state, PARAMS)
  adam, _ = t5x_optim.convert_state(
    OptaxWrapper(tx).create(PARAMS).replace(state=t5x_optim.OptimizerState(jnp.int32(3), state)),
    OptaxWrapper(optax.scale_by_adam()),
    missing="init",
  )
  nu = _scaled(adam.state.param_states.nu, 1 / _decay(0.999, 3))
  _assert_close(jax.tree.map(lambda g, v: g / jnp.sqrt(v), grads, nu), updates)


@pytest.mark.parametrize("side", ["source_hparams", "target_hparams"])
def test_an_hparam_no_converter_reads_is_refused(side):
  """A mistyped name (``beta_1`` for ``b1``) left the converter on optax's default b1."""
  read = rf"{side} 'beta_1', 'lr' read by no converter.* b1, b2.*, and a registered one reads "
  with pytest.raises(ValueError, match=read + "the names it asks its ConversionContext for"):
    t5x_optim.convert_state(
      _optimizer(BY_NAME["adam"]),
      OptaxWrapper(optax.sgd(1e-3, momentum=0.5)),
      **{side: {"beta_1": 0.8, "lr": 0.1, "momentum": 0.5}},
      missing="init",
    )


def test_hparams_reach_the_formulas():
  source = _optimizer(BY_NAME["adam"])
  new, _ = t5x_optim.convert_state(
    source,
    OptaxWrapper(optax.sgd(1e-3, momentum=0.5)),
    source_hparams={"b1": 0.8},
    target_hparams={"momentum": 0.5},
    missing="init",
  )
  mu = _scaled(M, _decay(0.9, T) / _decay(0.8, T))  # stored with 0.9, read with 0.8
  _assert_close(new.state.param_states[0].trace, _scaled(mu, _decay(0.5, T) / 0.5))


@pytest.mark.slow
def test_adafactor_momentum_is_read_from_optaxs_own_updates():
  """optax.adafactor(momentum=0.9) run on a constant gradient: its EMA reads back as the gradient.

  With ``g**2`` of rank 1, Adafactor's factored ``v`` is ``g**2`` exactly, each update
  ``lr * scale * g / |g|`` (rms 1: not clipped), and the EMA of t of them over
  ``(1 - 0.9^t)`` is one update, so the converted Adam state must hold ``g``.
  """
  grads = {"w": jnp.asarray(np.outer([1.0, -2.0, 0.5], [3.0, 1.0, -1.0, 2.0]), jnp.float32)}
  params = {"w": jnp.full((3, 4), 0.5)}
  tx = optax.adafactor(0.01, momentum=0.9, min_dim_size_to_factor=2)
  state = tx.init(params)
  for _ in range(4):
    _, state = tx.update(grads, state, params)
  source = OptaxWrapper(tx).create(params)
  source = source.replace(state=t5x_optim.OptimizerState(jnp.int32(4), state))
  adam, report = t5x_optim.convert_state(
    source,
    OptaxWrapper(optax.adam(1e-3)),
    source_hparams={"learning_rate": 0.01, "momentum": 0.9},
  )
  _assert_close(adam.state.param_states[0].mu, _scaled(grads, _decay(0.9, 4)))
  _assert_close(
    adam.state.param_states[0].nu, _scaled(jax.tree.map(jnp.square, grads), _decay(0.999, 4))
  )
  assert any("ScaleByAdamState).mu" in line and "4 (EmaState)" in line for line in report.converted)


def test_an_ema_adafactor_momentum_cannot_read_is_dropped_with_the_reason():
  opt = _optimizer(BY_NAME["adafactor_momentum"])
  _, report = t5x_optim.convert_state(
    opt, OptaxWrapper(optax.adam(1e-3)), source_hparams={"momentum": 0.9}, missing="init"
  )
  assert report.dropped == (
    "4 (EmaState: Adafactor's momentum, which needs the hyper-parameters ['learning_rate'])",
  )
  _, report = t5x_optim.convert_state(
    _optimizer(BY_NAME["adam"]),
    OptaxWrapper(BY_NAME["adafactor_momentum"].make()),
    missing="init",
  )
  assert report.initialised == (
    "4 (EmaState).ema (Adafactor's momentum, which needs the hyper-parameters "
    "['learning_rate', 'momentum']): 2 params without a source value (e.g. dense/bias)",
  )
  polyak = OptaxWrapper(optax.chain(optax.ema(0.9), optax.scale(-1.0))).create(PARAMS)
  _, report = t5x_optim.convert_state(polyak, OptaxWrapper(optax.sgd(0.1)), missing="init")
  assert report.dropped == (
    "0 (EmaState: an EMA after no FactoredState in its chain: not Adafactor's momentum)",
  )


def test_injected_hyperparameters_are_the_states_own():
  """An inject_hyperparams state's b1 (0.8 here) reads its mu, not optax's default 0.9."""
  tx = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3, b1=0.8)
  source = OptaxWrapper(tx).create(PARAMS)
  adam = optax.ScaleByAdamState(
    jnp.int32(T), _scaled(M, _decay(0.8, T)), _scaled(V, _decay(0.999, T))
  )
  inner = (adam, *source.state.param_states.inner_state[1:])
  state = source.state.param_states._replace(inner_state=inner)
  source = source.replace(state=t5x_optim.OptimizerState(jnp.int32(T), state))
  lion, _ = t5x_optim.convert_state(source, OptaxWrapper(optax.lion(1e-3)), missing="init")
  _assert_close(lion.state.param_states[0].mu, _scaled(M, _decay(0.99, T)))


def _constant_gradient_steps(tx, params, grads, steps):
  source = OptaxWrapper(tx).create(params)
  for _ in range(steps):
    source = source.apply_gradient(grads)
  return source


@pytest.mark.slow
def test_an_injected_muons_adam_b2_reads_its_adam():
  """Muon's adam_b1/adam_b2 are its Adam's b1/b2, held by an inject_hyperparams state too."""
  params = {"k": jnp.ones((4, 6)), "b": jnp.ones((6,))}
  grads = {"k": jnp.full((4, 6), 0.5), "b": jnp.full((6,), 2.0)}
  tx = optax.inject_hyperparams(optax.contrib.muon)(learning_rate=1e-3, adam_b2=0.95)
  source = _constant_gradient_steps(tx, params, grads, 5)
  adamw, _ = t5x_optim.convert_state(source, OptaxWrapper(optax.adamw(1e-3)), missing="init")
  _assert_close(adamw.state.param_states[0].nu["b"] / _decay(0.999, 5), jnp.full((6,), 4.0))


@pytest.mark.slow
@pytest.mark.parametrize("b2", [None, 0.99])
def test_schedule_free_adamws_second_moment_decays_with_its_b2(b2):
  """schedule_free_adamw keeps scale_by_rms(decay=b2)'s state, not rmsprop's decay=0.9."""
  params, grads = {"w": jnp.zeros(3)}, {"w": jnp.array([1.0, 2.0, 3.0])}
  given = {} if b2 is None else {"b2": b2}
  source = _constant_gradient_steps(
    optax.contrib.schedule_free_adamw(1e-3, **given), params, grads, 10
  )
  adamw, _ = t5x_optim.convert_state(
    source, OptaxWrapper(optax.adamw(1e-3)), source_hparams=given, missing="init"
  )
  _assert_close(adamw.state.param_states[0].nu["w"] / _decay(0.999, 10), grads["w"] ** 2)
  back, _ = t5x_optim.convert_state(
    adamw,
    OptaxWrapper(optax.contrib.schedule_free_adamw(1e-3, **given)),
    target_hparams=given,
    missing="init",
  )
  rms = back.state.param_states.base_optimizer_state[0]
  _assert_close(rms.nu["w"] / _decay(b2 or 0.999, int(rms.count)), grads["w"] ** 2)


@pytest.mark.slow
def test_a_schedule_given_for_an_injected_target_is_called_at_the_step():
  """A fresh inject_hyperparams state holds its schedule's value at step 0 (0 in a warmup
  from 0): Adafactor's momentum, written with that rate, was all zeros."""
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=(4, 6)), jnp.float32)}
  grads = {"w": jnp.asarray(rng.normal(size=(4, 6)), jnp.float32)}
  source = _constant_gradient_steps(optax.adamw(1e-3), params, grads, 5)
  schedule = optax.linear_schedule(0.0, 1e-2, 100)
  static = (
    *("dtype_momentum", "min_dim_size_to_factor", "factored", "multiply_by_parameter_scale"),
    *("eps", "decay_rate", "decay_offset", "clipping_threshold", "weight_decay_rate"),
    "weight_decay_mask",
  )
  injected = optax.inject_hyperparams(optax.adafactor, static_args=static)(
    learning_rate=schedule, momentum=0.9, min_dim_size_to_factor=2
  )
  plain = optax.adafactor(schedule, momentum=0.9, min_dim_size_to_factor=2)
  hparams = {"learning_rate": schedule, "momentum": 0.9}
  ema = [
    t5x_optim.convert_state(source, OptaxWrapper(tx), target_hparams=hparams)[0]
    for tx in (injected, plain)
  ]
  _assert_close(ema[0].state.param_states.inner_state[4].ema, ema[1].state.param_states[4].ema)
  assert float(jnp.abs(ema[1].state.param_states[4].ema["w"]).mean()) > 0


@pytest.mark.slow
def test_schedule_free_over_rmsprop_keeps_rmsprops_decay():
  """rmsprop's scale_by_rms(decay=0.9) keeps no count: b2 is schedule_free_adamw's only."""
  params, grads = {"w": jnp.zeros(3)}, {"w": jnp.array([1.0, 2.0, 3.0])}
  tx = optax.contrib.schedule_free(optax.rmsprop(1.0), 1.0)
  source = _constant_gradient_steps(tx, params, grads, 10)
  adamw, _ = t5x_optim.convert_state(source, OptaxWrapper(optax.adamw(1e-3)), missing="init")
  nu = source.state.param_states.base_optimizer_state[0].nu["w"] / _decay(0.9, 10)
  _assert_close(adamw.state.param_states[0].nu["w"] / _decay(0.999, 10), nu)


NESTED = [
  ("chain+inject", lambda tx: optax.chain(
    optax.clip_by_global_norm(1.0), optax.inject_hyperparams(optax.adamw)(learning_rate=0.1)),
   lambda s: s[1].inner_state[0]),
  ("multisteps", lambda tx: optax.MultiSteps(optax.adam(1e-3), 2).gradient_transformation(),
   lambda s: s.inner_opt_state[0]),
  ("masked", lambda tx: optax.masked(optax.adam(1e-3), {"dense": {"kernel": True, "bias": False}}),
   lambda s: s.inner_state[0]),
  ("multi_transform", lambda tx: optax.multi_transform(
    {"a": optax.adam(1e-3), "b": optax.sgd(1e-3, momentum=0.9)},
    {"dense": {"kernel": "a", "bias": "b"}}),
   lambda s: s.inner_states["a"].inner_state[0]),
]  # fmt: skip


@pytest.mark.parametrize(("name", "make", "adam_of"), NESTED, ids=[n[0] for n in NESTED])
def test_nested_states_are_found(name, make, adam_of):
  source = OptaxWrapper(optax.chain(optax.clip(1.0), BY_NAME["adam"].make()))
  source = source.create(PARAMS).replace(
    state=t5x_optim.OptimizerState(
      jnp.int32(T), (optax.EmptyState(), BY_NAME["adam"].stored(M, V, T))
    )
  )
  new, report = t5x_optim.convert_state(source, OptaxWrapper(make(None)))
  adam = adam_of(new.state.param_states)
  expected = BY_NAME["adam"].stored(M, V, T)[0]
  assert int(adam.count) == T
  for field in ("mu", "nu"):
    for path, leaf in traverse_util.flatten_dict(getattr(adam, field)).items():
      if not isinstance(leaf, optax.MaskedNode):
        want = traverse_util.flatten_dict(getattr(expected, field))[path]
        np.testing.assert_allclose(leaf, want, rtol=2e-5, err_msg=f"{name} {field} {path}")
  fresh = [line for line in report.initialised if "at the initial value by design" in line]
  assert report.converted and report.initialised == tuple(fresh), report
  assert [line.split(" ")[0] for line in fresh] == (["acc_grads"] if name == "multisteps" else [])


def test_schedule_counts_go_on_from_the_source_step():
  schedule = optax.warmup_cosine_decay_schedule(0.0, 1.0, 10, 100)
  new, _ = t5x_optim.convert_state(
    _optimizer(BY_NAME["adam"]), OptaxWrapper(optax.adamw(schedule)), missing="init"
  )
  assert int(new.state.param_states[-1].count) == T  # scale_by_schedule's count


def _of_type(states: Any, kind: type) -> list[Any]:
  return [
    n for n in jax.tree.leaves(states, is_leaf=lambda x: isinstance(x, kind)) if isinstance(n, kind)
  ]


@pytest.mark.parametrize(
  ("make", "kind"),
  [
    (
      lambda: optax.contrib.reduce_on_plateau(accumulation_size=2),
      optax.contrib.ReduceLROnPlateauState,
    ),
    (lambda: optax.apply_every(3), optax.ApplyEvery),
    (lambda: optax.contrib.galore(1e-3, rank=2, update_proj_gap=4), optax.contrib.GaLoreState),
    (lambda: optax.contrib.sophia(1e-3), optax.contrib.SophiaState),
    (lambda: optax.novograd(1e-3), optax.ScaleByNovogradState),
    (lambda: optax.scale_by_lbfgs(), optax.ScaleByLBFGSState),
  ],
  ids=["reduce_on_plateau", "apply_every", "galore", "sophia", "novograd", "lbfgs"],
)
@pytest.mark.slow
def test_counts_that_time_an_event_of_their_fresh_state_start_at_0(make, kind):
  """Such a count is compared with a setting or taken modulo one (the next check, emit,
  refresh or memory slot) or with 0 (a first step), over fields that start fresh: set to the
  old step, the event would fall out of step with them, or never come."""
  schedule = optax.linear_schedule(1.0, 0.0, 100)
  target = OptaxWrapper(optax.chain(make(), optax.scale_by_schedule(schedule)))
  new, _ = t5x_optim.convert_state(_optimizer(BY_NAME["adam"]), target, missing="init")
  (node,) = _of_type(new.state.param_states, kind)
  assert int(node.count) == 0
  (scheduled,) = _of_type(new.state.param_states, optax.ScaleByScheduleState)
  assert int(scheduled.count) == T


@pytest.mark.slow
def test_reduce_on_plateau_converted_still_reduces_its_scale():
  tx = optax.chain(
    optax.adam(1e-2), optax.contrib.reduce_on_plateau(patience=1, accumulation_size=2)
  )
  new, _ = t5x_optim.convert_state(_optimizer(BY_NAME["adam"]), OptaxWrapper(tx), missing="init")
  state = new.state.param_states
  grads = jax.tree.map(jnp.ones_like, PARAMS)
  for _ in range(6):  # a loss that never improves: the scale falls every 2 losses
    _, state = tx.update(grads, state, PARAMS, value=jnp.asarray(1.0))
  assert float(state[1].scale) < 1.0


@pytest.mark.slow
@pytest.mark.parametrize(
  "make",
  [
    lambda: optax.conditionally_transform(optax.adam(1e-2), lambda step: step >= 20),
    lambda: optax.conditionally_mask(optax.adam(1e-2), lambda step: step >= 20),
  ],
  ids=["conditionally_transform", "conditionally_mask"],
)
def test_a_gate_on_the_step_goes_on_from_the_source_step(make):
  """The gate's own step is a clock: converted into the same optimizer after 40 updates, it
  started again at 0, so a gate opened at step 20 closed again and the next update differed."""
  params, grads = {"w": jnp.ones(3)}, {"w": jnp.full(3, 0.5)}
  old = OptaxWrapper(make()).create(params)
  for _ in range(40):
    old = old.apply_gradient(grads)
  new, report = t5x_optim.convert_state(old, OptaxWrapper(make()))
  assert int(new.state.param_states.step) == 40
  assert not any("step" in line for line in report.initialised), report.initialised
  np.testing.assert_array_equal(
    new.apply_gradient(grads).target["w"], old.apply_gradient(grads).target["w"]
  )


def _ms(inner: optax.GradientTransformation, k: int) -> optax.GradientTransformation:
  return optax.MultiSteps(inner, k).gradient_transformation()


_BESIDE = {
  "schedule_beside_multi_steps": (
    lambda: optax.chain(_ms(optax.adam(_LINEAR), 4), optax.scale_by_schedule(_LINEAR)),
    (),
  ),
  "gate_beside_multi_steps": (
    lambda: optax.chain(
      _ms(optax.adam(1e-2), 4),
      optax.conditionally_transform(optax.scale(0.5), lambda step: step >= 10),
    ),
    (),
  ),
  "schedule_beside_apply_if_finite": (
    lambda: optax.chain(
      optax.apply_if_finite(optax.adam(_LINEAR), 5), optax.scale_by_schedule(_LINEAR)
    ),
    (3, 7),
  ),
  "multi_steps_without_moments": (lambda: _ms(optax.sgd(_LINEAR), 4), ()),
  "schedule_beside_multi_steps_without_moments": (
    lambda: optax.chain(_ms(optax.sgd(_LINEAR), 4), optax.scale_by_schedule(_LINEAR)),
    (),
  ),
  "schedule_beside_apply_if_finite_without_moments": (
    lambda: optax.chain(
      optax.apply_if_finite(optax.sgd(_LINEAR), 5), optax.scale_by_schedule(_LINEAR)
    ),
    (3, 7),
  ),
  "nested_multi_steps": (lambda: _ms(_ms(optax.adam(_LINEAR), 2), 3), ()),
  "apply_if_finite_in_multi_steps": (
    lambda: _ms(optax.apply_if_finite(optax.adam(_LINEAR), 5), 2),
    (3,),
  ),
}
"""Optimizers with a MultiSteps or apply_if_finite, and the gradients made non-finite."""


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(_BESIDE))
def test_converting_into_itself_keeps_the_counts_of_states_beside_a_wrapper(name):
  """A schedule or gate beside a MultiSteps or apply_if_finite sees every gradient: converted
  into the same optimizer, it goes on from the step, not from the wrapped optimizer's updates,
  and those inside from the updates applied (also without moments: sgd), so the next updates
  are the uninterrupted run's."""
  make, nan_at = _BESIDE[name]
  params = {"w": jnp.linspace(-1.0, 1.0, 4)}
  old = OptaxWrapper(make()).create(params)
  for i in range(24):  # every MultiSteps' mini-step back at 0, as a conversion leaves it
    grads = {"w": jnp.sin(params["w"] * (i + 1)) + 0.1}
    old = _step(old, jax.tree.map(lambda g: g * jnp.nan, grads) if i in nan_at else grads)
  new, _ = t5x_optim.convert_state(old, OptaxWrapper(make()))
  counts = jax.tree.leaves(
    jax.tree.map(lambda x: x if jnp.ndim(x) == 0 else None, old.state.param_states)
  )
  assert (
    jax.tree.leaves(jax.tree.map(lambda x: x if jnp.ndim(x) == 0 else None, new.state.param_states))
    == counts
  )
  grads = {"w": jnp.linspace(0.5, -0.5, 4)}
  for _ in range(4):
    old, new = _step(old, grads), _step(new, grads)
  # Adam's moments go over through their estimates (mu / c * c): equal to an ulp.
  np.testing.assert_allclose(new.target["w"], old.target["w"], rtol=1e-6)


def _in_groups(*groups: tuple[str, optax.GradientTransformation]) -> t5x_optim.MultiOptimizer:
  return t5x_optim.MultiOptimizer(
    [(t5x_optim.PathFilter(name), OptaxWrapper(tx)) for name, tx in groups]
  )


def _renamed(inner: Callable[..., optax.GradientTransformation]) -> tuple[Any, Any, tuple]:
  """A MultiSteps of 2 over 'w' and one of 4 over 'v', and the same with the labels swapped."""

  def make(w: str, v: str) -> Any:
    return lambda: OptaxWrapper(
      optax.multi_transform(
        {w: _ms(inner(_LINEAR), 2), v: _ms(inner(_LINEAR), 4)}, {"w": w, "v": v}
      )
    )

  return make("x", "y"), make("y", "x"), ()


_MOVED = {
  "partitions_renamed": _renamed(optax.adam),
  "partitions_renamed_without_moments": _renamed(optax.sgd),
  "groups_reordered": (
    lambda: _in_groups(("w", _ms(optax.adam(_LINEAR), 2)), ("v", _ms(optax.adam(_LINEAR), 4))),
    lambda: _in_groups(("v", _ms(optax.adam(_LINEAR), 4)), ("w", _ms(optax.adam(_LINEAR), 2))),
    (),
  ),
  "nested_multi_steps_flattened": (
    lambda: OptaxWrapper(_ms(_ms(optax.adam(_LINEAR), 2), 3)),
    lambda: OptaxWrapper(_ms(optax.adam(_LINEAR), 6)),
    (),
  ),
  "nested_multi_steps_around_another_optimizer": (
    lambda: OptaxWrapper(_ms(_ms(optax.adam(_LINEAR), 2), 3)),
    lambda: OptaxWrapper(_ms(_ms(optax.adamw(_LINEAR), 2), 3)),
    (),
  ),
  "apply_if_finite_in_multi_steps_around_another_optimizer": (
    lambda: OptaxWrapper(_ms(optax.apply_if_finite(optax.adam(_LINEAR), 5), 2)),
    lambda: OptaxWrapper(_ms(optax.apply_if_finite(optax.adamw(_LINEAR), 5), 2)),
    (3, 7),
  ),
  "low_precision_between_nested_multi_steps": (
    lambda: OptaxWrapper(_ms(_ms(optax.adam(_LINEAR), 2), 3)),
    lambda: OptaxWrapper(
      _ms(t5x_optim.low_precision(_ms(optax.adam(_LINEAR), 2), "bfloat16", min_size=0), 3)
    ),
    (),
  ),
  "partitions_renamed_with_two_multi_steps_alike": (
    lambda: OptaxWrapper(
      optax.multi_transform(
        {"a": optax.chain(_ms(optax.sgd(_LINEAR), 2), _ms(optax.sgd(_LINEAR), 3))},
        {"w": "a", "v": "a"},
      )
    ),
    lambda: OptaxWrapper(
      optax.multi_transform(
        {"x": optax.chain(_ms(optax.sgd(_LINEAR), 2), _ms(optax.sgd(_LINEAR), 3))},
        {"w": "x", "v": "x"},
      )
    ),
    (),
  ),
  "two_multi_steps_alike_in_a_chain": (
    lambda: OptaxWrapper(optax.chain(_ms(optax.sgd(_LINEAR), 2), _ms(optax.sgd(_LINEAR), 3))),
    lambda: OptaxWrapper(optax.chain(_ms(optax.sgd(_LINEAR), 2), _ms(optax.sgd(_LINEAR), 3))),
    (),
  ),
  "multi_steps_into_apply_if_finite": (
    lambda: OptaxWrapper(
      optax.multi_transform({"x": _ms(optax.sgd(_LINEAR), 4)}, {"w": "x", "v": "x"})
    ),
    lambda: OptaxWrapper(
      optax.multi_transform(
        {"x": optax.apply_if_finite(optax.sgd(_LINEAR), 5)}, {"w": "x", "v": "x"}
      )
    ),
    (),
  ),
}
"""Optimizers whose MultiSteps or apply_if_finite another holds elsewhere, around another
optimizer, or nested otherwise, with the optimizer they are converted into and the
gradients made non-finite."""


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(_MOVED))
def test_a_wrapper_goes_on_from_the_old_one_over_the_same_params_built_alike(name):
  """A new MultiSteps took the count of the old state's MultiSteps at the same path, though
  that one counted for other params (partitions renamed, groups reordered) or wrapped another
  MultiSteps; an apply_if_finite took a MultiSteps' count; matched by params and nesting
  instead, a wrapper around another optimizer, or one of two alike in a chain, took the
  innermost one's count, and so did one under a low_precision, or one of two alike in a
  renamed partition. Each goes on as an uninterrupted run of the new optimizer fed the same
  gradients: the same counts, and the same next updates (bfloat16 moments: to their
  rounding; with non-finite gradients, which a MultiSteps keeps in its accumulator so that
  every run's params are NaN, the counts alone)."""
  make_source, make_target, nan_at = _MOVED[name]
  params = {"w": jnp.linspace(-1.0, 1.0, 4), "v": jnp.linspace(-2.0, 0.5, 3)}
  old, uninterrupted = make_source().create(params), make_target().create(params)
  for i in range(24):
    grads = jax.tree.map(lambda p, i=i: jnp.sin(p * (i + 1)) + 0.1, params)
    if i in nan_at:
      grads = jax.tree.map(lambda g: g * jnp.nan, grads)
    old, uninterrupted = _step(old, grads), _step(uninterrupted, grads)
  new, _ = t5x_optim.convert_state(old, make_target())

  def counts(optimizer: Any) -> list[Any]:
    scalars = jax.tree.map(lambda x: x if jnp.ndim(x) == 0 else None, optimizer.state)
    return jax.tree.leaves(scalars)

  assert counts(new) == counts(uninterrupted)
  uninterrupted = uninterrupted.replace(target=new.target)
  grads = jax.tree.map(lambda p: jnp.linspace(0.5, -0.5, p.size), params)
  for _ in range(12):
    new, uninterrupted = _step(new, grads), _step(uninterrupted, grads)
  if not nan_at:
    rtol = 1e-2 if "low_precision" in name else 1e-6
    jax.tree.map(
      functools.partial(np.testing.assert_allclose, rtol=rtol, equal_nan=False),
      new.target,
      uninterrupted.target,
    )


def test_schedule_free_step_count_goes_on_from_the_source_step():
  """optax's schedule-free counts from 1, one ahead of its base optimizer's counts."""
  tx = optax.contrib.schedule_free_adamw(1e-2, warmup_steps=100)
  new, _ = t5x_optim.convert_state(_optimizer(BY_NAME["adam"]), OptaxWrapper(tx), missing="init")
  state = new.state.param_states
  native = tx.init(PARAMS)
  step = jax.jit(lambda native: tx.update(jax.tree.map(jnp.ones_like, PARAMS), native, PARAMS)[1])
  for _ in range(T):
    native = step(native)
  assert int(state.step_count) == int(native.step_count) == T + 1
  assert int(state.base_optimizer_state[0].count) == int(native.base_optimizer_state[0].count)


def _plateau(inner):
  return optax.chain(
    inner, optax.contrib.reduce_on_plateau(patience=1, accumulation_size=1, factor=0.5)
  )


def _plateaued():
  """Adam and reduce_on_plateau after 5 rising losses: its scale halved 4 times, to 1/16."""
  params, grads = {"w": jnp.ones(3)}, {"w": jnp.full(3, 0.5)}
  opt = OptaxWrapper(_plateau(optax.adam(1e-2))).create(params)
  for loss in (1.0, 2.0, 3.0, 4.0, 5.0):
    opt = opt.apply_gradient(grads, value=jnp.asarray(loss))
  assert float(opt.state.param_states[1].scale) == 0.0625
  return opt, grads


_PLATEAU = ("scale", "best_value", "plateau_count", "cooldown_count")


@pytest.mark.slow
def test_reduce_on_plateau_carries_its_cut_into_another_plateau_and_is_reported_elsewhere():
  """Converting kept reduce_on_plateau's initial scale 1, best value inf and counts, and
  reported nothing: the learning rate it had cut to 1/16 came back whole (the next update
  16 times the uninterrupted run's). Into another optimizer with one, in the same
  sub-optimizer, they carry over (its losses towards the next check start fresh with its
  count, reported); into one without, they are reported dropped; out of one without, the
  new optimizer's are reported initialised."""
  source, grads = _plateaued()
  converted, report = t5x_optim.convert_state(source, OptaxWrapper(_plateau(optax.adam(1e-2))))
  for name in _PLATEAU:
    np.testing.assert_array_equal(
      getattr(converted.state.param_states[1], name), getattr(source.state.param_states[1], name)
    )
  assert any("ReduceLROnPlateauState" in line and "scale" in line for line in report.converted)
  assert any("ReduceLROnPlateauState.avg_value" in line for line in report.initialised), report
  want = source.apply_gradient(grads, value=jnp.asarray(6.0)).target["w"]
  _assert_close(converted.apply_gradient(grads, value=jnp.asarray(6.0)).target["w"], want)
  _, report = t5x_optim.convert_state(source, OptaxWrapper(optax.adam(1e-2)))
  assert any(
    "ReduceLROnPlateauState" in line and "learning-rate scale" in line for line in report.dropped
  ), report
  adam = OptaxWrapper(optax.adam(1e-2)).create({"w": jnp.ones(3)}).apply_gradient(grads)
  _, report = t5x_optim.convert_state(adam, OptaxWrapper(_plateau(optax.adam(1e-2))))
  assert any(
    "ReduceLROnPlateauState" in line and "learning-rate scale" in line
    for line in report.initialised
  ), report


@pytest.mark.slow
def test_schedule_free_averaging_weights_are_reported_initialised_and_dropped():
  """Schedule-free's weight_sum and max_lr (the weights of its average so far) kept their
  initial values unreported when converted into it, and were dropped unreported out of it;
  its b1 is a setting, in neither list."""
  params, grads = {"w": jnp.ones(3)}, {"w": jnp.full(3, 0.5)}
  adam = OptaxWrapper(optax.adam(1e-2)).create(params).apply_gradient(grads)
  free = OptaxWrapper(optax.contrib.schedule_free_adamw(1e-2))
  converted, report = t5x_optim.convert_state(adam, free, missing="init")
  for name in ("weight_sum", "max_lr"):
    assert any(f"ScheduleFreeState.{name}" in line for line in report.initialised), report
  _, report = t5x_optim.convert_state(
    converted.apply_gradient(grads), OptaxWrapper(optax.adam(1e-2)), missing="init"
  )
  for name in ("weight_sum", "max_lr"):
    assert any(f"ScheduleFreeState.{name}" in line for line in report.dropped), report
  assert not any("ScheduleFreeState.b1" in line for line in (*report.dropped, *report.initialised))


def test_multi_optimizer_sub_states_are_converted():
  filters = [t5x_optim.PathFilter("kernel"), t5x_optim.PathFilter("bias")]
  target = t5x_optim.MultiOptimizer(
    [(filters[0], optimizers.adam(1e-3)), (filters[1], optimizers.lion(1e-3))]
  )
  new, report = t5x_optim.convert_state(_optimizer(BY_NAME["adam"]), target)
  kernel_adam = new.state.param_states[0].param_states[0]
  bias_lion = new.state.param_states[1].param_states[0]
  adam = BY_NAME["adam"].stored(M, V, T)[0]
  _assert_close(kernel_adam.mu["dense"]["kernel"], adam.mu["dense"]["kernel"])
  _assert_close(kernel_adam.nu["dense"]["kernel"], adam.nu["dense"]["kernel"])
  _assert_close(bias_lion.mu["dense"]["bias"], M["dense"]["bias"] * _decay(0.99, T))
  assert not report.initialised
  # And back: MultiOptimizer as the source. Lion kept no nu for the bias, so Adam starts the
  # bias's moments fresh (a mu is carried only with its nu).
  back, report = t5x_optim.convert_state(new, OptaxWrapper(optax.adam(1e-3)), missing="init")
  _assert_close(back.state.param_states[0].mu["dense"]["kernel"], adam.mu["dense"]["kernel"])
  _assert_close(back.state.param_states[0].mu["dense"]["bias"], jnp.zeros(6))
  assert report.initialised == (
    "0 (ScaleByAdamState).mu (carried only with nu): 1 params without a source value "
    "(e.g. dense/bias)",
    "0 (ScaleByAdamState).nu: 1 params without a source value (e.g. dense/bias)",
  )


# ------------------------------------------------- step counts of the states


@pytest.mark.parametrize("nesterov", [False, True], ids=["momentum", "nesterov"])
@pytest.mark.parametrize("target", ["adam", "sgd_momentum", "lion"])
@pytest.mark.slow
def test_a_fresh_sgd_momentum_converts_to_the_targets_fresh_state(nesterov, target):
  """At step 0 the trace holds no gradient: the new state is the target's initial one."""
  source = OptaxWrapper(optax.sgd(0.1, momentum=0.9, nesterov=nesterov)).create(PARAMS)
  new, _ = t5x_optim.convert_state(source, OptaxWrapper(BY_NAME[target].make()), missing="init")
  tx = BY_NAME[target].make()
  fresh = tx.init(PARAMS)
  _assert_close(new.state.param_states, fresh, f"{target}: ")
  updates, _ = tx.update(M, fresh, PARAMS)
  _assert_close(new.apply_gradient(M).target, optax.apply_updates(PARAMS, updates))


def _accumulating_sgd():
  return optax.MultiSteps(optax.sgd(0.1, momentum=0.9), every_k_schedule=4)


@pytest.mark.slow
def test_multisteps_states_convert_over_their_inner_updates():
  """8 gradients of 1 in MultiSteps(every 4): 2 inner updates, trace 1 + 0.9, E[g] 1."""
  params, grads = {"w": jnp.zeros(3)}, {"w": jnp.ones(3)}
  tx = _accumulating_sgd().gradient_transformation()
  state, p = tx.init(params), params
  for _ in range(8):
    updates, state = tx.update(grads, state, p)
    p = optax.apply_updates(p, updates)
  source = OptaxWrapper(tx).create(params)
  source = source.replace(target=p, state=t5x_optim.OptimizerState(jnp.int32(8), state))
  lion, report = t5x_optim.convert_state(source, OptaxWrapper(optax.lion(1e-3)), missing="init")
  assert int(lion.state.param_states[0].count) == 2
  _assert_close(lion.state.param_states[0].mu, {"w": jnp.full(3, 1 - 0.99**2)})
  assert report.converted == (
    "0 (ScaleByLionState).mu: 1 params, from inner_opt_state/0 (TraceState)",
  )
  back, _ = t5x_optim.convert_state(lion, OptaxWrapper(tx), missing="init")
  converted = back.state.param_states
  assert (int(converted.mini_step), int(converted.gradient_step)) == (0, 2)
  _assert_close(converted.inner_opt_state[0].trace, {"w": jnp.full(3, 1.9)})
  for _ in range(4):  # and it goes on as optax's own loop does
    updates, state = tx.update(grads, state, p)
    p = optax.apply_updates(p, updates)
    back = back.apply_gradient(grads)
  _assert_close(back.target, p)


def test_a_plain_state_converts_into_multisteps_over_its_own_count():
  """Adam at count 5 into MultiSteps(sgd): the inner trace and gradient_step count 5 updates."""
  new, _ = t5x_optim.convert_state(
    _optimizer(BY_NAME["adam"]), OptaxWrapper(_accumulating_sgd()), missing="init"
  )
  state = new.state.param_states
  assert (int(state.mini_step), int(state.gradient_step)) == (0, T)
  _assert_close(state.inner_opt_state[0].trace, _scaled(M, _decay(0.9, T) / 0.1))


_LINEAR = optax.linear_schedule(1.0, 0.0, 100)


@jax.jit
def _step(optimizer: Any, grads: Any) -> Any:
  """One `apply_gradient`, jitted: stepped eagerly, the `lax.cond` of a MultiSteps or an
  apply_if_finite traces and compiles its branches again at every call."""
  return optimizer.apply_gradient(grads)


def _after(tx, params, n):
  """`tx` over `n` gradients from `params`, as an `OptaxWrapper` optimizer."""
  opt = OptaxWrapper(tx).create(params)
  for i in range(n):
    opt = _step(opt, jax.tree.map(lambda p, i=i: jnp.sin(p * (i + 1)) + 0.1, opt.target))
  return opt


def _schedule_counts(state):
  """The counts of the scale_by_schedule and inject_hyperparams states in `state`."""
  kinds = (
    optax.ScaleByScheduleState,
    optax.InjectHyperparamsState,
    optax.InjectStatefulHyperparamsState,
  )
  nodes = [n for kind in kinds for n in _of_type(state, kind)]
  return [int(n.count) for n in nodes]


@pytest.mark.parametrize(
  "target",
  [
    lambda: optax.adamw(_LINEAR),
    lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=_LINEAR),
    lambda: optax.MultiSteps(optax.adamw(_LINEAR), every_k_schedule=1),
  ],
  ids=["adamw", "inject_hyperparams", "multisteps_k1"],
)
@pytest.mark.slow
def test_schedules_go_on_from_the_updates_a_multisteps_source_applied(target):
  """Out of MultiSteps(every 4) after 40 gradients (10 updates), plain adamw's schedule was
  set to 40 (lr 0.6 where the run was at 0.9: 30 updates of its schedule skipped) while
  Adam's moments counted 10; its schedules now go on from the 10 updates, as the
  uninterrupted run's, and the optimizer's step stays 40."""
  params = {"w": jnp.linspace(-1.0, 1.0, 4)}
  source = _after(optax.MultiSteps(optax.adamw(_LINEAR), every_k_schedule=4), params, 40)
  assert int(source.state.param_states.gradient_step) == 10
  new, _ = t5x_optim.convert_state(source, OptaxWrapper(target()))
  assert int(new.state.step) == 40
  assert _schedule_counts(new.state.param_states)
  assert set(_schedule_counts(new.state.param_states)) == {10}
  (adam,) = _of_type(new.state.param_states, optax.ScaleByAdamState)
  assert int(adam.count) == 10


_NEXT_GRADS = {"w": jnp.linspace(0.5, -0.5, 4)}


def _uninterrupted(tx, state, params, grads):
  """The params after `tx`'s next update from `state`: the run a conversion goes on from."""
  updates, _ = tx.update(grads, state, params)
  return optax.apply_updates(params, updates)


@pytest.mark.parametrize(
  ("make", "inner"),
  [
    (
      lambda tx: optax.named_chain(("accumulate", optax.MultiSteps(tx, every_k_schedule=4))),
      lambda state: state["accumulate"].inner_opt_state,
    ),
    (
      lambda tx: optax.chain(optax.MultiSteps(tx, every_k_schedule=4), optax.clip(10.0)),
      lambda state: state[0].inner_opt_state,
    ),
  ],
  ids=["named_chain", "before_clip"],
)
@pytest.mark.slow
def test_schedules_go_on_from_the_updates_of_a_multisteps_inside_a_chain(make, inner):
  """Out of MultiSteps(every 4) in a named_chain or before another transformation, after 40
  gradients (10 updates), adamw's schedule was set to 40; it is now at 10, and the next
  update is the one adamw makes from the old inner state."""
  params = {"w": jnp.linspace(-1.0, 1.0, 4)}
  source = _after(make(optax.adamw(_LINEAR)), params, 40)
  new, _ = t5x_optim.convert_state(source, OptaxWrapper(optax.adamw(_LINEAR)))
  assert _schedule_counts(new.state.param_states) == [10]
  old = inner(source.state.param_states)
  expected = _uninterrupted(optax.adamw(_LINEAR), old, source.target, _NEXT_GRADS)
  _assert_close(new.apply_gradient(_NEXT_GRADS).target, expected)


_TWO_PARAMS = {"a": jnp.linspace(-1.0, 1.0, 4), "b": jnp.linspace(0.0, 1.0, 3)}
_TWO_GRADS = {"a": jnp.linspace(0.5, -0.5, 4), "b": jnp.linspace(-0.3, 0.3, 3)}


def _partitioned(tx_a, tx_b):
  return OptaxWrapper(optax.multi_transform({"a": tx_a, "b": tx_b}, {"a": "a", "b": "b"}))


def _grouped(tx_a, tx_b):
  return t5x_optim.MultiOptimizer(
    [
      (t5x_optim.PathFilter("a"), OptaxWrapper(tx_a)),
      (t5x_optim.PathFilter("b"), OptaxWrapper(tx_b)),
    ]
  )


def _inner_partitions(state):
  """Per partition of a `multi_transform` state, the adamw state: inside its MultiSteps too."""
  inner = {key: masked.inner_state for key, masked in state.inner_states.items()}
  return {key: getattr(node, "inner_opt_state", node) for key, node in inner.items()}


def _inner_groups(state):
  """Per group of a `MultiOptimizer` state, the adamw state: inside its MultiSteps too."""
  inner = {key: sub.param_states for key, sub in zip("ab", state, strict=True)}
  return {key: getattr(node, "inner_opt_state", node) for key, node in inner.items()}


def _only(state, key):
  """`state` (adamw's, over both params or one) with its per-param trees over `key` alone."""
  return jax.tree.map(
    lambda node: {key: node[key]} if isinstance(node, dict) else node,
    state,
    is_leaf=lambda x: isinstance(x, dict),
  )


@pytest.mark.parametrize(
  ("make", "inner"),
  [(_partitioned, _inner_partitions), (_grouped, _inner_groups)],
  ids=["multi_transform", "multi_optimizer"],
)
@pytest.mark.slow
def test_each_partitions_schedules_go_on_from_the_updates_its_moments_had(make, inner):
  """MultiSteps(every 4) over partition or group 'a' only, after 40 gradients: the new
  schedules of both were set to 40, 'a''s 30 updates ahead of its 10; now 'a''s is at 10,
  'b''s at 40, and each param's next update is the one adamw makes from its old state."""
  source = make(optax.MultiSteps(optax.adamw(_LINEAR), every_k_schedule=4), optax.adamw(_LINEAR))
  source = source.create(_TWO_PARAMS)
  for i in range(40):
    source = _step(source, jax.tree.map(lambda p, i=i: jnp.sin(p * (i + 1)), _TWO_PARAMS))
  new, _ = t5x_optim.convert_state(source, make(optax.adamw(_LINEAR), optax.adamw(_LINEAR)))
  states = inner(new.state.param_states)
  assert {key: _schedule_counts(state) for key, state in states.items()} == {"a": [10], "b": [40]}
  got = new.apply_gradient(_TWO_GRADS).target
  for key, old in inner(source.state.param_states).items():
    part = lambda tree, key=key: {key: tree[key]}  # noqa: E731
    expected = _uninterrupted(
      optax.adamw(_LINEAR), _only(old, key), part(source.target), part(_TWO_GRADS)
    )
    _assert_close(part(got), expected, what=f"{key}: ")


@pytest.mark.parametrize(
  "inner", [lambda: optax.adamw(_LINEAR), lambda: optax.sgd(_LINEAR)], ids=["adamw", "sgd"]
)
@pytest.mark.slow
def test_schedules_go_on_from_the_updates_of_the_innermost_of_nested_multisteps(inner):
  """MultiSteps(every 3) around MultiSteps(every 2), after 36 gradients: the outer one made 12
  updates of the inner one, which made 6 of its optimizer, the updates that reached the
  params. The new schedule (set to 12 where no state holds moments) is at 6, and the next
  update is the one the inner optimizer makes from its old state."""
  params = {"w": jnp.linspace(-1.0, 1.0, 4)}
  nested = optax.MultiSteps(optax.MultiSteps(inner(), every_k_schedule=2), every_k_schedule=3)
  source = _after(nested, params, 36)
  outer = source.state.param_states
  assert (int(outer.gradient_step), int(outer.inner_opt_state.gradient_step)) == (12, 6)
  new, _ = t5x_optim.convert_state(source, OptaxWrapper(inner()))
  assert _schedule_counts(new.state.param_states) == [6]
  old = outer.inner_opt_state.inner_opt_state
  expected = _uninterrupted(inner(), old, source.target, _NEXT_GRADS)
  _assert_close(new.apply_gradient(_NEXT_GRADS).target, expected)


@pytest.mark.parametrize(
  "inner",
  [
    lambda: optax.adamw(_LINEAR),
    lambda: optax.sgd(_LINEAR, momentum=0.9),
    lambda: optax.sgd(_LINEAR),
  ],
  ids=["adamw", "sgd_momentum", "sgd"],
)
@pytest.mark.parametrize("guarded", [False, True], ids=["into_inner", "into_guarded"])
@pytest.mark.slow
def test_schedules_go_on_from_the_updates_apply_if_finite_let_through(inner, guarded):
  """`apply_if_finite` over 12 gradients, 2 of them non-finite: it skipped those, so its inner
  optimizer made 10 updates. The new schedules were set to 12; they are at 10, and the next
  update is the one the inner optimizer (behind the carried guard) makes from its old state."""
  params = {"w": jnp.linspace(-1.0, 1.0, 4)}
  guard = lambda tx: optax.apply_if_finite(tx, max_consecutive_errors=5)  # noqa: E731
  source = OptaxWrapper(guard(inner())).create(params)
  for i in range(12):
    grads = jax.tree.map(lambda p, i=i: jnp.sin(p * (i + 1)) + 0.1, source.target)
    if i in (3, 7):
      grads = jax.tree.map(lambda g: g * jnp.nan, grads)
    source = _step(source, grads)
  old = source.state.param_states
  assert (int(source.state.step), int(old.total_notfinite)) == (12, 2)
  assert _schedule_counts(old) == [10]
  target = guard(inner()) if guarded else inner()
  new, _ = t5x_optim.convert_state(source, OptaxWrapper(target))
  assert _schedule_counts(new.state.param_states) == [10]
  expected = _uninterrupted(target, old if guarded else old.inner_state, source.target, _NEXT_GRADS)
  _assert_close(new.apply_gradient(_NEXT_GRADS).target, expected)


@pytest.mark.slow
def test_a_multisteps_target_schedule_goes_on_from_a_plain_sources_updates():
  """A plain source's 12 updates are the MultiSteps target's 12 inner updates: its schedule
  is where the plain run's is."""
  params = {"w": jnp.linspace(-1.0, 1.0, 4)}
  source = _after(optax.adamw(_LINEAR), params, 12)
  target = OptaxWrapper(optax.MultiSteps(optax.adamw(_LINEAR), every_k_schedule=4))
  new, _ = t5x_optim.convert_state(source, target)
  assert (int(new.state.step), int(new.state.param_states.gradient_step)) == (12, 12)
  assert _schedule_counts(new.state.param_states) == [12]


def _warm_up(step):
  return 0.01 * step


def _kernel_warm_up_bias_sgd():
  """Kernels: a triple that reads its own step (a warm-up); biases: SGD with momentum."""
  return t5x_optim.MultiOptimizer(
    [
      (t5x_optim.PathFilter("kernel"), optimizers.example_lib_sgd(step_size=_warm_up)),
      (t5x_optim.PathFilter("bias"), optimizers.sgd(0.1, momentum=0.9)),
    ]
  )


def _sub_steps(optimizer):
  return [int(sub.step) for sub in optimizer.state.param_states]


@pytest.mark.slow
def test_conversion_into_a_multi_optimizer_gives_its_sub_optimizers_the_step(tmp_path):
  """A sub-optimizer steps with the MultiOptimizer (T5X passes it the outer step).

  After a conversion, a state-dict round trip and a restore with `convert_from=`
  alike, the warm-up goes on at step T (0.05) instead of starting again at 0.
  """
  source = _optimizer(BY_NAME["sgd_momentum"])
  target = _kernel_warm_up_bias_sgd()
  new, report = t5x_optim.convert_state(source, target, source_hparams=HPARAMS)
  assert not report.initialised, report
  assert int(new.state.step) == T and _sub_steps(new) == [T, T]
  trace = BY_NAME["sgd_momentum"].stored(M, V, T)[0].trace
  kernel = PARAMS["dense"]["kernel"] - _warm_up(T) * M["dense"]["kernel"]
  bias = PARAMS["dense"]["bias"] - 0.1 * (M["dense"]["bias"] + 0.9 * trace["dense"]["bias"])
  expected = {"dense": {"kernel": kernel, "bias": bias}}
  _assert_close(new.apply_gradient(M).target, expected)
  round_trip = target.create(PARAMS).restore_state(new.state_dict())
  assert _sub_steps(round_trip) == [T, T]
  _assert_close(round_trip.apply_gradient(M).target, expected)
  with t5x_optim.Checkpointer(tmp_path, async_save=False) as checkpointer:
    checkpointer.save(T, source)
    restored = checkpointer.restore(
      target.create(PARAMS), convert_from=OptaxWrapper(BY_NAME["sgd_momentum"].make())
    )
  assert _sub_steps(restored) == [T, T]
  _assert_close(restored.apply_gradient(M).target, expected)


@pytest.mark.slow
def test_a_multi_optimizer_in_t5xs_layout_behaves_the_same_after_a_state_dict_round_trip():
  """T5X's layout (per-param sub-states) stores no sub step: restored, each is the outer step.

  The converted state has the same, so it steps as its checkpoint does.
  """
  target = t5x_optim.MultiOptimizer(
    [
      (t5x_optim.PathFilter("kernel"), optimizers.example_lib_momentum(_warm_up, mass=0.9)),
      (t5x_optim.PathFilter("bias"), optimizers.example_lib_momentum(0.1, mass=0.9)),
    ]
  )
  new, _ = t5x_optim.convert_state(_optimizer(BY_NAME["adam"]), target, missing="init")
  state_dict = new.state_dict()
  assert "step" not in state_dict["state"]["param_states"]  # T5X's layout: no sub steps
  round_trip = target.create(PARAMS).restore_state(state_dict)
  assert _sub_steps(new) == _sub_steps(round_trip) == [T, T]
  kernel = PARAMS["dense"]["kernel"] - _warm_up(T) * M["dense"]["kernel"]  # fresh velocity
  expected = {
    "dense": {"kernel": kernel, "bias": PARAMS["dense"]["bias"] - 0.1 * M["dense"]["bias"]}
  }
  for optimizer in (new, round_trip):
    _assert_close(optimizer.apply_gradient(M).target, expected)


def test_a_triples_moments_are_neither_zeroed_nor_dropped_without_a_word():
  """A `jax.example_libraries` state is plain dicts of arrays: no state type converts it.

  Into such a target, its moments are refused (or reported initialised with
  ``missing='init'``); out of such a source, they are reported dropped.
  """
  source = _optimizer(BY_NAME["adam"])
  with pytest.raises(ValueError, match=r"dense/bias/m, dense/bias/v, dense/kernel/m"):
    t5x_optim.convert_state(source, optimizers.example_lib_adam(0.01))
  new, report = t5x_optim.convert_state(source, optimizers.example_lib_adam(0.01), missing="init")
  assert int(new.state.step) == T
  assert [entry.split(":")[0] for entry in report.initialised] == ["<root>"], report
  triple = optimizers.example_lib_adam(0.01).create(PARAMS).apply_gradient(M)
  _, report = t5x_optim.convert_state(triple, optimizers.adam(0.01), missing="init")
  assert len(report.dropped) == 1 and "dense/kernel/m" in report.dropped[0], report


@pytest.mark.parametrize(
  ("param", "grad", "match"),
  [
    (7e4, 1.0, r"w: the source's params .*7e\+04.* float16"),
    (1.0, 1e4, r"nu of param 'w' .*1e\+05.* float16"),
  ],
)
def test_values_beyond_a_float16_targets_range_are_refused(param, grad, match):
  """Cast, they would be inf: a float32 source's params, or a moment (adam's nu = 1e5)."""
  source = optimizers.adam(1e-3).create({"w": jnp.full((4, 8), param)})
  source = source.apply_gradient({"w": jnp.full((4, 8), grad)})
  target = optimizers.adam(1e-3).create({"w": jnp.ones((4, 8), jnp.float16)})
  with pytest.raises(ValueError, match=match):
    t5x_optim.convert_state(source, target)


@pytest.mark.slow
def test_the_report_counts_each_adafactor_field_for_the_params_it_holds():
  """A factored kernel's v and an unfactored bias's v_row and v_col are (1,) placeholders."""
  params = {"kernel": jnp.ones((4, 8)), "bias": jnp.ones((8,))}
  source = OptaxWrapper(optax.adam(1e-3)).create(params).apply_gradient(params)
  _, report = t5x_optim.convert_state(
    source, OptaxWrapper(optax.adafactor(1e-3, min_dim_size_to_factor=2))
  )
  assert report.converted == tuple(
    f"0 (FactoredState).{field}: 1 params, from 0 (ScaleByAdamState)"
    for field in ("v_row", "v_col", "v")
  )


def test_a_state_without_converter_is_named():
  with pytest.raises(ValueError, match=r"ScaleByBeliefState\.mu.*no converter"):
    t5x_optim.convert_state(_optimizer(BY_NAME["adam"]), OptaxWrapper(optax.adabelief(1e-3)))
  new, report = t5x_optim.convert_state(
    _optimizer(BY_NAME["adam"]), OptaxWrapper(optax.adabelief(1e-3)), missing="init"
  )
  assert any("ScaleByBeliefState.nu" in line for line in report.initialised), report
  _assert_close(new.state.param_states[0].mu, ZERO)
  source = OptaxWrapper(optax.adabelief(1e-3)).create(PARAMS)
  _, report = t5x_optim.convert_state(source, OptaxWrapper(optax.adam(1e-3)), missing="init")
  assert report.dropped == ("0/mu (ScaleByBeliefState.mu)", "0/nu (ScaleByBeliefState.nu)")


_STEP = jax.jit(wrapper_step)


_NOT_BIT_FOR_BIT = {
  "galore": "its projectors are recomputed at its count 0, and its moments in their space fresh",
  "noisy_sgd": "the random key of its noise is drawn fresh",
  "add_noise": "the random key of its noise is drawn fresh",
  "multisteps": "the gradients accumulated towards its next update start empty",
  "multisteps_skip_not_finite": "the gradients accumulated towards its next update start empty",
}
"""Table optimizers that, converted into themselves, do not go on bit for bit, and why."""


@pytest.mark.parametrize(
  "case",
  [
    case if case.name in ("lars", "madgrad") else pytest.param(case, marks=pytest.mark.slow)
    for case in TABLE
  ],
  ids=repr,
)
def test_every_optimizer_converted_into_itself_goes_on_bit_for_bit(case):
  """Converted into itself, Adam's moments went over through their estimates (an ulp off:
  ``mu / c * c``), and what a converter cannot express started fresh: lars's and rmsprop's
  momentum (a trace after another state), signum's EMA, Adan's gradient differences, AMSGrad's
  maximum. A state read and written with the same settings over the same clock now goes over
  as it is, as a state without a converter does (MADGRAD's sum of gradients, L-BFGS's
  memory), and the run goes on bit for bit, but where a state is fresh by design
  (`_NOT_BIT_FOR_BIT`)."""
  old = OptaxWrapper(case.make()).create(initial_params(case))
  for _ in range(3):
    old = _STEP(old)
  new, report = t5x_optim.convert_state(old, OptaxWrapper(case.make()), missing="init")
  if case.name in _NOT_BIT_FOR_BIT:
    return
  lacking = [line for line in report.initialised if "by design" not in line]
  assert lacking == (
    ["0/found_nan (ZeroNansState.found_nan): at the initial value (no converter sets it)"]
    if case.name == "zero_nans"
    else []
  ), report
  for _ in range(3):
    old, new = _STEP(old), _STEP(new)
  assert tree_equal(new.target, old.target) and tree_equal(new.state, old.state), report


@pytest.mark.parametrize(
  "make, other, hparams, field",
  [
    (lambda: optax.adam(0.1), lambda: optax.adam(0.1, b1=0.8), {"b1": 0.8}, "mu"),
    (lambda: optax.lars(0.1), lambda: optax.lars(0.1, momentum=0.8), {"momentum": 0.8}, None),
  ],
  ids=["adam", "lars"],
)
def test_a_state_with_other_settings_is_converted_not_carried(make, other, hparams, field):
  """Another setting its converter reads (Adam's b1, lars's momentum, given as the target's
  hyper-parameters, as `--init_from` gives the config's): the state goes through its
  converter (Adam's moments rescaled, lars's trace fresh), not over as it is."""
  params = {"w": jnp.linspace(-1.0, 1.0, 6)}
  old = OptaxWrapper(make()).create(params)
  for scale in (1.0, -2.0):
    old = _step(old, {"w": jnp.cos(params["w"]) * scale})
  new, report = t5x_optim.convert_state(
    old, OptaxWrapper(other()), target_hparams=hparams, missing="init"
  )
  assert not [line for line in report.converted if "as it is" in line], report
  if field is not None:
    assert any(line.startswith(f"0 (ScaleByAdamState).{field}") for line in report.converted)
  else:
    assert any("TraceState" in line for line in report.initialised), report


def test_states_of_their_type_go_on_across_storages_and_places():
  """adabelief's moments go over as they are from float32 into 8 bits and back, from one
  `MultiOptimizer` group into the group over the same params listed elsewhere, and from a
  chain's first place into a state of its own."""
  params = {"w": jnp.linspace(-1.0, 1.0, 256).reshape(2, 128), "v": jnp.linspace(0.5, 2.0, 3)}
  grads = jax.tree.map(lambda p: jnp.cos(3 * p), params)
  float32 = OptaxWrapper(optax.adabelief(1e-2)).create(params)
  float32 = float32.apply_gradient(grads).apply_gradient(grads)
  eight = OptaxWrapper(t5x_optim.low_precision(optax.adabelief(1e-2), "8bit", min_size=0))
  encoded, report = t5x_optim.convert_state(float32, eight)
  assert report.converted == (
    "inner_state/0 (ScaleByBeliefState): as it is, from 0, a state of its type",
  ), report
  assert (report.initialised, report.dropped) == ((), ())
  back, report = t5x_optim.convert_state(encoded, OptaxWrapper(optax.adabelief(1e-2)))
  assert report.converted == (
    "0 (ScaleByBeliefState): as it is, from inner_state/0, a state of its type",
  ), report
  decoded = t5x_optim.low_precision_to_float32(encoded.state.param_states)
  assert tree_equal(back.state.param_states, decoded)
  nu = float32.state.param_states[0].nu
  np.testing.assert_allclose(back.state.param_states[0].nu["w"], nu["w"], rtol=0.05)
  assert int(back.state.param_states[0].count) == 2

  def groups(*names):
    return t5x_optim.MultiOptimizer(
      [(t5x_optim.PathFilter(name), OptaxWrapper(optax.adabelief(1e-2))) for name in names]
    )

  old = groups("w", "v").create(params).apply_gradient(grads)
  new, report = t5x_optim.convert_state(old, groups("v", "w"))
  assert len(report.converted) == 2 and not report.initialised, report
  assert tree_equal(new.apply_gradient(grads).target, old.apply_gradient(grads).target)

  chained = OptaxWrapper(optax.chain(optax.scale_by_belief(), optax.scale(-1e-2)))
  old = chained.create(params).apply_gradient(grads)
  new, report = t5x_optim.convert_state(old, OptaxWrapper(optax.scale_by_belief()))
  assert report.converted == ("<root> (ScaleByBeliefState): as it is, from 0, a state of its type",)


def test_a_state_of_its_type_in_other_shapes_or_twice_starts_fresh():
  """L-BFGS with a shorter memory holds its memory in other shapes, and a chain of two
  adabelief scalings holds two states of one type over the same params, of which either
  could be either: each starts fresh, reported (refused unless told)."""
  params = {"w": jnp.linspace(-1.0, 1.0, 6)}
  grads = {"w": jnp.sin(3 * params["w"])}
  old = OptaxWrapper(optax.lbfgs(memory_size=10)).create(params)
  with pytest.raises(ValueError, match=r"0/diff_params_memory \(ScaleByLBFGSState.*no converter"):
    t5x_optim.convert_state(old, OptaxWrapper(optax.lbfgs(memory_size=5)))
  twice = lambda: OptaxWrapper(optax.chain(optax.scale_by_belief(), optax.scale_by_belief()))  # noqa: E731
  old = twice().create(params).apply_gradient(grads)
  new, report = t5x_optim.convert_state(old, twice(), missing="init")
  assert report.converted == () and len(report.initialised) == 4, report
  for state in new.state.param_states:
    assert tree_equal((state.mu, state.nu), ({"w": jnp.zeros(6)},) * 2)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["acc"], meta_fields=[])
@dataclasses.dataclass
class _PlainState:
  """A state kept as kfac-jax keeps its own: a plain dataclass, without flax's `replace`."""

  acc: Any


def test_a_plain_dataclass_state_without_converter_is_named_or_initialised():
  tx = optax.GradientTransformation(
    lambda params: _PlainState(jax.tree.map(jnp.zeros_like, params)),
    lambda updates, state, params=None: (updates, state),
  )
  with pytest.raises(ValueError, match=r"acc \(_PlainState\.acc\): no converter"):
    t5x_optim.convert_state(_optimizer(BY_NAME["adam"]), OptaxWrapper(tx))
  new, report = t5x_optim.convert_state(
    _optimizer(BY_NAME["adam"]), OptaxWrapper(tx), missing="init"
  )
  assert report.initialised == ("acc (_PlainState.acc): no converter",)
  assert isinstance(new.state.param_states, _PlainState)
  _assert_close(new.state.param_states.acc, ZERO)


def test_two_sources_for_one_moment_are_refused():
  adam = BY_NAME["adam"]
  source = OptaxWrapper(optax.chain(adam.make(), adam.make())).create(PARAMS)
  with pytest.raises(ValueError, match=r"'dense/bias' has a mu in two source states: '0/0"):
    t5x_optim.convert_state(source, OptaxWrapper(optax.adam(1e-3)))


class _Avg(NamedTuple):
  avg: Any


def test_registry_refuses_duplicates_and_takes_user_converters():
  with pytest.raises(ValueError, match="already registered"):
    t5x_optim.register_state_converter(optax.ScaleByAdamState, read=lambda s, c: {})
  with pytest.raises(ValueError, match="needs read, write or both"):
    t5x_optim.register_state_converter(_Avg)
  t5x_optim.register_state_converter(
    _Avg,
    read=lambda s, ctx: {"mu": s.avg},
    write=lambda t, m, ctx: _Avg(m.fill(t.avg, "mu", lambda v, leaf, p: v)),
  )
  tx = optax.GradientTransformation(
    lambda p: _Avg(jax.tree.map(jnp.zeros_like, p)), lambda u, s, p=None: (u, s)
  )
  new, _ = t5x_optim.convert_state(_optimizer(BY_NAME["lion"]), OptaxWrapper(tx))
  _assert_close(new.state.param_states.avg, M)
  assert t5x_optim.registered_converters()[_Avg].read is not None


@pytest.mark.parametrize(
  ("source", "message"),
  [
    (
      optax.adamw(1e-3),
      r"got a GradientTransformationExtraArgs, an optax transformation: give "
      r"OptaxWrapper\(it\)",
    ),
    ("adamw", "got a str"),
  ],
)
def test_the_source_of_a_restore_converted_is_a_definition_or_a_state(tmp_path, source, message):
  """An optax transformation given as the optimizer that wrote the checkpoint failed with
  ``AttributeError: ... has no attribute 'create'``."""
  adam = _optimizer(BY_NAME["adam"])
  with t5x_optim.Checkpointer(tmp_path) as checkpointer:
    checkpointer.save(1, adam)
  sgd = OptaxWrapper(optax.sgd(0.1)).create(PARAMS)
  with pytest.raises(TypeError, match=rf"convert_from= / source= .*{message}"):
    t5x_optim.restore_converted(tmp_path, sgd, source=source)
  with t5x_optim.Checkpointer(tmp_path) as checkpointer, pytest.raises(TypeError, match=message):
    checkpointer.restore(sgd, convert_from=source)


@pytest.mark.slow
def test_a_checkpoint_another_optimizer_wrote_is_said_not_to_fit_the_source(tmp_path):
  """A checkpoint adam wrote, restored into sgd with adabelief given as the optimizer that
  wrote it, was said not to fit "the target", whose state had adabelief's ScaleByBeliefState
  (the source's), with the advice to restore it with convert_from=, which was given."""
  params = {"w": jnp.ones((4, 8))}
  sgd, belief = optimizers.sgd(1e-3).create(params), optimizers.adabelief(1e-3)
  with t5x_optim.Checkpointer(tmp_path / "ours", async_save=False) as checkpointer:
    checkpointer.save(1, optimizers.adam(1e-3).create(params))
  t5x_optim.save_t5x_checkpoint(tmp_path / "t5x", optimizers.adam(1e-3).create(params))
  refusals = []
  for restore in (
    lambda: t5x_optim.Checkpointer(tmp_path / "ours").restore(sgd, convert_from=belief),
    lambda: t5x_optim.restore_converted(tmp_path / "ours", sgd, source=belief),
    lambda: t5x_optim.restore_t5x_checkpoint(tmp_path / "t5x", sgd, convert_from=belief),
  ):
    with pytest.raises(ValueError, match="does not fit the source: ") as refused:
      restore()
    refusals.append(str(refused.value))
  for message in refusals:
    assert "whose state has a ScaleByAdamState there, the source's has a ScaleByBeliefState" in (
      message
    ), message
    assert message.endswith(
      "Nothing was restored. The source is the optimizer said to have written the checkpoint, "
      "built over the target's params: give the one that did."
    ), message
    assert "target's has" not in message and "convert_from= to convert" not in message, message


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["ours", "t5x"])
def test_a_source_built_from_its_definition_reads_the_stored_float_dtypes(tmp_path, fmt):
  """bfloat16 params with float32 gradients: optax's adam holds ``mu`` in float32 after its
  first update. The source state built from adam's definition held it in bfloat16, so the
  moment was rounded on its way into a float32 target (with a warning)."""
  params = {"w": jnp.linspace(-1.0, 1.0, 64, dtype=jnp.bfloat16).reshape(8, 8)}
  grads = {"w": 0.3 + jnp.arange(64, dtype=jnp.float32).reshape(8, 8) * 1e-4}
  adam = OptaxWrapper(optax.adam(0.1))
  saved = adam.create(params).apply_gradient(grads)
  mu = saved.state.param_states[0].mu["w"]
  assert mu.dtype == jnp.float32 and not jnp.array_equal(mu, mu.astype(jnp.bfloat16))
  if fmt == "ours":
    with t5x_optim.Checkpointer(tmp_path, async_save=False) as checkpointer:
      checkpointer.save(1, saved)
  else:
    t5x_optim.save_t5x_checkpoint(tmp_path, saved)
  target = OptaxWrapper(optax.adamw(0.1, mu_dtype=jnp.float32)).create(params)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    state, _ = t5x_optim.restore_converted(tmp_path, target, source=adam)
  converted, _ = t5x_optim.convert_state(saved, target)
  restored = state.state.param_states[0].mu["w"]
  assert restored.dtype == jnp.float32
  np.testing.assert_array_equal(restored, converted.state.param_states[0].mu["w"])
  np.testing.assert_array_equal(state.target["w"], saved.target["w"])


@pytest.mark.slow
@pytest.mark.parametrize("scale", [1.0, 1e24])
def test_a_64_bit_source_state_restores_with_x64_off_into_the_checked_dtype(tmp_path, scale):
  """Saved with x64 on, a float64 moment is read with x64 off as float32: values beyond
  float32's range are refused naming the path, not turned into inf (nor does jax warn of
  truncating a float64 request)."""
  with jax.enable_x64(True):
    params = {"w": jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float64)}
    adam = OptaxWrapper(optax.adam(0.1))
    saved = adam.create(params).apply_gradient({"w": jnp.full(8, 0.3 * scale, jnp.float64)})
    with t5x_optim.Checkpointer(tmp_path, async_save=False) as checkpointer:
      checkpointer.save(1, saved)
  target = OptaxWrapper(optax.adamw(0.1)).create({"w": jnp.linspace(-1.0, 1.0, 8)})
  with warnings.catch_warnings():
    warnings.filterwarnings("error", message="Explicitly requested dtype")
    warnings.filterwarnings("ignore", message="Restoring checkpoint step 1 rounds")
    if scale > 1:
      with pytest.raises(ValueError, match=r"'state/param_states/0/nu/w'.*float32"):
        t5x_optim.restore_converted(tmp_path, target, source=adam)
      return
    state, _ = t5x_optim.restore_converted(tmp_path, target, source=adam)
  nu = state.state.param_states[0].nu["w"]
  assert nu.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(nu)))


def test_a_legacy_t5x_source_is_read_once(tmp_path, monkeypatch):
  """Reading the stored dtypes decoded the msgpack file a second time (a version-0 file holds
  its arrays inline, so all of its data)."""
  params = {"w": jnp.ones((4, 8), jnp.bfloat16)}
  adam = OptaxWrapper(optax.adam(0.1))
  t5x_optim.save_t5x_checkpoint(tmp_path, adam.create(params).apply_gradient(params))
  calls = []
  decode = t5x_read.serialization.msgpack_restore
  monkeypatch.setattr(
    t5x_read.serialization, "msgpack_restore", lambda data: calls.append(1) or decode(data)
  )
  target = OptaxWrapper(optax.adamw(0.1, mu_dtype=jnp.float32)).create(params)
  t5x_optim.restore_converted(tmp_path, target, source=adam)
  assert len(calls) == 1


def test_our_source_step_is_resolved_and_opened_once(tmp_path, monkeypatch):
  """The latest step was looked up twice, once for its stored dtypes and once for its data, with
  its headers opened each time: a step saved in between by another process was restored with
  the dtypes read from the one before."""
  params = {"w": jnp.ones((4, 8), jnp.bfloat16)}
  adam = OptaxWrapper(optax.adam(0.1))
  first = adam.create(params).apply_gradient({"w": jnp.ones((4, 8))})
  with t5x_optim.Checkpointer(tmp_path, async_save=False) as checkpointer:
    checkpointer.save(1, first)
  second = first.apply_gradient({"w": jnp.full((4, 8), 2.0)})
  opened, open_stored = [], store.open_stored

  def opening_while_another_saves(item, where, step, wanted):
    opened.append(step)
    if len(opened) == 1:
      with t5x_optim.Checkpointer(tmp_path, async_save=False) as other:
        other.save(2, second)
    return open_stored(item, where, step, wanted)

  monkeypatch.setattr(store, "open_stored", opening_while_another_saves)
  target = OptaxWrapper(optax.adamw(0.1, mu_dtype=jnp.float32)).create(params)
  state, _ = t5x_optim.restore_converted(tmp_path, target, source=adam)
  assert opened == [1]
  converted, _ = t5x_optim.convert_state(first, target)
  np.testing.assert_array_equal(state.target["w"], first.target["w"])
  np.testing.assert_array_equal(
    state.state.param_states[0].mu["w"], converted.state.param_states[0].mu["w"]
  )


def test_stored_leaves_of_a_directory_of_t5x_checkpoints(tmp_path):
  """`Checkpointer.restore` reads a directory of T5X checkpoints; `stored_leaves` said it held
  none."""
  state = OptaxWrapper(optax.adam(0.1)).create({"w": jnp.ones((4, 8), jnp.bfloat16)})
  saved = state.apply_gradient({"w": jnp.ones((4, 8))})
  t5x_optim.save_t5x_checkpoint(tmp_path, saved)
  with t5x_optim.Checkpointer(tmp_path) as checkpointer:
    stored = checkpointer.stored_leaves()
  assert stored[("target", "w")] == jax.ShapeDtypeStruct((4, 8), jnp.bfloat16)
  assert stored[("state", "param_states", "0", "mu", "w")].dtype == jnp.float32
  with t5x_optim.Checkpointer(tmp_path) as checkpointer:
    restored = checkpointer.restore_fitted(lambda stored: jax.eval_shape(lambda: saved))
    assert checkpointer.restored_step == 1
  assert_same_bits((restored.target, restored.state), (saved.target, saved.state))


def test_a_converting_restore_into_other_params_is_said_not_to_fit_the_target(tmp_path):
  """The source optimizer is built over the target's params: a checkpoint of other params
  (another model) was said not to fit the source, with the advice to give the optimizer that
  wrote it, which was given."""
  with t5x_optim.Checkpointer(tmp_path / "ours", async_save=False) as checkpointer:
    checkpointer.save(1, optimizers.adam(1e-3).create({"w": jnp.ones(3)}))
  t5x_optim.save_t5x_checkpoint(tmp_path / "t5x", optimizers.adam(1e-3).create({"w": jnp.ones(3)}))
  target, adam = optimizers.adamw(1e-3).create({"w": jnp.ones(4)}), optimizers.adam(1e-3)
  for restore in (
    lambda: t5x_optim.Checkpointer(tmp_path / "ours").restore(target, convert_from=adam),
    lambda: t5x_optim.restore_t5x_checkpoint(tmp_path / "t5x", target, convert_from=adam),
  ):
    with pytest.raises(ValueError, match="does not fit the target: ") as refused:
      restore()
    assert "the target has float32[4]" in str(refused.value), refused.value
    assert "source" not in str(refused.value), refused.value


def test_a_converting_restore_of_another_model_names_its_params_among_many_problems(tmp_path):
  """A refusal lists a few problems: the params' shape mismatch, listed after 28 problems of
  a wrongly given source's state, was cut off, and the refusal blamed the source."""
  params = {f"p{i}": jnp.ones((4, 8)) for i in range(7)}
  with t5x_optim.Checkpointer(tmp_path, async_save=False) as checkpointer:
    checkpointer.save(1, optimizers.adam(1e-3).create(params))
  target = optimizers.sgd(1e-3).create({**params, "p6": jnp.ones((5, 8))})
  with pytest.raises(ValueError, match="does not fit the target: shape mismatch at 'target/p6'"):
    t5x_optim.restore_converted(tmp_path, target, source=optimizers.adafactor(1e-3))


def test_state_dict_source_needs_its_definition():
  state_dict = _optimizer(BY_NAME["adam"]).state_dict()
  with pytest.raises(ValueError, match="pass source_def="):
    t5x_optim.convert_state(state_dict, OptaxWrapper(optax.lion(1e-3)))
  new, _ = t5x_optim.convert_state(
    state_dict, OptaxWrapper(optax.lion(1e-3)), source_def=OptaxWrapper(optax.adam(1e-3))
  )
  _assert_close(new.state.param_states[0].mu, _scaled(M, _decay(0.99, T)))
  with pytest.raises(ValueError, match=r"does not fit source_def OptaxWrapper"):
    t5x_optim.convert_state(
      state_dict, OptaxWrapper(optax.lion(1e-3)), source_def=OptaxWrapper(optax.sgd(0.1))
    )


# ------------------------------------------------------------ checkpoints

T5X_DATA = pathlib.Path(__file__).parent / "data" / "t5x_adafactor"
T5X_STEP, T5X_LEARNING_RATE = 3, 0.1
AXES = {"dense": {"kernel": ("embed", "mlp"), "bias": ("mlp",)}, "embedding": ("vocab", "embed")}
SHAPES = {"dense": {"kernel": (4, 8), "bias": (8,)}, "embedding": (16, 4)}


def _variables():
  def box(shape, names):
    return nn.LogicallyPartitioned(jnp.zeros(shape, jnp.float32), names)

  return {"params": jax.tree.map(box, SHAPES, AXES, is_leaf=lambda x: isinstance(x, tuple))}


@pytest.fixture(scope="module")
def partitioner():
  mesh = partitioning.create_mesh(shape={"data": 2, "model": 4})
  rules = partitioning.standard_logical_axis_rules(parameter_partitioning_dims=2)
  return partitioning.Partitioner(mesh, rules)


@pytest.fixture(scope="module")
def t5x_expected():
  with np.load(T5X_DATA / "expected.npz") as npz:
    return {tuple(k.split("/")): v for k, v in npz.items()}


def _assert_target_shardings(state, target):
  for (path, leaf), ref in zip(
    jax.tree.flatten_with_path(state)[0], jax.tree.leaves(target), strict=True
  ):
    assert leaf.sharding.is_equivalent_to(ref.sharding, leaf.ndim), (path, leaf.sharding)


@pytest.mark.slow
def test_t5x_legacy_adafactor_checkpoint_restores_into_adamw(partitioner, t5x_expected):
  """Written by T5X's own `adafactor.Adafactor` (beta1=0.9), see data/t5x_adafactor/README.md."""
  target = partitioning.abstract_train_state(partitioner, optimizers.adamw(1e-3), _variables)
  state, report = t5x_optim.restore_converted(
    T5X_DATA / "legacy", target, source_hparams={"learning_rate": T5X_LEARNING_RATE}
  )
  assert not report.initialised, report
  assert int(state.step) == T5X_STEP
  adam = state.param_states[0]
  assert int(adam.count) == T5X_STEP
  for path in traverse_util.flatten_dict(SHAPES, is_leaf=lambda p, x: isinstance(x, tuple)):
    param = t5x_expected[("target", *path)]
    np.testing.assert_array_equal(np.asarray(_at(state.params, path)), param)  # exact
    v_row, v_col, v, m = (
      t5x_expected[("state", "param_states", *path, k)] for k in "v_row v_col v m".split()
    )
    if v_row.shape == (1,):
      nu = v
    else:  # v_row keeps the row dim (d1), v_col the column dim (d0); d0 is the larger one.
      d0 = 1 if v_col.shape[0] == param.shape[1] and v_row.shape[0] == param.shape[0] else 0
      nu = (np.expand_dims(v_row, d0) / v_row.mean()) * np.expand_dims(v_col, 1 - d0)
    scale = T5X_LEARNING_RATE * max(np.sqrt(np.mean(param**2)), 1e-3)
    mu = m * np.sqrt(nu) / scale / (1 - 0.9**T5X_STEP)  # m is an average of updates
    np.testing.assert_allclose(_at(adam.nu, path), nu * (1 - 0.999**T5X_STEP), rtol=1e-5)
    np.testing.assert_allclose(_at(adam.mu, path), mu * (1 - 0.9**T5X_STEP), rtol=1e-5)
  _assert_target_shardings(state, target)


@pytest.mark.slow
def test_a_t5x_checkpoint_without_the_targets_mutables_is_refused(partitioner):
  """T5X's legacy checkpoint holds no flax_mutables: restored into a TrainState that has
  batch statistics, the target's own (init values, or abstract shapes) were kept."""

  def with_stats():
    return {**_variables(), "batch_stats": {"mean": jnp.full((8,), 123.0)}}

  target = partitioning.abstract_train_state(partitioner, optimizers.adamw(1e-3), with_stats)
  with pytest.raises(ValueError, match=r"Missing key .flax_mutables/batch_stats."):
    t5x_optim.restore_converted(
      T5X_DATA / "legacy", target, source_hparams={"learning_rate": T5X_LEARNING_RATE}
    )


def _at(tree, path):
  for key in path:
    tree = tree[key]
  return np.asarray(tree)


@pytest.mark.slow
def test_t5x_legacy_adafactor_without_learning_rate_leaves_mu_fresh(partitioner):
  target = partitioning.abstract_train_state(partitioner, optimizers.adamw(1e-3), _variables)
  with pytest.raises(ValueError, match=r"ScaleByAdamState\)\.mu: 3 params without"):
    t5x_optim.restore_converted(T5X_DATA / "legacy", target)
  with pytest.raises(ValueError, match=r"ScaleByAdamState\)\.mu: 3 params without"):
    t5x_optim.restore_t5x_checkpoint(T5X_DATA / "legacy", target, convert_from=True)
  state, report = t5x_optim.restore_converted(T5X_DATA / "legacy", target, missing="init")
  assert report.converted == ("0 (ScaleByAdamState).nu: 3 params, from dense/bias "
                              "(T5XAdafactorParamState), dense/kernel (T5XAdafactorParamState), "
                              "embedding (T5XAdafactorParamState)",)  # fmt: skip
  assert not np.any(np.asarray(state.param_states[0].mu["embedding"]))


class _T5XAdafactorLayout(t5x_optim.OptimizerDef):
  """A definition whose initial state is laid out as T5X's own Adafactor saved it.

  Each param's `T5XAdafactorParamState` has zeros of the shapes in
  ``expected.npz``: the factored dims and placeholders T5X chose. It only
  initialises: the conversion writes into its state.
  """

  def __init__(self, expected):
    super().__init__(hyper_params=None)
    self._expected = expected

  def init_state(self, params):
    def zeros(path, _):
      keys = ("state", "param_states", *(k.key for k in path))
      return t5x_optim.T5XAdafactorParamState(
        *(jnp.zeros_like(self._expected[(*keys, name)]) for name in ("v_row", "v_col", "v", "m"))
      )

    return t5x_optim.OptimizerState(jnp.int32(0), jax.tree.map_with_path(zeros, params))

  def apply_gradient(self, hyper_params, params, state, grads):
    raise NotImplementedError("only its initial state is used")


@pytest.mark.slow
def test_t5x_legacy_adafactor_factored_over_several_dims_converts_both_ways():
  """A 3-D kernel ('embed', 'heads', 'kv') under T5X's standard logical factor rules: the
  row dims (0,), the column dims (1, 2); T5X's update divides by the reconstructed nu."""
  rng = np.random.default_rng(0)
  params = {"query": {"kernel": jnp.ones((6, 2, 4))}}
  nu = rng.uniform(0.5, 2.0, size=(6, 2, 4)).astype(np.float32)
  v_row, v_col = nu.mean(axis=(1, 2)), nu.mean(axis=0)
  empty = jnp.zeros((1,))
  source = {
    "target": params,
    "state": {"step": 3, "param_states": {"query": {"kernel": {
      "v_row": jnp.asarray(v_row), "v_col": jnp.asarray(v_col), "v": empty, "m": empty,
    }}}},
  }  # fmt: skip
  adamw, _ = t5x_optim.convert_state(source, OptaxWrapper(optax.adamw(1e-3)), missing="init")
  seen = (v_row / v_row.mean())[:, None, None] * v_col[None]
  stored = adamw.state.param_states[0].nu["query"]["kernel"]
  _assert_close(stored / _decay(0.999, 3), seen)

  class Layout(_T5XAdafactorLayout):
    def __init__(self):
      super().__init__({
        ("state", "param_states", "query", "kernel", name): x
        for name, x in {"v_row": v_row, "v_col": v_col, "v": empty, "m": empty}.items()
      })  # fmt: skip

  back, _ = t5x_optim.convert_state(adamw, Layout())
  state = back.state.param_states["query"]["kernel"]
  _assert_close(state.v_row, seen.mean(axis=(1, 2)))
  _assert_close(state.v_col, seen.mean(axis=0))


def test_adafactor_factors_that_fit_no_dims_of_the_param_are_refused_naming_it():
  params = {"query": {"kernel": jnp.ones((6, 2, 4))}}
  empty = jnp.zeros((1,))
  source = {
    "target": params,
    "state": {"step": 3, "param_states": {"query": {"kernel": {
      "v_row": jnp.ones((5,)), "v_col": jnp.ones((2, 4)), "v": empty, "m": empty,
    }}}},
  }  # fmt: skip
  with pytest.raises(ValueError, match=r"query/kernel.*v_row \(5,\) and v_col \(2, 4\)"):
    t5x_optim.convert_state(source, OptaxWrapper(optax.adamw(1e-3)), missing="init")


@pytest.mark.slow
def test_t5x_legacy_adafactor_round_trips_through_adamw_to_t5xs_own_values(
  partitioner, t5x_expected
):
  """T5X's checkpoint -> adamw -> T5X's legacy layout gives back what T5X saved.

  Adafactor's row and column statistics average the same squared gradients, so the
  factoring of the reconstructed second moment returns them, and ``m`` its own value.
  """
  target = partitioning.abstract_train_state(partitioner, optimizers.adamw(1e-3), _variables)
  hparams = {"learning_rate": T5X_LEARNING_RATE}
  adamw, _ = t5x_optim.restore_converted(T5X_DATA / "legacy", target, source_hparams=hparams)
  back, report = t5x_optim.convert_state(
    adamw.optimizer, _T5XAdafactorLayout(t5x_expected), target_hparams=hparams
  )
  assert not report.initialised, report
  assert int(back.state.step) == T5X_STEP
  for path in traverse_util.flatten_dict(SHAPES, is_leaf=lambda p, x: isinstance(x, tuple)):
    state = back.state.param_states
    for key in path:
      state = state[key]
    for name in ("v_row", "v_col", "v", "m"):
      want = t5x_expected[("state", "param_states", *path, name)]
      np.testing.assert_allclose(getattr(state, name), want, rtol=2e-5, err_msg=f"{path} {name}")
  with pytest.raises(ValueError, match=r"m \(needs the learning_rate hyper-parameter\): 1 params"):
    t5x_optim.convert_state(adamw.optimizer, _T5XAdafactorLayout(t5x_expected))


def _runs_ok(script: pathlib.Path) -> None:
  """Runs `script` in a fresh process (with T5X's own code), which prints OK at its end."""
  proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), (
    proc.stdout[-3000:] + proc.stderr[-3000:]
  )


@pytest.mark.slow
@pytest.mark.skipif(not t5x_at_hand(), reason="needs T5X_SRC and T5X's dependencies")
def test_t5x_own_legacy_adafactor_is_a_conversion_target():
  """data/t5x_adafactor/convert_with_t5x.py, in a fresh process with T5X's own code."""
  _runs_ok(T5X_DATA / "convert_with_t5x.py")


@pytest.mark.skipif(not t5x_at_hand(), reason="needs T5X_SRC and T5X's dependencies")
def test_t5x_reads_our_checkpoints_of_adafactor_states():
  """data/t5x_adafactor/read_by_t5x.py, in a fresh process with T5X's own code."""
  _runs_ok(T5X_DATA / "read_by_t5x.py")


@pytest.mark.slow
def test_our_checkpoint_restores_into_another_optimizer_sharded(tmp_path, partitioner):
  source_def = optimizers.adafactor(0.1, min_dim_size_to_factor=2)
  old = partitioning.init_sharded(partitioner, source_def, lambda key: _variables(), None)
  grads = jax.tree.map(lambda p: jnp.full(p.shape, 0.5), old.params)
  old = old.apply_gradient(grads).apply_gradient(grads)
  with t5x_optim.Checkpointer(tmp_path, async_save=False) as checkpointer:
    checkpointer.save(2, old)
  target = partitioning.abstract_train_state(partitioner, optimizers.lion(1e-3), _variables)
  with pytest.raises(ValueError, match="pass source="):
    t5x_optim.restore_converted(tmp_path, target)
  abstract_old = partitioning.abstract_train_state(partitioner, source_def, _variables)
  for source in (source_def, abstract_old):
    with pytest.raises(ValueError, match=r"ScaleByLionState\)\.mu"):
      t5x_optim.restore_converted(tmp_path, target, source=source)
  target = partitioning.abstract_train_state(partitioner, optimizers.rmsprop(1e-3), _variables)
  state, report = t5x_optim.restore_converted(tmp_path, target, source=abstract_old)
  assert not report.initialised
  _assert_close(state.params, old.params)
  # g = 0.5 everywhere: Adafactor's nu is 0.25 (+1e-30), RMSProp stores nu (1 - 0.9^2).
  _assert_close(
    state.param_states[0].nu, jax.tree.map(lambda p: jnp.full(p.shape, 0.25 * 0.19), old.params)
  )
  _assert_target_shardings(state, target)
  assert state.param_states[0].nu["dense"]["kernel"].sharding.spec == jax.sharding.PartitionSpec(
    "data", "model"
  )


@pytest.mark.slow
def test_a_restore_from_a_definition_reads_the_source_sharded_by_its_params(
  tmp_path, partitioner, monkeypatch
):
  """The source state built from a definition was abstract without shardings, so the whole
  old optimizer state was read onto the default device: each leaf now spans the target's
  mesh, a moment sharded as its param, the rest replicated."""
  source_def = optimizers.adamw(1e-3)
  old = partitioning.init_sharded(partitioner, source_def, lambda key: _variables(), None)
  old = old.apply_gradient(jax.tree.map(lambda p: jnp.full(p.shape, 0.5), old.params))
  with t5x_optim.Checkpointer(tmp_path, async_save=False) as checkpointer:
    checkpointer.save(1, old)
  read = []
  read_source = converting._read_source

  def spy(*args, **kwargs):
    read.append(read_source(*args, **kwargs))
    return read[-1]

  monkeypatch.setattr(converting, "_read_source", spy)
  target = partitioning.abstract_train_state(partitioner, optimizers.lion(1e-3), _variables)
  state, _ = t5x_optim.restore_converted(tmp_path, target, source=source_def, missing="init")
  (source,) = read
  for path, leaf in jax.tree.flatten_with_path(source)[0]:
    assert len(leaf.sharding.device_set) == 8, (path, leaf.sharding)
  for moment in source.param_states[0].mu, source.param_states[0].nu:
    for got, param in zip(jax.tree.leaves(moment), jax.tree.leaves(target.params), strict=True):
      assert got.sharding.is_equivalent_to(param.sharding, got.ndim), got.sharding
  assert source.param_states[0].count.sharding.is_fully_replicated
  _assert_close(source.param_states, old.param_states)
  unsharded, _ = t5x_optim.convert_state(
    jax.device_get(old.optimizer), optimizers.lion(1e-3), missing="init"
  )
  _assert_close(state.param_states, unsharded.state.param_states)
  _assert_target_shardings(state, target)


@pytest.mark.slow
def test_params_on_two_meshes_convert_into_a_definition():
  """The new state was placed on the first param's mesh: a param's spec on another mesh was
  refused as naming axes that mesh lacks (and over other devices, placed on the wrong ones)."""
  devices = np.array(jax.devices())
  grid = jax.sharding.Mesh(devices.reshape(2, 4), ("data", "model"))
  for line in (jax.sharding.Mesh(devices, ("x",)), jax.sharding.Mesh(devices[4:], ("data",))):
    params = {
      "a": jax.device_put(
        jnp.ones((8, 8)),
        jax.sharding.NamedSharding(grid, jax.sharding.PartitionSpec("data", "model")),
      ),
      "b": jax.device_put(
        jnp.ones(8),
        jax.sharding.NamedSharding(line, jax.sharding.PartitionSpec(line.axis_names[0])),
      ),
    }
    old = OptaxWrapper(optax.adam(0.1)).create(params)
    new, _ = t5x_optim.convert_state(old, optimizers.lion(1e-3), missing="init")
    want, _ = t5x_optim.convert_state(jax.device_get(old), optimizers.lion(1e-3), missing="init")
    _assert_close(new.state.param_states[0].mu, want.state.param_states[0].mu)


@pytest.mark.slow
def test_a_sharded_state_converts_into_a_definition_sharded_as_create_gives_it(partitioner):
  """The converted state was committed to the default device while its params stayed
  sharded, so a jitted step refused the mix of devices; it is placed as `create` places it."""
  old = partitioning.init_sharded(partitioner, optimizers.adamw(1e-3), lambda: _variables())
  new, _ = t5x_optim.convert_state(old.optimizer, optimizers.lion(1e-3), missing="init")
  created = optimizers.lion(1e-3).create(old.params)
  for got, want in zip(jax.tree.leaves(new.state), jax.tree.leaves(created.state), strict=True):
    assert got.ndim == 0 or got.sharding.is_equivalent_to(want.sharding, got.ndim), (
      got.sharding,
      want.sharding,
    )
  jax.jit(lambda o, g: o.apply_gradient(g))(new, jax.tree.map(jnp.ones_like, new.target))


@pytest.mark.slow
def test_a_zero_size_param_converts_into_a_sharded_state_whose_shards_fit(partitioner):
  """A (0, 16) param sharded over both mesh axes: its converted moments held on every device a
  shard of the global shape (0, 16) where the sharding says (0, 4), so device_get of the
  state (metrics, a look at it) raised "could not broadcast (0,16) into (0,4)"."""

  def variables():
    box = nn.LogicallyPartitioned
    params = {"empty": box(jnp.zeros((0, 16)), ("vocab", "embed"))}
    return {"params": {**params, "w": box(jnp.ones((8, 16)), ("vocab", "embed"))}}

  other = partitioning.Partitioner(
    partitioning.create_mesh(shape={"data": 4, "model": 2}), partitioner.logical_axis_rules
  )
  old = partitioning.init_sharded(partitioner, optimizers.adamw(1e-3), variables)
  old = old.apply_gradient(jax.tree.map(jnp.ones_like, old.params))
  target = partitioning.init_sharded(other, optimizers.lion(1e-3), variables)
  new, _ = t5x_optim.convert_state(old.optimizer, target.optimizer)
  mu = new.state.param_states[0].mu["empty"]
  assert mu.sharding.shard_shape(mu.shape) == (0, 4)
  assert {shard.data.shape for shard in mu.addressable_shards} == {(0, 4)}
  assert jax.device_get(new.state).param_states[0].mu["empty"].shape == (0, 16)


def _buffers(tree):
  """`(path, buffer address)` of every device buffer of the concrete arrays in `tree`."""
  return [
    (jax.tree_util.keystr(path), shard.data.unsafe_buffer_pointer())
    for path, leaf in jax.tree.flatten_with_path(tree)[0]
    if isinstance(leaf, jax.Array) and leaf.size
    for shard in leaf.addressable_shards
  ]


_DEFINITION_TARGETS = [
  pytest.param(lambda: optimizers.adam(1e-3), id="adam"),
  pytest.param(
    lambda: OptaxWrapper(optax.lookahead(optax.adam(1e-3), sync_period=2, slow_step_size=0.5)),
    id="lookahead",
  ),
  pytest.param(
    lambda: OptaxWrapper(t5x_optim.low_precision(optax.adam(1e-3), "8bit", min_size=0)),
    id="8bit",
  ),
]


@pytest.mark.slow
@pytest.mark.parametrize("sharded", [False, True], ids=["one_device", "sharded"])
@pytest.mark.parametrize("make", _DEFINITION_TARGETS)
def test_a_definition_target_gets_its_own_buffers(make, sharded, partitioner):
  """Into a definition the new optimizer kept the source's param buffers (a lookahead target
  one buffer for both copies): a jitted step that donates its state refused the buffer given
  twice, or deleted the source's params. Every leaf is a new buffer, placed as the source's."""
  if sharded:
    source = partitioning.init_sharded(partitioner, optimizers.adam(0.1), _variables).optimizer
  else:
    source = optimizers.adam(0.1).create(PARAMS)
  new, _ = t5x_optim.convert_state(source, make(), missing="init")
  seen = {}
  for path, address in _buffers(new):
    assert address not in seen, f"{path} shares a buffer with {seen[address]}"
    seen[address] = path
  shared = [(path, seen[address]) for path, address in _buffers(source) if address in seen]
  assert not shared, f"the source's leaves share buffers with the result's: {shared}"
  for got, want in zip(
    jax.tree.leaves(t5x_optim.trained_params(new.target)), jax.tree.leaves(source.target)
  ):
    assert got.sharding.is_equivalent_to(want.sharding, got.ndim), (got.sharding, want.sharding)
  step = jax.jit(lambda o, g: o.apply_gradient(g), donate_argnums=0)
  jax.block_until_ready(step(new, jax.tree.map(jnp.ones_like, source.target)))
  assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(source))


def _lookahead(params):
  la = OptaxWrapper(optax.lookahead(optax.adam(0.1), sync_period=3, slow_step_size=0.5))
  old = la.create(optax.LookaheadParams.init_synced(params))
  for _ in range(2):  # Inside a sync period: the fast copy has moved, the slow one has not.
    old = old.apply_gradient(jax.tree.map(lambda p: jnp.full(p.shape, 0.5), params))
  return la, old


@pytest.mark.slow
def test_lookahead_params_convert_to_and_from_one_copy():
  """A lookahead source gives its slow copy (the one for evaluation) and says it dropped the
  fast one; a lookahead target starts with both copies at the source's params."""
  la, old = _lookahead(PARAMS)
  assert not np.allclose(old.target.fast["dense"]["bias"], old.target.slow["dense"]["bias"])
  new, report = t5x_optim.convert_state(old, OptaxWrapper(optax.adamw(1e-3)).create(PARAMS))
  _assert_close(new.target, old.target.slow)
  _assert_close(new.state.param_states[0].nu, old.state.param_states.fast_state[0].nu)
  assert report.dropped == (
    "target/fast (optax.LookaheadParams.fast): the new optimizer trains one copy of the "
    "params, the slow one (lookahead's params for evaluation)",
  )
  back, report = t5x_optim.convert_state(new, la.create(optax.LookaheadParams.init_synced(PARAMS)))
  _assert_close(back.target.fast, new.target)
  _assert_close(back.target.slow, new.target)
  _assert_close(back.state.param_states.fast_state[0].mu, new.state.param_states[0].mu)
  assert not report.initialised and not report.dropped


@pytest.mark.slow
def test_lookahead_params_convert_to_and_from_one_copy_into_a_definition():
  """Into a definition as into an Optimizer of it: a lookahead source gives its slow copy and
  names the fast one as dropped; a lookahead definition trains both copies at the source's
  params. The definition target kept both copies as one optimizer's params (its state over
  both, every step failing), and a lookahead definition refused one copy."""
  la, old = _lookahead(PARAMS)
  adamw = OptaxWrapper(optax.adamw(1e-3))
  new, report = t5x_optim.convert_state(old, adamw)
  want, want_report = t5x_optim.convert_state(old, adamw.create(PARAMS))
  _assert_close(new.target, old.target.slow)
  _assert_close(new.state, want.state)
  assert report == want_report
  grads = jax.tree.map(jnp.ones_like, PARAMS)
  _assert_close(new.apply_gradient(grads).target, want.apply_gradient(grads).target)
  back, report = t5x_optim.convert_state(new, la)
  want, want_report = t5x_optim.convert_state(
    new, la.create(optax.LookaheadParams.init_synced(PARAMS))
  )
  _assert_close(back.target, want.target)
  _assert_close(back.state, want.state)
  assert report == want_report and not report.initialised and not report.dropped
  _assert_close(back.apply_gradient(grads).target, want.apply_gradient(grads).target)


@pytest.mark.slow
def test_lookahead_into_lookahead_keeps_the_steps_since_the_last_sync():
  """Lookahead into lookahead carried both copies of the params but restarted the count of fast
  steps since the last sync at 0, without a word: the next sync came late, and the run
  differed from the source continued."""
  la, old = _lookahead(PARAMS)
  assert int(old.state.param_states.steps_since_sync) == 2
  new, report = t5x_optim.convert_state(old, la.create(optax.LookaheadParams.init_synced(PARAMS)))
  assert int(new.state.param_states.steps_since_sync) == 2
  assert (
    "<root> (LookaheadState).steps_since_sync: from <root> (LookaheadState)" in report.converted
  )
  grads = jax.tree.map(lambda p: jnp.full(p.shape, 0.5), PARAMS)
  for _ in range(2):  # past the sync at the third step
    old, new = old.apply_gradient(grads), new.apply_gradient(grads)
  _assert_close(new.target, old.target)


@pytest.mark.parametrize(("source", "target"), [(FrozenDict, dict), (dict, FrozenDict)])
def test_a_target_in_another_container_gets_the_source_params_in_its_own(source, target):
  """T5X's older checkpoints hold FrozenDicts, flax's models give dicts: either way round the
  params are the source's, in the target's container."""
  old = OptaxWrapper(optax.adam(1e-3)).create(source(PARAMS)).apply_gradient(source(M))
  new, report = t5x_optim.convert_state(old, OptaxWrapper(optax.adamw(1e-3)).create(target(PARAMS)))
  assert type(new.target) is target
  assert type(new.state.param_states[0].mu) is target
  _assert_close(dict(new.target), dict(old.target))
  _assert_close(dict(new.state.param_states[0].nu), dict(old.state.param_states[0].nu))
  assert not report.initialised


def _unfit(params: dict) -> dict[str, dict]:
  kernel = params["dense"]["kernel"]
  return {
    "transposed": {"dense": {**params["dense"], "kernel": kernel.T}},
    "extra": {**params, "head": {"bias": np.zeros(3, np.float32)}},
    "missing": {"dense": {"kernel": kernel}},
    "renamed": {"dense": {"kernel": kernel, "b": params["dense"]["bias"]}},
  }


@pytest.mark.parametrize("case", sorted(_unfit(PARAMS)))
def test_params_that_do_not_fit_the_target_are_refused_naming_the_path(case):
  """Converted into a target of other shapes, the params were the source's without a word:
  the optimizer no longer fitted the model it was built for."""
  old = OptaxWrapper(optax.adam(1e-3)).create(PARAMS)
  target = OptaxWrapper(optax.adam(1e-3)).create(_unfit(PARAMS)[case])
  want = {
    "transposed": r"dense/kernel: the source's params have shape \(4, 6\), the target's \(6, 4\)",
    "extra": r"the target's params have head/bias, which the source's do not",
    "missing": r"the source's params have dense/bias, which the target's do not",
    "renamed": r"the target's params have dense/b, which the source's do not",
  }[case]
  with pytest.raises(ValueError, match=want):
    t5x_optim.convert_state(old, target)


@pytest.mark.parametrize("mode", [None, pytest.param("8bit", marks=pytest.mark.slow)])
def test_a_schedule_free_source_gives_its_evaluation_params(mode):
  """Schedule-free takes gradients at y and evaluates its average x; the params carried over
  were y, with z dropped. The new optimizer starts from x, and the report says so."""
  tx = optax.contrib.schedule_free_adamw(0.1)
  old = OptaxWrapper(tx if mode is None else t5x_optim.low_precision(tx, mode, min_size=0))
  old = old.create(PARAMS)
  for scale in (1.0, -2.0, 3.0):
    old = old.apply_gradient(_scaled(M, scale))
  states = t5x_optim.low_precision_to_float32(old.state.param_states)
  x = optax.contrib.schedule_free_eval_params(states, old.target)
  assert not np.allclose(x["dense"]["bias"], old.target["dense"]["bias"])
  new, report = t5x_optim.convert_state(old, OptaxWrapper(optax.adamw(1e-3)), missing="init")
  _assert_close(new.target, x)
  assert report.dropped[-1] == (
    "target (optax.contrib.ScheduleFreeState): the new optimizer starts from schedule-free's "
    "evaluation params x = (y - (1 - b1) z) / b1, not the y it took gradients at"
  )


_SCHEDULE_FREE_WRAPPERS = {
  "MultiSteps": (
    lambda tx: optax.MultiSteps(tx, every_k_schedule=2),
    lambda state: state.inner_opt_state,
  ),
  "inject_hyperparams": (
    lambda tx: optimizers.inject_hyperparams(
      optax.contrib.schedule_free_adamw, hyperparams={"learning_rate": 0.1}
    ),
    lambda state: state.inner_state,
  ),
  "apply_if_finite": (
    lambda tx: optax.apply_if_finite(tx, max_consecutive_errors=3),
    lambda state: state.inner_state,
  ),
}


@pytest.mark.slow
@pytest.mark.parametrize("wrapper", sorted(_SCHEDULE_FREE_WRAPPERS))
def test_schedule_free_evaluation_params_are_found_inside_a_wrapper(wrapper):
  """Schedule-free wrapped in optax.MultiSteps, inject_hyperparams or apply_if_finite (in a
  chain, after clipping) was not looked for inside the wrapper: no evaluation params (the
  eval line had no loss_x). They are optax's of the wrapped state."""
  wrap, inner = _SCHEDULE_FREE_WRAPPERS[wrapper]
  old = OptaxWrapper(
    optax.chain(optax.clip_by_global_norm(1.0), wrap(optax.contrib.schedule_free_adamw(0.1)))
  ).create(PARAMS)
  for scale in (1.0, -2.0, 3.0, 0.5):
    old = old.apply_gradient(_scaled(M, scale))
  x = optax.contrib.schedule_free_eval_params(inner(old.state.param_states[-1]), old.target)
  assert not np.allclose(x["dense"]["bias"], old.target["dense"]["bias"])
  _assert_close(t5x_optim.schedule_free_evaluation_params(old.state.param_states, old.target), x)
  if wrapper == "MultiSteps":  # Converted, it starts from x too.
    new, report = t5x_optim.convert_state(old, OptaxWrapper(optax.adamw(1e-3)), missing="init")
    _assert_close(new.target, x)
    assert "evaluation params x = (y - (1 - b1) z) / b1" in report.dropped[-1]


_SCHEDULE_FREE_IN_PART = {
  "partition": lambda: OptaxWrapper(
    optax.partition(
      {"free": optax.contrib.schedule_free_adamw(0.1), "sgd": optax.sgd(0.1)},
      {"dense": {"kernel": "free", "bias": "sgd"}},
    )
  ),
  "masked": lambda: OptaxWrapper(
    optax.chain(
      optax.masked(optax.sgd(0.1), {"dense": {"kernel": False, "bias": True}}),
      optax.masked(
        optax.contrib.schedule_free_adamw(0.1), {"dense": {"kernel": True, "bias": False}}
      ),
    )
  ),
  "MultiOptimizer": lambda: t5x_optim.MultiOptimizer(
    [
      (t5x_optim.PathFilter("kernel"), OptaxWrapper(optax.contrib.schedule_free_adamw(0.1))),
      (t5x_optim.PathFilter("bias"), OptaxWrapper(optax.sgd(0.1))),
    ]
  ),
  "MultiOptimizer, 8-bit": lambda: t5x_optim.MultiOptimizer(
    [
      (
        t5x_optim.PathFilter("kernel"),
        OptaxWrapper(
          t5x_optim.low_precision(optax.contrib.schedule_free_adamw(0.1), "8bit", min_size=0)
        ),
      ),
      (t5x_optim.PathFilter("bias"), OptaxWrapper(optax.sgd(0.1))),
    ]
  ),
}


def _free_kernel_state(param_states):
  """The one schedule-free state of a `_SCHEDULE_FREE_IN_PART` optimizer's state."""
  kind = optax.contrib.ScheduleFreeState
  (state,) = [
    node
    for node in jax.tree.leaves(param_states, is_leaf=lambda n: isinstance(n, kind))
    if isinstance(node, kind)
  ]
  return state


@pytest.mark.parametrize("layout", sorted(_SCHEDULE_FREE_IN_PART))
def test_schedule_free_over_part_of_the_params_gives_its_evaluation_params(layout):
  """Schedule-free over some params only (a partition's part, optax.masked, a MultiOptimizer
  group, in 8 bits too) was not found: a conversion started the kernel from the y it took
  gradients at, without a word, and the eval line had no loss_x. The params it trains give
  its average x, the others are as they are, and the report says so."""
  old = _SCHEDULE_FREE_IN_PART[layout]().create(PARAMS)
  for scale in (1.0, -2.0, 3.0):
    old = old.apply_gradient(_scaled(M, scale))
  state = _free_kernel_state(t5x_optim.low_precision_to_float32(old.state.param_states))
  kernel = old.target["dense"]["kernel"]
  x = optax.contrib.schedule_free_eval_params(state._replace(z=state.z["dense"]["kernel"]), kernel)
  assert not np.allclose(x, kernel)
  want = {"dense": {"kernel": x, "bias": old.target["dense"]["bias"]}}
  got = t5x_optim.schedule_free_evaluation_params(old.state.param_states, old.target)
  assert got is not None and tree_equal(got, want)
  new, report = t5x_optim.convert_state(old, OptaxWrapper(optax.adamw(1e-3)), missing="init")
  assert tree_equal(new.target, want)
  assert report.dropped[-1] == (
    "target (optax.contrib.ScheduleFreeState): the new optimizer starts from schedule-free's "
    "evaluation params x = (y - (1 - b1) z) / b1 for 1 of the 2 params, not the y it "
    "took gradients at"
  )


def _free_in_part(layout, b1=0.9, storage=None):
  """Schedule-free AdamW over the kernel of `_FREE_PARAMS`-like params only, SGD over the bias,
  laid out as `layout` ("partition" or "MultiOptimizer"), its state in `storage`."""
  free = optax.contrib.schedule_free_adamw(0.05, warmup_steps=3, b1=b1)
  if storage is not None:
    free = t5x_optim.low_precision(free, storage, min_size=0)
  if layout == "partition":
    return OptaxWrapper(
      optax.partition({"free": free, "sgd": optax.sgd(0.1)}, {"w": "free", "b": "sgd"})
    )
  return t5x_optim.MultiOptimizer(
    [
      (t5x_optim.PathFilter("w"), OptaxWrapper(free)),
      (t5x_optim.PathFilter("b"), OptaxWrapper(optax.sgd(0.1))),
    ]
  )


_FREE_PART_PATHS = {
  "partition": "inner_states/free/inner_state",
  "MultiOptimizer": "0/param_states",
}


@pytest.mark.parametrize("layout", sorted(_FREE_PART_PATHS))
def test_schedule_free_over_part_of_the_params_converted_into_itself_goes_on(layout):
  """A partition's part or a MultiOptimizer group of schedule-free, converted into the same
  optimizer: its z had no converter (refused, or started at x with ``missing="init"``). It
  goes on as the whole state's does: the same params y, z and weights, bit for bit after."""
  old = _free_in_part(layout).create(_FREE_PARAMS)
  for scale in (1.0, -2.0, 3.0, 0.5, -1.0):
    old = _step(old, _scaled(_FREE_GRADS, scale))
  new, report = t5x_optim.convert_state(old, _free_in_part(layout))
  where = _FREE_PART_PATHS[layout]
  assert (
    f"{where} (ScheduleFreeState): z, weight_sum, max_lr and the params it takes gradients at "
    f"(y), from {where}"
  ) in report.converted, report
  assert not [line for line in report.dropped if "ScheduleFree" in line], report
  assert tree_equal(new.target, old.target)
  for scale in (2.0, -0.5, 1.5):
    old, new = _step(old, _scaled(_FREE_GRADS, scale)), _step(new, _scaled(_FREE_GRADS, scale))
  assert_same_bits(new.target, old.target)
  assert_same_bits(new.state, old.state)


@pytest.mark.parametrize(
  ("source", "target", "storages"),
  [
    ("MultiOptimizer", "partition", (None, None)),
    ("partition", "MultiOptimizer", ("8bit", None)),
  ],
)
def test_schedule_free_over_part_of_the_params_goes_on_in_another_layout_and_b1(
  source, target, storages
):
  """Schedule-free over the same params in another layout, storage and ``b1``: its x and z
  are the old ones, y = b1 x + (1 - b1) z by the new b1, and the other params are as they
  were."""
  old = _free_in_part(source, storage=storages[0]).create(_FREE_PARAMS)
  for scale in (1.0, -2.0, 3.0, 0.5):
    old = _step(old, _scaled(_FREE_GRADS, scale))
  x = t5x_optim.schedule_free_evaluation_params(old.state.param_states, old.target)
  new, report = t5x_optim.convert_state(old, _free_in_part(target, 0.8, storages[1]))
  into, of = [
    _FREE_PART_PATHS[layout] + ("/inner_state" if storage else "")
    for layout, storage in zip((target, source), reversed(storages), strict=True)
  ]
  assert (
    f"{into} (ScheduleFreeState): z, weight_sum, max_lr and the params it takes gradients at "
    f"(y), from {of}"
  ) in report.converted, report
  _assert_close(t5x_optim.schedule_free_evaluation_params(new.state.param_states, new.target), x)
  assert not np.allclose(new.target["w"], old.target["w"])
  assert tree_equal(new.target["b"], old.target["b"])
  old_free = _free_kernel_state(t5x_optim.low_precision_to_float32(old.state.param_states))
  new_free = _free_kernel_state(t5x_optim.low_precision_to_float32(new.state.param_states))
  assert tree_equal(new_free.z["w"], old_free.z["w"]) and float(new_free.b1) == pytest.approx(0.8)
  for name in ("weight_sum", "max_lr"):
    assert getattr(new_free, name) == getattr(old_free, name), name


def _free_split(layout, storage=None, lrs=(0.05, 0.05)):
  """Schedule-free AdamW over all of `_FREE_PARAMS`: one state (``"whole"``), or one per
  param as `MultiOptimizer` groups (``"groups"``) or ``optax.partition`` parts (``"parts"``),
  with the learning rates `lrs` (w's, b's), in `storage`."""

  def free(lr):
    tx = optax.contrib.schedule_free_adamw(lr, warmup_steps=3)
    return tx if storage is None else t5x_optim.low_precision(tx, storage, min_size=0)

  if layout == "whole":
    return OptaxWrapper(free(lrs[0]))
  if layout == "parts":
    return OptaxWrapper(
      optax.partition({"w": free(lrs[0]), "b": free(lrs[1])}, {"w": "w", "b": "b"})
    )
  return t5x_optim.MultiOptimizer(
    [
      (t5x_optim.PathFilter("w"), OptaxWrapper(free(lrs[0]))),
      (t5x_optim.PathFilter("b"), OptaxWrapper(free(lrs[1]))),
    ]
  )


def _free_z(optimizer):
  """The z of every schedule-free state in `optimizer`'s state, decoded, by param path."""
  kind = optax.contrib.ScheduleFreeState
  states = t5x_optim.low_precision_to_float32(optimizer.state.param_states)
  return {
    jax.tree_util.keystr(path): z
    for node in jax.tree.leaves(states, is_leaf=lambda n: isinstance(n, kind))
    if isinstance(node, kind)
    for path, z in jax.tree.flatten_with_path(node.z)[0]
  }


_FREE_SPLIT_LINES = {
  ("whole", "groups"): ["0/param_states", "<root>", "1/param_states", "<root>"],
  ("parts", "whole"): [
    "inner_state",
    "inner_states/b/inner_state/inner_state and inner_states/w/inner_state/inner_state",
  ],
}


@pytest.mark.parametrize(
  ("source", "target", "storage"), [("whole", "groups", None), ("parts", "whole", "8bit")]
)
def test_schedule_free_split_into_groups_or_merged_into_one_goes_on(source, target, storage):
  """One schedule-free state converted into schedule-free groups (or partition parts), or
  those into one: its z had no converter (refused, or started at x with ``missing="init"``).
  Each target state goes on from the source states that hold its params: y, x, z and the
  weights of the average as they were, and 3 steps later where the unconverted run is."""
  old = _free_split(source, storage).create(_FREE_PARAMS)
  for scale in (1.0, -2.0, 3.0, 0.5):
    old = _step(old, _scaled(_FREE_GRADS, scale))
  x = t5x_optim.schedule_free_evaluation_params(old.state.param_states, old.target)
  new, report = t5x_optim.convert_state(old, _free_split(target, storage))
  where = _FREE_SPLIT_LINES[source, target]
  assert [line for line in report.converted if "(ScheduleFreeState)" in line] == [
    f"{into} (ScheduleFreeState): z, weight_sum, max_lr and the params it takes gradients at "
    f"(y), from {of}"
    for into, of in zip(where[::2], where[1::2], strict=True)
  ], report
  assert not [line for line in report.dropped if "ScheduleFree" in line], report
  assert tree_equal(new.target, old.target)
  _assert_close(t5x_optim.schedule_free_evaluation_params(new.state.param_states, new.target), x)
  assert tree_equal(_free_z(new), _free_z(old))
  for scale in (2.0, -0.5, 1.5):
    old, new = _step(old, _scaled(_FREE_GRADS, scale)), _step(new, _scaled(_FREE_GRADS, scale))
  _assert_close(new.target, old.target)


def test_schedule_free_groups_averaged_with_other_weights_are_not_merged():
  """Groups of other learning rates weigh their averages otherwise (weight_sum, max_lr): one
  state cannot go on from both. Refused naming both groups and their weights; with
  ``missing="init"`` the params start from their x, as into another optimizer."""
  old = _free_split("groups", lrs=(0.05, 0.01)).create(_FREE_PARAMS)
  for scale in (1.0, -2.0, 3.0):
    old = _step(old, _scaled(_FREE_GRADS, scale))
  with pytest.raises(
    ValueError,
    match=r"z \(ScheduleFreeState.z\): no converter, the old optimizer's schedule-free states "
    r"over its params averaged with other weights, 0/param_states \(weight_sum [0-9.e-]+, "
    r"max_lr 0.05\) and 1/param_states \(weight_sum [0-9.e-]+, max_lr 0.01\)\.",
  ):
    t5x_optim.convert_state(old, _free_split("whole"))
  x = t5x_optim.schedule_free_evaluation_params(old.state.param_states, old.target)
  new, _ = t5x_optim.convert_state(old, _free_split("whole"), missing="init")
  _assert_close(new.target, x)


def _adam_groups(make=optax.adam):
  """Adam over the kernel with b2 0.95 and over the bias with b2 0.98, as `MultiOptimizer`
  groups, each built by `make` (``optax.adam``, or it injected)."""
  return t5x_optim.MultiOptimizer(
    [
      (t5x_optim.PathFilter("kernel"), OptaxWrapper(make(learning_rate=1e-2, b2=0.95))),
      (t5x_optim.PathFilter("bias"), OptaxWrapper(make(learning_rate=1e-2, b2=0.98))),
    ]
  )


_TWO_B2 = t5x_optim.SeveralValues((0.95, 0.98), ("k", "s"))


def test_a_hparam_of_several_values_is_not_guessed():
  """Groups of Adam with b2 0.95 and 0.98 have no one source b2: given none, the kernel's nu
  was read with optax's 0.999 and written with 0.95 (32 times too large after 20 steps). Given
  as `SeveralValues`, a converter that reads it is refused, naming the state and the values;
  each state reads the value known to be its own (``at``); both sides giving the same ones go
  over as they are; and values injected into each state (inject_hyperparams) are read."""
  old = _after_groups(_adam_groups())
  target = OptaxWrapper(optax.adam(1e-2, b2=0.95))
  with pytest.raises(
    ValueError,
    match=r"^0/param_states/0: its converter reads b2, which the optimizer's config binds to "
    r"several values, 0.95 \(k\) or 0.98 \(s\), one of them this state's",
  ):
    t5x_optim.convert_state(old, target, source_hparams={"b2": _TWO_B2})
  same, _ = t5x_optim.convert_state(
    old, _adam_groups(), source_hparams={"b2": _TWO_B2}, target_hparams={"b2": _TWO_B2}
  )
  assert_same_bits(same.state, old.state)
  groups = (("0/param_states",), ("1/param_states",))
  known = dataclasses.replace(_TWO_B2, at=groups)
  new, _ = t5x_optim.convert_state(
    old, target, source_hparams={"b2": known}, target_hparams={"b2": 0.95}
  )
  nu = new.state.param_states[0].nu["dense"]
  olds = [group.param_states[0].nu["dense"] for group in old.state.param_states]
  _assert_close(nu["kernel"], olds[0]["kernel"])
  _assert_close(nu["bias"], olds[1]["bias"] * (1 - 0.95**4) / (1 - 0.98**4))
  injected = _after_groups(_adam_groups(optax.inject_hyperparams(optax.adam)))
  new, _ = t5x_optim.convert_state(
    injected, target, source_hparams={"b2": _TWO_B2}, target_hparams={"b2": 0.95}
  )
  inner = [group.param_states.inner_state[0] for group in injected.state.param_states]
  _assert_close(new.state.param_states[0].nu["dense"]["kernel"], inner[0].nu["dense"]["kernel"])
  bias = new.state.param_states[0].nu["dense"]["bias"]
  assert not np.allclose(bias, inner[1].nu["dense"]["bias"])  # 0.98 into 0.95


def test_schedule_free_groups_of_other_b2_into_one_and_back_go_on():
  """Schedule-free AdamW groups of b2 0.95 and 0.98 merged into one state of b2 0.95 and
  split back, each group's second moment converted with its own b2 (`SeveralValues` known
  per group): 3 steps later where the groups never converted are."""
  free = lambda b2: OptaxWrapper(optax.contrib.schedule_free_adamw(0.01, b2=b2))  # noqa: E731
  groups = t5x_optim.MultiOptimizer(
    [(t5x_optim.PathFilter("w"), free(0.95)), (t5x_optim.PathFilter("b"), free(0.98))]
  )
  b2 = dataclasses.replace(_TWO_B2, at=(("0/param_states",), ("1/param_states",)))
  old = groups.create(_FREE_PARAMS)
  for scale in (1.0, -2.0, 3.0, 0.5):
    old = _step(old, _scaled(_FREE_GRADS, scale))
  one, _ = t5x_optim.convert_state(
    old, free(0.95), source_hparams={"b2": b2}, target_hparams={"b2": 0.95}
  )
  back, _ = t5x_optim.convert_state(
    one, groups, source_hparams={"b2": 0.95}, target_hparams={"b2": b2}
  )
  for scale in (2.0, -0.5, 1.5):
    old, back = _step(old, _scaled(_FREE_GRADS, scale)), _step(back, _scaled(_FREE_GRADS, scale))
  _assert_close(back.target, old.target)
  _assert_close(back.state, old.state)


def _after_groups(optimizer_def):
  old = optimizer_def.create(PARAMS)
  for scale in (1.0, -2.0, 3.0, 0.5):
    old = _step(old, _scaled(M, scale))
  return old


_SCHEDULE_FREE_KINDS = {
  "sgd": lambda b1: optax.contrib.schedule_free_sgd(0.1, warmup_steps=3, b1=b1),
  "adamw": lambda b1: optax.contrib.schedule_free_adamw(0.05, warmup_steps=3, b1=b1),
}


_FREE_RNG = np.random.default_rng(1)
_FREE_PARAMS = {"w": jnp.asarray(_FREE_RNG.normal(size=(3, 64)), jnp.float32), "b": jnp.ones(64)}
_FREE_GRADS = {"w": jnp.asarray(_FREE_RNG.normal(size=(3, 64)), jnp.float32), "b": jnp.ones(64)}


def _schedule_free_run(make, storage=None):
  tx = make()
  return OptaxWrapper(tx if storage is None else t5x_optim.low_precision(tx, storage, min_size=0))


@pytest.mark.parametrize("kind", ["sgd", pytest.param("adamw", marks=pytest.mark.slow)])
def test_schedule_free_converted_into_itself_goes_on_as_if_never_converted(kind):
  """Converted into schedule-free, a schedule-free run started over from its evaluation
  params x, with z = x and its averaging weights fresh (refused without ``missing="init"``):
  3 steps later its params were 0.36 (sgd) and 0.034 (adamw) away from the uninterrupted
  run's. Its y, z, weight_sum and max_lr go on."""
  make = _SCHEDULE_FREE_KINDS[kind]
  old = _schedule_free_run(lambda: make(0.9)).create(_FREE_PARAMS)
  for scale in (1.0, -2.0, 3.0, 0.5, -1.0):
    old = _step(old, _scaled(_FREE_GRADS, scale))
  new, report = t5x_optim.convert_state(old, _schedule_free_run(lambda: make(0.9)))
  assert tree_equal(new.target, old.target)
  assert (
    "<root> (ScheduleFreeState): z, weight_sum, max_lr and the params it takes gradients at "
    "(y), from <root>"
  ) in report.converted, report
  assert not [line for line in report.dropped if "ScheduleFree" in line], report
  assert not [line for line in report.initialised if "ScheduleFree" in line], report
  for scale in (2.0, -0.5, 1.5):
    old, new = _step(old, _scaled(_FREE_GRADS, scale)), _step(new, _scaled(_FREE_GRADS, scale))
  assert_same_bits(new.target, old.target)
  assert_same_bits(new.state, old.state)


@pytest.mark.slow
@pytest.mark.parametrize("storages", [(None, "8bit"), ("8bit", None), ("4bit", "bfloat16")])
def test_schedule_free_goes_on_across_storages_and_another_b1(storages):
  """Schedule-free into schedule-free in another storage and with another ``b1``: its
  evaluation params x and its z are the old ones, and y = b1 x + (1 - b1) z by the new b1."""
  make = _SCHEDULE_FREE_KINDS["adamw"]
  old = _schedule_free_run(lambda: make(0.9), storages[0]).create(_FREE_PARAMS)
  for scale in (1.0, -2.0, 3.0, 0.5):
    old = _step(old, _scaled(_FREE_GRADS, scale))
  x = t5x_optim.schedule_free_evaluation_params(old.state.param_states, old.target)
  new, report = t5x_optim.convert_state(old, _schedule_free_run(lambda: make(0.8), storages[1]))
  assert any(
    "z, weight_sum, max_lr and the params it takes gradients" in line for line in report.converted
  )
  _assert_close(t5x_optim.schedule_free_evaluation_params(new.state.param_states, new.target), x)
  old_free = _last_state(t5x_optim.low_precision_to_float32(old.state.param_states))
  new_free = _last_state(t5x_optim.low_precision_to_float32(new.state.param_states))
  assert tree_equal(new_free.z, old_free.z)
  assert float(new_free.b1) == pytest.approx(0.8)
  for name in ("weight_sum", "max_lr"):
    assert getattr(new_free, name) == getattr(old_free, name), name


def _last_state(states):
  while True:
    if isinstance(states, tuple) and not hasattr(states, "_fields"):
      states = states[-1]
    elif hasattr(states, "inner_state"):
      states = states.inner_state
    else:
      return states


def test_a_schedule_free_state_whose_updates_are_not_applied_starts_from_x():
  """Only a target whose applied updates are schedule-free's goes on from its y: one that
  scales them afterwards starts from the evaluation params x, with z fresh, as another
  optimizer does."""
  old = _schedule_free_run(lambda: optax.contrib.schedule_free_sgd(0.1)).create(_FREE_PARAMS)
  for scale in (1.0, -2.0, 3.0):
    old = _step(old, _scaled(_FREE_GRADS, scale))
  x = t5x_optim.schedule_free_evaluation_params(old.state.param_states, old.target)
  assert not np.allclose(x["b"], old.target["b"])
  scaled = optax.chain(optax.contrib.schedule_free_sgd(0.1), optax.scale(0.5))
  new, report = t5x_optim.convert_state(old, OptaxWrapper(scaled), missing="init")
  _assert_close(new.target, x)
  assert "evaluation params x = (y - (1 - b1) z) / b1" in report.dropped[-1], report


def test_schedule_free_before_another_masked_transformation_has_no_evaluation_params():
  """Schedule-free under optax.masked before another masked transformation: the last one's
  state does not say which params it transforms (SGD's holds none), so the params schedule-free
  holds may not be its y, and there are no evaluation params."""
  tx = optax.chain(
    optax.masked(optax.contrib.schedule_free_sgd(1.0), {"w": True, "b": False}),
    optax.masked(optax.sgd(1.0), {"w": False, "b": True}),
  )
  params = {"w": jnp.ones(2), "b": jnp.ones(2)}
  assert t5x_optim.schedule_free_evaluation_params(tx.init(params), params) is None


@pytest.mark.slow
def test_lookahead_and_muon_checkpoints_restore_from_their_definitions(tmp_path, partitioner):
  """Each source is given as a fresh definition, as `--init_from` builds it from gin: Muon's
  takes the target's logical axes (the embedding runs Adam, by its ``vocab`` axis), and
  lookahead's checkpoint holds two copies of the params."""
  muon = partitioning.init_sharded(
    partitioner, optimizers.muon(1e-3), lambda key: _variables(), None
  )
  grads = jax.tree.map(lambda p: jnp.full(p.shape, 0.5), muon.params)
  muon = muon.apply_gradient(grads)
  with t5x_optim.Checkpointer(tmp_path / "muon", async_save=False) as checkpointer:
    checkpointer.save(1, muon)
  adamw = partitioning.abstract_train_state(partitioner, optimizers.adamw(1e-3), _variables)
  state, report = t5x_optim.restore_converted(
    tmp_path / "muon", adamw, source=optimizers.muon(1e-3), missing="init"
  )
  _assert_close(state.params, muon.params)
  assert (
    "0 (ScaleByAdamState).nu: 2 params, from inner_states/adam/inner_state/0 (ScaleByAdamState)"
    in report.converted
  )

  _, old = _lookahead(PARAMS)
  with t5x_optim.Checkpointer(tmp_path / "lookahead", async_save=False) as checkpointer:
    checkpointer.save(2, t5x_optim.TrainState(_optimizer=old))
  la = OptaxWrapper(optax.lookahead(optax.adam(0.1), sync_period=3, slow_step_size=0.5))
  target = t5x_optim.TrainState(_optimizer=OptaxWrapper(optax.adamw(1e-3)).create(PARAMS))
  state, report = t5x_optim.restore_converted(tmp_path / "lookahead", target, source=la)
  _assert_close(state.params, old.target.slow)
  assert int(state.step) == 2 and len(report.dropped) == 1
  with t5x_optim.Checkpointer(tmp_path / "adamw", async_save=False) as checkpointer:
    checkpointer.save(2, state)
  target = t5x_optim.TrainState(_optimizer=la.create(optax.LookaheadParams.init_synced(PARAMS)))
  back, report = t5x_optim.restore_converted(
    tmp_path / "adamw", target, source=OptaxWrapper(optax.adamw(1e-3))
  )
  _assert_close(back.params.fast, old.target.slow)
  _assert_close(back.params.slow, old.target.slow)
  assert not report.initialised


T5X_ADAMW = pathlib.Path(__file__).parent / "data" / "t5x_checkpoints"


@pytest.mark.parametrize("fmt", ["legacy", "orbax"])
@pytest.mark.slow
def test_t5x_adamw_checkpoint_restores_into_lion_in_both_formats(fmt, partitioner):
  """T5X's OptaxWrapper(adamw) checkpoint (the Orbax one stores counts as float32)."""
  source = OptaxWrapper(optax.adamw(0.1, weight_decay=0.01))
  target = partitioning.abstract_train_state(partitioner, optimizers.lion(1e-3), _variables)
  state, report = t5x_optim.restore_converted(T5X_ADAMW / fmt, target, source=source)
  assert report.converted == ("0 (ScaleByLionState).mu: 3 params, from 0 (ScaleByAdamState)",)
  # The same through the convert_from= keyword of both restore APIs.
  with t5x_optim.Checkpointer(T5X_ADAMW / fmt) as checkpointer:
    through_checkpointer = checkpointer.restore(target, convert_from=source)
    assert checkpointer.restored_step == 2
  through_t5x = t5x_optim.restore_t5x_checkpoint(T5X_ADAMW / fmt, target, convert_from=source)
  for other in (through_checkpointer, through_t5x):
    _assert_close(other.param_states, state.param_states)
  with np.load(T5X_ADAMW / "expected.npz") as npz:
    expected = dict(npz)
  for key, value in expected.items():
    path = key.split("/")
    if path[0] == "target":
      np.testing.assert_array_equal(_at(state.params, path[1:]), value)
    elif path[2:4] == ["0", "mu"]:
      mu = value / (1 - 0.9**2) * (1 - 0.99**2)  # adam's b1 = 0.9, lion's b2 = 0.99, t = 2
      np.testing.assert_allclose(_at(state.param_states[0].mu, path[4:]), mu, rtol=1e-5)
  assert int(state.step) == int(state.param_states[0].count) == 2
  _assert_target_shardings(state, target)


@pytest.mark.slow
def test_stacked_params_convert_into_a_definition_as_into_its_optimizer():
  """Params kept stacked (`stack_params`) converted against a bare definition: the result held
  the stacked params under the plain definition, without the stacked layer `create` puts
  around it, and its first update failed (``The grads do not fit the params: paths only in
  the grads: ['b', 'w'] ...``). It is the optimizer `create` gives, and steps as the
  conversion of the same params unstacked does."""
  params = {"w": NOISY_PARAMS["w"][:8], "b": NOISY_PARAMS["w"][8:]}
  grads = _noisy_grads(params, 1)
  moved = []
  for given in (params, t5x_optim.stack_params(params)):
    source = OptaxWrapper(optax.adam(1e-3)).create(given).apply_gradient(grads)
    new, _ = t5x_optim.convert_state(source, OptaxWrapper(optax.lion(1e-3)), missing="init")
    assert type(new.target) is type(given)
    target = new.apply_gradient(grads).target
    moved.append(target.unstack() if isinstance(target, t5x_optim.StackedParams) else target)
  _assert_close(moved[1], moved[0])


@pytest.mark.slow
def test_the_report_of_stacked_params_counts_and_names_params_not_buffers():
  """Params kept stacked: the report counted the stacked buffers as params ("2 params" for
  three leaves in two buffers) and named a buffer as the example ("e.g. buffers/0"). It reads
  as the report of the same params unstacked."""
  params = {"w": jnp.ones((4, 3)), "b": jnp.ones((4, 3)), "c": jnp.ones((5,))}
  reports = []
  for given in (params, t5x_optim.stack_params(params)):
    for old, new in ((optax.adam, optax.lion), (optax.lion, optax.adam)):
      source = OptaxWrapper(old(1e-3)).create(given)
      reports.append(t5x_optim.convert_state(source, OptaxWrapper(new(1e-3)), missing="init")[1])
  assert reports[0].converted == ("0 (ScaleByLionState).mu: 3 params, from 0 (ScaleByAdamState)",)
  assert reports[1].initialised[-1] == (
    "0 (ScaleByAdamState).nu: 3 params without a source value (e.g. b)"
  )
  assert reports[2:] == reports[:2]


def test_a_converting_restore_says_which_checkpoint_step_it_read(tmp_path):
  """`restored_step` after a restore with convert_from= was the optimizer's step counter (1),
  not the checkpoint step read (100)."""
  source = _optimizer(BY_NAME["sgd_momentum"])
  with t5x_optim.Checkpointer(tmp_path, async_save=False) as checkpointer:
    checkpointer.save(100, source.replace(state=source.state.replace(step=1)))
    for step in (None, 100):
      checkpointer.restore(
        OptaxWrapper(BY_NAME["sgd_momentum"].make()).create(PARAMS),
        step,
        convert_from=OptaxWrapper(BY_NAME["sgd_momentum"].make()),
      )
      assert checkpointer.restored_step == 100


@pytest.mark.slow
def test_a_converting_restore_takes_missing_as_its_refusal_asks(tmp_path):
  """adam into adabelief leaves adabelief's state without a source value, refused with "Pass
  missing='init'": `Checkpointer.restore` refused ``missing=`` (a converting restore "reads one
  step whole") and `restore_t5x_checkpoint` did not take it."""
  params = {"w": jnp.ones((4, 8))}
  adam = optimizers.adam(1e-3).create(params).apply_gradient({"w": jnp.ones((4, 8))})
  target = optimizers.adabelief(1e-3).create(params)
  with t5x_optim.Checkpointer(tmp_path / "ours", async_save=False) as checkpointer:
    checkpointer.save(1, adam)
    with pytest.raises(ValueError, match="Pass missing='init'"):
      checkpointer.restore(target, convert_from=optimizers.adam(1e-3))
    ours = checkpointer.restore(target, convert_from=optimizers.adam(1e-3), missing="init")
    with pytest.raises(ValueError, match=r"^missing= is for a converting restore"):
      checkpointer.restore(adam, missing="init")
  t5x_optim.save_t5x_checkpoint(tmp_path / "t5x", adam)
  theirs = t5x_optim.restore_t5x_checkpoint(
    tmp_path / "t5x", target, convert_from=optimizers.adam(1e-3), missing="init"
  )
  with pytest.raises(ValueError, match=r"^missing= is for a converting restore"):
    t5x_optim.restore_t5x_checkpoint(tmp_path / "t5x", adam, missing="init")
  for restored in (ours, theirs):
    assert int(restored.state.step) == 1
    _assert_close(restored.target, adam.target)
    belief, initial = restored.state.param_states[0], target.state.param_states[0]
    assert int(belief.count) == 1
    _assert_close((belief.mu, belief.nu), (initial.mu, initial.nu))


def test_a_restore_refuses_an_unknown_missing_before_reading(tmp_path):
  """missing='bogus' without convert_from= was called a converting restore's option, and with
  it the checkpoint was read (or found absent) before convert_state refused the value."""
  opt = optimizers.sgd(0.5).create({"w": jnp.ones(2)})
  nowhere = tmp_path / "nowhere"
  refused = r"^missing must be one of \('raise', 'init'\), got 'bogus'\.$"
  for convert_from in (None, optimizers.adam(1e-3)):
    with pytest.raises(ValueError, match=refused):
      t5x_optim.restore_t5x_checkpoint(nowhere, opt, convert_from=convert_from, missing="bogus")
    with t5x_optim.Checkpointer(tmp_path / "empty") as checkpointer:
      with pytest.raises(ValueError, match=refused):
        checkpointer.restore(opt, convert_from=convert_from, missing="bogus")
  with pytest.raises(ValueError, match=refused):
    t5x_optim.restore_converted(nowhere, opt, source=optimizers.adam(1e-3), missing="bogus")


def _kernel_axes_variables() -> dict[str, Any]:
  return {
    "params": {
      "emb": nn.LogicallyPartitioned(jnp.ones((16, 8)), ("vocab", "embed")),
      "wi": nn.LogicallyPartitioned(jnp.ones((8, 16)), ("embed", "mlp")),
    }
  }


def _creates_without_axes(definition: Any) -> bool:
  """Whether `definition` has axes bound: low_precision's axis rules refuse params without."""
  try:
    definition.create({"emb": jnp.ones((16, 8)), "wi": jnp.ones((8, 16))})
  except ValueError:
    return False
  return True


@pytest.mark.slow
@pytest.mark.parametrize(
  "make_source, bound",
  [
    (lambda: optimizers.muon(learning_rate=0.02), lambda d: d.param_specs is not None),
    (
      lambda: OptaxWrapper(
        t5x_optim.low_precision(
          optax.adam(1e-2), "bfloat16", min_size=0, param_modes=[("axis:vocab", "float32")]
        )
      ),
      _creates_without_axes,
    ),
  ],
  ids=["muon", "low_precision_axis_rule"],
)
@pytest.mark.parametrize("step", [None, 999], ids=["restored", "failed"])
def test_a_converting_restore_leaves_the_callers_source_definition_as_it_was(
  tmp_path, make_source, bound, step
):
  """The source definition got the target's logical axes bound in place (`set_param_axes`),
  whether the restore succeeded or failed: the caller's object placed its params by another
  model's axes afterwards."""
  written = t5x_optim.TrainState.create(make_source(), _kernel_axes_variables())
  with t5x_optim.Checkpointer(tmp_path, async_save=False) as checkpointer:
    checkpointer.save(1, written)
  source = make_source()
  target = t5x_optim.TrainState.create(optimizers.adamw(1e-3), _kernel_axes_variables())
  if step is None:
    t5x_optim.restore_converted(tmp_path, target, source=source, missing="init")
  else:
    with pytest.raises(FileNotFoundError):
      t5x_optim.restore_converted(tmp_path, target, source=source, step=step, missing="init")
  assert not bound(source)


# A scanned attention kernel under T5X's standard_logical_factor_rules: 'embed' is a row
# dim, 'heads' and 'kv' column dims, 'layers' a batch dim. With 'layers' of the size of a
# factored dim (T5.1.1-base scanned: 12 layers, 12 heads) the shapes of v_row and v_col
# fit two factorings.
SCANNED = {
  "axis_1": (("embed", "layers", "heads", "kv"), (16, 3, 3, 4), ((0,), (2, 3))),
  "layers_first": (("layers", "embed", "heads", "kv"), (6, 6, 2, 4), ((1,), (2, 3))),
}


def _t5x_estimate(v_row, v_col, d1, d0):
  """T5X's ``apply_param_gradient``: the second moment its update divides by."""
  reduced_d1 = tuple(d - len([e for e in d0 if e < d]) for d in d1)
  row_col_mean = np.mean(v_row, axis=reduced_d1, keepdims=True)
  return np.expand_dims(v_row / row_col_mean, d0) * np.expand_dims(v_col, d1)


def _scanned_t5x_source(shape, d1, d0):
  """A T5X legacy Adafactor state dict of one scanned kernel ``q``, factored over (d1, d0)."""
  g2 = np.random.default_rng(0).uniform(0.1, 10.0, shape) ** 2
  v_row, v_col = g2.mean(axis=d0), g2.mean(axis=d1)
  empty = jnp.zeros((1,))
  states = {"v_row": jnp.asarray(v_row), "v_col": jnp.asarray(v_col), "v": empty, "m": empty}
  source = {"target": {"q": jnp.ones(shape)}, "state": {"step": T, "param_states": {"q": states}}}
  return source, v_row, v_col


@pytest.mark.parametrize("layout", SCANNED)
@pytest.mark.slow
def test_t5x_adafactor_of_a_scanned_kernel_is_read_over_its_logical_axes(layout):
  axes, shape, (d1, d0) = SCANNED[layout]
  source, v_row, v_col = _scanned_t5x_source(shape, d1, d0)
  adam, _ = t5x_optim.convert_state(
    source, OptaxWrapper(optax.adam(1e-3)), param_axes={"q": axes}, missing="init"
  )
  nu = adam.state.param_states[0].nu["q"]
  _assert_close(nu / _decay(0.999, T), _t5x_estimate(v_row, v_col, d1, d0))


AXES_FORMS = {
  "boxed params": lambda axes, shape: {"q": nn.LogicallyPartitioned(jnp.ones(shape), axes)},
  "T5X params_axes collection": lambda axes, _: {"q_axes": nn_partitioning.AxisMetadata(axes)},
  "T5X params_axes": lambda axes, _: {
    "params_axes": {"q_axes": nn_partitioning.AxisMetadata(axes)}
  },
}


@pytest.mark.parametrize("form", AXES_FORMS)
@pytest.mark.slow
def test_param_axes_are_taken_in_every_form_with_param_axes_takes(form):
  """Boxed params and T5X's params_axes collection give the axes their names do: boxes failed
  inside jax (an unhashable array), and a collection's '_axes' paths named no param, so T5X's
  legacy Adafactor was read as if no axes were given."""
  axes, shape, (d1, d0) = SCANNED["axis_1"]
  source, v_row, v_col = _scanned_t5x_source(shape, d1, d0)
  param_axes = AXES_FORMS[form](axes, shape)
  adam, _ = t5x_optim.convert_state(
    source, OptaxWrapper(optax.adam(1e-3)), param_axes=param_axes, missing="init"
  )
  nu = adam.state.param_states[0].nu["q"]
  _assert_close(nu / _decay(0.999, T), _t5x_estimate(v_row, v_col, d1, d0))
  muon, _ = t5x_optim.convert_state(
    adam, optimizers.muon(learning_rate=0.02), param_axes=param_axes, missing="init"
  )
  want = t5x_optim.with_param_axes(optimizers.muon(learning_rate=0.02), {"q": axes})
  assert muon.optimizer_def.describe_params(muon.target) == want.describe_params(muon.target)


@pytest.mark.parametrize("layout", SCANNED)
def test_t5x_adafactor_of_a_scanned_kernel_is_written_over_its_logical_axes(layout):
  axes, shape, (d1, d0) = SCANNED[layout]
  _, v_row, v_col = _scanned_t5x_source(shape, d1, d0)
  nu = np.random.default_rng(1).uniform(0.5, 2.0, shape).astype(np.float32)
  params = {"q": jnp.ones(shape)}
  adam = OptaxWrapper(optax.adam(1e-3)).create(params)
  stored = optax.ScaleByAdamState(
    jnp.int32(T), {"q": jnp.zeros(shape)}, _scaled({"q": nu}, _decay(0.999, T))
  )
  adam = adam.replace(
    state=adam.state.replace(step=jnp.int32(T), param_states=(stored, optax.EmptyState()))
  )
  empty = np.zeros((1,), np.float32)
  layout_def = _T5XAdafactorLayout({
    ("state", "param_states", "q", name): x
    for name, x in {"v_row": v_row, "v_col": v_col, "v": empty, "m": empty}.items()
  })  # fmt: skip
  back, _ = t5x_optim.convert_state(adam, layout_def, param_axes={"q": axes})
  state = back.state.param_states["q"]
  # T5X's statistics: the squared gradients averaged over the column dims, the row dims.
  _assert_close(state.v_row, nu.mean(axis=d0))
  _assert_close(state.v_col, nu.mean(axis=d1))


@pytest.mark.parametrize("layout", SCANNED)
def test_t5x_adafactor_factors_that_fit_two_factorings_are_refused_without_axes(layout):
  axes, shape, (d1, d0) = SCANNED[layout]
  source, _, _ = _scanned_t5x_source(shape, d1, d0)
  with pytest.raises(ValueError, match=r"Param 'q'.*fit 2 factorings.*param_axes=") as raised:
    t5x_optim.convert_state(source, OptaxWrapper(optax.adam(1e-3)), missing="init")
  assert str((d1, d0)) in str(raised.value)
  unknown = ("embed", "layers", "heads", "my_kv") if layout == "axis_1" else ("a", "b", "c", "d")
  with pytest.raises(ValueError, match=r"Param 'q'.*standard_logical_factor_rules"):
    t5x_optim.convert_state(
      source, OptaxWrapper(optax.adam(1e-3)), param_axes={"q": unknown}, missing="init"
    )


class _StateDict:
  def __init__(self, state_dict):
    self._state_dict = state_dict

  def state_dict(self):
    return self._state_dict


@pytest.mark.slow
def test_a_t5x_checkpoint_of_a_scanned_kernel_restores_over_the_train_states_axes(tmp_path):
  """`restore_converted` (and so ``--init_from``) gives the conversion the target's axes."""
  axes, shape, (d1, d0) = SCANNED["axis_1"]
  source, v_row, v_col = _scanned_t5x_source(shape, d1, d0)
  t5x_optim.save_t5x_checkpoint(tmp_path, _StateDict(source), step=T)
  boxed = nn.LogicallyPartitioned(jnp.ones(shape), axes)
  target = t5x_optim.TrainState.create(optimizers.adamw(1e-3), {"params": {"q": boxed}})
  state, _ = t5x_optim.restore_converted(tmp_path, target, missing="init")
  nu = state.param_states[0].nu["q"]
  _assert_close(nu / _decay(0.999, T), _t5x_estimate(v_row, v_col, d1, d0))


@pytest.mark.slow
@pytest.mark.skipif(not t5x_at_hand(), reason="needs T5X_SRC and T5X's dependencies")
def test_t5xs_own_adafactor_of_a_scanned_kernel_converts_over_its_axes():
  """data/t5x_adafactor/scanned_with_t5x.py, in a fresh process with T5X's own code."""
  _runs_ok(T5X_DATA / "scanned_with_t5x.py")


def test_moments_the_new_optimizer_does_not_use_are_listed_as_dropped():
  """Adam into plain SGD keeps no moment: its mu and nu are read and then discarded, and
  the report says so (before, every section was empty)."""
  _, report = t5x_optim.convert_state(_optimizer(BY_NAME["adam"]), OptaxWrapper(optax.sgd(1e-3)))
  assert report.dropped == (
    "0 (ScaleByAdamState): mu of 2 params, not used by the new optimizer (e.g. dense/bias)",
    "0 (ScaleByAdamState): nu of 2 params, not used by the new optimizer (e.g. dense/bias)",
  ), report
  _, report = t5x_optim.convert_state(
    _optimizer(BY_NAME["adam"]), OptaxWrapper(optax.sgd(1e-3, momentum=0.9))
  )
  assert report.dropped == (
    "0 (ScaleByAdamState): nu of 2 params, not used by the new optimizer (e.g. dense/bias)",
  ), report


def test_each_written_field_has_its_own_line():
  """AMSGrad's nu_max, written from the source's nu, was counted under nu (4 params for 2)
  and had no line of its own."""
  _, report = t5x_optim.convert_state(
    _optimizer(BY_NAME["adam"]), OptaxWrapper(BY_NAME["amsgrad"].make())
  )
  assert report.converted == (
    "0 (ScaleByAmsgradState).mu: 2 params, from 0 (ScaleByAdamState)",
    "0 (ScaleByAmsgradState).nu: 2 params, from 0 (ScaleByAdamState)",
    "0 (ScaleByAmsgradState).nu_max: 2 params, from 0 (ScaleByAdamState)",
  ), report


def test_a_converted_field_names_the_states_it_was_written_from():
  """A field's line named the source states of every moment its params had: Adafactor's
  momentum into RMSProp's nu was 'from 0 (FactoredState), 4 (EmaState)' while dropped said
  the EmaState's mu was not used."""
  _, report = t5x_optim.convert_state(
    _optimizer(BY_NAME["adafactor_momentum"]),
    OptaxWrapper(optax.rmsprop(1e-3)),
    source_hparams=HPARAMS,
  )
  assert report.converted == ("0 (ScaleByRmsState).nu: 2 params, from 0 (FactoredState)",)
  assert report.dropped == (
    "4 (EmaState): mu of 2 params, not used by the new optimizer (e.g. dense/bias)",
  ), report
  _, report = t5x_optim.convert_state(
    _optimizer(BY_NAME["adafactor_momentum"]),
    OptaxWrapper(optax.adam(1e-3)),
    source_hparams=HPARAMS,
  )
  assert report.converted == (  # Adam's mu is written only with nu.
    "0 (ScaleByAdamState).mu: 2 params, from 0 (FactoredState), 4 (EmaState)",
    "0 (ScaleByAdamState).nu: 2 params, from 0 (FactoredState)",
  ), report


def test_the_report_names_the_states_types_and_fields():
  """SGD's trace was reported as its '.mu', and adamax's state, optax's ScaleByAdamState, as
  'AdamaxState', the type the conversion reads it as."""
  _, report = t5x_optim.convert_state(
    _optimizer(BY_NAME["adam"]), OptaxWrapper(optax.sgd(1e-3, momentum=0.9)), missing="init"
  )
  assert report.converted == ("0 (TraceState).trace: 2 params, from 0 (ScaleByAdamState)",)
  _, report = t5x_optim.convert_state(_optimizer(BY_NAME["adam"]), OptaxWrapper(optax.adamax(1e-3)))
  assert report.converted == (
    "0 (ScaleByAdamState of adamax).mu: 2 params, from 0 (ScaleByAdamState)",
    "0 (ScaleByAdamState of adamax).nu: 2 params, from 0 (ScaleByAdamState)",
  ), report
  _, report = t5x_optim.convert_state(_optimizer(BY_NAME["adamax"]), OptaxWrapper(optax.lion(1e-3)))
  assert report.converted == (
    "0 (ScaleByLionState).mu: 2 params, from 0 (ScaleByAdamState of adamax)",
  ), report


def test_fields_neither_read_nor_written_are_listed():
  """Adan's v (started at 0 by design) and g, and AMSGrad's nu_max, were neither read nor
  converted, and the report said nothing of them. A field the new state keeps at its
  initial value by design is listed as initialised (and not refused, as a value the source
  lacks is), one of the old state no converter reads as dropped."""
  _, report = t5x_optim.convert_state(
    _optimizer(BY_NAME["adan"]), OptaxWrapper(BY_NAME["adan"].make()), target_hparams={"b1": 0.9}
  )
  assert report.initialised == (
    "0 (ScaleByAdanState).v (gradient differences: their expectation, 0): 2 params at the "
    "initial value by design (e.g. dense/bias)",
  ), report
  assert report.dropped == ("0/v (ScaleByAdanState.v)", "0/g (ScaleByAdanState.g)"), report
  _, report = t5x_optim.convert_state(
    _optimizer(BY_NAME["amsgrad"]), OptaxWrapper(optax.sgd(1e-3, momentum=0.9))
  )
  assert report.dropped == (
    "0/nu_max (ScaleByAmsgradState.nu_max)",
    "0 (ScaleByAmsgradState): nu of 2 params, not used by the new optimizer (e.g. dense/bias)",
  ), report


@pytest.mark.slow
def test_moments_galore_keeps_projected_are_neither_written_nor_read():
  """GaLore keeps a projected kernel's moments in its projected space, a square kernel's (rank
  at least its size) in its param's shape too: Adam's param-space moments were written there
  (the square's reported as converted, the other's failing the first step), and read back
  out of it as param-space moments."""
  rng = np.random.default_rng(0)
  params = {
    "square": jnp.asarray(rng.normal(size=(8, 8)), jnp.float32),
    "wi": jnp.asarray(rng.normal(size=(16, 8)), jnp.float32),
    "b": jnp.ones(8),
  }
  axes = {
    "square": PartitionSpec("embed", "mlp"),
    "wi": PartitionSpec("embed", "mlp"),
    "b": PartitionSpec("mlp"),
  }
  grads = jax.tree.map(jnp.ones_like, params)
  old = OptaxWrapper(optax.adam(0.1)).create(params).apply_gradient(grads)
  target = optimizers.galore(0.01, rank=8)
  with pytest.raises(ValueError, match=r"mu \(kept in GaLore's projected space\): 2 params"):
    t5x_optim.convert_state(old, target, param_axes=axes)
  new, report = t5x_optim.convert_state(old, target, missing="init", param_axes=axes)
  base = new.state.param_states[0].base_optimizer_state
  assert base.mu["square"].shape == (8, 8) and base.mu["wi"].shape == (8, 8)
  assert float(jnp.abs(base.mu["square"]).max()) == float(jnp.abs(base.mu["wi"]).max()) == 0.0
  np.testing.assert_allclose(base.mu["b"], old.state.param_states[0].mu["b"], rtol=1e-6)
  assert any("projected space): 2 params" in entry for entry in report.initialised)
  assert all("1 params" in entry for entry in report.converted if ".mu" in entry)
  stepped = new.apply_gradient(grads)
  assert stepped.target["wi"].shape == (16, 8)
  back, report = t5x_optim.convert_state(stepped, OptaxWrapper(optax.adam(0.1)), missing="init")
  assert any("of 2 params kept in GaLore's projected space" in e for e in report.dropped)
  assert float(jnp.abs(back.state.param_states[0].mu["square"]).max()) == 0.0
  assert float(jnp.abs(back.state.param_states[0].mu["b"]).max()) > 0.0


@pytest.mark.parametrize("boxed", [False, True], ids=["plain", "boxed"])
def test_galores_projectors_start_fresh_by_design_without_a_refusal(boxed):
  """GaLore recomputes its projectors at its count 0, where a converted GaLore starts: with
  no param projected, nothing is lost and the conversion goes through without
  ``missing="init"``, the projectors listed as fresh by design, as MultiSteps' accumulator;
  with params in flax boxes too (their projectors are boxes)."""
  params = {"bias": jnp.ones(8), "scale": jnp.ones(8)}
  if boxed:
    params = {name: nn.Partitioned(x, ("mlp",)) for name, x in params.items()}
  old = OptaxWrapper(optax.adam(0.1)).create(params)
  old = old.apply_gradient(jax.tree.map(jnp.ones_like, old.target))
  new, report = t5x_optim.convert_state(old, optimizers.galore(0.01, rank=8))
  assert report.initialised == (
    "0/projector (GaLoreState.projector): at the initial value by design (recomputed at "
    "the state's count 0)",
  )
  base = new.state.param_states[0].base_optimizer_state
  np.testing.assert_allclose(
    jax.tree.leaves(base.mu["bias"]), jax.tree.leaves(old.state.param_states[0].mu["bias"])
  )
  _, report = t5x_optim.convert_state(old, OptaxWrapper(optax.MultiSteps(optax.adam(0.1), 2)))
  assert report.initialised == (
    "acc_grads (MultiStepsState.acc_grads): at the initial value by design (the gradients "
    "accumulated towards the next update)",
  )


@pytest.mark.slow
def test_a_galore_base_state_of_projected_params_only_starts_at_count_0():
  """Every moment kept fresh (all params projected): the base optimizer's count was the old
  step's all the same, so its bias correction took the fresh moments for long averages."""
  params = {"square": jnp.ones((8, 8))}
  old = OptaxWrapper(optax.adam(0.1)).create(params)
  for _ in range(3):
    old = old.apply_gradient(jax.tree.map(jnp.ones_like, params))
  new, report = t5x_optim.convert_state(
    old,
    optimizers.galore(0.01, rank=8),
    missing="init",
    param_axes={"square": PartitionSpec("embed", "mlp")},
  )
  assert report.converted == ()
  assert int(new.state.param_states[0].base_optimizer_state.count) == 0
  assert int(new.state.step) == 3


@pytest.mark.slow
@pytest.mark.parametrize("set_mesh", [False, True], ids=["no_mesh_in_context", "under_set_mesh"])
@pytest.mark.parametrize(
  "axis_type",
  [jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit],
  ids=["auto", "explicit"],
)
def test_converting_into_an_optimizer_with_its_step_on_one_device(axis_type, set_mesh):
  """An optimizer over params on a mesh whose step is on one device: one program placed the
  converted state on both ("Received incompatible devices for jitted computation"), and under
  `jax.set_mesh` jax refused the step beside the mesh. The state is the conversion into its
  definition's, in the target's shardings. An eagerly created optimizer held its step so, and
  a jitted step of what was converted into it or restored into it failed the same way: its
  step is now on the params' mesh."""
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type,) * 2)
  split = jax.sharding.NamedSharding(mesh, PartitionSpec("data", "model"))
  params = {"w": jax.device_put(jnp.linspace(-1.0, 1.0, 64).reshape(8, 8), split)}
  source = OptaxWrapper(optax.adam(0.1)).create(params)
  source = source.apply_gradient(jax.tree.map(jnp.cos, params))
  created = OptaxWrapper(optax.sgd(0.1, momentum=0.9)).create(params)
  assert created.state.step.sharding == jax.sharding.NamedSharding(mesh, PartitionSpec())
  one_device = created.state.replace(step=jax.device_put(created.state.step, jax.devices()[0]))
  step = jax.jit(lambda o: o.apply_gradient(jax.tree.map(jnp.cos, o.target)))
  for target in created, created.replace(state=one_device):
    with jax.set_mesh(mesh) if set_mesh else contextlib.nullcontext():
      got, _ = t5x_optim.convert_state(source, target, missing="init")
    want, _ = t5x_optim.convert_state(source, target.optimizer_def, missing="init")
    for x, y, like in zip(*(jax.tree.leaves(t) for t in (got, want, target)), strict=True):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
      assert x.sharding == like.sharding
  assert int(step(t5x_optim.convert_state(source, created, missing="init")[0]).state.step) == 2


@pytest.mark.slow
def test_convert_state_traced_under_jit():
  """`convert_state` under `jax.jit` or `jax.eval_shape`: its placement ran jax.set_mesh and
  jax.sharding.get_mesh, which jax refuses under jit ("can only be used outside of jax.jit");
  traced, it places values by their types, as before."""
  params = {"w": jnp.linspace(-1.0, 1.0, 16).reshape(4, 4)}
  source = OptaxWrapper(optax.sgd(0.1, momentum=0.5)).create(params)
  target = OptaxWrapper(optax.lion(0.1))
  abstract = jax.eval_shape(lambda s: t5x_optim.convert_state(s, target, missing="init")[0], source)
  jitted = jax.jit(lambda s: t5x_optim.convert_state(s, target.create(params), missing="init")[0])
  eager = t5x_optim.convert_state(source, target, missing="init")[0]
  for x, y, z in zip(*(jax.tree.leaves(t) for t in (abstract, jitted(source), eager)), strict=True):
    assert x.shape == y.shape == z.shape
    np.testing.assert_array_equal(np.asarray(y), np.asarray(z))


def _nan_at(i: int, bad: bool) -> dict[str, jax.Array]:
  grads = jnp.full((16, 16), 0.1 * (i + 1))
  return {"w": grads.at[0, 0].set(jnp.nan if bad else 0.1)}


@pytest.mark.slow
def test_apply_if_finite_counts_carry_into_a_guard_and_are_reported_dropped_without():
  """Converting into another optimizer under `optax.apply_if_finite` reset its counts of
  non-finite updates to 0 and the report listed nothing: the consecutive-error guard started
  over (two more NaN gradients were skipped where the source, at 2 of 3, lets the next
  through). They carry over when source and target each have one guard, and the report
  says so; a target without a guard reports them dropped."""
  params = {"w": jnp.ones((16, 16))}
  source = OptaxWrapper(optax.apply_if_finite(optax.adam(1e-2), 3)).create(params)
  for i, bad in enumerate([0, 1, 0, 0, 1, 1]):
    source = source.apply_gradient(_nan_at(i, bad))
  counts = ("notfinite_count", "last_finite", "total_notfinite")
  want = [int(getattr(source.state.param_states, name)) for name in counts]
  assert want == [2, 0, 3]
  for inner in (optax.adam(1e-2), t5x_optim.low_precision(optax.adam(1e-2), "8bit", min_size=0)):
    target = OptaxWrapper(optax.apply_if_finite(inner, 3))
    converted, report = t5x_optim.convert_state(source, target)
    assert [int(getattr(converted.state.param_states, name)) for name in counts] == want
    assert any(
      "ApplyIfFiniteState" in line and "notfinite_count" in line for line in report.converted
    ), report
    continued = converted.apply_gradient(_nan_at(9, True)).apply_gradient(_nan_at(9, True))
    assert not bool(jnp.isfinite(continued.target["w"]).all())
  _, report = t5x_optim.convert_state(source, OptaxWrapper(optax.adam(1e-2)))
  assert any("ApplyIfFiniteState" in line for line in report.dropped), report


@pytest.mark.slow
def test_convert_state_of_adams_state_under_jit():
  """Adam's and adamax's states are told apart by stepping a small copy of the params:
  under `jax.jit` its counts were tracers ("Abstract tracer value encountered"), so no
  state holding Adam's state type converted traced; it converts as eagerly."""
  params = {"w": jnp.linspace(-1.0, 1.0, 16).reshape(4, 4)}
  source = OptaxWrapper(optax.adam(0.1)).create(params).apply_gradient(params)
  target = OptaxWrapper(optax.apply_if_finite(optax.adamax(0.1), 3)).create(params)
  eager = t5x_optim.convert_state(source, target)[0]
  traced = jax.jit(lambda s, t: t5x_optim.convert_state(s, t)[0])(source, target)
  for x, y in zip(jax.tree.leaves(traced), jax.tree.leaves(eager), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow
def test_apply_if_finite_counts_in_multi_optimizer_groups_start_at_0_reported():
  """Guards in `MultiOptimizer` groups: a group's place does not say which params it guards
  (paired by place, groups listed in another order gave the kernels' counts to the biases'
  guard, reported as converted), so they start at 0, reported; one guard over the kernels
  and one over the biases count different updates, and start at 0, reported."""
  params = {"kernel": jnp.ones((8, 8)), "bias": jnp.ones((8,))}

  def groups(kernel, bias, *, order=("kernel", "bias")):
    inner = {"kernel": kernel, "bias": bias}
    return t5x_optim.MultiOptimizer(
      [(t5x_optim.PathFilter(name), OptaxWrapper(inner[name])) for name in order]
    )

  guard = lambda inner: optax.apply_if_finite(inner, 5)  # noqa: E731
  source = groups(guard(optax.adam(1e-2)), guard(optax.sgd(0.1, 0.9))).create(params)
  for bad in (0, 1, 1):
    grads = {"kernel": jnp.full((8, 8), jnp.nan if bad else 0.1), "bias": jnp.full((8,), 0.1)}
    source = source.apply_gradient(grads)
  assert int(source.state.param_states[0].param_states.notfinite_count) == 2
  reordered = groups(guard(optax.adam(1e-2)), guard(optax.sgd(0.1, 0.9)), order=("bias", "kernel"))
  converted, report = t5x_optim.convert_state(source, reordered)
  for group in (0, 1):
    assert int(converted.state.param_states[group].param_states.notfinite_count) == 0
  assert not any("ApplyIfFiniteState" in line for line in report.converted), report
  assert sum("ApplyIfFiniteState): its counts" in line for line in report.initialised) == 2
  apart = groups(optax.adam(1e-2), guard(optax.sgd(0.1, 0.9)))
  converted, report = t5x_optim.convert_state(
    groups(guard(optax.adam(1e-2)), optax.sgd(0.1, 0.9)).create(params), apart, missing="init"
  )
  assert any(
    "ApplyIfFiniteState): its counts of non-finite updates at the initial value" in line
    for line in report.initialised
  ), report
