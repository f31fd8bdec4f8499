"""Samples and a drain for the sample-stream tests."""

from __future__ import annotations

import time

from streamrl_cli.transport.wire import Sample

TOKEN = "test-token-0123456789abcdef"


def sample(pid: str, i: int, n_tokens: int = 8) -> Sample:
    return Sample(
        prompt_id=pid,
        sample_index=i,
        group_id=pid,
        token_ids=list(range(n_tokens)),
        logprobs=[-0.5] * n_tokens,
        finish_reason="stop",
        weight_version=3,
        queued_at=1.0,
        first_token_at=2.0,
        finished_at=3.0,
    )


def drain(receiver, want: int, timeout: float = 20.0) -> list[Sample]:
    got, deadline = [], time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        s = receiver.get(timeout=0.2)
        if s is not None:
            got.append(s)
    return got


def delivers(cfg, receiver, prompt_id: str, generator: str = "generator-0") -> bool:
    """Whether a well-behaved generator's sample still reaches ``receiver`` (after whatever a test threw
    at it): a new sender sends one sample, which must be the one drained."""
    from streamrl_cli.transport.samples import make_sender

    good = make_sender(cfg, address=receiver.address, token=TOKEN, generator=generator)
    try:
        good.send(sample(prompt_id, 0))
        return [x.key for x in drain(receiver, 1)] == [(prompt_id, 0)]
    finally:
        good.close()
