"""A weight version as its difference from the one before: what crosses sites when the relay holds that one.

Why: at RL learning rates most values do not change from one version to the next in the dtype
the generators load (a bf16 value moves only when an update exceeds its resolution), so the far
site's relay, which holds the previous version bit for bit, needs only what changed. The
difference is taken on the relay stream's own bytes: the tensors as the trainer publishes them,
already in the dtype the generators load, never on fp32 master weights.

Per tensor, against the tensor of the same name, dtype and shape in the base version, one of:

- ``same``: no bit differs; nothing is sent.
- ``sparse16`` / ``sparse32``: the changed elements' positions, as gaps (each position minus the
  one before, the first from 0) in 16 or 32 bits (the narrowest that holds the largest gap),
  then the XOR of their bits; each array as byte planes (byte 0 of every element, then byte 1,
  ...: the high bytes are mostly zeros, which zstd then all but drops), zstd level 1. Used when
  the positions and values take fewer bytes than the tensor (under half of bf16 values changed).
- ``xor_planes``: the XOR of the raw bytes, as byte planes, zstd level 1: when more changed.
- ``raw``: the tensor's bytes as they are: it has no base, or the encoding is not smaller.

The kind is chosen from a count of the changed elements, taken a block at a time as the XOR is
computed, and only that kind is built (see ``_encode_one``). Every entry carries the xxh3_64
digest of the tensor in the new version; :func:`apply` rebuilds each tensor and checks it against
that digest, so a wrong base, a wrong delta or a bug here can never hand out weights that differ
from the trainer's by a bit.

Format changes: the kinds name their format, so a relay given a kind it does not know (a newer
trainer's) fails the rebuild, says which kind, and fetches the whole version (reason
``checksum``, logged): loud, never wrong. ``sparse`` and ``xor`` (an earlier StreamRL's: int32 or
int64 gaps and values as they are; the XOR as it is) are still rebuilt, never produced.

Speed: tensors are encoded and rebuilt on a few threads at once (numpy and zstd release the
GIL), a block at a time: XORed into scratch space of one block per thread (not one tensor), and
rebuilt and hashed while the block is in cache. Pure: byte arrays in, bytes out, no sockets, no torch.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from math import prod
from typing import TypeVar

import msgspec
import numpy as np
import xxhash

from streamrl_cli.weights.plan import TensorSpec

KINDS = ("same", "sparse16", "sparse32", "xor_planes", "raw")  # what encode produces
LEGACY = ("sparse", "xor")  # rebuilt, never produced (see the module's doc)
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_GAPS = {"sparse16": np.uint16, "sparse32": np.uint32}
ZSTD_LEVEL = 1  # on byte planes of bf16 deltas, levels 2-5 came out no smaller, at 1.4-12x the time
BLOCK = 1 << 20  # bytes of a tensor XORed at a time (a multiple of every element size)
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
THREADS = min(8, CORES)  # tensors encoded or rebuilt at once

T = TypeVar("T")


class TensorDelta(msgspec.Struct, array_like=True, frozen=True):
    kind: str  # same | sparse16 | sparse32 | xor_planes | raw (| sparse | xor: older senders)
    offset: int  # where its payload starts in the delta stream
    length: int  # payload bytes
    changed: int  # elements that differ from the base (sparse*: the positions in the payload)
    digest: bytes  # xxh3_64 of the tensor's bytes in the new version


def digest(data: np.ndarray | memoryview | bytes) -> bytes:
    return xxhash.xxh3_64_digest(data)


def digests(stream: np.ndarray, specs: Sequence[TensorSpec]) -> list[bytes]:
    """Each tensor's digest in a stream laid out as `specs`."""
    return [digest(stream[s.offset : s.offset + s.nbytes]) for s in specs]


def stream_size(specs: Sequence[TensorSpec]) -> int:
    """Bytes of a full stream laid out as `specs` (``plan.stream_layout``'s total)."""
    return max((s.offset + s.nbytes for s in specs), default=0)


def _width(spec: TensorSpec) -> int:
    """Bytes per element, compared as one unsigned integer (1 for any other size)."""
    n = prod(spec.shape)
    width = spec.nbytes // n if n else 1
    return width if width in _UINT and width * n == spec.nbytes else 1


