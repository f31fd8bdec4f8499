"""The relay against a hostile network: tampered manifests, strangers announcing huge frames or
squatting on connections, eavesdroppers. Loopback only; tests/support/netproxy.py stands in for
the man in the middle."""

from __future__ import annotations

import os
import resource
import select
import selectors
import socket
import struct
import threading
import time

import msgspec
import pytest
import torch
from support.helpers import tcp_pair
from support.netproxy import Proxy
from support.weights_relay import CHUNK, TOKEN, weights

from streamrl_cli.weights import WeightTransferError, relay_gate
from streamrl_cli.weights import relay_wire as rw
from streamrl_cli.weights.relay import WeightServer, fetch_weights


@pytest.fixture
def server():
    srv = WeightServer(TOKEN, host="127.0.0.1", chunk_bytes=CHUNK, checksum="crc32")
    yield srv
    srv.close()


def manifest_offset(manifest: rw.Manifest) -> int:
    """Where the manifest's sealed body starts in the server-to-client bytes."""
    frame = lambda m: 4 + len(msgspec.msgpack.encode(m))  # noqa: E731
    return frame(rw.Challenge(rw.PROTOCOL, b"\0" * 16)) + frame(rw.Welcome(b"\0" * 32)) + 4


@pytest.mark.parametrize("where", ["first byte", "middle", "tag"])
def test_a_tampered_manifest_is_refused_not_loaded(server, where):
    m = server.publish(1, weights())
    body = len(msgspec.msgpack.encode(m)) + rw.TAG
    at = manifest_offset(m) + {"first byte": 0, "middle": body // 2, "tag": body - 1}[where]
    hit = []

    def flip(conn: int, direction: str, offset: int, data: bytes) -> bytes:
        if direction == "down" and offset <= at < offset + len(data):
            hit.append(conn)
            i = at - offset
            return data[:i] + bytes([data[i] ^ 0x04]) + data[i + 1 :]
        return data

    proxy = Proxy(server.address, tamper=flip)
    try:
        with pytest.raises(WeightTransferError, match="failed authentication"):
            fetch_weights(proxy.address, TOKEN, streams=1)
    finally:
        proxy.close()
    assert hit == [0]


def test_swapping_two_names_in_a_plain_manifest_cannot_be_forged(server):
    """What the issue's proxy did to protocol 1 (swap two tensor names in the manifest): the
    forged manifest, however well-formed, is not sealed with the session key, so it is refused."""
    m = server.publish(1, weights())
    forged = msgspec.structs.replace(
        m,
        tensors=[
            msgspec.structs.replace(m.tensors[0], name=m.tensors[1].name),
            msgspec.structs.replace(m.tensors[1], name=m.tensors[0].name),
            *m.tensors[2:],
        ],
    )
    start = manifest_offset(m) - 4
    original = 4 + len(msgspec.msgpack.encode(m)) + rw.TAG
    body = msgspec.msgpack.encode(forged)
    replacement = struct.pack(">I", len(body) + rw.TAG) + body + b"\0" * rw.TAG
    assert len(replacement) == original
    buf = bytearray()

    def swap(conn: int, direction: str, offset: int, data: bytes) -> bytes:
        if direction != "down" or offset + len(data) <= start or offset >= start + original:
            return data
        buf.extend(data)  # the manifest arrives in one recv on loopback; splice it there
        lo = max(0, start - offset)
        return data[:lo] + replacement + data[lo + original :]

    proxy = Proxy(server.address, tamper=swap)
    try:
        with pytest.raises(WeightTransferError, match="failed authentication"):
            fetch_weights(proxy.address, TOKEN, streams=1)
    finally:
        proxy.close()
    assert buf


def test_a_frame_announced_before_the_handshake_is_refused_unread(server):
    """12 strangers announcing 64 MiB frames: the server drops each at the length, allocating nothing."""
    server.publish(1, weights())
    socks = []
    for _ in range(12):
        s = socket.create_connection(("127.0.0.1", int(server.address.rsplit(":", 1)[1])))
        s.settimeout(10)
        (n,) = struct.unpack(">I", s.recv(4))
        s.recv(n)  # the Challenge
        s.sendall(struct.pack(">I", 64 << 20))  # and never the body
        socks.append(s)
    for s in socks:
        # The server hangs up without waiting for (or reserving room for) the announced body.
        assert s.recv(1 << 16) == b""
        s.close()
    # ... and still serves the run's relay.
    assert fetch_weights(server.address, TOKEN, streams=1).version == 1


def test_preauth_frames_are_bounded_on_both_sides():
    a, b = tcp_pair()
    try:
        ca, cb = rw.Conn(a, 5), rw.Conn(b, 5)
        a.sendall(struct.pack(">I", rw.PREAUTH_MAX_FRAME + 1))
        with pytest.raises(rw.ProtocolError, match="before authentication"):
            cb.recv()
        ca.close()
    finally:
        b.close()


def test_relay_traffic_is_encrypted(server):
    """An eavesdropper on the link sees neither the weights nor the tensor names."""
    w = {"secret.weight": torch.full((64 << 10,), 0x5A, dtype=torch.uint8)}
    server.publish(1, w)
    seen = {"up": bytearray(), "down": bytearray()}
    lock = threading.Lock()

    def record(conn: int, direction: str, offset: int, data: bytes) -> bytes:
        with lock:
            seen[direction].extend(data)
        return data

    proxy = Proxy(server.address, tamper=record)
    try:
        got = fetch_weights(proxy.address, TOKEN, streams=1)
    finally:
        proxy.close()
    assert torch.equal(got.tensors["secret.weight"], w["secret.weight"])
    down = bytes(seen["down"])
    assert len(down) > 64 << 10
    assert b"\x5a" * 64 not in down and b"secret.weight" not in down
    assert TOKEN.encode() not in down + bytes(seen["up"])


def test_a_server_of_another_protocol_version_is_named():
    listener = socket.create_server(("127.0.0.1", 0))

    def old_server() -> None:
        sock, _ = listener.accept()
        conn = rw.Conn(sock, 10)
        conn.send(rw.Challenge(1, b"n" * 16))
        time.sleep(1)
        conn.close()

    threading.Thread(target=old_server, daemon=True).start()
    with pytest.raises(WeightTransferError, match=f"speaks protocol 1, this relay {rw.PROTOCOL}"):
        fetch_weights(f"127.0.0.1:{listener.getsockname()[1]}", TOKEN)
    listener.close()


# ---- strangers squatting on connections (relay_gate) ----

ATTACKERS = 400


def _port(srv: WeightServer) -> int:
    return int(srv.address.rsplit(":", 1)[1])


def _member(srv: WeightServer) -> rw.Conn:
    """A connection that completed the handshake: it holds one of the server's member slots."""
    conn = rw.Conn(socket.create_connection(("127.0.0.1", _port(srv)), timeout=10), 10)
    try:
        rw.client_handshake(conn, TOKEN)
    except BaseException:
        conn.close()
        raise
    return conn


def _server_threads() -> int:
    return sum(t.name.startswith("weight-server") for t in threading.enumerate())


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _wait_for(cond, what: str, timeout: float = 60.0) -> None:  # noqa: ANN001
    """Poll `cond` until it holds: the server ends threads and sockets on its own schedule."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.02)


def _assert_bit_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for k, w in want.items():
        g = got[k]
        assert (g.dtype, g.shape) == (w.dtype, w.shape), k
        raw = lambda t: t.contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
        assert torch.equal(raw(g), raw(w)), k


@pytest.fixture
def fd_room():
    """Room for the strangers' sockets and the server's: 1,200 held at once, and more in flight."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 8192 if hard == resource.RLIM_INFINITY else min(hard, 8192)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


class Squatters:
    """Strangers without the token holding connections to a relay server and never finishing a handshake.

    ``trickle``: each sends the start of a frame (its length, then a byte every 0.25 s) and never
    ends it. ``reconnect``: each connection the server closes is opened again at once. Otherwise
    they connect, never send a byte and never close (the server may).
    """

    def __init__(self, port: int, *, trickle: bool = False, reconnect: bool = False):
        self.port, self.trickle, self.reconnect = port, trickle, reconnect
        self.socks: list[socket.socket] = []  # every one opened, closed only by close()
        self.reopened = 0
        self._sel = selectors.DefaultSelector()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def open(self, n: int) -> None:
        for _ in range(n):
            self._open()

    def _open(self) -> None:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        self.socks.append(s)
        if self.trickle:
            s.sendall(struct.pack(">I", rw.PREAUTH_MAX_FRAME - 24) + b"\0")
        if self.reconnect:
            s.setblocking(False)
            self._sel.register(s, selectors.EVENT_READ)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        next_trickle = 0.0
        while not self._stop.is_set():
            if self.reconnect:
                for key, _ in self._sel.select(0.05):
                    s = key.fileobj
                    try:
                        data = s.recv(4096)  # its Challenge, or the server's hang-up
                    except BlockingIOError:
                        continue
                    except OSError:
                        data = b""
                    if not data:
                        self._sel.unregister(s)
                        try:
                            self._open()
                            self.reopened += 1
                        except OSError:
                            pass  # the listener's queue overflowed: this one is lost, the others go on
            else:
                self._stop.wait(0.05)
            if self.trickle and time.monotonic() >= next_trickle:
                next_trickle = time.monotonic() + 0.25
                for s in list(self.socks):
                    try:
                        s.send(b"\0", socket.MSG_DONTWAIT)
                    except OSError:
                        pass  # closed by the server: the stranger keeps it open all the same

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sel.close()
        for s in self.socks:
            s.close()


def test_members_beyond_the_bound_are_turned_away_not_threaded(monkeypatch):
    monkeypatch.setattr(relay_gate, "MAX_MEMBERS", 4)
    srv = WeightServer(TOKEN, host="127.0.0.1", chunk_bytes=CHUNK, checksum="crc32")
    try:
        srv.publish(1, weights())
        base = _server_threads()
        members = [_member(srv) for _ in range(4)]
        with pytest.raises(ConnectionError):  # closed before its Welcome: no thread
            _member(srv)
        assert srv.stats["turned_away"] == 1
        assert srv.connections() == {"pending": 0, "members": 4}
        assert _server_threads() == base + 4
        for c in members:
            c.close()
        _wait_for(lambda: srv.connections()["members"] == 0, "the members' threads to end")
        assert fetch_weights(srv.address, TOKEN, streams=1, max_reconnects=0).version == 1
    finally:
        srv.close()


def test_a_fetch_that_finds_every_member_slot_taken_tries_again_then_names_the_server(monkeypatch):
    """A server with its member slots full closes a newly authenticated connection before its
    Welcome. The fetch's first connection retries from the reconnect budget, like its streams do,
    and says which server failed it when the budget is spent (it once leaked a bare ConnectionError)."""
    monkeypatch.setattr(relay_gate, "MAX_MEMBERS", 1)
    srv = WeightServer(TOKEN, host="127.0.0.1", chunk_bytes=CHUNK, checksum="crc32")
    port = _port(srv)
    try:
        srv.publish(1, weights())
        squatter = _member(srv)  # holds the only slot
        named = rf"127\.0\.0\.1:{port}: no connection took after 3 tries"
        with pytest.raises(WeightTransferError, match=named):
            fetch_weights(srv.address, TOKEN, streams=1, max_reconnects=2)
        assert srv.stats["turned_away"] == 3

        threading.Timer(1.0, squatter.close).start()  # the slot frees while the fetch retries
        got = fetch_weights(srv.address, TOKEN, streams=1, max_reconnects=50)
        assert got.version == 1 and got.stats["reconnects"] >= 1
    finally:
        srv.close()


def test_a_full_pending_pool_closes_an_old_connection_of_the_biggest_source_not_the_newcomer(monkeypatch):
    monkeypatch.setattr(relay_gate, "MAX_PENDING", 5)
    monkeypatch.setattr(relay_gate, "MAX_PENDING_PER_SOURCE", 4)
    srv = WeightServer(TOKEN, host="127.0.0.1", chunk_bytes=CHUNK, checksum="crc32")
    port = _port(srv)
    socks = []

    def connect(source: str) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))
        socks.append(s)
        assert s.recv(4096)  # every newcomer is admitted: it gets its Challenge
        return s

    try:
        first = connect("127.0.0.2")
        # 4 fill 127.0.0.1's share; the 5th and 6th each push out its oldest.
        crowd = [connect("127.0.0.1") for _ in range(6)]
        # The pool is full: the source holding the most gives way, not the oldest connection.
        last = connect("127.0.0.3")
        assert [s.recv(1) for s in crowd[:3]] == [b""] * 3  # closed by the server, oldest first
        assert srv.stats["evicted"] == 3 and srv.connections()["pending"] == 5
        for s in (first, last, *crowd[3:]):
            s.sendall(b"\0")  # still open: nothing else was pushed out
        assert srv.stats["evicted"] == 3
    finally:
        for s in socks:
            s.close()
        srv.close()


