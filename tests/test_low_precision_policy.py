"""`low_precision(..., param_modes=...)`: each param's state in its own mode, chosen by path or
by logical axis."""

from __future__ import annotations

import functools
import re
import warnings

import flax
import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import test_gin_files
import test_sharded_training as st
from jax.sharding import PartitionSpec as P
from optimizer_table import assert_same_bits

from t5x_optim import (
  OptaxWrapper,
  TrainState,
  low_precision,
  low_precision_to_float32,
  optimizers,
  partitioning,
  restore_t5x_checkpoint,
  save_t5x_checkpoint,
)
from t5x_optim._low_precision.low_precision import leaf_storage
from t5x_optim._training import plan as plan_lib
from t5x_optim.checkpoints import Checkpointer
from t5x_optim.optimizers import OptaxStatePartitionRules
from t5x_optim.partitioning import abstract_train_state

RULES = (("embed", "float32"), ("mlp", "4bit"), ("bias$", "bfloat16"))
SHAPES = {"embed": (64, 256), "mlp": {"wi": (128, 256)}, "attn": (64, 256), "bias": (256,)}
MODES = {"embed": "float32", "mlp": "4bit", "attn": "8bit", "bias": "bfloat16"}


def _params(seed=0, shapes=SHAPES):
  rng = np.random.default_rng(seed)
  return jax.tree.map(
    lambda s: jnp.asarray(rng.normal(size=s), jnp.float32),
    shapes,
    is_leaf=lambda x: isinstance(x, tuple),
  )


def _assert_close(got, want, name: str) -> None:
  """Within float32 rounding; bfloat16 within 2**-6 of the leaf's largest magnitude."""
  if MODES[name] == "bfloat16":
    np.testing.assert_allclose(got, want, rtol=0, atol=2.0**-6 * float(np.max(np.abs(want))))
  else:
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)


def test_each_params_state_takes_the_first_matching_rules_mode_and_says_why():
  state = low_precision(optax.adam(1e-3), "8bit", min_size=0, param_modes=RULES).init(_params())
  storage = {"/".join(k[3:]): v for k, v in leaf_storage(state).items() if k[2:3] == ("mu",)}
  assert storage == {
    "attn/codes": "8bit codes",
    "attn/scales": "8bit scales",
    "bias": "bfloat16 (param_modes 'bias$')",
    "embed": "float32: param_modes 'embed'",
    "mlp/wi/codes": "4bit codes (param_modes 'mlp')",
    "mlp/wi/scales": "4bit scales (param_modes 'mlp')",
    "mlp/wi/cols": "4bit cols (param_modes 'mlp')",
  }
  assert state.inner_state[0].mu["embed"].dtype == jnp.float32


@pytest.mark.slow
def test_a_mixed_step_is_each_modes_own_step():
  """Three jitted steps: each param's update and decoded state are those of adam wrapped in
  its own mode alone (adam's update is elementwise per param); bfloat16 to within its
  rounding, whose random bits hash the leaf's index in the state, another one alone."""
  params = _params()
  mixed = low_precision(optax.adam(1e-2), "8bit", min_size=0, param_modes=RULES)
  state = mixed.init(params)
  alone = {
    name: (
      low_precision(optax.adam(1e-2), mode, min_size=0) if mode != "float32" else optax.adam(1e-2)
    )
    for name, mode in MODES.items()
  }
  alone_states = {name: tx.init({name: params[name]}) for name, tx in alone.items()}
  for step in range(3):
    grads = _params(seed=step + 1)
    updates, state = jax.jit(mixed.update)(grads, state, params)
    for name, tx in alone.items():
      want, alone_states[name] = jax.jit(tx.update)(
        {name: grads[name]}, alone_states[name], {name: params[name]}
      )
      jax.tree.map(
        lambda a, b, name=name: _assert_close(a, b, name),
        updates[name],
        want[name],
      )
  decoded = low_precision_to_float32(state)[0]
  for name, tx in alone.items():
    own = alone_states[name]
    own = own[0] if MODES[name] == "float32" else low_precision_to_float32(own)[0]
    for field in ("mu", "nu"):
      jax.tree.map(
        lambda a, b, name=name: _assert_close(a, b, name),
        getattr(decoded, field)[name],
        getattr(own, field)[name],
      )


