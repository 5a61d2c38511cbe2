"""`low_precision` states sharded on 8 simulated CPU devices, planned and checkpointed."""

from __future__ import annotations

import functools
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import test_sharded_training as st
from _t5x import run_t5x_check, t5x_at_hand
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from t5x_optim import (
  OptaxWrapper,
  TrainState,
  float32_to_low_precision,
  low_precision,
  low_precision_sum_squares,
  low_precision_to_float32,
)
from t5x_optim._training import plan as plan_lib
from t5x_optim.checkpoints import Checkpointer
from t5x_optim.partitioning import abstract_train_state

pytestmark = pytest.mark.usefixtures("shared_compilation_cache")

MODES = ["8bit", "bfloat16"]


def _low_precision(mode, stream=True):
  # Blocks of 4, 4 or more per last dimension: the scales shard over 4 and 8 devices too.
  return low_precision(
    optax.adamw(1e-2), mode, block_size=4, shard_multiple=4, min_size=0, stream=stream
  )


@functools.cache
def _opt_def(mode):
  return OptaxWrapper(_low_precision(mode))


def _fresh(mode):
  return TrainState.create(_opt_def(mode), st._variables("axes"))


def _train(state, partitioner=None):
  step = functools.partial(st._train_step, st.AxesMLP())
  if partitioner is None:
    return st._run(state, jax.jit(step))
  shardings = partitioner.get_shardings(state)
  step_fn = partitioner.partition(
    step, (shardings, st.BATCH_AXES), (shardings, None), donate_argnums=0
  )
  return st._run(jax.device_put(state, shardings), step_fn)


@functools.cache
def _unsharded(mode):
  return _train(_fresh(mode))


def _expected_specs(mode, zero):
  """Mesh specs of every state leaf on the 2x4 mesh, written out (trailing Nones dropped)."""
  wi, bi, wo = (
    (P("data", "model"), P(("model", "data")), P("model", "data"))
    if zero
    else (P(None, "model"), P("model"), P("model"))
  )
  specs = {".count": P(), ".inner_state[0].count": P()}
  for moment in ("mu", "nu"):
    for name, spec in (("wi", wi), ("bi", bi), ("wo", wo)):
      where = f".inner_state[0].{moment}['{name}']"
      if mode == "8bit":
        specs[f"{where}.codes"] = specs[f"{where}.scales"] = spec
      else:
        specs[where] = spec
  return specs


def _spec_paths(tree):
  return {
    jax.tree_util.keystr(path): spec
    for path, spec in jax.tree.leaves_with_path(
      st._actual_specs(tree), is_leaf=lambda x: isinstance(x, P)
    )
  }


def _bytes(state):
  """(bytes on device 0, total bytes) of the state leaves with more than one element."""
  leaves = [x for x in jax.tree.leaves(state.param_states) if x.size > 1]
  return sum(x.addressable_shards[0].data.nbytes for x in leaves), sum(x.nbytes for x in leaves)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("zero", [False, True])
def test_sharded_training_matches_unsharded(mode, zero):
  """Same losses and state as unsharded, the written-out specs, and the ideal bytes per device."""
  want_state, want_losses = _unsharded(mode)
  partitioner = st._partitioner(2, 4, zero=zero)
  state, losses = _train(_fresh(mode), partitioner)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-7)
  assert _spec_paths(state.param_states) == _expected_specs(mode, zero)
  _, rule_specs = st._expected_specs(state, partitioner)
  assert st._actual_specs(state.param_states) == st._normalized(rule_specs)
  on_device, total = _bytes(state)
  assert on_device == total / (8 if zero else 4)  # without ZeRO, replicated over data=2
  for got, want in zip(
    jax.tree.leaves(state.param_states), jax.tree.leaves(want_state.param_states)
  ):
    assert got.dtype == want.dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["8bit", "4bit"])
