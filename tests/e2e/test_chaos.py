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


def trained(run_dir: Path, n: int):  # type: ignore[no-untyped-def]
    """At least n iteration records."""

    return lambda: len(trainer_iterations(run_dir)) >= n


def test_a_trainer_that_keeps_dying_fails_the_run_with_its_reason(runs_root):
    # One generator, the embedded default's (start_run's pair is for tests that look at two): the
    # run's end stops it like any member; a second engine only made the start slower on two cores.
    proc = start_run(runs_root, "train.iterations=40", "train.global_batch=4", "train.checkpoint_every=0",
                     "roles.trainer.restarts=0", "roles.generator.instances=1")  # fmt: skip
    try:
        run_dir = wait_for(lambda: run_dir_of(runs_root), 60, "the run directory", proc)
        wait_for(trained(run_dir, 1), RUN_S, "a trained iteration", proc)
        pid, _ = live_trainer(run_dir) or (0, 0.0)
        os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=RUN_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out
    assert "trainer rank 0 exited with -9" in out and "starting the trainer again" not in out, out
    assert json.loads((run_dir / "run.json").read_text())["state"] == "failed"
    assert_nothing_left(run_dir)
