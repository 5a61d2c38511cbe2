"""What `t5x-optim train` shows while it runs: log lines, a progress bar and the train clock.

`Progress` prints the log lines on any stream and, on a terminal, keeps a
progress bar with an ETA below them; `Clock` times the train steps of each
log interval, compilation, evals and saves left out; `format_metrics` writes
one log line.

Example:
  >>> format_metrics(10, 20, {'loss': 2.5, 'grad_norm': 0.25, 'steps_per_sec': 4.0})
  'step 10/20  loss 2.5000  grad_norm 0.25  4.0 steps/s'
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import TextIO

__all__ = ["Clock", "Progress", "duration", "format_metrics"]


class Clock:
  """Train time per log interval, with compilation, evals and saves left out.

  Example:
    >>> clock = Clock()
    >>> clock.start(1)
    >>> with clock.paused():
    ...   pass
    >>> steps, seconds = clock.interval(5)
    >>> steps, seconds >= 0
    (4, True)
  """

  def __init__(self) -> None:
    self._t0: float | None = None
    self._step0 = 0
    self._paused = 0.0
    self._left_out = 0
    self.total_steps = 0
    self.total_seconds = 0.0

  @property
  def started(self) -> bool:
    return self._t0 is not None

  def start(self, step: int) -> None:
    """Starts timing after `step` completed (the compiling step is not timed)."""
    self._t0, self._step0, self._paused, self._left_out = time.perf_counter(), step, 0.0, 0

  @contextlib.contextmanager
  def paused(self, *, steps: int = 0) -> Iterator[None]:
    """Leaves the enclosed time (an eval, a save) out of the interval, and the `steps` it
    takes (a step that compiles its program)."""
    begin = time.perf_counter()
    try:
      yield
    finally:
      self._paused += time.perf_counter() - begin
      self._left_out += steps

  def interval(self, step: int) -> tuple[int, float]:
    """(steps, seconds) since the last call (or `start`); restarts the interval."""
    if self._t0 is None:
      return 0, 0.0
    now = time.perf_counter()
    steps = max(step - self._step0 - self._left_out, 0)
    seconds = max(now - self._t0 - self._paused, 0.0)
    self.total_steps += steps
    self.total_seconds += seconds
    self._t0, self._step0, self._paused, self._left_out = now, step, 0.0, 0
    return steps, seconds


class Progress:
  """Log lines on any stream; on a terminal also a progress bar with ETA below them.

  The bar is redrawn in place; log lines are printed above it, so the loss
  history stays on screen.

  Example:
    >>> import io
    >>> stream = io.StringIO()
    >>> progress = Progress(stream, start=0, total=20)
    >>> progress.log('step 10/20  loss 2.5000')
    >>> stream.getvalue()
    'step 10/20  loss 2.5000\\n'
  """

  _WIDTH = 30

  def __init__(self, stream: TextIO, *, start: int, total: int, redraw_seconds: float = 0.2):
    self._stream = stream
    self._redraw_seconds = redraw_seconds
    self._tty = stream.isatty()
    self._start, self._total = start, total
    self._rate: float | None = None
    self._step = start
    self._last_draw = 0.0

  def log(self, line: str, *, rate: float | None = None) -> None:
    """Prints a permanent line (and remembers `rate` for the ETA)."""
    if rate is not None:
      self._rate = rate
    if self._tty:
      self._stream.write("\r\x1b[K")
    self._stream.write(line + "\n")
    self._draw()

  def advance(self, step: int) -> None:
    """Notes that `step` was dispatched; redraws the bar now and then."""
    self._step = step
    if self._tty and time.perf_counter() - self._last_draw >= self._redraw_seconds:
      self._draw()

  def _draw(self) -> None:
    if self._tty:
      self._last_draw = time.perf_counter()
      filled = int(self._WIDTH * self._step / self._total)
      bar = "#" * filled + "." * (self._WIDTH - filled)
      if self._rate:
        eta = f"ETA {duration((self._total - self._step) / self._rate)}"
      else:
        eta = "ETA after the first log interval"
      self._stream.write(f"\r[{bar}] {self._step}/{self._total}  {eta}\x1b[K")
    self._stream.flush()

  def close(self) -> None:
    if self._tty:
      self._stream.write("\r\x1b[K")
      self._stream.flush()


def duration(seconds: float) -> str:
  seconds = int(round(seconds))
  if seconds < 60:
    return f"{seconds}s"
  minutes, seconds = divmod(seconds, 60)
  hours, minutes = divmod(minutes, 60)
  return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds:02d}s"


def format_metrics(step: int, total: int, metrics: dict[str, float | None]) -> str:
  parts = [f"step {step}/{total}", f"loss {metrics['loss']:.4f}"]
  if metrics.get("learning_rate") is not None:
    parts.append(f"lr {metrics['learning_rate']:.3g}")
  if metrics.get("lr_scale") is not None:
    parts.append(f"lr_scale {metrics['lr_scale']:.3g}")
  parts.append(f"grad_norm {metrics['grad_norm']:.3g}")
  if metrics.get("steps_per_sec") is not None:
    parts.append(f"{metrics['steps_per_sec']:.1f} steps/s")
  return "  ".join(parts)