def test_statistics_in_chunks_of_rows_shard_like_whole_leaves(mode):
  """``stream_chunk=16``: each matrix's statistics walk chunks of rows, one stripe per shard.

  Unsharded, the run is the whole leaves' bit for bit; sharded over 2 x 4
  with ZeRO (the rows split over devices), it matches it as the sharded run
  of whole leaves does.
  """

  def fresh(chunk):
    tx = low_precision(
      optax.adamw(1e-2), mode, block_size=4, shard_multiple=4, min_size=0, stream_chunk=chunk
    )
    return TrainState.create(OptaxWrapper(tx), st._variables("axes"))

  want, want_losses = _train(fresh(1 << 20))
  got, losses = _train(fresh(16))
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  sharded, sharded_losses = _train(fresh(16), st._partitioner(2, 4, zero=True))
  np.testing.assert_allclose(sharded_losses, want_losses, rtol=1e-5, atol=1e-7)
  for x, y in zip(
    jax.tree.leaves(sharded.param_states), jax.tree.leaves(want.param_states), strict=True
  ):
    np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), atol=1e-6)


STREAM = pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole_tree"])


@pytest.mark.slow
@STREAM
@pytest.mark.parametrize("mode", ["8bit", "4bit", "bfloat16"])
def test_explicit_mesh_axes_zero_update_as_auto(mode, stream):
  """ZeRO under Explicit axes, through `OptaxWrapper`; without ZeRO the transformation alone
  is tested below."""

  def steps(axis_types):
    return st.optimizer_steps(OptaxWrapper(_low_precision(mode, stream)), axis_types, zero=True)

  st.assert_explicit_as_auto(steps(AxisType.Explicit), steps(AxisType.Auto))


@pytest.mark.slow
@pytest.mark.parametrize("mode", [None, "8bit"])
def test_checkpoint_round_trip_on_explicit_mesh_axes(tmp_path, mode):
  opt_def = OptaxWrapper(optax.adamw(1e-2) if mode is None else _low_precision(mode))
  state = st.optimizer_steps(opt_def, AxisType.Explicit, zero=True)
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(2, state)
  fresh = TrainState.create(opt_def, st._variables("axes"))
  partitioner = st._partitioner(2, 4, zero=True, axis_types=AxisType.Explicit)
  with Checkpointer(tmp_path) as ckpt:
    restored = ckpt.restore(jax.device_put(fresh, partitioner.get_shardings(fresh)))
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
    assert got.sharding == want.sharding
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  grads = jax.tree.map(jnp.ones_like, restored.params)
  stepped = jax.jit(lambda s, g: s.apply_gradient(g))(restored, grads)
  assert [x.sharding for x in jax.tree.leaves(stepped)] == [
    x.sharding for x in jax.tree.leaves(state)
  ]


@pytest.mark.slow
@STREAM
@pytest.mark.parametrize("mode", ["8bit", "4bit", "bfloat16"])
def test_the_transformation_alone_on_explicit_mesh_axes(mode, stream):
  """Without `OptaxWrapper`: the streamed update orders its leaves by reading each new param's
  first element, a slice of a sharded dimension, which Explicit axes refuse unless it runs
  with the axes Auto."""
  specs = {"wi": P(None, "model"), "bi": P("model"), "wo": P("model", None)}
  tx = _low_precision(mode, stream)

  def steps(axis_types):
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_types,) * 2)
    params = st._variables("axes")["params"]
    shardings = {k: NamedSharding(mesh, spec) for k, spec in specs.items()}
    params = jax.device_put(dict(params), shardings)
    grads = jax.device_put(jax.tree.map(lambda x: jnp.sin(3.0 * x + 1.0), params), shardings)

    @jax.jit
    def step(params, state):
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    params, state = params, tx.init(params)
    for _ in range(2):
      params, state = step(params, state)
    return params, state

  (params, state), (want_params, want_state) = steps(AxisType.Explicit), steps(AxisType.Auto)
  # To float32 rounding: under Explicit axes XLA fuses the whole-tree update apart.
  for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(want_state), strict=True):
    assert x.dtype == y.dtype
    np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=1e-6)
  for k, spec in specs.items():
    assert params[k].sharding.spec == spec
    np.testing.assert_allclose(params[k], want_params[k], rtol=1e-6, atol=1e-7)


