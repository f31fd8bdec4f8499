"""The trainer's networks: policy (actor), frozen reference, and PPO's critic.

All three load with ``from_pretrained(path)`` from the recipe's model directory, so the same code
serves the tiny test model on a CPU and a Qwen2.5 on GPUs. The critic is the policy's backbone
with a scalar head (``AutoModel`` + ``Linear``), as in verl/OpenRLHF; its head starts at zero so
that its first values are 0 rather than noise.

Forward passes take a :class:`~streamrl_cli.trainer.loop.batch.MicroBatch` and return per-token
tensors aligned with its ``targets`` (position j holds what predicts token j + 1). They run it
packed (:class:`Packed`): its rows in few unpadded rows, so a micro-batch costs its tokens
rather than rows × its longest row.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from streamrl_cli.trainer.algo.losses import HeadMath, SamplingTransform, chunked_logprobs, sampled_logprobs
from streamrl_cli.trainer.loop.batch import MicroBatch
from streamrl_cli.transport.wire import UNROUTED

if TYPE_CHECKING:
    from streamrl_cli.trainer.role.moe import Routers

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str, device: torch.device) -> torch.dtype:
    """The recipe's dtype, except on CPUs where only float32 is both fast and supported everywhere."""
    return torch.float32 if device.type == "cpu" else DTYPES[name]


def load_policy(path: str, dtype: torch.dtype, attention: str | None = None) -> nn.Module:
    """The causal LM at `path`; `attention`: transformers' attn_implementation (None: its default)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attention)
    model.config.use_cache = False
    return model


def load_reference(
    path: str, dtype: torch.dtype, device: torch.device, attention: str | None = None
) -> nn.Module:
    ref = load_policy(path, dtype, attention).to(device).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


class Critic(nn.Module):
    """Backbone + scalar value head; values of every position."""

    def __init__(self, path: str, dtype: torch.dtype, attention: str | None = None):
        super().__init__()
        from transformers import AutoModel

        self.backbone = AutoModel.from_pretrained(path, dtype=dtype, attn_implementation=attention)
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
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        return self.head(hidden).squeeze(-1)


def policy_forward(
    model: nn.Module,
    mb: MicroBatch,
    sampling: SamplingTransform | float,
    *,
    entropy: bool = False,
    chunk: int = 0,
    routers: Routers | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the targets under `model`, of the distribution the generators sample from
    (temperature, top-k/top-p/min-p applied; a float: a temperature alone), and optionally the entropy.
    `routers` (a MoE actor's, trainer.role.moe): told which of the forward's tokens are real.

    ``chunk`` > 0 (roles.trainer.logits_chunk): the LM head and log-softmax run that many tokens at a
    time (``losses.chunked_logprobs``), so the [tokens × vocabulary] logits never exist whole; the
    model runs its own forward (through DeepSpeed's and PEFT's wrappers) for the final hidden states
    and the logits of its last position only. Models whose head :func:`lm_head` cannot reproduce
    run unchunked."""
    if not isinstance(sampling, SamplingTransform):
        sampling = SamplingTransform.tempered(float(sampling))
    packed = Packed.of(mb)
    if packed is None:
        ids, targets, kwargs = mb.input_ids, mb.targets, {"attention_mask": mb.attention_mask}
        real, routed = mb.attention_mask, mb.routed
    else:
        # use_cache=False: with a cache (any model whose config keeps use_cache on, in eval mode)
        # transformers no longer reads the packing from the position ids and attends across sequences.
        ids, targets = packed.ids, packed.ids[:, 1:]
        kwargs = {"position_ids": packed.positions, "use_cache": False}
        real = packed.real
        routed = packed.place(mb.routed, UNROUTED) if mb.routed is not None else None
    if routers is not None:
        routers.tokens(real, routed)
    logp, ent = target_logprobs(
        model, targets, sampling, entropy=entropy, chunk=chunk, input_ids=ids, **kwargs
    )
    if packed is None:
        return logp, ent
    return packed.unpack(logp), (packed.unpack(ent) if ent is not None else None)


