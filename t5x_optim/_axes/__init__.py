"""The axes room: logical-axis rules and optimizer-state spec derivation.

One engine (`engine`), one registry of per-state-type rules (`registry`), one
fallback policy. Imports no other t5x_optim module. Public through
`t5x_optim.partitioning`.
"""