@pytest.mark.slow
@STREAM
@pytest.mark.parametrize("mode", ["8bit", "4bit", "bfloat16"])
def test_the_transformation_alone_on_a_zero_state_on_explicit_mesh_axes(mode, stream):
  """Without `OptaxWrapper`, on a state the rules lay out with ZeRO: a quantized leaf's scales
  are laid out apart from its codes, each moment apart from its gradient, and Explicit axes
  refuse the decoder's and Adam's operations on both unless the update runs with the axes
  Auto (8 and 4 bits failed in the decoder, bfloat16 in Adam's sum)."""
  tx = _low_precision(mode, stream)
  step = jax.jit(lambda grads, state, params: tx.update(grads, state, params))

  def update(axis_types):
    _, state, grads = st._optimizer_step(OptaxWrapper(tx), axis_types, zero=True)
    updates, new_state = step(grads, state.param_states, state.params)
    return (updates, new_state), (grads, state.param_states)

  (got, before), (want, _) = update(AxisType.Explicit), update(AxisType.Auto)
  assert [_spec(x) for x in jax.tree.leaves(got)] == [_spec(x) for x in jax.tree.leaves(before)]
  # To float32 rounding: the whole-tree 4-bit update fuses apart, as above.
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=1e-6)


def _spec(x):
  return st._normalized(jax.typeof(x).sharding.spec)


@pytest.mark.slow
@pytest.mark.parametrize(
  "mode, shard_multiple", [("8bit", 1), ("8bit", 8), ("4bit", 1), ("bfloat16", 1)]
)
def test_init_on_explicit_mesh_axes_lays_the_state_out_as_the_rules(mode, shard_multiple):
  """``init`` of params placed on Explicit axes, eagerly and jitted: Auto's values, and each
  stored leaf laid out as the rules lay it out (blocks that span their shards, with
  ``shard_multiple=1``: the encoder failed, reading values of several devices)."""
  tx = low_precision(optax.adamw(1e-2), mode, min_size=0, shard_multiple=shard_multiple)
  fresh = TrainState.create(OptaxWrapper(tx), st._variables("axes"))
  states = {}
  for axis_types in (AxisType.Explicit, AxisType.Auto):
    partitioner = st._partitioner(2, 4, zero=False, axis_types=axis_types)
    shardings = partitioner.get_shardings(fresh)
    params = jax.device_put(fresh.params, shardings.params)
    with jax.set_mesh(partitioner.mesh):
      states[axis_types] = tx.init(params), jax.jit(tx.init)(params)
  rules = [st._normalized(x.spec) for x in jax.tree.leaves(shardings.param_states)]
  for state in states[AxisType.Explicit]:
    assert [_spec(x) for x in jax.tree.leaves(state)] == rules
  for got, want in zip(states[AxisType.Explicit], states[AxisType.Auto], strict=True):
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["8bit", "bfloat16"])
def test_eager_calls_on_explicit_mesh_axes(mode):
  """Unjitted, on params placed on Explicit axes: ``init``, ``update`` and the converters,
  the last from host values. Optax's init makes its step count on one device, which goes
  onto the mesh with the axes Auto only in the mesh's context (the update, then the encoder
  of host values, failed: "Please enter your `jit` into a mesh context")."""
  tx = low_precision(optax.adamw(1e-2), mode, min_size=0, shard_multiple=1)
  fresh = TrainState.create(OptaxWrapper(tx), st._variables("axes"))
  out = {}
  for axis_types in (AxisType.Explicit, AxisType.Auto):
    partitioner = st._partitioner(2, 4, zero=False, axis_types=axis_types)
    params = jax.device_put(fresh.params, partitioner.get_shardings(fresh).params)
    updates, state = tx.update(st._grads(params), tx.init(params), params)
    host = jax.tree.map(np.asarray, low_precision_to_float32(state))
    out[axis_types] = updates, state, float32_to_low_precision(host, state)
  got, want = out[AxisType.Explicit], out[AxisType.Auto]
  assert [_spec(x) for x in jax.tree.leaves(got[2])] == [_spec(x) for x in jax.tree.leaves(got[1])]
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=1e-6)


