"""Output-length rankers: quality metrics, the oracle/random/history/cached rankers, the learned
ranker's background refresh and what it learns on the built-in task, and `streamrl rank`."""

from __future__ import annotations

import json
import threading
import time

import pytest
from support.helpers import streamrl

from streamrl_cli.ranker import QualityTracker, RandomRanker, Ranker, RankerError, make_ranker, quality
from streamrl_cli.ranker.cache import CachedRanker, load_cache, write_cache
from streamrl_cli.ranker.history import HistoryRanker
from streamrl_cli.ranker.quality import average_ranks, spearman
from streamrl_cli.recipe.schema import SkewnessConfig, TaskConfig
from streamrl_cli.tasks import Prompt, make_task
from streamrl_cli.tasks.builtin import RepeatTask


def builtin(num_prompts: int) -> TaskConfig:
    """The built-in task with outputs of up to 64 tokens (the local recipe's)."""
    return TaskConfig(name="builtin", num_prompts=num_prompts, max_output_len=64)


def prompts(n: int) -> list[Prompt]:
    return [Prompt(f"p/{i}", f"prompt {i}") for i in range(n)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from streamrl_cli.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("ranker") / "tiny")


# --- quality ------------------------------------------------------------------------------------


def test_quality_perfect_and_reversed():
    true = [float(i) for i in range(100)]
    assert quality(true, true) == {
        "recall@20": 1.0,
        "recall@10": 1.0,
        "recall@5": 1.0,
        "spearman": 1.0,
        "n": 100,
    }
    backwards = quality(true, [-x for x in true])
    assert backwards["spearman"] == pytest.approx(-1.0)
    assert backwards["recall@20"] == backwards["recall@10"] == backwards["recall@5"] == 0.0
    # Only the order counts: any increasing map of the truth is perfect.
    assert quality(true, [x**3 + 7 for x in true])["spearman"] == pytest.approx(1.0)


def test_spearman_ties_get_average_ranks():
    assert average_ranks([3, 1, 3, 2]) == [3.5, 1.0, 3.5, 2.0]
    # ranks (1, 2.5, 2.5, 4) against (1, 2, 3, 4): 4.5 / sqrt(4.5 * 5)
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(4.5 / (4.5 * 5) ** 0.5)
    assert spearman([1, 2, 3], [5, 5, 5]) == 0.0  # a constant prediction carries no order
    with pytest.raises(ValueError):
        quality([1, 2], [1])


def test_quality_tracker_keeps_the_last_iteration():
    tracker = QualityTracker()
    assert tracker.metrics() == {}
    tracker.observe([1, 2, 3, 4, 5], [5, 4, 3, 2, 1])
    tracker.observe([1, 2, 3, 4, 5], [1, 2, 3, 4, 5])
    assert tracker.iterations == 2
    assert tracker.metrics()["ranker/spearman"] == pytest.approx(1.0)
    assert tracker.metrics()["ranker/recall@20"] == 1.0


# --- factory, oracle, random ----------------------------------------------------------------------


def test_oracle_ranks_the_builtin_task_perfectly():
    task = make_task(builtin(1000), seed=3)
    ranker = make_ranker(SkewnessConfig(ranker="oracle"), model_path=None, task=task, seed=3)
    ps = list(task.prompts())
    q = quality([RepeatTask.expected_length(p) for p in ps], ranker.rank(ps))
    assert q["recall@20"] == q["recall@10"] == q["recall@5"] == 1.0
    assert q["spearman"] == pytest.approx(1.0)


def test_factory_kinds_and_errors(tmp_path):
    task = make_task(builtin(10))
    assert make_ranker(SkewnessConfig(ranker="none"), model_path=None, task=task) is None
    assert make_ranker(SkewnessConfig(), model_path=None, task=task) is None
    with pytest.raises(RankerError, match="unknown ranker 'psychic'.*valid: none, learned"):
        make_ranker(SkewnessConfig(ranker="psychic"), model_path=None, task=task)
    with pytest.raises(RankerError, match="ranker_model.*does not exist"):
        learned = SkewnessConfig(ranker="learned", ranker_model=str(tmp_path / "nope"))
        make_ranker(learned, model_path=None, task=task)
    with pytest.raises(RankerError, match="model.path.*does not exist"):
        make_ranker(SkewnessConfig(ranker="history"), model_path=str(tmp_path), task=task)

    from streamrl_cli.tasks.datasets import DatasetTask

    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "hi"}\n')
    dataset = DatasetTask(data, reward=lambda prompts, completions, **_: [0.0] * len(completions))
    with pytest.raises(RankerError, match="oracle.*knows no expected output lengths"):
        make_ranker(SkewnessConfig(ranker="oracle"), model_path=None, task=dataset)


