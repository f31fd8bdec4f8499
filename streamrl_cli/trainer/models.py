"""The trainer's networks: policy (actor), frozen reference, and PPO's critic.

All three load with ``from_pretrained(path)`` from the recipe's model directory, so the same code
serves the tiny test model on a CPU and a Qwen2.5 on GPUs. The critic is the policy's backbone
with a scalar head (``AutoModel`` + ``Linear``), as in verl/OpenRLHF; its head starts at zero so
that its first values are 0 rather than noise.

Forward passes take a :class:`~streamrl_cli.trainer.batch.MicroBatch` and return per-token
tensors aligned with its ``targets`` (position j holds what predicts token j + 1). They run it
packed (:class:`Packed`): its rows as one unpadded sequence, so a micro-batch costs its tokens
rather than rows × its longest row.
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

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Values [B, L]; packed rows (:class:`Packed`) pass position ids and no attention mask."""
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
        ).last_hidden_state
        return self.head(hidden).squeeze(-1)


def policy_forward(
    model: nn.Module, mb: MicroBatch, sampling: SamplingTransform | float, *, entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the targets under `model`, of the distribution the generators sample from
    (temperature, top-k/top-p/min-p applied; a float: a temperature alone), and optionally the entropy."""
    if not isinstance(sampling, SamplingTransform):
        sampling = SamplingTransform(temperature=float(sampling))
    packed = Packed.of(mb)
    if packed is None:
        out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask)
        return sampled_logprobs(out.logits[:, :-1].float(), mb.targets, sampling, entropy=entropy)
    logits = model(input_ids=packed.ids, position_ids=packed.positions).logits[:, :-1].float()
    logp, ent = sampled_logprobs(logits, packed.ids[:, 1:], sampling, entropy=entropy)
    return packed.unpack(logp), (packed.unpack(ent) if ent is not None else None)


class Packed:
    """A micro-batch's rows as one unpadded row: forward passes cost its tokens, not rows × longest.

    The rows are concatenated and each restarts its position ids at 0, with no attention mask:
    transformers then attends within each sequence only (it reads the packing from the position
    ids). Per-token results come back in the micro-batch's padded layout (``targets``-aligned,
    0 at padding and at each row's last position), so the losses are the same code either way.
    """

    def __init__(self, mb: MicroBatch):
        self.keep = mb.attention_mask.bool()
        self.ids = mb.input_ids[self.keep].unsqueeze(0)
        self.positions = (mb.attention_mask.cumsum(1) - 1)[self.keep].unsqueeze(0)
        # Packed position k predicts k + 1; where k + 1 starts the next row, k is nothing of this one.
        self.within = self.positions[0, 1:] != 0

    @classmethod
    def of(cls, mb: MicroBatch) -> Packed | None:
        """None where packing saves nothing (one row, or no padding)."""
        if mb.input_ids.shape[0] < 2 or bool(mb.attention_mask.all()):
            return None
        return cls(mb)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """[1, T - 1] per packed target → [B, L - 1] aligned with the micro-batch's targets."""
        x = torch.where(self.within, x[0], torch.zeros((), dtype=x.dtype, device=x.device))
        return self.spread(torch.cat([x, x.new_zeros(1)]).unsqueeze(0))[:, :-1]  # the last predicts nothing

    def spread(self, x: torch.Tensor) -> torch.Tensor:
        """[1, T] per packed token → [B, L] in the micro-batch's layout (0 at padding)."""
        return x.new_zeros(self.keep.shape).masked_scatter(self.keep, x[0])


def critic_forward(critic: Any, mb: MicroBatch) -> torch.Tensor:
    """Values aligned with targets: the value of the state before each response token."""
    packed = Packed.of(mb)
    if packed is None:
        return critic(mb.input_ids, mb.attention_mask)[:, :-1].float()
    return packed.spread(critic(packed.ids, None, packed.positions))[:, :-1].float()
