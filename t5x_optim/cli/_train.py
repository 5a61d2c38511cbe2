"""The training loop of `t5x-optim train`: sharded steps, progress, checkpoints.

Example:
  >>> import jax
  >>> from t5x_optim import optimizers, partitioning
  >>> from t5x_optim.cli._config import TrainJob
  >>> from t5x_optim._model import SyntheticTask, TransformerConfig
  >>> mesh = partitioning.create_mesh(devices=jax.devices()[:1])
  >>> job = TrainJob(optimizers.adamw(1e-2), partitioning.Partitioner(mesh),
  ...                model=TransformerConfig(vocab_size=16, num_layers=1, max_length=8),
  ...                task=SyntheticTask(vocab_size=16, length=8, batch_size=4),
  ...                total_steps=3)
  >>> setup = prepare(job)
  >>> setup.abstract_state.params['logits'].shape
  (64, 16)
  >>> import io, tempfile
  >>> summary = train(setup, model_dir=tempfile.mkdtemp(), stream=io.StringIO())
  >>> summary.start_step, summary.end_step, summary.checkpoint_step
  (0, 3, 3)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from t5x_optim._model import TransformerLM, cross_entropy_loss
from t5x_optim._plan import format_bytes
from t5x_optim._train_state import TrainState
from t5x_optim.checkpoints import Checkpointer
from t5x_optim.cli._config import TrainJob
from t5x_optim.partitioning import abstract_train_state, init_sharded

__all__ = ["Setup", "TrainSummary", "UsageError", "prepare", "train"]

BATCH_AXES = {"inputs": PartitionSpec("batch"), "targets": PartitionSpec("batch")}
_CHECKPOINTS = "checkpoints"


class UsageError(Exception):
  """A request the command cannot satisfy (e.g. nothing to resume from)."""


@dataclasses.dataclass(frozen=True)
class Setup:
  """A job made ready to run: the model, the abstract state and the jitted step.

  Attributes:
    job: the job.
    model: the transformer.
    init_args: `model.init`'s arguments.
    abstract_state: the train state as sharded `jax.ShapeDtypeStruct`s.
    step_fn: `(state, batch) -> (state, loss)`, jitted with the shardings.
  """

  job: TrainJob
  model: TransformerLM
  init_args: tuple[Any, ...]
  abstract_state: TrainState
  step_fn: Any


def _train_step(model: TransformerLM, state: TrainState, batch: dict[str, Any]) -> Any:
  def loss_fn(params: Any) -> jax.Array:
    logits = model.apply({"params": params}, batch["inputs"])
    return cross_entropy_loss(logits, batch["targets"])

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradient(grads), loss


def _check_trains_plain_params(optimizer_def: Any) -> None:
  """Rejects optax.lookahead, whose params must be `optax.LookaheadParams`."""
  init = getattr(getattr(optimizer_def, "optax_optimizer", None), "init", None)
  if getattr(init, "__qualname__", "").startswith("lookahead."):
    raise TypeError(
        "OPTIMIZER is optax.lookahead, which trains optax.LookaheadParams (fast and slow "
        "copies of the params); the train job trains plain params. Use lookahead in your "
        "own loop (see gin/optimizers/lookahead.gin), or another optimizer here."
    )


def prepare(job: TrainJob) -> Setup:
  """Derives the shardings and traces one step, without allocating the state.

  Tracing the step here surfaces configuration errors (e.g. a hyper-parameter
  of the wrong type) before anything is initialised.
  """
  _check_trains_plain_params(job.optimizer)
  model = TransformerLM(job.model)
  init_args = (jax.random.key(job.seed), jnp.zeros((1, job.task.length), jnp.int32))
  abstract = abstract_train_state(job.partitioner, job.optimizer, model.init, *init_args)
  shardings = jax.tree.map(lambda x: x.sharding, abstract)
  step_fn = job.partitioner.partition(
      functools.partial(_train_step, model), (shardings, BATCH_AXES), (shardings, None),
      donate_argnums=0,
  )
  batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), job.task.batch(0))
  try:
    step_fn.lower(abstract, batch)
  except (TypeError, ValueError) as error:
    raise ValueError(
        f"Tracing one train step failed, so the optimizer is misconfigured (e.g. a "
        f"hyper-parameter of the wrong type): {type(error).__name__}: {error}"
    ) from error
  return Setup(job, model, init_args, abstract, step_fn)


def optimizer_state_bytes(state: TrainState) -> tuple[int, int]:
  """(bytes on device 0, total bytes) of the optimizer state's arrays."""
  leaves = jax.tree.leaves(state.param_states)
  per_device = sum(x.addressable_shards[0].data.nbytes for x in leaves)
  return per_device, sum(x.nbytes for x in leaves)


