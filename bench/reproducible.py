"""What bit-for-bit reproducibility costs: the local default with and without
`train.reproducible_sampling`, alternating, the same seed each time.

Reproducible runs seed every request and train each batch's groups in the batch's order, so a
group that finished early waits for those before it. This bench measures that price (iteration
time and the trainer's wait, sync-stream) against the same runs without it, and checks what it
buys: the reproducible runs produce the same tokens, rewards and exported weights; the others
are compared the same way.

    .venv/bin/python bench/reproducible.py [--iterations 8] [--repeats 2] [--skip 1] [override ...]

The first `--skip` iterations are left out of the timings (engines warming up).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import tempfile
from pathlib import Path

from rich.table import Table
from rl_modes import console, run_local  # bench/ is the script's directory

from streamrl_cli.metrics.read import read_iterations


def measure(run_dir: Path, skip: int) -> dict:
    recs = read_iterations(run_dir)
    timed = [r for r in recs if r["iteration"] >= skip]
    return {
        "iteration_s": statistics.fmean(r["t/iteration"] for r in timed),
        "wait_s": statistics.fmean(r["t/wait"] for r in timed),
        "idle_trainer": statistics.fmean(r["idle/trainer"] for r in timed),
        "run": [(r["data/digest"], r["tokens"], r["reward_mean"]) for r in recs],
        "weights": hashlib.sha256((run_dir / "model" / "model.safetensors").read_bytes()).hexdigest(),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--skip", type=int, default=1)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    res: dict[bool, list[dict]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(prefix="reproducible-") as tmp:
        for k in range(args.repeats):
            for on in (False, True):  # alternating: drift of the machine hits both alike
                label = f"{'reproducible' if on else 'as-finished'} #{k + 1}"
                run_dir = run_local(label, Path(tmp) / f"{on}-{k}", [
                    f"train.iterations={args.iterations}", f"train.reproducible_sampling={str(on).lower()}",
                    *args.overrides,
                ])  # fmt: skip
                res[on].append(measure(run_dir, args.skip))
    table = Table(title=f"Reproducible runs: their cost and what they buy (local default, sync-stream, "
                  f"{args.iterations} iterations, first {args.skip} not timed)")  # fmt: skip
    for col in ("runs", "iteration s", "trainer wait s", "trainer idle", "same tokens and rewards",
                "same weights"):  # fmt: skip
        table.add_column(col, justify="right")
    for on, runs in res.items():
        table.add_row(
            "reproducible" if on else "as-finished",
            " / ".join(f"{r['iteration_s']:.2f}" for r in runs),
            " / ".join(f"{r['wait_s']:.2f}" for r in runs),
            " / ".join(f"{100 * r['idle_trainer']:.0f}%" for r in runs),
            "yes" if len({json.dumps(r["run"]) for r in runs}) == 1 else "no",
            "yes" if len({r["weights"] for r in runs}) == 1 else "no",
        )
    console.print(table)
    base = statistics.fmean(r["iteration_s"] for r in res[False])
    value = statistics.fmean(r["iteration_s"] for r in res[True])
    print(json.dumps({
        "bench": "reproducible", "metric": "iteration_s_reproducible", "value": round(value, 3),
        "baseline": round(base, 3), "ratio": round(value / base, 3), "target": 1.0,
        "same_weights": len({r["weights"] for r in res[True]}) == 1,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
