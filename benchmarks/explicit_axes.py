"""Benchmark: the optimizer step on a mesh with Explicit axes against the same mesh with Auto axes.

For 8 layers of two 512 x 2048 matrices (16.8M params) on a 2 x 4 ``(data, model)`` mesh of 8
simulated CPU devices, with the state sharded like the params or also over ``data`` (ZeRO),
prints per mode (adamw in float32, 8-bit and bf16+SR `low_precision` states) and per axis type
the compiled step's peak per device (arguments + outputs + temporaries - aliased, from XLA's
memory analysis), the compile time and the median step time. The step is ``apply_gradient``
jitted with the params and state donated; the grads are an argument. Runs alternate Auto and
Explicit, twice.

Target: under Explicit axes the peak equals Auto's, and the step time is within noise of it.

Run: ``python benchmarks/explicit_axes.py [--repeats 2] [--steps 10]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import _cpu_devices  # noqa: F401  (sets the device flags before jax loads)
import jax
import jax.numpy as jnp
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from t5x_optim import OptaxWrapper, low_precision
from t5x_optim.partitioning import (
  create_mesh,
  logical_to_mesh_axes_tree,
  optimizer_state_mesh_axes_tree,
  standard_logical_axis_rules,
)

LAYERS, EMBED, MLP = 8, 512, 2048
MODES = {
  "adamw": lambda: optax.adamw(1e-3),
  "8-bit": lambda: low_precision(optax.adamw(1e-3), "8bit"),
  "bf16+SR": lambda: low_precision(optax.adamw(1e-3), "bfloat16"),
}


def _params() -> tuple[dict, dict]:
  params, axes = {}, {}
  for i in range(LAYERS):
    params[f"layer_{i}"] = {
      "wi": jnp.full((EMBED, MLP), 0.01),
      "wo": jnp.full((MLP, EMBED), 0.01),
    }
    axes[f"layer_{i}"] = {"wi": P("embed", "mlp"), "wo": P("mlp", "embed")}
  return params, axes


def _shardings(opt, axes, mesh, zero: bool):
  rules = standard_logical_axis_rules(shard_optimizer_state_over_data=zero)
  logical = opt.optimizer_def.derive_logical_axes(opt, axes)
  specs = logical.replace(
    target=logical_to_mesh_axes_tree(logical.target, rules),
    state=logical.state.replace(
      step=P(),
      param_states=optimizer_state_mesh_axes_tree(
        logical.state.param_states, opt.state.param_states, rules, mesh_shape=mesh.shape
      ),
    ),
  )
  return jax.tree.map(
    lambda spec: NamedSharding(mesh, spec or P()),
    specs,
    is_leaf=lambda x: x is None or isinstance(x, P),
  )


def measure(mode: str, axis_types: AxisType, zero: bool, steps: int) -> tuple[int, float, float]:
  """(peak bytes per device, compile seconds, median step seconds)."""
  params, axes = _params()
  opt = OptaxWrapper(MODES[mode]()).create(params)
  mesh = create_mesh(shape={"data": 2, "model": 4}, axis_types=axis_types)
  shardings = _shardings(opt, axes, mesh, zero)
  opt = jax.device_put(opt, shardings)
  grads = jax.device_put(jax.tree.map(lambda x: x * 0.1, params), shardings.target)
  step = jax.jit(
    lambda o, g: o.apply_gradient(g),
    in_shardings=(shardings, shardings.target),
    out_shardings=shardings,
    donate_argnums=0,
  )
  start = time.perf_counter()
  compiled = step.lower(opt, grads).compile()
  compile_s = time.perf_counter() - start
  m = compiled.memory_analysis()
  peak = (
    m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
  )
  opt = jax.block_until_ready(compiled(opt, grads))
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    opt = jax.block_until_ready(compiled(opt, grads))
    times.append(time.perf_counter() - start)
  return peak, compile_s, statistics.median(times)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--repeats", type=int, default=2, help="Auto/Explicit pairs per row")
  parser.add_argument("--steps", type=int, default=10, help="timed steps per run")
  args = parser.parse_args()
  params = LAYERS * 2 * EMBED * MLP
  print(f"{params / 1e6:.1f}M params on 2 x 4 devices; peak per device, median step time")
  print(f"{'mode':8s} {'state':10s} {'axes':9s} {'peak MB':>8s} {'compile s':>10s} {'step ms':>8s}")
  for mode in MODES:
    for zero in (False, True):
      for _ in range(args.repeats):
        for axis_types in (AxisType.Auto, AxisType.Explicit):
          peak, compile_s, step_s = measure(mode, axis_types, zero, args.steps)
          state = "ZeRO" if zero else "as params"
          print(
            f"{mode:8s} {state:10s} {axis_types.name:9s} {peak / 1e6:8.1f} {compile_s:10.2f} "
            f"{step_s * 1e3:8.1f}",
            flush=True,
          )


if __name__ == "__main__":
  main()
