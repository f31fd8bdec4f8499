"""Every server that decodes a peer's bytes, sent the deep, the huge and the malformed frame by a peer
that holds the run's token, then a valid call, which must succeed (limits: streamrl_cli.limits).

The environment server's case is in tests/unit/envserver/test_env_server.py (it needs environment
processes); the teacher's stream is the sample stream's receiver (another address, the same code).
"""

from __future__ import annotations

import struct
import time

import msgspec
import pytest
import zmq
from support.stream import TOKEN as STREAM_TOKEN
from support.stream import delivers
from support.weights_relay import TOKEN, connect, relay_server

from streamrl_cli import limits
from streamrl_cli.transport import wire as w
from streamrl_cli.transport.samples import StreamConfig, make_receiver
from streamrl_cli.transport.zmq_common import curve_keys, make_client_socket
from streamrl_cli.weights import relay_wire as rw
from streamrl_cli.weights.relay import fetch_weights

DEEP = b"\x91" * 5000 + b"\xc0"  # [[[[...nil...]]]] 5,000 levels as msgpack: 5 KB


def test_the_limits_are_one_table():
    assert limits.SAMPLE_STREAM_FRAME == w.MAX_MESSAGE
    assert (rw.MAX_FRAME, rw.PREAUTH_MAX_FRAME) == (limits.RELAY_FRAME, limits.RELAY_PREAUTH_FRAME)
    from streamrl_cli.rendezvous import protocol

    assert (protocol.MAX_BODY, protocol.MAX_BODY_DEPTH) == (limits.RENDEZVOUS_BODY, limits.MAX_DEPTH)
    assert limits.depth(1) == 1 and limits.depth({"a": [1]}) == 3 and limits.depth([[[]]]) == 3
    deep: list = []
    for _ in range(100_000):  # no recursion: a value of any depth is measured (and cut off past the limit)
        deep = [deep]
    assert limits.depth(deep) == limits.MAX_DEPTH + 1
    with pytest.raises(limits.FrameError, match="nests deeper than 32"):
        limits.check_depth(deep, "x")


def test_the_sample_receiver_serves_on_after_deep_huge_and_malformed_frames():
    """A batch item nested 5,000 levels deep raised RecursionError out of the receiver's thread (msgspec
    recurses to skip a Raw item), which ended the trainer's stream for every generator."""
    cfg = StreamConfig(bind="tcp://127.0.0.1:0", max_delay_s=0.001, max_generators=16)
    r = make_receiver(cfg, token=STREAM_TOKEN)
    ctx = zmq.Context()
    try:
        peer = make_client_socket(ctx, curve_keys(STREAM_TOKEN))
        peer.connect(f"tcp://{r.address}")
        hello = bytes(w.message(w.HELLO, w.Hello(w.PROTOCOL, "generator-hostile", "s")))
        peer.send(hello)
        peer.send(w.SAMPLES + b"\x92\x91\x01\x91" + DEEP)  # [[1], [deep]]
        peer.send(w.SAMPLES + b"\x92\x91\x01\x91\x82\xa1x" + DEEP)  # an item with a deep unknown field
        peer.send(w.SAMPLES + b"not msgpack")
        peer.send(w.REQUEST_ACK + DEEP)
        peer.send(b"?" + DEEP)
        peer.send(
            w.SAMPLES + b"\x00" * (limits.SAMPLE_STREAM_FRAME + 1)
        )  # dropped unread, with its connection
        deadline = time.monotonic() + 10
        while r.stats["malformed"] < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert r.stats["malformed"] >= 4 and r._thread.is_alive()
        assert delivers(cfg, r, "after-hostile", generator="generator-ok")
        assert r._thread.is_alive()
    finally:
        ctx.destroy(linger=0)
        r.close()


