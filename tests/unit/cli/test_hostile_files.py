"""Hostile or damaged files: recipes that would recurse, explode or not decode, non-finite
numbers, and run directories whose bookkeeping was damaged from outside. Every case is a clear
message from the real CLI (exit 2 for a user's mistake), never a traceback, and a damaged run
directory never hides processes that keep running."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from support.helpers import streamrl

BASE = "defaults:\n  - local\n  - _self_\n"


def laughs(levels: int = 9) -> str:
    lines = [BASE.rstrip("\n"), 'a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]")
    return "\n".join([*lines, f"run: {{name: *a{levels - 1}}}"]) + "\n"


# (name, {file: bytes}, the recipe to run, fragments the message must contain)
RECIPES = [
    ("self-including defaults", {"self.yaml": b"defaults:\n  - self\n  - _self_\n"}, "self.yaml",
     ["`defaults` form a cycle: self.yaml -> self.yaml"]),
    ("circular defaults", {"a.yaml": b"defaults:\n  - b\n  - _self_\n", "b.yaml": b"defaults:\n  - a\n"},
     "a.yaml", ["`defaults` form a cycle: a.yaml -> b.yaml -> a.yaml"]),
    ("not UTF-8", {"latin.yaml": BASE.encode() + b"run: {name: caf\xe9}\n"}, "latin.yaml",
     ["line 4: byte 0xe9 is not UTF-8"]),
    ("recursive alias", {"alias.yaml": BASE.encode() + b"x: &a [*a]\n"}, "alias.yaml",
     ["line 4", "alias refers to a node that contains it"]),
    ("billion laughs", {"laughs.yaml": laughs().encode()}, "laughs.yaml",
     ["expands to more than 100000 values", "billion laughs"]),
    ("deep nesting", {"deep.yaml": BASE.encode() + b"x: " + b"[" * 200 + b"]" * 200 + b"\n"}, "deep.yaml",
     ["nests deeper than 64 levels"]),
]  # fmt: skip


@pytest.mark.parametrize("files,recipe,want", [c[1:] for c in RECIPES], ids=[c[0] for c in RECIPES])
def test_hostile_recipe_files_are_clear_errors(tmp_path, runs_root, files, recipe, want):
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    out = streamrl("run", str(tmp_path / recipe), "--dry-run", "--root", str(runs_root), timeout=60)
    text = out.stdout + out.stderr
    assert out.returncode == 2, text
    assert "Traceback" not in text
    flat = " ".join(text.split())
    for fragment in want:
        assert fragment in flat, text
    assert not runs_root.exists() or not list(runs_root.iterdir())  # nothing written


@pytest.mark.parametrize(
    "override", ["algorithm.lr=nan", "algorithm.lr=inf", "algorithm.lr=-inf", "algorithm.clip_ratio=nan"]
)
def test_non_finite_numbers_are_refused(runs_root, override):
    out = streamrl("run", "local", override, "--dry-run", "--root", str(runs_root), timeout=60)
    text = " ".join((out.stdout + out.stderr).split())
    assert out.returncode == 2, text
    assert f"command line `{override}`" in text and "expected a finite number" in text


# ---- run directories ----


def fake_role(run_dir: Path, role: str) -> subprocess.Popen:
    """A long-lived process that looks like a role of this run (its command line and directory)."""
    return subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)", "-m", "streamrl_cli.roles",
         str(run_dir / "roles" / f"{role}.yaml"), "--rank", "0"],
        cwd=run_dir, start_new_session=True,
    )  # fmt: skip


def record(run_dir: Path, procs: list[tuple[str, subprocess.Popen]]) -> None:
    recs = [
        {"role": r, "rank": 0, "pid": p.pid, "created": psutil.Process(p.pid).create_time(), "log": "x"}
        for r, p in procs
    ]
    (run_dir / "local.json").write_text(json.dumps(recs))


def test_damaged_local_json_still_shows_and_stops_the_running_processes(dry_run):
    trainer = fake_role(dry_run, "trainer")
    try:
        record(dry_run, [("trainer", trainer)])
        (dry_run / "local.json").write_bytes(b'[{"role": "trainer", "ra')  # cut short
        out = streamrl("status", str(dry_run), "--json", timeout=60)
        assert out.returncode == 0, out.stderr
        doc = json.loads(out.stdout)
        assert any("local.json: damaged" in p for p in doc["problems"]), doc["problems"]
        (role,) = [r for r in doc["roles"] if r["role"] == "trainer"]
        assert [p["pid"] for p in role["processes"]] == [trainer.pid]

        out = streamrl("cancel", str(dry_run), timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "local.json is damaged" in out.stderr
        assert f"stopped local trainer rank 0 (pid {trainer.pid})" in out.stdout
        assert "nothing was running" not in out.stdout
        assert trainer.wait(timeout=20) is not None
    finally:
        trainer.kill()


def test_truncated_run_json_is_said_and_cancel_still_stops_the_run(dry_run):
    trainer = fake_role(dry_run, "trainer")
    try:
        record(dry_run, [("trainer", trainer)])
        whole = (dry_run / "run.json").read_bytes()
        (dry_run / "run.json").write_bytes(whole[: len(whole) // 2])
        out = streamrl("status", str(dry_run), "--json", timeout=60)
        assert out.returncode == 0, out.stderr
        assert any("run.json: damaged" in p for p in json.loads(out.stdout)["problems"])
        out = streamrl("cancel", str(dry_run), timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        assert f"pid {trainer.pid}" in out.stdout and "run.json: damaged" in out.stderr
        assert trainer.wait(timeout=20) is not None
        # The damaged bytes are kept for a person; run.json is readable again.
        assert (dry_run / "run.json.damaged").read_bytes() == whole[: len(whole) // 2]
        assert json.loads((dry_run / "run.json").read_text())["state"] == "cancelled"
    finally:
        trainer.kill()


def test_a_non_utf8_line_in_the_catalog_is_skipped_with_a_warning(dry_run, streamrl_home):
    catalog = streamrl_home / "catalog.jsonl"
    good = catalog.read_bytes()
    catalog.write_bytes(b'{"run": "x", "path": "/tmp/caf\xe9"}\n' + good + b"\xff\xfe garbage\n" + good)
    out = streamrl("status", timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert dry_run.name in out.stdout
    assert "catalog.jsonl: skipped unreadable line(s) 1, 3" in out.stderr
    assert "Traceback" not in out.stderr


def test_resume_without_a_checkpoint_is_refused_before_launching(dry_run):
    out = streamrl("run", "--resume", str(dry_run), timeout=60)
    text = " ".join((out.stdout + out.stderr).split())
    assert out.returncode == 2, text
    assert "no complete checkpoint" in text and "Traceback" not in text
    assert not (dry_run / "local.json").exists()  # nothing was started


@pytest.mark.parametrize(
    "damage", [b"model: {path: [unclosed\n", b"\xff\xfe\x00", b"x: &a [*a]\n", b"train: {iterations: lots}\n"]
)
def test_resume_with_a_damaged_config_names_the_file(dry_run, damage):
    ckpt = dry_run / "checkpoints" / "iter-000001"
    ckpt.mkdir(parents=True)
    (ckpt / "state.json").write_text("{}")
    (dry_run / "config.yaml").write_bytes(damage)
    started = time.time()
    out = streamrl("run", "--resume", str(dry_run), timeout=60)
    text = " ".join((out.stdout + out.stderr).split())
    assert out.returncode == 2, text
    assert "config.yaml" in text and "Traceback" not in text, text
    assert not (dry_run / "local.json").exists()
    assert time.time() - started < 60


def test_a_run_directory_that_lost_run_json_is_still_found_shown_and_cancelled(dry_run):
    trainer = fake_role(dry_run, "trainer")
    try:
        record(dry_run, [("trainer", trainer)])
        (dry_run / "run.json").unlink()
        out = streamrl("status", str(dry_run), "--json", timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        doc = json.loads(out.stdout)
        assert any("run.json: missing" in p for p in doc["problems"]), doc["problems"]
        assert doc["recorded_state"] is None and doc["state"] == "running"  # its process says so
        (role,) = [r for r in doc["roles"] if r["role"] == "trainer"]
        assert [p["pid"] for p in role["processes"]] == [trainer.pid]
        assert "run.json is missing" in out.stderr and "local.json" in out.stderr

        out = streamrl("cancel", str(dry_run), timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        assert f"stopped local trainer rank 0 (pid {trainer.pid})" in out.stdout
        assert trainer.wait(timeout=20) is not None
        assert json.loads((dry_run / "run.json").read_text())["state"] == "cancelled"
    finally:
        trainer.kill()


def test_a_directory_that_holds_no_run_is_said_to_be_none(dry_run, tmp_path):
    empty = tmp_path / "not-a-run"
    empty.mkdir()
    (empty / "config.yaml").write_text("x: 1\n")  # a config.yaml alone makes no run
    for command in ("status", "cancel", "plot"):
        out = streamrl(command, str(empty), timeout=60)
        text = " ".join((out.stdout + out.stderr).split())
        assert out.returncode == 2, text
        assert f"{empty} is not a run directory" in text and "streamrl run" in text, text
        assert "Traceback" not in text
    # The directory of runs itself: the message names the runs it holds.
    out = streamrl("status", str(dry_run.parent), timeout=60)
    text = " ".join((out.stdout + out.stderr).split())
    assert out.returncode == 2 and f"it holds run directories: {dry_run.name}" in text, text


def test_a_torn_line_in_events_jsonl_is_skipped_and_reported(tmp_path):
    from support.metric_runs import make_run, simulate

    recs = simulate("async", iterations=4)
    run_dir = make_run(tmp_path, recs)
    good = [
        {"time": recs[1]["time"], "event": "scaled", "before": 1, "after": 2, "source": "user"},
        {"time": recs[-1]["time"], "event": "finished", "failed": []},
    ]
    (run_dir / "events.jsonl").write_text(
        json.dumps(good[0]) + "\n" + '{"time": 17000, "event": "sca\n' + "42\n" + json.dumps(good[1]) + "\n"
    )
    out = streamrl("plot", str(run_dir), "--out", str(tmp_path / "plots"), timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "events.jsonl: 2 damaged lines skipped (lines 2, 3)" in " ".join(out.stderr.split())
    assert (tmp_path / "plots" / "throughput.png").is_file()

    out = streamrl("status", str(run_dir), "--json", timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    doc = json.loads(out.stdout)
    assert any("events.jsonl: 2 damaged lines skipped" in p for p in doc["problems"]), doc["problems"]
    assert doc["outcome"]["event"] == "finished"  # the lines around the damage are still read


def test_cancel_says_what_happened_to_each_process_and_leaves_a_reused_pid_alone(dry_run):
    # A stranger's process group that holds a pid this run once recorded (the pid was reused).
    stranger = subprocess.Popen(["bash", "-c", "sleep 120 & wait"], start_new_session=True)
    generator = fake_role(dry_run, "generator")
    try:
        deadline = time.monotonic() + 30
        while not psutil.Process(stranger.pid).children():  # its group has a member besides itself
            assert time.monotonic() < deadline, "the stranger's child did not start"
            time.sleep(0.05)
        record(dry_run, [("trainer", stranger), ("generator", generator)])
        recs = json.loads((dry_run / "local.json").read_text())
        recs[0]["created"] -= 100  # the recorded trainer started long before the stranger
        (dry_run / "local.json").write_text(json.dumps(recs))

        out = streamrl("cancel", str(dry_run), timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        text = " ".join(out.stdout.split())
        assert f"stopped local generator rank 0 (pid {generator.pid})" in text
        assert f"stopped local trainer rank 0 (pid {stranger.pid})" not in text
        assert (
            f"local trainer rank 0 (pid {stranger.pid}): not signalled, its pid now belongs to another "
            "process (bash" in text
        ), text
        assert generator.wait(timeout=20) is not None
        assert stranger.poll() is None and psutil.Process(stranger.pid).children()  # untouched
    finally:
        generator.kill()
        stranger.kill()
        for child in psutil.Process(stranger.pid).children() if stranger.poll() is None else []:
            child.kill()


def test_stop_does_not_claim_a_process_that_had_already_exited():
    from streamrl_cli.launch.local import LocalProc, stop

    proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    created = psutil.Process(proc.pid).create_time()
    proc.wait(timeout=30)
    (result,) = stop([LocalProc(role="trainer", rank=0, pid=proc.pid, created=created, log="x")])
    assert result.sent is None and result.ended
    assert result.describe() == f"local trainer rank 0 (pid {proc.pid}): not signalled, it had already exited"


def squeue_state(job_id: str) -> str:
    """The job's state as SLURM reports it (squeue keeps an ended job a while; sacct after)."""
    out = subprocess.run(
        ["squeue", "-h", "--states=all", "-j", job_id, "-o", "%T"], capture_output=True, text=True
    )
    if out.stdout.strip():
        return out.stdout.split()[0]
    out = subprocess.run(
        ["sacct", "-X", "-n", "-P", "-o", "State", "-j", job_id], capture_output=True, text=True
    )
    return out.stdout.split()[0] if out.stdout.split() else "UNKNOWN"


