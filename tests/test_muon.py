"""Muon's dimension numbers from logical axes (`KernelAxesRule`, `KernelAxesOptaxWrapper`)."""

from __future__ import annotations

import copy
import functools
import json
import pathlib
import re

import flax
import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
import pytest
from _t5x import run_t5x_check, t5x_at_hand
from flax.linen import partitioning as flax_partitioning
from jax.sharding import PartitionSpec as P

import t5x_optim
from t5x_optim import TrainState, convert_state, optimizers
from t5x_optim._axes.kernel_axes import KernelAxes, KernelAxesRule, UnplaceableParamsError
from t5x_optim.cli.loop import config as _config

D = optax.contrib.MuonDimensionNumbers
K = KernelAxes
LAYERS, EMBED, MLP, HEADS, KV, VOCAB = 2, 16, 32, 2, 8, 64
STEPS = 4

# (logical axes, what the default rule makes of them)
RULE_TABLE = [
  (("embed", "mlp"), K((), (0,), (1,))),
  (("mlp", "embed"), K((), (0,), (1,))),
  (("layers", "embed", "mlp"), K((0,), (1,), (2,))),
  (("embed", "layers", "mlp"), K((1,), (0,), (2,))),
  (("layers", "embed", "heads", "kv"), K((0,), (1,), (2, 3))),
  (("layers", "heads", "kv", "embed"), K((0,), (1, 2), (3,))),
  (("embed", "joined_kv"), K((), (0,), (1,))),
  (("expert", "embed", "mlp"), K((0,), (1,), (2,))),
  ((None, None), K((), (0,), (1,))),
  (("vocab", "embed"), None),
  (("embed", "vocab"), None),
  (("layers", "vocab", "embed"), None),
  (("length", "embed"), None),
  (("heads", "relpos_buckets"), None),
  (("embed",), None),
  (("layers", "embed"), None),
  (("heads", "kv"), None),
  ((), None),
]


@pytest.mark.parametrize(("names", "expected"), RULE_TABLE, ids=lambda x: str(x))
def test_default_rule_places_t5x_axes(names, expected):
  assert KernelAxesRule().place("p", names) == expected


OVERRIDE_TABLE = [
  ({"dec/wo": "adam"}, "dec/wo", ("layers", "mlp", "embed"), None),
  ({"dec/.*": None}, "dec/wo", ("mlp", "embed"), None),
  ({".*wo": ("embed", "mlp")}, "dec/wo", ("layers", "mlp", "embed"), K((0,), (2,), (1,))),
  ({"x": "adam"}, "dec/wo", ("mlp", "embed"), K((), (0,), (1,))),
  ({".*": (["a", "b"], "c")}, "p", ("a", "c", "b"), K((), (0, 2), (1,))),
]


@pytest.mark.parametrize(("overrides", "path", "names", "expected"), OVERRIDE_TABLE)
def test_overrides_match_the_whole_path(overrides, path, names, expected):
  assert KernelAxesRule(overrides=overrides).place(path, names) == expected


def test_configured_axes():
  rule = KernelAxesRule(batch_axes=["stack"], adam_axes=[], axis_groups=[["heads", "head_dim"]])
  with pytest.raises(UnplaceableParamsError):
    rule.place("p", ("layers", "embed", "mlp"))  # 'layers' is no batch axis here: 3 groups
  assert rule.place("p", ("vocab", "embed")) == K((), (0,), (1,))
  assert rule.place("p", ("stack", "heads", "head_dim", "embed")) == K((0,), (1, 2), (3,))


def test_unplaceable_params_are_named_in_one_error():
  rule = KernelAxesRule()
  with pytest.raises(UnplaceableParamsError) as info:
    rule.place_all(
      {
        "ok": ("embed", "mlp"),
        "enc/conv": ("width", "embed", "mlp"),
        "dec/odd": ("heads", "embed", "kv"),
      }
    )
  message = str(info.value)
  assert "cannot place 2 params" in message
  assert "'enc/conv' with axes ('width', 'embed', 'mlp')" in message
  assert "'dec/odd' with axes ('heads', 'embed', 'kv')" in message
  assert "'ok'" not in message and "overrides=" in message


def test_override_naming_a_missing_axis():
  with pytest.raises(UnplaceableParamsError, match=r"'w'.*'mlp'.*\('embed', 'kv'\)"):
    KernelAxesRule(overrides={"w": ("mlp", "kv")}).place("w", ("embed", "kv"))


@pytest.mark.parametrize(
  "override", [("embed", "embed"), (("embed", "embed"), "mlp"), ("embed", ("mlp", "embed"))]
)
def test_override_naming_an_axis_twice_is_refused(override):
  """An override that names one axis on both sides, or twice on one, gave dimension numbers
  such as reduction (0,) and output (0,), and Muon trained with them without a word."""
  with pytest.raises(UnplaceableParamsError, match=r"'w' names the axis 'embed' twice"):
    KernelAxesRule(overrides={"w": override}).place("w", ("embed", "mlp"))