def test_a_handshake_trickled_in_a_byte_at_a_time_is_cut_at_its_deadline(monkeypatch):
    """The deadline runs from accept: bytes arriving do not extend it (they did, 10 s per byte)."""
    monkeypatch.setattr(relay_gate, "HANDSHAKE_DEADLINE_S", 1.0)
    srv = WeightServer(TOKEN, host="127.0.0.1", chunk_bytes=CHUNK, checksum="crc32")
    s = socket.create_connection(("127.0.0.1", _port(srv)), timeout=10)
    try:
        assert s.recv(4096)  # the Challenge
        n = rw.PREAUTH_MAX_FRAME - 24
        s.sendall(struct.pack(">I", n))
        closed = False
        for _ in range(n - 1):  # 0.05 s a byte: 50 s for the frame, were it not cut
            try:
                s.sendall(b"\0")
                if select.select([s], [], [], 0.05)[0]:
                    closed = s.recv(1) == b""
            except OSError:  # reset: the server closed it while we were sending
                closed = True
            if closed:
                break
        assert closed and srv.stats["expired"] == 1
    finally:
        s.close()
        srv.close()


def _check_server_back_to(srv: WeightServer, threads: int, fds: int) -> None:
    """Every stranger's socket and every member's thread ended: nothing leaked."""
    _wait_for(lambda: srv.connections() == {"pending": 0, "members": 0}, "connections to close")
    _wait_for(lambda: _server_threads() == threads, "the server's threads to end")
    _wait_for(lambda: _open_fds() <= fds, "file descriptors to be released")


