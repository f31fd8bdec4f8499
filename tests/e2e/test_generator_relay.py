"""Generators at another site than the trainer: one copy crosses to the relay, which rebroadcasts.

Two real generator processes (vLLM on CPU) with ``weight_transport: relay``: generator 0 (the
relay: lowest rank) fetches each version from the trainer's weight server (the data plane's relay)
and hosts its site's elastic broadcast group; generator 1 receives from it. Failures and failover
are in test_weights_relay_elastic.py (engine-less generators, fast). The trainer is the harness of
test_generator_role.py with a WeightServer instead of a broadcast group.
"""

from __future__ import annotations

import pytest
from support.engine import LONG_PROMPT, hf_greedy, randomize
from support.generator_harness import Harness, serving, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    yield from serving(Harness(tmp_path_factory.mktemp("relay"), transport="relay"))


PROMPTS = [LONG_PROMPT[k:] + LONG_PROMPT[:k] for k in range(0, 40, 10)]


def greedy_everywhere(harness, version: int) -> None:
    """Both generators' greedy outputs are transformers' on the harness model's current weights."""
    ids = harness.submit(PROMPTS, temperature=0.0, max_tokens=12, ignore_eos=True)
    got = {s.prompt_id: s for s in harness.receive(len(PROMPTS))}
    assert [got[i].token_ids for i in ids] == [hf_greedy(harness.hf, p, 12) for p in PROMPTS]
    assert {got[i].weight_version for i in ids} == {version}
    assert {got[i].generator for i in ids} == {"generator-0", "generator-1"}


def relay_record(harness, version: int) -> dict:
    """generator-0's (the relay's) metrics once they are of `version`'s transfer."""

    def of_version() -> dict | None:
        m = harness.rdv.status()["metrics"].get("generator-0", {}).get("record", {})
        return m if m.get("weights/version") == version else None

    return wait_until(of_version, 30, f"the relay's record of version {version}")


def test_one_copy_crosses_to_the_relay_which_serves_its_site(harness):
    previous: dict = {}
    for version in (1, 2):
        state = randomize(harness.hf, seed=20 + version)
        if previous:  # the norms kept from version 1: the relay, holding it, gets a delta
            params = dict(harness.hf.named_parameters())
            for name in (n for n in state if "norm" in n):
                params[name].data.copy_(previous[name])
                state[name] = previous[name].clone()
        previous = state
        sent_before = harness.relay.stats["bytes"]
        manifest = harness.relay.publish(version, state)  # published first, then proposed
        harness.rdv.propose_version(version, ["generator"])
        harness.rdv.wait_for_version(version, timeout=120)
        # One copy of this version left the trainer's site: what the relay says it received.
        crossed = harness.relay.stats["bytes"] - sent_before
        rec = relay_record(harness, version)
        assert crossed == rec["weights/wan_bytes"] and rec["weights/wan_full_bytes"] == manifest.total
        if version == 1:  # nothing to build on: the whole version
            assert (rec["weights/wan_mode"], rec["weights/wan_reason"]) == ("full", "no_base")
            assert crossed == manifest.total
        else:
            assert rec["weights/wan_mode"] == "delta" and 0 < crossed < manifest.total
        # generator-0 sent it to its site on a group it planned, named in its re-sent proposal.
        resent = [e["data"] for e in harness.rdv.events(0, limit=10_000)["events"]
                  if e["type"] == "version_proposed" and e["data"]["version"] == version]  # fmt: skip
        assert resent[-1]["transfer"]["source"] == "generator-0"
        assert set(resent[-1]["members"]) == {"generator-0", "generator-1"}
        greedy_everywhere(harness, version)


def test_a_version_superseded_during_the_fetch_is_relayed_as_the_newer_one(harness):
    # The trainer published 3 and then 4 before the relay fetched 3: the relay sends 4, both
    # generators serve 4 and confirm it once the trainer proposes it.
    harness.relay.publish(3, randomize(harness.hf, seed=23))
    harness.relay.publish(4, randomize(harness.hf, seed=24))
    harness.rdv.propose_version(3, ["generator"])
    wait_until(
        lambda: {m["weight_version"] for m in harness.rdv.members("generator")} == {4}, 120, "both serving 4"
    )
    harness.rdv.propose_version(4, ["generator"])
    assert harness.rdv.wait_for_version(4, timeout=60)["current"] == 4
    greedy_everywhere(harness, 4)
