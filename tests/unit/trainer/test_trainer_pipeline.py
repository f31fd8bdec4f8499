"""The pipelining modes' schedule, with small fakes for generators, ranks and weight transfer.

What is checked here is *when* things happen (dispatch, micro-batch rounds, steps) and the
staleness rule; the real parts (vLLM generators, DeepSpeed, the data plane) are exercised
together in test_trainer_e2e.py. The fakes record events in one shared list.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections import deque

import msgspec
import pytest
from support.configs import pipeline_config
from support.helpers import Clock

from streamrl_cli.errors import StreamRLError
from streamrl_cli.tasks import Prompt, Task
from streamrl_cli.trainer.loop.pipeline import Pipeline, PipelineConfig, Stopped, sample_seed
from streamrl_cli.transport.wire import Episode, Sample


def config(**keys) -> PipelineConfig:
    """The runs here: groups of 2, 4 prompts per iteration, micro-batches of 2, outputs of at most 64
    tokens, groups trained as they finish (reproducible_sampling off); a test's own keys on top."""
    base = {"group_size": 2, "global_batch": 4, "micro_batch": 2, "max_output_len": 64}
    return pipeline_config(**{**base, "reproducible_sampling": False, **keys})


class CountTask(Task):
    name = "count"

    def __init__(self, n: int):
        self._prompts = [Prompt(prompt_id=f"c/{i}", text=f"p{i}", columns={"index": i}) for i in range(n)]

    def prompts(self):
        return self._prompts

    def reward(self, prompts, completions):
        return [float(len(c)) for c in completions]


class ListSampler:
    def __init__(self, prompts, batch):
        self.prompts, self.batch, self.pos = list(prompts), batch, 0

    def next_batch(self, size=None):
        size = size or self.batch
        out = [self.prompts[(self.pos + k) % len(self.prompts)] for k in range(size)]
        self.pos += size
        return out

    def state(self):
        return {"pos": self.pos}

    def give_back(self, prompts):
        raise AssertionError("no group is handed back in these runs (see PromptSampler for that)")

    def positions(self, prompts):
        raise AssertionError("no group is carried in these runs (see PromptSampler for that)")


class Generators:
    """Answers requests one sample per get(), with the weight version it currently serves (a
    `SampleService`: one generator, always connected; nothing is ever cancelled)."""

    def __init__(self, events: list, stale_first: int = 0):
        self.events, self.version = events, 0
        self.queue: deque = deque()
        self.stale_left = stale_first  # this many samples come with version 0 whatever is served
        self.lock = threading.Lock()

    def submit(self, requests):
        for r in requests:
            self.events.append(("dispatch", r.prompt_id))
            for i in r.sample_indices:
                self.queue.append((r, i))

    def get(self, timeout=None):
        with self.lock:
            if not self.queue:
                return None
            r, i = self.queue.popleft()
            version = self.version
            if self.stale_left:
                self.stale_left, version = self.stale_left - 1, 0
        self.events.append(("sample", r.prompt_id, i, version))
        return Sample(prompt_id=r.prompt_id, sample_index=i, group_id=r.group_id, token_ids=[1] * (i + 1),
                      logprobs=[-1.0] * (i + 1), finish_reason="stop", weight_version=version)  # fmt: skip

    def cancel(self, ids, keep=False):
        raise AssertionError("nothing is over-sampled here: no request is cancelled")

    def generators(self):
        return ["generator-0"]


class Driver:
    def __init__(self, events: list):
        self.events, self.rounds = events, []

    def round(self, micro_batches, *, last):
        self.rounds.append([r for mb in micro_batches for r in mb])
        self.events.append(("round", sum(len(m) for m in micro_batches), last))

    def step(self):
        self.events.append(("step",))
        return {"grad_norm": 1.0}

    def full_state(self):
        import torch

        return {"w": torch.zeros(1)}


class Publisher:
    rdv = None  # no rendezvous: no newcomer is caught up (one test gives it one)

    def __init__(self, events: list, gens: Generators):
        self.events, self.gens = events, gens
        self.pool = concurrent.futures.ThreadPoolExecutor(1)

    def publish(self, state, version, *, then=None):
        def deliver():
            self.gens.version = version
            self.events.append(("weights", version))
            if then:
                then(version)
            return {}

        return self.pool.submit(deliver)


def test_the_fakes_are_what_the_pipeline_asks_for():
    from streamrl_cli.trainer.loop import collaborators as C

    events: list = []
    gens = Generators(events)
    assert isinstance(gens, C.SampleService) and isinstance(Tail(events, slow=bool), C.SampleService)
    assert isinstance(Driver(events), C.LearnerDriver)
    assert isinstance(Publisher(events, gens), C.WeightPublisher)
    assert isinstance(ListSampler([], 4), C.PromptSource)
    assert isinstance(LengthRanker(), C.LengthRanker)


def make(mode: str, iterations: int = 4, stale_first: int = 0, **kw):
    events: list = []
    gens = Generators(events, stale_first)
    driver = Driver(events)
    records: list = []
    cfg = config(mode=mode, **kw)
    task = CountTask(64)
    pipe = Pipeline(
        cfg, task=task, sampler=ListSampler(task.prompts(), 4), tokenize=lambda t: [5, 6],
        detokenize=lambda ids: "x" * len(ids), svc=gens, driver=driver,
        publisher=Publisher(events, gens), on_record=records.append, clock=Clock(),
    )  # fmt: skip
    pipe.run(0, iterations, 0)
    return events, driver, records


