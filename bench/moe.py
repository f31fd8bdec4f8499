"""A mixture-of-experts model against the dense model of the same total size, end to end on this machine.

`streamrl run local-moe` (the tiny Qwen3-MoE: 8 experts, 2 per token, 296K parameters) and the same
recipe with a dense tiny Qwen2 whose MLP is as large as the eight experts together (intermediate
size 512: the same 296K parameters, each token using all of them), both warmed up alike, paired by
seed. Per arm: the iteration split (generation, training, weight sync), the weight sync per version
(the generator's transfer and in-place load of every tensor: the MoE's stacked experts go through
vLLM's fused layout and its CPU kernel's repacking), the trainer–generator log-prob agreement per
token (``rollout/logp_abs_diff``), and learning (mean reward of the first and last iterations).

All arms run one-step asynchronous (``algorithm.mode=async``): each iteration trains samples the
generators drew with the weights one version back, so the routers of the trainer and the engine see
different weights, as in a real run. A third arm runs the MoE with routing replay
(``algorithm.routing_replay``: the generators capture each token's experts, the trainer's forward
uses them) and says how often the trainer's routers would have chosen other experts
(``moe/replay_differ``).

Targets: the MoE's weight sync within 1.2× of the dense model's; agreement with replay at least as
good as without.

    .venv/bin/python bench/moe.py [--iterations 20] [--seeds 0 1 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from rich.table import Table
from rl_modes import console, run_streamrl  # bench/ is the script's directory

from streamrl_cli.metrics.read import read_iterations
from streamrl_cli.rundir import read_jsonl

WARMUP_STEPS = 400  # as recipes/model/tiny-qwen3-moe.yaml
MOE, DENSE, REPLAY = "MoE 8×2", "dense, same size", "MoE 8×2 + routing replay"


def dense_same_size(root: Path) -> Path:
    """The dense tiny Qwen2 with the MoE's total parameters, warmed up as the MoE recipe's model is."""
    from streamrl_cli.models.tiny import TinySpec, build_tiny_model
    from streamrl_cli.models.warmup import warm_up
    from streamrl_cli.recipe.schema import TaskConfig
    from streamrl_cli.tasks import make_task

    out = root / "dense-512"
    if out.exists():
        return out
    base = build_tiny_model(root / "dense-512-base", TinySpec(intermediate_size=512))
    return warm_up(base, out, make_task(TaskConfig()), WARMUP_STEPS)


def summary(run_dir: Path) -> dict:
    recs = read_iterations(run_dir)
    later = recs[1:]  # the first iteration pays the engines' first requests
    loads = [
        r["weights/transfer_s"]
        for r in read_jsonl(run_dir / "metrics.jsonl").records
        if r.get("role") == "generator" and r.get("weights/transfer_s") and r.get("weights/version", 0) > 0
    ]
    return {
        "t/generation": statistics.fmean(r["t/generation"] for r in later),
        "t/train": statistics.fmean(r["t/train"] for r in later),
        "t/weight_sync": statistics.fmean(r["t/weight_sync"] for r in later),
        "load_s": statistics.median(loads) if loads else float("nan"),
        "bytes": max(r.get("weights/bytes", 0) for r in read_jsonl(run_dir / "metrics.jsonl").records),
        "diff": statistics.median(r["rollout/logp_abs_diff"] for r in recs),
        "first": statistics.fmean(r["reward_mean"] for r in recs[:3]),
        "last": statistics.fmean(r["reward_mean"] for r in recs[-3:]),
        "aux": statistics.fmean(r["moe/aux_loss"] for r in recs) if "moe/aux_loss" in recs[0] else None,
        "differ": statistics.fmean(r["moe/replay_differ"] for r in recs)
        if "moe/replay_differ" in recs[0]
        else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = ap.parse_args()
    results: dict[str, dict[int, dict]] = {MOE: {}, DENSE: {}, REPLAY: {}}
    with tempfile.TemporaryDirectory(prefix="moe-bench-") as tmp:
        dense = dense_same_size(Path(tmp))
        dense_keys = [f"model.path={dense}", "model.builder=null", "algorithm.router_aux_loss_coef=0"]
        arms = {MOE: [], DENSE: dense_keys, REPLAY: ["algorithm.routing_replay=true"]}
        for seed in args.seeds:
            for n, (arm, keys) in enumerate(arms.items()):
                root = Path(tmp) / f"{n}-{seed}"
                run_streamrl(f"{arm}, seed {seed}", [
                    "run", "local-moe", f"train.iterations={args.iterations}", f"train.seed={seed}",
                    "train.checkpoint_every=0", "algorithm.mode=async", *keys, "--root", str(root),
                ])  # fmt: skip
                (run_dir,) = root.iterdir()
                results[arm][seed] = summary(run_dir)
    table = Table(title=f"MoE vs dense of the same total size (296K parameters), {args.iterations} "
                  "iterations, local, 2 cores; means over seeds")  # fmt: skip
    for col in ("arm", "generation s", "train s", "weight sync s", "load per version s", "bytes/version",
                "logp |diff| per token", "reward first 3 → last 3", "aux loss",
                "replay differs"):  # fmt: skip
        table.add_column(col, justify="right")

    def mean(arm: str, key: str) -> float:
        return statistics.fmean(results[arm][s][key] for s in args.seeds)

    for arm in results:
        aux, differ = results[arm][args.seeds[0]]["aux"], results[arm][args.seeds[0]]["differ"]
        table.add_row(
            arm, f"{mean(arm, 't/generation'):.2f}", f"{mean(arm, 't/train'):.2f}",
            f"{mean(arm, 't/weight_sync'):.3f}", f"{mean(arm, 'load_s'):.3f}",
            f"{results[arm][args.seeds[0]]['bytes']:,}", f"{mean(arm, 'diff'):.1e}",
            f"{mean(arm, 'first'):.3f} → {mean(arm, 'last'):.3f}", f"{mean(arm, 'aux'):.2f}" if aux else "-",
            f"{mean(arm, 'differ'):.2%}" if differ is not None else "-",
        )  # fmt: skip
    console.print(table)
    seeds = Table(title="learning per seed (mean reward, first 3 → last 3 iterations)")
    for col in ("seed", *results):
        seeds.add_column(col, justify="right")
    for s in args.seeds:
        seeds.add_row(
            str(s), *(f"{results[a][s]['first']:.3f} → {results[a][s]['last']:.3f}" for a in results)
        )
    console.print(seeds)
    moe, dense_ = mean(MOE, "t/weight_sync"), mean(DENSE, "t/weight_sync")
    with_replay, without = mean(REPLAY, "diff"), mean(MOE, "diff")
    console.print(
        f"weight sync per version: MoE {moe:.3f} s, dense {dense_:.3f} s: {moe / dense_:.2f}× "
        f"(target ≤ 1.2×); agreement per token: MoE {without:.1e} without replay, {with_replay:.1e} with "
        f"({'as good or better' if with_replay <= without * 1.05 else 'WORSE'}), "
        f"dense {mean(DENSE, 'diff'):.1e}"
    )
    print(json.dumps({
        "bench": "moe",
        "metric": "weight sync s per version, MoE (8 experts, top-2) / dense of the same total size",
        "value": round(moe, 4), "baseline": round(dense_, 4), "ratio": round(moe / dense_, 3), "target": 1.2,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
