"""`t5x-optim train --init_from DIR`: a new run from another run's checkpoint, another optimizer."""

from __future__ import annotations

import inspect
import pathlib
import re
import shutil
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import t5x_optim
from t5x_optim import Checkpointer
from t5x_optim._convert.convert import _state_paths
from t5x_optim.cli import _init_from, main
from t5x_optim.cli._t5x_config import optimizer_config
from t5x_optim.cli.loop import config as _config
from t5x_optim.cli.loop import train as _train

pytestmark = pytest.mark.usefixtures("clean_gin", "run_compilation_cache")

TINY = ["--gin_file", "examples/tiny.gin"]
ADAFACTOR = [*TINY, "--gin_file", "optimizers/adafactor.gin"]


def _params(model_dir, flags):
  _config.parse_config(gin_files=flags[1::2], macros=_config.device_macros(8))
  setup = _train.prepare(_config.build_job())
  with Checkpointer(model_dir / "checkpoints") as checkpointer:
    step = checkpointer.latest_step()
    return step, checkpointer.restore(setup.abstract_state, step)


@pytest.mark.slow
@pytest.mark.parametrize("source_flags", [[], ["--init_from_gin", "optimizers/adafactor.gin"]])
def test_init_from_converts_another_runs_adafactor_state_into_adamw(source_flags, tmp_path, capsys):
  old_dir, new_dir = tmp_path / "old", tmp_path / "new"
  adafactor = [*TINY, "--gin_file", "optimizers/adafactor.gin"]
  assert (
    main(["train", *adafactor, "--gin_bindings", "TOTAL_STEPS = 3", "--model_dir", str(old_dir)])
    == 0
  )
  capsys.readouterr()
  flags = ["--init_from", str(old_dir), *source_flags, "--model_dir", str(new_dir)]
  adamw = [*TINY, "--gin_file", "optimizers/adamw.gin"]
  assert main(["train", *adamw, "--gin_bindings", "TOTAL_STEPS = 5", *flags]) == 0
  out = capsys.readouterr().out
  assert f"init_from:       {old_dir} at step 3" in out
  # The new optimizer's b1 and b2 come from its gin file (optimizers/adamw.gin binds them).
  assert (
    "hparams: old learning_rate=a schedule, multiply_by_parameter_scale=False, "
    "new b1=0.9, b2=0.98, learning_rate=a schedule\n"
  ) in out, out
  assert re.search(r"ScaleByAdamState\)\.nu: \d+ params, from 0 \(FactoredState\)", out), out
  assert re.search(r"^steps 3 -> 5,", out, re.M), out
  step, old = _params(old_dir, ADAFACTOR)
  assert step == 3
  # The new run's first checkpoint is its last step; its adamw count went on from 3.
  _, new = _params(new_dir, TINY)
  assert int(new.param_states[1][0].count) == 5
  assert jax.tree.structure(new.params) == jax.tree.structure(old.params)
  assert not all(
    np.array_equal(a, b) for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(old.params))
  )  # it trained on from there


@pytest.mark.slow
def test_init_from_decodes_an_8bit_runs_state(tmp_path, capsys, monkeypatch):
  """adamw_8bit (every leaf 8-bit) -> adamw with another b2: mu and nu of every param, not of
  codes and scales (with the same settings the state goes over as it is, decoded).

  Both directories are named relative to the working directory, as on a shell.
  """
  monkeypatch.chdir(tmp_path)
  old_dir, new_dir = tmp_path / "old", tmp_path / "new"
  eight_bit = [*TINY, "--gin_file", "optimizers/adamw_8bit.gin"]
  eight_bit += ["--gin_bindings", "optimizers.low_precision.min_size = 0"]
  total = ["--gin_bindings", "TOTAL_STEPS = 3"]
  assert main(["train", *eight_bit, *total, "--model_dir", "old"]) == 0
  capsys.readouterr()
  adamw = [*TINY, "--gin_file", "optimizers/adamw.gin"]
  flags = ["--init_from", "old", "--model_dir", "new"]
  other = ["--gin_bindings", "optax.adamw.b2 = 0.95"]
  assert main(["train", *adamw, *other, "--gin_bindings", "TOTAL_STEPS = 4", *flags]) == 0
  out = capsys.readouterr().out
  assert f"init_from:       {old_dir} at step 3" in out, out
  _, new = _params(new_dir, adamw)
  count = len(jax.tree.leaves(new.params))
  for field in ("mu", "nu"):
    line = (
      f"1/0 (ScaleByAdamState).{field}: {count} params, from 1/inner_state/0 (ScaleByAdamState)"
    )
    assert line in out, out
  assert "initialised (0):" in out, out


@pytest.mark.slow
def test_init_from_gin_of_another_optimizer_names_both(tmp_path, capsys):
  """--init_from_gin with the gin file of an optimizer that did not write the checkpoint gave
  a 40-key list of missing and unexpected keys that never named --init_from_gin."""
  old, new = str(tmp_path / "old"), str(tmp_path / "new")
  assert main(["train", *TINY, "--gin_bindings", "TOTAL_STEPS = 2", "--model_dir", old]) == 0
  capsys.readouterr()
  flags = ["--init_from", old, "--init_from_gin", "optimizers/lion.gin", "--model_dir", new]
  assert main(["train", *TINY, "--gin_bindings", "TOTAL_STEPS = 3", *flags]) == 2
  err = capsys.readouterr().err
  assert len(err) < 600 and len(err.splitlines()) == 1, err
  assert (
    f"--init_from {old}: checkpoint step 2 was written by optimizers.chain(transformations="
    "[optax.clip_by_global_norm, optax.adamw]), and --init_from_gin optimizers/lion.gin builds "
    "optimizers.lion: give the gin files of the optimizer that wrote it"
  ) in err, err


