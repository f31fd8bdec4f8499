"""P_train(y): time to train on one iteration's samples on y GPUs, with the best parallelism.

For every TP × PP × SP × DP layout of y GPUs (TP inside a node, PP dividing the layers, SP —
DeepSpeed Ulysses sequence parallelism — dividing the attention heads), for a mixture of experts
every EP degree (expert parallelism, dividing the experts and the DP × SP ranks), every ZeRO stage
(1–3), optionally ZeRO-Offload of the optimizer states, and activation checkpointing on or off,
check that it fits in memory and estimate its time; keep the fastest. The trainer's TP is DeepSpeed
AutoTP (trainer.role.tensor_parallel; TRAINER_TPS: 1, 2, 4, 8 inside a node, dividing the query and
KV heads, with any ZeRO stage, but not beside Ulysses, nor with LoRA or a mixture of experts); the
"megatron" layouts (the paper's trainer) take TP with any ZeRO stage and PP. What is counted, and why:

- mixtures of experts (ModelShape.experts): compute counts the ACTIVE parameters (those a token
  goes through: F below uses 2 · active_params), memory the TOTAL (weights, gradients, optimizer
  states, the reference). EP splits the routed experts (ModelShape.expert_params) over EP
  data-parallel ranks: their weights, gradients and states ÷ EP on a rank, ZeRO partitioning them
  over the ranks / EP that hold the same experts (so under ZeRO-3 EP saves no memory, but divides
  the experts' gathers and gradient reductions); the rest of the model is partitioned as a dense one.
  Per micro-batch and MoE layer, each forward, recomputation and backward adds 2 all-to-alls among
  the EP ranks (the tokens to their k experts, the outputs back: k · h elements per token each,
  (EP − 1) / EP of them sent), over NVLink while EP × TP × SP GPUs fit in a node. The layout is
  planned to compare; the trainer does not run it (problem.overrides refuses to write it).
- tensor parallelism (TP): every weight, gradient and optimizer state ÷ TP on a rank (ZeRO then
  partitions over the DP × SP ranks); activations: AutoTP splits q, k, v, the attention output and
  the MLP's (or each expert's) gate/up/product over TP, and keeps the norms' inputs, the residual
  stream and the checkpointed block inputs whole on every TP rank (layer_working_set_parts;
  "megatron": all ÷ TP, Megatron's sequence-parallel TP); logits whole (AutoTP) or ÷ TP (Megatron's
  vocabulary-parallel head). Time: 2 all-reduces per layer (after attention, after the MLP) in each
  forward, recomputation and backward, of the rank's T / SP × h activations, 2 (TP − 1) / TP of them
  sent over NVLink.

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
- time: compute at the cost model's efficiency, TP all-reduces (2 per layer per pass, above), EP
  all-to-alls (above),
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
# Tensor-parallel degrees the trainer runs (DeepSpeed AutoTP, trainer.role.tensor_parallel): inside a
# node, dividing the query and KV heads (each rank computes whole heads), with any ZeRO stage, not with
# Ulysses, LoRA or a mixture of experts (the recipe checks refuse those: TrainingModel, tp_allowed).
TRAINER_TPS = (1, 2, 4, 8)
EXPERT_PARALLEL = (1, 2, 4, 8, 16, 32, 64)  # EP degrees tried for a mixture of experts
TRAINER_PPS = (1,)  # pipeline-parallel degrees the trainer runs
TRAINER_SPS = (1, 2, 4, 8)  # sequence-parallel (Ulysses) degrees tune-split proposes
ZERO_STAGES = (1, 2, 3)
LOGITS_BYTES = 4  # the LM head's logits are fp32 (trainer.algo.losses.HeadMath.post)
UNCHUNKED_LOGITS_COPIES = 3  # logits, their log-softmax kept for backward, its gradient
CHUNKED_LOGITS_COPIES = 2  # one chunk's logits and their gradient (recomputed in backward)


def layer_working_set_parts(m: ModelShape, row_tokens: int, attention: str = "sdpa") -> tuple[float, float]:
    """Elements per token one transformer block keeps for its backward, as (what every rank of a
    tensor-parallel group keeps whole, what TP splits over its ranks); see the module docstring.
    Attention: the norm's and the q/k/v projection's inputs, 2·h, whole; q, k, v and the attention
    output, 2·q + 2·kv (q = heads · head_dim), split (+ heads · row for eager attention's
    probabilities). Dense gated MLP: its norm's and gate/up's inputs, 2·h, whole; gate, up, silu(gate)
    and the product down_proj reads, 4·I, split. MoE MLP: 2·h and the router's E logits whole; for
    each of the k experts a token is routed to its copy of the input and the expert's output, 2·h,
    whole, and the expert's 4·I_e split; a shared expert's 4·I_s split. Dense and MoE layers are
    averaged over the layers."""
    h, kv, q = m.hidden, m.kv_heads * m.head_dim, m.q_width
    eager = m.heads * row_tokens if attention == "eager" else 0
    whole, split = 2 * h, 2 * q + 2 * kv + eager
    dense_mlp = (2 * h, 4 * m.mlp_width)
    if not m.moe:
        return whole + dense_mlp[0], split + dense_mlp[1]
    k = m.experts_per_token
    moe_mlp = (2 * h + m.experts + k * 2 * h, 4 * k * m.expert_intermediate + 4 * m.shared_intermediate)
    f = m.moe_layers / m.layers
    return (
        whole + f * moe_mlp[0] + (1 - f) * dense_mlp[0],
        split + f * moe_mlp[1] + (1 - f) * dense_mlp[1],
    )


def layer_working_set(m: ModelShape, row_tokens: int, attention: str = "sdpa") -> float:
    """Elements per token one transformer block keeps for its backward (see the module docstring):
    4·h + 2·kv (attention), 2·h + 4·I (gated MLP), + heads · row for eager attention's probabilities
    (a dense Qwen2.5 block, q = h; layer_working_set_parts has the general count)."""
    return sum(layer_working_set_parts(m, row_tokens, attention))


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


def activation_bytes(
    wl: Workload, tokens: float, checkpointing: bool, tp: int = 1, megatron: bool = False
) -> float:
    """Bytes of one micro-batch's activations on a rank whose sequence-parallel shard holds ``tokens``
    of it, in a tensor-parallel group of ``tp``: the parts TP splits divided by ``tp``, the rest (and
    the checkpointed block inputs) whole, as DeepSpeed AutoTP keeps them; ``megatron``: everything
    divided by ``tp`` (Megatron's sequence-parallel TP, the paper's trainer)."""
    m = wl.model
    whole, split = layer_working_set_parts(m, wl.micro_tokens, wl.attention)
    inputs = m.hidden
    if megatron:
        whole, inputs = whole / tp, inputs / tp
    per_layer = whole + split / tp
    per_token = m.layers * inputs + per_layer if checkpointing else m.layers * per_layer
    return tokens * per_token * m.dtype_bytes


def tp_allowed(m: ModelShape, hw: GPUSpec, tp: int) -> bool:
    """A TP degree the trainer runs: inside one node, with a GPU link, splitting the query heads and
    the KV heads evenly (AutoTP gives each rank whole heads; recipe.checks refuses the rest)."""
    inside = tp <= hw.gpus_per_node and (tp == 1 or hw.nvlink_bw > 0)
    return inside and m.heads % tp == 0 and m.kv_heads % tp == 0


def expert_parallel_degrees(m: ModelShape) -> list[int]:
    """EP degrees of a mixture of experts: those dividing its expert count (a dense model: 1)."""
    return [ep for ep in EXPERT_PARALLEL if m.moe and m.experts % ep == 0] if m.moe else [1]


@dataclass(frozen=True)
class Shards:
    """Parameters one rank holds of each kind before ZeRO partitions them: weights of every full model
    set (actor, critic, reference; with LoRA also the adapters), and those that train, each split
    into the dense part (÷ TP·PP, ZeRO over every data-parallel rank) and the routed experts
    (÷ TP·PP·EP, ZeRO over the ranks / EP holding the same experts)."""

    weights_dense: float
    weights_expert: float
    trainable_dense: float
    trainable_expert: float


def shards(wl: Workload, tp: int, pp: int, ep: int = 1) -> Shards:
    m, split = wl.model, tp * pp
    experts = m.expert_params
    dense = m.params - experts
    sets = wl.trained_models + wl.reference_copies
    fully_trained = int(not wl.lora) + int(wl.critic)  # models whose every weight (experts too) trains
    trainable = wl.actor_trainable + (m.params if wl.critic else 0)
    return Shards(
        weights_dense=(sets * dense + wl.adapter_params) / split,
        weights_expert=sets * experts / (split * ep),
        trainable_dense=(trainable - fully_trained * experts) / split,
        trainable_expert=fully_trained * experts / (split * ep),
    )


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
    ep: int = 1  # expert-parallel degree (a mixture of experts: experts split over ep data-parallel ranks)
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
        ep = f" EP{self.ep}" if self.ep > 1 else ""
        ckpt = "+ckpt" if self.checkpointing else ""
        return f"TP{self.tp} PP{self.pp}{sp} DP{self.dp}{ep} Z{self.zero}{off}{ckpt}"


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
    ep: int = 1,
    *,
    megatron: bool = False,
) -> dict[str, float]:
    """Bytes per GPU of one layout, by what holds them (see the module's docstring). ``ep``: the
    expert-parallel degree (a mixture of experts), dividing the data-parallel ranks; ``megatron``:
    the paper's Megatron trainer (sequence-parallel TP, vocabulary-parallel head) instead of the
    trainer's DeepSpeed AutoTP."""
    m, b = wl.model, wl.model.dtype_bytes
    ranks = dp * sp  # ZeRO partitions over every data-parallel and sequence-parallel rank
    expert_ranks = ranks / ep  # ... the routed experts over the ranks that hold the same experts
    sh = shards(wl, tp, pp, ep)
    return {
        "weights": b
        * (
            sh.weights_dense / (ranks if zero >= 3 else 1)
            + sh.weights_expert / (expert_ranks if zero >= 3 else 1)
        ),
        "gradients": b
        * (
            sh.trainable_dense / (ranks if zero >= 2 else 1)
            + sh.trainable_expert / (expert_ranks if zero >= 2 else 1)
        ),
        "optimizer": 0.0
        if offload
        else m.optimizer_bytes_per_param * (sh.trainable_dense / ranks + sh.trainable_expert / expert_ranks),
        "activations": activation_bytes(wl, wl.micro_tokens / sp, checkpointing, tp, megatron),
        # Megatron splits the head over TP (vocabulary-parallel); the last PP stage holds it whole.
        # AutoTP leaves each TP rank the whole logits.
        "logits": logits_bytes(wl, wl.micro_tokens / sp, chunks_logits(wl, zero)) / (tp if megatron else 1),
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
    return k - (2 * m.active_params - 2 * k * wl.adapter_params) / forward_flops_per_token(m, ctx)


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
        tensor_parallel: tuple[int, ...] | None = None,
        expert_parallel: tuple[int, ...] | None = None,
    ):
        """``layouts``: "trainer" plans what StreamRL's trainer runs, ZeRO data parallel (PP1) with
        DeepSpeed AutoTP tensor parallelism inside a node (not for LoRA or a mixture of experts) or
        Ulysses sequence parallelism, and activation checkpointing on or off; "megatron" TP within a node
        and PP, always with checkpointing and without Ulysses, as the paper's trainer ran (for
        reproducing its measurements, never for a recipe). Both try expert-parallel degrees for a
        mixture of experts (``expert_parallel`` pins them). A recipe that sets
        roles.trainer.sequence_parallel above 1 or activation_checkpointing on fixes it;
        ``sequence_parallel``, ``tensor_parallel`` and ``checkpointing`` pin the degrees and settings
        tried (what-ifs)."""
        self.cm, self.hw, self.wl = cm, hw, wl
        m = wl.model
        self.megatron = layouts != "trainer"
        self.eps = expert_parallel_degrees(m)
        if layouts == "trainer":
            # AutoTP splits neither PEFT's adapter layers nor a mixture of experts (recipe.checks).
            autotp = not wl.lora and not m.moe
            self.tps = [tp for tp in TRAINER_TPS if tp_allowed(m, hw, tp) and (tp == 1 or autotp)]
            self.pps = list(TRAINER_PPS)
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
        if tensor_parallel is not None:
            self.tps = [tp for tp in tensor_parallel if tp_allowed(m, hw, tp)]
        if expert_parallel is not None:
            self.eps = [ep for ep in expert_parallel if ep in expert_parallel_degrees(m)]
        if checkpointing is not None:
            self.checkpointing = list(checkpointing)
        self._best = lru_cache(maxsize=None)(lambda g: self._best_uncached(g, lambda p: p.time_s))
        self._front = lru_cache(maxsize=None)(self._pareto)

    def memory_parts(
        self,
        tp: int,
        pp: int,
        dp: int,
        zero: int,
        offload: bool,
        sp: int = 1,
        checkpointing: bool = True,
        ep: int = 1,
    ) -> dict[str, float]:
        return memory_parts(self.wl, tp, pp, dp, zero, offload, sp, checkpointing, ep, megatron=self.megatron)

    def memory_bytes(
        self,
        tp: int,
        pp: int,
        dp: int,
        zero: int,
        offload: bool,
        sp: int = 1,
        checkpointing: bool = True,
        ep: int = 1,
    ) -> float:
        return sum(self.memory_parts(tp, pp, dp, zero, offload, sp, checkpointing, ep).values())

    def full_memory_bytes(
        self,
        tp: int,
        pp: int,
        dp: int,
        zero: int,
        offload: bool,
        sp: int = 1,
        checkpointing: bool = True,
        ep: int = 1,
    ) -> float:
        """The same layout training every weight: what LoRA saves is the difference."""
        parts = memory_parts(
            full_finetune(self.wl), tp, pp, dp, zero, offload, sp, checkpointing, ep, megatron=self.megatron
        )
        return sum(parts.values())

    def runs(self, tp: int, zero: int, sp: int) -> bool:
        """Whether the trainer runs this combination: AutoTP (TP > 1) not beside Ulysses (the
        "megatron" layouts, the paper's trainer, have no Ulysses)."""
        return self.megatron or tp == 1 or sp == 1

    def plan(
        self,
        tp: int,
        pp: int,
        dp: int,
        zero: int,
        offload: bool,
        sp: int = 1,
        checkpointing: bool = True,
        ep: int = 1,
    ) -> TrainPlan | None:
        """The layout's time, or None if it does not fit in memory (or the trainer does not run it).
        ``dp``: data-parallel replicas, each an SP group of ``sp`` × TP × PP GPUs; ``ep``: the
        expert-parallel degree, dividing the dp × sp data-parallel ranks."""
        cm, hw, wl, m = self.cm, self.hw, self.wl, self.wl.model
        if not self.runs(tp, zero, sp) or (dp * sp) % ep or (ep > 1 and not m.moe):
            return None
        parts = self.memory_parts(tp, pp, dp, zero, offload, sp, checkpointing, ep)
        mem = sum(parts.values())
        if mem > hw.usable_bytes:
            return None
        gpus = tp * pp * sp * dp
        ranks = dp * sp  # ZeRO's partitions
        expert_ranks = ranks // ep  # ... of the routed experts
        sh = shards(wl, tp, pp, ep)
        trainable = sh.trainable_dense + sh.trainable_expert * ep  # all trained weights of a TP×PP rank
        b = m.dtype_bytes
        # Collectives per layer run once in each forward, recomputation and backward of a trained
        # model and in each frozen forward.
        collective_passes = wl.trained_models * (2 + int(checkpointing)) + wl.frozen_forwards
        passes = train_passes(wl, wl.attention_ctx, checkpointing)
        replica_tokens = wl.tokens / dp
        micro = max(1, math.ceil(replica_tokens / wl.micro_tokens))
        compute = cm.train_compute_s(hw, m, replica_tokens, passes, wl.attention_ctx, micro, tp * pp * sp)
        # One lone micro-batch (the last sample) crosses the stages one after another: PP does not
        # shorten it, only TP and SP do.
        last_sample = compute * min(1.0, wl.max_seq / replica_tokens) * pp
        compute *= 1 + (pp - 1) / micro  # 1F1B pipeline fill and drain
        if tp > 1:
            # Per micro-batch: 2 all-reduces per layer (after attention, after the MLP) in each
            # forward, recomputation and backward, of the rank's T / SP tokens × hidden activations;
            # a ring all-reduce sends 2 (TP − 1) / TP of them, over NVLink (TP stays in a node).
            msg = wl.micro_tokens / sp * m.hidden * b * 2 * (tp - 1) / tp
            per_collective = hw.collective_s + msg / (hw.nvlink_bw * hw.eff.comm)
            tp_comm = collective_passes * 2 * (m.layers / pp) * per_collective
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
        if ep > 1:
            # Per micro-batch and MoE layer, in each forward, recomputation and backward: 2 all-to-alls
            # among the EP group's ranks, the rank's T / SP tokens sent to their k experts (dispatch)
            # and their outputs back (combine), k · h elements per token each, (EP − 1) / EP of it
            # leaving the rank; over NVLink while the group (EP consecutive data-parallel ranks, each
            # TP × SP GPUs apart) fits in a node.
            volume = 2 * m.experts_per_token * m.hidden * wl.micro_tokens / sp * b * (ep - 1) / ep
            intra = ep * tp * sp <= hw.gpus_per_node and hw.nvlink_bw > 0
            bw = (hw.nvlink_bw if intra else hw.internode_bw) * hw.eff.comm
            ep_comm = collective_passes * (m.moe_layers / pp) * (2 * hw.collective_s + volume / bw)
            compute += micro * ep_comm
            last_sample += ep_comm * pp
        link = hw.internode_bw if gpus > hw.gpus_per_node or hw.nvlink_bw == 0 else hw.nvlink_bw
        dp_bw = link * hw.eff.comm
        ring = (ranks - 1) / ranks
        expert_ring = (expert_ranks - 1) / expert_ranks
        # One model's weights on this rank before ZeRO: dense ÷ TP·PP, experts ÷ TP·PP·EP.
        sets = wl.trained_models + wl.reference_copies
        dense_shard = (sh.weights_dense - wl.adapter_params / (tp * pp)) / max(1, sets)
        expert_shard = sh.weights_expert / max(1, sets)
        if zero == 3 and ranks > 1:
            # Per micro-batch: gather each trained model's shard for forward, recompute and backward,
            # reduce-scatter its gradients (with LoRA the adapters' only); gather the frozen weights
            # for their forwards (with LoRA the reference's are the actor's base again). Every rank
            # of an SP group gathers for the micro-batch it shares. The routed experts are gathered
            # among the ranks / EP that hold the same experts: EP divides what is gathered.
            dense = collective_passes * dense_shard + sh.trainable_dense
            experts = collective_passes * expert_shard + sh.trainable_expert
            gathers = micro * (dense * ring + experts * expert_ring) * b / dp_bw
            compute = max(compute, gathers)
            grad_sync = 0.0
        else:
            grad_sync = 2 * (sh.trainable_dense * ring + sh.trainable_expert * expert_ring) * b / dp_bw
        opt_shard = trainable / ranks
        states = m.optimizer_bytes_per_param + 2 * b
        if offload:
            step = opt_shard * (2 * states / hw.host_bw + 2 * b / hw.pcie_bw)
        else:
            step = opt_shard * 2 * states / hw.hbm_bw
        full = self.full_memory_bytes(tp, pp, dp, zero, offload, sp, checkpointing, ep) if wl.lora else mem
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
            ep=ep,
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
            if gpus % (tp * pp * sp) == 0 and (self.megatron or tp == 1 or sp == 1)  # AutoTP: no Ulysses
        ]

    def _plans(self, gpus: int) -> list[TrainPlan]:
        return [
            p
            for tp, pp, sp, dp in self.layouts(gpus)
            for ep in self.eps
            if (dp * sp) % ep == 0
            for zero in ZERO_STAGES
            if self.runs(tp, zero, sp)
            for offload in (False, True)
            for ckpt in self.checkpointing
            if (p := self.plan(tp, pp, dp, zero, offload, sp, ckpt, ep)) is not None
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
