"""What a request's sampling carries: the recipe's sampling keys as one typed
:class:`~streamrl_cli.transport.wire.Sampling`, built here and nowhere else, and per-request seeds
(train.reproducible_sampling, and every evaluation request)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import xxhash

from streamrl_cli.transport.wire import Sampling

if TYPE_CHECKING:
    from streamrl_cli.recipe.schema import AlgorithmConfig


def request_sampling(a: AlgorithmConfig, max_tokens: int, *, seed: int | None = None) -> Sampling:
    """The sampling of a request under the recipe's `algorithm` section (every value the schema's or
    the recipe's); overrides (evaluation's temperature, a resumed sample's budget) go through
    ``msgspec.structs.replace``."""
    return Sampling(
        temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, min_p=a.min_p, max_tokens=max_tokens,
        stop=[str(x) for x in a.stop], seed=seed,
    )  # fmt: skip


def sample_seed(seed: int, prompt_id: str, index: int) -> int:
    """The sampling seed of a request whose first sample is `index` (train.reproducible_sampling).

    vLLM seeds the k-th sample of a request with n > 1 by ``seed + k``, so sample k of a prompt
    always gets base + k, whether it is generated with its group or alone (a re-dispatch).
    """
    base = xxhash.xxh64_intdigest(f"{seed}/{prompt_id}".encode()) >> 16  # 48 bits: room to add indices
    return base + index
