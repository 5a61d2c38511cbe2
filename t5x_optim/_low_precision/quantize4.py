"""The 4-bit codec of `low_precision`: two values per byte, block-wise and rank-1 scales.

After Li et al. (2023), "Memory Efficient Optimizers with 4-bit States":

* Blocks of up to 128 elements: consecutive along the last dimension
  (`leaf_block4`: even, tiling it so that the blocks shard with the param),
  and where that run is short (a last dimension whose shards force small
  blocks, such as a vocabulary of 32128 over 8 devices: 16), over several
  rows of the dimension before it (`leaf_block4_shape`: ``(rows, cols)``,
  tiling that dimension's shards too); each block's scale is its largest
  finite magnitude, stored negated when the block holds a negative value.
* A block with a negative value (a first moment) uses the signed
  dynamic-exponent map (`signed_map4`: bitsandbytes' dynamic map with 3
  decades in 4 bits, 0 and 1 included, -1 not): scaled by the block's
  scale. Where a negative element holds the block's largest magnitude, the
  scale is that magnitude over 0.8875 (the map's least value's magnitude),
  rounded up (`extreme_scale`), so that the element decodes as itself:
  decoding and encoding again changes no code or block scale, and the codec
  has no bias by sign.
* A block without (a second moment) uses the unsigned linear map: ``k / 15``
  for codes ``k = 1..15``, and code 0 for an exact 0 only, so no positive
  value decodes as 0 (the zero-point problem: a small second moment stored
  as 0 turns adam's update into ``mu / eps``). In a matrix (a leaf of 2 or
  more dimensions, its leading ones flattened into rows) with at least a
  block's worth of rows, so that its column maxima take no more bytes than
  its block scales (`Rank1Quantized4Leaf`), the scale of element ``(i, j)``
  is ``min(block_max, col_max[j])``: rank-1 normalization's ``min(row_max[i],
  col_max[j])`` with the row's maximum narrowed to its block's (a block's
  maximum is at most its elements' columns' and rows', so a row maximum
  adds nothing); elsewhere (`Quantized4Leaf`) the block's.
* Codes are packed two per byte along the last dimension (element ``2t`` in
  the low nibble of byte ``t``, ``2t + 1`` in the high one), inside a
  block: the codes have the param's shape with the last dimension halved
  and shard like the param.

Encoding and decoding are arithmetic and selects (no table lookup, and no
layout change that XLA would copy: a byte is spread over its two elements by
a broadcast, each element shifting out its nibble, as the 8-bit codec spreads
its block scales). A non-finite value damages only its own element: the
statistics (block scales and signs, column maxima) count it as 0, so every other
element encodes as with 0 in its place; ``+inf`` stores the element's
scale, ``-inf`` the signed map's least value (-0.8875) times it in a signed
block and 0 in an unsigned one, NaN 0.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from t5x_optim._low_precision.quantize import (
  INF_BITS,
  MAGNITUDE_BITS,
  MIN_BLOCK,
  blocks_of,
  extreme_keys,
  spread_blocks,
  stored_scales,
)

__all__ = [
  "Quantized4Leaf",
  "Rank1Quantized4Leaf",
  "dequantize4",
  "dequantize4_lane",
  "leaf_block4",
  "leaf_block4_shape",
  "quantize4",
  "quantize4_lanes",
  "quantize4_stats",
  "signed_map4",
  "stored_block4",
  "stored_shapes4",
  "unpacked_shape",
]

_LEVELS = 15
"""The unsigned map's largest code: values ``k / 15``."""


class Quantized4Leaf(NamedTuple):
  """One 4-bit state leaf with block-wise scales.

  Attributes:
    codes: ``uint8``, ``(*shape[:-1], shape[-1] // 2)``: two 4-bit codes per
      byte, consecutive elements of the last dimension.
    scales: float32, ``(*shape[:-2], shape[-2] // rows, shape[-1] // cols)``
      for blocks of ``(rows, cols)`` (one row: ``(*shape[:-1], shape[-1] //
      cols)``): each block's largest finite magnitude (over 0.8875, rounded
      up, where a negative element holds it: `extreme_scale`), negated when
      the block uses the signed map.
  """

  codes: Any
  scales: Any


class Rank1Quantized4Leaf(NamedTuple):
  """One 4-bit state leaf of a matrix, with rank-1 scales for its unsigned blocks.

  Attributes:
    codes: as `Quantized4Leaf`'s.
    scales: as `Quantized4Leaf`'s.
    cols: float32, ``shape[-1:]``: each column's largest finite magnitude
      (over all leading dimensions).
  """

  codes: Any
  scales: Any
  cols: Any


