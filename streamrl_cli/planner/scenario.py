"""Simulator set-ups from the planner's choices, so the simulator checks what tune-split says.

`from_option` turns an allocation (generation plan + training plan) into a simulated run with
the same decode-step curve, KV-bounded batch, trainer throughput, optimizer step and weight
transfer; `colocated` gives the paper's verl-style baseline on the same pool (every GPU
generates, then every GPU trains); `with_ptl` swaps in a measured PTL curve (the paper's 7B one).
"""

from __future__ import annotations

import dataclasses

from streamrl_cli.planner.generation import GenPlan, running_ctx
from streamrl_cli.planner.iteration import engine_swap_s
from streamrl_cli.planner.search import Option, Planner, Pool
from streamrl_cli.planner.simulator import SimConfig
from streamrl_cli.planner.training import TrainPlan


def ptl_curve(planner: Planner, pool: Pool, gen: GenPlan) -> tuple[tuple[float, float], ...]:
    """The cost model's decode step at batch sizes 1, 2, 4, … up to the instance's max batch."""
    hw, wl = planner.spec(pool), planner.wl
    sizes, b = [], 1
    while b < gen.max_batch:
        sizes.append(b)
        b *= 2
    sizes.append(gen.max_batch)
    ctx = running_ctx(wl)
    return tuple((float(s), planner.cm.decode_step_s(hw, wl.model, gen.tp, s, ctx)) for s in sizes)


def _config(
    planner: Planner,
    gpool: Pool,
    gen: GenPlan,
    train: TrainPlan,
    sync_s: float,
    swap_s: float,
    mode: str,
    **kw: object,
) -> SimConfig:
    wl, hw = planner.wl, planner.spec(gpool)
    return SimConfig(
        mode=mode,
        prompts=wl.prompts,
        group_size=wl.group_size,
        lengths=wl.lengths,
        prompt_len=wl.prompt_len,
        instances=gen.instances,
        max_batch=gen.max_batch,
        ptl=ptl_curve(planner, gpool, gen),
        prefill_s_per_token=planner.cm.prefill_s(hw, wl.model, gen.tp, 1.0),
        train_s_per_token=train.compute_s / wl.tokens,
        sample_s_per_token=train.last_sample_s / wl.max_seq,
        optimizer_s=train.optimizer_s,
        sync_s=sync_s,
        swap_s=swap_s,
        train_chunk_tokens=float(train.dp * wl.max_seq),
        staleness=wl.staleness,
        **kw,  # type: ignore[arg-type]
    )


def from_option(planner: Planner, option: Option, mode: str, **kw: object) -> SimConfig:
    """Simulate `option` in `mode` (baseline, sync-stream or async)."""
    e = option.estimate
    return _config(planner, option.gen_pool, option.gen, option.train, e.weight_sync_s, e.swap_s, mode, **kw)


def colocated(planner: Planner, pool: Pool, **kw: object) -> SimConfig:
    """Every GPU of `pool` generates, then every GPU trains (weights stay in place)."""
    gen, train = planner.gen_model(pool).best(pool.gpus), planner.train_model(pool).best(pool.gpus)
    if gen is None or train is None:
        raise ValueError(f"the model does not fit {pool.gpus} {pool.kind} GPUs colocated")
    hw = planner.spec(pool)
    # Switching stages offloads one role's weights and states to host memory and loads the other's.
    per_gpu = planner.wl.model.weight_bytes / gen.tp
    swap = engine_swap_s(planner.wl.version_bytes, gen, hw)
    cfg = _config(planner, pool, gen, train, 0.0, swap, "colocated", **kw)
    return dataclasses.replace(cfg, switch_s=2 * per_gpu / hw.pcie_bw)


def with_ptl(cfg: SimConfig, points_ms: tuple[tuple[float, float], ...]) -> SimConfig:
    """`cfg` with a measured PTL(BS) curve given in milliseconds (e.g. the paper's)."""
    return dataclasses.replace(cfg, ptl=tuple((float(b), ms / 1e3) for b, ms in points_ms))
