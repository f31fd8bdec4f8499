"""Every algorithm preset on the same task, model, data and seed: what each learns, at what speed.

    .venv/bin/python bench/algorithms.py [--iterations 30] [--algorithms grpo,dapo,...]

Each preset (`algorithm.name`, docs/algorithms.md) runs `streamrl run local` on the embedded
default's model with the repeat task written out as a JSONL dataset: 8 prompts × 8 completions per
step, completions ≤ 64 tokens, lr 1e-3, sync-stream, training seed 0; every other key is the
preset's own (its KL term, clipping, loss reduction, dynamic sampling, overlong shaping). The
baseline is the same run with `algorithm.lr=0`: a policy that does not move, so its held-out reward
is where every preset starts and its samples/s is the pipeline's cost without a weight change.

Held-out reward: StreamRL's own evaluation after the last step (`task.eval_dataset`, 200 prompts of
(word, count) pairs no training prompt has, sampled at temperature 1 with per-request seeds, the
same for every run), with its standard error. Also shown: samples/s of the training loop, the
training reward over the first and last five steps, and what dynamic sampling dropped (DAPO);
every run's training reward per step on one plot (bench/plots/algorithms_rewards.png).
The target: every preset ends above the fixed policy's held-out reward.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_trl import write_data  # noqa: E402
from rl_modes import console, plot_rewards, run_local  # noqa: E402

from streamrl_cli.metrics.read import read_iterations  # noqa: E402
from streamrl_cli.recipe.schema import ALGORITHMS  # noqa: E402

# PPO's critic and GAE make it a different kind of run (and the slowest here); ask for it by name.
DEFAULT = [a for a in ALGORITHMS if a != "ppo"]
GROUP, PROMPTS_PER_STEP, MAX_COMPLETION, LR = 8, 8, 64, 1e-3


def run(
    name: str, lr: float, train: Path, test: Path, iterations: int, work: Path, extra: tuple[str, ...] = ()
) -> dict:
    """One preset's run at this benchmark's settings (`extra`: more overrides, e.g. LoRA's)."""
    overrides = [
        f"task.dataset={train}", "task.name=bench-repeat", f"task.eval_dataset={test}",
        "task.eval_temperature=1.0", f"task.max_output_len={MAX_COMPLETION}",
        "task.reward=streamrl_cli.tasks.rewards:repeat_verifier", f"algorithm.name={name}",
        f"algorithm.group_size={GROUP}", f"algorithm.lr={lr}", f"train.global_batch={PROMPTS_PER_STEP}",
        f"train.iterations={iterations}", "train.seed=0", *extra,
    ]  # fmt: skip
    started = time.monotonic()
    run_dir = run_local(f"{name} (lr {lr:g})", work, overrides)
    wall = time.monotonic() - started
    recs = read_iterations(run_dir)
    final = next(r for r in reversed(recs) if r.get("eval/reward_mean") is not None)
    n = final["eval/samples"]
    loop = recs[-1]["timeline"]["end"] - recs[0]["timeline"]["start"]
    rewards = [r["reward_mean"] for r in recs]
    return {
        "samples_per_s": sum(r["samples"] for r in recs) / loop,
        "wall_s": wall,
        "first": statistics.fmean(rewards[:5]),
        "last": statistics.fmean(rewards[-5:]),
        "held_out": final["eval/reward_mean"],
        "se": final.get("eval/reward_std", 0.0) / math.sqrt(n),
        "dropped": sum(r.get("dynamic_sampling/dropped_groups", 0) for r in recs),
        "rewards": rewards,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument(
        "--algorithms", default=",".join(DEFAULT), help=f"comma-separated: {', '.join(ALGORITHMS)}"
    )
    args = ap.parse_args()
    names = args.algorithms.split(",")
    if unknown := [a for a in names if a not in ALGORITHMS]:
        raise SystemExit(f"unknown algorithm {unknown[0]!r}; valid: {', '.join(ALGORITHMS)}")
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-algorithms-") as tmp:
        tmp = Path(tmp)
        train, test = write_data(tmp, args.iterations * PROMPTS_PER_STEP)
        results["fixed policy (lr 0)"] = run("grpo", 0.0, train, test, args.iterations, tmp / "fixed")
        for name in names:
            results[name] = run(name, LR, train, test, args.iterations, tmp / name)
    base = results["fixed policy (lr 0)"]
    table = Table(title=f"algorithm presets on the repeat task: tiny model, {args.iterations} steps of "
                  f"{PROMPTS_PER_STEP} prompts × {GROUP}, lr {LR:g}, same data and seed")  # fmt: skip
    for col in ("algorithm", "samples/s", "wall s", "train reward first5→last5", "groups dropped",
                "held-out reward ± se", "vs fixed policy"):  # fmt: skip
        table.add_column(col, justify="right")
    for name, r in results.items():
        table.add_row(
            name, f"{r['samples_per_s']:.1f}", f"{r['wall_s']:.0f}", f"{r['first']:.3f}→{r['last']:.3f}",
            str(r["dropped"]), f"{r['held_out']:.3f} ± {r['se']:.3f}",
            f"{r['held_out'] - base['held_out']:+.3f}" if r is not base else "-",
        )  # fmt: skip
    console.print(table)
    plot = Path(__file__).resolve().parent / "plots" / "algorithms_rewards.png"
    plot_rewards(
        results, plot, f"algorithm presets, tiny model, repeat task ({PROMPTS_PER_STEP}×{GROUP} per step)"
    )
    console.print(f"reward curves: {plot}")
    worst = min(names, key=lambda a: results[a]["held_out"])
    learned = [a for a in names if results[a]["held_out"] > base["held_out"]]
    low = results[worst]["held_out"]
    console.print(f"{len(learned)} of {len(names)} presets end above the fixed policy's held-out reward "
                  f"({base['held_out']:.3f}); lowest: {worst} ({low:.3f})")  # fmt: skip
    print(json.dumps({
        "bench": "algorithms", "metric": "held_out_reward_of_the_lowest_preset",
        "value": round(results[worst]["held_out"], 4), "baseline": round(base["held_out"], 4),
        "ratio": round(results[worst]["held_out"] / base["held_out"], 3) if base["held_out"] else None,
        "target": 1.0,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
