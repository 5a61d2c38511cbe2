"""The built-in optimizer-state converters and their formulas (registered on import).

Adam family (adam, adamw, nadam, radam), AMSGrad, Adan, Lion, SGD momentum,
RMSProp, optax's factored Adafactor and its momentum, and T5X's legacy
Adafactor;
`t5x_optim._convert.convert` documents what each reads and writes.
"""

from __future__ import annotations

import dataclasses
import itertools
import types
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
from optax._src import transform as _optax_transform

from t5x_optim._convert.registry import (
  MU,
  NU,
  ConversionContext,
  Moments,
  T5XAdafactorParamState,
  by_param,
  has_field,
  is_namedtuple,
  register_state_converter,
  state_field,
)
from t5x_optim._core import state_dict as _state_dict

# RMSProp's state with bias correction: optax exports no name for it. (Building
# one to take its type would run JAX at import, before a multi-process job's
# jax.distributed.initialize.)
RMS_WITH_COUNT = _optax_transform.ScaleByRmsWithCountState

# ------------------------------------------------------------- formulas


def _decay(b: float, count: Any) -> jax.Array:
  """``1 - b^count``: the weight an EMA started at zero has gathered after `count` steps."""
  return 1.0 - jnp.asarray(b, jnp.float32) ** jnp.asarray(count, jnp.float32)


def _corrected(b: float, count: Any) -> Callable[[Any], jax.Array]:
  """Stored EMA -> estimate: divides by ``1 - b^count`` (0 when count is 0)."""
  scale = _decay(b, count)
  return lambda x: jnp.where(scale > 0, x / jnp.where(scale > 0, scale, 1.0), 0.0)


Dims = tuple[tuple[int, ...], tuple[int, ...]]
"""Adafactor's factored dims: (row dims ``d1``, column dims ``d0``)."""


def factorings(
  shape: tuple[int, ...], row_shape: tuple[int, ...], col_shape: tuple[int, ...]
) -> list[Dims]:
  """Every (row dims, column dims) whose Adafactor ``v_row``/``v_col`` have these shapes.

  ``v_row`` is the second moment averaged over the column dims ``d0``,
  ``v_col`` averaged over the row dims ``d1``: one dim each in optax, one or
  more each in T5X's Adafactor under logical factor rules (a
  ``('embed', 'heads', 'kv')`` kernel: rows ``(0,)``, columns ``(1, 2)``).
  Adafactor's own heuristic comes first where it fits (the largest dim is the
  column, the second largest the row), then fewer dims before more. Several
  fit where factored dims have the size of other dims.

  Example:
    >>> factorings((6, 2, 4), (6,), (2, 4))
    [((0,), (1, 2))]
    >>> factorings((8, 3, 3, 4), (8, 3), (3, 3, 4))
    [((0,), (1, 3)), ((0,), (2, 3))]
  """
  order = [int(d) for d in np.argsort(shape, kind="stable")]
  candidates = [((order[-2],), (order[-1],))] if len(shape) > 1 else []
  subsets = [
    dims
    for size in range(1, len(shape))
    for dims in itertools.combinations(range(len(shape)), size)
  ]
  candidates += [(d1, d0) for d1 in subsets for d0 in subsets if not set(d1) & set(d0)]
  found = []
  for d1, d0 in sorted(candidates, key=lambda dims: len(dims[0]) + len(dims[1])):
    fits = tuple(np.delete(shape, d0)) == tuple(row_shape)
    if fits and tuple(np.delete(shape, d1)) == tuple(col_shape) and (d1, d0) not in found:
      found.append((d1, d0))
  return found


def factored_dims(
  shape: tuple[int, ...], row_shape: tuple[int, ...], col_shape: tuple[int, ...]
) -> Dims:
  """The (row dims, column dims) that optax Adafactor's ``v_row``/``v_col`` shapes imply.

  The first of `factorings`: optax factors the two largest dims (the largest
  is the column, the second largest the row), which always fit its own
  shapes.

  Raises:
    ValueError: when no choice of dims gives both shapes.

  Example:
    >>> factored_dims((4, 8), (4,), (8,))
    ((0,), (1,))
    >>> factored_dims((16, 4), (4,), (16,))
    ((1,), (0,))
  """
  found = factorings(shape, row_shape, col_shape)
  if not found:
    raise ValueError(_no_factoring(shape, row_shape, col_shape))
  return found[0]


