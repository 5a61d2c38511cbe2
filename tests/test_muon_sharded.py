"""Muon with axis-derived dimension numbers, sharded on 8 simulated CPU devices.

tests/conftest.py sets ``--xla_force_host_platform_device_count=8`` before jax
is imported. A sharded step (params by the rules, the state also over the data
axis with ZeRO rules) gives the params of the unsharded one.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.linen import partitioning as flax_partitioning
from jax.sharding import PartitionSpec as P

from t5x_optim import TrainState, optimizers
from t5x_optim.partitioning import (
  Partitioner,
  create_mesh,
  logical_to_mesh_axes_tree,
  optimizer_state_mesh_axes_tree,
  standard_logical_axis_rules,
)

LAYERS, EMBED, MLP, HEADS, KV, VOCAB, BATCH, LENGTH, STEPS = 2, 16, 32, 4, 4, 32, 8, 4, 3
BATCH_AXES = {"tokens": P("batch", None)}


class ScannedLM(nn.Module):
  """A T5X-style scanned stack: a 'layers' axis first, param_with_axes."""

  @nn.compact
  def __call__(self, tokens):
    def param(name, shape, axes, init=nn.initializers.lecun_normal()):
      return flax_partitioning.param_with_axes(name, init, shape, axes=axes)

    embedding = param("embedding", (VOCAB, EMBED), ("vocab", "embed"), nn.initializers.normal(1.0))
    query = param("query", (LAYERS, EMBED, HEADS, KV), ("layers", "embed", "heads", "kv"))
    out = param("out", (LAYERS, HEADS, KV, EMBED), ("layers", "heads", "kv", "embed"))
    wi = param("wi", (LAYERS, EMBED, MLP), ("layers", "embed", "mlp"))
    wo = param("wo", (LAYERS, MLP, EMBED), ("layers", "mlp", "embed"))
    scale = param("scale", (LAYERS, EMBED), ("layers", "embed"), nn.initializers.ones)
    final = param("final_scale", (EMBED,), ("embed",), nn.initializers.ones)
    logits = param("logits", (EMBED, VOCAB), ("embed", "vocab"))
    x = embedding[tokens]
    for layer in range(LAYERS):
      h = x * scale[layer]
      x = x + jnp.einsum(
        "bshk,hke->bse", jnp.tanh(jnp.einsum("bse,ehk->bshk", h, query[layer])), out[layer]
      )
      x = x + jax.nn.relu(x @ wi[layer]) @ wo[layer]
    return (x * final) @ logits


MODEL = ScannedLM()
MUON_ARGS = {"learning_rate": 0.02, "weight_decay": 1e-2}


def _batch(step):
  return {"tokens": jax.random.randint(jax.random.key(step + 1), (BATCH, LENGTH + 1), 0, VOCAB)}


def _train_step(state, batch):
  def loss_fn(params):
    logits = MODEL.apply({"params": params}, batch["tokens"][:, :-1])
    labels = batch["tokens"][:, 1:]
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradient(grads), loss


@functools.cache
def _variables():
  return jax.device_get(MODEL.init(jax.random.key(0), jnp.zeros((1, LENGTH), jnp.int32)))


def _run(state, step_fn):
  losses = []
  for step in range(STEPS):
    state, loss = step_fn(state, _batch(step))
    losses.append(float(loss))
  return state, losses


@functools.cache
def _unsharded():
  state = TrainState.create(optimizers.muon(**MUON_ARGS), _variables())
  return _run(state, jax.jit(_train_step))


def _normalized(specs):
  def norm(spec):
    entries = list(spec or ())
    while entries and entries[-1] is None:
      entries.pop()
    return P(*entries)

  return jax.tree.map(norm, specs, is_leaf=lambda x: x is None or isinstance(x, P))


@pytest.mark.parametrize(
  ("data", "model", "zero", "dims"),
  [(2, 4, False, 1), (2, 4, True, 1), (4, 2, True, 2)],
  ids=["2x4", "2x4-zero", "4x2-zero-2d"],
)
@pytest.mark.slow
def test_sharded_muon_matches_unsharded(data, model, zero, dims):
  partitioner = Partitioner(
    create_mesh(shape={"data": data, "model": model}),
    standard_logical_axis_rules(
      shard_optimizer_state_over_data=zero, parameter_partitioning_dims=dims
    ),
  )
  state = TrainState.create(optimizers.muon(**MUON_ARGS), _variables())
  shardings = partitioner.get_shardings(state)
  step_fn = partitioner.partition(
    _train_step, (shardings, BATCH_AXES), (shardings, None), donate_argnums=0
  )
  sharded, losses = _run(jax.device_put(state, shardings), step_fn)
  expected, expected_losses = _unsharded()
  np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
  jax.tree.map(
    functools.partial(np.testing.assert_allclose, rtol=1e-4, atol=1e-5),
    jax.device_get(sharded.params),
    jax.device_get(expected.params),
  )
  # Every state leaf is where the rules put it: momentum like its param (plus
  # the data axis with ZeRO rules), count and ns_coeffs replicated.
  logical = sharded.as_logical_axes()
  rules = partitioner.logical_axis_rules
  want = optimizer_state_mesh_axes_tree(
    logical.param_states, sharded.param_states, rules, mesh_shape=partitioner.mesh.shape
  )
  got = jax.tree.map(lambda x: x.sharding.spec, sharded.param_states)
  assert _normalized(got) == _normalized(want)
  mu = sharded.param_states.inner_states["muon"].inner_state[0].mu
  param_spec = _normalized(logical_to_mesh_axes_tree(logical.params, rules))["wi"]
  mu_spec = _normalized(mu["wi"].sharding.spec)
  if zero and dims == 1:  # the param is not over 'data': ZeRO adds it to the momentum
    assert param_spec == P(None, None, "model") and "data" in tuple(mu_spec)
  else:
    assert mu_spec == param_spec
  assert isinstance(mu["embedding"], optax.MaskedNode)
