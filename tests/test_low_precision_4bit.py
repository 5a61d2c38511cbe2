"""`low_precision(tx, "4bit")`: the codec against a numpy reference, its hazards, adam against
optax's, sharding, checkpoints and state dicts."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import test_low_precision as lp
import test_low_precision_sharded as lps
import test_sharded_training as st
from jax.sharding import PartitionSpec as P
from optimizer_table import assert_same_bits

from t5x_optim import (
  OptaxWrapper,
  OptimizerState,
  Quantized4Leaf,
  Rank1Quantized4Leaf,
  TrainState,
  convert_state,
  float32_to_low_precision,
  low_precision,
  low_precision_to_float32,
  restore_t5x_checkpoint,
  save_t5x_checkpoint,
)
from t5x_optim._low_precision.low_precision import leaf_storage
from t5x_optim._low_precision.quantize4 import (
  dequantize4,
  dequantize4_lane,
  leaf_block4,
  quantize4,
  quantize4_lanes,
  quantize4_stats,
  signed_map4,
  unpacked_shape,
  uses_rank1,
)
from t5x_optim._training import plan as plan_lib
from t5x_optim.checkpoints import Checkpointer
from t5x_optim.partitioning import abstract_train_state

pytestmark = pytest.mark.usefixtures("shared_compilation_cache")

_quantize = jax.jit(quantize4, static_argnums=1, static_argnames="rank1")
_dequantize = jax.jit(dequantize4)
SIGNED_HALF_GAP = 0.1125
"""Half the widest gap of the signed map (0.6625 to 0.8875): its largest rounding error."""

# The reference: the codec in numpy, element by element.


def bitsandbytes_map4() -> np.ndarray:
  """``bitsandbytes.functional.create_dynamic_map(signed=True, max_exponent_bits=3,
  total_bits=4)``, written out: decade i of 2**i steps of [0.1, 1] times 10**(i - 2)."""
  data = []
  for i in range(3):
    boundaries = np.linspace(0.1, 1, 2**i + 1)
    means = (boundaries[:-1] + boundaries[1:]) / 2.0
    data += list(10 ** (-2 + i) * means) + list(-(10 ** (-2 + i)) * means)
  return np.sort(np.asarray([*data, 0.0, 1.0], np.float32))


def _ref_blocks(a: np.ndarray, block) -> np.ndarray:
  """``a`` with each block's elements on the last axis: blocks of ``block`` (one row) or of
  ``(rows, cols)``."""
  rows, cols = (1, block) if isinstance(block, int) else block
  if rows == 1:
    return a.reshape(*a.shape[:-1], -1, cols)
  split = a.reshape(*a.shape[:-2], a.shape[-2] // rows, rows, a.shape[-1] // cols, cols)
  return np.moveaxis(split, -3, -2).reshape(*split.shape[:-3], split.shape[-2], rows * cols)


def _ref_spread(per_block: np.ndarray, block) -> np.ndarray:
  rows, cols = (1, block) if isinstance(block, int) else block
  wide = np.repeat(per_block, cols, -1)
  return wide if rows == 1 else np.repeat(wide, rows, -2)


def ref_stats(x: np.ndarray, block):
  """Each block's scale (its largest finite magnitude; where that is a negative element's,
  the one that decodes it from the map's most negative value), each block's sign, the
  column maxima."""
  magnitude = np.where(np.isfinite(x), np.abs(x), 0).astype(np.float32)
  negative = (x < 0) & np.isfinite(x)
  absmax = _ref_blocks(magnitude, block).max(-1)
  extreme = (_ref_blocks(np.where(negative, magnitude, 0), block).max(-1) == absmax) & (absmax > 0)
  scale = np.vectorize(lp.ref_extreme_scale, otypes=[np.float32])
  absmax = np.where(extreme, scale(absmax, -signed_map4()[0]), absmax).astype(np.float32)
  signed = _ref_blocks(negative, block).any(-1)
  cols = magnitude.max(tuple(range(x.ndim - 1))) if x.ndim > 1 else None
  return absmax, signed, cols


def ref_element_scales(x_shape, block, absmax, signed, cols, rank1):
  absmax_e = _ref_spread(absmax, block)
  signed_e = _ref_spread(signed, block)
  unsigned = absmax_e
  if rank1:
    unsigned = np.minimum(absmax_e, cols)
  return signed_e, np.where(signed_e, absmax_e, unsigned)


def ref_quantize4(x: np.ndarray, block: int, rank1: bool) -> np.ndarray:
  """The packed codes: the nearest signed map value (ties down), or round(15 s) (at least 1
  for a positive s) for unsigned blocks."""
  absmax, signed, cols = ref_stats(x, block)
  signed_e, scale = ref_element_scales(x.shape, block, absmax, signed, cols, rank1)
  with np.errstate(invalid="ignore", divide="ignore"):
    s = np.clip(np.where(scale > 0, x / np.where(scale > 0, scale, 1), 0), -1, 1)
  s = np.where(np.isnan(x), 0, s).astype(np.float32)
  table = signed_map4()
  mids = (table[:-1] + table[1:]) / np.float32(2)
  codes = np.where(
    signed_e,
    np.searchsorted(mids, s, side="left"),
    np.where(s > 0, np.clip(np.floor(s * 15 + 0.5), 1, 15), 0),
  ).astype(np.uint8)
  return codes[..., 0::2] | (codes[..., 1::2] << 4)


def ref_dequantize4(x_codes: np.ndarray, x: np.ndarray, block: int, rank1: bool) -> np.ndarray:
  codes = np.stack([x_codes & 15, x_codes >> 4], -1).reshape(x.shape).astype(np.int64)
  absmax, signed, cols = ref_stats(x, block)
  signed_e, scale = ref_element_scales(x.shape, block, absmax, signed, cols, rank1)
  unsigned = (codes.astype(np.float32) * np.float32(1 / 15)) * scale
  return np.where(signed_e, signed_map4()[codes] * scale, unsigned)


def _mixed(shape, seed=0):
  """Blocks of both signs, magnitudes over 10 decades, rows and columns of different size."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=shape) * 10.0 ** rng.integers(-8, 2, size=shape)
  x *= 10.0 ** rng.integers(-2, 2, size=shape[:-1] + (1,))
  x = x.astype(np.float32)
  half = x.reshape(*shape[:-1], -1, 16)
  half[..., ::2, :] = np.abs(half[..., ::2, :])  # every other block of 16 unsigned
  return half.reshape(shape)


