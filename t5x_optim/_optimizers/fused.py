"""Fused (multi-tensor) optax updates: many leaves per kernel (issue 15).

`OptaxWrapper(tx, fused=...)` can run an elementwise optax update as one
kernel per group of leaves instead of one (or more) per leaf. How it works:

1. **Which optimizers.** Nothing is listed by name. `plan_fused_update`
   traces ``tx.update`` + ``optax.apply_updates`` on the actual params and
   state to a jaxpr and proves, operation by operation, that every new param
   and every per-param state leaf (a state subtree with the params'
   structure and shapes, such as adam's ``mu``/``nu``) depends elementwise on
   its own leaf only: elementwise primitives over the leaf's param, gradient
   and state, scalars and broadcast scalars. Anything else (a reduction, a
   reshape, two leaves combined, a global state that reads a leaf, extra
   update arguments) makes the report say why, and the plain path runs.
   adam, adamw, lion, sgd with momentum, rmsprop and most of optax's
   elementwise optimizers pass; adafactor, clipping by global norm, muon and
   the line-search optimizers do not.
2. **Scalars outside, elements inside.** The scalar part of the update (step
   counts, bias corrections, schedules) runs once, as ordinary jax code. The
   elementwise part is cut into one small program per leaf; leaves whose
   programs, scalar inputs and dtypes agree form a group.
3. **One kernel per group.** Each group's leaves are flattened and
   concatenated into one buffer per operand (param, gradient, each state
   component), one Pallas kernel runs the program over the buffers, block by
   block, and the results are split back into leaves. On GPUs the kernel is
   a Triton kernel; before it is used, each program's kernel is lowered for
   the GPU (`jax.export` lowers without one), and a program Pallas cannot
   lower takes the plain path.
   The state keeps optax's per-leaf layout, so partition specs, state dicts
   and checkpoints are those of the plain path.
4. **Sharding.** The multi-tensor update is a `custom_partitioning` op: XLA's
   partitioner gives it every leaf's sharding and it runs on each device's
   local shards, so no data moves between devices. Where a leaf's operands
   are sharded differently (ZeRO: state sharded over ``data``, params
   replicated) it updates the most sharded layout and XLA reshards around it,
   as it does for the plain path.

Example:
  >>> import jax.numpy as jnp, optax
  >>> params = {'w': jnp.ones((2, 3)), 'b': jnp.zeros(3)}
  >>> report = fusion_report(optax.adamw(1e-3), params)
  >>> report.fusible, report.groups
  (True, (('b', 'w'),))
  >>> fusion_report(optax.adafactor(1e-3, min_dim_size_to_factor=2), params).fusible
  False
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.custom_batching
import jax.export
import jax.extend.backend
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import pallas as pl
from jax.experimental.custom_partitioning import SdyShardingRule, custom_partitioning
from jax.experimental.pallas import triton as pltriton
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from t5x_optim._optimizers.state_dict import key_path_str

__all__ = [
  "FusedPlan",
  "FusedUpdate",
  "FusionReport",
  "fused_apply",
  "fusion_report",
  "plan_fused_update",
  "program_key",
]


class FusedUpdate(enum.Enum):
  """How `OptaxWrapper` runs an elementwise optax update.

  Attributes:
    OFF: the plain path, ``tx.update`` + ``optax.apply_updates`` per leaf
      (the default).
    AUTO: the Pallas kernel on GPUs; the plain path on other backends (CPU,
      TPU), where no kernel is built.
    PALLAS: the Pallas kernel; raises on a backend other than GPU.
    INTERPRET: the Pallas kernel in Pallas interpret mode, on any backend:
      slow, for tests and debugging.

  `FusedUpdate.of` also takes the values as strings (for gin) and bools
  (``True`` is ``AUTO``).

  >>> FusedUpdate.of("interpret"), FusedUpdate.of(False)
  (<FusedUpdate.INTERPRET: 'interpret'>, <FusedUpdate.OFF: 'off'>)
  """

  OFF = "off"
  AUTO = "auto"
  PALLAS = "pallas"
  INTERPRET = "interpret"

  @classmethod
  def of(cls, value: FusedUpdate | str | bool) -> FusedUpdate:
    """The mode named by `value`: a member, its string value or a bool.

    Raises:
      ValueError: for anything else, listing the accepted values.
    """
    if isinstance(value, bool):
      return cls.AUTO if value else cls.OFF
    try:
      return cls(value)
    except ValueError:
      raise ValueError(
        f"fused= must be a bool or one of {[mode.value for mode in cls]}; got {value!r}."
      ) from None

  def kernel(self, backend: str) -> str | None:
    """The kernel this mode runs on `backend`: "pallas", "interpret" or None.

    Raises:
      ValueError: for ``PALLAS`` on a backend other than GPU.

    >>> FusedUpdate.AUTO.kernel("cpu") is None, FusedUpdate.AUTO.kernel("gpu")
    (True, 'pallas')
    """
    if self is FusedUpdate.OFF:
      return None
    if self is FusedUpdate.AUTO:
      return "pallas" if backend == "gpu" else None
    if self is FusedUpdate.PALLAS and backend != "gpu":
      raise ValueError(
        f"fused='pallas' needs a GPU; the default backend is {backend!r}. Use "
        "fused='auto' to take the plain path there, or 'interpret' to test."
      )
    return self.value


# Primitives whose every output element depends only on the same element of
# each operand (rank-0 operands broadcast). Anything else touching a leaf
# makes the update non-elementwise.
_ELEMENTWISE = frozenset(
  """abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp
  convert_element_type copy copy_p cos cosh digamma div eq erf erf_inv erfc exp
  exp2 expm1 floor ge gt igamma igammac imag integer_pow is_finite le lgamma log
  log1p logistic lt max min mul ne neg nextafter not or pow real reduce_precision
  rem round rsqrt select_n shift_left shift_right_arithmetic
  shift_right_logical sign sin sinh sqrt square sub tan tanh xor""".split()
)
# The custom call a Pallas Triton kernel lowers to.
_TRITON_CALL = "__gpu$xla.gpu.triton"
# Copies are the identity inside the kernel.
_COPIES = frozenset({"copy", "copy_p"})
# Reductions: when one reduces a leaf to a scalar (a norm, an "any NaN"), the
# scalar is computed before the fused kernel, like clipping's global norm.
_REDUCTIONS = frozenset(
  """argmax argmin dot_general reduce_and reduce_max reduce_min reduce_or
  reduce_prod reduce_sum reduce_xor""".split()
)
# Value kinds besides a leaf's index: no leaf data, or scalars reduced from leaves.
_GLOBAL, _REDUCED = -1, -2
# Call-like primitives whose body is inlined into the analysis.
_CALLS = frozenset(
  {
    "jit",
    "pjit",
    "closed_call",
    "core_call",
    "custom_jvp_call",
    "custom_vjp_call",
    "custom_vjp_call_jaxpr",
    "checkpoint",
    "remat",
  }
)
# Most elements per group buffer: bounds the temporary memory of a group.
_GROUP_ELEMENTS = 1 << 24
# Elements per Pallas block (a power of two, as Triton wants).
_BLOCK = 4096


class _Lit(NamedTuple):
  """A literal operand of the traced update."""

  value: Any


@dataclasses.dataclass(frozen=True)
class _Op:
  """One first-order operation of the inlined update: value ids in and out."""

  primitive: Any
  params: dict[str, Any]
  ins: tuple[int | _Lit, ...]
  outs: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class _Program:
  """The elementwise update of one leaf, independent of its shape.

  Operands are ``("in", k)`` (the leaf's k-th input: param, gradient, then
  its state components), ``("res", k)`` (the k-th scalar residual of the
  group), ``("val", k)`` (an earlier op's output) or ``("lit", value)``.
  """

  ops: tuple[tuple[Any, dict[str, Any], tuple[tuple[str, Any], ...], tuple[int, ...]], ...]
  outs: tuple[tuple[str, Any], ...]


@dataclasses.dataclass(frozen=True)
class _Group:
  """Leaves updated together: one program, one buffer per operand."""

  leaves: tuple[int, ...]
  program: _Program
  residuals: tuple[int, ...]  # value ids of the scalar residuals


@dataclasses.dataclass(frozen=True)
class FusedPlan:
  """How one update of one tree runs fused (built by `plan_fused_update`)."""

  outside: tuple[_Op, ...]  # what runs before the kernels: scalars, reductions
  inputs: tuple[int, ...]  # value ids: params, grads, state leaves, extra args, consts
  consts: tuple[Any, ...]
  global_outs: tuple[int | _Lit, ...]  # new global state leaves
  residual_ids: tuple[int, ...]  # every scalar residual used by some group
  slots: tuple[int | None, ...]  # per state leaf: its param-leaf index or None
  components: int  # per-param state leaves per param leaf
  groups: tuple[_Group, ...]
  paths: tuple[str, ...]
  tx: Any  # the transformation, for the plain path under `jax.vmap`


class FusionReport(NamedTuple):
  """Whether an update can run fused, and how.

  Attributes:
    fusible: True when every leaf's update is elementwise.
    reason: why not, naming the leaf and the operation; None when fusible.
    groups: the leaf paths of each group (one kernel each); empty when not
      fusible.
  """

  fusible: bool
  reason: str | None
  groups: tuple[tuple[str, ...], ...]


class _NotFusible(Exception):
  """Raised inside the analysis; its message is the report's reason."""


def _sub_jaxpr(eqn: Any) -> Any:
  """The body of a call-like equation, or None."""
  if eqn.primitive.name not in _CALLS:
    return None
  for name in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
    body = eqn.params.get(name)
    if body is not None and not callable(body):
      return body
  return None


class _Inliner:
  """Flattens a closed jaxpr into `_Op`s over integer value ids."""

  def __init__(self) -> None:
    self.ops: list[_Op] = []
    self.avals: list[Any] = []

  def new(self, aval: Any) -> int:
    self.avals.append(aval)
    return len(self.avals) - 1

  def run(self, jaxpr: Any, consts: Sequence[Any], ins: Sequence[int | _Lit]) -> list:
    env: dict[Any, int | _Lit] = {}
    for var, const in zip(jaxpr.constvars, consts, strict=True):
      env[var] = const if isinstance(const, int | _Lit) else _Lit(const)
    for var, atom in zip(jaxpr.invars, ins, strict=True):
      env[var] = atom

    def read(atom: Any) -> int | _Lit:
      return _Lit(atom.val) if isinstance(atom, jex.Literal) else env[atom]

    for eqn in jaxpr.eqns:
      args = [read(atom) for atom in eqn.invars]
      body = _sub_jaxpr(eqn)
      if body is not None:
        inner, inner_consts = (
          (body.jaxpr, body.consts) if isinstance(body, jex.ClosedJaxpr) else (body, ())
        )
        outs = self.run(inner, inner_consts, args)
      else:
        outs = [self.new(var.aval) for var in eqn.outvars]
        self.ops.append(_Op(eqn.primitive, dict(eqn.params), tuple(args), tuple(outs)))
      for var, out in zip(eqn.outvars, outs, strict=True):
        env[var] = out
    return [read(atom) for atom in jaxpr.outvars]


def _per_param_slots(state: Any, params_def: Any, shapes: Sequence[tuple]) -> list[int | None]:
  """For each state leaf, the index of the param leaf it mirrors, or None.

  A subtree mirrors the params when it has their tree structure and every
  leaf their shape (optax's ``mu``, ``nu``, ``trace``...); other leaves are
  global (step counts, injected hyper-parameters).
  """
  slots: list[int | None] = []

  def walk(node: Any) -> None:
    leaves, treedef = jax.tree.flatten(node)
    if treedef == params_def and [np.shape(leaf) for leaf in leaves] == list(shapes):
      slots.extend(range(len(leaves)))
      return
    children = jax.tree_util.tree_flatten(node, is_leaf=lambda child: child is not node)[0]
    if not children or (len(children) == 1 and children[0] is node):
      slots.extend([None] * len(leaves))
      return
    for child in children:
      walk(child)

  walk(state)
  return slots


def _ndim(atom: int | _Lit, avals: Sequence[Any]) -> int:
  return np.ndim(atom.value) if isinstance(atom, _Lit) else len(avals[atom].shape)


def _classify(ops: Sequence[_Op], avals: Sequence[Any], kind: dict[int, int], paths) -> set[int]:
  """Marks every value with its kind (in `kind`); returns the uniform values.

  A value's kind is the index of the one leaf it is elementwise in,
  `_REDUCED` for scalars reduced from leaves, or `_GLOBAL` (the default) for
  values that read no leaf. A uniform value is an array that is a broadcast
  scalar (or an elementwise function of broadcast scalars), so it has the
  same value in every element and can be rebuilt at any shape.

  Raises:
    _NotFusible: naming the leaf and the operation that is not elementwise.
  """
  uniform: set[int] = set()
  for op in ops:
    name = op.primitive.name
    kinds = [kind.get(a, _GLOBAL) if isinstance(a, int) else _GLOBAL for a in op.ins]
    leaves = {k for k in kinds if k >= 0}
    if not leaves:
      if _REDUCED in kinds:
        kind.update(dict.fromkeys(op.outs, _REDUCED))
      if name == "broadcast_in_dim" and _ndim(op.ins[0], avals) == 0:
        uniform.update(op.outs)
      elif name in _ELEMENTWISE and all(
        _ndim(a, avals) == 0 or (isinstance(a, int) and a in uniform) for a in op.ins
      ):
        uniform.update(out for out in op.outs if avals[out].shape)
      continue
    if len(leaves) > 1:
      names = ", ".join(paths[i] for i in sorted(leaves))
      raise _NotFusible(f"'{name}' combines the leaves {names}")
    (leaf,) = leaves
    if name in _REDUCTIONS and all(not avals[out].shape for out in op.outs):
      kind.update(dict.fromkeys(op.outs, _REDUCED))
      continue
    if name not in _ELEMENTWISE:
      raise _NotFusible(f"'{name}' on leaf {paths[leaf]} is not elementwise")
    for atom, atom_kind in zip(op.ins, kinds, strict=True):
      if atom_kind != leaf and _ndim(atom, avals) and atom not in uniform:
        raise _NotFusible(
          f"'{name}' on leaf {paths[leaf]} reads a non-scalar value that is not the leaf's"
        )
    kind.update(dict.fromkeys(op.outs, leaf))
  return uniform


def _lit_key(value: Any) -> tuple:
  """A hashable key of a literal: its dtype, shape and bytes."""
  value = np.asarray(value)
  return ("lit", value.dtype.str, value.shape, value.tobytes())


def _atom_key(atom: int | _Lit, canon: dict[int, int]) -> tuple:
  if isinstance(atom, _Lit):
    return _lit_key(atom.value)
  return ("val", canon.get(atom, atom))


def _value_numbering(ops: Sequence[_Op], kind: dict[int, int]) -> dict[int, int]:
  """Maps each global value to the first one computed the same way.

  Every leaf's update recomputes its scalars (``jnp.asarray(eps)``, a
  bias correction); numbering them lets leaves share residuals, so they
  group together.
  """
  canon: dict[int, int] = {}
  seen: dict[tuple, tuple[int, ...]] = {}
  for op in ops:
    if kind.get(op.outs[0], _GLOBAL) >= 0 or op.primitive.name not in _ELEMENTWISE | {
      "broadcast_in_dim"
    }:
      continue
    key = (
      op.primitive.name,
      repr(sorted(op.params.items())),
      tuple(_atom_key(a, canon) for a in op.ins),
    )
    if key in seen:
      canon.update(zip(op.outs, seen[key], strict=True))
    else:
      seen[key] = op.outs
  return canon


def _ops_by_leaf(
  ops: Sequence[_Op],
  kind: dict[int, int],
  uniform: set[int],
  n: int,
  outputs: Sequence[Sequence[int | _Lit]],
) -> list[list[_Op]]:
  """Per leaf, the ops its program may contain, in order.

  Those are the leaf's own ops and the ones computing the uniform values it
  reads or returns.
  """
  producer = {out: index for index, op in enumerate(ops) for out in op.outs}
  chosen: list[set[int]] = [set() for _ in range(n)]

  def add_uniform(leaf: int, value: int | _Lit) -> None:
    stack = [value]
    while stack:
      atom = stack.pop()
      if not isinstance(atom, int) or atom not in uniform or producer[atom] in chosen[leaf]:
        continue
      chosen[leaf].add(producer[atom])
      stack.extend(ops[producer[atom]].ins)

  for index, op in enumerate(ops):
    owner = kind.get(op.outs[0], _GLOBAL)
    if owner >= 0:
      chosen[owner].add(index)
      for atom in op.ins:
        add_uniform(owner, atom)
  for leaf, leaf_outputs in enumerate(outputs):
    for atom in leaf_outputs:
      add_uniform(leaf, atom)
  return [[ops[index] for index in sorted(indices)] for indices in chosen]


def _needed(ops: Sequence[_Op], wanted: Sequence[int | _Lit]) -> tuple[_Op, ...]:
  """The ops `wanted` depends on, in order."""
  needed = {a for a in wanted if isinstance(a, int)}
  chosen = []
  for op in reversed(ops):
    if needed.intersection(op.outs):
      chosen.append(op)
      needed.update(a for a in op.ins if isinstance(a, int))
  return tuple(reversed(chosen))


def _slice(
  ops: Sequence[_Op],
  canon: dict[int, int],
  leaf: int,
  inputs: Sequence[int],
  outputs: Sequence[int | _Lit],
  avals: Sequence[Any],
) -> tuple[_Program, tuple[int, ...]]:
  """The program computing `outputs` from `inputs` and scalars, for one leaf.

  Returns the program and the value ids of its scalar residuals, in order.
  """
  chosen = _needed(ops, outputs)
  position = {value: k for k, value in enumerate(inputs)}
  produced: dict[int, int] = {}
  residuals: list[int] = []

  def operand(atom: int | _Lit) -> tuple[str, Any]:
    if isinstance(atom, _Lit):
      return ("lit", atom.value)
    if atom in position:
      return ("in", position[atom])
    if atom in produced:
      return ("val", produced[atom])
    if avals[atom].shape:
      raise _NotFusible(f"an output of leaf {leaf} is a non-scalar value computed from no leaf")
    atom = canon.get(atom, atom)
    if atom not in residuals:
      residuals.append(atom)
    return ("res", residuals.index(atom))

  program_ops = []
  for op in chosen:
    ins = tuple(operand(a) for a in op.ins)
    outs = []
    for out in op.outs:
      produced[out] = len(produced)
      outs.append(produced[out])
    program_ops.append((op.primitive, op.params, ins, tuple(outs)))
  outs = tuple(operand(a) for a in outputs)
  return _Program(tuple(program_ops), outs), tuple(residuals)


_SHAPE_PARAMS = ("shape", "sharding", "broadcast_dimensions")


def _program_key(program: _Program, dtypes: tuple) -> tuple:
  """A hashable key: equal for programs that compute the same thing."""

  def lit(operand: tuple[str, Any]) -> tuple:
    kind, value = operand
    return _lit_key(value) if kind == "lit" else operand

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


def program_key(group: _Group) -> tuple:
  """What a group's leaves compute, comparable across plans (not its residuals)."""
  return _program_key(group.program, ())


def _run_program(program: _Program, ins: Sequence, residuals: Sequence, shape: tuple) -> list:
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
    outs = primitive.bind(*map(read, op_ins), **params)
    for out_id, out in zip(op_outs, outs if primitive.multiple_results else [outs], strict=True):
      values[out_id] = out
  results = []
  for operand in program.outs:
    value = read(operand)
    results.append(jnp.broadcast_to(value, shape) if jnp.ndim(value) == 0 else value)
  return results


def _split_extras(extra_args: dict[str, Any]) -> tuple[list, Callable[[list], dict]]:
  """Splits extra update arguments into array leaves and a rebuilder.

  Arrays and numbers are traced as inputs; other leaves (``value_fn``,
  ``obj_fn``) are passed as they are.
  """
  leaves, treedef = jax.tree.flatten(extra_args)
  is_array = [isinstance(x, jax.Array | np.ndarray | np.generic | int | float) for x in leaves]
  arrays = [x for x, a in zip(leaves, is_array, strict=True) if a]

  def rebuild(traced: list) -> dict[str, Any]:
    it = iter(traced)
    return jax.tree.unflatten(
      treedef, [next(it) if a else x for x, a in zip(leaves, is_array, strict=True)]
    )

  return arrays, rebuild


def _update_fn(tx: optax.GradientTransformation, params_def, state_def, rebuild) -> Callable:
  def update(p_leaves, g_leaves, s_leaves, extra_leaves):
    params = jax.tree.unflatten(params_def, p_leaves)
    grads = jax.tree.unflatten(params_def, g_leaves)
    state = jax.tree.unflatten(state_def, s_leaves)
    updates, new_state = tx.update(grads, state, params, **rebuild(extra_leaves))
    new_params = optax.apply_updates(params, updates)
    new_s_leaves, new_state_def = jax.tree.flatten(new_state)
    if new_state_def != state_def:
      raise _NotFusible("the update changes the state's tree structure")
    return jax.tree.leaves(new_params), new_s_leaves

  return update


def _aval(x: Any) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x))