def test_sync_stream_trains_before_the_last_sample_and_steps_after_it():
    events, driver, records = make("sync-stream")
    it0 = events[: events.index(("step",))]
    first_round = next(k for k, e in enumerate(it0) if e[0] == "round")
    last_sample = max(k for k, e in enumerate(it0) if e[0] == "sample")
    assert first_round < last_sample  # streamed: work started while samples were still coming
    assert [e for e in it0 if e[0] == "round"][-1][2] is True  # the last round ends accumulation
    assert sum(len(r) for r in driver.rounds) == 4 * 2 * 4  # every sample trained once
    # on-policy: batch j is generated by version j and dispatched only after it was delivered
    assert {r["staleness/max"] for r in records} == {0}
    assert events.index(("weights", 1)) < events.index(("dispatch", "it1/c/4"))


@pytest.mark.parametrize(("budget", "world"), [(0, 1), (5, 1), (7, 2)])
def test_micro_batches_are_cut_by_tokens_as_well_as_rows(budget, world):
    # Each sample is 2 prompt tokens + (index + 1) response tokens: 3 and 4 tokens in a group of 2.
    events: list = []
    gens = Generators(events)
    shapes: list = []

    class Shapes(Driver):
        def round(self, micro_batches, *, last):
            shapes.append([[len(r.prompt_tokens) + r.response_len for r in mb] for mb in micro_batches])
            super().round(micro_batches, last=last)

    driver = Shapes(events)
    task = CountTask(64)
    pipe = Pipeline(
        config(mode="sync-stream", micro_batch_tokens=budget, world=world), task=task,
        sampler=ListSampler(task.prompts(), 4), tokenize=lambda t: [5, 6],
        detokenize=lambda ids: "x" * len(ids), svc=gens, driver=driver, publisher=Publisher(events, gens),
        on_record=[].append, clock=Clock(),
    )  # fmt: skip
    pipe.run(0, 2, 0)
    mbs = [mb for rnd in shapes for mb in rnd]
    assert all(len(rnd) <= world for rnd in shapes)  # one micro-batch per rank at most
    assert sum(map(len, mbs)) == 2 * 4 * 2  # every sample trained once
    assert all(len(mb) <= 2 for mb in mbs)  # train.micro_batch
    if budget:
        assert all(sum(mb) <= budget for mb in mbs)
        # 5: the token bound cuts every pair the row bound would keep; 7: a group's 3 + 4 tokens fit
        assert {len(mb) for mb in mbs} == ({1} if budget == 5 else {2})
    else:
        assert {len(mb) for mb in mbs} == {2}
    # Streaming still trains rounds before the batch is whole.
    it0 = events[: events.index(("step",))]
    assert next(k for k, e in enumerate(it0) if e[0] == "round") < max(
        k for k, e in enumerate(it0) if e[0] == "sample"
    )


def test_baseline_waits_for_the_whole_batch():
    events, driver, _ = make("baseline")
    it0 = events[: events.index(("step",))]
    first_round = next(k for k, e in enumerate(it0) if e[0] == "round")
    assert all(e[0] != "sample" for e in it0[first_round:])


def test_async_overlaps_the_next_batch_and_bounds_staleness():
    events, driver, records = make("async", iterations=6, max_staleness=1, stale_first=0)
    # batch 1 is dispatched before iteration 0's step: generation overlaps training
    assert events.index(("dispatch", "it1/c/4")) < events.index(("step",))
    assert max(r["staleness/max"] for r in records) <= 1
    assert sum(len(r) for r in driver.rounds) == 6 * 8


@pytest.mark.parametrize("k", [1, 2])
def test_async_drops_samples_older_than_k_and_generates_them_again(k):
    # Generators that keep serving version 0 for a while: samples of later batches come too old.
    events, driver, records = make("async", iterations=5, max_staleness=k, stale_first=30)
    trained = [r for rnd in driver.rounds for r in rnd]
    assert all(r.staleness <= k for r in trained)
    assert len(trained) == 5 * 8  # each sample of each batch exactly once, re-generated if too old
    assert sum(r["retries"] for r in records) > 0
    keys = [(r.iteration, r.sample.group_id, r.sample.sample_index) for r in trained]
    assert len(set(keys)) == len(keys)


def test_records_carry_the_metrics_and_the_timeline():
    _, _, records = make("sync-stream", iterations=2)
    rec = records[-1]
    for key in ("reward_mean", "samples_per_s", "idle/trainer", "idle/generator", "len/p90", "t/generation",
                "staleness/max", "grad_norm", "weight_version"):  # fmt: skip
        assert key in rec, key
    assert rec["samples"] == 8 and rec["weight_version"] == 2
    tl = rec["timeline"]
    assert tl["start"] <= tl["generation"][0] <= tl["generation"][1] <= tl["step"][0] <= tl["end"]
    assert all(a <= b for a, b in tl["train"])


def test_generation_time_ends_when_generators_finished_not_when_the_trainer_read_the_sample():
    """All samples are finished at once; the trainer reads them only between slow micro-batch rounds.
    T_gen (the elastic rule's input) is the generators' time, not the trainer's reading."""
    events: list = []
    clock = Clock()

    class Finished(Generators):
        def get(self, timeout=None):
            s = super().get(timeout)
            if s is not None:
                s.finished_at = self.done_at
            return s

        def submit(self, requests):
            self.done_at = clock.t + 0.5  # generated within half a second of the dispatch
            super().submit(requests)

    class SlowDriver(Driver):
        def round(self, micro_batches, *, last):
            clock.t += 10.0  # each round trains for 10 s while finished samples wait unread
            super().round(micro_batches, last=last)

    gens, records = Finished(events), []
    cfg = config(mode="sync-stream")
    task = CountTask(64)
    pipe = Pipeline(
        cfg, task=task, sampler=ListSampler(task.prompts(), 4), tokenize=lambda t: [5, 6],
        detokenize=lambda ids: "x" * len(ids), svc=gens, driver=SlowDriver(events),
        publisher=Publisher(events, gens), on_record=records.append, clock=clock,
    )  # fmt: skip
    pipe.run(0, 2, 0)
    for rec in records:
        assert rec["t/generation"] == pytest.approx(0.5, abs=0.01)  # not ~30 s of reading between rounds
        assert rec["t/train"] >= 30.0 and rec["idle/generator"] > 0.9


