"""How an iteration's batch is assembled per algorithm, with fake generators and groups (no engine):
DAPO's dynamic sampling (drop, refill from over-sampled groups and from new draws, the bound and the
loud short batch), the estimators the pipeline applies per group and per batch, overlong shaping.

The fake generators answer in FIFO order, one sample per read; sample i of a group has i + 1
tokens. The task's reward is the completion's length, except for the prompts named "flat", whose
every sample scores 1.0: a group with no reward spread.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
from collections import deque

import pytest
from support.configs import pipeline_config
from support.helpers import Clock

from streamrl_cli.tasks import Prompt, Task
from streamrl_cli.tasks.sampler import PromptSampler
from streamrl_cli.trainer.loop.batch import collate
from streamrl_cli.trainer.loop.dynamic_sampling import Refill
from streamrl_cli.trainer.loop.pipeline import Pipeline
from streamrl_cli.transport.wire import Sample

# --- the bookkeeping alone ------------------------------------------------------------------------


def test_refill_draws_only_what_the_groups_still_out_cannot_make_up():
    r = Refill(needed=4, budget=2, outstanding=6)  # 4 + 2 over-sampled
    r.finished(informative=False)
    assert r.to_draw() == 0  # 5 still out could still give 4
    r.finished(informative=False)
    r.finished(informative=True)
    assert (r.outstanding, r.kept) == (3, 1) and r.to_draw() == 0  # 1 + 3 out: enough if all count
    r.finished(informative=False)
    assert r.to_draw() == 1  # 1 kept + 2 out < 4
    r.drew(1)
    assert (r.outstanding, r.drawn, r.to_draw()) == (3, 1, 0)
    for _ in range(3):
        r.finished(informative=True)
    assert r.complete and r.short == 0
    assert r.record() == {
        "dynamic_sampling/dropped_groups": 3,
        "dynamic_sampling/refilled_groups": 1,
        "dynamic_sampling/short_groups": 0,
        "dynamic_sampling/drop_share": 3 / 7,
    }


def test_refill_stops_at_its_budget_and_ends_short_once_nothing_is_out():
    r = Refill(needed=3, budget=1, outstanding=3)
    r.finished(informative=False)
    assert r.to_draw() == 1
    r.drew(1)
    r.finished(informative=False)
    assert r.to_draw() == 0 and not r.complete  # budget spent, but two groups still out
    r.finished(informative=True)
    assert not r.complete
    r.finished(informative=False)
    assert r.complete and r.short == 2 and r.kept == 1


# --- the pipeline with fake groups --------------------------------------------------------------


class Flat(Task):
    """Reward: the completion's length, 1.0 for the prompts in `flat` (no spread)."""

    name = "flat"

    def __init__(self, n: int, flat: set[int]):
        self._prompts = [Prompt(prompt_id=f"c/{i}", text=f"p{i}", columns={"index": i}) for i in range(n)]
        self.flat = flat

    def prompts(self):
        return self._prompts

    def reward(self, prompts, completions):
        flat = [p.columns["index"] in self.flat for p in prompts]
        return [1.0 if f else float(len(c)) for f, c in zip(flat, completions, strict=True)]


class Generators:
    def __init__(self):
        self.events, self.version, self.cancelled = [], 0, []
        self.queue: deque = deque()

    def submit(self, requests):
        for r in requests:
            self.events.append(("dispatch", r.prompt_id, r.priority))
            self.queue.extend((r, i) for i in r.sample_indices)

    def get(self, timeout=None):
        if not self.queue:
            return None
        r, i = self.queue.popleft()
        self.events.append(("sample", r.prompt_id, i))
        return Sample(
            prompt_id=r.prompt_id, sample_index=i, group_id=r.group_id, token_ids=[1] * (i + 1),
            logprobs=[-1.0] * (i + 1), finish_reason="stop", weight_version=self.version,
        )  # fmt: skip

    def cancel(self, ids, keep=False):
        self.cancelled.append(list(ids))

    def generators(self):
        return ["generator-0"]


