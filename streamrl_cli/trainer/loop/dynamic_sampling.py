"""DAPO's dynamic sampling as one iteration's bookkeeping: which finished groups count, how many
more to draw, and when the batch is complete (pure state; the pipeline dispatches and trains).

Why a group may not count: a group whose rewards are all equal has every group-relative advantage
0, so it adds tokens to the loss's denominator and nothing to its gradient (DAPO, arXiv:2503.14476,
§3.2). Such a group is dropped, and the iteration waits for another: first among the groups already
out (over-sampled ones, ``rollout.oversample``), then among groups drawn for it, but only as many as
even the groups still out, were they all informative, could not make up. Drawing is bounded per
iteration; past the bound, once nothing is out any more, the batch trains with fewer groups, and
says so (a warning and the ``dynamic_sampling/short_groups`` metric).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Refill:
    """One iteration's groups under dynamic sampling."""

    needed: int  # informative groups the iteration trains on (train.global_batch)
    budget: int  # groups it may draw beyond its first dispatch, at most
    outstanding: int  # groups dispatched and not finished yet (over-sampled ones included)
    kept: int = 0  # finished groups that count (their rewards differ)
    dropped: int = 0  # finished groups whose rewards were all equal
    drawn: int = 0  # groups drawn to replace dropped ones

    def finished(self, informative: bool) -> None:
        """A group of the iteration finished."""
        self.outstanding -= 1
        if informative:
            self.kept += 1
        else:
            self.dropped += 1

    def to_draw(self) -> int:
        """How many groups to draw now: what the groups still out cannot make up, within the budget."""
        if self.kept >= self.needed:
            return 0
        missing = self.needed - self.kept - self.outstanding
        return max(0, min(missing, self.budget - self.drawn))

    def drew(self, n: int) -> None:
        """`n` groups were drawn and dispatched for the iteration."""
        self.drawn += n
        self.outstanding += n

    @property
    def complete(self) -> bool:
        """The batch has its groups, or will get no more (nothing out, nothing left to draw)."""
        return self.kept >= self.needed or (self.outstanding <= 0 and self.to_draw() == 0)

    @property
    def short(self) -> int:
        """Groups the iteration trains fewer than it should (0 unless the budget ran out)."""
        return max(0, self.needed - self.kept)

    def record(self) -> dict[str, float]:
        """The iteration's metrics: groups dropped, drawn to refill, missing, and the dropped share."""
        done = self.kept + self.dropped
        return {
            "dynamic_sampling/dropped_groups": self.dropped,
            "dynamic_sampling/refilled_groups": self.drawn,
            "dynamic_sampling/short_groups": self.short,
            "dynamic_sampling/drop_share": self.dropped / done if done else 0.0,
        }
