"""One dtype rule for every restore: `Optimizer.restore_state` and `Checkpointer.restore` agree."""

import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from t5x_optim import OptaxWrapper, low_precision, optimizers, reapply_config
from t5x_optim.checkpoints import Checkpointer, CheckpointError

W, COUNT = "target/w", "state/param_states/0/count"
MU = "state/param_states/0/mu/w"
# bfloat16's exponent range is float32's, its largest finite value (2 - 2**-7) * 2**127 is not:
# from here a float32 rounds to inf in bfloat16.
BF16_HALF_ULP_BEYOND = np.float32((2 - 2**-8) * 2.0**127)

# name: (path of the leaf, the value saved there, the target's dtype there, restores?)
CASES = {
  "f32 params into bf16": (W, jnp.linspace(-1.0, 1.0, 4, dtype=jnp.float32), jnp.bfloat16, True),
  "bf16 params into f32": (W, jnp.linspace(-1.0, 1.0, 4, dtype=jnp.bfloat16), jnp.float32, True),
  "int32 count into int8, fits": (COUNT, jnp.int32(127), jnp.int8, True),
  "int32 count into int8, too big": (COUNT, jnp.int32(128), jnp.int8, False),
  "uint8 count into int8, too big": (COUNT, jnp.uint8(200), jnp.int8, False),
  "int32 count into uint32, negative": (COUNT, jnp.int32(-1), jnp.uint32, False),
  "int8 count into int32": (COUNT, jnp.int8(-5), jnp.int32, True),
  "bool count into int32": (COUNT, jnp.bool_(True), jnp.int32, True),
  "float32 step into int32, whole": ("state/step", jnp.float32(3.0), jnp.int32, True),
  "float32 count into int32, whole": (COUNT, jnp.float32(3.0), jnp.int32, True),
  "float32 count into int32, fractional": (COUNT, jnp.float32(3.5), jnp.int32, False),
  "float32 count into int32, nan": (COUNT, jnp.float32(jnp.nan), jnp.int32, False),
  "float32 count into int32, inf": (COUNT, jnp.float32(jnp.inf), jnp.int32, False),
  "float32 count into int8, too big": (COUNT, jnp.float32(300.0), jnp.int8, False),
  "int32 count into float32": (COUNT, jnp.int32(3), jnp.float32, False),
  "complex params into real": (W, jnp.ones(4, jnp.complex64), jnp.float32, False),
  "f32 mu into f16, in range": (MU, jnp.array([-65504.0, 0.1, 1e-9, 65519.0]), jnp.float16, True),
  "f32 mu into f16, half an ulp beyond": (
    MU,
    jnp.array([0.0, 65520.0, 1.0, 2.0]),
    jnp.float16,
    False,
  ),
  "f32 mu into f8 e4m3, beyond": (MU, jnp.array([0.0, 500.0, 1.0, 2.0]), jnp.float8_e4m3fn, False),
  "f32 mu into f16, nan and inf stay": (
    MU,
    jnp.array([jnp.nan, -jnp.inf, 1.0, 0.0]),
    jnp.float16,
    True,
  ),
  "f32 mu into f16, beyond its range": (MU, jnp.array([0.0, 1.0, 7e4, 2.0]), jnp.float16, False),
  "bf16 mu into f16, beyond its range": (MU, jnp.full(4, -1e5, jnp.bfloat16), jnp.float16, False),
  "f32 mu into bf16, large": (MU, jnp.full(4, 3e38, jnp.float32), jnp.bfloat16, True),
  "f32 mu into bf16, just below half an ulp beyond": (
    MU,
    jnp.array([np.nextafter(BF16_HALF_ULP_BEYOND, 0), -1.0, 0.0, 2.0], jnp.float32),
    jnp.bfloat16,
    True,
  ),
  "f32 mu into bf16, half an ulp beyond": (
    MU,
    jnp.array([0.0, -BF16_HALF_ULP_BEYOND, 1.0, 2.0], jnp.float32),
    jnp.bfloat16,
    False,
  ),
  "f32 mu into bf16, beyond its range": (
    MU,
    jnp.array([0.0, 3.4e38, 1.0, 2.0]),
    jnp.bfloat16,
    False,
  ),
  "f16 mu into f8 e5m2, beyond": (
    MU,
    jnp.array([0.0, 6.3e4, 1.0, 2.0], jnp.float16),
    jnp.float8_e5m2,
    False,
  ),
}
QUICK_CASES = {
  "f32 params into bf16",
  "bf16 params into f32",
  "int32 count into int8, fits",
  "int32 count into int8, too big",
  "float32 count into int32, whole",
  "float32 count into int32, fractional",
  "complex params into real",
  "f32 mu into f16, nan and inf stay",
  "f32 mu into f16, beyond its range",
  "f32 mu into bf16, half an ulp beyond",
}
"""The cases the quick loop runs: a widening, a narrowing of params, an integer that fits and
one that does not, a float count whole and fractional, complex into real, and a float state
narrowed in range (non-finite values included) and beyond it; the other boundaries run with
the slow tests."""
assert QUICK_CASES <= CASES.keys(), QUICK_CASES - CASES.keys()


