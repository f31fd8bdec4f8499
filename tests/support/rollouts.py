"""Rollouts of random tokens for the trainer's forward and loss tests."""

from __future__ import annotations

import random

from streamrl_cli.trainer.loop.batch import Rollout
from streamrl_cli.transport.wire import Sample


def random_rollouts(n: int, seed: int, *, scored: bool = False) -> list[Rollout]:
    """`n` rows of uneven lengths (collate right-pads them, `Packed` packs them): 2-14 response and 2-9
    prompt tokens below id 400. `scored`: a random reward and advantage each (else 0)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        resp = [rng.randrange(1, 400) for _ in range(rng.randint(2, 14))]
        sample = Sample(
            prompt_id=f"p{i}", sample_index=0, token_ids=resp, logprobs=[-1.0] * len(resp),
            finish_reason="stop", weight_version=0,
        )  # fmt: skip
        prompt = [rng.randrange(1, 400) for _ in range(rng.randint(2, 9))]
        reward, advantage = (rng.random(), rng.gauss(0, 1)) if scored else (0.0, 0.0)
        out.append(Rollout(prompt_tokens=prompt, sample=sample, reward=reward, advantage=advantage))
    return out
