"""Tensor parallelism (roles.trainer.tensor_parallel, DeepSpeed's AutoTP) trains as one rank does.

Real gloo ranks on loopback, the tiny dense model, the trainer's own Learner driven by its RankDriver:
the same micro-batches, two AdamW steps, at tensor_parallel 1 (one rank) and 2 (each layer split over
two ranks; with four ranks, two TP groups data parallel). The losses of both steps (the second one's
from the updated weights), the gradient norm, the weights the generators get (gathered from the
shards, under the HF model's names and shapes), a checkpoint's export and its resume agree.
"""

from __future__ import annotations

import json
import os
import random
import sys

import pytest
import torch
from support.configs import optim_config

from streamrl_cli.models.tiny import build_tiny_model
from streamrl_cli.recipe import presets
from streamrl_cli.recipe.schema import AlgorithmConfig
from streamrl_cli.trainer.loop.batch import Rollout
from streamrl_cli.transport.wire import Sample

GRPO = {"name": "grpo", "kl_coef": 0.05, "entropy_coef": 0.01, "is_correction": "on", "temperature": 0.7}
PPO = {"name": "ppo", "kl_coef": 0.01, "is_correction": "off"}


def rollouts(n: int, seed: int) -> list[Rollout]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        resp = [rng.randrange(1, 400) for _ in range(rng.randint(1, 12))]
        sample = Sample(
            prompt_id=f"p{i // 2}", sample_index=i % 2, token_ids=resp,
            logprobs=[-rng.uniform(0.5, 6.0) for _ in resp], finish_reason="stop", weight_version=0,
        )  # fmt: skip
        prompt = [rng.randrange(1, 400) for _ in range(rng.randint(2, 9))]
        out.append(
            Rollout(prompt_tokens=prompt, sample=sample, reward=rng.random(), advantage=rng.gauss(0, 1))
        )
    return out


def parts() -> list[list[Rollout]]:
    """Four uneven micro-batches of one iteration."""
    rows = rollouts(12, seed=5)
    return [rows[0:4], rows[4:5], rows[5:9], rows[9:12]]


def _rank_main(rank: int, world: int, tp: int, stage: int, algo: str, chunk, address, path, tmp) -> None:
    from streamrl_cli.trainer.role.learner import Learner, LossConfig, init_distributed, leave_group
    from streamrl_cli.trainer.role.ranks import RankDriver, follow

    init_distributed(rank, world, address, "gloo")
    torch.set_num_threads(1)
    algorithm = presets.filled(AlgorithmConfig(**(PPO if algo == "ppo" else GRPO)), 16)
    cfg = LossConfig.from_recipe(algorithm, 16)
    opt = optim_config(
        zero_stage=stage, tensor_parallel=tp, logits_chunk=chunk, lr=1e-2, critic_lr=1e-2,
        **{k: v for k, v in (PPO if algo == "ppo" else GRPO).items()},
    )  # fmt: skip
    learner = Learner(path, cfg, opt, torch.device("cpu"), torch.float32)
    if rank:
        follow(learner, rank)
    else:
        from streamrl_cli.trainer.role.export import export_checkpoint

        driver = RankDriver(learner, world)
        width = world // learner.shared_by  # micro-batches per round: one per TP group
        batches = parts()
        module = learner.actor.module  # this rank's shapes (ZeRO-3: before its partitioning)
        shapes = {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in module.named_parameters()}
        stats = []
        for _ in range(2):
            rounds = [batches[i : i + width] for i in range(0, len(batches), width)]
            for k, share in enumerate(rounds):
                driver.round(share, last=k == len(rounds) - 1)
            stats.append(driver.step())
        state = driver.full_state()
        ckpt = tmp / f"ckpt-{world}" / "iter-000001"
        driver.save(ckpt, {"iteration": 1})
        exported = export_checkpoint(ckpt, path, tmp / f"export-{world}", "float32")
        driver.load(ckpt)
        resumed = driver.full_state()
        driver.stop()
        torch.save((stats, state, shapes, str(exported), resumed), tmp / f"out-{world}.pt")
    leave_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as tests/e2e/test_trainer_learner.py: no interpreter teardown with gloo threads


