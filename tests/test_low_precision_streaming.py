"""`low_precision`'s streamed update: the same values as the whole-tree update, and a bounded peak.

The streamed update decodes, updates and encodes one param leaf at a time;
the whole-tree update (``stream=False``) expands the whole state to float32
first. Both are compared step by step from the same inputs, over the
optimizer table, and the compiled step's temporaries are read from XLA's
memory analysis.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optimizer_table import (
  LOW_PRECISION_MODES,
  TABLE,
  grads_and_extras,
  initial_params,
  make_params,
  to_numpy,
)

from t5x_optim import (
  OptaxWrapper,
  low_precision,
  low_precision_sum_squares,
  low_precision_to_float32,
)
from t5x_optim._low_precision import low_precision as low_precision_module
from t5x_optim._low_precision.low_precision import _row_split, _stats_split, _stream_plan
from t5x_optim._low_precision.quantize4 import Rank1Quantized4Leaf

pytestmark = pytest.mark.usefixtures("shared_compilation_cache")

MODES = ["8bit", "bfloat16"]
STEPS = 3
ELEMENTWISE = [
  lambda: optax.adamw(1e-2),
  lambda: optax.chain(optax.clip_by_global_norm(0.1), optax.lion(1e-3)),
  lambda: optax.sgd(1e-2, momentum=0.9, nesterov=True),
]
"""Updates that stream: elementwise per leaf, one with a global norm computed first."""
ELEMENTWISE_IDS = ["adamw", "clip+lion", "nesterov"]


def _pair(make, mode, **kwargs):
  options = dict(block_size=4, shard_multiple=1, min_size=0, **kwargs)
  return (
    low_precision(make(), mode, stream=True, **options),
    low_precision(make(), mode, stream=False, **options),
  )


def _close(got, want, *, rtol: float, spread: float, atol=None) -> None:
  """Leaf by leaf: at most a ``spread`` share of elements differ by more than ``rtol``.

  ``atol``: None, or a tree like ``want`` of absolute tolerances per element.
  """
  atols = [0.0] * len(jax.tree.leaves(want)) if atol is None else jax.tree.leaves(atol)
  for (path, x), y, a in zip(
    jax.tree.leaves_with_path(to_numpy(got)), jax.tree.leaves(to_numpy(want)), atols
  ):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    off = ~np.isclose(x, y, rtol=rtol, atol=0, equal_nan=True) & ~(np.abs(x - y) <= a)
    assert off.sum() <= spread * off.size, (
      jax.tree_util.keystr(path),
      off.sum(),
      x[off][:4],
      y[off][:4],
    )


def _assert_same_state_and_updates(streamed, whole, params, *, jit):
  """From the same inputs at every step: the same updates and decoded state, to rounding.

  The whole-tree update is not a function of each leaf alone: XLA rounds a
  leaf's update differently with other leaves beside it (see
  `test_whole_tree_rounding_depends_on_the_other_leaves`), by a float32 ulp;
  a stored value next to a rounding boundary (an 8-bit threshold) may then
  land on the other side of it.
  """
  state = whole.init(params)
  assert jax.tree.structure(streamed.init(params)) == jax.tree.structure(state)

  def step(tx, grads, state, params, arrays, functions):
    return tx.update(grads, state, params, **arrays, **dict(functions))

  if jit:  # One compilation per transformation: the extras' functions are static.
    step = jax.jit(step, static_argnums=(0, 5))
  for _ in range(STEPS):
    grads, extras = grads_and_extras(whole, params)
    functions = tuple(sorted((k, v) for k, v in extras.items() if callable(v)))
    arrays = {k: v for k, v in extras.items() if not callable(v)}
    got_updates, got_state = step(streamed, grads, state, params, arrays, functions)
    want_updates, want_state = step(whole, grads, state, params, arrays, functions)
    assert jax.tree.structure(got_state) == jax.tree.structure(want_state)
    # An update is added to its param: one float32 ulp of the param is below
    # what the step can tell apart (schedule-free's update, a difference of
    # param-sized interpolations, shows it).
    ulps = jax.tree.map(lambda p: np.spacing(np.abs(np.asarray(p, np.float32))), params)
    _close(got_updates, want_updates, rtol=1e-5, spread=0.0, atol=ulps)
    _close(
      low_precision_to_float32(got_state),
      low_precision_to_float32(want_state),
      rtol=1e-5,
      spread=0.02,
    )
    params, state = optax.apply_updates(params, want_updates), want_state


@pytest.mark.slow
@pytest.mark.parametrize("case", TABLE, ids=repr)
def test_streamed_update_equals_the_whole_tree_update(case):
  """The whole table in bfloat16; the 8-bit codec, the same in both updates, in the quick test.

  (Each 8-bit case compiles its codec once per leaf twice over: 10-25 s.)
  """
  params = initial_params(case)
  _assert_same_state_and_updates(*_pair(case.make, "bfloat16"), params, jit=True)


@pytest.mark.parametrize("mode", [pytest.param("8bit", marks=pytest.mark.slow), "bfloat16"])
@pytest.mark.parametrize("make", ELEMENTWISE, ids=ELEMENTWISE_IDS)
@pytest.mark.slow
def test_streamed_update_equals_the_whole_tree_update_quick(make, mode):
  _assert_same_state_and_updates(*_pair(make, mode), make_params(), jit=True)


@pytest.mark.parametrize("min_size", [pytest.param(0, marks=pytest.mark.slow), 1])
@pytest.mark.parametrize("mode", LOW_PRECISION_MODES)
def test_empty_and_one_element_leaves_stream_beside_compressed_ones(mode, min_size):
  """An empty param (a first or a last dimension of 0) and a one-element one beside a
  compressed leaf: the streamed update is the whole-tree one (``min_size=0`` compresses
  them too)."""
  params = {
    "rows0": jnp.zeros((0, 8)),
    "cols0": jnp.zeros((8, 0)),
    "one": jnp.ones((1, 1)),
    "w": jnp.linspace(-1.0, 1.0, 8 * 16).reshape(8, 16),
  }
  grads = jax.tree.map(lambda p: jnp.cos(3.0 * p + 1.0), params)
  options = dict(block_size=4, shard_multiple=1, min_size=min_size)
  streamed, whole = (
    low_precision(optax.adamw(1e-2), mode, stream=stream, **options) for stream in (True, False)
  )
  got, want = streamed.init(params), whole.init(params)
  for _ in range(STEPS):
    got_updates, got = jax.jit(streamed.update)(grads, got, params)
    want_updates, want = jax.jit(whole.update)(grads, want, params)
    _close(got_updates, want_updates, rtol=1e-5, spread=0.0)
    _close(low_precision_to_float32(got), low_precision_to_float32(want), rtol=1e-5, spread=0.0)
  assert got_updates["w"].shape == (8, 16) and got_updates["rows0"].shape == (0, 8)


def _adamw_updates(tx, params, grads, steps=2):
  state = tx.init(params)
  for _ in range(steps):
    updates, state = jax.jit(tx.update)(grads, state, params)
  return {k: np.asarray(v) for k, v in updates.items()}


@pytest.mark.usefixtures("xla_optimized")
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["8bit", "bfloat16"])
def test_whole_tree_rounding_depends_on_the_other_leaves(mode):
  """Why streamed and whole-tree updates differ in the last bit: the whole tree's does.

  Compiled with a second leaf beside it, optax's adamw rounds a leaf's
  update differently from the same leaf alone: XLA's algebraic simplifier
  rewrites the divisions by the bias corrections, scalars that the leaves
  share, as ``m / (c * d)`` instead of ``(m / c) / d`` (or as ``m * (1 / c)``)
  depending on their users. The streamed update computes each leaf's
  update apart, bit for bit the whole-tree update of that leaf alone.
  """
  rng = np.random.default_rng(0)
  params = {"a": rng.normal(size=(16, 32)), "b": rng.normal(size=(64,))}
  params = {k: jnp.asarray(v, jnp.float32) for k, v in params.items()}
  grads = {k: jnp.asarray(0.1 * rng.normal(size=v.shape), jnp.float32) for k, v in params.items()}
  alone = {"b": params["b"]}, {"b": grads["b"]}
  plain = _adamw_updates(optax.adamw(1e-2), params, grads, steps=1)["b"]
  plain_alone = _adamw_updates(optax.adamw(1e-2), *alone, steps=1)["b"]
  assert (plain != plain_alone).any()
  options = dict(block_size=4, shard_multiple=1, min_size=0, stochastic_rounding=False)
  streamed = low_precision(optax.adamw(1e-2), mode, stream=True, **options)
  whole = low_precision(optax.adamw(1e-2), mode, stream=False, **options)
  np.testing.assert_array_equal(
    _adamw_updates(streamed, params, grads)["b"], _adamw_updates(whole, *alone)["b"]
  )
  assert (_adamw_updates(whole, params, grads)["b"] != _adamw_updates(whole, *alone)["b"]).any()


def test_elementwise_optimizers_stream_and_others_do_not():
  params = {"w": jnp.ones((4, 8)), "b": jnp.ones((8,))}
  state = low_precision(optax.adam(1e-3), min_size=0).init(params)
  assert _stream_plan(optax.adam(1e-3), params, state, params, {}) is not None
  # adafactor's factored moments are not param-shaped: nothing streams where nothing is compressed.
  factored = low_precision(optax.adafactor(1e-3), min_size=0)
  fstate = factored.init(params)
  assert _stream_plan(optax.adafactor(1e-3), params, fstate, params, {}) is None
  # No params: optax's update may not read them, but the stream needs their shapes.
  assert _stream_plan(optax.adam(1e-3), params, state, None, {}) is None


def _lowered_step(tx, n):
  params = {f"l{i}": jax.ShapeDtypeStruct((64, 256), jnp.float32) for i in range(n)}
  opt = jax.eval_shape(lambda p: OptaxWrapper(tx).create(p), params)
  return jax.jit(lambda o, g: o.apply_gradient(g)).lower(opt, params).as_text()


@pytest.mark.parametrize("mode", ["8bit", "bfloat16"])
def test_leaves_of_one_shape_trace_and_lower_the_codec_once(mode):
  """The streamed step's program grows by a call per leaf, not by a codec per leaf.

  Leaves with the same program and shape call the same jitted branch and
  encoders, which JAX traces and lowers once: eight leaves lower to a
  program under twice two leaves' (a copy of the codec per leaf: 4
  times), and trace several times faster.
  """
  tx = low_precision(optax.adamw(1e-3), mode)
  assert len(_lowered_step(tx, 8)) < 2 * len(_lowered_step(tx, 2))


def _fused_bodies(hlo: str, root: str) -> list[str]:
  """The fused computations of compiled HLO text whose root is ``root``, names stripped."""
  bodies = re.findall(r"\n(%fused_computation[^\n]*\{\n.*?\n\})", hlo, flags=re.S)
  out = []
  for body in bodies:
    if re.search(rf"ROOT %\S+ = {re.escape(root)}", body):
      lines = [re.sub(r", metadata=\{.*\}", "", line) for line in body.splitlines()[1:]]
      out.append(re.sub(r"%[\w.\-]+", "%", "\n".join(lines)))
  return out


@pytest.mark.parametrize(
  "stream", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["streamed", "whole-tree"]
)
def test_equal_leaves_compile_one_stochastic_rounding_encoder(stream):
  """The encoders of equal bfloat16 leaves are one computation, which XLA compiles once.

  Each leaf hashes its own rounding key from the step's key and its index,
  both operands of its encoders, not constants folded into them, so the
  encoders of leaves of one shape are the same and XLA:CPU reuses one
  compiled kernel for them (a leaf's index folded into each encoder made
  bfloat16's step compile several times slower). Nor does any other
  computation depend on the leaf: the step holds as many distinct
  computations for 8 equal leaves as for 4 (a key hashed per leaf before
  the encoders was a small kernel apiece, about 10 ms of compile each). The
  same holds for the whole-tree update.
  """
  shape = (64, 256)

  def compiled(n: int) -> str:
    params = {f"l{i}": jax.ShapeDtypeStruct(shape, jnp.float32) for i in range(n)}
    opt = jax.eval_shape(
      lambda p: OptaxWrapper(low_precision(optax.adamw(1e-3), "bfloat16", stream=stream)).create(p),
      params,
    )
    return jax.jit(lambda o, g: o.apply_gradient(g)).lower(opt, params).compile().as_text()

  four, eight = compiled(4), compiled(8)
  encoders = _fused_bodies(four, f"bf16[{shape[0]},{shape[1]}]")
  assert len(encoders) >= 8
  # One for mu, one for nu (the two moments' programs differ).
  assert len(set(encoders)) <= 2
  assert len(set(_fused_bodies(eight, ""))) == len(set(_fused_bodies(four, "")))


def _step_memory(tx, shapes, platform="cpu"):
  """XLA's memory analysis of the donated optimizer step, compiled for ``platform``."""
  try:
    device = jax.devices(platform)[0]
  except RuntimeError as e:
    pytest.skip(f"no {platform} backend in this process (JAX_PLATFORMS=cpu,cuda adds one): {e}")
  on_device = jax.sharding.SingleDeviceSharding(device)
  params = {
    f"l{i}": jax.ShapeDtypeStruct(s, jnp.float32, sharding=on_device) for i, s in enumerate(shapes)
  }
  opt = jax.eval_shape(lambda p: OptaxWrapper(tx).create(p), params)
  opt = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on_device), opt)
  step = jax.jit(lambda o, g: o.apply_gradient(g), donate_argnums=0)
  return step.lower(opt, params).compile().memory_analysis()


