"""Optimizer-update time against the memory-bandwidth limit.

Run: ``python benchmarks/update_bandwidth.py [--scale S] [--repeats N]``
(on a GPU: ``--scale 1`` is the default there and gives the real T5 sizes).

For unscanned T5-v1.1-base-like (280 leaves) and T5-v1.1-large-like (556
leaves) float32 param trees, times one jitted update step (params and state
donated, as in training) of each layout below, and prints it next to the
limit: the bytes the update must move (read params, grads and state; write
params and state) divided by the copy bandwidth measured in the same run on
the same backend (the best of 10 or more donated ``x + 1`` over a buffer as
large as the tree).

Layouts ("variant" column):
  * ``plain``: ``tx.update`` + ``optax.apply_updates`` on the per-leaf tree.
  * ``wrapper``: `OptaxWrapper.create(...).apply_gradient` (the library path).
  * ``fused_pallas``, ``fused_interpret``: the same with
    ``OptaxWrapper(tx, fused=...)``, the multi-tensor update of
    `t5x_optim._layouts.fused`: per group of leaves, params, grads and
    state concatenated into flat buffers, one Pallas kernel, split back.
    ``fused_pallas`` needs a GPU; ``fused_interpret`` runs the same kernel
    in Pallas interpret mode on any backend, slowly.
  * ``optax_flatten``: ``optax.flatten(tx)``: one flat buffer, rebuilt from
    the per-leaf params and grads in every step.
  * ``regroup``: params, grads and state stacked by leaf shape inside every
    step and unstacked after it (state kept per-leaf between steps).
  * ``stacked_state``: optimizer state kept stacked by leaf shape between
    steps; params and grads stay per-leaf (the T5X interface) and are
    stacked inside the step, the new params unstacked.
  * ``stacked_params``: the library's `stack_params` through `OptaxWrapper`:
    params and state kept stacked by shape between steps; the per-leaf
    grads are stacked inside the step.
  * ``stacked_all``: the same with the grads stacked already, as the
    gradient of a loss of ``target.unstack()`` gives them (and as scanned
    layers give them): few large buffers and nothing else. T5X's trainer,
    which differentiates the per-leaf ``train_state.params``, cannot give
    them.
  * ``flat_params``: params and state kept between steps as one flat buffer
    per dtype (PyTorch FSDP's flat parameters); the per-leaf grads a model
    gives are concatenated into that layout inside the step. The candidate
    design for reaching 0.8 of the limit, measured before it is built.
  * ``flat_all``: the same with the grads already in the flat layout (FSDP's
    gradient accumulation into the flat buffer): its upper bound.

Every variant's first step is checked bit for bit against the first variant
("exact" column). "buffers" counts the arrays kept between steps, "ops" the
instructions of the optimized entry computation that do work (fusions,
copies, concatenations; compare it within one backend: XLA:GPU may wrap
kernels into command-buffer calls). Times are medians over ``--repeats``
rounds, the variants interleaved round by round so machine noise hits all
alike; "compile" is trace + compile of the step (a fresh ``jax.jit``),
measured separately; "speedup" and "compile x" are against the first variant;
"temp MB" is the step's temporary memory as XLA reports it.
"""

from __future__ import annotations

import argparse
import collections
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from t5x_optim import OptaxWrapper, stack_params

OPTIMIZERS: dict[str, Callable[[], optax.GradientTransformation]] = {
  "adamw": lambda: optax.adamw(1e-3),
  "clip_adamw": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
  "lion": lambda: optax.lion(1e-4),
  "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9),
}
FUSED = {"fused_pallas": "pallas", "fused_interpret": "interpret"}
VARIANTS = (
  "plain",
  "wrapper",
  *FUSED,
  "optax_flatten",
  "regroup",
  "stacked_state",
  "stacked_params",
  "stacked_all",
  "flat_params",
  "flat_all",
)
# fused_interpret runs the kernel's grid as an XLA loop, about 3 ms per 4096-element
# block on CPU: add it with --scale 0.05 or less.
DEFAULT_VARIANTS = ("plain", "wrapper", "stacked_all")
GPU_VARIANTS = (
  "plain",
  "wrapper",
  "fused_pallas",
  "stacked_params",
  "stacked_all",
  "flat_params",
  "flat_all",
)
# T5 v1.1 (gated-GELU MLP, untied logits): d_model, d_ff, layers per stack.
T5_SIZES = {"T5-base-like": (768, 2048, 12), "T5-large-like": (1024, 2816, 24)}
VOCAB = 32128
TREES = ("one-leaf", *T5_SIZES)
_NOT_COUNTED = ("parameter", "get-tuple-element", "tuple", "bitcast", "constant")


