"""The registry of optimizer-state converters (`convert_state` uses it).

A `StateConverter` reads a state node of its type into per-param moments
(``mu``, ``nu``, ``count``; see `t5x_optim._convert.convert`) and writes
moments into a node of its type. `register_state_converter` refuses a second
converter for a type unless told to replace it.
"""

from __future__ import annotations

import dataclasses
import threading
import types
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from t5x_optim._core import state_dict as _state_dict

__all__ = [
  "BUILTIN_HPARAMS",
  "HPARAM_ALIASES",
  "MU",
  "NU",
  "ConversionContext",
  "ReadHparams",
  "ConversionReport",
  "SeveralValues",
  "Moments",
  "StateConverter",
  "T5XAdafactorParamState",
  "by_param",
  "state_field",
  "has_field",
  "is_namedtuple",
  "register_state_converter",
  "registered_converters",
]

MU, NU = "mu", "nu"

BUILTIN_HPARAMS = frozenset(
  {"b1", "b2", "b3", "beta", "momentum", "decay", "learning_rate", "beta1", "epsilon2"}
  | {"multiply_by_parameter_scale"}
)
"""The hyper-parameters the built-in converters read (`ConversionContext.hparam`): Adam's
and Lion's ``b1``/``b2``, Adan's ``b3``, Muon's ``beta``, SGD's ``momentum``, RMSProp's
``decay``, and the learning rate and T5X Adafactor settings its momentum is read with."""

HPARAM_ALIASES = types.MappingProxyType({"adam_b1": "b1", "adam_b2": "b2"})
"""Arguments of another name that set a built-in converter's hyper-parameter: Muon's
(``optax.contrib.muon``) for the Adam it runs on the params it does not orthogonalise."""


@dataclasses.dataclass(frozen=True)
class SeveralValues:
  """A hyper-parameter bound to several values, one of them each state's: a config whose
  `MultiOptimizer` groups (or ``optax.partition`` parts) run Adam with another ``b2`` each.

  Given in ``source_hparams`` or ``target_hparams`` of `convert_state`, a converter of a
  state under one of the paths `at` gives a value (a `MultiOptimizer` group's,
  ``"1/param_states"``) reads that value; one elsewhere that reads the name with a default
  (`ConversionContext.hparam`: Adam's ``b2``) is refused, naming its state and the values,
  where one value for every state, or optax's default, would convert some states wrongly; a
  reader that does without (`ConversionContext.rate`, a default of None: Adafactor's
  momentum) goes without. Where both sides give equal `SeveralValues` without `at` (the
  same values at the same places), each state reads the same value on both sides and the
  name is left out of both, so an optimizer converts into itself as it is.

  Attributes:
    values: the values, each where `places` names it.
    places: where each value applies (a gin scope), compared for equality.
    bindings: what binds each value, as an error shows it (not compared).
    name: the name the values are bound as, where a converter reads them as another
      (schedule-free AdamW's ``b2`` as its RMS's ``decay``), else None (not compared).
    at: for each value, the paths of the states it is known to be the value of (a state
      and those under it), or none.

  Example:
    >>> b2 = SeveralValues((0.95, 0.98), ("k", "s"), ("k/optax.adam.b2", "s/optax.adam.b2"))
    >>> str(b2)
    '0.95 (k/optax.adam.b2) or 0.98 (s/optax.adam.b2)'
    >>> b2 == SeveralValues((0.95, 0.98), ("k", "s"))
    True
  """

  values: tuple[Any, ...]
  places: tuple[str, ...] = ()
  bindings: tuple[str, ...] = dataclasses.field(default=(), compare=False)
  name: str | None = dataclasses.field(default=None, compare=False)
  at: tuple[tuple[str, ...], ...] = ()

  def value_at(self, path: str) -> Any:
    """The value of the state at `path` (`at`), or self where none is known to be.

    Example:
      >>> b2 = SeveralValues((0.95, 0.98), at=(("0/param_states",), ("1/param_states",)))
      >>> b2.value_at("1/param_states/0"), b2.value_at("10/param_states") is b2
      (0.98, True)
    """
    for value, paths in zip(self.values, self.at, strict=False):
      if any(path == under or path.startswith(f"{under}/") for under in paths):
        return value
    return self

  def __str__(self) -> str:
    where = self.bindings or self.places
    return " or ".join(
      f"{value} ({at})" if at else f"{value}"
      for value, at in zip(self.values, (*where, *[""] * len(self.values)), strict=False)
    )


