"""Between the sample stream and the engine: requests in, samples out, and what the generator reports.

Pure functions and a pure meter (times are passed in), so the generator role's bookkeeping is
tested without an engine, a socket or a clock:

* :func:`to_engine_request` turns a dispatched :class:`~streamrl_cli.transport.wire.Request`
  (some or all samples of one prompt) into one engine request with ``n = len(sample_indices)``,
  so a GRPO group is generated together and comes out of the engine as one finished unit;
* :func:`to_samples` turns the finished group back into one wire ``Sample`` per completion,
  mapping the engine's completion index to the sample index the dispatcher asked for (after a
  re-dispatch only the missing indices are asked for);
* :class:`Meter` measures tokens/s, samples/s, queue depth and the idle ratio reported to the
  rendezvous server (what `streamrl status` shows and what elastic scaling will read).
"""

from __future__ import annotations

import dataclasses
import logging

import msgspec

from streamrl_cli.generator.engine import GenerationRequest, GenerationResult, SamplingSpec
from streamrl_cli.transport.wire import Episode, Request, Sample

log = logging.getLogger("streamrl.generator")


def to_engine_request(req: Request, serial: int, scoring: SamplingSpec | None = None) -> GenerationRequest:
    """One engine request for a dispatched request; `serial` keeps ids unique across re-dispatches.
    Sampled as the request says (the trainer built it from the recipe), or by `scoring`, the fixed
    settings of a role that scores rather than samples (a distillation teacher)."""
    if scoring is not None:
        spec = dataclasses.replace(scoring, n=len(req.sample_indices))
    elif req.sampling is None:
        raise ValueError(f"prompt {req.prompt_id}: a request to generate carries no sampling")
    else:
        spec = SamplingSpec(n=len(req.sample_indices), **msgspec.structs.asdict(req.sampling))
    return GenerationRequest(
        request_id=f"{req.prompt_id}#{serial}",  # see prompt_of
        prompt_token_ids=list(req.prompt_token_ids),
        sampling=spec,
        priority=req.priority,
        meta={
            "prompt_id": req.prompt_id,
            "group_id": req.group_id,
            "sample_indices": list(req.sample_indices),
            "env": req.env,
            "resume": req.resume,
        },
    )


def prompt_of(request_id: str) -> str:
    """The dispatched prompt id of an engine request id made by :func:`to_engine_request`."""
    return request_id.rpartition("#")[0]


def to_samples(result: GenerationResult, generator: str) -> list[Sample]:
    """The wire samples of a finished engine request (its completions in sample-index order)."""
    meta = result.meta
    indices = meta["sample_indices"]
    if len(indices) != len(result.completions):
        raise ValueError(
            f"{result.request_id}: {len(result.completions)} completions for sample indices {indices}"
        )
    return [
        Sample(
            prompt_id=meta["prompt_id"],
            sample_index=indices[c.index],
            group_id=meta.get("group_id", ""),
            token_ids=c.token_ids,
            logprobs=c.logprobs,
            finish_reason=c.finish_reason,
            weight_version=result.weight_version,
            generator=generator,
            queued_at=result.queued_at,
            first_token_at=result.first_token_at,
            finished_at=result.finished_at,
            token_versions=c.token_versions,
            loss_mask=c.loss_mask,
            episode=Episode(**c.episode) if c.episode is not None else None,
            routed_experts=c.routed_experts,
        )
        for c in result.completions
    ]


def unstarted_samples(req: GenerationRequest, version: int, generator: str, now: float) -> list[Sample]:
    """A paused request that never reached the engine, as samples with no tokens yet (partial rollout
    resumes them from the start)."""
    meta = req.meta
    return [
        Sample(
            prompt_id=meta["prompt_id"],
            sample_index=i,
            group_id=meta.get("group_id", ""),
            token_ids=[],
            logprobs=[],
            finish_reason="abort",
            weight_version=version,
            generator=generator,
            queued_at=now,
            first_token_at=now,
            finished_at=now,
        )  # fmt: skip
        for i in meta["sample_indices"]
    ]


class Meter:
    """Rates over the window since the last report, plus running totals.

    ``idle_ratio`` is the share of the window with no request in the engine: a generator that
    idles while the trainer is busy is what the elastic scaler and `tune-split` want to know.
    """

    def __init__(self, now: float):
        self.in_flight = 0  # requests in the engine (received, not finished)
        self.totals = {"requests": 0, "samples": 0, "tokens": 0}
        self._start = self._last = now
        self._idle = 0.0
        self._window = {"samples": 0, "tokens": 0}

    def submitted(self, now: float) -> None:
        self._advance(now)
        self.in_flight += 1
        self.totals["requests"] += 1

    def finished(self, now: float, samples: int, tokens: int) -> None:
        self._advance(now)
        if self.in_flight <= 0:
            raise ValueError("finished() without a matching submitted()")
        self.in_flight -= 1
        for d in (self.totals, self._window):
            d["samples"] += samples
            d["tokens"] += tokens

    def report(self, now: float) -> dict[str, float | int]:
        """The window's rates (and reset the window); totals keep counting."""
        self._advance(now)
        span = max(now - self._start, 1e-9)
        out = {
            "tokens_per_s": round(self._window["tokens"] / span, 3),
            "samples_per_s": round(self._window["samples"] / span, 3),
            "queue_depth": self.in_flight,
            "idle_ratio": round(min(1.0, self._idle / span), 4),
            "window_s": round(span, 3),
            **{f"total_{k}": v for k, v in self.totals.items()},
        }
        self._start, self._idle = now, 0.0
        self._window = {"samples": 0, "tokens": 0}
        return out

    def _advance(self, now: float) -> None:
        if self.in_flight == 0:
            self._idle += max(0.0, now - self._last)
        self._last = max(self._last, now)