def t5_shapes(d_model: int, d_ff: int, layers: int, vocab: int) -> dict[str, Any]:
  """The param shapes of an unscanned T5 v1.1 encoder-decoder, by path."""

  def attention() -> dict[str, Any]:
    return {name: {"kernel": (d_model, d_model)} for name in ("query", "key", "value")} | {
      "out": {"kernel": (d_model, d_model)}
    }

  def mlp() -> dict[str, Any]:
    return {
      "wi_0": {"kernel": (d_model, d_ff)},
      "wi_1": {"kernel": (d_model, d_ff)},
      "wo": {"kernel": (d_ff, d_model)},
    }

  def norm() -> dict[str, Any]:
    return {"scale": (d_model,)}

  encoder = {
    f"layers_{i}": {
      "attention": attention(),
      "mlp": mlp(),
      "pre_attention_layer_norm": norm(),
      "pre_mlp_layer_norm": norm(),
    }
    for i in range(layers)
  }
  decoder = {
    f"layers_{i}": {
      "self_attention": attention(),
      "encoder_decoder_attention": attention(),
      "mlp": mlp(),
      "pre_self_attention_layer_norm": norm(),
      "pre_cross_attention_layer_norm": norm(),
      "pre_mlp_layer_norm": norm(),
    }
    for i in range(layers)
  }
  encoder["encoder_norm"] = norm()
  decoder["decoder_norm"] = norm()
  decoder["logits_dense"] = {"kernel": (d_model, vocab)}
  return {"token_embedder": {"embedding": (vocab, d_model)}, "encoder": encoder, "decoder": decoder}


def tree_shapes(name: str, scale: float) -> dict[str, Any]:
  """The shapes of tree `name`; "one-leaf" is one vector as large as T5-base-like."""
  if name == "one-leaf":
    base = jax.tree.leaves(
      tree_shapes("T5-base-like", scale), is_leaf=lambda x: isinstance(x, tuple)
    )
    return {"w": (sum(int(np.prod(shape)) for shape in base),)}
  d_model, d_ff, layers = T5_SIZES[name]
  return t5_shapes(round(d_model * scale), round(d_ff * scale), layers, round(VOCAB * scale))


def random_tree(shapes: Any, seed: int, scale: float) -> Any:
  leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(
    treedef, [scale * jax.random.normal(k, shape, jnp.float32) for k, shape in zip(keys, leaves)]
  )


class Grouping:
  """Leaves grouped by (shape, dtype), in first-seen order, stacked on a new axis 0.

  With `max_size`, a group holds at most that many leaves (XLA:GPU fuses a
  concatenate into its consumer only up to a bounded operand count).
  """

  def __init__(self, tree: Any, max_size: int | None = None):
    leaves, self.treedef = jax.tree.flatten(tree)
    members = collections.defaultdict(list)
    for i, leaf in enumerate(leaves):
      members[(leaf.shape, leaf.dtype)].append(i)
    size = max_size or len(leaves)
    self.groups = [
      group[j : j + size] for group in members.values() for j in range(0, len(group), size)
    ]

  def pack(self, tree: Any) -> list[jax.Array]:
    leaves = jax.tree.leaves(tree)
    return [jnp.stack([leaves[i] for i in group]) for group in self.groups]

  def unpack(self, stacked: list[jax.Array]) -> Any:
    leaves = [None] * sum(len(group) for group in self.groups)
    for group, array in zip(self.groups, stacked):
      for j, i in enumerate(group):
        leaves[i] = array[j]
    return jax.tree.unflatten(self.treedef, leaves)


