"""Weights across sites: the trainer serves one copy, the relay at the far site fetches it.

Why pull: the receiver is the one that knows which chunks it holds, verified; so it asks for
exactly the missing ones — after a broken connection (only that stream's in-flight chunks are
asked again), after a corrupted chunk (that chunk again, a bounded number of times), and on
several TCP streams at once. The trainer's :class:`WeightServer` only answers; it snapshots
each published version into one contiguous buffer (the weights keep training meanwhile) and
computes each chunk's digest (and optional compression) once, lazily, on first request.

A fetched version is complete only when every chunk is verified: :func:`fetch_weights`
returns the tensors (views of one buffer) then, and raises otherwise — nothing half-received
is ever returned. The relay then broadcasts locally (``broadcast.BroadcastSender``), and each
member confirms the version through the rendezvous, which announces it once all did.

Who may connect is :mod:`relay_gate`'s concern: connections still in their handshake take no
thread and are bounded apart from the authenticated ones, so strangers holding idle connections
cannot make a fetch fail.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from streamrl_cli.weights import WeightTransferError
from streamrl_cli.weights import relay_wire as rw
from streamrl_cli.weights.plan import ChunkPlanner, chunk_count, chunk_range, stream_layout
from streamrl_cli.weights.relay_gate import Gate

log = logging.getLogger("streamrl.weights.relay")


class VersionSuperseded(WeightTransferError):
    """The server moved on to a newer version while we fetched; fetch `current` instead."""

    def __init__(self, message: str, current: int):
        super().__init__(message)
        self.current = current


@dataclass
class _Snapshot:
    manifest: rw.Manifest
    data: memoryview  # the whole stream
    buffer: torch.Tensor  # owns `data`
    digests: dict[int, bytes] = field(default_factory=dict)
    encoded: dict[int, tuple[str, Any]] = field(default_factory=dict)


class WeightServer:
    """The trainer's end: publish a version, serve its chunks to authenticated relays."""

    def __init__(
        self,
        token: str,
        *,
        host: str = "0.0.0.0",
        port: int = 0,
        advertise_host: str | None = None,
        chunk_bytes: int = 8 << 20,
        checksum: str | None = None,
        compression: str = "none",
        min_saving: float = 0.1,
        timeout_s: float = 60.0,
    ):
        self.token, self.chunk_bytes, self.compression = token, chunk_bytes, compression
        self.checksum = checksum or rw.default_checksum()
        rw.checksum_fn(self.checksum)  # fail now, not on the first request
        if compression != "none":
            rw.compress(compression, b"probe")
        self.min_saving, self.timeout_s = min_saving, timeout_s
        self.stats = {"connections": 0, "rejected": 0, "chunks": 0, "bytes": 0, "turned_away": 0}
        self._current: _Snapshot | None = None
        self._lock = threading.Lock()
        # Strangers without the token get no thread and cannot crowd out the run's relays: relay_gate.
        self._gate = Gate(token, host, port, self._serve, timeout_s=timeout_s, stats=self.stats)
        self.address = (
            f"{advertise_host or (socket.gethostname() if host == '0.0.0.0' else host)}:{self._gate.port}"
        )

    def publish(self, version: int, tensors: Mapping[str, torch.Tensor]) -> rw.Manifest:
        """Snapshot `tensors` as `version`; from now on relays get this one (older fetches are told so)."""
        entries = [
            (n, str(t.dtype).removeprefix("torch."), tuple(t.shape), t.numel() * t.element_size())
            for n, t in tensors.items()
        ]
        specs, total = stream_layout(entries)
        buf = torch.empty(total, dtype=torch.uint8)  # not zeros: touching 1 GB twice costs 0.1 s
        pos = 0
        for spec, t in zip(specs, tensors.values(), strict=True):
            buf[pos : spec.offset].zero_()  # alignment padding: deterministic bytes, stable digests
            pos = spec.offset + spec.nbytes
            if spec.nbytes:
                view = buf[spec.offset : spec.offset + spec.nbytes].view(t.dtype).view(t.shape)
                view.copy_(t.detach())
        manifest = rw.Manifest(version, total, self.chunk_bytes, self.checksum, specs)
        with self._lock:
            self._current = _Snapshot(manifest, memoryview(buf.numpy()), buf)
        return manifest

    def close(self) -> None:
        """Stop listening and end every connection (their threads exit)."""
        self._gate.close()

    def connections(self) -> dict[str, int]:
        """Open now: pending (handshake not done) and members (authenticated)."""
        return self._gate.counts()

    # ---- one authenticated connection ----

    def _serve(self, conn: rw.Conn) -> None:
        try:
            while True:
                msg = conn.recv()
                with self._lock:
                    snap = self._current
                if snap is None:
                    conn.send(rw.Error("no_version", "nothing published yet"))
                elif isinstance(msg, rw.GetManifest | rw.GetChunks) and msg.version not in (
                    -1,
                    snap.manifest.version,
                ):
                    conn.send(rw.Error("superseded", f"version {msg.version} is gone", snap.manifest.version))
                elif isinstance(msg, rw.GetManifest):
                    conn.send(snap.manifest)
                elif isinstance(msg, rw.GetChunks):
                    for i in msg.ids:
                        self._send_chunk(conn, snap, i)
                else:
                    conn.send(rw.Error("bad_request", f"unexpected {type(msg).__name__}"))
                    return
        except (OSError, rw.ProtocolError) as e:  # the client went away, or spoke garbage
            log.debug("weight relay: connection ended: %s", e)

    def _send_chunk(self, conn: rw.Conn, snap: _Snapshot, i: int) -> None:
        m = snap.manifest
        if not 0 <= i < chunk_count(m.total, m.chunk_bytes):
            raise rw.ProtocolError(f"chunk {i} out of range")
        start, end = chunk_range(i, m.total, m.chunk_bytes)
        raw = snap.data[start:end]
        digest = snap.digests.get(i)
        if digest is None:  # computed once, by whichever stream asks first (benign race)
            digest = snap.digests[i] = rw.checksum_fn(m.checksum)(raw)
        codec, payload = snap.encoded.get(i, ("none", raw))
        if self.compression != "none" and i not in snap.encoded:
            packed = rw.compress(self.compression, raw)
            if len(packed) <= (1 - self.min_saving) * len(raw):  # only where it pays
                codec, payload = self.compression, packed
            snap.encoded[i] = (codec, payload)
        conn.send(rw.ChunkHeader(m.version, i, codec, end - start, len(payload), digest))
        conn.send_raw(payload)
        self.stats["chunks"] += 1
        self.stats["bytes"] += len(payload)