class Tail(Generators):
    """FIFO, one sample per get(), except the groups `slow(request id)` names: those come after every
    other sample (the long tail). Cancellations are recorded but the samples still come (as samples
    already on the wire do): the pipeline must drop them itself."""

    def __init__(self, events: list, slow):
        super().__init__(events)
        self.slow, self.late, self.cancelled = slow, deque(), []

    def submit(self, requests):
        for r in requests:
            self.events.append(("dispatch", r.prompt_id))
            for i in r.sample_indices:
                (self.late if self.slow(r.prompt_id) else self.queue).append((r, i))

    def get(self, timeout=None):
        if not self.queue and self.late:
            self.queue.append(self.late.popleft())
        return super().get(timeout)

    def cancel(self, ids, keep=False):
        self.cancelled.append(list(ids))


def tail_run(gens: Tail, mode: str, iterations: int, **kw):
    """A run of 4 + 2 over-sampled groups of 2 per iteration against `gens`; (records, checkpoints,
    the rollouts of each training round)."""
    from streamrl_cli.tasks.sampler import PromptSampler

    driver, records, checkpoints = Driver(gens.events), [], []
    cfg = config(mode=mode, oversample=0.5, **kw)
    task = CountTask(64)
    pipe = Pipeline(
        cfg, task=task, sampler=PromptSampler(task.prompts(), 4, shuffle=False), tokenize=lambda t: [5, 6],
        detokenize=lambda ids: "x" * len(ids), svc=gens, driver=driver,
        publisher=Publisher(gens.events, gens), on_record=records.append, clock=Clock(),
        on_checkpoint=lambda i, st, stop: checkpoints.append(st),
    )  # fmt: skip
    pipe.run(0, iterations, 0)
    return records, checkpoints, driver.rounds


def oversampled(mode: str, iterations: int):
    gens = Tail([], slow=lambda rid: rid in ("it0/c/1", "it0/c/4"))
    records, checkpoints, rounds = tail_run(gens, mode, iterations)
    trained = [[r.sample.prompt_id for r in rnd] for rnd in rounds]
    return gens, records, checkpoints, trained


def test_oversampling_trains_the_first_groups_to_finish_and_hands_the_rest_back():
    gens, records, _, trained = oversampled("sync-stream", 3)
    # 4 + 2 groups dispatched per iteration; the first 4 to finish are trained, whole, once.
    assert [r["samples"] for r in records] == [8, 8, 8]
    assert [r["rollout/aborted_groups"] for r in records] == [2, 2, 2]
    flat = [p for rnd in trained for p in rnd]
    by_it = [sorted({p for p in flat if p.startswith(f"it{i}/")}) for i in range(3)]
    assert by_it[0] == ["it0/c/0", "it0/c/2", "it0/c/3", "it0/c/5"]  # the two slow groups were not waited for
    assert gens.cancelled[0] == ["it0/c/1", "it0/c/4"]
    # Their prompts come first in the next batch; there the last two dispatched finish last.
    assert by_it[1] == ["it1/c/1", "it1/c/4", "it1/c/6", "it1/c/7"]
    assert gens.cancelled[1] == ["it1/c/8", "it1/c/9"]
    assert all(flat.count(p) == 2 for p in flat)  # each group's two samples, once (late copies dropped)
    assert not any(p in flat for ids in gens.cancelled for p in ids)
    # The fake delivers cancelled groups anyway (as samples already on the wire): dropped and counted.
    assert sum(r["rollout/discarded_tokens"] for r in records) > 0
    assert all(r["t/tail"] >= 0 for r in records)


def test_oversampling_in_async_mode_saves_the_handed_back_prompts_with_the_next_batch():
    """Batch 1 is drawn before batch 0 closes: the checkpoint after iteration 0 resumes from batch 1's
    sampler state, which must carry batch 0's handed-back prompts (else a resumed run skips them)."""
    gens, records, checkpoints, _ = oversampled("async", 2)
    assert records[0]["rollout/aborted_groups"] == 2 and gens.cancelled[0] == ["it0/c/1", "it0/c/4"]
    assert checkpoints[0]["sampler"]["returned"][-2:] == [1, 4]


def test_oversampling_is_refused_with_reproducible_sampling():
    with pytest.raises(ValueError, match="reproducible"):
        oversampled_cfg = config(oversample=0.5, reproducible_sampling=True)
        Pipeline(oversampled_cfg, task=CountTask(4), sampler=None, tokenize=None, detokenize=None, svc=None,
                 driver=None, publisher=None, on_record=None)  # fmt: skip


class LengthRanker:
    """Predicts the prompt's index as its length; records what it learnt."""

    def __init__(self):
        self.updates = []

    def rank(self, prompts):
        return [float(p.columns["index"]) for p in prompts]

    def update(self, prompts, lengths):
        self.updates.append((len(prompts), list(lengths)))


class PlacingGenerators(Generators):
    def generators(self):
        return ["generator-0", "generator-1"]

    def submit(self, requests):
        self.requests = getattr(self, "requests", []) + list(requests)
        super().submit(requests)


