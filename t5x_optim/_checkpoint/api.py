"""The public checkpoint entry points, which send ``convert_from=`` to the converting restore.

`Checkpointer` is the store's checkpointer with ``restore(convert_from=)``;
`restore_t5x_checkpoint` is the T5X reader's with the same keyword. Every
other restore goes to the store or the reader unchanged, so neither of them
knows about conversion, and the converting restore builds on both.
"""

from __future__ import annotations

import os
from typing import Any

from t5x_optim._checkpoint import converting, store, t5x_read
from t5x_optim._checkpoint.store import CheckpointState
from t5x_optim._convert.convert import check_missing
from t5x_optim._core.placement import placed_as_target

__all__ = ["Checkpointer", "restore_t5x_checkpoint"]


def _refuse_missing_alone(missing: str, where: str) -> None:
  """Refuses ``missing=`` other than ``'raise'`` in a restore without ``convert_from=``."""
  if missing != "raise":
    raise ValueError(
      f"missing= is for a converting restore: {where}(..., convert_from=<the optimizer that "
      f"wrote the checkpoint>, missing={missing!r}) starts the state it gives no value for "
      "from its initial values."
    )


class Checkpointer(store.Checkpointer):
  """Saves and restores train states in a directory; see `store.Checkpointer`.

  Its `restore` also takes ``convert_from=``: the optimizer that wrote the
  checkpoint, when the target has another, and with it ``missing=``.

  Example:
    >>> import tempfile, jax.numpy as jnp
    >>> from t5x_optim import optimizers
    >>> opt = optimizers.adam(1e-3).create({'w': jnp.ones(2)})
    >>> with Checkpointer(tempfile.mkdtemp()) as ckpt:
    ...   ckpt.save(0, opt)
    ...   ckpt.wait_until_finished()
    ...   restored = ckpt.restore(optimizers.sgd(1e-3).create({'w': jnp.ones(2)}),
    ...                           convert_from=optimizers.adam(1e-3))
    >>> type(restored.optimizer_def).__name__, restored.target['w'].tolist()
    ('OptaxWrapper', [1.0, 1.0])
  """

  def restore(
    self,
    target: CheckpointState,
    step: int | None = None,
    *,
    convert_from: Any = None,
    missing: str = "raise",
    **options: Any,
  ) -> CheckpointState:
    """Restores checkpoint `step` into `target`; see `store.Checkpointer.restore`.

    Args:
      target: gives the structure, shapes, dtypes and shardings (but from a
        directory of T5X checkpoints, a floating param keeps the checkpoint's
        dtype, unless ``convert_from`` is given).
      step: the step to restore (None: the latest).
      convert_from: the optimizer that wrote the checkpoint, when `target`
        has another (its definition or an abstract state of it; True: T5X's
        legacy Adafactor): params restored exactly, the optimizer state
        converted, see `t5x_optim.restore_converted`.
      missing: with ``convert_from``, what to do with the state of `target`'s
        optimizer that the checkpoint gives no value for: ``'raise'`` or
        ``'init'`` (start it from its initial values); see
        `t5x_optim.convert_state`.
      **options: the store's ``params_only``, ``fallback`` and ``verify``,
        for a restore without conversion.

    Raises:
      ValueError: ``missing`` other than ``'raise'`` or ``'init'``;
        ``convert_from`` with any of the store's options, or ``missing``
        without ``convert_from``.
      TypeError: ``convert_from`` with a target over a flax NNX state.
    """
    check_missing(missing)
    if convert_from is None:
      _refuse_missing_alone(missing, "Checkpointer.restore")
      return super().restore(target, step, **options)
    if options:
      raise ValueError(
        f"restore(convert_from=...) takes no {sorted(options)}: a converting restore "
        "reads one step whole."
      )
    if step is None:
      only_t5x = self._holds_only_t5x_checkpoints()
      step = t5x_read.latest_t5x_step(self.directory) if only_t5x else self._resolve_step(None)
    restored = converting.restore_with_conversion(
      self.directory, target, convert_from, step, missing=missing, where="Checkpointer.restore"
    )
    self._restored_step = step
    return restored


@placed_as_target
def restore_t5x_checkpoint(
  path: str | os.PathLike[str],
  target: Any,
  *,
  step: int | None = None,
  convert_from: Any = None,
  missing: str = "raise",
) -> Any:
  """Restores a T5X checkpoint into `target`; see `t5x_read.restore_t5x_checkpoint`.

  Args:
    path: a T5X model directory, one step's ``checkpoint_<step>`` directory,
      or a legacy checkpoint's ``checkpoint`` file; local or with a scheme
      (``gs://``).
    target: gives the structure, shapes, shardings and dtypes, except that
      a floating param keeps the checkpoint's dtype (as T5X restores
      it without a ``restore_dtype``), unless ``convert_from`` is given, which
      gives every leaf the target's dtype.
    step: with a model directory, the step to restore (None: the latest).
    convert_from: the optimizer that wrote the checkpoint, when `target` has
      another: its definition or an abstract state of it (True: T5X's legacy
      Adafactor). Its state is converted into `target`'s optimizer, see
      `t5x_optim.restore_converted` (which also returns the report).
    missing: with ``convert_from``, what to do with the state of `target`'s
      optimizer that the checkpoint gives no value for: ``'raise'`` or
      ``'init'`` (start it from its initial values); see
      `t5x_optim.convert_state`.

  Raises:
    ValueError: ``missing`` other than ``'raise'`` or ``'init'``, or
      ``missing`` without ``convert_from``.

  Example:
    >>> import tempfile, jax.numpy as jnp
    >>> from t5x_optim import optimizers, save_t5x_checkpoint
    >>> opt = optimizers.sgd(0.5).create({'w': jnp.ones(2)})
    >>> model_dir = tempfile.mkdtemp()
    >>> _ = save_t5x_checkpoint(model_dir, opt.apply_gradient({'w': jnp.ones(2)}))
    >>> restored = restore_t5x_checkpoint(model_dir, opt)
    >>> int(restored.state.step), restored.target['w'].tolist()
    (1, [0.5, 0.5])
  """
  check_missing(missing)
  if convert_from is not None:
    return converting.restore_with_conversion(
      path, target, convert_from, step, missing=missing, where="restore_t5x_checkpoint"
    )
  _refuse_missing_alone(missing, "restore_t5x_checkpoint")
  return t5x_read.restore_t5x_checkpoint(path, target, step=step)
