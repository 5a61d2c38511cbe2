"""Checks with T5X's own code that T5X reads what t5x_optim writes, bit for bit (run by hand).

Like make_with_t5x.py, T5X is read from the git directory named by T5X_SRC, and this
needs an environment with T5X's dependencies and t5x_optim; the test suite never runs it.

On 8 simulated CPU devices (mesh data=2 x model=4), for each shipped T5X checkpoint
(legacy and Orbax format):
1. t5x_optim restores it into a sharded `TrainState` with `OptaxWrapper(optax.adamw)`,
   takes one jitted training step, and `save_t5x_checkpoint` writes step 3;
2. T5X's legacy `Checkpointer` and T5X's `OrbaxCheckpointManagerInterface` (which
   hands legacy checkpoints to the `Checkpointer`) each restore step 3 into T5X's own
   `FlaxOptimTrainState` with T5X's `OptaxWrapper(optax.adamw)`;
3. every leaf of T5X's restored state dict must equal the saved leaf bit for bit, with
   the same dtype and the same set of keys; T5X's restored train state then takes a
   step that must equal t5x_optim's next step.
It prints one line per check and exits with status 1 on any difference.

Usage:
  T5X_SRC=/path/to/t5x/.git PYTHONPATH=. python tests/data/t5x_checkpoints/check_with_t5x.py
"""

import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import make_with_t5x  # noqa: E402  (sets the XLA flags before jax is imported)


def _flat(state_dict):
  from flax import traverse_util
  return traverse_util.flatten_dict(state_dict, sep="/")


def _compare(name, got, want) -> bool:
  """Prints and returns whether two flat state dicts are equal bit for bit."""
  problems = make_with_t5x.differences(got, want)
  print(f"{'OK  ' if not problems else 'FAIL'} {name}: {len(want)} leaves"
        + (f"; {problems}" if problems else " identical (dtype, shape, bytes)"))
  return not problems


def main() -> int:
  make_with_t5x.load_t5x()
  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  import optax
  from flax.core import freeze
  from t5x import checkpoints

  import t5x_optim
  from t5x_optim import partitioning

  assert jax.device_count() == 8
  print(f"t5x_optim from {os.path.dirname(t5x_optim.__file__)}")
  mesh = partitioning.create_mesh(shape={"data": 2, "model": 4})
  ours = partitioning.Partitioner(
      mesh, partitioning.standard_logical_axis_rules(parameter_partitioning_dims=2))
  shapes = {"dense": {"kernel": (4, 8), "bias": (8,)}, "embedding": (16, 4)}
  axes = {"dense": {"kernel": ("embed", "mlp"), "bias": ("mlp",)}, "embedding": ("vocab", "embed")}

  def variables():
    def box(shape, names):
      return nn.LogicallyPartitioned(jnp.zeros(shape, jnp.float32), names)
    return {"params": jax.tree.map(box, shapes, axes, is_leaf=lambda x: isinstance(x, tuple))}

  target = partitioning.abstract_train_state(
      ours, t5x_optim.OptaxWrapper(optax.adamw(0.1, weight_decay=0.01)), variables)
  grads = jax.tree.map(lambda s: jnp.full(s, 0.25, jnp.float32), shapes,
                       is_leaf=lambda x: isinstance(x, tuple))
  ok = True
  for fmt in ("legacy", "orbax"):
    state = t5x_optim.restore_t5x_checkpoint(os.path.join(HERE, fmt), target)
    state = jax.jit(lambda s: s.apply_gradient(grads))(state)
    model_dir = tempfile.mkdtemp(prefix=f"t5x_optim_{fmt}_")
    path = t5x_optim.save_t5x_checkpoint(model_dir, state)
    saved = _flat(state.state_dict())
    next_ours = _flat(jax.jit(lambda s: s.apply_gradient(grads))(state).state_dict())
    print(f"t5x_optim restored {fmt}/checkpoint_2, stepped, saved {path}")

    partitioner = make_with_t5x.t5x_partitioner()
    template, _ = make_with_t5x.t5x_train_state(partitioner)
    restorers = {
        "T5X Checkpointer": lambda: checkpoints.Checkpointer(
            template, partitioner, model_dir).restore(),
        "T5X OrbaxCheckpointManagerInterface": lambda: checkpoints.OrbaxCheckpointManagerInterface(
            model_dir, template, partitioner).restore(step=3),
    }
    for name, restore in restorers.items():
      t5x_state = restore()
      ok &= _compare(f"{name} reads t5x_optim's save of {fmt}", _flat(t5x_state.state_dict()), saved)
      next_t5x = jax.jit(lambda s: s.apply_gradient(freeze(grads), learning_rate=None))(t5x_state)
      ok &= _compare("  T5X's next step equals t5x_optim's", _flat(next_t5x.state_dict()), next_ours)
    shutil.rmtree(model_dir)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
