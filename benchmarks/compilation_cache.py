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

Run: ``python benchmarks/compilation_cache.py [--parts b c] [--modes ...]``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
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


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--parts", nargs="+", default=["b", "c"], choices=["b", "c"])
  parser.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
  parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
  parser.add_argument("--part", choices=["b", "c"], help=argparse.SUPPRESS)
  parser.add_argument("--cache", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    _child(args.child, args.part, args.cache)
    return
  for part in args.parts:
    scanned = ", layers scanned" if part == "c" else ""
    print(f"\n({part}) whole train step{scanned}: lower + compile (or load), s, in a fresh process")
    print(f"{'mode':<10}{'first start':>13}{'restart':>10}")
    print(f"{'':<10}{'(compiles)':>13}{'(loads)':>10}{'vs f32 first':>15}")
    base = None
    for mode in args.modes:
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
