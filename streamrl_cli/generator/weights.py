"""How a generator instance gets each new weight version: from the trainer, or through the relay.

Inside the trainer's site every generator worker is a rank of the trainer's broadcast group. That
group is elastic (``weights.layout``): the trainer forms it for the generators it can reach and
names, in each version proposal, the group (store address, id) and every member's first rank.
For each proposal that names this instance (this incarnation), :meth:`WeightPath.update`

1. drains: requests in flight finish on the old weights (every sample comes from one version);
   an engine serving LoRA adapters (``model.lora.sync: adapter``) does not: it loads the new
   adapter beside the old, and requests in flight keep theirs;
2. reports ``receiving v<version> <group id>`` at once (a heartbeat): the trainer sends only when
   every member said so, so a long drain is never mistaken for a dead member;
3. joins the group (leaving the previous one if the id changed) and receives the version.

A proposal that does not name this instance (it started after the group was planned) is skipped:
the next one will. A failed transfer is not fatal: the trainer sends the version again on a new
group; until then the engine serves the weights it has, or stays paused if the failure left them
half loaded.

At another site one copy crosses the inter-site link: the site's *relay* — its lowest-ranked
generator past start-up, elected anew from the rendezvous' view whenever it is asked — fetches the
version from the trainer's weight server (``addresses["relay"]``; chunked, checksummed, resumable:
``weights.relay``) and is then the source of its site's elastic group (``weights.elastic``, the
trainer's own logic): it re-proposes the trainer's pending version with its site's layout, and the
other instances follow that layout exactly as above; its own engine's workers are ranks of the
group it hosts. The relay keeps the last version it fetched (bit for bit, in CPU memory: one copy
of the model, and a second while the next one is received) so that the next fetch brings only the
difference (``roles.generator.relay_sync: delta``; ``weights.relay_fetch``). A member dying
mid-transfer: the relay re-plans and sends once more; a late joiner is in the next version's
group. When the relay is lost or leaves, the next lowest-ranked generator takes over: on that event
(or at its own start) it delivers the newest pending version, unless a live relay already proposed
it (``source`` in the proposal's transfer document); a version pending when the relay died goes
only to the members that have not confirmed it. A relay that takes over holds no version to
start from: its first fetch is whole.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import Any

from streamrl_cli.errors import StreamRLError
from streamrl_cli.generator.engine import GenerationEngine, WeightSource
from streamrl_cli.roles.spec import GeneratorSpec
from streamrl_cli.weights.broadcast import process_backend
from streamrl_cli.weights.elastic import ElasticSource
from streamrl_cli.weights.layout import GroupLayout, eligible, receiving_state

log = logging.getLogger("streamrl.generator.weights")

NOT_PUBLISHED_WAIT_S = 60.0  # a relay asking for a version the trainer has not published yet


def weight_source(spec: GeneratorSpec, rank: int, source: dict[str, Any]) -> WeightSource:
    """Where this instance's workers join `source`'s fixed broadcast group (`source`: a member record);
    for proposals without a layout (a trainer that hosts one fixed group)."""
    address = source.get("addresses", {}).get("weights")
    if not address:
        raise StreamRLError(
            f"{source.get('member_id')} published no weight group address (addresses.weights); "
            "it must register one before weights are proposed"
        )
    host, _, port = address.rpartition(":")
    group = source.get("info", {}).get("weight_group", {})
    tp = spec.settings.tensor_parallel
    return WeightSource(
        host=host,
        port=int(port),
        world_size=int(group.get("world_size", 1 + spec.world * tp)),
        first_rank=1 + rank * tp,
        backend=group.get("backend") or process_backend(),
    )


def _store_listening(host: str, port: int) -> None:
    """Fail now if the group's source is gone (dropped the group, or died: what a relay's failover is
    about), before handing the join to the engine. Not a guarantee: the store can go between this check
    and the workers' connect, which has a bound of its own for that (``JOIN_CONNECT_TIMEOUT_S``)."""
    try:
        socket.create_connection((host, port), timeout=5.0).close()
    except OSError as e:
        raise StreamRLError(f"the weight group's store at {host}:{port} is gone: {e}") from None


