"""A discrete-event simulator of RL iterations on disaggregated generators and a trainer.

It checks what the cost model predicts (planner.generation, planner.iteration) by playing the
run out sample by sample, and compares pipelining modes and dispatch policies at cluster scale
without a cluster:

    dispatch ──► instance queues ──► continuous batching, one decode step = PTL(running batch)
                                            │ each sample finishes after its own length
                                            ▼
    weights ◄── optimizer step ◄── micro-batch training (streamed, or after the whole batch)

Modes: `colocated` (all GPUs generate, then all train: the paper's verl baseline), `baseline`
(disaggregated, batch hand-over, generate → train → sync), `sync-stream` (samples stream into
micro-batches, on-policy), `async` (generation of iteration k+1 overlaps training of k; weights
move in the background; staleness bound s: iteration k needs the weights of step k − s − 1).

Over-sampling (`oversample`): each iteration dispatches that fraction more GRPO groups and closes
when `prompts` groups are complete; the rest are aborted (their tokens so far wasted, their prompts
drawn again first by the next iteration: the same lengths, from the start) or, with `partial`,
paused and put first into the next iteration with the tokens they have (a resumed sample prefills
its prompt and those tokens, then decodes the rest).

Deterministic: all randomness (lengths, shuffles, ranker noise) comes from one seeded generator,
and simulated time is a number, not a clock. Between two events an instance's batch is
constant, so the next completion is computed, not stepped to: events ≈ samples, not tokens.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass

from streamrl_cli.curves import empirical_quantile, interpolate
from streamrl_cli.planner.lengths import LengthDist
from streamrl_cli.planner.sim_dispatch import POLICIES, dispatch_random, dispatch_skewness, predict
from streamrl_cli.skew.dispatch_plan import PAPER_PTL_7B_H800 as PAPER_PTL_7B_H800  # re-exported

SIM_MODES = ("colocated", "baseline", "sync-stream", "async")


@dataclass(frozen=True)
class SimConfig:
    """One simulated run. Times in seconds."""

    mode: str
    prompts: int  # per iteration
    lengths: LengthDist
    instances: int  # generator instances
    max_batch: int  # running sequences per instance (KV-cache bound)
    ptl: tuple[tuple[float, float], ...]  # (batch, seconds per decode step), interpolated
    train_s_per_token: float  # whole trainer, streamed work (forward/backward of all models)
    sample_s_per_token: float  # one lone sample on one trainer replica (the exposed last sample)
    optimizer_s: float
    sync_s: float  # weight transfer; blocks both sides except in async
    group_size: int = 1  # samples per prompt; a GRPO group reaches the trainer when complete
    prompt_len: float = 512
    prefill_s_per_token: float = 0.0  # per instance: admitted prompts stall its decoding
    swap_s: float = 0.0  # generators load new weights into the engine
    switch_s: float = 0.0  # colocated: switching the GPUs between stages, each way
    train_chunk_tokens: float = 131072  # tokens per streamed training step (DP × micro-batch budget)
    chunk_overhead_s: float = 0.0
    staleness: int = 1
    dispatch: str = "random"
    ranker_sigma: float = 0.35  # log-σ of the length ranker's noise (≈ the paper's 7B ranker recall)
    long_fraction: float = 0.2  # Algorithm 2's α
    iterations: int = 6
    seed: int = 0
    oversample: float = 0.0  # extra groups per iteration, a fraction of `prompts`
    partial: bool = False  # extra groups still running at the close go on in the next iteration

    @property
    def extra_groups(self) -> int:
        return math.ceil(self.prompts * self.oversample - 1e-9) if self.oversample > 0 else 0

    def __post_init__(self) -> None:
        if self.mode not in SIM_MODES:
            raise ValueError(f"mode {self.mode!r} not in {SIM_MODES}")
        if self.dispatch not in POLICIES:
            raise ValueError(f"dispatch {self.dispatch!r} not in {POLICIES}")
        if self.instances < 1 or self.max_batch < 1 or self.iterations < 2:
            raise ValueError("need ≥1 instance, max_batch ≥1 and ≥2 iterations")
        if not 0 <= self.oversample <= 1 or (self.partial and not self.oversample > 0):
            raise ValueError("oversample must be in [0, 1], and above 0 with partial")

    def step_s(self, batch: float) -> float:
        return interpolate(self.ptl, batch)


@dataclass(frozen=True)
class IterationTrace:
    index: int
    dispatched_s: float  # prompts handed to the generators
    generated_s: float  # last sample finished
    trained_s: float  # optimizer step done
    samples: int
    tokens: int  # output tokens generated


@dataclass(frozen=True)
class SimResult:
    config: SimConfig
    iterations: tuple[IterationTrace, ...]
    trained_samples: int  # each sample trained exactly once: a check on the event logic
    generator_busy: float  # fraction of instance-time with a running batch (steady state)
    trainer_busy: float
    wasted_tokens: int = 0  # generated, then thrown away (over-sampling's aborted groups)
    paused_groups: int = 0  # groups carried into the next iteration (partial rollout)

    @property
    def samples_per_s(self) -> float:
        """Steady-state throughput: the first iteration (pipeline fill) is left out."""
        its = self.iterations
        span = its[-1].trained_s - its[0].trained_s
        return sum(t.samples for t in its[1:]) / span

    @property
    def iteration_s(self) -> float:
        return self.config.prompts * self.config.group_size / self.samples_per_s

    @property
    def generation_s(self) -> float:
        return sum(t.generated_s - t.dispatched_s for t in self.iterations) / len(self.iterations)


class _Instance:
    """One generator engine: a queue and a continuously batched running set."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.queue: list[tuple[tuple[int, int], int, float]] = []  # (sample id, length, prefill tokens)
        self.running: list[tuple[float, int]] = []  # heap of (progress at which it ends, sample id)
        self.progress = 0.0  # decode steps taken (every running sample advances one token a step)
        self.clock = 0.0  # time up to which `progress` is accounted
        self.token = 0  # invalidates scheduled completions when the batch changes
        self.busy = 0.0


