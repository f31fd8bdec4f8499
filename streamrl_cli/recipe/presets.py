"""Algorithm presets: what `algorithm.name` means, as defaults for a consistent group of keys.

Why presets rather than one schema default per key: GRPO, Dr. GRPO, DAPO, GSPO, ... differ in a
handful of keys that only make sense together (Dr. GRPO is GRPO without the std and the length
normalisation; DAPO is clip-higher, no KL, overlong shaping and dynamic sampling). A preset sets
those; every other key keeps its own default.

How a user's key wins: the schema's default of each preset key is null (``recipe.schema``), so after
Hydra composition and the command line's overrides a key is non-null exactly when the recipe, one
of its config groups or an override set it. :func:`fill` replaces only the nulls, once, in
``checks.resolve``; the run's config.yaml and the roles see the filled values.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from streamrl_cli.errors import StreamRLError
from streamrl_cli.recipe.schema import ALGORITHMS, AlgorithmConfig


@dataclass(frozen=True)
class Share:
    """A preset value given as a share of task.max_output_len, in whole tokens."""

    of_max_len: float

    def tokens(self, max_output_len: int) -> int:
        return int(self.of_max_len * max_output_len)


# Every preset's value of a key, unless the preset names it (clip_ratio_high null: clip_ratio).
BASE: dict[str, Any] = {
    "group_size": 8,
    "advantage": "grpo",
    "policy_loss": "clip",
    "loss_agg": "token-mean",
    "grpo_std_norm": True,
    "clip_ratio": 0.2,
    "clip_ratio_high": None,
    "kl_mode": "loss",
    "kl_estimator": "k3",
    "kl_coef": 0.001,
    "overlong_buffer": 0,
    "dynamic_sampling": False,
    "is_level": "token",
}

PRESETS: dict[str, dict[str, Any]] = {
    # DeepSeekMath (arXiv:2402.03300): group-normalised rewards, KL to the reference as a loss term.
    "grpo": {},
    # A critic and GAE; the KL enters the per-token reward (InstructGPT's penalty), k1 estimator.
    # One sample per prompt: GAE's baseline is the critic, not the group.
    "ppo": {"advantage": "gae", "kl_mode": "penalty", "kl_estimator": "k1", "group_size": 1},
    # Dr. GRPO (arXiv:2503.20783): no std normalisation, no length normalisation (a constant divisor).
    "dr-grpo": {"grpo_std_norm": False, "loss_agg": "seq-mean-token-sum-norm"},
    # DAPO (arXiv:2503.14476): clip-higher 0.28, no KL, token-level loss (token-mean), soft overlong
    # punishment over the last 20% of the output length (4,096 of 20,480 in the paper), dynamic sampling.
    "dapo": {
        "clip_ratio_high": 0.28,
        "kl_coef": 0.0,
        "overlong_buffer": Share(0.2),
        "dynamic_sampling": True,
    },
    # GSPO (arXiv:2507.18071): one length-normalised ratio per sequence, clipped per sequence at the
    # paper's 3e-4 / 4e-4, sequences averaged; the behaviour correction at the same (geometric) level.
    "gspo": {
        "policy_loss": "gspo",
        "loss_agg": "seq-mean-token-mean",
        "clip_ratio": 3e-4,
        "clip_ratio_high": 4e-4,
        "is_level": "geometric",
    },
    # CISPO (MiniMax-M1, arXiv:2506.13585): the IS weight clipped and its gradient stopped. The paper
    # sets no lower bound (ε_low large) and tunes ε_high: 1.0 caps the weight at 2, as is_cap does.
    "cispo": {"policy_loss": "cispo", "clip_ratio": 1.0, "clip_ratio_high": 1.0},
    # RLOO (arXiv:2402.14740): each sample's baseline is the mean of the other samples of its prompt.
    "rloo": {"advantage": "rloo"},
    # REINFORCE++ (arXiv:2501.03262): the reward normalised over the whole batch, no group baseline.
    "reinforce++": {"advantage": "reinforce++"},
    # REINFORCE++ with a group baseline: the group mean subtracted, then normalised over the batch.
    "reinforce++-baseline": {"advantage": "reinforce++-baseline"},
}
assert set(PRESETS) == set(ALGORITHMS), "every algorithm name has a preset"


def preset(name: str) -> dict[str, Any]:
    """The keys and values `name` stands for (BASE with the preset's own on top)."""
    if name not in PRESETS:
        raise ValueError(f"unknown algorithm {name!r}; valid: {', '.join(ALGORITHMS)}")
    return {**BASE, **PRESETS[name]}


def fill(a: AlgorithmConfig, max_output_len: int) -> AlgorithmConfig:
    """Set every null preset key of `a` from its algorithm's preset, in place (idempotent)."""
    for key, value in preset(a.name).items():
        if getattr(a, key) is None:
            setattr(a, key, value.tokens(max_output_len) if isinstance(value, Share) else value)
    if a.clip_ratio_high is None:
        a.clip_ratio_high = a.clip_ratio
    return a


def filled(a: AlgorithmConfig, max_output_len: int) -> AlgorithmConfig:
    """A copy of `a` with its null preset keys filled (`a` is left as it is)."""
    return fill(copy.copy(a), max_output_len)


def require_resolved(a: AlgorithmConfig, reader: str) -> AlgorithmConfig:
    """`a` itself, if its preset was resolved (``checks.resolve``, through :func:`fill`): runtime
    code reads preset keys as they are and never fills them again. Else a clear error naming them."""
    unset = [k for k in BASE if getattr(a, k) is None]
    if unset:
        raise StreamRLError(
            f"{reader}: algorithm.{', algorithm.'.join(unset)} unset: the recipe's algorithm preset "
            "was not resolved (recipe.checks.resolve fills it; tests: presets.filled)"
        )
    return a


def uses_critic(a: AlgorithmConfig) -> bool:
    """Whether the algorithm trains a critic (GAE advantages)."""
    return (a.advantage or preset(a.name)["advantage"]) == "gae"
