"""Checkpoints: round trips, resharding, resume, crashes, errors, multi-process."""

import ast
import inspect
import os
import re
import shutil
import sys
import warnings

import _checkpoint_worker as w
import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts
from _subprocesses import free_port

from t5x_optim import optimizers, storage
from t5x_optim._checkpoint import headers as checkpoint_headers
from t5x_optim._checkpoint import store as checkpoints_impl
from t5x_optim._checkpoint.checksums import dispatch_checksums, fetch
from t5x_optim._checkpoint.leaves import array_key, flatten, listed, saveable
from t5x_optim.checkpoints import Checkpointer, CheckpointError


def _save(directory, step, state):
  with Checkpointer(directory) as ckpt:
    ckpt.save(step, state)


def _restore(directory, target, **kwargs):
  with Checkpointer(directory) as ckpt:
    return ckpt.restore(target, **kwargs)


@pytest.mark.parametrize("base", ["/run", "run/", "gs://b/run", "gs://b/run/"])
def test_storage_join_is_alike_on_every_storage_and_refuses_an_absolute_name(base):
  """A name starting with '/' dropped a local base ('/ckpt') and doubled a slash on gs://
  ('gs://b/run//ckpt')."""
  assert (
    storage.join(base, "checkpoint_3", "target.w") == f"{base.rstrip('/')}/checkpoint_3/target.w"
  )
  message = f"storage.join takes names relative to {base!r}: '/ckpt' is absolute."
  with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
    storage.join(base, "checkpoint_3", "/ckpt")


@pytest.fixture(scope="module")
def part_2x4():
  return w.partitioner(2, 4)


@pytest.mark.parametrize(
  "opt_name",
  ["adamw", *(pytest.param(name, marks=pytest.mark.slow) for name in ("adafactor", "multi"))],
)
def test_round_trip(tmp_path, part_2x4, opt_name):
  state = w.train(w.fresh_state(opt_name, part_2x4), 2)
  _save(tmp_path, 2, state)
  for target in (w.fresh_state(opt_name, part_2x4), w.abstract_state(opt_name, part_2x4)):
    w.assert_same_state(_restore(tmp_path, target), state)


@pytest.mark.slow
def test_round_trip_of_an_optimizer(tmp_path, part_2x4):
  optimizer = w.train(w.fresh_state("adafactor", part_2x4), 1).optimizer
  _save(tmp_path, 1, optimizer)
  restored = _restore(tmp_path, w.fresh_state("adafactor", part_2x4).optimizer)
  assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), restored, optimizer))
  assert jax.tree.map(lambda a: a.sharding, restored) == jax.tree.map(
    lambda a: a.sharding, optimizer
  )


@pytest.fixture(scope="module")
def saved_adafactor(tmp_path_factory, part_2x4):
  """Adafactor's train state after 2 steps on the 2x4 mesh, saved once, and where."""
  state = w.train(w.fresh_state("adafactor", part_2x4), 2)
  directory = tmp_path_factory.mktemp("adafactor")
  _save(directory, 2, state)
  return directory, state


@pytest.mark.parametrize(
  "data, model, num_devices",
  [(4, 2, 8), (1, 8, 8), pytest.param(2, 2, 4, marks=pytest.mark.slow), (1, 4, 4)],
)
def test_restore_onto_another_mesh(saved_adafactor, data, model, num_devices):
  directory, state = saved_adafactor
  part = w.partitioner(data, model, devices=jax.devices()[:num_devices])
  target = w.abstract_state("adafactor", part)
  restored = _restore(directory, target)
  for got, saved, want in zip(*(jax.tree.leaves(t) for t in (restored, state, target))):
    assert got.sharding == want.sharding and got.dtype == want.dtype == saved.dtype
    np.testing.assert_array_equal(np.asarray(got), np.asarray(saved))
  assert {d.id for leaf in jax.tree.leaves(restored) for d in leaf.sharding.device_set} == {
    d.id for d in jax.devices()[:num_devices]
  }


def test_params_only_switches_optimizer(tmp_path, part_2x4):
  adamw = w.train(w.fresh_state("adamw", part_2x4), 3)
  _save(tmp_path, 3, adamw)
  part = w.partitioner(4, 2)
  restored = _restore(tmp_path, w.abstract_state("sgd_momentum", part), params_only=True)
  fresh = w.fresh_state("sgd_momentum", part)
  expected = fresh.restore_state(
    {
      **adamw.state_dict(),
      "state": {"step": adamw.step, "param_states": fresh.state_dict()["state"]["param_states"]},
    }
  )
  w.assert_same_state(restored, expected)
  assert int(restored.step) == 3


@pytest.mark.slow
def test_params_only_into_an_optimizer(tmp_path):
  params = {"w": jnp.linspace(0.0, 1.0, 8)}
  adamw = w.OptaxWrapper(optax.adamw(0.1)).create(params)
  _save(tmp_path, 1, adamw.apply_gradient(params))
  sgd = w.OptaxWrapper(optax.sgd(0.1, momentum=0.9)).create(jax.tree.map(jnp.zeros_like, params))
  restored = _restore(tmp_path, sgd, params_only=True)
  np.testing.assert_array_equal(restored.target["w"], adamw.apply_gradient(params).target["w"])
  assert int(restored.state.step) == 1
  np.testing.assert_array_equal(restored.state.param_states[0].trace["w"], np.zeros(8))