@dataclasses.dataclass(frozen=True)
class _Traced:
  """The update, inlined into `_Op`s, with the value ids of its inputs and outputs."""

  ops: tuple[_Op, ...]
  avals: list[Any]
  p_ids: list[int]
  g_ids: list[int]
  s_ids: list[int]
  e_ids: list[int]
  const_ids: list[int]
  consts: tuple[Any, ...]
  new_p: list[int | _Lit]
  new_s: list[int | _Lit]


def _trace(tx, params_def, state_def, extra_args, p_avals, s_avals, paths) -> _Traced:
  """Traces ``tx.update`` + ``apply_updates`` and inlines it.

  Raises:
    _NotFusible: when the update changes the state's structure or a leaf's
      shape or dtype.
  """
  extra_leaves, rebuild = _split_extras(extra_args)
  e_avals = [_aval(x) for x in extra_leaves]
  closed = jax.make_jaxpr(_update_fn(tx, params_def, state_def, rebuild))(
    p_avals, p_avals, s_avals, e_avals
  )
  inliner = _Inliner()
  p_ids = [inliner.new(a) for a in p_avals]
  g_ids = [inliner.new(a) for a in p_avals]
  s_ids = [inliner.new(a) for a in s_avals]
  e_ids = [inliner.new(a) for a in e_avals]
  const_ids = [inliner.new(jax.typeof(c)) for c in closed.consts]
  outs = inliner.run(closed.jaxpr, const_ids, [*p_ids, *g_ids, *s_ids, *e_ids])
  n = len(p_avals)
  for k, (out, aval) in enumerate(zip(outs, [*p_avals, *s_avals], strict=True)):
    got = _aval(out.value) if isinstance(out, _Lit) else inliner.avals[out]
    if (tuple(got.shape), got.dtype) != (tuple(aval.shape), aval.dtype):
      where = paths[k] if k < n else f"state leaf {k - n}"
      raise _NotFusible(f"the update changes the shape or dtype of {where}: {aval} -> {got}")
  return _Traced(
    tuple(inliner.ops),
    inliner.avals,
    p_ids,
    g_ids,
    s_ids,
    e_ids,
    const_ids,
    tuple(closed.consts),
    outs[:n],
    outs[n:],
  )