class Simulator:
    """Plays `config.iterations` iterations; use :func:`simulate`."""

    def __init__(self, cfg: SimConfig):
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.events: list[tuple[float, int, str, tuple]] = []
        self.seq = 0
        self.instances = [_Instance(i) for i in range(cfg.instances)]
        self.lengths: list[list[int]] = []  # per iteration, per sample (whole: a resumed one's too)
        self.groups_done: list[int] = []  # per iteration: complete groups
        # Groups for the next iteration: ((length, tokens left) per sample, times paused so far).
        self.carry: list[tuple[list[tuple[int, int]], int]] = []
        self.paused_before: dict[tuple[int, int], int] = {}  # (iteration, group) -> times paused
        self.wasted = 0
        self.paused = 0
        self.arrived: list[list[int]] = []  # per iteration: sample ids ready for training
        self.group_left: dict[tuple[int, int], int] = {}
        self.trained: list[int] = []
        self.version = 0  # newest weights available to generators
        self.dispatched = -1
        self.gen_done = -1  # newest iteration fully generated
        self.step = 0  # iteration the trainer works on
        self.train_busy_until = 0.0
        self.train_busy = 0.0
        self.trace: dict[int, dict] = {}

    # -- event plumbing --------------------------------------------------------------------------
    def push(self, t: float, kind: str, *data: object) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, data))

    def run(self) -> SimResult:
        self.push(0.0, "dispatch", 0)
        while self.events:
            t, _, kind, data = heapq.heappop(self.events)
            getattr(self, "_on_" + kind.replace("-", "_"))(t, *data)
            if self.step >= self.cfg.iterations:
                break
        return self._result()

    # -- generation --------------------------------------------------------------------------------
    def _on_dispatch(self, t: float, k: int) -> None:
        cfg = self.cfg
        g = cfg.group_size
        carried, self.carry = self.carry, []
        fresh = cfg.prompts + cfg.extra_groups - len(carried)
        new = cfg.lengths.sample(self.rng, fresh * g)
        groups = [grp for grp, _ in carried] + [
            [(n, n) for n in new[p * g : (p + 1) * g]] for p in range(fresh)
        ]
        self.paused_before.update(((k, p), times) for p, (_, times) in enumerate(carried) if times)
        lengths = [n for grp in groups for n, _ in grp]
        self.lengths.append(lengths)
        self.groups_done.append(0)
        self.arrived.append([])
        self.trained.append(0)
        self.dispatched = k
        self.trace[k] = {"dispatched": t, "tokens": sum(left for grp in groups for _, left in grp)}
        if cfg.dispatch == "random":
            plan = dispatch_random(len(groups), cfg.instances, self.rng)
        else:  # what is left of each group to decode is what the ranker would predict
            per_prompt = [sum(left for _, left in grp) / g for grp in groups]
            seen = self.lengths[-2] if len(self.lengths) > 1 else None
            l50 = empirical_quantile(seen, 0.5) if seen else cfg.lengths.quantile(0.5)
            l90 = empirical_quantile(seen, 0.9) if seen else cfg.lengths.quantile(0.9)
            plan = dispatch_skewness(
                predict(per_prompt, self.rng, cfg.ranker_sigma),
                cfg.instances,
                cfg.step_s,
                g,
                cfg.max_batch,
                l50,
                l90,
                cfg.long_fraction,
            )
        for inst, prompts in zip(self.instances, plan, strict=True):
            self._advance(inst, t)
            for p in sorted(prompts, key=lambda p: p >= len(carried)):  # resumed groups first
                todo = [(j, n, left) for j, (n, left) in enumerate(groups[p]) if left > 0]
                self.group_left[(k, p)] = len(todo)
                inst.queue.extend(((k, p * g + j), left, cfg.prompt_len + n - left) for j, n, left in todo)
            self._admit(inst, t)

    def _advance(self, inst: _Instance, t: float) -> None:
        if t > inst.clock:
            if inst.running:
                inst.progress += (t - inst.clock) / self.cfg.step_s(len(inst.running))
                inst.busy += t - inst.clock
            inst.clock = t

    def _admit(self, inst: _Instance, t: float) -> None:
        prefill = 0.0
        while inst.queue and len(inst.running) < self.cfg.max_batch:
            sid, length, tokens = inst.queue.pop(0)
            heapq.heappush(inst.running, (inst.progress + length, sid))
            prefill += tokens
        if prefill:
            # Prefill of the admitted prompts (a resumed sample's: with its tokens so far) stalls decoding.
            stall = prefill * self.cfg.prefill_s_per_token
            inst.busy += stall
            inst.clock = max(inst.clock, t) + stall
        self._schedule(inst)

    def _schedule(self, inst: _Instance) -> None:
        inst.token += 1
        if inst.running:
            ends = inst.running[0][0]
            at = inst.clock + max(0.0, ends - inst.progress) * self.cfg.step_s(len(inst.running))
            self.push(at, "finish", inst.index, inst.token)

    def _on_finish(self, t: float, i: int, token: int) -> None:
        inst = self.instances[i]
        if token != inst.token:
            return  # the batch changed since this completion was computed
        self._advance(inst, t)
        inst.progress = max(inst.progress, inst.running[0][0])  # float drift: this one is done
        while inst.running and inst.running[0][0] <= inst.progress + 1e-6:
            _, (k, s) = heapq.heappop(inst.running)
            self._finished(t, k, s)
        self._admit(inst, t)

    def _finished(self, t: float, k: int, s: int) -> None:
        cfg = self.cfg
        key = (k, s // cfg.group_size)
        self.group_left[key] -= 1
        if self.group_left[key] == 0:  # a GRPO group is trained together
            self.arrived[k].extend(range(key[1] * cfg.group_size, (key[1] + 1) * cfg.group_size))
            self.groups_done[k] += 1
            if self.groups_done[k] == cfg.prompts:
                self.trace[k]["generated"] = t
                self.gen_done = k
                self._close(t, k)
                self._maybe_dispatch(t)
        self._train(t)

    def _close(self, t: float, k: int) -> None:
        """Iteration k has its groups: the over-sampled rest leave the instances, aborted or paused."""
        cfg = self.cfg
        if not cfg.extra_groups:
            return
        g = cfg.group_size
        left: dict[tuple[int, int], int] = {}  # (iteration, sample) -> tokens still to decode
        for inst in self.instances:
            self._advance(inst, t)
            left.update((sid, n) for sid, n, _ in inst.queue if sid[0] == k)
            left.update((sid, max(0, round(end - inst.progress))) for end, sid in inst.running if sid[0] == k)
            inst.queue = [q for q in inst.queue if q[0][0] != k]
            inst.running = [r for r in inst.running if r[1][0] != k]
            heapq.heapify(inst.running)
            self._admit(inst, t)  # their places go to the next requests
        lengths = self.lengths[k]
        for p in sorted({s // g for _, s in left}):
            group = [(lengths[s], left.get((k, s), 0)) for s in range(p * g, (p + 1) * g)]
            del self.group_left[(k, p)]
            times = self.paused_before.pop((k, p), 0) + 1
            # Paused once more, its oldest tokens would lag by more than the staleness bound: it
            # starts over (as the trainer does with such samples).
            if cfg.partial and k + 1 < cfg.iterations and times <= max(1, cfg.staleness):
                self.carry.append((group, times))
                self.paused += 1
                continue
            self.wasted += sum(n - rest for n, rest in group)
            if k + 1 < cfg.iterations:  # its prompt is drawn again first, and generated from the start
                self.carry.append(([(n, n) for n, _ in group], 0))

    def _maybe_dispatch(self, t: float) -> None:
        k = self.dispatched + 1
        if k >= self.cfg.iterations or self.gen_done < k - 1:
            return
        stale = self.cfg.staleness if self.cfg.mode == "async" else 0
        if self.version >= k - stale:
            self.dispatched = k  # reserve: the dispatch event fires after the engines load weights
            self.push(t + self.cfg.swap_s, "dispatch", k)

    # -- training ----------------------------------------------------------------------------------
    def _train(self, t: float) -> None:
        cfg = self.cfg
        k = self.step
        if t < self.train_busy_until or k >= len(self.arrived):
            return
        total = cfg.prompts * cfg.group_size
        ready = self.arrived[k][self.trained[k] :]
        lengths = self.lengths[k]
        if cfg.mode in ("baseline", "colocated"):
            if len(self.arrived[k]) < total or not ready:
                return
            take = ready  # the whole batch, once it is all there
        else:
            # A streamed step starts once its micro-batches are full (token-packed), or with
            # whatever is left once the iteration's last sample is in.
            take, tokens = [], 0.0
            for s in ready:
                take.append(s)
                tokens += cfg.prompt_len + lengths[s]
                if tokens >= cfg.train_chunk_tokens:
                    break
            if not take or (tokens < cfg.train_chunk_tokens and len(self.arrived[k]) < total):
                return
        tokens = sum(cfg.prompt_len + lengths[s] for s in take)
        longest = max(cfg.prompt_len + lengths[s] for s in take)
        chunks = math.ceil(tokens / cfg.train_chunk_tokens)
        start = t + (cfg.switch_s if cfg.mode == "colocated" else 0.0)
        duration = max(tokens * cfg.train_s_per_token, longest * cfg.sample_s_per_token)
        duration += chunks * cfg.chunk_overhead_s
        self.trained[k] += len(take)
        self.train_busy += duration
        self.train_busy_until = start + duration
        if self.trained[k] == total:
            self.train_busy += cfg.optimizer_s
            self.train_busy_until += cfg.optimizer_s
            self.push(self.train_busy_until, "stepped", k)
        else:
            self.push(self.train_busy_until, "trainer-free")

    def _on_trainer_free(self, t: float) -> None:
        self._train(t)

    def _on_stepped(self, t: float, k: int) -> None:
        cfg = self.cfg
        self.trace[k]["trained"] = t
        self.step = k + 1
        if cfg.mode == "async":
            self.push(t + cfg.sync_s, "weights", k + 1)  # in the background: the trainer goes on
            self._train(t)
            return
        # Sync modes: the transfer (colocated: switching back to generation) blocks both sides.
        hold = cfg.switch_s if cfg.mode == "colocated" else cfg.sync_s
        self.train_busy_until = t + hold
        self.push(t + hold, "weights", k + 1)

    def _on_weights(self, t: float, v: int) -> None:
        self.version = max(self.version, v)
        self._maybe_dispatch(t)
        self._train(t)

    def _result(self) -> SimResult:
        cfg = self.cfg
        its = tuple(
            IterationTrace(
                k,
                self.trace[k]["dispatched"],
                self.trace[k]["generated"],
                self.trace[k]["trained"],
                len(self.lengths[k]),
                self.trace[k]["tokens"],
            )
            for k in range(cfg.iterations)
        )
        span = its[-1].trained_s
        return SimResult(
            config=cfg,
            iterations=its,
            trained_samples=sum(self.trained),
            generator_busy=sum(i.busy for i in self.instances) / (cfg.instances * span),
            trainer_busy=self.train_busy / span,
            wasted_tokens=self.wasted,
            paused_groups=self.paused,
        )


def simulate(cfg: SimConfig) -> SimResult:
    """Run the simulation of `cfg` (deterministic for a given seed)."""
    return Simulator(cfg).run()
