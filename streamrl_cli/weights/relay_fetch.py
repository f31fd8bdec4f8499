"""The far site's end of the weight relay: fetch one version, whole or as a delta, verified.

Why a module of its own: the fetcher is where every fault of a long link is handled (see
:mod:`relay` for the server). It keeps a ``ChunkPlanner`` and several TCP streams: a broken
stream gives back only its in-flight chunks and reconnects, a chunk that fails its digest is
asked for again, a version superseded mid-fetch raises :class:`VersionSuperseded`.

With a ``base`` (the version the relay holds, as an earlier fetch returned it), the server may
answer with the delta against it (:mod:`relay_delta`): the fetcher receives the delta stream like
any other, rebuilds the whole version from the base into a new buffer, and checks every tensor
against the digest the server computed on the whole version; one that fails sends it back for the
whole version at once (reason ``checksum``). Either way what is returned is bit for bit what the
trainer published, and ``Fetched.stats`` say what crossed: its bytes, full or delta, and why full.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from streamrl_cli.weights import WeightTransferError
from streamrl_cli.weights import relay_delta as rd
from streamrl_cli.weights import relay_wire as rw
from streamrl_cli.weights.plan import ChunkPlanner, TensorSpec, chunk_count, chunk_range

log = logging.getLogger("streamrl.weights.relay")


class VersionSuperseded(WeightTransferError):
    """The server moved on to a newer version while we fetched; fetch `current` instead."""

    def __init__(self, message: str, current: int):
        super().__init__(message)
        self.current = current


@dataclass
class Fetched:
    version: int
    tensors: dict[str, torch.Tensor]  # views of one buffer
    manifest: rw.Manifest  # the whole version's layout, and the server instance it came from
    # corrupted, reconnects, chunks_received, bytes_received (what crossed, both tries when a delta
    # was rejected), seconds, mode (delta | full), reason (why full: FULL_REASONS; "" for a delta),
    # base (the version a delta was applied to, -1: none), full_bytes (the whole version's size)
    stats: dict[str, Any]
    buffer: torch.Tensor  # the uint8 buffer the tensors view (pass it as `out` to a later fetch)
    delta: list[rd.TensorDelta] = field(default_factory=list)  # how each tensor was rebuilt ([]: whole)


def fetch_weights(
    address: str,
    token: str,
    *,
    version: int = -1,
    base: Fetched | None = None,
    delta: bool = True,
    streams: int = 4,
    batch: int = 2,
    depth: int = 2,
    timeout_s: float = 30.0,
    max_attempts: int = 5,
    max_reconnects: int = 20,
    out: torch.Tensor | None = None,
) -> Fetched:
    """Fetch one version (-1: the latest) from a WeightServer; returns only when every chunk is verified.

    `base`: the version this relay holds, as an earlier fetch returned it and unchanged since; the
    server then sends only the difference when it can, which is rebuilt and checked against every
    tensor's digest (one that fails: the version is fetched whole). `delta=False`: always whole.
    `out`: a CPU uint8 buffer to receive into when large enough (a relay passes the buffer of a
    version it no longer needs; its contents are overwritten; never `base`'s, which a delta is
    rebuilt from), saving a fresh allocation.
    """
    fetch = _Fetch(address, token, streams, batch, depth, timeout_s, max_attempts, max_reconnects)
    return fetch.run(version, out, base if delta else None, "no_base" if delta else "off")


def _backoff(tries: int) -> float:
    """Seconds before the next connection after `tries` in a row broke before their handshake ended
    (0: one broke mid-transfer): 0.05 s, doubling up to 1 s. So a fetch's reconnect budget lasts
    longer than the server's handshake deadline (relay_gate): strangers crowding the server's
    pending connections are outlasted, not raced."""
    return min(1.0, 0.05 * 2 ** max(0, tries - 1))


class _Fetch:
    def __init__(
        self,
        address: str,
        token: str,
        streams: int,
        batch: int,
        depth: int,
        timeout_s: float,
        max_attempts: int,
        max_reconnects: int,
    ):
        host, _, port = address.rpartition(":")
        self.target, self.token = (host, int(port)), token
        self.streams, self.batch, self.depth, self.timeout_s = streams, batch, depth, timeout_s
        self.max_attempts, self.reconnects_left = max_attempts, max_reconnects
        self.cond = threading.Condition()
        self.stats = {
            "corrupted": 0,
            "reconnects": 0,
            "chunks_received": 0,
            "bytes_received": 0,
            "seconds": 0.0,
        }
        self.superseded: VersionSuperseded | None = None

    def connect(self) -> rw.Conn:
        conn = rw.Conn(socket.create_connection(self.target, timeout=self.timeout_s), self.timeout_s)
        try:
            rw.client_handshake(conn, self.token)
        except BaseException:
            conn.close()
            raise
        return conn

    def open(self, version: int, base: Fetched | None = None) -> tuple[rw.Conn, Any]:
        """The first connection and the server's answer to GetManifest.

        A connection that breaks here (refused, reset, closed by a server whose member slots are
        full, or pushed out of its pending handshakes by strangers) is tried again, with backoff,
        from the same reconnect budget as the streams; a refusal or a frame that fails
        authentication raises at once.
        """
        while True:
            conn = None
            try:
                conn = self.connect()
                if base is None:
                    conn.send(rw.GetManifest(version))
                else:
                    conn.send(rw.GetManifest(version, base.version, base.manifest.server))
                return conn, conn.recv()
            except OSError as e:  # a frame that fails its checks is refused, not asked for again
                if conn is not None:
                    conn.close()
                self.stats["reconnects"] += 1
                self.reconnects_left -= 1
                if self.reconnects_left < 0:
                    raise WeightTransferError(
                        f"relay server at {self.target[0]}:{self.target[1]}: no connection took "
                        f"after {self.stats['reconnects']} tries (last: {e})"
                    ) from e
                log.warning("relay: connecting to %s:%d broke (%s); trying again", *self.target, e)
                time.sleep(_backoff(self.stats["reconnects"]))

    def run(self, version: int, out: torch.Tensor | None, base: Fetched | None, reason: str) -> Fetched:
        start = time.perf_counter()
        if out is not None and base is not None and _shares(out, base.buffer):
            out = None  # the base stays whole whatever happens to this fetch
        conn, m = self.ask(version, base)
        got = None
        if m.base >= 0:
            if base is None:
                conn.close()
                raise rw.ProtocolError(f"a delta from version {m.base} was sent, none asked for")
            got = self.rebuild(conn, m, base, out)
            if got is None:  # fetch it whole: the delta or our base is not what the server has
                reason = "checksum"
                conn, m = self.ask(m.version, None)
        elif m.full_reason:
            reason = m.full_reason
        if got is None:
            got = self.whole(conn, m, out, reason)
        self.stats["seconds"] = time.perf_counter() - start
        return got

    def ask(self, version: int, base: Fetched | None) -> tuple[rw.Conn, rw.Manifest]:
        """The first connection and the manifest of `version` (a delta from `base`, or the whole)."""
        conn, m = self.open(version, base)
        if isinstance(m, rw.Error):
            conn.close()
            if m.code == "superseded":
                raise VersionSuperseded(f"relay: {m.message}; the server has {m.current}", m.current)
            raise WeightTransferError(
                f"relay server at {self.target[0]}:{self.target[1]}: {m.code}: {m.message}"
            )
        if not isinstance(m, rw.Manifest):
            conn.close()
            raise rw.ProtocolError(f"expected a manifest, got {type(m).__name__}")
        return conn, m

    def whole(self, conn: rw.Conn, m: rw.Manifest, out: torch.Tensor | None, reason: str) -> Fetched:
        buf = _buffer(out, m.total)
        self.receive(conn, m, buf)
        self.stats.update(mode="full", reason=reason, base=-1, full_bytes=m.total)
        return Fetched(m.version, _views(buf, m.tensors), m, self.stats, buf)

    def rebuild(
        self, conn: rw.Conn, m: rw.Manifest, base: Fetched, out: torch.Tensor | None
    ) -> Fetched | None:
        """Receive the delta stream, rebuild the whole version from `base` into `out` and check every
        tensor's digest; None when one fails (logged)."""
        stream = torch.empty(m.total, dtype=torch.uint8)
        self.receive(conn, m, stream)
        size = rd.stream_size(m.tensors)
        buf = _buffer(out, size)
        held = base.buffer.numpy()
        why = rd.apply(stream.numpy(), m.delta, m.tensors, held, base.manifest.tensors, buf.numpy())
        if why is not None:
            log.warning(
                "relay: version %d rebuilt from %d failed (%s); fetching it whole", m.version, m.base, why
            )
            return None
        whole = msgspec.structs.replace(m, total=size, base=-1, delta=[], full_reason="")
        self.stats.update(mode="delta", reason="", base=m.base, full_bytes=size)
        return Fetched(m.version, _views(buf, m.tensors), whole, self.stats, buf, list(m.delta))

    def receive(self, conn: rw.Conn, m: rw.Manifest, buf: torch.Tensor) -> None:
        """Every chunk of `m`'s stream into `buf`, verified, over up to `self.streams` connections."""
        self.manifest, self.digest, self.superseded = m, rw.checksum_fn(m.checksum), None
        self.buf, self.view = buf, memoryview(buf.numpy())
        n = chunk_count(m.total, m.chunk_bytes)
        self.planner = ChunkPlanner(n, self.max_attempts)
        conns = [conn] + [None] * (min(self.streams, n) - 1)
        threads = [
            threading.Thread(target=self.worker, args=(i, c), daemon=True) for i, c in enumerate(conns)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if not self.planner.complete:
            if self.superseded is not None:
                raise self.superseded
            raise WeightTransferError(f"relay fetch of version {m.version} failed: {self.planner.error}")

    def worker(self, stream: int, conn: rw.Conn | None) -> None:
        refused = 0  # connections in a row that broke before the handshake ended
        while True:
            with self.cond:
                if self.planner.done:
                    break
            try:
                if conn is None:
                    refused += 1
                    conn = self.connect()
                    refused = 0
                self.pump(stream, conn)
            except (OSError, rw.ProtocolError) as e:
                with self.cond:
                    back = self.planner.release(stream)
                    self.stats["reconnects"] += 1
                    self.reconnects_left -= 1
                    if self.reconnects_left < 0:
                        self.planner.fail(f"too many broken connections (last: {e})")
                    self.cond.notify_all()
                log.warning(
                    "relay stream %d broke (%s); %d chunk(s) go back to the queue", stream, e, len(back)
                )
                if conn is not None:
                    conn.close()
                conn = None
                time.sleep(_backoff(refused))
            except WeightTransferError as e:  # superseded, refused: final
                with self.cond:
                    if isinstance(e, VersionSuperseded):
                        self.superseded = e
                    self.planner.fail(str(e))
                    self.cond.notify_all()
        if conn is not None:
            conn.close()

    def pump(self, stream: int, conn: rw.Conn) -> None:
        """Keep `depth` requests of `batch` chunks in flight on this connection until all is done."""
        outstanding: deque[list[int]] = deque()
        while True:
            with self.cond:
                new = []
                while len(outstanding) + len(new) < self.depth:
                    ids = self.planner.take(stream, self.batch)
                    if not ids:
                        break
                    new.append(ids)
                if not new and not outstanding:
                    if self.planner.done:
                        return
                    self.cond.wait(0.2)  # others may still fail chunks back to the queue
                    continue
            for ids in new:
                conn.send(rw.GetChunks(self.manifest.version, ids, self.manifest.base))
            outstanding.extend(new)
            for i in outstanding.popleft():
                self.receive_chunk(conn, i)

    def receive_chunk(self, conn: rw.Conn, i: int) -> None:
        h = conn.recv()
        if isinstance(h, rw.Error):
            if h.code == "superseded":
                raise VersionSuperseded(f"relay: {h.message}; the server has {h.current}", h.current)
            raise WeightTransferError(f"relay server: {h.code}: {h.message}")
        m = self.manifest
        start, end = chunk_range(i, m.total, m.chunk_bytes)
        if (
            not isinstance(h, rw.ChunkHeader)
            or h.id != i
            or h.base != m.base
            or h.raw_len != end - start
            or h.wire_len > 2 * h.raw_len + 64
        ):
            raise rw.ProtocolError(f"expected the header of chunk {i}, got {h!r:.200}")
        dest = self.view[start:end]
        ok = True
        if h.codec == "none" and h.wire_len == h.raw_len:
            # Straight into place; not visible to anyone until all is verified.
            ok = conn.recv_payload_into(dest)
        else:
            payload = conn.recv_payload(h.wire_len)
            try:
                raw = rw.decompress(h.codec, payload, h.raw_len) if payload is not None else b""
            except rw.ProtocolError:
                raise
            except Exception:  # zlib.error, zstd.ZstdError: the compressed bytes were corrupted
                raw = b""
            ok = len(raw) == h.raw_len
            if ok:
                dest[:] = raw
        ok = ok and self.digest(dest) == h.digest
        with self.cond:
            self.stats["chunks_received"] += 1
            self.stats["bytes_received"] += h.wire_len
            if ok:
                self.planner.verified_ok(i)
            else:
                self.stats["corrupted"] += 1
                log.warning("relay: chunk %d of version %d failed verification; asking again", i, m.version)
                self.planner.failed(i, "digest mismatch")
            self.cond.notify_all()


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _buffer(out: torch.Tensor | None, size: int) -> torch.Tensor:
    """`size` bytes of `out` when it is a large enough CPU uint8 buffer, else a new one."""
    if out is not None and out.dtype == torch.uint8 and out.device.type == "cpu" and out.numel() >= size:
        return out[:size]
    return torch.empty(size, dtype=torch.uint8)


def _views(buf: torch.Tensor, specs: list[TensorSpec]) -> dict[str, torch.Tensor]:
    return {
        s.name: buf[s.offset : s.offset + s.nbytes].view(getattr(torch, s.dtype)).view(s.shape) for s in specs
    }
