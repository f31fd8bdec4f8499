"""The order in which prompts are trained on: shuffled epochs (or the dataset's order), resumable.

Each epoch is a permutation drawn from ``(seed, epoch)`` alone (the identity with ``shuffle``
off: a curriculum the dataset is sorted for), so the position in the stream is
fully described by three numbers (:meth:`PromptSampler.state`). A run that is resumed from a
checkpoint loads them and continues with exactly the batches it would have seen, which keeps
resumed and uninterrupted runs comparable.

Prompts handed back (over-sampling's aborted groups, ``rollout.oversample``) are drawn first, in
the order they came back, before the epoch goes on; they are part of the state, so a resumed run
neither loses nor repeats them.
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
        self.returned: list[int] = []  # dataset positions handed back, drawn before the epoch goes on
        self._position = {p.prompt_id: k for k, p in enumerate(self.prompts)}

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(f"prompts-{self.seed}-{epoch}").shuffle(order)
        return order

    def next_batch(self, size: int | None = None) -> list[Prompt]:
        """The next `size` prompts (default: the batch size), handed-back ones first."""
        size = self.batch_size if size is None else size
        take = self.returned[:size]
        self.returned = self.returned[len(take) :]
        batch = [self.prompts[k] for k in take]
        while len(batch) < size:
            if self.index == len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            batch.append(self.prompts[self._order[self.index]])
            self.index += 1
        return batch

    def give_back(self, prompts: Sequence[Prompt]) -> list[int]:
        """Prompts drawn but not trained on (aborted): they come first in the next batches.
        Returns their dataset positions (what :meth:`state` records for them)."""
        out = self.positions(prompts)
        self.returned += out
        return out

    def positions(self, prompts: Sequence[Prompt]) -> list[int]:
        """The dataset positions of these prompts (a state's `returned` list names prompts by them)."""
        out = []
        for p in prompts:
            if p.prompt_id not in self._position:
                raise TaskError(f"prompt {p.prompt_id!r} handed back is not one of the task's")
            out.append(self._position[p.prompt_id])
        return out

    def state(self) -> dict[str, Any]:
        """Where the sampler is: enough to continue the same order after a restart."""
        out: dict[str, Any] = {"epoch": self.epoch, "index": self.index, "seed": self.seed}
        if self.returned:
            out["returned"] = list(self.returned)
        return out

    def load_state(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state` (its seed wins: the resumed run keeps the saved order)."""
        try:
            epoch, index, seed = int(state["epoch"]), int(state["index"]), int(state["seed"])
            returned = [int(k) for k in state.get("returned", [])]
        except (KeyError, TypeError, ValueError) as e:
            raise TaskError(f"prompt sampler state {state!r} is not {{epoch, index, seed}}: {e}") from e
        n = len(self.prompts)
        if epoch < 0 or not 0 <= index <= n or any(not 0 <= k < n for k in returned):
            raise TaskError(
                f"prompt sampler state {state!r} does not fit a dataset of {len(self.prompts)} prompts "
                "(did the dataset change since the checkpoint?)"
            )
        self.seed, self.epoch, self.index, self.returned = seed, epoch, index, returned
        self._order = self._permutation(epoch)
