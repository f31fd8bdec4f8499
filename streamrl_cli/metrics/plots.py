"""PNG plots of a run from its metrics.jsonl (`streamrl plot`): is it learning, is it fast, why not.

Five figures, each answering one question: ``reward`` (is it learning: training reward, and the
held-out ``eval/reward_mean`` when the run evaluates), ``training`` (is the update healthy: KL,
grad norm, clip fraction, entropy, and the value loss of PPO), ``throughput`` (samples/s,
tokens/s, how idle each stage is), ``timeline`` (a Gantt chart of the pipeline, so the bubbles
that stream generation and async mode remove are visible; with a far site, its relay's fetch of
each version, as a delta or whole) and ``lengths`` (response lengths,
whose long tail makes those bubbles). Per-iteration values are noisy: they are drawn faint, with
a smoothed line over them. Older records may lack keys; a figure or panel whose data is missing
is skipped with the reason, never drawn empty.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from streamrl_cli.metrics import MetricsError
from streamrl_cli.metrics.read import read_iterations, read_relay_fetches
from streamrl_cli.rundir import RunDir

Record = dict[str, Any]
PARITY = ("tab:blue", "tab:cyan")  # even, odd iteration: neighbouring bars stay distinguishable
STEP = ("tab:red", "tab:orange")
SYNC = ("tab:purple", "tab:pink")
ACROSS = ("tab:green", "tab:olive")  # a relay's fetch across sites: as a delta, whole


class PlotFiles(list[Path]):
    """The PNGs written, plus ``skipped``: plot name → why it was not drawn."""

    def __init__(self) -> None:
        super().__init__()
        self.skipped: dict[str, str] = {}


def plot_run(run_dir: Path, out_dir: Path) -> PlotFiles:
    """Write reward, training, throughput, timeline and lengths PNGs of the run to out_dir."""
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
        "training": _training,
        "throughput": _throughput,
        "timeline": lambda fig, it: _timeline(fig, it, read_relay_fetches(run_dir)),
        "lengths": _lengths,
    }
    if any("agent/trajectories" in r for r in iters):  # a multi-turn run
        drawers["agent"] = _agent
    for plot, draw in drawers.items():
        size = {"timeline": (12, 4.5), "training": (12, 7.5)}.get(plot, (10, 6.5))
        fig = Figure(figsize=size, dpi=100, layout="constrained")
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


def smooth(ys: list[float]) -> list[float]:
    """An exponential moving average whose window grows with the run (about a tenth of it)."""
    window = min(25, max(2, len(ys) // 10))
    alpha = 2.0 / (window + 1)
    out: list[float] = []
    for y in ys:
        out.append(y if not out else alpha * y + (1 - alpha) * out[-1])
    return out


def _noisy(ax: Any, xs: list[int], ys: list[float], colour: str, label: str) -> None:
    """Raw values faint, the smoothed line over them (raw only when too few points to smooth)."""
    if len(xs) < 5:
        ax.plot(xs, ys, marker=".", color=colour, label=label)
        return
    ax.plot(xs, ys, color=colour, alpha=0.3, linewidth=1)
    ax.plot(xs, smooth(ys), color=colour, linewidth=2, label=f"{label} (smoothed)")


def _reward(fig: Any, iters: list[Record]) -> str | None:
    xs, mean = _series(iters, "reward_mean")
    if not xs:
        return "no reward_mean recorded"
    ax = fig.subplots()
    std = {r["iteration"]: _num(r.get("reward_std")) or 0.0 for r in iters}
    # The band is mean ± std clipped to what the rewards of that iteration actually were: a
    # 0/1 reward must not look as if it went below 0 or above 1.
    rmin = {r["iteration"]: _num(r.get("reward_min")) for r in iters}
    rmax = {r["iteration"]: _num(r.get("reward_max")) for r in iters}

    def clip(v: float, lo: float | None, hi: float | None) -> float:
        return min(max(v, lo if lo is not None else -math.inf), hi if hi is not None else math.inf)

    lo = [clip(m - std[x], rmin[x], rmax[x]) for x, m in zip(xs, mean, strict=True)]
    hi = [clip(m + std[x], rmin[x], rmax[x]) for x, m in zip(xs, mean, strict=True)]
    ax.fill_between(xs, lo, hi, color="tab:green", alpha=0.15, label="± std (within min..max)")
    _noisy(ax, xs, mean, "tab:green", "reward mean")
    mx, rmx = _series(iters, "reward_max")
    if mx:
        ax.plot(mx, rmx, linestyle=":", color="tab:green", label="reward max")
    ex, ev = _series(iters, "eval/reward_mean")
    if ex:
        ax.plot(ex, ev, marker="o", color="tab:purple", label="eval reward mean (held out)")
    ax.set_ylabel("reward")
    ax.set_xlabel("iteration")
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    return None


# (title, [(metric key, label)], y label): a panel is drawn when any of its keys was recorded.
TRAINING_PANELS = [
    (
        "KL",
        [
            ("approx_kl", "approx KL to the behaviour policy"),
            ("loss/kl", "KL to the reference"),
            ("kl", "KL"),
        ],
        "KL",
    ),
    (
        "trainer vs generator log-probs",
        [
            ("rollout/logp_abs_diff", "mean |Δ log p| per token"),
            ("rollout/kl", "KL(generator ‖ trainer), k3"),
        ],
        "nats per token",
    ),
    ("gradient norm", [("grad_norm", "grad norm (before clipping)")], "L2 norm"),
    ("clip fraction", [("clip_frac", "clipped tokens")], "fraction of tokens"),
    ("entropy", [("loss/entropy", "policy entropy"), ("entropy", "entropy")], "nats per token"),
    ("value loss (PPO)", [("loss/value", "critic loss")], "loss"),
    ("policy loss", [("loss/policy", "policy-gradient loss")], "loss"),
]
COLOURS = ("tab:red", "tab:blue", "tab:olive")


def _training(fig: Any, iters: list[Record]) -> str | None:
    panels = []
    for title, keys, ylabel in TRAINING_PANELS:
        got = [(label, *_series(iters, key)) for key, label in keys]
        got = [g for g in got if g[1]]
        if got:
            panels.append((title, got, ylabel))
    if not panels:
        return "no approx_kl, loss/kl, grad_norm, clip_frac, loss/entropy or loss/value recorded"
    cols = 3 if len(panels) > 4 else 2 if len(panels) > 1 else 1
    rows = math.ceil(len(panels) / cols)
    axes = fig.subplots(rows, cols, sharex=True, squeeze=False).ravel()
    for ax, (title, got, ylabel) in zip(axes, panels, strict=False):
        for colour, (label, xs, ys) in zip(COLOURS, got, strict=False):
            _noisy(ax, xs, ys, colour, label)
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    return None


def _agent(fig: Any, iters: list[Record]) -> str | None:
    """Multi-turn trajectories per iteration: turns and tool use, failures and why trajectories
    ended, model vs environment tokens, environment time."""
    (turns, ends), (tokens, env_time) = fig.subplots(2, 2, sharex=True)
    _lines(turns, iters, ["agent/turns_mean", "agent/tool_calls_per_trajectory"], "per trajectory")
    turns.set_title("turns and tool calls")
    turns.legend(loc="best", fontsize=8)
    stops = sorted({k for r in iters for k in r if k.startswith("agent/stop/")})
    _lines(ends, iters, [*stops, "agent/tool_errors"], "trajectories (tool errors: calls)")
    ends.set_title("why trajectories ended")
    ends.legend(loc="best", fontsize=8)
    _lines(tokens, iters, ["agent/model_tokens", "agent/env_tokens"], "tokens")
    tokens.set_title("model vs environment tokens")
    tokens.legend(loc="best", fontsize=8)
    _lines(env_time, iters, ["agent/env_s"], "seconds (summed over trajectories)")
    env_time.set_title("time in the environment")
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


def _timeline(fig: Any, iters: list[Record], fetches: Sequence[Record] = ()) -> str | None:
    """The pipeline's Gantt chart; with a far site, a row of its relay's fetches (`fetches`,
    metrics.read.read_relay_fetches): each version as a delta or whole."""
    lines = [(r["iteration"], r["timeline"]) for r in iters if isinstance(r.get("timeline"), dict)]
    starts = [s for _, tl in lines if (s := _num(tl.get("start"))) is not None]
    if not starts:
        return "no timeline recorded"
    t0 = min(starts)
    rows = {"generation": 2, "training": 1, "weight sync": 0}
    if fetches:
        rows = {name: y + 1 for name, y in rows.items()} | {"across sites": 0}
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
    for f in fetches:
        whole = f.get("mode") != "delta"
        _bars(ax, [[f["start"], f["start"] + f["seconds"]]], 0, ACROSS[whole], t0)
    ax.set_yticks(list(rows.values()), list(rows))
    ax.set_ylim(-0.6, max(rows.values()) + 0.6)
    ax.set_xlabel("seconds since the first iteration started")
    ax.grid(axis="x", alpha=0.3)
    from matplotlib.legend_handler import HandlerTuple
    from matplotlib.patches import Patch

    # Every colour drawn is in the legend: each entry shows its even- and odd-iteration shade.
    pairs = [
        (PARITY, "generation / micro-batches"),
        (STEP, "optimizer step"),
        (SYNC, "weight sync"),
    ]
    handles: list[Any] = [(Patch(color=even), Patch(color=odd)) for (even, odd), _ in pairs]
    labels = [f"{label} (even | odd iteration)" for _, label in pairs]
    if fetches:
        handles += [Patch(color=ACROSS[0]), Patch(color=ACROSS[1])]
        labels += ["relay fetch across sites: delta", "relay fetch across sites: whole"]
    ax.legend(
        handles=handles,
        labels=labels,
        handler_map={tuple: HandlerTuple(ndivide=None, pad=0)},
        loc="upper center",
        bbox_to_anchor=(0.5, -0.18),
        ncol=3,
        frameon=False,
    )
    return None


def _lengths(fig: Any, iters: list[Record]) -> str | None:
    """Output lengths, and what their tail costs: generation time, the tail (90% of the batch
    generated to its last sample) and, with over-sampling, the groups aborted (or paused, with
    partial rollout)."""
    keys = ["len/mean", "len/p50", "len/p90", "len/max"]
    if not any(_series(iters, k)[0] for k in keys):
        return "no len/* recorded"
    top, bottom = fig.subplots(2, 1, sharex=True)
    _lines(top, iters, keys, "response length (tokens)")
    top.legend(loc="best")
    if _lines(bottom, iters, ["t/generation", "t/tail"], "seconds"):
        bottom.legend(loc="upper left")
        ax, ys = _series(iters, "rollout/aborted_groups")
        px, ps = _series(iters, "rollout/paused_groups")
        if any(ys) or any(ps):
            twin = bottom.twinx()
            if any(ys):
                twin.bar(ax, ys, color="tab:gray", alpha=0.3, label="groups aborted (over-sampling)")
            if any(ps):
                twin.bar(px, ps, color="tab:green", alpha=0.3, label="groups paused (partial rollout)")
            twin.set_ylabel("groups")
            twin.legend(loc="upper right")
            bottom.set_zorder(twin.get_zorder() + 1)  # the times drawn over the bars
            bottom.patch.set_visible(False)
        bottom.set_ylim(bottom=0)
    else:
        bottom.text(0.5, 0.5, "generation times not recorded", ha="center", transform=bottom.transAxes)
    return None


def _scale_events(run_dir: Path, iters: list[Record]) -> list[tuple[float, str]]:
    """(iteration, label) of each change of generator instances (events.jsonl `scaled`), placed at
    the iteration during which it was applied."""
    ends = sorted(
        (e, r["iteration"]) for r in iters if isinstance(r.get("timeline"), dict)
        if (e := _num(r["timeline"].get("end"))) is not None
    )  # fmt: skip
    out = []
    for ev in RunDir(run_dir).events():  # damaged lines skipped, with a warning
        if ev["event"] != "scaled" or ev.get("before") == ev.get("after") or not ends:
            continue
        it = next((i for end, i in ends if end >= ev["time"]), ends[-1][1] + 0.5)
        before, after = ev.get("before", "?"), ev.get("after", "?")
        out.append((float(it), f"{before}→{after} gen ({ev.get('source', '?')})"))
    return out


def _mark_scale_events(fig: Any, marks: list[tuple[float, str]]) -> None:
    for n, ax in enumerate(fig.axes):
        for x, label in marks:
            ax.axvline(x, color="tab:gray", linestyle="--", linewidth=1)
            if n == 0:
                ax.annotate(label, (x, 1.0), xycoords=("data", "axes fraction"), rotation=90, size=8,
                            ha="right", va="top", color="tab:gray")  # fmt: skip
