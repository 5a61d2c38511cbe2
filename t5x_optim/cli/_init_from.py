"""`t5x-optim train --init_from DIR`: start a run from another run's checkpoint and optimizer.

DIR is a t5x-optim model directory (its checkpoints in ``DIR/checkpoints`` and its
operative gin config in ``DIR/config.gin``) or a T5X model directory (T5X's
``checkpoint_<step>`` directories, legacy or Orbax format). The params, step and
mutables are restored exactly and the old optimizer's state is converted into the
gin file's optimizer (`t5x_optim.convert_state`), so the new optimizer keeps what the
old one learned.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

import gin

from t5x_optim._training import storage
from t5x_optim._training.convert_checkpoint import restore_converted
from t5x_optim._training.train_state import TrainState
from t5x_optim.cli import _config
from t5x_optim.cli._train import CHECKPOINTS, CONFIG_FILE, UsageError

__all__ = ["initial_state_fn", "source_optimizer"]


def _as_path(init_from: Path | str) -> Path:
  try:
    return storage.check_reachable(init_from)
  except storage.StorageError as error:
    raise UsageError(f"--init_from {error}") from error


def _is_ours(init_from: Path) -> bool:
  return (init_from / CHECKPOINTS).is_dir() and (init_from / CONFIG_FILE).is_file()


def source_optimizer(
  init_from: Path, gin_files: Sequence[str], search_paths: Sequence[str], macros: dict[str, Any]
) -> Any:
  """The optimizer definition that wrote `init_from`'s checkpoints, or None.

  Built from `gin_files` when given (e.g. ``optimizers/adafactor.gin``), else
  from a t5x-optim model directory's ``config.gin``. None for a T5X model
  directory without `gin_files`: T5X's legacy Adafactor is then recognised by
  its state's layout. Parsing leaves gin's config cleared.

  Example:
    >>> source_optimizer(Path('/nonexistent'), [], [], {}) is None
    True
  """
  init_from = _as_path(init_from)
  files = list(gin_files) or ([str(init_from / CONFIG_FILE)] if _is_ours(init_from) else [])
  if not files:
    return None
  try:
    _config.parse_config(gin_files=files, search_paths=search_paths, macros=macros)
    return _config.build_job().optimizer
  finally:
    gin.clear_config()


def initial_state_fn(
  init_from: Path, source: Any, abstract_state: TrainState, stream: TextIO
) -> Callable[[], TrainState]:
  """A function restoring `init_from`'s latest checkpoint into `abstract_state`'s optimizer.

  What was converted and what started fresh is written to `stream`. A moment
  the old optimizer did not keep (Adam's ``mu`` after an Adafactor without
  momentum) starts from zero. A checkpoint that cannot be restored raises
  `UsageError` (one line on the command line).
  """

  init_from = _as_path(init_from)

  def restore() -> TrainState:
    directory = init_from / CHECKPOINTS if _is_ours(init_from) else init_from
    try:
      state, report = restore_converted(directory, abstract_state, source=source, missing="init")
    except (ValueError, FileNotFoundError) as error:
      raise UsageError(f"--init_from {init_from}: {error}") from error
    stream.write(f"init_from:       {init_from} at step {int(state.step)}\n")
    stream.write("".join(f"  {line}\n" for line in str(report).splitlines()))
    return state

  return restore