PLATFORMS = ["cpu", pytest.param("gpu", marks=pytest.mark.slow)]
"""Where the peak tests compile: the test process's CPU, and its GPU where it has one."""


@pytest.mark.parametrize("mode", [pytest.param("8bit", marks=pytest.mark.slow), "bfloat16"])
def test_streamed_step_temporaries_are_one_leafs_not_the_trees(mode):
  """Eight equal leaves: the streamed step's temporaries are those of about one leaf.

  The whole-tree update keeps many leaves' float32 state (or a copy of the
  stored one) live at once: over 2 bytes per param (bfloat16: 4). On XLA:CPU
  only: XLA:GPU's schedule of the whole-tree update of these leaves holds 1.1
  bytes per param (bfloat16: none).
  """
  shapes, size = [(256, 512)] * 8, 256 * 512
  streamed = _step_memory(low_precision(optax.adamw(1e-3), mode), shapes)
  whole = _step_memory(low_precision(optax.adamw(1e-3), mode, stream=False), shapes)
  n = size * len(shapes)
  assert whole.temp_size_in_bytes >= 2 * n
  # Decoded mu and nu, the new ones and the update of one leaf: at most 3
  # float32 copies of one leaf (the 8-bit guard against non-finite values
  # holds none: its selects fuse into the scales' reduction).
  assert streamed.temp_size_in_bytes <= 3 * 4 * size
  assert math.isclose(
    streamed.argument_size_in_bytes, whole.argument_size_in_bytes, rel_tol=0, abs_tol=0
  )


