"""Weights and settings shared by the cross-site relay tests."""

from __future__ import annotations

import torch

TOKEN = "relay-test-token-0123456789"


CHUNK = 64 << 10


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(300, 128, generator=g),  # 150 KiB: spans chunks
        "layer.0.w": torch.randn(256, 256, generator=g).to(torch.bfloat16),
        "layer.0.b": torch.randn(7, generator=g),  # odd size: the next offset is realigned
        "steps": torch.tensor(41, dtype=torch.int64),
        "mask": torch.rand(33, generator=g) > 0.5,
        "empty": torch.empty(0, 3),
        "head": torch.randn(64, 300, generator=g).t(),  # non-contiguous at the source
    }
