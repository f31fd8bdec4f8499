"""Who gets into the cross-site weight relay: strangers must not crowd out the run's relays.

Why a gate of its own: the relay server listens on a port the whole network may reach, and
anyone can open connections without the token. When each connection took a thread and waited
10 s for its handshake, 300 idle connections held every slot and a real fetch failed. So
connections have two budgets that cannot eat into each other:

- **pending** (accepted, handshake not done): no thread. One thread (``weight-server``) accepts
  and runs every pending handshake with non-blocking sockets (``relay_wire.ServerHandshake``). At
  most ``MAX_PENDING`` are held, and ``MAX_PENDING_PER_SOURCE`` per source (an IPv4 address, an
  IPv6 /64). A newcomer is always admitted: when its source's share is full, that source's oldest
  pending connection is closed; when the whole pool is full, the oldest of the source holding the
  most. Idle connections are pushed out by fresh ones, an honest client (whose handshake takes
  one round trip) is the freshest, and one source cannot push out another's while it holds more.
  Each must finish its handshake within ``HANDSHAKE_DEADLINE_S`` of being accepted, however
  slowly it trickles bytes in.
- **members** (proved the token): one thread each, at most ``MAX_MEMBERS``. When they are all
  taken, a newly authenticated connection is closed before its Welcome (the client retries).

What remains: a stranger can make one handshake fail by opening ``MAX_PENDING_PER_SOURCE``
connections from the client's own address (behind the same NAT), or ``MAX_PENDING`` from as many
addresses as it takes to outnumber the client's, within that handshake's round trip. The fetch
client retries with backoff for longer than the deadline (``relay_fetch._backoff``), so such a
stranger must keep that rate up for the whole time: a flood, which is a firewall's job.

Nothing here blocks the accept loop: pending sockets are non-blocking and the frames written to
them (Challenge, Welcome, Error) are under 200 bytes, into an empty send buffer; a connection
whose frame does not fit at once is dropped. Every dropped socket is closed there and then.
"""

from __future__ import annotations

import ipaddress
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from streamrl_cli.weights import relay_wire as rw

log = logging.getLogger("streamrl.weights.relay")
MAX_MEMBERS = 256  # authenticated connections served at once (a thread each); relays need a few each
MAX_PENDING = 256  # connections in their handshake, all sources together
MAX_PENDING_PER_SOURCE = 64
HANDSHAKE_DEADLINE_S = 3.0  # from accept: a cross-site handshake takes one round trip
ACCEPT_BATCH = 16  # accepted per turn of the loop, after the handshakes that made progress


class PendingPool:
    """The pending connections in accept order, bounded in all and per source: who goes next."""

    def __init__(self, max_total: int, max_per_source: int):
        self.max_total, self.max_per_source = max_total, max_per_source
        self._all: dict[Any, tuple[str, float]] = {}  # key -> (source, deadline), oldest first
        self._by_source: dict[str, dict[Any, None]] = {}

    def __len__(self) -> int:
        return len(self._all)

    def __iter__(self) -> Iterator[Any]:
        """Oldest first, over a copy: the caller may remove keys as it goes."""
        return iter(list(self._all))

    def admit(self, key: Any, source: str, deadline: float) -> Any | None:
        """Add `key`; returns the key pushed out to make room (already removed), if any."""
        same = self._by_source.get(source, {})
        out = None
        if len(same) >= self.max_per_source:
            out = next(iter(same))
        elif len(self._all) >= self.max_total:  # from the source holding the most
            out = next(iter(max(self._by_source.values(), key=len)))
        if out is not None:
            self.remove(out)
        self._all[key] = (source, deadline)
        self._by_source.setdefault(source, {})[key] = None
        return out

    def remove(self, key: Any) -> None:
        source, _ = self._all.pop(key)
        same = self._by_source[source]
        del same[key]
        if not same:
            del self._by_source[source]

    def expired(self, now: float) -> list[Any]:
        """Keys past their deadline (all deadlines are accept time + one constant: the oldest first)."""
        out = []
        for key, (_, deadline) in self._all.items():
            if deadline > now:
                break
            out.append(key)
        return out

    def next_deadline(self) -> float | None:
        return next(iter(self._all.values()))[1] if self._all else None