class ReadHparams(Mapping[str, Any]):
  """Hyper-parameters that note which names were read (``get``, ``[]``).

  Copies made with `updated` share the record, so a name read anywhere in a
  conversion counts (`convert_state` refuses names nothing read).

  Example:
    >>> hparams = ReadHparams({'b1': 0.8, 'b2x': 0.9})
    >>> hparams.updated({'b1': 0.7}).get('b1'), sorted(hparams.read)
    (0.7, ['b1'])
  """

  def __init__(
    self,
    values: Mapping[str, Any],
    read: set[str] | None = None,
    noted: dict[str, Any] | None = None,
  ):
    self._values = dict(values)
    self.read = set() if read is None else read
    self._noted = noted

  def __getitem__(self, name: str) -> Any:
    self.read.add(name)
    return self._note(name, self._values[name])

  def get(self, name: str, default: Any = None) -> Any:
    self.read.add(name)
    return self._note(name, self._values.get(name, default))

  def _note(self, name: str, value: Any) -> Any:
    if self._noted is not None:
      self._noted[name] = value
    return value

  def noting(self) -> tuple[ReadHparams, dict[str, Any]]:
    """A copy that also notes the value each read gave (a default included), and that record."""
    noted: dict[str, Any] = {}
    return ReadHparams(self._values, self.read, noted), noted

  def __iter__(self):
    return iter(self._values)

  def __len__(self) -> int:
    return len(self._values)

  def has(self, name: str) -> bool:
    """Whether `name` is given, without noting it read."""
    return name in self._values

  def schedules(self) -> dict[str, Any]:
    """Those given as schedules (called at the step), without noting them read."""
    return {name: value for name, value in self._values.items() if callable(value)}

  def updated(self, values: Mapping[str, Any]) -> ReadHparams:
    """These hyper-parameters with `values` over them, noting reads in the same record."""
    return ReadHparams({**self._values, **values}, self.read, self._noted)


class T5XAdafactorParamState(NamedTuple):
  """One param's state of T5X's legacy `adafactor.Adafactor`.

  Read from its state dict as this NamedTuple. T5X's own param state class
  (a dataclass with these four fields, in a T5X process) converts, read or
  written, through the same converter: states are matched by their fields.

  Attributes:
    v_row: the factored second moment's row statistics (the param's shape
      without its column dims), or a (1,) placeholder when not factored.
    v_col: the column statistics (the shape without the row dims), or (1,).
    v: the full second moment when not factored, else a (1,) placeholder.
    m: the momentum (an average of past updates, learning rate included) when
      Adafactor ran with ``beta1``, else None or a (1,) placeholder.
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
    step: the node's clock, the number of updates its state was built over
      (an int32 scalar): the optimizer's step, or inside a ``MultiSteps``
      state its ``gradient_step``, inside a sub-optimizer's state that
      sub-optimizer's step, inside a ``LowPrecisionState`` its ``count``
      (see `t5x_optim._convert.convert`). A state without a count of
      its own is read and written over it.
    params: the params, flat: '/'-joined param path to array.
    hparams: hyper-parameters of the side being read (``source_hparams``) or
      written (``target_hparams``), for converters whose state does not hold
      them (Adam's ``b1`` and ``b2``, SGD's ``momentum``, ...).
    param: the param path of a ``per_param`` node, else None.
    chain: the states of the transformations chained before this one (the
      node's earlier siblings in a ``chain`` state, nearest last), for a
      state whose meaning depends on them: optax Adafactor's momentum is an
      ``EmaState`` of updates already divided by the ``FactoredState``'s
      second moment.
    axes: the params' logical axes where given (``param_axes`` of
      `convert_state`): '/'-joined param path to a tuple of axis names, or
      None. T5X's legacy Adafactor factors a param by them.
  """

  path: str
  step: Any
  params: Mapping[str, Any]
  hparams: Mapping[str, Any]
  param: str | None = None
  chain: tuple[Any, ...] = ()
  axes: Mapping[str, tuple[Any, ...] | None] = dataclasses.field(default_factory=dict)

  def hparam(self, name: str, default: Any) -> Any:
    """``hparams[name]``, or `default` (optax's default for the state's factory).

    Raises:
      ValueError: `name` is given as `SeveralValues` and `default` is not None: which value
        is this state's is not known, and the default would be a guess. With a default of
        None, the reader does without: None.
    """
    value = self.hparams.get(name, default)
    if isinstance(value, SeveralValues):
      value = value.value_at(self.path)
    if not isinstance(value, SeveralValues):
      return value
    if default is None:
      return None
    bound = value.name or name
    read = name if bound == name else f"{name} ({bound})"
    raise ValueError(
      f"{self.path}: its converter reads {read}, which the optimizer's config binds to "
      f"several values, {value}, one of them this state's; converting it with another would "
      f"be wrong. Give one {bound} (source_hparams or target_hparams, --init_from_gin), or "
      "inject it into each state (inject_hyperparams)."
    )

  def rate(self, name: str = "learning_rate") -> Any:
    """The hyper-parameter `name` at the current step (a schedule is called), or None (not
    given, or given as `SeveralValues`)."""
    value = self.hparam(name, None)
    return value(self.step) if callable(value) else value


