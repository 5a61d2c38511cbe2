"""`low_precision`: numerics against a reference written out here, over the table, and refusals."""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from optimizer_table import (
  LOW_PRECISION_MODES,
  TABLE,
  Case,
  assert_same_bits,
  grads_and_extras,
  initial_params,
  make_params,
  to_numpy,
)

from t5x_optim import (
  LowPrecisionState,
  OptaxWrapper,
  QuantizedLeaf,
  float32_to_low_precision,
  low_precision,
  low_precision_sum_squares,
  low_precision_to_float32,
  restore_t5x_checkpoint,
  save_t5x_checkpoint,
)
from t5x_optim._low_precision.low_precision import leaf_storage
from t5x_optim._low_precision.quantize import _codes as quantize_codes
from t5x_optim._low_precision.quantize import (
  dequantize,
  dynamic_map,
  extreme_scale,
  quantize,
  rounding_bits,
  to_bfloat16,
)
from t5x_optim._low_precision.quantize4 import signed_map4

pytestmark = pytest.mark.usefixtures("shared_compilation_cache")

STEPS = 3
MODES = ["8bit", "bfloat16"]


# The reference: quantize and dequantize in numpy, one block at a time.


@functools.cache
def ref_thresholds(signed: bool) -> np.ndarray:
  """The 255 thresholds between map values: decade i's inner ones (n/9 + k + 1) * (0.9 10^(i-6) / n).

  Each decade of n values has n - 1 inner thresholds, computed in float32
  as written; the thresholds next to 0, between decades and next to 1 are
  the means of their two map values, except the unsigned map's first: 0,
  so that only 0 encodes as 0. The signed map's negative half mirrors.
  Computed once per sign (every block of the reference asks), and read-only.
  """
  table = dynamic_map(signed)
  positive_values = table[127:] if signed else table
  thresholds, first = [], 1
  for i in range(7):
    n = 2**i if signed else 2 ** (i + 1)
    last_before = positive_values[first - 1]
    boundary = (last_before + positive_values[first]) / np.float32(2)
    thresholds.append(np.float32(0) if i == 0 and not signed else boundary)
    scale = np.float32(10.0) ** np.float32(i - 6)
    for k in range(n - 1):
      a = np.float32(n) / np.float32(9)
      b = (np.float32(0.9) * scale) / np.float32(n)
      thresholds.append((a + np.float32(k + 1)) * b)
    first += n
  thresholds.append((positive_values[-2] + positive_values[-1]) / np.float32(2))
  positive = np.asarray(thresholds, np.float32)
  out = np.concatenate([-positive[-2::-1], positive]) if signed else positive
  out.setflags(write=False)
  return out


def ref_extreme_scale(absmax: np.float32, most_negative: np.float32) -> np.float32:
  """The smallest float32 whose product with the map's most negative magnitude (float32) is
  at least ``absmax``: the scale of a block whose largest magnitude is negative."""
  scale = np.float32(absmax / np.float64(most_negative))
  while most_negative * scale < absmax:
    scale = np.nextafter(scale, np.float32(np.inf))
  while most_negative * np.nextafter(scale, np.float32(0)) >= absmax:
    scale = np.nextafter(scale, np.float32(0))
  return scale