def test_a_replicated_four_bit_matrix_initializes_on_explicit_mesh_axes():
  """A (64, 32) param replicated (``P()``) and a stack sharded on its first axis alone
  (``P('model')``), 4-bit on a mesh of Explicit axes: init raised IndexError, the column
  maxima's spec read the last entry of a spec that stops before it."""
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  params = {
    "w": jax.device_put(jnp.ones((64, 32)), NamedSharding(mesh, P())),
    "stack": jax.device_put(jnp.ones((8, 64, 32)), NamedSharding(mesh, P("model"))),
  }
  state = low_precision(optax.adamw(1e-2), "4bit", min_size=0).init(params)
  mu = state.inner_state[0].mu
  assert mu["w"].cols.sharding.spec == P(None)
  assert mu["stack"].codes.sharding.spec == P("model", None, None)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["8bit", "4bit", "bfloat16"])
def test_converters_on_explicit_mesh_axes(mode):
  """`low_precision_to_float32` and `float32_to_low_precision` of a ZeRO state on Explicit
  axes give Auto's values bit for bit: each float32 leaf in its codes' layout, each stored leaf
  in the layout of the one it replaces (8 and 4 bits failed: the decoder reads the codes and
  scales together, which Explicit axes refuse where they are laid out apart)."""
  # The default blocks: a block of wo's codes (32, 16) spans a row, sharded over ``data``, so
  # its scales (32, 1) are sharded over ('model', 'data') on rows. `_low_precision`'s blocks
  # of 4 tile the shards, and the scales are laid out as the codes are.
  opt_def = OptaxWrapper(low_precision(optax.adamw(1e-2), mode, min_size=0))
  out = {}
  for axis_types in (AxisType.Explicit, AxisType.Auto):
    state = st.optimizer_steps(opt_def, axis_types, zero=True, steps=1)
    decoded = low_precision_to_float32(state.param_states)
    out[axis_types] = state, decoded, float32_to_low_precision(decoded, state.param_states)
  (state, decoded, encoded), want = out[AxisType.Explicit], out[AxisType.Auto]
  stored = jax.tree.leaves(state.param_states.inner_state, is_leaf=lambda x: hasattr(x, "codes"))
  assert [_spec(getattr(x, "codes", x)) for x in stored] == [
    _spec(x) for x in jax.tree.leaves(decoded)
  ]
  assert any("data" in str(_spec(x)) for x in jax.tree.leaves(decoded))
  assert [_spec(x) for x in jax.tree.leaves(encoded)] == [
    _spec(x) for x in jax.tree.leaves(state.param_states)
  ]
  for got, expected in zip((decoded, encoded), want[1:], strict=True):
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["8bit", "4bit"])
def test_sum_squares_on_explicit_mesh_axes(mode):
  """`low_precision_sum_squares` of a ZeRO state on Explicit axes, eagerly and jitted, gives
  Auto's sums (8 and 4 bits failed: the decoder reads codes and scales laid out apart)."""
  opt_def = OptaxWrapper(low_precision(optax.adamw(1e-2), mode, min_size=0))
  out = {}
  for axis_types in (AxisType.Explicit, AxisType.Auto):
    states = st.optimizer_steps(opt_def, axis_types, zero=True, steps=1).param_states
    out[axis_types] = low_precision_sum_squares(states), jax.jit(low_precision_sum_squares)(states)
  got, want = out[AxisType.Explicit], out[AxisType.Auto]
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6)


