"""`t5x-optim train --init_from DIR`: start a run from another run's checkpoint and optimizer.

DIR is a t5x-optim model directory (its checkpoints in ``DIR/checkpoints`` and its
operative gin config in ``DIR/config.gin``) or a T5X model directory (T5X's
``checkpoint_<step>`` directories, legacy or Orbax format, and the operative
``config.gin`` T5X's train.py writes, whose optimizer bindings name the old
optimizer), whose newest checkpoint is restored; or one step of either
(``DIR/checkpoints/<step>``, ``DIR/checkpoint_<step>``), which is restored or
refused. Of a t5x-optim directory, the newest intact step is restored: newer
steps that are incomplete or corrupt are skipped, each named with why, and
left where they are. The params, step and
mutables are restored exactly and the old optimizer's state is converted into the
gin file's optimizer (`t5x_optim.convert_state`), so the new optimizer keeps what the
old one learned.

The hyper-parameters a conversion needs and a state does not hold (Adam's ``b1``
and ``b2``, SGD's ``momentum``, ...) are read from each side's gin config, where
it binds them (``optax.adamw.b2 = 0.98``, through macros too; a learning-rate
schedule is kept as one); the others are optax's defaults. One bound to several values
(`MultiOptimizer` groups or ``optax.partition`` parts of another ``b2`` each) converts each
state with its own, or, where which is whose is not told, refuses a conversion that would
read it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TextIO

import gin

from t5x_optim import (
  BUILTIN_HPARAMS,
  HPARAM_ALIASES,
  Checkpointer,
  SeveralValues,
  TrainState,
  restore_converted,
  storage,
  t5x_checkpoint_steps,
)
from t5x_optim.checkpoints import CheckpointError
from t5x_optim.cli._t5x_config import (
  binding_statements,
  optimizer_config,
)
from t5x_optim.cli.loop import config as _config
from t5x_optim.cli.loop.job import (
  CONFIG_FILE,
  LostConfig,
  config_digest,
  format_problem,
  model_changes,
  recorded_config,
)
from t5x_optim.cli.loop.train import (
  CHECKPOINTS,
  INCOMPLETE,
  STEP_CHECKSUMS,
  UsageError,
  skip_reason,
  steps_line,
  steps_seen,
)

__all__ = [
  "CONVERSION_HPARAMS",
  "Source",
  "bound_hparams",
  "checkpoints_seen",
  "initial_state_fn",
  "restored_seen",
  "source_optimizer",
  "source_seen",
]

CONVERSION_HPARAMS = BUILTIN_HPARAMS
"""The hyper-parameters the built-in converters read (see `t5x_optim.convert_state`)."""


class Source(NamedTuple):
  """An ``--init_from`` directory, the optimizer that wrote it, and its hyper-parameters.

  Attributes:
    directory: the model directory, checked reachable (`storage.check_reachable`).
    optimizer: the optimizer definition, or None (see `source_optimizer`).
    hparams: its `bound_hparams`.
    step: the step that ``--init_from`` named (a step directory), or None.
    step_hparams: of a t5x-optim run resumed with other numbers, each step's
      `bound_hparams` from the config of the start that wrote it, where they
      differ from `hparams`; or the `UsageError` of a config that does not
      build, raised only if that step is restored.
    given_gin: with ``--init_from_gin``, the flag as given and the identity
      (`config.optimizer_identity`) of the optimizer its files build.
    config_sha256: the digest of the gin config the optimizer is built from
      (``gin.config_str()`` of ``--init_from_gin`` or of the directory's
      optimizer bindings; the text of T5X's config for its legacy Adafactor),
      or None for a directory without a config.
  """

  directory: Path
  optimizer: Any
  hparams: Mapping[str, Any]
  step: int | None = None
  step_hparams: Mapping[int, Mapping[str, Any] | UsageError] = {}
  given_gin: tuple[str, str | None] | None = None
  config_sha256: str | None = None

  def hparams_of(self, step: int | None) -> Mapping[str, Any]:
    """The hyper-parameters that wrote checkpoint `step` (None: the newest).

    Raises:
      UsageError: the config of the start that wrote `step` does not build.
    """
    found = self.hparams if step is None else self.step_hparams.get(step, self.hparams)
    if isinstance(found, UsageError):
      raise found
    return found


def bound_hparams() -> dict[str, Any]:
  """The `CONVERSION_HPARAMS` that gin's current config gives its optimizer, one value each.

  Muon's ``adam_b1`` and ``adam_b2`` count as the ``b1`` and ``b2`` of its Adam.

  They are read as gin builds the job's optimizer (``cli.TrainJob.optimizer``,
  ``%OPTIMIZER`` unless bound otherwise; `config.optimizer_arguments`): only
  the configurables it reaches count, each in the scope gin calls it in, so
  ``OPTIMIZER/optax.adamw.b2`` wins over ``optax.adamw.b2``. In a config
  without ``cli.TrainJob``, every binding counts.

  A binding to a macro (``%LEARNING_RATE``) or to a configurable's call
  (``@optax.linear_schedule()``) is evaluated as gin would evaluate it. A
  number is kept, and a schedule for ``learning_rate`` (converters call it at
  the step); a name bound to anything else is left out, so its converter
  uses optax's default. A name bound to several values (a `MultiOptimizer`'s
  groups with another ``b2`` each) is `SeveralValues`, with the scope and
  binding of each, and the paths of the states it is bound for where the
  walk tells them (a `MultiOptimizer` group's, an ``optax.partition``
  part's; `config.OptimizerArgument.at`); a converter elsewhere that would
  read it refuses rather than guess.
  Where a name is bound, a configurable reached that takes it with a number
  default and leaves it unbound counts that default (one group's ``b2`` bound
  to 0.98, the other's left at optax's 0.999).

  Example:
    >>> import gin
    >>> gin.clear_config()
    >>> _ = gin.parse_config(["from __gin__ import dynamic_registration", "import optax",
    ...                       "B2 = 0.98", "optax.adamw.b2 = %B2", "optax.sgd.momentum = None"])
    >>> bound_hparams()
    {'b2': 0.98}
    >>> gin.clear_config()
  """
  if _config.binds_optimizer():
    arguments = list(_config.optimizer_arguments(defaults=True))
  else:
    arguments = [
      _config.OptimizerArgument(
        f"{_selector(binding)}.{binding.arg_name}",
        binding.arg_name,
        gin.query_parameter(f"{_selector(binding)}.{binding.arg_name}"),
        tuple(binding.scope.split("/")) if binding.scope else (),
      )
      for binding in binding_statements(gin.config_str())
      if HPARAM_ALIASES.get(binding.arg_name, binding.arg_name) in CONVERSION_HPARAMS
    ]
  # By name, then by (scope, key): the value, its binding, the paths of its states.
  found: dict[str, dict[tuple[str, Any], tuple[Any, str, set[str | None]]]] = {}
  bound = {HPARAM_ALIASES.get(a.name, a.name) for a in arguments if not a.default}
  for argument in arguments:
    name = HPARAM_ALIASES.get(argument.name, argument.name)
    if name not in CONVERSION_HPARAMS or (argument.default and name not in bound):
      continue
    value = _conversion_value(argument)
    if isinstance(value, bool | int | float):
      key = value
    elif callable(value) and name == "learning_rate":  # one schedule per reference
      key = _evaluated_as(argument)
    else:
      continue
    binding = argument.binding
    if argument.default:  # Named by the scope it is called in: no binding names it.
      binding = "/".join((*argument.scope, binding.rsplit("/", 1)[-1])) + "'s default"
    place = ("/".join(argument.scope), key)
    found.setdefault(name, {}).setdefault(place, (value, binding, set()))[2].add(argument.at)
  return {name: _one_or_several(places) for name, places in sorted(found.items())}


def _one_or_several(
  places: Mapping[tuple[str, Any], tuple[Any, str, set[str | None]]],
) -> Any:
  """A name's value, where all its places (scope, key) give one key; else `SeveralValues`,
  in the order of their scopes, each value tied to the paths of the states it is bound for
  (`OptimizerArgument.at`) where every one is told and no state lies under another of
  another value."""
  if len({key for _, key in places}) == 1:
    return next(iter(places.values()))[0]
  entries = sorted(places.items(), key=lambda item: (item[0][0], repr(item[0][1])))
  tied = [(key, at) for (_, key), (_, _, ats) in entries for at in ats]
  known = all(at for _, at in tied) and not any(
    key != other and (at == under or at.startswith(f"{under}/"))
    for key, at in tied
    for other, under in tied
  )
  return SeveralValues(
    tuple(value for _, (value, _, _) in entries),
    tuple(scope for (scope, _), _ in entries),
    tuple(binding for _, (_, binding, _) in entries),
    at=tuple(tuple(sorted(ats)) for _, (_, _, ats) in entries) if known else (),
  )


def _selector(binding: Any) -> str:
  return f"{binding.scope}/{binding.selector}" if binding.scope else binding.selector


def _evaluated_as(argument: _config.OptimizerArgument) -> tuple[tuple[str, ...], str]:
  """The scope `argument`'s reference is called in (its own, as a macro's, or its
  configurable's) and the reference: one schedule per pair."""
  own = tuple(getattr(argument.value, "scopes", ()))
  return own or argument.scope, repr(argument.value)


def _conversion_value(argument: _config.OptimizerArgument) -> Any:
  """`argument`'s value, with a macro or ``@configurable()`` evaluated; None for a
  reference that is not called, or that cannot be called alone."""
  value = argument.value
  if isinstance(value, gin.config.ConfigurableReference) and not value.evaluate:
    return None
  try:
    return _config.evaluated_argument(argument)
  except (TypeError, ValueError):
    return None


def _as_path(init_from: Path | str) -> Path:
  try:
    return storage.check_reachable(init_from)
  except storage.StorageError as error:
    raise UsageError(f"--init_from {error}") from error


def _describe(hparams: Mapping[str, Any] | None) -> str:
  shown = [f"{k}={_shown(v)}" for k, v in (hparams or {}).items()]
  return ", ".join(shown) or "optax's defaults"


def _shown(value: Any) -> str:
  if isinstance(value, SeveralValues):
    return " or ".join(dict.fromkeys(map(_shown, value.values)))
  return "a schedule" if callable(value) else f"{value}"


def _located(path: Path) -> tuple[Path, int | None]:
  """The model directory and step that an ``--init_from`` path names (None: its newest).

  Example:
    >>> import tempfile
    >>> run = Path(tempfile.mkdtemp())
    >>> (run / 'checkpoints' / '20').mkdir(parents=True); (run / 'checkpoint_8').mkdir()
    >>> [_located(p) == (run, s) for p, s in [(run / 'checkpoints' / '20', 20),
    ...  (run / 'checkpoint_8', 8), (run, None), (run / 'checkpoints', None)]]
    [True, True, True, True]
  """
  name = path.name
  if path.parent.name == CHECKPOINTS and name.isdigit() and path.is_dir():
    return path.parent.parent, int(name)
  if name == CHECKPOINTS and _is_ours(path.parent):
    return path.parent, None  # A run's checkpoints/ directory: the run.
  if re.fullmatch(r"checkpoint_[0-9]+", name) and path.is_dir():
    return path.parent, int(name.removeprefix("checkpoint_"))
  return path, None


def _is_ours(init_from: Path) -> bool:
  """Whether `init_from` is a t5x-optim run's directory (its ``config.gin`` may be gone)."""
  return (init_from / CHECKPOINTS).is_dir()


def checkpoints_seen(source: Source) -> str:
  """The checkpoint steps `source`'s directory holds, as one line (`steps_seen`): what the
  processes of a job compare, since each host reads its own view of the directory."""
  if _is_ours(source.directory):
    return steps_seen(source.directory / CHECKPOINTS)
  return steps_line(t5x_checkpoint_steps(source.directory))


def restored_seen(source: Source) -> str:
  """The checkpoint step `source` restores and a digest of the checksums it records, as one
  line: what the processes of a job compare besides `checkpoints_seen`, since a host's own
  copy may be another run with the same steps.

  The step is the one ``--init_from`` named, else the newest that records checksums (a
  restore skips one that does not). T5X's checkpoints record none: their line is the step.

  Example:
    >>> import tempfile
    >>> run = Path(tempfile.mkdtemp())
    >>> (run / 'checkpoints' / '4' / 'checksums').mkdir(parents=True)
    >>> (run / 'checkpoints' / '4' / STEP_CHECKSUMS).write_text('{"target/w": 7}')
    15
    >>> restored_seen(Source(run, None, {}))
    'step 4 (checksums digest 4e5cb25822a3)'
  """
  if not _is_ours(source.directory):
    steps = t5x_checkpoint_steps(source.directory)
    return steps_line([source.step] if source.step is not None else steps[-1:])
  directory = source.directory / CHECKPOINTS
  names = [path.name for path in directory.iterdir() if path.name.isdigit()]
  for name in sorted(names, key=int, reverse=True):
    if source.step is not None and int(name) != source.step:
      continue
    path = directory / name / STEP_CHECKSUMS
    if path.is_file():
      digest = hashlib.sha256(path.read_bytes()).hexdigest()[:12]
      return f"step {int(name)} (checksums digest {digest})"
  return "no step that records checksums"


def source_seen(source: Source) -> str:
  """The hyper-parameters `source`'s optimizer converts with and a digest of the gin config
  it is built from, as one line: what the processes of a job compare, since each host parses
  its own ``--init_from_gin`` files (a relative path may be another file on one host).

  Example:
    >>> source_seen(Source(Path('run'), None, {'b2': 0.98}, config_sha256='0123456789abcdef'))
    'b2=0.98 (gin config digest 0123456789ab)'
  """
  shown = _describe(source.hparams)
  if source.config_sha256 is None:
    return shown
  return f"{shown} (gin config digest {source.config_sha256[:12]})"


def _refuse_newer(init_from: Path, step: int) -> dict[str, Any] | None:
  """Refuses checkpoint `step` of a t5x-optim run if a newer version wrote it (its job record's
  format, `job.format_problem`): its state may be laid out otherwise under the same names.

  Returns:
    The step's job record (None for a step saved without one).
  """
  with Checkpointer(init_from / CHECKPOINTS) as reader:
    job = reader.recorded_job(step)
  written_by = job and format_problem(job)
  if written_by:
    raise UsageError(
      f"--init_from {init_from}: checkpoint step {step} was written by {written_by}; convert "
      "it with that version."
    )
  return job


def _another_optimizer(
  job: Mapping[str, Any] | None, step: int, given_gin: tuple[str, str | None] | None
) -> str | None:
  """Why checkpoint `step`, whose job record is `job`, did not fit the optimizer
  ``--init_from_gin`` builds (`given_gin`), when the record names another; else None."""
  recorded = (job or {}).get("optimizer")
  if given_gin is None or not given_gin[1] or not recorded or recorded == given_gin[1]:
    return None
  return (
    f"checkpoint step {step} was written by {recorded}, and {given_gin[0]} builds "
    f"{given_gin[1]}: give the gin files of the optimizer that wrote it, or no "
    f"--init_from_gin (the run's {CONFIG_FILE} names it)."
  )


def _settings_advice(
  job: Mapping[str, Any] | None, given_gin: tuple[str, str | None] | None, refusal: str
) -> str:
  """Where ``--init_from_gin`` built the optimizer that the checkpoint's job record (`job`)
  names, yet the `refusal` says its state does not fit the source: the settings that lay
  the state out differ (`low_precision`'s ``min_size``, ``state_dtype``, ``param_modes``),
  not the optimizer."""
  if given_gin is None or not given_gin[1] or (job or {}).get("optimizer") != given_gin[1]:
    return ""
  if "does not fit the source" not in refusal:
    return ""
  return (
    f" {given_gin[0]} builds the optimizer the run names, with a state laid out otherwise: "
    "give the settings the run had (e.g. low_precision's min_size, state_dtype, param_modes), "
    f"or no --init_from_gin (the run's {CONFIG_FILE} holds them)."
  )


def _refuse_another_model(
  init_from: Path, step: int, job: Mapping[str, Any] | None, model: Mapping[str, Any] | None
) -> None:
  """Refuses checkpoint `step`, whose job record is `job`, when it names another model than
  `model`: params of other shapes would not restore, and heads split otherwise (2 x 16 read
  as 4 x 8) would restore into a model that means something else by them."""
  if not job or "model" not in job or model is None:
    return
  changes = model_changes(job["model"], model)
  if changes:
    raise UsageError(
      f"--init_from {init_from}: checkpoint step {step} holds another model: "
      f"{'; '.join(changes)}; --init_from starts a run of the same model with another "
      "optimizer: give the model of the run it names."
    )


def _holds_checkpoints(init_from: Path) -> bool:
  if _is_ours(init_from):
    return True
  return init_from.is_dir() and any(
    path.name.startswith("checkpoint_") for path in init_from.iterdir()
  )


def _flag_names(gin_files: Sequence[str]) -> str:
  return f"--init_from_gin {' '.join(gin_files)}" if gin_files else "its config.gin"


def _build_optimizer(where: str) -> Any:
  """Evaluates the parsed config's job's optimizer alone (``cli.TrainJob.optimizer``:
  ``%OPTIMIZER``, or what the config binds there itself): no mesh, model or data is built."""
  value = _config.job_optimizer()
  if value is None:
    raise UsageError(f"{where} binds no optimizer (cli.TrainJob.optimizer is None).")
  if not isinstance(value, gin.config.ConfigurableReference):
    return value
  # As gin calls it for TrainJob (in no scope): in the reference's own scope, a macro's name
  # (``OPTIMIZER``, where an operative config binds) or ``@fast/optimizers.lion()``'s.
  return value.scoped_configurable_fn()


def source_optimizer(
  init_from: Path, gin_files: Sequence[str], search_paths: Sequence[str], macros: dict[str, Any]
) -> Source:
  """The optimizer definition that wrote `init_from`'s checkpoints, and its `bound_hparams`.

  Built from `gin_files` when given (``--init_from_gin``, e.g.
  ``optimizers/adafactor.gin``), else from the optimizer bindings of the
  directory's ``config.gin`` (a t5x-optim run's operative config, or the one
  T5X's train.py wrote; `t5x_config.optimizer_config`). Only the job's
  optimizer is evaluated (``cli.TrainJob.optimizer``, ``%OPTIMIZER`` unless
  bound otherwise): the source run's mesh, model and data are never built, so
  neither its device count nor its data need to exist here. The optimizer is
  None for T5X's legacy Adafactor, recognised by its state's layout, and for
  a directory without a config. Of a t5x-optim run resumed with other numbers
  (``optax.adam.b2``, say), each step's hyper-parameters are read from the
  config of the start that wrote it (`Source.step_hparams`), a copy that
  still has the digest its step records. Parsing leaves
  gin's config cleared.

  Raises:
    UsageError: the config builds its optimizer from modules t5x_optim
      cannot import, binds none, or fails to build it (one line naming
      ``--init_from`` or ``--init_from_gin``).

  Example:
    >>> source_optimizer(Path('/nonexistent'), [], [], {})
    Traceback (most recent call last):
    ...
    t5x_optim.cli.loop.train.UsageError: --init_from /nonexistent holds no checkpoint: neither a t5x-optim run's checkpoints/ nor T5X's checkpoint_<step> directories, nor one step of either.
  """
  init_from, step = _located(_as_path(init_from))
  if not _holds_checkpoints(init_from):
    raise UsageError(
      f"--init_from {init_from} holds no checkpoint: neither a t5x-optim run's "
      f"{CHECKPOINTS}/ nor T5X's checkpoint_<step> directories, nor one step of either."
    )
  where = f"--init_from {init_from}: {_flag_names(gin_files)}"
  config = init_from / CONFIG_FILE
  optimizer, hparams, identity, digest = _parsed(config, gin_files, search_paths, macros, where)
  step_hparams = {}
  if not gin_files and config.is_file() and _is_ours(init_from):
    by_text = {config.read_text(): hparams}
    for number, found in _step_configs(init_from, step).items():
      if isinstance(found, UsageError):  # Refused only if its step is the one restored.
        step_hparams[number] = found
        continue
      path, text = found
      if text not in by_text:
        try:
          by_text[text] = _parsed(path, [], search_paths, macros, f"--init_from {path}")[1]
        except UsageError as error:
          by_text[text] = error
      if by_text[text] != hparams:
        step_hparams[number] = by_text[text]
  given = (_flag_names(gin_files), identity) if gin_files else None
  return Source(init_from, optimizer, hparams, step, step_hparams, given, digest)


def _step_configs(init_from: Path, only: int | None) -> dict[int, tuple[Path, str] | UsageError]:
  """Each committed step's operative config (step `only`'s alone, if given), as its file and
  text: that of the start that wrote it (`recorded_config`), where the step records one.

  A step whose config no copy still holds gets the `UsageError` naming what
  changed, since its hyper-parameters are then unknown. A step that a newer
  version recorded is left out, for `_refuse_newer` to refuse.
  """
  found: dict[int, tuple[Path, str] | UsageError] = {}
  texts: dict[Path, str | None] = {}

  def read(path: Path) -> str | None:
    if path not in texts:
      texts[path] = path.read_text() if path.is_file() else None
    return texts[path]

  with Checkpointer(init_from / CHECKPOINTS) as reader:
    for step in reader.all_steps() if only is None else [only]:
      try:
        job = reader.recorded_job(step) if reader.is_committed(step) else None
      except CheckpointError:
        continue
      if job and format_problem(job):  # Its fields are not this version's: `_refuse_newer`.
        continue
      config = recorded_config(init_from, job or {}, read=read)
      if isinstance(config, LostConfig):
        found[step] = _lost_config(init_from, step, config)
      elif config is not None:
        found[step] = config
  return found


def _lost_config(init_from: Path, step: int, lost: LostConfig) -> UsageError:
  """The refusal of a step whose config copy changed or is gone (`_step_configs`)."""
  return UsageError(
    f"--init_from {init_from}: checkpoint step {step} was written with the config {lost.name}, "
    f"which {lost.why}, and {CONFIG_FILE} {lost.latest}, so the hyper-parameters that wrote "
    f"the step are unknown: put {lost.name} back as it was, or pass --init_from_gin with gin "
    "files of the optimizer and numbers that wrote it."
  )


def _parsed(
  config: Path,
  gin_files: Sequence[str],
  search_paths: Sequence[str],
  macros: dict[str, Any],
  where: str,
) -> tuple[Any, dict[str, Any], str | None, str | None]:
  """``(optimizer, hparams, identity, digest)`` built from `gin_files`, else from `config`'s
  optimizer bindings; the identity is `config.optimizer_identity`'s, the digest that of the
  parsed config (``gin.config_str()``; of `config`'s text for T5X's legacy Adafactor).

  The optimizer is None, and the hparams are those T5X's config gives, for
  T5X's legacy Adafactor; both are empty for a directory without a config.
  Gin's config is left cleared.
  """
  bindings: list[str] = []
  if not gin_files and config.is_file():
    try:
      found = optimizer_config(config.read_text(), str(config))
    except ValueError as error:
      raise UsageError(f"--init_from {' '.join(str(error).split())}") from error
    except _config.PARSE_ERRORS as error:
      detail, line = _config.parse_problem(error)
      raise UsageError(
        f"--init_from {config.parent}: {config} does not parse: {detail} (line {line})"
      ) from error
    if found.gin is None:
      hparams = {k: v for k, v in found.hparams.items() if k in CONVERSION_HPARAMS}
      return None, hparams, None, config_digest(config.read_text())
    # Bindings follow _config.BINDING_IMPORTS, which enables dynamic registration already;
    # one entry, parsed at once as the config it comes from.
    lines = [line for line in found.gin.splitlines() if not line.startswith("from __gin__")]
    bindings = ["\n".join(lines)]
  if not gin_files and not bindings:
    return None, {}, None, None
  try:
    _config.parse_config(
      gin_files=gin_files, gin_bindings=bindings, search_paths=search_paths, macros=macros
    )
    digest = config_digest(gin.config_str())
    return _build_optimizer(where), bound_hparams(), _config.optimizer_identity(), digest
  except UsageError:
    raise
  except Exception as error:  # noqa: BLE001 - gin raises what the configurables raise
    text = " ".join(str(error).split())
    raise UsageError(f"{where} does not build the source's optimizer: {text}") from error
  finally:
    gin.clear_config()


_LISTINGS = 3
"""How many times `--init_from` lists a run's steps, listing them again after a step was
deleted while it was read (the run still training there, its rotation removing it)."""
VANISHED = "deleted while it was read (is the run that wrote it still training?)"
"""Why `--init_from` skipped a step that was gone when its read failed."""

_PYTHON_ADVICE = re.compile(r"pass source(_def)?= \([^)]*\)( to [^.;]*)?")


def initial_state_fn(
  source: Source,
  abstract_state: TrainState,
  stream: TextIO,
  *,
  target_hparams: Mapping[str, Any] | None = None,
  model: Mapping[str, Any] | None = None,
) -> Callable[[], TrainState]:
  """A function restoring `source`'s checkpoint into `abstract_state`'s optimizer.

  The checkpoint is the step `source` names, else the newest: of a
  t5x-optim directory the newest intact one, each newer step skipped
  (incomplete or corrupt) named on `stream` with why; nothing in the
  directory is changed. `target_hparams` are the new optimizer's
  (`bound_hparams` of the job's config). What was converted, with which
  hyper-parameters, and what started fresh is written to `stream`. A moment
  the old optimizer did not keep (Adam's ``mu`` after an Adafactor without
  momentum) starts from zero. A checkpoint that cannot be restored, or whose
  job record names another `model` (the job's, as `job.job_record` records
  it), raises `UsageError` (one line on the command line).
  """

  init_from = source.directory
  ours = _is_ours(init_from)
  directory = init_from / CHECKPOINTS if ours else init_from

  def restore() -> TrainState:
    if source.step is not None or not ours:
      return restore_step(source.step)
    skipped: list[tuple[int, str]] = []
    for _ in range(_LISTINGS):
      with Checkpointer(directory) as reader:
        steps = reader.all_steps()
        committed = {step for step in steps if reader.is_committed(step)}
      seen = {step for step, _ in skipped}
      vanished = False
      for step in (step for step in reversed(steps) if step not in seen):
        if step not in committed:
          skipped.append((step, INCOMPLETE))
          continue
        try:
          return restore_step(step, skipped=skipped)
        except UsageError:
          raise
        except (ValueError, FileNotFoundError) as error:  # a CheckpointError, or a step gone
          # `restore_step` raises any other error here only for a step it found gone.
          vanished = not isinstance(error, CheckpointError) or not committed_now(step)
          skipped.append((step, VANISHED if vanished else skip_reason(error)))
          if vanished:  # Newer steps may have come: the directory is listed again.
            break
      if not vanished:
        break
    tried = "; ".join(f"step {step}: {why}" for step, why in skipped) or "no steps"
    raise UsageError(f"--init_from {init_from} holds no intact checkpoint ({tried}).")

  def committed_now(step: int) -> bool:
    with Checkpointer(directory) as reader:
      return reader.is_committed(step)

  def restore_step(
    step: int | None, *, skipped: Sequence[tuple[int, str]] | None = None
  ) -> TrainState:
    """Restores `step` (None: the newest), after naming the `skipped` steps.

    With `skipped` (not None), a step whose data are corrupt raises its
    `CheckpointError`, for the caller to skip it.
    """
    old_hparams = source.hparams_of(step)
    job = None
    try:
      if ours and step is not None:
        job = _refuse_newer(init_from, step)
        _refuse_another_model(init_from, step, job, model)
      state, report = restore_converted(
        directory,
        abstract_state,
        source=source.optimizer,
        step=step,
        missing="init",
        source_hparams=old_hparams,
        target_hparams=target_hparams,
      )
    except UsageError:
      raise
    except (ValueError, FileNotFoundError) as error:
      if skipped is not None and (isinstance(error, CheckpointError) or not committed_now(step)):
        raise
      text = " ".join(str(error).split())
      if step is not None and not isinstance(error, CheckpointError):
        text = _another_optimizer(job, step, source.given_gin) or text + _settings_advice(
          job, source.given_gin, text
        )
      if source.optimizer is None:  # No config told which optimizer wrote it.
        text = _PYTHON_ADVICE.sub(
          f"it has no {CONFIG_FILE} that names the optimizer which wrote it: pass "
          "--init_from_gin with a gin file of that optimizer (e.g. optimizers/adamw.gin)",
          text,
        )
      raise UsageError(f"--init_from {init_from}: {text}") from error
    for number, why in skipped or ():
      stream.write(f"init_from:       skipped checkpoint step {number} of {init_from}: {why}\n")
    stream.write(f"init_from:       {init_from} at step {int(state.step)}\n")
    old = _describe(old_hparams)
    stream.write(f"  hparams: old {old}, new {_describe(target_hparams)}\n")
    stream.write("".join(f"  {line}\n" for line in str(report).splitlines()))
    return state

  return restore
