"""One interface to what starts a run's roles: a cluster's ``launcher`` key names its implementation.

    local  (launch/local.py)  role processes on this machine, recorded in local.json
    slurm  (launch/slurm/)    SLURM jobs and job arrays through submitit, recorded in jobs.json

Everything that starts, stops or looks at a run's roles goes through it, whatever the launcher:

- :func:`submit`: the one path that starts a role job and records it in the run directory, used by
  `streamrl run` (every role), `streamrl scale` (generator instances added, :class:`Added`) and the
  trainer restart (a job that replaces the one that died);
- ``Launcher.report``: what the launcher knows of the run now (`streamrl status`, `cancel`, `--resume`);
- ``Launcher.cancel``, ``instances``, ``release``, ``ranks``: cancel, and scaling a role in and out.

``Launcher.foreground`` says who watches the roles: `streamrl run` itself, which stays in the
foreground (local processes), or the rendezvous role's job watcher (SLURM jobs, see
launch.server_role), which also applies scale requests and restarts the trainer there.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from streamrl_cli.errors import ClusterError
from streamrl_cli.launch.plan import JobSpec
from streamrl_cli.rundir import RunDir


@dataclass(frozen=True)
class Added:
    """Instances added to a running role (`streamrl scale`): the first rank they take (after every
    rank the run ever had) and their places among the instances that will share their hosts, as
    ``first/count`` CPU slots (see environ.CPU_SLOT)."""

    rank: int
    slot: int
    slots: int


@dataclass(kw_only=True)
class Submission:
    """A role job started by :func:`submit`: what to say about it and what to record of it."""

    job: JobSpec
    job_id: str | None = None  # the job the cluster knows it by (a SLURM job id; None for processes)
    event: tuple[str, dict[str, Any]] = ("submitted", {})  # the events.jsonl record of its start
    line: str = ""  # the console line that says so


@dataclass(kw_only=True)
class Instance:
    """One running instance of a role (a generator), as its launcher knows it."""

    rank: int
    launcher: str
    pid: int | None = None  # local: its process
    job_id: str | None = None  # slurm: the array job
    task: int | None = None  # slurm: the array task id
    slurm_cluster: str | None = None


@dataclass(kw_only=True)
class Report:
    """What one launcher knows of a run's roles now, from its own records and its cluster."""

    key: str  # the status document's name of this launcher's units, per role ("jobs", "processes")
    units: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # role -> units, as shown
    started: bool = False  # it started roles of the run (a local rendezvous server counts for none)
    running: bool = False  # one of them runs
    pending: bool = False  # one waits to start (queued)
    ended: str | None = None  # once all it started ended: "finished", "failed" or "ended" (no record how)
    ended_note: str | None = None  # what to say when ``ended`` is what the run's state is taken from
    problems: list[str] = field(default_factory=list)  # units that ended badly
    # Whether something of the run may still need stopping (asked only when it matters: it may
    # search the process table); True counts units whose state the cluster cannot tell.
    stoppable: Callable[[bool], bool] = lambda unknown: False

    def live(self, unknown: bool = False) -> bool:
        return self.stoppable(unknown)


class Launcher(ABC):
    """How roles on a cluster are started, recorded, watched, scaled and stopped."""

    name: ClassVar[str]
    foreground: ClassVar[bool]  # `streamrl run` stays to watch these roles (else the rendezvous role does)

    @abstractmethod
    def render(self, job: JobSpec, run: RunDir, run_name: str, spec_path: Path) -> tuple[str, int]:
        """The job's script as `streamrl run` writes it in jobs/ before starting anything: (text, mode)."""

    @abstractmethod
    def start(
        self,
        run: RunDir,
        job: JobSpec,
        spec_path: Path,
        *,
        added: Added | None = None,
        replaces: dict[str, Any] | None = None,
        note: dict[str, Any] | None = None,
    ) -> Submission:
        """Start ``job`` and record it in the run directory (``replaces``: the record of the job it
        takes the place of; ``note``: more fields for its record)."""

    @abstractmethod
    def report(self, run: RunDir) -> Report: ...

    @abstractmethod
    def cancel(self, run: RunDir) -> tuple[list[str], list[str]]:
        """Stop everything of the run this launcher started: (what was done, what went wrong)."""

    @abstractmethod
    def instances(self, run: RunDir, role: str) -> list[Instance]:
        """The instances of ``role`` the run has now (started or queued, not released, not ended)."""

    @abstractmethod
    def release(self, run: RunDir, going: list[Instance], grace_s: float) -> list[str]:
        """Stop these instances (each gets SIGTERM first: it hands over and leaves); the errors."""

    @abstractmethod
    def ranks(self, run: RunDir, role: str) -> list[int]:
        """Every rank of ``role`` this launcher ever started for the run."""


def registry() -> dict[str, type[Launcher]]:
    """Launcher name (a cluster's ``launcher`` key, recipe.schema.LAUNCHERS) -> its class, in the
    order they are asked: queued jobs are cancelled before local processes (the local rendezvous
    server goes last)."""
    from streamrl_cli.launch.local import LocalLauncher
    from streamrl_cli.launch.slurm.launcher import SlurmLauncher

    return {"slurm": SlurmLauncher, "local": LocalLauncher}


def get(name: str) -> Launcher:
    known = registry()
    if name not in known:
        raise ClusterError(f"unknown launcher {name!r}; valid: {', '.join(known)}")
    return known[name]()


def every() -> list[Launcher]:
    return [cls() for cls in registry().values()]


def of_role(run: RunDir, role: str) -> Launcher:
    """The launcher of ``role``'s cluster in this run (from its spec and run.json; local when unknown)."""
    from streamrl_cli.launch import run_state

    cluster = run_state.role_spec(run, role).cluster
    return get(run.info().get("clusters", {}).get(cluster, {}).get("launcher", "local"))


def reports(run: RunDir) -> list[Report]:
    """What every launcher knows of the run now."""
    return [launcher.report(run) for launcher in every()]


def submit(
    run: RunDir,
    job: JobSpec,
    *,
    added: Added | None = None,
    replaces: dict[str, Any] | None = None,
    announce: bool = True,
    **note: Any,
) -> Submission:
    """Start a role job with its cluster's launcher and record it in the run directory: the one way
    `streamrl run`, `streamrl scale` (``added``) and a trainer restart (``replaces``, with
    ``announce`` off: the restart is its own event) start roles."""
    sub = get(job.launcher).start(
        run, job, run.role_spec(job.role), added=added, replaces=replaces, note=note
    )
    if announce:
        run.event(sub.event[0], **sub.event[1])
    return sub
