"""What SLURM says of a run's jobs, and scancel, on the job's own cluster (``-M``).

submitit polls state with `sacct -j ID` on the local cluster only; here jobs are keyed by
(cluster, job id) and asked of `squeue -M` (then sacct, where accounting is on); `scancel -M` stops
them. How a run whose jobs all ended ended (`ending`) is judged from those states.
"""

from __future__ import annotations

import json
import subprocess

from streamrl_cli.errors import ClusterError
from streamrl_cli.rundir import POOL_ROLES


def _m(slurm_cluster: str | None) -> list[str]:
    return ["-M", slurm_cluster] if slurm_cluster else []


def cancel(slurm_cluster: str | None, job_id: str) -> None:
    """scancel on the right cluster (without -M, scancel goes to the local cluster and says nothing)."""
    proc = subprocess.run(["scancel", *_m(slurm_cluster), str(job_id)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise ClusterError(
            f"scancel {job_id} on {slurm_cluster or 'the local cluster'}: {proc.stderr.strip()}"
        )


def query(slurm_cluster: str | None, job_ids: list[str]) -> dict[str, list[dict]]:
    """Current state of jobs (one entry per array task) from `squeue --json`, then sacct for the rest.

    Works without accounting: squeue keeps finished jobs for MinJobAge; jobs neither squeue nor
    sacct know come back as state UNKNOWN.
    """
    out: dict[str, list[dict]] = {j: [] for j in job_ids}
    if not job_ids:
        return out
    cmd = ["squeue", *_m(slurm_cluster), "--json", "--states=all", "--jobs=" + ",".join(job_ids)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if proc.returncode == 0:
        for rec in _squeue_records(proc.stdout):
            if rec["job_id"] in out:
                out[rec["job_id"]].append(rec)
    missing = [j for j, recs in out.items() if not recs]
    if missing:
        for rec in _sacct(slurm_cluster, missing):
            out.setdefault(rec["job_id"], []).append(rec)
    for j in out:
        if not out[j]:
            out[j] = [
                {
                    "job_id": j,
                    "task": None,
                    "state": "UNKNOWN",
                    "reason": "not known to squeue or sacct",
                    "nodes": "",
                }
            ]
        out[j].sort(key=lambda r: (r["task"] is None, str(r["task"])))
    return out


def _squeue_records(text: str) -> list[dict]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return []
    recs = []
    for j in data.get("jobs", []):
        array_id = j.get("array_job_id") or 0
        task = j.get("array_task_id")
        if isinstance(array_id, dict):  # newer openapi versions wrap numbers
            array_id = array_id.get("number", 0)
        if isinstance(task, dict):
            task = task.get("number") if task.get("set") else None
        is_array = bool(array_id)
        state = j.get("job_state")
        if isinstance(state, list):
            state = state[0] if state else "UNKNOWN"
        recs.append(
            {
                "job_id": str(array_id if is_array else j.get("job_id")),
                "task": (task if task is not None else j.get("array_task_string") or None)
                if is_array
                else None,
                "state": state or "UNKNOWN",
                "reason": "" if j.get("state_reason") in (None, "None") else j["state_reason"],
                "nodes": j.get("nodes") or "",
                "partition": j.get("partition") or "",
            }
        )
    return recs


def _sacct(slurm_cluster: str | None, job_ids: list[str]) -> list[dict]:
    cmd = [
        "sacct",
        *_m(slurm_cluster),
        "-X",
        "-n",
        "-P",
        "-o",
        "JobID,State,NodeList,Partition,Reason",
        "-j",
        ",".join(job_ids),
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if proc.returncode != 0:
        return []  # accounting disabled: squeue is all there is
    recs = []
    for line in proc.stdout.splitlines():
        parts = line.split("|")
        if len(parts) < 5:
            continue
        jid, _, task = parts[0].partition("_")
        recs.append(
            {
                "job_id": jid,
                "task": task or None,
                "state": parts[1].split()[0],
                "nodes": parts[2],
                "partition": parts[3],
                "reason": parts[4] if parts[4] != "None" else "",
            }
        )
    return recs


TERMINAL = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "OUT_OF_MEMORY",
    "NODE_FAIL",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
    "REVOKED",
    "SPECIAL_EXIT",
}


def run_job_states(jobs: list[dict]) -> list[dict]:
    """The submitted jobs of a run (jobs.json records) with one `tasks` list each, queried per cluster."""
    by_cluster: dict[str | None, list[str]] = {}
    for j in jobs:
        by_cluster.setdefault(j.get("slurm_cluster"), []).append(str(j["job_id"]))
    states: dict[tuple[str | None, str], list[dict]] = {}
    for cluster, ids in by_cluster.items():
        try:
            found = query(cluster, ids)
        except (OSError, subprocess.TimeoutExpired) as e:
            unknown = {"task": None, "state": "UNKNOWN", "reason": str(e), "nodes": ""}
            found = {i: [{"job_id": i, **unknown}] for i in ids}
        for i, recs in found.items():
            states[(cluster, i)] = recs
    return [{**j, "tasks": states.get((j.get("slurm_cluster"), str(j["job_id"])), [])} for j in jobs]


def all_ended(jobs_with_tasks: list[dict]) -> bool:
    return all(t["state"] in TERMINAL for j in jobs_with_tasks for t in j["tasks"]) and bool(jobs_with_tasks)


def ending(jobs_with_tasks: list[dict]) -> str:
    """How a run ended whose jobs (the current ones: a trainer restart's replaced jobs are not
    listed) all ended, judged as the run's supervisor judges its members. A generator, teacher or
    environment server task that failed or was released (cancelled) was a pool member lost or let go,
    which ends no run: the trainer's job and the other roles' say how it ended. So a finished run
    that lost a generator (or its site's relay) on the way says finished while its end is recorded,
    not failed. Without a trainer job among them (a launcher holding only pools), a lost member
    leaves the ending to the trainer's launcher ("ended")."""
    judged = [j for j in jobs_with_tasks if j["role"] not in POOL_ROLES]
    if {t["state"] for j in judged for t in j["tasks"]} - {"COMPLETED"}:
        return "failed"
    if any(j["role"] == "trainer" for j in judged):
        return "finished"
    pools = {t["state"] for j in jobs_with_tasks if j["role"] in POOL_ROLES for t in j["tasks"]}
    return "finished" if pools <= {"COMPLETED"} else "ended"


def unfinished(jobs_with_tasks: list[dict], unknown: bool = False) -> list[dict]:
    """The jobs with a task that SLURM does not report ended. With ``unknown`` a job SLURM knows
    nothing of (forgotten, or SLURM unreachable) counts too: for a run without a readable record of
    its own state, jobs.json is all there is to tell what may still run."""
    ended = TERMINAL if unknown else TERMINAL | {"UNKNOWN"}
    return [j for j in jobs_with_tasks if any(t["state"] not in ended for t in j["tasks"])]
