"""Mixture-of-experts models in the trainer: their routers' auxiliary load-balancing loss and load.

transformers' MoE blocks (Qwen3-MoE, Qwen2-MoE, Mixtral, ...) route each token with a router module
(``*TopKRouter``) that returns ``(router_logits, top-k weights, top-k experts)``. :class:`Routers`
hooks every one of them in the actor: during a forward it keeps each layer's router logits and
chosen experts for the tokens that are real (not a packed row's tail or padding, as
:meth:`Routers.tokens` says before the forward), from which it computes

* the auxiliary load-balancing loss of Switch Transformer / GShard, per layer
  ``E · Σ_e f_e · P_e`` (``f_e``: the share of the layer's top-k choices that went to expert e;
  ``P_e``: the mean router probability of e), averaged over layers. It is 1 when the load is even
  and the router's probabilities are too, and up to E when every token goes to one expert. The
  trainer adds ``algorithm.router_aux_loss_coef`` × it to the loss; its gradient reaches the router
  through ``P_e``.
* each layer's load imbalance, ``E · max_e f_e`` (1: even; E / k: every token's k choices on the
  same k experts), logged per layer as ``moe/imbalance/layer<i>``.

Hooks work the same through DeepSpeed's and PEFT's wrappers, activation checkpointing (a
recomputed forward is not counted twice: only the first call per layer between two
:meth:`Routers.tokens` is kept) and sequence parallelism (each rank sees its share of the tokens).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def routers(model: nn.Module) -> list[nn.Module]:
    """The top-k router modules of `model`'s MoE blocks, in layer order (empty: a dense model)."""
    return [
        m
        for m in model.modules()
        if type(m).__name__.endswith("TopKRouter") and hasattr(m, "top_k") and hasattr(m, "num_experts")
    ]


class Routers:
    """The actor's routers, hooked: each forward's router logits and choices of the real tokens."""

    def __init__(self, model: nn.Module):
        self.modules = routers(model)
        self.experts = int(self.modules[0].num_experts) if self.modules else 0
        self.top_k = int(self.modules[0].top_k) if self.modules else 0
        self._mask: torch.Tensor | None = None
        self._seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._handles = [m.register_forward_hook(self._hook(i)) for i, m in enumerate(self.modules)]

    def __bool__(self) -> bool:
        return bool(self.modules)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def tokens(self, mask: torch.Tensor | None) -> None:
        """Before a forward: which of its input tokens are real ([rows, width], 1 real), or None: all.
        Forgets what the previous forward kept."""
        self._mask = mask.reshape(-1).bool() if mask is not None else None
        self._seen = {}

    def _hook(self, layer: int) -> Any:
        def hook(_module: nn.Module, _inputs: Any, output: Any) -> None:
            if layer in self._seen or not torch.is_grad_enabled():
                return  # activation checkpointing's recomputation, or a no-grad forward (reference)
            logits, _weights, chosen = output[0], output[1], output[2]
            if self._mask is not None and self._mask.numel() == logits.shape[0]:
                logits, chosen = logits[self._mask], chosen[self._mask]
            self._seen[layer] = (logits, chosen)

        return hook

    def aux_loss(self) -> torch.Tensor | None:
        """The load-balancing loss of the last forward, averaged over layers (None: nothing routed)."""
        losses = []
        for logits, chosen in self._seen.values():
            if logits.shape[0] == 0:
                continue
            probs = torch.softmax(logits.float(), dim=-1).mean(0)  # P_e
            share = self._share(chosen)  # f_e
            losses.append(self.experts * (share * probs).sum())
        return torch.stack(losses).mean() if losses else None

    def _share(self, chosen: torch.Tensor) -> torch.Tensor:
        counts = torch.bincount(chosen.reshape(-1), minlength=self.experts).float()
        return counts / counts.sum().clamp(min=1.0)

    def imbalance(self) -> dict[int, float]:
        """Each layer's E · max_e f_e in the last forward (1.0: every expert took the same share)."""
        return {
            layer: float(self.experts * self._share(chosen).max())
            for layer, (_logits, chosen) in sorted(self._seen.items())
            if chosen.numel()
        }
