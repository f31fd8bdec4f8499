"""The supervisor's rule (launch.supervise.supervisor): one set of decisions for local processes and SLURM
jobs. The launchers' own sides are exercised by the real runs (tests/e2e/test_local_faults.py,
tests/slurm/test_slurm_chaos.py, tests/slurm/test_launch_slurm.py)."""

from __future__ import annotations

from streamrl_cli.launch.supervise.supervisor import (
    CANCELLED,
    COMPLETED,
    FAILED,
    RUNNING,
    Member,
    Outcome,
    Rule,
    supervise,
)
from streamrl_cli.rundir import RunDir


def m(role: str, rank: int, state: str = RUNNING, **kw) -> Member:  # type: ignore[no-untyped-def]
    return Member(role=role, key=f"{role}-{rank}-{kw.pop('gen', 0)}", rank=rank, state=state, **kw)


def test_a_failed_generator_is_lost_once_and_the_run_goes_on():
    rule = Rule(lambda: True)
    d = rule.decide([m("trainer", 0), m("generator", 0, FAILED), m("generator", 1)])
    assert [x.name for x in d.lost] == ["generator-0"] and d.end is None and not d.restart
    d = rule.decide([m("trainer", 0), m("generator", 0, FAILED), m("generator", 1)])
    assert d.lost == [] and d.end is None
    assert [x.name for x in rule.lost] == ["generator-0"]


def test_a_pool_with_every_member_ended_and_one_lost_fails_the_run_with_its_reason():
    rule = Rule(lambda: True)
    d = rule.decide([m("trainer", 0), m("teacher", 0, FAILED), m("teacher", 1, COMPLETED), m("generator", 0)])
    assert d.end == FAILED and [x.name for x in d.failed] == ["teacher-0"]
    assert d.reason == "no teacher left: every teacher failed"
    # Once the trainer finished, a pool that failed on its way out fails nothing.
    rule = Rule(lambda: True)
    d = rule.decide([m("trainer", 0, COMPLETED), m("generator", 0, FAILED)])
    assert d.end == "finished" and [x.name for x in d.lost] == ["generator-0"] and d.reason is None
    # Ended on purpose (released by scaling, or exit 0) is not lost: the pool alone does not fail a run.
    rule = Rule(lambda: True)
    d = rule.decide([m("trainer", 0), m("generator", 0, FAILED, released=True), m("generator", 1, COMPLETED)])
    assert d.lost == [] and d.end is None


def test_a_cancelled_generator_is_not_lost():
    # Someone scancelled it: the trainer's lease sees it gone; it is no failure of the run.
    rule = Rule(lambda: True)
    d = rule.decide([m("trainer", 0), m("generator", 0, CANCELLED)])
    assert d.lost == [] and d.end is None


def test_a_failed_trainer_is_restarted_while_allowed_then_fails_the_run():
    allowed = [True]
    rule = Rule(lambda: allowed[0])
    d = rule.decide([m("trainer", 0, FAILED), m("trainer", 1), m("generator", 0)])
    assert [x.name for x in d.restart] == ["trainer-0", "trainer-1"] and [x.name for x in d.dead] == [
        "trainer-0"
    ]
    assert d.end is None and d.failed == []
    # The old members are replaced: their ends say nothing; the new ones are watched.
    d = rule.decide(
        [m("trainer", 0, FAILED), m("trainer", 1, FAILED), m("trainer", 0, gen=1), m("generator", 0)]
    )
    assert d.end is None and not d.restart
    allowed[0] = False
    d = rule.decide([m("trainer", 0, FAILED), m("trainer", 0, FAILED, gen=1), m("generator", 0)])
    assert d.end == FAILED and [x.key for x in d.failed] == ["trainer-0-1"] and not d.restart


def test_a_trainer_failure_that_a_restart_cannot_help_ends_the_run():
    rule = Rule(lambda: True)
    d = rule.decide([m("trainer", 0, FAILED, restartable=False), m("generator", 0)])
    assert d.end == FAILED and not d.restart
    # Nor a trainer failure together with another one (the local rendezvous server that died too often).
    rule = Rule(lambda: True)
    d = rule.decide([m("trainer", 0, FAILED), m("rendezvous", 0, FAILED)])
    assert d.end == FAILED and {x.name for x in d.failed} == {"trainer-0", "rendezvous-0"}


def test_the_run_ends_as_its_trainer_did():
    for states, end in [
        ([COMPLETED, COMPLETED], "finished"),
        ([COMPLETED, CANCELLED], CANCELLED),
        ([COMPLETED, RUNNING], None),
    ]:
        rule = Rule(lambda: True)
        d = rule.decide([m("trainer", i, s) for i, s in enumerate(states)] + [m("generator", 0)])
        assert d.end == end, states
    # Nothing to judge before a trainer is known (its job not submitted yet).
    assert Rule(lambda: True).decide([m("generator", 0, COMPLETED)]).end is None