@pytest.mark.parametrize(
  "param_modes, match",
  [
    ((("embed", "int8"),), "param_modes maps 'embed' to 'int8'"),
    ((("(", "4bit"),), "missing \\)"),
    ((("axis:(", "4bit"),), "missing \\)"),
    ((("axis:", "4bit"),), "'axis:' names no logical axis"),
    (("embed", "float32"), r"param_modes takes \(pattern, mode\) pairs, got 'embed' at 0"),
    ([("wi", "8bit", "x")], r"got \('wi', '8bit', 'x'\) at 0 \(e.g. \[\('embed', 'float32'\)\]\)"),
    ("embed", r"param_modes takes \(pattern, mode\) pairs, got 'embed' at 0"),
  ],
)
def test_bad_param_modes_are_refused(param_modes, match):
  with pytest.raises(Exception, match=match):
    low_precision(optax.adam(1e-3), "8bit", param_modes=param_modes)


@pytest.mark.parametrize(
  "once", [iter, lambda pairs: (pair for pair in pairs)], ids=["iterator", "generator"]
)
@pytest.mark.parametrize("pattern", ["token_embedding", "axis:vocab"])
def test_param_modes_read_once_decide_as_a_list_does(once, pattern):
  """The pairs were checked by iterating them, so rules given as a zip or a generator came
  out empty: the embedding meant to stay float32 was stored in 8 bits without a word."""
  params = {"token_embedding": jnp.ones((256, 64)), "mlp": {"wi": jnp.ones((64, 256))}}
  axes = {"token_embedding": P("vocab", "embed"), "mlp": {"wi": P("embed", "mlp")}}
  pairs = [(pattern, "float32"), ("mlp", "bfloat16")]

  def storage(param_modes):
    tx = low_precision(
      optax.adam(1e-3), "8bit", min_size=0, param_modes=param_modes, param_axes=axes
    )
    return tx.init(params).storage

  assert storage(once(pairs)) == storage(pairs)
  assert storage(pairs)[1:3] == ("bfloat16", f"float32: param_modes {pattern!r}")


@pytest.mark.parametrize("mode", ["8bit", "4bit", "bfloat16"])
@pytest.mark.parametrize("pattern", ["c", "axis:embed"])
def test_a_pattern_giving_a_mode_to_a_complex_param_is_refused(mode, pattern):
  """As ``states=`` refuses a leaf it selects that no mode applies to: the complex param's
  state was kept without a word though the pattern named it."""
  params = {"c": jnp.ones((64, 256), jnp.complex64), "w": jnp.ones((64, 256))}
  axes = {"c": P("embed", "mlp"), "w": P("embed", "mlp")}
  tx = low_precision(optax.adam(1e-3), "8bit", param_modes=[(pattern, mode)], param_axes=axes)
  with pytest.raises(
    ValueError,
    match=re.escape(f"pattern '{pattern}' gives '{mode}' to the param 'c', whose state leaf ")
    + r"'0/mu/c' \(shape \(64, 256\), dtype complex64\) it does not apply to: .*its dtype "
    r"complex64 is not floating",
  ):
    tx.init(params)


def test_a_pattern_keeping_a_complex_param_in_float32_is_taken():
  params = {"c": jnp.ones((64, 256), jnp.complex64), "w": jnp.ones((64, 256))}
  state = low_precision(optax.adam(1e-3), "8bit", param_modes=[(".", "float32")]).init(params)
  assert leaf_storage(state)[("inner_state", "0", "mu", "c")] == "kept: not floating"


