"""The wheel ships the gin files and the `t5x-optim` script; the commands of the README
and of docs/ run from another directory after installing it (not editable).

The wheel is built without build isolation (no network) and installed without
its dependencies into a fresh venv that sees this interpreter's site-packages
through a ``.pth`` file, so nothing is downloaded.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path

import pytest
from _subprocesses import with_xla_flags

# Builds the wheel and installs it in a fresh environment: minutes.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "t5x_optim_launcher.py", "t5x_optim")
TIMEOUT = 300
SHORT = ["--gin_bindings", "TOTAL_STEPS = 1"]


def _readme_commands() -> list[list[str]]:
  """Every ``t5x-optim train|plan`` command line in the README's and docs/*.md's code blocks."""
  documents = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
  blocks = [
    block
    for document in documents
    for block in re.findall(r"^```(\w*)\n(.*?)^```$", document.read_text(), re.M | re.S)
  ]
  # A command shown in more than one place runs once.
  lines = dict.fromkeys(
    line.removeprefix("$ ")
    for kind, block in blocks
    if kind in ("", "bash")
    for line in block.splitlines()
  )
  # The gs:// commands (docs/cloud-storage.md) run against an emulator in test_cloud_storage.py.
  return [
    shlex.split(line, comments=True)
    for line in lines
    if re.match(r"t5x-optim (train|plan) ", line) and "gs://" not in line
  ]


def _run(command: list[str], *, cwd: Path) -> subprocess.CompletedProcess:
  env = with_xla_flags({k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
  return subprocess.run(
    command, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT, check=False
  )


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
  """A venv with the built wheel installed (its dependencies come from this interpreter's)."""
  root = tmp_path_factory.mktemp("packaging")
  source = root / "source"
  source.mkdir()
  for name in SOURCES:
    if (REPO / name).is_dir():
      shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    else:
      shutil.copy2(REPO / name, source / name)
  dist = root / "dist"
  build = _run(
    [
      sys.executable,
      "-m",
      "pip",
      "wheel",
      "--no-deps",
      "--no-build-isolation",
      "-w",
      str(dist),
      str(source),
    ],
    cwd=root,
  )
  assert build.returncode == 0, build.stdout + build.stderr
  (wheel,) = dist.glob("t5x_optim-*.whl")
  env_dir = root / "venv"
  created = _run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], cwd=root)
  assert created.returncode == 0, created.stderr
  python = env_dir / "bin" / "python"
  site = _run(
    [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=root
  ).stdout.strip()
  Path(site, "main_site_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
  install = _run([str(python), "-m", "pip", "install", "--no-deps", str(wheel)], cwd=root)
  assert install.returncode == 0, install.stdout + install.stderr
  return env_dir


def test_wheel_installs_the_package_and_its_gin_files(venv, tmp_path):
  probe = _run(
    [
      str(venv / "bin" / "python"),
      "-c",
      "import t5x_optim, t5x_optim.cli as c; print(t5x_optim.__file__); "
      "print(sorted(p.name for p in (c.GIN_DIR / 'optimizers').glob('*.gin')))",
    ],
    cwd=tmp_path,
  )
  assert probe.returncode == 0, probe.stderr
  module, files = probe.stdout.splitlines()
  assert Path(module).is_relative_to(venv)
  assert eval(files) == sorted(p.name for p in (REPO / "t5x_optim/gin/optimizers").glob("*.gin"))


def test_readme_commands_run_from_another_directory(venv, tmp_path):
  commands = _readme_commands()
  assert {command[1] for command in commands} == {"train", "plan"}
  for command in commands:
    extra = SHORT if command[1] == "train" else []
    result = _run([str(venv / "bin" / command[0]), *command[1:], *extra], cwd=tmp_path)
    assert result.returncode == 0, (command, result.stderr)
    assert "Traceback" not in result.stderr
  assert (tmp_path / "runs" / "lookahead" / "config.gin").is_file()


def test_the_sdist_holds_the_package_and_no_partial_test_suite(tmp_path):
  """setuptools put tests/test_*.py in the sdist without their conftest, helpers or data."""
  tracked = subprocess.run(
    ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
  ).stdout.split()
  source = tmp_path / "source"
  for name in tracked:
    (source / name).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(REPO / name, source / name)
  script = (
    "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))"
  )
  build = _run([sys.executable, "-c", script, str(tmp_path / "dist")], cwd=source)
  assert build.returncode == 0, build.stdout + build.stderr
  (sdist,) = (tmp_path / "dist").glob("t5x_optim-*.tar.gz")
  with tarfile.open(sdist) as archive:
    names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
  assert not {name for name in names if name.startswith("tests/")}
  package = {name for name in tracked if name.startswith("t5x_optim/")}
  assert package <= names, sorted(package - names)
