"""Algorithm 2 (skew.dispatch_plan) against brute force, and its edge cases. Pure, fast.

The brute force tries every assignment of prompts to instances in which no instance mixes long-tail
and regular prompts, and every batch size of every instance; Algorithm 2 only tries the splits
N_long + N_regular, spreads evenly and only the smallest batch size per number of rounds. Both must
reach the same optimum of the objective.
"""

from __future__ import annotations

import functools
import itertools
import math
import random

import pytest

from streamrl_cli.planner.costmodel import ptl_from_profile
from streamrl_cli.planner.profile import Profile
from streamrl_cli.skew.dispatch_plan import (
    PAPER_PTL_7B_H800,
    best_batch,
    default_ptl,
    long_tail_count,
    lpt_priorities,
    plan_dispatch,
    plan_split,
    ptl_from_points,
    random_dispatch,
)

L_LONG, L_REG = 90.0, 30.0
CURVES = {
    "flat": lambda b: 1.0,
    "paper": default_ptl(),
    "linear": lambda b: 0.2 + b,  # steep: a bigger batch saves nothing
    "quadratic": lambda b: b * b,  # steeper: small batches win
    "step": lambda b: 1.0 if b <= 2 else 4.0,
}


def brute_force(predicted, n, ptl, alpha, max_batch, group, objective) -> float:
    order = sorted(range(len(predicted)), key=lambda i: (-predicted[i], i))
    long = set(order[: long_tail_count(len(order), alpha)])

    @functools.cache
    def cost(m: int) -> float:  # one instance with m prompts: every batch size it may run
        sizes = [b * group for b in range(1, max(1, min(m, max_batch // group)) + 1)]
        return min(ptl(bs) * math.ceil(m * group / bs) for bs in sizes)

    best = math.inf
    for assign in itertools.product(range(n), repeat=len(predicted)):
        kinds = [{p in long for p, i in enumerate(assign) if i == inst} for inst in range(n)]
        if n > 1 and any(len(k) == 2 for k in kinds):
            continue  # an instance serves one group
        counts = [assign.count(inst) for inst in range(n)]
        if n == 1:
            k = len(long)
            mixed = (k * L_LONG + (len(predicted) - k) * L_REG) / len(predicted)
            lat = [0.0, mixed * cost(len(predicted))]
        else:
            lat = [
                max(
                    (length * cost(c) for c, kd in zip(counts, kinds, strict=True) if kd == {flag}),
                    default=0.0,
                )
                for flag, length in ((True, L_LONG), (False, L_REG))
            ]
        best = min(best, sum(lat) if objective == "sum" else max(lat))
    return best


def check_plan(plan, predicted, instances, ptl, max_batch, group) -> None:
    """The plan is consistent: every prompt placed once, groups apart, estimates match its queues."""
    assert sorted(p for q in plan.queues.values() for p in q) == list(range(len(predicted)))
    assert all(plan.queues[plan.assignment[p]].count(p) == 1 for p in range(len(predicted)))
    for q in plan.queues.values():
        assert list(q) == sorted(q, key=lambda i: (-predicted[i], i))  # longest first
    long = set(plan.long_prompts)
    assert set(plan.long_instances) <= set(instances)
    for inst, q in plan.queues.items():
        in_long = inst in plan.long_instances
        assert all((p in long) == in_long for p in q) or len(instances) == 1 or not plan.long_instances
        if q:
            bs, _ = best_batch(ptl, len(q), group=group, max_batch=max_batch)
            assert plan.batch_size[inst] == bs
            assert bs % group == 0 and (bs <= max_batch or bs == group) and bs <= len(q) * group


@pytest.mark.parametrize("objective", ["sum", "max"])
@pytest.mark.parametrize("curve", sorted(CURVES))
def test_algorithm_2_reaches_the_brute_force_optimum(curve, objective):
    ptl, rng = CURVES[curve], random.Random(f"{curve}/{objective}")
    cases = 0
    for n_prompts, n_inst, alpha, max_batch, group in itertools.product(
        range(1, 7), range(1, 4), (0.0, 0.2, 0.5, 1.0), (1, 3, 64), (1, 2)
    ):
        if group == 2 and n_prompts > 5:
            continue  # keeps the run short; group 2 is covered by the smaller sizes
        predicted = [rng.choice([5.0, 20.0, 50.0, 100.0, 400.0]) for _ in range(n_prompts)]
        instances = [f"generator-{i}" for i in range(n_inst)]
        plan = plan_split(
            predicted, instances, ptl=ptl, l_long=L_LONG, l_regular=L_REG, alpha=alpha,
            max_batch=max_batch, group=group, objective=objective,
        )  # fmt: skip
        want = brute_force(predicted, n_inst, ptl, alpha, max_batch, group, objective)
        assert plan.latency == pytest.approx(want, rel=1e-12), (predicted, n_inst, alpha, max_batch, group)
        check_plan(plan, predicted, instances, ptl, max_batch, group)
        cases += 1
    assert cases > 300


@pytest.mark.parametrize("scale", [1.0, 1311.0])  # lengths up to 99 tokens, and up to ~128K
def test_long_tail_goes_to_few_instances_with_small_batches(scale):
    # Algorithm 2 uses lengths only through their order and the P90/P50 of recent ones: a long-context
    # run (outputs up to 128K tokens) gets the same plan, its latencies scaled.
    predicted = [scale * x for x in range(100)]
    instances = [f"g{i}" for i in range(5)]
    plan = plan_dispatch(predicted, instances, ptl=default_ptl(), recent_lengths=predicted, max_batch=64)
    assert plan.long_prompts == tuple(range(99, 79, -1))
    assert 1 <= plan.split[0] < 5 and sum(plan.split) == 5
    for inst in plan.long_instances:
        assert set(plan.queues[inst]) <= set(plan.long_prompts)
    small = max(plan.batch_size[i] for i in plan.long_instances)
    assert small < min(plan.batch_size[i] for i in instances if i not in plan.long_instances)
    assert plan.latency == plan.latency_long + plan.latency_regular
    assert plan.batch_limit(99) == plan.batch_size[plan.assignment[99]]


def test_lengths_come_from_recent_observations_else_from_the_predictions():
    flat = ptl_from_points([(1, 1.0)])
    recent = [float(x) for x in range(101)]  # P90 = 90, P50 = 50
    predicted = [1.0, 2.0, 3.0, 4.0, 5.0]
    plan = plan_dispatch(predicted, ["a", "b"], ptl=flat, recent_lengths=recent, max_batch=8)
    assert (plan.latency_long, plan.latency_regular) == (90.0, 50.0)  # one round each, PTL 1
    plan = plan_dispatch(predicted, ["a", "b"], ptl=flat, recent_lengths=[], max_batch=8)
    assert (plan.latency_long, plan.latency_regular) == (5.0, 3.0)


def test_one_instance_takes_everything_in_one_pool():
    predicted = [10.0, 500.0, 20.0, 30.0]
    plan = plan_split(predicted, ["only"], ptl=CURVES["paper"], l_long=L_LONG, l_regular=L_REG, max_batch=2)
    assert plan.queues == {"only": (1, 3, 2, 0)} and plan.split == (0, 1)
    assert plan.batch_size == {"only": 2} and plan.long_prompts == (1,)
    mixed = (L_LONG + 3 * L_REG) / 4
    assert plan.latency_regular == pytest.approx(mixed * CURVES["paper"](2) * 2)


def test_more_instances_than_prompts_leaves_some_idle():
    plan = plan_split([3.0, 1.0], [f"g{i}" for i in range(5)], ptl=CURVES["paper"], l_long=9, l_regular=3,
                      alpha=0.5, max_batch=16)  # fmt: skip
    busy = {i: q for i, q in plan.queues.items() if q}
    assert sorted(busy.values()) == [(0,), (1,)] and len(plan.queues) == 5
    assert set(plan.batch_size.values()) == {1}  # idle instances get their group's size
    assert plan.split[0] >= 1 and plan.split[1] >= 1


def test_equal_lengths_are_spread_evenly_in_prompt_order():
    plan = plan_split([7.0] * 10, ["a", "b", "c"], ptl=lambda b: 1.0, l_long=7, l_regular=7, alpha=0.0,
                      max_batch=64)  # fmt: skip
    assert plan.queues == {"a": (0, 3, 6, 9), "b": (1, 4, 7), "c": (2, 5, 8)}
    assert plan.long_prompts == () and plan.split == (0, 3)


def test_alpha_one_makes_everything_long_tail():
    plan = plan_split([1.0, 2.0, 3.0], ["a", "b"], ptl=lambda b: 1.0, l_long=9, l_regular=3, alpha=1.0,
                      max_batch=64)  # fmt: skip
    assert plan.split == (2, 0) and plan.long_prompts == (2, 1, 0)
    assert (plan.latency_long, plan.latency_regular) == (9.0, 0.0)


def test_no_prompts_and_bad_input():
    plan = plan_dispatch([], ["a"], ptl=default_ptl(), recent_lengths=[], max_batch=4)
    assert plan.assignment == () and plan.queues == {"a": ()} and plan.batch_size == {"a": 0}
    with pytest.raises(ValueError, match="distinct generator instances"):
        plan_dispatch([1.0], [], ptl=default_ptl(), recent_lengths=[], max_batch=4)
    with pytest.raises(ValueError, match="distinct"):
        plan_dispatch([1.0], ["a", "a"], ptl=default_ptl(), recent_lengths=[], max_batch=4)
    with pytest.raises(ValueError, match=r"α must be within \[0, 1\]"):
        plan_dispatch([1.0], ["a"], ptl=default_ptl(), recent_lengths=[], max_batch=4, alpha=1.5)
    with pytest.raises(ValueError, match="objective"):
        plan_dispatch([1.0], ["a"], ptl=default_ptl(), recent_lengths=[], max_batch=4, objective="min")


def test_batch_size_is_chosen_not_just_the_maximum():
    # 17 prompts, max 16: two rounds either way, so 9 per round is cheaper than 16 on a rising curve.
    assert best_batch(CURVES["paper"], 17, max_batch=16) == (9, 2 * CURVES["paper"](9))
    assert best_batch(lambda b: 1.0, 17, max_batch=16)[0] == 9
    assert best_batch(CURVES["quadratic"], 17, max_batch=16) == (1, 17.0)
    assert best_batch(lambda b: 1.0, 3, group=4, max_batch=2) == (4, 3.0)  # a group is admitted whole
    assert best_batch(lambda b: 1.0, 0, max_batch=2) == (0, 0.0)


def test_random_dispatch_deals_equal_counts_without_limits():
    plan = random_dispatch(10, ["a", "b", "c"], random.Random(1))
    assert sorted(len(q) for q in plan.queues.values()) == [3, 3, 4]
    assert sorted(p for q in plan.queues.values() for p in q) == list(range(10))
    assert plan.batch_size == {"a": 0, "b": 0, "c": 0} and math.isnan(plan.latency)
    assert plan == random_dispatch(10, ["a", "b", "c"], random.Random(1))


def test_lpt_priorities_rank_longest_first():
    assert lpt_priorities([5.0, 50.0, 5.0, 20.0]) == [2, 0, 3, 1]
    assert lpt_priorities([1.0, 2.0], base=10) == [11, 10]


def test_ptl_curves_from_points_and_profiles():
    paper = default_ptl()
    assert [paper(b) for b, _ in PAPER_PTL_7B_H800] == [ms for _, ms in PAPER_PTL_7B_H800]
    noisy = ptl_from_profile(Profile(hardware="cpu", model="m", decode=((1, 1.0), (8, 0.8), (16, 2.0))))
    assert noisy(1) == noisy(8) == pytest.approx(0.9) and noisy(16) == 2.0  # made non-decreasing
    with pytest.raises(ValueError, match="no decode curve"):
        ptl_from_profile(Profile(hardware="cpu", model="m", decode=()))
