"""What a restart pays to compile the train step, without and with `t5x-optim train`'s compilation cache.

For each mode of `low_precision_peak` (float32, bf16+SR, 8-bit, 4-bit),
two fresh processes each lower (trace) and compile the whole train step of
its part (b) (the 115.5M-param decoder-only LM at T5.1.1-base widths,
unscanned) or (c) (the same with its layers scanned), with jax's persistent
compilation cache in a new directory, as ``t5x-optim train`` keeps it in
``MODEL_DIR/compilation_cache``: the first process compiles and writes the
entry (a job's first start), the second loads it (every restart). Each
process compiles a trivial program first, which absorbs the backend's
start-up. The time is ``jax.jit(step).lower(...)`` and ``.compile()``: lowering
runs in both processes; the second loads XLA's compiled program instead of
compiling it.

Part (d) times what a start spends checking the cache for entries cut short
(`remove_damaged`) in a directory of ``--entries`` entries of about
``--entry_mb`` MB (zlib, as jax writes them): the first start reads and
decompresses every entry, as every start would without the record of intact
entries; a later start reads only the record and each entry's size. On local
disk and on ``gs://`` (the tests' GCS emulator, a Python server: its numbers
show the request pattern, not GCS's speed).

Run: ``python benchmarks/compilation_cache.py [--parts b c d] [--modes ...]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

MODES = ["float32", "bf16+SR", "8-bit", "4-bit"]


def _child(mode: str, part: str, cache: str) -> None:
  import jax  # noqa: PLC0415 - the parent imports no jax
  import jax.numpy as jnp  # noqa: PLC0415
  from low_precision_peak import MODES as MAKERS  # noqa: PLC0415
  from low_precision_peak import train_step  # noqa: PLC0415

  from t5x_optim.cli.loop.compilation_cache import compilation_cache  # noqa: PLC0415

  jax.jit(lambda x: x + 1).lower(jnp.zeros(8)).compile()
  with compilation_cache(Path(cache)) as use:
    out = train_step(MAKERS[mode], scanned=part == "c")
  print(json.dumps({"seconds": out["compile"], "peak": out["peak"], "loaded": use.loaded}))


def _run(mode: str, part: str, cache: str) -> dict[str, float]:
  command = [sys.executable, __file__, "--child", mode, "--part", part, "--cache", cache]
  done = subprocess.run(command, capture_output=True, text=True, check=True)
  return json.loads(done.stdout.strip().splitlines()[-1])


def _check_on_start(entries: int, entry_mb: int) -> None:
  sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
  from _gcs_emulator import Emulator  # noqa: PLC0415 - before gcsfs loads: it configures it
  from etils import epath  # noqa: PLC0415

  from t5x_optim.cli.loop.compilation_cache import remove_damaged  # noqa: PLC0415

  size = entry_mb << 20
  # Random bytes, then as many zeros: about entry_mb MB compressed, twice that decompressed.
  entry = zlib.compress(os.urandom(size) + bytes(size), 1)
  print(
    f"\n(d) a start's check for entries cut short: {entries} entries of {len(entry) / 1e6:.0f} MB"
  )
  print(f"{'':<36}{'local disk':>12}{'gs:// (emulator)':>18}")
  seconds: dict[str, list[float]] = {}
  with Emulator() as emulator, tempfile.TemporaryDirectory() as local:
    emulator.create_bucket("bench")
    for where in (epath.Path(local), epath.Path("gs://bench/compilation_cache")):
      where.mkdir(parents=True, exist_ok=True)
      for i in range(entries):
        (where / f"jit_step-{i}-cache").write_bytes(entry)
      for start in ("first start (reads every entry)", "next start (the record and sizes)"):
        begin = time.perf_counter()
        assert remove_damaged(where) == 0
        seconds.setdefault(start, []).append(time.perf_counter() - begin)
  for start, (on_disk, on_gcs) in seconds.items():
    print(f"{start:<36}{on_disk:>10.3f} s{on_gcs:>16.3f} s")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--parts", nargs="+", default=["b", "c", "d"], choices=["b", "c", "d"])
  parser.add_argument("--entries", type=int, default=10)
  parser.add_argument("--entry_mb", type=int, default=50)
  parser.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
  parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
  parser.add_argument("--part", choices=["b", "c"], help=argparse.SUPPRESS)
  parser.add_argument("--cache", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    _child(args.child, args.part, args.cache)
    return
  for part in args.parts:
    if part == "d":
      _check_on_start(args.entries, args.entry_mb)
      continue
    scanned = ", layers scanned" if part == "c" else ""
    print(f"\n({part}) whole train step{scanned}: lower + compile (or load), s, in a fresh process")
    print(f"{'mode':<10}{'first start':>13}{'restart':>10}")
    print(f"{'':<10}{'(compiles)':>13}{'(loads)':>10}{'vs f32 first':>15}")
    base = None
    # The ratio is against float32's first start in the same run: it is always measured, first.
    for mode in dict.fromkeys(["float32", *args.modes]):
      with tempfile.TemporaryDirectory() as cache:
        cold = _run(mode, part, str(Path(cache) / "compilation_cache"))
        warm = _run(mode, part, str(Path(cache) / "compilation_cache"))
      assert (cold["loaded"], warm["loaded"]) == (0, 1) and warm["peak"] == cold["peak"], (
        cold,
        warm,
      )
      base = cold["seconds"] if mode == "float32" else base
      ratio = f"{warm['seconds'] / base:>15.2f}" if base else ""
      print(f"{mode:<10}{cold['seconds']:>13.1f}{warm['seconds']:>10.1f}{ratio}")


if __name__ == "__main__":
  main()