@pytest.mark.parametrize("mode", ["8bit", "4bit", "bfloat16"])
def test_a_0d_params_state_is_labelled_0d_where_min_size_would_compress_it(mode):
  """A 0-d param's state was labelled "below min_size" even with ``min_size=0``, also where
  ``states=`` selected it: it is labelled 0-d, in its own dtype; a ``states=`` pattern that
  also selects it compresses the others (a scalar param beside them is common)."""
  params = {"temp": jnp.ones((), jnp.bfloat16), "w": jnp.ones((64, 256))}
  for states in (None, "temp|w"):
    state = low_precision(optax.adam(1e-3), mode, min_size=0, states=states).init(params)
    storage = leaf_storage(state)
    assert storage[("inner_state", "0", "mu", "temp")] == "bfloat16: 0-d"
    kinds = [kind for path, kind in storage.items() if path[:4] == ("inner_state", "0", "mu", "w")]
    assert kinds and all(kind.startswith(mode) for kind in kinds), storage
  state = low_precision(optax.adam(1e-3), mode).init(params)
  assert leaf_storage(state)[("inner_state", "0", "mu", "temp")] == "bfloat16: below min_size"


@pytest.mark.parametrize(
  ("states", "min_size", "reason"),
  [("small", 256, "below min_size"), ("temp", 0, "0-d"), ("small|temp", 256, "below min_size")],
)
def test_a_states_pattern_selecting_only_leaves_kept_for_their_size_warns(states, min_size, reason):
  """``states=`` selecting only leaves that min_size keeps (or 0-d ones) compressed nothing
  and said nothing; a pattern that also selects a leaf it compresses says nothing."""
  params = {"big": jnp.ones((64, 64)), "small": jnp.ones((4, 4)), "temp": jnp.ones(())}
  tx = low_precision(optax.adam(1e-3), "8bit", min_size=min_size, states=states)
  with pytest.warns(UserWarning, match=r"selects only state leaves kept as they are: " + reason):
    tx.init(params)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    low_precision(optax.adam(1e-3), "8bit", min_size=min_size, states=f"big|{states}").init(params)


def test_a_pattern_over_a_real_param_with_a_bool_state_leaf_is_taken():
  """zero_nans keeps a bool per param: the mode compresses the param's floating leaves and
  keeps the bool, for the param is real; only a param that is not real is refused."""
  params = {"w": jnp.ones((64, 64)), "scale": jnp.ones(())}
  inner = optax.chain(optax.zero_nans(), optax.adam(1e-3))
  tx = low_precision(inner, "8bit", param_modes=((".*", "4bit"),))
  storage = leaf_storage(tx.init(params))
  assert storage[("inner_state", "0", "found_nan", "scale")] == "kept: not floating"
  assert storage[("inner_state", "1", "0", "mu", "w", "codes")].startswith("4bit codes")


@pytest.mark.parametrize(
  "param_modes, min_size, warned",
  [
    ((("embeddng", "float32"),), 4096, "'embeddng' selects no param"),
    (
      (("mlp|bias", "4bit"), ("bias$", "bfloat16")),
      4096,
      "'bias$' selects only params an earlier pattern takes (bias),",
    ),
    (
      (("bias$", "bfloat16"),),
      4096,
      "'bias$' selects only params that min_size=4096 keeps as they are before param_modes (bias),",
    ),
    (
      (("embed", "float32"), ("embed|bias", "4bit")),
      4096,
      "'embed|bias' selects only params an earlier pattern takes (embed) or params that "
      "min_size=4096 keeps as they are before param_modes (bias),",
    ),
    ((("scale", "8bit"),), 0, "'scale' selects only 0-d params (scale), which keep their state,"),
    ((("scale", "8bit"),), 1, "'scale' selects only 0-d params (scale), which keep their state,"),
    (
      (("bias|scale", "8bit"),),
      4096,
      "'bias|scale' selects only params that min_size=4096 keeps as they are before "
      "param_modes (bias) or 0-d params (scale), which keep their state,",
    ),
  ],
)
def test_a_pattern_that_sets_no_params_mode_warns(param_modes, min_size, warned):
  """A mistyped pattern, one after a pattern that takes all it selects, or one whose params
  are all below min_size or 0-d changed nothing without a word: the embedding's state stayed
  in 8 bits, the bias's in float32. A pattern of 0-d params only blamed min_size, even one
  (0 or 1) that keeps none."""
  params = _params(shapes={**SHAPES, "scale": ()})
  tx = low_precision(optax.adam(1e-3), "8bit", min_size=min_size, param_modes=param_modes)
  with pytest.warns(UserWarning, match=re.escape(warned) + ".*the params are attn, bias, embed"):
    tx.init(params)


