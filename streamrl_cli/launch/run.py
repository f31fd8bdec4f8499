"""`streamrl run`: render, submit, watch. Nothing here trains or generates.

    recipe ──► plan.jobs + plan.role_specs ──► run dir (config.yaml, roles/*.yaml, secret, jobs/*)
           ──► rendezvous server: a local process on this host (or its own SLURM job)
           ──► each job: SLURM through submitit (-M cluster) │ local processes
           ──► local jobs: watched in the foreground until they end; Ctrl-C stops every role

A SLURM-only run returns once submitted; its rendezvous server stays up on this host and stops
itself when the run's jobs have ended (see roles.rendezvous).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import yaml
from rich.console import Console

from streamrl_cli import rundir
from streamrl_cli.errors import ClusterError, RendezvousError
from streamrl_cli.launch import local, plan, slurm
from streamrl_cli.launch.plan import JobSpec, RoleSpec
from streamrl_cli.recipe.load import Composed
from streamrl_cli.rundir import RunDir, write_atomic

ENDED_STATES = ("finished", "failed", "cancelled", "dry-run")
RENDEZVOUS_START_S = 60.0  # a local server starts in about a second
RENDEZVOUS_JOB_START_S = 900.0  # a server job may wait in the queue first


@dataclass
class Prepared:
    run: RunDir
    specs: dict[str, RoleSpec]
    spec_paths: dict[str, Path]
    jobs: list[JobSpec]
    scripts: dict[str, Path]  # job key -> rendered script


def prepare(composed: Composed, root: Path | None = None, dry_run: bool = False) -> Prepared:
    """Create the run directory and write everything a launch needs; submits nothing."""
    from omegaconf import OmegaConf

    r = composed.recipe
    run = rundir.create(root or Path(r.run.root), r.run.name)
    write_atomic(run.path / "config.yaml", OmegaConf.to_yaml(OmegaConf.structured(r)))
    jobs = plan.jobs(r)
    specs = plan.role_specs(r, run.path)
    spec_paths = {}
    for role, spec in specs.items():
        spec_paths[role] = run.path / "roles" / f"{role}.yaml"
        write_atomic(spec_paths[role], yaml.safe_dump(dataclasses.asdict(spec), sort_keys=False))
    run.ensure_secret()
    scripts = {}
    for job in jobs:
        if job.launcher == "slurm":
            scripts[job.key] = run.path / "jobs" / f"{job.key}.sbatch"
            write_atomic(scripts[job.key], slurm.render(job, r.run.name, run.path))
        else:
            scripts[job.key] = run.path / "jobs" / f"{job.key}.sh"
            write_atomic(scripts[job.key], local.render(job, spec_paths[job.role]))
    run.update_info(
        name=r.run.name,
        run_id=run.name,
        iterations=r.train.iterations,
        recipe=str(composed.path),
        overrides=composed.overrides,
        choices=composed.choices,
        created=time.time(),
        launchers=sorted({j.launcher for j in jobs}),
        clusters={
            k: {"launcher": c.launcher, "slurm_cluster": c.slurm_cluster, "site": c.site}
            for k, c in r.clusters.items()
        },
        state="dry-run" if dry_run else "created",
        submit_host=os.uname().nodename,
    )
    rundir.catalog_add(run)
    return Prepared(run=run, specs=specs, spec_paths=spec_paths, jobs=jobs, scripts=scripts)


def reopen(run: RunDir) -> Prepared:
    """A run directory made ready to launch again (`--resume`): same config, role files and secret.

    What the previous attempt left that would confuse this one — its local process table, its job
    list, the old server's address — moves to ``attempts/<n>/``; checkpoints, metrics and the
    rendezvous journal stay (the trainer resumes from the checkpoints, the server from the journal).
    """
    from omegaconf import OmegaConf

    from streamrl_cli.recipe.schema import Recipe

    alive = [r for r in local.procs(run) if r.alive()]
    if alive or (run.jobs() and not slurm.all_ended(slurm.run_job_states(run.jobs()))):
        raise ClusterError(
            f"run {run.name} still has roles running: stop it first (`streamrl cancel {run.name}`)"
        )
    try:
        tree = OmegaConf.load(run.path / "config.yaml")
        recipe = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Recipe), tree))
    except (OSError, ValueError) as e:
        raise ClusterError(f"cannot read {run.path / 'config.yaml'} to resume: {e}") from None
    attempts = run.path / "attempts"
    n = len(list(attempts.glob("*"))) + 1 if attempts.is_dir() else 1
    for name in ("local.json", "jobs.json", "rendezvous.json"):
        if (run.path / name).exists():
            (attempts / str(n)).mkdir(parents=True, exist_ok=True)
            os.replace(run.path / name, attempts / str(n) / name)
    jobs = plan.jobs(recipe)
    spec_paths = {
        role: run.path / "roles" / f"{role}.yaml" for role in ("trainer", "generator", "rendezvous")
    }
    from streamrl_cli.roles.entry import load_spec

    specs = {role: load_spec(path) for role, path in spec_paths.items()}
    scripts = {
        j.key: run.path / "jobs" / f"{j.key}.{'sbatch' if j.launcher == 'slurm' else 'sh'}" for j in jobs
    }
    run.update_info(state="created", resumed=time.time(), attempt=n + 1)
    run.event("resumed", attempt=n + 1)
    return Prepared(run=run, specs=specs, spec_paths=spec_paths, jobs=jobs, scripts=scripts)


def prepare_model(p: Prepared, console: Console) -> None:
    """Build the recipe's model on this host first if its builder says how (the embedded default's
    tiny model and its warm-up), so that role processes never race to build it."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from streamrl_cli.models.warmup import ensure_model

    spec = p.specs["trainer"]
    path = Path(os.path.expanduser(str(spec.model["path"])))
    if path.exists() or not spec.model.get("builder"):
        return
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # ours is the one that counts
    hf_logging.set_verbosity_error()
    with Progress(
        TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
        TextColumn("loss {task.fields[loss]:.3f}"), TimeElapsedColumn(), console=console, transient=True,
    ) as progress:  # fmt: skip
        bar = progress.add_task(
            f"building {spec.model['name']} (once, cached)", total=None, loss=float("nan")
        )

        def report(step: int, steps: int, loss: float) -> None:
            progress.update(bar, description="warming up the model", completed=step, total=steps, loss=loss)

        ensure_model(spec.model, spec.task, progress=report)
    console.print(f"model {spec.model['name']}: {path}", markup=False, highlight=False)


