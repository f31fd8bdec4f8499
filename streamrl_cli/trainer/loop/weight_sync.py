"""The loop's side of weight publishing: the one transfer in flight, and when each one ran.

The publisher (``trainer.role.publish``) delivers versions in order in its own thread and hands back a
future per version. The loop must look at the newest one between samples (a failed transfer fails
the run, with its error, rather than leaving it waiting for a version that never comes), wait for
it before a synchronous step or the end, and know whether one is still running (a newcomer is not
sent the same weights twice). ``Transfers`` keeps that future, so no one else has to, and the
(version, start, end) span of every confirmed transfer for the records' ``t/weight_sync``.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from streamrl_cli.errors import StreamRLError
from streamrl_cli.weights.layout import eligible

if TYPE_CHECKING:
    import torch

    from streamrl_cli.trainer.loop.collaborators import WeightPublisher

log = logging.getLogger("streamrl.trainer")


class Transfers:
    """Weight versions on their way to the generators, through `publisher`."""

    def __init__(
        self, publisher: WeightPublisher, clock: Callable[[], float], on_confirmed: Callable[[int], None]
    ):
        self.publisher, self.clock, self.on_confirmed = publisher, clock, on_confirmed
        self.spans: list[tuple[int, float, float]] = []  # (version, start, end) of confirmed transfers
        self._inflight: concurrent.futures.Future | None = None  # the newest transfer started

    def publish(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Start delivering `version` (after the one in flight); `on_confirmed(version)` once current."""
        started = self.clock()

        def confirmed(v: int) -> None:
            self.spans.append((v, started, self.clock()))
            self.on_confirmed(v)

        self._inflight = self.publisher.publish(state, version, then=confirmed)

    def busy(self) -> bool:
        """A transfer is still running."""
        return self._inflight is not None and not self._inflight.done()

    def check(self) -> None:
        """A failed transfer fails the run (its error, not a hang); a running one is left alone."""
        if self._inflight is not None and self._inflight.done():
            self._inflight.result()

    def wait(self) -> None:
        """Until the newest transfer is done (its error, if it failed)."""
        if self._inflight is not None:
            self._inflight.result()

    def waiting_for(self, version: int) -> list[str]:
        """Generators registered and waiting for weights older than `version` (newcomers); none when
        the publisher has no rendezvous, or it cannot be asked just now (the next check asks again)."""
        rdv = self.publisher.rdv
        if rdv is None:
            return []
        try:
            members = rdv.members("generator")
        except StreamRLError as e:  # the server away for a moment
            log.warning("cannot list the generators: %s", e)
            return []
        return [m["member_id"] for m in eligible(members) if (m.get("weight_version") or 0) < version]
