"""Every Python block of README.md runs as shown, each in a fresh interpreter.

A line ``print(...)  # text`` in a block states what it prints: the printed
lines must equal those comments, in order.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# Runs the README's commands and examples in fresh processes.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
# The gs:// blocks (README: Cloud storage) run against an emulator in test_cloud_storage.py.
BLOCKS = [
  block
  for block in re.findall(r"^```python\n(.*?)^```", (REPO / "README.md").read_text(), re.M | re.S)
  if "gs://BUCKET" not in block
]
TIMEOUT = 240


def _expected(block: str) -> list[str]:
  """The comments of the block's ``print(...)  # text`` lines."""
  return [m.group(1).strip() for m in re.finditer(r"^print\(.*\)\s+# (.*)$", block, re.M)]


def test_readme_has_python_blocks():
  assert len(BLOCKS) >= 2
  assert all(_expected(block) for block in BLOCKS), "each block states what it prints"


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_python_block_runs_as_shown(index, tmp_path):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
  result = subprocess.run(
    [sys.executable, "-c", BLOCKS[index]],
    cwd=tmp_path,
    env=env,
    capture_output=True,
    text=True,
    timeout=TIMEOUT,
    check=False,
  )
  assert result.returncode == 0, result.stderr
  assert [line.strip() for line in result.stdout.splitlines()] == _expected(BLOCKS[index])