@pytest.mark.parametrize("dispatch,schedule", [("skewness-aware", "lpt"), ("random", "fifo")])
def test_skewness_settings_reach_the_requests_and_the_ranker_learns(dispatch, schedule):
    events: list = []
    gens = PlacingGenerators(events)
    ranker = LengthRanker()
    records: list = []
    cfg = config(mode="sync-stream", dispatch=dispatch, schedule=schedule)
    task = CountTask(64)
    pipe = Pipeline(
        cfg, task=task, sampler=ListSampler(task.prompts(), 4), tokenize=lambda t: [5, 6],
        detokenize=lambda ids: "x" * len(ids), svc=gens, driver=Driver(events),
        publisher=Publisher(events, gens), on_record=records.append, clock=Clock(), ranker=ranker,
    )  # fmt: skip
    pipe.run(0, 2, 0)
    first = gens.requests[:4]  # batch 0: prompts c/0..c/3, predicted lengths 0..3
    assert {r.target for r in gens.requests} <= {"generator-0", "generator-1"}
    assert all(r.target for r in gens.requests)
    if schedule == "lpt":
        # longest predicted first: c/3 gets the lowest priority value; every request has a batch limit
        assert [r.priority for r in first] == [3, 2, 1, 0]
        assert all(r.batch_limit > 0 for r in gens.requests)
        assert [r.priority for r in gens.requests[4:]] == [7, 6, 5, 4]  # the next batch comes after
        assert "dispatch/long_instances" in records[0]
    else:
        assert {r.priority for r in first} == {0}
        # random + FIFO runs under the same bound as Algorithm 2 may use: the engines' max_num_seqs
        assert {r.batch_limit for r in gens.requests} == {cfg.generator.max_num_seqs}
    assert len(ranker.updates) == 2 and ranker.updates[0][0] == 4  # one update per iteration
    # sample i has i + 1 tokens: the group's time is its longest sample's, 2, not the mean 1.5
    assert ranker.updates[0][1] == [2, 2, 2, 2]
    assert records[0]["lengths/by_prompt"] == {f"c/{i}": [1, 2] for i in range(4)}
    assert "ranker/recall@20" in records[0] and "ranker/spearman" in records[0]


@pytest.mark.parametrize("reproducible", [True, False])
def test_reproducible_sampling_seeds_each_sample_from_the_prompt(reproducible):
    events: list = []
    gens = PlacingGenerators(events)
    cfg = config(mode="baseline", dispatch="random", seed=3, reproducible_sampling=reproducible)
    task = CountTask(4)  # 4 prompts: iteration 1 draws the same ones again
    pipe = Pipeline(
        cfg, task=task, sampler=ListSampler(task.prompts(), 4), tokenize=lambda t: [5, 6],
        detokenize=lambda ids: "x" * len(ids), svc=gens, driver=Driver(events),
        publisher=Publisher(events, gens), on_record=[].append, clock=Clock(),
    )  # fmt: skip
    pipe.run(0, 2, 0)
    seeds = [r.sampling.seed for r in gens.requests]
    if not reproducible:
        assert seeds == [None] * 8
        return
    # the same prompt, the same seed in every iteration; different prompts, different seeds
    assert seeds[:4] == seeds[4:] == [sample_seed(3, f"c/{i}", 0) for i in range(4)]
    assert len(set(seeds[:4])) == 4
    # vLLM gives the k-th sample of a request seed + k: a lone re-dispatch of sample 1 matches it
    assert sample_seed(3, "c/0", 1) == sample_seed(3, "c/0", 0) + 1
    assert sample_seed(4, "c/0", 0) != sample_seed(3, "c/0", 0)


def test_algorithm_2_uses_the_given_ptl_curve():
    """The profiled decode curve (planner.profile_file), when the trainer passes one, is what
    Algorithm 2 plans with; its batch limits follow it (a curve where batching costs nothing
    lets every instance take its whole share at once)."""
    asked: list[float] = []

    def flat(bs: float) -> float:
        asked.append(bs)
        return 1.0

    events: list = []
    gens = PlacingGenerators(events)
    cfg = config(mode="sync-stream", dispatch="skewness-aware", schedule="lpt")
    task = CountTask(64)
    pipe = Pipeline(
        cfg, task=task, sampler=ListSampler(task.prompts(), 4), tokenize=lambda t: [5, 6],
        detokenize=lambda ids: "x" * len(ids), svc=gens, driver=Driver(events),
        publisher=Publisher(events, gens), on_record=[].append, clock=Clock(), ranker=LengthRanker(),
        ptl=flat,
    )  # fmt: skip
    pipe.run(0, 1, 0)
    assert asked and all(bs >= 1 for bs in asked)


def test_the_trainer_reads_algorithm_2s_curve_from_the_profile_file(tmp_path):
    from streamrl_cli.launch.plan import role_specs
    from streamrl_cli.planner.profile import Profile, save_profile
    from streamrl_cli.recipe.load import load
    from streamrl_cli.trainer.role.main import TrainerRole

    path = save_profile(
        Profile(hardware="h20", model="m", decode=((1, 0.01), (16, 0.02))), tmp_path / "p.json"
    )
    r = load(
        "local",
        [f"planner.profile_file={path}", "skewness.dispatch=skewness-aware", "skewness.ranker=oracle"],
    ).recipe
    ptl = TrainerRole(role_specs(r, tmp_path)["trainer"], 0)._ptl()
    assert ptl is not None and ptl(1) == 0.01 and ptl(16) == 0.02 and 0.01 < ptl(8) < 0.02
    random = load("local", [f"planner.profile_file={path}"]).recipe  # random dispatch has no curve
    assert TrainerRole(role_specs(random, tmp_path)["trainer"], 0)._ptl() is None


class VanishingGenerators(Generators):
    """Every generator goes away after `left` samples: nothing answers after that."""

    def __init__(self, events: list, left: int):
        super().__init__(events)
        self.left = left

    def get(self, timeout=None):
        if self.left <= 0:
            return None
        self.left -= 1
        return super().get(timeout)

    def generators(self):
        return ["generator-0"] if self.left > 0 else []


