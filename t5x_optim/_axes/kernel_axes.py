"""Which axes of each param a matrix optimizer (Muon, GaLore) treats as a matrix.

Muon orthogonalises a 2-D matrix; optax takes, per param, "dimension numbers"
that name the reduction (input) and output axes of the matrix, every other axis
being a batch axis orthogonalised slice by slice, or None to send the param to
Adam. `KernelAxesRule` derives them from the params' logical axes, so that a
T5X model (whose params carry logical axis names) needs no hand-written tree.

The rule, for a param with logical axes ``names`` at path ``path``:

1. an override whose regular expression matches the whole path decides
   (``"adam"``, or the names of the reduction and output axes);
2. a param with an axis in `KernelAxesRule.adam_axes` (``vocab``: the token
   embedding and untied logits; ``length`` and ``relpos_buckets``: position
   embeddings) goes to Adam, as in Moonlight, Kimi K2 and MaxText;
3. axes in `KernelAxesRule.batch_axes` (``layers`` of scanned layers,
   ``expert``, ``stack``) are batch axes, wherever they are;
4. the other axes, the core, are cut into groups: consecutive axes named in
   the same entry of `KernelAxesRule.axis_groups` (``heads`` and ``kv``: an
   attention projection's heads and their width) form one group, every other
   axis (unnamed ones too) is a group of its own;
5. a core of no group or of one (scalars, vectors, layer-norm scales, a
   per-head bias) goes to Adam; a core of two groups is a kernel: T5X kernels
   are laid out (inputs..., outputs...) (flax's ``DenseGeneral``), so the first
   group is the reduction axes and the second the output axes; a core of three
   or more groups cannot be placed, and every such param is named in one error.

Example:
  >>> rule = KernelAxesRule()
  >>> rule.place("layers/mlp/wi", ("layers", "embed", "mlp"))
  KernelAxes(batch=(0,), reduction=(1,), output=(2,))
  >>> rule.place("decoder/out", ("heads", "kv", "embed"))
  KernelAxes(batch=(), reduction=(0, 1), output=(2,))
  >>> rule.place("token_embedder/embedding", ("vocab", "embed")) is None
  True
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
from jax.sharding import PartitionSpec

from t5x_optim._axes.engine import logical_axes_from
from t5x_optim._keypaths import key_path_str

__all__ = [
  "ADAM",
  "AxesKey",
  "KernelAxes",
  "KernelAxesRule",
  "UnplaceableParamsError",
  "axes_key",
  "axis_names",
  "describe",
  "specs_by_path",
]

ADAM = "adam"
"""An override value: the param goes to Adam."""

AxesKey = tuple[tuple[str, PartitionSpec | None], ...]
"""The params' logical axes as `axes_key` gives them."""

AxisNames = tuple[str | None, ...]


class KernelAxes(NamedTuple):
  """A param's axes as a batch of matrices: positions of its dimensions.

  Attributes:
    batch: the axes orthogonalised separately (slice by slice).
    reduction: the matrix's input axes (flattened into its rows).
    output: the matrix's output axes (flattened into its columns).
  """

  batch: tuple[int, ...]
  reduction: tuple[int, ...]
  output: tuple[int, ...]


class UnplaceableParamsError(ValueError):
  """Params the rule cannot place; the message names each path and its axes."""


def _names(value: Any) -> tuple[str, ...]:
  if isinstance(value, str):
    return (value,)
  return tuple(value)


def _override(value: Any) -> Any:
  """An override value normalised: ``ADAM`` or ``(reduction names, output names)``."""
  if value is None or value == ADAM:
    return ADAM
  if isinstance(value, Sequence) and not isinstance(value, str) and len(value) == 2:
    return (_names(value[0]), _names(value[1]))
  raise TypeError(
    f"A KernelAxesRule override is 'adam' (or None) or a pair (reduction axis names, "
    f"output axis names); got {value!r}."
  )


