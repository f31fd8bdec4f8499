"""Chunked log-probs (roles.trainer.logits_chunk): the LM head and the sampled log-softmax computed a
chunk of tokens at a time, recomputed in backward, give the unchunked numbers to 1e-5 in fp32,
forward and gradient, for every sampling transform, packed and unpacked micro-batches, LoRA and tied
embeddings; and the same inputs give bit-identical outputs."""

from __future__ import annotations

import pytest
import torch
from support.rollouts import random_rollouts
from torch import nn

from streamrl_cli.errors import StreamRLError
from streamrl_cli.models.tiny import TinySpec, build_tiny_model
from streamrl_cli.recipe import checks
from streamrl_cli.recipe.schema import (
    AlgorithmConfig,
    ClusterConfig,
    LoraConfig,
    Recipe,
    RolesConfig,
    TrainerConfig,
)
from streamrl_cli.trainer.algo.losses import (
    HeadMath,
    SamplingTransform,
    _floor,
    _removed,
    chunked_logprobs,
    sampled_logprobs,
)
from streamrl_cli.trainer.loop.batch import Rollout, collate
from streamrl_cli.trainer.role import lora as lora_
from streamrl_cli.trainer.role.learner import Learner, OptimConfig
from streamrl_cli.trainer.role.models import (
    Packed,
    checkpoint_activations,
    lm_head,
    load_policy,
    policy_forward,
)

SAMPLINGS = {
    "plain": SamplingTransform.tempered(1.0),
    "tempered": SamplingTransform.tempered(0.7),
    "top-k": SamplingTransform(temperature=0.9, top_k=7, top_p=1.0, min_p=0.0),
    "top-p": SamplingTransform(temperature=1.0, top_k=0, top_p=0.8, min_p=0.0),
    "min-p": SamplingTransform(temperature=1.3, top_k=0, top_p=1.0, min_p=0.05),
    "all": SamplingTransform(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02),
}


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("chunked") / "tiny"))


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory) -> str:
    return str(
        build_tiny_model(tmp_path_factory.mktemp("chunked") / "tied", TinySpec(tie_word_embeddings=True))
    )


