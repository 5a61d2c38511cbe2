"""Generic derivation of state specs by sharding-in-types.

docs/design.md, "Deriving state specs by sharding-in-types", says why this
works and where it stops.

The params are given to ``transformation.init`` as abstract arrays sharded over
an ``AbstractMesh`` whose axes are the logical names (size 1, Explicit), so
every state leaf comes back carrying its logical spec. Nothing is allocated.

Tracing ``init`` costs about 0.2 ms per param leaf. To keep large trees cheap,
``init`` is first traced on a *probe*: one param per distinct
``(shape, dtype, spec)``. The probe's state is expanded back to the full
param tree and accepted only if it reproduces the real state's structure and
every leaf's shape; otherwise (a transformation that looks at tree paths, a
mask or label tree, a wrapper expecting a particular params container) the
full tree is traced. The probe is a dict, so params in another container
(``optax.LookaheadParams``, whose ``init`` warns on anything else) are traced
whole from the start.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import optax
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec

from t5x_optim._axes import specs as specs_lib

_PROBE_KEY = "\x00t5x_optim_probe_{:07d}"


class GenericDerivationError(Exception):
  """Raised when tracing ``init`` cannot give specs for the given state."""


# An axis no spec names, sized to the caller's mesh: jax refuses an abstract mesh of
# another size inside ``jax.set_mesh`` or ``use_abstract_mesh``.
_SPARE_AXIS = "t5x_optim spare axis"


def _abstract_mesh(param_specs: Sequence[PartitionSpec | None]) -> AbstractMesh:
  """One axis of size 1 per logical name, and the spare axis sized to the caller's mesh."""
  names = sorted({n for s in set(param_specs) for n in specs_lib.spec_names(s)})
  sizes = [1] * len(names)
  ambient = jax.sharding.get_abstract_mesh()
  if not ambient.empty and ambient.size > 1:
    names, sizes = [*names, _SPARE_AXIS], [*sizes, ambient.size]
  return AbstractMesh(tuple(sizes), tuple(names), axis_types=(AxisType.Explicit,) * len(names))


def _leaf_class(leaf: Any, spec: PartitionSpec | None) -> tuple[Any, ...]:
  shape = specs_lib.leaf_shape(leaf)
  if spec is None or len(spec) > len(shape):
    spec = PartitionSpec()
  return shape, leaf.dtype, getattr(leaf, "weak_type", False), spec


def _sharded(cls: tuple[Any, ...], mesh: AbstractMesh) -> jax.ShapeDtypeStruct:
  shape, dtype, weak_type, spec = cls
  return jax.ShapeDtypeStruct(shape, dtype, weak_type=weak_type, sharding=NamedSharding(mesh, spec))


def _trace_init(
  transformation: optax.GradientTransformation, params: Any, mesh: AbstractMesh
) -> Any:
  """The abstract state ``init`` gives `params`, without ``init``'s warnings: they are about
  the params ``init`` is given, here stand-ins (the probe's one per class), and the state's
  own ``init`` gives them about the real params."""
  with jax.sharding.use_abstract_mesh(mesh), warnings.catch_warnings():
    warnings.simplefilter("ignore")
    return jax.eval_shape(transformation.init, params)


def _matching_specs(
  abstract_state: Any, state_def: jax.tree_util.PyTreeDef, state_shapes: Sequence[tuple[int, ...]]
) -> list[Any] | None:
  """Specs of ``abstract_state``'s leaves if its structure matches the real state.

  A leaf whose shape differs from the real one gets ``UNDERIVED`` (the
  fallback decides it), and only it: the other leaves keep their specs.
  Each spec names at most one logical axis per dimension
  (`specs_lib.one_name_per_dim`).
  """
  leaves, treedef = jax.tree.flatten(abstract_state)
  if treedef != state_def:
    return None
  specs: dict[int, PartitionSpec | None] = {}
  out: list[Any] = []
  for leaf, expected in zip(leaves, state_shapes):
    shape = specs_lib.leaf_shape(leaf)
    if shape != expected:
      out.append(specs_lib.UNDERIVED)
      continue
    if id(leaf) not in specs:
      spec = getattr(getattr(leaf, "sharding", None), "spec", None)
      specs[id(leaf)] = specs_lib.canonical(specs_lib.one_name_per_dim(spec), len(shape))
    out.append(specs[id(leaf)])
  return out


