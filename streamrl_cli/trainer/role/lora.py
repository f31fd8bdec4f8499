"""LoRA on the policy (``model.lora``): PEFT adapters train, the base weights stay frozen.

What changes with LoRA on, and why:

- the optimizer holds the adapters only (DeepSpeed gets the parameters that require grad), so
  Adam's states and ZeRO's fp32 master copy cost rank × (in + out) per adapted layer instead of
  in × out;
- the reference model is the same network with its adapters switched off
  (``disable_adapter()``): the frozen base *is* the initial policy, so no second copy is loaded;
- checkpoints hold the adapters and their optimizer state, plus ``adapter_config.json``;
- what the generators get is ``model.lora.sync``'s choice: ``merged`` (the default), the merged
  weights, base + (alpha / rank) · B·A, under the base model's parameter names
  (:func:`merged_state`), so the weight broadcast, the cross-site relay and vLLM's weight loading
  are the same as without LoRA; ``adapter``, the adapters alone under PEFT's saved names
  (:func:`adapter_state`, ``weights.adapter``), which vLLM serves as a LoRA adapter over the base
  it loaded once.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from streamrl_cli.recipe.schema import LoraConfig

PEFT_PREFIX = "base_model.model."  # PeftModel's prefix of the wrapped model's parameter names
ADAPTER = "default"  # PEFT's name of the one adapter
CONFIG_FILE = "adapter_config.json"  # PEFT's; its presence marks a LoRA checkpoint


def enabled(lora: LoraConfig | None) -> bool:
    return lora is not None and lora.rank > 0


def apply(model: nn.Module, lora: LoraConfig) -> nn.Module:
    """``model`` wrapped with LoRA adapters on ``lora.target_modules``; every other weight frozen."""
    import peft

    config = peft.LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
    )
    return peft.get_peft_model(model, config)


def is_adapter(name: str) -> bool:
    """Whether a PeftModel parameter name is an adapter's (trained), not the base model's."""
    return ".lora_" in name


def hf_name(name: str) -> str:
    """A base parameter's name in the PeftModel → its name in the plain Hugging Face model."""
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def merged_state(model: nn.Module, *, clone: bool = False) -> dict[str, torch.Tensor]:
    """The policy as one plain model: every base weight by its Hugging Face name, with
    W + (alpha / rank) · B·A for the adapted layers (new tensors: ``model`` is not changed); the
    other weights are the parameters' own data unless ``clone``. Its parameters must be whole
    (under ZeRO-3: inside ``GatheredParameters``, with ``clone``)."""
    from peft.tuners.lora import LoraLayer
    from peft.utils import transpose

    deltas: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
            a, b = module.lora_A[ADAPTER].weight, module.lora_B[ADAPTER].weight
            delta = transpose(b.detach().float() @ a.detach().float(), module.fan_in_fan_out)
            deltas[f"{name}.base_layer.weight"] = delta * module.scaling[ADAPTER]
    out = {}
    for name, p in model.named_parameters():
        if is_adapter(name):
            continue
        w = p.detach()
        out[hf_name(name)] = (w + deltas[name].to(w.dtype)) if name in deltas else (w.clone() if clone else w)
    return out


def adapter_state(model: nn.Module, *, clone: bool = False) -> dict[str, torch.Tensor]:
    """The adapters alone (``model.lora.sync: adapter``): every ``lora_A``/``lora_B`` by its name in
    PEFT's saved adapter (``weights.adapter.wire_name``), the parameters' own data unless ``clone``.
    Its parameters must be whole (under ZeRO-3: inside ``GatheredParameters``, with ``clone``)."""
    from streamrl_cli.weights.adapter import wire_name

    return {
        wire_name(name): (p.detach().clone() if clone else p.detach())
        for name, p in model.named_parameters()
        if is_adapter(name)
    }


def save_config(model: nn.Module, directory: Path) -> None:
    """The adapters' PEFT config next to a checkpoint's actor (what an adapter export needs)."""
    model.peft_config[ADAPTER].save_pretrained(str(directory))
