"""Optimizer-state conversion: carry one optimizer's statistics into another's state.

Every converter reads a state node into per-param *moments* and writes moments
into a node of its type:

- ``mu``: the estimate of the gradient's mean, E[g] (a bias-corrected average);
- ``nu``: the estimate of the gradient's second moment, E[g^2];
- ``count``: how many gradients the estimates have seen.

Converting A to B reads every node of A's state that has a converter, then
writes every node of B's template state from the moments of its params, so any
pair of registered states converts (N converters, not N^2 conversions).

Step counts. Every state node was built over some number of updates of its
transformation, its *clock*: the optimizer's step at the root; inside a
``MultiSteps`` state its ``gradient_step`` (the inner optimizer's updates, not
the mini-steps); inside an ``apply_if_finite`` state its parent's clock less its
``total_notfinite``, the updates it let through (it skips non-finite ones; those it
lets through after more than ``max_consecutive_errors`` in a row are counted there too);
inside a sub-optimizer's `OptimizerState` (`MultiOptimizer`) that sub-optimizer's step;
inside a `LowPrecisionState` its ``count``. A state without a count of its own (SGD's
trace) is read and written over its clock.

A converted node's count is the source's count for its params (the count of the
source node that held them, or that node's clock), and each state stores its
moments scaled as its own update expects after that many steps. Adam's bias
correction at the next step divides by ``1 - b^(count+1)``, close to
``1 - b^count``, so it sees the source's estimates and does not re-amplify a
converted ``nu``. In the new state, the root's clock is the number of updates the
source applied to its params' moments (`_applied_to`): the clock of the source nodes
that held them where that is one clock for every param (the ``gradient_step`` of the
innermost ``MultiSteps`` they were under, wherever it is placed: its mini-steps
accumulate into one update), else, and where no param has moments, the clock of the
state whose updates are applied (`_updates_applied`). A target state over a part of the
params (`_SCOPES`: ``masked``'s, a ``multi_transform`` partition's, a `MultiOptimizer`
group's) gives the states inside it the same clock over its own params' moments, so that
each part goes on from its own updates; one whose states hold no param's statistics keeps
its parent's. Where the target, or the part, holds a state that counts apart
(`_COUNTING`: a ``MultiSteps`` or ``apply_if_finite`` of its own), the states beside
that one see every gradient: the root's clock is then the optimizer's step, a part keeps
its parent's, and inside an ``apply_if_finite`` the clock is the source's count for the
params it wraps. A new ``MultiSteps`` (its ``gradient_step``) or ``apply_if_finite`` takes
the clock inside the source's state of its type over the same params with the same
wrappers nested inside, wherever that one sits (`_counting_key`; where several are alike,
the one of the same rank among them where both hold as many, else the one at the same path:
`_Source.clock_for`); where the source has none, the count of its
params' moments, else the updates the source applied
(`_updates_applied`; for ``apply_if_finite``, no more than its parent's clock less its
``total_notfinite``).
The optimizer's step stays the source's, and so does a sub-optimizer's (T5X's
``MultiOptimizer`` passes its own step to its sub-optimizers); a
`LowPrecisionState`'s count is its parent's clock (it updates once per step of
it); a ``MultiSteps``'
``gradient_step`` is the source's count for its params (its inner optimizer
goes on from as many updates as its moments were gathered over), with
``mini_step`` 0 and no accumulated gradient; an ``optax.lookahead`` state's
``steps_since_sync`` is a lookahead source's (both copies of the params are the source's),
else 0 (one copy: just synced); an ``optax.contrib.schedule_free`` state's
``step_count``, which counts from 1, is its clock + 1. Every other ``count``
field (learning-rate schedules, injected hyper-parameters) is set to its clock,
so schedules go on where the old run was instead of warming up again; a node
that gets none of its moments starts fresh with count 0. A count that times an
event of its own state, which starts fresh (`_EVENT_COUNTS`: reduce_on_plateau's
losses towards its next check, apply_every's accumulated gradients, GaLore's
projector and Sophia's Hessian refreshes, Novograd's first step, L-BFGS's memory
slot), starts at 0 with it: set to the clock, the event would fall out of step
with that state or, compared for equality, never come. ``optax.apply_if_finite``'s
counts of non-finite updates and ``reduce_on_plateau``'s learning-rate scale, best loss and
plateau counts go over as they are where each side holds one such state, in the same
sub-optimizer (`_CARRIED_WHOLE`), so its guard does not start over and the learning rate it
cut stays cut. Any other scalar field of a state without a converter that is neither set
nor carried is reported as initialised or dropped (`_unset_scalars`).

States of their type. A state without a converter (`_of_its_type`: L-BFGS's memory,
adabelief's moments) goes over as it is, its count too, where each side holds one state of
its type over the same params in the same shapes (`_same_type_states`), whatever its place.
So does a state with a converter where each side holds one of its type over the same params,
after states of the same types in its chain (`_twin_key`), that its converter reads and
writes with the same settings over the same clock (`_same_settings`): its converter's round
trip would give it to within an ulp, or not where it cannot read or write some of it.

Schedule-free. A schedule-free source gives its evaluation params ``x``
(`schedule_free_evaluation_params`; in a partition's part or a `MultiOptimizer` group, for
the params it trains), except into schedule-free states over the same params, in any
grouping (one state split into groups, groups merged into one where their averages were
weighted alike), which go on from its ``z``, ``weight_sum`` and ``max_lr`` and the params it
took gradients at (`_schedule_free_continued`; by the target's ``b1`` where it is another).

Low precision. A `LowPrecisionState` (`low_precision`'s bfloat16, 8-bit or
4-bit state) is decoded to float32 (`low_precision_to_float32`) before it is read,
and a target's is written in float32 and encoded again
(`float32_to_low_precision`), so moments convert between any two storages.
An 8-bit or 4-bit leaf anywhere else cannot be decoded and is refused, with its path.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import serialization, traverse_util
from jax.sharding import NamedSharding, PartitionSpec

from t5x_optim._adapters.multi_optimizer import with_param_axes
from t5x_optim._adapters.optax_wrapper import loss_extra_args, trains_lookahead_params
from t5x_optim._axes.engine import logical_axes_from
from t5x_optim._axes.kernel_axes import specs_by_path
from t5x_optim._axes.rules import fit_state_spec, is_spec_leaf
from t5x_optim._convert import builtin as convert_builtin  # noqa: F401  (registers the built-in converters)
from t5x_optim._convert.builtin import RMS_WITH_COUNT, AdamaxState
from t5x_optim._convert.registry import (
  BUILTIN_HPARAMS,
  HPARAM_ALIASES,
  PROJECTED,
  ConversionContext,
  ConversionReport,
  Moments,
  ReadHparams,
  SeveralValues,
  StateConverter,
  T5XAdafactorParamState,
  by_param,
  galore_projected,
  is_namedtuple,
  register_state_converter,
  registered_converters,
  state_field,
)
from t5x_optim._core import state_dict as _state_dict
from t5x_optim._core.configured import same_setting
from t5x_optim._core.interface import Optimizer, OptimizerDef, OptimizerState, trained_params
from t5x_optim._core.placement import host_scalar, placed_as_target
from t5x_optim._keypaths import key_path_str
from t5x_optim._layouts.stacked import StackedLayout, StackedParams, per_leaf, stacked_like
from t5x_optim._low_precision.low_precision import (
  QUANTIZED_LEAF_TYPES,
  LowPrecisionState,
  float32_to_low_precision,
  low_precision_to_float32,
  quantized_mode,
)
from t5x_optim._nnx import refuse

__all__ = [
  "BUILTIN_HPARAMS",
  "HPARAM_ALIASES",
  "ConversionContext",
  "ConversionReport",
  "Moments",
  "SeveralValues",
  "StateConverter",
  "T5XAdafactorParamState",
  "check_missing",
  "convert_state",
  "fresh_state",
  "register_state_converter",
  "registered_converters",
  "schedule_free_evaluation_params",
]

_MISSING_POLICIES = ("raise", "init")


def check_missing(missing: str) -> None:
  """Raises ValueError unless `missing` is one of `convert_state`'s ``missing=`` policies."""
  if missing not in _MISSING_POLICIES:
    raise ValueError(f"missing must be one of {_MISSING_POLICIES}, got {missing!r}.")


# ------------------------------------------------------------------ engine


def _children(node: Any) -> list[tuple[str, Any]] | None:
  """The (key, child) pairs of a container node, or None for a leaf."""
  if isinstance(node, optax.MaskedNode):
    return None
  if is_namedtuple(node):
    return [(name, getattr(node, name)) for name in node._fields]
  if isinstance(node, tuple | list):
    return [(str(i), child) for i, child in enumerate(node)]
  if isinstance(node, Mapping):
    return [(str(key), child) for key, child in node.items()]
  if dataclasses.is_dataclass(node) and not isinstance(node, type):
    return [(f.name, getattr(node, f.name)) for f in dataclasses.fields(node)]
  return None


def _rebuild(node: Any, children: list[Any]) -> Any:
  if is_namedtuple(node):
    return type(node)(*children)
  if isinstance(node, tuple | list):
    return type(node)(children)
  if isinstance(node, Mapping):
    return type(node)(zip(node.keys(), children, strict=True))
  return dataclasses.replace(
    node, **{f.name: c for f, c in zip(dataclasses.fields(node), children, strict=True)}
  )


def _has_state_nodes(tree: Any, *, encoded: bool = False) -> bool:
  """Whether `tree` holds a NamedTuple or dataclass state (other than masked holes); with
  `encoded`, an 8-bit or 4-bit leaf counts as an array (a `LowPrecisionState`'s inner
  state as stored)."""
  if encoded and _is_quantized(tree):
    return False
  children = _children(tree)
  if children is None:
    return False
  if is_namedtuple(tree) or dataclasses.is_dataclass(tree):
    return True
  return any(_has_state_nodes(child, encoded=encoded) for _, child in children)


def _has_tensors(tree: Any) -> bool:
  """Whether `tree` holds an array that is not a scalar (per-param statistics)."""
  return any(jnp.ndim(leaf) > 0 for leaf in jax.tree.leaves(tree))


# Fields that hold no statistics to convert and start at their initial value, and why.
_FRESH_FIELDS = {
  (optax.MultiStepsState, "acc_grads"): "the gradients accumulated towards the next update",
  (optax.contrib.GaLoreState, "projector"): "recomputed at the state's count 0",
  (optax.contrib.ReduceLROnPlateauState, "avg_value"): (
    "the losses averaged towards its next check, which starts over with its count 0"
  ),
}

_GATES = (optax.ConditionallyTransformState, optax.ConditionallyMaskState)
"""States of a gate decided by their own step, which `_with_clock` sets."""

_UNREPORTED_SCALARS = {
  (optax.ConditionallyTransformState, "step"): "a clock (`_with_clock`)",
  (optax.ConditionallyMaskState, "step"): "a clock (`_with_clock`)",
  (optax.AddNoiseState, "rng_key"): "the key of the noise's random draws, of the same law fresh",
  (optax.MultiStepsState, "mini_step"): "counts the accumulated gradients (acc_grads)",
  (optax.MultiStepsState, "skip_state"): "what its last update's skip function returned",
  (optax.MultiStepsState, "gradient_step"): "a clock (`_clock_of`, `_with_clock`)",
  (optax.contrib.ScheduleFreeState, "b1"): "a setting",
  (optax.contrib.ScheduleFreeState, "step_count"): "a clock (`_with_clock`)",
  (optax.LookaheadState, "steps_since_sync"): "carried with the params (`_carry_sync_count`)",
  (OptimizerState, "step"): "a clock (`_clock_of`, `_with_clock`)",
}
"""Scalar fields of a state without a converter that are not reported as initialised or
dropped where the conversion does not set or carry them, and why: every other one is (a
state's ``count`` goes by its clock; see the module docstring)."""