def target_logprobs(
    model: nn.Module,
    targets: torch.Tensor,
    sampling: SamplingTransform,
    *,
    entropy: bool,
    chunk: int,
    **inputs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`model` run on `inputs`; the log-probs (and entropy) of `targets` [R, T] at its first T positions
    (position j predicting targets[:, j]). ``chunk`` > 0: the LM head a chunk at a time where
    :func:`lm_head` can reproduce it (the model's own forward gives the final hidden states and the
    logits of its last position only); else the model's whole logits."""
    width = targets.shape[1]
    head = lm_head(model) if chunk > 0 else None
    if head is None:
        logits = model(**inputs).logits[:, :width].float()
        return sampled_logprobs(logits, targets, sampling, entropy=entropy)
    out = model(**inputs, output_hidden_states=True, logits_to_keep=1)
    hidden = out.hidden_states[-1][:, :width]
    del out  # the other layers' states: only what backward keeps anyway
    return head.logprobs(hidden, targets, sampling, entropy=entropy, chunk=chunk)


# model_type → what its causal LM does to the LM head's output (``HeadMath``): the architectures
# whose forward is backbone → lm_head → these, and which take ``logits_to_keep``.
HEADS: dict[str, Callable[[Any], HeadMath]] = {
    **dict.fromkeys(
        ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "phi3", "olmo2"),
        lambda _c: HeadMath(),
    ),
    **dict.fromkeys(
        ("gemma2", "gemma3_text"), lambda c: HeadMath(softcap=float(c.final_logit_softcapping or 0.0))
    ),
    "cohere": lambda c: HeadMath(scale=float(c.logit_scale)),
}