def _groups(
  traced: _Traced,
  per_leaf: list[list[int]],
  paths: tuple[str, ...],
  sizes: list[int],
  max_elements: int | None,
) -> tuple[_Group, ...]:
  """Cuts the update into per-leaf programs and groups the leaves.

  Leaves whose programs, scalar residuals and dtypes agree share a group, of
  at most `max_elements` elements (no limit for None).

  Raises:
    _NotFusible: naming the leaf and the operation that is not elementwise.
  """
  n = len(paths)
  kind = {}
  for i in range(n):
    kind[traced.p_ids[i]] = kind[traced.g_ids[i]] = i
    for k in per_leaf[i]:
      kind[traced.s_ids[k]] = i
  uniform = _classify(traced.ops, traced.avals, kind, paths)
  global_leaves = set(range(len(traced.new_s))).difference(*per_leaf)
  for k in sorted(global_leaves):
    out = traced.new_s[k]
    if isinstance(out, int) and kind.get(out, _GLOBAL) >= 0:
      raise _NotFusible(f"a global state leaf depends on leaf {paths[kind[out]]}")
  canon = _value_numbering(traced.ops, kind)
  outputs = [[traced.new_p[i], *(traced.new_s[k] for k in per_leaf[i])] for i in range(n)]
  own = _ops_by_leaf(traced.ops, kind, uniform, n, outputs)
  by_key: dict[tuple, tuple[_Program, tuple[int, ...], list[int]]] = {}
  for i in range(n):
    inputs = [traced.p_ids[i], traced.g_ids[i], *(traced.s_ids[k] for k in per_leaf[i])]
    program, residuals = _slice(own[i], canon, i, inputs, outputs[i], traced.avals)
    dtypes = tuple(str(traced.avals[v].dtype) for v in inputs)
    by_key.setdefault((_program_key(program, dtypes), residuals), (program, residuals, []))[
      2
    ].append(i)
  built = []
  for program, residuals, leaves in by_key.values():
    chunk, total = [], 0
    for i in leaves:
      if chunk and max_elements is not None and total + sizes[i] > max_elements:
        built.append(_Group(tuple(chunk), program, residuals))
        chunk, total = [], 0
      chunk.append(i)
      total += sizes[i]
    built.append(_Group(tuple(chunk), program, residuals))
  return tuple(built)


