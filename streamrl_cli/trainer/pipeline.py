"""The three pipelining modes between generation and training (docs/architecture.md), one loop.

::

    batch j's prompts ──dispatch──► generators ──samples──► GroupCollector(j) ──whole groups──► ready[j]
         ▲ (once weight version j - ahead is confirmed)                                      │
         │                                                                        micro-batches (rounds)
    publisher ◄── full_state ◄── step (one per iteration, after batch j's last sample) ◄─────┘

- **baseline**: batch j is dispatched once version j is on the generators; training starts
  after its last sample (the naive disaggregated batch mode: each side idles while the other works).
- **sync-stream**: the same dispatch, but micro-batches are trained as soon as enough whole groups
  have arrived (dynamic-batch pipelining); the step still comes after the last sample: on-policy.
- **async**: batch j is dispatched once version j - k is confirmed (k = max_staleness), so the
  generation of the next batch overlaps this one's training, and the weight transfer runs in the
  background. A sample of batch j generated with a version older than j - k (a late joiner, a
  re-dispatch) is dropped and generated again, so staleness never exceeds k.

The gradient is the same in every mode (``learner``): modes differ only in timing.
"""

from __future__ import annotations

import logging
import math
import random
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import xxhash

from streamrl_cli.errors import StreamRLError
from streamrl_cli.recipe import presets
from streamrl_cli.tasks import Prompt, Task
from streamrl_cli.trainer.algorithms import batch_whiten, estimator, informative, overlong_penalty
from streamrl_cli.trainer.batch import GroupCollector, Rollout
from streamrl_cli.trainer.dynamic_sampling import Refill
from streamrl_cli.trainer.evaluation import Evaluator
from streamrl_cli.trainer.seeds import sample_seed
from streamrl_cli.transport.wire import Request, Sample
from streamrl_cli.weights.layout import eligible

if TYPE_CHECKING:
    from streamrl_cli.recipe.schema import AlgorithmConfig
    from streamrl_cli.roles.spec import TrainerSpec

log = logging.getLogger("streamrl.trainer")

GET_POLL_S = 0.5
CATCH_UP_POLL_S = 2.0  # while no generator is connected: how often to look for newcomers waiting


class Stopped(Exception):
    """The run stopped early, as asked (`stop_requested`), after a checkpointed iteration."""

    def __init__(self, next_iteration: int):
        super().__init__(f"stopped before iteration {next_iteration}")
        self.next_iteration = next_iteration


@dataclass(kw_only=True)
class PipelineConfig:
    mode: str = "sync-stream"
    advantage: str = "grpo"  # the estimator (trainer.algorithms.ADVANTAGES)
    group_size: int = 4
    global_batch: int = 8  # prompts per iteration
    micro_batch: int = 4  # samples per micro-batch (per rank)
    world: int = 1  # trainer data-parallel ranks
    max_staleness: int = 1
    max_output_len: int = 64
    temperature: float = 1.0
    # Sampling beyond temperature (the recipe's algorithm.top_p, ...), sent with every request:
    # {"top_p": 0.9, "stop": ["\n\n"]}; only what differs from vLLM's defaults.
    sampling: dict[str, Any] = field(default_factory=dict)
    grpo_std_norm: bool = True
    overlong_buffer: int = 0  # DAPO's soft overlong punishment over this many last tokens (0: off)
    overlong_penalty: float = 1.0
    dynamic_sampling: bool = False  # DAPO: groups with all-equal rewards do not count; more are drawn
    max_refill: float = 1.0  # dynamic sampling: groups drawn per iteration at most, × global_batch
    seed: int = 0
    sample_timeout_s: float = 1800.0  # no sample at all for this long: something is wrong
    # No generator connected for this long: every one failed or left, the run cannot go on. Not at
    # once: a restarted array task, or an elastic scale-up after scaling to zero, comes back.
    no_generator_s: float = 900.0
    dispatch: str = "least-loaded"  # least-loaded (the data plane's policy), random, skewness-aware
    schedule: str = "fifo"  # fifo or lpt (longest predicted first, inside each instance)
    long_tail: float = 0.2  # α of Algorithm 2
    engine_max_seqs: int = 64  # sequences a generator's engine runs at once at most (its max_num_seqs)
    reproducible: bool = False  # seed each request from (seed, prompt id, sample index); train in batch order
    oversample: float = 0.0  # dispatch this fraction more groups; train the first global_batch to finish
    partial: bool = False  # over-sampled groups running at the close are paused and resumed, not aborted

    @property
    def refill_budget(self) -> int:
        """Groups an iteration may draw to replace dropped ones (algorithm.max_refill)."""
        return math.floor(self.global_batch * self.max_refill + 1e-9)

    @property
    def extra_groups(self) -> int:
        """Groups dispatched beyond global_batch per iteration (rollout.oversample)."""
        return math.ceil(self.global_batch * self.oversample - 1e-9) if self.oversample > 0 else 0

    @classmethod
    def from_spec(cls, spec: TrainerSpec) -> PipelineConfig:
        """The pipeline of the trainer's typed sections (the defaults above serve tests only)."""
        a, t, skew = presets.filled(spec.algorithm, spec.task.max_output_len), spec.train, spec.skewness
        return cls(
            mode=a.mode, advantage=a.advantage, group_size=a.group_size, global_batch=t.global_batch,
            micro_batch=t.micro_batch, world=spec.world, max_staleness=a.max_staleness,
            max_output_len=spec.task.max_output_len, temperature=a.temperature, grpo_std_norm=a.grpo_std_norm,
            overlong_buffer=a.overlong_buffer, overlong_penalty=a.overlong_penalty,
            dynamic_sampling=a.dynamic_sampling, max_refill=a.max_refill,
            seed=t.seed, dispatch=skew.dispatch, schedule=skew.schedule, long_tail=skew.long_tail,
            engine_max_seqs=spec.generator.max_num_seqs, reproducible=t.reproducible_sampling,
            sample_timeout_s=t.stall_after_s, no_generator_s=t.stall_after_s, sampling=sampling_keys(a),
            oversample=spec.rollout.oversample, partial=spec.rollout.partial,
        )  # fmt: skip

    @property
    def ahead(self) -> int:
        return self.max_staleness if self.mode == "async" else 0

    @property
    def bound(self) -> int:
        """The most versions a trained sample's oldest token may lag its batch's policy."""
        return self.max_staleness if self.partial else self.ahead


