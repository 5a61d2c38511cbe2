"""Tests for TrainState: splitting model variables, updates, state dicts, logical axes."""

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.linen import partitioning as flax_partitioning
from jax.sharding import PartitionSpec as P

from t5x_optim import OptaxWrapper, TrainState, optimizers
from t5x_optim.partitioning import StateRulesFallback

EMBED, MLP = 4, 8
KERNEL_AXES = P("embed", "mlp")


class AxesModel(nn.Module):
  """T5X style: param_with_axes writes a params_axes collection; a stats collection with axes."""

  @nn.compact
  def __call__(self, x):
    kernel = flax_partitioning.param_with_axes(
      "kernel", nn.initializers.lecun_normal(), (EMBED, MLP), axes=("embed", "mlp")
    )
    bias = flax_partitioning.param_with_axes("bias", nn.initializers.zeros, (MLP,), axes=("mlp",))
    total = flax_partitioning.variable_with_axes("stats", "total", jnp.zeros, (MLP,), axes=("mlp",))
    y = x @ kernel + bias
    total.value = total.value + y.sum(0)
    return y


class BoxedModel(nn.Module):
  """Flax style: nn.with_logical_partitioning boxes; a cache collection without axes."""

  @nn.compact
  def __call__(self, x):
    y = nn.Dense(
      MLP,
      kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp")),
      use_bias=False,
      name="dense",
    )(x)
    self.variable("cache", "last", jnp.zeros, (MLP,))
    return y


def _x():
  return jnp.ones((2, EMBED))


def _variables(model):
  return model.init(jax.random.key(0), _x())


@pytest.mark.parametrize(
  "model, params_axes, mutables, mutables_axes",
  [
    (
      AxesModel(),
      {"kernel": KERNEL_AXES, "bias": P("mlp")},
      {"stats": {"total": (MLP,)}},
      {"stats": {"total": P("mlp")}},
    ),
    (
      BoxedModel(),
      {"dense": {"kernel": KERNEL_AXES}},
      {"cache": {"last": (MLP,)}},
      {"cache": {"last": None}},
    ),
  ],
)
@pytest.mark.parametrize("freeze", [False, True])
def test_create_splits_params_axes_and_mutables(
  model, params_axes, mutables, mutables_axes, freeze
):
  variables = _variables(model)
  state = TrainState.create(
    optimizers.adamw(1e-3), flax.core.freeze(variables) if freeze else variables
  )
  assert type(state.params) is dict and type(state.flax_mutables) is dict
  assert jax.tree.structure(state.params) == jax.tree.structure(params_axes)
  assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(state.params))
  assert state.params_axes == params_axes
  assert jax.tree.map(np.shape, state.flax_mutables) == mutables
  assert state.flax_mutables_axes == mutables_axes
  assert int(state.step) == 0


def test_as_logical_axes_has_the_state_structure():
  state = TrainState.create(optimizers.adamw(1e-3), _variables(AxesModel()))
  logical = state.as_logical_axes()
  assert type(logical) is TrainState
  assert logical.step is None
  axes = {"kernel": KERNEL_AXES, "bias": P("mlp")}
  assert logical.params == axes
  assert logical.param_states == (
    optax.ScaleByAdamState(count=None, mu=axes, nu=axes),
    optax.EmptyState(),
    optax.EmptyState(),
  )
  assert logical.flax_mutables == {"stats": {"total": P("mlp")}}

  def is_spec(x):
    return x is None or isinstance(x, P)

  assert jax.tree.structure(logical, is_leaf=is_spec) == jax.tree.structure(state)


def test_params_without_axes_are_replicated():
  state = TrainState.create(optimizers.sgd(0.1), {"params": {"w": jnp.ones(3)}})
  assert state.params_axes == {"w": None}
  assert state.as_logical_axes().params == {"w": None}


def test_apply_gradient_matches_the_optimizer_and_works_under_jit():
  opt_def = optimizers.adamw(1e-2)
  variables = _variables(AxesModel())
  state = TrainState.create(opt_def, variables)
  grads = jax.tree.map(jnp.ones_like, state.params)
  new_state = jax.jit(lambda s, g: s.apply_gradient(flax.core.freeze(g)))(state, grads)
  expected = opt_def.create(variables["params"]).apply_gradient(grads)
  assert int(new_state.step) == 1

  def close(a, b):
    return np.testing.assert_allclose(a, b, rtol=1e-6)

  jax.tree.map(close, new_state.params, expected.target)
  jax.tree.map(close, new_state.param_states, expected.state.param_states)
  assert new_state.params_axes == state.params_axes


