"""Fused (multi-tensor) optax updates: many leaves per kernel.

`OptaxWrapper(tx, fused=...)` can run an elementwise optax update as one
kernel per group of leaves instead of one (or more) per leaf. The
subpackage has four parts, each importing only those before it:

- `program`: what one leaf computes (a `Program`), and how to evaluate it;
- `analysis`: the proof that an update is elementwise per leaf, and the
  `FusedPlan` (the leaves' groups, and the kernel that will run it) or a
  `NotFusible` refusal saying why; `stack_params` needs only this;
- `kernel`: the Pallas kernel of one group and its GPU-lowering check (the
  only module that imports Pallas);
- `sharding`: the update on each device's local shards
  (`custom_partitioning` or `shard_map`), and under `jax.vmap`.

This module holds the modes (`FusedUpdate`) and the report
(`fusion_report`); Pallas loads only when a fused update is planned for a
GPU kernel or run. The state keeps optax's per-leaf layout, so partition
specs, state dicts and checkpoints are those of the plain path.

Example:
  >>> import jax.numpy as jnp, optax
  >>> params = {'w': jnp.ones((2, 3)), 'b': jnp.zeros(3)}
  >>> report = fusion_report(optax.adamw(1e-3), params)
  >>> report.fusible, report.groups
  (True, (('b', 'w'),))
  >>> fusion_report(optax.adafactor(1e-3, min_dim_size_to_factor=2), params).fusible
  False
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple

import jax
import optax

from t5x_optim._layouts.fused.analysis import FusedPlan, NotFusible, plan_fused_update
from t5x_optim._layouts.fused.program import program_key
from t5x_optim._warn import warn

__all__ = [
  "FusedPlan",
  "FusedUpdate",
  "FusionReport",
  "NotFusible",
  "fusion_report",
  "plan_fused_update",
  "program_key",
]


class FusedUpdate(enum.Enum):
  """How `OptaxWrapper` runs an elementwise optax update.

  Attributes:
    OFF: the plain path, ``tx.update`` + ``optax.apply_updates`` per leaf
      (the default).
    AUTO: the Pallas kernel on GPUs; the plain path on other backends (CPU,
      TPU), where no kernel is built.
    PALLAS: the Pallas kernel; raises on a backend other than GPU.
    INTERPRET: the Pallas kernel in Pallas interpret mode, on any backend:
      slow, for tests and debugging.

  `FusedUpdate.of` also takes the values as strings (for gin) and bools
  (``True`` is ``AUTO``).

  >>> FusedUpdate.of("interpret"), FusedUpdate.of(False)
  (<FusedUpdate.INTERPRET: 'interpret'>, <FusedUpdate.OFF: 'off'>)
  """

  OFF = "off"
  AUTO = "auto"
  PALLAS = "pallas"
  INTERPRET = "interpret"

  @classmethod
  def of(cls, value: FusedUpdate | str | bool) -> FusedUpdate:
    """The mode named by `value`: a member, its string value or a bool.

    Raises:
      ValueError: for anything else, listing the accepted values.
    """
    if isinstance(value, bool):
      return cls.AUTO if value else cls.OFF
    try:
      return cls(value)
    except ValueError:
      raise ValueError(
        f"fused= must be a bool or one of {[mode.value for mode in cls]}; got {value!r}."
      ) from None

  def kernel(self, backend: str) -> str | None:
    """The kernel this mode runs on `backend`: "pallas", "interpret" or None.

    Raises:
      ValueError: for ``PALLAS`` on a backend other than GPU.

    >>> FusedUpdate.AUTO.kernel("cpu") is None, FusedUpdate.AUTO.kernel("gpu")
    (True, 'pallas')
    """
    if self is FusedUpdate.OFF:
      return None
    if self is FusedUpdate.AUTO:
      return "pallas" if backend == "gpu" else None
    if self is FusedUpdate.PALLAS and backend != "gpu":
      raise ValueError(
        f"fused='pallas' needs a GPU; the default backend is {backend!r}. Use "
        "fused='auto' to take the plain path there, or 'interpret' to test."
      )
    return self.value

  def update(
    self,
    tx: optax.GradientTransformation,
    params: Any,
    grads: Any,
    state: Any,
    extra_args: dict[str, Any],
  ) -> tuple[Any, Any]:
    """One update of `tx` in this mode: the new params and optax state.

    The plain path is ``tx.update`` + ``optax.apply_updates``. With a
    kernel, the update runs fused where `plan_fused_update` proves it
    elementwise; otherwise it takes the plain path with a warning saying
    why. The results are those of the plain path either way.

    Raises:
      ValueError: for ``PALLAS`` on a backend other than GPU.

    >>> import jax.numpy as jnp, optax
    >>> tx, params = optax.sgd(0.5), {'w': jnp.ones(2)}
    >>> FusedUpdate.OFF.update(tx, params, params, tx.init(params), {})[0]
    {'w': Array([0.5, 0.5], dtype=float32)}
    """
    kernel = self.kernel(jax.default_backend())
    if kernel is not None:
      try:
        plan = plan_fused_update(tx, params, grads, state, extra_args, kernel=kernel)
      except NotFusible as refusal:
        warn(
          f"OptaxWrapper(fused={self.value!r}): the update cannot run fused "
          f"({refusal}), so it runs on the plain optax path."
        )
      else:
        # Pallas loads here, with the first fused update.
        from t5x_optim._layouts.fused.sharding import fused_apply

        return fused_apply(plan, params, grads, state, extra_args)
    updates, new_state = tx.update(grads, state, params, **extra_args)
    return optax.apply_updates(params, updates), new_state


class FusionReport(NamedTuple):
  """Whether an update can run fused, and how.

  Attributes:
    fusible: True when every leaf's update is elementwise.
    reason: why not, naming the leaf and the operation; None when fusible.
    groups: the leaf paths of each group (one kernel each); empty when not
      fusible.
  """

  fusible: bool
  reason: str | None
  groups: tuple[tuple[str, ...], ...]


def fusion_report(
  tx: optax.GradientTransformation,
  params: Any,
  *,
  grads: Any = None,
  extra_args: dict[str, Any] | None = None,
) -> FusionReport:
  """Whether ``tx``'s update of `params` can run fused, and in which groups.

  Args:
    tx: an optax transformation.
    params: the params (arrays or `jax.ShapeDtypeStruct`s).
    grads: the gradients (or their abstract values); by default like `params`.
    extra_args: the extra update arguments `apply_gradient` will get
      (``value=``, ``value_fn=``...), for transformations that need them.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> report = fusion_report(optax.chain(optax.clip_by_global_norm(1.0),
    ...                                    optax.adam(1e-3)), {'w': jnp.ones(3)})
    >>> report.fusible, report.groups
    (True, (('w',),))
    >>> fusion_report(optax.contrib.muon(1e-3), {'w': jnp.ones((4, 4))}).reason
    "'reshape' on leaf w is not elementwise"
  """
  state = jax.eval_shape(tx.init, params)
  try:
    plan = plan_fused_update(tx, params, params if grads is None else grads, state, extra_args)
  except NotFusible as refusal:
    return FusionReport(False, str(refusal), ())
  return FusionReport(
    True, None, tuple(tuple(plan.paths[i] for i in group.leaves) for group in plan.groups)
  )
