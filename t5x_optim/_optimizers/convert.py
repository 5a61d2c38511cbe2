"""Optimizer-state conversion: carry one optimizer's statistics into another's state.

Every converter reads a state node into per-param *moments* and writes moments
into a node of its type:

- ``mu``: the estimate of the gradient's mean, E[g] (a bias-corrected average);
- ``nu``: the estimate of the gradient's second moment, E[g^2];
- ``count``: how many gradients the estimates have seen.

Converting A to B reads every node of A's state that has a converter, then
writes every node of B's template state from the moments of its params, so any
pair of registered states converts (N converters, not N^2 conversions).

Step-count rule: a converted node's count is the source's count for its params
(the count of the source node that held them, or the source optimizer's step
when that node has none), and each state stores its moments scaled as its own
update expects after that many steps. Adam's bias correction at the next step
divides by ``1 - b^(count+1)``, close to ``1 - b^count``, so it sees the
source's estimates and does not re-amplify a converted ``nu``. Every other
``count`` field of the new state (learning-rate schedules, injected
hyper-parameters) is set to the source optimizer's step, so schedules go on
where the old run was instead of warming up again; a node that gets none of its
moments starts fresh with count 0.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import serialization, traverse_util
from optax._src import transform as _optax_transform

from t5x_optim._optimizers import state_dict as _state_dict
from t5x_optim._optimizers.interface import Optimizer, OptimizerDef, OptimizerState

__all__ = [
  "ConversionContext",
  "ConversionReport",
  "Moments",
  "StateConverter",
  "T5XAdafactorParamState",
  "convert_state",
  "register_state_converter",
  "registered_converters",
]

MU, NU = "mu", "nu"
# RMSProp's state with bias correction: optax exports no name for it. (Building
# one to take its type would run JAX at import, before a multi-process job's
# jax.distributed.initialize.)
_RMS_WITH_COUNT = _optax_transform.ScaleByRmsWithCountState
_MISSING_POLICIES = ("raise", "init")


class T5XAdafactorParamState(NamedTuple):
  """One param's state of T5X's legacy `adafactor.Adafactor` (read from its state dict).

  Attributes:
    v_row: the factored second moment's row statistics (the param's shape
      without its column dims), or a (1,) placeholder when not factored.
    v_col: the column statistics (the shape without the row dims), or (1,).
    v: the full second moment when not factored, else a (1,) placeholder.
    m: the momentum (an average of past updates, learning rate included) when
      Adafactor ran with ``beta1``, else None.
  """

  v_row: Any
  v_col: Any
  v: Any
  m: Any = None


@dataclasses.dataclass(frozen=True)
class ConversionContext:
  """What a converter may know besides its node.

  Attributes:
    path: the node's path in the optimizer state ('/'-joined).
    step: the source optimizer's step (an int32 scalar).
    params: the params, flat: '/'-joined param path to array.
    hparams: hyper-parameters of the side being read (``source_hparams``) or
      written (``target_hparams``), for converters whose state does not hold
      them (Adam's ``b1`` and ``b2``, SGD's ``momentum``, ...).
    param: the param path of a ``per_param`` node, else None.
  """

  path: str
  step: Any
  params: Mapping[str, Any]
  hparams: Mapping[str, Any]
  param: str | None = None

  def hparam(self, name: str, default: Any) -> Any:
    """``hparams[name]``, or `default` (optax's default for the state's factory)."""
    return self.hparams.get(name, default)


class Moments:
  """The moments available to a writer, looked up by param path.

  `fill` maps a tree of the template node (its ``mu``, say) to the converted
  values, keeping the template's leaf (the fresh initial value) where the
  source has nothing, and records which.
  """

  def __init__(self, stats: Mapping[str, dict[str, Any]], record: Callable[[str, str, bool], None]):
    self._stats, self._record = stats, record

  def fill(
    self,
    tree: Any,
    quantity: str,
    fn: Callable[[Any, Any, str], Any],
    *,
    field: str | None = None,
  ) -> Any:
    """`tree` with each leaf replaced by ``fn(value, leaf, param_path)``.

    Args:
      tree: the template's tree over the params (MaskedNode holes allowed).
      quantity: ``"mu"`` or ``"nu"``: the moment the leaves are made from.
      fn: the formula; ``value`` is the param's moment, ``leaf`` the
        template's leaf. The result is cast to the leaf's dtype.
      field: the node's field name, for the report (defaults to `quantity`).
    """

    def one(path: Any, leaf: Any) -> Any:
      param = _state_dict.key_path_str(path)
      value = self._stats.get(param, {}).get(quantity)
      self._record(field or quantity, param, value is not None)
      if value is None:
        return leaf
      return jnp.asarray(fn(value, leaf, param), dtype=leaf.dtype)

    return jax.tree_util.tree_map_with_path(one, tree)

  def count(self, tree: Any, template_count: Any, quantities: tuple[str, ...] = (MU, NU)) -> Any:
    """The source's count for the params of `tree`, or `template_count`.

    The template's count (a fresh start) stays when no param of `tree` has
    any of the `quantities` the node is written from.
    """
    for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
      stats = self._stats.get(_state_dict.key_path_str(path), {})
      if any(q in stats for q in quantities):
        return jnp.asarray(stats["count"], jnp.result_type(template_count))
    return template_count


Reader = Callable[[Any, ConversionContext], Mapping[str, Any]]
"""``read(node, context) -> {'mu': tree, 'nu': tree, 'count': scalar}`` (any subset).