@pytest.mark.parametrize("trickle", [False, True], ids=["silent", "trickling"])
def test_hundreds_of_connections_held_by_strangers_do_not_stop_any_fetch(fd_room, trickle):
    """400 connections without the token opened before each version (and all kept open) once made
    every fetch fail: they held the server's 256 slots for 10 s, the client retried for 4."""
    srv = WeightServer(TOKEN, host="127.0.0.1", chunk_bytes=CHUNK, checksum="crc32")
    squatters = Squatters(_port(srv), trickle=trickle)
    try:
        threads, fds = _server_threads(), _open_fds()
        squatters.start()
        for version in (1, 2, 3):
            want = weights(seed=version)
            srv.publish(version, want)
            squatters.open(ATTACKERS)
            got = fetch_weights(srv.address, TOKEN)  # the generators' settings
            assert got.version == version
            _assert_bit_exact(got.tensors, want)
        # Every stranger was accepted before the fetch that followed it (one accept queue, in
        # order), and the server holds at most MAX_PENDING_PER_SOURCE of them from one address.
        closed = srv.stats["evicted"] + srv.stats["expired"]
        assert closed >= 3 * ATTACKERS - relay_gate.MAX_PENDING_PER_SOURCE, srv.stats
        assert srv.stats["rejected"] == 0 and srv.stats["turned_away"] == 0
    finally:
        squatters.close()
    _check_server_back_to(srv, threads, fds)
    srv.close()


