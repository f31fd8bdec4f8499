"""The trainer's start against a real rendezvous server (in a thread, on loopback): it waits for the
generators to serve, and one that is still starting does not hold the run past its wait."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from support.helpers import rendezvous_in_thread

import streamrl_cli.trainer.role.main as trainer_main
from streamrl_cli.errors import StreamRLError
from streamrl_cli.rendezvous import RendezvousClient


def generator(run_dir, rank: int, state: str) -> RendezvousClient:
    c = RendezvousClient.from_run_dir(run_dir)
    c.register("generator", rank)
    c.set_status(state=state)
    c.heartbeat()
    return c


def wait(run_dir, expected: int) -> None:
    role = SimpleNamespace(rdv=RendezvousClient.from_run_dir(run_dir), generators=expected)
    trainer_main.TrainerRole._wait_serving(role, "generator", expected)  # type: ignore[arg-type]


def test_the_run_starts_with_the_generators_serving_once_the_wait_is_over(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(trainer_main, "WAIT_S", 1.0)
    with rendezvous_in_thread(tmp_path):
        generator(tmp_path, 0, "generating")
        generator(tmp_path, 1, "loading engine")
        with caplog.at_level(logging.WARNING, logger=trainer_main.log.name):
            wait(tmp_path, 3)  # the third never registered
    text = caplog.text
    assert "starting with 1 of 3 generators serving" in text
    assert "generator-1 (loading engine)" in text and "1 not registered" in text


def test_the_run_starts_at_once_when_every_generator_serves(tmp_path, monkeypatch):
    monkeypatch.setattr(trainer_main, "WAIT_S", 600.0)  # would fail the test's time limit if waited
    with rendezvous_in_thread(tmp_path):
        generator(tmp_path, 0, "generating")
        generator(tmp_path, 1, "waiting for weights")
        wait(tmp_path, 2)


def test_no_generator_serving_after_the_wait_fails_the_run_naming_them(tmp_path, monkeypatch):
    monkeypatch.setattr(trainer_main, "WAIT_S", 1.0)
    with rendezvous_in_thread(tmp_path):
        generator(tmp_path, 0, "loading engine")
        with pytest.raises(StreamRLError, match=r"no generator serving after 1s of 2 expected.*generator-0"):
            wait(tmp_path, 2)


def test_a_generator_lost_while_starting_is_waited_for_and_one_that_left_is_gone(tmp_path, monkeypatch):
    """Lost (silent past its lease: an engine starting on busy cores) is not gone: it may come back at
    its next heartbeat, and a process that died is the supervisor's to see. Left (failed, said why) is."""
    import time

    monkeypatch.setattr(trainer_main, "WAIT_S", 1.0)
    with rendezvous_in_thread(tmp_path, lease_s=0.4):
        g = generator(tmp_path, 0, "loading engine")
        rdv = RendezvousClient.from_run_dir(tmp_path)
        deadline = time.monotonic() + 30
        while rdv.members("generator")[0]["state"] != "lost":
            assert time.monotonic() < deadline, "the server never marked the silent generator lost"
            time.sleep(0.05)
        # Lost all along: the run waits its whole wait, then fails as for one still starting.
        with pytest.raises(StreamRLError, match=r"no generator serving after 1s of 1 expected.*generator-0"):
            wait(tmp_path, 1)
        # It comes back, serving (heartbeating from now on): the run starts.
        g.set_status(state="generating")
        g.start_heartbeat(interval=0.05)
        while rdv.members("generator")[0]["state"] != "alive":
            assert time.monotonic() < deadline, "the generator's heartbeats did not revive it"
            time.sleep(0.05)
        wait(tmp_path, 1)
        # Lost once it had served (killed: a restarted trainer finds it so), it is gone at once.
        g.stop_heartbeat()
        while rdv.members("generator")[0]["state"] != "lost":
            assert time.monotonic() < deadline, "the server never marked the silent generator lost"
            time.sleep(0.05)
        monkeypatch.setattr(trainer_main, "WAIT_S", 600.0)  # would fail the test's time limit if waited
        with pytest.raises(StreamRLError, match=r"every generator failed at start \(generator-0: lost\)"):
            wait(tmp_path, 1)
        # One that left is gone at once.
        g.leave("vLLM could not start")
        with pytest.raises(StreamRLError, match=r"every generator failed at start \(generator-0: left\)"):
            wait(tmp_path, 1)