Trees mirror the params below the node (param paths relative to the node's
param tree, as optax states hold them); for a ``per_param`` converter they are
single arrays of the node's own param.
"""

Writer = Callable[[Any, Moments, ConversionContext], Any]
"""``write(template, moments, context) -> node``: the template node, converted."""


@dataclasses.dataclass(frozen=True)
class StateConverter:
  """A registered converter of one state type.

  Attributes:
    read: see `Reader`; None if states of the type cannot be read.
    write: see `Writer`; None if states of the type cannot be written.
    per_param: the node holds one param's state (T5X's legacy Adafactor);
      its param path (`ConversionContext.param`) is the longest suffix of the
      node's path that names a param, and `read` returns single arrays.
      Only read: the written states are optax's, whose trees span params.
  """

  read: Reader | None
  write: Writer | None
  per_param: bool = False


_LOCK = threading.Lock()
_CONVERTERS: dict[type, StateConverter] = {}


def register_state_converter(
  state_type: type,
  *,
  read: Reader | None = None,
  write: Writer | None = None,
  per_param: bool = False,
  replace: bool = False,
) -> None:
  """Registers how states of `state_type` are read into moments and written from them.

  Args:
    state_type: the exact type of the state node (e.g. a NamedTuple class).
    read: ``read(node, context) -> {'mu': ..., 'nu': ..., 'count': ...}``.
    write: ``write(template, moments, context) -> node``.
    per_param: the node is one param's state, see `StateConverter`.
    replace: allow replacing a converter already registered for the type.

  Raises:
    TypeError: `state_type` is not a type, or `read`/`write` not callable.
    ValueError: neither `read` nor `write` is given, or a converter for
      `state_type` exists and `replace` is False.

  Example:
    >>> class MyState(NamedTuple):
    ...   avg: Any
    >>> register_state_converter(
    ...   MyState,
    ...   read=lambda s, ctx: {"mu": s.avg},
    ...   write=lambda t, m, ctx: MyState(avg=m.fill(t.avg, "mu", lambda v, leaf, p: v)),
    ... )
    >>> MyState in registered_converters()
    True
  """
  if not isinstance(state_type, type):
    raise TypeError(f"state_type must be a type, got {state_type!r}")
  for name, fn in (("read", read), ("write", write)):
    if fn is not None and not callable(fn):
      raise TypeError(f"{name} must be callable, got {fn!r}")
  if read is None and write is None:
    raise ValueError(f"a converter for {_type_name(state_type)} needs read, write or both")
  with _LOCK:
    if state_type in _CONVERTERS and not replace:
      raise ValueError(
        f"a state converter for {_type_name(state_type)} is already registered; "
        "pass replace=True to replace it"
      )
    _CONVERTERS[state_type] = StateConverter(read, write, per_param)


def registered_converters() -> Mapping[type, StateConverter]:
  """A snapshot of the registered converters, keyed by state type."""
  with _LOCK:
    return dict(_CONVERTERS)


@dataclasses.dataclass(frozen=True)
class ConversionReport:
  """What `convert_state` carried over and what started fresh.

  Attributes:
    converted: one line per written state field: its path, type and field,
      how many params got a converted value, and from which source nodes.
    initialised: one line per field (or state without a converter) that
      kept its fresh initial value for some params, with an example param.
    dropped: the source's states that no converter reads (their content is
      not carried).
  """

  converted: tuple[str, ...]
  initialised: tuple[str, ...]
  dropped: tuple[str, ...]

  def __str__(self) -> str:
    sections = [("converted", self.converted), ("initialised", self.initialised)]
    sections.append(("dropped", self.dropped))
    return "\n".join(
      f"{name} ({len(lines)}):" + "".join(f"\n  {line}" for line in lines)
      for name, lines in sections
    )


# ------------------------------------------------------------- formulas


def _decay(b: float, count: Any) -> jax.Array:
  """``1 - b^count``: the weight an EMA started at zero has gathered after `count` steps."""
  return 1.0 - jnp.asarray(b, jnp.float32) ** jnp.asarray(count, jnp.float32)


def _corrected(b: float, count: Any) -> Callable[[Any], jax.Array]:
  """Stored EMA -> estimate: divides by ``1 - b^count`` (0 when count is 0)."""
  scale = _decay(b, count)
  return lambda x: jnp.where(scale > 0, x / jnp.where(scale > 0, scale, 1.0), 0.0)


def factored_dims(shape: tuple[int, ...], row_shape: tuple[int, ...], col_shape: tuple[int, ...]):
  """The (row dims, column dims) that Adafactor's ``v_row``/``v_col`` shapes imply.

  ``v_row`` is the second moment averaged over the column dims ``d0``,
  ``v_col`` averaged over the row dims ``d1``. Where the shapes allow several
  choices (two factored dims of equal size), Adafactor's own heuristic wins:
  the largest dim is the column, the second largest the row.

  Raises:
    ValueError: when no choice of dims gives both shapes.

  Example:
    >>> factored_dims((4, 8), (4,), (8,))
    ((0,), (1,))
    >>> factored_dims((16, 4), (4,), (16,))
    ((1,), (0,))
  """
  order = [int(d) for d in np.argsort(shape, kind="stable")]
  heuristic = ((order[-2],), (order[-1],))
  candidates = [heuristic] + [
    ((d1,), (d0,)) for d1 in range(len(shape)) for d0 in range(len(shape)) if d1 != d0
  ]
  for d1, d0 in candidates:
    if tuple(np.delete(shape, d0)) == tuple(row_shape) and tuple(np.delete(shape, d1)) == tuple(
      col_shape
    ):
      return d1, d0
  raise ValueError(
    f"v_row {tuple(row_shape)} and v_col {tuple(col_shape)} are not a factoring of a "
    f"param of shape {tuple(shape)}"
  )


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
  """mu_stored = mu (1 - b1^t), nu_stored = nu (1 - b2^t): Adam's bias correction undoes it."""
  b1, b2 = ctx.hparam("b1", 0.9), ctx.hparam("b2", 0.999)
  count = moments.count(template.mu, template.count)
  return template._replace(
    count=count,
    mu=moments.fill(template.mu, MU, lambda v, leaf, p: v * _decay(b1, count)),
    nu=moments.fill(template.nu, NU, lambda v, leaf, p: v * _decay(b2, count)),
  )