def test_signed_map_is_bitsandbytes_dynamic_map_in_4_bits():
  np.testing.assert_array_equal(signed_map4(), bitsandbytes_map4())


@pytest.mark.parametrize("block, scales", [(16, (24, 4)), ((4, 16), (6, 4))], ids=["1x16", "4x16"])
@pytest.mark.parametrize("rank1", [False, True], ids=["block-wise", "rank-1"])
def test_codes_and_values_match_the_reference(rank1, block, scales):
  x = _mixed((24, 64))
  got = _quantize(jnp.asarray(x), block, rank1=rank1)
  assert isinstance(got, Rank1Quantized4Leaf if rank1 else Quantized4Leaf)
  assert got.codes.dtype == jnp.uint8 and got.codes.shape == (24, 32)
  assert got.scales.shape == scales
  want = ref_quantize4(x, block, rank1)
  np.testing.assert_array_equal(np.asarray(got.codes), want)
  np.testing.assert_array_equal(
    np.asarray(_dequantize(got)), ref_dequantize4(want, x, block, rank1).astype(np.float32)
  )


@pytest.mark.parametrize("rank1", [False, True], ids=["block-wise", "rank-1"])
def test_round_trip_error_is_within_the_maps_half_steps(rank1):
  """Signed blocks: within half the widest gap of the map, of the block's maximum.
  Unsigned: within half a step (1/30) of the element's scale, or one step below it."""
  x = _mixed((32, 128), seed=1)
  back = np.asarray(_dequantize(_quantize(jnp.asarray(x), 16, rank1=rank1)))
  absmax, signed, cols = ref_stats(x, 16)
  signed_e, scale = ref_element_scales(x.shape, 16, absmax, signed, cols, rank1)
  error = np.abs(back - x)
  slack = 1e-6 * scale
  assert (error[signed_e] <= SIGNED_HALF_GAP * scale[signed_e] + slack[signed_e]).all()
  unsigned = ~signed_e
  large = unsigned & (x >= scale / 30)
  assert (error[large] <= scale[large] / 30 + slack[large]).all()
  assert (error[unsigned] <= scale[unsigned] / 15 + slack[unsigned]).all()
  if rank1:  # rank-1 scales are finer than the blocks' for a fifth of these values
    assert (scale[unsigned] < np.repeat(absmax, 16, -1)[unsigned]).mean() > 0.2