def _no_factoring(
  shape: tuple[int, ...], row_shape: tuple[int, ...], col_shape: tuple[int, ...]
) -> str:
  return (
    f"v_row {tuple(row_shape)} and v_col {tuple(col_shape)} are not a factoring of a "
    f"param of shape {tuple(shape)}"
  )


T5X_FACTOR_RULES = types.MappingProxyType(
  {
    "vocab": "column",
    "embed": "row",
    "mlp": "column",
    "heads": "column",
    "kv": "column",
    "joined_kv": "column",
    "relpos_buckets": None,
    "layers": "batch",
    "stack": "batch",
    "q_wi_fused": "column",
    "o_wo_fused": "column",
    "multiquery_heads": "column",
    "kv_fused": "column",
    "layer_norm_scale": None,
    "mlp_activations": "column",
  }
)
"""T5X's ``adafactor.standard_logical_factor_rules()``: each logical axis name's part in
the factoring (``'row'``, ``'column'``, ``'batch'``: averaged over neither, or None)."""


def t5x_factored_dims(shape: tuple[int, ...], axes: Any) -> Dims | None:
  """The (row dims, column dims) T5X's legacy Adafactor factors a param over by its axes.

  As T5X's ``Adafactor.set_param_axes`` and ``_parse_rule`` apply
  `T5X_FACTOR_RULES`: the row dims are those of ``'row'`` names, the column
  dims those of ``'column'`` names; a param of rank 2 or less without a
  batch dim is factored by Adafactor's heuristic instead (the larger dim the
  column, the smaller the row).

  Returns:
    The dims, or None where the rules factor no dims of a param of these
    `axes` (no row or no column dim), or `axes` (a name per dim) are not
    all names of the rules.

  Example:
    >>> t5x_factored_dims((768, 12, 12, 64), ("embed", "layers", "heads", "kv"))
    ((0,), (2, 3))
    >>> t5x_factored_dims((2048, 768), ("mlp", "embed"))
    ((1,), (0,))
  """
  names = tuple(axes) if axes is not None else ()
  if len(names) != len(shape) or not all(
    isinstance(name, str) and name in T5X_FACTOR_RULES for name in names
  ):
    return None
  kinds = [T5X_FACTOR_RULES[name] for name in names]
  if len(shape) <= 2 and "batch" not in kinds:
    order = [int(d) for d in np.argsort(shape, kind="stable")]
    return ((order[-2],), (order[-1],)) if len(shape) == 2 else None
  rows = tuple(d for d, kind in enumerate(kinds) if kind == "row")
  cols = tuple(d for d, kind in enumerate(kinds) if kind == "column")
  if not rows or not cols or None in kinds:
    return None
  return rows, cols


def reconstruct_second_moment(v_row: Any, v_col: Any, d1: tuple[int, ...], d0: tuple[int, ...]):
  """Adafactor's full second moment from its factors, as its own update uses it.

  ``v = expand(v_row, d0) * expand(v_col, d1) / mean(v_row over d1)``: the
  update ``g * (v_row / mean(v_row))^-1/2 * v_col^-1/2`` is ``g / sqrt(v)``.

  Example:
    >>> v = reconstruct_second_moment(jnp.array([1.0, 3.0]), jnp.array([2.0, 2.0, 2.0]), (0,), (1,))
    >>> v.tolist()
    [[1.0, 1.0, 1.0], [3.0, 3.0, 3.0]]
  """
  reduced_d1 = tuple(d - len([e for e in d0 if e < d]) for d in d1)
  row_col_mean = jnp.mean(v_row, axis=reduced_d1, keepdims=True)
  return jnp.expand_dims(v_row / row_col_mean, d0) * jnp.expand_dims(v_col, d1)


