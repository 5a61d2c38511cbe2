"""Low-precision state specs under T5X's own train state and partitioner, on T5X's T5 networks.

Run by ``tests/test_low_precision_sharded.py`` in a fresh process where T5X is at hand
(T5X_SRC and T5X's dependencies); CI has neither and skips it. T5X's modules (its T5 and
scalable T5.1.1 example networks included) are read from T5X_SRC, as for
``tests/data/t5x_muon/check_with_t5x.py``; the optimizer is
``OptaxWrapper(low_precision(optax.adamw(...), mode, min_size=64))`` from
``t5x_optim.optimizers``, as a T5X gin file that imports ``t5x_optim.optimizers`` gives it.

For each mode (8-bit, 4-bit, bfloat16) and network (``examples/t5``, unscanned, and
``examples/scalable_t5`` with scanned layers), tiny and emitting ``params_axes``, T5X's
``utils.TrainStateInitializer`` builds the train state with T5X's ``PjitPartitioner`` on 8
simulated CPU devices (data=2 x model=4, 2-D parameter rules). Checks:

- both of adam's moments of every param are in T5X's state dict, as the param's shape
  (float32 or bfloat16) or as codes and block statistics (8-bit, 4-bit), and some params'
  in the mode;
- T5X's mesh axes for a moment of the param's shape, and for its codes, are the param's;
  its block statistics use no mesh axis the param does not use on that dimension (a
  dimension of fewer blocks than devices is replicated); every counter is replicated;
- the state T5X initialises from scratch is placed so (each leaf's sharding);
- `t5x_optim.partitioning.build_plan` (what ``t5x-optim plan`` prints) on T5X's abstract
  train state gives every state leaf T5X's mesh axes.

Prints one line per mode and network and ``OK`` last on success; exits with status 1
otherwise.

Usage: T5X_SRC=/path/to/t5x/.git python tests/data/t5x_low_precision/check_with_t5x.py
"""

import functools
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "t5x_checkpoints"))

import make_with_t5x  # noqa: E402  (sets XLA_FLAGS before jax is imported)

MODES = ("8bit", "4bit", "bfloat16")
STATE = "state/param_states/inner_state/0/{}/"


def _axes_fit(field_axes, field_rank: int, param_axes, param_rank: int) -> bool:
  """Whether a block statistic's mesh axes use, on each dimension, the param's axis or none.

  A statistic of the param's rank (block scales) lines up with its dimensions; one of
  fewer (4-bit column maxima, one per column of the last dimensions) with its last ones.
  """
  field = tuple(field_axes or ()) + (None,) * field_rank
  param = tuple(param_axes or ()) + (None,) * param_rank
  field, param = field[:field_rank], param[:param_rank][param_rank - field_rank :]
  return all(a is None or a == b for a, b in zip(field, param))


def check(example: str, partitioner, mode: str) -> list[str]:
  """Every problem found for one mode on one network (empty: none); prints a summary line."""
  import optax

  from t5x_optim import optimizers

  optimizer_def = optimizers.OptaxWrapper(
    optimizers.low_precision(optax.adamw(0.01), mode, min_size=64)
  )
  initializer, axes, abstract = make_with_t5x.t5_train_state(example, optimizer_def, partitioner)
  params = {k[len("target/") :]: v for k, v in abstract.items() if k.startswith("target/")}
  param_axes = {k[len("target/") :]: v for k, v in axes.items() if k.startswith("target/")}
  problems, moments, counts = [], set(), {}
  for param, shape in params.items():
    for name in ("mu", "nu"):
      key = STATE.format(name) + param
      fields = {k: v for k, v in abstract.items() if k.startswith(key + "/")}
      if key in abstract:
        moments.add(key)
        kind = str(abstract[key].dtype)
        if abstract[key].shape != shape.shape:
          problems.append(f"{key}: shape {abstract[key].shape}, param {shape.shape}")
        if axes[key] != param_axes[param]:
          problems.append(f"{key}: mesh axes {axes[key]}, param {param_axes[param]}")
      elif key + "/codes" in fields:
        moments.update(fields)
        kind = "8bit" if fields[key + "/codes"].shape == shape.shape else "4bit"
        if axes[key + "/codes"] != param_axes[param]:
          problems.append(f"{key}/codes: mesh axes {axes[key + '/codes']}, param {param_axes[param]}")
        for field, value in fields.items():
          rank = len(value.shape)
          if not _axes_fit(axes[field], rank, param_axes[param], len(shape.shape)):
            problems.append(f"{field}: mesh axes {axes[field]}, param {param_axes[param]}")
      else:
        problems.append(f"{param}: no {name}")
        continue
      counts[kind] = counts.get(kind, 0) + (name == "mu")
  if not counts.get(mode):
    problems.append(f"no param's moments in {mode}: {counts}")
  others, unreplicated = make_with_t5x.not_replicated(abstract, axes, moments)
  problems += unreplicated
  problems += make_with_t5x.misplaced(initializer, partitioner, axes)
  plan = make_with_t5x.t5x_optim_plan(initializer, partitioner)
  planned = 0
  for row in plan.rows:
    key = "state/param_states/" + row.path
    if key not in axes:
      problems.append(f"plan {row.path}: not in T5X's train state")
      continue
    planned += 1
    want = tuple(axes[key] or ())
    want += (None,) * (len(row.shape) - len(want))
    if row.mesh_axes != want:
      problems.append(f"plan {row.path}: mesh axes {row.mesh_axes}, T5X {want}")
  sharded = sum(1 for key in moments if any(axes[key] or ()))
  stored = ", ".join(f"{n} params {kind}" for kind, n in sorted(counts.items()))
  print(
    f"{'OK  ' if not problems else 'FAIL'} {mode} {example}: {stored}; {len(moments)} state "
    f"arrays with their params' mesh axes ({sharded} sharded), {len(others)} other leaves "
    f"replicated; {planned} of {len(plan.rows)} plan rows checked; "
    f"mesh {dict(partitioner.mesh.shape)}"
  )
  return problems


def main() -> int:
  return make_with_t5x.run_checks(
    (f"{mode} {example}", functools.partial(check, example, mode=mode))
    for mode in MODES
    for example in make_with_t5x.EXAMPLES
  )


if __name__ == "__main__":
  sys.exit(main())
