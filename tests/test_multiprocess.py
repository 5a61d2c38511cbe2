"""`t5x-optim train` as 2 processes x 4 simulated CPU devices (JAX's multi-controller runtime).

Every test starts real processes on 127.0.0.1, as the manual's recipe does (docs/cli.md).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest
from _subprocesses import communicate_all, free_port, with_run_compilation_cache, with_xla_flags
from test_cli import _scalars

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 240
# A constant rate: the default schedule's constants, and so the compiled step, follow
# TOTAL_STEPS; with it, each device layout's step compiles once for the whole run.
TINY_TEXT = ["train", "--gin_file", "examples/tiny.gin", "--data", "hamlet.txt"]
TINY_TEXT += ["--gin_bindings", "LEARNING_RATE = 5e-3"]
HEARTBEAT_BOUND_S = 60
"""The survivor's exit after its peer is killed: the 10 s heartbeat plus a loaded machine."""


def _env(devices: int, *, run_cache: bool = True) -> dict[str, str]:
  env = with_xla_flags(
    dict(os.environ, JAX_PLATFORMS="cpu"), f"--xla_force_host_platform_device_count={devices}"
  )
  env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
  return with_run_compilation_cache(env) if run_cache else env


def _start(args: Sequence[str], *, processes: int, cwd: Path) -> list[subprocess.Popen]:
  """`processes` processes of one job, each with 8 / `processes` devices."""
  flags: list[list[str]] = [[]]
  if processes > 1:
    address = f"127.0.0.1:{free_port()}"
    flags = [
      ["--coordinator_address", address, "--num_processes", str(processes), "--process_id", str(i)]
      for i in range(processes)
    ]
  return [
    subprocess.Popen(
      [sys.executable, "-m", "t5x_optim_launcher", *args, *extra],
      cwd=cwd,
      env=_env(8 // processes),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for extra in flags
  ]


def _train(args: Sequence[str], *, processes: int, cwd: Path) -> list[tuple[int, str, str]]:
  results = communicate_all(_start(args, processes=processes, cwd=cwd), TIMEOUT)
  for code, out, err in results:
    assert code == 0, f"exit {code}\n{out[-2000:]}\n{err[-3000:]}"
  return results


def _checkpoint_steps(model_dir: Path) -> list[int]:
  directory = model_dir / "checkpoints"
  return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def test_two_processes_train_like_one_and_only_process_0_writes(tmp_path):
  steps = ["--gin_bindings", "TOTAL_STEPS = 20", "--gin_bindings", "cli.TrainJob.log_every = 1"]
  args = [*TINY_TEXT, *steps, "--metrics_every", "10"]
  one = _train([*args, "--model_dir", str(tmp_path / "one")], processes=1, cwd=tmp_path)
  two = _train([*args, "--model_dir", str(tmp_path / "two")], processes=2, cwd=tmp_path)
  assert "devices:         8 x cpu (simulated) in 2 processes of 4" in two[0][1]
  # Process 1 prints none of the run's lines (gloo's C++ threads print connection lines,
  # sometimes interleaved).
  ours = r"^(model_dir|devices|mesh|optimizer|params|step|eval|loss|checkpoint|interrupted)"
  assert not re.search(ours, two[1][1], re.M), two[1][1]
  assert "loss 5.8711 -> " in one[0][1] and "loss 5.8711 -> " in two[0][1]
  for kind in ("train", "eval"):
    assert len(list((tmp_path / "two" / kind).iterdir())) == 1, "one event file, process 0's"
    expected, got = _scalars(tmp_path / "one" / kind), _scalars(tmp_path / "two" / kind)
    assert set(got) == set(expected)
    for tag in set(expected) - {"steps_per_sec"}:
      assert [s for s, _ in got[tag]] == [s for s, _ in expected[tag]]
      # Not bit-exact: gloo adds the partial sums of a cross-process all-reduce in another
      # order than XLA's in-process all-reduce (float32 rounding: ~1e-7 relative per step).
      np.testing.assert_allclose(
        [v for _, v in got[tag]], [v for _, v in expected[tag]], rtol=2e-5, err_msg=tag
      )
  assert (tmp_path / "two" / "config.gin").is_file()
  assert _checkpoint_steps(tmp_path / "two") == [20]


def _wait_for_checkpoint(model_dir: Path, procs: list[subprocess.Popen]) -> None:
  deadline = time.monotonic() + TIMEOUT
  while time.monotonic() < deadline:
    if (model_dir / "checkpoints").is_dir() and _checkpoint_steps(model_dir):
      return
    assert all(p.poll() is None for p in procs), communicate_all(procs, TIMEOUT)
    time.sleep(0.5)
  pytest.fail(f"no checkpoint in {TIMEOUT} s")


def _resume(model_dir: Path, total: int, processes: int, cwd: Path) -> str:
  args = [*TINY_TEXT, "--model_dir", str(model_dir), "--gin_bindings", f"TOTAL_STEPS = {total}"]
  out = _train(args, processes=processes, cwd=cwd)[0][1]
  assert f"(resuming from the checkpoint at step {total - 5})" in out, out
  assert f"steps {total - 5} -> {total}," in out
  return out


def _long_run(tmp_path: Path) -> tuple[Path, list[subprocess.Popen]]:
  """A 2-process run that checkpoints every 5 steps, once its first checkpoint is written."""
  model_dir = tmp_path / "run"
  args = [*TINY_TEXT, "--model_dir", str(model_dir), "--gin_bindings", "TOTAL_STEPS = 100000"]
  args += ["--gin_bindings", "cli.TrainJob.checkpoint_every = 5"]
  procs = _start(args, processes=2, cwd=tmp_path)
  _wait_for_checkpoint(model_dir, procs)
  return model_dir, procs


def test_kill_one_process_then_resume_in_one_then_two_processes(tmp_path):
  model_dir, procs = _long_run(tmp_path)
  procs[1].send_signal(signal.SIGKILL)
  killed = time.monotonic()
  try:
    procs[0].wait(timeout=HEARTBEAT_BOUND_S)
  except subprocess.TimeoutExpired:
    procs[0].kill()
    pytest.fail(f"process 0 still ran {HEARTBEAT_BOUND_S} s after process 1 was killed")
  survived = time.monotonic() - killed
  assert procs[0].returncode != 0 and survived < HEARTBEAT_BOUND_S
  communicate_all(procs, TIMEOUT)
  latest = _checkpoint_steps(model_dir)[-1]
  # The killed 2-process run's checkpoint resumes in 1 process, and that one's in 2.
  for processes in (1, 2):
    latest += 5
    _resume(model_dir, latest, processes, tmp_path)
  assert _checkpoint_steps(model_dir)[-1] == latest
  # A new 2-process run from that run's checkpoint: only process 0 reports the conversion.
  args = [*TINY_TEXT, "--init_from", str(model_dir), "--model_dir", str(tmp_path / "next")]
  args += ["--gin_bindings", f"TOTAL_STEPS = {latest + 5}"]
  (_, first, _), (_, second, _) = _train(args, processes=2, cwd=tmp_path)
  assert f"init_from:       {model_dir} at step {latest}" in first, first
  assert "init_from" not in second, second
  assert _checkpoint_steps(tmp_path / "next") == [latest + 5]


def test_ctrl_c_in_one_process_stops_both_at_the_same_step(tmp_path):
  model_dir, procs = _long_run(tmp_path)
  procs[0].send_signal(signal.SIGINT)
  results = communicate_all(procs, TIMEOUT)
  assert [code for code, _, _ in results] == [130, 130], results[0][2][-2000:]
  stopped = int(re.search(r"^interrupted at step (\d+)$", results[0][1], re.M).group(1))
  assert stopped % 5 == 0 and _checkpoint_steps(model_dir)[-1] == stopped


@pytest.mark.parametrize(
  "flags, message",
  [
    (["--num_processes", "2", "--process_id", "0"], "--model_dir is required"),
    (["--num_processes", "2", "--process_id", "2", "--model_dir", "x"], "--process_id 2 is not"),
  ],
)
def test_bad_process_flags_are_one_line(flags, message, tmp_path, capsys):
  from t5x_optim.cli import main  # noqa: PLC0415

  assert main(["train", *flags]) == 2
  err = capsys.readouterr().err
  assert len(err.splitlines()) == 1 and message in err, err


_THREE_CALLS = """
import sys
from t5x_optim.cli import main
argv = sys.argv[1:]
other = [*argv]
other[other.index("--coordinator_address") + 1] = "127.0.0.1:1"
statuses = [main(argv), main([*argv, "--gin_bindings", "TOTAL_STEPS = 6"]), main(other)]
print("statuses", *statuses, flush=True)
"""
"""Each process of a job: `main` twice in its job (3 steps, then 3 more), then once with the
coordinator of another job."""


def test_a_process_runs_main_again_in_its_job_and_joins_no_other(tmp_path):
  """A second `main` call in a process of a multi-process job failed with jax's advice to call
  jax.distributed.initialize before any jax call, though the process had joined the job: it
  now runs in that job, and a call with another job's flags is refused in one line."""
  address, model_dir = f"127.0.0.1:{free_port()}", tmp_path / "run"
  args = [*TINY_TEXT, "--model_dir", str(model_dir), "--gin_bindings", "TOTAL_STEPS = 3"]
  procs = [
    subprocess.Popen(
      [sys.executable, "-c", _THREE_CALLS, *args]
      + ["--coordinator_address", address, "--num_processes", "2", "--process_id", str(i)],
      cwd=tmp_path,
      env=_env(4),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for i in range(2)
  ]
  results = communicate_all(procs, TIMEOUT)
  for i, (code, out, err) in enumerate(results):
    assert code == 0 and "statuses 0 0 2" in out, f"exit {code}\n{out[-2000:]}\n{err[-3000:]}"
    assert err.splitlines()[-1] == (
      f"t5x-optim train: error: this process already joined a job of 2 processes as process {i}"
      f" at {address}, and a process can join one job: --coordinator_address 127.0.0.1:1 (the "
      f"job's: {address}); start another process for another job."
    ), err
  assert "(resuming from the checkpoint at step 3)" in results[0][1]
  assert _checkpoint_steps(model_dir)[-1] == 6


def _alone(tmp_path: Path, *flags: str) -> subprocess.Popen:
  """Process 1 of a job of 2 whose process 0 never starts."""
  args = [*TINY_TEXT, "--model_dir", str(tmp_path / "run"), *flags]
  args += ["--coordinator_address", f"127.0.0.1:{free_port()}"]
  return subprocess.Popen(
    [
      sys.executable,
      "-m",
      "t5x_optim_launcher",
      *args,
      "--num_processes",
      "2",
      "--process_id",
      "1",
    ],
    cwd=tmp_path,
    env=_env(4),
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )


def test_a_process_whose_peers_never_connect_stops_in_one_line_when_the_wait_ends(tmp_path):
  """Its coordinator unreachable (or a --process_id given twice), a process printed nothing for
  300 s, then jax aborted it (status 134) with a 100-line C++ stack trace."""
  started = time.monotonic()
  code, out, err = communicate_all([_alone(tmp_path, "--startup_timeout_seconds", "3")], 60)[0]
  assert code == 2, f"exit {code}\n{out[-2000:]}\n{err[-3000:]}"
  assert len(err.splitlines()) == 1, err
  assert "after 3 s, not every one of the job's 2 processes had connected" in err, err
  assert time.monotonic() - started < 45


def test_sigterm_while_a_process_waits_for_its_peers_stops_it_in_one_line(tmp_path):
  """SIGTERM and Ctrl-C went unheard while jax waited for the other processes to connect: a
  scheduler's stop took effect only when jax gave up, 300 s later."""
  proc = _alone(tmp_path)
  line = proc.stdout.readline()
  assert "waiting for the job's 2 processes" in line, line
  proc.send_signal(signal.SIGTERM)
  code, out, err = communicate_all([proc], 30)[0]
  assert code == 143, f"exit {code}\n{out[-2000:]}\n{err[-3000:]}"
  assert err.splitlines()[-1] == (
    "t5x-optim train: preempted (SIGTERM) while waiting for the job's processes; nothing was "
    "started."
  ), err


def _two_processes(
  tmp_path: Path,
  extra: Sequence[Sequence[str]],
  *,
  args: Sequence[str] = (*TINY_TEXT, "--gin_bindings", "TOTAL_STEPS = 5"),
  model_dir: str | None = None,
  cwds: Sequence[Path] | None = None,
  envs: Sequence[Mapping[str, str]] = ({}, {}),
) -> list[tuple[int, str, str]]:
  """One job of 2 processes, process i with the flags `extra[i]` added, run in `cwds[i]` (all
  in `tmp_path` by default) with `envs[i]` added to its environment."""
  address = f"127.0.0.1:{free_port()}"
  procs = [
    subprocess.Popen(
      [sys.executable, "-m", "t5x_optim_launcher", *args]
      + ["--model_dir", model_dir or str(tmp_path / "run"), *flags]
      + ["--coordinator_address", address, "--num_processes", "2", "--process_id", str(i)],
      cwd=cwd,
      env={**_env(4), **env},
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for i, (flags, cwd, env) in enumerate(zip(extra, cwds or [tmp_path] * 2, envs, strict=True))
  ]
  return communicate_all(procs, TIMEOUT)


@pytest.mark.parametrize(
  "extra, message",
  [
    (
      [[], ["--gin_bindings", "optax.adamw.weight_decay = 0.1"]],
      "the processes were started with different jobs: --gin_bindings is ",
    ),
    (
      [[], ["--gin_bindings", "TOTAL_STEPS = 7"]],
      "the processes were started with different jobs: --gin_bindings is ",
    ),
    (
      [["--num_devices", "1"], ["--num_devices", "1"]],
      "--num_devices 1: a run of 2 processes uses every device of every process, 8 here",
    ),
  ],
  ids=["weight_decay", "total_steps", "num_devices"],
)
def test_processes_of_different_jobs_stop_before_the_first_step(extra, message, tmp_path):
  results = _two_processes(tmp_path, extra)
  for code, out, err in results:
    assert code == 2, f"exit {code}\n{out[-2000:]}\n{err[-3000:]}"
    assert len(err.splitlines()) == 1 and message in err, err
    assert "step 1" not in out
  assert not (tmp_path / "run" / "checkpoints").exists() or not any(
    (tmp_path / "run" / "checkpoints").iterdir()
  )


def test_processes_may_wait_for_each_other_for_different_times(tmp_path):
  """--startup_timeout_seconds is how long one process waits for the others: process 0
  waiting longer than the rest is one job, where the jobs' comparison refused it."""
  extra = [["--startup_timeout_seconds", "600"], ["--startup_timeout_seconds", "60"]]
  args = (*TINY_TEXT, "--gin_bindings", "TOTAL_STEPS = 1")
  for code, out, err in _two_processes(tmp_path, extra, args=args):
    assert code == 0, f"exit {code}\n{out[-2000:]}\n{err[-3000:]}"


def test_processes_with_other_device_counts_stop_before_the_first_step(tmp_path):
  """Process 0 with 4 devices, process 1 with 2: both ended in a traceback from the gather that
  compares their jobs ("cannot reshape array of size 6 into shape (2,4)")."""
  two = {"XLA_FLAGS": with_xla_flags({}, "--xla_force_host_platform_device_count=2")["XLA_FLAGS"]}
  for code, out, err in _two_processes(tmp_path, [[], []], envs=({}, two)):
    assert code == 2, f"exit {code}\n{out[-2000:]}\n{err[-3000:]}"
    assert len(err.splitlines()) == 1, err
    assert "the processes have other numbers of devices: 4 on process 0, 2 on process 1" in err
    assert "step 1" not in out


@pytest.mark.skipif(sys.platform == "win32", reason="gloo collectives: not on Windows")
def test_processes_that_read_other_text_at_the_same_path_stop_before_the_first_step(tmp_path):
  """Each host with its own copy of the corpus at the same path (here one gs:// path on two
  emulators, one per process), and one copy stale: the job trained on both without a word."""
  pytest.importorskip("gcsfs")
  pytest.importorskip("gcp_storage_emulator")
  from _gcs_emulator import Emulator  # noqa: PLC0415 - needs the emulator installed

  hamlet = (REPO / "t5x_optim" / "data" / "hamlet.txt").read_bytes()
  with Emulator() as first, Emulator() as second:
    for emulator, text in ((first, hamlet), (second, hamlet[: len(hamlet) // 2])):
      emulator.create_bucket("corpus")
      emulator.upload("corpus", "text/hamlet.txt", text)
    args = ["train", "--gin_file", "examples/tiny.gin", "--data", "gs://corpus/text"]
    results = _two_processes(
      tmp_path,
      [[], []],
      args=[*args, "--gin_bindings", "TOTAL_STEPS = 5"],
      envs=[first.env, second.env],
    )
  half = f"{len(hamlet) // 2:,} bytes"
  for code, out, err in results:
    assert code == 2, f"exit {code}\n{out[-2000:]}\n{err[-3000:]}"
    assert (
      "the processes were started with different jobs: the text data at gs://corpus/text" in err
    )
    assert f"1 file, {len(hamlet):,} bytes" in err and f"1 file, {half}" in err, err
    assert "step 1" not in out


def test_processes_that_run_other_library_versions_stop_before_the_first_step(tmp_path):
  """A host whose image has another optax (process 1 here reads its version as 0.1.0): each
  host traces the step with its own optax, and the job ran without a word."""
  other = tmp_path / "other_optax"
  other.mkdir()
  (other / "sitecustomize.py").write_text(
    "from importlib import metadata\n"
    "_version = metadata.version\n"
    "metadata.version = lambda name: '0.1.0' if name == 'optax' else _version(name)\n"
  )
  path = os.pathsep.join([str(other), _env(4)["PYTHONPATH"]])
  results = _two_processes(tmp_path, [[], []], envs=[{}, {"PYTHONPATH": path}])
  for code, out, err in results:
    assert code == 2, f"exit {code}\n{out[-2000:]}\n{err[-3000:]}"
    assert (
      "the processes were started with different jobs: the version of optax is "
      f"{metadata.version('optax')} on process 0, 0.1.0 on process 1;"
    ) in err, err
    assert "step 1" not in out


@pytest.mark.parametrize(
  ("env", "setting", "values"),
  [
    ({"JAX_ENABLE_X64": "1"}, "jax_enable_x64", "False on process 0, True on process 1"),
    (
      {"JAX_DEFAULT_MATMUL_PRECISION": "highest"},
      "jax_default_matmul_precision",
      "None on process 0, 'highest' on process 1",
    ),
    ({"JAX_RANDOM_SEED_OFFSET": "1"}, "jax_random_seed_offset", "0 on process 0, 1 on process 1"),
  ],
  ids=["x64", "matmul_precision", "seed_offset"],
)
def test_processes_with_other_jax_settings_stop_before_the_first_step(
  tmp_path, env, setting, values
):
  """A host whose environment sets another jax numerics setting traces another program."""
  for code, out, err in _two_processes(tmp_path, [[], []], envs=({}, env)):
    assert code == 2, f"exit {code}\n{out[-2000:]}\n{err[-3000:]}"
    assert f"different jobs: jax's setting {setting} is {values};" in err, err
    assert "step 1" not in out


def _readme_recipe() -> str:
  blocks = re.findall(r"^```bash\n(.*?)^```$", (REPO / "docs" / "cli.md").read_text(), re.M | re.S)
  (recipe,) = [block for block in blocks if "--num_processes 2" in block]
  return recipe


def _run_recipe(model_dir: Path, steps: int, cwd: Path) -> str:
  """The manual's recipe for `steps` steps of `examples/tiny.gin`; its output."""
  script = (
    _readme_recipe()
    .replace("PORT=12355", f"PORT={free_port()}")
    .replace("/tmp/two_processes", str(model_dir))
    .replace("--data hamlet.txt", "--data hamlet.txt --gin_file examples/tiny.gin")
    # A constant rate: the default schedule's constants, and so the program, follow the steps.
    .replace(
      "$i &", f"$i --gin_bindings 'TOTAL_STEPS = {steps}' --gin_bindings 'LEARNING_RATE = 5e-3' &"
    )
  )
  env = with_xla_flags(_env(8, run_cache=False))  # the recipe's own cache, under MODEL_DIR
  env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]])
  env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  result = subprocess.run(
    ["bash", "-c", f"set -e\n{script}"],
    cwd=cwd,
    env=env,
    capture_output=True,
    text=True,
    timeout=TIMEOUT,
    check=False,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert "Traceback" not in result.stderr, result.stderr[-3000:]
  return result.stdout


def test_the_readme_recipe_runs_two_processes_and_restarts_from_process_0s_cache(tmp_path):
  model_dir = tmp_path / "run"
  out = _run_recipe(model_dir, 2, tmp_path)
  assert "devices:         8 x cpu (simulated) in 2 processes of 4" in out
  assert "steps 0 -> 2," in out and _checkpoint_steps(model_dir) == [2]
  written = sorted((model_dir / "compilation_cache").glob("jit__train_step-*"))
  assert len(written) == 1, "one entry, process 0's"
  again = _run_recipe(model_dir, 4, tmp_path)
  assert "steps 2 -> 4," in again
  assert re.search(r"^compilation cache: .* loaded from ", again, re.M), again
  assert sorted((model_dir / "compilation_cache").glob("jit__train_step-*")) == written
  assert _checkpoint_steps(model_dir) == [2, 4]


def test_processes_that_see_other_checkpoints_stop_before_the_first_step(tmp_path):
  """One --model_dir that is another directory on each host (here a relative path and two
  working directories), one holding checkpoints: process 0 resumed while process 1 started
  afresh, and they met in different collectives (process 0 called its checkpoint unreadable,
  process 1 crashed with a traceback). The same for --init_from, a stale copy on one host."""
  first, second = tmp_path / "host0", tmp_path / "host1"
  second.mkdir()
  first.mkdir()
  steps = [
    "--gin_bindings",
    "TOTAL_STEPS = 4",
    "--gin_bindings",
    "cli.TrainJob.checkpoint_every = 2",
  ]
  _train([*TINY_TEXT, "--model_dir", "run", *steps], processes=1, cwd=first)
  job = [*TINY_TEXT, "--gin_bindings", "TOTAL_STEPS = 6"]
  results = _two_processes(tmp_path, [[], []], args=job, model_dir="run", cwds=[first, second])
  shutil.copytree(first / "run", second / "run", dirs_exist_ok=True)
  shutil.rmtree(second / "run" / "checkpoints" / "4")
  next_dir = tmp_path / "next"
  results += _two_processes(
    tmp_path, [["--init_from", "run"]] * 2, args=job, model_dir=str(next_dir), cwds=[first, second]
  )
  for (code, out, err), seen in zip(
    results,
    ["--model_dir run is steps 2, 4 on process 0, none on process 1"] * 2
    + ["--init_from run is steps 2, 4 on process 0, step 2 on process 1"] * 2,
    strict=True,
  ):
    assert code == 2, f"exit {code}\n{out[-2000:]}\n{err[-3000:]}"
    assert len(err.splitlines()) == 1, err
    assert f"the processes were started with different jobs: the checkpoint list of {seen}; " in err
    assert "step 1" not in out
  assert _checkpoint_steps(first / "run") == [2, 4]
  assert not next_dir.exists() or not (next_dir / "checkpoints").exists()


def test_processes_that_init_from_other_sources_stop_before_the_first_step(tmp_path):
  """--init_from run, each host's own copy: two runs with the same steps (trained on other data
  orders) had the same checkpoint list, and each process restored its shards from its own run
  without a word. The step restored and the digest of its checksums name both sides. Then
  --init_from_gin src.gin, another file on each host (b2 0.98 and 0.5): each process converted
  the state with its own b2; the source optimizer's numbers name both sides."""
  cwds = [tmp_path / "host0", tmp_path / "host1"]
  for seed, cwd in enumerate(cwds):
    cwd.mkdir()
    steps = ["--gin_bindings", "TOTAL_STEPS = 2", "--gin_bindings", f"cli.TextTask.seed = {seed}"]
    _train([*TINY_TEXT, "--model_dir", "run", *steps], processes=1, cwd=cwd)
  digests = [
    hashlib.sha256((cwd / "run/checkpoints/2/checksums/checksums.json").read_bytes()).hexdigest()
    for cwd in cwds
  ]
  assert digests[0] != digests[1]
  job = [*TINY_TEXT, "--gin_bindings", "TOTAL_STEPS = 4"]
  next_dir = tmp_path / "next"
  results = _two_processes(
    tmp_path, [["--init_from", "run"]] * 2, args=job, model_dir=str(next_dir), cwds=cwds
  )
  sides = ", ".join(
    f"step 2 (checksums digest {digest[:12]}) on process {i}" for i, digest in enumerate(digests)
  )
  for code, out, err in results:
    assert code == 2, f"exit {code}\n{out[-2000:]}\n{err[-3000:]}"
    assert len(err.splitlines()) == 1, err
    assert f"different jobs: the checkpoint that --init_from run restores is {sides}; " in err
    assert "step 1" not in out
  source = cwds[0] / "run"
  for b2, cwd in zip(("0.98", "0.5"), cwds, strict=True):
    (cwd / "src.gin").write_text(f"include 'optimizers/adamw.gin'\noptax.adamw.b2 = {b2}\n")
  flags = ["--init_from", str(source), "--init_from_gin", "src.gin"]
  results = _two_processes(tmp_path, [flags] * 2, args=job, model_dir=str(next_dir), cwds=cwds)
  seen = (
    f"different jobs: the source optimizer of --init_from {re.escape(str(source))} is "
    r"[^;]*b2=0\.98[^;]* on process 0, [^;]*b2=0\.5[^;]* on process 1; "
  )
  for code, out, err in results:
    assert code == 2, f"exit {code}\n{out[-2000:]}\n{err[-3000:]}"
    assert len(err.splitlines()) == 1 and re.search(seen, err), err
    assert "step 1" not in out
  assert not (next_dir / "checkpoints").exists() or not any((next_dir / "checkpoints").iterdir())


def test_processes_that_write_to_other_directories_stop_before_the_first_step(tmp_path):
  """A fresh --model_dir that is another directory on each host: both see no checkpoint, so
  they trained on while the first save waited for a directory only process 0 made, until
  orbax gave up after 600 s: no checkpoint was committed, and the processes hung."""
  first, second = tmp_path / "host0", tmp_path / "host1"
  first.mkdir()
  second.mkdir()
  results = _two_processes(tmp_path, [[], []], model_dir="run", cwds=[first, second])
  for code, out, err in results:
    assert code == 2, f"exit {code}\n{out[-2000:]}\n{err[-3000:]}"
    assert len(err.splitlines()) == 1, err
    assert (
      "--model_dir run is not one directory for every process: process 1 does not see the file "
      "process 0 wrote there; "
    ) in err, err
    assert "step 1" not in out
  for host in (first, second):
    # The directory each process made for its --model_dir is gone again, probe files and all.
    assert not (host / "run").exists(), sorted(p.name for p in (host / "run").rglob("*"))
