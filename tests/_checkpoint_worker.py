"""Shared fixtures for the checkpoint tests, and their subprocess entry point.

Imported by tests/test_checkpoints.py for the model, optimizers and training
loop; run as a script in a fresh process for the scenarios that need one:

  python tests/_checkpoint_worker.py resume_crash RESUME_DIR CRASH_DIR
  python tests/_checkpoint_worker.py multiprocess IN_DIR OUT_DIR PORT PROCESS_ID
  python tests/_checkpoint_worker.py writer DIR MARKERS_DIR
  python tests/_checkpoint_worker.py peer_killed PORT PROCESS_ID KILL_FILE
  python tests/_checkpoint_worker.py any_mesh OPT_NAME IN_DIR EXPECTED_NPZ PORT PROCESS_ID

`run_workers` starts them (the parent sets ``XLA_FLAGS``, the device count,
in the environment before this script imports jax). Training is elementwise (gradients are a fixed
function of the params), so results are bit-identical on every mesh.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _subprocesses import communicate_all, with_xla_flags

from t5x_optim import (
  MultiOptimizer,
  OptaxWrapper,
  PathFilter,
  TrainState,
  distributed,
  low_precision,
  reapply_config,
)
from t5x_optim.checkpoints import Checkpointer, CheckpointError
from t5x_optim.partitioning import (
  Partitioner,
  abstract_train_state,
  create_mesh,
  init_sharded,
  standard_logical_axis_rules,
)

EMBED, MLP = 16, 32
RESUME_STEPS = 3
MP_STEPS = 2
WORKER_TIMEOUT_S = 150
KILL_AFTER_STEPS = 20


def run_workers(argvs: Sequence[Sequence[str]], *, devices: int) -> list[tuple[int, str]]:
  """Runs this script once per argv, in parallel, all within WORKER_TIMEOUT_S.

  Returns one (returncode, output tail) pair per worker; on timeout every
  worker still running is killed and its output says so.
  """
  env = with_xla_flags(
    dict(os.environ, JAX_PLATFORMS="cpu"), f"--xla_force_host_platform_device_count={devices}"
  )
  procs = [
    subprocess.Popen(
      [sys.executable, __file__, *argv],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for argv in argvs
  ]
  return [(code, out[-4000:]) for code, out, _ in communicate_all(procs, WORKER_TIMEOUT_S)]


OPTIMIZERS = {
  "adamw": lambda: OptaxWrapper(optax.adamw(1e-2)),
  "adafactor": lambda: OptaxWrapper(optax.adafactor(1e-2, min_dim_size_to_factor=EMBED)),
  "multi": lambda: MultiOptimizer(
    [
      (PathFilter("kernel$"), OptaxWrapper(optax.adamw(1e-2))),
      (PathFilter("bias$"), OptaxWrapper(optax.sgd(1e-2, momentum=0.9))),
    ]
  ),
  "sgd_momentum": lambda: OptaxWrapper(optax.sgd(1e-2, momentum=0.9)),
  # Low-precision states with the default blocks: on a 16-wide shard of the 32-wide kernel
  # a block of 4 spans two devices.
  "adamw_8bit": lambda: OptaxWrapper(low_precision(optax.adamw(1e-2), "8bit", min_size=0)),
  "adamw_4bit": lambda: OptaxWrapper(low_precision(optax.adamw(1e-2), "4bit", min_size=0)),
  "adamw_bfloat16": lambda: OptaxWrapper(low_precision(optax.adamw(1e-2), "bfloat16", min_size=0)),
  "schedule_free": lambda: OptaxWrapper(optax.contrib.schedule_free_sgd(1e-2, b1=0.9)),
  "schedule_free_b1_0.5": lambda: OptaxWrapper(optax.contrib.schedule_free_sgd(1e-2, b1=0.5)),
}
ANY_MESHES = {8: [(1, 1), (2, 4), (4, 2), (8, 1)], 16: [(4, 4), (2, 8), (16, 1), (1, 16)]}
"""The meshes (data, model) a checkpoint written on 2x4 restores onto, by device count.

