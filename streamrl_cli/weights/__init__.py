"""Weight transfer from the trainer to the generators: the other half of the data plane.

Why a package of its own: in asynchronous RL the transfer overlaps training, but in synchronous
RL it sits on the critical path of every iteration, and across sites it crosses the slowest link
of the run (docs/architecture.md). Two paths, one per distance:

    trainer rank 0 ──broadcast (gloo/NCCL)──► every generator worker of its site
          │
          └──relay (TCP, chunked, checksummed)──► relay member at the far site
                                                    └──broadcast──► that site's workers

- ``plan``: pure planning (per-dtype buckets, stream layout, the chunk state machine).
- ``broadcast``: a torch.distributed group (compatible with vLLM's stateless groups) and the
  bucketed broadcast over it.
- ``layout``: who is in a broadcast group at which ranks, re-planned as generators come and go
  (pure; the trainer's ``WeightPublisher`` and the generators' ``WeightPath`` use it).
- ``relay_wire`` / ``relay`` / ``relay_fetch``: the cross-site protocol, its server (trainer) and
  fetcher (relay); ``relay_gate``: who may connect; ``relay_delta``: a version as its difference
  from the one before (pure), so that only what changed crosses sites.

Nothing here imports torch at package import time; the modules do.
"""

from streamrl_cli.errors import StreamRLError


class WeightTransferError(StreamRLError):
    """A weight transfer failed: group set-up, broken protocol, authentication, corrupted data."""
