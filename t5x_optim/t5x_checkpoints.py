"""Reading and writing T5X checkpoints, without T5X and without tensorflow.

A T5X model directory holds one directory per saved step,
``<model_dir>/checkpoint_<step>``, in one of two formats:

- **legacy** (T5X's ``Checkpointer``): a msgpack file ``checkpoint`` holding
  ``{'version': 3, 'optimizer': <state dict>}``. Scalars (the step, optax's
  ``count``) are stored inline as numpy values; every other array is a
  tensorstore zarr array in the step directory, named by its path joined with
  ``'.'`` (``target.dense.kernel``), and the msgpack holds its tensorstore spec
  with that relative path.
- **Orbax** (T5X's ``OrbaxCheckpointManagerInterface``): the state dict as an
  orbax PyTree item in ``checkpoint_<step>/state`` (OCDBT), beside a
  ``dataset`` item.

Both hold the T5X-layout state dict that `TrainState.state_dict` and
`Optimizer.state_dict` produce (``target/...``, ``state/step``,
``state/param_states/...``, and ``flax_mutables/...`` if any), so a T5X
checkpoint restores into a t5x_optim train state with the same optimizer and
model. `restore_t5x_checkpoint` checks the checkpoint's keys and shapes against
the target's state dict before any array is read, reads each array straight
into the target's sharding (any mesh; only this process's shards are read),
and hands the result to the target's own `restore_state`, which validates it
and applies the dtype rule. `save_t5x_checkpoint` writes the legacy format,
which T5X's ``Checkpointer`` (and its Orbax manager, which falls back to it)
restores.

Example:
  >>> import tempfile, jax.numpy as jnp
  >>> from t5x_optim import optimizers
  >>> opt = optimizers.adamw(1e-3).create({'w': jnp.arange(4.0)})
  >>> model_dir = tempfile.mkdtemp()
  >>> path = save_t5x_checkpoint(model_dir, opt)
  >>> t5x_checkpoint_steps(model_dir)
  [0]
  >>> restore_t5x_checkpoint(model_dir, opt).target['w'].tolist()
  [0.0, 1.0, 2.0, 3.0]
"""

from t5x_optim._checkpoint.api import restore_t5x_checkpoint
from t5x_optim._checkpoint.t5x_read import latest_t5x_step, t5x_checkpoint_steps
from t5x_optim._checkpoint.t5x_write import save_t5x_checkpoint

__all__ = [
  "latest_t5x_step",
  "restore_t5x_checkpoint",
  "save_t5x_checkpoint",
  "t5x_checkpoint_steps",
]
