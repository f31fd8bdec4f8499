"""`streamrl run`: render, submit, watch. Nothing here trains or generates.

    recipe ──► plan.jobs + plan.role_specs ──► run dir (config.yaml, roles/*.yaml, secret, jobs/*)
           ──► rendezvous server: a local process on this host (or its own SLURM job)
           ──► each job: its cluster's launcher (launch.launcher): SLURM through submitit
               (-M cluster) │ local processes
           ──► local jobs: watched in the foreground until they end; Ctrl-C stops every role

A SLURM-only run returns once submitted; its rendezvous server stays up on this host and stops
itself when the run's jobs have ended (see launch.server_role).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from streamrl_cli import rundir
from streamrl_cli.errors import ClusterError, RendezvousError, ResumeError
from streamrl_cli.launch import launcher, local, plan
from streamrl_cli.launch.plan import JobSpec
from streamrl_cli.launch.supervise import keeper
from streamrl_cli.recipe.load import Composed
from streamrl_cli.rendezvous import create_secret
from streamrl_cli.roles.restart import mark_trainer_start
from streamrl_cli.roles.spec import RoleSpec, TrainerSpec, spec_yaml
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
    write_atomic(run.config, OmegaConf.to_yaml(OmegaConf.structured(r)))
    jobs = plan.jobs(r)
    specs = plan.role_specs(r, run.path)
    spec_paths = {}
    for role, spec in specs.items():
        spec_paths[role] = run.role_spec(role)
        write_atomic(spec_paths[role], spec_yaml(spec))
    create_secret(run.path)
    scripts = {}
    for job in jobs:
        scripts[job.key] = run.job_script(job.key, job.launcher)
        text, mode = launcher.get(job.launcher).render(job, run, r.run.name, spec_paths[job.role])
        write_atomic(scripts[job.key], text, mode=mode)
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
    from streamrl_cli.errors import RecipeError
    from streamrl_cli.launch import run_state

    # A job whose state its cluster cannot tell may still run, too.
    if any(rep.live(unknown=True) for rep in launcher.reports(run)):
        raise ClusterError(
            f"run {run.name} still has roles running: stop it first (`streamrl cancel {run.name}`)"
        )
    try:
        recipe = run_state.recipe(run)
    except RecipeError as e:
        raise ResumeError(f"cannot resume run {run.name}: {'; '.join(e.problems)}") from None
    # The trainer resumes from run_dir/checkpoints/iter-N/ (complete once its state.json exists).
    ckpts = run.checkpoints
    if not (ckpts.is_dir() and any((p / "state.json").is_file() for p in ckpts.glob("iter-*"))):
        raise ResumeError(
            f"cannot resume run {run.name}: it has no complete checkpoint in {ckpts} "
            "(train.checkpoint_every sets how often one is written); start it anew with `streamrl run`"
        )
    n = len(list(run.attempts.glob("*"))) + 1 if run.attempts.is_dir() else 1
    for path in run.attempt_leftovers():
        if path.exists():
            run.attempt(n).mkdir(parents=True, exist_ok=True)
            os.replace(path, run.attempt(n) / path.name)
    jobs = plan.jobs(recipe)
    roles = [r for r in plan.ROLES if r in plan.roles_of(recipe)]
    spec_paths = {role: run.role_spec(role) for role in roles}
    specs = {role: run_state.role_spec(run, role) for role in roles}
    scripts = {j.key: run.job_script(j.key, j.launcher) for j in jobs}
    run.update_info(state="created", resumed=time.time(), attempt=n + 1, trainer_restarts=0)
    run.event("resumed", attempt=n + 1)
    return Prepared(run=run, specs=specs, spec_paths=spec_paths, jobs=jobs, scripts=scripts)


def prepare_model(p: Prepared, console: Console) -> None:
    """Build the recipe's model on this host first if its builder says how (the embedded default's
    tiny model and its warm-up), so that role processes never race to build it."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from streamrl_cli.models.warmup import ensure_model

    spec = p.specs["trainer"]
    assert isinstance(spec, TrainerSpec)
    path = Path(os.path.expanduser(spec.model.path))
    if path.exists() or not spec.model.builder:
        return
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # ours is the one that counts
    hf_logging.set_verbosity_error()
    with Progress(
        TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
        TextColumn("loss {task.fields[loss]:.3f}"), TimeElapsedColumn(), console=console, transient=True,
    ) as progress:  # fmt: skip
        bar = progress.add_task(f"building {spec.model.name} (once, cached)", total=None, loss=float("nan"))

        def report(step: int, steps: int, loss: float) -> None:
            progress.update(bar, description="warming up the model", completed=step, total=steps, loss=loss)

        ensure_model(spec.model, spec.task, progress=report)
    console.print(f"model {spec.model.name}: {path}", markup=False, highlight=False)


