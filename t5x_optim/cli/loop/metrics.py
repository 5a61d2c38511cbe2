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

The events are written in the caller's thread and flushed (``fsync`` on a
local disk) before `MetricWriters.write` returns: tensorboardX's
`SummaryWriter` hands them to a logging thread that flushes every
``flush_secs`` (120 s), and its `flush` reaches only what that thread has
written, so a process killed after a write could lose the write.

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
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Self

from tensorboardX.event_file_writer import EventsWriter
from tensorboardX.proto.event_pb2 import Event, SessionLog
from tensorboardX.record_writer import directory_check
from tensorboardX.summary import scalar

from t5x_optim import storage
from t5x_optim.cli.loop.event_files import drop_events_after, event_dir

__all__ = ["EVAL", "TRAIN", "MetricWriters"]

TRAIN = "train"
EVAL = "eval"


class MetricWriters:
  """One TensorBoard writer per kind (``train``, ``eval``) under the model directory.

  Args:
    model_dir: the run's directory.
    start_step: the step the run starts from; the events that an earlier run
      logged after it are removed from the files (a resume's interrupted
      steps, or all of those of a run that saved nothing), and a purge step
      after it hides those of a file that cannot be read from TensorBoard's
      Python loader.
    fresh: the run starts from no checkpoint of this directory (a new run,
      or one started with ``--init_from``): every event already in it is of
      a run that saved nothing, and is removed.
    enabled: False writes nothing (the processes other than 0 of a run).
  """

  def __init__(
    self, model_dir: Path, *, start_step: int, fresh: bool = False, enabled: bool = True
  ):
    self._writers: dict[str, EventsWriter] = {}
    for kind in (TRAIN, EVAL) if enabled else ():
      directory = event_dir(model_dir, kind)
      drop_events_after(directory, -1 if fresh else start_step)
      directory_check(directory)
      # tensorboardX names a file by the second and the host: the process and the nanosecond
      # keep a start in the second of the last one's from reopening its file from empty.
      suffix = f".{os.getpid()}.{time.time_ns()}"
      writer = EventsWriter(storage.join(directory, "events"), filename_suffix=suffix)
      # The purge step: TensorBoard's Python loader drops the events of later steps before it.
      writer.write_event(
        Event(
          wall_time=time.time(),
          step=start_step + 1,
          session_log=SessionLog(status=SessionLog.START),
        )
      )
      writer.flush()
      self._writers[kind] = writer

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
    """Writes the scalars that are not None at `step`; they are on disk when it returns."""
    writer = self._writers.get(kind)
    if writer is None:
      return
    now = time.time()
    for tag, value in scalars.items():
      if value is not None:
        writer.write_event(Event(wall_time=now, step=step, summary=scalar(tag, float(value))))
    writer.flush()

  def close(self) -> None:
    """Flushes and closes every writer."""
    for writer in self._writers.values():
      writer.close()