A mesh of fewer devices than there are takes the first ones. In two
processes of 4 devices each, the 8-device meshes but the first are global.
"""


@functools.cache
def optimizer_def(name: str) -> Any:
  """One optimizer definition per name, so jit caches are shared."""
  return OPTIMIZERS[name]()


def init_fn(
  embed: int = EMBED, mlp: int = MLP, *, scale: bool = False, dtype: Any = jnp.float32
) -> dict[str, Any]:
  """Model variables with logical axes: a kernel, a bias and a stats collection.

  `scale=True` adds a third param, `dense/scale`; `dtype` is the kernel's.
  """
  kernel = jnp.linspace(-1.0, 1.0, embed * mlp, dtype=dtype).reshape(embed, mlp)
  dense = {
    "kernel": nn.LogicallyPartitioned(kernel, ("embed", "mlp")),
    "bias": nn.LogicallyPartitioned(jnp.full((mlp,), 0.5), ("mlp",)),
  }
  if scale:
    dense["scale"] = nn.LogicallyPartitioned(jnp.ones((embed,)), ("embed",))
  return {"params": {"dense": dense}, "stats": {"calls": jnp.zeros((mlp,), jnp.int32)}}


def partitioner(
  data: int, model: int, *, devices: Sequence[jax.Device] | None = None
) -> Partitioner:
  """A ZeRO-style partitioner (optimizer state also sharded over `data`)."""
  mesh = create_mesh(shape={"data": data, "model": model}, devices=devices)
  return Partitioner(mesh, standard_logical_axis_rules(shard_optimizer_state_over_data=True))


def fresh_state(opt_name: str, part: Partitioner) -> TrainState:
  """The sharded train state at step 0."""
  return init_sharded(part, optimizer_def(opt_name), init_fn)


def abstract_state(opt_name: str, part: Partitioner, **kwargs: Any) -> TrainState:
  """The train state as ShapeDtypeStructs carrying `part`'s shardings."""
  return abstract_train_state(part, optimizer_def(opt_name), functools.partial(init_fn, **kwargs))


def _step(state: TrainState) -> TrainState:
  grads = jax.tree.map(lambda p: jnp.cos(3.0 * p) + 0.1 * state.step, state.params)
  calls = jax.tree.map(lambda c: c + 1, state.flax_mutables)
  return state.apply_gradient(grads, flax_mutables=calls)


@functools.cache
def _jitted_step(treedef: Any, shardings: tuple[Any, ...]) -> Any:
  return jax.jit(_step, out_shardings=jax.tree.unflatten(treedef, shardings))


def train(state: TrainState, steps: int) -> TrainState:
  """`steps` deterministic, elementwise training steps, keeping the shardings."""
  leaves, treedef = jax.tree.flatten(state)
  step = _jitted_step(treedef, tuple(leaf.sharding for leaf in leaves))
  for _ in range(steps):
    state = step(state)
  return state


def local_leaves(state: TrainState) -> list[tuple[str, Any, np.ndarray]]:
  """Each leaf's path, sharding and this process's shards (by device id)."""
  flat = jax.tree.leaves_with_path(state.state_dict())
  return [
    (
      jax.tree_util.keystr(path),
      leaf.sharding,
      {s.device.id: np.asarray(s.data) for s in leaf.addressable_shards},
    )
    for path, leaf in flat
  ]


def assert_same_state(actual: TrainState, expected: TrainState) -> None:
  """Bit-identical values, equal dtypes and equal shardings, leaf by leaf."""
  got, want = local_leaves(actual), local_leaves(expected)
  assert [p for p, _, _ in got] == [p for p, _, _ in want]
  for (path, sharding, shards), (_, want_sharding, want_shards) in zip(got, want):
    assert sharding == want_sharding, (path, sharding, want_sharding)
    assert shards.keys() == want_shards.keys(), path
    for device, data in shards.items():
      assert data.dtype == want_shards[device].dtype, path
      np.testing.assert_array_equal(data, want_shards[device], err_msg=path)


def resume_then_crash(resume_dir: str, crash_dir: str) -> None:
  """Resumes from step 3 in `resume_dir`, trains to 6 and saves; then crashes.

  The crash: step 1 of a small state is saved completely in `crash_dir`,
  then an asynchronous save of a larger state as step 2 is started and the
  process kills itself with SIGKILL before that save can finish.
  """
  part = partitioner(2, 4)
  with Checkpointer(resume_dir) as ckpt:
    state = ckpt.restore(abstract_state("adamw", part), step=RESUME_STEPS)
    ckpt.save(2 * RESUME_STEPS, train(state, RESUME_STEPS))
  ckpt = Checkpointer(crash_dir, async_save=True)
  ckpt.save(1, fresh_state("adamw", part))
  ckpt.wait_until_finished()
  big = init_sharded(part, optimizer_def("adamw"), functools.partial(init_fn, 2048, 2048))
  ckpt.save(2, big)
  os.kill(os.getpid(), signal.SIGKILL)


