"""SLURM jobs through submitit, made cluster-aware.

submitit renders the sbatch script and pickles the role's entry function; what it lacks is
`--clusters`: it submits with `sbatch FILE` (the `#SBATCH --clusters=` line routes the job) but
polls state with `sacct -j ID` on the local cluster only. So here jobs are keyed by
(cluster, job id), and state and cancel go through `squeue -M` / `scancel -M` ourselves.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from streamrl_cli.environ import CPU_SLOT, RANK_BASE
from streamrl_cli.errors import ClusterError
from streamrl_cli.launch.launcher import Added, Instance, Launcher, Report, Submission
from streamrl_cli.launch.plan import JobSpec
from streamrl_cli.recipe.checks import templates_dir
from streamrl_cli.rundir import POOL_ROLES, RunDir, read_json_checked, write_atomic, write_json

SUBMITIT_COMMAND = "{python} -u -m submitit.core._submit {folder}"
SRUN_ARGS = ("--kill-on-bad-exit=1", "--cpu-bind=cores")
# Site options that submitit renders itself: set through its parameter, so one line comes out.
SUBMITIT_NAMES = {
    "mem": "mem",
    "wckey": "wckey",
    "account": "account",
    "qos": "qos",
    "comment": "comment",
    "constraint": "constraint",
    "exclude": "exclude",
    "mem-per-gpu": "mem_per_gpu",
    "mem-per-cpu": "mem_per_cpu",
}


def setup_lines(job: JobSpec, run_dir: Path) -> list[str]:
    """The job's setup: the cluster's template (Jinja, shell `${...}` left alone) then its env."""
    lines: list[str] = []
    if job.setup_template:
        import jinja2

        text = (templates_dir() / job.setup_template).read_text()
        tmpl = jinja2.Template(text, undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
        rendered = tmpl.render(site=job.site, cluster=job.cluster, role=job.role, run_dir=str(run_dir))
        lines += rendered.rstrip("\n").splitlines()
    lines += [f"export {k}={shlex.quote(str(v))}" for k, v in sorted(job.env.items())]
    return lines


def sbatch_parameters(job: JobSpec, run_name: str, run_dir: Path) -> dict[str, Any]:
    """submitit SlurmExecutor parameters for ``job`` (names as `_make_sbatch_string` takes them)."""
    extra: dict[str, Any] = {}
    if job.slurm_cluster:
        extra["clusters"] = job.slurm_cluster
    there = staged_run(job, run_dir)
    setup = setup_lines(job, there.path if there else run_dir)
    params: dict[str, Any] = {
        "job_name": f"streamrl-{run_name}-{job.role}",
        "partition": job.partition,
        "time": job.time_min,
        "nodes": job.nodes,
        "ntasks_per_node": job.tasks_per_node,
        "cpus_per_task": job.cpus_per_task,
        "setup": [*stage_lines(job, run_dir), *setup] if there else setup,
        "stderr_to_stdout": True,
        "signal_delay_s": job.signal_lead_s,
        "wckey": None,  # submitit's default ("submitit") is dropped: sites that want one set `sbatch.wckey`
        # One dead rank ends the step at once, instead of leaving the others in a collective until
        # its timeout; cores bound per task so that ranks do not migrate across each other's cores.
        "srun_args": [*SRUN_ARGS, *job.srun_args],
    }
    if job.gpus_per_node:
        params["gpus_per_node"] = job.gpus_per_node
    if job.mem_gb is not None:
        params["mem"] = f"{job.mem_gb}GB" if job.mem_gb else "0"
    if job.account:
        params["account"] = job.account
    if job.qos:
        params["qos"] = job.qos
    if job.exclusive:
        extra["exclusive"] = True
    if job.array:
        params["array_parallelism"] = job.max_running or job.array
    for key, value in job.sbatch.items():  # the site's options last: they may override ours (mem, time)
        if value is None or value is False:
            continue
        name = key.replace("_", "-")
        if name in SUBMITIT_NAMES:
            params[SUBMITIT_NAMES[name]] = value
        else:
            extra[name] = value
    if extra:
        params["additional_parameters"] = extra
    return params


def staged_run(job: JobSpec, run_dir: Path) -> RunDir | None:
    """Where a job on a cluster without the submit host's filesystem keeps this run's files
    (``run_root/<run id>``, same layout); None when it reads the run directory itself."""
    return RunDir(Path(job.run_root) / Path(run_dir).name) if job.run_root else None


def staged_files(job: JobSpec, run_dir: Path) -> dict[Path, tuple[bytes, int]]:
    """What a staged job reads, as its cluster's copies: path there -> (content, mode).

    The role spec with its paths moved to the staged directory, the run's secret, the rendezvous
    address once the server published it, and the server's CA when it uses TLS.
    """
    from streamrl_cli.launch import run_state
    from streamrl_cli.roles.spec import spec_yaml

    run, there = RunDir(Path(run_dir)), staged_run(job, run_dir)
    assert there is not None
    spec = run_state.role_spec(run, job.role)
    files: dict[Path, tuple[bytes, int]] = {there.secret: (run.secret.read_bytes(), 0o600)}
    if run.endpoint.is_file():
        files[there.endpoint] = (run.endpoint.read_bytes(), 0o644)
    ca = None
    if spec.rendezvous_ca:
        ca = str(there.staged_ca)
        files[there.staged_ca] = (Path(spec.rendezvous_ca).expanduser().read_bytes(), 0o644)
    spec = dataclasses.replace(
        spec,
        run_dir=str(there.path),
        rendezvous_file=str(there.endpoint),
        secret_file=str(there.secret),
        rendezvous_ca=ca,
    )
    files[there.role_spec(job.role)] = (spec_yaml(spec).encode(), 0o644)
    return files


def stage_lines(job: JobSpec, run_dir: Path) -> list[str]:
    """Shell lines that write the staged files on the job's first node before its role starts.

    The files travel inside the job script (SLURM carries it to the other cluster), base64-encoded;
    each is written beside its place and renamed, so array tasks starting together never read half
    a file. A requeued job writes them again, unchanged.
    """
    there = staged_run(job, run_dir)
    assert there is not None
    lines = [
        "# Staged: this cluster does not see the run directory; what its roles read follows.",
        f"mkdir -p -m 700 {shlex.quote(str(there.path))}",
        f"mkdir -p {shlex.quote(str(there.roles))} {shlex.quote(str(there.role_logs(job.role)))}"
        f" {shlex.quote(str(there.members))}",
    ]
    for path, (data, mode) in staged_files(job, run_dir).items():
        dest = shlex.quote(str(path))
        tmp = shlex.quote(f"{path}.part-") + '"$SLURM_JOB_ID"'
        lines += [
            f"(umask 077; base64 -d > {tmp} <<'STREAMRL_STAGED'",
            *base64.encodebytes(data).decode().splitlines(),
            "STREAMRL_STAGED",
            f"chmod {mode:o} {tmp} && mv -f {tmp} {dest})",
        ]
    return lines


def job_python(job: JobSpec) -> str:
    """The interpreter the job's nodes run: the cluster's own, else this host's (shared software)."""
    return job.python or shlex.quote(sys.executable)


