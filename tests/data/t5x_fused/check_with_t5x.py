"""Checks the fused update inside T5X's own train state and partitioner (run by hand).

Like tests/data/t5x_checkpoints/check_with_t5x.py, T5X is read from the git directory
named by T5X_SRC, and this needs an environment with T5X's dependencies and t5x_optim;
the test suite never runs it.

On 8 simulated CPU devices (mesh data=2 x model=4, T5X's 2-D parameter rules), T5X's
`FlaxOptimTrainState` is created with t5x_optim's `OptaxWrapper` for each optimizer below,
once plain and once with ``fused="interpret"``, and T5X's `PjitPartitioner.partition`
jits three training steps of each. The fused steps must run the kernel (a `pallas_call`
in the step's jaxpr), give the plain steps' params and state within 2 ulps of each
leaf's largest value, and keep the plain steps' shardings. It prints one line per
optimizer and exits with status 1 on any difference.

Usage:
  T5X_SRC=/path/to/t5x/.git PYTHONPATH=. python tests/data/t5x_fused/check_with_t5x.py
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "t5x_checkpoints"))

import make_with_t5x  # noqa: E402  (sets the XLA flags before jax is imported)

STEPS = 3
ULPS = 2.0


def _ulps(got, want):
  import jax
  import numpy as np

  worst = 0.0
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    a, b = np.asarray(a), np.asarray(b)
    if not np.issubdtype(b.dtype, np.floating):
      worst = max(worst, 0.0 if np.array_equal(a, b) else np.inf)
      continue
    scale = np.spacing(np.max(np.abs(b)).astype(b.dtype)).astype(np.float64)
    worst = max(worst, float(np.max(np.abs(a.astype(np.float64) - b)) / scale))
  return worst


def main() -> int:
  make_with_t5x.load_t5x()
  import jax
  import optax
  from t5x import train_state as train_state_lib

  from t5x_optim import OptaxWrapper

  partitioner = make_with_t5x.t5x_partitioner()
  txs = {
    "adamw": lambda: optax.adamw(learning_rate=0.1, weight_decay=0.01),
    "clip_adamw": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(0.1)),
    "lion": lambda: optax.lion(1e-2),
  }

  def train_step(state, seed):
    grads = jax.tree.map(lambda p: jax.random.normal(jax.random.key(seed), p.shape), state.params)
    return state.apply_gradient(grads, learning_rate=None)

  failures = 0
  for name, make in txs.items():
    results = {}
    for fused in ("off", "interpret"):
      state = train_state_lib.FlaxOptimTrainState.create(
        OptaxWrapper(make(), fused=fused), make_with_t5x.tiny_variables()
      )
      axes = partitioner.get_mesh_axes(state)
      step = partitioner.partition(train_step, in_axis_resources=(axes, None),
                                   out_axis_resources=axes)
      state = jax.device_put(state, jax.tree.map(
        lambda spec: jax.sharding.NamedSharding(partitioner.mesh, spec or
                                                jax.sharding.PartitionSpec()),
        axes, is_leaf=lambda x: x is None or isinstance(x, jax.sharding.PartitionSpec)))
      jaxpr = str(jax.make_jaxpr(train_step)(state, 0))
      for seed in range(STEPS):
        state = step(state, seed)
      results[fused] = (state, "pallas_call" in jaxpr)
    (plain, _), (fused_state, ran_kernel) = results["off"], results["interpret"]
    ulps = max(_ulps(fused_state.params, plain.params),
               _ulps(fused_state.param_states, plain.param_states))
    specs = [jax.tree.map(lambda x: x.sharding.spec, s.state_dict()) for s in (plain, fused_state)]
    ok = ran_kernel and ulps <= ULPS and specs[0] == specs[1] and int(fused_state.step) == STEPS
    failures += not ok
    print(f"{'OK  ' if ok else 'FAIL'} {name}: kernel ran {ran_kernel}, {ulps:g} ulps from plain "
          f"after {STEPS} steps, shardings {'equal' if specs[0] == specs[1] else 'DIFFER'}")
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())
