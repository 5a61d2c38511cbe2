"""Benchmark: `Checkpointer` save/restore throughput against raw orbax.

An adamw `TrainState` of about 200MB (params, `mu` and `nu`: three copies of
``--layers`` 2048x2048 float32 matrices) is sharded over a 2x4 mesh of 8
simulated CPU devices (optimizer state also over ``data``). With ``--data
random`` (the default) the params are random normal and one adamw step with
random gradients has been taken, so every array holds distinct values, as in
training; ``--data constant`` keeps the initial constant params and zero
`mu` and `nu`, which compress to almost nothing. Two sides:

* ``Checkpointer``: ``save`` + ``wait_until_finished``; ``restore`` of that
  step into the abstract train state (``abstract_train_state``), the
  metadata validation and the integrity checks included: the checksum of
  every array computed on its devices at save time and again, compared, at
  restore time;
* ``orbax``: ``ocp.StandardCheckpointer`` saving the train state's state
  dict (the same leaves, the same sharded arrays) + ``wait_until_finished``;
  restoring it into the same ``ShapeDtypeStruct``s with the same shardings.

Both tell orbax where the checkpoint is (orbax a path, `Checkpointer` its
step); the first round's restored leaf paths and shardings are checked to be
equal on both sides (values by `Checkpointer`'s checksums). Each round saves
both sides to fresh directories, then restores ``--restores`` pairs
back to back; the order alternates between rounds and between pairs, so
neither side always goes first. One warm-up round is not counted. The table
gives the median time and the MB/s of the median and of the best run
(MB = 1e6 bytes); the ratio row is the median over pairs of Checkpointer
MB/s over orbax MB/s (next to it the ratio of the best runs). Target: >= 0.9.

``--small N`` adds N replicated vectors of distinct sizes (64 + i floats), as a
model's scales and biases are. orbax writes a replicated array in one slice per
replica, compiling a slicing program per shape at its first save;
`Checkpointer` writes arrays under 1 MiB a replica whole. The line after the
table gives each side's first save of the state (round 0: compiles included,
Checkpointer first, both after a save of one float that sets up tensorstore and orbax).

Run: ``python benchmarks/checkpoint.py [--layers 4] [--rounds 21] [--restores 4]
[--data random|constant] [--small 0] [--dir DIR]``. The last line gives the cost of the
checksums alone: the median time of computing them for the whole state.
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
from typing import Any

import _cpu_devices  # noqa: F401  (sets the device flags before jax loads)
import flax.linen as nn
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from t5x_optim import TrainState, optimizers
from t5x_optim._checkpoint.checksums import dispatch_checksums, fetch
from t5x_optim._checkpoint.leaves import flatten
from t5x_optim.checkpoints import Checkpointer
from t5x_optim.partitioning import (
  Partitioner,
  abstract_train_state,
  create_mesh,
  init_sharded,
  standard_logical_axis_rules,
)

DIM = 2048


def init_fn(layers: int, *, random: bool, small: int = 0) -> dict:
  """`layers` DIM x DIM kernels with logical axes: random normal, or constants.

  With `small`, also that many replicated vectors of distinct sizes (scales and
  biases: each a few hundred bytes).
  """

  def kernel(i: int) -> jax.Array:
    if random:
      return 0.02 * jax.random.normal(jax.random.key(i), (DIM, DIM), jnp.float32)
    return jnp.full((DIM, DIM), 0.01 * (i + 1), jnp.float32)

  kernels = {
    f"layer_{i}": nn.LogicallyPartitioned(kernel(i), ("embed", "mlp")) for i in range(layers)
  }
  vectors = {f"scale_{i}": jnp.full((64 + i,), 1.0 + i, jnp.float32) for i in range(small)}
  return {"params": kernels | vectors}


def _one_random_step(state: TrainState) -> TrainState:
  """One adamw step with random gradients: `mu` and `nu` become distinct values."""
  keys = jax.random.split(jax.random.key(1000), len(state.params))
  grads = {
    name: jax.random.normal(key, param.shape, param.dtype)
    for key, (name, param) in zip(keys, sorted(state.params.items()))
  }
  shardings = jax.tree.map(lambda x: x.sharding, state)
  return jax.jit(lambda s, g: s.apply_gradient(g), out_shardings=shardings)(state, grads)


def _bytes(tree) -> int:
  return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
  start = time.perf_counter()
  result = jax.block_until_ready(fn())
  return time.perf_counter() - start, result


class _Ours:
  """`Checkpointer` saving the train state and restoring it into the abstract one."""

  name = "Checkpointer"

  def __init__(self, state: Any, abstract: Any):
    self._state, self._abstract = state, abstract
    self._ckpt: Checkpointer | None = None

  def save(self, directory: str) -> float:
    self._ckpt = Checkpointer(directory)
    return _timed(lambda: (self._ckpt.save(1, self._state), self._ckpt.wait_until_finished()))[0]

  def restore(self) -> tuple[float, dict[str, Any]]:
    seconds, restored = _timed(lambda: self._ckpt.restore(self._abstract, step=1))
    return seconds, restored.state_dict()

  def close(self) -> None:
    self._ckpt.close()


class _Orbax:
  """`ocp.StandardCheckpointer` saving and restoring the same state dict."""

  name = "orbax"

  def __init__(self, state_dict: dict[str, Any], abstract_dict: dict[str, Any]):
    self._state_dict, self._abstract_dict = state_dict, abstract_dict
    self._ckpt: ocp.StandardCheckpointer | None = None
    self._path = ""

  def save(self, directory: str) -> float:
    self._ckpt = ocp.StandardCheckpointer()
    self._path = os.path.join(directory, "raw")
    return _timed(
      lambda: (self._ckpt.save(self._path, self._state_dict), self._ckpt.wait_until_finished())
    )[0]

  def restore(self) -> tuple[float, dict[str, Any]]:
    return _timed(lambda: self._ckpt.restore(self._path, self._abstract_dict))

  def close(self) -> None:
    self._ckpt.close()


def _shardings(tree: Any) -> list[tuple[Any, Any]]:
  return [(path, leaf.sharding) for path, leaf in jax.tree.leaves_with_path(tree)]


def _rate_row(name: str, megabytes: float, saves: list[float], restores: list[float]) -> str:
  save, restore = statistics.median(saves), statistics.median(restores)
  return (
    f"{name:14}{save:9.3f}{megabytes / save:11.0f}{megabytes / min(saves):11.0f}"
    f"{restore:11.3f}{megabytes / restore:14.0f}{megabytes / min(restores):11.0f}"
  )


def _checksum_seconds(state_dict: dict[str, Any]) -> float:
  """The median time of computing (and fetching) every array's checksum."""
  leaves = flatten(state_dict)
  times = [_timed(lambda: fetch(dispatch_checksums(leaves)))[0] for _ in range(7)]
  return statistics.median(times[1:])