def ref_quantize(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
  """Block-wise dynamic 8-bit quantization, written out element by element over blocks."""
  flat = x.reshape(-1, block)
  codes = np.zeros(flat.shape, np.uint8)
  scales = np.zeros(len(flat), np.float32)
  for b, values in enumerate(flat):
    absmax = np.max(np.abs(values))
    signed = bool(np.min(values) < 0)
    if absmax > 0 and np.min(values) == -absmax:
      absmax = ref_extreme_scale(absmax, -dynamic_map(True)[0])
    middles = ref_thresholds(signed)
    scaled = values / (absmax if absmax > 0 else np.float32(1))
    codes[b] = np.searchsorted(middles, scaled, side="left")
    scales[b] = -absmax if signed else absmax
  return codes.reshape(x.shape), scales.reshape(*x.shape[:-1], -1)


def ref_dequantize(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
  block = codes.shape[-1] // scales.shape[-1]
  flat, flat_scales = codes.reshape(-1, block), scales.reshape(-1)
  out = np.stack(
    [dynamic_map(bool(s < 0))[c] * np.abs(s) for c, s in zip(flat, flat_scales, strict=True)]
  )
  return out.reshape(codes.shape)


def ref_hash32(x: np.ndarray) -> np.ndarray:
  x = x ^ (x >> np.uint32(16))
  x = x * np.uint32(0x7FEB352D)
  x = x ^ (x >> np.uint32(15))
  x = x * np.uint32(0x846CA68B)
  return x ^ (x >> np.uint32(16))


def ref_bits(shape, seed, count, leaf) -> np.ndarray:
  """16 random bits per element: its row-major index hashed with a key of seed, step, leaf."""
  one = functools.partial(np.array, dtype=np.uint32, ndmin=1)
  key = ref_hash32(ref_hash32(ref_hash32(one(seed)) ^ one(count)) ^ one(leaf))
  index = np.arange(math.prod(shape), dtype=np.uint32).reshape(shape)
  return ref_hash32(index * np.uint32(0x9E3779B9) + key) >> np.uint32(16)


def ref_bfloat16(x: np.ndarray, bits: np.ndarray | None) -> np.ndarray:
  """Round to bfloat16: add 16 random bits below the kept mantissa, then truncate."""
  if bits is None:
    return np.asarray(jnp.asarray(x).astype(jnp.bfloat16))
  rounded = ((x.view(np.uint32) + bits) & np.uint32(0xFFFF0000)).view(np.float32)
  return np.asarray(jnp.asarray(np.where(np.isfinite(x), rounded, x)).astype(jnp.bfloat16))


def ref_block(last_dim: int, block_size: int, shard_multiple: int) -> int:
  """The largest block that tiles ``last_dim`` into a multiple of its shard count."""
  rest = last_dim // math.gcd(last_dim, shard_multiple)
  return max(b for b in range(1, min(block_size, rest) + 1) if rest % b == 0)


def ref_compress(
  inner_state, storage, count, *, seed, block_size, shard_multiple=8, stochastic=True
):
  leaves, treedef = jax.tree.flatten(to_numpy(inner_state))
  out = []
  for i, (leaf, kind) in enumerate(zip(leaves, storage, strict=True)):
    if kind == "8bit":
      block = ref_block(leaf.shape[-1], block_size, shard_multiple)
      out.append(QuantizedLeaf(*ref_quantize(leaf, block)))
    elif kind == "bfloat16":
      out.append(ref_bfloat16(leaf, ref_bits(leaf.shape, seed, count, i) if stochastic else None))
    else:
      out.append(leaf)
  return treedef.unflatten(out)


def ref_expand(compressed, storage):
  leaves, treedef = jax.tree.flatten(compressed, is_leaf=lambda x: isinstance(x, QuantizedLeaf))
  out = []
  for leaf, kind in zip(leaves, storage, strict=True):
    if kind == "8bit":
      leaf = ref_dequantize(np.asarray(leaf.codes), np.asarray(leaf.scales))
    elif kind == "bfloat16":
      leaf = np.asarray(leaf, np.float32)
    out.append(jnp.asarray(leaf))
  return treedef.unflatten(out)


@pytest.mark.usefixtures("xla_optimized")
@pytest.mark.slow
def test_quantize_matches_reference_bit_for_bit():
  rng = np.random.default_rng(0)
  x = np.concatenate(
    [
      rng.normal(size=(3, 64)) * 10.0 ** rng.integers(-8, 3, size=(3, 1)),
      np.abs(rng.normal(size=(2, 64))) * 1e-3,  # non-negative blocks: the unsigned map
      np.zeros((1, 64)),
    ]
  ).astype(np.float32)
  state = low_precision(
    optax.sgd(0.1, momentum=0.9), "8bit", block_size=16, shard_multiple=1, min_size=0
  ).init({"w": jnp.asarray(x)})
  leaf = state.inner_state[0].trace["w"]
  assert isinstance(leaf, QuantizedLeaf) and leaf.scales.shape == (6, 4)
  codes, scales = ref_quantize(x, 16)
  got = jax.jit(quantize, static_argnums=1)(jnp.asarray(x), 16)
  np.testing.assert_array_equal(np.asarray(got.codes), codes)
  np.testing.assert_array_equal(np.asarray(got.scales), scales)
  assert (scales[3:5] > 0).all() and (scales[:3] < 0).all() and (scales[5] == 0).all()
  back = np.asarray(jax.jit(dequantize)(got))
  np.testing.assert_array_equal(back, ref_dequantize(codes, scales))
  # The flat form (per-block values spread over the leaf's shape) is the same codec.
  flat = jax.jit(functools.partial(quantize, flat=True), static_argnums=1)(jnp.asarray(x), 16)
  np.testing.assert_array_equal(np.asarray(flat.codes), codes)
  np.testing.assert_array_equal(np.asarray(flat.scales), scales)
  np.testing.assert_array_equal(
    np.asarray(jax.jit(dequantize, static_argnames="flat")(got, flat=True)), back
  )
  # The top decade of a block keeps a relative error of a few percent.
  top = np.abs(x) >= 0.1 * np.abs(x).max(axis=1, keepdims=True)
  top &= x != 0
  assert np.max(np.abs(back - x)[top] / np.abs(x)[top]) < 0.08


def bitsandbytes_map(signed: bool) -> np.ndarray:
  """``bitsandbytes.functional.create_dynamic_map(signed)``, as bitsandbytes computes it."""
  values = [0.0, 1.0]
  for i in range(7):
    items = 2**i + 1 if signed else 2 ** (i + 1) + 1
    bounds = np.linspace(0.1, 1, items, dtype=np.float32)
    means = (bounds[:-1] + bounds[1:]) / np.float32(2)
    decade = (np.float32(10.0 ** (i - 6)) * means).tolist()
    values += decade + ([-v for v in decade] if signed else [])
  return np.sort(np.asarray(values, np.float32))


@pytest.mark.parametrize("signed", [True, False])
def test_map_is_bitsandbytes_within_3_ulps_and_decodes_without_lookup(signed):
  table = dynamic_map(signed)
  assert np.abs(table.view(np.int32) - bitsandbytes_map(signed).view(np.int32)).max() <= 3
  assert len(np.unique(table)) == 256
  codes = np.arange(256, dtype=np.uint8).reshape(1, 256)
  scales = np.float32([-1.0 if signed else 1.0])
  got = jax.jit(dequantize)(QuantizedLeaf(jnp.asarray(codes), jnp.asarray(scales)))
  np.testing.assert_array_equal(np.asarray(got)[0], table)


@pytest.mark.parametrize("signed", [True, False])
def test_codes_match_the_thresholds_at_ties_and_every_decade(signed):
  """The gather-free encoder counts exactly the thresholds below each value."""
  thresholds, table = ref_thresholds(signed), dynamic_map(signed)
  assert ((table[:-1] < thresholds) | (thresholds == 0)).all() and (thresholds < table[1:]).all()
  middles = (table[:-1] + table[1:]) / np.float32(2)
  ulps = np.abs(thresholds.view(np.int32) - middles.view(np.int32))
  assert ulps[thresholds != 0].max() <= 2
  rng = np.random.default_rng(1)
  powers = np.float32(10.0) ** np.arange(-8, 1, dtype=np.float32)
  special = np.float32([0, 1, 1e-30, 1e-7, 1.5e-7, 1.6e-7, 3e-7])
  values = np.concatenate(
    [
      *(np.nextafter(v, d) for v in (thresholds, table, powers) for d in (-np.inf, np.inf)),
      thresholds,
      table,
      powers,
      special,
      np.float32(10.0) ** rng.uniform(-9, 0, 20000).astype(np.float32),
    ]
  )
  values = np.clip(values, -1, 1).astype(np.float32)
  values = np.concatenate([values, -values]) if signed else np.abs(values)
  got = jax.jit(quantize_codes)(jnp.asarray(values), jnp.full(values.shape, signed))
  flushed = np.where(np.abs(values) < np.finfo(np.float32).tiny, 0, values)  # as XLA does
  np.testing.assert_array_equal(np.asarray(got), np.searchsorted(thresholds, flushed, side="left"))


def _extreme_blocks(block: int) -> np.ndarray:
  """Blocks whose extremes the codecs' scales must survive decoding: a negative extreme at
  every magnitude and at the edges of its binade, a tie, all negative, all 0, non-finite."""
  rng = np.random.default_rng(5)
  x = rng.normal(size=(96, block)) * 10.0 ** rng.integers(-8, 4, size=(96, 1))
  x[:48, 0] = -np.abs(x[:48]).max(axis=1) * 1.5  # a negative extreme
  one = np.float32(1)
  edges = [np.nextafter(one, np.float32(0)), one, np.nextafter(one, np.float32(2))]
  edges += [np.float32(2) - np.float32(2**-23) * k for k in range(1, 40)]
  edges += [np.float32(1) + np.float32(2**-23) * k for k in range(1, 40)]
  near = rng.uniform(-0.5, 0.5, size=(len(edges), block))
  near[:, 1] = -np.asarray(edges)
  tie = rng.uniform(-1, 1, size=(1, block))
  tie[0, :2] = 1.25, -1.25
  non_finite = rng.uniform(-1, 1, size=(3, block))
  non_finite[:, 0] = -2.0
  non_finite[0, 1], non_finite[1, 1], non_finite[2, 1] = np.inf, -np.inf, np.nan
  rows = [x, near, tie, -np.abs(rng.normal(size=(1, block))), np.zeros((1, block)), non_finite]
  return np.concatenate(rows).astype(np.float32)


def test_decode_and_encode_again_is_the_identity_for_signed_blocks():
  """A block whose largest magnitude is negative decodes it as that magnitude (to an ulp),
  so encoding the decoded values gives the same codes and scales, round trip after round
  trip; a tie decodes both extremes alike."""
  x = _extreme_blocks(16)
  first = quantize(jnp.asarray(x), 16)
  back = np.asarray(dequantize(first))
  finite = np.isfinite(x)
  absmax = np.where(finite, np.abs(x), 0).max(axis=1)
  extreme = np.argmax(np.where(finite, np.abs(x), 0), axis=1)
  rows = np.arange(len(x))
  negative = x[rows, extreme] < 0
  decoded = back[rows, extreme][negative]
  assert (np.abs(-decoded - absmax[negative]) <= np.spacing(absmax[negative])).all()
  tie = np.flatnonzero((x[:, 0] == 1.25) & (x[:, 1] == -1.25))[0]
  assert back[tie, 0] == -back[tie, 1]
  stored = first
  for _ in range(100):
    stored = quantize(dequantize(stored), 16)
    np.testing.assert_array_equal(np.asarray(stored.codes), np.asarray(first.codes))
    np.testing.assert_array_equal(np.asarray(stored.scales), np.asarray(first.scales))


@pytest.mark.parametrize("most_negative", [dynamic_map(True)[0], signed_map4()[0]], ids=["8", "4"])
def test_the_scale_of_a_negative_extreme_is_the_smallest_that_decodes_it(most_negative):
  """Over every float32 mantissa: the scale's product with the map's least value's magnitude
  reaches the largest magnitude, and the float below's does not (the search looks at the
  quotient and the floats next to it)."""
  m = np.float32(-most_negative)
  largest = (np.arange(2**23, dtype=np.uint32) | np.uint32(0x3F800000)).view(np.float32)
  key = jnp.ones(largest.shape, jnp.uint32)
  scale = np.asarray(jax.jit(extreme_scale, static_argnums=2)(largest, key, float(m)))
  assert (m * scale >= largest).all()
  assert (m * np.nextafter(scale, np.float32(0)) < largest).all()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["8bit", "4bit"])
def test_multisteps_mini_steps_leave_the_stored_moments_as_they_are(mode):
  """MultiSteps returns adam's moments unchanged on its mini-steps; stored, they decode and
  encode again, and stay bit for bit what they were."""
  params = {"w": jax.random.normal(jax.random.key(0), (16, 256))}
  inner = optax.MultiSteps(optax.adam(1e-2), 4).gradient_transformation()
  opt = OptaxWrapper(low_precision(inner, mode, min_size=0)).create(params)
  step = jax.jit(lambda o, g: o.apply_gradient(g))
  moments = []
  for i in range(7):
    opt = step(opt, {"w": jax.random.normal(jax.random.key(i + 7), (16, 256)) * (1 + i)})
    adam = opt.state.param_states.inner_state.inner_opt_state[0]
    moments.append(to_numpy((adam.mu, adam.nu)))
  for later in moments[4:]:
    assert_same_bits(later, moments[3])


@pytest.mark.parametrize("mode", LOW_PRECISION_MODES)
def test_multisteps_accumulator_is_kept_unless_states_selects_it(mode):
  """MultiSteps's summed gradients were stored in the mode and encoded again at each
  mini-step, so the applied mean drifted with the number of mini-steps (4 bits, 32
  mini-steps: 0.61 relative error) without a word. They are kept as the inner state has them,
  and the update is float32 MultiSteps's bit for bit; ``states=`` naming them stores them in
  the mode, and one naming only their param keeps them."""
  params = {"w": jnp.zeros((16, 256))}
  inner = optax.MultiSteps(optax.sgd(1.0), 4).gradient_transformation()
  tx = low_precision(inner, mode, min_size=0)
  state, want_state = tx.init(params), inner.init(params)
  storage = leaf_storage(state)
  assert storage[("inner_state", "acc_grads", "w")] == "float32: a gradient accumulator"
  for i in range(4):
    grads = {"w": jnp.sin(jnp.arange(16 * 256.0).reshape(16, 256) * (i + 1.3))}
    got, state = tx.update(grads, state, params)
    want, want_state = inner.update(grads, want_state, params)
  assert_same_bits(to_numpy(got), to_numpy(want))
  selected = leaf_storage(low_precision(inner, mode, min_size=0, states="acc").init(params))
  kinds = [kind for path, kind in selected.items() if path[:2] == ("inner_state", "acc_grads")]
  assert kinds and all(kind.startswith(mode) for kind in kinds), selected
  by_param = leaf_storage(low_precision(inner, mode, min_size=0, states="w").init(params))
  assert by_param[("inner_state", "acc_grads", "w")] == "float32: a gradient accumulator"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["8bit", "4bit"])
