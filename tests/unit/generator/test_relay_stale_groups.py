"""A far-site generator neither joins nor sends on a weight group that is already given up.

Cases around a relay's failover (generator.weights.RelayPath): a member does not follow a layout
whose relay is lost or left (its store went with it); a relay's own engine does not join a group
its sender dropped before the engine got to it (a failed try); a generator that follows another
relay's group drops the one it hosted as relay before (its engine left it: were it the relay
again, a send on it would fail). Joining a dropped group would find the store gone, which the
join's own connect bound ends (tests/unit/weights/test_weights_broadcast.py), but the version comes
on another group: there is nothing to wait for. A fake rendezvous (its member and version views),
a fake engine that records its joins and a fake sender stand in; the fetch goes to a real
WeightServer on loopback.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from typing import Any

import pytest
import torch
from support.weights_relay import CHUNK, TOKEN

from streamrl_cli.generator.engine import WeightSource
from streamrl_cli.generator.weights import RelayPath
from streamrl_cli.recipe.schema import GeneratorConfig
from streamrl_cli.roles.spec import GeneratorSpec
from streamrl_cli.weights.layout import GroupLayout
from streamrl_cli.weights.relay import WeightServer


def generator(rank: int, state: str = "alive") -> dict[str, Any]:
    return {"member_id": f"generator-{rank}", "role": "generator", "rank": rank, "state": state,
            "incarnation": 1, "reported_state": "generating"}  # fmt: skip


class Rendezvous:
    """What RelayPath reads of the rendezvous: members, pending versions; what it reports, dropped."""

    incarnation = 1

    def __init__(self, members: list[dict[str, Any]], trainer: dict[str, Any] | None = None):
        self.generators, self.trainer = members, trainer
        self.pending: list[dict[str, Any]] = []

    def members(self, role: str) -> list[dict[str, Any]]:
        return self.generators if role == "generator" else [self.trainer] if self.trainer else []

    def versions(self) -> dict[str, Any]:
        return {"current": None, "pending": self.pending}

    def set_status(self, **_: Any) -> None:
        pass

    def heartbeat(self) -> None:
        pass


def proposal(version: int, group: str, source: str, port: int, members: list[str]) -> dict[str, Any]:
    layout = GroupLayout(
        group=group, address=f"127.0.0.1:{port}", world_size=1 + len(members), backend="gloo",
        timeout_s=600.0, ranks={m: 1 + i for i, m in enumerate(members)},
        incarnations=dict.fromkeys(members, 1),
    )  # fmt: skip
    return {"version": version, "required_roles": ["generator"], "members": layout.incarnations,
            "transfer": {**layout.doc(), "source": source}}  # fmt: skip


def relay_path(rank: int, rdv: Rendezvous, engine: Any = None, source: Any = None) -> RelayPath:
    spec = GeneratorSpec(
        run_name="stale", run_dir="/nowhere", role="generator", cluster="far", site="far", world=2,
        expected={"trainer": 1, "generator": 2}, program="streamrl_cli.generator.main:main",
        weight_transport="relay", rendezvous_file="/nowhere/rendezvous.json", secret_file="/nowhere/secret",
        settings=GeneratorConfig(cluster="far", relay_sync="full"),
    )  # fmt: skip
    return RelayPath(spec, rank, engine=engine, rdv=rdv, token=TOKEN, source=source or object())


def test_a_member_does_not_follow_a_layout_whose_relay_is_gone():
    rdv = Rendezvous([generator(0), generator(1)])
    ours = relay_path(1, rdv)
    p = proposal(3, "aaaa0001", "generator-0", 1, ["generator-0", "generator-1"])
    rdv.pending = [p]
    assert ours.concerns_us(p)  # its relay at work: join
    rdv.generators = [generator(0, "lost"), generator(1)]
    assert not ours.concerns_us(p)  # its relay lost: its store went with it; we relay it next
    rdv.generators = [generator(1)]  # left (or released)
    assert not ours.concerns_us(p)


class RecordingEngine:
    """Joins nothing: records the world size of every group it is told to join, and says when it
    took a group of `until` ranks."""

    live_swap, weight_version = True, 0

    def __init__(self, until: int) -> None:
        self.until, self.joined, self.took = until, [], threading.Event()

    async def update_weights(self, version: int, source: WeightSource) -> dict:
        self.joined.append(source.world_size)
        if source.world_size == self.until:
            self.took.set()
        return {"version": version, "bytes": 0}


class DroppingSender:
    """An ElasticSource whose first try failed: it proposed group `given_up`, dropped it and proposed
    `kept`, and our engine learns of both only now (as when it was busy). It returns once our engine
    took the kept group."""

    def __init__(self, given_up: dict[str, Any], kept: dict[str, Any], engine: RecordingEngine):
        self.given_up, self.kept, self.engine = given_up, kept, engine
        self.layout: GroupLayout | None = None

    def broadcast_version(self, tensors: dict, version: int, *, on_proposed: Any, **_: Any) -> dict:
        self.layout = GroupLayout.from_proposal(self.kept)  # the given-up group is dropped already
        on_proposed(self.given_up)
        on_proposed(self.kept)
        assert self.engine.took.wait(60), "our engine never took the kept group"
        return {"members": 1, "attempts": 2}


@pytest.fixture
def server():
    srv = WeightServer(TOKEN, host="127.0.0.1", chunk_bytes=CHUNK, checksum="crc32")
    srv.publish(1, {"w": torch.ones(8)})
    yield srv
    srv.close()


def test_the_relays_own_engine_does_not_join_a_group_its_sender_gave_up(server):
    # Both layouts name a store that listens (as the given-up one did when it was proposed): only the
    # sender's own state says which group is given up. Given up: 3 ranks; kept: 2.
    with socket.create_server(("127.0.0.1", 0)) as store:
        port = store.getsockname()[1]
        trainer = {
            "member_id": "trainer-0",
            "rank": 0,
            "state": "alive",
            "addresses": {"relay": server.address},
        }
        rdv = Rendezvous([generator(0), generator(1)], trainer)
        given_up = proposal(1, "aaaa0001", "generator-0", port, ["generator-0", "generator-1"])
        kept = proposal(1, "aaaa0002", "generator-0", port, ["generator-0"])
        engine = RecordingEngine(until=2)
        relay = relay_path(0, rdv, engine, DroppingSender(given_up, kept, engine))
        stats = asyncio.run(
            asyncio.wait_for(relay.update(1, {"version": 1, "required_roles": ["generator"]}), 60)
        )
    assert engine.joined == [2], engine.joined
    assert stats["version"] == 1 and stats["relay"]["broadcast"]["attempts"] == 2, stats


class HostingSender:
    """The ElasticSource of a generator that was the relay: it still hosts its group until closed."""

    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


def test_a_generator_that_follows_another_relays_group_drops_the_group_it_hosted():
    with socket.create_server(("127.0.0.1", 0)) as store:
        rdv = Rendezvous([generator(0), generator(1)])
        engine, ours, port = RecordingEngine(until=3), HostingSender(), store.getsockname()[1]
        theirs = proposal(2, "aaaa0003", "generator-0", port, ["generator-0", "generator-1"])
        rdv.pending = [theirs]
        relay = relay_path(1, rdv, engine, ours)  # the relay until generator-0 came up
        asyncio.run(asyncio.wait_for(relay.update(2, theirs), 60))  # liveness bound
    assert engine.joined == [3] and ours.closed
