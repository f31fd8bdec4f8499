"""P_train(y): time to train on one iteration's samples on y GPUs, with the best parallelism.

For every TP × PP × SP × DP layout of y GPUs (TP inside a node, PP dividing the layers, SP —
DeepSpeed Ulysses sequence parallelism — dividing the attention heads), every ZeRO stage (1–3),
optionally ZeRO-Offload of the optimizer states, and activation checkpointing on or off, check that
it fits in memory and estimate its time; keep the fastest. What is counted, and why:

- work, in forward-equivalents (F = forward FLOPs per token, costmodel.forward_flops_per_token:
  2·N for N weights, plus attention): the usual rule puts a forward at 2·N·tokens FLOPs and a
  backward at about 4·N·tokens, half of it activation gradients, half weight gradients; so a
  trained model costs 3, +1 with activation checkpointing (roles.trainer.activation_checkpointing:
  each block's forward runs again in backward). PPO trains actor and critic; GRPO, RLOO,
  REINFORCE++ and the other critic-free algorithms the actor only.
  Frozen forwards: the reference's log-probs when the loss has a KL term (algorithm.kl_coef ≠ 0
  and kl_mode ≠ none: DAPO's preset has none), and PPO's critic values. The policy loss (clip,
  GSPO, CISPO), the advantage estimator other than GAE, and importance sampling cost nothing more:
  they reuse the actor's one forward. Micro-batches are packed to T tokens: one maximum-length
  sequence (sequences up to 21K tokens make sample counts meaningless as a memory bound), or with
  train.micro_batch_tokens min(micro_batch_tokens, micro_batch × max_seq), at least one
  maximum-length sequence (the trainer cuts micro-batches by rows and tokens; a longer sample is a
  micro-batch of its own).
- LoRA (``model.lora``, trainer.role.lora): the actor's frozen weights need no weight gradient. Of its
  forward-equivalents the frozen weights' gradient GEMMs go (2·N per token: one forward's dense
  FLOPs); the activation gradients still flow back through every base layer, attention's backward
  and the recomputation stay, and the N_a adapter weights add their own forward, recomputation and
  backward (k × 2·N_a per token, k = 4 with checkpointing, 3 without). So the actor costs
  k − (2·N − 2·k·N_a) / F forward-equivalents: close to k − 1 while the dense GEMMs dominate F.
  PPO's critic still trains in full.
- memory per GPU (memory_parts): weights + gradients + Adam states of each trained model (sharded
  by TP×PP, and by the data-parallel ranks — DP×SP: ZeRO partitions over every rank of the trainer,
  DeepSpeed's seq_data_parallel_group — as far as the ZeRO stage goes; optimizer states off the GPU
  with offload), the frozen reference (with a KL term), the activations and the logits of one
  micro-batch. With LoRA the actor's base stays in the compute dtype, with the adapters beside it;
  gradients and Adam states (and ZeRO's fp32 masters) are the adapters' only; there is no reference
  copy (the base with its adapters switched off serves as the reference: its forward stays, its
  memory goes); activations are a full fine-tune's (the backward runs through the same layers).
- activations (layer_working_set): one transformer block keeps, per token, W elements for its
  backward — Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
  Models", §4.1: 34·h bytes + 5·a·s per token and layer for GPT) counted again for a Llama/Qwen
  block with no dropout and a fused attention kernel: attention 4·h + 2·kv (its norm's and the
  q/k/v projection's input, q, k, v, the attention output that o_proj reads), gated MLP 2·h + 4·I
  (its norm's and gate/up's input, gate, up, silu(gate), the product down_proj reads); eager
  attention also keeps its a·s probabilities. With checkpointing: the block inputs of all layers
  (h per token and layer; also what a 1F1B pipeline keeps in flight, about one micro-batch per
  stage) plus one block's W while it is recomputed; without: every block's W. T tokens, divided by
  TP (Megatron's sequence-parallel TP) and by SP (each rank holds T / SP of the row).
- logits (logits_bytes): the LM head's fp32 [tokens × vocabulary] of a micro-batch's T / SP tokens
  per rank. roles.trainer.logits_chunk > 0 computes them a chunk at a time and recomputes them in
  backward: chunk × V × 4 bytes for the chunk and as much for its gradient, at every ZeRO stage
  (under ZeRO-3 each chunk goes through the head module, which gathers its partitioned weight:
  trainer.role.models.Head). Unchunked (0): the logits, their log-softmax kept for backward and its
  gradient, 3 × tokens × V × 4. The recipe states no vocabulary: model_from_recipe reads it from the model
  directory's config.json, else assumes Qwen2.5's.
- time: compute at the cost model's efficiency, TP all-reduces (4 per layer per forward+backward),
  SP all-to-alls (Ulysses: 2 per layer per forward — q/k/v to head-sharded, the output back —, as
  many in backward and in each recomputation), the pipeline bubble, ZeRO-3 parameter gathers
  (overlapped with compute: DeepSpeed prefetches; one per forward, recomputation and backward), and
  once per iteration the gradient reduction and the optimizer step (on the host with offload).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

from streamrl_cli.planner.costmodel import CostModel, forward_flops_per_token
from streamrl_cli.planner.hardware import GPUSpec
from streamrl_cli.planner.workload import ModelShape, Workload

MAX_PP = 16
TRAINER_TPS = (1,)  # tensor-parallel degrees the trainer runs
TRAINER_PPS = (1,)  # pipeline-parallel degrees the trainer runs
TRAINER_SPS = (1, 2, 4, 8)  # sequence-parallel (Ulysses) degrees tune-split proposes
ZERO_STAGES = (1, 2, 3)
LOGITS_BYTES = 4  # the LM head's logits are fp32 (trainer.algo.losses.HeadMath.post)
UNCHUNKED_LOGITS_COPIES = 3  # logits, their log-softmax kept for backward, its gradient
CHUNKED_LOGITS_COPIES = 2  # one chunk's logits and their gradient (recomputed in backward)


def layer_working_set(m: ModelShape, row_tokens: int, attention: str = "sdpa") -> float:
    """Elements per token one transformer block keeps for its backward (see the module docstring):
    4·h + 2·kv (attention), 2·h + 4·I (gated MLP), + heads · row for eager attention's probabilities."""
    kv = m.kv_heads * m.head_dim
    eager = m.heads * row_tokens if attention == "eager" else 0
    return 6 * m.hidden + 2 * kv + 4 * m.mlp_width + eager


