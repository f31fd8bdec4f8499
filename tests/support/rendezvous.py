"""A real rendezvous server in a subprocess, for tests of members that talk to it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from streamrl_cli.rundir import RunDir


def start_rendezvous(run_dir: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "streamrl_cli.rendezvous", "--run-dir", str(run_dir), "--lease-s", "0.5"]
    proc = subprocess.Popen([*cmd, "--log-level", "WARNING"])
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if json.loads((RunDir(run_dir).endpoint).read_text()).get("pid") == proc.pid:
                return proc
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("rendezvous server did not start")
