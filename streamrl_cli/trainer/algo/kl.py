"""KL estimators, by name (``algorithm.kl_estimator``): per-token estimates of KL(policy ‖ ref) from
the policy's samples (Schulman's k1, k2, k3), each ``(logp [B, T], ref_logp [B, T]) -> [B, T]``."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from streamrl_cli.trainer.algo.registry import Registry

KL_ESTIMATORS: Registry[Callable[[Tensor, Tensor], Tensor]] = Registry("KL estimator")


@KL_ESTIMATORS.register("k1")
def k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """log(π/π_ref): unbiased, can be negative."""
    return logp - ref_logp


@KL_ESTIMATORS.register("k2")
def k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """½ log²(π/π_ref): low variance, biased."""
    return 0.5 * (logp - ref_logp).square()


@KL_ESTIMATORS.register("k3")
def k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """π_ref/π − 1 − log(π_ref/π): unbiased and never negative."""
    log_ratio = logp - ref_logp
    return torch.exp(-log_ratio) + log_ratio - 1.0


def kl_estimate(logp: Tensor, ref_logp: Tensor, kind: str) -> Tensor:
    """Per-token estimate of KL(policy || ref) by the estimator named `kind`."""
    return KL_ESTIMATORS.get(kind)(logp, ref_logp)