class WeightPath:
    """Weights from the trainer's own broadcast group (generators at the trainer's site)."""

    source_role, source_rank = "trainer", 0

    def __init__(self, spec: GeneratorSpec, rank: int, engine: GenerationEngine, rdv: Any):
        self.spec, self.rank, self.engine, self.rdv = spec, rank, engine, rdv
        self.member_id = f"generator-{rank}"

    def addresses(self) -> dict[str, str]:
        """What this instance publishes when it registers."""
        return {}

    def concerns_us(self, proposal: dict[str, Any]) -> bool:
        """Whether we take part in this proposal's transfer (always, for one without a layout)."""
        layout = GroupLayout.from_proposal(proposal)
        return layout is None or layout.source(self.member_id, self.rdv.incarnation) is not None

    def takes_part(self, proposal: dict[str, Any]) -> bool:
        """Whether `update` runs even when the engine serves the version already (a group member takes
        its rank), its failure then not being fatal (the source sends it again)."""
        return GroupLayout.from_proposal(proposal) is not None

    def orphaned(self) -> dict[str, Any] | None:
        """A pending version this instance must deliver itself, as a proposal (after a loss, at start)."""
        return None

    async def update(self, version: int, proposal: dict[str, Any] | None = None) -> dict[str, Any]:
        """Receive `version` (or newer, if the source moved on) into the engine; returns its stats.
        `proposal`: the ``version_proposed`` event's data, whose layout says where to join."""
        layout = GroupLayout.from_proposal(proposal or {})
        if layout is None:
            source = await asyncio.to_thread(self._source_member)
            return await self.engine.update_weights(version, weight_source(self.spec, self.rank, source))
        place = layout.source(self.member_id, self.rdv.incarnation)
        if place is None:
            raise StreamRLError(f"{self.member_id} is not a member of weight group {layout.group}")
        # Drain first: the trainer's send timeout must not see it. An engine that loads a version
        # beside the one in use (LoRA adapters) has nothing to drain: it keeps generating.
        drain = not self.engine.live_swap
        if drain:
            await self.engine.pause(mode="wait")
        try:
            self.rdv.set_status(state=receiving_state(version, layout.group))
            await asyncio.to_thread(self.rdv.heartbeat)  # now, not at the next beat: everyone waits for it
            await asyncio.to_thread(_store_listening, place["host"], place["port"])
        except BaseException:
            if drain:
                await self.engine.resume()
            raise
        return await self.engine.update_weights(version, WeightSource(**place))  # resumes the engine

    def close(self) -> None:
        pass

    def _source_member(self) -> dict[str, Any]:
        """The current record of the group's source (it may have re-registered with a new address)."""
        for m in self.rdv.members(self.source_role):
            if m["rank"] == self.source_rank and m["state"] == "alive":
                return m
        raise StreamRLError(f"the weight source {self.source_role}-{self.source_rank} is not alive")


