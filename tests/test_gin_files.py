"""Every gin file shipped in t5x_optim/gin parses and builds what it configures."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import gin
import jax
import jax.numpy as jnp
import optax
import pytest

from t5x_optim import OptimizerDef
from t5x_optim.cli.loop import config as _config
from t5x_optim.cli.loop import job as _job
from t5x_optim.cli.loop import train as _train
from t5x_optim.partitioning import Partitioner

pytestmark = pytest.mark.usefixtures("clean_gin")

GIN_DIR = _config.GIN_DIR
KINDS = ("optimizers", "partitioning", "examples")
EXPECTED_OPTIMIZERS = {
  "adamw",
  "adafactor",
  "lion",
  "sgd_momentum",
  "multi_optimizer",
  "multisteps",
  "inject_hyperparams",
  "lookahead",
  "example_lib_adam",
  "adamw_8bit",
  "adamw_4bit",
  "adamw_bf16_sr",
  "muon",
}
ACCUMULATED_STEPS = 4
"""Enough steps for warmup to start and for multisteps.gin to apply its update."""
PARAMS = {"dense": {"kernel": jnp.ones((4, 4))}, "norm": {"scale": jnp.ones(4)}}


def _files(kind: str) -> list[Path]:
  return sorted((GIN_DIR / kind).glob("*.gin"))


def _ids(paths: list[Path]) -> list[str]:
  return [path.stem for path in paths]


def _parse_alone(path: Path, total_steps: int = 10) -> None:
  """Parses `path` without the command's default config (as T5X would), with TOTAL_STEPS."""
  gin.add_config_file_search_path(str(GIN_DIR))
  gin.parse_config_file(str(path))
  gin.parse_config(f"TOTAL_STEPS = {total_steps}")


def _text(path: Path) -> str:
  """The file's text, each ``include``d shipped file's text after it."""
  text = path.read_text()
  included = re.findall(r"^include '([^']+)'", text, flags=re.MULTILINE)
  return "\n".join([text, *(_text(GIN_DIR / name) for name in included)])


def _macro(name: str):
  return gin.query_parameter(f"%{name}")


def _build(name: str):
  with gin.unlock_config():
    gin.parse_config(f"BUILT_FOR_TEST = %{name}")
  return gin.query_parameter("%BUILT_FOR_TEST").scoped_configurable_fn()


def test_every_gin_file_is_covered():
  every = sorted(GIN_DIR.rglob("*.gin"))
  covered = [path for kind in KINDS for path in _files(kind)]
  assert sorted(covered) == every
  assert EXPECTED_OPTIMIZERS <= set(_ids(_files("optimizers")))
  assert {"1d", "2d", "zero"} <= set(_ids(_files("partitioning")))


# multisteps (slow) compiles its accumulating step: seconds.
@pytest.mark.parametrize(
  "path",
  [
    pytest.param(p, marks=pytest.mark.slow) if p.stem == "multisteps" else p
    for p in _files("optimizers")
  ],
  ids=_ids(_files("optimizers")),
)
def test_optimizer_file_builds_a_working_optimizer(path):
  text = _text(path)
  assert "from t5x_optim import optimizers" in text and "OPTIMIZER = " in text
  _parse_alone(path)
  opt_def = _build("OPTIMIZER")
  assert isinstance(opt_def, OptimizerDef)
  params = optax.LookaheadParams.init_synced(PARAMS) if path.stem == "lookahead" else PARAMS
  grads = jax.tree.map(jnp.ones_like, PARAMS)
  optimizer = opt_def.create(params)
  step = jax.jit(lambda optimizer, grads: optimizer.apply_gradient(grads))
  for _ in range(ACCUMULATED_STEPS):
    optimizer = step(optimizer, grads)
  assert int(optimizer.state.step) == ACCUMULATED_STEPS
  trained = optimizer.target
  if isinstance(trained, optax.LookaheadParams):
    trained = trained.fast
  moved = jax.tree.map(lambda a, b: bool((a != b).any()), trained, PARAMS)
  assert any(jax.tree.leaves(moved))


