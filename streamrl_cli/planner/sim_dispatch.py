"""Which generator instance gets which prompt, and in what order: the simulator's policies.

- `random`: prompts shuffled and dealt round-robin (equal counts), each instance admits them
  first-in first-out. What a plain disaggregated system does.
- `skewness`: the StreamRL paper's skewness-aware dispatching (Algorithm 2) and scheduling. A
  ranker predicts output lengths (here: the true length times log-normal noise, tuned to the
  paper's reported ranker recall); the top α of prompts are "long-tail", the rest "regular";
  their mean lengths are estimated as the P90 and P50 of recently observed lengths; every split
  N_long + N_regular of the instances is tried and the one minimising
  Latency(long, L90, N_long) + Latency(regular, L50, N_regular) is kept, where one instance's
  Latency = PTL(BS) × L × ceil(M / BS). Within an instance, Longest-Processing-Time first.

Long samples end up on instances with few, small batches (low PTL); regular ones fill the rest.
Algorithm 2 itself is streamrl_cli.skew.dispatch_plan, shared with the real dispatcher; these are the
simulator's views of it (instances are numbered, queues are lists). Pure functions: randomness
comes from the caller's seeded generator.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

from streamrl_cli.skew.dispatch_plan import plan_split, random_dispatch

POLICIES = ("random", "skewness")


def predict(true_lengths: Sequence[float], rng: random.Random, sigma: float) -> list[float]:
    """A length ranker's predictions: the truth scrambled by log-normal noise of log-σ `sigma`."""
    return [length * math.exp(rng.gauss(0.0, sigma)) for length in true_lengths]


def recall(true_lengths: Sequence[float], predicted: Sequence[float], top: float) -> float:
    """Fraction of the truly longest `top` share that the predictions also rank in their top share."""
    k = max(1, round(top * len(true_lengths)))
    idx = range(len(true_lengths))
    truly = set(sorted(idx, key=lambda i: -true_lengths[i])[:k])
    guessed = set(sorted(idx, key=lambda i: -predicted[i])[:k])
    return len(truly & guessed) / k


def dispatch_random(n_prompts: int, instances: int, rng: random.Random) -> list[list[int]]:
    """Prompt indices per instance, in admission order."""
    plan = random_dispatch(n_prompts, _ids(instances), rng)
    return [list(q) for q in plan.queues.values()]


def dispatch_skewness(
    predicted: Sequence[float],
    instances: int,
    ptl: Callable[[float], float],
    group: int,
    max_batch: int,
    l50: float,
    l90: float,
    alpha: float = 0.2,
) -> list[list[int]]:
    """Algorithm 2 + LPT: prompt indices per instance, longest predicted first."""
    plan = plan_split(
        predicted, _ids(instances), ptl=ptl, l_long=l90, l_regular=l50, alpha=alpha, max_batch=max_batch,
        group=group,
    )  # fmt: skip
    return [list(q) for q in plan.queues.values()]


def _ids(instances: int) -> list[str]:
    return [str(i) for i in range(instances)]
