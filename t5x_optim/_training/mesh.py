"""Device meshes with a ``('data', 'model')`` layout.

Multi-process: by default the mesh spans ``jax.devices()``, which lists the
devices of *every* process (not just ``jax.local_devices()``), so each process
builds the same global mesh, as ``jax.jit`` with ``NamedSharding`` requires.
The data axis is the outer (slower) one, so with ``model`` no larger than the
local device count a process holds whole rows of the mesh.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

DATA_AXIS = "data"
MODEL_AXIS = "model"
MESH_AXES = (DATA_AXIS, MODEL_AXIS)


def _model_axis_size(
  num_partitions: int | None,
  model_parallel_submesh: Sequence[int] | None,
  shape: Mapping[str, int] | None,
  num_devices: int,
) -> tuple[int, int]:
  """Returns ``(data, model)`` sizes from exactly one of the three options."""
  given = [
    name
    for name, value in (
      ("num_partitions", num_partitions),
      ("model_parallel_submesh", model_parallel_submesh),
      ("shape", shape),
    )
    if value is not None
  ]
  if len(given) > 1:
    raise ValueError(
      f"Pass at most one of num_partitions, model_parallel_submesh and shape; got {given}."
    )
  if shape is not None:
    if set(shape) != set(MESH_AXES):
      raise ValueError(f"shape must have exactly the keys {MESH_AXES}; got {dict(shape)}.")
    data, model = shape[DATA_AXIS], shape[MODEL_AXIS]
    if data < 1 or model < 1 or data * model != num_devices:
      raise ValueError(
        f"Mesh shape {dict(shape)} needs {data * model} devices, "
        f"but {num_devices} devices are available."
      )
    return data, model
  if model_parallel_submesh is not None:
    model = math.prod(model_parallel_submesh)
    source = f"model_parallel_submesh={tuple(model_parallel_submesh)} (product {model})"
  else:
    model = 1 if num_partitions is None else num_partitions
    source = f"num_partitions={model}"
  if model < 1 or num_devices % model:
    raise ValueError(f"{source} does not divide the {num_devices} available devices.")
  return num_devices // model, model


def create_mesh(
  *,
  num_partitions: int | None = None,
  model_parallel_submesh: Sequence[int] | None = None,
  devices: Sequence[jax.Device] | None = None,
  shape: Mapping[str, int] | None = None,
  axis_types: AxisType | Sequence[AxisType] = AxisType.Auto,
) -> Mesh:
  """Creates a ``('data', 'model')`` mesh.

  Give at most one of ``num_partitions`` (the model-axis size),
  ``model_parallel_submesh`` (a tuple whose product is the model-axis size,
  as in T5X; the submesh's physical layout is not used) and ``shape``
  (``{'data': n, 'model': m}``). With none, every device goes on ``data``.
  The data-axis size is the device count divided by the model-axis size.

  Args:
    num_partitions: model-axis size.
    model_parallel_submesh: model-parallel submesh; its product is the
      model-axis size.
    devices: devices to use, in this order. Defaults to ``jax.devices()``
      (global over processes) arranged by
      ``jax.experimental.mesh_utils.create_device_mesh``, which is
      topology-aware on TPU and GPU and keeps the order on CPU.
    shape: explicit ``{'data': n, 'model': m}``.
    axis_types: one ``jax.sharding.AxisType`` for both axes or one per axis.
      ``Auto`` by default, which lets XLA shard matmuls over sharded
      contracting dims (``jax.make_mesh`` defaults to ``Explicit``).

  Returns:
    A ``jax.sharding.Mesh`` with axes ``('data', 'model')``.

  Raises:
    ValueError: more than one layout option, or a layout that does not
      factor the device count (the message gives both counts).

  Example:
    >>> mesh = create_mesh(num_partitions=1, devices=jax.devices()[:1])
    >>> dict(mesh.shape)
    {'data': 1, 'model': 1}
  """
  num_devices = jax.device_count() if devices is None else len(devices)
  data, model = _model_axis_size(num_partitions, model_parallel_submesh, shape, num_devices)
  if isinstance(axis_types, AxisType):
    axis_types = (axis_types,) * len(MESH_AXES)
  if devices is None:
    device_grid = mesh_utils.create_device_mesh((data, model))
  else:
    device_grid = np.asarray(list(devices), dtype=object).reshape(data, model)
  return Mesh(device_grid, MESH_AXES, axis_types=tuple(axis_types))
