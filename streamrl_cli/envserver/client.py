"""The generators' side of the environment servers: find them, spread trajectories over them.

:class:`RemoteEnvHost` stands in for the generator's own :class:`~streamrl_cli.agent.env_host.EnvHost`
(same ``start``/``open``/``close``, sessions with ``reset``/``step``/``close``, ``failures``) when
``roles.env_server.instances`` > 0. It follows the ``env_server`` members of the rendezvous (a
long-poll of its events) and keeps one authenticated ZeroMQ connection per alive server. Each
trajectory is opened on the server with the fewest open sessions; its calls go there.

Failures, as a trajectory sees them:

* what the server's own host answers: ``env_error``, ``env_timeout``, ``env_died`` (a process of
  the server exited), exactly as beside the generator;
* a server that dies or becomes unreachable (its connection drops, ZeroMQ's heartbeats go
  unanswered for ``HEARTBEAT_TIMEOUT_S``, a call gets no answer within ``agent.step_timeout_s`` +
  ``SLACK_S``, or the rendezvous says it left or was lost): ``env_died`` for each trajectory on it;
  new trajectories go to the other servers, and a server that comes back (a new process
  registered, or its connection restored) is used again;
* no server reachable for ``no_server_s`` (``train.stall_after_s``): the generator fails, saying so.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec

from streamrl_cli import limits
from streamrl_cli.agent.env_host import AgentError, EnvFailure, EnvSettings
from streamrl_cli.agent.environment import Message, StepResult
from streamrl_cli.agent.trajectory import ENV_DIED, ENV_ERROR, ENV_TIMEOUT
from streamrl_cli.envserver.server import ADDRESS, ROLE, SERVICE, decode, encode
from streamrl_cli.errors import StreamRLError

log = logging.getLogger("streamrl.agent")

# Beyond agent.step_timeout_s, for an answer to come back: the network, and a server starting an
# environment process in place of one that died (a spawn and the environment's imports).
SLACK_S = 30.0
HEARTBEAT_S = 2.0  # ZeroMQ heartbeats on each connection ...
HEARTBEAT_TIMEOUT_S = 10.0  # ... and how long one may go unanswered before the connection is dropped
POLL_S = 10.0  # the longest wait on the rendezvous' events between two looks at the members
PING_S = (
    10.0  # how often a server hears from us (it closes a client's sessions after stall_after_s of silence)
)


class _Server:
    """One connection to one environment server process."""

    def __init__(self, member: dict[str, Any], sock: Any, monitor: Any):
        self.member_id: str = member["member_id"]
        self.address: str = member["addresses"][ADDRESS]
        self.incarnation = member.get("incarnation")
        self.sock, self.monitor = sock, monitor
        self.up = False  # the handshake succeeded: it holds the run's token, and takes trajectories
        self.dead = False
        self.pending: dict[int, asyncio.Future] = {}
        self.sessions: set[str] = set()
        self.tasks: list[asyncio.Task] = []
        # Who we are to the server, on this connection: our session ids start with it and our pings
        # carry it. A new connection is a new client: what the server still holds of a connection we
        # gave up on (its trajectories ended env_died here) is not pinged any more, and is swept.
        self.client = secrets.token_hex(6)

    @property
    def key(self) -> tuple[Any, str]:
        return self.incarnation, self.address


class RemoteEnvHost:
    """The environment servers of a run, as one host of sessions (see the module docstring)."""

    def __init__(
        self,
        settings: EnvSettings,
        *,
        run_dir: Path | str,
        tls_ca: str | None = None,
        no_server_s: float = 900.0,
        directory: Any = None,
    ):
        self.settings = settings
        self.run_dir, self.tls_ca = Path(run_dir), tls_ca
        self.no_server_s = no_server_s
        self.directory = directory  # the rendezvous client (members_doc, events); made at start if None
        self.servers: dict[str, _Server] = {}  # member id -> its connection
        self.failures: Counter[str] = Counter()  # stop reason -> count
        self.calls: Counter[str] = Counter()  # member id -> calls answered
        self.lost = 0  # connections lost (their trajectories ended env_died)
        self._changed = asyncio.Event()  # a server came up (or went): open() looks again
        self._ids = itertools.count(1)
        self._ctx: Any = None
        self._keys: Any = None
        self._discovery: asyncio.Task | None = None
        self._closing = False

    async def start(self) -> None:
        """Find the servers and wait until one serves (up to ``no_server_s``)."""
        import zmq.asyncio

        from streamrl_cli.rendezvous import read_secret
        from streamrl_cli.transport.zmq_common import curve_keys

        if self.directory is None:
            from streamrl_cli.rendezvous.client import RendezvousClient

            self.directory = RendezvousClient.from_run_dir(self.run_dir, tls_ca=self.tls_ca)
        self._keys = curve_keys(read_secret(self.run_dir), SERVICE)
        self._ctx = zmq.asyncio.Context()
        self._discovery = asyncio.create_task(self._discover(), name="env-servers")
        self._discovery.add_done_callback(lambda _: self._changed.set())  # open() sees it end
        await self._usable()

    # ---- discovery ----

    async def _discover(self) -> None:
        while True:
            try:
                doc = await asyncio.to_thread(self.directory.members_doc, ROLE)
                self._sync(doc["members"])
                await asyncio.to_thread(self.directory.events, doc["event_seq"], POLL_S, 1)
            except StreamRLError as e:  # the rendezvous is away: the servers we know serve on
                log.warning("environment servers: cannot read the rendezvous: %s", e)
                await asyncio.sleep(1.0)

    def _sync(self, members: list[dict[str, Any]]) -> None:
        alive = {
            m["member_id"]: m
            for m in members
            if m.get("state") == "alive" and (m.get("addresses") or {}).get(ADDRESS)
        }
        for mid, s in list(self.servers.items()):
            m = alive.get(mid)
            if m is None:
                self._lost(s, f"environment server {mid} left the run or was lost")
            elif (m.get("incarnation"), m["addresses"][ADDRESS]) != s.key:
                self._lost(s, f"environment server {mid} was replaced by a new process")
        for mid, m in alive.items():
            if mid not in self.servers:
                self.servers[mid] = self._connect(m)

    def _connect(self, member: dict[str, Any]) -> _Server:
        import zmq

        from streamrl_cli.transport.zmq_common import make_client_socket, tcp_endpoint

        sock = make_client_socket(self._ctx, self._keys)
        sock.maxmsgsize = limits.ENV_SERVER_FRAME  # as the server: a longer answer drops the connection
        sock.heartbeat_ivl = int(HEARTBEAT_S * 1000)
        sock.heartbeat_timeout = int(HEARTBEAT_TIMEOUT_S * 1000)
        events = (
            zmq.EVENT_HANDSHAKE_SUCCEEDED
            | zmq.EVENT_DISCONNECTED
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        )
        s = _Server(member, sock, sock.get_monitor_socket(events))
        sock.connect(tcp_endpoint(s.address))
        s.tasks = [
            asyncio.create_task(self._watch(s)),
            asyncio.create_task(self._read(s)),
            asyncio.create_task(self._ping(s)),
        ]
        log.info("environment servers: connecting to %s at %s", s.member_id, s.address)
        return s

    async def _watch(self, s: _Server) -> None:
        import zmq
        from zmq.utils.monitor import parse_monitor_message

        with contextlib.suppress(zmq.ZMQError, asyncio.CancelledError):
            while not s.dead:
                event = parse_monitor_message(await s.monitor.recv_multipart())["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    s.up = True
                    log.info("environment servers: %s at %s serves us", s.member_id, s.address)
                    self._changed.set()
                elif event == zmq.EVENT_DISCONNECTED and s.up:
                    self._lost(s, f"the connection to environment server {s.member_id} ({s.address}) dropped")
                elif event != zmq.EVENT_DISCONNECTED:
                    log.warning(
                        "environment servers: %s at %s refused our handshake: it does not hold this run's "
                        "token (another run's server on that port?)", s.member_id, s.address,
                    )  # fmt: skip

    async def _read(self, s: _Server) -> None:
        import zmq

        with contextlib.suppress(zmq.ZMQError, asyncio.CancelledError):
            while not s.dead:
                frames = await s.sock.recv_multipart()
                try:
                    cid, kind, out = decode(frames[-1])
                except (msgspec.DecodeError, ValueError, TypeError) as e:  # another version's server
                    log.warning("environment servers: undecodable answer from %s: %s", s.member_id, e)
                    continue
                fut = s.pending.pop(cid, None)
                if fut is not None and not fut.done():
                    fut.set_result((kind, out))

    async def _ping(self, s: _Server) -> None:
        """Say we are here, so that the server keeps our sessions (see server.EnvServer._sweep)."""
        import zmq

        with contextlib.suppress(zmq.ZMQError, asyncio.CancelledError):
            while not s.dead:
                await asyncio.sleep(PING_S)
                if s.up:
                    await s.sock.send_multipart([encode([0, "ping", s.client, None])])

    def _lost(self, s: _Server, detail: str) -> None:
        """`s` is gone: each of its trajectories ends env_died; new ones go elsewhere."""
        if s.dead:
            return
        s.dead, s.up = True, False
        if self.servers.get(s.member_id) is s:
            del self.servers[s.member_id]
        if not self._closing:
            self.lost += 1
            log.warning("environment servers: %s (%d trajectories on it end env_died)", detail,
                        len(s.sessions))  # fmt: skip
        for fut in s.pending.values():
            if not fut.done():
                fut.set_exception(EnvFailure(ENV_DIED, detail))
        s.pending.clear()
        current = asyncio.current_task()
        for t in s.tasks:
            if t is not current:
                t.cancel()
        with contextlib.suppress(Exception):
            s.sock.disable_monitor()
        s.monitor.close(linger=0)
        s.sock.close(linger=0)
        self._changed.set()

    # ---- sessions ----

    async def _usable(self) -> list[_Server]:
        deadline = time.monotonic() + self.no_server_s
        while not (usable := [s for s in self.servers.values() if s.up and not s.dead]):
            found = self._discovery
            if found is not None and found.done() and not found.cancelled() and found.exception():
                raise AgentError(f"finding the environment servers failed: {found.exception()!r}")
            left = deadline - time.monotonic()
            if left <= 0:
                known = ", ".join(f"{s.member_id} at {s.address}" for s in self.servers.values()) or "none"
                raise AgentError(
                    f"no environment server reachable for {self.no_server_s:.0f} s (train.stall_after_s; "
                    f"roles.env_server: alive in the rendezvous and connecting: {known}); see their logs "
                    "and `streamrl status`"
                )
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)
        return usable

    async def open(self) -> RemoteSession:
        """A session for one trajectory, on the server with the fewest open sessions."""
        s = min(await self._usable(), key=lambda x: len(x.sessions))
        sid = f"{s.client}-{next(self._ids)}"
        s.sessions.add(sid)
        return RemoteSession(self, s, sid)

    async def _call(self, s: _Server, op: str, sid: str, payload: Any) -> Any:
        if s.dead:
            raise EnvFailure(ENV_DIED, f"environment server {s.member_id} is gone")
        cid = next(self._ids)
        try:  # what the server would refuse fails this trajectory here, not the server's connection
            frame = encode([cid, op, sid, limits.check_depth(payload, f"the {op} payload")])
            if len(frame) > limits.ENV_SERVER_FRAME:
                raise limits.FrameError(f"{len(frame)} bytes, over the limit of {limits.ENV_SERVER_FRAME}")
        except (ValueError, TypeError) as e:  # limits.FrameError; msgspec's TypeError: not encodable
            raise EnvFailure(ENV_ERROR, f"cannot send {op} to the environment server: {e}") from None
        fut = asyncio.get_running_loop().create_future()
        s.pending[cid] = fut
        bound = self.settings.timeout_s + SLACK_S
        try:
            await s.sock.send_multipart([frame])
            kind, out = await asyncio.wait_for(asyncio.shield(fut), bound)
        except TimeoutError:
            s.pending.pop(cid, None)
            detail = f"environment server {s.member_id} did not answer {op} within {bound:g} s"
            self._lost(s, detail)
            raise EnvFailure(ENV_DIED, detail) from None
        except Exception as e:  # noqa: BLE001 - the socket closed under us: the server is gone
            if isinstance(e, EnvFailure):
                raise
            s.pending.pop(cid, None)
            raise EnvFailure(ENV_DIED, f"environment server {s.member_id}: {e}") from None
        self.calls[s.member_id] += 1
        if kind == "fail":
            reason, detail = out
            if reason not in (ENV_ERROR, ENV_TIMEOUT, ENV_DIED):
                reason = ENV_ERROR
            raise EnvFailure(reason, f"{detail} (on {s.member_id})")
        return out

    async def _release(self, s: _Server, sid: str) -> None:
        if sid not in s.sessions:
            return
        if not s.dead:
            with contextlib.suppress(EnvFailure):
                await self._call(s, "close", sid, None)
        s.sessions.discard(sid)

    def stats(self) -> dict[str, Any]:
        """For the generator's metrics: servers serving it, connections lost, calls answered and by how
        many servers (totals: a record has room for a few dozen keys, a run may have hundreds of servers)."""
        return {
            "agent/env_servers": sum(s.up and not s.dead for s in self.servers.values()),
            "agent/env_servers_lost": self.lost,
            "agent/env_calls": sum(self.calls.values()),
            "agent/env_servers_used": len(self.calls),
            **{f"agent/env_failures/{k}": v for k, v in sorted(self.failures.items())},
        }

    async def close(self) -> None:
        self._closing = True
        if self._discovery is not None:
            self._discovery.cancel()
            with contextlib.suppress(BaseException):
                await self._discovery
        for s in list(self.servers.values()):  # (every trajectory closed its session as it ended)
            self._lost(s, "closing")
        if self._ctx is not None:
            self._ctx.destroy(linger=0)  # closes any socket still open: term() would wait on it forever


class RemoteSession:
    """One trajectory's environment on a server: reset, steps, close (always called)."""

    def __init__(self, host: RemoteEnvHost, server: _Server, sid: str):
        self.host, self.server, self.sid = host, server, sid

    async def reset(self, row: dict[str, Any]) -> list[Message]:
        return list(await self._call("reset", row))

    async def step(self, turn: str) -> StepResult:
        return StepResult(**await self._call("step", turn))

    async def _call(self, op: str, payload: Any) -> Any:
        try:
            return await self.host._call(self.server, op, self.sid, payload)
        except EnvFailure as e:
            self.host.failures[e.reason] += 1
            raise

    async def close(self) -> None:
        await self.host._release(self.server, self.sid)