_EVENT_COUNTS = frozenset(
  {
    optax.contrib.ReduceLROnPlateauState,  # losses averaged towards the next check (== size)
    optax.ApplyEvery,  # gradients in its accumulator (modulo k), which starts empty
    optax.contrib.GaLoreState,  # its projectors are computed when count % update_proj_gap == 0
    optax.contrib.SophiaState,  # its Hessian estimate when count % update_interval == 0
    optax.ScaleByNovogradState,  # count 0 sets its moments from the first gradient
    optax.ScaleByLBFGSState,  # count % memory_size is the slot of its memory of updates
  }
)
"""States whose ``count`` times an event of their own state, which starts fresh, rather
than feed a schedule: converted, it starts at 0 with that state (see the module docstring)."""


def _unset_scalars(node: Any, key: str, child: Any) -> bool:
  """Whether field `key` of state `node` holds scalars only (not per-param statistics, nor
  states) that the conversion neither sets nor carries: the written state keeps its
  initial value, a read one is left behind (reported as initialised or dropped)."""
  if not (is_namedtuple(node) or dataclasses.is_dataclass(node)):
    return False
  if not jax.tree.leaves(child) or _has_tensors(child) or _has_state_nodes(child):
    return False
  if key == "count" and _is_integer_scalar(child):
    return False
  if (type(node), key) in _UNREPORTED_SCALARS or (type(node), key) in _FRESH_FIELDS:
    return False
  if type(node) in _CARRIED_WHOLE and key in _CARRIED_WHOLE[type(node)][0]:
    return False
  return not (key == "hyperparams" and _injects_hyperparams(node))


def _injects_hyperparams(node: Any) -> bool:
  """Whether `node` is an ``inject_hyperparams`` state (its ``hyperparams`` are settings),
  recognised by structure: a NamedTuple with a mapping ``hyperparams`` and an ``inner_state``."""
  return (
    is_namedtuple(node)
    and {"hyperparams", "inner_state"} <= set(node._fields)
    and isinstance(node.hyperparams, Mapping)
  )


def _loose_arrays(node: Any, where: str) -> str | None:
  """What a plain container holding per-param arrays and no state type holds (a
  `jax.example_libraries` triple's parts), in a report's words; None for other nodes.

  No converter reads or writes such arrays: a converted state would drop them, or
  keep their initial values, without a word.
  """
  if is_namedtuple(node) or dataclasses.is_dataclass(node) or _children(node) is None:
    return None
  if _has_state_nodes(node) or not _has_tensors(node):
    return None
  paths = [key_path_str(path) for path, leaf in jax.tree.leaves_with_path(node) if jnp.ndim(leaf)]
  shown = ", ".join(paths[:4]) + (f" and {len(paths) - 4} more" if len(paths) > 4 else "")
  return f"{where}: {len(paths)} arrays outside any optimizer state type ({shown})"


def _param_suffix(path: tuple[str, ...], params: Mapping[str, Any]) -> str | None:
  for start in range(len(path)):
    candidate = "/".join(path[start:])
    if candidate in params:
      return candidate
  return None


def _as_count(value: Any, like: Any) -> jax.Array:
  """`value` as a step count of `like`'s integer dtype."""
  return jnp.asarray(value, jnp.result_type(like))


_CLOCKED = (optax.MultiStepsState, OptimizerState, optax.ApplyIfFiniteState)
"""The source states that set the clock of the states inside them (`_clock_of`); a
`LowPrecisionState` sets it to its ``count`` where it is decoded."""


def _clock_of(node: Any, clock: Any) -> Any:
  """The step count the states inside a source `node` were built over (see the module docstring)."""
  if isinstance(node, optax.MultiStepsState):
    return node.gradient_step
  if isinstance(node, OptimizerState):
    return node.step
  if isinstance(node, optax.ApplyIfFiniteState):
    return clock - node.total_notfinite
  return clock


def _updates_applied(param_states: Any, step: Any) -> Any:
  """How many updates a source state applied to its params: the clock (`_clock_of`) of the
  state whose updates are the ones applied, from the optimizer's `step` down through the
  whole state, a chain's last, and the state a transformation that wraps one optimizer keeps
  in one of `_WRAPPED_STATE_FIELDS`: the ``gradient_step`` of the innermost
  ``optax.MultiSteps`` on that way (an outer one's counts the inner one's mini-steps)."""
  node, clock = param_states, step
  while True:
    clock = _clock_of(node, clock)
    if type(node) is tuple and node:
      node = node[-1]
      continue
    inner = next((f for f in _WRAPPED_STATE_FIELDS if hasattr(node, f)), None)
    if inner is None:
      return clock
    node = getattr(node, inner)


_COUNTING = (optax.MultiStepsState, optax.ApplyIfFiniteState)
"""Target states whose inner states count other updates than the states beside them: the
updates a ``MultiSteps`` applies, or those ``apply_if_finite`` lets through."""


def _counts_apart(node: Any) -> bool:
  """Whether a target `node` holds a `_COUNTING` state: the states beside one see every
  gradient, so they go on from the source's step, not from its updates applied."""
  found = jax.tree.leaves(node, is_leaf=lambda x: isinstance(x, _COUNTING))
  return any(isinstance(x, _COUNTING) for x in found)


_SCOPES = (optax.MaskedState, OptimizerState)
"""Target states over a part of the params (``optax.masked``'s and each ``multi_transform``
partition's, each `MultiOptimizer` group's): the states inside one go on from the updates
the source applied to the moments of its params (`_applied_to`)."""


def _params_in(node: Any, params: Mapping[str, Any]) -> list[str]:
  """The params whose statistics the states inside `node` hold: those at the end of the
  paths of its nodes below it (masked holes aside; a `LowPrecisionState`'s encoded leaves
  by their paths, not decoded)."""
  found: list[str] = []

  def walk(node: Any, path: tuple[str, ...]) -> None:
    if isinstance(node, optax.MaskedNode):
      return
    param = _param_suffix(path, params) if path else None
    if param is not None and param not in found:
      found.append(param)
    for key, child in _children(node) or ():
      walk(child, (*path, key))

  walk(node, ())
  return found


def _with_clock(
  node: Any, clock: Any, moments: Moments, step: Any, applied: Any, counted: Any
) -> tuple[Any, Any]:
  """A target `node` with its own step count set, and the clock of the states inside it.

  A sub-optimizer's `OptimizerState` takes the optimizer's `step` (T5X's
  ``MultiOptimizer`` passes its own step down) and its parent's clock. A
  ``MultiSteps`` state's inner optimizer has made as many updates as the
  source's ``MultiSteps`` over the same params and nesting (`counted`,
  its clock; None where there is none), else as the source's moments for its
  params were gathered over,
  else the updates the source `applied`; ``mini_step`` stays 0, as the accumulated
  gradient starts empty. A schedule-free state's ``step_count`` (read by its
  own learning-rate schedule) counts from 1, one ahead of its base optimizer's
  counts. The step a ``conditionally_transform`` or ``conditionally_mask``
  gate is decided by is the clock.
  """
  if isinstance(node, optax.MultiStepsState):
    if counted is not None:
      inner = _as_count(counted, node.gradient_step)
    else:
      inner = moments.count(node.acc_grads, _as_count(applied, node.gradient_step))
    return node._replace(gradient_step=inner), inner
  if isinstance(node, OptimizerState):
    return node.replace(step=_as_count(step, node.step)), clock
  if isinstance(node, optax.contrib.ScheduleFreeState):
    return node._replace(step_count=_as_count(clock + 1, node.step_count)), clock
  if isinstance(node, _GATES):
    return node._replace(step=_as_count(clock, node.step)), clock
  return node, clock


def _is_lookahead(node: Any) -> bool:
  return isinstance(node, optax.LookaheadState)


def _lookahead_states(states: Any) -> list[tuple[Any, optax.LookaheadState]]:
  """Every ``optax.lookahead`` state in `states`, with its key path."""
  flat = jax.tree.flatten_with_path(states, is_leaf=_is_lookahead)[0]
  return [(path, node) for path, node in flat if _is_lookahead(node)]


def _carry_sync_count(source_states: Any, target_states: Any) -> tuple[Any, str | None]:
  """The target's ``optax.lookahead`` state with the source's count of fast steps since the
  last sync, when the source is lookahead too (the target's params are then both of the
  source's copies, so the next sync falls where the source's would), and its report line.

  From another optimizer, the fast and slow params are one: the count stays 0, just synced.
  """
  sources, targets = _lookahead_states(source_states), _lookahead_states(target_states)
  if len(sources) != 1 or len(targets) != 1:
    return target_states, None
  count = sources[0][1].steps_since_sync

  def carry(node: Any) -> Any:
    if not _is_lookahead(node):
      return node
    return node._replace(steps_since_sync=_as_count(count, node.steps_since_sync))

  carried = jax.tree.map(carry, target_states, is_leaf=_is_lookahead)
  where = [key_path_str(path) for path, _ in (sources[0], targets[0])]
  return carried, f"{where[1]} (LookaheadState).steps_since_sync: from {where[0]} (LookaheadState)"


def _is_quantized(node: Any) -> bool:
  return isinstance(node, QUANTIZED_LEAF_TYPES)


def _refuse_quantized(node: Any, path: tuple[str, ...], side: str) -> None:
  """Raises, naming its path, if `node` holds a quantized leaf outside a `LowPrecisionState`.

  Only a `LowPrecisionState` knows how its leaves are stored; an 8-bit or
  4-bit leaf elsewhere would be converted as its codes and scales.
  """
  flat = jax.tree.flatten_with_path(node, is_leaf=_is_quantized)[0]
  for leaf_path, leaf in flat:
    if _is_quantized(leaf):
      where = "/".join((*path, *_state_dict.key_path_parts(leaf_path))) or "<root>"
      raise ValueError(
        f"The {side} state's leaf '{where}' is {quantized_mode(leaf)[0]}-bit (uint8 codes and "
        "scales) outside a LowPrecisionState: convert_state decodes and encodes quantized "
        "leaves only inside low_precision's state; convert it to float32 first."
      )


@dataclasses.dataclass(frozen=True)
class _Read:
  """A source state its converter read: the node (decoded to float32), its clock, and the
  value of each hyper-parameter the converter read."""

  node: Any
  clock: Any
  hparams: dict[str, Any]


@dataclasses.dataclass
class _Source:
  """The moments read from a source state, by param path."""

  stats: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
  origin: dict[tuple[str, str], str] = dataclasses.field(default_factory=dict)
  dropped: list[str] = dataclasses.field(default_factory=list)
  guards: dict[type, list[_Carried]] = dataclasses.field(default_factory=dict)
  of_its_type: dict[type, list[_Carried]] = dataclasses.field(default_factory=dict)
  """Its states that `_same_type_states` carries, each with its node decoded to float32."""
  dropped_with: dict[str, list[str]] = dataclasses.field(default_factory=dict)
  """The lines of `dropped` that each of those states, by its path, made, and that each
  state its converter read made where it did not read all of it."""
  read_nodes: dict[str, _Read] = dataclasses.field(default_factory=dict)
  """Each state its converter read, by its path."""
  twins: dict[tuple[Any, ...], list[str]] = dataclasses.field(default_factory=dict)
  """The paths of its states with a converter, by `_twin_key`."""
  applied: dict[str, _Applied] = dataclasses.field(default_factory=dict)
  clocks: dict[tuple[Any, ...], list[Any]] = dataclasses.field(default_factory=dict)
  """The clocks inside the `_COUNTING` states of each `_counting_key`, in the order the
  states are walked (two alike in one chain: in chain order)."""
  placed: dict[str, tuple[tuple[Any, ...], Any]] = dataclasses.field(default_factory=dict)
  """Each `_COUNTING` state's `_counting_key` and clock, by its path."""

  def clock_for(self, where: str, key: tuple[Any, ...], rank: int, alike: int) -> Any:
    """The clock of the source's `_COUNTING` state that a target's goes on from: the
    target's of `key` at `where`, the `rank`-th of the `alike` states of that key it holds.
    Where the source holds as many of that key, the one of the same rank (wherever it
    sits); else the one of that key at the same path; None where there is none."""
    found = self.clocks.get(key, [])
    if len(found) == alike:
      return found[rank]
    same_place = self.placed.get(where)
    return same_place[1] if same_place is not None and same_place[0] == key else None


