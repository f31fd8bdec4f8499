"""The sample stream: prompts go from the trainer to generators, finished samples come back.

Why a package of its own: stream generation (docs/architecture.md) only pays off if a sample reaches
the trainer the moment it finishes, is never lost with a dying generator, and is never trained
on twice. This package is that data plane, apart from any engine:

    trainer process                                         generator process (one per instance)
    ┌──────────────────────────────┐   requests (R) ──►   ┌───────────────────────────────┐
    │ DispatchService              │ ◄── samples (S)      │ ZmqSampleSender               │
    │  Dispatcher (policy, Ledger) │     acks (A) ──►     │  owns each sample until acked │
    │  ZmqSampleReceiver (ROUTER)  │ ◄── request acks (a) │  (DEALER, CURVE, one socket)  │
    └──────────────────────────────┘                      └───────────────────────────────┘

- ``wire``: the msgspec messages (:class:`Sample`, :class:`Request`) and frame kinds.
- ``ledger``: pure bookkeeping of which generator owes which samples (exactly-once, re-dispatch).
- ``dispatch``: load-aware policies, the thread-safe :class:`Dispatcher`, and the trainer's
  :class:`DispatchService` (dispatcher + receiver + rendezvous watcher).
- ``samples``: the small :class:`SampleSender` / :class:`SampleReceiver` interfaces and their factory.
- ``zmq_sender`` / ``zmq_receiver`` / ``zmq_common``: the ZeroMQ implementation (CURVE keys derived
  from the run's token).

See docs/data-plane.md for the wire format and the acknowledgement protocol.
"""

from __future__ import annotations

from streamrl_cli.errors import StreamRLError


class TransportError(StreamRLError):
    """The sample stream failed: unknown transport type, authentication refused, peer gone."""


class BackpressureTimeout(TransportError):
    """A sender's window of unacknowledged samples stayed full for the whole timeout."""