def test_patterns_that_each_set_some_params_mode_do_not_warn(recwarn):
  """Rules that each decide a param, the bias's too where min_size keeps none."""
  low_precision(optax.adam(1e-3), "8bit", min_size=0, param_modes=RULES).init(_params())
  assert not [w for w in recwarn if "param_modes" in str(w.message)]


@pytest.mark.parametrize(
  "mode, options, warned",
  [
    ("bfloat16", dict(block_size=64), "block_size=64 is unused"),
    ("8bit", dict(stochastic_rounding=False), "stochastic_rounding=False is unused"),
    ("4bit", dict(stochastic_rounding=False), "stochastic_rounding=False is unused"),
    ("4bit", dict(stochastic_rounding=True), None),
    (
      "8bit",
      dict(block_size=64, param_modes=(("embed", "float32"), ("mlp", "bfloat16"))),
      None,
    ),
    ("8bit", dict(stochastic_rounding=False, param_modes=(("mlp", "bfloat16"),)), None),
    ("bfloat16", dict(block_size=64, param_modes=(("mlp", "4bit"),)), None),
    (
      "bfloat16",
      dict(block_size=64, param_modes=(("mlp", "float32"),)),
      "block_size=64 is unused",
    ),
    ("8bit", dict(block_size=None), None),
  ],
)
def test_a_setting_no_mode_in_use_reads_warns(mode, options, warned):
  """block_size sizes 8-bit and 4-bit blocks and stochastic_rounding rounds bfloat16 leaves:
  given where neither ``state_dtype`` nor a ``param_modes`` mode is one they apply to, they
  changed nothing without a word (adamw_bf16_sr.gin with a block_size). A stochastic_rounding
  of True, the default, is not told of: an 8-bit run's config.gin records it."""
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    low_precision(optax.adam(1e-3), mode, **options)
  messages = [str(w.message) for w in caught if w.category is UserWarning]
  if warned is None:
    assert messages == []
  else:
    assert len(messages) == 1 and warned in messages[0], messages
    assert f"the modes in use are {mode}" in messages[0]


@pytest.mark.parametrize(
  "param_modes, expected",
  [
    (
      (("wo", "float32"), ("bi", "8bit")),
      {
        "wi": {"4bit codes", "4bit scales", "4bit cols"},
        "bi": {"8bit codes (param_modes 'bi')", "8bit scales (param_modes 'bi')"},
        "wo": {"float32: param_modes 'wo'"},
      },
    ),
    (
      (("wo", "bfloat16"), ("axis:embed", "float32")),
      {
        "wi": {"float32: param_modes 'axis:embed'"},
        "bi": {"4bit codes", "4bit scales"},
        "wo": {"bfloat16 (param_modes 'wo')"},
      },
    ),
  ],
  ids=["by_path", "by_axis"],
)
def test_plan_shows_each_params_mode_and_the_rule_that_chose_it(param_modes, expected):
  """T5X-style params_axes (param_with_axes), through abstract_train_state on a 2x4 mesh."""
  tx = low_precision(
    optax.adamw(1e-2),
    "4bit",
    block_size=4,
    shard_multiple=4,
    min_size=0,
    param_modes=param_modes,
  )
  partitioner = st._partitioner(2, 4, zero=True)
  state = abstract_train_state(partitioner, OptaxWrapper(tx), st.AxesMLP().init, *st._init_args())
  plan = plan_lib.build_plan(state, logical=state.as_logical_axes())
  by_param = {}
  for row in plan.rows:
    if row.param and row.group == "inner_state/0/nu":
      by_param.setdefault(row.param, set()).add(row.storage)
  assert by_param == expected
  for storages in expected.values():
    for storage in storages:
      assert storage in plan_lib.format_table(plan)


