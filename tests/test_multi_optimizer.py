"""MultiOptimizer against the equivalent optax.multi_transform, and its edges."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import flax
import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import struct, traverse_util
from flax.core import FrozenDict
from jax.sharding import PartitionSpec as P

from t5x_optim import (
  MultiOptimizer,
  OptaxHyperParams,
  OptaxWrapper,
  Optimizer,
  OptimizerDef,
  OptimizerState,
  PathFilter,
  TrainState,
  low_precision,
  optimizers,
)
from t5x_optim.partitioning import Partitioner, create_mesh

pytestmark = pytest.mark.usefixtures("shared_compilation_cache")

STEPS = 3
KERNELS = PathFilter(r"kernel$")
BIASES = PathFilter(r"bias$")
SHAPES = {
  "dense": {"kernel": (4, 8), "bias": (8,)},
  "out": {"kernel": (8, 4), "bias": (4,)},
  "embed": {"embedding": (6, 4)},
}
AXES = {
  "dense": {"kernel": P("embed", "mlp"), "bias": P("mlp")},
  "out": {"kernel": P("mlp", "embed"), "bias": None},
  "embed": {"embedding": P("vocab", "embed")},
}


def make_params(container: type = dict) -> Any:
  rng = np.random.default_rng(0)
  params = jax.tree.map(
    lambda shape: jnp.asarray(rng.standard_normal(shape), jnp.float32),
    SHAPES,
    is_leaf=lambda x: isinstance(x, tuple),
  )
  return FrozenDict(params) if container is FrozenDict else params


def fake_grads(params: Any, step: int) -> Any:
  return jax.tree.map(lambda p: jnp.sin(p * (step + 1.0)), params)


def path_of(path: jax.tree_util.KeyPath) -> str:
  return "/".join(str(k.key) for k in path)


def labeler(rules: dict[str, str]) -> Callable[[Any], Any]:
  """multi_transform labels: the first regex (searched in the path) wins."""

  def label(path: str) -> str:
    return next((name for regex, name in rules.items() if re.search(regex, path)), "frozen")

  return lambda params: jax.tree.map_with_path(lambda p, _: label(path_of(p)), params)


def run_optax(tx: optax.GradientTransformation, params: Any, **extras: Any) -> Any:
  @jax.jit
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params, **extras)
    return optax.apply_updates(params, updates), state

  state = tx.init(params)
  for i in range(STEPS):
    params, state = step(params, state, fake_grads(params, i))
  return params


def run_multi(opt_def: OptimizerDef, params: Any, **kwargs: Any) -> Optimizer:
  step = jax.jit(lambda opt, grads: opt.apply_gradient(grads, **kwargs))
  opt = opt_def.create(params)
  for i in range(STEPS):
    opt = step(opt, fake_grads(opt.target, i))
  return opt


def assert_trees_equal(actual: Any, expected: Any) -> None:
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


def with_frozen(transforms: dict[str, optax.GradientTransformation]) -> Any:
  return {**transforms, "frozen": optax.set_to_zero()}


@pytest.mark.usefixtures("xla_optimized")
@pytest.mark.slow
@pytest.mark.parametrize("container", [dict, FrozenDict], ids=["dict", "frozendict"])
def test_matches_multi_transform_bit_for_bit(container: type) -> None:
  params = make_params(container)
  opt_def = MultiOptimizer(
    [
      (KERNELS, OptaxWrapper(optax.adam(1e-2))),
      (BIASES, OptaxWrapper(optax.sgd(0.1))),
    ]
  )
  tx = optax.multi_transform(
    with_frozen({"adam": optax.adam(1e-2), "sgd": optax.sgd(0.1)}),
    labeler({"kernel$": "adam", "bias$": "sgd"}),
  )
  opt = run_multi(opt_def, params)
  assert type(opt.target) is container
  assert_trees_equal(opt.target, run_optax(tx, params))
  np.testing.assert_array_equal(opt.target["embed"]["embedding"], params["embed"]["embedding"])
  assert int(opt.state.step) == STEPS
  assert [int(s.step) for s in opt.state.param_states] == [STEPS, STEPS]


MIXED_CASES = {
  "two_wrappers": (
    lambda: MultiOptimizer(
      [
        (KERNELS, OptaxWrapper(optax.adamw(1e-2, weight_decay=0.1))),
        (BIASES, OptaxWrapper(optax.sgd(0.1, momentum=0.9))),
      ]
    ),
    {"kernel$": optax.adamw(1e-2, weight_decay=0.1), "bias$": optax.sgd(0.1, momentum=0.9)},
  ),
  "multisteps": (
    lambda: MultiOptimizer(
      [
        (KERNELS, OptaxWrapper(optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2))),
        (BIASES, OptaxWrapper(optax.sgd(0.1))),
      ]
    ),
    {
      "kernel$": optax.MultiSteps(optax.adam(1e-2), 2).gradient_transformation(),
      "bias$": optax.sgd(0.1),
    },
  ),
  "nested": (
    lambda: MultiOptimizer(
      [
        (
          PathFilter("^dense/"),
          MultiOptimizer(
            [
              (KERNELS, OptaxWrapper(optax.adam(1e-2))),
              (BIASES, OptaxWrapper(optax.sgd(0.1))),
            ]
          ),
        ),
        ("^out/kernel$", OptaxWrapper(optax.lion(1e-3))),
      ]
    ),
    {
      "^dense/kernel$": optax.adam(1e-2),
      "^dense/bias$": optax.sgd(0.1),
      "^out/kernel$": optax.lion(1e-3),
    },
  ),
}


@pytest.mark.usefixtures("xla_optimized")
@pytest.mark.parametrize(
  "case",
  [
    pytest.param(c, marks=pytest.mark.slow) if c in ("multisteps", "nested") else c
    for c in sorted(MIXED_CASES)
  ],
)
def test_mixed_sub_optimizers_match_multi_transform(case: str) -> None:
  make_def, transforms = MIXED_CASES[case]
  names = {regex: str(i) for i, regex in enumerate(transforms)}
  tx = optax.multi_transform(
    with_frozen({names[r]: t for r, t in transforms.items()}), labeler(names)
  )
  params = make_params()
  opt = run_multi(make_def(), params)
  assert_trees_equal(opt.target, run_optax(tx, params))
  if case == "nested":
    np.testing.assert_array_equal(opt.target["out"]["bias"], params["out"]["bias"])


def injected(factory: Callable[..., Any], learning_rate: float) -> OptaxWrapper:
  return OptaxWrapper(optax.inject_hyperparams(factory)(learning_rate=learning_rate))


@pytest.mark.parametrize(
  "kwargs, kernel_rate, bias_rate",
  [
    ({"learning_rate": 0.05}, 0.05, 0.05),
    ({"hyper_params": (OptaxHyperParams(0.05), OptaxHyperParams(0.2))}, 0.05, 0.2),
    pytest.param({"learning_rate": None}, 1.0, 1.0, marks=pytest.mark.slow),
  ],
  ids=["learning_rate", "hyper_params", "none"],
)
def test_hyper_param_overrides(kwargs: dict[str, Any], kernel_rate: float, bias_rate: float):
  opt_def = MultiOptimizer(
    [
      (KERNELS, injected(optax.adam, 1.0)),
      (BIASES, injected(optax.sgd, 1.0)),
    ]
  )
  tx = optax.multi_transform(
    with_frozen(
      {
        "adam": optax.inject_hyperparams(optax.adam)(learning_rate=kernel_rate),
        "sgd": optax.inject_hyperparams(optax.sgd)(learning_rate=bias_rate),
      }
    ),
    labeler({"kernel$": "adam", "bias$": "sgd"}),
  )
  params = make_params()
  assert_trees_equal(run_multi(opt_def, params, **kwargs).target, run_optax(tx, params))


@pytest.mark.parametrize(
  "kwargs, error, message",
  [
    ({"hyper_params": (OptaxHyperParams(),)}, ValueError, r"one entry per sub-optimizer \(2\)"),
  ],
  ids=["hyper_params_length"],
)
def test_hyper_param_override_errors(kwargs: dict[str, Any], error: type, message: str) -> None:
  opt_def = MultiOptimizer(
    [
      (KERNELS, injected(optax.adam, 1.0)),
      (BIASES, OptaxWrapper(optax.sgd(1.0))),
    ]
  )
  opt = opt_def.create(make_params())
  with pytest.raises(error, match=message):
    opt.apply_gradient(fake_grads(opt.target, 0), **kwargs)


@pytest.mark.slow
def test_learning_rate_override_skips_sub_optimizers_without_injected_rate() -> None:
  opt_def = MultiOptimizer(
    [
      (KERNELS, injected(optax.adam, 1.0)),
      (BIASES, OptaxWrapper(optax.sgd(1.0))),
    ]
  )
  opt = opt_def.create(make_params())
  with pytest.warns(UserWarning, match=r"no injectable constant learning rate"):
    stepped = opt.apply_gradient(fake_grads(opt.target, 0), learning_rate=0.1)
  np.testing.assert_allclose(
    stepped.state.param_states[0].param_states.hyperparams["learning_rate"], 0.1
  )


@struct.dataclass
class PlainSgdHyperParams:
  learning_rate: float


class PlainSgd(OptimizerDef):
  """A stateless, non-optax definition that takes no extra arguments."""

  def __init__(self, learning_rate: float):
    super().__init__(PlainSgdHyperParams(learning_rate))
    self.param_axes: list[Any] = []

  def init_state(self, params: Any) -> OptimizerState:
    return OptimizerState(step=jnp.zeros((), jnp.int32), param_states={})

  def apply_gradient(self, hyper_params, params, state, grads):
    new_params = jax.tree.map(lambda p, g: p - hyper_params.learning_rate * g, params, grads)
    return new_params, state.replace(step=state.step + 1)

  def derive_logical_axes(self, optimizer: Optimizer, param_logical_axes: Any) -> Optimizer:
    return optimizer.replace(
      target=param_logical_axes, state=OptimizerState(step=None, param_states={})
    )

  def set_param_axes(self, param_logical_axes: Any) -> None:
    self.param_axes.append(param_logical_axes)


@pytest.mark.slow
def test_extra_args_reach_only_sub_optimizers_that_take_them() -> None:
  plateau = optax.chain(optax.sgd(0.1), optax.contrib.reduce_on_plateau(patience=1))
  opt_def = MultiOptimizer([(KERNELS, PlainSgd(0.1)), (BIASES, OptaxWrapper(plateau))])
  tx = optax.multi_transform(
    with_frozen({"plain": optax.sgd(0.1), "plateau": plateau}),
    labeler({"kernel$": "plain", "bias$": "plateau"}),
  )
  params = make_params()
  assert_trees_equal(
    run_multi(opt_def, params, value=jnp.float32(2.0)).target,
    run_optax(tx, params, value=jnp.float32(2.0)),
  )
  with pytest.raises(TypeError, match=r"unknown keyword arguments \['value'\]"):
    MultiOptimizer([(KERNELS, PlainSgd(0.1))]).create(params).apply_gradient(params, value=1.0)


def _sines(params: Any) -> jax.Array:
  return sum(jnp.sum(jnp.sin(p) ** 2) for p in jax.tree.leaves(params))


def _merged(kernels: Any, rest: Any) -> dict[str, Any]:
  return {name: {**kernels.get(name, {}), **rest[name]} for name in rest}


@pytest.mark.slow
def test_a_line_search_in_a_sub_optimizer_searches_its_own_params() -> None:
  """L-BFGS on the kernels, SGD on the rest: its line search was given the whole tree's
  ``grad`` and a ``value_fn`` of all the params, and failed on their structure. Each
  sub-optimizer gets ``grad`` split as the grads are, and ``value_fn`` (and ``obj_fn``) of
  its own params, the others held at their values: a hand-written optax loop's numbers."""
  params = make_params()
  opt_def = MultiOptimizer(
    [(KERNELS, OptaxWrapper(optax.lbfgs())), (PathFilter(r"kernel$", invert=True), PlainSgd(0.1))]
  )
  step = jax.jit(
    lambda opt: opt.apply_gradient(
      jax.grad(_sines)(opt.target),
      value=_sines(opt.target),
      grad=jax.grad(_sines)(opt.target),
      value_fn=_sines,
    )
  )
  opt = opt_def.create(params)
  for _ in range(STEPS):
    opt = step(opt)

  lbfgs = optax.lbfgs()
  kernels = {name: {"kernel": params[name]["kernel"]} for name in ("dense", "out")}
  rest = {name: {k: v for k, v in leaf.items() if k != "kernel"} for name, leaf in params.items()}

  @jax.jit
  def reference(kernels, rest, state):
    value_fn = lambda k: _sines(_merged(k, rest))  # noqa: E731
    value, grad = jax.value_and_grad(value_fn)(kernels)
    updates, state = lbfgs.update(grad, state, kernels, value=value, grad=grad, value_fn=value_fn)
    rest_grads = jax.grad(lambda r: _sines(_merged(kernels, r)))(rest)
    rest = jax.tree.map(lambda p, g: p - 0.1 * g, rest, rest_grads)
    return optax.apply_updates(kernels, updates), rest, state

  state = lbfgs.init(kernels)
  for _ in range(STEPS):
    kernels, rest, state = reference(kernels, rest, state)
  np.testing.assert_allclose(
    np.concatenate([np.ravel(x) for x in jax.tree.leaves(opt.target)]),
    np.concatenate([np.ravel(x) for x in jax.tree.leaves(_merged(kernels, rest))]),
    rtol=1e-6,
  )
  assert not np.allclose(opt.target["dense"]["kernel"], params["dense"]["kernel"])


