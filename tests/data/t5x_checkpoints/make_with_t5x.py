"""Writes the T5X checkpoints in this directory with T5X's own code (run once, by hand).

T5X cannot be installed from the package registry, so its modules are read from a git
directory of github.com/google-research/t5x named by the T5X_SRC environment variable
(the package is unpacked into a temporary directory; nothing of T5X is kept here).
It needs an environment with T5X's dependencies (tensorflow, clu, seqio, ...).
The test suite never runs this script; tests/test_t5x_checkpoints.py reads its output.
Its helpers (loading T5X and its example T5 networks, T5X's partitioner and train
states, the checks' run loop) serve the sibling ``check_with_t5x.py`` scripts too.

A T5X `FlaxOptimTrainState` with `OptaxWrapper(optax.adamw(...))` over three tiny params
(with T5X `params_axes`), partitioned by T5X's `PjitPartitioner` on 8 simulated CPU devices
(mesh data=2 x model=4, 2-D parameter rules), takes two jitted gradient steps and is
saved at step 2 by T5X's legacy `Checkpointer` (``legacy/checkpoint_2``) and by T5X's
`OrbaxCheckpointManagerInterface` (``orbax/checkpoint_2``). ``expected.npz`` holds every
leaf of the saved state dict, keyed by its '/'-joined path.

Usage (OUT defaults to this directory):
  T5X_SRC=/path/to/t5x/.git python tests/data/t5x_checkpoints/make_with_t5x.py [OUT]
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import functools  # noqa: E402
import importlib.util  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import types  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
STEP = 2


def load_t5x() -> str:
  """Unpacks T5X's package (HEAD of T5X_SRC) into a temp dir on sys.path; returns the commit."""
  src = os.environ.get("T5X_SRC", "")
  if not os.path.isdir(src):
    raise SystemExit(f"T5X_SRC={src!r} is not a git directory of github.com/google-research/t5x")
  git = ["git", "-C", src]
  commit = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()
  root = tempfile.mkdtemp(prefix="t5x_src_")
  os.makedirs(os.path.join(root, "t5x"))
  names = subprocess.run([*git, "ls-tree", "--name-only", "HEAD", "t5x/"], check=True,
                         capture_output=True, text=True).stdout.split()
  for name in names:
    if name.endswith(".py") and not name.endswith("/__init__.py"):
      source = subprocess.run([*git, "show", f"HEAD:{name}"], check=True,
                              capture_output=True).stdout
      with open(os.path.join(root, name), "wb") as f:
        f.write(source)
  with open(os.path.join(root, "t5x", "__init__.py"), "w") as f:
    f.write("")  # T5X's own __init__ imports every module (infer, trainer, ...).
  _stand_in_missing_modules()
  sys.path.insert(0, root)
  return commit


def _stand_in_missing_modules() -> None:
  """Empty stand-ins for the T5X imports that are not installable and unused here."""
  if importlib.util.find_spec("jestimator") is None:
    amos = types.ModuleType("jestimator.amos")
    amos.ScaleByAmosState = type("ScaleByAmosState", (tuple,), {})
    amos.amos = None
    helper = types.ModuleType("jestimator.amos_helper")
    helper.state_partition_rule = None
    pkg = types.ModuleType("jestimator")
    pkg.amos, pkg.amos_helper = amos, helper
    sys.modules.update({"jestimator": pkg, "jestimator.amos": amos,
                        "jestimator.amos_helper": helper})
  if importlib.util.find_spec("airio") is None:
    core = types.ModuleType("airio.core")
    for name in ["Task", "Mixture", "AirIODatasetIterator", "DatasetProviderBase"]:
      setattr(core, name, type(name, (), {}))
    pkg = types.ModuleType("airio")
    pkg.core = core
    sys.modules.update({"airio": pkg, "airio.core": core})


EXAMPLES = ("t5", "scalable_t5")


def load_examples() -> None:
  """T5X's example networks (``t5x/examples/{t5,scalable_t5}``) beside the unpacked T5X."""
  src, root = os.environ["T5X_SRC"], sys.path[0]
  names = ["t5x/examples/__init__.py"]
  for example in EXAMPLES:
    names += [f"t5x/examples/{example}/{name}.py" for name in ("__init__", "layers", "network")]
  for name in names:
    source = subprocess.run(
      ["git", "-C", src, "show", f"HEAD:{name}"], check=True, capture_output=True
    ).stdout
    os.makedirs(os.path.dirname(os.path.join(root, name)), exist_ok=True)
    with open(os.path.join(root, name), "wb") as f:
      f.write(source)


