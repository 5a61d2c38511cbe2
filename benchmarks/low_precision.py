"""Benchmark: adamw with its state in float32, bfloat16 (stochastic rounding) and 8 bits.

Each run is the `t5x-optim train` job (the default transformer on the text task,
``--data``, default the shipped ``hamlet.txt``, or with ``--synthetic`` the CLI's
synthetic task; the default mesh) with one optimizer gin file:

* ``float32``: ``optimizers/adamw.gin``;
* ``bf16+SR``: ``optimizers/adamw_bf16_sr.gin``;
* ``8bit``: ``optimizers/adamw_8bit.gin``;
* ``4bit`` (only when ``--runs`` names it): ``optimizers/adamw_4bit.gin``;
* ``bf16 nearest`` (the negative control): ``adamw_bf16_sr.gin`` with
  ``optimizers.low_precision.stochastic_rounding = False``;
* ``8bit whole-tree``: ``adamw_8bit.gin`` with ``optimizers.low_precision.stream =
  False`` (every leaf decoded, updated and encoded at once: the same values, a
  higher peak, and no per-leaf conditional);
* ``4bit+f32emb``: ``adamw_4bit.gin`` with the params of a ``vocab`` logical axis (the
  token embedding and the logits) kept in float32
  (``optimizers.low_precision.param_modes = [('axis:vocab', 'float32')]``).

Every run trains ``--steps`` steps per seed (the seed sets the init and the
stochastic-rounding bits; the data stream is the task's own) with the job's
jitted step, timing each step after the first (compiling) one, and evaluates
the held-out loss every ``--eval_every`` steps. The runs of one seed are
interleaved in rounds of ``--eval_every`` steps, so that the machine's load
falls on all of them alike. The table gives, per run: the final eval loss
(mean and spread over seeds) and its ratio to float32, optimizer-state bytes
per param (all state leaves, and the compressed moments alone), bytes per
device of the job's mesh, and the median step time with its ratio to
float32, all measured in the same process. A second table gives the bytes per
param and per device (against the ideal, every byte once over the mesh) on a
2x4 mesh with ZeRO, from the abstract state as ``t5x-optim plan`` computes
them; ``--bytes_only`` prints that table alone, for the model the runs would
train (the same ``--larger`` and task: on text its vocabulary is the task's 256
bytes), and also for a T5-base-sized model (about 110M params). ``--png``
writes the eval-loss curves (matplotlib, imported only then). ``--json PATH`` writes each run's
results; ``--merge PATH...`` prints the table and plot of several such files
without training (e.g. one process per seed, on one accelerator).

Run: ``python benchmarks/low_precision.py [--steps 2000] [--seeds 0 1 2]
[--eval_every 100] [--num_devices 1] [--larger] [--png PATH] [--bytes_only]
[--data PATH | --synthetic] [--json PATH]``; ``python benchmarks/low_precision.py
--merge A.json B.json [--png PATH]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

RUNS = {
  "float32": ("optimizers/adamw.gin", []),
  "bf16+SR": ("optimizers/adamw_bf16_sr.gin", []),
  "8bit": ("optimizers/adamw_8bit.gin", []),
  "4bit": ("optimizers/adamw_4bit.gin", []),
  "bf16 nearest": (
    "optimizers/adamw_bf16_sr.gin",
    ["optimizers.low_precision.stochastic_rounding = False"],
  ),
  "8bit whole-tree": ("optimizers/adamw_8bit.gin", ["optimizers.low_precision.stream = False"]),
  "4bit+f32emb": (
    "optimizers/adamw_4bit.gin",
    ["optimizers.low_precision.param_modes = [('axis:vocab', 'float32')]"],
  ),
}
DEFAULT_RUNS = [run for run in RUNS if not run.startswith("4bit")]
"""The runs without ``--runs``: 4-bit is asked for by name."""
T5_BASE = [
  "cli.TransformerConfig.embed_dim = 768",
  "cli.TransformerConfig.mlp_dim = 3072",
  "cli.TransformerConfig.num_heads = 12",
  "cli.TransformerConfig.head_dim = 64",
  "cli.TransformerConfig.num_layers = 12",
  "VOCAB_SIZE = 32128",
]
"""A T5-base-sized model (about 110M params) whose state bytes are computed abstractly."""
LARGER = [
  "cli.TransformerConfig.embed_dim = 128",
  "cli.TransformerConfig.mlp_dim = 512",
  "cli.TransformerConfig.num_heads = 8",
  "cli.TransformerConfig.num_layers = 4",
  "VOCAB_SIZE = 128",
]


def _parse() -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--steps", type=int, default=2000)
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  parser.add_argument("--eval_every", type=int, default=100)
  parser.add_argument("--runs", nargs="+", default=DEFAULT_RUNS, choices=list(RUNS))
  parser.add_argument("--larger", action="store_true", help="a wider, deeper model: " + str(LARGER))
  parser.add_argument(
    "--num_devices", type=int, default=1, help="simulated CPU devices (ignored on an accelerator)"
  )
  parser.add_argument("--png", default=None, help="write the eval-loss curves here")
  parser.add_argument("--json", default=None, help="write each run's results here")
  parser.add_argument(
    "--merge",
    nargs="+",
    default=None,
    help="no training: the table and plot of the runs in these --json files (e.g. one per seed)",
  )
  parser.add_argument("--data", default="hamlet.txt", help="text file or directory")
  parser.add_argument("--synthetic", action="store_true", help="the synthetic task instead")
  parser.add_argument(
    "--bytes_only", action="store_true", help="print only the state bytes (abstract, no training)"
  )
  parser.add_argument(
    "--binding",
    action="append",
    default=[],
    help="a gin binding for every run (e.g. 'optimizers.low_precision.shard_multiple = 1')",
  )
  return parser.parse_args()


def _task_bindings(args: argparse.Namespace) -> list[str]:
  from t5x_optim.cli.loop import config as _config  # noqa: PLC0415

  return [] if args.synthetic else _config.data_bindings(args.data)


def _data(args: argparse.Namespace) -> str:
  return "synthetic task" if args.synthetic else f"text task ({args.data})"


def _state_bytes(abstract) -> tuple[int, int, int, int]:
  """Of an abstract state: total bytes, bytes per device, and the bytes and values of its
  compressed moments (8-bit and 4-bit codes and scales, bfloat16 leaves)."""
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  from t5x_optim._core.state_dict import key_path_parts  # noqa: PLC0415
  from t5x_optim._low_precision.low_precision import leaf_storage  # noqa: PLC0415

  storage = leaf_storage(abstract.param_states)
  total = per_device = compressed = values = 0
  for path, leaf in jax.tree.leaves_with_path(abstract.param_states):
    size = math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
    total += size
    per_device += math.prod(leaf.sharding.shard_shape(leaf.shape)) * np.dtype(leaf.dtype).itemsize
    stored = storage.get(key_path_parts(path), "")
    if stored.startswith(("8bit", "4bit", "bfloat16")):
      compressed += size
    if stored in ("8bit codes", "bfloat16"):
      values += math.prod(leaf.shape)
    if stored == "4bit codes":  # two values per byte
      values += 2 * math.prod(leaf.shape)
  return total, per_device, compressed, values


def timed_steps(setup, state, step: int, steps: int) -> tuple[object, int, list[float]]:
  """Trains `steps` steps of the job `setup` from `step`; returns the state, the step and the
  seconds of each step but the job's first (compiling) one."""
  import jax  # noqa: PLC0415

  times = []
  for _ in range(steps):
    batch = setup.train_batch(step)
    start = time.perf_counter()
    state, metrics = setup.step_fn(state, batch)
    jax.block_until_ready(metrics)
    if step:
      times.append(time.perf_counter() - start)
    step += 1
  return state, step, times


