"""Sharded, crash-safe checkpoints of train states and optimizers with orbax.

A checkpoint holds the T5X-layout state dict (``{'target': ..., 'state':
{'step': ..., 'param_states': ...}}``, plus ``flax_mutables`` for a
`TrainState`) written by orbax-checkpoint's `CheckpointManager`: each process
writes the shards it holds, nothing is gathered to one host. Restoring reads
straight into the target's shardings, which may be on another mesh shape or
device count than at save time, so no unsharded copy is ever built.

Safety comes from orbax: a step is written to a temporary directory that is
renamed only once complete, so a crash mid-save leaves the earlier steps
intact and the partial one invisible (and removed by the next writer). Before
any array is read, the checkpoint's tree metadata is checked against the
target's state dict; a mismatch raises a `ValueError` naming the paths, and
nothing is restored.

Integrity: every saved array gets a 32-bit checksum, computed on the devices
where the array lives (one fused pass per array, reduced over all shards and
processes, so it does not depend on the sharding) and recorded by
process 0 in ``<step>/checksums/checksums.json``, part of the same atomic
orbax commit as the arrays (``<step>/default``, a plain orbax PyTree). Restore
recomputes it on the restored arrays, on whatever mesh they land, and any
difference, like every other storage failure (missing, truncated or corrupt
files, tensorstore errors, a step without checksums), raises `CheckpointError`
naming the step and the array path. `Checkpointer.restore(..., fallback=True)`
then falls back to the newest intact step. Each step also records the
classes of the optimizer state's nodes (``<step>/state_classes``): a restore
into an optimizer whose state has another class at the same path (adam's
checkpoint into adabelief, whose keys agree) is refused. An array without
elements (a layer of width 0), which orbax cannot write, is recorded by its
path, shape and dtype (``<step>/zero_size_arrays``) and restored as the
target's empty array, after the same checks. One writer per directory: the
first `save` takes an exclusive lock (``fcntl.flock`` on
``<directory>/.t5x_optim.lock``, held by process 0, released by `close` or
when the process dies).

Example:
  >>> import tempfile, jax.numpy as jnp
  >>> from t5x_optim import optimizers
  >>> opt = optimizers.adamw(1e-3).create({'w': jnp.ones(4)})
  >>> with Checkpointer(tempfile.mkdtemp(), keep=2) as ckpt:
  ...   ckpt.save(1, opt)
  ...   ckpt.wait_until_finished()
  ...   restored = ckpt.restore(opt)
  >>> restored.target['w'].tolist()
  [1.0, 1.0, 1.0, 1.0]
"""

from t5x_optim._checkpoint.api import Checkpointer
from t5x_optim._checkpoint.lock import WriterLock
from t5x_optim._checkpoint.store import CheckpointError, CheckpointState, is_committed_step

__all__ = ["CheckpointError", "CheckpointState", "Checkpointer", "WriterLock", "is_committed_step"]
