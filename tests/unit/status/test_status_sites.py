"""What `streamrl status` tells about sites, stalls and members' errors (pure logic, no sockets)."""

from __future__ import annotations

import json

from streamrl_cli.rendezvous.state import RendezvousState
from streamrl_cli.status import sites, stalled_for


def member(
    role: str, rank: int, site: str, *, state: str = "alive", version=None, metrics=None, rs="generating"
):
    return {
        "member_id": f"{role}-{rank}", "role": role, "rank": rank, "site": site, "state": state,
        "reported_state": rs, "weight_version": version, "metrics": metrics or {},
    }  # fmt: skip


def test_sites_show_members_relay_version_and_last_transfers():
    relay_fetch = {
        "weights/version": 3, "weights/at": 1000.0, "weights/transfer_s": 0.4, "weights/bytes": 600,
        "weights/relay": 1, "weights/wan_bytes": 60, "weights/wan_s": 0.1, "weights/wan_mode": "delta",
        "weights/wan_reason": "", "weights/wan_full_bytes": 600, "weights/wan_ratio": 10.0,
    }  # fmt: skip
    follower = {"weights/version": 3, "weights/at": 1001.0, "weights/transfer_s": 0.5, "weights/bytes": 600,
                "weights/relay": 0}  # fmt: skip
    members = [
        member("trainer", 0, "local", rs="training"),
        member("generator", 0, "remote", state="lost", version=2, metrics=relay_fetch),  # the old relay
        member("generator", 1, "remote", version=3, metrics=follower),
        member("generator", 2, "remote", version=3, rs="starting"),  # not past start-up: no relay yet
    ]
    local, remote = sites(members)
    assert local["trainer_site"] and local["relay"] is None and local["last_transfer"] is None
    assert not remote["trainer_site"]
    assert remote["relay"] == "generator-1"  # lowest-ranked alive generator past start-up
    assert [m["member_id"] for m in remote["members"]] == ["generator-0", "generator-1", "generator-2"]
    assert remote["weight_version"] == 3  # what every alive generator there serves at least
    assert remote["last_transfer"] == {"version": 3, "at": 1001.0, "seconds": 0.5, "bytes": 600}
    assert remote["last_wan_transfer"] == {
        "version": 3, "at": 1000.0, "seconds": 0.1, "bytes": 60,
        "mode": "delta", "reason": None, "full_bytes": 600, "ratio": 10.0,
    }  # fmt: skip


def test_a_run_is_stalled_only_past_the_bound_without_progress():
    rdv = {"reachable": True, "progress": {"step": 3, "updated": 1000.0}}
    info = {"started": 900.0}
    assert stalled_for("running", rdv, info, 60.0, 1059.0) is None
    assert stalled_for("running", rdv, info, 60.0, 1061.0) == 61.0
    assert (
        stalled_for("running", {"reachable": True, "progress": {}}, info, 60.0, 1000.0) == 100.0
    )  # no step yet
    assert stalled_for("finished", rdv, info, 60.0, 5000.0) is None
    assert stalled_for("running", {"reachable": False}, info, 60.0, 5000.0) is None  # cannot tell


def test_a_members_last_error_is_kept_cleared_and_replayed():
    s = RendezvousState(lease_s=5.0)
    events = []
    for rank in (0, 1):
        _, evs = s.register(
            role="generator",
            rank=rank,
            cluster="c",
            host="h",
            site="A",
            addresses={},
            info={},
            now=1.0,
            mono=0.0,
        )
        events += evs
    events += s.heartbeat("generator-0", incarnation=1, weight_version=None, reported_state=None,
                          error="weight version 2 not received: store gone", now=2.0, mono=1.0)  # fmt: skip
    assert s.members["generator-0"].last_error == "weight version 2 not received: store gone"
    events += s.heartbeat("generator-0", incarnation=1, weight_version=2, reported_state=None, error="",
                          now=3.0, mono=2.0)  # fmt: skip
    assert s.members["generator-0"].last_error is None
    events += s.leave("generator-1", reason="failed: StreamRLError: trainer unreachable", now=4.0)
    assert s.members["generator-1"].last_error == "failed: StreamRLError: trainer unreachable"
    replayed = RendezvousState(lease_s=5.0)
    replayed.replay(json.loads(json.dumps(events)))
    assert replayed.to_snapshot() == s.to_snapshot()


