"""A role's reaper: whatever the role started is stopped once the role is gone, even by SIGKILL.
It outlives the signals SLURM sends every process of the job step (USR2, its time-limit warning)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
from support.helpers import REPO

ROLE = """
import subprocess, sys, time
from streamrl_cli.roles import reaper
reaper.start()
# like vLLM's engine: a child in a session of its own, that a group kill would not reach
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
print(child.pid, flush=True)
time.sleep(300)
"""


def test_what_a_killed_role_started_is_stopped():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    role = subprocess.Popen([sys.executable, "-c", ROLE], stdout=subprocess.PIPE, text=True, env=env)
    child = int(role.stdout.readline())
    time.sleep(2)  # the reaper has seen the child
    assert psutil.pid_exists(child)
    (reaper,) = [p for p in psutil.Process(role.pid).children() if "streamrl_cli.roles.reaper" in p.cmdline()]
    for sig in (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT):
        reaper.send_signal(sig)
    time.sleep(1)
    assert reaper.is_running() and reaper.status() != psutil.STATUS_ZOMBIE
    role.send_signal(signal.SIGKILL)
    role.wait(timeout=30)
    deadline = time.monotonic() + 60  # liveness bound
    while psutil.pid_exists(child) and psutil.Process(child).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the killed role's child is still running"
        time.sleep(0.2)