@pytest.mark.parametrize("rank1", [False, True], ids=["block-wise", "rank-1"])
def test_no_positive_value_decodes_to_zero(rank1):
  """Second moments from 1e-37 to 1e3 beside each other (normal float32s: XLA flushes
  subnormal ones to 0): each decodes positive; 0 stays 0."""
  rng = np.random.default_rng(3)
  x = (10.0 ** rng.uniform(-37, 3, size=(16, 64))).astype(np.float32)
  x[rng.random(x.shape) < 0.1] = 0.0
  back = np.asarray(_dequantize(_quantize(jnp.asarray(x), 16, rank1=rank1)))
  assert (back[x > 0] > 0).all()
  assert (back[x == 0] == 0).all()


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("negatives", [True, False], ids=["signed", "unsigned"])
@pytest.mark.parametrize("rank1", [False, True], ids=["block-wise", "rank-1"])
@pytest.mark.parametrize(
  "block", [16, pytest.param((4, 16), marks=pytest.mark.slow)], ids=["1x16", "4x16"]
)
def test_a_non_finite_value_damages_only_its_own_element(bad, negatives, rank1, block):
  """Every other element encodes as with 0 in its place; every value decodes finite."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(8, 64)).astype(np.float32)
  x = x if negatives else np.abs(x)
  clean = x.copy()
  clean[1, 21] = 0.0
  x[1, 21] = bad
  got = _quantize(jnp.asarray(x), block, rank1=rank1)
  want = _quantize(jnp.asarray(clean), block, rank1=rank1)
  for a, b in zip(got[1:], want[1:], strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  others = np.ones(x.shape, bool)
  others[1, 21] = False
  unpacked = [np.stack([c & 15, c >> 4], -1).reshape(x.shape) for c in (got.codes, want.codes)]
  np.testing.assert_array_equal(unpacked[0][others], unpacked[1][others])
  assert np.isfinite(np.asarray(_dequantize(got))).all()


@pytest.mark.parametrize("block", [16, (2, 16)], ids=["1x16", "2x16"])
@pytest.mark.parametrize("rank1", [False, True], ids=["block-wise", "rank-1"])
def test_decode_and_encode_again_is_the_identity_for_signed_blocks(rank1, block):
  """A block whose largest magnitude is negative decodes it as that magnitude (to an ulp),
  not 0.8875 of it, so encoding the decoded values gives the same codes and block scales,
  round trip after round trip. Column maxima count the signed blocks' elements, which
  decode rounded: they change on the first round trip (unsigned blocks' elements that
  reach them decode exactly), then stay."""
  x = lp._extreme_blocks(64)
  x = x[: len(x) // 2 * 2]
  first = _quantize(jnp.asarray(x), block, rank1=rank1)
  back = np.asarray(_dequantize(first))
  magnitude = np.where(np.isfinite(x), np.abs(x), 0)
  blocks, backs = (_ref_blocks(a, block) for a in (np.where(np.isfinite(x), x, 0), back))
  absmax = _ref_blocks(magnitude, block).max(-1)
  negative = (-blocks == absmax[..., None]).any(-1) & (absmax > 0)
  decoded = -backs.min(-1)[negative]
  assert (np.abs(decoded - absmax[negative]) <= np.spacing(absmax[negative])).all()
  again = _quantize(_dequantize(first), block, rank1=rank1)
  stored = again
  for _ in range(100):
    stored = _quantize(_dequantize(stored), block, rank1=rank1)
    for got, want, fixed in zip(stored, first, again, strict=True):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want if got.ndim > 1 else fixed))


def test_without_the_guard_a_non_finite_value_damages_its_block():
  x = np.abs(np.random.default_rng(0).normal(size=(4, 64))).astype(np.float32)
  x[1, 21] = np.inf
  leaf = jax.jit(
    functools.partial(quantize4, rank1=False, guard_nonfinite=False), static_argnums=1
  )(jnp.asarray(x), 16)
  assert np.isinf(np.asarray(leaf.scales)[1, 1])


@pytest.mark.slow
def test_a_non_finite_gradient_element_damages_only_its_own_param():
  """Through adam's streamed 4-bit step: one inf gradient element, then a clean step."""
  tx = low_precision(optax.adam(1e-2), "4bit", min_size=0)
  params = {"w": jnp.ones((256, 512)), "b": jnp.ones((512,))}
  state = tx.init(params)
  assert isinstance(state.inner_state[0].nu["w"], Rank1Quantized4Leaf)
  grads = jax.tree.map(lambda p: jnp.full(p.shape, 0.5), params)
  bad = {"w": grads["w"].at[1, 7].set(jnp.inf), "b": grads["b"].at[7].set(jnp.nan)}
  step = jax.jit(tx.update)
  for i, g in enumerate((bad, grads)):
    updates, state = step(g, state, params)
    for name, where in (("w", (1, 7)), ("b", (7,))):
      finite = np.isfinite(np.asarray(updates[name]))
      others = np.ones(finite.shape, bool)
      others[where] = False
      assert finite[others].all(), (i, name)
      assert i > 0 or not finite[where]
    params = optax.apply_updates(params, updates)