def factor_second_moment(nu: Any, d1: tuple[int, ...], d0: tuple[int, ...]):
  """``(v_row, v_col)``: a full second moment averaged over the column / row dims.

  The inverse of `reconstruct_second_moment` for a rank-1 ``nu``; for any
  ``nu`` these are the statistics Adafactor accumulates from the same
  squared gradients (its averages are linear).
  """
  return jnp.mean(nu, axis=d0), jnp.mean(nu, axis=d1)


# ----------------------------------------------------- built-in converters


def _read_two_averages(mu: Any, b_mu: float, nu: Any, b_nu: float, count: Any) -> dict[str, Any]:
  """Two EMAs started at zero: mu / (1 - b_mu^t), nu / (1 - b_nu^t)."""
  return {
    MU: jax.tree.map(_corrected(b_mu, count), mu),
    NU: jax.tree.map(_corrected(b_nu, count), nu),
    "count": count,
  }


def _read_adam(state: Any, ctx: ConversionContext) -> dict[str, Any]:
  """mu = mu_stored / (1 - b1^t), nu = nu_stored / (1 - b2^t)."""
  b1, b2 = ctx.hparam("b1", 0.9), ctx.hparam("b2", 0.999)
  return _read_two_averages(state.mu, b1, state.nu, b2, state.count)


def _write_adam(template: Any, moments: Moments, ctx: ConversionContext) -> Any:
  """mu_stored = mu (1 - b1^t), nu_stored = nu (1 - b2^t): Adam's bias correction undoes it.

  Adam divides mu by the square root of nu, so a param's mu is written only
  with its nu: beside a fresh nu, the next update would divide a converted mu
  by one squared gradient's share of nu, up to thousands of times the
  learning rate where that gradient is small (Lion's or SGD's momentum into
  Adam). Such a param starts both moments fresh; the count is the source's
  where some param has a nu, else 0 (a fresh Adam).
  """
  b1, b2 = ctx.hparam("b1", 0.9), ctx.hparam("b2", 0.999)
  count = moments.count(template.mu, template.count, (NU,))
  return template._replace(
    count=count,
    mu=moments.fill(template.mu, MU, lambda v, leaf, p: v * _decay(b1, count), needs=(NU,)),
    nu=moments.fill(template.nu, NU, lambda v, leaf, p: v * _decay(b2, count)),
  )


class AdamaxState(NamedTuple):
  """optax's adamax state as the conversion sees it.

  ``scale_by_adamax`` stores a `optax.ScaleByAdamState` whose ``nu`` is a
  running maximum of ``|g|`` (``max(b2 nu, |g| + eps)``), not Adam's average
  of ``g^2``; `convert_state` finds such states by one update step and
  converts them as this type.
  """

  count: Any
  mu: Any
  nu: Any


def _read_adamax(state: AdamaxState, ctx: ConversionContext) -> dict[str, Any]:
  """mu as Adam's; nu = nu_stored^2 (a maximum of |g| has no bias to correct)."""
  mu = jax.tree.map(_corrected(ctx.hparam("b1", 0.9), state.count), state.mu)
  return {MU: mu, NU: jax.tree.map(jnp.square, state.nu), "count": state.count}


def _write_adamax(template: AdamaxState, moments: Moments, ctx: ConversionContext) -> Any:
  """mu_stored as Adam's; nu_stored = sqrt(nu); mu only with nu (see `_write_adam`).

  The root mean square is below the maximum the state would hold, so the
  first updates are at most about ``mu / sqrt(nu)``, Adam's.
  """
  b1 = ctx.hparam("b1", 0.9)
  count = moments.count(template.mu, template.count, (NU,))
  return template._replace(
    count=count,
    mu=moments.fill(template.mu, MU, lambda v, leaf, p: v * _decay(b1, count), needs=(NU,)),
    nu=moments.fill(template.nu, NU, lambda v, leaf, p: jnp.sqrt(v)),
  )


