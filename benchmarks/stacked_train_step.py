"""A whole training step with per-leaf params against `stack_params`.

``update_bandwidth.py`` times the optimizer update alone, given gradients.
This times what a training step pays for keeping the params stacked: the
model reads its per-leaf params as slices of the buffers
(`StackedParams.unstack`), and the backward pass writes their gradients
into the stacked layout (the transpose of the slicing is one concatenation
per buffer). The model is an unscanned T5-v1.1-like tree (the shapes of
``update_bandwidth.py``) in which every 2-D leaf multiplies a small batch of
activations, so each gradient leaf is a matmul output as in a real model,
and every vector leaf scales one.

  python benchmarks/stacked_train_step.py                    # scale 0.25, adamw and lion
  python benchmarks/stacked_train_step.py --scale 0.05 --batch 16

Variants: ``per_leaf`` (plain optax on the per-leaf params, the reference),
``wrapper`` (the same through `OptaxWrapper`) and ``stacked``
(``OptaxWrapper(tx).create(stack_params(params, tx=tx))``, gradients taken
with respect to the stacked params). Times are medians over ``--repeats``
rounds, each round running every variant once, in ``--variants`` order; "compile" is
trace + compile; "exact" compares the params after one step with the first of
``--variants`` (``per_leaf`` by default) bit for bit.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from update_bandwidth import OPTIMIZERS, T5_SIZES, random_tree, timed, tree_shapes

from t5x_optim import OptaxWrapper, stack_params

VARIANTS = ("per_leaf", "wrapper", "stacked")


def make_loss(params: Any, batch: int) -> Callable[[Any], jax.Array]:
  """A loss that reads every leaf once: a matmul for 2-D leaves, a scale for vectors."""
  leaves = jax.tree.leaves(params)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  inputs = [
    jax.random.normal(k, (batch, leaf.shape[0]), jnp.float32) for k, leaf in zip(keys, leaves)
  ]

  def loss(tree: Any) -> jax.Array:
    total = jnp.zeros((), jnp.float32)
    for x, w in zip(inputs, jax.tree.leaves(tree), strict=True):
      total = total + jnp.sum(jnp.tanh(x @ w if w.ndim == 2 else x * w))
    return total

  return loss


def make_step(name: str, tx: optax.GradientTransformation, params: Any, loss) -> tuple:
  """The jitted, donated step of one variant, its input, and a reader of its params."""
  if name == "per_leaf":

    def per_leaf(carry):
      p, s = carry
      updates, s = tx.update(jax.grad(loss)(p), s, p)
      return optax.apply_updates(p, updates), s

    return per_leaf, (params, tx.init(params)), lambda out: out[0]
  if name == "wrapper":
    return (
      lambda opt: opt.apply_gradient(jax.grad(loss)(opt.target)),
      OptaxWrapper(tx).create(params),
      lambda opt: opt.target,
    )
  if name == "stacked":
    return (
      lambda opt: opt.apply_gradient(jax.grad(lambda s: loss(s.unstack()))(opt.target)),
      OptaxWrapper(tx).create(stack_params(params, tx=tx)),
      lambda opt: opt.target.unstack(),
    )
  raise ValueError(f"Unknown variant {name!r}; the variants are {VARIANTS}.")


def measure(tree: str, opt: str, args: argparse.Namespace) -> list[dict[str, Any]]:
  params = random_tree(tree_shapes(tree, args.scale), 0, 0.02)
  loss = make_loss(params, args.batch)
  tx = OPTIMIZERS[opt]()
  runs = {}
  for name in args.variants:
    fn, state, read = make_step(name, tx, jax.tree.map(jnp.copy, params), loss)
    compile_s, compiled = timed(lambda: jax.jit(fn, donate_argnums=0).lower(state).compile())
    state = compiled(state)
    first = jax.device_get(read(state))
    runs[name] = {"compiled": compiled, "state": state, "compile": compile_s, "first": first}
  times = {name: [] for name in runs}
  for _ in range(args.repeats):
    for name, run in runs.items():
      elapsed, run["state"] = timed(lambda: run["compiled"](run["state"]))
      times[name].append(elapsed)
  reference = runs[args.variants[0]]
  rows = []
  for name, run in runs.items():
    step = statistics.median(times[name])
    exact = all(
      np.array_equal(a, b)
      for a, b in zip(jax.tree.leaves(run["first"]), jax.tree.leaves(reference["first"]))
    )
    rows.append(
      {
        "tree": tree,
        "opt": opt,
        "variant": name,
        "params": sum(x.size for x in jax.tree.leaves(params)),
        "leaves": len(jax.tree.leaves(params)),
        "step": step,
        "speedup": statistics.median(times[args.variants[0]]) / step,
        "compile": run["compile"],
        "compile_x": run["compile"] / reference["compile"],
        "exact": exact,
      }
    )
  return rows


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--scale", type=float, default=0.25, help="width scale of the T5 trees")
  parser.add_argument("--batch", type=int, default=8, help="rows of activations per leaf")
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--trees", nargs="+", default=list(T5_SIZES), choices=list(T5_SIZES))
  parser.add_argument("--optimizers", nargs="+", default=["adamw", "lion"], choices=OPTIMIZERS)
  parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
  args = parser.parse_args()
  print(f"backend {jax.default_backend()}, {jax.device_count()} device(s), scale {args.scale}")
  header = (
    f"{'tree':14} {'opt':6} {'variant':9} {'params':>7} {'leaves':>6} {'step ms':>8} "
    f"{'speedup':>8} {'compile s':>9} {'compile x':>9} {'exact':>5}"
  )
  print(header)
  for tree in args.trees:
    for opt in args.optimizers:
      for r in measure(tree, opt, args):
        print(
          f"{r['tree']:14} {r['opt']:6} {r['variant']:9} {r['params'] / 1e6:6.1f}M "
          f"{r['leaves']:6d} {r['step'] * 1e3:8.2f} {r['speedup']:7.2f}x {r['compile']:9.2f} "
          f"{r['compile_x']:8.2f}x {'yes' if r['exact'] else 'NO':>5}"
        )


if __name__ == "__main__":
  main()
