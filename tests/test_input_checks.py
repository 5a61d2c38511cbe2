"""Bad input is refused where it enters, with the path and both sides, and changes nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util
from jax.sharding import PartitionSpec as P

import t5x_optim
from t5x_optim import KernelAxesRule, MultiOptimizer, OptaxWrapper, low_precision, optimizers

PARAMS = {"dense": {"kernel": jnp.ones((3, 4)), "bias": jnp.zeros(4)}}


@pytest.fixture(scope="module")
def opt():
  return OptaxWrapper(optax.adam(0.1)).create(PARAMS)


@pytest.fixture(scope="module")
def jitted_apply():
  return jax.jit(lambda o, g: o.apply_gradient(g))


def _grads(kernel: Any) -> dict[str, Any]:
  return {"dense": {"kernel": kernel, "bias": jnp.zeros(4)}}


@pytest.mark.parametrize(
  "kernel, message",
  [
    (jnp.ones((2, 3, 4)), r"'dense/kernel': grads real \(2, 3, 4\), params real \(3, 4\)"),
    (jnp.ones(4), r"'dense/kernel': grads real \(4,\), params real \(3, 4\)"),
    (jnp.ones((1, 4)), r"'dense/kernel': grads real \(1, 4\), params real \(3, 4\)"),
    (jnp.float32(1.0), r"'dense/kernel': grads real \(\), params real \(3, 4\)"),
    (jnp.ones((4, 3)), r"'dense/kernel': grads real \(4, 3\), params real \(3, 4\)"),
    (jnp.ones((3, 4), jnp.complex64), r"'dense/kernel': grads complex \(3, 4\), params real"),
  ],
  ids=["broadcast_up", "row", "one_row", "scalar", "transposed", "complex"],
)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_grads_of_wrong_shape_or_kind_are_refused(opt, jitted_apply, kernel, message, jit):
  apply = jitted_apply if jit else (lambda o, g: o.apply_gradient(g))
  with pytest.raises(ValueError, match=message):
    apply(opt, _grads(kernel))


def test_grads_of_wrong_structure_name_the_paths(opt):
  with pytest.raises(ValueError, match=r"paths only in the grads: \['dense/extra'\]"):
    opt.apply_gradient({"dense": {**PARAMS["dense"], "extra": jnp.ones(2)}})


def test_params_axes_of_another_structure_name_the_paths(opt):
  """Only the two tree definitions were shown, where the grads' check names the paths."""
  axes = {"dense": {"kernel": P("embed", "mlp"), "scale": P("mlp")}}
  with pytest.raises(
    ValueError,
    match=r"paths only in params_axes: \['dense/scale'\]; paths only in the params: "
    r"\['dense/bias'\]",
  ):
    opt.optimizer_def.derive_logical_axes(opt, axes)


@pytest.mark.parametrize(
  "grads, message",
  [
    ({"dense": PARAMS["dense"]}, r"at 'extra': the grads have nothing, the params an empty dict"),
    (
      [jnp.ones(2), jnp.ones(3)],
      r"at the root: the grads have a list of 2, the params a tuple of 2",
    ),
    (
      {"dense": PARAMS["dense"], "extra": [None]},
      r"at 'extra': the grads have a list of 1, the params an empty dict",
    ),
  ],
)
def test_grads_whose_leaves_agree_but_not_their_containers_name_where(grads, message):
  params = (jnp.zeros(2), jnp.zeros(3)) if isinstance(grads, list) else {**PARAMS, "extra": {}}
  with pytest.raises(ValueError, match=message):
    OptaxWrapper(optax.sgd(0.1)).create(params).apply_gradient(grads)


def test_a_node_that_differs_in_its_metadata_shows_both_trees():
  params = {"p": nn.Partitioned(jnp.ones(2), names=("x",))}
  grads = {"p": nn.Partitioned(jnp.ones(2), names=("y",))}
  with pytest.raises(
    ValueError,
    match=r"at 'p': the grads have a Partitioned .*'y'.*, the params a Partitioned .*'x'",
  ):
    OptaxWrapper(optax.sgd(0.1)).create(params).apply_gradient(grads)


@pytest.mark.parametrize("hyper_params", [{"learning_rate": 0.1}, 0.1, None])
def test_hyper_params_of_another_type_are_refused_naming_the_type(opt, hyper_params):
  with pytest.raises(TypeError, match=r"hyper_params= is an OptaxHyperParams \(.*\), not "):
    opt.apply_gradient(PARAMS, hyper_params=hyper_params)