def test_with_confirm_an_end_or_a_failure_must_be_seen_twice_in_a_row():
    rule = Rule(lambda: True, confirm=2)
    flicker = [m("trainer", 0, COMPLETED), m("generator", 0, FAILED)]
    assert rule.decide(flicker).end is None and rule.lost == []
    assert rule.decide([m("trainer", 0), m("generator", 0)]).end is None  # it was a moment
    assert rule.decide(flicker).end is None and rule.lost == []
    d = rule.decide(flicker)
    assert d.end == "finished" and [x.name for x in d.lost] == ["generator-0"]


class ScriptedSide:
    """A side that plays given member lists, one per poll, and records what it was asked to do."""

    confirm, poll_s, grace_s = 1, 0.0, 0.0

    def __init__(self, polls: list[list[Member]], restart_ok: bool = True) -> None:
        self.polls, self.restart_ok, self.done = polls, restart_ok, []

    def interrupted(self) -> bool:
        return not self.polls

    def may_restart(self) -> bool:
        return True

    def members(self):  # type: ignore[no-untyped-def]
        return self.polls.pop(0)

    def lost(self, member):  # type: ignore[no-untyped-def]
        self.done.append(("lost", member.name))

    def restart_trainer(self, members, dead):  # type: ignore[no-untyped-def]
        self.done.append(("restart", [x.name for x in dead]))
        return self.restart_ok

    def wait(self) -> None:
        self.done.append(("wait",))

    def pools_ended(self) -> bool:
        return True

    def stop_leftovers(self):  # type: ignore[no-untyped-def]
        self.done.append(("stop",))
        return ["stopped generator-1"]

    def ended(self, outcome: Outcome) -> None:
        self.done.append(("ended", outcome.state))


def test_supervise_records_the_end_with_what_failed_and_what_was_lost(tmp_path):
    run = RunDir(tmp_path)
    run.update_info(state="running", trainer_restarts=0)
    side = ScriptedSide(
        [
            [m("trainer", 0), m("generator", 0, FAILED), m("generator", 1)],
            [m("trainer", 0, COMPLETED), m("generator", 0, FAILED), m("generator", 1)],
        ]
    )
    out = supervise(run, side)
    assert out.state == "finished" and [x.name for x in out.lost] == ["generator-0"]
    assert side.done == [("lost", "generator-0"), ("wait",), ("stop",), ("ended", "finished")]
    assert run.info()["state"] == "finished"
    (ev,) = [e for e in run.events() if e["event"] == "finished"]
    assert ev["lost"] == ["generator-0"] and ev["failed"] == [] and ev["stopped"] == ["stopped generator-1"]


class LingeringSide(ScriptedSide):
    """Pools that leave on their own only when asked the fifth time, with an hour's grace."""

    grace_s = 3600.0

    def __init__(self, polls: list[list[Member]]) -> None:
        super().__init__(polls)
        self.asked = 0

    def pools_ended(self) -> bool:
        self.asked += 1
        return self.asked >= 5


def test_a_failed_run_stops_what_is_left_at_once_a_finished_one_gives_the_pools_their_grace(tmp_path):
    # A pool lost while the trainer runs fails the run: the generators would not leave before the
    # trainer does, so waiting for them is only a wait; they are stopped at once.
    run = RunDir(tmp_path)
    run.update_info(state="running", trainer_restarts=0)
    side = LingeringSide([[m("trainer", 0), m("env_server", 0, FAILED), m("generator", 0)]])
    out = supervise(run, side)
    assert out.state == FAILED and side.asked <= 1 and side.done[-2:] == [("stop",), ("ended", FAILED)]
    # A finished run: the pools are given the time to leave on their own (asked until they left).
    side = LingeringSide([[m("trainer", 0, COMPLETED), m("generator", 0)]])
    out = supervise(RunDir(tmp_path / "b"), side)
    assert out.state == "finished" and side.asked == 5


def test_a_trainer_that_cannot_be_started_again_fails_the_run(tmp_path, monkeypatch):
    from streamrl_cli.launch.supervise import supervisor

    run = RunDir(tmp_path)
    run.update_info(state="running")
    monkeypatch.setattr("streamrl_cli.roles.restart.trainer_restarts_left", lambda run: 1)
    side = ScriptedSide([[m("trainer", 0, FAILED), m("generator", 0)]], restart_ok=False)
    out = supervisor.supervise(run, side)
    assert out.state == FAILED and [x.name for x in out.failed] == ["trainer-0"]
    assert side.done[0] == ("restart", ["trainer-0"]) and run.info()["state"] == FAILED


def test_a_cancel_in_progress_is_not_overwritten(tmp_path):
    run = RunDir(tmp_path)
    run.update_info(state="cancelling")
    side = ScriptedSide([[m("trainer", 0, FAILED)]])
    out = supervise(run, side)
    assert out.state == FAILED and side.done[-1] == ("ended", FAILED)
    assert run.info()["state"] == "cancelling"  # `streamrl cancel` records how it ended
    assert not [e for e in run.events() if e["event"] == FAILED]


def test_an_interrupted_watch_records_nothing(tmp_path):
    run = RunDir(tmp_path)
    run.update_info(state="running")
    out = supervise(run, ScriptedSide([]))
    assert out.state is None and run.info()["state"] == "running"