def _matches(a: TensorSpec | None, b: TensorSpec) -> bool:
    """`a` (the base's tensor of `b`'s name) is `b` in an earlier version: same dtype, shape, size."""
    return a is not None and (a.dtype, tuple(a.shape), a.nbytes) == (b.dtype, tuple(b.shape), b.nbytes)


# ---- threads: each keeps its scratch block and zstd contexts ----

_local = threading.local()
_pool_lock = threading.Lock()
_pool: tuple[int, ThreadPoolExecutor] | None = None  # (the pid that made it: not inherited by a fork)


def _ctx() -> threading.local:
    if not hasattr(_local, "block"):
        import zstandard

        _local.block = np.empty(BLOCK, dtype=np.uint8)
        _local.cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
        _local.dctx = zstandard.ZstdDecompressor()
    return _local


def _parallel(tasks: Sequence[tuple[int, Callable[[], T]]]) -> list[T]:
    """Each task's result, in order; (size, fn) tasks run on the pool, largest first. Returns once
    every task has ended (none still writes anywhere), raising the first one's error if any."""
    global _pool
    if THREADS == 1 or len(tasks) < 2:
        return [fn() for _, fn in tasks]
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), ThreadPoolExecutor(THREADS, thread_name_prefix="relay-delta"))
        pool = _pool[1]
    futures: list = [None] * len(tasks)
    for i in sorted(range(len(tasks)), key=lambda i: -tasks[i][0]):
        futures[i] = pool.submit(tasks[i][1])
    wait(futures)
    return [f.result() for f in futures]


def _xor(new: np.ndarray, old: np.ndarray, start: int, width: int) -> np.ndarray:
    """new ^ old over bytes [start, start + BLOCK), in this thread's scratch, as `width`-byte integers."""
    end = min(start + BLOCK, len(new))
    x = _ctx().block[: end - start]
    np.bitwise_xor(new[start:end], old[start:end], out=x)
    return x.view(_UINT[width])


def _unplanes(planes: np.ndarray, k: int, dtype: type) -> np.ndarray:
    """The `k` elements of `dtype` that `_put_planes` made `planes` of."""
    out = np.empty(k, dtype=dtype)
    w, b = out.itemsize, out.view(np.uint8)
    for i in range(w):
        b[i::w] = planes[i * k : (i + 1) * k]
    return out