def stepped(container: type = dict) -> Optimizer:
  opt_def = MultiOptimizer(
    [
      (KERNELS, OptaxWrapper(optax.adam(1e-2))),
      (BIASES, OptaxWrapper(optax.sgd(0.1, momentum=0.9))),
    ]
  )
  return run_multi(opt_def, make_params(container))


def test_sub_optimizers_take_the_step_of_the_multi_optimizer() -> None:
  """As T5X's MultiOptimizer, each sub-optimizer steps at the parent's step: after
  ``replace_step(9)`` a schedule read at the step (``example_lib``, T5X's Adafactor) ran at the
  sub-optimizer's own step 0, ten times the rate."""
  from t5x_optim import optimizers  # noqa: PLC0415

  params, grads = {"w": jnp.zeros(1), "b": jnp.zeros(1)}, {"w": jnp.ones(1), "b": jnp.ones(1)}

  def sgd():
    return optimizers.example_lib_sgd(lambda i: 1.0 / (1.0 + i))

  single = TrainState.create(sgd(), {"params": params})
  multi = TrainState.create(
    MultiOptimizer([(PathFilter("w"), sgd()), (PathFilter("b"), sgd())]), {"params": params}
  )
  want = single.replace_step(jnp.int32(9)).apply_gradient(grads)
  got = multi.replace_step(jnp.int32(9)).apply_gradient(grads)
  np.testing.assert_array_equal(got.params["w"], want.params["w"])
  np.testing.assert_array_equal(got.params["b"], want.params["b"])
  assert int(got.step) == 10
  assert [int(s.step) for s in got._optimizer.state.param_states] == [10, 10]


