"""Checks that T5X's own checkpointers read what `save_t5x_checkpoint` writes of Adafactor states.

Run by ``tests/test_t5x_checkpoints.py`` in a fresh process where T5X is at hand (T5X_SRC
and T5X's dependencies, as for ``../t5x_checkpoints/make_with_t5x.py``); CI has neither
and skips it.

T5X writes a leaf whose mesh axes are None (Adafactor's (1,) placeholders for a factored or
unfactored param) into the msgpack file itself, and its reader takes every tensorstore spec
for a leaf with mesh axes. For T5X's legacy `adafactor.Adafactor` and for
`t5x_optim.optimizers.adafactor`, over the three params of ``../t5x_checkpoints/`` on a
data=2 x model=4 mesh: T5X's `FlaxOptimTrainState` takes two steps, `save_t5x_checkpoint`
writes it, and T5X's legacy `Checkpointer` and its `OrbaxCheckpointManagerInterface` each
restore it into that train state; every leaf must equal the saved one bit for bit. Prints
``OK`` on success.

Usage: T5X_SRC=/path/to/t5x/.git python tests/data/t5x_adafactor/read_by_t5x.py
"""

import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "t5x_checkpoints"))

import make_with_t5x as base  # noqa: E402  (sets XLA_FLAGS before jax is imported)


def _read_back(optimizer_def):
  def check(partitioner):
    from flax import traverse_util
    from t5x import checkpoints

    import t5x_optim

    state, shardings = base.t5x_train_state(partitioner, optimizer_def)
    state = base.train_steps(state, shardings, 2, learning_rate=0.1)
    want = traverse_util.flatten_dict(state.state_dict(), sep="/")
    directory = tempfile.mkdtemp()
    t5x_optim.save_t5x_checkpoint(directory, state)
    readers = {
      "Checkpointer": lambda: checkpoints.Checkpointer(state, partitioner, directory).restore(
        step=2
      ),
      "OrbaxCheckpointManagerInterface": lambda: checkpoints.OrbaxCheckpointManagerInterface(
        directory, state, partitioner
      ).restore(step=2),
    }
    problems = []
    for name, read in readers.items():
      try:
        got = traverse_util.flatten_dict(read().state_dict(), sep="/")
      except Exception as e:  # noqa: BLE001 - reported as a problem
        problems.append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        continue
      problems += [f"{name}: {problem}" for problem in base.differences(got, want)]
    return problems

  return check


def main() -> int:
  def t5x_legacy_adafactor():
    from t5x import adafactor

    return adafactor.Adafactor(0.1)

  def our_adafactor():
    from t5x_optim import optimizers

    return optimizers.adafactor(0.1, min_dim_size_to_factor=2)

  checks = [
    ("T5X's adafactor.Adafactor", lambda p: _read_back(t5x_legacy_adafactor())(p)),
    ("t5x_optim.optimizers.adafactor", lambda p: _read_back(our_adafactor())(p)),
  ]
  return base.run_checks(checks)


if __name__ == "__main__":
  sys.exit(main())