def multiprocess(in_dir: str, out_dir: str, port: int, process_id: int) -> None:
  """One of two processes: restore `in_dir`, check it, train, save to `out_dir`.

  Also restores `in_dir` params-only into another optimizer's state, and sets a config's
  settings again in a state spread over both processes (`reapply_across_processes`).
  """
  distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
  assert jax.process_count() == 2 and jax.device_count() == 8, jax.devices()
  part = partitioner(2, 4)
  expected = train(fresh_state("adamw", part), MP_STEPS)
  with Checkpointer(in_dir) as ckpt:
    restored = ckpt.restore(abstract_state("adamw", part))
    switched = ckpt.restore(abstract_state("sgd_momentum", part), params_only=True)
  assert_same_state(restored, expected)
  fresh = fresh_state("sgd_momentum", part)
  assert_same_state(
    switched,
    fresh.replace_params(expected.params)
    .replace_step(expected.step)
    .replace_flax_mutables(expected.flax_mutables),
  )
  with Checkpointer(out_dir, async_save=True) as ckpt:
    ckpt.save(MP_STEPS + 1, train(restored, 1))
  reapply_across_processes(part)
  jax.distributed.shutdown()


def reapply_across_processes(part: Partitioner) -> None:
  """`reapply_config` of a schedule-free state on `part`'s mesh over both processes, whose
  ``b1`` is a scalar replicated over them: the same ``b1`` changes nothing, bit for bit;
  another moves the params as it does for the state in this process alone (one device)."""
  saved, spread = _reapplied_b1(part)
  assert not saved.param_states.b1.is_fully_addressable, saved.param_states.b1.sharding
  _, alone = _reapplied_b1(partitioner(1, 1, devices=jax.local_devices()[:1]))
  for (path, leaf), want in zip(
    jax.tree.leaves_with_path(spread), jax.tree.leaves(alone), strict=True
  ):
    for shard in leaf.addressable_shards:
      np.testing.assert_allclose(
        np.asarray(shard.data),
        np.asarray(want)[shard.index],
        rtol=1e-6,
        err_msg=jax.tree_util.keystr(path),
      )


def _reapplied_b1(part: Partitioner) -> tuple[TrainState, Any]:
  """A schedule-free state trained on `part`, and its params after `reapply_config` with
  another ``b1``; checks first that the same ``b1`` changes nothing."""
  saved = train(fresh_state("schedule_free", part), MP_STEPS)
  assert_same_state(saved.replace(_optimizer=reapply_config(saved.optimizer)), saved)
  other = saved.optimizer.replace(optimizer_def=optimizer_def("schedule_free_b1_0.5"))
  moved = reapply_config(other).target
  assert not all(
    np.array_equal(np.asarray(s.data), np.asarray(t.data))
    for a, b in zip(jax.tree.leaves(moved), jax.tree.leaves(saved.params), strict=True)
    for s, t in zip(a.addressable_shards, b.addressable_shards, strict=True)
  ), "another b1 moves the params"
  return saved, moved


def state_arrays(state: TrainState) -> dict[str, np.ndarray]:
  """The state dict's leaves as host arrays, by path (a fully addressable state)."""
  return {
    jax.tree_util.keystr(path): np.asarray(leaf)
    for path, leaf in jax.tree.leaves_with_path(state.state_dict())
  }


def _bits(array: np.ndarray) -> np.ndarray:
  return np.frombuffer(np.ascontiguousarray(array).tobytes(), np.uint8)


def save_expected(path: str, **states: TrainState) -> None:
  """Writes each state's arrays as ``NAME/PATH`` (bytes) and ``NAME.dtype/PATH`` into `path`."""
  arrays = {}
  for name, state in states.items():
    for where, array in state_arrays(state).items():
      arrays[f"{name}/{where}"] = _bits(array).reshape(array.shape + (array.dtype.itemsize,))
      arrays[f"{name}.dtype/{where}"] = np.array(str(array.dtype))
  np.savez(path, **arrays)


def load_expected(path: str, name: str) -> dict[str, tuple[str, np.ndarray]]:
  """``{PATH: (dtype name, bytes)}`` of the state `save_expected` wrote as `name`."""
  with np.load(path) as arrays:
    return {
      key.split("/", 1)[1]: (str(arrays[f"{name}.dtype/" + key.split("/", 1)[1]]), arrays[key])
      for key in arrays.files
      if key.startswith(f"{name}/")
    }


def assert_shards_equal(
  state: TrainState, expected: dict[str, tuple[str, np.ndarray]], what: str
) -> None:
  """Each of this process's shards equals its slice of `expected`, bit for bit."""
  leaves = jax.tree.leaves_with_path(state.state_dict())
  assert sorted(jax.tree_util.keystr(path) for path, _ in leaves) == sorted(expected), what
  for path, leaf in leaves:
    where = jax.tree_util.keystr(path)
    dtype, want = expected[where]
    assert str(leaf.dtype) == dtype, (what, where, leaf.dtype, dtype)
    for shard in leaf.addressable_shards:
      np.testing.assert_array_equal(
        _bits(np.asarray(shard.data)), _bits(want[shard.index]), err_msg=f"{what}: {where}"
      )