class Flattening:
  """Leaves concatenated into one flat buffer per dtype, in tree order."""

  def __init__(self, tree: Any):
    leaves, self.treedef = jax.tree.flatten(tree)
    self.shapes = [leaf.shape for leaf in leaves]
    members = collections.defaultdict(list)
    for i, leaf in enumerate(leaves):
      members[jnp.dtype(leaf.dtype).name].append(i)
    self.groups = dict(members)

  def pack(self, tree: Any) -> dict[str, jax.Array]:
    leaves = jax.tree.leaves(tree)
    return {
      dtype: jnp.concatenate([jnp.ravel(leaves[i]) for i in group])
      for dtype, group in self.groups.items()
    }

  def unpack(self, flat: dict[str, jax.Array]) -> Any:
    leaves = [None] * len(self.shapes)
    for dtype, group in self.groups.items():
      offset = 0
      for i in group:
        size = int(np.prod(self.shapes[i]))
        leaves[i] = flat[dtype][offset : offset + size].reshape(self.shapes[i])
        offset += size
    return jax.tree.unflatten(self.treedef, leaves)


def _map_param_subtrees(fn: Callable[[Any], Any], state: Any, treedef: Any) -> Any:
  """Applies `fn` to each subtree of `state` that has the params' structure."""
  return jax.tree.map(
    lambda t: fn(t) if jax.tree.structure(t) == treedef else t,
    state,
    is_leaf=lambda t: jax.tree.structure(t) == treedef,
  )


def _map_stacked(fn: Callable[[Any], Any], state: Any) -> Any:
  return jax.tree.map(
    lambda t: fn(t) if isinstance(t, list) else t, state, is_leaf=lambda t: isinstance(t, list)
  )


Setup = tuple[Callable[..., Any], tuple[Any, ...], Callable[[Any], Any]]
"""(step function, initial arguments, how to read the params out of its result)."""


def make_variant(
  name: str,
  tx: optax.GradientTransformation,
  params: Any,
  grads: Any,
  *,
  group_size: int | None = None,
) -> Setup:
  """Builds one layout's step (donating params and state), its inputs, and a params reader."""
  grouping = Grouping(params, group_size)

  def plain(p, s, g):
    updates, s = tx.update(g, s, p)
    return optax.apply_updates(p, updates), s

  if name == "plain":
    return plain, (params, tx.init(params), grads), lambda out: out[0]
  if name == "wrapper":
    return (
      (lambda opt, g: opt.apply_gradient(g)),
      (OptaxWrapper(tx).create(params), grads),
      (lambda opt: opt.target),
    )
  if name in FUSED:
    return (
      (lambda opt, g: opt.apply_gradient(g)),
      (OptaxWrapper(tx, fused=FUSED[name]).create(params), grads),
      (lambda opt: opt.target),
    )
  if name == "optax_flatten":
    flat_tx = optax.flatten(tx)

    def flat(p, s, g):
      updates, s = flat_tx.update(g, s, p)
      return optax.apply_updates(p, updates), s

    return flat, (params, flat_tx.init(params), grads), lambda out: out[0]
  if name == "regroup":

    def regroup(p, s, g):
      stacked_p = grouping.pack(p)
      stacked_s = _map_param_subtrees(grouping.pack, s, grouping.treedef)
      updates, stacked_s = tx.update(grouping.pack(g), stacked_s, stacked_p)
      new_p = optax.apply_updates(stacked_p, updates)
      return grouping.unpack(new_p), _map_stacked(grouping.unpack, stacked_s)

    return regroup, (params, tx.init(params), grads), lambda out: out[0]
  if name == "stacked_state":

    def stacked_state(p, s, g):
      stacked_p = grouping.pack(p)
      updates, s = tx.update(grouping.pack(g), s, stacked_p)
      return grouping.unpack(optax.apply_updates(stacked_p, updates)), s

    return stacked_state, (params, tx.init(grouping.pack(params)), grads), lambda out: out[0]
  if name in ("stacked_params", "stacked_all"):
    stacked = stack_params(params, tx=tx)
    step_grads = stacked.layout.stack(grads) if name == "stacked_all" else grads
    return (
      (lambda opt, g: opt.apply_gradient(g)),
      (OptaxWrapper(tx).create(stacked), step_grads),
      (lambda opt: opt.target.unstack()),
    )
  if name in ("flat_params", "flat_all"):
    layout = Flattening(params)
    packed = layout.pack(params)
    grads_packed = name == "flat_all"

    def pack_grads(p, s, g):
      return plain(p, s, layout.pack(g))

    return (
      plain if grads_packed else pack_grads,
      (packed, tx.init(packed), layout.pack(grads) if grads_packed else grads),
      (lambda out: layout.unpack(out[0])),
    )
  raise ValueError(f"Unknown variant {name!r}; the variants are {VARIANTS}.")


