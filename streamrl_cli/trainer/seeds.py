"""Per-request sampling seeds (train.reproducible_sampling, and every evaluation request)."""

from __future__ import annotations

import xxhash


def sample_seed(seed: int, prompt_id: str, index: int) -> int:
    """The sampling seed of a request whose first sample is `index` (train.reproducible_sampling).

    vLLM seeds the k-th sample of a request with n > 1 by ``seed + k``, so sample k of a prompt
    always gets base + k, whether it is generated with its group or alone (a re-dispatch).
    """
    base = xxhash.xxh64_intdigest(f"{seed}/{prompt_id}".encode()) >> 16  # 48 bits: room to add indices
    return base + index
