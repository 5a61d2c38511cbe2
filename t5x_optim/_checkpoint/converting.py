"""Restoring a checkpoint written with one optimizer into a train state with another."""

from __future__ import annotations

import functools
import logging
import os
import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import traverse_util

from t5x_optim._adapters.multi_optimizer import with_param_axes
from t5x_optim._adapters.optax_wrapper import is_transformation, trains_lookahead_params
from t5x_optim._checkpoint import store as _checkpoints
from t5x_optim._checkpoint import t5x_read as _t5x
from t5x_optim._convert import convert as _convert
from t5x_optim._core.interface import Optimizer, OptimizerDef
from t5x_optim._core.placement import placed_as_target
from t5x_optim._nnx import refuse
from t5x_optim._training.train_state import TrainState

__all__ = ["restore_converted"]

State = TrainState | Optimizer
_log = logging.getLogger("t5x_optim.checkpoints")


class _StoredStateDict:
  """A restore target that is the checkpoint's own state dict (T5X format only).

  Its `state_dict` lists every stored array as a `jax.ShapeDtypeStruct`, so
  `restore_opened` reads them all, and `restore_state` returns the state
  dict it is given.
  """

  def __init__(self, opened: _t5x.OpenedStep):
    self._abstract = traverse_util.unflatten_dict(
      {p: jax.ShapeDtypeStruct(s.shape, s.dtype) for p, s in opened.stored.items()}
    )

  def state_dict(self) -> dict[str, Any]:
    return self._abstract

  def restore_state(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
    return dict(state_dict)


def _in_stored_dtypes(source: State, stored: Mapping[tuple[str, ...], Any]) -> State:
  """`source` with each floating optimizer-state leaf in the checkpoint's floating dtype.

  A state created from a definition holds its moments in the params' dtype,
  while optax's adam, say, keeps ``mu`` in float32 after an update of
  bfloat16 params with float32 gradients: read in the created dtypes, such a
  moment would be rounded before it is converted. A dtype the devices cannot
  hold (float64 with x64 off) is taken as the one they hold it in, so the
  restore's range check applies.
  """
  leaves = traverse_util.flatten_dict(source.state_dict(), keep_empty_nodes=True)
  changed = {}
  for path, leaf in leaves.items():
    kept = stored.get(tuple(str(key) for key in path))
    if kept is None or path[0] != "state" or not isinstance(leaf, jax.ShapeDtypeStruct):
      continue
    dtype = jax.dtypes.canonicalize_dtype(kept.dtype)
    floating = jnp.issubdtype(leaf.dtype, jnp.floating) and jnp.issubdtype(dtype, jnp.floating)
    if floating and leaf.dtype != dtype:
      changed[path] = jax.ShapeDtypeStruct(leaf.shape, dtype, sharding=leaf.sharding)
  if not changed:
    return source
  return source.restore_state(traverse_util.unflatten_dict({**leaves, **changed}))


def _holds_t5x(path: str | os.PathLike[str]) -> bool:
  try:
    _t5x.locate(path, None)
  except (FileNotFoundError, ValueError):
    return False
  return True


def _optimizer(state: State) -> Optimizer:
  return state.optimizer if isinstance(state, TrainState) else state


def _with_optimizer(state: State, optimizer: Optimizer) -> State:
  return state.replace(_optimizer=optimizer) if isinstance(state, TrainState) else optimizer


def _abstract(leaf: jax.ShapeDtypeStruct, like: Any) -> jax.ShapeDtypeStruct:
  """`leaf` with `like`'s sharding, if it has one."""
  return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=getattr(like, "sharding", None))


