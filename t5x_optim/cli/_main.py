"""`t5x-optim train` and `t5x-optim plan`: arguments, devices and error reporting.

Bad input (gin, a job that does not fit the mesh, an unusable model
directory, a checkpoint of another model) prints one line and exits with
status 2; ``--traceback`` shows the whole traceback instead. Ctrl-C at any
moment exits with status 130 and SIGTERM (a preemption) with 143, after
saving a checkpoint when a step ran. A non-finite loss, gradient norm or
update stops the run with status 3 (unless ``--on_nonfinite skip``) and is
never saved; any other failure inside the training loop saves the last state
and exits with status 1. Both print one line.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import io
import json
import logging
import os
import signal
import sys
import threading
import traceback
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import NoReturn

from t5x_optim.cli import _processes
from t5x_optim.cli.loop.interrupt import (
  DEFAULT_GRACE_SECONDS,
  EXIT_INTERRUPTED,
  EXIT_PREEMPTED,
  Interrupt,
)

__all__ = [
  "EXIT_CONFIG_ERROR",
  "EXIT_DIVERGED",
  "EXIT_FAILED",
  "EXIT_INTERRUPTED",
  "EXIT_PREEMPTED",
  "TRACEBACK_FILE",
  "console_main",
  "main",
  "simulate_cpu_devices",
]

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
DEFAULT_SIMULATED_DEVICES = 8
EXIT_FAILED = 1
EXIT_CONFIG_ERROR = 2
EXIT_DIVERGED = 3
TRACEBACK_FILE = "traceback.txt"
"""Where a failed run's traceback goes, in its model directory (process 0's)."""
_log = logging.getLogger("t5x_optim.cli")

_TRUST = (
  "Gin files are code: parsing one imports Python modules and calls what it names, "
  "so use only gin files you would trust as code."
)
_DESCRIPTION = f"""\
Train a tiny gin-configured transformer LM on a synthetic task or on text (train), or show
how its optimizer state shards without allocating it (plan).

Runs on whatever is there: every GPU or TPU core, or, without an accelerator,
{DEFAULT_SIMULATED_DEVICES} simulated CPU devices (--num_devices changes the count). The default mesh
is data x model with model=2 on an even device count, else model=1.