@pytest.mark.parametrize(
  "name, tx, params",
  [
    ("typed PRNG key in the state", optax.noisy_sgd(0.1), {"w": jnp.ones(4)}),
    ("numpy params", optax.adamw(0.1), {"w": np.arange(4, dtype=np.float32)}),
  ],
)
@pytest.mark.slow
def test_round_trip_of_special_leaves(tmp_path, name, tx, params):
  opt_def = w.OptaxWrapper(tx)
  optimizer = opt_def.create(params).apply_gradient(jax.tree.map(np.ones_like, params))
  _save(tmp_path, 1, optimizer)
  template = opt_def.create(params)
  restored = _restore(tmp_path, template)
  for got, want, like in zip(*(jax.tree.leaves(t) for t in (restored, optimizer, template))):
    assert type(got) is type(like) and got.dtype == want.dtype, name
    if jax.dtypes.issubdtype(want.dtype, jax.dtypes.prng_key):
      got, want = jax.random.key_data(got), jax.random.key_data(want)
    np.testing.assert_array_equal(got, want, err_msg=name)


EMPTY_PARAMS = {
  "w": jnp.linspace(-1.0, 1.0, 48).reshape(6, 8),
  "no_rows": jnp.zeros((0, 8)),
  "no_cols": jnp.zeros((8, 0), jnp.bfloat16),
  "none": jnp.zeros((0,)),
}
"""Params with zero-size leaves (a layer of width 0): orbax cannot store a zero-size array."""