def test_state_dict_layout() -> None:
  flat = traverse_util.flatten_dict(stepped().state_dict(), sep="/")
  state_keys = sorted(k for k in flat if k.startswith("state/"))
  assert state_keys == [
    "state/param_states/0/param_states/0/count",
    "state/param_states/0/param_states/0/mu/dense/kernel",
    "state/param_states/0/param_states/0/mu/out/kernel",
    "state/param_states/0/param_states/0/nu/dense/kernel",
    "state/param_states/0/param_states/0/nu/out/kernel",
    "state/param_states/0/step",
    "state/param_states/1/param_states/0/trace/dense/bias",
    "state/param_states/1/param_states/0/trace/out/bias",
    "state/param_states/1/step",
    "state/step",
  ]
  assert "target/embed/embedding" in flat


@pytest.mark.parametrize("container", [dict, FrozenDict], ids=["dict", "frozendict"])
def test_state_dict_round_trip_through_flat_checkpoint(container: type) -> None:
  opt = stepped(container)
  flat = traverse_util.flatten_dict(opt.state_dict(), sep="/")
  checkpoint = traverse_util.unflatten_dict({k: np.asarray(v) for k, v in flat.items()}, sep="/")
  fresh = opt.optimizer_def.create(make_params(container))
  restored = fresh.restore_state(checkpoint)
  assert_trees_equal(restored, opt)
  grads = fake_grads(opt.target, STEPS)
  assert_trees_equal(restored.apply_gradient(grads), opt.apply_gradient(grads))