# Shapes: which leaves are 4-bit, and never more bytes than float32.


def _bytes_per_value(leaf) -> float:
  leaves = jax.tree.leaves(leaf)
  quantized = isinstance(leaf, (Quantized4Leaf, Rank1Quantized4Leaf))
  return sum(math.prod(x.shape) * x.dtype.itemsize for x in leaves) / math.prod(
    unpacked_shape(leaf) if quantized else leaf.shape
  )


_ODD = "float32: no even 4-bit block of 4 or more values tiles the last dimension and its shards"


@pytest.mark.parametrize(
  "shape, storage, bytes_per_value",
  [
    ((0, 256), "float32: below min_size", 4),
    ((1,), _ODD, 4),
    ((7,), _ODD, 4),
    ((8192, 1), _ODD, 4),
    ((64, 257), _ODD, 4),
    ((8, 24), _ODD, 4),  # one block of 24 has 12 bytes of codes: they do not split in 8
    ((1, 4096), "4bit", 0.5 + 4 / 128),  # rank-1 scales would cost a float32 per column
    ((4096, 4), _ODD, 4),  # one block of 4 has 2 bytes of codes: they do not split in 4
    ((4096, 16), "4bit", 0.5 + 4 / 128 + 4 / 4096),  # blocks of 8 rows x 16, column maxima
    ((16,), "4bit", 0.5 + 4 / 16),  # one block
    ((64, 256), "4bit", 0.5 + 4 / 128),  # 4 rows x 32: column maxima would cost more
    ((128, 256), "4bit", 0.5 + 4 / 128 + 4 / 128),  # 4 rows x 32, column maxima
    ((2, 8, 256), "4bit", 0.5 + 4 / 32),  # 8 rows over 8 shards: blocks of 1 row
    ((2, 64, 256), "4bit", 0.5 + 4 / 128 + 4 / 128),
    # 32128 columns over 8 shards: blocks of 16 columns, over rows that tile the rows' shards
    ((96, 32128), "4bit", 0.5 + 4 / 96 + 4 / 96),  # 6 of the 12 rows a shard holds
    ((768, 32128), "4bit", 0.5 + 4 / 128 + 4 / 768),  # 8 of 96
    ((12, 64), "4bit", 0.5 + 4 / 24),  # 64 over 8 shards: blocks of 8, over 3 rows of 12
  ],
)
def test_a_leaf_is_never_stored_in_more_bytes_than_float32(shape, storage, bytes_per_value):
  """The layout follows from the shapes: planned abstractly, as `t5x-optim plan` does."""
  params = {"w": jax.ShapeDtypeStruct(shape, jnp.float32)}
  tx = low_precision(optax.adam(1e-3), "4bit", min_size=0)
  state = jax.eval_shape(tx.init, params)
  mu = state.inner_state[0].mu["w"]
  kinds = set(leaf_storage(state).values()) - {"kept: not param-shaped"}
  if storage == "4bit":
    fields = mu._fields
    assert kinds == {f"4bit {f}" for f in fields}
    assert isinstance(mu, Rank1Quantized4Leaf) == (len(fields) == 3)
    assert _bytes_per_value(mu) == pytest.approx(bytes_per_value)
    assert bytes_per_value < 4
  else:
    assert kinds == {storage}
    assert mu.dtype == jnp.float32 and mu.shape == shape


