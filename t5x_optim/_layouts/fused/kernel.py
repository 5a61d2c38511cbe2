"""The Pallas kernel of a fused update, and its check that a program lowers for the GPU.

One kernel runs one group: the group's leaves are flattened and
concatenated into one buffer per operand (param, gradient, each state
component), the kernel runs the group's `Program` over the buffers block by
block, and the results are split back into leaves. On GPUs it is a Triton
kernel; `check_lowering` lowers each program for the GPU first, and a
program Pallas cannot lower takes the plain path. The plan's
``kernel="interpret"`` runs the same kernel in Pallas interpret mode, on
any backend.

This is the only module that imports Pallas; the package loads it when a
fused update is first planned for a GPU kernel or run.

Example:
  >>> import jax.numpy as jnp, optax
  >>> from t5x_optim._layouts.fused.analysis import plan_fused_update
  >>> params = {'w': jnp.ones(3)}
  >>> tx = optax.sgd(0.5)
  >>> plan = plan_fused_update(tx, params, params, tx.init(params), kernel="interpret")
  >>> local_update(plan, [params['w'], jnp.ones(3)], [])  # sgd: no state components
  [Array([0.5, 0.5, 0.5], dtype=float32)]
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.export
import jax.extend.backend
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from t5x_optim._layouts.fused.program import (
  FusedPlan,
  Group,
  NotFusible,
  Program,
  run_program,
  varying_alike,
  varying_over,
)

__all__ = ["check_lowering", "local_update"]

# Elements per Pallas block (a power of two, as Triton wants).
_BLOCK = 4096
# The custom call a Pallas Triton kernel lowers to.
_TRITON_CALL = "__gpu$xla.gpu.triton"
# The longest buffer a kernel updates: Triton's block offsets are 32-bit integers.
_KERNEL_ELEMENTS = 1 << 31


def _pallas_group(
  program: Program, buffers: Sequence, residuals: Sequence, *, interpret: bool
) -> list:
  """Runs `program` over 1-d `buffers` (a multiple of the block) with Pallas.

  `buffers` are the param, the gradient and the state components; the
  results (the new param and state components) have their dtypes, as
  `plan_fused_update` checked, and overwrite them in place.
  """
  # Under `jax.shard_map`, the results vary over the manual mesh axes that an operand does.
  operands = varying_alike([*buffers, *residuals])
  buffers, residuals = operands[: len(buffers)], operands[len(buffers) :]
  size = buffers[0].shape[0]
  block = min(_BLOCK, size)
  n_in, n_res = len(buffers), len(residuals)
  kept = [0, *range(2, n_in)]  # the buffers the results replace

  # Booleans travel as int32: Triton has no boolean memory.
  is_bool = [r.dtype == jnp.bool_ for r in residuals]

  def kernel(*refs):
    ins = [ref[...] for ref in refs[:n_in]]
    scalars = [
      ref[0] != 0 if boolean else ref[0]
      for ref, boolean in zip(refs[n_in : n_in + n_res], is_bool, strict=True)
    ]
    outs = run_program(program, ins, scalars, (block,))
    for ref, value in zip(refs[n_in + n_res :], outs, strict=True):
      ref[...] = value

  blocked = pl.BlockSpec((block,), lambda i: (i,))
  scalar = pl.BlockSpec((1,), lambda i: (0,))
  return pl.pallas_call(
    kernel,
    out_shape=[
      jax.ShapeDtypeStruct(
        (size,), buffers[k].dtype, manual_axis_type=jax.typeof(buffers[k]).manual_axis_type
      )
      for k in kept
    ],
    grid=(size // block,),
    in_specs=[blocked] * n_in + [scalar] * n_res,
    out_specs=[blocked] * len(kept),
    input_output_aliases={k: j for j, k in enumerate(kept)},
    interpret=interpret,
    compiler_params=None if interpret else pltriton.CompilerParams(),
  )(
    *buffers,
    *(
      jnp.reshape(r.astype(jnp.int32) if boolean else r, (1,))
      for r, boolean in zip(residuals, is_bool, strict=True)
    ),
  )


def _group_buffers(group: Group, interpret: bool, args: list[list], scalars: list) -> list:
  """One group's update over flat buffers; returns the new flat buffers.

  `args` holds, per leaf of the group, its param, gradient and state
  components. The buffers are padded to a whole number of blocks. Triton
  computes a block's offsets in 32 bits, so a buffer longer than
  `_KERNEL_ELEMENTS` runs the same program as XLA's elementwise fusion.
  So does interpret mode under `jax.shard_map` (with ``check_vma``) for
  values that vary over its mesh axes: Pallas's interpreter slices them with
  indices typed as the same on every device, which JAX refuses.
  """
  total = sum(math.prod(leaf[0].shape) for leaf in args)
  if not total or total > _KERNEL_ELEMENTS or (interpret and varying_over((args, scalars))):
    return run_program(group.program, _buffers(args, total), scalars, (total,))
  block = min(_BLOCK, 1 << (total - 1).bit_length())
  buffers = _buffers(args, -(-total // block) * block)
  return _pallas_group(group.program, buffers, scalars, interpret=interpret)


def _buffers(args: list[list], size: int) -> list:
  """Per component, the group's leaves flattened one after another, zero-padded to `size`."""
  buffers = []
  for k in range(len(args[0])):
    parts = [jnp.ravel(leaf[k]) for leaf in args]
    total = sum(part.shape[0] for part in parts)
    if size > total:
      parts.append(jnp.zeros((size - total,), parts[0].dtype))
    buffers.append(jnp.concatenate(parts) if len(parts) > 1 else parts[0])
  return buffers