class Driver:
    def __init__(self, gens: Generators):
        self.gens, self.rounds = gens, []

    def round(self, micro_batches, *, last):
        self.rounds.append([r for mb in micro_batches for r in mb])
        self.gens.events.append(("round",))

    def step(self):
        return {}

    def full_state(self):
        return {}


class Publisher:
    rdv = None  # no rendezvous: no newcomer is caught up

    def __init__(self, gens: Generators):
        self.gens, self.pool = gens, concurrent.futures.ThreadPoolExecutor(1)

    def publish(self, state, version, *, then=None):
        def deliver():
            self.gens.version = version
            if then:
                then(version)

        return self.pool.submit(deliver)


def run(flat: set[int], iterations: int = 1, **kw):
    """(records, trained rollouts per iteration, generators) of a run of 4 groups of 2 per iteration."""
    gens = Generators()
    driver, records = Driver(gens), []
    base = {"group_size": 2, "global_batch": 4, "micro_batch": 2, "max_output_len": 64}
    cfg = pipeline_config(**{**base, "reproducible_sampling": False, **kw})
    task = Flat(64, flat)
    pipe = Pipeline(
        cfg, task=task, sampler=PromptSampler(task.prompts(), 4, shuffle=False), tokenize=lambda t: [5, 6],
        detokenize=lambda ids: "x" * len(ids), svc=gens, driver=driver, publisher=Publisher(gens),
        on_record=records.append, clock=Clock(),
    )  # fmt: skip
    pipe.run(0, iterations, 0)
    trained = [r for rnd in driver.rounds for r in rnd]
    by_it = [[r for r in trained if r.iteration == i] for i in range(iterations)]
    return records, by_it, gens


def groups(rows) -> list[str]:
    return list(dict.fromkeys(r.sample.prompt_id for r in rows))


def test_groups_without_a_reward_spread_are_dropped_and_new_ones_drawn_in_their_place():
    records, trained, gens = run(flat={1, 3}, iterations=2, dynamic_sampling=True)
    # c/1 drops: c/0 kept, c/2 and c/3 out -> one more drawn (c/4); c/3 drops -> c/5 drawn.
    assert groups(trained[0]) == ["it0/c/0", "it0/c/2", "it0/c/4", "it0/c/5"]
    rec = records[0]
    assert rec["samples"] == 8  # a full batch of informative groups
    assert rec["dynamic_sampling/dropped_groups"] == 2 and rec["dynamic_sampling/refilled_groups"] == 2
    assert rec["dynamic_sampling/short_groups"] == 0
    assert rec["dynamic_sampling/drop_share"] == pytest.approx(2 / 6)
    # The refills go first in the generators' queues, and the next batch continues after them.
    assert ("dispatch", "it0/c/4", -1) in gens.events
    assert groups(trained[1]) == ["it1/c/6", "it1/c/7", "it1/c/8", "it1/c/9"]
    assert records[1]["dynamic_sampling/dropped_groups"] == 0
    # Each refill is drawn only once the groups still out cannot make up for the dropped ones.
    order = [e[1] for e in gens.events if e[0] in ("dispatch", "sample") and e[1].startswith("it0/")]
    assert order.index("it0/c/4") > max(k for k, p in enumerate(order) if p == "it0/c/1")


def test_over_sampled_groups_replace_dropped_ones_before_anything_is_drawn():
    records, trained, gens = run(
        flat={1}, dynamic_sampling=True, oversample=0.5, iterations=1
    )  # 4 + 2 groups out
    assert groups(trained[0]) == ["it0/c/0", "it0/c/2", "it0/c/3", "it0/c/4"]
    rec = records[0]
    assert rec["dynamic_sampling/refilled_groups"] == 0 and rec["dynamic_sampling/dropped_groups"] == 1
    assert rec["rollout/aborted_groups"] == 1 and gens.cancelled == [["it0/c/5"]]  # only the one still out