def test_a_steady_negative_gradient_moves_a_param_as_a_positive_one_does(mode):
  """The signed maps hold +1 but not -1: a block whose largest magnitude is negative is
  scaled so that the map's most negative value decodes as it, and adam moves a param under
  a gradient of -1 as far as under +1, and as far as in float32."""
  params = {"w": jnp.zeros((16, 256))}
  moved = {}
  for sign in (-1.0, 1.0):
    opt = OptaxWrapper(low_precision(optax.adam(1e-2), mode, min_size=0)).create(params)
    step = jax.jit(lambda o, g: o.apply_gradient(g))
    for _ in range(20):
      opt = step(opt, {"w": jnp.full((16, 256), sign)})
    moved[sign] = np.asarray(opt.target["w"])
  np.testing.assert_allclose(moved[-1.0], -moved[1.0], rtol=1e-6)
  np.testing.assert_allclose(moved[1.0], -0.2, rtol=1e-5)


def _stablehlo_ops(f, *args):
  return sum(" = " in line for line in jax.jit(f).lower(*args).as_text().splitlines())


def test_each_leafs_codecs_stay_small_in_the_compiled_step():
  """Every 8-bit leaf compiles its own encoder and decoder: their size is the step's compile time.

  One computation serves both maps (the signed map's constants, scaled by
  powers of two), so the encoder is under 300 StableHLO operations and the
  decoder under 160 (a computation per map took 632 and 323: the whole
  train step compiled about 20x slower than with float32 state).
  """
  x = jax.ShapeDtypeStruct((8, 256), jnp.float32)
  leaf = jax.eval_shape(lambda x: quantize(x, 64), x)
  assert _stablehlo_ops(lambda x: quantize(x, 64, guard_nonfinite=False), x) < 300
  assert _stablehlo_ops(dequantize, leaf) < 160


def _fusions_per_leaf(make_tx) -> float:
  """The compiled optimizer step's fusions per param leaf: 4 leaves' count less 2 leaves'."""
  counts = []
  for n in (2, 4):
    params = {f"l{i}": jax.ShapeDtypeStruct((64, 256), jnp.float32) for i in range(n)}
    opt = jax.eval_shape(lambda p: OptaxWrapper(make_tx()).create(p), params)
    step = jax.jit(lambda o, g: o.apply_gradient(g), donate_argnums=0)
    counts.append(step.lower(opt, params).compile().as_text().count(" fusion("))
  return (counts[1] - counts[0]) / 2


@pytest.mark.slow
@pytest.mark.parametrize("mode, most", [("8bit", 11), ("bfloat16", 9)])
def test_each_leaf_compiles_few_fusions_in_the_streamed_step(mode, most):
  """Each fusion is a kernel XLA compiles, unless an identical one was compiled before.

  float32 adamw compiles 3 per leaf. The streamed update runs each leaf in
  a conditional whose branch that never runs returns its operands (no
  fill); inside it, the update and an encoder per state leaf, and (8-bit)
  one reduction per state leaf whose results are the largest magnitude, the
  sign and the reciprocal the encoder multiplies by, the non-finite guard
  being selects inside it, and a per-block fusion forming the stored scale
  (the reduction combines each result in a standard way, so a mesh that
  splits a block can all-reduce it; one custom combination made 9); bfloat16's branch also computes each state leaf's
  stochastic-rounding key (a scalar fusion each), so that the encoders of
  equal leaves are identical and compile once
  (``test_low_precision_streaming.py``). A branch for the guard and
  separate fusions for the scales made 36 per 8-bit leaf; zeros filled in
  the never-run branch, 9 per bfloat16 leaf (with each leaf's own encoders).
  """
  assert _fusions_per_leaf(lambda: optax.adamw(1e-3)) == 3
  assert _fusions_per_leaf(lambda: low_precision(optax.adamw(1e-3), mode, min_size=0)) <= most


def _low(inner, mode, **kwargs):
  """`low_precision` with blocks of 4 along the last dimension, every leaf compressed.

  The whole-tree update (``stream=False``), which the reference spells out; the
  streamed update is held against it in ``test_low_precision_streaming.py``.
  """
  kwargs.setdefault("stream", False)
  return low_precision(inner, mode, block_size=4, shard_multiple=1, min_size=0, **kwargs)


def _update_fn(tx, extras, jit):
  """``tx.update``, jitted or not; callable extra arguments are closed over, arrays passed."""
  fns = {k: v for k, v in extras.items() if callable(v)}

  def update(grads, state, params, arrays):
    return tx.update(grads, state, params, **arrays, **fns)

  return jax.jit(update) if jit else update


def _arrays(extras):
  return {k: v for k, v in extras.items() if not callable(v)}


def _reference_run(make, mode, params, *, jit, stochastic=True, seed=0):
  """The inner transformation in float32, its state stored through the reference between steps.

  Blocks of 4 (``shard_multiple=1``), as `_low` builds them.
  """
  inner = optax.with_extra_args_support(make())
  storage = _low(make(), mode).init(params).storage
  options = dict(seed=seed, block_size=4, shard_multiple=1, stochastic=stochastic)
  compressed = ref_compress(inner.init(params), storage, 0, **options)
  update = None
  for step in range(STEPS):
    grads, extras = grads_and_extras(inner, params)
    update = update or _update_fn(inner, extras, jit)
    updates, state = update(grads, ref_expand(compressed, storage), params, _arrays(extras))
    params = optax.apply_updates(params, updates)
    compressed = ref_compress(state, storage, step + 1, **options)
  return params, compressed


def _wrapped_run(tx, params, *, jit):
  state = tx.init(params)
  update = None
  for _ in range(STEPS):
    grads, extras = grads_and_extras(tx, params)
    update = update or _update_fn(tx, extras, jit)
    updates, state = update(grads, state, params, _arrays(extras))
    params = optax.apply_updates(params, updates)
  return params, state


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", TABLE, ids=repr)
def test_table_matches_reference_bit_for_bit(case, mode):
  """Every optimizer of the table, op by op: the same params and stored state, bit for bit."""
  params = initial_params(case)
  got_params, got_state = _wrapped_run(_low(case.make(), mode), params, jit=False)
  want_params, want_inner = _reference_run(case.make, mode, params, jit=False)
  assert_same_bits(got_params, want_params)
  assert_same_bits(got_state.inner_state, want_inner)
  assert int(got_state.count) == STEPS
  _check_compressed_where_param_shaped(case, got_state, params, mode)


@pytest.mark.usefixtures("xla_optimized")
@pytest.mark.parametrize(
  "mode, stochastic",
  [pytest.param("8bit", True, marks=pytest.mark.slow), ("bfloat16", True), ("bfloat16", False)],
)
@pytest.mark.parametrize(
  "name",
  [
    pytest.param("adamw", marks=pytest.mark.slow),
    pytest.param("lion", marks=pytest.mark.slow),
    "sgd",
  ],
)
@pytest.mark.slow
def test_jitted_update_stores_the_references_state_bit_for_bit(name, mode, stochastic):
  """Dequantize, update and quantize fused in one jitted step: still the reference's bits.

  The stored state bit for bit; the params to 4 float32 ulps. The update is XLA's
  arithmetic on the same values in another program (the reference's has no decode or
  encode in it), and XLA:CPU may round it apart: jax 0.12's fuses Adam's new moments into
  the update's fusion in one program and reads them stored in the other, and rounds 2 or
  3 of 64 params a few ulps apart. Op by op (`test_table_matches_reference_bit_for_bit`)
  the params too are the reference's bits.
  """
  make = {
    "adamw": lambda: optax.adamw(1e-2),
    "lion": lambda: optax.lion(1e-3),
    "sgd": lambda: optax.sgd(1e-2, momentum=0.9),
  }[name]
  params = make_params()
  tx = _low(make(), mode, stochastic_rounding=stochastic, seed=3)
  got_params, got_state = _wrapped_run(tx, params, jit=True)
  want_params, want_inner = _reference_run(
    make, mode, params, jit=True, stochastic=stochastic, seed=3
  )
  assert_same_bits(got_state.inner_state, want_inner)
  got_params, want_params = to_numpy(got_params), to_numpy(want_params)
  assert jax.tree.structure(got_params) == jax.tree.structure(want_params)
  for got, want in zip(jax.tree.leaves(got_params), jax.tree.leaves(want_params), strict=True):
    np.testing.assert_array_max_ulp(got, want, maxulp=4)


