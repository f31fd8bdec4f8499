"""An iteration's batch while it is in flight: what the loop dispatched for it and what has come
back (``Batch``), and a group paused when its batch closed on its way to the next (``Carried``).

Its own module so that what reads a batch (``trainer.loop.iteration_record``, ``trainer.loop.sample_routing``)
does not import what drives it (``trainer.loop.pipeline``)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from streamrl_cli.tasks import Prompt
from streamrl_cli.trainer.loop.batch import GroupCollector, Rollout
from streamrl_cli.trainer.loop.dynamic_sampling import Refill
from streamrl_cli.transport.wire import Sample


@dataclass
class Batch:
    index: int
    prompts: dict[str, tuple[Prompt, list[int]]]  # request prompt id -> (task prompt, tokens)
    sampler_state: dict[str, Any]  # the sampler's position before drawing this batch
    dispatched_at: float = 0.0
    last_sample_at: float = 0.0  # when the trainer last read one of its samples (progress)
    generated_at: float = 0.0  # when generation finished its last sample so far (T_gen's end)
    collector: GroupCollector | None = None
    ready: list[Rollout] = field(default_factory=list)  # whole groups not yet trained on
    # Reproducible runs train the groups in the batch's own order, not as they finish: a group that
    # finished early waits here (group key -> rollouts) until those before it are in `ready`.
    held: dict[str, list[Rollout]] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)  # group keys in the batch's order
    released: int = 0  # groups of `order` moved to `ready`
    trained: list[Rollout] = field(default_factory=list)
    # Dynamic sampling: the iteration's bookkeeping, and the groups dropped (all rewards equal) by key.
    refill: Refill | None = None
    dropped: dict[str, list[Rollout]] = field(default_factory=dict)
    n_groups: int = 0  # groups dispatched
    needed: int = 0  # groups the iteration trains on (n_groups less the over-sampled ones)
    done_groups: int = 0
    aborted: list[str] = field(default_factory=list)  # over-sampled groups cancelled when it closed
    carried: dict[str, Carried] = field(default_factory=dict)  # group key -> a group resumed in this batch
    # Over-sampled groups paused when it closed (partial rollout).
    paused: list[str] = field(default_factory=list)
    # When each sample's generation finished, by (group key, sample index): the tail time.
    done_at: dict[tuple[str, int], float] = field(default_factory=dict)
    retries: int = 0
    predicted: dict[str, float] = field(default_factory=dict)  # request prompt id -> predicted length
    observed: dict[str, float] = field(default_factory=dict)  # request prompt id -> longest output
    # request prompt id -> (model turns, model tokens) of each of its trajectories (multi-turn only)
    turns: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    lengths: dict[str, list[int]] = field(default_factory=dict)  # task prompt id -> lengths by sample index
    plan: dict[str, Any] = field(default_factory=dict)  # the dispatch decision, for the record
    longest_s: float = (
        0.0  # the longest sample's own decoding (first token to finish): more instances won't shorten it
    )


@dataclass(eq=False)
class Carried:
    """A group paused when its iteration closed (partial rollout), on its way to the next batch.

    Its samples are in three places: finished ones (`have`), ones paused with the tokens they had
    (`prefix`: resumed by a request whose prompt is the prompt plus those tokens), and ones whose
    paused copy is still on its way back (`inflight`, under the request ids in `ids`). Once in a
    batch (`batch`), every sample that comes back goes on at once; the group trains when whole.
    """

    key: str  # its group key in the batch it is in (or was paused in)
    prompt: Prompt
    tokens: list[int]
    have: dict[int, Sample] = field(default_factory=dict)
    prefix: dict[int, Sample] = field(default_factory=dict)
    inflight: set[int] = field(default_factory=set)
    ids: list[str] = field(default_factory=list)  # paused request ids whose samples are still owed
    batch: Batch | None = None


@dataclass
class LoopState:
    """What the loop (``pipeline``) and its sample router (``sample_routing``) both read: the batches
    in flight and where the run is. The loop writes it; the router reads it and fills the batches."""

    batches: dict[int, Batch] = field(default_factory=dict)
    offset: int = 0  # batch j's policy is weight version j + offset
    end: int = 0  # the iteration the run ends before
    gen_spans: list[list[float]] = field(default_factory=list)  # [dispatched, last sample] of every batch
    recent_lengths: deque[int] = field(default_factory=lambda: deque(maxlen=4096))  # Algorithm 2's P90/P50
