"""OptaxWrapper against plain optax loops, over the one optimizer table."""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util
from jax.sharding import PartitionSpec as P
from optimizer_table import (
  ALL_FACTORIES,
  DISCOVERED,
  T5X_OPTIMIZER_NAMES,
  TABLE,
  Case,
  grads_and_extras,
  initial_params,
  make_params,
  to_numpy,
  tree_equal,
  wrapper_step,
)

import t5x_optim
from t5x_optim import OptaxWrapper, optimizers

pytestmark = pytest.mark.usefixtures("shared_compilation_cache")

STEPS = 5


def plain_step(tx: optax.GradientTransformation, params: Any, state: Any) -> tuple[Any, Any]:
  grads, extras = grads_and_extras(tx, params)
  updates, state = tx.update(grads, state, params, **extras)
  return optax.apply_updates(params, updates), state


def run(case: Case, jit: bool) -> tuple[Any, Any, t5x_optim.Optimizer]:
  """Runs the plain loop and the wrapper side by side."""
  tx = case.make()
  params = initial_params(case)
  state = tx.init(params)
  step = jax.jit(plain_step, static_argnums=0) if jit else plain_step
  for _ in range(STEPS):
    params, state = step(tx, params, state)
  opt = OptaxWrapper(tx).create(initial_params(case))
  apply = jax.jit(wrapper_step) if jit else wrapper_step
  for _ in range(STEPS):
    opt = apply(opt)
  return params, state, opt


# Compiled over the whole table; eager (op by op, each operation compiled on its own:
# about 2 CPU-minutes over the table) over the wrappers and the hand-made states, whose
# structures differ. The wrapper runs the same code eagerly for every discovered factory.
@pytest.mark.slow
@pytest.mark.parametrize(
  ("case", "jit"),
  [(case, jit) for case in TABLE for jit in (False, True) if jit or case not in DISCOVERED],
  ids=lambda x: {False: "eager", True: "jit"}[x] if isinstance(x, bool) else repr(x),
)
def test_matches_plain_optax_loop_bit_for_bit(case: Case, jit: bool, request):
  if jit:  # two programs, bit-identical as users compile; eagerly, the same operations
    request.getfixturevalue("xla_optimized")
  params, state, opt = run(case, jit)
  assert tree_equal(opt.target, params)
  assert tree_equal(opt.state.param_states, state)
  assert opt.state.step.dtype == jnp.int32 and int(opt.state.step) == STEPS
  assert type(opt.target) is type(params)


def _avals(tree: Any) -> tuple[Any, list[tuple[Any, ...]]]:
  """`tree`'s structure and its leaves' shapes, dtypes and weak types: what jit keys on."""
  leaves, treedef = jax.tree.flatten(jax.eval_shape(lambda tree: tree, tree))
  return treedef, [(leaf.shape, leaf.dtype, leaf.weak_type) for leaf in leaves]


@pytest.mark.parametrize(
  "case",
  [case if case.name == "lbfgs" else pytest.param(case, marks=pytest.mark.slow) for case in TABLE],
  ids=repr,
)
def test_the_created_state_has_the_types_its_update_returns(case: Case):
  """A jitted step compiles once: L-BFGS's line search started its state's ``info`` weakly
  typed, and its update returns it strongly typed, so a jitted step compiled again at the
  second step (7 s of a 8-step run of the CLI's tiny model)."""
  opt = OptaxWrapper(case.make()).create(initial_params(case))
  assert _avals(jax.eval_shape(wrapper_step, opt)) == _avals(opt)


def _buffer_owners(tree: Any) -> dict[int, list[str]]:
  """Every device buffer of the concrete arrays in `tree`, with the paths of the leaves in it."""
  owners: dict[int, list[str]] = {}
  for path, leaf in jax.tree.flatten_with_path(tree)[0]:
    if isinstance(leaf, jax.Array) and leaf.size:
      for shard in leaf.addressable_shards:
        owners.setdefault(shard.data.unsafe_buffer_pointer(), []).append(jax.tree_util.keystr(path))
  return owners


@pytest.mark.parametrize(
  "case",
  [
    case if case.name in ("lbfgs", "lookahead") else pytest.param(case, marks=pytest.mark.slow)
    for case in TABLE
  ],
  ids=repr,
)
def test_every_leaf_of_a_created_optimizer_is_its_own_buffer(case: Case):
  """A jitted step that donates the optimizer refused one buffer given twice: L-BFGS's
  ``diff_params_memory`` and ``diff_updates_memory`` were one array, prodigy's ``params0``,
  madgrad's ``x0`` and cocob's ``init_particles`` the params themselves, and lookahead's fast
  and slow params one where created from ``optax.LookaheadParams.init_synced`` (as its error
  at create advises). A leaf in a buffer another holds is copied; the first keeps it."""
  params = initial_params(case)
  opt = OptaxWrapper(case.make()).create(params)
  shared = [paths for paths in _buffer_owners(opt).values() if len(paths) > 1]
  assert not shared, shared
  assert jax.tree.leaves(opt.target)[0] is jax.tree.leaves(params)[0]


