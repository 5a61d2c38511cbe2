"""Multi-process runs of `t5x-optim train`: flags, start-up and who writes.

JAX's multi-controller runtime runs the job: every process runs the same
program on its own devices, and the collectives of the jitted steps span
all of them. `start` connects the processes through
`t5x_optim.distributed.initialize` (a 10 s heartbeat, so a killed process
ends the others within about that) when ``--coordinator_address``,
``--num_processes`` or ``--process_id`` is given, or when the environment
is a multi-process job of a cluster that jax detects by itself (Slurm,
Open MPI, multi-host TPU); arguments left out are detected as jax does.

Before the job's first collective, `agree` all-gathers every process's
flags and parsed gin config (and what the command adds, such as a summary
of the text data each host reads): processes started with different jobs
stop there, each with one line naming the first difference. Then
`see_one_directory` checks that every process sees the model directory as
one directory, which every process writes its checkpoint shards to.

Only process 0 writes the log, TensorBoard events and ``config.gin``;
checkpoints are written by every process (each its own shards), once per
step, as orbax does.

Example:
  >>> import argparse
  >>> parser = argparse.ArgumentParser()
  >>> add_flags(parser)
  >>> wanted(parser.parse_args(['--num_processes', '2']), environ={})
  True
  >>> wanted(parser.parse_args([]), environ={'OMPI_COMM_WORLD_SIZE': '4'})
  True
  >>> wanted(parser.parse_args([]), environ={'SLURM_JOB_ID': '7', 'SLURM_NTASKS': '1'})
  False
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

from t5x_optim.cli.loop.interrupt import Interrupt

__all__ = ["add_flags", "agree", "is_primary", "see_one_directory", "several", "start", "wanted"]

_CLUSTER_SIZES = ("OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS")
DEFAULT_STARTUP_TIMEOUT_S = 300
"""How long a process waits for every process of the job to connect (jax's default)."""
_EXIT_BAD_START = 2
"""The command's status for bad input: processes that never all connect were given bad flags."""
_WAIT_NOTE_S = 5.0
"""A wait for the other processes longer than this is said on stdout."""


def add_flags(parser: argparse.ArgumentParser) -> None:
  """Adds ``--coordinator_address``, ``--num_processes`` and ``--process_id``."""
  group = parser.add_argument_group(
    "multi-process (JAX's multi-controller runtime)",
    "Run one process per host (or per group of devices), each with the same flags except "
    "--process_id. Left out, they are detected on Slurm, Open MPI and multi-host TPU.",
  )
  group.add_argument(
    "--coordinator_address",
    default=None,
    metavar="HOST:PORT",
    help="where process 0 runs the coordination service",
  )
  group.add_argument("--num_processes", type=int, default=None, metavar="N")
  group.add_argument("--process_id", type=int, default=None, metavar="I", help="0 <= I < N")
  group.add_argument(
    "--startup_timeout_seconds",
    type=int,
    default=DEFAULT_STARTUP_TIMEOUT_S,
    metavar="S",
    help=f"how long each process waits for all to connect (default {DEFAULT_STARTUP_TIMEOUT_S})",
  )


def _cluster_size(environ: Mapping[str, str]) -> int:
  for name in _CLUSTER_SIZES:
    value = environ.get(name, "")
    if value.isdigit():
      return int(value)
  hosts = environ.get("TPU_WORKER_HOSTNAMES", "")
  return len(hosts.split(",")) if hosts else 1


def wanted(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> bool:
  """Whether this run is one process of several: flags given, or a multi-process cluster job."""
  given = (args.coordinator_address, args.num_processes, args.process_id)
  environ = os.environ if environ is None else environ
  return any(value is not None for value in given) or _cluster_size(environ) > 1


_JOINED: dict[str, str | None] = {}
"""The coordinator address of the job this process joined through `start` (under
``"address"``): jax connects a process to one job, for the process's lifetime."""


def _other_job(args: argparse.Namespace) -> str | None:
  """Whether the flags name another job than the one this process joined: None when each
  flag given agrees with it, else one line naming the first that does not, with both sides."""
  import jax  # noqa: PLC0415

  count, index = jax.process_count(), jax.process_index()
  address = _JOINED.get("address")
  joined = {"coordinator_address": address, "num_processes": count, "process_id": index}
  for name, value in joined.items():
    given = getattr(args, name)
    if given is not None and value is not None and given != value:
      at = f" at {address}" if address else ""
      return (
        f"this process already joined a job of {count} processes as process {index}{at}, and "
        f"a process can join one job: --{name} {given} (the job's: {value}); start another "
        "process for another job."
      )
  return None


def start(args: argparse.Namespace, interrupt: Interrupt) -> None:
  """Connects this process to the others when `wanted`; call before any other jax call.

  jax waits in C++ for every process to connect, deaf to signals, and aborts
  the process when its time runs out. The wait runs in a thread instead, so
  that a Ctrl-C or SIGTERM (`interrupt`) ends it at once and the deadline
  (``--startup_timeout_seconds``) in one line; either ends the process there
  (``os._exit``), as jax's start-up cannot be abandoned. A process that
  joined a job already (an earlier command in it) stays in that job.

  Raises:
    ValueError: the flags do not describe a process of a job, or no
      ``--model_dir`` is given, or they name another job than the one this
      process joined (one line).
  """
  if not wanted(args):
    return
  if getattr(args, "model_dir", None) is None:
    raise ValueError(
      "--model_dir is required in a multi-process run: every process must write into the "
      "same directory."
    )
  count, index = args.num_processes, args.process_id
  if args.startup_timeout_seconds < 1:
    raise ValueError(
      f"--startup_timeout_seconds must be at least 1, got {args.startup_timeout_seconds}."
    )
  if count is not None and count < 1:
    raise ValueError(f"--num_processes must be at least 1, got {count}.")
  if index is not None and count is not None and not 0 <= index < count:
    raise ValueError(f"--process_id {index} is not in [0, {count}) (--num_processes {count}).")
  import jax  # noqa: PLC0415 - after the XLA flags are set

  from t5x_optim import distributed  # noqa: PLC0415

  if jax.distributed.is_initialized():
    problem = _other_job(args)
    if problem is not None:
      raise ValueError(problem)
    return
  # CPU devices of different processes exchange collectives through gloo.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  failed: list[BaseException] = []

  def connect() -> None:
    try:
      # jax's own deadline after this process's, which then ends the wait with its line.
      distributed.initialize(
        args.coordinator_address,
        num_processes=count,
        process_id=index,
        initialization_timeout=args.startup_timeout_seconds + 60,
      )
    except BaseException as error:  # noqa: BLE001 - handed to the main thread
      failed.append(error)

  thread = threading.Thread(target=connect, name="t5x-optim start-up", daemon=True)
  thread.start()
  _wait(thread, args, interrupt)
  if failed:
    error = failed[0]
    if not isinstance(error, (RuntimeError, ValueError)):
      raise error
    raise ValueError(f"multi-process start-up failed: {' '.join(str(error).split())}") from error
  _JOINED["address"] = args.coordinator_address


def _wait(thread: threading.Thread, args: argparse.Namespace, interrupt: Interrupt) -> None:
  """Waits for jax's start-up in `thread`, hearing `interrupt`, up to the flags' deadline; from
  `_WAIT_NOTE_S` on, says that it waits."""
  timeout, count = args.startup_timeout_seconds, args.num_processes or "N"
  where = args.coordinator_address or "the coordinator the cluster names"
  begun = time.monotonic()
  noted = False
  while thread.is_alive():
    thread.join(0.2)
    waited = time.monotonic() - begun
    if interrupt.requested:
      what = "preempted (SIGTERM)" if interrupt.preempted else "interrupted"
      _end(f"{what} while waiting for the job's processes; nothing was started.", interrupt)
    if waited >= timeout and thread.is_alive():
      _end(
        f"error: multi-process start-up failed: after {timeout} s, not every one of the job's "
        f"{count} processes had connected to the coordinator at {where} (process 0 runs it; "
        "each --process_id must run once, all with the same --coordinator_address and "
        "--num_processes); nothing was started.",
        None,
      )
    if not noted and waited >= _WAIT_NOTE_S and thread.is_alive():
      index = "?" if args.process_id is None else args.process_id
      print(
        f"process {index}: waiting for the job's {count} processes at {where} "
        f"(at most {timeout} s)",
        flush=True,
      )
      noted = True


def _end(line: str, interrupt: Interrupt | None) -> None:
  """Ends the process with `line` (after ``t5x-optim train: ``) while jax's start-up runs in
  its thread: 2, or the status of `interrupt`'s signal."""
  print(f"t5x-optim train: {line}", file=sys.stderr, flush=True)
  if interrupt is not None:
    interrupt.cancel()
  os._exit(_EXIT_BAD_START if interrupt is None else interrupt.exit_status)


def is_primary() -> bool:
  """Whether this is process 0, the one that writes logs, events and ``config.gin``."""
  import jax  # noqa: PLC0415

  return jax.process_index() == 0


def several() -> bool:
  """Whether this job runs as more than one process (after `start`)."""
  import jax  # noqa: PLC0415

  return jax.process_count() > 1


def _gather_texts(text: str) -> list[str]:
  """Every process's `text`, by process index (two small all-gathers)."""
  import numpy as np  # noqa: PLC0415
  from jax.experimental import multihost_utils  # noqa: PLC0415

  data = np.frombuffer(text.encode(), np.uint8)
  # int32, not int64: jax sends an int64 as 4 bytes, or as 8 with x64 enabled, and a process
  # with another jax_enable_x64 than its peers' must reach the comparison that names it.
  lengths = np.asarray(multihost_utils.process_allgather(np.array([data.size], np.int32)))
  padded = np.zeros(int(lengths.max()), np.uint8)
  padded[: data.size] = data
  gathered = np.asarray(multihost_utils.process_allgather(padded))
  return [bytes(row[: int(n)]).decode() for row, n in zip(gathered, lengths.reshape(-1))]


def _first_difference(
  mine: Mapping[str, str | None], theirs: Mapping[str, str | None], here: int, there: int
) -> str:
  """The first flag (or else gin binding) that differs, with both processes' values."""
  (low, first), (high, second) = sorted([(here, mine), (there, theirs)], key=lambda x: x[0])
  for name in sorted(set(mine) | set(theirs)):
    if name != "config" and mine.get(name) != theirs.get(name):
      return f"{name} is {first.get(name)} on process {low}, {second.get(name)} on process {high}"
  from t5x_optim.cli.loop.job import config_changes  # noqa: PLC0415

  changes = config_changes(first.get("config") or "", second.get("config") or "")
  shown = f" ({changes[0]}, process {low} -> process {high})" if changes else ""
  return f"the gin config differs{shown}"


def agree(flags: Mapping[str, str], config: str | None) -> str | None:
  """Compares this process's flags and parsed gin config with every other process's.

  Every process must call it, at the same point, before the job's first
  collective; `config` is None on a process whose config failed (then every
  process learns it, instead of waiting for it).

  Returns:
    None when every process has as many devices and the same flags and
    config; else one line naming the first difference with both sides.
  """
  import json  # noqa: PLC0415

  import jax  # noqa: PLC0415

  # Every process knows every device; the gather below needs as many on each process.
  counts = collections.Counter(device.process_index for device in jax.devices())
  if len(set(counts.values())) > 1:
    listed = ", ".join(f"{n} on process {i}" for i, n in sorted(counts.items()))
    return (
      f"the processes have other numbers of devices: {listed}; every process of a job needs "
      "as many (XLA_FLAGS, CUDA_VISIBLE_DEVICES, the host's accelerators)."
    )
  mine = {**flags, "config": config}
  texts = _gather_texts(json.dumps(mine, sort_keys=True))
  everyone = [json.loads(text) for text in texts]
  here = jax.process_index()
  failed = [i for i, other in enumerate(everyone) if other["config"] is None]
  if failed and config is not None:
    return (
      f"process {failed[0]} of {len(everyone)} could not read the job's flags or gin config "
      "(its own error says why); nothing was started."
    )
  for i, other in enumerate(everyone):
    if other != mine:
      return (
        f"the processes were started with different jobs: {_first_difference(mine, other, here, i)}"
        "; every process of a job needs the same flags (but --process_id), gin files, library "
        "versions, text data and checkpoints (one model directory that every host sees: a shared "
        "filesystem or gs://)."
      )
  return None


def see_one_directory(directory: Any, flag: str) -> str | None:
  """Checks that every process sees `directory` as one directory (a shared filesystem or gs://).

  Every process writes its shards of each checkpoint there, and process 0
  commits them: a host-local path (or a relative one from another working
  directory) lets the job train until its first save, where the other
  processes time out waiting for the directory process 0 made. Process 0
  writes an empty file of a random name, every process looks for it, and
  process 0 deletes it. Every process calls it at the same point, after
  `agree`.

  Args:
    directory: the directory (a `pathlib.Path` or `epath.Path`).
    flag: how the command line named it (``--model_dir run``).

  Returns:
    None when every process sees the file; else one line naming the first
    process that does not.
  """
  import secrets  # noqa: PLC0415

  marker = None
  if is_primary():
    marker = directory / f".t5x_optim_process_0_{secrets.token_hex(8)}"
    try:
      marker.write_text("")
    except OSError:  # The first save says why; the others must not wait here for the name.
      marker = None
  name = _gather_texts("" if marker is None else marker.name)[0]
  seen = _gather_texts("1" if not name or (directory / name).exists() else "0")
  if marker is not None:
    try:
      marker.unlink()
    except OSError:
      pass
  blind = [i for i, answer in enumerate(seen) if answer != "1"]
  if not blind:
    return None
  return (
    f"{flag} is not one directory for every process: process {blind[0]} does not see the file "
    "process 0 wrote there; every process of a job writes its checkpoint shards to one model "
    "directory, which every host must see (a shared filesystem or gs://)."
  )
