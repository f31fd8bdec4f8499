"""Run directories with simulated metrics and events, for the plot and status tests."""

from __future__ import annotations

import json
from pathlib import Path

from streamrl_cli.rundir import write_json

T0 = 1_700_000_000.0


def simulate(
    mode: str, iterations: int = 6, first: int = 0, t0: float = T0, reward0: float = 0.2
) -> list[dict]:
    """Trainer records of a plausible run: 4 s generation, 4 micro-batches, a step, a weight sync.

    baseline trains after generation; sync-stream trains on micro-batches as they stream in;
    async generates continuously and syncs weights while the next iteration is generated.
    """
    gen_s, micro_s, step_s, sync_s, micro_batches = 4.0, 0.6, 0.3, 0.4, 4
    recs, t, trainer_free = [], t0, t0
    for i in range(first, first + iterations):
        gen = [t, t + gen_s]
        if mode == "sync-stream":
            begins = [t + gen_s * (k + 1) / micro_batches for k in range(micro_batches)]
        else:
            begin = max(gen[1], trainer_free)
            begins = [begin + k * (micro_s + 0.05) for k in range(micro_batches)]
        train = [[b, b + micro_s] for b in begins]
        step = [train[-1][1], train[-1][1] + step_s]
        sync = [step[1], step[1] + sync_s]
        trainer_free = sync[1] if mode != "async" else step[1]
        end = sync[1] if mode != "async" else gen[1]
        t_iter = end - t
        lens = {"len/mean": 300 + 10 * i, "len/p50": 250 + 5 * i, "len/p90": 700 + 20 * i, "len/max": 1024}
        recs.append(
            {
                "time": sync[1],
                "member_id": "trainer-0",
                "role": "trainer",
                "rank": 0,
                "iteration": i,
                "mode": mode,
                "weight_version": i + 1,
                "reward_mean": reward0 + 0.08 * i,
                "reward_std": 0.15,
                "reward_max": 1.0,
                "approx_kl": 0.002 * i,
                "grad_norm": 0.8,
                "clip_frac": 0.05,
                "reward_min": 0.0,
                "loss/policy": -0.01,
                "loss/kl": 0.001,
                "loss/value": 0.0,
                "loss/entropy": -0.01,
                "loss/total": -0.019,
                **lens,
                "samples": 64,
                "tokens": 64 * lens["len/mean"],
                "samples_per_s": 64 / t_iter,
                "tokens_per_s": 64 * lens["len/mean"] / t_iter,
                "t/iteration": t_iter,
                "t/generation": gen_s,
                "t/train": micro_batches * micro_s,
                "t/wait": max(0.0, begins[0] - t - (0.0 if mode == "sync-stream" else gen_s)),
                "t/weight_sync": sync_s,
                "t/tail": 1.5,
                "rollout/aborted_groups": 2 if mode == "async" else 0,  # over-sampling on one run's records
                "rollout/paused_groups": 2 if mode == "sync-stream" else 0,  # partial rollout on another's
                "idle/trainer": 0.5 if mode == "baseline" else 0.2,
                "idle/generator": 0.3 if mode == "baseline" else 0.05,
                "staleness/mean": 1.0 if mode == "async" else 0.0,
                "staleness/max": 1 if mode == "async" else 0,
                "timeline": {
                    "start": t,
                    "generation": gen,
                    "train": train,
                    "step": step,
                    "weight_sync": sync,
                },
            }
        )
        t = end
    return recs


def make_run(root: Path, lines: list, name: str = "demo") -> Path:
    """A run directory whose metrics.jsonl holds `lines` (dicts as JSON, strings verbatim)."""
    run_dir = root / f"{name}-20250101-000000"
    run_dir.mkdir(parents=True)
    write_json(run_dir / "run.json", {"name": name, "run_id": run_dir.name, "state": "finished"})
    with open(run_dir / "metrics.jsonl", "w") as f:
        for line in lines:
            f.write(line if isinstance(line, str) else json.dumps(line) + "\n")
    return run_dir
