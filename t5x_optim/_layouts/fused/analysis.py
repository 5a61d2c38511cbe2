"""The proof that an optax update is elementwise, and the plan that runs it fused.

Nothing is listed by name. `plan_fused_update` traces ``tx.update`` +
``optax.apply_updates`` on the actual params and state to a jaxpr and
proves, operation by operation, that every new param and every per-param
state leaf (a state subtree with the params' structure and shapes, such as
adam's ``mu``/``nu``) depends elementwise on its own leaf only: elementwise
primitives over the leaf's param, gradient and state, scalars and broadcast
scalars. Anything else (a reduction, a reshape, two leaves combined, a
global state that reads a leaf, extra update arguments) raises `NotFusible`
saying why. adam, adamw, lion, sgd with momentum, rmsprop and most of
optax's elementwise optimizers pass; adafactor, clipping by the global norm,
muon and the line-search optimizers do not.

The scalar part of the update (step counts, bias corrections, schedules)
stays outside, as ordinary jax code. The elementwise part is cut into one
`Program` per leaf; leaves whose programs, scalar inputs and dtypes agree
form a `Group`. `stack_params` uses the groups without any kernel; the
fused update (`t5x_optim._layouts.fused.kernel` and `.sharding`) runs
one kernel per group.

Example:
  >>> import jax.numpy as jnp, optax
  >>> params = {'w': jnp.ones((2, 3)), 'b': jnp.zeros(3)}
  >>> plan = plan_fused_update(optax.adam(1e-3), params, params, optax.adam(1e-3).init(params))
  >>> [[plan.paths[i] for i in group.leaves] for group in plan.groups]
  [['b', 'w']]
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import optax

from t5x_optim._keypaths import key_path_str
from t5x_optim._layouts.fused.program import (
  FusedPlan,
  Group,
  Lit,
  NotFusible,
  Op,
  Program,
  lit_key,
  program_signature,
)

__all__ = ["FusedPlan", "NotFusible", "eval_outside", "plan_fused_update", "split_extras"]

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
# Most elements per group buffer: bounds the temporary memory of a group.
_GROUP_ELEMENTS = 1 << 24


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
  """Flattens a closed jaxpr into `Op`s over integer value ids."""

  def __init__(self) -> None:
    self.ops: list[Op] = []
    self.avals: list[Any] = []

  def new(self, aval: Any) -> int:
    self.avals.append(aval)
    return len(self.avals) - 1

  def run(self, jaxpr: Any, consts: Sequence[Any], ins: Sequence[int | Lit]) -> list:
    env: dict[Any, int | Lit] = {}
    for var, const in zip(jaxpr.constvars, consts, strict=True):
      env[var] = const if isinstance(const, int | Lit) else Lit(const)
    for var, atom in zip(jaxpr.invars, ins, strict=True):
      env[var] = atom

    def read(atom: Any) -> int | Lit:
      return Lit(atom.val) if isinstance(atom, jex.Literal) else env[atom]

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
        self.ops.append(Op(eqn.primitive, dict(eqn.params), tuple(args), tuple(outs)))
      for var, out in zip(eqn.outvars, outs, strict=True):
        env[var] = out
    return [read(atom) for atom in jaxpr.outvars]


def _per_param_slots(state: Any, params_def: Any, shapes: Sequence[tuple]) -> list[int | None]:
  """For each state leaf, the index of the param leaf it mirrors, or None.

  A subtree mirrors the params when it has their tree structure and every
  leaf their shape (optax's ``mu``, ``nu``, ``trace``...), a param or a
  subtree of them perhaps an ``optax.MaskedNode`` instead (the state of a
  transformation inside ``optax.masked``, or a part of ``optax.partition``,
  whose mask may be a prefix of the params); other leaves are global (step
  counts, injected hyper-parameters).

  Example:
    >>> params = {'b': jnp.ones(3), 'w': {'k': jnp.ones((2, 3)), 'v': jnp.ones(2)}}
    >>> mu = {'b': optax.MaskedNode(), 'w': {'k': jnp.zeros((2, 3)), 'v': jnp.zeros(2)}}
    >>> shapes = [(3,), (2, 3), (2,)]
    >>> _per_param_slots((jnp.int32(0), mu), jax.tree.structure(params), shapes)
    [None, 1, 2]
    >>> prefix = {'b': jnp.zeros(3), 'w': optax.MaskedNode()}
    >>> _per_param_slots(prefix, jax.tree.structure(params), shapes)
    [0]
  """
  slots: list[int | None] = []
  template = params_def.unflatten(range(len(shapes)))
  is_hole = lambda node: isinstance(node, optax.MaskedNode)  # noqa: E731

  def mirrored(node: Any) -> list[int] | None:
    """The param index of each of ``node``'s leaves, where ``node`` mirrors the params."""
    leaves, node_def = jax.tree.flatten(node, is_leaf=is_hole)
    try:
      subs = node_def.flatten_up_to(template)  # the params' subtree at each of its leaves
    except (ValueError, TypeError):  # not a prefix of the params' structure
      return None
    kept = [(leaf, sub) for leaf, sub in zip(leaves, subs, strict=True) if not is_hole(leaf)]
    if not kept or any(
      not isinstance(sub, int) or np.shape(leaf) != shapes[sub] for leaf, sub in kept
    ):
      return None
    return [sub for _, sub in kept]

  def walk(node: Any) -> None:
    indices = mirrored(node)
    if indices is not None:
      slots.extend(indices)
      return
    leaves = jax.tree.leaves(node)
    children = jax.tree.flatten(node, is_leaf=lambda child: child is not node)[0]
    if not children or (len(children) == 1 and children[0] is node):
      slots.extend([None] * len(leaves))
      return
    for child in children:
      walk(child)

  walk(state)
  return slots


def _ndim(atom: int | Lit, avals: Sequence[Any]) -> int:
  return np.ndim(atom.value) if isinstance(atom, Lit) else len(avals[atom].shape)


def _classify(ops: Sequence[Op], avals: Sequence[Any], kind: dict[int, int], paths) -> set[int]:
  """Marks every value with its kind (in `kind`); returns the uniform values.

  A value's kind is the index of the one leaf it is elementwise in,
  `_REDUCED` for scalars reduced from leaves, or `_GLOBAL` (the default) for
  values that read no leaf. A uniform value is an array that is a broadcast
  scalar (or an elementwise function of broadcast scalars), so it has the
  same value in every element and can be rebuilt at any shape.

  Raises:
    NotFusible: naming the leaf and the operation that is not elementwise.
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
      raise NotFusible(f"'{name}' combines the leaves {names}")
    (leaf,) = leaves
    if name in _REDUCTIONS and all(not avals[out].shape for out in op.outs):
      kind.update(dict.fromkeys(op.outs, _REDUCED))
      continue
    if name not in _ELEMENTWISE:
      raise NotFusible(f"'{name}' on leaf {paths[leaf]} is not elementwise")
    for atom, atom_kind in zip(op.ins, kinds, strict=True):
      if atom_kind != leaf and _ndim(atom, avals) and atom not in uniform:
        raise NotFusible(
          f"'{name}' on leaf {paths[leaf]} reads a non-scalar value that is not the leaf's"
        )
    kind.update(dict.fromkeys(op.outs, leaf))
  return uniform


def _atom_key(atom: int | Lit, canon: dict[int, int]) -> tuple:
  if isinstance(atom, Lit):
    return lit_key(atom.value)
  return ("val", canon.get(atom, atom))


def _value_numbering(ops: Sequence[Op], kind: dict[int, int]) -> dict[int, int]:
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
  ops: Sequence[Op],
  kind: dict[int, int],
  uniform: set[int],
  n: int,
  outputs: Sequence[Sequence[int | Lit]],
) -> list[list[Op]]:
  """Per leaf, the ops its program may contain, in order.

  Those are the leaf's own ops and the ones computing the uniform values it
  reads or returns.
  """
  producer = {out: index for index, op in enumerate(ops) for out in op.outs}
  chosen: list[set[int]] = [set() for _ in range(n)]

  def add_uniform(leaf: int, value: int | Lit) -> None:
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


def _needed(ops: Sequence[Op], wanted: Sequence[int | Lit]) -> tuple[Op, ...]:
  """The ops `wanted` depends on, in order."""
  needed = {a for a in wanted if isinstance(a, int)}
  chosen = []
  for op in reversed(ops):
    if needed.intersection(op.outs):
      chosen.append(op)
      needed.update(a for a in op.ins if isinstance(a, int))
  return tuple(reversed(chosen))


def _slice(
  ops: Sequence[Op],
  canon: dict[int, int],
  leaf: int,
  inputs: Sequence[int],
  outputs: Sequence[int | Lit],
  avals: Sequence[Any],
) -> tuple[Program, tuple[int, ...]]:
  """The program computing `outputs` from `inputs` and scalars, for one leaf.

  Returns the program and the value ids of its scalar residuals, in order.
  """
  chosen = _needed(ops, outputs)
  position = {value: k for k, value in enumerate(inputs)}
  produced: dict[int, int] = {}
  residuals: list[int] = []

  def operand(atom: int | Lit) -> tuple[str, Any]:
    if isinstance(atom, Lit):
      return ("lit", atom.value)
    if atom in position:
      return ("in", position[atom])
    if atom in produced:
      return ("val", produced[atom])
    if avals[atom].shape:
      raise NotFusible(f"an output of leaf {leaf} is a non-scalar value computed from no leaf")
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
  return Program(tuple(program_ops), outs), tuple(residuals)


def split_extras(extra_args: dict[str, Any]) -> tuple[list, Callable[[list], dict]]:
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


def eval_outside(plan: FusedPlan, inputs: Sequence[Any]) -> dict[int, Any]:
  """Runs what the per-leaf programs need first (scalars, reductions); values by id.

  Args:
    plan: the plan.
    inputs: the values of ``plan.inputs``, in order; a value no outside
      operation reads may be None.
  """
  values = dict(zip(plan.inputs, inputs, strict=True))
  for op in plan.outside:
    args = [a.value if isinstance(a, Lit) else values[a] for a in op.ins]
    outs = op.primitive.bind(*args, **op.params)
    for out_id, out in zip(op.outs, outs if op.primitive.multiple_results else [outs], strict=True):
      values[out_id] = out
  return values


def _update_fn(
  tx: optax.GradientTransformation, params_def, state_def, rebuild, apply_updates: bool
) -> Callable:
  def update(p_leaves, g_leaves, s_leaves, extra_leaves):
    params = jax.tree.unflatten(params_def, p_leaves)
    grads = jax.tree.unflatten(params_def, g_leaves)
    state = jax.tree.unflatten(state_def, s_leaves)
    updates, new_state = tx.update(grads, state, params, **rebuild(extra_leaves))
    if apply_updates:
      updates = optax.apply_updates(params, updates)
    new_s_leaves, new_state_def = jax.tree.flatten(new_state)
    if new_state_def != state_def:
      raise NotFusible("the update changes the state's tree structure")
    return jax.tree.leaves(updates), new_s_leaves

  return update


def _aval(x: Any) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x))


@dataclasses.dataclass(frozen=True)
class _Traced:
  """The update, inlined into `Op`s, with the value ids of its inputs and outputs."""

  ops: tuple[Op, ...]
  avals: list[Any]
  p_ids: list[int]
  g_ids: list[int]
  s_ids: list[int]
  e_ids: list[int]
  const_ids: list[int]
  consts: tuple[Any, ...]
  new_p: list[int | Lit]
  new_s: list[int | Lit]


def _trace(
  tx, params_def, state_def, extra_args, p_avals, s_avals, paths, apply_updates
) -> _Traced:
  """Traces ``tx.update`` (+ ``apply_updates`` when asked) and inlines it.

  Raises:
    NotFusible: when the update changes the state's structure or a leaf's
      shape or dtype.
  """
  extra_leaves, rebuild = split_extras(extra_args)
  e_avals = [_aval(x) for x in extra_leaves]
  closed = jax.make_jaxpr(_update_fn(tx, params_def, state_def, rebuild, apply_updates))(
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
    got = _aval(out.value) if isinstance(out, Lit) else inliner.avals[out]
    if (tuple(got.shape), got.dtype) != (tuple(aval.shape), aval.dtype):
      where = paths[k] if k < n else f"state leaf {k - n}"
      raise NotFusible(f"the update changes the shape or dtype of {where}: {aval} -> {got}")
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
) -> tuple[Group, ...]:
  """Cuts the update into per-leaf programs and groups the leaves.

  Leaves whose programs, scalar residuals and dtypes agree share a group, of
  at most `max_elements` elements (no limit for None).

  Raises:
    NotFusible: naming the leaf and the operation that is not elementwise.
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
      raise NotFusible(f"a global state leaf depends on leaf {paths[kind[out]]}")
  canon = _value_numbering(traced.ops, kind)
  outputs = [[traced.new_p[i], *(traced.new_s[k] for k in per_leaf[i])] for i in range(n)]
  own = _ops_by_leaf(traced.ops, kind, uniform, n, outputs)
  by_key: dict[tuple, tuple[Program, tuple[int, ...], list[int]]] = {}
  for i in range(n):
    inputs = [traced.p_ids[i], traced.g_ids[i], *(traced.s_ids[k] for k in per_leaf[i])]
    program, residuals = _slice(own[i], canon, i, inputs, outputs[i], traced.avals)
    dtypes = tuple(str(traced.avals[v].dtype) for v in inputs)
    by_key.setdefault((program_signature(program, dtypes), residuals), (program, residuals, []))[
      2
    ].append(i)
  built = []
  for program, residuals, leaves in by_key.values():
    chunk, total = [], 0
    for i in leaves:
      if chunk and max_elements is not None and total + sizes[i] > max_elements:
        built.append(Group(tuple(chunk), program, residuals))
        chunk, total = [], 0
      chunk.append(i)
      total += sizes[i]
    built.append(Group(tuple(chunk), program, residuals))
  return tuple(built)


def _kernel_inputs(
  groups: Sequence[Group], traced: _Traced, per_leaf: list[list[int]]
) -> list[tuple[Program, tuple, tuple]]:
  """Per distinct group program: the program, its buffers' dtypes and its scalars' dtypes."""
  found: dict[int, tuple[Program, tuple, tuple]] = {}
  for group in groups:
    leaf = group.leaves[0]
    ids = [traced.p_ids[leaf], traced.g_ids[leaf], *(traced.s_ids[k] for k in per_leaf[leaf])]
    found.setdefault(
      id(group.program),
      (
        group.program,
        tuple(traced.avals[i].dtype for i in ids),
        tuple(traced.avals[r].dtype for r in group.residuals),
      ),
    )
  return list(found.values())


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
  apply_updates: bool = True,
  uniform: bool = True,
) -> FusedPlan:
  """Analyses ``tx.update`` on these trees (arrays or abstract values).

  Args:
    tx: the optax transformation.
    params, grads, state: the trees of one update.
    extra_args: optax's extra update arguments (``value=``...), if any:
      arrays are traced (a scalar ``value`` may feed the update), functions
      passed as they are.
    kernel: the kernel that will run the plan (see `FusedUpdate.kernel`),
      carried by the plan; None for the analysis alone. For ``"pallas"``
      every group's kernel is lowered for the GPU first (Pallas is imported
      then, not before).
    platform: the GPU platform to lower for, ``"cuda"`` or ``"rocm"``; by
      default the one of the default backend.
    bounded_groups: cut groups at `_GROUP_ELEMENTS` elements, which bounds
      a kernel's temporary buffers; False for grouping without kernels, as
      `stack_params` does.
    apply_updates: each leaf's program returns its new param
      (``optax.apply_updates``); False: its update, as ``tx.update`` does
      (what a transformation that wraps ``tx`` streams, `low_precision`).
    uniform: every param leaf has as many state components as the others, as a
      fused kernel needs; False: each its own (a param ``optax.masked`` leaves
      out has none), for leaf-by-leaf programs alone (`low_precision`).

  Returns:
    The `FusedPlan`.

  Raises:
    NotFusible: saying why, when the update is not elementwise, or a
      program does not lower for the GPU (a primitive Pallas's Triton
      lowering lacks, such as ``erf``).
  """
  path_leaves, params_def = jax.tree.flatten_with_path(params)
  if not path_leaves:
    raise NotFusible("the params tree has no leaves")
  if jax.tree.structure(grads) != params_def:
    raise NotFusible("the gradients do not have the params' tree structure")
  paths = tuple(key_path_str(path) for path, _ in path_leaves)
  p_avals = [_aval(x) for _, x in path_leaves]
  for path, aval in zip(paths, p_avals, strict=True):
    if not jnp.issubdtype(aval.dtype, jnp.floating):
      raise NotFusible(
        f"leaf {path} has dtype {aval.dtype}; the kernel updates real floating leaves"
      )
  if [_aval(g) for g in jax.tree.leaves(grads)] != p_avals:
    raise NotFusible("the gradients do not have the params' shapes and dtypes")
  s_leaves, state_def = jax.tree.flatten(state)
  slots = _per_param_slots(state, params_def, [a.shape for a in p_avals])
  per_leaf = [[k for k, slot in enumerate(slots) if slot == i] for i in range(len(paths))]
  traced = _trace(
    tx,
    params_def,
    state_def,
    dict(extra_args or {}),
    p_avals,
    [_aval(x) for x in s_leaves],
    paths,
    apply_updates,
  )
  sizes = [math.prod(a.shape) for a in p_avals]
  groups = _groups(traced, per_leaf, paths, sizes, _GROUP_ELEMENTS if bounded_groups else None)
  if uniform and any(len(ks) != len(per_leaf[0]) for ks in per_leaf):
    # After the analysis, whose reasons (an update that is not elementwise) say more.
    raise NotFusible("the state's per-param components do not cover every leaf alike")
  if kernel == "pallas":
    # Pallas loads here, with the first plan for its GPU kernel.
    from t5x_optim._layouts.fused.kernel import check_lowering

    check_lowering(_kernel_inputs(groups, traced, per_leaf), platform)
  residual_ids = tuple(dict.fromkeys(r for group in groups for r in group.residuals))
  global_outs = tuple(traced.new_s[k] for k, slot in enumerate(slots) if slot is None)
  return FusedPlan(
    outside=_needed(traced.ops, [*residual_ids, *global_outs]),
    inputs=(*traced.p_ids, *traced.g_ids, *traced.s_ids, *traced.e_ids, *traced.const_ids),
    consts=traced.consts,
    global_outs=global_outs,
    residual_ids=residual_ids,
    slots=tuple(slots),
    components=len(per_leaf[0]) if uniform else None,
    groups=groups,
    paths=paths,
    tx=tx,
    kernel=kernel,
  )