def _xor_planes(new: np.ndarray, old: np.ndarray, width: int, out: np.ndarray, stop: int) -> None:
    """The XOR's byte planes of bytes [0, stop) (whole blocks) into `out` (the tensor's size)."""
    for s in range(0, min(stop, len(new)), BLOCK):
        _put_planes(_xor(new, old, s, width), out, s // width, len(new) // width)


def _put_planes(x: np.ndarray, out: np.ndarray, first: int, k: int) -> None:
    """Elements `x` (from element `first` of a tensor of `k`) into the tensor's byte planes `out`."""
    w, b = x.itemsize, x.view(np.uint8)
    for i in range(w):
        out[i * k + first : i * k + first + len(x)] = b[i::w]


def _nonzero(x: np.ndarray, c: int) -> tuple[np.ndarray, np.ndarray]:
    """The positions and values of the `c` nonzero elements of `x` (a block)."""
    k = 8 // x.itemsize  # elements per 64-bit word
    if k > 1 and c * k < len(x) // 3 and len(x) % k == 0:
        # Few: the nonzero words first (k times fewer to look at), then the elements in those; 1.6x
        # faster at 4% of bf16 values, slower from ~9%.
        words = x.view(np.uint64)
        w = np.flatnonzero(words != 0)
        e = words[w].view(x.dtype)
        f = np.flatnonzero(e != 0)
        shift = k.bit_length() - 1
        p = w[f >> shift]
        p <<= shift
        p |= f & (k - 1)
        return p, e[f]
    p = np.flatnonzero(x != 0)  # a bool mask's nonzero is ~3x faster than the integers'
    return p, x[p]


def _encode_one(new: np.ndarray, old: np.ndarray, width: int) -> tuple[str, int, bytes]:
    """(kind, changed elements, payload) of one tensor against its base.

    One pass, a block at a time: each block's changed elements are counted, and their gaps and
    values kept only while the count so far stays under what makes gaps (16-bit) and values as
    large as the tensor (half of bf16 values). Past that the XOR's byte planes are built instead,
    the blocks before included: the choice is the count's, as if counted first. What is kept
    meanwhile: 4 bytes per changed element, and its value."""
    n = len(new)
    store = np.uint32 if n // width < 2**32 else np.uint64  # a gap, until the largest is known
    gaps: list[np.ndarray] = []
    values: list[np.ndarray] = []
    planes = None  # the XOR's byte planes, once too many changed for gaps and values
    changed = last = top = 0
    for s in range(0, n, BLOCK):
        x = _xor(new, old, s, width)
        if planes is not None:
            changed += int(np.count_nonzero(x))
            _put_planes(x, planes, s // width, n // width)
            continue
        c = int(np.count_nonzero(x))
        changed += c
        if changed * (2 + width) >= n:
            planes = np.empty(n, dtype=np.uint8)
            _xor_planes(new, old, width, planes, s + BLOCK)  # overwrites x
            gaps.clear()  # the planes say it all
            values.clear()
        elif c:
            p, v = _nonzero(x, c)
            p += s // width
            g = np.diff(p, prepend=last)  # the first from 0 (format), then from the block before's last
            last, top = int(p[-1]), max(top, int(g.max()))
            gaps.append(g.astype(store))
            values.append(v)
    if changed == 0:
        return "same", 0, b""
    cctx = _ctx().cctx
    if planes is None and top > 0xFFFFFFFF:  # a gap of over 2**32 elements: no sparse kind says it
        planes = np.empty(n, dtype=np.uint8)
        _xor_planes(new, old, width, planes, n)
    if planes is None:
        kind = "sparse16" if top <= 0xFFFF else "sparse32"
        gw = np.dtype(_GAPS[kind]).itemsize
        buf = np.empty(changed * (gw + width), dtype=np.uint8)
        at = 0
        for g, v in zip(gaps, values, strict=True):
            _put_planes(g.astype(_GAPS[kind], copy=False), buf, at, changed)
            _put_planes(v, buf[changed * gw :], at, changed)
            at += len(g)
        packed = cctx.compress(buf)
    else:
        kind, packed = "xor_planes", cctx.compress(planes)
    if len(packed) >= n:
        return "raw", changed, new.tobytes()
    return kind, changed, packed


def encode(
    new: np.ndarray,
    specs: Sequence[TensorSpec],
    base: np.ndarray,
    base_specs: Sequence[TensorSpec],
    new_digests: Sequence[bytes],
) -> tuple[list[TensorDelta], bytes]:
    """The delta of stream `new` (laid out as `specs`) against stream `base`: one entry per tensor,
    and the delta stream their payloads make, in order. A tensor without a base of the same name,
    dtype and shape is sent raw."""
    by_name = {s.name: s for s in base_specs}

    def task(spec: TensorSpec) -> Callable[[], tuple[str, int, bytes]]:
        data = new[spec.offset : spec.offset + spec.nbytes]
        b = by_name.get(spec.name)
        if _matches(b, spec):
            old = base[b.offset : b.offset + b.nbytes]
            return lambda: _encode_one(data, old, _width(spec))
        return lambda: ("raw", prod(spec.shape), data.tobytes())

    done = _parallel([(s.nbytes, task(s)) for s in specs])
    entries, pos = [], 0
    for (kind, changed, payload), want in zip(done, new_digests, strict=True):
        entries.append(TensorDelta(kind, pos, len(payload), changed, want))
        pos += len(payload)
    return entries, b"".join(payload for _, _, payload in done)


def unchanged(new_digests: Sequence[bytes]) -> list[TensorDelta]:
    """The delta of a version against itself (a relay that holds it already): every tensor ``same``."""
    return [TensorDelta("same", 0, 0, 0, d) for d in new_digests]


def apply(
    stream: np.ndarray,
    entries: Sequence[TensorDelta],
    specs: Sequence[TensorSpec],
    base: np.ndarray,
    base_specs: Sequence[TensorSpec],
    out: np.ndarray,
) -> str | None:
    """Rebuild the new version into `out` (laid out as `specs`, `stream_size(specs)` bytes) from the
    `base` stream and the delta `stream`. Returns None once every tensor matches its digest, else
    which tensor did not and why (`out` then holds garbage: fetch the whole version)."""
    if len(entries) != len(specs):
        return f"{len(entries)} delta entries for {len(specs)} tensors"
    by_name = {s.name: s for s in base_specs}
    end = 0
    for spec in specs:
        out[end : spec.offset] = 0  # alignment padding, as the trainer's snapshot has it
        end = spec.offset + spec.nbytes
    out[end:] = 0

    def task(spec: TensorSpec, e: TensorDelta) -> Callable[[], str | None]:
        def rebuild() -> str | None:
            dst = out[spec.offset : spec.offset + spec.nbytes]
            b = by_name.get(spec.name)
            src = base[b.offset : b.offset + b.nbytes] if _matches(b, spec) else None
            why = _apply_one(stream, e, spec, src, dst)
            return None if why is None else f"tensor {spec.name!r} ({e.kind}): {why}"

        return rebuild

    failed = _parallel([(s.nbytes, task(s, e)) for s, e in zip(specs, entries, strict=True)])
    return next((why for why in failed if why is not None), None)


def _apply_one(
    stream: np.ndarray, e: TensorDelta, spec: TensorSpec, src: np.ndarray | None, dst: np.ndarray
) -> str | None:
    """Rebuild one tensor into `dst` from its base `src` (None: the base has no such tensor) and
    check its digest; a block at a time, each hashed while it is in cache."""
    import zstandard

    if e.kind not in KINDS and e.kind not in LEGACY:
        return f"unknown kind {e.kind!r} (from a newer StreamRL than this relay's?)"
    if e.offset < 0 or e.length < 0 or e.offset + e.length > len(stream):
        return f"entry out of the delta stream ({e.kind} at {e.offset}+{e.length} of {len(stream)})"
    payload = stream[e.offset : e.offset + e.length]
    n = spec.nbytes
    if e.kind == "raw" and e.length != n:
        return f"{e.length} raw bytes for {n}"
    if e.kind != "raw" and src is None:
        return "the base holds no such tensor"
    width = _width(spec)
    elements = n // width
    dctx = _ctx().dctx
    try:
        if e.kind == "raw":

            def block(s: int, end: int) -> None:
                dst[s:end] = payload[s:end]

        elif e.kind == "same":

            def block(s: int, end: int) -> None:
                dst[s:end] = src[s:end]

        elif e.kind in ("xor", "xor_planes"):
            raw = np.frombuffer(dctx.decompress(payload, max_output_size=n), dtype=np.uint8)
            if len(raw) != n:
                return f"{len(raw)} XOR bytes for {n}"

            def block(s: int, end: int) -> None:
                if e.kind == "xor":  # the XOR as it is
                    np.bitwise_xor(src[s:end], raw[s:end], out=dst[s:end])
                    return
                a, b = s // width, end // width
                for i in range(width):
                    plane = raw[i * elements + a : i * elements + b]
                    np.bitwise_xor(src[s + i : end : width], plane, out=dst[s + i : end : width])

        else:  # sparse*
            c = e.changed
            gap = _GAPS.get(e.kind) or (np.int32 if elements < 2**31 else np.int64)  # sparse: its index
            size = c * (np.dtype(gap).itemsize + width)
            raw = np.frombuffer(dctx.decompress(payload, max_output_size=size), dtype=np.uint8)
            if len(raw) != size or c <= 0:
                return f"{len(raw)} bytes for {c} changed elements"
            split = c * np.dtype(gap).itemsize
            if e.kind == "sparse":  # the arrays as they are
                gaps, values = raw[:split].view(gap), raw[split:].view(_UINT[width])
                if gaps.min() < 0:
                    return "a changed position outside the tensor"
            else:
                gaps, values = _unplanes(raw[:split], c, gap), _unplanes(raw[split:], c, _UINT[width])
            pos = np.cumsum(gaps, dtype=np.int64)  # ascending: no gap is negative
            if pos[-1] >= elements:
                return "a changed position outside the tensor"
            edges = np.searchsorted(pos, [min(s, n) // width for s in range(0, n + BLOCK, BLOCK)])
            view = dst.view(_UINT[width])

            def block(s: int, end: int) -> None:
                dst[s:end] = src[s:end]
                lo, hi = edges[s // BLOCK], edges[s // BLOCK + 1]
                view[pos[lo:hi]] ^= values[lo:hi]

        h = xxhash.xxh3_64()
        for s in range(0, n, BLOCK):
            end = min(s + BLOCK, n)
            block(s, end)
            h.update(dst[s:end])
    except zstandard.ZstdError as err:
        return f"undecodable: {err}"
    return None if h.digest() == e.digest else "checksum mismatch"
