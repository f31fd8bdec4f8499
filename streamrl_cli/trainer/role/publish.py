"""The trainer's side of the weight protocol: propose, transfer, wait for the generators.

Generators at the trainer's site receive from the trainer's broadcast group; generators at another
site get one copy through the relay server (``weights.relay``): the relay generator of that site
fetches it and rebroadcasts it there, on an elastic group of its own (``generator.weights``).
Either way the version is proposed through the rendezvous first (that is what makes generators
start receiving) and counts as delivered once the rendezvous makes it current.

The trainer's broadcast group is elastic (``weights.elastic``, the same source logic as a relay's):
a new group whenever the generators it can reach change, named in the proposal; sent only once
every member said it is ready; sent again once, on a new group, when a member dies mid-transfer.
Newcomers are included in the next transfer; they take no work before they loaded it
(``generator.main``).

In async mode a transfer runs in a background thread while the next iteration trains; the
tensors are copied first, so the optimizer step that follows cannot change them mid-transfer.
"""

from __future__ import annotations

import concurrent.futures
import logging
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from streamrl_cli.weights.elastic import (  # noqa: F401 - MembershipChanged: part of this module's API
    SYNC_TIMEOUT_S,
    TRANSFER_TIMEOUT_S,
    ElasticSource,
    MembershipChanged,
)

log = logging.getLogger("streamrl.trainer.publish")


class WeightPublisher(ElasticSource):
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
        relay_deltas: bool = True,
    ):
        """`relay_deltas` (transport relay): serve each version as a delta to a relay holding the one
        before (roles.generator.relay_sync); off, no delta is computed."""
        super().__init__(
            rdv, backend=backend, host=host or socket.gethostname(),
            transfer_timeout_s=transfer_timeout_s, sync_timeout_s=sync_timeout_s, retries=retries,
        )  # fmt: skip
        self.transport = transport
        self.expected_workers = generator_workers  # the recipe's; the group is sized from who is there
        self.server: Any = None
        if transport == "relay":
            from streamrl_cli.weights.relay import WeightServer

            self.server = WeightServer(token, host="0.0.0.0", delta=relay_deltas)
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
            stats = self.broadcast_version(tensors, version)
        stats["seconds"] = time.monotonic() - started
        log.info("weight version %d delivered: %s", version, stats)
        if then is not None:
            then(version)
        return stats

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._drop_group()
        if self.server is not None:
            self.server.close()