def chunks_logits(wl: Workload, zero: int) -> bool:
    """Whether the trainer computes this layout's logits a chunk at a time: at every ZeRO stage (under
    ZeRO-3 the chunks go through the head module, which gathers its weight), except LoRA under ZeRO-3,
    whose frozen, partitioned head is not gathered for the recomputation (trainer.role.models.lm_head)."""
    return wl.logits_chunk > 0 and not (wl.lora and zero >= 3)


def logits_bytes(wl: Workload, tokens: float, chunked: bool) -> float:
    """Bytes of one micro-batch's logits on a rank that holds ``tokens`` of it (0 without a vocabulary)."""
    if chunked:
        return CHUNKED_LOGITS_COPIES * min(wl.logits_chunk, tokens) * wl.model.vocab * LOGITS_BYTES
    return UNCHUNKED_LOGITS_COPIES * tokens * wl.model.vocab * LOGITS_BYTES


def activation_bytes(wl: Workload, tokens: float, checkpointing: bool) -> float:
    """Bytes of one micro-batch's activations on a rank that holds ``tokens`` of it."""
    m = wl.model
    per_layer = layer_working_set(m, wl.micro_tokens, wl.attention)
    per_token = m.layers * m.hidden + per_layer if checkpointing else m.layers * per_layer
    return tokens * per_token * m.dtype_bytes


@dataclass(frozen=True)
class TrainPlan:
    """The training stage on `gpus` GPUs of one kind."""

    hardware: str
    gpus: int
    tp: int
    pp: int
    dp: int  # data-parallel replicas (SP groups): gpus = tp × pp × sp × dp
    zero: int
    offload: bool  # optimizer states in host memory
    compute_s: float  # forward/backward over the iteration's tokens (streamable, per micro-batch)
    optimizer_s: float  # once per iteration after the last micro-batch: gradient reduction + step
    memory_gb: float  # per GPU
    micro_batches: int  # per data-parallel replica
    last_sample_s: float  # training a maximum-length sample once it has arrived
    full_memory_gb: float  # per GPU, the same layout training every weight (= memory_gb without LoRA)
    sp: int = 1  # sequence-parallel (Ulysses) degree
    checkpointing: bool = True  # activation checkpointing (recomputation in backward)
    logits_chunked: bool = False  # the LM head runs roles.trainer.logits_chunk tokens at a time
    memory_parts_gb: tuple[tuple[str, float], ...] = ()  # memory_gb by what holds it
    usable_gb: float = 0.0  # per GPU, what the hardware spec lets the trainer fill

    @property
    def time_s(self) -> float:
        return self.compute_s + self.optimizer_s

    @property
    def layout(self) -> str:
        off = "+offload" if self.offload else ""
        sp = f" SP{self.sp}" if self.sp > 1 else ""
        ckpt = "+ckpt" if self.checkpointing else ""
        return f"TP{self.tp} PP{self.pp}{sp} DP{self.dp} Z{self.zero}{off}{ckpt}"