@pytest.mark.slow
def test_init_from_gin_of_the_same_optimizer_laid_out_otherwise_says_so_briefly(tmp_path, capsys):
  """--init_from_gin with the shipped 8-bit file, the run having compressed every leaf
  (min_size 0): one line of 7,704 characters, every missing and unexpected key, that never
  named --init_from_gin or the settings."""
  old, new = str(tmp_path / "old"), str(tmp_path / "new")
  every_leaf = ["--gin_file", "optimizers/adamw_8bit.gin"]
  every_leaf += ["--gin_bindings", "optimizers.low_precision.min_size = 0"]
  steps = ["--gin_bindings", "TOTAL_STEPS = 2", "--model_dir", old]
  assert main(["train", *TINY, *every_leaf, *steps]) == 0
  capsys.readouterr()
  flags = ["--init_from", old, "--init_from_gin", "optimizers/adamw_8bit.gin", "--model_dir", new]
  assert main(["train", *TINY, "--gin_bindings", "TOTAL_STEPS = 3", *flags]) == 2
  err = capsys.readouterr().err
  assert len(err) < 2500 and len(err.splitlines()) == 1, err
  assert re.search(r"; and \d+ more \(\d+ missing keys, \d+ unexpected keys\)", err), err
  assert (
    "--init_from_gin optimizers/adamw_8bit.gin builds the optimizer the run names, with a state "
    "laid out otherwise: give the settings the run had (e.g. low_precision's min_size"
  ) in err, err


@pytest.mark.slow
def test_init_from_into_injected_hyperparams(tmp_path, capsys):
  """The new optimizer's injected b1 and b2 (replicated on the mesh) met the count of the
  restored step on one device: "Received incompatible devices for jitted computation"."""
  old, new = str(tmp_path / "old"), str(tmp_path / "new")
  assert main(["train", *TINY, "--gin_bindings", "TOTAL_STEPS = 2", "--model_dir", old]) == 0
  injected = [*TINY, "--gin_file", "optimizers/inject_hyperparams.gin"]
  flags = ["--gin_bindings", "TOTAL_STEPS = 3", "--init_from", old, "--model_dir", new]
  assert main(["train", *injected, *flags]) == 0, capsys.readouterr().err
  out = capsys.readouterr().out
  assert re.search(r"\(ScaleByAdamState\)\.nu: \d+ params, from ", out), out
  assert re.search(r"^steps 2 -> 3,", out, re.M), out


@pytest.mark.slow
def test_init_from_lookahead_into_muon_and_back(tmp_path, capsys):
  """Lookahead checkpoints two copies of the params, and Muon's state follows the params'
  logical axes (the embeddings run Adam): both were refused as not fitting the optimizer
  built from the source's config. The new run takes the slow copy and says so."""
  lookahead = [*TINY, "--gin_file", "optimizers/lookahead.gin"]
  muon = [*TINY, "--gin_file", "optimizers/muon.gin"]
  dirs = [str(tmp_path / name) for name in ("lookahead", "muon", "back")]
  assert (
    main(["train", *lookahead, "--gin_bindings", "TOTAL_STEPS = 2", "--model_dir", dirs[0]]) == 0
  )
  capsys.readouterr()

  def init_from(source: int, flags: list[str], steps: int) -> str:
    total = ["--gin_bindings", f"TOTAL_STEPS = {steps}"]
    places = ["--init_from", dirs[source], "--model_dir", dirs[source + 1]]
    assert main(["train", *flags, *total, *places]) == 0
    out = capsys.readouterr().out
    assert f"init_from:       {dirs[source]} at step {steps - 1}" in out, out
    return out

  out = init_from(0, muon, 3)
  assert re.search(
    r"inner_states/muon/inner_state/0 \(MuonState\)\.mu: \d+ params, from fast_state/0", out
  ), out
  assert (
    "  dropped (2):\n    target/fast (optax.LookaheadParams.fast): the new optimizer trains one "
    "copy of the params, the slow one (lookahead's params for evaluation)\n"
    "    fast_state/0 (ScaleByAdamState): nu of 6 params, not used by the new optimizer "
    "(e.g. layers_0/attention/key)\n"
  ) in out, out
  out = init_from(1, lookahead, 4)
  assert re.search(
    r"fast_state/0 \(ScaleByAdamState\)\.nu: \d+ params, from inner_states/adam/", out
  ), out
  assert "fast_state/0 (ScaleByAdamState).mu (carried only with nu):" in out, out


