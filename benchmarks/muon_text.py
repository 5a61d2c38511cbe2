"""Benchmark: Muon against AdamW on the text task, each at its tuned learning rate.

Each run is the `t5x-optim train` job (the transformer on the text task,
``--data``, default the shipped ``hamlet.txt``; ``--larger`` the wider, deeper
model of ``low_precision.py``) with one optimizer gin file:

* ``adamw``: ``optimizers/adamw.gin`` (clip by global norm 1, AdamW);
* ``muon``: ``optimizers/muon.gin`` (Muon on the kernels the logical axes name,
  AdamW on embeddings, logits and scales).

Both share the same schedule (warmup over 10% of the steps, cosine decay), so
the learning rate is the schedule's peak (``peak_value``). First a sweep: one
seed (the first of ``--seeds``) per peak in ``--lrs`` for every optimizer
without a ``--peak NAME=LR``; each optimizer's best final eval loss picks its
learning rate, and its best run is the first seed's. Then every other seed at
that rate. The runs trained together (the whole sweep; then each seed's) are
interleaved in rounds of ``--eval_every`` steps, so machine load falls on all
of them alike; each step is timed (``block_until_ready``), and the eval loss
is recorded at each round's end.

The table gives per optimizer: the tuned peak, the final eval loss at equal
steps (mean and spread over seeds), the median step time, and the eval loss
at equal wall time. A run's training time at step ``s`` is ``s`` times its
median step time, which a passing load on a shared machine does not move (a
sum of the measured step times does); the equal time is the shorter of the
optimizers' mean training times, where each curve is interpolated linearly.
``--png`` writes the curves against steps and against that time.

Run: ``python benchmarks/muon_text.py [--larger] [--steps 2000] [--seeds 0 1 2]
[--lrs 3e-3 1e-2 3e-2] [--peak adamw=0.01 ...] [--eval_every 100] [--png PATH]
[--data PATH]``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

RUNS = {"adamw": "optimizers/adamw.gin", "muon": "optimizers/muon.gin"}


def _parse() -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--steps", type=int, default=2000)
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  parser.add_argument("--lrs", type=float, nargs="+", default=[3e-3, 1e-2, 3e-2])
  parser.add_argument(
    "--peak",
    nargs="+",
    default=[],
    metavar="NAME=LR",
    help="an optimizer's peak learning rate, instead of sweeping --lrs for it",
  )
  parser.add_argument("--eval_every", type=int, default=100)
  parser.add_argument("--larger", action="store_true", help="low_precision.py's larger model")
  parser.add_argument("--png", default=None, help="write the eval-loss curves here")
  parser.add_argument("--data", default="hamlet.txt", help="text file or directory")
  return parser.parse_args()


class _Run:
  """One optimizer's training run at one peak learning rate and seed."""

  def __init__(self, name: str, lr: float, seed: int, args: argparse.Namespace):
    from low_precision import LARGER  # noqa: PLC0415

    from t5x_optim.cli.loop import config as _config  # noqa: PLC0415
    from t5x_optim.cli.loop import train as _train  # noqa: PLC0415

    _config.parse_config(
      gin_files=[RUNS[name]],
      gin_bindings=[
        f"TOTAL_STEPS = {args.steps}",
        f"cli.TrainJob.seed = {seed}",
        "cli.TrainJob.eval_batches = 8",
        f"optax.cosine_onecycle_schedule.peak_value = {lr}",
        *(LARGER if args.larger else []),
        *_config.data_bindings(args.data),
      ],
      macros=_config.device_macros(1),
    )
    self.name, self.lr, self.seed = name, lr, seed
    self.setup = _train.prepare(_config.build_job())
    self.state = self.setup.create(*self.setup.init_args)
    self.step = 0
    self.times: list[float] = []
    self.curve: list[tuple[int, float]] = []

  def train(self, steps: int) -> None:
    from low_precision import timed_steps  # noqa: PLC0415

    self.state, self.step, times = timed_steps(self.setup, self.state, self.step, steps)
    self.times += times

  def evaluate(self) -> float:
    from t5x_optim.cli.loop import train as _train  # noqa: PLC0415

    loss = _train._evaluate(self.setup, self.state)["loss"]
    self.curve.append((self.step, loss))
    return loss

  @property
  def step_seconds(self) -> float:
    """The median step time (the first, compiling step is not timed)."""
    return statistics.median(self.times)

  @property
  def seconds(self) -> float:
    """The training time of all steps at the median step time."""
    return self.step * self.step_seconds

  @property
  def final(self) -> float:
    return self.curve[-1][1]

  def loss_at(self, seconds: float) -> float:
    """The eval loss at `seconds` of training, interpolated linearly between evals."""
    at = [(step * self.step_seconds, loss) for step, loss in self.curve]
    for (s0, l0), (s1, l1) in zip(at, at[1:], strict=False):
      if s0 <= seconds <= s1:
        return l0 + (l1 - l0) * (seconds - s0) / (s1 - s0) if s1 > s0 else l1
    return self.final


