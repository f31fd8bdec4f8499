"""What a request's sampling carries besides temperature: the recipe's other sampling keys, and
per-request seeds (train.reproducible_sampling, and every evaluation request)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import xxhash

if TYPE_CHECKING:
    from streamrl_cli.recipe.schema import AlgorithmConfig


def sampling_keys(a: AlgorithmConfig) -> dict[str, Any]:
    """The recipe's sampling keys beyond temperature that differ from "off", as requests carry them."""
    out: dict[str, Any] = {}
    if a.top_k > 0:
        out["top_k"] = a.top_k
    if a.top_p < 1.0:
        out["top_p"] = a.top_p
    if a.min_p > 0.0:
        out["min_p"] = a.min_p
    if a.stop:
        out["stop"] = [str(x) for x in a.stop]
    return out


def sample_seed(seed: int, prompt_id: str, index: int) -> int:
    """The sampling seed of a request whose first sample is `index` (train.reproducible_sampling).

    vLLM seeds the k-th sample of a request with n > 1 by ``seed + k``, so sample k of a prompt
    always gets base + k, whether it is generated with its group or alone (a re-dispatch).
    """
    base = xxhash.xxh64_intdigest(f"{seed}/{prompt_id}".encode()) >> 16  # 48 bits: room to add indices
    return base + index
