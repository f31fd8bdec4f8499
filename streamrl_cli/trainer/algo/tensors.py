"""What the registries' entries share: the per-token convention and the bound on log-ratios.

Conventions of the maths (``trainer.algo`` and ``trainer.algo.losses``): ``[B, T]`` per-token tensors
with a float mask (1.0 on response tokens the policy produced), per-token losses unreduced,
statistics as sums over valid tokens."""

from __future__ import annotations

from torch import Tensor

# Log-ratios are clamped here before exp: e^20 ≈ 5e8 is already far past any cap or bound.
LOG_RATIO_BOUND = 20.0


def per_token(x: Tensor, like: Tensor) -> Tensor:
    """Broadcast a sequence-level [B] tensor over T; a [B, T] tensor is returned as is."""
    return x.unsqueeze(-1).expand_as(like) if x.dim() == like.dim() - 1 else x