def set_in(tree: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
  *parents, last = path.split("/")
  node = tree
  for key in parents:
    node = node[key]
  node[last] = value
  return tree


def delete_in(tree: dict[str, Any], path: str) -> dict[str, Any]:
  *parents, last = path.split("/")
  node = tree
  for key in parents:
    node = node[key]
  del node[last]
  return tree


ADAM_MU = "state/param_states/0/param_states/0/mu/dense/kernel"


@pytest.mark.parametrize(
  "corrupt, message",
  [
    (
      lambda sd: set_in(sd, ADAM_MU, np.ones(3)),
      rf"Shape mismatch at '{ADAM_MU}': the "
      r"optimizer has shape \(4, 8\), the state dict has shape \(3,\)",
    ),
    (
      lambda sd: delete_in(sd, "state/param_states/1"),
      r"Missing key 'state/param_states/1' in the state dict",
    ),
    (
      lambda sd: set_in(sd, "state/param_states/0/extra", np.ones(2)),
      r"Unexpected keys \['extra'\] at 'state/param_states/0'",
    ),
    (
      lambda sd: set_in(sd, "target/embed/embedding", np.ones((6, 5))),
      r"Shape mismatch at 'target/embed/embedding'.*\(6, 4\).*\(6, 5\)",
    ),
    (
      lambda sd: set_in(sd, "state/param_states/1/step", np.float32(1.5)),
      r"Dtype mismatch at 'state/param_states/1/step': the state dict has float32",
    ),
  ],
  ids=["shape", "missing_sub", "unexpected", "target", "dtype"],
)
def test_restore_errors_name_path_and_leave_optimizer_untouched(corrupt, message) -> None:
  opt = stepped()
  before = jax.tree.map(np.asarray, opt)
  state_dict = jax.tree.map(np.asarray, opt.state_dict())
  with pytest.raises(ValueError, match=message):
    opt.restore_state(corrupt(state_dict))
  assert_trees_equal(opt, before)


@pytest.mark.parametrize(
  "pairs, message",
  [
    (
      [(KERNELS, "adam"), ("^dense/", "sgd")],
      r"1 params are selected by more than one filter: dense/kernel \(filters \[0, 1\]\)",
    ),
  ],
  ids=["overlap"],
)
def test_filter_errors(pairs: list[tuple[Any, str]], message: str) -> None:
  txs = {"adam": OptaxWrapper(optax.adam(1e-2)), "sgd": OptaxWrapper(optax.sgd(0.1))}
  opt_def = MultiOptimizer([(traversal, txs[name]) for traversal, name in pairs])
  with pytest.raises(ValueError, match=message):
    opt_def.create(make_params())


def test_filter_matching_nothing_is_allowed_with_a_warning() -> None:
  opt_def = MultiOptimizer(
    [(KERNELS, OptaxWrapper(optax.adam(1e-2))), ("nothing", OptaxWrapper(optax.adam(1e-2)))]
  )
  with pytest.warns(
    UserWarning,
    match=r"filter 1 PathFilter\('nothing'\) selects no params, so its optimizer gets an "
    r"empty tree; the params are dense/bias, dense/kernel, embed/embedding, out/bias, "
    r"out/kernel\.",
  ):
    opt = run_multi(opt_def, make_params())
  assert opt.state.param_states[1].param_states[0].mu == {}
  with pytest.warns(UserWarning) as caught:  # no params at all: it said "the params are ."
    opt_def.create({})
  assert [str(w.message).split("; ")[-1] for w in caught] == ["the params tree is empty."] * 2


@pytest.mark.parametrize("mode", ["8bit", "4bit", "bfloat16"])
@pytest.mark.parametrize("container", [dict, flax.core.FrozenDict], ids=["dict", "frozen"])
def test_a_low_precision_optimizer_of_a_filter_matching_nothing_gets_an_empty_state(
  mode, container
) -> None:
  """Its empty tree was taken for params that are one array: `create` failed with a bare
  KeyError 'p' after the warning that promised an empty tree."""
  compressed = OptaxWrapper(low_precision(optax.adam(1e-2), mode, min_size=0))
  opt_def = MultiOptimizer([(KERNELS, OptaxWrapper(optax.adam(1e-2))), ("nothing", compressed)])
  with pytest.warns(UserWarning, match="selects no params"):
    opt = run_multi(opt_def, container(make_params()))
  adam = opt.state.param_states[1].param_states.inner_state[0]
  assert jax.tree.leaves((adam.mu, adam.nu)) == []


@pytest.mark.parametrize(
  "make, error, message",
  [
    (lambda: MultiOptimizer([]), ValueError, "at least one"),
    (lambda: MultiOptimizer([(KERNELS, optax.adam(1e-2))]), TypeError, "OptaxWrapper"),
    (lambda: MultiOptimizer([(3, OptaxWrapper(optax.sgd(1.0)))]), TypeError, "Traversal 0"),
    (lambda: PathFilter("("), ValueError, "invalid regex"),
    (lambda: PathFilter([]), ValueError, "at least one pattern"),
    (
      lambda: MultiOptimizer([(KERNELS, OptaxWrapper(optax.sgd(1.0)))]).create(
        {"layers": [{"kernel": jnp.ones(2)}]}
      ),
      TypeError,
      "nested dicts or FrozenDicts; found a list at 'layers'",
    ),
  ],
  ids=["no_pairs", "raw_optax", "bad_traversal", "bad_regex", "no_patterns", "list_params"],
)
def test_construction_errors(make: Callable[[], Any], error: type, message: str) -> None:
  with pytest.raises(error, match=re.escape(message)):
    make()


@pytest.mark.parametrize(
  "patterns, invert, path, expected",
  [
    ("kernel$", False, "dense/kernel", True),
    ("kernel$", False, "dense/kernel_scale", False),
    (["^out/", "bias"], False, "dense/bias", True),
    (["^out/", "bias"], False, "dense/kernel", False),
    ("^dense/", True, "dense/kernel", False),
    ("^dense/", True, "out/kernel", True),
  ],
)
def test_path_filter(patterns: Any, invert: bool, path: str, expected: bool) -> None:
  assert PathFilter(patterns, invert=invert).matches(path) is expected


def test_path_filter_equality_and_repr() -> None:
  assert PathFilter("a") == PathFilter(["a"]) != PathFilter("a", invert=True)
  assert hash(PathFilter("a")) == hash(PathFilter(["a"]))
  assert repr(PathFilter(["a", "b"], invert=True)) == "PathFilter(['a', 'b'], invert=True)"


def model_param_traversal(filter_fn: Callable[[str, Any], bool]) -> Any:
  with pytest.warns(DeprecationWarning, match="deprecated"):
    return traverse_util.ModelParamTraversal(filter_fn)


@pytest.mark.parametrize(
  "filter_fn, equivalent",
  [
    (lambda path, _: path.endswith("kernel"), KERNELS),
    (lambda _, value: value.ndim == 2, PathFilter(["kernel$", "embedding$"])),
  ],
  ids=["path", "value"],
)
@pytest.mark.parametrize("container", [dict, FrozenDict], ids=["dict", "frozendict"])
@pytest.mark.slow
def test_model_param_traversal(filter_fn, equivalent: PathFilter, container: type) -> None:
  def make_def(traversal: Any) -> MultiOptimizer:
    return MultiOptimizer(
      [
        (traversal, OptaxWrapper(optax.adam(1e-2))),
        (BIASES, OptaxWrapper(optax.sgd(0.1))),
      ]
    )

  params = make_params(container)
  actual = run_multi(make_def(model_param_traversal(filter_fn)), params)
  expected = run_multi(make_def(equivalent), params)
  assert_trees_equal((actual.target, actual.state), (expected.target, expected.state))


class CountingFilter(PathFilter):
  """A PathFilter that counts the paths it is asked about."""

  calls = 0

  def matches(self, path: str) -> bool:
    CountingFilter.calls += 1
    return super().matches(path)


def test_partition_computed_once_per_tree_structure() -> None:
  CountingFilter.calls = 0
  opt_def = MultiOptimizer(
    [
      (CountingFilter("kernel$"), OptaxWrapper(optax.sgd(0.1))),
      (BIASES, OptaxWrapper(optax.sgd(0.1))),
    ]
  )
  params = make_params()
  opt = opt_def.create(params)
  for i in range(2):
    opt = opt.apply_gradient(fake_grads(opt.target, i))
  opt = run_multi(opt_def, params)
  assert CountingFilter.calls == len(jax.tree.leaves(params))
  opt_def.create(make_params(FrozenDict))
  assert CountingFilter.calls == 2 * len(jax.tree.leaves(params))


def test_grads_structure_error_names_paths() -> None:
  opt = stepped()
  grads = {**fake_grads(opt.target, 0), "extra": {"w": jnp.ones(2)}}
  message = "The grads do not fit the params: paths only in the grads: ['extra/w']"
  with pytest.raises(ValueError, match=re.escape(message)):
    opt.apply_gradient(grads)


@pytest.mark.parametrize(
  "axes_form",
  [
    lambda: AXES,
    lambda: FrozenDict(AXES),
    lambda: jax.tree.map(lambda s: tuple(s), AXES, is_leaf=lambda x: isinstance(x, P)),
  ],
  ids=["specs", "frozendict", "name_tuples"],
)
def test_derive_logical_axes(axes_form: Callable[[], Any]) -> None:
  opt = stepped(FrozenDict)
  derived = opt.optimizer_def.derive_logical_axes(opt, axes_form())
  adam_state, sgd_state = derived.state.param_states
  assert derived.state.step is None and adam_state.step is None
  assert flax.core.unfreeze(derived.target) == {**AXES, "out": {**AXES["out"]}}
  kernel_axes = {"dense": {"kernel": P("embed", "mlp")}, "out": {"kernel": P("mlp", "embed")}}
  assert flax.core.unfreeze(adam_state.param_states[0].mu) == kernel_axes
  assert flax.core.unfreeze(adam_state.param_states[0].nu) == kernel_axes
  assert adam_state.param_states[0].count is None
  bias_trace = sgd_state.param_states[0].trace
  assert flax.core.unfreeze(bias_trace) == {"dense": {"bias": P("mlp")}, "out": {"bias": None}}


def test_set_param_axes_forwarded_only_where_defined() -> None:
  optax_only = MultiOptimizer([(KERNELS, OptaxWrapper(optax.sgd(0.1)))])
  assert not hasattr(optax_only, "set_param_axes")
  plain = PlainSgd(0.1)
  inner = MultiOptimizer([(KERNELS, plain), (BIASES, OptaxWrapper(optax.sgd(0.1)))])
  outer = MultiOptimizer([("^dense/", inner), ("^out/", OptaxWrapper(optax.sgd(0.1)))])
  outer.set_param_axes(AXES)
  assert plain.param_axes == [{"dense": {"kernel": P("embed", "mlp")}}]


def test_a_definition_that_takes_axes_shared_by_two_filters_is_refused() -> None:
  """Each filter's axes would replace the other's in the one definition."""
  muon = optimizers.muon(learning_rate=0.02)
  flat = MultiOptimizer(
    [(KERNELS, muon), (BIASES, OptaxWrapper(optax.sgd(0.1))), ("^embed/", muon)]
  )
  nested = MultiOptimizer([("^dense/", MultiOptimizer([(KERNELS, muon)])), ("^out/", muon)])
  for multi, first, second in [
    (flat, "filter 0 PathFilter('kernel$')", "filter 2 PathFilter('^embed/')"),
    (
      nested,
      "filter 0 PathFilter('^dense/') / filter 0 PathFilter('kernel$')",
      "filter 1 PathFilter('^out/')",
    ),
  ]:
    with pytest.raises(ValueError, match=re.escape(f"{first} and {second} share one")):
      multi.set_param_axes(AXES)
    with pytest.raises(ValueError, match="one definition per filter"):
      multi.set_param_axes(AXES)


@pytest.mark.parametrize("copier", [copy.copy, copy.deepcopy], ids=["copy", "deepcopy"])
def test_a_copy_takes_axes_without_changing_its_original(copier) -> None:
  """A shallow copy shared its original's sub-optimizers (and its set_param_axes was the
  original's): axes given to the copy placed the original's Muon params."""
  params = {"enc": {"a": jnp.ones((8, 4)), "b": jnp.ones((4, 8))}}
  axes = {"enc": {"a": P("embed", "mlp"), "b": P("vocab", "embed")}, "dec": {"w": P("embed")}}
  other = {"enc": {"a": P("vocab", "embed"), "b": P("embed", "mlp")}, "dec": {"w": P("embed")}}
  muon = optimizers.muon(learning_rate=0.02)
  inner = MultiOptimizer([("^enc/", muon)])
  multi = MultiOptimizer([("^enc/", inner), ("^dec/", optimizers.adamw(1e-3))])
  multi.set_param_axes(axes)
  placed = muon.describe_params(params)
  copied = copier(multi)
  copied.set_param_axes(other)
  assert muon.describe_params(params) == placed
  copied_muon = copied.sub_optimizers[0].sub_optimizers[0]
  assert copied_muon is not muon
  assert copied_muon.describe_params(params)[0] == "enc/a ('vocab', 'embed'): adam"
  multi.create({**params, "dec": {"w": jnp.ones(4)}})
  copied.set_param_axes(axes)


GIN_CONFIG = """
from __gin__ import dynamic_registration
from t5x_optim import optimizers

OPTIMIZER = @optimizers.MultiOptimizer()
optimizers.MultiOptimizer:
  traversals_and_optimizers = [
      (@kernels/optimizers.PathFilter(), @optimizers.adam()),
      (@biases/optimizers.PathFilter(), @optimizers.sgd()),
  ]
kernels/optimizers.PathFilter.patterns = 'kernel$'
biases/optimizers.PathFilter:
  patterns = ['kernel$', '^embed/']
  invert = True
optimizers.adam.learning_rate = 1e-2
optimizers.sgd.learning_rate = 0.1
BUILT = %OPTIMIZER
"""


@pytest.mark.usefixtures("clean_gin")
def test_gin_configures_multi_optimizer_and_path_filters() -> None:
  gin.parse_config(GIN_CONFIG)
  with gin.config_scope(None):
    opt_def = gin.query_parameter("%BUILT").scoped_configurable_fn()
  biases = PathFilter(["kernel$", "^embed/"], invert=True)
  assert opt_def.traversals == (KERNELS, biases)
  reference = MultiOptimizer(
    [
      (KERNELS, OptaxWrapper(optax.adam(1e-2))),
      (BIASES, OptaxWrapper(optax.sgd(0.1))),
    ]
  )
  actual, expected = run_multi(opt_def, make_params()), run_multi(reference, make_params())
  assert_trees_equal((actual.target, actual.state), (expected.target, expected.state))


class Mlp(nn.Module):
  """A tiny MLP with logically partitioned params."""

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    init = nn.initializers.lecun_normal()
    for name, features, axes in (("dense", 16, ("embed", "mlp")), ("out", 8, ("mlp", "embed"))):
      x = nn.Dense(
        features,
        name=name,
        kernel_init=nn.with_logical_partitioning(init, axes),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, axes[1:]),
      )(x)
      x = nn.tanh(x) if name == "dense" else x
    return x


