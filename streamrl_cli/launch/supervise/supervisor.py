"""The run's supervisor: one loop, one rule, for every launcher.

Whoever watches a run's roles — `streamrl run` in the foreground for local processes, the
rendezvous role's job watcher for SLURM jobs (launch.server_role) — runs :func:`supervise` with a
:class:`Side` of its own. The side says what its launcher sees (each role instance as a
:class:`Member`: running, completed, failed or cancelled) and carries out what the rule decides;
the rule itself (:class:`Rule`) is the same for both:

- a pool member (generator, teacher, environment server) that failed, and was not released by
  scaling, is *lost*: the run goes on without it, its work re-dispatched; the side reaps what it
  left;
- a pool whose members have all ended, one of them lost, while the trainer runs, cannot serve
  the run: it fails;
- a trainer that failed is started again (it resumes from its newest checkpoint) while
  ``roles.trainer.restarts`` allows and the run is not being cancelled;
- the run ends when its trainer has ended (finished, cancelled or failed) or a failure cannot be
  recovered; a side whose view can flicker (a SLURM job array between its tasks' records) asks for
  the end, and every failure, to be seen on ``confirm`` polls in a row.

After the end, :func:`supervise` gives the pools ``Side.grace_s`` to leave on their own (they
hand over and exit once the trainer has left; a failed run gives none), has the side stop what
is left, and records how the run ended in run.json and events.jsonl, unless a cancel already did.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from streamrl_cli.rundir import POOL_ROLES, RunDir

RUNNING = "running"  # started or waiting to start
COMPLETED = "completed"
FAILED = "failed"
CANCELLED = "cancelled"


@dataclass(frozen=True)
class Member:
    """One instance of a role, as its launcher sees it now."""

    role: str
    key: str  # unique for the run: a process id, a SLURM job and task
    rank: int | None
    state: str  # RUNNING, COMPLETED, FAILED or CANCELLED
    detail: int | str | None = None  # how it ended, in its launcher's terms: an exit code, a SLURM job state
    released: bool = False  # scaled in: it leaves on purpose, whatever its exit
    restartable: bool = True  # a failed trainer that starting again can help (not a SLURM DEADLINE)
    ref: Any = field(default=None, compare=False)  # the side's own record of it

    @property
    def name(self) -> str:
        return f"{self.role}-{self.rank}" if self.rank is not None else self.role


@dataclass
class Decision:
    lost: list[Member] = field(default_factory=list)  # pool members lost since the last poll
    restart: list[Member] = field(default_factory=list)  # the trainer's members, to start again
    dead: list[Member] = field(default_factory=list)  # of those, the ones that failed
    end: str | None = None  # "finished", "failed" or "cancelled": the run is over
    failed: list[Member] = field(default_factory=list)  # what failed it
    reason: str | None = None  # said when a whole pool was lost


class Rule:
    """What to do about the members' states, poll after poll (it remembers what it already decided:
    members lost, trainer members replaced by a restart)."""

    def __init__(self, may_restart: Callable[[], bool], confirm: int = 1) -> None:
        self.may_restart = may_restart  # a trainer restart is allowed now (restarts left, no cancel)
        self.confirm = confirm
        self.lost: list[Member] = []
        self._replaced: set[str] = set()
        self._failing: dict[str, int] = {}  # member -> polls in a row it was seen failed
        self._ending = 0

    def decide(self, members: list[Member]) -> Decision:
        d = Decision()
        # A failure counts once seen on `confirm` polls in a row (a requeued SLURM task can show a
        # failed state for a moment); until then the member is taken as still running.
        self._failing = {m.key: self._failing.get(m.key, 0) + 1 for m in members if m.state == FAILED}
        members = [
            replace(m, state=RUNNING) if m.state == FAILED and self._failing[m.key] < self.confirm else m
            for m in members
        ]
        live = [m for m in members if m.key not in self._replaced]
        lost_keys = {m.key for m in self.lost}
        pool = [m for m in live if m.role in POOL_ROLES and not m.released]
        d.lost = [m for m in pool if m.state == FAILED and m.key not in lost_keys]
        self.lost += d.lost
        lost_keys |= {m.key for m in d.lost}
        d.failed = [m for m in live if m.role not in POOL_ROLES and m.state == FAILED]
        trainers = [m for m in live if m.role == "trainer"]
        for role in POOL_ROLES:
            of_role = [m for m in pool if m.role == role]
            gone = [m for m in of_role if m.key in lost_keys]
            training = any(m.state == RUNNING for m in trainers)  # (once it finished, none is needed)
            if gone and training and all(m.state != RUNNING for m in of_role):
                d.failed += gone  # none left, and not released: nothing will produce (or score) samples
                d.reason = f"no {role} left: every {role} failed"
        if d.failed and all(m.role == "trainer" and m.restartable for m in d.failed) and self.may_restart():
            self._replaced |= {m.key for m in trainers}
            d.restart, d.dead, d.failed = trainers, d.failed, []
            self._ending = 0
            return d
        if d.failed:
            end = FAILED
        elif trainers and all(m.state != RUNNING for m in trainers):
            states = {m.state for m in trainers}
            end = "finished" if states == {COMPLETED} else CANCELLED if CANCELLED in states else FAILED
        else:
            end = None
        self._ending = self._ending + 1 if end else 0
        d.end = end if self._ending >= self.confirm else None
        return d


@dataclass
class Outcome:
    state: str | None  # "finished", "failed", "cancelled"; None: interrupted (the side cancelled the run)
    failed: list[Member] = field(default_factory=list)
    lost: list[Member] = field(default_factory=list)
    reason: str | None = None


class Side(Protocol):
    """What a launcher's watcher gives the supervisor, and does for it."""

    confirm: int  # polls in a row that must show the end (1 unless the view can flicker)
    poll_s: float  # between looks at the pools while they leave
    grace_s: float  # after the end, how long the pools get to leave on their own

    def members(self) -> list[Member] | None:
        """Every role instance of the run now (None: nothing to watch yet)."""

    def interrupted(self) -> bool:
        """The watch must stop now (a signal, the run directory gone)."""

    def may_restart(self) -> bool:
        """A trainer restart is possible from this side now."""

    def lost(self, member: Member) -> None:
        """A pool member failed: say so, stop what it left."""

    def restart_trainer(self, members: list[Member], dead: list[Member]) -> bool:
        """Stop the trainer's members still running and start the trainer again; False when it
        could not be started (the run then ends failed)."""

    def wait(self) -> None:
        """Between polls (refresh a view, apply scale requests, sleep)."""

    def pools_ended(self) -> bool:
        """Every generator and teacher has ended (after the run's end)."""

    def stop_leftovers(self) -> list[str]:
        """Stop what is left of the run's roles once the grace is over; what was done."""

    def ended(self, outcome: Outcome) -> None:
        """The run ended as ``outcome`` and is recorded: say it, stop what serves the run."""


