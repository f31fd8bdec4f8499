"""Partial rollout pauses a trajectory between turns: it finishes the model turn in flight, comes
back as far as it got, and its generator keeps its environment and tokens, so that resuming it
there goes on from its next turn; resumed where it is not kept, it runs from its start.

The inference engine is scripted and each turn waits for the test to let it finish (an event), so
that a pause lands while a turn is in flight; the environment runs for real in its worker process.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from support.agent import Scripted

from streamrl_cli.agent.env_host import EnvSettings
from streamrl_cli.generator.engine import GenerationRequest, SamplingSpec
from streamrl_cli.generator.multiturn import AgentEngine
from streamrl_cli.generator.stream import to_samples
from streamrl_cli.tasks.calc import CHAT_TEMPLATE, SPECIAL_TOKENS

ENVS = Path(__file__).with_name("envs.py")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import AutoTokenizer

    from streamrl_cli.models.tiny import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("pause") / "tiny")
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS)})
    tok.chat_template = CHAT_TEMPLATE
    out = tmp_path_factory.mktemp("pause") / "tok"
    tok.save_pretrained(out)
    return out


class Gated(Scripted):
    """Scripted turns, each answered only once the test opens the gate (`asked` says one came)."""

    def __init__(self, turns):
        super().__init__(turns)
        self.asked = asyncio.Event()
        self.gate = asyncio.Event()
        self.aborted: list[str] = []

    async def _gen(self, requests):
        async for req in requests:  # (the scripted engine records each request)
            self.asked.set()
            await self.gate.wait()
            async for res in super()._gen(_one(req)):
                yield res

    async def abort(self, request_ids):
        self.aborted += list(request_ids)


async def _one(req):
    yield req


def _request(prompt, rid, prompt_id, *, resume=""):
    return GenerationRequest(
        request_id=rid, prompt_token_ids=prompt, sampling=SamplingSpec(n=1, max_tokens=200, seed=7),
        meta={"prompt_id": prompt_id, "group_id": prompt_id, "sample_indices": [0], "env": {},
              "resume": resume},
    )  # fmt: skip


def _setup(model_dir, turns, **kw):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = [tok(f"turn {k}", add_special_tokens=False).input_ids + [end] for k in range(len(turns))]
    inner = Gated(
        [(t, [-0.1 * (k + 1)] * len(t), v, "stop") for k, (t, v) in enumerate(zip(ids, turns, strict=True))]
    )
    settings = EnvSettings(env=f"{ENVS}:Scripted", workers=1, timeout_s=30)
    engine = AgentEngine(
        inner, settings, model_path=str(model_dir), max_turns=6, max_turn_tokens=16,
        chat_template=CHAT_TEMPLATE, **kw,
    )  # fmt: skip
    prompt = tok("<|im_start|>user\nplay<|im_end|>\n", add_special_tokens=False).input_ids
    return engine, inner, prompt, ids


async def _paused(engine, inner, req, *, pause=True):
    """Run `req` until its first turn is asked, pause (or cancel) it, then let the turn finish."""
    inner.gate.clear()
    inner.asked.clear()
    run = asyncio.ensure_future(_collect(engine, req))
    await inner.asked.wait()
    await (engine.pause_requests if pause else engine.abort)([req.request_id])
    inner.gate.set()
    return await run


async def _collect(engine, req):
    (result,) = [r async for r in engine.generate([req])]
    return result


def test_a_paused_trajectory_goes_on_from_its_next_turn_where_it_is_kept(model_dir):
    engine, inner, prompt, (t1, t2, t3) = _setup(model_dir, turns=[1, 2, 3])

    async def go():
        await engine.start()
        try:
            paused = await _paused(engine, inner, _request(prompt, "it0/p1#0", "it0/p1"))
            kept = set(engine.parked)
            resumed = await _collect(engine, _request(prompt, "it1/p1#p1#1", "it1/p1#p1", resume="it0/p1/0"))
            return paused, kept, resumed, set(engine.parked)
        finally:
            await engine.close()

    paused, kept, resumed, left = asyncio.run(go())
    (p,) = paused.completions
    # The turn in flight finished (it was not aborted in the engine) and came back as far as it got.
    assert inner.aborted == [] and p.finish_reason == "abort" and p.episode["parked"]
    assert p.token_ids[-len(t1) :] == t1 and p.episode["turns"] == 1 and kept == {"it0/p1/0"}
    (s,) = to_samples(paused, "generator-0")
    assert s.episode.parked and s.finish_reason == "abort"
    # Resumed: the environment answers the kept turn (its first step: "obs1"), then turns 2 and 3;
    # the environment's third step ends it. A restarted one would have reset and taken three more.
    (r,) = resumed.completions
    assert r.finish_reason == "stop" and r.episode["stop"] == "done" and r.episode["turns"] == 3
    assert r.episode["env_reward"] == pytest.approx(0.25 + 0.25 + 1.0) and not r.episode["parked"]
    assert r.episode["resumed"] and not p.episode["resumed"]
    assert r.token_ids[: len(p.token_ids)] == p.token_ids  # sent whole: the kept tokens first
    assert r.loss_mask[: len(p.loss_mask)] == p.loss_mask and r.logprobs[: len(p.logprobs)] == p.logprobs
    assert len(inner.requests) == 3  # no turn generated twice
    assert inner.prompts[1][: len(prompt) + len(p.token_ids)] == prompt + p.token_ids
    # Every model token keeps the version that sampled it.
    model_versions = [v for v, m in zip(r.token_versions, r.loss_mask, strict=True) if m]
    assert model_versions == [1] * len(t1) + [2] * len(t2) + [3] * len(t3)
    assert (resumed.weight_version, resumed.weight_version_end) == (1, 3)
    assert left == set()  # taken once: a second resume of the same key would start over


def test_one_resumed_where_it_is_not_kept_or_given_up_starts_over_and_a_cancel_keeps_nothing(model_dir):
    engine, inner, prompt, ids = _setup(model_dir, turns=[1, 1, 2, 2, 2, 2], max_parked=1)

    async def go():
        await engine.start()
        try:
            await _paused(engine, inner, _request(prompt, "it0/a#0", "it0/a"))
            await _paused(engine, inner, _request(prompt, "it0/b#1", "it0/b"))  # `a` given up: one kept
            kept = set(engine.parked)
            cancelled = await _paused(engine, inner, _request(prompt, "it0/c#2", "it0/c"), pause=False)
            after_cancel = set(engine.parked)
            again = await _collect(engine, _request(prompt, "it1/a#p1#3", "it1/a#p1", resume="it0/a/0"))
            return kept, cancelled, after_cancel, again
        finally:
            await engine.close()

    kept, cancelled, after_cancel, again = asyncio.run(go())
    assert kept == {"it0/b/0"}
    (c,) = cancelled.completions
    assert c.finish_reason == "abort" and not c.episode["parked"] and after_cancel == {"it0/b/0"}
    assert inner.aborted  # a cancel aborts the turn in flight
    # `a` was given up: its resumption resets a fresh environment and runs from the prompt: three
    # turns of its own (a continued `a` would have needed two), none of its paused turn's tokens.
    (r,) = again.completions
    assert r.episode["turns"] == 3 and r.episode["stop"] == "done" and len(inner.requests) == 3 + 3
    assert not r.episode["resumed"]
    assert inner.prompts[3] == prompt + r.token_ids[: len(inner.prompts[3]) - len(prompt)]
    assert inner.prompts[3][len(prompt) :] == r.token_ids[: r.loss_mask.index(1)]  # the opening only
    assert (again.weight_version, again.weight_version_end) == (2, 2)  # not the paused turn's version 1
