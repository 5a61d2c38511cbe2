"""Optax optimizers that take weight dimension numbers, given them from logical axes.

`optax.contrib.muon` orthogonalises every 2-D param and sends the others to
Adam, unless it is given ``muon_weight_dimension_numbers``; `optax.contrib.galore`
projects every 2-D param unless given ``weight_dimension_numbers``. On a T5X
model both defaults are wrong: scanned layers (a leading ``layers`` axis) are
3-D, while the token embedding and untied logits are 2-D.
`KernelAxesOptaxWrapper` implements T5X's ``set_param_axes``: once the params'
logical axes are known (T5X's train state, `TrainState.create`,
`partitioning.init_sharded`, or ``param_axes=``), the dimension numbers come
from them by a `KernelAxesRule` (`t5x_optim._axes.kernel_axes` has the rule).
Before that, the optimizer behaves as optax's default.

`wrap_optax_optimizer` builds this wrapper for the factories in
`KERNEL_AXES_FACTORIES` when the dimension numbers are not given by hand, and
a plain `OptaxWrapper` otherwise.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import jax
import optax
import optax.contrib

from t5x_optim._adapters.optax_wrapper import FusedOption, OptaxWrapper, takes_param_axes
from t5x_optim._adapters.param_subsets import format_paths
from t5x_optim._axes import engine as _state_rules
from t5x_optim._axes.kernel_axes import (
  KernelAxes,
  KernelAxesRule,
  axes_key,
  axis_names,
  describe,
  specs_by_path,
)
from t5x_optim._keypaths import key_path_str
from t5x_optim._warn import warn

__all__ = [
  "KERNEL_AXES_FACTORIES",
  "KernelAxesOptaxWrapper",
  "KernelAxesTarget",
  "wrap_optax_optimizer",
]

_EXTRA_ARGS = ("kernel_axes_rule", "param_axes", "wrap_transformation")


@dataclasses.dataclass(frozen=True)
class KernelAxesTarget:
  """How one optax factory takes its dimension numbers.

  Attributes:
    argument: the factory's keyword for the tree of dimension numbers.
    make: builds one param's dimension numbers from its `KernelAxes`.
    batches: whether the factory takes batch axes; when it does not, a
      param with batch axes gets None (no matrix treatment).
    labels: how plans name the two treatments (matrix, other).
  """

  argument: str
  make: Callable[..., Any]
  batches: bool = True
  labels: tuple[str, str] = ("muon", "adam")


def _muon_numbers(kernel: KernelAxes) -> optax.contrib.MuonDimensionNumbers:
  return optax.contrib.MuonDimensionNumbers(kernel.reduction, kernel.output)


def _galore_numbers(kernel: KernelAxes) -> optax.contrib.GaLoreDimensionNumbers:
  return optax.contrib.GaLoreDimensionNumbers(kernel.reduction, kernel.output)


KERNEL_AXES_FACTORIES: dict[Callable[..., Any], KernelAxesTarget] = {
  optax.contrib.muon: KernelAxesTarget("muon_weight_dimension_numbers", _muon_numbers),
  optax.contrib.galore: KernelAxesTarget(
    "weight_dimension_numbers", _galore_numbers, batches=False, labels=("galore", "plain")
  ),
}
"""The optax factories that take weight dimension numbers, and how."""


def _params_by_path(params: Any) -> list[tuple[Any, Any]]:
  """``(tree path, param)`` of each param; a flax box (``nn.with_logical_partitioning``'s)
  is one param at the box's path, its value, and one that holds no array (a param optax
  masked out) none."""
  found = []
  for path, param in jax.tree.flatten_with_path(params, is_leaf=_state_rules.is_box)[0]:
    value = _state_rules.unbox_leaf(param)
    if not _state_rules.is_box(param) or jax.tree.leaves(value):
      found.append((path, value))
  return found


class KernelAxesOptaxWrapper(OptaxWrapper):
  """An `OptaxWrapper` whose weight dimension numbers come from the params' logical axes.

  It has T5X's ``set_param_axes``, so T5X's train state gives it the params'
  axes (this package's `TrainState.create`, which `partitioning.init_sharded`
  and the partitioner use, gives them to a copy, `with_param_axes`);
  ``param_axes=`` gives them up front. Once it has created an optimizer it
  keeps its axes: the same again are taken, others refused. Each
  param is then placed by `rule` (`KernelAxesRule`): a batch of matrices
  (Muon; GaLore when it has no batch axes) or None (Adam; GaLore's plain
  update). Until the axes are set it is optax's factory as called, whose
  default decides by the number of dimensions.

  Args:
    factory: the optax factory (a key of `KERNEL_AXES_FACTORIES`).
    kwargs: the factory's arguments, without the dimension numbers.
    rule: the rule; default `KernelAxesRule()`.
    param_axes: the params' logical axes (a tree of `PartitionSpec`s, name
      tuples or None, boxed params, or a T5X ``params_axes`` collection).
    wrap_transformation: applied to the built transformation, e.g.
      ``functools.partial(low_precision, state_dtype="8bit")``; an
      `AxesAwareTransformation` it returns is built for the params' axes too.
    fused: `OptaxWrapper`'s.
    fallback: `OptaxWrapper`'s.

  Raises:
    UnplaceableParamsError: from `set_param_axes` (and from ``create`` for
      params without axes), naming every param the rule cannot place.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from jax.sharding import PartitionSpec as P
    >>> opt_def = KernelAxesOptaxWrapper(optax.contrib.muon, {"learning_rate": 0.02})
    >>> opt_def.set_param_axes({"emb": P("vocab", "embed"), "wi": P("layers", "embed", "mlp")})
    >>> opt_def.dimension_numbers({"emb": jnp.ones((8, 4)), "wi": jnp.ones((2, 4, 8))})
    {'emb': None, 'wi': MuonDimensionNumbers(reduction_axis=(1,), output_axis=(2,))}
  """

  def __init__(
    self,
    factory: Callable[..., optax.GradientTransformation],
    kwargs: Mapping[str, Any],
    *,
    rule: KernelAxesRule | None = None,
    param_axes: Any = None,
    wrap_transformation: Callable[[Any], Any] | None = None,
    fused: FusedOption = "off",
    fallback: _state_rules.StateRulesFallback | str = (
      _state_rules.StateRulesFallback.REPLICATE_WITH_WARNING
    ),
  ):
    if factory not in KERNEL_AXES_FACTORIES:
      raise ValueError(
        f"{getattr(factory, '__name__', factory)} takes no weight dimension numbers this "
        f"wrapper knows; it knows {sorted(f.__name__ for f in KERNEL_AXES_FACTORIES)}."
      )
    self.factory = factory
    self.target = KERNEL_AXES_FACTORIES[factory]
    if kwargs.get(self.target.argument) is not None:
      raise ValueError(
        f"{factory.__name__}: {self.target.argument}= is given by hand and would be replaced "
        "by the rule's; use optimizers.OptaxWrapper(optax...) for hand-written ones."
      )
    self.factory_kwargs = dict(kwargs)
    self.rule = KernelAxesRule() if rule is None else rule
    self.wrap_transformation = wrap_transformation
    self.param_axes: Any = None
    self.param_specs: dict[str, Any] | None = None
    super().__init__(self._build(with_axes=False), fused=fused, fallback=fallback)
    if param_axes is not None:
      self.set_param_axes(param_axes)

  def _build(self, *, with_axes: bool) -> optax.GradientTransformation:
    kwargs = dict(self.factory_kwargs)
    if with_axes:
      kwargs[self.target.argument] = self.dimension_numbers
    tx = self.factory(**kwargs)
    if self.wrap_transformation is None:
      return tx
    tx = self.wrap_transformation(tx)
    if with_axes and takes_param_axes(tx):
      tx = tx.with_param_axes(self.param_axes)
    return tx

  def _uncreated(self) -> KernelAxesOptaxWrapper:
    """This copy, keeping its original's axes, with a transformation of its own built for
    them: its original's dimension numbers read the original's axes, which may change after
    the copy."""
    super()._uncreated()
    if self.param_specs is not None:
      self._axes = axes_key(self.param_axes)
    self.optax_optimizer = self._build(with_axes=self.param_specs is not None)
    return self

  def set_param_axes(self, param_logical_axes: Any) -> None:
    """Takes the params' logical axes (T5X's hook) and rebuilds the transformation.

    Every param with logical axes is placed now, so a param the rule cannot
    place fails here, all of them in one error. The axes it has already
    leave it as it is.

    Raises:
      UnplaceableParamsError: naming each such param and its axes.
      ValueError: other axes once the definition has created an optimizer
        (`with_param_axes` gives them to a copy).
    """
    axes = _state_rules.logical_axes_from(param_logical_axes)
    specs = specs_by_path(axes)
    key = axes_key(axes)
    if not self.new_axes(key):
      return
    self.rule.place_all({path: tuple(spec) for path, spec in specs.items() if spec is not None})
    for pattern, why in self.rule.unused_overrides(list(specs)):
      warn(
        f"KernelAxesRule: the override {pattern!r} {why} (a pattern matches the whole "
        f"'/'-joined path), so it places no param; the params are {format_paths(list(specs))}."
      )
    self.param_axes = axes
    self.param_specs = specs
    self.optax_optimizer = self._build(with_axes=True)
    self._axes = key

  def _axis_names(self, params: Any) -> dict[str, tuple[str | None, ...]]:
    if self.param_specs is None:
      raise ValueError(
        f"{self.factory.__name__}: the params' logical axes are not set (set_param_axes, or "
        "param_axes=)."
      )
    names = {}
    for path, param in _params_by_path(params):
      where = key_path_str(path)
      if where not in self.param_specs:
        raise ValueError(
          f"The param '{where}' has no logical axes; the axes cover {sorted(self.param_specs)}."
        )
      names[where] = axis_names(where, self.param_specs[where], jax.numpy.shape(param))
    return names

  def placements(self, params: Any) -> dict[str, KernelAxes | None]:
    """``{param path: KernelAxes or None}`` for `params` (arrays or shapes).

    Raises:
      ValueError: before `set_param_axes`; or a param without axes or whose
        rank differs from its axes', naming its path.
      UnplaceableParamsError: naming every param the rule cannot place.
    """
    return self.rule.place_all(self._axis_names(params))

  def dimension_numbers(self, params: Any) -> Any:
    """The tree of dimension numbers (None: not a matrix) the factory gets for `params`; a
    flax box's are boxed as its param."""
    placed = self.placements(params)

    def numbers(path: Any, param: Any) -> Any:
      where = key_path_str(path)
      if where not in placed:
        return param
      kernel = placed[where]
      made = None
      if kernel is not None and (self.target.batches or not kernel.batch):
        made = self.target.make(kernel)
      return param.replace_boxed(made) if _state_rules.is_box(param) else made

    return jax.tree.map_with_path(numbers, params, is_leaf=_state_rules.is_box)

  def describe_params(self, params: Any) -> list[str]:
    """One line per param: where it goes (``muon`` or ``adam`` for muon) and by which axes.

    Raises:
      ValueError, UnplaceableParamsError: as `placements`.
    """
    names = self._axis_names(params)
    placed = {
      path: None if kernel is not None and kernel.batch and not self.target.batches else kernel
      for path, kernel in self.rule.place_all(names).items()
    }
    matrix, other = self.target.labels
    return describe(placed, names, matrix=matrix, other=other)


