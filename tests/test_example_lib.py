"""ExampleLibOptimizerDef against the triples' own loops (jax.example_libraries)."""

from __future__ import annotations

import inspect
from typing import Any, NamedTuple

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.example_libraries import optimizers as example_lib
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from t5x_optim import (
  ExampleLibOptimizerDef,
  Optimizer,
  TrainState,
  example_lib_optimizer_makers,
  optimizers,
  wrap_example_lib_optimizer,
)
from t5x_optim._adapters.example_lib import EXAMPLE_LIB_OPTIMIZERS
from t5x_optim.checkpoints import Checkpointer
from t5x_optim.partitioning import (
  Partitioner,
  StateRulesFallback,
  create_mesh,
  logical_to_mesh_axes_tree,
  standard_logical_axis_rules,
)

pytestmark = pytest.mark.usefixtures("shared_compilation_cache")

STEPS = 5
MAKERS = (
  "adagrad",
  "adam",
  "adamax",
  "momentum",
  "nesterov",
  "rmsprop",
  "rmsprop_momentum",
  "sgd",
  "sm3",
)
AXES = {"dense": {"kernel": P("embed", "mlp"), "bias": P("mlp")}, "scale": None}
RULES = (("embed", "data"), ("mlp", "model"))


class Case(NamedTuple):
  name: str
  maker: str
  args: tuple[Any, ...]

  def triple(self) -> example_lib.Optimizer:
    return getattr(example_lib, self.maker)(*self.args)

  def opt_def(self) -> ExampleLibOptimizerDef:
    return EXAMPLE_LIB_OPTIMIZERS[f"example_lib_{self.maker}"](*self.args)


CASES = (
  Case("sgd", "sgd", (0.1,)),
  Case("momentum", "momentum", (0.1, 0.9)),
  Case("nesterov", "nesterov", (0.1, 0.9)),
  Case("adagrad", "adagrad", (0.1,)),
  Case("rmsprop", "rmsprop", (0.01,)),
  Case("rmsprop_momentum", "rmsprop_momentum", (0.01,)),
  Case("adam", "adam", (0.01,)),
  Case("adamax", "adamax", (0.01,)),
  Case("sm3", "sm3", (0.1,)),
  Case("adam_exponential_decay", "adam", (example_lib.exponential_decay(0.01, 2, 0.5),)),
  Case("sm3_piecewise", "sm3", (example_lib.piecewise_constant([1, 3], [0.1, 0.05, 0.01]),)),
)
IDS = [case.name for case in CASES]


def make_params() -> dict[str, Any]:
  kernel = jnp.linspace(-1.0, 1.0, 32, dtype=jnp.float32).reshape(4, 8)
  return {"dense": {"kernel": kernel, "bias": jnp.linspace(0.5, 1.5, 8)}, "scale": jnp.float32(2.0)}


def grads_at(params: Any, step: int) -> Any:
  return jax.tree.map(lambda x: jnp.sin(3.0 * x + step) + 0.1, params)


def array_bytes(tree: Any) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(tree) if isinstance(x, jax.Array))


def assert_trees_equal(actual: Any, expected: Any) -> None:
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


def native_run(case: Case, *, jit: bool, steps: int = STEPS) -> tuple[Any, Any]:
  init_fn, update_fn, params_fn = case.triple()
  update = jax.jit(update_fn) if jit else update_fn
  state = init_fn(make_params())
  for i in range(steps):
    state = update(i, grads_at(params_fn(state), i), state)
  return params_fn(state), state


def native_parts(state: example_lib.OptimizerState) -> list[Any]:
  """The float state arrays after each param's own slot (first in every jax triple)."""
  return [
    x
    for flat in state.packed_state
    for x in flat[1:]
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating)
  ]


def adapter_step(opt: Optimizer, grads: Any) -> Optimizer:
  return opt.apply_gradient(grads)


