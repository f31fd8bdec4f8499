"""Roles as local processes: the launcher of the embedded default (and of the local rendezvous).

Each process gets its own session (process group), so that stopping a role stops everything it
started (vLLM spawns engine processes) and a Ctrl-C in the terminal reaches only `streamrl`,
which then stops the roles in order. Processes are recorded in `run_dir/local.json` with their
creation time, so `streamrl cancel` from another terminal never signals a recycled pid.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from streamrl_cli import environ
from streamrl_cli.launch.base import Added, Instance, Launcher, Report, Submission
from streamrl_cli.launch.plan import JobSpec
from streamrl_cli.rundir import RunDir, read_json_checked, warn_once, write_json


@dataclass
class LocalProc:
    role: str
    rank: int
    pid: int
    created: float  # psutil create_time(): tells a live process from a recycled pid
    log: str

    def process(self) -> psutil.Process | None:
        try:
            p = psutil.Process(self.pid)
            if abs(p.create_time() - self.created) < 0.05 and p.status() != psutil.STATUS_ZOMBIE:
                return p
        except psutil.Error:
            pass
        return None

    def alive(self) -> bool:
        return self.process() is not None

    def successor(self) -> psutil.Process | None:
        """The process that holds this pid now if it is another one (the pid was reused), else None."""
        try:
            p = psutil.Process(self.pid)
            return p if abs(p.create_time() - self.created) >= 0.05 else None
        except psutil.Error:
            return None

    def leftovers(self) -> list[psutil.Process]:
        """Processes of this role's group still running after its leader died (a `kill -9` leaves
        vLLM's EngineCore and worker running: they are in the group, not children we wait for).
        Only processes started after the leader count: a group id is a pid, and pids are reused.
        A pid that another process holds now has no group of ours: Linux hands out no pid that is
        still a live group's id, so that group is the newcomer's."""
        if self.successor() is not None:
            return []
        out = []
        for p in psutil.process_iter(["pid", "create_time"]):
            try:
                ours = os.getpgid(p.pid) == self.pid and p.create_time() >= self.created - 0.05
                if ours and p.pid != self.pid and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
            except (psutil.Error, OSError):
                continue
        return out

    def running(self) -> bool:
        """The leader or anything of its group is still running: there is something to stop."""
        return self.alive() or bool(self.leftovers())


# Popen objects of the processes this launcher started, so their exit codes can be collected.
_PROCS: dict[int, subprocess.Popen] = {}


def role_command(spec_path: Path, rank: int, python: str | None = None) -> list[str]:
    return [python or sys.executable, "-u", "-m", "streamrl_cli.roles", str(spec_path), "--rank", str(rank)]


def render(job: JobSpec, spec_path: Path, python: str | None = None) -> str:
    """The local equivalent of a job script: the command line of each process."""
    lines = [shlex.join(role_command(spec_path, rank, python)) for rank in range(job.processes)]
    env = "".join(f"# env {k}={v}\n" for k, v in sorted(job.env.items()))
    return f"# {job.role} on this machine: one local process per line\n{env}" + "\n".join(lines) + "\n"


def spawn(run: RunDir, role: str, rank: int, argv: list[str], env: dict[str, str] | None = None) -> LocalProc:
    log = run.local_log(role, rank)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {}), environ.RANK: str(rank)},
            start_new_session=True,
            cwd=run.path,
        )
    rec = LocalProc(
        role=role, rank=rank, pid=proc.pid, created=psutil.Process(proc.pid).create_time(), log=str(log)
    )
    _PROCS[proc.pid] = proc
    write_json(run.local_json, [*map(asdict, procs(run)), asdict(rec)])
    return rec


def procs(run: RunDir, search: bool = False) -> list[LocalProc]:
    """The run's local processes as recorded in local.json; when that file is damaged, the live
    ones found in the process table (a run that keeps running must not look like nothing).

    ``search`` (status, cancel): also where the records may not name every process that runs, that
    is, local.json is missing or one it names is gone; the live role processes of the run found in
    the process table are added to the records (see :func:`with_found`). A run that never started
    processes here (a dry run, a SLURM run) has none to find, and nothing is said."""
    records, problem = read_json_checked(run.local_json, [])
    recs = None
    if problem is None and isinstance(records, list):
        try:
            recs = [LocalProc(**r) for r in records]
        except TypeError:
            pass
    if recs is None:
        found = recover_procs(run)
        warn_once(
            f"{run.local_json} is damaged; found {len(found)} live process(es) of this run "
            "in the process table (role processes started in its directory)"
        )
        return found
    if not search or (recs and all(r.alive() for r in recs)):
        return recs
    out = with_found(recs, recover_procs(run))
    if unnamed := len([r for r in out if r not in recs]):
        how = "does not name" if run.local_json.exists() else "is missing; found"
        warn_once(
            f"{run.local_json} {how} {unnamed} live process(es) of this run in the process table "
            "(role processes started in its directory)"
        )
    return out


def with_found(recs: list[LocalProc], found: list[LocalProc]) -> list[LocalProc]:
    """The recorded processes and the found ones they do not name, one per pid: a found process
    that holds a recorded pid now (the pid was reused) takes that record's place, and one that is in
    the process group a record leads is left to it (stopping the group stops it: a role's forked
    helpers share its command line and directory)."""
    by_pid = {r.pid: r for r in recs}
    new = []
    for f in found:
        rec = by_pid.get(f.pid)
        if rec is not None and abs(rec.created - f.created) < 0.05:
            continue  # the recorded process itself
        try:
            lead = by_pid.get(os.getpgid(f.pid))
        except OSError:
            continue  # it has exited
        if lead is not None and lead.pid != f.pid and f.created >= lead.created - 0.05:
            continue
        new.append(f)
    taken = {f.pid for f in new}
    return [r for r in recs if r.pid not in taken] + new


def recover_procs(run: RunDir) -> list[LocalProc]:
    """Live role processes of `run`: started with its directory as working directory (spawn does)."""
    out = []
    want = str(run.path.resolve())
    for p in psutil.process_iter(["pid", "cmdline", "cwd", "create_time"]):
        try:
            cmd, cwd = p.info["cmdline"] or [], p.info["cwd"]
        except psutil.Error:
            continue
        if cwd != want or "streamrl_cli.roles" not in cmd:
            continue
        at = cmd.index("streamrl_cli.roles") + 1
        role = Path(cmd[at]).stem if at < len(cmd) else "?"  # roles/<role>.yaml
        try:
            rank = int(cmd[cmd.index("--rank") + 1])
        except (ValueError, IndexError):
            rank = 0
        out.append(
            LocalProc(
                role=role,
                rank=rank,
                pid=p.info["pid"],
                created=p.info["create_time"],
                log=str(run.local_log(role, rank)),
            )
        )
    return out


def exit_code(rec: LocalProc) -> int | None:
    """The exit code of a process this launcher started (None while running or if unknown)."""
    p = _PROCS.get(rec.pid)
    return p.poll() if p is not None else None


def started_here(rec: LocalProc) -> bool:
    """Whether this process (this `streamrl`) started it, and so can know its exit code."""
    return rec.pid in _PROCS


@dataclass
class Stopped:
    """What :func:`stop` did to one process, so that nobody reports a signal that was never sent."""

    rec: LocalProc
    sent: str | None  # the last signal sent: "SIGTERM", "SIGKILL", or None (nothing was sent)
    ended: bool  # nothing of it runs any more
    leader: bool = True  # its own process ran (else only what it left in its group)
    why: str = ""  # why nothing was sent

    def describe(self) -> str:
        what = f"local {self.rec.role} rank {self.rec.rank} (pid {self.rec.pid})"
        if self.sent is None:
            return f"{what}: not signalled, {self.why}"
        if not self.ended:
            return f"{what}: still running after {self.sent}"
        left = "" if self.leader else " (only what it left in its group was running)"
        if self.sent == "SIGKILL":
            return f"killed {what}{left}: still running after SIGTERM and the grace period"
        return f"stopped {what}{left}"


def gone_reason(rec: LocalProc) -> str:
    """Why a recorded process is not there to signal: it exited, or its pid is another's now."""
    other = rec.successor()
    if other is None:
        return "it had already exited"
    try:
        name = other.name()
    except psutil.Error:
        name = "?"
    started = time.strftime("%H:%M:%S", time.localtime(other.create_time()))
    return f"its pid now belongs to another process ({name}, started {started}), left alone"