def test_unplaceable_params_message_ends_in_one_period():
  with pytest.raises(UnplaceableParamsError) as raised:
    KernelAxesRule(overrides={"w": ("embed", "heads")}).place_all({"w": ("embed", "mlp")})
  assert "(need exactly once). Add the axis names" in str(raised.value), raised.value


def test_bad_override_value():
  with pytest.raises(TypeError, match="'adam'.*got 3"):
    KernelAxesRule(overrides={"w": 3})


def _scanned_t5():
  """A scanned T5-style tree: its params, logical axes and the MaxText-style numbers."""
  rng = np.random.default_rng(0)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
  params = {
    "token_embedder": {"embedding": normal(VOCAB, EMBED)},
    "decoder": {
      "layers": {
        "self_attention": {
          "query": {"kernel": normal(LAYERS, EMBED, HEADS, KV)},
          "out": {"kernel": normal(LAYERS, HEADS, KV, EMBED)},
        },
        "mlp": {
          "wi_0": {"kernel": normal(LAYERS, EMBED, MLP)},
          "wo": {"kernel": normal(LAYERS, MLP, EMBED)},
        },
        "pre_mlp_layer_norm": {"scale": jnp.ones((LAYERS, EMBED))},
      },
      "decoder_norm": {"scale": jnp.ones(EMBED)},
      "logits_dense": {"kernel": normal(EMBED, VOCAB)},
    },
  }
  axes = {
    "token_embedder": {"embedding": P("vocab", "embed")},
    "decoder": {
      "layers": {
        "self_attention": {
          "query": {"kernel": P("layers", "embed", "heads", "kv")},
          "out": {"kernel": P("layers", "heads", "kv", "embed")},
        },
        "mlp": {
          "wi_0": {"kernel": P("layers", "embed", "mlp")},
          "wo": {"kernel": P("layers", "mlp", "embed")},
        },
        "pre_mlp_layer_norm": {"scale": P("layers", "embed")},
      },
      "decoder_norm": {"scale": P("embed")},
      "logits_dense": {"kernel": P("embed", "vocab")},
    },
  }
  numbers = {
    "token_embedder": {"embedding": None},
    "decoder": {
      "layers": {
        "self_attention": {
          "query": {"kernel": D((1,), (2, 3))},
          "out": {"kernel": D((1, 2), (3,))},
        },
        "mlp": {"wi_0": {"kernel": D((1,), (2,))}, "wo": {"kernel": D((1,), (2,))}},
        "pre_mlp_layer_norm": {"scale": None},
      },
      "decoder_norm": {"scale": None},
      "logits_dense": {"kernel": None},
    },
  }
  return params, axes, numbers


MUON_ARGS = {"learning_rate": 0.02, "weight_decay": 1e-2, "adam_weight_decay": 1e-3}


def _grads(params, step):
  rng = np.random.default_rng(100 + step)
  return jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape) * 0.1, x.dtype), params)


