"""Benchmark: switching optimizers mid-run, with the old state reset or converted.

The main job's model (`t5x-optim train`'s default transformer) on the text task
(``--data``, default the shipped ``hamlet.txt``: a byte-level LM, vocabulary 256;
``--synthetic`` for the synthetic task, vocabulary 32) trains with Adafactor (as ``optimizers/adafactor.gin`` configures
it, at a constant learning rate) for ``--before`` steps; then AdamW takes over with a
constant learning rate and no new warmup, in three runs from the same params:

* ``reset``: AdamW's state starts from zeros (T5X's answer: drop the old state);
* ``converted``: AdamW's state comes from `t5x_optim.convert_state` (Adam's ``nu``
  from Adafactor's factored second moment, the count carried; ``mu`` from Adafactor's
  momentum with ``--adafactor_momentum``, else it starts at zero);
* ``continued``: Adafactor goes on (no switch), for reference.

The reverse switch (AdamW first, then Adafactor) runs the same way. For each
run the table gives, over the ``--after`` steps after the switch, the peak excess
of the train loss (a 5-step moving average) over the pre-switch loss (the mean
of the last 10 steps before it), the area of the excess (the sum over steps of
the loss above the pre-switch loss), and the final loss (mean of the last 10
steps), each the mean over ``--seeds`` seeds (model init and task). The same
batches feed every run of a seed. The curves go to ``--png``.

Run: ``python benchmarks/optimizer_switch.py [--before 400] [--after 100] [--seeds 2]
[--adamw_lr 1e-2] [--adafactor_momentum 0.9] [--data PATH | --synthetic]``.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import t5x_optim  # noqa: E402
from t5x_optim import OptaxWrapper  # noqa: E402
from t5x_optim.cli.demo.model import (  # noqa: E402
  SyntheticTask,
  TransformerConfig,
  TransformerLM,
  cross_entropy_loss,
)
from t5x_optim.cli.demo.text import TextTask  # noqa: E402

SMOOTH, PRE = 5, 10
SYNTHETIC_VOCAB_SIZE = 32  # the main job's synthetic task (t5x-optim's default config)


def _parse() -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--before", type=int, default=400, help="steps before the switch")
  parser.add_argument("--after", type=int, default=100, help="steps after the switch")
  parser.add_argument("--seeds", type=int, default=2)
  parser.add_argument("--adafactor_lr", type=float, default=1e-2)
  parser.add_argument("--adamw_lr", type=float, default=1e-2)
  parser.add_argument(
    "--adafactor_momentum",
    type=float,
    default=None,
    help="Adafactor's momentum (optax's EmaState; default: none, as optimizers/adafactor.gin)",
  )
  parser.add_argument("--data", default="hamlet.txt", help="text file or directory")
  parser.add_argument("--synthetic", action="store_true", help="the synthetic task instead")
  parser.add_argument(
    "--png",
    default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "optimizer_switch.png"),
  )
  args = parser.parse_args()
  if args.after < PRE:
    # The final loss averages the last PRE steps, the peak a window of SMOOTH.
    parser.error(f"--after must be at least {PRE}, got {args.after}.")
  return args


def _optimizers(args: argparse.Namespace) -> dict[str, t5x_optim.OptimizerDef]:
  return {
    "adafactor": OptaxWrapper(
      optax.adafactor(
        args.adafactor_lr,
        clipping_threshold=1.0,
        multiply_by_parameter_scale=False,
        min_dim_size_to_factor=32,
        momentum=args.adafactor_momentum,
      )
    ),
    "adamw": OptaxWrapper(optax.adamw(args.adamw_lr, weight_decay=1e-4)),
  }


def _hparams(args: argparse.Namespace) -> dict[str, dict[str, float]]:
  """What each optimizer's state does not hold and its converter reads (Adafactor's momentum)."""
  adafactor = {"learning_rate": args.adafactor_lr, "multiply_by_parameter_scale": False}
  if args.adafactor_momentum is not None:
    adafactor["momentum"] = args.adafactor_momentum
  return {"adafactor": adafactor, "adamw": {}}


def _runner(model: TransformerLM):
  """``run(opt, batches) -> (opt, losses)``: one jitted scan over the stacked batches."""

  def step(opt, batch):
    def loss_fn(params):
      return cross_entropy_loss(model.apply({"params": params}, batch["inputs"]), batch["targets"])

    loss, grads = jax.value_and_grad(loss_fn)(opt.target)
    return opt.apply_gradient(grads), loss

  return jax.jit(lambda opt, batches: jax.lax.scan(step, opt, batches))


def _task(args: argparse.Namespace, seed: int) -> SyntheticTask | TextTask:
  if args.synthetic:
    return SyntheticTask(vocab_size=SYNTHETIC_VOCAB_SIZE, seed=seed)
  return TextTask(path=args.data, seed=seed)


def _batches(task: SyntheticTask | TextTask, start: int, count: int) -> dict[str, jax.Array]:
  batches = [task.batch(step) for step in range(start, start + count)]
  return {key: jnp.stack([b[key] for b in batches]) for key in batches[0]}


def _metrics(pre: np.ndarray, after: np.ndarray) -> dict[str, float]:
  baseline = float(np.mean(pre[-PRE:]))
  smooth = np.convolve(after, np.ones(SMOOTH) / SMOOTH, mode="valid")
  return {
    "peak": float(np.max(smooth) - baseline),
    "area": float(np.sum(np.maximum(after - baseline, 0.0))),
    "final": float(np.mean(after[-PRE:])),
  }


def _switch(args, seed: int, first: str, second: str) -> dict[str, np.ndarray]:
  """Loss curves of one seed: the first optimizer's steps, then each run after the switch."""
  defs = _optimizers(args)
  task = _task(args, seed)
  model = TransformerLM(TransformerConfig(vocab_size=task.vocab_size))
  params = model.init(jax.random.key(seed), jnp.zeros((1, task.length), jnp.int32))["params"]
  run = _runner(model)
  old, pre = run(defs[first].create(params), _batches(task, 0, args.before))
  after_batches = _batches(task, args.before, args.after)
  fresh = defs[second].create(old.target)
  fresh = fresh.replace(state=fresh.state.replace(step=old.state.step))
  hparams = _hparams(args)
  converted, report = t5x_optim.convert_state(
    old, defs[second], source_hparams=hparams[first], target_hparams=hparams[second],
    missing="init",
  )  # fmt: skip
  if seed == 0:
    print(f"{first} -> {second}: {report}\n")
  curves = {"before": np.asarray(pre)}
  for name, opt in (("reset", fresh), ("converted", converted), ("continued", old)):
    curves[name] = np.asarray(run(opt, after_batches)[1])
  return curves


