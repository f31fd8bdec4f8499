"""The trainer's side of the weight protocol: propose, transfer, wait for the generators.

Generators at the trainer's site receive from the trainer's broadcast group; generators at another
site get one copy through the relay server (``weights.relay``), whose relay member rebroadcasts
locally. Either way the version is proposed through the rendezvous first (that is what makes
generators start receiving) and counts as delivered once the rendezvous makes it current.

The broadcast group is elastic (protocol: ``weights.layout``): before each transfer the trainer
compares the generators it can reach now (alive, past start-up; a restarted one is a new
incarnation) with the group it has; when they differ it forms a new group for exactly them and
says so in the proposal. It sends only once every member reported it is drained and ready, so a
member that dies before that costs nothing but a re-plan, and one that dies during the transfer
fails it within `transfer_timeout_s` (not the minutes a drain may take); the version is then sent
again once, on a new group of the members still there. Newcomers are included in the next
transfer; they take no work before they loaded it (``generator.main``).

In async mode a transfer runs in a background thread while the next iteration trains; the
tensors are copied first, so the optimizer step that follows cannot change them mid-transfer.
"""

from __future__ import annotations

import concurrent.futures
import gc
import logging
import secrets
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from streamrl_cli.weights import WeightTransferError
from streamrl_cli.weights.layout import (
    GroupLayout,
    alive_members,
    check_ready,
    eligible,
    membership,
    plan_layout,
    workers,
)

log = logging.getLogger("streamrl.trainer.publish")

SYNC_TIMEOUT_S = 600.0  # for the generators: to drain and say they are ready, to load and confirm
TRANSFER_TIMEOUT_S = 60.0  # forming the group and each broadcast, once all are ready: a dead member's cost


class MembershipChanged(WeightTransferError):
    """A member of the group was lost, left or restarted before the transfer completed."""


