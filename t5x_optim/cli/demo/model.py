"""A tiny decoder-only transformer LM and the synthetic task it learns.

Both are frozen dataclasses, so gin configures them field by field. The model
boxes every param with `nn.with_logical_partitioning` under T5X's logical
axis names (``vocab``, ``embed``, ``joined_kv``, ``mlp``, ``length``), so the
standard logical axis rules shard it.

The task is an order-2 Markov language: each token is one of `branching`
successors fixed by the two tokens before it, chosen uniformly. A model that
learns the successor table reaches a loss of about ``log(branching)`` on all
but the first two positions; a model that has learned nothing sits at
``log(vocab_size)``.

Example:
  >>> import jax
  >>> task = SyntheticTask(vocab_size=16, length=8, batch_size=2)
  >>> batch = task.batch(0)
  >>> batch['inputs'].shape, batch['targets'].shape
  ((2, 8), (2, 8))
  >>> model = TransformerLM(TransformerConfig(vocab_size=16, max_length=8))
  >>> variables = model.init(jax.random.key(0), batch['inputs'])
  >>> model.apply(variables, batch['inputs']).shape
  (2, 8, 16)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["SyntheticTask", "TransformerConfig", "TransformerLM", "cross_entropy_loss"]

_EVAL_STREAM = 1
"""Seeds held-out batches with ``(seed, index, 1)``, training ones with ``(seed, step)``."""


def _check_ints(owner: object, *, minimum: dict[str, int] | None = None) -> None:
  """Checks that every int field is an int of at least 1 (or its `minimum`)."""
  for field in dataclasses.fields(owner):
    value = getattr(owner, field.name)
    least = (minimum or {}).get(field.name, 1)
    if field.type == "int" and (
      isinstance(value, bool) or not isinstance(value, int) or value < least
    ):
      raise ValueError(
        f"{type(owner).__name__}.{field.name} must be an int >= {least}, "
        f"got {value!r} ({type(value).__name__})."
      )


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Sizes of `TransformerLM`.

  Attributes:
    vocab_size: number of token ids.
    embed_dim: model width.
    num_heads: attention heads.
    head_dim: width of each head.
    mlp_dim: hidden width of the MLP blocks.
    num_layers: transformer blocks.
    max_length: longest sequence (size of the position embedding).

  Example:
    >>> TransformerConfig(num_layers=1).num_layers
    1
  """

  vocab_size: int = 128
  embed_dim: int = 64
  num_heads: int = 4
  head_dim: int = 16
  mlp_dim: int = 128
  num_layers: int = 2
  max_length: int = 32

  def __post_init__(self):
    _check_ints(self)


def _param(
  module: nn.Module,
  name: str,
  shape: Sequence[int],
  axes: tuple[str, ...],
  init: Callable[..., Any] = nn.initializers.lecun_normal(),
) -> jax.Array:
  return module.param(name, nn.with_logical_partitioning(init, axes), tuple(shape))


class _LayerNorm(nn.Module):
  """RMS layer norm with a learned scale over ``embed``."""

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    scale = _param(self, "scale", (x.shape[-1],), ("embed",), nn.initializers.ones)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


class _Attention(nn.Module):
  """Causal multi-head self-attention with joined-head projections."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    c = self.config
    width = c.num_heads * c.head_dim
    batch, length, _ = x.shape

    def project(name: str) -> jax.Array:
      kernel = _param(self, name, (c.embed_dim, width), ("embed", "joined_kv"))
      return (x @ kernel).reshape(batch, length, c.num_heads, c.head_dim)

    q, k, v = project("query"), project("key"), project("value")
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(c.head_dim)
    causal = jnp.tril(jnp.ones((length, length), dtype=bool))
    weights = jax.nn.softmax(jnp.where(causal, logits, -1e9), axis=-1)
    mixed = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, length, width)
    out = _param(self, "out", (width, c.embed_dim), ("joined_kv", "embed"))
    return mixed @ out


class _Mlp(nn.Module):
  config: TransformerConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    c = self.config
    wi = _param(self, "wi", (c.embed_dim, c.mlp_dim), ("embed", "mlp"))
    wo = _param(self, "wo", (c.mlp_dim, c.embed_dim), ("mlp", "embed"))
    return jax.nn.gelu(x @ wi) @ wo


class _Block(nn.Module):
  config: TransformerConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + _Attention(self.config, name="attention")(_LayerNorm(name="pre_attention_norm")(x))
    return x + _Mlp(self.config, name="mlp")(_LayerNorm(name="pre_mlp_norm")(x))


class TransformerLM(nn.Module):
  """A pre-norm decoder-only transformer: token ids in, next-token logits out.

  Attributes:
    config: the sizes.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> model = TransformerLM(TransformerConfig(num_layers=1))
    >>> variables = model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    >>> nn.get_partition_spec(variables)['params']['layers_0']['mlp']['wi']
    P('embed', 'mlp')
  """

  config: TransformerConfig

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    c = self.config
    if tokens.shape[-1] > c.max_length:
      raise ValueError(
        f"Sequences of length {tokens.shape[-1]} exceed TransformerConfig.max_length="
        f"{c.max_length}."
      )
    embedding = _param(
      self,
      "token_embedding",
      (c.vocab_size, c.embed_dim),
      ("vocab", "embed"),
      nn.initializers.normal(1.0),
    )
    positions = _param(
      self,
      "position_embedding",
      (c.max_length, c.embed_dim),
      ("length", "embed"),
      nn.initializers.normal(0.02),
    )
    x = embedding[tokens] + positions[: tokens.shape[-1]]
    for i in range(c.num_layers):
      x = _Block(c, name=f"layers_{i}")(x)
    x = _LayerNorm(name="final_norm")(x)
    unembedding = _param(self, "logits", (c.embed_dim, c.vocab_size), ("embed", "vocab"))
    return x @ unembedding


def cross_entropy_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Mean next-token cross-entropy (nats).

  Example:
    >>> import jax.numpy as jnp
    >>> round(float(cross_entropy_loss(jnp.zeros((1, 2, 4)), jnp.zeros((1, 2), jnp.int32))), 4)
    1.3863
  """
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  picked = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)
  return -jnp.mean(picked)


