"""The gin-configured train job: the embedded default config and `TrainJob`.

Everything a gin file needs is reached through dynamic registration: optax
(``import optax``), this package's optimizers and partitioning
(``from t5x_optim import optimizers, partitioning``) and the job itself
(``from t5x_optim import cli``: `TrainJob`, `TransformerConfig`,
`SyntheticTask`). The default config is always parsed
first, then the ``--gin_file``s, then the ``--gin_bindings``, so a file or a
binding overrides only what it names. Bindings may name anything those
imports reach (``optax.adam.b1 = 0.95``) without importing it themselves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import gin
import optax

from t5x_optim._model import SyntheticTask, TransformerConfig
from t5x_optim._optimizer import OptimizerDef
from t5x_optim.partitioning import Partitioner

__all__ = [
    "BINDING_IMPORTS",
    "DEFAULT_CONFIG",
    "TrainJob",
    "build_job",
    "default_search_paths",
    "parse_config",
    "resolve_gin_file",
]

BINDING_IMPORTS = """
from __gin__ import dynamic_registration
import optax
from t5x_optim import cli
from t5x_optim import optimizers
from t5x_optim import partitioning
"""
"""Imports in effect for ``--gin_bindings``, so a binding may name any of them."""

DEFAULT_CONFIG = BINDING_IMPORTS + """
VOCAB_SIZE = 32
TOTAL_STEPS = 300

OPTIMIZER = @optimizers.chain()
optimizers.chain.transformations = [@optax.clip_by_global_norm(), @optax.adamw()]
optax.clip_by_global_norm.max_norm = 1.0
optax.adamw:
  learning_rate = @optax.warmup_cosine_decay_schedule()
  weight_decay = 1e-4
optax.warmup_cosine_decay_schedule:
  init_value = 0.0
  peak_value = 1e-2
  warmup_steps = 20
  decay_steps = %TOTAL_STEPS

PARTITIONER = @partitioning.Partitioner()
partitioning.Partitioner:
  mesh = @partitioning.create_mesh()
  logical_axis_rules = @partitioning.standard_logical_axis_rules()
partitioning.create_mesh.num_partitions = 2

cli.TrainJob:
  optimizer = %OPTIMIZER
  partitioner = %PARTITIONER
  model = @cli.TransformerConfig()
  task = @cli.SyntheticTask()
  total_steps = %TOTAL_STEPS
  checkpoint_every = 100
  keep_checkpoints = 3
  log_every = 10
  seed = 0
