"""`streamrl status` and `streamrl cancel` on runs that have ended, from their records alone."""

from __future__ import annotations

import json
import re
import subprocess
import time

import pytest
from support.helpers import STREAMRL, streamrl

from streamrl_cli.rundir import RunDir, catalog_add, write_json

LONG_NAME = "qwen2.5-7b-grpo-reasoning-with-a-long-name"


def ended_run(root, name=LONG_NAME, state="finished", iterations=40, done=40, stamp="20261124-101500"):
    """A run directory as a finished local run leaves it: run.json, events, 40 iteration records."""
    path = root / f"{name}-{stamp}"
    (path / "members").mkdir(parents=True)
    now = time.time()
    write_json(
        path / "run.json",
        {
            "name": name,
            "run_id": path.name,
            "state": state,
            "iterations": iterations,
            "created": now - 900,
            "started": now - 880,
            "ended": now - 60,
            "launchers": ["local"],
            "clusters": {"local": {"launcher": "local", "slurm_cluster": None, "site": None}},
            "recipe": "recipes/local.yaml",
        },
    )
    with open(path / "metrics.jsonl", "w") as f:
        for i in range(done):
            rec = {"time": now, "member_id": "trainer-0", "role": "trainer", "rank": 0, "iteration": i}
            rec.update({"reward_mean": 0.5 + i / 100, "samples_per_s": 3.25, "idle/trainer": 0.1})
            f.write(json.dumps(rec) + "\n")
            f.write(json.dumps({"member_id": "generator-0", "role": "generator", "rank": 0}) + "\n")
    with open(path / "events.jsonl", "w") as f:
        failed = ["generator-1"] if state == "failed" else []
        lost = ["generator-2"] if state == "failed" else []
        f.write(json.dumps({"time": now - 60, "event": state, "failed": failed, "lost": lost}) + "\n")
    catalog_add(RunDir(path))
    return path


@pytest.mark.parametrize("columns", [200, 80, 60, 40, 30])
def test_runs_table_never_cuts_a_run_id(tmp_path, columns):
    run = ended_run(tmp_path)
    out = streamrl("status", env={"COLUMNS": str(columns)})
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if run.name in line]
    assert len(lines) == 1, out.stdout  # whole, on one line
    assert "finished" in lines[0] and "40/40" in lines[0]
    assert max(len(line) for line in out.stdout.splitlines()) <= max(columns, len(lines[0]))
    if columns >= 80:
        assert "run" in out.stdout.split() and "step" in out.stdout.split()  # still a table
    if columns >= 120:
        assert all(col in out.stdout.split() for col in ("name", "launcher", "clusters", "age"))


def test_run_view_of_a_finished_run_shows_its_last_step_and_how_it_ended(tmp_path):
    ended_run(tmp_path, state="failed", done=12)
    out = streamrl("status", LONG_NAME, env={"COLUMNS": "100"})
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert "no progress reported yet" not in text
    assert "step 12/40" in text and "reward 0.61" in text and "samples_per_s 3.25" in text
    assert re.search(r"ended: failed \d+\.\dm ago after 13\.7m \(generator-1\)", text), text
    assert "lost on the way: generator-2" in text


def test_json_summary_has_step_and_iterations(tmp_path):
    ended_run(tmp_path)
    doc = json.loads(streamrl("status", "--json").stdout)
    (row,) = doc["runs"]
    assert (row["step"], row["iterations"], row["state"]) == (40, 40, "finished")
    one = json.loads(streamrl("status", LONG_NAME, "--json").stdout)
    assert one["progress"]["step"] == 40 and one["outcome"]["event"] == "finished"


def test_watch_off_a_terminal_prints_snapshots_and_ends_with_the_run(tmp_path, streamrl_home):
    run = ended_run(tmp_path, state="running", done=3)
    proc = subprocess.Popen(
        [*STREAMRL, "status", LONG_NAME, "--watch", "--interval", "0.2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**__import__("os").environ, "COLUMNS": "120"},
    )
    try:
        deadline = time.monotonic() + 60
        # Let it print at least two snapshots of the running run, then the run ends.
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(1.5)
            break
        assert proc.poll() is None, proc.communicate()
        with open(run / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"role": "trainer", "rank": 0, "iteration": 39, "reward_mean": 0.9}) + "\n")
        info = json.loads((run / "run.json").read_text())
        write_json(run / "run.json", {**info, "state": "finished"})
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    snapshots = out.split("--- ")
    assert len(snapshots) >= 3, out  # "" before the first, then at least two
    assert "state running" in snapshots[1] and "step 3/40" in snapshots[1]
    assert "state finished" in snapshots[-1] and "step 40/40" in snapshots[-1]


@pytest.mark.parametrize("state", ["finished", "failed", "cancelled"])
def test_cancel_leaves_an_ended_run_alone(tmp_path, state):
    run = ended_run(tmp_path, state=state)
    before = (run / "run.json").read_text(), (run / "events.jsonl").read_text()
    out = streamrl("cancel", LONG_NAME)
    assert out.returncode == 0, out.stderr
    assert f"has already ended ({state}): nothing to cancel" in " ".join(out.stdout.split())
    assert ((run / "run.json").read_text(), (run / "events.jsonl").read_text()) == before


def test_cancel_of_a_dry_run_changes_nothing(tmp_path):
    dry = streamrl("run", "local", "--dry-run", "--root", str(tmp_path / "runs"))
    assert dry.returncode == 0, dry.stderr
    (run,) = (tmp_path / "runs").iterdir()
    before = (run / "run.json").read_text()
    out = streamrl("cancel", run.name)
    assert out.returncode == 0 and "was a dry run: nothing to cancel" in out.stdout
    assert (run / "run.json").read_text() == before and not (run / "events.jsonl").exists()
    # status shows only the roles the run launched: no empty teacher or env_server table
    doc = json.loads(streamrl("status", run.name, "--json").stdout)
    assert [r["role"] for r in doc["roles"]] == ["rendezvous", "trainer", "generator"]
    text = streamrl("status", run.name).stdout
    assert "teacher" not in text and "env_server" not in text and "generator (cluster local)" in text