def adapter_run(opt: Optimizer, *, jit: bool, steps: int = STEPS) -> Optimizer:
  step = jax.jit(adapter_step) if jit else adapter_step
  for _ in range(steps):
    opt = step(opt, grads_at(opt.target, int(opt.state.step)))
  return opt


def test_discovers_every_decorated_maker() -> None:
  assert tuple(example_lib_optimizer_makers()) == MAKERS
  assert sorted(EXAMPLE_LIB_OPTIMIZERS) == [f"example_lib_{name}" for name in MAKERS]


def test_wrapper_keeps_the_signature_for_gin() -> None:
  wrapped = wrap_example_lib_optimizer(example_lib.adam)
  assert inspect.signature(wrapped) == inspect.signature(example_lib.adam)
  assert wrapped.__doc__ == example_lib.adam.__doc__
  assert EXAMPLE_LIB_OPTIMIZERS["example_lib_adam"].__name__ == "example_lib_adam"


QUICK = {"sgd", "rmsprop_momentum", "adam", "adam_exponential_decay"}
"""The cases the quick loop runs eagerly: a state of each shape and a schedule."""


# Under jit (slow): each case compiles its step; the quick loop runs some eagerly.
@pytest.mark.parametrize(
  "case, jit",
  [
    pytest.param(case, jit, marks=[] if case.name in QUICK and not jit else pytest.mark.slow)
    for case in CASES
    for jit in (False, True)
  ],
  ids=[f"{name}-{kind}" for name in IDS for kind in ("eager", "jit")],
)
def test_matches_native_loop_bit_for_bit(case: Case, jit: bool, request) -> None:
  if jit:  # the documented promise: bit-identical under jax.jit, as users compile
    request.getfixturevalue("xla_optimized")
  expected_params, native_state = native_run(case, jit=jit)
  opt = adapter_run(case.opt_def().create(make_params()), jit=jit)
  assert_trees_equal(opt.target, expected_params)
  assert_trees_equal(jax.tree.leaves(opt.state.param_states), native_parts(native_state))
  assert int(opt.state.step) == STEPS


@pytest.mark.parametrize("case", CASES[:9], ids=IDS[:9])
def test_state_keeps_no_param_copy(case: Case) -> None:
  params = make_params()
  native_state = case.triple().init_fn(params)
  opt = case.opt_def().create(params)
  assert array_bytes(opt.target) + array_bytes(opt.state.param_states) == array_bytes(native_state)


@pytest.mark.parametrize(
  "maker, parts",
  [
    ("sgd", {}),
    ("adam", {"m": (4, 8), "v": (4, 8)}),
    ("rmsprop_momentum", {"avg_sq_grad": (4, 8), "mom": (4, 8)}),
    ("sm3", {"m": (4, 8), "vs": {"0": (4,), "1": (8,)}}),
  ],
)
def test_param_states_are_named_and_keyed_like_the_params(maker: str, parts: Any) -> None:
  opt = EXAMPLE_LIB_OPTIMIZERS[f"example_lib_{maker}"](0.1).create(make_params())
  kernel = opt.state.param_states["dense"]["kernel"]
  assert jax.tree.map(jnp.shape, kernel) == parts


def test_bare_triple_names_state_positions() -> None:
  opt = ExampleLibOptimizerDef(example_lib.sm3(0.1)).create(make_params())
  assert jax.tree.map(jnp.shape, opt.state.param_states["scale"]) == {"1": (1,), "2": {"0": (1,)}}


@pytest.mark.slow
@pytest.mark.parametrize("maker", ["adam", "sm3"])
def test_state_dict_round_trip(maker: str) -> None:
  opt_def = EXAMPLE_LIB_OPTIMIZERS[f"example_lib_{maker}"](0.05)
  trained = adapter_run(opt_def.create(make_params()), jit=False, steps=2)
  state_dict = jax.device_get(trained.state_dict())
  assert set(state_dict["state"]["param_states"]["dense"]["kernel"]) == (
    {"m", "v"} if maker == "adam" else {"m", "vs"}
  )
  restored = opt_def.create(make_params()).restore_state(state_dict)
  assert_trees_equal(restored, trained)
  assert_trees_equal(
    adapter_run(restored, jit=False, steps=1), adapter_run(trained, jit=False, steps=1)
  )


