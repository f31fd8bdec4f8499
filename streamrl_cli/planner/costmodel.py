"""Cost primitives of one device: a decode step, a prefill, training compute. Two sources.

The planner composes stage times (planner.generation, planner.training) from three primitives,
so that the source of the numbers can change without touching the search:

- :class:`AnalyticCostModel` — a roofline of the hardware spec with efficiency factors, for
  users with no profile. A decode step streams the weight shard and the KV cache from HBM and
  runs the batch's GEMMs (a mixture of experts: the non-expert weights and the distinct experts
  the batch is routed to, ModelShape.decode_weight_bytes, and FLOPs of its active parameters); at
  small batch it is memory- and latency-bound (launches, TP all-reduces: twice per layer), at
  large batch compute-bound. Calibrated on the StreamRL
  paper's 7B/H800 PTL(BS) curve (tests/unit/planner/test_planner_costmodel.py). Training is FLOPs at a
  model-FLOP-utilisation, plus a fixed cost per micro-batch.
- :class:`ProfiledCostModel` — measured curves from `streamrl profile` (decode step time vs
  batch size, training step time vs tokens), interpolated; for hardware/model pairs no profile
  covers, and for a curve a profile lacks (on SLURM the generator's kind is profiled for decoding
  only, the trainer's for training), it falls back to the analytic model, rescaled where it can be
  (same hardware and model, another TP degree: the analytic shape times the measured-to-analytic
  ratio).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence

from streamrl_cli.curves import interpolate, monotone
from streamrl_cli.planner.hardware import GPUSpec
from streamrl_cli.planner.profile import Profile
from streamrl_cli.planner.workload import ModelShape
from streamrl_cli.skew.dispatch_plan import PTL, ptl_from_points


def forward_flops_per_token(model: ModelShape, ctx: float) -> float:
    """FLOPs of one forward pass per token at mean causal context ``ctx``: the GEMMs (2 per weight
    the token goes through: a mixture of experts' active parameters, not its total) plus causal
    attention's scores and weighted sum (4 · layers · heads · head_dim · ctx). Training counts in
    these forward-equivalents (planner.training)."""
    return 2 * model.active_params + 4 * model.layers * model.q_width * ctx


class CostModel(ABC):
    """Seconds for the primitives the planner composes; one interface, several sources."""

    name: str = "?"

    @abstractmethod
    def decode_step_s(self, hw: GPUSpec, model: ModelShape, tp: int, batch: float, ctx: float) -> float:
        """One decode step of ``batch`` running sequences of mean context ``ctx`` on a TP group."""

    @abstractmethod
    def prefill_s(self, hw: GPUSpec, model: ModelShape, tp: int, tokens: float) -> float:
        """Prefill of ``tokens`` prompt tokens on one TP group."""

    @abstractmethod
    def train_compute_s(
        self,
        hw: GPUSpec,
        model: ModelShape,
        tokens: float,
        passes: float,
        ctx: float,
        micro_batches: int,
        shards: int = 1,
    ) -> float:
        """Compute of ``passes`` forward-equivalents over ``tokens`` (mean causal context ``ctx``) on
        one model replica split over ``shards`` = TP×PP devices, in ``micro_batches`` micro-batches;
        communication is the caller's to add."""


class AnalyticCostModel(CostModel):
    """Roofline from the datasheet, discounted by the spec's efficiency factors."""

    name = "analytic"

    def decode_step_s(self, hw: GPUSpec, model: ModelShape, tp: int, batch: float, ctx: float) -> float:
        e = hw.eff
        batch = max(1.0, batch)
        # GEMMs: weights streamed once per step, FLOPs grow with the batch. A hard max() would put
        # a kink at the ridge point; measured curves bend smoothly, so combine in quadrature.
        # A mixture of experts reads only the experts the batch is routed to (decode_weight_bytes).
        weights = model.decode_weight_bytes(batch) / tp / (hw.hbm_bw * e.decode_memory)
        gemm_flops = 2 * model.active_params * batch + 4 * model.layers * model.q_width * ctx * batch
        compute = gemm_flops / tp / (hw.flops * e.decode_compute)
        linear = math.hypot(weights, compute)
        # Attention reads every running sequence's KV cache; KV heads are split over TP ranks
        # (replicated once TP exceeds the KV head count).
        kv_share = max(1 / tp, 1 / model.kv_heads)
        kv = batch * ctx * model.kv_bytes_per_token * kv_share / (hw.hbm_bw * e.decode_memory)
        comm = 0.0
        if tp > 1:
            msg = batch * model.hidden * model.dtype_bytes * 2 * (tp - 1) / tp
            comm = 2 * model.layers * (hw.collective_s + msg / (hw.nvlink_bw * e.comm))
        overhead = e.step_overhead_s + model.layers * e.layer_overhead_s + batch * e.seq_overhead_s
        return overhead + linear + kv + comm

    def prefill_s(self, hw: GPUSpec, model: ModelShape, tp: int, tokens: float) -> float:
        # Prefill is one big GEMM pass: compute-bound at training-like efficiency.
        return 2 * model.active_params * tokens / tp / (hw.flops * hw.eff.train_compute)

    def train_compute_s(
        self,
        hw: GPUSpec,
        model: ModelShape,
        tokens: float,
        passes: float,
        ctx: float,
        micro_batches: int,
        shards: int = 1,
    ) -> float:
        flops = passes * tokens * forward_flops_per_token(model, ctx)
        return (
            flops / (shards * hw.flops * hw.eff.train_compute) + micro_batches * hw.eff.micro_batch_overhead_s
        )


class ProfiledCostModel(CostModel):
    """Interpolates measured profiles; the analytic model covers what was not measured."""

    name = "profiled"

    def __init__(self, profiles: Sequence[Profile], fallback: CostModel | None = None):
        self.profiles = {(p.hardware, p.model): p for p in profiles}
        # A decode step cannot get faster with more sequences: smooth measurement noise away.
        self.decode = {key: monotone(p.decode) for key, p in self.profiles.items()}
        self.fallback = fallback or AnalyticCostModel()

    def covers(self, hw: GPUSpec, model: ModelShape) -> bool:
        return (hw.name, model.name) in self.profiles

    def decode_step_s(self, hw: GPUSpec, model: ModelShape, tp: int, batch: float, ctx: float) -> float:
        p = self.profiles.get((hw.name, model.name))
        if p is None or not p.decode:
            return self.fallback.decode_step_s(hw, model, tp, batch, ctx)
        measured = interpolate(self.decode[(hw.name, model.name)], batch)
        if tp == p.decode_tp:
            return measured
        # Another TP degree on the same hardware: keep the analytic shape, scaled to the measurement.
        at_profiled = self.fallback.decode_step_s(hw, model, p.decode_tp, batch, p.decode_ctx)
        return self.fallback.decode_step_s(hw, model, tp, batch, ctx) * measured / at_profiled

    def prefill_s(self, hw: GPUSpec, model: ModelShape, tp: int, tokens: float) -> float:
        p = self.profiles.get((hw.name, model.name))
        if p is None or p.prefill_s_per_token is None:
            return self.fallback.prefill_s(hw, model, tp, tokens)
        return tokens * p.prefill_s_per_token / tp

    def train_compute_s(
        self,
        hw: GPUSpec,
        model: ModelShape,
        tokens: float,
        passes: float,
        ctx: float,
        micro_batches: int,
        shards: int = 1,
    ) -> float:
        p = self.profiles.get((hw.name, model.name))
        if p is None or len(p.train) < 2:
            return self.fallback.train_compute_s(hw, model, tokens, passes, ctx, micro_batches, shards)
        fixed, per_token = linear_fit(p.train)
        # The profile timed forward + backward (3 forward-equivalents) of one unsharded replica.
        return (micro_batches * fixed + tokens * per_token / shards) * passes / 3


def linear_fit(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope), intercept clamped at 0 (a step cannot take negative time)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    intercept = my - slope * mx
    if intercept < 0:
        slope = sum(x * y for x, y in points) / sum(x * x for x, _ in points)
        intercept = 0.0
    return intercept, slope


def make_cost_model(profiles: Sequence[Profile] = ()) -> CostModel:
    return ProfiledCostModel(profiles) if profiles else AnalyticCostModel()


def ptl_from_profile(profile: Profile) -> PTL:
    """Algorithm 2's PTL from the decode curve of a `streamrl profile` measurement (planner.profile)."""
    if not profile.decode:
        raise ValueError(f"profile of {profile.model} on {profile.hardware} has no decode curve")
    return ptl_from_points(profile.decode)