def test_a_fetch_outlasts_strangers_who_reopen_every_connection_the_server_closes(fd_room):
    srv = WeightServer(TOKEN, host="127.0.0.1", chunk_bytes=CHUNK, checksum="crc32")
    squatters = Squatters(_port(srv), reconnect=True)
    try:
        threads, fds = _server_threads(), _open_fds()
        squatters.open(ATTACKERS)
        squatters.start()
        _wait_for(lambda: squatters.reopened >= ATTACKERS, "the strangers to churn")
        for version in (1, 2, 3):
            want = weights(seed=version)
            srv.publish(version, want)
            got = fetch_weights(srv.address, TOKEN)
            assert got.version == version
            _assert_bit_exact(got.tensors, want)
    finally:
        squatters.close()
    _check_server_back_to(srv, threads, fds)
    srv.close()


def _sealed_pair() -> tuple[rw.Conn, rw.Conn, socket.socket]:
    """Two connected Conns sealed with matching keys, and the sender's raw socket."""
    a, b = tcp_pair()
    tx, rx = rw.Conn(a, 10), rw.Conn(b, 10)
    c2s, s2c = rw.session_keys(TOKEN, b"s" * 16, b"c" * 16)
    tx.secure(tx_key=c2s, rx_key=s2c)
    rx.secure(tx_key=s2c, rx_key=c2s)
    return tx, rx, a


@pytest.mark.parametrize(
    "n", [1, 15, 16, rw.SEAL_SLICE - 1, rw.SEAL_SLICE, rw.SEAL_SLICE + 7, 3 * rw.SEAL_SLICE + 100]
)
def test_chunk_payloads_sealed_in_slices_arrive_whole_and_a_flipped_byte_in_any_slice_fails(n):
    """Payloads are sealed and opened a slice at a time: every size round-trips exactly, a
    byte flipped in the last slice is caught by the tag, and the stream stays in step."""
    tx, rx, raw = _sealed_pair()
    payload = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    try:
        sender = threading.Thread(target=lambda: tx.send_raw(payload.numpy()))
        sender.start()
        out = bytearray(n)
        assert rx.recv_payload_into(memoryview(out))
        sender.join()
        assert bytes(out) == payload.numpy().tobytes()

        # The same payload sealed by hand under the next nonce, one byte flipped near its end.
        enc = rw.Cipher(rw.algorithms.AES(tx._tx_key), rw.modes.GCM(tx._next_tx_nonce())).encryptor()
        wire = bytearray(enc.update(payload.numpy().tobytes()) + enc.finalize() + enc.tag)
        wire[max(0, n - 2)] ^= 0x01
        forger = threading.Thread(target=raw.sendall, args=(bytes(wire),))
        forger.start()
        assert rx.recv_payload(n) is None
        forger.join()

        tx.send(rw.GetChunks(7, [1, 2]))  # in step: the next frame opens
        assert rx.recv() == rw.GetChunks(7, [1, 2])
    finally:
        tx.close()
        rx.close()
