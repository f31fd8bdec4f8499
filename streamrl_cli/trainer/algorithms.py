"""Advantage estimators, policy losses and off-policy corrections, chosen by name: pure torch.

Why a registry: `algorithm.name` is a preset (``recipe.presets``) of an advantage estimator, a
policy loss, a correction level and a few coefficients; the trainer looks each one up here by the
name the recipe resolved to, so adding an algorithm is a function and a line, and an unknown name
is an error that lists the valid ones. The PPO/GRPO building blocks stay in ``losses`` (whose
conventions hold here too: ``[B, T]`` per-token tensors with a float mask, per-token losses
unreduced, statistics as sums over valid tokens).

Ratios. StreamRL takes one optimizer step per batch. With ``old_policy=trainer`` the loss's ratio
is against the trainer's own log-probs of the batch (``logp.detach()``): its value is 1 and only its
gradient matters; what lags (async staleness, partial rollout, a different inference engine) is
corrected against the generators' log-probs by :func:`is_weights` and :func:`keep_mask` (verl's
"decoupled" mode). With ``old_policy=behaviour`` the loss's ratio is against the generators'
log-probs itself, so the clipping of PPO, DAPO, GSPO and CISPO acts on that lag (verl's "bypass").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from streamrl_cli.trainer import losses as L

# Log-ratios are clamped here before exp: e^20 ≈ 5e8 is already far past any cap or bound.
LOG_RATIO_BOUND = 20.0

# ---- advantages ---------------------------------------------------------------------------------


def rloo_advantages(rewards: Tensor) -> Tensor:
    """RLOO (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style
    Optimization for Learning from Human Feedback in LLMs", arXiv:2402.14740, the RLOO estimator): each
    sample's baseline is the mean of the other samples of its prompt, A_i = r_i - (Σ_j r_j - r_i)/(G-1),
    i.e. G/(G-1) · (r_i - mean r). A group of one has no baseline: advantage 0."""
    rewards = rewards.detach().float()
    n = rewards.numel()
    if n < 2:
        return torch.zeros_like(rewards)
    return rewards - (rewards.sum() - rewards) / (n - 1)


def centred(rewards: Tensor) -> Tensor:
    """The group mean subtracted (REINFORCE++-baseline's first step, arXiv:2501.03262)."""
    rewards = rewards.detach().float()
    return rewards - rewards.mean()


def batch_whiten(advantages: Tensor, lengths: Tensor, eps: float = 1e-6) -> Tensor:
    """REINFORCE++ (Hu et al. 2025, arXiv:2501.03262, its global batch advantage normalisation):
    (A - μ) / (σ + eps) with μ and σ the mean and population std of the advantage over every token
    of the batch. A sequence's advantage holds for each of its tokens, so each counts `lengths` times
    (a length 0 takes no part and gets 0)."""
    a, w = advantages.detach().float(), lengths.detach().float()
    total = w.sum()
    if total <= 0:
        return torch.zeros_like(a)
    mean = (w * a).sum() / total
    std = ((w * (a - mean).square()).sum() / total).sqrt()
    return torch.where(w > 0, (a - mean) / (std + eps), torch.zeros_like(a))


def overlong_penalty(length: int, max_len: int, buffer: int, factor: float) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, §3.4, R_length): 0 up to
    max_len - buffer tokens, then -factor · (length - (max_len - buffer)) / buffer, reaching -factor
    at max_len (and -factor beyond it). buffer 0: off."""
    if buffer <= 0:
        return 0.0
    start = max_len - buffer
    if length <= start:
        return 0.0
    return -factor * min(1.0, (length - start) / buffer)


@dataclass(frozen=True)
class Estimator:
    """An advantage estimator: what it does with one prompt's group, and with the whole batch."""

    # One group's scored rewards [G] and the grpo_std_norm flag -> advantages [G] (None: GAE, learner).
    group: Callable[[Tensor, bool], Tensor] | None
    whiten: bool = False  # normalised over the whole batch afterwards (needs the batch before training)
    critic: bool = False  # per-token GAE from a critic's values (computed by the learner)


ADVANTAGES: dict[str, Estimator] = {
    "gae": Estimator(group=None, critic=True),
    "grpo": Estimator(group=lambda r, std_norm: L.grpo_advantages(r, std_norm)),
    "rloo": Estimator(group=lambda r, _: rloo_advantages(r)),
    "reinforce++": Estimator(group=lambda r, _: r.detach().float().clone(), whiten=True),
    "reinforce++-baseline": Estimator(group=lambda r, _: centred(r), whiten=True),
}


def estimator(name: str) -> Estimator:
    if name not in ADVANTAGES:
        raise ValueError(f"unknown advantage estimator {name!r}; valid: {', '.join(ADVANTAGES)}")
    return ADVANTAGES[name]


def informative(rewards: Sequence[float]) -> bool:
    """DAPO's dynamic-sampling rule (§3.2): a group counts when its rewards are not all equal (at
    least two, differing); otherwise every group-relative advantage of it is zero."""
    return len(rewards) >= 2 and max(rewards) != min(rewards)


def distilled_advantages(
    advantages: Tensor, teacher_logp: Tensor, behaviour_logp: Tensor, mask: Tensor, coef: float, *, task: bool
) -> Tensor:
    """On-policy distillation (Agarwal et al. 2024, arXiv:2306.13649, the reverse-KL objective of its
    Eq. 2 on the student's own samples; per token as in Lu & Thinking Machines 2025, "On-Policy
    Distillation"): each sampled token y_t's advantage is ``coef · (log p_T(y_t) − log p_S(y_t))``,
    the negative of the per-token estimate of KL(p_S ‖ p_T), with p_S the behaviour policy that
    sampled it; added to the task's advantages [B, T] (``task``) or alone. Zero where ``mask`` is 0."""
    gap = (teacher_logp - behaviour_logp) * mask
    base = advantages if task else torch.zeros_like(advantages)
    return base + coef * gap


# ---- policy losses ------------------------------------------------------------------------------


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
    adv = L._per_token(advantages.detach(), logp)
    log_ratio = (logp - old_logp.detach()) * valid
    count = valid.sum(dim=-1).clamp(min=1.0)
    log_s = (log_ratio.sum(dim=-1) / count).detach().clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    s_tok = torch.exp(log_s.unsqueeze(-1) + logp - logp.detach())
    unclipped = s_tok * adv
    clipped = torch.clamp(s_tok, 1.0 - clip_low, 1.0 + clip_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    if is_weights is not None:
        loss = loss * L._per_token(is_weights.detach(), logp)
    loss = loss * mask
    with torch.no_grad():
        s = log_s.exp().unsqueeze(-1).expand_as(logp)
        active = ((adv > 0) & (s > 1.0 + clip_high)) | ((adv < 0) & (s < 1.0 - clip_low))
        ratio = torch.exp(log_ratio.detach())
        stats = {
            "clip_frac": (active.to(loss.dtype) * valid).sum(),
            "approx_kl": (((ratio - 1.0) - log_ratio.detach()) * valid).sum(),
            "tokens": valid.sum(),
        }
    return loss, stats


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
    valid = (mask > 0).to(logp.dtype)
    adv = L._per_token(advantages.detach(), logp)
    with torch.no_grad():
        log_ratio = (logp - old_logp).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        ratio = torch.exp(log_ratio)
        weight = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = -weight * adv * logp
    if is_weights is not None:
        loss = loss * L._per_token(is_weights.detach(), logp)
    loss = loss * mask
    with torch.no_grad():
        stats = {
            "clip_frac": ((weight != ratio).to(loss.dtype) * valid).sum(),
            "approx_kl": (((ratio - 1.0) - log_ratio) * valid).sum(),
            "tokens": valid.sum(),
        }
    return loss, stats


PolicyLoss = Callable[..., tuple[Tensor, dict[str, Tensor]]]

# (logp, old_logp, advantages, mask, clip_low, clip_high, is_weights) -> (per-token loss, stats sums)
POLICY_LOSSES: dict[str, PolicyLoss] = {
    "clip": L.policy_loss,  # PPO's clipped surrogate (arXiv:1707.06347, eq. 7); DAPO's clip-higher
    "gspo": gspo_loss,
    "cispo": cispo_loss,
}


def policy_loss(name: str) -> PolicyLoss:
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; valid: {', '.join(POLICY_LOSSES)}")
    return POLICY_LOSSES[name]


# ---- off-policy corrections ---------------------------------------------------------------------

IS_LEVELS = ("token", "sequence", "geometric")


def _sequence_log_ratio(delta: Tensor, valid: Tensor, level: str) -> Tensor:
    """A sequence's log-ratio [B] from its tokens' [B, T]: their sum (the product of the token
    ratios) or their mean (the geometric mean)."""
    total = (delta * valid).sum(dim=-1)
    if level == "sequence":
        return total
    if level == "geometric":
        return total / valid.sum(dim=-1).clamp(min=1.0)
    raise ValueError(f"unknown correction level {level!r}; valid: {', '.join(IS_LEVELS)}")


def is_weights(trainer_logp: Tensor, behaviour_logp: Tensor, mask: Tensor, cap: float, level: str) -> Tensor:
    """Truncated importance weights against the behaviour policy, [B, T], 0 where masked (TIS):
    per token min(π_trainer/π_behaviour, cap) (``losses.importance_weights``), or one weight per
    sequence, min(Π_t ratio_t, cap) or min((Π_t ratio_t)^(1/|y|), cap) (verl's rollout correction,
    docs/algo/rollout_corr.md: token_is, seq_is; the geometric one is GSPO's length normalisation)."""
    if level == "token":
        return L.importance_weights(trainer_logp, behaviour_logp, mask, cap)
    with torch.no_grad():
        valid = (mask > 0).to(trainer_logp.dtype)
        log_w = _sequence_log_ratio(trainer_logp - behaviour_logp, valid, level)
        w = torch.exp(log_w.clamp(-LOG_RATIO_BOUND, math.log(cap)))
        return w.unsqueeze(-1) * valid


def keep_mask(
    trainer_logp: Tensor, behaviour_logp: Tensor, mask: Tensor, level: str, low: float, high: float
) -> Tensor:
    """Which tokens stay in the loss [B, T] (1.0 kept, 0.0 masked): those whose trainer/behaviour
    ratio lies in [low, high] (``token``: each token's own, IcePop (arXiv:2510.18855) with [0.5, 5]),
    or whole sequences by the product of their token ratios (``sequence``) or its geometric mean
    (``geometric``) (verl's rollout rejection, MIS). Positions outside `mask` are 0."""
    with torch.no_grad():
        valid = (mask > 0).to(trainer_logp.dtype)
        lo = math.log(low) if low > 0 else -math.inf
        hi = math.log(high)
        delta = (trainer_logp - behaviour_logp) * valid
        if level == "token":
            keep = (delta >= lo) & (delta <= hi)
        else:
            log_r = _sequence_log_ratio(delta, valid, level)
            keep = ((log_r >= lo) & (log_r <= hi)).unsqueeze(-1).expand_as(delta)
        return keep.to(trainer_logp.dtype) * valid
