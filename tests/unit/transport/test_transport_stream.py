"""The ZeroMQ sample stream on loopback: real sockets, real CURVE, real reconnections.

Failures are injected with tests/support/netproxy.py (a TCP proxy that cuts connections) rather
than by reaching into the objects, so what is tested is what a network does to the stream.
The generator killed with SIGKILL, with the rendezvous declaring it lost, is in
test_transport_kill.py.
"""

from __future__ import annotations

import threading
import time

import pytest
import zmq
from support.netproxy import Proxy, cut_after
from support.stream import TOKEN, drain, sample  # noqa: F401

from streamrl_cli.transport import BackpressureTimeout, TransportError
from streamrl_cli.transport.routing import Dispatcher
from streamrl_cli.transport.samples import SeenSet, StreamConfig, make_receiver, make_sender
from streamrl_cli.transport.wire import Request
from streamrl_cli.transport.zmq_common import curve_keys


@pytest.fixture
def cfg():
    return StreamConfig(bind="tcp://127.0.0.1:0", max_delay_s=0.001)


@pytest.fixture
def receiver(cfg):
    r = make_receiver(cfg, token=TOKEN)
    yield r
    r.close()


def test_samples_and_requests_round_trip_with_acks(cfg, receiver):
    s = make_sender(cfg, address=receiver.address, token=TOKEN, generator="generator-0")
    try:
        s.wait_connected(10)
        assert receiver.generators() == ["generator-0"]
        reqs = [
            Request(
                prompt_id=f"p{i}",
                prompt_token_ids=[i],
                sample_indices=[0, 1],
                priority=i,
                batch_limit=i,
                target="generator-0" if i % 2 else "",
            )
            for i in range(5)
        ]
        receiver.dispatch("generator-0", reqs[:2])
        receiver.dispatch("generator-0", reqs[2:])
        got_reqs = []
        while len(got_reqs) < 5:
            got_reqs += s.requests(timeout=10)
        assert got_reqs == reqs
        for r in reqs:
            for i in r.sample_indices:
                s.send(sample(r.prompt_id, i))
        assert s.flush(10) and s.pending() == 0  # every sample acknowledged: the generator let go
        got = drain(receiver, 10)
        assert sorted(x.key for x in got) == sorted((r.prompt_id, i) for r in reqs for i in (0, 1))
        first = sample("p0", 0)
        first.generator = "generator-0"  # filled in by the sender
        assert next(x for x in got if x.key == ("p0", 0)) == first  # every field survives the trip
        assert all(x.generator == "generator-0" and x.weight_version == 3 for x in got)
        assert receiver.get(timeout=0.05) is None
    finally:
        s.close()


def test_duplicates_are_dropped_but_acknowledged(cfg, receiver):
    a = make_sender(cfg, address=receiver.address, token=TOKEN, generator="generator-0")
    b = make_sender(cfg, address=receiver.address, token=TOKEN, generator="generator-1")
    try:
        for snd in (a, b, a):
            for i in range(20):
                snd.send(sample("p", i))
        assert a.flush(10) and b.flush(10)
        got = drain(receiver, 20)
        assert sorted(x.sample_index for x in got) == list(range(20))
        assert receiver.get(timeout=0.2) is None
        assert receiver.stats["received"] == 60 and receiver.stats["dropped"] == 40
    finally:
        a.close()
        b.close()


def test_backpressure_bounds_memory_and_send_times_out():
    cfg = StreamConfig(bind="tcp://127.0.0.1:0", window=4, queue=8, max_batch=2, max_delay_s=0)
    r = make_receiver(cfg, token=TOKEN)
    s = make_sender(cfg, address=r.address, token=TOKEN, generator="generator-0")
    try:
        sent = 0
        with pytest.raises(BackpressureTimeout, match="unacknowledged by the trainer"):
            for i in range(1000):  # the trainer consumes nothing
                s.send(sample("p", i), timeout=1.0)
                sent += 1
        # Everything in the system: the receiver's queue (+ one batch) and the sender's window.
        assert r.qsize() <= cfg.queue + cfg.max_batch
        assert s.pending() == cfg.window and s.room() == 0  # the generator role sends from a thread now
        assert cfg.window <= sent <= cfg.queue + cfg.max_batch + cfg.window
        got = drain(r, sent)  # the trainer catches up: the window opens, nothing was lost
        for i in range(sent, sent + 10):
            s.send(sample("p", i), timeout=10)
        got += drain(r, 10)
        assert sorted(x.sample_index for x in got) == list(range(sent + 10))
        assert s.flush(10) and s.room() == cfg.window
    finally:
        s.close()
        r.close()