class _Run:
  """One optimizer's training run for one seed."""

  def __init__(self, name: str, seed: int, args: argparse.Namespace):
    import jax  # noqa: PLC0415

    from t5x_optim.cli.loop import config as _config
    from t5x_optim.cli.loop import train as _train  # noqa: PLC0415

    gin_file, bindings = RUNS[name]
    common = [
      f"TOTAL_STEPS = {args.steps}",
      f"cli.TrainJob.seed = {seed}",
      "cli.TrainJob.eval_batches = 8",
      *(LARGER if args.larger else []),
      *_task_bindings(args),
      *args.binding,
    ]
    if "low_precision" in (_config.GIN_DIR / gin_file).read_text():
      common.append(f"optimizers.low_precision.seed = {seed}")
    _config.parse_config(
      gin_files=[gin_file],
      gin_bindings=common + bindings,
      macros=_config.device_macros(args.num_devices),
    )
    self.setup = _train.prepare(_config.build_job())
    self.state = self.setup.create(*self.setup.init_args)
    self.seed = seed
    self.step = 0
    self.times: list[float] = []
    self.curve: list[tuple[int, float]] = []
    abstract = self.setup.abstract_state
    self.params = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract.params))
    self.total, self.per_device, self.compressed, self.compressed_values = _state_bytes(abstract)

  def train(self, steps: int) -> None:
    self.state, self.step, times = timed_steps(self.setup, self.state, self.step, steps)
    self.times += times

  def evaluate(self) -> float:
    from t5x_optim.cli.loop import train as _train  # noqa: PLC0415

    loss = _train._evaluate(self.setup, self.state)["loss"]
    self.curve.append((self.step, loss))
    return loss


