"""Local runs of the real roles for fault tests: start, wait on records, find members."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import psutil

from streamrl_cli.rundir import read_jsonl
from support.helpers import REPO, STREAMRL


def group_of(pid: int, created: float) -> list[int]:
    """Processes of the process group `pid` leads (started after it: pids are reused)."""
    out = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pid and p.create_time() >= created - 0.05 and p.status() != "zombie":
                out.append(p.pid)
        except (psutil.Error, OSError):
            pass
    return out


RUN_S = 900  # liveness bound of a whole small run here (two vLLM engines + DeepSpeed on 2 cores)


def start_run(runs_root: Path, *overrides: str) -> subprocess.Popen:
    env = {**os.environ, "COLUMNS": "200", "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [*STREAMRL, "run", "local", "roles.generator.instances=2", *overrides, "--root", str(runs_root)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def wait_for(cond, timeout: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run ended ({proc.returncode}) before {what}:\n{proc.stdout.read()}")
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def run_dir_of(root: Path) -> Path | None:
    dirs = [p for p in root.iterdir() if p.is_dir()] if root.exists() else []
    return dirs[0] if dirs else None


def trainer_iterations(run_dir: Path) -> list[int]:
    """The iterations the trainer recorded, in order, read while the run writes them: none before
    metrics.jsonl exists, and a line still being written is not one yet."""
    recs = read_jsonl(run_dir / "metrics.jsonl").records
    return [r["iteration"] for r in recs if r.get("role") == "trainer" and "iteration" in r]


def generator_pid(run_dir: Path, rank: int) -> tuple[int, float]:
    (rec,) = [r for r in json.loads((run_dir / "local.json").read_text()) if r["role"] == "generator"
              and r["rank"] == rank]  # fmt: skip
    return rec["pid"], rec["created"]


def assert_nothing_left(run_dir: Path) -> None:
    """No process of any role the run started (nor any it started in turn) still runs."""
    for rec in json.loads((run_dir / "local.json").read_text()):
        assert not group_of(rec["pid"], rec["created"]), f"{rec['role']}-{rec['rank']} left processes"


def serving(run_dir: Path) -> bool:
    """Both generators generate and the trainer has trained at least one iteration."""
    return len(trainer_iterations(run_dir)) >= 1