def launch(p: Prepared, console: Console) -> int:
    """Start the rendezvous, then every job; watch local processes until they end. Returns an exit code."""
    run = p.run
    prepare_model(p, console)
    rdv_job = next((j for j in p.jobs if j.role == "rendezvous"), None)
    role_jobs = [j for j in p.jobs if j.role != "rendezvous"]
    try:
        if rdv_job is None:
            local.spawn(run, "rendezvous", 0, local.role_command(p.spec_paths["rendezvous"], 0))
        else:
            _submit(p, rdv_job, console)
        if rdv_job is not None:
            console.print("waiting for the rendezvous job to start ...")
        url = wait_rendezvous(run, RENDEZVOUS_START_S if rdv_job is None else RENDEZVOUS_JOB_START_S)
        console.print(f"rendezvous: {url}")
        for job in role_jobs:
            if job.launcher == "slurm":
                _submit(p, job, console)
            else:
                local.start_job(run, job, p.spec_paths[job.role])
                run.event("started", role=job.role, cluster=job.cluster, processes=job.processes)
                console.print(f"started {job.processes} local {job.role} process(es)")
    except BaseException as e:
        # Whatever started stays accounted for: stop local processes, cancel submitted jobs.
        cancel(run, reason=f"launch failed: {e}")
        run.update_info(state="failed")
        raise
    run.update_info(state="running", started=time.time())
    if any(j.launcher == "local" for j in role_jobs):
        return watch_local(run, console)
    console.print(
        f"submitted; follow with `streamrl status {run.name}`, stop with `streamrl cancel {run.name}`"
    )
    return 0


def _submit(p: Prepared, job: JobSpec, console: Console) -> None:
    from streamrl_cli.roles.entry import run_role

    job_id = slurm.submit(job, p.run.info()["name"], p.run.path, run_role, p.spec_paths[job.role])
    rec = {
        "role": job.role,
        "cluster": job.cluster,
        "slurm_cluster": job.slurm_cluster,
        "job_id": job_id,
        "array": job.array,
        "partition": job.partition,
        "submitted": time.time(),
        "script": str(p.scripts[job.key]),
    }
    p.run.add_job(rec)
    p.run.event("submitted", **{k: rec[k] for k in ("role", "cluster", "job_id")})
    where = f"{job.slurm_cluster or 'default cluster'}/{job.partition}"
    array = f" array of {job.array}" if job.array else ""
    console.print(f"submitted {job.role}{array} to {where}: job {job_id}")