def full_finetune(wl: Workload) -> Workload:
    """``wl`` training every weight of the actor (LoRA off)."""
    return dataclasses.replace(wl, lora_rank=0, lora_targets=()) if wl.lora else wl


def memory_parts(
    wl: Workload,
    tp: int,
    pp: int,
    dp: int,
    zero: int,
    offload: bool,
    sp: int = 1,
    checkpointing: bool = True,
) -> dict[str, float]:
    """Bytes per GPU of one layout, by what holds them (see the module's docstring)."""
    m, b, split = wl.model, wl.model.dtype_bytes, tp * pp
    ranks = dp * sp  # ZeRO partitions over every data-parallel and sequence-parallel rank
    shard = m.params / split  # one model's weights on one TP×PP rank
    trainable = (wl.actor_trainable + (m.params if wl.critic else 0)) / split
    models = wl.trained_models + wl.reference_copies  # full-size weight sets
    tokens = wl.micro_tokens / (tp * sp)  # of one micro-batch, on one rank
    return {
        "weights": b * (models * shard + wl.adapter_params / split) / (ranks if zero >= 3 else 1),
        "gradients": b * trainable / (ranks if zero >= 2 else 1),
        "optimizer": 0.0 if offload else m.optimizer_bytes_per_param * trainable / ranks,
        "activations": activation_bytes(wl, tokens, checkpointing),
        # Megatron splits the head over TP (vocabulary-parallel); the last PP stage holds it whole.
        "logits": logits_bytes(wl, wl.micro_tokens / sp, chunks_logits(wl, zero)) / tp,
    }


def model_passes(checkpointing: bool) -> float:
    """Forward-equivalents of one trained model in full: forward, backward (2), recomputation."""
    return 3.0 + int(checkpointing)


def actor_passes(wl: Workload, ctx: float, checkpointing: bool = True) -> float:
    """Forward-equivalents the actor costs per token: k = 4 (forward, recomputation, backward = 2) with
    checkpointing, 3 without; with LoRA k − (2·N − 2·k·N_a) / F: no weight gradients of the frozen
    base, the adapters' own work."""
    k = model_passes(checkpointing)
    if not wl.lora:
        return k
    m = wl.model
    return k - (2 * m.params - 2 * k * wl.adapter_params) / forward_flops_per_token(m, ctx)


def train_passes(wl: Workload, ctx: float, checkpointing: bool = True) -> float:
    """Forward-equivalents per token of one iteration: actor, critic (PPO), frozen forwards."""
    critic = model_passes(checkpointing) * int(wl.critic)
    return actor_passes(wl, ctx, checkpointing) + critic + wl.frozen_forwards