def train(state: TrainState, step_fn: Callable[..., Any], batches: list[Any]) -> tuple[Any, ...]:
  losses = []
  for batch in batches:
    state, loss = step_fn(state, batch)
    losses.append(float(loss))
  return state, losses


@pytest.mark.slow
def test_sharded_training_through_train_state_and_partitioner() -> None:
  model = Mlp()
  x = jax.random.normal(jax.random.key(1), (16, 8))
  batches = [(x, jnp.roll(x, i, axis=1)) for i in range(STEPS)]
  opt_def = MultiOptimizer(
    [
      (KERNELS, OptaxWrapper(optax.adamw(1e-2))),
      (PathFilter("^dense/bias$"), OptaxWrapper(optax.sgd(0.1, momentum=0.9))),
    ]
  )
  state = TrainState.create(opt_def, model.init(jax.random.key(0), x))

  def step(state: TrainState, batch: tuple[jax.Array, jax.Array]) -> tuple[TrainState, jax.Array]:
    inputs, targets = batch

    def loss_fn(params):
      return jnp.mean((model.apply({"params": params}, inputs) - targets) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradient(grads, learning_rate=None), loss

  partitioner = Partitioner(create_mesh(shape={"data": 2, "model": 4}))
  shardings = partitioner.get_shardings(state)
  sharded_step = partitioner.partition(step, (shardings, P("batch")), (shardings, None))
  sharded_state = jax.device_put(state, shardings)
  sharded_state, sharded_losses = train(sharded_state, sharded_step, batches)
  final, losses = train(state, jax.jit(step), batches)

  np.testing.assert_allclose(sharded_losses, losses, rtol=1e-6)
  for actual, expected in zip(jax.tree.leaves(sharded_state), jax.tree.leaves(final)):
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)
  for actual, sharding in zip(jax.tree.leaves(sharded_state), jax.tree.leaves(shardings)):
    assert actual.sharding.is_equivalent_to(sharding, actual.ndim)

  adam_state, sgd_state = shardings.param_states
  assert adam_state.param_states[0].mu["dense"]["kernel"].spec == P(None, "model")
  assert adam_state.param_states[0].nu["out"]["kernel"].spec == P("model", None)
  assert sgd_state.param_states[0].trace["dense"]["bias"].spec == P("model")
  assert shardings.params["out"]["bias"].is_fully_replicated
  assert np.array_equal(sharded_state.params["out"]["bias"], state.params["out"]["bias"])


