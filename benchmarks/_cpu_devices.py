"""Import first: 8 simulated CPU devices, unless another platform is asked for.

The benchmarks that shard over a mesh import this module before jax, so that
``XLA_FLAGS`` and ``JAX_PLATFORMS`` are set when jax reads them. Set
``JAX_PLATFORMS`` yourself to run them on an accelerator.
"""

import os

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