Gin file names are looked up in the current directory, then --gin_search_paths,
then the gin files shipped in the package (optimizers/, partitioning/, examples/).
{_TRUST}
"""
_TRAIN_DESCRIPTION = f"""\
Train on the synthetic task (or --data text) in MODEL_DIR (T5X's model-directory convention):
checkpoints in MODEL_DIR/checkpoints, TensorBoard events in MODEL_DIR/train and
MODEL_DIR/eval (tensorboard --logdir MODEL_DIR), the operative gin config in
MODEL_DIR/config.gin and, for each start, MODEL_DIR/config_<first step>.gin. A
MODEL_DIR with checkpoints resumes from its newest intact one (an incomplete or
corrupt one is set aside in MODEL_DIR/skipped_checkpoints), as the same job: another
model, optimizer or optimizer-state layout is refused (--init_from starts a new
MODEL_DIR from it); a finished run says so and exits 0. Ctrl-C saves a checkpoint
and exits 130; SIGTERM (a preemption) saves one and exits 143 within
--preemption_grace_seconds. A non-finite loss or gradient norm is never saved: the
run stops with status 3 (or skips the step: --on_nonfinite skip). Any other failure
in the loop saves the last finite state and exits 1. The compiled steps are kept in
MODEL_DIR/compilation_cache (--compilation_cache): a restart loads them instead of compiling.
{_TRUST}
"""


def simulate_cpu_devices(count: int) -> None:
  """Asks XLA for `count` host (CPU) devices unless XLA_FLAGS already sets a count.

  Takes effect only before jax initialises its backends; accelerators, when
  present, are still used instead.

  Example:
    >>> simulate_cpu_devices(8)
    >>> '--xla_force_host_platform_device_count' in os.environ['XLA_FLAGS']
    True
  """
  flags = os.environ.get("XLA_FLAGS", "")
  if _DEVICE_COUNT_FLAG not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {_DEVICE_COUNT_FLAG}={count}".strip()


def _positive(text: str) -> int:
  value = int(text)
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
  return value


def _non_negative(text: str) -> int:
  value = int(text)
  if value < 0:
    raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
  return value


def _seconds(text: str) -> float:
  value = float(text)
  if not value > 0:
    raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
  return value


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
  parser.add_argument(
    "--gin_file",
    action="append",
    default=[],
    type=_given,
    metavar="PATH",
    help="gin file to parse after the default config (repeatable); "
    "gin files are code: use only trusted ones",
  )
  parser.add_argument(
    "--gin_bindings",
    action="append",
    default=[],
    metavar="BINDING",
    help="gin binding applied after the files, e.g. 'TOTAL_STEPS = 50'",
  )
  parser.add_argument(
    "--gin_search_paths",
    action="append",
    default=[],
    type=_given,
    metavar="DIR",
    help="directory searched for gin files and includes (repeatable)",
  )
  parser.add_argument(
    "--data",
    type=_path_arg,
    default=None,
    metavar="FILE_OR_DIR",
    help="train a byte-level LM on this text file or directory of them (a shipped "
    "text by name: hamlet.txt) instead of the synthetic task; binds "
    "TASK = @cli.TextTask() and VOCAB_SIZE = 256",
  )
  parser.add_argument(
    "--num_devices",
    type=_positive,
    default=None,
    metavar="N",
    help="use N devices: the first N accelerators, or N simulated CPU "
    f"devices when there is no accelerator (default: all, or "
    f"{DEFAULT_SIMULATED_DEVICES} simulated)",
  )
  parser.add_argument(
    "--traceback", action="store_true", help="show the full traceback of configuration errors"
  )


def _given(text: str) -> str:
  """A path flag's value, ``~`` expanded; an empty one (an unset variable in a job's
  command) is refused: it would be the current directory."""
  if not text.strip():
    raise argparse.ArgumentTypeError(
      "empty, which would be the current directory (is a variable in the command unset?)"
    )
  return os.path.expanduser(text)


def _path_arg(text: str) -> Path | str:
  """A path flag's value: a `pathlib.Path`, or an `epath.Path` for ``gs://...`` and other schemes.

  A local path has ``~`` expanded (``~name`` of no user is left as
  written, as the shell leaves it) and stays relative: what reads it makes
  it absolute, and ``--data NAME`` is a shipped text where the working
  directory has no NAME. A path the storage layer refuses (a scheme
  without its package, ``#`` in a ``gs://`` path, ``gs:/bkt/run``) stays
  text, which `_check_path_flags` refuses in one line.
  """
  from t5x_optim import storage  # noqa: PLC0415

  expanded = _given(text)
  try:
    path = storage.as_path(text)
  except storage.StorageError:
    return text
  return Path(expanded) if storage.scheme_of(text) is None else path


_PATH_FLAGS = ("model_dir", "init_from", "data", "compilation_cache")
"""The flags whose values are paths (`_path_arg`)."""


def _check_path_flags(args: argparse.Namespace) -> None:
  """Refuses a path flag whose value `_path_arg` left as text (the storage layer refuses it),
  and ``--init_from_gin`` without ``--init_from``.

  Raises:
    ValueError: the flag and the storage layer's reason, in one line.
  """
  from t5x_optim import storage  # noqa: PLC0415

  for name in _PATH_FLAGS:
    value = getattr(args, name, None)
    if isinstance(value, str):
      try:
        storage.as_path(value)
      except storage.StorageError as error:
        raise ValueError(f"--{name} {error}") from error
  if getattr(args, "init_from_gin", None) and args.init_from is None:
    raise ValueError(
      "--init_from_gin configures the optimizer that wrote --init_from, which is not given: "
      "give --init_from too, or leave --init_from_gin out."
    )


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog="t5x-optim", description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  commands = parser.add_subparsers(dest="command", required=True)
  train = commands.add_parser(
    "train",
    help="train on the synthetic task or on text (--data)",
    description=_TRAIN_DESCRIPTION,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  _add_config_flags(train)
  train.add_argument(
    "--model_dir",
    type=_path_arg,
    default=None,
    help="the run's directory; resumed when it holds checkpoints "
    "(default: a new ./t5x_optim_runs/<date>-<time>)",
  )
  train.add_argument(
    "--metrics_every",
    type=_non_negative,
    default=None,
    metavar="N",
    help="write per-parameter metrics (RMS of params, gradients, updates and optimizer "
    "states) every N steps, 0 for none; binds cli.TrainJob.metrics_every (default 50)",
  )
  train.add_argument(
    "--init_from",
    type=_path_arg,
    default=None,
    metavar="DIR",
    help="start a new run from DIR's newest intact checkpoint (a t5x-optim or T5X model "
    "directory, any optimizer), or from one step of it (DIR/checkpoints/<step>, "
    "DIR/checkpoint_<step>): params exact, optimizer state converted; ignored, and "
    "said so, when --model_dir already holds checkpoints",
  )
  train.add_argument(
    "--init_from_gin",
    action="append",
    default=[],
    type=_given,
    metavar="PATH",
    help="gin file(s) configuring the optimizer that wrote --init_from (default: its "
    "config.gin; for a T5X directory, the optimizer bindings of the config.gin T5X wrote)",
  )
  train.add_argument(
    "--on_nonfinite",
    choices=("stop", "skip"),
    default=None,
    help="a step whose loss, gradient norm or updated params are not finite, or whose "
    "optimizer state holds a NaN: stop the run "
    "(status 3; it is never saved) or skip it (params and optimizer state unchanged, "
    "counted and logged; stops after cli.TrainJob.max_consecutive_skips in a row); binds "
    "cli.TrainJob.on_nonfinite (default stop)",
  )
  train.add_argument(
    "--preemption_grace_seconds",
    type=_seconds,
    default=None,
    metavar="S",
    help="after SIGTERM, save the current step and exit 143 within S seconds (past them, "
    "exit without that checkpoint); binds cli.TrainJob.preemption_grace_seconds "
    f"(default {DEFAULT_GRACE_SECONDS:g}; GKE's SIGKILL comes after 30)",
  )
  train.add_argument(
    "--compilation_cache",
    type=_path_arg,
    default=None,
    metavar="DIR",
    help="keep the compiled steps in DIR, so that a restart loads them instead of compiling "
    "(default: MODEL_DIR/compilation_cache, or jax's own JAX_COMPILATION_CACHE_DIR where "
    "set); 'none': no cache of the run's own",
  )
  _processes.add_flags(train)
  plan = commands.add_parser(
    "plan",
    help="show how the optimizer state shards (no training)",
    description=f"Show every optimizer-state leaf's shape, axes and bytes per device, "
    f"allocating nothing. {_TRUST}",
  )
  _add_config_flags(plan)
  plan.add_argument("--format", choices=("text", "json"), default="text")
  plan.add_argument(
    "--warn_replicated_bytes",
    type=int,
    default=1 << 20,
    help="flag replicated optimizer-state leaves of at least this many bytes",
  )
  return parser


_FLAG_BINDINGS = ("metrics_every", "on_nonfinite", "preemption_grace_seconds")


def _flag_bindings(args: argparse.Namespace) -> list[str]:
  """The ``cli.TrainJob`` bindings of the flags given (``--metrics_every`` and the like)."""
  return [
    f"cli.TrainJob.{name} = {getattr(args, name)!r}"
    for name in _FLAG_BINDINGS
    if getattr(args, name, None) is not None
  ]


def _error(command: str, message: str) -> int:
  print(f"t5x-optim {command}: error: {message}", file=sys.stderr)
  return EXIT_CONFIG_ERROR


def _raised_here(error: BaseException) -> bool:
  """Whether this package raised `error` itself: its messages name the argument at fault,
  where optax's or Python's (a binding of the wrong type) do not."""
  frame = error.__traceback__
  while frame is not None and frame.tb_next is not None:
    frame = frame.tb_next
  package = Path(__file__).resolve().parents[1]
  return frame is not None and Path(frame.tb_frame.f_code.co_filename).is_relative_to(package)


def _describe(error: BaseException) -> str:
  text = " ".join(str(error).split())
  if "In call to configurable '" in text:  # gin's note: gin and the config are loaded
    from t5x_optim.cli.loop import config as _config  # noqa: PLC0415

    text = _config.described_gin_error(text, call=not _raised_here(error))
  text = text or "(no message)"
  return text if isinstance(error, (ValueError, TypeError)) else f"{type(error).__name__}: {text}"


def _inside(path: str | os.PathLike[str], directory: str | os.PathLike[str]) -> bool:
  """Whether `path` is `directory` or below it (local paths resolved, others as written)."""
  path, directory = (
    os.fspath(Path(p).resolve()) if "://" not in os.fspath(p) else os.fspath(p).rstrip("/")
    for p in (path, directory)
  )
  return path == directory or path.startswith(directory.rstrip("/") + "/")


def _interrupted(command: str, interrupt: Interrupt) -> int:
  what = "preempted (SIGTERM)" if interrupt.preempted else "interrupted"
  print(f"t5x-optim {command}: {what} before the first step; nothing was saved.", file=sys.stderr)
  interrupt.cancel()
  return interrupt.exit_status


def _saved_text(saved: int | None, directory: str, note: str) -> str:
  if saved is None:
    return f"no checkpoint was written{f' ({note})' if note else ''}"
  latest = f"the latest checkpoint is step {saved} in {directory}"
  return f"{latest} (not the last state: {note})" if note else latest


def _loop_failed(args: argparse.Namespace, failure: Exception, model_dir, primary: bool) -> int:
  """One line for a failure inside the loop; the traceback goes to the model directory."""
  error = failure.error
  text = "".join(traceback.format_exception(error))
  _log.debug("t5x-optim train failed at step %d:\n%s", failure.step, text)
  where = ""
  if primary:
    try:
      (model_dir / TRACEBACK_FILE).write_text(text)
      where = f"; traceback in {model_dir / TRACEBACK_FILE}"
    except OSError:
      pass
  if args.traceback:
    print(text, file=sys.stderr, end="")
  saved = _saved_text(failure.saved, str(model_dir / "checkpoints"), failure.note)
  # After a save that failed, orbax's writer threads go on printing tracebacks for a while:
  # the line goes out in one write, and on a line of its own whatever they left half written.
  lead = "\n" if failure.note else ""
  sys.stderr.write(
    f"{lead}t5x-optim train: error at step {failure.step}: {type(error).__name__}: "
    f"{' '.join(str(error).split())}; {saved}{where}\n"
  )
  return EXIT_FAILED


def _devices(requested: int | None, label: str = "--num_devices") -> tuple[int, str]:
  """(device count to use, its description); raises ValueError when too few exist.

  ``label`` names where ``requested`` comes from: the flag, or the gin config's count.
  """
  import jax  # noqa: PLC0415 - after the XLA flags are set

  devices = jax.devices()
  platform = devices[0].platform
  if requested is not None and requested > len(devices):
    raise ValueError(f"{label} {requested}: only {len(devices)} {platform} devices are available.")
  count = len(devices) if requested is None else requested
  kind = "cpu (simulated)" if platform == "cpu" else devices[0].device_kind
  processes = jax.process_count()
  if processes > 1 and count != len(devices):
    raise ValueError(
      f"{label} {requested}: a run of {processes} processes uses every device of every "
      f"process, {len(devices)} here ({len(devices) // processes} per process); leave "
      f"{label} out or set it to {len(devices)}."
    )
  spread = f" in {processes} processes of {count // processes}" if processes > 1 else ""
  return count, f"{count} x {kind}{spread}"


def _gin_devices(flag: int | None, configured: int) -> tuple[int, str]:
  """`_devices` for a count the parsed gin config binds apart from the flag's or every
  device's; refused against ``--num_devices`` (the flag's count beats a gin file's, so only
  ``--gin_bindings`` can bind another)."""
  if flag is not None:
    raise ValueError(
      f"--num_devices {flag}, but the gin config binds NUM_DEVICES = {configured} "
      "(cli.mesh_devices.count); give one of the two."
    )
  return _devices(configured, label="the gin config's NUM_DEVICES")


def _keep_edited_config(model_dir: Path) -> Path | None:
  """`keep_edited_config` of `model_dir`, unless the run's config parse (the last one) read its
  config file (given, found in a search path, or included); the kept copy, or None."""
  from t5x_optim.cli.loop import config as _config  # noqa: PLC0415
  from t5x_optim.cli.loop import job as _job  # noqa: PLC0415

  config = model_dir / _job.CONFIG_FILE
  if any(_inside(path, config) for path in _config.files_read()):
    return None
  return _job.keep_edited_config(model_dir)


def _param_routes(abstract_state) -> list[str]:
  """Where each param goes, for optimizers that decide it from the axes (muon: muon or adam),
  alone or inside a MultiOptimizer (nested ones included)."""
  optimizer_def = abstract_state.optimizer.optimizer_def
  if not _places_by_axes(optimizer_def):
    return []
  return optimizer_def.describe_params(abstract_state.params)


def _places_by_axes(optimizer_def) -> bool:
  """Whether `optimizer_def`, or a sub-optimizer of a MultiOptimizer at any depth, decides
  where its params go from their axes."""
  subs = getattr(optimizer_def, "sub_optimizers", None)
  if subs is not None:
    return any(map(_places_by_axes, subs))
  return getattr(optimizer_def, "param_specs", None) is not None


def _run_plan(args: argparse.Namespace, setup) -> int:
  from t5x_optim import partitioning as _plan  # noqa: PLC0415
  from t5x_optim.cli.loop import train as _train  # noqa: PLC0415

  plan = _plan.build_plan(
    setup.abstract_state,
    logical=setup.abstract_state.as_logical_axes(),
    warn_replicated_bytes=args.warn_replicated_bytes,
  )
  memory = _train.step_memory(setup)
  routes = _param_routes(setup.abstract_state)
  if args.format == "json":
    extra = {"train_step_bytes_per_device": memory} | ({"param_routes": routes} if routes else {})
    print(json.dumps(_plan.plan_to_json(plan) | extra, indent=2))
  else:
    if routes:
      print(f"update rule per param ({len(routes)} params, from their logical axes):")
      print("\n".join(f"  {line}" for line in routes) + "\n")
    print(_plan.format_table(plan))
    print(
      f"train step: peak {_plan.format_bytes(memory['peak'])} per device, {memory['steps']} "
      f"(XLA's memory analysis of the compiled step: arguments "
      f"{_plan.format_bytes(memory['arguments'])} + "
      f"outputs {_plan.format_bytes(memory['outputs'])} + temporaries "
      f"{_plan.format_bytes(memory['temporaries'])} - donated "
      f"{_plan.format_bytes(memory['aliased'])}); optimizer state at rest "
      f"{_plan.format_bytes(plan.bytes_per_device)}"
    )
  return 0


def _fail(args: argparse.Namespace, error: Exception) -> int:
  if args.traceback:  # the error's own traceback: it may have been caught before this call
    traceback.print_exception(error)
  return _error(args.command, _describe(error))


def _refuse_unread(unread: Sequence[tuple[str, str]], flags: Mapping[str, str]) -> None:
  """Refuses the bindings the built job never read (`config.unread_bindings`): a binding that
  changes nothing is a mistake (a configurable the run does not call, a mistyped macro). A
  binding a flag made is named as that flag (`flags`: ``--data hamlet.txt``)."""
  if unread:
    raise ValueError(
      "; ".join(
        f"{flags.get(binding) or f'--gin_bindings {binding!r}'} binds what this run never "
        f"reads: {reason}"
        for binding, reason in unread
      )
      + ". Nothing was trained or saved: remove it, or bind what the run calls."
    )


def _same_job_flags(args: argparse.Namespace) -> dict[str, str]:
  """The flags every process of a job must share: all but ``--process_id``, ``--traceback``
  and ``--startup_timeout_seconds`` (how long one process waits for the others)."""
  own = ("process_id", "traceback", "command", "startup_timeout_seconds")
  return {
    f"--{name}": repr(value if not isinstance(value, Path) else str(value))
    for name, value in sorted(vars(args).items())
    if name not in own
  }


def _check_cache_flag(directory: Path | str | None) -> None:
  """Creates ``--compilation_cache``'s directory, before the processes of a job compare their
  flags: one that cannot be created stops every process, in one line."""
  if directory is None or str(directory) == "none":
    return
  try:
    directory.mkdir(parents=True, exist_ok=True)
  except (OSError, AttributeError) as error:
    raise ValueError(f"--compilation_cache {directory} is not usable: {error}") from error


def _cache_directory(args: argparse.Namespace, model_dir: Path) -> tuple[Path | None, str]:
  """The run's compilation-cache directory (None: none of its own), and how the banner says it."""
  import jax  # noqa: PLC0415 - after the XLA flags are set

  if args.compilation_cache is None and not jax.config.jax_enable_compilation_cache:
    return None, "none (jax's JAX_ENABLE_COMPILATION_CACHE is off)"
  if args.compilation_cache is None and jax.config.jax_compilation_cache_dir is not None:
    return None, f"{jax.config.jax_compilation_cache_dir} (jax's JAX_COMPILATION_CACHE_DIR)"
  if str(args.compilation_cache) == "none":
    return None, "none"
  directory = args.compilation_cache or model_dir / "compilation_cache"
  return directory, str(directory)


