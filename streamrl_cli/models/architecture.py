"""What a transformers model directory says of its architecture, in the recipe's terms.

One reader of `config.json` for whoever needs a model's shapes before it is loaded: the checks
before submission (launch.presubmit) fill in the numbers the recipe leaves out and hold the ones
it gives against them, and bound prompt plus output by the model's positions.
"""

from __future__ import annotations

from typing import Any

from streamrl_cli.recipe.checks import EXPERT_KEYS

# Any of these beside config.json is a tokenizer transformers can load.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
# recipe key -> config.json keys (first found wins)
ARCH_KEYS = {
    "num_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "num_attention_heads": ("num_attention_heads", "n_head"),
    "num_kv_heads": ("num_key_value_heads",),
}
# config.json keys of a mixture of experts (first found wins): Qwen2/3-MoE, Mixtral, DeepSeek. The
# planner reads the same keys (planner.workload.MOE_KEYS: it imports nothing of models).
MOE_KEYS = {
    "experts": EXPERT_KEYS,
    "experts_per_token": ("num_experts_per_tok", "moe_topk"),
    "expert_intermediate": ("moe_intermediate_size",),
}


def architecture(config: dict[str, Any]) -> dict[str, Any]:
    """The recipe's architecture numbers of a transformers config.json (what it states)."""
    config = config.get("text_config", config) if "num_hidden_layers" not in config else config
    out: dict[str, Any] = {}
    for key, names in ARCH_KEYS.items():
        for n in names:
            if isinstance(config.get(n), int):
                out[key] = config[n]
                break
    if "num_kv_heads" not in out and "num_attention_heads" in out:
        out["num_kv_heads"] = out["num_attention_heads"]
    params = estimate_params(config, out)
    if params is not None:
        out["params_b"] = float(f"{params / 1e9:.3g}")
    return out


def _count(config: dict[str, Any], *names: str) -> int:
    for n in names:
        v = config.get(n)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return 0


def moe(config: dict[str, Any]) -> dict[str, int]:
    """A mixture of experts' shape from its config.json ({} for a dense model): routed experts per
    MoE layer, experts per token, one expert's width, the shared experts' total width (Qwen2-MoE's
    shared_expert_intermediate_size, or DeepSeek's n_shared_experts × moe_intermediate_size) and the
    layers with a dense MLP instead (DeepSeek's first_k_dense_replace; Qwen's mlp_only_layers and
    the layers decoder_sparse_step skips)."""
    config = config.get("text_config", config) if "num_hidden_layers" not in config else config
    shape = {key: _count(config, *names) for key, names in MOE_KEYS.items()}
    if not all(shape.values()):
        return {}
    layers = _count(config, "num_hidden_layers")
    only = config.get("mlp_only_layers") or []
    step = _count(config, "decoder_sparse_step") or 1
    dense = _count(config, "first_k_dense_replace") or sum(
        1 for i in range(layers) if i in only or (i + 1) % step != 0
    )
    shared = _count(config, "shared_expert_intermediate_size") or (
        _count(config, "n_shared_experts") * shape["expert_intermediate"]
    )
    return {**shape, "shared_intermediate": shared, "dense_layers": dense}


def estimate_params(config: dict[str, Any], arch: dict[str, Any], active: bool = False) -> float | None:
    """Parameters of a decoder-only transformer from its shapes (attention, gated MLP or mixture of
    experts, embeddings). A mixture of experts counts every routed expert (E per MoE layer), its
    router and shared experts, and its dense layers' MLPs; ``active``: only the k routed experts one
    token goes through (what its compute costs: Qwen3-30B-A3B's 3.3B of 30.5B)."""
    try:
        h, layers = arch["hidden_size"], arch["num_layers"]
        heads, kv = arch["num_attention_heads"], arch["num_kv_heads"]
        vocab, inter = int(config["vocab_size"]), int(config.get("intermediate_size") or 0)
    except (KeyError, TypeError, ValueError):
        return None
    experts = moe(config)
    if not inter and not (experts and not experts["dense_layers"]):
        return None  # no MLP width to count
    head_dim = int(config.get("head_dim") or h // heads)
    attn = h * heads * head_dim * 2 + h * kv * head_dim * 2  # q, o; k, v
    mlp = 3 * h * inter  # gate, up, down
    embed = vocab * h * (1 if config.get("tie_word_embeddings") else 2)
    if not experts:
        return float(layers * (attn + mlp) + embed)
    routed = experts["experts_per_token"] if active else experts["experts"]
    moe_mlp = h * experts["experts"] + 3 * h * (routed * experts["expert_intermediate"])
    moe_mlp += 3 * h * experts["shared_intermediate"]
    dense = experts["dense_layers"]
    return float(layers * attn + dense * mlp + (layers - dense) * moe_mlp + embed)


def active_params(config: dict[str, Any]) -> float | None:
    """Parameters one token goes through (a dense model's all): None where the shapes are unknown."""
    arch = architecture(config)
    if "hidden_size" not in arch or "num_layers" not in arch:
        return None
    config = config.get("text_config", config) if "num_hidden_layers" not in config else config
    return estimate_params(config, arch, active=True)


def context_length(config: dict[str, Any]) -> int | None:
    """The positions a transformers config.json says the model holds: max_position_embeddings, or what
    its rope scaling stretches that to (YaRN and its kin: factor × original_max_position_embeddings)."""
    config = config.get("text_config", config) if "max_position_embeddings" not in config else config
    n = config.get("max_position_embeddings")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        return None
    rope = config.get("rope_scaling")
    if isinstance(rope, dict) and isinstance(rope.get("factor"), int | float) and rope["factor"] > 1:
        original = rope.get("original_max_position_embeddings")
        base = original if isinstance(original, int) and original > 0 else n
        n = max(n, int(base * rope["factor"]))
    return n