def log_folder(run_dir: Path, job: JobSpec) -> Path:
    """Where the job's logs go: the role's log folder of the run (of its staged copy when staged)."""
    return (staged_run(job, run_dir) or RunDir(run_dir)).role_logs(job.role)


def job_command(job: JobSpec, run_dir: Path, python: str | None = None) -> str:
    """What each task of the job runs under srun.

    submitit's runner unpickles the role's entry from the log folder, which only a shared
    filesystem brings to the nodes; a staged job runs the role's own command on its staged spec.
    """
    py = job.python or python or job_python(job)
    there = staged_run(job, run_dir)
    if there is not None:
        return f"{py} -u -m streamrl_cli.roles {shlex.quote(str(there.role_spec(job.role)))}"
    return SUBMITIT_COMMAND.format(python=py, folder=shlex.quote(str(log_folder(run_dir, job))))


def render(job: JobSpec, run_name: str, run_dir: Path, python: str | None = None) -> str:
    """The sbatch script submitit will submit for ``job`` (same function, same parameters)."""
    from submitit.slurm.slurm import _make_sbatch_string

    text = _make_sbatch_string(
        command=job_command(job, run_dir, python),
        folder=log_folder(run_dir, job),
        map_count=job.array,
        **sbatch_parameters(job, run_name, run_dir),
    )
    return batch_log_in_run_root(text, job, run_dir)


def batch_log_in_run_root(text: str, job: JobSpec, run_dir: Path) -> str:
    """A staged job's own log (`#SBATCH --output`) goes directly in ``run_root``: SLURM opens it
    before the script runs, so its directory must already exist there, and the run's directory
    under it is made by the script. The roles' logs (srun's) go in the run's log folder there."""
    if not job.run_root:
        return text
    folder, root = log_folder(run_dir, job), Path(job.run_root)
    for flag in ("output", "error"):
        text = text.replace(f"#SBATCH --{flag}={folder}/", f"#SBATCH --{flag}={root}/{Path(run_dir).name}-")
    return text


def script_mode(job: JobSpec) -> int:
    """A staged job's script carries the run's secret: readable by its owner only."""
    return 0o600 if job.run_root else 0o644