def test_the_trainer_ends_the_run_with_the_reason_when_no_generator_is_left():
    events: list = []
    gens = VanishingGenerators(events, left=10)  # iteration 0 (8 samples) and part of iteration 1
    cfg = config(no_generator_s=0.5)
    task = CountTask(64)
    pipe = Pipeline(
        cfg, task=task, sampler=ListSampler(task.prompts(), 4), tokenize=lambda t: [5, 6],
        detokenize=lambda ids: "x" * len(ids), svc=gens, driver=Driver(events),
        publisher=Publisher(events, gens), on_record=lambda r: None, clock=Clock(),
    )  # fmt: skip
    outcome: list = []

    def run() -> None:
        try:
            pipe.run(0, 4, 0)
        except StreamRLError as e:
            outcome.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout=120)  # liveness bound: a wait for generators that never come is a hang
    assert not t.is_alive(), "the trainer waited for ever with no generator left"
    assert outcome and "no generator left" in str(outcome[0]) and "train.stall_after_s" in str(outcome[0])
    assert ("step",) in events  # iteration 0 was trained before they went


class HalfScoredTask(CountTask):
    """Cannot score the first sample of each group (length 1): returns None for it."""

    def reward(self, prompts, completions):
        return [None if len(c) == 1 else float(len(c)) for c in completions]


def test_unscored_samples_are_not_learnt_from_and_are_counted():
    events: list = []
    gens = Generators(events)
    driver = Driver(events)
    records: list = []
    cfg = config(mode="sync-stream", group_size=3, global_batch=2)
    task = HalfScoredTask(8)
    pipe = Pipeline(
        cfg, task=task, sampler=ListSampler(task.prompts(), 2), tokenize=lambda t: [5, 6],
        detokenize=lambda ids: "x" * len(ids), svc=gens, driver=driver,
        publisher=Publisher(events, gens), on_record=records.append, clock=Clock(),
    )  # fmt: skip
    pipe.run(0, 1, 0)
    rows = [r for rnd in driver.rounds for r in rnd]
    assert len(rows) == 6  # groups stay whole
    unscored = [r for r in rows if not r.scored]
    assert len(unscored) == 2 and all(r.advantage == 0.0 and r.response_len == 1 for r in unscored)
    # GRPO normalises over the scored two of each group (rewards 2 and 3): ±1
    assert sorted(round(r.advantage, 3) for r in rows if r.scored) == [-1.0, -1.0, 1.0, 1.0]
    assert records[0]["reward/unscored"] == 2
    assert records[0]["reward_mean"] == 2.5  # over the scored samples only


def test_evaluation_runs_between_iterations_and_at_the_end_without_being_trained_on():
    from streamrl_cli.recipe.schema import AlgorithmConfig, TaskConfig
    from streamrl_cli.trainer.loop.evaluation import EvalConfig, Evaluator

    events: list = []
    gens = Generators(events)
    driver = Driver(events)
    records: list = []
    evals: list = []
    held_out = HalfScoredTask(5)
    clock = Clock()
    eval_cfg = EvalConfig(
        task=TaskConfig(eval_every=2, eval_samples=3, eval_temperature=0.0, max_output_len=9),
        algorithm=AlgorithmConfig(top_p=0.5),
    )
    evaluator = Evaluator(
        held_out, eval_cfg, tokenize=lambda t: [5, 6], detokenize=lambda ids: "x" * len(ids),
        on_eval=evals.append, clock=clock,
    )  # fmt: skip
    cfg = config(mode="sync-stream")
    task = CountTask(64)
    pipe = Pipeline(
        cfg, task=task, sampler=ListSampler(task.prompts(), 4), tokenize=lambda t: [5, 6],
        detokenize=lambda ids: "x" * len(ids), svc=gens, driver=driver, publisher=Publisher(events, gens),
        on_record=records.append, clock=clock, evaluator=evaluator,
    )  # fmt: skip
    pipe.run(0, 5, 0)
    assert [r["iteration"] for r in records] == [0, 1, 2, 3, 4]
    assert sum(len(r) for r in driver.rounds) == 5 * 8  # evaluation samples are never trained on
    # after iterations 1 and 3 (every 2), and the final one after the last (4)
    assert [(e["eval/iteration"], e["eval/final"]) for e in evals] == [(1, False), (3, False), (4, True)]
    final = evals[-1]
    assert final["eval/weight_version"] == 5 and final["eval/samples"] == 3
    assert final["eval/unscored"] == 3  # HalfScoredTask cannot score a 1-token completion
    assert final["eval/reward_mean"] is None and final["eval/length_mean"] == 1.0
    evals_sent = [e for e in events if e[0] == "dispatch" and e[1].startswith("eval")]
    assert len(evals_sent) == 9 and {e[1].split("/", 1)[1] for e in evals_sent} == {"c/0", "c/1", "c/2"}
    # an evaluation goes out once its weights are served, after the batch due with them
    first = events.index(("dispatch", "eval1/c/0"))
    assert events.index(("weights", 2)) < first and events.index(("dispatch", "it2/c/8")) < first


@pytest.mark.parametrize("mode", ["sync-stream", "async"])
def test_a_stop_asked_mid_run_checkpoints_that_iteration_and_stops_after_it(mode):
    # SLURM's warning (USR2/SIGTERM) sets a flag the pipeline reads once per iteration: the iteration
    # in progress finishes, is checkpointed whatever checkpoint_every says, and the run stops there.
    events: list = []
    gens = Generators(events, 0)
    records: list = []
    checkpoints: list = []
    task = CountTask(64)
    asked = {"now": False}

    def on_record(rec):
        records.append(rec)
        asked["now"] = rec["iteration"] == 1  # asked during iteration 2

    pipe = Pipeline(
        config(mode=mode), task=task,
        sampler=ListSampler(task.prompts(), 4), tokenize=lambda t: [5, 6], detokenize=lambda ids: "x",
        svc=gens, driver=Driver(events), publisher=Publisher(events, gens), on_record=on_record,
        on_checkpoint=lambda i, state, stopping: checkpoints.append((i, state["next_iteration"], stopping)),
        clock=Clock(), stop_requested=lambda: asked["now"],
    )  # fmt: skip
    with pytest.raises(Stopped) as stop:
        pipe.run(0, 10, 0)
    assert stop.value.next_iteration == 3
    assert [r["iteration"] for r in records] == [0, 1, 2]
    assert checkpoints == [(0, 1, False), (1, 2, False), (2, 3, True)]


