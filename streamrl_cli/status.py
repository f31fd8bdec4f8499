"""`streamrl status`: what every part of a run is doing, from three sources that fail separately.

    run directory ── run.json, jobs.json, local.json, members/   (always there)
    SLURM         ── squeue -M <cluster> --json (sacct -M when accounting is on)
    rendezvous    ── GET /v1/status: membership, heartbeats, weight versions, progress, metrics

Each source that cannot be reached is reported as such and the others are still shown, so a
run whose rendezvous server is gone, or a cluster without accounting, still gets a status.
The JSON document (`--json`) is described in docs/status-json.md.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from streamrl_cli import rundir
from streamrl_cli.launch import local, slurm
from streamrl_cli.rundir import RunDir

ROLE_ORDER = ("rendezvous", "trainer", "generator")
SCHEMA_VERSION = 1


def collect(run: RunDir) -> dict[str, Any]:
    """The whole status of one run as one JSON-able document."""
    info = run.info()
    jobs = slurm.run_job_states(run.jobs()) if run.jobs() else []
    procs = local.procs(run)
    rdv = _rendezvous(run)
    members = rdv.pop("_members", [])
    roles = []
    for role in ROLE_ORDER:
        spec = _spec(run, role)
        roles.append(
            {
                "role": role,
                "cluster": spec.get("cluster"),
                "jobs": [j for j in jobs if j["role"] == role],
                "processes": [_proc(p) for p in procs if p.role == role],
                "members": _members(run, role, members),
            }
        )
    state, problems = _derive_state(info.get("state", "unknown"), jobs, procs)
    problems += _member_errors(run)
    return {
        "schema": SCHEMA_VERSION,
        "run": run.name,
        "name": info.get("name"),
        "path": str(run.path),
        "state": state,
        "recorded_state": info.get("state"),
        "problems": problems,
        "recipe": info.get("recipe"),
        "overrides": info.get("overrides", []),
        "launchers": info.get("launchers", []),
        "clusters": info.get("clusters", {}),
        "created": info.get("created"),
        "age_s": round(time.time() - info["created"], 1) if info.get("created") else None,
        "rendezvous": rdv,
        "progress": rdv.get("progress") or _progress_from_metrics(run),
        "roles": roles,
    }


def _rendezvous(run: RunDir) -> dict[str, Any]:
    endpoint = rundir.read_json(run.path / "rendezvous.json") or {}
    out: dict[str, Any] = {"url": endpoint.get("url"), "reachable": False, "error": None}
    if not endpoint.get("url"):
        out["error"] = "not started (no rendezvous.json)"
        return out
    if endpoint.get("stopped"):
        out["error"] = "stopped at " + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(endpoint["stopped"]))
        return out
    from streamrl_cli.errors import RendezvousError
    from streamrl_cli.rendezvous.client import RendezvousClient

    ca = _spec(run, "rendezvous").get("rendezvous_ca")
    try:
        with RendezvousClient.from_run_dir(run.path, timeout=2.0, retry_s=0.0, tls_ca=ca) as client:
            st = client.status()
    except (RendezvousError, OSError) as e:
        out["error"] = f"unreachable: {str(e).splitlines()[0]}"
        return out
    out.update(
        reachable=True,
        uptime_s=st.get("server", {}).get("uptime_s"),
        lease_s=st.get("server", {}).get("lease_s"),
        event_seq=st.get("event_seq"),
        counts=st.get("counts", {}),
        versions=st.get("versions", {}),
        progress=st.get("progress") or {},
        _members=[
            {**m, "metrics": (st.get("metrics", {}).get(m["member_id"]) or {}).get("record", {})}
            for m in st.get("members", [])
        ],
    )
    return out


def _spec(run: RunDir, role: str) -> dict[str, Any]:
    import yaml

    try:
        return yaml.safe_load((run.path / "roles" / f"{role}.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return {}


def _members(run: RunDir, role: str, live: list[dict]) -> list[dict]:
    """Members of ``role``: the server's view when it answers, else the start records on disk."""
    if live:
        rows = [m for m in live if m["role"] == role]
        return [
            {
                "rank": m["rank"],
                "member_id": m["member_id"],
                "state": m["state"],
                "host": m["host"],
                "cluster": m.get("cluster"),
                "last_heartbeat_s": m.get("last_heartbeat_age_s"),
                "weight_version": m.get("weight_version"),
                "incarnation": m.get("incarnation"),
                "reported_state": m.get("reported_state"),
                "metrics": m.get("metrics", {}),
            }
            for m in sorted(rows, key=lambda m: m["rank"])
        ]
    out = []
    for f in sorted((run.path / "members").glob(f"{role}-*.json")):
        rec = rundir.read_json(f) or {}
        state = "exited" if "exit_code" in rec else "unknown"
        out.append(
            {
                "rank": rec.get("rank"),
                "member_id": None,
                "state": state,
                "host": rec.get("host"),
                "cluster": rec.get("cluster"),
                "last_heartbeat_s": None,
                "weight_version": None,
                "incarnation": None,
                "reported_state": None,
                "metrics": {},
            }
        )
    return out