@pytest.mark.slow
@pytest.mark.parametrize(
  "case", [case for case in TABLE if case.name in ("lbfgs", "lookahead")], ids=repr
)
def test_a_created_optimizer_steps_donated(case: Case):
  """The created L-BFGS and lookahead optimizers (two leaves in one buffer, before) go through
  a jitted step that donates them, twice."""
  step = jax.jit(wrapper_step, donate_argnums=0)
  jax.block_until_ready(step(step(OptaxWrapper(case.make()).create(initial_params(case)))))


def _distinct(tree: Any) -> Any:
  """`tree` with every numeric array leaf changed to values no other leaf holds
  (a swapped, dropped or zeroed leaf shows in a round trip, as it may not in a fresh state)."""
  leaves, treedef = jax.tree.flatten(tree)
  changed, offset = [], 0
  for leaf in leaves:
    if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.number):
      ramp = offset + np.arange(1, np.size(leaf) + 1).reshape(np.shape(leaf))
      leaf = jnp.asarray((np.asarray(leaf) + ramp).astype(leaf.dtype))
      offset += np.size(leaf) + 1
    changed.append(leaf)
  return jax.tree.unflatten(treedef, changed)


@pytest.mark.slow
@pytest.mark.parametrize("case", TABLE, ids=repr)
def test_state_dict_round_trip(case: Case):
  opt = _distinct(OptaxWrapper(case.make()).create(initial_params(case)))
  as_numpy = to_numpy(opt.state_dict())
  restored = opt.restore_state(as_numpy)
  assert tree_equal(restored.target, opt.target)
  assert tree_equal(restored.state, opt.state)
  fresh = opt.optimizer_def.create(initial_params(case)).restore_state(opt.state_dict())
  assert tree_equal(fresh.state, opt.state)


def test_discovery_covers_t5x_names_and_contrib():
  assert T5X_OPTIMIZER_NAMES <= set(ALL_FACTORIES)
  assert {"adafactor", "sm3", "lbfgs", "muon", "prodigy", "sophia"} <= set(ALL_FACTORIES)
  assert len(DISCOVERED) >= 40
  for name in ALL_FACTORIES:
    wrapped = getattr(optimizers, name)
    assert wrapped.optax_factory is ALL_FACTORIES[name]
    assert name in optimizers.__all__


def _flat_keys(state_dict: dict) -> list[str]:
  return sorted("/".join(k) for k in traverse_util.flatten_dict(state_dict))


def _params() -> dict:
  return {"dense": {"kernel": jnp.ones((2, 3)), "bias": jnp.zeros(3)}}


@pytest.mark.parametrize(
  "opt_def, expected",
  [
    (
      optimizers.adamw(1e-3),
      [
        "state/param_states/0/count",
        "state/param_states/0/mu/dense/bias",
        "state/param_states/0/mu/dense/kernel",
        "state/param_states/0/nu/dense/bias",
        "state/param_states/0/nu/dense/kernel",
      ],
    ),
    (
      optimizers.chain([optax.clip_by_global_norm(1.0), optax.adam(1e-3)]),
      [
        "state/param_states/1/0/count",
        "state/param_states/1/0/mu/dense/bias",
        "state/param_states/1/0/mu/dense/kernel",
        "state/param_states/1/0/nu/dense/bias",
        "state/param_states/1/0/nu/dense/kernel",
      ],
    ),
    (
      OptaxWrapper(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9)),
      [
        "state/param_states/count",
        "state/param_states/hyperparams/learning_rate",
        "state/param_states/hyperparams/momentum",
        "state/param_states/inner_state/0/trace/dense/bias",
        "state/param_states/inner_state/0/trace/dense/kernel",
      ],
    ),
  ],
  ids=["adamw", "chain_clip_adam", "inject_hyperparams_sgd"],
)
def test_state_dict_keys_match_t5x(opt_def, expected):
  keys = _flat_keys(opt_def.create(_params()).state_dict())
  assert keys == sorted(expected + ["state/step", "target/dense/bias", "target/dense/kernel"])