@dataclasses.dataclass(frozen=True)
class TrainSummary:
  """What a run did.

  Example:
    >>> print(TrainSummary(0, 10, 3.5, 1.25, 2.0, 1024, 8192, 8, '/tmp/c', 10, False).format())
    steps 0 -> 10 in 2.0 s (5.0 steps/s)
    loss 3.5000 -> 1.2500
    optimizer state: 1.0 KiB per device (8.0 KiB total over 8 devices, ideal 1.0 KiB)
    checkpoint: step 10 in /tmp/c
  """

  start_step: int
  end_step: int
  first_loss: float | None
  final_loss: float | None
  seconds: float
  state_bytes_per_device: int
  state_total_bytes: int
  num_devices: int
  checkpoint_dir: str
  checkpoint_step: int | None
  interrupted: bool

  def format(self) -> str:
    steps = self.end_step - self.start_step
    rate = steps / self.seconds if self.seconds > 0 else math.inf
    lines = []
    if self.interrupted:
      lines.append(f"interrupted at step {self.end_step}")
    lines.append(
        f"steps {self.start_step} -> {self.end_step} in {self.seconds:.1f} s ({rate:.1f} steps/s)"
    )
    if self.final_loss is not None:
      lines.append(f"loss {self.first_loss:.4f} -> {self.final_loss:.4f}")
    lines.append(
        f"optimizer state: {format_bytes(self.state_bytes_per_device)} per device "
        f"({format_bytes(self.state_total_bytes)} total over {self.num_devices} devices, "
        f"ideal {format_bytes(self.state_total_bytes / self.num_devices)})"
    )
    saved = "none" if self.checkpoint_step is None else f"step {self.checkpoint_step}"
    lines.append(f"checkpoint: {saved} in {self.checkpoint_dir}")
    return "\n".join(lines)


class Progress:
  """Step, loss and steps/s on a stream: a redrawn bar on a terminal, else lines.

  Example:
    >>> import io
    >>> stream = io.StringIO()
    >>> progress = Progress(stream, start=0, total=20, every=10)
    >>> progress.wants(10), progress.wants(11)
    (True, False)
    >>> progress.show(10, 2.5)
    >>> stream.getvalue().startswith('step 10/20  loss 2.5000')
    True
  """

  _WIDTH = 24
  _REDRAW_SECONDS = 0.1

  def __init__(self, stream: TextIO, *, start: int, total: int, every: int):
    self._stream = stream
    self._tty = stream.isatty()
    self._start, self._total, self._every = start, total, every
    self._t0: float | None = None
    self._step0 = start
    self._last_draw = 0.0

  def started(self, step: int) -> None:
    """Marks the end of the first (compiling) step, where the rate starts."""
    self._t0, self._step0 = time.perf_counter(), step

  def wants(self, step: int) -> bool:
    """Whether `step` should be shown (fetching the loss costs a device sync)."""
    if step == self._total or step % self._every == 0:
      return True
    return self._tty and time.perf_counter() - self._last_draw >= self._REDRAW_SECONDS

  def show(self, step: int, loss: float) -> None:
    now = time.perf_counter()
    self._last_draw = now
    elapsed = now - self._t0 if self._t0 is not None else 0.0
    rate = (step - self._step0) / elapsed if elapsed > 0 else 0.0
    text = f"step {step}/{self._total}  loss {loss:.4f}  {rate:.1f} steps/s"
    if self._tty:
      filled = int(self._WIDTH * step / self._total)
      bar = "#" * filled + "." * (self._WIDTH - filled)
      self._stream.write(f"\r[{bar}] {text}\x1b[K")
    else:
      self._stream.write(text + "\n")
    self._stream.flush()

  def close(self) -> None:
    if self._tty:
      self._stream.write("\n")
      self._stream.flush()


