"""Metrics of a run: reading metrics.jsonl back, the PNG plots, `streamrl plot`, and the sinks."""

from __future__ import annotations

import json
import struct
import sys
import types
from pathlib import Path

import pytest
from support.helpers import streamrl
from support.metric_runs import T0, make_run, simulate  # noqa: F401

from streamrl_cli.errors import StreamRLError
from streamrl_cli.metrics.plots import plot_run
from streamrl_cli.metrics.read import read_iterations
from streamrl_cli.metrics.sinks import JsonlSink, make_sinks, scalars
from streamrl_cli.rundir import RunDir, catalog_add

PLOTS = ["reward.png", "training.png", "throughput.png", "timeline.png", "lengths.png"]


def generator_line(i: int) -> dict:
    """Generators post to the same file; one even carries an iteration, and must be ignored."""
    return {"time": T0 + i, "member_id": "generator-0", "role": "generator", "rank": 0, "iteration": i}


def messy_run(root: Path, mode: str) -> Path:
    """Six iterations among generator lines, one garbage line, and a torn last line."""
    lines: list = []
    for rec in simulate(mode):
        lines += [rec, generator_line(rec["iteration"])]
    lines.insert(3, "this is not JSON\n")
    lines.append('{"time": 1, "member_id": "trainer-0", "role": "trai')
    return make_run(root, lines)


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


# --- reading -------------------------------------------------------------------------------------


def test_read_iterations_keeps_trainer_records_and_the_last_of_a_repeat(tmp_path):
    resumed = simulate("async", iterations=3, first=3, t0=T0 + 100, reward0=-1.0)  # repeats 3, 4, 5
    run_dir = make_run(tmp_path, [*simulate("async"), generator_line(9), "garbage\n", *resumed, "{torn"])
    iters = read_iterations(run_dir)
    assert [r["iteration"] for r in iters] == [0, 1, 2, 3, 4, 5]
    assert all(r["role"] == "trainer" for r in iters)
    assert iters[2]["reward_mean"] == pytest.approx(0.2 + 0.16)
    assert iters[4]["reward_mean"] == pytest.approx(-1.0 + 0.08 * 4)  # the resumed run's record wins


def test_evaluations_join_the_iteration_they_evaluated(tmp_path):
    """The trainer posts an evaluation as its own record (no `iteration` key) when it ends; its
    eval/* values reach the plots and status through the evaluated iteration's record."""
    ev = {"time": T0 + 50, "member_id": "trainer-0", "role": "trainer", "rank": 0,
          "eval/iteration": 2, "eval/reward_mean": 0.7, "eval/samples": 8}  # fmt: skip
    other = {**ev, "role": "generator", "eval/iteration": 3, "eval/reward_mean": 0.1}
    run_dir = make_run(tmp_path, [*simulate("sync-stream"), ev, other])
    iters = read_iterations(run_dir)
    assert [r.get("eval/reward_mean") for r in iters] == [None, None, 0.7, None, None, None]
    out = plot_run(run_dir, tmp_path / "plots")
    assert "reward" not in out.skipped


def test_read_iterations_without_a_metrics_file(tmp_path):
    assert read_iterations(tmp_path) == []


# --- plots ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["baseline", "sync-stream", "async"])
def test_plot_run_writes_five_pngs(tmp_path, mode):
    run_dir = messy_run(tmp_path, mode)
    files = plot_run(run_dir, tmp_path / "out")
    assert [p.name for p in files] == PLOTS and files.skipped == {}
    for path in files:
        width, height = png_size(path)
        assert width >= 800 and height >= 400 and path.stat().st_size > 10_000, path
    import matplotlib.image

    assert matplotlib.image.imread(files[3]).shape[:2] == (450, 1200)


def test_plot_run_skips_plots_whose_data_is_missing(tmp_path):
    old = [
        {"role": "trainer", "rank": 0, "iteration": i, "mode": "baseline", "reward_mean": 0.1 * i}
        for i in range(4)
    ]
    files = plot_run(make_run(tmp_path, old), tmp_path / "out")
    assert [p.name for p in files] == ["reward.png"]
    assert files.skipped == {
        "training": "no approx_kl, loss/kl, grad_norm, clip_frac, loss/entropy or loss/value recorded",
        "throughput": "no samples_per_s, tokens_per_s or idle/* recorded",
        "timeline": "no timeline recorded",
        "lengths": "no len/* recorded",
    }


def test_plot_run_without_iterations_is_a_user_error(tmp_path):
    run_dir = make_run(tmp_path, [generator_line(0), "nonsense\n"])
    with pytest.raises(StreamRLError, match="no iterations recorded yet in .*metrics.jsonl"):
        plot_run(run_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# --- the command ---------------------------------------------------------------------------------


def test_cli_plot_by_directory_and_by_name(tmp_path):
    run_dir = messy_run(tmp_path, "sync-stream")
    out = streamrl("plot", str(run_dir))
    assert out.returncode == 0, out.stderr
    assert [p.name for p in sorted((run_dir / "plots").iterdir())] == sorted(PLOTS)
    assert all(f"wrote {run_dir / 'plots' / name}" in out.stdout for name in PLOTS)
    catalog_add(RunDir(run_dir))
    out = streamrl("plot", "demo", "--out", str(tmp_path / "elsewhere"))
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in (tmp_path / "elsewhere").iterdir()) == sorted(PLOTS)