def _absent_directories(path: Path | str | None) -> list[Path]:
  """`path` and those of its parents that do not exist yet, deepest first (a local path only:
  an object store keeps no empty directories)."""
  if not isinstance(path, Path) or str(path) == "none":
    return []
  absent = []
  for directory in (path.absolute(), *path.absolute().parents):
    if directory.exists():
      break
    absent.append(directory)
  return absent


def _remove_if_empty(directories: Sequence[Path]) -> None:
  """Removes those of `directories` (made by the command) that it left empty, deepest first."""
  for directory in sorted(set(directories), key=lambda path: len(path.parts), reverse=True):
    with contextlib.suppress(OSError):  # not empty, or gone: kept as it is
      directory.rmdir()


def _run(args: argparse.Namespace, interrupt: Interrupt) -> int:
  """Runs the command; the directories it made for its flags and left empty (a configuration
  error stops it before it writes) are removed again."""
  made = [
    *_absent_directories(getattr(args, "model_dir", None)),
    *_absent_directories(getattr(args, "compilation_cache", None)),
  ]
  try:
    return _run_command(args, interrupt)
  finally:
    _remove_if_empty(made)


def _run_command(args: argparse.Namespace, interrupt: Interrupt) -> int:
  try:
    _check_path_flags(args)
    if args.command == "train":
      _processes.start(args, interrupt)
  except ValueError as error:
    return _fail(args, error)
  import gin  # noqa: PLC0415

  from t5x_optim.cli.loop import compilation_cache as _compilation_cache  # noqa: PLC0415
  from t5x_optim.cli.loop import config as _config  # noqa: PLC0415
  from t5x_optim.cli.loop import job as _job  # noqa: PLC0415
  from t5x_optim.cli.loop import train as _train  # noqa: PLC0415 - after the XLA flags are set

  train = args.command == "train"
  failure = None
  same_data: dict[str, str] = {}
  text = text_seen = None
  try:
    model_dir = _train.prepare_model_dir(args.model_dir) if train and args.model_dir else None
    if train:
      _check_cache_flag(args.compilation_cache)
    count, devices = _devices(args.num_devices)
    source = None
    if train and args.init_from:
      from t5x_optim.cli import _init_from  # noqa: PLC0415

      source = _init_from.source_optimizer(
        args.init_from, args.init_from_gin, args.gin_search_paths, _config.device_macros(count)
      )
    data = []
    if args.data is not None:
      from t5x_optim.cli.demo import text as _text  # noqa: PLC0415

      data = _config.data_bindings(_text.resolve_data_path(args.data, label="--data"))
      _text.scan_text(args.data, label="--data")
    # The flag's count beats a gin file's (a resumed run's config.gin binds one).
    flag_count = [] if args.num_devices is None else [f"NUM_DEVICES = {args.num_devices}"]
    flags = {binding: f"--data {args.data}" for binding in data}
    flags.update({binding: f"--num_devices {args.num_devices}" for binding in flag_count})
    for binding in _flag_bindings(args):
      name = binding.partition(" = ")[0].rpartition(".")[2]
      flags[binding] = f"--{name} {getattr(args, name)}"
    parse = functools.partial(
      _config.parse_config,
      gin_files=args.gin_file,
      gin_bindings=[*data, *flag_count, *_flag_bindings(args), *args.gin_bindings],
      search_paths=args.gin_search_paths,
    )
    parse(macros=_config.device_macros(count))
    configured = _config.configured_device_count()
    if configured is not None and configured != count:
      count, devices = _gin_devices(args.num_devices, configured)
      parse(macros=_config.device_macros(count))  # the default mesh of that count
    text = _config.text_data_path() if train or _processes.several() else None
    if text is not None:
      from t5x_optim.cli.demo import text as _text  # noqa: PLC0415

      label = "--data" if args.data is not None else "cli.TextTask.path"
      text_seen = _text.data_summary(text, label=label)
      if train and model_dir is not None and _inside(model_dir, text):
        raise ValueError(
          f"{label} {text} holds --model_dir {model_dir}: the run would read its own "
          "checkpoints and logs as text; put the model directory elsewhere."
        )
    if _processes.several():
      # Each host runs its own installed libraries and jax settings, reads its own copy of the
      # text, and its own view of the model and source directories (a host-local or relative
      # path may be another directory on one host): what each has and sees must agree too.
      for name, version in _job.package_versions().items():
        same_data[f"the version of {name}"] = version
      for name, value in _job.jax_settings().items():
        same_data[f"jax's setting {name}"] = value
      if text is not None:
        same_data[f"the text data at {text}"] = text_seen
      if model_dir is not None:
        checkpoints = _train.steps_seen(model_dir / _train.CHECKPOINTS)
        same_data[f"the checkpoint list of --model_dir {args.model_dir}"] = checkpoints
      if source is not None:
        checkpoints = _init_from.checkpoints_seen(source)
        same_data[f"the checkpoint list of --init_from {args.init_from}"] = checkpoints
        restored = _init_from.restored_seen(source)
        same_data[f"the checkpoint that --init_from {args.init_from} restores"] = restored
        optimizer = _init_from.source_seen(source)
        same_data[f"the source optimizer of --init_from {args.init_from}"] = optimizer
  except Exception as error:  # noqa: BLE001 - every configuration error gets one line
    failure = error
  if _processes.several():
    # Before the first collective of the job: every process, failed or not, compares.
    config = None if failure is not None else gin.config_str()
    mismatch = _processes.agree({**_same_job_flags(args), **same_data}, config)
    if mismatch is not None and failure is None:
      return _error(args.command, mismatch)
    if failure is None and model_dir is not None:
      blind = _processes.see_one_directory(model_dir, f"--model_dir {args.model_dir}")
      if blind is not None:
        return _error(args.command, blind)
  if failure is not None:
    return _fail(args, failure)
  primary = _processes.is_primary()
  try:
    _config.check_mesh_pin(count)
    identity = _config.optimizer_identity()
    job = _config.build_job()
    rate_from = _config.learning_rate_source()
    setup = _train.prepare(job)
    _refuse_unread(_config.unread_bindings(), flags)
    initial_state = None
    if train and args.init_from:
      initial_state = _init_from.initial_state_fn(
        source,
        setup.abstract_state,
        sys.stdout if primary else io.StringIO(),
        target_hparams=_init_from.bound_hparams(),
        model=dataclasses.asdict(job.model),
      )
    if train and model_dir is None:
      model_dir = _train.prepare_model_dir(_train.default_model_dir())
  except Exception as error:  # noqa: BLE001 - every configuration error gets one line
    return _fail(args, error)
  if _train.agreed_stop(interrupt):
    return _interrupted(args.command, interrupt)
  if args.command == "plan":
    return _run_plan(args, setup)
  about = _train.describe_setup(
    setup, devices=devices, optimizer=_config.describe_optimizer(), learning_rate=rate_from
  )
  cache, cache_text = _cache_directory(args, model_dir)
  interrupt.set_grace(setup.job.preemption_grace_seconds)
  config_text = gin.operative_config_str()
  record = _job.job_record(
    model=job.model,
    optimizer=identity,
    abstract_state=setup.abstract_state,
    config_text=config_text,
    data=text_seen,
  )
  use = None
  with contextlib.ExitStack() as stack:
    try:
      # Before the compilation cache, which lives in the model directory by default: a run
      # refused there must not rewrite the cache's record or delete an entry being written.
      stack.enter_context(_train.one_run_at_a_time(model_dir))
    except _train.UsageError as error:
      return _fail(args, error)
    kept = _keep_edited_config(model_dir) if primary else None
    if kept is not None:
      about = [
        *about,
        f"{_job.CONFIG_FILE}:      edited by hand, not read (a run reads --gin_file and "
        f"--gin_bindings); kept as {kept}",
      ]
    try:
      if cache is not None:
        use = stack.enter_context(_compilation_cache.compilation_cache(cache, primary=primary))
    except OSError as error:
      # Only an optimization: the run goes on, as every other process of the job does.
      print(
        f"t5x-optim train: warning: no compilation cache ({cache}: {error}); compiling as usual",
        file=sys.stderr,
      )
      cache_text = "none (the warning above says why)"
    about = [*about, f"compile cache:   {cache_text}"]
    try:
      summary = _train.train(
        setup,
        model_dir=model_dir,
        interrupt=interrupt,
        about=about,
        config_text=config_text,
        stream=None if primary else io.StringIO(),
        initial_state=initial_state,
        write_events=primary,
        job=record,
        init_from=None if args.init_from is None else str(args.init_from),
        lock=False,
      )
    except _train.UsageError as error:
      return _fail(args, error)
    except _train.Interrupted:
      return _interrupted(args.command, interrupt)
    except _train.Diverged as error:
      print(
        f"t5x-optim train: error: {error.message(str(model_dir / 'checkpoints'))}",
        file=sys.stderr,
      )
      return EXIT_DIVERGED
    except _train.LoopFailed as failure:
      return _loop_failed(args, failure, model_dir, primary)
    finally:
      interrupt.cancel()
  if primary and not summary.finished_before:
    print(summary.format())
    if use is not None and (use.loaded or use.removed):
      print(use.format())
    if args.model_dir is None and (summary.preempted or summary.interrupted):
      # The next run without --model_dir would start afresh in a directory of its own.
      print(f"to resume:       rerun with --model_dir {model_dir}")
  if summary.preempted:
    return EXIT_PREEMPTED
  return EXIT_INTERRUPTED if summary.interrupted else 0