class ReturningGenerators(Generators):
    """Every generator goes after `left` samples (scaled to zero); a newcomer registers and waits
    for weights; it serves once a version newer than the one it found was delivered to it."""

    def __init__(self, events: list, left: int):
        super().__init__(events)
        self.left, self.found = left, None

    def serving(self) -> bool:
        return self.left > 0 or (self.found is not None and self.version > self.found)

    def get(self, timeout=None):
        if self.left <= 0 and self.found is None:
            self.found = self.version
        if not self.serving():
            return None
        self.left -= 1
        return super().get(timeout)

    def generators(self):
        return ["generator"] if self.serving() else []


class Rendezvous:
    def __init__(self, gens: ReturningGenerators):
        self.gens = gens

    def members(self, role=None):
        if self.gens.found is None:
            return []
        return [{"member_id": "generator-2", "role": "generator", "rank": 2, "state": "alive",
                 "reported_state": "waiting for weights", "weight_version": None}]  # fmt: skip


def test_generators_that_join_while_none_serves_get_the_current_weights_as_a_new_version():
    """Scaled to zero and back: nothing generates, so no step makes a version the newcomers could
    load; the trainer sends them the current weights, unchanged, as the next version, and goes on."""
    events: list = []
    gens = ReturningGenerators(events, left=10)  # iteration 0 (8 samples) and part of iteration 1
    publisher = Publisher(events, gens)
    publisher.rdv = Rendezvous(gens)
    cfg = config(no_generator_s=1e9)
    task = CountTask(64)
    records: list = []
    pipe = Pipeline(
        cfg, task=task, sampler=ListSampler(task.prompts(), 4), tokenize=lambda t: [5, 6],
        detokenize=lambda ids: "x" * len(ids), svc=gens, driver=Driver(events),
        publisher=publisher, on_record=records.append, clock=Clock(),
    )  # fmt: skip
    t = threading.Thread(target=pipe.run, args=(0, 3, 0), daemon=True)
    t.start()
    t.join(timeout=120)  # liveness bound: without the catch-up this waits for ever
    assert not t.is_alive(), "newcomers that joined while none served never got weights"
    kinds = [e[0] if e[0] != "weights" else e for e in events if e[0] in ("step", "weights")]
    # Iteration 0's step made version 1; then, with no step between, version 2 (the same weights).
    assert kinds[:4] == ["step", ("weights", 1), ("weights", 2), "step"], kinds
    assert [r["iteration"] for r in records] == [0, 1, 2]
    assert [r["weight_version"] for r in records] == [1, 3, 4]  # batch j's policy is j + 1 from then on
    assert all(r["staleness/max"] == 0 for r in records)


def test_tail_runs_from_ninety_percent_of_the_samples_generated_to_the_last():
    from streamrl_cli.trainer.loop.batch import Rollout
    from streamrl_cli.trainer.loop.batch_state import Batch
    from streamrl_cli.trainer.loop.iteration_record import _tail

    batch = Batch.new(0, {})
    rows = []
    for g in range(5):  # 5 groups of 2, finished at 1, 2, 3, 4 and 10 s
        for i in range(2):
            s = Sample(prompt_id=f"g{g}", sample_index=i, group_id=f"g{g}", token_ids=[1], logprobs=[-1.0],
                       finish_reason="stop", weight_version=0)  # fmt: skip
            batch.arrived.done_at[(f"g{g}", i)] = [1.0, 2.0, 3.0, 4.0, 10.0][g]
            rows.append(Rollout(prompt_tokens=[5], sample=s, reward=0.0, advantage=0.0))
    assert _tail(batch, rows) == 6.0  # ⌊90%⌋ of 5 groups: the 4th, done at 4 s; the last at 10 s
    assert _tail(batch, rows[:2]) == 0.0  # one group: no tail
    assert _tail(batch, rows[:4]) == 1.0  # two groups: from the first to the last


def test_a_prompt_drawn_twice_in_one_batch_is_two_groups():
    """A batch that spans two epochs can draw a prompt twice (the end of one permutation, the start
    of the next; ~9% of batches with 10 prompts and batches of 4). Each draw is its own group."""
    events: list = []
    gens, driver, records = Generators(events), Driver(events), []
    cfg = config(mode="sync-stream")
    task = CountTask(3)  # 3 prompts, batches of 4: every batch draws one prompt twice
    pipe = Pipeline(
        cfg, task=task, sampler=ListSampler(task.prompts(), 4), tokenize=lambda t: [5, 6],
        detokenize=lambda ids: "x" * len(ids), svc=gens, driver=driver, publisher=Publisher(events, gens),
        on_record=records.append, clock=Clock(),
    )  # fmt: skip
    pipe.run(0, 2, 0)
    assert [r["samples"] for r in records] == [8, 8]
    assert sorted(records[0]["lengths/by_prompt"]) == ["c/0", "c/0~2", "c/1", "c/2"]
    trained = [(r.sample.prompt_id, r.sample.sample_index) for rnd in driver.rounds for r in rnd]
    assert len(set(trained)) == len(trained) == 16


# ---- partial rollout ----


