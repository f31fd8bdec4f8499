"""Sequence parallelism for the trainer (``roles.trainer.sequence_parallel``): each packed row split
along the sequence over ``degree`` ranks, with DeepSpeed's own Ulysses attention (ALST).

The trainer's N ranks form N / degree *sequence-parallel (SP) groups* of consecutive ranks
(DeepSpeed's ``parallel_state_sp``: ranks ``[g·s, (g+1)·s)``); the ranks of one group run the SAME
micro-batch, each on one contiguous slice of every packed row. Between the slices only attention
mixes tokens; DeepSpeed's :class:`UlyssesSPAttentionHF` does it with two all-to-alls per layer
(sequence-sharded, all heads → whole sequence, heads/degree → back), and everything else (norms,
MLP, RoPE from the true position ids, the LM head) is per token. Gloo runs those all-to-alls on
CPUs (torch ≥ 2.x has ``all_to_all_single`` on gloo): no fallback is needed.

Two things DeepSpeed's HF integration does not do, added here:

* **Packed rows with sdpa.** Transformers reads the packing (position ids restarting at 0) in
  ``create_causal_mask``, at the model's level, i.e. from the local slice's ids, for the local
  slice's length; DeepSpeed's wrapper drops that mask (it has the wrong size) and sdpa then falls
  back to ``is_causal``: one causal block over the whole row, attending ACROSS packed sequences.
  (Flash attention reads the packing from the gathered position ids itself and is exact.) The
  core attention installed here rebuilds the packed causal mask from the gathered position ids,
  as transformers does unsplit, so sdpa (the CPU path) is exact.
* **A per-model attention key, not a global override.** ``register_with_transformers`` replaces
  ``ALL_ATTENTION_FUNCTIONS["sdpa"]`` for the whole process and asserts it is called once;
  :meth:`SequenceParallel.install` registers its own key (``streamrl_ulysses``) and points only the
  models it is given at it (actor, reference, critic), so any other model in the process is
  unaffected; the micro-batch's row count may change between calls (DeepSpeed's class fixes it).

Per-token outputs (log-probs, entropy, values) are computed on the local slice, then gathered to
the whole packed row on every rank of the group (:meth:`SequenceParallel.gather`), so the loss code
(``trainer.algo``) runs unchanged on the whole micro-batch, identically on every rank of the
group. The gather's backward hands each rank the gradient of ITS slice only, with no
communication: every rank holds the same loss, so that slice is exactly d loss / d local output,
and the per-rank parameter gradients add up (over the group) to the gradient of that loss.
DeepSpeed, given :attr:`SequenceParallel.mpu` in ``deepspeed.initialize``, reduces gradients over
all N ranks and divides by N / degree (the data-parallel width) with ZeRO 0-2: the group's sum,
averaged over groups; but by N with ZeRO-3 (:meth:`SequenceParallel.averaged_over`). ZeRO
partitions over all N ranks (DeepSpeed's ``seq_data_parallel_group``).

What the caller does differently (``trainer.role.learner``): engines get ``mpu=sp.mpu``; losses and
stats, summed over all ranks, count each micro-batch once per rank of its group (divide by
``degree``); DeepSpeed's gradient is divided by :meth:`~SequenceParallel.averaged_over`, not by
the world; the rank driver hands a micro-batch per SP group (:attr:`~SequenceParallel.dp_rank`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from streamrl_cli.trainer.algo.losses import SamplingTransform
from streamrl_cli.trainer.loop.batch import MicroBatch
from streamrl_cli.trainer.role.models import Packed

ATTENTION_KEY = "streamrl_ulysses"


def create_groups(degree: int) -> Any:
    """Every trainer rank, after ``init_distributed`` and before any engine: DeepSpeed's SP groups of
    ``degree`` consecutive ranks (a collective: all ranks call it). Returns DeepSpeed's parallel-state
    module, the ``mpu`` for ``deepspeed.initialize`` (idempotent for the same degree)."""
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as mpu

    if mpu._SEQUENCE_PARALLEL_GROUP is not None:
        if mpu.get_sequence_parallel_world_size() != degree:
            raise RuntimeError(
                f"sequence-parallel groups of {mpu.get_sequence_parallel_world_size()} exist, not {degree}"
            )
        return mpu
    mpu.initialize_sequence_parallel(degree)
    return mpu


def release_groups() -> None:
    """Forget DeepSpeed's SP groups (after the default group is destroyed: ``learner.leave_group``)."""
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as mpu

    mpu._release_sequence_parallel_groups()