def _source_state(source_def: OptimizerDef, target: State) -> State:
  """An abstract state of `source_def` over `target`'s params, as its checkpoint holds them.

  Lookahead trains two copies of the params (`optax.LookaheadParams`), every
  other optimizer one. A definition that places its params by their logical
  axes (``set_param_axes``: Muon's) gets the target's axes, as
  `TrainState.create` gives them. Over params that carry `NamedSharding`s,
  its state is placed by them (`sharded_by_params`), so each device reads
  its shards of the old optimizer's state.
  """
  params = _optimizer(target).target
  axes = target.param_axis_leaves if isinstance(target, TrainState) else None
  two = isinstance(params, optax.LookaheadParams)
  if two and not trains_lookahead_params(source_def):
    params, axes = params.fast, None if axes is None else axes[: len(axes) // 2]
  elif not two and trains_lookahead_params(source_def):
    params, axes = optax.LookaheadParams.init_synced(params), None if axes is None else axes * 2
  if axes is not None:
    source_def = with_param_axes(source_def, jax.tree.structure(params).unflatten(axes))
  old = jax.eval_shape(source_def.create, params)
  if jax.tree.structure(old.target) == jax.tree.structure(params):
    old = _convert.sharded_by_params(
      old.replace(target=jax.tree.map(_abstract, old.target, params))
    )
  if isinstance(target, TrainState):
    return target.replace(_optimizer=old, param_axis_leaves=axes)
  return old


def _refuse_nnx(target: State, where: str) -> None:
  """Refuses an `Optimizer` target over a flax NNX state, which `convert_state` does not take."""
  if isinstance(target, Optimizer):
    refuse(
      target.target,
      "target.target",
      where,
      how="create the target over nnx.to_pure_dict(state), into which a checkpoint saved over "
      "the nnx.State restores, and put the params back with nnx.replace_by_pure_dict",
    )


def _not_a_source(source: Any) -> str:
  if is_transformation(source):
    got = f"a {type(source).__name__}, an optax transformation: give OptaxWrapper(it)"
  else:
    got = f"a {type(source).__name__}"
  return (
    "convert_from= / source= takes the optimizer that wrote the checkpoint: its definition "
    f"(an OptimizerDef) or an abstract state of it (True: T5X's legacy Adafactor), got {got}."
  )


SOURCE_ADVICE = (
  "The source is the optimizer said to have written the checkpoint, built over the target's "
  "params: give the one that did."
)
"""What a refusal of the source's state asks for, ending its message."""


def _read_source(
  path: str | os.PathLike[str], source: State, step: int | None, *, t5x: bool, built: bool
) -> State:
  """Checkpoint `step` at `path` restored into `source`, a state of the optimizer that wrote it.

  A source `built` from its definition is read in the checkpoint's floating
  dtypes (`_in_stored_dtypes`).

  Raises:
    ValueError: the checkpoint does not fit `source`: where only its
      optimizer state does not fit, the refusal of the restore (which names
      the state it reads into as the target) names it as the source and ends
      with `SOURCE_ADVICE`; where params do not fit, it is the target's
      (another model) and says so.
    CheckpointError: the step's data are missing, unreadable or corrupt.
  """
  try:
    if t5x:
      opened = _t5x.open_step(path, step)
      if built:
        source = _in_stored_dtypes(source, opened.stored)
      return _t5x.restore_opened(opened, source)
    with _checkpoints.Checkpointer(path) as checkpointer:
      if built:
        return checkpointer.restore_fitted(functools.partial(_in_stored_dtypes, source), step)
      return checkpointer.restore(source, step)
  except _checkpoints.CheckpointError:
    raise
  except ValueError as e:
    paths = re.findall(r"(?:at|key) '([^']*)'", str(e))
    if not paths or any(not path.startswith("state/") for path in paths):
      raise  # The target's params (another model), or no path: the refusal says which.
    text = re.sub(
      r"\bthe target\b", "the source", str(e).replace(_checkpoints.ANOTHER_OPTIMIZER, "")
    )
    raise ValueError(f"{text} {SOURCE_ADVICE}") from e


@placed_as_target
def restore_converted(
  path: str | os.PathLike[str],
  target: State,
  *,
  source: OptimizerDef | State | None = None,
  step: int | None = None,
  source_hparams: Mapping[str, Any] | None = None,
  target_hparams: Mapping[str, Any] | None = None,
  missing: str = "raise",
) -> tuple[State, _convert.ConversionReport]:
  """Restores a checkpoint written with another optimizer, converting its state.

  The checkpoint (a T5X model directory in either format, or a
  `Checkpointer` directory) is restored into a state of the old optimizer,
  then `convert_state` turns that optimizer's state into `target`'s: the
  params (and step, and ``flax_mutables``) are exact, the new optimizer's
  state is converted and placed in `target`'s shardings. A `TrainState`
  target's logical axes of its params are the conversion's ``param_axes``
  (T5X's legacy Adafactor is factored by them).

  Args:
    path: the model directory (or a T5X step directory).
    target: the `TrainState` or `Optimizer` to restore into, with the new
      optimizer; real or abstract (`partitioning.abstract_train_state`).
    source: the optimizer that wrote the checkpoint: its definition (its
      state is then read with the default placement, each floating leaf of
      its optimizer state in the checkpoint's dtype), or an abstract state
      of it with shardings (each array is read straight into them). None
      only for T5X's legacy ``adafactor.Adafactor``, recognised by its
      layout.
    step: the step to restore; None: the latest.
    source_hparams: see `convert_state`.
    target_hparams: see `convert_state`.
    missing: see `convert_state`.

  Returns:
    ``(state, report)``: a new object of `target`'s type and the
    `ConversionReport`.

  Raises:
    FileNotFoundError: no checkpoint (for `step`) at `path`.
    ValueError: the checkpoint does not fit `source` (naming the paths, and
      `source` as the side that does not fit), no
      `source` for a checkpoint that is not T5X's legacy Adafactor, or what
      `convert_state` raises.
    TypeError: `target` is an `Optimizer` over a flax NNX state.

  Example:
    >>> import tempfile, jax.numpy as jnp, optax, t5x_optim
    >>> from t5x_optim import optimizers
    >>> params = {'w': jnp.ones((2, 3))}
    >>> old = optimizers.adafactor(0.1, min_dim_size_to_factor=1).create(params)
    >>> model_dir = tempfile.mkdtemp()
    >>> _ = t5x_optim.save_t5x_checkpoint(model_dir, old.apply_gradient({'w': jnp.ones((2, 3))}))
    >>> new = optimizers.adamw(1e-3).create(params)
    >>> new, report = restore_converted(model_dir, new, source=old.optimizer_def, missing='init')
    >>> int(new.state.step), new.state.param_states[0].nu['w'].shape
    (1, (2, 3))
  """
  _convert.check_missing(missing)
  _refuse_nnx(target, "restore_converted")
  hparams = {"source_hparams": source_hparams, "target_hparams": target_hparams}
  hparams["param_axes"] = target.params_axes if isinstance(target, TrainState) else None
  t5x = _holds_t5x(path)
  if source is None:
    if not t5x:
      raise ValueError(
        f"{path} holds no T5X checkpoint; pass source= (the optimizer that wrote it) "
        "to restore it into another optimizer."
      )
    opened = _t5x.open_step(path, step)
    state_dict = _t5x.restore_opened(opened, _StoredStateDict(opened))
    optimizer, report = _convert.convert_state(
      state_dict, _optimizer(target), missing=missing, **hparams
    )
    restored = _with_optimizer(target, optimizer)
    if isinstance(restored, TrainState):  # a target's collection the checkpoint lacks: refused
      restored = restored.restore_state(
        {**optimizer.state_dict(), "flax_mutables": state_dict.get("flax_mutables", {})}
      )
    return restored, report
  if not isinstance(source, TrainState | Optimizer):
    if not callable(getattr(source, "create", None)):
      raise TypeError(_not_a_source(source))
    old_state = _read_source(path, _source_state(source, target), step, t5x=t5x, built=True)
  else:
    old_state = _read_source(path, source, step, t5x=t5x, built=False)
  optimizer, report = _convert.convert_state(
    _optimizer(old_state), _optimizer(target), missing=missing, **hparams
  )
  if isinstance(target, TrainState):
    return old_state.replace(
      _optimizer=optimizer,
      param_axis_leaves=target.param_axis_leaves,
      mutable_axis_leaves=target.mutable_axis_leaves,
    ), report
  return optimizer, report


def restore_with_conversion(
  path: str | os.PathLike[str],
  target: State,
  convert_from: Any,
  step: int | None,
  *,
  missing: str,
  where: str,
) -> State:
  """The ``convert_from=`` keyword of `Checkpointer.restore` and `restore_t5x_checkpoint`.

  `restore_converted` with ``source=convert_from`` (True: T5X's legacy
  Adafactor, recognised by its layout), `missing` and its other defaults;
  the report is logged at INFO level. `where` names the function called in
  a refusal.
  """
  _refuse_nnx(target, f"{where} with convert_from=")
  source = None if convert_from is True else convert_from
  state, report = restore_converted(path, target, source=source, step=step, missing=missing)
  _log.info("Restored %s into another optimizer:\n%s", path, report)
  return state