def test_bound_hparams_evaluate_macros_and_schedules():
  """adafactor.gin binds learning_rate = %LEARNING_RATE = @optax.linear_schedule().

  Only what its OPTIMIZER reaches counts: the default config's adamw, and a b1 bound to
  it here, are another optimizer's.
  """
  _config.parse_config(
    gin_files=["optimizers/adafactor.gin"],
    gin_bindings=["TOTAL_STEPS = 10", "M = 0.8", "optimizers.adafactor.momentum = %M"]
    + ["optax.adamw.b1 = 0.5"],
    macros=_config.device_macros(8),
  )
  hparams = _init_from.bound_hparams()
  assert sorted(hparams) == ["learning_rate", "momentum", "multiply_by_parameter_scale"]
  assert hparams["momentum"] == 0.8 and hparams["multiply_by_parameter_scale"] is False
  np.testing.assert_allclose([hparams["learning_rate"](s) for s in (0, 10)], [1e-2, 1e-3])


def test_bound_hparams_are_those_gin_builds_the_optimizer_with():
  """``%OPTIMIZER`` is built in the scope OPTIMIZER, a scoped reference in its own: their
  bindings win over the unscoped ones, which an operative config also holds."""
  _config.parse_config(
    gin_bindings=["optax.adamw.b2 = 0.999", "OPTIMIZER/optax.adamw.b2 = 0.95"]
    + ["other/optax.adamw.b1 = 0.5"],
    macros=_config.device_macros(8),
  )
  assert _init_from.bound_hparams()["b2"] == 0.95
  assert "b1" not in _init_from.bound_hparams()
  _config.parse_config(
    gin_bindings=["optimizers.chain.transformations = [@fast/optax.adamw()]"]
    + ["optax.adamw.b1 = 0.7", "fast/optax.adamw.b1 = 0.5", "OPTIMIZER/optax.adamw.b1 = 0.6"],
    macros=_config.device_macros(8),
  )
  assert _init_from.bound_hparams()["b1"] == 0.5
  _config.parse_config(  # One macro, called from two scopes: one schedule.
    gin_bindings=["optimizers.chain.transformations = [@a/optax.adamw(), @b/optax.adamw()]"],
    macros=_config.device_macros(8),
  )
  assert callable(_init_from.bound_hparams()["learning_rate"])


def test_bound_hparams_read_the_optimizers_in_a_dict():
  """``optax.multi_transform.transforms = {...}``: the optimizers' bindings were not read, so
  a conversion into it used optax's defaults (b2 0.999, momentum 0.9)."""
  _config.parse_config(
    gin_bindings=[
      "OPTIMIZER = @optimizers.OptaxWrapper()",
      "optimizers.OptaxWrapper.optax_optimizer = @optax.multi_transform()",
      "optax.multi_transform.transforms = {'x': @a/optax.adam(), 'y': @optax.sgd()}",
      "optax.multi_transform.param_labels = {'w': 'x'}",
      "a/optax.adam.b2 = 0.95",
      "optax.adam.learning_rate = 1e-3",
      "optax.sgd.learning_rate = 1e-3",
      "optax.sgd.momentum = 0.5",
    ],
    macros=_config.device_macros(8),
  )
  assert _init_from.bound_hparams() == {"b2": 0.95, "learning_rate": 1e-3, "momentum": 0.5}


def test_bound_hparams_read_muons_beta_and_the_b1_and_b2_of_its_adam():
  """muon.gin binds beta and adam_b2 = 0.98: a conversion from a muon run read its Adam's
  second moment with optax's b2 0.999 and its momentum with the default beta."""
  _config.parse_config(
    gin_files=["optimizers/muon.gin"],
    gin_bindings=["optimizers.muon.beta = 0.9", "optimizers.muon.adam_b1 = 0.85"],
    macros=_config.device_macros(8),
  )
  hparams = _init_from.bound_hparams()
  assert {k: hparams[k] for k in ("beta", "b1", "b2")} == {"beta": 0.9, "b1": 0.85, "b2": 0.98}
  assert _init_from.CONVERSION_HPARAMS == t5x_optim.BUILTIN_HPARAMS


_GROUPS_OF_TWO_B2 = [
  "OPTIMIZER = @optimizers.MultiOptimizer()",
  "optimizers.MultiOptimizer.traversals_and_optimizers = ["
  "(@matrices/optimizers.PathFilter(), @k/optimizers.adam()), "
  "(@scales/optimizers.PathFilter(), @s/optimizers.adam())]",
  "matrices/optimizers.PathFilter.patterns = 'scale$'",
  "matrices/optimizers.PathFilter.invert = True",
  "scales/optimizers.PathFilter.patterns = 'scale$'",
  "optimizers.adam.learning_rate = 0.01",
  "k/optimizers.adam.b2 = 0.95",
  "s/optimizers.adam.b2 = 0.98",
]
"""A `MultiOptimizer` of two Adam groups, each with its own ``b2``."""


