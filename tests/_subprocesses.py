"""What the tests that start processes share: a free port, and waiting for a group of processes.

Light on purpose (no jax): the GCS emulator's script imports it too.
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Sequence


def free_port() -> int:
  """A TCP port on 127.0.0.1 that nothing listens on now."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def communicate_all(
  procs: Sequence[subprocess.Popen], timeout_s: float
) -> list[tuple[int, str, str]]:
  """``(returncode, stdout, stderr)`` of each process, all under one deadline.

  When the deadline passes, every process is killed, and the output of the
  one that was waited on begins with ``timed out after N s`` (its stderr, or
  its stdout when stderr goes there; stderr is then ``""``).
  """
  deadline = time.monotonic() + timeout_s
  results = []
  for proc in procs:
    try:
      out, err = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
      for p in procs:
        p.kill()
      out, err = proc.communicate()
      note = f"timed out after {timeout_s} s\n"
      if err is None:
        out = note + out
      else:
        err = note + err
    results.append((proc.returncode, out, err or ""))
  return results
