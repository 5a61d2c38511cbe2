"""The gin-configured train job: the embedded default config and `TrainJob`.

Everything a gin file needs is reached through dynamic registration: optax
(``import optax``), this package's optimizers and partitioning
(``from t5x_optim import optimizers, partitioning``) and the job itself
(``from t5x_optim import cli``: `TrainJob`, `TransformerConfig`,
`SyntheticTask`, `TextTask`). The default config is always parsed
first, then the ``--gin_file``s, then the ``--gin_bindings``, so a file or a
binding overrides only what it names. Bindings may name anything those
imports reach (``optax.adam.b1 = 0.95``) without importing it themselves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import inspect
import logging
import math
import os
import re
import sys
import tokenize
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import gin
import jax
import optax

from t5x_optim import partitioning, storage
from t5x_optim.cli.demo.model import SyntheticTask, TransformerConfig
from t5x_optim.cli.demo.text import BYTE_VOCAB_SIZE, TextTask
from t5x_optim.cli.loop.interrupt import DEFAULT_GRACE_SECONDS
from t5x_optim.optimizers import MultiOptimizer, OptaxWrapper, OptimizerDef, chain, low_precision
from t5x_optim.partitioning import Partitioner

# gin reads its files with `open`; a path with a scheme (gs://) is read through epath.
gin.config.register_file_reader(lambda path: storage.as_path(path).open(), storage.is_object_store)

__all__ = [
  "BINDING_IMPORTS",
  "DEFAULT_CONFIG",
  "GIN_DIR",
  "NONFINITE_ACTIONS",
  "OptimizerArgument",
  "TrainJob",
  "binds_optimizer",
  "build_job",
  "check_mesh_pin",
  "data_bindings",
  "default_num_partitions",
  "default_search_paths",
  "describe_optimizer",
  "described_gin_error",
  "device_macros",
  "evaluated_argument",
  "files_read",
  "job_optimizer",
  "mesh_devices",
  "optimizer_arguments",
  "optimizer_identity",
  "optimizer_learning_rate",
  "parse_config",
  "resolve_gin_file",
  "text_data_path",
  "unread_bindings",
]

BINDING_IMPORTS = """
from __gin__ import dynamic_registration
import optax
from t5x_optim import cli
from t5x_optim import optimizers
from t5x_optim import partitioning
"""
"""Imports in effect for ``--gin_bindings``, so a binding may name any of them."""

DEFAULT_CONFIG = (
  BINDING_IMPORTS
  + """
VOCAB_SIZE = 32
TOTAL_STEPS = 300
# The command binds these two from the devices it runs on (see `device_macros`).
NUM_DEVICES = None
NUM_PARTITIONS = 1

# Warmup over the first 10% of TOTAL_STEPS, then cosine decay to the end.
LEARNING_RATE = @optax.cosine_onecycle_schedule()
optax.cosine_onecycle_schedule:
  transition_steps = %TOTAL_STEPS
  peak_value = 1e-2
  pct_start = 0.1
  div_factor = 100.0
  final_div_factor = 100.0

OPTIMIZER = @optimizers.chain()
optimizers.chain.transformations = [@optax.clip_by_global_norm(), @optax.adamw()]
optax.clip_by_global_norm.max_norm = 1.0
optax.adamw:
  learning_rate = %LEARNING_RATE
  weight_decay = 1e-4

PARTITIONER = @partitioning.Partitioner()
partitioning.Partitioner:
  mesh = @partitioning.create_mesh()
  logical_axis_rules = @partitioning.standard_logical_axis_rules()
partitioning.create_mesh:
  num_partitions = %NUM_PARTITIONS
  devices = @cli.mesh_devices()
cli.mesh_devices.count = %NUM_DEVICES

cli.TrainJob:
  optimizer = %OPTIMIZER
  partitioner = %PARTITIONER
  model = @cli.TransformerConfig()
  task = %TASK
  total_steps = %TOTAL_STEPS
  checkpoint_every = 100
  keep_checkpoints = 3
  log_every = 10
  eval_every = 50
  eval_batches = 4
  seed = 0
  metrics_every = 50
cli.TransformerConfig.vocab_size = %VOCAB_SIZE
cli.SyntheticTask.vocab_size = %VOCAB_SIZE

# The synthetic task; `--data PATH` binds TASK = @cli.TextTask() (bytes: VOCAB_SIZE = 256).
TASK = @cli.SyntheticTask()
"""
)
"""The config `t5x-optim train` and `t5x-optim plan` start from.

