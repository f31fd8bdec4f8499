"""The trainer's per-iteration records, read back from a run's metrics.jsonl.

The file is append-only and shared by every member, so it is read defensively: a crash or a
live writer can leave a torn last line, other members post other records, and a resumed run
repeats the iterations after its last checkpoint (the later record describes what the model
actually became, so it wins).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from streamrl_cli.rundir import RunDir


def is_iteration(rec: Any) -> bool:
    """A trainer record of one iteration (rank 0, or no rank in older lines)."""
    return (
        isinstance(rec, dict)
        and rec.get("role") == "trainer"
        and rec.get("rank", 0) == 0
        and isinstance(rec.get("iteration"), int)
        and not isinstance(rec.get("iteration"), bool)
    )


def read_iterations(run_dir: Path) -> list[dict[str, Any]]:
    """One record per iteration, in iteration order; the last record of a repeated iteration wins."""
    path = RunDir(Path(run_dir)).metrics
    latest: dict[int, dict[str, Any]] = {}
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return []
    with f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:  # torn last line, or something that is not JSON at all
                continue
            if is_iteration(rec):
                latest[rec["iteration"]] = rec
    return [latest[i] for i in sorted(latest)]