@pytest.mark.parametrize("mode, bytes_per_param", [("8bit", 1 + 4 / 4), ("bfloat16", 2)])
def test_plan_shows_storage_and_bytes(mode, bytes_per_param):
  partitioner = st._partitioner(2, 4, zero=True)
  state = abstract_train_state(partitioner, _opt_def(mode), st.AxesMLP().init, *st._init_args())
  plan = plan_lib.build_plan(state, logical=state.as_logical_axes())
  moments = [row for row in plan.rows if row.storage.startswith(mode)]
  assert len(moments) == (12 if mode == "8bit" else 6)
  assert {row.param for row in moments} == {"wi", "bi", "wo"}
  assert {row.group for row in moments} == {"inner_state/0/mu", "inner_state/0/nu"}
  params = sum(np.prod(x.shape) for x in jax.tree.leaves(state.params))
  assert sum(row.total_bytes for row in moments) == 2 * params * bytes_per_param
  assert plan.bytes_per_device == pytest.approx(plan.ideal_bytes_per_device, abs=8)
  table = plan_lib.format_table(plan)
  assert f"{mode}" in table and "inner_state/0/mu/wi" in table
  assert plan_lib.plan_to_json(plan)["leaves"][-1]["storage"] == moments[-1].storage


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_checkpoint_round_trip(tmp_path, mode):
  partitioner = st._partitioner(2, 4, zero=True)
  state, _ = _train(_fresh(mode), partitioner)
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(st.STEPS, state)
  target = jax.device_put(_fresh(mode), partitioner.get_shardings(_fresh(mode)))
  with Checkpointer(tmp_path) as ckpt:
    restored = ckpt.restore(target)
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
    assert got.dtype == want.dtype and got.sharding == want.sharding
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.slow
@pytest.mark.skipif(not t5x_at_hand(), reason="needs T5X_SRC and T5X's dependencies")
def test_t5x_partitioner_shards_low_precision_states_as_their_params():
  """data/t5x_low_precision/check_with_t5x.py: T5X's own networks, train state and partitioner."""
  script = pathlib.Path(__file__).parent / "data" / "t5x_low_precision" / "check_with_t5x.py"
  output = run_t5x_check(script)
  for line in (
    "OK   8bit t5: 40 params 8bit, 12 params float32",
    "OK   4bit scalable_t5: 13 params 4bit, 16 params float32",
    "OK   bfloat16 scalable_t5: 22 params bfloat16, 7 params float32",
  ):
    assert line in output


@pytest.mark.slow
def test_a_prefix_mask_shards_restores_and_converts_as_the_full_mask(tmp_path):
  """`optax.masked` with a mask that is a prefix of the params ({'enc': False, 'dec': True}):
  stored, laid out, planned, checkpointed, converted and summed as the full mask, leaf for leaf."""
  one = st._variables("axes")
  variables = {name: {"enc": one[name], "dec": one[name]} for name in one}
  full = {"enc": dict.fromkeys(one["params"], False), "dec": dict.fromkeys(one["params"], True)}
  partitioner = st._partitioner(2, 4, zero=True)

  def run(name, mask):
    tx = low_precision(optax.masked(optax.adamw(1e-2), mask), "8bit", block_size=4, min_size=0)
    opt_def = OptaxWrapper(tx)
    fresh = TrainState.create(opt_def, variables)
    shardings = partitioner.get_shardings(fresh)
    state, grads = jax.device_put((fresh, st._grads(fresh.params)), (shardings, shardings.params))
    step = jax.jit(lambda s, g: s.apply_gradient(g), out_shardings=shardings)
    for _ in range(2):
      state = step(state, grads)
    with Checkpointer(tmp_path / name) as ckpt:
      ckpt.save(2, state)
      restored = ckpt.restore(jax.device_put(fresh, shardings))
    abstract = abstract_train_state(partitioner, opt_def, lambda: variables)
    plan = plan_lib.build_plan(abstract, logical=abstract.as_logical_axes())
    param_states = state.param_states
    float32 = low_precision_to_float32(param_states)
    return {
      "storage": param_states.storage,
      "specs": [x.sharding for x in jax.tree.leaves(state)],
      "state": jax.tree.leaves(state),
      "restored": jax.tree.leaves(restored),
      "state_dict": jax.tree.leaves(fresh.restore_state(state.state_dict())),
      "plan": [(row.path, row.storage, row.param, row.bytes_per_device) for row in plan.rows],
      "float32": jax.tree.leaves(float32),
      "back": jax.tree.leaves(float32_to_low_precision(float32, param_states)),
      "sum_squares": jax.tree.leaves(low_precision_sum_squares(param_states)),
    }

  want, got = run("full", full), run("prefix", {"enc": False, "dec": True})
  assert "8bit" in got["storage"]
  assert got.keys() == want.keys()
  for key in want:
    if key in ("storage", "specs", "plan"):
      assert got[key] == want[key], key
    else:
      assert len(got[key]) == len(want[key]), key
      for x, y in zip(got[key], want[key], strict=True):
        assert x.dtype == y.dtype, key
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=key)


