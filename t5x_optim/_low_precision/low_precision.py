"""`low_precision`: any optax optimizer with its param-shaped state stored compressed.

Between steps, the param-shaped ("mirror") state leaves of the wrapped
transformation (adam's ``mu`` and ``nu``, sgd's ``trace``, ...) are stored in
one of three forms (the codecs are `t5x_optim._low_precision.quantize` and
`t5x_optim._low_precision.quantize4`); inside the update they are expanded
to float32, the wrapped update runs in float32 (its updates cast to the
dtypes it gives with its own state: bfloat16 for bfloat16 params' adam),
and its new state is compressed again, one param leaf at a time where the
update is elementwise per leaf (`_streamed_update`), so the step holds at
most a chunk of one leaf's float32 state rather than the whole tree's.

* ``"bfloat16"``: each float32 value is rounded to bfloat16. With
  ``stochastic_rounding=True`` (the default) the 16 dropped mantissa bits are
  rounded up with probability equal to their value, so the stored value is
  unbiased; the random bits hash the element's index with the seed, the step
  count and the leaf's index (`rounding_bits`), so a run is reproducible,
  sharded by `jax.jit` or not. Under a `jax.shard_map` around the update, a
  leaf that differs between shards hashes the shard's position too
  (`_rounding_bits`): shards draw uncorrelated bits, not the unsharded run's.
  ``stochastic_rounding=False`` rounds to nearest (a small ``nu`` update then
  rounds away: accumulation stalls). 2 bytes per value.
* ``"8bit"``: block-wise 8-bit quantization with the dynamic (nonlinear) maps
  of bitsandbytes (Dettmers et al., 2022), as torchao's 8-bit optimizers use
  them: each block of up to ``block_size`` consecutive elements along the *last*
  dimension is scaled by its absolute maximum, and each scaled value is
  stored as the index (``uint8``) of the nearest of 256 map values. A block
  with a negative value uses the signed map (sign, 7 decades of exponent);
  a block without uses the unsigned map, which spends the sign bit on
  precision: adam's ``mu`` gets the signed map and ``nu`` the unsigned one,
  as in bitsandbytes and torchao, with no per-optimizer table of names. The
  scale is stored negated for signed blocks. The codes have the param's shape
  and shard like it; the scales, shaped ``(*shape[:-1], shape[-1] // block)``,
  shard along the same dimensions. A leaf's block (`leaf_block`) is the
  largest that tiles the last dimension, is at most ``block_size`` and leaves
  a block count that the last dimension's shards divide (up to
  ``shard_multiple`` of them); below 4 values, the whole last dimension if
  it fits in ``block_size``, else none: the leaf stays float32 (a last
  dimension of 1, 257 or 4099 would cost 5 bytes per value). 1 + 4 / block
  bytes per value (1.016 for 256, at most 2). The codec never spreads a
  fault: an inf or NaN damages only its own element (inf saturates to its
  block's largest finite magnitude, NaN is stored as 0), and in a block
  without a negative value (adam's ``nu``) only 0 decodes as 0, so a small
  second moment beside a large one does not become 0 and turn adam's
  update into ``mu / eps``.
* ``"4bit"``: two codes per byte, after Li et al. (2023): blocks of up to
  ``block_size`` (128) values, an even run of the last dimension
  (`leaf_block4`) and, where that run is short, rows of the dimension
  before it (`leaf_block4_shape`); a
  block with a negative value uses a signed dynamic-exponent map, one
  without a linear map where only 0 decodes as 0, scaled in a matrix by
  ``min(block max, column max)`` (rank-1 normalization, the row's maximum
  narrowed to the block's). The codes (last dimension halved), scales and
  column maxima shard like the param.
  About 0.54 bytes per value on a large matrix; a leaf whose last dimension
  has no even block stays float32. The codec is
  `t5x_optim._low_precision.quantize4`; a mode of the table `_CODECS`, as
  8 bits is.

Leaves smaller than ``min_size`` elements, 8-bit and 4-bit leaves without a block,
leaves that are not param-shaped mirrors (adafactor's factored ``v_row``,
L-BFGS history), non-floating leaves and scalars stay as they are;
`leaf_storage` says why for each leaf, and
``t5x-optim plan`` shows it. ``states=`` (a regular expression on the state
path, e.g. ``'0/(mu|nu)/'``) restricts compression to matching leaves, and
refuses, naming the path, a matching leaf the mode does not apply to.
``param_modes=`` sets a mode per param, by a regular expression on its path
or, as ``axis:<regex>``, by its logical axes (``axis:vocab``: embeddings and
untied logits); those come from ``param_axes=`` or from T5X's
``set_param_axes`` on the optimizer definition built on the transformation
(`AxesAwareTransformation`).

The state is `LowPrecisionState` (an int32 ``count`` and the compressed
``inner_state``); in a T5X state dict an 8-bit leaf is two keys,
``inner_state/0/mu/dense/kernel/codes`` and ``.../scales`` (a 4-bit leaf
``.../cols`` too, with rank-1 scales), and a bfloat16 leaf
one, ``inner_state/0/mu/dense/kernel``.
`low_precision_to_float32` and `float32_to_low_precision` convert states
both ways, e.g. to restore into an optimizer without the wrapper and back.

Example:
  >>> import jax.numpy as jnp, optax
  >>> tx = low_precision(optax.adam(1e-3), "8bit", min_size=0)
  >>> params = {'w': jnp.ones((2, 256))}
  >>> state = tx.init(params)
  >>> updates, state = tx.update({'w': jnp.ones((2, 256))}, state, params)
  >>> state.inner_state[0].mu['w'].codes.dtype, state.inner_state[0].mu['w'].scales.shape
  (dtype('uint8'), (2, 8))
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.extend.core
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec

from t5x_optim._adapters.optax_wrapper import AxesAwareTransformation, checked_transformation
from t5x_optim._adapters.param_subsets import format_paths
from t5x_optim._axes import registry
from t5x_optim._axes import specs as specs_lib
from t5x_optim._axes.auto import auto_axes_call, auto_axes_like, explicit_mesh
from t5x_optim._axes.engine import holey_mirror, logical_axes_from, view_specs
from t5x_optim._axes.kernel_axes import axis_names, specs_by_path
from t5x_optim._axes.rules import drop_indivisible_axes, is_spec_leaf
from t5x_optim._core import state_dict as _state_dict
from t5x_optim._core.interface import trained_params
from t5x_optim._layouts.fused.analysis import (
  FusedPlan,
  NotFusible,
  eval_outside,
  plan_fused_update,
  split_extras,
)
from t5x_optim._layouts.fused.program import (
  Lit,
  Program,
  run_program,
  varying_axes,
  varying_over,
)
from t5x_optim._low_precision.quantize import (
  QuantizedLeaf,
  dequantize,
  dynamic_map,
  hashed_bits,
  leaf_block,
  leaf_key,
  leaf_rounding_bits,
  quantize,
  quantize_stats,
  rounding_bits,
  step_key,
  stored_shapes,
  to_bfloat16,
)
from t5x_optim._low_precision.quantize4 import (
  Quantized4Leaf,
  Rank1Quantized4Leaf,
  dequantize4,
  dequantize4_lane,
  leaf_block4,
  leaf_block4_shape,
  quantize4,
  quantize4_lanes,
  quantize4_stats,
  stored_shapes4,
  unpacked_shape,
  uses_rank1,
)
from t5x_optim._nnx import to_pure
from t5x_optim._warn import warn

__all__ = [
  "LOW_PRECISION_MODES",
  "QUANTIZED_LEAF_TYPES",
  "QUANTIZED_MODES",
  "LowPrecisionState",
  "Quantized4Leaf",
  "QuantizedLeaf",
  "Rank1Quantized4Leaf",
  "dynamic_map",
  "float32_to_low_precision",
  "leaf_block",
  "leaf_block4",
  "leaf_storage",
  "low_precision",
  "low_precision_sum_squares",
  "low_precision_to_float32",
  "quantized_mode",
  "rounding_bits",
]

_FLOAT32 = "float32"
_BF16 = "bfloat16"
_8BIT = "8bit"
_4BIT = "4bit"
_KEPT_SMALL = "float32: below min_size"
_KEPT_NO_BLOCK = "float32: no 8-bit block of 4 or more values tiles the last dimension"
_KEPT_NO_BLOCK4 = (
  "float32: no even 4-bit block of 4 or more values tiles the last dimension and its shards"
)
_KEPT_NOT_MIRROR = "kept: not param-shaped"
_KEPT_NOT_FLOAT = "kept: not floating"
_KEPT_PARAM_COPY = "kept: a copy of its param"
_KEPT_NOT_SELECTED = "kept: not selected by states="
_KEPT_0D = "float32: 0-d"
_KEPT_ACCUMULATOR = "float32: a gradient accumulator"


@dataclasses.dataclass(frozen=True)
class _KeptField:
  """Why the leaves of a state field are kept whatever their shape: their `leaf_storage`
  label, and the reason a ``states=`` refusal gives."""

  storage: str
  why: str


_KEPT_FIELDS = {
  (optax.contrib.GaLoreState, "projector"): _KeptField(
    "kept: GaLore projector (a basis, not a moment)",
    "it is GaLore's projector, an orthonormal basis it sets from the gradient every "
    "update_proj_gap steps, not a moment (at a rank of at least a kernel's smaller "
    "dimension it can have its param's shape)",
  ),
  **dict.fromkeys(
    [(optax.ScaleByLBFGSState, "params"), (optax.ScaleByLBFGSState, "updates")],
    _KeptField(
      "kept: L-BFGS's last params or updates (a curvature pair's end, not a moment)",
      "it is L-BFGS's last params or updates, which it subtracts from the next ones for its "
      "curvature pairs, not a moment (encoded, each difference is the codec's error)",
    ),
  ),
  (optax.contrib.MadgradState, "s"): _KeptField(
    "kept: MADGRAD's sum of gradients (the params' offset from x0, not a moment)",
    "it is MADGRAD's weighted sum of gradients, from which it sets the params as x0 minus "
    "it over the cube root of the summed squares, not a moment (encoded, its error is the "
    "params')",
  ),
  (optax.contrib.COCOBState, "reward"): _KeptField(
    "kept: COCOB's reward (the wealth it bets, not a moment)",
    "it is COCOB's reward, the wealth whose bet sets the params' offset from their start "
    "and which each step adds that offset's gain to, not a moment (encoded, its error is "
    "the params')",
  ),
  **dict.fromkeys(
    [
      (optax.ScaleByZoomLinesearchState, "grad"),
      (optax.ScaleByBacktrackingLinesearchState, "grad"),
    ],
    _KeptField(
      "kept: a line search's gradient (the next step's, not a moment)",
      "it is a line search's gradient at the new params, which "
      "optax.value_and_grad_from_state gives the next step as its gradient, not a moment",
    ),
  ),
}
"""State fields (by state type and field name) whose leaves no mode applies to, whatever
their shape, and why (`_kept_fields`)."""
_KEPT_FIELD_LABELS = frozenset(kept.storage for kept in _KEPT_FIELDS.values())
_BY_AXIS = "axis:"
"""The prefix of a ``param_modes`` pattern that selects params by logical axis."""
_SHARD_MULTIPLE = 8
"""`low_precision`'s default ``shard_multiple``; `low_precision_sum_squares` walks as many stripes."""
_COLUMN_CHUNKS = 16
"""The fewest chunks of rows whose statistics a leaf that stores column maxima (4-bit, rank 1)
computes apart, however small: XLA:CPU holds the input of a reduction over rows (the column
maxima) whole, here the chunk's new moments in float32, 8 bytes per value for Adam's two."""
_COLUMN_CHUNKS_MOST = 4 * _COLUMN_CHUNKS
"""The most chunks of rows the `_COLUMN_CHUNKS` floor walks in a leaf of at most
`_WHOLE_STATS_MOST` values: one whose rows divide only into more (a prime count) computes its
statistics whole (`_stats_split`)."""
_WHOLE_STATS_MOST = 1 << 17
"""The most values of a leaf whose statistics `_stats_split` computes whole rather than walk
more than `_COLUMN_CHUNKS_MOST` chunks of rows: 1 MiB of float32, for Adam's two moments."""


@struct.dataclass
class LowPrecisionState:
  """State of `low_precision`.

  Attributes:
    count: int32 steps taken (folded into the stochastic-rounding bits).
    inner_state: the wrapped transformation's state, each compressed leaf a
      bfloat16 array, a `QuantizedLeaf` (8 bits) or a `Quantized4Leaf` or
      `Rank1Quantized4Leaf` (4 bits).
    storage: static; for each leaf of the float32 inner state, how it is
      stored: ``"bfloat16"``, ``"8bit"``, ``"4bit"`` or why it is kept
      (`leaf_storage`).
    param_index: static; for each leaf of the float32 inner state, the index
      of the param it mirrors (in the params' leaf order) or -1.
    stochastic_rounding: static; bfloat16 leaves are rounded stochastically.
    seed: static; the seed of the stochastic-rounding bits.
    rules: static; for each leaf of the float32 inner state, the pattern of
      ``param_modes`` that set its mode (a path regex or ``axis:<regex>``), or
      "" (``state_dtype`` did).
    blocks: static; for each leaf of the float32 inner state, the block its
      quantized leaf is encoded in (None: not quantized), chosen by ``init``
      for the leaf's whole shape. A step keeps it; a shard of the leaf
      (under `jax.shard_map`) is encoded in it too.
  """

  count: Any
  inner_state: Any
  storage: tuple[str, ...] = struct.field(pytree_node=False, default=())
  param_index: tuple[int, ...] = struct.field(pytree_node=False, default=())
  stochastic_rounding: bool = struct.field(pytree_node=False, default=True)
  seed: int = struct.field(pytree_node=False, default=0)
  rules: tuple[str, ...] = struct.field(pytree_node=False, default=())
  blocks: tuple[Any, ...] = struct.field(pytree_node=False, default=())


def _is_quantized(x: Any) -> bool:
  return isinstance(x, QUANTIZED_LEAF_TYPES)