@pytest.mark.parametrize("shape", [(8, 512, 512), (2, 1024, 1024)])
def test_a_stack_of_few_leaves_holds_a_chunk_not_a_stripe(shape):
  """8 experts (or layers) stacked first: the 4-bit statistics walked the first axis alone,
  whose 8 stripes left one chunk each, and held the whole leaf's new moments (8.1 bytes per
  value; (2, 1024, 1024): 8.2). They walk the second axis: 0.1 and 0.6."""
  memory = _step_memory(low_precision(optax.adamw(1e-3), "4bit"), [shape])
  assert memory.temp_size_in_bytes <= 0.7 * math.prod(shape)


_MASKED_INNERS = {
  "masked": lambda: optax.masked(optax.adamw(1e-3), {"l0": True, "l1": False, "l2": True}),
  "multi_transform": lambda: optax.multi_transform(
    {"a": optax.adamw(1e-3), "s": optax.sgd(1e-3, momentum=0.9)},
    {"l0": "a", "l1": "s", "l2": "a"},
  ),
}


@pytest.mark.parametrize("mode", [pytest.param("8bit", marks=pytest.mark.slow), "4bit"])
@pytest.mark.parametrize("inner", list(_MASKED_INNERS))
def test_a_masked_or_partitioned_update_streams(inner, mode):
  """Inside optax.masked with a mask that leaves params out, or a part of multi_transform, a
  state mirrors the params with MaskedNode holes: taken for a global leaf, so the update did
  not stream, and the 4-bit step's temporaries took 16 bytes per param (25.1 at the peak
  against float32 adamw's 24.0), 8-bit's 2.1. Each leaf streams, as outside them."""
  shapes, size = [(1024, 256), (256,), (1024, 256)], 1024 * 256
  params = {f"l{i}": jnp.ones(s) for i, s in enumerate(shapes)}
  make = _MASKED_INNERS[inner]
  tx = low_precision(make(), mode)
  assert _stream_plan(make(), params, tx.init(params), params, {}) is not None
  memory = _step_memory(tx, shapes)
  assert memory.temp_size_in_bytes <= 0.7 * 2 * size


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("mode", ["8bit", pytest.param("4bit", marks=pytest.mark.slow)])
def test_a_large_leafs_step_holds_a_chunk_not_a_float32_copy_of_the_leaf(mode, platform):
  """A vocabulary-sized leaf: the step's temporaries stay under 0.3 bytes per value (GPU: 0.4).

  The update is computed beside the caller's ``apply_updates`` (no float32
  update is held), the block statistics a chunk of rows at a time, and
  the encoders write their codes over the old ones (4-bit: a byte from its
  two values). Whole, the leaf's new moments took 2 float32 copies (4-bit,
  8.2 bytes per value) or 1 (8-bit, 4.3). On XLA:GPU, encoders that decoded
  the stored state as the update does shared that decode with it, held whole
  (8-bit: 8.2 bytes per value; reading it through the select, 0.33).
  """
  memory = _step_memory(low_precision(optax.adamw(1e-3), mode), [(32128, 768)], platform)
  assert memory.temp_size_in_bytes <= {"cpu": 0.3, "gpu": 0.4}[platform] * 32128 * 768


