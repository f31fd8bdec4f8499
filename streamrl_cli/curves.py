"""Small numeric helpers over measured curves and samples, shared by the planner and skew.

Pure functions with no imports of this package: the planner's cost model and the runtime
dispatcher (skew) both read curves through them, so neither has to import the other.
"""

from __future__ import annotations

from collections.abc import Sequence


def interpolate(points: Sequence[tuple[float, float]], x: float) -> float:
    """Piecewise-linear through sorted (x, y) points; flat below, last slope above the range."""
    pts = sorted(points)
    if len(pts) == 1 or x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = pts[-2], pts[-1]
    return y1 + (y1 - y0) * (x - x1) / (x1 - x0)


def monotone(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """Isotonic (non-decreasing) least-squares fit of y over sorted x: pool adjacent violators."""
    blocks: list[list[float]] = []  # [sum of y, count, first x index]
    pts = sorted(points)
    for i, (_, y) in enumerate(pts):
        blocks.append([y, 1, i])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, n, _ = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += n
    out = []
    for s, n, start in blocks:
        out += [(pts[start + j][0], s / n) for j in range(int(n))]
    return out


def empirical_quantile(values: list[int], q: float) -> float:
    """Quantile of observed lengths (dispatchers learn the long tail from recent lengths)."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("no values")
    return float(ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))])