def head_case(seed: int, *, bias: bool):
    """Hidden states [2, 9, 16], an LM head of 50 tokens (with big logits: truncation bites), targets."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 9, 16, generator=g).requires_grad_(True)
    weight = (torch.randn(50, 16, generator=g) * 0.8).requires_grad_(True)
    b = (torch.randn(50, generator=g) * 0.5).requires_grad_(True) if bias else None
    tokens = torch.randint(0, 50, (2, 9), generator=g)
    weights = (torch.randn(2, 9, generator=g), torch.randn(2, 9, generator=g))  # the loss's mix
    return hidden, weight, b, tokens, weights


def grads_of(logp, ent, weights, inputs):
    loss = (logp * weights[0]).sum() + ((ent * weights[1]).sum() if ent is not None else 0.0)
    return torch.autograd.grad(loss, [t for t in inputs if t is not None])


@pytest.mark.parametrize("name", list(SAMPLINGS))
@pytest.mark.parametrize("entropy", [True, False])
@pytest.mark.parametrize("chunk", [1, 4, 7, 18, 1000])
def test_chunked_equals_unchunked_forward_and_gradients(name, entropy, chunk):
    s = SAMPLINGS[name]
    hidden, weight, bias, tokens, weights = head_case(
        list(SAMPLINGS).index(name) * 10 + chunk, bias=chunk % 2 == 0
    )
    math = HeadMath()
    logp, ent = sampled_logprobs(math.logits(hidden, weight, bias), tokens, s, entropy=entropy)
    c_logp, c_ent = chunked_logprobs(hidden, tokens, weight, bias, s, entropy=entropy, chunk=chunk)
    close(c_logp, logp)
    if entropy:
        close(c_ent, ent)
    else:
        assert c_ent is None
    inputs = (hidden, weight, bias)
    for got, want in zip(
        grads_of(c_logp, c_ent, weights, inputs), grads_of(logp, ent, weights, inputs), strict=True
    ):
        close(got, want)


@pytest.mark.parametrize("math", [HeadMath(softcap=3.0), HeadMath(scale=0.25)])
def test_softcap_and_logit_scale(math):
    s = SAMPLINGS["top-p"]
    hidden, weight, bias, tokens, weights = head_case(3, bias=False)
    logp, ent = sampled_logprobs(math.logits(hidden, weight, bias), tokens, s, entropy=True)
    c_logp, c_ent = chunked_logprobs(hidden, tokens, weight, bias, s, entropy=True, chunk=5, head=math)
    close(c_logp, logp)
    close(c_ent, ent)
    for got, want in zip(
        grads_of(c_logp, c_ent, weights, (hidden, weight)),
        grads_of(logp, ent, weights, (hidden, weight)),
        strict=True,
    ):
        close(got, want)


@pytest.mark.parametrize("top_p", [0.3, 0.5, 0.7])
def test_top_p_cut_between_equal_logits(top_p):
    """Backward finds the forward's kept tokens from each row's smallest kept logit, except where
    top-p cut between equal logits (the sort order decides there): vLLM's rule runs again.

    The expected numbers come from the same chunks' logits: a matmul of 4 rows and one of 18 may
    differ in the last bit, and a top-p cut between near-equal logits follows that bit."""
    s = SamplingTransform(temperature=1.0, top_k=0, top_p=top_p, min_p=0.0)
    hidden, weight, bias, tokens, weights = head_case(11, bias=False)
    weight = weight.detach()[:10].repeat(5, 1).requires_grad_(True)  # every logit five times
    flat = hidden.reshape(-1, 16)
    logits = torch.cat([HeadMath().logits(flat[a : a + 4], weight, None) for a in range(0, 18, 4)])
    with torch.no_grad():
        assert torch.isinf(_floor(logits, _removed(logits, s))).any()  # the case is exercised
    logp, ent = sampled_logprobs(logits.reshape(2, 9, 50), tokens, s, entropy=True)
    c_logp, c_ent = chunked_logprobs(hidden, tokens, weight, bias, s, entropy=True, chunk=4)
    close(c_logp, logp)
    close(c_ent, ent)
    for got, want in zip(
        grads_of(c_logp, c_ent, weights, (hidden, weight)),
        grads_of(logp, ent, weights, (hidden, weight)),
        strict=True,
    ):
        close(got, want)


def test_only_one_output_used_and_no_grad():
    s = SAMPLINGS["all"]
    hidden, weight, bias, tokens, weights = head_case(5, bias=True)
    logp, ent = sampled_logprobs(HeadMath().logits(hidden, weight, bias), tokens, s, entropy=True)
    c_logp, c_ent = chunked_logprobs(hidden, tokens, weight, bias, s, entropy=True, chunk=4)
    # the entropy alone in the loss (the log-probs' gradient is None in backward)
    close(torch.autograd.grad(c_ent.sum(), hidden)[0], torch.autograd.grad(ent.sum(), hidden)[0])
    with torch.no_grad():
        n_logp, _ = chunked_logprobs(hidden, tokens, weight, bias, s, chunk=4)
    assert not n_logp.requires_grad
    close(n_logp, logp.detach())
    with pytest.raises(ValueError, match="chunk"):
        chunked_logprobs(hidden, tokens, weight, bias, s, chunk=0)


def rollouts(n: int, seed: int) -> list[Rollout]:
    """Rows of uneven lengths: collate right-pads them, and `Packed` packs them."""
    return random_rollouts(n, seed)


def forward_and_grads(model: nn.Module, mb, s: SamplingTransform, chunk: int):
    """(log-probs, entropy, {name: grad}) of one loss through `policy_forward`."""
    model.zero_grad(set_to_none=True)
    logp, ent = policy_forward(model, mb, s, entropy=True, chunk=chunk)
    g = torch.Generator().manual_seed(1)
    mix = torch.randn(logp.shape, generator=g) * mb.mask
    ((logp * mix).sum() - 0.1 * (ent * mb.mask).sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach(), ent.detach(), grads


def assert_same(model: nn.Module, mb, s: SamplingTransform, chunk: int) -> dict[str, torch.Tensor]:
    logp, ent, grads = forward_and_grads(model, mb, s, 0)
    c_logp, c_ent, c_grads = forward_and_grads(model, mb, s, chunk)
    close(c_logp, logp)
    close(c_ent, ent)
    assert c_grads.keys() == grads.keys() and grads
    for name in grads:
        close(c_grads[name], grads[name])
    return c_grads


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("name", ["plain", "all"])
def test_policy_forward_chunked_equals_unchunked(model_dir, packed, name):
    torch.manual_seed(0)
    model = load_policy(model_dir, torch.float32)
    mb = collate(rollouts(5, seed=7) if packed else rollouts(1, seed=8))  # one row: never packed
    assert (Packed.of(mb) is not None) == packed
    assert lm_head(model) is not None  # the chunked path runs
    grads = assert_same(model, mb, SAMPLINGS[name], chunk=5)
    assert "lm_head.weight" in grads and "model.embed_tokens.weight" in grads


def test_tied_embeddings(tied_dir):
    model = load_policy(tied_dir, torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    grads = assert_same(model, collate(rollouts(4, seed=3)), SAMPLINGS["tempered"], chunk=6)
    assert "model.embed_tokens.weight" in grads  # the head's and the embedding's gradient, summed


def test_lora_model_and_its_reference(model_dir):
    torch.manual_seed(0)
    model = lora_.apply(load_policy(model_dir, torch.float32), LoraConfig(rank=4))
    with torch.no_grad():  # B starts at 0: make the adapters matter
        for n, p in model.named_parameters():
            if lora_.is_adapter(n):
                p.normal_(0, 0.05)
    assert lm_head(model) is not None
    mb = collate(rollouts(5, seed=11))
    grads = assert_same(model, mb, SAMPLINGS["top-k"], chunk=4)
    assert grads and all(lora_.is_adapter(n) for n in grads)
    # The reference: the base weights, adapters off, no gradient.
    with torch.no_grad(), model.disable_adapter():
        ref = policy_forward(model, mb, SAMPLINGS["top-k"], chunk=4)[0]
        ref_full = policy_forward(model, mb, SAMPLINGS["top-k"])[0]
    close(ref, ref_full)
    with torch.no_grad():
        on = policy_forward(model, mb, SAMPLINGS["top-k"], chunk=4)[0]
    assert not torch.allclose(on, ref)


@pytest.mark.parametrize("name", ["plain", "all"])
def test_lora_on_the_lm_head_runs_chunk_by_chunk_through_the_head_module(model_dir, name):
    # The head is PEFT's LoRA layer, not a Linear: each chunk goes through the module under
    # activation checkpointing (as under ZeRO-3, whose partitioned weight only the module gathers).
    model = lora_.apply(load_policy(model_dir, torch.float32), LoraConfig(rank=2, target_modules=["lm_head"]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if lora_.is_adapter(n):
                p.normal_(0, 0.05)
    head = lm_head(model)
    assert head is not None and not head.direct
    grads = assert_same(model, collate(rollouts(3, seed=2)), SAMPLINGS[name], chunk=4)
    assert any("lm_head" in n for n in grads)


def test_reproducible_bit_for_bit(model_dir):
    model = load_policy(model_dir, torch.float32)
    mb = collate(rollouts(5, seed=5))
    first = forward_and_grads(model, mb, SAMPLINGS["all"], 3)
    second = forward_and_grads(model, mb, SAMPLINGS["all"], 3)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert all(torch.equal(first[2][n], second[2][n]) for n in first[2])


# ---- roles.trainer.activation_checkpointing and attention ----


@pytest.mark.parametrize("lora", [False, True])
def test_activation_checkpointing_gives_the_same_gradients(model_dir, lora):
    """Recomputed activations, the same numbers; with LoRA the frozen embeddings' output is made to
    require grad (PEFT), so the adapters of the first block get their gradient."""
    mb = collate(rollouts(4, seed=9))

    def grads(checkpointed: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = load_policy(model_dir, torch.float32)
        runs = []
        model.model.layers[0].register_forward_pre_hook(lambda *_: runs.append(1))
        if checkpointed:
            checkpoint_activations(model)
        if lora:
            model = lora_.apply(model, LoraConfig(rank=4))
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if lora_.is_adapter(n):
                        p.normal_(0, 0.05)
        model.train()
        out = forward_and_grads(model, mb, SAMPLINGS["plain"], 5)[2]
        assert len(runs) == (2 if checkpointed else 1)  # the block ran again in backward
        return out

    plain, checkpointed = grads(False), grads(True)
    assert plain.keys() == checkpointed.keys() and any(".layers.0." in n for n in plain)
    for name in plain:
        close(checkpointed[name], plain[name])


def test_attention_implementation_reaches_the_model(model_dir):
    assert load_policy(model_dir, torch.float32, "eager").config._attn_implementation == "eager"
    assert load_policy(model_dir, torch.float32, "sdpa").config._attn_implementation == "sdpa"


def test_flash_attention_refused_on_cpu(model_dir):
    local = {"local": ClusterConfig(launcher="local", local_gpus=0)}
    trainer = TrainerConfig(cluster="local", attention="flash_attention_2")
    problems = checks.check(Recipe(clusters=local, roles=RolesConfig(trainer=trainer)))
    assert [p for p in problems if p[0] == "roles.trainer.attention"] == [
        (
            "roles.trainer.attention",
            "flash_attention_2 runs on CUDA GPUs only, and the trainer's cluster 'local' gives it none "
            "(it trains on CPUs): use sdpa or eager",
        )
    ]
    gpus = {"local": ClusterConfig(launcher="local", local_gpus=1)}
    assert not [
        p
        for p in checks.check(Recipe(clusters=gpus, roles=RolesConfig(trainer=trainer)))
        if "attention" in p[0]
    ]
    # At the trainer's start too (a recipe's cluster may say GPUs where a rank finds none).
    opt = OptimConfig(algorithm=AlgorithmConfig(), trainer=trainer)
    with pytest.raises(StreamRLError, match="flash_attention_2 runs on CUDA GPUs only.*runs on cpu"):
        Learner(model_dir, None, opt, torch.device("cpu"), torch.float32)  # type: ignore[arg-type]


# ---- the Learner: DeepSpeed engines, LoRA, the reference and the critic ----

LEARNER = """
import json, random, sys, torch
from streamrl_cli.recipe import presets
from streamrl_cli.recipe.schema import AlgorithmConfig, LoraConfig, TrainerConfig
from streamrl_cli.trainer.loop.batch import Rollout, collate
from streamrl_cli.trainer.role.learner import Learner, LossConfig, OptimConfig
from streamrl_cli.trainer.role.learner import init_distributed, open_group_store
from streamrl_cli.transport.wire import Sample

