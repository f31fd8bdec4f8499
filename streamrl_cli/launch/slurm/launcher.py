"""The SLURM launcher (`launcher: slurm`): role jobs rendered (.script), submitted (.submission),
recorded in jobs.json, and followed, scaled and cancelled through the queue (.queue)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from streamrl_cli.environ import CPU_SLOT, RANK_BASE
from streamrl_cli.errors import ClusterError
from streamrl_cli.launch.base import Added, Instance, Launcher, Report, Submission
from streamrl_cli.launch.plan import JobSpec
from streamrl_cli.launch.slurm import submission
from streamrl_cli.launch.slurm.queue import TERMINAL, all_ended, cancel, ending, run_job_states, unfinished
from streamrl_cli.launch.slurm.script import render, script_mode
from streamrl_cli.rundir import RunDir, read_json_checked, write_atomic, write_json


class SlurmLauncher(Launcher):
    """Roles as SLURM jobs through submitit (`launcher: slurm`), recorded in jobs.json; once they
    are submitted `streamrl run` returns, and the rendezvous role's job watcher follows them.

    Generator instances are array tasks. Instances added by scaling are a new array job of the
    role (rank = `STREAMRL_RANK_BASE` + task id, recorded with `rank_base`); a released instance is
    `scancel -M <cluster> <job>_<task>` of that task only (SLURM sends SIGTERM first: the instance
    hands over and leaves), noted in its record's `released` list.
    """

    name = "slurm"
    foreground = False

    def render(self, job: JobSpec, run: RunDir, run_name: str, spec_path: Path) -> tuple[str, int]:
        return render(job, run_name, run.path), script_mode(job)

    def start(
        self,
        run: RunDir,
        job: JobSpec,
        spec_path: Path,
        *,
        added: Added | None = None,
        replaces: dict | None = None,
        note: dict | None = None,
    ) -> Submission:
        """Submit the job, writing the script it is (a staged job's carries the rendezvous address,
        known only now); its jobs.json record is new, or takes the place of ``replaces``."""
        from streamrl_cli.roles.entry import run_role

        key = job.key
        if added is not None:
            # Task t's CPU slot is slot + t of the instances sharing a node (see generator.main.cpu_binding).
            env = {**job.env, RANK_BASE: str(added.rank), CPU_SLOT: f"{added.slot}/{added.slots}"}
            job, key = dataclasses.replace(job, env=env), f"{job.key}-from{added.rank}"
        name = run.info().get("name", run.name)
        script = run.job_script(key, self.name)
        write_atomic(script, render(job, name, run.path), mode=script_mode(job))
        job_id = submission.submit(job, name, run.path, run_role, spec_path)
        now = time.time()
        if replaces is not None:
            old = {k: v for k, v in replaces.items() if k != "tasks"}  # a state query's, not a record's
            run.replace_job(replaces, {**old, "job_id": job_id, "submitted": now, **(note or {})})
        else:
            rec: dict[str, Any] = {
                "role": job.role, "cluster": job.cluster, "slurm_cluster": job.slurm_cluster,
                "job_id": job_id, "array": job.array,
                **({"rank_base": added.rank} if added is not None else {}),
                "partition": job.partition, "submitted": now, "script": str(script),
                **({"scaled": True} if added is not None else {}),
                **(note or {}),
            }  # fmt: skip
            run.add_job(rec)
        where = f"{job.slurm_cluster or 'default cluster'}/{job.partition}"
        array = f" array of {job.array}" if job.array else ""
        return Submission(
            job=job,
            job_id=job_id,
            event=("submitted", {"role": job.role, "cluster": job.cluster, "job_id": job_id}),
            line=f"submitted {job.role}{array} to {where}: job {job_id}",
        )

    def report(self, run: RunDir) -> Report:
        jobs = run_job_states(run.jobs()) if run.jobs() else []
        units: dict[str, list[dict]] = {}
        for j in jobs:
            units.setdefault(j["role"], []).append(j)
        problems = []
        for j in jobs:
            for t in j["tasks"]:
                if t["state"] in TERMINAL - {"COMPLETED"}:
                    task = f"[{t['task']}]" if t["task"] is not None else ""
                    where = j.get("slurm_cluster") or "default cluster"
                    problems.append(f"{j['role']} job {j['job_id']}{task} on {where}: {t['state']}")
        states = {t["state"] for j in jobs for t in j["tasks"]}
        ended = ending(jobs) if jobs and all_ended(jobs) else None
        return Report(
            key="jobs",
            units=units,
            started=bool(jobs),
            running="RUNNING" in states,
            pending="PENDING" in states,
            ended=ended,
            problems=problems,
            stoppable=lambda unknown: bool(unfinished(jobs, unknown=unknown)),
        )

    def cancel(self, run: RunDir) -> tuple[list[str], list[str]]:
        done, errors = [], []
        _, damaged = read_json_checked(run.jobs_json)
        if damaged:
            errors.append(
                f"{damaged}: cannot tell which SLURM jobs to cancel; find them with "
                f"`squeue --name {run.info().get('name') or run.name}` and scancel them"
            )
        for job in run.jobs():  # jobs.json, not run.json, says which jobs the run has
            try:
                cancel(job.get("slurm_cluster"), job["job_id"])
                done.append(
                    f"scancel {job['job_id']} ({job.get('role', '?')} on "
                    f"{job.get('slurm_cluster') or 'default cluster'})"
                )
            except ClusterError as e:
                errors.append(str(e))
        return done, errors

    def instances(self, run: RunDir, role: str) -> list[Instance]:
        out: list[Instance] = []
        jobs = [j for j in run.jobs() if j["role"] == role]
        if not jobs:
            return out
        for j in run_job_states(jobs):
            ended = {t["task"] for t in j["tasks"] if isinstance(t["task"], int) and t["state"] in TERMINAL}
            aggregate = not any(isinstance(t["task"], int) for t in j["tasks"])  # one line for the array
            if aggregate and j["tasks"] and all(t["state"] in TERMINAL for t in j["tasks"]):
                continue
            released = set(j.get("released", []))
            for task in range(int(j.get("array") or 1)):
                if task in ended or task in released:
                    continue
                out.append(
                    Instance(
                        rank=int(j.get("rank_base", 0)) + task, launcher=self.name, job_id=str(j["job_id"]),
                        task=task, slurm_cluster=j.get("slurm_cluster"),
                    )
                )  # fmt: skip
        return out

    def release(self, run: RunDir, going: list[Instance], grace_s: float) -> list[str]:
        """scancel of each task (SLURM's KillWait, not ``grace_s``, bounds its hand-over)."""
        errors = []
        for i in going:
            try:
                cancel(i.slurm_cluster, f"{i.job_id}_{i.task}")
            except ClusterError as e:
                errors.append(str(e))
                continue
            jobs = run.jobs(replaced=True)
            for j in jobs:
                if str(j["job_id"]) == i.job_id and j.get("slurm_cluster") == i.slurm_cluster:
                    j["released"] = sorted({*j.get("released", []), i.task})
            write_json(run.jobs_json, jobs)
        return errors

    def ranks(self, run: RunDir, role: str) -> list[int]:
        return [
            int(j.get("rank_base", 0)) + int(j.get("array") or 1) - 1 for j in run.jobs() if j["role"] == role
        ]
