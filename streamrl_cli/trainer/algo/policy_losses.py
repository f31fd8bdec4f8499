"""Policy losses, by name (``algorithm.policy_loss``): each one public function
``(logp, old_logp, advantages, mask, clip_low, clip_high, is_weights) -> (per-token loss, stats sums)``.

Ratios. StreamRL takes one optimizer step per batch. With ``old_policy=trainer`` the loss's ratio
is against the trainer's own log-probs of the batch (``logp.detach()``): its value is 1 and only its
gradient matters; what lags (async staleness, partial rollout, a different inference engine) is
corrected against the generators' log-probs by ``corrections.is_weights`` and ``keep_mask`` (verl's
"decoupled" mode). With ``old_policy=behaviour`` the loss's ratio is against the generators'
log-probs itself, so the clipping of PPO, DAPO, GSPO and CISPO acts on that lag (verl's "bypass").
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from streamrl_cli.trainer.algo.registry import Registry
from streamrl_cli.trainer.algo.tensors import LOG_RATIO_BOUND, per_token

PolicyLoss = Callable[..., tuple[Tensor, dict[str, Tensor]]]

# (logp, old_logp, advantages, mask, clip_low, clip_high, is_weights) -> (per-token loss, stats sums)
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")


def policy_loss(name: str) -> PolicyLoss:
    return POLICY_LOSSES.get(name)


def weighted(loss: Tensor, is_weights: Tensor | None, mask: Tensor) -> Tensor:
    """A per-token loss times the off-policy correction's weights (if any), 0 outside `mask`."""
    if is_weights is not None:
        loss = loss * per_token(is_weights.detach(), loss)
    return loss * mask


def statistics(clipped: Tensor, log_ratio: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """A policy loss's statistics, as sums over the valid tokens: the clipped ones, KL(old || new) by
    Schulman's k3 on the old policy's samples ((r - 1) - log r, never negative), the token count."""
    with torch.no_grad():
        valid = (mask > 0).to(log_ratio.dtype)
        log_ratio = log_ratio.detach()
        return {
            "clip_frac": (clipped.to(valid.dtype) * valid).sum(),
            "approx_kl": ((torch.exp(log_ratio) - 1.0 - log_ratio) * valid).sum(),
            "tokens": valid.sum(),
        }


def clipped_surrogate(ratio: Tensor, adv: Tensor, clip_low: float, clip_high: float) -> tuple[Tensor, Tensor]:
    """PPO's -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A) per token, and where the clipping is
    active: the clipped term is the one taken and it cuts the gradient (by r's value)."""
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    with torch.no_grad():
        r = ratio.detach()
        active = ((adv > 0) & (r > 1.0 + clip_high)) | ((adv < 0) & (r < 1.0 - clip_low))
    return -torch.minimum(unclipped, clipped), active


@POLICY_LOSSES.register("clip")
def clip_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped surrogate (arXiv:1707.06347, eq. 7; DAPO's clip-higher with clip_high > clip_low) per
    token [B, T], and stats as sums over valid tokens (divide by "tokens")."""
    adv = per_token(advantages.detach(), logp)
    log_ratio = logp - old_logp.detach()
    loss, active = clipped_surrogate(torch.exp(log_ratio), adv, clip_low, clip_high)
    return weighted(loss, is_weights, mask), statistics(active, log_ratio, mask)


@POLICY_LOSSES.register("gspo")
def gspo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025, arXiv:2507.18071): the sequence-level ratio s_i = (π/π_old)^(1/|y_i|) =
    exp(mean over the sequence's tokens of log π - log π_old), clipped per sequence,
    -min(s_i A_i, clip(s_i, 1 - clip_low, 1 + clip_high) A_i). Written in the paper's GSPO-token form,
    s_{i,t} = sg[s_i] · π(y_t) / sg[π(y_t)]: the same value for every token of a sequence, and with
    ``seq-mean-token-mean`` the paper's gradient s_i A_i · (1/|y_i|) Σ_t ∇ log π(y_t).
    Advantages: one per sequence ([B], or [B, T] constant along T)."""
    valid = (mask > 0).to(logp.dtype)
    adv = per_token(advantages.detach(), logp)
    log_ratio = (logp - old_logp.detach()) * valid
    count = valid.sum(dim=-1).clamp(min=1.0)
    log_s = (log_ratio.sum(dim=-1) / count).detach().clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    s_tok = torch.exp(log_s.unsqueeze(-1) + logp - logp.detach())  # its value: s_i at every token
    loss, active = clipped_surrogate(s_tok, adv, clip_low, clip_high)
    return weighted(loss, is_weights, mask), statistics(active, log_ratio, mask)


@POLICY_LOSSES.register("cispo")
def cispo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, arXiv:2506.13585, eqs. 4-5): -sg(clip(r_t, 1 - clip_low, 1 + clip_high)) ·
    A_t · log π(y_t), r_t = π/π_old. The IS weight is clipped and its gradient stopped, so a token
    whose ratio is clipped keeps its gradient (scaled by the clipped weight) instead of losing it."""
    adv = per_token(advantages.detach(), logp)
    with torch.no_grad():
        log_ratio = (logp - old_logp).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        ratio = torch.exp(log_ratio)
        weight = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = -weight * adv * logp
    loss = weighted(loss, is_weights, mask)
    return loss, statistics(weight != ratio, log_ratio, mask)