def _train_together(runs: list[_Run], args: argparse.Namespace) -> None:
  for run in runs:
    run.evaluate()
  while any(run.step < args.steps for run in runs):
    for run in runs:
      run.train(min(args.eval_every, args.steps - run.step))
      run.evaluate()


def main() -> None:
  args = _parse()
  import jax  # noqa: PLC0415

  started = time.perf_counter()
  given = {name: float(lr) for name, lr in (peak.split("=") for peak in args.peak)}
  unknown = set(given) - set(RUNS)
  if unknown:
    raise SystemExit(f"--peak: no optimizer {sorted(unknown)}; they are {sorted(RUNS)}")
  print(f"sweep: seed {args.seeds[0]}, {args.steps} steps, peak learning rates {args.lrs}")
  sweep = [
    _Run(name, lr, args.seeds[0], args)
    for name in RUNS
    for lr in ([given[name]] if name in given else args.lrs)
  ]
  _train_together(sweep, args)
  best: dict[str, float] = {}
  runs_of_first_seed: list[_Run] = []
  for name in RUNS:
    tried = [run for run in sweep if run.name == name]
    for run in tried:
      print(f"  {name:<6} peak {run.lr:<8g} eval loss {run.final:.4f}", flush=True)
    finite = [run for run in tried if math.isfinite(run.final)]
    best_run = min(finite, key=lambda run: run.final)
    best[name] = best_run.lr
    runs_of_first_seed.append(best_run)
  runs: dict[str, list[_Run]] = {name: [] for name in RUNS}
  for seed in args.seeds:
    if seed == args.seeds[0]:
      seed_runs = runs_of_first_seed
    else:
      seed_runs = [_Run(name, best[name], seed, args) for name in RUNS]
      _train_together(seed_runs, args)
    for run in seed_runs:
      runs[run.name].append(run)
      print(f"seed {seed} {run.name:<6} eval loss {run.final:.4f}", flush=True)

  budget = min(statistics.mean(r.seconds for r in seeds) for seeds in runs.values())
  model = "larger" if args.larger else "default"
  print(
    f"\n{model} model, text task ({args.data}), {args.steps} steps, seeds {args.seeds}, "
    f"{jax.devices()[0].platform}; equal wall time = {budget:.1f} s of training; "
    f"{time.perf_counter() - started:.0f} s in all"
  )
  print(
    f"{'run':<7}{'peak lr':>9}{'loss @ steps':>14}{'spread':>9}{'loss @ time':>13}"
    f"{'steps @ time':>14}{'ms/step':>9}"
  )
  for name, seeds in runs.items():
    finals = [r.final for r in seeds]
    at_time = statistics.mean(r.loss_at(budget) for r in seeds)
    ms = statistics.mean(r.step_seconds for r in seeds) * 1e3
    steps_at_time = statistics.mean(args.steps * min(1.0, budget / r.seconds) for r in seeds)
    print(
      f"{name:<7}{best[name]:>9g}{statistics.mean(finals):>14.4f}{max(finals) - min(finals):>9.4f}"
      f"{at_time:>13.4f}{steps_at_time:>14.0f}{ms:>9.2f}"
    )
  for name, seeds in runs.items():
    print(f"per seed {name}: " + " / ".join(f"{r.final:.4f}" for r in seeds))
  if args.png:
    _plot(runs, best, args, model)


def _plot(runs: dict[str, list[_Run]], best: dict[str, float], args, model: str) -> None:
  import matplotlib  # noqa: PLC0415

  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # noqa: PLC0415

  fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
  for name, seeds in runs.items():
    n = len(seeds[0].curve)
    steps = [seeds[0].curve[i][0] for i in range(n)]
    seconds = [statistics.mean(step * r.step_seconds for r in seeds) for step in steps]
    mean = [statistics.mean(r.curve[i][1] for r in seeds) for i in range(n)]
    label = f"{name}, peak {best[name]:g} (mean of {len(seeds)} seeds)"
    axes[0].plot(steps[1:], mean[1:], label=label)
    axes[1].plot(seconds[1:], mean[1:], label=label)
  axes[0].set_xlabel("step")
  axes[1].set_xlabel("training seconds (steps x median step time)")
  axes[0].set_ylabel("eval loss")
  axes[0].set_yscale("log")
  for ax in axes:
    ax.legend()
  fig.suptitle(f"Muon vs AdamW, {model} model, text task ({args.data})")
  fig.tight_layout()
  fig.savefig(args.png, dpi=100)
  print(f"curves: {args.png}")


if __name__ == "__main__":
  main()
