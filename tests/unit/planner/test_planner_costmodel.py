"""Cost model: the analytic roofline against the paper's PTL curve, the stage models, profiles."""

from __future__ import annotations

import random
import statistics

import pytest

from streamrl_cli.planner.costmodel import (
    AnalyticCostModel,
    ProfiledCostModel,
    interpolate,
    linear_fit,
    monotone,
)
from streamrl_cli.planner.generation import GenerationModel, max_batch
from streamrl_cli.planner.hardware import load_hardware
from streamrl_cli.planner.lengths import LengthDist
from streamrl_cli.planner.profile import Profile
from streamrl_cli.planner.simulator import PAPER_PTL_7B_H800
from streamrl_cli.planner.training import TrainingModel
from streamrl_cli.planner.workload import ModelShape, Workload, workload_from_recipe
from streamrl_cli.recipe.load import load

HW = load_hardware()
QWEN_7B = ModelShape("qwen2.5-7b", 7.6e9, 28, 3584, 28, 4, 2)
QWEN_72B = ModelShape("qwen2.5-72b", 72.7e9, 80, 8192, 64, 8, 2)


def workload(model: ModelShape, max_len: int = 20480, mode: str = "sync-stream") -> Workload:
    return Workload(
        model=model,
        algorithm="ppo",
        mode=mode,
        prompts=1024,
        group_size=1,
        prompt_len=512,
        max_prompt_len=1024,
        lengths=LengthDist(max_len / 10, max_len),
        micro_batch=8,
    )


@pytest.mark.parametrize("batch,ms", PAPER_PTL_7B_H800)
def test_analytic_decode_step_matches_the_papers_7b_h800_curve(batch, ms):
    # The paper does not give the context of its measurement; 1.5K tokens is a typical reasoning prompt
    # plus some output. Every point within 15%.
    got = AnalyticCostModel().decode_step_s(HW.get("h800"), QWEN_7B, 1, batch, 1500) * 1e3
    assert got == pytest.approx(ms, rel=0.15)


def test_decode_step_grows_with_batch_and_context_and_tp_cuts_the_lone_sample_latency():
    cm, h800 = AnalyticCostModel(), HW.get("h800")
    steps = [cm.decode_step_s(h800, QWEN_72B, 8, b, 4000) for b in (1, 8, 64, 256)]
    assert steps == sorted(steps)
    assert cm.decode_step_s(h800, QWEN_72B, 8, 64, 8000) > cm.decode_step_s(h800, QWEN_72B, 8, 64, 1000)
    assert cm.decode_step_s(h800, QWEN_72B, 8, 1, 4000) < cm.decode_step_s(h800, QWEN_72B, 4, 1, 4000)


def test_h20_decodes_small_batches_faster_than_h800_but_large_ones_slower():
    # More HBM bandwidth, a seventh of the FLOPs: why the paper generates on H20.
    cm = AnalyticCostModel()
    h20, h800 = HW.get("h20"), HW.get("h800")
    assert cm.decode_step_s(h20, QWEN_7B, 1, 8, 2000) < cm.decode_step_s(h800, QWEN_7B, 1, 8, 2000)
    assert cm.decode_step_s(h20, QWEN_7B, 1, 256, 2000) > cm.decode_step_s(h800, QWEN_7B, 1, 256, 2000)


def test_kv_cache_bounds_the_batch():
    h800, wl = HW.get("h800"), workload(QWEN_72B)
    assert 0 < max_batch(h800, wl, 4) < max_batch(h800, wl, 8)
    assert max_batch(h800, workload(QWEN_72B), 1) == 0  # 145 GB of weights on one 80 GB GPU
    assert max_batch(h800, workload(QWEN_7B, 5120), 1) > max_batch(h800, workload(QWEN_7B, 20480), 1)


def test_generation_is_tail_bound_more_gpus_help_little():
    gm = GenerationModel(AnalyticCostModel(), HW.get("h800"), workload(QWEN_72B))
    g64, g128 = gm.best(64), gm.best(128)
    assert g128.time_s < g64.time_s < 1.1 * g128.time_s
    # The longest sample alone takes its length times the lone-sample step, a floor for any count.
    assert g128.time_s > 0.9 * 20480 * g128.ptl_tail_s
    assert g64.arrival[-1] == (g64.time_s, 1.0)
    assert all(a[0] <= b[0] and a[1] <= b[1] for a, b in zip(g64.arrival, g64.arrival[1:], strict=False))


