"""Mixtures of experts and tensor-parallel trainers in the planner (issue #44, item 6).

Qwen3-30B-A3B as its public config.json states it (streamrl_cli/planner/models.yaml): 48 layers,
hidden 2,048, 32 heads of 128 (q width 4,096), 4 KV heads, 128 experts of width 768, 8 per token,
no shared expert, vocabulary 151,936. One expert's gate/up/down: 3 · 2,048 · 768 = 4,718,592
weights; the routed experts: 48 · 128 · 4,718,592 = 28,991,029,248 of the recipe's 30.5B.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from streamrl_cli.models.architecture import active_params, architecture, estimate_params, moe
from streamrl_cli.planner import PlannerError
from streamrl_cli.planner.costmodel import AnalyticCostModel, forward_flops_per_token
from streamrl_cli.planner.hardware import load_hardware
from streamrl_cli.planner.problem import overrides, pools_from_recipe, trainer_runs_tp, tune
from streamrl_cli.planner.report import document, parallel_note, table
from streamrl_cli.planner.search import Planner
from streamrl_cli.planner.training import (
    TrainingModel,
    activation_bytes,
    expert_parallel_degrees,
    layer_working_set,
    layer_working_set_parts,
)
from streamrl_cli.planner.workload import adapter_params, catalogue, model_from_recipe, workload_from_recipe
from streamrl_cli.recipe.load import load

HW = load_hardware()
H800 = HW.get("h800")
CM = AnalyticCostModel()
A3B = "moe/qwen3-30b-a3b-grpo"
A22B = "moe/qwen3-235b-a22b-grpo"
ONE_EXPERT = 3 * 2048 * 768
EXPERTS = 48 * 128 * ONE_EXPERT
ACTIVE = 30_500_000_000 - 48 * (128 - 8) * ONE_EXPERT


def a3b():
    return workload_from_recipe(load(A3B).recipe)


def test_the_scenario_reads_the_experts_from_the_catalogue_and_counts_active_against_total():
    m = a3b().model
    assert (m.experts, m.experts_per_token, m.expert_intermediate, m.shared_intermediate) == (128, 8, 768, 0)
    assert (m.moe_layers, m.head_dim, m.q_width, m.vocab) == (48, 128, 4096, 151_936)
    assert EXPERTS == 28_991_029_248 and m.expert_params == EXPERTS
    assert m.params == 30.5e9 and m.active_params == ACTIVE == 3_320_910_080
    # Compute counts the active weights: a forward at no context is 2 FLOPs per active weight.
    assert forward_flops_per_token(m, 0) == 2 * ACTIVE
    assert forward_flops_per_token(m, 1000) == 2 * ACTIVE + 4 * 48 * 4096 * 1000
    # Memory counts the total: the generators' weights and each weight version are 61 GB.
    assert m.weight_bytes == 61e9 and a3b().version_bytes == 61e9
    # The dense models are unchanged: active = total, one MLP per LoRA target.
    dense = workload_from_recipe(load("paper/qwen2.5-7b-ppo").recipe).model
    assert (
        not dense.moe
        and dense.active_params == dense.params
        and dense.decode_weight_bytes(64) == dense.weight_bytes
    )


def test_models_architecture_counts_total_and_active_from_config_json():
    for hub, total, active in (
        ("Qwen/Qwen3-30B-A3B", 30.5e9, 3.3e9),  # the model card's 30.5B / 3.3B
        ("Qwen/Qwen3-235B-A22B", 235e9, 22e9),  # 235B / 22B
    ):
        config = catalogue()[hub]
        arch = architecture(config)
        assert arch["params_b"] == pytest.approx(total / 1e9, rel=0.01)
        assert active_params(config) == pytest.approx(active, rel=0.02)
        assert moe(config)["experts"] == 128 and moe(config)["dense_layers"] == 0
    # Counted by hand: attention 2·2048·4096 + 2·2048·512, router 2048·128, 8 (or 128) experts,
    # embeddings and head 2 · 151,936 · 2048.
    config = catalogue()["Qwen/Qwen3-30B-A3B"]
    attn, router, embed = 2 * 2048 * 4096 + 2 * 2048 * 512, 2048 * 128, 2 * 151_936 * 2048
    arch = architecture(config)
    assert estimate_params(config, arch) == 48 * (attn + router + 128 * ONE_EXPERT) + embed
    assert estimate_params(config, arch, active=True) == 48 * (attn + router + 8 * ONE_EXPERT) + embed
    # The planner's active count from the recipe's total agrees with the architecture's within 1%.
    assert a3b().model.active_params == pytest.approx(active_params(config), rel=0.01)
    # A dense config is counted as before; DeepSeek's shared experts and dense first layers count too.
    dense = {
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "vocab_size": 100,
        "intermediate_size": 128,
    }
    assert (
        moe(dense) == {}
        and estimate_params(dense, architecture(dense)) == 2 * (4 * 64 * 64 + 3 * 64 * 128) + 2 * 100 * 64
    )
    deepseek = {
        **dense,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
    }
    assert moe(deepseek) == {
        "experts": 4,
        "experts_per_token": 2,
        "expert_intermediate": 16,
        "shared_intermediate": 16,
        "dense_layers": 1,
    }
    moe_mlp = 64 * 4 + 3 * 64 * 16 * 4 + 3 * 64 * 16
    assert (
        estimate_params(deepseek, architecture(deepseek))
        == 2 * 4 * 64 * 64 + 3 * 64 * 128 + moe_mlp + 2 * 100 * 64
    )


def test_decode_reads_the_distinct_experts_of_the_batch():
    m = a3b().model
    assert m.distinct_experts(1) == pytest.approx(8)  # b = 1: the token's k experts
    assert m.distinct_experts(16) == pytest.approx(128 * (1 - (1 - 8 / 128) ** 16))  # 82.4
    assert m.distinct_experts(512) == pytest.approx(128, rel=1e-9)  # large b: every expert
    steps = [m.distinct_experts(b) for b in (1, 2, 4, 8, 16, 64, 256)]
    assert steps == sorted(steps) and all(8 <= s <= 128 for s in steps)
    dense_bytes = (30.5e9 - EXPERTS) * 2
    assert m.decode_weight_bytes(1) == pytest.approx(dense_bytes + 48 * 8 * ONE_EXPERT * 2)
    assert m.decode_weight_bytes(1e6) == pytest.approx(m.weight_bytes)
    # A lone sequence decodes far faster than a dense model of the same total size would, and the
    # step grows towards it as the batch touches more experts.
    h20 = HW.get("h20")
    dense = dataclasses.replace(m, experts=0, experts_per_token=0, expert_intermediate=0)
    assert CM.decode_step_s(h20, m, 1, 1, 2000) < 0.5 * CM.decode_step_s(h20, dense, 1, 1, 2000)
    assert CM.decode_step_s(h20, m, 1, 1, 2000) < CM.decode_step_s(h20, m, 1, 16, 2000)
    # Prefill is compute: the active weights'.
    assert CM.prefill_s(h20, m, 1, 1000) == pytest.approx(CM.prefill_s(h20, dense, 1, 1000) * ACTIVE / 30.5e9)


def test_memory_per_rank_falls_with_tp_and_ep():
    wl = a3b()
    tm = TrainingModel(CM, H800, wl)
    b, sets = 2, 2  # bf16; actor and reference (GRPO with a KL term)
    by_tp = [tm.memory_parts(tp, 1, 4, 1, False, 1, True) for tp in (1, 2, 4, 8)]
    for tp, parts in zip((1, 2, 4, 8), by_tp, strict=True):
        assert parts["weights"] == pytest.approx(b * sets * 30.5e9 / tp)  # ZeRO-1: every weight, ÷ TP
        assert parts["optimizer"] == pytest.approx(12 * 30.5e9 / tp / 4)
    acts = [p["activations"] for p in by_tp]
    assert acts == sorted(acts, reverse=True)
    # AutoTP splits q/k/v, the attention output and the experts' MLPs; the block inputs stay whole.
    whole, split = layer_working_set_parts(wl.model, wl.micro_tokens)
    assert whole + split == layer_working_set(wl.model, wl.micro_tokens)
    assert by_tp[3]["activations"] == pytest.approx(wl.micro_tokens * (48 * 2048 + whole + split / 8) * b)
    assert by_tp[3]["activations"] > by_tp[0]["activations"] / 8
    # EP splits the routed experts over EP data-parallel ranks (ZeRO-1: weights and gradients whole).
    by_ep = {ep: tm.memory_parts(1, 1, 8, 1, False, 1, True, ep) for ep in (1, 2, 4, 8)}
    for ep, parts in by_ep.items():
        assert parts["weights"] == pytest.approx(b * sets * (30.5e9 - EXPERTS + EXPERTS / ep))
        assert parts["gradients"] == pytest.approx(b * (30.5e9 - EXPERTS + EXPERTS / ep))
        assert parts["optimizer"] == pytest.approx(by_ep[1]["optimizer"])  # ZeRO shards them anyway
    # Under ZeRO-3 EP moves no memory (the experts are partitioned over every rank either way) but
    # divides what each rank gathers across nodes: on 32 GPUs the time falls (67 s, 34 s at EP2, 24 s
    # at EP4); at EP8 the all-to-alls, (EP − 1) / EP of the routed tokens, cost more than it saves.
    z3 = {ep: tm.plan(1, 1, 32, 3, False, 1, True, ep) for ep in (1, 2, 4, 8)}
    assert len({round(p.memory_gb, 6) for p in z3.values()}) == 1
    assert z3[1].time_s > z3[2].time_s > z3[4].time_s < z3[8].time_s
    assert expert_parallel_degrees(wl.model) == [1, 2, 4, 8, 16, 32, 64]
    assert tm.plan(1, 1, 6, 1, False, 1, True, 4) is None  # EP must divide the data-parallel ranks


def test_tp_and_ep_add_their_collectives():
    wl = a3b()
    tm = TrainingModel(CM, H800, wl)
    one = tm.plan(4, 1, 2, 2, True, 1, True)
    ep = tm.plan(4, 1, 2, 2, True, 1, True, 2)
    assert one.layout == "TP4 PP1 DP2 Z2+offload+ckpt" and ep.layout == "TP4 PP1 DP2 EP2 Z2+offload+ckpt"
    # EP2 × TP4 inside a node: per micro-batch, 4 passes (forward, recomputation, backward, the
    # reference's forward) × 48 MoE layers × (2 latencies + 2·k·h·T·b·(EP − 1)/EP over NVLink).
    micro = math.ceil(wl.tokens / 2 / wl.micro_tokens)
    volume = 2 * 8 * 2048 * wl.micro_tokens * 2 * 0.5
    a2a = 4 * 48 * (2 * H800.collective_s + volume / (H800.nvlink_bw * H800.eff.comm))
    assert ep.compute_s - one.compute_s == pytest.approx(micro * a2a)
    # TP4's all-reduces: 2 per layer and pass, of T · h · b, 2 (TP − 1) / TP of it over NVLink.
    tp1 = tm.plan(1, 1, 8, 3, True, 1, True)  # ZeRO-3: its gathers hide or replace compute
    msg = wl.micro_tokens * 2048 * 2 * 2 * 3 / 4
    ar = 4 * 2 * 48 * (H800.collective_s + msg / (H800.nvlink_bw * H800.eff.comm))
    assert one.last_sample_s > ar and tp1 is not None
    # AutoTP: not beside Ulysses, nor (in the trainer's search) for a mixture of experts or LoRA.
    assert tm.plan(2, 1, 2, 2, True, 2, True) is None
    assert tm.tps == [1] and TrainingModel(CM, H800, wl, layouts="megatron").tps == [1, 2, 4, 8]


def test_paper_72b_plans_a_tp_trainer():
    r = load("paper/qwen2.5-72b-ppo").recipe
    wl = workload_from_recipe(r)
    pools = pools_from_recipe(r)
    # The trainer's ZeRO data parallelism alone (TP 1): 56 generation / 72 training GPUs, Ulysses SP4.
    zero = Planner(wl, HW, CM, trainer_tps=(1,)).search(pools).recommended
    assert (zero.gen.gpus, zero.train.gpus, zero.train.layout) == (56, 72, "TP1 PP1 SP4 DP18 Z3+ckpt")
    # With AutoTP: TP8 on 48 GPUs, the paper's 80 / 48, 3% faster.
    best = Planner(wl, HW, CM).search(pools).recommended
    assert (best.gen.gpus, best.train.gpus, best.train.tp) == (80, 48, 8)
    assert best.train.layout == "TP8 PP1 DP6 Z3+offload+ckpt"
    assert best.estimate.iteration_s < 0.98 * zero.estimate.iteration_s
    assert "roles.trainer.tensor_parallel=8" in overrides(best, r)
    # AutoTP keeps the checkpointed block inputs whole on every TP rank: 80 layers × 8,192 × 21.5K
    # tokens × 2 bytes = 28 GB, more than the whole activations of an SP4 rank.
    acts = dict(best.train.memory_parts_gb)["activations"] * 1e9
    assert acts > 80 * 8192 * wl.micro_tokens * 2 > dict(zero.train.memory_parts_gb)["activations"] * 1e9
    # The paper's Megatron trainer (sequence-parallel TP: everything ÷ TP) gives the same split.
    megatron = Planner(wl, HW, CM, layouts="megatron").search(pools).recommended
    assert (megatron.gen.gpus, megatron.train.gpus, megatron.train.tp) == (80, 48, 8)
    assert megatron.estimate.iteration_s < best.estimate.iteration_s
    # tune-split plans TP only where the recipe checks accept it (the trainer's AutoTP), so that
    # what --write writes runs.
    tuned = tune(r)
    if trainer_runs_tp(r):
        assert tuned.result.recommended.train.tp == 8
    else:
        assert all(o.train.tp == 1 for o in tuned.result.options)
    # LoRA and mixtures of experts train without AutoTP.
    lora = workload_from_recipe(load("paper/qwen2.5-72b-ppo", ["model.lora.rank=8"]).recipe)
    assert TrainingModel(CM, H800, lora).tps == [1] and TrainingModel(CM, H800, wl).tps == [1, 2, 4, 8]


@pytest.mark.parametrize("recipe,gen_kind", [(A3B, "h20"), (A22B, "h20")])
def test_the_qwen3_moe_scenarios_plan(recipe, gen_kind, capsys):
    from rich.console import Console

    tuned = tune(load(recipe).recipe)
    best = tuned.result.recommended
    assert best.gen.hardware == gen_kind and best.train.hardware == "h800"
    assert best.train.memory_gb <= H800.usable_bytes / 1e9
    assert best.estimate.samples_per_s > 0
    Console(width=220).print(table(tuned, 6))
    out = capsys.readouterr().out
    print(out)  # the split, for the report (pytest -s)
    assert "MoE:" in out and f"{best.gen.gpus}× {gen_kind}" in out
    doc = json.loads(json.dumps(document(tuned)))
    assert doc["trainer"]["moe"]["experts"] == 128
    m = tuned.workload.model
    assert (
        doc["workload"]["active_params_b"]
        == round(m.active_params / 1e9, 3)
        < doc["workload"]["params_b"] / 9
    )
    if best.train.ep > 1:
        note = parallel_note(tuned.workload, best.train)
        assert f"EP{best.train.ep} assumes the routed experts split over groups of {best.train.ep}" in note
        with pytest.raises(PlannerError, match="expert"):
            overrides(best, load(recipe).recipe)


def test_a_local_config_json_wins_and_must_agree_with_the_recipe(tmp_path):
    config = dict(catalogue()["Qwen/Qwen3-30B-A3B"], num_experts=64)
    (tmp_path / "config.json").write_text(json.dumps(config))
    m = model_from_recipe(load(A3B, [f"model.path={tmp_path}"]).recipe)
    assert m.experts == 64 and m.active_params == pytest.approx(30.5e9 - 48 * 56 * ONE_EXPERT)
    (tmp_path / "config.json").write_text(json.dumps(dict(config, num_hidden_layers=40)))
    with pytest.raises(PlannerError, match="num_layers 48 but its config.json says 40"):
        model_from_recipe(load(A3B, [f"model.path={tmp_path}"]).recipe)
    with pytest.raises(PlannerError, match="params_b is the total"):
        model_from_recipe(load(A3B, ["model.params_b=3"]).recipe)


def test_lora_on_expert_projections_adapts_every_expert():
    m = a3b().model
    # q_proj: 8 · (2048 + 4096) per layer; gate_proj: 8 · (2048 + 768) for each of 128 experts.
    assert adapter_params(m, 8, ("q_proj",)) == 48 * 8 * (2048 + 4096)
    assert adapter_params(m, 8, ("gate_proj",)) == 48 * 128 * 8 * (2048 + 768)


def test_activations_at_tp1_are_unchanged_and_megatron_splits_everything():
    wl = a3b()
    t = wl.micro_tokens
    assert activation_bytes(wl, t, True, 1) == activation_bytes(wl, t, True, 1, megatron=True)
    assert activation_bytes(wl, t, True, 4, megatron=True) == pytest.approx(activation_bytes(wl, t, True) / 4)