def _wrappers_inside(node: Any) -> tuple[tuple[int, str], ...]:
  """The `_COUNTING` states in `node`, itself included, each as its depth among them and
  its type name, in the order they are walked: how its wrappers nest, whatever they wrap
  and whatever sits between them (a chain, a `low_precision`)."""
  found: list[tuple[int, str]] = []

  def walk(node: Any, depth: int) -> None:
    if isinstance(node, _COUNTING):
      found.append((depth, type(node).__name__))
      depth += 1
    for _, child in _children(node) or ():
      walk(child, depth)

  walk(node, 0)
  return tuple(found)


def _counting_places(
  tree: Any, params: Mapping[str, Any]
) -> dict[str, tuple[tuple[Any, ...], int, int]]:
  """Each `_COUNTING` state in `tree`, by its path: its `_counting_key`, its rank among the
  states of that key in the order they are walked, and how many states have that key."""
  keys: dict[str, tuple[Any, ...]] = {}

  def walk(node: Any, path: tuple[str, ...]) -> None:
    if isinstance(node, _COUNTING):
      keys["/".join(path) or "<root>"] = _counting_key(node, params)
    for name, child in _children(node) or ():
      walk(child, (*path, name))

  walk(tree, ())
  alike = collections.Counter(keys.values())
  ranks: collections.Counter = collections.Counter()
  places = {}
  for where, key in keys.items():
    places[where] = (key, ranks[key], alike[key])
    ranks[key] += 1
  return places


def _counting_key(node: Any, params: Mapping[str, Any]) -> tuple[Any, ...]:
  """What a source and a target `_COUNTING` state share when the target's clock is the
  source's: their type, the params they count for and how the wrappers inside them nest
  (`_wrappers_inside`), wherever either sits in its optimizer (a partition renamed, a
  `MultiOptimizer` group moved) and whatever optimizer they wrap (adam or adamw)."""
  return type(node), frozenset(_params_in(node, params)), _wrappers_inside(node)


@dataclasses.dataclass(frozen=True)
class _Applied:
  """The updates applied to a param's moments: the clock of the source node that held them,
  and where that clock was set (the path of the state that sets it, `_CLOCKED`; "" for the
  optimizer's step), so that params whose clocks are one can be told apart by structure,
  their values being traced under `jax.jit`."""

  clock: Any
  where: str


def _applied_to(params: Iterable[str], applied: Mapping[str, _Applied], default: Any) -> Any:
  """The updates applied to `params`' moments where every one of them had moments under one
  clock (`_Applied`), else `default`."""
  found = [applied.get(param) for param in params]
  if not found or None in found or len({entry.where for entry in found}) > 1:
    return default
  return found[0].clock


_CARRIED_WHOLE = {
  optax.ApplyIfFiniteState: (
    ("notfinite_count", "last_finite", "total_notfinite"),
    "its counts of non-finite updates",
  ),
  optax.contrib.ReduceLROnPlateauState: (
    ("scale", "best_value", "plateau_count", "cooldown_count"),
    "its learning-rate scale, best loss and counts towards its next cut",
  ),
}
"""States whose scalar fields (not per-param moments) are the run's history, by type: each
field goes over as it is where each side holds one state of the type, in the same
sub-optimizer (`_Carried`), and is reported dropped where the target holds none. With more,
a state's place does not say which params it guards (`MultiOptimizer` groups may be listed
in another order), so they start at their initial values, reported, as where the source
holds none. ``apply_if_finite`` started over would skip as many non-finite updates in a row
again before it lets one through; ``reduce_on_plateau`` would give back the learning rate
it had cut."""


@dataclasses.dataclass(frozen=True)
class _Carried:
  """A `_CARRIED_WHOLE` state: its '/'-joined path as the walks name it, and the place of
  the sub-optimizer's state it is in (a `MultiOptimizer` group's; "" for none), a
  `LowPrecisionState`'s ``inner_state`` left out of places (the same whatever the storage)."""

  where: str
  group: str
  node: Any


def _carried_whole(tree: Any) -> dict[type, list[_Carried]]:
  """Every state of a `_CARRIED_WHOLE` type in `tree`, by type."""
  found: dict[type, list[_Carried]] = {}

  def walk(node: Any, path: tuple[str, ...], place: tuple[str, ...], group: str) -> None:
    if isinstance(node, LowPrecisionState):
      walk(node.inner_state, (*path, "inner_state"), place, group)
      return
    if isinstance(node, OptimizerState):
      group = "/".join(place)
    if type(node) in _CARRIED_WHOLE:
      where = "/".join(path) or "<root>"
      found.setdefault(type(node), []).append(_Carried(where, group, node))
    for key, child in _children(node) or ():
      walk(child, (*path, key), (*place, key), group)

  walk(tree, (), (), "")
  return found


_NOT_CARRIED_AS_OF_ITS_TYPE = (
  *_CLOCKED,
  *_COUNTING,
  *_SCOPES,
  *_GATES,
  *_CARRIED_WHOLE,
  LowPrecisionState,
  optax.contrib.GaLoreState,
  optax.contrib.ScheduleFreeState,
  optax.LookaheadState,
  AdamaxState,
  StackedParams,
)
"""State types the walks treat apart (clocks, scopes, guards, storage, the params a
conversion gives, a stacked layout's buffers), never carried as states of their type
(`_same_type_states`)."""


def _of_its_type(node: Any, converters: Mapping[type, StateConverter]) -> bool:
  """Whether `node` is a state that no converter reads or writes and that goes over as it
  is into the target's one state of its type (`_same_type_states`): a NamedTuple or
  dataclass holding per-param arrays, and no other state but records of scalars (a line
  search's ``info``) and states of this kind in fields of their own (Sophia's Hessian
  estimator's); not a state of `_NOT_CARRIED_AS_OF_ITS_TYPE`, nor an
  ``inject_hyperparams`` state."""
  if not (is_namedtuple(node) or dataclasses.is_dataclass(node)) or _is_quantized(node):
    return False
  if isinstance(node, _NOT_CARRIED_AS_OF_ITS_TYPE) or _injects_hyperparams(node):
    return False
  if _converter(node, converters) is not None or not _has_tensors(node):
    return False
  return all(
    not (_has_state_nodes(child, encoded=True) and _has_tensors(child))
    or (
      (is_namedtuple(child) or dataclasses.is_dataclass(child)) and _of_its_type(child, converters)
    )
    for _, child in _children(node)
  )


def _same_type_states(tree: Any, params: Mapping[str, Any]) -> dict[type, list[_Carried]]:
  """Every state of `tree` that `_of_its_type` carries, the outermost, by type; each
  `_Carried` with its node as `tree` holds it (encoded inside a `LowPrecisionState`) and,
  as its group, the params it holds (`_params_in`), one a line.

  Such a state holds what no moments express (L-BFGS's memory of updates, MADGRAD's sum
  of gradients, COCOB's wealth, adabelief's moments): where the source and the target
  each hold one state of its type over the same params, in the same shapes, wherever it
  sits (a chain's other place, another `MultiOptimizer` group, another storage), the
  target's goes on from the source's as it is, its count too, and its settings and clocks
  (`_UNREPORTED_SCALARS`) are the target's."""
  converters = registered_converters()
  found: dict[type, list[_Carried]] = {}

  def walk(node: Any, path: tuple[str, ...]) -> None:
    if isinstance(node, LowPrecisionState):
      walk(node.inner_state, (*path, "inner_state"))
      return
    if _of_its_type(node, converters):
      where, held = "/".join(path) or "<root>", "\n".join(sorted(_params_in(node, params)))
      found.setdefault(type(node), []).append(_Carried(where, held, node))
      return
    if _converter(node, converters) is not None or _is_quantized(node):
      return  # Read and written by its converter, or refused.
    for key, child in _children(node) or ():
      walk(child, (*path, key))

  walk(tree, ())
  return found


def _twin_key(node: Any, chain: tuple, params: Mapping[str, Any]) -> tuple[Any, ...] | None:
  """What a source's and a target's state with a converter share when the target's may go on
  from the source's as it is (`_converted_states`): its type, the params it holds, and the
  types of the states before it in its chain (lars's trace sums updates its trust ratio
  scaled, SGD's the gradients); None for a state of no param's arrays."""
  held = frozenset(_params_in(node, params))
  if not held or not _has_tensors(node):
    return None
  return type(node), held, tuple(type(state) for state in chain)


def _converted_states(
  tree: Any, params: Mapping[str, Any], adamax: frozenset[tuple[str, ...]]
) -> dict[tuple[Any, ...], list[str]]:
  """The paths of the states of `tree` that a converter reads or writes (as the conversion's
  walks reach them), by `_twin_key`."""
  converters = registered_converters()
  found: dict[tuple[Any, ...], list[str]] = {}

  def walk(node: Any, path: tuple[str, ...], chain: tuple) -> None:
    if isinstance(node, LowPrecisionState):
      walk(node.inner_state, (*path, "inner_state"), chain)
      return
    if path in adamax:
      node = AdamaxState(*node)
    if _converter(node, converters) is not None:
      key = _twin_key(node, chain, params)
      if key is not None:
        found.setdefault(key, []).append("/".join(path) or "<root>")
      return
    children = _children(node) or []
    for i, (key, child) in enumerate(children):
      walk(child, (*path, key), _chained(node, children, i))

  walk(tree, (), ())
  return found