class Pausing(Tail):
    """Tail, and a pause (cancel with keep) sends back each undelivered sample of the paused requests
    as far as it got: 3 tokens (log-prob -0.5) for a slow one, none for the others. A resumed sample
    ("#p" request) finishes with 2 more tokens (log-prob -0.25), unless `slow` names it too."""

    def __init__(self, events: list, slow):
        super().__init__(events, slow)
        self.requests: list = []
        self.back: deque = deque()

    def submit(self, requests):
        self.requests += requests
        super().submit(requests)

    def cancel(self, ids, keep=False):
        super().cancel(ids)
        if not keep:
            return
        for q in (self.queue, self.late):
            for r, i in [e for e in q if e[0].prompt_id in ids]:
                q.remove((r, i))
                n = 3 if self.slow(r.prompt_id) else 0
                self.back.append(Sample(prompt_id=r.prompt_id, sample_index=i, group_id=r.group_id,
                                        token_ids=[7] * n, logprobs=[-0.5] * n, finish_reason="abort",
                                        weight_version=self.version))  # fmt: skip

    def get(self, timeout=None):
        if self.back:  # a pause is answered at once
            return self.back.popleft()
        if not self.queue and self.late:
            self.queue.append(self.late.popleft())
        if self.queue and "#p" in self.queue[0][0].prompt_id:
            r, i = self.queue.popleft()
            return Sample(prompt_id=r.prompt_id, sample_index=i, group_id=r.group_id, token_ids=[8, 8],
                          logprobs=[-0.25, -0.25], finish_reason="stop",
                          weight_version=self.version)  # fmt: skip
        return Generators.get(self, timeout)


def partial_run(mode: str, iterations: int, slow, **kw):
    gens = Pausing([], slow)
    records, checkpoints, rounds = tail_run(gens, mode, iterations, partial=True, **kw)
    return gens, records, checkpoints, [r for rnd in rounds for r in rnd]


def test_partial_rollout_resumes_paused_samples_under_the_next_weights_with_per_token_versions():
    import torch

    from streamrl_cli.trainer.algo import is_weights
    from streamrl_cli.trainer.loop.batch import collate

    gens, records, checkpoints, rollouts = partial_run(
        "sync-stream", 3, lambda rid: rid in ("it0/c/1", "it0/c/4")
    )
    # Iteration 0 trains the four fast groups and pauses the two slow ones, which go on first in
    # iteration 1 (under version 1) from their three tokens; it draws four fresh prompts.
    assert [r["rollout/paused_groups"] for r in records] == [2, 2, 0]  # the last one aborts its extras
    assert gens.cancelled[0] == ["it0/c/1", "it0/c/4"]
    resumed = [r for r in gens.requests if "#p" in r.prompt_id]
    got = [(r.prompt_id, r.sample_indices, r.prompt_token_ids, r.sampling.max_tokens) for r in resumed[:4]]
    assert got == [
        ("it1/c/1#p1", [0], [5, 6, 7, 7, 7], 61), ("it1/c/1#p2", [1], [5, 6, 7, 7, 7], 61),
        ("it1/c/4#p3", [0], [5, 6, 7, 7, 7], 61), ("it1/c/4#p4", [1], [5, 6, 7, 7, 7], 61),
    ]  # fmt: skip
    fresh = [r.prompt_id for r in gens.requests if r.prompt_id.startswith("it1/") and "#" not in r.prompt_id]
    assert fresh == ["it1/c/6", "it1/c/7", "it1/c/8", "it1/c/9"]
    by_it = [sorted({r.sample.group_id for r in rollouts if r.iteration == i}) for i in range(3)]
    assert by_it[0] == ["it0/c/0", "it0/c/2", "it0/c/3", "it0/c/5"]
    assert by_it[1] == ["it1/c/1", "it1/c/4", "it1/c/6", "it1/c/7"]
    # Each sample trained once: every (prompt, index) once over the run.
    keys = [(r.sample.group_id.split("/", 1)[1], r.sample.sample_index) for r in rollouts]
    assert len(keys) == len(set(keys)) == 24
    # The joined sample: 3 tokens of version 0, then 2 of version 1; oldest token's staleness 1.
    (s,) = [r for r in rollouts if r.sample.group_id == "it1/c/1" and r.sample.sample_index == 0]
    assert s.sample.token_ids == [7, 7, 7, 8, 8] and s.sample.token_versions == [0, 0, 0, 1, 1]
    assert s.sample.weight_version == 0 and s.staleness == 1 and s.prompt_tokens == [5, 6]
    assert records[1]["rollout/resumed_samples"] == 4 and records[1]["staleness/max"] == 1
    # 12 tokens of staleness 1 among the iteration's tokens (4 resumed × 3; fresh ones: 0).
    assert records[1]["staleness/token_max"] == 1
    assert records[1]["staleness/token_mean"] == pytest.approx(12 / records[1]["tokens"])
    # The importance weights use each token's own behaviour log-prob: with the trainer's log-probs
    # at 0, min(exp(0 - b), 2) = e^0.5 for the first three tokens and e^0.25 for the last two.
    mb = collate([s])
    w = is_weights(torch.zeros_like(mb.behaviour_logp), mb.behaviour_logp, mb.mask, 2.0, "token")
    hand = [0.0, *[0.5**0 * 2.718281828459045**0.5] * 3, *[2.718281828459045**0.25] * 2]
    torch.testing.assert_close(w[0], torch.tensor(hand), atol=1e-6, rtol=0)
    # Paused groups are not checkpointed: their prompts are drawn again first by a resumed run.
    assert checkpoints[0]["sampler"]["returned"] == [1, 4]


