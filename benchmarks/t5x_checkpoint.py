"""Benchmark: reading and writing T5X checkpoints against raw tensorstore and orbax.

An adamw `TrainState` after one step (params, `mu` and `nu`: three copies of
``--layers`` random 2048x2048 float32 matrices, 16.8 MB each) is sharded over a data=2 x model=4
mesh of 8 simulated CPU devices. Three comparisons, each on the same files:

* legacy restore: `restore_t5x_checkpoint` of a `save_t5x_checkpoint` step
  into the abstract train state (locating the step, msgpack, key and shape
  check, `restore_state` included) against raw tensorstore: open the same
  zarr arrays and read each device's shard into
  `jax.make_array_from_single_device_arrays`, nothing else;
* Orbax-format restore: `restore_t5x_checkpoint` of a T5X Orbax-format step
  (``checkpoint_<step>/state``, an OCDBT PyTree item, as T5X's
  `OrbaxCheckpointManagerInterface` writes it) against orbax's own
  `PyTreeCheckpointer.restore` of that item into the same shardings;
* legacy save: `save_t5x_checkpoint` against raw tensorstore writing the same
  shards as zarr with the same chunks (no msgpack, no rename).

Each side runs ``--rounds`` times, alternating which goes first; one warm-up
round is not counted. The table gives the median seconds, MB/s (1e6 bytes of
arrays) and the ratio of MB/s, ours over the baseline (1.0 = as fast).

Run: ``python benchmarks/t5x_checkpoint.py [--layers 2] [--rounds 5]``.
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
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from flax import traverse_util

from t5x_optim import optimizers, restore_t5x_checkpoint, save_t5x_checkpoint
from t5x_optim.partitioning import (
  Partitioner,
  abstract_train_state,
  create_mesh,
  init_sharded,
  standard_logical_axis_rules,
)

DIM = 2048
# What T5X and t5x_optim use: tensorstore's default file concurrency is the core count.
CONTEXT = ts.Context({"file_io_concurrency": {"limit": 128}})


def init_fn(layers: int) -> dict[str, Any]:
  """Random (incompressible) kernels with logical axes."""
  return {
    "params": {
      f"layer_{i}": nn.LogicallyPartitioned(
        jax.random.normal(jax.random.key(i), (DIM, DIM), jnp.float32), ("embed", "mlp")
      )
      for i in range(layers)
    }
  }


def _timed(fn: Callable[[], Any]) -> float:
  start = time.perf_counter()
  jax.block_until_ready(fn())
  return time.perf_counter() - start


def _arrays(state_dict: dict[str, Any]) -> dict[tuple[str, ...], Any]:
  return {p: x for p, x in traverse_util.flatten_dict(state_dict).items() if np.ndim(x) > 0}


def raw_ts_read(step_dir: str, abstract: dict[tuple[str, ...], Any]) -> list[jax.Array]:
  """Opens each zarr array and reads each device's shard: the floor for the legacy format."""
  stores = {
    p: ts.open(
      {"driver": "zarr", "kvstore": {"driver": "file", "path": f"{step_dir}/{'.'.join(p)}"}},
      context=CONTEXT,
    )
    for p in abstract
  }
  pending = {}
  for p, leaf in abstract.items():
    store = stores[p].result()
    index_map = leaf.sharding.addressable_devices_indices_map(leaf.shape)
    pending[p] = [(d, store[i].read()) for d, i in index_map.items()]
  return [
    jax.make_array_from_single_device_arrays(
      abstract[p].shape, abstract[p].sharding, [jax.device_put(f.result(), d) for d, f in reads]
    )
    for p, reads in pending.items()
  ]


def raw_ts_write(directory: str, arrays: dict[tuple[str, ...], jax.Array]) -> None:
  """Writes each shard as zarr with the same chunks: the floor for the legacy save."""
  opening = {}
  for p, leaf in arrays.items():
    spec = {
      "driver": "zarr",
      "dtype": leaf.dtype.name,
      "kvstore": {"driver": "file", "path": f"{directory}/{'.'.join(p)}"},
      "metadata": {
        "compressor": {"id": "zstd", "level": 1},
        "shape": list(leaf.shape),
        "chunks": list(leaf.sharding.shard_shape(leaf.shape)),
      },
    }
    opening[p] = ts.open(spec, create=True, open=True, context=CONTEXT)
  writes = []
  for p, leaf in arrays.items():
    store = opening[p].result()
    writes += [
      store[s.index].write(np.asarray(s.data)) for s in leaf.addressable_shards if s.replica_id == 0
    ]
  for w in writes:
    w.commit.result()


