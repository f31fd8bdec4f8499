"""The generator's admission queue: exact LPT / FIFO order and the per-instance batch size.

The queue alone (pure), then the generator role's wiring of it (`_receive` → admission →
`_incoming` → engine → `_deliver` frees the place) with a fake engine whose requests take a time
proportional to their max_tokens. tests/e2e/test_skew_lpt.py does the same on the real vLLM engine.
"""

from __future__ import annotations

import asyncio
import random
import threading

import pytest
from support.admission import FakeEngine, FakeSender, drive_role, requests_for, role_spec  # noqa: F401

from streamrl_cli.generator.admission import Admission
from streamrl_cli.skew.dispatch_plan import lpt_priorities


def test_lpt_admits_by_priority_and_the_next_one_whenever_one_finishes():
    q: Admission[str] = Admission()
    lengths = {"a": 30, "b": 90, "c": 10, "d": 60, "e": 50}
    prio = dict(zip(lengths, lpt_priorities(list(lengths.values())), strict=True))
    for k in lengths:
        q.add(k, k, priority=prio[k], limit=2)
    assert q.ready() == ["b", "d"] and q.running == 2 and q.waiting == 3
    assert q.ready() == []
    q.finish("d")
    assert q.ready() == ["e"]
    q.finish("b")
    q.finish("e")
    assert q.ready() == ["a", "c"]
    q.finish("a")
    q.finish("c")
    assert q.running == 0 and q.waiting == 0


def test_equal_priorities_are_first_in_first_out():
    q: Admission[int] = Admission()
    for i in [3, 1, 4, 0, 2]:
        q.add(str(i), i, limit=3)
    assert q.ready() == [3, 1, 4]
    q.finish("1")
    assert q.ready() == [0]


def test_groups_count_their_sequences_and_nothing_jumps_a_head_that_does_not_fit():
    q: Admission[str] = Admission()
    q.add("g4", "g4", size=4, priority=0, limit=6)
    q.add("g3", "g3", size=3, priority=1, limit=6)
    q.add("g1", "g1", size=1, priority=2, limit=6)  # would fit beside g4, but g3 is ahead of it
    assert q.ready() == ["g4"] and q.running == 4
    q.finish("g4")
    assert q.ready() == ["g3", "g1"] and q.running == 4
    q.finish("g3")
    q.finish("g1")
    q.add("big", "big", size=8, limit=6)  # larger than the limit: runs, alone
    q.add("next", "next", size=1, limit=6)
    assert q.ready() == ["big"]
    q.finish("big")
    assert q.ready() == ["next"]


def test_no_limit_admits_everything_and_bad_calls_raise():
    q: Admission[int] = Admission()
    for i in range(50):
        q.add(str(i), i, size=4, priority=-i)
    assert q.ready() == list(range(49, -1, -1)) and q.running == 200
    with pytest.raises(KeyError, match="not running"):
        q.finish("nope")
    with pytest.raises(ValueError, match="size must be ≥ 1"):
        q.add("x", 0, size=0)
    q.add("0", 0)
    with pytest.raises(ValueError, match="already running"):
        q.ready()


def test_random_interleavings_keep_the_limit_and_the_order():
    rng = random.Random(0)
    for _ in range(200):
        q: Admission[tuple[int, int, int]] = Admission()
        limit, waiting, running = rng.randint(1, 6), [], {}  # running: key -> size
        for serial in range(60):
            if rng.random() < 0.5 or not running:
                size, prio = rng.randint(1, 3), rng.randint(0, 4)
                q.add(str(serial), (prio, serial, size), size=size, priority=prio, limit=limit)
                waiting.append((prio, serial, size))
            else:
                key = rng.choice(sorted(running))
                q.finish(key)
                del running[key]
            waiting.sort()
            got = q.ready()
            assert got == waiting[: len(got)]  # the best waiting ones, best first
            del waiting[: len(got)]
            running.update((str(s), size) for _, s, size in got)
            assert q.running == sum(running.values()) and q.waiting == len(waiting)
            assert q.running <= limit or len(running) == 1
            if waiting:  # the head left behind does not fit
                assert q.running + waiting[0][2] > limit


# ---- the generator role's wiring, with a fake engine ----


@pytest.mark.parametrize("lpt", [True, False])
def test_role_admits_in_order_within_the_batch_limit(lpt):
    lengths = [40, 100, 20, 80, 60, 30, 90]
    engine = FakeEngine()
    reqs = requests_for(lengths, lpt=lpt, limit=4, n=2)
    samples = asyncio.run(drive_role(engine, reqs))
    order = sorted(lengths, reverse=True) if lpt else lengths
    assert engine.started == [f"p{lengths.index(x)}-len{x}" for x in order]
    assert engine.peak == 4  # two groups of two at a time, never more
    assert sorted((s.prompt_id, s.sample_index) for s in samples) == sorted(
        (r.prompt_id, i) for r in reqs for i in (0, 1)
    )


@pytest.mark.parametrize("window", [1000, 1])
def test_the_role_sends_on_its_loop_when_the_window_has_room_and_from_a_thread_when_not(window):
    reqs = requests_for([20, 30], lpt=False, limit=0, n=2)  # groups of two samples
    sender = FakeSender(reqs, window=window)
    samples = asyncio.run(drive_role(FakeEngine(), reqs, sender=sender))
    assert len(samples) == 4
    on_loop = sender.threads == {threading.main_thread().name}
    assert on_loop == (window >= 2)  # a window too small for a group: send() may block, so not on the loop