@pytest.fixture(name="adamw_opt", scope="module")
def fixture_adamw_opt() -> t5x_optim.Optimizer:
  opt = optimizers.adamw(1e-3).create(_params())
  return opt.apply_gradient(jax.tree.map(jnp.ones_like, _params()))


def _edit(state_dict: dict, path: str, value: Any = None, *, delete: bool = False) -> dict:
  flat = traverse_util.flatten_dict(state_dict, sep="/")
  if delete:
    del flat[path]
  else:
    flat[path] = value
  return traverse_util.unflatten_dict(flat, sep="/")


@pytest.mark.parametrize(
  "edit, message",
  [
    (
      lambda sd: _edit(sd, "state/param_states/0/mu/dense/kernel", delete=True),
      r"Missing key 'state/param_states/0/mu/dense/kernel'",
    ),
    (
      lambda sd: _edit(sd, "state/param_states/0/mu/dense/extra", np.zeros(3)),
      r"Unexpected keys \['extra'\] at 'state/param_states/0/mu/dense'",
    ),
    (
      lambda sd: _edit(sd, "target/dense/kernel", np.zeros((3, 2), np.float32)),
      r"Shape mismatch at 'target/dense/kernel': the optimizer has shape \(2, 3\), "
      r"the state dict has shape \(3, 2\)",
    ),
    (
      lambda sd: _edit(sd, "state/param_states/0/nu/dense/bias", np.zeros(3, np.complex64)),
      r"Dtype mismatch at 'state/param_states/0/nu/dense/bias': the state dict has "
      r"complex64, which cannot be cast safely to the optimizer's float32",
    ),
    (
      lambda sd: _edit(sd, "state/param_states/0/count", np.asarray(1.5)),
      r"Dtype mismatch at 'state/param_states/0/count': the state dict has float64",
    ),
    (lambda sd: _edit(sd, "state/step", np.asarray(2**40)), r"Dtype mismatch at 'state/step'"),
    (
      lambda sd: _edit(sd, "state/param_states/0/count", {"x": np.zeros(())}),
      r"State dict mismatch at 'state/param_states/0/count'",
    ),
    (  # A checkpoint written with x64 on: the param came back inf, without a word.
      lambda sd: _edit(sd, "target/dense/bias", np.array([1e39, 1.0, 2.0])),
      r"Dtype mismatch at 'target/dense/bias': the state dict has float64, which the devices "
      r"hold as float32 \(jax_enable_x64 is off\), and a finite value is beyond its range",
    ),
  ],
  ids=[
    "missing",
    "unexpected",
    "shape",
    "complex",
    "float_count",
    "int_overflow",
    "subtree_for_leaf",
    "float64_param_overflow",
  ],
)
def test_bad_restore_names_path_and_leaves_optimizer_unchanged(adamw_opt, edit, message):
  before = to_numpy(adamw_opt)
  bad = edit(to_numpy(adamw_opt.state_dict()))
  with pytest.raises(ValueError, match=message):
    adamw_opt.restore_state(bad)
  assert tree_equal(adamw_opt, before)


def test_a_restore_into_another_mask_names_every_masked_out_slot():
  """A state dict of ``optax.masked`` with another mask: each slot the optimizer's mask leaves
  out (a MaskedNode, one param or a whole subtree) is named as masked out, and every mismatch
  is listed in one message."""
  params = {"a": jnp.ones((4, 4)), "b": jnp.ones((4, 4)), "c": {"d": jnp.ones(4)}}

  def masked(mask):
    return OptaxWrapper(optax.masked(optax.adam(0.1), mask)).create(params)

  old = masked({"a": True, "b": False, "c": True}).apply_gradient(params)
  new = masked({"a": False, "b": True, "c": False})
  with pytest.raises(ValueError) as info:
    new.restore_state(old.state_dict())
  lines = str(info.value).splitlines()
  assert lines[0] == "The state dict does not fit the optimizer in 6 places:"
  for moment in ("mu", "nu"):
    where = f"'state/param_states/inner_state/0/{moment}"
    assert (
      f"- State dict mismatch at {where}/a': the optimizer's mask leaves this param out "
      f"(its state there is a MaskedNode), the state dict has shape (4, 4) dtype float32."
    ) in lines
    assert (
      f"- State dict mismatch at {where}/c': the optimizer's mask leaves these params out "
      f"(its state there is a MaskedNode), the state dict has a subtree with keys ['d']."
    ) in lines
    assert (
      f"- Missing key {where}/b' in the state dict: the optimizer has shape (4, 4) dtype "
      f"float32 there."
    ) in lines


