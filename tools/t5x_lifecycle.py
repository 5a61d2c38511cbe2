"""A T5X job's whole life through T5X's own entry points, with T5X's optimizers and with ours.

Runs T5X's ``t5x/train.py``, ``t5x/eval.py`` and ``t5x/infer.py`` in fresh
processes, with gin files that include T5X's own configs
(``t5x/examples/t5/byt5/base.gin`` shrunk to a tiny model, and
``t5x/configs/runs/pretrain.gin``), on a small in-memory seqio task (reverse a
word, byte vocabulary, so nothing is downloaded). Every stage runs in three
columns:

* ``t5x``: T5X as it is, the gin file says ``from t5x import optimizers``;
* ``gin``: T5X untouched, only the gin import says ``from t5x_optim import optimizers``;
* ``module``: ``t5x/optimizers.py`` replaced by a re-export of
  ``t5x_optim.optimizers`` (so T5X's legacy ``adafactor.Adafactor`` subclasses
  our ``OptimizerDef``); the gin file is T5X's.

Stages (each in its own model directory, runs in order):

* ``pretrain``: train 4 steps from scratch (checkpoints every 2 steps, Orbax).
* ``resume``: train again in a copy of that model_dir to step 8, as a job
  restarted after preemption does (Orbax checkpointer, float32 save dtype).
* ``resume_legacy``: the same with ``train.use_orbax = False`` (T5X's legacy
  checkpointer), from scratch to 4, then resumed to 8.
* ``takeover``: the ``t5x`` column's step-4 model_dir resumed to 8 with this
  column's optimizers; ``handback``: this column's step-4 model_dir resumed to
  8 with T5X's own optimizers.
* ``finetune``: a new model_dir initialised from the pretrained step-4
  checkpoint as ``finetune.gin`` does (``RestoreCheckpointConfig(mode='specific',
  dtype='bfloat16')``, bfloat16 save dtype), trained to 8;
  ``finetune_fresh``: the same with ``assignment_map`` dropping every
  optimizer-state key and ``fallback_to_scratch``, so the optimizer starts afresh.
* ``eval`` and ``infer``: T5X's ``eval.py`` and ``infer.py`` on the resumed
  step-8 checkpoint (exact-match metric, predictions).
* ``microbatches``: ``Trainer.num_microbatches = 2``, 4 steps.
* ``partitions``: ``PjitPartitioner(num_partitions=2)`` on 8 simulated CPU
  devices, 4 steps (8 heads: on CPU, T5X's mesh is data=1 x model=8).

Each cell shows whether the run succeeded, and for the ``gin`` and ``module``
columns whether its losses and final checkpoint (every array, bit for bit)
equal the ``t5x`` column's: ``= t5x`` or the largest difference. One
difference is ours by design and marked ``explained``: T5X's Orbax restore
casts the step to ``RestoreCheckpointConfig.dtype`` (bfloat16 when fine-tuning
so), and T5X's optimizers go on computing with that step; ours restores it as
the int32 it was. T5X runs
here are deterministic (fixed seeds, no dropout, no shuffling), so equal means
bit-exact.

Muon (``muon`` on the byt5 network, ``muon_scanned`` on T5X's scalable T5.1.1
network with scanned layers, both through ``optimizers.muon`` and
``optimizers.KernelAxesRule``) is one T5X's own optimizers cannot build, so its
``t5x`` column is ``-`` and each of its runs is checked on its own (these runs
save the dataset iterator, ``SaveCheckpointConfig.save_dataset = True``, so that
a restarted job sees the batches an uninterrupted one does):

* ``pretrain``: the loss decreases, and the checkpoint's optimizer state is
  Muon's in T5X's layout (``state/param_states/inner_states/{muon,adam}/
  inner_state/0/...``) with Muon's momentum on exactly the kernels (every
  ``kernel`` but the ``vocab``-sized logits, scanned ones included) and Adam's
  on the embeddings, logits, relative-position biases and layer-norm scales.
  Optax's default would send 2-D embeddings to Muon and the scanned 3-D and 4-D
  kernels to Adam, so this layout shows that T5X called ``set_param_axes`` and
  the params' logical axes chose the dimension numbers;
* ``resume`` and ``resume_legacy``: the restarted process starts its main loop
  at step 4 (T5X's log), and its losses and final checkpoint equal, bit for
  bit, those of one process trained 0-8 uninterrupted with the Orbax
  checkpointer (``= uninterrupted``);
* ``eval``: T5X's ``eval.py`` runs on the resumed checkpoint.

``adamw_8bit``, ``adamw_4bit`` and ``adamw_bf16`` (``optimizers.low_precision`` of
optax's adamw, every param of 64 values or more compressed) are checked the
same way, their ``pretrain`` by the state's layout instead of Muon's: both
moments of every param in the mode (8-bit: uint8 codes of the param's shape and
float32 block scales; 4-bit: uint8 codes of two values per byte; bfloat16) or
kept float32, every state array as t5x_optim plans it for these params, some
in the mode (`low_precision_layout`). Fine-tuning (T5X restores the
params in bfloat16, and saves them so) must restore the compressed state (``finetune``: the
decoded moments end within 5% of the resumed run's) or drop it
(``finetune_fresh``: 20% or more apart); 2 partitions must keep the
planned layout; ``infer`` and microbatches must run.

T5X cannot be installed from the package registry: its files are read at run
time from a git directory of github.com/google-research/t5x (``--t5x-src`` or
``T5X_SRC``); nothing of T5X is kept. The Python running this script needs
T5X's dependencies (tensorflow, seqio, clu, ...) and t5x_optim installed. Two stand-ins are written for T5X imports that cannot be
installed and are never called here (``jestimator``, ``airio``).

Usage::

  T5X_SRC=/path/to/t5x/.git /tmp/t5xv/bin/python tools/t5x_lifecycle.py \\
      [--optimizers adamw,legacy_adafactor] [--stages pretrain,resume] \\
      [--columns t5x,gin,module] [--module-optimizers adamw,...] [--workdir DIR [--reuse]]
      [--json-out FILE]

Each T5X process takes 30-70 s on 2 CPU cores; every stage of every optimizer in
every column is about 250 processes. ``--reuse`` re-tabulates an earlier work
dir, running only what is missing there.

Exit status 1 when a cell that succeeds in the ``t5x`` column fails, or
differs from it, in another column, or when a Muon cell fails or fails a check.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

COLUMNS = ("t5x", "gin", "module")
EXPLAINED = "explained"
STEPS_A, STEPS_B = 4, 8

# Muon on the kernels, Adam on the rest, placed by the params' logical axes.
MUON = """
OPTIMIZER = @optimizers.muon()
optimizers.muon:
  learning_rate = @optax.warmup_cosine_decay_schedule()
  kernel_axes_rule = @optimizers.KernelAxesRule()
