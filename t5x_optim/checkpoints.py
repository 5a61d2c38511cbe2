"""Sharded, crash-safe checkpoints of train states and optimizers with orbax.

A checkpoint holds the T5X-layout state dict (``{'target': ..., 'state':
{'step': ..., 'param_states': ...}}``, plus ``flax_mutables`` for a
`TrainState`) written by orbax-checkpoint's `CheckpointManager`: each process
writes the shards it holds, nothing is gathered to one host. Restoring reads
straight into the target's shardings, which may be on another mesh shape or
device count than at save time, so no unsharded copy is ever built.

Safety comes from orbax: a step is written to a temporary directory that is
renamed only once complete, so a crash mid-save leaves the earlier steps
intact and the partial one invisible (and removed when the directory is next
opened). Before any array is read, the checkpoint's tree metadata is checked
against the target's state dict; a mismatch raises a `ValueError` naming the
paths, and nothing is restored.

Example:
  >>> import tempfile, jax.numpy as jnp
  >>> from t5x_optim import optimizers
  >>> opt = optimizers.adamw(1e-3).create({'w': jnp.ones(4)})
  >>> with Checkpointer(tempfile.mkdtemp(), keep=2) as ckpt:
  ...   ckpt.save(1, opt)
  ...   ckpt.wait_until_finished()
  ...   restored = ckpt.restore(opt)
  >>> restored.target['w'].tolist()
  [1.0, 1.0, 1.0, 1.0]
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from typing import Any, Protocol, Self

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath
from flax import serialization, traverse_util

# orbax's own reader of a step's tree metadata file and its own read spec of
# a stored array: the metadata check opens each array exactly as the restore
# will, in one batch, without orbax's per-leaf sharding-file reads.
from orbax.checkpoint._src.metadata.tree import InternalTreeMetadata
from orbax.checkpoint._src.path.format_utils import PYTREE_METADATA_FILE
from orbax.checkpoint._src.serialization.tensorstore_utils import ArrayReadSpec

from t5x_optim import _state_dict
from t5x_optim._optimizer import Optimizer
from t5x_optim._train_state import TrainState

__all__ = ["Checkpointer", "CheckpointState"]

Path = tuple[str, ...]
_TARGET = "target"
_STATE = "state"
_STEP = "step"
_PARAM_STATES = "param_states"
_FLAX_MUTABLES = "flax_mutables"


class CheckpointState(Protocol):
  """What `Checkpointer` saves and restores: a `TrainState` or an `Optimizer`."""

  def state_dict(self) -> dict[str, Any]:
    """The T5X-layout state dict."""

  def restore_state(self, state_dict: Mapping[str, Any]) -> Self:
    """A copy restored from a T5X-layout state dict."""


def _join(path: Path) -> str:
  return "/".join(path)


def _open_stored(
    item: epath.Path, where: str, wanted: Callable[[Path], bool]
) -> dict[Path, jax.ShapeDtypeStruct]:
  """The shape and dtype of the `wanted` arrays stored in the orbax item `item`.

  Reads the tree metadata file once, then opens those arrays in one batch
  with orbax's read spec; tensorstore reads only their headers, no data.

  Args:
    item: the item directory of a step (``<directory>/<step>/default``).
    where: names the checkpoint in error messages.
    wanted: which stored paths to open.

  Raises:
    ValueError: the tree metadata is unreadable, or some arrays' headers
      are, naming every such path.
  """
  try:
    metadata = InternalTreeMetadata.from_json(
        json.loads((item / PYTREE_METADATA_FILE).read_text())
    )
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise ValueError(f"{where} has no readable tree metadata: {e}") from e
  use_ocdbt = metadata.use_ocdbt
  if use_ocdbt is None:
    use_ocdbt = ocp.type_handlers.is_ocdbt_checkpoint(item)
  context = ocp.type_handlers.get_ts_context(use_ocdbt=use_ocdbt)
  opening = {}
  for entry in metadata.tree_metadata_entries:
    if entry.value_metadata.skip_deserialize:
      continue  # An empty node: nothing is stored, as `_flatten` drops it.
    path = tuple(key.nested_key_name for key in entry.key_metadata.nested_key_metadata_entries)
    if not wanted(path):
      continue
    spec = ArrayReadSpec(
        item.as_posix(), ".".join(path), bool(metadata.use_zarr3), use_ocdbt=use_ocdbt
    )
    opening[path] = ts.open(spec.json, open=True, context=context)
  stored, unreadable, first_error = {}, [], None
  for path, future in opening.items():
    try:
      array = future.result()
    except (OSError, ValueError) as e:
      unreadable.append(f"'{_join(path)}'")
      first_error = first_error or e
      continue
    stored[path] = jax.ShapeDtypeStruct(array.shape, jax.numpy.dtype(array.dtype.name))
  if unreadable:
    raise ValueError(
        f"{where} has unreadable metadata at {', '.join(unreadable)}: {first_error}"
    ) from first_error
  return stored


def _flatten(tree: Mapping[str, Any]) -> dict[Path, Any]:
  """A nested state dict as ``{path: leaf}`` (empty mappings dropped)."""
  return traverse_util.flatten_dict(_state_dict.prune_empty(tree))


def _saveable(leaf: Any) -> Any:
  """Typed PRNG keys are written as their raw `key_data`."""
  return jax.random.key_data(leaf) if _state_dict.is_prng_key(leaf) else leaf


def _as_stored(leaf: Any) -> Any:
  """How `leaf` looks on disk: a key as its `key_data`'s shape and dtype."""
  if not _state_dict.is_prng_key(leaf):
    return leaf
  data = jax.eval_shape(jax.random.key_data, leaf)
  return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=getattr(leaf, "sharding", None))