def _ema_momentum(rate: str, default: float) -> tuple[Callable, Callable]:
  """The reader and writer of a momentum stored as an uncorrected EMA of the gradients.

  Reading: ``mu = mu_stored / (1 - r^t)``; writing: ``mu_stored = mu (1 - r^t)``,
  with ``r`` the hyper-parameter `rate` (default `default`). The other fields
  of the state stay the new optimizer's.
  """

  def read(state: Any, ctx: ConversionContext) -> dict[str, Any]:
    r = ctx.hparam(rate, default)
    return {MU: jax.tree.map(_corrected(r, state.count), state.mu), "count": state.count}

  def write(template: Any, moments: Moments, ctx: ConversionContext) -> Any:
    r = ctx.hparam(rate, default)
    count = moments.count(template.mu, template.count, (MU,))
    mu = moments.fill(template.mu, MU, lambda v, leaf, p: v * _decay(r, count))
    return template._replace(count=count, mu=mu)

  return read, write


# Lion's momentum is an EMA of the gradients with rate b2; Muon's with rate beta
# (only the params Muon runs have a ``mu``: the others are ``MaskedNode`` holes,
# their state is the Adam state beside it).
_read_lion, _write_lion = _ema_momentum("b2", 0.99)
_read_muon, _write_muon = _ema_momentum("beta", 0.95)


def _scaled_trace(ctx: ConversionContext) -> str | None:
  """Why a ``TraceState`` is not a momentum of the gradients, or None when it is one.

  SGD's trace comes first in its chain (clipping or weight decay before it
  keep no state). After a transformation with a state, it sums updates
  already scaled: RMSProp's momentum follows its second moment and learning
  rate, LARS's its trust ratio.
  """
  before = next((s for s in ctx.chain if not isinstance(s, optax.EmptyState)), None)
  if before is None:
    return None
  return f"a momentum of updates scaled by the {type(before).__name__} before it, not of gradients"


def _read_trace(state: Any, ctx: ConversionContext) -> dict[str, Any]:
  """mu = trace (1 - m) / (1 - m^t): the trace is a sum of decayed gradients, not an average.

  ``t`` is the trace's clock (it has no count of its own); at ``t = 0`` it
  holds no gradient and mu is 0. A trace after a stateful transformation in
  its chain (`_scaled_trace`) is not read.
  """
  m = ctx.hparam("momentum", 0.9)  # Read either way: the trace's setting.
  why = _scaled_trace(ctx)
  if why is not None:
    return {"unread": why}
  corrected = _corrected(m, ctx.step)
  return {MU: jax.tree.map(lambda x: corrected(x * (1.0 - m)), state.trace)}


def _write_trace(template: Any, moments: Moments, ctx: ConversionContext) -> Any:
  """trace = mu (1 - m^t) / (1 - m), over the trace's clock ``t``.

  A trace after a stateful transformation in its chain (`_scaled_trace`)
  starts fresh.
  """
  m = ctx.hparam("momentum", 0.9)  # Read either way: the trace's setting.
  why = _scaled_trace(ctx)
  if why is not None:
    return template._replace(trace=moments.keep(template.trace, f"trace ({why})"))
  scale = _decay(m, ctx.step) / (1.0 - m)
  trace = moments.fill(template.trace, MU, lambda v, leaf, p: v * scale, field="trace")
  return template._replace(trace=trace)


def _read_rms(state: Any, ctx: ConversionContext) -> dict[str, Any]:
  """nu = nu_stored / (1 - decay^t): RMSProp's average starts at zero."""
  count = state_field(state, "count", ctx.step)
  read = {NU: jax.tree.map(_corrected(ctx.hparam("decay", 0.9), count), state.nu)}
  return {**read, "count": count} if has_field(state, "count") else read


def _write_rms(template: Any, moments: Moments, ctx: ConversionContext) -> Any:
  """nu_stored = nu (1 - decay^t)."""
  if has_field(template, "count"):
    template = template._replace(count=moments.count(template.nu, template.count, (NU,)))
  scale = _decay(ctx.hparam("decay", 0.9), state_field(template, "count", ctx.step))
  return template._replace(nu=moments.fill(template.nu, NU, lambda v, leaf, p: v * scale))