def supervise(run: RunDir, side: Side) -> Outcome:
    """Watch the run's roles through ``side`` until the run ends; record and return how it ended."""
    from streamrl_cli.roles.restart import trainer_restarts_left

    def may_restart() -> bool:
        return (
            side.may_restart()
            and run.info().get("state") not in ("cancelling", "cancelled")
            and trainer_restarts_left(run) > 0
        )

    rule = Rule(may_restart, confirm=side.confirm)
    while not side.interrupted():
        members = side.members()
        d = rule.decide(members) if members else Decision()
        for m in d.lost:
            side.lost(m)
        if d.restart:
            if side.restart_trainer(d.restart, d.dead):
                continue  # its new members are in the run's records: the next poll watches them
            d.end, d.failed = FAILED, d.dead
        if d.end:
            out = Outcome(state=d.end, failed=d.failed, lost=list(rule.lost), reason=d.reason)
            _wind_down(run, side, out)
            return out
        side.wait()
    return Outcome(state=None, lost=list(rule.lost))


def _wind_down(run: RunDir, side: Side, out: Outcome) -> None:
    """The pools leave on their own once the trainer left (they hand over first); what is still
    there after ``grace_s`` is stopped. A failed run gets no grace: nothing of it is handed over,
    and with its trainer still up (a pool lost, say) the pools would not leave before it, so what is
    left is stopped at once. Then the run's end is recorded, unless a cancel (from
    `streamrl cancel`, or a signal) is recording it."""
    deadline = time.monotonic() + (0.0 if out.state == FAILED else side.grace_s)
    while not side.pools_ended() and time.monotonic() < deadline:
        time.sleep(min(side.poll_s, max(0.0, deadline - time.monotonic())))
    stopped = side.stop_leftovers()
    if run.info().get("state") not in ("cancelling", "cancelled"):
        run.update_info(state=out.state, ended=time.time())
        run.event(
            out.state,
            failed=[m.name for m in out.failed],
            **({"lost": [m.name for m in out.lost]} if out.lost else {}),
            **({"reason": out.reason} if out.reason else {}),
            **({"stopped": stopped} if stopped else {}),
        )
    side.ended(out)
