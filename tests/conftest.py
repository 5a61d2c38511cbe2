"""Test configuration (the simulated devices are set in the repository's conftest.py)."""

import gin
import pytest


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
  doctests = {item.name for item in items if isinstance(item, pytest.DoctestItem)}
  modules = doctests | {name.rsplit(".", 1)[0] for name in doctests}
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
