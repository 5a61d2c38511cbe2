"""T5X checkpoints: the shipped ones, written by T5X's own code, restore bit for bit.

`tests/data/t5x_checkpoints/` holds one step of a T5X `FlaxOptimTrainState` with
`OptaxWrapper(optax.adamw(0.1, weight_decay=0.01))`, written by T5X's legacy
`Checkpointer` (`legacy/`) and by its `OrbaxCheckpointManagerInterface` (`orbax/`)
from a data=2 x model=4 mesh, and every value of its state dict (`expected.npz`); see
the README there for how they were made. No T5X code runs here.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tensorstore as ts
from flax import serialization, traverse_util

import t5x_optim
from t5x_optim import partitioning
from t5x_optim._checkpoint import t5x_write as t5x_checkpoint_writer
from t5x_optim._checkpoint.leaves import array_key
from t5x_optim.partitioning import Partitioner

DATA = pathlib.Path(__file__).parent / "data" / "t5x_checkpoints"
FORMATS = ["legacy", "orbax"]
STEP = 2
SHAPES = {"dense": {"kernel": (4, 8), "bias": (8,)}, "embedding": (16, 4)}
AXES = {"dense": {"kernel": ("embed", "mlp"), "bias": ("mlp",)}, "embedding": ("vocab", "embed")}
LEARNING_RATE, WEIGHT_DECAY = 0.1, 0.01


def _flat(state_dict):
  return traverse_util.flatten_dict(state_dict, sep="/")


def _variables(shapes=SHAPES, axes=AXES):
  def box(shape, names):
    return nn.LogicallyPartitioned(jnp.zeros(shape, jnp.float32), names)

  return {"params": jax.tree.map(box, shapes, axes, is_leaf=lambda x: isinstance(x, tuple))}


def _partitioner(data: int, model: int) -> Partitioner:
  mesh = partitioning.create_mesh(shape={"data": data, "model": model})
  return Partitioner(mesh, partitioning.standard_logical_axis_rules(parameter_partitioning_dims=2))


def _optimizer_def():
  return t5x_optim.OptaxWrapper(optax.adamw(LEARNING_RATE, weight_decay=WEIGHT_DECAY))


def _target(partitioner, shapes=SHAPES, axes=AXES, optimizer_def=None):
  """An abstract train state: ShapeDtypeStruct leaves with the mesh's shardings."""
  return partitioning.abstract_train_state(
    partitioner, optimizer_def or _optimizer_def(), lambda: _variables(shapes, axes)
  )


@pytest.fixture(scope="module")
def expected():
  with np.load(DATA / "expected.npz") as npz:
    return dict(npz)


@pytest.fixture(scope="module")
def mesh_2x4():
  return _partitioner(2, 4)


@pytest.fixture(scope="module")
def target(mesh_2x4):
  return _target(mesh_2x4)


@pytest.fixture(scope="module")
def restored(target):
  return {fmt: t5x_optim.restore_t5x_checkpoint(DATA / fmt, target) for fmt in FORMATS}


def _assert_bit_for_bit(state, expected):
  flat = _flat(state.state_dict())
  assert sorted(flat) == sorted(expected)
  for key, value in expected.items():
    got = np.asarray(flat[key])
    assert got.dtype == value.dtype, key
    np.testing.assert_array_equal(got, value, err_msg=key)


def _assert_shardings(state, target):
  for (path, leaf), ref in zip(
    jax.tree.flatten_with_path(state)[0], jax.tree.leaves(target), strict=True
  ):
    assert isinstance(leaf, jax.Array), path
    assert leaf.sharding.is_equivalent_to(ref.sharding, leaf.ndim), (path, leaf.sharding)


@pytest.mark.parametrize("fmt", FORMATS)
def test_steps_are_listed(fmt):
  assert t5x_optim.t5x_checkpoint_steps(DATA / fmt) == [STEP]
  assert t5x_optim.latest_t5x_step(DATA / fmt) == STEP


