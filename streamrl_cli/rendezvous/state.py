"""The rendezvous server's state machine and its journal: no sockets, clocks passed in.

The state is event-sourced. A command (register, heartbeat, confirm, ...) checks its
arguments against the current state, then emits events; :meth:`RendezvousState.apply` is
the only code that mutates state, for a live event and for one replayed from the journal
alike, so a restarted server rebuilds exactly the state it had. The same events, with
their sequence numbers, are what ``GET /v1/events`` serves.

Liveness is kept apart from the journal: heartbeats only move an in-memory monotonic
timestamp (``Member.last_seen``), so the hot path never touches the disk. After a replay,
every member that was alive gets one full lease (``start_grace``) to heartbeat again.

Two clocks are passed explicitly: ``now`` (wall time, recorded in events) and ``mono``
(monotonic, for lease arithmetic, immune to clock steps).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from streamrl_cli.errors import RendezvousError

log = logging.getLogger("streamrl.rendezvous")

SNAPSHOT_FORMAT = 1


class Rejected(RendezvousError):
    """A command that the current state does not allow; ``code`` is stable, for clients."""

    def __init__(self, code: str, message: str, **details: Any):
        super().__init__(message)
        self.code = code
        self.details = details


def printable(text: str) -> str:
    """A member's free-form error as it may reach a terminal: control characters (ANSI escapes, line
    separators) shown as spaces."""
    return "".join(c if c.isprintable() else " " for c in text).strip()


@dataclass
class Member:
    member_id: str
    role: str
    rank: int
    cluster: str
    host: str
    site: str
    addresses: dict[str, str]
    info: dict[str, Any]
    incarnation: int = 1
    state: str = "alive"  # alive | lost | left
    reported_state: str | None = None  # what the member says it is doing ("generating", ...)
    weight_version: int | None = None  # the version it serves
    last_error: str | None = None  # why it could not do its job, as it said last (or as it left)
    registered_at: float = 0.0
    changed_at: float = 0.0  # wall time of the last change of `state`
    last_seen: float = field(default=0.0, compare=False)  # monotonic; never journaled


@dataclass
class PendingVersion:
    version: int
    required_roles: list[str]
    proposed_at: float
    confirmed: dict[str, float] = field(default_factory=dict)  # member_id -> wall time
    # The members it is sent to (member_id -> incarnation): only they must confirm. None: every
    # alive member of the required roles (a newcomer too).
    members: dict[str, int] | None = None
    transfer: dict[str, Any] | None = None  # how they get it (the weight group layout); opaque here


MEMBER_FIELDS = [f.name for f in fields(Member) if f.name != "last_seen"]
PEER_FIELDS = ["member_id", "role", "rank", "cluster", "site", "host", "addresses", "incarnation"]


class RendezvousState:
    """Membership, weight versions, run progress and the event log of one run."""

    def __init__(self, lease_s: float, max_events: int = 10_000):
        self.lease_s = lease_s
        self.members: dict[str, Member] = {}
        self.seq = 0
        self.events: deque[dict[str, Any]] = deque(maxlen=max_events)
        self.current_version: int | None = None
        self.current_since: float | None = None
        self.pending: dict[int, PendingVersion] = {}
        self.progress: dict[str, Any] = {}
        self.metrics: dict[str, dict[str, Any]] = {}  # member_id -> latest {"time", "record"}
        self.scale: dict[str, dict[str, Any]] = {}  # role -> latest scale request (with its seq)
        self._views: dict[str, dict[str, Any]] = {}  # member_id -> member_view minus the age

    # ---- commands: check, then emit events (each returns the events it emitted) ----

    def register(
        self,
        *,
        role: str,
        rank: int,
        cluster: str,
        host: str,
        site: str,
        addresses: dict[str, str],
        info: dict[str, Any],
        now: float,
        mono: float,
    ) -> tuple[Member, list[dict[str, Any]]]:
        member_id = f"{role}-{rank}"
        old = self.members.get(member_id)
        incarnation = old.incarnation + 1 if old else 1
        ev = self._emit(
            now,
            "member_registered",
            member_id=member_id,
            role=role,
            rank=rank,
            cluster=cluster,
            host=host,
            site=site,
            addresses=addresses,
            info=info,
            incarnation=incarnation,
        )
        member = self.members[member_id]
        member.last_seen = mono
        # A restarted member named by a pending proposal no longer holds it up (another process).
        return member, [ev, *self._check_versions(now)]

    def heartbeat(
        self,
        member_id: str,
        *,
        incarnation: int | None,
        weight_version: int | None,
        reported_state: str | None,
        now: float,
        mono: float,
        error: str | None = None,
    ) -> list[dict[str, Any]]:
        m = self.member(member_id)
        if incarnation is not None and incarnation != m.incarnation:
            raise Rejected(
                "stale_incarnation",
                f"{member_id} incarnation {incarnation} was superseded by incarnation "
                f"{m.incarnation} (another process registered the same role and rank)",
                current_incarnation=m.incarnation,
            )
        events = self._touch(m, now, mono)
        changes: dict[str, Any] = {}
        if weight_version is not None and weight_version != m.weight_version:
            changes["weight_version"] = weight_version
        if reported_state is not None and reported_state != m.reported_state:
            changes["reported_state"] = reported_state
        if error is not None and (printable(error) or None) != m.last_error:
            changes["last_error"] = printable(error) or None
        if changes:
            events.append(self._emit(now, "member_updated", member_id=member_id, **changes))
        return events

    def leave(self, member_id: str, *, reason: str, now: float) -> list[dict[str, Any]]:
        m = self.member(member_id, allow_left=True)
        if m.state == "left":
            return []  # leaving twice is not an error: a retried request must be harmless
        events = [self._emit(now, "member_left", member_id=member_id, reason=reason)]
        if reason.startswith("failed:"):  # its last words are the reason it failed
            events.append(
                self._emit(now, "member_updated", member_id=member_id, last_error=printable(reason))
            )
        return events + self._check_versions(now)

    def reap(self, *, now: float, mono: float) -> list[dict[str, Any]]:
        """Mark lost every alive member silent for longer than one lease."""
        events = []
        for m in list(self.members.values()):
            silent = mono - m.last_seen
            if m.state == "alive" and silent > self.lease_s:
                events.append(
                    self._emit(now, "member_lost", member_id=m.member_id, silent_s=round(silent, 3))
                )
        return events + self._check_versions(now) if events else events

    def excuse(self, seconds: float, *, mono: float) -> None:
        """The server heard nobody for ``seconds`` (it did not run): that time is not silence."""
        for m in self.members.values():
            m.last_seen = min(mono, m.last_seen + seconds)

    def start_grace(self, mono: float) -> None:
        """After a replay: every alive member gets one full lease from `mono` to heartbeat."""
        for m in self.members.values():
            m.last_seen = mono

    def propose(
        self,
        version: int,
        required_roles: list[str],
        *,
        now: float,
        members: dict[str, int] | None = None,
        transfer: dict[str, Any] | None = None,
    ) -> list[dict[str, Any]]:
        """Announce `version`. Proposing a pending version again with other `members` or `transfer` is a
        re-send (the trainer re-formed its weight group around a changed membership): a new event,
        the new recipients replace the old ones, confirmations already made still count."""
        if self.current_version is not None and version <= self.current_version:
            raise Rejected(
                "stale_version",
                f"version {version} is not newer than the current version "
                f"{self.current_version}; propose a version > {self.current_version}",
                current=self.current_version,
            )
        roles = sorted(set(required_roles))
        unknown = sorted(set(members or ()) - set(self.members))
        if unknown:
            raise Rejected(
                "unknown_member", f"version {version} proposed for unregistered member(s) {unknown}"
            )
        pending = self.pending.get(version)
        if pending is not None:
            if pending.required_roles != roles:
                raise Rejected(
                    "version_conflict",
                    f"version {version} is already pending with required roles "
                    f"{pending.required_roles}, not {roles}",
                )
            if (pending.members, pending.transfer) == (members, transfer):
                return []  # the same proposal again (a retry): nothing to do
        extra = {k: v for k, v in (("members", members), ("transfer", transfer)) if v is not None}
        ev = self._emit(now, "version_proposed", version=version, required_roles=roles, **extra)
        return [ev, *self._check_versions(now)] if pending is not None else [ev]

    def confirm(self, member_id: str, version: int, *, now: float, mono: float) -> list[dict[str, Any]]:
        m = self.member(member_id)
        events = self._touch(m, now, mono)
        if version == self.current_version:
            if m.weight_version != version:  # a late joiner loading the current version
                events.append(self._emit(now, "member_updated", member_id=member_id, weight_version=version))
            return events
        if version not in self.pending:
            if self.current_version is not None and version < self.current_version:
                raise Rejected(
                    "stale_version",
                    f"version {version} is older than the current version {self.current_version}",
                    current=self.current_version,
                )
            raise Rejected(
                "unknown_version",
                f"version {version} was never proposed; pending versions: "
                f"{sorted(self.pending)}, current: {self.current_version}",
            )
        if member_id not in self.pending[version].confirmed:
            events.append(self._emit(now, "version_confirmed", version=version, member_id=member_id))
            events += self._check_versions(now)
        return events

    def set_progress(self, update: dict[str, Any], *, now: float) -> list[dict[str, Any]]:
        return [self._emit(now, "progress", **update)]

    def request_scale(
        self, role: str, instances: int, *, source: str, reason: str, now: float
    ) -> list[dict[str, Any]]:
        """A scale request: an event for whoever applies it (the process watching the run)."""
        if role != "generator":
            raise Rejected("not_elastic", f"only the generator role scales, not {role!r}")
        return [
            self._emit(now, "scale_requested", role=role, instances=instances, source=source, reason=reason)
        ]

    def record_metrics(
        self, member_id: str, record: dict[str, Any], *, now: float, mono: float
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Keep the latest record of a member; return the metrics.jsonl line and any events."""
        m = self.member(member_id)
        events = self._touch(m, now, mono)
        self.metrics[member_id] = {"time": now, "record": record}
        line = {"time": now, "member_id": member_id, "role": m.role, "rank": m.rank, **record}
        return line, events

    # ---- the only mutator ----

    def apply(self, ev: dict[str, Any]) -> None:
        if ev["seq"] != self.seq + 1:
            raise ValueError(f"event seq {ev['seq']} does not follow {self.seq}")
        getattr(self, "_on_" + ev["type"])(ev["time"], ev["data"])
        self._views.pop(ev["data"].get("member_id"), None)
        self.seq = ev["seq"]
        self.events.append(ev)

    def _on_member_registered(self, t: float, d: dict[str, Any]) -> None:
        mid = d["member_id"]
        self.members[mid] = Member(
            member_id=mid,
            role=d["role"],
            rank=d["rank"],
            cluster=d["cluster"],
            host=d["host"],
            site=d["site"],
            addresses=d["addresses"],
            info=d["info"],
            incarnation=d["incarnation"],
            registered_at=t,
            changed_at=t,
        )
        # A new incarnation starts without weights: its old confirmations no longer hold.
        for p in self.pending.values():
            p.confirmed.pop(mid, None)
        self.metrics.pop(mid, None)

    def _on_member_updated(self, t: float, d: dict[str, Any]) -> None:
        m = self.members[d["member_id"]]
        m.weight_version = d.get("weight_version", m.weight_version)
        m.reported_state = d.get("reported_state", m.reported_state)
        m.last_error = d.get("last_error", m.last_error)

    def _set_state(self, member_id: str, state: str, t: float) -> None:
        m = self.members[member_id]
        m.state, m.changed_at = state, t

    def _on_member_lost(self, t: float, d: dict[str, Any]) -> None:
        self._set_state(d["member_id"], "lost", t)

    def _on_member_revived(self, t: float, d: dict[str, Any]) -> None:
        self._set_state(d["member_id"], "alive", t)

    def _on_member_left(self, t: float, d: dict[str, Any]) -> None:
        self._set_state(d["member_id"], "left", t)

    def _on_version_proposed(self, t: float, d: dict[str, Any]) -> None:
        p = self.pending.get(d["version"])
        if p is None:
            p = self.pending[d["version"]] = PendingVersion(d["version"], d["required_roles"], t)
        p.members, p.transfer = d.get("members"), d.get("transfer")  # a re-send replaces the recipients

    def _on_version_confirmed(self, t: float, d: dict[str, Any]) -> None:
        self.pending[d["version"]].confirmed[d["member_id"]] = t
        self.members[d["member_id"]].weight_version = d["version"]

    def _on_version_current(self, t: float, d: dict[str, Any]) -> None:
        self.current_version, self.current_since = d["version"], t
        for v in [v for v in self.pending if v <= d["version"]]:
            del self.pending[v]

    def _on_scale_requested(self, t: float, d: dict[str, Any]) -> None:
        self.scale[d["role"]] = {**d, "time": t, "seq": self.seq + 1}

    def _on_progress(self, t: float, d: dict[str, Any]) -> None:
        self.progress.update(d)
        self.progress["updated"] = t

    # ---- helpers ----

    def member(self, member_id: str, *, allow_left: bool = False) -> Member:
        m = self.members.get(member_id)
        if m is None:
            raise Rejected("unknown_member", f"no member {member_id!r}; register first (POST /v1/register)")
        if m.state == "left" and not allow_left:
            raise Rejected("member_left", f"member {member_id!r} has left; register again to rejoin")
        return m

    def _emit(self, now: float, type_: str, **data: Any) -> dict[str, Any]:
        ev = {"seq": self.seq + 1, "time": now, "type": type_, "data": data}
        self.apply(ev)
        return ev

    def _touch(self, m: Member, now: float, mono: float) -> list[dict[str, Any]]:
        # Any call from a member proves it is alive; one declared lost comes back.
        m.last_seen = mono
        return [self._emit(now, "member_revived", member_id=m.member_id)] if m.state == "lost" else []

    def _check_versions(self, now: float) -> list[dict[str, Any]]:
        """Announce the newest pending version that every alive member it was sent to confirmed
        (all alive members of its roles, unless the proposal named its members)."""
        for v in sorted(self.pending, reverse=True):
            p = self.pending[v]
            if p.members is None:
                needed = [
                    m.member_id
                    for m in self.members.values()
                    if m.state == "alive" and m.role in p.required_roles
                ]
            else:  # a member that re-registered since is a new process: it was not sent this version
                needed = [
                    mid
                    for mid, incarnation in p.members.items()
                    if (m := self.members.get(mid)) and m.state == "alive" and m.incarnation == incarnation
                ]
            # At least one confirmation: a version nobody serves is not "current".
            if needed and all(mid in p.confirmed for mid in needed):
                superseded = sorted(x for x in self.pending if x < v)
                return [
                    self._emit(
                        now, "version_current", version=v, confirmed_by=sorted(needed), superseded=superseded
                    )
                ]
        return []

    # ---- views ----

    def events_after(
        self, since: int, limit: int, upto: int | None = None
    ) -> tuple[list[dict[str, Any]], bool]:
        """Events with since < seq <= upto (the oldest `limit`), and whether the caller must resync.

        Resync means events were missed: `since` is older than what is retained, or beyond the
        last seq (the server's state was reset). The caller then re-reads /v1/members.
        """
        last = self.seq if upto is None else min(upto, self.seq)
        newer: list[dict[str, Any]] = []
        for ev in reversed(self.events):  # new events sit at the right end: O(new events)
            if ev["seq"] <= since:
                break
            if ev["seq"] <= last:
                newer.append(ev)
        newer.reverse()
        oldest = self.events[0]["seq"] if self.events else last + 1
        resync = since > last or (oldest > since + 1 and since < last)
        return newer[:limit], resync

    def member_view(self, m: Member, mono: float) -> dict[str, Any]:
        return {**self._view(m), "last_heartbeat_age_s": round(max(0.0, mono - m.last_seen), 3)}

    def peer_view(self, m: Member) -> dict[str, Any]:
        """What a newcomer needs to reach a peer; the rest is in GET /v1/members."""
        view = self._view(m)
        return {f: view[f] for f in PEER_FIELDS}

    def _view(self, m: Member) -> dict[str, Any]:
        # Cached between changes of the member, and shallow: callers encode it at once and
        # never modify it. A registration storm of N members builds N^2/2 peer views.
        view = self._views.get(m.member_id)
        if view is None:
            view = self._views[m.member_id] = {f: getattr(m, f) for f in MEMBER_FIELDS}
        return view

    def versions_view(self) -> dict[str, Any]:
        return {
            "current": self.current_version,
            "current_since": self.current_since,
            "pending": [asdict(self.pending[v]) for v in sorted(self.pending)],
        }

    def to_snapshot(self, keep_events: int = 1000) -> dict[str, Any]:
        members = [{k: v for k, v in asdict(m).items() if k != "last_seen"} for m in self.members.values()]
        return {
            "format": SNAPSHOT_FORMAT,
            "seq": self.seq,
            "members": members,
            "current_version": self.current_version,
            "current_since": self.current_since,
            "pending": [asdict(p) for p in self.pending.values()],
            "progress": self.progress,
            "scale": self.scale,
            "events": list(self.events)[-keep_events:],
        }

    def load_snapshot(self, snap: dict[str, Any]) -> None:
        if snap.get("format") != SNAPSHOT_FORMAT:
            raise RendezvousError(f"snapshot format {snap.get('format')!r} is not {SNAPSHOT_FORMAT}")
        self.members = {m["member_id"]: Member(**m) for m in snap["members"]}
        self._views.clear()
        self.pending = {}
        for p in snap["pending"]:
            self.pending[p["version"]] = PendingVersion(**p)
        self.current_version, self.current_since = snap["current_version"], snap["current_since"]
        self.progress, self.seq = dict(snap["progress"]), snap["seq"]
        self.scale = dict(snap.get("scale", {}))  # absent in snapshots written before scaling existed
        self.events.clear()
        self.events.extend(snap["events"])

    def replay(self, events: list[dict[str, Any]]) -> None:
        for ev in events:
            if ev["seq"] <= self.seq:
                continue  # already in the snapshot (a crash between snapshot and journal reset)
            if ev["seq"] != self.seq + 1:
                log.warning("journal: events %d..%d are missing", self.seq + 1, ev["seq"] - 1)
                self.seq = ev["seq"] - 1
            try:
                self.apply(ev)
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                # A damaged journal must not keep the control plane down; say what was skipped.
                log.warning("journal: skipping event %s (%s): %r", ev["seq"], ev.get("type"), e)
                self.seq = ev["seq"]
