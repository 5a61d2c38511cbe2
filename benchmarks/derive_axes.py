"""Benchmark: deriving logical specs for optimizer states on large param trees.

For T5X-like param trees of about 700 and 7,000 leaves, prints per optimizer:

* ``derive``: ``OptaxStatePartitionRules.derive_optax_logical_axes`` with the
  transformation and abstract params (median of a few runs);
* ``tree_map_params``: ``optax.tree_utils.tree_map_params`` on the same state,
  the cheap (but, for factored states, wrong) reference;
* ``step compile``: trace + compile of one jitted, sharded train step on the
  same tree (abstract inputs, nothing allocated), and derive as % of it;
* state MiB per device with the derived shardings on a 2x4 mesh of 8 simulated
  CPU devices, beside the ideal (every leaf's size / devices its spec shards
  it over) and the unsharded state size.

Run: ``python benchmarks/derive_axes.py [--no-compile]``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import _cpu_devices  # noqa: F401  (sets the device flags before jax loads)
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from t5x_optim.partitioning import OptaxStatePartitionRules

RULES = (("embed", "data"), ("mlp", "model"), ("heads", "model"), ("vocab", "model"), ("kv", None))
EMBED, MLP, HEADS, KV, VOCAB = 256, 512, 8, 32, 1024
LAYER = {
  "attention": {
    "query": ((EMBED, HEADS, KV), P("embed", "heads", "kv")),
    "key": ((EMBED, HEADS, KV), P("embed", "heads", "kv")),
    "value": ((EMBED, HEADS, KV), P("embed", "heads", "kv")),
    "out": ((HEADS, KV, EMBED), P("heads", "kv", "embed")),
  },
  "mlp": {
    "wi": ((EMBED, MLP), P("embed", "mlp")),
    "wo": ((MLP, EMBED), P("mlp", "embed")),
    "bias": ((MLP,), P("mlp")),
  },
  "pre_attention_layer_norm": {"scale": ((EMBED,), P("embed"))},
  "pre_mlp_layer_norm": {"scale": ((EMBED,), P("embed"))},
  "gate": {"scale": ((), None)},
}


def model(num_leaves: int):
  """Abstract params and their logical axes, ``num_leaves`` leaves."""
  per_layer = len(
    jax.tree.leaves(LAYER, is_leaf=lambda x: isinstance(x, tuple) and isinstance(x[0], tuple))
  )
  layers = (num_leaves - 1) // per_layer

  def is_entry(x):
    return isinstance(x, tuple) and isinstance(x[0], tuple)

  tree = {f"layer_{i:04d}": LAYER for i in range(layers)}
  tree["token_embedder"] = {"embedding": ((VOCAB, EMBED), P("vocab", "embed"))}
  params = jax.tree.map(lambda e: jax.ShapeDtypeStruct(e[0], jnp.float32), tree, is_leaf=is_entry)
  axes = jax.tree.map(lambda e: e[1], tree, is_leaf=is_entry)
  return params, axes


def optimizers():
  return {
    "adamw": optax.adamw(1e-3),
    "adafactor": optax.adafactor(1e-3),
    "chain+inject_hyperparams": optax.chain(
      optax.clip_by_global_norm(1.0), optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3)
    ),
  }


def timed(fn, repeats: int) -> tuple[float, object]:
  times, out = [], None
  for _ in range(repeats):
    start = time.perf_counter()
    out = fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times), out


def shardings(specs, mesh):
  return nn.logical_to_mesh_sharding(specs, mesh, RULES)


def state_bytes(state, specs, mesh) -> tuple[float, float, float]:
  """(per-device bytes with the derived shardings, ideal, unsharded)."""
  sh = shardings(specs, mesh)
  leaves = jax.tree.leaves(state)
  sh_leaves = jax.tree.leaves(sh, is_leaf=lambda x: x is None or isinstance(x, NamedSharding))
  actual = ideal = total = 0.0
  for leaf, s in zip(leaves, sh_leaves, strict=True):
    size = math.prod(leaf.shape) * leaf.dtype.itemsize
    total += size
    if s is None:
      actual += size
      ideal += size
      continue
    actual += math.prod(s.shard_shape(leaf.shape)) * leaf.dtype.itemsize
    axes = [a for e in s.spec for a in ((e,) if isinstance(e, str) else e or ())]
    ideal += size / math.prod(mesh.shape[a] for a in axes)
  return actual, ideal, total


def step_compile_seconds(tx, params, axes, state, specs, mesh) -> float:
  def step(p, s, g):
    updates, s = tx.update(g, s, p)
    return optax.apply_updates(p, updates), s

  p_sh = shardings(axes, mesh)
  s_sh = shardings(specs, mesh)
  start = time.perf_counter()
  jax.jit(step, in_shardings=(p_sh, s_sh, p_sh), out_shardings=(p_sh, s_sh)).lower(
    params, state, params
  ).compile()
  return time.perf_counter() - start


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument(
    "--no-compile", action="store_true", help="skip the train-step trace+compile column"
  )
  parser.add_argument("--leaves", type=int, nargs="+", default=[700, 7000])
  args = parser.parse_args()
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
  header = (
    f"{'leaves':>6} {'optimizer':<26}{'derive s':>9}{'tmp s':>8}"
    f"{'compile s':>10}{'derive %':>9}{'MiB/dev':>9}{'ideal':>8}"
    f"{'unshard':>9}"
  )
  print(header)
  for n in args.leaves:
    params, axes = model(n)
    for name, tx in optimizers().items():
      state = jax.eval_shape(tx.init, params)
      derive = lambda: OptaxStatePartitionRules.derive_optax_logical_axes(  # noqa: E731
        state, axes, transformation=tx, params=params
      )
      t_derive, specs = timed(derive, 3)
      t_tmp, _ = timed(
        lambda: optax.tree_utils.tree_map_params(  # noqa: B023
          tx,
          lambda _, spec: spec,
          state,
          axes,  # noqa: B023
          transform_non_params=lambda _: None,
          is_leaf=lambda x: x is None or isinstance(x, P),
        ),
        3,
      )
      actual, ideal, total = state_bytes(state, specs, mesh)
      if args.no_compile:
        compile_col, pct = f"{'-':>10}", f"{'-':>9}"
      else:
        t_compile = step_compile_seconds(tx, params, axes, state, specs, mesh)
        compile_col = f"{t_compile:>10.2f}"
        pct = f"{100 * t_derive / t_compile:>8.1f}%"
      mib = 2.0**20
      print(
        f"{len(jax.tree.leaves(params)):>6} {name:<26}{t_derive:>9.3f}"
        f"{t_tmp:>8.3f}{compile_col}{pct}{actual / mib:>9.1f}"
        f"{ideal / mib:>8.1f}{total / mib:>9.1f}",
        flush=True,
      )


if __name__ == "__main__":
  main()