optax.warmup_cosine_decay_schedule:
  init_value = 0.0
  peak_value = 0.02
  warmup_steps = 2
  decay_steps = 8
optimizers.KernelAxesRule:
  batch_axes = ['layers', 'expert', 'stack']
  adam_axes = ['vocab', 'length', 'relpos_buckets']
  axis_groups = [['heads', 'kv']]
utils.SaveCheckpointConfig.save_dataset = True
"""

# adamw with its moments stored compressed between steps; every param of 64 values or
# more (the byt5 network's embedding, logits and kernels) is compressed. As for Muon, the
# dataset iterator is saved: a restarted job sees the batches an uninterrupted one does.
LOW_PRECISION = """
OPTIMIZER = @optimizers.OptaxWrapper()
optimizers.OptaxWrapper.optax_optimizer = @optimizers.low_precision()
optimizers.low_precision:
  inner = @optax.adamw()
  state_dtype = '{mode}'
  min_size = 64
optax.adamw.learning_rate = 0.01
utils.SaveCheckpointConfig.save_dataset = True
"""
LOW_PRECISION_STATE = "state/param_states/inner_state/0/{}/"
LOW_PRECISION_MODES = {"adamw_8bit": "8bit", "adamw_4bit": "4bit", "adamw_bf16": "bfloat16"}

# The optimizer section of the gin file; `optimizers` is whatever the column imports.
OPTIMIZERS: dict[str, str] = {
  "adamw": """
OPTIMIZER = @optimizers.adamw()
optimizers.adamw.learning_rate = 0.01
""",
  "optax_adafactor": """
OPTIMIZER = @optimizers.OptaxWrapper()
optimizers.OptaxWrapper.optax_optimizer = @optax.adafactor()
optax.adafactor.learning_rate = 0.01
""",
  # T5X's legacy Adafactor, as byt5/base.gin configures it.
  "legacy_adafactor": "",
  "lion": """
OPTIMIZER = @optimizers.lion()
optimizers.lion.learning_rate = 0.001
""",
  "inject_schedule": """
OPTIMIZER = @optimizers.OptaxWrapper()
optimizers.OptaxWrapper.optax_optimizer = @lifecycle_tasks.inject_adamw()
lifecycle_tasks.inject_adamw.learning_rate = @optax_lr/utils.create_learning_rate_scheduler()
optax_lr/utils.create_learning_rate_scheduler:
  factors = 'constant * linear_warmup'
  base_learning_rate = 0.01
  warmup_steps = 3
""",
  "multisteps": """
OPTIMIZER = @optimizers.OptaxWrapper()
optimizers.OptaxWrapper.optax_optimizer = @optax.MultiSteps()
optax.MultiSteps.opt = @optax.adamw()
optax.MultiSteps.every_k_schedule = 2
optax.adamw.learning_rate = 0.01
""",
  "multi_legacy": """
OPTIMIZER = @optimizers.MultiOptimizer()
optimizers.MultiOptimizer.traversals_and_optimizers = (
    (@attn/lifecycle_tasks.traversal(), @attn/adafactor.Adafactor()),
    (@rest/lifecycle_tasks.traversal(), @rest/adafactor.Adafactor()))
attn/lifecycle_tasks.traversal.pattern = 'attention'
rest/lifecycle_tasks.traversal.pattern = '^((?!attention).)*$'
rest/adafactor.Adafactor.multiply_by_parameter_scale = False
""",
  "muon": MUON,
  "muon_scanned": MUON,
  **{name: LOW_PRECISION.format(mode=mode) for name, mode in LOW_PRECISION_MODES.items()},
  "multi_optax": """
OPTIMIZER = @optimizers.MultiOptimizer()
optimizers.MultiOptimizer.traversals_and_optimizers = (
    (@attn/lifecycle_tasks.traversal(), @optimizers.adamw()),
    (@rest/lifecycle_tasks.traversal(), @optimizers.sgd()))
attn/lifecycle_tasks.traversal.pattern = 'attention'
rest/lifecycle_tasks.traversal.pattern = '^((?!attention).)*$'
optimizers.adamw.learning_rate = 0.01
optimizers.sgd.learning_rate = 0.0001
""",
}

# Optimizers T5X's own optimizers cannot build: no t5x column, their own checks instead.
OURS_ONLY = ("muon", "muon_scanned", *LOW_PRECISION_MODES)
MUON_STATE = "state/param_states/inner_states/{}/inner_state/0/mu/"

STAGES = (
  "pretrain",
  "resume",
  "resume_legacy",
  "takeover",
  "handback",
  "finetune",
  "finetune_fresh",
  "eval",
  "infer",
  "microbatches",
  "partitions",
)

TASK_MODULE = '''"""The lifecycle's seqio task and the user-side gin helpers (written by t5x_lifecycle.py)."""
import re

import flax
import numpy as np
import optax
import seqio
import tensorflow as tf

VOCABULARY = seqio.ByteVocabulary()
SIZES = {"train": 512, "validation": 64, "test": 16}


def _words(split, shuffle_files=False, seed=None):
  del shuffle_files, seed
  rng = np.random.default_rng(list(SIZES).index(split))
  words = [
    "".join(chr(97 + c) for c in rng.integers(0, 26, rng.integers(3, 12)))
    for _ in range(SIZES[split])
  ]
  return tf.data.Dataset.from_tensor_slices({"inputs": words, "targets": [w[::-1] for w in words]})