def test_two_directories_of_one_step_are_refused_naming_both(tmp_path):
  """``checkpoint_10`` and ``checkpoint_010`` both read as step 10, and the one restored was
  whichever the directory listing gave last; ``checkpoint_٧`` (an Arabic-Indic seven) was 7."""
  shutil.copytree(DATA / "legacy" / f"checkpoint_{STEP}", tmp_path / f"checkpoint_{STEP}")
  shutil.copytree(DATA / "legacy" / f"checkpoint_{STEP}", tmp_path / "checkpoint_٧")
  assert t5x_optim.t5x_checkpoint_steps(tmp_path) == [STEP]
  shutil.copytree(DATA / "legacy" / f"checkpoint_{STEP}", tmp_path / f"checkpoint_0{STEP}")
  with pytest.raises(ValueError, match=rf"checkpoint_0?{STEP} and .*checkpoint_0?{STEP} are both"):
    t5x_optim.t5x_checkpoint_steps(tmp_path)


def test_no_steps_in_an_empty_dir(tmp_path):
  (tmp_path / "checkpoint_3.tmp-123").mkdir()  # an unfinished save
  (tmp_path / "checkpoint_4").mkdir()  # neither format
  assert t5x_optim.t5x_checkpoint_steps(tmp_path) == []
  assert t5x_optim.latest_t5x_step(tmp_path) is None
  with pytest.raises(FileNotFoundError, match="No T5X checkpoint in"):
    t5x_optim.restore_t5x_checkpoint(tmp_path, None)


@pytest.mark.parametrize("fmt", FORMATS)
def test_restores_bit_for_bit_into_the_sharded_target(fmt, restored, target, expected):
  state = restored[fmt]
  assert isinstance(state, t5x_optim.TrainState)
  _assert_bit_for_bit(state, expected)
  _assert_shardings(state, target)
  assert {d.id for d in state.params["dense"]["kernel"].sharding.device_set} == set(range(8))
  assert state.params["dense"]["kernel"].sharding.spec == jax.sharding.PartitionSpec(
    "data", "model"
  )


@pytest.mark.parametrize(
  "where",
  [
    lambda d: d / "legacy",
    lambda d: d / "legacy" / "checkpoint_2",
    lambda d: d / "legacy" / "checkpoint_2" / "checkpoint",
    lambda d: d / "orbax" / "checkpoint_2",
  ],
  ids=["model_dir", "legacy_step_dir", "msgpack_file", "orbax_step_dir"],
)
@pytest.mark.parametrize("relative", [False, True], ids=["absolute", "relative"])
def test_path_forms(where, relative, expected, monkeypatch):
  optimizer = _optimizer_def().create(
    jax.tree.map(jnp.zeros, SHAPES, is_leaf=lambda x: isinstance(x, tuple))
  )
  if relative:
    monkeypatch.chdir(DATA.parent)
  path = where(pathlib.Path(DATA.name) if relative else DATA)
  restored = t5x_optim.restore_t5x_checkpoint(str(path), optimizer)
  _assert_bit_for_bit(restored, expected)


@pytest.mark.parametrize("fmt", FORMATS)
def test_unknown_step_is_an_error(fmt, target):
  with pytest.raises(FileNotFoundError, match=r"step 3 .* the steps are \[2\]"):
    t5x_optim.restore_t5x_checkpoint(DATA / fmt, target, step=3)


def test_keeps_training_like_plain_optax(restored, expected, mesh_2x4):
  grads = jax.tree.map(
    lambda s: jnp.full(s, 0.25, jnp.float32), SHAPES, is_leaf=lambda x: isinstance(x, tuple)
  )
  tx = optax.adamw(LEARNING_RATE, weight_decay=WEIGHT_DECAY)

  def tree(prefix):
    return traverse_util.unflatten_dict(
      {
        tuple(k[len(prefix) :].split("/")): jnp.asarray(v)
        for k, v in expected.items()
        if k.startswith(prefix)
      }
    )

  params = tree("target/")
  opt_state = (
    optax.ScaleByAdamState(
      count=jnp.asarray(expected["state/param_states/0/count"]),
      mu=tree("state/param_states/0/mu/"),
      nu=tree("state/param_states/0/nu/"),
    ),
    optax.EmptyState(),
    optax.EmptyState(),
  )

  @jax.jit
  def plain_step(params, opt_state):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  want_params, want_state = plain_step(params, opt_state)
  step = jax.jit(lambda state: state.apply_gradient(grads))
  for state in restored.values():
    new = step(state)
    assert int(new.step) == STEP + 1
    assert new.params["dense"]["kernel"].sharding.spec == jax.sharding.PartitionSpec(
      "data", "model"
    )
    for got, want in zip(
      jax.tree.leaves((new.params, new.param_states)),
      jax.tree.leaves((want_params, want_state)),
      strict=True,
    ):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("fmt", FORMATS)
