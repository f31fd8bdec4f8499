"""The rendezvous state machine and journal, without sockets: explicit clocks, exact answers."""

from __future__ import annotations

import json

import pytest

from streamrl_cli.rendezvous.journal import Journal
from streamrl_cli.rendezvous.state import Rejected, RendezvousState


def reg(s: RendezvousState, role: str, rank: int, mono: float = 0.0) -> list[dict]:
    _, events = s.register(
        role=role, rank=rank, cluster="c", host="h", site="A", addresses={}, info={}, now=100.0, mono=mono
    )
    return events


def live_state() -> tuple[RendezvousState, list[dict]]:
    """A state driven through every kind of event; returns it and the events it emitted."""
    s, events = RendezvousState(lease_s=1.0), []
    for role, rank in [("trainer", 0), ("generator", 0), ("generator", 1), ("generator", 2)]:
        events += reg(s, role, rank)
    events += s.propose(1, ["generator"], now=101.0)
    for g in range(3):
        events += s.confirm(f"generator-{g}", 1, now=102.0, mono=0.5)
    events += s.heartbeat(
        "generator-0", incarnation=1, weight_version=1, reported_state="busy", now=103, mono=0.9
    )
    events += s.propose(2, ["generator"], now=104.0)
    events += s.confirm("generator-0", 2, now=104.0, mono=1.0)
    events += s.reap(now=105.0, mono=1.8)  # generator-1/2 and trainer-0 silent since 0.5 / 0
    events += s.leave("trainer-0", reason="done", now=106.0)
    events += s.set_progress({"step": 7, "samples": 700}, now=107.0)
    events += reg(s, "generator", 1, mono=2.0)
    return s, events


def test_events_are_numbered_and_replay_rebuilds_the_same_state():
    s, events = live_state()
    assert [e["seq"] for e in events] == list(range(1, s.seq + 1))
    types = [e["type"] for e in events]
    assert types.count("version_current") == 2 and "member_lost" in types and "member_updated" in types
    assert s.current_version == 2  # generator-1/2 lost: generator-0's confirmation sufficed
    replayed = RendezvousState(lease_s=1.0)
    replayed.replay(json.loads(json.dumps(events)))
    assert replayed.to_snapshot() == s.to_snapshot()


def test_versions_need_every_alive_required_member_and_at_least_one():
    s = RendezvousState(lease_s=1.0)
    reg(s, "trainer", 0)
    assert s.propose(1, ["generator"], now=1) and s.current_version is None
    reg(s, "generator", 0)
    reg(s, "generator", 1)
    s.confirm("generator-0", 1, now=2, mono=0)
    assert s.current_version is None and list(s.pending) == [1]
    reg(s, "generator", 2)  # a newcomer must load the version too
    s.confirm("generator-1", 1, now=3, mono=0)
    assert s.current_version is None
    reg(s, "generator", 0)  # restarted: its confirmation no longer holds
    s.confirm("generator-2", 1, now=3, mono=0)
    assert s.current_version is None and sorted(s.pending[1].confirmed) == ["generator-1", "generator-2"]
    (ev,) = s.confirm("generator-0", 1, now=4, mono=0)[-1:]
    assert ev["type"] == "version_current" and ev["data"]["confirmed_by"] == [
        f"generator-{i}" for i in range(3)
    ]
    assert s.propose(2, ["generator"], now=5) and s.propose(2, ["generator"], now=5) == []  # a retry
    with pytest.raises(Rejected, match="already pending") as e:
        s.propose(2, ["generator", "relay"], now=5)
    assert e.value.code == "version_conflict"
    with pytest.raises(Rejected, match="not newer") as e:
        s.propose(1, ["generator"], now=5)
    assert e.value.code == "stale_version"
    with pytest.raises(Rejected) as e:
        s.confirm("generator-0", 9, now=5, mono=0)
    assert e.value.code == "unknown_version"