@functools.cache
def signed_map4() -> np.ndarray:
  """The 16 sorted float32 values of the signed 4-bit dynamic-exponent map.

  ``bitsandbytes.functional.create_dynamic_map(True, 3, 4)``: decade ``i``
  (``i = 0, 1, 2``) holds the midpoints of ``2**i`` equal steps of ``[0.1,
  1]`` times ``10**(i - 2)``, with both signs; then 0 and 1.

  Example:
    >>> m = signed_map4()
    >>> len(m), float(m[0]), float(m[-1]), int((m == 0).sum())
    (16, -0.887499988079071, 1.0, 1)
  """
  values = [0.0, 1.0]
  for i in range(3):
    edges = np.linspace(0.1, 1.0, 2**i + 1)
    means = (edges[:-1] + edges[1:]) / 2 * 10.0 ** (i - 2)
    values += [*means, *(-means)]
  out = np.sort(np.asarray(values, np.float32))
  out.setflags(write=False)
  return out


def leaf_block4(last_dim: int, block_size: int = 128, shard_multiple: int = 8) -> int | None:
  """The block of a 4-bit leaf whose last dimension is ``last_dim``, or None: keep it float32.

  `leaf_block`'s rule with even blocks (a byte's two codes share a block):
  the largest even divisor of ``last_dim // gcd(last_dim, shard_multiple)``
  not above ``block_size``, so the block count is a multiple of the last
  dimension's shard count and each shard of the codes holds whole blocks;
  below `MIN_BLOCK`, the whole last dimension if it has `MIN_BLOCK` to
  ``block_size`` values and its halved length (the codes') still shards
  wherever it does; else None (an odd last dimension: 1, 7, 257; one above
  ``block_size`` without such a block; 24 over 8 shards, whose codes, 12,
  do not split in 8). A 4-bit leaf then takes at most 1.5 bytes per value
  for codes and block scales.

  Example:
    >>> leaf_block4(4096), leaf_block4(3072), leaf_block4(768), leaf_block4(16)
    (128, 128, 96, 16)
    >>> leaf_block4(24), leaf_block4(24, shard_multiple=1)
    (None, 24)
    >>> leaf_block4(7), leaf_block4(257), leaf_block4(1)
    (None, None, None)
  """
  rest = last_dim // math.gcd(last_dim, shard_multiple)
  even = [b for b in range(2, min(block_size, rest) + 1, 2) if rest % b == 0]
  if even and even[-1] >= MIN_BLOCK:
    return even[-1]
  if rest % 2 == 0 and MIN_BLOCK <= last_dim <= block_size:
    return last_dim
  return None


