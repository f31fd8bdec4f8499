"""A fake engine and a driver for the generator role's admission path (no vLLM)."""

from __future__ import annotations

import asyncio
import threading
import time

from streamrl_cli.generator.engine import Completion, EngineHealth, GenerationResult
from streamrl_cli.generator.main import GeneratorRole
from streamrl_cli.recipe.schema import GeneratorConfig, ModelConfig, TaskConfig, TrainConfig
from streamrl_cli.roles.spec import GeneratorSpec
from streamrl_cli.skew.dispatch_plan import lpt_priorities
from streamrl_cli.transport.samples import SampleSender
from streamrl_cli.transport.wire import Request
from support.configs import sampling as make_sampling


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
            sampling=make_sampling(max_tokens=length, temperature=0.0, ignore_eos=True),
            batch_limit=limit,
        )  # fmt: skip
        for i, length in enumerate(lengths)
    ]
