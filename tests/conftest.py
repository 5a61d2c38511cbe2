"""Test configuration (the simulated devices are set in the repository's conftest.py)."""

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gin
import jax
import pytest
from _subprocesses import QUICK_EMITTERS, RUN_CACHE, RUN_CACHE_SETTINGS
from jax._src import compiler


@pytest.fixture
def clean_gin():
  """Clears gin's global config before and after a test that parses gin."""
  gin.clear_config()
  yield
  gin.clear_config()


# Docstring examples that take seconds (they compile 8-bit codecs, or build and
# train the CLI's model): left out of the quick loop (`-m "not slow"`), as a slow
# test is. The modules they document keep fast tests, and CI runs these too.
SLOW_DOCTESTS = {
  "t5x_optim._checkpoint.converting.restore_converted",
  "t5x_optim._convert.convert.convert_state",
  "t5x_optim._layouts.fused.kernel",
  "t5x_optim._adapters.kfac.KfacOptimizerDef",
  "t5x_optim._low_precision.low_precision",
  "t5x_optim._low_precision.low_precision.float32_to_low_precision",
  "t5x_optim._low_precision.low_precision.leaf_storage",
  "t5x_optim._low_precision.low_precision.low_precision_to_float32",
  "t5x_optim._low_precision.quantize.quantize",
  "t5x_optim._low_precision.quantize4.quantize4",
  "t5x_optim._layouts.stacked",
  "t5x_optim.cli.demo.model",
  "t5x_optim.cli.demo.model.TransformerLM",
  "t5x_optim.cli.loop.train",
}


def pytest_collection_modifyitems(config, items):
  del config
  doctest_items = [item for item in items if isinstance(item, pytest.DoctestItem)]
  doctests = {item.name for item in doctest_items}
  # The modules whose examples were collected (a module's own is named as the module).
  modules = {item.dtest.globs["__name__"] for item in doctest_items}
  stale = sorted(
    name
    for name in SLOW_DOCTESTS - doctests
    if name in modules or name.rsplit(".", 1)[0] in modules
  )
  if stale:
    raise pytest.UsageError(f"SLOW_DOCTESTS names doctests that no longer exist: {stale}")
  for item in items:
    if isinstance(item, pytest.DoctestItem) and item.name in SLOW_DOCTESTS:
      item.add_marker(pytest.mark.slow)


@contextlib.contextmanager
def _jax_settings(settings: dict[str, object]) -> Iterator[None]:
  """jax's config with `settings` inside, its previous values restored after."""
  previous = {name: jax.config.values[name] for name in settings}
  for name, value in settings.items():
    jax.config.update(name, value)
  try:
    yield
  finally:
    for name, value in previous.items():
      jax.config.update(name, value)


def _with_default_emitters(get_compile_options: Callable[..., Any]) -> Callable[..., Any]:
  """jax's `get_compile_options`, with XLA's default fusion emitters in every compile."""

  def compile_options(*args: Any, env_options_overrides=None, **kwargs: Any) -> Any:
    overrides = {"xla_cpu_use_fusion_emitters": True, **(env_options_overrides or {})}
    return get_compile_options(*args, env_options_overrides=overrides, **kwargs)

  return compile_options


@pytest.fixture
def default_emitters(monkeypatch):
  """XLA's default fusion emitters for a test, in its process and the processes it starts.

  The suite compiles with XLA:CPU's earlier emitters (`_subprocesses.QUICK_EMITTERS`, set for
  the run by the repository's conftest.py), whose code may round the last bit otherwise: a
  test that compares two different programs bit for bit, as the documentation promises they
  agree, checks that with the emitters users run. The flag is process-wide, so it is left out
  of the processes the test starts and overridden in each compile of its own; jax's
  in-memory caches do not tell programs of the two emitters apart, so they are emptied
  before and after.
  """
  flags = os.environ.get("XLA_FLAGS", "").split()
  if QUICK_EMITTERS not in flags:
    yield
    return
  with monkeypatch.context() as patch:
    patch.setenv("XLA_FLAGS", " ".join(flag for flag in flags if flag != QUICK_EMITTERS))
    patch.setattr(
      compiler, "get_compile_options", _with_default_emitters(compiler.get_compile_options)
    )
    jax.clear_caches()
    yield
  jax.clear_caches()


@pytest.fixture
def xla_optimized(monkeypatch, default_emitters):
  """XLA's default optimizations for a test, in its process and the processes it starts.

  The suite compiles with jax's ``jax_disable_most_optimizations`` (the repository's
  conftest.py): XLA optimizes the same HLO but generates its code with the least effort,
  and the numbers may differ from the default's in the last bits. A test that compares two
  different programs bit for bit, as the documentation promises they agree, checks that with
  the code users run (XLA's default emitters included, `default_emitters`), and computes both
  sides itself. jax's in-memory caches do not tell programs of the two settings apart, so
  they are emptied before and after.
  """
  del default_emitters
  monkeypatch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "0")
  jax.clear_caches()
  with _jax_settings({"jax_disable_most_optimizations": False}):
    yield
  jax.clear_caches()


@pytest.fixture(scope="session")
def _compilation_cache_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("compilation_cache")


@pytest.fixture(scope="module")
def shared_compilation_cache(_compilation_cache_dir):
  """jax's persistent compilation cache for a module's tests: one directory per test process.

  The table tests compile the same programs over and over, since each test builds its
  own functions; jax loads them from the cache instead: the same executables, without the
  compiling. The cache is `t5x-optim train`'s own, every program kept. A module that runs
  `t5x-optim` in this process must not use it (the command would take it for the user's
  cache).
  """
  from t5x_optim.cli.loop.compilation_cache import compilation_cache  # noqa: PLC0415

  with (
    _jax_settings({"jax_persistent_cache_min_compile_time_secs": 0.0}),
    compilation_cache(_compilation_cache_dir, primary=False),
  ):
    yield


@pytest.fixture(scope="module")
def run_compilation_cache():
  """The test run's compilation cache for the `t5x-optim` runs a module makes in this process.

  What `_subprocesses.with_run_compilation_cache` gives the processes the tests start: one
  directory for the whole run, every program kept, jax's file lock around each read and
  write. The command defers to a cache set in jax's config, so that its runs here load the
  programs any earlier run compiled. Not for a module that tests the command's own cache.
  """
  from t5x_optim.cli.loop.compilation_cache import compilation_cache  # noqa: PLC0415

  with (
    _jax_settings(RUN_CACHE_SETTINGS),
    compilation_cache(Path(os.environ[RUN_CACHE]), primary=False),
  ):
    yield
