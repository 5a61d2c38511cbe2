"""Test configuration: 8 simulated CPU devices, set before jax is imported."""

import os

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


import gin  # noqa: E402  (after the XLA flags above; gin does not import jax)
import pytest  # noqa: E402


@pytest.fixture
def clean_gin():
  """Clears gin's global config before and after a test that parses gin."""
  gin.clear_config()
  yield
  gin.clear_config()