PROJECTED = "kept in GaLore's projected space"
"""Why a param's moment is neither read nor written: ``optax.contrib.galore`` keeps the base
optimizer's moments of the params it projects in its projected space (a square kernel's in
its param's shape too), where no other optimizer's moments are."""


def galore_projected(node: Any) -> frozenset[str]:
  """The params a ``GaLoreState`` projects (a projector that is not empty), by param path."""
  return frozenset(param for param, leaf in by_param(node.projector).items() if jnp.size(leaf))


class Moments:
  """The moments available to a writer, looked up by param path.

  `fill` maps a tree of the template node (its ``mu``, say) to the converted
  values, keeping the template's leaf (the fresh initial value) where the
  source has nothing, and records each param's leaf with ``record(field,
  param, quantities, by_design)``: the quantities it was written from (its
  `quantity` and `needs`), none where it kept its initial value; `keep`
  records a field kept at it, ``by_design`` where the converter chose to.
  The `projected` params' leaves are kept too (see `PROJECTED`).
  """

  def __init__(
    self,
    stats: Mapping[str, dict[str, Any]],
    record: Callable[[str, str, tuple[str, ...], bool], None],
    *,
    projected: frozenset[str] = frozenset(),
  ):
    self._stats, self._record, self._projected = stats, record, projected

  def value(self, param: str, quantity: str) -> Any:
    """The source's `quantity` (``"mu"``, ``"nu"``) of `param`, or None."""
    return self._stats.get(param, {}).get(quantity)

  def fill(
    self,
    tree: Any,
    quantity: str,
    fn: Callable[[Any, Any, str], Any],
    *,
    field: str | None = None,
    needs: tuple[str, ...] = (),
    param: str | None = None,
    holds: Callable[[str], bool] | None = None,
  ) -> Any:
    """`tree` with each leaf replaced by ``fn(value, leaf, param_path)``.

    Args:
      tree: the template's tree over the params (MaskedNode holes allowed).
      quantity: ``"mu"`` or ``"nu"``: the moment the leaves are made from.
      fn: the formula; ``value`` is the param's moment, ``leaf`` the
        template's leaf. The result is cast to the leaf's dtype (refused,
        naming the param, where it would overflow a float16 leaf).
      field: the node's field name, for the report (defaults to `quantity`).
      needs: other quantities the leaf is written only with (its formula
        reads them, or the update pairs them: Adam divides ``mu`` by the
        square root of ``nu``); a param without all of them keeps its leaf,
        as one without `quantity` does, reported as carried only with them.
        So does a param GaLore projects (`projected`): its moments are in
        GaLore's projected space, not its param's.
      param: for a ``per_param`` node: `tree` is one array, this param's.
      holds: whether the field holds a value of this param; a param's leaf
        where it does not (Adafactor's ``(1,)`` placeholders) stays as it is,
        unreported. By default every param's.
    """

    def one(param: str, leaf: Any) -> Any:
      if holds is not None and not holds(param):
        return leaf
      if param in self._projected:
        self._record(f"{field or quantity} ({PROJECTED})", param, (), False)
        return leaf
      value = self.value(param, quantity)
      lacking = [q for q in needs if self.value(param, q) is None]
      name = field or quantity
      if value is not None and lacking:
        name = f"{name} (carried only with {', '.join(needs)})"
      if value is None or lacking:
        self._record(name, param, (), False)
        return leaf
      self._record(name, param, (quantity, *needs), False)
      written = fn(value, leaf, param)
      problem = _state_dict.range_problem(written, leaf.dtype)
      if problem is not None:
        raise ValueError(f"The converted {name} of param '{param}' does not fit: {problem}.")
      return jnp.asarray(written, dtype=leaf.dtype)

    if param is not None:
      return one(param, tree)
    return jax.tree.map_with_path(
      lambda path, leaf: one(_state_dict.key_path_str(path), leaf), tree
    )

  def keep(
    self, tree: Any, field: str, *, param: str | None = None, by_design: bool = False
  ) -> Any:
    """`tree` unchanged, every param of it (or `param`) recorded as initialised under `field`.

    Args:
      tree: the template's tree over the params.
      field: the node's field name and why it starts fresh, for the report.
      param: for a ``per_param`` node: `tree` is this param's array.
      by_design: the initial value is the converter's value for the field
        (Adan's ``v``: 0, the expected difference of two gradients), not a
        value it lacks: reported so, and not refused by ``missing='raise'``.
    """
    if param is not None:
      self._record(field, param, (), by_design)
      return tree
    for path, _ in jax.tree.flatten_with_path(tree)[0]:
      self._record(field, _state_dict.key_path_str(path), (), by_design)
    return tree

  def count(
    self,
    tree: Any,
    template_count: Any,
    quantities: tuple[str, ...] = (MU, NU),
    *,
    needs: tuple[str, ...] = (),
  ) -> Any:
    """The source's count for the params of `tree`, or `template_count`.

    The template's count (a fresh start) stays when no param of `tree` has
    any of the `quantities` the node is written from (and all its `needs`,
    as `fill` takes them), the `projected` params aside, whose moments start
    fresh.
    """
    for path, _ in jax.tree.flatten_with_path(tree)[0]:
      param = _state_dict.key_path_str(path)
      if param in self._projected:
        continue
      stats = self._stats.get(param, {})
      if any(q in stats for q in quantities) and all(q in stats for q in needs):
        return jnp.asarray(stats["count"], jnp.result_type(template_count))
    return template_count


