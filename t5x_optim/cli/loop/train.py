"""The training loop of `t5x-optim train`: sharded steps, metrics, eval, checkpoints.

A run lives in its model directory (T5X's convention): checkpoints in
``model_dir/checkpoints``, TensorBoard events in ``model_dir/train`` and
``model_dir/eval``, the operative gin config in ``model_dir/config.gin`` (and
each start's in ``config_<first step>.gin``). A directory with checkpoints is
resumed from its newest intact one, as the same job (`job.identity_problem`);
one whose latest committed checkpoint is at ``total_steps`` is reported
finished.

Example:
  >>> import io, jax, tempfile
  >>> from t5x_optim import optimizers, partitioning
  >>> from t5x_optim.cli.loop.config import TrainJob
  >>> from t5x_optim.cli.loop.interrupt import Interrupt
  >>> from t5x_optim.cli.demo.model import SyntheticTask, TransformerConfig
  >>> mesh = partitioning.create_mesh(devices=jax.devices()[:1])
  >>> job = TrainJob(optimizers.adamw(1e-2), partitioning.Partitioner(mesh),
  ...                model=TransformerConfig(vocab_size=16, num_layers=1, max_length=8),
  ...                task=SyntheticTask(vocab_size=16, length=8, batch_size=4),
  ...                total_steps=3)
  >>> setup = prepare(job)
  >>> setup.abstract_state.params['logits'].shape
  (64, 16)
  >>> summary = train(setup, model_dir=tempfile.mkdtemp(), interrupt=Interrupt(),
  ...                 stream=io.StringIO())
  >>> summary.start_step, summary.end_step, summary.checkpoint_step
  (0, 3, 3)
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import hashlib
import math
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import PartitionSpec

from t5x_optim import (
  MultiOptimizer,
  TrainState,
  leaf_storage,
  loss_extra_args,
  reapply_config,
  schedule_free_evaluation_params,
  storage,
  trained_params,
  trains_lookahead_params,
)
from t5x_optim.checkpoints import Checkpointer, CheckpointError, WriterLock, is_committed_step
from t5x_optim.cli.demo.model import SyntheticTask, TransformerLM, cross_entropy_loss
from t5x_optim.cli.demo.text import TextTask
from t5x_optim.cli.loop import config as config_lib
from t5x_optim.cli.loop.config import TrainJob
from t5x_optim.cli.loop.event_files import write_at_once
from t5x_optim.cli.loop.input import FEATURES, global_batch
from t5x_optim.cli.loop.interrupt import Interrupt
from t5x_optim.cli.loop.job import (
  CONFIG_FILE,
  LostConfig,
  config_changes,
  config_digest,
  config_file_name,
  format_problem,
  identity_problem,
  model_changes,
  recorded_config,
  version_changes,
  x64_problem,
)
from t5x_optim.cli.loop.metrics import EVAL, TRAIN, MetricWriters
from t5x_optim.cli.loop.progress import Clock, Progress, format_metrics
from t5x_optim.cli.loop.summary import TrainSummary
from t5x_optim.cli.loop.weight_metrics import holds_low_precision, metric_tags, metric_vector
from t5x_optim.partitioning import format_bytes

__all__ = [
  "Diverged",
  "INCOMPLETE",
  "Interrupted",
  "LoopFailed",
  "Setup",
  "TrainSummary",
  "UsageError",
  "abstract_batch",
  "agreed_stop",
  "default_model_dir",
  "describe_setup",
  "injected_learning_rates",
  "one_run_at_a_time",
  "plateau_scales",
  "prepare",
  "step_memory",
  "prepare_model_dir",
  "skip_reason",
  "steps_line",
  "steps_seen",
  "train",
]

BATCH_AXES = {"inputs": PartitionSpec("batch"), "targets": PartitionSpec("batch")}
CHECKPOINTS = "checkpoints"
SKIPPED = "skipped_checkpoints"
RUNS_DIR = "t5x_optim_runs"
_SHOWN_PATHS = 3
STEP_CHECKSUMS = Path("checksums") / "checksums.json"
"""Where a step of a t5x-optim run records its arrays' checksums (`t5x_optim.checkpoints`)."""
_SHOWN_STEPS = 4
_REASON_CHARS = 300
INCOMPLETE = "incomplete: its save or copy never completed"
"""Why a checkpoint step that was never committed is skipped."""
_PATH_PROBLEM = re.compile(
  r"(missing key|unexpected key|shape mismatch at|dtype mismatch at) '([^']+)'"
)
_MODEL_PATHS = ("target/", "flax_mutables/")
"""Where a train state's checkpoint holds the model (its params and mutables), not its optimizer."""


class UsageError(ValueError):
  """A request the command cannot satisfy: an unusable model directory or checkpoint."""


class Interrupted(Exception):
  """Ctrl-C or SIGTERM before the first train step; nothing was written."""


class Diverged(Exception):
  """A step's loss, gradient norm or updated params were not finite; the run stopped.

  Attributes:
    step: the step whose update was not finite (or the last of
      ``max_consecutive_skips`` skipped in a row).
    loss: its loss.
    grad_norm: its gradient norm.
    saved: the latest saved step, or None (the run saves nothing when it
      diverges: the state before a divergence is often bad already).
    skipped: whether the job skipped such steps (it stopped after too many).
  """

  def __init__(self, step: int, loss: float, grad_norm: float, *, saved: int | None, skipped: bool):
    self.step, self.loss, self.grad_norm = step, loss, grad_norm
    self.saved, self.skipped = saved, skipped
    super().__init__(self.message())

  def message(self, directory: str = "") -> str:
    """One line: the step, its values, what was saved and what to do."""
    values = f"loss {self.loss}, grad_norm {self.grad_norm}"
    if math.isfinite(self.loss) and math.isfinite(self.grad_norm):
      values += ", the updated params or optimizer state not finite"
    where = f" in {directory}" if directory else ""
    kept = (
      "no checkpoint was written"
      if self.saved is None
      else f"the latest checkpoint is step {self.saved}{where}"
    )
    why = (
      "the loss, gradient norm, updated params or optimizer state stayed non-finite for "
      "cli.TrainJob.max_consecutive_skips steps in a row, up to"
      if self.skipped
      else "the loss, gradient norm, updated params or optimizer state are not finite at"
    )
    advice = "" if self.skipped else " (or skip such steps: --on_nonfinite skip)"
    return f"{why} step {self.step} ({values}); stopped: {kept}; lower the learning rate{advice}."


class LoopFailed(Exception):
  """An exception inside the training loop, after the last finite state was saved, or
  while the checkpointer and event writers open before it (nothing saved then).

  Attributes:
    step: the last step completed.
    error: the exception.
    saved: the latest saved step, or None.
    note: why the state could not be saved on the way out ("" when it was).
  """

  def __init__(self, step: int, error: BaseException, *, saved: int | None, note: str):
    self.step, self.error, self.saved, self.note = step, error, saved, note
    super().__init__(f"step {step}: {type(error).__name__}: {error}")


def default_model_dir(base: Path | None = None) -> Path:
  """A fresh ``t5x_optim_runs/<date>-<time>`` under `base` (the current directory).

  Example:
    >>> default_model_dir(Path('/tmp')).parent
    PosixPath('/tmp/t5x_optim_runs')
  """
  runs = (Path.cwd() if base is None else base) / RUNS_DIR
  stamp = time.strftime("%Y%m%d-%H%M%S")
  candidate, n = runs / stamp, 1
  while candidate.exists():
    n += 1
    candidate = runs / f"{stamp}-{n}"
  return candidate


def steps_seen(directory: Path) -> str:
  """The checkpoint steps in a run's `directory` (``<model_dir>/checkpoints``), as one line
  (`steps_line`).

  What the processes of a job compare before the first step (`_processes.agree`):
  each host reads its own view of the model directory, and processes that see
  other steps (a host-local path, a relative one from another working
  directory) would restore different states, or one would start afresh.

  Example:
    >>> import tempfile
    >>> run = Path(tempfile.mkdtemp())
    >>> steps_seen(run / 'checkpoints')
    'none'
    >>> for step in (4, 20): (run / 'checkpoints' / str(step)).mkdir(parents=True)
    >>> steps_seen(run / 'checkpoints')
    'steps 4, 20'
  """
  names = [path.name for path in directory.iterdir()] if directory.is_dir() else []
  return steps_line(sorted(int(name) for name in names if name.isdigit()))


def steps_line(steps: Sequence[int]) -> str:
  """Ascending checkpoint steps as one line: each of a few, else their count, ends and digest.

  Example:
    >>> steps_line([]), steps_line([2]), steps_line(range(10, 60, 10))
    ('none', 'step 2', '5 steps, 10 to 50 (digest 88b7e79a7728)')
  """
  if len(steps) <= _SHOWN_STEPS:
    return f"step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))}" if steps else "none"
  digest = hashlib.sha256(",".join(map(str, steps)).encode()).hexdigest()[:12]
  return f"{len(steps)} steps, {steps[0]} to {steps[-1]} (digest {digest})"