def _gpu_platform() -> str:
  """The platform name of the default GPU backend for lowering: "cuda" or "rocm"."""
  version = jax.extend.backend.get_backend().platform_version.lower()
  return "rocm" if "rocm" in version else "cuda"


def _refused_by_gpu(
  groups: Sequence[_Group], traced: _Traced, per_leaf: list[list[int]], platform: str | None
) -> str | None:
  """Lowers each distinct group program's Pallas kernel for the GPU; the first refusal.

  Lowering needs no GPU (`jax.export` lowers for any platform), so the same
  check runs on CPU in the tests.
  """
  platform = platform or _gpu_platform()
  seen = set()
  for group in groups:
    if id(group.program) in seen:
      continue
    seen.add(id(group.program))
    leaf = group.leaves[0]
    ids = [traced.p_ids[leaf], traced.g_ids[leaf], *(traced.s_ids[k] for k in per_leaf[leaf])]
    buffers = [jax.ShapeDtypeStruct((_BLOCK,), traced.avals[i].dtype) for i in ids]
    scalars = [jax.ShapeDtypeStruct((), traced.avals[r].dtype) for r in group.residuals]

    def kernel(buffers, scalars, program=group.program):
      return _pallas_group(program, buffers, scalars, interpret=False)

    try:
      jax.export.export(
        jax.jit(kernel),
        platforms=(platform,),
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(_TRITON_CALL)],
      )(buffers, scalars)
    except NotImplementedError as error:
      return f"its Pallas kernel does not lower for {platform}: {error}"
  return None