def _shipped_4bit_with(param_modes: str):
  """The optimizer of adamw_4bit.gin, every leaf eligible, with a param_modes binding."""
  test_gin_files._parse_alone(test_gin_files.GIN_DIR / "optimizers" / "adamw_4bit.gin")
  gin.parse_config(
    f"optimizers.low_precision.min_size = 0\noptimizers.low_precision.param_modes = {param_modes}"
  )
  return test_gin_files._build("OPTIMIZER")


@pytest.mark.slow
def test_gin_binds_a_policy_onto_the_shipped_4bit_file(clean_gin):
  """adamw_4bit.gin with a param_modes binding: the rule reaches each param's state."""
  opt_def = _shipped_4bit_with("[('embed', 'float32'), ('attn', '8bit')]")
  step = jax.jit(lambda optimizer, grads: optimizer.apply_gradient(grads))
  optimizer = step(opt_def.create(_params()), _params(seed=1))
  storage = leaf_storage(optimizer.state.param_states)
  nu = {"/".join(k[k.index("nu") + 1 :]): v for k, v in storage.items() if "nu" in k}
  assert nu["embed"] == "float32: param_modes 'embed'"
  assert nu["attn/codes"] == "8bit codes (param_modes 'attn')"
  assert nu["mlp/wi/codes"] == "4bit codes"


# Rules by logical axis: ``axis:<regex>`` selects the params with an axis of that name.

AXES = {
  "token_embedding": P("vocab", "embed"),
  "logits": P("embed", "vocab"),
  "mlp": {"wi": P("embed", "mlp"), "wo": P("mlp", "embed")},
  "scale": P("embed"),
}
AXIS_SHAPES = {
  "token_embedding": (48, 32),
  "logits": (32, 48),
  "mlp": {"wi": (32, 64), "wo": (64, 32)},
  "scale": (32,),
}
VOCAB = (("axis:vocab", "float32"),)
VOCAB_FLOAT32 = {
  "token_embedding": {"float32: param_modes 'axis:vocab'"},
  "logits": {"float32: param_modes 'axis:vocab'"},
  "wi": {"4bit"},
  "wo": {"4bit"},
}
"""`_modes` of an adam state in 4 bits with the `VOCAB` rule."""


def _boxed(params):
  """The params boxed with their `AXES`, as `nn.with_logical_partitioning` leaves them."""
  return jax.tree.map(
    lambda spec, x: nn.LogicallyPartitioned(x, tuple(spec)),
    AXES,
    params,
    is_leaf=lambda x: isinstance(x, P),
  )


def _modes(param_states, names=("token_embedding", "logits", "wi", "wo")) -> dict[str, set[str]]:
  """Each param's storage over all its state leaves, a quantized leaf's field left out."""
  out: dict[str, set[str]] = {}
  for key, storage in leaf_storage(param_states).items():
    name = next((n for n in names if n in key), None)
    if name is not None:
      out.setdefault(name, set()).add(re.sub(r" (codes|scales|cols)\b", "", storage))
  return out


def _vocab_tx(**kwargs):
  """adamw in 4 bits, the `VOCAB` rule keeping the params with a vocab axis in float32."""
  return low_precision(optax.adamw(1e-2), "4bit", min_size=0, param_modes=VOCAB, **kwargs)