def stop(recs: list[LocalProc], grace_s: float = 10.0) -> list[Stopped]:
    """SIGTERM each process group, wait up to ``grace_s``, then SIGKILL what is left. A group whose
    leader is gone is still signalled while processes of it run (a killed role's engine processes).
    Returns what happened to each process, in the order of ``recs``."""
    results = []
    for r in recs:
        leader = r.alive()
        if not (leader or r.leftovers()):
            results.append(Stopped(r, None, ended=True, why=gone_reason(r)))
            continue
        why = _signal_group(r, signal.SIGTERM)
        sent = "SIGTERM" if why is None else None
        results.append(Stopped(r, sent, ended=False, leader=leader, why=why or ""))
    live = [s for s in results if s.sent is not None]
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(s.rec.running() for s in live):
        for s in live:
            exit_code(s.rec)  # reap our own children so they stop being zombies
        time.sleep(0.1)
    for s in live:
        if s.rec.running() and _signal_group(s.rec, signal.SIGKILL) is None:
            s.sent = "SIGKILL"
    deadline = time.monotonic() + 5.0  # SIGKILL cannot be caught: only a process stuck in the kernel stays
    while time.monotonic() < deadline and any(s.rec.running() for s in live if s.sent == "SIGKILL"):
        for s in live:
            exit_code(s.rec)
        time.sleep(0.05)
    for s in live:
        if s.rec.pid in _PROCS:
            try:
                _PROCS[s.rec.pid].wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
    for s in results:
        s.ended = not s.rec.running()
    return results


