"""Algorithm 2 of the StreamRL paper: which generator instance gets which prompt, and its batch size.

Why: output lengths are long-tailed. On one instance a sample costs PTL(BS) × L (per-token latency
at running batch size BS, times its length), so long samples want small batches and regular ones
large batches. Algorithm 2 sorts the prompts by predicted length, calls the top α the long tail and
the rest regular, estimates their lengths as the P90 and P50 of recently observed lengths, and tries
every split N_long + N_regular = N of the instances, keeping the one that minimises

    Latency(long, L90, N_long) + Latency(regular, L50, N_regular)
    Latency(group, L, n) = PTL(BS) × L × ceil(M_inst / BS),   M_inst = ceil(M / n) × samples per prompt

with the batch size BS (≤ max_batch, ≤ M_inst) chosen per group to minimise it. The sum is the
paper's objective. The two groups run side by side, so the generation time is rather their max:
``objective="max"`` evaluates that alternative (both are checked against brute force in
tests/unit/skew/test_skew_dispatch.py).

One implementation for the real dispatcher (the trainer turns a :class:`DispatchPlan` into each
request's ``target``, ``batch_limit`` and ``priority``) and for the simulator (planner.sim_dispatch).
Pure functions: no clock; randomness only from the caller's generator.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from streamrl_cli.curves import empirical_quantile, interpolate, monotone

PTL = Callable[[float], float]  # running batch size (sequences) -> time of one decode step
OBJECTIVES = ("sum", "max")
# PTL(BS) for a 7B model on H800 with vLLM, ms, read off the StreamRL paper's PTL figure.
PAPER_PTL_7B_H800 = ((1, 8.3), (16, 9.4), (32, 10.2), (64, 11.7), (128, 15.2), (256, 21.0), (512, 37.0))


@dataclass(frozen=True)
class DispatchPlan:
    """Where each prompt goes. Every instance appears in `queues` and `batch_size`, idle ones too."""

    assignment: tuple[str, ...]  # prompt index -> instance id
    queues: dict[str, tuple[int, ...]]  # instance -> its prompt indices, longest predicted first
    batch_size: dict[str, int]  # instance -> sequences it runs at once (Request.batch_limit); 0: no limit
    long_prompts: tuple[int, ...] = ()  # the predicted long tail, longest first
    long_instances: tuple[str, ...] = ()  # the instances given to the long tail
    latency_long: float = math.nan  # Algorithm 2's estimates (PTL's unit × tokens); nan: not estimated
    latency_regular: float = math.nan
    objective: str = "sum"

    @property
    def split(self) -> tuple[int, int]:
        """(N_long, N_regular)."""
        return len(self.long_instances), len(self.queues) - len(self.long_instances)

    @property
    def latency(self) -> float:
        """The objective Algorithm 2 minimised (sum, or max, of the two groups' latencies)."""
        return _combine(self.objective, self.latency_long, self.latency_regular)

    def batch_limit(self, prompt: int) -> int:
        """The batch size of the instance prompt `prompt` goes to (what its Request carries)."""
        return self.batch_size[self.assignment[prompt]]


def plan_dispatch(
    predicted: Sequence[float],
    instances: Sequence[str],
    *,
    ptl: PTL,
    recent_lengths: Sequence[float],
    alpha: float = 0.2,
    max_batch: int,
    group: int = 1,
    objective: str = "sum",
) -> DispatchPlan:
    """Algorithm 2 for one batch of prompts (`predicted`: one predicted output length per prompt).

    L_long and L_regular are the P90 and P50 of `recent_lengths` (outputs observed lately); before
    any were observed, of the predictions themselves. `group`: samples per prompt (GRPO's n), all
    generated on the prompt's instance; batch sizes count sequences.
    """
    basis = list(recent_lengths) or list(predicted) or [0.0]
    return plan_split(
        predicted,
        instances,
        ptl=ptl,
        l_long=empirical_quantile(basis, 0.9),
        l_regular=empirical_quantile(basis, 0.5),
        alpha=alpha,
        max_batch=max_batch,
        group=group,
        objective=objective,
    )


def plan_split(
    predicted: Sequence[float],
    instances: Sequence[str],
    *,
    ptl: PTL,
    l_long: float,
    l_regular: float,
    alpha: float = 0.2,
    max_batch: int,
    group: int = 1,
    objective: str = "sum",
) -> DispatchPlan:
    """Algorithm 2 with the two groups' mean lengths given (the simulator knows them)."""
    if not instances or len(set(instances)) != len(instances):
        raise ValueError(f"need one or more distinct generator instances, got {list(instances)}")
    if objective not in OBJECTIVES:
        raise ValueError(f"objective {objective!r} not in {OBJECTIVES}")
    if max_batch < 1 or group < 1:
        raise ValueError(f"max_batch ({max_batch}) and group ({group}) must be ≥ 1")
    order = sorted(range(len(predicted)), key=lambda i: (-predicted[i], i))
    k = long_tail_count(len(order), alpha)
    long, regular = order[:k], order[k:]
    n = len(instances)

    def lat(prompts: int, length: float, inst: int) -> float:
        return group_latency(ptl, prompts, length, inst, group=group, max_batch=max_batch)

    if long and regular and n > 1:

        def key(j: int) -> tuple[float, float, int]:
            a, b = lat(len(long), l_long, j), lat(len(regular), l_regular, n - j)
            return _combine(objective, a, b), max(a, b), j

        j = min(range(1, n), key=key)
        groups = [(long, instances[:j], l_long), (regular, instances[j:], l_regular)]
    elif long and not regular:  # everything is long tail (α = 1, or one prompt)
        groups = [(long, instances, l_long), ([], (), l_regular)]
    else:  # no long tail, or a single instance: one pool, at the mixed mean length
        mixed = (len(long) * l_long + len(regular) * l_regular) / len(order) if order else l_regular
        groups = [([], (), l_long), (order, instances, mixed)]

    queues: dict[str, tuple[int, ...]] = {}
    batch: dict[str, int] = {}
    latencies = []
    for prompts, insts, length in groups:
        latencies.append(lat(len(prompts), length, len(insts)) if prompts else 0.0)
        cap = math.ceil(len(prompts) / len(insts)) if insts else 0
        for inst, q in _deal(prompts, insts, predicted, cap).items():
            queues[inst] = tuple(q)
            # An idle instance gets the group's size: it is what re-dispatched work would find there.
            batch[inst] = best_batch(ptl, len(q) or cap, group=group, max_batch=max_batch)[0]
    assignment = [""] * len(order)
    for inst, q in queues.items():
        for p in q:
            assignment[p] = inst
    return DispatchPlan(
        assignment=tuple(assignment),
        queues={i: queues[i] for i in instances},
        batch_size={i: batch[i] for i in instances},
        long_prompts=tuple(long),
        long_instances=tuple(groups[0][1]),
        latency_long=latencies[0],
        latency_regular=latencies[1],
        objective=objective,
    )


def random_dispatch(n: int, instances: Sequence[str], rng: random.Random) -> DispatchPlan:
    """The baseline: prompts shuffled and dealt round-robin (equal counts), no batch limit."""
    order = list(range(n))
    rng.shuffle(order)
    queues = {inst: tuple(order[j :: len(instances)]) for j, inst in enumerate(instances)}
    assignment = [""] * n
    for inst, q in queues.items():
        for p in q:
            assignment[p] = inst
    return DispatchPlan(assignment=tuple(assignment), queues=queues, batch_size=dict.fromkeys(instances, 0))


def lpt_priorities(predicted: Sequence[float], base: int = 0) -> list[int]:
    """Longest-Processing-Time order as request priorities: `base` + rank, 0 = longest predicted.

    Lower is admitted first (vLLM's convention, and the generator's admission queue's). A trainer
    that overlaps iterations gives each batch a higher `base` than the previous one's last priority.
    """
    prio = [0] * len(predicted)
    for rank, i in enumerate(sorted(range(len(predicted)), key=lambda i: (-predicted[i], i))):
        prio[i] = base + rank
    return prio


def long_tail_count(n: int, alpha: float) -> int:
    """How many of `n` prompts form the long tail: round(α·n), at least one when α > 0."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"long-tail share α must be within [0, 1], got {alpha}")
    if n == 0 or alpha == 0.0:
        return 0
    return min(n, max(1, round(alpha * n)))


def group_latency(
    ptl: PTL, prompts: int, length: float, instances: int, *, group: int = 1, max_batch: int
) -> float:
    """Algorithm 2's Latency: `prompts` prompts of mean output `length` spread evenly on `instances`."""
    if prompts == 0:
        return 0.0
    if instances == 0:
        return math.inf
    per_instance = math.ceil(prompts / instances)
    return length * best_batch(ptl, per_instance, group=group, max_batch=max_batch)[1]


def best_batch(ptl: PTL, prompts: int, *, group: int = 1, max_batch: int) -> tuple[int, float]:
    """(BS, PTL(BS) × ceil(prompts·group / BS)): the batch size minimising one instance's time per token.

    BS is a whole number of prompts (a GRPO group is admitted whole; one group even when it alone
    exceeds max_batch), at most max_batch sequences and at most the instance's own sequences. PTL
    does not decrease with BS (measured curves are made monotone), so for each number of rounds only
    the smallest BS reaching it can be best: those are the candidates tried. Ties: fewer rounds.
    """
    if prompts <= 0:
        return 0, 0.0
    top = max(1, min(prompts, max_batch // group))
    best, best_cost, last = top, math.inf, 0
    for rounds in range(math.ceil(prompts / top), prompts + 1):
        b = math.ceil(prompts / rounds)
        if b == last:
            continue
        last = b
        cost = ptl(b * group) * math.ceil(prompts / b)
        if cost < best_cost:
            best, best_cost = b, cost
    return best * group, best_cost


def default_ptl() -> PTL:
    """The paper's 7B/H800 curve: its shape is what matters (Algorithm 2's choice ignores the scale)."""
    return ptl_from_points(PAPER_PTL_7B_H800)


def ptl_from_points(points: Sequence[tuple[float, float]]) -> PTL:
    """PTL interpolated through measured (batch size, step time) points, made non-decreasing first."""
    pts = monotone(points)
    if not pts:
        raise ValueError("a PTL curve needs at least one (batch size, step time) point")
    return lambda bs: interpolate(pts, bs)


def _combine(objective: str, a: float, b: float) -> float:
    return a + b if objective == "sum" else max(a, b)


def _deal(
    prompts: Sequence[int], instances: Sequence[str], predicted: Sequence[float], cap: int
) -> dict[str, list[int]]:
    """Longest first, each prompt to the instance with the least predicted work that has room.

    `cap` = ceil(M / n) prompts per instance keeps the spread even, as the latency estimate assumes.
    """
    out: dict[str, list[int]] = {i: [] for i in instances}
    load = dict.fromkeys(instances, 0.0)
    for p in prompts:
        inst = min((i for i in instances if len(out[i]) < cap), key=lambda i: (load[i], len(out[i])))
        out[inst].append(p)
        load[inst] += predicted[p]
    return out
