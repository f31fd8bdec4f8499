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


def is_evaluation(rec: Any) -> bool:
    """A trainer record of one held-out evaluation (``eval/*`` keys; ``eval/iteration`` says whose
    weights were evaluated). It has no ``iteration`` key: it is posted when the evaluation ends."""
    return (
        isinstance(rec, dict)
        and rec.get("role") == "trainer"
        and rec.get("rank", 0) == 0
        and isinstance(rec.get("eval/iteration"), int)
        and not isinstance(rec.get("eval/iteration"), bool)
    )


def count_iteration_records(run_dir: Path) -> int:
    """How many iteration records the trainer wrote, repeats included (grows with every trained
    iteration, also when a restarted trainer trains one again)."""
    try:
        f = open(RunDir(Path(run_dir)).metrics, "rb")
    except FileNotFoundError:
        return 0
    n = 0
    with f:
        for line in f:
            if b'"iteration"' not in line:
                continue
            try:
                n += is_iteration(json.loads(line))
            except ValueError:
                continue
    return n


def read_iterations(run_dir: Path) -> list[dict[str, Any]]:
    """One record per iteration, in iteration order; the last record of a repeated iteration wins.

    An evaluation's ``eval/*`` values join the record of the iteration it evaluated, so plots and
    status read them like any other per-iteration value."""
    path = RunDir(Path(run_dir)).metrics
    latest: dict[int, dict[str, Any]] = {}
    evals: dict[int, dict[str, Any]] = {}
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
            elif is_evaluation(rec):
                evals[rec["eval/iteration"]] = {k: v for k, v in rec.items() if k.startswith("eval/")}
    for i, ev in evals.items():
        if i in latest:
            latest[i] = {**latest[i], **ev}
    return [latest[i] for i in sorted(latest)]


def read_relay_fetches(run_dir: Path) -> list[dict[str, Any]]:
    """Each weight version a far site's relay fetched across sites, as its generator reported it: a
    generator repeats its last transfer's ``weights/*`` keys in every metrics record, so one per
    (member, version, time), in the order they came. ``start`` (unix time) and ``seconds`` are the
    fetch's (it comes first in the transfer), ``mode`` delta or full (null before delta versions),
    ``reason`` why full, ``bytes`` what crossed."""
    try:
        f = open(RunDir(Path(run_dir)).metrics, "rb")
    except FileNotFoundError:
        return []
    out, seen = [], set()
    with f:
        for line in f:
            if b'"weights/wan_s"' not in line:
                continue
            try:
                rec = json.loads(line)
                key = (rec.get("member_id"), rec["weights/version"], rec["weights/at"])
                start = float(rec["weights/at"]) - float(rec.get("weights/transfer_s") or 0.0)
                seconds = float(rec["weights/wan_s"])
            except (ValueError, KeyError, TypeError):  # torn, or not a relay's transfer
                continue
            if key in seen or not rec.get("weights/relay"):
                continue
            seen.add(key)
            out.append({
                "version": rec["weights/version"], "start": start, "seconds": seconds,
                "mode": rec.get("weights/wan_mode"), "reason": rec.get("weights/wan_reason") or None,
                "bytes": rec.get("weights/wan_bytes"),
            })  # fmt: skip
    return out
