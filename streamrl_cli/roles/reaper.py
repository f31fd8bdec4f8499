"""A role's reaper: when the role process dies, however it dies, what it started dies with it.

Why: vLLM runs its engine in a spawned EngineCore process (and that one its workers). Nothing in
EngineCore watches its parent, so a generator killed with SIGKILL (or the OOM killer) leaves ~2 GB
of engine running, on SLURM as well as locally, where nobody may be watching the role's process
group. So each role process starts this small watcher (`python -m streamrl_cli.roles.reaper PID`):
it keeps a list of the role's descendants, and once the role is gone it stops every one still
running (SIGTERM, then SIGKILL), then exits. It ignores SIGTERM/SIGINT, so that stopping the role's
process group does not stop it before the role has gone, and SIGUSR2: SLURM sends its time-limit
warning to every process of the job step, and its default action would end the reaper.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

POLL_S = 0.5
GRACE_S = 3.0


def start(pid: int | None = None) -> subprocess.Popen:
    """Start the reaper of process `pid` (default: this one)."""
    return subprocess.Popen(
        [sys.executable, "-m", "streamrl_cli.roles.reaper", str(pid or os.getpid())],
        stdin=subprocess.DEVNULL,
        close_fds=True,
    )


def watch(pid: int, poll_s: float = POLL_S) -> list[int]:
    """Follow `pid`'s descendants until it is gone; then stop those still running. Returns them."""
    me = os.getpid()
    known: dict[int, float] = {}  # pid -> create time (pids are reused)
    try:
        parent = psutil.Process(pid)
        while parent.is_running() and parent.status() != psutil.STATUS_ZOMBIE:
            for c in parent.children(recursive=True):
                if c.pid != me:
                    try:
                        known.setdefault(c.pid, c.create_time())
                    except psutil.Error:
                        pass
            time.sleep(poll_s)
    except psutil.Error:
        pass  # it is gone
    left = []
    for p_id, created in known.items():
        try:
            p = psutil.Process(p_id)
            if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                left.append(p)
        except psutil.Error:
            continue
    for p in left:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(left, timeout=GRACE_S)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    if left:
        print(f"reaper: role process {pid} gone; stopped {[p.pid for p in left]} it left", file=sys.stderr)
    return [p.pid for p in left]


def main() -> None:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
    watch(int(sys.argv[1]))


if __name__ == "__main__":
    main()