def test_bound_hparams_of_groups_bound_otherwise_are_several_values():
  """Two groups' b2 (0.95, 0.98) were left out, so a conversion read the groups' second
  moments with optax's 0.999; one group's bound and the other's left to optax's default was
  taken for both. They are `SeveralValues`, each with its scope and binding, and with the
  `MultiOptimizer` group it is the value of, where that is told."""
  _config.parse_config(gin_bindings=_GROUPS_OF_TWO_B2, macros=_config.device_macros(8))
  hparams = _init_from.bound_hparams()
  assert hparams["learning_rate"] == 0.01
  groups = (("0/param_states",), ("1/param_states",))
  assert hparams["b2"] == t5x_optim.SeveralValues((0.95, 0.98), ("k", "s"), at=groups)
  assert str(hparams["b2"]) == "0.95 (k/optimizers.adam.b2) or 0.98 (s/optimizers.adam.b2)"
  _config.parse_config(
    gin_bindings=_GROUPS_OF_TWO_B2[:-1], macros=_config.device_macros(8)
  )  # The scales' b2 left at optax's default: the kernels' 0.95 was taken for both.
  assert str(_init_from.bound_hparams()["b2"]) == (
    "0.95 (k/optimizers.adam.b2) or 0.999 (s/optimizers.adam.b2's default)"
  )
  _config.parse_config(  # Inside optax.apply_if_finite (not told before: refused).
    gin_bindings=[
      "optimizers.chain.transformations = [@optax.apply_if_finite(), @optax.scale_by_adam()]",
      "optax.apply_if_finite.inner = @a/optax.adam()",
      "optax.apply_if_finite.max_consecutive_errors = 3",
      "a/optax.adam.b2 = 0.95",
      "optax.scale_by_adam.b2 = 0.98",
    ],
    macros=_config.device_macros(8),
  )
  b2 = _init_from.bound_hparams()["b2"]
  assert (b2.value_at("0/inner_state/0"), b2.value_at("1")) == (0.95, 0.98)


def test_bound_hparams_of_partition_parts_convert_each_part_with_its_own():
  """The parts of an optax.partition in a chain, Adam with b2 0.95 and 0.98: each value is
  tied to its part's state path, and a conversion of that state reads each part's own."""
  _config.parse_config(
    gin_bindings=[
      "optimizers.chain.transformations = [@optax.clip(), @optax.multi_transform()]",
      "optax.clip.max_delta = 1.0",
      "optax.multi_transform.transforms = {'x': @a/optax.adam(), 'y': @b/optax.adam()}",
      "optax.adam.learning_rate = 0.01",
      "a/optax.adam.b2 = 0.95",
      "b/optax.adam.b2 = 0.98",
    ],
    macros=_config.device_macros(8),
  )
  b2 = _init_from.bound_hparams()["b2"]
  assert b2.at == (("1/inner_states/x",), ("1/inner_states/y",))
  parts = {"x": optax.adam(0.01, b2=0.95), "y": optax.adam(0.01, b2=0.98)}
  params = {"w": jnp.ones((4, 8)), "b": jnp.ones(8)}
  tx = optax.chain(optax.clip(1.0), optax.partition(parts, {"w": "x", "b": "y"}))
  old = t5x_optim.OptaxWrapper(tx).create(params)
  for scale in (1.0, -2.0, 0.5):
    old = old.apply_gradient(jax.tree.map(lambda p: scale * jnp.cos(p), params))  # noqa: B023
  new, _ = t5x_optim.convert_state(
    old,
    t5x_optim.OptaxWrapper(optax.adam(0.01, b2=0.95)),
    source_hparams={"b2": b2},
    target_hparams={"b2": 0.95},
  )
  olds = old.state.param_states[1].inner_states
  nu = new.state.param_states[0].nu
  np.testing.assert_allclose(nu["w"], olds["x"].inner_state[0].nu["w"], rtol=1e-6)
  scaled = olds["y"].inner_state[0].nu["b"] * (1 - 0.95**3) / (1 - 0.98**3)
  np.testing.assert_allclose(nu["b"], scaled, rtol=1e-5)


class _Marker(NamedTuple):
  tag: jax.Array


def _marker(tag: int) -> optax.GradientTransformation:
  """A transformation whose state is its tag alone, to be found in the state of what holds it."""
  return optax.GradientTransformation(
    lambda _: _Marker(jnp.int32(tag)), lambda u, s, _=None: (u, s)
  )


