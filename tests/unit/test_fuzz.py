"""Property-based hostile input (hypothesis) against every wire and every file a run reads.

Each property feeds generated input to the real parser or the real server on loopback and
checks: only the documented error comes out (a 4xx, ProtocolError, RecipeError, ...), never
anything else, and the server still serves a well-behaved peer afterwards. Example counts are
small enough for CI (the whole module runs in well under a minute); `pytest -m fuzz
--hypothesis-seed=N` reproduces a run.
"""

from __future__ import annotations

import json
import socket
import struct
import time

import msgspec
import pytest
import yaml
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.helpers import tcp_pair
from support.stream import TOKEN as STREAM_TOKEN
from support.stream import drain, sample
from support.weights_relay import CHUNK, TOKEN, weights

from streamrl_cli.errors import RecipeError
from streamrl_cli.launch import local
from streamrl_cli.recipe import safe_yaml
from streamrl_cli.rundir import RunDir, catalog
from streamrl_cli.transport import wire as w
from streamrl_cli.transport.samples import StreamConfig, make_receiver, make_sender
from streamrl_cli.transport.zmq_common import curve_keys, make_client_socket
from streamrl_cli.weights import relay_wire as rw
from streamrl_cli.weights.relay import WeightServer, fetch_weights

pytestmark = pytest.mark.fuzz
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=10), kids, max_size=4),
    max_leaves=30,
)

# ---- relay ----


@pytest.fixture(scope="module")
def relay():
    srv = WeightServer(TOKEN, host="127.0.0.1", chunk_bytes=CHUNK, checksum="crc32", timeout_s=2)
    srv.publish(1, weights())
    yield srv
    srv.close()


def _connect(address: str) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", int(address.rsplit(":", 1)[1])), timeout=5)
    s.settimeout(5)
    return s


@FAST
@given(junk=st.binary(max_size=2048), announce=st.integers(0, 2**32 - 1))
def test_relay_server_survives_any_bytes_before_the_handshake(relay, junk, announce):
    with _connect(relay.address) as s:
        s.recv(4096)  # the Challenge
        try:
            s.sendall(struct.pack(">I", announce) + junk)
            s.shutdown(socket.SHUT_WR)
            while s.recv(4096):  # the server answers (Error) or hangs up; it never waits for 4 GB
                pass
        except OSError:
            pass  # it hung up already