def quantized_mode(leaf: Any) -> str | None:
  """The quantized mode (``"8bit"``, ``"4bit"``) whose stored leaf ``leaf`` is, or None."""
  return next((mode for mode, c in _CODECS.items() if isinstance(leaf, c.leaf_types)), None)


def _is_masked(x: Any) -> bool:
  return isinstance(x, optax.MaskedNode)


@dataclasses.dataclass(frozen=True)
class _Codec:
  """A quantized mode of `low_precision`: how its leaves are planned, encoded and decoded.

  Attributes:
    leaf_types: the stored leaf classes (NamedTuples of arrays; their fields
      are the leaf's state-dict keys).
    leaf_block: ``(shape, block_size, shard_multiple)`` to a leaf's
      block, or None: the leaf stays float32 (``no_block`` says why).
    stored_shapes: ``(shape, block)`` to the shapes of the stored arrays of
      values of ``shape`` in ``block``, or None: the block does not tile it.
    block_size: the default largest block.
    no_block: the storage of a leaf without a block.
    stats: ``(x, block, guard, shape)`` to the block statistics of a new
      state leaf of ``shape``, or of ``x``, some of its rows (whole blocks),
      computed inside the streamed update's branch.
    encode: ``(x, block, guard, stats, flat)`` to the stored leaf.
    decode: ``(stored, flat)`` to the float32 values.
    shape: the float32 shape of a stored leaf.
    lanes: how many consecutive values of the last dimension a stored
      element (a byte of codes) holds: the streamed encoders compute the
      new values of each lane (columns ``q::lanes``) apart, so that they
      read the old codes at the index where they write the new ones and XLA
      writes them in place.
    decode_lane: ``(stored, q)`` to the float32 values of lane ``q``.
    encode_lanes: ``(xs, block, guard, stats)`` to the stored leaf of the
      values whose lanes are ``xs``.
  """

  leaf_types: tuple[type, ...]
  leaf_block: Callable[..., Any]
  stored_shapes: Callable[[tuple[int, ...], Any], tuple[tuple[int, ...], ...] | None]
  block_size: int
  no_block: str
  stats: Callable[[jax.Array, Any, bool, tuple[int, ...]], Any]
  encode: Callable[[jax.Array, int, bool, Any, bool], Any]
  decode: Callable[[Any, bool], jax.Array]
  shape: Callable[[Any], tuple[int, ...]]
  lanes: int
  decode_lane: Callable[[Any, int], jax.Array]
  encode_lanes: Callable[[Sequence[jax.Array], Any, bool, Any], Any]


def _stats4(x: jax.Array, block: Any, guard: bool, shape: tuple[int, ...]) -> Any:
  rank1 = uses_rank1(shape, block)
  return quantize4_stats(x, block, rank1=rank1, guard_nonfinite=guard)


def _encode4(x: jax.Array, block: int, guard: bool, stats: Any, flat: bool) -> Any:
  del flat  # 4-bit codes are packed: the encoder reads the leaf's own shape either way.
  rank1 = uses_rank1(jnp.shape(x), block)
  return quantize4(x, block, rank1=rank1, guard_nonfinite=guard, stats=stats)


_CODECS: dict[str, _Codec] = {
  _8BIT: _Codec(
    leaf_types=(QuantizedLeaf,),
    leaf_block=lambda shape, **kwargs: leaf_block(shape[-1], **kwargs),
    stored_shapes=stored_shapes,
    block_size=256,
    no_block=_KEPT_NO_BLOCK,
    stats=lambda x, block, guard, shape: quantize_stats(x, block, guard_nonfinite=guard),
    encode=lambda x, block, guard, stats, flat: quantize(
      x, block, guard_nonfinite=guard, stats=stats, flat=flat
    ),
    decode=lambda stored, flat: dequantize(stored, flat=flat),
    shape=lambda stored: tuple(jnp.shape(stored.codes)),
    lanes=1,
    decode_lane=lambda stored, lane: dequantize(stored, flat=True),
    encode_lanes=lambda xs, block, guard, stats: quantize(
      xs[0], block, guard_nonfinite=guard, stats=stats, flat=True
    ),
  ),
  _4BIT: _Codec(
    leaf_types=(Quantized4Leaf, Rank1Quantized4Leaf),
    leaf_block=leaf_block4_shape,
    stored_shapes=stored_shapes4,
    block_size=128,
    no_block=_KEPT_NO_BLOCK4,
    stats=_stats4,
    encode=_encode4,
    decode=lambda stored, flat: dequantize4(stored),
    shape=unpacked_shape,
    lanes=2,
    decode_lane=dequantize4_lane,
    encode_lanes=lambda xs, block, guard, stats: quantize4_lanes(tuple(xs), block, stats),
  ),
}
"""The quantized modes, by ``state_dtype``: each stores a leaf as a NamedTuple of arrays."""

LOW_PRECISION_MODES = (_BF16, *_CODECS)
"""The modes of `low_precision`'s ``state_dtype``."""

QUANTIZED_MODES = tuple(_CODECS)
"""The modes that store a leaf as several arrays (`leaf_storage`: ``"<mode> <field>"``)."""

QUANTIZED_LEAF_TYPES = tuple(t for codec in _CODECS.values() for t in codec.leaf_types)
"""The classes of the quantized modes' stored leaves."""


def _mirror_params(init: Callable[[Any], Any], inner_state: Any, params: Any) -> list[int]:
  """For each leaf of ``inner_state`` (``init(params)``), the index of the param it mirrors,
  or -1.

  A mirror is a subtree with the params' structure, where a ``MaskedNode``
  hole may stand for a param or a whole subtree of them (`optax.masked` with
  a mask that is a prefix of the params); its leaves mirror the params at
  the same positions. Every leaf has the structure of params that are one
  array: a leaf mirrors them where the state `init` gives the same param in
  a dict (traced, ``{'p': params}``) has a mirror, so a setting that has
  their shape (Muon's ``ns_coeffs``) is not taken for one; by the shape
  alone where that state cannot be traced or does not map onto
  ``inner_state`` leaf by leaf.
  """
  reference = trained_params(params)
  structure = jax.tree.structure(reference, is_leaf=_is_masked)
  if structure.num_nodes == 1 == structure.num_leaves:  # One array: not an empty tree.
    in_a_dict = _mirrors_in_a_dict(init, inner_state, params)
    if in_a_dict is not None:
      return in_a_dict
    shape = jnp.shape(reference)
    return [0 if jnp.shape(x) == shape else -1 for x in jax.tree.leaves(inner_state)]
  return [i for _, indices in _mirrors(inner_state, params)[0] for i in indices]


def _mirrors(state: Any, params: Any) -> tuple[list[tuple[Any, list[int]]], Any]:
  """Each mirror of ``params`` in ``state`` with its leaves' param indices, and each other
  leaf with ``[-1]``, in order; and the treedef they are the leaves of."""
  param_def = jax.tree.structure(trained_params(params), is_leaf=_is_masked)

  def mirrored(node: Any) -> list[int] | None:
    return holey_mirror(jax.tree.structure(node), param_def)

  nodes, treedef = jax.tree.flatten(state, is_leaf=lambda x: mirrored(x) is not None)
  return [(node, [-1] if mirrored(node) is None else mirrored(node)) for node in nodes], treedef


def _mirrors_in_a_dict(
  init: Callable[[Any], Any], inner_state: Any, params: Any
) -> list[int] | None:
  """`_mirror_params` of params that are one array, read from the state `init` gives them in
  a dict; None where it cannot be traced for them or does not map onto ``inner_state``."""
  wrapped = jax.tree.map(
    lambda x: {"p": jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))}, params
  )
  try:
    mirrors, treedef = _mirrors(jax.eval_shape(init, wrapped), wrapped)
  except Exception:  # noqa: BLE001 - an init may take only an array, or read its values
    return None
  # Each mirror {'p': x} stands for the leaf x of inner_state, each other leaf for itself.
  unwrapped = treedef.unflatten(
    [node["p"] if isinstance(node, Mapping) and ix != [-1] else node for node, ix in mirrors]
  )
  if jax.tree.structure(unwrapped) != jax.tree.structure(inner_state) or [
    x.shape for x in jax.tree.leaves(unwrapped)
  ] != [jnp.shape(x) for x in jax.tree.leaves(inner_state)]:
    return None
  return [i for _, indices in mirrors for i in indices]


_COPYING = frozenset(
  {"copy", "copy_p", "convert_element_type", "device_put", "sharding_constraint", "stop_gradient"}
)
"""Primitives whose result holds their operand's values (in another dtype or place)."""


def _copies_of_inputs(jaxpr: Any, copies: set) -> set:
  """`copies` (variables of `jaxpr` that copy its inputs) with what `jaxpr`'s equations copy."""
  for eqn in jaxpr.eqns:
    sub = eqn.params.get("jaxpr")
    if sub is not None and len(getattr(sub, "jaxpr", sub).invars) == len(eqn.invars):
      sub = getattr(sub, "jaxpr", sub)
      inner = {v for v, x in zip(sub.invars, eqn.invars, strict=True) if _in(x, copies)}
      inner = _copies_of_inputs(sub, inner)
      copies |= {o for o, v in zip(eqn.outvars, sub.outvars, strict=True) if _in(v, inner)}
    elif eqn.primitive.name in _COPYING and _in(eqn.invars[0], copies):
      copies.update(eqn.outvars)
  return copies


def _in(v: Any, variables: set) -> bool:
  return isinstance(v, jax.extend.core.Var) and v in variables


def _param_copies(init: Callable[[Any], Any], params: Any, state: Any) -> list[bool]:
  """For each leaf of `state` (``init(params)``), whether it is a copy of a param.

  Read from the traced init (no values): a leaf that is a param, or a param
  copied or cast (schedule-free's ``z``, prodigy's ``params0``, dog's
  ``init_params``, COCOB's ``init_particles``, mechanic's ``x0``). An init
  that needs the params' values cannot be traced without them; its copies
  are then the leaves that are params.
  """
  try:
    closed = jax.make_jaxpr(init)(params)
  except jax.errors.JAXTypeError:
    ids = {id(x) for x in jax.tree.leaves(params)}
    return [id(x) in ids for x in jax.tree.leaves(state)]
  copies = _copies_of_inputs(closed.jaxpr, set(closed.jaxpr.invars))
  return [_in(v, copies) for v in closed.jaxpr.outvars]


def _accumulators(inner_state: Any) -> list[bool]:
  """Whether each leaf of `inner_state` is a sum of gradients kept between updates
  (`optax.MultiSteps`'s ``acc_grads``): encoded again at every mini-step, its rounding
  errors would add up over the mini-steps.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> inner = optax.MultiSteps(optax.sgd(0.1, momentum=0.9), 4).gradient_transformation()
    >>> _accumulators(inner.init({'w': jnp.zeros(3)}))
    [False, False, False, True]
  """

  def is_multisteps(node: Any) -> bool:
    return isinstance(node, optax.MultiStepsState)

  def marks(tree: Any) -> Any:
    def mark(node: Any) -> Any:
      if not is_multisteps(node):
        return False
      fields = {name: marks(value) for name, value in node._asdict().items()}
      return node._replace(**(fields | {"acc_grads": jax.tree.map(lambda _: True, node.acc_grads)}))

    return jax.tree.map(mark, tree, is_leaf=is_multisteps)

  return jax.tree.leaves(marks(inner_state))


def _kept_fields(inner_state: Any) -> list[_KeptField | None]:
  """For each leaf of `inner_state`, the `_KEPT_FIELDS` entry of the state field it lies in,
  or None.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> state = optax.contrib.galore(0.1, rank=4).init({'w': jnp.zeros((4, 4))})
    >>> [None if k is None else k.storage for k in _kept_fields(state)]
    [None, None, None, None, 'kept: GaLore projector (a basis, not a moment)']
  """
  types = tuple({state_type for state_type, _ in _KEPT_FIELDS})

  def is_kept_type(node: Any) -> bool:
    return isinstance(node, types)

  def marks(tree: Any) -> Any:
    def mark(node: Any) -> Any:
      if not is_kept_type(node):
        return False
      fields = {}
      for name, value in node._asdict().items():
        kept = _KEPT_FIELDS.get((type(node), name))
        fields[name] = marks(value) if kept is None else jax.tree.map(lambda _: kept, value)
      return node._replace(**fields)

    return jax.tree.map(mark, tree, is_leaf=is_kept_type)

  return [m if isinstance(m, _KeptField) else None for m in jax.tree.leaves(marks(inner_state))]


def _names_accumulator(pattern: re.Pattern[str] | None, where: str) -> bool:
  """Whether ``states=`` (`pattern`) names the accumulator at `where`: a match that covers
  part of its ``acc_grads`` key, not only its param's path.

  Example:
    >>> import re
    >>> [_names_accumulator(re.compile(p), '0/acc_grads/dense/kernel') for p in ('acc', 'kernel')]
    [True, False]
  """
  key = re.search(r"(?:^|/)(acc_grads)(?:/|$)", where)
  if pattern is None or key is None:
    return False
  return any(m.start() < key.end(1) and m.end() > key.start(1) for m in pattern.finditer(where))


def _not_applicable(
  leaf: Any, param: Any | None, copy: bool, field: _KeptField | None
) -> tuple[str, str] | None:
  """(storage, why) of an inner leaf (its param or None, whether it copies it, the
  `_KEPT_FIELDS` entry of its field or None) the modes do not apply to, or None."""
  if field is not None:
    return field.storage, field.why
  if param is None:
    return _KEPT_NOT_MIRROR, "mirrors no param"
  if jnp.shape(leaf) != jnp.shape(param):
    return _KEPT_NOT_MIRROR, f"its shape {jnp.shape(leaf)} is not its param's {jnp.shape(param)}"
  if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
    return _KEPT_NOT_FLOAT, f"its dtype {jnp.result_type(leaf)} is not floating"
  if copy:
    # A codec scaled to the weights would round away each step's small change.
    return _KEPT_PARAM_COPY, "it is a copy of its param (the inner init sets it to the param)"
  return None


