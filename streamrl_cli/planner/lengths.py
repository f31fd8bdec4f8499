"""Output-length distribution of a reasoning workload: a log-normal body and a flat tail.

Reasoning outputs are long-tailed (StreamRL paper; docs/architecture.md): most samples end near a mode of
~2K tokens, a flat tail reaches the maximum output length (20K). The tail, not the mean, sets how
long a synchronous generation stage takes: the iteration waits for its longest sample. So both
the cost model (which integrates over the survival function) and the simulator (which samples)
read this one description.

    P(L > k) = (1 − tail) · P(body > k) + tail · P(Uniform(mode, max) > k)
    body: log-normal with its mode at `mode` and log-σ `spread`, truncated at `max`
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from functools import cached_property

GRID = 1024  # integration points over [0, max]: 20 tokens apart for a 20K maximum


@dataclass(frozen=True)
class LengthDist:
    """Output lengths in tokens, 1 ≤ L ≤ max_len."""

    mode: float  # most common length
    max_len: int  # hard cap (the task's max_output_len)
    tail: float = 0.2  # probability mass of the flat tail between mode and max_len
    spread: float = 0.4  # σ of log L around the mode (body width)

    def __post_init__(self) -> None:
        if not (0 < self.mode <= self.max_len and 0 <= self.tail <= 1 and self.spread > 0):
            raise ValueError(f"invalid length distribution {self}")

    @property
    def _mu(self) -> float:
        # A log-normal's mode is exp(μ − σ²): put it where the workload peaks.
        return math.log(self.mode) + self.spread**2

    def _body_cdf(self, x: float) -> float:
        if x <= 0:
            return 0.0
        z = (math.log(x) - self._mu) / self.spread
        return 0.5 * (1 + math.erf(z / math.sqrt(2)))

    def survival(self, k: float) -> float:
        """P(L > k)."""
        if k >= self.max_len:
            return 0.0
        body = 1 - self._body_cdf(k) / self._body_cdf(self.max_len)
        if self.max_len <= self.mode:
            return body
        tail = 1.0 if k < self.mode else (self.max_len - k) / (self.max_len - self.mode)
        return (1 - self.tail) * body + self.tail * tail

    @cached_property
    def _table(self) -> tuple[list[float], list[float], list[float]]:
        """k grid, S(k) and ∫_k^max S: every moment below is a lookup, not an integral."""
        ks = [self.max_len * i / GRID for i in range(GRID + 1)]
        s = [self.survival(k) for k in ks]
        above = [0.0] * (GRID + 1)
        step = self.max_len / GRID
        for i in range(GRID - 1, -1, -1):
            above[i] = above[i + 1] + 0.5 * (s[i] + s[i + 1]) * step
        return ks, s, above

    @cached_property
    def mean(self) -> float:
        """E[L] = ∫ S(k) dk."""
        return self._table[2][0]

    @cached_property
    def second_moment(self) -> float:
        """E[L²] = ∫ 2k S(k) dk."""
        ks, s, _ = self._table
        step = self.max_len / GRID
        return sum(0.5 * (2 * ks[i] * s[i] + 2 * ks[i + 1] * s[i + 1]) * step for i in range(GRID))

    def tokens_above(self, k: float) -> float:
        """E[L · 1{L > k}]: tokens per sample that belong to samples longer than k."""
        ks, s, above = self._table
        if k >= self.max_len:
            return 0.0
        i = min(int(k / self.max_len * GRID), GRID - 1)
        frac = k / self.max_len * GRID - i
        rest = above[i] - frac * 0.5 * (s[i] + s[i + 1]) * (self.max_len / GRID)
        return k * self.survival(k) + rest

    def quantile(self, q: float) -> float:
        """The length below which a fraction q of samples end."""
        lo, hi = 0.0, float(self.max_len)
        for _ in range(40):
            mid = 0.5 * (lo + hi)
            if 1 - self.survival(mid) < q:
                lo = mid
            else:
                hi = mid
        return hi

    def expected_max(self, n: int) -> float:
        """Typical longest of n samples (the quantile 1 − 1/(n+1))."""
        return self.quantile(1 - 1 / (n + 1))

    def sample(self, rng: random.Random, n: int) -> list[int]:
        """n lengths drawn with ``rng`` (deterministic for a seeded generator)."""
        out = []
        for _ in range(n):
            if self.max_len > self.mode and rng.random() < self.tail:
                x = rng.uniform(self.mode, self.max_len)
            else:
                x = rng.lognormvariate(self._mu, self.spread)
                while x > self.max_len:  # truncation, as in the survival function
                    x = rng.lognormvariate(self._mu, self.spread)
            out.append(max(1, min(self.max_len, round(x))))
        return out

    def grid(self, upto: float, points: int) -> list[tuple[float, float]]:
        """(k, S(k)) at the middle of ``points`` equal steps over [0, upto]."""
        step = upto / points
        return [((i + 0.5) * step, self.survival((i + 0.5) * step)) for i in range(points)]