@pytest.mark.parametrize("hyper_params", [optimizers.OptaxHyperParams(), {"learning_rate": 0.3}])
def test_multi_optimizer_hyper_params_are_one_per_sub_optimizer(hyper_params):
  multi = MultiOptimizer([("dense", OptaxWrapper(optax.sgd(0.1)))]).create(PARAMS)
  with pytest.raises(TypeError, match=r"hyper_params= is a list or tuple with one entry per "):
    multi.apply_gradient(PARAMS, hyper_params=hyper_params)
  with pytest.raises(TypeError, match=r"hyper_params= is an OptaxHyperParams"):
    multi.apply_gradient(PARAMS, hyper_params=[{"learning_rate": 0.3}])


@pytest.mark.parametrize("kwargs", [{"lr": 0.1}, {"learning_rte": 0.1}, {"valu": 1.0}])
def test_unknown_keywords_list_what_is_accepted(opt, kwargs):
  with pytest.raises(
    TypeError,
    match=r"unknown keyword arguments \['\w+'\]; it accepts the hyper-parameters "
    r"\['hyper_params', 'learning_rate'\] and the update's extra arguments "
    r"\['grad', 'obj_fn', 'value', 'value_fn'\]",
  ):
    opt.apply_gradient(PARAMS, **kwargs)


def test_extra_args_can_be_named_for_custom_transformations():
  def update(updates, state, params=None, *, scale=1.0, **extra_args):
    del params, extra_args
    return jax.tree.map(lambda u: -scale * u, updates), state

  tx = optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)
  opt = OptaxWrapper(tx, extra_args=["scale"]).create(PARAMS)
  stepped = opt.apply_gradient(jax.tree.map(jnp.ones_like, PARAMS), scale=0.5)
  np.testing.assert_array_equal(stepped.target["dense"]["bias"], -0.5 * np.ones(4))
  # One name as a string was its letters: s, c, a, l, e.
  with pytest.raises(TypeError, match=r"extra_args takes a collection of names, got 'scale'"):
    OptaxWrapper(tx, extra_args="scale")


@pytest.mark.parametrize(
  "learning_rate, message",
  [
    ("0.1", "a str"),
    ([0.1], "a list"),
    (True, "a bool"),
    (1 + 2j, "a complex"),
    (np.ones(1), r"an array of shape \(1,\)"),
    (jnp.asarray(1 + 2j), "a scalar of dtype complex64"),
  ],
  ids=["str", "list", "bool", "complex", "shaped", "complex_array"],
)
def test_learning_rate_override_must_be_a_real_scalar(learning_rate, message):
  opt = OptaxWrapper(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)).create(PARAMS)
  with pytest.raises(TypeError, match=rf"learning_rate= must be a real scalar.*got {message}"):
    opt.apply_gradient(PARAMS, learning_rate=learning_rate)


@pytest.mark.parametrize("learning_rate", [0.5, 1, np.float32(0.5), jnp.asarray(0.5)])
def test_learning_rate_override_accepts_real_scalars(learning_rate):
  opt = OptaxWrapper(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)).create(PARAMS)
  stepped = opt.apply_gradient(PARAMS, learning_rate=learning_rate)
  assert stepped.state.param_states.hyperparams["learning_rate"].shape == ()


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_fractional_learning_rate_is_refused_where_an_integer_one_was_injected(jit):
  """gin's ``learning_rate = 1`` injects an int32 rate: an override of 0.5 was cast to 0, and
  the params stopped moving without a word."""
  tx = optax.inject_hyperparams(optax.sgd)(learning_rate=1)
  opt = OptaxWrapper(tx).create(PARAMS)
  step = jax.jit(lambda o, lr: o.apply_gradient(PARAMS, learning_rate=lr)) if jit else None
  with pytest.raises(TypeError, match=r"learning_rate=.*float32.* int32 learning rate .*1\.0"):
    step(opt, 0.5) if jit else opt.apply_gradient(PARAMS, learning_rate=0.5)
  stepped = opt.apply_gradient(PARAMS, learning_rate=2)
  np.testing.assert_array_equal(stepped.target["dense"]["kernel"], -np.ones((3, 4)))


@pytest.mark.slow
def test_lookahead_over_plain_params_is_refused_at_create():
  """optax.lookahead trains `optax.LookaheadParams`: plain params were accepted by ``create``
  and failed at the first step with ``AttributeError: 'dict' object has no attribute 'fast'``."""
  opt_def = OptaxWrapper(optax.lookahead(optax.adam(0.1), 2, 0.5))
  with pytest.raises(TypeError, match=r"optax\.LookaheadParams\.init_synced\(params\).*got dict"):
    opt_def.create(PARAMS)
  opt = opt_def.create(optax.LookaheadParams.init_synced(PARAMS))
  stepped = opt.apply_gradient(jax.tree.map(jnp.ones_like, PARAMS))
  assert int(stepped.state.step) == 1


