"""What `model.lora.target_modules` may name, found before anything is queued.

A target that matches no module would fail only when the trainer builds its adapters, after the
job waited in the queue. So the recipe check reads the names here: from the model's own
safetensors headers when ``model.path`` is a local directory (a few KiB of JSON per shard; no
torch, no weights loaded), else from the architecture named by its config.json, else (a hub id,
an unknown architecture without local weights) not at all.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from streamrl_cli.recipe.schema import LORA_LINEAR_NAMES, ModelConfig

# vLLM's LoRAConfig.max_lora_rank takes only these values (vllm.config.lora.MaxLoRARanks): the
# adapter ranks model.lora.sync adapter can serve.
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# Architectures (config.json's model_type) whose blocks' linear layers are LORA_LINEAR_NAMES.
LLAMA_FAMILY = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral"})
# 2-D weights that are not a block's linear layers: embeddings, and the output head (tied to the
# embedding in many models, so an adapter on it would change both).
NOT_LINEAR = ("embed", "wte", "wpe", "lm_head")


def _header(path: Path) -> dict[str, dict]:
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header


def linear_modules(path: Path) -> list[str] | None:
    """Full names of the model's linear layers (2-D ``.weight`` tensors, embeddings and the output
    head left out) from its safetensors files; None when it has none."""
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        return None
    names = set()
    for shard in shards:
        for key, meta in _header(shard).items():
            module, _, leaf = key.rpartition(".")
            if leaf == "weight" and len(meta.get("shape", ())) == 2:
                if not any(word in module.rsplit(".", 1)[-1] for word in NOT_LINEAR):
                    names.add(module)
    return sorted(names)


def target_names(model: ModelConfig) -> list[str] | None:
    """The module names LoRA can target in ``model``, or None where they cannot be known here."""
    path = Path(model.path).expanduser()
    if path.is_dir():
        found = linear_modules(path)
        if found is not None:
            return found
        config = path / "config.json"
        if config.is_file():
            model_type = json.loads(config.read_text()).get("model_type")
            return list(LORA_LINEAR_NAMES) if model_type in LLAMA_FAMILY else None
    if model.builder is not None:  # built at run time: streamrl_cli.models.tiny's Qwen2
        return list(LORA_LINEAR_NAMES)
    return None


def matches(target: str, modules: list[str]) -> bool:
    """PEFT's rule for a target_modules string: a module's full name, or its last dotted parts."""
    return any(m == target or m.endswith("." + target) for m in modules)


def vllm_max_lora_rank(rank: int) -> int | None:
    """The smallest ``max_lora_rank`` vLLM accepts that holds `rank`; None when none does."""
    return next((r for r in VLLM_MAX_LORA_RANKS if r >= rank), None)