def launch(p: Prepared, console: Console) -> int:
    """Start the rendezvous, then every job; watch local processes until they end. Returns an exit code."""
    run = p.run
    prepare_model(p, console)
    rdv_job = next((j for j in p.jobs if j.role == "rendezvous"), None)
    role_jobs = [j for j in p.jobs if j.role != "rendezvous"]
    # Does this command stay to watch roles (local processes), or return once they are submitted?
    foreground = any(launcher.get(j.launcher).foreground for j in role_jobs)
    try:
        if rdv_job is None:  # the server runs on this host
            command = local.role_command(p.spec_paths["rendezvous"], 0)
            if not foreground:
                # This command returns once the jobs are submitted: a keeper restarts the server.
                command = [sys.executable, "-u", "-m", keeper.__name__, str(run.path), "--", *command]
            local.spawn(run, "rendezvous", 0, command)
        else:
            _submit(run, rdv_job, console)
        if rdv_job is not None:
            console.print("waiting for the rendezvous job to start ...")
        url = wait_rendezvous(run, RENDEZVOUS_START_S if rdv_job is None else RENDEZVOUS_JOB_START_S)
        console.print(f"rendezvous: {url}")
        for job in role_jobs:
            _submit(run, job, console)
    except BaseException as e:
        # Whatever started stays accounted for: stop local processes, cancel submitted jobs.
        cancel(run, reason=f"launch failed: {e}")
        run.update_info(state="failed")
        raise
    run.update_info(state="running", started=time.time())
    mark_trainer_start(run)
    if foreground:
        from streamrl_cli.launch.supervise.local_watch import watch_local

        return watch_local(run, console, cancel, restart=_trainer_restarter(p))
    console.print(
        f"submitted; follow with `streamrl status {run.name}`, stop with `streamrl cancel {run.name}`"
    )
    return 0


def _submit(run: RunDir, job: JobSpec, console: Console) -> None:
    console.print(launcher.submit(run, job).line)


def wait_rendezvous(run: RunDir, timeout: float) -> str:
    """The server's URL, once it has published it; fails early if its local process died."""
    deadline = time.monotonic() + timeout
    f = run.endpoint
    while time.monotonic() < deadline:
        info = rundir.read_json(f)
        if info and info.get("url"):
            return info["url"]
        rdv = [r for r in local.procs(run) if r.role == "rendezvous"]
        if rdv and not rdv[0].alive():
            raise RendezvousError(f"the rendezvous server exited at start:\n{local.log_tail(rdv[0].log)}")
        time.sleep(0.1)
    raise RendezvousError(f"the rendezvous server did not start within {timeout:.0f} s (see {run.path}/logs)")


def _trainer_restarter(p: Prepared) -> Callable[[], object] | None:
    """Starts the trainer job again (it resumes from the newest checkpoint), if this command watches
    it (else the rendezvous role's job watcher does, see launch.server_role)."""
    job = next((j for j in p.jobs if j.role == "trainer"), None)
    if job is None or not launcher.get(job.launcher).foreground:
        return None
    # Its restart is the run's event (`trainer_restarted`), not the start of a job.
    return lambda: launcher.submit(p.run, job, announce=False)


def cancel(
    run: RunDir, reason: str = "cancelled by user", say: Callable[[str], object] | None = None
) -> list[str]:
    """Cancel every job of the run on every cluster and stop its local processes. Returns what was
    done: one line per job, and per process what actually happened to it (stopped, killed, or why
    it was not signalled); ``say`` gets each line once its launcher is through, so that what was
    stopped is said even when something else could not be (a ClusterError then)."""
    done: list[str] = []
    errors: list[str] = []
    ended_as = run.info().get("state")
    if ended_as not in ENDED_STATES:
        ended_as = None
    elif not any(rep.live() for rep in launcher.reports(run)):
        return done  # nothing of it runs: its record of how it ended stays as it is
    if ended_as is None:
        # Said before any signal is sent, so that a `streamrl run` watching the roles reads their
        # exits as a cancel, not as a failure.
        run.update_info(state="cancelling")
    # Every launcher, whichever the run's clusters use: queued jobs first, local processes (this
    # host's rendezvous server among them, last) after.
    for each in launcher.every():
        did, failed = each.cancel(run)
        if say is not None:
            for line in did:
                say(line)
        done += did
        errors += failed
    if ended_as is None:
        run.update_info(state="cancelled", ended=time.time())
        run.event("cancelled", reason=reason, actions=done, errors=errors)
    else:  # a run that had ended (its generators still shutting down, say) keeps how it ended
        run.event("leftovers_stopped", reason=reason, ended_as=ended_as, actions=done, errors=errors)
    if errors:
        raise ClusterError("; ".join(errors))
    return done