_TABLE_ENTRIES = 1 << 24
"""The most entries (int32, 64 MiB) of a successor table `SyntheticTask` builds; a language
whose table would hold more hashes its successors (`_hashed_successors`)."""


@functools.cache
def _successor_table(vocab_size: int, branching: int, seed: int) -> np.ndarray:
  rng = np.random.default_rng(seed)
  return rng.integers(vocab_size, size=(vocab_size, vocab_size, branching), dtype=np.int32)


_GOLDEN64 = np.uint64(0x9E3779B97F4A7C15)
"""SplitMix64's increment: 2**64 over the golden ratio."""


def _mix64(x: np.ndarray) -> np.ndarray:
  """SplitMix64 of uint64 values: the increment added, then its finalizer (modulo 2**64)."""
  with np.errstate(over="ignore"):
    x = np.asarray(x, np.uint64) + _GOLDEN64
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  return x ^ (x >> np.uint64(31))


def _hashed_successors(
  vocab_size: int, seed: int, previous: np.ndarray, last: np.ndarray, choice: np.ndarray | int
) -> np.ndarray:
  """Successor ``choice`` of the tokens ``previous`` then ``last`` (elementwise), int32: the
  hash of the three and ``seed``, modulo ``vocab_size``.

  Example:
    >>> _hashed_successors(1 << 18, 0, np.array([3, 3]), np.array([5, 5]), np.array([0, 1]))
    array([200297, 220581], dtype=int32)
  """
  pair = np.asarray(previous, np.uint64) * np.uint64(vocab_size) + np.asarray(last, np.uint64)
  key = _mix64(_mix64(pair ^ _mix64(seed)) ^ np.asarray(choice, np.uint64))
  return (key % np.uint64(vocab_size)).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class SyntheticTask:
  """Batches of an order-2 Markov language, generated from `seed` and the step.

  Batch `step` is the same on every call and every host, so a resumed run
  sees exactly the data it would have seen without the interruption.

  Attributes:
    vocab_size: number of token ids.
    length: tokens per example (inputs and targets each).
    batch_size: examples per batch (global, over all devices).
    branching: successors per pair of preceding tokens.
    seed: fixes the successors and the data stream.

  The successors of a language of up to 2,896 tokens (``vocab_size**2 *
  branching`` at most 2**24) are a random table of them; a larger one's are a hash of the two
  tokens, the choice and `seed` (a table of 262,144 tokens would take 512 GiB).

  Example:
    >>> task = SyntheticTask(vocab_size=8, length=4, batch_size=1)
    >>> b = task.batch(3)
    >>> bool((b['inputs'][:, 1:] == b['targets'][:, :-1]).all())
    True
  """

  vocab_size: int = 128
  length: int = 32
  batch_size: int = 32
  branching: int = 2
  seed: int = 0

  def __post_init__(self):
    _check_ints(self, minimum={"seed": 0})

  @property
  def loss_floor(self) -> float:
    """The best achievable mean loss (nats); the first target is random."""
    free = min(self.length, 1)
    guessed = self.length - free
    return (free * math.log(self.vocab_size) + guessed * math.log(self.branching)) / self.length

  def batch(self, step: int, rows: slice | None = None) -> dict[str, np.ndarray]:
    """Rows `rows` (default: all) of the training batch of `step`: ``inputs``
    and next-token ``targets``, int32."""
    return self._sample(np.random.default_rng((self.seed, step)), rows)

  def eval_batch(self, index: int, rows: slice | None = None) -> dict[str, np.ndarray]:
    """Held-out batch `index` (its rows `rows`): the same language, sampled apart
    from every training batch.

    Example:
      >>> task = SyntheticTask(vocab_size=8, length=4, batch_size=2)
      >>> bool((task.eval_batch(0)['inputs'] == task.batch(0)['inputs']).all())
      False
    """
    return self._sample(np.random.default_rng((self.seed, index, _EVAL_STREAM)), rows)

  def _successors(self) -> Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]:
    """``(previous, last, choice)`` to the chosen successors: read from the language's table
    where it holds at most `_TABLE_ENTRIES`, else hashed (`_hashed_successors`)."""
    if self.vocab_size**2 * self.branching <= _TABLE_ENTRIES:
      table = _successor_table(self.vocab_size, self.branching, self.seed)
      return lambda previous, last, choice: table[previous, last, choice]
    return functools.partial(_hashed_successors, self.vocab_size, self.seed)

  def _sample(self, rng: np.random.Generator, rows: slice | None) -> dict[str, np.ndarray]:
    successors = self._successors()
    tokens = np.empty((self.batch_size, self.length + 1), np.int32)
    tokens[:, :2] = rng.integers(self.vocab_size, size=(self.batch_size, 2))
    choices = rng.integers(self.branching, size=(self.batch_size, self.length + 1))
    for t in range(2, self.length + 1):
      tokens[:, t] = successors(tokens[:, t - 2], tokens[:, t - 1], choices[:, t])
    tokens = tokens if rows is None else tokens[rows]
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
