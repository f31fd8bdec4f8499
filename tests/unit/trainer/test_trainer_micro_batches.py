"""train.micro_batch_tokens: `batch.by_tokens` cuts a batch's rollouts into micro-batches of at most
`rows` rollouts and `tokens` tokens (prompt + response), in order, greedily."""

from __future__ import annotations

import random

import pytest

from streamrl_cli.trainer.loop.batch import Rollout, by_tokens
from streamrl_cli.transport.wire import Sample


def rollout(name: str, prompt: int, response: int) -> Rollout:
    sample = Sample(
        prompt_id=name, sample_index=0, token_ids=[1] * response, logprobs=[0.0] * response,
        finish_reason="stop", weight_version=0,
    )  # fmt: skip
    return Rollout(prompt_tokens=[2] * prompt, sample=sample, reward=0.0)


def names(batches: list[list[Rollout]]) -> list[list[str]]:
    return [[r.sample.prompt_id for r in mb] for mb in batches]


def test_no_token_bound_is_the_row_count_alone():
    rows = [rollout(str(i), 5, 1000 * i) for i in range(7)]
    assert names(by_tokens(rows, rows=3, tokens=0)) == [["0", "1", "2"], ["3", "4", "5"], ["6"]]


def test_cut_greedily_in_order_at_the_token_bound():
    # tokens: a 10, b 20, c 30, d 5, e 40
    rows = [
        rollout("a", 4, 6),
        rollout("b", 4, 16),
        rollout("c", 10, 20),
        rollout("d", 1, 4),
        rollout("e", 8, 32),
    ]
    assert names(by_tokens(rows, rows=4, tokens=40)) == [["a", "b"], ["c", "d"], ["e"]]
    assert names(by_tokens(rows, rows=4, tokens=35)) == [["a", "b"], ["c", "d"], ["e"]]
    assert names(by_tokens(rows, rows=4, tokens=30)) == [["a", "b"], ["c"], ["d"], ["e"]]
    assert names(by_tokens(rows, rows=1, tokens=1000)) == [["a"], ["b"], ["c"], ["d"], ["e"]]


def test_a_rollout_over_the_bound_is_a_micro_batch_of_its_own():
    rows = [
        rollout("short", 2, 3),
        rollout("long", 10, 500),
        rollout("short2", 2, 3),
        rollout("short3", 1, 1),
    ]
    assert names(by_tokens(rows, rows=8, tokens=100)) == [["short"], ["long"], ["short2", "short3"]]


def test_bounds_hold_and_nothing_is_lost_or_reordered():
    rng = random.Random(0)
    rows = [rollout(str(i), rng.randint(1, 50), rng.randint(1, 400)) for i in range(200)]
    for cap_rows, cap_tokens in ((1, 0), (4, 0), (4, 300), (16, 1000), (64, 50)):
        batches = by_tokens(rows, rows=cap_rows, tokens=cap_tokens)
        assert [r for mb in batches for r in mb] == rows
        assert all(1 <= len(mb) <= cap_rows for mb in batches)
        for mb in batches:
            used = sum(len(r.prompt_tokens) + r.response_len for r in mb)
            assert not cap_tokens or used <= cap_tokens or len(mb) == 1
        assert by_tokens(rows, rows=cap_rows, tokens=cap_tokens) == batches  # deterministic


def test_empty_and_bad_bounds():
    assert by_tokens([], rows=4, tokens=100) == []
    with pytest.raises(ValueError, match="rows"):
        by_tokens([rollout("a", 1, 1)], rows=0, tokens=0)
    with pytest.raises(ValueError, match="tokens"):
        by_tokens([rollout("a", 1, 1)], rows=1, tokens=-1)