@pytest.mark.slow
@pytest.mark.parametrize(
  "tx",
  [
    pytest.param(optax.adamw(0.1), id="adamw"),
    pytest.param(optimizers.low_precision(optax.adamw(0.1), "8bit", min_size=0), id="adamw_8bit"),
  ],
)
def test_zero_size_leaves_round_trip_on_a_mesh(tmp_path, tx):
  """A state with zero-size leaves saves (the save failed in orbax, and its threads kept the
  process alive minutes after) and restores: exactly, sharded, params only, into a target
  whose zero-size leaf has another shape only with a refusal naming it."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
  shard = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  opt_def = w.OptaxWrapper(tx)
  grads = jax.tree.map(lambda x: jnp.full_like(x, 0.5), EMPTY_PARAMS)
  state = opt_def.create(EMPTY_PARAMS).apply_gradient(grads).apply_gradient(grads)
  _save(tmp_path, 2, state)
  w.assert_same_state(_restore(tmp_path, opt_def.create(EMPTY_PARAMS)), state)
  sharded = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shard if x.ndim else None),
    jax.eval_shape(opt_def.create, EMPTY_PARAMS),
  )
  restored = _restore(tmp_path, sharded)
  for got, want, like in zip(*(jax.tree.leaves(t) for t in (restored, state, sharded))):
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    if like.sharding is not None:
      assert got.sharding == like.sharding
  restored = _restore(tmp_path, opt_def.create(EMPTY_PARAMS), params_only=True)
  assert restored.target["no_rows"].shape == (0, 8) and int(restored.state.step) == 2
  assert restored.target["no_cols"].dtype == jnp.bfloat16
  other = opt_def.create({**EMPTY_PARAMS, "none": jnp.zeros((0, 3))})
  with pytest.raises(
    ValueError,
    match="shape mismatch at 'target/none': the target has "
    r"float32\[0, 3\], the checkpoint has float32\[0\]",
  ):
    _restore(tmp_path, other)


@pytest.mark.slow
def test_a_target_over_an_abstract_mesh_restores_under_its_mesh_and_is_refused_without(tmp_path):
  """`jax.eval_shape` of a state on a mesh with Explicit axes gives shardings over an abstract
  mesh: orbax failed to read onto it, which was reported as a corrupt step, and with
  ``fallback`` every intact step was declared bad. Under `jax.set_mesh` of that mesh it
  restores onto its devices (also through `restore_fitted`); without, it is refused as the
  target's fault, never retried. Any
  restore under `jax.set_mesh` failed where a leaf was on one device (as an eagerly created
  optimizer's step was): "Received incompatible devices for jitted computation"."""
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", "model"))
  every = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  params = {
    "w": jax.device_put(jnp.arange(64.0).reshape(8, 8), split),
    "none": jax.device_put(jnp.zeros((0, 3)), every),
  }
  opt_def = w.OptaxWrapper(optax.adam(0.1))
  state = opt_def.create(params).apply_gradient(jax.tree.map(jnp.ones_like, params))
  _save(tmp_path, 1, state)
  _save(tmp_path, 2, state)
  target = jax.eval_shape(lambda s: s, state)
  assert isinstance(target.target["w"].sharding.mesh, jax.sharding.AbstractMesh)
  for fallback in (False, True):
    with pytest.raises(ValueError, match=r"leaf '[^']+' is sharded over an abstract mesh") as e:
      _restore(tmp_path, target, fallback=fallback)
    assert not isinstance(e.value, CheckpointError)
  one_device = state.replace(
    state=state.state.replace(step=jax.device_put(state.state.step, jax.devices()[0]))
  )
  with pytest.raises(ValueError, match=r"leaf '[^']+' is sharded over an abstract mesh") as e:
    Checkpointer(tmp_path).restore_fitted(lambda stored: target)
  assert not isinstance(e.value, CheckpointError)
  with jax.set_mesh(mesh):
    restored = _restore(tmp_path, target)
    w.assert_same_state(_restore(tmp_path, one_device), one_device)
    with Checkpointer(tmp_path) as checkpointer:
      w.assert_same_state(checkpointer.restore_fitted(lambda stored: target), state)
  w.assert_same_state(restored, state)
  assert restored.target["w"].sharding == split
  assert Checkpointer(tmp_path).all_steps() == [1, 2]


@pytest.mark.slow
def test_t5x_and_converted_restores_under_set_mesh(tmp_path):
  """`restore_t5x_checkpoint` and `restore_converted` under `jax.set_mesh`, into an optimizer
  whose step is on one device (as an eagerly created one's was): both failed ("Received
  incompatible devices for jitted computation"); they restore as with no mesh in context."""
  from t5x_optim import restore_converted, restore_t5x_checkpoint, save_t5x_checkpoint

  mesh = jax.make_mesh((2, 4), ("data", "model"))
  split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", "model"))
  params = {"w": jax.device_put(jnp.linspace(-1.0, 1.0, 64).reshape(8, 8), split)}
  adam = w.OptaxWrapper(optax.adam(0.1))
  state = adam.create(params).apply_gradient(jax.tree.map(jnp.cos, params))
  save_t5x_checkpoint(tmp_path / "t5x", state)
  _save(tmp_path / "ours", 1, state)
  target = w.OptaxWrapper(optax.sgd(0.1, momentum=0.9)).create(params)
  target = target.replace(
    state=target.state.replace(step=jax.device_put(target.state.step, jax.devices()[0]))
  )
  want = [
    restore_t5x_checkpoint(tmp_path / "t5x", state),
    restore_converted(tmp_path / "ours", target, source=adam, missing="init")[0],
  ]
  with jax.set_mesh(mesh):
    got = [
      restore_t5x_checkpoint(tmp_path / "t5x", state),
      restore_converted(tmp_path / "ours", target, source=adam, missing="init")[0],
    ]
  for x, y in zip(got, want, strict=True):
    w.assert_same_state(x, y)


@pytest.mark.slow
@pytest.mark.parametrize(
  "placed", ["mesh", "one_device", "moment_on_one_device", "numpy_step", "abstract_step"]
)
def test_params_only_into_an_eagerly_created_optimizer_over_a_mesh(tmp_path, placed):
  """A params-only restore into an optimizer created eagerly over params on a mesh (or on one
  device that is not the default): its fresh state's count was on the default device and its
  moments beside the params, which one program could not place ("Received incompatible
  devices"); the restored optimizer then steps jitted. A target whose moment a user put on
  one device beside params on the mesh failed the same way; its fresh moment is placed as the
  target's. A target's step without a sharding (numpy, or abstract without one) does not
  stop the others from being placed as the target's."""
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", "model"))
  where = jax.devices()[3] if placed == "one_device" else split
  params = {"w": jax.device_put(jnp.linspace(-1.0, 1.0, 64).reshape(8, 8), where)}
  state = w.OptaxWrapper(optax.sgd(0.1)).create(params).apply_gradient(params)
  _save(tmp_path, 1, state)
  target = w.OptaxWrapper(optax.adam(0.1)).create(params)
  if placed == "moment_on_one_device":
    one = jax.tree.map(lambda x: jax.device_put(x, jax.devices()[0]), target.state.param_states)
    target = target.replace(state=target.state.replace(param_states=one))
  step = {"numpy_step": np.int32(0), "abstract_step": jax.ShapeDtypeStruct((), jnp.int32)}
  if placed in step:
    target = target.replace(state=target.state.replace(step=step[placed]))
  restored = _restore(tmp_path, target, params_only=True)
  np.testing.assert_array_equal(restored.target["w"], state.target["w"])
  pairs = zip(*(jax.tree.leaves(o.state.param_states) for o in (restored, target)), strict=True)
  for got, like in pairs:
    assert got.sharding == like.sharding
  if placed not in step:
    assert restored.state.step.sharding == target.state.step.sharding
  if placed not in ("moment_on_one_device", "abstract_step"):  # Placed apart by the target.
    stepped = jax.jit(lambda o: o.apply_gradient(o.target))(restored)
    assert int(stepped.state.step) == 2


@pytest.mark.slow
def test_a_save_under_another_meshs_context(tmp_path):
  """A state on one mesh saved under `jax.set_mesh` of another mesh of the same devices: the
  checksums refused the state's mesh ("context mesh ... should match the aval mesh") and
  nothing was saved; it saves and restores as with no mesh in context."""
  explicit = (jax.sharding.AxisType.Explicit,) * 2
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=explicit)
  other = jax.make_mesh((4, 2), ("x", "y"), axis_types=explicit)
  split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", "model"))
  params = {"w": jax.device_put(jnp.linspace(-1.0, 1.0, 64).reshape(8, 8), split)}
  state = w.OptaxWrapper(optax.adam(0.1)).create(params)
  with jax.set_mesh(other):
    _save(tmp_path, 1, state)
  w.assert_same_state(_restore(tmp_path, state), state)