@pytest.mark.slow
def test_a_small_4bit_leafs_step_holds_a_chunk_not_a_float32_copy_of_the_leaf():
  """A 768 x 768 leaf, under ``stream_chunk``: the 4-bit step's temporaries stay under 1 byte
  per value, and its peak under float32 adamw's 16 bytes per param.

  XLA:CPU holds the input of the column maxima's reduction whole: computed
  for the whole leaf at once, its new moments took 8.2 bytes per value (a
  peak of 17.3 bytes per param); a leaf that stores column maxima computes
  its statistics in at least 16 chunks of rows (0.65).
  """
  memory = _step_memory(low_precision(optax.adamw(1e-3), "4bit"), [(768, 768)])
  n = 768 * 768
  assert memory.temp_size_in_bytes <= 1.0 * n
  peak = (
    memory.argument_size_in_bytes
    + memory.output_size_in_bytes
    + memory.temp_size_in_bytes
    - memory.alias_size_in_bytes
  )
  assert peak < 16 * n


@pytest.mark.parametrize(
  ("shape", "column_maxima", "want"),
  [
    ((768, 768), True, (8, 16, 6, 0)),  # under stream_chunk: 16 chunks of rows
    ((768, 768), False, None),  # fits in a chunk: whole
    ((4099, 16), True, None),  # prime rows: 4,099 chunks of one row walked, whole instead
    ((61, 16), True, (1, 61, 1, 0)),  # prime rows, a few more chunks than 16: walked
    ((4096, 16), True, (8, 16, 32, 0)),
    ((769, 768), True, (1, 769, 1, 0)),  # prime rows of a larger leaf: a row at a time
    ((4099, 4096), True, (1, 4099, 1, 0)),
    ((8, 512, 512), True, (8, 16, 4, 1)),  # 8 stacked: their second axis walked
    (
      (12, 768, 2048),
      False,
      (8, 24, 4, 1),
    ),  # along the first, 4 layers (6.3M values) a chunk  # over stream_chunk: a row at a time, never whole
  ],
)
def test_column_maxima_walk_at_least_16_chunks_unless_a_small_leafs_rows_divide_poorly(
  shape, column_maxima, want
):
  """A leaf under ``stream_chunk`` that stores column maxima walks 16 chunks of rows or a
  few more; where its rows divide only into far more, thin ones (a prime row count), a small
  leaf's statistics (at most 131,072 values: 1 MiB in float32) are computed whole, and a
  larger leaf's still walk a row at a time (whole, a 769 x 768 leaf's took 8.3 bytes per
  value)."""
  assert _stats_split(shape, 1, 1 << 20, 8, column_maxima=column_maxima) == want