def _read_lion(state: Any, ctx: ConversionContext) -> dict[str, Any]:
  """mu = mu_stored / (1 - b2^t): Lion's momentum is an EMA of the gradients with rate b2."""
  b2 = ctx.hparam("b2", 0.99)
  return {MU: jax.tree.map(_corrected(b2, state.count), state.mu), "count": state.count}


def _write_lion(template: Any, moments: Moments, ctx: ConversionContext) -> Any:
  """mu_stored = mu (1 - b2^t)."""
  b2 = ctx.hparam("b2", 0.99)
  count = moments.count(template.mu, template.count, (MU,))
  mu = moments.fill(template.mu, MU, lambda v, leaf, p: v * _decay(b2, count))
  return template._replace(count=count, mu=mu)


def _read_trace(state: Any, ctx: ConversionContext) -> dict[str, Any]:
  """mu = trace (1 - m) / (1 - m^t): the trace is a sum of decayed gradients, not an average."""
  m = ctx.hparam("momentum", 0.9)
  scale = (1.0 - m) / _decay(m, ctx.step)
  return {MU: jax.tree.map(lambda x: x * scale, state.trace)}


def _write_trace(template: Any, moments: Moments, ctx: ConversionContext) -> Any:
  """trace = mu (1 - m^t) / (1 - m)."""
  m = ctx.hparam("momentum", 0.9)
  scale = _decay(m, ctx.step) / (1.0 - m)
  return template._replace(trace=moments.fill(template.trace, MU, lambda v, leaf, p: v * scale))


def _read_rms(state: Any, ctx: ConversionContext) -> dict[str, Any]:
  """nu = nu_stored / (1 - decay^t): RMSProp's average starts at zero."""
  count = _field(state, "count", ctx.step)
  read = {NU: jax.tree.map(_corrected(ctx.hparam("decay", 0.9), count), state.nu)}
  return {**read, "count": count} if _has_field(state, "count") else read