@dataclasses.dataclass(frozen=True)
class _ParamRule:
  """A ``(pattern, mode)`` pair of ``param_modes``.

  A pattern ``axis:<regex>`` selects a param with a logical axis whose
  whole name the regular expression matches; any other pattern is a
  regular expression searched in the param's path.
  """

  pattern: str
  mode: str

  @property
  def by_axis(self) -> bool:
    """Whether the rule selects params by logical axis."""
    return self.pattern.startswith(_BY_AXIS)

  @property
  def regex(self) -> str:
    """The regular expression: on an axis name (``axis:`` rules), else on the path."""
    return self.pattern.removeprefix(_BY_AXIS) if self.by_axis else self.pattern

  def matches(self, path: str, names: Sequence[str | None]) -> bool:
    """Whether the param at ``path`` with logical axes ``names`` is selected."""
    if self.by_axis:
      return any(name is not None and re.fullmatch(self.regex, name) for name in names)
    return re.search(self.regex, path) is not None


def _param_rules(param_modes: Sequence[tuple[str, str]]) -> tuple[_ParamRule, ...]:
  """``param_modes`` as rules, each mode and regular expression checked.

  Raises:
    ValueError: naming the pattern, for an unknown mode or an ``axis:``
      pattern without an axis; `re.error` for a bad regular expression.
  """
  if isinstance(param_modes, str):
    param_modes = [param_modes]
  for i, pair in enumerate(param_modes):
    if isinstance(pair, str) or not isinstance(pair, Sequence) or len(pair) != 2:
      raise ValueError(
        f"low_precision: param_modes takes (pattern, mode) pairs, got {pair!r} at {i} "
        "(e.g. [('embed', 'float32')])."
      )
  rules = tuple(_ParamRule(str(pattern), str(mode)) for pattern, mode in param_modes)
  for rule in rules:
    if rule.mode not in (_FLOAT32, *LOW_PRECISION_MODES):
      raise ValueError(
        f"low_precision: param_modes maps {rule.pattern!r} to {rule.mode!r}, not one of "
        f"{(_FLOAT32, *LOW_PRECISION_MODES)}."
      )
    if rule.pattern == _BY_AXIS:
      raise ValueError(
        f"low_precision: the param_modes pattern {rule.pattern!r} names no logical axis "
        f"(e.g. '{_BY_AXIS}vocab')."
      )
    re.compile(rule.regex)
  return rules


def _trained_leaves(params: Any) -> list[tuple[str, Any]]:
  """The trained params' leaves by path (``encoder/layers_0/mlp/wi/kernel``), those another
  transformation takes (optax's masked nodes) left out."""
  return [
    (_state_dict.key_path_str(path), leaf)
    for path, leaf in jax.tree.flatten_with_path(trained_params(params), is_leaf=_is_masked)[0]
    if not _is_masked(leaf)
  ]


def _param_axis_names(
  rules: Sequence[_ParamRule], specs: dict[str, Any] | None, params: Any
) -> dict[str, tuple[str | None, ...]]:
  """Each param's logical axis names by path, where a rule selects params by axis.

  ``specs`` are the params' specs by path (`specs_by_path`), or None: not
  given. Without a rule by axis there is nothing to look up: ``{}``.

  Raises:
    ValueError: naming the rules by axis when ``specs`` is None; naming
      the params ``specs`` lacks; or, from `axis_names`, naming a param
      whose spec's rank is not its shape's.
  """
  by_axis = [rule.pattern for rule in rules if rule.by_axis]
  if not by_axis:
    return {}
  named = ", ".join(map(repr, by_axis))
  if specs is None:
    rules_select = "rule " + named + " selects" if len(by_axis) == 1 else f"rules {named} select"
    raise ValueError(
      f"low_precision: the param_modes {rules_select} params by logical axis, but the "
      "params' logical axes are not given: pass param_axes= to low_precision, or give the "
      "transformation itself to optimizers.chain or OptaxWrapper (optax.chain does not pass "
      "the axes on), whose set_param_axes takes them (T5X's train state, TrainState.create "
      "and partitioning.init_sharded call it)."
    )
  leaves = _trained_leaves(params)
  missing = [path for path, _ in leaves if path not in specs]
  if missing:
    which = (
      f"param {missing[0]!r} has"
      if len(missing) == 1
      else f"params {', '.join(map(repr, missing))} have"
    )
    raise ValueError(
      f"low_precision: the {which} no logical axes (param_modes {named} select by axis); "
      f"the axes cover {sorted(specs)}."
    )
  return {path: axis_names(path, specs[path], jnp.shape(leaf)) for path, leaf in leaves}


def _unused_settings(
  state_dtype: str,
  rules: Sequence[_ParamRule],
  *,
  block_size: int | None,
  stochastic_rounding: bool,
) -> list[str]:
  """Why `block_size` given (not None) or `stochastic_rounding` given False changes nothing:
  no mode in use (`state_dtype` and the `rules`' modes) is one it applies to. True, the
  default, is not told of: a run's ``config.gin`` records it, whatever the mode.

  Example:
    >>> _unused_settings("bfloat16", (), block_size=64, stochastic_rounding=True)
    ['low_precision: block_size=64 is unused: it sizes 8-bit and 4-bit blocks, and the modes in use are bfloat16 (state_dtype and param_modes).']
    >>> _unused_settings("bfloat16", (_ParamRule("mlp", "8bit"),), block_size=64,
    ...     stochastic_rounding=False)
    []
  """
  modes = list(dict.fromkeys([state_dtype, *(rule.mode for rule in rules)]))
  unused = []
  if block_size is not None and not set(modes) & set(_CODECS):
    unused.append((f"block_size={block_size}", "sizes 8-bit and 4-bit blocks"))
  if not stochastic_rounding and _BF16 not in modes:
    unused.append((f"stochastic_rounding={stochastic_rounding}", "rounds bfloat16 leaves"))
  return [
    f"low_precision: {given} is unused: it {what}, and the modes in use are "
    f"{', '.join(modes)} (state_dtype and param_modes)."
    for given, what in unused
  ]


def _warn_of_unused_rules(
  rules: Sequence[_ParamRule],
  params: Any,
  axes: Mapping[str, tuple[str | None, ...]],
  *,
  min_size: int,
) -> None:
  """Warns of each of ``param_modes`` that decides no param's mode: it selects no param, or
  only params an earlier pattern takes or that `_kept_by_size` keeps as they are (below
  `min_size`, which applies before the patterns' modes, or 0-d: `_kept_reasons`); a warning,
  not an error: one policy may be given to several transformations, each over its own
  params, as `MultiOptimizer`'s groups."""
  leaves = _trained_leaves(params)
  paths = [path for path, _ in leaves]
  small = {path for path, leaf in leaves if _kept_by_size(leaf, min_size)}
  shapes = {path: jnp.shape(leaf) for path, leaf in leaves}
  taken: set[str] = set()
  for rule in rules:
    selected = [path for path in paths if rule.matches(path, axes.get(path, ()))]
    kept = [path for path in selected if path in small and path not in taken]
    if not selected:
      why = "selects no param"
    elif taken.union(kept).issuperset(selected):
      earlier = [path for path in selected if path in taken]
      why = "selects only " + _kept_reasons(
        earlier, {path: shapes[path] for path in kept}, min_size
      )
    else:
      why = None
    if why is not None:
      warn(
        f"low_precision: the param_modes pattern {rule.pattern!r} {why}, so it sets no "
        f"param's mode; the params are {format_paths(paths)}."
      )
    taken.update(selected)


def _warn_if_nothing_is_compressed(
  mode: str,
  inner_state: Any,
  storage: Sequence[str],
  *,
  min_size: int,
  states: str | None,
  param_modes: Sequence[_ParamRule],
) -> None:
  """Warns when no leaf of the inner state is stored in a low-precision mode while some
  floating leaf that `_kept_by_size` does not keep is kept for what it is (``"kept: ..."``:
  not param-shaped, L-BFGS's last params, the moments of a GaLore that projects every
  kernel) or because no block of the mode tiles it: the transformation then saves no
  memory. Under a ``param_modes`` policy or ``states=``, what is kept is the caller's
  choice, which warns of nothing here."""
  if states is not None or param_modes or any(k in LOW_PRECISION_MODES for k in storage):
    return
  no_block = {_reason(codec.no_block) for codec in _CODECS.values()}
  kept: dict[str, list[tuple[str, int]]] = {}
  flat = jax.tree.leaves_with_path(inner_state)
  for (path, leaf), kind in zip(flat, storage, strict=True):
    floating = jnp.issubdtype(jnp.result_type(leaf), jnp.floating)
    unsaved = kind.startswith("kept: ") or _reason(kind) in no_block
    if unsaved and floating and not _kept_by_size(leaf, min_size):
      size = math.prod(jnp.shape(leaf))
      kept.setdefault(kind, []).append((_state_dict.key_path_str(path), size))
  if kept:
    reasons = "; ".join(
      f"{kind!r}: {format_paths([p for p, _ in leaves])} "
      f"({sum(size for _, size in leaves):,} values)"
      for kind, leaves in kept.items()
    )
    warn(
      f"low_precision: {mode!r} stores none of the inner transformation's state in low "
      f"precision, so it saves no memory; it keeps its leaves of min_size={min_size} values "
      f"or more as they are: {reasons}. `leaf_storage` gives every leaf's reason."
    )


def _reason(kind: str) -> str:
  """A storage label without its dtype: ``"float32: 0-d"`` -> ``"0-d"``."""
  return kind.partition(": ")[2]


def _kept_by_size(leaf: Any, min_size: int) -> bool:
  """Whether the state of the param `leaf` stays as it is whatever its mode: it is below
  `min_size` elements, or 0-d.

  Example:
    >>> _kept_by_size(jnp.ones((8, 8)), 4096), _kept_by_size(jnp.ones(()), 0)
    (True, True)
    >>> _kept_by_size(jnp.ones((64, 64)), 4096)
    False
  """
  shape = jnp.shape(leaf)
  return math.prod(shape) < max(min_size, 1) or not shape


def _kept_reasons(
  earlier: Sequence[str], kept: Mapping[str, tuple[int, ...]], min_size: int
) -> str:
  """Why a pattern's params get no mode from it: the paths of them that an `earlier` pattern
  takes, and the shapes (by path) of those `_kept_by_size` keeps, below `min_size` or 0-d or
  empty (kept whatever `min_size`).

  Example:
    >>> _kept_reasons(['embed'], {'bias': (8,)}, 4096)
    'params an earlier pattern takes (embed) or params that min_size=4096 keeps as they are before param_modes (bias)'
    >>> _kept_reasons([], {'scale': ()}, 0)
    '0-d params (scale), which keep their state'
  """
  reasons = [f"params an earlier pattern takes ({format_paths(earlier)})"] if earlier else []
  sized = [path for path, shape in kept.items() if shape and 0 not in shape]
  if sized:
    reasons.append(
      f"params that min_size={min_size} keeps as they are before param_modes "
      f"({format_paths(sized)})"
    )
  bare = [path for path, shape in kept.items() if not shape or 0 in shape]
  if bare:
    kind = "0-d" if all(not kept[path] for path in bare) else "0-d or empty"
    reasons.append(f"{kind} params ({format_paths(bare)}), which keep their state")
  return " or ".join(reasons)


def _in_own_dtype(kept: str, leaf: Any) -> str:
  """A ``"float32: <why>"`` storage label with the dtype the uncompressed `leaf` keeps (the
  wrapped optimizer's own: bfloat16 for bfloat16 params' adam state).

  Example:
    >>> _in_own_dtype(_KEPT_SMALL, jnp.ones(2, jnp.bfloat16))
    'bfloat16: below min_size'
  """
  return kept.replace(_FLOAT32, jnp.result_type(leaf).name, 1)