@FAST
@given(
    msgs=st.lists(
        st.one_of(
            st.builds(rw.GetManifest, st.integers(-(2**63), 2**63 - 1)),
            st.builds(rw.GetChunks, st.integers(-2, 3), st.lists(st.integers(-(2**40), 2**40), max_size=5)),
            st.builds(rw.Hello, st.binary(max_size=32), st.binary(max_size=40)),
            st.builds(rw.Error, st.text(max_size=10), st.text(max_size=20)),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_relay_server_answers_any_authenticated_request_or_drops_it(relay, msgs):
    conn = rw.Conn(_connect(relay.address), 5)
    try:
        rw.client_handshake(conn, TOKEN)
        conn.send(*msgs)
        conn.sock.shutdown(socket.SHUT_WR)
        while True:
            msg = conn.recv()
            if isinstance(msg, rw.ChunkHeader):
                conn.recv_payload(msg.wire_len)
    except (ConnectionError, OSError, rw.ProtocolError):
        pass  # the server hung up on an out-of-range or unexpected request: what it should do
    finally:
        conn.close()


def test_relay_still_serves_after_the_fuzzing(relay):
    assert fetch_weights(relay.address, TOKEN, streams=2).version == 1


@settings(max_examples=200, deadline=None)
@given(body=st.binary(max_size=512))
def test_any_frame_body_decodes_or_is_a_protocol_error(body):
    """What a relay client does with whatever a (sealed, so authenticated) server sends."""
    a, b = tcp_pair()
    try:
        a.sendall(struct.pack(">I", len(body)) + body)
        try:
            msg = rw.Conn(b, 5).recv()
            assert isinstance(msg, rw.Message)
        except rw.ProtocolError:
            pass
    finally:
        a.close()
        b.close()


# ---- sample stream ----


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=256))
def test_sample_stream_decoders_raise_only_decode_errors(data):
    for decode in (w.decode_batch, w.decode_sample, w.decode_request, w.decode_hello, w.decode_welcome,
                   w.decode_seqs, w.decode_int, w.decode_str):  # fmt: skip
        try:
            decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
            pass


@pytest.fixture(scope="module")
def stream():
    cfg = StreamConfig(bind="tcp://127.0.0.1:0", max_delay_s=0.001, max_generators=16)
    r = make_receiver(cfg, token=STREAM_TOKEN)
    ctx = zmq.Context()
    peer = make_client_socket(ctx, curve_keys(STREAM_TOKEN))
    peer.connect(f"tcp://{r.address}")
    yield cfg, r, peer
    ctx.destroy(linger=0)
    r.close()


@FAST
@given(
    frames=st.lists(
        st.one_of(
            st.binary(max_size=300),
            st.sampled_from([w.HELLO, w.SAMPLES, w.REQUEST_ACK]).flatmap(
                lambda k: st.binary(max_size=200).map(lambda b: k + b)
            ),
            st.builds(lambda g, p: bytes(w.message(w.HELLO, w.Hello(p, g, "s"))), st.text(max_size=30),
                      st.integers(-3, 5)),
        ),
        min_size=1,
        max_size=8,
    )
)  # fmt: skip
def test_sample_receiver_survives_any_frames_from_a_run_member(stream, frames):
    _, r, peer = stream
    for f in frames:
        peer.send(f)


def test_sample_receiver_still_serves_after_the_fuzzing(stream):
    cfg, r, _ = stream
    time.sleep(0.5)
    assert r._thread.is_alive() and len(r.generators()) <= 16
    good = make_sender(cfg, address=r.address, token=STREAM_TOKEN, generator="generator-fuzz-ok")
    try:
        good.send(sample("after-fuzz", 0))
        assert [x.key for x in drain(r, 1)] == [("after-fuzz", 0)]
    finally:
        good.close()


# ---- rendezvous ----

POSTS = ["/v1/register", "/v1/heartbeat", "/v1/leave", "/v1/versions/propose", "/v1/versions/confirm",
         "/v1/metrics", "/v1/progress"]  # fmt: skip


@FAST
@given(path=st.sampled_from(POSTS), body=json_values)
def test_rendezvous_answers_any_json_body_with_2xx_or_4xx(rendezvous_server, path, body):
    http, _ = rendezvous_server
    r = http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert r.status_code < 500, r.text


@FAST
@given(path=st.sampled_from(POSTS), raw=st.binary(max_size=512))
def test_rendezvous_answers_any_bytes_with_2xx_or_4xx(rendezvous_server, path, raw):
    http, run_dir = rendezvous_server
    r = http.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code < 500, r.text


@FAST
@given(
    record=st.dictionaries(
        st.text(max_size=12), st.text(max_size=12) | st.floats(allow_nan=False), max_size=5
    ),
    state=st.text(min_size=1, max_size=20),
)
def test_metrics_jsonl_stays_one_clean_json_line_per_record(rendezvous_server, record, state):
    http, run_dir = rendezvous_server
    mid = http.post("/v1/register", json={"role": "fuzz", "rank": 0}).json()["member_id"]
    http.post("/v1/heartbeat", content=json.dumps({"member_id": mid, "state": state}),
              headers={"Content-Type": "application/json"})  # fmt: skip
    r = http.post("/v1/metrics", content=json.dumps({"member_id": mid, "record": record}),
                  headers={"Content-Type": "application/json"})  # fmt: skip
    assert r.status_code < 500, r.text
    for line in (run_dir / "metrics.jsonl").read_bytes().split(b"\n"):
        text = line.decode("utf-8")  # every line is UTF-8 ...
        assert not any(c in text for c in "\x1b\r\u2028\u2029\x85")  # ... with nothing that splits or paints
        if text:
            json.loads(text)


# ---- recipes and run directories ----


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=400))
def test_any_yaml_text_is_data_or_a_recipe_error(tmp_path_factory, text):
    try:
        safe_yaml.check_document(tmp_path_factory.getbasetemp() / "x.yaml", text)
    except RecipeError:
        pass


@settings(max_examples=100, deadline=None)
@given(
    anchors=st.integers(1, 12),
    fan=st.integers(1, 12),
)
def test_alias_expansion_is_bounded_whatever_the_shape(tmp_path_factory, anchors, fan):
    lines = ["a0: &a0 [x]"]
    for i in range(1, anchors):
        lines.append(f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * fan) + "]")
    try:
        data = safe_yaml.check_document(tmp_path_factory.getbasetemp() / "x.yaml", "\n".join(lines))
        assert fan ** (anchors - 1) <= safe_yaml.MAX_NODES and isinstance(data, dict)
    except RecipeError as e:
        assert "expands to more than" in str(e)


@FAST
@given(
    files=st.fixed_dictionaries(
        {},
        optional={
            "run.json": st.binary(max_size=100) | json_values.map(lambda v: json.dumps(v).encode()),
            "local.json": st.binary(max_size=100) | json_values.map(lambda v: json.dumps(v).encode()),
            "jobs.json": st.binary(max_size=100),
        },
    ),
    catalog_bytes=st.binary(max_size=300),
)
def test_damaged_run_directory_files_never_raise(tmp_path_factory, monkeypatch, files, catalog_bytes):
    run_dir = tmp_path_factory.mktemp("run")
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("STREAMRL_HOME", str(home))
    for name, data in files.items():
        (run_dir / name).write_bytes(data)
    (home / "catalog.jsonl").write_bytes(catalog_bytes + b"\n" + json.dumps({"path": str(run_dir)}).encode())
    run = RunDir(run_dir)
    assert isinstance(run.info(), dict)
    run.damage()
    local.procs(run)
    catalog()
    if (run_dir / "run.json").exists():
        run.update_info(state="checked")
        assert json.loads((run_dir / "run.json").read_text())["state"] == "checked"
    yaml.safe_load("a: 1")  # the process is still sane
