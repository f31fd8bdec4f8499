"""Pure planning for weight transfer: where each tensor's bytes go, and which chunks are still owed.

No torch, no sockets: what the two transfer paths decide is decided here, and tested alone.

- :func:`plan_buckets` (broadcast inside a site): tensors grouped by dtype and packed into flat
  buckets of at most ``bucket_bytes``, so that a model of thousands of tensors moves in a few
  large collective calls; a tensor larger than a bucket gets a bucket of its own (never split:
  an engine loads whole tensors).
- :func:`stream_layout` (relay across sites): every tensor at a 64-byte aligned offset of one
  byte stream, which is cut into fixed-size chunks; aligned offsets let the receiver view its
  buffer as typed tensors without a copy.
- :class:`ChunkPlanner`: the relay receiver's state machine — which chunks are missing, in
  flight on which stream, verified — so that a broken stream only gives back its in-flight
  chunks and a corrupted chunk is asked for again, a bounded number of times.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import msgspec

ALIGN = 64


class TensorSpec(msgspec.Struct, array_like=True, frozen=True):
    name: str
    dtype: str  # torch dtype name without the "torch." prefix ("bfloat16")
    shape: tuple[int, ...]
    offset: int  # bytes from the start of its bucket (broadcast) or of the stream (relay)
    nbytes: int


class Bucket(msgspec.Struct, array_like=True, frozen=True):
    dtype: str
    nbytes: int
    tensors: tuple[TensorSpec, ...]


class Plan(msgspec.Struct, array_like=True, frozen=True):
    """What a broadcast receiver needs to cut the buckets back into named tensors."""

    version: int
    buckets: tuple[Bucket, ...]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)


Entry = tuple[str, str, tuple[int, ...], int]  # name, dtype, shape, nbytes


def plan_buckets(
    entries: Iterable[Entry], bucket_bytes: int, version: int = 0, solo_bytes: int | None = None
) -> Plan:
    """Pack tensors into per-dtype buckets of at most `bucket_bytes`, in their given order.

    A tensor of `solo_bytes` or more (default: `bucket_bytes`) gets a bucket of its own, emitted
    as soon as it is met: it is already a large flat buffer, which the sender can broadcast in
    place instead of copying it.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    solo = bucket_bytes if solo_bytes is None else solo_bytes
    by_dtype: dict[str, list[Entry]] = {}
    for e in entries:
        by_dtype.setdefault(e[1], []).append(e)
    buckets: list[Bucket] = []
    for dtype, items in by_dtype.items():
        current: list[TensorSpec] = []
        size = 0
        for name, _, shape, nbytes in items:
            if nbytes >= solo and nbytes > 0:
                buckets.append(Bucket(dtype, nbytes, (TensorSpec(name, dtype, tuple(shape), 0, nbytes),)))
                continue
            if current and size + nbytes > bucket_bytes:
                buckets.append(Bucket(dtype, size, tuple(current)))
                current, size = [], 0
            current.append(TensorSpec(name, dtype, tuple(shape), size, nbytes))
            size += nbytes
        if current:
            buckets.append(Bucket(dtype, size, tuple(current)))
    return Plan(version, tuple(buckets))


def stream_layout(entries: Iterable[Entry], align: int = ALIGN) -> tuple[list[TensorSpec], int]:
    """Offsets of every tensor in one byte stream (each aligned to `align`), and its total length."""
    specs, pos = [], 0
    for name, dtype, shape, nbytes in entries:
        pos = -(-pos // align) * align
        specs.append(TensorSpec(name, dtype, tuple(shape), pos, nbytes))
        pos += nbytes
    return specs, pos


def chunk_count(total: int, chunk_bytes: int) -> int:
    return max(1, -(-total // chunk_bytes))


def chunk_range(index: int, total: int, chunk_bytes: int) -> tuple[int, int]:
    """[start, end) of chunk `index` in a stream of `total` bytes."""
    start = index * chunk_bytes
    return start, min(total, start + chunk_bytes)


class ChunkPlanner:
    """Missing -> in flight (on one stream) -> verified; failures go back to missing, a few times."""

    def __init__(self, n_chunks: int, max_attempts: int = 5, have: Iterable[int] = ()):
        self.n = n_chunks
        self.max_attempts = max_attempts
        self.verified: set[int] = set(have)
        self._missing = deque(i for i in range(n_chunks) if i not in self.verified)
        self._in_flight: dict[int, int] = {}  # chunk -> stream
        self.attempts: dict[int, int] = {}  # chunk -> times it failed verification
        self.error: str | None = None

    @property
    def complete(self) -> bool:
        return len(self.verified) == self.n

    @property
    def done(self) -> bool:
        """Nothing more to do: complete, or failed for good."""
        return self.complete or self.error is not None

    def missing(self) -> int:
        return len(self._missing)

    def in_flight(self, stream: int | None = None) -> list[int]:
        return sorted(c for c, s in self._in_flight.items() if stream is None or s == stream)

    def take(self, stream: int, n: int) -> list[int]:
        """Up to `n` missing chunks for `stream` to request (lowest first; retries first)."""
        out = []
        while self._missing and len(out) < n and self.error is None:
            c = self._missing.popleft()
            self._in_flight[c] = stream
            out.append(c)
        return out

    def verified_ok(self, chunk: int) -> None:
        if self._in_flight.pop(chunk, None) is None and chunk not in self.verified:
            raise ValueError(f"chunk {chunk} was not requested")
        self.verified.add(chunk)

    def failed(self, chunk: int, reason: str) -> None:
        """Chunk arrived corrupted: ask again, unless it failed `max_attempts` times."""
        if self._in_flight.pop(chunk, None) is None:
            raise ValueError(f"chunk {chunk} was not in flight")
        n = self.attempts[chunk] = self.attempts.get(chunk, 0) + 1
        if n >= self.max_attempts:
            self.error = f"chunk {chunk} failed verification {n} times (last: {reason})"
        else:
            self._missing.appendleft(chunk)

    def release(self, stream: int) -> list[int]:
        """`stream` broke: its in-flight chunks are missing again (not a verification failure)."""
        back = self.in_flight(stream)
        for c in back:
            del self._in_flight[c]
        self._missing.extendleft(reversed(back))
        return back

    def fail(self, reason: str) -> None:
        self.error = self.error or reason