def plan_fused_update(
  tx: optax.GradientTransformation,
  params: Any,
  grads: Any,
  state: Any,
  extra_args: dict[str, Any] | None = None,
  *,
  kernel: str | None = None,
  platform: str | None = None,
  bounded_groups: bool = True,
) -> FusedPlan | str:
  """Analyses ``tx.update`` on these trees (arrays or abstract values).

  Args:
    tx: the optax transformation.
    params, grads, state: the trees of one update.
    extra_args: optax's extra update arguments (``value=``...), if any:
      arrays are traced (a scalar ``value`` may feed the update), functions
      passed as they are.
    kernel: the kernel that will run the plan (see `FusedUpdate.kernel`).
      For ``"pallas"`` every group's kernel is lowered for the GPU first, and
      a program the lowering refuses (a primitive Pallas's Triton lowering
      lacks, such as ``erf``) makes the plan a reason instead.
    platform: the GPU platform to lower for, ``"cuda"`` or ``"rocm"``; by
      default the one of the default backend.
    bounded_groups: cut groups at `_GROUP_ELEMENTS` elements, which bounds
      a kernel's temporary buffers; False for grouping without kernels, as
      `stack_params` does.

  Returns:
    A `FusedPlan`, or a string saying why the update is not elementwise.
  """
  path_leaves, params_def = jax.tree_util.tree_flatten_with_path(params)
  if not path_leaves:
    return "the params tree has no leaves"
  if jax.tree.structure(grads) != params_def:
    return "the gradients do not have the params' tree structure"
  paths = tuple(key_path_str(path) or "(root)" for path, _ in path_leaves)
  p_avals = [_aval(x) for _, x in path_leaves]
  for path, aval in zip(paths, p_avals, strict=True):
    if not jnp.issubdtype(aval.dtype, jnp.floating):
      return f"leaf {path} has dtype {aval.dtype}; the kernel updates real floating leaves"
  if [_aval(g) for g in jax.tree.leaves(grads)] != p_avals:
    return "the gradients do not have the params' shapes and dtypes"
  s_leaves, state_def = jax.tree.flatten(state)
  slots = _per_param_slots(state, params_def, [a.shape for a in p_avals])
  per_leaf = [[k for k, slot in enumerate(slots) if slot == i] for i in range(len(paths))]
  if any(len(ks) != len(per_leaf[0]) for ks in per_leaf):
    return "the state's per-param components do not cover every leaf alike"
  try:
    traced = _trace(
      tx,
      params_def,
      state_def,
      dict(extra_args or {}),
      p_avals,
      [_aval(x) for x in s_leaves],
      paths,
    )
    sizes = [math.prod(a.shape) for a in p_avals]
    groups = _groups(traced, per_leaf, paths, sizes, _GROUP_ELEMENTS if bounded_groups else None)
  except _NotFusible as error:
    return str(error)
  if kernel == "pallas" and (refused := _refused_by_gpu(groups, traced, per_leaf, platform)):
    return refused
  residual_ids = tuple(dict.fromkeys(r for group in groups for r in group.residuals))
  global_outs = tuple(traced.new_s[k] for k, slot in enumerate(slots) if slot is None)
  return FusedPlan(
    outside=_needed(traced.ops, [*residual_ids, *global_outs]),
    inputs=(*traced.p_ids, *traced.g_ids, *traced.s_ids, *traced.e_ids, *traced.const_ids),
    consts=traced.consts,
    global_outs=global_outs,
    residual_ids=residual_ids,
    slots=tuple(slots),
    components=len(per_leaf[0]),
    groups=groups,
    paths=paths,
    tx=tx,
  )


