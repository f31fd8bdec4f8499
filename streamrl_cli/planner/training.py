"""P_train(y): time to train on one iteration's samples on y GPUs, with the best parallelism.

For every TP × PP × DP layout of y GPUs (TP inside a node, PP dividing the layers), every ZeRO
stage (1–3) and optionally ZeRO-Offload of the optimizer states, check that it fits in memory
and estimate its time; keep the fastest. What is counted, and why:

- work, in forward-equivalents (F = forward FLOPs per token, costmodel.forward_flops_per_token:
  2·N for N weights, plus attention): the usual rule puts a forward at 2·N·tokens FLOPs and a
  backward at about 4·N·tokens, half of it activation gradients, half weight gradients; so a
  trained model costs 3, +1 for activation recomputation (which long sequences need). PPO trains
  actor and critic; GRPO, RLOO, REINFORCE++ and the other critic-free algorithms the actor only.
  Frozen forwards: the reference's log-probs when the loss has a KL term (algorithm.kl_coef ≠ 0
  and kl_mode ≠ none: DAPO's preset has none), and PPO's critic values. The policy loss (clip,
  GSPO, CISPO), the advantage estimator other than GAE, and importance sampling cost nothing more:
  they reuse the actor's one forward. Micro-batches are packed to one maximum-length sequence of
  tokens (sequences up to 21K tokens make sample counts meaningless as a memory bound).
- LoRA (``model.lora``, trainer.role.lora): the actor's frozen weights need no weight gradient. Of its
  4 forward-equivalents the frozen weights' gradient GEMMs go (2·N per token: one forward's dense
  FLOPs); the activation gradients still flow back through every base layer, attention's backward
  and the recomputation stay, and the N_a adapter weights add their own forward, recomputation and
  backward (4 × 2·N_a per token). So the actor costs 4 − (2·N − 8·N_a) / F forward-equivalents:
  close to 3 while the dense GEMMs dominate F. PPO's critic still trains in full.
- memory per GPU: weights + gradients + Adam states of each trained model (sharded by TP×PP,
  and by DP as far as the ZeRO stage goes; optimizer states off the GPU with offload), the
  frozen reference (with a KL term), activation checkpoints of the in-flight micro-batches. With
  LoRA the actor's base stays in the compute dtype, with the adapters beside it; gradients and
  Adam states (and ZeRO's fp32 masters) are the adapters' only; there is no reference copy (the
  base with its adapters switched off serves as the reference: its forward stays, its memory
  goes); activations are a full fine-tune's (the backward runs through the same layers).
- time: compute at the cost model's efficiency, TP all-reduces (4 per layer per forward+backward),
  the pipeline bubble, ZeRO-3 parameter gathers (overlapped with compute: DeepSpeed prefetches),
  and once per iteration the gradient reduction and the optimizer step (on the host with offload).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

from streamrl_cli.planner.costmodel import CostModel, forward_flops_per_token
from streamrl_cli.planner.hardware import GPUSpec
from streamrl_cli.planner.workload import Workload

MAX_PP = 16
TRAINER_TPS = (1,)  # tensor-parallel degrees the trainer runs
TRAINER_PPS = (1,)  # pipeline-parallel degrees the trainer runs
ZERO_STAGES = (1, 2, 3)
ACTIVATION_LAYERS_EXTRA = 16  # one layer's full working set, in units of a layer-boundary checkpoint


@dataclass(frozen=True)
class TrainPlan:
    """The training stage on `gpus` GPUs of one kind."""

    hardware: str
    gpus: int
    tp: int
    pp: int
    dp: int
    zero: int
    offload: bool  # optimizer states in host memory
    compute_s: float  # forward/backward over the iteration's tokens (streamable, per micro-batch)
    optimizer_s: float  # once per iteration after the last micro-batch: gradient reduction + step
    memory_gb: float  # per GPU
    micro_batches: int  # per data-parallel replica
    last_sample_s: float  # training a maximum-length sample once it has arrived
    full_memory_gb: float  # per GPU, the same layout training every weight (= memory_gb without LoRA)

    @property
    def time_s(self) -> float:
        return self.compute_s + self.optimizer_s

    @property
    def layout(self) -> str:
        off = "+offload" if self.offload else ""
        return f"TP{self.tp} PP{self.pp} DP{self.dp} Z{self.zero}{off}"


def full_finetune(wl: Workload) -> Workload:
    """``wl`` training every weight of the actor (LoRA off)."""
    return dataclasses.replace(wl, lora_rank=0, lora_targets=()) if wl.lora else wl


def memory_parts(wl: Workload, tp: int, pp: int, dp: int, zero: int, offload: bool) -> dict[str, float]:
    """Bytes per GPU of one layout, by what holds them (see the module's docstring)."""
    m, b, split = wl.model, wl.model.dtype_bytes, tp * pp
    shard = m.params / split  # one model's weights on one TP×PP rank
    trainable = (wl.actor_trainable + (m.params if wl.critic else 0)) / split
    models = wl.trained_models + wl.reference_copies  # full-size weight sets
    return {
        "weights": b * (models * shard + wl.adapter_params / split) / (dp if zero >= 3 else 1),
        "gradients": b * trainable / (dp if zero >= 2 else 1),
        "optimizer": 0.0 if offload else m.optimizer_bytes_per_param * trainable / dp,
        # Checkpoints at layer boundaries for the micro-batches a 1F1B pipeline keeps in flight
        # (about one per stage: `layers` in total) plus one layer's working set; sequence-parallel
        # TP splits them.
        "activations": wl.max_seq * m.hidden * b * (m.layers + ACTIVATION_LAYERS_EXTRA) / tp,
    }


def actor_passes(wl: Workload, ctx: float) -> float:
    """Forward-equivalents the actor costs per token: 4 (forward, recomputation, backward = 2), and
    with LoRA 4 − (2·N − 8·N_a) / F: no weight gradients of the frozen base, the adapters' own work."""
    if not wl.lora:
        return 4.0
    m = wl.model
    return 4.0 - (2 * m.params - 8 * wl.adapter_params) / forward_flops_per_token(m, ctx)


def train_passes(wl: Workload, ctx: float) -> float:
    """Forward-equivalents per token of one iteration: actor, critic (PPO), frozen forwards."""
    return actor_passes(wl, ctx) + 4 * int(wl.critic) + wl.frozen_forwards


class TrainingModel:
    """P_train for one hardware kind and workload; plans are memoised."""

    def __init__(self, cm: CostModel, hw: GPUSpec, wl: Workload, layouts: str = "trainer"):
        """``layouts``: "trainer" plans only what StreamRL's trainer runs, ZeRO data parallel (TP1
        PP1); "megatron" also TP within a node and PP, as the paper's trainer ran (for reproducing
        its measurements, never for a recipe)."""
        self.cm, self.hw, self.wl = cm, hw, wl
        m = wl.model
        if layouts == "trainer":
            self.tps, self.pps = list(TRAINER_TPS), list(TRAINER_PPS)
        else:
            self.tps = [
                tp
                for tp in (1, 2, 4, 8, 16)
                if tp <= hw.gpus_per_node and m.heads % tp == 0 and (tp == 1 or hw.nvlink_bw > 0)
            ]
            self.pps = [pp for pp in range(1, min(MAX_PP, m.layers) + 1) if m.layers % pp == 0]
        self._best = lru_cache(maxsize=None)(lambda g: self._best_uncached(g, lambda p: p.time_s))
        self._front = lru_cache(maxsize=None)(self._pareto)

    def memory_bytes(self, tp: int, pp: int, dp: int, zero: int, offload: bool) -> float:
        return sum(memory_parts(self.wl, tp, pp, dp, zero, offload).values())

    def full_memory_bytes(self, tp: int, pp: int, dp: int, zero: int, offload: bool) -> float:
        """The same layout training every weight: what LoRA saves is the difference."""
        return sum(memory_parts(full_finetune(self.wl), tp, pp, dp, zero, offload).values())

    def plan(self, tp: int, pp: int, dp: int, zero: int, offload: bool) -> TrainPlan | None:
        """The layout's time, or None if it does not fit in memory."""
        cm, hw, wl, m = self.cm, self.hw, self.wl, self.wl.model
        mem = self.memory_bytes(tp, pp, dp, zero, offload)
        if mem > hw.usable_bytes:
            return None
        gpus = tp * pp * dp
        shard = m.params / (tp * pp)
        trainable = (wl.actor_trainable + (m.params if wl.critic else 0)) / (tp * pp)
        b = m.dtype_bytes
        passes = train_passes(wl, wl.attention_ctx)
        replica_tokens = wl.tokens / dp
        micro = max(1, math.ceil(replica_tokens / wl.max_seq))
        compute = cm.train_compute_s(hw, m, replica_tokens, passes, wl.attention_ctx, micro, tp * pp)
        # One lone micro-batch (the last sample) crosses the stages one after another: PP does not
        # shorten it, only TP does.
        last_sample = compute * min(1.0, wl.max_seq / replica_tokens) * pp
        compute *= 1 + (pp - 1) / micro  # 1F1B pipeline fill and drain
        if tp > 1:
            msg = wl.max_seq * m.hidden * b * 2 * (tp - 1) / tp
            per_collective = hw.collective_s + msg / (hw.nvlink_bw * hw.eff.comm)
            tp_comm = passes * 2 * (m.layers / pp) * per_collective
            compute += micro * tp_comm
            last_sample += tp_comm * pp
        link = hw.internode_bw if gpus > hw.gpus_per_node or hw.nvlink_bw == 0 else hw.nvlink_bw
        dp_bw = link * hw.eff.comm
        ring = (dp - 1) / dp
        if zero == 3 and dp > 1:
            # Per micro-batch: gather each trained model's shard for forward, recompute and backward,
            # reduce-scatter its gradients (with LoRA the adapters' only); gather the frozen weights
            # for their forwards (with LoRA the reference's are the actor's base again).
            gathered = (wl.trained_models * 3 + wl.frozen_forwards) * shard + trainable
            gathers = micro * gathered * b * ring / dp_bw
            compute = max(compute, gathers)
            grad_sync = 0.0
        else:
            grad_sync = 2 * trainable * b * ring / dp_bw
        opt_shard = trainable / dp
        states = m.optimizer_bytes_per_param + 2 * b
        if offload:
            step = opt_shard * (2 * states / hw.host_bw + 2 * b / hw.pcie_bw)
        else:
            step = opt_shard * 2 * states / hw.hbm_bw
        full = self.full_memory_bytes(tp, pp, dp, zero, offload) if wl.lora else mem
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
        )

    def layouts(self, gpus: int) -> list[tuple[int, int, int]]:
        return [(tp, pp, gpus // (tp * pp)) for tp in self.tps for pp in self.pps if gpus % (tp * pp) == 0]

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
        plans = [
            p
            for tp, pp, dp in self.layouts(gpus)
            for zero in ZERO_STAGES
            for offload in (False, True)
            if (p := self.plan(tp, pp, dp, zero, offload)) is not None
        ]
        front: list[TrainPlan] = []
        for p in sorted(plans, key=lambda p: (p.time_s, p.last_sample_s)):
            if not front or p.last_sample_s < front[-1].last_sample_s:
                front.append(p)
        return front

    def _best_uncached(self, gpus: int, key: Callable[[TrainPlan], float]) -> TrainPlan | None:
        best: TrainPlan | None = None
        for tp, pp, dp in self.layouts(gpus):
            for zero in ZERO_STAGES:
                for offload in (False, True):
                    p = self.plan(tp, pp, dp, zero, offload)
                    if p is not None and (best is None or key(p) < key(best)):
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