class TrainingModel:
    """P_train for one hardware kind and workload; plans are memoised."""

    def __init__(
        self,
        cm: CostModel,
        hw: GPUSpec,
        wl: Workload,
        layouts: str = "trainer",
        *,
        sequence_parallel: tuple[int, ...] | None = None,
        checkpointing: tuple[bool, ...] | None = None,
    ):
        """``layouts``: "trainer" plans only what StreamRL's trainer runs, ZeRO data parallel (TP1
        PP1) with Ulysses sequence parallelism and activation checkpointing on or off; "megatron"
        also TP within a node and PP, always with checkpointing and without Ulysses, as the paper's
        trainer ran (for reproducing its measurements, never for a recipe). A recipe that sets
        roles.trainer.sequence_parallel above 1 or activation_checkpointing on fixes it;
        ``sequence_parallel`` and ``checkpointing`` pin the degrees and settings tried (what-ifs)."""
        self.cm, self.hw, self.wl = cm, hw, wl
        m = wl.model
        if layouts == "trainer":
            self.tps, self.pps = list(TRAINER_TPS), list(TRAINER_PPS)
            sps = (wl.sequence_parallel,) if wl.sequence_parallel > 1 else TRAINER_SPS
            # Ulysses needs sdpa or flash attention (trainer.role.sequence_parallel.install).
            self.sps = [sp for sp in sps if sp == 1 or (sp_divides(m, sp) and wl.attention != "eager")]
            self.checkpointing = [True] if wl.activation_checkpointing else [False, True]
        else:
            self.tps = [
                tp
                for tp in (1, 2, 4, 8, 16)
                if tp <= hw.gpus_per_node and m.heads % tp == 0 and (tp == 1 or hw.nvlink_bw > 0)
            ]
            self.pps = [pp for pp in range(1, min(MAX_PP, m.layers) + 1) if m.layers % pp == 0]
            self.sps, self.checkpointing = [1], [True]
        if sequence_parallel is not None:
            self.sps = [sp for sp in sequence_parallel if sp == 1 or sp_divides(m, sp)]
        if checkpointing is not None:
            self.checkpointing = list(checkpointing)
        self._best = lru_cache(maxsize=None)(lambda g: self._best_uncached(g, lambda p: p.time_s))
        self._front = lru_cache(maxsize=None)(self._pareto)

    def memory_bytes(
        self, tp: int, pp: int, dp: int, zero: int, offload: bool, sp: int = 1, checkpointing: bool = True
    ) -> float:
        return sum(memory_parts(self.wl, tp, pp, dp, zero, offload, sp, checkpointing).values())

    def full_memory_bytes(
        self, tp: int, pp: int, dp: int, zero: int, offload: bool, sp: int = 1, checkpointing: bool = True
    ) -> float:
        """The same layout training every weight: what LoRA saves is the difference."""
        parts = memory_parts(full_finetune(self.wl), tp, pp, dp, zero, offload, sp, checkpointing)
        return sum(parts.values())

    def plan(
        self,
        tp: int,
        pp: int,
        dp: int,
        zero: int,
        offload: bool,
        sp: int = 1,
        checkpointing: bool = True,
    ) -> TrainPlan | None:
        """The layout's time, or None if it does not fit in memory. ``dp``: data-parallel replicas,
        each an SP group of ``sp`` × TP × PP GPUs."""
        cm, hw, wl, m = self.cm, self.hw, self.wl, self.wl.model
        parts = memory_parts(wl, tp, pp, dp, zero, offload, sp, checkpointing)
        mem = sum(parts.values())
        if mem > hw.usable_bytes:
            return None
        gpus = tp * pp * sp * dp
        ranks = dp * sp  # ZeRO's partitions
        shard = m.params / (tp * pp)
        trainable = (wl.actor_trainable + (m.params if wl.critic else 0)) / (tp * pp)
        b = m.dtype_bytes
        passes = train_passes(wl, wl.attention_ctx, checkpointing)
        replica_tokens = wl.tokens / dp
        micro = max(1, math.ceil(replica_tokens / wl.micro_tokens))
        compute = cm.train_compute_s(hw, m, replica_tokens, passes, wl.attention_ctx, micro, tp * pp * sp)
        # One lone micro-batch (the last sample) crosses the stages one after another: PP does not
        # shorten it, only TP and SP do.
        last_sample = compute * min(1.0, wl.max_seq / replica_tokens) * pp
        compute *= 1 + (pp - 1) / micro  # 1F1B pipeline fill and drain
        if tp > 1:
            msg = wl.max_seq * m.hidden * b * 2 * (tp - 1) / tp
            per_collective = hw.collective_s + msg / (hw.nvlink_bw * hw.eff.comm)
            tp_comm = passes * 2 * (m.layers / pp) * per_collective
            compute += micro * tp_comm
            last_sample += tp_comm * pp
        if sp > 1:
            # Per micro-batch, per layer and attention pass (each trained model's forward, backward
            # and recomputation, each frozen forward): 2 all-to-alls of this rank's q, k, v and then
            # of the attention output, (2·h + 2·kv) · T / (TP·SP) elements, (SP − 1) / SP of it sent.
            # An SP group of consecutive ranks stays in a node while it fits in one.
            kv = m.kv_heads * m.head_dim
            attention_passes = wl.trained_models * (2 + int(checkpointing)) + wl.frozen_forwards
            volume = (2 * m.hidden + 2 * kv) * wl.micro_tokens / (tp * sp) * b * (sp - 1) / sp
            intra = sp * tp <= hw.gpus_per_node and hw.nvlink_bw > 0
            bw = (hw.nvlink_bw if intra else hw.internode_bw) * hw.eff.comm
            sp_comm = attention_passes * (m.layers / pp) * (2 * hw.collective_s + volume / bw)
            compute += micro * sp_comm
            last_sample += sp_comm * pp
        link = hw.internode_bw if gpus > hw.gpus_per_node or hw.nvlink_bw == 0 else hw.nvlink_bw
        dp_bw = link * hw.eff.comm
        ring = (ranks - 1) / ranks
        if zero == 3 and ranks > 1:
            # Per micro-batch: gather each trained model's shard for forward, recompute and backward,
            # reduce-scatter its gradients (with LoRA the adapters' only); gather the frozen weights
            # for their forwards (with LoRA the reference's are the actor's base again). Every rank
            # of an SP group gathers for the micro-batch it shares.
            gathered = (wl.trained_models * (2 + int(checkpointing)) + wl.frozen_forwards) * shard + trainable
            gathers = micro * gathered * b * ring / dp_bw
            compute = max(compute, gathers)
            grad_sync = 0.0
        else:
            grad_sync = 2 * trainable * b * ring / dp_bw
        opt_shard = trainable / ranks
        states = m.optimizer_bytes_per_param + 2 * b
        if offload:
            step = opt_shard * (2 * states / hw.host_bw + 2 * b / hw.pcie_bw)
        else:
            step = opt_shard * 2 * states / hw.hbm_bw
        full = self.full_memory_bytes(tp, pp, dp, zero, offload, sp, checkpointing) if wl.lora else mem
        return TrainPlan(
            hardware=hw.name,
            gpus=gpus,
            tp=tp,
            pp=pp,
            dp=dp,
            zero=zero,
            offload=offload,
            compute_s=compute,
            optimizer_s=grad_sync + step,
            memory_gb=mem / 1e9,
            micro_batches=micro,
            last_sample_s=last_sample,
            full_memory_gb=full / 1e9,
            sp=sp,
            checkpointing=checkpointing,
            logits_chunked=chunks_logits(wl, zero),
            memory_parts_gb=tuple((k, v / 1e9) for k, v in parts.items()),
            usable_gb=hw.usable_bytes / 1e9,
        )

    def layouts(self, gpus: int) -> list[tuple[int, int, int, int]]:
        """(tp, pp, sp, dp) of `gpus` GPUs."""
        return [
            (tp, pp, sp, gpus // (tp * pp * sp))
            for tp in self.tps
            for pp in self.pps
            for sp in self.sps
            if gpus % (tp * pp * sp) == 0
        ]

    def _plans(self, gpus: int) -> list[TrainPlan]:
        return [
            p
            for tp, pp, sp, dp in self.layouts(gpus)
            for zero in ZERO_STAGES
            for offload in (False, True)
            for ckpt in self.checkpointing
            if (p := self.plan(tp, pp, dp, zero, offload, sp, ckpt)) is not None
        ]

    def best(self, gpus: int) -> TrainPlan | None:
        """The fastest layout of exactly `gpus` GPUs (None: nothing fits)."""
        return self._best(gpus)

    def candidates(self, gpus: int) -> list[TrainPlan]:
        """Layouts worth composing into an iteration: the fastest, and in sync-stream mode every
        layout on the Pareto front of (total time, time to train the last sample). There the last
        sample and the optimizer step are exposed after generation ends, so a trainer with slack
        does better with a layout that trains one 20K-token sample fast than with the fastest."""
        best = self.best(gpus)
        if best is None or self.wl.mode != "sync-stream":
            return [best] if best is not None else []
        return self._front(gpus)

    def _pareto(self, gpus: int) -> list[TrainPlan]:
        front: list[TrainPlan] = []
        for p in sorted(self._plans(gpus), key=lambda p: (p.time_s, p.last_sample_s)):
            if not front or p.last_sample_s < front[-1].last_sample_s:
                front.append(p)
        return front

    def _best_uncached(self, gpus: int, key: Callable[[TrainPlan], float]) -> TrainPlan | None:
        best: TrainPlan | None = None
        for p in self._plans(gpus):
            if best is None or key(p) < key(best):
                best = p
        return best

    def table(self, counts: list[int], budget: int) -> list[TrainPlan | None]:
        """best-so-far[y], y = 0..budget, over the allowed trainer sizes `counts` (Algorithm 1's P_train)."""
        allowed = set(counts)
        out: list[TrainPlan | None] = [None] * (budget + 1)
        best: TrainPlan | None = None
        for y in range(1, budget + 1):
            if y in allowed:
                p = self.best(y)
                if p is not None and (best is None or p.time_s < best.time_s):
                    best = p
            out[y] = best
        return out

    def smallest_fitting(self, counts: list[int]) -> int | None:
        """The fewest GPUs (among `counts`) on which some layout fits: for error messages."""
        return next((y for y in sorted(counts) if self.best(y) is not None), None)


def sp_divides(m: ModelShape, sp: int) -> bool:
    """Ulysses splits the heads over the SP ranks: ``sp`` divides the attention heads and divides or
    is a multiple of the key/value heads (trainer.role.sequence_parallel.install)."""
    return m.heads % sp == 0 and (m.kv_heads % sp == 0 or sp % m.kv_heads == 0)
