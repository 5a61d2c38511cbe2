"""Global batches assembled from the rows each process reads (T5X's per-host input).

`global_batch` asks the task only for the rows of the devices this process
holds, so on N processes each one reads 1/N of every batch (times the
model-axis replication, which it reads once), yet the global array is the
same as on one process.

Example:
  >>> import jax
  >>> from jax.sharding import NamedSharding, PartitionSpec
  >>> from t5x_optim.cli.demo.model import SyntheticTask
  >>> mesh = jax.make_mesh((1,), ('data',), devices=jax.devices()[:1])
  >>> task = SyntheticTask(vocab_size=8, length=4, batch_size=4)
  >>> sharding = NamedSharding(mesh, PartitionSpec('data'))
  >>> batch = global_batch(lambda rows: task.batch(0, rows), sharding, (4, 4))
  >>> bool((jax.device_get(batch['inputs']) == task.batch(0)['inputs']).all())
  True
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import Sharding

__all__ = ["FEATURES", "global_batch"]

FEATURES = ("inputs", "targets")


def global_batch(
  read: Callable[[slice], dict[str, np.ndarray]],
  sharding: Sharding,
  shape: tuple[int, int],
  names: tuple[str, ...] = FEATURES,
) -> dict[str, jax.Array]:
  """The batch whose rows ``read(rows)`` returns, as global arrays sharded by `sharding`.

  Args:
    read: returns the given rows (a slice of the global batch) of every
      feature in `names`, each ``(rows, length)``.
    sharding: the batch sharding (rows over the data axis).
    shape: the global ``(batch_size, length)`` of every feature.
    names: the features.

  Returns:
    ``{feature: jax.Array}``; only the rows of this process's devices were
    read, each row range once.
  """
  pieces: dict[tuple[int, int], dict[str, np.ndarray]] = {}

  def piece(index: tuple[slice, ...]) -> dict[str, np.ndarray]:
    start, stop, _ = index[0].indices(shape[0])
    if (start, stop) not in pieces:
      pieces[(start, stop)] = read(slice(start, stop))
    return pieces[(start, stop)]

  return {
    name: jax.make_array_from_callback(
      shape, sharding, lambda index, name=name: piece(index)[name][:, index[1]]
    )
    for name in names
  }
