"""Benchmark: schedule-free AdamW regrouped mid-run, going on or restarted from its average.

The main job's model (`t5x-optim train`'s default transformer) on the text task (``--data``,
default the shipped ``hamlet.txt``) trains with ``optax.contrib.schedule_free_adamw`` over
all its params (one state, weight decay everywhere) for ``--before`` steps. Then the same
optimizer takes over as two `MultiOptimizer` groups, the norms' scales without weight decay
and the rest with it (the usual reason to regroup), in three runs from the same state:

* ``regrouped``: `t5x_optim.convert_state` splits the one state into the two groups, each
  going on from its params' ``y``, ``z``, ``weight_sum`` and ``max_lr``;
* ``restarted``: what ``convert_state(..., missing="init")`` gave before a state could be
  split (`_restarted`): the params start from schedule-free's average ``x``, with ``z = x``
  and the average's weights at zero, Adam's second moment and the step count carried;
* ``continued``: the one state goes on (no regrouping), for reference.

For each run: the eval loss at schedule-free's average ``x`` (the params it is evaluated
at, `t5x_optim.schedule_free_evaluation_params`) on ``--eval_batches`` held-out batches,
right after the switch and at the end, and the area of the train loss above the continued
run's over the steps after the switch; each the mean over ``--seeds`` seeds. Also the time
of the conversion (best of 3), beside a fresh ``create`` of the groups as the baseline.

Run: ``python benchmarks/schedule_free_regroup.py [--before 300] [--after 100] [--seeds 2]``.
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
from flax import linen as nn  # noqa: E402

import t5x_optim  # noqa: E402
from t5x_optim import MultiOptimizer, OptaxWrapper, PathFilter  # noqa: E402
from t5x_optim.cli.demo.model import TransformerConfig, TransformerLM, cross_entropy_loss  # noqa: E402
from t5x_optim.cli.demo.text import TextTask  # noqa: E402

RUNS = ("regrouped", "restarted", "continued")


def _parse() -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--before", type=int, default=300, help="steps before the regrouping")
  parser.add_argument("--after", type=int, default=100, help="steps after it")
  parser.add_argument("--seeds", type=int, default=2)
  parser.add_argument("--lr", type=float, default=1e-2)
  parser.add_argument("--warmup", type=int, default=50)
  parser.add_argument("--weight_decay", type=float, default=1e-2)
  parser.add_argument("--eval_batches", type=int, default=20)
  parser.add_argument("--data", default="hamlet.txt", help="text file or directory")
  return parser.parse_args()


def _free(args: argparse.Namespace, weight_decay: float) -> optax.GradientTransformation:
  return optax.contrib.schedule_free_adamw(
    args.lr, warmup_steps=args.warmup, weight_decay=weight_decay
  )


def _grouped(args: argparse.Namespace) -> MultiOptimizer:
  """The norms' scales without weight decay, the rest with it."""
  return MultiOptimizer(
    [
      (PathFilter(r"scale$"), OptaxWrapper(_free(args, 0.0))),
      (PathFilter(r"scale$", invert=True), OptaxWrapper(_free(args, args.weight_decay))),
    ]
  )


def _restarted(opt: t5x_optim.Optimizer) -> t5x_optim.Optimizer:
  """`opt` (schedule-free groups) restarted at its average: params and each ``z`` at ``x``,
  ``weight_sum`` and ``max_lr`` at zero."""
  x = t5x_optim.schedule_free_evaluation_params(opt.state.param_states, opt.target)
  kind = optax.contrib.ScheduleFreeState

  def restart(node):
    if not isinstance(node, kind):
      return node
    return node._replace(
      z=_subset(x, node.z),
      weight_sum=jnp.zeros_like(node.weight_sum),
      max_lr=jnp.zeros_like(node.max_lr),
    )

  states = jax.tree.map(restart, opt.state.param_states, is_leaf=lambda n: isinstance(n, kind))
  return opt.replace(target=x, state=opt.state.replace(param_states=states))