def _donated(args: tuple[Any, ...]) -> tuple[int, ...]:
  return tuple(range(len(args) - 1))


def _copy(tree: Any) -> Any:
  return jax.tree.map(jnp.copy, tree)


def _as_tuple(out: Any) -> tuple[Any, ...]:
  return out if isinstance(out, tuple) else (out,)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
  start = time.perf_counter()
  out = jax.block_until_ready(fn())
  return time.perf_counter() - start, out


def copy_bandwidth(n_floats: int, repeats: int) -> float:
  """Bytes per second of a donated, jitted ``x + 1`` (one read, one write), best of `repeats`.

  The best rather than the median: the limit is a floor, and on a shared
  machine a median copy time would make it look slower than it is.
  """
  step = jax.jit(lambda x: x + 1.0, donate_argnums=0)
  x = jax.block_until_ready(step(jnp.zeros((n_floats,), jnp.float32)))
  times = []
  for _ in range(repeats):
    elapsed, x = timed(lambda: step(x))
    times.append(elapsed)
  return 2 * 4 * n_floats / min(times)


def update_bytes(tx: optax.GradientTransformation, params: Any) -> int:
  """Bytes an update must move: params and state read and written, grads read."""
  state = jax.eval_shape(tx.init, params)

  def nbytes(tree):
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))

  return 3 * nbytes(params) + 2 * nbytes(state)


def op_count(compiled: Any) -> int:
  """Instructions of the optimized entry computation that do work (fusions, copies...)."""
  entry = compiled.as_text().split("\nENTRY ", 1)[1].split("\n}", 1)[0]
  ops = [
    re.search(r" ([a-z][a-z0-9-]*)\(", " " + line.split(" = ", 1)[1]).group(1)
    for line in entry.splitlines()[1:]
    if " = " in line
  ]
  return sum(op not in _NOT_COUNTED for op in ops)


def temp_bytes(compiled: Any) -> int | None:
  """Bytes of temporaries XLA allocates for the step (None where the backend does not say)."""
  analysis = compiled.memory_analysis()
  return None if analysis is None else analysis.temp_size_in_bytes


