"""The generator's admission queue: exact LPT / FIFO order and the per-instance batch size.

The queue alone (pure), then the generator role's wiring of it (`_receive` → admission →
`_incoming` → engine → `_deliver` frees the place) with a fake engine whose requests take a time
proportional to their max_tokens. tests/test_skew_lpt.py does the same on the real vLLM engine.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

from streamrl_cli.generator.admission import Admission
from streamrl_cli.generator.engine import Completion, EngineHealth, GenerationResult
from streamrl_cli.generator.main import GeneratorRole
from streamrl_cli.recipe.schema import GeneratorConfig, ModelConfig, TaskConfig, TrainConfig
from streamrl_cli.roles.spec import GeneratorSpec
from streamrl_cli.skew.dispatch import lpt_priorities
from streamrl_cli.transport.samples import SampleSender
from streamrl_cli.transport.wire import Request


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


def role_spec() -> GeneratorSpec:
    return GeneratorSpec(
        run_name="t", run_dir="/tmp/none", role="generator", cluster="local", site="local", world=2,
        expected={"trainer": 1, "generator": 1}, program="streamrl_cli.generator.main:main",
        weight_transport="broadcast", rendezvous_file="/tmp/none/rendezvous.json",
        secret_file="/tmp/none/secret",
        settings=GeneratorConfig(cluster="local", engine="vllm", gpus_per_instance=0),
        model=ModelConfig(name="m", path="/tmp/none/m"),
        task=TaskConfig(name="builtin", max_prompt_len=64, max_output_len=128), train=TrainConfig(seed=0),
    )  # fmt: skip


class FakeSender(SampleSender):
    """The sample sender as the role sees it: one batch of requests, then nothing; samples recorded.
    With `window`, send() takes that many before the role must wait in a thread (back-pressure)."""

    def __init__(self, requests: list[Request], window: int = 0):
        self._requests, self.sent, self.window = list(requests), [], window
        self.threads: set[str] = set()  # the threads send() was called on

    def requests(self, timeout: float) -> list[Request]:
        out, self._requests = self._requests, []
        if not out:
            time.sleep(min(timeout, 0.02))
        return out

    def room(self) -> int:
        return self.window

    def send(self, sample, timeout=None) -> None:
        self.threads.add(threading.current_thread().name)
        self.sent.append(sample)

    def close(self, flush_timeout: float = 5.0) -> None:
        pass


async def drive_role(engine, requests: list[Request], timeout: float = 120.0, sender=None) -> list:
    """Run the role's receive → admission → engine → deliver path until every sample is sent."""
    role = GeneratorRole(role_spec(), 0, engine=engine)
    role.sender = sender or FakeSender(requests, window=1000)
    role._serving.set()  # what connecting the sample stream does
    want = sum(len(r.sample_indices) for r in requests)
    tasks = [asyncio.create_task(role._receive()), asyncio.create_task(role._deliver())]
    try:
        deadline = time.monotonic() + timeout
        while len(role.sender.sent) < want:
            assert time.monotonic() < deadline, f"{len(role.sender.sent)} of {want} samples"
            for t in tasks:
                if t.done():
                    t.result()  # raises what killed it
            await asyncio.sleep(0.01)
    finally:
        role._stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert role.admission.running == 0 and role.admission.waiting == 0
    return role.sender.sent


class FakeEngine:
    """Each request takes max_tokens milliseconds; records start order and concurrency."""

    weight_version = 0

    def __init__(self) -> None:
        self.started: list[str] = []
        self.running = self.peak = 0

    async def health(self) -> EngineHealth:
        return EngineHealth(ok=True, weight_version=self.weight_version, running=self.running, paused=False)

    async def generate(self, requests):
        results: asyncio.Queue = asyncio.Queue()
        pending = set()

        async def one(req) -> None:
            n = req.sampling.n
            self.started.append(req.meta["prompt_id"])
            self.running += n
            self.peak = max(self.peak, self.running)
            start = time.time()
            await asyncio.sleep(req.sampling.max_tokens / 1000)
            self.running -= n
            tokens = [7] * req.sampling.max_tokens
            completions = [Completion(index=i, token_ids=tokens, logprobs=[-1.0] * len(tokens),
                                      finish_reason="length") for i in range(n)]  # fmt: skip
            await results.put(GenerationResult(
                request_id=req.request_id, prompt_token_ids=req.prompt_token_ids, completions=completions,
                weight_version=0, weight_version_end=0, priority=req.priority, queued_at=start,
                first_token_at=start, finished_at=time.time(), meta=req.meta,
            ))  # fmt: skip

        async def feed() -> None:
            async for req in requests:
                t = asyncio.create_task(one(req))
                pending.add(t)
                t.add_done_callback(pending.discard)

        feeder = asyncio.create_task(feed())
        try:
            while True:
                yield await results.get()
        finally:
            feeder.cancel()
            for t in list(pending):
                t.cancel()


def requests_for(lengths: list[int], *, lpt: bool, limit: int, n: int = 1) -> list[Request]:
    prio = lpt_priorities(lengths) if lpt else [0] * len(lengths)
    return [
        Request(
            prompt_id=f"p{i}-len{length}",
            prompt_token_ids=[1, 2, 3],
            sample_indices=list(range(n)),
            priority=prio[i],
            sampling={"max_tokens": length, "temperature": 0.0, "ignore_eos": True},
            batch_limit=limit,
        )  # fmt: skip
        for i, length in enumerate(lengths)
    ]


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