def _is_factored(v_row: Any) -> bool:
  return jnp.shape(v_row) != (1,)


def _dims(param: str, shape: tuple[int, ...], v_row: Any, v_col: Any) -> Dims | None:
  """optax's `factored_dims` of param `param` (None where `v_row` is a placeholder: not
  factored), named where the factors fit none of its dims."""
  if not _is_factored(v_row):
    return None
  try:
    return factored_dims(shape, jnp.shape(v_row), jnp.shape(v_col))
  except ValueError as e:
    raise ValueError(f"Param '{param}': {e}.") from None


def _t5x_dims(
  ctx: ConversionContext, shape: tuple[int, ...], v_row: Any, v_col: Any
) -> Dims | None:
  """The dims T5X's legacy Adafactor factored `ctx.param` over (None where not factored).

  Those `t5x_factored_dims` gives the param's logical axes (`ctx.axes`) where
  they fit the shapes of `v_row` and `v_col`; else the one factoring those
  shapes fit (of a param of rank 2 or less, Adafactor's heuristic first: T5X
  factors it so).

  Raises:
    ValueError: the shapes fit no factoring, or several and the axes choose
      none, naming the param, the factorings and how to give its axes.
  """
  if not _is_factored(v_row):
    return None
  param, row_shape, col_shape = ctx.param, jnp.shape(v_row), jnp.shape(v_col)
  axes = ctx.axes.get(param)
  ruled = t5x_factored_dims(shape, axes)
  found = factorings(shape, row_shape, col_shape)
  if ruled in found:
    return ruled
  if len(shape) <= 2:
    found = found[:1]
  if not found:
    raise ValueError(f"Param '{param}': {_no_factoring(shape, row_shape, col_shape)}.")
  if len(found) > 1:
    given = (
      "no logical axes were given for it"
      if axes is None
      else f"its logical axes {tuple(axes)} choose none of them under T5X's "
      "standard_logical_factor_rules"
    )
    raise ValueError(
      f"Param '{param}' of shape {tuple(shape)}: T5X Adafactor's v_row {tuple(row_shape)} "
      f"and v_col {tuple(col_shape)} fit {len(found)} factorings (row dims, column dims) "
      f"{', '.join(map(str, found))}, and {given}. Pass param_axes= (the params' logical "
      "axes, names of T5X's standard_logical_factor_rules) to convert_state, or restore "
      "into a TrainState whose params have axes."
    )
  return found[0]


def _second_moment(v_row: Any, v_col: Any, v: Any, dims: Dims | None) -> Any:
  """The full second moment: `v` where not factored (`dims` None), else reconstructed."""
  if dims is None:
    return v
  return reconstruct_second_moment(v_row, v_col, *dims)


def _as_factored(nu: Any, dims: Dims | None) -> Any:
  """`nu` as an Adafactor factored over `dims` stores it back.

  Factored and reconstructed (`factor_second_moment`, then
  `reconstruct_second_moment`); `nu` itself for an unfactored param.
  """
  if dims is None:
    return nu
  return reconstruct_second_moment(*factor_second_moment(nu, *dims), *dims)


def _read_factored(state: optax.FactoredState, ctx: ConversionContext) -> dict[str, Any]:
  """nu = v where unfactored, else `reconstruct_second_moment` of v_row and v_col.

  Adafactor's decay ``1 - (t+1)^-0.8`` is 0 at the first step, so its
  statistics are estimates already: no bias correction.
  """
  cols, full = by_param(state.v_col), by_param(state.v)

  def nu(path: Any, v_row: Any) -> Any:
    param = _state_dict.key_path_str(path)
    dims = _dims(param, jnp.shape(ctx.params[param]), v_row, cols[param])
    return _second_moment(v_row, cols[param], full[param], dims)

  return {NU: jax.tree.map_with_path(nu, state.v_row), "count": state.count}