def test_saves_and_reads_back_on_another_mesh(fmt, restored, expected, tmp_path):
  path = t5x_optim.save_t5x_checkpoint(tmp_path, restored[fmt])
  assert path == os.fspath(tmp_path / "checkpoint_2")
  assert sorted(os.listdir(tmp_path)) == ["checkpoint_2"]
  contents = serialization.msgpack_restore((tmp_path / "checkpoint_2" / "checkpoint").read_bytes())
  assert contents["version"] == 3
  kernel = contents["optimizer"]["target"]["dense"]["kernel"]
  assert kernel["kvstore"] == {"driver": "file", "path": "target.dense.kernel"}
  assert kernel["metadata"]["shape"] == [4, 8] and kernel["metadata"]["chunks"] == [2, 2]
  assert contents["optimizer"]["state"]["step"] == np.int32(STEP)
  for mesh in [(4, 2), (1, 1)]:
    partitioner = (
      _partitioner(*mesh)
      if mesh != (1, 1)
      else Partitioner(partitioning.create_mesh(devices=jax.devices()[:1]))
    )
    target = _target(partitioner)
    again = t5x_optim.restore_t5x_checkpoint(tmp_path, target)
    _assert_bit_for_bit(again, expected)
    _assert_shardings(again, target)


def test_single_element_arrays_are_written_inline_as_t5x_writes_them(tmp_path):
  """T5X writes a leaf without mesh axes (adafactor's (1,) placeholders) into the msgpack
  file, and its reader takes each tensorstore spec for an array with mesh axes: T5X's
  checkpointer failed on such a spec (data/t5x_adafactor/read_by_t5x.py, with T5X)."""
  params = {"dense": {"kernel": jnp.ones((4, 8)), "bias": jnp.ones(8)}}
  opt = t5x_optim.optimizers.adafactor(0.1, min_dim_size_to_factor=2).create(params)
  t5x_optim.save_t5x_checkpoint(tmp_path, opt, step=1)
  contents = serialization.msgpack_restore((tmp_path / "checkpoint_1" / "checkpoint").read_bytes())
  factored = contents["optimizer"]["state"]["param_states"]["0"]
  assert isinstance(factored["v_row"]["dense"]["bias"], np.ndarray)  # (1,): inline
  assert isinstance(factored["v"]["dense"]["kernel"], np.ndarray)
  assert factored["v"]["dense"]["bias"]["metadata"]["shape"] == [8]  # a spec
  assert sorted(os.listdir(tmp_path / "checkpoint_1")) == [
    "checkpoint",
    "state.param_states.0.v.dense.bias",
    "state.param_states.0.v_col.dense.kernel",
    "state.param_states.0.v_row.dense.kernel",
    "t5x_optim_state_classes.json",
    "target.dense.bias",
    "target.dense.kernel",
  ]
  expected = {k: np.asarray(v) for k, v in _flat(opt.state_dict()).items()}
  _assert_bit_for_bit(t5x_optim.restore_t5x_checkpoint(tmp_path, opt), expected)