def run(layers: int, rounds: int, restores: int, root: str, *, random: bool, small: int) -> None:
  part = Partitioner(
    create_mesh(shape={"data": 2, "model": 4}),
    standard_logical_axis_rules(shard_optimizer_state_over_data=True),
  )
  opt_def, init = (
    optimizers.adamw(1e-3),
    functools.partial(init_fn, layers, random=random, small=small),
  )
  state = init_sharded(part, opt_def, init)
  if random:
    state = _one_random_step(state)
  abstract = abstract_train_state(part, opt_def, init)
  state_dict = state.state_dict()
  abstract_dict = jax.tree.map(
    lambda x, a: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=a.sharding),
    state_dict,
    abstract.state_dict(),
  )
  megabytes = _bytes(state_dict) / 1e6
  sides = [_Ours(state, abstract), _Orbax(state_dict, abstract_dict)]
  saves = {side.name: [] for side in sides}
  first_saves = {}
  # tensorstore's and orbax's set-up, paid by whichever side saves first, is paid here.
  warm = optimizers.sgd(0.1).create({"w": jnp.zeros(1)})
  for side in (_Ours(warm, None), _Orbax(warm.state_dict(), None)):
    side.save(tempfile.mkdtemp(dir=root))
    side.close()
  restore_times = {side.name: [] for side in sides}
  shardings = {}
  for i in range(rounds + 1):
    order = sides if i % 2 == 0 else sides[::-1]
    directories = []
    for side in order:
      directories.append(tempfile.mkdtemp(dir=root))
      seconds = side.save(directories[-1])
      if i:
        saves[side.name].append(seconds)
      else:
        first_saves[side.name] = seconds
    for j in range(restores):
      for side in order if j % 2 == 0 else order[::-1]:
        seconds, restored = side.restore()
        if i:
          restore_times[side.name].append(seconds)
        else:
          shardings[side.name] = _shardings(restored)
        del restored
    for side, directory in zip(order, directories):
      side.close()
      shutil.rmtree(directory)
  ours, raw = shardings.values()
  if ours != raw:
    raise AssertionError(f"the sides restore different leaves or shardings:\n{ours}\n{raw}")
  load = os.getloadavg()
  print(
    f"adamw state ({'random' if random else 'constant'} data): {megabytes:.1f} MB, "
    f"{len(jax.tree.leaves(state_dict))} leaves on both "
    f"sides, mesh 2x4 (8 CPU devices); {rounds} rounds after 1 warm-up, "
    f"{restores} restore pairs per round; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
  )
  print(
    f"{'':14}{'save s':>9}{'save MB/s':>11}{'best MB/s':>11}"
    f"{'restore s':>11}{'restore MB/s':>14}{'best MB/s':>11}"
  )
  for side in sides:
    print(_rate_row(side.name, megabytes, saves[side.name], restore_times[side.name]))
  ratios = []
  for times in (saves, restore_times):
    ours, raw = times[sides[0].name], times[sides[1].name]
    pairs = [raw_seconds / ours_seconds for ours_seconds, raw_seconds in zip(ours, raw)]
    ratios += [statistics.median(pairs), min(raw) / min(ours)]
  print(
    f"{'ratio':14}{'':9}{ratios[0]:11.2f}{ratios[1]:11.2f}{'':11}{ratios[2]:14.2f}{ratios[3]:11.2f}"
  )
  print(
    "first save (round 0, compiles included, Checkpointer first): "
    + ", ".join(f"{name} {seconds:.3f} s" for name, seconds in first_saves.items())
  )
  seconds = _checksum_seconds(state_dict)
  print(f"{'checksums':14}{seconds:9.3f}{megabytes / seconds:11.0f}  (computing all of them once)")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=int, default=4, help="2048x2048 float32 kernels")
  parser.add_argument("--rounds", type=int, default=21)
  parser.add_argument("--restores", type=int, default=4, help="restore pairs per round")
  parser.add_argument("--data", choices=["random", "constant"], default="random")
  parser.add_argument("--small", type=int, default=0, help="replicated vectors of distinct sizes")
  parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
  args = parser.parse_args()
  if args.restores < 1:
    parser.error(f"--restores must be at least 1, got {args.restores}.")
  root = tempfile.mkdtemp(dir=args.dir)
  try:
    run(
      args.layers, args.rounds, args.restores, root, random=args.data == "random", small=args.small
    )
  finally:
    shutil.rmtree(root)


if __name__ == "__main__":
  main()