def _set(state_dict: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
  flat = traverse_util.flatten_dict(state_dict, sep="/")
  flat[path] = value
  return traverse_util.unflatten_dict(flat, sep="/")


BAD_VALUES = {
  "list": [1.0, 2.0],
  "tuple": (1.0,),
  "str": "abc",
  "object": object(),
  "int_for_subtree": 3,
}


@pytest.mark.parametrize("where", ["subtree", "leaf"])
@pytest.mark.parametrize("kind", sorted(BAD_VALUES))
@pytest.mark.parametrize("make", ["optax", "multi"])
def test_restore_errors_name_the_path_whatever_the_value(where, kind, make):
  opt_def = OptaxWrapper(optax.adam(0.1))
  if make == "multi":
    opt_def = MultiOptimizer([("kernel", opt_def), ("bias", OptaxWrapper(optax.sgd(0.1)))])
  opt = opt_def.create(PARAMS)
  state_dict = jax.tree.map(np.asarray, opt.state_dict())
  flat = traverse_util.flatten_dict(state_dict, sep="/")
  leaf = next(k for k in flat if k.endswith("mu/dense/kernel"))
  path = leaf.rsplit("/", 2)[0] if where == "subtree" else leaf
  if kind == "int_for_subtree" and where == "leaf":
    pytest.skip("an int is array data for a leaf")
  bad = {k: v for k, v in flat.items() if not k.startswith(path + "/")}
  bad = traverse_util.unflatten_dict({**bad, path: BAD_VALUES[kind]}, sep="/")
  before = jax.tree.map(np.asarray, opt)
  with pytest.raises(ValueError, match=rf"at '{path}'"):
    opt.restore_state(bad)
  assert jax.tree.all(jax.tree.map(lambda a, b: bool(np.all(a == b)), opt, before))


@pytest.mark.parametrize("root", [3, None, [1, 2], "state", np.ones(2)])
def test_restore_of_a_non_dict_root_names_the_root(opt, root):
  with pytest.raises(ValueError, match=r"State dict mismatch at '<root>'"):
    opt.restore_state(root)


def test_restore_of_a_list_where_state_belongs(opt):
  state_dict = {**opt.state_dict(), "state": [1, 2]}
  with pytest.raises(ValueError, match=r"State dict mismatch at 'state': expected a subtree"):
    opt.restore_state(state_dict)


@pytest.mark.parametrize(
  "build, message",
  [
    (
      lambda: OptaxWrapper(optax.adam),
      r"OptaxWrapper takes .* got the function optax\.adam.*call it",
    ),
    (lambda: OptaxWrapper(None), r"OptaxWrapper takes .* got None"),
    (
      lambda: OptaxWrapper(OptaxWrapper(optax.adam(0.1))),
      r"OptaxWrapper takes .* got an OptaxWrapper, an optimizer definition already",
    ),
    (
      lambda: optimizers.chain([optax.clip(1.0), optax.sgd]),
      r"optimizers\.chain's transformations\[1\] .* got the function optax\.sgd.*call it",
    ),
    (
      lambda: optimizers.low_precision(optax.adamw, "8bit"),
      r"low_precision's inner .* got the function optax\.adamw.*call it",
    ),
    (
      # The list's brackets forgotten: the error blamed chain's init_fn and said to call it.
      lambda: optimizers.chain(optax.adamw(1e-3)),
      r"optimizers\.chain's transformations takes a list of transformations, got one "
      r"transformation: put it in a list \(in gin, with the brackets: ",
    ),
  ],
)
def test_a_transformation_is_checked_where_it_is_given(build, message):
  """A factory instead of the transformation it builds (gin's ``@optax.adam`` without ``()``)
  failed only at ``create``, with ``AttributeError: 'function' object has no attribute 'init'``."""
  with pytest.raises(TypeError, match=message):
    build()


def test_inject_hyperparams_takes_one_static_arg_by_name():
  """optax takes ``static_args='nesterov'``; ours split it into characters, and optax then
  refused {'v', 's', 'o', 't', 'r', 'n', 'e'}."""
  tx = optimizers.inject_hyperparams(
    optax.sgd, hyperparams={"learning_rate": 0.1, "nesterov": True}, static_args="nesterov"
  )
  assert sorted(tx.init({"w": jnp.ones(2)}).hyperparams) == ["learning_rate"]  # nesterov static


def _warn_ignored_learning_rate() -> None:
  OptaxWrapper(optax.adam(0.1)).create(PARAMS).apply_gradient(
    _grads(PARAMS["dense"]["kernel"]), learning_rate=0.5
  )


def _warn_ignored_learning_rate_under_jit() -> None:
  opt = OptaxWrapper(optax.adam(0.1)).create(PARAMS)
  jax.jit(lambda o: o.apply_gradient(_grads(o.target["dense"]["kernel"]), learning_rate=0.5))(opt)


def _warn_replicated_state_leaves() -> None:
  opt = OptaxWrapper(optax.adam(0.1)).create(PARAMS)
  axes = {"dense": {"kernel": P("embed", "mlp"), "bias": P("embed", "mlp")}}
  opt.optimizer_def.derive_logical_axes(opt, axes)


def _warn_filter_selecting_nothing() -> None:
  MultiOptimizer([("nothing", OptaxWrapper(optax.sgd(0.1)))]).create(PARAMS)


def _warn_unused_kernel_axes_override() -> None:
  rule = KernelAxesRule(overrides={"nothing": "adam"})
  optimizers.muon(
    learning_rate=0.02,
    kernel_axes_rule=rule,
    param_axes={"dense": {"kernel": P("embed", "mlp"), "bias": P("mlp")}},
  )


def _warn_unused_param_mode() -> None:
  low_precision(optax.adam(0.1), "8bit", param_modes=[("nothing", "bfloat16")]).init(PARAMS)


def _warn_unused_param_mode_in_a_wrapper_under_jit() -> None:
  tx = low_precision(optax.adam(0.1), "8bit", param_modes=[("nothing", "bfloat16")])
  jax.jit(OptaxWrapper(optax.chain(tx)).create)(PARAMS)


def _warn_counter_restored_from_bfloat16() -> None:
  opt = OptaxWrapper(optax.adam(0.1)).create(PARAMS)
  state_dict = opt.state_dict()
  state_dict["state"]["step"] = np.asarray(1000, jnp.bfloat16)
  opt.restore_state(state_dict)


def _warn_unused_block_size_of_a_gin_built_optimizer() -> None:
  with gin.unlock_config():
    gin.parse_config(
      "from __gin__ import dynamic_registration\n"
      "import optax\n"
      "from t5x_optim import optimizers\n"
      "optimizers.low_precision.inner = @optax.adam()\n"
      "optax.adam.learning_rate = 0.1\n"
      "optimizers.low_precision.state_dtype = 'bfloat16'\n"
      "optimizers.low_precision.block_size = 64\n"
    )
  try:
    gin.get_configurable(low_precision)()
  finally:
    gin.clear_config()


def _warn_unused_block_size_of_a_gin_reference() -> None:
  """gin builds a reference's value (``[@optimizers.low_precision()]``) in ``copy.deepcopy``."""
  with gin.unlock_config():
    gin.parse_config(
      "from __gin__ import dynamic_registration\n"
      "import optax\n"
      "from t5x_optim import optimizers\n"
      "optimizers.chain.transformations = [@optimizers.low_precision()]\n"
      "optimizers.low_precision.inner = @optax.adam()\n"
      "optax.adam.learning_rate = 0.1\n"
      "optimizers.low_precision.state_dtype = 'bfloat16'\n"
      "optimizers.low_precision.block_size = 64\n"
    )
  try:
    gin.get_configurable(optimizers.chain)()
  finally:
    gin.clear_config()


@pytest.mark.parametrize(
  "warn",
  [
    _warn_ignored_learning_rate,
    _warn_ignored_learning_rate_under_jit,
    _warn_replicated_state_leaves,
    _warn_filter_selecting_nothing,
    _warn_unused_kernel_axes_override,
    _warn_unused_param_mode,
    _warn_unused_param_mode_in_a_wrapper_under_jit,
    _warn_counter_restored_from_bfloat16,
    _warn_unused_block_size_of_a_gin_built_optimizer,
    _warn_unused_block_size_of_a_gin_reference,
  ],
)
def test_each_warning_points_at_the_callers_line(warn):
  """The warnings named an internal line, or `sys:1` (a fixed stacklevel too deep)."""
  with pytest.warns(UserWarning) as caught:
    warn()
  assert [w.filename for w in caught] == [__file__] * len(caught), [
    (w.filename, w.lineno, str(w.message)[:60]) for w in caught
  ]


def test_every_warning_of_the_package_goes_through_the_caller_attributing_helper():
  """A warning raised with a fixed stacklevel names an internal line from other call paths."""
  package = Path(t5x_optim.__file__).parent
  direct = [
    str(path.relative_to(package))
    for path in package.rglob("*.py")
    if path.name != "_warn.py" and "warnings.warn(" in path.read_text()
  ]
  assert direct == []
