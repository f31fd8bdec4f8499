"""The source of an elastic broadcast group: plan, propose, wait until ready, send; once more on a new group.

Why shared: two processes are rank 0 of a group whose members come and go. The trainer sends to
the generators of its own site (``trainer.role.publish``); at another site the relay sends what it
fetched to the generators there, its own engine included (``generator.weights``). Both follow the
protocol of ``weights.layout``: before each transfer the source compares the generators it can
reach now (alive, past start-up; a restarted one is a new incarnation) with the group it has; when
they differ it forms a new group for exactly them and says so in the version proposal (the relay
re-sends the trainer's pending proposal with its own site's layout). It sends only once every
member reported it is drained and ready, so a member that dies before that costs nothing but a
re-plan, and one that dies during the transfer fails it within `transfer_timeout_s`; the version is
then sent again once, on a new group of the members still there.

A source that finds the pending proposal carrying another group than its own stops at once and
does not retry: another source took the version over (a relay that came back after its site
elected a new one).
"""

from __future__ import annotations

import gc
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

from streamrl_cli.weights import WeightTransferError
from streamrl_cli.weights import layout as wl
from streamrl_cli.weights.layout import GroupLayout, eligible, membership, workers

log = logging.getLogger("streamrl.weights.elastic")

SYNC_TIMEOUT_S = 600.0  # for the generators: to drain and say they are ready, to load and confirm
TRANSFER_TIMEOUT_S = 60.0  # forming the group and each broadcast, once all are ready: a dead member's cost


class MembershipChanged(WeightTransferError):
    """A member of the group was lost, left or restarted before the transfer completed."""


class SourceReplaced(WeightTransferError):
    """Another source proposed this version's transfer since ours: it is theirs now; no retry."""