# One compiled 4-bit step per shape: about a second each, all but one slow.
@pytest.mark.parametrize(
  "shape",
  [
    (64, 256),
    *(
      pytest.param(shape, marks=pytest.mark.slow)
      for shape in [(1, 4096), (4096, 16), (16,), (2, 8, 256), (2, 64, 256), (96, 32128)]
    ),
  ],
)
@pytest.mark.slow
def test_each_4bit_layout_updates_like_float32_adam(shape):
  params = {"w": jnp.zeros(shape)}
  tx = low_precision(optax.adam(1e-3), "4bit", min_size=0)
  grads = {"w": jnp.asarray(np.random.default_rng(0).normal(size=shape), jnp.float32)}
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  want, _ = optax.adam(1e-3).update(grads, optax.adam(1e-3).init(params), params)
  np.testing.assert_allclose(updates["w"], want["w"], rtol=0.2, atol=1e-7)


@pytest.mark.parametrize("block_size, shard_multiple", [(128, 8), (128, 1), (4, 4), (64, 8)])
def test_every_block_is_even_and_its_codes_shard_with_the_param(block_size, shard_multiple):
  """Every last dimension up to 2100: an even block tiling it, or None (float32).

  The codes' last dimension (half the param's) splits wherever the param's does
  over up to shard_multiple devices, and so do the block scales, or there is one block.
  """
  for last_dim in range(1, 2100):
    block = leaf_block4(last_dim, block_size, shard_multiple)
    if block is None:
      continue
    count, shards = last_dim // block, math.gcd(last_dim, shard_multiple)
    assert 4 <= block <= block_size and block % 2 == 0 and count * block == last_dim
    assert (last_dim // 2) % shards == 0, (last_dim, block)
    assert count == 1 or count % shards == 0, (last_dim, block)


def test_adamw_state_of_a_t5_base_kernel_takes_under_1_1_bytes_per_param():
  """768x3072 (a T5.1.1-base mlp kernel), the shipped settings: 0.5 B of codes per value,
  block scales of 128 and column maxima."""
  params = {"wi": jax.ShapeDtypeStruct((768, 3072), jnp.float32)}
  state = jax.eval_shape(low_precision(optax.adamw(1e-3), "4bit").init, params)
  moments = [state.inner_state[0].mu["wi"], state.inner_state[0].nu["wi"]]
  total = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(moments))
  per_param = total / (768 * 3072)
  assert per_param == pytest.approx(2 * (0.5 + 4 / 128 + 4 / 768))
  assert per_param <= 1.1
  codes = sum(math.prod(m.codes.shape) for m in moments)
  assert codes == 768 * 3072


