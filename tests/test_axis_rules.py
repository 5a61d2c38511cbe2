"""Tests for logical axis rules and logical -> mesh spec conversion."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P

from t5x_optim.partitioning import (
  LogicalAxisRules,
  UnknownAxis,
  add_optimizer_state_axis,
  as_logical_axis_rules,
  logical_to_mesh_axes,
  logical_to_mesh_axes_tree,
  optimizer_state_mesh_axes_tree,
  standard_logical_axis_rules,
)

STANDARD_CASES = [
  # (activation dims, parameter dims, logical spec, mesh spec)
  (1, 1, P("batch", "length", "embed"), P("data", None, None)),
  (1, 1, P("embed", "mlp"), P(None, "model")),
  (1, 1, P("vocab", "embed"), P("model", None)),
  (1, 1, P("embed", "heads", "kv"), P(None, "model", None)),
  (1, 1, P("joined_kv", "embed"), P("model", None)),
  (1, 1, P("batch", "length", "vocab"), P("data", None, "model")),
  (1, 1, P("layers", "relpos_buckets", "abspos_buckets", "stack"), P(None, None, None, None)),
  (2, 1, P("batch", "length", "embed"), P("data", None, "model")),
  (2, 1, P("embed", "mlp"), P(None, "model")),
  (2, 1, P("batch", "length", "mlp_activations", "mlp"), P("data", None, None, "model")),
  (1, 2, P("embed", "mlp"), P("data", "model")),
  (1, 2, P("vocab", "embed"), P("model", "data")),
  (1, 2, P("embed", "kv"), P("data", None)),
  (1, 2, P("batch", "embed"), P("data", None)),
  (2, 2, P("batch", "length", "embed"), P("data", None, "model")),
  (2, 2, P("embed", "mlp"), P("data", "model")),
  (2, 2, P("embed", "kv"), P("model", None)),
  (1, 1, P(None, "mlp"), P(None, "model")),
  (1, 1, P(), P()),
]


@pytest.mark.parametrize("act_dims, param_dims, logical, expected", STANDARD_CASES)
def test_standard_rules(act_dims, param_dims, logical, expected):
  rules = standard_logical_axis_rules(
    activation_partitioning_dims=act_dims, parameter_partitioning_dims=param_dims
  )
  assert logical_to_mesh_axes(logical, rules) == expected


@pytest.mark.parametrize("act_dims, param_dims, logical, expected", STANDARD_CASES)
def test_standard_rules_agree_with_flax(act_dims, param_dims, logical, expected):
  rules = standard_logical_axis_rules(
    activation_partitioning_dims=act_dims, parameter_partitioning_dims=param_dims
  )
  assert nn.logical_to_mesh_axes(tuple(logical), tuple(rules)) == expected


def test_repeated_mesh_axis_keeps_the_earlier_rule():
  rules = [("embed", "data"), ("batch", "data")]
  assert logical_to_mesh_axes(P("batch", "embed"), rules) == P(None, "data")


def test_tuple_mesh_axes_block_later_rules():
  rules = [("embed", ("data", "model")), ("mlp", "model")]
  assert logical_to_mesh_axes(P("embed", "mlp"), rules) == P(("data", "model"), None)


@pytest.mark.parametrize("flag, axis", [(False, None), (True, "data")])
def test_zero_flag_sets_optimizer_state_axis(flag, axis):
  rules = standard_logical_axis_rules(shard_optimizer_state_over_data=flag)
  assert rules.optimizer_state_axis == axis


def test_additional_rules_come_last():
  rules = standard_logical_axis_rules(additional_rules=[("mlp", "data"), ("experts", "data")])
  assert tuple(rules)[-2:] == (("mlp", "data"), ("experts", "data"))
  assert logical_to_mesh_axes(P("experts", "mlp"), rules) == P("data", "model")


@pytest.mark.parametrize(
  "kwargs",
  [
    {"activation_partitioning_dims": 3},
    {"parameter_partitioning_dims": 0},
  ],
)
def test_standard_rules_reject_bad_dims(kwargs):
  with pytest.raises(ValueError, match="must be 1 or 2"):
    standard_logical_axis_rules(**kwargs)


@pytest.mark.parametrize(
  "rules, match",
  [
    ([("batch",)], "pair"),
    ([(1, "data")], "pair"),
  ],
)
def test_malformed_rules(rules, match):
  with pytest.raises(ValueError, match=match):
    LogicalAxisRules(rules)


def test_plain_list_of_pairs_becomes_rules_without_zero():
  rules = as_logical_axis_rules([["batch", "data"], ["embed", ["data", "model"]]])
  assert rules == LogicalAxisRules((("batch", "data"), ("embed", ("data", "model"))))
  assert rules.optimizer_state_axis is None


def test_unknown_name_raises_naming_it():
  with pytest.raises(ValueError, match=r"No logical axis rule for \['expert'\]"):
    logical_to_mesh_axes(P("expert", "mlp"), standard_logical_axis_rules())


@pytest.mark.parametrize("policy", [UnknownAxis.REPLICATE, "replicate"])
def test_unknown_name_replicate_policy(policy):
  spec = logical_to_mesh_axes(P("expert", "mlp"), standard_logical_axis_rules(), unknown=policy)
  assert spec == P(None, "model")


def test_repeated_logical_name_raises():
  with pytest.raises(ValueError, match=r"\['mlp'\] occur more than once"):
    logical_to_mesh_axes(P("mlp", "mlp"), standard_logical_axis_rules())


def test_none_spec_and_unconstrained_pass_through():
  rules = standard_logical_axis_rules()
  assert logical_to_mesh_axes(None, rules) is None
  assert logical_to_mesh_axes(P(P.UNCONSTRAINED, "mlp"), rules) == P(P.UNCONSTRAINED, "model")


MESH_2X4 = {"data": 2, "model": 4}


@pytest.mark.parametrize(
  "spec, shape, mesh_shape, expected",
  [
    (P(None, "model"), (6, 8), MESH_2X4, P("data", "model")),
    (P("model", None), (8, 6), MESH_2X4, P("model", "data")),
    (P(None, None), (3, 4), MESH_2X4, P(None, "data")),
    (None, (4, 8), MESH_2X4, P("data")),
    (P(), (4,), MESH_2X4, P("data")),
    (
      P("model"),
      (16,),
      MESH_2X4,
      P(
        ("model", "data"),
      ),
    ),
    (P("model"), (4,), MESH_2X4, P("model")),
    (P(None, "model"), (3, 8), MESH_2X4, P(None, ("model", "data"))),
    (P("data", None), (4, 8), MESH_2X4, P("data", None)),
    (None, (), MESH_2X4, None),
    (None, (3,), MESH_2X4, None),
    (None, (1,), MESH_2X4, None),
    (None, (8,), {"data": 1, "model": 8}, None),
    (P(None, "model"), (8, 8), {"data": 4, "model": 2}, P("data", "model")),
  ],
)
def test_add_optimizer_state_axis(spec, shape, mesh_shape, expected):
  result = add_optimizer_state_axis(spec, shape, mesh_axis="data", mesh_shape=mesh_shape)
  assert result == expected


def _adamw_logical_axes(param_axes):
  return (
    optax.ScaleByAdamState(count=None, mu=param_axes, nu=param_axes),
    optax.EmptyState(),
    optax.EmptyState(),
  )


PARAM_AXES = {"dense": {"kernel": P("embed", "mlp"), "bias": P("mlp")}, "scale": None}


def test_tree_conversion_keeps_empty_nodes_and_none():
  tree = (_adamw_logical_axes(PARAM_AXES), optax.MaskedNode())
  mesh_axes = logical_to_mesh_axes_tree(tree, standard_logical_axis_rules())
  expected_params = {"dense": {"kernel": P(None, "model"), "bias": P("model")}, "scale": None}
  assert mesh_axes == (_adamw_logical_axes(expected_params), optax.MaskedNode())


def test_tree_conversion_error_names_path():
  tree = {"layer": {"kernel": P("embed", "expert")}}
  match = r"layer/kernel: No logical axis rule for \['expert'\]"
  with pytest.raises(ValueError, match=match):
    logical_to_mesh_axes_tree(tree, standard_logical_axis_rules())


def test_tree_conversion_rejects_non_spec_leaf():
  with pytest.raises(TypeError, match=r"w: expected a PartitionSpec or None"):
    logical_to_mesh_axes_tree({"w": "embed"}, standard_logical_axis_rules())


def _shapes(param_shapes):
  return jax.tree.map(
    lambda s: jax.ShapeDtypeStruct(s, jnp.float32),
    param_shapes,
    is_leaf=lambda x: isinstance(x, tuple),
  )


PARAM_SHAPES = {"dense": {"kernel": (8, 16), "bias": (16,)}, "scale": (4,)}


@pytest.mark.parametrize(
  "zero, expected_mu",
  [
    (False, {"dense": {"kernel": P(None, "model"), "bias": P("model")}, "scale": None}),
    (
      True,
      {
        "dense": {
          "kernel": P("data", "model"),
          "bias": P(
            ("model", "data"),
          ),
        },
        "scale": P("data"),
      },
    ),
  ],
)
def test_optimizer_state_tree_with_and_without_zero(zero, expected_mu):
  rules = standard_logical_axis_rules(shard_optimizer_state_over_data=zero)
  logical = _adamw_logical_axes(PARAM_AXES)
  shapes = jax.eval_shape(optax.adamw(1e-3).init, _shapes(PARAM_SHAPES))
  mesh_axes = optimizer_state_mesh_axes_tree(logical, shapes, rules, mesh_shape=MESH_2X4)
  assert mesh_axes == _adamw_logical_axes(expected_mu)
  params_only = logical_to_mesh_axes_tree(PARAM_AXES, rules)
  assert params_only["dense"]["kernel"] == P(None, "model")


def test_optimizer_state_axis_must_be_in_mesh():
  rules = LogicalAxisRules((("mlp", "model"),), optimizer_state_axis="replica")
  with pytest.raises(ValueError, match="'replica' is not a mesh axis"):
    optimizer_state_mesh_axes_tree(
      {"w": P("mlp")}, _shapes({"w": (8,)}), rules, mesh_shape=MESH_2X4
    )


@pytest.mark.parametrize(
  "rules, match",
  [
    ("mlp", r"a sequence of \(logical_name, mesh_axes\) pairs, not the str 'mlp'"),
    ([("mlp", 3)], r"\('mlp', 3\): mesh_axes is None, a mesh axis name or a tuple of names"),
    ([("mlp", ("model", 2))], r"\('mlp', \('model', 2\)\): mesh_axes is None"),
    ([("mlp", P.UNCONSTRAINED)], r"\('mlp', UNCONSTRAINED\): mesh_axes is None"),
  ],
)
def test_rules_with_mesh_axes_of_another_type_are_refused_naming_the_rule(rules, match):
  with pytest.raises(ValueError, match=match):
    as_logical_axis_rules(rules)


def test_a_dimension_with_several_logical_names_is_refused():
  with pytest.raises(ValueError, match=r"dimension 0 of P\(\('embed', 'mlp'\), None\) names"):
    logical_to_mesh_axes(P(("embed", "mlp"), None), standard_logical_axis_rules())


def test_a_tuple_of_names_without_rules_passes_through_as_mesh_axes():
  assert logical_to_mesh_axes(P(("data", "model")), [("mlp", "model")]) == P(("data", "model"))


@pytest.mark.parametrize("zero", [False, True])
def test_optimizer_state_tree_keeps_unconstrained_dimensions(zero):
  rules = standard_logical_axis_rules(shard_optimizer_state_over_data=zero)
  mesh_axes = optimizer_state_mesh_axes_tree(
    {"w": P(P.UNCONSTRAINED, "mlp")}, _shapes({"w": (6, 8)}), rules, mesh_shape=MESH_2X4
  )
  expected = ("model", "data") if zero else "model"
  assert mesh_axes == {"w": P(P.UNCONSTRAINED, expected)}


@pytest.mark.parametrize("zero", [False, True])
def test_optimizer_state_tree_refuses_a_spec_longer_than_the_leaf(zero):
  rules = standard_logical_axis_rules(shard_optimizer_state_over_data=zero)
  with pytest.raises(
    ValueError, match=r"w: sharding P\('model', None, None\) has 3 entries .* \(16, 4\)"
  ):
    optimizer_state_mesh_axes_tree(
      {"w": P("mlp", None, None)}, _shapes({"w": (16, 4)}), rules, mesh_shape=MESH_2X4
    )


@pytest.mark.parametrize("spec", [P(("data", "expert")), P("mlp")])
def test_optimizer_state_tree_refuses_mesh_axes_not_in_the_mesh(spec):
  rules = [("mlp", "expert")]
  with pytest.raises(ValueError, match=r"w: mesh axes \['expert'\] of .* are not in the mesh"):
    optimizer_state_mesh_axes_tree({"w": spec}, _shapes({"w": (16,)}), rules, mesh_shape=MESH_2X4)