def _source(host: str) -> str:
    """Whose connection this is: the IPv4 address, or the /64 of an IPv6 one (one host's share)."""
    ip = ipaddress.ip_address(host.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


@dataclass(eq=False)
class _Pending:
    sock: socket.socket
    handshake: rw.ServerHandshake
    peer: Any = field(default=None)


class Gate:
    """Listens, authenticates, and hands each member's connection to `serve` on a thread of its own.

    `stats` (shared with the caller) counts connections, rejected (wrong token), turned_away
    (no member slot), evicted (pushed out of the pending pool) and expired (handshake too slow).
    """

    def __init__(
        self,
        token: str,
        host: str,
        port: int,
        serve: Callable[[rw.Conn], None],
        *,
        timeout_s: float,
        stats: dict[str, int],
    ):
        self.token, self.serve, self.timeout_s, self.stats = token, serve, timeout_s, stats
        for k in ("connections", "rejected", "turned_away", "evicted", "expired"):
            stats.setdefault(k, 0)
        self.max_members = MAX_MEMBERS
        self.deadline_s = HANDSHAKE_DEADLINE_S
        self._pool = PendingPool(MAX_PENDING, MAX_PENDING_PER_SOURCE)
        self._listener = socket.create_server((host, port), backlog=128)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._members: set[rw.Conn] = set()
        self._lock = threading.Lock()
        self._stop = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, "listen")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._accept_paused_until = 0.0  # set while accept() fails (out of descriptors)
        self._thread = threading.Thread(target=self._loop, name="weight-server", daemon=True)
        self._thread.start()

    def counts(self) -> dict[str, int]:
        """Connections open now: pending (in their handshake) and members (authenticated)."""
        with self._lock:
            return {"pending": len(self._pool), "members": len(self._members)}

    def close(self) -> None:
        """Stop accepting, close every pending connection, and end every member's (their threads exit)."""
        self._stop = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join()
        with self._lock:
            members = list(self._members)
        for conn in members:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)  # its thread's recv returns; it closes the socket
            except OSError:
                pass

    # ---- the loop: the only thread that touches pending connections ----

    def _loop(self) -> None:
        try:
            while not self._stop:
                deadline = self._pool.next_deadline()
                if self._accept_paused_until:
                    pause = self._accept_paused_until
                    deadline = pause if deadline is None else min(deadline, pause)
                timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                listen = False
                for key, _ in self._sel.select(timeout):
                    if key.data == "listen":
                        listen = True
                    elif key.data == "wake":
                        self._wake_r.recv(64)
                    else:
                        self._advance(key.data)
                if self._accept_paused_until and time.monotonic() >= self._accept_paused_until:
                    self._accept_paused_until = 0.0
                    self._sel.register(self._listener, selectors.EVENT_READ, "listen")
                # Handshakes that made progress go first, then newcomers: a burst of strangers
                # accepted in one turn cannot push out a Hello already waiting to be read.
                if listen:
                    self._accept()
                now = time.monotonic()
                for p in self._pool.expired(now):
                    self.stats["expired"] += 1
                    self._drop(p)
        finally:
            for p in self._pool:
                self._drop(p)
            self._sel.close()
            self._listener.close()
            self._wake_r.close()
            self._wake_w.close()

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                sock, peer = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as e:
                # Out of file descriptors (or kernel memory): free one by dropping the oldest
                # handshake, and stop listening for a moment rather than spin on a ready listener.
                log.warning("weight relay: cannot accept a connection (%s); pausing for 0.1 s", e)
                oldest = next(iter(self._pool), None)
                if oldest is not None:
                    self.stats["evicted"] += 1
                    self._drop(oldest)
                self._sel.unregister(self._listener)
                self._accept_paused_until = time.monotonic() + 0.1
                return
            self.stats["connections"] += 1
            self._admit(sock, peer)

    def _admit(self, sock: socket.socket, peer: Any) -> None:
        p = _Pending(sock, rw.ServerHandshake(self.token), peer)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if not self._send(sock, p.handshake.challenge()):
                sock.close()
                return
        except OSError:  # reset before we got to it
            sock.close()
            return
        with self._lock:
            out = self._pool.admit(p, _source(peer[0]), time.monotonic() + self.deadline_s)
        if out is not None:
            self.stats["evicted"] += 1
            self._close_pending(out)
        self._sel.register(sock, selectors.EVENT_READ, p)

    def _advance(self, p: _Pending) -> None:
        try:
            data = p.sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # the stranger left
            self._drop(p)
            return
        try:
            hello = p.handshake.feed(data)
        except rw.ProtocolError as e:
            log.debug("weight relay: dropped a connection before its handshake: %s", e)
            self._drop(p)
            return
        if hello is None:
            return
        answer = p.handshake.answer(hello)
        if answer is None:
            self.stats["rejected"] += 1
            log.warning("weight relay: refused a client without the run's token from %s", p.peer)
            self._send(p.sock, rw.ServerHandshake.refusal())
            self._drop(p)
            return
        with self._lock:
            room = len(self._members) < self.max_members
        if not room:
            self.stats["turned_away"] += 1
            self._drop(p)
            return
        welcome, tx_key, rx_key = answer
        if not self._send(p.sock, welcome):
            self._drop(p)
            return
        self._sel.unregister(p.sock)
        with self._lock:
            self._pool.remove(p)
            conn = rw.Conn(p.sock, self.timeout_s)  # blocking from here, on the member's own thread
            conn.secure(tx_key=tx_key, rx_key=rx_key)
            self._members.add(conn)
        thread = threading.Thread(target=self._member, args=(conn,), name="weight-server-conn", daemon=True)
        try:
            thread.start()
        except RuntimeError:  # the process cannot start another thread: as if the slots were full
            self.stats["turned_away"] += 1
            with self._lock:
                self._members.discard(conn)
            conn.close()

    def _member(self, conn: rw.Conn) -> None:
        try:
            self.serve(conn)
        finally:
            conn.close()
            with self._lock:
                self._members.discard(conn)

    @staticmethod
    def _send(sock: socket.socket, frame: bytes) -> bool:
        try:
            return sock.send(frame) == len(frame)
        except OSError:
            return False

    def _drop(self, p: _Pending) -> None:
        with self._lock:
            self._pool.remove(p)
        self._close_pending(p)

    def _close_pending(self, p: _Pending) -> None:
        self._sel.unregister(p.sock)
        p.sock.close()