def _probe_specs(transformation, classes, class_of, params_def, mesh, state_def, state_shapes):
  """Specs from tracing ``init`` on one param per class, or None."""
  keys = [_PROBE_KEY.format(i) for i in range(len(classes))]
  key_set = set(keys)

  def is_probe(node: Any) -> bool:
    return type(node) is dict and node.keys() == key_set  # pylint: disable=unidiomatic-typecheck

  def expand(node: Any) -> Any:
    if is_probe(node):
      return params_def.unflatten([node[keys[c]] for c in class_of])
    return node

  probe = {k: _sharded(c, mesh) for k, c in zip(keys, classes)}
  try:
    probe_state = _trace_init(transformation, probe, mesh)
  except Exception:  # pylint: disable=broad-exception-caught
    # Any failure on the probe (e.g. init expects another params container)
    # only means the probe does not apply; the full trace decides.
    return None
  expanded = jax.tree.map(expand, probe_state, is_leaf=is_probe)
  found = _matching_specs(expanded, state_def, state_shapes)
  if found is None or any(s is specs_lib.UNDERIVED for s in found):
    return None  # Only an exact probe stands for the full trace.
  return found


def derive_generic(
  transformation: optax.GradientTransformation,
  param_leaves: Sequence[Any],
  params_def: jax.tree_util.PyTreeDef,
  param_specs: Sequence[PartitionSpec | None],
  state_def: jax.tree_util.PyTreeDef,
  state_shapes: Sequence[tuple[int, ...]],
) -> list[PartitionSpec | None]:
  """Canonical specs of every state leaf, by tracing ``transformation.init``.

  Args:
    transformation: the optax transformation whose state is described.
    param_leaves: flat params (arrays or ``jax.ShapeDtypeStruct``).
    params_def: the params' tree structure.
    param_specs: one logical spec (no repeated names) or None per param leaf.
    state_def: the structure of the real optimizer state.
    state_shapes: the shape of every leaf of the real optimizer state.

  Returns:
    one canonical spec (or None) per state leaf.

  Raises:
    GenericDerivationError: if ``init`` fails or its state does not match.

  >>> import jax.numpy as jnp
  >>> p = [jax.ShapeDtypeStruct((4, 8), jnp.float32)]
  >>> d = jax.tree.structure(optax.sgd(1.0, momentum=0.9).init(p))
  >>> derive_generic(optax.sgd(1.0, momentum=0.9), p, jax.tree.structure(p),
  ...                [PartitionSpec('embed', 'mlp')], d, [(4, 8)])
  [P('embed', 'mlp')]
  """
  mesh = _abstract_mesh(param_specs)
  leaf_classes = [_leaf_class(p, s) for p, s in zip(param_leaves, param_specs)]
  index: dict[tuple[Any, ...], int] = {}
  class_of = [index.setdefault(c, len(index)) for c in leaf_classes]
  if len(index) < len(class_of) and isinstance(params_def.unflatten(class_of), Mapping):
    found = _probe_specs(
      transformation, list(index), class_of, params_def, mesh, state_def, state_shapes
    )
    if found is not None:
      return found
  sharded = [_sharded(c, mesh) for c in leaf_classes]
  try:
    state = _trace_init(transformation, params_def.unflatten(sharded), mesh)
  except Exception as e:  # pylint: disable=broad-exception-caught
    raise GenericDerivationError(
      f"tracing transformation.init on abstract sharded params failed: {type(e).__name__}: {e}"
    ) from e
  found = _matching_specs(state, state_def, state_shapes)
  if found is None:
    raise GenericDerivationError(
      "transformation.init(params) does not produce a state with the "
      "structure and shapes of the given optax_state"
    )
  return found