Gin files are Python code: parsing one imports modules and calls whatever it
names, so only use gin files you would run as code.
"""

NONFINITE_ACTIONS = ("stop", "skip")
"""What `TrainJob.on_nonfinite` may be."""
_GIN_PROBE_MESSAGE = "Path not found"
GIN_DIR = Path(__file__).resolve().parents[2] / "gin"
"""The gin files shipped in the package (``optimizers/``, ``partitioning/``, ``examples/``)."""
_MESH_OPTIONS = ("num_partitions", "model_parallel_submesh", "shape")


_LARGEST_STEP = 2**31 - 1  # The int32 step counter's largest.


def _check_int(
  owner: str, name: str, value: Any, *, minimum: int, maximum: int | None = None
) -> None:
  if (
    isinstance(value, bool)
    or not isinstance(value, int)
    or value < minimum
    or (maximum is not None and value > maximum)
  ):
    bound = "" if maximum is None else f" and <= {maximum} (the int32 step counter's largest)"
    raise ValueError(
      f"{owner}.{name} must be an int >= {minimum}{bound}, got {value!r} ({type(value).__name__})."
    )


def _check_type(owner: str, name: str, value: Any, expected: type, hint: str) -> None:
  if not isinstance(value, expected):
    raise TypeError(
      f"{owner}.{name} must be a {expected.__name__}, got {value!r} "
      f"({type(value).__name__}). {hint}"
    )


def mesh_devices(count: int | None = None) -> list[jax.Device] | None:
  """The first `count` devices, or None (every device, in `create_mesh`'s order).

  The default config binds ``partitioning.create_mesh.devices`` to this with
  ``count = %NUM_DEVICES``, which the command sets from ``--num_devices``.

  Raises:
    ValueError: `count` is below 1 or above the device count.

  Example:
    >>> mesh_devices() is None, mesh_devices(jax.device_count()) is None
    (True, True)
  """
  available = jax.device_count()
  if count is None or count == available:
    return None
  if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= available:
    raise ValueError(
      f"cli.mesh_devices.count={count!r} does not fit the {available} available devices."
    )
  return jax.devices()[:count]


def default_num_partitions(num_devices: int) -> int:
  """The default model-axis size: 2 on an even device count, else 1.

  Example:
    >>> [default_num_partitions(n) for n in (1, 2, 3, 8)]
    [1, 2, 1, 2]
  """
  return 2 if num_devices % 2 == 0 else 1


def device_macros(num_devices: int) -> dict[str, int]:
  """The macros the command binds for a run on `num_devices` devices.

  Example:
    >>> device_macros(8)
    {'NUM_DEVICES': 8, 'NUM_PARTITIONS': 2}
  """
  return {"NUM_DEVICES": num_devices, "NUM_PARTITIONS": default_num_partitions(num_devices)}


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def _evaluated(value: Any) -> Any:
  """A bound gin value with macros (``%NAME``) resolved."""
  if isinstance(value, gin.config.ConfigurableReference):
    return value.scoped_configurable_fn()
  return value


def _is_macro(value: Any, name: str) -> bool:
  """Whether a gin binding's `value` is the macro reference ``%name``."""
  return (
    isinstance(value, gin.config.ConfigurableReference)
    and value.configurable.wrapped is gin.config.macro
    and value.scopes[-1] == name
  )


def check_mesh_pin(num_devices: int) -> None:
  """Checks that a mesh pinned in the parsed config fits `num_devices`.

  Call after `parse_config`; looks at the bindings of
  ``partitioning.create_mesh``.

  Raises:
    ValueError: one line naming the pin, the device count and what would fit.

  Example:
    >>> parse_config(gin_bindings=['partitioning.create_mesh.num_partitions = 3'])
    >>> check_mesh_pin(8)
    Traceback (most recent call last):
    ...
    ValueError: the gin config pins partitioning.create_mesh.num_partitions = 3, which does not fit the 8 devices in use; what fits: num_partitions in (1, 2, 4, 8), or shape {'data': d, 'model': m} with d * m = 8 (without a pin the mesh is data=4 x model=2).
  """
  bindings = gin.get_bindings(partitioning.create_mesh)
  pinned = {
    name: _evaluated(bindings[name]) for name in _MESH_OPTIONS if bindings.get(name) is not None
  }
  pinned = {name: value for name, value in pinned.items() if value is not None}
  if not pinned:
    return
  name, value = next(iter(pinned.items()))
  if len(pinned) == 1:
    if name == "shape":
      shape = dict(value)
      fits = set(shape) == {"data", "model"} and shape["data"] * shape["model"] == num_devices
    else:
      model = math.prod(value) if name == "model_parallel_submesh" else value
      fits = isinstance(model, int) and model >= 1 and num_devices % model == 0
    if fits:
      return
  default = default_num_partitions(num_devices)
  pins = ", ".join(f"partitioning.create_mesh.{n} = {v!r}" for n, v in pinned.items())
  raise ValueError(
    f"the gin config pins {pins}, which does not fit the {num_devices} devices in use; "
    f"what fits: num_partitions in {tuple(_divisors(num_devices))}, or shape "
    f"{{'data': d, 'model': m}} with d * m = {num_devices} (without a pin the mesh is "
    f"data={num_devices // default} x model={default})."
  )


@dataclasses.dataclass(frozen=True)
class TrainJob:
  """What `t5x-optim train` runs; every field is set through gin.

  Attributes:
    optimizer: the optimizer definition (``%OPTIMIZER``).
    partitioner: mesh and logical axis rules (``%PARTITIONER``).
    model: sizes of the transformer LM.
    task: the data: `SyntheticTask` or `TextTask` (its batch size is global).
    total_steps: train until the step counter reaches this.
    learning_rate: what TensorBoard shows as ``learning_rate`` when it is
      not read from the optimizer (a schedule, a function of the step, or a
      constant; None logs none). The command replaces it with the learning
      rate the optimizer's own gin bindings give, and the step reads it from
      the optimizer state where that holds one (``inject_hyperparams``). It
      does not change the optimizer.
    checkpoint_every: save a checkpoint every this many steps (and at the end).
    keep_checkpoints: keep this many newest checkpoints.
    log_every: log metrics every this many steps.
    eval_every: evaluate on held-out batches every this many steps (and at the end).
    eval_batches: held-out batches per evaluation.
    seed: the PRNG seed of the model's initialisation.
    metrics_every: every this many steps, write per-parameter metrics (RMS of
      each param, its gradient, its update and each optimizer-state leaf,
      as T5X's ``WeightMetricsComputer``) under ``train/``; 0 writes none.
    on_nonfinite: what a step whose loss, gradient norm or updated params
      are not finite does: ``'stop'`` (the run stops, naming the step; the
      latest checkpoint stays the latest) or ``'skip'`` (the step leaves the params and the
      optimizer state as they were; the step counter still advances, so the
      next step reads the next batch). A non-finite state is never saved.
    max_consecutive_skips: with ``'skip'``, stop as ``'stop'`` does after
      this many non-finite steps in a row.
    preemption_grace_seconds: after a SIGTERM (a preemption), the run saves
      the current step and exits with status 143; past this many seconds it
      exits without waiting for that checkpoint (schedulers kill with SIGKILL
      after their own grace: 30 s on GKE, so stay below theirs).

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
  task: SyntheticTask | TextTask = SyntheticTask()
  total_steps: int = 300
  learning_rate: float | Callable[[int], Any] | None = None
  checkpoint_every: int = 100
  keep_checkpoints: int = 3
  log_every: int = 10
  eval_every: int = 50
  eval_batches: int = 4
  seed: int = 0
  metrics_every: int = 0
  on_nonfinite: str = "stop"
  max_consecutive_skips: int = 10
  preemption_grace_seconds: float = DEFAULT_GRACE_SECONDS

  def __post_init__(self):
    owner = type(self).__name__
    if isinstance(self.optimizer, optax.GradientTransformation):
      raise TypeError(
        f"{owner}.optimizer is an optax GradientTransformation, not an OptimizerDef: use "
        "the wrapped factory of t5x_optim.optimizers (e.g. @optimizers.adamw()) or "
        "@optimizers.OptaxWrapper()."
      )
    _check_type(
      owner,
      "optimizer",
      self.optimizer,
      OptimizerDef,
      "Set OPTIMIZER to an optimizer from t5x_optim.optimizers.",
    )
    _check_type(
      owner,
      "partitioner",
      self.partitioner,
      Partitioner,
      "Set PARTITIONER to @partitioning.Partitioner().",
    )
    _check_type(owner, "model", self.model, TransformerConfig, "Use @cli.TransformerConfig().")
    if not isinstance(self.task, (SyntheticTask, TextTask)):
      raise TypeError(
        f"{owner}.task must be a SyntheticTask or a TextTask, got {self.task!r} "
        f"({type(self.task).__name__}). Use @cli.SyntheticTask() or @cli.TextTask()."
      )
    task = type(self.task).__name__
    _check_int(owner, "total_steps", self.total_steps, minimum=1, maximum=_LARGEST_STEP)
    for name in (
      "checkpoint_every",
      "keep_checkpoints",
      "log_every",
      "eval_every",
      "eval_batches",
    ):
      _check_int(owner, name, getattr(self, name), minimum=1)
    _check_int(owner, "seed", self.seed, minimum=0)
    _check_int(owner, "metrics_every", self.metrics_every, minimum=0)
    _check_int(owner, "max_consecutive_skips", self.max_consecutive_skips, minimum=1)
    if self.on_nonfinite not in NONFINITE_ACTIONS:
      raise ValueError(
        f"{owner}.on_nonfinite must be one of {NONFINITE_ACTIONS}, got {self.on_nonfinite!r}."
      )
    grace = self.preemption_grace_seconds
    if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not grace > 0:
      raise ValueError(
        f"{owner}.preemption_grace_seconds must be a number of seconds > 0, got {grace!r}."
      )
    rate = self.learning_rate
    if not (
      rate is None
      or callable(rate)
      or (isinstance(rate, (int, float)) and not isinstance(rate, bool))
    ):
      raise TypeError(
        f"{owner}.learning_rate must be a schedule, a number or None, got {rate!r} "
        f"({type(rate).__name__})."
      )
    if self.model.vocab_size != self.task.vocab_size:
      raise ValueError(
        f"TransformerConfig.vocab_size={self.model.vocab_size} differs from "
        f"{task}.vocab_size={self.task.vocab_size}; bind both (VOCAB_SIZE)."
      )
    if self.task.length > self.model.max_length:
      raise ValueError(
        f"{task}.length={self.task.length} exceeds "
        f"TransformerConfig.max_length={self.model.max_length}."
      )
    data = dict(self.partitioner.mesh.shape).get("data", 1)
    if self.task.batch_size % data:
      raise ValueError(
        f"{task}.batch_size={self.task.batch_size} is not divisible by the "
        f"mesh's data axis ({data} devices)."
      )


def data_bindings(path: str | Path) -> list[str]:
  """The gin bindings of ``--data PATH``: the byte-level `TextTask` on `path`.

  Example:
    >>> data_bindings('hamlet.txt')
    ['TASK = @cli.TextTask()', "cli.TextTask.path = 'hamlet.txt'", 'VOCAB_SIZE = 256']
  """
  return [
    "TASK = @cli.TextTask()",
    f"cli.TextTask.path = {str(path)!r}",
    f"VOCAB_SIZE = {BYTE_VOCAB_SIZE}",
  ]


def configured_device_count() -> int | None:
  """How many devices the parsed config's mesh takes (``cli.mesh_devices.count``, its
  macro ``NUM_DEVICES`` followed), or None: every device.

  Example:
    >>> parse_config(macros=device_macros(8), gin_bindings=['NUM_DEVICES = 4'])
    >>> configured_device_count()
    4
  """
  bound = gin.get_bindings(mesh_devices, resolve_references=False).get("count")
  count, _ = _past_macros(bound, [])
  return count if isinstance(count, int) and not isinstance(count, bool) else None


def text_data_path() -> str | None:
  """The path of the text the parsed config trains on (its `TextTask`), or None for
  another task.

  Example:
    >>> parse_config(gin_bindings=data_bindings('hamlet.txt'))
    >>> text_data_path()
    'hamlet.txt'
    >>> parse_config()
    >>> text_data_path() is None
    True
  """
  task, scope = _past_macros(gin.get_bindings(TrainJob, resolve_references=False).get("task"), [])
  if not isinstance(task, gin.config.ConfigurableReference) or task.configurable.wrapped is not (
    TextTask
  ):
    return None
  path = _bound(task, scope).get("path")
  return None if path is None else str(path)


def default_search_paths() -> list[Path]:
  """The package's gin directory, where relative gin file names are looked up last.

  Example:
    >>> [path.name for path in default_search_paths()]
    ['gin']
  """
  return [GIN_DIR]


PARSE_ERRORS = (SyntaxError, tokenize.TokenError)
"""What gin's parser raises for text that is not gin."""


