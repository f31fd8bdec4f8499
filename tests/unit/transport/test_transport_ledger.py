"""The Ledger (who owes which sample) and the dispatch policy: pure logic, tested exhaustively.

Besides the scenarios by name, a model check drives the Ledger through thousands of random
event sequences (assign, complete from any generator, lose) next to a ten-line reference model
and compares every answer: exactly-once and load accounting must hold in every interleaving.
"""

from __future__ import annotations

import random

import msgspec
import pytest
from support.configs import sampling as make_sampling

from streamrl_cli.transport import TransportError
from streamrl_cli.transport.ledger import Ledger, Outcome
from streamrl_cli.transport.routing import Dispatcher, LeastLoaded, make_policy
from streamrl_cli.transport.wire import Request, Sample, Sampling, decode_request, encode


def req(pid: str, n: int = 2, **kw) -> Request:
    return Request(prompt_id=pid, prompt_token_ids=[1, 2, 3], sample_indices=list(range(n)), **kw)


def test_assign_complete_and_loads():
    led = Ledger()
    led.add(req("p0", 3, priority=2, sampling=make_sampling(temperature=0.7)))
    led.add(req("p1", 1))
    assert len(led) == 4 and led.loads() == {}
    sent = led.assign("p0", [0, 2], "g0")
    assert sent.sample_indices == [0, 2] and sent.priority == 2
    assert sent.sampling == make_sampling(temperature=0.7)
    led.assign("p1", [0], "g1")
    assert led.loads() == {"g0": 2, "g1": 1} and led.owner("p0", 1) is None
    assert [r.sample_indices for r in led.open_requests()] == [[1]]
    assert led.complete("p0", 0) is Outcome.NEW and led.load("g0") == 1
    assert led.complete("p0", 0) is Outcome.DUPLICATE
    assert led.complete("p0", 7) is Outcome.UNKNOWN and led.complete("nope", 0) is Outcome.UNKNOWN
    assert led.complete("p1", 0) is Outcome.NEW and led.is_done("p1")
    assert led.complete("p1", 0) is Outcome.UNKNOWN  # finished prompts are forgotten (memory is bounded)
    assert led.stats == {"completed": 2, "duplicates": 1, "unknown": 3, "redispatched": 0, "cancelled": 0}


def test_lose_reopens_only_the_lost_generators_undelivered_samples():
    led = Ledger()
    for p in ("a", "b", "c"):
        led.add(req(p, 2))
    led.assign("a", [0, 1], "g0")
    led.assign("b", [0], "g0")
    led.assign("b", [1], "g1")
    led.assign("c", [0, 1], "g1")
    assert led.complete("a", 1) is Outcome.NEW
    lost = led.lose("g0")
    assert [(r.prompt_id, r.sample_indices) for r in lost] == [("a", [0]), ("b", [0])]
    assert led.loads() == {"g1": 3} and led.stats["redispatched"] == 2
    assert led.lose("g0") == [] and led.lose("never-seen") == []
    # A late copy from the lost generator is still the first copy: accepted.
    assert led.complete("a", 0) is Outcome.NEW and led.is_done("a")
    led.assign("b", [0], "g2")
    assert led.complete("b", 0) is Outcome.NEW and led.load("g2") == 0  # the lost g0's copy won the race
    assert led.complete("b", 0) is Outcome.DUPLICATE  # ... so g2's copy is dropped


def test_cancel_forgets_a_prompt_and_names_who_owed_it():
    led = Ledger()
    for p in ("a", "b"):
        led.add(req(p, 3))
    led.assign("a", [0], "g0")
    led.assign("a", [1], "g1")  # index 2 still open
    led.assign("b", [0, 1, 2], "g0")
    assert led.complete("a", 0) is Outcome.NEW
    assert led.cancel("a") == {"g1"}  # g0 delivered its part already
    assert led.loads() == {"g0": 3} and led.stats["cancelled"] == 2
    assert [r.prompt_id for r in led.open_requests()] == []  # the open index is never assigned
    assert led.complete("a", 1) is Outcome.UNKNOWN  # a late copy is dropped
    assert led.lose("g1") == [] and led.cancel("a") == set() and led.cancel("never") == set()