def submit(job: JobSpec, run_name: str, run_dir: Path, entry: Any, spec_path: Path) -> str:
    """Submit ``entry(spec_path)`` as ``job``; returns the SLURM job id (the array id for arrays).

    A staged job (``run_root``) runs ``python -m streamrl_cli.roles`` on its staged spec instead
    of submitit's runner; submitit still renders, submits and numbers it.
    """
    import submitit

    cls = _array_executor() if job.array else _executor()
    if job.run_root:
        cls = _staged_executor(job, run_dir, cls)
    executor = cls(folder=RunDir(run_dir).role_logs(job.role), python=job_python(job))
    executor.update_parameters(**sbatch_parameters(job, run_name, run_dir))
    try:
        if job.array:
            jobs = executor.map_array(entry, [str(spec_path)] * job.array)
            return jobs[0].job_id.split("_")[0]
        return executor.submit(entry, str(spec_path)).job_id
    except (submitit.core.utils.FailedJobError, subprocess.CalledProcessError, OSError) as e:
        raise ClusterError(
            f"sbatch refused the {job.role} job on cluster {job.cluster!r}: {_stderr(e)}"
        ) from None


# Variables of the job a submission is made from that the new job must not inherit: sbatch passes
# the environment on, and srun in the new job then refuses e.g. the old job's SLURM_MEM_PER_CPU
# beside its own SLURM_MEM_PER_NODE ("mutually exclusive"). SLURM_CONF names the cluster: kept.
KEPT_SLURM_VARS = frozenset({"SLURM_CONF"})


def outside_job_env(environ: Any = None) -> list[str]:
    """`env -u ...` that runs a command without the SLURM job variables of the job we are in (none
    outside a job): a trainer submitted again by the rendezvous role's job watcher, or a generator
    array added by scaling, starts from a clean environment as one submitted from a login node."""
    environ = os.environ if environ is None else environ
    if "SLURM_JOB_ID" not in environ:
        return []
    drop = sorted(k for k in environ if k.startswith(("SLURM_", "SRUN_")) and k not in KEPT_SLURM_VARS)
    return ["env", *(arg for k in drop for arg in ("-u", k))]


def _executor() -> type:
    import submitit

    class Executor(submitit.SlurmExecutor):
        """submitit's executor, submitting outside the job it may be called from (`outside_job_env`)."""

        def _make_submission_command(self, submission_file_path):  # type: ignore[no-untyped-def]
            return [*outside_job_env(), *super()._make_submission_command(submission_file_path)]

    return Executor


def _array_executor() -> type:
    import uuid

    from submitit.core.utils import JobPaths
    from submitit.slurm.slurm import SlurmJob

    class ArrayExecutor(_executor()):
        """submitit's array branch, run by this executor itself: submitit submits a one-element map
        as a plain job (a generator stays an array even with one instance, so that elastic scaling
        is always adding or cancelling array tasks), and it submits larger arrays through a plain
        copy of the executor, which would drop a subclass's script (see `_staged_executor`)."""

        def _internal_process_submissions(self, delayed):  # type: ignore[no-untyped-def]
            folder = JobPaths.get_first_id_independent_folder(self.folder)
            folder.mkdir(parents=True, exist_ok=True)
            pickles = []
            for d in delayed:
                pickles.append(folder / f"{uuid.uuid4().hex}.pkl")
                d.set_timeout(self.parameters.get("time", 5), self.max_num_timeout)
                d.dump(pickles[-1])
            self.parameters["map_count"] = len(delayed)
            try:
                first = self._submit_command(self._submitit_command_str)
            finally:
                del self.parameters["map_count"]
            tasks = list(range(first.num_tasks))
            jobs = [
                SlurmJob(folder=self.folder, job_id=f"{first.job_id}_{a}", tasks=tasks)
                for a in range(len(delayed))
            ]
            for job, path in zip(jobs, pickles, strict=True):
                job.paths.move_temporary_file(path, "submitted_pickle")
            return jobs

    return ArrayExecutor


def _staged_executor(job: JobSpec, run_dir: Path, base: type) -> type:
    from submitit.slurm.slurm import _make_sbatch_string

    command, folder = job_command(job, run_dir), log_folder(run_dir, job)

    class StagedExecutor(base):  # type: ignore[misc, valid-type]
        """Submits from the run's log folder here; the job runs ``command`` and logs to ``folder``,
        on its own cluster's filesystem."""

        @property
        def _submitit_command_str(self) -> str:
            return command

        def _make_submission_file_text(self, command: str, uid: str) -> str:
            return batch_log_in_run_root(
                _make_sbatch_string(command=command, folder=folder, **self.parameters), job, run_dir
            )

    return StagedExecutor


def _stderr(e: BaseException) -> str:
    out = getattr(e, "stderr", None) or getattr(e, "output", None) or str(e)
    return out.decode(errors="replace").strip() if isinstance(out, bytes) else str(out).strip()


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
        job_id = submit(job, name, run.path, run_role, spec_path)
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