@pytest.mark.parametrize(
  "record, message",
  [
    ("[]", "expected a JSON object, got list"),
    (
      '{"arrays": [{"path": ["target", "none"], "shape": [3], "dtype": "float32"}]}',
      "with elements",
    ),
  ],
)
def test_a_corrupt_record_of_zero_size_arrays_is_a_corrupt_step(tmp_path, record, message):
  opt_def = w.OptaxWrapper(optax.sgd(0.1))
  _save(tmp_path, 1, opt_def.create(EMPTY_PARAMS))
  _save(tmp_path, 2, opt_def.create(EMPTY_PARAMS))
  (tmp_path / "2" / "zero_size_arrays" / "metadata").write_text(record)
  with pytest.raises(
    CheckpointError, match="Checkpoint step 2 in .* record of its zero-size"
  ) as info:
    _restore(tmp_path, opt_def.create(EMPTY_PARAMS))
  assert message in str(info.value)
  with Checkpointer(tmp_path) as ckpt:
    ckpt.restore(opt_def.create(EMPTY_PARAMS), fallback=True)
    assert ckpt.restored_step == 1


@pytest.mark.parametrize(
  "victim, message",
  [
    ("_METADATA", "has no readable tree metadata: .*No such file"),
    (
      "d",
      "has unreadable metadata at 'flax_mutables/stats/calls', .*'target/dense/kernel': "
      "ValueError: NOT_FOUND",
    ),
  ],
)
def test_corrupt_checkpoint_raises(tmp_path, part_2x4, victim, message):
  state = w.fresh_state("adamw", part_2x4)
  _save(tmp_path, 1, state)
  path = tmp_path / "1" / "default" / victim
  shutil.rmtree(path) if path.is_dir() else path.unlink()
  with pytest.raises(CheckpointError, match=f"Checkpoint step 1 in {tmp_path} {message}"):
    _restore(tmp_path, state)


def _numpy_params_optimizer(part):
  del part
  params = {"w": np.arange(4, dtype=np.float32)}
  return w.OptaxWrapper(optax.adamw(0.1)).create(params)


@pytest.mark.parametrize(
  "make",
  [lambda part: w.train(w.fresh_state("adamw", part), 1), _numpy_params_optimizer],
  ids=["sharded adamw train state", "numpy params"],
)
@pytest.mark.parametrize("params_only", [False, True])
def test_restore_check_reads_what_orbax_metadata_reads(tmp_path, part_2x4, make, params_only):
  """The header-only check agrees with orbax's own `metadata` on every array it opens."""
  _save(tmp_path, 1, make(part_2x4))
  item = tmp_path / "1" / "default"
  wanted = checkpoints_impl._is_params_only_path if params_only else checkpoints_impl._any_path
  ours = checkpoint_headers.open_stored(item, "step 1", 1, wanted)
  theirs = flax.traverse_util.flatten_dict(ocp.PyTreeCheckpointHandler().metadata(item).tree)
  assert ours and ours == {
    path: jax.ShapeDtypeStruct(meta.shape, meta.dtype)
    for path, meta in theirs.items()
    if wanted(path)
  }


def test_checkpoints_use_orbax_public_api_only():
  source = ast.parse(inspect.getsource(checkpoints_impl))
  imported = [
    node.module if isinstance(node, ast.ImportFrom) else alias.name
    for node in ast.walk(source)
    if isinstance(node, ast.Import | ast.ImportFrom)
    for alias in node.names
  ]
  assert "orbax.checkpoint" in imported
  assert not [name for name in imported if name and "._src" in name]


def test_steps_keep_and_order(tmp_path, part_2x4):
  state = w.fresh_state("adamw", part_2x4)
  with Checkpointer(tmp_path, keep=2) as ckpt:
    assert (ckpt.latest_step(), ckpt.all_steps()) == (None, [])
    for step in (1, 5, 9):
      ckpt.save(step, state)
    ckpt.wait_until_finished()
    assert (ckpt.latest_step(), ckpt.all_steps()) == (9, [5, 9])
    with pytest.raises(ValueError, match="step 9 is already saved"):
      ckpt.save(9, state)
    with pytest.raises(FileNotFoundError, match=r"step 1 .* the steps are \[5, 9\]"):
      ckpt.restore(state, step=1)
  with pytest.raises(FileNotFoundError, match="No complete checkpoint"):
    _restore(tmp_path / "empty", state)


@pytest.mark.parametrize("async_save", [True, False])
def test_a_save_that_fails_keeps_the_steps_on_disk_listed_and_rotated(
  tmp_path, monkeypatch, async_save
):
  """With keep=1, orbax drops the step a save will rotate away from its list when the save
  starts: a save that failed (a full disk) left step 1 intact on disk but unlisted, so the
  run named no checkpoint, and the next save never rotated step 1 away (two kept)."""
  from t5x_optim._checkpoint.checksums import ChecksumsHandler  # noqa: PLC0415

  opt = optimizers.sgd(0.1).create({"w": jnp.ones(2)})

  def disk_full(self, directory, pending):
    raise OSError(28, "No space left on device")

  with Checkpointer(tmp_path, keep=1, async_save=async_save) as ckpt:
    ckpt.save(1, opt)
    ckpt.wait_until_finished()
    with monkeypatch.context() as patch:
      patch.setattr(ChecksumsHandler, "_write", disk_full)
      with pytest.raises(OSError, match="No space left"):
        ckpt.save(2, opt)
        ckpt.wait_until_finished()
    assert (ckpt.all_steps(), ckpt.latest_step()) == ([1], 1)
    ckpt.save(3, opt)
    ckpt.wait_until_finished()
    assert ckpt.all_steps() == [3]
  assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["3"]