def _write_rms(template: Any, moments: Moments, ctx: ConversionContext) -> Any:
  """nu_stored = nu (1 - decay^t)."""
  if _has_field(template, "count"):
    template = template._replace(count=moments.count(template.nu, template.count, (NU,)))
  scale = _decay(ctx.hparam("decay", 0.9), _field(template, "count", ctx.step))
  return template._replace(nu=moments.fill(template.nu, NU, lambda v, leaf, p: v * scale))


def _has_field(node: Any, name: str) -> bool:
  """Whether a NamedTuple state has field `name` (``tuple.count`` is a method of them all)."""
  return name in getattr(node, "_fields", ())


def _field(node: Any, name: str, default: Any) -> Any:
  return getattr(node, name) if _has_field(node, name) else default


def _is_factored(v_row: Any) -> bool:
  return jnp.shape(v_row) != (1,)


def _by_param(tree: Any) -> dict[str, Any]:
  """A tree over the params, flat: '/'-joined param path to leaf."""
  return {
    _state_dict.key_path_str(path): leaf
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
  }


def _read_factored(state: optax.FactoredState, ctx: ConversionContext) -> dict[str, Any]:
  """nu = v where unfactored, else `reconstruct_second_moment` of v_row and v_col.

  Adafactor's decay ``1 - (t+1)^-0.8`` is 0 at the first step, so its
  statistics are estimates already: no bias correction.
  """
  cols, full = _by_param(state.v_col), _by_param(state.v)

  def nu(path: Any, v_row: Any) -> Any:
    param = _state_dict.key_path_str(path)
    if not _is_factored(v_row):
      return full[param]
    d1, d0 = factored_dims(jnp.shape(ctx.params[param]), jnp.shape(v_row), jnp.shape(cols[param]))
    return reconstruct_second_moment(v_row, cols[param], d1, d0)

  return {NU: jax.tree_util.tree_map_with_path(nu, state.v_row), "count": state.count}


def _write_factored(template: optax.FactoredState, moments: Moments, ctx: ConversionContext):
  """v = nu where unfactored; else v_row = mean(nu over d0), v_col = mean(nu over d1)."""
  rows, cols = _by_param(template.v_row), _by_param(template.v_col)

  def factor(which: int) -> Callable[[Any, Any, str], Any]:
    def fn(nu: Any, leaf: Any, param: str) -> Any:
      if not _is_factored(rows[param]):
        return leaf
      d1, d0 = factored_dims(jnp.shape(nu), jnp.shape(rows[param]), jnp.shape(cols[param]))
      return factor_second_moment(nu, d1, d0)[which]

    return fn

  def full(nu: Any, leaf: Any, param: str) -> Any:
    return leaf if _is_factored(rows[param]) else nu

  return template._replace(
    count=moments.count(template.v, template.count, (NU,)),
    v_row=moments.fill(template.v_row, NU, factor(0), field="v_row"),
    v_col=moments.fill(template.v_col, NU, factor(1), field="v_col"),
    v=moments.fill(template.v, NU, full, field="v"),
  )


def _read_t5x_adafactor(state: T5XAdafactorParamState, ctx: ConversionContext) -> dict[str, Any]:
  """nu as in `_read_factored`; mu = m sqrt(nu) / (lr scale) / (1 - beta1^t).

  T5X's ``m`` averages past *updates* ``lr * scale * g / sqrt(v)``, with
  ``scale = max(rms(param), epsilon2)`` (``multiply_by_parameter_scale``) and
  no bias correction; dividing by the same factors gives back an average of
  gradients, for a slowly changing ``v``. That needs the learning rate the
  run used: ``source_hparams['learning_rate']``; without it ``m`` is not read.
  """
  param = ctx.params[ctx.param]
  if _is_factored(state.v_row):
    d1, d0 = factored_dims(jnp.shape(param), jnp.shape(state.v_row), jnp.shape(state.v_col))
    nu = reconstruct_second_moment(state.v_row, state.v_col, d1, d0)
  else:
    nu = state.v
  read = {NU: nu}
  learning_rate = ctx.hparam("learning_rate", None)
  if state.m is not None and learning_rate is not None:
    scale = learning_rate
    if ctx.hparam("multiply_by_parameter_scale", True):
      rms = jnp.sqrt(jnp.mean(jnp.square(param)))
      scale = scale * jnp.maximum(rms, ctx.hparam("epsilon2", 1e-3))
    mu = state.m * jnp.sqrt(nu) / scale
    read[MU] = _corrected(ctx.hparam("beta1", 0.9), ctx.step)(mu)
  return read