@dataclass
class Fetched:
    version: int
    tensors: dict[str, torch.Tensor]  # views of one buffer
    manifest: rw.Manifest
    stats: dict[str, float]
    buffer: torch.Tensor  # the uint8 buffer the tensors view (pass it as `out` to the next fetch)


def fetch_weights(
    address: str,
    token: str,
    *,
    version: int = -1,
    streams: int = 4,
    batch: int = 2,
    depth: int = 2,
    timeout_s: float = 30.0,
    max_attempts: int = 5,
    max_reconnects: int = 20,
    out: torch.Tensor | None = None,
) -> Fetched:
    """Fetch one version (-1: the latest) from a WeightServer; returns only when every chunk is verified.

    `out`: a CPU uint8 buffer to receive into when large enough (a relay passes the previous
    version's ``Fetched.buffer``; its contents are overwritten), saving a fresh allocation.
    """
    fetch = _Fetch(address, token, streams, batch, depth, timeout_s, max_attempts, max_reconnects)
    return fetch.run(version, out)


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

    def open(self, version: int) -> tuple[rw.Conn, Any]:
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
                conn.send(rw.GetManifest(version))
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

    def run(self, version: int, out: torch.Tensor | None) -> Fetched:
        start = time.perf_counter()
        conn, m = self.open(version)
        if isinstance(m, rw.Error):
            conn.close()
            if m.code == "superseded":
                raise VersionSuperseded(f"relay: {m.message}; the server has {m.current}", m.current)
            raise WeightTransferError(
                f"relay server at {self.target[0]}:{self.target[1]}: {m.code}: {m.message}"
            )
        if not isinstance(m, rw.Manifest):
            raise rw.ProtocolError(f"expected a manifest, got {type(m).__name__}")
        self.manifest, self.digest = m, rw.checksum_fn(m.checksum)
        if (
            out is not None
            and out.dtype == torch.uint8
            and out.device.type == "cpu"
            and out.numel() >= m.total
        ):
            self.buf = out[: m.total]
        else:
            self.buf = torch.empty(m.total, dtype=torch.uint8)
        self.view = memoryview(self.buf.numpy())
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
        self.stats["seconds"] = time.perf_counter() - start
        if not self.planner.complete:
            if self.superseded is not None:
                raise self.superseded
            raise WeightTransferError(f"relay fetch of version {m.version} failed: {self.planner.error}")
        tensors = {}
        for s in m.tensors:
            t = self.buf[s.offset : s.offset + s.nbytes].view(getattr(torch, s.dtype)).view(s.shape)
            tensors[s.name] = t
        return Fetched(m.version, tensors, m, self.stats, self.buf)

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
                conn.send(rw.GetChunks(self.manifest.version, ids))
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