def fusion_report(
  tx: optax.GradientTransformation,
  params: Any,
  *,
  grads: Any = None,
  extra_args: dict[str, Any] | None = None,
) -> FusionReport:
  """Whether ``tx``'s update of `params` can run fused, and in which groups.

  Args:
    tx: an optax transformation.
    params: the params (arrays or `jax.ShapeDtypeStruct`s).
    grads: the gradients (or their abstract values); by default like `params`.
    extra_args: the extra update arguments `apply_gradient` will get
      (``value=``, ``value_fn=``...), for transformations that need them.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> report = fusion_report(optax.chain(optax.clip_by_global_norm(1.0),
    ...                                    optax.adam(1e-3)), {'w': jnp.ones(3)})
    >>> report.fusible, report.groups
    (True, (('w',),))
    >>> fusion_report(optax.contrib.muon(1e-3), {'w': jnp.ones((4, 4))}).reason
    "'reshape' on leaf w is not elementwise"
  """
  state = jax.eval_shape(tx.init, params)
  plan = plan_fused_update(tx, params, params if grads is None else grads, state, extra_args)
  if isinstance(plan, str):
    return FusionReport(False, plan, ())
  return FusionReport(
    True, None, tuple(tuple(plan.paths[i] for i in group.leaves) for group in plan.groups)
  )


def _eval_outside(plan: FusedPlan, inputs: Sequence[Any]) -> dict[int, Any]:
  """Runs what the kernels need first (scalars, reductions); values by id."""
  values = dict(zip(plan.inputs, inputs, strict=True))
  for op in plan.outside:
    args = [a.value if isinstance(a, _Lit) else values[a] for a in op.ins]
    outs = op.primitive.bind(*args, **op.params)
    for out_id, out in zip(op.outs, outs if op.primitive.multiple_results else [outs], strict=True):
      values[out_id] = out
  return values


