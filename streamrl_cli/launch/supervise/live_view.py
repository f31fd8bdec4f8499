"""Rich tables of what a launch is doing (the live view of `streamrl run`)."""

from __future__ import annotations

import time

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from streamrl_cli.launch import local
from streamrl_cli.rundir import RunDir, read_json


def local_table(run: RunDir) -> Table:
    """One row per local process: which one, its pid, state and uptime, what its start record says.

    Sized for an 80-column terminal: the short columns never wrap, the note folds onto more lines.
    """
    table = Table(title=f"run {run.name}", title_justify="left")
    for col in ("process", "pid", "state", "uptime"):
        table.add_column(col, no_wrap=True)
    table.add_column("note", overflow="fold")
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
        table.add_row(
            f"{rec.role}-{rec.rank}",
            str(rec.pid),
            Text(state, style=style),
            uptime,
            Text(note, overflow="fold"),
        )
    return table


def _member(run: RunDir, role: str, rank: int) -> dict:
    return read_json(run.member_record(role, rank), {})


SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int = 40) -> str:
    """The last `width` values as block characters scaled between their min and max."""
    vals = values[-width:]
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    span = (hi - lo) or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int((v - lo) / span * len(SPARK)))] for v in vals)


def training_view(run: RunDir) -> RenderableType | None:
    """What the trainer reports per iteration (from metrics.jsonl), or None before the first one.

    Three lines of `label value` pairs rather than one row of nine narrow columns, so that an
    80-column terminal shows every value whole (a narrower one folds them, never cuts them)."""
    from streamrl_cli.metrics.read import read_iterations

    recs = read_iterations(run.path)
    if not recs:
        return None
    last, total = recs[-1], run_total_iterations(run)

    def pair(label: str, value: str) -> Text:
        return Text.assemble((label + " ", "dim"), value, overflow="fold")

    grid = Table.grid(padding=(0, 3))
    for _ in range(3):
        grid.add_column(overflow="fold")
    grid.add_row(
        pair("iteration", f"{last['iteration'] + 1}/{total or '?'}"),
        pair("mode", str(last.get("mode", "?"))),
        pair("reward", f"{_num(recs[0]['reward_mean'], 2)} → {_num(last['reward_mean'], 2)}"),
    )
    grid.add_row(
        pair("samples/s", f"{last.get('samples_per_s', 0):.1f}"),
        pair("idle trainer", f"{100 * last.get('idle/trainer', 0):.0f}%"),
        pair("idle generator", f"{100 * last.get('idle/generator', 0):.0f}%"),
    )
    grid.add_row(
        pair("staleness", f"{last.get('staleness/max', 0)}"),
        pair("kl", f"{last.get('loss/kl', 0):.3f}"),
        pair("length p50/p90", f"{last.get('len/p50', 0)}/{last.get('len/p90', 0)}"),
    )
    spark = Text(
        "reward " + sparkline([r["reward_mean"] for r in recs if r["reward_mean"] is not None]), style="green"
    )
    return Group(Text("training", style="italic"), grid, spark)


def run_total_iterations(run: RunDir) -> int | None:
    spec = read_json(run.run_json, {})
    return spec.get("iterations")


def live_view(run: RunDir) -> RenderableType:
    training = training_view(run)
    return local_table(run) if training is None else Group(local_table(run), training)


def summary_line(run: RunDir) -> str | None:
    """One line for the end of a run: how the reward moved, at what speed."""
    from streamrl_cli.metrics.read import read_iterations

    recs = read_iterations(run.path)
    if not recs:
        return None
    first, last = recs[0], recs[-1]
    rate = sum(r.get("samples", 0) for r in recs) / max(sum(r.get("t/iteration", 0) for r in recs), 1e-9)
    scored = [r["reward_mean"] for r in recs if r["reward_mean"] is not None]  # null: nothing scored
    return (
        f"{len(recs)} iterations ({last.get('mode')}): reward {_num(first['reward_mean'], 3)} → "
        f"{_num(last['reward_mean'], 3)} (best {_num(max(scored, default=None), 3)}), {rate:.1f} samples/s"
    )


def _num(x: float | None, digits: int) -> str:
    """A reward as the views print it; null (an iteration whose reward scored nothing) as "-"."""
    return "-" if x is None else f"{x:.{digits}f}"