def _row_split_by_every_divisor(shape, unit, limit, shard_multiple):
  """`_row_split`, trying every candidate count of units per chunk one by one."""
  if len(shape) < 2 or math.prod(shape) <= limit or shape[0] % unit:
    return None
  stripes = math.gcd(shape[0] // unit, shard_multiple)
  units = shape[0] // unit // stripes
  row = math.prod(shape[1:]) * stripes * unit
  fits = [k for k in range(1, units + 1) if units % k == 0 and k * row <= limit] or [1]
  if fits[-1] == units:
    return None
  return stripes, units // fits[-1], fits[-1] * unit


def test_row_split_picks_the_largest_dividing_chunk_of_rows():
  """Over first dimensions up to 1,000 (primes, squares, powers of two), blocks of 1, 2 and 8
  rows, rows of 1 to 24 values and 1, 2 or 8 shards: the same split as trying every divisor."""
  for rows in range(1, 1001):
    for unit, width, shards, limit in [
      (1, 1, 8, 64),
      (2, 3, 8, 100),
      (8, 24, 1, 4096),
      (1, 5, 2, 1),
    ]:
      shape = (rows, width)
      assert _row_split(shape, unit, limit, shards) == _row_split_by_every_divisor(
        shape, unit, limit, shards
      ), (shape, unit, limit, shards)


@pytest.mark.parametrize(
  ("shape", "want"),
  [
    ((2**31, 8), (8, 2**14, 2**14)),
    ((2**28 + 2**27, 8), (8, 3 * 2**10, 2**14)),
    ((2 * 1_000_000_007, 4), (2, 1_000_000_007, 1)),  # a prime count of rows per stripe
  ],
)
def test_row_split_of_a_huge_leaf_is_quick(shape, want):
  """Divisors are found up to the square root of the rows per stripe: a (2**31, 8) leaf's
  split takes microseconds, not the minute that trying every count of rows takes."""
  assert _row_split(shape, 1, 1 << 20, 8) == want


def _chunked_equals_whole(monkeypatch, update_c, update_w, grads, state_c, state_w, params):
  """One step chunked (`update_c`) and whole (`update_w`, the 16-chunk floor off), checked
  bit for bit; the whole step's updates and both new states."""
  got, state_c = update_c(grads, state_c, params)
  with monkeypatch.context() as m:
    m.setattr(low_precision_module, "_COLUMN_CHUNKS", 1)
    want, state_w = update_w(grads, state_w, params)
  for x, y in zip(jax.tree.leaves((got, state_c)), jax.tree.leaves((want, state_w)), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  return want, state_c, state_w


@pytest.mark.slow
@pytest.mark.usefixtures("default_emitters")
@pytest.mark.parametrize("guard", [True, False])
def test_a_small_4bit_leafs_statistics_in_chunks_change_no_value(monkeypatch, guard):
  """Leaves under ``stream_chunk`` that store column maxima walk at least 16 chunks of rows:
  with inf, -inf and NaN gradients, the same updates and states, bit for bit, as their
  statistics computed whole (at least one chunk); beside a 1-D and an empty leaf, with
  blocks of two rows, and rows of a prime count (61 chunks of one row); a stack of 8 leaves
  (8 experts or layers first), whose first axis holds one stripe of 4 per shard and so walks
  its second (split along the first, a stripe of (8, 512, 512) took 8.1 bytes per value)."""
  rng = np.random.default_rng(0)
  shapes = {"w": (64, 32), "prime": (61, 16), "narrow": (96, 4), "vec": (48,), "empty": (0,)}
  shapes["stack"] = (8, 64, 32)
  params = {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in shapes.items()}
  options = dict(block_size=8, shard_multiple=2, min_size=0, guard_nonfinite=guard)
  chunked = low_precision(optax.adamw(1e-2), "4bit", **options)
  update_c = jax.jit(chunked.update)
  update_w = jax.jit(low_precision(optax.adamw(1e-2), "4bit", **options).update)
  state_c = state_w = chunked.init(params)
  assert isinstance(state_c.inner_state[0].mu["w"], Rank1Quantized4Leaf)
  assert _row_split((64, 32), 1, 64 * 32 // 16, 2) is not None
  assert _stats_split((8, 64, 32), 1, 1 << 20, 2, column_maxima=True).axis == 1
  for i in range(STEPS):
    grads = jax.tree.map(lambda x: jnp.cos(x * (i + 1)), params)
    grads["w"] = grads["w"].at[5, 3].set(jnp.inf).at[40, 7].set(jnp.nan)
    grads["prime"] = grads["prime"].at[50, 1].set(-jnp.inf)
    want, state_c, state_w = _chunked_equals_whole(
      monkeypatch, update_c, update_w, grads, state_c, state_w, params
    )
    params = optax.apply_updates(params, jax.tree.map(jnp.nan_to_num, want))


@pytest.mark.slow
@pytest.mark.parametrize("guard", [True, False])
def test_4bit_column_maxima_of_a_whole_leaf_match_chunked_ones_with_inf_and_nan(monkeypatch, guard):
  """Column maxima computed over a whole leaf (a large ``stream_chunk``, the 16-chunk floor
  off) and combined over chunks of rows (``stream_chunk=128``): with inf, -inf and NaN
  gradients, with or without the guard, the same updates and states, bit for bit. XLA:CPU's
  float32 maximum over the 97 rows of a (97, 128) leaf drops a NaN; without the guard the
  NaN enters the column maxima either way."""
  rng = np.random.default_rng(0)
  shapes = {"w": (97, 128), "small": (64, 32)}
  params = {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in shapes.items()}
  options = dict(min_size=0, guard_nonfinite=guard)
  chunked = low_precision(optax.adamw(1e-2), "4bit", stream_chunk=128, **options)
  update_c = jax.jit(chunked.update)
  update_w = jax.jit(low_precision(optax.adamw(1e-2), "4bit", **options).update)
  state_c = state_w = chunked.init(params)
  assert all(isinstance(x, Rank1Quantized4Leaf) for x in state_c.inner_state[0].mu.values())
  for i in range(STEPS):
    grads = jax.tree.map(lambda x: jnp.cos(x * (i + 1)), params)
    grads = {
      k: g.at[5, 3].set(jnp.nan).at[40, 7].set(jnp.inf).at[60, 9].set(-jnp.inf)
      for k, g in grads.items()
    }
    want, state_c, state_w = _chunked_equals_whole(
      monkeypatch, update_c, update_w, grads, state_c, state_w, params
    )
    if not guard:
      assert np.isnan(np.asarray(state_w.inner_state[0].mu["w"].cols[3]))
    params = optax.apply_updates(params, jax.tree.map(jnp.nan_to_num, want))


@pytest.mark.slow
def test_the_encoders_decode_the_codes_themselves():
  """8-bit: the encoders' decode of the old codes is their own, not merged with the update's.

  The two decodes were the same computation, and XLA's common-subexpression
  elimination merged them; XLA:GPU then computed the decoded moments once
  and held them whole from the update to the encoders (8.2 bytes per value
  of temporaries for a 32128 x 768 leaf on an H200). XLA:CPU recomputes a
  decode in each fusion, so its memory does not show the merge; the compiled
  program's instructions, named by the function that traced them, do.
  """
  params = {"w": jax.ShapeDtypeStruct((256, 512), jnp.float32)}
  tx = low_precision(optax.adamw(1e-3), "8bit")
  opt = jax.eval_shape(lambda p: OptaxWrapper(tx).create(p), params)
  step = jax.jit(lambda o, g: o.apply_gradient(g), donate_argnums=0)
  text = step.lower(opt, params).compile().as_text()
  names = re.findall(r'op_name="([^"]+)"', text)
  assert any("jit(step)/jit(_dequantize)" in name for name in names)
  assert any("jit(encoders)/jit(_dequantize)" in name for name in names)


def _chunked_pair(make, mode):
  options = dict(block_size=8, shard_multiple=2, min_size=0)
  return (
    low_precision(make(), mode, stream_chunk=64, **options),
    low_precision(make(), mode, **options),
  )


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["8bit", "4bit", "bfloat16"])
@pytest.mark.parametrize("make", ELEMENTWISE, ids=ELEMENTWISE_IDS)
def test_statistics_in_chunks_of_rows_change_no_value(make, mode):
  """``stream_chunk=64`` walks every matrix in chunks of rows: the same updates and states, bit
  for bit, as the statistics of whole leaves."""
  params = jax.tree.map(lambda x: jnp.tile(x, (4, 4)) if x.ndim == 2 else x, make_params())
  # 4 columns: 4-bit blocks of 2 rows, which a chunk never cuts.
  params["narrow"] = jnp.cos(jnp.arange(96 * 4, dtype=jnp.float32)).reshape(96, 4)
  assert all(_row_split(x.shape, 2, 64, 2) for x in jax.tree.leaves(params) if x.ndim == 2)
  chunked, whole = _chunked_pair(make, mode)
  state_c = state_w = whole.init(params)
  grads = jax.tree.map(lambda x: jnp.cos(3 * x), params)
  for _ in range(STEPS):
    got, state_c = jax.jit(chunked.update)(grads, state_c, params)
    want, state_w = jax.jit(whole.update)(grads, state_w, params)
    for x, y in zip(jax.tree.leaves((got, state_c)), jax.tree.leaves((want, state_w)), strict=True):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    params = optax.apply_updates(params, want)
    grads = jax.tree.map(lambda g: -0.5 * g + 0.01, grads)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["8bit", "4bit"])
@pytest.mark.parametrize("guard", [True, False])
def test_statistics_in_chunks_of_rows_match_whole_ones_with_inf_and_nan(mode, guard):
  """inf, -inf and NaN gradients, with or without the guard: chunked statistics (4-bit column
  maxima combined over chunks) store what whole ones do, bit for bit."""
  rng = np.random.default_rng(0)
  params = {
    "w": jnp.asarray(rng.normal(size=(64, 32)), jnp.float32),
    "narrow": jnp.asarray(rng.normal(size=(96, 4)), jnp.float32),
  }
  options = dict(block_size=8, shard_multiple=2, min_size=0, guard_nonfinite=guard)
  chunked = low_precision(optax.adamw(1e-2), mode, stream_chunk=64, **options)
  whole = low_precision(optax.adamw(1e-2), mode, **options)
  state_c = state_w = whole.init(params)
  for i in range(STEPS):
    grads = jax.tree.map(lambda x: jnp.cos(x * (i + 1)), params)
    grads["w"] = grads["w"].at[5, 3].set(jnp.inf).at[40, 7].set(jnp.nan)
    grads["narrow"] = grads["narrow"].at[50, 1].set(-jnp.inf)
    got, state_c = jax.jit(chunked.update)(grads, state_c, params)
    want, state_w = jax.jit(whole.update)(grads, state_w, params)
    for x, y in zip(jax.tree.leaves((got, state_c)), jax.tree.leaves((want, state_w)), strict=True):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow
def test_the_nonfinite_guard_costs_the_8bit_step_no_memory():
  """With or without the guard, the step holds under two float32 copies of a leaf.

  The guard's selects fuse into the reduction that computes the block
  scales: no branch, no pass over the leaf held in memory.
  """
  shapes, size = [(256, 512)] * 8, 256 * 512
  guarded = _step_memory(low_precision(optax.adamw(1e-3), "8bit"), shapes)
  plain = _step_memory(low_precision(optax.adamw(1e-3), "8bit", guard_nonfinite=False), shapes)
  assert guarded.temp_size_in_bytes <= plain.temp_size_in_bytes <= 2 * 4 * size


@pytest.mark.slow
def test_without_the_nonfinite_guard_apply_if_finite_still_refuses_the_step():
  tx = optax.apply_if_finite(
    low_precision(optax.adam(1e-2), "8bit", min_size=0, guard_nonfinite=False), 3
  )
  params = {"w": jnp.ones((4, 256))}
  state = jax.jit(tx.update)({"w": jnp.full((4, 256), 0.5)}, tx.init(params), params)[1]
  grads = {"w": jnp.full((4, 256), 0.5).at[1, 7].set(jnp.inf)}
  updates, after = jax.jit(tx.update)(grads, state, params)
  assert not np.asarray(updates["w"]).any()
  for x, y in zip(jax.tree.leaves(after.inner_state), jax.tree.leaves(state.inner_state)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


SUM_SQUARES_SHAPES = {
  "rows": (96, 40),
  "prime": (13, 257),
  "vector": (300,),
  "long": (2048,),
  "one": (1,),
  "empty": (0, 8),
  "cube": (12, 8, 16),
}


@pytest.mark.slow
@pytest.mark.parametrize("mode", LOW_PRECISION_MODES)
def test_sum_squares_equal_those_of_the_float32_values(mode):
  """A chunk of 512 values: the (96, 40) and (12, 8, 16) leaves are walked a chunk of rows at
  a time, the (2048,) one a run of whole blocks at a time; the others are decoded whole. The
  third step's gradient holds a NaN."""
  tx = low_precision(optax.adam(1e-2), mode, block_size=8, min_size=0)
  params = {name: jnp.zeros(shape) for name, shape in SUM_SQUARES_SHAPES.items()}
  state = tx.init(params)
  # numpy's generator: jax's compiles a sampler per shape, seconds for these six.
  rng = np.random.default_rng(0)
  update = jax.jit(lambda grads, state: tx.update(grads, state, params)[1])

  @jax.jit
  def sums(state):
    want = jax.tree.map(lambda x: jnp.sum(jnp.square(x)), low_precision_to_float32(state))
    return low_precision_sum_squares(state, chunk=512), want

  for step in range(3):
    grads = {k: rng.standard_normal(p.shape, np.float32) for k, p in params.items()}
    if step == 2:
      grads["rows"][50, 3] = np.nan
    state = update(grads, state)
    got, want = sums(state)
    got = jax.tree.leaves_with_path(got)
    for (path, x), y in zip(got, jax.tree.leaves(want), strict=True):
      np.testing.assert_allclose(x, y, rtol=2e-6, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("shape", [(4096, 1024), (4096 * 1024,)])
@pytest.mark.parametrize("mode", ["8bit", "4bit"])
def test_sum_squares_hold_a_chunk_not_a_float32_copy_of_the_state(mode, shape):
  """Jitted alone on a (4096, 1024) or a 1-D leaf of as many values, in chunks of 2**18 values
  (1 MiB in float32): a reduction of the decoded state holds its 32 MiB moments in float32."""
  tx = low_precision(optax.adam(1e-3), mode)
  params = {"w": jax.ShapeDtypeStruct(shape, jnp.float32)}
  state = jax.eval_shape(tx.init, params)

  def temporaries(fn) -> int:
    return jax.jit(fn).lower(state).compile().memory_analysis().temp_size_in_bytes

  def whole(s):
    return jax.tree.map(lambda x: jnp.sum(jnp.square(x)), low_precision_to_float32(s))

  assert temporaries(whole) >= 2 * 4 * 4096 * 1024
  assert temporaries(lambda s: low_precision_sum_squares(s, chunk=1 << 18)) <= 2 * 4 << 18
