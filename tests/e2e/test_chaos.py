"""A trainer that keeps dying fails the run with its reason (a local run of the real roles).

The faults a run survives (a trainer killed before and while checkpointing, a trainer whose reward
raised, a generator stopped past its lease or killed, the rendezvous killed, scaling by hand) are
steps of one scenario run: tests/e2e/test_local_faults.py. This one ends the run, so it has its own.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from support.member_runs import (
    RUN_S,
    assert_nothing_left,
    run_dir_of,
    start_run,
    trainer_iterations,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.chaos]


def live_trainer(run_dir: Path) -> tuple[int, float] | None:
    """The newest trainer process of the run, once started."""
    recs = [r for r in json.loads((run_dir / "local.json").read_text()) if r["role"] == "trainer"]
    if not recs:
        return None
    rec = max(recs, key=lambda r: r["created"])
    return rec["pid"], rec["created"]


def test_a_trainer_that_keeps_dying_fails_the_run_with_its_reason(runs_root):
    # One generator, the embedded default's (start_run's pair is for tests that look at two). The
    # trainer is killed as soon as its process runs, while the generator is still starting its
    # engine: the run fails at once, and the generator abandons its start-up on the SIGTERM that
    # follows (stopped, never killed after a grace), leaving no engine process behind.
    proc = start_run(runs_root, "train.iterations=40", "train.global_batch=4", "train.checkpoint_every=0",
                     "roles.trainer.restarts=0", "roles.generator.instances=1")  # fmt: skip
    try:
        run_dir = wait_for(lambda: run_dir_of(runs_root), 60, "the run directory", proc)
        wait_for(
            lambda: (run_dir / "members" / "trainer-0.json").exists(), RUN_S, "the trainer's start", proc
        )
        pid, _ = live_trainer(run_dir) or (0, 0.0)
        os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=RUN_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out
    assert "trainer rank 0 exited with -9" in out and "starting the trainer again" not in out, out
    assert json.loads((run_dir / "run.json").read_text())["state"] == "failed"
    (end,) = [e for e in map(json.loads, (run_dir / "events.jsonl").read_text().splitlines())
              if e["event"] == "failed"]  # fmt: skip
    assert end["failed"] == ["trainer-0"], end
    assert not [s for s in end.get("stopped", []) if s.startswith("killed")], end  # SIGTERM was enough
    assert not trainer_iterations(run_dir)
    assert_nothing_left(run_dir)