def test_invalid_transitions_raise():
    led = Ledger()
    led.add(req("p", 2))
    with pytest.raises(ValueError, match="already outstanding"):
        led.add(req("p", 1))
    with pytest.raises(ValueError, match="distinct and non-empty"):
        led.add(Request(prompt_id="q", prompt_token_ids=[], sample_indices=[1, 1]))
    with pytest.raises(ValueError, match="distinct and non-empty"):
        led.add(Request(prompt_id="q", prompt_token_ids=[], sample_indices=[]))
    led.assign("p", [0], "g0")
    with pytest.raises(ValueError, match="already assigned to g0"):
        led.assign("p", [0, 1], "g1")
    assert led.owner("p", 1) is None  # the failed call changed nothing
    with pytest.raises(KeyError):
        led.assign("p", [5], "g1")
    with pytest.raises(KeyError):
        led.assign("zz", [0], "g1")
    with pytest.raises(KeyError):
        led.owner("p", 9)


def test_model_check_random_interleavings():
    for seed in range(500):
        try:
            _model_check(seed)
        except AssertionError as e:
            raise AssertionError(f"seed {seed}: {e}") from e


def _model_check(seed: int) -> None:
    rng = random.Random(seed)
    gens = ["g0", "g1", "g2"]
    keys = [(f"p{i}", j) for i in range(3) for j in range(rng.randint(1, 3))]
    state: dict[tuple[str, int], str | None] = {}  # reference model: key -> owner (None open, "done")
    led = Ledger()
    for pid in sorted({p for p, _ in keys}):
        idx = [j for p, j in keys if p == pid]
        led.add(Request(prompt_id=pid, prompt_token_ids=[], sample_indices=idx))
        state.update({(pid, j): None for j in idx})
    delivered = []
    for _ in range(40):
        op = rng.random()
        if op < 0.35:
            open_keys = [k for k, o in state.items() if o is None]
            if open_keys:
                pid = rng.choice(open_keys)[0]
                idx = [j for (p, j) in open_keys if p == pid]
                pick = rng.sample(idx, rng.randint(1, len(idx)))
                g = rng.choice(gens)
                assert led.assign(pid, pick, g).sample_indices == sorted(pick)
                state.update({(pid, j): g for j in pick})
        elif op < 0.85:
            k = rng.choice([*keys, ("p9", 0)])
            expect = Outcome.NEW if state.get(k, "done") != "done" else None
            got = led.complete(*k)
            if expect is Outcome.NEW:
                assert got is Outcome.NEW
                state[k] = "done"
                delivered.append(k)
            else:
                assert got in (Outcome.DUPLICATE, Outcome.UNKNOWN)
        else:
            g = rng.choice(gens)
            lost = {(r.prompt_id, j) for r in led.lose(g) for j in r.sample_indices}
            assert lost == {k for k, o in state.items() if o == g}
            state.update({k: None for k in lost})
        for g in gens:
            assert led.load(g) == sum(1 for o in state.values() if o == g)
        assert len(led) == sum(1 for o in state.values() if o != "done")
    assert len(delivered) == len(set(delivered))  # exactly once, whatever the interleaving


def test_least_loaded_rotates_among_equals_and_prefers_the_least_loaded():
    pol = LeastLoaded()
    r = req("x")
    picks = [pol.choose(r, {"a": 0, "b": 0, "c": 0}) for _ in range(6)]
    assert picks == ["a", "b", "c", "a", "b", "c"]
    assert pol.choose(r, {"a": 5, "b": 2, "c": 9}) == "b"
    with pytest.raises(TransportError, match="unknown dispatch policy 'skew'; valid: least_loaded"):
        make_policy("skew")


