"""Partitioning: optimizer-state partition rules, logical axis rules, meshes, plans.

The axis rules and `OptaxStatePartitionRules` come from the axes layer
(``t5x_optim/_axes``); meshes, the partitioner and the sharding plan from the
training layer (``t5x_optim/_training``).

Example:
  >>> import jax.numpy as jnp, optax
  >>> from jax.sharding import PartitionSpec as P
  >>> from t5x_optim import partitioning
  >>> params = {'w': jnp.ones((4, 8))}
  >>> tx = optax.adamw(1e-3)
  >>> specs = partitioning.OptaxStatePartitionRules.derive_optax_logical_axes(
  ...     tx.init(params), {'w': P('embed', 'mlp')}, transformation=tx, params=params)
  >>> specs[0].mu
  {'w': P('embed', 'mlp')}
"""

from t5x_optim._axes.engine import (
  OptaxStatePartitionRules,
  StateRulesFallback,
  logical_axes_from,
)
from t5x_optim._axes.registry import StateRuleContext, register_state_rule
from t5x_optim._axes.rules import (
  LogicalAxisRules,
  UnknownAxis,
  add_optimizer_state_axis,
  as_logical_axis_rules,
  logical_to_mesh_axes,
  logical_to_mesh_axes_tree,
  optimizer_state_mesh_axes_tree,
  standard_logical_axis_rules,
)
from t5x_optim._training.init import abstract_train_state, init_sharded
from t5x_optim._training.mesh import create_mesh
from t5x_optim._training.partitioner import Partitioner, check_divisible
from t5x_optim._training.plan import (
  LeafRow,
  Plan,
  build_plan,
  format_bytes,
  format_table,
  plan_to_json,
)

__all__ = [
  "LeafRow",
  "LogicalAxisRules",
  "OptaxStatePartitionRules",
  "Partitioner",
  "Plan",
  "StateRuleContext",
  "StateRulesFallback",
  "UnknownAxis",
  "abstract_train_state",
  "add_optimizer_state_axis",
  "as_logical_axis_rules",
  "build_plan",
  "check_divisible",
  "create_mesh",
  "format_bytes",
  "format_table",
  "init_sharded",
  "logical_axes_from",
  "logical_to_mesh_axes",
  "logical_to_mesh_axes_tree",
  "optimizer_state_mesh_axes_tree",
  "plan_to_json",
  "register_state_rule",
  "standard_logical_axis_rules",
]
