"""The trainer's cost with LoRA and with each algorithm's models: hand-computed on a small model.

The toy model: 8 layers, hidden 1,024, 16 heads of 64, 4 KV heads (k/v width 256), gated MLP of
4,096, no embeddings, bf16. Per layer: attention 2·1024² + 2·1024·256 = 2,621,440 weights, MLP
3·1024·4096 = 12,582,912; N = 8 × 15,204,352 = 121,634,816 weights.
"""

from __future__ import annotations

import dataclasses

import pytest

from streamrl_cli.planner import PlannerError
from streamrl_cli.planner.costmodel import AnalyticCostModel
from streamrl_cli.planner.hardware import load_hardware
from streamrl_cli.planner.iteration import weight_sync_s
from streamrl_cli.planner.lengths import LengthDist
from streamrl_cli.planner.problem import tune
from streamrl_cli.planner.report import document, table
from streamrl_cli.planner.scenario import from_option
from streamrl_cli.planner.search import Planner, Pool
from streamrl_cli.planner.training import TrainingModel, actor_passes, memory_parts, train_passes
from streamrl_cli.planner.workload import ModelShape, Workload, adapter_params, workload_from_recipe
from streamrl_cli.recipe.load import load

HW = load_hardware()
N = 121_634_816
TOY = ModelShape("toy", float(N), 8, 1024, 16, 4, 2)  # intermediate left to be inferred
QV = ("q_proj", "v_proj")
# max_seq × bytes × (layers × hidden + one layer's working set), activation checkpointing on; the
# working set of a block per token (planner.training.layer_working_set): 6·1024 + 2·256 + 4·4096.
ACTS = 2048 * 2 * (8 * 1024 + 23_040)


def toy(algorithm: str = "grpo", *, reference: bool = True, rank: int = 0, targets=QV) -> Workload:
    return Workload(
        model=TOY,
        algorithm=algorithm,
        mode="sync-stream",
        prompts=64,
        group_size=8,
        prompt_len=256,
        max_prompt_len=512,
        lengths=LengthDist(300, 1536),
        micro_batch=8,
        reference=reference,
        lora_rank=rank,
        lora_targets=targets if rank else (),
    )


def test_the_mlp_width_is_inferred_from_the_parameter_count_or_taken_as_given():
    assert TOY.mlp_width == 4096
    assert dataclasses.replace(TOY, intermediate=3000).mlp_width == 3000
    assert TOY.linear_shapes["k_proj"] == (1024, 256) and TOY.linear_shapes["down_proj"] == (4096, 1024)


def test_adapter_parameters_are_rank_times_in_plus_out_per_adapted_layer():
    # q_proj: 8 · (1024 + 1024) = 16,384; v_proj: 8 · (1024 + 256) = 10,240; × 8 layers.
    assert adapter_params(TOY, 8, QV) == 8 * (16_384 + 10_240) == 212_992
    # All seven: q 16,384, k 10,240, v 10,240, o 16,384, gate/up/down 8 · 5,120 = 40,960 each.
    every = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert adapter_params(TOY, 8, every) == 8 * 176_128 == 1_409_024
    # A layer named twice is adapted once; an indexed name adapts one block.
    assert adapter_params(TOY, 8, ("q_proj", "self_attn.q_proj")) == 8 * 16_384
    assert adapter_params(TOY, 8, ("model.layers.3.self_attn.q_proj",)) == 16_384
    with pytest.raises(PlannerError, match="'c_attn' is no layer"):
        adapter_params(TOY, 8, ("c_attn",))


def test_qwen_7b_rank_8_on_q_and_v_has_pefts_adapter_count():
    r = load("paper/qwen2.5-7b-grpo", ["model.lora.rank=8", "model.lora.target_modules=[q_proj,v_proj]"])
    wl = workload_from_recipe(r.recipe)
    # 28 layers × 8 · ((3584 + 3584) + (3584 + 512)) = 2,523,136: Qwen2.5-7B's real q and v shapes
    # (neither depends on the MLP width, which the recipe does not state).
    assert (wl.lora_rank, wl.lora_targets, wl.adapter_params) == (8, QV, 2_523_136)
    assert workload_from_recipe(load("paper/qwen2.5-7b-grpo").recipe).lora is False


