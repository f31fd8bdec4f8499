"""`generator.engine.each_its_own_task`: the request loop the vLLM engine and the agent engine share.

Each request runs in a task of its own (a slow one never holds up the next), results come out as
they finish, the first error reaches the consumer, and a consumer that leaves cancels what is still
running (which makes an engine abort those requests).
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from streamrl_cli.generator.engine import GenerationRequest, GenerationResult, SamplingSpec, each_its_own_task


def request(rid: str) -> GenerationRequest:
    return GenerationRequest(request_id=rid, prompt_token_ids=[1], sampling=SamplingSpec(n=1, max_tokens=1))


def result(req: GenerationRequest) -> GenerationResult:
    return GenerationResult(
        request_id=req.request_id, prompt_token_ids=[1], completions=[], weight_version=0,
        weight_version_end=0, priority=0, queued_at=0.0, first_token_at=0.0, finished_at=0.0,
    )  # fmt: skip


def test_results_come_as_they_finish_and_a_slow_request_holds_up_no_other():
    async def go():
        release = asyncio.Event()

        async def run(req):
            if req.request_id == "slow":
                await release.wait()  # finishes only once the fast ones came out
            return result(req)

        out = []
        async for r in each_its_own_task([request("slow"), request("a"), request("b")], run):
            out.append(r.request_id)
            if len(out) == 2:
                release.set()
        return out

    assert asyncio.run(go()) == ["a", "b", "slow"]


def test_an_async_source_and_its_error_reach_the_consumer():
    async def go():
        async def source():
            yield request("a")
            raise ValueError("the source broke")

        async def run(req):
            return result(req)

        return [r.request_id async for r in each_its_own_task(source(), run)]

    with pytest.raises(ValueError, match="the source broke"):
        asyncio.run(go())


def test_a_failed_request_fails_the_stream_and_a_leaving_consumer_cancels_the_rest():
    cancelled: list[str] = []

    async def go():
        async def run(req):
            if req.request_id == "bad":
                raise RuntimeError("engine said no")
            try:
                await asyncio.Event().wait()  # never finishes by itself
            except asyncio.CancelledError:
                cancelled.append(req.request_id)
                raise

        stream = each_its_own_task([request("a"), request("bad"), request("b")], run)
        async with contextlib.aclosing(stream) as out:
            async for _ in out:
                pass

    with pytest.raises(RuntimeError, match="engine said no"):
        asyncio.run(go())
    assert sorted(cancelled) == ["a", "b"]


def test_an_error_put_from_outside_fails_the_stream_at_once():
    """The agent engine's inner stream failing: every episode fails with it, not one at a time."""

    async def go():
        results: asyncio.Queue = asyncio.Queue()

        async def run(req):
            await asyncio.Event().wait()

        async def fail_soon():
            await asyncio.sleep(0)
            await results.put(ConnectionError("the inner engine died"))

        task = asyncio.create_task(fail_soon())
        try:
            return [r async for r in each_its_own_task([request("a")], run, results)]
        finally:
            await task

    with pytest.raises(ConnectionError, match="the inner engine died"):
        asyncio.run(go())
