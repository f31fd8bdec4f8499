"""How fast `streamrl --help` and a dry run answer (heavy imports must stay inside commands).

Baseline, measured in the same run: a bare `python -c pass` of the same interpreter (the floor
any Python CLI pays). Target: `streamrl --help` under 0.5 s.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from rich.console import Console
from rich.table import Table

REPEATS = 15


def timed(argv: list[str], env: dict[str, str]) -> list[float]:
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, env=env)
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    env = {**os.environ, "STREAMRL_HOME": tempfile.mkdtemp()}
    root = tempfile.mkdtemp()
    cases = {
        "python -c pass (baseline)": [sys.executable, "-c", "pass"],
        "streamrl --help": [sys.executable, "-m", "streamrl_cli.cli", "--help"],
        "streamrl recipes": [sys.executable, "-m", "streamrl_cli.cli", "recipes"],
        "streamrl run local --dry-run": [
            sys.executable,
            "-m",
            "streamrl_cli.cli",
            "run",
            "local",
            "--dry-run",
            "--root",
            root,
        ],
    }
    results = {name: timed(argv, env) for name, argv in cases.items()}
    table = Table(title=f"CLI start-up, {REPEATS} runs each (seconds)")
    for col in ("command", "median", "p90", "min"):
        table.add_column(col, justify="right" if col != "command" else "left")
    for name, ts in results.items():
        ts = sorted(ts)
        table.add_row(
            name, f"{statistics.median(ts):.3f}", f"{ts[int(0.9 * (len(ts) - 1))]:.3f}", f"{ts[0]:.3f}"
        )
    Console().print(table)
    value = statistics.median(results["streamrl --help"])
    baseline = statistics.median(results["python -c pass (baseline)"])
    print(
        json.dumps(
            {
                "bench": "cli_startup",
                "metric": "streamrl_help_median_s",
                "value": round(value, 4),
                "baseline": round(baseline, 4),
                "ratio": round(value / baseline, 2),
                "target": 0.5,
            }
        )
    )


if __name__ == "__main__":
    main()