def leaf_block4_shape(
  shape: tuple[int, ...], block_size: int = 128, shard_multiple: int = 8
) -> tuple[int, int] | None:
  """The ``(rows, cols)`` block of a 4-bit leaf of ``shape``, or None: keep it float32.

  ``cols`` is `leaf_block4` of the last dimension. When it is shorter than
  ``block_size``, a block also spans ``rows`` rows of the dimension before
  it: the most with ``rows * cols <= block_size`` that divide that
  dimension's length over ``gcd(length, shard_multiple)``, so each of its
  shards holds whole blocks as well. A vocabulary of 32128 columns over 8
  devices has blocks of 16 columns: over 768 rows they take 8, 128 values
  in all, and their scales cost 1/32 byte per value instead of 1/4.

  Example:
    >>> leaf_block4_shape((768, 32128)), leaf_block4_shape((768, 3072))
    ((8, 16), (1, 128))
    >>> leaf_block4_shape((12, 64)), leaf_block4_shape((3, 16)), leaf_block4_shape((7,))
    ((3, 8), (3, 16), None)
  """
  cols = leaf_block4(shape[-1], block_size, shard_multiple)
  if cols is None:
    return None
  if len(shape) < 2:
    return 1, cols
  rest = shape[-2] // math.gcd(shape[-2], shard_multiple)
  return max(r for r in range(1, block_size // cols + 1) if rest % r == 0), cols


def block_shape(block: int | tuple[int, int]) -> tuple[int, int]:
  """``(rows, cols)`` of a block given as either; an int is a block of one row."""
  return (1, block) if isinstance(block, int) else (int(block[0]), int(block[1]))


def uses_rank1(shape: tuple[int, ...], block: int | tuple[int, int]) -> bool:
  """Whether a leaf of ``shape`` stores column maxima: a matrix with at least a block's
  values in rows, whose column maxima take no more bytes than its block scales."""
  rows, cols = block_shape(block)
  return len(shape) >= 2 and math.prod(shape[:-1]) >= rows * cols


def _blocks(x: jax.Array, block: tuple[int, int]) -> tuple[jax.Array, tuple[int, ...]]:
  """``x`` split into blocks, and the axes that run within a block."""
  rows, cols = block
  if rows == 1:
    return blocks_of(x, cols), (x.ndim,)
  shape = (*x.shape[:-2], x.shape[-2] // rows, rows, x.shape[-1] // cols, cols)
  return x.reshape(shape), (x.ndim - 1, x.ndim + 1)


def _spread(per_block: jax.Array, block: tuple[int, int]) -> jax.Array:
  """A value per block repeated over its block's elements, in the leaf's shape."""
  rows, cols = block
  wide = spread_blocks(per_block, cols)
  if rows == 1:
    return wide
  shape = wide.shape
  repeated = jax.lax.broadcast_in_dim(
    wide, (*shape[:-1], rows, shape[-1]), (*range(len(shape) - 1), len(shape))
  )
  return repeated.reshape(*shape[:-2], shape[-2] * rows, shape[-1])


def stored_block4(leaf: Quantized4Leaf | Rank1Quantized4Leaf) -> tuple[int, int]:
  """The ``(rows, cols)`` block of a stored 4-bit leaf, from its shapes."""
  shape, scales = unpacked_shape(leaf), tuple(jnp.shape(leaf.scales))
  rows = shape[-2] // scales[-2] if len(shape) >= 2 else 1
  return rows, shape[-1] // scales[-1]


def stored_shapes4(
  shape: tuple[int, ...], block: int | tuple[int, int]
) -> tuple[tuple[int, ...], ...] | None:
  """The shapes of the arrays (codes, scales and, where `uses_rank1`, column maxima) of a
  4-bit leaf of values of ``shape`` in blocks of ``block``; None where the blocks do not tile
  it (or are odd: a byte's two codes share a block).

  Example:
    >>> stored_shapes4((256, 256), (2, 64)), stored_shapes4((64, 256), 128)
    (((256, 128), (128, 4), (256,)), ((64, 128), (64, 2)))
    >>> stored_shapes4((3, 256), (2, 64)) is None
    True
  """
  rows, cols = block_shape(block)
  if not shape or rows < 1 or cols < 2 or cols % 2 or shape[-1] % cols:
    return None
  if len(shape) < 2:
    return ((shape[0] // 2,), (shape[0] // cols,)) if rows == 1 else None
  if shape[-2] % rows:
    return None
  codes = (*shape[:-1], shape[-1] // 2)
  scales = (*shape[:-2], shape[-2] // rows, shape[-1] // cols)
  return (codes, scales, *([(shape[-1],)] if uses_rank1(shape, block) else []))


def unpacked_shape(leaf: Quantized4Leaf | Rank1Quantized4Leaf) -> tuple[int, ...]:
  """The shape of the values a 4-bit leaf stores."""
  shape = tuple(jnp.shape(leaf.codes))
  return (*shape[:-1], 2 * shape[-1])


def quantize4_stats(
  x: jax.Array, block: int | tuple[int, int], *, rank1: bool, guard_nonfinite: bool = True
) -> tuple[jax.Array, ...]:
  """The statistics of `quantize4`: ``(scales,)``, or ``(scales, cols)`` with ``rank1``.

  Non-finite values count as magnitude 0 and as not negative
  (``guard_nonfinite``); without the guard they enter the maxima, a NaN as
  the largest. The column maxima are a maximum over the magnitudes' float32
  bits, whose order is their values' and which holds a NaN on every backend
  (XLA:CPU's float32 maximum over the rows of some shapes drops it). The block
  scales are one reduction over the float32 bits with a standard combination
  per operand (`extreme_keys`: the largest magnitude and whether a negative
  element holds it; whether any element is negative), so that a mesh
  splitting a block over devices all-reduces it; a block whose largest
  magnitude is negative is then scaled by `extreme_scale`.
  """
  x = jnp.asarray(x, jnp.float32)
  magnitude = jax.lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(MAGNITUDE_BITS)
  negative = x < 0
  if guard_nonfinite:
    finite = magnitude < jnp.uint32(INF_BITS)
    magnitude = jnp.where(finite, magnitude, jnp.uint32(0))
    negative = negative & finite
  block = block_shape(block)
  by_block, within = _blocks(extreme_keys(magnitude, negative), block)
  key, signed = jax.lax.reduce(
    (by_block, _blocks(negative.astype(jnp.uint32), block)[0]),
    (jnp.uint32(0), jnp.uint32(0)),
    lambda a, b: (jax.lax.max(a[0], b[0]), jax.lax.max(a[1], b[1])),
    within,
  )
  scales = stored_scales(key, signed, -float(signed_map4()[0]))[2]
  if not rank1:
    return (scales,)
  cols = magnitude.max(axis=tuple(range(x.ndim - 1)))
  return scales, jax.lax.bitcast_convert_type(cols, jnp.float32)


def _signed_codes(scaled: jax.Array) -> jax.Array:
  """The index of the nearest `signed_map4` value: the number of midpoints below ``scaled``."""
  values = signed_map4()
  mids = (values[:-1] + values[1:]) / np.float32(2)
  code = jnp.zeros(scaled.shape, jnp.int32)
  for mid in mids:
    code = code + (scaled > mid).astype(jnp.int32)
  return code


def _signed_values(code: jax.Array) -> jax.Array:
  """`signed_map4` at each code, by selects."""
  values = signed_map4()
  out = jnp.full(code.shape, values[0], jnp.float32)
  for k in range(1, len(values)):
    out = jnp.where(code >= k, values[k], out)
  return out


def _element_scales(
  stats: tuple[jax.Array, ...], block: tuple[int, int], lane: int | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Each element's (signed flag, signed-map scale, unsigned-map scale).

  ``lane``: 0 or 1, for the elements of the even or odd columns only.
  """
  rows, cols = block
  if lane is not None:
    block = (rows, cols // 2)
  scales = stats[0]
  signed = _spread(scales < 0, block)
  absmax = _spread(jnp.abs(scales), block)
  if len(stats) == 1:
    return signed, absmax, absmax
  return signed, absmax, jnp.minimum(absmax, stats[1] if lane is None else stats[1][lane::2])


def _codes(x: jax.Array, scales: tuple[jax.Array, jax.Array, jax.Array]) -> jax.Array:
  """Each element's 4-bit code (int32), given its `_element_scales`."""
  signed, signed_scale, unsigned_scale = scales
  scale = jnp.where(signed, signed_scale, unsigned_scale)
  # +/-inf saturates to +/- the element's scale; NaN is stored as 0.
  scaled = jnp.clip(jnp.where(scale > 0, x / jnp.where(scale > 0, scale, 1.0), 0.0), -1.0, 1.0)
  # XLA flushes subnormal floats to 0: a positive value keeps a normal ratio to its scale.
  tiny = np.finfo(np.float32).tiny
  scaled = jnp.where(x > 0, jnp.maximum(scaled, tiny), jnp.where(jnp.isnan(x), 0.0, scaled))
  rounded = jnp.clip(jnp.floor(scaled * _LEVELS + 0.5), 1, _LEVELS).astype(jnp.int32)
  unsigned_code = jnp.where(scaled > 0, rounded, 0)
  return jnp.where(signed, _signed_codes(scaled), unsigned_code)


def _values(codes: jax.Array, scales: tuple[jax.Array, jax.Array, jax.Array]) -> jax.Array:
  """Each element's float32 value from its code (int32) and `_element_scales`."""
  signed, signed_scale, unsigned_scale = scales
  signed_value = _signed_values(codes) * signed_scale
  level = codes.astype(jnp.float32) * np.float32(1 / _LEVELS)
  tiny = np.finfo(np.float32).tiny
  unsigned_value = jnp.where(codes > 0, jnp.maximum(level * unsigned_scale, tiny), 0.0)
  return jnp.where(signed, signed_value, unsigned_value)


def _pack(codes: jax.Array) -> jax.Array:
  pairs = codes.astype(jnp.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
  return pairs[..., 0] | (pairs[..., 1] << 4)


def _unpack(packed: jax.Array) -> jax.Array:
  """Each element's code: its byte spread over both its elements, shifted by 0 or 4."""
  wide = spread_blocks(jnp.asarray(packed), 2)
  odd = jax.lax.broadcasted_iota(jnp.uint8, wide.shape, wide.ndim - 1) & jnp.uint8(1)
  return ((wide >> (odd * jnp.uint8(4))) & jnp.uint8(15)).astype(jnp.int32)


def quantize4(
  x: jax.Array,
  block: int | tuple[int, int],
  *,
  rank1: bool,
  guard_nonfinite: bool = True,
  stats: tuple[jax.Array, ...] | None = None,
) -> Quantized4Leaf | Rank1Quantized4Leaf:
  """4-bit quantization of a float32 array (see the module docstring).

  Args:
    x: the values; the last dimension a multiple of the block's even ``cols``
      and, for a block of several rows, the one before a multiple of ``rows``.
    block: ``cols``, a block along the last dimension (`leaf_block4`), or
      ``(rows, cols)`` (`leaf_block4_shape`).
    rank1: store column maxima (`Rank1Quantized4Leaf`); for a leaf of 2
      or more dimensions (`uses_rank1` says when it pays).
    guard_nonfinite: an inf or NaN damages only its own element; False: it
      enters the statistics and damages its block and column.
    stats: `quantize4_stats` of ``x``, computed before; None: computed here.

  Returns:
    The stored leaf.

  Example:
    >>> x = jnp.asarray([[2.0, 1e-9, jnp.inf, jnp.nan], [-1.0, 0.5, 0.0, 0.25]])
    >>> back = dequantize4(quantize4(x, 4, rank1=False))
    >>> [[round(float(v), 4) for v in row] for row in back]
    [[2.0, 0.1333, 2.0, 0.0], [-1.0, 0.493, 0.0, 0.2394]]
  """
  return _quantize4(x, block_shape(block), rank1, guard_nonfinite, stats)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _quantize4(
  x: jax.Array,
  block: tuple[int, int],
  rank1: bool,
  guard_nonfinite: bool,
  stats: tuple[jax.Array, ...] | None,
) -> Quantized4Leaf | Rank1Quantized4Leaf:
  """`quantize4`, one program per shape: called eagerly (``init``, a conversion of a
  checkpoint), its tens of operations would each compile on their own."""
  x = jnp.asarray(x, jnp.float32)
  if stats is None:
    stats = quantize4_stats(x, block, rank1=rank1, guard_nonfinite=guard_nonfinite)
  codes = _pack(_codes(x, _element_scales(stats, block)))
  if rank1:
    return Rank1Quantized4Leaf(codes, *stats)
  return Quantized4Leaf(codes, stats[0])


def quantize4_lanes(
  lanes: tuple[jax.Array, jax.Array],
  block: int | tuple[int, int],
  stats: tuple[jax.Array, ...],
) -> Quantized4Leaf | Rank1Quantized4Leaf:
  """`quantize4` of the values whose even and odd columns are ``lanes``.

  The codes are computed byte by byte, each from the two values it holds:
  an encoder that also reads the old codes (to compute the new values) reads
  them at the same index it writes, so XLA writes the new codes over the old
  ones. ``stats`` are `quantize4_stats` of the interleaved values.
  """
  block = block_shape(block)
  low, high = (_codes(x, _element_scales(stats, block, lane)) for lane, x in enumerate(lanes))
  codes = low.astype(jnp.uint8) | (high.astype(jnp.uint8) << 4)
  if len(stats) == 2:
    return Rank1Quantized4Leaf(codes, *stats)
  return Quantized4Leaf(codes, stats[0])


def dequantize4_lane(leaf: Quantized4Leaf | Rank1Quantized4Leaf, lane: int) -> jax.Array:
  """The float32 values of a 4-bit leaf's even (``lane`` 0) or odd (1) columns.

  Each byte's low or high code, at the byte's own index (`quantize4_lanes`).
  """
  codes = (jnp.asarray(leaf.codes) >> jnp.uint8(4 * lane)) & jnp.uint8(15)
  stats = tuple(jnp.asarray(s) for s in leaf[1:])
  return _values(codes.astype(jnp.int32), _element_scales(stats, stored_block4(leaf), lane))


def dequantize4(leaf: Quantized4Leaf | Rank1Quantized4Leaf) -> jax.Array:
  """The float32 values of a 4-bit leaf.

  A positive code of an unsigned block decodes to at least the smallest
  normal float32 (XLA flushes subnormal products to 0), and a positive value
  (a normal float32: XLA counts a subnormal one as 0) encodes as a positive
  code, however small its ratio to its scale.
  """
  return _dequantize4(leaf)


@jax.jit
def _dequantize4(leaf: Quantized4Leaf | Rank1Quantized4Leaf) -> jax.Array:
  """`dequantize4`, one program per shape (as `_quantize4`)."""
  stats = tuple(jnp.asarray(s) for s in leaf[1:])
  return _values(_unpack(leaf.codes), _element_scales(stats, stored_block4(leaf)))
