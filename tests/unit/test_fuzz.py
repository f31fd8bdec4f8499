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
from pathlib import Path

import msgspec
import pytest
import yaml
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.helpers import tcp_pair
from support.stream import TOKEN as STREAM_TOKEN
from support.stream import delivers
from support.weights_relay import TOKEN, connect, relay_server

from streamrl_cli.errors import RecipeError
from streamrl_cli.launch import local
from streamrl_cli.recipe import safe_yaml
from streamrl_cli.rundir import RunDir, catalog
from streamrl_cli.transport import wire as w
from streamrl_cli.transport.samples import StreamConfig, make_receiver
from streamrl_cli.transport.zmq_common import curve_keys, make_client_socket
from streamrl_cli.weights import relay_wire as rw
from streamrl_cli.weights.relay import fetch_weights

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
    with relay_server() as srv:
        yield srv


@FAST
@given(junk=st.binary(max_size=2048), announce=st.integers(0, 2**32 - 1))
def test_relay_server_survives_any_bytes_before_the_handshake(relay, junk, announce):
    with connect(relay.address) as s:
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
    conn = rw.Conn(connect(relay.address), 5)
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
    assert delivers(cfg, r, "after-fuzz", generator="generator-fuzz-ok")


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


# ---- recipe entry points: `streamrl run` / `--dry-run` / `tune-split` all start with recipe.load ----


