"""Who is in a weight broadcast group, at which ranks: what makes the broadcast path elastic.

Why: a torch.distributed group has a fixed world. Formed once for every generator, it hangs the
next broadcast when one of them dies, and a generator that starts later (a restarted SLURM array
task, one more task for elastic scale-out) can never join it. So the trainer forms the group for
the generators it can reach *now*, re-forms it whenever that set changes, and says with every
version proposal who is in the group at which ranks (the proposal's ``transfer`` document and its
``members``, rendezvous API). Pure functions over rendezvous member records: no sockets, no torch.

Protocol of one transfer of version v (trainer: ``trainer.role.publish``; generators:
``generator.weights``, ``generator.main``)::

    trainer                                         generator (each one named in the layout)
    eligible = alive, past start-up, same incarnation
    new group? -> host a new store (new port, new id)
    propose(v, members={id: incarnation}, transfer=layout) ──► drain in-flight requests, then report
                                                                state "receiving v<v> <group id>"
    wait until every member reports it  ◄──────────────────── (a member lost / re-registered meanwhile:
                                                                abandon, re-plan: nothing was sent)
    form the group (new one only), broadcast v ─────────────► join (leave the old group first), receive
    wait until v is current  ◄────────────────────────────── load, confirm v

The rendezvous makes v current once every member it was sent to, still alive as that
incarnation, confirmed it; newcomers do not hold it up. They get the next version: the trainer
does not keep the current one's tensors (in sync mode they are the live parameters), and a
newcomer takes no work before it loaded a version (it reports ``WAITING`` until then).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

STARTING = "starting"  # a generator's state until its engine is up and it follows proposals
WAITING = "waiting for weights"  # up, but serves no version of this run yet: takes no work


@dataclass(frozen=True, kw_only=True)
class GroupLayout:
    """One formed group: rank 0 is the source; each member's workers take consecutive ranks."""

    group: str  # id of this formation (random): another id means leave the old group, join this one
    address: str  # host:port of rank 0's store
    world_size: int
    backend: str  # gloo | nccl
    timeout_s: float  # the members' group timeout: covers waiting for the slowest member to drain
    ranks: dict[str, int]  # member_id -> group rank of its first worker
    incarnations: dict[str, int]  # member_id -> the incarnation the rank is for

    def doc(self) -> dict[str, Any]:
        """The proposal's ``transfer`` document (incarnations travel as the proposal's ``members``)."""
        return {
            "group": self.group,
            "address": self.address,
            "world_size": self.world_size,
            "backend": self.backend,
            "timeout_s": self.timeout_s,
            "ranks": dict(self.ranks),
        }

    @classmethod
    def from_proposal(cls, data: Mapping[str, Any]) -> GroupLayout | None:
        """The layout a ``version_proposed`` event (or pending version) carries; None if it has none."""
        doc = data.get("transfer")
        if not doc or "group" not in doc:
            return None
        return cls(
            group=str(doc["group"]),
            address=str(doc["address"]),
            world_size=int(doc["world_size"]),
            backend=str(doc["backend"]),
            timeout_s=float(doc["timeout_s"]),
            ranks={k: int(v) for k, v in doc["ranks"].items()},
            incarnations={k: int(v) for k, v in (data.get("members") or {}).items()},
        )

    def source(self, member_id: str, incarnation: int) -> dict[str, Any] | None:
        """Where `member_id` (as `incarnation`) joins, as WeightSource fields; None: not its group."""
        if member_id not in self.ranks or self.incarnations.get(member_id) != incarnation:
            return None
        host, _, port = self.address.rpartition(":")
        return {
            "host": host,
            "port": int(port),
            "world_size": self.world_size,
            "first_rank": self.ranks[member_id],
            "backend": self.backend,
            "timeout_s": self.timeout_s,
        }

    def membership(self) -> tuple[tuple[str, int, int], ...]:
        """(member_id, incarnation, workers) of every member, sorted: equal means same group."""
        order = sorted(self.ranks, key=self.ranks.get)
        ends = [self.ranks[m] for m in order[1:]] + [self.world_size]
        return tuple(
            sorted((m, self.incarnations[m], e - self.ranks[m]) for m, e in zip(order, ends, strict=True))
        )


def workers(member: Mapping[str, Any]) -> int:
    """Ranks a generator takes in the group: one per worker (its tensor-parallel size)."""
    return int(member.get("info", {}).get("workers", 1))


def eligible(members: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Members a transfer can go to: alive and past start-up (they follow proposals), by rank."""
    up = [
        dict(m) for m in members if m["state"] == "alive" and m.get("reported_state") not in (None, STARTING)
    ]
    return sorted(up, key=lambda m: (m["role"], m["rank"]))


def membership(members: Iterable[Mapping[str, Any]]) -> tuple[tuple[str, int, int], ...]:
    """(member_id, incarnation, workers) of member records, sorted: compare with a layout's."""
    return tuple(sorted((m["member_id"], int(m["incarnation"]), workers(m)) for m in members))


def plan_layout(
    members: Iterable[Mapping[str, Any]], *, group: str, address: str, backend: str, timeout_s: float
) -> GroupLayout:
    """Rank 0 for the source; then each member's workers, members in (role, rank) order."""
    ranks, incarnations, nxt = {}, {}, 1
    for m in sorted(members, key=lambda m: (m["role"], m["rank"])):
        ranks[m["member_id"]], incarnations[m["member_id"]] = nxt, int(m["incarnation"])
        nxt += workers(m)
    if not ranks:
        raise ValueError("a weight group needs at least one member besides its source")
    return GroupLayout(
        group=group, address=address, world_size=nxt, backend=backend, timeout_s=timeout_s,
        ranks=ranks, incarnations=incarnations,
    )  # fmt: skip


def receiving_state(version: int, group: str) -> str:
    """What a member reports once drained and about to join/receive (rendezvous state, <= 64 chars)."""
    return f"receiving v{version} {group}"


def check_ready(
    layout: GroupLayout, members: Iterable[Mapping[str, Any]], version: int
) -> tuple[bool, str | None]:
    """(every member of `layout` reports it is ready for `version`, why the layout no longer holds).

    The layout breaks when one of its members is lost, left, or re-registered (a new process):
    nothing has been sent yet, so the trainer re-plans at no cost.
    """
    by_id = {m["member_id"]: m for m in members}
    want = receiving_state(version, layout.group)
    ready = True
    for mid, incarnation in layout.incarnations.items():
        m = by_id.get(mid)
        if m is None or m["state"] != "alive" or int(m["incarnation"]) != incarnation:
            why = "gone" if m is None else m["state"] if m["state"] != "alive" else "restarted"
            return False, f"{mid} {why}"
        ready = ready and m.get("reported_state") == want
    return ready, None


def alive_members(layout: GroupLayout, members: Iterable[Mapping[str, Any]]) -> list[str]:
    """Members of `layout` still alive as the incarnation it was formed for."""
    by_id = {m["member_id"]: m for m in members}
    return [
        mid
        for mid, inc in layout.incarnations.items()
        if (m := by_id.get(mid)) and m["state"] == "alive" and int(m["incarnation"]) == inc
    ]