@dataclass(frozen=True)
class Head:
    """A causal LM's head as the chunked log-probs run it: its module (a Linear, or PEFT's LoRA layer
    around one), what follows it (``HeadMath``), and whether the closed-form path can use its weight
    directly (a plain Linear whose weight is whole on this rank)."""

    module: nn.Module
    math: HeadMath
    direct: bool

    def logprobs(
        self,
        hidden: torch.Tensor,
        targets: torch.Tensor,
        sampling: SamplingTransform,
        *,
        entropy: bool,
        chunk: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (and entropy) of `targets` [B, T] from the final hidden states [B, T, H], a chunk of
        tokens at a time. A direct head: ``losses.chunked_logprobs`` (closed-form backward). Otherwise
        (ZeRO-3 partitions the weight, LoRA wraps the head): each chunk through the head module under
        activation checkpointing, so DeepSpeed gathers the weight (forward, and the recomputation in
        backward) and reduces its gradient as for any layer; a chunk's logits are held at a time."""
        if self.direct:
            linear = self.module
            return chunked_logprobs(
                hidden,
                targets,
                linear.weight,
                linear.bias,
                sampling,
                entropy=entropy,
                chunk=chunk,
                head=self.math,
            )
        from torch.utils.checkpoint import checkpoint

        flat, tokens = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
        logps, ents = [], []
        for a in range(0, flat.shape[0], chunk):
            lp, en = checkpoint(self._piece, flat[a : a + chunk], tokens[a : a + chunk], sampling, entropy,
                                use_reentrant=False)  # fmt: skip
            logps.append(lp)
            if entropy:
                ents.append(en)
        return torch.cat(logps).reshape(targets.shape), (
            torch.cat(ents).reshape(targets.shape) if entropy else None
        )

    def _piece(
        self, h: torch.Tensor, t: torch.Tensor, sampling: SamplingTransform, entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        lp, en = sampled_logprobs(self.math.post(self.module(h))[None], t[None], sampling, entropy=entropy)
        return lp[0], (en[0] if en is not None else None)


def lm_head(model: nn.Module) -> Head | None:
    """The LM head of `model` (a DeepSpeed engine, a PEFT model or a transformers causal LM) and what
    follows it, where the chunked log-probs can compute the logits themselves; None where they cannot:
    an architecture not in `HEADS` (its forward may do more after the head), or one whose forward
    cannot keep its logits to the last position."""
    base = model
    ds = sys.modules.get("deepspeed")
    if ds is not None and isinstance(base, ds.DeepSpeedEngine):
        base = base.module
    if hasattr(base, "get_base_model"):  # peft.PeftModel
        base = base.get_base_model()
    config = getattr(base, "config", None)
    make = HEADS.get(getattr(config, "model_type", ""))
    get = getattr(base, "get_output_embeddings", None)
    module = get() if make is not None and get is not None else None
    if module is None or "logits_to_keep" not in inspect.signature(base.forward).parameters:
        return None
    partitioned = any(hasattr(p, "ds_id") for p in module.parameters())
    if partitioned and not all(p.requires_grad for p in module.parameters()):
        # ZeRO-3 gathers a frozen head weight (LoRA's base) for the forward but not for checkpointing's
        # recomputation in backward: such a head's logits are computed whole.
        return None
    direct = type(module) is nn.Linear and not partitioned
    return Head(module, make(config), direct)


# A packed row holds at most this many tokens (or the longest sequence, if longer). With sdpa or
# eager attention a row's causal mask and attention cost its length squared: one row for a whole
# micro-batch of long sequences would cost more than padding it.
PACK_TOKENS = 4096


class Packed:
    """A micro-batch's sequences packed into few unpadded rows: a forward costs its tokens, not
    rows × the longest row.

    Sequences go, longest first, into the first row with room (`PACK_TOKENS`, or the longest
    sequence if longer); each restarts its position ids at 0, and no attention mask is passed:
    transformers then attends within each sequence only (it reads the packing from the position
    ids). Per-token results come back in the micro-batch's padded layout (``targets``-aligned, 0
    at padding and at each sequence's last position), so the losses are the same code either way.
    """

    def __init__(self, mb: MicroBatch):
        keep = mb.attention_mask.bool()
        lengths = keep.sum(1).tolist()
        cap = max(max(lengths), PACK_TOKENS)
        rows: list[list[int]] = []  # the micro-batch's rows in each packed row
        used: list[int] = []
        for b in sorted(range(len(lengths)), key=lambda b: -lengths[b]):
            r = next((r for r, u in enumerate(used) if u + lengths[b] <= cap), len(rows))
            if r == len(rows):
                rows.append([])
                used.append(0)
            rows[r].append(b)
            used[r] += lengths[b]
        width = max(used)
        device = mb.input_ids.device
        ids = torch.zeros(len(rows), width, dtype=torch.long, device=device)
        positions = torch.zeros_like(ids)
        real = torch.zeros_like(ids, dtype=torch.bool)  # a sequence's token, not a row's tail
        start = [0] * len(lengths)  # where each micro-batch row begins, flattened
        for r, members in enumerate(rows):
            at = 0
            for b in members:
                n = lengths[b]
                ids[r, at : at + n] = mb.input_ids[b][keep[b]]
                positions[r, at : at + n] = torch.arange(n, device=device)
                real[r, at : at + n] = True
                start[b] = r * width + at
                at += n
            positions[r, at:] = torch.arange(width - at, device=device)  # the tail: a sequence of its own
        self.ids, self.positions, self.real = ids, positions, real
        offset = torch.arange(keep.shape[1], device=device)
        base = torch.tensor(start, device=device)[:, None]
        self.tokens = (keep, base + offset)  # [B, L]: each token's place in the packed rows
        # Targets: position j predicts j + 1, so a sequence's last token predicts nothing of it.
        self.targets = (keep[:, 1:], (base + offset[:-1]) - torch.div(base, width, rounding_mode="floor"))

    @classmethod
    def of(cls, mb: MicroBatch) -> Packed | None:
        """None where packing saves nothing (one row, no padding, or rows that fill the packed rows
        no better than the padding did), or for rows not right-padded."""
        keep = mb.attention_mask.bool()
        if keep.shape[0] < 2 or bool(keep.all()) or bool((keep[:, 1:] > keep[:, :-1]).any()):
            return None
        packed = cls(mb)
        return packed if packed.ids.numel() < keep.numel() else None

    def place(self, x: torch.Tensor, fill: int) -> torch.Tensor:
        """[B, L, ...] per micro-batch token → [R, W, ...] in the packed rows (`fill` in the rows' tails)."""
        keep, index = self.tokens
        out = torch.full((self.ids.numel(), *x.shape[2:]), fill, dtype=x.dtype, device=x.device)
        out[index[keep]] = x[keep]
        return out.view(*self.ids.shape, *x.shape[2:])

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """[R, W - 1] per packed target → [B, L - 1] aligned with the micro-batch's targets."""
        return self._gather(x, *self.targets)

    def spread(self, x: torch.Tensor) -> torch.Tensor:
        """[R, W] per packed token → [B, L] in the micro-batch's layout (0 at padding)."""
        return self._gather(x, *self.tokens)

    @staticmethod
    def _gather(x: torch.Tensor, valid: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1)
        picked = flat[torch.where(valid, index, torch.zeros_like(index))]
        return torch.where(valid, picked, torch.zeros((), dtype=x.dtype, device=x.device))


def checkpoint_activations(model: nn.Module) -> None:
    """Gradient checkpointing on a transformers model (non-reentrant: the inputs of a checkpointed
    block need not require grad, so frozen embeddings under LoRA are fine, and ZeRO's hooks see one
    backward). It acts in train mode only, as transformers' layers check."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def critic_forward(critic: Any, mb: MicroBatch) -> torch.Tensor:
    """Values aligned with targets: the value of the state before each response token."""
    packed = Packed.of(mb)
    if packed is None:
        return critic(mb.input_ids, mb.attention_mask)[:, :-1].float()
    return packed.spread(critic(packed.ids, None, packed.positions))[:, :-1].float()