def test_newest_complete_version_supersedes_older_pending_ones():
    s = RendezvousState(lease_s=1.0)
    reg(s, "generator", 0)
    s.propose(1, ["generator"], now=1)
    s.propose(2, ["generator"], now=1)
    s.propose(3, ["generator"], now=1)
    events = s.confirm("generator-0", 2, now=2, mono=0)
    assert events[-1]["data"] == {"version": 2, "confirmed_by": ["generator-0"], "superseded": [1]}
    assert s.current_version == 2 and list(s.pending) == [3]
    with pytest.raises(Rejected) as e:
        s.confirm("generator-0", 1, now=3, mono=0)
    assert e.value.code == "stale_version"
    # Confirming the current version again (a late joiner, a retry) is fine.
    assert s.confirm("generator-0", 2, now=3, mono=0) == []


def test_a_version_sent_to_named_members_needs_only_them_alive_as_that_incarnation():
    s = RendezvousState(lease_s=1.0)
    for rank in range(3):
        reg(s, "generator", rank)
    layout = {"group": "g1", "ranks": {"generator-0": 1, "generator-1": 2}}
    sent_to = {"generator-0": 1, "generator-1": 1}
    (ev,) = s.propose(1, ["generator"], members=sent_to, transfer=layout, now=1)
    assert ev["data"]["members"] == sent_to and ev["data"]["transfer"] == layout
    assert s.propose(1, ["generator"], members=sent_to, transfer=layout, now=1) == []  # a retry
    reg(s, "generator", 3)  # a newcomer (and generator-2, not sent it) does not hold it up
    s.confirm("generator-0", 1, now=2, mono=0)
    assert s.current_version is None
    # generator-1 restarts: the new process was not sent version 1, so version 1 is complete.
    assert [e["type"] for e in reg(s, "generator", 1)] == ["member_registered", "version_current"]
    assert s.current_version == 1
    with pytest.raises(Rejected, match=r"unregistered member\(s\) \['generator-9'\]") as e:
        s.propose(2, ["generator"], members={"generator-9": 1}, now=3)
    assert e.value.code == "unknown_member"


def test_proposing_a_pending_version_to_other_members_is_a_re_send():
    s = RendezvousState(lease_s=1.0)
    for rank in range(3):
        reg(s, "generator", rank)
    first = {"generator-0": 1, "generator-1": 1, "generator-2": 1}
    s.propose(1, ["generator"], members=first, transfer={"group": "a"}, now=1)
    s.confirm("generator-2", 1, now=2, mono=0)  # had it before the group failed
    s.reap(now=3, mono=1.5)  # all silent: generator-0 comes back below, generator-1 stays lost
    s.heartbeat("generator-0", incarnation=1, weight_version=None, reported_state=None, now=3, mono=1.5)
    (ev,) = s.propose(1, ["generator"], members={"generator-0": 1}, transfer={"group": "b"}, now=4)
    assert ev["type"] == "version_proposed" and s.pending[1].transfer == {"group": "b"}
    assert s.pending[1].members == {"generator-0": 1} and list(s.pending[1].confirmed) == ["generator-2"]
    assert s.confirm("generator-0", 1, now=5, mono=1.6)[-1]["data"]["confirmed_by"] == ["generator-0"]
    s.heartbeat("generator-2", incarnation=1, weight_version=None, reported_state=None, now=6, mono=1.6)
    s.propose(2, ["generator"], members={"generator-0": 1, "generator-2": 1}, transfer={"group": "b"}, now=6)
    s.confirm("generator-0", 2, now=6, mono=1.6)
    assert s.current_version == 1
    # Re-sent to members that all confirmed it already: current at once.
    events = s.propose(2, ["generator"], members={"generator-0": 1}, transfer={"group": "c"}, now=7)
    assert [e["type"] for e in events] == ["version_proposed", "version_current"] and s.current_version == 2
    snap = s.to_snapshot()
    replayed = RendezvousState(lease_s=1.0)
    replayed.replay(list(s.events))
    assert replayed.to_snapshot() == snap


def test_lease_boundaries_and_revival():
    s = RendezvousState(lease_s=1.0)
    reg(s, "generator", 0, mono=10.0)
    assert s.reap(now=0, mono=11.0) == []  # exactly one lease: still alive
    (lost,) = s.reap(now=0, mono=11.01)
    assert lost["type"] == "member_lost" and s.members["generator-0"].state == "lost"
    assert s.reap(now=0, mono=20.0) == []  # reported once
    (revived,) = s.heartbeat(
        "generator-0", incarnation=None, weight_version=None, reported_state=None, now=0, mono=21
    )
    assert revived["type"] == "member_revived" and s.members["generator-0"].state == "alive"
    s.start_grace(mono=100.0)
    assert s.reap(now=0, mono=100.9) == []


