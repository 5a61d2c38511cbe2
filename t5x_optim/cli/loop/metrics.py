"""TensorBoard event files of a run: ``model_dir/train`` and ``model_dir/eval``.

Written with tensorboardX, whose only dependencies are numpy, protobuf and
packaging. T5X writes its metrics with clu's metric writers, whose summary
writer needs TensorFlow (a multi-hundred-MB dependency the rest of this
package never needs); flax's `flax.metrics.tensorboard` needs TensorFlow too.
tensorboardX writes the same event-file format (TensorBoard's ``Event``
protos with ``simple_value`` scalars), which TensorBoard and its
`EventAccumulator` read.

Train and eval scalars share their tags (``loss``), so TensorBoard draws the
two curves of a tag in one chart.

Example:
  >>> import tempfile
  >>> from pathlib import Path
  >>> model_dir = Path(tempfile.mkdtemp())
  >>> with MetricWriters(model_dir, start_step=0) as writers:
  ...   writers.write(TRAIN, 10, {'loss': 2.5, 'learning_rate': None})
  >>> sorted(p.name for p in model_dir.iterdir())
  ['eval', 'train']
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from pathlib import Path
from typing import Self

import tensorboardX

from t5x_optim.cli.loop.event_files import event_dir

__all__ = ["EVAL", "TRAIN", "MetricWriters"]

TRAIN = "train"
EVAL = "eval"


class MetricWriters:
  """One TensorBoard writer per kind (``train``, ``eval``) under the model directory.

  Args:
    model_dir: the run's directory.
    start_step: the step the run starts from; TensorBoard drops the events
      that an earlier run logged after it (its purge step): a resume's
      interrupted steps, or all of those of a run that saved nothing.
    enabled: False writes nothing (the processes other than 0 of a run).
  """

  def __init__(self, model_dir: Path, *, start_step: int, enabled: bool = True):
    # Events of steps after the start are an earlier run's that never saved (a resume's
    # interrupted steps, or a whole run that diverged or was killed before its first save).
    purge = start_step + 1
    self._writers = {
      kind: tensorboardX.SummaryWriter(event_dir(model_dir, kind), purge_step=purge)
      for kind in (TRAIN, EVAL)
      if enabled
    }

  def __enter__(self) -> Self:
    return self

  def __exit__(self, error_type: type | None, *rest: object) -> None:
    if error_type is None:
      self.close()
      return
    # The error in flight is the run's; one in closing (the same full disk) would replace it.
    with contextlib.suppress(Exception):
      self.close()

  def write(self, kind: str, step: int, scalars: Mapping[str, float | None]) -> None:
    """Writes the scalars that are not None at `step` and flushes them to disk."""
    writer = self._writers.get(kind)
    if writer is None:
      return
    for tag, value in scalars.items():
      if value is not None:
        writer.add_scalar(tag, float(value), step)
    writer.flush()

  def close(self) -> None:
    """Flushes and closes every writer."""
    for writer in self._writers.values():
      writer.close()
