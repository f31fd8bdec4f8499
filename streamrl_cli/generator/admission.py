"""The generator's admission queue: exact in-instance order and a per-instance batch size.

Why not leave it to vLLM: its priority scheduling orders only the *waiting* requests, never preempts
a running one, and admits as many as max_num_seqs and the KV cache allow. Skewness-aware
scheduling (docs/architecture.md) wants more: run at most BS sequences (Algorithm 2's batch size for this
instance), admit requests in descending predicted length, and whenever one finishes admit the
longest remaining one (Longest-Processing-Time first). So the generator role holds requests here
and hands the engine only what fits:

    sample sender ──add──► Admission ──ready──► engine.generate ──result──► finish ─┐
                              ▲                                                      │
                              └──────────────── capacity freed ◄─────────────────────┘

A request's `size` is its number of sequences (a GRPO group of n counts n, admitted whole); its
`limit` is the batch size its dispatcher chose (0: no limit); its `priority` orders admission
(lower first; ties in arrival order, so all-zero priorities are FIFO). The head of the queue is
admitted when it fits under its own limit, or when nothing runs (a group larger than the limit
still runs, alone). Nothing behind a head that does not fit jumps ahead: the order stays exact.
Pure state machine: no engine, no clock, no event loop.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(order=True)
class _Waiting(Generic[T]):
    priority: int
    arrival: int
    key: str = field(compare=False)
    item: T = field(compare=False)
    size: int = field(compare=False)
    limit: int = field(compare=False)


class Admission(Generic[T]):
    """Requests waiting to enter the engine, and the sequences running in it."""

    def __init__(self) -> None:
        self._heap: list[_Waiting[T]] = []
        self._arrivals = itertools.count()
        self._running: dict[str, int] = {}  # key -> sequences
        self.running = 0  # sequences in the engine

    @property
    def waiting(self) -> int:
        """Requests not yet admitted."""
        return len(self._heap)

    def add(self, key: str, item: T, *, size: int = 1, priority: int = 0, limit: int = 0) -> None:
        """Queue a request; `key` must be unique among those queued or running (the engine's id)."""
        if size < 1 or limit < 0:
            raise ValueError(f"request {key}: size must be ≥ 1 and limit ≥ 0 (got {size}, {limit})")
        heapq.heappush(self._heap, _Waiting(priority, next(self._arrivals), key, item, size, limit))

    def ready(self) -> list[T]:
        """Pop what may enter the engine now, in admission order, and count it as running."""
        out = []
        while self._heap:
            head = self._heap[0]
            if self.running and head.limit and self.running + head.size > head.limit:
                break
            heapq.heappop(self._heap)
            if head.key in self._running:
                raise ValueError(f"request {head.key} is already running")
            self._running[head.key] = head.size
            self.running += head.size
            out.append(head.item)
        return out

    def drop_waiting(self) -> int:
        """Forget every request not yet admitted (their dispatcher is gone); returns how many."""
        n = len(self._heap)
        self._heap.clear()
        return n

    def waiting_keys(self) -> list[str]:
        """The requests not yet admitted (in no particular order)."""
        return [w.key for w in self._heap]

    def drop(self, keys: set[str]) -> list[T]:
        """Forget the waiting requests among `keys` (cancelled); returns those that were waiting."""
        kept = [w for w in self._heap if w.key not in keys]
        dropped = [w.item for w in self._heap if w.key in keys]
        if dropped:
            self._heap = kept
            heapq.heapify(self._heap)
        return dropped

    def running_keys(self) -> list[str]:
        """The requests in the engine now."""
        return list(self._running)

    def finish(self, key: str) -> None:
        """A request left the engine (finished, failed or aborted): its sequences free their places."""
        size = self._running.pop(key, None)
        if size is None:
            raise KeyError(f"request {key} is not running")
        self.running -= size