_REUSED_FIELDS = {
  (optax.contrib.GaLoreState, "projector"),
  (optax.ScaleByLBFGSState, "params"),
  (optax.ScaleByLBFGSState, "updates"),
  (optax.ScaleByZoomLinesearchState, "grad"),
  (optax.ScaleByBacktrackingLinesearchState, "grad"),
  (optax.contrib.MadgradState, "s"),
  (optax.contrib.COCOBState, "reward"),
}
"""The state fields that are not moments, whatever their shape: GaLore's projector, the values
L-BFGS and the line searches reuse, and what MADGRAD and COCOB set the params from."""


def _in_reused_fields(state: Any) -> list[bool]:
  """For each leaf of `state`, whether it lies in one of the `_REUSED_FIELDS`."""
  types = {state_type for state_type, _ in _REUSED_FIELDS}

  def mark(node: Any) -> Any:
    if type(node) not in types:
      return False
    return node._replace(
      **{
        name: jax.tree.map(lambda _: True, value)
        if (type(node), name) in _REUSED_FIELDS
        else jax.tree.map(mark, value, is_leaf=lambda x: type(x) in types)
        for name, value in node._asdict().items()
      }
    )

  return jax.tree.leaves(jax.tree.map(mark, state, is_leaf=lambda x: type(x) in types))


def _check_compressed_where_param_shaped(case, state, params, mode):
  """Every floating leaf whose path ends with a param's path and whose shape is that param's
  is compressed, unless the inner init copies the param into it, it is MultiSteps's sum of
  gradients or lies in one of the `_REUSED_FIELDS` (GaLore's projector: the out kernel's, at
  rank 128 of (16, 4)); nothing else is."""
  fast = params.fast if isinstance(params, optax.LookaheadParams) else params
  param_shapes = {jax.tree_util.keystr(p): np.shape(x) for p, x in jax.tree.leaves_with_path(fast)}
  inner = low_precision_to_float32(state)
  expected = []
  for (path, leaf), copy, reused in zip(
    jax.tree.leaves_with_path(inner),
    _param_copies(case, params),
    _in_reused_fields(inner),
    strict=True,
  ):
    name = jax.tree_util.keystr(path)
    shape = next((s for p, s in param_shapes.items() if name.endswith(p)), None)
    floating = jnp.issubdtype(leaf.dtype, jnp.floating)
    summed = ".acc_grads" in name
    compressed = shape == np.shape(leaf) and floating and not (copy or summed or reused)
    expected.append(mode if compressed else "kept")
  got = [kind if kind in MODES else "kept" for kind in state.storage]
  assert got == expected, case


def test_rounding_bits_of_a_leaf_past_2_to_the_32_values():
  """Its trailing dimensions' strides exceed uint32 (an OverflowError naming no leaf): the
  index is taken modulo 2**32, as documented (abstract, or 16 values computed)."""
  shape = (2, 65536, 65536)
  params = {"experts": jax.ShapeDtypeStruct(shape, jnp.bfloat16)}
  tx = low_precision(optax.adamw(1e-3), "bfloat16")
  state = jax.eval_shape(tx.init, params)
  new_state = jax.eval_shape(lambda p, s: tx.update(p, s, p)[1], params, state)
  assert jax.tree.map(lambda x: (x.shape, x.dtype), new_state) == jax.tree.map(
    lambda x: (x.shape, x.dtype), state
  )

  def first_of_each_half(seed):  # XLA computes the two slices alone.
    bits = rounding_bits(shape, seed, jnp.int32(1), 0)
    return bits[0, 0, :8], bits[1, 0, :8]

  low, high = jax.jit(first_of_each_half, static_argnums=0)(0)
  np.testing.assert_array_equal(low, high)


@pytest.mark.slow
def test_stochastic_rounding_is_unbiased_and_accumulates():
  """A nu that grows by 1e-4 per step from 1: to nearest it never moves, stochastically it does."""
  x = jnp.full((4096,), 1.0 + 2.0**-10, jnp.float32)  # a quarter of a bfloat16 step above 1
  rounded = to_bfloat16(x, rounding_bits(x.shape, 0, jnp.int32(0), 0)).astype(jnp.float32)
  assert abs(float(rounded.mean()) - float(x[0])) < 2.0**-8 * 0.05
  assert float(to_bfloat16(x, None)[0]) == 1.0

  def accumulate(stochastic):
    tx = low_precision(
      optax.scale_by_rms(decay=0.999, eps=0.0, initial_scale=1.0),
      "bfloat16",
      min_size=0,
      stochastic_rounding=stochastic,
    )
    params = {"w": jnp.zeros((64, 64))}
    grads = {"w": jnp.full((64, 64), 1.1)}

    def body(state, _):
      return tx.update(grads, state, params)[1], None

    state = jax.lax.scan(body, tx.init(params), None, length=200)[0]
    return float(low_precision_to_float32(state).nu["w"].mean())

  exact = 1.21 + (1.0 - 1.21) * 0.999**200
  assert accumulate(False) == 1.0
  assert abs(accumulate(True) - exact) < 2e-3


@pytest.mark.slow
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole_tree"])
def test_a_meta_gradient_passes_straight_through_stochastic_rounding(stream):
  """`jax.grad` through bfloat16 steps rounded stochastically: the state's share of the
  gradient passes straight through the rounding, whose bit arithmetic has no derivative
  (the meta-gradient lost it, 26% of float32 adam's here, as with the state behind
  `jax.lax.stop_gradient`), so it is float32 adam's up to rounding, as rounding to nearest
  gives."""
  x = jnp.cos(jnp.arange(16 * 64.0)).reshape(16, 64)
  params = {"w": jnp.sin(jnp.arange(64 * 128.0)).reshape(64, 128) * 0.1}

  def loss(p):
    return jnp.mean(jnp.tanh(x @ p["w"]) ** 2)

  def meta(p, tx):
    state = tx.init(p)
    for _ in range(3):
      updates, state = tx.update(jax.grad(loss)(p), state, p)
      p = optax.apply_updates(p, updates)
    return loss(p)

  rounded = low_precision(optax.adam(1e-2), "bfloat16", min_size=0, stream=stream)
  got = jax.grad(meta)(params, rounded)["w"]
  want = jax.grad(meta)(params, optax.adam(1e-2))["w"]
  assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 0.005


def test_stochastic_rounding_differentiated_rounds_as_it_does_alone():
  """Differentiated, the rounding gives its own values bit for bit, and the tangent."""
  x = jnp.linspace(-3.0, 3.0, 4096).at[:3].set(jnp.asarray([jnp.inf, -jnp.inf, jnp.nan]))
  bits = rounding_bits(x.shape, 0, jnp.int32(1), 0)
  tangent = jnp.cos(x)
  value, out_tangent = jax.jvp(lambda x: to_bfloat16(x, bits), (x,), (tangent,))

  def raw(y):
    return np.asarray(jax.lax.bitcast_convert_type(y, jnp.uint16))

  np.testing.assert_array_equal(raw(value), raw(to_bfloat16(x, bits)))
  np.testing.assert_array_equal(raw(out_tangent), raw(tangent.astype(jnp.bfloat16)))


def test_an_eager_create_compiles_the_rounding_bits_once_per_shape(caplog):
  """Outside jit, a stochastically rounded state's init hashes its bits in one program per shape.

  Hashed op by op, each operation compiled on its own for every new shape: an
  eager ``create`` of three leaves took 0.8 s on the CPU, almost all of it compiling.
  """
  # Shapes no other test uses, so that nothing compiled before this test hides a compile.
  params = {f"w{i}": jnp.ones((7, 13)) for i in range(3)} | {"b": jnp.ones((11,))}
  opt_def = OptaxWrapper(low_precision(optax.adam(1e-2), "bfloat16", min_size=0))
  with caplog.at_level("WARNING", logger="jax"), jax.log_compiles():
    state = opt_def.create(params).state
  prefix = "Finished XLA compilation of "
  compiled = [
    r.getMessage().removeprefix(prefix).split(" ")[0]
    for r in caplog.records
    if r.getMessage().startswith(prefix)
  ]
  assert all(kind == "bfloat16" for kind in state.param_states.storage[1:])
  assert compiled.count("jit(leaf_rounding_bits)") == 2, compiled
  hashing = {"jit(bitwise_xor)", "jit(right_shift)", "jit(iota)"}
  assert not hashing & set(compiled), compiled


@pytest.mark.slow
def test_an_eager_sum_of_squares_compiles_once(caplog):
  """`low_precision_sum_squares` outside jit: each leaf's conditional compiled its branches
  anew at every call (2.3 s a call for eight 8-bit leaves, as at the first); a second call
  now compiles nothing."""
  params = {f"w{i}": jnp.ones((5, 96)) for i in range(2)}
  tx = low_precision(optax.adam(1e-2), "8bit", min_size=0)
  state = tx.init(params)
  first = low_precision_sum_squares(state)
  with caplog.at_level("WARNING", logger="jax"), jax.log_compiles():
    second = low_precision_sum_squares(state)
  compiled = [r.getMessage() for r in caplog.records if "XLA compilation" in r.getMessage()]
  assert compiled == []
  assert jax.tree.map(float, first) == jax.tree.map(float, second)


