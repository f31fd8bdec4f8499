"""The generator's end of the sample stream over ZeroMQ (one DEALER socket, CURVE).

Why this shape: the engine's thread must not wait on the network, and a sample must survive a
broken connection. So :meth:`ZmqSampleSender.send` only encodes the sample and files it under
a sequence number (the caller's cost, ~5 µs for 1K tokens); one I/O thread owns the socket,
coalesces samples into messages (up to ``max_batch``, waiting at most ``max_delay_s``), reads
acknowledgements and requests, and after every reconnection says hello again and resends every
sample not yet acknowledged. The window of unacknowledged samples is the back-pressure: when the
trainer stops acknowledging, ``send`` blocks, then raises :class:`BackpressureTimeout`.

What streaming adds to generation is what holds the GIL per sample, on the engine's thread and on
the I/O thread (CURVE and TCP run on ZeroMQ's own thread, outside it; bench/sample_stream.py). On
these machines that is dominated by memory traffic and system calls, not by encoding, so: a sample
is encoded while its data is hot, on the engine's core; a message is encoded once into a frame that
ZeroMQ sends without a copy; and while anything is queued or unacknowledged the I/O thread wakes once
per ``max_delay_s`` and reads the socket then, not on every acknowledgement (acks and requests wait
that long at most), unless a caller waits for room or a flush; with nothing in flight it reads at
once. Where the OS runs the I/O thread matters too: on the engine's core (they share the GIL, so
they never run at once anyway) it reads each sample from that core's cache; on another core it pays
twice as much here (the benchmark's ``--placement split``).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque

import zmq
from zmq.utils.monitor import recv_monitor_message

from streamrl_cli.transport import BackpressureTimeout, TransportError
from streamrl_cli.transport import wire as w
from streamrl_cli.transport.samples import SampleSender, StreamConfig
from streamrl_cli.transport.zmq_common import Waker, curve_keys, make_client_socket, tcp_endpoint

log = logging.getLogger("streamrl.transport.sender")

_MONITOR_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_DISCONNECTED
)


class ZmqSampleSender(SampleSender):
    def __init__(self, config: StreamConfig, *, address: str, token: str, generator: str):
        self.config, self.generator, self.endpoint = config, generator, tcp_endpoint(address)
        self.session = secrets.token_hex(8)
        self._keys = curve_keys(token)
        lock = threading.Lock()  # not the default RLock: cheaper
        self._cond = threading.Condition(lock)  # acks, refusals, closing: what send() and flush() wait for
        # What requests() waits for (requests, closing), apart: a generator's request loop waits all the
        # time, and waking it for every acknowledgement took the engine's GIL for nothing.
        self._arrived = threading.Condition(lock)
        self._next_seq = 1
        self._unacked: dict[int, bytes] = {}  # seq -> encoded sample; insertion order = resend order
        self._outbox: deque[int] = deque()  # seqs not yet handed to ZeroMQ
        self._next_flush = 0.0  # monotonic time of the next timed flush (I/O thread only)
        self._scratch = bytearray(64 * 1024)  # send()'s encoding buffer (under the lock)
        self._requests: deque[w.Request] = deque()
        self._req_expected = 1  # next request seq from the current trainer session
        self._trainer_session = ""
        self._welcomed = threading.Event()
        self._refused = ""  # the trainer refused our credentials: fatal, reported by send()/wait_connected()
        self._closing = False
        self._waiters = 0  # callers blocked on acks (window full, flush): the socket is read at once then
        self._failures = 0  # handshake failures in a row
        self.stats = {"sent": 0, "resent": 0, "acked": 0, "messages": 0, "handshakes": 0, "requests": 0}
        self._waker = Waker()
        self._ctx = zmq.Context(io_threads=1)
        self._thread = threading.Thread(target=self._run, name=f"sample-sender-{generator}", daemon=True)
        self._thread.start()

    # ---- caller side ----

    def send(self, sample: w.Sample, timeout: float | None = None) -> None:
        if not sample.generator:
            sample.generator = self.generator
        timeout = self.config.send_timeout_s if timeout is None else timeout
        with self._cond:
            if len(self._unacked) >= self.config.window:
                ok = self._wait_for_acks(
                    lambda: len(self._unacked) < self.config.window or self._refused or self._closing, timeout
                )
                if not ok:
                    raise BackpressureTimeout(
                        f"{self.generator}: {len(self._unacked)} samples unacknowledged by the trainer at "
                        f"{self.endpoint} for {timeout:.3g}s (window {self.config.window})"
                    )
            self._check_usable()
            w.encode_into(sample, self._scratch)
            seq, self._next_seq = self._next_seq, self._next_seq + 1
            self._unacked[seq] = bytes(self._scratch)
            self._outbox.append(seq)
            n, idle = len(self._outbox), len(self._unacked) == 1
        # No system call per sample: while streaming the I/O thread ticks every max_delay_s on its
        # own; it is woken only out of idleness, for a full batch, or at once when batching is off.
        if idle or n >= self.config.max_batch or self.config.max_delay_s == 0:
            self._waker.wake()

    def requests(self, timeout: float | None = 0.0) -> list[w.Request]:
        with self._cond:
            if not self._requests and timeout != 0:
                self._arrived.wait_for(lambda: self._requests or self._closing, timeout)
            out = list(self._requests)
            self._requests.clear()
            return out

    def wait_connected(self, timeout: float) -> None:
        """Block until the trainer answered our hello; raise TransportError if refused or silent."""
        deadline = time.monotonic() + timeout
        while not self._welcomed.wait(0.05):
            with self._cond:
                self._check_usable()
            if time.monotonic() > deadline:
                raise TransportError(
                    f"{self.generator}: no answer from the trainer at {self.endpoint} in {timeout}s"
                )

    def room(self) -> int:
        with self._cond:
            return self.config.window - len(self._unacked)

    def pending(self) -> int:
        """Samples sent but not yet acknowledged (owned by this generator)."""
        with self._cond:
            return len(self._unacked)

    def flush(self, timeout: float) -> bool:
        """Wait until every sample is acknowledged; False after `timeout`."""
        with self._cond:
            return self._wait_for_acks(lambda: not self._unacked, timeout)

    def _wait_for_acks(self, predicate, timeout: float | None) -> bool:  # noqa: ANN001 - a condition
        """Wait (holding the lock) for `predicate`, with the I/O thread reading acks at once meanwhile."""
        if predicate():
            return True
        self._waiters += 1
        self._waker.wake()
        try:
            return self._cond.wait_for(predicate, timeout)
        finally:
            self._waiters -= 1

    def close(self, flush_timeout: float = 5.0) -> None:
        if self._thread.is_alive():
            if flush_timeout > 0 and not self._refused:
                self.flush(flush_timeout)
            with self._cond:
                self._closing = True
                self._cond.notify_all()
                self._arrived.notify_all()
            self._waker.wake()
            self._thread.join(timeout=5)
        self._ctx.destroy(linger=0)
        self._waker.close()

    def _check_usable(self) -> None:
        if self._refused:
            raise TransportError(f"{self.generator}: {self._refused}")
        if self._closing:
            raise TransportError(f"{self.generator}: sender is closed")

    # ---- I/O thread ----

    def _run(self) -> None:
        sock = make_client_socket(self._ctx, self._keys)
        sock.sndhwm = sock.rcvhwm = self.config.window + 64
        sock.maxmsgsize = w.MAX_MESSAGE
        mon = sock.get_monitor_socket(_MONITOR_EVENTS)
        sock.connect(self.endpoint)
        poller = zmq.Poller()
        for s in (sock, mon, self._waker.fileno()):
            poller.register(s, zmq.POLLIN)
        reading = True
        try:
            while True:
                with self._cond:
                    if self._closing:
                        return
                    wait_ms = self._flush_due_ms()
                    ticking = wait_ms is not None and self._waiters == 0 and self.config.max_delay_s > 0
                if reading == ticking:  # while ticking the socket is read at the ticks only
                    reading = not ticking
                    poller.modify(sock, zmq.POLLIN if reading else 0)
                ready = dict(poller.poll(wait_ms))
                if self._waker.fileno() in ready:
                    self._waker.drain()
                if mon in ready:
                    self._on_monitor(sock, mon)
                    if self._refused:  # stop knocking: the answer will not change
                        sock.disconnect(self.endpoint)
                        poller.unregister(mon)
                if sock in ready or not reading:
                    self._on_messages(sock)
                self._send_outbox(sock)
        except zmq.ZMQError as e:
            if not self._closing:
                log.exception("sample sender I/O thread failed")
                with self._cond:
                    self._refused = f"I/O thread failed: {e}"
                    self._cond.notify_all()
        finally:
            sock.disable_monitor()
            mon.close(0)
            sock.close(0)

    def _flush_due_ms(self) -> int | None:
        """How long the I/O thread may sleep: until the next tick while samples are in flight."""
        if len(self._outbox) >= self.config.max_batch:
            return 0
        if self.config.max_delay_s == 0:
            return None if not self._outbox else 0  # every send() wakes us
        if not self._unacked:  # idle: the next send() wakes us
            return None
        return max(0, int((self._next_flush - time.monotonic()) * 1000 + 0.999))  # the next tick

    def _send_outbox(self, sock: zmq.Socket) -> None:
        """Send full batches now, and everything waiting once per max_delay_s (a tick)."""
        now = time.monotonic()
        tick = now >= self._next_flush - 0.001  # poll() may wake a little early: no second wake for it
        if tick:
            self._next_flush = now + self.config.max_delay_s
        due = len(self._outbox) if tick else 0  # what a tick sends: only what was queued when it came
        while True:
            with self._cond:
                if not self._outbox or not (due > 0 or len(self._outbox) >= self.config.max_batch):
                    return
                # (Each send gives up the GIL, and a busy engine queues more meanwhile: chasing that
                # with small messages would send a message per GIL handoff.)
                take = min(len(self._outbox), self.config.max_batch)
                due -= take
                seqs = [self._outbox.popleft() for _ in range(take)]
                datas = [self._unacked[s] for s in seqs if s in self._unacked]
                seqs = [s for s in seqs if s in self._unacked]
            self._send_batch(sock, seqs, datas)
            self.stats["sent"] += len(seqs)

    def _send_batch(self, sock: zmq.Socket, seqs: list[int], datas: list[bytes]) -> None:
        if seqs:
            # Blocking is fine here: the window keeps the queue well under the high-water mark.
            # Without a copy: ZeroMQ's thread reads the frame where the encoder wrote it (pyzmq lets
            # go of it afterwards; its garbage collector thread is counted in the benchmark).
            sock.send(w.message(w.SAMPLES, w.batch(seqs, datas)), copy=False)
            self.stats["messages"] += 1

    def _on_monitor(self, sock: zmq.Socket, mon: zmq.Socket) -> None:
        while mon.poll(0):
            ev = recv_monitor_message(mon)["event"]
            if ev == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._failures = 0
                self.stats["handshakes"] += 1
                sock.send(w.message(w.HELLO, w.Hello(w.PROTOCOL, self.generator, self.session)))
                if self.stats["handshakes"] > 1:
                    self._resend_unacked(sock)
            elif ev == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                with self._cond:
                    self._refused = (
                        f"the trainer at {self.endpoint} refused our credentials (wrong run token?)"
                    )
                    self._cond.notify_all()
            elif ev in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
                # With another run's token our CURVE hello cannot be decrypted: the server drops us
                # and ZeroMQ retries for ever. Three failures in a row with no success is not a blip.
                self._failures += 1
                if self._failures >= 3:
                    with self._cond:
                        self._refused = (
                            f"CURVE handshake with {self.endpoint} failed {self._failures} times "
                            "(wrong run token, or not this run's trainer)"
                        )
                        self._cond.notify_all()
            elif ev == zmq.EVENT_DISCONNECTED:
                self._welcomed.clear()

    def _resend_unacked(self, sock: zmq.Socket) -> None:
        # Anything in flight on the dead connection may be lost: send again every sample not acked
        # (duplicates are dropped by the trainer). Outbox entries go out with the next batch anyway.
        with self._cond:
            queued = set(self._outbox)
            items = [(s, d) for s, d in self._unacked.items() if s not in queued]
        for i in range(0, len(items), self.config.max_batch):
            part = items[i : i + self.config.max_batch]
            self._send_batch(sock, [s for s, _ in part], [d for _, d in part])
        self.stats["resent"] += len(items)

    def _on_messages(self, sock: zmq.Socket) -> None:
        # Readiness from ZMQ_EVENTS, which keeps the GIL (poll(0) gives it up; a NOBLOCK recv raises
        # zmq.Again at the end, which costs more than a message).
        while sock.get(zmq.EVENTS) & zmq.POLLIN:
            kind, body = w.split(sock.recv())
            if kind == w.ACK:
                seqs = w.decode_seqs(body)
                with self._cond:
                    for s in seqs:
                        if self._unacked.pop(s, None) is not None:
                            self.stats["acked"] += 1
                    self._cond.notify_all()
            elif kind == w.REQUESTS:
                self._on_requests(sock, *w.decode_batch(body))
            elif kind == w.WELCOME:
                welcome = w.decode_welcome(body)
                with self._cond:
                    if welcome.session != self._trainer_session:  # a new trainer process: its seqs restart
                        self._trainer_session, self._req_expected = welcome.session, 1
                self._welcomed.set()
            elif kind == w.REFUSED:
                reason = w.decode_str(body)
                log.error("%s: the trainer refused this generator: %s", self.generator, reason)
                with self._cond:
                    self._refused = f"the trainer refused this generator: {reason}"
                    self._cond.notify_all()
                    self._arrived.notify_all()
            else:
                log.warning("%s: ignoring a message of unknown kind %r", self.generator, kind)

    def _on_requests(self, sock: zmq.Socket, seqs: list[int], items: list) -> None:
        # Requests are resent in order after a reconnection: accept exactly the next seq, drop the rest.
        with self._cond:
            for seq, data in zip(seqs, items, strict=True):
                if seq == self._req_expected:
                    self._requests.append(w.decode_request(data))
                    self._req_expected += 1
                    self.stats["requests"] += 1
            upto = self._req_expected - 1
            self._arrived.notify_all()
        sock.send(w.message(w.REQUEST_ACK, upto))
