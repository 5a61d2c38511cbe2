"""The compiled step's peak memory with float32, bf16+SR, 8-bit and 4-bit optimizer states.

What a user sizing a job pays is the step's peak, not the state's bytes at
rest. For each mode this prints XLA's own memory analysis of the compiled
step (``jax.jit(step, donate_argnums=0).lower(...).compile()
.memory_analysis()``; abstract shapes, nothing is allocated), in bytes per
param: the optimizer state at rest, the step's temporaries, and its peak
(arguments + outputs + temporaries - aliased), with the compile time
(``lower`` and ``compile``, after a first compile that absorbs the backend's
start-up and an untimed compile of the part's float32 step, which absorbs a
GPU's autotuning of its matrix products: every mode then compiles from the
same cache), for

* (a) the optimizer step jitted alone (``Optimizer.apply_gradient`` with
  the optimizer donated and the gradients an argument: gradient
  accumulation outside the step), on the params of an unscanned T5.1.1-base
  encoder-decoder (247.6M params);
* (b) a whole train step (forward, backward and update in one jit) of a
  decoder-only transformer LM at T5.1.1-base widths (embed 768, 12 heads of
  64, MLP 2048, 12 layers, vocabulary 32128: 115.5M params), at a per-device
  batch of 2 x 128 tokens, small enough that the update is the peak;
* (c) the same step with the 12 layers scanned (``flax.linen.scan``: each
  layer param stacked over a leading ``layers`` axis, 12 leaves instead of
  100), as T5X's scanned models keep them.

Modes: optax's ``adamw`` (float32 state), `t5x_optim.low_precision` of it in
``"bfloat16"`` (stochastic rounding) and ``"8bit"`` (also with
``guard_nonfinite=False``, for a step that refuses non-finite gradients
anyway), and optax's own
``adamw(mu_dtype=bfloat16)``, the peer a JAX user has today; ``"4bit"``
(``--modes ... 4-bit``) and ``"bfloat16"`` rounded to nearest (``stochastic_rounding=False``,
``--modes ... "bf16 nearest"``) run only when named. The ideal saving
of a mode is float32's state bytes less its own; the last column is the share
of it the peak keeps.

Run: ``python benchmarks/low_precision_peak.py [--parts a b c] [--modes ...]``.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from update_bandwidth import VOCAB, t5_shapes

from t5x_optim import OptaxWrapper, low_precision
from t5x_optim.cli.demo import model as demo
from t5x_optim.cli.demo.model import TransformerConfig, TransformerLM, cross_entropy_loss

MODES: dict[str, Callable[[], optax.GradientTransformation]] = {
  "float32": lambda: optax.adamw(1e-3),
  "bf16+SR": lambda: low_precision(optax.adamw(1e-3), "bfloat16"),
  "8-bit": lambda: low_precision(optax.adamw(1e-3), "8bit"),
  "8-bit, no inf guard": lambda: low_precision(optax.adamw(1e-3), "8bit", guard_nonfinite=False),
  "optax mu_dtype=bf16": lambda: optax.adamw(1e-3, mu_dtype=jnp.bfloat16),
  "4-bit": lambda: low_precision(optax.adamw(1e-3), "4bit"),
  "bf16 nearest": lambda: low_precision(optax.adamw(1e-3), "bfloat16", stochastic_rounding=False),
}
NAMED_MODES = ("4-bit", "bf16 nearest")
DEFAULT_MODES = [mode for mode in MODES if mode not in NAMED_MODES]
"""The modes run without ``--modes``: 4-bit and bfloat16 rounded to nearest are asked for by name."""
BASE_LM = TransformerConfig(
  vocab_size=VOCAB,
  embed_dim=768,
  num_heads=12,
  head_dim=64,
  mlp_dim=2048,
  num_layers=12,
  max_length=128,
)
BATCH = (2, 128)


class _ScannedBlock(nn.Module):
  """One layer of `TransformerLM` as a `flax.linen.scan` body."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, x: jax.Array, _: Any) -> tuple[jax.Array, None]:
    return demo._Block(self.config, name="block")(x), None


class ScannedLM(nn.Module):
  """`TransformerLM` with its layers scanned: each layer param stacked over ``layers``."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    c = self.config
    embedding = demo._param(
      self, "token_embedding", (c.vocab_size, c.embed_dim), ("vocab", "embed")
    )
    positions = demo._param(
      self, "position_embedding", (c.max_length, c.embed_dim), ("length", "embed")
    )
    x = embedding[tokens] + positions[: tokens.shape[-1]]
    layers = nn.scan(
      _ScannedBlock,
      variable_axes={"params": 0},
      split_rngs={"params": True},
      length=c.num_layers,
      metadata_params={nn.PARTITION_NAME: "layers"},
    )
    x, _ = layers(c, name="layers")(x, None)
    x = demo._LayerNorm(name="final_norm")(x)
    return x @ demo._param(self, "logits", (c.embed_dim, c.vocab_size), ("embed", "vocab"))


def _abstract_params_t5() -> Any:
  shapes = t5_shapes(768, 2048, 12, VOCAB)
  return jax.tree.map(
    lambda s: jax.ShapeDtypeStruct(s, jnp.float32), shapes, is_leaf=lambda x: isinstance(x, tuple)
  )


def _abstract_params_lm(model: nn.Module) -> Any:
  tokens = jnp.zeros(BATCH, jnp.int32)
  variables = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens))
  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nn_unbox(variables["params"])
  )


def nn_unbox(tree: Any) -> Any:
  """The params without flax's logical-partitioning boxes."""
  return nn.meta.unbox(tree)