def _key_impl(dtype: Any) -> str:
  """The name of the PRNG implementation of key dtype `dtype`."""
  for name in ("threefry2x32", "rbg", "unsafe_rbg"):
    if jax.eval_shape(lambda: jax.random.key(0, impl=name)).dtype == dtype:
      return name
  raise ValueError(f"Unknown PRNG key dtype {dtype}.")


def _shape_dtype(leaf: Any) -> tuple[tuple[int, ...], np.dtype]:
  dtype = getattr(leaf, "dtype", None)
  return tuple(np.shape(leaf)), np.dtype(dtype if dtype is not None else np.asarray(leaf).dtype)


def _describe(leaf: Any) -> str:
  shape, dtype = _shape_dtype(leaf)
  return f"{dtype}{list(shape)}"


def _leaf_problem(path: Path, expected: Any, stored: Any) -> str | None:
  """Describes why the stored leaf cannot restore into `expected`, or None."""
  shape, dtype = _shape_dtype(expected)
  stored_shape, stored_dtype = _shape_dtype(stored)
  if stored_shape != shape:
    return (
        f"shape mismatch at '{_join(path)}': the target has {_describe(expected)}, the "
        f"checkpoint has {_describe(stored)}"
    )
  if not np.can_cast(stored_dtype, dtype, casting="safe"):
    return (
        f"dtype mismatch at '{_join(path)}': the checkpoint's {stored_dtype} cannot be "
        f"cast safely to the target's {dtype}"
    )
  return None


def _problems(expected: Mapping[Path, Any], stored: Mapping[Path, Any]) -> list[str]:
  """Every missing key, unexpected key and shape or dtype mismatch, by path."""
  problems = [
      f"missing key '{_join(path)}' (the target has {_describe(leaf)} there)"
      for path, leaf in expected.items()
      if path not in stored
  ]
  problems += [
      f"unexpected key '{_join(path)}' ({_describe(leaf)})"
      for path, leaf in stored.items()
      if path not in expected
  ]
  for path, leaf in expected.items():
    if path in stored:
      problem = _leaf_problem(path, leaf, stored[path])
      if problem is not None:
        problems.append(problem)
  return problems


def _abstract_leaf(leaf: Any) -> jax.ShapeDtypeStruct:
  """What orbax restores `leaf` as: its shape, dtype and sharding.

  A leaf without a sharding (a numpy array or Python scalar) is read onto
  this process's first device.
  """
  shape, dtype = _shape_dtype(leaf)
  sharding = getattr(leaf, "sharding", None)
  if sharding is None:
    sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def _restore_args(expected: Mapping[Path, Any]) -> tuple[dict[str, Any], Any]:
  """The orbax restore target (abstract arrays) and its per-leaf restore args."""
  abstract = traverse_util.unflatten_dict({p: _abstract_leaf(x) for p, x in expected.items()})
  return abstract, ocp.checkpoint_utils.construct_restore_args(abstract)


def _rewrap_keys(restored: Mapping[Path, Any], target: Mapping[Path, Any]) -> dict[Path, Any]:
  """Turns the `key_data` read for the target's typed PRNG keys back into keys."""
  return {
      path: jax.random.wrap_key_data(leaf, impl=_key_impl(target[path].dtype))
      if _state_dict.is_prng_key(target[path])
      else leaf
      for path, leaf in restored.items()
  }


