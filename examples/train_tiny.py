"""Trains a tiny Flax MLP with `OptaxWrapper(optax.adamw(...))` and prints the loss.

Run: ``python examples/train_tiny.py``.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from t5x_optim import OptaxWrapper


class MLP(nn.Module):
  """Two dense layers."""

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    return nn.Dense(1)(nn.relu(nn.Dense(32)(x)))


def main(steps: int = 200) -> None:
  x = jax.random.normal(jax.random.key(0), (256, 4))
  y = jnp.sin(x.sum(axis=1, keepdims=True))
  model = MLP()
  params = model.init(jax.random.key(1), x)["params"]

  def loss_fn(params):
    return jnp.mean((model.apply({"params": params}, x) - y) ** 2)

  @jax.jit
  def train_step(optimizer):
    loss, grads = jax.value_and_grad(loss_fn)(optimizer.target)
    return optimizer.apply_gradient(grads), loss

  optimizer = OptaxWrapper(optax.adamw(learning_rate=1e-2)).create(params)
  first = None
  for step in range(steps):
    optimizer, loss = train_step(optimizer)
    first = float(loss) if first is None else first
    if step % 40 == 0 or step == steps - 1:
      print(f"step {int(optimizer.state.step):4d}  loss {float(loss):.4f}")
  print(f"loss fell from {first:.4f} to {float(loss):.4f}")


if __name__ == "__main__":
  main()
