"""Registry of state rules: per-state-type overrides of derived specs."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping
from typing import Any

StateRule = Callable[[Any, Any, "StateRuleContext"], Any]
"""``rule(state, specs, context) -> specs`` for one state node.

``state`` is the node of the optimizer state (arrays or ShapeDtypeStructs),
``specs`` the specs derived so far for that node (same structure; leaves are
canonical ``PartitionSpec``s, None for replicated, or ``UNDERIVED``), and the
rule returns a tree of the node's structure with the specs to use (leaving
``UNDERIVED`` where it has none: the fallback policy then decides).
"""


@dataclasses.dataclass(frozen=True)
class StateRuleContext:
  """What a state rule may know about the params.

  Attributes:
    param_specs: the params' logical specs, one ``PartitionSpec`` or None per
      param (canonical when ``params`` is known: padded to the param's rank).
      Use ``is_leaf=lambda x: x is None or isinstance(x, PartitionSpec)``.
    params: the params (arrays or ``jax.ShapeDtypeStruct``) or None if the
      caller did not pass them.
  """

  param_specs: Any
  params: Any | None


@dataclasses.dataclass(frozen=True)
class RegisteredRule:
  """A registered state rule and what the fallback's message says about it.

  Attributes:
    rule: the rule, see ``StateRule``.
    underived_reason: why the leaves the rule leaves ``UNDERIVED`` have no
      spec, or None (the engine's generic "no spec could be derived").
  """

  rule: StateRule
  underived_reason: str | None = None


_LOCK = threading.Lock()
_RULES: dict[type, RegisteredRule] = {}


def register_state_rule(
  state_type: type,
  rule: StateRule,
  *,
  replace: bool = False,
  underived_reason: str | None = None,
) -> None:
  """Registers ``rule`` to override the specs derived for ``state_type`` nodes.

  Rules run after structural and generic derivation, innermost node first, and
  their output is validated like any derived spec.

  Args:
    state_type: the exact type of the state node (e.g. a NamedTuple class).
    rule: ``rule(state, specs, context) -> specs``, see ``StateRule``.
    replace: allow replacing a rule already registered for ``state_type``.
    underived_reason: why leaves the rule leaves ``UNDERIVED`` have no spec;
      it ends the message of the fallback policy (e.g. "K-FAC state leaves
      that match no single param dimension").

  Raises:
    TypeError: if ``state_type`` is not a type or ``rule`` is not callable.
    ValueError: if a rule for ``state_type`` exists and ``replace`` is False.

  Example::

    class MyState(NamedTuple):
      history: Any

    def my_rule(state, specs, context):
      return MyState(history=jax.tree.map(
          lambda s: None if s is None else PartitionSpec(None, *s),
          context.param_specs, is_leaf=lambda x: x is None
          or isinstance(x, PartitionSpec)))

    register_state_rule(MyState, my_rule)
  """
  if not isinstance(state_type, type):
    raise TypeError(f"state_type must be a type, got {state_type!r}")
  if not callable(rule):
    raise TypeError(f"rule must be callable, got {rule!r}")
  with _LOCK:
    if state_type in _RULES and not replace:
      raise ValueError(
        f"a state rule for {state_type.__module__}.{state_type.__qualname__}"
        " is already registered; pass replace=True to replace it"
      )
    _RULES[state_type] = RegisteredRule(rule, underived_reason)


def registered_rules() -> Mapping[type, RegisteredRule]:
  """A snapshot of the registered rules, keyed by state type."""
  with _LOCK:
    return dict(_RULES)
