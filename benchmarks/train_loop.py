"""Benchmark: the `t5x-optim train` loop against a bare loop of the same jitted step.

Both sides run the default job's jitted train step (the default transformer,
adamw, the default mesh) on the same synthetic batches:

* ``t5x-optim``: `t5x_optim.cli.loop.train.train`, the loop behind ``t5x-optim
  train``: metrics fetched and averaged every ``log_every`` steps, TensorBoard
  events, progress lines (to a string buffer). Its own steps/s (compilation,
  evals and saves excluded) is what the table shows; evals and intermediate
  checkpoints are switched off (``eval_every``, ``checkpoint_every`` past the
  end), the final save is outside the timed interval.
* ``bare loop``: ``state, _ = step_fn(state, batch)`` back to back, timed
  after the first (compiling) step; on CPU it waits for each step, as the
  t5x-optim loop does there (several multi-device steps in flight can
  deadlock XLA:CPU's collectives on a loaded machine).

Each round runs both sides once, alternating which goes first; one warm-up
round is not counted. The table gives the median steps/s of each side and the
median over rounds of the per-round ratio (t5x-optim / bare; 1.0 = no loop
overhead).

Run: ``python benchmarks/train_loop.py [--steps 200] [--rounds 5] [--num_devices 8]``.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import tempfile
import time


def _parse() -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument(
    "--num_devices", type=int, default=8, help="simulated CPU devices (ignored on an accelerator)"
  )
  args = parser.parse_args()
  if args.steps < 2:  # the bare loop times the steps after its first, compiling one
    parser.error(f"--steps must be at least 2, got {args.steps}.")
  return args


def main() -> None:
  args = _parse()
  os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.num_devices}"
  import jax  # noqa: PLC0415 - after the XLA flags

  from t5x_optim.cli.loop import config as _config
  from t5x_optim.cli.loop import train as _train  # noqa: PLC0415
  from t5x_optim.cli.loop.interrupt import Interrupt  # noqa: PLC0415

  _config.parse_config(
    gin_bindings=[
      f"TOTAL_STEPS = {args.steps}",
      "cli.TrainJob.eval_every = 1000000",
      "cli.TrainJob.checkpoint_every = 1000000",
    ],
    macros=_config.device_macros(jax.device_count()),
  )
  setup = _train.prepare(_config.build_job())
  task = setup.job.task
  one_in_flight = jax.devices()[0].platform == "cpu"

  def cli_loop() -> float:
    with tempfile.TemporaryDirectory() as model_dir:
      summary = _train.train(
        setup, model_dir=model_dir, interrupt=Interrupt(), stream=io.StringIO()
      )
    return summary.timed_steps / summary.timed_seconds

  def bare_loop() -> float:
    state = setup.create(*setup.init_args)
    state, metrics = setup.step_fn(state, task.batch(0))
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    for step in range(1, args.steps):
      state, metrics = setup.step_fn(state, task.batch(step))
      if one_in_flight:
        jax.block_until_ready(metrics)
    jax.block_until_ready((state, metrics))
    return (args.steps - 1) / (time.perf_counter() - start)

  cli_rates, bare_rates, ratios = [], [], []
  for round_index in range(args.rounds + 1):
    order = (cli_loop, bare_loop) if round_index % 2 else (bare_loop, cli_loop)
    rates = {fn.__name__: fn() for fn in order}
    if round_index:
      cli_rates.append(rates["cli_loop"])
      bare_rates.append(rates["bare_loop"])
      ratios.append(rates["cli_loop"] / rates["bare_loop"])
  mesh = " x ".join(f"{k}={v}" for k, v in setup.job.partitioner.mesh.shape.items())
  print(
    f"default job, {args.steps} steps, mesh {mesh} ({jax.devices()[0].platform}), "
    f"{args.rounds} rounds"
  )
  print(f"{'side':<12}{'median steps/s':>16}{'best steps/s':>14}")
  print(f"{'t5x-optim':<12}{statistics.median(cli_rates):>16.1f}{max(cli_rates):>14.1f}")
  print(f"{'bare loop':<12}{statistics.median(bare_rates):>16.1f}{max(bare_rates):>14.1f}")
  print(f"ratio t5x-optim / bare (median of rounds): {statistics.median(ratios):.3f}")


if __name__ == "__main__":
  main()
