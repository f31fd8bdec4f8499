"""Advantage estimators, by name (``algorithm.advantage``), and the reward shaping around them.

Every estimator is one public function of one prompt's group, ``(rewards [G], std_norm) ->
advantages [G]`` (GAE alone has none: the learner computes it per token from a critic), registered
with what it needs of the batch (``whiten``) and of the trainer (``critic``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from streamrl_cli.trainer.algo.registry import Registry


@dataclass(frozen=True)
class Estimator:
    """An advantage estimator: what it does with one prompt's group, and with the whole batch."""

    # One group's scored rewards [G] and the grpo_std_norm flag -> advantages [G] (None: GAE, learner).
    group: Callable[[Tensor, bool], Tensor] | None
    whiten: bool = False  # normalised over the whole batch afterwards (needs the batch before training)
    critic: bool = False  # per-token GAE from a critic's values (computed by the learner)


ADVANTAGES: Registry[Estimator] = Registry("advantage estimator")


def advantage(name: str, *, whiten: bool = False) -> Callable[[Callable[[Tensor, bool], Tensor]], Callable]:
    """Register a group estimator: ``@advantage("rloo")`` over ``fn(rewards, std_norm)``."""

    def add(fn: Callable[[Tensor, bool], Tensor]) -> Callable[[Tensor, bool], Tensor]:
        ADVANTAGES.add(name, Estimator(group=fn, whiten=whiten))
        return fn

    return add


ADVANTAGES.add("gae", Estimator(group=None, critic=True))


def estimator(name: str) -> Estimator:
    return ADVANTAGES.get(name)


@advantage("grpo")
def grpo_advantages(rewards: Tensor, std_norm: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO advantages of one group's rewards [G]: r - mean, over the population std + eps if std_norm."""
    rewards = rewards.detach().float()
    centred = rewards - rewards.mean()
    if not std_norm:
        return centred
    # Population std (correction=0): a group is the whole population of its prompt's samples, and
    # a group of one then gives std 0 (advantage 0) instead of NaN.
    return centred / (rewards.std(correction=0) + eps)


@advantage("rloo")
def rloo_advantages(rewards: Tensor, std_norm: bool = False) -> Tensor:
    """RLOO (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style
    Optimization for Learning from Human Feedback in LLMs", arXiv:2402.14740, the RLOO estimator): each
    sample's baseline is the mean of the other samples of its prompt, A_i = r_i - (Σ_j r_j - r_i)/(G-1),
    i.e. G/(G-1) · (r_i - mean r). A group of one has no baseline: advantage 0. (No std: std_norm
    is GRPO's.)"""
    rewards = rewards.detach().float()
    n = rewards.numel()
    if n < 2:
        return torch.zeros_like(rewards)
    return rewards - (rewards.sum() - rewards) / (n - 1)


@advantage("reinforce++", whiten=True)
def reinforce_pp_advantages(rewards: Tensor, std_norm: bool = False) -> Tensor:
    """REINFORCE++ (arXiv:2501.03262): the reward itself, normalised over the batch afterwards."""
    return rewards.detach().float().clone()


@advantage("reinforce++-baseline", whiten=True)
def centred(rewards: Tensor, std_norm: bool = False) -> Tensor:
    """The group mean subtracted (REINFORCE++-baseline's first step, arXiv:2501.03262), then
    normalised over the batch."""
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
