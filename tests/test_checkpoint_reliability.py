"""Checkpoint integrity, one writer per directory, bounded multi-process failure."""

import functools
import json
import logging
import os
import re
import shutil
import sys
import time

import _checkpoint_worker as w
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _ocdbt import array_chunks, flip_bytes
from _subprocesses import free_port

from t5x_optim import CheckpointError, distributed, optimizers
from t5x_optim._checkpoint.checksums import dispatch_checksums, fetch
from t5x_optim.checkpoints import Checkpointer


@pytest.fixture(scope="module")
def part_2x4():
  return w.partitioner(2, 4)


# Arrays big enough that their data files are the largest files of a step.
SIZES = dict(embed=64, mlp=128)


@pytest.fixture(scope="module")
def states(part_2x4):
  """The train states saved as steps 1 and 2."""
  init = functools.partial(w.init_fn, **SIZES)
  fresh = w.init_sharded(part_2x4, w.optimizer_def("adamw"), init)
  return {step: w.train(fresh, step) for step in (1, 2)}


@pytest.fixture(scope="module")
def target(part_2x4):
  return w.abstract_state("adamw", part_2x4, **SIZES)


def _truncate(step_dir):
  chunk = array_chunks(step_dir)[0]
  os.truncate(chunk.path, chunk.offset + chunk.length // 2)


def _delete_index(step_dir):
  for name in os.listdir(step_dir / "default" / "d"):
    os.remove(step_dir / "default" / "d" / name)


def _edit_checksums(edit):
  def corrupt(step_dir):
    path = step_dir / "checksums" / "checksums.json"
    path.write_text(edit(path.read_text()))

  return corrupt


def _bump_kernel(text):
  recorded = json.loads(text)
  recorded["target/dense/kernel"] = (recorded["target/dense/kernel"] + 1) % 2**32
  return json.dumps(recorded)


CORRUPTIONS = {
  "8 bytes flipped in array data": (
    lambda d: flip_bytes(d, 8),
    r"(is corrupt: the checksum differs|could not be read) at '(target|state)/",
  ),
  "array data truncated": (_truncate, r"could not be read at '(target|state)/"),
  "array data deleted": (
    lambda d: os.remove(array_chunks(d)[0].path),
    r"could not be read at '(target|state)/",
  ),
  "tree index deleted": (_delete_index, r"has unreadable metadata at 'flax_mutables/"),
  "checksums deleted": (
    lambda d: os.remove(d / "checksums" / "checksums.json"),
    r"has no readable checksums .*checksums\.json",
  ),
  "checksums not JSON": (_edit_checksums(lambda text: text[:-1]), r"has no readable checksums"),
  "a checksum changed": (
    _edit_checksums(_bump_kernel),
    r"is corrupt: the checksum differs at 'target/dense/kernel' "
    r"\(recorded 0x[0-9a-f]{8}, read 0x[0-9a-f]{8}\)",
  ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", CORRUPTIONS)
def test_corruption_is_a_checkpoint_error_and_falls_back(tmp_path, states, target, caplog, case):
  corrupt, message = CORRUPTIONS[case]
  with Checkpointer(tmp_path) as ckpt:
    for step, state in states.items():
      ckpt.save(step, state)
  corrupt(tmp_path / "2")
  with Checkpointer(tmp_path) as ckpt:
    with pytest.raises(CheckpointError, match=f"Checkpoint step 2 in {tmp_path} {message}") as e:
      ckpt.restore(target)
    assert isinstance(e.value, ValueError) and e.value.step == 2 and ckpt.restored_step is None
    with caplog.at_level(logging.WARNING, logger="t5x_optim.checkpoints"):
      w.assert_same_state(ckpt.restore(target, fallback=True), states[1])
    assert ckpt.restored_step == 1
    assert [r.getMessage()[:30] for r in caplog.records if r.name == "t5x_optim.checkpoints"] == [
      "Skipping checkpoint step 2: Ch",
      "Restored checkpoint step 1 of ",
    ]


@pytest.mark.slow
def test_a_step_without_checksums_restores_unverified_when_asked(tmp_path, states, target):
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(2, states[2])
  shutil.rmtree(tmp_path / "2" / "checksums")  # as written before checksums existed
  with Checkpointer(tmp_path) as ckpt:
    with pytest.raises(CheckpointError, match=r"restores with verify=False, unverified"):
      ckpt.restore(target)
    w.assert_same_state(ckpt.restore(target, verify=False), states[2])


@pytest.mark.slow
def test_fallback_limits(tmp_path, part_2x4, states, target):
  with Checkpointer(tmp_path) as ckpt:
    for step, state in states.items():
      ckpt.save(step, state)
  for step in states:
    flip_bytes(tmp_path / str(step), 8)
  with Checkpointer(tmp_path) as ckpt:
    with pytest.raises(
      CheckpointError, match="No intact checkpoint up to step 2 in .*step 2.*; Checkpoint step 1"
    ):
      ckpt.restore(target, fallback=True)
    with pytest.raises(ValueError, match="does not fit the target") as e:
      ckpt.restore(w.abstract_state("adamw", part_2x4), fallback=True)
    assert not isinstance(e.value, CheckpointError)


@pytest.mark.slow
def test_a_safe_cast_restore_is_verified(tmp_path, part_2x4):
  bf16 = w.init_sharded(part_2x4, w.optimizer_def("adamw"), lambda: w.init_fn(dtype=jnp.bfloat16))
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, bf16)
    restored = ckpt.restore(w.abstract_state("adamw", part_2x4))
  kernel = restored.params["dense"]["kernel"]
  assert kernel.dtype == jnp.float32
  np.testing.assert_array_equal(kernel, bf16.params["dense"]["kernel"].astype(jnp.float32))


def _checksum(value):
  """The checksum `Checkpointer` records for an array `value`."""
  return fetch(dispatch_checksums({("x",): value}))["x"]


def _meshes():
  devices = np.array(jax.devices())
  mesh_2x4 = jax.sharding.Mesh(devices.reshape(2, 4), ("a", "b"))
  mesh_8 = jax.sharding.Mesh(devices, ("a",))
  return [
    jax.sharding.NamedSharding(mesh_2x4, jax.P("a", "b")),
    jax.sharding.NamedSharding(mesh_8, jax.P(None, "a")),
    jax.sharding.SingleDeviceSharding(jax.devices()[3]),
  ]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8, jnp.bool_, jnp.complex64])
