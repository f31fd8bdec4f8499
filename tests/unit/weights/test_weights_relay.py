"""The cross-site relay on loopback: broken connections, corrupted chunks, wrong tokens.

Faults are injected in flight by tests/support/netproxy.py between the fetcher and the server. To
corrupt exactly one chunk's payload (and not a header), the corruption tests use one stream
fetching one chunk per request, so the byte offset of every chunk on the wire is known.
"""

from __future__ import annotations

import socket
import threading

import msgspec
import pytest
import torch
from support.netproxy import Proxy, cut_after
from support.weights_broadcast import SPAWN, digests, form_group
from support.weights_relay import CHUNK, TOKEN, weights  # noqa: F401

from streamrl_cli.weights import WeightTransferError
from streamrl_cli.weights import relay_wire as rw
from streamrl_cli.weights.relay import VersionSuperseded, WeightServer, fetch_weights


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for k, w in want.items():
        g = got[k]
        assert (g.dtype, g.shape) == (w.dtype, w.shape), k
        assert torch.equal(
            g.contiguous().reshape(-1).view(torch.uint8), w.contiguous().reshape(-1).view(torch.uint8)
        ), k


@pytest.fixture
def server():
    srv = WeightServer(TOKEN, host="127.0.0.1", chunk_bytes=CHUNK, checksum="crc32")
    yield srv
    srv.close()


def payload_offset(manifest: rw.Manifest, transmission: int) -> int:
    """Offset, in the server-to-client bytes of a one-stream fetch with batch=1, of the middle of the
    payload of its `transmission`-th chunk (0-based); every chunk before it is full-size."""
    frame = lambda m: 4 + len(msgspec.msgpack.encode(m))  # noqa: E731
    # Sealed frames (from the manifest on) and payloads each carry a 16-byte tag.
    pre = frame(rw.Challenge(rw.PROTOCOL, b"\0" * 16)) + frame(rw.Welcome(b"\0" * 32))
    pre += frame(manifest) + rw.TAG
    header = frame(rw.ChunkHeader(manifest.version, 1, "none", CHUNK, CHUNK, b"\0" * 4)) + rw.TAG
    return pre + transmission * (header + CHUNK + rw.TAG) + header + CHUNK // 2