def test_a_state_dict_holding_one_array_twice_restores_into_own_buffers(adamw_opt):
  """One array as both moments (a state dict built by hand, or converted): the restored
  optimizer held it twice, and a jitted step that donates the optimizer refused it ("donate
  the same buffer twice"). Each leaf gets its own buffer, as `create` gives it."""
  zeros = jnp.zeros((2, 3))
  state_dict = jax.tree.map(jnp.copy, adamw_opt.state_dict())  # the fixture's stay undonated
  state_dict = _edit(state_dict, "state/param_states/0/mu/dense/kernel", zeros)
  state_dict = _edit(state_dict, "state/param_states/0/nu/dense/kernel", zeros)
  restored = adamw_opt.restore_state(state_dict)
  step = jax.jit(lambda o, g: o.apply_gradient(g), donate_argnums=0)
  stepped = step(restored, jax.tree.map(jnp.ones_like, adamw_opt.target))
  assert int(stepped.state.step) == int(adamw_opt.state.step) + 1


def test_restore_dtype_rule(adamw_opt):
  state_dict = to_numpy(adamw_opt.state_dict())
  state_dict = _edit(state_dict, "state/step", np.asarray(1, np.int64))
  state_dict = _edit(state_dict, "target/dense/bias", np.ones(3, np.float16))
  state_dict = _edit(state_dict, "state/param_states/0/mu/dense/bias", np.ones(3, np.float64))
  restored = adamw_opt.restore_state(state_dict)
  assert restored.state.step.dtype == jnp.int32 and int(restored.state.step) == 1
  # Params keep the state dict's floating dtype (T5X's restore_dtype); state
  # arrays take the optimizer's.
  assert restored.target["dense"]["bias"].dtype == jnp.float16
  assert restored.state.param_states[0].mu["dense"]["bias"].dtype == jnp.float32
  assert tree_equal(adamw_opt.restore_state(adamw_opt.state_dict()), adamw_opt)


class Pair(NamedTuple):
  first: Any
  second: Any


@pytest.mark.parametrize(
  "params",
  [
    flax.core.freeze(_params()),
    (jnp.ones(3), jnp.ones((2, 2))),
    Pair(jnp.ones(3), {"w": jnp.ones(2)}),
  ],
  ids=["frozendict", "tuple", "namedtuple"],
)
def test_any_params_pytree_comes_back_as_given(params):
  opt = optimizers.adam(1e-2).create(params)
  assert opt.state.step.dtype == jnp.int32
  opt = jax.jit(lambda o: o.apply_gradient(jax.tree.map(jnp.ones_like, o.target)))(opt)
  assert jax.tree.structure(opt.target) == jax.tree.structure(params)
  assert tree_equal(opt.restore_state(opt.state_dict()), opt)


def test_plain_dict_grads_for_frozendict_params_and_back():
  frozen = flax.core.freeze(_params())
  grads = jax.tree.map(jnp.ones_like, _params())
  a = optimizers.sgd(0.1).create(frozen).apply_gradient(grads)
  b = optimizers.sgd(0.1).create(_params()).apply_gradient(flax.core.freeze(grads))
  assert isinstance(a.target, flax.core.FrozenDict) and type(b.target) is dict
  assert tree_equal(flax.core.unfreeze(a.target), b.target)


def test_wrong_grads_structure_names_paths():
  opt = optimizers.sgd(0.1).create(_params())
  with pytest.raises(ValueError, match=r"paths only in the grads: \['dense/kernal'\]"):
    opt.apply_gradient({"dense": {"kernal": jnp.ones((2, 3)), "bias": jnp.zeros(3)}})


def test_learning_rate_override_sets_injected_rate():
  tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
  opt = OptaxWrapper(tx).create(_params())
  grads = jax.tree.map(jnp.ones_like, _params())
  stepped = jax.jit(lambda o, lr: o.apply_gradient(grads, learning_rate=lr))(opt, 0.5)
  np.testing.assert_allclose(stepped.target["dense"]["bias"], -0.5 * np.ones(3))
  assert float(stepped.state.param_states.hyperparams["learning_rate"]) == 0.5
  unchanged = opt.apply_gradient(grads, learning_rate=None)
  np.testing.assert_allclose(unchanged.target["dense"]["bias"], -0.1 * np.ones(3))


def test_learning_rate_override_reaches_nested_injected_state():
  tx = optax.chain(optax.clip(1.0), optax.inject_hyperparams(optax.adam)(learning_rate=0.1))
  opt = OptaxWrapper(tx).create(_params())
  stepped = opt.apply_gradient(jax.tree.map(jnp.ones_like, _params()), learning_rate=0.25)
  assert float(stepped.state.param_states[1].hyperparams["learning_rate"]) == 0.25


