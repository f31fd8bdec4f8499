"""Long contexts in the trainer's cost (planner.training): logits, activations with and without
checkpointing, Ulysses sequence parallelism, the micro-batch token budget; and the 64K recipe.

Qwen2.5-32B as the recipe states it: 64 layers, hidden 5,120, 40 heads of 128, 8 KV heads (k/v
width 1,024), 32.5B weights, so an inferred MLP width of 28,965 (embeddings counted as MLP); a
block's working set W = 6·5,120 + 2·1,024 + 4·28,965 = 148,628 elements per token. The vocabulary
is Qwen2.5's 152,064 (the recipe's model path is a hub id: no config.json here).
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from streamrl_cli.planner.costmodel import AnalyticCostModel
from streamrl_cli.planner.hardware import load_hardware
from streamrl_cli.planner.problem import overrides, pools_from_recipe, tune
from streamrl_cli.planner.report import document, long_context_note
from streamrl_cli.planner.search import trainer_counts
from streamrl_cli.planner.training import (
    TrainingModel,
    actor_passes,
    layer_working_set,
    memory_parts,
    train_passes,
)
from streamrl_cli.planner.workload import DEFAULT_VOCAB, workload_from_recipe
from streamrl_cli.recipe.load import load
from streamrl_cli.recipe.schema import TrainerConfig

HW = load_hardware()
H800 = HW.get("h800")
RECIPE = "paper/qwen2.5-32b-grpo-64k"
T = 65_536  # 2,048 prompt + 63,488 output tokens: one micro-batch
V = 152_064
W = 148_628
CHUNK = TrainerConfig().logits_chunk  # the recipe keeps the trainer's default
L, H = 64, 5120


def wl64k(*ovr: str):
    return workload_from_recipe(load(RECIPE, list(ovr)).recipe)


def test_the_64k_workload_reads_the_long_context_keys():
    wl = wl64k()
    assert (wl.max_seq, wl.micro_tokens, wl.model.vocab) == (T, T, DEFAULT_VOCAB) and V == DEFAULT_VOCAB
    assert (wl.logits_chunk, wl.activation_checkpointing, wl.sequence_parallel) == (CHUNK, True, 1)
    assert layer_working_set(wl.model, T) == W
    assert layer_working_set(wl.model, T, "eager") == W + 40 * T  # eager keeps its probabilities


def test_micro_batch_tokens_bound_the_micro_batch_but_never_below_one_longest_sample():
    wl = wl64k()
    assert dataclasses.replace(wl, micro_batch_tokens=0).micro_tokens == T  # off: one longest sample
    assert dataclasses.replace(wl, micro_batch_tokens=1000).micro_tokens == T  # at least one sample
    assert dataclasses.replace(wl, micro_batch_tokens=200_000).micro_tokens == 200_000
    assert dataclasses.replace(wl, micro_batch_tokens=10**7).micro_tokens == 8 * T  # micro_batch rows
    # A bigger micro-batch: fewer of them, more memory each.
    big = dataclasses.replace(wl, micro_batch_tokens=2 * T)
    tm, tm2 = TrainingModel(AnalyticCostModel(), H800, wl), TrainingModel(AnalyticCostModel(), H800, big)
    p, p2 = tm.plan(1, 1, 8, 3, False, 8, True), tm2.plan(1, 1, 8, 3, False, 8, True)
    assert p2 is not None and p2.micro_batches < p.micro_batches and p2.memory_gb > p.memory_gb


def test_logits_bytes_follow_the_chunk_the_zero_stage_and_sp_exactly():
    wl = wl64k()
    unchunked = 3 * T * V * 4  # the logits, their log-softmax, its gradient: fp32
    chunked = 2 * CHUNK * V * 4  # one chunk's logits and their gradient
    assert memory_parts(wl, 1, 1, 8, 2, False)["logits"] == chunked
    assert memory_parts(dataclasses.replace(wl, logits_chunk=0), 1, 1, 8, 2, False)["logits"] == unchunked
    # ZeRO-3 too: its chunks go through the head module, which gathers the partitioned weight.
    assert memory_parts(wl, 1, 1, 8, 3, False)["logits"] == chunked
    whole = dataclasses.replace(wl, logits_chunk=0)
    for sp in (2, 4, 8):
        assert memory_parts(whole, 1, 1, 8 // sp, 3, False, sp)["logits"] == unchunked / sp
    # A chunk larger than a rank's tokens is those tokens.
    small = dataclasses.replace(wl, logits_chunk=T)
    assert memory_parts(small, 1, 1, 1, 2, False, 8)["logits"] == 2 * (T // 8) * V * 4
    # No vocabulary known (a bare ModelShape): no logits counted.
    bare = dataclasses.replace(wl, model=dataclasses.replace(wl.model, vocab=0))
    assert memory_parts(bare, 1, 1, 8, 3, False)["logits"] == 0


def test_activations_follow_checkpointing_and_sp_exactly():
    wl = wl64k()
    on = memory_parts(wl, 1, 1, 8, 3, False, 1, True)["activations"]
    off = memory_parts(wl, 1, 1, 8, 3, False, 1, False)["activations"]
    assert on == T * (L * H + W) * 2  # each block's input, and one block's working set
    assert off == T * L * W * 2  # every block's working set
    assert off > 10 * on
    for sp in (2, 4, 8):
        for ckpt in (True, False):
            parts = memory_parts(wl, 1, 1, 8 // sp, 3, False, sp, ckpt)
            assert parts["activations"] == memory_parts(wl, 1, 1, 8, 3, False, 1, ckpt)["activations"] / sp
    # The same 8 GPUs: ZeRO partitions weights, gradients and states over every rank, SP or not.
    base = memory_parts(wl, 1, 1, 8, 3, False)
    sp4 = memory_parts(wl, 1, 1, 2, 3, False, 4)
    assert all(sp4[k] == pytest.approx(base[k]) for k in ("weights", "gradients", "optimizer"))


def test_recomputation_is_counted_only_with_checkpointing():
    wl = wl64k()
    assert train_passes(wl, 1000, True) == 4 + 1 and train_passes(wl, 1000, False) == 3 + 1
    assert actor_passes(wl, 1000, False) == 3
    cm = AnalyticCostModel()
    tm = TrainingModel(cm, H800, dataclasses.replace(wl, activation_checkpointing=False))
    on, off = tm.plan(1, 1, 8, 3, True, 8, True), tm.plan(1, 1, 8, 3, True, 8, False)
    assert on is not None and off is None  # 64 blocks' working sets do not fit even split 8 ways
    tiny = dataclasses.replace(wl, max_prompt_len=512, prompt_len=256, micro_batch_tokens=0)
    tiny = dataclasses.replace(tiny, lengths=dataclasses.replace(wl.lengths, mode=256, max_len=1536))
    tm = TrainingModel(cm, H800, tiny)
    on, off = tm.plan(1, 1, 64, 3, False, 1, True), tm.plan(1, 1, 64, 3, False, 1, False)
    assert on.compute_s > off.compute_s and on.memory_gb < off.memory_gb


def test_sp_adds_all_to_alls_and_shortens_the_last_sample():
    wl = dataclasses.replace(wl64k(), activation_checkpointing=False)
    tm = TrainingModel(AnalyticCostModel(), H800, wl)
    sp4, sp8 = tm.plan(1, 1, 16, 3, False, 4, True), tm.plan(1, 1, 8, 3, False, 8, True)
    assert sp4 is not None and sp8 is not None and sp4.gpus == sp8.gpus == 64
    assert sp8.last_sample_s < sp4.last_sample_s  # the longest sample split over more GPUs
    assert sp8.micro_batches >= 2 * sp4.micro_batches - 1  # half the replicas, twice the tokens each
    assert sp8.compute_s > sp4.compute_s  # more all-to-alls and ZeRO-3 gathers per GPU


def test_sp_degrees_divide_the_heads_and_a_recipe_can_fix_them():
    cm = AnalyticCostModel()
    assert TrainingModel(cm, H800, wl64k()).sps == [1, 2, 4, 8]  # 40 heads, 8 KV heads
    assert TrainingModel(cm, H800, wl64k()).checkpointing == [True]  # the recipe turns it on
    seven = workload_from_recipe(load("paper/qwen2.5-7b-grpo").recipe)  # 28 heads, 4 KV heads
    assert TrainingModel(cm, H800, seven).sps == [1, 2, 4]
    assert TrainingModel(cm, H800, seven).checkpointing == [False, True]
    fixed = dataclasses.replace(wl64k(), sequence_parallel=4)
    assert TrainingModel(cm, H800, fixed).sps == [4]
    assert TrainingModel(cm, H800, dataclasses.replace(wl64k(), attention="eager")).sps == [1]
    assert TrainingModel(cm, H800, wl64k(), layouts="megatron").sps == [1]
    layouts = TrainingModel(cm, H800, wl64k()).layouts(8)
    # Ulysses degrees at TP 1; AutoTP degrees (inside the node) without Ulysses.
    assert layouts == [
        (1, 1, 1, 8),
        (1, 1, 2, 4),
        (1, 1, 4, 2),
        (1, 1, 8, 1),
        (2, 1, 1, 4),
        (4, 1, 1, 2),
        (8, 1, 1, 1),
    ]
    assert TrainingModel(cm, H800, wl64k()).plan(1, 1, 2, 3, True, 8, True).layout == (
        "TP1 PP1 SP8 DP2 Z3+offload+ckpt"
    )


def test_the_64k_recipe_fits_only_with_the_planners_proposal():
    r = load(RECIPE).recipe
    cm = AnalyticCostModel()
    (pool,) = pools_from_recipe(r)
    counts = trainer_counts(pool, 8)
    assert pool.gpus == 64 and counts[-1] == 64
    # (a) No SP, unchunked logits, no checkpointing: no trainer of these GPUs fits.
    bare = workload_from_recipe(
        load(RECIPE, ["roles.trainer.logits_chunk=0", "roles.trainer.activation_checkpointing=false"]).recipe
    )
    tm = TrainingModel(cm, H800, bare, sequence_parallel=(1,), checkpointing=(False,), tensor_parallel=(1,))
    assert all(tm.best(y) is None for y in counts)
    # Checkpointing and chunking alone fit only at 48 GPUs or more (ZeRO-3 + offload, 67 GB of 68): a
    # rank holding all 64K tokens keeps 62 GB of activations at layer boundaries.
    sp1 = TrainingModel(cm, H800, wl64k(), sequence_parallel=(1,), tensor_parallel=(1,))
    assert [y for y in counts if sp1.best(y) is not None] == [y for y in counts if y >= 48]
    # AutoTP instead of SP splits less: every TP rank keeps the checkpointed block inputs of all 64K
    # tokens (64 layers × 5,120 × 2 bytes = 43 GB): TP fits from 16 GPUs (ZeRO-3 + offload, 48 GB or
    # more of activations), SP8 from 8.
    tp = TrainingModel(cm, H800, wl64k(), sequence_parallel=(1,), tensor_parallel=(2, 4, 8))
    assert [y for y in counts if tp.best(y) is not None] == [y for y in counts if y >= 16]
    assert tp.best(16).layout == "TP2 PP1 DP8 Z3+offload+ckpt"
    assert tp.memory_parts(8, 1, 2, 3, True, 1, True)["activations"] > T * L * H * 2 > 40e9
    # (b) tune-split proposes SP and its plan fits.
    tuned = tune(r)
    t = tuned.result.recommended.train
    assert t.sp > 1 and t.checkpointing and t.memory_gb <= H800.usable_bytes / 1e9
    parts = memory_parts(tuned.workload, t.tp, t.pp, t.dp, t.zero, t.offload, t.sp, t.checkpointing)
    assert sum(parts.values()) / 1e9 == pytest.approx(t.memory_gb)
    assert parts["activations"] == T / t.sp * (L * H + W) * 2
    note = long_context_note(tuned.workload, t)
    assert f"SP{t.sp} splits it to" in note and "without SP no layout" in note
    assert "activation checkpointing on" in note and "logits chunked by 1024" in note
    assert "Proposes roles.trainer.sequence_parallel" in note
    doc = json.loads(json.dumps(document(tuned)))
    lc = doc["long_context"]
    assert lc["sequence_parallel"] == t.sp and lc["tokens_per_gpu"] == T // t.sp
    assert lc["proposes"] == {"roles.trainer.sequence_parallel": t.sp}
    by_part = doc["recommended"]["training"]["memory_gb_by_part"]
    assert by_part["logits"] == round(2 * CHUNK * V * 4 / 1e9, 2)
    lines = overrides(tuned.result.recommended, r)
    assert "roles.trainer.activation_checkpointing=true" in lines


def test_the_vocabulary_comes_from_a_local_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 1000}}))
    assert workload_from_recipe(load(RECIPE, [f"model.path={tmp_path}"]).recipe).model.vocab == 1000
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 32_000}))
    assert workload_from_recipe(load(RECIPE, [f"model.path={tmp_path}"]).recipe).model.vocab == 32_000
    (tmp_path / "config.json").write_text("not json")
    assert workload_from_recipe(load(RECIPE, [f"model.path={tmp_path}"]).recipe).model.vocab == V


def test_a_builder_models_vocabulary_is_the_builders():
    from streamrl_cli.models.tiny import TinySpec
    from streamrl_cli.planner.workload import BUILDER_VOCAB

    assert BUILDER_VOCAB == TinySpec().vocab_size  # the planner's copy (it imports nothing of models)
    recipe = load("local", ["model.path=/nonexistent/tiny"]).recipe
    assert workload_from_recipe(recipe).model.vocab == BUILDER_VOCAB


def test_lora_under_zero_3_counts_the_whole_logits():
    # The trainer computes a frozen, partitioned head's logits whole (trainer.role.models.lm_head).
    wl = dataclasses.replace(wl64k(), lora_rank=8, lora_targets=("q_proj",))
    assert memory_parts(wl, 1, 1, 8, 2, False)["logits"] == 2 * CHUNK * V * 4
    assert memory_parts(wl, 1, 1, 8, 3, False)["logits"] == 3 * T * V * 4
