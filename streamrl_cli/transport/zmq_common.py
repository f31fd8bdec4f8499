"""What both ZeroMQ ends share: CURVE keys derived from the run's token, and a thread waker.

Why CURVE: samples cross sites (generators in one datacenter, the trainer in another), so the
stream must be authenticated *and* private; CurveZMQ gives both per connection, and its cost
(encryption on ZeroMQ's own I/O thread, outside the GIL) is measured in bench/sample_stream.py.
Why derive the keys: every member of a run already holds the token (run_dir/secret, 0600), so
both key pairs are a pure function of it and nothing else has to be distributed. A peer without
the token cannot compute the server's public key (its CURVE hello does not decrypt) nor the
client's secret key (the ZAP handler refuses any other client key).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import socket
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.auth.thread

log = logging.getLogger("streamrl.transport")
ZAP_DOMAIN = "streamrl-samples"


@dataclass(frozen=True)
class CurveKeys:
    server_public: bytes  # z85
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def curve_keys(token: str, service: str = "samples") -> CurveKeys:
    """Both CURVE key pairs of a run's `service` (the sample stream, the environment servers),
    derived from its token (HMAC-SHA256 with fixed labels): one service's keys open no other's."""

    def secret(label: str) -> bytes:
        return zmq.utils.z85.encode(hmac.new(token.encode(), label.encode(), hashlib.sha256).digest())

    ss, cs = secret(f"streamrl/{service}/curve/server"), secret(f"streamrl/{service}/curve/client")
    return CurveKeys(zmq.curve_public(ss), ss, zmq.curve_public(cs), cs)


class _RunKeyOnly:
    """ZAP credentials provider: only the run's client key is let in; refusals are counted."""

    def __init__(self, client_public: bytes, stats: dict[str, int]):
        self._key, self._stats = client_public, stats

    def callback(self, domain: str, key: bytes) -> bool:
        ok = hmac.compare_digest(key, self._key)
        if not ok:
            self._stats["rejected"] += 1
            log.warning("sample stream: refused a CURVE client whose key is not the run's (wrong token?)")
        return ok


def make_server_socket(ctx: zmq.Context, keys: CurveKeys, stats: dict[str, int]) -> tuple[zmq.Socket, Any]:
    """A CURVE ROUTER socket and the ZAP authenticator thread that guards it."""
    auth = zmq.auth.thread.ThreadAuthenticator(ctx, log=logging.getLogger("streamrl.transport.zap"))
    auth.start()
    auth.configure_curve_callback(
        domain=ZAP_DOMAIN, credentials_provider=_RunKeyOnly(keys.client_public, stats)
    )
    sock = ctx.socket(zmq.ROUTER)
    sock.curve_server = True
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public
    sock.zap_domain = ZAP_DOMAIN.encode()
    sock.router_mandatory = True  # a send to a vanished peer raises instead of vanishing silently
    sock.linger = 0
    return sock, auth


def make_client_socket(ctx: zmq.Context, keys: CurveKeys) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.client_public
    sock.curve_secretkey = keys.client_secret
    sock.linger = 0
    sock.reconnect_ivl = 100  # ms; ZeroMQ reconnects by itself, we resend what was not acked
    sock.reconnect_ivl_max = 2000
    return sock


def tcp_endpoint(address: str) -> str:
    """Accept "host:port" (as published in the rendezvous) as well as a full ZeroMQ endpoint."""
    return address if "://" in address else f"tcp://{address}"


class Waker:
    """Wakes an I/O thread blocked in zmq.Poller from any other thread (a socketpair)."""

    def __init__(self) -> None:
        self._r, self._w = socket.socketpair()
        self._r.setblocking(False)
        self._w.setblocking(False)

    def fileno(self) -> int:
        return self._r.fileno()

    def wake(self) -> None:
        try:
            self._w.send(b"\0")
        except BlockingIOError:  # already a pile of wake-ups pending: one is enough
            pass

    def drain(self) -> None:
        try:
            while self._r.recv(4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        self._r.close()
        self._w.close()
