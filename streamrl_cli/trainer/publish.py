"""The trainer's side of the weight protocol: propose, transfer, wait for every generator.

Generators at the trainer's site join the trainer's broadcast group (rank 0 here hosts its
store, formed on the first transfer); generators at another site get one copy through the
relay server (``weights.relay``), whose relay member rebroadcasts locally. Either way the
version is proposed through the rendezvous first (that is what makes generators start receiving)
and counts as delivered when the rendezvous says every generator confirmed it.

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

log = logging.getLogger("streamrl.trainer.publish")

SYNC_TIMEOUT_S = 600.0


class WeightPublisher:
    """Sends each new policy version to the generators; one transfer at a time, in order."""

    def __init__(self, rdv: Any, token: str, *, transport: str, generator_workers: int, backend: str):
        self.rdv, self.transport = rdv, transport
        self.world = 1 + generator_workers
        self.backend = backend
        self.group: Any = None
        self.server: Any = None
        self.host = socket.gethostname()
        if transport == "relay":
            from streamrl_cli.weights.relay import WeightServer

            self.server = WeightServer(token, host="0.0.0.0")
        else:
            with socket.socket() as s:  # the group's store port, published before the group exists
                s.bind(("", 0))
                self.port = s.getsockname()[1]
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weights")
        self._last: concurrent.futures.Future | None = None

    def addresses(self) -> dict[str, str]:
        """What trainer rank 0 publishes when it registers."""
        if self.server is not None:
            return {"relay": self.server.address}
        return {"weights": f"{self.host}:{self.port}"}

    def info(self) -> dict[str, Any]:
        return {"weight_group": {"world_size": self.world, "backend": self.backend}}

    def publish(
        self, tensors: Mapping[str, torch.Tensor], version: int, *, then: Callable[[int], None] | None = None
    ) -> concurrent.futures.Future:
        """Start delivering `version` (after any earlier one); `then(version)` runs once it is confirmed."""
        return self._pool.submit(self._deliver, dict(tensors), version, then)

    def _deliver(
        self, tensors: dict[str, torch.Tensor], version: int, then: Callable[[int], None] | None
    ) -> dict:
        started = time.monotonic()
        if self.server is not None:  # published before proposed: the relay fetches it at once
            stats = {"bytes": self.server.publish(version, tensors).total}
            self.rdv.propose_version(version, ["generator"])
        else:
            self.rdv.propose_version(version, ["generator"])
            from streamrl_cli.weights.broadcast import BroadcastSender, init_weight_group

            if self.group is None:  # formed once: the generators join on their first proposal
                self.group = init_weight_group(
                    f"{self.host}:{self.port}", 0, self.world, backend=self.backend, timeout_s=SYNC_TIMEOUT_S
                )
            stats = BroadcastSender(self.group).send(tensors, version)
        sent = time.monotonic()
        self.rdv.wait_for_version(version, timeout=SYNC_TIMEOUT_S)
        stats.update(
            send_s=sent - started, confirm_s=time.monotonic() - sent, seconds=time.monotonic() - started
        )
        log.info("weight version %d delivered: %s", version, stats)
        if then is not None:
            then(version)
        return stats

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.group is not None:
            self.group.close()
        if self.server is not None:
            self.server.close()