_BINDING_NOTE = re.compile(r"\n\s*In bindings string line \d+\n.*", re.DOTALL)
"""What gin appends to an error in a bindings string: the line, counted after the imports put
before each ``--gin_bindings`` entry, the line's text and a caret under the fault."""

_BINDING_ERRORS = (ValueError, AttributeError, NameError, ImportError)
"""What gin raises for a binding that parses but names what it cannot bind (an unknown
parameter, configurable or module)."""


def parse_problem(error: SyntaxError | tokenize.TokenError) -> tuple[str, int | None]:
  """What is wrong in text gin could not parse (one of `PARSE_ERRORS`), and on which line.

  Example:
    >>> import tokenize
    >>> parse_problem(tokenize.TokenError('EOF in multi-line statement', (3, 0)))
    ('EOF in multi-line statement', 3)
  """
  if isinstance(error, SyntaxError):
    return error.msg, error.lineno
  return error.args[0], error.args[1][0]


def parse_config(
  *,
  gin_files: Sequence[str] = (),
  gin_bindings: Sequence[str] = (),
  search_paths: Sequence[str | Path] = (),
  macros: Mapping[str, Any] | None = None,
) -> None:
  """Parses the default config, the `macros`, then `gin_files`, then `gin_bindings`; a mesh
  pinned by ``shape`` or ``model_parallel_submesh`` replaces the default config's
  ``num_partitions``.

  Relative files and ``include``s are looked up in the current directory,
  then in `search_paths`, then in the package's gin directory (`GIN_DIR`),
  never beside the file that includes them (one found elsewhere while that
  folder holds a file of its name is refused, `_check_includes`; so is one of a
  shipped file's includes found elsewhere than in `GIN_DIR`), nor in other
  search paths given to gin (earlier parses' among them: gin's list is left as
  it was);
  an ``include`` also, as gin does, in the packages on ``sys.path``, folders
  without ``__init__.py`` among them (`_package_file`).
  Gin files are code: parsing one imports modules and calls functions, so
  parse only files you trust like code.

  Args:
    gin_files: gin files, parsed in order.
    gin_bindings: bindings parsed after the files.
    search_paths: local directories searched for files and includes.
    macros: ``{name: value}`` bound right after the default config (the
      command binds `device_macros`), so files and bindings override them.

  Raises:
    NotADirectoryError: a search path is not a local directory (a mistyped one
      would leave a file to be found in the package's directory instead).
    ValueError: a file includes a name that gin finds in another file than
      the one of that name beside it (for a shipped file, the shipped one); a
      `gin_bindings` entry does not parse, or names a parameter, configurable
      or module gin cannot bind (the entry named with gin's reason).
    Exception: whatever gin raises for a bad config file (unknown names,
      syntax); gin adds the file and line to the message.

  Example:
    >>> parse_config(gin_bindings=['TOTAL_STEPS = 7'], macros={'NUM_PARTITIONS': 1})
    >>> gin.query_parameter('%TOTAL_STEPS'), gin.query_parameter('%NUM_PARTITIONS')
    (7, 1)
  """
  for path in search_paths:
    if storage.is_object_store(path) or not Path(path).is_dir():
      raise NotADirectoryError(f"gin search path {str(path)!r} is not a local directory.")
  directories = [Path(path) for path in [*search_paths, *default_search_paths()]]
  _GIVEN_BINDINGS.clear()
  _FILES_READ.clear()
  gin.clear_config()
  files = [str(resolve_gin_file(path, directories)) for path in gin_files]
  _check_includes(files, directories)
  with (
    _gin_search_paths(directories),
    _quiet_gin_path_probes(),
    _package_lookup_of_namespace_packages(),
    _recording_files_read(),
  ):
    gin.parse_config(DEFAULT_CONFIG)
    gin.parse_config([f"{name} = {value!r}" for name, value in (macros or {}).items()])
    gin.parse_config_files_and_bindings(files, None, finalize_config=False)
    _GIVEN_BINDINGS[:] = _parse_bindings(gin_bindings)
  _give_way_to_a_pinned_mesh()


_INCLUDE = re.compile(r"^include\s+(['\"])(.+?)\1", re.MULTILINE)


