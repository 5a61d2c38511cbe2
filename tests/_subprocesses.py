"""What the tests that start processes share: a free port, waiting for a group of processes, and
the test run's compilation cache.

Light on purpose (no jax): the GCS emulator's script imports it too.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Sequence

RUN_CACHE = "T5X_OPTIM_TESTS_COMPILATION_CACHE"
"""The variable naming the test run's compilation cache (made by the repository's conftest.py)."""

RUN_CACHE_SETTINGS = {
  "jax_persistent_cache_min_compile_time_secs": 0.0,
  "jax_compilation_cache_max_size": 2**36,
}
"""jax's settings for the run's cache: every program kept (no minimum compile time), and a
size limit, so that jax takes a file lock around each entry it reads or writes: processes
started at once (a job of two processes, two test workers) never read an entry another is
writing. Each is also jax's environment variable, in capitals."""


QUICK_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
"""XLA:CPU's earlier fusion emitters, which the repository's conftest.py adds to ``XLA_FLAGS`` for
the whole run where the jaxlib knows the flag: the same memory analysis, and code generated two
to five times faster for the small programs the tests compile."""


def with_xla_flags(env: dict[str, str], *flags: str) -> dict[str, str]:
  """`env` whose ``XLA_FLAGS`` are `flags`, with the run's `QUICK_EMITTERS` where it has them.

  For a process that sets its own flags (another device count, or none as a user's process)
  and still compiles as quickly as the tests' own. Without flags to give, ``XLA_FLAGS`` is
  left out.
  """
  env = {name: value for name, value in env.items() if name != "XLA_FLAGS"}
  if QUICK_EMITTERS in os.environ.get("XLA_FLAGS", "").split():
    flags = (*flags, QUICK_EMITTERS)
  return dict(env, XLA_FLAGS=" ".join(flags)) if flags else env


def with_run_compilation_cache(env: dict[str, str]) -> dict[str, str]:
  """`env` for a `t5x-optim` process that shares jax's compilation cache with the run's others.

  The processes the tests start compile the same few programs over and over (the tiny
  model's train, eval and init steps with the default optimizer); with one cache for the
  whole test run (`RUN_CACHE_SETTINGS`), every process after the first loads them. The
  command defers to jax's own ``JAX_COMPILATION_CACHE_DIR``, so a test of its own cache
  under ``MODEL_DIR`` starts its processes without this.
  """
  settings = {name.upper(): str(value) for name, value in RUN_CACHE_SETTINGS.items()}
  return dict(env, JAX_COMPILATION_CACHE_DIR=os.environ[RUN_CACHE], **settings)


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