_LABELS = {"w": "x", "b": "y"}
_MAKE: dict[Any, Callable[[Callable[[int], Any]], tuple[Any, dict[str, tuple]]]] = {
  # Each builds the configurable with a marker (tag n) in each of its optimizer arguments, and
  # says where in that argument's value each tag is.
  t5x_optim.MultiOptimizer: lambda m: (
    t5x_optim.MultiOptimizer(
      [(t5x_optim.PathFilter(k), t5x_optim.OptaxWrapper(m(n))) for n, k in enumerate(_LABELS)]
    ),
    {"traversals_and_optimizers": ((0, 1), (1, 1))},
  ),
  t5x_optim.OptaxWrapper: lambda m: (t5x_optim.OptaxWrapper(m(0)), {"optax_optimizer": ((),)}),
  t5x_optim.chain: lambda m: (
    t5x_optim.chain([optax.clip(1.0), m(0), m(1)]),
    {"transformations": ((1,), (2,))},
  ),
  optax.partition: lambda m: (
    optax.partition({"x": m(0), "y": m(1)}, _LABELS),
    {"transforms": (("x",), ("y",))},
  ),
  t5x_optim.low_precision: lambda m: (t5x_optim.low_precision(m(0), "8bit"), {"inner": ((),)}),
  optax.MultiSteps: lambda m: (optax.MultiSteps(m(0), 2), {"opt": ((),)}),
  optax.masked: lambda m: (optax.masked(m(0), {"w": True, "b": False}), {"inner": ((),)}),
  optax.apply_if_finite: lambda m: (optax.apply_if_finite(m(0), 3), {"inner": ((),)}),
  optax.conditionally_mask: lambda m: (
    optax.conditionally_mask(m(0), lambda step: step > 2),
    {"inner": ((),)},
  ),
  optax.conditionally_transform: lambda m: (
    optax.conditionally_transform(m(0), lambda step: step > 2),
    {"inner": ((),)},
  ),
  optax.flatten: lambda m: (optax.flatten(m(0)), {"inner": ((),)}),
  optax.with_extra_args_support: lambda m: (optax.with_extra_args_support(m(0)), {"tx": ((),)}),
  optax.lookahead: lambda m: (optax.lookahead(m(0), 2, 0.5), {"fast_optimizer": ((),)}),
  optax.selective_transform: lambda m: (
    optax.selective_transform(m(0), freeze_mask={"w": False, "b": True}),
    {"optimizer": ((),)},
  ),
  optax.contrib.galore: lambda m: (
    optax.contrib.galore(0.1, base_optimizer=m(0)),
    {"base_optimizer": ((),)},
  ),
  optax.contrib.scale_by_galore: lambda m: (
    optax.contrib.scale_by_galore(base_optimizer=m(0)),
    {"base_optimizer": ((),)},
  ),
  optax.contrib.mechanize: lambda m: (optax.contrib.mechanize(m(0)), {"base_optimizer": ((),)}),
  optax.contrib.sam: lambda m: (
    optax.contrib.sam(m(0), m(1)),
    {"optimizer": ((),), "adv_optimizer": ((),)},
  ),
  optax.contrib.schedule_free: lambda m: (
    optax.contrib.schedule_free(m(0), 0.1),
    {"base_optimizer": ((),)},
  ),
  optax.contrib.split_real_and_imaginary: lambda m: (
    optax.contrib.split_real_and_imaginary(m(0)),
    {"inner": ((),)},
  ),
}
_NO_PATH = {
  # Arguments of an optimizer that the gin walk ties no value to, and why.
  (optax.chain, "args"): "gin binds no *args: a config chains with optimizers.chain",
  (optax.named_chain, "args"): "gin binds no *args",
  (optax.lbfgs, "linesearch"): "a line search: no converter reads a value of its state",
  (optax.contrib.sophia, "hessian_diagonal_fn"): "an estimator: no converter reads its values",
  (t5x_optim.with_param_axes, "opt_def"): "called in Python on a definition already made",
}


def _made_from_optimizers() -> set[tuple[Any, str]]:
  """(configurable, argument) for every optimizer of optax, optax.contrib and this package
  made from another one given as an argument (a transformation or an `OptimizerDef`; not a
  factory of one)."""
  kinds = ("GradientTransformation", "OptimizerDef")
  found = set()
  for module in (optax, optax.contrib, t5x_optim, t5x_optim.optimizers):
    for name in (name for name in dir(module) if not name.startswith("_")):
      function = getattr(module, name)
      try:
        signature = inspect.signature(function)
      except (TypeError, ValueError):
        continue
      if isinstance(function, type):
        makes = issubclass(function, t5x_optim.OptimizerDef) or hasattr(function, "update")
      else:
        makes = any(kind in str(signature.return_annotation) for kind in kinds)
      for parameter in signature.parameters.values() if makes else ():
        annotation = str(parameter.annotation)
        factory = re.match(r"(collections\.abc\.|typing\.)?Callable\[", annotation)
        if any(kind in annotation for kind in kinds) and not factory:
          found.add((function, parameter.name))
  return found


def test_every_optimizer_made_of_others_ties_their_values_to_their_states():
  """A value bound inside optax.apply_if_finite, lookahead, schedule_free (and the rest but
  masked, MultiSteps, partition) told no state, so one b2 of two there was refused. Every
  optimizer made of others (found in optax, optax.contrib and this package) has its
  arguments' state paths, each where the real state keeps that argument's state, or says
  why not."""
  params = {"w": jnp.ones((4, 6)), "b": jnp.ones(6)}
  untold = {(f, a) for f, a in _made_from_optimizers() if a not in _config.state_paths_of(f)}
  assert {(inspect.unwrap(f), a) for f, a in untold} == set(_NO_PATH)
  assert set(_MAKE) == set(_config._STATE_PATHS)
  for function, make in _MAKE.items():
    tags = iter(range(100))
    optimizer, where = make(lambda _: _marker(next(tags)))  # noqa: B023
    state = (
      optimizer.create(params).state.param_states
      if isinstance(optimizer, t5x_optim.OptimizerDef)
      else optimizer.init(
        optax.LookaheadParams(params, params) if function is optax.lookahead else params
      )
    )
    found_at = {
      int(node.tag): "/".join(path)
      for path, node in _state_paths(state)
      if isinstance(node, _Marker)
    }
    assert set(where) == set(_config._STATE_PATHS[function]), function
    tag = 0
    for argument, items in where.items():
      suffix, items_at = _config._STATE_PATHS[function][argument]
      for keys in items:
        at, inner = _config._under("", suffix), items_at
        for key in keys:
          at, inner = inner(at, key)
        # The tag's state is at `at` or under it, and no other tag's is.
        under = {n for n, path in found_at.items() if f"{path}/".startswith(f"{at}/".lstrip("/"))}
        assert under == {tag}, (function, argument, keys, at, found_at)
        tag += 1
    assert tag == len(found_at), function


