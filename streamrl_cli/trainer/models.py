"""The trainer's networks: policy (actor), frozen reference, and PPO's critic.

All three load with ``from_pretrained(path)`` from the recipe's model directory, so the same code
serves the tiny test model on a CPU and a Qwen2.5 on GPUs. The critic is the policy's backbone
with a scalar head (``AutoModel`` + ``Linear``), as in verl/OpenRLHF; its head starts at zero so
that its first values are 0 rather than noise.

Forward passes take a :class:`~streamrl_cli.trainer.batch.MicroBatch` and return per-token
tensors aligned with its ``targets`` (position j holds what predicts token j + 1).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from streamrl_cli.trainer.batch import MicroBatch
from streamrl_cli.trainer.losses import SamplingTransform, sampled_logprobs

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str, device: torch.device) -> torch.dtype:
    """The recipe's dtype, except on CPUs where only float32 is both fast and supported everywhere."""
    return torch.float32 if device.type == "cpu" else DTYPES[name]


def load_policy(path: str, dtype: torch.dtype) -> nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.config.use_cache = False
    return model


def load_reference(path: str, dtype: torch.dtype, device: torch.device) -> nn.Module:
    ref = load_policy(path, dtype).to(device).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


class Critic(nn.Module):
    """Backbone + scalar value head; values of every position."""

    def __init__(self, path: str, dtype: torch.dtype):
        super().__init__()
        from transformers import AutoModel

        self.backbone = AutoModel.from_pretrained(path, dtype=dtype)
        self.backbone.config.use_cache = False
        self.head = nn.Linear(self.backbone.config.hidden_size, 1, dtype=dtype)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.head(hidden).squeeze(-1)


def policy_forward(
    model: nn.Module, mb: MicroBatch, sampling: SamplingTransform | float, *, entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the targets under `model`, of the distribution the generators sample from
    (temperature, top-k/top-p/min-p applied; a float: a temperature alone), and optionally the entropy."""
    if not isinstance(sampling, SamplingTransform):
        sampling = SamplingTransform(temperature=float(sampling))
    out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask)
    logits = out.logits[:, :-1].float()
    return sampled_logprobs(logits, mb.targets, sampling, entropy=entropy)


def critic_forward(critic: Any, mb: MicroBatch) -> torch.Tensor:
    """Values aligned with targets: the value of the state before each response token."""
    return critic(mb.input_ids, mb.attention_mask)[:, :-1].float()