def _signature(factory: Callable[..., Any]) -> inspect.Signature:
  """The factory's signature with the wrapper's keyword-only arguments added."""
  signature = inspect.signature(factory)
  extra = [
    inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None) for name in _EXTRA_ARGS
  ]
  params = list(signature.parameters.values())
  var_keyword = [p for p in params if p.kind is inspect.Parameter.VAR_KEYWORD]
  plain = [p for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD]
  return signature.replace(parameters=[*plain, *extra, *var_keyword])


def wrap_optax_optimizer(
  optax_optimizer: Callable[..., optax.GradientTransformation],
) -> Callable[..., OptaxWrapper]:
  """Turns an optax factory into one that builds an `OptaxWrapper`.

  The result keeps the factory's name, docstring and signature, so gin can
  configure it; `optax_factory` is the factory. For a factory that takes weight dimension numbers
  (`KERNEL_AXES_FACTORIES`: muon, galore) it builds a `KernelAxesOptaxWrapper`
  unless they are given by hand, and takes three more keyword-only arguments:
  ``kernel_axes_rule`` (a `KernelAxesRule`), ``param_axes`` and
  ``wrap_transformation`` (see `KernelAxesOptaxWrapper`).

  Example:
    >>> import optax
    >>> adamw = wrap_optax_optimizer(optax.adamw)
    >>> type(adamw(learning_rate=1e-3)).__name__
    'OptaxWrapper'
    >>> type(wrap_optax_optimizer(optax.contrib.muon)(learning_rate=0.02)).__name__
    'KernelAxesOptaxWrapper'
  """
  target = KERNEL_AXES_FACTORIES.get(optax_optimizer)
  if target is None:

    @functools.wraps(optax_optimizer)
    def wrapped_optimizer(*args: Any, **kwargs: Any) -> OptaxWrapper:
      return OptaxWrapper(optax_optimizer(*args, **kwargs))

    wrapped_optimizer.optax_factory = optax_optimizer
    return wrapped_optimizer

  names = list(inspect.signature(optax_optimizer).parameters)

  @functools.wraps(optax_optimizer)
  def wrapped_kernel_axes_optimizer(
    *args: Any,
    kernel_axes_rule: KernelAxesRule | None = None,
    param_axes: Any = None,
    wrap_transformation: Callable[[Any], Any] | None = None,
    **kwargs: Any,
  ) -> OptaxWrapper:
    positional = dict(zip(names, args, strict=False))
    twice = sorted(set(positional) & set(kwargs))
    if twice:
      raise TypeError(f"{optax_optimizer.__name__}() got multiple values for {twice}.")
    kwargs.update(positional)
    if kwargs.get(target.argument) is not None:
      given = [
        f"{name}="
        for name, value in (("kernel_axes_rule", kernel_axes_rule), ("param_axes", param_axes))
        if value is not None
      ]
      if given:
        raise ValueError(
          f"{optax_optimizer.__name__}: {target.argument}= is given by hand, so {given} "
          "would be ignored; give one or the other."
        )
      tx = optax_optimizer(**kwargs)
      return OptaxWrapper(tx if wrap_transformation is None else wrap_transformation(tx))
    return KernelAxesOptaxWrapper(
      optax_optimizer,
      kwargs,
      rule=kernel_axes_rule,
      param_axes=param_axes,
      wrap_transformation=wrap_transformation,
    )

  # gin reads a function's parameters through `__wrapped__`, which would hide the
  # extra ones: the factory is `optax_factory` here, and `__signature__` has them all.
  del wrapped_kernel_axes_optimizer.__wrapped__
  wrapped_kernel_axes_optimizer.__signature__ = _signature(optax_optimizer)
  wrapped_kernel_axes_optimizer.optax_factory = optax_optimizer
  return wrapped_kernel_axes_optimizer
