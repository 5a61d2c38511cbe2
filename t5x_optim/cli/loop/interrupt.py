"""Ctrl-C as a flag that the command checks between steps.

A KeyboardInterrupt raised inside jax (tracing, XLA compilation, an orbax
save in flight) can leave threads behind that crash the interpreter at exit,
so the command never raises one: the first Ctrl-C sets a flag, the command
stops at its next check (between train steps, or after the current phase
while compiling) and exits with status 130; a second Ctrl-C exits at once
(`os._exit`), which orbax's write-then-rename keeps safe for the checkpoints
already completed.

Example:
  >>> interrupt = Interrupt()
  >>> interrupt.requested
  False
  >>> interrupt.handle(2, None)
  >>> interrupt.requested
  True
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

__all__ = ["EXIT_INTERRUPTED", "Interrupt"]

EXIT_INTERRUPTED = 130
_NOTICE = "t5x-optim: interrupted; stopping at the next step (Ctrl-C again to quit at once)\n"
_QUIT = "t5x-optim: interrupted twice; quitting now\n"


class Interrupt:
  """Counts SIGINTs in `pending` (shared with whoever installed the first handler).

  Args:
    pending: the signals received so far; the launcher passes the list its
      own handler filled while the package was being imported.
    quiet: do not print the notice on the first signal.
  """

  def __init__(self, pending: list[int] | None = None, *, quiet: bool = False):
    self.pending = [] if pending is None else pending
    self._quiet = quiet

  @property
  def requested(self) -> bool:
    """Whether Ctrl-C was pressed."""
    return bool(self.pending)

  def handle(self, signum: int, frame: Any) -> None:
    """The SIGINT handler: flag the first signal, quit on the second."""
    self.pending.append(signum)
    if len(self.pending) > 1:
      os.write(sys.stderr.fileno(), _QUIT.encode())
      os._exit(EXIT_INTERRUPTED)
    if not self._quiet:
      os.write(sys.stderr.fileno(), _NOTICE.encode())

  def install(self) -> None:
    """Makes this the process's SIGINT handler (main thread only)."""
    signal.signal(signal.SIGINT, self.handle)