def _abstract_state(name: str, model: list[str], extra: list[str]):
  """The job's abstract train state on a 2x4 mesh with ZeRO (nothing allocated)."""
  from t5x_optim.cli.loop import config as _config
  from t5x_optim.cli.loop import train as _train  # noqa: PLC0415

  gin_file, bindings = RUNS[name]
  _config.parse_config(
    gin_files=[gin_file, "partitioning/zero.gin"],
    gin_bindings=["TOTAL_STEPS = 10", *model, *extra, *bindings],
    macros=_config.device_macros(8),
  )
  return _train.prepare(_config.build_job()).abstract_state


def _print_bytes(names: list[str], model: list[str], extra: list[str], title: str) -> None:
  """State bytes per param and per device on a 2x4 mesh with ZeRO, against the ideal."""
  import jax  # noqa: PLC0415

  print(f"\n{title}, 2x4 mesh with ZeRO (abstract state, nothing allocated)")
  print(f"{'run':<14}{'B/param':>9}{'B/moment':>10}{'B/device':>14}{'ideal':>14}{'ratio':>7}")
  for name in names:
    state = _abstract_state(name, model, extra)
    params = sum(math.prod(x.shape) for x in jax.tree.leaves(state.params))
    total, per_device, compressed, values = _state_bytes(state)
    moment = compressed / values if values else 4.0
    print(
      f"{name:<14}{total / params:>9.3f}{moment:>10.3f}{per_device:>14,}"
      f"{total / 8:>14,.0f}{per_device / (total / 8):>7.3f}"
    )


def _record(run: _Run) -> dict:
  """What the table and the plot read of a finished run."""
  keys = ("seed", "curve", "times", "params", "total", "per_device", "compressed")
  return {k: getattr(run, k) for k in keys} | {"values": run.compressed_values}


def _train_all(args: argparse.Namespace) -> dict[str, list[dict]]:
  runs: dict[str, list[dict]] = {name: [] for name in args.runs}
  for seed in args.seeds:
    seed_runs = {name: _Run(name, seed, args) for name in args.runs}
    for run in seed_runs.values():
      run.evaluate()
    while any(run.step < args.steps for run in seed_runs.values()):
      for run in seed_runs.values():
        run.train(min(args.eval_every, args.steps - run.step))
        run.evaluate()
    for name, run in seed_runs.items():
      runs[name].append(_record(run))
      print(f"seed {seed} {name:<13} eval loss {run.curve[-1][1]:.4f}", flush=True)
  return runs