def test_unauthenticated_peers_are_rejected(cfg, receiver):
    wrong = make_sender(
        cfg, address=receiver.address, token="another-runs-token-0000", generator="generator-9"
    )
    with pytest.raises(TransportError, match="wrong run token"):
        wrong.wait_connected(10)
    with pytest.raises(TransportError, match="wrong run token"):
        wrong.send(sample("evil", 0))
    wrong.close(0)
    ctx = zmq.Context()
    try:
        # The server's key but not the run's client key: the ZAP handler refuses it.
        keys, other = curve_keys(TOKEN), curve_keys("another-runs-token-0000")
        forged = ctx.socket(zmq.DEALER)
        forged.curve_serverkey, forged.curve_publickey = keys.server_public, other.client_public
        forged.curve_secretkey = other.client_secret
        forged.connect(f"tcp://{receiver.address}")
        forged.send_multipart([b"S", b"\x91\x01", b"junk"])
        plain = ctx.socket(zmq.DEALER)  # no CURVE at all
        plain.connect(f"tcp://{receiver.address}")
        plain.send_multipart([b"S", b"\x91\x01", b"junk"])
        deadline = time.monotonic() + 10
        while (receiver.stats["rejected"] < 1 or receiver.stats["handshake_failures"] < 3) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.05)
        assert receiver.stats["rejected"] >= 1 and receiver.stats["handshake_failures"] >= 3
    finally:
        ctx.destroy(linger=0)
    good = make_sender(cfg, address=receiver.address, token=TOKEN, generator="generator-0")
    try:
        good.send(sample("ok", 0))
        got = drain(receiver, 1)
        assert [x.key for x in got] == [("ok", 0)] and receiver.get(timeout=0.2) is None
        assert receiver.stats["received"] == 1 and receiver.stats["malformed"] == 0
        assert receiver.generators() == ["generator-0"]
    finally:
        good.close()


def test_broken_connection_resends_unacked_samples_and_requests(cfg, receiver):
    # The proxy cuts the first connection once 20 KB went up: mid-message, so some samples
    # of that connection were never acknowledged and must be sent again on the next one.
    proxy = Proxy(receiver.address, tamper=cut_after(0, "up", 20_000))
    s = make_sender(cfg, address=proxy.address, token=TOKEN, generator="generator-0")
    try:
        for i in range(200):
            s.send(sample("p", i, n_tokens=64))
        assert s.flush(20)
        got = drain(receiver, 200)
        assert sorted(x.sample_index for x in got) == list(range(200))
        assert receiver.get(timeout=0.2) is None
        assert proxy.cut >= 1 and s.stats["handshakes"] >= 2 and s.stats["resent"] >= 1
        # Requests dispatched while the connection is down arrive once it is back, once each.
        proxy.tamper = None
        proxy.cut_all()
        receiver.dispatch(
            "generator-0",
            [Request(prompt_id=f"q{i}", prompt_token_ids=[], sample_indices=[0]) for i in range(3)],
        )
        got_reqs = []
        deadline = time.monotonic() + 20
        while len(got_reqs) < 3 and time.monotonic() < deadline:
            got_reqs += s.requests(timeout=0.5)
        proxy.cut_all()  # and a reconnection after they arrived does not deliver them twice
        s.send(sample("after", 0))
        assert drain(receiver, 1)[0].key == ("after", 0)
        assert [r.prompt_id for r in got_reqs + s.requests(timeout=0.3)] == ["q0", "q1", "q2"]
    finally:
        s.close()
        proxy.close()