def test_apply_gradient_learning_rate_override_and_mutables():
  opt_def = OptaxWrapper(optax.inject_hyperparams(optax.sgd)(learning_rate=1.0))
  state = TrainState.create(opt_def, {"params": {"w": jnp.ones(2)}, "stats": {"n": jnp.zeros(())}})
  kept = state.apply_gradient({"w": jnp.ones(2)}, learning_rate=0.25)
  np.testing.assert_allclose(kept.params["w"], 0.75)
  assert kept.flax_mutables == state.flax_mutables
  new = state.apply_gradient(
    {"w": jnp.ones(2)}, flax_mutables=flax.core.freeze({"stats": {"n": jnp.ones(())}})
  )
  np.testing.assert_allclose(new.params["w"], 0.0)
  assert type(new.flax_mutables) is dict and float(new.flax_mutables["stats"]["n"]) == 1.0


def test_state_dict_layout_and_round_trip():
  opt_def = optimizers.adamw(1e-3)
  state = TrainState.create(opt_def, _variables(AxesModel()))
  state = state.apply_gradient(jax.tree.map(jnp.ones_like, state.params))
  state_dict = state.state_dict()
  assert set(state_dict) == {"target", "state", "flax_mutables"}
  assert set(state_dict["state"]["param_states"]["0"]) == {"count", "mu", "nu"}
  assert set(state_dict["flax_mutables"]) == {"stats"}
  fresh = TrainState.create(opt_def, _variables(AxesModel()))
  restored = fresh.restore_state(state_dict)
  assert int(restored.step) == 1
  jax.tree.map(np.testing.assert_array_equal, restored, state)
  no_mutables = TrainState.create(optimizers.sgd(0.1), {"params": {"w": jnp.ones(2)}})
  assert set(no_mutables.state_dict()) == {"target", "state"}


@pytest.mark.slow
def test_restore_state_names_missing_mutables():
  state = TrainState.create(optimizers.adamw(1e-3), _variables(AxesModel()))
  state_dict = state.state_dict()
  del state_dict["flax_mutables"]
  with pytest.raises(ValueError, match="Missing key 'flax_mutables/stats'"):
    state.restore_state(state_dict)


def test_replace_params_and_step():
  state = TrainState.create(optimizers.sgd(0.1), {"params": {"w": jnp.ones(2)}})
  replaced = state.replace_params(flax.core.freeze({"w": jnp.zeros(2)})).replace_step(7)
  assert type(replaced.params) is dict and float(replaced.params["w"].sum()) == 0.0
  assert replaced.step == 7
  with pytest.raises(ValueError, match=r"paths only in the new params: \['v'\]"):
    state.replace_params({"w": jnp.ones(2), "v": jnp.ones(2)})


def test_replaced_params_of_another_shape_are_refused():
  """A (1, 8) param in place of a (4, 8) one was taken: the next step broadcast it against
  adam's (4, 8) moments and the param became (4, 8) without a word."""
  state = TrainState.create(optimizers.adamw(1e-3), {"params": {"w": jnp.ones((4, 8))}})
  with pytest.raises(ValueError, match=r"'w': new params \(1, 8\), the train state's \(4, 8\)"):
    state.replace_params({"w": jnp.ones((1, 8))})
  state = TrainState.create(optimizers.sgd(0.1), _variables(AxesModel()))
  stats = jax.tree.map(lambda x: jnp.ones((1, *x.shape)), state.flax_mutables)
  with pytest.raises(ValueError, match=r"new flax_mutables \(1, "):
    state.replace_flax_mutables(stats)