def _optimizer_of(target: CheckpointState) -> Optimizer:
  if isinstance(target, TrainState):
    return target.optimizer
  if isinstance(target, Optimizer):
    return target
  raise TypeError(
      f"params_only=True needs a TrainState or an Optimizer, got {type(target).__name__}."
  )


def _fresh_param_states(target: CheckpointState, params: Mapping[str, Any]) -> Any:
  """The optimizer's initial per-param state for `params`, in the target's shardings.

  Runs the definition's `init_state` under `jax.jit` with the shardings of
  the target's optimizer state as `out_shardings`, so each device only ever
  holds its own shards.
  """
  optimizer = _optimizer_of(target)
  leaves, treedef = jax.tree.flatten(optimizer.state.param_states)
  shardings = [getattr(leaf, "sharding", None) for leaf in leaves]
  out_shardings = None if None in shardings else treedef.unflatten(shardings)
  init = jax.jit(
      lambda p: optimizer.optimizer_def.init_state(p).param_states, out_shardings=out_shardings
  )
  return init(serialization.from_state_dict(optimizer.target, params))


def _is_params_only_path(path: Path) -> bool:
  return path[0] in (_TARGET, _FLAX_MUTABLES) or path == (_STATE, _STEP)


def _any_path(path: Path) -> bool:
  del path
  return True