@dataclasses.dataclass(frozen=True)
class KernelAxesRule:
  """The rule from logical axes to matrix axes (see the module docstring).

  Gin-configurable (``optimizers.KernelAxesRule``); lists become tuples.

  Args:
    batch_axes: axis names orthogonalised separately (batch axes).
    adam_axes: axis names that send a param to Adam.
    axis_groups: tuples of axis names that form one side of a kernel when
      they are next to each other.
    overrides: ``{path regex: value}``, tried in order against the whole
      '/'-joined param path; the value is ``"adam"`` (or None) or a pair
      ``(reduction axis names, output axis names)``, the param's other axes
      being batch axes.

  Example:
    >>> rule = KernelAxesRule(overrides={".*/wo": ("mlp", "embed")})
    >>> rule.place("layers/mlp/wo", ("layers", "mlp", "embed"))
    KernelAxes(batch=(0,), reduction=(1,), output=(2,))
  """

  batch_axes: tuple[str, ...] = ("layers", "expert", "stack")
  adam_axes: tuple[str, ...] = ("vocab", "length", "relpos_buckets")
  axis_groups: tuple[tuple[str, ...], ...] = (("heads", "kv"),)
  overrides: tuple[tuple[str, Any], ...] = ()

  def __post_init__(self):
    set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
    set_("batch_axes", _names(self.batch_axes))
    set_("adam_axes", _names(self.adam_axes))
    set_("axis_groups", tuple(_names(group) for group in self.axis_groups))
    items = self.overrides.items() if isinstance(self.overrides, Mapping) else self.overrides
    set_("overrides", tuple((str(pattern), _override(value)) for pattern, value in items))
    for pattern, _ in self.overrides:
      re.compile(pattern)

  def _group(self, name: str | None, position: int) -> Any:
    for index, group in enumerate(self.axis_groups):
      if name in group:
        return ("group", index)
    return ("axis", position)

  def _by_names(self, path: str, names: AxisNames, reduction: tuple, output: tuple) -> KernelAxes:
    named = (*reduction, *output)
    twice = next((name for name in named if named.count(name) > 1), None)
    if twice is not None:
      raise UnplaceableParamsError(
        f"The override for '{path}' names the axis {twice!r} twice ({reduction} and "
        f"{output}); each axis is on one side, once."
      )
    where = {}
    for name in named:
      if names.count(name) != 1:
        raise UnplaceableParamsError(
          f"The override for '{path}' names the axis {name!r}, which its axes {names} "
          f"hold {names.count(name)} times (need exactly once)."
        )
      where[name] = names.index(name)
    red = tuple(where[name] for name in reduction)
    out = tuple(where[name] for name in output)
    if not red or not out:
      raise UnplaceableParamsError(
        f"The override for '{path}' (axes {names}) needs reduction and output axes; "
        f"got {reduction} and {output}."
      )
    batch = tuple(i for i in range(len(names)) if i not in red and i not in out)
    return KernelAxes(batch, red, out)

  def place(self, path: str, names: Sequence[str | None]) -> KernelAxes | None:
    """The matrix axes of the param at `path` with logical axes `names`, or None (Adam).

    Raises:
      UnplaceableParamsError: the core has three or more groups (no override
        matches), or an override names an axis the param lacks; the message
        names the path and the axes.
    """
    names = tuple(names)
    for pattern, value in self.overrides:
      if re.fullmatch(pattern, path):
        return None if value == ADAM else self._by_names(path, names, *value)
    if any(name in self.adam_axes for name in names if name is not None):
      return None
    batch = tuple(i for i, name in enumerate(names) if name in self.batch_axes)
    runs: list[tuple[Any, list[int]]] = []
    for i, name in enumerate(names):
      if i in batch:
        continue
      group = self._group(name, i)
      if runs and runs[-1][0] == group and group[0] == "group":
        runs[-1][1].append(i)
      else:
        runs.append((group, [i]))
    if len(runs) < 2:
      return None
    if len(runs) > 2:
      sides = " | ".join(str(tuple(names[i] for i in run)) for _, run in runs)
      raise UnplaceableParamsError(
        f"'{path}' with axes {names}: its non-batch axes form {len(runs)} groups ({sides}), "
        "not the two sides (inputs, outputs) of a kernel."
      )
    return KernelAxes(batch, tuple(runs[0][1]), tuple(runs[1][1]))

  def unused_overrides(self, paths: Sequence[str]) -> list[tuple[str, str]]:
    """``(pattern, why)`` for each override that places none of `paths`: it matches none of
    them, or only paths that an earlier override takes (overrides are tried in order).

    Example:
      >>> KernelAxesRule(overrides={"mlp/wi": "adam"}).unused_overrides(["layers_0/mlp/wi"])
      [('mlp/wi', 'matches no param')]
    """
    unused, taken = [], set()
    for pattern, _ in self.overrides:
      matched = {path for path in paths if re.fullmatch(pattern, path)}
      if not matched:
        unused.append((pattern, "matches no param"))
      elif matched <= taken:
        unused.append((pattern, "matches only params that an earlier override places"))
      taken |= matched
    return unused

  def place_all(self, axes: Mapping[str, AxisNames]) -> dict[str, KernelAxes | None]:
    """`place` for every ``{path: axis names}``, all failures in one error.

    Raises:
      UnplaceableParamsError: naming every param the rule cannot place, its
        axes, and how to place it by hand.

    Example:
      >>> KernelAxesRule().place_all({"w": ("embed", "mlp"), "b": ("mlp",)})
      {'w': KernelAxes(batch=(), reduction=(0,), output=(1,)), 'b': None}
    """
    placed, problems = {}, []
    for path, names in axes.items():
      try:
        placed[path] = self.place(path, names)
      except UnplaceableParamsError as error:
        problems.append(str(error))
    if problems:
      params = "param" if len(problems) == 1 else "params"
      raise UnplaceableParamsError(
        f"The kernel-axes rule cannot place {len(problems)} {params}: "
        + "; ".join(problem.rstrip(".") for problem in problems)
        + ". Add the axis names to KernelAxesRule.axis_groups, batch_axes or adam_axes, or "
        "give the path an override: KernelAxesRule(overrides={'<path regex>': 'adam'}) or "
        "{'<path regex>': (('<input axis>', ...), ('<output axis>', ...))}."
      )
    return placed