def test_cli_plot_without_iterations_fails_cleanly(tmp_path):
    run_dir = make_run(tmp_path, [generator_line(0)])
    out = streamrl("plot", str(run_dir))
    assert out.returncode != 0
    assert "no iterations recorded yet in" in out.stderr
    assert "Traceback" not in out.stderr + out.stdout


# --- sinks ---------------------------------------------------------------------------------------

RECORD = {
    "iteration": 3,
    "mode": "async",
    "kl": 0.1,
    "done": True,
    "loss": {"kl": 0.5},
    "timeline": {"start": 1.0},
}


def test_scalars_flatten_numbers_and_leave_the_timeline_out():
    assert scalars(RECORD) == {"iteration": 3.0, "kl": 0.1, "loss/kl": 0.5}


def test_jsonl_sink_appends_one_flushed_line_per_record(tmp_path):
    path = tmp_path / "sub" / "metrics.jsonl"
    sink = JsonlSink(path)
    sink.log(RECORD, step=3)
    assert json.loads(path.read_text()) == {"step": 3, **RECORD}  # readable before close
    sink.log({"kl": 0.2}, step=4)
    sink.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [3, 4]


def test_make_sinks_rejects_unknown_names(tmp_path):
    assert make_sinks([], tmp_path, "demo", "streamrl") == []
    with pytest.raises(StreamRLError, match=r"'tensorbord', 'mlflow'.*valid: tensorboard, wandb"):
        make_sinks(["tensorbord", "wandb", "mlflow"], tmp_path, "demo", "streamrl")


def test_missing_dashboard_packages_say_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # `import tensorboard` now fails
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(StreamRLError, match=r"pip install tensorboard.*streamrl\[tensorboard\]"):
        make_sinks(["tensorboard"], tmp_path, "demo", "streamrl")
    with pytest.raises(StreamRLError, match=r"pip install wandb.*streamrl\[wandb\]"):
        make_sinks(["wandb"], tmp_path, "demo", "streamrl")


class FakeWandb(types.ModuleType):
    """Records what the sink asks of wandb."""

    def __init__(self) -> None:
        super().__init__("wandb")
        self.inits: list[dict] = []
        self.logged: list[tuple[dict, int]] = []
        self.finished = False

    def init(self, **kw):  # type: ignore[no-untyped-def]
        self.inits.append(kw)
        return types.SimpleNamespace(log=lambda d, step: self.logged.append((d, step)), finish=self.finish)

    def finish(self) -> None:
        self.finished = True


