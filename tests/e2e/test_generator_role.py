"""Two real generator processes (the role program, real vLLM on CPU) and a test harness as trainer.

The harness is what the trainer's rank 0 will be: registered with a real rendezvous server, the
data plane's DispatchService receiving samples, the data plane's broadcast sending weights. The
generators are started exactly as `streamrl run` starts them (``python -m streamrl_cli.roles
SPEC --rank N``). One set of processes serves the whole module (each vLLM start costs ~30 s and
~3 GiB); the tests run in file order: stream, update weights, kill one, trainer leaves.
"""

from __future__ import annotations

import os
import signal

import pytest
from support.engine import LONG_PROMPT, hf_greedy, randomize
from support.generator_harness import LEASE_S, START_S, Harness, serving, wait_until  # noqa: F401

from streamrl_cli.rendezvous import RendezvousClient

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    yield from serving(Harness(tmp_path_factory.mktemp("generators")))


def test_two_generators_stream_every_group_exactly_once(harness):
    prompts = [[(7 * i + j) % 500 + 1 for j in range(10 + i)] for i in range(8)]
    ids = harness.submit(prompts, n=4, temperature=1.0, max_tokens=16, seed=3)
    samples = harness.receive(8 * 4)
    assert sorted((s.prompt_id, s.sample_index) for s in samples) == sorted(
        (p, i) for p in ids for i in range(4)
    )
    assert {s.generator for s in samples} == {"generator-0", "generator-1"}
    for s in samples:
        assert len(s.token_ids) == len(s.logprobs) > 0 and all(lp <= 0 for lp in s.logprobs)
        assert s.weight_version == 0 and s.group_id == s.prompt_id
        assert s.queued_at <= s.first_token_at <= s.finished_at
    # A GRPO group comes from one generator (one engine request with n = 4).
    by_prompt = {}
    for s in samples:
        by_prompt.setdefault(s.prompt_id, set()).add(s.generator)
    assert all(len(g) == 1 for g in by_prompt.values())


def test_new_weights_change_both_generators_greedy_output(harness):
    hf = harness.hf
    prompts = [LONG_PROMPT[k:] + LONG_PROMPT[:k] for k in range(0, 40, 10)]
    before = [hf_greedy(hf, p, 12) for p in prompts]
    state = randomize(hf, seed=11)
    harness.rdv.propose_version(1, ["generator"])
    harness.weights.send(state, 1).result(timeout=120)
    harness.rdv.wait_for_version(1, timeout=120)
    ids = harness.submit(prompts, temperature=0.0, max_tokens=12, ignore_eos=True)
    got = {s.prompt_id: s for s in harness.receive(len(prompts))}
    expected = [hf_greedy(hf, p, 12) for p in prompts]
    assert expected != before
    assert [got[i].token_ids for i in ids] == expected
    assert {got[i].weight_version for i in ids} == {1}
    assert {got[i].generator for i in ids} == {"generator-0", "generator-1"}
    served = {m["member_id"]: m["weight_version"] for m in harness.rdv.members("generator")}
    assert served == {"generator-0": 1, "generator-1": 1}
    metrics = wait_until(lambda: harness.rdv.status()["metrics"].get("generator-0"), 30, "metrics")
    assert {"tokens_per_s", "queue_depth", "idle_ratio", "weight_version"} <= set(metrics["record"])


def test_a_cancelled_group_is_dropped_by_its_generator_and_nothing_of_it_arrives(harness):
    # What over-sampling does to the groups it will not train. The long group (4 × 256 tokens) is
    # cancelled the moment it is dispatched: whether its generator still queues it or already runs
    # it in the engine, it drops it and counts it; it cannot have finished by then.
    def cancelled() -> int:
        metrics = harness.rdv.status()["metrics"]
        return sum(m["record"].get("cancelled_requests", 0) for m in metrics.values() if "record" in m)

    # Both generators take work first: a group submitted while none is alive (a lease missed on
    # 2 busy cores) waits in the ledger, and cancelling it then reaches no generator at all.
    wait_until(lambda: len(harness.svc.generators()) == 2, 60, "both generators taking work")
    before = cancelled()
    (long,) = harness.submit([LONG_PROMPT[:20]], n=4, temperature=1.0, max_tokens=256, ignore_eos=True)
    (owner,) = harness.svc.dispatcher.ledger.owers(long)  # dispatched to one generator at once
    harness.svc.cancel([long])
    short = harness.submit([LONG_PROMPT[:12], LONG_PROMPT[5:15]], n=2, temperature=1.0, max_tokens=8)
    got = harness.receive(4)
    assert {s.prompt_id for s in got} == set(short)
    try:
        wait_until(lambda: cancelled() == before + 1, 30, f"the cancellation counted by {owner}")
    except AssertionError as e:
        raise AssertionError(f"{e}\n{harness.log_tails()}") from None
    assert harness.svc.outstanding() == 0
    assert harness.svc.get(timeout=1.0) is None  # nothing of the cancelled group comes after


def test_killed_generator_work_is_redispatched_and_received_once(harness):
    # The victim serves a first batch (so samples of it were received before it died), then gets
    # half of a second batch of long outputs (200 tokens each) and is frozen (SIGSTOP) by the next
    # statement: it cannot have finished its share, so it still owes it when it is killed. Frozen
    # before the dispatch instead, it could have been marked lost first (2 s lease) and been given
    # nothing. Its share comes from the other generator, once.
    victim, ledger = harness.generators[1], harness.svc.dispatcher.ledger
    prompts = [[(3 * i + j) % 500 + 1 for j in range(8)] for i in range(16)]
    first = harness.submit(prompts[:8], n=2, temperature=1.0, max_tokens=16, ignore_eos=True)
    got = harness.receive(len(first) * 2)
    assert {s.generator for s in got} == {"generator-0", "generator-1"}
    before = ledger.stats["redispatched"]
    second = harness.submit(prompts[8:], n=2, temperature=1.0, max_tokens=200, ignore_eos=True)
    os.killpg(victim.pid, signal.SIGSTOP)
    owed = ledger.load("generator-1")  # the samples it had not delivered
    assert owed > 0
    os.killpg(victim.pid, signal.SIGKILL)
    assert victim.wait(timeout=30) == -signal.SIGKILL
    got += harness.receive(len(second) * 2, timeout=240)
    keys = [(s.prompt_id, s.sample_index) for s in got]
    assert len(keys) == len(set(keys)) and set(keys) == {(p, i) for p in first + second for i in range(2)}
    assert 0 < ledger.stats["redispatched"] - before <= owed  # what it owed, less any in flight
    assert harness.svc.outstanding() == 0
    assert harness.svc.get(timeout=1.0) is None  # nothing more arrives: no duplicate got through
    lost = {m["member_id"]: m["state"] for m in harness.rdv.members("generator")}
    assert lost["generator-1"] == "lost"


def test_generator_leaves_cleanly_when_the_trainer_leaves(harness):
    survivor = harness.generators[0]
    harness.rdv.leave("done")
    assert survivor.wait(timeout=120) == 0, harness.log_tails()
    states = {m["member_id"]: m["state"] for m in RendezvousClient.from_run_dir(harness.run_dir).members()}
    assert states["generator-0"] == "left"