def run(path: str, tmp_path, world: int, tp: int, stage: int, algo: str, chunk):
    import torch.multiprocessing as mp

    from streamrl_cli.trainer.role.learner import open_group_store

    store, address = open_group_store(world, "127.0.0.1")
    args = (world, tp, stage, algo, chunk, address, path, tmp_path)
    mp.start_processes(_rank_main, args=args, nprocs=world, start_method="spawn")
    del store
    return torch.load(tmp_path / f"out-{world}.pt", weights_only=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("tp") / "tiny"))


@pytest.mark.slow  # real DeepSpeed engines in spawned gloo ranks
@pytest.mark.parametrize(
    "world,stage,algo,chunk",
    # one TP group of 2: GRPO under ZeRO-1, its LM head chunked 7 tokens at a time; PPO's actor and
    # critic both split under ZeRO-3 (whole logits); two TP groups of 2, data parallel: ZeRO-0 (the
    # trainer's own gradient norm), ZeRO-3 (which divides the gradient by the data-parallel width)
    [(2, 1, "grpo", 7), (2, 3, "ppo", 0), (4, 0, "grpo", None), (4, 3, "grpo", None)],
)
def test_tp2_trains_as_tp1(model_dir, tmp_path, world, stage, algo, chunk):
    from transformers import AutoModelForCausalLM

    want_stats, want_state, want_shapes, _, _ = run(model_dir, tmp_path, 1, 1, stage, algo, chunk)
    stats, state, shapes, exported, resumed = run(model_dir, tmp_path, world, 2, stage, algo, chunk)
    print("TP=1", json.dumps(want_stats), "\nTP=2", json.dumps(stats))
    # The layers are split on the ranks (q_proj by rows: 64 → 32 on the tiny model) ...
    assert (
        shapes["model.layers.0.self_attn.q_proj.weight"]
        == (32, 64)
        != want_shapes["model.layers.0.self_attn.q_proj.weight"]
    )
    # ... and train to the same losses, the second step's from the updated weights.
    for want, got in zip(want_stats, stats, strict=True):
        assert set(got) == set(want)
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    assert want_stats[1]["loss/policy"] != want_stats[0]["loss/policy"]
    if algo == "ppo":
        assert stats[1]["loss/value"] > 0
    # The generators' weights: whole, the HF model's names and shapes, the same values.
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    assert {n: tuple(t.shape) for n, t in state.items()} == {n: tuple(t.shape) for n, t in hf.items()}
    moved = [n for n in hf if not torch.equal(state[n], hf[n])]
    assert len(moved) == len(hf)  # every weight trained (Adam moves each by about lr)
    for name, want in want_state.items():
        torch.testing.assert_close(state[name], want, rtol=0, atol=2e-4, msg=name)
    # A checkpoint's export loads in transformers with those weights; its resume gives them back.
    model = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).state_dict()
    for name, want in state.items():
        torch.testing.assert_close(model[name], want, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(resumed[name], want, rtol=0, atol=0, msg=name)


def test_a_tp_checkpoint_resumes_only_into_its_layout_and_exports_only_gathered(tmp_path):
    """DeepSpeed's per-TP-rank files load only into the same layout; without the gathered weights
    the export refuses rather than taking one rank's shards for the model."""
    from types import SimpleNamespace

    from streamrl_cli.trainer.role.checkpoint import CheckpointMismatch, load_engines, tp_degree
    from streamrl_cli.trainer.role.export import ExportError, fp32_state

    tag = tmp_path / "iter-000001" / "actor" / "ckpt"
    tag.mkdir(parents=True)
    for rank in (0, 1):
        (tag / f"mp_rank_0{rank}_model_states.pt").write_bytes(b"")
    assert tp_degree(tag.parent) == 2
    one_rank = SimpleNamespace(lora=None, tp=None, actor=None, critic=None)
    with pytest.raises(CheckpointMismatch, match="tensor_parallel=2, and this one has 1"):
        load_engines(one_rank, tag.parent.parent)
    with pytest.raises(ExportError, match="a tensor-parallel checkpoint .* without its gathered weights"):
        fp32_state(tag.parent)
