"""`streamrl run` in the foreground: the supervisor's side for a run's local role processes.

It feeds launch.supervise.supervisor what the processes' exit codes say, restarts the trainer processes
and the local rendezvous server, applies scale requests, and keeps a live table on the terminal;
Ctrl-C (or SIGTERM) stops every role. The decisions are the supervisor's, the same as for
SLURM jobs (launch.supervise.slurm_watch).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

from rich.console import Console
from rich.live import Live

from streamrl_cli.errors import StreamRLError
from streamrl_cli.launch import launcher, local
from streamrl_cli.launch.supervise import keeper
from streamrl_cli.launch.supervise.live_view import live_view, summary_line
from streamrl_cli.launch.supervise.supervisor import COMPLETED, FAILED, RUNNING, Member, Outcome, supervise
from streamrl_cli.roles.restart import mark_trainer_start
from streamrl_cli.rundir import POOL_ROLES, RunDir

GENERATOR_EXIT_S = 30.0  # after the trainer left, for generators to hand over and exit on their own
POLL_S = 0.5


class LocalSide:
    """The supervisor's side for local processes (local.json), with a live table on ``console``."""

    confirm = 1
    poll_s = POLL_S
    grace_s = GENERATOR_EXIT_S

    def __init__(
        self, run: RunDir, console: Console, live: Live, restart: Callable[[], object] | None
    ) -> None:
        self.run, self.console, self.live, self._restart = run, console, live, restart
        self.signal: int | None = None
        self.roles = [r for r in local.procs(run) if r.role != "rendezvous"]
        self.follower = _scale_follower(run, console)

    def interrupted(self) -> bool:
        return self.signal is not None

    def may_restart(self) -> bool:
        return self._restart is not None

    def members(self) -> list[Member]:
        if self.follower is not None:
            _follow_scale(self.follower, self.console)
        released = self.follower.released if self.follower is not None else set()
        known = {r.pid for r in self.roles}  # generators started later (scaled up) are watched too
        procs = local.procs(self.run)
        self.roles += [r for r in procs if r.role != "rendezvous" and r.pid not in known]
        out = [
            _member(r, _exit_code(r), released=r.role == "generator" and r.rank in released)
            for r in self.roles
        ]
        dead = _revive_rendezvous(self.run, [r for r in procs if r.role == "rendezvous"], self.console)
        if dead is not None:
            out.append(_member(dead, local.exit_code(dead)))
        return out

    def lost(self, member: Member) -> None:
        _member_failed(self.run, member.ref, member.detail, self.console)

    def restart_trainer(self, members: list[Member], dead: list[Member]) -> bool:
        """The trainer died: stop its other ranks (they would wait in a collective), stop what the
        dead ones left, and start the job again; it resumes from the newest checkpoint and the
        generators, which wait for it, serve the new process once they load the weights it pushes."""
        assert self._restart is not None
        codes = {m.name: m.detail for m in dead}
        local.stop([m.ref for m in members if m.ref.alive()])
        for m in dead:
            local.reap(m.ref)
        n = int(self.run.info().get("trainer_restarts") or 0) + 1
        self.run.update_info(trainer_restarts=n)
        mark_trainer_start(self.run)
        self.run.event("trainer_restarted", restart=n, exit_codes=codes)
        for m in dead:
            self.console.print(
                f"[yellow]trainer rank {m.rank} exited with {m.detail}[/yellow]; "
                f"starting the trainer again from the newest checkpoint (restart {n}); "
                f"last lines of {m.ref.log}:"
            )
            self.console.print(local.log_tail(m.ref.log, 5), markup=False, highlight=False)
        self._restart()
        return True

    def wait(self) -> None:
        self.live.update(live_view(self.run))
        time.sleep(POLL_S)

    def pools_ended(self) -> bool:
        return not any(local.exit_code(r) is None and r.alive() for r in self.roles if r.role in POOL_ROLES)

    def stop_leftovers(self) -> list[str]:
        roles = local.stop([r for r in local.procs(self.run) if r.role != "rendezvous"])  # what a role left
        local.stop(local.procs(self.run))  # the rendezvous server goes last
        return [s.describe() for s in roles if s.sent]

    def ended(self, outcome: Outcome) -> None:
        self.live.update(live_view(self.run))


def watch_local(
    run: RunDir,
    console: Console,
    cancel: Callable[..., object],
    restart: Callable[[], object] | None = None,
) -> int:
    """Supervise the local role processes until the run ends, with a live table; Ctrl-C (or
    SIGTERM) stops them all, by ``cancel`` (launch.run's: every launcher of the run). A trainer that
    dies is started again by ``restart`` while roles.trainer.restarts allows; a local rendezvous
    server that dies, up to keeper.RENDEZVOUS_RESTARTS times (see `_revive_rendezvous`). Returns
    the exit code."""
    old: dict[int, object] = {}
    try:
        with Live(live_view(run), console=console, refresh_per_second=2, transient=False) as live:
            side = LocalSide(run, console, live, restart)

            def on_signal(signum, _frame):  # type: ignore[no-untyped-def]
                side.signal = signum

            old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
            outcome = supervise(run, side)
    finally:
        for s, h in old.items():
            signal.signal(s, h)  # type: ignore[arg-type]
    if outcome.state is None:
        console.print("stopping: signal received, stopping every role ...")
        cancel(run, reason="interrupted")
        return 130
    if run.info().get("state") in ("cancelling", "cancelled"):  # `streamrl cancel` from elsewhere
        return 130
    if outcome.reason:
        console.print(f"[red]{outcome.reason}[/red]; the run cannot go on")
    for m in outcome.failed:
        console.print(f"[red]{m.role} rank {m.rank} exited with {m.detail}[/red]; last lines of {m.ref.log}:")
        console.print(local.log_tail(m.ref.log), markup=False, highlight=False)
    if not console.is_terminal:
        console.line()  # the live table leaves no line break when output goes to a file or pipe
    summary = summary_line(run)
    if summary:
        console.print(summary, markup=False, highlight=False)
    console.print(f"run {run.name} {outcome.state} (logs in {run.logs}; `streamrl status {run.name}`)")
    if summary:
        console.print(f"plots: `streamrl plot {run.name}`", markup=False, highlight=False)
    return 0 if outcome.state == "finished" else 1


def _member(rec: local.LocalProc, code: int | None, released: bool = False) -> Member:
    state = RUNNING if code is None else COMPLETED if code == 0 else FAILED
    return Member(
        role=rec.role, key=str(rec.pid), rank=rec.rank, state=state,
        detail=code, released=released, ref=rec,
    )  # fmt: skip


def _member_failed(run: RunDir, rec: local.LocalProc, code: int | None, console: Console) -> None:
    """A generator (or teacher) died (killed, crashed): the trainer re-dispatches its work to the
    others (it sees the member leave or its lease expire); here, what it left running in its group
    is stopped."""
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


def _scale_follower(run: RunDir, console: Console):  # type: ignore[no-untyped-def]
    """The follower of scale requests when this process is the one that applies them (local generators)."""
    from streamrl_cli.launch import run_state
    from streamrl_cli.launch.scale.follow import ScaleFollower
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