@pytest.mark.slow
def test_the_axes_rebuild_keeps_every_other_setting():
  """set_param_axes's rebuild (`with_param_axes`) equals the transformation given the same
  axes up front, settings that are not defaults included: block, shard multiple, seed."""
  settings = dict(block_size=8, shard_multiple=2, seed=3, stochastic_rounding=False)
  params = _params(shapes=AXIS_SHAPES)
  rebuilt = _vocab_tx(**settings).with_param_axes(AXES).init(params)
  given = _vocab_tx(**settings, param_axes=AXES).init(params)
  assert (rebuilt.storage, rebuilt.seed, rebuilt.stochastic_rounding) == (
    given.storage,
    given.seed,
    given.stochastic_rounding,
  )
  assert rebuilt.seed == 3 and not rebuilt.stochastic_rounding
  assert rebuilt.inner_state[0].mu["mlp"]["wi"].scales.shape == (32, 8)
  assert_same_bits(rebuilt, given)


@pytest.mark.slow
def test_an_axis_rule_keeps_every_vocab_param_in_float32_and_says_why():
  """A ('vocab', 'embed') embedding and an ('embed', 'vocab') logits kernel, given by
  param_axes=; the ('embed', 'mlp') kernels take state_dtype."""
  state = _vocab_tx(param_axes=AXES).init(_params(shapes=AXIS_SHAPES))
  assert _modes(state) == VOCAB_FLOAT32
  assert state.inner_state[0].mu["logits"].dtype == jnp.float32
  assert state.inner_state[0].nu["token_embedding"].dtype == jnp.float32


@pytest.mark.parametrize(
  "rules, logits",
  [
    ((("logits", "8bit"), ("axis:vocab", "float32")), "8bit (param_modes 'logits')"),
    ((("axis:vocab", "float32"), ("logits|wo", "8bit")), "float32: param_modes 'axis:vocab'"),
  ],
)
def test_path_and_axis_rules_take_the_first_match_in_order(rules, logits):
  rules = (*rules, ("axis:heads|mlp", "bfloat16"))
  state = low_precision(
    optax.adam(1e-3), "4bit", min_size=0, param_modes=rules, param_axes=AXES
  ).init(_params(shapes=AXIS_SHAPES))
  assert _modes(state, names=("token_embedding", "logits", "wi", "scale")) == {
    "token_embedding": {"float32: param_modes 'axis:vocab'"},
    "logits": {logits},
    "wi": {"bfloat16 (param_modes 'axis:heads|mlp')"},
    "scale": {"4bit"},
  }


def _muon_with_vocab_rule():
  wrap = functools.partial(low_precision, state_dtype="4bit", min_size=0, param_modes=VOCAB)
  return optimizers.muon(learning_rate=0.02, wrap_transformation=wrap)


@pytest.mark.parametrize(
  "make",
  [
    lambda: OptaxWrapper(_vocab_tx()),
    lambda: optimizers.chain([optax.clip_by_global_norm(1.0), _vocab_tx()]),
    lambda: optimizers.MultiOptimizer([(".*", optimizers.chain([_vocab_tx()]))]),
    _muon_with_vocab_rule,
  ],
  ids=["OptaxWrapper", "chain", "MultiOptimizer", "muon"],
)
def test_set_param_axes_gives_the_axes_to_the_rule(make):
  """T5X's hook on the optimizer definition (here with a FrozenDict, as T5X passes it)."""
  opt_def = make()
  opt_def.set_param_axes(flax.core.freeze(AXES))
  modes = _modes(opt_def.create(_params(shapes=AXIS_SHAPES)).state.param_states)
  assert modes == VOCAB_FLOAT32


