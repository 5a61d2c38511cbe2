"""Ctrl-C and SIGTERM as flags that the command checks between steps.

A KeyboardInterrupt raised inside jax (tracing, XLA compilation, an orbax
save in flight) can leave threads behind that crash the interpreter at exit,
so the command never raises one: the first Ctrl-C sets a flag, the command
stops at its next check (between train steps, or after the current phase
while compiling) and exits with status 130; a second Ctrl-C exits at once
(`os._exit`), which orbax's write-then-rename keeps safe for the checkpoints
already completed.

SIGTERM is how schedulers preempt a job (GKE, Cloud TPU and GCE spot VMs,
Slurm, ``docker stop``), with a SIGKILL after a grace period (30 s on GKE).
It sets the same flag: the command finishes the current step, saves it,
waits until the checkpoint is committed and exits with status 143. A
watchdog started with the signal exits with 143 anyway once
``grace_seconds`` have passed (the latest complete checkpoint then stays the
latest; a half-written step is never taken for one). Repeated SIGTERMs are
ignored. SIGHUP (the terminal or ssh session closed) is taken for a
SIGTERM where nothing ignores it (``nohup`` does): it killed the run at once,
with every step since the last checkpoint.

Example:
  >>> interrupt = Interrupt(quiet=True)
  >>> interrupt.requested, interrupt.exit_status
  (False, 130)
  >>> interrupt.handle(signal.SIGINT, None)
  >>> interrupt.requested, interrupt.preempted
  (True, False)
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any

__all__ = [
  "DEFAULT_GRACE_SECONDS",
  "EXIT_INTERRUPTED",
  "EXIT_PREEMPTED",
  "Interrupt",
]

EXIT_INTERRUPTED = 130
EXIT_PREEMPTED = 143
DEFAULT_GRACE_SECONDS = 20.0
"""How long after a SIGTERM the command may take to save and exit (GKE kills at 30 s)."""
_NOTICE = "t5x-optim: interrupted; stopping at the next step (Ctrl-C again to quit at once)\n"
_QUIT = "t5x-optim: interrupted twice; quitting now\n"


_SIGHUP = getattr(signal, "SIGHUP", None)


def _terminal_outputs() -> list[int]:
  """Standard output and error where they are a terminal (a hangup takes it away)."""
  return [fd for fd in (1, 2) if os.isatty(fd)]


def _silence(fds: list[int]) -> None:
  """Points `fds` at the null device: after a hangup every write to the terminal fails
  (EIO), and a step line would crash the run before it saves."""
  null = os.open(os.devnull, os.O_WRONLY)
  for fd in fds:
    os.dup2(null, fd)
  os.close(null)


def _write(text: str) -> None:
  try:
    os.write(sys.stderr.fileno(), text.encode())
  except OSError:  # no terminal any more (after a SIGHUP): the notice is lost, not the run
    pass


class Interrupt:
  """Records SIGINTs and SIGTERMs in `pending` (shared with whoever installed the first handler).

  Args:
    pending: the signals received so far; the launcher passes the list its
      own handler filled while the package was being imported.
    quiet: do not print the notices.
    grace_seconds: after a SIGTERM, exit with status 143 once this many
      seconds have passed, whatever the command is doing.
  """

  def __init__(
    self,
    pending: list[int] | None = None,
    *,
    quiet: bool = False,
    grace_seconds: float = DEFAULT_GRACE_SECONDS,
  ):
    self.pending = [] if pending is None else pending
    self._quiet = quiet
    self._grace = grace_seconds
    self._since: float | None = None
    self._timer: threading.Timer | None = None
    self._terminal: list[int] = []
    self._replaced: dict[int, Any] = {}
    if self.preempted:
      self.start_grace()

  @property
  def requested(self) -> bool:
    """Whether Ctrl-C was pressed or SIGTERM received."""
    return bool(self.pending)

  @property
  def preempted(self) -> bool:
    """Whether SIGTERM was received (or `start_grace` called: a peer's preemption notice)."""
    return signal.SIGTERM in self.pending or self._since is not None

  @property
  def exit_status(self) -> int:
    """143 after a SIGTERM, else 130."""
    return EXIT_PREEMPTED if self.preempted else EXIT_INTERRUPTED

  @property
  def grace_seconds(self) -> float:
    """The grace after a SIGTERM."""
    return self._grace

  def handle(self, signum: int, frame: Any) -> None:
    """The handler: flag the first signal; quit on a second Ctrl-C; ignore a second SIGTERM;
    take SIGHUP for SIGTERM."""
    if signum in (signal.SIGTERM, _SIGHUP):
      if signum == _SIGHUP:
        _silence(self._terminal)
      if self.preempted:
        return
      self.pending.append(signal.SIGTERM)
      if not self._quiet:
        name = "SIGTERM" if signum == signal.SIGTERM else "SIGHUP, taken for SIGTERM"
        _write(
          f"t5x-optim: {name}; saving at the next step and exiting within "
          f"{self._grace:g} s (the preemption grace)\n"
        )
      self.start_grace()
      return
    self.pending.append(signum)
    if self.pending.count(signal.SIGINT) > 1:
      _write(_QUIT)
      os._exit(EXIT_INTERRUPTED)
    if not self._quiet:
      _write(_NOTICE)

  def start_grace(self) -> None:
    """Starts the grace watchdog now, unless it runs already."""
    if self._since is None:
      self._since = time.monotonic()
      self._arm()

  def set_grace(self, seconds: float) -> None:
    """Sets the grace; a watchdog already running keeps its start and gets the new length."""
    self._grace = seconds
    if self._since is not None:
      self._arm()

  def cancel(self) -> None:
    """Stops the watchdog (the command is exiting by itself)."""
    if self._timer is not None:
      self._timer.cancel()

  def _arm(self) -> None:
    self.cancel()
    remaining = max(0.0, self._since + self._grace - time.monotonic())
    self._timer = threading.Timer(remaining, self._expire)
    self._timer.daemon = True
    self._timer.start()

  def _expire(self) -> None:
    _write(
      f"t5x-optim: the preemption grace of {self._grace:g} s ran out; exiting now (the "
      "latest complete checkpoint stays the latest)\n"
    )
    os._exit(EXIT_PREEMPTED)

  def install(self) -> None:
    """Makes this the process's SIGINT and SIGTERM handler, and its SIGHUP handler unless
    SIGHUP is ignored (``nohup``) (main thread only); `uninstall` puts back those it replaced."""
    if _SIGHUP is not None and signal.getsignal(_SIGHUP) not in (signal.SIG_IGN, None):
      self._terminal = _terminal_outputs()
      self._replaced.setdefault(_SIGHUP, signal.signal(_SIGHUP, self.handle))
    for signum in (signal.SIGINT, signal.SIGTERM):
      self._replaced.setdefault(signum, signal.signal(signum, self.handle))

  def uninstall(self) -> None:
    """Stops the watchdog and puts back the handlers `install` replaced (the default one where
    the replaced one was not installed from Python) (main thread only)."""
    self.cancel()
    for signum, handler in self._replaced.items():
      signal.signal(signum, signal.SIG_DFL if handler is None else handler)
    self._replaced.clear()