def test_adafactor_file_factors_matrices():
  _parse_alone(GIN_DIR / "optimizers" / "adafactor.gin")
  state = _build("OPTIMIZER").create({"w": jnp.ones((32, 64))}).state.param_states
  factored = state[0]
  assert factored.v_row["w"].shape == (32,) and factored.v_col["w"].shape == (64,)


@pytest.mark.parametrize("path", _files("partitioning"), ids=_ids(_files("partitioning")))
def test_partitioning_file_builds_a_partitioner(path):
  _config.parse_config(gin_files=[str(path)], macros=_config.device_macros(8))
  partitioner = _build("PARTITIONER")
  assert isinstance(partitioner, Partitioner)
  assert dict(partitioner.mesh.shape) == {"data": 4, "model": 2}
  rules = partitioner.logical_axis_rules
  assert (rules.optimizer_state_axis == "data") == (path.stem == "zero")
  embed = [axes for name, axes in rules if name == "embed"]
  assert (embed[0] == "data") == (path.stem == "2d")
  _config.parse_config(gin_files=[str(path)], macros=_config.device_macros(1))
  _config.check_mesh_pin(1)  # the file pins no mesh, so it runs on one device too
  assert dict(_build("PARTITIONER").mesh.shape) == {"data": 1, "model": 1}


SCHEDULED = [path for path in _files("optimizers") if "%TOTAL_STEPS" in path.read_text()]


def test_scheduled_files_are_the_expected_ones():
  assert {path.stem for path in SCHEDULED} == {"adamw", "adafactor", "lion", "muon"}


@pytest.mark.parametrize("path", [None, *SCHEDULED], ids=["default", *_ids(SCHEDULED)])
@pytest.mark.parametrize("total_steps", [1, 20, 1000])
@pytest.mark.slow
def test_schedule_follows_total_steps(path, total_steps):
  files = [] if path is None else [str(path)]
  _config.parse_config(
    gin_files=files, gin_bindings=[f"TOTAL_STEPS = {total_steps}"], macros=_config.device_macros(8)
  )
  schedule = _macro("LEARNING_RATE").scoped_configurable_fn()
  rates = jax.vmap(schedule)(jnp.arange(2 * total_steps + 1)).tolist()
  assert all(rate > 0 for rate in rates)
  assert rates[total_steps] == rates[-1], "the schedule runs past TOTAL_STEPS"
  if total_steps > 1:
    assert rates[total_steps - 1] != rates[total_steps] or rates[0] != rates[total_steps]
    assert max(rates) > rates[total_steps]
  opt_def = _build("OPTIMIZER")
  optimizer = opt_def.create(PARAMS).apply_gradient(jax.tree.map(jnp.ones_like, PARAMS))
  assert all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(optimizer.target))


@pytest.mark.parametrize("path", _files("optimizers"), ids=_ids(_files("optimizers")))
def test_optimizer_file_names_its_learning_rate(path):
  """The command logs the rate the optimizer binds, or reads it from its state."""
  _config.parse_config(gin_files=[str(path)], macros=_config.device_macros(8))
  assert "LEARNING_RATE = " in _text(path) and "%LEARNING_RATE" in _text(path)
  found = _config.optimizer_learning_rate()
  if path.name == "multi_optimizer.gin":  # Two rates: none is logged.
    assert found is None
  else:
    assert found is not None and "%LEARNING_RATE = " in found[1]


