"""The `t5x-optim` console script: Ctrl-C is caught before anything is imported.

Importing jax takes a while; a Ctrl-C during the import would otherwise end
in a KeyboardInterrupt traceback. This module imports nothing heavy, installs
a SIGINT handler that only records the signal, then imports the package and
hands the recorded signals to the command, which exits with status 130.

Run: ``t5x-optim ...`` or ``python -m t5x_optim_launcher ...``.
"""

import signal
import sys

_PENDING: list[int] = []


def _record(signum, frame):
  _PENDING.append(signum)
  if len(_PENDING) > 1:
    sys.exit(130)


def main() -> None:
  """Entry point: records Ctrl-C, then runs `t5x_optim.cli.main`."""
  signal.signal(signal.SIGINT, _record)
  from t5x_optim.cli import _main  # noqa: PLC0415 - imported after the handler on purpose

  sys.exit(_main.main(pending_signals=_PENDING))


if __name__ == "__main__":
  main()