def _same_settings(old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
  """Whether two records of settings name the same ones, each `same_setting` on both sides."""
  return old.keys() == new.keys() and all(same_setting(old[name], new[name]) for name in old)


def _as_it_was(node: Any, old: Any) -> Any:
  """A target's state `node` with the fields of the source's state `old` of its type (placed
  as the template's with the rest of the written state); its clocks and settings
  (`_UNREPORTED_SCALARS`) and the fields a conversion never carries (`_FRESH_FIELDS`) stay the
  node's."""
  children = []
  for (key, child), (_, value) in zip(_children(node), _children(old), strict=True):
    ours = (type(node), key) in _UNREPORTED_SCALARS or (type(node), key) in _FRESH_FIELDS
    children.append(child if ours else jax.tree.map_with_path(_fitting(node, key), value, child))
  return _rebuild(node, children)


def _fitting(node: Any, key: str) -> Callable[[Any, Any, Any], Any]:
  """Gives a value of field `key` of `node`'s type for the new state's leaf, refusing one
  beyond that leaf's range (7e4 into float16), naming the field and leaf."""

  def fit(path: Any, value: Any, like: Any) -> Any:
    problem = _state_dict.range_problem(value, getattr(like, "dtype", None))
    if problem is not None:
      raise ValueError(
        f"{type(node).__name__}.{key}{jax.tree_util.keystr(path)} does not fit the new "
        f"state: {problem}."
      )
    return value

  return fit


def _shaped_alike(old: Any, new: Any) -> bool:
  """Whether two states have one structure and leaves of the same shapes."""
  if jax.tree.structure(old) != jax.tree.structure(new):
    return False
  shapes = [jnp.shape(leaf) for leaf in jax.tree.leaves(old)]
  return shapes == [jnp.shape(leaf) for leaf in jax.tree.leaves(new)]


def _read_source(
  param_states: Any,
  step: Any,
  params: Mapping[str, Any],
  hparams: ReadHparams,
  adamax: frozenset[tuple[str, ...]],
  axes: Mapping[str, tuple[Any, ...] | None],
) -> _Source:
  source = _Source()
  converters = registered_converters()
  of_its_type = _same_type_states(param_states, params)
  carried = {state.where for states in of_its_type.values() for state in states}
  decoded: dict[str, Any] = {}

  def visit(
    node: Any,
    path: tuple[str, ...],
    hparams: ReadHparams,
    chain: tuple,
    clock: Any,
    set_at: str,
    projected: frozenset[str] = frozenset(),
  ) -> None:
    where = "/".join(path) or "<root>"
    if isinstance(node, LowPrecisionState):
      inner = low_precision_to_float32(node)
      visit(inner, (*path, "inner_state"), hparams, chain, node.count, where, projected)
      return
    if path in adamax:
      node = AdamaxState(*node)
    converter = _converter(node, converters)
    if converter is not None or _is_quantized(node):
      _refuse_quantized(node, path, "source")
    if converter is not None and converter.read is not None:
      own = _own_param(node, converter, path, params)
      noting, noted = hparams.noting()
      ctx = ConversionContext(where, clock, params, noting, own, chain, axes)
      read = converter.read(node, ctx)
      source.read_nodes[where] = _Read(node, clock, noted)
      if "unread" in read:
        source.dropped_with[where] = [f"{where} ({_type_label(node)}: {read['unread']})"]
        source.dropped += source.dropped_with[where]
        return
      source.dropped_with[where] = [
        f"{where}/{field} ({_type_label(node)}.{field})" for field in read.get("unread_fields", ())
      ]
      source.dropped += source.dropped_with[where]
      for quantity, tree in read.items():
        if quantity in ("count", "unread_fields"):
          continue
        values = {own: tree} if own else by_param(tree)
        kept = sorted(param for param in values if param in projected)
        if kept:
          source.dropped.append(
            f"{where} ({_type_label(node)}): {quantity} of {len(kept)} params {PROJECTED} "
            f"(e.g. {kept[0]})"
          )
        for param, value in values.items():
          if param in projected:
            continue
          entry = source.stats.setdefault(param, {})
          if quantity in entry:
            raise ValueError(
              f"Param '{param}' has a {quantity} in two source states: "
              f"'{source.origin[(param, quantity)]}' and '{where}' ({_type_label(node)}); "
              "the conversion would have to choose."
            )
          entry[quantity] = value
          entry.setdefault("count", _count_of(node, clock))
          source.applied.setdefault(param, _Applied(clock, set_at))
          source.origin[(param, quantity)] = f"{where} ({_type_label(node)})"
      return
    loose = _loose_arrays(node, where)
    if loose is not None:
      source.dropped.append(loose)
      return
    children = _children(node)
    if children is None:
      return
    hparams = _node_hparams(node, hparams)
    clock = _clock_of(node, clock)
    if isinstance(node, _CLOCKED):
      set_at = where
    if isinstance(node, _COUNTING):
      key = _counting_key(node, params)
      source.clocks.setdefault(key, []).append(clock)
      source.placed[where] = (key, clock)
    if isinstance(node, optax.contrib.GaLoreState):
      projected = galore_projected(node)
    before = len(source.dropped)
    for i, (key, child) in enumerate(children):
      if (
        (is_namedtuple(node) or dataclasses.is_dataclass(node))
        and not _has_state_nodes(child)
        and (_has_tensors(child) or _unset_scalars(node, key, child))
      ):
        source.dropped.append(f"{'/'.join((*path, key))} ({type(node).__name__}.{key})")
        continue
      chained = _chained(node, children, i)
      visit(child, (*path, key), hparams, chained, clock, set_at, projected)
    if where in carried:
      decoded[where] = node
      source.dropped_with[where] = source.dropped[before:]

  visit(param_states, (), hparams, (), step, "")
  source.twins = _converted_states(param_states, params, adamax)
  source.guards = _carried_whole(param_states)
  source.of_its_type = {
    kind: [
      dataclasses.replace(state, node=decoded[state.where])
      for state in states
      if state.where in decoded  # a state the visit did not reach is not read, nor carried
    ]
    for kind, states in of_its_type.items()
  }
  return source


def _type_label(node: Any) -> str:
  """A state node's type as the report names it: adamax's state, read and written as
  `AdamaxState`, is the ``optax.ScaleByAdamState`` it is stored as."""
  return "ScaleByAdamState of adamax" if isinstance(node, AdamaxState) else type(node).__name__


def _fields(node: Any) -> tuple[str, ...]:
  if is_namedtuple(node):
    return tuple(node._fields)
  if dataclasses.is_dataclass(node) and not isinstance(node, type):
    return tuple(f.name for f in dataclasses.fields(node))
  return ()


def _converter(node: Any, converters: Mapping[type, StateConverter]) -> StateConverter | None:
  """The converter registered for `node`'s type; T5X's legacy Adafactor param state by its fields.

  T5X's own ``_AdafactorParamState`` (a dataclass of ``v_row``, ``v_col``,
  ``v``, ``m``) cannot be imported here; it converts as `T5XAdafactorParamState`.
  """
  found = converters.get(type(node))
  if found is None and _fields(node) == T5XAdafactorParamState._fields:
    found = converters.get(T5XAdafactorParamState)
  return found


def _own_param(
  node: Any, converter: StateConverter, path: tuple[str, ...], params: Mapping[str, Any]
) -> str | None:
  """The param a ``per_param`` node holds the state of (None for other nodes)."""
  if not converter.per_param:
    return None
  own = _param_suffix(path, params)
  if own is None:
    raise ValueError(
      f"The {type(node).__name__} at '{'/'.join(path) or '<root>'}' is the state of no param: "
      f"no suffix of its path is one of the params {sorted(params)}."
    )
  return own


def _without_agreed(
  source: Mapping[str, Any], target: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
  """Both sides' hyper-parameters without the names both give as equal `SeveralValues` that
  do not say which value is whose (`SeveralValues.at`): each state reads the same value on
  both sides, so leaving them to optax's default on both keeps what the value would keep (an
  optimizer converted into itself goes over as it is)."""
  agreed = {
    name
    for name, value in source.items()
    if isinstance(value, SeveralValues) and not value.at and target.get(name) == value
  }
  return (
    {name: value for name, value in source.items() if name not in agreed},
    {name: value for name, value in target.items() if name not in agreed},
  )


def _refuse_unread(given: Mapping[str, ReadHparams]) -> None:
  """Refuses hyper-parameter names that no converter read and no built-in one reads (a
  mistyped ``beta_1`` would leave its converter on optax's default)."""
  problems = []
  for side, hparams in given.items():
    unknown = sorted(set(hparams) - hparams.read - BUILTIN_HPARAMS)
    if unknown:
      problems.append(f"{side} {', '.join(map(repr, unknown))}")
  if problems:
    raise ValueError(
      f"convert_state: {'; '.join(problems)} read by no converter; the built-in converters "
      f"read {', '.join(sorted(BUILTIN_HPARAMS))}, and a registered one reads the names it "
      "asks its ConversionContext for."
    )


def _node_hparams(node: Any, hparams: ReadHparams) -> ReadHparams:
  """`hparams` updated with those `node` sets for the states under it.

  An ``inject_hyperparams`` state's (its values rule, Muon's ``adam_b2`` as
  ``b2``: `HPARAM_ALIASES`), recognised by structure: a NamedTuple with a
  mapping ``hyperparams`` and an ``inner_state``. Under a schedule-free
  state, an RMS state with a count is ``schedule_free_adamw``'s
  ``scale_by_rms(decay=b2, bias_correction=True)``: there ``decay`` is
  ``b2`` (optax's 0.999) unless ``decay`` is given.
  """
  if (
    isinstance(node, optax.contrib.ScheduleFreeState)
    and not hparams.has("decay")
    and any(
      isinstance(s, RMS_WITH_COUNT)
      for s in jax.tree.leaves(
        node.base_optimizer_state, is_leaf=lambda x: isinstance(x, RMS_WITH_COUNT)
      )
    )
  ):
    b2 = hparams.get("b2", 0.999)
    if isinstance(b2, SeveralValues):
      b2 = dataclasses.replace(b2, name="b2")
    return hparams.updated({"decay": b2})
  if not _injects_hyperparams(node):
    return hparams
  injected = {name: host_scalar(value) for name, value in node.hyperparams.items()}
  for alias, name in HPARAM_ALIASES.items():
    if alias in injected and name not in injected:
      injected[name] = injected[alias]
  return hparams.updated(injected)


def _chained(node: Any, children: list[tuple[str, Any]], i: int) -> tuple[Any, ...]:
  """The states before child `i` of a ``chain`` state (a plain tuple), else ()."""
  if isinstance(node, tuple) and not is_namedtuple(node):
    return tuple(child for _, child in children[:i])
  return ()


def _is_integer_scalar(value: Any) -> bool:
  return (
    isinstance(value, jax.Array | np.ndarray | np.generic)
    and value.ndim == 0
    and jnp.issubdtype(value.dtype, jnp.integer)
  )


def _count_of(node: Any, clock: Any) -> Any:
  """A node's own step count (``count``, ``t``), or its clock."""
  for name in ("count", "t"):
    value = state_field(node, name, None)
    if value is not None and jnp.ndim(value) == 0:
      return value
  return clock


@dataclasses.dataclass
class _Field:
  """One written field's params: converted (with the quantities each was written from), kept
  fresh for want of a source value, and kept fresh by its converter's design."""

  filled: list[tuple[str, tuple[str, ...]]] = dataclasses.field(default_factory=list)
  lacking: list[str] = dataclasses.field(default_factory=list)
  by_design: list[str] = dataclasses.field(default_factory=list)


class _Recorder:
  """Collects what `Moments` records, per written field."""

  def __init__(self) -> None:
    self.fields: dict[str, _Field] = {}

  def record(self, where: str) -> Callable[[str, str, tuple[str, ...], bool], None]:
    def add(field: str, param: str, quantities: tuple[str, ...], by_design: bool) -> None:
      record = self.fields.setdefault(f"{where}.{field}", _Field())
      if quantities:
        record.filled.append((param, quantities))
      else:
        (record.by_design if by_design else record.lacking).append(param)

    return add

  def used(self) -> set[tuple[str, str]]:
    """Every ``(param, quantity)`` some field was written from."""
    return {
      (param, quantity)
      for record in self.fields.values()
      for param, quantities in record.filled
      for quantity in quantities
    }


def _flat_params(params: Any) -> dict[str, Any]:
  """`params`' leaves by the path the conversion keys them by (``layers_0/mlp/wi``)."""
  return {
    "/".join(map(str, path)): leaf
    for path, leaf in traverse_util.flatten_dict(serialization.to_state_dict(params)).items()
  }


def _held_params(params: Any) -> dict[str, tuple[str, ...]]:
  """Per stacked buffer's path (as `_flat_params` gives it), the paths of the params it
  holds; ``{}`` for params that are not stacked (each path is one param)."""
  if not isinstance(params, StackedParams):
    return {}
  layout = params.layout
  numbered = params.replace(buffers=tuple(range(len(layout.groups))))
  return {
    path: tuple(layout.paths[j] for j in layout.groups[i])
    for path, i in _flat_params(numbered).items()
  }


def _write_target(
  template: Any,
  source: _Source,
  step: Any,
  updates: Any,
  applied: Any,
  params: Mapping[str, Any],
  hparams: ReadHparams,
  missing: str,
  adamax: frozenset[tuple[str, ...]],
  held: Mapping[str, tuple[str, ...]],
  axes: Mapping[str, tuple[Any, ...] | None],
  continued: Sequence[_ScheduleFree],
  unmerged: Mapping[tuple[str, ...], str],
) -> tuple[Any, ConversionReport]:
  """`template` written from `source`, and the report; `step` is the optimizer's, `updates`
  the clock of the target's states, `applied` the updates the source applied
  (`_updates_applied`: where the source holds no moments for the params of a new
  ``MultiSteps`` or ``apply_if_finite``, its inner states go on from these); `held` names the params
  a stacked buffer's path holds, so that the report counts and names params; `axes` are the
  params' logical axes (`ConversionContext.axes`); `continued` are the target's schedule-free
  states that go on from the source's, `unmerged` why others do not, by path
  (`_schedule_free_continued`)."""
  converters = registered_converters()
  recorder = _Recorder()
  no_converter: list[str] = []
  fresh: list[str] = []
  counts = Moments(source.stats, lambda field, param, quantities, by_design: None)
  schedules = hparams.schedules()
  targets = _carried_whole(template)
  of_its_type = _same_type_states(template, params)
  twins = _converted_states(template, params, adamax)
  carried_origins: set[str] = set()
  counting = _counting_places(template, params)
  carried: list[str] = []
  carried_from: list[str] = []

  def carry(node: Any, where: str) -> Any:
    """`node` with its `_CARRIED_WHOLE` fields from the source's one state of its type,
    where each side holds one, in the same sub-optimizer (or in none)."""
    fields, what = _CARRIED_WHOLE[type(node)]
    sources, mine = source.guards.get(type(node), []), targets[type(node)]
    label = f"{where} ({type(node).__name__})"
    if len(sources) == 1 and len(mine) == 1 and sources[0].group == mine[0].group:
      old = sources[0]
    elif sources:
      held = [f"{n} state{'s' * (n != 1)}" for n in (len(sources), len(mine))]
      fresh.append(
        f"{label}: {what} at the initial value (of its type, the old optimizer holds "
        f"{held[0]} and the new one {held[1]}, or they are in other sub-optimizers: "
        "which was whose is not known)"
      )
      return node
    else:
      fresh.append(f"{label}: {what} at the initial value (the old optimizer holds none)")
      return node
    carried.append(f"{label}: {', '.join(fields)}, from {old.where}")
    return node._replace(**{f: _placed(getattr(old.node, f), getattr(node, f)) for f in fields})

  def carry_of_its_type(node: Any, where: str) -> Any | None:
    """`node` as the source's one state of its type (`_same_type_states`), or None."""
    [mine] = [state for state in of_its_type[type(node)] if state.where == where]
    sources = [s for s in source.of_its_type.get(type(node), []) if s.group == mine.group]
    twins = [state for state in of_its_type[type(node)] if state.group == mine.group]
    if len(sources) != 1 or len(twins) != 1 or not _shaped_alike(sources[0].node, node):
      return None
    old = sources[0]
    label = f"{where} ({type(node).__name__})"
    carried.append(f"{label}: as it is, from {old.where}, a state of its type")
    carried_from.append(old.where)
    return _as_it_was(node, old.node)

  def twin_of(node: Any, where: str, chain: tuple) -> str | None:
    """The path of the source's one state that the target's `node` may go on from as it is
    (`_twin_key`), where each side holds one such state; else None."""
    key = _twin_key(node, chain, params)
    if key is None or twins.get(key) != [where] or len(source.twins.get(key, ())) != 1:
      return None
    [old] = source.twins[key]
    found = source.read_nodes.get(old)
    return old if found is not None and _shaped_alike(found.node, node) else None

  def visit(
    node: Any,
    path: tuple[str, ...],
    hparams: ReadHparams,
    chain: tuple,
    clock: Any,
    projected: frozenset[str] = frozenset(),
  ) -> Any:
    if isinstance(node, LowPrecisionState):
      decoded = low_precision_to_float32(node)
      inner = visit(decoded, (*path, "inner_state"), hparams, chain, clock, projected)
      # Encoded where the template lives: the source's arrays may sit on other devices.
      inner = jax.tree.map(_placed, inner, decoded)
      return float32_to_low_precision(inner, node.replace(count=_placed(clock, node.count)))
    if path in adamax:
      node = AdamaxState(*node)
    converter = _converter(node, converters)
    where = "/".join(path) or "<root>"
    if converter is not None or _is_quantized(node):
      _refuse_quantized(node, path, "target")
    if converter is not None:
      if converter.write is None:
        no_converter.append(
          f"{where} ({_type_label(node)}: its converter only reads): no converter"
        )
        return node
      label = f"{where} ({_type_label(node)})"
      own = _own_param(node, converter, path, params)
      noting, noted = hparams.noting()
      ctx = ConversionContext(where, clock, params, noting, own, chain, axes)
      trial = _Recorder()
      moments = Moments(source.stats, trial.record(label), projected=projected)
      written = converter.write(node, moments, ctx)
      old = None if own or projected else twin_of(node, where, chain)
      if old is not None and _same_settings(
        {**source.read_nodes[old].hparams, "(clock)": source.read_nodes[old].clock},
        {**noted, "(clock)": clock},
      ):
        # Read and written with the same settings over the same clock: the source's state
        # as it is, which its converter's round trip gives to within an ulp, or not at all
        # where it cannot read or write some of it (a trace after another state, Adan's
        # gradient differences, AMSGrad's maximum).
        carried.append(f"{label}: as it is, from {old}, a state of its type")
        carried_from.append(old)
        carried_origins.add(f"{old} ({_type_label(source.read_nodes[old].node)})")
        written = _as_it_was(node, source.read_nodes[old].node)
      else:
        recorder.fields.update(trial.fields)
      return optax.ScaleByAdamState(*written) if path in adamax else written
    loose = _loose_arrays(node, where)
    if loose is not None:
      no_converter.append(f"{loose}: no converter")
      return node
    counted = source.clock_for(where, *counting[where]) if where in counting else None
    node, clock = _with_clock(node, clock, counts, step, applied, counted)
    goes_on = next((state for state in continued if path == state.target_path), None)
    if goes_on is not None:
      node = _carry_schedule_free(node, goes_on)
      carried.append(goes_on.line())
    if isinstance(node, _SCOPES) and not _counts_apart(node):
      clock = _applied_to(_params_in(node, params), source.applied, clock)
    if type(node) in _CARRIED_WHOLE:
      node = carry(node, where)
    if any(state.where == where for state in of_its_type.get(type(node), ())):
      whole = carry_of_its_type(node, where)
      if whole is not None:
        return whole
    if isinstance(node, optax.ApplyIfFiniteState):
      held = dict.fromkeys(_params_in(node.inner_state, params), 0)
      let_through = jnp.maximum(clock - node.total_notfinite, 0)
      own = counted if counted is not None else jnp.minimum(let_through, applied)
      clock = counts.count(held, own)
    children = _children(node)
    if children is None:
      return node
    # A fresh state holds a schedule's value at step 0; one given is called at the step.
    hparams = _node_hparams(node, hparams).updated(schedules)
    if isinstance(node, optax.contrib.GaLoreState):
      projected = galore_projected(node)
    new = []
    for i, (key, child) in enumerate(children):
      state_node = is_namedtuple(node) or dataclasses.is_dataclass(node)
      label = f"{'/'.join((*path, key))} ({type(node).__name__}.{key})"
      if goes_on is not None and key in _SCHEDULE_FREE_HISTORY:
        new.append(child)
      elif state_node and key == "count" and _is_integer_scalar(child):
        new.append(child if type(node) in _EVENT_COUNTS else _as_count(clock, child))
      elif state_node and (type(node), key) in _FRESH_FIELDS and jax.tree.leaves(child):
        # Whole, whatever it holds (flax boxes of a boxed params' tree, too).
        fresh.append(f"{label}: at the initial value by design ({_FRESH_FIELDS[type(node), key]})")
        new.append(child)
      elif state_node and not _has_state_nodes(child) and _has_tensors(child):
        why = unmerged.get(path) if key == "z" else None
        no_converter.append(f"{label}: no converter" + ("" if why is None else f", {why}"))
        new.append(child)
      elif _unset_scalars(node, key, child):
        fresh.append(f"{label}: at the initial value (no converter sets it)")
        new.append(child)
      else:
        new.append(
          visit(child, (*path, key), hparams, _chained(node, children, i), clock, projected)
        )
    return _rebuild(node, new)

  written = visit(template, (), hparams, (), updates)
  converted, initialised, refused = [], [], []

  def count(paths: list[str]) -> int:
    return sum(len(held.get(path, (path,))) for path in paths)

  def kept(field: str, paths: list[str], how: str) -> str:
    return f"{field}: {count(paths)} params {how} (e.g. {held.get(paths[0], paths)[0]})"

  for field, record in recorder.fields.items():
    if record.filled:
      origins = sorted({source.origin[(p, q)] for p, qs in record.filled for q in qs})
      filled = count([param for param, _ in record.filled])
      converted.append(f"{field}: {filled} params, from {', '.join(origins)}")
    if record.lacking:
      refused.append(kept(field, record.lacking, "without a source value"))
      initialised.append(refused[-1])
    if record.by_design:
      initialised.append(kept(field, record.by_design, "at the initial value by design"))
  converted += carried
  refused += no_converter
  initialised += no_converter + fresh
  unused: dict[tuple[str, str], list[str]] = {}
  used = recorder.used()
  for param, entry in source.stats.items():
    for quantity in entry.keys() - {"count"}:
      if (param, quantity) not in used and source.origin[(param, quantity)] not in carried_origins:
        unused.setdefault((source.origin[(param, quantity)], quantity), []).append(param)
  gone = {line for where in carried_from for line in source.dropped_with[where]}
  dropped = [line for line in source.dropped if line not in gone] + [
    f"{origin}: {quantity} of {count(paths)} params, not used by the new optimizer "
    f"(e.g. {held.get(min(paths), (min(paths),))[0]})"
    for (origin, quantity), paths in sorted(unused.items())
  ]
  dropped += [
    f"{old.where} ({kind.__name__}): {_CARRIED_WHOLE[kind][1]}, not used by the new optimizer"
    for kind, states in source.guards.items()
    if kind not in targets
    for old in states
  ]
  report = ConversionReport(tuple(converted), tuple(initialised), tuple(dropped))
  if refused and missing == "raise":
    raise ValueError(
      "The new optimizer's state cannot be fully converted from the old one: "
      + "; ".join(refused)
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


def _state_paths(node: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
  """Every node of a state with its path, as the conversion walks it (low precision decoded)."""
  if isinstance(node, LowPrecisionState):
    yield from _state_paths(low_precision_to_float32(node), (*path, "inner_state"))
    return
  yield path, node
  for key, child in _children(node) or ():
    yield from _state_paths(child, (*path, key))


_PROBE_GRADIENTS = 256
"""The most gradients the adamax probe feeds a definition whose Adam state has not updated yet
(`optax.MultiSteps` updates its inner state every k-th gradient)."""


def _adam_states(param_states: Any) -> list[tuple[tuple[str, ...], optax.ScaleByAdamState]]:
  return [
    (path, node)
    for path, node in _state_paths(param_states)
    if isinstance(node, optax.ScaleByAdamState)
  ]


def _holds_adam_state(param_states: Any) -> bool:
  """Whether `param_states` holds `optax.ScaleByAdamState` anywhere (compressed leaves too)."""
  is_adam = lambda node: isinstance(node, optax.ScaleByAdamState)  # noqa: E731
  return any(map(is_adam, jax.tree.leaves(param_states, is_leaf=is_adam)))


def _adamax_paths(
  optimizer_def: OptimizerDef | None, params: Any, param_states: Any, side: str
) -> frozenset[tuple[str, ...]]:
  """The paths of the `optax.ScaleByAdamState` nodes in `param_states` that are adamax's.

  Adamax stores Adam's state type with a running maximum of ``|g|`` as its
  ``nu``. Updates of a copy of the params with two values per dimension, on
  gradients alternating 2e-3 and 3e-3 (small, for element-wise clipping),
  tell them apart: Adam's ``nu`` grows as ``g^2`` (ratio 2.25), adamax's as
  ``|g|`` (1.5); a scalar's one value is told by its size
  (`_adamax_ratio`). Only a ratio near 1.5 in every leaf marks a state as
  adamax's. The probe runs only where `param_states` (the `side`
  optimizer's) holds Adam's state type, with the extra arguments the update
  takes (`loss_extra_args` of a linear loss whose gradient is the probe's),
  and feeds the same gradient until every such state has updated once
  (``optax.MultiSteps`` updates its inner state every k-th gradient: at most
  `_PROBE_GRADIENTS`).

  Raises:
    ValueError: the definition's update does not run on the probe's gradients, so the states
      could not be told apart (each named, with the update's error).
  """
  if optimizer_def is None or not _holds_adam_state(param_states):
    return frozenset()
  # The probe's own values, computed now even where the conversion is traced (jax.jit).
  with jax.ensure_compile_time_eval():
    small = jax.tree.map(lambda p: jnp.zeros((2,) * jnp.ndim(p), jnp.float32), params)
    trained = trained_params(small)
    grads = jax.tree.map(
      lambda p: 1e-3 * (2.0 + jnp.arange(p.size, dtype=jnp.float32) % 2), trained
    )
    grads = jax.tree.map(lambda g, p: g.reshape(p.shape), grads, trained)

    def loss(params: Any) -> Any:  # linear, its gradient the probe's everywhere
      pairs = zip(jax.tree.leaves(grads), jax.tree.leaves(params), strict=False)
      return sum(jnp.vdot(g, p) for g, p in pairs)

    names = getattr(optimizer_def, "extra_arg_names", ())
    extra_args = loss_extra_args(names, loss(trained), grads, loss)
    try:
      # What the optimizer says of the copy (low_precision: nothing of leaves of two values
      # compressed) is not said of the caller's params.
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = optimizer_def.create(small).apply_gradient(grads, **extra_args)
        step = jax.jit(lambda opt: opt.apply_gradient(grads, **extra_args))
        for _ in range(_PROBE_GRADIENTS - 1):
          if all(int(node.count) > 0 for _, node in _adam_states(opt.state.param_states)):
            break
          opt = step(opt)
    except Exception as error:
      paths = ", ".join(
        f"{'/'.join(path) or '<root>'} (ScaleByAdamState)" for path, _ in _adam_states(param_states)
      )
      raise ValueError(
        f"Cannot convert the {side} optimizer's state at {paths}: adam and adamax both store "
        "optax.ScaleByAdamState (nu Adam's average of g^2 or adamax's maximum of |g|), told "
        "apart by updating a small copy of the params, and that update failed: "
        f"{type(error).__name__}: {error}"
      ) from error
  found = set()
  for path, node in _adam_states(opt.state.param_states):
    nus = [np.asarray(v).ravel() for v in jax.tree.leaves(node.nu)]
    ratios = [_adamax_ratio(v) for v in nus if v.size and v[0] > 0]
    if ratios and all(abs(ratio - 1.5) < 0.15 for ratio in ratios):
      found.add(path)
  return frozenset(found)


def _adamax_ratio(nu: np.ndarray) -> float:
  """The probe's ratio of the second to the first value of `nu` (1.5 for adamax's, 2.25 for
  Adam's). A one-value leaf (a scalar param) has only the first, from a gradient of 2e-3:
  adamax's is about 2e-3 (ratio taken as 1.5), Adam's at most (2e-3)^2 (taken as 2.25)."""
  if nu.size >= 2:
    return float(nu[1] / nu[0])
  return 1.5 if nu[0] > 1e-3 else 2.25


def schedule_free_evaluation_params(param_states: Any, params: Any) -> Any | None:
  """Schedule-free's evaluation params, or None where `param_states` is not schedule-free's.

  ``optax.contrib.schedule_free`` takes gradients at its params ``y`` and is
  evaluated at its average ``x = (y - (1 - b1) z) / b1``
  (``optax.contrib.schedule_free_eval_params``). A schedule-free state counts
  where its updates are the ones applied (`_applied_schedule_free`): the
  optimizer's whole state or the last of a chain's (``chain(clip_by_global_norm,
  schedule_free_adamw)``), also inside a transformation that wraps one
  optimizer and keeps its state as its own state's ``inner_state`` or
  ``inner_opt_state`` (`low_precision`, decoded only once found;
  ``optax.MultiSteps``, ``inject_hyperparams``, ``apply_if_finite``,
  ``optax.masked``), and in each part of ``optax.partition`` and each group of a
  `MultiOptimizer`. The params each holds (its ``z``'s, by path) are its ``x``;
  the others are as they are. None where there is none, or where a ``z`` is of
  no param of its path and shape (``optax.lookahead``'s two copies).

  Example:
    >>> import jax.numpy as jnp, optax
    >>> tx = optax.contrib.schedule_free_sgd(1.0, b1=0.5)
    >>> params = {'w': jnp.zeros(2)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({'w': jnp.ones(2)}, state, params)
    >>> schedule_free_evaluation_params(state, optax.apply_updates(params, updates))
    {'w': Array([-1., -1.], dtype=float32)}
    >>> clipped = optax.chain(optax.clip_by_global_norm(1.0), tx)
    >>> schedule_free_evaluation_params(clipped.init(params), params)
    {'w': Array([0., 0.], dtype=float32)}
    >>> from t5x_optim import low_precision
    >>> compressed = optax.chain(optax.clip_by_global_norm(1.0), low_precision(tx, 'bfloat16'))
    >>> schedule_free_evaluation_params(compressed.init(params), params)
    {'w': Array([0., 0.], dtype=float32)}
    >>> schedule_free_evaluation_params(optax.MultiSteps(tx, 2).init(params), params)
    {'w': Array([0., 0.], dtype=float32)}
    >>> part = optax.partition({'free': tx, 'sgd': optax.sgd(1.0)}, {'w': 'free', 'b': 'sgd'})
    >>> both = {'w': jnp.zeros(2), 'b': jnp.ones(1)}
    >>> updates, state = part.update({'w': jnp.ones(2), 'b': jnp.ones(1)}, part.init(both), both)
    >>> schedule_free_evaluation_params(state, optax.apply_updates(both, updates))
    {'b': Array([0.], dtype=float32), 'w': Array([-1., -1.], dtype=float32)}
    >>> schedule_free_evaluation_params(optax.sgd(1.0).init(params), params) is None
    True
  """
  evaluated = _evaluated(param_states, params)
  return None if evaluated is None else evaluated[0]


def _evaluated(param_states: Any, params: Any) -> tuple[Any, frozenset[str]] | None:
  """`schedule_free_evaluation_params`, and the paths of the params it evaluates at an
  ``x``."""
  # Told by its type, so that another optimizer's compressed state is not decoded.
  if not _applied_schedule_free(param_states):
    return None
  leaves = by_param(params)
  evaluated: set[str] = set()
  for state in _applied_schedule_free(low_precision_to_float32(param_states)):
    for at, z in by_param(state.z).items():
      if at not in leaves or at in evaluated or jnp.shape(leaves[at]) != jnp.shape(z):
        return None
      leaves[at] = optax.contrib.schedule_free_eval_params(state._replace(z=z), leaves[at])
      evaluated.add(at)
  if not evaluated:
    return None
  return jax.tree.unflatten(jax.tree.structure(params), leaves.values()), frozenset(evaluated)


def _applied_schedule_free(states: Any) -> list[Any]:
  """The schedule-free states in `states` whose updates are the ones applied to the params
  they hold (`_applied_schedule_free_at`)."""
  return [node for _, node in _applied_schedule_free_at(states)]


def _applied_schedule_free_at(
  states: Any, path: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], Any]]:
  """The schedule-free states in `states` whose updates are the ones applied to the params
  they hold, with their paths in the keys the conversion's walks name them by: the whole
  state, a chain's last (through the transformations that wrap one optimizer,
  `_WRAPPED_STATE_FIELDS`), each part of ``optax.partition`` and each group of a
  `MultiOptimizer` (a tuple of `OptimizerState`)."""
  if isinstance(states, optax.contrib.ScheduleFreeState):
    return [(path, states)]
  if isinstance(states, optax.transforms.PartitionState):
    return [
      found
      for key, part in states.inner_states.items()
      for found in _applied_schedule_free_at(part, (*path, "inner_states", str(key)))
    ]
  if type(states) is tuple and states and all(isinstance(s, OptimizerState) for s in states):
    return [
      found
      for i, group in enumerate(states)
      for found in _applied_schedule_free_at(group.param_states, (*path, str(i), "param_states"))
    ]
  if type(states) is tuple and states:
    return _applied_schedule_free_at(states[-1], (*path, str(len(states) - 1)))
  inner = next((f for f in _WRAPPED_STATE_FIELDS if hasattr(states, f)), None)
  if inner is None:
    return []
  return _applied_schedule_free_at(getattr(states, inner), (*path, inner))


_WRAPPED_STATE_FIELDS = ("inner_state", "inner_opt_state")
"""The fields in which a transformation that wraps one optimizer keeps that optimizer's state:
`LowPrecisionState`'s, optax's inject_hyperparams', apply_if_finite's, masked's and
conditionally_transform's ``inner_state``, ``optax.MultiSteps``' ``inner_opt_state``."""


_SCHEDULE_FREE_HISTORY = ("z", "weight_sum", "max_lr")
"""The fields of a schedule-free state that a schedule-free target goes on from: its ``z``
and the weights of its average so far (``b1`` is a setting, ``step_count`` a clock)."""


@dataclasses.dataclass(frozen=True)
class _ScheduleFree:
  """A target's schedule-free state and the source schedule-free states it goes on from:
  paths (`_applied_schedule_free_at`) and nodes, decoded; each of the target's params is held
  by one of `sources`, which may hold others too (a whole state split into groups) or be
  several (groups merged into one state, their averages weighted alike)."""

  target_path: tuple[str, ...]
  target: Any
  sources: tuple[tuple[tuple[str, ...], Any], ...]

  def line(self) -> str:
    where = "/".join(self.target_path) or "<root>"
    old = " and ".join("/".join(path) or "<root>" for path, _ in self.sources)
    return (
      f"{where} (ScheduleFreeState): {', '.join(_SCHEDULE_FREE_HISTORY[:-1])}, "
      f"{_SCHEDULE_FREE_HISTORY[-1]} and the params it takes gradients at (y), from {old}"
    )

  def held(self) -> set[str]:
    """The paths of the params it holds (the target's ``z``'s)."""
    return set(by_param(self.target.z))

  def source_at(self, path: str) -> tuple[Any, Any]:
    """The source state that holds the param at `path` (a path of `held`), and its ``z``."""
    return self._by_param[path]

  @functools.cached_property
  def _by_param(self) -> dict[str, tuple[Any, Any]]:
    return {at: (node, z) for _, node in self.sources for at, z in by_param(node.z).items()}

  def dropped(self) -> set[str]:
    """The sources' fields it carries, as the source's walk lists them (`_read_source`)."""
    return {
      f"{'/'.join((*path, key))} (ScheduleFreeState.{key})"
      for path, _ in self.sources
      for key in _SCHEDULE_FREE_HISTORY
    }


def _schedule_free_continued(
  source_states: Any, source_params: Any, target_states: Any, params: Any
) -> tuple[list[_ScheduleFree], dict[tuple[str, ...], str]]:
  """The target's schedule-free states that go on from the source's, and why each of those
  whose params the source's hold does not.

  Both sides' states are those applied (`_applied_schedule_free_at`), matched by the params
  their ``z``'s hold (path and shape): a target's goes on where each of its params is held by
  exactly one source state and by no other target state, whatever the layouts (the whole
  state, a partition's part, a `MultiOptimizer` group). Several sources merge only where
  their averages were weighted alike (equal ``weight_sum`` and ``max_lr``); otherwise the
  second value names them, by the target's path. None where a side has a ``z`` of no param of
  its path and shape (``optax.lookahead``'s)."""
  found = [
    [path for path, _ in _applied_schedule_free_at(states)]
    for states in (source_states, target_states)
  ]
  if not all(found):  # Told by type, so that neither side is decoded for nothing.
    return [], {}
  sides = []
  for states, over, paths in zip(
    (source_states, target_states), (source_params, params), found, strict=True
  ):
    shapes = {at: jnp.shape(leaf) for at, leaf in by_param(over).items()}
    holders: dict[str, list[tuple[tuple[str, ...], Any]]] = {}
    decoded = list(
      zip(paths, _applied_schedule_free(low_precision_to_float32(states)), strict=True)
    )
    for path, node in decoded:
      held = {at: jnp.shape(z) for at, z in by_param(node.z).items()}
      if not held or any(shapes.get(at) != shape for at, shape in held.items()):
        return [], {}
      for at in held:
        holders.setdefault(at, []).append((path, node))
    sides.append((holders, decoded))
  (source, sources), (target, targets) = sides
  continued, unmerged = [], {}
  for path, node in targets:
    held = by_param(node.z)
    if any(len(target[at]) != 1 or len(source.get(at, ())) != 1 for at in held):
      continue
    holding = {source[at][0][0] for at in held}
    old = [(at, n) for at, n in sources if at in holding]
    weights = [
      tuple(float(host_scalar(getattr(n, k))) for k in ("weight_sum", "max_lr")) for _, n in old
    ]
    if len(set(weights)) == 1:
      continued.append(_ScheduleFree(path, node, tuple(old)))
    else:
      unmerged[path] = "the old optimizer's schedule-free states over its params averaged with " + (
        "other weights, "
        + " and ".join(
          f"{'/'.join(at) or '<root>'} (weight_sum {w:g}, max_lr {m:g})"
          for (at, _), (w, m) in zip(old, weights, strict=True)
        )
      )
  return continued, unmerged


def _schedule_free_params(
  continued: Iterable[_ScheduleFree], source_params: Any, evaluated: Any
) -> Any:
  """The params schedule-free targets take gradients at, in `evaluated`'s structure, dtypes
  and shardings: for the params each target's state holds, the source's ``y`` where the
  ``b1`` of the target and of the source state holding the param are one, else ``b1 x + (1 -
  b1) z`` by the target's ``b1``, with `evaluated` the source's ``x`` and ``z`` the source's;
  the others as in `evaluated`."""
  leaves, y = by_param(evaluated), by_param(source_params)
  for state in continued:
    b1 = host_scalar(state.target.b1)
    for at, like in by_param(state.target.z).items():
      old, z = state.source_at(at)
      z, x = _placed(z, like), leaves[at]
      same = b1 == host_scalar(old.b1)
      leaves[at] = _placed(jnp.where(same, _placed(y[at], x), b1 * x + (1 - b1) * z), x)
  return jax.tree.unflatten(jax.tree.structure(evaluated), leaves.values())


def _carry_schedule_free(node: Any, continued: _ScheduleFree) -> Any:
  """A target's schedule-free `node` with its sources' `_SCHEDULE_FREE_HISTORY`: the ``z`` of
  each param from the source holding it, the weights from any (all are alike)."""
  z = [_placed(continued.source_at(at)[1], leaf) for at, leaf in by_param(node.z).items()]
  old = continued.sources[0][1]
  return node._replace(
    z=jax.tree.unflatten(jax.tree.structure(node.z), z),
    **{key: _placed(getattr(old, key), getattr(node, key)) for key in _SCHEDULE_FREE_HISTORY[1:]},
  )


def _evaluation_params(params: Any, param_states: Any) -> tuple[Any, frozenset[str]]:
  """Schedule-free's evaluation params (its average ``x``) where it is the source
  (`schedule_free_evaluation_params`), and the paths of the params at their ``x``; else
  `params` and none."""
  found = _evaluated(param_states, params)
  return (params, frozenset()) if found is None else found


def _evaluation_notes(params: Any, evaluated: frozenset[str]) -> tuple[str, ...]:
  """The report's line for the params at schedule-free's ``x`` (`_evaluation_params`), paths
  of `params`; none without any (``z`` is listed as dropped too)."""
  if not evaluated:
    return ()
  total = len(jax.tree.leaves(params))
  which = "" if len(evaluated) == total else f" for {len(evaluated)} of the {total} params"
  return (
    "target (optax.contrib.ScheduleFreeState): the new optimizer starts from schedule-free's "
    f"evaluation params x = (y - (1 - b1) z) / b1{which}, not the y it took gradients at",
  )


def _copies_for(params: Any, *, lookahead: bool) -> tuple[Any, tuple[str, ...]]:
  """`params` as a target trains them, two copies for `lookahead`, else one, and a report line
  for a copy left behind.

  ``optax.lookahead`` trains two copies (`optax.LookaheadParams`), every other
  optimizer one: a lookahead source gives its slow copy (the one lookahead
  evaluates), a lookahead target starts with both copies at the source's params.
  """
  two = isinstance(params, optax.LookaheadParams)
  if two and not lookahead:
    return params.slow, (
      "target/fast (optax.LookaheadParams.fast): the new optimizer trains one copy of the "
      "params, the slow one (lookahead's params for evaluation)",
    )
  if lookahead and not two:
    return optax.LookaheadParams.init_synced(params), ()
  return params, ()


def sharded_by_params(optimizer: Optimizer) -> Optimizer:
  """`optimizer`, an abstract one, with its state leaves placed as its params are.

  Where every param (``optimizer.target``) carries a `NamedSharding` of one
  mesh, each state leaf becomes a `jax.ShapeDtypeStruct` on that mesh with the
  spec its definition's `derive_logical_axes` gives it over the params' mesh
  specs (a moment shaped as its param is sharded as it is), the mesh axes its
  shape does not divide dropped; a leaf given no spec is replicated, without
  the definition's warning. Otherwise (params on several meshes, a definition
  without `derive_logical_axes` or whose fallback refuses a leaf) `optimizer`
  is returned as it is.
  """
  shardings = [getattr(leaf, "sharding", None) for leaf in jax.tree.leaves(optimizer.target)]
  if (
    not shardings
    or not all(isinstance(s, NamedSharding) for s in shardings)
    or len({s.mesh for s in shardings}) > 1
    or not hasattr(optimizer.optimizer_def, "derive_logical_axes")
  ):
    return optimizer
  mesh = shardings[0].mesh
  specs = jax.tree.map(lambda leaf: leaf.sharding.spec, optimizer.target)
  try:
    with warnings.catch_warnings():  # A leaf without a spec is replicated, as asked for none.
      warnings.simplefilter("ignore", UserWarning)
      axes = optimizer.optimizer_def.derive_logical_axes(optimizer, specs).state
  except ValueError:  # The definition's fallback refuses a leaf: placed as before.
    return optimizer

  def place(path: Any, spec: PartitionSpec | None, leaf: Any) -> jax.ShapeDtypeStruct:
    spec = fit_state_spec(
      key_path_str(path), spec, jnp.shape(leaf), mesh_shape=mesh.shape, axis=None
    )
    sharding = NamedSharding(mesh, spec or PartitionSpec())
    return jax.ShapeDtypeStruct(jnp.shape(leaf), leaf.dtype, sharding=sharding)

  state = jax.tree.map_with_path(place, axes, optimizer.state, is_leaf=is_spec_leaf)
  return optimizer.replace(state=state)


def fresh_state(optimizer_def: OptimizerDef, params: Any, like: Any) -> OptimizerState:
  """The definition's initial state for `params`, placed in `like`'s shardings if it has
  them; without `like`, placed by the params' shardings (`sharded_by_params`).

  Made under `jax.jit` with `like`'s shardings as its outputs', so a sharded leaf is never
  whole on one device. A leaf of `like` without a sharding is placed as jit places it; one
  on devices other than the params' (a step count on one device beside params on a mesh)
  is made replicated beside the params and then copied where `like` has it.
  """
  if like is None:
    abstract = jax.eval_shape(optimizer_def.init_state, params)
    like = sharded_by_params(Optimizer(optimizer_def, abstract, params)).state
  leaves, treedef = jax.tree.flatten(like)
  shardings = [getattr(leaf, "sharding", None) for leaf in leaves]
  placed = [s for s in shardings if s is not None]
  if not placed:
    return jax.jit(optimizer_def.init_state)(params)
  # One program places its outputs on the devices of its inputs.
  devices = {
    frozenset(s.device_set)
    for x in jax.tree.leaves(params)
    if (s := getattr(x, "sharding", None)) is not None
  }
  common = next((s for s in placed if s.device_set in devices), placed[0])
  odd = [s is not None and s.device_set != common.device_set for s in shardings]
  everywhere = (
    common if not isinstance(common, NamedSharding) else NamedSharding(common.mesh, PartitionSpec())
  )
  out = [everywhere if o else s for s, o in zip(shardings, odd, strict=True)]
  state = jax.tree.leaves(
    jax.jit(optimizer_def.init_state, out_shardings=treedef.unflatten(out))(params)
  )
  return treedef.unflatten(
    [_placed(x, leaf) if o else x for x, leaf, o in zip(state, leaves, odd, strict=True)]
  )


def _params_like(params: Any, like: Any) -> Any:
  """`params` in `like`'s structure (its containers: a dict or a FrozenDict), dtypes and
  shardings, matched by path.

  Raises:
    ValueError: a path one side has and the other lacks, or a shape that differs, named
      with both sides.
  """
  given = {key_path_str(path): leaf for path, leaf in jax.tree.flatten_with_path(params)[0]}
  wanted, treedef = jax.tree.flatten_with_path(like)
  names = [key_path_str(path) for path, _ in wanted]
  problems = [
    f"the {side} params have {path}, which the {other} do not"
    for side, other, have, lack in (
      ("source's", "target's", given, names),
      ("target's", "source's", names, given),
    )
    for path in sorted(set(have) - set(lack))
  ]
  problems += [
    f"{name}: the source's params have shape {tuple(jnp.shape(given[name]))}, the target's "
    f"{tuple(leaf.shape)}"
    for name, (_, leaf) in zip(names, wanted, strict=True)
    if name in given and tuple(jnp.shape(given[name])) != tuple(leaf.shape)
  ]
  problems += [
    f"{name}: the source's params hold {problem}"
    for name, (_, leaf) in zip(names, wanted, strict=True)
    if name in given
    and (problem := _state_dict.range_problem(given[name], getattr(leaf, "dtype", None)))
  ]
  if problems:
    raise ValueError(
      "The source's params do not fit the target optimizer's: " + "; ".join(problems) + "."
    )
  leaves = [_placed(given[name], leaf) for name, (_, leaf) in zip(names, wanted, strict=True)]
  return jax.tree.unflatten(treedef, leaves)


@functools.lru_cache(maxsize=64)
def _resharding(dtype: Any, sharding: jax.sharding.Sharding) -> Callable[[jax.Array], jax.Array]:
  """A jitted copy into `dtype` and `sharding`, on the devices (`jax.device_put` between
  two shardings of the same devices may go through the host)."""
  return jax.jit(functools.partial(jnp.array, dtype=dtype, copy=True), out_shardings=sharding)


def _placed(value: Any, like: Any) -> Any:
  """`value` as a new array in `like`'s dtype and sharding.

  Always a copy, so no two leaves of the result share a buffer (a jitted step
  that donates its state would otherwise donate one buffer twice).
  """
  sharding = getattr(like, "sharding", None)
  dtype = getattr(like, "dtype", None)
  if sharding is None:
    return jnp.array(value, dtype, copy=True)
  if not isinstance(value, jax.core.Tracer) and not np.size(value):
    # A jitted copy of a zero-size array into a sharding gives each device a shard of the
    # global shape (jax 0.10, CPU), which device_get and np.asarray then refuse.
    empty = np.zeros(np.shape(value), dtype)
    return jax.make_array_from_callback(empty.shape, sharding, lambda index: empty[index])
  concrete = isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer)
  if concrete and (
    not value.is_fully_addressable or value.sharding.device_set == sharding.device_set
  ):
    return _resharding(dtype, sharding)(value)
  if sharding.is_fully_addressable:
    return jax.device_put(jnp.array(value, dtype, copy=True), sharding)
  # A multi-process target: each process holds the whole value and places its own shards.
  local = np.asarray(value, dtype)
  return jax.make_array_from_callback(local.shape, sharding, lambda index: local[index])


def _axes_by_path(param_axes: Any) -> dict[str, tuple[Any, ...] | None]:
  """`param_axes` (a tree over the params, of the fast copy's for `optax.LookaheadParams`)
  as '/'-joined param path to a tuple of axis names, or None."""
  if param_axes is None:
    return {}
  specs = specs_by_path(trained_params(param_axes))
  return {path: None if spec is None else tuple(spec) for path, spec in specs.items()}


def _stacked(optimizer: Any) -> bool:
  return isinstance(optimizer, Optimizer) and isinstance(optimizer.target, StackedParams)


def _layout(optimizer: Any) -> StackedLayout | None:
  """How `optimizer` stacks its params; None where it keeps them per leaf."""
  return optimizer.target.layout if _stacked(optimizer) else None


@placed_as_target
def convert_state(
  source: Optimizer | Mapping[str, Any],
  target: Optimizer | OptimizerDef,
  *,
  source_def: OptimizerDef | None = None,
  source_hparams: Mapping[str, Any] | None = None,
  target_hparams: Mapping[str, Any] | None = None,
  missing: str = "raise",
  param_axes: Any = None,
) -> tuple[Optimizer, ConversionReport]:
  """Converts an optimizer's state into another optimizer's, over the same params.

  Every state node of the source with a registered converter is read into
  per-param moments (E[g] as ``mu``, E[g^2] as ``nu``, and their count);
  every node of the target's initial state with a converter is written from
  them. Nodes are found wherever they nest (``chain``,
  ``inject_hyperparams``, ``MultiSteps``, ``masked``, ``multi_transform``,
  ``MultiOptimizer``, ``low_precision``: its bfloat16, 8-bit and 4-bit leaves are
  decoded to float32 to be read and encoded again when written). Built in: Adam's state (adam, adamw, nadam, radam),
  adamax's (Adam's state type, told apart by updating a small copy of the params,
  inside ``MultiSteps`` too, with optax's extra arguments where the update takes
  them), AMSGrad, Adan, Lion, SGD's momentum trace, RMSProp, optax's Adafactor
  (factored or not, and its momentum: the ``EmaState`` after its
  ``FactoredState``) and T5X's legacy ``adafactor.Adafactor`` (its state
  dict's layout, or T5X's own param state class, matched by its fields);
  see the module docstring for the step-count rule and each converter for
  its formula. A state of another type (adabelief's, L-BFGS's, say) goes over
  as it is into the new optimizer's one state of its type over the same params
  in the same shapes; into another type it needs a registered converter.

  Args:
    source: the old optimizer, or its T5X-layout state dict (ours, or a T5X
      checkpoint's). A state dict is read with `source_def`, or without it
      when it has T5X's legacy Adafactor layout.
    target: the new optimizer: an `OptimizerDef`, whose state is placed by
      the source's param shardings (`sharded_by_params`), or an `Optimizer`
      (real or abstract, e.g. `jax.eval_shape` of ``create`` with sharded
      leaves) whose state structure, dtypes and shardings the result takes.
    source_def: the definition that wrote a state-dict `source`.
    source_hparams: hyper-parameters of the old optimizer that its state
      does not hold (defaults: optax's): ``b1``/``b2`` (Adam 0.9/0.999, Lion
      b2 0.99), ``momentum`` (SGD, 0.9), ``decay`` (RMSProp, 0.9),
      ``b1``/``b3`` (Adan 0.98/0.99); T5X's Adafactor momentum ``m`` is read
      only with ``learning_rate`` (the rate of its last steps, or a schedule,
      called at the step; also ``beta1`` 0.9, ``epsilon2`` 1e-3,
      ``multiply_by_parameter_scale`` True), optax Adafactor's only with
      ``learning_rate`` and ``momentum``. Values an ``inject_hyperparams``
      state holds override these for the states inside it. A name whose
      value differs between states (a `MultiOptimizer`'s groups' ``b2``) is
      given as `SeveralValues`: each state reads its own value where
      `SeveralValues.at` tells it, and a converter that would read it
      elsewhere is refused rather than given a guess.
    target_hparams: the same for the new optimizer.
    missing: ``"raise"`` (default) when some state of the new optimizer would
      keep its initial value (no source value for a param's moment, or a
      state type without a converter), naming each; ``"init"`` to let it
      start fresh. Either way the report lists what was initialised (with
      a field its converter keeps fresh by design, Adan's ``v``, which is
      not refused).
    param_axes: the params' logical axes, in any form `with_param_axes`
      takes but flax NNX's: a tree over the params of `PartitionSpec`s or
      tuples of names (`TrainState.params_axes`), params boxed by
      ``nn.with_logical_partitioning``, or T5X's ``params_axes`` collection
      (``AxisMetadata`` under ``<name>_axes`` keys, alone or as
      ``{'params_axes': collection}``); or None.
      T5X's legacy Adafactor state of a param, read or written, is factored
      over the dims T5X's ``standard_logical_factor_rules`` give its axes
      (a scanned ``('embed', 'layers', 'heads', 'kv')`` kernel: rows
      ``(0,)``, columns ``(2, 3)``); without them, over the one factoring
      its ``v_row`` and ``v_col`` shapes fit. A definition `target` that
      places its params by their axes (``set_param_axes``: Muon's, alone or
      in a `MultiOptimizer`) gets them on a copy, as `TrainState.create`
      gives them; without them it places them as it does without axes.

  Returns:
    ``(optimizer, report)``: the new optimizer with the source's params (in
    the target's containers, dtypes and shardings, matched by path) and
    step, and a `ConversionReport`. Every leaf is a new buffer (none the
    source's, no two one), so a jitted step may donate it. Between
    ``optax.lookahead`` (two copies of the params, `optax.LookaheadParams`)
    and another optimizer (either way, into an `Optimizer` or a definition),
    the params are the slow copy (the report's ``dropped`` names the fast
    one), or both copies are the source's params. A schedule-free source
    gives its evaluation params ``x`` (the report's ``dropped`` says so), but
    into schedule-free the params it took gradients at, ``y = b1 x + (1 - b1) z``
    by the target's ``b1`` (the source's ``y`` where ``b1`` is the same), with its
    ``z`` and averaging weights.
    Stacked params (`t5x_optim.stack_params`) with a definition `target` get
    the stacked layer its ``create`` would put around it; between an optimizer
    of stacked params and an `Optimizer` target of per-leaf ones (or back), or
    of params stacked in other buffers, the states are converted per leaf and
    the result has the target's layout.

  Raises:
    TypeError: `source` is neither an Optimizer nor a state dict; a flax
      ``nnx.State`` or ``nnx.Variable`` in `source`, `target` or
      `param_axes` (pass ``nnx.to_pure_dict`` dicts), naming its path.
    ValueError: a state dict that `source_def` does not fit (or, without
      it, that is not T5X's legacy Adafactor layout); source params that do
      not fit an `Optimizer` target's (a path one side lacks, or another
      shape: each named, with both sides); params or converted moments
      beyond a float16 or float8 target's range, naming the param (values
      traced under `jax.jit` are not checked); a param with the same
      moment in two source states; an 8-bit leaf outside a
      ``LowPrecisionState`` (naming its path); Adam's state type under an
      update that does not run on gradients and optax's extra arguments
      alone, so adamax's cannot be told from Adam's (naming its path); with
      ``missing="raise"``, anything the conversion would initialise; a
      ``source_hparams`` or ``target_hparams`` name that no converter read
      and none of `BUILTIN_HPARAMS` is (a typo: ``beta_1`` for ``b1``); T5X
      legacy Adafactor factors whose shapes fit several factorings of their
      param, and the param's axes (none given, or not of T5X's rules) choose
      none, naming the param and the factorings.

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
  check_missing(missing)
  for argument, tree in ("source", source), ("target", target), ("param_axes", param_axes):
    if isinstance(tree, Optimizer):
      argument, tree = f"{argument}.target", tree.target
    refuse(tree, argument, "convert_state")
  if param_axes is not None:
    param_axes = logical_axes_from(param_axes)
  if isinstance(target, Optimizer) and _layout(source) != _layout(target):
    # The sides stack their params otherwise (or one keeps them per leaf): converted per leaf,
    # as checkpoints hold both layouts, so params and moments are matched by path.
    converted, report = convert_state(
      per_leaf(source) if _stacked(source) else source,
      per_leaf(target) if _stacked(target) else target,
      source_def=source_def,
      source_hparams=source_hparams,
      target_hparams=target_hparams,
      missing=missing,
      param_axes=param_axes,
    )
    return (stacked_like(converted, target) if _stacked(target) else converted), report
  params, step, param_states = _source_parts(source, source_def)
  step = jnp.asarray(step).astype(jnp.int32)
  source_adamax = _adamax_paths(
    source.optimizer_def if isinstance(source, Optimizer) else source_def,
    params,
    param_states,
    "source",
  )
  source_params = params
  params, evaluated = _evaluation_params(params, param_states)
  notes: tuple[str, ...] = ()
  if isinstance(target, Optimizer):
    optimizer_def, like_params, like_state = target.optimizer_def, target.target, target.state
    params, copies = _copies_for(params, lookahead=isinstance(like_params, optax.LookaheadParams))
    notes += copies
    params = _params_like(params, like_params)
  else:
    optimizer_def, like_state = target, None
    params, copies = _copies_for(params, lookahead=trains_lookahead_params(target))
    notes += copies
    params = jax.tree.map(_placed, params, params)  # Each a new buffer, as the source's placed.
    if param_axes is not None:  # A definition that places its params by their axes: Muon's.
      optimizer_def = with_param_axes(target, param_axes)
    if isinstance(params, StackedParams):  # The stacked layer `create` puts around it.
      optimizer_def = jax.eval_shape(optimizer_def.create, params).optimizer_def
  template = fresh_state(optimizer_def, params, like_state)
  continued, unmerged = _schedule_free_continued(
    param_states, source_params, template.param_states, params
  )
  if continued:  # Schedule-free into schedule-free: from y, not x.
    params = _schedule_free_params(continued, source_params, params)
    evaluated -= {path for state in continued for path in state.held()}
  notes = _evaluation_notes(source_params, evaluated) + notes
  trained = trained_params(params)
  flat_params = _flat_params(trained)
  axes = _axes_by_path(param_axes)
  source_hparams, target_hparams = _without_agreed(source_hparams or {}, target_hparams or {})
  given = {
    "source_hparams": ReadHparams(source_hparams),
    "target_hparams": ReadHparams(target_hparams),
  }
  source_stats = _read_source(
    param_states,
    step,
    flat_params,
    given["source_hparams"],
    source_adamax,
    axes,
  )
  source_stats.dropped.extend(notes)
  carried_fields = {line for state in continued for line in state.dropped()}
  source_stats.dropped = [line for line in source_stats.dropped if line not in carried_fields]
  applied = _updates_applied(param_states, step)
  written, report = _write_target(
    template.param_states,
    source_stats,
    step,
    step
    if _counts_apart(template.param_states)
    else _applied_to(flat_params, source_stats.applied, applied),
    applied,
    flat_params,
    given["target_hparams"],
    missing,
    _adamax_paths(optimizer_def, params, template.param_states, "target"),
    _held_params(trained),
    axes,
    continued,
    unmerged,
  )
  _refuse_unread(given)
  written, carried = _carry_sync_count(param_states, written)
  if carried:
    report = dataclasses.replace(report, converted=(*report.converted, carried))
  written = jax.tree.map(_placed, written, template.param_states)
  state = OptimizerState(step=_placed(step, template.step), param_states=written)
  return Optimizer(optimizer_def=optimizer_def, state=state, target=params), report