def _with_leaf(optimizer, path, value):
  """`optimizer` with the leaf at `path` (a state-dict path) replaced by `value`."""
  return jax.tree.map_with_path(
    lambda p, x: value if jax.tree_util.keystr(p, simple=True, separator="/") == path else x,
    optimizer,
  )


def _pair(path, saved_value, dtype):
  base = optimizers.adam(0.1).create({"w": jnp.zeros(4)})
  target_value = jnp.zeros(np.shape(saved_value), dtype)
  return _with_leaf(base, path, saved_value), _with_leaf(base, path, target_value)


def _leaf(optimizer, path):
  [leaf] = [
    x
    for p, x in jax.tree.leaves_with_path(optimizer)
    if jax.tree_util.keystr(p, simple=True, separator="/") == path
  ]
  return leaf


@pytest.mark.parametrize(
  "case", [c if c in QUICK_CASES else pytest.param(c, marks=pytest.mark.slow) for c in CASES]
)
def test_restore_state_and_checkpointer_give_the_same_verdict(tmp_path, case):
  path, saved_value, dtype, restores = CASES[case]
  saved, target = _pair(path, saved_value, dtype)
  src, dst = str(jnp.dtype(saved_value.dtype)), str(jnp.dtype(dtype))
  with Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(1, saved)
    if restores:
      by_state_dict = target.restore_state(saved.state_dict())
      by_checkpoint = ckpt.restore(target)
      # Checkpoints come back in the target's dtype; a state dict's float params
      # keep theirs (T5X's restore_dtype), state leaves take the state's.
      kept = saved_value.dtype if path == W else dtype
      for restored, want_dtype in ((by_state_dict, kept), (by_checkpoint, dtype)):
        leaf = _leaf(restored, path)
        assert leaf.dtype == want_dtype
        np.testing.assert_array_equal(leaf, saved_value.astype(want_dtype))
      return
    with pytest.raises(ValueError) as by_state_dict:
      target.restore_state(saved.state_dict())
    with pytest.raises(ValueError, match="Nothing was restored") as by_checkpoint:
      ckpt.restore(target)
  for error in (by_state_dict.value, by_checkpoint.value):
    assert f"mismatch at '{path}'" in str(error)
    assert src in str(error) and dst in str(error)
  assert f"step 1 in {tmp_path}" in str(by_checkpoint.value)


def test_a_rounding_cast_is_verified_and_keeps_the_target_sharding(tmp_path):
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("x",))
  sharding = jax.sharding.NamedSharding(mesh, jax.P("x"))
  saved_w = jax.device_put(jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32) / 3, sharding)
  saved = optimizers.adam(0.1).create({"w": saved_w})
  target = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), saved
  )
  target = _with_leaf(target, W, jax.ShapeDtypeStruct((8,), jnp.bfloat16, sharding=sharding))
  with Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(1, saved)
    restored = ckpt.restore(target)
  w = _leaf(restored, W)
  assert w.dtype == jnp.bfloat16 and w.sharding == sharding
  np.testing.assert_array_equal(w, saved_w.astype(jnp.bfloat16))


def test_values_are_checked_after_their_checksum(tmp_path):
  # A count too big for the target is only a misfit if it was read intact.
  saved, target = _pair(COUNT, jnp.int32(300), jnp.int8)
  with Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(1, saved)
    checksums = tmp_path / "1" / "checksums" / "checksums.json"
    recorded = json.loads(checksums.read_text())
    recorded[COUNT] ^= 1
    checksums.write_text(json.dumps(recorded))
    with pytest.raises(CheckpointError, match=f"is corrupt: the checksum differs at '{COUNT}'"):
      ckpt.restore(target)
    with pytest.raises(ValueError, match=f"mismatch at '{COUNT}'.*Nothing was restored"):
      ckpt.restore(target, verify=False)


def test_params_beyond_a_narrower_float_range_are_refused_where_they_would_be_cast(tmp_path):
  # A state dict's float params keep their dtype (T5X's restore_dtype), so nothing overflows;
  # a checkpoint's come back in the target's, where 70000 would become inf in float16.
  saved, target = _pair(W, jnp.array([1.0, 7e4, 0.0, 2.0]), jnp.float16)
  assert _leaf(target.restore_state(saved.state_dict()), W).dtype == jnp.float32
  with Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(1, saved)
    with pytest.raises(
      ValueError, match=f"mismatch at '{W}'.*float32 values .* range of the target's float16"
    ):
      ckpt.restore(target)


