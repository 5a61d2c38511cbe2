"""`t5x-optim train` and `t5x-optim plan`: argument parsing and error reporting.

Configuration errors (bad gin, wrong types, a job that does not fit the mesh)
print one clear message and exit with status 2; ``--traceback`` shows the
whole traceback instead. A run stopped by Ctrl-C saves a checkpoint and
exits with status 130.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback
from collections.abc import Sequence
from pathlib import Path

from t5x_optim import _plan
from t5x_optim.cli import _config, _train

__all__ = ["console_main", "main", "simulate_cpu_devices"]

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
EXIT_CONFIG_ERROR = 2
EXIT_INTERRUPTED = 130


def simulate_cpu_devices(count: int) -> None:
  """Asks XLA for `count` host (CPU) devices unless XLA_FLAGS already sets it.

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


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--gin_file", action="append", default=[], metavar="PATH",
                      help="gin file to parse after the default config (repeatable)")
  parser.add_argument("--gin_bindings", action="append", default=[], metavar="BINDING",
                      help="gin binding applied after the files, e.g. 'TOTAL_STEPS = 50'")
  parser.add_argument("--gin_search_paths", action="append", default=[], metavar="DIR",
                      help="directory searched for gin files and includes (repeatable)")
  parser.add_argument("--num_devices", type=int, default=8,
                      help="simulated CPU devices when no accelerator is present (default 8)")
  parser.add_argument("--traceback", action="store_true",
                      help="show the full traceback of configuration errors")


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="t5x-optim",
      description="Train a tiny gin-configured transformer LM, or plan an optimizer "
                  "state's sharding.")
  commands = parser.add_subparsers(dest="command", required=True)
  train = commands.add_parser("train", help="train on the synthetic task")
  _add_config_flags(train)
  train.add_argument("--model_dir", type=Path,
                     default=Path(tempfile.gettempdir()) / "t5x_optim" / "train",
                     help="checkpoints go to MODEL_DIR/checkpoints")
  train.add_argument("--resume", action="store_true",
                     help="continue from the latest checkpoint in --model_dir")
  plan = commands.add_parser("plan", help="show how the optimizer state shards (no training)")
  _add_config_flags(plan)
  plan.add_argument("--format", choices=("text", "json"), default="text")
  plan.add_argument("--warn_replicated_bytes", type=int, default=1 << 20,
                    help="flag replicated optimizer-state leaves of at least this many bytes")
  return parser


def _error(args: argparse.Namespace, message: str) -> int:
  print(f"t5x-optim {args.command}: error: {message}", file=sys.stderr)
  return EXIT_CONFIG_ERROR


def _describe(error: BaseException) -> str:
  text = str(error).strip() or "(no message)"
  return text if isinstance(error, (ValueError, TypeError)) else f"{type(error).__name__}: {text}"


def _configure(args: argparse.Namespace) -> _train.Setup:
  """Parses the gin config and prepares the job (raises on a bad config)."""
  _config.parse_config(gin_files=args.gin_file, gin_bindings=args.gin_bindings,
                       search_paths=args.gin_search_paths)
  return _train.prepare(_config.build_job())


def _run_plan(args: argparse.Namespace, setup: _train.Setup) -> int:
  plan = _plan.build_plan(setup.abstract_state, logical=setup.abstract_state.as_logical_axes(),
                          warn_replicated_bytes=args.warn_replicated_bytes)
  if args.format == "json":
    print(json.dumps(_plan.plan_to_json(plan), indent=2))
  else:
    print(_plan.format_table(plan))
  return 0


def _run_train(args: argparse.Namespace, setup: _train.Setup) -> int:
  try:
    summary = _train.train(setup, model_dir=args.model_dir, resume=args.resume)
  except _train.UsageError as error:
    return _error(args, str(error))
  print(summary.format())
  return EXIT_INTERRUPTED if summary.interrupted else 0


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the command line; returns the exit status.

  Example:
    >>> main(['plan', '--gin_bindings', "cli.TrainJob.total_steps = 'ten'"])
    2
  """
  args = _parser().parse_args(argv)
  simulate_cpu_devices(args.num_devices)
  try:
    setup = _configure(args)
  except Exception as error:  # noqa: BLE001 - every configuration error gets one message
    if args.traceback:
      traceback.print_exc()
    return _error(args, _describe(error))
  return _run_plan(args, setup) if args.command == "plan" else _run_train(args, setup)


def console_main() -> None:
  """The `t5x-optim` console script."""
  sys.exit(main())