def _check_includes(files: Sequence[str], directories: Sequence[Path]) -> None:
  """Refuses an ``include`` in `files` (or in the local files they include) of a relative name
  that gin finds in another file (in the current directory, `directories` or the package's
  gin files: `resolve_gin_file`) than the including file's own one of that name: the one
  beside it, or for a shipped file the shipped one (`_own_include`)."""
  seen: set[str] = set()
  pending = [file for file in files if not storage.is_object_store(file)]
  while pending:
    file = pending.pop()
    if file in seen:
      continue
    seen.add(file)
    for _, name in _INCLUDE.findall(Path(file).read_text()):
      if os.path.isabs(name) or storage.is_object_store(name):
        continue
      try:
        found = resolve_gin_file(name, directories)
      except FileNotFoundError:  # gin says so, or finds it in a package
        continue
      own = _own_include(Path(file), name)
      if own.is_file() and own.resolve() != found:
        raise ValueError(_shadowed_include(Path(file), name, found, own))
      pending.append(str(found))


def _gin_root(found: Path, name: str) -> Path:
  """The folder that the relative `name` was looked up in to find `found` (the current
  directory or a search path): `found` without the parts of `name`.

  Example:
    >>> _gin_root(Path('/my/optimizers/lion.gin'), 'optimizers/lion.gin')
    PosixPath('/my')
    >>> _gin_root(Path('/my/lion.gin'), './lion.gin')
    PosixPath('/my')
  """
  return found.parents[len(Path(os.path.normpath(name)).parts) - 1]


def _own_include(file: Path, name: str) -> Path:
  """The file that `file`'s ``include`` of the relative `name` means: the shipped one for a
  shipped file (the package's includes are relative to its gin folder, `GIN_DIR`), else the
  one beside `file`.

  Example:
    >>> _own_include(GIN_DIR / 'optimizers/adamw_8bit.gin', 'optimizers/adamw.gin') == (
    ...   GIN_DIR / 'optimizers/adamw.gin')
    True
    >>> _own_include(Path('/my/main.gin'), 'optimizers/adamw.gin')
    PosixPath('/my/optimizers/adamw.gin')
  """
  if file.is_relative_to(GIN_DIR):
    return GIN_DIR / name
  return file.parent / name


def _shadowed_include(file: Path, name: str, found: Path, own: Path) -> str:
  """Why `file`'s ``include`` of `name` is refused: gin finds it as `found`, not as `own`."""
  where = (
    f"{file} includes {name!r}, which gin finds as {found} (it looks in the current "
    "directory, the search paths and the package's gin files, in that order"
  )
  if own.is_relative_to(GIN_DIR):
    copy = _gin_root(found, name) / file.relative_to(GIN_DIR)
    return (
      f"{where}), not as the shipped {own}: rename or move {found}, or to take it in place of "
      f"the shipped one give a copy of {file.name} of your own as {copy} and use it by that "
      f"name ({str(file.relative_to(GIN_DIR))!r}) or by its path."
    )
  return (
    f"{where}, not beside the including file), not as {own}: include one of them by a path "
    "that names it alone (e.g. an absolute path)."
  )


def _give_way_to_a_pinned_mesh() -> None:
  """Unbinds the default config's ``num_partitions = %NUM_PARTITIONS`` where the parsed
  config pins the mesh by ``shape`` or ``model_parallel_submesh`` (``create_mesh`` takes one
  of the three)."""
  raw = gin.get_bindings(partitioning.create_mesh, resolve_references=False)
  pinned = any(raw.get(name) is not None for name in ("shape", "model_parallel_submesh"))
  if pinned and _is_macro(raw.get("num_partitions"), "NUM_PARTITIONS"):
    gin.bind_parameter("partitioning.create_mesh.num_partitions", None)


class _GivenBinding(NamedTuple):
  text: str
  keys: tuple[tuple[str, str, str], ...]  # (scope, selector, parameter) it binds


_GIVEN_BINDINGS: list[_GivenBinding] = []
"""The bindings the last `parse_config` was given, each with what it binds."""


def _config_values() -> dict[tuple[str, str, str], Any]:
  # gin shows its bindings only as text; its `_CONFIG` holds them by (scope, selector).
  return {
    (scope, selector, name): value
    for (scope, selector), values in gin.config._CONFIG.items()  # noqa: SLF001
    for name, value in values.items()
  }


def _parse_bindings(bindings: Sequence[str]) -> list[_GivenBinding]:
  """Parses `bindings` in order (after `BINDING_IMPORTS` and the imports of those before),
  each with the (scope, selector, parameter) keys it binds or rebinds (none for an entry that
  includes a file: its bindings are the file's, and a file's are not checked)."""
  imports = [BINDING_IMPORTS]
  given = []
  before = _config_values()
  for text in bindings:
    try:
      gin.parse_config([*imports, text])
    except PARSE_ERRORS as error:
      # gin's line numbers count the imports put before the binding.
      detail, _ = parse_problem(error)
      raise ValueError(f"--gin_bindings {text!r} does not parse: {detail}") from error
    except _BINDING_ERRORS as error:
      note = _BINDING_NOTE.search(str(error))
      if note is None:
        raise
      raise ValueError(f"--gin_bindings {text!r}: {str(error)[: note.start()]}") from error
    after = _config_values()
    keys = tuple(
      key for key, value in after.items() if key not in before or before[key] is not value
    )
    before = after
    lines = [line.strip() for line in text.splitlines()]
    # An entry that includes a file binds what the file binds, and is taken as a file is.
    included = any(line.startswith("include ") for line in lines)
    given.append(_GivenBinding(text, () if included else keys))
    imports += [line for line in lines if line.startswith(("import ", "from "))]
  return given


def _display(selector: str) -> str:
  return selector.removeprefix("t5x_optim.")


_GIN_NOTE = re.compile(
  r"\s+In call to configurable '([^']*)' \((.*?)\)(?: in scope '([^']*)')?"
  r"(?=\s+In call to configurable|$)"
)
"""What gin appends to an error raised where it calls a configurable, once for each call the
error passes through, the innermost first: its name, its function or class, its scope."""


def described_gin_error(text: str, *, call: bool = True) -> str:
  """`text`, an error's message on one line, with gin's notes of the calls it passed through
  (``In call to configurable 'name' (<function name at 0x...>) in scope 'S'``) replaced by
  the innermost call as the config names it: the configurable, its scope and the bindings
  gin gave it; without ``call`` (a message that names what is at fault), left out.

  Example:
    >>> parse_config(gin_bindings=["optax.cosine_onecycle_schedule.pct_start = 'x'"])
    >>> note = f"In call to configurable 'cosine_onecycle_schedule' ({optax.cosine_onecycle_schedule})"
    >>> described_gin_error(f"bad type {note} in scope 'LEARNING_RATE'")
    "bad type (in the call of optax.cosine_onecycle_schedule in scope LEARNING_RATE; its bindings: transition_steps = %TOTAL_STEPS, peak_value = 0.01, pct_start = 'x', div_factor = 100.0, final_div_factor = 100.0)"
  """
  match = _GIN_NOTE.search(text)
  head = _GIN_NOTE.sub("", text)
  if match is None or not call:
    return head
  name, shown, scope = match.groups()
  where = f" in scope {scope}" if scope else ""
  registry = gin.config._REGISTRY  # noqa: SLF001 - gin names the call only as text
  called = [
    selector
    for selector, configurable in registry.items()
    if configurable.name == name and str(configurable.wrapped) == shown
  ]
  if len(called) != 1:
    return f"{head} (in the call of {name}{where})"
  bound = gin.get_bindings(f"{scope}/{called[0]}" if scope else called[0], resolve_references=False)
  given = ", ".join(f"{key} = {value!r}" for key, value in bound.items()) or "none"
  return f"{head} (in the call of {_display(called[0])}{where}; its bindings: {given})"


