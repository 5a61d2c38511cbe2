"""The training room: the train state and what places it on devices.

- `train_state`: T5X's `TrainState` around an `Optimizer`;
- `mesh` and `partitioner`: device meshes and the partitioner that maps
  logical axes onto them; `init`: a sharded train state, built in place;
- `plan`: what every state leaf costs per device, before anything runs;
- `distributed`: starting and checking a multi-process job.

Imports the low-precision, core and lower rooms. Public through
`t5x_optim.partitioning` and `t5x_optim.distributed`.
"""
