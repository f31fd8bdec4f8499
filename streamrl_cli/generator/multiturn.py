"""Multi-turn rollouts behind the same engine interface: a request's samples become trajectories.

:class:`AgentEngine` wraps the generator's inference engine. The generator role, its admission
queue, the sample stream, weight updates, cancellation and partial rollout see an ordinary
engine: a request of ``n`` samples goes in, one finished group comes out. Inside, each sample is an
episode: the environment's reset (in a worker process, :mod:`.env_host`, or on one of the run's
environment servers, :mod:`streamrl_cli.envserver`), then model turns (one
engine request each, on the prompt and every token so far) and environment turns (the
environment's answer rendered on its own, :mod:`.render`) until the environment is done or a budget
ends it (:mod:`.trajectory`). The completion is the trajectory: its token ids (model and
environment), behaviour log-probs (0 on environment tokens), loss mask, the weight version of
each token, and an episode record (turns, tool calls and errors, environment reward and time, why
it ended).

Turns of one episode may run under different weight versions (an update between turns): each
token keeps the version that sampled it, as partial rollout's tokens do, so staleness bounds and
importance ratios stay per token. An aborted request (over-sampling, the trainer going) aborts the
turn in flight and ends its episodes. A request the trainer *pauses* (partial rollout) is ended
between turns instead: each episode finishes the model turn in flight, comes back as far as it got
(``parked``), and is kept here, its environment session and tokens, so that a request that resumes
it (``meta["resume"]``, on this generator) goes on from its next turn and sends it whole. One
resumed elsewhere, or given up here (at most ``max_parked`` are kept, the oldest given up first),
runs from its start.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import time
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from typing import Any

from streamrl_cli.agent.env_host import EnvFailure, EnvHost, EnvSettings
from streamrl_cli.agent.render import Renderer
from streamrl_cli.agent.trajectory import ABORTED, DONE, MAX_TOKENS, MAX_TURNS, Trajectory
from streamrl_cli.envserver.client import RemoteEnvHost
from streamrl_cli.generator.engine import (
    Completion,
    EngineHealth,
    GenerationEngine,
    GenerationRequest,
    GenerationResult,
    WeightSource,
    each_its_own_task,
)


def turn_seed(seed: int | None, index: int, turn: int) -> int | None:
    """The sampling seed of one turn of one sample (a request's seed is per group: its samples, run
    as separate engine requests here, must not share it)."""
    if seed is None:
        return None
    digest = hashlib.blake2b(f"{seed}/{index}/{turn}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def finish_reason(t: Trajectory) -> str:
    if t.stop == ABORTED:
        return "abort"
    return "length" if t.stop == MAX_TOKENS else "stop"


def episode_record(t: Trajectory) -> dict[str, Any]:
    """What the trainer's metrics and `streamrl status` report of one trajectory."""
    return {
        "turns": t.turns, "turns_cut": t.turns_cut, "tool_calls": t.tool_calls, "tool_errors": t.tool_errors,
        "env_reward": t.env_reward, "env_s": round(t.env_s, 4), "stop": t.stop, "error": t.error[:500],
        "model_tokens": t.model_tokens, "env_tokens": t.env_tokens, "parked": t.parked,
        "resumed": t.resumed,
    }  # fmt: skip


@dataclasses.dataclass
class Parked:
    """A trajectory paused between turns: what it takes to go on with it."""

    trajectory: Trajectory
    session: Any  # its environment (env_host.Session)
    turn: list[int] | None  # its last model turn, not yet answered by the environment (None: answered)


def park_key(meta: dict[str, Any], index: int) -> str:
    """The key of a request's `index`-th trajectory: its prompt id and sample index, as the
    trainer names the paused sample (Request.resume)."""
    return f"{meta.get('prompt_id', '')}/{list(meta.get('sample_indices') or [index])[index]}"


