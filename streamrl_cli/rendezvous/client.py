"""Client library of the rendezvous server, for every role of a run and for ``streamrl status``.

Synchronous (httpx) and thread-safe, because the roles are plain processes whose main
threads are busy in torch: the heartbeat runs in a background thread with its own
connection, so a long-poll or a slow call on the main thread never delays it. Calls retry
with exponential back-off and jitter while the server is unreachable (it may be restarting:
its state survives) and raise :class:`RendezvousError` with the URL and the last failure
once ``retry_s`` is spent. A client made with :meth:`RendezvousClient.from_run_dir`
re-reads ``rendezvous.json`` while retrying, so it follows a server restarted on a new port.
"""

from __future__ import annotations

import json
import logging
import random
import socket
import ssl
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from streamrl_cli import environ
from streamrl_cli.errors import RendezvousError
from streamrl_cli.rendezvous import read_secret
from streamrl_cli.rundir import RunDir

log = logging.getLogger("streamrl.rendezvous.client")


class RendezvousRequestError(RendezvousError):
    """The server answered with an error; `status` and `code` say which (see the API doc)."""

    def __init__(self, status: int, code: str, message: str, body: dict[str, Any]):
        super().__init__(f"rendezvous server refused the request ({status} {code}): {message}")
        self.status, self.code, self.body = status, code, body


