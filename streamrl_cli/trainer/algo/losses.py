"""The RL loss math that is not a choice between algorithms: pure torch functions, no I/O, no state.

GAE and the per-token rewards, the value loss, the loss aggregation, log-probs and entropy under
the generators' sampling distribution. What a recipe chooses by name (advantage estimators, policy
losses, off-policy corrections, KL estimators) is in the registries of ``trainer.algo``.

Why one module: every pipelining mode of the trainer (synchronous, one-step-off, fully streamed
micro-batches) computes the same advantages, ratios, clipped surrogates and reductions; keeping
the math here, away from DeepSpeed and the stream, makes it testable against hand-computed
numbers and guarantees the modes differ only in *when* they compute, never in *what*.

Conventions:

- Per-token tensors have shape ``[B, T]`` (sequences × response positions) and come with a
  float ``mask`` of the same shape, 1.0 on valid response tokens and 0.0 elsewhere (padding,
  prompt, tokens the policy did not produce). Every per-token output is 0 where the mask is 0.
- Per-token losses are returned *unreduced*; :func:`aggregate` turns them into a
  ``(numerator, units)`` pair so that the loss of a batch split into micro-batches is exactly
  ``Σ numerators / Σ units`` — the same number as the whole batch in one piece.
- Statistics (``algo.policy_losses``) are *sums* over valid tokens plus a ``"tokens"`` count, for
  the same reason: the caller adds them across micro-batches and divides once at the end.
- Advantages, returns, importance weights and statistics carry no gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _last_valid_index(mask: Tensor) -> tuple[Tensor, Tensor]:
    """(index of each row's last valid token, whether the row has any), for a [B, T] mask."""
    valid = mask > 0
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    last = torch.where(valid, positions, torch.full_like(positions, -1)).max(dim=-1).values
    has_any = last >= 0
    return last.clamp(min=0), has_any


def token_rewards(score: Tensor, kl: Tensor | None, kl_coef: float, mask: Tensor) -> Tensor:
    """PPO per-token reward [B, T]: -kl_coef * kl on valid tokens, plus score [B] at each last valid token."""
    rewards = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    if kl is not None:
        rewards = rewards - kl_coef * kl.detach().float()
    last, has_any = _last_valid_index(mask)
    bonus = torch.where(has_any, score.detach().float(), torch.zeros_like(score, dtype=torch.float32))
    rewards = rewards.scatter_add(1, last.unsqueeze(1), bonus.unsqueeze(1))
    return rewards * (mask > 0)


def gae(
    token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over [B, T], backward in time: (advantages, returns)."""
    # Masked positions are skipped, not treated as steps: the value and the running GAE carry over
    # them unchanged, so right padding (V after the last valid token = 0) and holes inside a
    # response (e.g. tool output) are both handled by one rule. A mask is read as valid where > 0.
    rewards = token_rewards.detach().float()
    vals = values.detach().float()
    valid = (mask > 0).float()
    batch, length = rewards.shape
    next_value = torch.zeros(batch, dtype=torch.float32, device=rewards.device)
    running = torch.zeros_like(next_value)
    advantages = torch.zeros_like(rewards)
    for t in reversed(range(length)):
        m = valid[:, t]
        delta = rewards[:, t] + gamma * next_value - vals[:, t]
        step = delta + gamma * lam * running
        running = m * step + (1.0 - m) * running
        next_value = m * vals[:, t] + (1.0 - m) * next_value
        advantages[:, t] = running * m
    returns = (advantages + vals) * valid
    return advantages, returns


def rollout_mismatch(logp: Tensor, behaviour_logp: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Sums over the response tokens of how the trainer's log-probs differ from the generators'
    for the same tokens: |Δ log p| and the k3 estimate of KL(behaviour ‖ trainer), which is
    exp(Δ) − 1 − Δ with Δ = log p_trainer − log p_behaviour (never negative; the tokens were
    sampled from the behaviour policy). Divide by the token count for per-token means."""
    with torch.no_grad():
        delta = (logp.detach() - behaviour_logp) * mask
        return {
            "logp_abs_diff": delta.abs().sum(),
            "kl": ((torch.expm1(delta) - delta) * mask).sum(),
        }


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float) -> Tensor:
    """Per-token value loss 0.5 * max((v - R)^2, (clip(v, old ± clip) - R)^2); clip <= 0: unclipped."""
    returns = returns.detach()
    loss = (values - returns).square()
    if clip > 0:
        old = old_values.detach()
        clipped = torch.maximum(torch.minimum(values, old + clip), old - clip)
        loss = torch.maximum(loss, (clipped - returns).square())
    return 0.5 * loss * mask


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) [B, T, V] → [B, T]: logsumexp(l) - Σ p·l, stable for large logits."""
    lse = torch.logsumexp(logits, dim=-1)
    probs = torch.softmax(logits, dim=-1)
    return lse - (probs * logits).sum(dim=-1)


def token_logprobs(logits: Tensor, tokens: Tensor, temperature: float) -> Tensor:
    """log softmax(logits / temperature) at tokens: [B, T, V], [B, T] → [B, T], no [B, T, V] log-softmax."""
    scaled = logits if temperature == 1.0 else logits / temperature
    picked = scaled.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(scaled, dim=-1)


@dataclass(frozen=True, kw_only=True)
class SamplingTransform:
    """The distribution the generators sample from, as a function of the logits (the recipe's
    algorithm.temperature, min_p, top_k, top_p). The trainer's log-probs must be of this same
    distribution, or the importance ratio against the behaviour log-probs is off. No value has a
    default here: each is the recipe's (the schema holds the defaults)."""

    temperature: float
    top_k: int  # 0: off
    top_p: float  # 1: off
    min_p: float  # 0: off

    @classmethod
    def tempered(cls, temperature: float) -> SamplingTransform:
        """The distribution of a temperature alone: no truncation."""
        return cls(temperature=temperature, top_k=0, top_p=1.0, min_p=0.0)

    @property
    def truncates(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


# Rows of [*, V] logits truncated at once: top-p sorts the vocabulary, a [rows, V] copy at a time.
TRUNCATE_ROWS = 1024


def sampled_logprobs(
    logits: Tensor, tokens: Tensor, s: SamplingTransform, *, entropy: bool = False
) -> tuple[Tensor, Tensor | None]:
    """Log-probs of ``tokens`` [B, T] under the sampling distribution of ``logits`` [B, T, V], and
    optionally its entropy [B, T].

    Without truncation: log softmax(logits / T). With it, vLLM's processing in vLLM's order
    (temperature, then min_p on the tempered probabilities, then top-k, then top-p over what top-k
    kept) and a log-softmax over the tokens kept. One difference, on purpose: the target token is
    never dropped. On the weights that sampled it, it is in the kept set anyway (so the log-prob is
    vLLM's); on later weights (async mode, the reference model) dropping it would give -inf and an
    infinite ratio or KL, where keeping it gives the nearest finite value.
    """
    if not s.truncates:
        scaled = logits if s.temperature == 1.0 else logits / s.temperature
        return token_logprobs(logits, tokens, s.temperature), (
            entropy_from_logits(scaled) if entropy else None
        )
    shape = tokens.shape
    flat, targets = logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1).long()
    logps, ents = [], []
    for a in range(0, flat.shape[0], TRUNCATE_ROWS):
        scaled = flat[a : a + TRUNCATE_ROWS] / s.temperature
        tgt = targets[a : a + TRUNCATE_ROWS]
        with torch.no_grad():
            removed = _removed(scaled.detach(), s)
            removed.scatter_(-1, tgt.unsqueeze(-1), False)
        kept = scaled.masked_fill(removed, float("-inf"))
        lse = torch.logsumexp(kept, dim=-1)
        logps.append(kept.gather(-1, tgt.unsqueeze(-1)).squeeze(-1) - lse)
        if entropy:
            probs = torch.softmax(kept, dim=-1)  # 0 where removed: those terms are 0, not 0 × -inf
            ents.append(lse - (probs * scaled.masked_fill(removed, 0.0)).sum(dim=-1))
    logp = torch.cat(logps).reshape(shape)
    return logp, (torch.cat(ents).reshape(shape) if entropy else None)


