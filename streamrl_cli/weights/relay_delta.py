"""A weight version as its difference from the one before: what crosses sites when the relay holds that one.

Why: at RL learning rates most values do not change from one version to the next in the dtype
the generators load (a bf16 value moves only when an update exceeds its resolution), so the far
site's relay, which holds the previous version bit for bit, needs only what changed. The
difference is taken on the relay stream's own bytes: the tensors as the trainer publishes them,
already in the dtype the generators load, never on fp32 master weights.

Per tensor, against the tensor of the same name, dtype and shape in the base version, one of:

- ``same``: no bit differs; nothing is sent.
- ``xor``: the XOR of the raw bytes (mostly zeros), zstd-compressed.
- ``sparse``: the changed elements' positions (as gaps) and the XOR of their bits, zstd-compressed;
  used instead of ``xor`` when fewer elements changed than make it the larger (see ``_encode_one``).
- ``raw``: the tensor's bytes as they are: it has no base, or neither encoding is smaller.

Every entry carries the xxh3_64 digest of the tensor in the new version; :func:`apply` rebuilds
each tensor and checks it against that digest, so a wrong base, a wrong delta or a bug here can
never hand out weights that differ from the trainer's by a bit. Pure: byte arrays in, bytes out,
no sockets, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import prod

import msgspec
import numpy as np
import xxhash

from streamrl_cli.weights.plan import TensorSpec

KINDS = ("same", "xor", "sparse", "raw")
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
ZSTD_LEVEL = 1  # level 3 saved < 2% more on bf16 deltas here, at twice the time
ZSTD_THREADS_FROM = 16 << 20  # tensors this large are compressed on every core


class TensorDelta(msgspec.Struct, array_like=True, frozen=True):
    kind: str  # same | xor | sparse | raw
    offset: int  # where its payload starts in the delta stream
    length: int  # payload bytes
    changed: int  # elements that differ from the base (sparse: the positions in the payload)
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


def _index_dtype(elements: int) -> type:
    return np.int32 if elements < 2**31 else np.int64


def _compress(data: np.ndarray | bytes) -> bytes:
    import zstandard

    threads = -1 if len(data) >= ZSTD_THREADS_FROM else 0
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL, threads=threads).compress(data)


def _decompress(data: memoryview, size: int) -> bytes:
    import zstandard

    return zstandard.ZstdDecompressor().decompress(data, max_output_size=size)


def _encode_one(new: np.ndarray, old: np.ndarray, width: int, scratch: np.ndarray) -> tuple[str, int, bytes]:
    """(kind, changed elements, payload) of one tensor against its base."""
    n = len(new)
    x = scratch[:n]
    np.bitwise_xor(new, old, out=x)
    xe = x.view(_UINT[width])
    changed = int(np.count_nonzero(xe))
    if changed == 0:
        return "same", 0, b""
    index = _index_dtype(len(xe))
    # One encoding, chosen by the count: positions and values whenever they take fewer bytes than the
    # tensor before compression (under ~1/3 of bf16 values changed), which also compressed smaller
    # than the XOR in every case measured; compressing both doubled the time of a publish.
    if changed * (np.dtype(index).itemsize + width) < n:
        pos = np.flatnonzero(xe)
        kind, packed = (
            "sparse",
            _compress(np.diff(pos, prepend=0).astype(index).tobytes() + xe[pos].tobytes()),
        )
    else:
        kind, packed = "xor", _compress(x)
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
    scratch = np.empty(max((s.nbytes for s in specs), default=0), dtype=np.uint8)
    entries, payloads, pos = [], [], 0
    for spec, want in zip(specs, new_digests, strict=True):
        data = new[spec.offset : spec.offset + spec.nbytes]
        b = by_name.get(spec.name)
        if _matches(b, spec):
            old = base[b.offset : b.offset + b.nbytes]
            kind, changed, payload = _encode_one(data, old, _width(spec), scratch)
        else:
            kind, changed, payload = "raw", prod(spec.shape), data.tobytes()
        entries.append(TensorDelta(kind, pos, len(payload), changed, want))
        payloads.append(payload)
        pos += len(payload)
    return entries, b"".join(payloads)


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
    for spec, e in zip(specs, entries, strict=True):
        out[end : spec.offset] = 0  # alignment padding, as the trainer's snapshot has it
        end = spec.offset + spec.nbytes
        dst = out[spec.offset : end]
        b = by_name.get(spec.name)
        src = base[b.offset : b.offset + b.nbytes] if _matches(b, spec) else None
        why = _apply_one(stream, e, spec, src, dst)
        if why is None and digest(dst) != e.digest:
            why = "checksum mismatch"
        if why is not None:
            return f"tensor {spec.name!r} ({e.kind}): {why}"
    out[end:] = 0
    return None


def _apply_one(
    stream: np.ndarray, e: TensorDelta, spec: TensorSpec, src: np.ndarray | None, dst: np.ndarray
) -> str | None:
    """Rebuild one tensor into `dst` from its base `src` (None: the base has no such tensor)."""
    import zstandard

    if e.kind not in KINDS or e.offset < 0 or e.length < 0 or e.offset + e.length > len(stream):
        return f"entry out of the delta stream ({e.kind} at {e.offset}+{e.length} of {len(stream)})"
    payload = memoryview(stream[e.offset : e.offset + e.length])
    n = spec.nbytes
    if e.kind == "raw":
        if e.length != n:
            return f"{e.length} raw bytes for {n}"
        dst[:] = np.frombuffer(payload, dtype=np.uint8)
        return None
    if src is None:
        return "the base holds no such tensor"
    width = _width(spec)
    try:
        if e.kind == "same":
            dst[:] = src
        elif e.kind == "xor":
            raw = _decompress(payload, n)
            if len(raw) != n:
                return f"{len(raw)} XOR bytes for {n}"
            np.bitwise_xor(src, np.frombuffer(raw, dtype=np.uint8), out=dst)
        else:  # sparse
            elements = n // width
            index = np.dtype(_index_dtype(elements))
            size = e.changed * (index.itemsize + width)
            raw = _decompress(payload, size)
            if len(raw) != size or e.changed <= 0:
                return f"{len(raw)} bytes for {e.changed} changed elements"
            pos = np.cumsum(np.frombuffer(raw, dtype=index, count=e.changed), dtype=np.int64)
            if pos[0] < 0 or pos[-1] >= elements:
                return "a changed position outside the tensor"
            dst[:] = src
            view = dst.view(_UINT[width])
            view[pos] ^= np.frombuffer(raw, dtype=_UINT[width], offset=e.changed * index.itemsize)
    except zstandard.ZstdError as err:
        return f"undecodable: {err}"
    return None