def _nbytes(tree: Any) -> int:
  return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _measure(step: Callable, opt: Any, *args: Any) -> dict[str, float]:
  start = time.perf_counter()
  compiled = jax.jit(step, donate_argnums=0).lower(opt, *args).compile()
  seconds = time.perf_counter() - start
  m = compiled.memory_analysis()
  peak = (
    m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
  )
  return {"temp": m.temp_size_in_bytes, "peak": peak, "compile": seconds}


def optimizer_step(make_tx: Callable[[], optax.GradientTransformation]) -> dict[str, float]:
  params = _abstract_params_t5()
  opt = jax.eval_shape(lambda p: OptaxWrapper(make_tx()).create(p), params)
  out = _measure(lambda o, g: o.apply_gradient(g), opt, params)
  return out | {"state": _nbytes(opt.state.param_states), "n": _nbytes(params) / 4}


def train_step(
  make_tx: Callable[[], optax.GradientTransformation], *, scanned: bool = False
) -> dict[str, float]:
  model = (ScannedLM if scanned else TransformerLM)(BASE_LM)
  params = _abstract_params_lm(model)
  opt = jax.eval_shape(lambda p: OptaxWrapper(make_tx()).create(p), params)
  batch = {
    "inputs": jax.ShapeDtypeStruct(BATCH, jnp.int32),
    "targets": jax.ShapeDtypeStruct(BATCH, jnp.int32),
  }

  def step(opt, batch):
    def loss(p):
      return cross_entropy_loss(model.apply({"params": p}, batch["inputs"]), batch["targets"])

    grads = jax.grad(loss)(opt.target)
    return opt.apply_gradient(grads)

  out = _measure(step, opt, batch)
  return out | {"state": _nbytes(opt.state.param_states), "n": _nbytes(params) / 4}


def _table(title: str, rows: dict[str, dict[str, float]]) -> None:
  base = rows.get("float32")
  print(f"\n{title}")
  print(
    f"{'mode':<24}{'state B/p':>10}{'temp B/p':>10}{'peak B/p':>10}{'vs f32':>8}"
    f"{'saved/ideal':>13}{'compile s':>11}"
  )
  for name, r in rows.items():
    n = r["n"]
    ratio = r["peak"] / base["peak"] if base else float("nan")
    ideal = (base["state"] - r["state"]) if base else 0
    kept = (base["peak"] - r["peak"]) / ideal if base and ideal > 0 else float("nan")
    print(
      f"{name:<24}{r['state'] / n:>10.2f}{r['temp'] / n:>10.2f}{r['peak'] / n:>10.2f}"
      f"{ratio:>8.3f}{kept:>13.0%}{r['compile']:>11.1f}"
    )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--parts", nargs="+", default=["a", "b", "c"], choices=["a", "b", "c"])
  parser.add_argument("--modes", nargs="+", default=DEFAULT_MODES, choices=list(MODES))
  args = parser.parse_args()
  # The ratios are against float32's step of the same run: it is always measured, first.
  modes = list(dict.fromkeys(["float32", *args.modes]))
  print(f"{jax.devices()[0].platform}; B/p = bytes per param")
  # The backend's start-up (on a GPU, tens of seconds) falls on the first compile: not a mode's.
  jax.jit(lambda x: x + 1).lower(jnp.zeros(8)).compile()
  if "a" in args.parts:
    optimizer_step(MODES["float32"])
    rows = {m: optimizer_step(MODES[m]) for m in modes}
    n = next(iter(rows.values()))["n"]
    _table(f"(a) optimizer step jitted alone, T5.1.1-base params ({n / 1e6:.1f}M)", rows)
  if "b" in args.parts:
    train_step(MODES["float32"])
    rows = {m: train_step(MODES[m]) for m in modes}
    n = next(iter(rows.values()))["n"]
    _table(
      f"(b) whole train step, decoder-only LM at T5.1.1-base widths ({n / 1e6:.1f}M params), "
      f"batch {BATCH[0]} x {BATCH[1]}",
      rows,
    )
  if "c" in args.parts:
    train_step(MODES["float32"], scanned=True)
    rows = {m: train_step(MODES[m], scanned=True) for m in modes}
    _table(f"(c) the same step, layers scanned ({BASE_LM.num_layers} layers stacked)", rows)


if __name__ == "__main__":
  main()
