"""Who owes which sample: the trainer side's bookkeeping for exactly-once delivery.

Pure state machine (no sockets, no clocks, not thread-safe: :class:`Dispatcher` holds the lock).
Every outstanding sample ``(prompt_id, sample_index)`` is in one of three states:

    assigned to a generator ──complete──► done (removed when its whole prompt is done)
          │ lose(generator)                  ▲
          ▼                                  │ complete (a late copy from the lost generator)
    open (waiting for a generator) ──────────┘
          │ assign
          └──────► assigned

A sample is accepted once: the first copy to arrive completes it, whatever generator sent it;
any later copy (a resend after a reconnection, the re-dispatched twin of a sample whose
generator was declared lost too early) is a duplicate. Prompts are forgotten once all their
samples are done, so memory is bounded by the work in flight; a copy that arrives after that is
``UNKNOWN`` and dropped like a duplicate. Prompt ids must therefore be unique within a run.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import msgspec

from streamrl_cli.transport.wire import Request


class Outcome(enum.Enum):
    NEW = "new"  # first copy: deliver it to the trainer
    DUPLICATE = "duplicate"  # already done: drop (but acknowledge)
    UNKNOWN = "unknown"  # no such outstanding prompt or index (finished long ago, or never sent)


@dataclass
class _Prompt:
    request: Request  # as first submitted (prompt tokens, priority, sampling)
    owner: dict[int, str | None]  # outstanding sample index -> generator (None: open)
    done: set[int] = field(default_factory=set)


class Ledger:
    """Outstanding samples per prompt and per generator."""

    def __init__(self) -> None:
        self._prompts: dict[str, _Prompt] = {}
        self._load: dict[str, int] = {}  # generator -> samples it owes
        self.stats = {"completed": 0, "duplicates": 0, "unknown": 0, "redispatched": 0, "cancelled": 0}

    # ---- queries ----

    def __len__(self) -> int:
        """Outstanding (not yet done) samples."""
        return sum(len(p.owner) for p in self._prompts.values())

    def load(self, generator: str) -> int:
        return self._load.get(generator, 0)

    def loads(self) -> dict[str, int]:
        return {g: n for g, n in self._load.items() if n}

    def owner(self, prompt_id: str, index: int) -> str | None:
        p = self._prompts.get(prompt_id)
        if p is None or index not in p.owner:
            raise KeyError(f"({prompt_id!r}, {index}) is not outstanding")
        return p.owner[index]

    def open_requests(self) -> list[Request]:
        """Requests for every open (unassigned) sample, one per prompt, in submission order."""
        out = []
        for p in self._prompts.values():
            idx = sorted(i for i, g in p.owner.items() if g is None)
            if idx:
                out.append(_narrow(p.request, idx))
        return out

    def is_done(self, prompt_id: str) -> bool:
        return prompt_id not in self._prompts

    # ---- transitions ----

    def add(self, request: Request) -> None:
        """Record a new prompt whose samples are all open (to be assigned)."""
        if request.prompt_id in self._prompts:
            raise ValueError(
                f"prompt {request.prompt_id!r} is already outstanding; prompt ids must be unique"
            )
        if not request.sample_indices or len(set(request.sample_indices)) != len(request.sample_indices):
            raise ValueError(f"prompt {request.prompt_id!r}: sample_indices must be distinct and non-empty")
        self._prompts[request.prompt_id] = _Prompt(request, dict.fromkeys(request.sample_indices))

    def assign(self, prompt_id: str, indices: Iterable[int], generator: str) -> Request:
        """Give open samples of a prompt to `generator`; returns the request to send it."""
        p = self._prompts.get(prompt_id)
        if p is None:
            raise KeyError(f"prompt {prompt_id!r} is not outstanding")
        indices = sorted(indices)
        for i in indices:
            if i not in p.owner:
                raise KeyError(f"({prompt_id!r}, {i}) is not outstanding")
            if p.owner[i] is not None:
                raise ValueError(f"({prompt_id!r}, {i}) is already assigned to {p.owner[i]}")
        for i in indices:
            p.owner[i] = generator
        self._load[generator] = self._load.get(generator, 0) + len(indices)
        return _narrow(p.request, indices)

    def complete(self, prompt_id: str, index: int) -> Outcome:
        """A copy of sample (prompt_id, index) arrived; say whether it is the first."""
        p = self._prompts.get(prompt_id)
        if p is None or (index not in p.owner and index not in p.done):
            self.stats["unknown"] += 1
            return Outcome.UNKNOWN
        if index in p.done:
            self.stats["duplicates"] += 1
            return Outcome.DUPLICATE
        g = p.owner.pop(index)
        if g is not None:
            self._drop_load(g, 1)
        p.done.add(index)
        self.stats["completed"] += 1
        if not p.owner:
            del self._prompts[prompt_id]
        return Outcome.NEW

    def lose(self, generator: str) -> list[Request]:
        """`generator` is gone: open everything it owed; returns that work as requests."""
        out = []
        for p in self._prompts.values():
            idx = sorted(i for i, g in p.owner.items() if g == generator)
            for i in idx:
                p.owner[i] = None
            if idx:
                out.append(_narrow(p.request, idx))
        self._load.pop(generator, None)
        self.stats["redispatched"] += sum(len(r.sample_indices) for r in out)
        return out

    def cancel(self, prompt_id: str) -> set[str]:
        """No sample of `prompt_id` is wanted any more: forget it (a copy arriving later is
        ``UNKNOWN``, dropped); returns the generators that still owed some of it."""
        p = self._prompts.pop(prompt_id, None)
        if p is None:
            return set()
        owed = Counter(g for g in p.owner.values() if g is not None)
        for g, n in owed.items():
            self._drop_load(g, n)
        self.stats["cancelled"] += len(p.owner)
        return set(owed)

    def owers(self, prompt_id: str) -> set[str]:
        """The generators that still owe samples of `prompt_id` (those a pause must reach)."""
        p = self._prompts.get(prompt_id)
        return {g for g in p.owner.values() if g is not None} if p is not None else set()

    def _drop_load(self, generator: str, n: int) -> None:
        left = self._load.get(generator, 0) - n
        assert left >= 0, f"load of {generator} would go negative"
        if left:
            self._load[generator] = left
        else:
            self._load.pop(generator, None)


def _narrow(request: Request, indices: list[int]) -> Request:
    if indices == request.sample_indices:
        return request
    return msgspec.structs.replace(request, sample_indices=list(indices))