def test_a_relative_directory_is_the_one_below_the_working_directory_when_opened(
  tmp_path, monkeypatch
):
  opt = optimizers.adam(0.1).create({"w": jnp.arange(3.0)})
  monkeypatch.chdir(tmp_path)
  with Checkpointer("run/checkpoints") as ckpt:
    ckpt.save(1, opt)
    ckpt.wait_until_finished()
    monkeypatch.chdir(tmp_path.parent)  # where the process is afterwards does not matter
    ckpt.save(2, opt)
    ckpt.wait_until_finished()
    assert ckpt.all_steps() == [1, 2]
    assert ckpt.restore(opt).target["w"].tolist() == [0.0, 1.0, 2.0]
  assert sorted(os.listdir(tmp_path / "run" / "checkpoints" / "2")) == sorted(
    os.listdir(tmp_path / "run" / "checkpoints" / "1")
  )
  monkeypatch.chdir(tmp_path / "run")
  assert _restore("checkpoints", opt, step=2).target["w"].tolist() == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("key", ["a.b", "a/b"])
def test_keys_that_two_paths_would_share_are_refused_before_anything_is_written(tmp_path, key):
  """orbax names an array by its keys joined with '.', a checksum by its path joined with '/':
  ``{'a.b'}`` and ``{'a': {'b'}}`` were written to one file (the step was damaged from the
  start, and its restore blamed the disk); ``{'a/b'}`` and ``{'a': {'b'}}`` shared one checksum,
  so an intact step could not be restored."""
  good = w.OptaxWrapper(optax.sgd(0.1)).create({"a": {"b": jnp.array([3.0, 4.0])}})
  _save(tmp_path, 0, good)
  params = {key: jnp.array([1.0, 2.0]), "a": {"b": jnp.array([3.0, 4.0])}}
  shared = re.escape(f"('target', '{key}') and ('target', 'a', 'b') would share")
  with pytest.raises(ValueError, match=rf"{shared} .*Nothing was written"):
    _save(tmp_path, 1, w.OptaxWrapper(optax.sgd(0.1)).create(params))
  with Checkpointer(tmp_path) as ckpt:
    assert ckpt.all_steps() == [0]
    w.assert_same_state(ckpt.restore(good), good)  # the previous step is intact


@pytest.mark.parametrize("keys, shapes", [(("a", "a/"), (3, 3)), (("", "/"), (3, 2))])
def test_keys_that_differ_by_a_trailing_slash_are_refused_before_anything_is_written(
  tmp_path, keys, shapes
):
  """tensorstore keeps an array in the directory of its name, so ``a`` and ``a/`` were written to
  one array: the restore called the step corrupt (and ``verify=False`` gave both one value), or,
  with other shapes, the save failed in tensorstore naming no param."""
  params = {key: jnp.full(shape, float(i)) for i, (key, shape) in enumerate(zip(keys, shapes))}
  shared = re.escape(
    f"('target', '{keys[0]}') and ('target', '{keys[1]}') would share the array file "
    f"target.{keys[0]}"
  )
  with pytest.raises(ValueError, match=rf"{shared}\. Nothing was written"):
    _save(tmp_path, 1, w.OptaxWrapper(optax.sgd(0.1)).create(params))
  with Checkpointer(tmp_path) as ckpt:
    assert ckpt.all_steps() == []


OCDBT_NAMES = ["t.a", "t.a/", "t.a//", "t.a/b", "t.a//b", "t.a/./b", "t.a/../b", "t.a\\b", "t."]


def test_array_key_is_where_orbax_stores_an_array(tmp_path):
  """orbax's OCDBT store keeps each array's zarr key as the name with one ``/`` appended unless it
  ends in one: asked of tensorstore itself."""
  base = {"driver": "file", "path": str(tmp_path)}
  for name in OCDBT_NAMES:
    kvstore = {"driver": "ocdbt", "base": base, "path": name}
    spec = {"driver": "zarr", "kvstore": kvstore, "dtype": "float32", "metadata": {"shape": [2]}}
    assert ts.open(spec, create=True, open=True).result().kvstore.path == array_key(name), name


def test_names_orbax_keeps_apart_still_round_trip(tmp_path):
  params = {key: jnp.full(2, float(i)) for i, key in enumerate(["a/b", "a//b", "a/./b", "a\\b"])}
  opt = w.OptaxWrapper(optax.sgd(0.1)).create(params)
  _save(tmp_path, 1, opt)
  w.assert_same_state(
    _restore(tmp_path, opt.replace(target=jax.tree.map(jnp.zeros_like, params))), opt
  )


@pytest.mark.slow
def test_saves_from_several_threads_take_turns(tmp_path):
  """One checkpointer saving from three threads at once: steps were lost without an error, a
  listed step could not be read, and the checkpointer took itself for another writer."""
  import threading  # noqa: PLC0415

  opt = w.OptaxWrapper(optax.adamw(0.1)).create({"w": jnp.arange(1000.0), "v": jnp.ones((8, 8))})
  refused = []

  def save(checkpointer, step):
    try:
      checkpointer.save(step, opt.replace(target=jax.tree.map(lambda x: x * step, opt.target)))
    except ValueError as error:  # a step not newer than one another thread saved first
      assert "steps must increase" in str(error)
      refused.append(step)

  with Checkpointer(tmp_path) as checkpointer:
    checkpointer.save(0, opt)
    threads = [threading.Thread(target=save, args=(checkpointer, k)) for k in (1, 2, 3)]
    for thread in threads:
      thread.start()
    for thread in threads:
      thread.join()
    checkpointer.wait_until_finished()
  with Checkpointer(tmp_path) as reader:
    steps = reader.all_steps()
    assert sorted([*steps, *refused]) == [0, 1, 2, 3]
    for step in steps[1:]:
      restored = reader.restore(opt, step)
      np.testing.assert_array_equal(restored.target["w"], np.arange(1000.0) * step)
  assert not list(tmp_path.glob("*.orbax-checkpoint-tmp*"))


