"""The elastic weight group's pure parts: who is in a group, at which ranks, and when it no longer holds."""

from __future__ import annotations

import pytest

from streamrl_cli.trainer.role.publish import MembershipChanged, WeightPublisher
from streamrl_cli.weights.layout import (
    STARTING,
    WAITING,
    GroupLayout,
    alive_members,
    check_ready,
    eligible,
    membership,
    plan_layout,
    receiving_state,
)


def gen(rank: int, *, state: str = "alive", reported: str | None = "generating", inc: int = 1, tp: int = 1):
    return {
        "member_id": f"generator-{rank}", "role": "generator", "rank": rank, "incarnation": inc,
        "state": state, "reported_state": reported, "info": {"workers": tp},
    }  # fmt: skip


def layout_of(members, group="g1") -> GroupLayout:
    return plan_layout(members, group=group, address="node7:4242", backend="gloo", timeout_s=600.0)


def test_ranks_follow_member_rank_order_and_worker_counts():
    # Ranks 10 and 2 sort numerically (not as strings); tensor-parallel members take several ranks.
    layout = layout_of([gen(10, tp=2), gen(2), gen(0, tp=4)])
    assert layout.ranks == {"generator-0": 1, "generator-2": 5, "generator-10": 6}
    assert layout.world_size == 8  # trainer + 4 + 1 + 2
    assert layout.membership() == membership([gen(10, tp=2), gen(2), gen(0, tp=4)])
    with pytest.raises(ValueError, match="at least one member"):
        layout_of([])


def test_the_same_members_plan_the_same_ranks_whatever_their_order():
    a = layout_of([gen(1), gen(3), gen(2)])
    b = layout_of([gen(3), gen(2), gen(1)])
    assert a.ranks == b.ranks and a.world_size == b.world_size == 4


def test_eligible_are_alive_generators_past_start_up():
    members = [
        gen(0), gen(1, state="lost"), gen(2, state="left"), gen(3, reported=STARTING), gen(4, reported=None),
        gen(5, reported=WAITING), gen(6, reported="loading weights v3"),
    ]  # fmt: skip
    assert [m["member_id"] for m in eligible(members)] == ["generator-0", "generator-5", "generator-6"]


def test_membership_changes_with_a_loss_a_newcomer_a_restart_or_more_workers():
    base = membership([gen(0), gen(1)])
    assert membership([gen(1), gen(0)]) == base
    assert membership([gen(0)]) != base  # lost
    assert membership([gen(0), gen(1), gen(2)]) != base  # newcomer
    assert membership([gen(0), gen(1, inc=2)]) != base  # restarted: a new process, not in the group
    assert membership([gen(0), gen(1, tp=2)]) != base


def test_the_proposal_round_trips_and_tells_each_member_where_to_join():
    layout = layout_of([gen(0), gen(1, tp=2)])
    proposal = {"version": 3, "required_roles": ["generator"], "members": layout.incarnations,
                "transfer": layout.doc()}  # fmt: skip
    back = GroupLayout.from_proposal(proposal)
    assert back == layout
    assert back.source("generator-1", 1) == {
        "host": "node7", "port": 4242, "world_size": 4, "first_rank": 2, "backend": "gloo",
        "timeout_s": 600.0,
    }  # fmt: skip
    assert back.source("generator-1", 2) is None  # another incarnation: not its rank
    assert back.source("generator-5", 1) is None  # a newcomer: the next group
    assert GroupLayout.from_proposal({"version": 3, "required_roles": ["generator"]}) is None  # legacy


def test_ready_needs_every_member_to_report_this_version_and_group():
    layout = layout_of([gen(0), gen(1)], group="abcd")
    want = receiving_state(4, "abcd")
    assert len(want) <= 64  # the rendezvous' limit on a reported state
    assert check_ready(layout, [gen(0, reported=want), gen(1)], 4) == (False, None)
    assert check_ready(layout, [gen(0, reported=want), gen(1, reported=receiving_state(3, "abcd"))], 4) == (
        False,
        None,
    )
    assert check_ready(layout, [gen(0, reported=want), gen(1, reported=want), gen(2)], 4) == (True, None)


@pytest.mark.parametrize(
    ("member", "why"),
    [(gen(1, state="lost"), "generator-1 lost"), (gen(1, state="left"), "generator-1 left"),
     (gen(1, inc=2), "generator-1 restarted"), (None, "generator-1 gone")],
)  # fmt: skip
def test_a_layout_breaks_when_a_member_is_lost_left_or_restarted(member, why):
    layout = layout_of([gen(0), gen(1)])
    members = [gen(0, reported=receiving_state(4, layout.group))] + ([member] if member else [])
    assert check_ready(layout, members, 4) == (False, why)
    assert alive_members(layout, members) == ["generator-0"]


# ---- the publisher's decisions on the rendezvous' view ----


def pending(version: int, confirmed=(), layout: GroupLayout | None = None) -> dict:
    p = {"version": version, "required_roles": ["generator"], "confirmed": dict.fromkeys(confirmed, 1.0)}
    if layout is not None:
        p.update(members=layout.incarnations, transfer=layout.doc())
    return p


def test_recipients_are_the_eligible_generators_less_those_that_have_the_version():
    members = [gen(0), gen(1), gen(2, reported=STARTING), gen(3, reported=WAITING)]
    first = WeightPublisher._recipients(members, {"current": 1, "pending": []}, 2)
    assert [m["member_id"] for m in first] == ["generator-0", "generator-1", "generator-3"]
    retry = WeightPublisher._recipients(members, {"current": 1, "pending": [pending(2, ["generator-0"])]}, 2)
    assert [m["member_id"] for m in retry] == ["generator-1", "generator-3"]
    done = {"current": 1, "pending": [pending(2, ["generator-0", "generator-1", "generator-3"])]}
    assert WeightPublisher._recipients(members, done, 2) == "confirmed"
    assert WeightPublisher._recipients([gen(0, reported=STARTING)], {"current": 1, "pending": []}, 2) is None
    # Made current while a retry waited (the member that hung mid-transfer was lost and dropped from
    # its group): delivered, not proposed again, which the rendezvous would refuse as stale.
    assert WeightPublisher._recipients(members, {"current": 2, "pending": []}, 2) == "confirmed"


def test_confirmation_wait_ends_at_current_and_breaks_when_the_whole_group_is_gone():
    layout = layout_of([gen(0), gen(1)])
    assert WeightPublisher._current([gen(0)], {"current": 5, "pending": []}, 5) is True
    sent = {"current": 4, "pending": [pending(5, [], layout)]}
    assert WeightPublisher._current([gen(0), gen(1)], sent, 5) is None
    gone = [gen(0, state="lost"), gen(1, inc=2)]
    with pytest.raises(MembershipChanged, match="every member"):
        WeightPublisher._current(gone, sent, 5)
    with pytest.raises(MembershipChanged, match="generator-1 lost before version 5 was sent"):
        WeightPublisher._ready(layout, [gen(0), gen(1, state="lost")], 5)
