"""Test configuration: 8 simulated CPU devices and XLA's quickest compiling, set before jax is
imported.

Here rather than in tests/ so that it holds for the docstring examples of the
package too, and so that the K-FAC adapter's examples are left out where
kfac-jax cannot be imported (tests/test_kfac.py then skips, saying why).
"""

import atexit
import gc
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA's code generation at its lowest effort, in these processes and the ones they start (jax's
# own switch for programs that cost more to compile than to run): the same optimized HLO and
# memory analysis, about 45% less compiling for a tiny `t5x-optim train`, numbers that may
# differ from the default's in the last bits. `JAX_DISABLE_MOST_OPTIMIZATIONS=0` runs the
# suite as users compile; the `xla_optimized` fixture (tests/conftest.py) does so for one test.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "tests"))
from _optional import kfac_jax_error  # noqa: E402
from _subprocesses import QUICK_EMITTERS, RUN_CACHE  # noqa: E402

# XLA:CPU's earlier fusion emitters (`QUICK_EMITTERS`), in these processes and the ones they
# start: a third less compiling in the low-precision and conversion modules, with the same
# memory analysis (docs/development.md). XLA ends a process at start on a flag it does not
# know, so the run's first process asks a fresh interpreter first; a jaxlib without them runs
# the suite with its own. An ``XLA_FLAGS`` that names the flag is left as it is
# (``--xla_cpu_use_fusion_emitters=true`` runs the suite with XLA's default emitters); the
# `default_emitters` fixture (tests/conftest.py) gives them to one test.
_EMITTERS_ASKED = "T5X_OPTIM_TESTS_EMITTERS_ASKED"
if (
  "xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"] and _EMITTERS_ASKED not in os.environ
):
  os.environ[_EMITTERS_ASKED] = "1"
  try:
    _known = not subprocess.run(
      [sys.executable, "-c", "import jax; jax.devices()"],
      env=dict(os.environ, XLA_FLAGS=f"{os.environ['XLA_FLAGS']} {QUICK_EMITTERS}"),
      capture_output=True,
      check=False,
      timeout=120,
    ).returncode
  except subprocess.TimeoutExpired:
    _known = False
  if _known:
    os.environ["XLA_FLAGS"] += f" {QUICK_EMITTERS}"

# The test run's compilation cache (`_subprocesses.with_run_compilation_cache` and the
# `run_compilation_cache` fixture): made by the first process of the run (xdist's controller),
# whose workers inherit the variable, and deleted when that process exits.
if RUN_CACHE not in os.environ:
  os.environ[RUN_CACHE] = tempfile.mkdtemp(prefix="t5x_optim-tests-compilation-cache-")
  atexit.register(shutil.rmtree, os.environ[RUN_CACHE], ignore_errors=True)

_KFAC_MODULES = ("t5x_optim/_adapters/kfac.py", "t5x_optim/_adapters/kfac_state.py")


def _exit_without_teardown() -> None:
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(0)


def pytest_configure(config):
  """An xdist worker leaves at once when its work is done, without the interpreter's teardown.

  The controller has every result by then (xdist ends a worker only after
  its last report), reads no worker's exit status, and waits for the workers
  to exit: freeing a worker's thousands of compiled programs (jax's clean-up
  at exit, then the interpreter's) kept the quick loop waiting 3 to 4 s after
  its last test, 2.5 s of which this saves. The handler is registered after
  jax is imported, so it runs before jax's clean-up and every other exit
  handler registered before it, and skips them.
  """
  if hasattr(config, "workerinput"):  # xdist's own test for a worker process
    import jax  # noqa: F401, PLC0415 - its exit handlers first, skipped by the one below

    atexit.register(_exit_without_teardown)


def pytest_ignore_collect(collection_path, config):
  """Leaves out the K-FAC modules' examples where kfac-jax cannot be imported.

  Asked only when collection reaches them, so that a process that collects
  nothing (xdist's controller) does not import kfac-jax.
  """
  del config
  if collection_path.as_posix().endswith(_KFAC_MODULES) and kfac_jax_error():
    return True
  return None


def _mappings() -> int:
  """How many memory regions this process has mapped (the lines of /proc/self/maps); 0 where
  there is no /proc."""
  try:
    with open("/proc/self/maps", "rb") as maps:
      return maps.read().count(b"\n")
  except OSError:
    return 0


def _mappings_allowed() -> int:
  """The kernel's limit on a process's mappings (``vm.max_map_count``), 65,530 if unknown."""
  try:
    with open("/proc/sys/vm/max_map_count") as limit:
      return int(limit.read())
  except (OSError, ValueError):
    return 65530


def _drop_compiled_programs() -> None:
  import jax  # noqa: PLC0415 - after the device count is set above

  jax.clear_caches()
  gc.collect()


@pytest.fixture(autouse=True, scope="module")
def _compiled_programs_dropped_after_a_module_that_leaves_many():
  """Drops jax's compiled programs when a test module (or a module's examples) is done and
  the process holds more than a quarter of the mappings the kernel allows.

  XLA:CPU maps the code of each program it compiles or loads into regions of
  its own, a few for each program, and keeps them while jax's caches
  hold the program. A pytest worker that kept every module's programs reached
  the kernel's limit on a process's mappings (``vm.max_map_count``, 65,530)
  within the first quarter of the suite: the next compile crashed it, with a
  segmentation fault inside XLA, or with a failed allocation that ended its
  link to pytest-xdist's controller (which then interrupts and exits the
  worker). A module's programs are of no use to the next module, which
  builds its own functions. Dropping them takes most of a second (a full
  garbage collection of the worker), so it waits until they are many.
  """
  yield
  if _mappings() > _mappings_allowed() // 4:
    _drop_compiled_programs()


_MAPPINGS_CHECKED_EVERY_S = 1.0
"""How often the mappings are counted between tests: reading ``/proc/self/maps`` takes
about 30 ms at 20,000 mappings, more than most tests, and a second of compiling adds a few
hundred mappings, far from the limit's other half."""

_last_mappings_check = 0.0


@pytest.fixture(autouse=True)
def _compiled_programs_dropped_before_the_mappings_run_out():
  """Drops jax's compiled programs after a test that leaves the process with more than half
  the mappings the kernel allows, counted at most once every `_MAPPINGS_CHECKED_EVERY_S`: a
  module of many large programs could reach the limit alone
  (`_compiled_programs_dropped_after_a_module_that_leaves_many`)."""
  global _last_mappings_check
  yield
  if time.monotonic() - _last_mappings_check < _MAPPINGS_CHECKED_EVERY_S:
    return
  _last_mappings_check = time.monotonic()
  if _mappings() > _mappings_allowed() // 2:
    _drop_compiled_programs()
