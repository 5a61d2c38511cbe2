"""How long `import t5x_optim` takes, against its own dependencies, in fresh processes.

Each round starts fresh Python processes, interleaved: one imports jax,
optax, flax and orbax (what `t5x_optim` cannot import without) and one
imports `t5x_optim`; each process times its own import with
`time.perf_counter`. The table gives the best and the median of the rounds
and the difference of the bests, which is what the package adds.

  python benchmarks/import_time.py              # 5 rounds
  python benchmarks/import_time.py --rounds 9
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

CASES = {
  "jax + optax + flax + orbax": "import jax, optax, flax, orbax.checkpoint",
  "t5x_optim": "import t5x_optim",
}

_TIMER = "import time; t = time.perf_counter(); {statement}; print(time.perf_counter() - t)"


def time_import(statement: str) -> float:
  """Seconds one fresh process takes to run `statement` (an import)."""
  out = subprocess.run(
    [sys.executable, "-c", _TIMER.format(statement=statement)],
    check=True,
    capture_output=True,
    text=True,
  )
  return float(out.stdout.split()[-1])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=5)
  args = parser.parse_args()
  times: dict[str, list[float]] = {name: [] for name in CASES}
  for _ in range(args.rounds):
    for name, statement in CASES.items():
      times[name].append(time_import(statement))
  print(f"| import ({args.rounds} fresh processes each) | best (s) | median (s) |")
  print("|---|---|---|")
  for name, values in times.items():
    print(f"| {name} | {min(values):.3f} | {statistics.median(values):.3f} |")
  base, full = (min(times[name]) for name in CASES)
  print(f"| t5x_optim minus its dependencies (best) | {full - base:+.3f} | |")


if __name__ == "__main__":
  main()