class WeightPublisher:
    """Sends each new policy version to the generators; one transfer at a time, in order."""

    def __init__(
        self,
        rdv: Any,
        token: str,
        *,
        transport: str,
        generator_workers: int,
        backend: str,
        host: str | None = None,
        transfer_timeout_s: float = TRANSFER_TIMEOUT_S,
        sync_timeout_s: float = SYNC_TIMEOUT_S,
        retries: int = 1,
    ):
        self.rdv, self.transport, self.backend = rdv, transport, backend
        self.expected_workers = generator_workers  # the recipe's; the group is sized from who is there
        self.host = host or socket.gethostname()  # the name generators reach us by (the store prefix)
        self.transfer_timeout_s, self.sync_timeout_s = transfer_timeout_s, sync_timeout_s
        self.retries = retries  # sends of a version again, each on a new group, before the run fails
        self.layout: GroupLayout | None = None  # the group planned last; formed once `group` is set
        self.group: Any = None
        self._store: Any = None  # the layout's store, hosted before the group forms
        self.server: Any = None
        if transport == "relay":
            from streamrl_cli.weights.relay import WeightServer

            self.server = WeightServer(token, host="0.0.0.0")
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weights")

    def addresses(self) -> dict[str, str]:
        """What trainer rank 0 publishes when it registers (broadcast groups go with each proposal)."""
        return {"relay": self.server.address} if self.server is not None else {}

    def info(self) -> dict[str, Any]:
        return {"weight_group": {"backend": self.backend, "elastic": True}}

    def publish(
        self, tensors: Mapping[str, torch.Tensor], version: int, *, then: Callable[[int], None] | None = None
    ) -> concurrent.futures.Future:
        """Start delivering `version` (after any earlier one); `then(version)` runs once it is current."""
        return self._pool.submit(self._deliver, dict(tensors), version, then)

    def _deliver(
        self, tensors: dict[str, torch.Tensor], version: int, then: Callable[[int], None] | None
    ) -> dict:
        started = time.monotonic()
        if self.server is not None:  # published before proposed: the relay fetches it at once
            stats = {"bytes": self.server.publish(version, tensors).total}
            self.rdv.propose_version(version, ["generator"])
            self.rdv.wait_for_version(version, timeout=self.sync_timeout_s)
        else:
            stats = self._broadcast(tensors, version)
        stats["seconds"] = time.monotonic() - started
        log.info("weight version %d delivered: %s", version, stats)
        if then is not None:
            then(version)
        return stats

    # ---- the elastic broadcast ----

    def _broadcast(self, tensors: dict[str, torch.Tensor], version: int) -> dict:
        attempts = 1 + self.retries
        for attempt in range(1, attempts + 1):
            try:
                return {**self._attempt(tensors, version, new_group=attempt > 1), "attempts": attempt}
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

    def _attempt(self, tensors: dict[str, torch.Tensor], version: int, *, new_group: bool) -> dict:
        t0 = time.monotonic()
        members = self._until(lambda ms, vs: self._recipients(ms, vs, version), self.sync_timeout_s,
                              f"a generator to send version {version} to")  # fmt: skip
        if members == "confirmed":  # every member still there has it already (a retry after a late loss)
            return self._confirmed(version, t0, t0, {})
        layout = self.layout
        if new_group or layout is None or layout.membership() != membership(members):
            layout = self._plan(members)
        self.rdv.propose_version(version, ["generator"], members=layout.incarnations, transfer=layout.doc())
        self._until(lambda ms, _vs: self._ready(layout, ms, version), self.sync_timeout_s,
                    f"generators {sorted(layout.ranks)} to be ready for version {version}")  # fmt: skip
        from streamrl_cli.weights.broadcast import BroadcastSender, init_weight_group

        t1 = time.monotonic()
        if self.group is None:
            self.group = init_weight_group(
                layout.address, 0, layout.world_size, backend=self.backend,
                timeout_s=self.transfer_timeout_s, store=self._store,
            )  # fmt: skip
        try:
            sent = BroadcastSender(self.group).send(tensors, version)
        except RuntimeError as e:  # gloo/NCCL: a member died or hangs
            raise WeightTransferError(f"broadcast on group {layout.group} failed: {e}") from None
        stats = {"bytes": sent["bytes"], "members": len(layout.ranks), "group": layout.group}
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
        self.layout = plan_layout(
            members, group=secrets.token_hex(4), address=f"{self.host}:{self._store.port}",
            backend=self.backend, timeout_s=self.sync_timeout_s,
        )  # fmt: skip
        log.info("weight group %s: %s (world %d)", self.layout.group, self.layout.ranks, world)
        return self.layout

    # ---- conditions on the rendezvous' view (None: not yet) ----

    @staticmethod
    def _recipients(members: list[dict], versions: dict, version: int) -> list[dict] | str | None:
        """Who gets `version`: every eligible generator, less those that confirmed it already."""
        pending = {p["version"]: p for p in versions["pending"]}.get(version)
        done = set(pending["confirmed"]) if pending else set()
        todo = [m for m in eligible(members) if m["member_id"] not in done]
        if todo:
            return todo
        return "confirmed" if done and any(m["member_id"] in done for m in eligible(members)) else None

    @staticmethod
    def _ready(layout: GroupLayout, members: list[dict], version: int) -> bool | None:
        ready, broken = check_ready(layout, members, version)
        if broken:
            raise MembershipChanged(f"{broken} before version {version} was sent")
        return ready or None

    @staticmethod
    def _current(members: list[dict], versions: dict, version: int) -> bool | None:
        # The rendezvous needs only members of the layout still alive; if none is, nobody will confirm.
        if versions["current"] is not None and versions["current"] >= version:
            return True
        layouts = [GroupLayout.from_proposal(p) for p in versions["pending"] if p["version"] == version]
        if layouts and layouts[0] is not None and not alive_members(layouts[0], members):
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
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._drop_group()
        if self.server is not None:
            self.server.close()
