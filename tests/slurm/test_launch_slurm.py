"""Real jobs on the real local SLURM test clusters: submit, run, read state, cancel.

Needs scripts/slurm-test-cluster.sh start (CI does it). Roles run the preflight program, which
registers with the run's rendezvous server and waits for every peer, so a passing run proves
that jobs on both partitions (and both clusters) found each other through it.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest
from support.held_preflight import held
from support.helpers import streamrl
from support.slurm_jobs import FAST, launch, status, tasks, wait_for  # noqa: F401

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

HOLD = held(300)


def all_tasks(doc: dict, state: str) -> bool:
    ts = tasks(doc, "trainer") + tasks(doc, "generator")
    return bool(ts) and all(t["state"] == state for t in ts)


def test_run_on_both_partitions_completes_and_stops_its_rendezvous(slurm, runs_root):
    run = launch(runs_root, "slurm-local")
    jobs = json.loads((run / "jobs.json").read_text())
    assert [(j["role"], j["partition"], j["array"]) for j in jobs] == [
        ("trainer", "h800", None),
        ("generator", "h20", 2),
    ]
    doc = wait_for(run, lambda d: d["state"] == "finished", what="run finished")
    assert all_tasks(doc, "COMPLETED")
    assert [t["task"] for t in tasks(doc, "generator")] == [0, 1]  # one array task per instance
    for name in ("trainer-0", "generator-0", "generator-1"):
        rec = json.loads((run / "members" / f"{name}.json").read_text())
        assert rec["preflight_ok"] and rec["peers"] == {"trainer": 1, "generator": 2}, rec
        assert rec["slurm_job_id"]
    assert json.loads((run / "members" / "generator-1.json").read_text())["partition"] == "h20"
    assert json.loads((run / "members" / "trainer-0.json").read_text())["partition"] == "h800"
    wait_for(run, lambda d: "stopped" in (d["rendezvous"]["error"] or ""), timeout=30, what="server stopped")
    assert json.loads((run / "run.json").read_text())["state"] == "finished"


def test_status_of_a_live_run_then_cancel(slurm, runs_root):
    run = launch(runs_root, "slurm-local", *HOLD)
    doc = wait_for(
        run,
        lambda d: (
            all_tasks(d, "RUNNING")
            and d["rendezvous"]["reachable"]
            and [m["state"] for r in d["roles"] for m in r["members"]] == ["alive"] * 3
        ),
        what="all members registered",
    )
    assert doc["state"] == "running"
    gens = next(r for r in doc["roles"] if r["role"] == "generator")["members"]
    assert [m["rank"] for m in gens] == [0, 1] and all(m["last_heartbeat_s"] < 10 for m in gens)
    out = streamrl("cancel", run.name)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("scancel") == 2
    doc = wait_for(run, lambda d: all_tasks(d, "CANCELLED"), what="jobs cancelled")
    assert doc["state"] == "cancelled"
    wait_for(run, lambda d: not d["rendezvous"]["reachable"], timeout=60, what="rendezvous stopped")


def test_a_job_cancelled_behind_the_runs_back_shows_in_status(slurm, runs_root):
    run = launch(runs_root, "slurm-local", *HOLD, "roles.rendezvous.lease_s=2")
    wait_for(
        run,
        lambda d: (
            all_tasks(d, "RUNNING")
            and [m["state"] for r in d["roles"] for m in r["members"]] == ["alive"] * 3
        ),
        what="members registered",
    )
    gen = next(j for j in json.loads((run / "jobs.json").read_text()) if j["role"] == "generator")
    subprocess.run(["scancel", gen["job_id"]], check=True)
    doc = wait_for(
        run,
        lambda d: tasks(d, "generator") and all(t["state"] == "CANCELLED" for t in tasks(d, "generator")),
        what="generator tasks cancelled",
    )
    assert any(f"generator job {gen['job_id']}" in p and "CANCELLED" in p for p in doc["problems"])
    assert [t["state"] for t in tasks(doc, "trainer")] == ["RUNNING"]
    doc = wait_for(
        run,
        lambda d: (
            [m["state"] for r in d["roles"] if r["role"] == "generator" for m in r["members"]]
            == ["lost", "lost"]
        ),
        timeout=60,
        what="generator members lost (lease expired)",
    )
    assert streamrl("cancel", run.name).returncode == 0


def test_two_sites_submit_to_both_clusters_and_cancel_with_cluster(slurm_remote, runs_root):
    run = launch(runs_root, "two-site-testbed", *held(300, ("local", "remote")))
    jobs = {j["role"]: j for j in json.loads((run / "jobs.json").read_text())}
    assert jobs["generator"]["slurm_cluster"] == "remote" and int(jobs["generator"]["job_id"]) >= 1_000_000
    assert jobs["trainer"]["slurm_cluster"] is None
    doc = wait_for(
        run,
        lambda d: (
            all_tasks(d, "RUNNING")
            and [m["state"] for r in d["roles"] for m in r["members"]] == ["alive"] * 3
        ),
        what="both sites registered",
    )
    gens = next(r for r in doc["roles"] if r["role"] == "generator")["members"]
    assert {m["cluster"] for m in gens} == {"remote"}
    assert streamrl("cancel", run.name).returncode == 0
    wait_for(run, lambda d: all_tasks(d, "CANCELLED"), what="cancelled on both clusters")
    out = subprocess.run(
        ["squeue", "-M", "remote", "-h", "-j", jobs["generator"]["job_id"]], capture_output=True, text=True
    )
    assert "RUNNING" not in out.stdout


def test_a_single_generator_is_still_an_array(slurm, runs_root):
    run = launch(runs_root, "slurm-local", "roles.generator.instances=1")
    assert "#SBATCH --array=0-0%1" in (run / "jobs" / "local-generator.sbatch").read_text()
    doc = wait_for(run, lambda d: d["state"] == "finished", what="run finished")
    assert [t["task"] for t in tasks(doc, "generator")] == [0]


def test_status_works_without_accounting(slurm, runs_root, tmp_path):
    # What sacct prints on a cluster without slurmdbd; status must rely on squeue alone.
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "sacct").write_text(
        "#!/bin/sh\necho 'sacct: error: Slurm accounting storage is disabled' >&2\nexit 1\n"
    )
    (shim / "sacct").chmod(0o755)
    run = launch(runs_root, "slurm-local")
    env = {"PATH": f"{shim}:{os.environ['PATH']}"}
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        out = streamrl("status", str(run), "--json", env=env)
        assert out.returncode == 0, out.stderr
        doc = json.loads(out.stdout)
        if doc["state"] == "finished":
            break
        time.sleep(1)
    assert all_tasks(doc, "COMPLETED"), json.dumps(doc, indent=1)[:4000]
    table = streamrl("status", env=env)
    assert table.returncode == 0 and run.name in table.stdout


def test_rendezvous_as_its_own_job(slurm, runs_root):
    run = launch(
        runs_root,
        "slurm-local",
        "roles.rendezvous.placement=job",
        "roles.rendezvous.cluster=local",
        "roles.rendezvous.partition=h800",
        "roles.rendezvous.bind_host=0.0.0.0",
    )
    jobs = json.loads((run / "jobs.json").read_text())
    assert [j["role"] for j in jobs] == ["rendezvous", "trainer", "generator"]
    wait_for(run, lambda d: d["state"] == "finished", what="run finished")
    # ... and then the server job ends by itself instead of holding its node until the time limit
    wait_for(
        run,
        lambda d: [t["state"] for t in tasks(d, "rendezvous")] == ["COMPLETED"],
        timeout=60,
        what="rendezvous job completed",
    )
    assert json.loads((run / "members" / "generator-0.json").read_text())["preflight_ok"]