def _pallas_group(
  program: _Program, buffers: Sequence, residuals: Sequence, *, interpret: bool
) -> list:
  """Runs `program` over 1-d `buffers` (a multiple of the block) with Pallas.

  `buffers` are the param, the gradient and the state components; the
  results (the new param and state components) have their dtypes, as
  `plan_fused_update` checked, and overwrite them in place.
  """
  size = buffers[0].shape[0]
  block = min(_BLOCK, size)
  n_in, n_res = len(buffers), len(residuals)
  kept = [0, *range(2, n_in)]  # the buffers the results replace

  # Booleans travel as int32: Triton has no boolean memory.
  is_bool = [r.dtype == jnp.bool_ for r in residuals]

  def kernel(*refs):
    ins = [ref[...] for ref in refs[:n_in]]
    scalars = [
      ref[0] != 0 if boolean else ref[0]
      for ref, boolean in zip(refs[n_in : n_in + n_res], is_bool, strict=True)
    ]
    outs = _run_program(program, ins, scalars, (block,))
    for ref, value in zip(refs[n_in + n_res :], outs, strict=True):
      ref[...] = value

  blocked = pl.BlockSpec((block,), lambda i: (i,))
  scalar = pl.BlockSpec((1,), lambda i: (0,))
  return pl.pallas_call(
    kernel,
    out_shape=[jax.ShapeDtypeStruct((size,), buffers[k].dtype) for k in kept],
    grid=(size // block,),
    in_specs=[blocked] * n_in + [scalar] * n_res,
    out_specs=[blocked] * len(kept),
    input_output_aliases={k: j for j, k in enumerate(kept)},
    interpret=interpret,
    compiler_params=None if interpret else pltriton.CompilerParams(),
  )(
    *buffers,
    *(
      jnp.reshape(r.astype(jnp.int32) if boolean else r, (1,))
      for r, boolean in zip(residuals, is_bool, strict=True)
    ),
  )


def _group_buffers(group: _Group, kernel: str, args: list[list], scalars: list) -> list:
  """One group's update over flat buffers; returns the new flat buffers.

  `args` holds, per leaf of the group, its param, gradient and state
  components. The buffers are padded to a whole number of blocks.
  """
  total = sum(math.prod(leaf[0].shape) for leaf in args)
  if not total:
    return _run_program(group.program, [jnp.zeros((0,), x.dtype) for x in args[0]], scalars, (0,))
  block = min(_BLOCK, 1 << (total - 1).bit_length())
  padded = -(-total // block) * block
  buffers = []
  for k in range(len(args[0])):
    parts = [jnp.ravel(leaf[k]) for leaf in args]
    if padded > total:
      parts.append(jnp.zeros((padded - total,), parts[0].dtype))
    buffers.append(jnp.concatenate(parts) if len(parts) > 1 else parts[0])
  return _pallas_group(group.program, buffers, scalars, interpret=kernel == "interpret")


def _local_update(plan: FusedPlan, kernel: str, leaf_args: Sequence, residuals: Sequence) -> list:
  """The fused update of local (per-device) leaves.

  `leaf_args` holds, per param leaf, its param, gradient and state
  components; returns, per leaf, the new param and state components.
  """
  width = 2 + plan.components
  scalar_of = dict(zip(plan.residual_ids, residuals, strict=True))
  results: list[Any] = [None] * (len(leaf_args) // width * (width - 1))
  for group in plan.groups:
    args = [list(leaf_args[i * width : (i + 1) * width]) for i in group.leaves]
    scalars = [scalar_of[r] for r in group.residuals]
    buffers = _group_buffers(group, kernel, args, scalars)
    offset = 0
    for i, leaf in zip(group.leaves, args, strict=True):
      shape, size = leaf[0].shape, math.prod(leaf[0].shape)
      for k, out in enumerate(buffers):
        piece = jax.lax.slice(out, (offset,), (offset + size,))
        results[i * (width - 1) + k] = piece.reshape(shape)
      offset += size
  return results


def _most_sharded(shardings: Sequence[Any], shape: tuple) -> Any:
  """The sharding with the smallest shard of `shape` (the first on ties)."""
  return min(shardings, key=lambda s: math.prod(s.shard_shape(shape)))


def _explicit_mesh(arrays: Sequence[Any]) -> Any:
  """The mesh of the arrays' sharding types when all its axes are Explicit."""
  for x in arrays:
    mesh = jax.typeof(x).sharding.mesh
    if not mesh.empty and all(t == AxisType.Explicit for t in mesh.axis_types):
      return mesh
  return None


def _shard_mapped(
  plan: FusedPlan, kernel: str, leaf_args: list, residuals: list, mesh: Any
) -> list:
  """`_local_update` under `jax.shard_map`, for arrays with Explicit sharding types.

  Each leaf is updated in the most sharded layout of its operands; every
  result then goes back to the layout of the operand it replaces.
  """
  width = 2 + plan.components
  specs = [jax.typeof(x).sharding.spec for x in leaf_args]
  args, in_specs, out_specs = [], [], []
  for i in range(len(leaf_args) // width):
    own = specs[i * width : (i + 1) * width]
    shape = jnp.shape(leaf_args[i * width])
    chosen = _most_sharded([NamedSharding(mesh, spec) for spec in own], shape).spec
    for x, spec in zip(leaf_args[i * width : (i + 1) * width], own, strict=True):
      args.append(x if spec == chosen else jax.sharding.reshard(x, NamedSharding(mesh, chosen)))
    in_specs.extend([chosen] * width)
    out_specs.extend([chosen] * (width - 1))
  outs = jax.shard_map(
    lambda *a: tuple(_local_update(plan, kernel, a[: len(args)], a[len(args) :])),
    mesh=mesh,
    in_specs=(*in_specs, *(PartitionSpec() for _ in residuals)),
    out_specs=tuple(out_specs),
    check_vma=False,  # the program binds primitives itself, without pvary
  )(*args, *residuals)
  results = []
  for k, out in enumerate(outs):
    i, j = divmod(k, width - 1)
    want = specs[i * width + (0 if j == 0 else j + 1)]
    results.append(
      out if want == out_specs[k] else jax.sharding.reshard(out, NamedSharding(mesh, want))
    )
  return results


def _multi_tensor(plan: FusedPlan, kernel: str, leaf_args: list, residuals: list) -> list:
  """`_local_update` on each device's local shards.

  Under Explicit mesh axes the shardings are in the types and `jax.shard_map`
  runs it; otherwise it is a `custom_partitioning` op, to which XLA's
  partitioner gives the shardings.
  """
  mesh = _explicit_mesh(leaf_args)
  if mesh is not None:
    return _shard_mapped(plan, kernel, leaf_args, residuals, mesh)
  width = 2 + plan.components
  n_leaf_args = len(leaf_args)

  def leaf_shardings(arg_shapes: Sequence[Any], mesh: Any) -> tuple[list, list]:
    arg_sh, out_sh = [], []
    for i in range(n_leaf_args // width):
      shape = arg_shapes[i * width].shape
      chosen = _most_sharded([s.sharding for s in arg_shapes[i * width : (i + 1) * width]], shape)
      arg_sh.extend([chosen] * width)
      out_sh.extend([chosen] * (width - 1))
    arg_sh.extend(NamedSharding(mesh, PartitionSpec()) for _ in residuals)
    return arg_sh, out_sh

  def partition(mesh, arg_shapes, result_shape):
    arg_sh, out_sh = leaf_shardings(arg_shapes, mesh)

    def lower(*args):
      return tuple(_local_update(plan, kernel, args[:n_leaf_args], args[n_leaf_args:]))

    return mesh, lower, tuple(out_sh), tuple(arg_sh)

  def infer(mesh, arg_shapes, result_shape):
    return tuple(leaf_shardings(arg_shapes, mesh)[1])

  operand_maps, result_maps = [], []
  for i in range(n_leaf_args // width):
    factors = tuple(f"l{i}d{d}" for d in range(jnp.ndim(leaf_args[i * width])))
    operand_maps.extend([factors] * width)
    result_maps.extend([factors] * (width - 1))
  operand_maps.extend(() for _ in residuals)

  @custom_partitioning
  def update(*args):
    return tuple(_local_update(plan, kernel, args[:n_leaf_args], args[n_leaf_args:]))

  update.def_partition(
    partition=partition,
    infer_sharding_from_operands=infer,
    sharding_rule=SdyShardingRule(tuple(operand_maps), tuple(result_maps)),
  )
  return list(update(*leaf_args, *residuals))


def _fused_leaves(
  plan: FusedPlan, kernel: str, params: Any, grads: Any, state: Any, extra_leaves: list
) -> tuple[Any, Any]:
  """`fused_apply` with the extra arguments' array leaves given."""
  p_leaves, params_def = jax.tree.flatten(params)
  g_leaves = jax.tree.leaves(grads)
  s_leaves, state_def = jax.tree.flatten(state)
  values = _eval_outside(plan, [*p_leaves, *g_leaves, *s_leaves, *extra_leaves, *plan.consts])
  per_leaf = [[] for _ in p_leaves]
  for leaf, slot in zip(s_leaves, plan.slots, strict=True):
    if slot is not None:
      per_leaf[slot].append(leaf)
  leaf_args = [x for i, p in enumerate(p_leaves) for x in (p, g_leaves[i], *per_leaf[i])]
  residuals = [jnp.asarray(values[r]) for r in plan.residual_ids]
  outs = _multi_tensor(plan, kernel, leaf_args, residuals)
  width = 1 + plan.components
  new_p = [outs[i * width] for i in range(len(p_leaves))]
  taken = [1] * len(p_leaves)
  new_global = iter(a.value if isinstance(a, _Lit) else values[a] for a in plan.global_outs)
  new_s = []
  for slot in plan.slots:
    if slot is None:
      new_s.append(next(new_global))
    else:
      new_s.append(outs[slot * width + taken[slot]])
      taken[slot] += 1
  return jax.tree.unflatten(params_def, new_p), jax.tree.unflatten(state_def, new_s)


def fused_apply(
  plan: FusedPlan,
  kernel: str,
  params: Any,
  grads: Any,
  state: Any,
  extra_args: dict[str, Any] | None = None,
) -> tuple[Any, Any]:
  """One fused update: returns the new params and the new optax state.

  Under `jax.vmap` (an ensemble of optimizers) the global scalars (a step
  count per member) are no longer scalars, so the batched update takes the
  plain path: ``jax.vmap`` of ``tx.update`` + ``optax.apply_updates``.

  Args:
    plan: from `plan_fused_update` for these trees' structure and types.
    kernel: "pallas" or "interpret" (see `FusedUpdate.kernel`).
    params, grads, state, extra_args: those the plan was built for.
  """
  extra_leaves, rebuild = _split_extras(dict(extra_args or {}))
  update = jax.custom_batching.custom_vmap(
    lambda p, g, s, e: _fused_leaves(plan, kernel, p, g, s, e)
  )

  @update.def_vmap
  def _batched(axis_size, in_batched, params, grads, state, extra_leaves):
    def plain(params, grads, state, extra_leaves):
      updates, new_state = plan.tx.update(grads, state, params, **rebuild(extra_leaves))
      return optax.apply_updates(params, updates), new_state

    in_axes = jax.tree.map(lambda batched: 0 if batched else None, tuple(in_batched))
    out = jax.vmap(plain, in_axes=in_axes, axis_size=axis_size)(params, grads, state, extra_leaves)
    return out, jax.tree.map(lambda _: True, out)

  return update(params, grads, state, extra_leaves)