def _write_factored(template: optax.FactoredState, moments: Moments, ctx: ConversionContext):
  """v = nu where unfactored; else v_row = mean(nu over d0), v_col = mean(nu over d1)."""
  rows, cols = by_param(template.v_row), by_param(template.v_col)

  def factor(which: int) -> Callable[[Any, Any, str], Any]:
    def one(nu: Any, leaf: Any, param: str) -> Any:
      return factor_second_moment(nu, *_dims(param, jnp.shape(nu), rows[param], cols[param]))[which]

    return one

  def factored(param: str) -> bool:
    return _is_factored(rows[param])

  return template._replace(
    count=moments.count(template.v, template.count, (NU,)),
    v_row=moments.fill(template.v_row, NU, factor(0), field="v_row", holds=factored),
    v_col=moments.fill(template.v_col, NU, factor(1), field="v_col", holds=factored),
    v=moments.fill(
      template.v, NU, lambda nu, leaf, p: nu, field="v", holds=lambda p: not factored(p)
    ),
  )


def _update_scale(ctx: ConversionContext, param: str) -> jax.Array:
  """``lr * max(rms(param), epsilon2)``: Adafactor's factor on ``g / sqrt(v)`` before momentum.

  The param-scale factor only with ``multiply_by_parameter_scale`` (default
  True; optax's ``scale_by_param_block_rms`` uses the same 1e-3 floor).
  """
  scale = jnp.asarray(ctx.rate(), jnp.float32)
  if ctx.hparam("multiply_by_parameter_scale", True):
    rms = jnp.sqrt(jnp.mean(jnp.square(ctx.params[param])))
    scale = scale * jnp.maximum(rms, ctx.hparam("epsilon2", 1e-3))
  return scale


def _gradient_average(m: Any, nu: Any, scale: Any, decay: Any, count: Any) -> jax.Array:
  """mu = m sqrt(nu) / scale / (1 - decay^count), from an average ``m`` of Adafactor's updates."""
  return _corrected(decay, count)(m * jnp.sqrt(nu) / scale)


def _update_average(mu: Any, nu: Any, scale: Any, decay: Any, count: Any) -> jax.Array:
  """m = mu scale / sqrt(nu) (1 - decay^count): the inverse of `_gradient_average` (0 where nu is)."""
  safe = jnp.where(nu > 0, nu, 1.0)
  return jnp.where(nu > 0, mu * scale / jnp.sqrt(safe), 0.0) * _decay(decay, count)


def _read_t5x_adafactor(state: T5XAdafactorParamState, ctx: ConversionContext) -> dict[str, Any]:
  """nu as in `_read_factored`; mu = m sqrt(nu) / (lr scale) / (1 - beta1^t).

  T5X's ``m`` averages past *updates* ``lr * scale * g / sqrt(v)``, with
  ``scale = max(rms(param), epsilon2)`` (``multiply_by_parameter_scale``) and
  no bias correction; dividing by the same factors gives back an average of
  gradients, for a slowly changing ``v``. That needs the learning rate the
  run used: ``source_hparams['learning_rate']`` (a schedule is called at the
  step); without it ``m`` is not read.
  """
  param = ctx.params[ctx.param]
  dims = _t5x_dims(ctx, jnp.shape(param), state.v_row, state.v_col)
  nu = _second_moment(state.v_row, state.v_col, state.v, dims)
  read = {NU: nu}
  if _has_momentum(state, param) and ctx.rate() is not None:
    scale = _update_scale(ctx, ctx.param)
    read[MU] = _gradient_average(state.m, nu, scale, ctx.hparam("beta1", 0.9), ctx.step)
  return read


def _has_momentum(state: Any, param: Any) -> bool:
  """Whether a T5X Adafactor param state has ``m`` (beta1 set), not its (1,) placeholder."""
  return state.m is not None and jnp.shape(state.m) == jnp.shape(param)