@pytest.mark.parametrize(
  ("dtype", "value"), [(np.float16, 2049), (np.float32, 2**24 + 1), (jnp.bfloat16, 257)]
)
def test_a_python_int_that_a_float_leaf_would_round_is_refused(dtype, value):
  from t5x_optim._core.state_dict import restore_into

  with pytest.raises(ValueError, match="Dtype mismatch at 'x'"):
    restore_into({"x": np.zeros((), dtype)}, {"x": value})
  exact = restore_into({"x": np.zeros((), dtype)}, {"x": value - 1})["x"]
  assert float(exact) == value - 1


@pytest.mark.parametrize(
  "data",
  [
    np.array([0.0, 1.0], np.float32),
    np.array([1.5, 2.7], np.float32),
    np.array([2**40 + 5, 7], np.int64),
    np.array([-1, 7], np.int32),
  ],
  ids=["whole-floats", "fractions", "beyond-uint32", "negative"],
)
def test_raw_prng_key_data_restores_only_as_uint32_values(data):
  tx = optax.chain(optax.add_noise(0.1, 0.5, jax.random.key(0)), optax.sgd(0.1))
  opt = optimizers.OptaxWrapper(tx).create({"w": jnp.zeros(2)})
  state = opt.state_dict()
  state["state"]["param_states"]["0"]["rng_key"] = data
  with pytest.raises(ValueError, match="state/param_states/0/rng_key"):
    opt.restore_state(state)
  state["state"]["param_states"]["0"]["rng_key"] = data.astype(np.int64) * 0 + np.array([3, 9])
  restored = opt.restore_state(state).state.param_states[0].rng_key
  np.testing.assert_array_equal(jax.random.key_data(restored), [3, 9])


def test_a_restore_into_arrays_on_no_particular_device_leaves_them_so():
  """A restored state was committed to its device where the optimizer's arrays were not, so a
  step jitted before the restore compiled again for it."""
  opt = optimizers.adamw(1e-3).create({"w": jnp.zeros(3)})
  step = jax.jit(lambda o: o.apply_gradient({"w": jnp.ones(3)}))
  opt = step(opt)
  restored = opt.restore_state(opt.state_dict())
  assert not any(leaf.committed for leaf in jax.tree.leaves(restored))
  step(restored)
  assert step._cache_size() == 1


def test_a_restore_into_arrays_on_no_particular_device_keeps_their_device():
  """Made under jax.default_device, the state came back on the default device: a state kept
  on one device (the host's, beside accelerators) moved wholly to another."""
  device = jax.devices()[3]
  with jax.default_device(device):
    opt = optimizers.adamw(1e-3).create({"w": jnp.zeros(3)})
  restored = opt.restore_state(jax.tree.map(np.asarray, opt.state_dict()))
  for leaf in jax.tree.leaves(restored):
    assert leaf.devices() == {device} and not leaf.committed


def _aligned(array: np.ndarray) -> np.ndarray:
  """A copy of `array` in memory at a 64-byte boundary, which jax on CPU may take as its own."""
  raw = np.empty(array.nbytes + 64, np.uint8)
  start = -raw.ctypes.data % 64
  out = raw[start : start + array.nbytes].view(array.dtype).reshape(array.shape)
  out[...] = array
  return out


@pytest.mark.slow
@pytest.mark.parametrize("placed", ["default_device", "sharded"])
def test_a_restore_from_numpy_holds_no_memory_of_the_state_dict(placed):
  """Restored from numpy arrays at a 64-byte boundary, the params and moments were the
  state dict's memory (jax on CPU takes such an array without copying): refilling the state
  dict, as a loop that reads the next checkpoint into the same buffers does, changed the
  restored optimizer without a word. A restore from jax arrays still takes them as they are."""
  params = {"w": jnp.linspace(-1.0, 1.0, 64 * 64, dtype=jnp.float32).reshape(64, 64)}
  if placed == "sharded":
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
    params = jax.device_put(
      params, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    )
  opt = optimizers.adamw(1e-3).create(params)
  opt = opt.apply_gradient({"w": jnp.ones((64, 64))})
  saved = jax.tree.map(lambda x: _aligned(np.asarray(x)), opt.state_dict())
  want = jax.tree.map(np.copy, saved)
  restored = opt.restore_state(saved)
  jax.tree.map(lambda x: x.fill(7), saved)
  changed = [
    jax.tree_util.keystr(path)
    for (path, got), kept in zip(
      jax.tree.flatten_with_path(restored.state_dict())[0], jax.tree.leaves(want), strict=True
    )
    if not np.array_equal(np.asarray(got), kept)
  ]
  assert not changed, f"refilling the state dict changed the restored {changed}"
  given = opt.state_dict()
  taken = opt.restore_state(given).state_dict()
  for got, passed in zip(jax.tree.leaves(taken), jax.tree.leaves(given), strict=True):
    assert [shard.data.unsafe_buffer_pointer() for shard in got.addressable_shards] == [
      shard.data.unsafe_buffer_pointer() for shard in passed.addressable_shards
    ]