def main(argv: Sequence[str] | None = None, *, pending_signals: list[int] | None = None) -> int:
  """Runs the command line; returns the exit status.

  Each call shows its warnings as a process of its own would: a warning the
  package raises names the caller's line, which Python would otherwise show
  once per process, at the first call only. The warnings filters are the
  caller's. A call replaces the process's gin config (gin keeps one, and
  offers no way to set it aside): the caller's bindings are cleared, and the
  command's stay parsed after it returns. In a process of a multi-process job
  (``--coordinator_address``, ``--num_processes``, ``--process_id``), the
  first call joins the job and later calls run in it: jax connects a process
  to one job for its lifetime, so a call whose flags name another job is
  refused in one line.

  Args:
    argv: the arguments (default: ``sys.argv[1:]``).
    pending_signals: SIGINTs and SIGTERMs recorded before this call (by the
      launcher); when given, this call installs the Ctrl-C, SIGTERM and
      SIGHUP handlers that the command checks between steps, and puts the
      caller's back when it returns or raises.

  Example:
    >>> main(['plan', '--gin_bindings', "cli.TrainJob.total_steps = 'ten'"])
    2
  """
  with warnings.catch_warnings():  # Python forgets the warnings it showed when filters change
    return _main(argv, pending_signals, keep_handlers=False)


