"""The per-leaf programs of a fused update: what one leaf computes, and how to run it.

The elementwise analysis (`t5x_optim._layouts.fused.analysis`) cuts an
optax update into one `Program` per leaf over ``("in", k)`` operands (the
leaf's param, gradient and state components) and scalar residuals; leaves
whose programs agree form a `Group`, and the groups with the scalar part
run before them make a `FusedPlan` (or a `NotFusible` refusal). `run_program` evaluates a program on
arrays of any shape: a Pallas block, a flat buffer or, under the plain
path's test, a whole leaf.

Example:
  >>> import jax, jax.numpy as jnp
  >>> double = Program(ops=((jax.lax.add_p, {}, (("in", 0), ("in", 0)), (0,)),),
  ...                  outs=(("val", 0),))
  >>> run_program(double, [jnp.arange(3.0)], [], (3,))
  [Array([0., 2., 4.], dtype=float32)]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
  "FusedPlan",
  "Group",
  "NotFusible",
  "Lit",
  "Op",
  "Program",
  "lit_key",
  "program_key",
  "program_signature",
  "run_program",
  "varying_alike",
  "varying_axes",
  "varying_over",
]

# Copies are the identity inside the kernel.
_COPIES = frozenset({"copy", "copy_p"})


class Lit(NamedTuple):
  """A literal operand of the traced update."""

  value: Any


@dataclasses.dataclass(frozen=True)
class Op:
  """One first-order operation of the inlined update: value ids in and out."""

  primitive: Any
  params: dict[str, Any]
  ins: tuple[int | Lit, ...]
  outs: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Program:
  """The elementwise update of one leaf, independent of its shape.

  Operands are ``("in", k)`` (the leaf's k-th input: param, gradient, then
  its state components), ``("res", k)`` (the k-th scalar residual of the
  group), ``("val", k)`` (an earlier op's output) or ``("lit", value)``.
  """

  ops: tuple[tuple[Any, dict[str, Any], tuple[tuple[str, Any], ...], tuple[int, ...]], ...]
  outs: tuple[tuple[str, Any], ...]


@dataclasses.dataclass(frozen=True)
class Group:
  """Leaves updated together: one program, one buffer per operand."""

  leaves: tuple[int, ...]
  program: Program
  residuals: tuple[int, ...]  # value ids of the scalar residuals


def lit_key(value: Any) -> tuple:
  """A hashable key of a literal: its dtype, shape and bytes."""
  value = np.asarray(value)
  return ("lit", value.dtype.str, value.shape, value.tobytes())


_SHAPE_PARAMS = ("shape", "sharding", "broadcast_dimensions")


def program_signature(program: Program, dtypes: tuple) -> tuple:
  """A hashable key: equal for programs that compute the same thing on these dtypes."""

  def lit(operand: tuple[str, Any]) -> tuple:
    kind, value = operand
    return lit_key(value) if kind == "lit" else operand

  ops = tuple(
    (
      primitive.name,
      repr(sorted((k, v) for k, v in params.items() if k not in _SHAPE_PARAMS)),
      tuple(lit(a) for a in ins),
      outs,
    )
    for primitive, params, ins, outs in program.ops
  )
  return (ops, tuple(lit(a) for a in program.outs), dtypes)


def program_key(group: Group) -> tuple:
  """What a group's leaves compute, comparable across plans (not its residuals)."""
  return program_signature(group.program, ())


def run_program(program: Program, ins: Sequence, residuals: Sequence, shape: tuple) -> list:
  """Evaluates `program` on arrays of `shape` (a block or a flat buffer)."""
  values: dict[int, Any] = {}

  def read(operand: tuple[str, Any]) -> Any:
    kind, value = operand
    if kind == "in":
      return ins[value]
    if kind == "res":
      return residuals[value]
    if kind == "val":
      return values[value]
    return value

  for primitive, params, op_ins, op_outs in program.ops:
    if primitive.name in _COPIES:
      values[op_outs[0]] = read(op_ins[0])
      continue
    if primitive.name == "broadcast_in_dim":
      params = {**params, "shape": shape, "broadcast_dimensions": (), "sharding": None}
    elif "sharding" in params:
      params = {**params, "sharding": None}
    args = [read(operand) for operand in op_ins]
    if primitive.name == "select_n":
      args = _select_operands(args)
    outs = primitive.bind(*varying_alike(args), **params)
    for out_id, out in zip(op_outs, outs if primitive.multiple_results else [outs], strict=True):
      values[out_id] = out
  results = []
  for operand in program.outs:
    value = read(operand)
    results.append(jnp.broadcast_to(value, shape) if jnp.ndim(value) == 0 else value)
  return results


def varying_alike(args: list) -> list:
  """``args``, each cast to vary over every manual mesh axis that one of them varies over.

  Under `jax.shard_map` with ``check_vma`` (JAX's default), a value that differs between the
  shards of a manual axis is typed as varying over it, and a primitive refuses operands
  typed apart (a replicated scalar beside a sharded leaf); `jax.numpy`'s operations cast
  them, but the program binds primitives itself. Elsewhere nothing varies: ``args`` as
  they are.
  """
  varying = [varying_axes(a) for a in args]
  every = frozenset().union(*varying)
  if all(v == every for v in varying):
    return args
  order = jax.sharding.get_abstract_mesh().axis_names
  return [
    a if v == every else jax.lax.pcast(a, tuple(x for x in order if x in every - v), to="varying")
    for a, v in zip(args, varying, strict=True)
  ]


def varying_axes(x: Any) -> frozenset:
  """The manual mesh axes over which ``x`` varies under `jax.shard_map` (with ``check_vma``,
  JAX's default; without it JAX types every value as the same on every device); none for a
  constant, or outside `jax.shard_map`."""
  manual = getattr(jax.typeof(x), "manual_axis_type", None)
  return frozenset() if manual is None else manual.varying


def varying_over(values: Any) -> frozenset:
  """The manual mesh axes over which any array of the tree ``values`` varies
  (`varying_axes`)."""
  return frozenset().union(*(varying_axes(x) for x in jax.tree.leaves(values)))


def _select_operands(args: list) -> list:
  """`select_n`'s operands with scalar cases broadcast to the others' shape.

  A scalar leaf's update traces ``jnp.where`` without a broadcast, so its
  cases are scalars, while the kernel holds the leaf's values as a block.
  """
  shape = next((jnp.shape(a) for a in args if jnp.ndim(a)), None)
  if shape is None:
    return args
  return [args[0], *(jnp.broadcast_to(a, shape) if jnp.ndim(a) == 0 else a for a in args[1:])]


class NotFusible(ValueError):
  """An update that cannot run fused; the message says why (the leaf and the operation)."""


@dataclasses.dataclass(frozen=True)
class FusedPlan:
  """How one update of one tree runs fused (built by `plan_fused_update`)."""

  outside: tuple[Op, ...]  # what runs before the kernels: scalars, reductions
  inputs: tuple[int, ...]  # value ids: params, grads, state leaves, extra args, consts
  consts: tuple[Any, ...]
  global_outs: tuple[int | Lit, ...]  # new global state leaves
  residual_ids: tuple[int, ...]  # every scalar residual used by some group
  slots: tuple[int | None, ...]  # per state leaf: its param-leaf index or None
  components: int | None  # per-param state leaves per param leaf; None: not alike
  groups: tuple[Group, ...]
  paths: tuple[str, ...]
  tx: Any  # the transformation, for the plain path under `jax.vmap`
  kernel: str | None = None  # "pallas", "interpret", or None for the analysis alone