def prepare_model_dir(path: Path) -> Path:
  """Creates `path` if needed and checks that a run can write there.

  A path with a scheme (``gs://bucket/run``) stays one (an `epath.Path`);
  its bucket and credentials are checked first.

  Raises:
    UsageError: `path`, or a directory a run keeps in it (``checkpoints``,
      ``train``, ``eval``, ``skipped_checkpoints``), is a file; `path` is (in)
      a committed checkpoint step of a run (`_committed_step_around`); `path`
      cannot be created or is not writable; its bucket, credentials or
      scheme's package are missing (one line).

  Example:
    >>> import tempfile
    >>> prepare_model_dir(Path(tempfile.mkdtemp()) / 'run').is_dir()
    True
  """
  try:
    path = storage.check_reachable(path)
  except storage.StorageError as error:
    raise UsageError(f"--model_dir {error}") from error
  step = _committed_step_around(path)
  if step is not None and is_committed_step(step):
    raise UsageError(
      f"--model_dir {path} is inside {step}, step {step.name} of the run in "
      f"{step.parent.parent}, whose rotation would delete a run there; to start from that "
      f"step, use --init_from {step} with a --model_dir outside it."
    )
  if step is not None:
    raise UsageError(
      f"--model_dir {path} is inside {step}, the directory of step {step.name} still to come "
      f"of the run in {step.parent.parent}, which sets it aside, whole, as an incomplete "
      f"checkpoint when it saves that step; use a --model_dir outside {step.parent}."
    )
  if path.exists() and not path.is_dir():
    raise UsageError(f"--model_dir {path} is a file, not a directory.")
  for name in (CHECKPOINTS, TRAIN, EVAL, SKIPPED):
    if (path / name).exists() and not (path / name).is_dir():
      raise UsageError(f"--model_dir {path}: {path / name} is a file, not a directory.")
  try:
    path.mkdir(parents=True, exist_ok=True)
    probe = path / f".t5x_optim_write_probe.{os.getpid()}"
    probe.write_bytes(b"")
    probe.unlink()
  except OSError as error:
    raise UsageError(f"--model_dir {path} is not usable: {error.strerror or error}.") from error
  return path


def _committed_step_around(path: storage.AnyPath) -> storage.AnyPath | None:
  """The checkpoint step of a run that `path` is (or is in), local or on an object store, or None.

  That is a numbered directory in a ``checkpoints`` directory that holds
  orbax's record of a completed save (`is_committed_step`), what a run's
  rotation deletes, or that is a step still to come of a t5x-optim run: its
  ``checkpoints`` directory holds a committed step that records the run's
  checksums (`STEP_CHECKSUMS`) and its ``config.gin`` lies beside it (the run
  sets an incomplete step aside when it saves there). A numbered directory
  elsewhere (made beforehand, a folder of years, beside a checkpoint
  copied from another framework) is no step a run keeps. A local `path` is
  resolved first (its links followed).

  Example:
    >>> import tempfile
    >>> run = Path(tempfile.mkdtemp())
    >>> (run / 'checkpoints' / '5').mkdir(parents=True)
    >>> _committed_step_around(run / 'checkpoints' / '5' / 'run') is None
    True
    >>> (run / 'checkpoints' / '5' / 'commit_success.txt').write_text('')
    0
    >>> _committed_step_around(run / 'checkpoints' / '5' / 'run') == run / 'checkpoints' / '5'
    True
  """
  resolved = path if storage.is_object_store(path) else path.resolve()
  for directory in (resolved, *resolved.parents):
    if directory.name.isdigit() and directory.parent.name == CHECKPOINTS:
      if is_committed_step(directory) or (
        (directory.parent.parent / "config.gin").is_file()
        and directory.parent.is_dir()
        and any(
          is_committed_step(step) and (step / STEP_CHECKSUMS).is_file()
          for step in directory.parent.iterdir()
          if step.name.isdigit()
        )
      ):
        return directory
  return None


def _is_spec(x: Any) -> bool:
  return x is None or isinstance(x, PartitionSpec)


def _create_fn(job: TrainJob, model: TransformerLM) -> Callable[..., TrainState]:
  """`(key, tokens) -> TrainState`; for lookahead the params are fast and slow copies."""
  lookahead = trains_lookahead_params(job.optimizer)

  def create(key: jax.Array, tokens: jax.Array) -> TrainState:
    variables = model.init(key, tokens)
    if not lookahead:
      return TrainState.create(job.optimizer, variables)
    specs = nn.get_partition_spec(variables)["params"]
    params = optax.LookaheadParams.init_synced(nn.meta.unbox(variables["params"]))
    both = optax.LookaheadParams(fast=specs, slow=specs)
    return TrainState(
      _optimizer=job.optimizer.create(params),
      param_axis_leaves=tuple(jax.tree.leaves(both, is_leaf=_is_spec)),
    )

  return create


def _train_step(
  model: TransformerLM,
  learning_rate: Any,
  state: TrainState,
  batch: dict[str, Any],
  *,
  weights: bool = False,
  shardings: TrainState | None = None,
  skip: bool = False,
) -> Any:
  """One update; the metrics are the loss, the gradient norm, the learning rate (and
  reduce_on_plateau's ``lr_scale``) and ``finite`` (whether the loss, the gradient
  norm and the updated params are, and the updated optimizer state holds no NaN), and
  with `weights` the per-parameter metrics
  (`metric_vector`, reduced with one all-reduce given the state's `shardings`) under
  ``weights``. An optimizer that takes optax's extra arguments gets them of the batch's
  loss (`loss_extra_args`).

  The learning rate is that of the optimizer's latest update: this step's, or where
  the step only accumulates a gradient (``optax.MultiSteps``) the update's before it
  (before the first update, the first's), whether the optimizer state holds it
  (``inject_hyperparams``) or `learning_rate` gives it.

  A step that is not finite returns the state it was given: its step counter
  advanced when `skip`, else unchanged. A non-finite update never reaches the
  state.
  """

  def loss_fn(params: Any) -> jax.Array:
    return cross_entropy_loss(model.apply({"params": params}, batch["inputs"]), batch["targets"])

  loss, grads = jax.value_and_grad(loss_fn)(trained_params(state.params))
  grad_norm = optax.tree.norm(grads)
  metrics = {"loss": loss, "grad_norm": grad_norm}
  names = getattr(state.optimizer.optimizer_def, "extra_arg_names", ())
  updated = state.apply_gradient(grads, **loss_extra_args(names, loss, grads, loss_fn))
  if learning_rate is not None:
    # The schedule's own count of updates made (behind the step under optax.MultiSteps or
    # after skipped steps): the latest update read it one before, the first at 0.
    counts = schedule_counts(updated.param_states)
    at = jnp.maximum(counts[0] - 1, 0) if counts else state.step
    rate = learning_rate(at) if callable(learning_rate) else learning_rate
    metrics["learning_rate"] = jnp.asarray(rate, jnp.float32)
  # An optimizer state may hold an infinity by design (reduce_on_plateau's best loss before
  # its first check), never a NaN.
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & _all_floats(jnp.isfinite, updated.params)
  finite &= _all_floats(lambda x: ~jnp.isnan(x), updated.param_states)
  metrics["finite"] = finite
  new_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), updated, state)
  if skip:
    new_state = new_state.replace_step(updated.step)
  injected = injected_learning_rates(updated.param_states)
  if len(injected) == 1:  # What the optimizer used in its latest update.
    metrics["learning_rate"] = jnp.asarray(injected[0], jnp.float32)
  scales = plateau_scales(updated.param_states)
  if len(scales) == 1:  # reduce_on_plateau's scale of this step's updates.
    metrics["lr_scale"] = jnp.asarray(scales[0], jnp.float32)
  if weights:
    metrics["weights"] = metric_vector(
      trained_params(state.params),
      trained_params(new_state.params),
      grads,
      new_state.param_states,
      param_shardings=None if shardings is None else trained_params(shardings.params),
      state_shardings=None if shardings is None else shardings.param_states,
    )
  return new_state, metrics