cli.TransformerConfig.vocab_size = %VOCAB_SIZE
cli.SyntheticTask.vocab_size = %VOCAB_SIZE
"""
"""The config `t5x-optim train` and `t5x-optim plan` start from."""

_GIN_PROBE_MESSAGE = "Path not found"


def _check_int(owner: str, name: str, value: Any, *, minimum: int) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    raise ValueError(
        f"{owner}.{name} must be an int >= {minimum}, got {value!r} ({type(value).__name__})."
    )


def _check_type(owner: str, name: str, value: Any, expected: type, hint: str) -> None:
  if not isinstance(value, expected):
    raise TypeError(
        f"{owner}.{name} must be a {expected.__name__}, got {value!r} "
        f"({type(value).__name__}). {hint}"
    )


@dataclasses.dataclass(frozen=True)
class TrainJob:
  """What `t5x-optim train` runs; every field is set through gin.

  Attributes:
    optimizer: the optimizer definition (``%OPTIMIZER``).
    partitioner: mesh and logical axis rules (``%PARTITIONER``).
    model: sizes of the transformer LM.
    task: the synthetic task (its batch size is global).
    total_steps: train until the step counter reaches this.
    checkpoint_every: save a checkpoint every this many steps (and at the end).
    keep_checkpoints: keep this many newest checkpoints.
    log_every: print progress every this many steps when not on a terminal.
    seed: the PRNG seed of the model's initialisation.

  Raises:
    TypeError: a field of the wrong type (e.g. an optax transformation
      instead of an `OptimizerDef`), naming the field.
    ValueError: an out-of-range field, or model and task that do not fit
      each other or the mesh.

  Example:
    >>> import jax
    >>> from t5x_optim import optimizers, partitioning
    >>> mesh = partitioning.create_mesh(devices=jax.devices()[:1])
    >>> job = TrainJob(optimizers.sgd(0.1), partitioning.Partitioner(mesh), total_steps=5)
    >>> job.total_steps
    5
  """

  optimizer: OptimizerDef
  partitioner: Partitioner
  model: TransformerConfig = TransformerConfig()
  task: SyntheticTask = SyntheticTask()
  total_steps: int = 300
  checkpoint_every: int = 100
  keep_checkpoints: int = 3
  log_every: int = 10
  seed: int = 0

  def __post_init__(self):
    owner = type(self).__name__
    if isinstance(self.optimizer, optax.GradientTransformation):
      raise TypeError(
          f"{owner}.optimizer is an optax GradientTransformation, not an OptimizerDef: use "
          "the wrapped factory of t5x_optim.optimizers (e.g. @optimizers.adamw()) or "
          "@optimizers.OptaxWrapper()."
      )
    _check_type(owner, "optimizer", self.optimizer, OptimizerDef,
                "Set OPTIMIZER to an optimizer from t5x_optim.optimizers.")
    _check_type(owner, "partitioner", self.partitioner, Partitioner,
                "Set PARTITIONER to @partitioning.Partitioner().")
    _check_type(owner, "model", self.model, TransformerConfig, "Use @cli.TransformerConfig().")
    _check_type(owner, "task", self.task, SyntheticTask, "Use @cli.SyntheticTask().")
    for name in ("total_steps", "checkpoint_every", "keep_checkpoints", "log_every"):
      _check_int(owner, name, getattr(self, name), minimum=1)
    _check_int(owner, "seed", self.seed, minimum=0)
    if self.model.vocab_size != self.task.vocab_size:
      raise ValueError(
          f"TransformerConfig.vocab_size={self.model.vocab_size} differs from "
          f"SyntheticTask.vocab_size={self.task.vocab_size}; bind both (VOCAB_SIZE)."
      )
    if self.task.length > self.model.max_length:
      raise ValueError(
          f"SyntheticTask.length={self.task.length} exceeds "
          f"TransformerConfig.max_length={self.model.max_length}."
      )
    data = dict(self.partitioner.mesh.shape).get("data", 1)
    if self.task.batch_size % data:
      raise ValueError(
          f"SyntheticTask.batch_size={self.task.batch_size} is not divisible by the "
          f"mesh's data axis ({data} devices)."
      )


def default_search_paths() -> list[Path]:
  """The repository's ``gin/`` directory (when this package runs from a checkout).

  Example:
    >>> all(path.name == 'gin' for path in default_search_paths())
    True
  """
  repo_gin = Path(__file__).resolve().parents[2] / "gin"
  return [repo_gin] if repo_gin.is_dir() else []


def parse_config(
    *,
    gin_files: Sequence[str] = (),
    gin_bindings: Sequence[str] = (),
    search_paths: Sequence[str | Path] = (),
) -> None:
  """Parses the default config, then `gin_files`, then `gin_bindings`.

  Relative files and ``include``s are looked up in the current directory,
  then in `search_paths`, then in the repository's ``gin/`` directory.

  Raises:
    Exception: whatever gin raises for a bad config (unknown names, syntax);
      gin adds the file and line to the message.

  Example:
    >>> parse_config(gin_bindings=['TOTAL_STEPS = 7'])
    >>> gin.query_parameter('%TOTAL_STEPS')
    7
  """
  directories = [Path(path) for path in [*search_paths, *default_search_paths()]]
  gin.clear_config()
  for directory in directories:
    gin.add_config_file_search_path(str(directory))
  files = [str(resolve_gin_file(path, directories)) for path in gin_files]
  with _quiet_gin_path_probes():
    gin.parse_config(DEFAULT_CONFIG)
    bindings = [BINDING_IMPORTS, *gin_bindings] if gin_bindings else []
    gin.parse_config_files_and_bindings(files, bindings, finalize_config=False)


def resolve_gin_file(path: str | Path, directories: Sequence[Path]) -> Path:
  """`path` itself when it exists, else the first `directories` entry holding it.

  Resolving here keeps gin from probing the path as a Python package (which
  fails when the current directory has a package of the same name).

  Raises:
    FileNotFoundError: naming the path and the directories searched.

  Example:
    >>> resolve_gin_file('optimizers/adamw.gin', default_search_paths()).name
    'adamw.gin'
  """
  path = Path(path)
  for candidate in [path, *(directory / path for directory in directories if not path.is_absolute())]:
    if candidate.is_file():
      return candidate.resolve()
  searched = ", ".join(str(d) for d in directories) or "none"
  raise FileNotFoundError(
      f"gin file {str(path)!r} not found (in the current directory or the search paths: "
      f"{searched})."
  )


class _DropPathProbes(logging.Filter):
  def filter(self, record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(_GIN_PROBE_MESSAGE)


@contextlib.contextmanager
def _quiet_gin_path_probes() -> Iterator[None]:
  """Hides gin's error log for every search path a file is not in."""
  probe_filter = _DropPathProbes()
  root = logging.getLogger()
  root.addFilter(probe_filter)
  try:
    yield
  finally:
    root.removeFilter(probe_filter)


def build_job() -> TrainJob:
  """Builds the `TrainJob` the parsed config describes (call `parse_config` first)."""
  return gin.get_configurable(TrainJob)()
