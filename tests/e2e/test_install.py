"""Installed from a wheel, outside the checkout, streamrl has its recipes and runs them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.helpers import REPO

pytestmark = pytest.mark.slow  # builds a wheel and installs it (~15 s)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The wheel built from this repository, installed (without dependencies) into a new prefix."""
    tmp = tmp_path_factory.mktemp("install")
    pip = [sys.executable, "-m", "pip"]
    # pip builds in the source tree (build/, *.egg-info): build from a copy, leaving the checkout as it is.
    src = tmp / "src"
    junk = shutil.ignore_patterns(
        ".*",
        "runs",
        "build",
        "dist",
        "*.egg-info",
        "__pycache__",  # .* : .git, .venv, caches, wheels
    )
    shutil.copytree(REPO, src, ignore=junk)
    # Offline: the build uses this environment's setuptools, the install only this wheel.
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp / "wheel"), str(src)],
        check=True,
        capture_output=True,
        cwd=tmp,
    )
    (wheel,) = (tmp / "wheel").glob("streamrl-*.whl")
    target = tmp / "site"
    subprocess.run(
        [*pip, "install", "--no-deps", "--no-index", "-q", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
    )
    return target


def run_installed(target: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    # Only the installed copy is importable as streamrl_cli (no checkout on the path, no
    # STREAMRL_RECIPES); the dependencies come from this environment's site-packages.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "STREAMRL_RECIPES")}
    env.update(PYTHONPATH=str(target), COLUMNS="200")
    return subprocess.run(
        [str(target / "bin" / "streamrl"), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=300,
    )


def test_wheel_ships_recipes_and_runs_them_outside_the_checkout(installed, tmp_path):
    where = run_installed(installed, tmp_path, "show", "local")
    assert where.returncode == 0, where.stderr
    out = run_installed(installed, tmp_path, "recipes")
    assert out.returncode == 0, out.stderr
    shipped = sorted(
        p.relative_to(REPO / "recipes").with_suffix("").as_posix() for p in REPO.glob("recipes/*.yaml")
    )
    assert set(shipped) <= set(out.stdout.split()) and "paper/qwen2.5-7b-ppo" in out.stdout.split()
    dry = run_installed(installed, tmp_path, "run", "local", "--dry-run", "--root", "runs")
    assert dry.returncode == 0, dry.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    recipe = (run_dir / "run.json").read_text()
    assert str(installed / "streamrl_cli" / "recipes" / "local.yaml") in recipe  # the installed copy
    assert str(REPO) not in recipe


def test_a_users_recipe_uses_the_shipped_groups_when_installed(installed, tmp_path):
    (tmp_path / "mine.yaml").write_text(
        "defaults:\n  - local\n  - override /algorithm: ppo\n  - _self_\nrun: {name: mine}\n"
    )
    out = run_installed(installed, tmp_path, "show", "mine.yaml")
    assert out.returncode == 0, out.stderr
    assert "name: mine" in out.stdout and "name: ppo" in out.stdout


def test_slurm_templates_ship_too(installed):
    names = sorted(p.name for p in (installed / "streamrl_cli" / "slurm_templates").iterdir())
    assert names == sorted(p.name for p in (REPO / "slurm_templates").iterdir())