def test_memory_of_full_fine_tuning_and_lora_by_part():
    full = memory_parts(toy(), 1, 1, 1, 1, False)
    assert full == {
        "weights": 2 * 2 * N,  # the actor and the reference copy
        "gradients": 2 * N,
        "optimizer": 12 * N,  # Adam's m and v and the fp32 master
        "activations": ACTS,
        "logits": 0.0,  # the toy states no vocabulary
    }
    assert sum(full.values()) == 2_317_352_960
    lora = memory_parts(toy(rank=8), 1, 1, 1, 1, False)
    assert lora == {
        "weights": 2 * (N + 212_992),  # the frozen base and the adapters; no reference copy
        "gradients": 2 * 212_992,
        "optimizer": 12 * 212_992,
        "activations": ACTS,
        "logits": 0.0,
    }
    assert sum(lora.values()) == 374_603_776
    # ZeRO-3 on 4 GPUs shards weights, gradients and states alike.
    z3 = memory_parts(toy(rank=8), 1, 1, 4, 3, False)
    assert z3["weights"] == 2 * (N + 212_992) / 4 and z3["optimizer"] == 12 * 212_992 / 4


def test_each_algorithm_adds_the_models_it_runs():
    # DAPO's preset has no KL: no reference, no reference forward.
    assert memory_parts(toy(reference=False), 1, 1, 1, 1, False)["weights"] == 2 * N
    # PPO: the critic trains in full beside the actor's adapters (no reference copy with LoRA).
    ppo = memory_parts(toy("ppo", rank=8), 1, 1, 1, 1, False)
    assert ppo["weights"] == 2 * (2 * N + 212_992)
    assert ppo["gradients"] == 2 * (N + 212_992) and ppo["optimizer"] == 12 * (N + 212_992)
    # Forward-equivalents: a trained model 4, each frozen forward 1.
    assert train_passes(toy(), 1000) == 4 + 1
    assert train_passes(toy(reference=False), 1000) == 4
    assert train_passes(toy("ppo"), 1000) == 4 + 4 + 2  # reference and critic values
    assert train_passes(toy("ppo", reference=False), 1000) == 4 + 4 + 1


def test_lora_drops_the_frozen_weights_gradient_gemms_from_the_actors_work():
    # F = 2N + 4 · layers · hidden · ctx = 243,269,632 + 32,768,000 at ctx 1000; the actor loses
    # 2N and gains 8 · N_a = 1,703,936 of adapter work.
    assert actor_passes(toy(), 1000) == 4
    assert actor_passes(toy(rank=8), 1000) == pytest.approx(4 - 241_565_696 / 276_037_632, rel=1e-12)
    # The reference's forward stays with LoRA (the base with its adapters off).
    assert train_passes(toy(rank=8), 1000) == pytest.approx(actor_passes(toy(rank=8), 1000) + 1, rel=1e-12)


def test_a_lora_trainer_fits_a_gpu_the_full_one_does_not():
    # Usable 0.5 GB: full fine-tuning needs 857,735,168 bytes even with the optimizer offloaded
    # (weights ×2, gradients, activations); LoRA 372,047,872 (offloaded) or 374,603,776 — with
    # activation checkpointing: without it the activations alone (8 × 23,040 × 2 × 2048) overflow.
    h800 = HW.get("h800")
    small = dataclasses.replace(
        h800, hbm_bytes=0.5e9, eff=dataclasses.replace(h800.eff, memory_usable=1.0, reserve_bytes=0.0)
    )
    cm = AnalyticCostModel()
    assert TrainingModel(cm, small, toy()).best(1) is None
    plan = TrainingModel(cm, small, toy(rank=8)).best(1)
    assert plan is not None and not plan.offload  # the fastest: Adam's step on the GPU
    assert plan.memory_gb * 1e9 == pytest.approx(374_603_776, abs=1) and plan.checkpointing
    assert plan.full_memory_gb * 1e9 > small.usable_bytes
    full_same = TrainingModel(cm, h800, toy()).memory_bytes(1, 1, 1, plan.zero, plan.offload, 1, True)
    assert plan.full_memory_gb * 1e9 == pytest.approx(full_same)


def test_lora_trains_faster_and_steps_less_on_the_same_layout():
    cm, h800 = AnalyticCostModel(), HW.get("h800")
    full = TrainingModel(cm, h800, toy()).plan(1, 1, 4, 1, False)
    lora = TrainingModel(cm, h800, toy(rank=8)).plan(1, 1, 4, 1, False)
    assert lora.compute_s < full.compute_s and lora.optimizer_s < full.optimizer_s
    assert full.full_memory_gb == full.memory_gb and lora.full_memory_gb == full.memory_gb