@pytest.mark.slow
def test_init_from_groups_of_other_b2_converts_each_with_its_own(tmp_path, capsys):
  """Groups of Adam with b2 0.95 and 0.98 into one Adam with b2 0.95: the groups' b2 were
  left to optax's 0.999, and the kernels' second moments came out 32 times too large after
  20 steps (0.999 against 0.95 in the bias correction), without a word. Each group's state
  converts with its own b2; into the same groups, each goes over as it is."""
  flags = [f for binding in _GROUPS_OF_TWO_B2 for f in ("--gin_bindings", binding)]
  old_dir = tmp_path / "old"
  total = ["--gin_bindings", "TOTAL_STEPS = 3"]
  assert main(["train", *TINY, *flags, *total, "--model_dir", str(old_dir)]) == 0
  capsys.readouterr()
  more = ["--gin_bindings", "TOTAL_STEPS = 4", "--init_from", str(old_dir)]
  one = ["--gin_bindings", "OPTIMIZER = @optimizers.adam()"]
  one += ["--gin_bindings", "optimizers.adam.b2 = 0.95"]
  one += ["--gin_bindings", "optimizers.adam.learning_rate = 0.01"]
  assert main(["train", *TINY, *one, *more, "--model_dir", str(tmp_path / "one")]) == 0
  out = capsys.readouterr().out
  assert "hparams: old b2=0.95 or 0.98, learning_rate=0.01, new b2=0.95, learning_rate" in out
  assert (
    "0 (ScaleByAdamState).nu: 12 params, from 0/param_states/0 (ScaleByAdamState), "
    "1/param_states/0 (ScaleByAdamState)"
  ) in out, out
  assert main(["train", *TINY, *flags, *more, "--model_dir", str(tmp_path / "same")]) == 0
  out = capsys.readouterr().out
  assert "hparams: old b2=0.95 or 0.98, learning_rate=0.01, new b2=0.95 or 0.98" in out, out
  for group in (0, 1):
    where = f"{group}/param_states/0 (ScaleByAdamState)"
    assert f"{where}: as it is, from {group}/param_states/0, a state of its type" in out, out


T5X_CONFIG = pathlib.Path(__file__).parent / "data" / "t5x_config" / "config.gin"


def test_t5x_operative_config_gives_its_optimizer():
  """The config T5X's train.py wrote: adamw, learning_rate 0.01, among T5X's own modules."""
  found = optimizer_config(T5X_CONFIG.read_text())
  assert found.gin.splitlines() == [
    "from __gin__ import dynamic_registration",
    "from t5x_optim import optimizers",
    "OPTIMIZER = @optimizers.adamw()",
    "optimizers.adamw.learning_rate = 0.01",
  ]
  legacy = T5X_CONFIG.read_text().replace("@optimizers.adamw()", "@adafactor.Adafactor()")
  assert optimizer_config(legacy) == (None, {"decay_rate": 0.8, "step_offset": 0})
  foreign = T5X_CONFIG.read_text().replace("@optimizers.adamw()", "@utils.DatasetConfig()")
  with pytest.raises(ValueError, match=r"uses utils.DatasetConfig from t5x.utils, which"):
    optimizer_config(foreign)
  with pytest.raises(ValueError, match="binds no optimizer"):
    optimizer_config("from t5x import utils\nutils.CheckpointConfig.restore = None")


def test_the_optimizer_the_job_binds_itself_is_the_source_optimizer():
  """A t5x-optim run whose cli.TrainJob.optimizer is bound to an optimizer itself writes no
  OPTIMIZER into its operative config (gin leaves out the unused macro): --init_from from it
  was refused as binding no optimizer. The job's binding is the optimizer, also over an
  OPTIMIZER macro it does not use, as a model's optimizer_def is."""
  run = "\n".join([
    "from t5x_optim import optimizers",
    "import t5x_optim.cli as cli",
    "cli.TrainJob.optimizer = @optimizers.sgd()",
    "optimizers.sgd.learning_rate = 0.05",
    "cli.TrainJob.total_steps = %TOTAL_STEPS",
  ])  # fmt: skip
  assert optimizer_config(run).gin.splitlines() == [
    "from __gin__ import dynamic_registration",
    "from t5x_optim import optimizers",
    "OPTIMIZER = @optimizers.sgd()",
    "optimizers.sgd.learning_rate = 0.05",
  ]
  unused = run + "\nOPTIMIZER = @optimizers.adamw()\noptimizers.adamw.learning_rate = 0.1"
  assert optimizer_config(unused).gin == optimizer_config(run).gin
  through = T5X_CONFIG.read_text().replace(
    "models.EncoderDecoderModel.optimizer_def = %OPTIMIZER",
    "models.EncoderDecoderModel.optimizer_def = @optimizers.sgd()",
  )
  assert through != T5X_CONFIG.read_text()
  assert "OPTIMIZER = @optimizers.sgd()" in optimizer_config(through).gin