def _bench(sides: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
  """Median seconds per side, alternating the order, after one warm-up round."""
  names = list(sides)
  times = {n: [] for n in names}
  for r in range(rounds + 1):
    for n in names if r % 2 == 0 else names[::-1]:
      seconds = sides[n]()
      if r:
        times[n].append(seconds)
  return {n: statistics.median(t) for n, t in times.items()}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--rounds", type=int, default=5)
  args = parser.parse_args()

  partitioner = Partitioner(
    create_mesh(shape={"data": 2, "model": 4}),
    standard_logical_axis_rules(parameter_partitioning_dims=2),
  )
  optimizer_def = optimizers.adamw(1e-3)
  init = functools.partial(init_fn, args.layers)
  state = init_sharded(partitioner, optimizer_def, init)
  grads = jax.tree.map(lambda p: jax.random.normal(jax.random.key(7), p.shape), state.params)
  state = jax.jit(lambda s: s.apply_gradient(grads))(state)  # random mu and nu
  abstract = abstract_train_state(partitioner, optimizer_def, init)
  abstract_arrays = _arrays(abstract.state_dict())
  arrays = _arrays(state.state_dict())
  megabytes = sum(x.size * x.dtype.itemsize for x in arrays.values()) / 1e6

  root = tempfile.mkdtemp(prefix="t5x_ckpt_bench_")
  legacy_dir = save_t5x_checkpoint(os.path.join(root, "legacy"), state)
  orbax_item = os.path.join(root, "orbax", "checkpoint_0", "state")
  with ocp.PyTreeCheckpointer() as checkpointer:
    checkpointer.save(orbax_item, state.state_dict())
  abstract_orbax = {
    p: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    for p, x in traverse_util.flatten_dict(abstract.state_dict()).items()
  }
  orbax_target = traverse_util.unflatten_dict(abstract_orbax)
  orbax_args = ocp.args.PyTreeRestore(
    orbax_target, restore_args=ocp.checkpoint_utils.construct_restore_args(orbax_target)
  )

  def orbax_raw() -> float:
    with ocp.PyTreeCheckpointer() as checkpointer:
      return _timed(lambda: checkpointer.restore(orbax_item, args=orbax_args))

  counter = iter(range(10**6))

  def fresh(name: str) -> str:
    return os.path.join(root, f"{name}_{next(counter)}")

  def ours_save() -> float:
    target = fresh("save")
    seconds = _timed(lambda: save_t5x_checkpoint(target, state))
    shutil.rmtree(target)
    return seconds

  def raw_save() -> float:
    target = fresh("raw")
    seconds = _timed(lambda: raw_ts_write(target, arrays))
    shutil.rmtree(target)
    return seconds

  rows = [
    (
      "legacy restore",
      _bench(
        {
          "ours": lambda: _timed(
            lambda: restore_t5x_checkpoint(os.path.join(root, "legacy"), abstract)
          ),
          "base": lambda: _timed(lambda: raw_ts_read(legacy_dir, abstract_arrays)),
        },
        args.rounds,
      ),
      "raw tensorstore",
    ),
    (
      "Orbax-format restore",
      _bench(
        {
          "ours": lambda: _timed(
            lambda: restore_t5x_checkpoint(os.path.join(root, "orbax"), abstract)
          ),
          "base": orbax_raw,
        },
        args.rounds,
      ),
      "orbax PyTreeCheckpointer",
    ),
    ("legacy save", _bench({"ours": ours_save, "base": raw_save}, args.rounds), "raw tensorstore"),
  ]
  shutil.rmtree(root)

  print(
    f"adamw TrainState, {args.layers} x {DIM}x{DIM} f32 params (+ mu, nu): {megabytes:.0f} MB, "
    f"mesh data=2 x model=4 (8 CPU devices), median of {args.rounds} rounds"
  )
  print(
    f"{'operation':<22}{'ours s':>9}{'ours MB/s':>11}{'baseline':>26}{'base s':>9}"
    f"{'base MB/s':>11}{'ratio':>7}"
  )
  for name, t, base in rows:
    print(
      f"{name:<22}{t['ours']:>9.3f}{megabytes / t['ours']:>11.0f}{base:>26}{t['base']:>9.3f}"
      f"{megabytes / t['base']:>11.0f}{t['base'] / t['ours']:>7.2f}"
    )


if __name__ == "__main__":
  main()
