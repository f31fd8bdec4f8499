"""Fixtures of the command-line tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.helpers import streamrl


@pytest.fixture
def dry_run(runs_root) -> Path:
    """A dry run of the local recipe: a run directory with its records, and nothing running."""
    out = streamrl("run", "local", "--dry-run", "--root", str(runs_root), timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    (run_dir,) = [p for p in runs_root.iterdir() if (p / "run.json").exists()]
    return run_dir
