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
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from streamrl_cli import rundir
from streamrl_cli.errors import ClusterError, RendezvousError, ResumeError, StreamRLError
from streamrl_cli.launch import keeper, launcher, local, plan
from streamrl_cli.launch.plan import JobSpec
from streamrl_cli.recipe.load import Composed
from streamrl_cli.rendezvous import create_secret
from streamrl_cli.roles.restart import mark_trainer_start, trainer_restarts_left
from streamrl_cli.roles.spec import RoleSpec, TrainerSpec, spec_yaml
from streamrl_cli.rundir import POOL_ROLES, RunDir, write_atomic

ENDED_STATES = ("finished", "failed", "cancelled", "dry-run")
RENDEZVOUS_START_S = 60.0  # a local server starts in about a second
RENDEZVOUS_JOB_START_S = 900.0  # a server job may wait in the queue first
GENERATOR_EXIT_S = 30.0  # after the trainer left, for generators to hand over and exit on their own


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
        return watch_local(run, console, restart=_trainer_restarter(p))
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


def watch_local(run: RunDir, console: Console, restart: Callable[[], object] | None = None) -> int:
    """Wait for the local role processes, with a live table; Ctrl-C (or SIGTERM) stops them all.

    A trainer that dies is started again by ``restart`` while roles.trainer.restarts allows; a
    local rendezvous server that dies, up to keeper.RENDEZVOUS_RESTARTS times (see `_revive_rendezvous`).
    """
    from rich.live import Live

    from streamrl_cli.launch.live_view import live_view, summary_line

    stop = {"signal": None}

    def on_signal(signum, _frame):  # type: ignore[no-untyped-def]
        stop["signal"] = signum

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    roles = [r for r in local.procs(run) if r.role != "rendezvous"]
    failed: list[local.LocalProc] = []
    gone: set[int] = set()  # generators (and teachers) that failed: the run goes on without them
    replaced: set[int] = set()  # trainer processes that died and were started again
    no_generator = ""  # the pool ("generator", "teacher") with none left, if one is
    follower = _scale_follower(run, console)
    try:
        with Live(live_view(run), console=console, refresh_per_second=2, transient=False) as live:
            while stop["signal"] is None:
                if follower is not None:
                    _follow_scale(follower, console)
                released = follower.released if follower is not None else set()
                known = {r.pid for r in roles}  # generators started later (scaled up) are watched too
                procs = local.procs(run)
                roles += [r for r in procs if r.role != "rendezvous" and r.pid not in known]
                codes = {r.pid: _exit_code(r) for r in roles}
                # Released instances (scaled in) leave on purpose, whatever their exit code.
                members = [
                    r
                    for r in roles
                    if r.role in POOL_ROLES and not (r.role == "generator" and r.rank in released)
                ]
                for r in members:
                    if codes[r.pid] not in (None, 0) and r.pid not in gone:
                        gone.add(r.pid)
                        _generator_failed(run, r, codes[r.pid], console)
                failed = [
                    r
                    for r in roles
                    if codes[r.pid] not in (None, 0) and r.role not in POOL_ROLES and r.pid not in replaced
                ]
                trainers = [r for r in roles if r.role == "trainer" and r.pid not in replaced]
                dead_rendezvous = _revive_rendezvous(
                    run, [r for r in procs if r.role == "rendezvous"], console
                )
                if dead_rendezvous is not None:
                    failed.append(dead_rendezvous)
                for pool in POOL_ROLES:
                    of_pool = [r for r in members if r.role == pool]
                    if any(r.pid in gone for r in of_pool) and all(codes[r.pid] is not None for r in of_pool):
                        # None left, and not released (those exit 0): nothing will produce (or score) samples.
                        failed += [r for r in of_pool if r.pid in gone]
                        no_generator = pool
                if (
                    restart is not None
                    and failed
                    and all(r.role == "trainer" for r in failed)
                    and run.info().get("state") not in ("cancelling", "cancelled")
                    and trainer_restarts_left(run) > 0
                ):
                    replaced |= {r.pid for r in trainers}
                    _restart_trainer(run, trainers, failed, restart, console)
                    continue  # its new processes are in local.json: the next pass watches them
                if failed or all(codes[r.pid] is not None for r in trainers):
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
    # Generators finish on their own once the trainer left; the server goes last.
    _wait_exit([r for r in roles if r.role in POOL_ROLES], GENERATOR_EXIT_S)
    local.stop([r for r in local.procs(run) if r.role != "rendezvous"])  # anything a role left
    local.stop(local.procs(run))  # the rendezvous server
    run.update_info(state=state, ended=time.time())
    run.event(
        state,
        failed=[f"{r.role}-{r.rank}" for r in failed],
        **({"reason": f"no {no_generator} left: every {no_generator} failed"} if no_generator else {}),
    )
    if no_generator:
        console.print(f"[red]no {no_generator} left: every {no_generator} failed[/red]; the run cannot go on")
    for r in failed:
        console.print(
            f"[red]{r.role} rank {r.rank} exited with {_exit_code(r)}[/red]; last lines of {r.log}:"
        )
        console.print(local.log_tail(r.log), markup=False, highlight=False)
    if not console.is_terminal:
        console.line()  # the live table leaves no line break when output goes to a file or pipe
    summary = summary_line(run)
    if summary:
        console.print(summary, markup=False, highlight=False)
    console.print(f"run {run.name} {state} (logs in {run.logs}; `streamrl status {run.name}`)")
    if summary:
        console.print(f"plots: `streamrl plot {run.name}`", markup=False, highlight=False)
    return 1 if failed else 0


