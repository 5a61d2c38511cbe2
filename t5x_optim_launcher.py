"""The `t5x-optim` console script: Ctrl-C, SIGTERM and SIGHUP are caught before anything is
imported.

Importing jax takes a while; a Ctrl-C during the import would otherwise end
in a KeyboardInterrupt traceback, and a SIGTERM (a preemption) would kill the
process at once. This module imports nothing heavy, installs handlers that
only record the signals, then imports the package and hands the recorded
signals to the command, which exits with status 130 (Ctrl-C) or 143
(SIGTERM).

Run: ``t5x-optim ...`` or ``python -m t5x_optim_launcher ...``.
"""

import os
import signal
import sys

_PENDING: list[int] = []
_SIGHUP = getattr(signal, "SIGHUP", None)
_TERMINAL: list[int] = []
"""Standard output and error where they were a terminal: a hangup takes it away."""


def _record(signum, frame):
  if signum == _SIGHUP:  # a closed terminal: taken for a preemption; writes there would fail
    null = os.open(os.devnull, os.O_WRONLY)
    for fd in _TERMINAL:
      os.dup2(null, fd)
    os.close(null)
    signum = signal.SIGTERM
  if signum == signal.SIGTERM and signum in _PENDING:
    return
  _PENDING.append(signum)
  if _PENDING.count(signal.SIGINT) > 1:
    sys.exit(130)


def main() -> None:
  """Entry point: records Ctrl-C, SIGTERM and SIGHUP (unless ``nohup`` ignores it), then runs
  the command as the process (`t5x_optim.cli.console_main`)."""
  signal.signal(signal.SIGINT, _record)
  signal.signal(signal.SIGTERM, _record)
  if _SIGHUP is not None and signal.getsignal(_SIGHUP) == signal.SIG_DFL:
    _TERMINAL.extend(fd for fd in (1, 2) if os.isatty(fd))
    signal.signal(_SIGHUP, _record)
  from t5x_optim.cli import _main  # noqa: PLC0415 - imported after the handlers on purpose

  _main.console_main(_PENDING)


if __name__ == "__main__":
  main()
