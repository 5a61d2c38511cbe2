"""Layer 3, training: train state, mesh, partitioner, checkpoints, plans.

Checkpoints are `checkpoints` (the `Checkpointer`) and the modules it is
made of: `checkpoint_leaves` (stored against expected leaves),
`checkpoint_headers` (reading array headers only), `checkpoint_checksums`
and `checkpoint_lock` (the writer lock; `checkpoint_lease` on object stores);
every path goes through `storage` (epath files, tensorstore kvstores by
scheme); `t5x_checkpoints` reads T5X's own
format and `t5x_checkpoint_writer` writes it; `convert_checkpoint` restores either into a train state
with another optimizer. Imports layers 0-2 only. Public through `t5x_optim`,
`t5x_optim.partitioning`, `t5x_optim.checkpoints`, `t5x_optim.t5x_checkpoints`
and `t5x_optim.distributed`.
"""
