"""Benchmark: checkpoint save and restore on ``gs://`` (a local GCS emulator) against local disk.

An adamw optimizer after one step (params, ``mu`` and ``nu``: three copies of
``--layers`` random 1024x1024 float32 matrices, 4.2 MB each) is saved and
restored, in one run, into a local temporary directory and into a bucket of
`gcp-storage-emulator` on 127.0.0.1 (tests/_gcs_emulator.py, the emulator
the tests use), by

* `Checkpointer` (orbax, checksums and the writer lock or lease included;
  synchronous saves, so the time is the whole write), and
* `save_t5x_checkpoint` / `restore_t5x_checkpoint` (T5X's legacy format).

Each case runs ``--rounds`` times into a fresh directory, after one warm-up
round that is not counted; the table gives the median seconds, MB/s (1e6
bytes of arrays) and the emulator's MB/s over local disk's. The emulator is a
Python server answering one request at a time, so its numbers measure this
package's request pattern on top of that server, not GCS: they are there to
show a regression.

Run: ``python benchmarks/cloud_storage.py [--layers 4] [--rounds 5]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from _gcs_emulator import Emulator  # noqa: E402 - before gcsfs loads: it configures it

from t5x_optim import optimizers, restore_t5x_checkpoint, save_t5x_checkpoint  # noqa: E402
from t5x_optim.checkpoints import Checkpointer  # noqa: E402

DIM = 1024


def _state(layers: int):
  rng = np.random.default_rng(0)
  params = {f"w{i}": rng.standard_normal((DIM, DIM), np.float32) for i in range(layers)}
  opt = optimizers.adamw(1e-3).create(jax.tree.map(jax.numpy.asarray, params))
  return opt.apply_gradient(jax.tree.map(jax.numpy.ones_like, opt.target))


def _nbytes(state) -> int:
  return sum(np.asarray(x).nbytes for x in jax.tree.leaves(state.state_dict()) if np.ndim(x))


def _median_seconds(run: Callable[[str], None], root: str, rounds: int) -> float:
  times = []
  for i in range(rounds + 1):
    where = f"{root}/{uuid.uuid4().hex[:8]}"
    start = time.perf_counter()
    run(where)
    if i:  # The first round warms up.
      times.append(time.perf_counter() - start)
  return statistics.median(times)


def _cases(state) -> dict[str, Callable[[str], None]]:
  def checkpointer_save(where: str) -> None:
    with Checkpointer(where, async_save=False) as ckpt:
      ckpt.save(1, state)

  def checkpointer_restore(where: str) -> None:
    checkpointer_save(where)
    start = time.perf_counter()
    with Checkpointer(where) as ckpt:
      jax.block_until_ready(ckpt.restore(state))
    _restore_times.append(time.perf_counter() - start)

  def t5x_save(where: str) -> None:
    save_t5x_checkpoint(where, state, step=1)

  def t5x_restore(where: str) -> None:
    t5x_save(where)
    start = time.perf_counter()
    jax.block_until_ready(restore_t5x_checkpoint(where, state))
    _restore_times.append(time.perf_counter() - start)

  return {
    "Checkpointer save": checkpointer_save,
    "Checkpointer restore": checkpointer_restore,
    "T5X legacy save": t5x_save,
    "T5X legacy restore": t5x_restore,
  }


_restore_times: list[float] = []


def _time(case: str, run: Callable[[str], None], root: str, rounds: int) -> float:
  """Median seconds of `case`; a restore case counts its restore only (it saves first)."""
  if "restore" not in case:
    return _median_seconds(run, root, rounds)
  _restore_times.clear()
  _median_seconds(run, root, rounds)
  return statistics.median(_restore_times[1:])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--rounds", type=int, default=5)
  args = parser.parse_args()
  state = _state(args.layers)
  megabytes = _nbytes(state) / 1e6
  print(f"adamw state: {megabytes:.1f} MB of arrays ({args.layers} x {DIM}x{DIM} float32, x3)")
  with Emulator() as emulator, tempfile.TemporaryDirectory() as local:
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    emulator.create_bucket(bucket)
    print(
      f"{'case':<22} {'local s':>8} {'local MB/s':>11} {'gs:// s':>8} {'gs:// MB/s':>11} {'ratio':>6}"
    )
    for case, run in _cases(state).items():
      on_disk = _time(case, run, local, args.rounds)
      on_gcs = _time(case, run, f"gs://{bucket}", args.rounds)
      print(
        f"{case:<22} {on_disk:>8.3f} {megabytes / on_disk:>11.1f} {on_gcs:>8.3f} "
        f"{megabytes / on_gcs:>11.1f} {on_disk / on_gcs:>6.3f}"
      )


if __name__ == "__main__":
  main()