def test_past_its_bound_the_iteration_trains_a_shorter_batch_and_says_so(caplog):
    # max_refill 0.25 of 4: one group may be drawn. c/1 drops -> c/4 drawn, which drops too, as does c/3.
    with caplog.at_level(logging.WARNING, logger="streamrl.trainer"):
        records, trained, _ = run(flat={1, 3, 4}, dynamic_sampling=True, max_refill=0.25)
    assert groups(trained[0]) == ["it0/c/0", "it0/c/2"]
    rec = records[0]
    assert rec["samples"] == 4
    assert rec["dynamic_sampling/short_groups"] == 2 and rec["dynamic_sampling/refilled_groups"] == 1
    assert rec["dynamic_sampling/drop_share"] == pytest.approx(3 / 5)
    assert "only 2 of 4 groups had rewards that differ after drawing 1 more" in caplog.text


def test_with_no_informative_group_at_all_the_dropped_ones_are_trained_loudly(caplog):
    with caplog.at_level(logging.WARNING, logger="streamrl.trainer"):
        records, trained, _ = run(flat={0, 1, 2, 3}, dynamic_sampling=True, max_refill=0.0)
    assert groups(trained[0]) == ["it0/c/0", "it0/c/1", "it0/c/2", "it0/c/3"]
    assert records[0]["dynamic_sampling/short_groups"] == 4 and records[0]["samples"] == 8
    assert "no group had a reward spread" in caplog.text


def test_dynamic_sampling_keeps_the_batch_order_of_reproducible_runs():
    records, trained, _ = run(flat={1}, dynamic_sampling=True, reproducible_sampling=True)
    assert groups(trained[0]) == ["it0/c/0", "it0/c/2", "it0/c/3", "it0/c/4"]
    assert records[0]["dynamic_sampling/dropped_groups"] == 1


def test_without_dynamic_sampling_a_flat_group_is_trained_and_nothing_is_recorded():
    records, trained, _ = run(flat={1})
    assert groups(trained[0]) == ["it0/c/0", "it0/c/1", "it0/c/2", "it0/c/3"]
    assert not any(k.startswith("dynamic_sampling/") for k in records[0])


# --- estimators and shaping in the pipeline -----------------------------------------------------


def test_rloo_advantages_come_from_the_other_samples_of_the_group():
    # rewards 1, 2, 3 (lengths): 1 - 2.5, 2 - 2, 3 - 1.5
    _, trained, _ = run(flat=set(), group_size=3, advantage="rloo")
    assert [r.advantage for r in trained[0][:3]] == pytest.approx([-1.5, 0.0, 1.5])


def test_reinforce_pp_trains_after_the_last_group_with_batch_normalised_advantages():
    _, trained, gens = run(flat=set(), group_size=3, advantage="reinforce++")
    events = [e[0] for e in gens.events]
    assert events.index("round") > max(k for k, e in enumerate(events) if e == "sample")  # no streaming
    # Every group has rewards 1, 2, 3 over 1, 2, 3 tokens: token mean 7/3, std √5/3.
    rows = trained[0]
    expected = [-4 / math.sqrt(5), -1 / math.sqrt(5), 2 / math.sqrt(5)]  # (r - 7/3) / (√5/3 + 1e-6)
    assert [r.advantage for r in rows[:3]] == pytest.approx(expected, abs=1e-5)
    tokens = sum(r.response_len for r in rows)
    assert sum(r.advantage * r.response_len for r in rows) / tokens == pytest.approx(0.0, abs=1e-6)


def test_overlong_shaping_enters_the_advantages_and_the_loss_reward_not_reward_mean():
    # max_output_len 3, buffer 2: 1 token free, 2 tokens -0.5, 3 tokens -1.0. Rewards 1, 2, 3 become
    # 1, 1.5, 2: GRPO's (r - 1.5) / 0.408248 = -1.224745, 0, 1.224745.
    records, trained, _ = run(flat=set(), group_size=3, max_output_len=3, overlong_buffer=2)
    rows = trained[0][:3]
    assert [r.shaping for r in rows] == [0.0, -0.5, -1.0]
    assert [r.advantage for r in rows] == pytest.approx([-1.224745, 0.0, 1.224745], abs=1e-5)
    assert collate(rows).rewards.tolist() == [1.0, 1.5, 2.0]  # what GAE would see
    assert records[0]["reward_mean"] == pytest.approx(2.0)  # the task's reward
    assert records[0]["reward/overlong_penalty"] == pytest.approx(-0.5)