def measure(
  tx_name: str,
  params: Any,
  grads: Any,
  variants: tuple[str, ...],
  repeats: int,
  group_size: int | None,
) -> dict[str, dict[str, Any]]:
  """Compile time, median step time and exactness of each variant on one tree.

  Each variant owns a copy of the params (its steps donate them), so only one
  copy of params and state per variant is alive: at T5-large size with adamw
  and the default variants that is about 56 GB (counted, not measured on a
  GPU), plus the step's temporaries. A variant is exact when its first step gives the first
  variant's params bit for bit.
  """
  tx = OPTIMIZERS[tx_name]()
  results, steps, state, reference = {}, {}, {}, None
  for name in variants:
    fn, initial, reader = make_variant(name, tx, _copy(params), grads, group_size=group_size)
    compile_s, compiled = timed(
      lambda: jax.jit(fn, donate_argnums=_donated(initial)).lower(*initial).compile()
    )
    buffers = len(jax.tree.leaves(initial[:-1]))
    out = jax.block_until_ready(compiled(*initial))
    first = jax.tree.leaves(jax.device_get(reader(out)))
    reference = first if reference is None else reference
    steps[name], state[name] = compiled, (*_as_tuple(out), initial[-1])
    results[name] = {
      "compile": compile_s,
      "times": [],
      "buffers": buffers,
      "ops": op_count(compiled),
      "temp": temp_bytes(compiled),
      "exact": all(np.array_equal(a, b) for a, b in zip(reference, first)),
    }
  for i in range(repeats):
    for name in variants if i % 2 == 0 else variants[::-1]:
      elapsed, out = timed(lambda: steps[name](*state[name]))
      state[name] = (*_as_tuple(out), state[name][-1])
      results[name]["times"].append(elapsed)
  return results


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--scale",
    type=float,
    default=None,
    help="multiplies d_model, d_ff and the vocabulary (default: 1 on an "
    "accelerator, 0.25 on CPU; leaf counts never change)",
  )
  parser.add_argument(
    "--repeats",
    type=int,
    default=None,
    help="timed rounds per variant (default: 20 on an accelerator, 5 on CPU)",
  )
  parser.add_argument("--trees", nargs="+", default=list(TREES), choices=TREES)
  parser.add_argument(
    "--group-size",
    type=int,
    default=None,
    help="most leaves per stacked buffer in the stacked/regroup variants",
  )
  parser.add_argument(
    "--optimizers", nargs="+", default=["adamw", "lion"], choices=list(OPTIMIZERS)
  )
  parser.add_argument(
    "--variants",
    nargs="+",
    default=None,
    choices=VARIANTS,
    help="the first one is the reference for ratios and exactness (default: "
    f"{' '.join(DEFAULT_VARIANTS)}; on a GPU {' '.join(GPU_VARIANTS)})",
  )
  args = parser.parse_args()
  on_cpu = jax.default_backend() == "cpu"
  scale = args.scale if args.scale is not None else (0.25 if on_cpu else 1.0)
  repeats = args.repeats if args.repeats is not None else (5 if on_cpu else 20)
  variants = tuple(args.variants or (DEFAULT_VARIANTS if on_cpu else GPU_VARIANTS))
  device = jax.devices()[0]
  print(
    f"jax {jax.__version__}, optax {optax.__version__}, backend {jax.default_backend()} "
    f"({device.device_kind}), scale {scale}, {repeats} timed rounds per variant"
  )
  header = (
    f"{'tree':<14} {'opt':<13} {'variant':<14} {'params':>8} {'leaves':>6} "
    f"{'buffers':>7} {'ops':>7} {'step ms':>9} {'limit ms':>9} {'of limit':>8} {'speedup':>9} "
    f"{'compile s':>9} {'compile x':>9} {'exact':>5} {'temp MB':>8}"
  )
  for tree_name in args.trees:
    shapes = tree_shapes(tree_name, scale)
    params = random_tree(shapes, 0, 0.05)
    grads = random_tree(shapes, 1, 1e-3)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    bandwidth = copy_bandwidth(n_params, repeats=max(2 * repeats, 10))
    print(
      f"\n{tree_name}: copy bandwidth {bandwidth / 1e9:.1f} GB/s (donated x + 1 over "
      f"{n_params / 1e6:.1f}M floats)"
    )
    print(header)
    for tx_name in args.optimizers:
      limit = update_bytes(OPTIMIZERS[tx_name](), params) / bandwidth
      results = measure(tx_name, params, grads, variants, repeats, args.group_size)
      base = results[variants[0]]
      for name in variants:
        row = results[name]
        step = statistics.median(row["times"])
        print(
          f"{tree_name:<14} {tx_name:<13} {name:<14} {n_params / 1e6:>7.1f}M "
          f"{len(jax.tree.leaves(params)):>6} {row['buffers']:>7} {row['ops']:>7} {step * 1e3:>9.2f} "
          f"{limit * 1e3:>9.2f} {limit / step:>8.2f} "
          f"{statistics.median(base['times']) / step:>8.2f}x {row['compile']:>9.2f} "
          f"{row['compile'] / base['compile']:>8.2f}x {'yes' if row['exact'] else 'NO':>5} "
          f"{'-' if row['temp'] is None else format(row['temp'] / 1e6, '.1f'):>8}"
        )


if __name__ == "__main__":
  main()
