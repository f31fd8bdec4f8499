"""PNG plots of a run from its metrics.jsonl (`streamrl plot`): is it learning, is it fast, why not.

Four figures, each answering one question: ``reward`` (learning, and drifting from the
reference: KL), ``throughput`` (samples/s, tokens/s, how idle each stage is), ``timeline`` (a
Gantt chart of the pipeline, so the bubbles that stream generation and async mode remove are
visible) and ``lengths`` (response lengths, whose long tail makes those bubbles). Older records
may lack keys; a figure whose data is missing is skipped with the reason, never drawn empty.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from streamrl_cli.metrics import MetricsError
from streamrl_cli.metrics.read import read_iterations
from streamrl_cli.rundir import RunDir

Record = dict[str, Any]
PARITY = ("tab:blue", "tab:cyan")  # even, odd iteration: neighbouring bars stay distinguishable
STEP = ("tab:red", "tab:orange")
SYNC = ("tab:purple", "tab:pink")


class PlotFiles(list[Path]):
    """The PNGs written, plus ``skipped``: plot name → why it was not drawn."""

    def __init__(self) -> None:
        super().__init__()
        self.skipped: dict[str, str] = {}


def plot_run(run_dir: Path, out_dir: Path) -> PlotFiles:
    """Write reward, throughput, timeline and lengths PNGs of the run to out_dir."""
    run_dir = Path(run_dir)
    iters = read_iterations(run_dir)
    if not iters:
        raise MetricsError(f"no iterations recorded yet in {RunDir(run_dir).metrics}")
    import matplotlib

    if "matplotlib.pyplot" not in sys.modules:  # never switch the backend under an interactive session
        matplotlib.use("Agg")
    from matplotlib.figure import Figure

    name = RunDir(run_dir).info().get("name") or run_dir.name
    modes = list(dict.fromkeys(str(r["mode"]) for r in iters if r.get("mode")))
    label = f"{name} ({', '.join(modes) or 'mode unknown'})"
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = PlotFiles()
    drawers: dict[str, Callable[[Any, list[Record]], str | None]] = {
        "reward": _reward,
        "throughput": _throughput,
        "timeline": _timeline,
        "lengths": _lengths,
    }
    for plot, draw in drawers.items():
        fig = Figure(figsize=(12, 4.5) if plot == "timeline" else (10, 6.5), dpi=100, layout="constrained")
        missing = draw(fig, iters)
        if missing:
            files.skipped[plot] = missing
            continue
        if plot == "throughput":
            _mark_scale_events(fig, _scale_events(run_dir, iters))
        fig.suptitle(f"{label}: {plot}")
        path = out_dir / f"{plot}.png"
        fig.savefig(path)
        files.append(path)
    return files


def _num(value: Any) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _series(iters: list[Record], key: str) -> tuple[list[int], list[float]]:
    pairs = [(r["iteration"], v) for r in iters if (v := _num(r.get(key))) is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _lines(ax: Any, iters: list[Record], keys: list[str], ylabel: str) -> bool:
    drawn = False
    for key in keys:
        xs, ys = _series(iters, key)
        if xs:
            ax.plot(xs, ys, marker=".", label=key)
            drawn = True
    ax.set_xlabel("iteration")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return drawn


def _reward(fig: Any, iters: list[Record]) -> str | None:
    xs, mean = _series(iters, "reward_mean")
    if not xs:
        return "no reward_mean recorded"
    kx, kl = _series(iters, "kl")
    ax, *rest = fig.subplots(2 if kx else 1, 1, sharex=True, squeeze=False)[:, 0]
    std = {r["iteration"]: _num(r.get("reward_std")) or 0.0 for r in iters}
    ax.plot(xs, mean, marker=".", color="tab:green", label="reward mean")
    lo = [m - std[x] for x, m in zip(xs, mean, strict=True)]
    hi = [m + std[x] for x, m in zip(xs, mean, strict=True)]
    ax.fill_between(xs, lo, hi, color="tab:green", alpha=0.2, label="± std")
    mx, rmax = _series(iters, "reward_max")
    if mx:
        ax.plot(mx, rmax, linestyle=":", color="tab:green", label="reward max")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    if rest:
        rest[0].plot(kx, kl, marker=".", color="tab:red", label="KL")
        rest[0].set_ylabel("KL to reference")
        rest[0].grid(alpha=0.3)
    (rest[0] if rest else ax).set_xlabel("iteration")
    return None


def _throughput(fig: Any, iters: list[Record]) -> str | None:
    sx, sps = _series(iters, "samples_per_s")
    tx, tps = _series(iters, "tokens_per_s")
    idle = ["idle/trainer", "idle/generator"]
    if not (sx or tx or any(_series(iters, k)[0] for k in idle)):
        return "no samples_per_s, tokens_per_s or idle/* recorded"
    top, bottom = fig.subplots(2, 1, sharex=True)
    if sx:
        top.plot(sx, sps, marker=".", color="tab:blue", label="samples/s")
    top.set_ylabel("samples/s", color="tab:blue")
    if tx:
        twin = top.twinx()
        twin.plot(tx, tps, marker=".", color="tab:orange", label="tokens/s")
        twin.set_ylabel("tokens/s", color="tab:orange")
    top.grid(alpha=0.3)
    if _lines(bottom, iters, idle, "idle fraction"):
        bottom.set_ylim(-0.02, 1.02)
        bottom.legend(loc="best")
    else:
        bottom.text(0.5, 0.5, "idle ratios not recorded", ha="center", transform=bottom.transAxes)
    return None


def _span(value: Any) -> tuple[float, float] | None:
    """(start, width) of a [t0, t1] pair; None for anything else."""
    if isinstance(value, list | tuple) and len(value) == 2:
        a, b = _num(value[0]), _num(value[1])
        if a is not None and b is not None and b >= a:
            return a, b - a
    return None


def _bars(ax: Any, spans: list[Any], y: float, colour: str, t0: float) -> None:
    got = [(s[0] - t0, s[1]) for v in spans if (s := _span(v))]
    if got:
        ax.broken_barh(got, (y - 0.35, 0.7), facecolors=colour, edgecolor="none")


def _timeline(fig: Any, iters: list[Record]) -> str | None:
    lines = [(r["iteration"], r["timeline"]) for r in iters if isinstance(r.get("timeline"), dict)]
    starts = [s for _, tl in lines if (s := _num(tl.get("start"))) is not None]
    if not starts:
        return "no timeline recorded"
    t0 = min(starts)
    rows = {"generation": 2, "training": 1, "weight sync": 0}
    ax = fig.subplots()
    every = max(1, len(lines) // 40)  # label at most ~40 bars
    for n, (it, tl) in enumerate(lines):
        parity = it % 2
        gen = _span(tl.get("generation"))
        _bars(ax, [tl.get("generation")], rows["generation"], PARITY[parity], t0)
        if gen and n % every == 0:
            ax.text(gen[0] - t0 + gen[1] / 2, rows["generation"], str(it), ha="center", va="center", size=8)
        train = tl.get("train")
        _bars(ax, train if isinstance(train, list) else [], rows["training"], PARITY[parity], t0)
        _bars(ax, [tl.get("step")], rows["training"], STEP[parity], t0)
        _bars(ax, [tl.get("weight_sync")], rows["weight sync"], SYNC[parity], t0)
    ax.set_yticks(list(rows.values()), list(rows))
    ax.set_ylim(-0.6, 2.6)
    ax.set_xlabel("seconds since the first iteration started")
    ax.grid(axis="x", alpha=0.3)
    from matplotlib.patches import Patch

    legend = [
        Patch(color=PARITY[0], label="generation / micro-batches (even iteration)"),
        Patch(color=PARITY[1], label="(odd iteration)"),
        Patch(color=STEP[0], label="optimizer step"),
        Patch(color=SYNC[0], label="weight sync"),
    ]
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=4, frameon=False)
    return None


def _lengths(fig: Any, iters: list[Record]) -> str | None:
    keys = ["len/mean", "len/p50", "len/p90", "len/max"]
    ax = fig.subplots()
    if not _lines(ax, iters, keys, "response length (tokens)"):
        return "no len/* recorded"
    ax.legend(loc="best")
    return None


def _scale_events(run_dir: Path, iters: list[Record]) -> list[tuple[float, str]]:
    """(iteration, label) of each change of generator instances (events.jsonl `scaled`), placed at
    the iteration during which it was applied."""
    ends = sorted(
        (e, r["iteration"]) for r in iters if isinstance(r.get("timeline"), dict)
        if (e := _num(r["timeline"].get("end"))) is not None
    )  # fmt: skip
    out = []
    for ev in RunDir(run_dir).events():
        if ev.get("event") != "scaled" or ev.get("before") == ev.get("after") or not ends:
            continue
        it = next((i for end, i in ends if end >= ev["time"]), ends[-1][1] + 0.5)
        out.append((float(it), f"{ev['before']}→{ev['after']} gen ({ev.get('source', '?')})"))
    return out


def _mark_scale_events(fig: Any, marks: list[tuple[float, str]]) -> None:
    for n, ax in enumerate(fig.axes):
        for x, label in marks:
            ax.axvline(x, color="tab:gray", linestyle="--", linewidth=1)
            if n == 0:
                ax.annotate(label, (x, 1.0), xycoords=("data", "axes fraction"), rotation=90, size=8,
                            ha="right", va="top", color="tab:gray")  # fmt: skip