@pytest.mark.parametrize(
  "stream",
  # The default (streamed) path with the quick tests, the whole-tree one with the slow.
  [pytest.param(True, id="streamed"), pytest.param(False, id="whole_tree", marks=pytest.mark.slow)],
)
@pytest.mark.parametrize("mode", LOW_PRECISION_MODES)
def test_bfloat16_params_get_the_inner_optimizers_update_dtypes(mode, stream):
  """The state computes in float32, but the updates keep the dtypes adamw gives bfloat16
  params: a wrapper that selects between them and zeros like the gradients
  (``optax.apply_if_finite``) traces."""
  w = jnp.linspace(-1.0, 1.0, 64 * 256).reshape(64, 256)
  params = {"w": w.astype(jnp.bfloat16), "b": jnp.zeros((256,))}
  grads = jax.tree.map(lambda p: jnp.cos(3.0 * p + 1.0).astype(p.dtype), params)
  inner = low_precision(optax.adamw(1e-2), mode, min_size=0, stream=stream)
  stored = set(leaf_storage(inner.init(params)).values()) - {"kept: not param-shaped"}
  assert stored and stored <= {"bfloat16", f"{mode} codes", f"{mode} scales", f"{mode} cols"}
  tx = optax.apply_if_finite(inner, max_consecutive_errors=3)
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  want, _ = optax.adamw(1e-2).update(grads, optax.adamw(1e-2).init(params), params)
  assert jax.tree.map(jnp.result_type, updates) == jax.tree.map(jnp.result_type, want)


@pytest.mark.parametrize(
  "stream",
  [pytest.param(True, id="streamed"), pytest.param(False, id="whole_tree", marks=pytest.mark.slow)],
)
@pytest.mark.parametrize("mode", LOW_PRECISION_MODES)
def test_float16_gradients_are_squared_in_float32(mode, stream):
  """In float16, 0.001 * g**2 of g = -0.0054 underflows to 0: the decoded float32 moments
  then gave an update of lr * g / eps (540), finite, where float32 adam gives lr."""
  params = {"h": jnp.full((64, 256), 0.1, jnp.float16), "b": jnp.full((8,), 0.1, jnp.float16)}
  grads = {"h": jnp.full((64, 256), -0.0054, jnp.float16), "b": jnp.full((8,), 1.0, jnp.float16)}
  tx = low_precision(optax.adam(1e-3), mode, min_size=64, stream=stream)
  state = tx.init(params)
  updates, new_state = jax.jit(tx.update)(grads, state, params)
  assert jax.tree.map(jnp.result_type, updates) == {"h": jnp.float16, "b": jnp.float16}
  np.testing.assert_allclose(np.asarray(updates["h"], np.float32), 1e-3, rtol=0.02)
  # The state kept below min_size (b's) stays float16, as init made it.
  assert jax.tree.map(jnp.result_type, new_state) == jax.tree.map(jnp.result_type, state)


_GALORE_PROJECTOR = "kept: GaLore projector (a basis, not a moment)"


@pytest.mark.parametrize(
  "shape, rank", [((16, 16), 16), ((16, 4), 8), ((16, 16), 4)], ids=["square", "tall", "low_rank"]
)
def test_galore_projectors_are_kept_whatever_their_shape_and_say_why(shape, rank):
  """A kernel at a rank of at least its smaller dimension can have a projector of its param's
  shape, which was taken for a moment and compressed: every projector is kept, with its
  reason, the param-shaped moments (a square kernel's at full rank) are compressed, and
  ``states=`` selecting a projector is refused, saying what it is."""
  params = {"w": jnp.ones(shape), "b": jnp.ones(16)}
  inner = optax.contrib.galore(1e-2, rank=rank)
  storage = leaf_storage(low_precision(inner, "bfloat16", min_size=0).init(params))
  assert storage[("inner_state", "0", "projector", "w")] == _GALORE_PROJECTOR, storage
  assert storage[("inner_state", "0", "projector", "b")] == _GALORE_PROJECTOR, storage
  mu = storage[("inner_state", "0", "base_optimizer_state", "mu", "w")]
  assert (mu == "bfloat16") == (shape == (16, 16) and rank == 16), storage
  assert storage[("inner_state", "0", "base_optimizer_state", "mu", "b")] == "bfloat16", storage
  with pytest.raises(ValueError, match=r"'0/projector/w' .* it is GaLore's projector"):
    low_precision(inner, "bfloat16", min_size=0, states="projector/w").init(params)


@pytest.mark.usefixtures("xla_optimized")
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["8bit", "bfloat16"])
def test_galore_projectors_stay_float32_galores_bit_for_bit(mode):
  """A square kernel at full rank: its projector, once encoded again at every step (8 bits,
  10 steps at 64 x 64: 0.0122 of float32 GaLore's movement off, against 0.0080 with the
  moments alone compressed), stays float32 GaLore's bit for bit, refreshed or not."""
  params = {"wsq": jnp.sin(jnp.arange(64 * 64.0).reshape(64, 64))}
  inner = optax.contrib.galore(1e-2, rank=64, update_proj_gap=2)
  tx = low_precision(inner, mode, min_size=0)
  state, want_state = tx.init(params), inner.init(params)
  assert isinstance(state.inner_state[0].base_optimizer_state.mu["wsq"], QuantizedLeaf) == (
    mode == "8bit"
  )
  update, want_update = jax.jit(tx.update), jax.jit(inner.update)
  for i in range(3):
    grads = {"wsq": jnp.cos(params["wsq"] * (i + 1.3))}
    _, state = update(grads, state, params)
    _, want_state = want_update(grads, want_state, params)
    assert_same_bits(to_numpy(state.inner_state[0].projector), to_numpy(want_state[0].projector))


_QUADRATIC_TARGET = {
  "w": jnp.sin(jnp.arange(64 * 128.0)).reshape(64, 128) + 3.0,
  "b": jnp.ones(128),
}
_QUADRATIC_WEIGHT = jnp.linspace(1.0, 10.0, 64 * 128).reshape(64, 128)


def _quadratic(params: Any) -> jax.Array:
  """A quadratic with its minimum at `_QUADRATIC_TARGET`, conditioned 1 to 10 on the kernel."""
  off = jax.tree.map(jnp.subtract, params, _QUADRATIC_TARGET)
  return 0.5 * jnp.sum(_QUADRATIC_WEIGHT * off["w"] ** 2) + jnp.sum(off["b"] ** 2)


_LINE_SEARCHERS = {
  "lbfgs": lambda: optax.lbfgs(),
  "sgd_backtracking": lambda: optax.chain(
    optax.sgd(1.0),
    optax.scale_by_backtracking_linesearch(max_backtracking_steps=15, store_grad=True),
  ),
}


@pytest.mark.usefixtures("default_emitters")
@pytest.mark.parametrize("mode", LOW_PRECISION_MODES)
@pytest.mark.parametrize(
  "name",
  [n if n != "lbfgs" else pytest.param(n, marks=pytest.mark.slow) for n in sorted(_LINE_SEARCHERS)],
)
def test_lbfgs_and_line_searches_keep_the_values_they_reuse(name, mode):
  """L-BFGS keeps its last params and updates, whose differences with the next ones are its
  curvature pairs, and a line search the gradient at the new params, which
  `optax.value_and_grad_from_state` gives the next step: compressed, 30 L-BFGS steps on a
  quadratic that float32 solves to 5e-11 ended at 18.5 (bfloat16) and 0.157 (8 bits), and
  optax's own loop failed on the bfloat16 gradient. Kept, nothing else of these states
  mirrors a param, and the run is float32's bit for bit."""

  def run(tx):
    params = jax.tree.map(jnp.zeros_like, _QUADRATIC_TARGET)
    state = tx.init(params)
    value_and_grad = optax.value_and_grad_from_state(_quadratic)

    @jax.jit
    def step(params, state):
      value, grad = value_and_grad(params, state=state)
      updates, state = tx.update(grad, state, params, value=value, grad=grad, value_fn=_quadratic)
      return optax.apply_updates(params, updates), state

    for _ in range(30):
      params, state = step(params, state)
    return params, state

  want, _ = run(_LINE_SEARCHERS[name]())
  got, state = run(low_precision(_LINE_SEARCHERS[name](), mode, min_size=0))
  storage = {"/".join(path): kind for path, kind in leaf_storage(state).items()}
  kept = {where: kind for where, kind in storage.items() if where.endswith(("/w", "/b"))}
  lbfgs = "kept: L-BFGS's last params or updates (a curvature pair's end, not a moment)"
  searched = "kept: a line search's gradient (the next step's, not a moment)"
  for leaf in ("w", "b"):
    if name == "lbfgs":
      assert kept.pop(f"inner_state/0/params/{leaf}") == lbfgs, storage
      assert kept.pop(f"inner_state/0/updates/{leaf}") == lbfgs, storage
    assert kept.pop(f"inner_state/{1 + (name == 'lbfgs')}/grad/{leaf}") == searched, storage
  assert set(kept.values()) <= {"kept: not param-shaped"}, storage
  assert_same_bits(got, want)


