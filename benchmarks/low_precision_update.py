"""One adamw update of a large leaf: float32 state vs bfloat16 (stochastic rounding), 8 and 4 bits.

The job-level benchmark (`low_precision.py`) times whole training steps of a
small model, where the optimizer update is a small part of the step. This one
times the update alone, on one leaf of each size, so the cost of the codecs
shows: plain ``optax.adamw`` (float32 state), and ``t5x_optim.low_precision``
of it in ``"bfloat16"``, ``"8bit"`` and ``"4bit"`` mode, and 8 bits with the
block statistics of the whole leaf at once (``stream_chunk`` above the leaf:
what walking a large leaf in chunks of rows costs), all in the same process.
It also times the 8-bit codec alone (quantize and dequantize of the leaf) and
one elementwise float32 op over it, the floor any update pays.

Run: ``python benchmarks/low_precision_update.py [--shapes 64x1024 1024x1024 4096x1024
32128x768] [--repeats 20]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import optax

from t5x_optim import low_precision
from t5x_optim._low_precision.quantize import dequantize, quantize


def _time(fn, *args, repeats: int) -> float:
  """Median seconds of ``fn(*args)`` over `repeats` calls, after one warm-up."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _update_seconds(
  tx: optax.GradientTransformation, shape: tuple[int, int], repeats: int
) -> float:
  params = {"w": jax.random.normal(jax.random.key(0), shape)}
  grads = {"w": jax.random.normal(jax.random.key(1), params["w"].shape)}

  @jax.jit
  def step(params, state):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  state = tx.init(params)
  params, state = step(params, state)
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    params, state = jax.block_until_ready(step(params, state))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument(
    "--shapes", nargs="+", default=["64x1024", "1024x1024", "4096x1024", "32128x768"]
  )
  parser.add_argument("--repeats", type=int, default=20)
  args = parser.parse_args()
  runs = {
    "float32": optax.adamw(1e-3),
    "bf16+SR": low_precision(optax.adamw(1e-3), "bfloat16"),
    "8bit": low_precision(optax.adamw(1e-3), "8bit"),
    "8bit whole": low_precision(optax.adamw(1e-3), "8bit", stream_chunk=1 << 40),
    "4bit": low_precision(optax.adamw(1e-3), "4bit"),
  }
  print(f"{jax.devices()[0].platform}, median of {args.repeats}; ms per call")
  print(
    f"{'shape':>10}{'x*1.5':>9}{'quantize':>10}{'dequant':>9}"
    + "".join(f"{name:>12}" for name in runs)
    + "".join(f"{name + ' vs f32':>19}" for name in list(runs)[1:])
  )
  for text in args.shapes:
    shape = tuple(int(n) for n in text.split("x"))
    x = jax.random.normal(jax.random.key(2), shape)
    scale = _time(jax.jit(lambda v: v * 1.5), x, repeats=args.repeats)
    encode = jax.jit(lambda v: quantize(v, 256))
    encoded = encode(x)
    quant = _time(encode, x, repeats=args.repeats)
    dequant = _time(jax.jit(dequantize), encoded, repeats=args.repeats)
    updates = {name: _update_seconds(tx, shape, args.repeats) for name, tx in runs.items()}
    base = updates["float32"]
    print(
      f"{text:>10}{scale * 1e3:>9.2f}{quant * 1e3:>10.2f}{dequant * 1e3:>9.2f}"
      + "".join(f"{t * 1e3:>12.2f}" for t in updates.values())
      + "".join(f"{base / updates[name]:>19.3f}" for name in list(runs)[1:])
    )


if __name__ == "__main__":
  main()