def test_learning_rate_override_reaches_a_rate_injected_inside_another_injected_state():
  """An outer inject_hyperparams of the weight decay alone stopped the walk, so the inner
  injected learning rate kept 1.0 and the override was called ignored."""

  def decayed_sgd(weight_decay):
    inner = optax.inject_hyperparams(optax.sgd)(learning_rate=1.0)
    return optax.chain(optax.add_decayed_weights(weight_decay), inner)

  tx = optax.inject_hyperparams(decayed_sgd)(weight_decay=0.0)
  opt = OptaxWrapper(tx).create(_params())
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    stepped = opt.apply_gradient(jax.tree.map(jnp.ones_like, _params()), learning_rate=100.0)
  np.testing.assert_array_equal(stepped.target["dense"]["bias"], -100.0 * np.ones(3))
  inner = stepped.state.param_states.inner_state[1]
  assert float(inner.hyperparams["learning_rate"]) == 100.0


def test_learning_rate_override_of_several_injected_rates_warns_with_their_paths():
  labels = {"dense": {"kernel": "k", "bias": "b"}}
  tx = optax.multi_transform(
    {
      "k": optax.inject_hyperparams(optax.sgd)(learning_rate=0.1),
      "b": optax.inject_hyperparams(optax.sgd)(learning_rate=1e-4),
    },
    labels,
  )
  opt = OptaxWrapper(tx).create(_params())
  grads = jax.tree.map(jnp.ones_like, _params())
  with pytest.warns(UserWarning, match=r"one value.*inner_states/b/.*inner_states/k/"):
    stepped = opt.apply_gradient(grads, learning_rate=0.5)
  inner = stepped.state.param_states.inner_states
  assert [float(inner[k].inner_state.hyperparams["learning_rate"]) for k in "bk"] == [0.5, 0.5]
  single = OptaxWrapper(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)).create(_params())
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    single.apply_gradient(grads, learning_rate=0.5)


@pytest.mark.parametrize(
  "tx",
  [
    optax.adam(0.1),
    optax.inject_hyperparams(optax.sgd)(learning_rate=optax.linear_schedule(0.1, 0.0, 5)),
  ],
  ids=["not_injectable", "scheduled"],
)
def test_learning_rate_override_without_injected_constant_warns_and_is_ignored(tx):
  opt = OptaxWrapper(tx).create(_params())
  grads = jax.tree.map(jnp.ones_like, _params())
  with pytest.warns(UserWarning, match=r"no injectable constant learning rate.*ignored"):
    overridden = opt.apply_gradient(grads, learning_rate=0.5)
  assert tree_equal(overridden, opt.apply_gradient(grads))


@pytest.mark.slow
def test_extra_args_reach_reduce_on_plateau():
  tx = optax.chain(
    optax.sgd(1.0), optax.contrib.reduce_on_plateau(patience=0, factor=0.5, cooldown=0)
  )
  opt = OptaxWrapper(tx).create(_params())
  grads = jax.tree.map(jnp.ones_like, _params())
  for _ in range(3):
    opt = opt.apply_gradient(grads, value=jnp.asarray(1.0))
  assert float(opt.state.param_states[1].scale) < 1.0


def test_extra_args_refused_by_plain_transformation():
  opt = OptaxWrapper(optax.GradientTransformation(optax.sgd(0.1).init, optax.sgd(0.1).update))
  with pytest.raises(
    TypeError,
    match=r"unknown keyword arguments \['value'\]; it accepts the hyper-parameters "
    r"\['hyper_params', 'learning_rate'\]\.$",
  ):
    opt.create(_params()).apply_gradient(jax.tree.map(jnp.ones_like, _params()), value=1.0)


def test_multisteps_object_is_accepted():
  opt_def = OptaxWrapper(optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2))
  opt = opt_def.create(_params()).apply_gradient(jax.tree.map(jnp.ones_like, _params()))
  assert isinstance(opt.state.param_states, optax.MultiStepsState)


def test_a_multisteps_object_takes_optaxs_extra_arguments():
  """optax.MultiSteps.update passes extra arguments on to its inner optimizer, but its
  gradient_transformation() is a plain GradientTransformation: the wrapper took none, and
  reduce_on_plateau inside MultiSteps could not get its value=."""
  inner = optax.chain(optax.adam(0.1), optax.contrib.reduce_on_plateau(accumulation_size=1))
  opt_def = OptaxWrapper(optax.MultiSteps(inner, every_k_schedule=2))
  assert opt_def.extra_arg_names == {"grad", "obj_fn", "value", "value_fn"}
  opt = opt_def.create(_params())
  for _ in range(2):
    opt = opt.apply_gradient(jax.tree.map(jnp.ones_like, _params()), value=jnp.float32(1.0))
  assert int(opt.state.param_states.inner_opt_state[1].count) == 0
  assert float(opt.state.param_states.inner_opt_state[1].best_value) == 1.0