@pytest.mark.slow
def test_checkpointer_round_trip(tmp_path: Any) -> None:
  opt_def = EXAMPLE_LIB_OPTIMIZERS["example_lib_sm3"](0.05)
  trained = adapter_run(opt_def.create(make_params()), jit=False, steps=2)
  with Checkpointer(tmp_path, async_save=False) as checkpointer:
    checkpointer.save(2, trained)
    restored = checkpointer.restore(opt_def.create(make_params()))
  assert_trees_equal(restored, trained)


def test_frozen_dict_params_take_dict_grads() -> None:
  params = flax.core.freeze(make_params())
  opt = EXAMPLE_LIB_OPTIMIZERS["example_lib_adam"](0.01).create(params)
  opt = opt.apply_gradient(grads_at(make_params(), 0))
  init_fn, update_fn, params_fn = example_lib.adam(0.01)
  expected = params_fn(update_fn(0, grads_at(params, 0), init_fn(params)))
  assert isinstance(opt.target, flax.core.FrozenDict)
  assert_trees_equal(opt.target, expected)
  thawed = opt.replace(target=flax.core.unfreeze(opt.target)).apply_gradient(grads_at(expected, 1))
  native = update_fn(1, grads_at(expected, 1), update_fn(0, grads_at(params, 0), init_fn(params)))
  assert_trees_equal(thawed.target, flax.core.unfreeze(params_fn(native)))


@pytest.mark.parametrize(
  "edit, match",
  [
    (
      lambda ps: ps["dense"]["kernel"].update(m=np.zeros((8, 4), np.float32)),
      r"Shape mismatch at 'state/param_states/dense/kernel/m'",
    ),
    (lambda ps: ps["dense"]["kernel"].pop("v"), r"Missing key 'state/param_states/dense/kernel/v'"),
    (
      lambda ps: ps["scale"].update(w=np.zeros(2, np.float32)),
      r"Unexpected keys \['w'\] at 'state/param_states/scale'",
    ),
  ],
  ids=["shape", "missing", "unexpected"],
)
def test_bad_restore_names_the_path(edit: Any, match: str) -> None:
  opt = EXAMPLE_LIB_OPTIMIZERS["example_lib_adam"](0.05).create(make_params())
  state_dict = jax.device_get(opt.state_dict())
  edit(state_dict["state"]["param_states"])
  with pytest.raises(ValueError, match=match):
    opt.restore_state(state_dict)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_learning_rate_override_rebuilds_the_step_size(jit: bool) -> None:
  opt = EXAMPLE_LIB_OPTIMIZERS["example_lib_adam"](0.5).create(make_params())
  grads = grads_at(make_params(), 0)
  step = jax.jit(Optimizer.apply_gradient) if jit else Optimizer.apply_gradient
  new = step(opt, grads, learning_rate=jnp.float32(0.01))
  init_fn, update_fn, params_fn = example_lib.adam(jnp.float32(0.01))
  expected = params_fn(
    jax.jit(update_fn)(0, grads, init_fn(make_params()))
    if jit
    else update_fn(0, grads, init_fn(make_params()))
  )
  assert_trees_equal(new.target, expected)