def test_random_ranker_is_seeded_per_prompt_and_about_chance():
    task = make_task(builtin(5000), seed=1)
    ps = list(task.prompts())
    scores = RandomRanker(7).rank(ps)
    assert RandomRanker(7).rank(ps[100:200]) == scores[100:200]  # batch-independent
    assert RandomRanker(8).rank(ps[:50]) != scores[:50]
    assert 0.12 < quality([RepeatTask.expected_length(p) for p in ps], scores)["recall@20"] < 0.28


# --- history --------------------------------------------------------------------------------------


class FakeRanker(Ranker):
    """Predicts a fixed length; records what it was asked and taught."""

    def __init__(self, length: float = 10.0):
        self.length = length
        self.ranked: list[str] = []
        self.updates: list[tuple[list[str], list[float]]] = []
        self.closed = False

    def rank(self, prompts):
        self.ranked += [p.prompt_id for p in prompts]
        return [self.length] * len(prompts)

    def update(self, prompts, lengths):
        self.updates.append(([p.prompt_id for p in prompts], list(lengths)))

    def close(self):
        self.closed = True


def test_history_scores_seen_prompts_by_their_lengths_and_the_rest_by_the_fallback():
    ps = prompts(4)
    fallback = FakeRanker(10.0)
    ranker = HistoryRanker(fallback)
    assert ranker.rank(ps) == [10.0] * 4  # nothing seen yet: all fallback, no bias yet
    fallback.ranked.clear()
    ranker.update(ps[:2], [100.0, 30.0])
    assert fallback.updates == [(["p/0", "p/1"], [100.0, 30.0])]  # the fallback learns too
    fallback.ranked.clear()
    scores = ranker.rank(ps)
    assert scores[:2] == [100.0, 30.0]
    assert fallback.ranked == ["p/2", "p/3"]  # asked only about the unseen prompts
    # The fallback predicted 10 where the policy wrote 100 and 30: its scores are lifted onto the
    # history's scale (geometric mean of 101/11 and 31/11), so unseen prompts rank between.
    assert 30.0 < scores[2] == scores[3] < 100.0
    ranker.close()
    assert fallback.closed


def test_history_follows_a_drifting_prompt():
    ranker = HistoryRanker(None, window=2)
    p = prompts(2)
    ranker.update(p[:1], [10.0])
    ranker.update(p[:1], [20.0])
    ranker.update(p[:1], [40.0])
    assert ranker.seen["p/0"].count == 3
    assert ranker.rank(p)[0] == pytest.approx(27.5)  # forgets: 15 → halfway to 40
    assert ranker.rank(p)[1] == pytest.approx(27.5)  # no fallback: unseen get the mean of history


# --- cache ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["scores.json", "scores.jsonl"])
def test_cache_round_trip_and_cached_ranker(tmp_path, name):
    path = write_cache(tmp_path / name, {"p/0": 5.0, "p/1": 50.0}, {"ranker": "oracle"})
    cache = load_cache(path)
    assert cache.scores == {"p/0": 5.0, "p/1": 50.0}
    assert cache.meta["ranker"] == "oracle" and cache.meta["created"]
    inner = FakeRanker(20.0)
    ranker = CachedRanker(cache, inner)
    assert ranker.rank(prompts(3)) == [5.0, 50.0, 20.0]
    assert inner.ranked == ["p/2"]


def test_make_ranker_starts_from_a_cache(tmp_path):
    task = make_task(builtin(20))
    ps = list(task.prompts())
    path = write_cache(tmp_path / "c.json", {ps[0].prompt_id: 1000.0}, {})
    ranker = make_ranker(SkewnessConfig(ranker="oracle", cache=str(path)), model_path=None, task=task)
    scores = ranker.rank(ps[:2])
    assert scores == [1000.0, float(RepeatTask.expected_length(ps[1]))]