def _split(axis):
  """A spec per array: its dimension ``axis`` (-1: the last) over the mesh axis 'x'."""

  def spec(x):
    if jnp.ndim(x) < 2:
      return P(*["x"] * (axis == -1 and jnp.ndim(x) == 1))
    dims = [None] * jnp.ndim(x)
    dims[axis] = "x"
    return P(*dims)

  return spec


def _shard_map_step(opt, grads, spec, check_vma=False):
  """``opt.apply_gradient(grads)`` under `jax.shard_map` over 8 devices, each array's spec
  ``spec(array)``."""
  mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
  specs, grad_specs = jax.tree.map(spec, (opt, grads))
  step = jax.shard_map(
    lambda o, g: o.apply_gradient(g),
    mesh=mesh,
    in_specs=(specs, grad_specs),
    out_specs=specs,
    check_vma=check_vma,
  )
  put = functools.partial(jax.tree.map, lambda x, s: jax.device_put(x, NamedSharding(mesh, s)))
  return jax.jit(step)(put(opt, specs), put(grads, grad_specs))


def _codes_split(scales_width):
  """A spec per array: split over 'x' as `_split`, but for scales (last dimension
  ``scales_width``), replicated."""
  return lambda x: P() if jnp.shape(x)[-1:] == (scales_width,) else _split(-1)(x)


@pytest.mark.slow
@pytest.mark.parametrize(
  "mode, shape", [("8bit", (64, 1024)), ("4bit", (64, 1024)), ("4bit", (512, 32))]
)
def test_a_shard_map_step_keeps_the_stored_blocks(mode, shape):
  """Under `jax.shard_map`, each shard the whole blocks of a globally made state: the new state
  keeps the stored blocks, and a global step's values. The blocks were derived again from the
  shard's shape: 8 bits' scales (64, 8) became (64, 64), 4 bits' (64, 8) became (8, 64), so
  the optimizer refused its own state dict; a (512, 4) shard, which has no 4-bit block of
  its own, failed."""
  params = {"w": jax.random.normal(jax.random.PRNGKey(0), shape)}
  grads = {"w": jax.random.normal(jax.random.PRNGKey(1), shape)}
  opt = OptaxWrapper(low_precision(optax.adam(1e-2), mode)).create(params)
  got, want = _shard_map_step(opt, grads, _split(-1)), opt.apply_gradient(grads)
  state_dict = jax.tree.map(np.asarray, got.state_dict())
  restored = opt.restore_state(state_dict).state.param_states
  for x, y, z in zip(
    jax.tree.leaves(got.state.param_states),
    jax.tree.leaves(restored),
    jax.tree.leaves(want.state.param_states),
    strict=True,
  ):
    assert x.shape == y.shape == z.shape
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    np.testing.assert_array_equal(np.asarray(x), np.asarray(z))


@pytest.mark.parametrize(
  "mode, shape, spec, detail",
  [
    ("4bit", (256, 1024), _split(0), "values of shape (32, 1024)"),
    ("8bit", (64, 1024), lambda x: P("x") if jnp.shape(x)[-1:] == (8,) else P(), "(8, 8)"),
    ("8bit", (64, 1024), _codes_split(8), "encodes them as codes (64, 128), scales (64, 1)"),
    ("4bit", (64, 1024), _codes_split(8), "encodes them as codes (64, 64), scales (64, 1)"),
  ],
  ids=[
    "4bit_rows_without_their_column_maxima",
    "8bit_scales_split_apart",
    "8bit_codes_split_scales_replicated",
    "4bit_codes_split_scales_replicated",
  ],
)
def test_a_shard_map_step_refuses_shards_that_cannot_keep_the_stored_blocks(
  mode, shape, spec, detail
):
  """A shard whose stored block does not encode it in the stored layout (a 4-bit matrix split
  by rows, too few of them for column maxima; scales split apart from their codes) is refused,
  naming the leaf and both layouts, rather than stored in another. Codes split with their
  scales replicated looked like a whole leaf of a smaller block (8 bits: codes (64, 128),
  scales (64, 8), block 16 instead of 128), and were encoded so, wrongly, without a word."""
  params = {"w": jnp.ones(shape)}
  opt = OptaxWrapper(low_precision(optax.adam(1e-2), mode)).create(params)
  with pytest.raises(ValueError, match=r"(?s)'0/mu/w'.*" + re.escape(detail) + ".*whole blocks"):
    _shard_map_step(opt, params, spec)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["8bit", "4bit"])
