"""Every Python block of README.md and of the manual (docs/*.md) runs as shown.

Each block runs in a fresh interpreter, so a block may set ``XLA_FLAGS`` before
it imports jax (8 simulated devices). A line ``print(...)  # text`` in a block
states what it prints: the printed lines must equal those comments, in order.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _subprocesses import with_xla_flags

# Runs the README's and the manual's examples in fresh processes.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# The gs:// blocks (docs/cloud-storage.md) run against an emulator in test_cloud_storage.py.
# A block shown in more than one place (README.md and the manual) runs once.
FOUND: dict[str, str] = {}
for document in DOCUMENTS:
  for block in re.findall(r"^```python\n(.*?)^```", document.read_text(), re.M | re.S):
    if "gs://BUCKET" not in block:
      FOUND.setdefault(block, document.relative_to(REPO).as_posix())
SOURCES = [(document, block) for block, document in FOUND.items()]
BLOCKS = [block for _, block in SOURCES]
TIMEOUT = 240


def _expected(block: str) -> list[str]:
  """The comments of the block's ``print(...)  # text`` lines."""
  return [m.group(1).strip() for m in re.finditer(r"^print\(.*\)\s+# (.*)$", block, re.M)]


def test_readme_and_docs_have_python_blocks():
  documents = {document for document, _ in SOURCES}
  assert "README.md" in documents and len(documents) >= 2, documents
  assert all(_expected(block) for block in BLOCKS), "each block states what it prints"


@pytest.mark.parametrize(
  "index", range(len(BLOCKS)), ids=[f"{document}-{i}" for i, (document, _) in enumerate(SOURCES)]
)
def test_python_block_runs_as_shown(index, tmp_path):
  env = with_xla_flags(os.environ)
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