def test_a_state_it_stores_nothing_of_in_low_precision_is_a_warning():
  """L-BFGS keeps its history (not param-shaped), its last params and updates and its line
  search's gradient, and a GaLore that projects every kernel keeps moments of another shape
  and its projector: 8 bits of either stored nothing in 8 bits, without a word. Leaves kept
  by ``min_size`` (0-d ones too) or under a ``param_modes`` policy are the caller's choice,
  and a state with one compressed leaf saves memory."""
  params = {"w": jnp.zeros((64, 128)), "b": jnp.zeros(128)}
  with pytest.warns(UserWarning) as record:
    low_precision(optax.lbfgs(), "8bit", min_size=0).init(params)
  [message] = [str(w.message) for w in record]
  assert message.startswith(
    "low_precision: '8bit' stores none of the inner transformation's state in low precision, "
    "so it saves no memory; it keeps its leaves of min_size=0 values or more as they are: "
  ), message
  assert "0/params/b, 0/params/w, 0/updates/b, 0/updates/w (16,640 values)" in message
  assert "'kept: not param-shaped': 0/diff_params_memory/b" in message
  assert "line search's gradient" in message
  with pytest.warns(UserWarning, match=r"'kept: GaLore projector .*': 0/projector/w \(8,192"):
    low_precision(optax.contrib.galore(1e-3), "8bit", min_size=0).init({"w": params["w"]})
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    low_precision(optax.contrib.galore(1e-3), "8bit", min_size=0).init(params)  # b's moments
    low_precision(optax.adamw(1e-3), "8bit").init(params)  # every leaf below min_size
    low_precision(optax.lbfgs(), "8bit", min_size=10**6).init(params)
    low_precision(optax.inject_hyperparams(optax.sgd)(0.1), "8bit", min_size=0).init(params)
    low_precision(optax.adafactor(1e-3), "8bit", param_modes=[(".", "float32")]).init(
      {"w": jnp.zeros((4096, 1024))}
    )


@pytest.mark.parametrize("mode", ["8bit", "4bit"])
def test_a_state_that_no_block_tiles_is_a_warning(mode):
  """Params whose last dimensions no block tiles (prime, 1) keep adam's moments in float32:
  8 or 4 bits then store nothing of the state in low precision, which `leaf_storage` said
  and `init` did not. One compressed leaf saves memory and warns of nothing."""
  params = {"w": jnp.zeros((64, 257)), "v": jnp.zeros((8192, 1)), "b": jnp.zeros(7)}
  with pytest.warns(UserWarning) as record:
    state = low_precision(optax.adam(1e-3), mode).init(params)
  [message] = [str(w.message) for w in record]
  no_block = {kind for kind in leaf_storage(state).values() if kind.startswith("float32: no ")}
  [kind] = no_block
  assert message.startswith(
    f"low_precision: '{mode}' stores none of the inner transformation's state in low precision, "
    "so it saves no memory; it keeps its leaves of min_size=4096 values or more as they are: "
  ), message
  assert f"{kind!r}: 0/mu/v, 0/mu/w, 0/nu/v, 0/nu/w (49,280 values)" in message, message
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    low_precision(optax.adam(1e-3), mode).init({**params, "k": jnp.zeros((64, 256))})
    low_precision(optax.adam(1e-3), mode, min_size=20_000).init(params)


_FROM_THEIR_STATE = {
  "madgrad": (
    lambda: optax.contrib.madgrad(0.05),
    "inner_state/1/s",
    "kept: MADGRAD's sum of gradients (the params' offset from x0, not a moment)",
  ),
  "cocob": (
    lambda: optax.contrib.cocob(),
    "inner_state/2/reward",
    "kept: COCOB's reward (the wealth it bets, not a moment)",
  ),
}


@pytest.mark.parametrize("mode", LOW_PRECISION_MODES)
@pytest.mark.parametrize(
  "name",
  [
    n if n != "cocob" else pytest.param(n, marks=pytest.mark.slow)
    for n in sorted(_FROM_THEIR_STATE)
  ],
)
def test_madgrad_and_cocob_keep_what_they_set_the_params_from(name, mode):
  """MADGRAD sets the params from their start and its sum of gradients `s`, COCOB from its
  reward: compressed, 300 steps on a quadratic that float32 takes to a loss of 4e-9 (MADGRAD)
  and 2e-9 (COCOB) ended at 0.387 and 0.585 in bfloat16, 13.5 and 35.7 in 8 bits."""
  make, where, label = _FROM_THEIR_STATE[name]

  def run(tx):
    params = jax.tree.map(lambda t: jnp.full_like(t, 0.5), _QUADRATIC_TARGET)
    state = tx.init(params)

    @jax.jit
    def steps(params, state):
      def step(carry, _):
        params, state = carry
        updates, state = tx.update(jax.grad(_quadratic)(params), state, params)
        return (optax.apply_updates(params, updates), state), None

      return jax.lax.scan(step, (params, state), length=300)[0]

    return steps(params, state)

  want, _ = run(make())
  got, state = run(low_precision(make(), mode, min_size=0))
  storage = {"/".join(path): kind for path, kind in leaf_storage(state).items()}
  assert storage[f"{where}/w"] == storage[f"{where}/b"] == label, storage
  assert float(_quadratic(want)) < 1e-7
  assert float(_quadratic(got)) < 1e-6, float(_quadratic(got))


def test_storage_names_the_dtype_a_kept_leaf_has():
  """bfloat16 params' adam state is bfloat16: a leaf left uncompressed is not float32."""
  params = {"emb": jnp.ones((64, 32), jnp.bfloat16), "b": jnp.ones((8,), jnp.bfloat16)}
  tx = low_precision(optax.adam(1e-2), "8bit", min_size=16, param_modes=(("emb", "float32"),))
  state = tx.init(params)
  storage = leaf_storage(state)
  assert storage[("inner_state", "0", "mu", "emb")] == "bfloat16: param_modes 'emb'"
  assert storage[("inner_state", "0", "mu", "b")] == "bfloat16: below min_size"
  assert state.inner_state[0].mu["emb"].dtype == jnp.bfloat16


def test_storage_small_and_factored_leaves_stay_float32():
  params = {"big": jnp.ones((32, 64)), "small": jnp.ones((8,))}
  state = low_precision(optax.adafactor(1e-2, min_dim_size_to_factor=16), "8bit", min_size=64).init(
    params
  )
  storage = leaf_storage(state)
  assert storage[("inner_state", "0", "v_row", "big")] == "kept: not param-shaped"
  assert storage[("inner_state", "0", "v", "small")] == "float32: below min_size"
  assert storage[("inner_state", "0", "v", "big")] == "kept: not param-shaped"
  assert state.inner_state[0].v_row["big"].dtype == jnp.float32


@pytest.mark.parametrize(
  "make, mode, states, match",
  [
    (
      lambda: optax.adafactor(1e-2, min_dim_size_to_factor=16),
      "8bit",
      "v_row",
      r"selects the state leaf '0/v_row/w' \(shape \(32,\), dtype float32\), which it does not "
      r"apply to: .* its shape \(32,\) is not its param's \(32, 64\)",
    ),
    (
      lambda: optax.adam(1e-2),
      "bfloat16",
      "count",
      r"selects the state leaf '0/count' \(shape \(\), dtype int32\)",
    ),
    (lambda: optax.adam(1e-2), "8bit", "nope", r"selects no state leaf; the state's leaves are"),
  ],
)
def test_a_mode_that_does_not_apply_is_refused_with_the_path(make, mode, states, match):
  with pytest.raises(ValueError, match=match):
    low_precision(make(), mode, states=states).init({"w": jnp.ones((32, 64))})


@pytest.mark.slow
def test_states_selects_leaves():
  state = low_precision(optax.adam(1e-2), "8bit", states="/mu/", min_size=0).init(
    {"w": jnp.ones((4, 8))}
  )
  assert isinstance(state.inner_state[0].mu["w"], QuantizedLeaf)
  assert state.inner_state[0].nu["w"].dtype == jnp.float32


@pytest.mark.parametrize(
  "kwargs, match",
  [
    ({"state_dtype": "int4"}, "state_dtype must be one of"),
    ({"block_size": 0}, "block_size and shard_multiple must be positive"),
    ({"shard_multiple": 0}, "block_size and shard_multiple must be positive"),
    ({"stream_chunk": 0}, "stream_chunk must be positive, got 0"),
  ],
)
def test_bad_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    low_precision(optax.adam(1e-2), **kwargs)


