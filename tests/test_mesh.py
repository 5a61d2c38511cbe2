"""Tests for create_mesh on 8 simulated CPU devices."""

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from t5x_optim.partitioning import create_mesh

LAYOUTS = [(1, 8), (2, 4), (4, 2), (8, 1)]


def _shape(mesh):
  return dict(mesh.shape)


@pytest.mark.parametrize("data, model", LAYOUTS)
def test_from_num_partitions(data, model):
  mesh = create_mesh(num_partitions=model)
  assert mesh.axis_names == ("data", "model")
  assert _shape(mesh) == {"data": data, "model": model}
  assert set(mesh.devices.flat) == set(jax.devices())


@pytest.mark.parametrize("data, model", LAYOUTS)
def test_from_shape(data, model):
  mesh = create_mesh(shape={"model": model, "data": data})
  assert _shape(mesh) == {"data": data, "model": model}


@pytest.mark.parametrize(
  "submesh, data, model",
  [
    ((1, 1, 1, 1), 8, 1),
    ((2, 1, 1, 1), 4, 2),
    ((2, 2, 1, 1), 2, 4),
    ((2, 2, 1, 2), 1, 8),
  ],
)
def test_from_model_parallel_submesh(submesh, data, model):
  assert _shape(create_mesh(model_parallel_submesh=submesh)) == {"data": data, "model": model}


def test_default_is_data_parallel():
  assert _shape(create_mesh()) == {"data": 8, "model": 1}


@pytest.mark.parametrize(
  "kwargs, match",
  [
    ({"num_partitions": 3}, r"num_partitions=3 does not divide the 8 available devices"),
    ({"num_partitions": 0}, r"num_partitions=0 does not divide the 8 available devices"),
    (
      {"model_parallel_submesh": (3, 1)},
      r"model_parallel_submesh=\(3, 1\) \(product 3\) does not divide the 8 available",
    ),
    ({"shape": {"data": 3, "model": 2}}, r"needs 6 devices, but 8 devices are available"),
    ({"shape": {"data": 4}}, r"exactly the keys"),
    ({"num_partitions": 2, "shape": {"data": 4, "model": 2}}, r"at most one"),
    (
      {"num_partitions": 4, "devices": jax.devices()[:6]},
      r"num_partitions=4 does not divide the 6 available devices",
    ),
  ],
)
def test_layout_errors(kwargs, match):
  with pytest.raises(ValueError, match=match):
    create_mesh(**kwargs)


@pytest.mark.parametrize("count, model", [(4, 2), (2, 1), (6, 3)])
def test_device_subset_in_given_order(count, model):
  devices = jax.devices()[::-1][:count]
  mesh = create_mesh(num_partitions=model, devices=devices)
  assert _shape(mesh) == {"data": count // model, "model": model}
  assert list(mesh.devices.flat) == devices


@pytest.mark.parametrize(
  "axis_types, expected",
  [
    (AxisType.Auto, (AxisType.Auto, AxisType.Auto)),
    (AxisType.Explicit, (AxisType.Explicit, AxisType.Explicit)),
    ((AxisType.Explicit, AxisType.Auto), (AxisType.Explicit, AxisType.Auto)),
  ],
)
def test_axis_types(axis_types, expected):
  assert create_mesh(num_partitions=2, axis_types=axis_types).axis_types == expected


@pytest.mark.parametrize("axis_types", [AxisType.Auto, AxisType.Explicit])
def test_auto_mesh_shards_a_matmul_over_the_contracting_dim(axis_types):
  """The default (Auto) mesh runs it; an Explicit one refuses it (docs/design.md, "Meshes")."""
  mesh = create_mesh(num_partitions=4, axis_types=axis_types)
  x_values = np.arange(16, dtype=np.float32).reshape(2, 8)
  w_values = np.arange(24, dtype=np.float32).reshape(8, 3)
  x = jax.device_put(x_values, NamedSharding(mesh, PartitionSpec(None, "model")))
  w = jax.device_put(w_values, NamedSharding(mesh, PartitionSpec("model")))
  assert len(x.addressable_shards) == 8 and x.addressable_shards[0].data.shape == (2, 2)
  matmul = jax.jit(lambda a, b: a @ b)
  if axis_types is AxisType.Explicit:
    with pytest.raises(Exception, match="Contracting dimensions are sharded"):
      matmul(x, w)
    return
  np.testing.assert_array_equal(matmul(x, w), x_values @ w_values)
