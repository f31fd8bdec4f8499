"""Off-policy corrections, by level (``algorithm.is_level``, ``algorithm.is_mask``): how far the
trainer's log-probs are from the generators' (behaviour) ones, per token or per sequence, as a
truncated importance weight (:func:`is_weights`) or a mask (:func:`keep_mask`).

Each level is one public function ``(log_ratio [B, T], valid [B, T]) -> log-ratio [B, T]``: a
token's own, or its sequence's (the product of the token ratios, or their geometric mean) on every
token of the sequence. The level names are the schema's (``recipe.schema.IS_LEVELS``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from streamrl_cli.trainer.algo.registry import Registry
from streamrl_cli.trainer.algo.tensors import LOG_RATIO_BOUND

CORRECTIONS: Registry[Callable[[Tensor, Tensor], Tensor]] = Registry("correction level")


@CORRECTIONS.register("token")
def token_level(log_ratio: Tensor, valid: Tensor) -> Tensor:
    """Each token's own ratio."""
    return log_ratio


@CORRECTIONS.register("sequence")
def sequence_level(log_ratio: Tensor, valid: Tensor) -> Tensor:
    """The product of the sequence's token ratios (verl's seq_is), on each of its tokens."""
    return (log_ratio * valid).sum(dim=-1, keepdim=True).expand_as(log_ratio)


@CORRECTIONS.register("geometric")
def geometric_level(log_ratio: Tensor, valid: Tensor) -> Tensor:
    """The geometric mean of the sequence's token ratios (GSPO's length normalisation)."""
    total = (log_ratio * valid).sum(dim=-1, keepdim=True)
    return (total / valid.sum(dim=-1, keepdim=True).clamp(min=1.0)).expand_as(log_ratio)


def is_weights(trainer_logp: Tensor, behaviour_logp: Tensor, mask: Tensor, cap: float, level: str) -> Tensor:
    """Truncated importance weights against the behaviour policy, [B, T], 0 where masked (TIS):
    min(ratio, cap) with the ratio of `level`: per token min(π_trainer/π_behaviour, cap), or one
    weight per sequence, min(Π_t ratio_t, cap) or min((Π_t ratio_t)^(1/|y|), cap) (verl's rollout
    correction, docs/algo/rollout_corr.md: token_is, seq_is). No gradient."""
    level_of = CORRECTIONS.get(level)
    with torch.no_grad():
        valid = (mask > 0).to(trainer_logp.dtype)
        log_r = level_of((trainer_logp - behaviour_logp) * valid, valid)
        return torch.exp(log_r.clamp(min=-LOG_RATIO_BOUND)).clamp(max=cap) * valid


def keep_mask(
    trainer_logp: Tensor, behaviour_logp: Tensor, mask: Tensor, level: str, low: float, high: float
) -> Tensor:
    """Which tokens stay in the loss [B, T] (1.0 kept, 0.0 masked): those whose trainer/behaviour
    ratio lies in [low, high] (``token``: each token's own, IcePop (arXiv:2510.18855) with [0.5, 5]),
    or whole sequences by the product of their token ratios (``sequence``) or its geometric mean
    (``geometric``) (verl's rollout rejection, MIS). Positions outside `mask` are 0."""
    level_of = CORRECTIONS.get(level)
    with torch.no_grad():
        valid = (mask > 0).to(trainer_logp.dtype)
        lo = math.log(low) if low > 0 else -math.inf
        hi = math.log(high)
        log_r = level_of((trainer_logp - behaviour_logp) * valid, valid)
        return ((log_r >= lo) & (log_r <= hi)).to(trainer_logp.dtype) * valid