def test_membership_refusals():
    s = RendezvousState(lease_s=1.0)
    reg(s, "generator", 0)
    reg(s, "generator", 0)
    with pytest.raises(Rejected, match="superseded by incarnation 2") as e:
        s.heartbeat("generator-0", incarnation=1, weight_version=None, reported_state=None, now=0, mono=0)
    assert e.value.code == "stale_incarnation"
    with pytest.raises(Rejected) as e:
        s.heartbeat("nobody-0", incarnation=None, weight_version=None, reported_state=None, now=0, mono=0)
    assert e.value.code == "unknown_member"
    assert len(s.leave("generator-0", reason="", now=0)) == 1
    assert s.leave("generator-0", reason="", now=0) == []  # leaving twice is harmless
    with pytest.raises(Rejected) as e:
        s.record_metrics("generator-0", {"step": 1}, now=0, mono=0)
    assert e.value.code == "member_left"
    assert reg(s, "generator", 0)[0]["data"]["incarnation"] == 3  # rejoining is registering


def test_events_after_limits_and_resync():
    s = RendezvousState(lease_s=1.0, max_events=5)
    for rank in range(8):
        reg(s, "generator", rank)
    events, resync = s.events_after(6, limit=10)
    assert [e["seq"] for e in events] == [7, 8] and not resync
    assert s.events_after(8, limit=10) == ([], False)
    events, resync = s.events_after(1, limit=2)  # seq 2 and 3 were dropped from memory
    assert [e["seq"] for e in events] == [4, 5] and resync
    assert s.events_after(50, limit=10) == ([], True)  # beyond the end: the server was reset


def test_journal_tolerates_a_torn_last_line(tmp_path):
    s, events = live_state()
    j = Journal(tmp_path)
    j.load()
    j.append(events)
    j.close()
    path = tmp_path / "journal.jsonl"
    with open(path, "ab") as f:
        f.write(b'{"seq": 99, "time": 1.0, "type": "progr')  # crash mid-write
    j = Journal(tmp_path)
    snap, loaded = j.load()
    assert snap is None and loaded == events
    assert path.read_bytes().endswith(b"}\n")  # the torn bytes were cut off
    s2 = RendezvousState(lease_s=1.0)
    s2.replay(loaded)
    more = s2.set_progress({"step": 8}, now=200.0)
    j.append(more)
    j.close()
    _, again = Journal(tmp_path).load()
    assert [e["seq"] for e in again] == list(range(1, s.seq + 2))


def test_journal_keeps_a_complete_last_line_without_newline_and_skips_garbage(tmp_path):
    _, events = live_state()
    lines = [json.dumps(e).encode() for e in events]
    (tmp_path / "journal.jsonl").write_bytes(b"\n".join(lines[:3] + [b"#garbage#"] + lines[3:]))
    j = Journal(tmp_path)
    _, loaded = j.load()
    assert loaded == events
    j.append([{"seq": len(events) + 1, "time": 0.0, "type": "progress", "data": {"step": 1}}])
    j.close()
    _, loaded = Journal(tmp_path).load()
    assert [e["seq"] for e in loaded] == list(range(1, len(events) + 2))


def test_compaction_and_a_crash_between_snapshot_and_journal_reset(tmp_path):
    s, events = live_state()
    j = Journal(tmp_path, compact_every=5)
    j.load()
    j.append(events)
    assert j.should_compact()
    journal_before = (tmp_path / "journal.jsonl").read_bytes()
    j.compact(s.to_snapshot())
    assert (tmp_path / "journal.jsonl").read_bytes() == b""
    extra = s.set_progress({"step": 9}, now=300.0)
    j.append(extra)
    j.close()
    for journal in [None, journal_before]:  # None: the normal case; else: reset never happened
        if journal is not None:
            (tmp_path / "journal.jsonl").write_bytes(journal + (tmp_path / "journal.jsonl").read_bytes())
        snap, loaded = Journal(tmp_path).load()
        restored = RendezvousState(lease_s=1.0)
        restored.load_snapshot(snap)
        restored.replay(loaded)
        assert restored.to_snapshot() == s.to_snapshot()