def test_dispatcher_backlog_lose_rejoin_reset_and_admit():
    d = Dispatcher()
    assert d.submit([req("p0", 2), req("p1", 2)]) == {}  # nobody to give it to yet
    out = d.generator_joined("g0")
    assert {g: [r.prompt_id for r in rs] for g, rs in out.items()} == {"g0": ["p0", "p1"]}
    out = d.generator_joined("g1")
    assert out == {}
    out = d.submit([req("p2", 2), req("p3", 2)])
    assert {g: [r.prompt_id for r in rs] for g, rs in out.items()} == {"g1": ["p2", "p3"]}
    sample = Sample(
        prompt_id="p0", sample_index=0, token_ids=[], logprobs=[], finish_reason="stop", weight_version=0
    )
    assert d.admit(sample) and not d.admit(sample)
    out = d.lose("g0")  # p0#1 and p1#0..1 go to g1, the only one left
    assert {g: [(r.prompt_id, r.sample_indices) for r in rs] for g, rs in out.items()} == {
        "g1": [("p0", [1]), ("p1", [0, 1])]
    }
    assert d.generators() == ["g1"] and d.outstanding() == 7
    assert d.lose("g1") == {} and d.generators() == []
    out = d.generator_joined("g0")  # back (revived): takes everything
    assert sum(len(r.sample_indices) for r in out["g0"]) == 7
    out = d.generator_reset("g0")  # same id, new process: its work is handed out again (to itself)
    assert sum(len(r.sample_indices) for r in out["g0"]) == 7


def placed(out) -> dict[str, list[tuple[str, list[int]]]]:
    return {g: [(r.prompt_id, r.sample_indices) for r in rs] for g, rs in out.items()}


def test_a_target_is_followed_while_alive_else_the_policy_places_the_request():
    d = Dispatcher()
    for g in ("g0", "g1", "g2"):
        d.generator_joined(g)
    out = d.submit([
        req("a", 2, target="g2", batch_limit=4, priority=1),
        req("b", 2, target="g2", batch_limit=4, priority=0),
        req("c", 1, target="gone"),  # not a member (any more): the policy's choice
        req("d", 1),
    ])  # fmt: skip
    assert placed(out) == {"g2": [("a", [0, 1]), ("b", [0, 1])], "g0": [("c", [0])], "g1": [("d", [0])]}
    assert out["g2"][0].batch_limit == 4 and out["g2"][1].priority == 0
    sample = Sample(prompt_id="a", sample_index=0, token_ids=[], logprobs=[], finish_reason="stop",
                    weight_version=0)  # fmt: skip
    assert d.admit(sample)
    out = d.lose("g2")  # its undelivered work goes by load, with its limit and priority kept
    assert placed(out) == {"g0": [("a", [1])], "g1": [("b", [0, 1])]}
    assert out["g0"][0].target == "g2" and out["g0"][0].batch_limit == 4 and out["g0"][0].priority == 1
    out = d.generator_reset("g0")  # same id, new process: what it owed comes back to it
    assert placed(out)["g0"] == [("a", [1]), ("c", [0])]


def test_new_request_fields_are_appended_so_older_peers_still_decode():
    class OldRequest(msgspec.Struct, array_like=True, kw_only=True):  # the wire format before them
        prompt_id: str
        prompt_token_ids: list[int]
        sample_indices: list[int]
        group_id: str = ""
        priority: int = 0
        sampling: Sampling | None = None

    old = decode_request(
        encode(OldRequest(prompt_id="p", prompt_token_ids=[1], sample_indices=[0], priority=3))
    )
    assert (old.priority, old.batch_limit, old.target) == (3, 0, "")
    new = req("p", 2, target="generator-1", batch_limit=8)
    assert decode_request(encode(new)) == new
