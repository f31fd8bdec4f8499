"""The relay against a hostile network: tampered manifests, strangers announcing huge frames,
eavesdroppers. Loopback only; tests/support/netproxy.py stands in for the man in the middle."""

from __future__ import annotations

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

from streamrl_cli.weights import WeightTransferError
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
    with pytest.raises(WeightTransferError, match="speaks protocol 1, this relay 2"):
        fetch_weights(f"127.0.0.1:{listener.getsockname()[1]}", TOKEN)
    listener.close()


def test_connections_beyond_the_bound_are_turned_away_not_threaded(monkeypatch):
    from streamrl_cli.weights import relay

    monkeypatch.setattr(relay, "MAX_CONNECTIONS", 4)
    srv = WeightServer(TOKEN, host="127.0.0.1", chunk_bytes=CHUNK, checksum="crc32")
    port = int(srv.address.rsplit(":", 1)[1])
    try:
        srv.publish(1, weights())
        idle = []
        for _ in range(4):  # strangers that connect and say nothing
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            assert s.recv(4096)  # each gets its Challenge
            idle.append(s)
        extra = socket.create_connection(("127.0.0.1", port), timeout=10)
        assert extra.recv(4096) == b""  # closed at once: no thread, no Challenge
        extra.close()
        assert srv.stats["turned_away"] == 1
        for s in idle:
            s.close()
        deadline = time.monotonic() + 10
        while True:  # their threads notice the hang-up and free the slots
            try:
                assert fetch_weights(srv.address, TOKEN, streams=1, max_reconnects=0).version == 1
                break
            except WeightTransferError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
    finally:
        srv.close()


def test_a_fetch_that_finds_every_slot_taken_tries_again_then_names_the_server(monkeypatch):
    """A server with its connection slots full closes new connections at once. The fetch's first
    connection retries from the reconnect budget, like its streams do, and says which server
    failed it when the budget is spent (it once leaked a bare ConnectionError)."""
    from streamrl_cli.weights import relay

    monkeypatch.setattr(relay, "MAX_CONNECTIONS", 1)
    srv = WeightServer(TOKEN, host="127.0.0.1", chunk_bytes=CHUNK, checksum="crc32")
    port = int(srv.address.rsplit(":", 1)[1])
    try:
        srv.publish(1, weights())
        squatter = socket.create_connection(("127.0.0.1", port), timeout=10)
        assert squatter.recv(4096)  # its Challenge: it holds the only slot
        named = rf"127\.0\.0\.1:{port}: no connection took after 3 tries"
        with pytest.raises(WeightTransferError, match=named):
            fetch_weights(srv.address, TOKEN, streams=1, max_reconnects=2)
        assert srv.stats["turned_away"] == 3

        threading.Timer(1.0, squatter.close).start()  # the slot frees while the fetch retries
        got = fetch_weights(srv.address, TOKEN, streams=1, max_reconnects=50)
        assert got.version == 1 and got.stats["reconnects"] >= 1
    finally:
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
