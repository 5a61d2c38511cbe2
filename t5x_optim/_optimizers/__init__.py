"""Layer 2, optimizers: the `OptimizerDef`/`Optimizer` interface and adapters.

`interface` (T5X's contract), `state_dict` (T5X's state-dict layout and
restore checks, used by every adapter), and the adapters: optax
(`optax_wrapper`), `multi_optimizer`, `example_lib`, `kfac`. Each adapter
plugs its spec rules into layer 1 (`t5x_optim._axes`) and imports nothing
above it. Public through `t5x_optim` and `t5x_optim.optimizers`.
"""
