"""Applying a generator instance count to a run: local processes, or SLURM array jobs.

An instance is identified by its rank (`generator-<rank>` in the rendezvous). Ranks are never
reused: a new instance takes the next rank after every rank the run ever had, so the trainer sees
a new member, not a restart of an old one.

- **Local**: a new instance is one more role process (`local.spawn`, recorded in `local.json` like
  the others, so `status` and `cancel` see it). A released one gets SIGTERM: it aborts what is in
  flight, hands over what finished, leaves the rendezvous (the trainer re-dispatches what it still
  owed, at once), and exits; its process group is killed after a grace period if it does not.
- **SLURM**: new instances are a new array job of the generator role on its own cluster (rank =
  `STREAMRL_RANK_BASE` + task id), recorded in `jobs.json` with `rank_base`, so `status` shows it
  and `cancel` cancels it. A released instance is `scancel -M <cluster> <job>_<task>` of that task
  only (SLURM sends SIGTERM first: the same hand-over), noted in the record's `released` list.

The newest instances go first when releasing: at a far site the relay is the lowest rank, so it
stays.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from streamrl_cli.environ import CPU_SLOT, RANK_BASE
from streamrl_cli.errors import ClusterError
from streamrl_cli.launch import local, plan, slurm
from streamrl_cli.launch.plan import JobSpec
from streamrl_cli.rundir import RunDir, write_atomic, write_json


@dataclass(kw_only=True)
class Instance:
    rank: int
    launcher: str  # local | slurm
    pid: int | None = None
    job_id: str | None = None  # the array job
    task: int | None = None  # the array task id
    slurm_cluster: str | None = None


@dataclass(kw_only=True)
class ScaleResult:
    before: int
    after: int
    added: list[int] = field(default_factory=list)
    released: list[int] = field(default_factory=list)
    jobs: list[str] = field(default_factory=list)  # SLURM array jobs submitted


def generator_job(run: RunDir) -> JobSpec:
    """The generator role's job as the run launched it (from its resolved config)."""
    return role_job(run, "generator")


def role_job(run: RunDir, role: str) -> JobSpec:
    """A role's job as the run launched it (from its resolved config)."""
    from omegaconf import OmegaConf

    from streamrl_cli.recipe.schema import Recipe

    try:
        tree = OmegaConf.load(run.config)
        recipe = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Recipe), tree))
    except (OSError, ValueError) as e:
        raise ClusterError(f"cannot read {run.config}: {e}") from None
    return next(j for j in plan.jobs(recipe) if j.role == role)


def launcher_of(run: RunDir) -> str:
    """How the run's generators are started (local or slurm)."""
    from streamrl_cli.roles.spec import load_spec

    cluster = load_spec(run.role_spec("generator")).cluster
    return run.info().get("clusters", {}).get(cluster, {}).get("launcher", "local")


def instances(run: RunDir) -> list[Instance]:
    """The generator instances the run has now (started or queued, not released, not ended)."""
    out = [
        Instance(rank=p.rank, launcher="local", pid=p.pid)
        for p in local.procs(run)
        if p.role == "generator" and p.alive()
    ]
    jobs = [j for j in run.jobs() if j["role"] == "generator"]
    if jobs:
        for j in slurm.run_job_states(jobs):
            ended = {
                t["task"] for t in j["tasks"] if isinstance(t["task"], int) and t["state"] in slurm.TERMINAL
            }
            aggregate = not any(isinstance(t["task"], int) for t in j["tasks"])  # one line for the array
            if aggregate and j["tasks"] and all(t["state"] in slurm.TERMINAL for t in j["tasks"]):
                continue
            released = set(j.get("released", []))
            for task in range(int(j.get("array") or 1)):
                if task in ended or task in released:
                    continue
                out.append(
                    Instance(
                        rank=int(j.get("rank_base", 0)) + task, launcher="slurm", job_id=str(j["job_id"]),
                        task=task, slurm_cluster=j.get("slurm_cluster"),
                    )
                )  # fmt: skip
    return sorted(out, key=lambda i: i.rank)