@pytest.mark.parametrize(
  "opt_def, match",
  [
    (ExampleLibOptimizerDef(example_lib.adam(0.1)), r"without its maker"),
    (EXAMPLE_LIB_OPTIMIZERS["example_lib_adam"](example_lib.constant(0.1)), r"step-size schedule"),
  ],
  ids=["bare_triple", "schedule"],
)
def test_learning_rate_override_errors(opt_def: ExampleLibOptimizerDef, match: str) -> None:
  opt = opt_def.create(make_params())
  with pytest.raises(ValueError, match=match):
    opt.apply_gradient(grads_at(make_params(), 0), learning_rate=0.01)
  assert opt.apply_gradient(grads_at(make_params(), 0), learning_rate=None).state.step == 1


@pytest.mark.parametrize(
  "learning_rate, match",
  [(True, r"got a bool: True"), (jnp.linspace(0.1, 0.8, 8), r"got an array of shape \(8,\)")],
  ids=["bool", "vector"],
)
def test_learning_rate_override_must_be_a_real_scalar(learning_rate: Any, match: str) -> None:
  """A bool was taken as a step size of 1.0, and a vector failed inside
  jax.example_libraries with a TypeError naming neither learning_rate= nor the problem."""
  opt = EXAMPLE_LIB_OPTIMIZERS["example_lib_sgd"](0.1).create(make_params())
  with pytest.raises(TypeError, match=r"learning_rate= must be a real scalar.*" + match):
    opt.apply_gradient(grads_at(make_params(), 0), learning_rate=learning_rate)


def test_unknown_keyword_raises() -> None:
  opt = EXAMPLE_LIB_OPTIMIZERS["example_lib_sgd"](0.1).create(make_params())
  with pytest.raises(TypeError, match=r"unknown keyword arguments \['batch'\]"):
    opt.apply_gradient(grads_at(make_params(), 0), batch=1)


def test_mismatched_grads_name_the_paths() -> None:
  opt = EXAMPLE_LIB_OPTIMIZERS["example_lib_adam"](0.1).create(make_params())
  with pytest.raises(ValueError, match=r"paths only in the grads: \['other'\]"):
    opt.apply_gradient({"other": jnp.ones(2), **grads_at(make_params(), 0)})


@example_lib.optimizer
def _twice_stored(step_size: float) -> tuple[Any, Any, Any]:
  return (
    lambda x: (x, x + 0.0),
    lambda i, g, s: (s[0] - step_size * g, s[1]),
    lambda s: s[0] + s[1],
  )


def test_param_read_from_two_arrays_raises() -> None:
  with pytest.raises(ValueError, match=r"get_params reads param 'w' from state arrays"):
    ExampleLibOptimizerDef(_twice_stored(0.1)).create({"w": jnp.ones(3)})


@example_lib.optimizer
def _stored_at_half_scale(step_size: float) -> tuple[Any, Any, Any]:
  return (lambda x: 0.5 * x, lambda i, g, s: s - 0.5 * step_size * g, lambda s: 2.0 * s)


@example_lib.optimizer
def _stored_transposed(step_size: float) -> tuple[Any, Any, Any]:
  return (lambda x: x.T, lambda i, g, s: s - step_size * g.T, lambda s: s.T)


@pytest.mark.parametrize(
  ("maker", "ops"), [(_stored_at_half_scale, "mul"), (_stored_transposed, "transpose")]
)
def test_a_param_computed_from_its_state_array_raises(maker, ops) -> None:
  """The adapter rebuilds the state array from the param by a reshape: any other
  computation in get_params would be undone wrongly at every step."""
  with pytest.raises(ValueError, match=rf"param 'w' from its state array by {ops}"):
    ExampleLibOptimizerDef(maker(0.1)).create({"w": jnp.ones((2, 3))})


def test_a_param_stored_reshaped_steps_as_the_triple() -> None:
  stored_flat = example_lib.optimizer(
    lambda step_size: (
      lambda x: x.reshape(-1),
      lambda i, g, s: s - step_size * g.reshape(-1),
      lambda s: s.reshape(2, 3),
    )
  )
  init, update, get_params = stored_flat(0.1)
  grads = {"w": jnp.arange(6.0).reshape(2, 3)}
  opt = ExampleLibOptimizerDef(stored_flat(0.1)).create({"w": jnp.ones((2, 3))})
  expected = get_params(update(0, grads, init({"w": jnp.ones((2, 3))})))
  np.testing.assert_array_equal(opt.apply_gradient(grads).target["w"], expected["w"])


