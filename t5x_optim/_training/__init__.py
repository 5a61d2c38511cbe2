"""Layer 3, training: train state, mesh, partitioner, checkpoints, plans.

Imports layers 1 and 2 only. Public through `t5x_optim`,
`t5x_optim.partitioning`, `t5x_optim.checkpoints`, `t5x_optim.t5x_checkpoints`
and `t5x_optim.distributed`.
"""