def _read_adan(state: Any, ctx: ConversionContext) -> dict[str, Any]:
  """mu = m / (1 - b1^t), nu = n / (1 - b3^t) (Adan's n averages (g + (1-b2) diff)^2)."""
  b1, b3 = ctx.hparam("b1", 0.98), ctx.hparam("b3", 0.99)
  return _read_two_averages(state.m, b1, state.n, b3, state.t)


def _write_adan(template: Any, moments: Moments, ctx: ConversionContext) -> Any:
  """m = mu (1 - b1^t), n = nu (1 - b3^t), g (the previous gradient) = mu.

  v, Adan's average of gradient differences, keeps its initial zero: the
  expected difference of two gradients from a steady distribution.
  """
  b1, b3 = ctx.hparam("b1", 0.98), ctx.hparam("b3", 0.99)
  t = moments.count(template.m, template.t)
  return template._replace(
    t=t,
    m=moments.fill(template.m, MU, lambda v, leaf, p: v * _decay(b1, t), field="m"),
    n=moments.fill(template.n, NU, lambda v, leaf, p: v * _decay(b3, t), field="n"),
    g=moments.fill(template.g, MU, lambda v, leaf, p: v, field="g"),
  )


def _read_amsgrad(state: Any, ctx: ConversionContext) -> dict[str, Any]:
  """As Adam (nu_max, a running maximum, is not an estimate and is not read)."""
  return _read_adam(state, ctx)


def _write_amsgrad(template: Any, moments: Moments, ctx: ConversionContext) -> Any:
  """As Adam; nu_max = nu_stored (the maximum so far of the one estimate there is)."""
  written = _write_adam(template, moments, ctx)
  return written._replace(
    nu_max=moments.fill(
      template.nu_max, NU, lambda v, leaf, p: v * _decay(ctx.hparam("b2", 0.999), written.count)
    )
  )


def _builtin() -> None:
  adam = {"read": _read_adam, "write": _write_adam}
  register_state_converter(optax.ScaleByAdamState, **adam)
  register_state_converter(optax.ScaleByLionState, read=_read_lion, write=_write_lion)
  register_state_converter(optax.TraceState, read=_read_trace, write=_write_trace)
  register_state_converter(optax.ScaleByRmsState, read=_read_rms, write=_write_rms)
  register_state_converter(_RMS_WITH_COUNT, read=_read_rms, write=_write_rms)
  register_state_converter(optax.ScaleByAmsgradState, read=_read_amsgrad, write=_write_amsgrad)
  register_state_converter(optax.ScaleByAdanState, read=_read_adan, write=_write_adan)
  register_state_converter(optax.FactoredState, read=_read_factored, write=_write_factored)
  register_state_converter(T5XAdafactorParamState, read=_read_t5x_adafactor, per_param=True)


_builtin()


# ------------------------------------------------------------------ engine


def _type_name(state_type: type) -> str:
  return f"{state_type.__module__}.{state_type.__qualname__}"


def _is_namedtuple(node: Any) -> bool:
  return isinstance(node, tuple) and hasattr(node, "_fields")


def _children(node: Any) -> list[tuple[str, Any]] | None:
  """The (key, child) pairs of a container node, or None for a leaf."""
  if isinstance(node, optax.MaskedNode):
    return None
  if _is_namedtuple(node):
    return [(name, getattr(node, name)) for name in node._fields]
  if isinstance(node, tuple | list):
    return [(str(i), child) for i, child in enumerate(node)]
  if isinstance(node, Mapping):
    return [(str(key), child) for key, child in node.items()]
  if dataclasses.is_dataclass(node) and not isinstance(node, type):
    return [(f.name, getattr(node, f.name)) for f in dataclasses.fields(node)]
  return None


def _rebuild(node: Any, children: list[Any]) -> Any:
  if _is_namedtuple(node):
    return type(node)(*children)
  if isinstance(node, tuple | list):
    return type(node)(children)
  if isinstance(node, Mapping):
    return type(node)(zip(node.keys(), children, strict=True))
  return node.replace(
    **{f.name: c for f, c in zip(dataclasses.fields(node), children, strict=True)}
  )


def _has_state_nodes(tree: Any) -> bool:
  """Whether `tree` holds a NamedTuple or dataclass state (other than masked holes)."""
  children = _children(tree)
  if children is None:
    return False
  if _is_namedtuple(tree) or dataclasses.is_dataclass(tree):
    return True
  return any(_has_state_nodes(child) for _, child in children)


