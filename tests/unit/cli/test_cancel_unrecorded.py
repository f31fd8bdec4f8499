"""`streamrl cancel` of a run whose records cannot name its processes (local.json lost, damaged, or
naming only processes that are gone): the run's role processes are found in the process table and
stopped, and a process that still runs is never reported as exited. Real processes, the real CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
from support.helpers import streamrl

SLEEP = "import time; time.sleep(600)"


def role_argv(role: str) -> list[str]:
    """A long sleep whose command line and directory are those of a role process of the run."""
    return [sys.executable, "-c", SLEEP, "streamrl_cli.roles", f"roles/{role}.yaml", "--rank", "0"]


def role_process(run_dir: Path, role: str) -> subprocess.Popen:
    """Started the way spawn starts a role: in the run directory, leading a session of its own."""
    return subprocess.Popen(role_argv(role), cwd=run_dir, start_new_session=True)


def gone(pid: int, timeout: float = 20.0) -> bool:
    """The process exited (a zombie its parent has not reaped yet counts as exited)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_cancel_stops_a_role_process_when_run_json_and_local_json_are_lost(dry_run):
    trainer = role_process(dry_run, "trainer")
    try:
        (dry_run / "run.json").unlink()
        (dry_run / "local.json").unlink(missing_ok=True)  # a dry run never wrote one
        out = streamrl("cancel", str(dry_run), timeout=60)
        text = " ".join(out.stdout.split())
        assert out.returncode == 0, out.stdout + out.stderr
        assert f"stopped local trainer rank 0 (pid {trainer.pid})" in text, out.stdout + out.stderr
        assert "nothing to cancel" not in text
        assert "local.json is missing" in out.stderr  # said: the processes came from the process table
        assert trainer.wait(timeout=20) is not None
    finally:
        trainer.kill()


def test_cancel_stops_a_role_process_that_leads_no_process_group(dry_run):
    # A shell leads the session and the group; the role process is a member of its group only.
    shell = subprocess.Popen(
        ["sh", "-c", f"{subprocess.list2cmdline(role_argv('trainer'))} & wait"],
        cwd=dry_run,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not psutil.Process(shell.pid).children():
            assert time.monotonic() < deadline, "the role process did not start"
            time.sleep(0.05)
        (role,) = psutil.Process(shell.pid).children()
        deadline = time.monotonic() + 30
        while "streamrl_cli.roles" not in role.cmdline():  # until sh has exec'd python
            assert time.monotonic() < deadline, "the role process did not start"
            time.sleep(0.05)
        assert psutil.Process(role.pid).ppid() == shell.pid and role.pid != shell.pid
        assert os.getpgid(role.pid) == shell.pid  # it leads no group
        (dry_run / "local.json").write_bytes(b'[{"role": "trainer", "ra')  # cut short

        out = streamrl("cancel", str(dry_run), timeout=60)
        text = " ".join((out.stdout + out.stderr).split())
        assert out.returncode == 0, text
        assert "already exited" not in text, text
        assert f"stopped local trainer rank 0 (pid {role.pid})" in text, text
        assert gone(role.pid)
        assert shell.wait(timeout=20) is not None  # its shell saw it end
    finally:
        for child in psutil.Process(shell.pid).children() if shell.poll() is None else []:
            child.kill()
        shell.kill()


def test_cancel_stops_an_unrecorded_role_process_when_the_recorded_ones_are_gone(dry_run):
    # local.json names a trainer that has exited; a live trainer of the run is not in it.
    old = subprocess.Popen([sys.executable, "-c", "pass"], cwd=dry_run, start_new_session=True)
    created = psutil.Process(old.pid).create_time()
    old.wait(timeout=30)
    rec = {"role": "trainer", "rank": 0, "pid": old.pid, "created": created, "log": "x"}
    (dry_run / "local.json").write_text(json.dumps([rec]))
    info = json.loads((dry_run / "run.json").read_text())
    (dry_run / "run.json").write_text(json.dumps({**info, "state": "running"}))
    trainer = role_process(dry_run, "trainer")
    try:
        out = streamrl("status", str(dry_run), "--json", timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        doc = json.loads(out.stdout)
        assert doc["state"] == "running", doc
        (role,) = [r for r in doc["roles"] if r["role"] == "trainer"]
        assert trainer.pid in [p["pid"] for p in role["processes"]]

        out = streamrl("cancel", str(dry_run), timeout=60)
        text = " ".join(out.stdout.split())
        assert out.returncode == 0, out.stdout + out.stderr
        assert f"stopped local trainer rank 0 (pid {trainer.pid})" in text, out.stdout + out.stderr
        assert trainer.wait(timeout=20) is not None
        assert json.loads((dry_run / "run.json").read_text())["state"] == "cancelled"
    finally:
        trainer.kill()


def test_a_dry_run_without_local_json_is_shown_and_left_alone_without_warnings(dry_run):
    out = streamrl("status", str(dry_run), "--json", timeout=60)
    assert out.returncode == 0 and "warning" not in out.stderr, out.stderr
    assert json.loads(out.stdout)["state"] == "dry-run"
    out = streamrl("cancel", str(dry_run), timeout=60)
    assert out.returncode == 0 and "warning" not in out.stderr, out.stderr
    assert "was a dry run: nothing to cancel" in " ".join(out.stdout.split())
    assert not (dry_run / "local.json").exists()


def test_found_processes_join_the_records_once_each(tmp_path):
    from streamrl_cli.launch.local import LocalProc, with_found

    # A recorded role that leads its group, with a helper in that group (a forked engine process
    # shares the role's command line and directory, so the process table search finds it too).
    shell = subprocess.Popen(["sh", "-c", f"{subprocess.list2cmdline(role_argv('generator'))} & wait"],
                             cwd=tmp_path, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not psutil.Process(shell.pid).children():
            assert time.monotonic() < deadline, "the helper did not start"
            time.sleep(0.05)
        (helper,) = psutil.Process(shell.pid).children()

        def proc(p: psutil.Process, created: float | None = None) -> LocalProc:
            return LocalProc("generator", 0, p.pid, created or p.create_time(), "x")

        leader = proc(psutil.Process(shell.pid))
        assert with_found([leader], [leader, proc(helper)]) == [leader]  # its group is stopped with it
        # A record whose pid another role process of the run holds now gives it its place.
        stale = proc(helper, helper.create_time() - 100)
        assert with_found([stale], [proc(helper)]) == [proc(helper)]
        # An unrecorded process of another group is added.
        other = LocalProc("trainer", 0, os.getpid(), psutil.Process().create_time(), "x")
        assert with_found([leader], [other]) == [leader, other]
    finally:
        for child in psutil.Process(shell.pid).children() if shell.poll() is None else []:
            child.kill()
        shell.kill()