def test_init_from_gin_that_binds_the_job_optimizer_builds_that_optimizer(tmp_path):
  """--init_from_gin with a file that binds cli.TrainJob.optimizer itself (as a run's own gin
  file may): the identity compared with the step's record was that optimizer's, while the
  source definition the state was converted with was %OPTIMIZER's, the default chain with
  adamw. It is built as gin calls it, in its own scope."""
  gin_file = tmp_path / "run.gin"
  gin_file.write_text(
    "from __gin__ import dynamic_registration\n"
    "from t5x_optim import cli\n"
    "from t5x_optim import optimizers\n"
    "cli.TrainJob.optimizer = @fast/optimizers.lion()\n"
    "fast/optimizers.lion.learning_rate = 1e-3\n"
    "fast/optimizers.lion.b1 = 0.5\n"
  )
  where = f"--init_from {tmp_path}: --init_from_gin {gin_file}"
  built, hparams, identity, _ = _init_from._parsed(
    tmp_path / "config.gin", [str(gin_file)], [], {}, where
  )
  assert (identity, hparams["b1"]) == ("optimizers.lion", 0.5)
  params = {"w": jnp.ones(2)}
  lion = t5x_optim.optimizers.lion(learning_rate=1e-3)
  assert jax.tree.structure(built.create(params).state.param_states) == jax.tree.structure(
    lion.create(params).state.param_states
  )


def _saved_run(model_dir: pathlib.Path, w: list[float]) -> None:
  opt = t5x_optim.optimizers.sgd(0.1).create({"w": jnp.asarray(w)})
  with Checkpointer(model_dir / "checkpoints", async_save=False) as checkpointer:
    for step in (2, 4):
      checkpointer.save(step, opt)


@pytest.mark.slow
def test_the_checkpoint_init_from_restores_is_told_by_its_checksums(tmp_path):
  """Each host reads its own view of --init_from (a host-local copy, a relative path): copies
  of two runs with the same steps had the same checkpoint list, and the processes of a job
  restored their shards from different runs without a word. The step restored and a digest
  of its recorded checksums tell them apart; a copy of the same run has the same."""
  _saved_run(tmp_path / "a", [1.0, 2.0])
  _saved_run(tmp_path / "b", [1.0, 3.0])
  shutil.copytree(tmp_path / "a", tmp_path / "copy")

  def seen(path: pathlib.Path) -> tuple[str, str]:
    source = _init_from.source_optimizer(path, [], [], {})
    return _init_from.checkpoints_seen(source), _init_from.restored_seen(source)

  a, b, copy = seen(tmp_path / "a"), seen(tmp_path / "b"), seen(tmp_path / "copy")
  assert a[0] == b[0] == "steps 2, 4"
  assert re.fullmatch(r"step 4 \(checksums digest [0-9a-f]{12}\)", a[1]), a
  assert a[1] != b[1] and copy == a
  named = [seen(tmp_path / run / "checkpoints" / "2")[1] for run in ("a", "b")]
  assert named[0].startswith("step 2 (") and named[0] != named[1]


def test_the_source_optimizer_is_told_by_its_numbers_and_config(tmp_path):
  """--init_from_gin src.gin, a relative path that is another file on each host: the source's
  config was never compared (`source_optimizer` leaves gin cleared), and each process
  converted the state with its own b2. Its conversion numbers and a digest of its config
  tell the files apart, a number no converter reads (weight_decay) included."""
  (tmp_path / "run" / "checkpoints").mkdir(parents=True)
  seen = []
  for i, binding in enumerate(["b2 = 0.98", "b2 = 0.5", "b2 = 0.98", "weight_decay = 0.2"]):
    gin_file = tmp_path / f"host{i}" / "src.gin"
    gin_file.parent.mkdir()
    gin_file.write_text(f"include 'optimizers/adamw.gin'\noptax.adamw.{binding}\n")
    source = _init_from.source_optimizer(
      tmp_path / "run", [str(gin_file)], [], _config.device_macros(8)
    )
    seen.append(_init_from.source_seen(source))
  assert "b2=0.98" in seen[0] and "b2=0.5" in seen[1], seen
  assert re.search(r" \(gin config digest [0-9a-f]{12}\)$", seen[0]), seen
  assert seen[0] == seen[2] and len({seen[0], seen[1], seen[3]}) == 3, seen


def _t5x_adamw_directory(t5x_dir: pathlib.Path, *, steps: int) -> pathlib.Path:
  """A T5X model directory: the tiny model's adamw state after `steps` steps, T5X's config."""
  _config.parse_config(
    gin_files=["examples/tiny.gin"],
    gin_bindings=["OPTIMIZER = @optimizers.adamw()", "optimizers.adamw.learning_rate = 0.01"],
    macros=_config.device_macros(8),
  )
  setup = _train.prepare(_config.build_job())
  state = setup.create(*setup.init_args)
  for step in range(steps):
    state, _ = setup.step_fn(state, setup.train_batch(step))
  t5x_optim.save_t5x_checkpoint(t5x_dir, state)
  shutil.copy(T5X_CONFIG, t5x_dir / "config.gin")
  return t5x_dir