@pytest.mark.slow
def test_state_dict_keys_and_validated_restore():
  params = {"dense": {"kernel": jnp.ones((4, 8))}}
  opt_def = OptaxWrapper(low_precision(optax.adamw(1e-2), "8bit", min_size=0))
  optimizer = opt_def.create(params).apply_gradient({"dense": {"kernel": jnp.ones((4, 8))}})
  flat = {
    "/".join(k): v for k, v in _flatten(optimizer.state_dict()["state"]["param_states"]).items()
  }
  assert sorted(flat) == [
    "count",
    "inner_state/0/count",
    "inner_state/0/mu/dense/kernel/codes",
    "inner_state/0/mu/dense/kernel/scales",
    "inner_state/0/nu/dense/kernel/codes",
    "inner_state/0/nu/dense/kernel/scales",
  ]
  restored = opt_def.create(params).restore_state(optimizer.state_dict())
  assert_same_bits(restored.state, optimizer.state)
  float32 = OptaxWrapper(optax.adamw(1e-2)).create(params).state_dict()
  float32["state"]["param_states"] = {"count": 0, "inner_state": float32["state"]["param_states"]}
  with pytest.raises(ValueError, match=r"inner_state/0/mu/dense/kernel"):
    opt_def.create(params).restore_state(float32)


def _flatten(tree, prefix=()):
  if not isinstance(tree, dict):
    return {prefix: tree}
  return {k: v for key, sub in tree.items() for k, v in _flatten(sub, (*prefix, key)).items()}


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_restore_into_a_float32_optimizer_and_back(mode):
  params = make_params()
  low = OptaxWrapper(low_precision(optax.adamw(1e-2), mode, min_size=0))
  full = OptaxWrapper(optax.adamw(1e-2))
  grads, _ = grads_and_extras(optax.adamw(1e-2), params)
  optimizer = low.create(params).apply_gradient(grads)
  expanded = low_precision_to_float32(optimizer.state.param_states)
  as_float32 = optimizer.replace(
    optimizer_def=full, state=optimizer.state.replace(param_states=expanded)
  )
  restored = full.create(params).restore_state(as_float32.state_dict())
  assert_same_bits(restored.state.param_states, expanded)
  restored = restored.apply_gradient(grads)
  back = float32_to_low_precision(restored.state.param_states, optimizer.state.param_states)
  assert isinstance(back, LowPrecisionState) and int(back.count) == 1
  again = low_precision_to_float32(back)
  for got, want in zip(jax.tree.leaves(again), jax.tree.leaves(restored.state.param_states)):
    np.testing.assert_allclose(got, want, rtol=0.07 if mode == "8bit" else 2**-7, atol=1e-7)
  with pytest.raises(ValueError, match=r"float32 inner state has structure"):
    float32_to_low_precision(
      optax.sgd(0.1, momentum=0.9).init(params), optimizer.state.param_states
    )


def _param_copies(case: Case, params: Any) -> list[bool]:
  """For each leaf of the inner init state, whether it equals a param (random params)."""
  fast = params.fast if isinstance(params, optax.LookaheadParams) else params
  values = [np.asarray(x) for x in jax.tree.leaves(fast)]
  return [
    any(np.shape(leaf) == v.shape and np.array_equal(leaf, v) for v in values)
    for leaf in jax.tree.leaves(case.make().init(params))
  ]


@pytest.mark.slow
@pytest.mark.parametrize("mode", LOW_PRECISION_MODES)
def test_copies_of_the_params_are_never_compressed(mode):
  """Schedule-free's ``z``, prodigy's ``params0``, dog's ``init_params``, mechanic's ``x0``:
  a copy of the weights moves by each step's small update, which a codec scaled to the
  weights would round away. Every such leaf of the table keeps its dtype, and says why."""
  found = set()
  others = [
    Case("dog", optax.contrib.dog),
    Case("dowg", optax.contrib.dowg),
    Case("mechanize", lambda: optax.contrib.mechanize(optax.adam(1e-3))),
  ]
  for case in [*TABLE, *others]:
    params = initial_params(case)
    storage = low_precision(case.make(), mode, min_size=0).init(params).storage
    for copy, kind in zip(_param_copies(case, params), storage, strict=True):
      assert (kind == "kept: a copy of its param") == copy, (case, storage)
      found |= {case.name} if copy else set()
  assert {"schedule_free_adamw", "schedule_free", "prodigy", "dog", "mechanize"} <= found, found


def test_an_init_that_reads_values_still_finds_the_copies_of_the_params():
  """An init that needs concrete values (run eagerly) cannot be traced without them: the
  copies are then the leaves that are the params themselves."""

  def init(params):
    scale = float(jnp.max(jnp.abs(params["w"])))  # A value, not a tracer.
    return {"copy": params, "trace": jax.tree.map(lambda x: jnp.zeros_like(x) * scale, params)}

  tx = optax.GradientTransformation(init, lambda u, s, p=None: (u, s))
  storage = low_precision(tx, "bfloat16", min_size=0).init({"w": jnp.ones((4, 8))}).storage
  assert storage == ("kept: a copy of its param", "bfloat16")


@pytest.mark.slow
def test_a_constant_of_a_single_params_shape_is_not_its_mirror():
  """Muon's ns_coeffs ('dion': (5, 3)) beside a (5, 3) param: a setting of the transformation,
  kept as it is, as beside the same param in a dict; the momentum is compressed."""
  param = jnp.sin(jnp.arange(15.0).reshape(5, 3))
  tx = low_precision(optax.contrib.muon(0.02, ns_coeffs="dion"), "bfloat16", min_size=0)
  state = tx.init(param)
  storage = leaf_storage(state)
  muon = ("inner_state", "inner_states", "muon", "inner_state", "0")
  assert storage[(*muon, "ns_coeffs")] == "kept: not param-shaped"
  assert storage[(*muon, "mu")] == "bfloat16"
  assert state.storage == tx.init({"w": param}).storage
  _, state = tx.update(jnp.cos(param), state, param)
  coeffs = low_precision_to_float32(state).inner_states["muon"].inner_state[0].ns_coeffs
  want = optax.contrib.muon(0.02, ns_coeffs="dion").init(param)
  np.testing.assert_array_equal(coeffs, want.inner_states["muon"].inner_state[0].ns_coeffs)


@pytest.mark.parametrize("rows", [126, 127, 128])
def test_a_single_params_state_is_stored_as_in_a_dict_at_the_factoring_boundary(rows):
  """Adafactor factors v from min_dim_size_to_factor on: the state of a (127, 300) param is
  stored as that of the same param in a dict, though a param one longer in each dim is
  factored."""
  inner = optax.adafactor(1e-3, min_dim_size_to_factor=128, factored=True)
  tx = low_precision(inner, "bfloat16")
  param = jnp.ones((rows, 300))
  single, in_a_dict = tx.init(param).storage, tx.init({"w": param}).storage
  assert single == in_a_dict
  assert ("bfloat16" in single) == (rows < 128)


def test_a_single_params_state_from_an_init_that_takes_only_an_array_is_read_by_its_shape():
  """An init that cannot be traced for the param in a dict: a leaf of the param's shape
  mirrors it."""

  def init(param):
    return {"m": jnp.zeros(param.shape, param.dtype), "n": jnp.zeros(param.size)}

  tx = optax.GradientTransformation(init, lambda u, s, p=None: (u, s))
  assert low_precision(tx, "bfloat16", min_size=0).init(jnp.ones((4, 8))).storage == (
    "bfloat16",
    "kept: not param-shaped",
  )


def test_a_copy_behind_stop_gradient_is_a_copy():
  def init(params):
    return {"copy": jax.lax.stop_gradient(params), "trace": jax.tree.map(jnp.zeros_like, params)}

  tx = optax.GradientTransformation(init, lambda u, s, p=None: (u, s))
  storage = low_precision(tx, "bfloat16", min_size=0).init({"w": jnp.ones((4, 8))}).storage
  assert storage == ("kept: a copy of its param", "bfloat16")


@pytest.mark.parametrize(
  "mode, most",
  [
    pytest.param("8bit", 0.05, marks=pytest.mark.slow),
    pytest.param("4bit", 0.2, marks=pytest.mark.slow),
    ("bfloat16", 0.05),
  ],
)
@pytest.mark.parametrize(
  "make",
  [lambda: optax.contrib.schedule_free_adamw(1e-3), lambda: optax.contrib.prodigy(1.0)],
  ids=["schedule_free_adamw", "prodigy"],
)
def test_optimizers_that_keep_a_copy_of_the_params_train_as_in_float32(make, mode, most):
  """10 steps on weights of norm 45: the params end within `most` of the float32 run's
  distance from the start (schedule-free 8-bit: 17.8 times it, with ``z`` compressed)."""
  start = {"w": jax.random.normal(jax.random.key(0), (8, 256))}

  def run(tx):
    params, state = start, tx.init(start)
    update = jax.jit(tx.update)
    for i in range(10):
      grads = jax.tree.map(lambda x, i=i: jnp.sin(3 * x + i), params)
      updates, state = update(grads, state, params)
      params = optax.apply_updates(params, updates)
    return params["w"]

  want = run(make())
  got = run(low_precision(make(), mode, min_size=0))
  moved = float(jnp.linalg.norm(want - start["w"]))
  assert float(jnp.linalg.norm(got - want)) <= most * moved