def sampling_keys(a: AlgorithmConfig) -> dict[str, Any]:
    """The recipe's sampling keys beyond temperature that differ from "off", as requests carry them."""
    out: dict[str, Any] = {}
    if a.top_k > 0:
        out["top_k"] = a.top_k
    if a.top_p < 1.0:
        out["top_p"] = a.top_p
    if a.min_p > 0.0:
        out["min_p"] = a.min_p
    if a.stop:
        out["stop"] = [str(x) for x in a.stop]
    return out


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


class Pipeline:
    """Rank 0's loop: dispatch prompts, receive samples, train micro-batches, step, publish."""

    def __init__(
        self,
        cfg: PipelineConfig,
        *,
        task: Task,
        sampler: Any,
        tokenize: Callable[[str], list[int]],
        detokenize: Callable[[list[int]], str],
        svc: Any,
        driver: Any,
        publisher: Any,
        on_record: Callable[[dict[str, Any]], None],
        on_checkpoint: Callable[[int, dict[str, Any], bool], None] | None = None,
        clock: Callable[[], float] = time.time,
        ranker: Any = None,
        ptl: Callable[[float], float] | None = None,
        evaluator: Evaluator | None = None,
        stop_requested: Callable[[], bool] | None = None,
    ):
        self.cfg, self.task, self.sampler = cfg, task, sampler
        self.tokenize, self.detokenize = tokenize, detokenize
        self.svc, self.driver, self.publisher = svc, driver, publisher
        self.on_record, self.on_checkpoint, self.clock = on_record, on_checkpoint, clock
        self.batches: dict[int, Batch] = {}
        self.confirmed = -1  # newest weight version every generator serves
        self._cv = threading.Condition()
        self.gen_spans: list[list[float]] = []  # [dispatched, last sample] of every batch
        self.sync_spans: list[tuple[int, float, float]] = []  # (version, start, end) of weight transfers
        self.ranker = ranker
        # Algorithm 2's decode-step time vs batch size: the profiled curve (planner.profile_file)
        # when the run has one, else the paper's 7B/H800 shape (skew.dispatch_plan.default_ptl).
        self.ptl = ptl
        self.recent_lengths: deque[int] = deque(maxlen=4096)  # for Algorithm 2's P90 / P50
        self.priority_base = 0  # LPT priorities of later batches come after earlier ones'
        self.rng = random.Random(cfg.seed)
        self._no_generator_since: float | None = None
        self._catch_up_checked = 0.0
        self.evaluator = evaluator
        self.evals_due: list[tuple[int, int]] = []  # (iteration, weight version) to evaluate once confirmed
        # Asked to end early (SLURM's warning before a time limit or preemption): looked at once per
        # iteration, before its checkpoint; that iteration is then checkpointed and the run stops.
        self.stop_requested = stop_requested
        self.stopping = False
        if cfg.oversample and cfg.reproducible:
            raise ValueError(
                "over-sampling trains the groups that finish first: not with reproducible sampling"
            )
        self.cancelled: set[str] = set()  # request ids of aborted groups: their late samples are dropped
        self.discarded_tokens = 0  # tokens of aborted groups that reached us since the last record
        # Partial rollout: paused request id -> its group; groups waiting for the next dispatch; groups
        # resumed in batches drawn already (async), which the next dispatch draws fewer prompts for.
        self.pausing: dict[str, Carried] = {}
        self.carry: list[Carried] = []
        self.carry_debt = 0
        self.resumes = 0  # request ids of resumed samples: "<group>#p<n>"

    # ---- the loop ----

    def run(self, start: int, end: int, version: int, *, push_first: bool = False) -> None:
        """Train iterations [start, end) from weight version `version` (== start). The generators
        serve it already (a fresh run: the model on disk) or get it first (`push_first`: a resumed run)."""
        # Weight versions count optimizer steps; a resumed run may have to continue above versions
        # the rendezvous already saw, hence the offset (version of batch j's policy = j + offset).
        self.version, self.end, self.next_batch, self.offset = version, end, start, version - start
        if push_first:
            self._publish(self.driver.full_state(), version)
            self._wait_transfers()
        else:
            self._versions_ready(version)
        prev_end = self.clock()
        for i in range(start, end):
            self._dispatch_due()
            record = self._iteration(i, prev_end)
            prev_end = record["timeline"]["end"]
            self.on_record(record)
            if self.on_checkpoint is not None:
                self.on_checkpoint(*self._checkpoint_due)
            if self.stopping:
                self._wait_transfers()
                raise Stopped(i + 1)
            if self.evaluator is not None and self.evaluator.due(i, end):
                self.evals_due.append((i, self.version))
                self._dispatch_due()
        self._wait_transfers()
        if self.evaluator is not None and end > start:
            self._final_eval(end - 1)

    def _final_eval(self, i: int) -> None:
        """Evaluate the last weights (every generator serves them now), and wait for every evaluation."""
        assert self.evaluator is not None
        self._dispatch_due()  # a periodic evaluation still waiting for its weights goes first
        self.svc.submit(self.evaluator.dispatch(i, final=True))
        last = self.clock()
        while self.evaluator.pending:
            sample = self.svc.get(timeout=GET_POLL_S)
            if sample is not None:
                self._route(sample)
                last = self.clock()
            elif self.clock() - last > self.cfg.sample_timeout_s:
                raise TimeoutError(f"no evaluation sample for {self.cfg.sample_timeout_s:.0f}s")

    def _dispatch_due(self) -> None:
        """Dispatch every batch whose weight version requirement is met (j - ahead <= confirmed)."""
        with self._cv:
            confirmed = self.confirmed
        while self.next_batch < self.end and self.next_batch - self.cfg.ahead + self.offset <= confirmed:
            self._dispatch(self.next_batch)
            self.next_batch += 1
        # Evaluations go out once their weights are served, after the training batch due with them.
        while self.evals_due and self.evals_due[0][1] <= confirmed:
            assert self.evaluator is not None
            i, _ = self.evals_due.pop(0)
            self.svc.submit(self.evaluator.dispatch(i))

    def _versions_ready(self, version: int) -> None:
        with self._cv:
            self.confirmed = max(self.confirmed, version)
            self._cv.notify_all()

    def _dispatch(self, j: int) -> None:
        state = self.sampler.state()
        extra = self.cfg.extra_groups
        # Paused samples that came back already go on first (their requests ahead of the fresh ones).
        while any(c.inflight for c in self.carry) and (sample := self.svc.get(timeout=0)) is not None:
            self._route(sample)
        held, self.carry = self.carry, []
        # Paused groups take the places of fresh ones (partial rollout); those resumed in a batch drawn
        # already (async) are paid back from the over-sampled share of the next draws.
        fresh = self.cfg.global_batch + extra - len(held)
        draw = max(self.cfg.global_batch - len(held), fresh - self.carry_debt)
        self.carry_debt = max(0, self.carry_debt - (fresh - draw))
        prompts = self.sampler.next_batch(draw)
        batch = Batch(index=j, prompts={}, sampler_state=state)
        batch.collector = GroupCollector(self.cfg.group_size, lambda key, s, b=batch: self._score(b, key, s))
        # A batch that spans two epochs may draw a prompt twice (the end of one permutation and the
        # start of the next): each draw is a group of its own, under its own request id.
        rids, drawn = [], {}
        for p in prompts:
            drawn[p.prompt_id] = n = drawn.get(p.prompt_id, 0) + 1
            rids.append(f"it{j}/{p.prompt_id}" + (f"~{n}" if n > 1 else ""))
        placement = self._place(batch, prompts, rids)
        requests = []
        for k, (p, rid) in enumerate(zip(prompts, rids, strict=True)):
            tokens = self.tokenize(p.text)
            batch.prompts[rid] = (p, tokens)
            req = self._request(rid, tokens, list(range(self.cfg.group_size)), seed_key=_draw(rid))
            if placement is not None:
                req.priority, req.target, req.batch_limit = placement[k]
            requests.append(req)
        batch.n_groups = len(prompts)
        batch.needed = self.cfg.global_batch
        if self.cfg.dynamic_sampling:
            budget = self.cfg.refill_budget
            batch.refill = Refill(needed=batch.needed, budget=budget, outstanding=len(prompts))
        batch.order = rids
        batch.dispatched_at = self.clock()
        self.batches[j] = batch
        for c in held:  # resumed first: they are the longest (FIFO admission takes them first)
            self._resume(c, batch)
        self.svc.submit(requests)

    def _place(
        self, batch: Batch, prompts: list[Prompt], rids: list[str]
    ) -> list[tuple[int, str, int]] | None:
        """(priority, target generator, batch limit) per prompt, or None: the data plane's own policy."""
        from streamrl_cli.skew.dispatch_plan import (
            default_ptl,
            lpt_priorities,
            plan_dispatch,
            random_dispatch,
        )

        cfg = self.cfg
        predicted = [float(x) for x in self.ranker.rank(prompts)] if self.ranker is not None else None
        if predicted is not None:
            batch.predicted = dict(zip(rids, predicted, strict=True))
        alive = self.svc.generators() if hasattr(self.svc, "generators") else []
        if cfg.dispatch == "least-loaded" and cfg.schedule == "fifo" or not alive:
            return None
        if cfg.dispatch == "skewness-aware" and predicted is not None:
            plan = plan_dispatch(
                predicted, alive, ptl=self.ptl or default_ptl(), recent_lengths=list(self.recent_lengths),
                alpha=cfg.long_tail, max_batch=cfg.engine_max_seqs, group=cfg.group_size,
            )  # fmt: skip
            batch.plan = {"split": list(plan.split), "estimated_s": plan.latency}
        else:
            plan = random_dispatch(len(prompts), alive, self.rng)
        if cfg.schedule == "lpt" and predicted is not None:
            priorities = lpt_priorities(predicted, base=self.priority_base)
        else:
            priorities = [self.priority_base] * len(prompts)  # ties: arrival order
        self.priority_base += len(prompts)
        # Every dispatch runs under the same bound in the generators' admission queues (a group is
        # admitted whole and holds its places until its longest sample ends), so that random + FIFO
        # and Algorithm 2 + LPT are compared at equal batch room; without one, LPT's order is moot.
        return [
            (priorities[k], plan.assignment[k], plan.batch_limit(k) or cfg.engine_max_seqs)
            for k in range(len(prompts))
        ]

    def _request(
        self, rid: str, tokens: list[int], indices: list[int], *, group: str = "", seed_key: str = ""
    ) -> Request:
        sampling: dict[str, Any] = {
            "temperature": self.cfg.temperature,
            "max_tokens": self.cfg.max_output_len,
            **self.cfg.sampling,
        }
        if self.cfg.reproducible:
            sampling["seed"] = sample_seed(self.cfg.seed, seed_key, indices[0])
        return Request(
            prompt_id=rid, prompt_token_ids=tokens, sample_indices=indices, group_id=group or rid,
            sampling=sampling,
        )  # fmt: skip

    def _iteration(self, i: int, started: float) -> dict[str, Any]:
        wait_s = 0.0
        while i not in self.batches:  # its weight version is still on the way to the generators
            t0 = self.clock()
            with self._cv:
                self._cv.wait(GET_POLL_S)
            wait_s += self.clock() - t0
            self._check_transfer()
            self._check_generators()
            self._dispatch_due()
        batch = self.batches[i]
        per_round = self.cfg.micro_batch * self.cfg.world
        train_spans: list[list[float]] = []
        # An estimator that normalises over the whole batch (REINFORCE++) trains after its last group.
        stream = self.cfg.mode != "baseline" and not estimator(self.cfg.advantage).whiten
        while True:
            done = batch.done_groups == batch.needed
            if not done and batch.needed < batch.n_groups:
                # Over-sampling: read what already arrived before training a round, so that the
                # batch closes (and its extra groups are cancelled) as soon as it may, not a round late.
                while batch.done_groups < batch.needed and (sample := self.svc.get(timeout=0)) is not None:
                    self._route(sample)
                done = batch.done_groups == batch.needed
            if done or (stream and len(batch.ready) > per_round):
                take = batch.ready[:per_round] if not done or len(batch.ready) > per_round else batch.ready
                batch.ready = batch.ready[len(take) :]
                batch.trained += take
                last = done and not batch.ready
                t0 = self.clock()
                mbs = [take[k : k + self.cfg.micro_batch] for k in range(0, len(take), self.cfg.micro_batch)]
                self.driver.round(mbs, last=last)
                train_spans.append([t0, self.clock()])
                if last:
                    break
                continue
            t0 = self.clock()
            sample = self.svc.get(timeout=GET_POLL_S)
            wait_s += self.clock() - t0
            if sample is not None:
                self._route(sample)
            else:
                self._check_transfer()
                self._check_generators()
            if (
                sample is None
                and self.clock() - max(batch.dispatched_at, batch.last_sample_at) > self.cfg.sample_timeout_s
            ):
                raise TimeoutError(f"no sample of iteration {i} for {self.cfg.sample_timeout_s:.0f}s")
            self._dispatch_due()
        t_step = self.clock()
        stats = self.driver.step()
        self.version = i + 1 + self.offset
        step_span = [t_step, self.clock()]
        # Every rank takes part in gathering the weights; the transfer runs in the publisher's thread.
        state = self.driver.full_state()
        if self.cfg.mode == "async":
            state = {k: v.clone() for k, v in state.items()}  # the next step must not change it mid-transfer
        self._publish(state, self.version)
        self.stopping = self.stop_requested is not None and self.stop_requested() and i + 1 < self.end
        # Saved once the iteration's record is out (see run): a process killed in between must not
        # leave a checkpoint past the last recorded iteration (resumed after it, that record is lost).
        self._checkpoint_due = (i, self._client_state(i), self.stopping)
        if self.cfg.mode != "async":
            self._wait_transfers()
        end = self.clock()
        return self._record(i, batch, started, end, train_spans, step_span, wait_s, stats)

    # ---- samples ----

    def _route(self, sample: Sample) -> None:
        if self.evaluator is not None and self.evaluator.owns(sample.prompt_id):
            self.evaluator.add(sample)
            return
        if sample.prompt_id in self.cancelled:  # an aborted group's sample, generated before the cancel came
            self.discarded_tokens += len(sample.token_ids)
            return
        paused = self.pausing.get(sample.prompt_id)
        if paused is not None:  # a paused group's sample, as far as it got
            self._came_back(paused, sample)
            return
        j = int(sample.prompt_id.split("/", 1)[0].removeprefix("it"))
        batch = self.batches.get(j)
        if batch is None:
            log.warning("sample of unknown iteration %s dropped", sample.prompt_id)
            return
        carried = batch.carried.get(GroupCollector.key(sample))
        if carried is not None and sample.sample_index in carried.prefix:  # a resumed sample: join its start
            sample = _join(carried.prefix.pop(sample.sample_index), sample)
        self._accept(batch, sample)

    def _accept(self, batch: Batch, sample: Sample) -> None:
        """A sample of `batch` (whole: a resumed one joined to its start): into its group, or generated
        again when its oldest token is past the staleness bound."""
        j = batch.index
        staleness = j + self.offset - sample.weight_version
        if staleness > self.cfg.bound:
            # Too old for this batch (a late joiner's, a re-dispatch's, one resumed once too often):
            # generate it again.
            group = GroupCollector.key(sample)
            self.discarded_tokens += len(sample.token_ids)
            batch.retries += 1
            rid = f"{group}#r{batch.retries}"
            batch.prompts[rid] = batch.prompts[group]
            prompt, tokens = batch.prompts[group]
            retry = self._request(rid, tokens, [sample.sample_index], group=group, seed_key=_draw(group))
            self.svc.submit([retry])
            return
        now = batch.last_sample_at = self.clock()
        # T_gen ends when the generator finished the sample, not when this loop read it: while a
        # micro-batch trains, arrived samples wait in the queue, and stamping them on reading made
        # T_gen track T_train whenever training was the slower stage (the elastic rule then never
        # saw idle generators). The generator's clock is bounded by what this side saw.
        done_at = min(now, max(batch.dispatched_at, sample.finished_at)) if sample.finished_at > 0 else now
        batch.generated_at = max(batch.generated_at, done_at)
        batch.done_at[(GroupCollector.key(sample), sample.sample_index)] = done_at
        if sample.first_token_at and sample.finished_at:
            batch.longest_s = max(batch.longest_s, sample.finished_at - sample.first_token_at)
        key = GroupCollector.key(sample)
        group = batch.collector.add(sample)
        for r in group:
            r.staleness, r.iteration = j + self.offset - r.sample.weight_version, j
        finished = bool(group) or key in batch.dropped  # the group is whole (trained, or dropped)
        if finished:
            batch.carried.pop(key, None)
        if not self.cfg.reproducible:
            batch.ready += group
        elif finished:
            # The same micro-batches, summed in the same order, run after run: the gradients, hence
            # the weights, are the same bit for bit (the order the groups finished in varies).
            batch.held[key] = group
            while batch.released < len(batch.order) and batch.order[batch.released] in batch.held:
                batch.ready += batch.held.pop(batch.order[batch.released])
                batch.released += 1
        if finished and batch.refill is not None and batch.done_groups < batch.needed:
            self._refill(batch)
        if batch.done_groups == batch.needed:
            self.gen_spans.append([batch.dispatched_at, batch.generated_at])
            if estimator(self.cfg.advantage).whiten:
                self._whiten(batch)
            if batch.needed < batch.n_groups and _unfinished(batch):
                # The last iteration's extra groups have no next batch to go on in: aborted.
                if self.cfg.partial and batch.index + 1 < self.end:
                    self._pause_rest(batch)
                else:
                    self._abort_rest(batch)

    # ---- dynamic sampling, batch normalisation ----

    def _refill(self, batch: Batch) -> None:
        """Dynamic sampling, after a group of `batch` finished: draw the groups that those still out
        cannot make up for, or, with none out and the budget spent, close the batch with fewer."""
        r = batch.refill
        assert r is not None
        n = r.to_draw()
        if n:
            self._draw_more(batch, n)
        elif r.complete:
            log.warning(
                "iteration %d: only %d of %d groups had rewards that differ after drawing %d more "
                "(algorithm.max_refill=%g); it trains on %s",
                batch.index, r.kept, r.needed, r.drawn, self.cfg.max_refill,
                f"{r.kept} groups" if r.kept else "the dropped groups (no group had a reward spread)",
            )  # fmt: skip
            if not r.kept:  # nothing informative at all: the dropped groups, rather than an empty batch
                batch.ready += [x for k in batch.order if k in batch.dropped for x in batch.dropped[k]]
                batch.done_groups = len(batch.dropped)
            batch.needed = batch.done_groups

    def _draw_more(self, batch: Batch, n: int) -> None:
        """Dynamic sampling: `n` more groups for `batch`, in place of dropped ones (admitted first)."""
        assert batch.refill is not None
        prompts = self.sampler.next_batch(n)
        requests = []
        for p in prompts:
            rid, k = f"it{batch.index}/{p.prompt_id}", 1
            while rid in batch.prompts:  # drawn by this batch already
                k += 1
                rid = f"it{batch.index}/{p.prompt_id}~{k}"
            tokens = self.tokenize(p.text)
            batch.prompts[rid] = (p, tokens)
            batch.order.append(rid)
            req = self._request(rid, tokens, list(range(self.cfg.group_size)), seed_key=_draw(rid))
            req.priority = -1
            requests.append(req)
        batch.n_groups += len(prompts)
        batch.refill.drew(len(prompts))
        self.svc.submit(requests)

    def _whiten(self, batch: Batch) -> None:
        """REINFORCE++: the batch's advantages normalised over all its scored tokens, once it is whole."""
        import torch

        rows = batch.ready
        lengths = torch.tensor([float(r.response_len) if r.scored else 0.0 for r in rows])
        adv = batch_whiten(torch.tensor([r.advantage for r in rows]), lengths)
        for r, a in zip(rows, adv.tolist(), strict=True):
            r.advantage = a

    def _abort_rest(self, batch: Batch) -> None:
        """Over-sampling: the iteration has its groups; the others are cancelled on their generators
        (late samples dropped) and their prompts drawn again first (batches drawn already, in async
        mode, carry them in their saved sampler state, so a resumed run neither loses nor repeats them)."""
        assert batch.collector is not None
        batch.aborted = _unfinished(batch)
        ids = [k for rid in batch.aborted for k in _request_ids(batch, rid)]
        for rid in batch.aborted:  # resumed groups (partial rollout): what they still owe goes too
            c = batch.carried.pop(rid, None)
            if c is not None:
                ids += [k for k in c.ids if self.pausing.pop(k, None) is not None]
                self.discarded_tokens += sum(len(s.token_ids) for s in c.prefix.values())
        self.cancelled.update(ids)
        self.svc.cancel(ids)
        self.discarded_tokens += batch.collector.drop(batch.aborted)
        positions = self.sampler.give_back([batch.prompts[rid][0] for rid in batch.aborted])
        for later in self.batches.values():
            if later.index > batch.index:
                saved = later.sampler_state
                later.sampler_state = {**saved, "returned": [*saved.get("returned", []), *positions]}

    # ---- partial rollout ----

    def _pause_rest(self, batch: Batch) -> None:
        """Partial rollout: the iteration has its groups; the others are paused on their generators,
        which send back each sample as far as it got, and go on in the next batch to be drawn (or,
        in async mode, in the next one, drawn already)."""
        assert batch.collector is not None
        rest = _unfinished(batch)
        later = sorted(k for k in self.batches if k > batch.index)
        groups, paused = [], []
        for rid in rest:
            c = batch.carried.pop(rid, None) or Carried(rid, *batch.prompts[rid])
            c.batch = None
            c.have.update(batch.collector.take(rid))
            ids = _request_ids(batch, rid)
            c.inflight = set(range(self.cfg.group_size)) - set(c.have)
            c.ids += ids
            self.pausing.update(dict.fromkeys(ids, c))
            groups.append(c)
            paused += ids
        self.svc.cancel(paused, keep=True)
        for c in groups:
            if later:
                self.carry_debt += 1
                self._resume(c, self.batches[later[0]])
            else:
                self.carry.append(c)
        batch.paused = rest

    def _came_back(self, c: Carried, sample: Sample) -> None:
        """A sample of a paused group, as far as it got (or whole, if it finished meanwhile)."""
        i = sample.sample_index
        if i not in c.inflight:
            return  # a copy of one already back (re-dispatched after its generator was lost)
        c.inflight.discard(i)
        if i in c.prefix:
            sample = _join(c.prefix.pop(i), sample)
        (c.prefix if sample.finish_reason == "abort" else c.have)[i] = sample
        if not c.inflight:
            for rid in c.ids:
                self.pausing.pop(rid, None)
            c.ids = []
        if c.batch is not None:
            self._go_on(c, i)

    def _resume(self, c: Carried, batch: Batch) -> None:
        """Make a paused group one of `batch`'s (under a key of that batch) and send on what it has."""
        key = f"it{batch.index}/{_draw(c.key)}"
        while key in batch.prompts:  # drawn afresh by this batch too (an epoch boundary)
            key += "~c"
        c.key, c.batch = key, batch
        batch.prompts[key] = (c.prompt, c.tokens)
        batch.order.append(key)
        batch.n_groups += 1
        if batch.refill is not None:
            batch.refill.outstanding += 1
        batch.carried[key] = c
        for i in sorted({*c.have, *c.prefix}):
            self._go_on(c, i)

    def _go_on(self, c: Carried, i: int) -> None:
        """Sample `i` of a group resumed in its batch: into the group if finished, else resumed from its
        tokens so far (from the start if they are too old to be trained in this batch)."""
        batch = c.batch
        assert batch is not None
        if i in c.have:
            self._accept(batch, msgspec.structs.replace(c.have.pop(i), group_id=c.key))
            return
        prefix = c.prefix[i]
        if batch.index + self.offset - prefix.weight_version > self.cfg.bound:
            self.discarded_tokens += len(prefix.token_ids)
            prefix = msgspec.structs.replace(prefix, token_ids=[], logprobs=[], token_versions=[])
        self.resumes += 1
        rid = f"{c.key}#p{self.resumes}"
        batch.prompts[rid] = (c.prompt, c.tokens)
        req = self._request(rid, c.tokens + list(prefix.token_ids), [i], group=c.key)
        req.sampling["max_tokens"] = self.cfg.max_output_len - len(prefix.token_ids)
        req.priority = -1  # admitted before any fresh request: begun earlier, it is likely the longest
        if not prefix.token_ids:
            del c.prefix[i]  # nothing to join: an ordinary sample from the start
        self.svc.submit([req])

    def _score(self, batch: Batch, key: str, samples: list[Sample]) -> list[Rollout]:
        prompt, tokens = batch.prompts[key]
        lengths = [len(s.token_ids) for s in samples]
        self.recent_lengths.extend(lengths)
        # A group is admitted whole and comes back when its longest sample ends: that is its
        # processing time, so it is what the ranker learns, and is judged on.
        batch.observed[key] = max(lengths)
        batch.lengths[_draw(key)] = [len(s.token_ids) for s in sorted(samples, key=lambda s: s.sample_index)]
        texts = [self.detokenize(s.token_ids) for s in samples]
        scores = self.task.reward([prompt] * len(samples), texts)
        import torch

        # None ("cannot score"): the sample is not learnt from (masked out of the loss), and the
        # group's advantages are over the samples that were scored.
        scored = [k for k, r in enumerate(scores) if r is not None]
        rewards = [float(r) if r is not None else 0.0 for r in scores]
        c = self.cfg
        shaping = [  # DAPO's overlong penalty: part of the reward the loss sees, not of reward_mean
            overlong_penalty(len(s.token_ids), c.max_output_len, c.overlong_buffer, c.overlong_penalty)
            if sc is not None
            else 0.0
            for s, sc in zip(samples, scores, strict=True)
        ]
        trained = [rewards[k] + shaping[k] for k in scored]
        adv = [0.0] * len(rewards)
        group_fn = estimator(c.advantage).group
        if group_fn is not None and scored:
            for k, a in zip(scored, group_fn(torch.tensor(trained), c.grpo_std_norm).tolist(), strict=True):
                adv[k] = a
        rollouts = [
            Rollout(prompt_tokens=tokens, sample=s, reward=r, advantage=a, scored=sc is not None, shaping=sh)
            for s, r, a, sc, sh in zip(samples, rewards, adv, scores, shaping, strict=True)
        ]
        if batch.refill is not None:
            batch.refill.finished(informative(trained))
            if not informative(trained):  # every advantage 0: it does not count toward the batch
                batch.dropped[key] = rollouts
                return []
        batch.done_groups += 1
        return rollouts

    # ---- weights ----

    def _publish(self, state: dict, version: int) -> None:
        started = self.clock()

        def confirmed(v: int) -> None:
            self.sync_spans.append((v, started, self.clock()))
            self._versions_ready(v)

        self._transfer = self.publisher.publish(state, version, then=confirmed)

    def _check_generators(self) -> None:
        """End the run, saying why, when no generator has been connected for `no_generator_s` (a
        failed one's work waits for the others; with none left it would wait for ever)."""
        generators = getattr(self.svc, "generators", None)
        if generators is None or generators():
            self._no_generator_since = None
            return
        now = self.clock()
        if self._no_generator_since is None:
            self._no_generator_since = now
            log.warning("no generator is connected: every one failed or left; waiting for one to come back")
        elif now - self._catch_up_checked >= CATCH_UP_POLL_S:
            self._catch_up_checked = now
            self._catch_up_newcomers()
        if now - self._no_generator_since > self.cfg.no_generator_s:
            raise StreamRLError(
                f"no generator left: none has been connected for {self.cfg.no_generator_s:.0f}s "
                "(train.stall_after_s); every generator failed or left, see `streamrl status` for their "
                "last errors"
            )

    def _catch_up_newcomers(self) -> None:
        """Generators that joined while none served (every one had left: scaled to zero, all lost)
        wait for weights, and no step will make a new version while nothing generates. The
        current weights go to them as the next version, unchanged (in flight, none is resent)."""
        transfer = getattr(self, "_transfer", None)
        if transfer is not None and not transfer.done():
            return
        rdv = getattr(self.publisher, "rdv", None)
        if rdv is None:
            return
        try:
            members = rdv.members("generator")
        except StreamRLError as e:  # the server away for a moment: the next check asks again
            log.warning("cannot list the generators: %s", e)
            return
        waiting = [m["member_id"] for m in eligible(members) if (m.get("weight_version") or 0) < self.version]
        if not waiting:
            return
        self.version += 1
        self.offset += 1  # batch j's policy is j + offset: the same weights under a newer number
        log.info("generators %s joined while none served: the current weights go to them as version %d",
                 waiting, self.version)  # fmt: skip
        state = self.driver.full_state()
        if self.cfg.mode == "async":
            state = {k: v.clone() for k, v in state.items()}
        self._publish(state, self.version)

    def _check_transfer(self) -> None:
        """A failed background transfer fails the run (its error, not a hang)."""
        transfer = getattr(self, "_transfer", None)
        if transfer is not None and transfer.done():
            transfer.result()

    def _wait_transfers(self) -> None:
        transfer = getattr(self, "_transfer", None)
        if transfer is not None:
            transfer.result()

    # ---- records ----

    def _client_state(self, i: int) -> dict[str, Any]:
        """What a resumed run needs: where the data of iteration i + 1 starts."""
        nxt = self.batches.get(i + 1)
        sampler = nxt.sampler_state if nxt is not None else self.sampler.state()
        # Paused groups are not saved (their tokens were generated by weights a resumed run no longer
        # has in flight): their prompts are drawn again first, from the start.
        live = [*self.carry, *(c for b in self.batches.values() if b.index > i for c in b.carried.values())]
        if live:
            back = self.sampler.positions([c.prompt for c in live])
            sampler = {**sampler, "returned": [*sampler.get("returned", []), *back]}
        return {"iteration": i, "next_iteration": i + 1, "weight_version": i + 1, "sampler": sampler}

    def _record(self, i, batch, started, end, train_spans, step_span, wait_s, stats) -> dict[str, Any]:  # noqa: ANN001
        rows = batch.trained
        # Reward statistics over scored samples (an unscored one has no reward to average).
        rewards = [r.reward for r in rows if r.scored] or [float("nan")]  # none scored: recorded as null
        lengths = sorted(r.response_len for r in rows)
        stale = [r.staleness for r in rows]
        policy = i + self.offset  # the batch's policy version (self.version is the step's already)
        token_stale = [policy - v for r in rows for v in _versions(r.sample)]
        elapsed = max(end - started, 1e-9)
        busy = sum(b - a for a, b in train_spans) + (step_span[1] - step_span[0])
        gen_busy = _covered(self.gen_spans + [[batch.dispatched_at, batch.generated_at]], started, end)
        syncs = [s for s in self.sync_spans if started <= s[2] <= end + 1e-6]
        tokens = sum(lengths)
        rec = {
            "iteration": i,
            "mode": self.cfg.mode,
            "weight_version": self.version,
            "reward_mean": statistics.fmean(rewards),
            "reward_std": statistics.pstdev(rewards),
            "reward_max": max(rewards),
            "reward/unscored": sum(not r.scored for r in rows),
            "reward_min": min(rewards),  # with reward_max: the range the plots clip the ±std band to
            "samples": len(rows),
            "tokens": tokens,
            "len/mean": tokens / len(rows),
            "len/p50": lengths[len(lengths) // 2],
            "len/p90": lengths[min(len(lengths) - 1, int(0.9 * len(lengths)))],
            "len/max": lengths[-1],
            "samples_per_s": len(rows) / elapsed,
            "tokens_per_s": tokens / elapsed,
            "t/iteration": elapsed,
            "t/generation": batch.generated_at - batch.dispatched_at,
            "t/train": busy,
            "t/longest_sample": batch.longest_s,
            "t/tail": _tail(batch, rows),
            "t/wait": wait_s,
            "t/weight_sync": sum(s[2] - s[1] for s in syncs),
            "idle/trainer": max(0.0, 1.0 - busy / elapsed),
            "idle/generator": max(0.0, 1.0 - gen_busy / elapsed),
            "staleness/mean": statistics.fmean(stale),
            "staleness/max": max(stale),
            "staleness/token_mean": statistics.fmean(token_stale) if token_stale else 0.0,
            "staleness/token_max": max(token_stale, default=0),
            "retries": batch.retries,
            "rollout/aborted_groups": len(batch.aborted),
            "rollout/aborted_prompts": [batch.prompts[rid][0].prompt_id for rid in batch.aborted],
            "rollout/discarded_tokens": self.discarded_tokens,
            "rollout/paused_groups": len(batch.paused),
            "rollout/paused_prompts": [batch.prompts[rid][0].prompt_id for rid in batch.paused],
            "rollout/resumed_samples": sum(bool(r.sample.token_versions) for r in rows),
            # Which prompts the batch held, in order (a resumed run must repeat the same data order).
            "data/digest": xxhash.xxh64_hexdigest(
                "\n".join(p.prompt_id for k, (p, _) in batch.prompts.items() if "#" not in k).encode()
            ),
            "micro_batches": len(train_spans),
            # What each prompt produced (`streamrl rank --fit` input; the benchmark's true oracle).
            "lengths/by_prompt": batch.lengths,
            "timeline": {
                "start": started,
                "end": end,
                "generation": [batch.dispatched_at, batch.generated_at],
                "train": train_spans,
                "step": step_span,
                "weight_sync": [syncs[-1][1], syncs[-1][2]] if syncs else None,
            },
            **stats,
            **self._skew_record(batch),
            **(batch.refill.record() if batch.refill is not None else {}),
        }
        if self.cfg.overlong_buffer:  # mean shaping of the scored samples trained (≤ 0)
            shaped = [r.shaping for r in rows if r.scored]
            rec["reward/overlong_penalty"] = statistics.fmean(shaped) if shaped else 0.0
        self.batches.pop(i, None)
        self.discarded_tokens = 0
        return rec

    def _skew_record(self, batch: Batch) -> dict[str, Any]:
        """Ranker quality on this batch (predicted before it learned from it), then its update."""
        out: dict[str, Any] = {}
        if batch.plan:
            out["dispatch/long_instances"], out["dispatch/regular_instances"] = batch.plan["split"]
            out["dispatch/estimated_s"] = batch.plan["estimated_s"]
        keys = [k for k in batch.observed if k in batch.predicted]
        if self.ranker is None or len(keys) < 2:
            return out
        from streamrl_cli.ranker.quality import quality

        q = quality([batch.observed[k] for k in keys], [batch.predicted[k] for k in keys])
        out.update({f"ranker/{name}": v for name, v in q.items() if name != "n"})
        self.ranker.update([batch.prompts[k][0] for k in keys], [batch.observed[k] for k in keys])
        return out


def _draw(rid: str) -> str:
    """What a request id of batch j ("it<j>/<prompt id>[~n]") drew: the task prompt id, with "~n"
    for its n-th draw in the same batch. Its sampling seed and its `lengths/by_prompt` key."""
    return rid.split("/", 1)[1]


def _unfinished(batch: Batch) -> list[str]:
    """The groups of a closed batch that it does not train (over-sampled ones still out), in order."""
    done = {GroupCollector.key(r.sample) for r in [*batch.trained, *batch.ready]} | set(batch.dropped)
    return [rid for rid in batch.order if rid not in done]


def _request_ids(batch: Batch, group: str) -> list[str]:
    """Every request id of `group` in `batch`: its own and its "#r" retries and "#p" resumptions."""
    return [k for k in batch.prompts if k.split("#", 1)[0] == group]


def _versions(sample: Sample) -> list[int]:
    """The weight version of each of a sample's tokens."""
    return list(sample.token_versions) or [sample.weight_version] * len(sample.token_ids)


def _join(start: Sample, rest: Sample) -> Sample:
    """A paused sample's tokens so far followed by what its resumption generated: one sample whose
    tokens keep their versions and behaviour log-probs (the loss's importance weights are per token)."""
    if not start.token_ids:
        return rest
    versions = _versions(start) + _versions(rest)
    return msgspec.structs.replace(
        rest, token_ids=[*start.token_ids, *rest.token_ids], logprobs=[*start.logprobs, *rest.logprobs],
        weight_version=min(versions), token_versions=versions, queued_at=start.queued_at,
        first_token_at=start.first_token_at,
    )  # fmt: skip


def _tail(batch: Batch, rows: list[Rollout]) -> float:
    """The long tail of a batch's generation, in seconds: from when ⌊90%⌋ of its trained groups were
    generated (at most all but the last) to when the last one was. Counted in groups, because a
    group's samples finish together (0 for a batch of one group)."""
    done: dict[str, float] = {}
    for r in rows:
        key = GroupCollector.key(r.sample)
        done[key] = max(done.get(key, 0.0), batch.done_at.get((key, r.sample.sample_index), 0.0))
    times = sorted(done.values())
    if len(times) < 2:
        return 0.0
    return times[-1] - times[min(math.floor(0.9 * len(times)), len(times) - 1) - 1]


def _covered(spans: list[list[float]], start: float, end: float) -> float:
    """Length of the union of `spans` clipped to [start, end]."""
    clipped = sorted((max(a, start), min(b, end)) for a, b in spans if b > start and a < end)
    total, cur_a, cur_b = 0.0, None, None
    for a, b in clipped:
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                total += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_b is not None:
        total += cur_b - cur_a
    return total
