"""Step and trace+compile overhead of `Optimizer.apply_gradient` vs plain optax.

Run: ``python benchmarks/step_overhead.py [--pairs N]``.

Measures, in one run and interleaved in pairs (so machine noise hits both
sides alike), the median time ratio of
  * a jitted training step (forward, backward, adamw update) on a ~10M
    parameter MLP: the wrapper's `apply_gradient` vs `tx.update` +
    `optax.apply_updates`;
  * trace + compile of one update step on a 7,000-leaf parameter tree.
Targets: step ratio <= 1.01, trace+compile ratio <= 1.05.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from t5x_optim import OptaxWrapper

WIDTH, DEPTH, BATCH = 1024, 10, 64


def mlp_params(key: jax.Array) -> dict[str, Any]:
  keys = jax.random.split(key, DEPTH)
  return {
    f"layer_{i}": {
      "kernel": jax.random.normal(k, (WIDTH, WIDTH), jnp.float32) / WIDTH**0.5,
      "bias": jnp.zeros((WIDTH,), jnp.float32),
    }
    for i, k in enumerate(keys)
  }


def mlp_loss(params: dict[str, Any], x: jax.Array) -> jax.Array:
  for i in range(DEPTH):
    layer = params[f"layer_{i}"]
    x = jnp.tanh(x @ layer["kernel"] + layer["bias"])
  return jnp.mean(x**2)


def make_steps(tx: optax.GradientTransformation) -> tuple[Callable, Callable]:
  """Jitted train steps: plain optax and through the wrapper."""

  def plain(params, state, x):
    grads = jax.grad(mlp_loss)(params, x)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  def wrapped(optimizer, x):
    return optimizer.apply_gradient(jax.grad(mlp_loss)(optimizer.target, x))

  return jax.jit(plain, donate_argnums=(0, 1)), jax.jit(wrapped, donate_argnums=0)


def time_call(fn: Callable[[], Any]) -> tuple[float, Any]:
  start = time.perf_counter()
  out = jax.block_until_ready(fn())
  return time.perf_counter() - start, out


def step_ratio(pairs: int) -> tuple[float, float, float]:
  tx = optax.adamw(1e-3)
  plain, wrapped = make_steps(tx)
  x = jax.random.normal(jax.random.key(1), (BATCH, WIDTH))
  params = mlp_params(jax.random.key(0))
  state = tx.init(params)
  optimizer = OptaxWrapper(tx).create(mlp_params(jax.random.key(0)))
  params, state = jax.block_until_ready(plain(params, state, x))
  optimizer = jax.block_until_ready(wrapped(optimizer, x))
  plain_times, wrapped_times, ratios = [], [], []
  for i in range(pairs):
    order = (0, 1) if i % 2 == 0 else (1, 0)
    elapsed = {}
    for which in order:
      if which == 0:
        elapsed[0], (params, state) = time_call(lambda: plain(params, state, x))
      else:
        elapsed[1], optimizer = time_call(lambda: wrapped(optimizer, x))
    plain_times.append(elapsed[0])
    wrapped_times.append(elapsed[1])
    ratios.append(elapsed[1] / elapsed[0])
  return statistics.median(plain_times), statistics.median(wrapped_times), statistics.median(ratios)


def wide_params(leaves: int) -> dict[str, Any]:
  return {
    f"module_{i}": {"kernel": jnp.zeros((4, 4)), "bias": jnp.zeros((4,))}
    for i in range(leaves // 2)
  }


def compile_ratios(pairs: int, leaves: int) -> list[tuple[str, float, float, float]]:
  """Trace (jit lowering) and trace+compile times, interleaved in pairs."""
  tx = optax.adamw(1e-3)
  params = wide_params(leaves)
  state = tx.init(params)
  optimizer = OptaxWrapper(tx).create(params)
  grads = jax.tree.map(jnp.ones_like, params)

  def plain_lower():
    def plain(params, state, grads):
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    return jax.jit(plain).lower(params, state, grads)

  def wrapped_lower():
    def wrapped(optimizer, grads):
      return optimizer.apply_gradient(grads)

    return jax.jit(wrapped).lower(optimizer, grads)

  times: dict[str, list[float]] = {key: [] for key in ("pt", "wt", "pc", "wc")}
  for i in range(pairs):
    sides = (("p", plain_lower), ("w", wrapped_lower))
    for side, lower in sides if i % 2 == 0 else sides[::-1]:
      traced, lowered = time_call(lower)
      compiled, _ = time_call(lowered.compile)
      times[side + "t"].append(traced)
      times[side + "c"].append(traced + compiled)
  rows = []
  for label, kind in (
    (f"trace (lower), {leaves}-leaf tree (s)", "t"),
    (f"trace+compile, {leaves}-leaf tree (s)", "c"),
  ):
    plain, wrapped = times["p" + kind], times["w" + kind]
    ratios = [w / p for w, p in zip(wrapped, plain)]
    rows.append(
      (label, statistics.median(plain), statistics.median(wrapped), statistics.median(ratios))
    )
  return rows


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--pairs", type=int, default=30, help="timed pairs for the step")
  parser.add_argument(
    "--compile-pairs",
    type=int,
    default=2,
    help="timed pairs for compiles (XLA:CPU takes minutes at 7,000 leaves)",
  )
  parser.add_argument("--leaves", type=int, default=7000)
  args = parser.parse_args()
  n_params = DEPTH * (WIDTH * WIDTH + WIDTH)
  rows = [(f"train step, {n_params / 1e6:.1f}M-param MLP (ms)", *step_ratio(args.pairs), 1.01)]
  rows += [(*row, 1.05) for row in compile_ratios(args.compile_pairs, args.leaves)]
  print(f"jax {jax.__version__}, optax {optax.__version__}, backend {jax.default_backend()}")
  print(f"{'measure':<42} {'plain optax':>12} {'wrapper':>12} {'median ratio':>13} {'target':>8}")
  for name, plain, wrapped, ratio, target in rows:
    scale = 1e3 if "(ms)" in name else 1.0
    print(
      f"{name:<42} {plain * scale:>12.3f} {wrapped * scale:>12.3f} {ratio:>13.3f} {'<= ' + str(target):>8}"
    )


if __name__ == "__main__":
  main()
