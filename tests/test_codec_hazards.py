"""The 8-bit codec on hand-made inputs: non-finite values, tiny second moments, short blocks."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from t5x_optim import OptaxWrapper, QuantizedLeaf, low_precision
from t5x_optim._low_precision.low_precision import leaf_storage
from t5x_optim._low_precision.quantize import dequantize, dynamic_map, leaf_block, quantize
from t5x_optim._low_precision.quantize4 import dequantize4, quantize4

_quantize = jax.jit(quantize, static_argnums=1)
_dequantize = jax.jit(dequantize)

# 1. A non-finite value damages at most its own element.


def _in_its_place(x: np.ndarray, where: tuple[int, int]) -> np.ndarray:
  """``x`` with its non-finite element at ``where`` replaced as the block statistics count it.

  0 for +inf and NaN; for -inf, a negative value too small to be any block's extreme (-inf
  makes its block signed).
  """
  out = x.copy()
  out[where] = -1e-30 if x[where] == -np.inf else 0.0
  return out


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("negatives", [True, False], ids=["signed", "unsigned"])
def test_a_non_finite_value_damages_only_its_own_element(bad, negatives):
  """The block keeps its scale and map: other elements encode as if the value were finite."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(4, 64)).astype(np.float32)
  x = x if negatives else np.abs(x)
  x[1, 21] = bad
  got = _quantize(jnp.asarray(x), 16)
  want = _quantize(jnp.asarray(_in_its_place(x, (1, 21))), 16)
  np.testing.assert_array_equal(np.asarray(got.scales), np.asarray(want.scales))
  others = np.ones(x.shape, bool)
  others[1, 21] = False
  np.testing.assert_array_equal(np.asarray(got.codes)[others], np.asarray(want.codes)[others])
  back = np.asarray(_dequantize(got))
  assert np.isfinite(back).all()
  absmax = np.abs(x[1, 16:32][np.isfinite(x[1, 16:32])]).max()
  saturated = 0.0 if np.isnan(bad) else np.sign(bad) * absmax  # the map's extreme of its sign
  np.testing.assert_allclose(back[1, 21], saturated, rtol=0.01)
  finite = np.isfinite(x)
  error = np.abs(back - x)[finite] / np.abs(x).max(where=finite, initial=0.0)
  assert error.max() < 0.01  # the codec's usual error, relative to the block's absmax


@pytest.mark.parametrize("bad", [np.inf, np.nan], ids=["inf", "nan"])
def test_a_block_of_zeros_and_one_non_finite_value_decodes_to_zeros(bad):
  x = np.zeros((1, 8), np.float32)
  x[0, 3] = bad
  back = np.asarray(_dequantize(_quantize(jnp.asarray(x), 8)))
  np.testing.assert_array_equal(back, np.zeros_like(x))


# 2. A nonzero second moment never decodes to zero.