def test_generator_restarted_with_the_same_id_gets_its_work_again(cfg):
    d = Dispatcher()
    r = make_receiver(cfg, token=TOKEN, hooks=d)
    old = make_sender(cfg, address=r.address, token=TOKEN, generator="generator-0")
    try:
        old.wait_connected(10)
        for g, reqs in d.submit([Request(prompt_id="p", prompt_token_ids=[], sample_indices=[0, 1])]).items():
            r.dispatch(g, reqs)
        assert [x.sample_indices for x in old.requests(timeout=10)] == [[0, 1]]
        old.send(sample("p", 0))
        assert old.flush(10)
        old.close(0)  # the process dies; a new one starts under the same member id
        new = make_sender(cfg, address=r.address, token=TOKEN, generator="generator-0")
        reqs = new.requests(timeout=10)
        assert [(x.prompt_id, x.sample_indices) for x in reqs] == [("p", [1])]  # only what was owed
        new.send(sample("p", 1))
        new.send(sample("p", 0))  # a stale duplicate from the new process is dropped too
        assert new.flush(10)
        assert sorted(x.key for x in drain(r, 2)) == [("p", 0), ("p", 1)]
        assert r.get(timeout=0.2) is None and d.outstanding() == 0
        new.close()
    finally:
        r.close()


def test_factory_and_config_errors():
    with pytest.raises(
        TransportError, match=r"unknown sample transport type 'nats' \(stream.type\); valid: zmq"
    ):
        make_receiver(StreamConfig(type="nats"), token=TOKEN)
    with pytest.raises(TransportError, match="window must be >= 1, got 0; max_delay_s must be >= 0"):
        StreamConfig(window=0, max_delay_s=-1)
    r = make_receiver(StreamConfig(bind="tcp://127.0.0.1:0"), token=TOKEN)
    try:
        with pytest.raises(TransportError, match="cannot listen for samples"):
            make_receiver(StreamConfig(bind=f"tcp://{r.address}"), token=TOKEN)
    finally:
        r.close()
    seen = SeenSet()
    assert seen.admit(sample("a", 0)) and not seen.admit(sample("a", 0))
    seen.forget(["a"])
    assert seen.admit(sample("a", 0))