def test_the_sites_table_names_the_relay_and_what_crossed():
    from rich.console import Console

    from streamrl_cli.status.view import sites_table

    wan = {"weights/version": 5, "weights/at": 1.0, "weights/bytes": 3 << 20, "weights/transfer_s": 0.3,
           "weights/relay": 1, "weights/wan_bytes": 3 << 20, "weights/wan_s": 0.25}  # fmt: skip
    console = Console(record=True, width=200)
    console.print(
        sites_table(sites([member("trainer", 0, "a"), member("generator", 0, "b", version=5, metrics=wan)]))
    )
    text = console.export_text()
    assert "(trainer's site)" in text and "generator-0" in text
    assert "v5: 3.00 MiB in 0.25s" in text and "v5: 3.00 MiB in 0.30s" in text  # no mode: before deltas

    def across(**wan_fields) -> str:
        rec = {**wan, **{f"weights/wan_{k}": v for k, v in wan_fields.items()}}
        console = Console(record=True, width=200)
        console.print(
            sites_table(sites([member("trainer", 0, "a"), member("generator", 0, "b", metrics=rec)]))
        )
        return console.export_text()

    assert "v5 delta: 0.12 MiB (25×) in 0.25s" in across(
        mode="delta", reason="", bytes=int(0.12 * 2**20), full_bytes=3 << 20, ratio=25.0
    )
    assert "v5 full: 3.00 MiB in 0.25s, " in across(mode="full", reason="base_gone", ratio=1.0)
    assert " ago (base_gone)" in across(mode="full", reason="base_gone", ratio=1.0)


def test_a_members_error_reaches_the_terminal_without_control_characters():
    s = RendezvousState(lease_s=5.0)
    s.register(
        role="generator", rank=0, cluster="c", host="h", site="A", addresses={}, info={}, now=1.0, mono=0.0
    )
    s.heartbeat("generator-0", incarnation=1, weight_version=None, reported_state=None,
                error="bad\x1b[31m red\u2028next\nline", now=2.0, mono=1.0)  # fmt: skip
    assert s.members["generator-0"].last_error == "bad [31m red next line"


def test_members_not_yet_heard_from_are_registering_while_the_server_answers(tmp_path):
    from streamrl_cli import rundir
    from streamrl_cli.rundir import RunDir
    from streamrl_cli.status import _members

    run = RunDir(tmp_path)
    run.members.mkdir(parents=True)
    rundir.write_json(run.member_record("generator", 0), {"role": "generator", "rank": 0, "host": "h"})
    rundir.write_json(run.member_record("generator", 1), {"role": "generator", "rank": 1, "exit_code": 1})
    live = [{**member("trainer", 0, "local"), "host": "h"}]  # only the trainer registered so far

    def states(live, reachable):
        return [(m["rank"], m["state"]) for m in _members(run, "generator", live, reachable=reachable)]

    assert states(live, True) == [(0, "registering"), (1, "exited")]
    assert states([], False) == [(0, "unknown"), (1, "exited")]  # the server cannot be asked
    assert [m["state"] for m in _members(run, "trainer", live, reachable=True)] == ["alive"]
    rundir.write_json(run.member_record("rendezvous", 0), {"role": "rendezvous", "rank": 0})
    assert _members(run, "rendezvous", live, reachable=True) == []  # no member of itself
    assert [m["state"] for m in _members(run, "rendezvous", [], reachable=False)] == ["unknown"]