def recipe_tuned(*ovr: str):
    return tune(load("paper/qwen2.5-7b-grpo", list(ovr)).recipe)


def test_weight_sync_sends_the_merged_model_with_lora_and_the_simulator_uses_the_plans_costs():
    full = workload_from_recipe(load("paper/qwen2.5-7b-grpo").recipe)
    lora = workload_from_recipe(load("paper/qwen2.5-7b-grpo", ["model.lora.rank=8"]).recipe)
    h800 = HW.get("h800")
    # The whole model crosses the site link (1 GB/s here): its bytes do not depend on LoRA.
    for wl in (full, lora):
        assert wl.version_bytes == wl.model.weight_bytes
        assert weight_sync_s(wl.version_bytes, h800, h800, True, 1e9) == wl.model.weight_bytes / 1e9
    planner = Planner(lora, HW, AnalyticCostModel())
    best = planner.search([Pool("h800", "h800", 32)]).recommended
    cfg = from_option(planner, best, "sync-stream")
    assert cfg.train_s_per_token * lora.tokens == pytest.approx(best.train.compute_s)
    assert cfg.optimizer_s == best.train.optimizer_s and cfg.sync_s == best.estimate.weight_sync_s


def test_tune_split_reports_lora_and_the_memory_it_saves():
    tuned = recipe_tuned("model.lora.rank=8")
    doc = document(tuned)
    t = doc["trainer"]
    assert t["lora"]["rank"] == 8 and t["lora"]["trainable_params"] == tuned.workload.adapter_params
    assert t["reference"] == "the actor's base, adapters off (no copy)" and t["critic"] is False
    assert t["weight_sync_bytes"] == round(tuned.workload.model.weight_bytes)
    for o in doc["options"]:
        assert o["training"]["memory_gb_per_gpu"] < o["training"]["memory_gb_per_gpu_full_finetune"]
    caption = str(table(tuned).caption)
    assert "LoRA r8" in caption and "merged model" in caption
    plain = document(recipe_tuned("algorithm.name=dapo"))
    assert plain["trainer"] == {
        "lora": None,
        "critic": False,
        "reference": "none (no KL term)",
        "weight_sync_bytes": round(tuned.workload.model.weight_bytes),
        "weight_sync": "whole model",
        "moe": None,  # a dense model
    }
    rec = plain["recommended"]["training"]
    assert rec["memory_gb_per_gpu"] == rec["memory_gb_per_gpu_full_finetune"]


def test_adapter_sync_is_costed_as_the_adapters_inside_a_site_and_across():
    """model.lora.sync adapter: a version is the adapters' bytes (rank 8 on the 7B's default
    targets: ~20M parameters, 40 MB in bf16, against 15 GB merged), on the broadcast and through a
    far site's relay alike. tune-split's choice and report follow."""
    merged = workload_from_recipe(load("paper/qwen2.5-7b-grpo", ["model.lora.rank=8"]).recipe)
    adapter = workload_from_recipe(
        load("paper/qwen2.5-7b-grpo", ["model.lora.rank=8", "model.lora.sync=adapter"]).recipe
    )
    assert adapter.lora_sync == "adapter" and merged.lora_sync == "merged"
    inside = adapter.version_bytes
    assert inside == adapter.adapter_params * adapter.model.dtype_bytes
    assert inside < adapter.model.weight_bytes / 100
    h800 = HW.get("h800")
    for cross in (False, True):  # inside a site, and over a 1 GB/s link to another
        assert (
            weight_sync_s(inside, h800, h800, cross, 1e9)
            < weight_sync_s(merged.version_bytes, h800, h800, cross, 1e9) / 100
        )
    pools = [Pool("h800", "h800", 32)]
    fast = Planner(adapter, HW, AnalyticCostModel()).search(pools).recommended
    slow = Planner(merged, HW, AnalyticCostModel()).search(pools).recommended
    assert fast.estimate.weight_sync_s < slow.estimate.weight_sync_s / 100
    tuned = recipe_tuned("model.lora.rank=8", "model.lora.sync=adapter")
    t = document(tuned)["trainer"]
    assert t["weight_sync_bytes"] == round(inside)
    assert t["weight_sync"] == "the adapters alone (model.lora.sync adapter), inside a site and across sites"
    assert "adapters alone, inside a site and across" in str(table(tuned).caption)
