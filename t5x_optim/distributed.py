"""Multi-process start-up with bounded failure: `initialize`.

`jax.distributed.initialize` connects the processes of a job through a
coordination service run by process 0. Every process sends it heartbeats;
when a process has sent none for ``heartbeat_timeout_seconds``, the service
declares it dead and every other process terminates with

  Terminating process because the JAX distributed service detected fatal
  errors. This most likely indicates that another task died; ...

(printed on stderr, exit status 134: SIGABRT), instead of waiting forever in a
collective. jax's default is 100 s, so a job whose peer died runs on for
about 100 s; `initialize` sets 10 s, so every survivor exits within about 10 s
(measured with 2 CPU processes: 8-11 s after the other process was killed,
under 1 s when that was process 0, the coordinator). ``shutdown_timeout_seconds`` bounds
how long a process that reached `jax.distributed.shutdown` (or exit) waits
for the others: 60 s here instead of 300 s.

The knob: raise ``heartbeat_timeout_seconds`` where a healthy process may
fail to send heartbeats for that long (an overloaded host, a slow network);
heartbeats come from a C++ thread, so long Python or XLA work does not
delay them.

Example (each process of a 2-process job, before any other jax call):
  >>> from t5x_optim import distributed
  >>> distributed.initialize("127.0.0.1:1234", num_processes=2, process_id=0)  # doctest: +SKIP
"""

from t5x_optim._training.distributed import (
  DEFAULT_HEARTBEAT_TIMEOUT_S,
  DEFAULT_SHUTDOWN_TIMEOUT_S,
  initialize,
)

__all__ = ["DEFAULT_HEARTBEAT_TIMEOUT_S", "DEFAULT_SHUTDOWN_TIMEOUT_S", "initialize"]