@pytest.mark.parametrize(
  "read", [low_precision_sum_squares, low_precision_to_float32], ids=["sum_squares", "to_float32"]
)
def test_reading_shards_that_cannot_keep_the_stored_blocks_is_refused(mode, read):
  """Reading a state under `jax.shard_map` with codes split and scales replicated: each shard
  decoded as a whole leaf of a smaller block, silently wrong (8 bits' sum of squares 690 for
  658); it is refused, as the update is."""
  mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
  params = {"w": jnp.ones((64, 1024))}
  state = low_precision(optax.adam(1e-2), mode).init(params)
  spec = jax.tree.map(_codes_split(8), state)
  put = functools.partial(jax.tree.map, lambda x, s: jax.device_put(x, NamedSharding(mesh, s)))
  out_specs = jax.tree.map(lambda x: P(), jax.eval_shape(read, state))
  step = jax.shard_map(read, mesh=mesh, in_specs=(spec,), out_specs=out_specs, check_vma=False)
  with pytest.raises(ValueError, match=r"(?s)'0/mu/w'.*encodes them as codes \(64, "):
    jax.jit(step)(put(state, spec))


def test_a_state_without_its_blocks_is_refused_in_words():
  """A `LowPrecisionState` built without ``blocks`` (its default) is refused naming what is
  missing, not with zip's "argument 3 is shorter"."""
  tx = low_precision(optax.adam(1e-2), "8bit", min_size=0)
  params = {"w": jnp.ones((4, 256))}
  state = tx.init(params).replace(blocks=())
  with pytest.raises(ValueError, match=r"records 0 blocks for its 3 inner leaves"):
    tx.update(params, state, params)


@pytest.mark.slow
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole_tree"])
def test_shards_round_bfloat16_apart_under_shard_map(stream):
  """bfloat16 stochastic rounding under `jax.shard_map` (with ``check_vma``, JAX's default):
  a state split over the mesh hashes each shard's position into its bits, so equal values on
  two shards round apart (every shard hashed its local indices alike: their round-up
  patterns agreed everywhere; the streamed update failed under ``check_vma``); a state
  replicated over it rounds as unsharded on every device, and `jax.jit`'s sharding keeps the
  unsharded bits."""
  mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
  params = {"w": jax.random.normal(jax.random.PRNGKey(0), (64, 1024))}
  shard = jax.random.normal(jax.random.PRNGKey(1), (64, 128)) * 1e-3
  grads = {"w": jnp.tile(shard, (1, 8))}  # The same values on every shard.
  opt = OptaxWrapper(low_precision(optax.adam(1e-2), "bfloat16", stream=stream)).create(params)
  specs, grad_specs = jax.tree.map(_split(-1), (opt, grads))
  put = functools.partial(jax.tree.map, lambda x, s: jax.device_put(x, NamedSharding(mesh, s)))
  jitted = jax.jit(lambda o, g: o.apply_gradient(g))(put(opt, specs), put(grads, grad_specs))

  def nu(o):
    return np.asarray(o.state.param_states.inner_state[0].nu["w"], np.float32)

  def agreement(o):
    """The fraction of elements that round as the first shard's do, over the other shards."""
    up = (nu(o) > 1e-3 * np.asarray(grads["w"]) ** 2).reshape(64, 8, 128)
    return float(np.mean(up[:, 1:] == up[:, :1]))

  unsharded = opt.apply_gradient(grads)
  split = _shard_map_step(opt, grads, _split(-1), check_vma=True)
  replicated = _shard_map_step(opt, grads, lambda x: P(), check_vma=True)
  assert agreement(split) < 0.75
  assert agreement(unsharded) < 0.75
  np.testing.assert_array_equal(nu(replicated), nu(unsharded))
  np.testing.assert_array_equal(nu(jitted), nu(unsharded))


