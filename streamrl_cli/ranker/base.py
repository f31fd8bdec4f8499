"""The output-length ranker interface and the trivial rankers (``ranker.factory`` picks one).

Skewness-aware dispatching (docs/architecture.md) only needs to know which prompts will produce the longest
outputs: "rankability over predictability". A :class:`Ranker` therefore returns one score per
prompt, in tokens so that rankers can stand in for each other (the history ranker falls back on the
learned one, a cache on its ranker), but only the order of the scores is used. ``update`` feeds the
lengths the policy actually produced back, so that a ranker can follow the policy as it drifts.

Kinds (``skewness.ranker`` in a recipe): ``learned`` (a small LM fine-tuned online,
:mod:`.learned`), ``history`` (per-prompt statistics, the learned ranker for unseen prompts,
:mod:`.history`), ``oracle`` (the task's true lengths: the upper bound, for evaluation), ``none``.
``random`` is not a recipe choice: it is the baseline that tests and benchmarks compare with.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Sequence

from streamrl_cli.errors import StreamRLError
from streamrl_cli.tasks import Prompt, Task

KINDS = ("none", "learned", "history", "oracle", "random")


class RankerError(StreamRLError):
    """A ranker could not be made or used: unknown kind, missing model, unreadable cache."""

    exit_code = 2


class Ranker(ABC):
    """Predicts output lengths of prompts; learns from the lengths the policy produced."""

    kind: str = "?"

    @abstractmethod
    def rank(self, prompts: Sequence[Prompt]) -> list[float]:
        """Predicted output length in tokens of each prompt (only their order matters)."""

    def update(self, prompts: Sequence[Prompt], lengths: Sequence[float]) -> None:  # noqa: B027
        """Observed output lengths (e.g. the mean over a GRPO group), one call per iteration.
        Must return at once: learning, if any, happens in the background."""

    def fit(self, prompts: Sequence[Prompt], lengths: Sequence[float]) -> None:
        """Learn from ``lengths`` now, before returning (offline use: ``streamrl rank --fit``)."""
        self.update(prompts, lengths)
        self.wait_idle()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no background learning is pending or running; False on timeout."""
        return True

    def close(self) -> None:  # noqa: B027
        """Stop background work and free the model."""

    def __enter__(self) -> Ranker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class OracleRanker(Ranker):
    """The task's exact expected lengths: the best any ranker can do."""

    kind = "oracle"

    def __init__(self, task: Task):
        expected = getattr(task, "expected_length", None)
        if expected is None:
            raise RankerError(
                f"skewness.ranker=oracle: task {task.name!r} knows no expected output lengths "
                "(only the built-in repeat task does); use ranker=learned or ranker=history"
            )
        self._expected = expected

    def rank(self, prompts: Sequence[Prompt]) -> list[float]:
        return [float(self._expected(p)) for p in prompts]


class RandomRanker(Ranker):
    """Scores drawn from ``seed`` and the prompt id: the evaluation baseline (recall@k ≈ k)."""

    kind = "random"

    def __init__(self, seed: int = 0):
        self.seed = seed

    def rank(self, prompts: Sequence[Prompt]) -> list[float]:
        # Per-prompt seeding: the same prompt gets the same score whatever batch it comes in.
        return [random.Random(f"rank-{self.seed}-{p.prompt_id}").random() for p in prompts]