class RelayPath(WeightPath):
    """At a far site: follow the site's relay's layouts, or be the relay (fetch across, then the source)."""

    def __init__(
        self,
        spec: GeneratorSpec,
        rank: int,
        engine: GenerationEngine,
        rdv: Any,
        token: str,
        source: ElasticSource | None = None,
    ):
        super().__init__(spec, rank, engine, rdv)
        self.token = token
        # What we send with while we are the relay (tests pass one with short timeouts). The backend
        # follows what this process has (CUDA or not), whatever the recipe's GPU count says.
        self.source = source or ElasticSource(rdv, backend=process_backend(), host=socket.gethostname())
        self._own: set[str] = set()  # groups we proposed: those proposals come back to us as events
        self.deltas = spec.settings.relay_sync == "delta"
        self._held: Any = None  # the last version fetched (relay_fetch.Fetched): the next delta's base
        self._spare: Any = None  # the buffer of the version before it, received into next

    def relay_id(self, members: list[dict[str, Any]]) -> str | None:
        """The site's relay: its lowest-ranked generator past start-up (every member computes the same)."""
        up = eligible(m for m in members if m["role"] == "generator")
        return up[0]["member_id"] if up else None

    def concerns_us(self, proposal: dict[str, Any]) -> bool:
        layout = GroupLayout.from_proposal(proposal)
        if layout is None:  # the trainer's proposal: the relay's to deliver
            return self.relay_id(self.rdv.members("generator")) == self.member_id
        if layout.group in self._own or layout.source(self.member_id, self.rdv.incarnation) is None:
            return False
        # Only the latest layout of a version: an older one's group was given up already.
        pending = {p["version"]: p for p in self.rdv.versions()["pending"]}.get(proposal["version"])
        latest = GroupLayout.from_proposal(pending) if pending else None
        if latest is None or latest.group != layout.group:
            return False
        # Nor one whose relay is lost or left already: its group went with it (the next relay, maybe
        # we, sends the version again on a group of its own).
        source = (proposal.get("transfer") or {}).get("source")
        return source is None or source in {m["member_id"] for m in eligible(self.rdv.members("generator"))}

    def takes_part(self, proposal: dict[str, Any]) -> bool:
        return True  # a relay delivers to the others even when its own engine has the version

    def orphaned(self) -> dict[str, Any] | None:
        """The newest pending version if we are the relay and no live relay sends it (ours died)."""
        members = self.rdv.members("generator")
        if self.relay_id(members) != self.member_id:
            return None
        pending = [p for p in self.rdv.versions()["pending"] if "generator" in p["required_roles"]]
        if not pending:
            return None
        newest = max(pending, key=lambda p: p["version"])
        source = (newest.get("transfer") or {}).get("source")
        if source is not None and (
            source == self.member_id or source in {m["member_id"] for m in eligible(members)}
        ):
            return None  # ours (done or under way), or a live relay's
        log.info(
            "%s: taking over as relay for version %d (from %s)", self.member_id, newest["version"], source
        )
        return {"version": newest["version"], "required_roles": newest["required_roles"]}

    async def update(self, version: int, proposal: dict[str, Any] | None = None) -> dict[str, Any]:
        if GroupLayout.from_proposal(proposal or {}) is not None:
            # A member of another relay's group: not the relay now. Our engine leaves the group we
            # hosted for theirs, so should we be the relay again, a send on it would fail (and cost
            # the version a retry after a wait for a membership change that never comes): drop it.
            self._held = self._spare = None
            self.source.close()
            return await super().update(version, proposal)
        trainer = await asyncio.to_thread(self._trainer)
        fetched = await asyncio.to_thread(self._fetch, trainer["addresses"]["relay"], version)
        loop = asyncio.get_running_loop()
        ours: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

        def proposed(p: dict[str, Any]) -> None:  # in the sender's thread
            layout = GroupLayout.from_proposal(p)
            self._own.add(layout.group)
            if layout.source(self.member_id, self.rdv.incarnation) is not None:
                loop.call_soon_threadsafe(ours.put_nowait, p)

        # Our own workers are ranks of the group we host: for each layout that names us, they
        # receive while the sender sends; a failed try is sent again on a new group.
        send = asyncio.create_task(
            asyncio.to_thread(
                self.source.broadcast_version,
                fetched.tensors,
                version,
                sent_as=fetched.version,
                confirm=False,
                on_proposed=proposed,
            )
        )
        stats: dict[str, Any] = {}
        while True:
            nxt = asyncio.create_task(ours.get())
            await asyncio.wait({send, nxt}, return_when=asyncio.FIRST_COMPLETED)
            if not nxt.done():
                nxt.cancel()
                break
            layout = GroupLayout.from_proposal(nxt.result())
            if self.source.layout is None or self.source.layout.group != layout.group:
                # Our sender gave that group up (a failed try) before our engine got to it: its store
                # is gone; the try on a new group comes next.
                log.info("%s: our own group %s is given up already; not joining it", self.member_id,
                         layout.group)  # fmt: skip
                continue
            try:
                stats = await super().update(version, nxt.result())
            except Exception as e:  # noqa: BLE001 - the sender fails too and tries a new group
                log.warning("%s: our own engine missed version %d: %s", self.member_id, version, e)
        sent = send.result()  # raises when every try failed
        return {**stats, "relay": {**fetched.stats, "broadcast": sent}}

    def close(self) -> None:
        self.source.close()

    def _trainer(self) -> dict[str, Any]:
        for m in self.rdv.members("trainer"):
            if m["rank"] == 0 and m["state"] == "alive" and m.get("addresses", {}).get("relay"):
                return m
        raise StreamRLError("trainer rank 0 is not alive or published no relay address (addresses.relay)")

    def _fetch(self, address: str, version: int) -> Any:
        from streamrl_cli.weights.relay import VersionSuperseded, fetch_weights

        deadline = time.monotonic() + NOT_PUBLISHED_WAIT_S
        while True:
            try:
                fetched = fetch_weights(
                    address, self.token, version=version, base=self._held, delta=self.deltas, out=self._spare
                )
            except VersionSuperseded as e:
                if e.current > version:  # the trainer moved on: relay the newer one (members accept it)
                    log.info("relay: version %d superseded by %d", version, e.current)
                    version = e.current
                elif time.monotonic() > deadline:
                    raise StreamRLError(
                        f"relay: the trainer proposed version {version} but its weight server still "
                        f"serves {e.current} after {NOT_PUBLISHED_WAIT_S:.0f}s"
                    ) from None
                else:
                    time.sleep(0.2)  # proposed before published: it comes
                continue
            if self.deltas:  # the tensors it broadcasts next are only read: it stays the next base
                self._spare = self._held.buffer if self._held is not None else None
                self._held = fetched
            return fetched


def make_weight_path(
    spec: GeneratorSpec, rank: int, engine: GenerationEngine, rdv: Any, token: str
) -> WeightPath:
    """The path for this instance: the trainer's group, or its site's relay (which may become us)."""
    if spec.weight_transport == "broadcast":
        return WeightPath(spec, rank, engine, rdv)
    if spec.weight_transport == "relay":
        return RelayPath(spec, rank, engine, rdv, token)
    raise StreamRLError(f"generator: unknown weight transport {spec.weight_transport!r} (broadcast or relay)")
