"""Implementation of `t5x_optim.distributed`, documented there."""

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
