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

This module is the loop itself: when a batch is dispatched and where its groups are placed, the
micro-batch rounds and the step, the checkpoint state. Where each sample goes (its group, a retry,
an aborted or paused group) is ``trainer.loop.sample_routing``; what an iteration records is
``trainer.loop.iteration_record``; what it runs by is ``trainer.loop.loop_config``; a batch in flight is
``trainer.loop.batch_state``; the weight transfer in flight is ``trainer.loop.weight_sync``; request ids
are ``trainer.loop.request_id``; the parts the loop drives are typed in ``trainer.loop.collaborators``.
"""

from __future__ import annotations

import functools
import logging
import random
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from streamrl_cli.errors import StreamRLError
from streamrl_cli.tasks import Prompt, Task
from streamrl_cli.trainer.algo.advantages import estimator
from streamrl_cli.trainer.loop.batch import GroupCollector, by_tokens
from streamrl_cli.trainer.loop.batch_state import LoopState
from streamrl_cli.trainer.loop.dynamic_sampling import Refill
from streamrl_cli.trainer.loop.evaluation import Evaluator
from streamrl_cli.trainer.loop.iteration_record import iteration_record
from streamrl_cli.trainer.loop.loop_config import PipelineConfig
from streamrl_cli.trainer.loop.request_id import RequestId
from streamrl_cli.trainer.loop.sample_routing import Batch, SampleRouter, draw_key
from streamrl_cli.trainer.loop.seeds import sample_seed  # noqa: F401 - re-exported for tests
from streamrl_cli.trainer.loop.weight_sync import Transfers

if TYPE_CHECKING:
    from streamrl_cli.trainer.loop.collaborators import (
        LearnerDriver,
        LengthRanker,
        PromptSource,
        SampleService,
        WeightPublisher,
    )

log = logging.getLogger("streamrl.trainer")

GET_POLL_S = 0.5
CATCH_UP_POLL_S = 2.0  # while no generator is connected: how often to look for newcomers waiting


class Stopped(Exception):
    """The run stopped early, as asked (`stop_requested`), after a checkpointed iteration."""

    def __init__(self, next_iteration: int):
        super().__init__(f"stopped before iteration {next_iteration}")
        self.next_iteration = next_iteration


class Pipeline:
    """Rank 0's loop: dispatch prompts, receive samples, train micro-batches, step, publish."""

    def __init__(
        self,
        cfg: PipelineConfig,
        *,
        task: Task,
        sampler: PromptSource,
        tokenize: Callable[[str], list[int]],
        detokenize: Callable[[list[int]], str],
        svc: SampleService,
        driver: LearnerDriver,
        publisher: WeightPublisher,
        on_record: Callable[[dict[str, Any]], None],
        on_checkpoint: Callable[[int, dict[str, Any], bool], None] | None = None,
        clock: Callable[[], float] = time.time,
        ranker: LengthRanker | None = None,
        ptl: Callable[[float], float] | None = None,
        evaluator: Evaluator | None = None,
        stop_requested: Callable[[], bool] | None = None,
    ):
        self.cfg, self.task, self.sampler = cfg, task, sampler
        self.tokenize, self.detokenize = tokenize, detokenize
        self.svc, self.driver = svc, driver
        self.transfers = Transfers(publisher, clock, self._versions_ready)
        self.on_record, self.on_checkpoint, self.clock = on_record, on_checkpoint, clock
        self.state = LoopState()  # the batches in flight and where the run is, shared with the router
        self.confirmed = -1  # newest weight version every generator serves
        self._cv = threading.Condition()
        self.ranker = ranker
        # Algorithm 2's decode-step time vs batch size: the profiled curve (planner.profile_file)
        # when the run has one, else the paper's 7B/H800 shape (skew.dispatch_plan.default_ptl).
        self.ptl = ptl
        self.priority_base = 0  # LPT priorities of later batches come after earlier ones'
        self.rng = random.Random(cfg.train.seed)
        self._no_generator_since: float | None = None
        self._catch_up_checked = 0.0
        self.evaluator = evaluator
        self.evals_due: list[tuple[int, int]] = []  # (iteration, weight version) to evaluate once confirmed
        # Asked to end early (SLURM's warning before a time limit or preemption): looked at once per
        # iteration, before its checkpoint; that iteration is then checkpointed and the run stops.
        self.stop_requested = stop_requested
        self.stopping = False
        if cfg.rollout.oversample and cfg.train.reproducible_sampling:
            raise ValueError(
                "over-sampling trains the groups that finish first: not with reproducible sampling"
            )
        self.router = SampleRouter(
            cfg, self.state, task=task, sampler=sampler, svc=svc, tokenize=tokenize, detokenize=detokenize,
            clock=clock, evaluator=evaluator,
        )  # fmt: skip

    # ---- the loop ----

    def run(self, start: int, end: int, version: int, *, push_first: bool = False) -> None:
        """Train iterations [start, end) from weight version `version` (== start). The generators
        serve it already (a fresh run: the model on disk) or get it first (`push_first`: a resumed run)."""
        # Weight versions count optimizer steps; a resumed run may have to continue above versions
        # the rendezvous already saw, hence the offset (version of batch j's policy = j + offset).
        self.version, self.state.end, self.next_batch, self.state.offset = (
            version,
            end,
            start,
            version - start,
        )
        if push_first:
            self.transfers.publish(self.driver.full_state(), version)
            self.transfers.wait()
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
                self.transfers.wait()
                raise Stopped(i + 1)
            if self.evaluator is not None and self.evaluator.due(i, end):
                self.evals_due.append((i, self.version))
                self._dispatch_due()
        self.transfers.wait()
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
                self.router.route(sample)
                last = self.clock()
            elif self.clock() - last > self.cfg.sample_timeout_s:
                raise TimeoutError(f"no evaluation sample for {self.cfg.sample_timeout_s:.0f}s")

    def _dispatch_due(self) -> None:
        """Dispatch every batch whose weight version requirement is met (j - ahead <= confirmed)."""
        with self._cv:
            confirmed = self.confirmed
        while (
            self.next_batch < self.state.end
            and self.next_batch - self.cfg.ahead + self.state.offset <= confirmed
        ):
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
        while any(c.inflight for c in self.router.carry) and (sample := self.svc.get(timeout=0)) is not None:
            self.router.route(sample)
        held, self.router.carry = self.router.carry, []
        # Paused groups take the places of fresh ones (partial rollout); those resumed in a batch drawn
        # already (async) are paid back from the over-sampled share of the next draws.
        fresh = self.cfg.train.global_batch + extra - len(held)
        draw = max(self.cfg.train.global_batch - len(held), fresh - self.router.carry_debt)
        self.router.carry_debt = max(0, self.router.carry_debt - (fresh - draw))
        prompts = self.sampler.next_batch(draw)
        batch = Batch.new(j, state)
        planned = batch.planned
        group_size = self.cfg.algorithm.group_size
        batch.arrived.collector = GroupCollector(
            group_size, lambda key, s, b=batch: self.router.score(b, key, s)
        )
        # A batch that spans two epochs may draw a prompt twice (the end of one permutation and the
        # start of the next): each draw is a group of its own, under its own request id.
        rids, drawn = [], {}
        for p in prompts:
            drawn[p.prompt_id] = n = drawn.get(p.prompt_id, 0) + 1
            rids.append(str(RequestId(iteration=j, prompt_id=p.prompt_id, draw=n)))
        placement = self._place(batch, prompts, rids)
        requests = []
        for k, (p, rid) in enumerate(zip(prompts, rids, strict=True)):
            tokens = self.tokenize(p.text)
            planned.prompts[rid] = (p, tokens)
            req = self.router.request(rid, p, tokens, list(range(group_size)), seed_key=draw_key(rid))
            if placement is not None:
                req.priority, req.target, req.batch_limit = placement[k]
            requests.append(req)
        planned.n_groups = len(prompts)
        planned.needed = self.cfg.train.global_batch
        if self.cfg.algorithm.dynamic_sampling:
            budget = self.cfg.refill_budget
            planned.refill = Refill(needed=planned.needed, budget=budget, outstanding=len(prompts))
        planned.order = rids
        planned.dispatched_at = self.clock()
        self.state.batches[j] = batch
        for c in held:  # resumed first: they are the longest (FIFO admission takes them first)
            self.router.resume(c, batch)
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
            batch.planned.predicted = dict(zip(rids, predicted, strict=True))
        alive = self.svc.generators()
        if not alive:
            return None
        if cfg.skewness.dispatch == "skewness-aware" and predicted is not None:
            plan = plan_dispatch(
                predicted, alive, ptl=self.ptl or default_ptl(),
                recent_lengths=list(self.state.recent_lengths), alpha=cfg.skewness.long_tail,
                max_batch=cfg.generator.max_num_seqs, group=cfg.algorithm.group_size,
            )  # fmt: skip
            batch.planned.decision = {"split": list(plan.split), "estimated_s": plan.latency}
        else:
            plan = random_dispatch(len(prompts), alive, self.rng)
        if cfg.skewness.schedule == "lpt" and predicted is not None:
            priorities = lpt_priorities(predicted, base=self.priority_base)
        else:
            priorities = [self.priority_base] * len(prompts)  # ties: arrival order
        self.priority_base += len(prompts)
        # Every dispatch runs under the same bound in the generators' admission queues (a group is
        # admitted whole and holds its places until its longest sample ends), so that random + FIFO
        # and Algorithm 2 + LPT are compared at equal batch room; without one, LPT's order is moot.
        return [
            (priorities[k], plan.assignment[k], plan.batch_limit(k) or cfg.generator.max_num_seqs)
            for k in range(len(prompts))
        ]

    def _iteration(self, i: int, started: float) -> dict[str, Any]:
        wait_s = 0.0
        while i not in self.state.batches:  # its weight version is still on the way to the generators
            t0 = self.clock()
            with self._cv:
                self._cv.wait(GET_POLL_S)
            wait_s += self.clock() - t0
            self.transfers.check()
            self._check_generators()
            self._dispatch_due()
        batch = self.state.batches[i]
        world = self.cfg.world
        cut = functools.partial(
            by_tokens, rows=self.cfg.train.micro_batch, tokens=self.cfg.train.micro_batch_tokens
        )
        train_spans: list[list[float]] = []
        # An estimator that normalises over the whole batch (REINFORCE++) trains after its last group.
        alg = self.cfg.algorithm
        stream = alg.mode != "baseline" and not estimator(alg.advantage).whiten
        got = batch.arrived
        while True:
            done = batch.whole
            if not done and batch.planned.needed < batch.planned.n_groups:
                # Over-sampling: read what already arrived before training a round, so that the
                # batch closes (and its extra groups are cancelled) as soon as it may, not a round late.
                while not batch.whole and (sample := self.svc.get(timeout=0)) is not None:
                    self.router.route(sample)
                done = batch.whole
            # A round is one micro-batch per rank (cut by rows and tokens); streaming trains one as soon
            # as more than a round's worth is ready, the whole batch's last round once it is whole.
            # (A round's micro-batches are cut from its first world × micro_batch rollouts at most.)
            mbs = cut(got.ready[: world * self.cfg.train.micro_batch])[:world] if done or stream else []
            if done or (len(mbs) == world and len(got.ready) > sum(map(len, mbs))):
                got.take(sum(map(len, mbs)))
                last = done and not got.ready
                t0 = self.clock()
                self.driver.round(mbs, last=last)
                train_spans.append([t0, self.clock()])
                if last:
                    break
                continue
            t0 = self.clock()
            sample = self.svc.get(timeout=GET_POLL_S)
            wait_s += self.clock() - t0
            if sample is not None:
                self.router.route(sample)
            else:
                self.transfers.check()
                self._check_generators()
            if (
                sample is None
                and self.clock() - max(batch.planned.dispatched_at, got.last_sample_at)
                > self.cfg.sample_timeout_s
            ):
                raise TimeoutError(f"no sample of iteration {i} for {self.cfg.sample_timeout_s:.0f}s")
            self._dispatch_due()
        t_step = self.clock()
        stats = self.driver.step()
        self.version = i + 1 + self.state.offset
        step_span = [t_step, self.clock()]
        # Every rank takes part in gathering the weights; the transfer runs in the publisher's thread.
        state = self.driver.full_state()
        if self.cfg.algorithm.mode == "async":
            state = {k: v.clone() for k, v in state.items()}  # the next step must not change it mid-transfer
        self.transfers.publish(state, self.version)
        self.stopping = self.stop_requested is not None and self.stop_requested() and i + 1 < self.state.end
        # Saved once the iteration's record is out (see run): a process killed in between must not
        # leave a checkpoint past the last recorded iteration (resumed after it, that record is lost).
        self._checkpoint_due = (i, self._client_state(i), self.stopping)
        if self.cfg.algorithm.mode != "async":
            self.transfers.wait()
        end = self.clock()
        return self._record(i, batch, started, end, train_spans, step_span, wait_s, stats)

    # ---- weights ----

    def _check_generators(self) -> None:
        """End the run, saying why, when no generator has been connected for `no_generator_s` (a
        failed one's work waits for the others; with none left it would wait for ever)."""
        if self.svc.generators():
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
        if self.transfers.busy():
            return
        waiting = self.transfers.waiting_for(self.version)
        if not waiting:
            return
        self.version += 1
        self.state.offset += 1  # batch j's policy is j + offset: the same weights under a newer number
        log.info("generators %s joined while none served: the current weights go to them as version %d",
                 waiting, self.version)  # fmt: skip
        state = self.driver.full_state()
        if self.cfg.algorithm.mode == "async":
            state = {k: v.clone() for k, v in state.items()}
        self.transfers.publish(state, self.version)

    # ---- records ----

    def _client_state(self, i: int) -> dict[str, Any]:
        """What a resumed run needs: where the data of iteration i + 1 starts."""
        nxt = self.state.batches.get(i + 1)
        sampler = nxt.planned.sampler_state if nxt is not None else self.sampler.state()
        # Paused groups are not saved (their tokens were generated by weights a resumed run no longer
        # has in flight): their prompts are drawn again first, from the start.
        live = [
            *self.router.carry,
            *(c for b in self.state.batches.values() if b.index > i for c in b.arrived.carried.values()),
        ]
        if live:
            back = self.sampler.positions([c.prompt for c in live])
            sampler = {**sampler, "returned": [*sampler.get("returned", []), *back]}
        return {"iteration": i, "next_iteration": i + 1, "weight_version": i + 1, "sampler": sampler}

    def _record(
        self, i: int, batch: Batch, started: float, end: float, train_spans: list[list[float]],
        step_span: list[float], wait_s: float, stats: dict[str, Any],
    ) -> dict[str, Any]:  # fmt: skip
        rec = iteration_record(
            i, batch, mode=self.cfg.algorithm.mode, overlong=bool(self.cfg.algorithm.overlong_buffer),
            version=self.version,
            policy=i + self.state.offset,  # the batch's policy version (self.version is the step's already)
            gen_spans=self.state.gen_spans, sync_spans=self.transfers.spans,
            discarded_tokens=self.router.discarded_tokens,
            ranker=self.ranker, started=started, end=end, train_spans=train_spans, step_span=step_span,
            wait_s=wait_s, stats=stats,
        )  # fmt: skip
        self.state.batches.pop(i, None)
        self.router.discarded_tokens = 0
        return rec
