"""What a launcher is: the interface that launch/local.py and launch/slurm/ implement, and the
records they hand back. Which launcher a cluster uses, and the one path that starts a role job,
are launch.launcher's."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

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
