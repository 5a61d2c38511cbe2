"""The two storage codecs of `low_precision`: bfloat16 with stochastic rounding, block-wise 8 bits.

* bfloat16: `rounding_bits` gives each element 16 random bits hashed from its
  index, the seed, the step count and the leaf's index, so a run is
  reproducible, sharded by `jax.jit` or not; `to_bfloat16` rounds up with probability equal
  to the dropped mantissa bits' value (unbiased), or to nearest without bits.
* 8 bits: `quantize` scales each block of the last dimension by its absolute
  maximum and stores each value as the index (``uint8``) of the nearest of
  256 values of bitsandbytes' dynamic map (`dynamic_map`), signed for a block
  with a negative value; `dequantize` inverts it. The signed map holds +1 but
  not -1 (its least value is -0.99297): a block whose largest magnitude is a
  negative element's is scaled so that that value decodes as it
  (`extreme_scale`), so decoding and encoding again changes nothing and the
  codec has no bias by sign. "Nearest" is decided by 255
  thresholds (`_decade_constants`) within 2 float32 ulps of the midpoints between
  map values, defined so that encoding computes them instead of looking
  them up; in the unsigned map only 0 encodes as 0 (a positive second
  moment never decodes as 0). A non-finite value saturates (+/-inf to about
  +/- its block's largest finite magnitude, NaN to 0) and leaves the rest of
  its block as it would be. `leaf_block` chooses a leaf's block so that the
  scales shard wherever the codes do, and none (float32) where every block
  would cost more than 2 bytes per value.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
  "MIN_BLOCK",
  "QuantizedLeaf",
  "dequantize",
  "dynamic_map",
  "hashed_bits",
  "leaf_block",
  "leaf_key",
  "leaf_rounding_bits",
  "quantize",
  "quantize_stats",
  "rounding_bits",
  "step_key",
  "stored_block",
  "stored_shapes",
  "to_bfloat16",
]


class QuantizedLeaf(NamedTuple):
  """One 8-bit state leaf.

  Attributes:
    codes: ``uint8``, the leaf's shape: the index of each value in its
      block's map (`dynamic_map`).
    scales: float32, ``(*shape[:-1], shape[-1] // block)``: each block's
      absolute maximum (divided by the signed map's least value's magnitude,
      0.99297, and rounded up, where a negative element holds it:
      `extreme_scale`), negated when the block uses the signed map.
  """

  codes: Any
  scales: Any


def _decade_sizes(signed: bool) -> tuple[int, ...]:
  """How many values each of the map's seven decades holds above 0."""
  return tuple(2**i if signed else 2 ** (i + 1) for i in range(7))


@functools.cache
def _decade_factors(signed: bool) -> tuple[np.ndarray, np.ndarray]:
  """``(a, b)``: decade ``i``'s value ``k`` is ``(a[i] + (k + 1/2)) * b[i]`` in float32.

  That is ``10**(i-6) * (0.1 + (k + 1/2) * 0.9 / n)`` for a decade of ``n``
  values, written as ``(n / 9 + (k + 1/2)) * (0.9 * 10**(i-6) / n)``: an
  addition, then a multiplication, which no compiler contracts into a
  fused multiply-add, so the codecs compute exactly the values of the
  tables here, on any backend. The powers of ten are decimal literals, each
  rounded once to float32: numpy's vectorized float32 power gives some of
  them one ulp away, depending on the CPU it runs on.
  """
  sizes = np.asarray(_decade_sizes(signed), np.float32)
  scales = np.asarray([1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0], np.float32)
  return sizes / np.float32(9), (np.float32(0.9) * scales) / sizes


@functools.cache
def dynamic_map(signed: bool) -> np.ndarray:
  """The 256 sorted float32 values of bitsandbytes' dynamic quantization map.

  Seven decades, ``1e-6`` to ``1``; decade ``i`` (from the smallest) holds
  the midpoints of ``2**i`` (signed) or ``2**(i + 1)`` (unsigned) equal steps
  of ``[0.1, 1]`` times ``10**(i - 6)``, the signed map with both signs; then
  0 and 1. This is ``bitsandbytes.functional.create_dynamic_map(signed)``
  to within 2 float32 ulps: each value is computed as `_decade_factors`
  says, so that decoding computes it instead of looking it up.

  Example:
    >>> m = dynamic_map(True)
    >>> len(m), round(float(m[0]), 6), float(m[-1]), int((m == 0).sum())
    (256, -0.992969, 1.0, 1)
  """
  a, b = _decade_factors(signed)
  values = [np.float32(0), np.float32(1)]
  for i, n in enumerate(_decade_sizes(signed)):
    decade = (a[i] + (np.arange(n, dtype=np.float32) + np.float32(0.5))) * b[i]
    values += [*decade, *(-decade if signed else [])]
  out = np.sort(np.asarray(values, np.float32))
  out.setflags(write=False)
  return out


def blocks_of(x: jax.Array, block: int) -> jax.Array:
  """``x`` with its last dimension split into blocks of ``block`` values."""
  return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def spread_blocks(per_block: jax.Array, block: int) -> jax.Array:
  """A value per block repeated over its block's elements, in the leaf's shape.

  The codecs reshape the per-block values, not the leaf: an elementwise
  computation on the leaf (a new state from the old codes) can then write
  its result over its operand.
  """
  shape = per_block.shape
  repeated = jax.lax.broadcast_in_dim(per_block, (*shape, block), tuple(range(len(shape))))
  return repeated.reshape(*shape[:-1], shape[-1] * block)


@functools.cache
def _decade_constants(signed: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """``(a, b, boundaries)``: decade ``i``'s inner thresholds are ``(a[i] + k + 1) * b[i]``.

  Between the ``n`` values of a decade (`_decade_factors`) lie ``n - 1``
  thresholds, the same formula at ``k + 1``: their midpoints up to rounding.
  The 8 boundaries (between 0 and the first value, between decades, between
  the last value and 1) are the float32 means of their two map values,
  except the unsigned map's first, which is 0: there only 0 encodes as 0,
  and a positive value below the smallest positive map value encodes as it
  (the zero-point problem of Li et al., 2023: a small second moment stored
  as 0 turns adam's update into ``mu / eps``). Overestimating a tiny value
  of an all-positive block by at most that smallest value (``3.25e-7`` of
  the block's largest) is harmless for a first moment too: the signed map
  rounds its values near 0 with an error as large (``2.75e-7``); in the
  signed map, whose blocks are first moments, a small value still rounds to
  0, since an overestimated ``mu`` would scale adam's update up.
  """
  a, b = _decade_factors(signed)
  positive = dynamic_map(signed)[127 if signed else 0 :]
  firsts = np.cumsum([1, *_decade_sizes(signed)])
  low, high = positive[firsts[:-1]], positive[firsts[1:] - 1]
  lower = np.concatenate([[positive[0]], high])
  upper = np.concatenate([low, [positive[-1]]])
  boundaries = ((lower + upper) / np.float32(2)).astype(np.float32)
  if not signed:
    boundaries[0] = 0
  return a, b, boundaries


class _Ops:
  """`jax.lax` on arrays of one shape, constants broadcast: the codecs trace
  several times faster than with `jax.numpy`, whose wrappers each trace a
  nested jitted function."""

  def __init__(self, like: jax.Array):
    self.like = like

  def full(self, value: Any, dtype: Any) -> jax.Array:
    """``value`` broadcast like the codec's operand (its shape and sharding)."""
    return jax.lax.full_like(self.like, value, dtype)

  def int32(self, x: jax.Array) -> jax.Array:
    return jax.lax.convert_element_type(x, jnp.int32)

  def float32(self, x: jax.Array) -> jax.Array:
    return jax.lax.convert_element_type(x, jnp.float32)

  def where(self, flag: jax.Array, x: Any, y: Any, dtype: Any = None) -> jax.Array:
    """``x`` where ``flag`` else ``y``; a constant (a Python or numpy scalar) is broadcast."""
    x = x if isinstance(x, jax.Array) else self.full(x, dtype)
    y = y if isinstance(y, jax.Array) else self.full(y, dtype)
    return jax.lax.select(flag, x, y)

  def chain(self, above: list[jax.Array], values: Any, dtype: Any) -> jax.Array:
    """``values[d]``, ``d`` the number of true ``above`` (true ones first), by selects (no gather)."""
    out = self.full(values[0], dtype)
    for flag, value in zip(above, values[1:], strict=True):
      out = self.where(flag, value, out, dtype)
    return out


def _first_factor(size: jax.Array, ops: _Ops) -> jax.Array:
  """`_decade_factors`' ``a`` of a decade of ``size`` values, ``size / 9``: a power of two
  times the float32 ``1 / 9``, exactly the table's value, in one multiplication."""
  return ops.float32(size) * ops.full(np.float32(1) / np.float32(9), jnp.float32)


def _codes(scaled: jax.Array, signed: jax.Array) -> jax.Array:
  """The index of the nearest map value: the number of thresholds below ``scaled``.

  Arithmetic and comparisons only, no table lookup: XLA:CPU runs a lookup
  one element at a time inside a fused loop (10x slower here), and a lookup
  does not trace under explicit sharding. Both maps share one computation,
  their constants chosen per element (a map's decade ``i`` holds
  ``2**(i + u)`` values, ``u`` 1 for the unsigned map, and its factors
  follow from that count, exactly), which keeps each leaf's compiled
  encoder small (a computation per map, selected after, made the whole
  train step compile several times slower).
  The decade comes from comparisons with its 6 inner boundaries, the
  position inside it from one division, corrected exactly by comparing with
  the two thresholds next to it. A negative value of the signed map mirrors:
  its code is 127 less the thresholds at or below its magnitude (below the
  next float up).
  """
  lax, ops = jax.lax, _Ops(scaled)
  b_signed = _decade_factors(True)[1]
  bounds = {s: _decade_constants(s)[2] for s in (True, False)}
  signed = jnp.broadcast_to(signed, scaled.shape)
  mirror = signed & lax.lt(scaled, ops.full(0, jnp.float32))
  unsigned = ops.int32(~signed)
  # A threshold at or below a positive float lies below the next float up.
  nudged = lax.bitcast_convert_type(lax.abs(scaled), jnp.int32) + ops.int32(mirror)
  magnitude = lax.bitcast_convert_type(nudged, jnp.float32)

  def below(threshold: jax.Array) -> jax.Array:
    return lax.lt(threshold, magnitude)

  def boundary(i: int) -> jax.Array:
    return ops.where(signed, bounds[True][i], bounds[False][i], jnp.float32)

  above = [below(boundary(i)) for i in range(1, 7)]
  size = lax.shift_left(ops.chain(above, [2**i for i in range(7)], jnp.int32), unsigned)
  a_d = _first_factor(size, ops)
  b_d = ops.chain(above, b_signed, jnp.float32) * ops.where(signed, 1.0, 0.5, jnp.float32)
  last = size - ops.full(1, jnp.int32)
  guess = lax.clamp(ops.full(0, jnp.float32), lax.floor(magnitude / b_d - a_d), ops.float32(last))
  guess = ops.int32(guess)
  one = ops.full(1, jnp.int32)

  def inner_below(k: jax.Array) -> jax.Array:
    return ops.int32(below((a_d + ops.float32(k + one)) * b_d))

  low = ops.where(lax.gt(guess, ops.full(0, jnp.int32)), inner_below(guess - one), 1, jnp.int32)
  high = ops.where(lax.lt(guess, last), inner_below(guess), 0, jnp.int32)
  # Decade d's values start after 2**d (signed) or 2**(d + 1) - 1 (unsigned) codes.
  count = ops.where(below(boundary(0)), last - unsigned + guess + low + high, 0, jnp.int32)
  top = below(boundary(7)) & ~mirror
  count = ops.where(top, ops.full(128, jnp.int32) + unsigned * ops.full(127, jnp.int32), count)
  middle = ops.full(127, jnp.int32)
  return ops.where(mirror, middle - count, ops.where(signed, middle + count, count))


MAGNITUDE_BITS = 0x7FFFFFFF
INF_BITS = 0x7F800000


def extreme_scale(largest: jax.Array, key: jax.Array, most_negative: float) -> jax.Array:
  """The magnitude of each block's scale, from its largest magnitude and its reduced ``key``.

  ``key`` is the block's maximum of `extreme_keys`: its low bit says that a negative element
  holds the largest magnitude (a tie of ``+a`` and ``-a`` included). The signed maps hold
  +1 but not -1, so such a block's scale is the smallest float32 ``s`` whose product with
  the map's ``most_negative`` magnitude is at least ``largest``: the map's most negative
  value decodes as ``-largest`` (where no product equals it, an ulp beyond), and the
  positive elements, none larger, still fit. Every block then decodes its extreme as
  itself, and decoding and encoding again gives the same scales and codes. Elsewhere (the
  extreme positive, 0, inf or NaN, and a scale that would reach ``2**126``, whose reciprocal
  XLA flushes to 0) the scale is ``largest``.
  """
  lax, ops = jax.lax, _Ops(largest)
  m, one = ops.full(most_negative, jnp.float32), ops.full(1, jnp.uint32)
  # The smallest scale that fits is the quotient or a float next to it, whether XLA divides
  # or multiplies by the reciprocal (as it does by a constant): so for every float32 mantissa.
  # The walk down starts 2 floats above: from 1 above, XLA folds its first step back into the
  # quotient, and ``m`` times ``largest / m`` into ``largest``, unrounded.
  raw = lax.add(lax.bitcast_convert_type(lax.div(largest, m), jnp.uint32), ops.full(2, jnp.uint32))
  for _ in range(3):
    lower = lax.sub(raw, one)
    fits = lax.ge(lax.mul(m, lax.bitcast_convert_type(lower, jnp.float32)), largest)
    raw = lax.select(fits, lower, raw)
  scale = lax.bitcast_convert_type(raw, jnp.float32)
  # A largest magnitude of 0 keeps its scale; an infinite or NaN one ends not below inf. A
  # scale from 2**126 on has a subnormal reciprocal, which XLA flushes to 0 (the block would
  # decode as zeros): the block keeps its largest magnitude (its extreme decodes as the map's).
  flagged = lax.eq(lax.bitwise_and(key, one), one) & lax.lt(scale, ops.full(2.0**126, jnp.float32))
  return lax.select(flagged, scale, largest)


def extreme_keys(magnitude: jax.Array, negative: jax.Array) -> jax.Array:
  """``magnitude << 1 | negative``: its maximum over a block is the block's largest
  magnitude (``>> 1``, magnitudes' bits being below ``2**31``) and whether a negative element
  holds it (the low bit), a standard reduction that a mesh splitting a block all-reduces."""
  return (magnitude << 1) | negative.astype(jnp.uint32)


def stored_scales(
  key: jax.Array, signed: jax.Array, most_negative: float
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """From each block's reduced `extreme_keys` and whether it holds a negative value (1 or 0):
  its largest magnitude, the magnitude of its scale (`extreme_scale`, for the map whose most
  negative value's magnitude is ``most_negative``) and the stored scale, that magnitude with
  the sign bit set where the block is signed."""
  largest = jax.lax.bitcast_convert_type(key >> 1, jnp.float32)
  scale = extreme_scale(largest, key, most_negative)
  scale_bits = jax.lax.bitcast_convert_type(scale, jnp.uint32)
  return largest, scale, jax.lax.bitcast_convert_type(scale_bits | (signed << 31), jnp.float32)


def _block_scales(blocks: jax.Array, *, finite: bool) -> tuple[jax.Array, jax.Array]:
  """Each block's stored scale and the reciprocal of its magnitude.

  One reduction over the float32 bits with a standard combination per
  operand (`extreme_keys`: the largest magnitude and whether a negative element holds it;
  whether any element is negative (-0.0 and NaN are not); the smallest reciprocal of a
  magnitude), so that a mesh splitting a block over devices all-reduces it (a custom
  combination cannot be all-reduced). The stored scale is `extreme_scale` of the largest
  magnitude, with the sign bit set where a value is negative. ``finite``: non-finite
  elements count as magnitude 0 (-inf still makes its block signed, and its key is 1,
  below any other's but 0's: it decides no extreme), with selects that fuse into the
  reduction: no branch, no second pass over the leaf.
  """
  bits = jax.lax.bitcast_convert_type(blocks, jnp.uint32)
  magnitude = bits & jnp.uint32(MAGNITUDE_BITS)
  if finite:
    magnitude = jnp.where(magnitude < jnp.uint32(INF_BITS), magnitude, jnp.uint32(0))
  negative = blocks < 0
  reciprocal = 1.0 / jax.lax.bitcast_convert_type(magnitude, jnp.float32)
  key, signed, reciprocal = jax.lax.reduce(
    (extreme_keys(magnitude, negative), negative.astype(jnp.uint32), reciprocal),
    (jnp.uint32(0), jnp.uint32(0), jnp.float32(jnp.inf)),
    lambda a, b: (jax.lax.max(a[0], b[0]), jax.lax.max(a[1], b[1]), jax.lax.min(a[2], b[2])),
    (blocks.ndim - 1,),
  )
  largest, scale, stored = stored_scales(key, signed, -float(dynamic_map(True)[0]))
  return stored, jax.lax.select(scale > largest, 1.0 / scale, reciprocal)


def quantize_stats(
  x: jax.Array, block: int, *, guard_nonfinite: bool = True
) -> tuple[jax.Array, jax.Array]:
  """`quantize`'s ``stats``: each block's stored scale and the reciprocal of its magnitude."""
  return _block_scales(blocks_of(x, block), finite=guard_nonfinite)


def quantize(
  x: jax.Array,
  block: int,
  *,
  guard_nonfinite: bool = True,
  stats: tuple[jax.Array, jax.Array] | None = None,
  flat: bool = False,
) -> QuantizedLeaf:
  """Block-wise dynamic 8-bit quantization of a float32 array, blocks of ``block`` along the last axis.

  Each block is scaled by its largest finite magnitude and uses the signed
  map if it holds a negative value, else the unsigned one (`dynamic_map`);
  where a negative element holds that magnitude, the scale is such that the
  signed map's least value (-0.99297) decodes as it (`extreme_scale`).
  Each value is stored as the code of the nearest map value, except that in
  the unsigned map a positive value never rounds to 0: below the map's
  smallest positive value (``3.25e-7`` of the block's largest) it stores
  that value, so a small positive second moment never decodes as 0 (a
  subnormal float32 value counts as 0: XLA flushes it to 0 anyway). A
  non-finite value damages only its own element: ``+/-inf`` stores the map's
  extreme of its sign (about +/- the block's largest finite magnitude; 0 in
  a block without one) and NaN stores 0; the other values are stored exactly
  as with 0 in its place (-inf makes its block signed). Each block depends
  on its own values only: quantizing some rows of ``x`` gives those rows of
  quantizing all of it.

  ``guard_nonfinite=False`` lets non-finite values into the block scales:
  an inf or NaN then damages its whole block, for callers that refuse such
  a step anyway. The guard costs no memory and no branch: its selects fuse
  into the one reduction that computes the scales (`_block_scales`).
  ``stats``: `quantize_stats` of ``x``, computed before (e.g. in a branch
  that orders the work); None: computed here. ``flat``: the per-block
  values are spread over the leaf's shape instead of the leaf being
  reshaped into blocks (the same values): an encoder of a new state
  computed from old codes decoded ``flat`` (`dequantize`) can then write
  its codes over the old ones; XLA fuses the blocks' form better where a
  whole tree of leaves is compressed at once.

  Example:
    >>> x = jnp.asarray([[2.0, 1e-9, jnp.inf, jnp.nan]])
    >>> [round(float(v), 8) for v in dequantize(quantize(x, 4))[0]]
    [2.0, 6.5e-07, 2.0, 0.0]
  """
  return _quantize(x, block, guard_nonfinite, stats, flat)


@functools.partial(jax.jit, static_argnums=(1, 2, 4))
def _quantize(
  x: jax.Array,
  block: int,
  guard_nonfinite: bool,
  stats: tuple[jax.Array, jax.Array] | None,
  flat: bool,
) -> QuantizedLeaf:
  """`quantize`, one program per shape: called eagerly (``init``, a conversion of a
  checkpoint), its tens of operations would each compile on their own."""
  if stats is None:
    stats = _block_scales(blocks_of(x, block), finite=guard_nonfinite)
  scales, reciprocal = stats
  reciprocal = jnp.where(reciprocal < jnp.inf, reciprocal, 1.0)
  signed = jax.lax.bitcast_convert_type(scales, jnp.int32) < 0
  values = x if flat else blocks_of(x, block)
  signed, reciprocal = (
    spread_blocks(a, block) if flat else a[..., None] for a in (signed, reciprocal)
  )
  # +/-inf saturates to +/-1 times the scale; NaN is stored as 0.
  scaled = jnp.clip(values * reciprocal, -1.0, 1.0)
  # XLA flushes subnormal floats to 0: a positive value keeps a normal ratio to its maximum.
  tiny = np.finfo(np.float32).tiny
  scaled = jnp.where(
    values > 0, jnp.maximum(scaled, tiny), jnp.where(jnp.isnan(values), 0.0, scaled)
  )
  codes = _codes(scaled, signed).astype(jnp.uint8).reshape(x.shape)
  return QuantizedLeaf(codes=codes, scales=scales)


def _decode(codes: jax.Array, signed: jax.Array) -> jax.Array:
  """The map value of each code (`dynamic_map`), computed: no table lookup.

  One computation for both maps, as in `_codes`: position ``p`` of a map's
  half lies in decade ``floor(log2(p + u)) - u`` (``u`` 1 for the unsigned
  map), found by counting leading zeros.
  """
  lax, ops = jax.lax, _Ops(codes)
  b_signed = _decade_factors(True)[1]
  signed = jnp.broadcast_to(signed, codes.shape)
  unsigned = ops.int32(~signed)
  middle = ops.full(127, jnp.int32)
  position = ops.where(signed, lax.abs(codes - middle), codes)
  shifted = position + unsigned
  exponent = ops.full(31, jnp.int32) - lax.clz(lax.max(shifted, ops.full(1, jnp.int32)))
  decade = exponent - unsigned
  above = [lax.ge(decade, ops.full(i, jnp.int32)) for i in range(1, 7)]
  size = lax.shift_left(ops.full(1, jnp.int32), exponent)
  k = ops.float32(shifted - size)
  a_d = _first_factor(size, ops)
  b_d = ops.chain(above, b_signed, jnp.float32) * ops.where(signed, 1.0, 0.5, jnp.float32)
  value = (a_d + (k + ops.full(0.5, jnp.float32))) * b_d
  top = lax.gt(position, middle + unsigned * middle)
  value = ops.where(
    lax.eq(position, ops.full(0, jnp.int32)), 0, ops.where(top, 1, value, jnp.float32), jnp.float32
  )
  return ops.where(signed & lax.lt(codes, middle), -value, value)


def stored_block(leaf: QuantizedLeaf) -> int:
  """The block of a stored 8-bit leaf, from its arrays' shapes."""
  return jnp.shape(leaf.codes)[-1] // jnp.shape(leaf.scales)[-1]


def stored_shapes(shape: tuple[int, ...], block: int) -> tuple[tuple[int, ...], ...] | None:
  """The shapes of the arrays (codes, scales) of an 8-bit leaf of values of ``shape`` in
  blocks of ``block``; None where the blocks do not tile its last dimension.

  Example:
    >>> stored_shapes((2, 256), 32), stored_shapes((2, 256), 48)
    (((2, 256), (2, 8)), None)
  """
  if not shape or block < 1 or shape[-1] % block:
    return None
  return tuple(shape), (*shape[:-1], shape[-1] // block)


def dequantize(leaf: QuantizedLeaf, *, flat: bool = False) -> jax.Array:
  """The float32 values of an 8-bit leaf; ``flat`` as in `quantize` (the same values)."""
  return _dequantize(leaf, flat)


@functools.partial(jax.jit, static_argnums=1)
def _dequantize(leaf: QuantizedLeaf, flat: bool) -> jax.Array:
  """`dequantize`, one program per shape (as `_quantize`)."""
  block = stored_block(leaf)
  codes = jnp.asarray(leaf.codes).astype(jnp.int32)
  if flat:
    values = _decode(codes, spread_blocks(leaf.scales < 0, block))
    return values * spread_blocks(jnp.abs(leaf.scales), block)
  values = _decode(blocks_of(codes, block), (leaf.scales < 0)[..., None])
  return (values * jnp.abs(leaf.scales)[..., None]).reshape(leaf.codes.shape)


def _hash32(x: jax.Array) -> jax.Array:
  """Chris Wellons' ``lowbias32`` integer hash of uint32 values."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x7FEB352D)
  x = x ^ (x >> 15)
  x = x * jnp.uint32(0x846CA68B)
  return x ^ (x >> 16)


def step_key(seed: int, count: jax.Array) -> jax.Array:
  """The uint32 key that every leaf of a step shares (`leaf_key`): the seed and the count hashed."""
  return _hash32(_hash32(jnp.uint32(seed)) ^ jnp.asarray(count).astype(jnp.uint32))


def leaf_key(step: jax.Array, leaf: int | jax.Array) -> jax.Array:
  """The uint32 key of leaf ``leaf``'s `rounding_bits`: its step's `step_key` hashed with its index."""
  return _hash32(step ^ jnp.asarray(leaf, jnp.uint32))


def hashed_bits(shape: tuple[int, ...], key: jax.Array) -> jax.Array:
  """`rounding_bits` from its key (`leaf_key`): each element's row-major index hashed with it
  (modulo 2**32: elements 2**32 apart in one leaf get the same bits)."""
  index = jnp.zeros(shape, jnp.uint32)
  stride = 1
  for dim in reversed(range(len(shape))):
    index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, dim) * jnp.uint32(stride % 2**32)
    stride *= shape[dim]
  return _hash32(index * jnp.uint32(0x9E3779B9) + key) >> 16


@functools.partial(jax.jit, static_argnums=(0, 1))
def rounding_bits(
  shape: tuple[int, ...], seed: int, count: jax.Array, leaf: int | jax.Array
) -> jax.Array:
  """16 random bits (uint32 below ``2**16``) per element, from the seed, step and leaf.

  Each element's bits hash its row-major index with a key hashed from
  ``seed``, ``count`` and ``leaf`` (`step_key`, `leaf_key`, then `hashed_bits`):
  cheaper than a counter-based PRNG, the same sharded by `jax.jit` or not,
  and reproducible. `leaf_rounding_bits` gives the same bits from the step's
  key (`step_key`), which a step computes once for all its leaves.

  Example:
    >>> bits = rounding_bits((2, 3), 0, jnp.int32(1), 0)
    >>> bits.dtype, bool((bits < 2**16).all())
    (dtype('uint32'), True)
  """
  return leaf_rounding_bits(shape, step_key(seed, count), leaf)


@functools.partial(jax.jit, static_argnums=0)
def leaf_rounding_bits(shape: tuple[int, ...], step: jax.Array, leaf: int | jax.Array) -> jax.Array:
  """`rounding_bits` of leaf ``leaf`` from its step's `step_key`.

  One program per shape: called outside `jax.jit` (an eager ``create``),
  it compiles once rather than op by op.

  Example:
    >>> step = step_key(0, jnp.int32(1))
    >>> bool((leaf_rounding_bits((2, 3), step, 0) == rounding_bits((2, 3), 0, jnp.int32(1), 0)).all())
    True
  """
  return hashed_bits(shape, leaf_key(step, leaf))


@jax.jit
def to_bfloat16(x: jax.Array, bits: jax.Array | None) -> jax.Array:
  """``x`` in bfloat16: to nearest (``bits`` None) or stochastically, adding 16 random ``bits``.

  Either way differentiable as the cast to nearest is: a tangent passes through, in bfloat16
  (straight through the stochastic rounding, whose bit arithmetic has no derivative).
  Compiled (as `quantize`): called eagerly, its operations would each compile on their own.

  Example:
    >>> x, bits = jnp.float32(1.0 + 2.0**-10), jnp.uint32(0xF000)  # 1/8 of a step, 15/16 up
    >>> value, tangent = jax.jvp(lambda x: to_bfloat16(x, bits), (x,), (jnp.float32(0.5),))
    >>> float(value), float(tangent)
    (1.0078125, 0.5)
  """
  if bits is None:
    return x.astype(jnp.bfloat16)
  return _stochastic_bfloat16(x, bits)


@jax.custom_jvp
def _stochastic_bfloat16(x: jax.Array, bits: jax.Array) -> jax.Array:
  """`to_bfloat16` with ``bits``: the dropped mantissa bits plus ``bits`` carry into the kept
  ones with probability equal to the dropped bits' value."""
  raw = jax.lax.bitcast_convert_type(x, jnp.uint32)
  rounded = jax.lax.bitcast_convert_type((raw + bits) & jnp.uint32(0xFFFF0000), jnp.float32)
  return jnp.where(jnp.isfinite(x), rounded, x).astype(jnp.bfloat16)


@_stochastic_bfloat16.defjvp
def _stochastic_bfloat16_jvp(primals: tuple, tangents: tuple) -> tuple[jax.Array, jax.Array]:
  """The rounded values, and ``x``'s tangent cast to bfloat16 (the bits have none)."""
  x, bits = primals
  return _stochastic_bfloat16(x, bits), tangents[0].astype(jnp.bfloat16)


MIN_BLOCK = 4
"""The smallest block `leaf_block` chooses: at most 2 bytes per value (1 + 4 / 4)."""


def leaf_block(last_dim: int, block_size: int = 256, shard_multiple: int = 8) -> int | None:
  """The block of an 8-bit leaf whose last dimension is ``last_dim``, or None: keep it float32.

  The largest divisor of ``last_dim // gcd(last_dim, shard_multiple)`` not
  above ``block_size``: blocks tile the last dimension, and the block count
  is a multiple of ``gcd(last_dim, shard_multiple)``, so the scales shard
  along the last dimension wherever the codes do over up to
  ``shard_multiple`` devices (a power of two). Such a block below
  `MIN_BLOCK` values would cost more than 2 bytes per value (5 for a block
  of 1, more than float32's 4): then the whole last dimension is one block
  if it has `MIN_BLOCK` to ``block_size`` values (its scales are not split
  along it: as many bytes per device as with the aligned block or fewer,
  fewer in all), else there is none and the leaf stays float32 (a last
  dimension below 4, or above ``block_size`` without such a block: 257,
  4099, 8 * 257). So an 8-bit leaf takes at most 2 bytes per value, and
  with ``block_size`` below 4 every leaf stays float32.

  Example:
    >>> leaf_block(4096), leaf_block(3072), leaf_block(768), leaf_block(768, shard_multiple=1)
    (256, 192, 96, 256)
    >>> leaf_block(16), leaf_block(257), leaf_block(1)
    (16, None, None)
  """
  rest = last_dim // math.gcd(last_dim, shard_multiple)
  aligned = next(b for b in range(min(block_size, rest), 0, -1) if rest % b == 0)
  if aligned >= MIN_BLOCK:
    return aligned
  return last_dim if MIN_BLOCK <= last_dim <= block_size else None
