"""roles.trainer.tensor_parallel is checked before anything is queued: a degree that divides the
trainer's ranks and the model's query and KV heads is accepted; what AutoTP cannot run with
(sequence parallelism, LoRA, a mixture of experts) is refused by name, saying what would do."""

from __future__ import annotations

import json

import pytest

from streamrl_cli.recipe import checks
from streamrl_cli.recipe.schema import (
    ClusterConfig,
    LoraConfig,
    ModelConfig,
    Recipe,
    RolesConfig,
    TrainerConfig,
)

KEY = "roles.trainer.tensor_parallel"
CLUSTERS = {"local": ClusterConfig(launcher="local", local_gpus=8)}


def tp_problems(tp: int, *, gpus: int = 4, nodes: int = 1, model: ModelConfig | None = None, **trainer):
    t = TrainerConfig(cluster="local", nodes=nodes, gpus_per_node=gpus, tensor_parallel=tp, **trainer)
    model = model or ModelConfig(path="/nowhere", num_attention_heads=8, num_kv_heads=4)
    recipe = Recipe(clusters=CLUSTERS, model=model, roles=RolesConfig(trainer=t))
    return [msg for key, msg in checks.check(recipe) if key == KEY]


@pytest.mark.parametrize("tp,gpus,nodes", [(1, 4, 1), (2, 4, 1), (4, 4, 1), (2, 2, 1), (4, 2, 2)])
def test_a_degree_that_divides_the_ranks_and_heads_is_accepted(tp, gpus, nodes):
    assert tp_problems(tp, gpus=gpus, nodes=nodes) == []


def test_a_degree_that_divides_neither_the_ranks_nor_the_kv_heads_is_refused_with_the_valid_ones():
    (ranks, heads) = tp_problems(8, gpus=4)
    assert ranks == (
        "8 does not divide the trainer's 4 ranks (nodes × gpus_per_node, one per node on CPUs); "
        "valid: 1, 2, 4"
    )
    assert heads == (
        "8 does not split the model's 8 attention heads and 4 KV heads evenly (AutoTP gives each rank "
        "whole heads); valid: 1, 2, 4"
    )
    assert tp_problems(0) == ["must be at least 1 (1: off), got 0"]
    assert tp_problems(3, gpus=3)[0].startswith("3 does not split the model's 8 attention heads")


def test_sequence_parallelism_lora_and_experts_are_refused_by_name(tmp_path):
    (sp,) = tp_problems(2, sequence_parallel=2)
    assert "with sequence_parallel=2" in sp and "use one of them" in sp
    lora = ModelConfig(path="/nowhere", num_attention_heads=8, num_kv_heads=4, lora=LoraConfig(rank=8))
    (adapters,) = tp_problems(2, model=lora)
    assert "with model.lora.rank=8" in adapters and "tensor_parallel=1" in adapters
    moe = tmp_path / "moe"
    moe.mkdir()
    (moe / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": 8}))
    (experts,) = tp_problems(2, model=ModelConfig(path=str(moe), num_attention_heads=8, num_kv_heads=4))
    assert "mixture-of-experts model" in experts and "zero_stage=3 and tensor_parallel=1" in experts
    # with tensor_parallel 1 none of them concerns it
    assert tp_problems(1, sequence_parallel=2, model=lora) == []


def test_pipeline_parallelism_stays_refused():
    t = TrainerConfig(cluster="local", gpus_per_node=2, pipeline_parallel=2)
    problems = checks.check(Recipe(clusters=CLUSTERS, roles=RolesConfig(trainer=t)))
    assert [k for k, _ in problems if "parallel" in k] == ["roles.trainer.pipeline_parallel"]