def test_send_from_many_threads_is_safe(cfg, receiver):
    s = make_sender(cfg, address=receiver.address, token=TOKEN, generator="generator-0")
    try:
        threads = [
            threading.Thread(target=lambda t=t: [s.send(sample(f"t{t}", i)) for i in range(100)])
            for t in range(4)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert s.flush(20)
        assert len({x.key for x in drain(receiver, 400)}) == 400
    finally:
        s.close()


def test_malformed_messages_from_a_run_member_are_counted_and_dropped(cfg, receiver):
    """A peer with the run's keys but another framing or garbage: counted, dropped, the stream goes on."""
    from streamrl_cli.transport import wire as w
    from streamrl_cli.transport.zmq_common import make_client_socket

    ctx = zmq.Context()
    try:
        raw = make_client_socket(ctx, curve_keys(TOKEN))
        raw.connect(f"tcp://{receiver.address}")
        raw.send_multipart([w.SAMPLES, w.encode(w.batch([1], [w.encode(sample("p", 0))]))])  # protocol 1
        raw.send(w.SAMPLES + b"\xc1junk")  # not msgpack
        raw.send(b"?" + w.encode(1))  # unknown kind
        deadline = time.monotonic() + 10
        while receiver.stats["malformed"] < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert receiver.stats["malformed"] == 3 and receiver.get(timeout=0.2) is None
    finally:
        ctx.destroy(linger=0)
    good = make_sender(cfg, address=receiver.address, token=TOKEN, generator="generator-0")
    try:
        good.send(sample("ok", 0))
        assert [x.key for x in drain(receiver, 1)] == [("ok", 0)]
    finally:
        good.close()


def test_a_cancelled_prompt_reaches_its_generator_after_its_request_and_late_samples_are_dropped(cfg):
    """Over-sampling's cancellation: the generators that owe a prompt get a cancel in the same ordered,
    acknowledged stream as its request; what they send of it afterwards is dropped (and acknowledged,
    so nothing is resent), and the ledger owes nothing for it."""
    d = Dispatcher()
    r = make_receiver(cfg, token=TOKEN, hooks=d)
    gen = make_sender(cfg, address=r.address, token=TOKEN, generator="generator-0")
    try:
        gen.wait_connected(10)
        reqs = [Request(prompt_id=p, prompt_token_ids=[1], sample_indices=[0, 1]) for p in ("keep", "drop")]
        for g, batch in d.submit(reqs).items():
            r.dispatch(g, batch)
        gen.send(sample("drop", 0))  # one sample of the doomed prompt arrives before its cancel
        assert [x.prompt_id for x in drain(r, 1)] == ["drop"]
        for g, batch in d.cancel(["drop", "never-sent"]).items():
            r.dispatch(g, batch)
        got: list[Request] = []
        deadline = time.monotonic() + 10
        while len(got) < 3 and time.monotonic() < deadline:
            got += gen.requests(timeout=1)
        assert [(x.prompt_id, x.cancel) for x in got] == [("keep", False), ("drop", False), ("drop", True)]
        assert d.ledger.loads() == {"generator-0": 2} and d.ledger.stats["cancelled"] == 1
        for p in ("drop", "keep"):
            for i in (1, 0) if p == "drop" else (0, 1):
                gen.send(sample(p, i))
        assert gen.flush(10) and gen.pending() == 0  # the dropped ones are acknowledged too
        assert sorted(x.key for x in drain(r, 2)) == [("keep", 0), ("keep", 1)]
        assert r.get(timeout=0.2) is None and d.outstanding() == 0
    finally:
        gen.close()
        r.close()


class _SlowJoin(Dispatcher):
    """A dispatcher whose join hook takes a while, as a busy trainer's can."""

    def generator_joined(self, generator: str):  # noqa: ANN201 - Dispatcher's own type
        time.sleep(0.5)
        return super().generator_joined(generator)


def test_a_welcomed_generator_is_one_the_dispatcher_already_places_work_on(cfg):
    """The join hook runs before the welcome: when wait_connected() returns, work submitted next
    goes to this generator at once (CI once saw a pause sent before the hook ran reach nobody)."""
    d = _SlowJoin()
    r = make_receiver(cfg, token=TOKEN, hooks=d)
    gen = make_sender(cfg, address=r.address, token=TOKEN, generator="generator-0")
    try:
        gen.wait_connected(10)
        assert d.generators() == ["generator-0"]
        req = Request(prompt_id="a", prompt_token_ids=[1], sample_indices=[0])
        assert list(d.submit([req])) == ["generator-0"]
    finally:
        gen.close()
        r.close()


def test_a_paused_prompt_reaches_its_generator_and_its_samples_are_still_owed(cfg):
    """Partial rollout's pause: a cancel with `keep` reaches the generator the same way, but the
    ledger still owes the prompt's samples (the generator sends each as far as it got); if the
    generator is lost before it does, they are re-dispatched whole to another."""
    d = Dispatcher()
    r = make_receiver(cfg, token=TOKEN, hooks=d)
    gen = make_sender(cfg, address=r.address, token=TOKEN, generator="generator-0")
    try:
        gen.wait_connected(10)
        reqs = [Request(prompt_id=p, prompt_token_ids=[1], sample_indices=[0, 1]) for p in ("a", "b")]
        for g, batch in d.submit(reqs).items():
            r.dispatch(g, batch)
        for g, batch in d.cancel(["a", "b"], keep=True).items():
            r.dispatch(g, batch)
        got: list[Request] = []
        deadline = time.monotonic() + 10
        while len(got) < 4 and time.monotonic() < deadline:
            got += gen.requests(timeout=1)
        assert [(x.prompt_id, x.cancel, x.keep) for x in got[2:]] == [("a", True, True), ("b", True, True)]
        assert d.outstanding() == 4 and d.ledger.stats["cancelled"] == 0
        gen.send(sample("a", 0))
        gen.send(sample("a", 1))
        assert sorted(x.key for x in drain(r, 2)) == [("a", 0), ("a", 1)]
        assert d.outstanding() == 2
        # Lost before it answered for "b": both its samples are open again, for the next generator.
        assert [(x.prompt_id, x.sample_indices) for x in d.ledger.lose("generator-0")] == [("b", [0, 1])]
    finally:
        gen.close()
        r.close()
