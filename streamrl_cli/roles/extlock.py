"""Stale build locks in torch's C++ extension cache: found and removed, never waited on for ever.

DeepSpeed loads its CPU ops (Adam, shared-memory comm) through torch's extension loader, which
guards each op's build directory (``<TORCH_EXTENSIONS_DIR>/<py>_<device>/<op>/``) with a file
named ``lock``, created exclusively by the builder and deleted when it is done. A builder killed
in between (a cancelled run) leaves the file, and every later load of that op polls it for ever
without a word. A lock is *stale* when it is older than a build could take here and no process
works in its directory (the compiler and ninja run with the build directory as their working
directory). :class:`LockWatch` removes stale locks for as long as the trainer loads its ops, so the
wait is bounded by the staleness age; a lock that it cannot remove fails loudly.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from streamrl_cli.errors import StreamRLError

log = logging.getLogger("streamrl.extlock")

# A lock this young may belong to a builder that has not started its compiler yet.
STALE_AFTER_S = 60.0
CHECK_EVERY_S = 5.0


def extensions_root() -> Path:
    """Where torch builds extensions (its own default when TORCH_EXTENSIONS_DIR is not set)."""
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    if env:
        return Path(env)
    return Path(os.path.expanduser("~/.cache/torch_extensions"))


def builders(directory: Path) -> list[int]:
    """Pids of processes working in `directory` (their cwd is in it): a live build of that op."""
    target = str(directory.resolve())
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            cwd = p.cwd()
        except (psutil.Error, OSError):
            continue
        if cwd == target or cwd.startswith(target + os.sep):
            out.append(p.pid)
    return out


def stale_locks(root: Path, *, stale_after_s: float = STALE_AFTER_S, now: float | None = None) -> list[Path]:
    """Lock files under `root` older than `stale_after_s` whose directory no process works in."""
    now = time.time() if now is None else now
    out = []
    for lock in root.glob("*/*/lock"):
        try:
            age = now - lock.stat().st_mtime
        except FileNotFoundError:
            continue  # its builder just finished
        if age >= stale_after_s and not builders(lock.parent):
            out.append(lock)
    return out


def clear_stale(root: Path | None = None, *, stale_after_s: float = STALE_AFTER_S) -> list[Path]:
    """Remove every stale lock under `root`; returns them. A lock that cannot be removed is an error
    (whoever loads that op would wait on it for ever)."""
    root = extensions_root() if root is None else root
    removed = []
    for lock in stale_locks(root, stale_after_s=stale_after_s):
        try:
            lock.unlink()
        except FileNotFoundError:
            continue
        except OSError as e:
            raise StreamRLError(
                f"stale build lock {lock} (left by a killed process; no build runs there) "
                f"cannot be removed: {e}; delete it by hand"
            ) from None
        log.warning(
            "removed stale build lock %s: older than %.0fs and no process builds there "
            "(left by a process killed while building this op)",
            lock,
            stale_after_s,
        )
        removed.append(lock)
    return removed


class LockWatch:
    """While open, a daemon thread clears stale extension locks every `every_s` (the op loader
    itself only polls them); use around the code that loads DeepSpeed's ops. A lock it cannot remove
    is raised at entry, or later given to `on_error` (the loader is blocked on it by then: the caller
    must fail the process, not wait)."""

    def __init__(
        self,
        root: Path | None = None,
        *,
        stale_after_s: float = STALE_AFTER_S,
        every_s: float = CHECK_EVERY_S,
        on_error: Callable[[StreamRLError], None] | None = None,
    ):
        self.root = extensions_root() if root is None else root
        self.on_error = on_error
        self.stale_after_s, self.every_s = stale_after_s, every_s
        self.removed: list[Path] = []
        self.error: StreamRLError | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="extension-lock-watch", daemon=True)

    def __enter__(self) -> LockWatch:
        self._sweep()  # before the first load: a lock left by the last run goes at once
        if self.error is not None:
            raise self.error
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    def _sweep(self) -> None:
        try:
            self.removed += clear_stale(self.root, stale_after_s=self.stale_after_s)
        except StreamRLError as e:
            self.error = e
            log.error("%s", e)

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self._sweep()
            if self.error is not None and self.on_error is not None:
                self.on_error(self.error)
                return