@pytest.mark.parametrize("mode", ["8bit", "4bit", "bfloat16"])
@pytest.mark.parametrize("shape", [(256, 32), (64, 256), (8192,)])
def test_float32_state_of_another_shape_is_refused_naming_the_path(mode, shape):
  like = low_precision(optax.adam(1e-3), mode, min_size=0).init({"w": jnp.ones((32, 256))})
  full = low_precision_to_float32(like)
  wrong = (full[0]._replace(mu={"w": jnp.ones(shape)}), *full[1:])
  with pytest.raises(
    ValueError,
    match=rf"at '0/mu/w': float32\[{shape[0]}.*\] in the float32 state, .* float32\[32, 256\]",
  ):
    float32_to_low_precision(wrong, like)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["8bit", "4bit"])
def test_float32_state_is_stored_in_the_dtypes_of_like(mode):
  """A leaf the state keeps uncompressed (a bfloat16 param's moments, too small for a block)
  comes back in ``like``'s dtype, not float32, and stays so after a step."""
  params = {"b": jnp.ones((4, 3), jnp.bfloat16), "w": jnp.ones((4, 256))}
  tx = low_precision(optax.adam(1e-3), mode, min_size=0)
  like = tx.init(params)
  assert like.inner_state[0].nu["b"].dtype == jnp.bfloat16
  full = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), low_precision_to_float32(like))
  back = float32_to_low_precision(full, like)
  dtypes = lambda tree: [x.dtype for x in jax.tree.leaves(tree)]  # noqa: E731
  assert dtypes(back) == dtypes(like)
  _, after = tx.update(jax.tree.map(jnp.ones_like, params), back, params)
  assert dtypes(after) == dtypes(like)


@pytest.mark.parametrize("mode", ["8bit", "4bit", "bfloat16"])
@pytest.mark.parametrize("param", ["w", "b"])
def test_complex_values_for_a_real_state_are_refused_naming_the_path(mode, param):
  """Both dtypes are named: float32 where the leaf is stored compressed, bfloat16 where it is
  kept (a bfloat16 param's moments, too small for an 8- or 4-bit block)."""
  params = {"b": jnp.ones((4, 3), jnp.bfloat16), "w": jnp.ones((4, 256))}
  dtype = "bfloat16" if param == "b" and mode != "bfloat16" else "float32"
  like = low_precision(optax.adam(1e-3), mode, min_size=0).init(params)
  full = low_precision_to_float32(like)
  mu = {**full[0].mu, param: jnp.full(params[param].shape, 1 + 1j, jnp.complex64)}
  with pytest.raises(
    ValueError, match=rf"at '0/mu/{param}': complex64\[.*\] in the float32 state, .* {dtype}\["
  ):
    float32_to_low_precision((full[0]._replace(mu=mu), *full[1:]), like)


@pytest.mark.parametrize(
  ("dtype", "value", "largest"),
  [(jnp.float16, 7e4, r"6\.55e\+04"), (jnp.bfloat16, 3.4e38, r"3\.39e\+38")],
)
def test_values_beyond_a_kept_leafs_range_are_refused_naming_the_path(dtype, value, largest):
  """A kept leaf (a float16 or bfloat16 param's moment, too small for a block) refuses float32
  values beyond its dtype's range, as a restore does, in place of turning them into inf."""
  like = low_precision(optax.adam(1e-3), "8bit").init({"w": jnp.ones((4,), dtype)})
  full = low_precision_to_float32(like)
  big = (full[0]._replace(mu={"w": jnp.full((4,), value, jnp.float32)}), *full[1:])
  name = jnp.dtype(dtype).name
  with pytest.raises(
    ValueError,
    match=rf"at '0/mu/w': float32\[4\] .* {name}\[4\] .*beyond {name}'s largest, {largest}",
  ):
    float32_to_low_precision(big, like)
  fits = (full[0]._replace(mu={"w": jnp.full((4,), 6e4, jnp.float32)}), *full[1:])
  assert low_precision_to_float32(float32_to_low_precision(fits, like))[0].mu["w"].dtype == dtype
  # Traced values hold no numbers to check: under jit they are cast unchecked, as documented.
  traced = jax.jit(float32_to_low_precision)(big, like)
  assert bool(jnp.all(jnp.isinf(low_precision_to_float32(traced)[0].mu["w"])))


def test_a_step_count_that_is_not_a_whole_number_is_refused_naming_the_path():
  like = low_precision(optax.adam(1e-3), "8bit").init({"w": jnp.ones((4,))})
  full = low_precision_to_float32(like)
  with pytest.raises(ValueError, match=r"at '0/count': float32\[\] .* int32\[\] .*whole numbers"):
    float32_to_low_precision((full[0]._replace(count=jnp.float32(2.5)), *full[1:]), like)
  back = float32_to_low_precision((full[0]._replace(count=jnp.float32(2.0)), *full[1:]), like)
  assert back.inner_state[0].count.dtype == jnp.int32 and int(back.inner_state[0].count) == 2


@pytest.mark.parametrize("mode", [pytest.param("8bit", marks=pytest.mark.slow), "bfloat16"])
def test_logical_axes_are_derived(mode):
  """Exact spec trees: compressed leaves take their param's axes, factored ones keep theirs."""
  params = {"w": jnp.ones((16, 32)), "b": jnp.ones((32,)), "s": jnp.ones((2,))}
  axes = {"w": P("embed", "mlp"), "b": P("mlp"), "s": P("mlp")}
  tx = optax.adafactor(1e-2, min_dim_size_to_factor=8)
  opt_def = OptaxWrapper(low_precision(tx, mode, min_size=16, block_size=8), fallback="raise")
  specs = opt_def.derive_logical_axes(opt_def.create(params), axes).state.param_states
  b = QuantizedLeaf(P("mlp"), P("mlp")) if mode == "8bit" else P("mlp")
  assert specs.count is None
  assert specs.inner_state[0] == optax.FactoredState(
    count=None,
    v_row={"b": None, "s": None, "w": P("embed")},
    v_col={"b": None, "s": None, "w": P("mlp")},
    v={"b": b, "s": P("mlp"), "w": None},
  )
  adam = OptaxWrapper(
    low_precision(optax.adam(1e-2), mode, min_size=16, block_size=32, shard_multiple=1)
  )
  mu = adam.derive_logical_axes(adam.create(params), axes).state.param_states.inner_state[0].mu
  one_block = QuantizedLeaf(P("mlp"), None) if mode == "8bit" else P("mlp")
  w = QuantizedLeaf(P("embed", "mlp"), P("embed", None)) if mode == "8bit" else P("embed", "mlp")
  assert mu == {"b": one_block, "s": P("mlp"), "w": w}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["8bit", "bfloat16"])
def test_t5x_checkpoint_round_trip(tmp_path, mode):
  """T5X's legacy checkpoint format: codes, scales and bfloat16 leaves come back exactly."""
  params = make_params()
  opt_def = OptaxWrapper(low_precision(optax.adamw(1e-2), mode, min_size=0))
  grads, _ = grads_and_extras(optax.adamw(1e-2), params)
  # One compiled step (eagerly, each leaf's streamed update compiles on its own).
  optimizer = jax.jit(lambda o, g: o.apply_gradient(g))(opt_def.create(params), grads)
  save_t5x_checkpoint(tmp_path, optimizer)
  restored = restore_t5x_checkpoint(tmp_path, opt_def.create(params))
  assert_same_bits(restored.state, optimizer.state)
  assert_same_bits(restored.target, optimizer.target)


def _masked(mask):
  return optax.masked(optax.adam(0.1), mask)


def _relabelled(mask):
  labels = jax.tree.map(lambda m: "adam" if m else "frozen", mask)
  return optax.multi_transform({"adam": optax.adam(0.1), "frozen": optax.set_to_zero()}, labels)


@pytest.mark.slow
@pytest.mark.parametrize("make", [_masked, _relabelled], ids=["masked", "multi_transform"])
def test_a_prefix_mask_compresses_as_the_full_mask(make):
  """A mask (or labels) that is a prefix of the params, as optax allows, selects whole
  subtrees: their state is a MaskedNode hole in place of a subtree. The state still mirrors
  the params, and is stored and updated as the same selection spelled out leaf by leaf."""
  params = {
    "enc": {"wi": jnp.ones((16, 32)), "scale": jnp.ones(16)},
    "dec": {"wi": jnp.linspace(-1.0, 1.0, 512).reshape(32, 16), "scale": jnp.ones(32)},
  }
  full = {"enc": {"wi": False, "scale": False}, "dec": {"wi": True, "scale": True}}
  prefix = {"enc": False, "dec": True}
  txs = [low_precision(make(mask), "8bit", min_size=0) for mask in (full, prefix)]
  states = [tx.init(params) for tx in txs]
  assert states[1].storage == states[0].storage
  assert "8bit" in states[1].storage
  assert leaf_storage(states[1]) == leaf_storage(states[0])
  results = []
  for tx, state in zip(txs, states, strict=True):
    step = jax.jit(tx.update)
    for i in range(STEPS):
      grads = jax.tree.map(lambda p, i=i: jnp.sin(p * (i + 2.0)), params)
      updates, state = step(grads, state, params)
    results.append((jax.tree.leaves(updates), jax.tree.leaves(state)))
  assert_same_bits(results[1], results[0])
