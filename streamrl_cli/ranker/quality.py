"""How good a ranker's order is: recall of the true long tail, and Spearman rank correlation.

The paper judges its ranker by recall of the truly longest 20% / 10% / 5% of prompts (0.87 / 0.82
/ 0.76 for a 7B ranker, in the StreamRL paper): dispatching only needs the long tail found, not every
length right. Spearman's ρ adds a view of the whole order. Pure Python: a few thousand prompts per
iteration cost milliseconds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from streamrl_cli.planner.sim_dispatch import recall

TAILS = {"recall@20": 0.20, "recall@10": 0.10, "recall@5": 0.05}


def average_ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks, ties given the mean of the ranks they span."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(true: Sequence[float], predicted: Sequence[float]) -> float:
    """Pearson correlation of the average ranks; 0.0 where either side is constant (no order)."""
    if len(true) != len(predicted):
        raise ValueError(f"{len(true)} true lengths but {len(predicted)} predictions")
    a, b = average_ranks(true), average_ranks(predicted)
    n = len(a)
    if n < 2:
        return 0.0
    ma, mb = sum(a) / n, sum(b) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(a, b, strict=True))
    va = sum((x - ma) ** 2 for x in a)
    vb = sum((y - mb) ** 2 for y in b)
    if va == 0 or vb == 0:
        return 0.0
    return cov / math.sqrt(va * vb)


def quality(true: Sequence[float], predicted: Sequence[float]) -> dict[str, float]:
    """recall@20/10/5 (share of the truly longest k% that the predictions put in their top k%) and
    spearman. Ties are broken by position, as the dispatcher breaks them."""
    if len(true) != len(predicted):
        raise ValueError(f"{len(true)} true lengths but {len(predicted)} predictions")
    if not true:
        return {**dict.fromkeys(TAILS, 0.0), "spearman": 0.0, "n": 0}
    out: dict[str, float] = {name: recall(true, predicted, top) for name, top in TAILS.items()}
    out["spearman"] = spearman(true, predicted)
    out["n"] = len(true)
    return out


class QualityTracker:
    """The last iteration's ranker quality, for the metrics stream.

    Call :meth:`observe` once per iteration with the lengths the policy produced and what the
    ranker predicted for the same prompts (before it learned from them)."""

    def __init__(self, prefix: str = "ranker/"):
        self.prefix = prefix
        self.last: dict[str, float] = {}
        self.iterations = 0

    def observe(self, true: Sequence[float], predicted: Sequence[float]) -> dict[str, float]:
        self.last = quality(true, predicted)
        self.iterations += 1
        return self.last

    def metrics(self) -> dict[str, float]:
        """The last numbers with the prefix (empty before the first :meth:`observe`)."""
        return {f"{self.prefix}{k}": float(v) for k, v in self.last.items()}