def _has_tensors(tree: Any) -> bool:
  """Whether `tree` holds an array that is not a scalar (per-param statistics)."""
  return any(jnp.ndim(leaf) > 0 for leaf in jax.tree.leaves(tree))


# Fields that hold no statistics of the gradients and start at their initial value.
_FRESH_FIELDS = {(optax.MultiStepsState, "acc_grads")}


def _param_suffix(path: tuple[str, ...], params: Mapping[str, Any]) -> str | None:
  for start in range(len(path)):
    candidate = "/".join(path[start:])
    if candidate in params:
      return candidate
  return None


@dataclasses.dataclass
class _Source:
  """The moments read from a source state, by param path."""

  stats: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
  origin: dict[tuple[str, str], str] = dataclasses.field(default_factory=dict)
  dropped: list[str] = dataclasses.field(default_factory=list)


def _read_source(
  param_states: Any, step: Any, params: Mapping[str, Any], hparams: Mapping[str, Any]
) -> _Source:
  source = _Source()
  converters = registered_converters()

  def visit(node: Any, path: tuple[str, ...]) -> None:
    converter = converters.get(type(node))
    where = "/".join(path) or "<root>"
    if converter is not None and converter.read is not None:
      own = _param_suffix(path, params) if converter.per_param else None
      if converter.per_param and own is None:
        raise ValueError(
          f"The {type(node).__name__} at '{where}' is the state of no param: no suffix "
          f"of its path is one of the params {sorted(params)}."
        )
      ctx = ConversionContext(where, step, params, hparams, own)
      for quantity, tree in converter.read(node, ctx).items():
        if quantity == "count":
          continue
        for param, value in {own: tree}.items() if own else _by_param(tree).items():
          entry = source.stats.setdefault(param, {})
          if quantity in entry:
            raise ValueError(
              f"Param '{param}' has a {quantity} in two source states: "
              f"'{source.origin[(param, quantity)]}' and '{where}' ({type(node).__name__}); "
              "the conversion would have to choose."
            )
          entry[quantity] = value
          entry.setdefault("count", _count_of(node, step))
          source.origin[(param, quantity)] = f"{where} ({type(node).__name__})"
      return
    children = _children(node)
    if children is None:
      return
    for key, child in children:
      if (
        (_is_namedtuple(node) or dataclasses.is_dataclass(node))
        and not _has_state_nodes(child)
        and _has_tensors(child)
      ):
        source.dropped.append(f"{'/'.join((*path, key))} ({type(node).__name__}.{key})")
        continue
      visit(child, (*path, key))

  visit(param_states, ())
  return source


def _is_integer_scalar(value: Any) -> bool:
  return (
    isinstance(value, jax.Array | np.ndarray | np.generic)
    and value.ndim == 0
    and jnp.issubdtype(value.dtype, jnp.integer)
  )


def _count_of(node: Any, step: Any) -> Any:
  """A node's own step count (``count``, ``t``), or the optimizer's step."""
  for name in ("count", "t"):
    value = _field(node, name, None)
    if value is not None and jnp.ndim(value) == 0:
      return value
  return step


class _Recorder:
  """Collects, per written field, which params were converted and which kept fresh."""

  def __init__(self) -> None:
    self.fields: dict[str, dict[bool, list[str]]] = {}

  def record(self, where: str) -> Callable[[str, str, bool], None]:
    def add(field: str, param: str, converted: bool) -> None:
      self.fields.setdefault(f"{where}.{field}", {True: [], False: []})[converted].append(param)

    return add


