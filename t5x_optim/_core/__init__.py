"""The core room: T5X's optimizer interface and its state-dict layout.

- `interface`: T5X's contract (`OptimizerDef`, `Optimizer`, `OptimizerState`)
  and the checks every definition shares;
- `state_dict`: T5X's state-dict layout and the restore checks that name a
  path and both sides.
- `configured`: the state leaves that only the config sets, set anew after a
  restore under a changed config.
- `placement`: the devices a restore or conversion reads onto, for targets
  sharded over an abstract mesh.

Imports only the axes room (`t5x_optim._axes`) and `t5x_optim._keypaths`.
"""