def _plot(path: str, results: dict[str, list[dict[str, np.ndarray]]], before: int) -> None:
  import matplotlib  # noqa: PLC0415 - only the benchmark needs it

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), sharey=True)
  colors = {"reset": "tab:red", "converted": "tab:green", "continued": "tab:gray"}
  for ax, (title, seeds) in zip(np.atleast_1d(axes), results.items(), strict=True):
    shown = 60
    pre = np.mean([s["before"] for s in seeds], axis=0)
    ax.plot(range(before - shown, before), pre[-shown:], color="black", label="before the switch")
    for name, color in colors.items():
      curve = np.mean([s[name] for s in seeds], axis=0)
      smooth = np.convolve(curve, np.ones(SMOOTH) / SMOOTH, mode="valid")
      steps = range(before + SMOOTH - 1, before + len(curve))
      ax.plot(steps, smooth, color=color, label=name)
    ax.axvline(before, color="black", linestyle=":", linewidth=1)
    ax.set_title(f"{title} (mean of {len(seeds)} seeds, {SMOOTH}-step average)")
    ax.set_xlabel("step")
    ax.legend()
  np.atleast_1d(axes)[0].set_ylabel("train loss")
  fig.tight_layout()
  fig.savefig(path, dpi=100)


def main() -> None:
  args = _parse()
  start = time.perf_counter()
  results = {}
  for first, second in (("adafactor", "adamw"), ("adamw", "adafactor")):
    title = f"{first} -> {second}"
    results[title] = [_switch(args, seed, first, second) for seed in range(args.seeds)]
  data = "synthetic task" if args.synthetic else f"text task ({args.data})"
  print(
    f"{data}: {args.before} steps before the switch, {args.after} after; mean of "
    f"{args.seeds} seeds; "
    f"adafactor lr {args.adafactor_lr} (momentum {args.adafactor_momentum}), "
    f"adamw lr {args.adamw_lr} (constant, no warmup)\n"
  )
  print("| switch | run | peak excess | area | final loss | pre-switch loss |")
  print("|---|---|---|---|---|---|")
  for title, seeds in results.items():
    pre = np.mean([np.mean(s["before"][-PRE:]) for s in seeds])
    for name in ("reset", "converted", "continued"):
      values = [_metrics(s["before"], s[name]) for s in seeds]
      mean = {key: np.mean([v[key] for v in values]) for key in values[0]}
      run = name if name != "continued" else f"continued ({title.split(' ')[0]})"
      print(
        f"| {title} | {run} | {mean['peak']:+.3f} | {mean['area']:.2f} | "
        f"{mean['final']:.3f} | {pre:.3f} |"
      )
  _plot(args.png, results, args.before)
  print(f"\nwrote {args.png} ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
  main()