def test_a_symlinked_step_is_refused_where_steps_rotate_and_restored_where_not(tmp_path):
  """orbax's rotation cannot delete a step that is a symbolic link: every later save failed
  in the background with an OSError naming no path, and keep= stopped being kept."""
  opt = optimizers.sgd(0.1).create({"w": jnp.arange(3.0)})
  directory, archive = tmp_path / "run", tmp_path / "archive"
  _save(directory, 1, opt)
  archive.mkdir()
  (directory / "1").rename(archive / "1")
  (directory / "1").symlink_to(archive / "1")
  link = f"{directory / '1'} -> {archive / '1'}"
  with pytest.raises(
    CheckpointError, match=re.escape(f"step 1 is a symbolic link ({link})")
  ) as caught:
    Checkpointer(directory, keep=2)
  assert caught.value.step == 1 and "replace it with a copy" in str(caught.value)
  restored = _restore(directory, opt)
  np.testing.assert_array_equal(restored.target["w"], np.arange(3.0))


@pytest.mark.parametrize("keep", [0, -1, 1.5, "2", True])
def test_keep_is_a_whole_number_of_steps(tmp_path, keep):
  with pytest.raises(ValueError, match=f"keep must be None or an int >= 1, got {keep!r}"):
    Checkpointer(tmp_path, keep=keep)
  assert list(tmp_path.iterdir()) == []
  Checkpointer(tmp_path, keep=np.int64(2)).close()


def test_a_file_is_refused_as_a_checkpoint_directory(tmp_path):
  path = tmp_path / "notes.txt"
  path.write_text("mine")
  with pytest.raises(NotADirectoryError, match=f"{path} is a file, not a checkpoint directory"):
    Checkpointer(path)
  assert path.read_text() == "mine"


@pytest.mark.slow
def test_a_save_of_small_replicated_arrays_compiles_nothing_but_the_checksums(tmp_path):
  # orbax would copy each replicated array off the devices in one slice per replica,
  # compiling a slicing program per shape at the first save: 1.9 s of a 1-step run.
  mesh = jax.make_mesh((8,), ("data",))
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  params = {f"w{n}": jnp.arange(n * 8.0) for n in (1, 3, 7, 13)} | {"b": jnp.zeros((5, 16))}
  opt = optimizers.adam(0.1).create(jax.device_put(params, replicated))
  arrays = {path: saveable(leaf) for path, leaf in flatten(opt.state_dict()).items()}
  fetch(dispatch_checksums(arrays))
  compiles = []

  def record(event, duration, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
      compiles.append(kwargs)

  jax.monitoring.register_event_duration_secs_listener(record)
  try:
    with Checkpointer(tmp_path) as ckpt:
      ckpt.save(1, opt)
      ckpt.wait_until_finished()
  finally:
    jax.monitoring.unregister_event_duration_listener(record)
  assert compiles == []
  restored = _restore(tmp_path, opt)
  assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), restored, opt))
  # The step holds what orbax's own writer records, and orbax's own reader reads it.
  assert (tmp_path / "1" / "default" / "array_metadatas" / "process_0").is_file()
  with ocp.PyTreeCheckpointer() as reader:
    stored = reader.restore(tmp_path / "1" / "default")
  assert flatten(stored).keys() == arrays.keys()
  for path, array in flatten(stored).items():
    np.testing.assert_array_equal(array, arrays[path], err_msg=str(path))


def test_each_step_records_the_job_and_only_committed_steps_count(tmp_path):
  opt = optimizers.adam(0.1).create({"w": jnp.ones(2)})
  job = {"model": {"layers": 2}, "optimizer": "optax.adam"}
  with Checkpointer(tmp_path, async_save=False) as plain:
    plain.save(1, opt)
  with Checkpointer(tmp_path, async_save=False, job=job) as ckpt:
    ckpt.save(2, opt)
    (tmp_path / "3").mkdir()  # an interrupted copy: a step's name, nothing committed
    assert ckpt.recorded_job(2) == job and ckpt.recorded_job(1) is None
    assert [ckpt.is_committed(step) for step in (1, 2, 3)] == [True, True, False]
  with pytest.raises(
    ValueError, match="job is not JSON: Object of type builtin_function_or_method"
  ):
    Checkpointer(tmp_path, job={"f": print})


