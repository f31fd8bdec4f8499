"""The local launcher, for real: role processes, the rendezvous server, Ctrl-C and cancel."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

from support.helpers import PREFLIGHT, REPO, STREAMRL, none_alive, streamrl
from support.local_runs import HOLD, TWO, members_ok, run_dir_of, start_held_run, wait_until  # noqa: F401


def pids(run_dir: Path) -> list[dict]:
    return json.loads((run_dir / "local.json").read_text())


def test_local_run_meets_at_the_rendezvous_and_finishes(runs_root):
    out = streamrl("run", "local", *PREFLIGHT, TWO, "--root", str(runs_root))
    assert out.returncode == 0, out.stdout + out.stderr
    run_dir = run_dir_of(runs_root)
    info = json.loads((run_dir / "run.json").read_text())
    assert info["state"] == "finished" and info["launchers"] == ["local"]
    records = {f.stem: json.loads(f.read_text()) for f in (run_dir / "members").glob("*.json")}
    assert set(records) == {"rendezvous-0", "trainer-0", "generator-0", "generator-1"}
    for rec in (records[k] for k in ("trainer-0", "generator-0", "generator-1")):
        assert rec["preflight_ok"] and rec["exit_code"] == 0
        assert rec["peers"] == {"trainer": 1, "generator": 2}
    assert none_alive(pids(run_dir)), "the rendezvous server must stop with the run"
    rdv = json.loads((run_dir / "rendezvous.json").read_text())
    assert rdv["url"].startswith("http://127.0.0.1:") and "stopped" in rdv
    assert (run_dir / "logs" / "generator" / "generator-1.log").exists()
    # every member posted its preflight metrics through the server
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 3


def test_dry_run_writes_everything_and_prints_the_run_dir_last(runs_root):
    out = streamrl("run", "slurm-local", "--dry-run", "--root", str(runs_root))
    assert out.returncode == 0, out.stderr
    run_dir = Path(out.stdout.strip().splitlines()[-1])
    assert run_dir.parent == runs_root.resolve()
    assert {p.name for p in (run_dir / "jobs").iterdir()} == {
        "local-trainer.sbatch",
        "local-generator.sbatch",
    }
    assert {p.name for p in (run_dir / "roles").iterdir()} == {
        "trainer.yaml",
        "generator.yaml",
        "rendezvous.yaml",
    }
    assert json.loads((run_dir / "run.json").read_text())["state"] == "dry-run"
    assert not (run_dir / "jobs.json").exists() and not (run_dir / "rendezvous.json").exists()


def test_ctrl_c_stops_every_role_and_leaves_no_orphans(runs_root):
    proc, run_dir = start_held_run(runs_root)
    try:
        recs = pids(run_dir)
        assert len(recs) == 4 and not none_alive(recs)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, out
    assert none_alive(recs), "a role survived Ctrl-C"
    assert json.loads((run_dir / "run.json").read_text())["state"] == "cancelled"


def test_cancel_from_another_terminal_stops_a_local_run(runs_root):
    proc, run_dir = start_held_run(runs_root)
    try:
        recs = pids(run_dir)
        out = streamrl("cancel", run_dir.name[:12])  # a unique prefix of the run id
        assert out.returncode == 0, out.stderr
        assert "stopped local generator rank 1" in out.stdout
        proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert none_alive(recs)
    events = [json.loads(x)["event"] for x in (run_dir / "events.jsonl").read_text().splitlines()]
    assert "cancelled" in events
    assert json.loads((run_dir / "run.json").read_text())["state"] == "cancelled"


def test_a_failing_role_fails_the_run_and_shows_its_log(runs_root):
    out = streamrl(
        "run",
        "local",
        PREFLIGHT[0],
        "roles.generator.program=streamrl_cli.no_such_module:main",
        "--root",
        str(runs_root),
    )
    assert out.returncode == 1
    assert (
        "generator rank 0 exited with 1" in out.stdout
        and "No module named 'streamrl_cli.no_such_module'" in out.stdout
    )
    run_dir = run_dir_of(runs_root)
    assert json.loads((run_dir / "run.json").read_text())["state"] == "failed"
    assert none_alive(pids(run_dir))


def test_a_run_without_progress_past_its_bound_shows_as_stalled(runs_root):
    """Preflight roles hold and heartbeat but never train: past train.stall_after_s the run is
    `stalled`, in the JSON and the table, with a problem that says for how long and the errors."""
    proc = subprocess.Popen(
        [*STREAMRL, "run", "local", *PREFLIGHT, TWO, *HOLD, "train.stall_after_s=3",
         "--root", str(runs_root)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    try:
        run_dir = wait_until(
            lambda: runs_root.exists() and any(runs_root.iterdir()) and run_dir_of(runs_root),
            what="run directory",
        )
        doc = wait_until(
            lambda: (
                (d := json.loads(streamrl("status", str(run_dir), "--json").stdout))["state"] == "stalled"
                and d
            ),
            timeout=90,
            what="the stalled state",
        )
        (problem,) = [p for p in doc["problems"] if p.startswith("no progress for")]
        assert "train.stall_after_s=3" in problem and "last errors: none reported" in problem
        assert "stalled" in streamrl("status", str(run_dir)).stdout
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=120)
