"""What makes a run the same job on resume, and what a resume may change.

Every checkpoint of `t5x-optim train` records its job (`job_record`, saved
with the step by `Checkpointer(job=...)`): the model's sizes, the optimizer
(the gin configurables ``cli.TrainJob.optimizer`` reaches, its learning rate and
schedule left out, and how they are named), the optimizer state's layout (the class of each state node, each
leaf's dtype and shape), the config file of the start that wrote it, the
text data's summary, the versions of the libraries that ran it and
``jax_enable_x64`` (a resume with another is refused: `x64_problem`). A
resume compares the checkpoint's record with the new run's (`identity_problem`):
another model, optimizer or layout is refused, since the state would be read
as another's (adam's E[g^2] as adabelief's variance; 4 heads of 8 read from 2
of 16, whose kernels have the same shapes). Everything else may change and is
reported (`config_changes`): total steps, cadences, the learning rate and
other numeric hyper-parameters, the data, the seed, the devices and mesh;
so are other text under the same path and other library versions
(`version_changes`).

Example:
  >>> old = {'model': {'num_heads': 2}, 'optimizer': 'optax.adam', 'state': {}}
  >>> new = {'model': {'num_heads': 4}, 'optimizer': 'optax.adam', 'state': {}}
  >>> identity_problem(old, new)
  'cli.TransformerConfig.num_heads is 2 there, 4 now'
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Callable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any, NamedTuple

import jax
from flax import traverse_util
from gin import config_parser

__all__ = [
  "CONFIG_FILE",
  "FORMAT",
  "LostConfig",
  "OPTIMIZER_NAMING",
  "config_changes",
  "config_digest",
  "config_file_name",
  "format_problem",
  "identity_problem",
  "jax_settings",
  "job_record",
  "keep_edited_config",
  "package_versions",
  "recorded_config",
  "state_layout",
  "version_changes",
  "x64_problem",
]

CONFIG_FILE = "config.gin"
"""The model directory's copy of the latest start's config (each start's is ``config_<step>.gin``)."""

FORMAT = 1
"""The version of the record's format."""
OPTIMIZER_NAMING = 2
"""How a record's ``optimizer`` names the job's optimizer (its ``optimizer_naming``): 2, what
``cli.TrainJob.optimizer`` is bound to, each configurable as gin imported it
(`config.optimizer_identity`). Records of earlier versions have none: they named
``%OPTIMIZER`` whatever the job bound, each configurable as written
(`config.earlier_optimizer_identities`)."""
_SHOWN = 4
_PACKAGES = ("t5x-optim", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint")


def _node_classes(tree: Any, path: tuple[str, ...], out: dict[str, str]) -> None:
  if isinstance(tree, tuple) and hasattr(tree, "_fields"):
    out["/".join(path)] = type(tree).__name__
    for name in tree._fields:
      _node_classes(getattr(tree, name), (*path, name), out)
  elif dataclasses.is_dataclass(tree) and not isinstance(tree, type):
    out["/".join(path)] = type(tree).__name__
    for field in dataclasses.fields(tree):
      _node_classes(getattr(tree, field.name), (*path, field.name), out)
  elif isinstance(tree, (tuple, list)):
    for i, child in enumerate(tree):
      _node_classes(child, (*path, str(i)), out)
  elif isinstance(tree, Mapping):
    for key, child in tree.items():
      _node_classes(child, (*path, str(key)), out)


def state_layout(abstract_state: Any) -> dict[str, dict[str, str]]:
  """The optimizer state's layout: the class of each node and each leaf's ``dtype[shape]``.

  Args:
    abstract_state: a `TrainState` (of `jax.ShapeDtypeStruct`s or arrays).

  Example:
    >>> import jax.numpy as jnp
    >>> from t5x_optim import optimizers
    >>> layout = state_layout(optimizers.adam(0.1).create({'w': jnp.ones(2)}))
    >>> layout['classes'], layout['leaves']['0/nu/w']
    ({'0': 'ScaleByAdamState', '1': 'EmptyState'}, 'float32[2]')
  """
  optimizer = getattr(abstract_state, "optimizer", abstract_state)
  classes: dict[str, str] = {}
  _node_classes(optimizer.state.param_states, (), classes)
  param_states = optimizer.state_dict()["state"].get("param_states", {})
  leaves = traverse_util.flatten_dict(param_states, sep="/") if param_states else {}
  return {
    "classes": classes,
    "leaves": {
      path: f"{leaf.dtype.name}[{','.join(map(str, leaf.shape))}]"
      for path, leaf in sorted(leaves.items())
    },
  }


def config_digest(text: str) -> str:
  """The digest of a config's text that `job_record` records as ``config_sha256``.

  Example:
    >>> config_digest('A = 1')[:12]
    'd585f16be257'
  """
  return hashlib.sha256(text.encode()).hexdigest()


def job_record(
  *, model: Any, optimizer: str, abstract_state: Any, config_text: str, data: str | None = None
) -> dict[str, Any]:
  """The record saved with every checkpoint of a run (the loop adds ``config_file``,
  the name of the start's copy of its config in the model directory).

  Args:
    model: the `TransformerConfig`.
    optimizer: the optimizer's gin structure (`config.optimizer_identity`).
    abstract_state: the train state (`Setup.abstract_state`).
    config_text: the operative gin config of this start.
    data: the text data's summary (``data_summary``: files, bytes, digest) where
      the job reads text; a resume on other text says so.
  """
  record = {
    "format": FORMAT,
    "model": dataclasses.asdict(model),
    "optimizer": optimizer,
    "optimizer_naming": OPTIMIZER_NAMING,
    "state": state_layout(abstract_state),
    "config_sha256": config_digest(config_text),
    "versions": package_versions(),
    "jax_enable_x64": bool(jax.config.values["jax_enable_x64"]),
  }
  if data is not None:
    record["data"] = data
  return record


def package_versions() -> dict[str, str]:
  """The installed versions of this package and of the libraries whose numerics a step runs.

  Example:
    >>> sorted(package_versions())[:3]
    ['flax', 'jax', 'jaxlib']
  """
  versions = {}
  for name in _PACKAGES:
    try:
      versions[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
      continue
  return versions


_JAX_SETTINGS = (
  "jax_enable_x64",
  "jax_default_matmul_precision",
  "jax_numpy_dtype_promotion",
  "jax_numpy_rank_promotion",
  "jax_default_prng_impl",
  "jax_threefry_partitionable",
  "jax_random_seed_offset",
  "jax_softmax_custom_jvp",
  "jax_disable_most_optimizations",
  "jax_debug_nans",
  "jax_debug_infs",
  "jax_disable_jit",
)
"""jax's settings that change the program a step traces or compiles, the random keys it makes,
or what it does on a bad value."""


def jax_settings() -> dict[str, str]:
  """jax's `_JAX_SETTINGS` as this process has them (environment variables or
  ``jax.config.update``), each as its ``repr``.

  Example:
    >>> jax_settings()["jax_enable_x64"]
    'False'
  """
  return {
    name: repr(jax.config.values[name]) for name in _JAX_SETTINGS if name in jax.config.values
  }


def version_changes(there: Mapping[str, str], now: Mapping[str, str]) -> list[str]:
  """Each package whose version differs, ``name old -> new`` (``none`` where not installed).

  Example:
    >>> version_changes({'jax': '0.4.1', 'optax': '0.2.4'}, {'jax': '0.4.1', 'optax': '0.2.5'})
    ['optax 0.2.4 -> 0.2.5']
  """
  return [
    f"{name} {there.get(name, 'none')} -> {now.get(name, 'none')}"
    for name in sorted(set(there) | set(now))
    if there.get(name) != now.get(name)
  ]


def _first_differences(
  name: str,
  there: Mapping[str, str],
  now: Mapping[str, str],
  leaves: tuple[Mapping[str, str], Mapping[str, str]] = ({}, {}),
) -> list[str]:
  """Each path whose entry differs, with both sides; a path that is a leaf on one side
  (`leaves`: there's and now's) is named as that array."""
  out = []
  for path in sorted(set(there) | set(now)):
    old, new = (
      side.get(path) or (f"an array {leaf[path]}" if path in leaf else "nothing")
      for side, leaf in zip((there, now), leaves, strict=True)
    )
    if old != new:
      out.append(f"{name} {path} is {old} there, {new} now")
  return out


def format_problem(recorded: Mapping[str, Any]) -> str | None:
  """What keeps this version from reading a job record (from `job_record`), or None.

  A record of a higher format comes from a newer t5x-optim, whose fields may
  mean other things (a state laid out otherwise under the same names), so it
  is not compared as this version's; nor is one whose format is no number.
  A record without a format is compared as this version's.

  Example:
    >>> format_problem({'format': FORMAT}) is None
    True
    >>> format_problem({'format': FORMAT + 1})
    'a newer t5x-optim (job record format 2; this version reads format 1)'
  """
  written = recorded.get("format", FORMAT)
  if type(written) is int and written <= FORMAT:
    return None
  if type(written) is int:
    return f"a newer t5x-optim (job record format {written}; this version reads format {FORMAT})"
  return f"another t5x-optim (job record format {written!r}; this version reads format {FORMAT})"


def x64_problem(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> str | None:
  """How `current`'s ``jax_enable_x64`` differs from `recorded`'s (both from `job_record`), or
  None (also for a record of an earlier version, which has none).

  With it on, jax makes params, counters and state float64 and int64: the checkpoint's leaves
  would be read in other dtypes, or trained on in another precision.

  Example:
    >>> x64_problem({'jax_enable_x64': False}, {'jax_enable_x64': True})
    'was written with jax_enable_x64 False, this run has True'
    >>> x64_problem({}, {'jax_enable_x64': True}) is None
    True
  """
  there, now = recorded.get("jax_enable_x64"), current.get("jax_enable_x64")
  if there is None or now is None or there == now:
    return None
  return f"was written with jax_enable_x64 {there}, this run has {now}"


def model_changes(there: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
  """Each field of the model (a job record's ``model``) that differs, with both sides.

  Example:
    >>> model_changes({'num_heads': 2, 'head_dim': 16}, {'num_heads': 4, 'head_dim': 16})
    ['cli.TransformerConfig.num_heads is 2 there, 4 now']
  """
  return [
    f"cli.TransformerConfig.{key} is {there.get(key)} there, {now.get(key)} now"
    for key in sorted(set(there) | set(now))
    if there.get(key) != now.get(key)
  ]


def identity_problem(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> str | None:
  """What makes `current` another job than `recorded` (both from `job_record`), or None.

  Compares the model, then the optimizer, then the optimizer state's layout,
  and names the first differences with both sides (the checkpoint's first).
  """
  problems = model_changes(recorded.get("model", {}), current.get("model", {}))
  if not problems and recorded.get("optimizer") != current.get("optimizer"):
    problems.append(
      f"the optimizer is {recorded.get('optimizer')} there, {current.get('optimizer')} now"
    )
  if not problems:
    old_state, new_state = recorded.get("state", {}), current.get("state", {})
    problems = _first_differences(
      "the optimizer state's node",
      old_state.get("classes", {}),
      new_state.get("classes", {}),
      (old_state.get("leaves", {}), new_state.get("leaves", {})),
    ) or _first_differences(
      "the optimizer state's leaf", old_state.get("leaves", {}), new_state.get("leaves", {})
    )
  if not problems:
    return None
  more = f" ({len(problems) - _SHOWN} more)" if len(problems) > _SHOWN else ""
  return "; ".join(problems[:_SHOWN]) + more + _schedule_hint(problems)


def _schedule_hint(problems: list[str]) -> str:
  """Advice when a learning rate changed between a number and a schedule, which optax keeps
  in the state (`ScaleByScheduleState`) only for a schedule."""
  swapped = (
    "ScaleByScheduleState there, EmptyState now",
    "EmptyState there, ScaleByScheduleState now",
  )
  if not any(problem.endswith(swapped) for problem in problems):
    return ""
  return (
    " (a learning rate that was a schedule is a number now, or the other way round: keep its "
    "kind; a constant one as a schedule is `LEARNING_RATE = @optax.constant_schedule()` with "
    "`optax.constant_schedule.value = 0.001`)"
  )


class _Gin:
  """A reference or macro of a parsed gin value, shown as gin writes it."""

  def __init__(self, text: str):
    self.text = text

  def __repr__(self) -> str:
    return self.text


class _AsText(config_parser.ParserDelegate):
  def configurable_reference(self, scoped_configurable_name: str, evaluate: bool) -> _Gin:
    return _Gin(f"@{scoped_configurable_name}{'()' if evaluate else ''}")

  def macro(self, macro_name: str) -> _Gin:
    return _Gin(f"%{macro_name}")


_Binding = tuple[str, str, str]
"""A binding's scope, selector and argument name (``''`` for a macro)."""


def _bindings(text: str) -> dict[_Binding, str]:
  """``{(scope, selector, arg): value}`` of a gin config, parsed without importing anything."""
  out: dict[_Binding, str] = {}
  for statement in config_parser.ConfigParser(text, _AsText()):
    if isinstance(statement, config_parser.BindingStatement):
      key = (statement.scope or "", statement.selector, statement.arg_name or "")
      out[key] = repr(statement.value)
  return out


def _name(binding: _Binding) -> str:
  scope, selector, arg = binding
  name = f"{scope}/{selector}" if scope else selector
  return f"{name}.{arg}" if arg else name


def config_changes(old_text: str, new_text: str) -> list[str]:
  """The bindings that differ between two gin configs, as ``name old -> new``.

  An operative config lists each configurable once per scope it was called
  in. A scoped change equal to the unscoped one is shown once, unscoped; the
  arguments of an unscoped call that one side alone made, of a configurable
  both sides call in a scope, are left out (the runs used the scoped call;
  operative configs of t5x-optim before 2026-11-29 also list the optimizer
  unscoped, from its description).

  Example:
    >>> config_changes('TOTAL_STEPS = 40\\nA = 1', 'TOTAL_STEPS = 60\\nA = 1')
    ['TOTAL_STEPS 40 -> 60']
  """
  old, new = _bindings(old_text), _bindings(new_text)

  def calls(side: dict[_Binding, str]) -> set[tuple[str, str]]:
    return {(scope, selector) for scope, selector, arg in side if arg}

  scoped_on_both = {sel for scope, sel in calls(old) & calls(new) if scope}
  one_side_only = calls(old) ^ calls(new)

  def shown(binding: _Binding) -> bool:
    scope, selector, arg = binding
    change = old.get(binding), new.get(binding)
    if change[0] == change[1]:
      return False
    if scope:
      return change != (old.get(("", selector, arg)), new.get(("", selector, arg)))
    return not (arg and ("", selector) in one_side_only and selector in scoped_on_both)

  return [
    f"{_name(b)} {old.get(b, '(unbound)')} -> {new.get(b, '(unbound)')}"
    for b in sorted(set(old) | set(new), key=_name)
    if shown(b)
  ]


class LostConfig(NamedTuple):
  """A checkpoint's config that no copy in the model directory still holds (`recorded_config`)."""

  name: str
  """The copy the checkpoint names (its start's)."""
  why: str
  """``is gone``, or ``has changed since (...)`` with both digests."""
  latest: str
  """What `CONFIG_FILE` is: ``is gone``, or ``is another config``."""


def _read(path: Path) -> str | None:
  return path.read_text() if path.is_file() else None


def recorded_config(
  model_dir: Path, record: Mapping[str, Any], *, read: Callable[[Path], str | None] = _read
) -> tuple[Path, str] | LostConfig | None:
  """The config that wrote a checkpoint of `model_dir` whose job record is `record`.

  The record names its start's copy (``config_file``) and that config's
  digest (``config_sha256``). The copy is taken only if it still has that
  text, else `CONFIG_FILE` if it has (the latest start's copy); otherwise
  the config is lost (`LostConfig`): its hyper-parameters and its changes are
  unknown. A record without a digest takes its copy as it is.

  Args:
    model_dir: the run's model directory.
    record: the checkpoint's job record (`job_record` and ``config_file``).
    read: a file's text, or None where there is none.

  Returns:
    The copy's path and text; a `LostConfig`; or None where the record names
    no copy, or names one without a digest that is gone.

  Example:
    >>> import tempfile
    >>> model_dir = Path(tempfile.mkdtemp())
    >>> _ = (model_dir / 'config.gin').write_text('A = 1')
    >>> record = {'config_file': 'config_0.gin', 'config_sha256': config_digest('A = 1')}
    >>> recorded_config(model_dir, record)[0].name
    'config.gin'
    >>> recorded_config(model_dir, {**record, 'config_sha256': config_digest('A = 2')}).why
    'is gone'
  """
  name, digest = record.get("config_file"), record.get("config_sha256")
  if not isinstance(name, str):
    return None
  own = read(model_dir / name)
  if not isinstance(digest, str):
    return None if own is None else (model_dir / name, own)
  if own is not None and config_digest(own) == digest:
    return model_dir / name, own
  latest = read(model_dir / CONFIG_FILE)
  if latest is not None and config_digest(latest) == digest:
    return model_dir / CONFIG_FILE, latest
  why = (
    "is gone"
    if own is None
    else f"has changed since (sha256 {digest[:12]} recorded with the step, "
    f"{config_digest(own)[:12]} now)"
  )
  return LostConfig(name, why, "is gone" if latest is None else "is another config")


_START_COPY = re.compile(r"config_\d+(-\d+)?\.gin")
"""The name of a start's config copy (`config_file_name`)."""


def keep_edited_config(model_dir: Path) -> Path | None:
  """Copies `CONFIG_FILE` to ``config_edited.gin`` (or ``config_edited-<n>.gin``, a new name)
  when no start wrote it, its text being none of the starts' copies: an edit by hand, which
  no run reads and the next start overwrites. Returns the copy, or None.

  Example:
    >>> import tempfile
    >>> model_dir = Path(tempfile.mkdtemp())
    >>> (model_dir / 'config_0.gin').write_text('A = 1')
    5
    >>> (model_dir / CONFIG_FILE).write_text('A = 2')
    5
    >>> keep_edited_config(model_dir).name
    'config_edited.gin'
  """
  text = _read(model_dir / CONFIG_FILE)
  if text is None or any(
    _START_COPY.fullmatch(copy.name) and _read(copy) == text for copy in model_dir.iterdir()
  ):
    return None
  name, n = "config_edited.gin", 1
  while (model_dir / name).exists():
    n += 1
    name = f"config_edited-{n}.gin"
  (model_dir / name).write_text(text)
  return model_dir / name


def config_file_name(model_dir: Path, start: int, text: str) -> str:
  """The name of this start's config copy: ``config_<first step>.gin``, unique in `model_dir`.

  A start at the same step with the same config reuses its name; with
  another, the name gets a suffix, so no earlier config is overwritten.

  Example:
    >>> import tempfile
    >>> config_file_name(Path(tempfile.mkdtemp()), 40, 'A = 1')
    'config_40.gin'
  """
  name, n = f"config_{start}.gin", 1
  while (model_dir / name).exists() and (model_dir / name).read_text() != text:
    n += 1
    name = f"config_{start}-{n}.gin"
  return name