def test_fetch_over_several_streams_equals_the_source(server):
    w = weights()
    m = server.publish(3, w)
    assert [t.offset % 64 for t in m.tensors] == [0] * len(w)
    got = fetch_weights(server.address, TOKEN, streams=3)
    assert got.version == 3 and got.stats["corrupted"] == 0 and got.stats["reconnects"] == 0
    assert_same(got.tensors, w)
    assert server.stats["chunks"] == -(-m.total // CHUNK)  # each chunk once, whichever stream took it
    # The next version received into the previous one's buffer (what a relay does every step).
    server.publish(4, weights(4))
    again = fetch_weights(server.address, TOKEN, streams=2, out=got.buffer)
    assert again.buffer.data_ptr() == got.buffer.data_ptr() and again.version == 4
    assert_same(again.tensors, weights(4))


def test_broken_connection_resumes_with_only_the_missing_chunks(server):
    w = weights(1)
    m = server.publish(1, w)
    n = -(-m.total // CHUNK)
    proxy = Proxy(server.address, tamper=cut_after(0, "down", 100_000))  # stream 0 dies mid-chunk
    try:
        got = fetch_weights(proxy.address, TOKEN, streams=2, batch=2, depth=2)
    finally:
        proxy.close()
    assert_same(got.tensors, w)
    assert proxy.cut == 1 and got.stats["reconnects"] == 1
    # Resumed, not restarted: at most the broken stream's in-flight chunks (depth x batch) come twice.
    assert n <= server.stats["chunks"] <= n + 2 * 2


def test_corrupted_chunk_is_detected_and_fetched_again(server):
    w = weights(2)
    m = server.publish(2, w)
    n = -(-m.total // CHUNK)
    at = payload_offset(m, 3)  # flip one byte in the middle of chunk 3's bytes, once
    flipped = []

    def flip(conn: int, direction: str, offset: int, data: bytes) -> bytes:
        if direction == "down" and not flipped and offset <= at < offset + len(data):
            flipped.append(at)
            i = at - offset
            return data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1 :]
        return data

    proxy = Proxy(server.address, tamper=flip)
    try:
        got = fetch_weights(proxy.address, TOKEN, streams=1, batch=1, depth=1)
    finally:
        proxy.close()
    assert flipped and got.stats["corrupted"] == 1 and got.stats["reconnects"] == 0
    assert server.stats["chunks"] == n + 1  # that chunk, and only it, was sent twice
    assert_same(got.tensors, w)


def test_chunk_corrupted_every_time_is_never_loaded(server):
    m = server.publish(5, weights(5))
    bad = {payload_offset(m, s) for s in (3, 4, 5)}  # chunk 3 and both of its retries

    def flip(conn: int, direction: str, offset: int, data: bytes) -> bytes:
        hits = [o - offset for o in bad if direction == "down" and offset <= o < offset + len(data)]
        for i in hits:
            data = data[:i] + bytes([data[i] ^ 0x80]) + data[i + 1 :]
        return data

    proxy = Proxy(server.address, tamper=flip)
    try:
        with pytest.raises(WeightTransferError, match="chunk 3 failed verification 3 times"):
            fetch_weights(proxy.address, TOKEN, streams=1, batch=1, depth=1, max_attempts=3)
    finally:
        proxy.close()


def test_wrong_token_is_refused_both_ways(server):
    server.publish(1, weights())
    with pytest.raises(WeightTransferError, match="refused us: unauthorized"):
        fetch_weights(server.address, "not-this-runs-token-000")
    assert server.stats["rejected"] == 1 and server.stats["chunks"] == 0, server.stats

    # A server that does not hold the token cannot pass itself off as the trainer either.
    listener = socket.create_server(("127.0.0.1", 0))

    def impostor() -> None:
        sock, _ = listener.accept()
        conn = rw.Conn(sock, 10)
        try:
            conn.send(rw.Challenge(rw.PROTOCOL, b"n" * 16))
            conn.recv()
            conn.send(rw.Welcome(b"x" * 32))  # welcomes anyone, but cannot compute the right MAC
            conn.recv()  # the client hangs up instead of asking for anything
        except ConnectionError:
            pass
        finally:
            conn.close()

    t = threading.Thread(target=impostor, daemon=True)
    t.start()
    with pytest.raises(WeightTransferError, match="could not prove it holds this run's token"):
        fetch_weights(f"127.0.0.1:{listener.getsockname()[1]}", TOKEN)
    listener.close()


def test_a_newer_version_supersedes_a_fetch_in_progress(server):
    server.publish(1, weights(1))
    with pytest.raises(VersionSuperseded) as e:
        fetch_weights(server.address, TOKEN, version=7)
    assert e.value.current == 1

    def publish_v2_on_first_chunk(conn: int, direction: str, offset: int, data: bytes) -> bytes:
        if direction == "up" and offset > 200 and server._current.manifest.version == 1:
            server.publish(2, weights(2))  # the trainer moves on while the relay fetches
        return data

    proxy = Proxy(server.address, tamper=publish_v2_on_first_chunk)
    try:
        with pytest.raises(VersionSuperseded, match="version 1 is gone") as e:
            fetch_weights(proxy.address, TOKEN, version=1, streams=1, batch=1, depth=1)
    finally:
        proxy.close()
    assert e.value.current == 2
    assert_same(fetch_weights(server.address, TOKEN).tensors, weights(2))


def test_compression_only_where_it_pays():
    srv = WeightServer(TOKEN, host="127.0.0.1", chunk_bytes=CHUNK, compression="zlib")
    try:
        sparse = {"zeros": torch.zeros(100_000), "ones": torch.ones(50_000, dtype=torch.bfloat16)}
        m = srv.publish(1, sparse)
        got = fetch_weights(srv.address, TOKEN)
        assert_same(got.tensors, sparse)
        assert got.stats["bytes_received"] < m.total / 20  # compressible: sent compressed
        noisy = {"w": torch.randn(100_000)}
        m = srv.publish(2, noisy)
        got = fetch_weights(srv.address, TOKEN)
        assert_same(got.tensors, noisy)
        assert got.stats["bytes_received"] == m.total  # random floats: sent raw, no decompression cost
    finally:
        srv.close()
    with pytest.raises(WeightTransferError, match="unknown compression 'lz5'"):
        WeightServer(TOKEN, host="127.0.0.1", compression="lz5")
    with pytest.raises(WeightTransferError, match="checksum 'md5' is not available"):
        WeightServer(TOKEN, host="127.0.0.1", checksum="md5")


def _far_site(rank: int, relay_address: str, ports, out) -> None:
    """Rank 0: the relay (fetch across sites, then broadcast); rank 1: a generator worker there."""
    from streamrl_cli.weights.broadcast import BroadcastSender, receive_weights

    try:
        group = form_group(rank, 2, ports)
        if rank == 0:
            fetched = fetch_weights(relay_address, TOKEN, streams=2)
            BroadcastSender(group, bucket_bytes=128 << 10).send(fetched.tensors, fetched.version)
            out.put((rank, fetched.version))
        else:
            version, tensors = receive_weights(group)
            out.put((rank, (version, digests(tensors))))
        group.close()
    except Exception as e:
        out.put((rank, f"{type(e).__name__}: {e}"))


@pytest.mark.slow
def test_relay_then_local_broadcast_delivers_the_trainers_tensors(server):
    w = weights(9)
    server.publish(9, w)
    ports, q = SPAWN.Queue(), SPAWN.Queue()
    procs = [SPAWN.Process(target=_far_site, args=(r, server.address, ports, q)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = dict(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert results == {0: 9, 1: (9, digests(w))}
