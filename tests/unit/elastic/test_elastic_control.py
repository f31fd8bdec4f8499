"""The trainer's side of the rule: iteration records in, `elastic/*` metrics out, scale requests
posted to a real rendezvous server (loopback) as `scale_requested` events from source `policy`."""

from __future__ import annotations

import time

import pytest
from support.rendezvous import start_rendezvous

from streamrl_cli.elastic.control import ElasticController
from streamrl_cli.recipe.schema import ElasticConfig
from streamrl_cli.rendezvous import RendezvousClient, create_secret


def rec(i: int, t_gen: float, t_train: float, idle: float = 0.0, floor: float = 0.0) -> dict:
    return {"iteration": i, "t/generation": t_gen, "t/train": t_train, "idle/generator": idle,
            "t/longest_sample": floor}  # fmt: skip


@pytest.fixture
def rdv(tmp_path):
    create_secret(tmp_path)
    server = start_rendezvous(tmp_path)
    client = RendezvousClient.from_run_dir(tmp_path, timeout=5.0, retry_s=10.0)
    yield client
    client.close()
    server.terminate()
    server.wait(timeout=10)


def scale_events(client: RendezvousClient, since: int) -> list[dict]:
    return [e for e in client.events(since)["events"] if e["type"] == "scale_requested"]


def test_generation_bound_iterations_ask_for_one_more_instance(rdv):
    since = rdv.versions()["event_seq"]
    n = {"now": 1}
    ctl = ElasticController(
        ElasticConfig(enabled=True, min=1, max=3, patience=2, cooldown=1), rdv, lambda: n["now"]
    )
    first = ctl.after_iteration(rec(0, t_gen=10.0, t_train=2.0, floor=4.0))
    assert first == {
        "elastic/instances": 1,
        "elastic/target": 1,
        "elastic/delta": 8.0,
        "elastic/delta_prime": 3.0,
    }
    assert scale_events(rdv, since) == []  # patience 2: not yet
    second = ctl.after_iteration(rec(1, t_gen=10.0, t_train=2.0, floor=4.0))
    assert second["elastic/target"] == 2
    (ev,) = scale_events(rdv, since)
    assert ev["data"]["instances"] == 2 and ev["data"]["source"] == "policy"
    assert ev["data"]["reason"].startswith("add: Δ 8s > Δ′ 3s")


def test_a_lost_rendezvous_costs_a_decision_not_the_run(tmp_path):
    create_secret(tmp_path)
    (tmp_path / "rendezvous.json").write_text('{"url": "http://127.0.0.1:9"}')  # nothing listens there
    client = RendezvousClient.from_run_dir(tmp_path, timeout=0.5, retry_s=0.5)
    ctl = ElasticController(
        ElasticConfig(enabled=True, min=1, max=2, patience=1, cooldown=0), client, lambda: 1
    )
    t0 = time.monotonic()
    out = ctl.after_iteration(rec(0, t_gen=10.0, t_train=1.0))
    assert out["elastic/target"] == 2 and time.monotonic() - t0 < 30
    client.close()
