"""The two storage codecs of `low_precision`: bfloat16 with stochastic rounding, block-wise 8 bits.

* bfloat16: `rounding_bits` gives each element 16 random bits hashed from its
  index, the seed, the step count and the leaf's index, so a run is
  reproducible, sharded or not; `to_bfloat16` rounds up with probability equal
  to the dropped mantissa bits' value (unbiased), or to nearest without bits.
* 8 bits: `quantize` scales each block of the last dimension by its absolute
  maximum and stores each value as the index (``uint8``) of the nearest of
  256 values of bitsandbytes' dynamic map (`dynamic_map`), signed for a block
  with a negative value; `dequantize` inverts it. `leaf_block` chooses a
  leaf's block so that the scales shard wherever the codes do.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
  "QuantizedLeaf",
  "dequantize",
  "dynamic_map",
  "leaf_block",
  "quantize",
  "rounding_bits",
  "to_bfloat16",
]


class QuantizedLeaf(NamedTuple):
  """One 8-bit state leaf.

  Attributes:
    codes: ``uint8``, the leaf's shape: the index of each value in its
      block's map (`dynamic_map`).
    scales: float32, ``(*shape[:-1], shape[-1] // block)``: each block's
      absolute maximum, negated when the block uses the signed map.
  """

  codes: Any
  scales: Any


@functools.cache
def dynamic_map(signed: bool) -> np.ndarray:
  """The 256 sorted float32 values of bitsandbytes' dynamic quantization map.

  Seven decades, ``1e-6`` to ``1``; decade ``i`` (from the smallest) holds
  the midpoints of ``2**i`` (signed) or ``2**(i + 1)`` (unsigned) equal steps
  of ``[0.1, 1]`` times ``10**(i - 6)``, the signed map with both signs; then
  0 and 1. This is ``bitsandbytes.functional.create_dynamic_map(signed)``.

  Example:
    >>> m = dynamic_map(True)
    >>> len(m), round(float(m[0]), 6), float(m[-1]), int((m == 0).sum())
    (256, -0.992969, 1.0, 1)
  """
  values = [0.0, 1.0]
  for i in range(7):
    items = 2**i + 1 if signed else 2 ** (i + 1) + 1
    bounds = np.linspace(0.1, 1, items, dtype=np.float32)
    means = (bounds[:-1] + bounds[1:]) / np.float32(2)
    decade = (np.float32(10.0 ** (i - 6)) * means).tolist()
    values += decade + ([-v for v in decade] if signed else [])
  out = np.sort(np.asarray(values, np.float32))
  out.setflags(write=False)
  return out


@functools.cache
def _midpoints(signed: bool) -> np.ndarray:
  table = dynamic_map(signed)
  return (table[:-1] + table[1:]) / np.float32(2)


@functools.cache
def _joined_tables() -> tuple[np.ndarray, np.ndarray]:
  """(midpoints, values): the signed map's at 0-255, the unsigned map's at 256-511.

  Each map's 255 midpoints are padded with +inf to 256, so a binary search
  over one half never leaves it.
  """
  pad = np.array([np.inf], np.float32)
  middles = np.concatenate([_midpoints(True), pad, _midpoints(False), pad])
  return middles, np.concatenate([dynamic_map(True), dynamic_map(False)])


def _blocks(x: jax.Array, block: int) -> jax.Array:
  return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _codes(scaled: jax.Array, signed: jax.Array) -> jax.Array:
  """The index of the nearest map value: the number of the map's midpoints below ``scaled``.

  A binary search of 8 steps over the joined tables (one gather per step);
  under explicit sharding (generic spec derivation traces ``init`` so),
  where a gather from a replicated table does not trace, a count over all
  midpoints. Both count the same midpoints.
  """
  if _explicitly_sharded(scaled):
    return jnp.where(
      signed,
      jnp.searchsorted(jnp.asarray(_midpoints(True)), scaled, method="compare_all"),
      jnp.searchsorted(jnp.asarray(_midpoints(False)), scaled, method="compare_all"),
    )
  middles = jnp.asarray(_joined_tables()[0])
  offset = jnp.where(signed, 0, 256)
  found = jnp.zeros(scaled.shape, jnp.int32)
  for step in (128, 64, 32, 16, 8, 4, 2, 1):
    candidate = found + step
    found = jnp.where(middles[offset + candidate - 1] < scaled, candidate, found)
  return found


def quantize(x: jax.Array, block: int) -> QuantizedLeaf:
  """Block-wise dynamic 8-bit quantization of a float32 array."""
  blocks = _blocks(x, block)
  absmax = jnp.max(jnp.abs(blocks), axis=-1)
  signed = jnp.min(blocks, axis=-1) < 0
  scaled = blocks / jnp.where(absmax > 0, absmax, 1.0)[..., None]
  codes = _codes(scaled, jnp.broadcast_to(signed[..., None], scaled.shape))
  return QuantizedLeaf(
    codes=codes.astype(jnp.uint8).reshape(x.shape), scales=jnp.where(signed, -absmax, absmax)
  )


def dequantize(leaf: QuantizedLeaf) -> jax.Array:
  codes = _blocks(leaf.codes.astype(jnp.int32), leaf.codes.shape[-1] // leaf.scales.shape[-1])
  offset = jnp.where(leaf.scales < 0, 0, 256)[..., None]
  values = jnp.asarray(_joined_tables()[1])[offset + codes]
  return (values * jnp.abs(leaf.scales)[..., None]).reshape(leaf.codes.shape)


def _explicitly_sharded(x: jax.Array) -> bool:
  """Whether ``x`` is traced sharded over an explicit mesh (sharding in types)."""
  mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
  types = () if mesh is None or mesh.empty else mesh.axis_types
  return any(t == jax.sharding.AxisType.Explicit for t in types)


def _hash32(x: jax.Array) -> jax.Array:
  """Chris Wellons' ``lowbias32`` integer hash of uint32 values."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x7FEB352D)
  x = x ^ (x >> 15)
  x = x * jnp.uint32(0x846CA68B)
  return x ^ (x >> 16)


def rounding_bits(shape: tuple[int, ...], seed: int, count: jax.Array, leaf: int) -> jax.Array:
  """16 random bits (uint32 below ``2**16``) per element, from the seed, step and leaf.

  Each element's bits hash its row-major index with a key hashed from
  ``seed``, ``count`` and ``leaf``: cheaper than a counter-based PRNG, the
  same sharded or not, and reproducible.

  Example:
    >>> bits = rounding_bits((2, 3), 0, jnp.int32(1), 0)
    >>> bits.dtype, bool((bits < 2**16).all())
    (dtype('uint32'), True)
  """
  key = _hash32(_hash32(_hash32(jnp.uint32(seed)) ^ count.astype(jnp.uint32)) ^ jnp.uint32(leaf))
  index = jnp.zeros(shape, jnp.uint32)
  stride = 1
  for dim in reversed(range(len(shape))):
    index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, dim) * jnp.uint32(stride)
    stride *= shape[dim]
  return _hash32(index * jnp.uint32(0x9E3779B9) + key) >> 16


