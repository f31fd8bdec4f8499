"""The sample stream against peers that hold the run's keys but not its manners: another
protocol version, a flood of hellos with made-up generator ids, oversized frames. Loopback,
real CURVE sockets."""

from __future__ import annotations

import time

import pytest
import zmq
from support.stream import TOKEN, delivers, drain, sample

from streamrl_cli.transport import TransportError
from streamrl_cli.transport import wire as w
from streamrl_cli.transport.routing import DispatchService
from streamrl_cli.transport.samples import StreamConfig, make_receiver, make_sender
from streamrl_cli.transport.wire import Request
from streamrl_cli.transport.zmq_common import curve_keys, make_client_socket


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def raw_peer(ctx: zmq.Context, address: str) -> zmq.Socket:
    s = make_client_socket(ctx, curve_keys(TOKEN))
    s.rcvtimeo = 10_000
    s.connect(f"tcp://{address}")
    return s


def wait(predicate, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)
    return predicate()


def test_a_hello_of_another_protocol_version_is_refused_by_name(ctx):
    r = make_receiver(StreamConfig(bind="tcp://127.0.0.1:0"), token=TOKEN)
    try:
        peer = raw_peer(ctx, r.address)
        peer.send(w.message(w.HELLO, w.Hello(1, "generator-0", "s1")))
        kind, body = w.split(peer.recv())
        assert kind == w.REFUSED
        assert f"protocol {w.PROTOCOL}, this generator 1" in w.decode_str(body)
        assert r.stats["refused"] == 1 and r.generators() == []
    finally:
        r.close()


def test_a_refused_sender_fails_loudly_instead_of_waiting(ctx):
    """The real sender, once its hello is refused (here: the table is full), raises with the reason."""
    r = make_receiver(StreamConfig(bind="tcp://127.0.0.1:0", max_generators=1), token=TOKEN)
    first = make_sender(StreamConfig(), address=r.address, token=TOKEN, generator="generator-0")
    try:
        first.wait_connected(20)
        late = make_sender(StreamConfig(), address=r.address, token=TOKEN, generator="generator-1")
        try:
            with pytest.raises(TransportError, match="refused this generator: .*already knows 1"):
                late.wait_connected(20)
        finally:
            late.close(0)
    finally:
        first.close(0)
        r.close()


def test_a_flood_of_hellos_is_bounded_and_work_goes_only_to_registered_generators(ctx):
    """What the issue saw: 20,000 hellos made 20,004 "generators" and a prompt went to a phantom.
    Now the receiver keeps at most `max_generators` peers, and the dispatcher, following the
    rendezvous, sends work only to generators registered there."""
    svc = DispatchService(StreamConfig(bind="tcp://127.0.0.1:0", max_generators=64), TOKEN)
    # What watch(rdv) does with the rendezvous' member list: only generator-0 is registered.
    svc._send(svc.dispatcher.require_registration(["generator-0"]))
    flood = raw_peer(ctx, svc.address)
    try:
        for i in range(2000):
            flood.send(w.message(w.HELLO, w.Hello(w.PROTOCOL, f"generator-{1000 + i}", "x")))
        receiver = svc.receiver
        # Phantoms evict each other (none is registered, none owes anything): the table stays bounded.
        assert wait(lambda: "generator-2999" in receiver.generators())
        assert len(receiver.generators()) <= 64 and svc.generators() == []
        assert svc.dispatcher.unregistered_hellos == 2000

        gen = make_sender(StreamConfig(), address=svc.address, token=TOKEN, generator="generator-0")
        try:
            # The table is full of phantoms, but a registered generator is let in.
            gen.wait_connected(20)
        except TransportError as e:
            pytest.fail(f"the registered generator was locked out: {e}")
        try:
            assert wait(lambda: svc.generators() == ["generator-0"])
            svc.submit(
                [Request(prompt_id=f"p{k}", prompt_token_ids=[1, 2], sample_indices=[0]) for k in range(20)]
            )
            got = []
            deadline = time.monotonic() + 20
            while len(got) < 20 and time.monotonic() < deadline:
                for req in gen.requests(timeout=0.2):
                    got.append(req.prompt_id)
                    gen.send(sample(req.prompt_id, 0))
            assert sorted(got) == sorted(f"p{k}" for k in range(20))
            assert len(drain(svc, 20)) == 20 and svc.outstanding() == 0
        finally:
            gen.close(1)
    finally:
        svc.close()


def test_an_oversized_frame_is_dropped_unread_and_the_stream_goes_on(ctx):
    cfg = StreamConfig(bind="tcp://127.0.0.1:0", max_delay_s=0.001)
    r = make_receiver(cfg, token=TOKEN)
    try:
        big = raw_peer(ctx, r.address)
        big.send(w.SAMPLES + b"\0" * (w.MAX_MESSAGE + 1))
        time.sleep(1)
        assert r.stats["messages"] == 0 and r.stats["malformed"] == 0
        assert delivers(cfg, r, "ok")
    finally:
        r.close()


def test_a_generator_registered_before_its_hello_gets_work_once_it_says_hello():
    """The rendezvous' member_registered may arrive before the generator's stream is up: the
    registration is kept, and its hello then makes it a working generator."""
    svc = DispatchService(StreamConfig(bind="tcp://127.0.0.1:0"), TOKEN)
    try:
        svc._send(svc.dispatcher.require_registration([]))
        svc.on_event({"type": "member_registered", "data": {"member_id": "generator-5", "incarnation": 1}})
        svc.submit([Request(prompt_id="p", prompt_token_ids=[1], sample_indices=[0])])
        gen = make_sender(StreamConfig(), address=svc.address, token=TOKEN, generator="generator-5")
        try:
            assert wait(lambda: svc.generators() == ["generator-5"])
            reqs = []
            assert wait(lambda: reqs.extend(gen.requests(timeout=0.1)) or reqs)
            assert [r.prompt_id for r in reqs] == ["p"]
        finally:
            gen.close(0)
    finally:
        svc.close()