def _member_errors(run: RunDir) -> list[str]:
    """The reason each failed process wrote into its record before exiting (its first line)."""
    out = []
    for f in sorted((run.path / "members").glob("*.json")):
        rec = rundir.read_json(f) or {}
        if rec.get("exit_code") and rec.get("error"):
            where = f" on {rec['host']}" if rec.get("host") else ""
            first = str(rec["error"]).strip().splitlines()[0] if str(rec["error"]).strip() else ""
            out.append(
                f"{rec.get('role')} rank {rec.get('rank')}{where} exited with {rec['exit_code']}: {first}"
            )
    return out


def _proc(p: local.LocalProc) -> dict[str, Any]:
    return {"rank": p.rank, "pid": p.pid, "state": "running" if p.alive() else "exited", "log": p.log}


def _derive_state(recorded: str, jobs: list[dict], procs: list[local.LocalProc]) -> tuple[str, list[str]]:
    """The run's state now; ``recorded`` is what run.json says (it may lag what SLURM knows)."""
    problems = []
    for j in jobs:
        for t in j["tasks"]:
            if t["state"] in slurm.TERMINAL - {"COMPLETED"} and recorded not in ("cancelled",):
                task = f"[{t['task']}]" if t["task"] is not None else ""
                where = j.get("slurm_cluster") or "default cluster"
                problems.append(f"{j['role']} job {j['job_id']}{task} on {where}: {t['state']}")
    if recorded not in ("running", "created"):
        return recorded, problems
    role_procs = [p for p in procs if p.role != "rendezvous"]
    local_alive = any(p.alive() for p in role_procs)
    if jobs and slurm.all_ended(jobs) and not local_alive:
        final = {t["state"] for j in jobs for t in j["tasks"]}
        return ("finished" if final == {"COMPLETED"} else "failed"), problems
    if not jobs and role_procs and not local_alive:
        return "ended", problems + ["local processes are gone but the run was not marked finished"]
    pending = any(t["state"] == "PENDING" for j in jobs for t in j["tasks"])
    running = local_alive or any(t["state"] == "RUNNING" for j in jobs for t in j["tasks"])
    return ("running" if running else "pending" if pending else recorded), problems


def _progress_from_metrics(run: RunDir) -> dict[str, Any]:
    """Without a server: the last metrics record that has a step."""
    try:
        with open(run.path / "metrics.jsonl", "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 65536))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return {}
    for line in reversed(lines):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        record = rec.get("record", rec)
        if "step" in record:
            return record
    return {}


def runs_summary() -> list[dict[str, Any]]:
    """One line per catalogued run, cheap enough for many runs: no server is asked."""
    out = []
    for run in rundir.catalog():
        info = run.info()
        jobs = run.jobs()
        state = info.get("state", "unknown")
        if state == "running" and not jobs:  # a local run: are its processes there?
            state = (
                "running" if any(p.alive() for p in local.procs(run) if p.role != "rendezvous") else "ended"
            )
        out.append(
            {
                "run": run.name,
                "name": info.get("name"),
                "path": str(run.path),
                "launchers": info.get("launchers", []),
                "clusters": sorted(
                    c.get("slurm_cluster") or k for k, c in (info.get("clusters") or {}).items()
                ),
                "state": state,
                "step": _progress_from_metrics(run).get("step"),
                "created": info.get("created"),
                "age_s": round(time.time() - info["created"], 1) if info.get("created") else None,
                "jobs": len(jobs),
            }
        )
    if any(r["state"] == "running" and r["jobs"] for r in out):
        _refresh_slurm_states(out)
    return out


def _refresh_slurm_states(rows: list[dict[str, Any]]) -> None:
    for row in rows:
        if row["state"] == "running" and row["jobs"]:
            jobs = slurm.run_job_states(RunDir(Path(row["path"])).jobs())
            state, _ = _derive_state("running", jobs, [])
            row["state"] = state