def test_update_hyper_params():
  opt_def = optimizers.sgd(0.1)
  assert opt_def.update_hyper_params(learning_rate=0.3).learning_rate == 0.3
  replacement = t5x_optim.OptaxHyperParams(learning_rate=0.7)
  assert opt_def.update_hyper_params(hyper_params=replacement) is replacement
  with pytest.raises(TypeError, match=r"unknown keyword arguments \['value'\]"):
    t5x_optim.OptimizerDef.split_apply_kwargs(_NoExtras(), {"value": 1.0})


class _NoExtras(t5x_optim.OptimizerDef):
  """A minimal user-written definition (T5X style) without extra arguments."""

  def __init__(self):
    super().__init__(hyper_params=t5x_optim.OptaxHyperParams())

  def init_state(self, params):
    return t5x_optim.OptimizerState(step=jnp.zeros((), jnp.int32), param_states=None)

  def apply_gradient(self, hyper_params, params, state, grads):
    return params, state.replace(step=state.step + 1)

  def derive_logical_axes(self, optimizer, param_logical_axes):
    return optimizer.replace(target=param_logical_axes)


def test_plain_optimizer_def_subclass_round_trips():
  opt = _NoExtras().create(make_params()).apply_gradient(make_params())
  assert int(opt.state.step) == 1
  assert tree_equal(opt.restore_state(opt.state_dict()), opt)


def test_derive_logical_axes_t5x_form_for_adamw():
  axes = {"dense": {"kernel": P("embed", "mlp"), "bias": P("mlp")}}
  opt = optimizers.adamw(1e-3).create(_params())
  derived = opt.optimizer_def.derive_logical_axes(opt, flax.core.freeze(axes))
  assert derived.target == axes
  assert derived.state.step is None
  assert derived.state.param_states == (
    optax.ScaleByAdamState(count=None, mu=axes, nu=axes),
    optax.EmptyState(),
    optax.EmptyState(),
  )


def test_derive_logical_axes_on_abstract_params():
  axes = {"dense": {"kernel": P("embed", "mlp"), "bias": P("mlp")}}
  opt_def = optimizers.adafactor(1e-3, min_dim_size_to_factor=2)
  abstract = jax.eval_shape(opt_def.create, _params())
  derived = opt_def.derive_logical_axes(abstract, axes)
  factored = derived.state.param_states[0]
  assert factored.v_row == {"dense": {"kernel": P("embed"), "bias": None}}
  assert factored.v_col == {"dense": {"kernel": P("mlp"), "bias": None}}
  assert factored.v == {"dense": {"kernel": None, "bias": P("mlp")}}


def test_derive_logical_axes_of_params_with_a_none_leaf():
  """A None param holds no array (create and apply_gradient keep it, as optax does), so it has no
  axes: axes made from the params by jax.tree.map, None there, were refused as another
  structure."""
  params = {"w": jnp.ones((4, 8)), "unused": None}
  opt = optimizers.adam(1e-2).create(params).apply_gradient({"w": jnp.ones((4, 8)), "unused": None})
  axes = jax.tree.map(lambda p: P("embed", "mlp"), params)
  derived = opt.optimizer_def.derive_logical_axes(opt, axes)
  assert derived.target == axes == {"w": P("embed", "mlp"), "unused": None}
  assert derived.state.param_states[0] == optax.ScaleByAdamState(count=None, mu=axes, nu=axes)


CONFIGURED = {
  "galore": ["[0].projector['dense']['bias']"],
  "momo": [".lb"],
  "momo_adam": [".lb"],
  "muon": [".inner_states['muon'].inner_state[0].ns_coeffs"],
  "schedule_free": [".b1"],
  "schedule_free_adamw": [".b1"],
  "schedule_free_sgd": [".b1"],
  "inject_hyperparams": [
    f".hyperparams['{name}']"
    for name in ("b1", "b2", "eps", "eps_root", "learning_rate", "weight_decay")
  ],
  "inject_stateful_hyperparams": [".hyperparams['momentum']"],
}
"""The state leaves that only the config sets (`t5x_optim.configured_leaves`), by table case;
every other case has none."""