class AgentEngine(GenerationEngine):
    """An engine whose samples are multi-turn trajectories with an environment and tools."""

    def __init__(
        self,
        inner: GenerationEngine,
        settings: EnvSettings,
        *,
        host: EnvHost | RemoteEnvHost | None = None,
        model_path: str,
        max_turns: int,
        max_turn_tokens: int,
        chat_template: str | None = None,
        max_parked: int = 256,
    ):
        self.inner = inner
        self.settings = settings
        self.host = host if host is not None else EnvHost(settings)  # or the run's environment servers
        self.model_path = model_path
        self.tokenizer: Any = None
        self.chat_template = chat_template
        self.max_turns = max_turns
        self.max_turn_tokens = max_turn_tokens
        self.renderer: Renderer | None = None
        self._waiting: dict[str, asyncio.Future] = {}  # turn request id -> its result
        self._turns: dict[str, set[str]] = {}  # request id -> its turns in the engine
        self._aborted: set[str] = set()
        self._pausing: set[str] = set()  # aborted requests the trainer pauses: their episodes park
        # Paused trajectories by park_key, oldest first; bounded: one the trainer restarts instead
        # (too stale) or never resumes must not hold its environment for ever.
        self.parked: dict[str, Parked] = {}
        self.max_parked = max_parked
        self._closing: set[asyncio.Task] = set()  # sessions of trajectories given up, closing
        self._subq: asyncio.Queue[GenerationRequest | None] | None = None

    # The generator role reads and sets these on its engine.
    @property
    def weight_version(self) -> int:  # type: ignore[override]
        return self.inner.weight_version

    @property
    def weights_intact(self) -> bool:  # type: ignore[override]
        return self.inner.weights_intact

    @property
    def live_swap(self) -> bool:  # type: ignore[override]
        return self.inner.live_swap

    async def start(self) -> None:
        from transformers import AutoTokenizer

        from streamrl_cli.agent.tools import load_tool, template_format, unreadable

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        schemas = [load_tool(spec).schema for spec in self.settings.tools]
        if self.chat_template is not None:
            self.tokenizer.chat_template = self.chat_template
        self.renderer = Renderer(self.tokenizer, tools=schemas)
        if schemas:  # the syntax the environment's workers read calls in (the recipe's, or the template's)
            fmt = self.settings.tool_format or template_format(self.tokenizer.chat_template)
            if fmt is None:
                from streamrl_cli.agent.env_host import AgentError

                raise AgentError(unreadable("the model's chat template"))
            self.settings.tool_format = fmt
        await self.host.start()  # the environment loads here, or the generator fails saying why
        await self.inner.start()

    def generate(
        self, requests: AsyncIterable[GenerationRequest] | Iterable[GenerationRequest]
    ) -> AsyncIterator[GenerationResult]:
        return self._generate(requests)

    async def _generate(
        self, requests: AsyncIterable[GenerationRequest] | Iterable[GenerationRequest]
    ) -> AsyncIterator[GenerationResult]:
        subq: asyncio.Queue[GenerationRequest | None] = asyncio.Queue()
        self._subq = subq
        results: asyncio.Queue[GenerationResult | BaseException | None] = asyncio.Queue()

        async def turns() -> AsyncIterator[GenerationRequest]:
            while (req := await subq.get()) is not None:
                yield req

        async def pump() -> None:
            """Every turn of every episode through the inner engine's one stream; its failure fails
            every episode waiting on it and the whole stream at once (not one episode at a time)."""
            try:
                async for res in self.inner.generate(turns()):
                    fut = self._waiting.pop(res.request_id, None)
                    if fut is not None and not fut.done():
                        fut.set_result(res)
            except BaseException as e:  # noqa: BLE001 - the engine failed: so does every episode
                for fut in self._waiting.values():
                    if not fut.done():
                        fut.set_exception(e)
                await results.put(e)

        pumper = asyncio.create_task(pump())
        try:
            async with contextlib.aclosing(each_its_own_task(requests, self._run, results)) as out:
                async for result in out:
                    yield result
        finally:
            await subq.put(None)
            pumper.cancel()
            with contextlib.suppress(BaseException):
                await pumper

    async def _run(self, req: GenerationRequest) -> GenerationResult:
        queued = time.time()
        self._turns[req.request_id] = set()  # known from now on: an abort finds it between turns
        try:
            trajectories = await asyncio.gather(*(self._episode(req, i) for i in range(req.sampling.n)))
        finally:
            self._aborted.discard(req.request_id)
            self._pausing.discard(req.request_id)
            self._turns.pop(req.request_id, None)
        versions = [v for t in trajectories if t.model_tokens for v in t.token_versions] or [
            self.weight_version
        ]
        completions = []
        for i, t in enumerate(trajectories):
            per_token = t.token_versions
            completions.append(
                Completion(
                    index=i,
                    # Copies: a parked trajectory grows on when it is resumed.
                    token_ids=list(t.token_ids),
                    logprobs=list(t.logprobs),
                    finish_reason=finish_reason(t),
                    loss_mask=list(t.loss_mask),
                    token_versions=per_token if len(set(per_token)) > 1 else [],
                    episode=episode_record(t),
                )  # fmt: skip
            )
        return GenerationResult(
            request_id=req.request_id, prompt_token_ids=list(req.prompt_token_ids or []),
            completions=completions, weight_version=min(versions), weight_version_end=max(versions),
            priority=req.priority, queued_at=queued, first_token_at=queued, finished_at=time.time(),
            meta=req.meta,
        )  # fmt: skip

    async def _episode(self, req: GenerationRequest, index: int) -> Trajectory:
        assert self.renderer is not None, "start() first"
        kept = self.parked.pop(str(req.meta.get("resume") or ""), None) if index == 0 else None
        if kept is not None:  # a paused trajectory goes on from its next turn
            t, session, last = kept.trajectory, kept.session, kept.turn
            t.go_on()
        else:
            t, session, last = Trajectory(max_tokens=req.sampling.max_tokens), None, None
        park = False
        try:
            if session is None:
                session = await self.host.open()
                t0 = time.monotonic()
                first = await session.reset(dict(req.meta.get("env") or {}))
                t.env_s += time.monotonic() - t0
                opening = self.renderer.first_turn(first)
                if not t.fits(opening):
                    t.end(MAX_TOKENS)
                else:
                    t.add_env_turn(opening)
            while not t.stop:
                if last is not None:  # the environment answers the model's turn
                    await self._answer(session, t, last)
                    last = None
                    continue
                if req.request_id in self._aborted:
                    park = req.request_id in self._pausing
                    t.end(ABORTED)
                    break
                budget = min(self.max_turn_tokens, t.room)
                result = await self._turn(req, index, t, budget)
                c = result.completions[0]
                if c.token_ids:
                    t.add_model_turn(list(c.token_ids), list(c.logprobs), result.weight_version)
                if c.finish_reason == "length":
                    t.turns_cut += 1
                if c.finish_reason == "abort" or req.request_id in self._aborted:
                    # Paused: the turn was let finish (an aborted one is cut: that trajectory restarts).
                    park = req.request_id in self._pausing and c.finish_reason != "abort"
                    last = list(c.token_ids) if park else None
                    t.end(ABORTED)
                    break
                if c.finish_reason == "error":
                    raise EnvFailure("env_error", f"the engine refused a turn: {result.error}")
                last = list(c.token_ids)
        except EnvFailure as e:
            t.end(e.reason, e.detail)
            park = False
        finally:
            if park and session is not None:
                t.parked = True
                self._park(park_key(req.meta, index), Parked(t, session, last))
            elif session is not None:
                await session.close()
        return t

    async def _answer(self, session: Any, t: Trajectory, turn: list[int]) -> None:
        """The environment's step on a model turn, and its answer appended (or the trajectory ended)."""
        assert self.renderer is not None
        t0 = time.monotonic()
        step = await session.step(self.renderer.text(turn))
        t.env_s += time.monotonic() - t0
        t.env_reward += step.reward
        t.tool_calls += step.tool_calls
        t.tool_errors += step.tool_errors
        if step.done:
            t.end(DONE)
        elif t.turns >= self.max_turns:
            t.end(MAX_TURNS)
        else:
            answer = self.renderer.env_turn(step.observation, turn)
            if t.fits(answer):
                t.add_env_turn(answer)
            else:
                t.end(MAX_TOKENS)

    def _park(self, key: str, parked: Parked) -> None:
        self.parked[key] = parked
        while len(self.parked) > self.max_parked:  # the oldest is given up: resumed, it restarts
            oldest = self.parked.pop(next(iter(self.parked)))
            task = asyncio.get_running_loop().create_task(oldest.session.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def _turn(self, req: GenerationRequest, index: int, t: Trajectory, budget: int) -> GenerationResult:
        assert self._subq is not None and self.renderer is not None
        s = req.sampling
        sampling = dataclasses.replace(
            s, n=1, max_tokens=budget, seed=turn_seed(s.seed, index, t.turns),
            stop_token_ids=sorted({*s.stop_token_ids, *self.renderer.turn_end_ids}),
        )  # fmt: skip
        rid = f"{req.request_id}/{index}/t{t.turns}"
        sub = GenerationRequest(
            request_id=rid, prompt_token_ids=[*(req.prompt_token_ids or []), *t.token_ids],
            sampling=sampling, priority=req.priority,
        )  # fmt: skip
        fut = asyncio.get_running_loop().create_future()
        self._waiting[rid] = fut
        running = self._turns.setdefault(req.request_id, set())  # (gone: aborted and cleaned up)
        running.add(rid)
        await self._subq.put(sub)
        try:
            return await fut
        finally:
            running.discard(rid)
            self._waiting.pop(rid, None)

    def stats(self) -> dict[str, Any]:
        """The environment processes' (or servers') totals since start, for the generator's metrics."""
        return self.host.stats()

    async def pause_requests(self, request_ids: Iterable[str]) -> None:
        """End these requests between turns: each episode's turn in flight finishes, and the
        episode is parked (its environment kept) for a request that resumes it."""
        for rid in request_ids:
            if rid in self._turns:
                self._pausing.add(rid)
                self._aborted.add(rid)

    async def abort(self, request_ids: Iterable[str]) -> None:
        turns = []
        for rid in request_ids:
            if rid in self._turns:
                self._aborted.add(rid)
                turns += list(self._turns[rid])
        if turns:
            await self.inner.abort(turns)

    async def update_weights(self, version: int, source: WeightSource, *, mode: str = "wait") -> dict:
        return await self.inner.update_weights(version, source, mode=mode)

    async def pause(self, mode: str = "keep") -> None:
        await self.inner.pause(mode)

    async def resume(self) -> None:
        await self.inner.resume()

    async def health(self) -> EngineHealth:
        return await self.inner.health()

    async def close(self) -> None:
        parked, self.parked = list(self.parked.values()), {}
        try:
            # (the workers go next, whatever a session's release said)
            closing = [*self._closing, *(p.session.close() for p in parked)]
            await asyncio.gather(*closing, return_exceptions=True)
            await self.host.close()
        finally:
            await self.inner.close()

    def __getattr__(self, name: str) -> Any:  # engine-specific extras (collective_rpc, load_weights)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


def wrap(inner: GenerationEngine, spec: Any) -> GenerationEngine:
    """The generator's engine for its recipe: `inner` itself, or multi-turn around it (agent.*)."""
    import os

    a, task = spec.agent, spec.task
    if not a.enabled:
        return inner
    template = None
    if task.chat_template not in (None, "tokenizer"):  # the task's own template renders the turns too
        from streamrl_cli.tasks.datasets import ChatFormat

        template = ChatFormat(template=task.chat_template)._template_text()
    settings = EnvSettings(
        env=a.env, env_args=dict(a.env_args), tools=list(a.tools), tool_format=a.tool_format,
        workers=a.env_workers, timeout_s=a.step_timeout_s,
    )  # fmt: skip
    host = None
    if spec.env_servers > 0:  # the run's environment servers host them, found through the rendezvous
        host = RemoteEnvHost(
            settings, run_dir=spec.run_dir, tls_ca=spec.rendezvous_ca, no_server_s=spec.train.stall_after_s
        )
    return AgentEngine(
        inner, settings, host=host, model_path=os.path.expanduser(spec.model.path), max_turns=a.max_turns,
        max_turn_tokens=a.max_turn_tokens or task.max_output_len, chat_template=template,
    )  # fmt: skip