def to_bfloat16(x: jax.Array, bits: jax.Array | None) -> jax.Array:
  """``x`` in bfloat16: to nearest (``bits`` None) or stochastically, adding 16 random ``bits``."""
  if bits is None:
    return x.astype(jnp.bfloat16)
  raw = jax.lax.bitcast_convert_type(x, jnp.uint32)
  rounded = jax.lax.bitcast_convert_type((raw + bits) & jnp.uint32(0xFFFF0000), jnp.float32)
  return jnp.where(jnp.isfinite(x), rounded, x).astype(jnp.bfloat16)


def leaf_block(last_dim: int, block_size: int = 256, shard_multiple: int = 8) -> int:
  """The block of an 8-bit leaf whose last dimension is ``last_dim``.

  The largest divisor of ``last_dim // gcd(last_dim, shard_multiple)`` not
  above ``block_size``: blocks tile the last dimension, and the block count
  is a multiple of ``gcd(last_dim, shard_multiple)``, so the scales shard
  along the last dimension wherever the codes do over up to
  ``shard_multiple`` devices (a power of two).

  Example:
    >>> leaf_block(4096), leaf_block(3072), leaf_block(768), leaf_block(768, shard_multiple=1)
    (256, 192, 96, 256)
  """
  rest = last_dim // math.gcd(last_dim, shard_multiple)
  return next(b for b in range(min(block_size, rest), 0, -1) if rest % b == 0)