def test_a_request_nested_past_the_limit_is_refused_by_the_generators_decoder():
    req = w.Request(prompt_id="p", prompt_token_ids=[1], sample_indices=[0], env={"a": [[[[[[]]]]]]})
    assert w.decode_request(w.encode(req)).env == req.env
    deep: list = []
    for _ in range(40):
        deep = [deep]
    with pytest.raises(limits.FrameError, match="environment row nests deeper"):
        w.decode_request(
            w.encode(w.Request(prompt_id="p", prompt_token_ids=[], sample_indices=[], env={"x": deep}))
        )
    # the sampling is typed: a free-form value in its place is refused by the decoder itself
    with pytest.raises(msgspec.ValidationError):
        w.decode_request(w.encode(["p", [], [], "", 0, {"x": [[[]]]}]))
    placeholder = w.encode(w.Request(prompt_id="p", prompt_token_ids=[], sample_indices=[], env={"x": "@@"}))
    with pytest.raises(limits.FrameError):  # env's value 5,000 levels deep: the decoder's own recursion
        w.decode_request(placeholder.replace(b"\xa2@@", DEEP))


@pytest.fixture
def relay():
    with relay_server() as srv:
        yield srv


def _answer(conn: rw.Conn) -> object:
    """What the server says next, or None if it hung up (both are refusals)."""
    try:
        return conn.recv()
    except (ConnectionError, OSError, rw.ProtocolError):
        return None


def test_the_relay_serves_on_after_deep_huge_and_malformed_frames(relay):
    """An authenticated client's frame with a deep unknown field raised RecursionError in the relay's
    decoder (only msgspec.DecodeError was caught)."""
    deep_frame = (
        b"\x82\xa4type\xa5Hello\xa1x" + b"\x91" * 900 + b"\xc0"
    )  # under the 1,024-byte pre-auth limit
    with connect(relay.address) as s:  # before authentication
        conn = rw.Conn(s, 5)
        conn.recv()  # the Challenge
        s.sendall(struct.pack(">I", len(deep_frame)) + deep_frame)
        assert not isinstance(_answer(conn), rw.Welcome)
    with connect(relay.address) as s:  # a string that is not UTF-8 (msgspec raised UnicodeDecodeError)
        conn = rw.Conn(s, 5)
        conn.recv()
        bad = b"\x82\xa4type\xa5Hello\xa1\xff\xc0"
        s.sendall(struct.pack(">I", len(bad)) + bad)
        assert not isinstance(_answer(conn), rw.Welcome)
    with connect(relay.address) as s:  # after it: sealed frames
        conn = rw.Conn(s, 5)
        rw.client_handshake(conn, TOKEN)
        conn.sock.sendall(conn._frame(b"\x82\xa4type\xabGetManifest\xa1x" + DEEP))
        assert not isinstance(_answer(conn), rw.Manifest)
    with connect(relay.address) as s:
        conn = rw.Conn(s, 5)
        rw.client_handshake(conn, TOKEN)
        conn.sock.sendall(struct.pack(">I", limits.RELAY_FRAME + rw.TAG + 1))  # announced, never sent
        assert _answer(conn) is None or isinstance(_answer(conn), rw.Error)
    with connect(relay.address) as s:
        conn = rw.Conn(s, 5)
        rw.client_handshake(conn, TOKEN)
        conn.sock.sendall(conn._frame(b"\xc1 malformed"))
        assert not isinstance(_answer(conn), rw.Manifest)
    assert fetch_weights(relay.address, TOKEN, streams=2).version == 1


def test_the_rendezvous_answers_deep_huge_and_malformed_bodies_then_serves(rendezvous_server):
    http, _ = rendezvous_server
    json_headers = {"Content-Type": "application/json"}
    deep = "[" * 100_000 + "]" * 100_000  # 200 KB, under the body limit
    r = http.post("/v1/register", content=deep, headers=json_headers)
    assert r.status_code == 400 and "nest" in r.json()["message"], r.text
    r = http.post("/v1/register", content=b"{" + b" " * limits.RENDEZVOUS_BODY + b"}", headers=json_headers)
    assert r.status_code == 413, r.text
    r = http.post("/v1/register", content=b"\xff{not json", headers=json_headers)
    assert r.status_code == 400, r.text
    r = http.post("/v1/register", json={"role": "hostile-test", "rank": 0})
    assert r.status_code == 200 and r.json()["member_id"] == "hostile-test-0", r.text