class ElasticSource:
    """Rank 0 of an elastic broadcast group over the alive generators; one transfer at a time."""

    def __init__(
        self,
        rdv: Any,
        *,
        backend: str,
        host: str,
        transfer_timeout_s: float = TRANSFER_TIMEOUT_S,
        sync_timeout_s: float = SYNC_TIMEOUT_S,
        retries: int = 1,
    ):
        self.rdv, self.backend = rdv, backend
        self.host = host  # the name members reach us by (the store prefix)
        self.transfer_timeout_s, self.sync_timeout_s = transfer_timeout_s, sync_timeout_s
        self.retries = retries  # sends of a version again, each on a new group, before giving up
        self.layout: GroupLayout | None = None  # the group planned last; formed once `group` is set
        self.group: Any = None
        self._store: Any = None  # the layout's store, hosted before the group forms

    def broadcast_version(
        self,
        tensors: dict[str, Any],
        version: int,
        *,
        sent_as: int | None = None,
        confirm: bool = True,
        on_proposed: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict:
        """Deliver `version` to every eligible generator that does not have it yet; returns stats.

        `sent_as`: the version the tensors are (a relay superseded mid-fetch sends a newer one than
        proposed). `confirm`: wait until the version is current (a relay does not: its own engine
        confirms only after this returns). `on_proposed(proposal)` runs after each proposal.
        """
        attempts = 1 + self.retries
        for attempt in range(1, attempts + 1):
            try:
                stats = self._attempt(
                    tensors, version, new_group=attempt > 1, sent_as=sent_as, confirm=confirm,
                    on_proposed=on_proposed,
                )  # fmt: skip
                return {**stats, "attempts": attempt}
            except SourceReplaced:
                self._drop_group()
                raise
            except WeightTransferError as e:
                error = str(e)
            # Out of the except clause: the exception's frames no longer hold the group, so dropping
            # it closes its sockets and the members blocked in it fail now, not at their timeout.
            failed = self.layout
            self._drop_group()
            if attempt == attempts:
                raise WeightTransferError(
                    f"weight version {version} not delivered in {attempts} attempt(s): {error}"
                )
            log.warning(
                "weight version %d, attempt %d failed: %s; again on a new group", version, attempt, error
            )
            if failed is not None:  # a member died without the rendezvous knowing yet: give it a lease
                self._until(
                    lambda ms, _vs, f=failed: membership(eligible(ms)) != f.membership() or None,
                    self.transfer_timeout_s, "a change of membership", fail=False,
                )  # fmt: skip
        raise AssertionError("unreachable")

    def _attempt(
        self,
        tensors: dict[str, Any],
        version: int,
        *,
        new_group: bool,
        sent_as: int | None,
        confirm: bool,
        on_proposed: Callable[[dict[str, Any]], None] | None,
    ) -> dict:
        t0 = time.monotonic()
        members = self._until(lambda ms, vs: self._recipients(ms, vs, version), self.sync_timeout_s,
                              f"a generator to send version {version} to")  # fmt: skip
        if members == "confirmed":  # every member still there has it already (a retry after a late loss)
            return self._confirmed(version, t0, t0, {}) if confirm else {"members": 0}
        layout = self.layout
        if new_group or layout is None or layout.membership() != membership(members):
            layout = self._plan(members)
        # `source`: who sends (a far site's generators tell a relay at work from one that died).
        transfer = {**layout.doc(), "source": self.rdv.member_id}
        proposal = {"version": version, "members": layout.incarnations, "transfer": transfer}
        self.rdv.propose_version(version, ["generator"], members=layout.incarnations, transfer=transfer)
        if on_proposed is not None:
            on_proposed(proposal)
        self._until(
            lambda ms, vs: self._replaced(layout, vs, version) or self._ready(layout, ms, version),
            self.sync_timeout_s,
            f"generators {sorted(layout.ranks)} to be ready for version {version}",
        )
        from streamrl_cli.weights.broadcast import BroadcastSender, init_weight_group

        t1 = time.monotonic()
        if self.group is None:
            self.group = init_weight_group(
                layout.address, 0, layout.world_size, backend=self.backend,
                timeout_s=self.transfer_timeout_s, store=self._store,
            )  # fmt: skip
        try:
            sent = BroadcastSender(self.group).send(tensors, version if sent_as is None else sent_as)
        except RuntimeError as e:  # gloo/NCCL: a member died or hangs
            raise WeightTransferError(f"broadcast on group {layout.group} failed: {e}") from None
        stats = {"bytes": sent["bytes"], "members": len(layout.ranks), "group": layout.group}
        if not confirm:
            return {**stats, "ready_s": t1 - t0, "send_s": time.monotonic() - t1}
        return self._confirmed(version, t0, t1, stats)

    def _confirmed(self, version: int, t0: float, t1: float, stats: dict) -> dict:
        t2 = time.monotonic()
        self._until(lambda ms, vs: self._current(ms, vs, version), self.sync_timeout_s,
                    f"weight version {version} to be confirmed")  # fmt: skip
        return {**stats, "ready_s": t1 - t0, "send_s": t2 - t1, "confirm_s": time.monotonic() - t2}

    def _plan(self, members: list[dict[str, Any]]) -> GroupLayout:
        from streamrl_cli.weights.broadcast import host_weight_store

        self._drop_group()
        world = 1 + sum(workers(m) for m in members)
        self._store = host_weight_store(self.host, world, timeout_s=self.transfer_timeout_s)
        self.layout = wl.plan_layout(
            members, group=secrets.token_hex(4), address=f"{self.host}:{self._store.port}",
            backend=self.backend, timeout_s=self.sync_timeout_s,
        )  # fmt: skip
        log.info("weight group %s: %s (world %d)", self.layout.group, self.layout.ranks, world)
        return self.layout

    # ---- conditions on the rendezvous' view (None: not yet) ----

    @staticmethod
    def _recipients(members: list[dict], versions: dict, version: int) -> list[dict] | str | None:
        """Who gets `version`: every eligible generator, less those that confirmed it already.
        "confirmed" once it is current: the rendezvous made it so when every member of its group
        still alive had it (a member lost mid-transfer is dropped from the group), and proposing it
        again would be refused as stale."""
        if versions["current"] is not None and versions["current"] >= version:
            return "confirmed"
        pending = {p["version"]: p for p in versions["pending"]}.get(version)
        done = set(pending["confirmed"]) if pending else set()
        todo = [m for m in eligible(members) if m["member_id"] not in done]
        if todo:
            return todo
        return "confirmed" if done and any(m["member_id"] in done for m in eligible(members)) else None

    @staticmethod
    def _ready(layout: GroupLayout, members: list[dict], version: int) -> bool | None:
        ready, broken = wl.check_ready(layout, members, version)
        if broken:
            raise MembershipChanged(f"{broken} before version {version} was sent")
        return ready or None

    @staticmethod
    def _replaced(layout: GroupLayout, versions: dict, version: int) -> None:
        pending = {p["version"]: p for p in versions["pending"]}.get(version)
        if pending is None:
            raise SourceReplaced(f"version {version} is no longer pending (current: {versions['current']})")
        theirs = GroupLayout.from_proposal(pending)
        if theirs is None or theirs.group != layout.group:
            raise SourceReplaced(f"version {version} was proposed again since, without group {layout.group}")

    @staticmethod
    def _current(members: list[dict], versions: dict, version: int) -> bool | None:
        # The rendezvous needs only members of the layout still alive; if none is, nobody will confirm.
        if versions["current"] is not None and versions["current"] >= version:
            return True
        layouts = [GroupLayout.from_proposal(p) for p in versions["pending"] if p["version"] == version]
        if layouts and layouts[0] is not None and not wl.alive_members(layouts[0], members):
            raise MembershipChanged(f"every member of group {layouts[0].group} is gone")
        return None

    def _until(
        self, check: Callable[[list, dict], Any], timeout: float, what: str, *, fail: bool = True
    ) -> Any:
        """Re-evaluate `check(generators, versions)` on every rendezvous event until it is not None."""
        deadline = time.monotonic() + timeout
        while True:
            versions = self.rdv.versions()  # first: its event_seq covers the members read after it
            result = check(self.rdv.members("generator"), versions)
            left = deadline - time.monotonic()
            if result is not None:
                return result
            if left <= 0:
                if not fail:
                    return None
                raise WeightTransferError(f"timed out after {timeout:.0f}s waiting for {what}")
            self.rdv.events(versions["event_seq"], timeout=min(left, 10.0), limit=1)

    def _drop_group(self) -> None:
        """Close our end: members still joining or receiving fail at once and wait for the next layout.

        Only destroying the process group (and the store) closes its sockets (gloo's shutdown does
        not), hence dropping every reference and collecting at once."""
        if self.group is not None or self._store is not None:
            if self.group is not None:
                self.group.close()
            self.group = self._store = None
            gc.collect()
        self.layout = None

    def close(self) -> None:
        self._drop_group()
