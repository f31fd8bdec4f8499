"""Sampling beyond temperature: top-k, top-p, min-p and stop strings reach vLLM, and the trainer's
log-probs are of the distribution vLLM sampled from (or the importance ratio would be off)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch

from streamrl_cli.generator.engine import GenerationRequest, SamplingSpec
from streamrl_cli.recipe.load import load
from streamrl_cli.trainer.algo.losses import SamplingTransform, sampled_logprobs, token_logprobs

CASES = [
    SamplingTransform(temperature=0.8, top_k=8, top_p=1.0, min_p=0.0),
    SamplingTransform(temperature=1.0, top_k=0, top_p=0.7, min_p=0.0),
    SamplingTransform(temperature=1.3, top_k=0, top_p=1.0, min_p=0.1),
    SamplingTransform(temperature=0.9, top_k=20, top_p=0.8, min_p=0.02),
]


def vllm_processed_logprobs(logits: torch.Tensor, s: SamplingTransform) -> torch.Tensor:
    """vLLM's own sampler steps (temperature, its min-p processor's rule, its top-k/top-p function)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    x = logits.clone() / s.temperature
    if s.min_p > 0:  # MinPLogitsProcessor.apply
        probs = torch.softmax(x, dim=-1)
        x.masked_fill_(probs < probs.amax(dim=-1, keepdim=True) * s.min_p, -float("inf"))
    n = x.shape[0]
    k = torch.full((n,), s.top_k) if s.top_k else None
    p = torch.full((n,), s.top_p) if s.top_p < 1 else None
    return apply_top_k_top_p_pytorch(x, k, p).log_softmax(dim=-1)


@pytest.mark.parametrize("s", CASES, ids=str)
def test_trainer_truncation_is_vllms(s):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 300, generator=g) * 3
    want = vllm_processed_logprobs(logits, s)
    targets = torch.multinomial(want.exp(), 1, generator=g)[:, 0]  # sampled: inside the kept set
    got, ent = sampled_logprobs(logits[None], targets[None], s, entropy=True)
    torch.testing.assert_close(got[0], want.gather(1, targets[:, None])[:, 0], atol=1e-5, rtol=0)
    p = want.exp()
    torch.testing.assert_close(ent[0], -(p * want.masked_fill(p == 0, 0)).sum(-1), atol=1e-4, rtol=0)
    # and truncation matters: the temperature alone gives other numbers
    assert (got[0] - token_logprobs(logits, targets, s.temperature)).abs().max() > 1e-2


def test_a_token_outside_the_kept_set_keeps_a_finite_logprob():
    logits = torch.tensor([[[4.0, 3.0, 0.0, -1.0]]], requires_grad=True)
    s = SamplingTransform(temperature=1.0, top_k=1, top_p=1.0, min_p=0.0)
    lp, _ = sampled_logprobs(logits, torch.tensor([[2]]), s)
    assert torch.isfinite(lp).all()
    lp.sum().backward()  # and a gradient flows through it
    assert torch.isfinite(logits.grad).all()
    top, _ = sampled_logprobs(logits, torch.tensor([[0]]), s)
    assert top.item() == 0.0  # the sampled token was the only one kept


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("algorithm.top_p=0", "algorithm.top_p"),
        ("algorithm.top_p=1.5", "algorithm.top_p"),
        ("algorithm.top_k=-1", "algorithm.top_k"),
        ("algorithm.min_p=2", "algorithm.min_p"),
        ("algorithm.stop=['']", "algorithm.stop"),
    ],
)
def test_bad_sampling_keys_are_reported(override, key):
    from streamrl_cli.errors import RecipeError

    with pytest.raises(RecipeError, match=key):
        load("local", [override])


def test_sampling_keys_reach_every_request():
    from streamrl_cli.trainer.loop.seeds import request_sampling
    from streamrl_cli.transport.wire import Sampling

    a = load("local", ["algorithm.top_p=0.9", "algorithm.top_k=5", "algorithm.stop=[END,'###']"]).recipe
    got = request_sampling(a.algorithm, 16)
    assert (got.top_k, got.top_p, got.min_p, got.stop, got.max_tokens) == (5, 0.9, 0.0, ["END", "###"], 16)
    # the schema's defaults are "off", and they are the only ones: Sampling has none of its own
    plain = request_sampling(load("local").recipe.algorithm, 16)
    assert (plain.temperature, plain.top_k, plain.top_p, plain.min_p, plain.stop) == (1.0, 0, 1.0, 0.0, [])
    assert not any(f.default is not msgspec.NODEFAULT for f in msgspec.structs.fields(Sampling)
                   if f.name not in ("seed", "ignore_eos"))  # fmt: skip