def local_update(plan: FusedPlan, leaf_args: Sequence, residuals: Sequence) -> list:
  """The fused update of local (per-device) leaves, with the plan's kernel.

  `leaf_args` holds, per param leaf, its param, gradient and state
  components; returns, per leaf, the new param and state components.
  """
  interpret = plan.kernel == "interpret"
  width = 2 + plan.components
  scalar_of = dict(zip(plan.residual_ids, residuals, strict=True))
  results: list[Any] = [None] * (len(leaf_args) // width * (width - 1))
  for group in plan.groups:
    scalars = [scalar_of[r] for r in group.residuals]
    for leaves in _alike(group.leaves, leaf_args, width):
      args = [list(leaf_args[i * width : (i + 1) * width]) for i in leaves]
      buffers = _group_buffers(group, interpret, args, scalars)
      offset = 0
      for i, leaf in zip(leaves, args, strict=True):
        shape, size = leaf[0].shape, math.prod(leaf[0].shape)
        for k, out in enumerate(buffers):
          piece = jax.lax.slice(out, (offset,), (offset + size,))
          results[i * (width - 1) + k] = piece.reshape(shape)
        offset += size
  return results


def _alike(leaves: Sequence[int], leaf_args: Sequence, width: int) -> list[list[int]]:
  """A group's ``leaves``, in runs whose arrays vary over the same manual mesh axes
  (`varying_over`), each run concatenated into buffers of its own.

  Under `jax.shard_map` (with ``check_vma``), one buffer of a leaf split over an
  axis and one replicated over it would vary over it, and so would the replicated
  leaf's results, which its output spec refuses. Elsewhere nothing varies: one run.
  """
  runs: dict[frozenset, list[int]] = {}
  for i in leaves:
    runs.setdefault(varying_over(leaf_args[i * width : (i + 1) * width]), []).append(i)
  return list(runs.values())


def _gpu_platform() -> str:
  """The platform name of the default GPU backend for lowering: "cuda" or "rocm"."""
  version = jax.extend.backend.get_backend().platform_version.lower()
  return "rocm" if "rocm" in version else "cuda"


LOWERING_TARGET = jax.sharding.AbstractDevice(
  device_kind="NVIDIA H100", num_cores=None, platform="gpu"
)
"""The GPU that `check_lowering` lowers for in a process without one (compute capability 9.0)."""


def _lowering_target(platform: str) -> contextlib.AbstractContextManager:
  """A context that names `LOWERING_TARGET` as the device to lower for, where there is no GPU.

  Without a GPU, jax 0.10's Triton lowering assumed compute capability 9.0;
  jax 0.11's asks for the GPU in the abstract mesh's ``abstract_device``
  (otherwise: "No supported GPU devices found"). The mesh's axes stay as
  they are. With a GPU (or for ROCm), nothing changes.

  Example (in a process without a GPU, as the tests run):
    >>> with _lowering_target("cuda"):
    ...   jax.sharding.get_abstract_mesh().abstract_device.device_kind
    'NVIDIA H100'
  """
  try:
    jax.local_devices(backend="gpu")
  except RuntimeError:
    if platform == "cuda":
      mesh = jax.sharding.get_abstract_mesh().update(abstract_device=LOWERING_TARGET)
      return jax.sharding.use_abstract_mesh(mesh)
  return contextlib.nullcontext()


def check_lowering(programs: Sequence[tuple[Program, tuple, tuple]], platform: str | None) -> None:
  """Lowers each program's Pallas kernel for the GPU.

  Lowering needs no GPU (`jax.export` lowers for any platform), so the same
  check runs on CPU in the tests; there it lowers for `LOWERING_TARGET`.

  Args:
    programs: per program, the program, its buffers' dtypes (param,
      gradient, state components) and its scalar residuals' dtypes.
    platform: ``"cuda"`` or ``"rocm"``; by default the default backend's.

  Raises:
    NotFusible: for the first program whose kernel does not lower.
  """
  platform = platform or _gpu_platform()
  with _lowering_target(platform):
    for program, buffer_dtypes, scalar_dtypes in programs:
      buffers = [jax.ShapeDtypeStruct((_BLOCK,), dtype) for dtype in buffer_dtypes]
      scalars = [jax.ShapeDtypeStruct((), dtype) for dtype in scalar_dtypes]

      def kernel(buffers, scalars, program=program):
        return _pallas_group(program, buffers, scalars, interpret=False)

      try:
        jax.export.export(
          jax.jit(kernel),
          platforms=(platform,),
          disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(_TRITON_CALL)],
        )(buffers, scalars)
      except NotImplementedError as error:
        raise NotFusible(f"its Pallas kernel does not lower for {platform}: {error}") from None