@pytest.mark.slow
@pytest.mark.parametrize("case", TABLE, ids=repr)
def test_reapply_config_resets_only_the_leaves_the_config_alone_sets(case: Case):
  """Muon's ns_coeffs and schedule-free's b1 sit in the state and a resume kept the old ones:
  `reapply_config` sets such leaves as the config gives them. Under an unchanged config after
  two steps it changes no leaf: one that the update changes, taken for a setting, would come
  back as at init."""
  opt = OptaxWrapper(case.make()).create(initial_params(case))
  for _ in range(2):
    opt = jax.jit(wrapper_step)(opt)
  grads, extras = grads_and_extras(opt.optimizer_def.optax_optimizer, opt.target)
  flags = t5x_optim.configured_leaves(opt, grads, **extras)
  paths = jax.tree_util.tree_leaves_with_path(opt.state.param_states)
  assert [jax.tree_util.keystr(path) for (path, _), flag in zip(paths, flags) if flag] == (
    CONFIGURED.get(case.name, [])
  )
  assert tree_equal(t5x_optim.reapply_config(opt, grads, **extras).state, opt.state)


@pytest.mark.parametrize(
  "wrap",
  [
    lambda tx: optax.MultiSteps(tx, every_k_schedule=2),
    lambda tx: optax.MultiSteps(
      tx, every_k_schedule=2, should_skip_update_fn=optax.skip_not_finite
    ),
    lambda tx: optax.chain(optax.clip_by_global_norm(1.0), optax.MultiSteps(tx, 2)),
  ],
  ids=["MultiSteps", "MultiSteps skipping", "chain(clip, MultiSteps)"],
)
def test_reapply_config_sets_the_settings_kept_inside_multi_steps(wrap):
  """MultiSteps returns its inner state through ``where(emit, new, old)``, and through a cond
  where it may skip a step: the constants of inject_hyperparams and schedule-free's b1 in it
  were not found, and a resume kept the old ones."""
  params = {"w": jnp.ones(3)}

  def injected(learning_rate: float) -> optax.GradientTransformation:
    return optimizers.inject_hyperparams(
      optax.adamw, hyperparams={"learning_rate": learning_rate, "b1": 0.9}
    )

  saved = OptaxWrapper(wrap(injected(1e-2))).create(params)
  now = t5x_optim.reapply_config(saved.replace(optimizer_def=OptaxWrapper(wrap(injected(1e-3)))))
  states = [
    node
    for node in jax.tree.leaves(now.state.param_states, is_leaf=lambda x: hasattr(x, "hyperparams"))
    if hasattr(node, "hyperparams")
  ]
  assert [float(state.hyperparams["learning_rate"]) for state in states] == pytest.approx([1e-3])
  schedule_free = optax.contrib.schedule_free_adamw
  saved = OptaxWrapper(wrap(schedule_free(1e-3, b1=0.9))).create(params)
  now = t5x_optim.reapply_config(
    saved.replace(optimizer_def=OptaxWrapper(wrap(schedule_free(1e-3, b1=0.5))))
  )
  kind = optax.contrib.ScheduleFreeState
  states = jax.tree.leaves(now.state.param_states, is_leaf=lambda x: isinstance(x, kind))
  assert [float(state.b1) for state in states if isinstance(state, kind)] == [0.5]


def _free(b1: float) -> optax.GradientTransformation:
  return optax.contrib.schedule_free_sgd(0.1, b1=b1)


_FREE_LAYOUTS = {
  "whole": lambda b1: OptaxWrapper(_free(b1)),
  "MultiSteps": lambda b1: OptaxWrapper(optax.MultiSteps(_free(b1), 2)),
  "low_precision": lambda b1: OptaxWrapper(t5x_optim.low_precision(_free(b1), "bfloat16")),
  "partition": lambda b1: OptaxWrapper(
    optax.multi_transform({"free": _free(b1), "sgd": optax.sgd(0.1)}, {"a": "free", "b": "sgd"})
  ),
  "MultiOptimizer": lambda b1: t5x_optim.MultiOptimizer(
    [
      (t5x_optim.PathFilter("kernel"), OptaxWrapper(_free(b1))),
      (t5x_optim.PathFilter("bias"), OptaxWrapper(optax.sgd(0.1))),
    ]
  ),
  "lookahead": lambda b1: OptaxWrapper(optax.lookahead(_free(b1), 2, 0.5)),
}


