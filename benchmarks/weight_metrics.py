"""Cost of the per-parameter metrics (``metrics_every``) in `t5x-optim train`'s step.

Run: ``python benchmarks/weight_metrics.py [--pairs N] [--data PATH] [--gin_file F ...]``
(``--gin_file optimizers/adamw_8bit.gin``: the state in 8 bits, whose metrics decode it).

Builds the default job (the default model, optimizer and mesh on 8 simulated
CPU devices, on the text task), then times the jitted train step without the
metrics and with them (RMS of every param, gradient, update and
optimizer-state leaf), in pairs (the plain step first in each) so that machine
noise hits both alike.
Prints the median step times, the cost of one step with the metrics, and what
that costs on average at ``metrics_every = 50`` (the default).
"""

from __future__ import annotations

import argparse
import statistics
import time

import _cpu_devices  # noqa: F401  (first: XLA flags before jax)
import jax

from t5x_optim.cli.loop import config as _config
from t5x_optim.cli.loop import train as _train


def _time(fn, state, batch) -> tuple[float, object]:
  start = time.perf_counter()
  state, metrics = fn(state, batch)
  jax.block_until_ready((state, metrics))
  return time.perf_counter() - start, state


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--pairs", type=int, default=200)
  parser.add_argument("--data", default="hamlet.txt")
  parser.add_argument("--every", type=int, default=50)
  parser.add_argument("--gin_file", action="append", default=[])
  args = parser.parse_args()
  _config.parse_config(
    gin_files=args.gin_file,
    gin_bindings=_config.data_bindings(args.data),
    macros=_config.device_macros(8),
  )
  setup = _train.prepare(_config.build_job())
  state = setup.create(*setup.init_args)
  batch = setup.train_batch(0)
  for fn in (setup.step_fn, setup.weights_step_fn):  # compile both
    _, state = _time(fn, state, batch)
  plain, weights = [], []
  for _ in range(args.pairs):
    seconds, state = _time(setup.step_fn, state, batch)
    plain.append(seconds)
    seconds, state = _time(setup.weights_step_fn, state, batch)
    weights.append(seconds)
  base, with_metrics = statistics.median(plain), statistics.median(weights)
  cost = with_metrics / base - 1
  tags = len(setup.weight_tags)
  print(f"devices: {jax.device_count()} x {jax.devices()[0].platform}, {tags} metric tags")
  print(f"optimizer: {_config.describe_optimizer()}")
  print(f"step without metrics: {base * 1e3:.2f} ms (median of {args.pairs})")
  print(f"step with metrics:    {with_metrics * 1e3:.2f} ms ({cost:+.1%})")
  print(f"at metrics_every={args.every}: {cost / args.every:+.2%} on average")


if __name__ == "__main__":
  main()