def test_a_spec_with_an_absolute_path_is_refused_naming_the_leaf(tmp_path):
  """T5X writes each array's path relative to its step directory; an absolute one was read
  from elsewhere on local disk and under a doubled '/' on gs://."""
  opt = t5x_optim.optimizers.sgd(0.1).create({"w": jnp.ones((4, 8))})
  checkpoint = pathlib.Path(t5x_optim.save_t5x_checkpoint(tmp_path, opt, step=1)) / "checkpoint"
  contents = serialization.msgpack_restore(checkpoint.read_bytes())
  kernel = contents["optimizer"]["target"]["w"]
  kernel["kvstore"]["path"] = f"{checkpoint.parent}/target.w"
  checkpoint.write_bytes(serialization.msgpack_serialize(contents))
  message = (
    f"The T5X checkpoint in {checkpoint.parent} has a spec with an absolute path at 'target/w': "
    f"'{checkpoint.parent}/target.w'; T5X writes each path relative to the step directory."
  )
  with pytest.raises(ValueError, match=re.escape(message)):
    t5x_optim.restore_t5x_checkpoint(tmp_path, opt)


def test_save_refuses_an_existing_step_and_keeps_it(restored, expected, tmp_path):
  t5x_optim.save_t5x_checkpoint(tmp_path, restored["legacy"])
  with pytest.raises(FileExistsError, match="checkpoint_2 exists already"):
    t5x_optim.save_t5x_checkpoint(tmp_path, restored["orbax"].replace_step(jnp.int32(7)), step=2)
  _assert_bit_for_bit(t5x_optim.restore_t5x_checkpoint(tmp_path, restored["legacy"]), expected)


def test_failed_save_leaves_no_step_dir(restored, tmp_path):
  optimizer = restored["legacy"].optimizer
  adam, *rest = optimizer.state.param_states
  abstract_nu = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), adam.nu)
  broken = optimizer.replace(
    state=optimizer.state.replace(param_states=(adam._replace(nu=abstract_nu), *rest))
  )
  with pytest.raises(ValueError, match="abstract leaf at 'state/param_states/0/nu/dense/bias'"):
    t5x_optim.save_t5x_checkpoint(tmp_path, broken)
  assert os.listdir(tmp_path) == []


def test_io_error_mid_save_leaves_earlier_steps_and_no_partial_one(
  restored, expected, tmp_path, monkeypatch
):
  t5x_optim.save_t5x_checkpoint(tmp_path, restored["legacy"])
  real_open, calls = ts.open, []

  def open_failing_the_fifth(spec, **kwargs):
    calls.append(spec)
    if len(calls) == 5:  # a real tensorstore error, raised from the future
      return real_open({"driver": "zarr", "kvstore": {"driver": "memory"}}, open=True)
    return real_open(spec, **kwargs)

  monkeypatch.setattr(
    t5x_checkpoint_writer, "ts", types.SimpleNamespace(open=open_failing_the_fifth)
  )
  with pytest.raises(ValueError, match="NOT_FOUND"):
    t5x_optim.save_t5x_checkpoint(tmp_path, restored["legacy"], step=3)
  assert len(calls) == 9  # every open was started and waited for before the cleanup
  assert sorted(os.listdir(tmp_path)) == ["checkpoint_2"]
  monkeypatch.undo()
  _assert_bit_for_bit(t5x_optim.restore_t5x_checkpoint(tmp_path, restored["legacy"]), expected)


