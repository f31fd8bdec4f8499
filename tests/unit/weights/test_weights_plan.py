"""Pure planning of weight transfers: buckets, the relay's stream layout, the chunk state machine."""

from __future__ import annotations

import random

import pytest

from streamrl_cli.weights.plan import ChunkPlanner, chunk_count, chunk_range, plan_buckets, stream_layout


def test_plan_buckets_per_dtype_with_size_limit_and_order():
    entries = [
        ("a", "float32", (4,), 16),
        ("b", "bfloat16", (8,), 16),
        ("c", "float32", (2, 2), 16),
        ("d", "float32", (100,), 400),  # larger than a bucket: a bucket of its own
        ("e", "float32", (), 4),
        ("f", "bfloat16", (0,), 0),
    ]
    plan = plan_buckets(entries, bucket_bytes=32, version=5)
    got = [(b.dtype, b.nbytes, [(t.name, t.offset) for t in b.tensors]) for b in plan.buckets]
    assert got == [
        ("float32", 400, [("d", 0)]),  # alone, and out first: it needs no packing
        ("float32", 32, [("a", 0), ("c", 16)]),
        ("float32", 4, [("e", 0)]),
        ("bfloat16", 16, [("b", 0), ("f", 16)]),
    ]
    assert plan.version == 5 and plan.nbytes == 452
    solo = plan_buckets(entries, bucket_bytes=1000, solo_bytes=16)  # 16 bytes and up: alone, sent in place
    assert [[t.name for t in b.tensors] for b in solo.buckets] == [["a"], ["c"], ["d"], ["e"], ["b"], ["f"]]
    assert plan_buckets([], 32).buckets == ()
    with pytest.raises(ValueError):
        plan_buckets(entries, 0)


def test_stream_layout_aligns_every_tensor_and_chunks_cover_the_stream():
    specs, total = stream_layout([("a", "float32", (3,), 12), ("b", "int8", (1,), 1), ("c", "bool", (0,), 0),
                                  ("d", "bfloat16", (40,), 80)])  # fmt: skip
    assert [(s.name, s.offset) for s in specs] == [("a", 0), ("b", 64), ("c", 128), ("d", 128)]
    assert total == 208
    assert chunk_count(total, 100) == 3 and chunk_count(0, 100) == 1 and chunk_count(200, 100) == 2
    assert [chunk_range(i, total, 100) for i in range(3)] == [(0, 100), (100, 200), (200, 208)]


def test_chunk_planner_take_verify_fail_release():
    p = ChunkPlanner(6, max_attempts=2, have=[4])
    assert p.take(0, 2) == [0, 1] and p.take(1, 2) == [2, 3] and p.take(1, 5) == [5]
    assert p.missing() == 0 and p.in_flight(1) == [2, 3, 5]
    p.verified_ok(0)
    p.failed(1, "digest mismatch")  # corrupted: first in line again
    assert p.take(0, 1) == [1] and p.attempts == {1: 1}
    assert p.release(1) == [2, 3, 5]  # stream 1 broke: its chunks are missing again, in order
    assert p.in_flight() == [1] and p.take(0, 10) == [2, 3, 5]
    for c in (1, 2, 3, 5):
        p.verified_ok(c)
    assert p.complete and p.done and p.error is None
    with pytest.raises(ValueError):
        p.failed(2, "not in flight")
    q = ChunkPlanner(2, max_attempts=2)
    for _ in range(2):
        (c,) = q.take(0, 1)
        q.failed(c, "bad")
    assert q.error == "chunk 0 failed verification 2 times (last: bad)" and q.done and not q.complete
    assert q.take(0, 5) == []  # nothing more is handed out once it failed for good
    with pytest.raises(ValueError):
        q.verified_ok(1)  # never requested


def test_chunk_planner_random_schedules_deliver_each_chunk_verified_once():
    for seed in range(300):
        rng = random.Random(seed)
        n, streams = rng.randint(1, 12), rng.randint(1, 4)
        p = ChunkPlanner(n, max_attempts=1000)
        taken: dict[int, list[int]] = {s: [] for s in range(streams)}
        while not p.done:
            s = rng.randrange(streams)
            op = rng.random()
            if op < 0.4:
                taken[s] += p.take(s, rng.randint(1, 3))
            elif op < 0.8 and taken[s]:
                c = taken[s].pop(0)
                p.verified_ok(c) if rng.random() < 0.8 else p.failed(c, "bad")
            elif op < 0.9:
                assert sorted(p.release(s)) == sorted(taken[s]), seed
                taken[s] = []
            owned = sorted(c for t in taken.values() for c in t)
            assert owned == p.in_flight(), seed
            assert len(set(owned) | p.verified) == len(owned) + len(p.verified), seed  # never both
        assert p.verified == set(range(n)), seed
