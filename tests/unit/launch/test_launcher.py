"""The launcher interface (launch/launcher.py): one registry of launchers, and the one path that
starts a role job and records it, as a launch, a scale-up and a trainer restart use it.

Without SLURM: sbatch is replaced by a function that numbers the jobs (the real submissions are
tests/slurm/); what is recorded, written and said is checked here.
"""

from __future__ import annotations

import dataclasses
import json
import stat

import pytest

from streamrl_cli.environ import CPU_SLOT, RANK_BASE
from streamrl_cli.errors import ClusterError
from streamrl_cli.launch import launcher, slurm
from streamrl_cli.launch.launcher import Added, Launcher
from streamrl_cli.launch.run import prepare
from streamrl_cli.launch.scale.executor import next_rank
from streamrl_cli.launch.slurm import submission
from streamrl_cli.recipe.load import load
from streamrl_cli.recipe.schema import LAUNCHERS


def test_one_launcher_per_name_the_schema_allows_and_no_other():
    assert tuple(launcher.registry()) == LAUNCHERS
    for name, cls in launcher.registry().items():
        assert issubclass(cls, Launcher) and cls.name == name
        assert isinstance(launcher.get(name), cls)
    with pytest.raises(ClusterError, match=r"unknown launcher 'pbs'; valid: slurm, local"):
        launcher.get("pbs")
    # Who watches the roles: `streamrl run` stays for local processes only.
    assert launcher.get("local").foreground and not launcher.get("slurm").foreground


@pytest.fixture
def slurm_run(tmp_path, monkeypatch):
    """A prepared SLURM run whose sbatch hands out job ids 101, 102, ... and remembers each job."""
    p = prepare(load("slurm-local"), root=tmp_path, dry_run=True)
    submitted = []

    def fake_submit(job, name, run_dir, entry, spec_path):
        submitted.append((job, name, spec_path))
        return str(100 + len(submitted))

    monkeypatch.setattr(submission, "submit", fake_submit)
    return p, submitted


def events(run, kind):
    return [e for e in run.events() if e["event"] == kind]


def test_a_launched_job_is_submitted_recorded_and_said(slurm_run):
    p, submitted = slurm_run
    job = next(j for j in p.jobs if j.role == "generator")
    before = p.scripts[job.key].read_text()
    sub = launcher.submit(p.run, job)
    assert sub.job_id == "101" and submitted[0][2] == p.run.role_spec("generator")
    assert sub.line == f"submitted generator array of {job.array} to default cluster/{job.partition}: job 101"
    (rec,) = p.run.jobs()
    assert {k: rec[k] for k in ("role", "cluster", "job_id", "array", "partition", "script")} == {
        "role": "generator", "cluster": job.cluster, "job_id": "101", "array": job.array,
        "partition": job.partition, "script": str(p.scripts[job.key]),
    }  # fmt: skip
    assert "rank_base" not in rec and "scaled" not in rec
    assert p.scripts[job.key].read_text() == before  # the script submitted is the one prepared
    assert [(e["role"], e["job_id"]) for e in events(p.run, "submitted")] == [("generator", "101")]


def test_a_scale_up_is_a_new_array_job_ranked_after_the_run(slurm_run):
    p, submitted = slurm_run
    job = next(j for j in p.jobs if j.role == "generator")
    launcher.submit(p.run, job)
    base = job.array  # one past the launch's ranks
    sub = launcher.submit(p.run, dataclasses.replace(job, array=2), added=Added(rank=base, slot=1, slots=3))
    scaled = submitted[-1][0]
    assert scaled.array == 2 and scaled.env[RANK_BASE] == str(base) and scaled.env[CPU_SLOT] == "1/3"
    rec = p.run.jobs()[-1]
    assert rec["job_id"] == sub.job_id == "102" and rec["rank_base"] == base and rec["scaled"] is True
    script = p.run.job_script(f"{job.key}-from{base}", "slurm")
    assert rec["script"] == str(script) and "#SBATCH --array=0-1" in script.read_text()
    assert stat.S_IMODE(script.stat().st_mode) == slurm.script_mode(scaled)
    assert next_rank(p.run) == base + 2


def test_a_trainer_restart_replaces_the_old_record_and_is_no_new_job_event(slurm_run):
    p, _ = slurm_run
    job = next(j for j in p.jobs if j.role == "trainer")
    launcher.submit(p.run, job)
    (old,) = p.run.jobs()
    sub = launcher.submit(
        p.run, job, replaces={**old, "tasks": [{"state": "FAILED"}]}, announce=False, restart=1
    )
    (new,) = p.run.jobs()  # the replaced one is listed only with replaced=True
    assert new == {**old, "job_id": sub.job_id, "submitted": new["submitted"], "restart": 1}
    everything = json.loads(p.run.jobs_json.read_text())
    assert [(j["job_id"], j.get("replaced")) for j in everything] == [("101", True), ("102", None)]
    assert [e["job_id"] for e in events(p.run, "submitted")] == ["101"]


def test_every_launcher_reports_and_the_status_document_keeps_its_keys(slurm_run):
    p, _ = slurm_run
    reports = launcher.reports(p.run)
    assert [r.key for r in reports] == ["jobs", "processes"]
    assert not any(r.started or r.live(unknown=True) for r in reports)  # a dry run started nothing


def test_how_a_slurm_run_ended_is_told_by_its_trainer_not_by_a_lost_generator():
    """`streamrl status` of a run whose jobs all ended, before the run's end is recorded: a pool
    member lost (a killed relay's task FAILED) or released (CANCELLED) ends no run."""

    def job(role: str, *states: str) -> dict:
        return {"role": role, "tasks": [{"task": i, "state": s} for i, s in enumerate(states)]}

    done = job("trainer", "COMPLETED")
    assert slurm.ending([done, job("generator", "COMPLETED", "COMPLETED")]) == "finished"
    assert (
        slurm.ending([done, job("generator", "FAILED", "COMPLETED"), job("teacher", "CANCELLED")])
        == "finished"
    )
    assert slurm.ending([done, job("rendezvous", "COMPLETED"), job("env_server", "NODE_FAIL")]) == "finished"
    # the trainer's job, or another role that is no pool, tells a failed run
    assert slurm.ending([job("trainer", "FAILED"), job("generator", "COMPLETED")]) == "failed"
    assert slurm.ending([job("trainer", "CANCELLED"), job("generator", "FAILED")]) == "failed"
    assert slurm.ending([done, job("rendezvous", "TIMEOUT"), job("generator", "COMPLETED")]) == "failed"
    # pools alone (the trainer under another launcher): all completed, or "ended", leaving it to that one
    assert slurm.ending([job("generator", "COMPLETED", "COMPLETED")]) == "finished"
    assert slurm.ending([job("generator", "COMPLETED", "FAILED")]) == "ended"