def _all_floats(holds: Callable[[jax.Array], jax.Array], tree: Any) -> jax.Array:
  """Whether `holds` is true of every element of every floating array of `tree` (one fused
  reduction per leaf)."""
  flags = [jnp.all(holds(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
  return functools.reduce(jnp.logical_and, flags, jnp.bool_(True))


def injected_learning_rates(param_states: Any) -> list[Any]:
  """The ``learning_rate`` of every ``inject_hyperparams`` state in an optimizer state,
  those of a `MultiOptimizer`'s sub-optimizers included.

  Such a state holds the value its optimizer used in the last update.

  Example:
    >>> import jax.numpy as jnp
    >>> tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.5)
    >>> injected_learning_rates(tx.init({'w': jnp.ones(2)}))
    [Array(0.5, dtype=float32)]
  """
  found: list[Any] = []

  def visit(node: Any) -> None:
    hyperparams = getattr(node, "hyperparams", None)
    if isinstance(hyperparams, dict) and "learning_rate" in hyperparams:
      found.append(hyperparams["learning_rate"])
    if isinstance(node, tuple):
      for child in node:
        visit(child)
    elif isinstance(node, dict):
      for child in node.values():
        visit(child)
    elif dataclasses.is_dataclass(node) and not isinstance(node, type):
      for field in dataclasses.fields(node):  # a MultiOptimizer's state per sub-optimizer
        visit(getattr(node, field.name))

  visit(param_states)
  return found


_SCHEDULE_STATES = (
  optax.ScaleByScheduleState,
  optax.contrib.ProdigyState,
  optax.contrib.DAdaptAdamWState,
  optax.contrib.MomoState,
  optax.contrib.MomoAdamState,
  optax.contrib.MadgradState,
)
"""The optax states whose ``count`` their optimizer calls its learning-rate schedule at:
``scale_by_schedule``'s, and those of the optimizers that call it in their own update."""


def schedule_counts(param_states: Any) -> list[Any]:
  """The ``count`` of every state in an optimizer state that its learning-rate schedule is
  read at for the next update (``optax.scale_by_schedule``'s, and prodigy's, dadapt_adamw's,
  momo's and madgrad's own state's).

  Example:
    >>> import jax.numpy as jnp
    >>> tx = optax.MultiSteps(optax.adam(optax.linear_schedule(1.0, 0.0, 10)), 4)
    >>> schedule_counts(tx.init({'w': jnp.ones(2)}))
    [Array(0, dtype=int32)]
  """
  return [node.count for node in _nodes(param_states, _SCHEDULE_STATES)]


def plateau_scales(param_states: Any) -> list[Any]:
  """The ``scale`` of every ``optax.contrib.reduce_on_plateau`` state in an optimizer state:
  the factor it multiplied the last updates by.

  Example:
    >>> import jax.numpy as jnp
    >>> tx = optax.chain(optax.sgd(0.1), optax.contrib.reduce_on_plateau())
    >>> plateau_scales(tx.init({'w': jnp.ones(2)}))
    [Array(1., dtype=float32)]
  """
  return [node.scale for node in _plateau_states(param_states)]


def _plateau_states(param_states: Any) -> list[optax.contrib.ReduceLROnPlateauState]:
  """Every ``optax.contrib.reduce_on_plateau`` state in an optimizer state."""
  return _nodes(param_states, optax.contrib.ReduceLROnPlateauState)


def _nodes(param_states: Any, kind: type | tuple[type, ...]) -> list[Any]:
  """Every node of class `kind` (or of one of the classes) in an optimizer state, in tree
  order."""
  return [
    node
    for node in jax.tree.leaves(param_states, is_leaf=lambda x: isinstance(x, kind))
    if isinstance(node, kind)
  ]


def _eval_loss(model: TransformerLM, params: Any, batch: dict[str, Any]) -> jax.Array:
  return cross_entropy_loss(model.apply({"params": params}, batch["inputs"]), batch["targets"])


@dataclasses.dataclass(frozen=True)
class Setup:
  """A job made ready to run: the model, the abstract state and the jitted functions.

  Attributes:
    job: the job.
    model: the transformer.
    init_args: the create function's arguments (a key and a token batch).
    create: `(key, tokens) -> TrainState`, jitted into the shardings.
    abstract_state: the train state as sharded `jax.ShapeDtypeStruct`s.
    step_fn: `(state, batch) -> (state, metrics)`, jitted; the metrics are
      ``loss``, ``grad_norm``, ``finite`` (of those and of the updated params),
      ``learning_rate`` (the one the optimizer state holds, else the job's when it names
      one; none where the state holds several) and ``lr_scale`` (reduce_on_plateau's, when
      the optimizer holds one). A step that is not finite leaves the state as it
      was (see `_train_step`).
    eval_fn: `(params, batch) -> loss`, jitted (params: the trained copy).
    batch_sharding: how a batch's rows shard over the mesh.
    weights_step_fn: `step_fn` that also returns the per-parameter metrics
      under ``weights``, a vector (None when ``metrics_every`` is 0).
  """

  job: TrainJob
  model: TransformerLM
  init_args: tuple[Any, ...]
  create: Any
  abstract_state: TrainState
  step_fn: Any
  eval_fn: Any
  batch_sharding: Any = None
  weights_step_fn: Any = None

  @functools.cached_property
  def weight_tags(self) -> list[str]:
    """The tags of the ``weights`` vector of `weights_step_fn`."""
    state = self.abstract_state
    return metric_tags(trained_params(state.params), state.param_states)

  def train_batch(self, step: int) -> dict[str, jax.Array]:
    """The global batch of `step`; this process reads only its devices' rows."""
    task = self.job.task
    return global_batch(
      lambda rows: task.batch(step, rows), self.batch_sharding, (task.batch_size, task.length)
    )

  def eval_batch(self, index: int) -> dict[str, jax.Array]:
    """Held-out global batch `index`, read like `train_batch`."""
    task = self.job.task
    return global_batch(
      lambda rows: task.eval_batch(index, rows),
      self.batch_sharding,
      (task.batch_size, task.length),
    )


def _abstract(job: TrainJob, create: Callable[..., TrainState], args: tuple[Any, ...]) -> Any:
  partitioner = job.partitioner
  with jax.set_mesh(partitioner.mesh), nn.logical_axis_rules(tuple(partitioner.logical_axis_rules)):
    abstract = jax.eval_shape(create, *args)
  shardings = partitioner.get_shardings(abstract)
  return jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings
  )


def abstract_batch(task: SyntheticTask | TextTask) -> dict[str, jax.ShapeDtypeStruct]:
  """The shapes and dtypes of ``task``'s batches (`Setup.train_batch`'s and `Setup.eval_batch`'s),
  from its fields, without reading one: every feature int32 ``(batch_size, length)``.

  Example:
    >>> from t5x_optim.cli.demo.model import SyntheticTask
    >>> abstract_batch(SyntheticTask(vocab_size=1 << 18, length=8, batch_size=4))['targets']
    ShapeDtypeStruct(shape=(4, 8), dtype=int32)
  """
  shape = (task.batch_size, task.length)
  return {name: jax.ShapeDtypeStruct(shape, jnp.int32) for name in FEATURES}


def step_memory(setup: Setup) -> dict[str, Any]:
  """XLA's memory analysis of the largest train step the run compiles, in bytes per device.

  ``peak`` is what the step holds at once: its arguments (params, optimizer
  state, batch), outputs and temporaries, less the outputs that reuse a
  donated argument's buffer. A run of at least ``metrics_every`` steps also
  runs a step that computes the per-parameter metrics (every ``metrics_every``
  steps), whose peak may be the larger; ``steps`` says which steps it is.
  Compiles the steps; allocates nothing.
  """
  batch = abstract_batch(setup.job.task)
  largest: dict[str, Any] = {}
  steps = [(setup.step_fn, "every step")]
  every = setup.job.metrics_every
  if setup.weights_step_fn is not None and every <= setup.job.total_steps:
    steps.append((setup.weights_step_fn, f"the steps with per-parameter metrics (every {every})"))
  for step_fn, which in steps:
    m = step_fn.lower(setup.abstract_state, batch).compile().memory_analysis()
    out = {
      "arguments": m.argument_size_in_bytes,
      "outputs": m.output_size_in_bytes,
      "temporaries": m.temp_size_in_bytes,
      "aliased": m.alias_size_in_bytes,
    }
    out["peak"] = out["arguments"] + out["outputs"] + out["temporaries"] - out["aliased"]
    if out["peak"] > largest.get("peak", -1):
      largest = out | {"steps": which}
  return largest


def prepare(job: TrainJob) -> Setup:
  """Derives the shardings and traces one step, without allocating the state.

  Tracing here surfaces configuration errors (e.g. a hyper-parameter of the
  wrong type) before anything is initialised or compiled.

  Raises:
    ValueError: the step cannot be traced (the optimizer is misconfigured),
      or a param or state leaf does not fit the mesh.
  """
  model = TransformerLM(job.model)
  init_args = (jax.random.key(job.seed), jnp.zeros((1, job.task.length), jnp.int32))
  create_fn = _create_fn(job, model)
  abstract = _abstract(job, create_fn, init_args)
  shardings = jax.tree.map(lambda x: x.sharding, abstract)
  partitioner = job.partitioner
  # Rates the optimizer state holds are the ones used: one is logged, several none.
  rate = None if injected_learning_rates(abstract.param_states) else job.learning_rate

  def partitioned_step(weights: bool) -> Any:
    step = functools.partial(
      _train_step,
      model,
      rate,
      weights=weights,
      shardings=shardings,
      skip=job.on_nonfinite == "skip",
    )
    return partitioner.partition(step, (shardings, BATCH_AXES), (shardings, None), donate_argnums=0)

  step_fn = partitioned_step(weights=False)
  weights_step_fn = partitioned_step(weights=True) if job.metrics_every else None
  param_shardings = trained_params(shardings.params)
  eval_fn = partitioner.partition(
    lambda params, batch: _eval_loss(model, params, batch), (param_shardings, BATCH_AXES), None
  )
  try:
    step_fn.lower(abstract, abstract_batch(job.task))
  except (TypeError, ValueError) as error:
    names = getattr(job.optimizer, "extra_arg_names", ())
    given = sorted(loss_extra_args(names, None, None, lambda params: None))
    others = sorted(set(names) - set(given))
    raise ValueError(
      f"Tracing one train step failed, so the optimizer is misconfigured (e.g. a "
      f"hyper-parameter of the wrong type): {type(error).__name__}: {error}"
      + (
        f"; of the extra arguments it takes, the train step gives those of optax's that come "
        f"from the loss ({', '.join(given) or 'none'}), not {', '.join(others)}."
        if others
        else ""
      )
    ) from error
  create = partitioner.partition(create_fn, None, shardings)
  batch_sharding = partitioner.mesh_sharding(BATCH_AXES["inputs"])
  return Setup(
    job, model, init_args, create, abstract, step_fn, eval_fn, batch_sharding, weights_step_fn
  )


def _leaf_bytes_per_device(leaf: jax.ShapeDtypeStruct) -> int:
  return math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize


def describe_setup(
  setup: Setup, *, devices: str, optimizer: str, learning_rate: str | None = None
) -> list[str]:
  """The run's description: devices, mesh, optimizer, params, optimizer-state bytes,
  and where the logged learning rate comes from.

  Args:
    setup: from `prepare`.
    devices: how the devices are described (e.g. ``8 x cpu (simulated)``).
    optimizer: the optimizer's description (from its gin config).
    learning_rate: where ``job.learning_rate`` comes from (a gin binding);
      the optimizer state, where it holds the rate, takes precedence.
  """
  abstract = setup.abstract_state
  mesh = setup.job.partitioner.mesh
  params = trained_params(abstract.params)
  num_params = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
  states = jax.tree.leaves(abstract.param_states)
  per_device = sum(_leaf_bytes_per_device(x) for x in states)
  total = sum(math.prod(x.shape) * x.dtype.itemsize for x in states)
  mesh_text = " x ".join(f"{name}={size}" for name, size in mesh.shape.items())
  copies = " (lookahead: fast and slow copies)" if params is not abstract.params else ""
  return [
    f"devices:         {devices}",
    f"mesh:            {mesh_text}",
    f"optimizer:       {optimizer}",
    f"params:          {num_params:,}{copies}",
    f"optimizer state: {format_bytes(per_device)} per device "
    f"({format_bytes(total)} in all, ideal {format_bytes(total / mesh.size)} per device)",
    f"learning rate:   {_rate_source(setup, learning_rate)}",
    *_state_precision(setup),
  ]


def _state_precision(setup: Setup) -> list[str]:
  """The params whose optimizer state each low-precision choice holds, and why.

  Empty without a `low_precision` state; ``t5x-optim plan`` lists it leaf by leaf.
  """
  from t5x_optim.partitioning import build_plan  # noqa: PLC0415 - a plan only for this line

  abstract = setup.abstract_state
  if not holds_low_precision(abstract.param_states):
    return []
  plan = build_plan(abstract, logical=abstract.as_logical_axes())
  choices: dict[str, set[str]] = {}
  for row in plan.rows:
    if row.storage and row.param is not None:
      choices.setdefault(_choice(row.storage), set()).add(row.param)
  if not choices:
    return []
  parts = []
  for choice, params in sorted(choices.items(), key=lambda item: (-len(item[1]), item[0])):
    named = f": {', '.join(sorted(params))}" if len(params) <= 3 else ""
    parts.append(f"{choice} for {len(params)} param{'s' * (len(params) != 1)}{named}")
  return [f"state precision: {'; '.join(parts)}"]


def _choice(storage: str) -> str:
  """A state leaf's mode and why, without the field of a quantized leaf.

  Example:
    >>> _choice("4bit codes (param_modes 'axis:mlp')"), _choice("float32: below min_size")
    ("4bit (param_modes 'axis:mlp')", 'float32: below min_size')
  """
  return re.sub(r"^(\w+) (codes|scales|cols)\b", r"\1", storage)


def _rate_source(setup: Setup, where: str | None) -> str:
  """Where the logged learning rate comes from."""
  injected = len(injected_learning_rates(setup.abstract_state.param_states))
  if injected == 1:
    return "read from the optimizer state (inject_hyperparams' learning_rate) after each step"
  if injected:
    return f"not logged (the optimizer state holds {injected} inject_hyperparams' learning rates)"
  if setup.job.learning_rate is None:
    return "not logged (the optimizer binds no single learning rate)"
  kind = (
    "a schedule, at its optimizer's count" if callable(setup.job.learning_rate) else "a constant"
  )
  return f"{where or 'cli.TrainJob.learning_rate'} ({kind})"


def _resume_advice(model_dir: Path, *, another_model: bool) -> str:
  """Why a run did not resume and what may start from its checkpoint: ``--init_from`` where
  the optimizer or its state's layout differs, nothing where the model does (`another_model`):
  ``--init_from`` starts a run of the same model."""
  fits = (
    f"a run resumes only with the model, optimizer and optimizer-state layout it started "
    f"with (its config: {model_dir / CONFIG_FILE})"
  )
  if another_model:
    return (
      f"{fits}; its checkpoint cannot start a run of another model: give the model it has, "
      "or train this one in another --model_dir"
    )
  return (
    f"{fits}; to start from its checkpoint with another, pass --init_from {model_dir} and a "
    "new --model_dir"
  )


def _mismatch_message(error: Exception, step: int, model_dir: Path) -> str:
  """A bounded description of a checkpoint that does not fit the model."""
  text = " ".join(str(error).split())
  paths = _PATH_PROBLEM.findall(text)
  advice = _resume_advice(
    model_dir, another_model=any(path.startswith(_MODEL_PATHS) for _, path in paths)
  )
  if not paths:
    short = text if len(text) <= 300 else text[:300] + "..."
    return f"the checkpoint at step {step} cannot be restored: {short}; {advice}."
  counts: dict[str, int] = {}
  for kind, _ in paths:
    counts[kind.split()[0]] = counts.get(kind.split()[0], 0) + 1
  kinds = ", ".join(f"{n} {kind}" for kind, n in counts.items())
  first = ", ".join(f"{kind.split()[0]} {path}" for kind, path in paths[:_SHOWN_PATHS])
  return (
    f"the checkpoint at step {step} does not fit this model: {len(paths)} paths differ "
    f"({kinds}), first: {first}; {advice}."
  )


def skip_reason(error: Exception) -> str:
  """Why a checkpoint step is skipped: ``error``'s message on one line, at most 300 characters."""
  text = " ".join(str(error).split())
  return text if len(text) <= _REASON_CHARS else text[:_REASON_CHARS] + "..."


@dataclasses.dataclass
class _Resume:
  """What a model directory's checkpoints give a new start."""

  state: TrainState | None = None
  step: int | None = None
  recorded: dict[str, Any] | None = None
  skipped: list[tuple[int, str]] = dataclasses.field(default_factory=list)


def _configured_constants(state: TrainState) -> TrainState:
  """`state` with the settings its optimizer state keeps (Muon's ``ns_coeffs``, schedule-free's
  ``b1``, ``inject_hyperparams``' constants: `reapply_config`) as the config gives them now:
  the update reads them in the state, so a resume restored the old values (a change was
  reported and not used)."""
  grads = jax.tree.map(jnp.zeros_like, trained_params(state.params))
  names = getattr(state.optimizer.optimizer_def, "extra_arg_names", ())
  extra = loss_extra_args(names, jnp.float32(0), grads, lambda p: optax.tree.norm(p, squared=True))
  return state.replace(_optimizer=reapply_config(state.optimizer, grads, **extra))


def _refuse_another_job(
  recorded: Mapping[str, Any] | None,
  job: Mapping[str, Any] | None,
  model_dir: Path,
  step: int,
  abstract_state: TrainState | None = None,
) -> None:
  """Refuses checkpoint `step`, whose job record is `recorded`, when a newer version wrote it,
  another ``jax_enable_x64`` did (`job.x64_problem`) or it is another job than `job`
  (`job.identity_problem`); a refusal over a low_precision
  leaf of `abstract_state` that earlier versions compressed (`_kept_since_earlier_versions`) says why.

  Raises:
    UsageError: naming the step and what differs.
  """
  written_by = recorded and format_problem(recorded)
  if written_by:
    raise UsageError(
      f"--model_dir {model_dir}: its checkpoint step {step} was written by {written_by}; "
      "nothing was changed: resume it with that version, or use another --model_dir."
    )
  x64 = recorded and job and x64_problem(recorded, job)
  if x64:
    raise UsageError(
      f"--model_dir {model_dir}: its checkpoint step {step} {x64}; nothing was changed: set "
      f"it as the run had it (JAX_ENABLE_X64={int(recorded['jax_enable_x64'])})."
    )
  if recorded is not None and job is not None:
    problem = identity_problem(recorded, job)
    if problem and _recorded_by_an_earlier_version(recorded, job):
      problem = identity_problem(recorded, {**job, "optimizer": recorded["optimizer"]})
    if problem:
      another_model = bool(model_changes(recorded.get("model", {}), job.get("model", {})))
      kept = {} if abstract_state is None else _kept_since_earlier_versions(abstract_state)
      what = next((what for path, what in kept.items() if f" {path} is " in problem), None)
      earlier = (
        f" (this version keeps {what}; earlier versions compressed it, and their "
        "checkpoints resume only with the version that wrote them)"
        if what
        else ""
      )
      raise UsageError(
        f"--model_dir {model_dir} holds another job: at its checkpoint step {step} "
        f"{problem}{earlier}; {_resume_advice(model_dir, another_model=another_model)}."
      )


def _recorded_by_an_earlier_version(recorded: Mapping[str, Any], job: Mapping[str, Any]) -> bool:
  """Whether `recorded`, a record without ``optimizer_naming`` (`job.OPTIMIZER_NAMING`),
  names `job`'s optimizer as an earlier version did (`config.earlier_optimizer_identities`:
  a dict of optimizers left out, ``%OPTIMIZER`` named where the job bound its own); such a
  record cannot tell what the dict held, or what trained, and is taken for the job's."""
  earlier = recorded.get("optimizer")
  if "optimizer_naming" in recorded or earlier == job.get("optimizer"):
    return False
  return earlier in config_lib.earlier_optimizer_identities()


_KEPT_SINCE_EARLIER_VERSIONS = {
  "kept: a copy of its param": (
    "a low_precision state leaf that copies the params, such as schedule-free's z, in its own dtype"
  ),
  "a gradient accumulator": (
    "optax.MultiSteps's sum of gradients inside low_precision in its own dtype unless "
    "states= names it"
  ),
  "kept: GaLore projector (a basis, not a moment)": (
    "GaLore's projector inside low_precision in its own dtype, whatever its shape"
  ),
  "kept: L-BFGS's last params or updates (a curvature pair's end, not a moment)": (
    "L-BFGS's last params and updates inside low_precision in their own dtype"
  ),
  "kept: a line search's gradient (the next step's, not a moment)": (
    "a line search's gradient inside low_precision in its own dtype"
  ),
  "kept: MADGRAD's sum of gradients (the params' offset from x0, not a moment)": (
    "MADGRAD's sum of gradients inside low_precision in its own dtype"
  ),
  "kept: COCOB's reward (the wealth it bets, not a moment)": (
    "COCOB's reward inside low_precision in its own dtype"
  ),
}
"""`leaf_storage` labels (or their ends) of the leaves earlier versions compressed, and
what they are, in a refusal's words."""


def _kept_since_earlier_versions(abstract_state: TrainState) -> dict[str, str]:
  """The state-dict paths (below ``param_states``) of the low_precision leaves that this
  version keeps and earlier versions compressed, and what each is
  (`_KEPT_SINCE_EARLIER_VERSIONS`)."""
  return {
    "/".join(path): what
    for path, kind in leaf_storage(abstract_state.param_states).items()
    for label, what in _KEPT_SINCE_EARLIER_VERSIONS.items()
    if kind == label or kind.endswith(f": {label}")
  }


def _resume(setup: Setup, reader: Checkpointer, model_dir: Path, job: Any) -> _Resume:
  """Restores the newest intact checkpoint that the job may resume from.

  Steps whose directory was never committed (an interrupted save or copy)
  and steps whose data are corrupt are skipped, newest first.

  Raises:
    UsageError: the checkpoint was written by another job (model, optimizer,
      state layout) or by a newer version, or no checkpoint is intact.
  """
  resume = _Resume()
  for step in reversed(reader.all_steps()):
    if not reader.is_committed(step):
      resume.skipped.append((step, INCOMPLETE))
      continue
    try:
      recorded = reader.recorded_job(step)
    except CheckpointError as error:
      resume.skipped.append((step, skip_reason(error)))
      continue
    _refuse_another_job(recorded, job, model_dir, step, setup.abstract_state)
    try:
      resume.state = reader.restore(setup.abstract_state, step)
    except CheckpointError as error:
      resume.skipped.append((step, skip_reason(error)))
      continue
    except (ValueError, FileNotFoundError) as error:
      raise UsageError(_mismatch_message(error, step, model_dir)) from error
    stalled = _dropped_accumulation(setup.job.optimizer, resume.state) or _stalled_plateau(
      setup.job.optimizer, resume.state
    )
    if stalled:
      raise UsageError(
        f"--model_dir {model_dir}: its checkpoint step {step} {stalled[0]}; nothing was "
        f"changed: resume with the {stalled[1]} it was saved with until then, then change it."
      )
    resume.step, resume.recorded = step, recorded
    return resume
  if resume.skipped:
    steps = "; ".join(f"step {step}: {why}" for step, why in resume.skipped)
    raise UsageError(
      f"--model_dir {model_dir} holds no intact checkpoint ({steps}); nothing was changed: "
      "move its checkpoints away to start afresh there, or use another --model_dir."
    )
  return resume


def _optax_parts(optimizer: Any, param_states: Any) -> list[tuple[Any, Any]]:
  """`optimizer`'s optax transformation (None without one) and its `param_states`; for a
  `MultiOptimizer`, each sub-optimizer's, nested ones included."""
  if not isinstance(optimizer, MultiOptimizer):
    return [(getattr(optimizer, "optax_optimizer", None), param_states)]
  return [
    part
    for sub, sub_state in zip(optimizer.sub_optimizers, param_states, strict=True)
    for part in _optax_parts(sub, sub_state.param_states)
  ]


def _dropped_accumulation(optimizer: Any, state: TrainState) -> tuple[str, str] | None:
  """What a restored `optax.MultiSteps` state accumulated that `optimizer` (or one of a
  `MultiOptimizer`'s sub-optimizers) would drop, and the setting that drops it, or None.

  A step saved between two updates holds ``mini_step`` gradients accumulated
  towards the next. optax counts mini-steps modulo the current
  ``every_k_schedule``, so a schedule now at or below that count never
  applies them: the next update starts afresh, or weighs them as one. The
  MultiSteps is found nested in the transformation (`_reachable`);
  checked where an optimizer (a sub-optimizer) holds one, against each
  MultiSteps state of its state.
  """
  for transformation, param_states in _optax_parts(optimizer, state.param_states):
    multi_steps = [
      node for node in _reachable(transformation) if isinstance(node, optax.MultiSteps)
    ]
    if len(multi_steps) != 1:
      continue
    for node in _nodes(param_states, optax.MultiStepsState):
      accumulated = int(node.mini_step)
      # MultiSteps exposes no accessor for its schedule (an int is kept as a constant function).
      every = int(multi_steps[0]._every_k_schedule(int(node.gradient_step)))
      if accumulated >= every:
        return (
          f"holds {accumulated} gradients that optax.MultiSteps accumulated towards its next "
          f"update, which every_k_schedule {every} now would never apply",
          "every_k_schedule",
        )
  return None


def _stalled_plateau(optimizer: Any, state: TrainState) -> tuple[str, str] | None:
  """What a restored ``optax.contrib.reduce_on_plateau`` state counted that `optimizer` (or
  one of a `MultiOptimizer`'s sub-optimizers) would never act on, and the setting that
  stalls it, or None.

  reduce_on_plateau checks the loss when its ``count`` of losses equals
  ``accumulation_size``, and reduces the scale when its ``plateau_count``
  equals ``patience``; a setting now at or below the count saved is never
  met (until an improvement resets ``plateau_count``). Checked where an
  optimizer (a sub-optimizer) holds one reduce_on_plateau and its state one
  such state.
  """
  for transformation, param_states in _optax_parts(optimizer, state.param_states):
    settings = _plateau_settings(transformation)
    nodes = _plateau_states(param_states)
    if len(settings) == 1 and len(nodes) == 1:
      stalled = _plateau_stall(settings[0], nodes[0])
      if stalled:
        return stalled
  return None


def _plateau_stall(
  setting: dict[str, Any], node: optax.contrib.ReduceLROnPlateauState
) -> tuple[str, str] | None:
  """What `node` counted that reduce_on_plateau's `setting` would never act on, and the
  setting's name, or None."""
  checks = (
    (
      "accumulation_size",
      int(node.count),
      "holds the average of {count} losses that {what} accumulates towards its next check, "
      "which accumulation_size {value} now would never make (it checks when its count equals "
      "it)",
    ),
    (
      "patience",
      int(node.plateau_count),
      "holds a count of {count} checks without improvement of {what}, which patience {value} "
      "now would never act on until the loss improves (it reduces the scale when its count "
      "equals it)",
    ),
  )
  for name, count, text in checks:
    value = setting.get(name)
    if isinstance(value, int) and count >= value > 0:
      return text.format(count=count, value=value, what="optax.contrib.reduce_on_plateau"), name
  return None


def _plateau_settings(transformation: Any) -> list[dict[str, Any]]:
  """The ``accumulation_size`` and ``patience`` of each ``optax.contrib.reduce_on_plateau``
  in `transformation`, nested in it (`_reachable`).

  optax keeps them nowhere but in the closures of reduce_on_plateau's functions (the
  patience in those of its ``_update_scale``), so they are read from there.
  """
  found = []
  for node in _reachable(transformation):
    if getattr(node, "__qualname__", None) == "reduce_on_plateau.<locals>.update_fn":
      values = _closure(node)
      scale = values.get("_update_scale")
      patience = _closure(scale).get("patience") if scale is not None else None
      found.append({"accumulation_size": values.get("accumulation_size"), "patience": patience})
  return found


def _closure(fn: Any) -> dict[str, Any]:
  """The variables that function `fn` closes over, by name."""
  cells = getattr(fn, "__closure__", None) or ()
  return {
    name: cell.cell_contents for name, cell in zip(fn.__code__.co_freevars, cells, strict=True)
  }


def _reachable(transformation: Any) -> list[Any]:
  """Every object that optax `transformation` holds, itself included, to a depth of 16.

  optax's combinators (chain, named_chain, masked, multi_transform, MultiSteps,
  apply_if_finite, ...) keep the transformations they combine in the closures of their
  functions, in tuples and dicts there, or as attributes of an instance
  (``optax.MultiSteps``) that they hold or whose bound methods they hold.
  ``inject_hyperparams`` keeps a factory that builds its transformation at each call:
  what that builds is not reached.
  """
  reached: list[Any] = []
  seen: set[int] = set()

  def visit(node: Any, depth: int) -> None:
    if depth > 16 or id(node) in seen:
      return
    seen.add(id(node))
    reached.append(node)
    children: Any = ()
    if isinstance(node, tuple | list):
      children = node
    elif isinstance(node, dict):
      children = node.values()
    elif hasattr(node, "__self__") and hasattr(node, "__func__"):  # a bound method
      children = (node.__self__, *getattr(node.__self__, "__dict__", {}).values())
    elif callable(node) and hasattr(node, "__code__"):
      children = _closure(node).values()
    elif type(node).__module__.startswith("optax.") and hasattr(node, "__dict__"):
      children = vars(node).values()
    for child in children:
      visit(child, depth + 1)

  visit(transformation, 0)
  return reached


def _set_aside(model_dir: Path, step: int, why: str) -> Path:
  """Moves checkpoint `step` out of the checkpoint directory, into ``skipped_checkpoints/``.

  It is kept for inspection (with the reason next to it), out of reach of the
  rotation of old steps and of a new save of the same step.

  Raises:
    UsageError: the step could not be moved (one line naming where it went).
  """
  aside = model_dir / SKIPPED
  aside.mkdir(parents=True, exist_ok=True)
  name, n = str(step), 1
  while (aside / name).exists():
    n += 1
    name = f"{step}-{n}"
  try:
    _move(model_dir / CHECKPOINTS / str(step), aside / name)
  except OSError as error:
    raise UsageError(
      f"--model_dir {model_dir}: checkpoint step {step} is skipped, but it could not be moved "
      f"to {aside / name}: {error}"
    ) from error
  (aside / f"{name}.txt").write_text(f"checkpoint step {step} was skipped on resume: {why}\n")
  return aside / name


def _move(source: Path, target: Path) -> None:
  """Renames `source` to `target`; from another file system (``checkpoints`` a link to
  one), copies it whole under a temporary name, renames the copy, then deletes `source`.
  An object store has no folders to rename into: it copies each object under `target`
  (removing the copies if one fails), then deletes `source`."""
  if storage.is_object_store(source):
    try:
      for file in storage.files_under(source):
        file.copy(target / file.relative_to(source))
    except Exception as error:  # noqa: BLE001 - gcsfs's HttpError is no OSError
      target.rmtree(missing_ok=True)
      raise OSError(str(error)) from error
    source.rmtree()
    return
  try:
    source.rename(target)
  except OSError as error:
    if error.errno != errno.EXDEV:
      raise
    partial = target.with_name(f".{target.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    try:
      shutil.copytree(source, partial, symlinks=True)
    except OSError:
      shutil.rmtree(partial, ignore_errors=True)
      raise
    partial.rename(target)
    shutil.rmtree(source)


def _sync(name: str) -> None:
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def _config_change_line(model_dir: Path, resume: _Resume, config_text: str) -> str | None:
  """What the resumed run's config changes against the config that wrote the checkpoint."""
  recorded = resume.recorded or {}
  earlier = recorded_config(model_dir, recorded)
  if isinstance(earlier, LostConfig):
    if config_digest(config_text) == recorded.get("config_sha256"):
      return None
    return (
      f"config:          changed since step {resume.step}, not listed: the config that wrote it, "
      f"{earlier.name}, {earlier.why}, and {CONFIG_FILE} {earlier.latest}"
    )
  if earlier is None:
    return None
  changes = config_changes(earlier[1], config_text)
  if not changes:
    return None
  # Every change: one left unnamed may be the one that changes what the run trains on.
  return (
    f"config:          changed since step {resume.step} ({earlier[0].name}): {', '.join(changes)}"
  )


def _data_change_line(resume: _Resume, job: Mapping[str, Any] | None) -> str | None:
  """The text data's summary at the resumed step and now, where they differ."""
  there, now = (resume.recorded or {}).get("data"), (job or {}).get("data")
  if there is None or now is None or there == now:
    return None
  return f"data:            changed since step {resume.step}: {there} there, {now} now"


def _version_change_line(resume: _Resume, job: Mapping[str, Any] | None) -> str | None:
  """The packages whose versions differ from those that wrote the resumed step."""
  there, now = (resume.recorded or {}).get("versions"), (job or {}).get("versions")
  if not isinstance(there, dict) or not isinstance(now, dict):
    return None
  changes = version_changes(there, now)
  if not changes:
    return None
  return f"versions:        changed since step {resume.step}: {', '.join(changes)}"


_AT_END = frozenset({"learning_rate", "lr_scale"})
"""The step metrics a log line takes from the interval's last step: the learning rate and
reduce_on_plateau's scale in effect at the line's step."""


def _summarize(records: Sequence[dict[str, Any]]) -> dict[str, float]:
  """Loss and gradient norm averaged over the interval; the rates in effect at its end."""
  fetched = jax.device_get(list(records))
  return {
    key: float(fetched[-1][key] if key in _AT_END else np.mean([r[key] for r in fetched]))
    for key in fetched[0]
  }


def _evaluate(setup: Setup, state: TrainState) -> dict[str, float]:
  """Mean held-out loss of the trained params, and of the copy the optimizer is evaluated at
  where that is another: lookahead's slow params (``loss_slow``), schedule-free's average
  (``loss_x``)."""
  job = setup.job
  batches = [setup.eval_batch(i) for i in range(job.eval_batches)]
  copies = {"loss": trained_params(state.params)}
  if isinstance(state.params, optax.LookaheadParams):
    copies["loss_slow"] = state.params.slow
  evaluated = schedule_free_evaluation_params(state.param_states, state.params)
  if evaluated is not None:
    copies["loss_x"] = evaluated
  return {
    name: float(np.mean(jax.device_get([setup.eval_fn(params, b) for b in batches])))
    for name, params in copies.items()
  }


def train(
  setup: Setup,
  *,
  model_dir: Path,
  interrupt: Interrupt,
  about: Sequence[str] = (),
  config_text: str | None = None,
  stream: TextIO | None = None,
  initial_state: Callable[[], TrainState] | None = None,
  write_events: bool = True,
  job: Mapping[str, Any] | None = None,
  init_from: str | None = None,
  lock: bool = True,
) -> TrainSummary:
  """Runs the job to `total_steps` in `model_dir`, resuming from its newest intact checkpoint.

  The run holds `model_dir`'s writer lock (`WriterLock`) from start to end,
  so a second run there is refused before it reads or writes anything
  (``lock=False``: the caller holds it, `one_run_at_a_time`, from before
  it touches anything of the directory's, the compilation cache in it).

  Prints the model directory (and whether the run is new, resumed or
  finished) first, then the checkpoints it skipped, then `about`, then a log
  line every ``log_every`` steps and an eval line every ``eval_every`` steps.

  A checkpoint that is incomplete (never committed) or corrupt is skipped for
  the newest intact one and moved to ``model_dir/skipped_checkpoints/``, kept
  for inspection. A checkpoint of another job (`job.identity_problem`) is
  refused.

  Args:
    setup: from `prepare`.
    model_dir: the run's directory (from `prepare_model_dir`).
    interrupt: checked between steps; when set, the run saves and stops.
    about: lines describing the run (from `describe_setup`).
    config_text: the operative gin config; written to ``model_dir/config.gin``
      and to this start's ``config_<first step>.gin`` (by the process that
      writes events), and compared with the config of the resumed step.
    stream: where the output goes (default: standard output).
    initial_state: builds the state of a new run (default: `setup.create`);
      ``--init_from`` restores another run's checkpoint with it.
    write_events: write TensorBoard events and the config files (only
      process 0 of a multi-process run does).
    job: what makes the run this job (`job.job_record` without the config
      file), recorded with every checkpoint and compared on resume.
    init_from: the ``--init_from`` directory, named when a resume ignores it.
    lock: take `model_dir`'s writer lock (False: the caller holds it).

  Returns:
    The summary.

  Raises:
    UsageError: another run holds `model_dir`, the checkpoint was written by
      another job or does not fit it, or no checkpoint is intact.
    Interrupted: Ctrl-C or SIGTERM before the first step (nothing was written).
    Diverged: a step's loss, gradient norm or updated params were not
      finite (unless the job skips such steps); nothing more is saved.
    LoopFailed: an exception inside the loop (the last finite state was
      saved first, in single-process runs) or while the checkpointer and
      event writers open before it.
  """
  model_dir = storage.as_path(model_dir)
  with one_run_at_a_time(model_dir) if lock else contextlib.nullcontext():
    return _train(
      setup,
      model_dir=model_dir,
      interrupt=interrupt,
      about=about,
      config_text=config_text,
      stream=sys.stdout if stream is None else stream,
      initial_state=initial_state,
      write_events=write_events,
      job=job,
      init_from=init_from,
    )


@contextlib.contextmanager
def one_run_at_a_time(model_dir: Path) -> Iterator[None]:
  """Holds `model_dir`'s writer lock for the run; a run already there refuses this one."""
  model_dir.mkdir(parents=True, exist_ok=True)
  lock = WriterLock(str(model_dir))
  problem = lock.take(wait_out_stale=True)
  if problem:
    advice = "wait for it to end, or use" if problem.startswith("is in use") else "use"
    raise UsageError(
      f"--model_dir {model_dir} {problem}; nothing was changed: {advice} another --model_dir."
    )
  try:
    yield
  finally:
    lock.release()


def _intact(reader: Checkpointer, setup: Setup, step: int) -> bool:
  """Whether checkpoint `step` restores into the job's state (its checksums verified)."""
  try:
    reader.restore(setup.abstract_state, step)
  except (CheckpointError, ValueError, FileNotFoundError):
    return False
  return True


def _train(
  setup: Setup,
  *,
  model_dir: Path,
  interrupt: Interrupt,
  about: Sequence[str],
  config_text: str | None,
  stream: TextIO,
  initial_state: Callable[[], TrainState] | None,
  write_events: bool,
  job: Mapping[str, Any] | None,
  init_from: str | None,
) -> TrainSummary:
  """`train` in `model_dir`, which this process (or job) holds."""
  train_job = setup.job
  directory = model_dir / CHECKPOINTS
  with Checkpointer(directory) as reader:
    committed = [step for step in reader.all_steps() if reader.is_committed(step)]
    latest = committed[-1] if committed else None
    ignored = (
      f"init_from:       ignored: {model_dir} already holds checkpoints, so the run resumes "
      f"from them; to start from {init_from}, use a new --model_dir\n"
      if init_from is not None and latest is not None
      else ""
    )
    finished = latest is not None and latest >= train_job.total_steps
    if finished:
      with contextlib.suppress(CheckpointError):  # an unreadable record: the step is corrupt
        _refuse_another_job(reader.recorded_job(latest), job, model_dir, latest)
    # A corrupt last step is no finished run: the resume below skips it and trains it again.
    if finished and _intact(reader, setup, latest):
      stream.write(ignored)
      stream.write(
        f"model_dir: {model_dir} holds the finished run (checkpoint at step "
        f"{latest}, total_steps={train_job.total_steps}); nothing to do. Raise "
        f"TOTAL_STEPS to train further.\n"
      )
      return TrainSummary(
        latest,
        latest,
        None,
        None,
        None,
        0,
        0.0,
        str(directory),
        latest,
        interrupted=False,
        finished_before=True,
      )
    resume = _resume(setup, reader, model_dir, job) if reader.all_steps() else _Resume()
  # Only the process that writes the model directory's files moves them, and says where to.
  skipped = resume.skipped if write_events else []
  kept = [(step, _set_aside(model_dir, step, why), why) for step, why in skipped]
  _sync("t5x_optim: skipped checkpoints set aside")
  status = (
    "new run" if resume.step is None else f"resuming from the checkpoint at step {resume.step}"
  )
  stream.write(f"model_dir:       {model_dir} ({status})\n")
  stream.write(ignored)
  for step, where, why in kept:
    stream.write(f"skipped:         checkpoint step {step}, kept in {where}: {why}\n")
  if resume.step is not None:
    changes = (
      None if config_text is None else _config_change_line(model_dir, resume, config_text),
      _data_change_line(resume, job),
      _version_change_line(resume, job),
    )
    stream.write("".join(f"{line}\n" for line in changes if line))
  stream.write("".join(f"{line}\n" for line in about))
  stream.flush()
  if agreed_stop(interrupt):
    raise Interrupted
  if resume.state is None:
    state = setup.create(*setup.init_args) if initial_state is None else initial_state()
    if initial_state is not None and int(state.step) >= train_job.total_steps:
      raise UsageError(
        f"--init_from {init_from}: its checkpoint is at step {int(state.step)}, and the run "
        f"ends at TOTAL_STEPS {train_job.total_steps}, so it would train nothing; raise "
        "TOTAL_STEPS (the steps count on from the checkpoint's)."
      )
  else:
    state = _configured_constants(resume.state)
  start = int(state.step)
  name = None if config_text is None else config_file_name(model_dir, start, config_text)
  record = None if name is None or job is None else {**job, "config_file": name}
  with contextlib.ExitStack() as stack:
    try:
      checkpointer = stack.enter_context(
        Checkpointer(directory, keep=train_job.keep_checkpoints, job=record)
      )
      if name is not None and write_events:
        # The start's copy first: config.gin stays one of the copies if either write fails.
        for path in (model_dir / name, model_dir / CONFIG_FILE):
          write_at_once(path, config_text.encode())
      writers = stack.enter_context(
        MetricWriters(model_dir, start_step=start, fresh=resume.step is None, enabled=write_events)
      )
    except (UsageError, Interrupted):
      raise
    except CheckpointError as error:  # a step the checkpointer cannot rotate: nothing written
      raise UsageError(str(error)) from error
    except Exception as error:  # noqa: BLE001 - storage fails as it may: one line, as in the loop
      raise LoopFailed(start, error, saved=resume.step, note="") from error
    return _loop(setup, state, checkpointer, writers, interrupt, stream, saved=resume.step)


def _runs_on_cpu(job: TrainJob) -> bool:
  """Whether the mesh is on CPU devices, where the loop keeps one step in flight.

  XLA:CPU runs each simulated device's part of a step on a shared thread pool;
  with several multi-device steps in flight, threads waiting in one step's
  collectives can starve another's until XLA aborts the process (seen on a
  loaded 2-core machine). Waiting for each step costs little on CPU, where
  the devices are the host's cores anyway.
  """
  return job.partitioner.mesh.devices.flat[0].platform == "cpu"


def _stop(
  interrupt: Interrupt, checkpointer: Checkpointer, step: int, every: int, *, first: bool
) -> bool:
  """Whether to stop before the next step (Ctrl-C or SIGTERM).

  The processes of a multi-process run must stop at the same step (they save
  its checkpoint together). A preemption notice (SIGTERM to any process, which
  jax's coordination service passes on) stops all of them at the step jax's
  preemption sync point names; Ctrl-C (and a SIGTERM received before the
  processes connected) is agreed on at the first step and at every multiple
  of `every` (``log_every``): all stop when any was interrupted, with status
  143 when any was preempted.
  """
  if jax.process_count() == 1:
    return interrupt.requested
  if checkpointer.reached_preemption(step):
    interrupt.start_grace()
    return True
  if step % every and not first:
    return False
  return agreed_stop(interrupt)


def agreed_stop(interrupt: Interrupt) -> bool:
  """Whether any process of the job was interrupted; the same answer in every process.

  Every process must call it at the same point. With several, they exchange what each
  received (a peer's SIGTERM starts this process's grace, so it exits 143 too); a
  process that stopped alone would leave the others failing in their next collective.
  """
  if jax.process_count() == 1:
    return interrupt.requested
  code = 2 if interrupt.preempted else int(interrupt.requested)
  codes = multihost_utils.process_allgather(np.int32(code))
  if np.max(codes) == 2:
    interrupt.start_grace()
  return bool(np.max(codes))


def _usable(state: TrainState) -> bool:
  """Whether every array of `state` still exists (a failed step may have consumed them)."""
  return not any(getattr(leaf, "is_deleted", lambda: False)() for leaf in jax.tree.leaves(state))


def _save_on_the_way_out(
  checkpointer: Checkpointer, state: TrainState, step: int, saved: int | None
) -> tuple[int | None, str]:
  """Saves `state` as `step` unless it is saved; returns the latest saved step and a problem."""
  if step == saved:
    return saved, ""
  if jax.process_count() > 1:
    return saved, "the other processes cannot join a save after one process failed"
  if not _usable(state):
    return saved, "the failed step consumed the state"
  try:
    checkpointer.save(step, state)
    checkpointer.wait_until_finished()
  except Exception as error:  # noqa: BLE001 - reported with the error that stopped the run
    return saved, f"saving it failed too: {type(error).__name__}: {error}"
  return step, ""


def _loop(
  setup: Setup,
  state: TrainState,
  checkpointer: Checkpointer,
  writers: MetricWriters,
  interrupt: Interrupt,
  stream: TextIO,
  *,
  saved: int | None,
) -> TrainSummary:
  """Trains from `state` to ``total_steps``; see `train`.

  Raises:
    Diverged: a non-finite step (nothing more is saved).
    LoopFailed: any other exception (after saving the last finite state).
  """
  start = step = int(state.step)
  try:
    return _steps(setup, state, checkpointer, writers, interrupt, stream, saved=saved)
  except _Stopped as stopped:
    step, state, error = stopped.step, stopped.state, stopped.error
    saved = _newest_committed(checkpointer, stopped.saved)
  if isinstance(error, Diverged):
    # Not saved: the state before a divergence is often already bad, and its save would
    # rotate an older, good checkpoint away.
    raise Diverged(
      error.step, error.loss, error.grad_norm, saved=saved, skipped=error.skipped
    ) from None
  saved, note = (
    (saved, "") if step == start else _save_on_the_way_out(checkpointer, state, step, saved)
  )
  raise LoopFailed(step, error, saved=saved, note=note) from error


def _newest_committed(checkpointer: Checkpointer, saved: int | None) -> int | None:
  """The newest step up to `saved` whose save completed, once the saves in flight end.

  The loop counts a step saved when its save starts; a save that fails (a full
  disk) leaves it uncommitted, and its error is the run's or comes with it.
  """
  with contextlib.suppress(Exception):
    checkpointer.wait_until_finished()
  if saved is None:
    return None
  steps = reversed([s for s in checkpointer.all_steps() if s <= saved])
  return next((s for s in steps if checkpointer.is_committed(s)), None)


class _Stopped(Exception):
  """How `_steps` hands its last state to `_loop` when something stops it."""

  def __init__(self, step: int, state: TrainState, saved: int | None, error: Exception):
    super().__init__(str(error))
    self.step, self.state, self.saved, self.error = step, state, saved, error


def _steps(
  setup: Setup,
  state: TrainState,
  checkpointer: Checkpointer,
  writers: MetricWriters,
  interrupt: Interrupt,
  stream: TextIO,
  *,
  saved: int | None,
) -> TrainSummary:
  job = setup.job
  start = step = int(state.step)
  one_in_flight = _runs_on_cpu(job)
  progress = Progress(stream, start=start, total=job.total_steps)
  clock = Clock()
  records: list[dict[str, Any]] = []
  first_loss = final_loss = eval_loss = eval_step = None
  eval_others: tuple[tuple[str, float], ...] = ()
  compiled_weights = False
  skipped = in_a_row = written_skips = 0

  def log_pending() -> None:
    """Writes and prints the line of the steps since the last one (`records`), if any, and
    writes the count of skipped steps where it changed since the last write (an interval of
    skipped steps only has no line)."""
    nonlocal final_loss, written_skips
    if records:
      mean = _summarize(records)
      final_loss = float(records[-1]["loss"])  # Fetched by _summarize.
      records.clear()
      steps, seconds = clock.interval(step)
      with clock.paused():
        rate = steps / seconds if steps and seconds > 0 else None
        mean["steps_per_sec"] = rate
        if skipped:
          mean["skipped_steps"] = written_skips = skipped
        writers.write(TRAIN, step, mean)
        progress.log(format_metrics(step, job.total_steps, mean), rate=rate)
    if skipped != written_skips:
      with clock.paused():
        writers.write(TRAIN, step, {"skipped_steps": skipped})
      written_skips = skipped

  try:
    while step < job.total_steps and not _stop(
      interrupt, checkpointer, step, job.log_every, first=step == start
    ):
      if setup.weights_step_fn is not None and (step + 1) % job.metrics_every == 0:
        with clock.paused(steps=1) if not compiled_weights else contextlib.nullcontext():
          state, metrics = setup.weights_step_fn(state, setup.train_batch(step))
          if not compiled_weights:
            jax.block_until_ready(metrics)
            compiled_weights = True
      else:
        state, metrics = setup.step_fn(state, setup.train_batch(step))
      weights = metrics.pop("weights", None)
      if one_in_flight:
        jax.block_until_ready(metrics)
      if not bool(metrics.pop("finite")):
        loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
        if job.on_nonfinite != "skip":
          log_pending()
          raise Diverged(step + 1, loss, grad_norm, saved=saved, skipped=False)
        step += 1
        skipped, in_a_row = skipped + 1, in_a_row + 1
        updated = (
          ", updated params or optimizer state not finite"
          if math.isfinite(loss + grad_norm)
          else ""
        )
        progress.log(
          f"step {step}: not finite (loss {loss}, grad_norm {grad_norm}{updated}); skipped: "
          f"params and optimizer state unchanged ({skipped} skipped in all)"
        )
        if in_a_row >= job.max_consecutive_skips:
          log_pending()
          raise Diverged(step, loss, grad_norm, saved=saved, skipped=True)
        weights = None
      else:
        in_a_row = 0
        records.append(metrics)
        step += 1
      if weights is not None:
        with clock.paused():
          writers.write(TRAIN, step, dict(zip(setup.weight_tags, jax.device_get(weights).tolist())))
      progress.advance(step)
      if step == start + 1:
        clock.start(step)
      if first_loss is None and records:
        first_loss = float(records[0]["loss"])
      if step % job.log_every == 0 or step == job.total_steps:
        log_pending()
      if step % job.eval_every == 0 or step == job.total_steps:
        with clock.paused():
          evaluated = _evaluate(setup, state)
          writers.write(EVAL, step, evaluated)
          eval_loss, eval_step = evaluated["loss"], step
          eval_others = tuple((k, v) for k, v in evaluated.items() if k != "loss")
          progress.log(
            f"eval step {step}  "
            + "  ".join(f"{name} {value:.4f}" for name, value in evaluated.items())
          )
      if step % job.checkpoint_every == 0 and step != saved:
        with clock.paused():
          checkpointer.save(step, state)
          saved = step
    log_pending()  # Stopped (Ctrl-C, SIGTERM) between log lines: the resume starts after them.
    if step > start and step != saved:
      checkpointer.save(step, state)
      saved = step
    checkpointer.wait_until_finished()
  except Exception as error:
    progress.close()
    raise _Stopped(step, state, saved, error) from error
  progress.close()
  return TrainSummary(
    start_step=start,
    end_step=step,
    first_loss=first_loss,
    final_loss=final_loss,
    eval_loss=eval_loss,
    eval_step=eval_step,
    eval_others=eval_others,
    timed_steps=clock.total_steps,
    timed_seconds=clock.total_seconds,
    checkpoint_dir=str(checkpointer.directory),
    checkpoint_step=saved,
    interrupted=step < job.total_steps,
    finished_before=False,
    tokens_per_step=job.task.batch_size * job.task.length,
    preempted=step < job.total_steps and interrupt.preempted,
    skipped_steps=skipped,
  )