def axis_names(path: str, spec: Any, shape: Sequence[int]) -> AxisNames:
  """The logical axis names of the param at `path` with shape `shape`.

  A spec that names no axis (None, ``P()``, what ``nn.get_partition_spec``
  writes for a param without axes, or ``P(None, ...)`` of any length) gives one
  unnamed axis per dimension, as `derive_logical_axes` replicates each.

  Raises:
    ValueError: a spec whose rank differs from the shape's, or an entry that
      is not one name or None; naming the path and both sides.

  Example:
    >>> axis_names("w", PartitionSpec("embed", None), (4, 8)), axis_names("b", PartitionSpec(), (8,))
    (('embed', None), (None,))
  """
  names = () if spec is None else tuple(spec)
  if all(name is None for name in names):
    return (None,) * len(shape)
  for name in names:
    if name is not None and not isinstance(name, str):
      raise ValueError(
        f"'{path}' has the logical axes {names}; each must be one name or None, not {name!r}."
      )
  if len(names) != len(shape):
    raise ValueError(
      f"'{path}' has the logical axes {names} ({len(names)} dimensions) but the shape "
      f"{tuple(shape)} ({len(shape)} dimensions)."
    )
  return names


def _is_spec(x: Any) -> bool:
  """A spec: None, a `PartitionSpec` or a plain tuple of names (str or None); any other tuple
  (of specs, or a NamedTuple such as `optax.LookaheadParams`) holds specs."""
  if x is None or isinstance(x, PartitionSpec):
    return True
  return type(x) is tuple and all(n is None or isinstance(n, str) for n in x)  # pylint: disable=unidiomatic-typecheck


def specs_by_path(param_axes: Any) -> dict[str, PartitionSpec | None]:
  """``{'/'-joined path: spec}`` of a tree of `PartitionSpec`s, name tuples or None.

  Example:
    >>> specs_by_path({"dense": {"kernel": PartitionSpec("embed", "mlp"), "bias": None}})
    {'dense/bias': None, 'dense/kernel': P('embed', 'mlp')}
  """
  flat = jax.tree.flatten_with_path(param_axes, is_leaf=_is_spec)[0]
  return {key_path_str(path): None if spec is None else PartitionSpec(*spec) for path, spec in flat}


def axes_key(param_axes: Any) -> AxesKey:
  """The params' logical axes, in any form `logical_axes_from` accepts, as sorted
  ``('/'-joined path, spec)`` pairs: equal for the same axes in any form, and hashable.

  A spec that names no axis (``P()``, ``P(None)``, ``(None,)``, ...) is None
  there, as `axis_names` leaves every dimension of its param unnamed.

  Example:
    >>> same = {"b": PartitionSpec(None), "w": PartitionSpec("embed", "mlp")}
    >>> axes_key({"w": ("embed", "mlp"), "b": None}) == axes_key(same)
    True
  """
  specs = specs_by_path(logical_axes_from(param_axes))
  named = {
    path: None if spec is None or all(name is None for name in spec) else spec
    for path, spec in specs.items()
  }
  return tuple(sorted(named.items(), key=lambda kv: kv[0]))


def describe(
  placed: Mapping[str, KernelAxes | None],
  axes: Mapping[str, AxisNames],
  *,
  matrix: str = "matrix",
  other: str = ADAM,
) -> list[str]:
  """One line per param: its path, axes and where it goes (for plans and logs).

  Params placed as a matrix are labelled `matrix`, the others `other`.

  Example:
    >>> describe({"w": KernelAxes((), (0,), (1,))}, {"w": ("embed", "mlp")})
    ["w ('embed', 'mlp'): matrix, inputs ('embed',), outputs ('mlp',)"]
  """
  lines = []
  for path, kernel in placed.items():
    names = axes[path]
    if kernel is None:
      lines.append(f"{path} {names}: {other}")
      continue
    pick = lambda positions: tuple(names[i] for i in positions)  # noqa: E731
    batch = f", batch {pick(kernel.batch)}" if kernel.batch else ""
    lines.append(
      f"{path} {names}: {matrix}, inputs {pick(kernel.reduction)}, outputs "
      f"{pick(kernel.output)}{batch}"
    )
  return lines