path, zero, lora, name = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "lora", sys.argv[4]
store, address = open_group_store(1, "127.0.0.1")
init_distributed(0, 1, address, "gloo", store)
rng = random.Random(4)
rows = []
for i in range(6):
    resp = [rng.randrange(1, 400) for _ in range(rng.randint(2, 14))]
    sample = Sample(prompt_id=f"p{i}", sample_index=0, token_ids=resp, logprobs=[-1.0] * len(resp),
                    finish_reason="stop", weight_version=0)
    rows.append(Rollout(prompt_tokens=[rng.randrange(1, 400) for _ in range(rng.randint(2, 9))],
                        sample=sample, reward=rng.random(), advantage=rng.gauss(0, 1)))
keys = {"grpo": dict(name="grpo", kl_coef=0.1, top_k=20, entropy_coef=0.01, is_correction="on"),
        "ppo": dict(name="ppo", kl_mode="penalty", kl_coef=0.01, is_correction="off")}[name]
algorithm = presets.filled(AlgorithmConfig(**keys), 16)
out = {}
for ckpt, chunk in ((False, 0), (True, 5)):
    torch.manual_seed(0)
    opt = OptimConfig(algorithm=algorithm, trainer=TrainerConfig(
        zero_stage=zero, activation_checkpointing=ckpt, logits_chunk=chunk))
    learner = Learner(path, LossConfig.from_recipe(algorithm, 16), opt, torch.device("cpu"), torch.float32,
                      lora=LoraConfig(rank=4) if lora else None)
    with torch.no_grad():  # B starts at 0: make the adapters matter
        for n, p in learner.actor.module.named_parameters():
            if ".lora_B" in n:
                p.normal_(0, 0.05)
    learner.micro_step(collate(rows[:3]), last=False)
    learner.micro_step(collate(rows[3:]), last=True)
    stats = learner.finish_gradients()
    grads = learner.full_gradients()
    if learner.critic is not None:
        from deepspeed.utils import safe_get_full_grad

        critic = learner.critic.module.named_parameters()
        grads |= {"critic." + n: safe_get_full_grad(p).detach().clone() for n, p in critic}
    out[chunk] = (grads, stats)
(g0, s0), (g1, s1) = out[0], out[5]
print(json.dumps({
    "grad": max((g1[n] - g0[n]).abs().max().item() for n in g0),
    "stats": max(abs(s1[k] - s0[k]) for k in s0),
    "names": len(g0),
}))
"""


@pytest.mark.slow
@pytest.mark.parametrize(("zero", "lora", "name"), [(2, "lora", "grpo"), (1, "full", "ppo")])
def test_learner_checkpointed_and_chunked_equals_plain(model_dir, tmp_path, zero, lora, name):
    """Activation checkpointing and chunked log-probs together, through DeepSpeed's engine (its
    backward hooks sit on the forward's outputs), against neither: the same gradients of the actor
    (LoRA: its adapters; with the reference being the actor with them off) and the critic (PPO)."""
    import json
    import subprocess
    import sys

    script = tmp_path / "learner.py"
    script.write_text(LEARNER)
    out = subprocess.run(
        [sys.executable, str(script), model_dir, str(zero), lora, name],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["names"] > 0
    assert result["grad"] < 1e-5 and result["stats"] < 1e-4, result
