"""The rendezvous HTTP server: the wire protocol around the state machine in ``state.py``.

This module owns what is about sockets and files: authentication, request validation
(every malformed request gets a 4xx JSON error naming what is wrong and what would be
valid), the long-poll of ``/v1/events``, the reaper that marks silent members lost, the
journal commit of every state change, ``metrics.jsonl`` and ``rendezvous.json``. The API
is documented in ``docs/rendezvous-api.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import signal
import socket
import ssl
import time
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from streamrl_cli.errors import RendezvousError
from streamrl_cli.rendezvous import protocol as p
from streamrl_cli.rendezvous import read_secret
from streamrl_cli.rendezvous.journal import Journal, read_metrics_tail
from streamrl_cli.rendezvous.protocol import ApiError, error_response, json_response
from streamrl_cli.rendezvous.state import Rejected, RendezvousState
from streamrl_cli.rundir import RunDir, write_atomic

log = logging.getLogger("streamrl.rendezvous")
# One per member per version: at INFO they would drown the membership changes.
QUIET_EVENTS = {"member_updated", "version_confirmed"}


class RendezvousServer:
    """One run's rendezvous service; `make_app` gives the aiohttp application."""

    def __init__(self, run_dir: Path, token: str, lease_s: float, url: str = ""):
        self.run_dir = Path(run_dir)
        self.lease_s = lease_s
        self.url = url
        self.started = time.time()
        self._token = token.encode()
        self._wakeup = asyncio.Event()
        self.stopping = False
        self.state = RendezvousState(lease_s)
        self.journal = Journal(RunDir(self.run_dir).rendezvous_state)
        self._member_key = _member_key(RunDir(self.run_dir).rendezvous_state)
        snap, events = self.journal.load()
        if snap is not None:
            self.state.load_snapshot(snap)
        self.state.replay(events)
        self.state.start_grace(time.monotonic())
        self.durable_seq = self.state.seq  # long-polls never hand out an event a crash could undo
        self._synced = 0  # events of `journal.written` known to be on disk
        self._syncing: asyncio.Future[None] | None = None
        for mid, latest in read_metrics_tail(RunDir(self.run_dir).metrics).items():
            if mid in self.state.members:
                self.state.metrics[mid] = latest
        self._metrics_fh = open(RunDir(self.run_dir).metrics, "ab", buffering=0)
        if self.state.seq:
            log.info(
                "replayed state up to event %d: %d member(s), current version %s",
                self.state.seq,
                len(self.state.members),
                self.state.current_version,
            )

    # ---- plumbing ----

    def make_app(self) -> web.Application:
        @web.middleware
        async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
            return await self._guard(request, handler)

        app = web.Application(middlewares=[middleware], client_max_size=p.MAX_BODY)
        routes = [
            ("GET", "/healthz", self.healthz),
            ("POST", "/v1/register", self.register),
            ("POST", "/v1/heartbeat", self.heartbeat),
            ("POST", "/v1/leave", self.leave),
            ("GET", "/v1/members", self.members),
            ("GET", "/v1/events", self.events),
            ("GET", "/v1/versions", self.versions),
            ("POST", "/v1/versions/propose", self.propose),
            ("POST", "/v1/versions/confirm", self.confirm),
            ("POST", "/v1/metrics", self.metrics),
            ("POST", "/v1/progress", self.progress),
            ("POST", "/v1/scale", self.scale),
            ("GET", "/v1/status", self.status),
        ]
        for method, path, handler in routes:
            app.router.add_route(method, path, handler)
        self.endpoints = [f"{method} {path}" for method, path, _ in routes]
        return app

    async def _guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Authenticate, then turn every failure into a JSON error; the server never goes down."""
        try:
            if request.path != "/healthz":
                self._authenticate(request)
            return await handler(request)
        except ApiError as e:
            return error_response(e.status, e.code, str(e), **e.extra)
        except Rejected as e:
            return error_response(p.REJECT_STATUS.get(e.code, 409), e.code, str(e), **e.details)
        except web.HTTPNotFound:
            return error_response(404, "not_found", f"no endpoint {request.path}", endpoints=self.endpoints)
        except web.HTTPMethodNotAllowed as e:
            return error_response(
                405,
                "method_not_allowed",
                f"{request.path} does not accept {request.method}; allowed: {sorted(e.allowed_methods)}",
                endpoints=self.endpoints,
            )
        except web.HTTPRequestEntityTooLarge:
            return error_response(413, "body_too_large", f"the body is larger than {p.MAX_BODY} bytes")
        except web.HTTPException as e:
            return error_response(e.status, "http_error", e.reason)
        except Exception:
            log.exception("internal error answering %s %s", request.method, request.path)
            return error_response(500, "internal", "internal server error; see the rendezvous server's log")

    def _authenticate(self, request: web.Request) -> None:
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        # Tokens are ASCII; a header with other bytes is a wrong token (401), not a server error.
        given = token.strip().encode("utf-8", "surrogateescape")
        if scheme.lower() == "bearer" and hmac.compare_digest(given, self._token):
            return
        why = "missing" if not token else "wrong"
        log.warning(
            "unauthorized %s %s from %s (%s token)", request.method, request.path, request.remote, why
        )
        raise ApiError(
            401,
            "unauthorized",
            f"{why} token: send 'Authorization: Bearer <token>' with the "
            "token from the run directory's 'secret' file",
        )

    async def _commit(self, events: list[dict[str, Any]]) -> None:
        """Make state changes durable, then wake the long-polls (a client never sees an unsaved event).

        Group commit: the fsync runs in a worker thread, and every change written while one
        is in flight shares the next. A registration storm of 512 members costs a few
        fsyncs instead of 512, and heartbeats keep being answered meanwhile.
        """
        if not events:
            return
        self.journal.write(events)
        target = self.journal.written
        while self._synced < target:
            if self._syncing is None:
                self._syncing = asyncio.ensure_future(self._fsync())
            await asyncio.shield(self._syncing)
        self.durable_seq = max(self.durable_seq, events[-1]["seq"])
        if self.journal.should_compact():
            self.journal.compact(self.state.to_snapshot())
        for ev in events:
            level = logging.DEBUG if ev["type"] in QUIET_EVENTS else logging.INFO
            log.log(level, "event %d %s %s", ev["seq"], ev["type"], _brief(ev["data"]))
        self._wakeup.set()
        self._wakeup = asyncio.Event()

    async def _fsync(self) -> None:
        try:
            upto = self.journal.written
            await asyncio.get_running_loop().run_in_executor(None, self.journal.fsync)
            self._synced = max(self._synced, upto)
        finally:
            self._syncing = None

    async def reaper(self) -> None:
        """Mark silent members lost; checking at lease/4 finds one within 1.25 leases.

        A tick that comes late by more than a tick means this process did not run meanwhile
        (stopped, swapped out, starved of CPU, its loop blocked): heartbeats then waited unread in
        its sockets, so that time is not counted as the members' silence."""
        tick = self.lease_s / 4
        due = time.monotonic() + tick
        while True:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            mono = time.monotonic()
            late, due = mono - due, mono + tick
            if late > tick:
                log.warning("rendezvous server stalled for %.1fs: not counted as its members' silence", late)
                self.state.excuse(late, mono=mono)
            try:
                await self._commit(self.state.reap(now=time.time(), mono=mono))
            except Exception:
                log.exception("reaper failed; retrying at the next tick")

    def shutdown(self) -> None:
        self.stopping = True
        self._wakeup.set()  # release long-polls so that the server stops promptly

    def close(self) -> None:
        self.journal.close()
        self._metrics_fh.close()

    # ---- members' credentials ----

    def credential(self, member_id: str, incarnation: int) -> str:
        """What /v1/register gives one incarnation of a member: its later calls carry it, so that
        holding the run's token is not enough to speak in another member's name."""
        msg = f"{member_id}\x00{incarnation}".encode()
        return hmac.new(self._member_key, msg, "sha256").hexdigest()

    def _bound(self, path: str, member_id: str, credential: str, incarnation: int | None = None) -> None:
        """Refuse a call in `member_id`'s name that does not carry its credential (403), or that
        carries an earlier incarnation's (409 stale_incarnation, as a heartbeat of it gets)."""
        m = self.state.members.get(member_id)
        if m is None:
            return  # the state answers unknown_member
        inc = m.incarnation if incarnation is None else incarnation
        given = credential.encode("utf-8", "surrogateescape")
        if hmac.compare_digest(given, self.credential(member_id, inc).encode()):
            return
        earlier = (self.credential(member_id, i).encode() for i in range(1, m.incarnation))
        if incarnation is None and any(hmac.compare_digest(given, c) for c in earlier):
            raise Rejected(
                "stale_incarnation",
                f"{member_id}: this process's incarnation was superseded by incarnation {m.incarnation} "
                "(another process registered the same role and rank)",
                current_incarnation=m.incarnation,
            )
        log.warning("%s in the name of %s without its credential", path, member_id)
        raise ApiError(
            403,
            "bad_credential",
            f"{'missing' if not credential else 'wrong'} credential for {member_id}: calls in a "
            "member's name carry the credential its registration returned (POST /v1/register)",
        )

    # ---- endpoints ----

    async def healthz(self, request: web.Request) -> web.Response:
        return json_response({"ok": True})

    async def register(self, request: web.Request) -> web.Response:
        b = await p.decode_body(request, p.RegisterBody)
        p.check_addresses(request.path, b.addresses)
        p.check_document(b.info, "info", request.path, reserved=set())
        m, events = self.state.register(**msgspec.structs.asdict(b), now=time.time(), mono=time.monotonic())
        await self._commit(events)
        peers = [
            self.state.peer_view(o)
            for o in self.state.members.values()
            if o.state == "alive" and o.member_id != m.member_id
        ]
        return json_response(
            {
                "member_id": m.member_id,
                "incarnation": m.incarnation,
                "credential": self.credential(m.member_id, m.incarnation),
                "lease_s": self.lease_s,
                "heartbeat_s": self.lease_s / 3,
                "weight_version": self.state.current_version,
                "peers": peers,
                "event_seq": self.durable_seq,
            }
        )

    async def heartbeat(self, request: web.Request) -> web.Response:
        b = await p.decode_body(request, p.HeartbeatBody)
        self._bound(request.path, b.member_id, b.credential, b.incarnation)
        events = self.state.heartbeat(
            b.member_id,
            incarnation=b.incarnation,
            weight_version=b.weight_version,
            reported_state=b.state,
            error=b.error,
            now=time.time(),
            mono=time.monotonic(),
        )
        await self._commit(events)
        return json_response(
            {
                "ok": True,
                "weight_version": self.state.current_version,
                "pending_versions": sorted(self.state.pending),
                "event_seq": self.durable_seq,
            }
        )

    async def leave(self, request: web.Request) -> web.Response:
        b = await p.decode_body(request, p.LeaveBody)
        self._bound(request.path, b.member_id, b.credential)
        await self._commit(self.state.leave(b.member_id, reason=b.reason, now=time.time()))
        return json_response({"ok": True})

    async def members(self, request: web.Request) -> web.Response:
        q = p.parse_query(request, {"role"})
        mono = time.monotonic()
        return json_response(
            {
                "members": [
                    self.state.member_view(m, mono)
                    for m in self.state.members.values()
                    if q.get("role") in (None, m.role)
                ],
                "event_seq": self.durable_seq,
                "lease_s": self.lease_s,
            }
        )

    async def events(self, request: web.Request) -> web.Response:
        q = p.parse_query(request, {"since", "timeout", "limit"})
        since = p.query_number(q, "since", int, 0, 0, None)
        timeout = min(p.query_number(q, "timeout", float, 0.0, 0.0, None), p.MAX_POLL_S)
        limit = p.query_number(q, "limit", int, 1000, 1, 10_000)
        events, resync = self.state.events_after(since, limit, upto=self.durable_seq)
        if not events and not resync and timeout > 0 and not self.stopping:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), timeout)
            events, resync = self.state.events_after(since, limit, upto=self.durable_seq)
        next_since = events[-1]["seq"] if events else self.durable_seq
        return json_response(
            {"events": events, "next_since": next_since, "resync": resync, "event_seq": self.durable_seq}
        )

    async def versions(self, request: web.Request) -> web.Response:
        p.parse_query(request, set())
        return json_response({**self.state.versions_view(), "event_seq": self.durable_seq})

    async def propose(self, request: web.Request) -> web.Response:
        b = await p.decode_body(request, p.ProposeBody)
        if b.transfer is not None:
            p.check_document(b.transfer, "transfer", request.path, reserved=set(), max_bytes=p.MAX_TRANSFER)
        events = self.state.propose(
            b.version, b.required_roles, members=b.members, transfer=b.transfer, now=time.time()
        )
        await self._commit(events)
        return json_response({**self.state.versions_view(), "event_seq": self.durable_seq})

    async def confirm(self, request: web.Request) -> web.Response:
        b = await p.decode_body(request, p.ConfirmBody)
        self._bound(request.path, b.member_id, b.credential)
        await self._commit(self.state.confirm(b.member_id, b.version, now=time.time(), mono=time.monotonic()))
        return json_response(
            {"ok": True, "current": self.state.current_version, "event_seq": self.durable_seq}
        )

    async def metrics(self, request: web.Request) -> web.Response:
        b = await p.decode_body(request, p.MetricsBody)
        self._bound(request.path, b.member_id, b.credential)
        p.check_document(b.record, "record", request.path, reserved=p.RESERVED_METRIC_KEYS)
        line, events = self.state.record_metrics(
            b.member_id, b.record, now=time.time(), mono=time.monotonic()
        )
        await self._commit(events)
        self._metrics_fh.write(msgspec.json.encode(line) + b"\n")  # one write(2): lines never interleave
        return json_response({"ok": True})

    async def progress(self, request: web.Request) -> web.Response:
        doc = await p.decode_body(request, dict[str, Any])
        p.check_progress(request.path, doc)
        await self._commit(self.state.set_progress(doc, now=time.time()))
        return json_response({"ok": True, "progress": self.state.progress})

    async def scale(self, request: web.Request) -> web.Response:
        b = await p.decode_body(request, p.ScaleBody)
        events = self.state.request_scale(
            b.role, b.instances, source=b.source, reason=b.reason, now=time.time()
        )
        await self._commit(events)
        return json_response({"ok": True, "seq": events[-1]["seq"], "event_seq": self.durable_seq})

    async def status(self, request: web.Request) -> web.Response:
        p.parse_query(request, set())
        mono, now = time.monotonic(), time.time()
        members = [self.state.member_view(m, mono) for m in self.state.members.values()]
        counts: dict[str, dict[str, int]] = {}
        for m in members:
            c = counts.setdefault(m["role"], {"alive": 0, "lost": 0, "left": 0})
            c[m["state"]] += 1
        return json_response(
            {
                "server": {
                    "url": self.url,
                    "pid": os.getpid(),
                    "started": self.started,
                    "uptime_s": round(now - self.started, 3),
                    "lease_s": self.lease_s,
                },
                "event_seq": self.durable_seq,
                "counts": counts,
                "members": members,
                "versions": self.state.versions_view(),
                "progress": self.state.progress,
                "metrics": self.state.metrics,
                "scale": self.state.scale,
            }
        )