class RendezvousClient:
    """One connection to a run's rendezvous server; at most one registered member per client."""

    def __init__(
        self,
        url: str,
        token: str,
        *,
        timeout: float = 10.0,
        tls_ca: Path | str | None = None,
        retry_s: float = 30.0,
        run_dir: Path | None = None,
    ):
        self._url = url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"}
        self.timeout = timeout
        self.retry_s = retry_s
        self._run_dir = Path(run_dir) if run_dir is not None else None
        self._verify: ssl.SSLContext | bool = (
            ssl.create_default_context(cafile=str(tls_ca)) if tls_ca else True
        )
        self._http = self._new_http()
        self._lock = threading.Lock()
        self._registration: dict[str, Any] | None = None
        self.member_id: str | None = None
        self._credential = ""  # from /v1/register
        self.incarnation: int | None = None
        self.lease_s: float | None = None
        self._status: dict[str, Any] = {}  # weight_version / state sent with each heartbeat
        self._hb_thread: threading.Thread | None = None
        self._hb_stop = threading.Event()
        self.heartbeat_stats = {"sent": 0, "failed": 0, "reregistered": 0, "last_ok": 0.0, "error": ""}

    @classmethod
    def from_run_dir(cls, run_dir: Path | str, **kwargs: Any) -> RendezvousClient:
        """A client for the server of `run_dir`: URL from rendezvous.json, token from secret."""
        run_dir = Path(run_dir)
        return cls(_read_url(run_dir), read_secret(run_dir), run_dir=run_dir, **kwargs)

    @property
    def url(self) -> str:
        return self._url

    # ---- membership ----

    def register(
        self,
        role: str,
        rank: int,
        *,
        cluster: str = "",
        host: str | None = None,
        site: str = "",
        addresses: dict[str, str] | None = None,
        info: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Register (or re-register after a restart) as (role, rank); returns member id, peers, version."""
        body = {
            "role": role,
            "rank": rank,
            "cluster": cluster,
            "host": host or socket.gethostname(),
            "site": site,
            "addresses": addresses or {},
            "info": info or {},
        }
        with self._lock:
            self._registration = body
        return self._register(self._http)

    def _register(self, http: httpx.Client, retry_s: float | None = None) -> dict[str, Any]:
        with self._lock:
            body = self._registration
        if body is None:
            raise RendezvousError("register() first")
        resp = self._call("POST", "/v1/register", body, http=http, retry_s=retry_s)
        with self._lock:
            self.member_id, self.incarnation = resp["member_id"], resp["incarnation"]
            self._credential = resp["credential"]  # our later calls in our own name carry it
            self.lease_s = resp["lease_s"]
        return resp

    def set_status(
        self, *, weight_version: int | None = None, state: str | None = None, error: str | None = None
    ) -> None:
        """What the next heartbeats report: the weight version served, a free-form activity, and why
        the member cannot do its job (`error`; "" once it can again)."""
        with self._lock:
            if weight_version is not None:
                self._status["weight_version"] = weight_version
            if state is not None:
                self._status["state"] = state[:64]
            if error is not None:
                self._status["error"] = error[:1000]

    def heartbeat(self) -> dict[str, Any]:
        """Send one heartbeat now (the background thread does this on its own)."""
        return self._heartbeat_once(self._http)

    def _heartbeat_once(self, http: httpx.Client, retry_s: float | None = None) -> dict[str, Any]:
        with self._lock:
            body = {"member_id": self._require_member(), "credential": self._credential,
                    "incarnation": self.incarnation, **self._status}  # fmt: skip
        return self._call("POST", "/v1/heartbeat", body, http=http, retry_s=retry_s)

    def start_heartbeat(self, interval: float | None = None) -> None:
        """Heartbeat in a daemon thread every `interval` s (default lease/3) until leave() or close()."""
        with self._lock:
            self._require_member()
            if self._hb_thread is not None and self._hb_thread.is_alive():
                return
            interval = interval or self.lease_s / 3
            self._hb_stop.clear()
            self._hb_thread = threading.Thread(
                target=self._heartbeat_loop,
                args=(interval,),
                daemon=True,
                name=f"rendezvous-heartbeat-{self.member_id}",
            )
            self._hb_thread.start()

    def _heartbeat_loop(self, interval: float) -> None:
        http = self._new_http()  # its own connection: never queued behind a long-poll
        stats, failures, delay, reregister = self.heartbeat_stats, 0, interval, False
        try:
            while not self._hb_stop.wait(delay):
                try:
                    if reregister:
                        self._register(http, retry_s=0)
                        stats["reregistered"] += 1
                        reregister = False
                    self._heartbeat_once(http, retry_s=0)
                    stats["sent"] += 1
                    stats["last_ok"] = time.time()
                    failures, delay = 0, interval
                except RendezvousRequestError as e:
                    if e.code in ("unknown_member", "bad_credential"):
                        # The server lost our registration (or the key of its credentials): register again.
                        log.warning("rendezvous server does not know %s (%s); registering again",
                                    self.member_id, e.code)  # fmt: skip
                        reregister, delay = True, 0
                    elif e.code in ("stale_incarnation", "member_left", "unauthorized"):
                        stats["error"] = str(e)
                        log.error("heartbeat stopped: %s", e)
                        return
                    else:
                        log.warning("heartbeat refused: %s", e)
                        delay = interval
                except Exception as e:  # RendezvousError when unreachable; anything else is logged too
                    # Back off exponentially, but never beyond the interval, so that the member is
                    # back well within one lease once the server (restarting, say) answers again.
                    failures += 1
                    stats["failed"] += 1
                    delay = min(interval, 0.05 * 2**failures) * random.uniform(0.5, 1.0)
                    if not isinstance(e, RendezvousError):
                        log.exception("heartbeat failed unexpectedly")
                    log.debug("heartbeat failed (%d in a row): %s", failures, e)
        finally:
            http.close()

    def stop_heartbeat(self) -> None:
        self._hb_stop.set()
        t = self._hb_thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=self.timeout + 1)
        self._hb_thread = None

    def leave(self, reason: str = "") -> None:
        """Stop heartbeating and tell the server this member exits cleanly (not a failure)."""
        self.stop_heartbeat()
        with self._lock:
            body = {"member_id": self._require_member(), "credential": self._credential,
                    "reason": reason[:255]}  # fmt: skip
        try:
            self._call("POST", "/v1/leave", body)
        except RendezvousRequestError as e:
            if e.code != "stale_incarnation":
                raise
            # A newer process took our role and rank: the member is theirs now, not ours to end.
            log.info("not leaving as %s: %s", body["member_id"], e)

    # ---- discovery and events ----

    def members(self, role: str | None = None) -> list[dict[str, Any]]:
        return self.members_doc(role)["members"]

    def members_doc(self, role: str | None = None) -> dict[str, Any]:
        """The members (of `role`) and ``event_seq``: events after it change them (long-poll ``events``)."""
        return self._call("GET", "/v1/members", params={"role": role} if role else None)

    def events(self, since: int = 0, timeout: float = 0.0, limit: int = 1000) -> dict[str, Any]:
        """Events after `since`; waits up to `timeout` s (server cap 60) when there are none yet."""
        params = {"since": since, "timeout": timeout, "limit": limit}
        return self._call("GET", "/v1/events", params=params, timeout=self.timeout + min(timeout, 60.0))

    def wait_for(self, role: str, count: int, timeout: float) -> list[dict[str, Any]]:
        """Block until `count` members of `role` are alive; return them. Long-polls, never spins."""
        deadline = time.monotonic() + timeout
        while True:
            doc = self.members_doc(role)
            alive = [m for m in doc["members"] if m["state"] == "alive"]
            left = deadline - time.monotonic()
            if len(alive) >= count:
                return alive
            if left <= 0:
                raise RendezvousError(
                    f"timed out after {timeout:.3g}s waiting for {count} alive '{role}' "
                    f"member(s); {len(alive)} alive: {[m['member_id'] for m in alive]}"
                )
            self.events(doc["event_seq"], timeout=min(left, 30.0), limit=1)

    # ---- weight versions ----

    def versions(self) -> dict[str, Any]:
        return self._call("GET", "/v1/versions")

    def propose_version(
        self,
        version: int,
        required_roles: list[str],
        *,
        members: dict[str, int] | None = None,
        transfer: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Trainer: announce that `version` is being distributed to `required_roles`; with `members`
        (member_id -> incarnation) only those must confirm it; `transfer` is passed on to them."""
        body: dict[str, Any] = {"version": version, "required_roles": required_roles}
        if members is not None:
            body["members"] = members
        if transfer is not None:
            body["transfer"] = transfer
        return self._call("POST", "/v1/versions/propose", body)

    def confirm_version(self, version: int) -> dict[str, Any]:
        """Member: `version` is loaded and served (also reported by later heartbeats)."""
        with self._lock:
            body = {"member_id": self._require_member(), "credential": self._credential, "version": version}
            self._status["weight_version"] = version
        return self._call("POST", "/v1/versions/confirm", body)

    def wait_for_version(self, version: int, timeout: float) -> dict[str, Any]:
        """Block until the current version is >= `version`; return GET /v1/versions."""
        deadline = time.monotonic() + timeout
        while True:
            doc = self.versions()
            if doc["current"] is not None and doc["current"] >= version:
                return doc
            left = deadline - time.monotonic()
            if left <= 0:
                pending = {p["version"]: sorted(p["confirmed"]) for p in doc["pending"]}
                raise RendezvousError(
                    f"timed out after {timeout:.3g}s waiting for weight version {version}; "
                    f"current {doc['current']}, pending (confirmed by): {pending}"
                )
            self.events(doc["event_seq"], timeout=min(left, 30.0), limit=1)

    # ---- metrics, progress, status ----

    def post_metrics(self, record: dict[str, Any]) -> None:
        with self._lock:
            body = {"member_id": self._require_member(), "credential": self._credential, "record": record}
        self._call("POST", "/v1/metrics", body)

    def post_progress(self, step: int, **fields: Any) -> dict[str, Any]:
        return self._call("POST", "/v1/progress", {"step": step, **fields})["progress"]

    def request_scale(self, instances: int, *, source: str = "user", reason: str = "") -> int:
        """Ask for `instances` generator instances; returns the request's event seq."""
        body = {"role": "generator", "instances": instances, "source": source, "reason": reason[:255]}
        return int(self._call("POST", "/v1/scale", body)["seq"])

    def status(self) -> dict[str, Any]:
        return self._call("GET", "/v1/status")

    def close(self) -> None:
        self.stop_heartbeat()
        self._http.close()

    def __enter__(self) -> RendezvousClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- transport ----

    def _new_http(self) -> httpx.Client:
        return httpx.Client(timeout=self.timeout, verify=self._verify, headers=self._headers)

    def _require_member(self) -> str:
        if self.member_id is None:
            raise RendezvousError("this client has not registered a member; call register() first")
        return self.member_id

    def _call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        params: Any = None,
        timeout: float | None = None,
        http: httpx.Client | None = None,
        retry_s: float | None = None,
    ) -> Any:
        """One request, retried while the server is unreachable or answers 5xx."""
        http = http or self._http
        retry_s = self.retry_s if retry_s is None else retry_s
        deadline = time.monotonic() + retry_s
        attempt, waited = 0, False
        while True:
            base = self._url
            url = base + path
            try:
                r = http.request(method, url, json=body, params=params, timeout=timeout or self.timeout)
            except httpx.TransportError as e:
                failure = f"{type(e).__name__}: {e}"
            else:
                if r.status_code < 500:
                    try:
                        data = r.json()
                    except ValueError:  # not our server (a proxy, say): no point in retrying
                        raise RendezvousRequestError(r.status_code, "not_json", r.text[:200], {}) from None
                    if r.is_success:
                        return data
                    raise RendezvousRequestError(
                        r.status_code, data.get("error", "?"), data.get("message", r.text), data
                    )
                failure = f"HTTP {r.status_code}: {r.text[:200]}"
            attempt += 1
            requeued = self._refresh_url()
            if self._url != base:
                # A restarted or requeued server listens at a new address, which it writes once it
                # serves: try it now, with a budget of its own (the old address may have used up
                # this call's, while the server was away).
                deadline, attempt = time.monotonic() + retry_s, 0
                continue
            moving = requeued and retry_s > 0  # retry_s=0: the caller does not wait
            delay = min(2.0, 0.05 * 2**attempt) * random.uniform(0.5, 1.0)
            late = time.monotonic() + delay > deadline
            if late and not moving:
                raise RendezvousError(
                    f"rendezvous server at {base} unreachable for {method} {path} "
                    f"after {attempt} attempt(s) over {retry_s:.3g}s: {failure}"
                )
            if late and not waited:
                waited = True
                log.warning("the rendezvous server's job requeued itself: %s %s waits for it", method, path)
            time.sleep(delay)

    def _refresh_url(self) -> bool:
        """Follow the server to the address rendezvous.json gives (a restarted server may listen on
        another port; it rewrites the file when ready). True while the file says the server is on
        its way to its requeued SLURM job: calls wait for it past `retry_s` (up to
        $STREAMRL_RENDEZVOUS_REQUEUE_WAIT_S, environ.requeue_wait_s)."""
        if self._run_dir is None:
            return False
        try:
            doc = _read_endpoint(self._run_dir)
        except RendezvousError:
            return False
        with self._lock:
            if doc["url"] != self._url:
                log.info("rendezvous server moved: %s -> %s", self._url, doc["url"])
                self._url = doc["url"]
        requeued = doc.get("requeued")
        return isinstance(requeued, (int, float)) and time.time() - requeued < environ.requeue_wait_s()


def _read_endpoint(run_dir: Path) -> dict[str, Any]:
    path = RunDir(Path(run_dir)).endpoint
    try:
        doc = json.loads(path.read_text())
        if not isinstance(doc, dict) or not isinstance(doc.get("url"), str):
            raise KeyError("url")
        return doc
    except (OSError, ValueError, KeyError) as e:
        raise RendezvousError(f"cannot read the rendezvous server's address from {path}: {e}") from None


def _read_url(run_dir: Path) -> str:
    return _read_endpoint(run_dir)["url"]
