"""P_gen(x): time to generate one iteration's samples on x GPUs, with the best TP per instance.

A generator instance is one engine on a TP group of `tp` GPUs; x GPUs hold x // tp instances and
the iteration's prompts are spread evenly over them (a GRPO group stays on one instance). The
KV cache bounds an instance's running batch (`max_batch`). Per instance, with n samples:

    bulk : while more than max_batch samples remain, the batch stays full:
           (n − B) · E[L] / B  steps of PTL(B)
    drain: then the last m = min(n, B) samples run together and finish by length; after k
           decode steps m · P(L > k) of them are still running, and the instance holding the
           iteration's longest sample runs until its expected maximum:
           Σ_k PTL(max(1, m · P(L > k)), ctx = prompt + k)

This is the StreamRL paper's `latency = PTL(BS) × L` with the batch shrinking as samples finish,
and it shows why the long tail dominates: after the body of the distribution has finished, a few
long samples decode at PTL(≈1) for thousands of steps. Adding instances barely shortens that;
a larger TP degree (lower PTL(1)) does. The same walk gives the arrival curve of finished
tokens, which the streaming trainer consumes (planner.iteration).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from streamrl_cli.planner.costmodel import CostModel
from streamrl_cli.planner.hardware import GPUSpec
from streamrl_cli.planner.workload import ModelShape, Workload

MAX_BATCH_CAP = 512  # the engine's max_num_seqs: the paper's PTL curve stops at 512 too
DRAIN_POINTS = 48  # integration steps over the drain phase
TP_DEGREES = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class GenPlan:
    """The generation stage on `gpus` GPUs of one kind."""

    hardware: str
    gpus: int  # GPUs used: instances × tp
    tp: int  # tensor-parallel degree of one instance
    instances: int
    max_batch: int  # running sequences per instance the KV cache allows
    per_instance: int  # samples per instance per iteration
    time_s: float  # makespan of the iteration's generation
    prefill_s: float
    ptl_full_s: float  # decode step at the starting batch
    ptl_tail_s: float  # decode step of a lone long sample
    arrival: tuple[tuple[float, float], ...]  # (seconds, fraction of the iteration's tokens done)


def tp_options(hw: GPUSpec, model: ModelShape) -> list[int]:
    """TP degrees an instance may use: inside one node, dividing the heads, with a GPU link."""
    return [
        tp
        for tp in TP_DEGREES
        if tp <= hw.gpus_per_node and model.heads % tp == 0 and (tp == 1 or hw.nvlink_bw > 0)
    ]


def running_ctx(wl: Workload) -> float:
    """Mean context of a running sequence: long samples stay in the batch longer (length bias)."""
    d = wl.lengths
    return wl.prompt_len + d.second_moment / (2 * d.mean)


def max_batch(hw: GPUSpec, wl: Workload, tp: int) -> int:
    """Running sequences whose KV cache fits next to the weights (0: the weights do not fit)."""
    m = wl.model
    free = tp * hw.usable_bytes - m.weight_bytes
    # KV heads are split over TP ranks; beyond the KV head count each rank keeps a copy.
    per_seq = running_ctx(wl) * m.kv_bytes_per_token * max(1.0, tp / m.kv_heads)
    if free <= 0:
        return 0
    return min(MAX_BATCH_CAP, int(free // per_seq))


class GenerationModel:
    """P_gen for one hardware kind and workload; plans are memoised (the search asks often)."""

    def __init__(self, cm: CostModel, hw: GPUSpec, wl: Workload):
        self.cm, self.hw, self.wl = cm, hw, wl
        self.tps = [tp for tp in tp_options(hw, wl.model) if max_batch(hw, wl, tp) >= 1]
        self._batch = {tp: max_batch(hw, wl, tp) for tp in self.tps}
        self._instance = lru_cache(maxsize=None)(self._instance_time)

    def plan(self, tp: int, instances: int) -> GenPlan | None:
        """Generation with `instances` instances of TP `tp` (None if it cannot run)."""
        if tp not in self._batch or instances < 1:
            return None
        wl = self.wl
        instances = min(instances, wl.prompts)  # an instance without a prompt would only idle
        per_instance = math.ceil(wl.prompts / instances) * wl.group_size
        time_s, prefill, ptl_full, ptl_tail, arrival = self._instance(tp, per_instance)
        return GenPlan(
            hardware=self.hw.name,
            gpus=instances * tp,
            tp=tp,
            instances=instances,
            max_batch=self._batch[tp],
            per_instance=per_instance,
            time_s=time_s,
            prefill_s=prefill,
            ptl_full_s=ptl_full,
            ptl_tail_s=ptl_tail,
            arrival=arrival,
        )

    def best(self, gpus: int) -> GenPlan | None:
        """The fastest plan using at most `gpus` GPUs."""
        plans = [self.plan(tp, gpus // tp) for tp in self.tps if gpus >= tp]
        plans = [p for p in plans if p is not None]
        return min(plans, key=lambda p: (p.time_s, p.gpus), default=None)

    def table(self, budget: int) -> list[GenPlan | None]:
        """best-so-far[x] for x = 0..budget: the fastest plan on at most x GPUs (Algorithm 1's P_gen)."""
        out: list[GenPlan | None] = [None] * (budget + 1)
        best: GenPlan | None = None
        for x in range(1, budget + 1):
            for tp in self.tps:
                if x % tp == 0:
                    p = self.plan(tp, x // tp)
                    if p is not None and (best is None or p.time_s < best.time_s):
                        best = p
            out[x] = best
        return out

    def _instance_time(self, tp: int, n: int) -> tuple:
        cm, hw, wl = self.cm, self.hw, self.wl
        d, model = wl.lengths, wl.model
        cap = self._batch[tp]
        m = min(n, cap)
        ptl = cm.decode_step_s
        prefill = cm.prefill_s(hw, model, tp, n * wl.prompt_len)
        bulk = 0.0
        arrival = [(prefill, 0.0)]
        if n > cap:
            bulk = (n - cap) * d.mean / cap * ptl(hw, model, tp, cap, running_ctx(wl))
            arrival.append((prefill + bulk, (n - m) / n))
        lmax = d.expected_max(wl.samples)
        step = lmax / DRAIN_POINTS
        t = prefill + bulk
        for i, (k, surv) in enumerate(d.grid(lmax, DRAIN_POINTS)):
            t += step * ptl(hw, model, tp, max(1.0, m * surv), wl.prompt_len + k)
            done = (n - m) * d.mean + m * (d.mean - d.tokens_above((i + 1) * step))
            arrival.append((t, min(1.0, done / (n * d.mean))))
        arrival[-1] = (t, 1.0)
        ctx0 = wl.prompt_len + d.mean / 2
        return (
            t,
            prefill,
            ptl(hw, model, tp, m, ctx0),
            ptl(hw, model, tp, 1, wl.prompt_len + lmax / 2),
            tuple(arrival),
        )