@pytest.mark.parametrize(
  "make",
  [lambda: OptaxWrapper(_vocab_tx()), _muon_with_vocab_rule],
  ids=["OptaxWrapper", "muon"],
)
def test_set_param_axes_after_create_refuses_other_axes(make):
  """The definition's transformation was built again under an optimizer created with it: a
  step jitted before kept the modes the axes no longer gave."""
  opt_def = make()
  opt_def.set_param_axes(AXES)
  tx = opt_def.optax_optimizer
  opt_def.create(_params(shapes=AXIS_SHAPES))
  opt_def.set_param_axes(flax.core.freeze(AXES))
  assert opt_def.optax_optimizer is tx
  swapped = {**AXES, "logits": P("embed", "mlp")}
  with pytest.raises(ValueError, match=r"created an optimizer.*with_param_axes"):
    opt_def.set_param_axes(swapped)
  assert opt_def.optax_optimizer is tx


@pytest.mark.slow
def test_a_flax_models_axes_reach_the_rule_through_the_train_state():
  """`TrainState.create` and `partitioning.init_sharded` of a model whose params are boxed."""
  variables = {"params": _boxed(_params(shapes=AXIS_SHAPES))}
  state = TrainState.create(optimizers.chain([_vocab_tx()]), variables)
  assert _modes(state.param_states) == VOCAB_FLOAT32
  partitioner = partitioning.Partitioner(partitioning.create_mesh(devices=jax.devices()[:1]))
  state = partitioning.init_sharded(partitioner, optimizers.chain([_vocab_tx()]), lambda: variables)
  assert _modes(state.param_states) == VOCAB_FLOAT32


def test_gin_binds_an_axis_rule_onto_the_shipped_4bit_file(clean_gin):
  opt_def = _shipped_4bit_with("[('axis:vocab', 'float32')]")
  state = TrainState.create(opt_def, {"params": _boxed(_params(shapes=AXIS_SHAPES))})
  assert _modes(state.param_states) == VOCAB_FLOAT32


MIXED = (("scale", "float32"), ("axis:vocab", "float32"), ("axis:mlp|heads", "8bit"))


@pytest.mark.parametrize(
  "create",
  [
    lambda tx, params: tx.init(params),
    lambda tx, params: OptaxWrapper(tx).create(params),
    lambda tx, params: optimizers.chain([tx]).create(params),
    # optax's own chain returns a plain transformation: the rule cannot get the axes.
    lambda tx, params: OptaxWrapper(optax.chain(tx)).create(params),
  ],
  ids=["init", "OptaxWrapper", "chain", "optax.chain"],
)
def test_axis_rules_without_axes_are_one_error_naming_them(create):
  tx = low_precision(optax.adam(1e-3), "4bit", param_modes=MIXED)
  with pytest.raises(ValueError, match=r"'axis:vocab', 'axis:mlp\|heads'.*logical axes"):
    create(tx, _params(shapes=AXIS_SHAPES))


def test_a_train_state_without_axes_is_refused():
  with pytest.raises(ValueError, match="the model emits none"):
    TrainState.create(optimizers.chain([_vocab_tx()]), {"params": _params(shapes=AXIS_SHAPES)})


def test_an_empty_spec_is_a_param_without_axes():
  """P(), what nn.get_partition_spec writes for a param without axes, names no axis."""
  state = _vocab_tx(param_axes={**AXES, "scale": P()}).init(_params(shapes=AXIS_SHAPES))
  assert _modes(state) == VOCAB_FLOAT32


@pytest.mark.parametrize(
  "axes, match",
  [
    ({"token_embedding": P("vocab", "embed")}, r"'logits', 'mlp/wi', 'mlp/wo', 'scale' have no"),
    ({**AXES, "logits": P("vocab")}, r"'logits' has the logical axes \('vocab',\)"),
  ],
)
def test_axes_that_do_not_fit_the_params_name_the_param(axes, match):
  with pytest.raises(ValueError, match=match):
    _vocab_tx(param_axes=axes).init(_params(shapes=AXIS_SHAPES))


