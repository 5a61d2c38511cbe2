"""The adapters room: other optimizer libraries behind T5X's interface.

- `optax_wrapper`: any optax transformation as an `OptimizerDef`, and
  `discovery`, which finds optax's optimizer factories to wrap;
- `multi_optimizer`: T5X's `MultiOptimizer` over parts of the params, which
  `param_subsets` chooses;
- `example_lib` (with `example_lib_layout`): `jax.example_libraries`
  triples;
- `kfac` (with `kfac_state`): kfac-jax, loaded on first use.

Each adapter plugs its spec rules into `t5x_optim._axes`; imports the
layouts room and below.
"""
