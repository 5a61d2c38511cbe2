"""Writes a T5X checkpoint of T5X's legacy `adafactor.Adafactor` with T5X's own code (run once).

The sibling of ``tests/data/t5x_checkpoints/make_with_t5x.py`` (whose T5X loading, params
and partitioner it reuses): a T5X `FlaxOptimTrainState` with T5X's legacy
`adafactor.Adafactor` (factored second moments by T5X's standard logical factor rules,
momentum ``beta1=0.9``) over the same three tiny params, on the same data=2 x model=4
mesh of 8 simulated CPU devices, takes three jitted gradient steps with
``learning_rate=0.1`` (as T5X's trainer passes it) and is saved at step 3 by T5X's legacy
`Checkpointer` (``legacy/checkpoint_3``). ``expected.npz`` holds every leaf of the saved
state dict, keyed by its '/'-joined path. The test suite never runs this script;
tests/test_convert.py reads its output.

Usage (OUT defaults to this directory):
  T5X_SRC=/path/to/t5x/.git python tests/data/t5x_adafactor/make_with_t5x.py [OUT]
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "t5x_checkpoints"))

import make_with_t5x as base  # noqa: E402  (sets XLA_FLAGS before jax is imported)

STEP = 3
LEARNING_RATE = 0.1


def main(out: str) -> None:
  commit = base.load_t5x()
  import shutil

  import jax
  import numpy as np
  from flax import traverse_util
  from t5x import adafactor, checkpoints

  assert jax.device_count() == 8, jax.devices()
  partitioner = base.t5x_partitioner()
  optimizer_def = adafactor.Adafactor(
      decay_rate=0.8,
      step_offset=0,
      beta1=0.9,
      min_dim_size_to_factor=2,
      logical_factor_rules=adafactor.standard_logical_factor_rules(),
  )
  state, shardings = base.t5x_train_state(partitioner, optimizer_def)
  state = base.train_steps(state, shardings, STEP, LEARNING_RATE)

  shutil.rmtree(os.path.join(out, "legacy"), ignore_errors=True)
  os.makedirs(os.path.join(out, "legacy"))
  checkpoints.Checkpointer(state, partitioner, os.path.join(out, "legacy")).save(state)
  flat = traverse_util.flatten_dict(state.state_dict(), sep="/")
  np.savez(os.path.join(out, "expected.npz"), **{k: np.asarray(v) for k, v in flat.items()})
  print(f"T5X commit {commit}: wrote legacy/checkpoint_{STEP} and expected.npz with "
        f"{len(flat)} leaves:")
  for key, value in sorted(flat.items()):
    print(f"  {key}: {np.asarray(value).dtype}{list(np.shape(value))}")


if __name__ == "__main__":
  main(sys.argv[1] if len(sys.argv) > 1 else HERE)