@pytest.mark.slow
def test_checksum_is_sharding_free_and_sees_any_change(dtype):
  x = (jnp.arange(64).reshape(8, 8) * 3 % 11).astype(dtype)
  sums = {_checksum(jax.device_put(x, sharding)) for sharding in _meshes()}
  assert len(sums) == 1
  changed = {
    _checksum(x.at[i, j].set(x[i, j] == 0 if dtype == jnp.bool_ else x[i, j] + 1))
    for i, j in [(0, 0), (3, 5), (7, 7)]
  }
  moved = _checksum(x.T)
  assert sums.isdisjoint(changed | {moved}) and len(changed) == 3


@pytest.mark.slow
def test_checksums_of_many_sharded_leaves_do_not_deadlock():
  # Dispatched all at once, 100 such all-reduce programs deadlock XLA:CPU's
  # 8 simulated devices (the process aborts after 40 s).
  sharding = _meshes()[0]
  leaves = {(f"w{i}",): jax.device_put(jnp.full((8, 8), float(i)), sharding) for i in range(128)}
  sums = fetch(dispatch_checksums(leaves))
  assert len(set(sums.values())) == 128
  assert sums["w7"] == _checksum(np.full((8, 8), 7.0, np.float32))


def test_checksum_of_nans_ignores_the_payload():
  nans = np.array([np.nan, np.nan], np.float32)
  nans.view(np.uint32)[1] = 0x7FC00001
  assert _checksum(nans[:1]) == _checksum(nans[1:])