def test_mutables_of_another_structure_are_named_as_the_train_states_mutables():
  """The reference side of a flax_mutables mismatch was called the params."""
  state = TrainState.create(optimizers.sgd(0.1), _variables(AxesModel()))
  other = {"stats": {"count": jnp.ones(MLP)}}
  with pytest.raises(ValueError) as raised:
    state.apply_gradient(jax.tree.map(jnp.ones_like, state.params), flax_mutables=other)
  message = str(raised.value)
  assert "paths only in the train state's flax_mutables: ['stats/total']" in message
  assert "train state's flax_mutables tree: PyTreeDef" in message
  assert "params" not in message
  empty = {"stats": {"total": jnp.ones(MLP), "more": {}}}
  with pytest.raises(ValueError, match=r"have an empty dict, the train state's flax_mutables no"):
    state.replace_flax_mutables(empty)
  with pytest.raises(ValueError, match=r"paths only in the train state's params: \['bias'\]"):
    state.replace_params({"kernel": state.params["kernel"]})


class _WantsAxes(OptaxWrapper):
  """An optimizer definition that partitions by param axes, like T5X's Adafactor."""

  def set_param_axes(self, param_logical_axes):
    self.seen_axes = param_logical_axes


@pytest.mark.parametrize(
  "variables, match",
  [
    ({"stats": {}}, r"no 'params' collection; its collections are \['stats'\]"),
    (
      {
        "params": {"w": jnp.ones(2), "v": jnp.ones(2)},
        "params_axes": {"w_axes": flax_partitioning.AxisMetadata(("mlp",))},
      },
      r"variables without axes: \['v'\]",
    ),
    (
      {"params": {"w": jnp.ones(2)}, "cache_axes": {}},
      r"Axes collections \['cache_axes'\] have no matching variable collection",
    ),
    ({"params": {"w": jnp.ones(2)}}, r"_WantsAxes partitions by .* the model emits none"),
  ],
)
def test_create_errors(variables, match):
  with pytest.raises(ValueError, match=match):
    TrainState.create(_WantsAxes(optax.sgd(0.1)), variables)


def test_create_refuses_mesh_axis_boxes_naming_the_variable():
  boxed = nn.Partitioned(jnp.ones((EMBED, MLP)), ("data", "model"))
  with pytest.raises(TypeError, match=r"'params/w' is a flax Partitioned box .*mesh axes"):
    TrainState.create(optimizers.adam(1e-3), {"params": {"w": boxed}})


def test_set_param_axes_gets_the_axes_on_a_copy():
  """The caller's definition took the axes in place, so it placed its params by the last
  model's axes wherever else it was used."""
  opt_def = _WantsAxes(optax.sgd(0.1))
  state = TrainState.create(opt_def, _variables(BoxedModel()))
  assert state.optimizer.optimizer_def.seen_axes == {"dense": {"kernel": KERNEL_AXES}}
  assert not hasattr(opt_def, "seen_axes")
  again = TrainState.create(opt_def, _variables(BoxedModel()))
  assert again.optimizer.optimizer_def is state.optimizer.optimizer_def


@pytest.mark.parametrize("fallback", list(StateRulesFallback))
def test_as_logical_axes_applies_the_definitions_fallback(fallback):
  # A spec longer than the param's rank: adam's mu and nu cannot keep it.
  boxed = nn.LogicallyPartitioned(jnp.ones(4), ("embed", "mlp"))
  state = TrainState.create(
    OptaxWrapper(optax.adam(0.1), fallback=fallback), {"params": {"w": boxed}}
  )
  if fallback is StateRulesFallback.RAISE:
    with pytest.raises(ValueError, match=r"0/mu/w \(shape \(4,\), spec"):
      state.as_logical_axes()
  else:
    with pytest.warns(UserWarning, match=r"replicating 2 optimizer state leaves.*0/nu/w \(shape"):
      logical = state.as_logical_axes()
    assert logical.param_states[0].mu == {"w": None}


def test_a_box_and_an_axes_collection_that_disagree_are_refused():
  """The collection's axes were taken and the box's dropped without a word."""
  boxed = nn.LogicallyPartitioned(jnp.ones((2, 4)), ("embed", "mlp"))
  variables = {
    "params": {"w": boxed},
    "params_axes": {"w_axes": flax_partitioning.AxisMetadata(("mlp", "embed"))},
  }
  with pytest.raises(
    ValueError, match=r"'params/w': box .*'embed', 'mlp'.*collection .*'mlp', 'embed'"
  ):
    TrainState.create(optimizers.adamw(0.1), variables)
  variables["params_axes"] = {"w_axes": flax_partitioning.AxisMetadata(("embed", "mlp"))}
  assert TrainState.create(optimizers.adamw(0.1), variables).params_axes == {"w": P("embed", "mlp")}