def _leaf_keys() -> list[str]:
    """Every scalar key of the schema, as a user writes it on the command line (dict sections skipped)."""
    import dataclasses
    import typing

    from streamrl_cli.recipe.schema import Recipe

    out: list[str] = []

    def visit(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            typ = hints[f.name]
            if dataclasses.is_dataclass(typ):
                visit(typ, f"{prefix}{f.name}.")
            elif typing.get_origin(typ) is not dict:
                out.append(prefix + f.name)

    visit(Recipe, "")
    return out


LEAF_KEYS = _leaf_keys()
hostile_values = st.one_of(
    st.integers(-(2**70), 2**70).map(str),
    st.sampled_from(
        [
            "0",
            "-1",
            "1e400",
            "nan",
            "-inf",
            "null",
            "???",
            "[1,2]",
            "{a: 1}",
            "true",
            "''",
            str(2**63),
            str(-(2**63) - 1),
            "../../x",
            "/abs",
            "a/b",
            "${oc.env:HOME}",
        ]
    ),  # fmt: skip
    st.text(max_size=30).map(lambda t: "'" + t.replace("'", "") + "'"),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
)


@settings(max_examples=60, deadline=None)
@given(
    overrides=st.lists(
        st.tuples(st.sampled_from(["", "+", "++", "~"]), st.sampled_from(LEAF_KEYS), hostile_values),
        min_size=1,
        max_size=4,
    )
)
def test_any_overrides_load_and_plan_or_are_one_recipe_error(overrides):
    """`streamrl run local k=v ...` with hostile keys and values: a recipe that loads also plans its jobs
    and role specs (what --dry-run renders) without any exception; anything else is a RecipeError."""
    from streamrl_cli.launch import plan
    from streamrl_cli.recipe.load import load

    lines = [f"{p}{k}" if p == "~" else f"{p}{k}={v}" for p, k, v in overrides]
    try:
        composed = load("local", lines)
    except RecipeError as e:
        assert e.problems and all(isinstance(p, str) and p for p in e.problems)
        return
    plan.jobs(composed.recipe)
    plan.role_specs(composed.recipe, Path("/tmp/streamrl-fuzz-run"))
    r = composed.recipe
    assert r.roles.generator.instances <= 100_000 and r.train.iterations <= 10_000_000


recipe_sections = st.fixed_dictionaries(
    {},
    optional={
        "run": st.dictionaries(st.sampled_from(["name", "root"]), json_values, max_size=2),
        "train": st.dictionaries(
            st.sampled_from(["iterations", "global_batch", "seed", "stall_after_s"]), json_values, max_size=3
        ),  # fmt: skip
        "task": st.dictionaries(
            st.sampled_from(["max_prompt_len", "max_output_len", "num_prompts", "dataset"]),
            json_values,
            max_size=3,
        ),  # fmt: skip
        "roles": st.fixed_dictionaries(
            {},
            optional={
                "generator": st.dictionaries(st.sampled_from(["instances", "max_num_seqs"]), json_values)
            },
        ),
        "algorithm": json_values,
    },
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=recipe_sections)
def test_any_recipe_file_loads_or_is_one_recipe_error(tmp_path_factory, body):
    from streamrl_cli.recipe.load import load

    path = tmp_path_factory.mktemp("recipe") / "r.yaml"
    path.write_text(yaml.safe_dump({"defaults": ["local", "_self_"], **body}))
    try:
        load(str(path))
    except RecipeError as e:
        assert e.problems


@settings(max_examples=300, deadline=None)
@given(name=st.text(max_size=80))
def test_a_run_directory_is_made_directly_under_its_root_or_not_at_all(tmp_path_factory, name):
    from streamrl_cli.rundir import create

    root = tmp_path_factory.getbasetemp() / "fuzz-root"
    try:
        run = create(root, name)
    except RecipeError:
        return
    assert run.path.parent == root.resolve() and run.path.name.startswith(name)
    run.path.joinpath("roles").rmdir()


# ---- environment server ----


@pytest.fixture(scope="module")
def env_server():
    """An environment server on loopback (its environment processes real) and a token holder's socket."""
    import asyncio
    import threading

    from streamrl_cli.agent.env_host import EnvSettings
    from streamrl_cli.envserver.server import SERVICE, EnvServer

    envs = Path(__file__).parent / "agent" / "envs.py"
    loop = asyncio.new_event_loop()
    server = EnvServer(EnvSettings(env=f"{envs}:Scripted", workers=1), STREAM_TOKEN, bind_host="127.0.0.1")
    port = loop.run_until_complete(server.start())
    serving = loop.create_task(server.serve())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    ctx = zmq.Context()
    peer = make_client_socket(ctx, curve_keys(STREAM_TOKEN, SERVICE))
    peer.connect(f"tcp://127.0.0.1:{port}")
    yield server, peer
    ctx.destroy(linger=0)

    async def stop():
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        await server.close()

    asyncio.run_coroutine_threadsafe(stop(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def _pack(value) -> bytes:
    try:
        return msgspec.msgpack.encode(value)
    except OverflowError:  # an int past 64 bits (json_values has any): not a frame anyone can send
        return b"\xc0"


def _deep(levels: int) -> bytes:
    return b"\x94\x01\xa5reset\xa3g-9" + b"\x91" * levels + b"\xc0"


@FAST
@given(
    frames=st.lists(
        st.one_of(
            st.binary(max_size=300),
            json_values.map(_pack),
            st.builds(
                lambda c, o, s, p: _pack([c, o, s, p]),
                st.integers(-(2**63), 2**63 - 1) | st.text(max_size=5),
                st.sampled_from(["reset", "step", "close", "ping", "nope"]),
                st.text(max_size=12),
                json_values,
            ),  # fmt: skip
            st.integers(1, 3000).map(_deep),
        ),
        min_size=1,
        max_size=6,
    )
)
def test_env_server_survives_any_frames_from_a_token_holder(env_server, frames):
    server, peer = env_server
    for f in frames:
        peer.send(f)
    while peer.poll(50):  # its answers: errors for what was no request
        peer.recv_multipart()


def test_env_server_still_serves_after_the_fuzzing(env_server):
    from streamrl_cli.envserver.server import decode, encode

    server, peer = env_server
    time.sleep(0.5)
    while peer.poll(100):
        peer.recv_multipart()
    peer.send(encode([10**6, "reset", "fuzz-ok-1", {"prompt": "p"}]))
    assert peer.poll(10_000) and decode(peer.recv_multipart()[-1]) == [10**6, "ok", []]
    peer.send(encode([10**6 + 1, "step", "fuzz-ok-1", "turn"]))
    assert peer.poll(10_000)
    cid, kind, step = decode(peer.recv_multipart()[-1])
    assert (cid, kind, step["done"]) == (10**6 + 1, "ok", False)
    assert server.stats["malformed"] > 0