def test_adamw_state_of_t5_1_1_base_takes_at_most_1_1_bytes_per_param():
  """The whole unscanned T5.1.1-base (247.6M params), the shipped settings. Its untied
  logits, 768 x 32128, have blocks of 16 columns (32128 over 8 shards allows no more), so
  they span 8 rows: 1/32 byte of scales per value, not 1/4 (the model would take 1.13)."""
  d, ff, vocab, layers = 768, 2048, 32128, 12
  shapes = {"embedding": (vocab, d), "logits": (d, vocab)}
  shapes |= {f"attention_{i}": (d, d) for i in range(12 * layers)}  # 4 encoder, 8 decoder
  shapes |= {f"wi_{i}": (d, ff) for i in range(4 * layers)}
  shapes |= {f"wo_{i}": (ff, d) for i in range(2 * layers)}
  shapes |= {f"norm_{i}": (d,) for i in range(5 * layers + 2)}
  params = {k: jax.ShapeDtypeStruct(v, jnp.float32) for k, v in shapes.items()}
  state = jax.eval_shape(low_precision(optax.adamw(1e-3), "4bit").init, params)
  count = sum(math.prod(v) for v in shapes.values())
  total = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(state))
  assert count == 247_577_088
  assert total / count <= 1.1
  assert state.inner_state[0].mu["logits"].scales.shape == (768 // 8, 32128 // 16)


# Adam over a few steps, against optax's.


@pytest.mark.slow
def test_a_few_steps_of_adamw_stay_close_to_optax():
  """Ten steps on gradients with a steady direction (plus noise): the params stay within
  30% of float32 adamw's movement (relative L2; 8 bits stay within 1.1%, 4 bits measured
  20%), from 4-bit's codec error in mu (a signed map whose rounding reaches 11% of a
  block's scale) and nu (1/15 of its scale).

  The gradients do not depend on the params, so optax's moments are the exact EMAs of the
  same gradients: the stored moment's error after t steps is at most the codec's error
  per step times 1 + b + ... + b**(t-1) (each step decodes, decays and encodes again).
  """
  rng = np.random.default_rng(0)
  params = {
    "w": jnp.asarray(rng.normal(size=(256, 512)), jnp.float32),
    "b": jnp.asarray(rng.normal(size=(512,)), jnp.float32),
  }
  direction = jax.tree.map(lambda p: rng.normal(size=p.shape).astype(np.float32), params)
  grads = [
    jax.tree.map(lambda d: jnp.asarray(d + 0.5 * rng.normal(size=d.shape), jnp.float32), direction)
    for _ in range(10)
  ]

  def run(tx):
    state, p = tx.init(params), params
    step = jax.jit(tx.update)
    for g in grads:
      updates, state = step(g, state, p)
      p = optax.apply_updates(p, updates)
    return p, state

  want, want_state = run(optax.adamw(1e-3))
  got, state = run(low_precision(optax.adamw(1e-3), "4bit", min_size=0))
  for name in params:
    moved = np.linalg.norm(want[name] - params[name])
    assert np.linalg.norm(got[name] - want[name]) <= 0.3 * moved, name
  decoded = low_precision_to_float32(state)[0]
  for field, error, decay in (("mu", SIGNED_HALF_GAP, 0.9), ("nu", 1 / 15, 0.999)):
    bound = error * (1 - decay ** len(grads)) / (1 - decay)
    for name in params:
      a, b = getattr(decoded, field)[name], getattr(want_state[0], field)[name]
      assert np.max(np.abs(a - b)) <= bound * np.max(np.abs(b)), (field, name)


# Sharded, planned, checkpointed, and in state dicts.


@functools.cache
def _opt_def():
  tx = low_precision(optax.adamw(1e-2), "4bit", block_size=4, shard_multiple=4, min_size=0)
  return OptaxWrapper(tx)


def _fresh():
  return TrainState.create(_opt_def(), st._variables("axes"))


def _expected_specs(zero: bool) -> dict[str, P]:
  """The 2x4 mesh's spec of every 4-bit leaf: codes and scales like their param, column
  maxima like its last dimension."""
  mlp, embed = (P(("model", "data")), P("data")) if zero else (P("model"), P())
  if zero:
    wi, bi, wo = P("data", "model"), P(("model", "data")), P("model", "data")
  else:
    wi, bi, wo = P(None, "model"), P("model"), P("model")
  specs = {".count": P(), ".inner_state[0].count": P()}
  for moment in ("mu", "nu"):
    where = f".inner_state[0].{moment}"
    for name, spec in (("wi", wi), ("bi", bi), ("wo", wo)):
      specs[f"{where}['{name}'].codes"] = specs[f"{where}['{name}'].scales"] = spec
    # A vector of the mlp axis shards as bi does (ZeRO: over both mesh axes).
    specs[f"{where}['wi'].cols"], specs[f"{where}['wo'].cols"] = mlp, embed
  return specs


@pytest.mark.slow
@pytest.mark.parametrize("zero", [False, True])
def test_sharded_training_matches_unsharded(zero):
  """2x4 mesh, jitted and donated: the losses and state of the unsharded run, the specs above."""
  want_state, want_losses = lps._train(_fresh())
  partitioner = st._partitioner(2, 4, zero=zero)
  state, losses = lps._train(_fresh(), partitioner)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-7)
  assert isinstance(state.param_states.inner_state[0].nu["wi"], Rank1Quantized4Leaf)
  assert lps._spec_paths(state.param_states) == _expected_specs(zero)
  _, rule_specs = st._expected_specs(state, partitioner)
  assert st._actual_specs(state.param_states) == st._normalized(rule_specs)
  for got, want in zip(
    jax.tree.leaves(state.param_states), jax.tree.leaves(want_state.param_states), strict=True
  ):
    assert got.dtype == want.dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=1e-6)


