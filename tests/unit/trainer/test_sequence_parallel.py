"""Sequence parallelism (trainer.role.sequence_parallel) gives sequence_parallel 1's loss and gradient.

Real gloo ranks on loopback, the tiny model, DeepSpeed engines with the SP groups as their ``mpu``:
each packed row is split over the ranks of an SP group (DeepSpeed's Ulysses attention between the
slices), per-token log-probs, entropy and values are gathered back to the whole row, and the
trainer's own loss code runs on them. The reference is one process, no split, the same loss.
The micro-batches hold rows of several packed sequences, more than one packed row, prompt tokens
(masked), extra masked tokens, per-token importance weights, and a rank's empty filler batch.
"""

from __future__ import annotations

import os
import random
import sys

import pytest
import torch

from streamrl_cli.models.tiny import build_tiny_model
from streamrl_cli.recipe import presets
from streamrl_cli.recipe.schema import AlgorithmConfig
from streamrl_cli.trainer import algo as A
from streamrl_cli.trainer.algo import losses as L
from streamrl_cli.trainer.loop.batch import MicroBatch, Rollout, collate
from streamrl_cli.trainer.role import models
from streamrl_cli.transport.wire import Sample

ALGO = presets.filled(
    AlgorithmConfig(
        name="grpo", kl_coef=0.05, entropy_coef=0.01, is_correction="on", temperature=0.7, top_k=40,
        loss_agg="token-mean",
    ),
    16,
)  # fmt: skip
SAMPLING = L.SamplingTransform(temperature=0.7, top_k=40, top_p=1.0, min_p=0.0)
PACK_TOKENS = 40  # small packed rows: the second micro-batch needs two of them


def rollouts(lengths: list[int], seed: int) -> list[Rollout]:
    rng = random.Random(seed)
    out = []
    for i, n in enumerate(lengths):
        resp = [rng.randrange(1, 400) for _ in range(n)]
        sample = Sample(
            prompt_id=f"p{i}", sample_index=0, token_ids=resp,
            logprobs=[-rng.uniform(0.5, 6.0) for _ in resp], finish_reason="stop", weight_version=0,
        )  # fmt: skip
        prompt = [rng.randrange(1, 400) for _ in range(rng.randint(2, 7))]
        out.append(Rollout(prompt_tokens=prompt, sample=sample, reward=0.0, advantage=rng.gauss(0, 1)))
    return out


def micro_batches() -> list[MicroBatch]:
    """Three sequences in one packed row (odd length: padded for the split); five in two packed rows;
    a rank's empty filler batch. Each with extra masked response tokens."""
    out = []
    for lengths, seed in (([9, 4, 13], 1), ([11, 3, 14, 6, 8], 2)):
        mb = collate(rollouts(lengths, seed))
        mb.mask[0, -2:] = 0  # off-policy masking, say: tokens out of the loss and its denominator
        out.append(mb)
    return [*out, collate([])]


def loss_numerator(logp, ent, ref_logp, mb: MicroBatch) -> tuple[torch.Tensor, float]:
    """The trainer's GRPO loss (Learner.micro_step's pieces, unchanged) on whole micro-batch rows."""
    a = ALGO
    old = logp.detach()
    adv = mb.advantages[:, None].expand_as(mb.mask) * mb.mask
    isw = A.is_weights(old, mb.behaviour_logp, mb.mask, a.is_cap, a.is_level)  # per-token weights
    pg, _ = A.policy_loss(a.policy_loss)(logp, old, adv, mb.mask, a.clip_ratio, a.clip_ratio_high, isw)
    per_token = pg + a.kl_coef * A.kl_estimate(logp, ref_logp, a.kl_estimator) - a.entropy_coef * ent
    num, units = L.aggregate(per_token, mb.mask, a.loss_agg, 16)
    return num, (units if mb.size else 0.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("sp") / "tiny"))


