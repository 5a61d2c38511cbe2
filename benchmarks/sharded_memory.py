"""Benchmark: per-device memory of params and optimizer state under sharding.

For a ~50M-parameter transformer-like parameter tree (abstract
``jax.ShapeDtypeStruct``s through ``abstract_train_state``; nothing is
allocated) prints, for adamw and adafactor on 1x8, 2x4 and 8x1
``(data, model)`` meshes of 8 simulated CPU devices, the per-device bytes of
params and of optimizer state beside the ideal (total bytes / 8 devices) and
their ratio, under three rule sets:

* ``1d``: ``standard_logical_axis_rules()``: params and state sharded over
  ``model`` only (T5X's default), so they are replicated over ``data``;
* ``1d+zero``: optimizer state also sharded over ``data`` (ZeRO-style); on
  the 1x8 mesh, where ``data`` has size 1, over ``model`` instead, which
  shards the state leaves the rules replicate (``embed``-sized vectors);
* ``2d+zero``: also ``parameter_partitioning_dims=2`` (``embed`` on ``data``).

Target: ratio within 1% of 1.00 wherever every dimension divides its mesh
axes (``1d`` rows are replicated over ``data`` by design).

Run: ``python benchmarks/sharded_memory.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import _cpu_devices  # noqa: F401  (sets the device flags before jax loads)
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from t5x_optim import OptaxWrapper
from t5x_optim.partitioning import (
  LogicalAxisRules,
  Partitioner,
  abstract_train_state,
  create_mesh,
  standard_logical_axis_rules,
)

VOCAB, EMBED, HEADS, KV, MLP, LAYERS = 32128, 512, 8, 64, 2048, 11
MESHES = [(1, 8), (2, 4), (8, 1)]
OPTIMIZERS = {"adamw": lambda: optax.adamw(1e-3), "adafactor": lambda: optax.adafactor(1e-3)}
RULE_SETS = {
  "1d": {},
  "1d+zero": {"shard_optimizer_state_over_data": True},
  "2d+zero": {"shard_optimizer_state_over_data": True, "parameter_partitioning_dims": 2},
}
ZERO_AXIS_WHEN_DATA_IS_1 = "model"
MiB = 2**20


def _layer_shapes() -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
  """One transformer layer: attention, MLP, two layer norms."""
  return {
    "query": ((EMBED, HEADS, KV), ("embed", "heads", "kv")),
    "key": ((EMBED, HEADS, KV), ("embed", "heads", "kv")),
    "value": ((EMBED, HEADS, KV), ("embed", "heads", "kv")),
    "out": ((HEADS, KV, EMBED), ("heads", "kv", "embed")),
    "wi": ((EMBED, MLP), ("embed", "mlp")),
    "wo": ((MLP, EMBED), ("mlp", "embed")),
    "pre_attention_norm": ((EMBED,), ("embed",)),
    "pre_mlp_norm": ((EMBED,), ("embed",)),
  }


def model_variables() -> dict[str, dict[str, object]]:
  """The parameter tree, boxed with its logical axes (traced, never allocated)."""

  def boxed(shape, names):
    return nn.LogicallyPartitioned(jnp.zeros(shape, jnp.float32), names)

  params = {
    f"layer_{i}": {name: boxed(*spec) for name, spec in _layer_shapes().items()}
    for i in range(LAYERS)
  }
  params["token_embedder"] = boxed((VOCAB, EMBED), ("vocab", "embed"))
  params["final_norm"] = boxed((EMBED,), ("embed",))
  return {"params": params}


def _bytes_per_device(tree) -> int:
  return sum(
    math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree)
  )


def _total_bytes(tree) -> int:
  return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def logical_axis_rules(data: int, rules: str) -> LogicalAxisRules:
  """The named rule set; ZeRO goes over ``model`` when the data axis has size 1."""
  axis_rules = standard_logical_axis_rules(**RULE_SETS[rules])
  if axis_rules.optimizer_state_axis is None or data > 1:
    return axis_rules
  return dataclasses.replace(axis_rules, optimizer_state_axis=ZERO_AXIS_WHEN_DATA_IS_1)


def measure(data: int, model: int, optimizer: str, rules: str) -> dict[str, float]:
  """Per-device and total bytes of params and optimizer state for one configuration."""
  partitioner = Partitioner(
    create_mesh(shape={"data": data, "model": model}), logical_axis_rules(data, rules)
  )
  state = abstract_train_state(partitioner, OptaxWrapper(OPTIMIZERS[optimizer]()), model_variables)
  return {
    "params": _bytes_per_device(state.params),
    "params_total": _total_bytes(state.params),
    "state": _bytes_per_device(state.param_states),
    "state_total": _total_bytes(state.param_states),
  }


def main() -> None:
  argparse.ArgumentParser(description=__doc__.split("\n", 1)[0]).parse_args()  # --help
  devices = jax.device_count()
  header = (
    f"{'mesh':>5} {'optimizer':>9} {'rules':>8} | {'params/dev':>10} {'ideal':>8} "
    f"{'ratio':>6} | {'state/dev':>10} {'ideal':>8} {'ratio':>6}"
  )
  print(header)
  print("-" * len(header))
  for optimizer in OPTIMIZERS:
    for data, model in MESHES:
      for rules in RULE_SETS:
        m = measure(data, model, optimizer, rules)
        ideal_params, ideal_state = m["params_total"] / devices, m["state_total"] / devices
        print(
          f"{data}x{model:<3} {optimizer:>9} {rules:>8} | "
          f"{m['params'] / MiB:>10.2f} {ideal_params / MiB:>8.2f} "
          f"{m['params'] / ideal_params:>6.3f} | "
          f"{m['state'] / MiB:>10.2f} {ideal_state / MiB:>8.2f} "
          f"{m['state'] / ideal_state:>6.3f}"
        )
  num_params = sum(x.size for x in jax.tree.leaves(jax.eval_shape(model_variables)))
  print(
    f"\nparams: {num_params / 1e6:.1f}M float32; sizes in MiB; ideal = total / {devices} devices."
  )


if __name__ == "__main__":
  main()