def _main(
  argv: Sequence[str] | None, pending_signals: list[int] | None, *, keep_handlers: bool
) -> int:
  """`main`; with `keep_handlers`, the command's signal handlers stay installed after it."""
  args = _parser().parse_args(argv)
  simulate_cpu_devices(args.num_devices or DEFAULT_SIMULATED_DEVICES)
  grace = getattr(args, "preemption_grace_seconds", None) or DEFAULT_GRACE_SECONDS
  interrupt = Interrupt(pending_signals, grace_seconds=grace)
  if pending_signals is None:
    return _run(args, interrupt)
  interrupt.install()
  try:
    if interrupt.requested:
      return _interrupted(args.command, interrupt)
    return _run(args, interrupt)
  finally:
    if not keep_handlers:
      interrupt.uninstall()


_STRAGGLER_WAIT_S = 10.0
"""How long a failed command's process waits for threads that outlive it before it exits."""


def _end_now(status: int) -> None:
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(status)


def exit_process(status: int) -> NoReturn:
  """Ends the process with the command's `status`, as ``sys.exit`` does, except that after a
  failure the threads that outlive the command get `_STRAGGLER_WAIT_S`, not as long as they
  take: a checkpoint save that failed in the background (the directory gone, no inodes left)
  leaves orbax's threads, some started as Python shuts down, waiting 300 s for a signal it
  never sends, and Python waits for them before it exits.

  SIGTERM and SIGHUP are ignored from here on: the command has ended, and Python's shutdown
  would put the default handlers back while jax tears down (a second or more; with several
  processes, until every process reaches the shutdown), so that a scheduler's repeated
  SIGTERM killed a process that had saved and was exiting with its status."""
  for ended in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
    if ended is not None:
      signal.signal(ended, signal.SIG_IGN)
  if status:
    watchdog = threading.Timer(_STRAGGLER_WAIT_S, _end_now, args=(status,))
    watchdog.daemon = True
    watchdog.start()
  sys.exit(status)


