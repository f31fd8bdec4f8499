"""Elastic generators: the rule against fixed splits in the simulator.

**Simulator** (the paper's 7B PPO setup on H800, its measured PTL(BS) curve, async mode, trainer
fixed at the 16 GPUs tune-split recommends for 32 H800): output lengths grow over training, as the
paper reports — the length cap goes 4K → 8K → 12K → 16K → 20K over five phases of eight
iterations (the most common length a tenth of the cap). Every fixed generator count n ∈ 2..24
runs the whole schedule; the elastic rule (``streamrl_cli.elastic.policy``, min 2, max 24,
patience 1, cooldown 1) starts at 4 instances and decides after each iteration from what it
measured (T_gen, T_train, the generators' idle share, and the longest sample's decoding as the part
more instances cannot shorten). A decision takes effect from the next iteration (a new 7B instance
starts within one iteration here: 40 s and more). Reported: total time and GPU-hours of each, the
elastic run's time relative to the fastest fixed split chosen in hindsight (target: within 10%)
and the GPU-hours it saves against it. 3 seeds.

    .venv/bin/python bench/elastic_scale.py
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from functools import cache

from rich.console import Console
from rich.table import Table

from streamrl_cli.elastic.policy import HOLD, ElasticPolicy, Observation
from streamrl_cli.recipe.schema import ElasticConfig

console = Console(width=150)

CAPS = (4096, 8192, 12288, 16384, 20480)  # the length cap of each phase
PER_PHASE = 8
FIXED = tuple(range(2, 25, 2))
ELASTIC = ElasticConfig(enabled=True, min=2, max=24, patience=1, cooldown=1, idle_release=0.5)
START = 4
SEEDS = (0, 1, 2)


def base_config():  # type: ignore[no-untyped-def]
    from streamrl_cli.planner import scenario
    from streamrl_cli.planner.costmodel import AnalyticCostModel
    from streamrl_cli.planner.hardware import load_hardware
    from streamrl_cli.planner.search import Planner, Pool
    from streamrl_cli.planner.simulator import PAPER_PTL_7B_H800
    from streamrl_cli.planner.workload import workload_from_recipe
    from streamrl_cli.recipe.load import load

    wl = workload_from_recipe(load("paper/qwen2.5-7b-ppo").recipe)
    planner = Planner(wl, load_hardware(), AnalyticCostModel())
    best = planner.search([Pool("h800", "h800", 32)]).recommended
    cfg = scenario.from_option(planner, best, "async", dispatch="skewness")
    return scenario.with_ptl(cfg, PAPER_PTL_7B_H800), best


CFG, BEST = base_config()


@cache
def phase(n: int, cap: int, seed: int) -> dict[str, float]:
    """One instance count on one phase's lengths: steady-state iteration time and what the rule sees."""
    from streamrl_cli.planner.simulator import simulate

    lengths = dataclasses.replace(CFG.lengths, mode=cap / 10, max_len=cap)
    cfg = dataclasses.replace(CFG, instances=n, iterations=3, lengths=lengths, seed=seed)
    r = simulate(cfg)
    t_train = statistics.fmean(t.tokens * cfg.train_s_per_token + cfg.optimizer_s for t in r.iterations)
    # The longest of the batch's samples decodes alone at the end (the tail's small batch).
    floor = lengths.quantile(1 - 1 / (cfg.prompts * cfg.group_size)) * cfg.step_s(1)
    return {
        "iteration_s": r.iteration_s, "t_gen": r.generation_s, "t_train": t_train,
        "idle": 1 - r.generator_busy, "floor": floor,
    }  # fmt: skip


def schedule() -> list[int]:
    return [cap for cap in CAPS for _ in range(PER_PHASE)]


def gpu_hours(seconds: list[float], instances: list[int]) -> float:
    per_instance = BEST.gen.tp
    return (
        sum(s * (n * per_instance + BEST.train.gpus) for s, n in zip(seconds, instances, strict=True)) / 3600
    )