def test_training_layouts_respect_memory_and_scale():
    tm = TrainingModel(AnalyticCostModel(), HW.get("h800"), workload(QWEN_72B), layouts="megatron")
    assert tm.best(8) is None  # actor, critic, reference and Adam states of 72B do not fit 8 GPUs
    p16, p64 = tm.best(16), tm.best(64)
    assert p16 is not None and p16.memory_gb <= HW.get("h800").usable_bytes / 1e9
    assert p64.time_s < p16.time_s / 3
    # ZeRO stages shard more as they go up; offload takes the optimizer states off the GPU.
    mems = [tm.memory_bytes(8, 1, 8, z, False) for z in (1, 2, 3)]
    assert mems == sorted(mems, reverse=True)
    assert tm.memory_bytes(8, 1, 8, 1, True) < tm.memory_bytes(8, 1, 8, 1, False)


def test_workload_from_recipe_uses_the_length_distribution_fields():
    r = load("paper/qwen2.5-32b-grpo", ["task.output_len_mode=3000", "task.output_len_tail=0.1"]).recipe
    wl = workload_from_recipe(r)
    assert wl.samples == 128 * 8 and wl.trained_models == 1 and wl.frozen_forwards == 1
    assert wl.lengths.mode == 3000 and wl.lengths.tail == 0.1 and wl.lengths.max_len == 20480
    assert workload_from_recipe(load("paper/qwen2.5-32b-ppo").recipe).lengths.mode == 2048


def test_length_distribution_moments_match_samples():
    d = LengthDist(2048, 20480)
    xs = d.sample(random.Random(0), 40000)
    assert statistics.mean(xs) == pytest.approx(d.mean, rel=0.02)
    assert statistics.mean(x * x for x in xs) == pytest.approx(d.second_moment, rel=0.03)
    assert sorted(xs)[20000] == pytest.approx(d.quantile(0.5), rel=0.03)
    assert max(xs) <= 20480 and min(xs) >= 1
    # Mode near 2K: the densest 512-token bin is the one around it; a flat tail reaches 20K.
    bins = [sum(1 for x in xs if lo <= x < lo + 512) for lo in range(0, 20480, 512)]
    assert 1024 <= 512 * bins.index(max(bins)) <= 2560
    assert d.survival(15000) > 0.05 and d.expected_max(1024) > 20000
    assert d.tokens_above(0) == pytest.approx(d.mean) and d.tokens_above(20480) == 0


def test_interpolation_monotone_fit_and_linear_fit():
    pts = [(1, 2.0), (4, 5.0)]
    assert interpolate(pts, 0.5) == 2.0 and interpolate(pts, 2) == 3.0 and interpolate(pts, 7) == 8.0
    assert monotone([(1, 3.0), (2, 1.0), (4, 5.0)]) == [(1, 2.0), (2, 2.0), (4, 5.0)]
    assert linear_fit([(0, 1.0), (1, 3.0), (2, 5.0)]) == pytest.approx((1.0, 2.0))
    assert linear_fit([(1, 1.0), (2, 1.5)])[0] >= 0  # never a negative fixed cost


def test_profiled_model_interpolates_covered_pairs_and_falls_back_otherwise():
    prof = Profile(
        hardware="h800",
        model="qwen2.5-7b",
        decode=((1, 0.010), (16, 0.012), (64, 0.020)),
        decode_ctx=1500,
        train=((1000, 1.0), (2000, 1.9)),
        prefill_s_per_token=1e-5,
    )
    cm, analytic, h800 = ProfiledCostModel([prof]), AnalyticCostModel(), HW.get("h800")
    assert cm.decode_step_s(h800, QWEN_7B, 1, 16, 1500) == pytest.approx(0.012)
    assert cm.decode_step_s(h800, QWEN_7B, 1, 40, 1500) == pytest.approx(0.016)
    # TP2 was not measured: the analytic shape scaled by measured / analytic at TP1.
    ratio = 0.012 / analytic.decode_step_s(h800, QWEN_7B, 1, 16, 1500)
    assert cm.decode_step_s(h800, QWEN_7B, 2, 16, 1500) == pytest.approx(
        ratio * analytic.decode_step_s(h800, QWEN_7B, 2, 16, 1500)
    )
    # Training: 0.1 s per step + 0.9 ms per token for 3 forward-equivalents.
    assert cm.train_compute_s(h800, QWEN_7B, 4000, 3, 1000, 2) == pytest.approx(2 * 0.1 + 4000 * 0.0009)
    assert cm.prefill_s(h800, QWEN_7B, 1, 100) == pytest.approx(1e-3)
    # Not covered: another model, or another kind.
    for hw, model in ((h800, QWEN_72B), (HW.get("h20"), QWEN_7B)):
        assert cm.decode_step_s(hw, model, 8, 4, 900) == analytic.decode_step_s(hw, model, 8, 4, 900)