def _optax_loop(tx, params, steps=STEPS):
  state = tx.init(params)
  for step in range(steps):
    updates, state = tx.update(_grads(params, step), state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def _wrapper_loop(opt_def, params, steps=STEPS):
  optimizer = opt_def.create(params)
  for step in range(steps):
    optimizer = optimizer.apply_gradient(_grads(params, step))
  return optimizer


def test_dimension_numbers_of_a_scanned_t5_tree():
  params, axes, numbers = _scanned_t5()
  opt_def = optimizers.muon(**MUON_ARGS)
  opt_def.set_param_axes(axes)
  assert opt_def.dimension_numbers(params) == numbers


def test_set_param_axes_after_create_refuses_other_axes():
  """set_param_axes rebuilt the transformation of a definition that had created an
  optimizer: a step jitted before kept Adam on a kernel describe_params called Muon, and the
  eager step failed with a TypeError."""
  params = {"wi": jnp.ones((LAYERS, EMBED, MLP))}
  opt_def = optimizers.muon(**MUON_ARGS)
  tx = opt_def.optax_optimizer
  opt_def.create(params)
  with pytest.raises(ValueError, match=r"created an optimizer.*with_param_axes"):
    opt_def.set_param_axes({"wi": P("layers", "embed", "mlp")})
  assert opt_def.optax_optimizer is tx and opt_def.param_specs is None


def test_set_param_axes_after_create_takes_the_same_axes_again():
  """T5X's train state gives the definition the model's axes each time it creates a state."""
  params = {"wi": jnp.ones((LAYERS, EMBED, MLP))}
  axes = {"wi": P("layers", "embed", "mlp")}
  opt_def = optimizers.muon(**MUON_ARGS)
  opt_def.set_param_axes(flax.core.freeze(axes))
  tx = opt_def.optax_optimizer
  opt_def.create(params)
  opt_def.set_param_axes(axes)
  assert opt_def.optax_optimizer is tx
  other = t5x_optim.with_param_axes(opt_def, {"wi": P("layers", "vocab", "mlp")})
  assert other is not opt_def
  assert other.dimension_numbers(params) == {"wi": None}
  assert opt_def.dimension_numbers(params) == {"wi": D((1,), (2,))}


def test_a_copy_given_its_originals_axes_builds_its_own_transformation():
  """A copy keeps no transformation of its original's, whose dimension numbers read the
  original's axes when the state is built: axes given to the original later reached it."""
  params = {"wi": jnp.ones((LAYERS, EMBED, MLP))}
  axes = {"wi": P("layers", "embed", "mlp")}
  opt_def = optimizers.muon(**MUON_ARGS)
  opt_def.set_param_axes(axes)
  copied = t5x_optim.with_param_axes(opt_def, axes)
  opt_def.set_param_axes({"wi": P("layers", "vocab", "mlp")})
  state = copied.create(params).state.param_states
  assert state.inner_states["muon"].inner_state[0].mu["wi"].shape == (LAYERS, EMBED, MLP)


def test_a_deep_copy_given_its_originals_axes_builds_its_own_transformation():
  """A deep copy shares its original's transformation (functions are not copied), which reads
  the original's axes: axes given to the original later sent the copy's kernel to Adam while
  describe_params called it Muon."""
  params = {"wi": jnp.ones((LAYERS, EMBED, MLP))}
  axes = {"wi": P("layers", "embed", "mlp")}
  opt_def = optimizers.muon(**MUON_ARGS)
  opt_def.set_param_axes(axes)
  copied = copy.deepcopy(opt_def)
  opt_def.set_param_axes({"wi": P("layers", "vocab", "mlp")})
  copied.set_param_axes(axes)
  state = copied.create(params).state.param_states
  assert state.inner_states["muon"].inner_state[0].mu["wi"].shape == (LAYERS, EMBED, MLP)
  assert isinstance(state.inner_states["adam"].inner_state[0].mu["wi"], optax.MaskedNode)


@pytest.mark.parametrize("copier", [copy.copy, copy.deepcopy], ids=["copy", "deepcopy"])
def test_a_copy_trains_by_its_own_axes_when_its_original_gets_others(copier):
  """A copy kept its original's transformation, whose dimension numbers read the original's
  axes: axes given to the original after the copy sent the copy's kernels by them while its
  describe_params reported its own."""
  params = {"a": jnp.ones((EMBED, MLP)), "b": jnp.ones((MLP, EMBED))}
  axes = {"a": P("embed", "mlp"), "b": P("vocab", "embed")}
  opt_def = optimizers.muon(**MUON_ARGS, param_axes=axes)
  copied = copier(opt_def)
  opt_def.set_param_axes({"a": P("vocab", "embed"), "b": P("embed", "mlp")})
  muon_mu = copied.create(params).state.param_states.inner_states["muon"].inner_state[0].mu
  assert muon_mu["a"].shape == (EMBED, MLP)
  assert isinstance(muon_mu["b"], optax.MaskedNode)


@pytest.mark.parametrize("copier", [copy.copy, copy.deepcopy], ids=["copy", "deepcopy"])
@pytest.mark.parametrize(
  "factory",
  [functools.partial(optimizers.muon, **MUON_ARGS), functools.partial(optimizers.galore, rank=2)],
  ids=["muon", "galore"],
)
def test_a_copy_that_created_takes_its_own_axes_again(copier, factory):
  """A copy forgot the axes it was built with, so after create it refused them as other axes
  while its original took them: T5X gives them at every create, so a copy failed under T5X."""
  params = {"w": jnp.ones((EMBED, MLP)), "b": jnp.ones(MLP)}
  axes = {"w": P("embed", "mlp"), "b": P("mlp")}
  copied = copier(factory(learning_rate=1e-2, param_axes=axes))
  copied.create(params)
  tx = copied.optax_optimizer
  copied.set_param_axes(axes)
  assert copied.optax_optimizer is tx
  with pytest.raises(ValueError, match="created an optimizer"):
    copied.set_param_axes({"w": P("mlp", "embed"), "b": P("mlp")})


def test_train_state_gives_axes_to_a_definition_that_compares_by_value():
  """A definition with __eq__ and no __hash__ (a user's subclass) could not key the copies
  TrainState.create keeps: TypeError 'unhashable type'."""

  class ByValue(t5x_optim.OptaxWrapper):
    def set_param_axes(self, param_logical_axes):
      self.seen = param_logical_axes

    def __eq__(self, other):
      return type(other) is type(self)

  opt_def = ByValue(optax.sgd(0.1))
  names = flax.linen.partitioning.AxisMetadata(names=("embed", "mlp"))
  variables = {"params": {"w": jnp.ones((2, 3))}, "params_axes": {"w_axes": names}}
  state = t5x_optim.TrainState.create(opt_def, variables)
  assert isinstance(state.optimizer.optimizer_def, ByValue)


@pytest.mark.slow
def test_same_params_as_optax_with_hand_written_numbers():
  params, axes, numbers = _scanned_t5()
  opt_def = optimizers.muon(**MUON_ARGS)
  opt_def.set_param_axes(axes)
  optimizer = _wrapper_loop(opt_def, params)
  expected, _ = _optax_loop(
    optax.contrib.muon(**MUON_ARGS, muon_weight_dimension_numbers=numbers), params
  )
  jax.tree.map(np.testing.assert_array_equal, optimizer.target, expected)
  moved = jax.tree.map(lambda a, b: bool((a != b).any()), optimizer.target, params)
  assert all(jax.tree.leaves(moved))
  # Scanned kernels run Muon, the embedding and logits Adam.
  muon_mu = optimizer.state.param_states.inner_states["muon"].inner_state[0].mu
  adam_mu = optimizer.state.param_states.inner_states["adam"].inner_state[0].mu
  assert muon_mu["decoder"]["layers"]["mlp"]["wi_0"]["kernel"].shape == (LAYERS, EMBED, MLP)
  assert isinstance(muon_mu["token_embedder"]["embedding"], optax.MaskedNode)
  assert adam_mu["decoder"]["logits_dense"]["kernel"].shape == (EMBED, VOCAB)


def test_optax_default_differs_on_this_tree():
  """Why the rule exists: optax's ndim == 2 default runs the embedding and logits on Muon."""
  params, axes, _ = _scanned_t5()
  state = optax.contrib.muon(**MUON_ARGS).init(params)
  muon_mu = state.inner_states["muon"].inner_state[0].mu
  assert muon_mu["token_embedder"]["embedding"].shape == (VOCAB, EMBED)
  assert isinstance(muon_mu["decoder"]["layers"]["mlp"]["wi_0"]["kernel"], optax.MaskedNode)


@pytest.mark.slow
def test_without_axes_it_is_optax_default():
  params, _, _ = _scanned_t5()
  opt_def = optimizers.muon(**MUON_ARGS)
  assert opt_def.param_specs is None
  expected, _ = _optax_loop(optax.contrib.muon(**MUON_ARGS), params, steps=2)
  got = _wrapper_loop(opt_def, params, steps=2).target
  jax.tree.map(np.testing.assert_array_equal, got, expected)
  with pytest.raises(ValueError, match="logical axes are not set"):
    opt_def.dimension_numbers(params)


def test_param_axes_argument_and_boxed_forms():
  params, axes, numbers = _scanned_t5()
  assert optimizers.muon(**MUON_ARGS, param_axes=axes).dimension_numbers(params) == numbers
  tuples = jax.tree.map(tuple, axes, is_leaf=lambda x: isinstance(x, P))
  assert optimizers.muon(**MUON_ARGS, param_axes=tuples).dimension_numbers(params) == numbers
  # T5X hands set_param_axes a FrozenDict, and older T5X keeps FrozenDict params.
  opt_def = optimizers.muon(**MUON_ARGS)
  opt_def.set_param_axes(flax.core.freeze(axes))
  frozen = flax.core.freeze(params)
  assert flax.core.unfreeze(opt_def.dimension_numbers(frozen)) == numbers
  muon_mu = opt_def.create(frozen).state.param_states.inner_states["muon"].inner_state[0].mu
  assert muon_mu["decoder"]["layers"]["mlp"]["wo"]["kernel"].shape == (LAYERS, MLP, EMBED)


@pytest.mark.slow
@pytest.mark.parametrize("factory", ["muon", "galore"])
def test_boxed_params_are_placed_by_their_boxes(factory):
  """Params boxed by nn.with_logical_partitioning (adamw takes them) were looked up under the
  box's value ('wi/value'), which has no logical axes; they train as the unboxed params."""

  class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
      init = nn.with_logical_partitioning(nn.initializers.normal(0.1), ("embed", "mlp"))
      scale = nn.with_logical_partitioning(nn.initializers.ones, ("mlp",))
      return x @ self.param("wi", init, (EMBED, MLP)) * self.param("scale", scale, (MLP,))

  boxed = Mlp().init(jax.random.key(0), jnp.ones((2, EMBED)))["params"]
  make = functools.partial(getattr(optimizers, factory), learning_rate=0.02, param_axes=boxed)
  matrix = "muon" if factory == "muon" else "galore"
  assert make().describe_params(boxed)[1] == (
    f"wi ('embed', 'mlp'): {matrix}, inputs ('embed',), outputs ('mlp',)"
  )
  grads = jax.tree.map(jnp.ones_like, boxed)
  trained = make().create(boxed).apply_gradient(grads)
  assert isinstance(trained.target["wi"], nn.LogicallyPartitioned)
  unboxed = make().create(nn.meta.unbox(boxed)).apply_gradient(nn.meta.unbox(grads))
  jax.tree.map(np.testing.assert_allclose, nn.meta.unbox(trained.target), unboxed.target)
  assert jax.tree.structure(nn.meta.unbox(trained.state)) == jax.tree.structure(unboxed.state)


@pytest.mark.slow
def test_frozen_dict_params_train():
  """Older T5X keeps FrozenDict params: a step runs Muon on them (seconds: Muon's first step)."""
  params, axes, _ = _scanned_t5()
  opt_def = optimizers.muon(**MUON_ARGS)
  opt_def.set_param_axes(flax.core.freeze(axes))
  optimizer = _wrapper_loop(opt_def, flax.core.freeze(params), steps=1)
  assert optimizer.target["decoder"]["layers"]["mlp"]["wo"]["kernel"].shape == (LAYERS, MLP, EMBED)


def test_set_param_axes_raises_for_unplaceable_params():
  opt_def = optimizers.muon(**MUON_ARGS)
  axes = {"a": P("x", "embed", "mlp"), "b": P("embed", "mlp")}
  with pytest.raises(UnplaceableParamsError, match=r"'a' with axes \('x', 'embed', 'mlp'\)"):
    opt_def.set_param_axes(axes)
  assert opt_def.param_specs is None


def test_an_override_that_places_no_param_warns():
  """An override with a typo, or one short of the whole path ('mlp/wi' for
  'layers_0/mlp/wi'), placed nothing and the param kept the rule's placement, silently."""
  rule = KernelAxesRule(
    overrides={".*logit": ("embed", "vocab"), "mlp/wi": "adam", "layers_0/mlp/wi": "adam"}
  )
  axes = {"layers_0": {"mlp": {"wi": P("embed", "mlp")}}, "logits": P("embed", "vocab")}
  with pytest.warns(UserWarning) as caught:
    optimizers.muon(**MUON_ARGS, kernel_axes_rule=rule, param_axes=axes)
  messages = [str(w.message) for w in caught]
  assert len(messages) == 2, messages
  assert messages[0].startswith("KernelAxesRule: the override '.*logit' matches no param"), messages
  assert "'mlp/wi' matches no param" in messages[1], messages
  assert messages[1].endswith("the params are layers_0/mlp/wi, logits."), messages


def test_rank_and_path_mismatches_name_the_param():
  opt_def = optimizers.muon(**MUON_ARGS, param_axes={"w": P("embed", "mlp")})
  with pytest.raises(ValueError, match=r"'w' has the logical axes \('embed', 'mlp'\).*\(2, 3, 4\)"):
    opt_def.create({"w": jnp.ones((2, 3, 4))})
  with pytest.raises(ValueError, match="'v' has no logical axes"):
    opt_def.dimension_numbers({"w": jnp.ones((2, 3)), "v": jnp.ones((2, 3))})


def test_an_empty_spec_is_a_param_without_axes():
  """P(), what nn.get_partition_spec writes for a param without axes, sends it to adam."""
  params = {"w": jnp.ones((4, 8)), "b": jnp.zeros(8), "s": jnp.zeros(())}
  axes = {"w": P("embed", "mlp"), "b": P(), "s": P()}
  opt_def = optimizers.muon(**MUON_ARGS, param_axes=axes)
  assert opt_def.describe_params(params) == [
    "b (None,): adam",
    "s (): adam",
    "w ('embed', 'mlp'): muon, inputs ('embed',), outputs ('mlp',)",
  ]


def test_axes_naming_no_axis_in_any_form_are_the_same_axes():
  """None, P(), P(None) and (None,) for a replicated param were other axes: refused after
  create, and with_param_axes gave each its own copy, whose states differed in structure."""
  params = {"w": jnp.ones((EMBED, MLP)), "b": jnp.ones(MLP)}
  forms = [None, P(), P(None), (None,), P(None, None)]
  opt_def = optimizers.muon(**MUON_ARGS, param_axes={"w": P("embed", "mlp"), "b": forms[0]})
  opt_def.create(params)
  for form in forms:
    opt_def.set_param_axes({"w": ("embed", "mlp"), "b": form})
  base = optimizers.muon(**MUON_ARGS)
  copies = {id(t5x_optim.with_param_axes(base, {"w": P("embed", "mlp"), "b": f})) for f in forms}
  assert len(copies) == 1
  assert id(t5x_optim.with_param_axes(base, {"w": P("embed", None), "b": None})) not in copies
  with pytest.raises(ValueError, match="other than those it had"):
    opt_def.set_param_axes({"w": P("embed", "mlp"), "b": P("mlp")})
  replicated = optimizers.muon(**MUON_ARGS, param_axes={"w": P(None), "b": P(None)})
  empty = optimizers.muon(**MUON_ARGS, param_axes={"w": P(), "b": P()})
  assert replicated.describe_params(params) == empty.describe_params(params)


def test_axes_in_a_tuple_or_lookahead_params_are_a_tree_of_specs():
  """A tuple of specs, or optax.LookaheadParams of spec trees, is a container of the params'
  axes, as a list is: each tuple was read as one spec, so the axes covered only '<root>' (or
  failed inside jax on a spec of dicts). Only a tuple of names (or None) is one spec."""
  kernels = (jnp.ones((VOCAB, EMBED)), jnp.ones((EMBED, MLP)))
  specs = [P("vocab", "embed"), P("embed", "mlp")]
  want = optimizers.muon(**MUON_ARGS, param_axes=specs).describe_params(list(kernels))
  assert want[1] == "1 ('embed', 'mlp'): muon, inputs ('embed',), outputs ('mlp',)"
  muon = optimizers.muon(**MUON_ARGS)
  assert t5x_optim.with_param_axes(muon, tuple(specs)).describe_params(kernels) == want
  axes = {"w": P("embed", "mlp"), "b": ("mlp",)}
  copies = optax.LookaheadParams(fast=axes, slow=axes)
  params = {"w": jnp.ones((EMBED, MLP)), "b": jnp.ones(MLP)}
  assert t5x_optim.with_param_axes(muon, copies).describe_params(
    optax.LookaheadParams.init_synced(params)
  ) == [
    f"{copy}/{line}"
    for copy in ("fast", "slow")
    for line in (
      "b ('mlp',): adam",
      "w ('embed', 'mlp'): muon, inputs ('embed',), outputs ('mlp',)",
    )
  ]


def test_hand_written_numbers_give_a_plain_wrapper():
  numbers = {"w": D(0, 1)}
  opt_def = optimizers.muon(**MUON_ARGS, muon_weight_dimension_numbers=numbers)
  assert type(opt_def) is optimizers.OptaxWrapper and not hasattr(opt_def, "set_param_axes")
  with pytest.raises(ValueError, match="given by hand"):
    optimizers.muon(**MUON_ARGS, muon_weight_dimension_numbers=numbers, param_axes={})


def test_positional_arguments_are_the_factorys():
  params, axes, _ = _scanned_t5()
  by_position = optimizers.muon(0.02, param_axes=axes)
  assert by_position.factory_kwargs == {"learning_rate": 0.02}
  with pytest.raises(TypeError, match=r"multiple values for \['learning_rate'\]"):
    optimizers.muon(0.02, learning_rate=0.01)


def test_custom_rule_and_override():
  params, axes, numbers = _scanned_t5()
  rule = KernelAxesRule(overrides={"decoder/logits_dense/kernel": ("embed", "vocab")})
  opt_def = optimizers.muon(**MUON_ARGS, kernel_axes_rule=rule, param_axes=axes)
  numbers["decoder"]["logits_dense"]["kernel"] = D((0,), (1,))
  assert opt_def.dimension_numbers(params) == numbers


def test_galore_batch_axes_stay_unprojected():
  params, axes, _ = _scanned_t5()
  opt_def = optimizers.galore(learning_rate=1e-2, rank=2, param_axes=axes)
  numbers = opt_def.dimension_numbers(params)
  assert numbers["decoder"]["layers"]["mlp"]["wo"]["kernel"] is None
  assert numbers["decoder"]["logits_dense"]["kernel"] is None
  opt_def = optimizers.galore(learning_rate=1e-2, rank=2, param_axes={"w": P("embed", "mlp")})
  assert opt_def.dimension_numbers({"w": jnp.ones((4, 8))}) == {
    "w": optax.contrib.GaLoreDimensionNumbers((0,), (1,))
  }


class ScannedAxesModel(nn.Module):
  """T5X style: param_with_axes, a params_axes collection, a leading 'layers' axis."""

  @nn.compact
  def __call__(self, x):
    def param(name, shape, axes):
      return flax_partitioning.param_with_axes(
        name, nn.initializers.lecun_normal(), shape, axes=axes
      )

    embedding = param("embedding", (VOCAB, EMBED), ("vocab", "embed"))
    wi = param("wi", (LAYERS, EMBED, MLP), ("layers", "embed", "mlp"))
    scale = flax_partitioning.param_with_axes(
      "scale", nn.initializers.ones, (EMBED,), axes=("embed",)
    )
    h = embedding[x] * scale
    return jnp.einsum("bse,lem->bsm", h, wi)


@pytest.mark.slow
def test_train_state_gives_the_axes():
  variables = ScannedAxesModel().init(jax.random.key(0), jnp.zeros((1, 3), jnp.int32))
  opt_def = optimizers.muon(**MUON_ARGS)
  state = TrainState.create(opt_def, variables)
  assert state.optimizer.optimizer_def.dimension_numbers(state.params) == {
    "embedding": None,
    "scale": None,
    "wi": D((1,), (2,)),
  }
  assert state.param_states.inner_states["muon"].inner_state[0].mu["wi"].shape == (
    LAYERS,
    EMBED,
    MLP,
  )
  with pytest.raises(ValueError, match="emits none"):
    TrainState.create(optimizers.muon(**MUON_ARGS), {"params": {"w": jnp.ones((2, 2))}})


def test_every_state_leaf_has_a_spec():
  params, axes, _ = _scanned_t5()
  opt_def = optimizers.KernelAxesOptaxWrapper(
    optax.contrib.muon, MUON_ARGS, param_axes=axes, fallback="raise"
  )
  logical = opt_def.derive_logical_axes(opt_def.create(params), axes).state.param_states
  muon_state = logical.inner_states["muon"].inner_state[0]
  adam_state = logical.inner_states["adam"].inner_state[0]
  layers = muon_state.mu["decoder"]["layers"]
  assert layers["self_attention"]["out"]["kernel"] == P("layers", "heads", "kv", "embed")
  assert layers["mlp"]["wi_0"]["kernel"] == P("layers", "embed", "mlp")
  assert isinstance(muon_state.mu["token_embedder"]["embedding"], optax.MaskedNode)
  assert muon_state.ns_coeffs in (None, P(), P(None))
  assert adam_state.nu["token_embedder"]["embedding"] == P("vocab", "embed")
  assert adam_state.mu["decoder"]["decoder_norm"]["scale"] == P("embed")


@pytest.mark.parametrize(("state_dtype", "tolerance"), [("bfloat16", 2e-2), ("8bit", 5e-2)])
@pytest.mark.slow
def test_low_precision_momentum(state_dtype, tolerance):
  params = {"w": jax.random.normal(jax.random.key(1), (4, 64, 64)), "b": jnp.zeros(64)}
  axes = {"w": P("layers", "embed", "mlp"), "b": P("mlp")}
  wrap = functools.partial(optimizers.low_precision, state_dtype=state_dtype, min_size=0)
  opt_def = optimizers.muon(**MUON_ARGS, param_axes=axes, wrap_transformation=wrap)
  optimizer = _wrapper_loop(opt_def, params)
  stored = optimizer.state.param_states.inner_state.inner_states["muon"].inner_state[0].mu["w"]
  if state_dtype == "bfloat16":
    assert stored.dtype == jnp.bfloat16
  else:
    assert stored.codes.dtype == jnp.uint8 and stored.codes.shape == (4, 64, 64)
  exact = _wrapper_loop(optimizers.muon(**MUON_ARGS, param_axes=axes), params).target
  for got, want, start in zip(
    jax.tree.leaves(optimizer.target), jax.tree.leaves(exact), jax.tree.leaves(params), strict=True
  ):
    moved = float(jnp.max(jnp.abs(want - start)))
    assert float(jnp.max(jnp.abs(got - want))) <= tolerance * moved


def _trained(opt_def, params, steps=3):
  return _wrapper_loop(opt_def, params, steps)


@pytest.mark.slow
def test_convert_adamw_to_muon_and_back():
  params, axes, _ = _scanned_t5()
  adamw = _trained(optimizers.adamw(1e-3, b1=0.9), params)
  muon, report = convert_state(
    adamw, optimizers.muon(**MUON_ARGS, param_axes=axes), target_hparams={"beta": 0.95}
  )
  assert int(muon.state.step) == 3
  adam_mu = adamw.state.param_states[0].mu
  muon_state = muon.state.param_states.inner_states["muon"].inner_state[0]
  kernel = ("decoder", "layers", "mlp", "wo", "kernel")
  pick = lambda tree: functools.reduce(lambda t, k: t[k], kernel, tree)  # noqa: E731
  # E[g] is the same on both sides: mu_adam / (1 - 0.9^3) == mu_muon / (1 - 0.95^3).
  np.testing.assert_allclose(
    pick(muon_state.mu) / (1 - 0.95**3), pick(adam_mu) / (1 - 0.9**3), rtol=1e-5
  )
  assert int(muon_state.count) == 3
  inner_adam = muon.state.param_states.inner_states["adam"].inner_state[0]
  np.testing.assert_allclose(
    inner_adam.nu["token_embedder"]["embedding"],
    adamw.state.param_states[0].nu["token_embedder"]["embedding"],
    rtol=1e-6,
  )
  assert any("MuonState" in line for line in report.converted)
  back, back_report = convert_state(
    muon, optimizers.adamw(1e-3), source_hparams={"beta": 0.95}, missing="init"
  )
  # Muon's kernels have no nu, so Adam starts their mu fresh too (a mu goes with its nu).
  np.testing.assert_array_equal(pick(back.state.param_states[0].mu), 0.0)
  embedding = ("token_embedder", "embedding")
  np.testing.assert_allclose(
    back.state.param_states[0].mu[embedding[0]][embedding[1]],
    adam_mu[embedding[0]][embedding[1]],
    rtol=1e-5,
  )
  assert back_report.initialised == (
    "0 (ScaleByAdamState).mu (carried only with nu): 4 params without a source value (e.g. "
    "decoder/layers/mlp/wi_0/kernel)",
    "0 (ScaleByAdamState).nu: 4 params without a source value (e.g. "
    "decoder/layers/mlp/wi_0/kernel)",
  )
  with pytest.raises(ValueError, match="nu"):
    convert_state(muon, optimizers.adamw(1e-3))


@pytest.mark.slow
def test_convert_state_gives_param_axes_to_a_definition_target():
  params = {"emb": jnp.ones((7, 5)), "wi": jnp.ones((2, 5, 7)), "scale": jnp.ones(5)}
  axes = {"emb": P("vocab", "embed"), "wi": P("layers", "embed", "mlp"), "scale": P("embed")}
  adamw = optimizers.adamw(1e-3).create(params)
  muon = optimizers.muon(learning_rate=0.02)
  multi = optimizers.MultiOptimizer([("^scale$", optimizers.adamw(1e-3)), ("^(emb|wi)$", muon)])
  for target, muon_state in [
    (muon, lambda state: state),
    (multi, lambda states: states[1].param_states),
  ]:
    new, _ = convert_state(adamw, target, missing="init", param_axes=axes)
    mu = muon_state(new.state.param_states).inner_states["muon"].inner_state[0].mu
    assert sorted(name for name, leaf in mu.items() if hasattr(leaf, "shape")) == ["wi"]
    assert muon.param_specs is None  # the caller's definition keeps its own axes


@pytest.mark.usefixtures("clean_gin")
def test_gin_file_configures_the_rule():
  gin.add_config_file_search_path(str(_config.GIN_DIR))
  gin.parse_config_file(str(_config.GIN_DIR / "optimizers" / "muon.gin"))
  gin.parse_config(
    [
      "TOTAL_STEPS = 10",
      "optimizers.KernelAxesRule.overrides = {'.*logits.*': ('embed', 'vocab')}",
    ]
  )
  opt_def = gin.query_parameter("%OPTIMIZER").scoped_configurable_fn()
  assert isinstance(opt_def, optimizers.KernelAxesOptaxWrapper)
  assert opt_def.rule.batch_axes == ("layers", "expert", "stack")
  params, axes, numbers = _scanned_t5()
  opt_def.set_param_axes(axes)
  numbers["decoder"]["logits_dense"]["kernel"] = D((0,), (1,))
  assert opt_def.dimension_numbers(params) == numbers


@pytest.mark.slow
@pytest.mark.usefixtures("clean_gin")
def test_cli_plan_and_train_with_muon_gin(tmp_path, capsys):
  from t5x_optim.cli import main  # noqa: PLC0415

  muon = ["--gin_file", "examples/tiny.gin", "--gin_file", "optimizers/muon.gin"]
  assert main(["plan", *muon]) == 0
  out = capsys.readouterr().out
  assert "update rule per param (12 params, from their logical axes):" in out
  assert "layers_0/mlp/wi ('embed', 'mlp'): muon, inputs ('embed',), outputs ('mlp',)" in out
  assert "token_embedding ('vocab', 'embed'): adam" in out
  assert "logits ('embed', 'vocab'): adam" in out
  assert main(["plan", *muon, "--format", "json"]) == 0
  routes = json.loads(capsys.readouterr().out)["param_routes"]
  assert sum(line.endswith("adam") for line in routes) == 6 and len(routes) == 12
  bindings = [
    "--gin_bindings",
    "TOTAL_STEPS = 20",
    "--gin_bindings",
    "cli.TrainJob.eval_every = 20",
  ]
  assert main(["train", *muon, *bindings, "--model_dir", str(tmp_path / "run")]) == 0
  out = capsys.readouterr().out
  first, last = re.search(r"loss ([\d.]+) -> ([\d.]+)", out).groups()
  assert float(last) < float(first)


@pytest.mark.usefixtures("clean_gin")
@pytest.mark.slow
def test_gin_wraps_the_transformation_in_low_precision(tmp_path):
  config = tmp_path / "muon_bf16.gin"
  config.write_text(
    "include 'optimizers/muon.gin'\n"
    "from __gin__ import dynamic_registration\n"
    "from t5x_optim import optimizers\n"
    "TOTAL_STEPS = 10\n"
    "optimizers.low_precision.state_dtype = 'bfloat16'\n"
    "optimizers.low_precision.min_size = 0\n"
    "optimizers.muon.wrap_transformation = @optimizers.low_precision\n"
  )
  gin.add_config_file_search_path(str(_config.GIN_DIR))
  gin.parse_config_file(str(config))
  opt_def = gin.query_parameter("%OPTIMIZER").scoped_configurable_fn()
  params, axes, _ = _scanned_t5()
  opt_def.set_param_axes(axes)
  optimizer = _wrapper_loop(opt_def, params, steps=2)
  muon_state = optimizer.state.param_states.inner_state.inner_states["muon"].inner_state[0]
  assert muon_state.mu["decoder"]["layers"]["mlp"]["wo"]["kernel"].dtype == jnp.bfloat16


@pytest.mark.slow
@pytest.mark.skipif(not t5x_at_hand(), reason="needs T5X_SRC and T5X's dependencies")
def test_t5x_partitioner_shards_muon_state_as_its_params():
  """data/t5x_muon/check_with_t5x.py: T5X's own networks, train state and partitioner."""
  output = run_t5x_check(pathlib.Path(__file__).parent / "data" / "t5x_muon" / "check_with_t5x.py")
  assert "OK   t5: Muon on 36 kernels (rank 2), Adam on 16 params" in output
  assert "OK   scalable_t5: Muon on 18 kernels (rank 3/4), Adam on 11 params" in output
