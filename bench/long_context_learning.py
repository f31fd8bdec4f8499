"""What the long-context machinery does to learning: the local default trained as it is (one trainer
rank, whole logits) and with two trainer ranks in one sequence-parallel group, chunked logits and
activation checkpointing, seed for seed (paired), in reproducible mode.

Both arms see the same prompts in the same order from the same weights; only the arithmetic differs
(the rows split over two ranks, the LM head a chunk at a time, recomputed activations), so their
rewards should agree. The table holds each seed's mean reward over the last iterations and the
difference; the JSON line the mean difference over seeds (target: within ±0.05 reward).

    .venv/bin/python bench/long_context_learning.py [--iterations 12] [--seeds 0 1 2] [--last 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from rich.table import Table
from rl_modes import console, run_local  # bench/ is the script's directory

from streamrl_cli.metrics.read import read_iterations

ARMS = {
    "whole (1 rank)": ["roles.trainer.logits_chunk=0"],
    "SP 2 + chunked + ckpt": [
        "roles.trainer.nodes=2", "roles.trainer.sequence_parallel=2", "roles.trainer.logits_chunk=16",
        "roles.trainer.activation_checkpointing=true",
    ],
}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=12)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--last", type=int, default=4, help="iterations at the end whose rewards are averaged")
    args = ap.parse_args()
    rewards: dict[str, dict[int, list[float]]] = {arm: {} for arm in ARMS}
    tokens: dict[str, dict[int, list[int]]] = {arm: {} for arm in ARMS}  # tokens generated per iteration
    seconds: dict[str, list[float]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory(prefix="long-learning-") as tmp:
        for seed in args.seeds:
            for arm, keys in ARMS.items():
                run_dir = run_local(f"{arm}, seed {seed}", Path(tmp) / f"{seed}-{len(keys)}", [
                    f"train.iterations={args.iterations}", f"train.seed={seed}",
                    "train.reproducible_sampling=true", *keys,
                ])  # fmt: skip
                recs = read_iterations(run_dir)
                rewards[arm][seed] = [r["reward_mean"] for r in recs]
                tokens[arm][seed] = [r["tokens"] for r in recs]
                seconds[arm].append(statistics.fmean(r["t/iteration"] for r in recs[1:]))
    whole, split = ARMS
    table = Table(title=f"Local default, {args.iterations} iterations: mean reward of the last {args.last}, "
                  "paired by seed (reproducible mode)")  # fmt: skip
    for col in ("seed", whole, split, "difference", "largest per-iteration difference", "same tokens"):
        table.add_column(col, justify="right")
    diffs = []
    for seed in args.seeds:
        a, b = (statistics.fmean(rewards[arm][seed][-args.last :]) for arm in (whole, split))
        diffs.append(b - a)
        worst = max(abs(x - y) for x, y in zip(rewards[whole][seed], rewards[split][seed], strict=True))
        same = sum(x == y for x, y in zip(tokens[whole][seed], tokens[split][seed], strict=True))
        table.add_row(
            str(seed), f"{a:.4f}", f"{b:.4f}", f"{b - a:+.4f}", f"{worst:.1e}",
            f"{same} of {len(tokens[whole][seed])} iterations",
        )  # fmt: skip
    console.print(table)
    console.print(
        f"iteration time: {whole} {statistics.fmean(seconds[whole]):.2f} s, "
        f"{split} {statistics.fmean(seconds[split]):.2f} s (two ranks on 2 cores beside the generator)"
    )
    mean = statistics.fmean(diffs)
    print(json.dumps({
        "bench": "long_context_learning", "metric": "mean reward difference, SP 2 + chunked - whole (last "
        f"{args.last} of {args.iterations} iterations, {len(args.seeds)} paired seeds)",
        "value": round(mean, 4), "baseline": 0.0, "ratio": round(mean, 4), "target": 0.05,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