def _free_average(opt) -> list[Any]:
  """Each schedule-free state's average x of its params, ``(y - (1 - b1) z) / b1``, by path."""
  kind = optax.contrib.ScheduleFreeState
  found = []
  trained = dict(
    (jax.tree_util.keystr(path), leaf)
    for path, leaf in jax.tree.flatten_with_path(t5x_optim.trained_params(opt.target))[0]
  )
  for state in jax.tree.leaves(opt.state.param_states, is_leaf=lambda x: isinstance(x, kind)):
    if isinstance(state, kind):
      for path, z in jax.tree.flatten_with_path(state.z)[0]:
        y = trained[jax.tree_util.keystr(path)]
        found.append((y - (1 - state.b1) * z) / state.b1)
  return found


@pytest.mark.parametrize("layout", sorted(_FREE_LAYOUTS))
def test_reapply_config_with_another_b1_keeps_schedule_frees_average(layout):
  """optax's schedule-free stores its params y and z, and its update recovers its average x
  from them by the b1 it is built with: a resume with another b1 kept y, which moved x (the
  params it is evaluated at; here by up to 0.13). The params it takes gradients at are now
  ``b1 x + (1 - b1) z`` by the new b1; x and z stay the run's."""
  make = _FREE_LAYOUTS[layout]
  params = {"a": {"kernel": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)}, "b": {"bias": jnp.ones(3)}}
  lookahead = optax.LookaheadParams.init_synced(params)
  saved = make(0.9).create(lookahead if layout == "lookahead" else params)
  step = jax.jit(lambda opt, i: opt.apply_gradient(jax.tree.map(lambda p: jnp.sin(p * i), params)))
  for i in range(1, 6):
    saved = step(saved, i + 1.0)
  before = _free_average(saved)
  now = t5x_optim.reapply_config(saved.replace(optimizer_def=make(0.5)))
  assert len(before) in (1, 2)
  for got, want in zip(_free_average(now), before, strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  assert not tree_equal(now.target, saved.target)
  assert tree_equal(now.state.step, saved.state.step)
  again = t5x_optim.reapply_config(now)
  assert tree_equal(again.target, now.target) and tree_equal(again.state, now.state)


def test_reapply_config_makes_its_grads_for_a_lookahead_optimizer():
  """Without grads, reapply_config made zeros like the target, which for optax.lookahead holds
  the fast and the slow copy: the grads did not fit the params the update trains."""
  params = optax.LookaheadParams.init_synced({"w": jnp.ones(3)})

  def lookahead(b1: float) -> OptaxWrapper:
    return OptaxWrapper(optax.lookahead(optax.contrib.schedule_free_adamw(1e-3, b1=b1), 2, 0.5))

  saved = lookahead(0.9).create(params)
  now = t5x_optim.reapply_config(saved.replace(optimizer_def=lookahead(0.5)))
  assert float(now.state.param_states.fast_state.b1) == 0.5


@pytest.mark.parametrize(
  "wrap",
  [lambda tx: optax.MultiSteps(tx, 2), lambda tx: optax.chain(optax.clip(1.0), tx)],
  ids=["multi_steps", "chain"],
)
def test_lookahead_inside_another_transformation_is_refused_at_create(wrap):
  """Only an outermost optax.lookahead trains LookaheadParams: inside another transformation
  it was created on plain params (optax only logged a warning) and every step failed inside
  optax with "'dict' object has no attribute 'fast'"."""
  tx = wrap(optax.lookahead(optax.sgd(0.1), 2, 0.5))
  with pytest.raises(TypeError, match=r"optax.lookahead inside another transformation"):
    OptaxWrapper(tx).create({"w": jnp.ones(3)})


@pytest.mark.parametrize(
  "wrap",
  [
    lambda tx: optax.chain(optax.identity(), tx),
    lambda tx: optax.inject_hyperparams(lambda rate: tx)(rate=0.1),
  ],
  ids=["chain", "inject_hyperparams"],
)
def test_lookahead_inside_another_transformation_trains_lookahead_params(wrap):
  """Given optax.LookaheadParams, a lookahead inside a chain or inject_hyperparams trains as
  an outermost one does."""
  params = optax.LookaheadParams.init_synced({"w": jnp.ones(3)})
  plain = OptaxWrapper(optax.lookahead(optax.sgd(0.1), 2, 0.5)).create(params)
  wrapped = OptaxWrapper(wrap(optax.lookahead(optax.sgd(0.1), 2, 0.5))).create(params)
  for _ in range(3):
    plain = plain.apply_gradient({"w": jnp.ones(3)})
    wrapped = wrapped.apply_gradient({"w": jnp.ones(3)})
  for x, y in zip(jax.tree.leaves(plain.target), jax.tree.leaves(wrapped.target), strict=True):
    np.testing.assert_array_equal(x, y)
