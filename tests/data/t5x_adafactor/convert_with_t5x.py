"""Converts an adamw state into T5X's own legacy Adafactor, which then trains on.

Run by ``tests/test_convert.py`` in a fresh process where T5X is at hand (T5X_SRC and
T5X's dependencies, as for ``make_with_t5x.py``); CI has neither and skips it. T5X's
modules are read from T5X_SRC, with ``t5x.optimizers`` re-exporting
``t5x_optim.optimizers`` (the drop-in), so T5X's ``adafactor.Adafactor`` is a subclass
of our ``OptimizerDef`` and its param states are T5X's own ``_AdafactorParamState``.

Checks, on three tiny params (one factored each way, one not) after three adamw steps:
the converted state is T5X's own class with ``v_row``/``v_col``/``v``/``m`` as the
formulas give them from adamw's moments; T5X's ``apply_gradient`` takes two more steps
from it; and converting T5X's in-memory state back to adamw returns adamw's moments.
Prints ``OK`` on success.

Usage: T5X_SRC=/path/to/t5x/.git python tests/data/t5x_adafactor/convert_with_t5x.py
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "t5x_checkpoints"))

import make_with_t5x as base  # noqa: E402  (sets XLA_FLAGS before jax is imported)

LEARNING_RATE, STEPS = 0.1, 3
DROP_IN = (
  "from t5x_optim.optimizers import *\n"
  "from t5x_optim.optimizers import OptimizerDef, Optimizer, OptimizerState\n"
  "OptimizerType = Optimizer\nOptimizerDefType = OptimizerDef\nOptimizerStateType = OptimizerState\n"
)


def main() -> None:
  base.load_t5x()
  with open(os.path.join(sys.path[0], "t5x", "optimizers.py"), "w") as f:
    f.write(DROP_IN)
  import jax
  import jax.numpy as jnp
  import numpy as np
  from t5x import adafactor

  import t5x_optim
  from t5x_optim import optimizers

  rng = np.random.default_rng(0)
  params = {
    "dense": {"kernel": rng.normal(size=(4, 8)), "bias": rng.normal(size=(8,))},
    "embedding": rng.normal(size=(16, 4)),
  }
  params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
  grads = [jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
           for _ in range(STEPS + 2)]  # fmt: skip
  old = optimizers.adamw(1e-3).create(params)
  for g in grads[:STEPS]:
    old = old.apply_gradient(g)
  t5x_def = adafactor.Adafactor(decay_rate=0.8, step_offset=0, beta1=0.9, min_dim_size_to_factor=2)
  hparams = {"learning_rate": LEARNING_RATE}
  new, report = t5x_optim.convert_state(old, t5x_def, target_hparams=hparams)
  assert not report.initialised, report
  assert int(new.state.step) == STEPS

  adam = old.state.param_states[0]
  for path, p in jax.tree.flatten_with_path(old.target)[0]:
    keys = [k.key for k in path]
    state, mu, nu = new.state.param_states, adam.mu, adam.nu
    for key in keys:
      state, mu, nu = state[key], mu[key], nu[key]
    assert type(state) is adafactor._AdafactorParamState, type(state)
    mu = np.asarray(mu) / (1 - 0.9**STEPS)
    nu = np.asarray(nu) / (1 - 0.999**STEPS)
    if p.ndim == 1:
      np.testing.assert_allclose(state.v, nu, rtol=1e-5)
      seen = nu
    else:  # T5X keeps the smaller dim in v_row: d0 is the larger one.
      d0 = int(np.argmax(p.shape))
      np.testing.assert_allclose(state.v_row, nu.mean(axis=d0), rtol=1e-5)
      np.testing.assert_allclose(state.v_col, nu.mean(axis=1 - d0), rtol=1e-5)
      row = np.asarray(state.v_row) / np.mean(state.v_row)
      seen = np.expand_dims(row, d0) * np.expand_dims(np.asarray(state.v_col), 1 - d0)
    scale = LEARNING_RATE * max(float(np.sqrt(np.mean(np.square(p)))), 1e-3)
    np.testing.assert_allclose(
      state.m, mu * scale / np.sqrt(seen) * (1 - 0.9**STEPS), rtol=1e-5, atol=1e-9
    )

  trained = new
  for g in grads[STEPS:]:
    trained = trained.apply_gradient(g, learning_rate=LEARNING_RATE)
  assert int(trained.state.step) == STEPS + 2
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(trained))

  back, _ = t5x_optim.convert_state(
    new, optimizers.adamw(1e-3), source_hparams=hparams, missing="init"
  )
  for field in ("nu", "mu"):
    for path, want in jax.tree.flatten_with_path(getattr(adam, field))[0]:
      got = getattr(back.state.param_states[0], field)
      for key in path:
        got = got[key.key]
      if field == "nu" and want.ndim == 2:  # factored: adamw's nu only through its row and
        continue  # column averages, checked above
      np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-9, err_msg=f"{field} {path}")
  print("OK")


if __name__ == "__main__":
  main()