def _plan_storage(
  mode: str,
  inner_state: Any,
  params: Any,
  *,
  min_size: int,
  states: str | None,
  block: Callable[[str, tuple[int, ...]], Any],
  mirrors: Sequence[int],
  copies: Sequence[bool],
  accumulators: Sequence[bool],
  fields: Sequence[_KeptField | None],
  param_modes: Sequence[_ParamRule] = (),
  axes: Mapping[str, tuple[str | None, ...]] | None = None,
) -> tuple[tuple[str, ...], tuple[int, ...], tuple[str, ...]]:
  """(storage, param index, rule) of every inner leaf; refuses what ``states=`` selects wrongly.

  A leaf's mode is that of the first of ``param_modes`` that selects its
  param (by its path, or by its logical axis names: ``axes``, by param
  path), else ``mode``; ``"float32"`` keeps it, saying which pattern. In a
  quantized mode a leaf without a block (``block(mode, shape)``, the mode's
  `leaf_block` with its arguments, returns None) stays float32: the mode
  would cost it more bytes. ``mirrors`` is each leaf's param index
  (`_mirror_params`, -1: none); a leaf that ``copies`` marks as a copy of
  its param keeps its dtype, as does a 0-d leaf, and a leaf that
  ``accumulators`` marks unless ``states`` names it (`_names_accumulator`). A leaf
  of a field that ``fields`` marks (`_kept_fields`) is kept whatever its
  shape (GaLore's projector).

  Raises:
    ValueError: naming the path, when ``states`` selects a leaf that is not a
      floating param-shaped mirror, or selects no leaf at all; naming the
      pattern, the param and the leaf, when a pattern of ``param_modes``
      gives a mode other than ``"float32"`` to a param that is not real
      floating (a complex param, whose state leaves are complex); a real
      param's leaves that are not floating (`optax.zero_nans`'s bool) are
      kept.
  """
  flat = jax.tree.flatten_with_path(inner_state)[0]
  reference = trained_params(params)
  param_leaves = jax.tree.leaves(reference, is_leaf=_is_masked)
  pattern = None if states is None else re.compile(states)
  param_paths = [
    _state_dict.key_path_str(path)
    for path, _ in jax.tree.flatten_with_path(reference, is_leaf=_is_masked)[0]
  ]
  storage, rules = [], []
  matched = False
  selected_kinds = []

  def rule_of(j: int) -> _ParamRule | None:
    names = axes.get(param_paths[j], ()) if axes else ()
    return next((r for r in param_modes if r.matches(param_paths[j], names)), None)

  for (path, leaf), j, copy, summed, field in zip(
    flat, mirrors, copies, accumulators, fields, strict=True
  ):
    where = _state_dict.key_path_str(path)
    selected = pattern is None or pattern.search(where) is not None
    matched |= selected
    rule = None
    kept = _not_applicable(leaf, param_leaves[j] if j >= 0 else None, copy, field)
    if kept is not None and pattern is not None and selected:
      raise ValueError(
        f"low_precision({mode!r}, states={states!r}) selects the state leaf '{where}' "
        f"(shape {jnp.shape(leaf)}, dtype {jnp.result_type(leaf)}), which it does not apply to: "
        f"the mode compresses floating param-shaped state leaves that are not copies of the "
        f"params, and {kept[1]}."
      )
    unreal = (
      kept is not None
      and kept[0] == _KEPT_NOT_FLOAT
      and not jnp.issubdtype(jnp.result_type(param_leaves[j]), jnp.floating)
    )
    chosen = rule_of(j) if unreal else None
    if chosen is not None and chosen.mode != _FLOAT32:
      raise ValueError(
        f"low_precision: the param_modes pattern {chosen.pattern!r} gives {chosen.mode!r} to "
        f"the param '{param_paths[j]}', whose state leaf '{where}' (shape "
        f"{jnp.shape(leaf)}, dtype {jnp.result_type(leaf)}) it does not apply to: the "
        f"modes compress floating state leaves, and {kept[1]}."
      )
    if kept is not None:
      storage.append(kept[0])
    elif not selected:
      storage.append(_KEPT_NOT_SELECTED)
    elif math.prod(jnp.shape(leaf)) < max(min_size, 1):
      storage.append(_in_own_dtype(_KEPT_SMALL, leaf))
    elif not jnp.shape(leaf):
      storage.append(_in_own_dtype(_KEPT_0D, leaf))
    elif summed and not _names_accumulator(pattern, where):
      storage.append(_in_own_dtype(_KEPT_ACCUMULATOR, leaf))
    else:
      rule = rule_of(j)
      leaf_mode = mode if rule is None else rule.mode
      if leaf_mode == _FLOAT32:
        storage.append(_in_own_dtype(f"float32: param_modes {rule.pattern!r}", leaf))
      elif leaf_mode in _CODECS and block(leaf_mode, jnp.shape(leaf)) is None:
        storage.append(_in_own_dtype(_CODECS[leaf_mode].no_block, leaf))
      else:
        storage.append(leaf_mode)
    if selected and kept is None:
      selected_kinds.append((where, storage[-1]))
    rules.append("" if rule is None else rule.pattern)
  if pattern is not None and not matched:
    raise ValueError(
      f"low_precision({mode!r}, states={states!r}) selects no state leaf; the state's "
      f"leaves are {[_state_dict.key_path_str(p) for p, _ in flat]}."
    )
  if pattern is not None:
    _warn_of_a_pattern_kept_by_size(f"low_precision({mode!r}, states={states!r})", selected_kinds)
  return tuple(storage), tuple(mirrors), tuple(rules)


def _warn_of_a_pattern_kept_by_size(what: str, kinds: Sequence[tuple[str, str]]) -> None:
  """Warns where every state leaf ``states=`` selects that a mode applies to is kept for its
  size (`kinds`: each one's path and storage): the pattern then compresses nothing.

  Example:
    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...   warnings.simplefilter("always")
    ...   _warn_of_a_pattern_kept_by_size("states='b'", [("0/mu/b", "float32: below min_size")])
    >>> str(caught[0].message).split(":")[0]
    "states='b' selects only state leaves kept as they are"
  """
  by_size = {_reason(_KEPT_SMALL), _reason(_KEPT_0D)}
  size_kept = [(where, _reason(kind)) for where, kind in kinds]
  if not kinds or any(reason not in by_size for _, reason in size_kept):
    return
  reasons = sorted({reason for _, reason in size_kept})
  paths = [where for where, _ in size_kept]
  more = f" and {len(paths) - 3} more" if len(paths) > 3 else ""
  warn(
    f"{what} selects only state leaves kept as they are: {' or '.join(reasons)} "
    f"({', '.join(paths[:3])}{more}), so it compresses none; min_size applies before "
    "states=, and 0-d leaves keep their dtype."
  )


def _decode(kind: str, stored: Any, flat: bool = False) -> jax.Array:
  """One stored leaf in float32; ``flat`` is `dequantize`'s."""
  if kind in _CODECS:
    return _CODECS[kind].decode(stored, flat)
  if kind == _BF16:
    return stored.astype(jnp.float32)
  return stored


def _encode(
  kind: str,
  x: Any,
  bits: jax.Array | None,
  block: Any,
  guard: bool = True,
  stats: Any = None,
  flat: bool = False,
) -> Any:
  """One float32 leaf stored as ``kind`` says.

  ``bits`` are the stochastic-rounding bits of a bfloat16 leaf (None: round
  to nearest); ``block`` is a quantized leaf's block; ``guard``, ``stats``
  and ``flat`` are `quantize`'s ``guard_nonfinite``, ``stats`` and ``flat``.
  """
  if kind in _CODECS:
    x = jnp.asarray(x, jnp.float32)
    return _CODECS[kind].encode(x, block, guard, stats, flat)
  if kind == _BF16:
    return to_bfloat16(jnp.asarray(x, jnp.float32), bits)
  return x


def _decode_lane(kind: str, stored: Any, lane: int, lanes: int) -> jax.Array:
  """Columns ``lane::lanes`` of one stored leaf in float32 (`_Codec.decode_lane`)."""
  if kind in _CODECS and _CODECS[kind].lanes == lanes:
    return _CODECS[kind].decode_lane(stored, lane)
  values = _decode(kind, stored, flat=True)
  return values if lanes == 1 else values[..., lane::lanes]


def _stats(kind: str, x: Any, block: Any, guard: bool, shape: tuple[int, ...]) -> Any:
  """The block statistics of a new quantized state leaf (`quantize_stats`) in ``block``; None
  for other kinds."""
  if kind not in _CODECS:
    return None
  x = jnp.asarray(x, jnp.float32)
  return _CODECS[kind].stats(x, block, guard, shape)


def _rounded(state: LowPrecisionState, leaf: int) -> bool:
  """Inner leaf ``leaf`` is stored in bfloat16 with stochastic rounding."""
  return state.storage[leaf] == _BF16 and state.stochastic_rounding


def _compress(
  inner_state: Any,
  state: LowPrecisionState,
  count: jax.Array,
  *,
  blocks: Sequence[Any],
  guard: bool = True,
) -> Any:
  """``inner_state`` (float32) stored as ``state``'s static fields say, each quantized leaf in
  its block of ``blocks`` (one per leaf).

  A `_rounded` leaf's stochastic-rounding bits (`_rounding_bits`) read
  the step's key and the leaf's index from `_rounding_operands`, not as
  constants, as the streamed encoders do.
  """
  leaves, treedef = jax.tree.flatten(inner_state)
  shared_key, leaf_ids = _rounding_operands(state, count)
  out = []
  for k, (leaf, kind, block) in enumerate(zip(leaves, state.storage, blocks, strict=True)):
    rounded = _rounded(state, k)
    bits = _rounding_bits(leaf, shared_key, leaf_ids[k]) if rounded else None
    out.append(_encode(kind, leaf, bits, block, guard))
  return treedef.unflatten(out)


def _in_stored_layouts(encode: Callable[[Any, jax.Array], Any], fresh: Any, count: Any) -> Any:
  """``encode(fresh, count)``, the stored leaves of a float32 state ``fresh``.

  On a mesh with Explicit axes it runs with them Auto: a block that spans a
  sharded dimension's shards reads values of several devices, which Explicit
  axes refuse. Each stored leaf is then laid out as `_state_rule` lays it out
  from its float32 leaf's spec (`_quantized_spec`), a mesh axis that does not
  divide a dimension dropped from it.
  """
  leaves = jax.tree.leaves(fresh)
  mesh = explicit_mesh(leaves)
  if mesh is None:
    return encode(fresh, count)
  abstract = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in leaves]
  stored = jax.eval_shape(
    lambda *xs: encode(jax.tree.unflatten(jax.tree.structure(fresh), xs), jnp.int32(0)),
    *abstract,
  )
  stored_leaves, stored_def = jax.tree.flatten(stored, is_leaf=_is_quantized)

  def fitted(spec: Any, shape: tuple[int, ...]) -> PartitionSpec:
    spec = drop_indivisible_axes(specs_lib.canonical(spec, len(shape)), shape, mesh.shape)
    return PartitionSpec() if spec is None else spec

  out = []
  for value, leaf in zip(leaves, stored_leaves, strict=True):
    spec = jax.typeof(value).sharding.spec if isinstance(value, jax.Array) else PartitionSpec()
    if not _is_quantized(leaf):
      out.append(fitted(spec, leaf.shape))
      continue
    specs = _quantized_spec(leaf, fitted(spec, leaf.codes.shape))
    out.append(type(leaf)(*(fitted(x, y.shape) for x, y in zip(specs, leaf, strict=True))))
  shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), stored_def.unflatten(out))
  return auto_axes_call(encode, shardings, fresh, count)


def _expand(state: LowPrecisionState) -> Any:
  """The inner state, each compressed leaf back in float32.

  Raises:
    ValueError: from `_stored_blocks`, for a leaf whose block does not encode
      its values in the arrays it has.
  """
  _stored_blocks(state)
  leaves, treedef = jax.tree.flatten(state.inner_state, is_leaf=_is_quantized)
  return treedef.unflatten(
    [_decode(kind, leaf) for leaf, kind in zip(leaves, state.storage, strict=True)]
  )


def _expanded_shapes(state: LowPrecisionState) -> Any:
  """The shapes and dtypes of `_expand`'s result, without tracing the decoders."""

  def shape(leaf: Any, kind: str) -> Any:
    if kind in _CODECS:
      return jax.ShapeDtypeStruct(_CODECS[kind].shape(leaf), jnp.float32)
    if kind == _BF16:
      return jax.ShapeDtypeStruct(jnp.shape(leaf), jnp.float32)
    return jax.ShapeDtypeStruct(jnp.shape(leaf), jnp.result_type(leaf))

  leaves, treedef = jax.tree.flatten(state.inner_state, is_leaf=_is_quantized)
  return treedef.unflatten([shape(x, k) for x, k in zip(leaves, state.storage, strict=True)])


def _stored_blocks(state: LowPrecisionState) -> list[Any]:
  """Each inner leaf's block (None: not quantized), as ``init`` chose it (``state.blocks``).

  A new state is encoded in the blocks of the one it replaces, so an update
  never changes a leaf's layout: not where its arrays are shards (under
  `jax.shard_map`), whose own shapes `leaf_block` would give other blocks.

  Raises:
    ValueError: from `_stored_block`, for a leaf whose block does not encode
      its values in the arrays it has.
  """
  flat = jax.tree.flatten_with_path(state.inner_state, is_leaf=_is_quantized)[0]
  if len(state.blocks) != len(flat):
    raise ValueError(
      f"low_precision: this LowPrecisionState records {len(state.blocks)} blocks for its "
      f"{len(flat)} inner leaves; make a state with low_precision(...).init, which records "
      "each leaf's block."
    )
  return [
    _stored_block(kind, stored, block, _state_dict.key_path_str(path)) if kind in _CODECS else None
    for (path, stored), kind, block in zip(flat, state.storage, state.blocks, strict=True)
  ]


def _stored_block(kind: str, stored: Any, block: Any, where: str) -> Any:
  """``block``, the block of the quantized leaf ``stored`` (of mode ``kind``, at ``where``).

  Raises:
    ValueError: naming the leaf, its values' shape and both layouts, when
      ``block`` does not encode values of its shape in the arrays it has (a
      shard that splits a block, codes split over a mesh axis that their
      scales are not, or 4-bit rows too few for the column maxima it stores).
  """
  codec = _CODECS[kind]
  shape = codec.shape(stored)
  have = tuple(tuple(jnp.shape(x)) for x in stored)
  want = codec.stored_shapes(shape, block)
  if want == have:
    return block
  fields = (*stored._fields, "cols")
  encoded = "does not tile them" if want is None else f"encodes them as {_layout(fields, want)}"
  rows = "; a leaf that stores column maxima ('cols') needs its rows whole" if len(have) > 2 else ""
  raise ValueError(
    f"low_precision: the {kind} state leaf '{where}' holds values of shape {shape} here, "
    f"stored as {_layout(fields, have)}; its block {block} {encoded}. An update keeps each "
    "leaf's stored layout: under jax.shard_map, split the state as its param so that each "
    "shard holds whole blocks, its codes with their scales (the specs the optimizer derives "
    f"for its state){rows}."
  )


def _layout(fields: Sequence[str], shapes: Sequence[tuple[int, ...]]) -> str:
  """A stored leaf's arrays and their shapes: ``codes (2, 8), scales (2, 1)``."""
  return ", ".join(f"{field} {shape}" for field, shape in zip(fields, shapes))


def _inner_update_dtypes(
  inner: optax.GradientTransformationExtraArgs,
  updates: Any,
  state: LowPrecisionState,
  params: Any,
  extra_args: dict[str, Any],
  *,
  widened: bool,
) -> list[Any] | None:
  """The dtypes of ``inner``'s updates computed with its own state, leaf by leaf.

  None where the state it would hold is float32 wherever it is stored
  compressed and the gradients are not `widened` to float32
  (`_in_float32_range`): the update computed from the float32 decoded state
  then has them already. Otherwise (bfloat16 params, whose adam state is
  bfloat16) the update computes in float32 and its leaves are cast to these,
  so that ``low_precision(inner)`` gives the updates ``inner`` gives.
  """
  own = jax.eval_shape(inner.init, updates if params is None else params)
  if not widened and all(
    x.dtype == jnp.float32 or kind not in LOW_PRECISION_MODES
    for x, kind in zip(jax.tree.leaves(own), state.storage, strict=True)
  ):
    return None
  inner_updates, _ = jax.eval_shape(
    functools.partial(inner.update, **extra_args), updates, own, params
  )
  return [x.dtype for x in jax.tree.leaves(inner_updates)]


