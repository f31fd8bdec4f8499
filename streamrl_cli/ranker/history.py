"""The history ranker: a prompt's own past output lengths, the learned ranker for prompts never seen.

RL revisits the same prompts epoch after epoch, and the best predictor of what the policy will write
for a prompt is what it wrote for it last time. Per prompt id it keeps a running mean of the
observed lengths that forgets slowly (a mean over roughly the last ``window`` observations), so it
follows the policy as its lengths drift. Prompts with no history are scored by the fallback (the
learned ranker), whose predictions are shifted onto the history's scale: the mean gap between
log(observed) and log(what the fallback predicted before seeing it) is tracked, so that a fallback
lagging a drifting policy does not put every unseen prompt below (or above) every seen one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from streamrl_cli.ranker.base import Ranker
from streamrl_cli.tasks import Prompt


@dataclass
class Seen:
    """Running statistics of one prompt's observed output lengths."""

    mean: float = 0.0
    count: int = 0

    def add(self, length: float, window: int) -> None:
        self.count += 1
        self.mean += (length - self.mean) / min(self.count, window)


class HistoryRanker(Ranker):
    """History for seen prompts, ``fallback`` (calibrated) for the rest; None: the mean of history."""

    kind = "history"

    def __init__(self, fallback: Ranker | None, window: int = 4, bias_decay: float = 0.7):
        self.fallback = fallback
        self.window = max(1, window)
        self.bias_decay = bias_decay  # weight of the old log-bias when a new iteration's is blended in
        self.seen: dict[str, Seen] = {}
        self.log_bias = 0.0  # mean log(1 + observed) - log(1 + fallback's prediction)
        self._calibrated = False

    def rank(self, prompts: Sequence[Prompt]) -> list[float]:
        scores: list[float | None] = [
            self.seen[p.prompt_id].mean if p.prompt_id in self.seen else None for p in prompts
        ]
        unseen = [i for i, s in enumerate(scores) if s is None]
        if unseen:
            for i, s in zip(unseen, self._unseen([prompts[i] for i in unseen]), strict=True):
                scores[i] = s
        return [float(s) for s in scores]  # type: ignore[arg-type]

    def _unseen(self, prompts: list[Prompt]) -> list[float]:
        if self.fallback is None:
            known = [s.mean for s in self.seen.values()]
            return [sum(known) / len(known) if known else 0.0] * len(prompts)
        predicted = self.fallback.rank(prompts)
        if not self._calibrated:
            return predicted
        return [math.expm1(math.log1p(max(0.0, s)) + self.log_bias) for s in predicted]

    def update(self, prompts: Sequence[Prompt], lengths: Sequence[float]) -> None:
        if len(prompts) != len(lengths):
            raise ValueError(f"{len(prompts)} prompts but {len(lengths)} lengths")
        if self.fallback is not None and prompts:
            self._calibrate(prompts, lengths)
        self._record(prompts, lengths)
        if self.fallback is not None:
            self.fallback.update(prompts, lengths)

    def fit(self, prompts: Sequence[Prompt], lengths: Sequence[float]) -> None:
        self._record(prompts, lengths)
        if self.fallback is not None:
            self.fallback.fit(prompts, lengths)

    def _record(self, prompts: Sequence[Prompt], lengths: Sequence[float]) -> None:
        for p, n in zip(prompts, lengths, strict=True):
            self.seen.setdefault(p.prompt_id, Seen()).add(float(n), self.window)

    def _calibrate(self, prompts: Sequence[Prompt], lengths: Sequence[float]) -> None:
        """Blend this iteration's log gap between truth and the fallback's (pre-update) predictions."""
        predicted = self.fallback.rank(prompts)  # type: ignore[union-attr]
        gap = sum(
            math.log1p(max(0.0, float(n))) - math.log1p(max(0.0, s))
            for n, s in zip(lengths, predicted, strict=True)
        ) / len(prompts)
        self.log_bias = (
            gap if not self._calibrated else self.bias_decay * self.log_bias + (1 - self.bias_decay) * gap
        )
        self._calibrated = True

    def wait_idle(self, timeout: float | None = None) -> bool:
        return self.fallback.wait_idle(timeout) if self.fallback is not None else True

    def close(self) -> None:
        if self.fallback is not None:
            self.fallback.close()
