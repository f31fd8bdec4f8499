"""Weights across sites: the trainer serves one copy, the relay at the far site fetches it.

Why pull: the receiver is the one that knows which chunks it holds, verified; so it asks for
exactly the missing ones — after a broken connection (only that stream's in-flight chunks are
asked again), after a corrupted chunk (that chunk again, a bounded number of times), and on
several TCP streams at once (the fetcher: :mod:`relay_fetch`, importable from here). The
trainer's :class:`WeightServer` only answers; it snapshots each published version into one
contiguous buffer (the weights keep training meanwhile) and computes each chunk's digest (and
optional compression) once, lazily, on first request.

A fetched version is complete only when every chunk is verified: :func:`fetch_weights`
returns the tensors (views of one buffer) then, and raises otherwise — nothing half-received
is ever returned. The relay then broadcasts locally (``broadcast.BroadcastSender``), and each
member confirms the version through the rendezvous, which announces it once all did.

Delta versions (:mod:`relay_delta`): a relay that holds the version before, bit for bit, names it
(and the server instance it came from) when it asks for the next, and is sent only the
difference, which it rebuilds into the whole version and checks tensor by tensor before anything
is handed out. The server computes that difference once, as it publishes, against the version
it served until then, and then lets that version go: it holds one whole version and one delta,
never two whole versions. Any other relay gets the whole version, told why
(``relay_wire.FULL_REASONS``).

Who may connect is :mod:`relay_gate`'s concern: connections still in their handshake take no
thread and are bounded apart from the authenticated ones, so strangers holding idle connections
cannot make a fetch fail.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from streamrl_cli.weights import relay_delta as rd
from streamrl_cli.weights import relay_wire as rw
from streamrl_cli.weights.plan import chunk_count, chunk_range, stream_layout
from streamrl_cli.weights.relay_fetch import (  # noqa: F401 - the relay's client, imported from here too
    Fetched,
    VersionSuperseded,
    fetch_weights,
)
from streamrl_cli.weights.relay_gate import Gate

log = logging.getLogger("streamrl.weights.relay")


@dataclass
class _Stream:
    """Bytes served in chunks: a whole version, or its delta against a base."""

    manifest: rw.Manifest
    data: memoryview
    owner: Any  # owns `data`
    compress: bool = True  # a delta is zstd already: chunk compression would only cost time
    digests: dict[int, bytes] = field(default_factory=dict)
    encoded: dict[int, tuple[str, Any]] = field(default_factory=dict)


@dataclass
class _Snapshot:
    """A published version: its whole stream, and the deltas it can be served as, by base version."""

    version: int
    whole: _Stream
    deltas: dict[int, _Stream] = field(default_factory=dict)
    previous: int = -1  # the version published before it (-1: none)
    no_delta: str = ""  # why there is no delta from `previous` (a FULL_REASONS key)

    @property
    def manifest(self) -> rw.Manifest:
        return self.whole.manifest


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
        delta: bool = True,
    ):
        """`delta`: serve relays that hold the version before with its delta (computed as each version
        is published); off, every relay gets every version whole and no digests are computed."""
        self.token, self.chunk_bytes, self.compression = token, chunk_bytes, compression
        self.delta = delta
        self.id = os.urandom(16)  # a restarted trainer's server is another: its versions are others
        self.checksum = checksum or rw.default_checksum()
        rw.checksum_fn(self.checksum)  # fail now, not on the first request
        if compression != "none":
            rw.compress(compression, b"probe")
        self.min_saving, self.timeout_s = min_saving, timeout_s
        self.stats = {"connections": 0, "rejected": 0, "chunks": 0, "bytes": 0, "turned_away": 0}
        self.stats["delta_bytes"] = 0  # of `bytes`: chunks of deltas
        self._current: _Snapshot | None = None
        self._lock = threading.Lock()
        self._publishing = threading.Lock()  # one publish at a time: each is the next one's base
        # Strangers without the token get no thread and cannot crowd out the run's relays: relay_gate.
        self._gate = Gate(token, host, port, self._serve, timeout_s=timeout_s, stats=self.stats)
        self.address = (
            f"{advertise_host or (socket.gethostname() if host == '0.0.0.0' else host)}:{self._gate.port}"
        )

    def publish(self, version: int, tensors: Mapping[str, torch.Tensor]) -> rw.Manifest:
        """Snapshot `tensors` as `version`; from now on relays get this one (older fetches are told so).

        The snapshot holds the tensors' bytes as given, in their dtype: what the generators load
        (the trainer publishes its model's parameters, in the recipe's dtype). With deltas on, the
        delta against the version published before is computed here, once, and the version
        before is then let go: the server holds one whole version and one delta.
        """
        entries = [
            (n, str(t.dtype).removeprefix("torch."), tuple(t.shape), t.numel() * t.element_size())
            for n, t in tensors.items()
        ]
        specs, total = stream_layout(entries)
        with self._publishing:
            buf = torch.empty(total, dtype=torch.uint8)  # not zeros: touching 1 GB twice costs 0.1 s
            pos = 0
            for spec, t in zip(specs, tensors.values(), strict=True):
                buf[pos : spec.offset].zero_()  # alignment padding: deterministic bytes, stable digests
                pos = spec.offset + spec.nbytes
                if spec.nbytes:
                    view = buf[spec.offset : spec.offset + spec.nbytes].view(t.dtype).view(t.shape)
                    view.copy_(t.detach())
            manifest = rw.Manifest(version, total, self.chunk_bytes, self.checksum, specs, self.id)
            snap = _Snapshot(version, _Stream(manifest, memoryview(buf.numpy()), buf))
            if self.delta:
                self._add_deltas(snap, buf.numpy(), self._current)
            with self._lock:
                self._current = snap
        return manifest

    def _add_deltas(self, snap: _Snapshot, data: Any, before: _Snapshot | None) -> None:
        """The deltas `snap` is served as: against itself (a relay that holds it already: nothing to
        send) and against the version published before, when that is smaller than the whole."""
        m = snap.whole.manifest
        digests = rd.digests(data, m.tensors)

        def delta(base: int, entries: list[rd.TensorDelta], payload: bytes) -> _Stream:
            dm = msgspec.structs.replace(m, total=len(payload), base=base, delta=entries)
            return _Stream(dm, memoryview(payload), payload, compress=False)

        snap.deltas[snap.version] = delta(snap.version, rd.unchanged(digests), b"")
        if before is None or before.version == snap.version:
            snap.no_delta = "base_gone"
            return
        snap.previous = before.version
        b = before.whole
        entries, payload = rd.encode(data, m.tensors, b.owner.numpy(), b.manifest.tensors, digests)
        if len(payload) < sum(s.nbytes for s in m.tensors):  # padding aside: every tensor raw is no delta
            snap.deltas[before.version] = delta(before.version, entries, payload)
        else:
            snap.no_delta = "not_smaller"

    def _manifest_for(self, snap: _Snapshot, msg: rw.GetManifest) -> rw.Manifest:
        """The delta against the client's version if there is one, else the whole version (saying why)."""
        whole = snap.whole.manifest
        if msg.base < 0:
            return whole
        if not self.delta:
            why = "off"
        elif msg.server != self.id:
            why = "new_server"
        elif msg.base in snap.deltas:
            return snap.deltas[msg.base].manifest
        elif msg.base == snap.previous:
            why = snap.no_delta
        else:
            why = "base_gone"
        return msgspec.structs.replace(whole, full_reason=why)

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
                elif isinstance(msg, rw.GetManifest | rw.GetChunks) and msg.version not in (-1, snap.version):
                    conn.send(rw.Error("superseded", f"version {msg.version} is gone", snap.version))
                elif isinstance(msg, rw.GetManifest):
                    conn.send(self._manifest_for(snap, msg))
                elif isinstance(msg, rw.GetChunks):
                    stream = snap.whole if msg.base < 0 else snap.deltas.get(msg.base)
                    if stream is None:
                        why = f"no delta of version {snap.version} from {msg.base}"
                        conn.send(rw.Error("bad_request", why))
                        return
                    for i in msg.ids:
                        self._send_chunk(conn, stream, i)
                else:
                    conn.send(rw.Error("bad_request", f"unexpected {type(msg).__name__}"))
                    return
        except (OSError, rw.ProtocolError) as e:  # the client went away, or spoke garbage
            log.debug("weight relay: connection ended: %s", e)

    def _send_chunk(self, conn: rw.Conn, snap: _Stream, i: int) -> None:
        m = snap.manifest
        if not 0 <= i < chunk_count(m.total, m.chunk_bytes):
            raise rw.ProtocolError(f"chunk {i} out of range")
        start, end = chunk_range(i, m.total, m.chunk_bytes)
        raw = snap.data[start:end]
        digest = snap.digests.get(i)
        if digest is None:  # computed once, by whichever stream asks first (benign race)
            digest = snap.digests[i] = rw.checksum_fn(m.checksum)(raw)
        codec, payload = snap.encoded.get(i, ("none", raw))
        if self.compression != "none" and snap.compress and i not in snap.encoded:
            packed = rw.compress(self.compression, raw)
            if len(packed) <= (1 - self.min_saving) * len(raw):  # only where it pays
                codec, payload = self.compression, packed
            snap.encoded[i] = (codec, payload)
        conn.send(rw.ChunkHeader(m.version, i, codec, end - start, len(payload), digest, m.base))
        conn.send_raw(payload)
        self.stats["chunks"] += 1
        self.stats["bytes"] += len(payload)
        if m.base >= 0:
            self.stats["delta_bytes"] += len(payload)