def _narrow_range(x: Any) -> bool:
  """Whether ``x`` is of a floating dtype with fewer exponent bits than float32 (float16, the
  float8s; not bfloat16), in which the squares of small gradients underflow."""
  dtype = jnp.result_type(x)
  return bool(jnp.issubdtype(dtype, jnp.floating)) and (
    jnp.finfo(dtype).maxexp < jnp.finfo(jnp.float32).maxexp
  )


def _in_float32_range(tree: Any) -> Any:
  """``tree`` with its `_narrow_range` leaves in float32, for the update beside the decoded
  float32 state (otherwise a float16 ``0.001 * g**2`` of ``g = 0.005`` is 0, and the update
  ``lr * g / eps``)."""
  return jax.tree.map(lambda x: x.astype(jnp.float32) if _narrow_range(x) else x, tree)


def _in_stored_dtypes(new: Any, old: Any) -> Any:
  """The stored inner state `new` with each leaf kept as it is (not compressed) in its dtype
  in `old`: an update of widened float16 gradients (`_in_float32_range`) gives float32."""
  new_leaves, treedef = jax.tree.flatten(new, is_leaf=_is_quantized)
  old_leaves = jax.tree.leaves(old, is_leaf=_is_quantized)
  return treedef.unflatten([
    x if _is_quantized(x) else jnp.asarray(x).astype(jnp.result_type(o))
    for x, o in zip(new_leaves, old_leaves, strict=True)
  ])  # fmt: skip


def _stream_plan(
  inner: optax.GradientTransformation,
  updates: Any,
  state: LowPrecisionState,
  params: Any,
  extra_args: dict[str, Any],
) -> FusedPlan | None:
  """The per-leaf programs of ``inner``'s update, or None when it cannot stream.

  It streams when `plan_fused_update` proves every leaf's update
  elementwise in its own param, gradient and state leaves (the scalars and
  the global reductions of the gradients, such as a global norm, are
  computed first), no global computation reads a param-shaped state leaf,
  and some leaf is compressed.
  """
  if params is None or not any(kind in LOW_PRECISION_MODES for kind in state.storage):
    return None
  try:
    plan = plan_fused_update(
      inner,
      params,
      updates,
      _expanded_shapes(state),
      extra_args,
      bounded_groups=False,
      apply_updates=False,
      uniform=False,
    )
  except NotFusible:
    return None
  n = len(plan.paths)
  mirrored = {
    v for v, slot in zip(plan.inputs[2 * n :], plan.slots, strict=False) if slot is not None
  }
  if any(a in mirrored for op in plan.outside for a in op.ins if isinstance(a, int)):
    return None
  return plan


def _after(x: jax.Array) -> jax.Array:
  """True, computed from ``x``'s first element: a predicate that waits for ``x``.

  The sign bit of any float is 0 or 1, which no compiler simplification
  knows, so the predicate cannot be folded away or hoisted above ``x``.
  """
  width = jnp.dtype(x.dtype).itemsize * 8
  bits = jax.lax.bitcast_convert_type(x.reshape(-1)[:1], jnp.dtype(f"uint{width}"))
  return (bits >> (width - 1) <= 1).all()


def _latest_alike(done: list[jax.Array], values: Any, first: jax.Array) -> jax.Array:
  """The last of ``done`` that varies over no manual mesh axis that ``values`` do not
  (`varying_axes`), or ``first``: what a leaf's update and statistics wait for (`_after`).

  Under `jax.shard_map` (with ``check_vma``) a value computed from one that varies over
  an axis varies over it too: a replicated leaf that waited for a split one would come
  out split, which its output spec refuses. Outside `jax.shard_map` it is the last of
  ``done``.
  """
  own = varying_over(values)
  return next((x for x in reversed(done) if varying_axes(x) <= own), first)


def _rounding_operands(state: LowPrecisionState, count: jax.Array) -> tuple[Any, list]:
  """``(step_key(seed, count), [0, ..., n - 1])`` for ``state``'s ``n`` inner leaves: what a
  leaf's stochastic-rounding bits hash its key from; None for all without a `_rounded` leaf.

  The inner leaves' indices come out of a conditional (`_after` of
  ``count``: always true) that XLA cannot fold, beside the step's key: a
  leaf's encoders then read its index and the key as operands, not as
  constants inside them, and the encoders of same-shaped leaves compile to
  one kernel. A key hashed in each leaf's encoders from a constant index
  made them a kernel apiece, and one hashed before them a small kernel
  apiece: XLA:CPU takes about 10 ms to compile a kernel, however small.
  """
  n = len(state.storage)
  if not any(_rounded(state, k) for k in range(n)):
    return None, [None] * n
  return _unfoldable_operands(state.seed, count, n)


@functools.partial(jax.jit, static_argnums=(0, 2))
def _unfoldable_operands(seed: int, count: jax.Array, n: int) -> tuple[jax.Array, list]:
  """`_rounding_operands`' conditional; jitted: called eagerly (an eager ``create``), it runs
  as one program."""
  ids = tuple(jnp.uint32(k) for k in range(n))

  def shared() -> tuple:
    return step_key(seed, count), ids

  def never() -> tuple:
    return jnp.uint32(0), tuple(jnp.uint32(0) for _ in ids)

  key, ids = jax.lax.cond(_after(count), shared, never)
  return key, list(ids)


def _rounding_bits(x: jax.Array, shared_key: jax.Array, leaf_id: jax.Array) -> jax.Array:
  """The stochastic-rounding bits of the new state leaf ``x`` (`leaf_rounding_bits`).

  Under `jax.shard_map`, where ``x`` differs between the shards of manual mesh axes
  (`_shard_position`), its leaf's key is hashed with the shard's position too: each shard
  hashes its own elements' local indices, which every shard shares, and would otherwise
  round equal values alike. A leaf that is the same on every device (replicated, or outside
  `jax.shard_map`, sharded by `jax.jit` or not) keeps the bits of the whole leaf.
  """
  position = _shard_position(x)
  if position is None:
    return leaf_rounding_bits(jnp.shape(x), shared_key, leaf_id)
  return hashed_bits(jnp.shape(x), leaf_key(leaf_key(shared_key, leaf_id), position))


def _shard_position(x: jax.Array) -> jax.Array | None:
  """The index of this shard of ``x`` among those of the manual mesh axes it varies over
  (`varying_axes`), or None where it varies over none."""
  varying = varying_axes(x)
  if not varying:
    return None
  mesh = jax.sharding.get_abstract_mesh()
  return jax.lax.axis_index(tuple(a for a in mesh.manual_axes if a in varying))


def _unchanged(shapes: Any, operands: Any) -> Any:
  """The branch of `_streamed_update`'s conditional that never runs: its operands back.

  Each output is an operand of its shape and dtype (zeros where none is):
  nothing to compute.
  """
  arrays = jax.tree.leaves(operands)

  def like(s: Any) -> Any:
    same = (a for a in arrays if jnp.shape(a) == s.shape and jnp.result_type(a) == s.dtype)
    return next(same, None)

  def pick(s: Any) -> Any:
    found = like(s)
    return jnp.zeros(s.shape, s.dtype) if found is None else found

  return jax.tree.map(pick, shapes)