@pytest.mark.parametrize(
  "keys, file", [(("a", "a/"), "target.a"), (("a/b", "a\\b"), "target.a/b"), (("", "/"), "target.")]
)
def test_keys_whose_files_coincide_are_refused_before_anything_is_written(tmp_path, keys, file):
  """tensorstore's file store keeps an array in the directory of its name and reads '\\' as '/':
  ``a`` and ``a/`` were written to one file, and the restore gave both the second one's values."""
  params = {key: jnp.full((4, 4), float(i)) for i, key in enumerate(keys)}
  optimizer = t5x_optim.OptaxWrapper(optax.sgd(1.0)).create(params)
  message = f"'target/{keys[1]}' and 'target/{keys[0]}' would share the file {file}."
  with pytest.raises(ValueError, match=re.escape(message)):
    t5x_optim.save_t5x_checkpoint(tmp_path, optimizer, step=0)
  assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
  "params, why",
  [
    ({"a": {"/": {"": 1}}}, "a part '.'"),
    ({"a//b": 1}, "an empty part"),
    ({"a/./b": 1}, "a part '.'"),
    ({"a/../b": 1}, "a part '..'"),
    ({"a\\\\b": 1}, "an empty part"),
    ({"a": {"__lock": 1}}, "a part ending in '.__lock'"),
  ],
)
def test_keys_the_file_store_refuses_are_refused_before_anything_is_written(tmp_path, params, why):
  """tensorstore's file store refuses a file name with an empty, '.' or '..' part or one ending in
  its lock files' suffix: the save failed with tensorstore's "Invalid file path", naming a file in
  a temporary directory and not the param."""
  params = jax.tree.map(lambda _: jnp.ones((4, 4)), params)
  (path, _), *_ = jax.tree.flatten_with_path(params)[0]
  keys = ("target", *(entry.key for entry in path))
  optimizer = t5x_optim.OptaxWrapper(optax.sgd(1.0)).create(params)
  message = (
    f"Cannot save the array at '{'/'.join(keys)}' (keys {keys}): "
    f"tensorstore's file store refuses the name {'.'.join(keys)!r}, which has {why}"
  )
  with pytest.raises(ValueError, match=re.escape(message) + r".*Nothing was written"):
    t5x_optim.save_t5x_checkpoint(tmp_path, optimizer, step=0)
  assert os.listdir(tmp_path) == []


FILE_NAMES = ["t.a", "t.a/", "t.a\\", "t.a/b", "t.a\\b", "t.", "t./", "t.a/ /b"]
REFUSED_FILE_NAMES = ["t.a//", "t.a//b", "t.a/./b", "t.a/../b", "t.a/.", "t.a/..", "t.a\\\\b"]
REFUSED_FILE_NAMES += ["t.a/\\b", "t.a.__lock", "t.a.__lock/b", "t.a/\0"]


def test_array_key_on_files_is_where_tensorstore_writes_an_array(tmp_path):
  """Asked of tensorstore's file store itself: where it keeps each array, and which names it
  refuses."""
  for name in FILE_NAMES + REFUSED_FILE_NAMES:
    kvstore = {"driver": "file", "path": f"{tmp_path}/{name}"}
    spec = {"driver": "zarr", "kvstore": kvstore, "dtype": "float32", "metadata": {"shape": [2]}}
    try:
      path = ts.open(spec, create=True, open=True).result().kvstore.path
    except ValueError:
      path = None
    try:
      key = f"{tmp_path}/{array_key(name, files=True)}"
    except ValueError:
      key = None
    assert path == key, name
    assert (path is None) == (name in REFUSED_FILE_NAMES), name


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.int8])
def test_round_trips_other_dtypes(dtype, tmp_path):
  params = {"w": (jnp.arange(12).reshape(3, 4) - 5).astype(dtype)}
  optimizer = t5x_optim.OptaxWrapper(optax.sgd(1.0)).create(params)
  t5x_optim.save_t5x_checkpoint(tmp_path, optimizer, step=0)
  back = t5x_optim.restore_t5x_checkpoint(tmp_path, optimizer)
  assert back.target["w"].dtype == dtype
  np.testing.assert_array_equal(np.asarray(back.target["w"]), np.asarray(params["w"]))


def test_a_dtype_of_another_kind_is_refused_before_reading(tmp_path):
  optimizer = t5x_optim.OptaxWrapper(optax.sgd(1.0)).create({"w": jnp.ones((3, 4))})
  t5x_optim.save_t5x_checkpoint(tmp_path, optimizer, step=0)
  as_bools = optimizer.replace(target={"w": jnp.ones((3, 4), jnp.bool_)})
  message = (
    r"dtype mismatch at 'target/w': the target has bool\[3, 4\], the checkpoint has "
    r"float32\[3, 4\]\. Nothing was restored\."
  )
  with pytest.raises(ValueError, match=message):
    t5x_optim.restore_t5x_checkpoint(tmp_path, as_bools)


