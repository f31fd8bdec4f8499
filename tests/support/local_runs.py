"""Local preflight runs held open, for launch and status tests."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from support.held_preflight import held
from support.helpers import PREFLIGHT, REPO, STREAMRL


def wait_until(cond, timeout: float = 60, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


HOLD = held(120)  # the roles stay after their check, for a look at a live run


TWO = "roles.generator.instances=2"  # the embedded default has one; these tests look at a pair


def run_dir_of(runs_root: Path) -> Path:
    (d,) = list(runs_root.iterdir())
    return d


def members_ok(run_dir: Path) -> int:
    n = 0
    for f in (run_dir / "members").glob("*.json"):
        try:
            n += bool(json.loads(f.read_text()).get("preflight_ok"))
        except json.JSONDecodeError:
            pass
    return n


def start_held_run(runs_root: Path) -> tuple[subprocess.Popen, Path]:
    """`streamrl run local` whose roles hold (heartbeating) after preflight; returns once all passed it."""
    proc = subprocess.Popen(
        [*STREAMRL, "run", "local", *PREFLIGHT, TWO, *HOLD, "--root", str(runs_root)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
    )
    run_dir = wait_until(
        lambda: runs_root.exists() and any(runs_root.iterdir()) and run_dir_of(runs_root),
        what="run directory",
    )
    wait_until(lambda: members_ok(run_dir) == 3, what="all roles through preflight")
    return proc, run_dir