def _restart_trainer(
    run: RunDir,
    trainers: list[local.LocalProc],
    failed: list[local.LocalProc],
    restart: Callable[[], object],
    console: Console,
) -> None:
    """The trainer died: stop its other ranks (they would wait in a collective), stop what the dead
    ones left, and start the job again; it resumes from the newest checkpoint and the generators,
    which wait for it, serve the new process once they load the weights it pushes first."""
    codes = {f"{r.role}-{r.rank}": _exit_code(r) for r in failed}
    local.stop([r for r in trainers if r.alive()])
    for r in failed:
        local.reap(r)
    n = int(run.info().get("trainer_restarts") or 0) + 1
    run.update_info(trainer_restarts=n)
    mark_trainer_start(run)
    run.event("trainer_restarted", restart=n, exit_codes=codes)
    for r in failed:
        console.print(
            f"[yellow]trainer rank {r.rank} exited with {codes[f'{r.role}-{r.rank}']}[/yellow]; "
            f"starting the trainer again from the newest checkpoint (restart {n}); last lines of {r.log}:"
        )
        console.print(local.log_tail(r.log, 5), markup=False, highlight=False)
    restart()


def _generator_failed(run: RunDir, rec: local.LocalProc, code: int | None, console: Console) -> None:
    """A generator (or teacher) died (killed, crashed): the trainer re-dispatches its work to the others
    (it sees the member leave or its lease expire); here, what it left running in its group is stopped."""
    left = local.reap(rec)
    run.event("member_failed", role=rec.role, rank=rec.rank, exit_code=code, reaped=left)
    console.print(
        f"[yellow]{rec.role} rank {rec.rank} exited with {code}[/yellow]; the run goes on without it"
        + (f" (stopped {len(left)} process(es) it left: {left})" if left else "")
        + f"; last lines of {rec.log}:"
    )
    console.print(local.log_tail(rec.log, 5), markup=False, highlight=False)


def _revive_rendezvous(run: RunDir, recs: list[local.LocalProc], console: Console) -> local.LocalProc | None:
    """Start the run's local rendezvous server again if it died (returns it once it died too often).
    `recs`: its process records, as the watch loop read them. Only this launcher knows its exit
    code: it is the one that watches it.

    Its journal keeps the run's state (members, versions, progress) and members follow it to its
    new port through rendezvous.json, retrying meanwhile; heartbeats that missed a beat get a grace
    lease. A server that keeps dying is a failure of the run, with its log's last lines.
    """
    if not recs or any(r.alive() for r in recs):
        return None
    last = max(recs, key=lambda r: r.created)
    code = local.exit_code(last)
    if code is None or keeper.stopped_on_purpose(run, code):
        return None  # running, or stopped on purpose (the run directory deleted, a cancel)
    n = keeper.count_restart(run, code)
    if n is None:
        return last  # it died too often
    console.print(
        f"[yellow]the rendezvous server exited with {code}[/yellow]; starting it again from its journal "
        f"({n} of {keeper.RENDEZVOUS_RESTARTS})"
    )
    local.spawn(run, "rendezvous", 0, local.role_command(run.role_spec("rendezvous"), 0))
    return None


def _exit_code(rec: local.LocalProc) -> int | None:
    """Its exit code; a process we did not start (added by `streamrl scale`) that is gone counts as 0
    unless its start record says otherwise."""
    code = local.exit_code(rec)
    if code is None and not local.started_here(rec) and not rec.alive():
        return 0
    return code


def _wait_exit(recs: list[local.LocalProc], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(local.exit_code(r) is None and r.alive() for r in recs):
        time.sleep(0.2)


def _scale_follower(run: RunDir, console: Console):  # type: ignore[no-untyped-def]
    """The follower of scale requests when this process is the one that applies them (local generators)."""
    from streamrl_cli.launch import run_state
    from streamrl_cli.launch.scale_follow import ScaleFollower
    from streamrl_cli.rendezvous import RendezvousClient

    try:
        if not launcher.of_role(run, "generator").foreground:
            return None  # the rendezvous role's job watcher applies them
        ca = run_state.role_spec(run, "rendezvous").rendezvous_ca
        # Short retries: the watch loop must stay responsive while the server restarts or stops.
        return ScaleFollower(run, RendezvousClient.from_run_dir(run.path, tls_ca=ca, retry_s=2.0))
    except StreamRLError as e:
        console.print(f"[yellow]scaling unavailable for this run: {e}[/yellow]")
        return None


def _follow_scale(follower, console: Console) -> bool:  # type: ignore[no-untyped-def]
    """Apply pending scale requests; True when instances were started or released."""
    try:
        written = follower.poll()
    except StreamRLError as e:  # the server unreachable for a moment: the next poll retries
        console.print(f"[yellow]scale requests: {e}[/yellow]")
        return False
    for ev in written:
        if ev["event"] == "scaled":
            console.print(
                f"generators {ev['before']} -> {ev['after']} ({ev['source']}"
                f"{': ' + ev['reason'] if ev['reason'] else ''})", markup=False, highlight=False,
            )  # fmt: skip
        elif ev["event"] == "scale_failed":
            console.print(f"[red]scale request {ev['request']} failed: {ev['error']}[/red]")
    return any(ev["event"] == "scaled" for ev in written)


def cancel(run: RunDir, reason: str = "cancelled by user") -> list[str]:
    """Cancel every job of the run on every cluster and stop its local processes. Returns what was
    done: one line per job, and per process what actually happened to it (stopped, killed, or why
    it was not signalled)."""
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