def test_plan_shows_each_leafs_storage_and_bytes():
  partitioner = st._partitioner(2, 4, zero=True)
  state = abstract_train_state(partitioner, _opt_def(), st.AxesMLP().init, *st._init_args())
  plan = plan_lib.build_plan(state, logical=state.as_logical_axes())
  moments = [row for row in plan.rows if row.storage.startswith("4bit")]
  # codes and scales of 3 params, column maxima of the 2 kernels, for mu and nu
  assert len(moments) == 2 * (3 * 2 + 2)
  assert {row.storage for row in moments} == {"4bit codes", "4bit scales", "4bit cols"}
  assert {row.param for row in moments} == {"wi", "bi", "wo"}
  assert {row.group for row in moments} == {"inner_state/0/mu", "inner_state/0/nu"}
  e, m = st.EMBED, st.MLP
  per_moment = (e * m + m + m * e) * (0.5 + 4 / 4) + 4 * (m + e)
  assert sum(row.total_bytes for row in moments) == 2 * per_moment
  for row in moments:  # over the mesh axes of their dimensions: column maxima over fewer
    devices = math.prod(
      plan.mesh_shape[name]
      for axes in row.mesh_axes
      for name in (axes if isinstance(axes, tuple) else (axes,) if axes else ())
    )
    assert row.bytes_per_device * devices == row.total_bytes, row
    assert devices == 8 or row.storage == "4bit cols", row
    assert row.dropped_axes == (), "a part of a compressed moment, not a factored moment"
  table = plan_lib.format_table(plan)
  assert "4bit cols" in table and "factored" not in table


@pytest.mark.slow
def test_checkpoint_round_trip_bit_for_bit(tmp_path):
  """Our checkpoints, sharded on 2x4: every array and sharding back exactly."""
  partitioner = st._partitioner(2, 4, zero=True)
  state, _ = lps._train(_fresh(), partitioner)
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(st.STEPS, state)
  target = jax.device_put(_fresh(), partitioner.get_shardings(_fresh()))
  with Checkpointer(tmp_path) as ckpt:
    restored = ckpt.restore(target)
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
    assert got.dtype == want.dtype and got.sharding == want.sharding
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _trained_optimizer():
  params = {"dense": {"kernel": jnp.ones((128, 256))}, "bias": jnp.ones((256,))}
  opt_def = OptaxWrapper(low_precision(optax.adamw(1e-2), "4bit", min_size=0))
  grads = jax.tree.map(lambda p: jnp.asarray(np.random.default_rng(0).normal(size=p.shape)), params)
  return params, opt_def, opt_def.create(params).apply_gradient(grads)


@pytest.mark.slow
def test_t5x_checkpoint_round_trip_bit_for_bit(tmp_path):
  params, opt_def, optimizer = _trained_optimizer()
  save_t5x_checkpoint(tmp_path, optimizer)
  restored = restore_t5x_checkpoint(tmp_path, opt_def.create(params))
  assert_same_bits(restored.state, optimizer.state)
  assert_same_bits(restored.target, optimizer.target)


@pytest.mark.slow
def test_state_dict_keys_and_validated_restore():
  params, opt_def, optimizer = _trained_optimizer()
  state_dict = optimizer.state_dict()["state"]["param_states"]
  mu = state_dict["inner_state"]["0"]["mu"]
  assert sorted(mu["dense"]["kernel"]) == ["codes", "cols", "scales"]
  assert sorted(mu["bias"]) == ["codes", "scales"]
  assert mu["dense"]["kernel"]["codes"].shape == (128, 128)
  assert_same_bits(
    opt_def.create(params).restore_state(optimizer.state_dict()).state, optimizer.state
  )
  bad = optimizer.state_dict()
  del bad["state"]["param_states"]["inner_state"]["0"]["nu"]["dense"]["kernel"]["cols"]
  with pytest.raises(ValueError, match=r"inner_state/0/nu/dense/kernel"):
    opt_def.create(params).restore_state(bad)


