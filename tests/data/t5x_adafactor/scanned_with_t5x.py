"""T5X's own legacy Adafactor on a scanned attention kernel, converted into adamw and back.

Run by ``tests/test_convert.py`` in a fresh process where T5X is at hand (T5X_SRC and
T5X's dependencies, as for ``convert_with_t5x.py``, whose drop-in ``t5x.optimizers`` it
uses); CI has neither and skips it.

A query kernel scanned at axis 1, ``('embed', 'layers', 'heads', 'kv')``, with as many
layers as heads (T5.1.1-base scanned: 12 and 12). Under T5X's
``standard_logical_factor_rules`` its row dims are ``(0,)``, its column dims ``(2, 3)``
and ``'layers'`` a batch dim; the shapes of ``v_row`` and ``v_col`` fit a second
factoring too, rows ``(0,)`` and columns ``(1, 3)``.

Checks: after three steps of T5X's ``apply_gradient``, `convert_state` with the param's
axes gives adamw the second moment T5X's update divides by (its formula, written here);
without them it refuses, naming the param. adamw converted back into T5X's Adafactor
(its factor map set from the same axes) holds ``v_row`` and ``v_col`` as the averages of
adamw's second moment over T5X's column and row dims, without the axes it refuses, and
T5X's ``apply_gradient`` trains on. Prints ``OK`` on success.

Usage: T5X_SRC=/path/to/t5x/.git python tests/data/t5x_adafactor/scanned_with_t5x.py
"""

import os
import sys

from convert_with_t5x import DROP_IN, base

LEARNING_RATE, STEPS = 0.1, 3
ROWS, COLUMNS = (0,), (2, 3)


def refused(convert) -> str:
  try:
    convert()
  except ValueError as error:
    return str(error)
  raise AssertionError("converted without the param's axes")


def main() -> None:
  base.load_t5x()
  with open(os.path.join(sys.path[0], "t5x", "optimizers.py"), "w") as f:
    f.write(DROP_IN)
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import PartitionSpec as P
  from t5x import adafactor

  import t5x_optim
  from t5x_optim import optimizers

  rng = np.random.default_rng(0)
  params = {"q": jnp.asarray(rng.normal(size=(16, 3, 3, 4)), jnp.float32)}
  grads = [{"q": jnp.asarray(rng.normal(size=(16, 3, 3, 4)), jnp.float32)} for _ in range(4)]
  axes = {"q": P("embed", "layers", "heads", "kv")}

  def t5x_def():
    optimizer_def = adafactor.Adafactor(
      decay_rate=0.8, step_offset=0, logical_factor_rules=adafactor.standard_logical_factor_rules()
    )
    optimizer_def.set_param_axes(axes)
    return optimizer_def

  old = t5x_def().create(params)
  for g in grads[:STEPS]:
    old = old.apply_gradient(g, learning_rate=LEARNING_RATE)
  state = old.state.param_states["q"]
  assert state.v_row.shape == (16, 3) and state.v_col.shape == (3, 3, 4), state
  # T5X's apply_param_gradient: the second moment its update divides by.
  v_row, v_col = np.asarray(state.v_row), np.asarray(state.v_col)
  reduced_d1 = tuple(d - len([e for e in COLUMNS if e < d]) for d in ROWS)
  row_col_mean = np.mean(v_row, axis=reduced_d1, keepdims=True)
  seen = np.expand_dims(v_row / row_col_mean, COLUMNS) * np.expand_dims(v_col, ROWS)

  adamw = optimizers.adamw(1e-3)
  new, _ = t5x_optim.convert_state(old, adamw, param_axes=axes, missing="init")
  nu = np.asarray(new.state.param_states[0].nu["q"]) / (1 - 0.999**STEPS)
  np.testing.assert_allclose(nu, seen, rtol=1e-5)
  error = refused(lambda: t5x_optim.convert_state(old, adamw, missing="init"))
  assert "Param 'q'" in error and "param_axes=" in error, error

  back, report = t5x_optim.convert_state(new, t5x_def(), param_axes=axes)
  assert not report.initialised, report
  state = back.state.param_states["q"]
  assert type(state) is adafactor._AdafactorParamState, type(state)
  np.testing.assert_allclose(state.v_row, nu.mean(axis=COLUMNS), rtol=1e-5)
  np.testing.assert_allclose(state.v_col, nu.mean(axis=ROWS), rtol=1e-5)
  error = refused(lambda: t5x_optim.convert_state(new, t5x_def()))
  assert "Param 'q'" in error, error
  trained = back.apply_gradient(grads[STEPS], learning_rate=LEARNING_RATE)
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(trained))
  print("OK")


if __name__ == "__main__":
  main()
