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

import xxhash

from streamrl_cli.errors import StreamRLError
from streamrl_cli.tasks import Prompt, Task
from streamrl_cli.trainer.batch import GroupCollector, Rollout
from streamrl_cli.trainer.evaluation import Evaluator
from streamrl_cli.trainer.losses import grpo_advantages
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
    algorithm: str = "grpo"
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

    @property
    def extra_groups(self) -> int:
        """Groups dispatched beyond global_batch per iteration (rollout.oversample)."""
        return math.ceil(self.global_batch * self.oversample - 1e-9) if self.oversample > 0 else 0

    @classmethod
    def from_spec(cls, spec: TrainerSpec) -> PipelineConfig:
        """The pipeline of the trainer's typed sections (the defaults above serve tests only)."""
        a, t, skew = spec.algorithm, spec.train, spec.skewness
        return cls(
            mode=a.mode, algorithm=a.name, group_size=a.group_size, global_batch=t.global_batch,
            micro_batch=t.micro_batch, world=spec.world, max_staleness=a.max_staleness,
            max_output_len=spec.task.max_output_len, temperature=a.temperature, grpo_std_norm=a.grpo_std_norm,
            seed=t.seed, dispatch=skew.dispatch, schedule=skew.schedule, long_tail=skew.long_tail,
            engine_max_seqs=spec.generator.max_num_seqs, reproducible=t.reproducible_sampling,
            sample_timeout_s=t.stall_after_s, no_generator_s=t.stall_after_s, sampling=sampling_keys(a),
            oversample=spec.rollout.oversample,
        )  # fmt: skip

    @property
    def ahead(self) -> int:
        return self.max_staleness if self.mode == "async" else 0


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
    n_groups: int = 0  # groups dispatched
    needed: int = 0  # groups the iteration trains on (n_groups less the over-sampled ones)
    done_groups: int = 0
    aborted: list[str] = field(default_factory=list)  # over-sampled groups cancelled when it closed
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
        # when the run has one, else the paper's 7B/H800 shape (skew.dispatch.default_ptl).
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
        prompts = self.sampler.next_batch(self.cfg.global_batch + extra)
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
        batch.needed = len(prompts) - extra
        batch.order = rids
        batch.dispatched_at = self.clock()
        self.batches[j] = batch
        self.svc.submit(requests)

    def _place(
        self, batch: Batch, prompts: list[Prompt], rids: list[str]
    ) -> list[tuple[int, str, int]] | None:
        """(priority, target generator, batch limit) per prompt, or None: the data plane's own policy."""
        from streamrl_cli.skew.dispatch import default_ptl, lpt_priorities, plan_dispatch, random_dispatch

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
        stream = self.cfg.mode != "baseline"
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
        j = int(sample.prompt_id.split("/", 1)[0].removeprefix("it"))
        batch = self.batches.get(j)
        if batch is None:
            log.warning("sample of unknown iteration %s dropped", sample.prompt_id)
            return
        staleness = j + self.offset - sample.weight_version
        if staleness > self.cfg.ahead:
            # Too old for this batch (a late joiner's or a re-dispatch's): generate it again.
            group = GroupCollector.key(sample)
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
        group = batch.collector.add(sample)
        for r in group:
            r.staleness, r.iteration = staleness, j
        if not self.cfg.reproducible:
            batch.ready += group
        elif group:
            # The same micro-batches, summed in the same order, run after run: the gradients, hence
            # the weights, are the same bit for bit (the order the groups finished in varies).
            batch.held[GroupCollector.key(sample)] = group
            while batch.released < len(batch.order) and batch.order[batch.released] in batch.held:
                batch.ready += batch.held.pop(batch.order[batch.released])
                batch.released += 1
        if batch.done_groups == batch.needed:
            self.gen_spans.append([batch.dispatched_at, batch.generated_at])
            if batch.needed < batch.n_groups:
                self._abort_rest(batch)

    def _abort_rest(self, batch: Batch) -> None:
        """Over-sampling: the iteration has its groups; the others are cancelled on their generators
        (late samples dropped) and their prompts drawn again first (batches drawn already, in async
        mode, carry them in their saved sampler state, so a resumed run neither loses nor repeats them)."""
        assert batch.collector is not None
        done = {GroupCollector.key(r.sample) for r in [*batch.trained, *batch.ready]}
        batch.aborted = [rid for rid in batch.order if rid not in done]
        ids = [k for k in batch.prompts if k in batch.aborted or k.split("#r", 1)[0] in batch.aborted]
        self.cancelled.update(ids)
        self.svc.cancel(ids)
        self.discarded_tokens += batch.collector.drop(batch.aborted)
        positions = self.sampler.give_back([batch.prompts[rid][0] for rid in batch.aborted])
        for later in self.batches.values():
            if later.index > batch.index:
                saved = later.sampler_state
                later.sampler_state = {**saved, "returned": [*saved.get("returned", []), *positions]}

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
        batch.done_groups += 1
        import torch

        # None ("cannot score"): the sample is not learnt from (masked out of the loss), and GRPO
        # normalises the group over the samples that were scored.
        scored = [k for k, r in enumerate(scores) if r is not None]
        rewards = [float(r) if r is not None else 0.0 for r in scores]
        adv = [0.0] * len(rewards)
        if self.cfg.algorithm == "grpo" and scored:
            group = grpo_advantages(torch.tensor([rewards[k] for k in scored]), self.cfg.grpo_std_norm)
            for k, a in zip(scored, group.tolist(), strict=True):
                adv[k] = a
        return [
            Rollout(prompt_tokens=tokens, sample=s, reward=r, advantage=a, scored=sc is not None)
            for s, r, a, sc in zip(samples, rewards, adv, scores, strict=True)
        ]

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
        return {"iteration": i, "next_iteration": i + 1, "weight_version": i + 1, "sampler": sampler}

    def _record(self, i, batch, started, end, train_spans, step_span, wait_s, stats) -> dict[str, Any]:  # noqa: ANN001
        rows = batch.trained
        # Reward statistics over scored samples (an unscored one has no reward to average).
        rewards = [r.reward for r in rows if r.scored] or [float("nan")]  # none scored: recorded as null
        lengths = sorted(r.response_len for r in rows)
        stale = [r.staleness for r in rows]
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
            "retries": batch.retries,
            "rollout/aborted_groups": len(batch.aborted),
            "rollout/aborted_prompts": [batch.prompts[rid][0].prompt_id for rid in batch.aborted],
            "rollout/discarded_tokens": self.discarded_tokens,
            # Which prompts the batch held, in order (a resumed run must repeat the same data order).
            "data/digest": xxhash.xxh64_hexdigest(
                "\n".join(p.prompt_id for k, (p, _) in batch.prompts.items() if "#r" not in k).encode()
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
        }
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
