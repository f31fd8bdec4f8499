"""A far-site generator without an inference engine, for
tests/unit/weights/test_weights_relay_elastic.py: the real
generator role (``generator.main.GeneratorRole``: rendezvous membership, sample stream, weight path,
relay election) with only the engine faked behind the same interface. Its "engine" joins the weight
group it is given (real gloo) and prints what it received.

    python tests/support/relay_peer.py SPEC RANK [--die-when-joining VERSION]

Prints ``GOT <version> <digest>`` per loaded version (digest: sum of every received value) and
``FAILED <version>`` per failed transfer. With ``--die-when-joining V`` it exits as its engine is
about to join a group for version V: after it said it is ready, before anything was sent (as a
relay: after it proposed its site's layout, while the others join).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from streamrl_cli.generator.engine import (  # noqa: E402
    EngineHealth,
    GenerationEngine,
    GenerationRequest,
    GenerationResult,
    WeightSource,
)
from streamrl_cli.generator.main import GeneratorRole  # noqa: E402
from streamrl_cli.generator.weights import RelayPath, WeightPath  # noqa: E402
from streamrl_cli.roles.entry import load_spec  # noqa: E402
from streamrl_cli.weights.broadcast import init_weight_group, receive_weights  # noqa: E402
from streamrl_cli.weights.elastic import ElasticSource  # noqa: E402

TRANSFER_TIMEOUT_S = 3.0  # the relay's: forming its group, each broadcast
SYNC_TIMEOUT_S = 20.0  # the relay's: members to be ready; the members' own group timeout


class ReceivingEngine(GenerationEngine):
    """Serves nothing; receives weights over the group like a vLLM worker does (one group kept)."""

    def __init__(self, die_when_joining: int):
        self.die_when_joining = die_when_joining
        self.group: Any = None
        self.key: tuple | None = None

    async def start(self) -> None:
        pass

    async def generate(
        self, requests: AsyncIterable[GenerationRequest] | Iterable[GenerationRequest]
    ) -> AsyncIterator[GenerationResult]:
        async for _ in requests:  # nothing is dispatched in these tests
            pass
        return
        yield

    async def update_weights(self, version: int, source: WeightSource, *, mode: str = "wait") -> dict:
        return await asyncio.to_thread(self._receive, version, source)

    def _receive(self, version: int, source: WeightSource) -> dict:
        if version == self.die_when_joining:
            os._exit(9)
        key = (source.host, source.port, source.world_size, source.first_rank)
        try:
            if key != self.key:
                if self.group is not None:
                    self.group.close()
                self.group, self.key = None, None
                self.group = init_weight_group(
                    f"{source.host}:{source.port}", source.first_rank, source.world_size,
                    backend=source.backend, timeout_s=source.timeout_s,
                )  # fmt: skip
                self.key = key
            got, tensors = receive_weights(self.group)
        except Exception as e:
            print(f"FAILED {version} {type(e).__name__}", flush=True)
            self.group, self.key = None, None
            raise
        digest = sum(float(t.double().sum()) for t in tensors.values())
        print(f"GOT {got} {digest:.6f}", flush=True)
        self.weight_version = got
        return {"version": got}

    async def pause(self, mode: str = "keep") -> None:
        pass

    async def resume(self) -> None:
        pass

    async def abort(self, request_ids: Iterable[str]) -> None:
        pass

    async def health(self) -> EngineHealth:
        return EngineHealth(ok=True, weight_version=self.weight_version, running=0, paused=False)

    async def close(self) -> None:
        if self.group is not None:
            self.group.close()


class Peer(GeneratorRole):
    def make_weights(self, token: str) -> WeightPath:
        source = ElasticSource(
            self.rdv, backend="gloo", host="127.0.0.1",
            transfer_timeout_s=TRANSFER_TIMEOUT_S, sync_timeout_s=SYNC_TIMEOUT_S,
        )  # fmt: skip
        return RelayPath(self.spec, self.rank, self.engine, self.rdv, token, source)


def main() -> None:
    spec, rank, *options = sys.argv[1:]
    die = int(options[1]) if options[:1] == ["--die-when-joining"] else -1
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    role = Peer(load_spec(spec), int(rank), engine=ReceivingEngine(die))
    sys.exit(asyncio.run(role.run()))


if __name__ == "__main__":
    main()