def unread_bindings() -> list[tuple[str, str]]:
  """The bindings given to the last `parse_config` that nothing called so far has read, each
  with why (``(binding, reason)``).

  A binding is read when a call of its configurable took the parameter from
  it: from the bindings (not from the caller), and from this one, not one of
  a more specific scope (``OPTIMIZER/optax.adamw.b1`` over ``optax.adamw.b1``);
  a macro, when something referred to it. Ask once the job is built:
  `build_job` and `train.prepare` call every configurable a run calls.

  Example:
    >>> parse_config(gin_bindings=['BATCH_SIZE = 8', 'optax.lbfgs.memory_size = 5'])
    >>> for binding, reason in unread_bindings():
    ...   print(f'{binding}: {reason}')
    BATCH_SIZE = 8: nothing refers to %BATCH_SIZE
    optax.lbfgs.memory_size = 5: no call of optax.lbfgs took memory_size from the bindings
  """
  operative = gin.config._OPERATIVE_CONFIG  # noqa: SLF001 - likewise only text otherwise
  lines = []
  for given in _GIVEN_BINDINGS:
    for key in given.keys:
      scope, selector, name = key
      sources = _sources(key, operative)
      if scope in sources:
        continue
      if selector == "gin.macro":
        lines.append((given.text, f"nothing refers to %{scope}"))
        continue
      if sources:
        shadows = ", ".join(f"{s}/{_display(selector)}.{name}" for s in sorted(sources))
        lines.append(
          (
            given.text,
            f"every call of {_display(selector)} took {name} from the more specific {shadows}",
          )
        )
        continue
      line = f"no call of {_display(selector)} took {name} from the bindings"
      # What the binding may have meant: a call of the same name, or one that takes `name`.
      last = selector.rsplit(".", 1)[-1]
      alike = sorted(
        {
          _display(c)
          for (_, c), values in operative.items()
          if c != selector and (name in values or c.rsplit(".", 1)[-1] == last)
        }
      )
      if alike:
        more = f" and {len(alike) - 4} more" if len(alike) > 4 else ""
        line += f" (did you mean {', '.join(alike[:4])}{more}?)"
      lines.append((given.text, line))
  return lines


def _sources(key: tuple[str, str, str], operative: Mapping[tuple[str, str], Any]) -> set[str]:
  """The scopes of the bindings that the calls recorded in `operative` took `key`'s parameter
  from, of the calls of its selector in its scope or one inside it: each takes the binding of
  the most specific scope around it that binds the parameter (gin reads a scope's bindings in
  its sub-scopes, and a sub-scope's binding wins). The binding `key` names was read when its
  own scope is among them; a macro is read when anything refers to it."""
  scope, selector, name = key
  bound = gin.config._CONFIG  # noqa: SLF001 - see `_config_values`
  sources = set()
  for (where, called), values in operative.items():
    if called != selector or name not in values:
      continue
    if scope and where != scope and not where.startswith(f"{scope}/"):
      continue
    parts = where.split("/") if where else []
    around = ("/".join(parts[:end]) for end in range(len(parts), -1, -1))
    sources.add(next((s for s in around if name in bound.get((s, selector), {})), scope))
  return sources


def resolve_gin_file(path: str | Path, directories: Sequence[Path]) -> Path:
  """`path` itself when it exists, else the first `directories` entry holding it.

  A path with a scheme (``gs://bucket/run/config.gin``) is only checked.

  A relative path may also name a shipped file as ``gin/<kind>/<file>`` (the
  repository layout before the files moved into the package).
  Resolving here keeps gin from probing the path as a Python package (which
  fails when the current directory has a package of the same name).

  Raises:
    FileNotFoundError: naming the path and the directories searched.

  Example:
    >>> resolve_gin_file('optimizers/adamw.gin', default_search_paths()).name
    'adamw.gin'
    >>> resolve_gin_file('gin/optimizers/adamw.gin', []) == GIN_DIR / 'optimizers/adamw.gin'
    True
  """
  if storage.is_object_store(path):
    remote = storage.as_path(path)
    if not remote.is_file():
      raise FileNotFoundError(f"gin file {str(remote)!r} not found.")
    return remote
  path = Path(path)
  relative = [] if path.is_absolute() else [directory / path for directory in directories]
  if not path.is_absolute() and path.parts[:1] == (GIN_DIR.name,):
    relative.append(GIN_DIR.joinpath(*path.parts[1:]))
  for candidate in [path, *relative]:
    if candidate.is_file():
      return candidate.resolve()
  searched = ", ".join(str(d) for d in directories) or "none"
  raise FileNotFoundError(
    f"gin file {str(path)!r} not found (in the current directory or the search paths: {searched})."
  )


def _package_file(config_path: str) -> str | None:
  """Where gin's lookup in packages finds `config_path` (``pkg/file.gin``: ``file.gin`` in the
  package ``pkg`` on ``sys.path``), a namespace package (a folder without ``__init__.py``)
  included, whose folders gin's own lookup fails on; None where it is not found.

  Example:
    >>> _package_file('t5x_optim/gin/optimizers/adamw.gin') == str(GIN_DIR / 'optimizers/adamw.gin')
    True
    >>> _package_file('no_such_package/adamw.gin') is None
    True
  """
  head, name = os.path.split(config_path)
  try:
    spec = importlib.util.find_spec(head.replace("/", "."))
  except (ImportError, ValueError):
    return None
  if spec is None:
    return None
  if spec.has_location and spec.origin:
    folders = [os.path.dirname(spec.origin)]
  else:
    folders = list(spec.submodule_search_locations or ())
  for folder in folders:
    path = os.path.join(folder, name)
    if os.path.isfile(path):
      return path
  return None


def _open_package_file(config_path: str) -> Any:
  return open(_package_file(config_path))  # noqa: SIM115 - gin closes it


def _package_file_exists(config_path: str) -> bool:
  return _package_file(config_path) is not None


@contextlib.contextmanager
def _package_lookup_of_namespace_packages() -> Iterator[None]:
  """Swaps gin's lookup of files in packages for `_package_file` while a config is parsed."""
  readers = getattr(gin.config, "_FILE_READERS", None)  # gin offers no way to replace a reader
  lookup = getattr(gin, "resource_reader", None)
  if not isinstance(readers, list) or lookup is None:  # another gin: its own lookup, as it is
    yield
    return
  gins = (lookup.system_path_reader, lookup.system_path_file_exists)
  ours = (_open_package_file, _package_file_exists)
  readers[:] = [ours if entry == gins else entry for entry in readers]
  try:
    yield
  finally:
    readers[:] = [gins if entry == ours else entry for entry in readers]


_FILES_READ: list[Path | str] = []
"""The gin files the last `parse_config` read, in order (`files_read`)."""


def files_read() -> list[Path | str]:
  """The gin files the last `parse_config` read, in order: those given and every file they
  or the bindings ``include``, each local one resolved (links followed), others as named.

  Example:
    >>> parse_config(gin_files=['examples/tiny.gin'])
    >>> files_read() == [GIN_DIR / 'examples' / 'tiny.gin']
    True
  """
  return list(_FILES_READ)