def _row_split(
  shape: tuple[int, ...], unit: int, limit: int, shard_multiple: int
) -> tuple[int, int, int] | None:
  """How the streamed statistics of a leaf of ``shape`` walk its first dimension, or None.

  ``(stripes, chunks, rows)``: the first dimension is ``stripes x chunks x
  rows`` long, and chunk ``b`` holds rows ``b * rows`` to ``(b + 1) * rows
  - 1`` of every stripe. ``stripes`` is as many as divide the dimension's
  shards (``shard_multiple`` of them), so that each device walks its own
  rows; ``rows`` is a multiple of ``unit`` (the rows of a block) and as
  large as keeps a chunk within ``limit`` values (one block of rows per
  stripe where none is that small). None: the leaf has one dimension, fits
  in ``limit`` values, or cannot split.

  Example:
    >>> _row_split((32128, 768), 1, 1 << 20, 8), _row_split((768, 32128), 8, 1 << 20, 8)
    ((8, 251, 16), (8, 12, 8))
    >>> _row_split((768, 768), 1, 1 << 20, 8) is None  # it fits
    True
  """
  if len(shape) < 2 or math.prod(shape) <= limit or shape[0] % unit:
    return None
  stripes = math.gcd(shape[0] // unit, shard_multiple)
  units = shape[0] // unit // stripes
  row = math.prod(shape[1:]) * stripes * unit
  fits = _largest_divisor(units, limit // row)
  if fits == units:
    return None
  return stripes, units // fits, fits * unit


def _largest_divisor(n: int, most: int) -> int:
  """The largest divisor of ``n`` that is at most ``most``; 1 where ``most`` is below 1.

  Divisors come in pairs ``(k, n // k)`` with ``k`` up to the square root of
  ``n``: only those ``k`` are tried.

  Example:
    >>> _largest_divisor(3 * 2**24, 2**14), _largest_divisor(1_000_000_007, 2**17)
    (16384, 1)
  """
  if most >= n:
    return n
  best = 1
  for k in range(1, math.isqrt(n) + 1):
    if n % k:
      continue
    for d in (k, n // k):
      if best < d <= most:
        best = d
  return best


class _Split(NamedTuple):
  """How streamed statistics walk a leaf: along ``axis``, ``stripes x chunks x rows`` long
  (`_row_split`), chunk ``b`` holding rows ``b * rows`` to ``(b + 1) * rows - 1`` of every
  stripe and the whole of every axis before ``axis``."""

  stripes: int
  chunks: int
  rows: int
  axis: int = 0


def _leaf_split(
  shape: tuple[int, ...], unit: int, limit: int, shard_multiple: int
) -> _Split | None:
  """`_row_split` along the first axis (but the last) whose chunks hold at most ``limit``
  values, the axes before it whole in each chunk; where none is, the axis of the smallest
  chunks; None where the leaf fits in ``limit`` values or no axis splits.

  ``unit`` is the rows of a block along the axis before the last, which chunks never cut.
  A leaf whose first axis is short (8 experts, a few stacked layers) walks its second
  one: split along the first alone, a chunk held a whole stripe of it.

  Example:
    >>> _leaf_split((32128, 768), 1, 1 << 20, 8)
    _Split(stripes=8, chunks=251, rows=16, axis=0)
    >>> _leaf_split((8, 512, 512), 1, 1 << 20, 8)
    _Split(stripes=8, chunks=2, rows=32, axis=1)
  """
  if len(shape) < 2 or math.prod(shape) <= limit:
    return None
  best = None
  for axis in range(len(shape) - 1):
    lead = math.prod(shape[:axis])
    rows = unit if axis == len(shape) - 2 else 1
    split = _row_split(shape[axis:], rows, max(1, limit // lead), shard_multiple)
    if split is None:
      continue
    size = math.prod(shape) // split[1]
    if size <= limit:
      return _Split(*split, axis)
    if best is None or size < best[0]:
      best = (size, _Split(*split, axis))
  return None if best is None else best[1]


def _stats_split(
  shape: tuple[int, ...], unit: int, chunk: int, shard_multiple: int, *, column_maxima: bool
) -> _Split | None:
  """`_leaf_split` of a leaf's streamed statistics: chunks of at most ``chunk`` values, and for
  a leaf that stores column maxima at least `_COLUMN_CHUNKS` of them.

  A small leaf (at most `_WHOLE_STATS_MOST` values) whose rows divide only into far more,
  thinner chunks than the floor asks (a prime row count: one row per chunk) computes them
  whole: walking its rows costs more time than the floor saves memory. A larger one walks
  them, whatever their count: whole, a 769 x 768 leaf's new moments took 8.3 bytes per value.

  Example:
    >>> _stats_split((4096, 16), 1, 1 << 20, 8, column_maxima=True)
    _Split(stripes=8, chunks=16, rows=32, axis=0)
    >>> _stats_split((4099, 16), 1, 1 << 20, 8, column_maxima=True) is None  # 4,099 rows
    True
  """
  if not column_maxima:
    return _leaf_split(shape, unit, chunk, shard_multiple)
  floor = min(chunk, max(1, math.prod(shape) // _COLUMN_CHUNKS))
  split = _leaf_split(shape, unit, floor, shard_multiple)
  if split is None or split[1] <= _COLUMN_CHUNKS_MOST or math.prod(shape) > _WHOLE_STATS_MOST:
    return split
  return None


def _chunk(x: jax.Array, split: _Split, rows: int, b: jax.Array) -> jax.Array:
  """Chunk ``b`` of `_leaf_split` of an array whose split axis holds ``rows`` leaf rows
  per row (a block's scales)."""
  stripes, chunks, chunk_rows, axis = split
  shape = jnp.shape(x)
  if shape[axis] * rows != stripes * chunks * chunk_rows:
    return x
  lead, tail = shape[:axis], shape[axis + 1 :]
  x = jnp.reshape(x, (*lead, stripes, chunks, chunk_rows // rows, *tail))
  x = jax.lax.dynamic_index_in_dim(x, b, axis=axis + 1, keepdims=False)
  return x.reshape(*lead, -1, *tail)


def _chunk_field(x: Any, split: _Split, shape: tuple[int, ...], b: jax.Array) -> Any:
  """Chunk ``b`` of `_leaf_split` of an array of a leaf of ``shape`` (the leaf itself or
  a stored field of it); one with fewer dimensions than the leaf (or None) whole."""
  if x is None or jnp.ndim(x) < len(shape):
    return x
  axis = split.axis
  return _chunk(x, split, shape[axis] // jnp.shape(x)[axis], b)


def _chunked_stats(fn: Callable, p: Any, g: Any, leaves: list, rest: tuple, split: Any) -> Any:
  """``fn(p, g, leaves, *rest)`` (block statistics), computed one chunk of rows at a time.

  A statistic with as many dimensions as the leaf holds one row per row or
  block of rows, gathered from the chunks; one with fewer (4-bit column
  maxima) spans every row, and the chunks' are combined by their maximum.
  """
  if split is None:
    return fn(p, g, leaves, *rest)
  stripes, chunks, _, axis = split

  def of(b: jax.Array) -> tuple:
    cut = functools.partial(_chunk_field, split=split, shape=jnp.shape(g), b=b)
    return cut(p), cut(g), jax.tree.map(cut, leaves)

  shapes, tree = jax.tree.flatten(jax.eval_shape(lambda b: fn(*of(b), *rest), jnp.int32(0)))
  spans = [len(s.shape) < jnp.ndim(g) for s in shapes]

  def body(maxima: list, b: jax.Array) -> tuple[list, list]:
    stats = jax.tree.leaves(fn(*of(b), *rest))
    maxima = [jnp.maximum(m, x) for m, x in zip(maxima, (x for x, w in zip(stats, spans) if w))]
    return maxima, [x for x, w in zip(stats, spans, strict=True) if not w]

  lowest = [jnp.full(s.shape, -jnp.inf, s.dtype) for s, w in zip(shapes, spans) if w]
  maxima, rows = jax.lax.scan(body, lowest, jnp.arange(chunks, dtype=jnp.int32))
  maxima, rows = iter(maxima), iter(rows)
  out = []
  for s, w in zip(shapes, spans, strict=True):
    if w:
      out.append(next(maxima))
      continue
    # A chunk's (*lead, stripes x rows, *tail), stacked over the chunks, in the leaf's order:
    # (*lead, stripes, chunks, rows, *tail).
    lead, tail = s.shape[:axis], s.shape[axis + 1 :]
    per = next(rows).reshape(chunks, *lead, stripes, -1, *tail)
    out.append(jnp.moveaxis(per, 0, axis + 1).reshape(*lead, -1, *tail))
  return tree.unflatten(out)


def _opaque(residuals: list) -> list:
  """The scalar residuals behind an optimization barrier.

  XLA's algebraic simplifier rounds a program differently by what it knows
  of the scalars (``m / c / d`` or ``m / (c * d)``; a scalar's other users
  in the step): seen as opaque values, they round the same in the update,
  the statistics (whole or in chunks, inside a loop) and the encoders, and
  as in the whole-tree update of the leaf alone.
  """
  return list(jax.lax.optimization_barrier(tuple(residuals))) if residuals else residuals


def _state_reads_param(program: Program) -> bool:
  """Whether ``program``'s new state (its outputs after the update) reads the param (input 0)."""
  refs = {"in", "val"}
  needed = {operand for operand in program.outs[1:] if operand[0] in refs}
  for _, _, ins, outs in reversed(program.ops):
    if any(("val", out) in needed for out in outs):
      needed.update(operand for operand in ins if operand[0] in refs)
  return ("in", 0) in needed


def _block_rows(g: Any, stored: list) -> int:
  """The rows of a block of ``stored`` leaves along the axis before the last (the least
  common multiple), as `_leaf_split` needs; 1 for a leaf without rows (that axis of length
  0), which has nothing to walk."""
  rows = [
    jnp.shape(g)[-2] // jnp.shape(x)[-2]
    for x in jax.tree.leaves(stored)
    if jnp.ndim(x) == jnp.ndim(g) >= 2 and jnp.shape(x)[-2]
  ]
  return math.lcm(1, *rows)


def _leaf_functions(
  program: Program,
  kinds: tuple[str, ...],
  rounded: tuple[bool, ...],
  blocks: tuple[Any, ...],
  guard: bool,
  split: _Split | None,
) -> tuple[Callable, Callable, Callable]:
  """``(step, branch, encoders)``: one leaf's streamed update, jitted, for `_streamed_update`.

  Each takes ``operands``: the leaf's param (None where its new state does
  not read it), gradient, stored state leaves, the group's scalar
  residuals, the step's rounding key and the inner leaves' indices
  (`_rounding_operands`).
  ``step(param, operands, ready)`` decodes the leaf's state and runs
  ``program`` to the update, reading the gradient after ``ready``;
  ``branch(operands)`` computes each new state leaf's block statistics
  (`_stats`, quantized modes; a chunk of rows at a time where ``split``
  says, `_chunked_stats`); ``encoders(operands, stats, new_param)``
  computes the new state again, from the gradient read through a select on
  the new param (so after it), and stores it as ``kinds`` say (a quantized
  leaf in its block of ``blocks``), hashing a
  leaf's stochastic-rounding bits (`_rounding_bits`) from the step's
  key and its index where ``rounded``. Leaves with the same program, kinds and
  shapes call the same three functions, which JAX traces and lowers once;
  their compiled encoders are the same too, and XLA compiles one kernel for
  all of them: nothing in them depends on the leaf but their operands (the
  indices are not constants there).
  """

  def new_values(
    p: Any,
    g: Any,
    leaves: list,
    residuals: list,
    *_: Any,
    lane: int = 0,
    lanes: int = 1,
    ready: jax.Array | None = None,
  ) -> list:
    """The program's outputs on columns ``lane::lanes``; the gradient read after ``ready``."""
    decoded = [
      _decode_lane(kind, leaf, lane, lanes) for kind, leaf in zip(kinds, leaves, strict=True)
    ]
    # Without the param, only the update reads it: a placeholder that XLA drops with it.
    p = jnp.zeros_like(g) if p is None else p
    if lanes > 1:
      p, g = p[..., lane::lanes], g[..., lane::lanes]
    if ready is not None:
      # A select that orders the reader after ``ready`` (always True: the same values), and
      # keeps XLA from merging this computation with another of the same values. It comes
      # after the cut into lanes: a select over the whole leaf before a strided slice keeps
      # XLA:CPU from vectorizing the encoder (10 times slower).
      g = jnp.where(ready, g, jnp.zeros_like(g))
    return run_program(program, [p, g, *decoded], _opaque(residuals), jnp.shape(g))

  def step(param: Any, operands: tuple, ready: jax.Array) -> Any:
    return new_values(param, *operands[1:], ready=ready)[0]

  def stats_of(p: Any, g: Any, leaves: list, residuals: list, shape: tuple[int, ...]) -> list:
    outs = new_values(p, g, leaves, residuals)
    return [
      _stats(kind, x, block, guard, shape)
      for kind, block, x in zip(kinds, blocks, outs[1:], strict=True)
    ]

  def branch(operands: tuple) -> list:
    p, g, leaves, residuals, *_ = operands
    return _chunked_stats(stats_of, p, g, leaves, (residuals, jnp.shape(g)), split)

  def encoders(operands: tuple, stats: list, new_param: Any) -> list:
    after = _after(new_param)
    # Codes read through the select too: decoded as the update decodes them, XLA:GPU computes
    # the float32 state once for both and holds it whole between them. Only the codes: the
    # scales through a select keep XLA:CPU from vectorizing the 4-bit encoder (3 times slower),
    # and a bfloat16 leaf's decode, a convert, XLA:GPU recomputes.
    p, g, leaves, *rest = operands
    shared_key, leaf_ids = rest[-2:]
    gated = [
      leaf._replace(codes=jnp.where(after, leaf.codes, jnp.zeros_like(leaf.codes)))
      if kind in _CODECS
      else leaf
      for kind, leaf in zip(kinds, leaves, strict=True)
    ]
    operands = (p, g, gated, *rest)
    by_lanes: dict[int, list] = {}
    out = []
    for k, (kind, block, leaf_stats, leaf_id) in enumerate(
      zip(kinds, blocks, stats, leaf_ids, strict=True)
    ):
      lanes = _CODECS[kind].lanes if kind in _CODECS else 1
      if lanes not in by_lanes:
        by_lanes[lanes] = [
          new_values(*operands, lane=lane, lanes=lanes, ready=after) for lane in range(lanes)
        ]
      xs = [outs[1 + k] for outs in by_lanes[lanes]]
      if kind in _CODECS:
        out.append(_CODECS[kind].encode_lanes(xs, block, guard, leaf_stats))
        continue
      bits = _rounding_bits(xs[0], shared_key, leaf_id) if rounded[k] else None
      out.append(_encode(kind, xs[0], bits, block, guard))
    return out

  return jax.jit(step), jax.jit(branch), jax.jit(encoders)


def _streamed_update(
  plan: FusedPlan,
  updates: Any,
  state: LowPrecisionState,
  params: Any,
  extra_args: dict[str, Any],
  count: jax.Array,
  *,
  blocks: Sequence[Any],
  guard: bool,
  chunk: int,
  shard_multiple: int,
  dtypes: list[Any] | None,
) -> tuple[Any, Any]:
  """``(updates, new stored inner state)``, computed one param leaf at a time.

  For each leaf, three parts (`_leaf_functions`), none holding a float32
  copy of the leaf:

  * its update, computed from the decoded state beside the caller's
    ``optax.apply_updates`` of the leaf, which XLA's common-subexpression
    elimination merges with the one here into one elementwise pass that
    writes the new param over the old one: no float32 update is held. It
    reads the gradient through a select on the previous leaf's new param,
    so that in a whole train step it runs in leaf order, after
    the backward pass has read the param, not as soon as its gradient
    exists (then XLA keeps a copy of the param);
  * its new state's block statistics, in a conditional whose predicate
    reads the previous leaf's new param (`_after`): a conditional's branch
    runs as a whole, after its predicate, so the leaves' statistics run one
    after the other whatever order the compiler's scheduler prefers
    (optimization barriers do not order work on every backend: XLA:CPU
    removes them before scheduling); a leaf larger than ``chunk`` values,
    or one that stores column maxima (in `_COLUMN_CHUNKS` chunks at least,
    `_stats_split`),
    computes them a chunk of rows at a time (`_leaf_split`,
    `_chunked_stats`), in stripes that follow the walked dimension's
    shards;
  * its encoders, which read the branch's statistics and the gradient
    through a select on the new param, compute the new state again, elementwise, and
    write each stored leaf over the old one: they read the old codes at the
    index where they write (`_Codec.lanes`), which nothing reads after them.

  Leaves whose programs, storage and shapes agree call the same jitted
  functions, which JAX traces and lowers once: the traced program holds the
  codecs once per leaf shape, not once per leaf.
  """
  p_leaves, params_def = jax.tree.flatten(params)
  g_leaves = jax.tree.leaves(updates)
  stored, stored_def = jax.tree.flatten(state.inner_state, is_leaf=_is_quantized)
  extra_leaves, _ = split_extras(extra_args)
  mirrors_absent = [s if j is None else None for s, j in zip(stored, plan.slots, strict=True)]
  values = eval_outside(plan, [*p_leaves, *g_leaves, *mirrors_absent, *extra_leaves, *plan.consts])
  globals_ = iter(a.value if isinstance(a, Lit) else values[a] for a in plan.global_outs)
  new_stored = [leaf if j is not None else next(globals_) for leaf, j in zip(stored, plan.slots)]
  group_of = {i: group for group in plan.groups for i in group.leaves}
  shared_key, leaf_ids = _rounding_operands(state, count)
  functions: dict[tuple, tuple[Callable, Callable, Callable]] = {}
  new_updates, done = [], []
  for i, (p, g) in enumerate(zip(p_leaves, g_leaves, strict=True)):
    ks = [k for k, j in enumerate(plan.slots) if j == i]
    program = group_of[i].program
    residuals = [jnp.asarray(values[r]) for r in group_of[i].residuals]
    kinds = tuple(state.storage[k] for k in ks)
    rounded = tuple(_rounded(state, k) for k in ks)
    leaf_blocks = tuple(blocks[k] for k in ks)
    old = [new_stored[k] for k in ks]
    column_maxima = any(isinstance(x, Rank1Quantized4Leaf) for x in old)
    split = _stats_split(
      jnp.shape(g), _block_rows(g, old), chunk, shard_multiple, column_maxima=column_maxima
    )
    key = (id(group_of[i]), kinds, rounded, leaf_blocks, split)
    if key not in functions:
      functions[key] = _leaf_functions(program, kinds, rounded, leaf_blocks, guard, split)
    step, branch, encoders = functions[key]
    # The param goes to the branch and the encoders only if the new state reads it: the
    # update writes the new param over it first.
    state_param = p if _state_reads_param(program) else None
    operands = (state_param, g, old, residuals, shared_key, [leaf_ids[k] for k in ks])
    ready = _after(_latest_alike(done, [p, g, old, residuals], g))
    # The update waits for the previous leaf's new param, as the statistics do: left free,
    # XLA may schedule it while the backward pass still reads the param, and copy the param.
    update = step(p, operands, ready)
    if dtypes is not None:
      update = update.astype(dtypes[i])
    new_updates.append(update)
    stats = [None] * len(ks)
    if any(kind in _CODECS for kind in kinds):
      stats = jax.lax.cond(
        ready,
        branch,
        functools.partial(_unchanged, branch.eval_shape(operands)),
        operands,
      )
    # The caller's ``optax.apply_updates`` of the leaf, merged with this one by XLA.
    done.append(optax.apply_updates(p, update))
    for k, encoded in zip(ks, encoders(operands, stats, done[-1]), strict=True):
      new_stored[k] = encoded
  return jax.tree.unflatten(params_def, new_updates), stored_def.unflatten(new_stored)


def low_precision(
  inner: optax.GradientTransformation,
  state_dtype: str = _8BIT,
  *,
  stochastic_rounding: bool = True,
  block_size: int | None = None,
  shard_multiple: int = _SHARD_MULTIPLE,
  min_size: int = 4096,
  states: str | None = None,
  seed: int = 0,
  stream: bool = True,
  stream_chunk: int = 1 << 20,
  guard_nonfinite: bool = True,
  param_modes: Sequence[tuple[str, str]] = (),
  param_axes: Any = None,
) -> optax.GradientTransformationExtraArgs:
  """Stores ``inner``'s param-shaped state in bfloat16, 8 or 4 bits between steps.

  See the module docstring for the modes. In gin:
  ``optimizers.low_precision.inner = @optax.adamw()`` and
  ``optimizers.low_precision.state_dtype = '8bit'``; ready configs are
  ``optimizers/adamw_8bit.gin``, ``optimizers/adamw_4bit.gin`` and
  ``optimizers/adamw_bf16_sr.gin``.

  Args:
    inner: the optax transformation whose state is compressed.
    state_dtype: ``"8bit"``, ``"4bit"`` or ``"bfloat16"``.
    stochastic_rounding: bfloat16 mode: round stochastically (else to nearest).
      False while neither ``state_dtype`` nor a ``param_modes`` mode is
      bfloat16 is a warning: it rounds nothing.
    block_size: 8-bit and 4-bit modes: the largest block (see `leaf_block`
      and `leaf_block4`); None: the mode's own, 256 (8-bit) or 128 (4-bit).
      Given while neither ``state_dtype`` nor a ``param_modes`` mode is 8-bit
      or 4-bit, a warning: it sizes no block.
    shard_multiple: 8-bit and 4-bit modes: each leaf's block count is a multiple of
      ``gcd(shape[-1], shard_multiple)``, so the scales shard along the last
      dimension wherever the codes do over up to that many devices; a 4-bit
      block of several rows tiles the dimension before it likewise.
    min_size: leaves with fewer elements stay as they are.
    states: a regular expression; only inner leaves whose state path (e.g.
      ``0/mu/dense/kernel``) it matches are compressed, and each must be a
      floating param-shaped mirror. None: every such leaf.
    seed: the seed of the stochastic-rounding bits.
    stream: decode, update and encode one param leaf at a time when the
      update is elementwise per leaf (`plan_fused_update` proves it); False
      (or an update that is not) expands the whole state to float32 at once,
      which is what the step's peak then holds.
    stream_chunk: the most values of a leaf whose new state the streamed
      update holds in float32 at once, to compute its block statistics: a
      larger leaf of 2 or more dimensions is walked in chunks of rows of
      its first dimension (an embedding of 32128 x 768 in 251 chunks of 8
      x 16 rows with the default 2**20). A 4-bit leaf that stores column
      maxima walks at least 16 chunks, however small (a 768 x 768 leaf 16
      of 8 x 6 rows), but for a leaf of at most 131,072 values whose rows
      divide only into more than 64 (a prime count): whole. The values are
      the same either way.
    guard_nonfinite: 8-bit and 4-bit modes: an inf or NaN in the new state damages only
      its own element (`quantize`), by selects inside the reduction that
      computes the block scales, which cost no memory. False: an inf or NaN
      damages its block, and a NaN in a 4-bit leaf that stores column
      maxima also its column's unsigned elements, whether the statistics
      run whole or in chunks of rows, for an optimizer that refuses such
      steps anyway (``optax.apply_if_finite(low_precision(...))``).
    param_modes: a per-param precision policy: ``(pattern, mode)`` pairs, a
      pattern and ``"float32"`` or a ``state_dtype``. A pattern is a regular
      expression searched in the param's path (e.g.
      ``encoder/layers_0/mlp/wi/kernel``), or ``axis:<regex>``, which
      selects the params with a logical axis whose whole name the regular
      expression matches (``axis:vocab``: the token embedding, ``('vocab',
      'embed')``, and untied logits, ``('embed', 'vocab')``). The first pair
      that selects a param sets the mode of its state leaves, and the others
      take ``state_dtype`` (e.g. ``(("axis:vocab", "float32"), ("mlp",
      "4bit"))`` with ``state_dtype="8bit"``). ``min_size`` applies first: a
      param below it, or 0-d, keeps its state whatever its mode. A pattern that
      decides no param's mode (its params all taken by earlier patterns or kept
      by ``min_size``) is a warning at ``init``; one that gives a mode other
      than ``"float32"`` to a param whose state is not floating (complex)
      is refused there. ``leaf_storage`` and
      ``t5x-optim plan`` show each leaf's mode and the pattern that chose it.
    param_axes: the params' logical axes, which ``axis:`` patterns read: a
      tree of `PartitionSpec`s or name tuples (None: no axes), params boxed
      by ``nn.with_logical_partitioning``, or a T5X ``params_axes``
      collection. An optimizer definition built on the transformation
      (`OptaxWrapper`, ``optimizers.chain``, ``optimizers.muon``'s
      ``wrap_transformation``) gives them in T5X's ``set_param_axes``
      instead, which T5X's train state, `TrainState.create` and
      `partitioning.init_sharded` call. Unused without ``axis:`` patterns.

  Returns:
    The wrapped transformation; its state is a `LowPrecisionState`. With an
    ``axis:`` pattern it is an `AxesAwareTransformation`, which
    ``with_param_axes`` builds again for given axes.

  Raises:
    ValueError: for an unknown ``state_dtype`` or mode in ``param_modes``,
      an ``axis:`` pattern without an axis, or a non-positive
      ``block_size``; at ``init``, when ``states`` selects a leaf the mode
      does not apply to (naming its path) or no leaf, when an ``axis:``
      pattern finds no axes given (naming each such pattern), or when the
      axes lack a param or disagree with its rank (naming it).

  Example:
    >>> import jax.numpy as jnp, optax
    >>> tx = low_precision(optax.adamw(1e-3), "bfloat16", min_size=0)
    >>> state = tx.init({'w': jnp.zeros((4, 4))})
    >>> state.inner_state[0].nu['w'].dtype, state.storage
    (dtype(bfloat16), ('kept: not param-shaped', 'bfloat16', 'bfloat16'))

    The token embedding's state kept in float32 by its logical axis:

    >>> from jax.sharding import PartitionSpec as P
    >>> params = {'embedding': jnp.zeros((64, 8)), 'wi': jnp.zeros((8, 64))}
    >>> tx = low_precision(optax.adam(1e-3), "4bit", min_size=0,
    ...     param_modes=[('axis:vocab', 'float32')],
    ...     param_axes={'embedding': P('vocab', 'embed'), 'wi': P('embed', 'mlp')})
    >>> tx.init(params).storage
    ('kept: not param-shaped', "float32: param_modes 'axis:vocab'", '4bit', "float32: param_modes 'axis:vocab'", '4bit')
  """
  if isinstance(param_modes, Iterator):  # Read twice below (checked, then made rules).
    param_modes = tuple(param_modes)
  # Every argument as given, before any other local exists: an axis rule rebuilds with them.
  arguments = dict(locals())
  if state_dtype not in LOW_PRECISION_MODES:
    raise ValueError(
      f"low_precision: state_dtype must be one of {LOW_PRECISION_MODES}, got {state_dtype!r}."
    )
  rules = _param_rules(param_modes)
  specs = None if param_axes is None else specs_by_path(logical_axes_from(param_axes))
  if (block_size is not None and block_size < 1) or shard_multiple < 1:
    raise ValueError(
      f"low_precision: block_size and shard_multiple must be positive, got {block_size} "
      f"and {shard_multiple}."
    )
  if stream_chunk < 1:
    raise ValueError(f"low_precision: stream_chunk must be positive, got {stream_chunk}.")
  for unused in _unused_settings(
    state_dtype, rules, block_size=block_size, stochastic_rounding=stochastic_rounding
  ):
    warn(unused)

  def block(mode: str, shape: tuple[int, ...]) -> Any:
    codec = _CODECS[mode]
    size = codec.block_size if block_size is None else block_size
    return codec.leaf_block(tuple(shape), block_size=size, shard_multiple=shard_multiple)

  inner = optax.with_extra_args_support(checked_transformation(inner, "low_precision's inner"))

  def init(params: Any) -> LowPrecisionState:
    axes = _param_axis_names(rules, specs, params)
    _warn_of_unused_rules(rules, params, axes, min_size=min_size)
    inner_state = inner.init(params)
    storage, param_index, chosen_by = _plan_storage(
      state_dtype,
      inner_state,
      params,
      min_size=min_size,
      states=states,
      block=block,
      mirrors=_mirror_params(inner.init, inner_state, params),
      copies=_param_copies(inner.init, params, inner_state),
      accumulators=_accumulators(inner_state),
      fields=_kept_fields(inner_state),
      param_modes=rules,
      axes=axes,
    )
    _warn_if_nothing_is_compressed(
      state_dtype, inner_state, storage, min_size=min_size, states=states, param_modes=rules
    )
    blocks = tuple(
      block(kind, jnp.shape(leaf)) if kind in _CODECS else None
      for leaf, kind in zip(jax.tree.leaves(inner_state), storage, strict=True)
    )
    state = LowPrecisionState(
      count=jnp.zeros([], jnp.int32),
      inner_state=inner_state,
      storage=storage,
      param_index=param_index,
      stochastic_rounding=stochastic_rounding,
      seed=seed,
      rules=chosen_by,
      blocks=blocks,
    )
    # The inner init is mostly constants (zeros): encoding them under jit lets XLA
    # constant-fold the codec, which took 100 s for 32 leaves on CPU. Multiplying by a
    # one that XLA cannot see through keeps the values and the fusion of the init into
    # the encoders (no float32 copy of the state).
    one, count = jax.lax.optimization_barrier((jnp.ones([], jnp.float32), state.count))
    fresh = jax.tree.map(
      lambda x: x * one.astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
      inner_state,
    )

    def encode(fresh: Any, count: jax.Array) -> Any:
      return _compress(fresh, state, count, blocks=blocks)

    return state.replace(inner_state=_in_stored_layouts(encode, fresh, count))

  def update(
    updates: Any, state: LowPrecisionState, params: Any = None, **extra_args: Any
  ) -> tuple[Any, LowPrecisionState]:
    # With Explicit mesh axes Auto: a quantized leaf's codes and scales are laid out apart, as
    # a ZeRO moment and its gradient are, and Explicit axes refuse an operation on both. The
    # new updates and state come back in the layouts of the ones they replace.
    return auto_axes_like(update_leaves, (updates, state))(updates, state, params, **extra_args)

  def update_leaves(
    updates: Any, state: LowPrecisionState, params: Any = None, **extra_args: Any
  ) -> tuple[Any, LowPrecisionState]:
    count = optax.safe_int32_increment(state.count)
    widened = any(_narrow_range(x) for x in jax.tree.leaves(updates))
    dtypes = _inner_update_dtypes(inner, updates, state, params, extra_args, widened=widened)
    if widened:
      updates, params = _in_float32_range(updates), _in_float32_range(params)
    new_updates, inner_state = _stored_update(updates, state, params, count, dtypes, extra_args)
    if widened:
      inner_state = _in_stored_dtypes(inner_state, state.inner_state)
    return new_updates, state.replace(count=count, inner_state=inner_state)

  def _stored_update(
    updates: Any,
    state: LowPrecisionState,
    params: Any,
    count: jax.Array,
    dtypes: list[Any] | None,
    extra_args: dict[str, Any],
  ) -> tuple[Any, Any]:
    """The updates (in `dtypes` where given) and the new stored inner state, in the blocks
    of the stored one (`_stored_blocks`)."""
    blocks = _stored_blocks(state)
    plan = _stream_plan(inner, updates, state, params, extra_args) if stream else None
    if plan is not None:
      return _streamed_update(
        plan,
        updates,
        state,
        params,
        extra_args,
        count,
        blocks=blocks,
        guard=guard_nonfinite,
        chunk=stream_chunk,
        shard_multiple=shard_multiple,
        dtypes=dtypes,
      )
    new_updates, inner_state = inner.update(updates, _expand(state), params, **extra_args)
    if dtypes is not None:
      leaves, treedef = jax.tree.flatten(new_updates)
      new_updates = treedef.unflatten([u.astype(d) for u, d in zip(leaves, dtypes, strict=True)])
    return new_updates, _compress(inner_state, state, count, blocks=blocks, guard=guard_nonfinite)

  tx = optax.GradientTransformationExtraArgs(init, update)
  if not any(rule.by_axis for rule in rules):
    return tx
  return AxesAwareTransformation.of(
    tx, lambda axes: low_precision(**{**arguments, "param_axes": axes})
  )


def leaf_storage(param_states: Any) -> dict[tuple[str, ...], str]:
  """How each leaf inside a `LowPrecisionState` of ``param_states`` is stored.

  Keys are state-dict paths below ``param_states`` (as tuples of keys; over
  a flax ``nnx.State`` those of its ``nnx.to_pure_dict``, without ``value``);
  values are ``"bfloat16"``, the mode and field of a quantized leaf's
  arrays (``"8bit codes"``, ``"8bit scales"``, ``"4bit codes"``, ``"4bit
  scales"``, ``"4bit cols"``), or why a leaf is kept as it
  is (``"float32: below min_size"``, ``"float32: no 8-bit block of 4 or
  more values tiles the last dimension"`` (see `leaf_block` and
  `leaf_block4`), ``"kept: not param-shaped"``, ``"float32: 0-d"``, ...; an uncompressed leaf's
  label names the dtype it keeps: ``"bfloat16: below min_size"`` for
  bfloat16 params' adam state). Leaves outside a `LowPrecisionState` are
  absent.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> state = low_precision(optax.sgd(0.1, momentum=0.9), min_size=0).init(
    ...     {'w': jnp.zeros((2, 8))})
    >>> leaf_storage(state)
    {('count',): 'kept: not param-shaped', ('inner_state', '0', 'trace', 'w', 'codes'): '8bit codes', ('inner_state', '0', 'trace', 'w', 'scales'): '8bit scales'}
  """

  def is_node(x: Any) -> bool:
    return isinstance(x, LowPrecisionState)

  out: dict[tuple[str, ...], str] = {}
  for path, node in jax.tree.flatten_with_path(param_states, is_leaf=is_node)[0]:
    if not is_node(node):
      continue
    prefix = _state_dict.key_path_parts(path)
    out[(*prefix, "count")] = _KEPT_NOT_MIRROR
    flat = jax.tree.flatten_with_path(to_pure(node.inner_state), is_leaf=_is_quantized)[0]
    for i, ((leaf_path, stored), kind) in enumerate(zip(flat, node.storage, strict=True)):
      parts = (*prefix, "inner_state", *_state_dict.key_path_parts(leaf_path))
      rule = node.rules[i] if i < len(node.rules) else ""
      why = f" (param_modes {rule!r})" if rule and kind in LOW_PRECISION_MODES else ""
      if kind in _CODECS:
        for field in stored._fields:
          out[(*parts, field)] = f"{kind} {field}{why}"
      elif why:
        out[parts] = f"{kind}{why}"
      else:
        out[parts] = kind
  return out


def low_precision_to_float32(param_states: Any) -> Any:
  """``param_states`` with every `LowPrecisionState` replaced by its float32 inner state.

  Compressed leaves are expanded back to their float32 values; the result is
  the state of the wrapped transformation alone (e.g. to restore into an
  `OptaxWrapper` of ``inner``: its state dict has that optimizer's keys).

  Example:
    >>> import jax.numpy as jnp, optax
    >>> tx = low_precision(optax.adam(1e-3), "8bit", min_size=0)
    >>> inner = low_precision_to_float32(tx.init({'w': jnp.ones((2, 4))}))
    >>> inner[0].mu['w'].dtype
    dtype('float32')
  """

  def is_node(x: Any) -> bool:
    return isinstance(x, LowPrecisionState)

  return jax.tree.map(lambda x: _expanded(x) if is_node(x) else x, param_states, is_leaf=is_node)


def low_precision_sum_squares(param_states: Any, *, chunk: int = 1 << 20) -> Any:
  """The sum of squares of each leaf of `low_precision_to_float32`'s result, in float32.

  Each compressed leaf is decoded at most ``chunk`` values at a time (rows of
  whole blocks, in stripes along the shards of its first dimension, or of its
  second where the first is short, as the streamed update walks it; at least a
  block of rows per stripe; a 1-D leaf's runs of whole
  blocks, as many per stripe as fit), and one leaf after another: each leaf's sum is
  computed in a conditional whose predicate reads the previous one's, so the
  temporaries stay within one chunk in float32 whatever order the compiler's
  scheduler prefers. ``jnp.sum(jnp.square(...))`` of the decoded state holds
  it in float32 instead (XLA:CPU decodes a leaf whole before reducing it).
  Leaves outside a `LowPrecisionState`, and those it keeps, are summed as
  they are. Called outside `jax.jit`, each state's sums are one program,
  compiled once for its structure.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> tx = low_precision(optax.sgd(0.1, momentum=0.9), min_size=0)
    >>> params = {'w': jnp.ones((2, 8))}
    >>> state = tx.update(params, tx.init(params), params)[1]
    >>> float(low_precision_sum_squares(state)[0].trace['w'])
    16.0
  """

  def is_node(x: Any) -> bool:
    return isinstance(x, LowPrecisionState)

  def sums(node: Any) -> Any:
    if not is_node(node):
      return jax.tree.map(_sum_squares, node)
    treedef = jax.tree.structure(node.inner_state, is_leaf=_is_quantized)
    # Called eagerly, one program, compiled once per state structure: each leaf's
    # conditional would otherwise compile its new branches at every call.
    traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(node))
    state_sums = _state_sum_squares if traced else _state_sum_squares_jitted
    mesh = explicit_mesh(node)
    if mesh is None:
      return treedef.unflatten(state_sums(node, chunk))
    # Explicit axes refuse a decoder that reads codes and scales laid out apart.
    replicated = [NamedSharding(mesh, PartitionSpec())] * treedef.num_leaves
    call = functools.partial(state_sums, chunk=chunk)
    return treedef.unflatten(auto_axes_call(call, replicated, node))

  return jax.tree.map(sums, param_states, is_leaf=is_node)


def _state_sum_squares(state: LowPrecisionState, chunk: int) -> list[jax.Array]:
  """`low_precision_sum_squares` of one state: a float32 scalar per inner leaf.

  Raises:
    ValueError: from `_stored_blocks`, for a leaf whose block does not encode
      its values in the arrays it has.
  """
  _stored_blocks(state)
  leaves = jax.tree.leaves(state.inner_state, is_leaf=_is_quantized)
  done, out = [], []
  for leaf, kind in zip(leaves, state.storage, strict=True):
    if kind not in _CODECS:
      out.append(_sum_squares(leaf))
      continue
    total = jax.lax.cond(
      _after(_latest_alike(done, leaf, jnp.asarray(state.count))),
      functools.partial(_streamed_sum_squares, kind, chunk),
      _no_sum,
      leaf,
    )
    out.append(total)
    done.append(total)
  return out


_state_sum_squares_jitted = jax.jit(_state_sum_squares, static_argnames="chunk")


def _no_sum(stored: Any) -> jax.Array:
  """A float32 zero that varies over the manual mesh axes the arrays of ``stored`` do: the
  branch of `_state_sum_squares`' conditional that never runs."""
  return sum(jnp.zeros_like(x, jnp.float32).sum() for x in stored)


def _sum_squares(x: Any) -> jax.Array:
  return jnp.sum(jnp.square(jnp.asarray(x, jnp.float32)))


def _streamed_sum_squares(kind: str, chunk: int, stored: Any) -> jax.Array:
  """The sum of squares of a compressed leaf's values, decoded a chunk of rows at a time
  (a 1-D leaf's: runs of whole blocks, `_rows_of_blocks`)."""
  shape = _CODECS[kind].shape(stored)
  if len(shape) == 1 and math.prod(shape) > chunk:
    stored = _rows_of_blocks(stored)
    shape = _CODECS[kind].shape(stored)
  rows = _block_rows(jax.ShapeDtypeStruct(shape, jnp.float32), [stored])
  split = _leaf_split(shape, rows, chunk, _SHARD_MULTIPLE)
  if split is None:
    return _sum_squares(_decode(kind, stored))

  def body(total: jax.Array, b: jax.Array) -> tuple[jax.Array, None]:
    cut = functools.partial(_chunk_field, split=split, shape=shape, b=b)
    return total + _sum_squares(_decode(kind, jax.tree.map(cut, stored))), None

  chunks = jnp.arange(split.chunks, dtype=jnp.int32)
  return jax.lax.scan(body, jnp.zeros([], jnp.float32), chunks)[0]


def _rows_of_blocks(stored: Any) -> Any:
  """A stored 1-D leaf as the stored matrix whose rows are its blocks: the same values, in
  rows of one block, and each field's array reshaped to a row per block.

  Example:
    >>> import jax.numpy as jnp
    >>> leaf = quantize(jnp.arange(8.0), 4)
    >>> [x.shape for x in _rows_of_blocks(leaf)]
    [(2, 4), (2, 1)]
  """
  blocks = jnp.shape(stored.scales)[0]
  return type(stored)(*(jnp.reshape(x, (blocks, -1)) for x in stored))


def _expanded(state: LowPrecisionState) -> Any:
  """`_expand`, with Explicit mesh axes Auto: each float32 leaf in its stored codes' layout.

  A quantized leaf's scales are laid out apart from its codes (`_state_rule`),
  and its decoder combines the two, which Explicit axes refuse.
  """
  leaves, treedef = jax.tree.flatten(state.inner_state, is_leaf=_is_quantized)
  like = treedef.unflatten([leaf.codes if _is_quantized(leaf) else leaf for leaf in leaves])
  return auto_axes_like(_expand, like)(state)


def float32_to_low_precision(param_states: Any, like: Any) -> Any:
  """The inverse of `low_precision_to_float32`: compresses a float32 state like ``like``.

  Args:
    param_states: a float32 state: ``like`` with every `LowPrecisionState`
      replaced by the wrapped transformation's state.
    like: a state of the low-precision optimizer (e.g. from ``init``): where
      its `LowPrecisionState`s sit and how each leaf is stored.

  Returns:
    ``like``'s structure holding ``param_states``' values, compressed; the
    leaves ``like`` keeps uncompressed (step counters, a bfloat16 param's
    moments too small for a block) in ``like``'s dtypes; the step counts of
    ``like`` are kept.

  Raises:
    ValueError: naming the path and both sides, when ``param_states`` does
      not have the structure or shapes of ``like``'s float32 state, or holds
      a leaf a restore refuses: data of another kind (complex data for a
      real leaf), or values that do not fit a leaf ``like`` keeps in a
      narrower dtype (beyond a float16 or bfloat16 leaf's range, a step
      count that is not a whole number). Values are checked only where
      they are concrete: under ``jax.jit`` they are cast unchecked (a value
      beyond a float16 leaf's range becomes inf).

  Example:
    >>> import jax.numpy as jnp, optax
    >>> tx = low_precision(optax.adam(1e-3), "8bit", min_size=0)
    >>> like = tx.init({'w': jnp.ones((2, 4))})
    >>> back = float32_to_low_precision(low_precision_to_float32(like), like)
    >>> back.inner_state[0].nu['w'].codes.shape
    (2, 4)
  """

  def is_node(x: Any) -> bool:
    return isinstance(x, LowPrecisionState)

  nodes, outer = jax.tree.flatten(like, is_leaf=is_node)
  try:
    values = outer.flatten_up_to(param_states)
  except (ValueError, TypeError) as e:
    raise ValueError(
      f"float32_to_low_precision: the float32 state does not have the structure of "
      f"the low-precision state's outer part: {outer} vs {jax.tree.structure(param_states)}"
    ) from e
  out = []
  for node, value in zip(nodes, values, strict=True):
    if not is_node(node):
      out.append(value)
      continue
    shapes = _expanded_shapes(node)
    expected = jax.tree.structure(shapes)
    if jax.tree.structure(value) != expected:
      raise ValueError(
        f"float32_to_low_precision: the float32 inner state has structure "
        f"{jax.tree.structure(value)}, the low-precision state expects {expected}."
      )
    cast = []
    for (path, got), want in zip(
      jax.tree.leaves_with_path(value), jax.tree.leaves(shapes), strict=True
    ):
      dtype = jnp.result_type(got)
      fit = _state_dict.leaf_fit(jnp.shape(got), dtype, want.shape, want.dtype)
      misfit = ""
      if fit.values_decide and not isinstance(got, jax.core.Tracer):
        misfit = _state_dict.range_problem(got, want.dtype) or (
          "" if _state_dict.values_fit(got, want.dtype) else f"not all {fit.misfit} {want.dtype}"
        )
      if fit in (_state_dict.Fit.OTHER_SHAPE, _state_dict.Fit.OTHER_DTYPE) or misfit:
        raise ValueError(
          f"float32_to_low_precision: at '{_state_dict.key_path_str(path)}': "
          f"{dtype}{list(jnp.shape(got))} in the float32 state, "
          f"the low-precision state holds {want.dtype}{list(want.shape)} there"
          + (f": {misfit}." if misfit else ".")
        )
      cast.append(got if dtype == want.dtype else jnp.asarray(got, want.dtype))
    value = jax.tree.unflatten(expected, cast)

    def compress(value: Any, node: LowPrecisionState, blocks: list = _stored_blocks(node)) -> Any:
      return _compress(value, node, node.count, blocks=blocks)

    # With Explicit mesh axes Auto: each stored leaf in the layout of the one it replaces.
    out.append(node.replace(inner_state=auto_axes_like(compress, node.inner_state)(value, node)))
  return outer.unflatten(out)


def _scales_spec(spec: Any, codes_shape: tuple[int, ...], scales_shape: tuple[int, ...]) -> Any:
  """The codes' spec for the scales; an axis is dropped where one block spans it."""
  if spec is None or spec is specs_lib.UNDERIVED:
    return spec
  one_block = [s == 1 and c != 1 for s, c in zip(scales_shape, codes_shape, strict=True)]
  if len(spec) == len(one_block) and any(one_block):
    axes = [None if single else axis for axis, single in zip(spec, one_block, strict=True)]
    return specs_lib.canonical(PartitionSpec(*axes), len(scales_shape))
  return spec


def _cols_spec(spec: Any, rank: int) -> Any:
  """The spec of a 4-bit leaf's column maxima: its codes' last dimension's."""
  if spec is None or spec is specs_lib.UNDERIVED:
    return spec
  # A spec may stop before the last dimension (``P()``: replicated), which it leaves whole.
  last = spec[rank - 1] if len(spec) >= rank else None
  return specs_lib.canonical(PartitionSpec(last), 1)


def _quantized_spec(leaf: Any, codes: Any) -> Any:
  """A quantized leaf's spec from its codes' (`leaf`'s type): the scales on their block
  dimension, a 4-bit leaf's column maxima on its last dimension."""
  shape = specs_lib.leaf_shape(leaf.codes)
  scales = _scales_spec(codes, shape, specs_lib.leaf_shape(leaf.scales))
  cols = () if len(leaf) == 2 else (_cols_spec(codes, len(shape)),)
  return type(leaf)(codes, scales, *cols)


def _state_rule(
  state: LowPrecisionState, specs: LowPrecisionState, context: registry.StateRuleContext
) -> LowPrecisionState:
  """Each inner leaf gets the spec it has in the inner state uncompressed.

  Specs are derived on the float32 inner state (`_expanded_shapes`), where
  the moments mirror the params and the inner state's rules (GaLore's
  projected moments) see the state they were written for. A compressed
  leaf's codes get that spec (its param's, if none is derived); its scales
  too, on their block dimension; a 4-bit leaf's column maxima that of its
  last dimension.
  """
  param_specs = jax.tree.leaves(context.param_specs, is_leaf=is_spec_leaf)
  leaves, treedef = jax.tree.flatten(state.inner_state, is_leaf=_is_quantized)
  stored = treedef.flatten_up_to(specs.inner_state)
  # Without params no generic derivation ran: the structure step gave the stored specs, and
  # the view's redoes it over the whole inner state.
  known = [
    specs_lib.UNDERIVED if kind in _CODECS or context.params is None else spec
    for spec, kind in zip(stored, state.storage, strict=True)
  ]
  derived = view_specs(_expanded_shapes(state), known, context)
  out = []
  for leaf, spec, kind, j in zip(leaves, derived, state.storage, state.param_index, strict=True):
    if kind in _CODECS and 0 <= j < len(param_specs):
      shape = specs_lib.leaf_shape(leaf.codes)
      spec = _quantized_spec(leaf, _codes_spec(spec, param_specs[j], len(shape)))
    elif spec is specs_lib.UNDERIVED and kind not in (
      _KEPT_NOT_MIRROR,
      _KEPT_NOT_FLOAT,
      *_KEPT_FIELD_LABELS,
    ):
      spec = specs_lib.canonical(param_specs[j], len(specs_lib.leaf_shape(leaf)))
    out.append(spec)
  return specs.replace(count=None, inner_state=treedef.unflatten(out))


def _codes_spec(derived: Any, param_spec: Any, rank: int) -> Any:
  """A compressed leaf's codes' spec: the one derived for the leaf, else its param's.

  >>> _codes_spec(specs_lib.UNDERIVED, PartitionSpec('embed'), 2)
  P('embed', None)
  """
  return specs_lib.canonical(param_spec if derived is specs_lib.UNDERIVED else derived, rank)


registry.register_state_rule(LowPrecisionState, _state_rule)
