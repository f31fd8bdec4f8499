"""The two ends of the sample stream as small interfaces, chosen by ``StreamConfig.type``.

A generator holds a :class:`SampleSender` (take requests, send samples); the trainer holds a
:class:`SampleReceiver` (dispatch requests, take samples). The engine and the trainer code see
only these, so that another transport (shared memory on one node, say) plugs in without
touching them. The receiver calls back into the trainer's logic through :class:`ReceiverHooks`
(the :class:`~streamrl_cli.transport.routing.Dispatcher` implements it); :class:`SeenSet` is
the stand-alone default that only drops duplicates.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from streamrl_cli.transport import TransportError
from streamrl_cli.transport.wire import Request, Sample

Assignments = Mapping[str, Sequence[Request]]  # generator member id -> requests to send it


@dataclass(kw_only=True)
class StreamConfig:
    """How samples travel; the same object configures both ends. Not a recipe section (#27): no
    recipe key sets these, both roles run the defaults below (tests and benchmarks set their own)."""

    type: str = "zmq"  # transport implementation (see TRANSPORTS)
    bind: str = "tcp://0.0.0.0:0"  # receiver's listen address; port 0 picks a free one
    window: int = 256  # unacknowledged samples a sender may hold; send() blocks beyond (back-pressure)
    queue: int = 1024  # received samples buffered for the trainer; beyond, the receiver stops reading
    max_batch: int = 64  # samples coalesced into one message
    # How long a sample may wait for others to share its message: each message and each wake-up of the
    # sender's I/O thread costs GIL handoffs with the engine's thread (bench/sample_stream.py: 50 ms
    # keeps streaming under 1% of a busy engine's time; 20 ms did not), and 50 ms is nothing next to
    # the seconds a sample takes to generate.
    max_delay_s: float = 0.05
    send_timeout_s: float = 600.0  # default time send() waits for window room before raising
    # Generator ids the receiver keeps a peer entry for; a hello with a new id beyond is refused
    # (a peer holding the run's token cannot grow the trainer's tables without bound).
    max_generators: int = 1024

    def __post_init__(self) -> None:
        problems = [
            f"{k} must be >= 1, got {getattr(self, k)}"
            for k in ("window", "queue", "max_batch", "max_generators")
            if getattr(self, k) < 1
        ]
        if self.max_delay_s < 0:
            problems.append(f"max_delay_s must be >= 0, got {self.max_delay_s}")
        if problems:
            raise TransportError("invalid sample stream config: " + "; ".join(problems))


class SampleSender(ABC):
    """Generator side: requests in, samples out. A sample is kept until the trainer acks it."""

    @abstractmethod
    def send(self, sample: Sample, timeout: float | None = None) -> None:
        """Queue `sample`; blocks while the window is full, raises BackpressureTimeout after `timeout`."""

    def room(self) -> int:
        """Samples that send() takes now without blocking (0 if it cannot tell)."""
        return 0

    @abstractmethod
    def requests(self, timeout: float | None = 0.0) -> list[Request]:
        """Requests dispatched to this generator since the last call (waits up to `timeout` for one)."""

    @abstractmethod
    def close(self, flush_timeout: float = 5.0) -> None:
        """Wait up to `flush_timeout` for outstanding acks, then close."""


class SampleReceiver(ABC):
    """Trainer side: requests out, samples in (each (prompt_id, sample_index) at most once)."""

    @abstractmethod
    def get(self, timeout: float | None = None) -> Sample | None:
        """The next admitted sample, or None after `timeout` seconds."""

    @abstractmethod
    def dispatch(self, generator: str, requests: Sequence[Request]) -> None:
        """Send requests to a generator (delivered reliably, also across its reconnections)."""

    @abstractmethod
    def close(self) -> None: ...


class ReceiverHooks(Protocol):
    """The trainer logic a receiver consults; called on the receiver's I/O thread."""

    def admit(self, sample: Sample) -> bool:
        """True if this is the first copy of the sample (deliver it), False to drop it."""
        ...

    def generator_joined(self, generator: str) -> Assignments:
        """A generator said hello for the first time (or again after being lost)."""
        ...

    def generator_reset(self, generator: str) -> Assignments:
        """A generator came back as a new process: what it owed must be done again."""
        ...


class SeenSet:
    """Stand-alone hooks: drop repeated (prompt_id, sample_index) keys; nothing is dispatched."""

    def __init__(self) -> None:
        self._seen: set[tuple[str, int]] = set()

    def admit(self, sample: Sample) -> bool:
        if sample.key in self._seen:
            return False
        self._seen.add(sample.key)
        return True

    def forget(self, prompt_ids: Iterable[str]) -> None:
        """Release memory of finished prompts (their late copies then pass again: forget only done ones)."""
        drop = set(prompt_ids)
        self._seen = {k for k in self._seen if k[0] not in drop}

    def generator_joined(self, generator: str) -> Assignments:
        return {}

    def generator_reset(self, generator: str) -> Assignments:
        return {}


# type -> (sender class, receiver class), imported only when chosen (pyzmq stays optional to import).
TRANSPORTS = {
    "zmq": (
        "streamrl_cli.transport.zmq_sender:ZmqSampleSender",
        "streamrl_cli.transport.zmq_receiver:ZmqSampleReceiver",
    ),
}


def _impl(kind: str, which: int) -> type:
    try:
        path = TRANSPORTS[kind][which]
    except KeyError:
        raise TransportError(
            f"unknown sample transport type {kind!r} (stream.type); valid: {', '.join(sorted(TRANSPORTS))}"
        ) from None
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def make_sender(config: StreamConfig, *, address: str, token: str, generator: str) -> SampleSender:
    """The generator's end, connected to the receiver at `address` (e.g. ``tcp://node1:29500``)."""
    return _impl(config.type, 0)(config, address=address, token=token, generator=generator)


def make_receiver(config: StreamConfig, *, token: str, hooks: ReceiverHooks | None = None) -> SampleReceiver:
    """The trainer's end, bound to ``config.bind``; its ``address`` property says where it listens."""
    return _impl(config.type, 1)(config, token=token, hooks=hooks or SeenSet())