def console_main(pending_signals: list[int] | None = None) -> None:
  """The command of ``sys.argv`` as the process, ended by `exit_process`: ``python -m
  t5x_optim``, and the `t5x-optim` script, which passes the signals it recorded while the
  package was imported (see ``t5x_optim_launcher``). The command's signal handlers stay until
  the process ends: a second Ctrl-C while it shuts down quits at once. A warning that names
  a line of what started the command (the script, ``runpy``) shows as one line of its own,
  ``t5x-optim: warning: ...``: the package's warnings name their caller's line, and here the
  caller is the command line."""
  entry, frame = {"sys"}, sys._getframe(1)
  while frame is not None:
    entry.add(frame.f_code.co_filename)
    frame = frame.f_back
  warnings.showwarning = _shown_as_the_commands(warnings.showwarning, frozenset(entry))
  exit_process(_main(None, [] if pending_signals is None else pending_signals, keep_handlers=True))


def _shown_as_the_commands(show: Callable[..., None], entry: frozenset[str]) -> Callable[..., None]:
  """`warnings.showwarning` that shows a warning attributed to a file of `entry` as
  ``t5x-optim: warning: <message>`` (``t5x-optim: <Category>: ...`` unless a
  ``UserWarning``), and others as `show` does.

  Example:
    >>> python = lambda message, category, filename, lineno, *_: print(f"{filename}:{lineno}: ...")
    >>> shown = _shown_as_the_commands(python, frozenset({"<frozen runpy>"}))
    >>> shown(UserWarning("careful"), UserWarning, "<frozen runpy>", 88, sys.stdout)
    t5x-optim: warning: careful
    >>> shown(UserWarning("mine"), UserWarning, "/home/me/job.py", 3)
    /home/me/job.py:3: ...
  """

  def showwarning(message, category, filename, lineno, file=None, line=None):
    if filename not in entry:
      show(message, category, filename, lineno, file, line)
      return
    kind = "warning" if category is UserWarning else category.__name__
    try:
      print(f"t5x-optim: {kind}: {message}", file=sys.stderr if file is None else file)
    except OSError:  # Python's own ignores a stream that is gone (a closed terminal)
      pass

  return showwarning
