"""Muon's state specs under T5X's own train state and partitioner, on T5X's own T5 networks.

Run by ``tests/test_muon.py`` in a fresh process where T5X is at hand (T5X_SRC and
T5X's dependencies, as for ``tests/data/t5x_checkpoints/make_with_t5x.py``); CI has
neither and skips it. T5X's modules (its T5 and scalable T5.1.1 example networks
included) are read from T5X_SRC; ``t5x.optimizers`` stays T5X's own, and the optimizer
is ``t5x_optim.optimizers.muon``, as a T5X gin file that imports ``t5x_optim.optimizers``
gives it.

For each network (T5X's ``examples/t5`` one, unscanned, and ``examples/scalable_t5``
with scanned layers, whose params carry a ``layers`` axis at position 1), tiny and
emitting ``params_axes``, T5X's ``utils.TrainStateInitializer`` builds the train state
with T5X's ``PjitPartitioner`` on 8 simulated CPU devices (data=2 x model=4, 2-D
parameter rules). Checks:

- T5X's train state called ``set_param_axes``: Muon's momentum covers exactly the
  kernels (every ``kernel`` but the ``vocab``-sized logits; the scanned ones 3-D or 4-D),
  Adam's moments every other param (embeddings, logits, relative-position biases,
  layer-norm scales), each of its param's shape;
- T5X's mesh axes for every momentum and moment are its param's, and every counter and
  Newton-Schulz coefficient is replicated;
- the state T5X initialises from scratch is placed so (each leaf's sharding);
- `t5x_optim.partitioning.build_plan` (what ``t5x-optim plan`` prints) on T5X's abstract
  train state gives every state leaf its param's mesh axes.

Prints one line per network and ``OK`` last on success; exits with status 1 otherwise.

Usage: T5X_SRC=/path/to/t5x/.git python tests/data/t5x_muon/check_with_t5x.py
"""

import functools
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "t5x_checkpoints"))

import make_with_t5x  # noqa: E402  (sets XLA_FLAGS before jax is imported)

EXAMPLES = make_with_t5x.EXAMPLES
STATE = "state/param_states/inner_states/{}/inner_state/0/{}/"


def _expected_branch(param: str) -> str:
  name = param.rsplit("/", 1)[-1]
  return "muon" if name == "kernel" and "logits_dense" not in param else "adam"


def check(example: str, partitioner) -> list[str]:
  """Every problem found on one network (empty: none); prints its summary line."""

  from t5x_optim import optimizers

  optimizer_def = optimizers.muon(learning_rate=0.02)
  initializer, axes, abstract = make_with_t5x.t5_train_state(example, optimizer_def, partitioner)
  problems = []
  if optimizer_def.param_specs is None:
    return ["T5X's train state did not call set_param_axes"]

  params = {k[len("target/") :]: v for k, v in abstract.items() if k.startswith("target/")}
  param_axes = {k[len("target/") :]: v for k, v in axes.items() if k.startswith("target/")}
  moments = {}
  for branch, names in (("muon", ("mu",)), ("adam", ("mu", "nu"))):
    for name in names:
      prefix = STATE.format(branch, name)
      for key in abstract:
        if key.startswith(prefix):
          moments[key] = (branch, key[len(prefix) :])
  for param in params:
    want = _expected_branch(param)
    for name in ("mu",) if want == "muon" else ("mu", "nu"):
      key = STATE.format(want, name) + param
      if key not in moments:
        problems.append(f"{param}: no {want} {name}")
  kernel_ranks = set()
  for key, (branch, param) in moments.items():
    if _expected_branch(param) != branch or param not in params:
      problems.append(f"{key}: a {branch} moment of a param that must not have one")
      continue
    if abstract[key].shape != params[param].shape:
      problems.append(f"{key}: shape {abstract[key].shape}, param {params[param].shape}")
    if axes[key] != param_axes[param]:
      problems.append(f"{key}: mesh axes {axes[key]}, param {param_axes[param]}")
    if branch == "muon":
      kernel_ranks.add(len(params[param].shape))
  others, unreplicated = make_with_t5x.not_replicated(abstract, axes, moments)
  problems += unreplicated
  problems += make_with_t5x.misplaced(initializer, partitioner, axes)
  plan = make_with_t5x.t5x_optim_plan(initializer, partitioner)
  for row in plan.rows:
    if row.param is None:
      continue
    want = tuple(param_axes[row.param] or ())
    want += (None,) * (len(row.shape) - len(want))
    if row.mesh_axes != want:
      problems.append(f"plan {row.path}: mesh axes {row.mesh_axes}, param {want}")
  muon = sum(1 for branch, _ in moments.values() if branch == "muon")
  sharded = sum(1 for key in moments if any(axes[key] or ()))
  print(
    f"{'OK  ' if not problems else 'FAIL'} {example}: Muon on {muon} kernels "
    f"(rank {'/'.join(map(str, sorted(kernel_ranks)))}), Adam on {len(params) - muon} params; "
    f"{len(moments)} moments with their params' mesh axes ({sharded} sharded), "
    f"{len(others)} other leaves replicated; {len(plan.rows)} plan rows; "
    f"mesh {dict(partitioner.mesh.shape)}"
  )
  return problems


def main() -> int:
  return make_with_t5x.run_checks(
    (example, functools.partial(check, example)) for example in EXAMPLES
  )


if __name__ == "__main__":
  sys.exit(main())