def test_a_step_that_lost_a_record_its_metadata_lists_is_not_whole(tmp_path):
  """A copy of a run that left out each step's small job/metadata (an interrupted rsync):
  `recorded_job` said None, "saved before records existed", so a resume into another model
  of the same shapes and --init_from compared nothing and went on. So with state_classes,
  whose loss skipped the check of the state's classes on restore."""
  params = {"w": jnp.ones(2)}
  opt = optimizers.adam(0.1).create(params)
  with Checkpointer(tmp_path, async_save=False) as plain:
    plain.save(1, opt)  # no job given: none recorded, none listed
  with Checkpointer(tmp_path, async_save=False, job={"model": "a"}) as ckpt:
    ckpt.save(2, opt)
  (tmp_path / "2" / "job" / "metadata").unlink()
  shutil.rmtree(tmp_path / "2" / "state_classes")
  with Checkpointer(tmp_path) as ckpt:
    assert ckpt.recorded_job(1) is None
    lost = f"Checkpoint step 2 in {tmp_path} has lost its record of its "
    with pytest.raises(CheckpointError, match=f"{lost}job .*the step's metadata lists it"):
      ckpt.recorded_job(2)
    with pytest.raises(CheckpointError, match=f"{lost}optimizer") as error:
      ckpt.restore(opt)
    assert error.value.step == 2
    assert ckpt.restore(opt, fallback=True).state.step == opt.state.step
    assert ckpt.restored_step == 1


def test_restore_neither_copies_nor_rereads_needlessly(tmp_path, part_2x4, monkeypatch):
  state, target = w.fresh_state("adamw", part_2x4), w.abstract_state("adamw", part_2x4)
  read, reloads = [], []
  orbax_restore, orbax_reload = ocp.CheckpointManager.restore, ocp.CheckpointManager.reload

  def restore(self, *args, **kwargs):
    read.append(orbax_restore(self, *args, **kwargs))
    return read[-1]

  def reload(self):
    reloads.append(self.directory)
    orbax_reload(self)

  monkeypatch.setattr(ocp.CheckpointManager, "restore", restore)
  monkeypatch.setattr(ocp.CheckpointManager, "reload", reload)
  with Checkpointer(tmp_path) as other:
    other.save(1, state)
    other.wait_until_finished()
    ckpt = Checkpointer(tmp_path)
    restored = ckpt.restore(target, step=1)
    assert reloads == []
    got = jax.tree.leaves_with_path(restored.state_dict())
    want = dict(jax.tree.leaves_with_path(read[-1]["default"]))
    assert got and all(leaf is want[path] for path, leaf in got)
    other.save(2, w.train(state, 1))
    other.wait_until_finished()
    w.assert_same_state(ckpt.restore(target), w.train(state, 1))
    assert len(reloads) == 1 and ckpt.all_steps() == [1, 2]
    w.assert_same_state(ckpt.restore(target, step=2), w.train(state, 1))
    assert len(reloads) == 1
    shutil.rmtree(tmp_path / "1")
    with pytest.raises(FileNotFoundError, match=r"step 1 .* the steps are \[2\]"):
      ckpt.restore(target, step=1)
    assert len(reloads) == 2
    ckpt.close()


def test_a_reader_lists_the_steps_on_disk_at_each_call(tmp_path):
  """A checkpointer made before another saved into its directory listed none of those steps
  (all_steps() [], latest_step() None) until a restore: it kept the list it was made with."""
  opt = optimizers.sgd(0.1).create({"w": jnp.ones(2)})
  reader = Checkpointer(tmp_path)
  assert (reader.all_steps(), reader.latest_step()) == ([], None)
  with Checkpointer(tmp_path) as writer:
    for step in (1, 2):
      writer.save(step, opt)
      assert writer.all_steps()[-1] == step, "its own save in flight"
      writer.wait_until_finished()
      assert (reader.all_steps(), reader.latest_step()) == (list(range(1, step + 1)), step)
    shutil.rmtree(tmp_path / "2")
    (tmp_path / "3.orbax-checkpoint-tmp-1").mkdir()
    assert (reader.all_steps(), reader.latest_step()) == ([1], 1)
  w.assert_same_state(reader.restore(opt), opt)
  reader.close()


ERROR_CASES = {
  "another optimizer's state": (
    dict(opt_name="sgd_momentum"),
    [
      "missing key 'state/param_states/0/trace/dense/kernel'",
      "unexpected key 'state/param_states/0/mu/dense/kernel'",
    ],
  ),
  "wrong shapes": (
    dict(opt_name="adamw", mlp=64),
    [
      "shape mismatch at 'target/dense/kernel': the target has float32[16, 64], the "
      "checkpoint has float32[16, 32]"
    ],
  ),
  "a dtype of another kind": (
    dict(opt_name="adamw", dtype=jnp.bool_),
    [
      "dtype mismatch at 'target/dense/kernel': the checkpoint's float32 cannot be cast "
      "safely to the target's bool"
    ],
  ),
  "a param missing from the checkpoint": (
    dict(opt_name="adamw", scale=True),
    [
      "missing key 'target/dense/scale' (the target has float32[16] there)",
      "missing key 'state/param_states/0/nu/dense/scale'",
    ],
  ),
  "params only, wrong shapes": (
    dict(opt_name="sgd_momentum", embed=8, params_only=True),
    ["shape mismatch at 'target/dense/kernel'"],
  ),
}