class Checkpointer:
  """Saves and restores train states or optimizers as sharded orbax checkpoints.

  Steps live in ``directory/<step>``. Saves are asynchronous by default:
  `save` returns once the arrays are copied off the devices and the files are
  written in the background; call `wait_until_finished` (or `close`) before
  relying on them. All processes of a multi-process job must call `save`,
  `restore` and `close` together with the same arguments.

  Args:
    directory: the checkpoint directory (created if missing).
    keep: keep only the newest `keep` steps (None keeps all).
    async_save: write in the background (`False` blocks in `save`).

  Example:
    >>> import tempfile, jax.numpy as jnp
    >>> from t5x_optim import optimizers
    >>> opt = optimizers.sgd(0.1).create({'w': jnp.ones(2)})
    >>> with Checkpointer(tempfile.mkdtemp(), async_save=False) as ckpt:
    ...   ckpt.save(7, opt)
    ...   ckpt.all_steps(), ckpt.latest_step()
    ([7], 7)
  """

  def __init__(
      self, directory: str | os.PathLike[str], *, keep: int | None = None, async_save: bool = True
  ):
    if keep is not None and keep < 1:
      raise ValueError(f"keep must be None or at least 1, got {keep}.")
    self._directory = os.fspath(directory)
    # How the manager names step directories by default (passing it as
    # `step_name_format` would make every restore list the directory).
    self._step_names = ocp.step.standard_name_format()
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep,
        enable_async_checkpointing=async_save,
        cleanup_tmp_directories=True,
        create=True,
    )
    self._manager = ocp.CheckpointManager(
        self._directory, options=options, item_handlers=ocp.PyTreeCheckpointHandler()
    )

  @property
  def directory(self) -> str:
    """The checkpoint directory."""
    return self._directory

  def __enter__(self) -> Self:
    return self

  def __exit__(self, *exc_info: object) -> None:
    self.close()

  def all_steps(self) -> list[int]:
    """The saved steps, ascending.

    These are the complete checkpoints found on disk (partial ones from a
    crash never count) plus this checkpointer's own saves still in flight;
    call `wait_until_finished` first to list only complete ones.
    """
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    """The newest of `all_steps`, or None when there is none."""
    return self._manager.latest_step()

  def save(self, step: int, state: CheckpointState) -> None:
    """Saves `state`'s state dict as checkpoint `step`.

    Each process writes the shards it holds. With `async_save` this returns
    once the arrays are copied off the devices, before the files are
    complete; the step becomes a checkpoint directory only when they are.

    Args:
      step: the step number; must be newer than every saved step.
      state: a `TrainState` or an `Optimizer` (arrays may be sharded).

    Raises:
      ValueError: when `step` is not newer than the latest saved step.
    """
    step = int(step)
    latest = self.latest_step()
    if latest is not None and step <= latest:
      raise ValueError(
          f"Cannot save step {step} in {self._directory}: step {latest} is already saved "
          "and steps must increase."
      )
    state_dict = jax.tree.map(_saveable, state.state_dict())
    self._manager.save(step, args=ocp.args.PyTreeSave(state_dict), force=True)

  def wait_until_finished(self) -> None:
    """Blocks until every pending asynchronous save is complete."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Finishes pending saves and releases the manager's resources."""
    self._manager.close()

  def _where(self, step: int) -> str:
    return f"Checkpoint step {step} in {self._directory}"

  def _item(self, step: int) -> epath.Path:
    """The directory orbax writes checkpoint `step`'s state dict to."""
    return (
        epath.Path(self._directory)
        / self._step_names.build_name(step)
        / ocp.checkpoint_manager.DEFAULT_ITEM_NAME
    )

  def _resolve_step(self, step: int | None) -> int:
    """The step to restore, from complete checkpoints only.

    Pending saves are finished first. An explicit step this checkpointer
    already knows (it saved or listed it) and that is still on disk needs no
    re-read of the directory; otherwise the directory is re-read, so steps
    written by other processes are seen.
    """
    self._manager.wait_until_finished()
    if step is not None:
      step = int(step)
    if step is None or step not in self._manager.all_steps() or not self._item(step).exists():
      self._manager.reload()
    steps = self.all_steps()
    if step is None:
      if not steps:
        raise FileNotFoundError(f"No complete checkpoint in {self._directory}.")
      return steps[-1]
    if step not in steps:
      raise FileNotFoundError(
          f"No complete checkpoint for step {step} in {self._directory}; the steps are {steps}."
      )
    return step

  def _check(self, step: int, expected: Mapping[Path, Any], stored: Mapping[Path, Any]) -> None:
    problems = _problems(expected, stored)
    if problems:
      raise ValueError(
          f"{self._where(step)} does not fit the target: {'; '.join(problems)}. "
          "Nothing was restored."
      )

  def _read(self, step: int, expected: Mapping[Path, Any], *, partial: bool) -> dict[Path, Any]:
    """Reads the `expected` leaves of checkpoint `step` into their shardings."""
    abstract, restore_args = _restore_args(expected)
    args = ocp.args.PyTreeRestore(abstract, restore_args=restore_args, partial_restore=partial)
    try:
      restored = self._manager.restore(step, args=args)
    except (OSError, ValueError) as e:
      raise ValueError(f"{self._where(step)} could not be read: {e}") from e
    return traverse_util.flatten_dict(dict(restored))

  def restore(
      self, target: CheckpointState, step: int | None = None, *, params_only: bool = False
  ) -> CheckpointState:
    """Restores checkpoint `step` into `target`'s structure and shardings.

    `target` is only a template and is never modified: its leaves may be real
    arrays or `jax.ShapeDtypeStruct`s with shardings (see
    `partitioning.abstract_train_state`). Each array is read straight into
    its target sharding, whatever mesh or device count the checkpoint was
    saved from; no unsharded copy is made, and the jax arrays read are
    returned as they are, without another device copy. Pending saves of
    this checkpointer are finished first. The directory is re-read, so checkpoints written by
    other processes are seen, unless `step` is one this checkpointer
    already knows.

    Args:
      target: a `TrainState` or `Optimizer` giving structure, dtypes and
        shardings.
      step: the step to restore; None means the latest.
      params_only: restore only the params (`target`), the step counter and
        the `flax_mutables`, and start the optimizer state afresh: the
        target optimizer's `init_state` of the restored params. For
        switching optimizers (e.g. to fine-tune): the checkpoint's optimizer
        state is neither checked nor read.

    Returns:
      A new object of `target`'s type holding real, sharded arrays.

    Raises:
      FileNotFoundError: no complete checkpoint (for `step`).
      ValueError: the checkpoint does not fit the target (missing or
        unexpected keys, e.g. another optimizer's state; other shapes;
        dtypes that do not cast safely), checked on the metadata before any
        array is read and naming every such path; or unreadable files.
    """
    step = self._resolve_step(step)
    wanted = _is_params_only_path if params_only else _any_path
    stored = _open_stored(self._item(step), self._where(step), wanted)
    target_leaves = {p: x for p, x in _flatten(target.state_dict()).items() if wanted(p)}
    expected = {path: _as_stored(leaf) for path, leaf in target_leaves.items()}
    self._check(step, expected, stored)
    restored = _rewrap_keys(self._read(step, expected, partial=params_only), target_leaves)
    state_dict = traverse_util.unflatten_dict(restored)
    if params_only:
      state_dict[_STATE][_PARAM_STATES] = _state_dict.to_pruned_state_dict(
          _fresh_param_states(target, state_dict[_TARGET])
      )
    return target.restore_state(state_dict)