def _removed(scaled: Tensor, s: SamplingTransform) -> Tensor:
    """Which tokens vLLM's sampler drops from tempered logits [N, V] (True: dropped)."""
    removed = torch.zeros_like(scaled, dtype=torch.bool)
    if s.min_p > 0.0:
        probs = torch.softmax(scaled, dim=-1)
        removed |= probs < probs.amax(dim=-1, keepdim=True) * s.min_p
    if s.top_k > 0 and s.top_k < scaled.shape[-1]:
        kth = scaled.topk(s.top_k, dim=-1).values[..., -1:]
        removed |= scaled < kth  # ties with the k-th are kept, as vLLM keeps them
    if s.top_p < 1.0:
        masked = scaled.masked_fill(removed, float("-inf"))
        # Stable: equal logits go in vocabulary order, so where top-p cuts between them does not
        # depend on how many rows are sorted at once (chunked log-probs equal unchunked ones).
        order_vals, order = masked.sort(dim=-1, descending=False, stable=True)
        cum = order_vals.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cum <= 1.0 - s.top_p
        drop_sorted[..., -1] = False  # the most likely token always stays
        removed |= torch.zeros_like(removed).scatter(-1, order, drop_sorted)
    return removed


def aggregate(per_token: Tensor, mask: Tensor, mode: str, max_len: int) -> tuple[Tensor, float]:
    """(numerator, units) of a per-token loss: a batch's loss is Σ numerators / Σ units over micro-batches."""
    masked = per_token * mask
    if mode == "token-mean":
        return masked.sum(), float(mask.sum().item())
    if mode == "seq-mean-token-mean":
        per_seq = masked.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)
        return per_seq.sum(), float(per_token.shape[0])
    if mode == "seq-mean-token-sum-norm":
        return masked.sum() / max_len, float(per_token.shape[0])
    raise ValueError(f"unknown loss aggregation {mode!r}; valid: {', '.join(LOSS_AGGS)}")


