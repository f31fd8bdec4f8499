"""Multi-turn trajectories' lengths predicted turn by turn: turns × model tokens per turn.

A trajectory's generated tokens are its model's over all its turns (docs/agents.md). Learning that
total alone mixes two things that vary for different reasons: how many turns an episode takes (the
environment, the task's difficulty, tool use) and how much the model writes in a turn (the policy's
verbosity). Each turn is an observation of the second, so a prompt's tokens per turn are known from
many more observations than its totals, and its turn count from every trajectory of its group.

:class:`TurnRanker` keeps, per prompt id, a slowly forgetting mean of each (as the history ranker
keeps one of totals, over roughly the last ``window`` observations) and scores a prompt seen before
as turns × tokens per turn; prompts never seen are scored by the ranker it wraps (the recipe's
``skewness.ranker``), which still learns the totals. The trainer feeds it per group (its
``update_turns``): the most model turns of the group's trajectories (a group comes back when its
longest ends), and the model tokens per turn over all of the group's turns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from streamrl_cli.ranker.base import Ranker
from streamrl_cli.ranker.history import Seen
from streamrl_cli.tasks import Prompt


@runtime_checkable
class TurnLearner(Protocol):
    """A ranker that learns from multi-turn trajectories' turns (the trainer feeds it if it is one)."""

    def update_turns(
        self, prompts: Sequence[Prompt], turns: Sequence[float], per_turn: Sequence[float]
    ) -> None: ...


class TurnRanker(Ranker):
    """Turns × tokens per turn for prompts seen, ``inner`` for the others."""

    kind = "turns"

    def __init__(self, inner: Ranker, window: int = 4):
        self.inner = inner
        self.window = max(1, window)
        self.turns: dict[str, Seen] = {}  # prompt id -> the most model turns in its group
        self.per_turn: dict[str, Seen] = {}  # prompt id -> model tokens per turn, over its group's turns

    def rank(self, prompts: Sequence[Prompt]) -> list[float]:
        scores: list[float | None] = [self._predict(p.prompt_id) for p in prompts]
        unseen = [i for i, s in enumerate(scores) if s is None]
        if unseen:
            for i, s in zip(unseen, self.inner.rank([prompts[i] for i in unseen]), strict=True):
                scores[i] = s
        return [float(s) for s in scores]  # type: ignore[arg-type]

    def _predict(self, prompt_id: str) -> float | None:
        if prompt_id not in self.turns:
            return None
        return self.turns[prompt_id].mean * self.per_turn[prompt_id].mean

    def update_turns(
        self, prompts: Sequence[Prompt], turns: Sequence[float], per_turn: Sequence[float]
    ) -> None:
        """Per group: the most model turns of its trajectories, its model tokens per turn."""
        if not len(prompts) == len(turns) == len(per_turn):
            raise ValueError(
                f"{len(prompts)} prompts, {len(turns)} turn counts, {len(per_turn)} per-turn lengths"
            )
        for p, t, n in zip(prompts, turns, per_turn, strict=True):
            if t > 0:  # a trajectory with no model turn (its environment failed at reset) says nothing
                self.turns.setdefault(p.prompt_id, Seen()).add(float(t), self.window)
                self.per_turn.setdefault(p.prompt_id, Seen()).add(float(n), self.window)

    def update(self, prompts: Sequence[Prompt], lengths: Sequence[float]) -> None:
        self.inner.update(prompts, lengths)

    def fit(self, prompts: Sequence[Prompt], lengths: Sequence[float]) -> None:
        self.inner.fit(prompts, lengths)

    def wait_idle(self, timeout: float | None = None) -> bool:
        return self.inner.wait_idle(timeout)

    def close(self) -> None:
        self.inner.close()


def group_turns(episodes: Sequence[tuple[int, int]]) -> tuple[float, float]:
    """A group's (turns, tokens per turn) from its trajectories' (model turns, model tokens): the
    most turns any took (the group comes back when its longest ends: most often the one with most
    turns), the tokens per turn over all their turns (0, 0: no model turn at all)."""
    total_turns = sum(t for t, _ in episodes)
    if not total_turns:
        return 0.0, 0.0
    return float(max(t for t, _ in episodes)), sum(n for _, n in episodes) / total_turns
