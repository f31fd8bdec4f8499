"""`streamrl profile` on SLURM: one job per hardware kind that the recipe's roles run on.

A profile describes one hardware kind, and the kinds a recipe uses are its roles' partitions
(their `gpu_type`), which this host usually is not. So for a recipe whose roles run on SLURM
clusters the measurement runs where they run:

    recipe roles ──► plan(): the kind of each role's (cluster, partition)  (problem.placement)
                 ──► one ProfileJob per kind: decode where the generator runs, train where the
                     trainer runs, both in one job when the two share a kind
    ProfileJob   ──► JobSpec (launch.plan.job_spec) ──► launch.slurm.submit(job_main, request.json)
    in the job:  job_main ──► profiling.local.run_profile (the worker child, CPU or CUDA settings)
                 ──► OUT/profile-<model>-<kind>.json
                 ──► progress lines appended to OUT/logs/profile-<kind>/progress.jsonl
    here:        watch() polls the jobs' states (launch.slurm.run_job_states) and tails the
                 progress files; a failed job is reported with its log's tail; Ctrl-C cancels

OUT must be on a filesystem the compute nodes share with this host (as a run directory is);
`OUT/profile-jobs.json` records the submitted jobs, and each profile's `notes.slurm` says which
job, cluster, partition and node measured it. The plan is pure and tested without SLURM.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from streamrl_cli import environ
from streamrl_cli.errors import ClusterError
from streamrl_cli.launch import slurm
from streamrl_cli.launch.plan import JobSpec, job_spec
from streamrl_cli.planner import ProfileError
from streamrl_cli.planner.problem import placement
from streamrl_cli.planner.profile import Profile, ProfileRequest, load_profile
from streamrl_cli.profiling.local import run_profile
from streamrl_cli.rundir import write_atomic

if TYPE_CHECKING:
    from rich.console import Console

    from streamrl_cli.recipe.schema import Recipe

JOBS_FILE = "profile-jobs.json"
TIME_MIN = 60  # wall-clock limit of a profile job (capped by the roles' own limits)
POLL_S = 5.0  # seconds between squeue calls; $STREAMRL_JOB_POLL_S overrides (environ.JOB_POLL)
LOG_LINES = 30  # lines of a failed job's log shown here
WORKER_LINES = 20  # lines of the worker's log a failed job copies into its own


@dataclass(frozen=True)
class ProfileJob:
    """One SLURM job: the measurements of one hardware kind, on one partition of that kind."""

    kind: str  # hardware kind (the partition's gpu_type, or "cpu"): names the profile
    cluster: str  # recipe key of the cluster it runs on
    partition: str | None
    measure: tuple[str, ...]  # decode (the generator's kind), train (the trainer's), or both
    roles: tuple[str, ...]  # the roles whose kind it measures
    gpus: int  # GPUs it asks for: the generator's TP degree for decode, one to train
    cpus: int  # CPU cores of its one task
    mem_gb: int | None
    time_min: int

    @property
    def name(self) -> str:
        return f"profile-{self.kind}"


def on_slurm(r: Recipe) -> bool:
    """Whether a role of the recipe runs on a SLURM cluster (then profiling does too)."""
    return any(r.clusters[x.cluster].launcher == "slurm" for x in (r.roles.generator, r.roles.trainer))


def plan(r: Recipe) -> list[ProfileJob]:
    """The jobs that profile the kinds of the recipe's SLURM roles, generator's kind first.

    Kinds, not partitions, are what a profile is of: two roles on partitions of the same kind
    share one job (on the generator's partition), which measures both curves.
    """
    g, t = r.roles.generator, r.roles.trainer
    merged: dict[str, ProfileJob] = {}
    for role, what, cfg in (("generator", "decode", g), ("trainer", "train", t)):
        if r.clusters[cfg.cluster].launcher != "slurm":
            continue
        where = placement(r, cfg.cluster, cfg.partition)
        part = r.clusters[cfg.cluster].partitions.get(where.partition or "")
        has_gpus = part is not None and part.gpus_per_node > 0
        gpus = (g.tensor_parallel if what == "decode" else 1) if has_gpus else 0
        job = ProfileJob(
            kind=where.kind,
            cluster=cfg.cluster,
            partition=where.partition,
            measure=(what,),
            roles=(role,),
            gpus=gpus,
            cpus=cfg.cpus_per_task,
            mem_gb=cfg.mem_gb,
            time_min=min(TIME_MIN, cfg.time_min),
        )
        first = merged.get(job.kind)
        merged[job.kind] = job if first is None else _merge(first, job)
    return list(merged.values())


def _merge(a: ProfileJob, b: ProfileJob) -> ProfileJob:
    mems = [m for m in (a.mem_gb, b.mem_gb) if m is not None]
    return replace(
        a,
        measure=a.measure + b.measure,
        roles=a.roles + b.roles,
        gpus=max(a.gpus, b.gpus),
        cpus=max(a.cpus, b.cpus),
        mem_gb=max(mems) if mems else None,
        time_min=max(a.time_min, b.time_min),
    )


def slurm_job(r: Recipe, job: ProfileJob) -> JobSpec:
    """The job as `streamrl run` would submit a role there (account, qos, setup, env of the cluster)."""
    return job_spec(
        r,
        job.name,
        job.cluster,
        job.partition,
        nodes=1,
        tasks=1,
        gpus=job.gpus,
        cpus=job.cpus,
        mem=job.mem_gb,
        time_min=job.time_min,
        array=None,
        max_running=None,
    )


def profile_path(out: Path, model: str, kind: str) -> Path:
    return out / f"profile-{model}-{kind}.json"


def describe(job: dict, task: dict | None, step: dict | None) -> str:
    """One progress row: the job's state until its worker reports, then the worker's last step."""
    head = f"{job['kind']} (job {job['job_id']})"
    state = task["state"] if task else "SUBMITTED"
    if state == "RUNNING" and step:
        return f"{head}: {step.get('text', '')}"
    if state == "RUNNING":
        return f"{head}: running on {task.get('nodes') or '?'}, starting"
    if state == "PENDING" and task.get("reason"):
        return f"{head}: pending ({task['reason']})"
    return f"{head}: {state.lower()}"


# --- inside the job ------------------------------------------------------------------------------


def job_main(request_file: str) -> str:
    """The job's entry (through submitit): measure, appending each progress record to the file."""
    spec = json.loads(Path(request_file).read_text())
    req = ProfileRequest.from_dict(spec["request"])
    progress = Path(spec["progress"])
    reported: list[dict] = []  # the worker's own error event, if it sent one

    def on_event(event: dict) -> None:
        if event.get("event") == "error":
            reported.append(event)
        line = json.dumps(event)
        print(line, flush=True)  # into the job's log as well
        with progress.open("a") as f:  # one open per record: the reader is on another host
            f.write(line + "\n")

    on_event({"event": "start", "host": socket.gethostname(), "job_id": os.environ.get("SLURM_JOB_ID")})
    try:
        run_profile(req, on_event, log_path=spec["worker_log"])
    except ProfileError as e:
        if not reported:  # the worker died without a word (killed, crashed): say what we know
            on_event({"event": "error", "message": str(e)})
        # The job's log tells the whole story, without submitit's traceback of this function:
        # the error, then the end of the worker's own log (where vLLM says why it died).
        worker_log = Path(spec["worker_log"])
        tail = (
            worker_log.read_text(errors="replace").splitlines()[-WORKER_LINES:] if worker_log.exists() else []
        )
        lines = [f"error: {e}", *([f"--- last lines of {worker_log}:", *tail] if tail else [])]
        print(*lines, sep="\n", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    return req.out


# --- on this host ---------------------------------------------------------------------------------


def out_dir(out: Path) -> Path:
    """`--out` of a SLURM profile, checked before anything is built or submitted: a directory (one
    profile per hardware kind), existing or to be made."""
    out = out.expanduser().resolve()
    if out.suffix == ".json" or (out.exists() and not out.is_dir()):
        raise ProfileError(f"--out {out}: on SLURM it names a directory (one profile per hardware kind)")
    return out


def profile_on_slurm(
    r: Recipe, base: ProfileRequest, out: Path, console: Console
) -> list[tuple[Path, Profile]]:
    """Submit one job per kind, watch them until they end, return the profiles written.

    Raises ProfileError (with each failed job's log tail) if a job did not write its profile.
    Ctrl-C or SIGTERM cancels the jobs still queued or running.
    """
    jobs = plan(r)
    out = out_dir(out)
    out.mkdir(parents=True, exist_ok=True)
    records: list[dict] = []
    ended: set[str] = set()

    def on_term(signum, frame):  # type: ignore[no-untyped-def]
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        submit(r, jobs, base, out, console, records)
        written, failures = watch(records, console, ended.add)
    except BaseException:
        for line in cancel([j for j in records if j["kind"] not in ended]):
            console.print(line, markup=False, highlight=False)
        raise
    finally:
        signal.signal(signal.SIGTERM, old)
    if failures:
        raise ProfileError("\n".join(failures))
    return written


def submit(
    r: Recipe, jobs: list[ProfileJob], base: ProfileRequest, out: Path, console: Console, records: list[dict]
) -> None:
    """Write each job's request and submit it; ``records`` (and OUT/profile-jobs.json) grow as it goes."""
    for pj in jobs:
        spec = slurm_job(r, pj)
        folder = slurm.log_folder(out, spec)
        folder.mkdir(parents=True, exist_ok=True)
        req = replace(
            base, hardware=pj.kind, out=str(profile_path(out, base.model, pj.kind)), measure=pj.measure
        )
        progress = folder / "progress.jsonl"
        progress.write_text("")  # a fresh file: the reader tails it from the start
        request_file = folder / "request.json"
        doc = {"request": asdict(req), "progress": str(progress), "worker_log": str(folder / "worker.log")}
        write_atomic(request_file, json.dumps(doc, indent=2) + "\n")
        job_id = slurm.submit(spec, r.run.name, out, job_main, request_file)
        records.append(
            {
                "kind": pj.kind,
                "measure": list(pj.measure),
                "roles": list(pj.roles),
                "cluster": pj.cluster,
                "slurm_cluster": spec.slurm_cluster,
                "partition": pj.partition,
                "job_id": job_id,
                "submitted": time.time(),
                "profile": req.out,
                "folder": str(folder),
            }
        )
        write_atomic(out / JOBS_FILE, json.dumps(records, indent=2) + "\n")
        where = f"{spec.slurm_cluster or 'default cluster'}/{pj.partition}"
        console.print(
            f"submitted {pj.name} ({' + '.join(pj.measure)}) to {where}: job {job_id}",
            markup=False,
            highlight=False,
        )


def watch(
    records: list[dict], console: Console, on_end: Callable[[str], None] = lambda kind: None
) -> tuple[list[tuple[Path, Profile]], list[str]]:
    """Draw the jobs' states and their workers' progress until every job has ended.

    Jobs are keyed by kind (one job each; job ids of two clusters may coincide); ``on_end(kind)``
    is called as soon as a job is seen to have ended.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    tails = {j["kind"]: Tail(Path(j["folder"]) / "progress.jsonl") for j in records}
    steps: dict[str, dict] = {}
    states: dict[str, dict] = {}
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        rows = {j["kind"]: progress.add_task(describe(j, None, None), total=None) for j in records}
        next_poll = 0.0
        while True:
            if time.monotonic() >= next_poll:
                for j in slurm.run_job_states(records):
                    task = j["tasks"][0] if j["tasks"] else {"state": "UNKNOWN"}
                    before = states.get(j["kind"], {}).get("state")
                    if task["state"] in slurm.TERMINAL and before not in slurm.TERMINAL:
                        on_end(j["kind"])
                        if task["state"] != "COMPLETED":  # said now; the details come at the end
                            progress.console.print(
                                f"{j['kind']}: job {j['job_id']} ended {task['state']}", markup=False
                            )
                    states[j["kind"]] = task
                next_poll = time.monotonic() + environ.job_poll_s(POLL_S)
            done = {i for i, t in states.items() if t["state"] in slurm.TERMINAL}
            for j in records:
                i = j["kind"]
                for event in tails[i].read():
                    if event.get("event") == "step":
                        steps[i] = event
                total, completed = steps.get(i, {}).get("total"), steps.get(i, {}).get("done", 0)
                if i in done:  # a full bar for a finished job, an empty one for a failed job
                    total = total or 1
                    completed = total if states[i]["state"] == "COMPLETED" else completed
                progress.update(
                    rows[i],
                    description=describe(j, states.get(i), steps.get(i)),
                    total=total,
                    completed=completed,
                )
            if len(done) == len(records):
                break
            time.sleep(0.5)
    written, failures = [], []
    for j in records:
        state = states[j["kind"]]["state"]
        if state == "COMPLETED":
            try:
                written.append((Path(j["profile"]), load_profile(j["profile"])))
                continue
            except ProfileError as e:
                state = f"COMPLETED but {e}"
        failures.append(failure(j, state, tails[j["kind"]].errors))
    return written, failures


def failure(job: dict, state: str, errors: list[str]) -> str:
    """What went wrong with one job: its state, the worker's error, the tail of the job's log."""
    from submitit.core.utils import JobPaths

    where = f"{job['slurm_cluster'] or 'default cluster'}/{job['partition']}"
    text = f"profile job {job['job_id']} ({job['kind']} on {where}) ended {state}"
    if errors:
        text += f": {errors[-1]}"
    log = JobPaths(job["folder"], job_id=job["job_id"], task_id=0).stdout
    try:
        lines = log.read_text(errors="replace").splitlines()[-LOG_LINES:]
    except OSError:
        return text + f"\n  (no job log at {log})"
    return text + f"\n  last lines of {log}:\n    " + "\n    ".join(lines)


def cancel(records: list[dict]) -> list[str]:
    """Cancel the given jobs on their clusters; says what was done (errors included, not raised)."""
    lines = []
    for j in records:
        try:
            slurm.cancel(j.get("slurm_cluster"), j["job_id"])
            lines.append(f"cancelled profile job {j['job_id']} ({j['kind']})")
        except ClusterError as e:
            lines.append(str(e))
    return lines


class Tail:
    """New complete JSON lines of a file that another host appends to."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0
        self.errors: list[str] = []  # the error events seen

    def read(self) -> list[dict]:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        end = data.rfind(b"\n") + 1  # a line still being written is read next time
        self.offset += end
        events = []
        for line in data[:end].decode(errors="replace").splitlines():
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(event, dict):
                events.append(event)
                if event.get("event") == "error":
                    self.errors.append(str(event.get("message")))
        return events
