"""`streamrl plot` marks the scale events of events.jsonl on the throughput figure."""

from __future__ import annotations

import json

from support.metric_runs import make_run, simulate

from streamrl_cli.metrics.plots import _scale_events, plot_run


def with_ends(recs: list[dict]) -> list[dict]:
    for r in recs:  # the trainer records each iteration's end (the test helper leaves it out)
        r["timeline"]["end"] = r["time"]
    return recs


def test_scale_events_are_placed_at_the_iteration_they_happened_in(tmp_path):
    recs = with_ends(simulate("sync-stream", iterations=6))
    run_dir = make_run(tmp_path, recs)
    during_2 = (recs[2]["timeline"]["start"] + recs[2]["time"]) / 2
    events = [
        {"time": during_2, "event": "scaled", "before": 1, "after": 2, "source": "user"},
        {
            "time": recs[4]["time"] - 0.01,
            "event": "scaled",
            "before": 2,
            "after": 2,
            "source": "policy",
        },  # no-op
        {"time": recs[5]["time"] + 100, "event": "scaled", "before": 2, "after": 1, "source": "policy"},
        {"time": during_2, "event": "scale_failed", "error": "x"},
    ]
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    marks = _scale_events(run_dir, recs)
    assert marks == [(2.0, "1→2 gen (user)"), (5.5, "2→1 gen (policy)")]
    files = plot_run(run_dir, tmp_path / "plots")
    assert (tmp_path / "plots" / "throughput.png") in files


def test_a_run_without_scale_events_has_no_marks(tmp_path):
    recs = with_ends(simulate("async", iterations=3))
    run_dir = make_run(tmp_path, recs)
    assert _scale_events(run_dir, recs) == []