@functools.cache
def _trained_vocab_optimizer():
  opt_def = OptaxWrapper(_vocab_tx())
  opt_def.set_param_axes(AXES)
  params = _params(shapes=AXIS_SHAPES)
  return params, opt_def, opt_def.create(params).apply_gradient(_params(1, AXIS_SHAPES))


@pytest.mark.slow
def test_state_dict_of_an_axis_policy_restores_bit_for_bit():
  params, opt_def, optimizer = _trained_vocab_optimizer()
  nu = optimizer.state_dict()["state"]["param_states"]["inner_state"]["0"]["nu"]
  assert nu["logits"].dtype == np.float32 and nu["token_embedding"].shape == (48, 32)
  assert sorted(nu["mlp"]["wi"]) == ["codes", "cols", "scales"]
  assert_same_bits(
    opt_def.create(params).restore_state(optimizer.state_dict()).state, optimizer.state
  )


@pytest.mark.slow
def test_checkpoints_of_an_axis_policy_round_trip_bit_for_bit(tmp_path):
  """T5X's checkpoint of the optimizer, and ours of a train state built from a boxed model."""
  params, opt_def, optimizer = _trained_vocab_optimizer()
  save_t5x_checkpoint(tmp_path / "t5x", optimizer)
  restored = restore_t5x_checkpoint(tmp_path / "t5x", opt_def.create(params))
  assert_same_bits(restored.state, optimizer.state)
  variables = {"params": _boxed(params)}
  state = TrainState.create(optimizers.chain([_vocab_tx()]), variables)
  state = state.apply_gradient(_params(1, AXIS_SHAPES))
  with Checkpointer(tmp_path / "ours") as ckpt:
    ckpt.save(1, state)
  with Checkpointer(tmp_path / "ours") as ckpt:
    restored = ckpt.restore(TrainState.create(optimizers.chain([_vocab_tx()]), variables))
  assert _modes(restored.param_states) == VOCAB_FLOAT32
  assert_same_bits((restored.params, restored.param_states), (state.params, state.param_states))


@pytest.mark.slow
@pytest.mark.usefixtures("clean_gin")
def test_the_train_banner_names_each_choice_and_its_rule():
  """`t5x-optim train`'s description of its job, with adamw_4bit.gin and an axis rule: one
  line says which params each choice holds (the vocab params named)."""
  from t5x_optim.cli.loop import config as _config  # noqa: PLC0415
  from t5x_optim.cli.loop import train as _train  # noqa: PLC0415

  _config.parse_config(
    gin_files=["examples/tiny.gin", "optimizers/adamw_4bit.gin"],
    gin_bindings=[
      "optimizers.low_precision.param_modes = [('axis:vocab', 'float32')]",
      "optimizers.low_precision.min_size = 0",
    ],
    macros=_config.device_macros(8),
  )
  about = _train.describe_setup(_train.prepare(_config.build_job()), devices="", optimizer="")
  assert about[-1] == (
    "state precision: 4bit for 10 params; "
    "float32: param_modes 'axis:vocab' for 2 params: logits, token_embedding"
  )


def test_deriving_the_state_specs_adds_no_warning_about_stand_in_params():
  """The spec derivation traces init on one stand-in param per shape: init's own warnings
  there named the stand-ins (' t5x_optim_probe_0000000') after the real params' warning."""
  params = {f"w{i}": jnp.ones((64, 64)) for i in range(3)}
  axes = {name: P("embed", "mlp") for name in params}
  tx = low_precision(optax.adam(1e-3), "8bit", param_modes=[("no_such_param", "float32")])
  state = jax.eval_shape(tx.init, params)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    OptaxStatePartitionRules.derive_optax_logical_axes(
      state, axes, transformation=tx, params=params
    )
  assert [str(w.message) for w in caught if "probe" in str(w.message)] == []
