"""Layer 2, optimizers: the `OptimizerDef`/`Optimizer` interface and adapters.

- `interface`: T5X's contract (`OptimizerDef`, `Optimizer`, `OptimizerState`);
- `state_dict`: T5X's state-dict layout and restore checks, used by every
  adapter;
- `optax_wrapper`: any optax transformation as an `OptimizerDef`, and
  `discovery`, which finds optax's optimizer factories to wrap;
- `fused` (a subpackage): the fused (multi-tensor) update that
  `OptaxWrapper(fused=...)` runs: the elementwise analysis, the Pallas
  kernel and its sharding;
- `stacked`: params and optax state kept stacked by shape between steps,
  and the stacked layer `OptaxWrapper.create` puts around itself for them;
  it needs only the fused update's elementwise analysis;
- `layouts`: `UpdateLayout`, the wrapper's one hook into the fused update
  and the stacked layer;
- `multi_optimizer`: T5X's `MultiOptimizer` over parts of the params, which
  `param_subsets` chooses (traversals and the partition they make);
- `example_lib` (with `example_lib_layout`): `jax.example_libraries`
  triples;
- `kfac` (with `kfac_state`): kfac-jax, loaded on first use;
- `low_precision`: any optax optimizer's param-shaped state stored in
  bfloat16 (stochastic rounding) or block-wise 8 bits between steps;
- `convert`: optimizer-state conversion between optimizers, through the
  registry of converters keyed by state type (`convert_registry`) and the
  built-in converters and their formulas (`convert_builtin`).

Each adapter plugs its spec rules into layer 1 (`t5x_optim._axes`) and
imports nothing above it; `t5x_optim._keypaths` names tree paths for all
layers. Public through `t5x_optim` and `t5x_optim.optimizers`.
"""