def next_rank(run: RunDir) -> int:
    """One past every generator rank the run ever had (processes, array tasks, start records)."""
    ranks = [p.rank for p in local.procs(run) if p.role == "generator"]
    for j in run.jobs():
        if j["role"] == "generator":
            ranks.append(int(j.get("rank_base", 0)) + int(j.get("array") or 1) - 1)
    for f in run.members.glob("generator-*.json"):
        suffix = f.stem.removeprefix("generator-")
        if suffix.isdigit():
            ranks.append(int(suffix))
    return max(ranks, default=-1) + 1


def apply(run: RunDir, target: int, *, job: JobSpec | None = None) -> ScaleResult:
    """Start or release generator instances until the run has `target`."""
    if target < 0:
        raise ClusterError(f"cannot scale to {target} generator instances (0 or more)")
    have = instances(run)
    result = ScaleResult(before=len(have), after=len(have))
    if target > len(have):
        job = job or generator_job(run)
        base, k = next_rank(run), target - len(have)
        if job.launcher == "local":
            spec_path = run.role_spec("generator")
            for i, rank in enumerate(range(base, base + k)):
                # Its place among the instances that will share this host, so that its engine gets
                # cores of its own instead of the first instance's (see generator.main.cpu_binding).
                env = {**job.env, CPU_SLOT: f"{len(have) + i}/{target}"}
                local.spawn(run, "generator", rank, local.role_command(spec_path, rank), env)
        else:
            result.jobs.append(_submit(run, job, base, k, slots=(len(have), target)))
        result.added = list(range(base, base + k))
    elif target < len(have):
        going = have[target:][::-1]  # the newest first; the lowest ranks (a site's relay) stay
        release(run, going)
        result.released = [i.rank for i in going]
    result.after = len(have) + len(result.added) - len(result.released)
    return result


def release(run: RunDir, going: list[Instance], grace_s: float = 30.0) -> None:
    procs = {p.pid: p for p in local.procs(run)}
    local.stop([procs[i.pid] for i in going if i.launcher == "local" and i.pid in procs], grace_s=grace_s)
    errors = []
    for i in going:
        if i.launcher != "slurm":
            continue
        try:
            slurm.cancel(i.slurm_cluster, f"{i.job_id}_{i.task}")
        except ClusterError as e:
            errors.append(str(e))
            continue
        _mark_released(run, i)
    if errors:
        raise ClusterError("; ".join(errors))


def _mark_released(run: RunDir, inst: Instance) -> None:
    jobs = run.jobs(replaced=True)
    for j in jobs:
        if str(j["job_id"]) == inst.job_id and j.get("slurm_cluster") == inst.slurm_cluster:
            j["released"] = sorted({*j.get("released", []), inst.task})
    write_json(run.jobs_json, jobs)


def _submit(run: RunDir, job: JobSpec, base: int, k: int, slots: tuple[int, int]) -> str:
    from streamrl_cli.roles.entry import run_role

    # Task t's CPU slot is first + t of the instances sharing a node (see generator.main.cpu_binding).
    first, count = slots
    env = {**job.env, RANK_BASE: str(base), CPU_SLOT: f"{first}/{count}"}
    scaled = dataclasses.replace(job, array=k, env=env)
    name = run.info().get("name", run.name)
    script = run.job_script(f"{job.key}-from{base}", "slurm")
    write_atomic(script, slurm.render(scaled, name, run.path), mode=slurm.script_mode(scaled))
    job_id = slurm.submit(scaled, name, run.path, run_role, run.role_spec("generator"))
    run.add_job(
        {
            "role": "generator", "cluster": job.cluster, "slurm_cluster": job.slurm_cluster,
            "job_id": job_id, "array": k, "rank_base": base, "partition": job.partition,
            "submitted": time.time(), "script": str(script), "scaled": True,
        }
    )  # fmt: skip
    run.event("submitted", role="generator", cluster=job.cluster, job_id=job_id)
    return job_id