@pytest.mark.parametrize(
  ("rates", "logged"),
  [
    (("@fast/optax.constant_schedule()", "@slow/optax.constant_schedule()"), None),
    (("@fast/optax.constant_schedule()", "@fast/optax.constant_schedule()"), 0.01),
  ],
  ids=["two_scopes", "one_scope"],
)
def test_two_schedules_of_one_configurable_are_two_rates(rates, logged):
  """The matrices at 0.01 and the scales at 0.5, each a scoped ``optax.constant_schedule``: the
  rates were told apart by the configurable's name alone, and the scales' 0.5 was logged as
  the run's learning rate."""
  _config.parse_config(
    gin_files=["optimizers/multi_optimizer.gin"],
    gin_bindings=[
      f"optimizers.adamw.learning_rate = {rates[0]}",
      f"optimizers.adam.learning_rate = {rates[1]}",
      "fast/optax.constant_schedule.value = 0.01",
      "slow/optax.constant_schedule.value = 0.5",
    ],
    macros=_config.device_macros(8),
  )
  found = _config.optimizer_learning_rate()
  assert (found and found[0](0)) == logged


@pytest.mark.parametrize(("adam_rate", "logged"), [("1e-3", False), ("%LEARNING_RATE", True)])
def test_muons_adam_learning_rate_is_a_second_rate(adam_rate, logged):
  """Muon with its own ``adam_learning_rate`` trains its other params at that rate: the run
  logged Muon's schedule as the one learning rate."""
  _config.parse_config(
    gin_files=["optimizers/muon.gin"],
    gin_bindings=[f"optimizers.muon.adam_learning_rate = {adam_rate}"],
    macros=_config.device_macros(8),
  )
  assert (_config.optimizer_learning_rate() is not None) == logged


@pytest.mark.parametrize(
  ("bindings", "path"),
  [
    ([], None),
    (_config.data_bindings("hamlet.txt"), "hamlet.txt"),
    (["TASK = @cli.TextTask()", "cli.TextTask.path = '{x}'"], "{x}"),
    (["cli.TrainJob.task = @cli.TextTask()", "cli.TextTask.path = '{y}'"], "{y}"),
    (
      [
        "cli.TrainJob.task = @mine/cli.TextTask()",
        "mine/cli.TextTask.path = '{x}'",
        "cli.TextTask.path = '{y}'",
      ],
      "{x}",
    ),
  ],
  ids=["synthetic", "data_flag", "macro", "direct", "scoped"],
)
def test_the_text_a_job_reads_is_found_however_it_is_bound(bindings, path, tmp_path):
  """The processes of a job compare the text at this path (`test_multiprocess`)."""
  files = {name: tmp_path / f"{name}.txt" for name in ("x", "y")}
  for name, file in files.items():
    file.write_text(f"the text {name} " * 100)
  bindings = [binding.format(**files) for binding in bindings] + ["VOCAB_SIZE = 256"]
  _config.parse_config(gin_files=["examples/tiny.gin"], gin_bindings=bindings)
  want = None if path is None else path.format(**files)
  assert _config.text_data_path() == want
  task = _config.build_job().task
  assert getattr(task, "path", None) == want


@pytest.mark.parametrize("path", _files("examples"), ids=_ids(_files("examples")))
def test_example_file_builds_a_train_job(path):
  _config.parse_config(gin_files=[str(path)])
  job = _config.build_job()
  assert isinstance(job, _config.TrainJob)
  assert isinstance(job.optimizer, OptimizerDef)


def test_examples_take_their_included_optimizer():
  _config.parse_config(gin_files=["examples/adafactor_2d.gin"])
  job = _config.build_job()
  state = job.optimizer.create({"w": jnp.ones((32, 64))}).state.param_states
  assert isinstance(state[0], optax.FactoredState)
  assert [axes for name, axes in job.partitioner.logical_axis_rules if name == "embed"][0] == "data"