def test_describe_params_names_each_params_sub_optimizer_and_muon_placement():
  """`t5x-optim plan` lists a MultiOptimizer's params: Muon's placement inside its subset."""
  import optax  # noqa: PLC0415
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415

  from t5x_optim import optimizers  # noqa: PLC0415

  params = {
    "body": {"kernel": jnp.ones((4, 6)), "scale": jnp.ones(4)},
    "embed": {"embedding": jnp.ones((10, 4))},
    "head": {"kernel": jnp.ones((4, 3))},
  }
  axes = {
    "body": {"kernel": P("embed", "mlp"), "scale": P("embed")},
    "embed": {"embedding": P("vocab", "embed")},
    "head": {"kernel": P("embed", "classes")},
  }
  opt_def = optimizers.MultiOptimizer(
    [
      (optimizers.PathFilter("^(body|embed)/"), optimizers.muon(learning_rate=0.02)),
      (optimizers.PathFilter("^head/"), optimizers.OptaxWrapper(optax.sgd(0.1))),
    ]
  )
  opt_def.set_param_axes(axes)
  assert opt_def.describe_params(params) == [
    "body/kernel ('embed', 'mlp'): muon, inputs ('embed',), outputs ('mlp',) "
    "[filter 0 PathFilter('^(body|embed)/')]",
    "body/scale ('embed',): adam [filter 0 PathFilter('^(body|embed)/')]",
    "embed/embedding ('vocab', 'embed'): adam [filter 0 PathFilter('^(body|embed)/')]",
    "head/kernel: OptaxWrapper [filter 1 PathFilter('^head/')]",
  ]


