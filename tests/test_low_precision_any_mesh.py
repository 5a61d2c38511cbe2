"""Low-precision checkpoints restore onto any mesh, device count and process count.

A state trained and saved on a 2x4 ZeRO mesh is restored onto 1, 2x4, 4x2
and 8x1 devices here, onto 4x4, 2x8, 16x1 and 1x16 in a process of 16
devices, and onto 2x4 and 4x2 across two processes of 4 devices: bit for bit,
and one more step on each mesh gives the params of a step on the mesh it was saved on (to
float32 rounding: XLA compiles each mesh's step apart).
The blocks of the 8-bit codec are fixed by the param's shape and the
optimizer's settings, never by the mesh, so no target mesh is refused.
"""

from __future__ import annotations

import sys

import _checkpoint_worker as w
import pytest
from _subprocesses import free_port

from t5x_optim.checkpoints import Checkpointer

MODES = ["adamw_8bit", "adamw_4bit", "adamw_bfloat16"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory, opt_name):
  """A directory holding a checkpoint of 2 steps of `opt_name` trained on 2x4, and a file of
  the expected arrays (saved, and one step later); made once per optimizer (the tests'
  ``opt_name`` is module-scoped), since the tests only read them."""
  root = tmp_path_factory.mktemp(opt_name)
  part = w.partitioner(2, 4)
  state = w.train(w.fresh_state(opt_name, part), 2)
  with Checkpointer(root / "ckpt") as ckpt:
    ckpt.save(2, state)
  w.save_expected(str(root / "expected.npz"), saved=state, after=w.train(state, 1))
  return root / "ckpt", root / "expected.npz"


@pytest.mark.slow
@pytest.mark.parametrize("opt_name", MODES, scope="module")
def test_restores_onto_every_mesh_of_8_devices(saved, opt_name):
  directory, expected = saved
  w.any_mesh(opt_name, str(directory), str(expected), 0, 0)


@pytest.mark.slow
@pytest.mark.parametrize("opt_name", MODES, scope="module")
def test_restores_onto_16_devices(saved, opt_name):
  directory, expected = saved
  [(returncode, output)] = w.run_workers(
    [["any_mesh", opt_name, str(directory), str(expected), "0", "0"]], devices=16
  )
  assert returncode == 0, output
  assert [line for line in output.splitlines() if line.startswith("restored")] == [
    f"restored on {d}x{m}" for d, m in w.ANY_MESHES[16]
  ]


@pytest.mark.slow
@pytest.mark.skipif(
  sys.platform == "win32",
  reason="jax.distributed CPU collectives (gloo) are not available on Windows",
)
@pytest.mark.parametrize("opt_name", MODES, scope="module")
def test_restores_in_two_processes(saved, opt_name):
  directory, expected = saved
  port = free_port()
  results = w.run_workers(
    [["any_mesh", opt_name, str(directory), str(expected), str(port), str(i)] for i in range(2)],
    devices=4,
  )
  for process_id, (returncode, output) in enumerate(results):
    assert returncode == 0, f"process {process_id}:\n{output}"
    assert "restored on 4x2" in output, output