def _write_target(
  template: Any,
  source: _Source,
  step: Any,
  params: Mapping[str, Any],
  hparams: Mapping[str, Any],
  missing: str,
) -> tuple[Any, ConversionReport]:
  converters = registered_converters()
  recorder = _Recorder()
  no_converter: list[str] = []

  def visit(node: Any, path: tuple[str, ...]) -> Any:
    converter = converters.get(type(node))
    where = "/".join(path) or "<root>"
    if converter is not None:
      if converter.write is None:
        no_converter.append(f"{where} ({type(node).__name__}: its converter only reads)")
        return node
      label = f"{where} ({type(node).__name__})"
      ctx = ConversionContext(where, step, params, hparams)
      return converter.write(node, Moments(source.stats, recorder.record(label)), ctx)
    children = _children(node)
    if children is None:
      return node
    new = []
    for key, child in children:
      state_node = _is_namedtuple(node) or dataclasses.is_dataclass(node)
      if state_node and key == "count" and _is_integer_scalar(child):
        new.append(jnp.asarray(step, jnp.result_type(child)))
      elif (
        state_node
        and not _has_state_nodes(child)
        and _has_tensors(child)
        and (type(node), key) not in _FRESH_FIELDS
      ):
        no_converter.append(f"{'/'.join((*path, key))} ({type(node).__name__}.{key})")
        new.append(child)
      else:
        new.append(visit(child, (*path, key)))
    return _rebuild(node, new)

  written = visit(template, ())
  converted, initialised = [], []
  for field, by in recorder.fields.items():
    if by[True]:
      origins = sorted(
        {source.origin[(p, q)] for p in by[True] for q in (MU, NU) if (p, q) in source.origin}
      )
      converted.append(f"{field}: {len(by[True])} params, from {', '.join(origins)}")
    if by[False]:
      initialised.append(
        f"{field}: {len(by[False])} params without a source value (e.g. {by[False][0]})"
      )
  initialised += [f"{entry}: no converter" for entry in no_converter]
  report = ConversionReport(tuple(converted), tuple(initialised), tuple(source.dropped))
  if initialised and missing == "raise":
    raise ValueError(
      "The new optimizer's state cannot be fully converted from the old one: "
      + "; ".join(initialised)
      + ". Pass missing='init' to start these from their initial values."
    )
  return written, report


_T5X_ADAFACTOR_KEYS = frozenset(T5XAdafactorParamState._fields)


def _t5x_adafactor_states(param_states: Any, params: Any) -> Any | None:
  """T5X's legacy Adafactor param states as `T5XAdafactorParamState`s, or None if not that layout."""
  if not isinstance(param_states, Mapping):
    return None
  flat_params = traverse_util.flatten_dict(serialization.to_state_dict(params))
  flat_states = {}
  for path in flat_params:
    node = param_states
    for key in path:
      node = node.get(key) if isinstance(node, Mapping) else None
    if (
      not isinstance(node, Mapping)
      or not {"v_row", "v_col", "v"} <= set(node) <= _T5X_ADAFACTOR_KEYS
    ):
      return None
    flat_states[path] = T5XAdafactorParamState(**node)
  return traverse_util.unflatten_dict(flat_states)


def _source_parts(
  source: Optimizer | Mapping[str, Any], source_def: OptimizerDef | None
) -> tuple[Any, Any, Any]:
  """``(params, step, param_states)`` of the source optimizer or state dict."""
  if isinstance(source, Optimizer):
    return source.target, source.state.step, source.state.param_states
  if not isinstance(source, Mapping) or "target" not in source or "state" not in source:
    raise TypeError(
      "source must be an Optimizer or a T5X-layout state dict ({'target': ..., 'state': "
      f"{{'step': ..., 'param_states': ...}}}}), got {type(source).__name__}."
    )
  params, state = source["target"], source["state"]
  if source_def is not None:
    abstract = jax.eval_shape(source_def.create, params)
    try:
      restored = abstract.restore_state(source)
    except ValueError as e:
      raise ValueError(
        f"The source state dict does not fit source_def {type(source_def).__name__}: {e}"
      ) from e
    return restored.target, restored.state.step, restored.state.param_states
  states = _t5x_adafactor_states(state.get("param_states"), params)
  if states is None:
    raise ValueError(
      "The source state dict is not T5X's legacy Adafactor layout (v_row, v_col, v and "
      "optionally m under every param's path in state/param_states); pass source_def= "
      "(the optimizer definition that wrote it) to read it."
    )
  return params, jnp.asarray(state["step"]).astype(jnp.int32), states


def _fresh_state(optimizer_def: OptimizerDef, params: Any, like: Any) -> OptimizerState:
  """The definition's initial state for `params`, placed in `like`'s shardings if it has them."""
  leaves, treedef = jax.tree.flatten(like)
  shardings = [getattr(leaf, "sharding", None) for leaf in leaves]
  out = None if like is None or None in shardings else treedef.unflatten(shardings)
  return jax.jit(optimizer_def.init_state, out_shardings=out)(params)


def _placed(value: Any, like: Any) -> Any:
  """`value` as a new array in `like`'s dtype and sharding.

  Always a copy, so no two leaves of the result share a buffer (a jitted step
  that donates its state would otherwise donate one buffer twice).
  """
  sharding = getattr(like, "sharding", None)
  value = jnp.array(value, getattr(like, "dtype", None), copy=True)
  return value if sharding is None else jax.device_put(value, sharding)