def test_a_refusal_lists_the_params_and_mismatches_first_and_counts_the_rest_by_kind():
  """A checkpoint of another layout was refused with every key, thousands of characters; the
  count of the rest said "other mismatchs" for shape and dtype mismatches."""
  missing = [f"missing key 'state/param_states/0/mu/p{i}' (...)" for i in range(9)]
  other = ["dtype mismatch at 'state/count': ...", "shape mismatch at 'target/p1': ..."]
  shown = listed([*missing, "unexpected key 'state/x' (...)", *other, "shape mismatch at 'a'"])
  assert shown[:3] == [other[1], "shape mismatch at 'a'", other[0]]
  assert shown[3:-1] == missing[:5]
  assert shown[-1] == "and 5 more (4 missing keys, 1 unexpected key)"
  assert listed(missing[:8]) == missing[:8]
  mutable = "unexpected key 'flax_mutables/batch_stats/old' (...)"
  values = [f"Value mismatch at 'state/step{i}': ..." for i in range(2)]
  shown = listed([*missing, *values, mutable])
  assert shown[:3] == [mutable, *values], "another model's first, then mismatches"
  assert shown[-1] == "and 4 more (4 missing keys)"
  assert listed([*values, *values, *missing])[-1] == "and 5 more (5 missing keys)"
  assert listed(values * 5)[-1] == "and 2 more (2 value mismatches)"


@pytest.mark.parametrize("case", ERROR_CASES)
def test_incompatible_checkpoint_raises_before_reading(tmp_path, part_2x4, monkeypatch, case):
  kwargs, messages = ERROR_CASES[case]
  kwargs = dict(kwargs)
  opt_name, params_only = kwargs.pop("opt_name"), kwargs.pop("params_only", False)
  _save(tmp_path, 1, w.fresh_state("adamw", part_2x4))
  target = w.abstract_state(opt_name, part_2x4, **kwargs)

  def no_read(*args, **kwargs):
    raise AssertionError("arrays were read before validation")

  monkeypatch.setattr(ocp.CheckpointManager, "restore", no_read)
  with pytest.raises(ValueError, match="does not fit the target") as info:
    _restore(tmp_path, target, params_only=params_only)
  for message in messages:
    assert message in str(info.value)
  assert "Nothing was restored" in str(info.value)


@pytest.mark.slow
def test_resume_in_new_process_and_crash_mid_save(tmp_path, part_2x4):
  resume_dir, crash_dir = tmp_path / "resume", tmp_path / "crash"
  straight = w.train(w.fresh_state("adamw", part_2x4), 2 * w.RESUME_STEPS)
  _save(resume_dir, w.RESUME_STEPS, w.train(w.fresh_state("adamw", part_2x4), w.RESUME_STEPS))

  [(returncode, output)] = w.run_workers(
    [["resume_crash", str(resume_dir), str(crash_dir)]], devices=8
  )

  assert returncode == -9, output
  resumed = _restore(resume_dir, w.abstract_state("adamw", part_2x4))
  assert int(resumed.step) == 2 * w.RESUME_STEPS
  w.assert_same_state(resumed, straight)
  partial = [p.name for p in crash_dir.iterdir() if p.name.startswith("2.")]
  assert partial and all("tmp" in name for name in partial), sorted(os.listdir(crash_dir))
  with Checkpointer(crash_dir) as ckpt:
    assert ckpt.all_steps() == [1]
    w.assert_same_state(
      ckpt.restore(w.abstract_state("adamw", part_2x4)), w.fresh_state("adamw", part_2x4)
    )
    # The worker died holding the directory's writer lock: it died with it.
    ckpt.save(2, w.fresh_state("adamw", part_2x4))
  assert sorted(os.listdir(crash_dir)) == [".t5x_optim.lock", "1", "2"]


@pytest.mark.slow
@pytest.mark.skipif(
  sys.platform == "win32",
  reason="jax.distributed CPU collectives (gloo) are not available on Windows",
)
def test_two_processes_restore_and_save(tmp_path, part_2x4):
  in_dir, out_dir = tmp_path / "in", tmp_path / "out"
  state = w.train(w.fresh_state("adamw", part_2x4), w.MP_STEPS)
  _save(in_dir, w.MP_STEPS, state)
  port = free_port()

  results = w.run_workers(
    [["multiprocess", str(in_dir), str(out_dir), str(port), str(i)] for i in range(2)], devices=4
  )

  for process_id, (returncode, output) in enumerate(results):
    assert returncode == 0, f"process {process_id}:\n{output}"
  part_1x8 = w.partitioner(1, 8)
  restored = _restore(out_dir, w.abstract_state("adamw", part_1x8))
  w.assert_same_state(restored, w.train(w.fresh_state("adamw", part_1x8), w.MP_STEPS + 1))


def test_a_restore_that_narrows_the_optimizer_states_floats_says_so(tmp_path):
  """bfloat16 params with float32 gradients: optax's adam holds ``mu`` in float32 after its
  first update, and a restore into a freshly created optimizer (``mu`` in bfloat16) rounded it
  without a word, so the resumed run drifted from the uninterrupted one. The cast is the
  documented rule; the restore now warns, naming the leaf and both dtypes."""
  params = {"w": jnp.linspace(-1.0, 1.0, 64, dtype=jnp.bfloat16).reshape(8, 8)}
  opt_def = w.OptaxWrapper(optax.adam(0.1))
  state = opt_def.create(params).apply_gradient({"w": jnp.full((8, 8), 0.3, jnp.float32)})
  assert state.state.param_states[0].mu["w"].dtype == jnp.float32
  _save(tmp_path, 1, state)
  with pytest.warns(
    UserWarning,
    match=r"'state/param_states/0/mu/w' \(float32 in the checkpoint, bfloat16 in the state read "
    r"into\)",
  ):
    _restore(tmp_path, opt_def.create(params))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    w.assert_same_state(_restore(tmp_path, state), state)
    float32 = {"w": params["w"].astype(jnp.float32)}
    _restore(tmp_path, state.replace(target=float32))
