"""Whether T5X itself is at hand: a T5X git directory (T5X_SRC) and T5X's dependencies.

Tests that run T5X's own code in a fresh process (its train.py, its legacy Adafactor)
need both; CI has neither and skips them.
"""

from __future__ import annotations

import importlib.util
import os


def t5x_at_hand() -> bool:
  src = os.environ.get("T5X_SRC", "")
  return os.path.isdir(src) and all(
    importlib.util.find_spec(name) for name in ("tensorflow", "seqio", "clu")
  )


def run_t5x_check(script: os.PathLike) -> str:
  """Runs one of ``tests/data``'s checks with T5X's own code in a fresh process; its output,
  once it has ended in ``OK``."""
  import subprocess
  import sys

  proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), (
    proc.stdout[-3000:] + proc.stderr[-3000:]
  )
  return proc.stdout