def test_describe_params_lists_frozen_params_and_those_of_a_nested_multi_optimizer():
  """One line per param: a param no filter selects is frozen, and a nested MultiOptimizer's
  params are named by its own filters and sub-optimizers (Muon's placement included); the
  frozen ones were left out and a nested MultiOptimizer was named by its class."""
  from t5x_optim import optimizers  # noqa: PLC0415

  params = {
    "body": {"kernel": jnp.ones((4, 6))},
    "embed": {"embedding": jnp.ones((10, 4))},
    "head": {"kernel": jnp.ones((4, 3)), "bias": jnp.ones(3)},
  }
  axes = {
    "body": {"kernel": P("embed", "mlp")},
    "embed": {"embedding": P("vocab", "embed")},
    "head": {"kernel": P("embed", "mlp"), "bias": P("mlp")},
  }
  head = optimizers.MultiOptimizer([("kernel$", optimizers.muon(learning_rate=0.02))])
  opt_def = optimizers.MultiOptimizer(
    [("^body/", optimizers.OptaxWrapper(optax.sgd(0.1))), ("^head/", head)]
  )
  opt_def.set_param_axes(axes)
  assert opt_def.describe_params(params) == [
    "body/kernel: OptaxWrapper [filter 0 PathFilter('^body/')]",
    "embed/embedding: frozen [no filter]",
    "head/bias: frozen [no filter] [filter 1 PathFilter('^head/')]",
    "head/kernel ('embed', 'mlp'): muon, inputs ('embed',), outputs ('mlp',) "
    "[filter 0 PathFilter('kernel$')] [filter 1 PathFilter('^head/')]",
  ]