class _GatherSequence(torch.autograd.Function):
    """[B, n] local slice → [B, n·degree], the group's slices in rank order. Backward: this rank's
    slice of the gradient, no communication (every rank holds the same downstream loss)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, rank: int, degree: int) -> torch.Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(degree)]
        dist.all_gather(parts, x, group=group)
        ctx.span = (rank * x.shape[1], (rank + 1) * x.shape[1])
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        a, b = ctx.span
        return grad[:, a:b].contiguous(), None, None, None


@dataclass(frozen=True)
class Shard:
    """One rank's slice of a micro-batch's packed rows. The rows are padded to a multiple of the
    degree (``width`` → ``padded``); the padding comes after every real token, so causal attention
    keeps it out of them, and :meth:`SequenceParallel.gather` cuts it off again."""

    packed: Packed
    ids: torch.Tensor  # [R, padded / degree] this rank's tokens
    positions: torch.Tensor  # [R, padded / degree] their position ids (restarting per sequence)
    targets: torch.Tensor  # [R, padded / degree] the token each position predicts (0 past the row)
    width: int  # the packed rows' length


class SequenceParallel:
    """This rank's place in the SP layout, and the forwards that split packed rows over its group.

    Build it with :meth:`setup` (all ranks, collective). ``degree`` 1 is not built: the trainer
    then runs as before."""

    def __init__(self, degree: int, group: Any, mpu: Any = None):
        self.degree, self.group, self.mpu = degree, group, mpu
        self.rank = dist.get_rank(group)  # within the SP group
        world = dist.get_world_size()
        self.dp_world = world // degree  # micro-batches per round: one per SP group
        self.dp_rank = dist.get_rank() // degree  # which of them this rank runs

    @classmethod
    def setup(cls, degree: int) -> SequenceParallel:
        """All trainer ranks: DeepSpeed's SP groups (:func:`create_groups`) and this rank's handle."""
        if degree < 2:
            raise ValueError(f"sequence parallelism needs a degree of 2 or more, got {degree}")
        mpu = create_groups(degree)
        return cls(degree, mpu.get_sequence_parallel_group(), mpu)

    def averaged_over(self, zero_stage: int) -> int:
        """The number DeepSpeed 0.19.8 divides each gradient's sum over all ranks by, given this
        ``mpu``: the data-parallel width (world / degree) with ZeRO 0-2; the whole world with ZeRO-3,
        whose default reduce-scatter (``reduce_scatter: true``) ignores the SP size (its contiguous
        all-reduce path does not; other projects hit the same: hamishivi/tmax#9)."""
        world = self.dp_world * self.degree
        return world if zero_stage == 3 else self.dp_world

    # -- the model ------------------------------------------------------------------------------

    def install(self, model: nn.Module) -> nn.Module:
        """Point `model`'s attention (an HF model, a PEFT wrapper or a bare backbone) at DeepSpeed's
        Ulysses attention over this group, around its current implementation (sdpa on CPUs; flash
        attention variants on GPUs). Returns the model."""
        config = model.config
        core = config._attn_implementation
        if core == ATTENTION_KEY:
            return model
        text = config.get_text_config()
        heads, kv = text.num_attention_heads, text.num_key_value_heads
        if heads % self.degree or (kv % self.degree and self.degree % kv):
            raise ValueError(
                f"sequence_parallel {self.degree} must divide the attention heads ({heads}) and divide or be "
                f"a multiple of the key/value heads ({kv})"
            )
        if core in ("eager", "paged|eager", None):
            raise ValueError(
                f"sequence parallelism needs sdpa or flash attention, the model uses {core!r} (DeepSpeed's "
                "Ulysses discards the 4-D mask eager attention needs)"
            )
        _register(self.group, core)
        config._attn_implementation = ATTENTION_KEY
        return model

    # -- the data -------------------------------------------------------------------------------

    def shard(self, mb: MicroBatch) -> Shard:
        """`mb` packed (:class:`~streamrl_cli.trainer.role.models.Packed`, always, even where plain
        rows would cost the same) and this rank's slice of its rows."""
        keep = mb.attention_mask.bool()
        if bool((keep[:, 1:] > keep[:, :-1]).any()):
            raise ValueError("sequence parallelism needs right-padded micro-batches")
        packed = Packed(mb)
        rows, width = packed.ids.shape
        span = -(-width // self.degree)  # each rank's share, the rows padded to degree × span
        pad = span * self.degree - width
        ids = torch.nn.functional.pad(packed.ids, (0, pad))
        # The padding continues the last sequence's positions: it adds no packed sequence, and
        # causal attention keeps it out of every real token (it comes after all of them).
        tail = packed.positions[:, -1:] + torch.arange(1, pad + 1, device=ids.device)
        positions = torch.cat([packed.positions, tail], dim=1)
        targets = torch.nn.functional.pad(ids[:, 1:], (0, 1))
        part = slice(self.rank * span, (self.rank + 1) * span)
        return Shard(packed, ids[:, part], positions[:, part], targets[:, part], width)

    def gather(self, x: torch.Tensor, shard: Shard) -> torch.Tensor:
        """Per-token [R, span] on this rank's slice → [R, width], the whole packed rows, on every rank
        of the group (autograd: the gradient flows back to this rank's slice)."""
        full = _GatherSequence.apply(x, self.group, self.rank, self.degree)
        return full[:, : shard.width]

    # -- the trainer's forwards (``models.policy_forward`` / ``critic_forward`` with SP) ----------

    def policy_forward(
        self,
        model: nn.Module,
        mb: MicroBatch,
        sampling: SamplingTransform | float,
        *,
        entropy: bool = False,
        chunk: int = 0,
        routers: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``models.policy_forward`` over this group: the same [B, L-1] log-probs (and entropy) of the
        whole micro-batch on every rank of the group; each rank's forward holds 1/degree of the tokens.
        ``chunk`` (roles.trainer.logits_chunk) as there: the LM head a chunk of this rank's tokens at
        a time, where ``models.lm_head`` can reproduce it. `routers` (a MoE actor's) count every token
        of this rank's shard (its packed row's tail included)."""
        from streamrl_cli.trainer.role.models import target_logprobs

        if not isinstance(sampling, SamplingTransform):
            sampling = SamplingTransform.tempered(float(sampling))
        shard = self.shard(mb)
        if routers is not None:
            routers.tokens(None)
        logp, ent = target_logprobs(
            model, shard.targets, sampling, entropy=entropy, chunk=chunk, input_ids=shard.ids,
            position_ids=shard.positions, use_cache=False,
        )  # fmt: skip
        packed = shard.packed
        logp = packed.unpack(self.gather(logp, shard)[:, :-1])
        return logp, (packed.unpack(self.gather(ent, shard)[:, :-1]) if ent is not None else None)

    def critic_forward(self, critic: Any, mb: MicroBatch) -> torch.Tensor:
        """``models.critic_forward`` over this group: values aligned with the targets, whole batch."""
        shard = self.shard(mb)
        values = critic(shard.ids, None, shard.positions)
        return shard.packed.spread(self.gather(values, shard))[:, :-1].float()


# -- attention ----------------------------------------------------------------------------------

_CORES: dict[str, Any] = {}  # what the registration wraps: its core implementation and SP group


def _register(group: Any, core: str) -> None:
    """Register ``ATTENTION_KEY`` with transformers: DeepSpeed's Ulysses around `core`; and a mask
    function that builds no mask (the wrapper discards it: it would be the local slice's)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if _CORES.get("core") == core and _CORES.get("group") is group:
        return  # registered: the actor's, reference's and critic's calls share it
    # A new group (its groups rebuilt after release_groups) or core replaces the registration: one
    # SP group per rank, so every model of the process runs the same one.
    _CORES.update(core=core, group=group)
    ulysses: dict[tuple[int, int, int], Any] = {}  # one DeepSpeed module per head layout

    def attention(module: nn.Module, query, key, value, attention_mask, *args, **kwargs):  # type: ignore[no-untyped-def]
        layout = (query.shape[1], key.shape[1], query.shape[-1])
        if layout not in ulysses:
            ulysses[layout] = _Ulysses(
                attn=_core_attention(core),
                batch_size=query.shape[0],
                attn_head_count=layout[0],
                attn_head_size=layout[2],
                kv_head_count=layout[1],
                num_hidden_layers=1,  # only DeepSpeed's skip-attention debug mode reads it
                process_group=group,
                seq_length_is_variable=True,
            )
            ulysses[layout].core_attn_implementation = core
        return ulysses[layout](module, query, key, value, None, *args, **kwargs)

    AttentionInterface.register(ATTENTION_KEY, attention)
    AttentionMaskInterface.register(ATTENTION_KEY, _no_mask)


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None


def _core_attention(core: str) -> Any:
    """The attention the gathered heads run: `core` as registered; sdpa given the packed causal mask
    of the gathered (whole-row) position ids, as transformers builds it for an unsplit row."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    function = ALL_ATTENTION_FUNCTIONS[core]
    if core != "sdpa":
        return function  # flash attention: reads the packing from position_ids itself

    def sdpa(module: nn.Module, query, key, value, attention_mask, *args, **kwargs):  # type: ignore[no-untyped-def]
        mask = packed_causal_mask(kwargs["position_ids"])
        return function(module, query, key, value, mask, *args, **kwargs)

    return sdpa


def packed_causal_mask(position_ids: torch.Tensor) -> torch.Tensor | None:
    """[B, 1, L, L] bool: causal within each packed sequence (position ids restart at 0 at each);
    None for rows of one sequence each (sdpa's own is_causal then)."""
    from transformers.masking_utils import find_packed_sequence_indices

    seq = find_packed_sequence_indices(position_ids)
    if seq is None:
        return None
    length = position_ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    return ((seq[:, :, None] == seq[:, None, :]) & causal)[:, None]


def _ulysses_class() -> type:
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    class Ulysses(UlyssesSPAttentionHF):
        """DeepSpeed's module with the batch (packed rows) read from each call, not fixed at build."""

        def forward(self, module, query, key, value, attention_mask, *args, **kwargs):  # type: ignore[no-untyped-def]
            batch = query.shape[0]
            if batch != self.batch_size:
                self.batch_size = batch
                q, kv = self.required_query_shape, self.required_key_value_shape
                c = self.required_context_shape
                self.required_query_shape = torch.Size([q[0], batch, *q[2:]])
                self.required_key_value_shape = torch.Size([kv[0], batch, *kv[2:]])
                self.required_context_shape = torch.Size([c[0], batch, *c[2:]])
            return super().forward(module, query, key, value, attention_mask, *args, **kwargs)

    return Ulysses


def _Ulysses(**kwargs: Any) -> Any:  # noqa: N802 (a class, made on first use: DeepSpeed imports late)
    return _ulysses_class()(**kwargs)
