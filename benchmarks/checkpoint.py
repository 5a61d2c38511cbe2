"""Benchmark: `Checkpointer` save/restore throughput against raw orbax.

An adamw `TrainState` of about 200MB (params, `mu` and `nu`: three copies of
``--layers`` 2048x2048 float32 matrices) is sharded over a 2x4 mesh of 8
simulated CPU devices (optimizer state also over ``data``). Each round
times, on fresh directories:

* ``Checkpointer``: ``save`` + ``wait_until_finished``, then ``restore`` into
  the abstract train state (``abstract_train_state``), metadata validation
  included;
* ``orbax``: ``ocp.StandardCheckpointer`` saving the same state dict (the
  same pytree of sharded arrays) + ``wait_until_finished``, then restoring
  it into the same ``ShapeDtypeStruct``s with shardings.

The order alternates between rounds so neither side always runs on a warm
page cache. The table gives the median time over rounds, the MB/s of the
median and of the best round (MB = 1e6 bytes); the ratio is Checkpointer
MB/s over orbax MB/s. Target: >= 0.9.

Run: ``python benchmarks/checkpoint.py [--layers 4] [--rounds 5] [--dir DIR]``.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

from t5x_optim import optimizers  # noqa: E402
from t5x_optim.checkpoints import Checkpointer  # noqa: E402
from t5x_optim.partitioning import (  # noqa: E402
    Partitioner,
    abstract_train_state,
    create_mesh,
    init_sharded,
    standard_logical_axis_rules,
)

DIM = 2048


def init_fn(layers: int) -> dict:
  """`layers` DIM x DIM kernels with logical axes."""
  return {
      "params": {
          f"layer_{i}": nn.LogicallyPartitioned(
              jnp.full((DIM, DIM), 0.01 * (i + 1), jnp.float32), ("embed", "mlp")
          )
          for i in range(layers)
      }
  }


def _bytes(tree) -> int:
  return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


def _timed(fn: Callable[[], object]) -> float:
  start = time.perf_counter()
  jax.block_until_ready(fn())
  return time.perf_counter() - start


def _ours(state, abstract, directory: str) -> tuple[float, float]:
  with Checkpointer(directory) as ckpt:
    save = _timed(lambda: (ckpt.save(1, state), ckpt.wait_until_finished()))
    restore = _timed(lambda: ckpt.restore(abstract).state_dict())
  return save, restore


def _orbax(state_dict, abstract_dict, directory: str) -> tuple[float, float]:
  path = os.path.join(directory, "raw")
  with ocp.StandardCheckpointer() as ckpt:
    save = _timed(lambda: (ckpt.save(path, state_dict), ckpt.wait_until_finished()))
    restore = _timed(lambda: ckpt.restore(path, abstract_dict))
  return save, restore


def run(layers: int, rounds: int, root: str) -> None:
  part = Partitioner(
      create_mesh(shape={"data": 2, "model": 4}),
      standard_logical_axis_rules(shard_optimizer_state_over_data=True),
  )
  opt_def, init = optimizers.adamw(1e-3), functools.partial(init_fn, layers)
  state = init_sharded(part, opt_def, init)
  abstract = abstract_train_state(part, opt_def, init)
  state_dict, abstract_dict = state.state_dict(), abstract.state_dict()
  megabytes = _bytes(state_dict) / 1e6
  sides = {
      "Checkpointer": lambda d: _ours(state, abstract, d),
      "orbax": lambda d: _orbax(state_dict, abstract_dict, d),
  }
  times = {name: ([], []) for name in sides}
  for i in range(rounds + 1):
    order = list(sides) if i % 2 == 0 else list(reversed(sides))
    for name in order:
      directory = tempfile.mkdtemp(dir=root)
      save, restore = sides[name](directory)
      shutil.rmtree(directory)
      if i:
        times[name][0].append(save)
        times[name][1].append(restore)
  print(f"adamw state: {megabytes:.1f} MB, {len(jax.tree.leaves(state_dict))} leaves, "
        f"mesh 2x4 (8 CPU devices), {rounds} rounds after 1 warm-up")
  print(f"{'':14}{'save s':>9}{'save MB/s':>11}{'best MB/s':>11}"
        f"{'restore s':>11}{'restore MB/s':>14}{'best MB/s':>11}")
  rates = {}
  for name, (saves, restores) in times.items():
    save, restore = statistics.median(saves), statistics.median(restores)
    rates[name] = tuple(megabytes / t for t in (save, min(saves), restore, min(restores)))
    print(f"{name:14}{save:9.3f}{rates[name][0]:11.0f}{rates[name][1]:11.0f}"
          f"{restore:11.3f}{rates[name][2]:14.0f}{rates[name][3]:11.0f}")
  ratio = [ours / raw for ours, raw in zip(rates["Checkpointer"], rates["orbax"])]
  print(f"{'ratio':14}{'':9}{ratio[0]:11.2f}{ratio[1]:11.2f}{'':11}{ratio[2]:14.2f}{ratio[3]:11.2f}")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=int, default=4, help="2048x2048 float32 kernels")
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
  args = parser.parse_args()
  root = tempfile.mkdtemp(dir=args.dir)
  try:
    run(args.layers, args.rounds, root)
  finally:
    shutil.rmtree(root)


if __name__ == "__main__":
  main()