def test_unreadable_caches_are_clear_errors(tmp_path):
    with pytest.raises(RankerError, match="cannot be read.*streamrl rank"):
        load_cache(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    for text, why in [("{oops", "not a ranker cache"), ('{"meta": {}}', '"scores"'), ("[1, 2]", '"scores"')]:
        bad.write_text(text)
        with pytest.raises(RankerError, match=why):
            load_cache(bad)
    lines = tmp_path / "bad.jsonl"
    lines.write_text('{"meta": {}}\n{"prompt_id": "a"}\n')
    with pytest.raises(RankerError, match="line 2 has no prompt_id or score"):
        load_cache(lines)
    task = make_task(builtin(5))
    with pytest.raises(RankerError, match="skewness.cache"):
        make_ranker(SkewnessConfig(ranker="oracle", cache=str(bad)), model_path=None, task=task)


# --- the learned ranker ---------------------------------------------------------------------------


def test_learned_ranker_never_blocks_on_a_refresh(tiny):
    import torch

    from streamrl_cli.ranker.learned import LearnedRanker

    threads = torch.get_num_threads()
    ranker = LearnedRanker(tiny, steps_per_update=2)
    release, started = threading.Event(), threading.Event()
    train = ranker._train

    def slow_train(data, steps):  # a refresh that lasts until the test says so
        started.set()
        release.wait(30)
        return train(data, steps)

    ranker._train = slow_train
    ps = list(make_task(builtin(64)).prompts())
    before = ranker.rank(ps)
    ranker.update(ps[:32], [RepeatTask.expected_length(p) for p in ps[:32]])
    assert started.wait(10)
    t0 = time.monotonic()
    assert ranker.rank(ps) == before  # the old snapshot serves while the refresh runs
    ranker.update(ps[32:], [RepeatTask.expected_length(p) for p in ps[32:]])  # returns at once too
    assert time.monotonic() - t0 < 5
    assert not ranker.wait_idle(timeout=0.1) and ranker.refreshes == 0
    release.set()
    assert ranker.wait_idle(timeout=30)
    assert ranker.refreshes == 2  # the second update, queued during the first refresh, ran after it
    assert ranker.rank(ps) != before and ranker.last_error is None
    assert torch.get_num_threads() == threads  # the refresh thread's torch threads are its own
    ranker.close()
    assert not ranker._thread.is_alive()


def test_learned_ranker_learns_the_long_tail_online(tiny):
    """THE test: the tiny model, taught online in iterations of 32 prompts, finds the long tail of
    held-out prompts far better than chance."""
    from streamrl_cli.ranker.learned import LearnedRanker

    task = make_task(builtin(600), seed=0)
    ps = list(task.prompts())
    train, held = ps[:384], ps[384:]
    true = [RepeatTask.expected_length(p) for p in held]
    t0 = time.monotonic()
    ranker = LearnedRanker(tiny, seed=0)
    load_s = time.monotonic() - t0
    chance = quality(true, RandomRanker(0).rank(held))
    before = quality(true, ranker.rank(held))
    tracker = QualityTracker()
    online = []
    t0 = time.monotonic()
    for start in range(0, len(train), 32):  # one RL iteration per chunk
        chunk = train[start : start + 32]
        lengths = [RepeatTask.expected_length(p) for p in chunk]
        online.append(tracker.observe(lengths, ranker.rank(chunk))["spearman"])  # as dispatched
        ranker.update(chunk, lengths)
        assert ranker.wait_idle(timeout=60)  # an iteration outlasts a refresh
    train_s = time.monotonic() - t0
    t0 = time.monotonic()
    after = quality(true, ranker.rank(held))
    rank_s = time.monotonic() - t0
    # Held-out prompts whose very text (word, count) never came up in training: read, not recalled.
    texts = {p.text for p in train}
    novel = [p for p in held if p.text not in texts]
    novel_rho = spearman([RepeatTask.expected_length(p) for p in novel], ranker.rank(novel))
    ranker.close()

    def show(q: dict) -> str:
        return " ".join(f"{k} {v:.3f}" for k, v in q.items() if k != "n")

    print(f"\nheld-out prompts: {len(held)}; refreshes {ranker.refreshes}, last loss {ranker.last_loss:.3f}")
    print(f"random           {show(chance)}")
    print(f"learned, before  {show(before)}")
    print(f"learned, after   {show(after)}")
    print(f"learned, after, on {len(novel)} prompts with texts unseen in training: spearman {novel_rho:.3f}")
    print("online spearman per iteration: " + " ".join(f"{s:.2f}" for s in online))
    print(
        f"load {load_s:.1f} s, {len(online)} updates + refreshes {train_s:.1f} s, rank {rank_s * 1000:.0f} ms"
    )
    assert chance["recall@20"] < 0.4
    assert after["recall@20"] >= 0.6 and after["recall@10"] >= 0.5
    assert after["spearman"] >= 0.8
    assert after["recall@20"] >= chance["recall@20"] + 0.3
    assert len(novel) >= 10 and novel_rho >= 0.6
    # Scores are lengths in tokens (the history ranker and caches mix them with observed lengths).
    mean_pred = sum(ranker.rank(held)) / len(held)
    assert 0.5 < mean_pred / (sum(true) / len(true)) < 2.0


# --- streamrl rank --------------------------------------------------------------------------------


def test_cli_rank_oracle_writes_a_cache(tmp_path):
    out = tmp_path / "f.json"
    r = streamrl("rank", "local", "--out", str(out), "--limit", "200", "skewness.ranker=oracle")
    assert r.returncode == 0, r.stderr
    assert f"wrote {out}: 200 scores" in r.stdout
    cache = load_cache(out)
    assert cache.meta["ranker"] == "oracle" and cache.meta["task"] == "repeat"
    ps = list(make_task(builtin(4096)).prompts())[:200]  # the local recipe's task, seed 0
    assert cache.scores == {p.prompt_id: float(RepeatTask.expected_length(p)) for p in ps}


@pytest.mark.parametrize(
    "args, message",
    [
        (["skewness.ranker=none"], "skewness.ranker is none"),
        (["skewness.ranker=psychic"], "skewness.ranker: 'psychic' is not one of"),
        (
            ["skewness.ranker=learned", "skewness.ranker_model=/nonexistent/m"],
            "/nonexistent/m does not exist",
        ),
        (["skewness.ranker=oracle", "--fit", "x.jsonl"], "--fit teaches a learned or history ranker"),
        (
            ["skewness.ranker=history", "skewness.ranker_model=/nonexistent/m"],
            "/nonexistent/m does not exist",
        ),
    ],
)
def test_cli_rank_errors_without_tracebacks(tmp_path, args, message):
    r = streamrl("rank", "local", "--out", str(tmp_path / "f.json"), *args)
    assert r.returncode != 0
    assert message in " ".join(r.stderr.split()), r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "f.json").exists()