@pytest.mark.slow
def test_float32_round_trip_and_logical_axes():
  """Decoded to adamw's own state and encoded back: nu (unsigned, each row's, column's and
  block's largest value decodes exactly) bit for bit; mu's codes and block scales too (each
  block's largest magnitude decodes as itself, a negative one included), so it decodes to
  the same values. Column maxima get their param's last axis."""
  params, opt_def, optimizer = _trained_optimizer()
  expanded = low_precision_to_float32(optimizer.state.param_states)
  assert expanded[0].nu["dense"]["kernel"].dtype == jnp.float32
  back = float32_to_low_precision(expanded, optimizer.state.param_states)
  assert_same_bits(back.inner_state[0].nu, optimizer.state.param_states.inner_state[0].nu)
  stored = (back, optimizer.state.param_states)
  mu = [jax.tree.leaves(s.inner_state[0].mu, is_leaf=lambda x: hasattr(x, "codes")) for s in stored]
  for got, want in zip(*mu, strict=True):
    assert_same_bits((got.codes, got.scales), (want.codes, want.scales))
  assert_same_bits(low_precision_to_float32(back)[0].mu, expanded[0].mu)
  axes = {"dense": {"kernel": P("embed", "mlp")}, "bias": P("mlp")}
  specs = opt_def.derive_logical_axes(optimizer, axes).state.param_states
  assert specs.inner_state[0].nu == {
    "dense": {"kernel": Rank1Quantized4Leaf(P("embed", "mlp"), P("embed", "mlp"), P("mlp"))},
    "bias": Quantized4Leaf(P("mlp"), P("mlp")),
  }


def test_column_maxima_only_where_they_cost_no_more_than_the_block_scales():
  assert uses_rank1((768, 3072), 128) and uses_rank1((4, 32, 256), 128)
  assert not uses_rank1((3072,), 128) and not uses_rank1((1, 4096), 128)
  assert not uses_rank1((2, 8, 256), 32)


@pytest.mark.slow
def test_a_4bit_leaf_outside_a_low_precision_state_is_refused_with_its_path():
  """convert_state decodes 4-bit leaves only inside their LowPrecisionState."""
  params, _, optimizer = _trained_optimizer()
  inner = optimizer.state.param_states.inner_state  # 4-bit leaves without their wrapper
  bare = OptaxWrapper(optax.adamw(1e-2)).create(params)
  bare = bare.replace(state=OptimizerState(jnp.int32(1), inner))
  with pytest.raises(ValueError, match=r"source state's leaf '0/mu/bias' is 4-bit"):
    convert_state(bare, OptaxWrapper(optax.lion(1e-3)))


@pytest.mark.parametrize(
  "shape, block",
  [
    pytest.param((16, 64), (1, 16), marks=pytest.mark.slow),
    ((12, 16), (4, 8)),
    pytest.param((48,), (1, 8), marks=pytest.mark.slow),
  ],
)
def test_the_lanes_codec_is_the_interleaved_one(shape, block):
  """`quantize4_lanes` of the even and odd columns stores what `quantize4` does, and
  `dequantize4_lane` reads back those columns of `dequantize4`, bit for bit."""
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.normal(size=shape) * np.exp(rng.normal(size=shape) * 3), jnp.float32)
  x = x.at[(0,) * len(shape)].set(jnp.inf)
  for values in (x, jnp.abs(x)):
    rank1 = len(shape) >= 2
    whole = quantize4(values, block, rank1=rank1)
    stats = quantize4_stats(values, block, rank1=rank1)
    pair = (values[..., 0::2], values[..., 1::2])
    lanes = jax.jit(quantize4_lanes, static_argnums=1)(pair, block, stats)
    assert type(lanes) is type(whole)
    for got, want in zip(lanes, whole, strict=True):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    decoded = np.asarray(dequantize4(whole))
    read = jax.jit(dequantize4_lane, static_argnums=1)
    for lane in (0, 1):
      np.testing.assert_array_equal(np.asarray(read(whole, lane)), decoded[..., lane::2])