@pytest.mark.slow
def test_one_writer_per_directory(tmp_path, states):
  with Checkpointer(tmp_path) as first, Checkpointer(tmp_path) as second:
    first.save(1, states[1])
    start = time.monotonic()
    with pytest.raises(
      CheckpointError,
      match=(
        rf"Cannot save step 2: checkpoint directory {tmp_path} is in use by another writer "
        rf"\(pid {os.getpid()} on .*\)\. Only one Checkpointer"
      ),
    ):
      second.save(2, states[2])
    assert time.monotonic() - start < 5
    first.wait_until_finished()
    assert sorted(os.listdir(tmp_path)) == [".t5x_optim.lock", "1"]
    w.assert_same_state(second.restore(states[1]), states[1])
    first.close()
    second.save(2, states[2])
    second.wait_until_finished()
    assert second.all_steps() == [1, 2]


@pytest.mark.slow
def test_two_writer_processes(tmp_path):
  directory, markers = tmp_path / "ckpt", tmp_path / "markers"
  markers.mkdir()
  start = time.monotonic()
  results = w.run_workers([["writer", str(directory), str(markers)]] * 2, devices=8)
  outputs = [out for _, out in results]
  assert [code for code, _ in results] == [0, 0], outputs
  assert time.monotonic() - start < 60, outputs
  outcomes = sorted(re.search(r"^(SAVED|REFUSED: .*)$", out, re.M).group(1) for out in outputs)
  assert outcomes[1] == "SAVED" and re.match(
    r"REFUSED: Cannot save step 1: checkpoint directory .* is in use by another writer", outcomes[0]
  ), outputs
  with Checkpointer(directory) as ckpt:
    assert ckpt.all_steps() == [1, 2, 3]
    for step in (1, 2, 3):
      restored = ckpt.restore(w.small_optimizer(), step=step)
      np.testing.assert_array_equal(restored.target["w"], w.small_optimizer().target["w"])


@pytest.mark.parametrize(
  "name, value",
  [
    ("heartbeat_timeout_seconds", 0),
    ("heartbeat_timeout_seconds", 2.5),
    ("shutdown_timeout_seconds", True),
    ("initialization_timeout", "300"),
  ],
)
def test_distributed_timeouts_are_checked(name, value):
  with pytest.raises(ValueError, match=f"{name} must be a whole number of seconds >= 1, got"):
    distributed.initialize("127.0.0.1:1", num_processes=2, process_id=0, **{name: value})


@pytest.mark.slow
@pytest.mark.skipif(
  sys.platform == "win32",
  reason="jax.distributed CPU collectives (gloo) are not available on Windows",
)
def test_survivor_exits_soon_after_a_peer_dies(tmp_path):
  kill_file = tmp_path / "killed_at"
  port = free_port()
  [(code, output), (victim_code, _)] = w.run_workers(
    [["peer_killed", str(port), str(i), str(kill_file)] for i in range(2)], devices=4
  )
  exited_at = time.time()
  assert victim_code == -9 and kill_file.exists(), output
  assert code not in (0, None) and "timed out" not in output, output
  assert exited_at - float(kill_file.read_text()) < 20, output
  assert re.search(
    "Terminating process because the JAX distributed service detected fatal "
    "errors|tasks are unhealthy",
    output,
  ), output


_SAVE_AND_END = """
import sys, jax.numpy as jnp
from t5x_optim import optimizers
from t5x_optim.checkpoints import Checkpointer
checkpointer = Checkpointer(sys.argv[1])
checkpointer.save(1, optimizers.sgd(0.1).create({"w": jnp.arange(64.0)}))
"""


@pytest.mark.slow
def test_a_save_pending_when_the_script_ends_is_finished(tmp_path):
  """A script that saved and ended without close() exited 0 with the step lost: the finalizer
  meant to finish it ran after Python had shut down the threads orbax commits with."""
  import subprocess

  done = subprocess.run(
    [sys.executable, "-c", _SAVE_AND_END, str(tmp_path / "ckpt")],
    capture_output=True,
    text=True,
    timeout=120,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )
  assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
  with Checkpointer(tmp_path / "ckpt") as checkpointer:
    assert checkpointer.all_steps() == [1]
    restored = checkpointer.restore(optimizers.sgd(0.1).create({"w": jnp.zeros(64)}), step=1)
  np.testing.assert_array_equal(restored.target["w"], np.arange(64.0))