@pytest.mark.parametrize("name", ["optimizers/adamw.gin", "gin/optimizers/adamw.gin"])
def test_shipped_files_resolve_from_any_directory(name, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  resolved = _config.resolve_gin_file(name, _config.default_search_paths())
  assert resolved == GIN_DIR / "optimizers" / "adamw.gin"


def test_a_search_paths_file_comes_before_the_shipped_one_of_the_same_name(tmp_path, monkeypatch):
  """A user's ``optimizers/adamw.gin`` in a search path is the one parsed; a search path that
  is not a directory is refused rather than passed over for the shipped file."""
  monkeypatch.chdir(tmp_path)
  mine = tmp_path / "mine"
  (mine / "optimizers").mkdir(parents=True)
  (mine / "optimizers" / "adamw.gin").write_text("TOTAL_STEPS = 3\n")
  _config.parse_config(gin_files=["optimizers/adamw.gin"], search_paths=[str(mine)])
  assert gin.query_parameter("%TOTAL_STEPS") == 3
  for missing in (tmp_path / "mien", mine / "optimizers" / "adamw.gin"):
    with pytest.raises(NotADirectoryError, match=f"gin search path '{missing}' is not a local"):
      _config.parse_config(gin_files=["optimizers/adamw.gin"], search_paths=[str(missing)])


def test_an_include_of_a_name_beside_the_including_file_that_gin_finds_elsewhere_is_refused(
  tmp_path, monkeypatch
):
  """gin looks an include up in the current directory, the search paths and the package's gin
  files, never beside the file that includes it: ``include 'optimizers/adamw.gin'`` in
  ``my/main.gin`` beside ``my/optimizers/adamw.gin`` took the shipped file without a word when
  run from another directory. Run from ``my``, both are one file, and it is the one parsed."""
  mine = tmp_path / "my"
  (mine / "optimizers").mkdir(parents=True)
  (mine / "optimizers" / "adamw.gin").write_text("TOTAL_STEPS = 3\n")
  (mine / "main.gin").write_text("include 'optimizers/adamw.gin'\n")
  monkeypatch.chdir(tmp_path)
  shipped = GIN_DIR / "optimizers" / "adamw.gin"
  with pytest.raises(
    ValueError,
    match=re.escape(
      f"{mine / 'main.gin'} includes 'optimizers/adamw.gin', which gin finds as {shipped}"
    ),
  ):
    _config.parse_config(gin_files=[str(mine / "main.gin")])
  monkeypatch.chdir(mine)
  _config.parse_config(gin_files=[str(mine / "main.gin")])
  assert gin.query_parameter("%TOTAL_STEPS") == 3


@pytest.mark.parametrize("search_path", [False, True])
@pytest.mark.parametrize(
  "including, included",
  [
    ("optimizers/adamw_8bit.gin", "optimizers/adamw.gin"),
    ("examples/lion_1d.gin", "optimizers/lion.gin"),
  ],
)
def test_a_shipped_files_include_that_gin_finds_in_a_users_file_is_refused(
  including, included, search_path, tmp_path, monkeypatch
):
  """The shipped ``optimizers/adamw_8bit.gin`` includes ``optimizers/adamw.gin`` from the
  package's gin folder; a user's ``optimizers/adamw.gin`` in the current directory or a search
  path took its place without a word, its learning rate with it. A copy of the including file
  at its shipped name under the folder the include was found in takes it; the refusal names
  that place (``examples/lion_1d.gin``'s copy beside the found ``optimizers/lion.gin`` was
  refused the same way)."""
  mine = tmp_path / "mine" if search_path else tmp_path
  (mine / "optimizers").mkdir(parents=True)
  (mine / included).write_text((GIN_DIR / included).read_text() + "TOTAL_STEPS = 3\n")
  monkeypatch.chdir(tmp_path)
  search_paths = [mine] if search_path else []
  with pytest.raises(
    ValueError,
    match=re.escape(
      f"{GIN_DIR / including} includes {included!r}, which gin finds as {mine / included}"
    )
    + ".*"
    + re.escape(f"not as the shipped {GIN_DIR / included}")
    + ".*"
    + re.escape(f"give a copy of {Path(including).name} of your own as {mine / including} and"),
  ):
    _config.parse_config(gin_files=[including], search_paths=search_paths)
  (mine / including).parent.mkdir(exist_ok=True)
  shutil.copy(GIN_DIR / including, mine / including)
  _config.parse_config(gin_files=[including], search_paths=search_paths)
  assert gin.query_parameter("%TOTAL_STEPS") == 3


@pytest.fixture
def folders_on_sys_path(tmp_path, monkeypatch):
  """The working directory on ``sys.path`` (``python -m t5x_optim``), as `tmp_path`; what it
  imports as namespace packages (folders without ``__init__.py``) is forgotten afterwards."""
  monkeypatch.chdir(tmp_path)
  monkeypatch.syspath_prepend(str(tmp_path))
  before = set(sys.modules)
  yield tmp_path
  for name in set(sys.modules) - before:
    del sys.modules[name]


def test_a_folder_named_like_an_include_in_the_working_directory_does_not_break_it(
  folders_on_sys_path,
):
  """adamw_8bit.gin includes ``optimizers/adamw.gin``: with an ``optimizers/`` folder where the
  command runs, gin's lookup of the include in packages failed on that namespace package with
  ``TypeError: expected str, bytes or os.PathLike object, not NoneType``."""
  (folders_on_sys_path / "optimizers").mkdir()
  _config.parse_config(gin_files=["optimizers/adamw_8bit.gin"])
  assert "optimizers.low_precision(inner=optax.adamw" in _config.describe_optimizer()
  _config.parse_config(gin_bindings=["include 'optimizers/adamw_8bit.gin'"])
  assert "optimizers.low_precision(inner=optax.adamw" in _config.describe_optimizer()


def test_an_include_in_a_namespace_package_is_found_as_in_a_package(
  folders_on_sys_path, monkeypatch
):
  """gin finds ``include 'pkg/file.gin'`` in the package ``pkg`` on ``sys.path``: in a folder
  without ``__init__.py`` as well, also when another folder is the working directory."""
  (folders_on_sys_path / "elsewhere").mkdir()
  (folders_on_sys_path / "lib" / "my_configs").mkdir(parents=True)
  (folders_on_sys_path / "lib" / "my_configs" / "steps.gin").write_text("TOTAL_STEPS = 3\n")
  monkeypatch.syspath_prepend(str(folders_on_sys_path / "lib"))
  monkeypatch.chdir(folders_on_sys_path / "elsewhere")
  _config.parse_config(gin_bindings=["include 'my_configs/steps.gin'"])
  assert gin.query_parameter("%TOTAL_STEPS") == 3
  with pytest.raises(OSError, match="Unable to open file: my_configs/nothing.gin"):
    _config.parse_config(gin_bindings=["include 'my_configs/nothing.gin'"])


def _optimizer_report(bindings: list[str]) -> tuple[str, str, tuple | None, OptimizerDef]:
  _config.parse_config(gin_bindings=bindings)
  found = _config.optimizer_learning_rate()
  return _config.describe_optimizer(), _config.optimizer_identity(), found, _build("OPTIMIZER")


def test_the_optimizer_is_read_in_the_scope_gin_builds_it_in():
  """``OPTIMIZER = @optimizers.chain()`` is called in the scope OPTIMIZER: a binding
  scoped there is the optimizer the run trains with, and the one it reports."""
  bindings = [
    "OPTIMIZER/optimizers.chain.transformations = [@optax.lion()]",
    "OPTIMIZER/optax.lion.learning_rate = 0.003",
  ]
  described, identity, (rate, where), built = _optimizer_report(bindings)
  assert described == "optimizers.chain(transformations=[optax.lion])"
  assert identity == "optimizers.chain(transformations=[optax.lion])"
  assert (rate, where) == (0.003, "OPTIMIZER/optax.lion.learning_rate = 0.003")
  state = built.create(PARAMS).state.param_states
  assert isinstance(state[0][0], optax.ScaleByLionState)


def test_a_learning_rate_bound_in_the_optimizers_scope_is_the_one_logged():
  bindings = ["OPTIMIZER/optax.adamw.learning_rate = 0.003"]
  _, _, (rate, where), _ = _optimizer_report(bindings)
  assert (rate, where) == (0.003, "OPTIMIZER/optax.adamw.learning_rate = 0.003")


def test_a_reference_with_a_scope_of_its_own_is_read_in_that_scope():
  """gin calls ``@fast/optax.adamw()`` in the scope ``fast`` alone, whatever scope
  its caller is in: bindings scoped OPTIMIZER do not reach it."""
  bindings = [
    "optimizers.chain.transformations = [@fast/optax.adamw()]",
    "fast/optax.adamw.learning_rate = @optax.linear_schedule()",
    "fast/optax.linear_schedule.init_value = 0.5",
    "optax.linear_schedule.end_value = 0.1",
    "optax.linear_schedule.transition_steps = 10",
    "OPTIMIZER/optax.adamw.learning_rate = 0.003",
  ]
  described, _, (rate, where), _ = _optimizer_report(bindings)
  assert (
    described
    == "optimizers.chain(transformations=[optax.adamw(learning_rate=optax.linear_schedule)])"
  )
  assert where == "fast/optax.adamw.learning_rate = @optax.linear_schedule()"
  assert (float(rate(0)), float(rate(10))) == (0.5, pytest.approx(0.1))


MULTI_TRANSFORM = [
  "OPTIMIZER = @optimizers.OptaxWrapper()",
  "optimizers.OptaxWrapper.optax_optimizer = @optax.multi_transform()",
  "optax.multi_transform.transforms = {'y': @optax.sgd(), 'x': @a/optax.adam()}",
  "optax.multi_transform.param_labels = {'dense': {'kernel': 'x'}, 'norm': {'scale': 'y'}}",
  "a/optax.adam.learning_rate = 0.003",
  "a/optax.adam.b2 = 0.95",
  "optax.sgd.learning_rate = 0.003",
  "optax.sgd.momentum = 0.5",
]
"""``optax.multi_transform``, whose optimizers are the values of its ``transforms`` dict."""


def test_the_optimizers_in_a_dict_are_described_and_are_the_optimizers_identity():
  """A dict's values are walked as a list's items are (its keys in order): the description
  and the identity a resume compares named ``optax.multi_transform`` alone, so a resume with
  nadam in the place of adam was not refused."""
  described, identity, _, built = _optimizer_report(MULTI_TRANSFORM)
  expected = (
    "optimizers.OptaxWrapper(optax_optimizer=optax.multi_transform("
    "transforms={'x': optax.adam, 'y': optax.sgd}))"
  )
  assert (described, identity) == (expected, expected.replace("multi_transform", "partition"))
  assert set(built.create(PARAMS).state.param_states.inner_states) == {"x", "y"}
  nadam = [binding.replace("adam", "nadam") for binding in MULTI_TRANSFORM]
  assert _optimizer_report(nadam)[1] == identity.replace("adam", "nadam")


def test_a_record_written_before_dicts_were_read_still_names_the_job(tmp_path):
  """Earlier versions recorded a dict of optimizers not at all (``optax.multi_transform``
  alone): such a checkpoint of an unchanged config was refused as another job."""
  _, identity, _, _ = _optimizer_report(MULTI_TRANSFORM)
  earlier = "optimizers.OptaxWrapper(optax_optimizer=optax.multi_transform)"
  assert earlier in _config.earlier_optimizer_identities()
  job = {"optimizer": identity}
  _train._refuse_another_job({"optimizer": earlier}, job, tmp_path, 4)
  with pytest.raises(_train.UsageError, match="holds another job"):
    _train._refuse_another_job({"optimizer": earlier.replace("multi_", "")}, job, tmp_path, 4)


def test_a_record_without_jax_enable_x64_is_not_refused_for_it(tmp_path):
  """Job records name the run's jax_enable_x64; one written before they did is not refused."""
  job = {"optimizer": "optax.sgd", "jax_enable_x64": True}
  _train._refuse_another_job({"optimizer": "optax.sgd"}, job, tmp_path, 4)
  with pytest.raises(_train.UsageError, match="jax_enable_x64 False, this run has True"):
    _train._refuse_another_job({**job, "jax_enable_x64": False}, job, tmp_path, 4)


@pytest.mark.parametrize(
  "setting",
  ["jax_random_seed_offset", "jax_softmax_custom_jvp", "jax_disable_most_optimizations"],
  ids=["seed_offset", "softmax_custom_jvp", "disable_most_optimizations"],
)
def test_the_jax_settings_the_processes_compare_include_those_that_change_the_numbers(setting):
  """A host whose environment sets one of these trained other numbers beside its peers without
  a word: ``JAX_RANDOM_SEED_OFFSET`` shifts every random key it makes (the params' init),
  ``JAX_SOFTMAX_CUSTOM_JVP`` differentiates the attention's softmax otherwise and
  ``JAX_DISABLE_MOST_OPTIMIZATIONS`` compiles the step otherwise (3 steps of examples/tiny.gin
  end in other params with either). Each is changed from what this process has (the suite
  itself runs with most optimizations disabled)."""
  before = _job.jax_settings()
  current = jax.config.values[setting]
  other = not current if isinstance(current, bool) else current + 1
  jax.config.update(setting, other)
  try:
    after = _job.jax_settings()
  finally:
    jax.config.update(setting, current)
  assert (before[setting], after[setting]) == (repr(current), repr(other))


def test_a_configurable_named_by_another_name_of_its_function_is_read():
  """``optax.partition`` is ``optax.multi_transform``: gin registers the function once, under
  the name it meets first, and the walk looked a reference's bindings up under the name it
  was written with, which gin then did not know (an ``--init_from`` between a run of one name
  and a config of the other stopped on ``Could not find OPTIMIZER/optax.partition``)."""
  described, identity, _, _ = _optimizer_report(MULTI_TRANSFORM)
  partition = [binding.replace("multi_transform", "partition") for binding in MULTI_TRANSFORM]
  renamed = (described.replace("multi_transform", "partition"), identity)
  assert _optimizer_report(partition)[:2] == renamed
  assert [a.binding for a in _config.optimizer_arguments() if a.name == "b2"] == ["a/optax.adam.b2"]
  _optimizer_report(MULTI_TRANSFORM)
  assert _config.optimizer_identity() == identity


def test_the_default_optimizer_reports_its_unscoped_bindings():
  described, identity, (_, where), _ = _optimizer_report([])
  assert described == (
    "optimizers.chain(transformations=[optax.clip_by_global_norm, "
    "optax.adamw(learning_rate=optax.cosine_onecycle_schedule)])"
  )
  assert identity == "optimizers.chain(transformations=[optax.clip_by_global_norm, optax.adamw])"
  assert where == "optax.adamw.learning_rate = %LEARNING_RATE = @optax.cosine_onecycle_schedule()"


DIRECT = ["cli.TrainJob.optimizer = @optimizers.adam()", "optimizers.adam.learning_rate = 0.05"]
"""An optimizer bound to the train job itself, not through ``%OPTIMIZER``."""


def test_an_optimizer_bound_to_the_train_job_itself_is_the_one_reported():
  """``cli.TrainJob.optimizer = @optimizers.adam()`` trains adam, while the banner, the rate
  logged, the arguments read and the identity a resume compares described ``%OPTIMIZER``
  (the default chain with adamw), so a resume with yogi was not refused."""
  described, identity, found, _ = _optimizer_report(DIRECT)
  assert (described, identity) == ("optimizers.adam", "optimizers.adam")
  assert found == (0.05, "optimizers.adam.learning_rate = 0.05")
  assert [a.binding for a in _config.optimizer_arguments()] == ["optimizers.adam.learning_rate"]
  yogi = [binding.replace("adam", "yogi") for binding in DIRECT]
  assert _optimizer_report(yogi)[1] == "optimizers.yogi"


def test_a_record_of_the_macro_when_the_job_bound_its_own_optimizer_still_names_it(tmp_path):
  """Earlier versions recorded ``%OPTIMIZER`` as the optimizer of a job that bound its own:
  such a record cannot tell what trained, and is taken for the job's (the state's layout is
  still compared). One that this version wrote (``optimizer_naming``) names what trained."""
  identity = _optimizer_report(DIRECT)[1]
  earlier = "optimizers.chain(transformations=[optax.clip_by_global_norm, optax.adamw])"
  _train._refuse_another_job({"optimizer": earlier}, {"optimizer": identity}, tmp_path, 4)
  ours = {"optimizer": earlier, "optimizer_naming": _job.OPTIMIZER_NAMING}
  with pytest.raises(_train.UsageError, match="holds another job"):
    _train._refuse_another_job(ours, {"optimizer": identity}, tmp_path, 4)
  with pytest.raises(_train.UsageError, match="holds another job"):
    _train._refuse_another_job(
      {"optimizer": "optimizers.yogi"}, {"optimizer": identity}, tmp_path, 4
    )


def test_an_empty_list_bound_to_an_argument_is_not_part_of_the_identity(tmp_path):
  """A run's config.gin writes the defaults it read (``low_precision.param_modes = ()``):
  resumed with its own config.gin, an 8-bit run's optimizer was 'low_precision(inner=...,
  param_modes=[])' where the run recorded 'low_precision(inner=...)', another job. An empty
  list holds no optimizer, so it is left out; a record from an earlier version that shows it
  is still taken for the job's."""
  include = ["include 'optimizers/adamw_8bit.gin'"]
  shown = _optimizer_report([*include, "optimizers.low_precision.param_modes = ()"])[1]
  earlier = _config.earlier_optimizer_identities()
  assert _optimizer_report(include)[1] == shown and "param_modes" not in shown
  assert any("param_modes=[]" in text for text in earlier), earlier
  record = next(text for text in earlier if "param_modes=[]" in text)
  _optimizer_report([*include, "optimizers.low_precision.param_modes = ()"])
  _train._refuse_another_job({"optimizer": record}, {"optimizer": shown}, tmp_path, 4)


QUALIFIED = [
  "import t5x_optim.optimizers\nOPTIMIZER = @t5x_optim.optimizers.chain()\n"
  "t5x_optim.optimizers.chain.transformations = [@optax.clip_by_global_norm(), @optax.adamw()]"
]
"""The default optimizer written with the module's full name."""


def test_one_optimizer_written_under_two_names_is_one_identity(tmp_path):
  """The identity named each configurable as written: ``@t5x_optim.optimizers.chain()`` for
  ``@optimizers.chain()`` (one module), or ``optax.partition`` for ``optax.multi_transform``
  (one function), was another job, and its resume was refused. A record that names it as
  written, as earlier versions did, is still taken for the job's."""
  identity = _optimizer_report([])[1]
  assert _optimizer_report(QUALIFIED)[1] == identity
  written = _optimizer_report(MULTI_TRANSFORM)[:2]
  partition = [binding.replace("multi_transform", "partition") for binding in MULTI_TRANSFORM]
  assert _optimizer_report(partition)[1] == written[1]
  assert "optax.partition(" in written[1] and "optax.multi_transform(" in written[0]
  _optimizer_report(MULTI_TRANSFORM)
  _train._refuse_another_job({"optimizer": written[0]}, {"optimizer": written[1]}, tmp_path, 4)
  _optimizer_report(QUALIFIED)
  _train._refuse_another_job(
    {"optimizer": "t5x_optim." + identity}, {"optimizer": identity}, tmp_path, 4
  )