def unsplit(path: str) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], torch.Tensor]:
    """sequence_parallel 1: per-token log-probs, the mean loss's gradient, the critic's values."""
    torch.manual_seed(0)
    model = models.load_policy(path, torch.float32)
    ref = models.load_reference(path, torch.float32, torch.device("cpu"))
    logps, total, units = [], 0.0, 0.0
    for mb in micro_batches():
        logp, ent = models.policy_forward(model, mb, SAMPLING, entropy=True)
        with torch.no_grad():
            ref_logp = models.policy_forward(ref, mb, SAMPLING)[0]
        num, n = loss_numerator(logp, ent, ref_logp, mb)
        total, units = total + num, units + n
        logps.append(logp.detach())
    (total / units).backward()
    critic = models.Critic(path, torch.float32)
    critic.head.weight.data = torch.linspace(-1, 1, critic.head.weight.numel()).reshape_as(critic.head.weight)
    values = models.critic_forward(critic, micro_batches()[1]).detach()
    return logps, {n: p.grad.clone() for n, p in model.named_parameters()}, values


def _rank_main(
    rank: int, world: int, degree: int, stage: int, long: bool, address: str, path: str, out: str
) -> None:
    import deepspeed
    from deepspeed.utils import safe_get_full_grad, safe_update_full_grad_vectorized

    from streamrl_cli.trainer.role.learner import init_distributed, leave_group
    from streamrl_cli.trainer.role.sequence_parallel import SequenceParallel, release_groups

    models.PACK_TOKENS = PACK_TOKENS
    init_distributed(rank, world, address, "gloo")
    torch.set_num_threads(1)
    sp = SequenceParallel.setup(degree)
    policy = sp.install(models.load_policy(path, torch.float32))
    if long:  # the other long-context settings: checkpointed blocks re-run their all-to-alls in backward
        models.checkpoint_activations(policy)
    ref = sp.install(models.load_reference(path, torch.float32, torch.device("cpu")))
    config = {
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage}, "steps_per_print": 1 << 30,
    }  # fmt: skip
    optimizer = torch.optim.AdamW(policy.parameters(), lr=0.0)
    engine, *_ = deepspeed.initialize(model=policy, optimizer=optimizer, config=config, mpu=sp.mpu)
    engine.train()
    chunk = 8 if long else 0  # roles.trainer.logits_chunk: the LM head 8 tokens at a time
    assert not long or (models.lm_head(engine) is not None and policy.is_gradient_checkpointing)
    batches = micro_batches()
    # One micro-batch per SP group and round, as the rank driver hands them out (sp.dp_rank; every
    # group in every round, with an empty filler batch where none is left); one group: all in turn.
    rounds = -(-len(batches) // sp.dp_world)
    mine = [
        batches[i] if i < len(batches) else collate([])
        for i in range(sp.dp_rank, rounds * sp.dp_world, sp.dp_world)
    ]
    logps, units = [], 0.0
    for k, mb in enumerate(mine):
        logp, ent = sp.policy_forward(engine, mb, SAMPLING, entropy=True, chunk=chunk)
        ref_logp = sp.policy_forward(ref, mb, SAMPLING, chunk=chunk)[0]
        num, n = loss_numerator(logp, ent, ref_logp, mb)
        engine.set_gradient_accumulation_boundary(k == len(mine) - 1)
        engine.backward(num, scale_wrt_gas=False)
        units += n
        logps.append(logp.detach())
    # Learner.finish_gradients' rule with SP: each rank counted its group's units (degree times over);
    # DeepSpeed divided the gradient sum by sp.averaged_over(stage), not by the world.
    total = torch.tensor([units], dtype=torch.float64)
    torch.distributed.all_reduce(total)
    factor = sp.averaged_over(stage) / (float(total[0]) / degree)
    params = [p for p in engine.module.parameters() if p.requires_grad]
    safe_update_full_grad_vectorized(params, lambda g, _p: g * factor)
    grads = {n: safe_get_full_grad(p).detach().clone() for n, p in engine.module.named_parameters()}
    engine.step()  # lr 0: for the norm DeepSpeed reports (and clips by), ZeRO 1-3
    norm = engine.get_global_grad_norm()
    critic = models.Critic(path, torch.float32)
    critic.head.weight.data = torch.linspace(-1, 1, critic.head.weight.numel()).reshape_as(critic.head.weight)
    sp.install(critic.backbone)
    values = sp.critic_forward(critic, batches[1]).detach()
    if rank == 0:
        torch.save((logps, grads, values, norm), out)
    torch.distributed.barrier()
    leave_group()
    release_groups()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as tests/e2e/test_trainer_learner.py: no interpreter teardown with gloo threads


def run_ranks(path: str, tmp_path, world: int, degree: int, stage: int, long: bool = False):
    import torch.multiprocessing as mp

    from streamrl_cli.trainer.role.learner import open_group_store

    store, address = open_group_store(world, "127.0.0.1")
    out = tmp_path / "sp.pt"
    args = (world, degree, stage, long, address, path, str(out))
    mp.start_processes(_rank_main, args=args, nprocs=world, start_method="spawn")
    del store
    return torch.load(out)


@pytest.mark.slow  # real DeepSpeed engines in spawned gloo ranks
@pytest.mark.parametrize(
    "world,stage,long",
    # one SP group of 2 (ZeRO-2) with chunked logits and activation checkpointing; two SP groups of
    # 2, data-parallel (ZeRO-3)
    [(2, 2, True), (4, 3, False)],
)
def test_sp_ranks_give_the_unsplit_loss_and_gradient(model_dir, tmp_path, monkeypatch, world, stage, long):
    got = run_ranks(model_dir, tmp_path, world=world, degree=2, stage=stage, long=long)
    got_logps, got_grads, got_values, got_norm = got
    monkeypatch.setattr(models, "PACK_TOKENS", PACK_TOKENS)
    packed = [models.Packed(mb) for mb in micro_batches()]
    assert [p.ids.shape[0] for p in packed[:2]] == [1, 2]  # one row of 3 sequences; two rows
    assert packed[0].ids.shape[1] % 2 == 1  # padded for the split
    logps, grads, values = unsplit(model_dir)
    dp = world // 2  # rank 0 ran micro-batches 0, dp, 2·dp, ... (then fillers)
    assert len(got_logps) == -(-len(logps) // dp)
    for k, got_logp in enumerate(got_logps):
        if k * dp < len(logps):
            torch.testing.assert_close(got_logp, logps[k * dp], rtol=0, atol=1e-5)
    torch.testing.assert_close(got_values, values, rtol=0, atol=1e-5)
    assert set(got_grads) == set(grads)
    for name, g in grads.items():
        torch.testing.assert_close(got_grads[name], g, rtol=1e-4, atol=1e-6, msg=name)
    assert any(g.abs().sum() > 0 for g in grads.values())
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
    assert got_norm == pytest.approx(float(norm), rel=1e-4)


def test_the_packed_causal_mask_is_transformers_own_for_the_whole_row():
    """What the gathered heads attend to (sdpa): causal within each packed sequence, as transformers'
    mask of the unsplit row; rows of one sequence each need no mask (sdpa's is_causal)."""
    from transformers import AutoConfig
    from transformers.masking_utils import create_causal_mask

    from streamrl_cli.trainer.role.sequence_parallel import packed_causal_mask

    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 0, 1, 2], [0, 1, 2, 0, 1, 2, 3, 4, 5]])
    config = AutoConfig.for_model("qwen2", hidden_size=64, num_attention_heads=2, num_key_value_heads=2)
    config._attn_implementation = "sdpa"
    expected = create_causal_mask(
        config=config, inputs_embeds=torch.zeros(2, 9, 64), attention_mask=None, past_key_values=None,
        position_ids=positions,
    )  # fmt: skip
    assert torch.equal(packed_causal_mask(positions), expected)
    assert packed_causal_mask(torch.arange(9).expand(2, 9)) is None