def test_wandb_sink_honours_wandb_mode_and_logs_scalars(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_MODE", "offline")
    (sink,) = make_sinks(["wandb"], tmp_path, "demo", "streamrl")
    sink.log(RECORD, step=3)
    sink.close()
    assert fake.inits == [{"project": "streamrl", "name": "demo", "dir": str(tmp_path), "mode": "offline"}]
    assert fake.logged == [({"iteration": 3.0, "kl": 0.1, "loss/kl": 0.5}, 3)] and fake.finished


def test_tensorboard_sink_writes_event_files(tmp_path):
    pytest.importorskip("tensorboard")
    (sink,) = make_sinks(["tensorboard"], tmp_path, "demo", "streamrl")
    sink.log(RECORD, step=3)
    sink.close()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


# --- what the figures hold -----------------------------------------------------------------------


def trained(n: int = 30, ppo: bool = True, evals: bool = True) -> list[dict]:
    """Iteration records with the keys the trainer writes (learner.py) and noisy values."""
    import random

    rng = random.Random(0)
    recs = []
    for i in range(n):
        rec = {
            "role": "trainer",
            "rank": 0,
            "iteration": i,
            "mode": "async",
            "reward_mean": min(1.0, max(0.0, 0.2 + 0.02 * i + rng.gauss(0, 0.1))),
            "reward_std": 0.45,
            "reward_min": 0.0,
            "reward_max": 1.0,
            "approx_kl": abs(rng.gauss(0.004, 0.002)),
            "loss/kl": 0.0002 * i,
            "grad_norm": abs(rng.gauss(0.9, 0.3)),
            "clip_frac": abs(rng.gauss(0.05, 0.02)),
            "loss/entropy": 1.2 - 0.01 * i,
            "loss/policy": rng.gauss(0, 0.01),
        }
        if ppo:
            rec["loss/value"] = 0.5 * 0.95**i
        if evals and i % 10 == 9:
            rec["eval/reward_mean"] = 0.1 + 0.02 * i
        recs.append(rec)
    return recs


def figure_of(draw, iters):  # type: ignore[no-untyped-def]
    from matplotlib.figure import Figure

    fig = Figure()
    assert draw(fig, iters) is None
    return fig


def test_training_figure_plots_what_the_trainer_records():
    from streamrl_cli.metrics.plots import _training

    fig = figure_of(_training, trained())
    titles = [ax.get_title() for ax in fig.axes if ax.get_visible()]
    assert titles == ["KL", "gradient norm", "clip fraction", "entropy", "value loss (PPO)", "policy loss"]
    kl = fig.axes[0]
    labels = [t.get_text() for t in kl.get_legend().get_texts()]
    assert labels == ["approx KL to the behaviour policy (smoothed)", "KL to the reference (smoothed)"]
    assert len(kl.lines) == 4  # raw + smoothed of each


def test_training_figure_of_grpo_has_no_value_panel():
    from streamrl_cli.metrics.plots import _training

    fig = figure_of(_training, trained(ppo=False))
    assert "value loss (PPO)" not in [ax.get_title() for ax in fig.axes if ax.get_visible()]


def test_reward_band_stays_within_the_rewards_range_and_eval_is_drawn():
    from streamrl_cli.metrics.plots import _reward

    fig = figure_of(_reward, trained())
    (ax,) = fig.axes
    (band,) = ax.collections
    ys = [y for path in band.get_paths() for _, y in path.vertices]
    assert min(ys) >= 0.0 and max(ys) <= 1.0  # mean ± 0.45 would reach past both ends
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "eval reward mean (held out)" in labels and "reward mean (smoothed)" in labels
    (eval_line,) = [line for line in ax.lines if line.get_label() == "eval reward mean (held out)"]
    assert list(eval_line.get_xdata()) == [9, 19, 29]


def test_smoothing_follows_the_trend_with_less_noise():
    from statistics import pstdev

    from streamrl_cli.metrics.plots import smooth

    noisy = [(-1) ** i * 1.0 + 0.1 * i for i in range(60)]
    smoothed = smooth(noisy)
    assert len(smoothed) == 60 and smoothed[0] == noisy[0]
    diffs = lambda ys: [b - a for a, b in zip(ys, ys[1:], strict=False)]  # noqa: E731
    assert pstdev(diffs(smoothed)) < pstdev(diffs(noisy)) / 4
    assert abs(smoothed[-1] - 0.1 * 59) < 1.0


def test_timeline_legend_names_every_colour_drawn():
    from matplotlib.colors import to_hex

    from streamrl_cli.metrics.plots import _timeline

    fig = figure_of(_timeline, simulate("async"))
    (ax,) = fig.axes
    drawn = {to_hex(c) for coll in ax.collections for c in coll.get_facecolors()}
    in_legend = {to_hex(p.get_facecolor()) for p in _legend_patches(ax.get_legend())}
    assert len(drawn) == 6 and drawn <= in_legend


def _legend_patches(legend):  # type: ignore[no-untyped-def]
    """Patches inside the legend's drawn entries (tuple handles draw one patch per colour)."""
    from matplotlib.patches import Rectangle

    return [a for a in legend.findobj(Rectangle) if a is not legend.legendPatch]


def relay_line(
    version: int, at: float, mode: str | None, *, reason: str = "", member: str = "generator-2"
) -> dict:
    """What a far site's relay posts (every few seconds, its last transfer's keys repeated)."""
    line = {
        "time": at + 3, "member_id": member, "role": "generator", "rank": 2, "weights/version": version,
        "weights/at": at, "weights/transfer_s": 0.5, "weights/relay": 1, "weights/wan_bytes": 1000,
        "weights/wan_s": 0.3,
    }  # fmt: skip
    if mode is not None:  # older generators do not say
        line |= {"weights/wan_mode": mode, "weights/wan_reason": reason}
    return line


def test_the_timeline_marks_each_version_fetched_across_sites_as_a_delta_or_whole(tmp_path):
    from matplotlib.colors import to_hex

    from streamrl_cli.metrics.plots import ACROSS, _timeline
    from streamrl_cli.metrics.read import read_relay_fetches

    iters = simulate("async")
    ends = [r["timeline"]["weight_sync"][1] for r in iters if r["timeline"].get("weight_sync")]
    lines: list = [*iters, relay_line(1, ends[0], "full", reason="no_base")]
    lines += [relay_line(1, ends[0], "full", reason="no_base")]  # the same transfer, reported again
    lines += [relay_line(v + 1, at, "delta") for v, at in enumerate(ends[1:], start=1)]
    lines += [relay_line(9, ends[-1], None), {"member_id": "generator-0", "weights/version": 3}]
    fetches = read_relay_fetches(make_run(tmp_path, lines))
    assert [(f["version"], f["mode"]) for f in fetches] == [
        (1, "full"), *[(v + 1, "delta") for v in range(1, len(ends))], (9, None)
    ]  # fmt: skip
    assert fetches[0]["reason"] == "no_base" and fetches[0]["start"] == ends[0] - 0.5
    fig = figure_of(lambda f, it: _timeline(f, it, fetches), iters)
    (ax,) = fig.axes
    drawn = {to_hex(c) for coll in ax.collections for c in coll.get_facecolors()}
    assert {to_hex(c) for c in ACROSS} <= drawn
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "relay fetch across sites: delta" in labels and "relay fetch across sites: whole" in labels
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        "generation",
        "training",
        "weight sync",
        "across sites",
    ]