@pytest.mark.slow
def test_init_from_a_t5x_directory_reads_its_optimizer_from_t5xs_config(tmp_path, capsys):
  """A T5X model directory: T5X-format checkpoints (adamw) and T5X's operative config."""
  t5x_dir = _t5x_adamw_directory(tmp_path / "t5x", steps=2)
  adafactor = [*TINY, "--gin_file", "optimizers/adafactor.gin", "--gin_bindings", "TOTAL_STEPS = 4"]
  flags = ["--init_from", str(t5x_dir), "--model_dir", str(tmp_path / "new")]
  assert main(["train", *adafactor, *flags]) == 0
  out = capsys.readouterr().out
  assert f"init_from:       {t5x_dir} at step 2" in out, out
  assert "hparams: old learning_rate=0.01, new learning_rate=a schedule" in out, out
  assert re.search(r"FactoredState\)\.v_row: \d+ params, from 0 \(ScaleByAdamState\)", out), out
  # One step of it, named by its directory: T5X's config is in the model directory above.
  flags = ["--init_from", str(t5x_dir / "checkpoint_2"), "--model_dir", str(tmp_path / "step")]
  assert main(["train", *adafactor, *flags]) == 0
  out = capsys.readouterr().out
  assert f"init_from:       {t5x_dir} at step 2" in out, out
  assert "hparams: old learning_rate=0.01, new learning_rate=a schedule" in out, out


@pytest.mark.slow
def test_init_from_a_directory_without_checkpoints_is_one_line(tmp_path, capsys):
  assert (
    main(["train", *TINY, "--init_from", str(tmp_path), "--model_dir", str(tmp_path / "new")]) == 2
  )
  assert capsys.readouterr().err == (
    f"t5x-optim train: error: --init_from {tmp_path} holds no checkpoint: neither a "
    "t5x-optim run's checkpoints/ nor T5X's checkpoint_<step> directories, nor one step of "
    "either.\n"
  )
  assert not (tmp_path / "new" / "checkpoints").exists() or not any(
    (tmp_path / "new" / "checkpoints").iterdir()
  )


@pytest.mark.slow
def test_init_from_a_step_at_or_past_total_steps_is_refused(tmp_path, capsys):
  """A run started from another run's step 3 with TOTAL_STEPS = 3 trained nothing, saved
  nothing and exited 0: its model directory held no checkpoint to evaluate or resume."""
  old_dir, new_dir = tmp_path / "old", tmp_path / "new"
  three = ["--gin_bindings", "TOTAL_STEPS = 3"]
  assert main(["train", *TINY, *three, "--model_dir", str(old_dir)]) == 0
  capsys.readouterr()
  flags = ["--init_from", str(old_dir), "--model_dir", str(new_dir)]
  assert main(["train", *TINY, "--gin_file", "optimizers/adafactor.gin", *three, *flags]) == 2
  assert capsys.readouterr().err == (
    f"t5x-optim train: error: --init_from {old_dir}: its checkpoint is at step 3, and the run "
    "ends at TOTAL_STEPS 3, so it would train nothing; raise TOTAL_STEPS (the steps count on "
    "from the checkpoint's).\n"
  )
  assert not (new_dir / "checkpoints").exists() or not any((new_dir / "checkpoints").iterdir())


@pytest.mark.slow
def test_init_from_a_t5x_directory_whose_config_does_not_parse_names_the_flag_and_file(
  tmp_path, capsys
):
  """T5X's config.gin cut short gave only gin's "SyntaxError: Couldn't parse statement ...
  (line 42)", naming neither --init_from nor the file."""
  t5x_dir = tmp_path / "t5x"
  _config.parse_config(gin_files=["examples/tiny.gin"], macros=_config.device_macros(8))
  setup = _train.prepare(_config.build_job())
  t5x_optim.save_t5x_checkpoint(t5x_dir, setup.create(*setup.init_args))
  (t5x_dir / "config.gin").write_text(T5X_CONFIG.read_text() + "\nDROPOUT_RATE = (0.1,\n")
  flags = ["--init_from", str(t5x_dir), "--model_dir", str(tmp_path / "new")]
  assert main(["train", *TINY, "--gin_bindings", "TOTAL_STEPS = 4", *flags]) == 2
  err = capsys.readouterr().err
  assert len(err.splitlines()) == 1, err
  assert err.startswith(
    f"t5x-optim train: error: --init_from {t5x_dir}: {t5x_dir}/config.gin does not parse: "
  ), err


@pytest.mark.slow
def test_init_from_a_t5x_directory_another_optimizer_wrote_names_no_python_argument(
  tmp_path, capsys
):
  """The refusal ended with the Python API's advice ("the optimizer given as convert_from= /
  source="), flags the command line has not."""
  t5x_dir = _t5x_adamw_directory(tmp_path / "t5x", steps=0)
  flags = ["--init_from", str(t5x_dir), "--init_from_gin", "optimizers/lion.gin"]
  flags += ["--model_dir", str(tmp_path / "new")]
  assert main(["train", *TINY, "--gin_bindings", "TOTAL_STEPS = 4", *flags]) == 2
  err = capsys.readouterr().err
  assert len(err.splitlines()) == 1, err
  assert "the source's has a ScaleByLionState" in err, err
  assert err.rstrip().endswith(
    "The source is the optimizer said to have written the checkpoint, built over the target's "
    "params: give the one that did."
  ), err
  assert "convert_from=" not in err and "source=" not in err, err