def exact_match(targets, predictions):
  return {"exact_match": float(np.mean([t == p for t, p in zip(targets, predictions)]))}


seqio.TaskRegistry.add(
  "lifecycle_reverse",
  source=seqio.FunctionDataSource(_words, splits=list(SIZES)),
  preprocessors=[seqio.preprocessors.tokenize, seqio.preprocessors.append_eos_after_trim],
  output_features={k: seqio.Feature(VOCABULARY, add_eos=True) for k in ("inputs", "targets")},
  metric_fns=[exact_match],
)


def traversal(pattern):
  """A T5X MultiOptimizer traversal: params whose path matches `pattern`."""
  return flax.traverse_util.ModelParamTraversal(lambda path, _: re.search(pattern, path) is not None)


def inject_adamw(learning_rate):
  """adamw whose learning rate is injected (here: T5X's own schedule)."""
  return optax.inject_hyperparams(optax.adamw)(learning_rate=learning_rate)
'''

MODEL_GIN = """
from t5x.examples.t5 import network
include 't5x/examples/t5/byt5/base.gin'
network.T5Config:
  emb_dim = 16
  num_heads = 4
  num_encoder_layers = 2
  num_decoder_layers = 2
  head_dim = 4
  mlp_dim = 32
  dtype = 'float32'
DROPOUT_RATE = 0.0
"""

# T5X's T5.1.1 network with scanned layers (a 'layers' axis at position 1 of every
# layer's params), byte vocabulary.
SCANNED_MODEL_GIN = """
from t5x.examples.scalable_t5 import network
include 't5x/examples/scalable_t5/t5_1_1/base.gin'
VOCABULARY = @seqio.ByteVocabulary()
network.T5Config:
  vocab_size = 384
  emb_dim = 16
  num_heads = 4
  num_encoder_layers = 2
  num_decoder_layers = 2
  head_dim = 4
  mlp_dim = 32
  dtype = 'float32'
  scan_layers = True
DROPOUT_RATE = 0.0
"""

MODELS = {"muon_scanned": SCANNED_MODEL_GIN}

HEADER = """from __gin__ import dynamic_registration
import __main__ as {script}
import optax
import seqio
import lifecycle_tasks
from t5x import adafactor
from t5x import partitioning
from t5x import trainer
from t5x import utils
{optimizers_import}
"""

TRAIN_GIN = """
include 't5x/configs/runs/pretrain.gin'
MIXTURE_OR_TASK_NAME = 'lifecycle_reverse'
TASK_FEATURE_LENGTHS = {{'inputs': 16, 'targets': 16}}
TRAIN_STEPS = {steps}
BATCH_SIZE = 8
USE_CACHED_TASKS = False
RANDOM_SEED = 0
SHUFFLE_TRAIN_EXAMPLES = False
train/utils.DatasetConfig.seed = 0
train_script.train.eval_period = 2
train_script.train.train_eval_dataset_cfg = None
utils.SaveCheckpointConfig.period = 2
utils.create_learning_rate_scheduler.warmup_steps = 2
"""

EVAL_GIN = """
include 't5x/configs/runs/{script}.gin'
MIXTURE_OR_TASK_NAME = 'lifecycle_reverse'
TASK_FEATURE_LENGTHS = {{'inputs': 16, 'targets': 16}}
CHECKPOINT_PATH = '{checkpoint}'
{output_var} = '{output_dir}'
utils.DatasetConfig.batch_size = 8
"""


@dataclasses.dataclass
class Result:
  """One cell: a run's outcome, its train losses and its final checkpoint's arrays."""

  ok: bool
  error: str = ""
  seconds: float = 0.0
  losses: dict[str, float] = dataclasses.field(default_factory=dict)
  arrays: dict[str, Any] = dataclasses.field(default_factory=dict)
  outputs: str = ""
  first_step: int | None = None
  checks: list[tuple[bool, str]] = dataclasses.field(default_factory=list)


def _git(src: str, *args: str) -> bytes:
  return subprocess.run(["git", "-C", src, *args], check=True, capture_output=True).stdout


def build_tree(src: str, root: str, *, replace_optimizers: bool) -> None:
  """T5X's package (HEAD of `src`) under `root`, with the task module and stand-ins."""
  archive = subprocess.run(
    ["git", "-C", src, "archive", "HEAD", "t5x", ":(exclude)t5x/testdata", ":(exclude)t5x/contrib"],
    check=True,
    capture_output=True,
  ).stdout
  subprocess.run(["tar", "-x", "-C", root], input=archive, check=True)
  # T5X's __init__ imports every module, inference and export included; train.py needs none.
  open(os.path.join(root, "t5x", "__init__.py"), "w").close()
  if replace_optimizers:
    with open(os.path.join(root, "t5x", "optimizers.py"), "w") as f:
      f.write(
        "from t5x_optim.optimizers import *\n"
        "from t5x_optim.optimizers import Optimizer, OptimizerDef, OptimizerState\n"
        "OptimizerType = Optimizer\nOptimizerDefType = OptimizerDef\n"
        "OptimizerStateType = OptimizerState\n"
      )
  stand_ins = {
    "jestimator/__init__.py": "",
    "jestimator/amos.py": "class ScaleByAmosState(tuple):\n  pass\n\namos = None\n",
    "jestimator/amos_helper.py": "state_partition_rule = None\n",
    "airio/__init__.py": "from airio import core\n",
    "airio/core.py": "".join(
      f"class {name}:\n  pass\n\n"
      for name in ("Task", "Mixture", "AirIODatasetIterator", "DatasetProviderBase")
    ),
  }
  for name, text in stand_ins.items():
    module = name.split("/")[0]
    if _importable(module):
      continue
    os.makedirs(os.path.join(root, module), exist_ok=True)
    with open(os.path.join(root, name), "w") as f:
      f.write(text)
  with open(os.path.join(root, "lifecycle_tasks.py"), "w") as f:
    f.write(TASK_MODULE)


def _importable(module: str) -> bool:
  import importlib.util

  return importlib.util.find_spec(module) is not None


class Lifecycle:
  """Runs the stages of one optimizer in every column, in fresh processes."""

  def __init__(
    self, src: str, workdir: str, columns: Sequence[str], timeout: int, *, reuse: bool = False
  ):
    self.workdir, self.columns, self.timeout, self.reuse = workdir, tuple(columns), timeout, reuse
    self.roots = {}
    for replace in (False, True):
      root = os.path.join(workdir, "t5x_module" if replace else "t5x_untouched")
      if not os.path.isdir(root):
        os.makedirs(root)
        build_tree(src, root, replace_optimizers=replace)
      self.roots[replace] = root

  def _gin(self, column: str, script: str, optimizer: str, body: str) -> str:
    optimizers_import = (
      "from t5x_optim import optimizers" if column == "gin" else "from t5x import optimizers"
    )
    head = HEADER.format(script=script, optimizers_import=optimizers_import)
    return head + MODELS.get(optimizer, MODEL_GIN) + body + OPTIMIZERS[optimizer]

  def run(
    self,
    column: str,
    script: str,
    optimizer: str,
    body: str,
    model_dir: str,
    *,
    bindings: Sequence[str] = (),
    devices: int = 1,
  ) -> Result:
    """Runs T5X's `script` (train, eval or infer) once.

    Its gin file, `bindings` at the end (gin statements, which may use the
    file's import aliases), and its log go into `model_dir`.
    """
    os.makedirs(model_dir, exist_ok=True)
    text = self._gin(column, f"{script}_script", optimizer, body) + "\n".join(bindings)
    if self.reuse:
      done = _finished_run(model_dir, script, text)
      if done is not None:
        return done
    gin_file = os.path.join(model_dir, f"{script}-{len(os.listdir(model_dir))}.gin")
    with open(gin_file, "w") as f:
      f.write(text)
    root = self.roots[column == "module"]
    env = dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    command = [
      sys.executable,
      "-m",
      f"t5x.{script}",
      f"--gin_file={gin_file}",
      f"--gin_search_paths={root}",
    ]
    if script == "train":
      command.append(f"--gin.MODEL_DIR='{model_dir}'")
    start = time.perf_counter()
    try:
      proc = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=self.timeout, cwd=model_dir
      )
    except subprocess.TimeoutExpired:
      return Result(False, f"timed out after {self.timeout} s", time.perf_counter() - start)
    seconds = time.perf_counter() - start
    with open(gin_file[: -len(".gin")] + ".log", "w") as f:
      f.write(proc.stdout + proc.stderr)
    if proc.returncode != 0:
      return Result(False, _error_line(proc.stderr), seconds)
    return Result(True, seconds=seconds, first_step=_first_step(proc.stderr))


def _finished_run(model_dir: str, script: str, text: str) -> Result | None:
  """The outcome of an earlier run of `script` in `model_dir` with gin file `text`, if any.

  A run counts as finished when its log was written; it failed when the log
  holds a Python traceback.
  """
  for name in sorted(os.listdir(model_dir)):
    if not (name.startswith(f"{script}-") and name.endswith(".gin")):
      continue
    log = os.path.join(model_dir, name[: -len(".gin")] + ".log")
    with open(os.path.join(model_dir, name)) as f:
      same = f.read() == text
    if same and os.path.exists(log):
      with open(log) as f:
        output = f.read()
      failed = "Traceback (most recent call last)" in output
      if failed:
        return Result(False, _error_line(output))
      return Result(True, first_step=_first_step(output))
  return None


def _first_step(log: str) -> int | None:
  """The step T5X's train.py started its main loop at, from its log."""
  found = re.search(r"Starting main loop over steps (\d+)-", log)
  return int(found.group(1)) if found else None


def _error_line(log: str) -> str:
  """The last exception line of a log, with the innermost frame inside t5x or t5x_optim."""
  lines = [line for line in log.splitlines() if line.strip()]
  frames = [line.strip() for line in lines if line.strip().startswith("File ") and "/t5x" in line]
  error = next(
    (line for line in reversed(lines) if not line.startswith((" ", "I", "W", "E0", "\t"))), ""
  )
  where = frames[-1] if frames else ""
  return f"{error[:300]}  [{where}]" if where else error[:300]


def read_train(model_dir: str, result: Result) -> Result:
  """Adds the train losses (TensorBoard) and the latest checkpoint's arrays to `result`."""
  if not result.ok:
    return result
  import numpy as np
  from tensorboard.backend.event_processing import event_accumulator
  from tensorboard.util import tensor_util

  events = event_accumulator.EventAccumulator(
    os.path.join(model_dir, "train"), size_guidance={"tensors": 0}
  )
  events.Reload()
  result.losses = {
    str(e.step): float(tensor_util.make_ndarray(e.tensor_proto)) for e in events.Tensors("loss")
  }
  result.arrays = {path: np.asarray(x) for path, x in read_checkpoint(model_dir).items()}
  return result


def read_checkpoint(model_dir: str) -> dict[str, Any]:
  """Every array of the latest T5X checkpoint in `model_dir`, by '/'-joined path.

  Orbax-format checkpoints are read with orbax's own reader; legacy ones with
  tensorstore from the paths in T5X's msgpack.
  """
  import jax
  import numpy as np

  steps = [
    int(name.split("_")[1]) for name in os.listdir(model_dir) if name.startswith("checkpoint_")
  ]
  step_dir = os.path.join(model_dir, f"checkpoint_{max(steps)}")
  if os.path.isdir(os.path.join(step_dir, "state")):
    import orbax.checkpoint as ocp

    # As host numpy arrays: the checkpoint may come from more devices than are here.
    checkpointer, item = ocp.PyTreeCheckpointer(), os.path.join(step_dir, "state")
    metadata = checkpointer.metadata(item)
    metadata = getattr(metadata, "item_metadata", metadata)
    as_numpy = jax.tree.map(
      lambda _: ocp.RestoreArgs(restore_type=np.ndarray), getattr(metadata, "tree", metadata)
    )
    tree = checkpointer.restore(item, restore_args=as_numpy)
  else:
    import tensorstore as ts
    from flax import serialization

    with open(os.path.join(step_dir, "checkpoint"), "rb") as f:
      tree = serialization.msgpack_restore(f.read())

    def load(leaf: Any) -> Any:
      if isinstance(leaf, dict):  # A tensorstore spec, its path relative to the step.
        spec = dict(leaf, kvstore=dict(leaf["kvstore"]))
        spec["kvstore"]["path"] = os.path.join(step_dir, spec["kvstore"]["path"])
        return ts.open(spec).result().read().result()
      return leaf

    # T5X's legacy msgpack nests the train state under 'optimizer', beside a version.
    tree = _map_specs(tree["optimizer"], load)
  flat = jax.tree.leaves_with_path(tree)
  return {jax.tree_util.keystr(p, simple=True, separator="/"): np.asarray(x) for p, x in flat}


def _map_specs(tree: Any, fn: Any) -> Any:
  """Applies `fn` to every leaf, a tensorstore spec (a dict with a driver) counting as one."""
  if isinstance(tree, dict) and "driver" not in tree:
    return {k: _map_specs(v, fn) for k, v in tree.items()}
  return fn(tree)


def _counter_drift(ours: Any, theirs: Any) -> bool:
  """Whether an integer leaf of ours is floating (float32, bfloat16) in T5X's run."""
  import jax.numpy as jnp

  return bool(jnp.issubdtype(ours, jnp.integer) and jnp.issubdtype(theirs, jnp.floating))


def compare(result: Result, reference: Result, name: str = "t5x") -> str:
  """'= <name>' when losses and every checkpoint array are equal bit for bit, else the difference.

  `name` names the reference: the ``t5x`` column's run, or ``uninterrupted``.
  """
  import numpy as np

  if result.outputs or reference.outputs:
    return f"= {name}" if result.outputs == reference.outputs else "outputs differ"
  if result.losses != reference.losses:
    worst = max(
      (abs(result.losses.get(k, np.nan) - v) for k, v in reference.losses.items()), default=np.nan
    )
    step, ref_step = result.arrays.get("state/step"), reference.arrays.get("state/step")
    if (
      step is not None
      and ref_step is not None
      and _counter_drift(step.dtype, ref_step.dtype)
      and ref_step.dtype.itemsize < 4
    ):
      # T5X's Orbax restore casts host arrays, the step included, to
      # RestoreCheckpointConfig.dtype; a bfloat16 step changes T5X's updates.
      return f"{EXPLAINED}: T5X's step is {ref_step.dtype}, ours int32 (max |d| loss {worst:.3g})"
    return f"loss differs (max |d| {worst:.3g})"
  if set(result.arrays) != set(reference.arrays):
    only = sorted(set(result.arrays) ^ set(reference.arrays))
    return f"checkpoint keys differ ({len(only)}: {only[0]}...)"
  worst, where, drifted = 0.0, "", 0
  for path, ref in reference.arrays.items():
    got = result.arrays[path]
    # T5X's Orbax checkpointer restores step counters as float32 and T5X's own
    # optimizers go on counting in float32; ours restore them as integers.
    counter = _counter_drift(got.dtype, ref.dtype) and got.shape == ref.shape
    drifted += counter
    if got.shape != ref.shape or (got.dtype != ref.dtype and not counter):
      return f"{path}: {got.dtype}{list(got.shape)} vs {ref.dtype}{list(ref.shape)}"
    if not np.array_equal(got, ref, equal_nan=True):
      diff = float(np.max(np.abs(got.astype(np.float64) - ref.astype(np.float64))))
      if diff >= worst:
        worst, where = diff, path
  if where:
    return f"checkpoint differs (max |d| {worst:.3g} at {where})"
  theirs = "T5X's" if name == "t5x" else f"the {name} run's"
  return f"= {name}" + (
    f" ({drifted} int32 counters where {theirs} are float32)" if drifted else ""
  )


def expected_branch(param: str) -> str:
  """Where Muon's rule must send a param of T5X's T5 networks: kernels to Muon, the rest to Adam.

  The logits' kernel has a 'vocab' axis; embeddings, relative-position biases
  and layer-norm scales are not kernels.
  """
  name = param.rsplit("/", 1)[-1]
  return "muon" if name == "kernel" and "logits_dense" not in param else "adam"


def muon_layout(arrays: dict[str, Any]) -> tuple[bool, str]:
  """Whether a checkpoint's Muon state has Muon's momentum on the kernels and Adam's elsewhere.

  Reads T5X's state-dict paths: every param must have one momentum, of its
  shape, under ``inner_states/muon`` or ``inner_states/adam`` as
  `expected_branch` says.

  Returns:
    (ok, a summary naming the kernels' ranks and the first misplaced params).
  """
  params = {path[len("target/") :]: x for path, x in arrays.items() if path.startswith("target/")}
  placed: dict[str, str] = {}
  for branch in ("muon", "adam"):
    prefix = MUON_STATE.format(branch)
    for path, x in arrays.items():
      if path.startswith(prefix):
        param = path[len(prefix) :]
        same = param not in placed and param in params and x.shape == params[param].shape
        placed[param] = branch if same else f"{branch} (duplicate, unknown or misshapen)"
  wrong = [
    f"{param}: {placed.get(param, 'no momentum')}"
    for param in sorted(set(params) | set(placed))
    if placed.get(param) != expected_branch(param)
  ]
  kernels = [x for param, x in params.items() if placed.get(param) == "muon"]
  ranks = "/".join(sorted({str(x.ndim) for x in kernels}))
  text = f"Muon on {len(kernels)} kernels (rank {ranks}), Adam on {len(params) - len(kernels)}"
  if wrong:
    text += f"; misplaced {len(wrong)}: " + ", ".join(wrong[:3])
  return bool(kernels) and not wrong, text


def _stored_as(arrays: dict[str, Any], path: str, shape: tuple[int, ...]) -> str:
  """How a checkpoint holds one moment of a param of ``shape`` at ``path``: its mode, or why not.

  ``float32`` or ``bfloat16`` (an array of the param's shape), ``8bit``
  (uint8 codes of the param's shape and float32 block scales) or ``4bit``
  (uint8 codes with two values per byte along the last dimension).
  """
  whole = arrays.get(path)
  if whole is not None:
    kind = str(whole.dtype)
    ok = kind in ("float32", "bfloat16") and whole.shape == shape
    return kind if ok else f"{whole.dtype}{list(whole.shape)}"
  codes = arrays.get(path + "/codes")
  if codes is None:
    return "missing"
  if str(codes.dtype) != "uint8":
    return f"codes {codes.dtype}"
  if codes.shape == shape and str(getattr(arrays.get(path + "/scales"), "dtype", "")) == "float32":
    return "8bit"
  if codes.shape == (*shape[:-1], shape[-1] // 2):
    return "4bit"
  return f"codes {list(codes.shape)}"


def _nested(arrays: dict[str, Any]) -> dict[str, Any]:
  """'/'-joined paths to arrays as the nested state dict they come from."""
  tree: dict[str, Any] = {}
  for path, x in arrays.items():
    *parents, name = path.split("/")
    node = tree
    for key in parents:
      node = node.setdefault(key, {})
    node[name] = x
  return tree


def _low_precision_optimizer(arrays: dict[str, Any], mode: str) -> Any:
  """`LOW_PRECISION`'s optimizer (t5x_optim's) created for a checkpoint's params."""
  import optax

  import t5x_optim

  tx = t5x_optim.low_precision(optax.adamw(0.01), mode, min_size=64)
  return t5x_optim.OptaxWrapper(tx).create(_nested(arrays)["target"])


def low_precision_layout(arrays: dict[str, Any], mode: str) -> tuple[bool, str]:
  """Whether a checkpoint holds adam's moments as `low_precision(..., mode)` plans them.

  Every array of the checkpoint's optimizer state has the path, dtype and
  shape of the state dict of `LOW_PRECISION`'s optimizer created for the
  checkpoint's params (each moment in ``mode`` or kept float32, `_stored_as`),
  and some param's moments are in ``mode``.

  Returns:
    (ok, a summary: how many params each way, and the first wrong arrays).
  """
  import jax

  planned = {
    "state/" + jax.tree_util.keystr(path, simple=True, separator="/"): x
    for path, x in jax.tree.leaves_with_path(
      _low_precision_optimizer(arrays, mode).state_dict()["state"]
    )
  }
  state = {path: x for path, x in arrays.items() if path.startswith("state/")}
  wrong = [
    f"{path}: {_describe(state.get(path))} (planned {_describe(planned.get(path))})"
    for path in sorted(set(state) | set(planned))
    if _describe(state.get(path)) != _describe(planned.get(path))
  ]
  params = {path[len("target/") :]: x for path, x in arrays.items() if path.startswith("target/")}
  counts: dict[str, int] = {}
  for param, x in sorted(params.items()):
    kinds = {
      _stored_as(arrays, LOW_PRECISION_STATE.format(moment) + param, x.shape)
      for moment in ("mu", "nu")
    }
    kind = "/".join(sorted(kinds))
    counts[kind] = counts.get(kind, 0) + 1
  text = ", ".join(f"{n} params {kind}" for kind, n in sorted(counts.items()))
  if wrong:
    text += f"; wrong {len(wrong)}: " + ", ".join(wrong[:3])
  return counts.get(mode, 0) > 0 and not wrong, text


def _describe(x: Any) -> str:
  """An array's dtype and shape, as in ``uint8[24, 8]``; ``missing`` for None."""
  return "missing" if x is None else f"{x.dtype}{list(x.shape)}"


def adam_moments(arrays: dict[str, Any], mode: str) -> dict[str, Any]:
  """Adam's moments in a checkpoint of `LOW_PRECISION`, decoded to float32, by path.

  The checkpoint's state dict is restored into t5x_optim's optimizer (which
  validates every key, shape and dtype) and decoded by
  `t5x_optim.low_precision_to_float32`.
  """
  import jax
  import numpy as np

  import t5x_optim

  optimizer = _low_precision_optimizer(arrays, mode).restore_state(_nested(arrays))
  adam = t5x_optim.low_precision_to_float32(optimizer.state.param_states)[0]
  return {
    f"{moment}/" + jax.tree_util.keystr(path, simple=True, separator="/"): np.asarray(x)
    for moment in ("mu", "nu")
    for path, x in jax.tree.leaves_with_path(getattr(adam, moment))
  }


def moments_apart(result: Result, reference: Result, mode: str) -> float:
  """The larger of mu's and nu's relative L1 distance between two runs' decoded moments."""
  import numpy as np

  got, want = adam_moments(result.arrays, mode), adam_moments(reference.arrays, mode)
  apart = []
  for moment in ("mu/", "nu/"):
    keys = [k for k in want if k.startswith(moment)]
    diff = sum(float(np.abs(got[k] - want[k]).sum()) for k in keys)
    apart.append(diff / sum(float(np.abs(want[k]).sum()) for k in keys))
  return max(apart)


def _check_finetuned(result: Result, resumed: Result | None, optimizer: str, stage: str) -> None:
  """A low-precision fine-tuning's check: T5X restored the compressed state (``finetune``: its
  moments end within 5% of the resumed run's, which trained the same steps from the same
  checkpoint in float32 params) or dropped it (``finetune_fresh``: 20% or more apart)."""
  if resumed is None or not resumed.ok:
    result.checks.append((False, "no resumed run to compare the optimizer state with"))
    return
  apart = moments_apart(result, resumed, LOW_PRECISION_MODES[optimizer])
  if stage == "finetune":
    result.checks.append((apart < 0.05, f"state restored: moments {apart:.1%} from resume's"))
  else:
    result.checks.append((apart >= 0.2, f"state afresh: moments {apart:.1%} from resume's"))


def _check_pretrain(result: Result, optimizer: str) -> None:
  """The pretrain checks of an optimizer T5X cannot run: the loss decreases, and the
  state's layout (`muon_layout`, `low_precision_layout`)."""
  steps = sorted(result.losses, key=int)
  first, last = result.losses[steps[0]], result.losses[steps[-1]]
  result.checks.append((len(steps) > 1 and last < first, f"loss {first:.4f} -> {last:.4f}"))
  if optimizer.startswith("muon"):
    result.checks.append(muon_layout(result.arrays))
  else:
    result.checks.append(low_precision_layout(result.arrays, LOW_PRECISION_MODES[optimizer]))


def _check_resumed(result: Result, reference: Result) -> None:
  """Muon's resume checks: restarted at the saved step, and equal to the uninterrupted run."""
  started = result.first_step == STEPS_A
  result.checks.append((started, f"restarted at step {result.first_step}"))
  if not reference.ok:
    result.checks.append((False, f"the uninterrupted run failed: {reference.error}"))
    return
  verdict = compare(result, reference, "uninterrupted")
  result.checks.append((verdict.startswith("= uninterrupted"), verdict))


def run_stage(life: Lifecycle, stage: str, optimizer: str, column: str, dirs: dict) -> Result:
  """Runs one stage of one optimizer in one column.

  `dirs` holds earlier stages' model dirs, and for the optimizers T5X cannot
  run (`OURS_ONLY`) their uninterrupted runs, which their resumes must equal.
  """
  base = os.path.join(life.workdir, optimizer, column)
  train = TRAIN_GIN.format
  ours_only = optimizer in OURS_ONLY
  if ours_only and (column == "t5x" or stage in ("takeover", "handback")):
    return Result(False, "not applicable")

  def fresh(name: str) -> str:
    path = os.path.join(base, name)
    if not life.reuse:
      shutil.rmtree(path, ignore_errors=True)
    return path

  def copy_of(source: str, name: str) -> str:
    path = fresh(name)
    if not os.path.isdir(path):
      shutil.copytree(source, path)
    return path

  def train_in(model_dir: str, col: str, steps: int, **kwargs: Any) -> Result:
    result = life.run(col, "train", optimizer, train(steps=steps), model_dir, **kwargs)
    return read_train(model_dir, result)

  def uninterrupted() -> Result:
    key = (optimizer, column, "uninterrupted")
    if key not in dirs:
      dirs[key] = train_in(fresh("uninterrupted"), column, STEPS_B)
    return dirs[key]

  if stage == "pretrain":
    model_dir = fresh("pretrain")
    result = train_in(model_dir, column, STEPS_A)
    if result.ok:
      dirs[(optimizer, column, "pretrain")] = model_dir
      if ours_only:
        _check_pretrain(result, optimizer)
    return result
  pretrained = dirs.get((optimizer, column, "pretrain"))
  if stage in ("resume", "finetune", "finetune_fresh") and pretrained is None:
    return Result(False, "no pretrained model_dir (pretrain failed or was not run)")
  if stage == "resume":
    model_dir = copy_of(pretrained, "resume")
    result = train_in(model_dir, column, STEPS_B)
    if result.ok:
      dirs[(optimizer, column, "resume")] = model_dir
      dirs[(optimizer, column, "resumed")] = result
      if ours_only:
        _check_resumed(result, uninterrupted())
    return result
  if stage == "resume_legacy":
    model_dir = fresh("resume_legacy")
    first = train_in(model_dir, column, STEPS_A, bindings=["train_script.train.use_orbax=False"])
    if not first.ok:
      return first
    result = train_in(model_dir, column, STEPS_B, bindings=["train_script.train.use_orbax=False"])
    if result.ok and ours_only:
      _check_resumed(result, uninterrupted())
    return result
  if stage in ("takeover", "handback"):
    if column == "t5x":
      return Result(False, "not applicable")
    writer, reader = ("t5x", column) if stage == "takeover" else (column, "t5x")
    source = dirs.get((optimizer, writer, "pretrain"))
    if source is None:
      return Result(False, f"no pretrained model_dir of column {writer}")
    model_dir = copy_of(source, stage)
    return train_in(model_dir, reader, STEPS_B)
  if stage in ("finetune", "finetune_fresh"):
    model_dir = fresh(stage)
    checkpoint = os.path.join(pretrained, f"checkpoint_{STEPS_A}")
    bindings = [
      f"utils.RestoreCheckpointConfig.path='{checkpoint}'",
      "utils.RestoreCheckpointConfig.mode='specific'",
      "utils.RestoreCheckpointConfig.dtype='bfloat16'",
      "utils.SaveCheckpointConfig.dtype='bfloat16'",
    ]
    if stage == "finetune_fresh":
      bindings += [
        "utils.RestoreCheckpointConfig.assignment_map=((r'state/param_states.*', None),)",
        "utils.RestoreCheckpointConfig.fallback_to_scratch=True",
      ]
    result = train_in(model_dir, column, STEPS_B, bindings=bindings)
    if result.ok and optimizer in LOW_PRECISION_MODES:
      _check_finetuned(result, dirs.get((optimizer, column, "resumed")), optimizer, stage)
    return result
  if stage in ("eval", "infer"):
    resumed = dirs.get((optimizer, column, "resume"))
    if resumed is None:
      return Result(False, "no resumed model_dir (resume failed or was not run)")
    output_dir = fresh(stage)
    output_var = "EVAL_OUTPUT_DIR" if stage == "eval" else "INFER_OUTPUT_DIR"
    body = EVAL_GIN.format(
      script=stage,
      checkpoint=os.path.join(resumed, f"checkpoint_{STEPS_B}"),
      output_var=output_var,
      output_dir=output_dir,
    )
    result = life.run(column, stage, optimizer, body, output_dir)
    if result.ok:
      result.outputs = _outputs(output_dir, stage)
    return result
  if stage == "microbatches":
    return train_in(fresh(stage), column, STEPS_A, bindings=["trainer.Trainer.num_microbatches=2"])
  if stage == "partitions":
    result = train_in(
      fresh(stage),
      column,
      STEPS_A,
      # On CPU, T5X's mesh is data=1 x model=<devices>: 8 heads shard over 8.
      bindings=["partitioning.PjitPartitioner.num_partitions=2", "network.T5Config.num_heads=8"],
      devices=8,
    )
    if result.ok and optimizer in LOW_PRECISION_MODES:
      result.checks.append(low_precision_layout(result.arrays, LOW_PRECISION_MODES[optimizer]))
    return result
  raise ValueError(f"unknown stage {stage!r}")


def _outputs(output_dir: str, stage: str) -> str:
  """The metrics (eval) or predictions (infer) a run wrote, as one string."""
  texts = []
  for folder, _, files in sorted(os.walk(output_dir)):
    for name in sorted(files):
      if (stage == "eval" and name.endswith("-metrics.jsonl")) or (
        stage == "infer" and ".jsonl" in name and "metrics" not in name
      ):
        with open(os.path.join(folder, name)) as f:
          texts.append(f.read())
  if not texts:
    return "(nothing written)"
  return "\n".join(texts)


def cell(result: Result, reference: Result | None, column: str) -> str:
  """A table cell: the outcome, and for our columns the comparison with `reference`."""
  if not result.ok:
    if result.error in ("not applicable", "not run"):
      return "-" if result.error == "not applicable" else "(not run)"
    return "FAIL: " + result.error
  last = result.losses[max(result.losses, key=int)] if result.losses else None
  text = f"ok loss {last:.6f}" if last is not None else "ok"
  if result.outputs:
    text = "ok " + _summary(result.outputs)
  if column != "t5x" and reference is not None and reference.ok:
    text += ", " + compare(result, reference)
  for ok, message in result.checks:
    text += ("; " if ok else "; FAILED ") + message
  return text


def _summary(outputs: str) -> str:
  if '"exact_match"' in outputs:
    return "exact_match " + outputs.split('"exact_match":')[1].split(",")[0].split("}")[0].strip()
  return f"{outputs.count(chr(10))} predictions"


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--t5x-src", default=os.environ.get("T5X_SRC", ""))
  parser.add_argument("--optimizers", default=",".join(OPTIMIZERS))
  parser.add_argument("--stages", default=",".join(STAGES))
  parser.add_argument("--columns", default=",".join(COLUMNS))
  parser.add_argument(
    "--module-optimizers",
    default="",
    help="run the module column only for these optimizers (default: all); for optax "
    "optimizers it runs the same t5x_optim code as the gin column",
  )
  parser.add_argument("--workdir", default="")
  parser.add_argument("--timeout", type=int, default=900, help="seconds per T5X process")
  parser.add_argument("--json-out", default="")
  parser.add_argument(
    "--reuse",
    action="store_true",
    help="in an earlier --workdir, take each run whose gin file and log are there as it "
    "ended instead of running it again (to re-tabulate, or to go on after an interruption)",
  )
  args = parser.parse_args(argv)
  if not os.path.isdir(args.t5x_src):
    parser.error(
      f"--t5x-src / T5X_SRC={args.t5x_src!r} is not a git directory of google-research/t5x"
    )
  optimizers = args.optimizers.split(",")
  stages = [s for s in STAGES if s in args.stages.split(",")]
  columns = [c for c in COLUMNS if c in args.columns.split(",")]
  unknown = sorted(set(optimizers) - set(OPTIMIZERS)) + sorted(
    set(args.stages.split(",")) - set(STAGES)
  )
  if unknown:
    parser.error(f"unknown optimizers or stages {unknown}")
  if "t5x" not in columns:
    columns.insert(0, "t5x")  # The reference column.
  module_optimizers = args.module_optimizers.split(",") if args.module_optimizers else optimizers
  workdir = args.workdir or tempfile.mkdtemp(prefix="t5x_lifecycle_")
  commit = _git(args.t5x_src, "rev-parse", "--short", "HEAD").decode().strip()
  print(f"T5X {commit}, work dir {workdir}", flush=True)
  life = Lifecycle(args.t5x_src, workdir, columns, args.timeout, reuse=args.reuse)
  dirs: dict = {}
  rows, regressions, ours_failed = [], 0, 0
  resumed_by_t5x: dict[str, Result] = {}
  for optimizer in optimizers:
    for stage in stages:
      results = {
        column: run_stage(life, stage, optimizer, column, dirs)
        if column != "module" or optimizer in module_optimizers
        else Result(False, "not run")
        for column in columns
      }
      if stage == "resume":
        resumed_by_t5x[optimizer] = results["t5x"]
      # A model_dir changing hands must train on as T5X's own resume of its own does.
      handed = stage in ("takeover", "handback")
      reference = resumed_by_t5x.get(optimizer) if handed else results["t5x"]
      row = {"stage": stage, "optimizer": optimizer}
      for column in columns:
        row[column] = cell(results[column], reference, column)
        row[f"{column}_seconds"] = round(results[column].seconds, 1)
        skipped = results[column].error == "not run"
        if column != "t5x" and reference is not None and reference.ok and not skipped:
          regressions += "= t5x" not in row[column] and EXPLAINED not in row[column]
        if optimizer in OURS_ONLY and column != "t5x" and not skipped:
          result = results[column]
          ours_failed += (not result.ok and result.error != "not applicable") or not all(
            ok for ok, _ in result.checks
          )
      rows.append(row)
      print(
        f"{stage:15s} {optimizer:17s} " + " | ".join(f"{c}: {row[c]}" for c in columns), flush=True
      )
      if args.json_out:
        with open(args.json_out, "w") as f:
          json.dump({"t5x": commit, "rows": rows}, f, indent=1)
  print()
  print(_table(rows, columns))
  print(f"\nSUMMARY: {regressions} cells work with T5X's optimizers but fail or differ with ours.")
  if any(optimizer in OURS_ONLY for optimizer in optimizers):
    print(f"SUMMARY: {ours_failed} cells of optimizers T5X cannot run fail or fail a check.")
  return 1 if regressions or ours_failed else 0


def _table(rows: list[dict], columns: Sequence[str]) -> str:
  header = ["stage", "optimizer", *columns]
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  for row in rows:
    lines.append("| " + " | ".join(str(row[h]) for h in header) + " |")
  return "\n".join(lines)


if __name__ == "__main__":
  sys.exit(main())