@example_lib.optimizer
def _python_counter(step_size: float) -> tuple[Any, Any, Any]:
  return (lambda x: (x, 0), lambda i, g, s: (s[0] - step_size * g, s[1] + 1), lambda s: s[0])


def test_changing_python_state_raises() -> None:
  opt = ExampleLibOptimizerDef(_python_counter(0.1)).create({"w": jnp.ones(3)})
  with pytest.raises(ValueError, match=r"changed the Python value 0 in the state of param 'w'"):
    opt.apply_gradient({"w": jnp.ones(3)})


@pytest.mark.parametrize(
  "jit", [pytest.param(False, marks=pytest.mark.slow), True], ids=["eager", "jit"]
)
@pytest.mark.slow
def test_low_precision_params_keep_their_dtype(jit: bool) -> None:
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), make_params())
  opt = EXAMPLE_LIB_OPTIMIZERS["example_lib_adam"](
    example_lib.exponential_decay(0.01, 2, 0.5)
  ).create(params)
  opt = adapter_run(opt, jit=jit, steps=2)
  assert {x.dtype for x in jax.tree.leaves(opt)} == {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.int32)}


EXPECTED_AXES = {
  "adam": {
    "dense": {
      "kernel": {"m": P("embed", "mlp"), "v": P("embed", "mlp")},
      "bias": {"m": P("mlp"), "v": P("mlp")},
    },
    "scale": {"m": None, "v": None},
  },
  "sm3": {
    "dense": {
      "kernel": {"m": P("embed", "mlp"), "vs": {"0": P("embed"), "1": P("mlp")}},
      "bias": {"m": P("mlp"), "vs": {"0": P("mlp")}},
    },
    "scale": {"m": None, "vs": {"0": None}},
  },
  "sgd": {"dense": {"kernel": {}, "bias": {}}, "scale": {}},
}


@pytest.mark.parametrize("abstract", [False, True], ids=["arrays", "eval_shape"])
@pytest.mark.parametrize("maker", sorted(EXPECTED_AXES))
def test_derive_logical_axes_exact_specs(maker: str, abstract: bool) -> None:
  opt_def = EXAMPLE_LIB_OPTIMIZERS[f"example_lib_{maker}"](0.1)
  opt = jax.eval_shape(opt_def.create, make_params()) if abstract else opt_def.create(make_params())
  axes = opt_def.derive_logical_axes(opt, AXES)
  assert axes.target == AXES
  assert axes.state.step is None
  assert axes.state.param_states == EXPECTED_AXES[maker]


@example_lib.optimizer
def _odd_state(step_size: float) -> tuple[Any, Any, Any]:
  return (lambda x: (x, jnp.zeros(3)), lambda i, g, s: (s[0] - step_size * g, s[1]), lambda s: s[0])


def test_axes_that_do_not_fit_the_params_raise() -> None:
  opt_def = EXAMPLE_LIB_OPTIMIZERS["example_lib_adam"](0.1)
  opt = opt_def.create(make_params())
  with pytest.raises(ValueError, match=r"logical axes do not fit the params"):
    opt_def.derive_logical_axes(opt, {"dense": AXES["dense"], "other": None})


@pytest.mark.parametrize("fallback", list(StateRulesFallback))
def test_unmatched_state_leaf_goes_to_the_fallback(fallback: StateRulesFallback) -> None:
  opt_def = ExampleLibOptimizerDef(_odd_state(0.1), fallback=fallback)
  opt = opt_def.create({"w": jnp.ones((4, 8))})
  axes = {"w": P("embed", "mlp")}
  if fallback is StateRulesFallback.RAISE:
    with pytest.raises(ValueError, match=r"w/1 \(shape"):
      opt_def.derive_logical_axes(opt, axes)
  else:
    with pytest.warns(UserWarning, match=r"w/1 \(shape"):
      assert opt_def.derive_logical_axes(opt, axes).state.param_states == {"w": {"1": None}}