@pytest.mark.slow
def test_cli_rank_learned_with_fit(tmp_path, tiny):
    task = make_task(builtin(4096))
    fit = tmp_path / "lengths.jsonl"
    rows = [
        {"prompt_id": p.prompt_id, "length": RepeatTask.expected_length(p)} for p in task.prompts()[1000:1300]
    ]
    rows.append({"prompt": "repeat fox 33:", "length": 34})
    fit.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "scores.jsonl"
    args = ["--out", str(out), "--limit", "300", "--fit", str(fit)]
    one_thread = {"OMP_NUM_THREADS": "1"}  # a tiny model on shared cores: threads only contend
    r = streamrl(
        "rank", "local", *args, "skewness.ranker=learned", f"skewness.ranker_model={tiny}", env=one_thread
    )
    assert r.returncode == 0, r.stderr
    cache = load_cache(out)
    assert cache.meta["fit"] == str(fit) and cache.meta["model"] == str(tiny)
    ps = task.prompts()[:300]
    q = quality([RepeatTask.expected_length(p) for p in ps], [cache.scores[p.prompt_id] for p in ps])
    print(f"\nstreamrl rank --fit (300 pairs): {q}")
    assert q["recall@20"] >= 0.5
    fit.write_text('{"prompt_id": "repeat/99999", "length": 3}\n')
    r = streamrl("rank", "local", *args, "skewness.ranker=learned", f"skewness.ranker_model={tiny}")
    assert r.returncode == 2 and "is not in task 'repeat'" in r.stderr and "Traceback" not in r.stderr
