"""Benchmark: bytes moved between devices by one sharded Muon step, against AdamW.

A scanned T5-style stack (``layers`` x kernels, a token embedding, untied
logits, layer-norm scales) is built as float32 zeros (about 180 MB at the
default sizes). For muon (dimension numbers from the logical axes,
`KernelAxesRule`) and adamw, the optimizer step (``apply_gradient`` with the
gradients sharded like the params, the state donated) is compiled for 8
simulated CPU devices on 1x8, 2x4 and 4x2 ``(data, model)`` meshes with
T5X's 1-D rules plus ZeRO, and the collectives of the compiled (SPMD-
partitioned) HLO are counted: all-gather, all-reduce, reduce-scatter,
all-to-all and collective-permute, with the bytes of each one's result per
device (the shapes in a partitioned module are per device). AdamW is
elementwise, so it moves nothing but what ZeRO's layout asks; Muon's
Newton-Schulz products need whole matrices, so its kernels are gathered.

Run: ``python benchmarks/muon_sharded.py`` (add ``--layers 24 --embed 1024
--mlp 4096`` for larger shapes).
"""

from __future__ import annotations

import argparse
import collections
import re

import _cpu_devices  # noqa: F401  (sets the device flags before jax loads)
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from t5x_optim import optimizers
from t5x_optim.partitioning import (
  Partitioner,
  abstract_train_state,
  create_mesh,
  standard_logical_axis_rules,
)

MESHES = [(1, 8), (2, 4), (4, 2)]
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1}
# `%name = f32[2,16,32]{2,1,0} all-gather(...)` or a tuple result `(f32[..], f32[..]) all-reduce(`.
_OP = re.compile(r"=\s*(\(.*?\)|\S+)\s+(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")


def tree(layers: int, embed: int, mlp: int, heads: int, kv: int, vocab: int):
  """(shapes, logical axes) of the scanned stack."""
  spec = {
    "token_embedder/embedding": ((vocab, embed), ("vocab", "embed")),
    "layers/attention/query": ((layers, embed, heads, kv), ("layers", "embed", "heads", "kv")),
    "layers/attention/key": ((layers, embed, heads, kv), ("layers", "embed", "heads", "kv")),
    "layers/attention/value": ((layers, embed, heads, kv), ("layers", "embed", "heads", "kv")),
    "layers/attention/out": ((layers, heads, kv, embed), ("layers", "heads", "kv", "embed")),
    "layers/mlp/wi": ((layers, embed, mlp), ("layers", "embed", "mlp")),
    "layers/mlp/wo": ((layers, mlp, embed), ("layers", "mlp", "embed")),
    "layers/pre_attention_norm/scale": ((layers, embed), ("layers", "embed")),
    "layers/pre_mlp_norm/scale": ((layers, embed), ("layers", "embed")),
    "decoder_norm/scale": ((embed,), ("embed",)),
    "logits_dense/kernel": ((embed, vocab), ("embed", "vocab")),
  }
  shapes, axes = {}, {}
  for path, (shape, names) in spec.items():
    *parents, leaf = path.split("/")
    node_s, node_a = shapes, axes
    for key in parents:
      node_s, node_a = node_s.setdefault(key, {}), node_a.setdefault(key, {})
    node_s[leaf], node_a[leaf] = jnp.zeros(shape, jnp.float32), P(*names)
  return shapes, axes


def collectives(hlo: str) -> dict[str, tuple[int, int]]:
  """``{op: (count, bytes per device)}`` of the collectives in a compiled HLO text."""
  found = collections.defaultdict(lambda: [0, 0])
  for result, op in _OP.findall(hlo):
    size = 0
    for dtype, dims in _SHAPE.findall(result):
      count = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
      size += count * _DTYPE_BYTES.get(dtype, 4)
    found[op][0] += 1
    found[op][1] += size
  return {op: tuple(found[op]) for op in COLLECTIVES if op in found}


def step_collectives(opt_def, shapes, axes, data: int, model: int) -> dict[str, tuple[int, int]]:
  """Compiles the donated optimizer step on a (data, model) mesh and counts its collectives."""
  partitioner = Partitioner(
    create_mesh(shape={"data": data, "model": model}),
    standard_logical_axis_rules(shard_optimizer_state_over_data=True),
  )
  boxed = lambda: {"params": jax.tree.map(_box, shapes, axes)}  # noqa: E731
  abstract = abstract_train_state(partitioner, opt_def, boxed)
  shardings = jax.tree.map(lambda x: x.sharding, abstract)
  grads = abstract.params
  compiled = (
    jax.jit(
      lambda state, grads: state.apply_gradient(grads),
      in_shardings=(shardings, shardings.params),
      out_shardings=shardings,
      donate_argnums=0,
    )
    .lower(abstract, grads)
    .compile()
  )
  return collectives(compiled.as_text())


def _box(x, spec):
  return nn.LogicallyPartitioned(x, tuple(spec))


def _format(found: dict[str, tuple[int, int]]) -> str:
  total = sum(size for _, size in found.values())
  parts = [f"{op} x{count} {size / 2**20:.2f} MiB" for op, (count, size) in found.items()]
  return f"{total / 2**20:8.2f} MiB  ({', '.join(parts) or 'none'})"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--embed", type=int, default=512)
  parser.add_argument("--mlp", type=int, default=2048)
  parser.add_argument("--heads", type=int, default=8)
  parser.add_argument("--kv", type=int, default=64)
  parser.add_argument("--vocab", type=int, default=32128)
  args = parser.parse_args()
  shapes, axes = tree(args.layers, args.embed, args.mlp, args.heads, args.kv, args.vocab)
  count = sum(x.size for x in jax.tree.leaves(shapes))
  print(
    f"scanned stack: {count / 1e6:.1f}M params, {args.layers} layers, embed {args.embed}, "
    f"mlp {args.mlp}; optimizer step, 1-D rules + ZeRO; bytes of collective results per device"
  )
  for data, model in MESHES:
    for name, make in (
      ("adamw", lambda: optimizers.adamw(1e-3)),
      ("muon", lambda: optimizers.muon(0.02)),
    ):
      found = step_collectives(make(), shapes, axes, data, model)
      print(f"  data={data} model={model}  {name:5s} {_format(found)}")


if __name__ == "__main__":
  main()