def _write_t5x_adafactor(template: Any, moments: Moments, ctx: ConversionContext) -> Any:
  """One param's T5X Adafactor state: ``v_row``, ``v_col`` or ``v`` from nu, ``m`` from mu.

  As `_write_factored` for the second moment (the template's shapes say
  which dims T5X factored), and ``m = mu lr scale / sqrt(nu) (1 - beta1^t)``
  with ``nu`` as the factored statistics give it back, the inverse of
  `_read_t5x_adafactor`; ``m`` needs ``learning_rate`` (T5X passes it at
  each step, the state does not hold it). Placeholders stay as they are.
  """
  param = ctx.param

  def dims() -> Dims | None:
    return _t5x_dims(ctx, jnp.shape(ctx.params[param]), template.v_row, template.v_col)

  fields = {}
  if _is_factored(template.v_row):
    for which, name in enumerate(("v_row", "v_col")):
      fields[name] = moments.fill(
        getattr(template, name), NU,
        lambda nu, leaf, p, which=which: factor_second_moment(nu, *dims())[which],
        field=name, param=param,
      )  # fmt: skip
  else:
    fields["v"] = moments.fill(template.v, NU, lambda nu, leaf, p: nu, field="v", param=param)
  if _has_momentum(template, ctx.params[param]):
    if ctx.rate() is None:
      fields["m"] = moments.keep(
        template.m, "m (needs the learning_rate hyper-parameter)", param=param
      )
    else:
      scale, beta1 = _update_scale(ctx, param), ctx.hparam("beta1", 0.9)
      fields["m"] = moments.fill(
        template.m, MU,
        lambda mu, leaf, p: _update_average(
          mu, _as_factored(moments.value(p, NU), dims()), scale, beta1, ctx.step
        ),
        field="m", needs=(NU,), param=param,
      )  # fmt: skip
  if is_namedtuple(template):
    return template._replace(**fields)
  return dataclasses.replace(template, **fields)


def _adafactor_momentum(ctx: ConversionContext) -> tuple[Any, str | None]:
  """The ``FactoredState`` an ``EmaState`` is Adafactor's momentum of, or (None, why not)."""
  factored = next((s for s in reversed(ctx.chain) if isinstance(s, optax.FactoredState)), None)
  if factored is None:
    return None, "an EMA after no FactoredState in its chain: not Adafactor's momentum"
  missing = [name for name in ("learning_rate", "momentum") if ctx.hparam(name, None) is None]
  if missing:
    return None, f"Adafactor's momentum, which needs the hyper-parameters {missing}"
  return factored, None


def _read_adafactor_momentum(state: optax.EmaState, ctx: ConversionContext) -> dict[str, Any]:
  """mu = ema sqrt(nu) / (lr scale) / (1 - momentum^t), nu from the FactoredState before it.

  In ``optax.adafactor(momentum=...)`` the ``EmaState`` (no debiasing)
  averages the updates ``lr * scale * g / sqrt(v)`` (`_update_scale`), as
  T5X's ``m`` does; the block-RMS clipping between them is not undone.
  Reading it needs ``learning_rate`` and ``momentum``; an ``EmaState`` with
  no ``FactoredState`` before it in its chain is not read.
  """
  factored, why = _adafactor_momentum(ctx)
  if factored is None:
    return {"unread": why}
  nu = by_param(_read_factored(factored, ctx)[NU])
  momentum = ctx.hparam("momentum", None)

  def mu(path: Any, ema: Any) -> Any:
    param = _state_dict.key_path_str(path)
    return _gradient_average(ema, nu[param], _update_scale(ctx, param), momentum, state.count)

  return {MU: jax.tree.map_with_path(mu, state.ema), "count": state.count}


def _write_adafactor_momentum(template: optax.EmaState, moments: Moments, ctx: ConversionContext):
  """ema = mu lr scale / sqrt(nu) (1 - momentum^t), with nu as the Adafactor will see it.

  ``nu`` is the source's, factored and reconstructed as the ``FactoredState``
  before it stores it, so the average is of the updates that Adafactor
  would have made.
  """
  factored, why = _adafactor_momentum(ctx)
  if factored is None:
    return template._replace(ema=moments.keep(template.ema, f"ema ({why})"))
  rows, cols = by_param(factored.v_row), by_param(factored.v_col)
  momentum = ctx.hparam("momentum", None)
  count = moments.count(template.ema, template.count, (MU,), needs=(NU,))

  def ema(mu: Any, leaf: Any, param: str) -> Any:
    nu = moments.value(param, NU)
    nu = _as_factored(nu, _dims(param, jnp.shape(nu), rows[param], cols[param]))
    return _update_average(mu, nu, _update_scale(ctx, param), momentum, count)

  return template._replace(
    count=count, ema=moments.fill(template.ema, MU, ema, field="ema", needs=(NU,))
  )


