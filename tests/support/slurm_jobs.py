"""Launching preflight runs on the SLURM test clusters and reading their jobs' state."""

from __future__ import annotations

import json
import time
from pathlib import Path

from support.helpers import PREFLIGHT, streamrl

FAST = {"STREAMRL_JOB_POLL_S": "1"}


def launch(runs_root: Path, recipe: str, *overrides: str) -> Path:
    out = streamrl("run", recipe, *PREFLIGHT, *overrides, "--root", str(runs_root), env=FAST)
    assert out.returncode == 0, out.stdout + out.stderr
    (run_dir,) = list(runs_root.iterdir())
    return run_dir


def status(run: Path) -> dict:
    out = streamrl("status", str(run), "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def tasks(doc: dict, role: str) -> list[dict]:
    return [t for r in doc["roles"] if r["role"] == role for j in r["jobs"] for t in j["tasks"]]


def wait_for(run: Path, pred, timeout: float = 120, what: str = "state") -> dict:
    deadline = time.monotonic() + timeout
    doc = {}
    while time.monotonic() < deadline:
        doc = status(run)
        if pred(doc):
            return doc
        time.sleep(1)
    brief = {r["role"]: [(m["rank"], m["state"]) for m in r["members"]] for r in doc.get("roles", [])}
    last = json.dumps(doc, indent=1)[:3000]
    raise AssertionError(f"timed out waiting for {what}; members {brief}; last status: {last}")