def convert_state(
  source: Optimizer | Mapping[str, Any],
  target: Optimizer | OptimizerDef,
  *,
  source_def: OptimizerDef | None = None,
  source_hparams: Mapping[str, Any] | None = None,
  target_hparams: Mapping[str, Any] | None = None,
  missing: str = "raise",
) -> tuple[Optimizer, ConversionReport]:
  """Converts an optimizer's state into another optimizer's, over the same params.

  Every state node of the source with a registered converter is read into
  per-param moments (E[g] as ``mu``, E[g^2] as ``nu``, and their count);
  every node of the target's initial state with a converter is written from
  them. Nodes are found wherever they nest (``chain``,
  ``inject_hyperparams``, ``MultiSteps``, ``masked``, ``multi_transform``,
  ``MultiOptimizer``). Built in: Adam's state (adam, adamw, nadam, radam),
  AMSGrad, Adan, Lion, SGD's momentum trace, RMSProp, optax's Adafactor
  (factored or not) and, as a source, T5X's legacy ``adafactor.Adafactor``;
  see the module docstring for the step-count rule and each converter for
  its formula. Other states (adabelief's, say) need a registered converter.

  Args:
    source: the old optimizer, or its T5X-layout state dict (ours, or a T5X
      checkpoint's). A state dict is read with `source_def`, or without it
      when it has T5X's legacy Adafactor layout.
    target: the new optimizer: an `OptimizerDef`, or an `Optimizer` (real or
      abstract, e.g. `jax.eval_shape` of ``create`` with sharded leaves)
      whose state structure, dtypes and shardings the result takes.
    source_def: the definition that wrote a state-dict `source`.
    source_hparams: hyper-parameters of the old optimizer that its state
      does not hold (defaults: optax's): ``b1``/``b2`` (Adam 0.9/0.999, Lion
      b2 0.99), ``momentum`` (SGD, 0.9), ``decay`` (RMSProp, 0.9),
      ``b1``/``b3`` (Adan 0.98/0.99); T5X's Adafactor momentum ``m`` is read
      only with ``learning_rate`` (the rate of its last steps; also
      ``beta1`` 0.9, ``epsilon2`` 1e-3, ``multiply_by_parameter_scale`` True).
    target_hparams: the same for the new optimizer.
    missing: ``"raise"`` (default) when some state of the new optimizer would
      keep its initial value (no source value for a param's moment, or a
      state type without a converter), naming each; ``"init"`` to let it
      start fresh. Either way the report lists what was initialised.

  Returns:
    ``(optimizer, report)``: the new optimizer with the source's params (in
    the target's dtypes and shardings) and step, and a `ConversionReport`.

  Raises:
    TypeError: `source` is neither an Optimizer nor a state dict.
    ValueError: a state dict that `source_def` does not fit (or, without
      it, that is not T5X's legacy Adafactor layout); a param with the same
      moment in two source states; with ``missing="raise"``, anything the
      conversion would initialise.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from t5x_optim import OptaxWrapper
    >>> params = {'w': jnp.ones((2, 3))}
    >>> old = OptaxWrapper(optax.adafactor(0.1, min_dim_size_to_factor=1)).create(params)
    >>> old = old.apply_gradient({'w': jnp.full((2, 3), 2.0)})
    >>> new, report = convert_state(old, OptaxWrapper(optax.adamw(1e-3)), missing="init")
    >>> nu = new.state.param_states[0].nu['w']  # 4.0 * (1 - 0.999): Adam's scale at count 1
    >>> round(float(nu[0, 0]), 6), int(new.state.param_states[0].count)
    (0.004, 1)
    >>> report.initialised
    ('0 (ScaleByAdamState).mu: 1 params without a source value (e.g. w)',)
  """
  if missing not in _MISSING_POLICIES:
    raise ValueError(f"missing must be one of {_MISSING_POLICIES}, got {missing!r}.")
  params, step, param_states = _source_parts(source, source_def)
  step = jnp.asarray(step).astype(jnp.int32)
  if isinstance(target, Optimizer):
    optimizer_def, like_params, like_state = target.optimizer_def, target.target, target.state
    params = jax.tree.map(_placed, params, like_params)
  else:
    optimizer_def, like_state = target, None
  template = _fresh_state(optimizer_def, params, like_state)
  flat_params = {
    "/".join(map(str, path)): leaf
    for path, leaf in traverse_util.flatten_dict(serialization.to_state_dict(params)).items()
  }
  source_stats = _read_source(param_states, step, flat_params, dict(source_hparams or {}))
  written, report = _write_target(
    template.param_states, source_stats, step, flat_params, dict(target_hparams or {}), missing
  )
  written = jax.tree.map(_placed, written, template.param_states)
  state = OptimizerState(step=_placed(step, template.step), param_states=written)
  return Optimizer(optimizer_def=optimizer_def, state=state, target=params), report
