"""Benchmark: MultiOptimizer against the equivalent `optax.multi_transform`.

On a param tree of about 7,000 small leaves (1,000 layers of 7 params), with
2 and 8 sub-optimizers, prints for each:

* ``partition``: computing the split of leaf paths between sub-optimizers
  (once per tree structure; paid by ``create``);
* ``compile``: trace + lower + compile of one jitted step, MultiOptimizer
  (``Optimizer.apply_gradient``) and plain optax (``update`` +
  ``apply_updates``), in ``--compile-pairs`` interleaved pairs (one by
  default: a 7,000-leaf step takes minutes to compile on CPU); the ratio is
  the median of the per-pair ratios;
* ``step``: one compiled step, in interleaved pairs of ``--steps`` steps
  each; median ratio again.

Both sides give frozen params (matched by no filter) no state: optax through
``optax.set_to_zero()``. Targets: step ratio <= 1.02, compile ratio <= 1.2.

Run: ``python benchmarks/multi_optimizer.py [--leaves 7000] [--pairs 15]
[--compile-pairs 1] [--steps 10]``.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from t5x_optim import MultiOptimizer, OptaxWrapper, Optimizer, PathFilter  # noqa: E402

LAYER = {
  "attention": {"query": (16, 8), "key": (16, 8), "value": (16, 8), "out": (8, 16)},
  "mlp": {"wi": (16, 32), "bias": (32,)},
  "layer_norm": {"scale": (16,)},
}
FACTORIES = (
  lambda: optax.adam(1e-3),
  lambda: optax.sgd(1e-2, momentum=0.9),
  lambda: optax.adamw(1e-3),
  lambda: optax.lion(1e-4),
  lambda: optax.rmsprop(1e-3),
  lambda: optax.adagrad(1e-2),
  lambda: optax.sgd(1e-2),
  lambda: optax.adabelief(1e-3),
)


def make_params(num_leaves: int) -> dict[str, Any]:
  """About `num_leaves` float32 leaves in layers of seven."""
  per_layer = len(jax.tree.leaves(LAYER, is_leaf=lambda x: isinstance(x, tuple)))
  keys = iter(jax.random.split(jax.random.key(0), per_layer))

  def is_shape(x):
    return isinstance(x, tuple)

  layer = jax.tree.map(lambda shape: jax.random.normal(next(keys), shape), LAYER, is_leaf=is_shape)
  return {f"layer_{i:04d}": layer for i in range(num_leaves // per_layer)}


def group_patterns(num_groups: int) -> list[str]:
  """Path regexes for the groups; the params they leave out are frozen."""
  if num_groups == 2:
    return ["/attention/", "/mlp/"]
  return [rf"^layer_\d*{digit}/" for digit in range(num_groups)]


def path_str(path: jax.tree_util.KeyPath) -> str:
  return "/".join(str(k.key) for k in path)


def optax_labels(patterns: list[str]) -> Callable[[Any], Any]:
  def label(path: jax.tree_util.KeyPath, _: Any) -> str:
    text = path_str(path)
    return next((str(i) for i, p in enumerate(patterns) if re.search(p, text)), "frozen")

  return lambda params: jax.tree.map_with_path(label, params)


def optax_step(tx: optax.GradientTransformation) -> Callable[..., Any]:
  def step(params: Any, state: Any, grads: Any) -> tuple[Any, Any]:
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


def multi_step(opt: Optimizer, grads: Any) -> Optimizer:
  return opt.apply_gradient(grads)


def seconds(fn: Callable[[], Any]) -> float:
  start = time.perf_counter()
  jax.block_until_ready(fn())
  return time.perf_counter() - start


def compile_timed(fn: Callable[..., Any], *args: Any) -> tuple[float, Any]:
  """Trace + lower + compile of a fresh jit of `fn` (no jit cache reuse)."""
  fresh = jax.jit(lambda *a: fn(*a))
  start = time.perf_counter()
  compiled = fresh.lower(*args).compile()
  return time.perf_counter() - start, compiled


def run_steps(compiled: Callable[..., Any], args: tuple[Any, ...], steps: int) -> Callable[[], Any]:
  def run() -> Any:
    out = None
    for _ in range(steps):
      out = compiled(*args)
    return out

  return run


def median_ratio(multi: list[float], plain: list[float]) -> float:
  return statistics.median(m / p for m, p in zip(multi, plain))


def bench(
  params: Any, num_groups: int, *, pairs: int, compile_pairs: int, steps: int
) -> dict[str, float]:
  patterns = group_patterns(num_groups)
  factories = FACTORIES[:num_groups]
  opt_def = MultiOptimizer(
    [(PathFilter(p), OptaxWrapper(f())) for p, f in zip(patterns, factories)]
  )
  transforms = {str(i): f() for i, f in enumerate(factories)}
  tx = optax.multi_transform({**transforms, "frozen": optax.set_to_zero()}, optax_labels(patterns))
  grads = jax.tree.map(jnp.ones_like, params)

  start = time.perf_counter()
  opt_def._partition(params)  # pylint: disable=protected-access
  partition = time.perf_counter() - start
  opt = opt_def.create(params)
  state = tx.init(params)

  compile_multi, compile_plain = [], []
  for _ in range(compile_pairs):
    seconds_multi, multi = compile_timed(multi_step, opt, grads)
    seconds_plain, plain = compile_timed(optax_step(tx), params, state, grads)
    compile_multi.append(seconds_multi)
    compile_plain.append(seconds_plain)
  run_multi = run_steps(multi, (opt, grads), steps)
  run_plain = run_steps(plain, (params, state, grads), steps)
  seconds(run_multi), seconds(run_plain)
  step_multi, step_plain = [], []
  for _ in range(pairs):
    step_multi.append(seconds(run_multi) / steps)
    step_plain.append(seconds(run_plain) / steps)
  return {
    "partition": partition,
    "compile_multi": statistics.median(compile_multi),
    "compile_plain": statistics.median(compile_plain),
    "compile_ratio": median_ratio(compile_multi, compile_plain),
    "step_multi": statistics.median(step_multi),
    "step_plain": statistics.median(step_plain),
    "step_ratio": median_ratio(step_multi, step_plain),
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--leaves", type=int, default=7000)
  parser.add_argument("--pairs", type=int, default=15)
  parser.add_argument("--compile-pairs", type=int, default=1)
  parser.add_argument("--steps", type=int, default=10)
  args = parser.parse_args()
  params = make_params(args.leaves)
  print(f"{len(jax.tree.leaves(params))} leaves, jax {jax.__version__}, optax {optax.__version__}")
  header = (
    f"{'subopts':>7} {'partition s':>11} {'compile multi s':>16} {'compile optax s':>16} "
    f"{'ratio':>6} {'step multi ms':>14} {'step optax ms':>14} {'ratio':>6}"
  )
  print(header)
  print("-" * len(header))
  for num_groups in (2, 8):
    r = bench(
      params, num_groups, pairs=args.pairs, compile_pairs=args.compile_pairs, steps=args.steps
    )
    print(
      f"{num_groups:>7} {r['partition']:>11.3f} {r['compile_multi']:>16.2f} "
      f"{r['compile_plain']:>16.2f} {r['compile_ratio']:>6.3f} {1e3 * r['step_multi']:>14.2f} "
      f"{1e3 * r['step_plain']:>14.2f} {r['step_ratio']:>6.3f}"
    )


if __name__ == "__main__":
  main()
