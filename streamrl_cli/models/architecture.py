"""What a transformers model directory says of its architecture, in the recipe's terms.

One reader of `config.json` for whoever needs a model's shapes before it is loaded: the checks
before submission (launch.presubmit) fill in the numbers the recipe leaves out and hold the ones
it gives against them, and bound prompt plus output by the model's positions.
"""

from __future__ import annotations

from typing import Any

# Any of these beside config.json is a tokenizer transformers can load.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
# recipe key -> config.json keys (first found wins)
ARCH_KEYS = {
    "num_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "num_attention_heads": ("num_attention_heads", "n_head"),
    "num_kv_heads": ("num_key_value_heads",),
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


def estimate_params(config: dict[str, Any], arch: dict[str, Any]) -> float | None:
    """Parameters of a decoder-only transformer from its shapes (attention, gated MLP, embeddings)."""
    try:
        h, layers = arch["hidden_size"], arch["num_layers"]
        heads, kv = arch["num_attention_heads"], arch["num_kv_heads"]
        vocab, inter = int(config["vocab_size"]), int(config["intermediate_size"])
    except (KeyError, TypeError, ValueError):
        return None
    head_dim = int(config.get("head_dim") or h // heads)
    attn = h * heads * head_dim * 2 + h * kv * head_dim * 2  # q, o; k, v
    mlp = 3 * h * inter  # gate, up, down
    embed = vocab * h * (1 if config.get("tie_word_embeddings") else 2)
    return float(layers * (attn + mlp) + embed)


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