def _read_adan(state: Any, ctx: ConversionContext) -> dict[str, Any]:
  """mu = m / (1 - b1^t), nu = n / (1 - b3^t) (Adan's n averages (g + (1-b2) diff)^2).

  v (gradient differences) and g (the last gradient) are not read.
  """
  b1, b3 = ctx.hparam("b1", 0.98), ctx.hparam("b3", 0.99)
  read = _read_two_averages(state.m, b1, state.n, b3, state.t)
  return {**read, "unread_fields": ("v", "g")}


def _write_adan(template: Any, moments: Moments, ctx: ConversionContext) -> Any:
  """m = mu (1 - b1^t), n = nu (1 - b3^t), g (the previous gradient) = mu.

  v, Adan's average of gradient differences, keeps its initial zero (reported
  as initialised): the expected difference of two gradients from a steady
  distribution. Adan divides by the square root of n, so m and g are written
  only with n (see `_write_adam`).
  """
  b1, b3 = ctx.hparam("b1", 0.98), ctx.hparam("b3", 0.99)
  t = moments.count(template.m, template.t, (NU,))
  return template._replace(
    t=t,
    m=moments.fill(template.m, MU, lambda v, leaf, p: v * _decay(b1, t), field="m", needs=(NU,)),
    n=moments.fill(template.n, NU, lambda v, leaf, p: v * _decay(b3, t), field="n"),
    g=moments.fill(template.g, MU, lambda v, leaf, p: v, field="g", needs=(NU,)),
    v=moments.keep(template.v, "v (gradient differences: their expectation, 0)", by_design=True),
  )


def _read_amsgrad(state: Any, ctx: ConversionContext) -> dict[str, Any]:
  """As Adam (nu_max, a running maximum, is not an estimate and is not read)."""
  return {**_read_adam(state, ctx), "unread_fields": ("nu_max",)}


def _write_amsgrad(template: Any, moments: Moments, ctx: ConversionContext) -> Any:
  """As Adam; nu_max = nu_stored (the maximum so far of the one estimate there is)."""
  written = _write_adam(template, moments, ctx)
  return written._replace(
    nu_max=moments.fill(
      template.nu_max,
      NU,
      lambda v, leaf, p: v * _decay(ctx.hparam("b2", 0.999), written.count),
      field="nu_max",
    )
  )


def _builtin() -> None:
  adam = {"read": _read_adam, "write": _write_adam}
  register_state_converter(optax.ScaleByAdamState, **adam)
  register_state_converter(AdamaxState, read=_read_adamax, write=_write_adamax)
  register_state_converter(optax.ScaleByLionState, read=_read_lion, write=_write_lion)
  register_state_converter(optax.TraceState, read=_read_trace, write=_write_trace)
  register_state_converter(optax.contrib.MuonState, read=_read_muon, write=_write_muon)
  register_state_converter(optax.ScaleByRmsState, read=_read_rms, write=_write_rms)
  register_state_converter(RMS_WITH_COUNT, read=_read_rms, write=_write_rms)
  register_state_converter(optax.ScaleByAmsgradState, read=_read_amsgrad, write=_write_amsgrad)
  register_state_converter(optax.ScaleByAdanState, read=_read_adan, write=_write_adan)
  register_state_converter(optax.FactoredState, read=_read_factored, write=_write_factored)
  register_state_converter(
    optax.EmaState, read=_read_adafactor_momentum, write=_write_adafactor_momentum
  )
  register_state_converter(
    T5XAdafactorParamState, read=_read_t5x_adafactor, write=_write_t5x_adafactor, per_param=True
  )


_builtin()