def _brief(data: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in data.items() if k not in ("info", "addresses"))


def _bind(host: str, port: int) -> socket.socket:
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    return socket.create_server((host, port), family=family, backlog=1024)


def _advertised_url(host: str, port: int, tls: bool) -> str:
    # A wildcard bind is reachable under the machine's name, not under 0.0.0.0.
    name = socket.gethostname() if host in ("", "0.0.0.0", "::") else host
    name = f"[{name}]" if ":" in name else name
    return f"{'https' if tls else 'http'}://{name}:{port}"


async def run(
    run_dir: Path,
    *,
    host: str,
    port: int,
    lease_s: float,
    ssl_context: ssl.SSLContext | None,
    token: str,
    stop: asyncio.Event | None = None,
) -> None:
    """Serve until `stop` is set, or SIGTERM/SIGINT arrives when `stop` is not given."""
    run_dir = Path(run_dir)
    try:
        sock = _bind(host, port)
    except OSError as e:
        raise RendezvousError(f"cannot listen on {host}:{port}: {e}") from None
    port = sock.getsockname()[1]
    url = _advertised_url(host, port, ssl_context is not None)
    try:
        server = RendezvousServer(run_dir, token, lease_s, url)
    except OSError as e:
        sock.close()
        raise RendezvousError(f"cannot open the rendezvous state in {run_dir}: {e}") from None
    runner = web.AppRunner(server.make_app(), access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    await web.SockSite(runner, sock, ssl_context=ssl_context, backlog=1024).start()
    endpoint = {
        "url": url,
        "pid": os.getpid(),
        "host": host,
        "port": port,
        "started": server.started,
        "tls": ssl_context is not None,
    }
    write_atomic(RunDir(run_dir).endpoint, json.dumps(endpoint).encode(), durable=True)
    if stop is None:
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    reaper = asyncio.create_task(server.reaper())
    log.info("rendezvous server for %s listening on %s (lease %.3gs)", run_dir, url, lease_s)
    try:
        await stop.wait()
    finally:
        log.info("rendezvous server shutting down")
        reaper.cancel()
        server.shutdown()
        await runner.cleanup()
        server.close()
        write_atomic(
            RunDir(run_dir).endpoint, json.dumps({**endpoint, "stopped": time.time()}).encode(), durable=True
        )


def serve(
    run_dir: Path,
    host: str = "127.0.0.1",
    port: int = 0,
    lease_s: float = 10.0,
    tls_cert: Path | None = None,
    tls_key: Path | None = None,
) -> None:
    """Run the rendezvous server for `run_dir` until SIGTERM/SIGINT (blocking)."""
    if not lease_s > 0:
        raise RendezvousError(f"lease_s must be > 0 seconds, got {lease_s}")
    if (tls_cert is None) != (tls_key is None):
        raise RendezvousError("give both tls_cert and tls_key (or neither)")
    if not 0 <= port < 65536:
        raise RendezvousError(f"port must be in 0..65535 (0 = any free port), got {port}")
    token = read_secret(run_dir)
    ctx = None
    if tls_cert is not None:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            ctx.load_cert_chain(tls_cert, tls_key)
        except (OSError, ssl.SSLError) as e:
            raise RendezvousError(f"cannot load TLS certificate {tls_cert} / key {tls_key}: {e}") from None
    try:
        import uvloop  # optional: a faster event loop when installed

        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(run(Path(run_dir), host=host, port=port, lease_s=lease_s, ssl_context=ctx, token=token))


def _member_key(state_dir: Path) -> bytes:
    """The server's own key for members' credentials (`rendezvous/member-key`, 0600), made once per
    run (written whole or not at all): a server restarted from its journal gives the same
    credentials again."""
    path = Path(state_dir) / "member-key"
    try:
        key = path.read_bytes()
    except FileNotFoundError:
        key = b""
    if len(key) != 32:
        if key:
            log.warning("%s is damaged (%d bytes): a new key; members must register again", path, len(key))
        key = os.urandom(32)
        write_atomic(path, key, mode=0o600, durable=True)
    return key