def assert_params_close(
  state: TrainState, expected: dict[str, tuple[str, np.ndarray]], what: str
) -> None:
  """This process's shards of the params equal `expected`'s to float32 rounding.

  XLA compiles a step for each mesh apart and may round a product an ulp apart
  (contracted into a fused multiply-add, or not) on one mesh and not another:
  an ulp of the param, or of its update (at most the learning rate, 1e-2) for
  a param near 0.
  """
  for path, leaf in jax.tree.leaves_with_path(state.state_dict()["target"]):
    where = "['target']" + jax.tree_util.keystr(path)
    dtype, want = expected[where]
    for shard in leaf.addressable_shards:
      np.testing.assert_allclose(
        np.asarray(shard.data),
        np.frombuffer(want[shard.index].tobytes(), dtype).reshape(shard.data.shape),
        rtol=1e-6,
        atol=2 * float(np.spacing(np.float32(1e-2))),
        err_msg=f"{what}: {where}",
      )


def any_mesh(opt_name: str, in_dir: str, expected_npz: str, port: int, process_id: int) -> None:
  """Restores `in_dir`'s checkpoint onto every mesh of `ANY_MESHES` and checks it.

  `expected_npz` holds the saved state (``saved``) and the state one step
  later (``after``), as `save_expected` writes them; the restored state must
  equal the saved one bit for bit, and one step of it on the new mesh give
  the params of ``after`` (to float32 rounding). With a `port`, this is one of two
  processes. Prints the meshes checked.
  """
  if port:
    distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
  saved, after = load_expected(expected_npz, "saved"), load_expected(expected_npz, "after")
  count = jax.device_count()
  meshes = ANY_MESHES[count][1:] if port else ANY_MESHES[count]
  for data, model in meshes:
    part = partitioner(data, model, devices=jax.devices()[: data * model])
    with Checkpointer(in_dir) as ckpt:
      restored = ckpt.restore(abstract_state(opt_name, part))
    assert_shards_equal(restored, saved, f"restored on {data}x{model}")
    assert_params_close(train(restored, 1), after, f"a step on {data}x{model}")
    print(f"restored on {data}x{model}", flush=True)
  if port:
    jax.distributed.shutdown()


def small_optimizer() -> Any:
  """An sgd optimizer of one small param, on one device."""
  return optimizer_def("sgd_momentum").create({"w": jnp.arange(8.0)})


def writer(directory: str, markers: str) -> None:
  """One of two writers into `directory`; prints SAVED or REFUSED.

  Each tries to save step 1, then leaves a file in `markers` and waits (up
  to 60 s) until both have, so the two always overlap; the one that saved
  then saves steps 2 and 3. Neither calls `close`: both must still exit.
  """
  state = small_optimizer()
  ckpt = Checkpointer(directory)
  try:
    ckpt.save(1, state)
    outcome = "SAVED"
  except CheckpointError as e:
    outcome = f"REFUSED: {e}"
  Path(markers, str(os.getpid())).touch()
  deadline = time.monotonic() + 60
  while len(os.listdir(markers)) < 2 and time.monotonic() < deadline:
    time.sleep(0.01)
  if outcome == "SAVED":
    ckpt.save(2, state)
    ckpt.save(3, state)
  print(outcome, flush=True)


def peer_killed(port: int, process_id: int, kill_file: str) -> None:
  """One of two processes training forever; process 1 kills itself mid-way.

  Process 1 writes the time into `kill_file` and SIGKILLs itself after
  KILL_AFTER_STEPS steps; process 0 trains on until the distributed
  service stops it.
  """
  distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
  state = fresh_state("adamw", partitioner(2, 4))
  for step in range(sys.maxsize):
    state = jax.block_until_ready(train(state, 1))
    if process_id == 1 and step == KILL_AFTER_STEPS:
      Path(kill_file).write_text(str(time.time()))
      os.kill(os.getpid(), signal.SIGKILL)


def main(argv: Sequence[str]) -> None:
  mode, *args = argv
  if mode == "resume_crash":
    resume_then_crash(*args)
  elif mode == "multiprocess":
    in_dir, out_dir, port, process_id = args
    multiprocess(in_dir, out_dir, int(port), int(process_id))
  elif mode == "any_mesh":
    opt_name, in_dir, expected_npz, port, process_id = args
    any_mesh(opt_name, in_dir, expected_npz, int(port), int(process_id))
  elif mode == "writer":
    writer(*args)
  elif mode == "peer_killed":
    port, process_id, kill_file = args
    peer_killed(int(port), int(process_id), kill_file)
  else:
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
  main(sys.argv[1:])