def test_a_float32_step_restores_as_the_optimizers_int32(tmp_path):
  # T5X's Orbax checkpointer saves every array in its save_dtype, step counters included.
  optimizer = t5x_optim.OptaxWrapper(optax.adam(1.0)).create({"w": jnp.ones((3, 4))})
  as_floats = jax.tree.map_with_path(
    lambda path, x: x.astype(jnp.float32) + 7 if "count" in str(path) or "step" in str(path) else x,
    optimizer,
  )
  t5x_optim.save_t5x_checkpoint(tmp_path, as_floats, step=0)
  back = t5x_optim.restore_t5x_checkpoint(tmp_path, optimizer)
  assert back.state.step.dtype == jnp.int32 and int(back.state.step) == 7
  assert back.state.param_states[0].count.dtype == jnp.int32
  assert int(back.state.param_states[0].count) == 7
  fractional = as_floats.replace(state=as_floats.state.replace(step=jnp.float32(7.5)))
  t5x_optim.save_t5x_checkpoint(tmp_path / "frac", fractional, step=0)
  with pytest.raises(
    ValueError, match=r"mismatch at 'state/step': the stored float32 values \(from 7.5 to 7.5\)"
  ):
    t5x_optim.restore_t5x_checkpoint(tmp_path / "frac", optimizer)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
  ("shapes", "axes", "optimizer_def", "message"),
  [
    (
      {**SHAPES, "embedding": (16, 8)},
      AXES,
      None,
      r"shape mismatch at 'target/embedding': the target has float32\[16, 8\], the "
      r"checkpoint has float32\[16, 4\]",
    ),
    (
      {**SHAPES, "extra": (4,)},
      {**AXES, "extra": ("mlp",)},
      None,
      r"missing key 'target/extra' \(the target has float32\[4\]\)",
    ),
    (
      SHAPES,
      AXES,
      t5x_optim.OptaxWrapper(optax.sgd(0.1)),
      r"unexpected key 'state/param_states/0/count' \(the checkpoint has int32\[\]",
    ),
  ],
  ids=["other_shape", "other_model", "other_optimizer"],
)
def test_wrong_target_names_the_path(fmt, shapes, axes, optimizer_def, message):
  target = _target(_partitioner(2, 4), shapes, axes, optimizer_def)
  with pytest.raises(ValueError, match=message) as info:
    t5x_optim.restore_t5x_checkpoint(DATA / fmt, target)
  assert "Nothing was restored" in str(info.value)


def test_round_trips_flax_mutables_and_a_chosen_step(tmp_path):
  variables = {
    "params": {"w": jnp.arange(6.0).reshape(2, 3)},
    "batch_stats": {"mean": jnp.array([0.5, -1.5, 2.0])},
  }
  state = t5x_optim.TrainState.create(t5x_optim.OptaxWrapper(optax.adam(0.1)), variables)
  later = state.apply_gradient(
    {"w": jnp.ones((2, 3))}, flax_mutables={"batch_stats": {"mean": jnp.ones(3)}}
  )
  t5x_optim.save_t5x_checkpoint(tmp_path, state)
  t5x_optim.save_t5x_checkpoint(tmp_path, later)
  assert t5x_optim.t5x_checkpoint_steps(tmp_path) == [0, 1]
  for step, want in [(None, later), (0, state)]:
    back = t5x_optim.restore_t5x_checkpoint(tmp_path, state, step=step)
    for got, ref in zip(jax.tree.leaves(back), jax.tree.leaves(want), strict=True):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))


@pytest.mark.parametrize("fmt", FORMATS)
def test_checkpointer_restores_a_t5x_model_dir(fmt, target, expected, tmp_path):
  model_dir = tmp_path / fmt
  shutil.copytree(DATA / fmt, model_dir)
  with t5x_optim.Checkpointer(str(model_dir)) as checkpointer:
    state = checkpointer.restore(target)
    assert checkpointer.restored_step == STEP
    with pytest.raises(ValueError, match="holds T5X checkpoints"):
      checkpointer.restore(target, params_only=True)
  _assert_bit_for_bit(state, expected)
  _assert_shardings(state, target)