def _cast_unpartitioned(state_dict, dtype):
  """`state_dict` as T5X's ``RestoreCheckpointConfig.dtype`` hands it to ``restore_state``:
  the params and the arrays it has no partitioning for (the scalars here) cast to `dtype`."""
  return jax.tree.map_with_path(
    lambda path, x: (
      np.asarray(x).astype(dtype) if path[0].key == "target" or np.ndim(x) == 0 else x
    ),
    state_dict,
  )


@pytest.mark.parametrize(
  ("dtype", "saved", "restored"),
  [(jnp.bfloat16, 1001, 1000), (jnp.bfloat16, 1_000_000, 999_424), (np.float16, 3001, 3000)],
)
def test_counters_beyond_the_whole_numbers_a_float_holds_warn_and_restore_as_given(
  dtype, saved, restored
):
  opt = optimizers.adam(0.1).create({"w": jnp.zeros(4)})
  state_dict = opt.state_dict()
  state_dict["state"]["step"] = saved
  state_dict["state"]["param_states"]["0"]["count"] = saved
  with pytest.warns(UserWarning) as caught:
    back = opt.restore_state(_cast_unpartitioned(state_dict, dtype))
  [message] = [str(w.message) for w in caught]
  name, exact = jnp.dtype(dtype).name, {jnp.bfloat16: 256, np.float16: 2048}[dtype]
  assert f"state/step ({name} {restored})" in message and f"{COUNT} ({name}" in message
  assert f"{name} holds every whole number only up to {exact}, to which it rounds" in message
  assert "RestoreCheckpointConfig.dtype" in message and "taken as they are" in message
  assert "reapply_config" not in message
  assert int(back.state.step) == int(back.state.param_states[0].count) == restored
  assert back.state.step.dtype == jnp.int32


@pytest.mark.parametrize(
  ("dtype", "value", "warns"),
  [(jnp.bfloat16, 255, False), (jnp.bfloat16, 256, True), (np.float16, 2047, False)],
)
def test_a_counter_warns_from_the_first_whole_number_its_float_may_have_rounded_to(
  dtype, value, warns
):
  # 257 becomes 256 in bfloat16, so a 256 received may have been 257.
  opt = optimizers.adam(0.1).create({"w": jnp.zeros(4)})
  state_dict = opt.state_dict()
  state_dict["state"]["step"] = np.asarray(value, dtype)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    opt.restore_state(state_dict)
  assert bool(caught) is warns


def test_config_set_state_leaves_from_a_narrower_float_warn_and_reapply_config_resets_them():
  # Without hyperparam_dtype, inject_hyperparams would init them in the bfloat16 params' dtype.
  tx = optax.inject_hyperparams(optax.adam, hyperparam_dtype=jnp.float32)
  opt = OptaxWrapper(tx(learning_rate=0.1, b2=0.999)).create({"w": jnp.zeros(4)})
  with pytest.warns(UserWarning) as caught:
    back = opt.restore_state(_cast_unpartitioned(opt.state_dict(), jnp.bfloat16))
  [message] = [str(w.message) for w in caught]
  assert "state/param_states/hyperparams/b1 (bfloat16 into float32)" in message
  assert message.count("(bfloat16 into float32)") == 4 and "and 1 more" in message
  assert "target/" not in message and "state/step" not in message
  assert "t5x_optim.reapply_config" in message
  assert float(back.state.param_states.hyperparams["b2"]) == 1.0  # 0.999 rounded
  np.testing.assert_allclose(reapply_config(back).state.param_states.hyperparams["b2"], 0.999)


@pytest.mark.parametrize("state", ["bf16 moments", "8bit"])
def test_states_whose_leaves_are_narrow_themselves_restore_from_narrow_floats_quietly(state):
  if state == "bf16 moments":
    opt = optimizers.adam(0.1).create({"w": jnp.zeros(64, jnp.bfloat16)})
  else:
    opt = OptaxWrapper(low_precision(optax.adam(0.1), "8bit", min_size=0)).create(
      {"w": jnp.zeros(64)}
    )
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    back = opt.restore_state(_cast_unpartitioned(opt.state_dict(), jnp.bfloat16))
  assert back.target["w"].dtype == jnp.bfloat16