def shard(tree: Any, logical: Any, mesh: jax.sharding.Mesh) -> Any:
  mesh_axes = logical_to_mesh_axes_tree(logical, RULES)
  return jax.tree.map(
    lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec or P())),
    tree,
    mesh_axes,
    is_leaf=lambda x: x is None or isinstance(x, P),
  )


@pytest.mark.parametrize("maker", [pytest.param("adam", marks=pytest.mark.slow), "sm3"])
def test_sharded_jitted_step_matches_unsharded(maker: str) -> None:
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
  opt_def = EXAMPLE_LIB_OPTIMIZERS[f"example_lib_{maker}"](0.05)
  opt = opt_def.create(make_params())
  logical = opt_def.derive_logical_axes(opt, AXES)
  sharded = opt.replace(
    target=shard(opt.target, logical.target, mesh),
    state=opt.state.replace(
      param_states=shard(opt.state.param_states, logical.state.param_states, mesh)
    ),
  )
  kernel_m = sharded.state.param_states["dense"]["kernel"]["m"]
  assert kernel_m.sharding.spec == P("data", "model")
  sharded = adapter_run(sharded, jit=True, steps=3)
  expected = adapter_run(opt, jit=True, steps=3)
  assert sharded.target["dense"]["kernel"].sharding.spec == P("data", "model")
  # Per-shard kernels may round differently by an ulp; layouts are checked above.
  jax.tree.map(
    lambda a, e: np.testing.assert_allclose(a, e, rtol=1e-6, atol=1e-7),
    jax.device_get(sharded),
    jax.device_get(expected),
  )


def train_step(state: TrainState) -> TrainState:
  return state.apply_gradient(grads_at(state.params, 0), learning_rate=jnp.float32(0.02))


@pytest.mark.parametrize("maker", ["adam", "sm3"])
@pytest.mark.slow
def test_train_state_with_partitioner_and_zero(maker: str) -> None:
  boxed = jax.tree.map(
    lambda x, spec: nn.LogicallyPartitioned(x, tuple(spec or ())),
    make_params(),
    AXES,
    is_leaf=lambda x: x is None or isinstance(x, P),
  )
  state = TrainState.create(EXAMPLE_LIB_OPTIMIZERS[f"example_lib_{maker}"](0.5), {"params": boxed})
  partitioner = Partitioner(
    create_mesh(shape={"data": 2, "model": 4}),
    standard_logical_axis_rules(shard_optimizer_state_over_data=True),
  )
  shardings = partitioner.get_shardings(state)
  step = partitioner.partition(train_step, (shardings,), shardings)
  sharded = step(jax.device_put(state, shardings))
  expected = jax.jit(train_step)(state)
  kernel = sharded.param_states["dense"]["kernel"]
  assert kernel["m"].sharding.spec == P("data", "model")
  if maker == "sm3":
    assert kernel["vs"]["1"].sharding.spec == P(("model", "data"))
  jax.tree.map(
    lambda a, e: np.testing.assert_allclose(a, e, rtol=1e-6, atol=1e-7),
    jax.device_get(sharded),
    jax.device_get(expected),
  )


def test_low_precision_refuses_a_triple_without_pointing_to_a_transformation_it_lacks() -> None:
  with pytest.raises(TypeError, match=r"holds no optax transformation") as raised:
    optimizers.low_precision(EXAMPLE_LIB_OPTIMIZERS["example_lib_adam"](1e-3), "8bit")
  assert "optax_optimizer" not in str(raised.value)
