"""Rich tables of what a launch is doing (the live view of `streamrl run`)."""

from __future__ import annotations

import time

from rich.table import Table

from streamrl_cli.launch import local
from streamrl_cli.rundir import RunDir, read_json


def local_table(run: RunDir) -> Table:
    """One row per local process: role, rank, pid, state, what its start record says."""
    table = Table(title=f"run {run.name}", title_justify="left")
    for col in ("role", "rank", "pid", "state", "uptime", "note"):
        table.add_column(col)
    for rec in local.procs(run):
        code = local.exit_code(rec)
        if rec.alive():
            state, style = "running", "green"
        elif code == 0:
            state, style = "done", "cyan"
        elif code is None:
            state, style = "gone", "yellow"
        else:
            state, style = f"exit {code}", "red"
        member = _member(run, rec.role, rec.rank)
        note = ""
        if member.get("preflight_ok"):
            note = "preflight ok: " + ", ".join(f"{k}={v}" for k, v in member.get("peers", {}).items())
        uptime = f"{time.time() - rec.created:.0f}s" if rec.alive() else ""
        table.add_row(rec.role, str(rec.rank), str(rec.pid), f"[{style}]{state}[/{style}]", uptime, note)
    return table


def _member(run: RunDir, role: str, rank: int) -> dict:
    return read_json(run.path / "members" / f"{role}-{rank}.json", {})
