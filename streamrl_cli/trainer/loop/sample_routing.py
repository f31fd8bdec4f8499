"""Where each sample goes: into its batch's group, generated again, dropped, paused or carried on.

The loop (``trainer.loop.pipeline``) reads one sample at a time from the data plane and hands it here.
A sample belongs to the batch its request id names (``trainer.loop.request_id``), or to an evaluation,
or to a group paused or cancelled when its batch closed::

    sample ─► evaluation? ─► cancelled group? (dropped, counted) ─► paused group? (kept for the next batch)
                 └─► its batch ─► too stale? (generated again: "#r") ─► its group ─► whole: scored
                                                                             │
       DAPO: all rewards equal ─► dropped, more groups drawn (refill) ◄──────┤
       the batch has its groups ─► over-sampled ones still out: cancelled (aborted) or paused,
                                   and resumed in the next batch from their tokens so far ("#p")

``SampleRouter`` owns this part of the loop's state (cancelled ids, paused and carried groups); the
loop (``Pipeline``) owns the batches in flight (``LoopState``) and hands it the data plane and the
sampler.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from streamrl_cli.tasks import Prompt, Task
from streamrl_cli.trainer.algo.advantages import batch_whiten, estimator, informative, overlong_penalty
from streamrl_cli.trainer.loop.batch import GroupCollector, Rollout
from streamrl_cli.trainer.loop.batch_state import Batch, Carried, LoopState
from streamrl_cli.trainer.loop.request_id import RequestId
from streamrl_cli.trainer.loop.samples import generated, join, trajectory_rewards, trajectory_turns
from streamrl_cli.trainer.loop.seeds import sample_seed
from streamrl_cli.transport.wire import Request, Sample

if TYPE_CHECKING:
    from streamrl_cli.trainer.loop.collaborators import PromptSource, SampleService
    from streamrl_cli.trainer.loop.evaluation import Evaluator
    from streamrl_cli.trainer.loop.loop_config import PipelineConfig

log = logging.getLogger("streamrl.trainer")


class SampleRouter:
    """The sample-routing part of the trainer's loop: it owns what it tracks (cancelled ids, paused
    and carried groups, the tokens thrown away), reads the batches in flight from the loop's
    ``LoopState`` and dispatches through the data plane it is given."""

    def __init__(
        self, cfg: PipelineConfig, state: LoopState, *, task: Task, sampler: PromptSource, svc: SampleService,
        tokenize: Callable[[str], list[int]], detokenize: Callable[[list[int]], str],
        clock: Callable[[], float], evaluator: Evaluator | None,
    ):  # fmt: skip
        self.cfg, self.state, self.task, self.sampler, self.svc = cfg, state, task, sampler, svc
        self.tokenize, self.detokenize, self.clock, self.evaluator = tokenize, detokenize, clock, evaluator
        self.cancelled: set[str] = set()  # request ids of aborted groups: their late samples are dropped
        self.discarded_tokens = 0  # tokens of aborted groups that reached us since the last record
        # Partial rollout: paused request id -> its group; groups waiting for the next dispatch; groups
        # resumed in batches drawn already (async), which the next dispatch draws fewer prompts for.
        self.pausing: dict[str, Carried] = {}
        self.carry: list[Carried] = []
        self.carry_debt = 0
        self.resumes = 0  # request ids of resumed samples: "<group>#p<n>"

    def request(
        self, rid: str, prompt: Prompt, tokens: list[int], indices: list[int], *, group: str = "",
        seed_key: str = "", max_tokens: int | None = None,
    ) -> Request:  # fmt: skip
        """A request for `indices` of `prompt`; `max_tokens`: a resumed sample's budget (default: the
        whole task.max_output_len)."""
        sampling = self.cfg.sampling
        if max_tokens is not None:
            sampling = msgspec.structs.replace(sampling, max_tokens=max_tokens)
        if self.cfg.train.reproducible_sampling:
            sampling = msgspec.structs.replace(
                sampling, seed=sample_seed(self.cfg.train.seed, seed_key, indices[0])
            )
        # A multi-turn task's environment starts from the prompt's row, on the generator.
        env = {**prompt.columns, "prompt": prompt.text} if self.cfg.agent.enabled else {}
        return Request(
            prompt_id=rid, prompt_token_ids=tokens, sample_indices=indices, group_id=group or rid,
            sampling=sampling, env=env,
        )  # fmt: skip

    # ---- samples ----

    def route(self, sample: Sample) -> None:
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
        j = RequestId.parse(sample.prompt_id).iteration
        batch = self.state.batches.get(j)
        if batch is None:
            log.warning("sample of unknown iteration %s dropped", sample.prompt_id)
            return
        carried = batch.arrived.carried.get(GroupCollector.key(sample))
        if carried is not None and sample.sample_index in carried.prefix:  # a resumed sample: join its start
            sample = self._joined(carried.prefix.pop(sample.sample_index), sample)
        self._accept(batch, sample)

    def _accept(self, batch: Batch, sample: Sample) -> None:
        """A sample of `batch` (whole: a resumed one joined to its start): into its group, or generated
        again when its oldest token is past the staleness bound."""
        j = batch.index
        staleness = j + self.state.offset - sample.weight_version
        if staleness > self.cfg.bound:
            # Too old for this batch (a late joiner's, a re-dispatch's, one resumed once too often):
            # generate it again.
            group = GroupCollector.key(sample)
            self.discarded_tokens += len(sample.token_ids)
            batch.planned.retries += 1
            rid = str(RequestId.parse(group).retried(batch.planned.retries))
            batch.planned.prompts[rid] = batch.planned.prompts[group]
            prompt, tokens = batch.planned.prompts[group]
            retry = self.request(
                rid, prompt, tokens, [sample.sample_index], group=group, seed_key=draw_key(group)
            )
            self.svc.submit([retry])
            return
        got = batch.arrived
        got.stamp(sample, self.clock(), batch.planned.dispatched_at)
        key = GroupCollector.key(sample)
        group = got.collector.add(sample)
        for r in group:
            r.staleness, r.iteration = j + self.state.offset - r.sample.weight_version, j
        finished = bool(group) or key in got.dropped  # the group is whole (trained, or dropped)
        if finished:
            got.carried.pop(key, None)
        if not self.cfg.train.reproducible_sampling:
            got.ready += group
        elif finished:
            got.release_in_order(key, group, batch.planned.order)
        if finished and batch.planned.refill is not None and not batch.whole:
            self._refill(batch)
        if batch.whole:
            self.state.gen_spans.append([batch.planned.dispatched_at, batch.arrived.generated_at])
            if estimator(self.cfg.algorithm.advantage).whiten:
                self._whiten(batch)
            if batch.planned.needed < batch.planned.n_groups and _unfinished(batch):
                # The last iteration's extra groups have no next batch to go on in: aborted.
                if self.cfg.rollout.partial and batch.index + 1 < self.state.end:
                    self._pause_rest(batch)
                else:
                    self._abort_rest(batch)

    # ---- dynamic sampling, batch normalisation ----

    def _refill(self, batch: Batch) -> None:
        """Dynamic sampling, after a group of `batch` finished: draw the groups that those still out
        cannot make up for, or, with none out and the budget spent, close the batch with fewer."""
        r = batch.planned.refill
        assert r is not None
        n = r.to_draw()
        if n:
            self._draw_more(batch, n)
        elif r.complete:
            log.warning(
                "iteration %d: only %d of %d groups had rewards that differ after drawing %d more "
                "(algorithm.max_refill=%g); it trains on %s",
                batch.index, r.kept, r.needed, r.drawn, self.cfg.algorithm.max_refill,
                f"{r.kept} groups" if r.kept else "the dropped groups (no group had a reward spread)",
            )  # fmt: skip
            if not r.kept:  # nothing informative at all: the dropped groups, rather than an empty batch
                batch.arrived.ready += [
                    x
                    for k in batch.planned.order
                    if k in batch.arrived.dropped
                    for x in batch.arrived.dropped[k]
                ]
                batch.arrived.done_groups = len(batch.arrived.dropped)
            batch.planned.needed = batch.arrived.done_groups

    def _draw_more(self, batch: Batch, n: int) -> None:
        """Dynamic sampling: `n` more groups for `batch`, in place of dropped ones (admitted first)."""
        assert batch.planned.refill is not None
        prompts = self.sampler.next_batch(n)
        requests = []
        for p in prompts:
            rid = RequestId(iteration=batch.index, prompt_id=p.prompt_id)
            while str(rid) in batch.planned.prompts:  # drawn by this batch already
                rid = RequestId(iteration=batch.index, prompt_id=p.prompt_id, draw=rid.draw + 1)
            rid = str(rid)
            tokens = self.tokenize(p.text)
            batch.planned.prompts[rid] = (p, tokens)
            batch.planned.order.append(rid)
            indices = list(range(self.cfg.algorithm.group_size))
            req = self.request(rid, p, tokens, indices, seed_key=draw_key(rid))
            req.priority = -1
            requests.append(req)
        batch.planned.n_groups += len(prompts)
        batch.planned.refill.drew(len(prompts))
        self.svc.submit(requests)

    def _whiten(self, batch: Batch) -> None:
        """REINFORCE++: the batch's advantages normalised over all its scored tokens, once it is whole."""
        import torch

        rows = batch.arrived.ready
        lengths = torch.tensor([float(r.trained_tokens) if r.scored else 0.0 for r in rows])
        adv = batch_whiten(torch.tensor([r.advantage for r in rows]), lengths)
        for r, a in zip(rows, adv.tolist(), strict=True):
            r.advantage = a

    def _abort_rest(self, batch: Batch) -> None:
        """Over-sampling: the iteration has its groups; the others are cancelled on their generators
        (late samples dropped) and their prompts drawn again first (batches drawn already, in async
        mode, carry them in their saved sampler state, so a resumed run neither loses nor repeats them)."""
        assert batch.arrived.collector is not None
        batch.arrived.aborted = _unfinished(batch)
        ids = [k for rid in batch.arrived.aborted for k in _request_ids(batch, rid)]
        for rid in batch.arrived.aborted:  # resumed groups (partial rollout): what they still owe goes too
            c = batch.arrived.carried.pop(rid, None)
            if c is not None:
                ids += [k for k in c.ids if self.pausing.pop(k, None) is not None]
                self.discarded_tokens += sum(len(s.token_ids) for s in c.prefix.values())
        self.cancelled.update(ids)
        self.svc.cancel(ids)
        self.discarded_tokens += batch.arrived.collector.drop(batch.arrived.aborted)
        positions = self.sampler.give_back([batch.planned.prompts[rid][0] for rid in batch.arrived.aborted])
        for later in self.state.batches.values():
            if later.index > batch.index:
                saved = later.planned.sampler_state
                later.planned.sampler_state = {**saved, "returned": [*saved.get("returned", []), *positions]}

    # ---- partial rollout ----

    def _pause_rest(self, batch: Batch) -> None:
        """Partial rollout: the iteration has its groups; the others are paused on their generators,
        which send back each sample as far as it got, and go on in the next batch to be drawn (or,
        in async mode, in the next one, drawn already)."""
        assert batch.arrived.collector is not None
        rest = _unfinished(batch)
        later = sorted(k for k in self.state.batches if k > batch.index)
        groups, paused = [], []
        for rid in rest:
            c = batch.arrived.carried.pop(rid, None) or Carried(rid, *batch.planned.prompts[rid])
            c.batch = None
            c.have.update(batch.arrived.collector.take(rid))
            ids = _request_ids(batch, rid)
            c.inflight = set(range(self.cfg.algorithm.group_size)) - set(c.have)
            c.ids += ids
            self.pausing.update(dict.fromkeys(ids, c))
            groups.append(c)
            paused += ids
        self.svc.cancel(paused, keep=True)
        for c in groups:
            if later:
                self.carry_debt += 1
                self.resume(c, self.state.batches[later[0]])
            else:
                self.carry.append(c)
        batch.arrived.paused = rest

    def _came_back(self, c: Carried, sample: Sample) -> None:
        """A sample of a paused group, as far as it got (or whole, if it finished meanwhile)."""
        i = sample.sample_index
        if i not in c.inflight:
            return  # a copy of one already back (re-dispatched after its generator was lost)
        c.inflight.discard(i)
        if i in c.prefix:
            sample = self._joined(c.prefix.pop(i), sample)
        (c.prefix if sample.finish_reason == "abort" else c.have)[i] = sample
        if not c.inflight:
            for rid in c.ids:
                self.pausing.pop(rid, None)
            c.ids = []
        if c.batch is not None:
            self._go_on(c, i)

    def resume(self, c: Carried, batch: Batch) -> None:
        """Make a paused group one of `batch`'s (under a key of that batch) and send on what it has."""
        rid = RequestId.parse(c.key).in_batch(batch.index)
        while str(rid) in batch.planned.prompts:  # drawn afresh by this batch too (an epoch boundary)
            rid = rid.carried_again()
        key = str(rid)
        c.key, c.batch = key, batch
        batch.planned.prompts[key] = (c.prompt, c.tokens)
        batch.planned.order.append(key)
        batch.planned.n_groups += 1
        if batch.planned.refill is not None:
            batch.planned.refill.outstanding += 1
        batch.arrived.carried[key] = c
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
        # A trajectory goes on from its next turn on the generator that kept its environment (parked
        # between turns); any other starts over there: its environment's state went with its episode.
        parked = prefix.episode is not None and prefix.episode.parked
        restart = (bool(prefix.loss_mask) or prefix.episode is not None) and not parked
        if restart or batch.index + self.state.offset - prefix.weight_version > self.cfg.bound:
            self.discarded_tokens += len(prefix.token_ids)
            parked = False
            prefix = msgspec.structs.replace(
                prefix, token_ids=[], logprobs=[], token_versions=[], teacher_logprobs=[], episode=None
            )
        self.resumes += 1
        rid = str(RequestId.parse(c.key).resumed(self.resumes))
        batch.planned.prompts[rid] = (c.prompt, c.tokens)
        if parked:  # its generator sends it whole (continued, or run again if it no longer holds it)
            req = self.request(rid, c.prompt, c.tokens, [i], group=c.key)
            req.resume, req.target = f"{prefix.prompt_id}/{prefix.sample_index}", prefix.generator
        else:
            budget = self.cfg.task.max_output_len - len(prefix.token_ids)
            req = self.request(
                rid, c.prompt, c.tokens + list(prefix.token_ids), [i], group=c.key, max_tokens=budget
            )
        req.priority = -1  # admitted before any fresh request: begun earlier, it is likely the longest
        if not prefix.token_ids and not parked:
            del c.prefix[i]  # nothing to join: an ordinary sample from the start
        self.svc.submit([req])

    def _joined(self, start: Sample, rest: Sample) -> Sample:
        """A paused sample's start and what its resumption sent. A parked trajectory's resumption
        comes back whole: its kept tokens first if its generator went on with it; if it ran again
        from the start (its generator lost, or its state given up there), the start is lost."""
        if not (start.episode is not None and start.episode.parked):
            return join(start, rest)
        if not rest.token_ids and rest.finish_reason == "abort":
            return start  # paused again before it reached the engine: still kept where it was
        n = len(start.token_ids)
        if rest.token_ids[:n] != start.token_ids or rest.loss_mask[:n] != start.loss_mask:
            self.discarded_tokens += n
        return rest

    def score(self, batch: Batch, key: str, samples: list[Sample]) -> list[Rollout]:
        prompt, tokens = batch.planned.prompts[key]
        lengths = [generated(s) for s in samples]
        self.state.recent_lengths.extend(lengths)
        # A group is admitted whole and comes back when its longest sample ends: that is its
        # processing time, so it is what the ranker learns, and is judged on. (A trajectory's
        # length is the tokens its model generated over all its turns, not its environment's.)
        batch.arrived.observed[key] = max(lengths)
        if turns := trajectory_turns(samples):  # what the ranker learns turn by turn
            batch.arrived.turns[key] = turns
        batch.arrived.lengths[draw_key(key)] = [
            generated(s) for s in sorted(samples, key=lambda x: x.sample_index)
        ]
        texts = [self.detokenize(s.token_ids) for s in samples]
        scores = trajectory_rewards(self.cfg.agent, self.task, [prompt] * len(samples), samples, texts)
        import torch

        # None ("cannot score"): the sample is not learnt from (masked out of the loss), and the
        # group's advantages are over the samples that were scored.
        scored = [k for k, r in enumerate(scores) if r is not None]
        rewards = [float(r) if r is not None else 0.0 for r in scores]
        alg, max_len = self.cfg.algorithm, self.cfg.task.max_output_len
        shaping = [  # DAPO's overlong penalty: part of the reward the loss sees, not of reward_mean
            overlong_penalty(len(s.token_ids), max_len, alg.overlong_buffer, alg.overlong_penalty)
            if sc is not None
            else 0.0
            for s, sc in zip(samples, scores, strict=True)
        ]
        trained = [rewards[k] + shaping[k] for k in scored]
        adv = [0.0] * len(rewards)
        group_fn = estimator(alg.advantage).group
        if group_fn is not None and scored:
            for k, a in zip(scored, group_fn(torch.tensor(trained), alg.grpo_std_norm).tolist(), strict=True):
                adv[k] = a
        rollouts = [
            Rollout(prompt_tokens=tokens, sample=s, reward=r, advantage=a, scored=sc is not None, shaping=sh)
            for s, r, a, sc, sh in zip(samples, rewards, adv, scores, shaping, strict=True)
        ]
        if batch.planned.refill is not None:
            batch.planned.refill.finished(informative(trained))
            if not informative(trained):  # every advantage 0: it does not count toward the batch
                batch.arrived.dropped[key] = rollouts
                return []
        batch.arrived.done_groups += 1
        return rollouts


def draw_key(group: str) -> str:
    """What a group of batch j drew: the task prompt id, with "~n" for its n-th draw in the same
    batch (and "~c" if carried). Its sampling seed and its `lengths/by_prompt` key."""
    return RequestId.parse(group).draw_key


def _unfinished(batch: Batch) -> list[str]:
    """The groups of a closed batch that it does not train (over-sampled ones still out), in order."""
    done = {GroupCollector.key(r.sample) for r in [*batch.arrived.trained, *batch.arrived.ready]} | set(
        batch.arrived.dropped
    )
    return [rid for rid in batch.planned.order if rid not in done]


def _request_ids(batch: Batch, group: str) -> list[str]:
    """Every request id of `group` in `batch`: its own and its "#r" retries and "#p" resumptions."""
    return [k for k in batch.planned.prompts if str(RequestId.parse(k).group) == group]