@dataclass(frozen=True)
class HeadMath:
    """What a causal LM does to its LM head's output before the logits: Cohere's ``logit_scale`` (a
    multiplier, 1: none) and Gemma 2/3's ``final_logit_softcapping`` (tanh(l / c) · c, 0: none)."""

    scale: float = 1.0
    softcap: float = 0.0

    def logits(self, hidden: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """fp32 logits [N, V] of hidden states [N, H], in the model's own order and dtype until the cast."""
        return self.post(torch.nn.functional.linear(hidden, weight, bias))

    def post(self, logits: Tensor) -> Tensor:
        """The LM head's output [N, V] → the fp32 logits."""
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.float()

    def grad_(self, grad: Tensor, logits: Tensor) -> Tensor:
        """The gradient at the LM head's output from the one at the fp32 `logits` it gave (both [N, V];
        `logits` is overwritten, `grad` is scaled in place)."""
        if self.softcap:  # d(c · tanh(l / c)) = 1 - tanh², and tanh = logits / c
            grad.mul_(logits.div_(self.softcap).square_().neg_().add_(1.0))
        if self.scale != 1.0:
            grad.mul_(self.scale)
        return grad


def chunked_logprobs(
    hidden: Tensor,
    tokens: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    s: SamplingTransform,
    *,
    entropy: bool = False,
    chunk: int,
    head: HeadMath = HeadMath(),
) -> tuple[Tensor, Tensor | None]:
    """:func:`sampled_logprobs` of the logits ``head.logits(hidden, weight, bias)`` without ever holding
    them whole: hidden states [B, T, H] and tokens [B, T] → log-probs [B, T] (and entropy [B, T]).

    The LM head and the log-softmax run ``chunk`` tokens at a time (roles.trainer.logits_chunk);
    backward recomputes each chunk's logits instead of keeping them, so the logits cost chunk ×
    vocabulary floats, not tokens × vocabulary, forward and backward. Gradients reach ``hidden``,
    ``weight`` and ``bias``; the results equal the unchunked computation's to rounding. The
    gradient is the log-softmax's own in closed form (per logit, for a token's log-prob: onehot − p;
    for the entropy: −p · (log p + H); with truncation, over the tokens kept), a few passes over a
    chunk, with no autograd graph of the chunk's logits.
    """
    if chunk <= 0:
        raise ValueError(f"chunk must be at least 1, got {chunk}")
    shape = tokens.shape
    flat = hidden.reshape(-1, hidden.shape[-1])
    logp, ent = _ChunkedHead.apply(flat, weight, bias, tokens.reshape(-1), s, entropy, chunk, head)
    return logp.reshape(shape), (ent.reshape(shape) if entropy else None)


class _ChunkedHead(torch.autograd.Function):
    """LM head + sampled log-softmax (+ entropy) chunk by chunk; backward recomputes each chunk."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        tokens: Tensor,
        s: SamplingTransform,
        entropy: bool,
        chunk: int,
        head: HeadMath,
    ) -> tuple[Tensor, Tensor]:
        n = hidden.shape[0]
        logp = hidden.new_empty(n, dtype=torch.float32)
        ent = hidden.new_empty(n if entropy else 0, dtype=torch.float32)
        lse = hidden.new_empty(n, dtype=torch.float32)
        # Truncation: each row's smallest kept scaled logit, so that backward knows the kept tokens
        # without vLLM's rule again (top-p sorts the vocabulary); -inf where it cannot tell.
        floor = hidden.new_empty(n if s.truncates else 0, dtype=torch.float32)
        for a in range(0, n, chunk):
            b = min(a + chunk, n)
            logits = head.logits(hidden[a:b], weight, bias)
            tgt = tokens[a:b].long()
            if s.truncates:  # sampled_logprobs' computation, step for step
                logits.div_(s.temperature)
                removed = _removed(logits, s)
                floor[a:b] = _floor(logits, removed)
                removed.scatter_(-1, tgt[:, None], False)
                kept = logits.masked_fill(removed, float("-inf"))
                lse[a:b] = torch.logsumexp(kept, dim=-1)
                logp[a:b] = kept.gather(-1, tgt[:, None]).squeeze(-1) - lse[a:b]
                if entropy:
                    probs = torch.softmax(kept, dim=-1)
                    ent[a:b] = lse[a:b] - (probs * logits.masked_fill(removed, 0.0)).sum(dim=-1)
                continue
            if s.temperature != 1.0:
                logits.div_(s.temperature)
            lse[a:b] = torch.logsumexp(logits, dim=-1)
            logp[a:b] = logits.gather(-1, tgt[:, None]).squeeze(-1) - lse[a:b]
            if entropy:  # logsumexp − Σ p · l, as entropy_from_logits computes it
                p = torch.softmax(logits, dim=-1)
                ent[a:b] = lse[a:b] - p.mul_(logits).sum(dim=-1)
        if not entropy:
            ctx.mark_non_differentiable(ent)
        ctx.save_for_backward(hidden, weight, bias, tokens, lse, ent, floor)
        ctx.s, ctx.entropy, ctx.chunk, ctx.head = s, entropy, chunk, head
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, g_logp: Tensor | None, g_ent: Tensor | None):  # type: ignore[override]
        hidden, weight, bias, tokens, lse, ent, floor = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        need_b = need_b and bias is not None
        g_hidden = torch.zeros_like(hidden) if need_h else None
        # Summed over chunks in fp32 (the unchunked matmul's accumulation is fp32 too, in one go).
        g_weight = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        g_bias = torch.zeros_like(bias, dtype=torch.float32) if need_b else None
        g_ent = g_ent if ctx.entropy else None
        if g_logp is None and g_ent is None:
            return g_hidden, g_weight, g_bias, None, None, None, None, None
        n = hidden.shape[0]
        for a in range(0, n, ctx.chunk):
            b = min(a + ctx.chunk, n)
            h = hidden[a:b]
            g_out = _softmax_grad(ctx, h, weight, bias, tokens[a:b], lse, ent, floor, g_logp, g_ent, a, b)
            g_out = g_out.to(weight.dtype)
            if need_h:
                g_hidden[a:b] = g_out @ weight
            if need_w:
                if g_weight.dtype == g_out.dtype:
                    g_weight.addmm_(g_out.t(), h)
                else:
                    g_weight += (g_out.t() @ h).float()
            if need_b:
                g_bias += g_out.float().sum(dim=0)
        return (
            g_hidden,
            g_weight.to(weight.dtype) if g_weight is not None else None,
            g_bias.to(bias.dtype) if g_bias is not None else None,
            None, None, None, None, None,
        )  # fmt: skip


def _floor(scaled: Tensor, removed: Tensor) -> Tensor:
    """Per row of [C, V], the smallest scaled logit kept, where the dropped tokens are exactly those
    below it (min-p, top-k and top-p each drop the least likely first); -inf where they are not (a
    top-p cut between equal logits)."""
    low = scaled.masked_fill(removed, float("inf")).amin(dim=-1)
    exact = ((scaled < low[:, None]) == removed).all(dim=-1)
    return torch.where(exact, low, torch.full_like(low, float("-inf")))


def _softmax_grad(
    ctx: Any, h: Tensor, weight: Tensor, bias: Tensor | None, tgt: Tensor, lse: Tensor, ent: Tensor,
    floor: Tensor, g_logp: Tensor | None, g_ent: Tensor | None, a: int, b: int,
) -> Tensor:  # fmt: skip
    """∂loss/∂(the LM head's output) of one chunk [C, V] in closed form: with scaled logits
    l = logits / T, p = softmax(l) over the tokens kept (all of them without truncation; with it,
    ``_removed``'s rule again, 0 elsewhere) and H the entropy, ∂ log p_t / ∂l = onehot_t − p and
    ∂H / ∂l = −p · (log p + H)."""
    s, head = ctx.s, ctx.head
    scaled = head.logits(h, weight, bias)
    if s.truncates or s.temperature != 1.0:
        scaled.div_(s.temperature)
    lse = lse[a:b]
    if s.truncates:  # the forward's kept tokens: above its floor (or vLLM's rule again), and the target
        low = floor[a:b]
        removed = _removed(scaled, s) if bool(torch.isinf(low).any()) else scaled < low[:, None]
        removed.scatter_(-1, tgt.long()[:, None], False)
        p = torch.softmax(scaled.masked_fill(removed, float("-inf")), dim=-1)
        del removed
    else:
        p = torch.softmax(scaled, dim=-1)
    grad = scaled.sub(lse[:, None])  # log p where kept (times p = 0 elsewhere)
    zero = torch.zeros((), dtype=torch.float32, device=h.device)
    g_lp = g_logp[a:b, None] if g_logp is not None else zero
    if g_ent is not None:  # −p · (g_lp + g_ent · (log p + H))
        grad.add_(ent[a:b, None]).mul_(g_ent[a:b, None]).add_(g_lp)
    else:
        grad.copy_(g_lp.expand_as(grad))
    grad.mul_(p).neg_()
    del p
    if g_logp is not None:
        grad.scatter_add_(-1, tgt.long()[:, None], g_logp[a:b, None])
    if s.truncates or s.temperature != 1.0:
        grad.div_(s.temperature)
    if head.softcap:
        scaled.mul_(s.temperature)  # the logits again, for the softcap's derivative
    return head.grad_(grad, scaled)