def reap(rec: LocalProc, grace_s: float = 5.0) -> list[int]:
    """Stop what a dead role process left in its group; returns the pids that were still running."""
    left = [p.pid for p in rec.leftovers()]
    if left:
        stop([rec], grace_s)
    exit_code(rec)
    return left


def _signal_group(rec: LocalProc, sig: int) -> str | None:
    """Send ``sig`` to the process group ``rec`` leads (its session: spawn starts one per process),
    or to the process alone where it leads none (a role process found in the process table may have
    been started otherwise) or its group may not be signalled. None once sent, else why it could
    not be; a process that still runs is never said to have exited."""
    try:
        os.killpg(rec.pid, sig)
        return None
    except (ProcessLookupError, PermissionError):
        pass  # no group of that id (it leads none), or not all of it ours: the process, at least
    try:
        os.kill(rec.pid, sig)
        return None
    except ProcessLookupError:
        if rec.running():
            return "no process or group of its pid could be signalled, though it runs"
        return gone_reason(rec)
    except PermissionError as e:
        return f"not permitted ({e.strerror})"


def log_tail(path: str | Path, lines: int = 15) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class LocalLauncher(Launcher):
    """Roles as processes on this machine (`launcher: local`), watched by the `streamrl run` that
    started them; their records are local.json's."""

    name = "local"
    foreground = True

    def render(self, job: JobSpec, run: RunDir, run_name: str, spec_path: Path) -> tuple[str, int]:
        return render(job, spec_path), 0o644

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
        """One process per rank of the job (spawn records each in local.json); ``replaces`` and
        ``note`` have nothing to add to those records."""
        first = added.rank if added is not None else 0
        for i in range(job.processes):
            env = dict(job.env)
            if added is not None:
                # Its place among the instances that will share this host, so that its engine gets
                # cores of its own instead of the first instance's (see generator.main.cpu_binding).
                env[environ.CPU_SLOT] = f"{added.slot + i}/{added.slots}"
            spawn(run, job.role, first + i, role_command(spec_path, first + i), env)
        return Submission(
            job=job,
            event=("started", {"role": job.role, "cluster": job.cluster, "processes": job.processes}),
            line=f"started {job.processes} local {job.role} process(es)",
        )

    def report(self, run: RunDir) -> Report:
        recs = procs(run, search=True)
        units: dict[str, list[dict]] = {}
        for p in recs:
            units.setdefault(p.role, []).append(
                {"rank": p.rank, "pid": p.pid, "state": "running" if p.alive() else "exited", "log": p.log}
            )
        # The run's roles; a local rendezvous server (of a SLURM run too) is none of them.
        roles = [p for p in recs if p.role != "rendezvous"]
        running = any(p.alive() for p in roles)
        return Report(
            key="processes",
            units=units,
            started=bool(roles),
            running=running,
            ended="ended" if roles and not running else None,
            ended_note="local processes are gone but the run was not marked finished",
            # A dead role's leftover engine processes, and the server, still need stopping.
            stoppable=lambda unknown: any(p.running() for p in recs),
        )

    def cancel(self, run: RunDir) -> tuple[list[str], list[str]]:
        recs = procs(run, search=True)
        live = [p for p in recs if p.running()]  # a dead role's leftover engine processes too
        # Roles first, the rendezvous last: members can still say goodbye while it is up.
        stopped = stop([p for p in live if p.role != "rendezvous"])
        stopped += stop([p for p in live if p.role == "rendezvous"])
        # A recorded pid that another process holds now is named: nothing of ours is there to stop.
        stopped += stop([p for p in recs if p not in live and p.successor() is not None])
        return [s.describe() for s in stopped], [s.describe() for s in stopped if not s.ended]

    def instances(self, run: RunDir, role: str) -> list[Instance]:
        return [
            Instance(rank=p.rank, launcher=self.name, pid=p.pid)
            for p in procs(run)
            if p.role == role and p.alive()
        ]

    def release(self, run: RunDir, going: list[Instance], grace_s: float) -> list[str]:
        """SIGTERM: the instance aborts what is in flight, hands over what finished, leaves the
        rendezvous and exits; its process group is killed after ``grace_s`` if it does not."""
        recs = {p.pid: p for p in procs(run)}
        stop([recs[i.pid] for i in going if i.pid in recs], grace_s=grace_s)
        return []

    def ranks(self, run: RunDir, role: str) -> list[int]:
        return [p.rank for p in procs(run) if p.role == role]