Reader = Callable[[Any, ConversionContext], Mapping[str, Any]]
"""``read(node, context) -> {'mu': tree, 'nu': tree, 'count': scalar}`` (any subset).

A reader that cannot read its node in its context returns ``{'unread': why}``
instead; the node is then listed as dropped, with the reason. A reader may add
``'unread_fields'``: the names of the node's fields it does not read (Adan's
``v``), each listed as dropped.

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
      node's path that names a param, `read` returns single arrays and
      `write` fills single arrays (``Moments.fill(..., param=ctx.param)``).
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

  A converter reads its settings through its context (``context.hparam``): where the old
  and the new optimizer each hold one state of the type over the same params, and the
  converter reads and writes it with the same settings over the same clock, the state goes
  over as it is (its round trip is taken to be the identity).

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
      how many params got a converted value, and the source nodes of the
      moments it was written from (Adam's ``mu`` from those of ``mu`` and
      ``nu``: it is written only with ``nu``).
    initialised: one line per field (or state without a converter) that
      kept its fresh initial value for some params, with an example param;
      a field its converter keeps at that value by design (Adan's ``v``) says
      so, and is not refused by ``missing='raise'``.
    dropped: the source's states, and fields of them, that no converter
      reads, and the moments read that no field of the new state is written
      from (Adam's ``nu`` into SGD with momentum): their content is not
      carried.
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


def _type_name(state_type: type) -> str:
  return f"{state_type.__module__}.{state_type.__qualname__}"


def is_namedtuple(node: Any) -> bool:
  return isinstance(node, tuple) and hasattr(node, "_fields")


def has_field(node: Any, name: str) -> bool:
  """Whether a NamedTuple state has field `name` (``tuple.count`` is a method of them all)."""
  return name in getattr(node, "_fields", ())


def state_field(node: Any, name: str, default: Any) -> Any:
  return getattr(node, name) if has_field(node, name) else default


def by_param(tree: Any) -> dict[str, Any]:
  """A tree over the params, flat: '/'-joined param path to leaf."""
  return {
    _state_dict.key_path_str(path): leaf for path, leaf in jax.tree.flatten_with_path(tree)[0]
  }