@pytest.mark.parametrize("mode", ["8bit", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_a_non_finite_gradient_element_damages_only_its_own_param(mode):
  """Through adam's streamed step: one inf gradient element; every other param stays finite.

  float32 adam damages that element alone (its update is NaN); so does the
  low-precision state, over this step and a clean one after it (where 8 bits
  have stored the inf as its block's largest finite value, and bfloat16 as inf).
  """
  tx = low_precision(optax.adam(1e-2), mode, min_size=0)
  params = {"w": jnp.ones((4, 256))}
  state = tx.init(params)
  grads = {"w": jnp.full((4, 256), 0.5).at[1, 7].set(jnp.inf)}
  step = jax.jit(tx.update)
  others = np.ones((4, 256), bool)
  others[1, 7] = False
  for i, g in enumerate((grads, {"w": jnp.full((4, 256), 0.5)})):
    updates, state = step(g, state, params)
    finite = np.isfinite(np.asarray(updates["w"]))
    assert finite[others].all()
    assert i > 0 or not finite[1, 7]
    params = optax.apply_updates(params, updates)


@pytest.mark.slow
def test_apply_if_finite_refuses_the_whole_step_and_keeps_the_stored_state():
  """The other choice: ``optax.apply_if_finite`` around the 8-bit optimizer skips the step."""
  tx = optax.apply_if_finite(low_precision(optax.adam(1e-2), "8bit", min_size=0), 3)
  params = {"w": jnp.ones((4, 256))}
  state = jax.jit(tx.update)({"w": jnp.full((4, 256), 0.5)}, tx.init(params), params)[1]
  updates, after = jax.jit(tx.update)(
    {"w": jnp.full((4, 256), 0.5).at[1, 7].set(jnp.nan)}, state, params
  )
  assert not np.asarray(updates["w"]).any()
  for x, y in zip(jax.tree.leaves(after.inner_state), jax.tree.leaves(state.inner_state)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert int(after.notfinite_count) == 1


def test_a_tiny_nonnegative_value_decodes_to_the_smallest_map_value_not_zero():
  """In a block without negatives (adam's nu) only an exact 0 decodes to 0."""
  x = np.float32([[1.0, 1e-7, 1e-12, 1e-30, 0.0, 5e-7, 1e-3, 0.5]])
  back = np.asarray(_dequantize(_quantize(jnp.asarray(x), 8)))[0]
  smallest = dynamic_map(False)[1]
  np.testing.assert_array_equal(back[[1, 2, 3]], [smallest] * 3)
  assert back[4] == 0.0
  np.testing.assert_allclose(back[[0, 5, 6, 7]], x[0, [0, 5, 6, 7]], rtol=0.4)
  far = np.float32([[1e20, 1e-25, 0.0, 1.0]])  # 1e-45 of the maximum: a subnormal ratio
  back = np.asarray(_dequantize(_quantize(jnp.asarray(far), 4)))[0]
  np.testing.assert_array_equal(back[1:3] / np.float32(1e20), [smallest, 0.0])


def test_a_tiny_signed_value_still_rounds_to_zero():
  """With a negative in the block (adam's mu), a value below the map's floor decodes to 0:
  an overestimated mu would scale adam's update up, a zero one only stops it."""
  x = np.float32([[1.0, -1.0, 1e-9, -1e-9]])
  back = np.asarray(_dequantize(_quantize(jnp.asarray(x), 4)))[0]
  np.testing.assert_array_equal(back, [1.0, -1.0, 0.0, 0.0])


def _adam_run(tx: optax.GradientTransformation, grads: jax.Array, steps: int) -> np.ndarray:
  params = {"w": jnp.zeros(grads.shape)}

  def body(carry, _):
    params, state = carry
    updates, state = tx.update({"w": grads}, state, params)
    return (optax.apply_updates(params, updates), state), None

  (params, _), _ = jax.lax.scan(body, (params, tx.init(params)), None, length=steps)
  return np.asarray(params["w"])


@pytest.mark.parametrize("signs", [(1, 1), (1, -1)], ids=["nu-and-mu-unsigned", "mu-signed"])
@pytest.mark.parametrize(
  "ratio",
  [1e-4, *(pytest.param(r, marks=pytest.mark.slow) for r in (1e-2, 1e-3, 3e-4, 1e-5, 1e-8))],
)
@pytest.mark.slow
def test_adam_moves_a_tiny_gradient_element_no_farther_than_float32(ratio, signs):
  """The zero-point problem: one block holds large and tiny constant gradients, 300 steps.

  float32 adam moves every element by about lr * steps. Where the tiny
  element's nu fell under the unsigned map's floor, it decoded as 0 and the
  update became mu / eps: 10x as far at ratio 1e-4. Now that nu decodes to
  at least the smallest map value (3.25e-7 of the block's largest), the
  tiny element moves at most as far as in float32, up to the map's error in
  its lowest decades: a stored nu as low as 1/1.69 of the true one (the
  widest gap between neighbours, 3.25e-7 to 7.75e-7 of the block's largest,
  rounded to the nearer), so an update up to sqrt(1.69) = 1.3x; and in the
  direction of float32's. The large elements move as in float32, within 1%.
  """
  big, tiny = signs
  grads = jnp.float32([big, ratio, tiny, ratio * tiny])
  steps = 300
  want = _adam_run(optax.adam(1e-3), grads, steps)
  tx = low_precision(optax.adam(1e-3), "8bit", min_size=0, shard_multiple=1)
  got = _adam_run(tx, grads, steps)
  np.testing.assert_allclose(got[[0, 2]], want[[0, 2]], rtol=0.01)
  assert (np.sign(got) == np.sign(want)).all(), (got, want)
  assert (np.abs(got[[1, 3]]) <= 1.3 * np.abs(want[[1, 3]])).all(), (got, want)


# 3. A leaf is never stored in more bytes than float32.


def _bytes_per_value(leaf) -> float:
  arrays = [leaf.codes, leaf.scales] if isinstance(leaf, QuantizedLeaf) else [leaf]
  return sum(a.nbytes for a in arrays) / math.prod(np.shape(arrays[0]))


_NO_BLOCK = "float32: no 8-bit block of 4 or more values tiles the last dimension"


@pytest.mark.parametrize(
  "shape, storage, bytes_per_value",
  [
    ((64, 257), _NO_BLOCK, 4),  # a prime last dimension above block_size
    ((8192, 1), _NO_BLOCK, 4),
    ((64, 4099), _NO_BLOCK, 4),
    ((1024, 3), _NO_BLOCK, 4),
    ((512, 8), "8bit", 1 + 4 / 8),  # one block: no aligned one of 4 or more
    pytest.param((4096, 16), "8bit", 1 + 4 / 16, marks=pytest.mark.slow),
    pytest.param((64, 24), "8bit", 1 + 4 / 24, marks=pytest.mark.slow),
    ((64, 32), "8bit", 1 + 4 / 4),  # aligned blocks of 4, as before
    pytest.param((64, 768), "8bit", 1 + 4 / 96, marks=pytest.mark.slow),
  ],
)
@pytest.mark.slow
def test_a_leaf_is_never_stored_in_more_bytes_than_float32(shape, storage, bytes_per_value):
  state = low_precision(optax.adam(1e-3), "8bit", min_size=0).init({"w": jnp.zeros(shape)})
  mu = state.inner_state[0].mu["w"]
  assert _bytes_per_value(mu) == pytest.approx(bytes_per_value)
  kinds = set(leaf_storage(state).values()) - {"kept: not param-shaped"}
  assert kinds == ({"8bit codes", "8bit scales"} if storage == "8bit" else {storage})
  if storage == "8bit":
    back = low_precision(optax.adam(1e-3), "8bit", min_size=0).update(
      {"w": jnp.ones(shape)}, state, {"w": jnp.zeros(shape)}
    )[1]
    assert isinstance(back.inner_state[0].nu["w"], QuantizedLeaf)


@pytest.mark.parametrize("block_size, shard_multiple", [(256, 8), (256, 1), (4, 4), (64, 8)])
def test_every_block_tiles_the_last_dimension_in_at_most_2_bytes_per_value(
  block_size, shard_multiple
):
  """Every last dimension up to 2100: a block of 4 to block_size values, or None (float32).

  Blocks split the last dimension into a multiple of its shard count (the
  scales shard with the codes) or into one block (the scales are not split
  along it).
  """
  for last_dim in range(1, 2100):
    block = leaf_block(last_dim, block_size, shard_multiple)
    if block is None:
      continue
    count = last_dim // block
    assert 4 <= block <= block_size and count * block == last_dim, (last_dim, block)
    assert count == 1 or count % math.gcd(last_dim, shard_multiple) == 0, (last_dim, block)


@pytest.mark.slow
def test_a_kept_leaf_and_a_one_block_leaf_get_their_params_axes():
  params = {"odd": jnp.ones((16, 257)), "short": jnp.ones((16, 8))}
  axes = {"odd": P("embed", "mlp"), "short": P("embed", "mlp")}
  opt_def = OptaxWrapper(low_precision(optax.adam(1e-3), "8bit", min_size=0), fallback="raise")
  specs = opt_def.derive_logical_axes(opt_def.create(params), axes).state.param_states
  mu = specs.inner_state[0].mu
  assert mu == {
    "odd": P("embed", "mlp"),
    "short": QuantizedLeaf(P("embed", "mlp"), P("embed", None)),
  }


@pytest.mark.slow
def test_quantizing_rows_gives_the_rows_of_the_whole_leaf():
  """Row chunks of a leaf encode exactly as the whole leaf does, non-finite values included."""
  rng = np.random.default_rng(2)
  x = rng.normal(size=(12, 48)).astype(np.float32) * 10.0 ** rng.integers(-6, 3, size=(12, 1))
  x[[2, 7, 9], [5, 40, 11]] = [np.inf, np.nan, -np.inf]
  whole = _quantize(jnp.asarray(x), 16)
  for start, stop in ((0, 5), (5, 8), (8, 12), (3, 5)):  # rows 3 and 4 are finite
    part = _quantize(jnp.asarray(x[start:stop]), 16)
    np.testing.assert_array_equal(np.asarray(part.codes), np.asarray(whole.codes)[start:stop])
    np.testing.assert_array_equal(np.asarray(part.scales), np.asarray(whole.scales)[start:stop])


@pytest.mark.parametrize("v", [8.4e37, 8.46e37, 8.5e37])
def test_a_huge_negative_extreme_still_decodes(v):
  """A block's scale from 2**126 on has a subnormal reciprocal, which XLA flushes to 0: the
  scale that makes a negative extreme exact reached it below 2**126 and the block decoded
  as zeros; there the scale stays the block's largest magnitude."""
  x = jnp.asarray([[-v, 0.5 * v]], jnp.float32)
  eight = np.asarray(_dequantize(_quantize(x, 2)))
  four = np.asarray(jax.jit(dequantize4)(quantize4(x, 2, rank1=False)))
  np.testing.assert_allclose(eight, x, rtol=0.01)
  np.testing.assert_allclose(four, x, rtol=0.13)  # the 4-bit map's widest gap