def t5_model(example: str, optimizer_def):
  """T5X's example network ``example`` (``t5`` or ``scalable_t5``, layers scanned), tiny
  (2 + 2 layers, 4 heads of 4, MLP 32, byte vocabulary), as an `EncoderDecoderModel`."""
  import importlib

  import seqio
  from t5x import models

  network = importlib.import_module(f"t5x.examples.{example}.network")
  config = dict(
    vocab_size=384,
    dtype="float32",
    emb_dim=16,
    num_heads=4,
    num_encoder_layers=2,
    num_decoder_layers=2,
    head_dim=4,
    mlp_dim=32,
    mlp_activations=("gelu", "linear"),
    dropout_rate=0.0,
    logits_via_embedding=False,
  )
  if example == "scalable_t5":
    config["scan_layers"] = True
  vocabulary = seqio.ByteVocabulary()
  return models.EncoderDecoderModel(
    module=network.Transformer(network.T5Config(**config)),
    input_vocabulary=vocabulary,
    output_vocabulary=vocabulary,
    optimizer_def=optimizer_def,
  )


LENGTH, BATCH = 16, 8


def t5_train_state(example: str, optimizer_def, partitioner):
  """T5X's `TrainStateInitializer` for `t5_model` with `optimizer_def`, and its state dict's
  mesh axes and abstract arrays by '/'-joined path."""
  import numpy as np
  from t5x import utils

  model = t5_model(example, optimizer_def)
  shapes = {
    name: (BATCH, LENGTH)
    for name in ("encoder_input_tokens", "decoder_input_tokens", "decoder_target_tokens")
  }
  types = {name: np.int32 for name in shapes}
  initializer = utils.TrainStateInitializer(
    optimizer_def, model.get_initial_variables, shapes, partitioner, types
  )
  return (
    initializer,
    flat_state_dict(initializer.train_state_axes),
    flat_state_dict(initializer.global_train_state_shape),
  )


def flat_state_dict(tree) -> dict:
  """A train state's state dict by '/'-joined path."""
  from flax import traverse_util

  return traverse_util.flatten_dict(tree.state_dict(), sep="/", keep_empty_nodes=True)


def not_replicated(abstract: dict, axes: dict, moments) -> tuple[list, list]:
  """``(others, problems)``: the optimizer-state leaves besides ``moments`` (counters), and
  those of them T5X does not replicate."""
  from jax.sharding import PartitionSpec

  others = [k for k in abstract if k.startswith("state/") and k not in moments]
  problems = [
    f"{key}: mesh axes {axes[key]}, expected replicated"
    for key in others
    if axes[key] not in (None, PartitionSpec())
  ]
  return others, problems


def misplaced(initializer, partitioner, axes: dict) -> list:
  """Where the state T5X initialises from scratch is not placed as its mesh axes say."""
  import jax
  from jax.sharding import NamedSharding, PartitionSpec

  problems = []
  state = initializer.from_scratch(jax.random.PRNGKey(0))
  for key, leaf in flat_state_dict(state).items():
    spec = axes[key] or PartitionSpec()
    if leaf.sharding != NamedSharding(partitioner.mesh, spec):
      problems.append(f"{key}: placed {leaf.sharding.spec}, mesh axes {spec}")
  return problems


def t5x_optim_plan(initializer, partitioner):
  """`t5x_optim.partitioning.build_plan` (what ``t5x-optim plan`` prints) of T5X's abstract
  train state, each array with the sharding of T5X's mesh axes."""
  import jax
  from jax.sharding import NamedSharding, PartitionSpec

  from t5x_optim import partitioning

  def with_sharding(spec, shape):
    if not hasattr(shape, "shape"):  # An empty collection (flax_mutables), None in the axes.
      return shape
    sharding = NamedSharding(partitioner.mesh, spec or PartitionSpec())
    return jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=sharding)

  abstract_state = jax.tree.map(
    with_sharding,
    initializer.train_state_axes,
    initializer.global_train_state_shape,
    is_leaf=lambda x: x is None or isinstance(x, PartitionSpec),
  )
  return partitioning.build_plan(
    abstract_state, logical=initializer.global_train_state_shape.as_logical_axes()
  )


def differences(got: dict, want: dict) -> list:
  """How two flat state dicts differ: keys, then each leaf's dtype, shape or bytes."""
  import numpy as np

  problems = []
  if sorted(got) != sorted(want):
    problems.append(f"keys differ: {sorted(set(got) ^ set(want))}")
  for key in sorted(set(got) & set(want)):
    a, b = np.asarray(got[key]), np.asarray(want[key])
    if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
      problems.append(f"{key}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}")
  return problems


def run_checks(checks) -> int:
  """Runs each ``(label, check)`` with T5X and its example networks loaded, where
  ``check(partitioner)`` (`t5x_partitioner`, 8 simulated devices) returns the problems it
  found; prints them, or ``OK`` when there is none. Returns the exit status."""
  load_t5x()
  load_examples()
  import jax

  assert jax.device_count() == 8, jax.devices()
  partitioner = t5x_partitioner()
  problems = []
  for label, check in checks:
    problems += [f"{label}: {problem}" for problem in check(partitioner)]
  for problem in problems:
    print(problem)
  if problems:
    return 1
  print("OK")
  return 0


