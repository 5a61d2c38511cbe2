"""Test configuration: 8 simulated CPU devices, set before jax is imported.

Here rather than in tests/ so that it holds for the docstring examples of the
package too, and so that the K-FAC adapter's examples are left out where
kfac-jax cannot be imported (tests/test_kfac.py then skips, saying why).
"""

import os
import sys

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "tests"))
from _optional import kfac_jax_error  # noqa: E402  (after the flags: it imports jax)

collect_ignore = (
  ["t5x_optim/_adapters/kfac.py", "t5x_optim/_adapters/kfac_state.py"] if kfac_jax_error() else []
)