def fixed_run(n: int, seed: int) -> tuple[float, float]:
    secs = [phase(n, cap, seed)["iteration_s"] for cap in schedule()]
    return sum(secs), gpu_hours(secs, [n] * len(secs))


def elastic_run(seed: int) -> tuple[float, float, list[int]]:
    policy = ElasticPolicy(config=ELASTIC)
    n, secs, used = START, [], []
    for i, cap in enumerate(schedule()):
        m = phase(n, cap, seed)
        secs.append(m["iteration_s"])
        used.append(n)
        d = policy.observe(
            Observation(iteration=i, instances=n, t_gen=m["t_gen"], t_train=m["t_train"],
                        generator_idle=m["idle"], t_floor=m["floor"])
        )  # fmt: skip
        if d.action != HOLD:
            n = d.target
    return sum(secs), gpu_hours(secs, used), used


def simulator_part() -> dict[str, float]:
    console.print(
        f"7B PPO, trainer {BEST.train.gpus} H800 ({BEST.train.layout}), generator instances TP{BEST.gen.tp}; "
        f"{len(CAPS)} phases × {PER_PHASE} iterations, length cap {CAPS[0]} → {CAPS[-1]}; seeds {list(SEEDS)}"
    )
    fixed = {n: [fixed_run(n, s) for s in SEEDS] for n in FIXED}
    elastic = [elastic_run(s) for s in SEEDS]
    t_fixed = {n: statistics.fmean(t for t, _ in v) for n, v in fixed.items()}
    h_fixed = {n: statistics.fmean(h for _, h in v) for n, v in fixed.items()}
    fastest = min(t_fixed.values())
    # The best fixed split in hindsight: the fastest, and among splits within 1% of it the cheapest.
    best_n = min((n for n in FIXED if t_fixed[n] <= fastest * 1.01), key=lambda n: h_fixed[n])
    t_el = statistics.fmean(t for t, _, _ in elastic)
    h_el = statistics.fmean(h for _, h, _ in elastic)
    table = Table(title="whole run: fixed generator counts vs the elastic rule (mean of seeds)")
    for col in ("generators", "run time (h)", "GPU-hours", "time / best fixed", "GPU-hours / best fixed"):
        table.add_column(col, justify="right")
    for n in FIXED:
        mark = " (best in hindsight)" if n == best_n else ""
        table.add_row(
            f"fixed {n}{mark}", f"{t_fixed[n] / 3600:.2f}", f"{h_fixed[n]:.0f}",
            f"{t_fixed[n] / t_fixed[best_n]:.3f}", f"{h_fixed[n] / h_fixed[best_n]:.3f}",
        )  # fmt: skip
    table.add_row(
        "elastic",
        f"{t_el / 3600:.2f}",
        f"{h_el:.0f}",
        f"{t_el / t_fixed[best_n]:.3f}",
        f"{h_el / h_fixed[best_n]:.3f}",
    )
    console.print(table)
    per_phase = [elastic[0][2][k * PER_PHASE] for k in range(len(CAPS))]
    console.print(
        f"elastic instances at the start of each phase (seed 0): {per_phase}; final {elastic[0][2][-1]}"
    )
    return {
        "elastic_s": t_el, "best_fixed_s": t_fixed[best_n], "best_fixed_n": best_n,
        "gpu_hours_saved": h_fixed[best_n] - h_el, "gpu_hours_best_fixed": h_fixed[best_n],
    }  # fmt: skip


def main() -> None:
    sim = simulator_part()
    line = {
        "bench": "elastic_scale",
        "metric": "elastic_run_time_vs_best_fixed_split_7b_growing_lengths",
        "value": round(sim["elastic_s"], 1),
        "baseline": round(sim["best_fixed_s"], 1),
        "ratio": round(sim["elastic_s"] / sim["best_fixed_s"], 4),
        "target": 1.10,
        "gpu_hours_saved": round(sim["gpu_hours_saved"], 1),
        "gpu_hours_saved_fraction": round(sim["gpu_hours_saved"] / sim["gpu_hours_best_fixed"], 4),
    }
    print(json.dumps(line))


if __name__ == "__main__":
    main()