def split_a(tree):
  """Specs over the mesh axis 'x': leaves under key 'a' split along their last dimension,
  the others replicated."""

  def spec(path, x):
    split = "'a'" in jax.tree_util.keystr(path) and jnp.ndim(x)
    return P(*[None] * (jnp.ndim(x) - 1), "x") if split else P()

  return jax.tree_util.tree_map_with_path(spec, tree)


def split_a_step(opt, grads):
  """``opt.apply_gradient(grads)`` under `jax.shard_map` (``check_vma`` on, JAX's default) over
  8 devices, each tree laid out by `split_a`."""
  mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
  step = jax.shard_map(
    lambda o, g: o.apply_gradient(g),
    mesh=mesh,
    in_specs=(split_a(opt), split_a(grads)),
    out_specs=split_a(opt),
  )
  put = functools.partial(jax.tree.map, lambda x, s: jax.device_put(x, NamedSharding(mesh, s)))
  return jax.jit(step)(put(opt, split_a(opt)), put(grads, split_a(grads)))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["8bit", "4bit", "bfloat16"])
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole_tree"])
def test_a_replicated_leaf_after_a_split_one_steps_under_shard_map(mode, stream):
  """Under `jax.shard_map` with ``check_vma`` (JAX's default), a leaf replicated over the mesh
  after one split over it: the streamed update made each leaf wait for the one before, so the
  replicated leaf's new state came out varying over the mesh and JAX refused its output spec
  ("could not infer replication"). It steps as unsharded, to float32's last bit (XLA fuses
  the shards' programs otherwise; a bfloat16 state to its last bit, and only the replicated
  leaf's: a split one's rounding bits are its shard's)."""
  params = {
    "a": jax.random.normal(jax.random.PRNGKey(0), (64, 1024)),
    "b": jax.random.normal(jax.random.PRNGKey(1), (64, 1024)),
  }
  grads = jax.tree.map(lambda x: 0.1 * x + 0.01, params)
  opt = OptaxWrapper(low_precision(optax.adam(1e-2), mode, stream=stream)).create(params)
  got, want = split_a_step(opt, grads), opt.apply_gradient(grads)
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    x, y, where = np.asarray(x, np.float32), np.asarray(y, np.float32), str(path)
    if mode != "bfloat16":
      np.testing.assert_allclose(x, y, atol=1e-6, err_msg=where)
    elif "'b'" in where:  # A split leaf's bfloat16 rounding bits hash its shard's position.
      np.testing.assert_allclose(x, y, rtol=2**-7, atol=1e-6, err_msg=where)


@pytest.mark.slow
def test_sum_squares_of_a_replicated_leaf_after_a_split_one_under_shard_map():
  """`low_precision_sum_squares` under `jax.shard_map` with ``check_vma``: a split leaf's sum
  failed to trace (its conditional's branch that never runs gave a zero typed as the same on
  every device), and a replicated leaf's sum, which waited for the split one's, would have
  come out varying over the mesh, refused by an output spec that replicates it."""
  mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
  params = {"a": jnp.ones((64, 1024)), "b": jnp.ones((64, 1024))}
  tx = low_precision(optax.adam(1e-2), "8bit")
  state = tx.update(params, tx.init(params), params)[1]

  def sums(s):
    mu = low_precision_sum_squares(s)[0].mu
    return jax.lax.psum(mu["a"], "x"), mu["b"]

  put = functools.partial(jax.tree.map, lambda x, s: jax.device_put(x, NamedSharding(mesh, s)))
  step = jax.shard_map(sums, mesh=mesh, in_specs=(split_a(state),), out_specs=(P(), P()))
  got = jax.jit(step)(put(state, split_a(state)))
  want = low_precision_sum_squares(state)[0].mu
  np.testing.assert_allclose(got, (want["a"], want["b"]), rtol=1e-6)
