"""How a generator instance gets each new weight version: from the trainer, or through the relay.

Inside the trainer's site every generator worker is a rank of the trainer's broadcast group. That
group is elastic (``weights.layout``): the trainer forms it for the generators it can reach and
names, in each version proposal, the group (store address, id) and every member's first rank.
For each proposal that names this instance (this incarnation), :meth:`WeightPath.update`

1. drains: requests in flight finish on the old weights (every sample comes from one version);
2. reports ``receiving v<version> <group id>`` at once (a heartbeat): the trainer sends only when
   every member said so, so a long drain is never mistaken for a dead member;
3. joins the group (leaving the previous one if the id changed) and receives the version.

A proposal that does not name this instance (it started after the group was planned) is skipped:
the next one will. A failed transfer is not fatal: the trainer sends the version again on a new
group; until then the engine serves the weights it has, or stays paused if the failure left them
half loaded.

At another site one copy crosses the inter-site link: generator rank 0 of that site is the
*relay* — it fetches the version from the trainer's weight server (``addresses["relay"]``;
chunked, checksummed, resumable: ``weights.relay``), then hosts its site's own broadcast group
(published as its own ``addresses["weights"]``) and broadcasts to every worker there, its own
engine's included. The other instances at that site receive from the relay exactly as they did
from a trainer before groups were elastic: proposals without a layout, a group formed once, rank
0 the source and instance r's workers at ranks ``1 + r * tp ...`` (:func:`weight_source`).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import Any

from streamrl_cli.errors import StreamRLError
from streamrl_cli.generator.engine import GenerationEngine, WeightSource
from streamrl_cli.launch.plan import RoleSpec
from streamrl_cli.weights.layout import GroupLayout, receiving_state

log = logging.getLogger("streamrl.generator.weights")

NOT_PUBLISHED_WAIT_S = 60.0  # a relay asking for a version the trainer has not published yet


def weight_source(spec: RoleSpec, rank: int, source: dict[str, Any]) -> WeightSource:
    """Where this instance's workers join `source`'s fixed broadcast group (`source`: a member record);
    for proposals without a layout (the relay's group)."""
    address = source.get("addresses", {}).get("weights")
    if not address:
        raise StreamRLError(
            f"{source.get('member_id')} published no weight group address (addresses.weights); "
            "it must register one before weights are proposed"
        )
    host, _, port = address.rpartition(":")
    group = source.get("info", {}).get("weight_group", {})
    tp = int(spec.settings.get("tensor_parallel", 1))
    gpus = int(spec.settings.get("gpus_per_instance", 1))
    return WeightSource(
        host=host,
        port=int(port),
        world_size=int(group.get("world_size", 1 + spec.world * tp)),
        first_rank=1 + rank * tp,
        backend=group.get("backend", "nccl" if gpus > 0 else "gloo"),
    )


class WeightPath:
    """Weights from the trainer's own broadcast group (generators at the trainer's site)."""

    source_role, source_rank = "trainer", 0

    def __init__(self, spec: RoleSpec, rank: int, engine: GenerationEngine, rdv: Any):
        self.spec, self.rank, self.engine, self.rdv = spec, rank, engine, rdv
        self.member_id = f"generator-{rank}"

    def addresses(self) -> dict[str, str]:
        """What this instance publishes when it registers."""
        return {}

    def concerns_us(self, proposal: dict[str, Any]) -> bool:
        """Whether we take part in this proposal's transfer (always, for one without a layout)."""
        layout = GroupLayout.from_proposal(proposal)
        return layout is None or layout.source(self.member_id, self.rdv.incarnation) is not None

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
        await self.engine.pause(mode="wait")  # drain first: the trainer's send timeout must not see it
        try:
            self.rdv.set_status(state=receiving_state(version, layout.group))
            await asyncio.to_thread(self.rdv.heartbeat)  # now, not at the next beat: everyone waits for it
        except BaseException:
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


class RelayMemberPath(WeightPath):
    """At a far site: weights from the relay's broadcast group (generator rank 0 of the site)."""

    source_role, source_rank = "generator", 0


class RelayPath(WeightPath):
    """At a far site, generator rank 0: fetch across sites, then be the site's broadcast source."""

    def __init__(self, spec: RoleSpec, rank: int, engine: GenerationEngine, rdv: Any, token: str):
        super().__init__(spec, rank, engine, rdv)
        self.token = token
        self.host = socket.gethostname()
        with socket.socket() as s:  # the group's store port, published before the group exists
            s.bind(("", 0))
            self.port = s.getsockname()[1]
        self.group: Any = None

    def addresses(self) -> dict[str, str]:
        return {"weights": f"{self.host}:{self.port}"}

    async def update(self, version: int, proposal: dict[str, Any] | None = None) -> dict[str, Any]:
        trainer = await asyncio.to_thread(self._trainer)
        fetched = await asyncio.to_thread(self._fetch, trainer["addresses"]["relay"], version)
        me = {"member_id": f"generator-{self.rank}", "addresses": self.addresses(), "info": {}}
        source = weight_source(self.spec, self.rank, me)
        # Our own workers are ranks of the group we host: send and receive run together.
        send = asyncio.create_task(
            asyncio.to_thread(self._broadcast, source, fetched.tensors, fetched.version)
        )
        try:
            stats = await self.engine.update_weights(fetched.version, source)
        finally:
            sent = await send
        return {**stats, "relay": {**fetched.stats, "broadcast": sent}}

    def close(self) -> None:
        if self.group is not None:
            self.group.close()

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
                return fetch_weights(address, self.token, version=version)
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

    def _broadcast(self, source: WeightSource, tensors: dict, version: int) -> dict[str, float]:
        from streamrl_cli.weights.broadcast import BroadcastSender, init_weight_group

        if self.group is None:
            self.group = init_weight_group(
                f"{self.host}:{self.port}",
                0,
                source.world_size,
                backend=source.backend,
                timeout_s=source.timeout_s,
            )
        return BroadcastSender(self.group).send(tensors, version)


def make_weight_path(spec: RoleSpec, rank: int, engine: GenerationEngine, rdv: Any, token: str) -> WeightPath:
    """The path for this instance: the trainer's group, the relay role, or the relay's group."""
    if spec.weight_transport == "broadcast":
        return WeightPath(spec, rank, engine, rdv)
    if spec.weight_transport == "relay":
        return (
            RelayPath(spec, rank, engine, rdv, token)
            if rank == 0
            else RelayMemberPath(spec, rank, engine, rdv)
        )
    raise StreamRLError(f"generator: unknown weight transport {spec.weight_transport!r} (broadcast or relay)")
