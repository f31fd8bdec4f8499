"""The trainer's end of the sample stream over ZeroMQ (one ROUTER socket, CURVE + ZAP).

Why one socket both ways: a generator's connection carries its requests out and its samples
back, so the trainer knows each generator by the hello on that connection and needs no second
address per generator. One I/O thread owns the socket. It admits each sample through the
trainer's hooks (duplicates dropped), acknowledges every copy (so the sender lets go of it),
and stops reading while the trainer's queue is full: unread samples then stay unacknowledged
and the senders' windows fill, which is the back-pressure (memory here is bounded by
``queue + max_batch`` samples, plus what ZeroMQ buffers: at most every sender's window).
Requests are numbered per generator session and kept until the generator acknowledges them,
so a reconnection resends them; a generator that comes back as a new process is reported to
the hooks, which re-dispatch what the old one owed.
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from streamrl_cli.transport import TransportError
from streamrl_cli.transport import wire as w
from streamrl_cli.transport.samples import ReceiverHooks, SampleReceiver, StreamConfig
from streamrl_cli.transport.zmq_common import Waker, curve_keys, make_server_socket

log = logging.getLogger("streamrl.transport.receiver")

_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


@dataclass
class _Peer:
    routing_id: bytes | None  # None until its hello arrives (requests wait for it)
    session: str
    next_seq: int = 1
    unacked: dict[int, bytes] = field(default_factory=dict)  # request seq -> encoded request


class ZmqSampleReceiver(SampleReceiver):
    def __init__(self, config: StreamConfig, *, token: str, hooks: ReceiverHooks):
        self.config, self.hooks = config, hooks
        self.session = secrets.token_hex(8)
        self.stats = {
            "received": 0,
            "delivered": 0,
            "dropped": 0,
            "malformed": 0,
            "messages": 0,
            "rejected": 0,
            "handshake_failures": 0,
            "requests_sent": 0,
            "refused": 0,  # hellos refused: other protocol version, or peer table full
        }
        self._ctx = zmq.Context(io_threads=1)
        self._sock, self._auth = make_server_socket(self._ctx, curve_keys(token), self.stats)
        self._sock.rcvhwm = 1000
        self._sock.maxmsgsize = w.MAX_MESSAGE  # a longer frame drops its sender, unread
        try:
            self._sock.bind(config.bind.replace(":0", ":*") if config.bind.endswith(":0") else config.bind)
        except zmq.ZMQError as e:
            self._auth.stop()
            self._ctx.destroy(linger=0)
            raise TransportError(f"cannot listen for samples on {config.bind}: {e}") from None
        endpoint = self._sock.last_endpoint.decode()
        host, port = endpoint.rsplit("//", 1)[1].rsplit(":", 1)
        self.address = f"{socket.gethostname() if host in ('0.0.0.0', '*', '[::]') else host}:{port}"
        self._cond = threading.Condition(threading.Lock())  # not the default RLock: cheaper
        self._queue: deque[w.Sample] = deque()
        self._reading = True
        self._outbound: deque[tuple[str, list[w.Request]]] = deque()
        self._peers: dict[str, _Peer] = {}
        self._by_routing: dict[bytes, str] = {}
        self._closing = False
        self._waker = Waker()
        self._thread = threading.Thread(target=self._run, name="sample-receiver", daemon=True)
        self._thread.start()

    # ---- trainer side ----

    def get(self, timeout: float | None = None) -> w.Sample | None:
        with self._cond:
            if not self._cond.wait_for(lambda: self._queue, timeout):
                return None
            sample = self._queue.popleft()
            resume = not self._reading and len(self._queue) < self.config.queue
        if resume:
            self._waker.wake()
        return sample

    def qsize(self) -> int:
        with self._cond:
            return len(self._queue)

    def dispatch(self, generator: str, requests: Sequence[w.Request]) -> None:
        if requests:
            with self._cond:
                self._outbound.append((generator, list(requests)))
            self._waker.wake()

    def generators(self) -> list[str]:
        """Generators that said hello (in order of arrival)."""
        with self._cond:
            return [g for g, p in self._peers.items() if p.routing_id is not None]

    def close(self) -> None:
        with self._cond:
            self._closing = True
        self._waker.wake()
        self._thread.join(timeout=5)
        self._auth.stop()
        self._ctx.destroy(linger=0)
        self._waker.close()

    # ---- I/O thread ----

    def _run(self) -> None:
        sock = self._sock
        mon = sock.get_monitor_socket(_FAILED)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        for s in (mon, self._waker.fileno()):
            poller.register(s, zmq.POLLIN)
        try:
            while True:
                with self._cond:
                    if self._closing:
                        return
                    room = len(self._queue) < self.config.queue
                    self._reading = room
                poller.modify(sock, zmq.POLLIN if room else 0)
                ready = dict(poller.poll(1000))
                if self._waker.fileno() in ready:
                    self._waker.drain()
                    self._send_outbound(sock)
                if mon in ready:
                    while mon.poll(0):
                        recv_monitor_message(mon)
                        n = self.stats["handshake_failures"] = self.stats["handshake_failures"] + 1
                        if n % 100 == 1:  # a refused peer retries ~10 times a second: do not flood the log
                            log.warning(
                                "sample stream: %d failed CURVE handshake(s) (peers not of this run?)", n
                            )
                if sock in ready:
                    self._on_messages(sock)
        except zmq.ZMQError:
            if not self._closing:
                log.exception("sample receiver I/O thread failed")
        finally:
            sock.disable_monitor()
            mon.close(0)
            sock.close(0)

    def _on_messages(self, sock: zmq.Socket) -> None:
        for _ in range(64):  # then let the loop look at the queue bound and at outbound requests
            if not sock.poll(0):
                return
            rid, *frames = sock.recv_multipart()
            kind = b""
            try:
                if len(frames) != 1:
                    raise ValueError(f"{len(frames)} frames, not one (a peer of another protocol version?)")
                kind, body = w.split(frames[0])
                if kind == w.SAMPLES:
                    self._on_samples(sock, rid, *w.decode_batch(body))
                elif kind == w.HELLO:
                    self._on_hello(sock, rid, w.decode_hello(body))
                elif kind == w.REQUEST_ACK:
                    peer = self._peers.get(self._by_routing.get(rid, ""))
                    if peer is not None:
                        upto = w.decode_int(body)
                        for seq in [s for s in peer.unacked if s <= upto]:
                            del peer.unacked[seq]
                else:
                    self.stats["malformed"] += 1
            except (msgspec.DecodeError, msgspec.ValidationError, IndexError, ValueError) as e:
                n = self.stats["malformed"] = self.stats["malformed"] + 1
                if n % 100 == 1:  # a peer sending garbage must not flood the log too
                    log.warning("sample stream: malformed %r message (%d so far): %s", kind, n, e)
            with self._cond:
                if len(self._queue) >= self.config.queue:
                    return

    def _on_samples(self, sock: zmq.Socket, rid: bytes, seqs: list[int], items: list) -> None:
        self.stats["messages"] += 1
        admitted = []
        for data in items:
            self.stats["received"] += 1
            try:
                sample = w.decode_sample(data)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                self.stats["malformed"] += 1  # acked all the same: resending it would not help
                log.warning("sample stream: dropped a malformed sample: %s", e)
                continue
            if self._call_hook(self.hooks.admit, sample):
                admitted.append(sample)
            else:
                self.stats["dropped"] += 1
        if admitted:
            with self._cond:
                self._queue.extend(admitted)
                self._cond.notify_all()
            self.stats["delivered"] += len(admitted)
        self._send(sock, rid, w.message(w.ACK, seqs))

    def _refuse(self, sock: zmq.Socket, rid: bytes, reason: str) -> None:
        n = self.stats["refused"] = self.stats["refused"] + 1
        if n % 100 == 1:  # a flood must not flood the log too
            log.warning("sample stream: refused a hello (%d so far): %s", n, reason)
        self._send(sock, rid, w.message(w.REFUSED, reason))

    def _on_hello(self, sock: zmq.Socket, rid: bytes, hello: w.Hello) -> None:
        g = hello.generator
        if hello.protocol != w.PROTOCOL:
            self._refuse(
                sock,
                rid,
                f"the trainer speaks sample-stream protocol {w.PROTOCOL}, this generator "
                f"{hello.protocol}: run the same StreamRL version on every member",
            )
            return
        with self._cond:
            peer = self._peers.get(g)
            full = peer is None and len(self._peers) >= self.config.max_generators
        if full and not self._evict_idle():
            self._refuse(
                sock, rid, f"the trainer already knows {self.config.max_generators} generators (the limit)"
            )
            return
        with self._cond:
            if peer is not None and peer.routing_id is not None and peer.session != hello.session:
                # The same generator id from a new process: the old one's requests died with it.
                log.warning("sample stream: %s came back as a new process; re-dispatching what it owed", g)
                self._by_routing.pop(peer.routing_id, None)
                peer = self._peers[g] = _Peer(rid, hello.session)
                hook = self.hooks.generator_reset
            elif peer is None or peer.routing_id is None:
                peer = self._peers.setdefault(g, _Peer(None, hello.session))
                peer.routing_id, peer.session = rid, hello.session
                hook = self.hooks.generator_joined
            else:  # a reconnection of the same process: its unacknowledged requests go again
                self._by_routing.pop(peer.routing_id, None)
                peer.routing_id, hook = rid, None
            self._by_routing[rid] = g
        # The hooks learn of the generator before it is welcomed, so that a generator whose
        # wait_connected() returned is one the dispatcher already places work on (a request
        # submitted right after the welcome must not wait for the hook).
        assigned = (self._call_hook(hook, g) or {}) if hook is not None else {}
        self._send(sock, rid, w.message(w.WELCOME, w.Welcome(w.PROTOCOL, self.session)))
        self._send_requests(sock, peer, list(peer.unacked.items()))
        for gen, reqs in assigned.items():
            self._enqueue_requests(sock, gen, list(reqs))

    def _evict_idle(self) -> bool:
        """Make room in a full peer table: drop the oldest peer that owes nothing and that the
        hooks do not count as a working generator (a phantom that only said hello)."""
        working = getattr(self.hooks, "working", None)
        if working is None:
            return False
        with self._cond:
            for g, p in self._peers.items():
                if not p.unacked and not working(g):
                    del self._peers[g]
                    if p.routing_id is not None:
                        self._by_routing.pop(p.routing_id, None)
                    break
            else:
                return False
        forget = getattr(self.hooks, "forget_generator", None)
        if forget is not None:
            forget(g)
        return True

    def _send_outbound(self, sock: zmq.Socket) -> None:
        while True:
            with self._cond:
                if not self._outbound:
                    return
                g, reqs = self._outbound.popleft()
            self._enqueue_requests(sock, g, reqs)

    def _enqueue_requests(self, sock: zmq.Socket, generator: str, reqs: list[w.Request]) -> None:
        with self._cond:
            peer = self._peers.setdefault(generator, _Peer(None, ""))
        items = []
        for r in reqs:
            items.append((peer.next_seq, w.encode(r)))
            peer.unacked[peer.next_seq] = items[-1][1]
            peer.next_seq += 1
        self._send_requests(sock, peer, items)

    def _send_requests(self, sock: zmq.Socket, peer: _Peer, items: list[tuple[int, bytes]]) -> None:
        if peer.routing_id is None or not items:
            return  # sent when its hello arrives
        for i in range(0, len(items), self.config.max_batch):
            part = items[i : i + self.config.max_batch]
            body = w.batch([s for s, _ in part], [d for _, d in part])
            if self._send(sock, peer.routing_id, w.message(w.REQUESTS, body)):
                self.stats["requests_sent"] += len(part)

    def _send(self, sock: zmq.Socket, rid: bytes, frame: bytes) -> bool:
        try:
            sock.send_multipart([rid, frame], flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError as e:  # peer gone (EHOSTUNREACH) or its queue full: it resyncs on hello
            log.debug("sample stream: could not send to %r: %s", rid, e)
            return False

    def _call_hook(self, hook, arg):  # noqa: ANN001, ANN202 - hooks are the trainer's code
        try:
            return hook(arg)
        except Exception:
            log.exception("sample stream: hook %s failed", getattr(hook, "__name__", hook))
            return None