def wait_rendezvous(run: RunDir, timeout: float) -> str:
    """The server's URL, once it has published it; fails early if its local process died."""
    deadline = time.monotonic() + timeout
    f = run.path / "rendezvous.json"
    while time.monotonic() < deadline:
        info = rundir.read_json(f)
        if info and info.get("url"):
            return info["url"]
        rdv = [r for r in local.procs(run) if r.role == "rendezvous"]
        if rdv and not rdv[0].alive():
            raise RendezvousError(f"the rendezvous server exited at start:\n{local.log_tail(rdv[0].log)}")
        time.sleep(0.1)
    raise RendezvousError(f"the rendezvous server did not start within {timeout:.0f} s (see {run.path}/logs)")


def watch_local(run: RunDir, console: Console) -> int:
    """Wait for the local role processes, with a live table; Ctrl-C (or SIGTERM) stops them all."""
    from rich.live import Live

    from streamrl_cli.launch.view import live_view, summary_line

    stop = {"signal": None}

    def on_signal(signum, _frame):  # type: ignore[no-untyped-def]
        stop["signal"] = signum

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    roles = [r for r in local.procs(run) if r.role != "rendezvous"]
    failed: list[local.LocalProc] = []
    try:
        with Live(live_view(run), console=console, refresh_per_second=2, transient=False) as live:
            while stop["signal"] is None:
                codes = {r.pid: local.exit_code(r) for r in roles}
                failed = [r for r in roles if codes[r.pid] not in (None, 0)]
                if failed or all(c is not None for c in codes.values()):
                    break
                live.update(live_view(run))
                time.sleep(0.5)
            live.update(live_view(run))
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if stop["signal"] is not None:
        console.print("stopping: signal received, stopping every role ...")
        cancel(run, reason="interrupted")
        return 130
    if run.info().get("state") in ("cancelling", "cancelled"):  # `streamrl cancel` from elsewhere
        return 130
    state = "failed" if failed else "finished"
    local.stop(local.procs(run))  # the rendezvous server (and anything a failed role left)
    run.update_info(state=state, ended=time.time())
    run.event(state, failed=[f"{r.role}-{r.rank}" for r in failed])
    for r in failed:
        console.print(
            f"[red]{r.role} rank {r.rank} exited with {local.exit_code(r)}[/red]; last lines of {r.log}:"
        )
        console.print(local.log_tail(r.log), markup=False, highlight=False)
    if not console.is_terminal:
        console.line()  # the live table leaves no line break when output goes to a file or pipe
    summary = summary_line(run)
    if summary:
        console.print(summary, markup=False, highlight=False)
    console.print(f"run {run.name} {state} (logs in {run.path / 'logs'}; `streamrl status {run.name}`)")
    if summary:
        console.print(f"plots: `streamrl plot {run.name}`", markup=False, highlight=False)
    return 1 if failed else 0


def cancel(run: RunDir, reason: str = "cancelled by user") -> list[str]:
    """Cancel every job of the run on every cluster and stop its local processes. Returns what was done."""
    done, errors = [], []
    if run.info().get("state") in ENDED_STATES:
        return done  # its record of how it ended stays as it is
    # Said before any signal is sent, so that a `streamrl run` watching the roles reads their
    # exits as a cancel, not as a failure.
    run.update_info(state="cancelling")
    for job in run.jobs():
        try:
            slurm.cancel(job.get("slurm_cluster"), job["job_id"])
            done.append(
                f"scancel {job['job_id']} ({job['role']} on {job.get('slurm_cluster') or 'default cluster'})"
            )
        except ClusterError as e:
            errors.append(str(e))
    live = [r for r in local.procs(run) if r.alive()]
    # Roles first, the rendezvous last: members can still say goodbye while it is up.
    local.stop([r for r in live if r.role != "rendezvous"])
    local.stop([r for r in live if r.role == "rendezvous"])
    done += [f"stopped local {r.role} rank {r.rank} (pid {r.pid})" for r in live]
    run.update_info(state="cancelled", ended=time.time())
    run.event("cancelled", reason=reason, actions=done, errors=errors)
    if errors:
        raise ClusterError("; ".join(errors))
    return done
