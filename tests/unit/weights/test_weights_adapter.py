"""An adapter weight version (model.lora.sync: adapter): PEFT's saved names, and the directory vLLM
loads, exactly what PEFT itself writes and reads back."""

from __future__ import annotations

import json

import pytest
import torch

from streamrl_cli.recipe.schema import LoraConfig
from streamrl_cli.weights.adapter import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    lora_slots,
    peft_config,
    vllm_max_lora_rank,
    wire_name,
    write_adapter,
)


def test_names_drop_the_adapters_name_as_peft_saves_them():
    inside = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    assert wire_name(inside) == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert wire_name(inside.replace("lora_A", "lora_B")).endswith("q_proj.lora_B.weight")


def test_vllm_limits():
    ranks = (1, 2, 8, 9, 320, 321, 512, 513)
    assert [vllm_max_lora_rank(r) for r in ranks] == [1, 8, 8, 16, 320, 512, 512, None]
    assert lora_slots(0) == 2 and lora_slots(1) == 3  # the staleness' versions in flight + the new one


def test_the_directory_is_what_peft_writes_and_reads(tmp_path):
    peft = pytest.importorskip("peft")
    from peft.utils import get_peft_model_state_dict
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, vocab_size=64)  # fmt: skip
    lora = LoraConfig(rank=2, alpha=4.0, target_modules=["q_proj", "down_proj"])
    torch.manual_seed(0)
    model = peft.get_peft_model(
        LlamaForCausalLM(cfg),
        peft.LoraConfig(r=2, lora_alpha=4.0, target_modules=["q_proj", "down_proj"], bias="none"),
    )
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_" in n:
                p.normal_()
    tensors = {wire_name(n): p.detach() for n, p in model.named_parameters() if ".lora_" in n}
    assert set(tensors) == set(get_peft_model_state_dict(model))  # PEFT's own saved names
    size = write_adapter(tmp_path / "v3", tensors, peft_config(lora))
    assert size == sum(t.numel() * 4 for t in tensors.values())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v3"]  # nothing half-written beside it
    config = json.loads((tmp_path / "v3" / CONFIG_FILE).read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (2, 4.0, ["q_proj", "down_proj"])
    # PEFT loads it back into a fresh model: the same adapters
    fresh = peft.PeftModel.from_pretrained(LlamaForCausalLM(cfg), str(tmp_path / "v3"))
    loaded = get_peft_model_state_dict(fresh)
    assert all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    assert (tmp_path / "v3" / WEIGHTS_FILE).is_file()