def _subset(tree, like):
  """`tree`'s leaves at the paths of `like`'s, in `like`'s structure."""
  flat = {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree.flatten_with_path(tree)[0]}
  paths, treedef = jax.tree.flatten_with_path(like)
  return jax.tree.unflatten(treedef, [flat[jax.tree_util.keystr(path)] for path, _ in paths])


def _batches(task: TextTask, start: int, count: int) -> dict[str, jax.Array]:
  batches = [task.batch(step) for step in range(start, start + count)]
  return {key: jnp.stack([b[key] for b in batches]) for key in batches[0]}


def _best_of_3(fn) -> float:
  times = []
  for _ in range(3):
    start = time.perf_counter()
    jax.block_until_ready(jax.tree.leaves(fn()))
    times.append(time.perf_counter() - start)
  return min(times)


def _seed(args: argparse.Namespace, seed: int) -> dict[str, dict[str, float]]:
  task = TextTask(path=args.data, seed=seed)
  model = TransformerLM(TransformerConfig(vocab_size=task.vocab_size))
  variables = model.init(jax.random.key(seed), jnp.zeros((1, task.length), jnp.int32))
  params = nn.unbox(variables["params"])  # MultiOptimizer takes plain (or frozen) dicts.

  def loss_of(params, batch):
    return cross_entropy_loss(model.apply({"params": params}, batch["inputs"]), batch["targets"])

  def step(opt, batch):
    loss, grads = jax.value_and_grad(loss_of)(opt.target, batch)
    return opt.apply_gradient(grads), loss

  run = jax.jit(lambda opt, batches: jax.lax.scan(step, opt, batches))
  held_out = _batches(task, 10**6, args.eval_batches)

  @jax.jit
  def eval_loss(opt):
    x = t5x_optim.schedule_free_evaluation_params(opt.state.param_states, opt.target)
    return jnp.mean(jax.lax.map(lambda batch: loss_of(x, batch), held_out))

  whole = OptaxWrapper(_free(args, args.weight_decay))
  old, _ = run(whole.create(params), _batches(task, 0, args.before))
  after = _batches(task, args.before, args.after)
  grouped = _grouped(args)
  starts = {
    "regrouped": lambda: t5x_optim.convert_state(old, grouped)[0],
    "restarted": lambda: _restarted(t5x_optim.convert_state(old, grouped)[0]),
    "continued": lambda: old,
  }
  seconds = {
    "convert_state into the groups": _best_of_3(starts["regrouped"]),
    "the groups' create (baseline)": _best_of_3(lambda: grouped.create(old.target)),
  }
  curves, result = {}, {}
  for name, start in starts.items():
    opt = start()
    first = float(eval_loss(opt))
    opt, losses = run(opt, after)
    curves[name] = np.asarray(losses)
    result[name] = {"eval at switch": first, "eval at end": float(eval_loss(opt))}
  for name in RUNS:
    excess = np.maximum(curves[name] - curves["continued"], 0.0)
    result[name]["area"] = float(np.sum(excess))
  result["seconds"] = seconds
  return result


def main() -> None:
  args = _parse()
  start = time.perf_counter()
  seeds = [_seed(args, seed) for seed in range(args.seeds)]
  print(
    f"text task ({args.data}): schedule_free_adamw lr {args.lr}, warmup {args.warmup}, "
    f"weight decay {args.weight_decay}; {args.before} steps as one state, then {args.after} "
    f"as two groups (norm scales without weight decay); mean of {args.seeds} seeds\n"
  )
  print(
    "| run | eval loss at x, at the switch | eval loss at x, at the end | train loss area above continued |"
  )
  print("|---|---|---|---|")
  for name in RUNS:
    mean = {key: np.mean([s[name][key] for s in seeds]) for key in seeds[0][name]}
    print(
      f"| {name} | {mean['eval at switch']:.4f} | {mean['eval at end']:.4f} | {mean['area']:.2f} |"
    )
  print("\n| conversion | seconds (best of 3, mean of seeds) |\n|---|---|")
  for name in seeds[0]["seconds"]:
    print(f"| {name} | {np.mean([s['seconds'][name] for s in seeds]):.3f} |")
  print(f"\n({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
  main()
