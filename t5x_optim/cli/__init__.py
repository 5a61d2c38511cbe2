"""The `t5x-optim` command line and what its gin configs configure.

``t5x-optim train`` trains a tiny transformer LM on a synthetic task, or
on local text as a byte-level LM (``--data``);
``t5x-optim plan`` prints how the optimizer state will shard. Gin configs
reach the job through ``from t5x_optim import cli``. Gin files are code
(parsing one imports modules and calls functions): trust them like code.

Example:
  >>> from t5x_optim import cli
  >>> cli.TrainJob.__name__, cli.TransformerConfig().num_layers
  ('TrainJob', 2)
"""

from t5x_optim.cli._main import console_main, main
from t5x_optim.cli.demo.model import SyntheticTask, TransformerConfig, TransformerLM
from t5x_optim.cli.demo.text import TextTask
from t5x_optim.cli.loop.config import DEFAULT_CONFIG, GIN_DIR, TrainJob, mesh_devices

__all__ = [
  "DEFAULT_CONFIG",
  "GIN_DIR",
  "SyntheticTask",
  "TextTask",
  "TrainJob",
  "TransformerConfig",
  "TransformerLM",
  "console_main",
  "main",
  "mesh_devices",
]
