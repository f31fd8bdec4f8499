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
class Planned:
    """What the loop asked the generators for, for this batch: written when it is dispatched
    (``trainer.loop.pipeline``) and changed after only by the router: new requests for it (refills
    under dynamic sampling, retries of stale samples, groups resumed from the batch before), and
    fewer groups `needed` when dynamic sampling gives up drawing."""

    index: int
    sampler_state: dict[str, Any]  # the sampler's position before drawing this batch
    # Every request id of the batch (its groups, their "#r" retries and "#p" resumptions) ->
    # (task prompt, prompt tokens).
    prompts: dict[str, tuple[Prompt, list[int]]] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)  # group keys in the batch's order
    n_groups: int = 0  # groups dispatched
    needed: int = 0  # groups the iteration trains on (n_groups less the over-sampled ones)
    dispatched_at: float = 0.0
    refill: Refill | None = None  # dynamic sampling's bookkeeping (None: off)
    retries: int = 0  # stale samples asked for again
    predicted: dict[str, float] = field(default_factory=dict)  # request prompt id -> predicted length
    decision: dict[str, Any] = field(default_factory=dict)  # the skewness-aware dispatch, for the record


@dataclass
class Arrived:
    """What came back for the batch and where it is now: the router (``trainer.loop.sample_routing``)
    writes it as samples arrive; the loop takes whole groups off ``ready`` to train (``take``)."""

    collector: GroupCollector | None = None
    ready: list[Rollout] = field(default_factory=list)  # whole groups not yet trained on
    # Reproducible runs train the groups in the batch's own order, not as they finish: a group that
    # finished early waits here (group key -> rollouts) until those before it are in `ready`.
    held: dict[str, list[Rollout]] = field(default_factory=dict)
    released: int = 0  # groups of the batch's order moved to `ready`
    trained: list[Rollout] = field(default_factory=list)
    done_groups: int = 0  # groups scored that count toward the batch
    dropped: dict[str, list[Rollout]] = field(default_factory=dict)  # dynamic sampling: no reward spread
    aborted: list[str] = field(default_factory=list)  # over-sampled groups cancelled when it closed
    paused: list[str] = field(default_factory=list)  # over-sampled groups paused when it closed
    carried: dict[str, Carried] = field(default_factory=dict)  # group key -> a group resumed in this batch
    last_sample_at: float = 0.0  # when the trainer last read one of its samples (progress)
    generated_at: float = 0.0  # when generation finished its last sample so far (T_gen's end)
    # When each sample's generation finished, by (group key, sample index): the tail time.
    done_at: dict[tuple[str, int], float] = field(default_factory=dict)
    # The longest sample's own decoding (first token to finish): more instances won't shorten it.
    longest_s: float = 0.0
    observed: dict[str, float] = field(default_factory=dict)  # request prompt id -> longest output
    # request prompt id -> (model turns, model tokens) of each of its trajectories (multi-turn only)
    turns: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    lengths: dict[str, list[int]] = field(default_factory=dict)  # task prompt id -> lengths by sample index

    def stamp(self, sample: Sample, now: float, dispatched_at: float) -> None:
        """The times of a sample read `now`. T_gen ends when the generator finished the sample, not
        when the loop read it: while a micro-batch trains, arrived samples wait in the queue, and
        stamping them on reading made T_gen track T_train whenever training was the slower stage (the
        elastic rule then never saw idle generators). The generator's clock is bounded by what this
        side saw."""
        self.last_sample_at = now
        done_at = min(now, max(dispatched_at, sample.finished_at)) if sample.finished_at > 0 else now
        self.generated_at = max(self.generated_at, done_at)
        self.done_at[(GroupCollector.key(sample), sample.sample_index)] = done_at
        if sample.first_token_at and sample.finished_at:
            self.longest_s = max(self.longest_s, sample.finished_at - sample.first_token_at)

    def release_in_order(self, key: str, group: list[Rollout], order: list[str]) -> None:
        """Reproducible runs: a whole group waits until every group before it in the batch's `order`
        is ready, so the same micro-batches, summed in the same order, run after run (the order the
        groups finish in varies; the gradients, hence the weights, are the same bit for bit)."""
        self.held[key] = group
        while self.released < len(order) and order[self.released] in self.held:
            self.ready += self.held.pop(order[self.released])
            self.released += 1

    def take(self, n: int) -> list[Rollout]:
        """The next (at most) `n` ready rollouts, counted as trained from now on."""
        take, self.ready = self.ready[:n], self.ready[n:]
        self.trained += take
        return take


@dataclass(eq=False)
class Batch:
    """An iteration's batch in flight: what was asked for it (``planned``) and what came back
    (``arrived``)."""

    planned: Planned
    arrived: Arrived = field(default_factory=Arrived)

    @classmethod
    def new(cls, index: int, sampler_state: dict[str, Any]) -> Batch:
        return cls(Planned(index=index, sampler_state=sampler_state))

    @property
    def index(self) -> int:
        return self.planned.index

    @property
    def whole(self) -> bool:
        """It has every group it trains on (scored, or dropped and given up on)."""
        return self.arrived.done_groups == self.planned.needed


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