@contextlib.contextmanager
def _interruptible() -> Iterator[list[bool]]:
  """Turns the first Ctrl-C into a flag; a second one interrupts at once."""
  flag = [False]
  previous = signal.getsignal(signal.SIGINT)

  def handler(signum: int, frame: Any) -> None:
    if flag[0]:
      raise KeyboardInterrupt
    flag[0] = True

  signal.signal(signal.SIGINT, handler)
  try:
    yield flag
  finally:
    signal.signal(signal.SIGINT, previous)


def _initial_state(setup: Setup, checkpointer: Checkpointer, *, resume: bool) -> TrainState:
  latest = checkpointer.latest_step()
  if resume:
    if latest is None:
      raise UsageError(f"--resume: no checkpoint in {checkpointer.directory}.")
    try:
      return checkpointer.restore(setup.abstract_state)
    except ValueError as error:
      raise UsageError(f"--resume: {error}") from error
  if latest is not None:
    raise UsageError(
        f"{checkpointer.directory} already holds checkpoints up to step {latest}: pass "
        "--resume to continue from there, or another --model_dir."
    )
  job = setup.job
  return init_sharded(job.partitioner, job.optimizer, setup.model.init, *setup.init_args)


def train(
    setup: Setup, *, model_dir: Path, resume: bool = False, stream: TextIO = sys.stderr
) -> TrainSummary:
  """Runs the job to `total_steps`, checkpointing; Ctrl-C saves and stops.

  Args:
    setup: from `prepare`.
    model_dir: checkpoints go to ``model_dir/checkpoints``.
    resume: continue from the latest checkpoint.
    stream: where progress goes.

  Returns:
    The summary.

  Raises:
    UsageError: `resume` without a checkpoint or with one that does not fit
      the job (e.g. saved with another optimizer), or checkpoints present
      without `resume`.
  """
  job = setup.job
  directory = Path(model_dir) / _CHECKPOINTS
  with Checkpointer(directory, keep=job.keep_checkpoints) as checkpointer:
    state = _initial_state(setup, checkpointer, resume=resume)
    start = int(state.step)
    saved = checkpointer.latest_step()
    progress = Progress(stream, start=start, total=job.total_steps, every=job.log_every)
    first_loss = final_loss = None
    t0 = time.perf_counter()
    step = start
    with _interruptible() as interrupted:
      while step < job.total_steps and not interrupted[0]:
        state, loss = setup.step_fn(state, job.task.batch(step))
        step += 1
        if step == start + 1:
          first_loss = float(loss)
          progress.started(step)
        if progress.wants(step):
          final_loss = float(loss)
          progress.show(step, final_loss)
        if step % job.checkpoint_every == 0 and step != saved:
          checkpointer.save(step, state)
          saved = step
      if step > start:
        final_loss = float(loss)
      if step != saved:
        checkpointer.save(step, state)
        saved = step
      checkpointer.wait_until_finished()
    progress.close()
    seconds = time.perf_counter() - t0
  per_device, total = optimizer_state_bytes(state)
  return TrainSummary(
      start_step=start,
      end_step=step,
      first_loss=first_loss,
      final_loss=final_loss,
      seconds=seconds,
      state_bytes_per_device=per_device,
      state_total_bytes=total,
      num_devices=job.partitioner.mesh.size,
      checkpoint_dir=str(directory),
      checkpoint_step=saved,
      interrupted=interrupted[0],
  )
