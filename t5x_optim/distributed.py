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

from __future__ import annotations

from collections.abc import Sequence

import jax

__all__ = ["DEFAULT_HEARTBEAT_TIMEOUT_S", "DEFAULT_SHUTDOWN_TIMEOUT_S", "initialize"]

DEFAULT_HEARTBEAT_TIMEOUT_S = 10
DEFAULT_SHUTDOWN_TIMEOUT_S = 60


def _positive_seconds(name: str, value: object) -> int:
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"{name} must be a whole number of seconds >= 1, got {value!r}.")
  return value


def initialize(
  coordinator_address: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
  *,
  heartbeat_timeout_seconds: int = DEFAULT_HEARTBEAT_TIMEOUT_S,
  shutdown_timeout_seconds: int = DEFAULT_SHUTDOWN_TIMEOUT_S,
  initialization_timeout: int = 300,
  local_device_ids: int | Sequence[int] | None = None,
  cluster_detection_method: str | None = None,
  coordinator_bind_address: str | None = None,
) -> None:
  """`jax.distributed.initialize` with timeouts that bound a peer's failure.

  Call it in every process of the job, before any other jax call. Arguments
  left None are detected from the cluster environment (TPU, Slurm, Open MPI)
  as jax does.

  Args:
    coordinator_address: ``host:port`` of process 0's coordination service.
    num_processes: the number of processes in the job.
    process_id: this process's index, ``0 <= process_id < num_processes``.
    heartbeat_timeout_seconds: a process silent for this long is declared
      dead and every other process terminates with an error (jax: 100).
    shutdown_timeout_seconds: how long a process shutting down waits for
      the others (jax: 300).
    initialization_timeout: how long to wait for every process to connect.
    local_device_ids: restricts this process to these local devices.
    cluster_detection_method: as `jax.distributed.initialize`.
    coordinator_bind_address: as `jax.distributed.initialize`.

  Raises:
    ValueError: a timeout is not a whole number of seconds >= 1.
    RuntimeError: jax is already initialised (distributed, or a backend).
  """
  jax.distributed.initialize(
    coordinator_address=coordinator_address,
    num_processes=num_processes,
    process_id=process_id,
    local_device_ids=local_device_ids,
    cluster_detection_method=cluster_detection_method,
    initialization_timeout=_positive_seconds("initialization_timeout", initialization_timeout),
    heartbeat_timeout_seconds=_positive_seconds(
      "heartbeat_timeout_seconds", heartbeat_timeout_seconds
    ),
    shutdown_timeout_seconds=_positive_seconds(
      "shutdown_timeout_seconds", shutdown_timeout_seconds
    ),
    coordinator_bind_address=coordinator_bind_address,
  )
