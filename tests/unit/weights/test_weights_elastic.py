"""The trainer's elastic weight broadcast against engine-less generator processes (real rendezvous,
real gloo, tests/support/weight_peer.py): a member dying before or after it said it was ready, a late
joiner, a group kept while nobody changed. The same protocol with real vLLM engines is in
tests/e2e/test_generator_elastic.py; this one is fast enough to try every failure path.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from support.generator_harness import wait_until
from support.weights_elastic import LEASE_S, TRANSFER_TIMEOUT_S, Run, digest, state  # noqa: F401

from streamrl_cli.weights import WeightTransferError


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    r = Run(tmp_path_factory.mktemp("elastic"))
    try:
        for rank in range(3):
            r.start(rank, *(["--die-when-ready", "2"] if rank == 2 else []))
        wait_until(lambda: len(r.eligible()) == 3, 60, "three generators")
        yield r
    finally:
        r.close()


def test_a_version_goes_to_a_group_formed_for_every_generator(run):
    stats = run.publish(1)
    assert (stats["members"], stats["attempts"]) == (3, 1)
    assert run.rdv.versions()["current"] == 1
    for rank in range(3):
        assert wait_until(lambda r=rank: run.got(r), 60, f"peer {rank}") == [f"GOT 1 {digest(state(1))}"]


def test_a_member_dying_after_it_said_ready_fails_the_broadcast_then_a_new_group_gets_it(run):
    # generator-2 says it is ready for version 2 and exits: the broadcast on version 1's group
    # fails (at once on a closed socket, at worst after the transfer timeout) and the trainer
    # sends again to the two still there, on a new group.
    t0 = time.monotonic()
    stats = run.publish(2)
    took = time.monotonic() - t0
    assert (stats["members"], stats["attempts"]) == (2, 2)
    assert took < TRANSFER_TIMEOUT_S + 10 * LEASE_S  # not the members' own 30 s group timeout
    assert run.rdv.versions()["current"] == 2
    states = {m["member_id"]: m["state"] for m in run.rdv.members("generator")}
    assert states == {"generator-0": "alive", "generator-1": "alive", "generator-2": "lost"}
    for rank in range(2):
        # Their receive on the abandoned group failed at once when the trainer dropped its end.
        assert [x.split()[1] for x in run.lines(rank) if x.startswith("FAILED")] == ["2"]
        assert run.got(rank)[-1] == f"GOT 2 {digest(state(2))}"


def test_a_member_killed_before_the_transfer_is_left_out_without_a_timeout(run):
    run.peers[1].send_signal(signal.SIGKILL)
    run.peers[1].wait()
    t0 = time.monotonic()
    stats = run.publish(3)  # generator-1 is still alive for the rendezvous: planned in, then out
    assert time.monotonic() - t0 < TRANSFER_TIMEOUT_S + 5 * LEASE_S
    assert (stats["members"], stats["attempts"]) == (1, 2)
    assert run.rdv.versions()["current"] == 3
    assert run.got(0)[-1] == f"GOT 3 {digest(state(3))}"


def test_late_joiners_are_in_the_next_group_and_an_unchanged_group_is_kept(run):
    run.start(3)
    run.start(4, "--die-when-ready", "4")
    # Wait for exactly these three: a count of three is also met by generator-1 (killed in the last
    # test) before its lease runs out, and the version would then be planned for it.
    want = ["generator-0", "generator-3", "generator-4"]
    wait_until(lambda: sorted(run.eligible()) == want, 60, "the late joiners, generator-1 lost")
    # A new group for generators 0, 3, 4; generator-4 dies once ready, so the group never forms:
    # the trainer gives up after its transfer timeout, the others' joins fail when its store goes.
    t0 = time.monotonic()
    four = run.publish(4)
    assert TRANSFER_TIMEOUT_S <= time.monotonic() - t0 < TRANSFER_TIMEOUT_S + 10 * LEASE_S
    assert (four["members"], four["attempts"]) == (2, 2)
    assert wait_until(lambda: run.got(3), 60, "peer 3") == [f"GOT 4 {digest(state(4))}"]
    five = run.publish(5)
    assert five["group"] == four["group"]  # nobody came or went: same group, no re-formation
    assert run.rdv.versions()["current"] == 5
    assert wait_until(lambda: len(run.got(3)) == 2, 60, "peer 3, twice")
    assert run.got(0)[-1] == run.got(3)[-1] == f"GOT 5 {digest(state(5))}"


def test_with_no_generator_left_the_transfer_fails_after_its_retry(run):
    for rank in (0, 3):
        os.kill(run.peers[rank].pid, signal.SIGKILL)
        run.peers[rank].wait()
    wait_until(lambda: not run.eligible(), 60, "both lost")
    run.publisher.sync_timeout_s = 2.0
    with pytest.raises(WeightTransferError, match="not delivered in 2 attempt"):
        run.publish(6)