def tiny_variables():
  """Three params with T5X logical axes (`params_axes`), as a T5X model's init returns."""
  import flax
  import numpy as np
  from flax.linen import partitioning as flax_partitioning

  rng = np.random.default_rng(0)
  params = {
      "dense": {
          "kernel": rng.standard_normal((4, 8)).astype(np.float32),
          "bias": rng.standard_normal((8,)).astype(np.float32),
      },
      "embedding": rng.standard_normal((16, 4)).astype(np.float32),
  }
  axes = {
      "dense": {
          "kernel_axes": flax_partitioning.AxisMetadata(names=("embed", "mlp")),
          "bias_axes": flax_partitioning.AxisMetadata(names=("mlp",)),
      },
      "embedding_axes": flax_partitioning.AxisMetadata(names=("vocab", "embed")),
  }
  # T5X's axis derivation maps over FrozenDicts, as older flax `Module.init` returned.
  return flax.core.freeze({"params": params, "params_axes": axes})


def t5x_partitioner():
  """T5X's PjitPartitioner with 2-D parameter rules on a data=2 x model=4 mesh."""
  import jax
  import numpy as np
  from t5x import partitioning

  class Mesh2x4Partitioner(partitioning.PjitPartitioner):
    """On CPU, T5X's own mesh is always data=1 x model=<devices>."""

    @functools.cached_property
    def mesh(self):
      return jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))

  return Mesh2x4Partitioner(
      num_partitions=4,
      logical_axis_rules=partitioning.standard_logical_axis_rules(parameter_partitioning_dims=2),
  )


def t5x_train_state(partitioner, optimizer_def=None):
  """T5X's FlaxOptimTrainState at step 0, sharded, and its shardings.

  The optimizer is T5X's OptaxWrapper(adamw) unless `optimizer_def` is given.
  """
  import jax
  import optax
  from t5x import optimizers
  from t5x import train_state as train_state_lib

  if optimizer_def is None:
    optimizer_def = optimizers.OptaxWrapper(optax.adamw(learning_rate=0.1, weight_decay=0.01))
  state = train_state_lib.FlaxOptimTrainState.create(optimizer_def, tiny_variables())
  shardings = jax.tree.map(
      lambda spec: jax.sharding.NamedSharding(partitioner.mesh, spec or jax.sharding.PartitionSpec()),
      partitioner.get_mesh_axes(state),
      is_leaf=lambda x: x is None or isinstance(x, jax.sharding.PartitionSpec))
  return jax.device_put(state, shardings), shardings


def train_steps(state, shardings, steps, learning_rate=None):
  """`steps` jitted gradient steps with grads `jax.random.normal(jax.random.key(s), shape)`."""
  import jax

  def train_step(state, seed):
    grads = jax.tree.map(lambda p: jax.random.normal(jax.random.key(seed), p.shape), state.params)
    return state.apply_gradient(grads, learning_rate=learning_rate)

  step_fn = jax.jit(train_step, out_shardings=shardings)
  for seed in range(steps):
    state = step_fn(state, seed)
  assert int(state.step) == steps
  return state


def main(out: str) -> None:
  commit = load_t5x()
  import jax
  import numpy as np
  from flax import traverse_util
  from t5x import checkpoints

  assert jax.device_count() == 8, jax.devices()
  partitioner = t5x_partitioner()
  state, shardings = t5x_train_state(partitioner)
  mesh_axes = partitioner.get_mesh_axes(state)

  state = train_steps(state, shardings, STEP)

  for name in ("legacy", "orbax"):
    shutil.rmtree(os.path.join(out, name), ignore_errors=True)
    os.makedirs(os.path.join(out, name))  # T5X's Orbax manager takes a missing dir's parent.
  checkpoints.Checkpointer(state, partitioner, os.path.join(out, "legacy")).save(state)
  manager = checkpoints.OrbaxCheckpointManagerInterface(
      os.path.join(out, "orbax"), state, partitioner)
  manager.save(state)
  manager.wait_until_finished()
  manager.close()

  flat = traverse_util.flatten_dict(state.state_dict(), sep="/")
  np.savez(os.path.join(out, "expected.npz"), **{k: np.asarray(v) for k, v in flat.items()})
  print(f"mesh {dict(partitioner.mesh.shape)}")
  print(f"T5X commit {commit}: wrote legacy/checkpoint_{STEP}, orbax/checkpoint_{STEP} and "
        f"expected.npz with {len(flat)} leaves:")
  for key, value in sorted(flat.items()):
    print(f"  {key}: {np.asarray(value).dtype}{list(np.shape(value))} mesh axes "
          f"{traverse_util.flatten_dict(mesh_axes.state_dict(), sep='/').get(key)}")


if __name__ == "__main__":
  main(sys.argv[1] if len(sys.argv) > 1 else HERE)