class TurnPausing(Pausing):
    """Pausing, for multi-turn trajectories paused between turns: a slow one comes back with one
    model turn of 3 tokens, parked on generator-0. Its resumption ("#p" with `resume`) comes back
    whole from generator-0 while it holds it: the 3 kept tokens, then a turn of 2 under the version
    served now; elsewhere, or once `lost`, it runs from its start (a turn of 2 tokens, 9s)."""

    def __init__(self, events: list, slow, lost: bool = False):
        super().__init__(events, slow)
        self.kept: dict[str, Sample] = {}
        self.lost = lost
        self.resumed: list = []  # the resumptions, as they came

    def cancel(self, ids, keep=False):
        super().cancel(ids, keep)
        for k, s in enumerate(self.back):
            if s.token_ids:
                s = msgspec.structs.replace(
                    s, loss_mask=[1] * 3, generator="generator-0",
                    episode=Episode(turns=1, model_tokens=3, stop="abort", parked=True),
                )  # fmt: skip
                self.back[k] = s
                self.kept[f"{s.prompt_id}/{s.sample_index}"] = s

    def get(self, timeout=None):
        if self.back or not (self.queue and "#p" in self.queue[0][0].prompt_id):
            return super().get(timeout)
        r, i = self.queue.popleft()
        self.resumed.append(r)
        start = self.kept.pop(r.resume, None) if r.target == "generator-0" and not self.lost else None
        done = Episode(
            turns=2 if start else 1, model_tokens=5 if start else 2, stop="done", resumed=bool(start)
        )
        out = Sample(prompt_id=r.prompt_id, sample_index=i, group_id=r.group_id, token_ids=[9, 9],
                     logprobs=[-0.25] * 2, loss_mask=[1, 1], finish_reason="stop",
                     weight_version=self.version, episode=done)  # fmt: skip
        if start is None:
            return out
        v = start.weight_version
        return msgspec.structs.replace(
            out, token_ids=[7, 7, 7, 8, 8], logprobs=[-0.5] * 3 + [-0.25] * 2, loss_mask=[1] * 5,
            weight_version=v, token_versions=[v] * 3 + [self.version] * 2,
        )  # fmt: skip


@pytest.mark.parametrize("lost", [False, True])
def test_a_trajectory_paused_between_turns_goes_on_where_it_was_kept_or_starts_over(lost):
    gens = TurnPausing([], lambda rid: rid in ("it0/c/1", "it0/c/4"), lost=lost)
    records, _, rounds = tail_run(gens, "sync-stream", 3, partial=True)
    rollouts = [r for rnd in rounds for r in rnd]
    # Resumed where it was kept: on generator-0, under the key of its paused sample, from the prompt
    # (the generator holds its tokens and its environment), with the whole budget.
    got = [
        (r.prompt_id, r.resume, r.target, r.prompt_token_ids, r.sampling.max_tokens) for r in gens.resumed[:4]
    ]
    assert got == [
        (f"it1/c/{c}#p{n}", f"it0/c/{c}/{i}", "generator-0", [5, 6], 64)
        for n, (c, i) in enumerate([(1, 0), (1, 1), (4, 0), (4, 1)], 1)
    ]
    (s,) = [r for r in rollouts if r.sample.group_id == "it1/c/1" and r.sample.sample_index == 0]
    if not lost:  # went on: the kept turn (version 0) and the next (version 1), never twice
        assert s.sample.token_ids == [7, 7, 7, 8, 8] and s.sample.token_versions == [0, 0, 0, 1, 1]
        assert s.staleness == 1 and records[1]["rollout/discarded_tokens"] == 0
    else:  # its generator no longer holds it: run from its start, the kept turn lost (counted)
        assert s.sample.token_ids == [9, 9] and s.staleness == 0
        assert records[1]["rollout/discarded_tokens"] == 4 * 3
    assert records[1]["rollout/resumed_samples"] == (0 if lost else 4)
    keys = [(r.sample.group_id.split("/", 1)[1], r.sample.sample_index) for r in rollouts]
    assert len(keys) == len(set(keys)) == 24  # each sample trained once, none lost


def test_a_sample_paused_past_the_staleness_bound_starts_over():
    # it0/c/1 is slow, and so are its resumptions: paused again at iteration 1's close, its samples
    # would go on in iteration 2 with tokens of version 0, two versions old (max_staleness 1): they
    # start over from the prompt, and their tokens so far are counted as discarded.
    slow = lambda rid: rid == "it0/c/1" or rid.startswith("it1/c/1#p")  # noqa: E731
    gens, records, _, rollouts = partial_run("sync-stream", 3, slow)
    again = [r for r in gens.requests if r.prompt_id.startswith("it2/c/1#p")]
    assert [(r.prompt_token_ids, r.sampling.max_tokens) for r in again] == [([5, 6], 64)] * 2
    assert records[2]["rollout/discarded_tokens"] == 2 * 6  # 3 of version 0 and 3 of version 1, each
    assert all(r.staleness <= 1 for r in rollouts)
    assert max(rec["staleness/token_max"] for rec in records) <= 1
    keys = [(r.sample.group_id.split("/", 1)[1], r.sample.sample_index) for r in rollouts]
    assert len(keys) == len(set(keys))


def test_partial_rollout_in_async_mode_resumes_in_the_batch_drawn_already():
    gens, records, checkpoints, rollouts = partial_run("async", 3, lambda rid: rid in ("it0/c/1", "it0/c/4"))
    assert records[0]["rollout/paused_groups"] == 2
    resumed = sorted({r.prompt_id.split("#")[0] for r in gens.requests if "#p" in r.prompt_id})
    assert resumed[:2] == ["it1/c/1", "it1/c/4"]
    assert all(r.staleness <= 1 for r in rollouts)
    keys = [(r.sample.group_id.split("/", 1)[1], r.sample.sample_index) for r in rollouts]
    assert len(keys) == len(set(keys))
    # Batch 1 was drawn before batch 0 closed: the paused prompts are saved with its sampler state.
    assert checkpoints[0]["sampler"]["returned"][-2:] == [1, 4]
    # The draws after it are smaller by what batch 1 took on: 6 groups in flight per batch at most.
    assert [len([r for r in gens.requests if r.prompt_id.startswith(f"it{j}/") and "#" not in r.prompt_id])
            for j in range(3)] == [6, 6, 4]  # fmt: skip