@pytest.mark.slurm
@pytest.mark.slow
def test_cancel_of_a_slurm_run_with_a_damaged_run_json_scancels_the_jobs_of_jobs_json(dry_run, slurm):
    sub = subprocess.run(
        ["sbatch", "--parsable", "--job-name", "streamrl-hostile-test", "--output", "/dev/null",
         "--wrap", "sleep 600"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.strip().split(";")[0]
    try:
        # jobs.json as `streamrl run` writes it (launch.launcher.submit), the job a harmless sleep.
        script = dry_run / "jobs" / "trainer.sbatch"
        partition = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%P"], capture_output=True, text=True)
        job = {
            "role": "trainer",
            "cluster": "local",
            "slurm_cluster": None,
            "job_id": job_id,
            "array": None,
            "partition": partition.stdout.strip(),
            "submitted": time.time(),
            "script": str(script),
        }
        (dry_run / "jobs.json").write_text(json.dumps([job], indent=2, sort_keys=True) + "\n")
        (dry_run / "run.json").write_bytes(b'{"name": "local", "state": "runn')  # cut short
        assert squeue_state(job_id) in ("PENDING", "RUNNING", "CONFIGURING")

        out = streamrl("cancel", str(dry_run), timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        assert f"scancel {job_id} (trainer on default cluster)" in out.stdout
        assert "nothing to cancel" not in out.stdout
        assert "run.json: damaged" in out.stderr
        deadline = time.monotonic() + 60
        while squeue_state(job_id) not in ("CANCELLED", "COMPLETED", "FAILED"):
            assert time.monotonic() < deadline, f"job {job_id} is still {squeue_state(job_id)}"
            time.sleep(0.5)
        assert squeue_state(job_id) == "CANCELLED"
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
