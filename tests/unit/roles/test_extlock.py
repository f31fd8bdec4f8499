"""Stale build locks in torch's extension cache: removed, so that loading an op never waits for ever."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from streamrl_cli.roles.extlock import clear_stale, stale_locks


def make_lock(root: Path, op: str, age_s: float) -> Path:
    lock = root / "py311_cpu" / op / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    then = time.time() - age_s
    os.utime(lock, (then, then))
    return lock


def test_an_old_lock_without_a_builder_is_removed_a_young_one_or_a_live_build_is_kept(tmp_path):
    stale = make_lock(tmp_path, "cpu_adam", 3600)
    young = make_lock(tmp_path, "fused_adam", 1)
    building = make_lock(tmp_path, "shm_comm", 3600)
    # A compiler at work: its working directory is the op's build directory.
    builder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], cwd=building.parent)
    try:
        time.sleep(0.5)
        assert stale_locks(tmp_path, stale_after_s=60) == [stale]
        assert clear_stale(tmp_path, stale_after_s=60) == [stale]
    finally:
        builder.kill()
        builder.wait()
    assert not stale.exists() and young.exists() and building.exists()
    assert clear_stale(tmp_path, stale_after_s=60) == [building]  # its builder is gone now


def test_a_load_waiting_on_a_lock_left_by_a_killed_build_goes_on(tmp_path):
    """torch's own waiter (FileBaton, as its extension loader uses) on a lock nobody will delete: with
    the watch it returns; the subprocess timeout is the liveness bound."""
    lock = make_lock(tmp_path, "cpu_adam", 0)
    code = textwrap.dedent(f"""
        from pathlib import Path
        from torch.utils.file_baton import FileBaton
        from streamrl_cli.roles.extlock import LockWatch

        baton = FileBaton({str(lock)!r}, wait_seconds=0.05)
        assert not baton.try_acquire()  # someone "holds" it: a build killed mid-way
        with LockWatch(Path({str(tmp_path)!r}), stale_after_s=2.0, every_s=0.2) as watch:
            baton.wait()
        print("loaded after removing", [str(p) for p in watch.removed])
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"loaded after removing ['{lock}']" in out.stdout
    assert "removed stale build lock" in out.stderr
