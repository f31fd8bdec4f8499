"""An environment server: a run's environments in processes of their own, served to its generators.

A heavy environment (a simulator, a sandbox, a browser) beside each generator takes the CPUs and
memory its engine needs. With ``roles.env_server.instances`` > 0 the environments run here instead:
each server hosts ``roles.env_server.workers`` environment processes (:class:`~.env_host.EnvHost`,
with its semantics unchanged: a call that raises answers ``env_error``, one past
``agent.step_timeout_s`` answers ``env_timeout`` and retires its process, a process that exits
answers ``env_died`` for each of its trajectories and is replaced) and serves them to every
generator of the run over one ZeroMQ socket::

    generator (env_remote.RemoteEnvHost) ── DEALER ──► ROUTER (this server) ──► EnvHost ──► env processes
                       ◄──── answer (ok / the failure's stop reason) ─────┘

The socket is CURVE-encrypted and admits only clients holding the run's token (the keys are
derived from it, as the sample stream's are: ``transport.zmq_common``). Even a token holder's frame
is bounded (:mod:`streamrl_cli.limits`): a frame over ``ENV_SERVER_FRAME`` bytes drops its
connection unread, and one nested deeper than ``MAX_DEPTH`` levels, or not a request at all, is
answered ``[call id or 0, "fail", ["env_error", why]]`` and counted as malformed; the server goes on
serving. The server registers as
member ``env_server-<rank>`` with its address (``addresses.env``) (:mod:`.role`); generators
find it there (:mod:`.client`).

Wire format (msgpack): a request is ``[call id, op, session id, payload]`` with op ``reset`` (the
task's row: a session starts), ``step`` (the model's turn) or ``close``; the answer is
``[call id, "ok", result]`` or ``[call id, "fail", [stop reason, detail]]``. A session id is
``<client>-<n>``; a client also sends ``[0, "ping", client, null]`` now and then (no answer). The
sessions of a client silent for ``client_silent_s`` (``train.stall_after_s``: a generator that
died or was restarted) are closed: their environments would otherwise stay until the run ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import Counter
from typing import Any

import msgspec

from streamrl_cli import limits
from streamrl_cli.agent.env_host import AgentError, EnvFailure, EnvHost, EnvSettings, Session
from streamrl_cli.agent.trajectory import ENV_DIED, ENV_ERROR
from streamrl_cli.roles.spec import EnvServerSpec

log = logging.getLogger("streamrl.env_server")

SERVICE = "env"  # the CURVE keys' label (transport.zmq_common.curve_keys)
ROLE = "env_server"  # its rendezvous role: member ids are "env_server-<rank>"
ADDRESS = "env"  # the key of its address in its rendezvous record
OPS = ("reset", "step", "close", "ping")
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder()


def encode(msg: Any) -> bytes:
    return _enc.encode(msg)


def decode(data: bytes, what: str = "a frame") -> Any:
    """A frame of this wire within its limits (``limits.FrameError`` past them)."""
    return limits.decode(_dec.decode, data, what, max_bytes=limits.ENV_SERVER_FRAME)


def settings_of(spec: EnvServerSpec) -> EnvSettings:
    """The environment each of its processes makes, as a generator would make it itself."""
    a = spec.agent
    workers = spec.settings.workers or a.env_workers
    return EnvSettings(
        env=a.env, env_args=dict(a.env_args), tools=list(a.tools), workers=workers, timeout_s=a.step_timeout_s
    )


class EnvServer:
    """An :class:`EnvHost` served on an authenticated ZeroMQ socket (see the module docstring)."""

    def __init__(
        self, settings: EnvSettings, token: str, *, bind_host: str = "0.0.0.0", client_silent_s: float = 900.0
    ):
        self.host = EnvHost(settings)
        self.client_silent_s = client_silent_s
        self.heard: dict[str, float] = {}  # client -> when it last said anything (monotonic)
        self.swept = 0  # sessions closed because their client went silent
        self.token, self.bind_host = token, bind_host
        self.sessions: dict[str, Session] = {}  # session id (the client's) -> its environment
        self.calls: Counter[str] = Counter()  # op -> calls answered
        self.stats = {"rejected": 0, "malformed": 0}  # rejected: clients refused by the ZAP handler
        self.port = 0
        self._ctx: Any = None
        self._sync: Any = None
        self._sock: Any = None
        self._auth: Any = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> int:
        """Start the environment processes (the environment's error raised here), then listen."""
        import zmq
        import zmq.asyncio

        from streamrl_cli.transport.zmq_common import curve_keys, make_server_socket

        await self.host.start()
        # The ZAP authenticator runs on a thread with blocking sockets: a plain context; our own
        # end of the socket is the asyncio view of the same socket.
        self._ctx = zmq.Context()
        self._sync, self._auth = make_server_socket(self._ctx, curve_keys(self.token, SERVICE), self.stats)
        self._sync.maxmsgsize = limits.ENV_SERVER_FRAME  # a longer frame drops its sender, unread
        self.port = self._sync.bind_to_random_port(f"tcp://{self.bind_host}")
        self._sock = zmq.asyncio.Socket.from_socket(self._sync)
        return self.port

    async def serve(self) -> None:
        """Answer requests until cancelled; each call runs as its own task (a slow step holds up no other)."""
        sweeper = asyncio.create_task(self._sweep())
        try:
            await self._receive()
        finally:
            sweeper.cancel()

    async def _receive(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            if len(frames) != 2:
                self.stats["malformed"] += 1
                continue
            peer, body = frames
            request: Any = None
            try:
                request = limits.decode(_dec.decode, body, "a request", max_bytes=limits.ENV_SERVER_FRAME,
                                        max_depth=None)  # fmt: skip
                if not isinstance(request, list) or len(request) != 4:
                    raise ValueError("not [call id, op, session id, payload]")
                cid, op, sid, payload = request
                if op not in OPS or type(cid) is not int or not isinstance(sid, str):
                    raise ValueError(f"op {op!r}, call id {cid!r}, session id {sid!r}")
                limits.check_depth(payload, f"the {op} payload")
            except (msgspec.DecodeError, ValueError, TypeError) as e:  # limits.FrameError is a ValueError
                self._malformed(peer, request, e)
                continue
            client = sid if op == "ping" else sid.rpartition("-")[0]
            self.heard[client] = time.monotonic()
            if op == "ping":
                continue
            task = asyncio.create_task(self._answer(peer, cid, op, sid, payload))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _malformed(self, peer: bytes, request: Any, error: Exception) -> None:
        """Count and answer a frame that is no request: the call it names (if it names one) fails at
        once rather than at its client's timeout; call id 0 (a ping's: no client waits on it) if not."""
        n = self.stats["malformed"] = self.stats["malformed"] + 1
        if n % 100 == 1:  # a peer sending garbage must not flood the log
            log.warning("env server: dropped a malformed request (%d so far): %s", n, error)
        cid = request[0] if isinstance(request, list) and request and type(request[0]) is int else 0
        reply = [cid, "fail", [ENV_ERROR, f"malformed request: {error}"[:500]]]
        task = asyncio.create_task(self._send(peer, reply))  # a peer that reads nothing holds up no one
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, peer: bytes, reply: list) -> None:
        with contextlib.suppress(Exception):  # the client is gone: its trajectory ended with it
            await self._sock.send_multipart([peer, encode(reply)])

    async def _answer(self, peer: bytes, cid: int, op: str, sid: str, payload: Any) -> None:
        try:
            out = await self._call(op, sid, payload)
            reply = [cid, "ok", dataclasses.asdict(out) if dataclasses.is_dataclass(out) else out]
        except EnvFailure as e:
            reply = [cid, "fail", [e.reason, e.detail]]
        except Exception as e:  # noqa: BLE001 - a payload the host could not take: this call fails, not the server
            log.warning("env server: %s of session %s failed: %r", op, sid, e)
            reply = [cid, "fail", [ENV_ERROR, f"{op} failed on the environment server: {e!r}"[:500]]]
        self.calls[op] += 1
        await self._send(peer, reply)

    async def _call(self, op: str, sid: str, payload: Any) -> Any:
        if op == "reset":
            if sid in self.sessions:
                raise EnvFailure(ENV_ERROR, f"session {sid} was reset already")
            try:
                session = await self.host.open()
            except AgentError as e:  # a replacement process could not make the environment
                raise EnvFailure(ENV_DIED, str(e)) from None
            self.sessions[sid] = session
            return await session.reset(payload)
        if op == "close":
            session = self.sessions.pop(sid, None)
            if session is not None:
                await session.close()
            return None
        session = self.sessions.get(sid)
        if session is None:
            raise EnvFailure(ENV_DIED, f"this environment server has no session {sid} (it restarted?)")
        return await session.step(payload)

    async def _sweep(self) -> None:
        """Close the sessions of clients silent for client_silent_s (see the module docstring)."""
        while True:
            await asyncio.sleep(min(30.0, self.client_silent_s / 4))
            now = time.monotonic()
            gone = {c for c, t in self.heard.items() if now - t > self.client_silent_s}
            for sid in [sid for sid in self.sessions if sid.rpartition("-")[0] in gone]:
                session = self.sessions.pop(sid)
                self.swept += 1
                with contextlib.suppress(EnvFailure):
                    await session.close()
            for c in gone:
                del self.heard[c]
            if gone:
                log.info("env server: %d client(s) silent for %.0f s: their sessions closed", len(gone),
                         self.client_silent_s)  # fmt: skip

    def metrics(self) -> dict[str, Any]:
        return {
            "env_server/sessions": len(self.sessions),
            "env_server/processes": sum(not w.dead for w in self.host.workers),
            "env_server/restarts": self.host.restarts,
            "env_server/rejected": self.stats["rejected"],
            "env_server/malformed": self.stats["malformed"],
            "env_server/swept": self.swept,
            **{f"env_server/calls/{op}": n for op, n in sorted(self.calls.items())},
            **{f"env_server/failures/{k}": n for k, n in sorted(self.host.failures.items())},
        }

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._sync is not None:
            self._sync.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)  # closes any socket still open: term() would wait on it forever
        await self.host.close()