@contextlib.contextmanager
def _recording_files_read() -> Iterator[None]:
  """Records in `_FILES_READ` each file that gin's readers open while a config is parsed."""
  readers = getattr(gin.config, "_FILE_READERS", None)  # gin offers no way to wrap a reader
  if not isinstance(readers, list):  # another gin: nothing recorded
    yield
    return
  before = readers[:]
  readers[:] = [(_recorded(read), exists) for read, exists in before]
  try:
    yield
  finally:
    readers[:] = before


def _recorded(read: Callable[[str], Any]) -> Callable[[str], Any]:
  """`read`, recording the file it opens in `_FILES_READ` (the opened file's name, which a
  package's file has in place of the name gin looked it up by)."""

  def recorded(name: str) -> Any:
    opened = read(name)
    path = os.fspath(getattr(opened, "name", name))
    _FILES_READ.append(path if storage.is_object_store(path) else Path(path).resolve())
    return opened

  return recorded


class _DropPathProbes(logging.Filter):
  def filter(self, record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(_GIN_PROBE_MESSAGE)


@contextlib.contextmanager
def _gin_search_paths(directories: Sequence[Path]) -> Iterator[None]:
  """gin's search paths for files and ``include``s: the current directory, then
  `directories`, inside; those gin had before, after. gin keeps them for the process (clearing
  its config keeps them too), so one parse's would be searched by every later one."""
  prefixes = getattr(gin.config, "_LOCATION_PREFIXES", None)  # gin can only append to them
  if not isinstance(prefixes, list):  # another gin: its own search paths, added to
    for directory in directories:
      gin.add_config_file_search_path(str(directory))
    yield
    return
  before = prefixes[:]
  prefixes[:] = ["", *map(str, directories)]
  try:
    yield
  finally:
    prefixes[:] = before


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
  """Builds the `TrainJob` the parsed config describes (call `parse_config` first).

  The learning rate it logs is the one the optimizer's bindings give
  (`optimizer_learning_rate`) when they give one; `learning_rate_source`
  says where it comes from.
  """
  job = gin.get_configurable(TrainJob)()
  rate = optimizer_learning_rate()
  return job if rate is None else dataclasses.replace(job, learning_rate=rate[0])


def learning_rate_source() -> str:
  """Where the learning rate that `build_job`'s job logs comes from, for the banner."""
  rate = optimizer_learning_rate()
  return "cli.TrainJob.learning_rate, not read from the optimizer" if rate is None else rate[1]


class OptimizerArgument(NamedTuple):
  """One argument gin binds in a configurable that the job's optimizer reaches.

  Attributes:
    binding: the binding that gives it, e.g. ``OPTIMIZER/optax.adamw.b1``.
    name: the argument's name, e.g. ``b1``.
    value: the bound value, a macro or reference unevaluated.
    scope: the scope gin evaluates `value` in.
    default: whether nothing binds it and `value` is the configurable's default
      (`optimizer_arguments`' ``defaults``).
    at: the path, in the job's optimizer's state (its ``param_states``), of the state of
      the configurable it is bound in, where the walk can tell it (`_STATE_PATHS`): ``""``
      for the job's optimizer, ``"1/param_states"`` for a `MultiOptimizer`'s second
      group's, ``"inner_states/x"`` for an ``optax.partition`` part's; else None.
  """

  binding: str
  name: str
  value: Any
  scope: tuple[str, ...]
  default: bool = False
  at: str | None = None


_OPTIMIZER_SCOPE = ("OPTIMIZER",)
"""gin evaluates a macro's value in the macro's scope: ``%OPTIMIZER``'s in ``OPTIMIZER``."""


def job_optimizer() -> Any:
  """What the parsed config binds ``cli.TrainJob.optimizer`` to, unevaluated: ``%OPTIMIZER``
  (the default config's), or a reference bound there itself (``@optimizers.adam()``). As
  `build_job` calls `TrainJob` in no scope, gin calls it in its own scope: a macro's name
  (``OPTIMIZER``), or that of a scoped reference (``@fast/optimizers.adam()``).

  Raises:
    ValueError: gin has not met `TrainJob` (a config parsed without the default one).
  """
  return gin.get_bindings(TrainJob, resolve_references=False).get("optimizer")


def _called_in(reference: Any, scope: Sequence[str]) -> list[str]:
  """The scope gin calls `reference` in from a caller in `scope`: its own scope
  (``@fast/optax.adamw()``, a macro's name) replaces the caller's."""
  return list(reference.scopes) or list(scope)


def _bound(reference: Any, scope: Sequence[str]) -> dict[str, Any]:
  """The bindings gin gives `reference` in `scope`: a scoped binding over an unscoped one.

  They are looked up under the name gin registered the configurable with, which is not the
  name the reference is written with where a function has two (``optax.partition`` is
  ``optax.multi_transform``: gin knows it by the name it met first).
  """
  key = "/".join([*scope, reference.configurable.selector])
  return gin.get_bindings(key, resolve_references=False)


def _binding_name(reference: Any, scope: Sequence[str], arg: str) -> str:
  """The binding that gives `reference`'s `arg` its value in `scope`, e.g. ``optax.adamw.b1``:
  looked up under the configurable's registered name (a function of two names is registered
  under one), named as the reference is written."""
  registered = reference.configurable.selector
  for end in range(len(scope), -1, -1):
    if arg in gin.get_bindings(
      "/".join([*scope[:end], registered]), resolve_references=False, inherit_scopes=False
    ):
      return f"{'/'.join([*scope[:end], reference.selector])}.{arg}"
  return f"{reference.selector}.{arg}"


def _past_macros(value: Any, scope: Sequence[str]) -> tuple[Any, list[str]]:
  """`value` bound from a caller in `scope`, with macros followed to what they bind, and
  the scope gin calls that in (a reference's own scope, else its caller's)."""
  while isinstance(value, gin.config.ConfigurableReference):
    scope = _called_in(value, scope)
    if value.configurable.wrapped is not gin.config.macro:
      break
    value = _bound(value, scope).get("value")
  return value, list(scope)


def _called_identity(value: Any, scope: Sequence[str]) -> tuple[str, tuple[str, ...]] | None:
  """A gin reference as the configurable gin calls and the scope it calls it in (a macro
  followed to its value): one identity, one value; None when `value` is not a reference."""
  value, scope = _past_macros(value, scope)
  if not isinstance(value, gin.config.ConfigurableReference):
    return None
  return value.selector, tuple(scope)


def _items(value: Any, *, dicts: bool = True) -> list[tuple[Any, Any]] | None:
  """The ``(key, item)`` pairs of a bound list, tuple or dict (a dict's in the order of its
  keys' reprs: one order whatever order a file binds them in), the indices as keys; None
  for any other value (and for a dict without ``dicts``).

  Example:
    >>> _items({'y': 1, 'x': 2}), _items(('a',)), _items('a')
    ([('x', 2), ('y', 1)], [(0, 'a')], None)
  """
  if isinstance(value, (list, tuple)):
    return list(enumerate(value))
  if isinstance(value, Mapping) and dicts:
    return sorted(value.items(), key=lambda item: repr(item[0]))
  return None


def _own_name(reference: Any) -> str:
  """The name of the configurable `reference` calls, however it is written: the module as
  gin imported it (``optimizers.chain`` for ``t5x_optim.optimizers.chain``), and of a
  function of two names the one it has itself where its module has it so (``optax.partition``
  for ``optax.multi_transform``, whichever gin met first).

  Example:
    >>> parse_config(gin_bindings=['OPTIMIZER = @optax.multi_transform()'])
    >>> _own_name(gin.query_parameter('OPTIMIZER/gin.macro.value'))
    'optax.partition'
  """
  configurable = reference.configurable
  own = getattr(configurable.wrapped, "__name__", None)
  module = sys.modules.get(configurable.module or "")
  if own and getattr(module, own, None) is configurable.wrapped:
    return _display(f"{configurable.module}.{own}")
  return _display(configurable.selector)


def _reference_text(
  value: Any,
  depth: int,
  skip: frozenset[str] = frozenset(),
  scope: Sequence[str] = (),
  *,
  dicts: bool = True,
  written: bool = True,
  empty: bool = False,
) -> str | None:
  """`value` as ``name(arg=...)`` when it is a gin reference (or a list or dict of them).

  Its arguments are those gin binds when it calls `value` from `scope`;
  those named in `skip` are left out, and dicts without ``dicts``. Each
  configurable is named as written, or without ``written`` by `_own_name`.
  An empty list or dict holds no reference and is left out, or with
  `empty` shown as ``[]`` (as earlier versions recorded it).
  """
  items = _items(value, dicts=dicts)
  recurse = functools.partial(_reference_text, skip=skip, dicts=dicts, written=written, empty=empty)
  if items is not None:
    parts = [(key, recurse(item, depth, scope=scope)) for key, item in items]
    if not all(text for _, text in parts) or not (parts or empty):
      return None
    if isinstance(value, Mapping):
      return f"{{{', '.join(f'{key!r}: {text}' for key, text in parts)}}}"
    return f"[{', '.join(text for _, text in parts)}]"
  if not isinstance(value, gin.config.ConfigurableReference):
    return None
  scope = _called_in(value, scope)
  bound = _bound(value, scope)
  if value.configurable.wrapped is gin.config.macro:
    return recurse(bound.get("value"), depth, scope=scope)
  name = value.selector if written else _own_name(value)
  if depth == 0:
    return name
  inner = []
  for key, argument in bound.items():
    if key in skip:
      continue
    shown = recurse(argument, depth - 1, scope=scope)
    if shown is not None:
      inner.append(f"{key}={shown}")
  return f"{name}({', '.join(inner)})" if inner else name


def describe_optimizer() -> str:
  """The parsed config's job's optimizer (``cli.TrainJob.optimizer``, ``%OPTIMIZER`` unless
  bound otherwise) as gin names, e.g. ``optimizers.lion(...)``.

  Example:
    >>> parse_config()
    >>> describe_optimizer()
    'optimizers.chain(transformations=[optax.clip_by_global_norm, optax.adamw(learning_rate=optax.cosine_onecycle_schedule)])'
  """
  text = _reference_text(job_optimizer(), depth=3)
  return text or "(not a gin reference)"


_IDENTITY_DEPTH = 16
_RATES = frozenset({"learning_rate", "step_size", "adam_learning_rate"})
"""The names of an optimizer's learning rates (``step_size``: jax.example_libraries';
``adam_learning_rate``: Muon's for the params it sends to Adam)."""


def optimizer_identity() -> str:
  """What makes the parsed config's job's optimizer (``cli.TrainJob.optimizer``,
  ``%OPTIMIZER`` unless bound otherwise) the same optimizer on resume.

  The gin configurables it reaches, nested as they are bound, without the
  learning rate and its schedule (which a resume may change) or any number;
  each named as gin imported it, one name for one function (`_own_name`), so
  ``@t5x_optim.optimizers.chain()`` is ``optimizers.chain`` and
  ``optax.multi_transform`` is ``optax.partition``.

  Example:
    >>> parse_config()
    >>> optimizer_identity()
    'optimizers.chain(transformations=[optax.clip_by_global_norm, optax.adamw])'
  """
  value = job_optimizer()
  text = _reference_text(value, depth=_IDENTITY_DEPTH, skip=_RATES, written=False)
  return text or f"(not a gin reference: {value!r})"


def earlier_optimizer_identities() -> set[str]:
  """`optimizer_identity` as earlier versions recorded it for the parsed config: that of
  ``%OPTIMIZER`` whatever ``cli.TrainJob.optimizer`` is bound to, its configurables named as
  written, arguments bound to an empty list shown (``param_modes=[]``), with arguments bound
  to a dict (``optax.multi_transform``'s ``transforms``) in or, before those were read, left
  out.

  Example:
    >>> parse_config(gin_bindings=['cli.TrainJob.optimizer = @optimizers.adam()'])
    >>> optimizer_identity(), sorted(earlier_optimizer_identities())
    ('optimizers.adam', ['optimizers.chain(transformations=[optax.clip_by_global_norm, optax.adamw])'])
  """
  value = gin.query_parameter("%OPTIMIZER")
  return {
    _reference_text(
      value, depth=_IDENTITY_DEPTH, skip=_RATES, scope=_OPTIMIZER_SCOPE, dicts=dicts, empty=True
    )
    or f"(not a gin reference: {value!r})"
    for dicts in (True, False)
  }


def optimizer_arguments(
  *, stop: frozenset[str] = frozenset(), defaults: bool = False
) -> Iterator[OptimizerArgument]:
  """Each argument gin binds in the configurables the job's optimizer
  (``cli.TrainJob.optimizer``, ``%OPTIMIZER`` unless bound otherwise) reaches, as gin builds it.

  A configurable is read in the scope gin calls it in: ``OPTIMIZER`` for
  ``%OPTIMIZER``'s value and what it reaches, a reference's own scope
  (``@fast/optax.adamw()``) for it, where a scoped binding wins over an
  unscoped one. Lists, tuples and dicts (``optax.multi_transform``'s
  ``transforms``) are looked into item by item. Arguments named in `stop`
  are yielded but not looked into. With `defaults`, so is each argument of a
  number (or bool) default that nothing binds, marked ``default``.

  Example:
    >>> parse_config(gin_bindings=['OPTIMIZER/optax.adamw.b1 = 0.8'])
    >>> [a.binding for a in optimizer_arguments() if a.name == 'b1']
    ['OPTIMIZER/optax.adamw.b1']
  """

  def visit(
    value: Any, depth: int, scope: Sequence[str], at: str | None, items_at: Any = None
  ) -> Iterator[OptimizerArgument]:
    if depth == 0:
      return
    items = _items(value)
    if items is not None:
      for key, item in items:
        inner = items_at(at, key) if items_at is not None and at is not None else (None, None)
        yield from visit(item, depth, scope, *inner)
      return
    if not isinstance(value, gin.config.ConfigurableReference):
      return
    scope = _called_in(value, scope)
    bound = _bound(value, scope)
    if value.configurable.wrapped is gin.config.macro:
      yield from visit(bound.get("value"), depth - 1, scope, at, items_at)
      return
    paths = state_paths_of(value.configurable.wrapped)
    for key, argument in bound.items():
      name = _binding_name(value, scope, key)
      yield OptimizerArgument(name, key, argument, tuple(scope), at=at)
      if key not in stop:
        suffix, inner_items = paths.get(key, (None, None))
        inner_at = None if at is None or suffix is None else _under(at, suffix)
        yield from visit(argument, depth - 1, scope, inner_at, inner_items)
    if defaults:
      for key, argument in _number_defaults(value.configurable.wrapped).items():
        if key not in bound:
          name = _binding_name(value, scope, key)
          yield OptimizerArgument(name, key, argument, tuple(scope), default=True, at=at)

  yield from visit(job_optimizer(), _IDENTITY_DEPTH, (), "")


def _under(at: str, *keys: Any) -> str:
  return "/".join(str(key) for key in (at, *keys) if str(key))


def _group(at: str, index: Any) -> tuple[str, Any]:
  """A `MultiOptimizer`'s group `index`: its ``param_states``, where the second item of its
  ``(traversal, optimizer)`` pair keeps its state."""
  return _under(at, index, "param_states"), lambda at, key: (at, None) if key == 1 else (None, None)


_STATE_PATHS: dict[Any, dict[str, tuple[str, Any]]] = {
  MultiOptimizer: {"traversals_and_optimizers": ("", _group)},
  OptaxWrapper: {"optax_optimizer": ("", None)},
  chain: {"transformations": ("", lambda at, index: (_under(at, index), None))},
  optax.partition: {"transforms": ("", lambda at, key: (_under(at, "inner_states", key), None))},
  low_precision: {"inner": ("inner_state", None)},
  optax.MultiSteps: {"opt": ("inner_opt_state", None)},
  optax.masked: {"inner": ("inner_state", None)},
  optax.apply_if_finite: {"inner": ("inner_state", None)},
  optax.conditionally_mask: {"inner": ("inner_state", None)},
  optax.conditionally_transform: {"inner": ("inner_state", None)},
  optax.flatten: {"inner": ("", None)},
  optax.with_extra_args_support: {"tx": ("", None)},
  optax.lookahead: {"fast_optimizer": ("fast_state", None)},
  optax.selective_transform: {"optimizer": ("inner_states/train/inner_state", None)},
  optax.contrib.galore: {"base_optimizer": ("0/base_optimizer_state", None)},
  optax.contrib.scale_by_galore: {"base_optimizer": ("base_optimizer_state", None)},
  optax.contrib.mechanize: {"base_optimizer": ("base_optimizer_state", None)},
  optax.contrib.sam: {"optimizer": ("opt_state", None), "adv_optimizer": ("adv_state", None)},
  optax.contrib.schedule_free: {"base_optimizer": ("base_optimizer_state", None)},
  optax.contrib.split_real_and_imaginary: {"inner": ("inner_state", None)},
}
"""How an argument of a configurable that composes optimizers reaches the state of what it is
bound to, for `OptimizerArgument.at`: by configurable (`state_paths_of`: a wrapper, as this
package's ``optimizers.schedule_free``, by what it wraps) and argument name, the path of that
state under the configurable's own (``""``: the same, an `OptaxWrapper`'s optax
transformation's; ``"inner_state"``: `low_precision`'s), and for a list, tuple or dict, each
item's path and how its own items go on. Any other argument tells no path."""


def state_paths_of(function: Any) -> dict[str, tuple[str, Any]]:
  """`function`'s row of `_STATE_PATHS`, or that of what it wraps (``__wrapped__``, or the
  ``optax_factory`` of this package's optimizers), or none.

  Example:
    >>> from t5x_optim import optimizers
    >>> state_paths_of(optimizers.schedule_free)
    {'base_optimizer': ('base_optimizer_state', None)}
  """
  while function is not None:
    if function in _STATE_PATHS:
      return _STATE_PATHS[function]
    function = getattr(function, "optax_factory", getattr(function, "__wrapped__", None))
  return {}


def _number_defaults(function: Any) -> dict[str, Any]:
  """The arguments of `function` (a configurable) whose default is a number or a bool."""
  try:
    parameters = inspect.signature(function).parameters.values()
  except (TypeError, ValueError):  # a builtin without a signature
    return {}
  return {p.name: p.default for p in parameters if isinstance(p.default, bool | int | float)}


def binds_optimizer() -> bool:
  """Whether the parsed config binds the job's optimizer (``cli.TrainJob.optimizer``)."""
  try:
    return job_optimizer() is not None
  except ValueError:  # gin has not met TrainJob: a config parsed without the default one
    return False


def evaluated_argument(argument: OptimizerArgument) -> Any:
  """`argument`'s value as gin would pass it: a macro or ``@configurable()`` evaluated
  in the argument's scope."""
  with gin.config_scope(list(argument.scope)):
    return _evaluated(argument.value)


_WARMED_UP = frozenset({"schedule_free_adamw", "schedule_free_sgd"})
"""The factories (optax's and their wrapped ones) that warm a constant ``learning_rate`` up
from 0 over their ``warmup_steps`` (``optax.warmup_constant_schedule``)."""


def _call_of(argument: OptimizerArgument) -> tuple[str, tuple[str, ...]]:
  """The configurable `argument` is bound for, as its binding names it, and the scope gin
  calls it in: two arguments of one call have the same."""
  selector = argument.binding[: -len(argument.name) - 1]
  return selector.rsplit("/", 1)[-1], argument.scope


def optimizer_learning_rate() -> tuple[Any, str] | None:
  """The learning rate the parsed config binds in the configurables the job's optimizer reaches
  (`optimizer_arguments`).

  Returns ``(value, where)``: a number or a schedule (a function of the
  step), and the binding it comes from; None when no binding, or more than
  one value, is found (an optimizer of several learning rates). A rate bound
  with ``warmup_steps`` in a schedule-free factory (`_WARMED_UP`) is the
  warmup schedule the factory applies.

  Example:
    >>> parse_config(gin_bindings=['optax.adamw.learning_rate = 1e-5'])
    >>> optimizer_learning_rate()
    (1e-05, 'optax.adamw.learning_rate = 1e-05')
  """
  found: dict[Any, tuple[Any, str]] = {}
  arguments = list(optimizer_arguments(stop=_RATES))
  warmups = {_call_of(a): a for a in arguments if a.name == "warmup_steps"}
  for argument in arguments:
    if argument.name not in _RATES:
      continue
    rate = evaluated_argument(argument)
    if rate is None or isinstance(rate, bool):
      continue
    bound = argument.value
    name = _reference_text(bound, depth=0, scope=argument.scope)
    shown = f"@{name}()" if name else repr(rate)
    if isinstance(bound, gin.config.ConfigurableReference):
      if bound.configurable.wrapped is gin.config.macro:
        shown = f"%{bound.scopes[-1]} = {shown}"
    # One configurable called in two scopes gives two rates (``@fast/...``, ``@slow/...``).
    key = _called_identity(bound, argument.scope) or repr(rate)
    where = f"{argument.binding} = {shown}"
    warmup = warmups.get(_call_of(argument))
    steps = None if warmup is None else evaluated_argument(warmup)
    factory = _call_of(argument)[0].rsplit(".", 1)[-1]
    if factory in _WARMED_UP and steps is not None and isinstance(rate, int | float):
      rate = optax.warmup_constant_schedule(0.0, rate, steps)
      where += f", warmed up by optax.warmup_constant_schedule over {warmup.binding} = {steps}"
    found[key] = (rate, where)
  if len(found) != 1:
    return None
  rate, where = next(iter(found.values()))
  if not (callable(rate) or isinstance(rate, (int, float))):
    return None
  return rate, where
