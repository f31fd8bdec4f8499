"""The order in which prompts are trained on: shuffled epochs (or the dataset's order), resumable.

Each epoch is a permutation drawn from ``(seed, epoch)`` alone (the identity with ``shuffle``
off: a curriculum the dataset is sorted for), so the position in the stream is
fully described by three numbers (:meth:`PromptSampler.state`). A run that is resumed from a
checkpoint loads them and continues with exactly the batches it would have seen, which keeps
resumed and uninterrupted runs comparable.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from streamrl_cli.tasks import Prompt, TaskError


class PromptSampler:
    """Batches of ``batch_size`` prompts; a batch may span the end of one epoch and the next."""

    def __init__(self, prompts: Sequence[Prompt], batch_size: int, seed: int = 0, shuffle: bool = True):
        if not prompts:
            raise TaskError("the task has no prompts to sample from")
        if batch_size < 1:
            raise TaskError(f"train.global_batch must be at least 1, got {batch_size}")
        self.prompts = list(prompts)
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.index = 0  # position inside the current epoch's permutation
        self._order = self._permutation(self.epoch)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(f"prompts-{self.seed}-{epoch}").shuffle(order)
        return order

    def next_batch(self) -> list[Prompt]:
        batch = []
        while len(batch) < self.batch_size:
            if self.index == len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            batch.append(self.prompts[self._order[self.index]])
            self.index += 1
        return batch

    def state(self) -> dict[str, int]:
        """Where the sampler is: enough to continue the same order after a restart."""
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed}

    def load_state(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state` (its seed wins: the resumed run keeps the saved order)."""
        try:
            epoch, index, seed = int(state["epoch"]), int(state["index"]), int(state["seed"])
        except (KeyError, TypeError, ValueError) as e:
            raise TaskError(f"prompt sampler state {state!r} is not {{epoch, index, seed}}: {e}") from e
        if epoch < 0 or not 0 <= index <= len(self.prompts):
            raise TaskError(
                f"prompt sampler state {state!r} does not fit a dataset of {len(self.prompts)} prompts "
                "(did the dataset change since the checkpoint?)"
            )
        self.seed, self.epoch, self.index = seed, epoch, index
        self._order = self._permutation(epoch)