def _merged(paths: list[str]) -> tuple[dict[str, list[dict]], dict]:
  """The runs of several --json files, each name's seeds together, and their description;
  files that describe another model, task, step count or platform are refused."""
  runs: dict[str, list[dict]] = {}
  about = None
  for path in paths:
    with open(path) as f:
      saved = json.load(f)
    about = about or saved["about"]
    if saved["about"] != about:
      raise SystemExit(
        f"--merge: {path} has runs of '{saved['about']['line']}', the first file of "
        f"'{about['line']}'."
      )
    for name, records in saved["runs"].items():
      runs.setdefault(name, []).extend(records)
  ordered = [name for name in RUNS if name in runs]
  return {name: sorted(runs[name], key=lambda x: x["seed"]) for name in ordered}, about


def _print_table(runs: dict[str, list[dict]]) -> None:
  header = (
    f"{'run':<14}{'eval loss':>10}{'spread':>9}{'vs f32':>8}{'B/param':>9}{'B/moment':>10}"
    f"{'B/device':>10}{'ms/step':>9}{'speed vs f32':>14}"
  )
  print(header)
  base = runs.get("float32")
  base_loss = statistics.mean(r["curve"][-1][1] for r in base) if base else math.nan
  base_ms = statistics.median(t for r in base for t in r["times"]) * 1e3 if base else math.nan
  for name, seeds in runs.items():
    losses = [r["curve"][-1][1] for r in seeds]
    loss = statistics.mean(losses)
    run = seeds[0]
    per_moment = run["compressed"] / run["values"] if run["values"] else 4.0
    ms = statistics.median(t for r in seeds for t in r["times"]) * 1e3
    print(
      f"{name:<14}{loss:>10.4f}{max(losses) - min(losses):>9.4f}{loss / base_loss:>8.4f}"
      f"{run['total'] / run['params']:>9.3f}{per_moment:>10.3f}{run['per_device']:>10,}"
      f"{ms:>9.2f}{base_ms / ms:>14.3f}"
    )


def _plot(runs: dict[str, list[dict]], path: str, title: str) -> None:
  import matplotlib  # noqa: PLC0415

  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # noqa: PLC0415

  fig, ax = plt.subplots(figsize=(7, 4.5))
  for name, seeds in runs.items():
    steps = [s for s, _ in seeds[0]["curve"]]
    mean = [statistics.mean(r["curve"][i][1] for r in seeds) for i in range(len(steps))]
    ax.plot(steps[1:], mean[1:], label=f"{name} (mean of {len(seeds)} seeds)")
  ax.set_xlabel("step")
  ax.set_ylabel("eval loss")
  ax.set_yscale("log")
  ax.set_title(f"adamw state: float32 vs bfloat16 vs 8-bit vs 4-bit\n{title}")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  print(f"curves: {path}")


def main() -> None:
  args = _parse()
  if args.merge:
    runs, about = _merged(args.merge)
    print(about["line"])
    _print_table(runs)
    if args.png:
      _plot(runs, args.png, about["title"])
    return
  os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={max(args.num_devices, 8)}"
  import jax  # noqa: PLC0415

  model = [*(LARGER if args.larger else []), *_task_bindings(args)]
  if args.bytes_only:
    title = f"{'larger' if args.larger else 'default'} model, {_data(args)}"
    _print_bytes(args.runs, model, args.binding, title)
    _print_bytes(args.runs, T5_BASE, args.binding, "T5-base-sized model")
    return
  started = time.perf_counter()
  runs = _train_all(args)
  first = next(iter(runs.values()))[0]
  platform = jax.devices()[0].platform
  about = {
    "line": (
      f"{'larger' if args.larger else 'default'} model ({first['params']:,} params), "
      f"{_data(args)}, {args.steps} steps, {args.num_devices} {platform} device(s)"
    ),
    "title": f"{'larger model' if args.larger else 'default model'}, {_data(args)}",
  }
  print(f"\n{about['line']}, seeds {args.seeds}; {time.perf_counter() - started:.0f} s in all")
  _print_table(runs)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"about": about, "runs": runs}, f)
  if jax.device_count() >= 8:
    _print_bytes(args.runs, model, args.binding, "the same model")
  else:
    print(f"\n(the 2x4 mesh table needs 8 devices, {jax.device_count()} here: --bytes_only on CPU)")
  if args.png:
    _plot(runs, args.png, about["title"])


if __name__ == "__main__":
  main()