# ---- the real engine, on weights with peaked distributions (the builder's are near uniform) ----


@pytest.fixture(scope="module")
def peaked_model(tmp_path_factory, tied_model_dir) -> Path:
    """The shared engine's model (tests/e2e/conftest.py) with peaked weights, saved for the trainer's side."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tied_model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(noise * 0.3 if p.ndim == 2 else 1.0 + 0.1 * noise if "norm" in name else 0.1 * noise)
    path = tmp_path_factory.mktemp("models") / "tiny-peaked"
    model.save_pretrained(path)
    for f in tied_model_dir.glob("*.json"):  # the tokenizer's files too
        if not (path / f.name).exists():
            (path / f.name).write_bytes(f.read_bytes())
    return path


@pytest.fixture(scope="module")
def served(engine_loop, shared_engine, peaked_model, tied_model_dir):
    """The session's shared engine, serving the peaked weights (loaded in place, as a version); its
    model's own weights are loaded back afterwards, for the modules that expect them."""
    from safetensors.torch import load_file

    def load(model: Path) -> None:
        state = load_file(str(model / "model.safetensors"))
        engine_loop.run_until_complete(shared_engine.load_weights(shared_engine.weight_version + 1, state))

    load(peaked_model)
    yield engine_loop, shared_engine
    load(tied_model_dir)


def _generate(served, spec: SamplingSpec, prompt: list[int], rid: str):
    loop, eng = served

    async def run():
        req = GenerationRequest(request_id=rid, prompt_token_ids=prompt, sampling=spec)
        return [r async for r in eng.generate([req])]

    (result,) = loop.run_until_complete(run())
    return result


@pytest.mark.slow
@pytest.mark.parametrize("s", CASES, ids=str)
def test_generator_and_trainer_logprobs_agree_under_truncation(served, peaked_model, s):
    from transformers import AutoModelForCausalLM

    from streamrl_cli.trainer.loop.batch import Rollout, collate
    from streamrl_cli.trainer.role.models import policy_forward
    from streamrl_cli.transport.wire import Sample

    prompt = list(range(40, 56))
    spec = SamplingSpec(
        n=4, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p,
        max_tokens=24, seed=11, ignore_eos=True,
    )  # fmt: skip
    result = _generate(served, spec, prompt, f"trunc-{s}")
    rollouts = [
        Rollout(prompt_tokens=prompt, reward=0.0, sample=Sample(
            prompt_id="p", sample_index=c.index, token_ids=c.token_ids, logprobs=c.logprobs,
            finish_reason=c.finish_reason, weight_version=0))
        for c in result.completions
    ]  # fmt: skip
    mb = collate(rollouts)
    hf = AutoModelForCausalLM.from_pretrained(peaked_model, dtype=torch.float32).eval()
    with torch.no_grad():
        trainer, _ = policy_forward(hf, mb, s)
        tempered, _ = policy_forward(hf, mb, s.temperature)
    m = mb.mask.bool()
    # the trainer's recomputed log-probs are the behaviour log-probs vLLM returned ...
    torch.testing.assert_close(trainer[m], mb.behaviour_logp[m], atol=2e-4, rtol=0)
    # ... which the temperature alone would not give (the test tells truncation apart)
    assert (tempered[m] - mb.behaviour_logp[m]).abs().max() > 1e-2


@pytest.mark.slow
def test_stop_strings_end_a_completion(served, peaked_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(peaked_model)
    prompt = list(range(60, 70))
    free = _generate(served, SamplingSpec(temperature=0.0, max_tokens=30, ignore_eos=True), prompt, "free")
    ids = free.completions[0].token_ids
    text = tok.decode(ids)
    stop = tok.decode(ids[8:10]).strip() or tok.decode(ids[8:11])
    assert stop and stop in text
    spec = SamplingSpec(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop])
    (c,) = _generate(served, spec, prompt, "stopped").completions
    assert c.finish_reason == "stop" and len(c.token_ids) < len(ids)
    assert c.token_ids == ids[: len(c.token_ids)]  # the same greedy path, cut where the string ends
    assert stop in tok.decode(c.token_ids) and len(c.logprobs) == len(c.token_ids)
