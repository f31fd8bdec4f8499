"""Durability of the rendezvous state: the append-only journal, its snapshot, metrics.jsonl.

The journal is the source of truth: one JSON line per event, fsynced before the answer
leaves the server, so a client never acts on a change that a crash could undo. A crash
mid-write leaves at most one torn last line, which :meth:`Journal.load` cuts off. When
the journal grows long, the state is written as a snapshot (atomically: readers see the
old or the new file) and the journal starts over; events already in the snapshot are
skipped on replay, so a crash between the two steps is harmless.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from streamrl_cli.errors import RendezvousError
from streamrl_cli.rundir import write_atomic

log = logging.getLogger("streamrl.rendezvous")


class Journal:
    """Append-only JSON-lines journal with fsync, plus an atomically replaced snapshot."""

    def __init__(self, directory: Path, compact_every: int = 20_000):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "journal.jsonl"
        self.snapshot_path = self.dir / "snapshot.json"
        self.compact_every = compact_every
        self.lines = 0  # lines in the journal file (compaction resets it)
        self.written = 0  # events written since this object was made (group commit counts these)
        self._fh: Any = None

    def load(self) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
        """Read the snapshot and journal; cut a torn last line (a crash mid-write) off the file."""
        snap = None
        if self.snapshot_path.exists():
            try:
                snap = json.loads(self.snapshot_path.read_text())
            except ValueError as e:  # written atomically, so this is damage, not a crash
                raise RendezvousError(f"{self.snapshot_path} is not valid JSON ({e}); move it aside") from e
        events: list[dict[str, Any]] = []
        data = self.path.read_bytes() if self.path.exists() else b""
        good_end = 0
        pos = 0
        while pos < len(data):
            nl = data.find(b"\n", pos)
            end = len(data) if nl < 0 else nl + 1
            try:
                ev = json.loads(data[pos:end])
                if not (isinstance(ev, dict) and isinstance(ev.get("seq"), int) and "data" in ev):
                    raise ValueError("not an event")
                events.append(ev)
                good_end = end
            except ValueError:
                if nl < 0:
                    log.warning("journal: dropping a torn last line (%d bytes) of %s", end - pos, self.path)
                else:
                    log.warning("journal: skipping an unreadable line at byte %d of %s", pos, self.path)
                    good_end = end
            pos = end
        self._fh = open(self.path, "ab")
        if good_end < len(data):
            self._fh.truncate(good_end)
        elif data and not data.endswith(b"\n"):
            self._fh.write(b"\n")  # the last record was complete but its newline was lost
        self.lines = len(events)
        return snap, events

    def write(self, events: list[dict[str, Any]]) -> None:
        """Append events (handed to the OS, not yet durable: see `fsync`)."""
        if events:
            self._fh.write(b"".join(json.dumps(ev, separators=(",", ":")).encode() + b"\n" for ev in events))
            self._fh.flush()
            self.lines += len(events)
            self.written += len(events)

    def fsync(self) -> None:
        """Make everything written so far durable; safe to call from a worker thread."""
        os.fsync(self._fh.fileno())

    def append(self, events: list[dict[str, Any]]) -> None:
        """write + fsync, for callers without a group commit."""
        self.write(events)
        self.fsync()

    def should_compact(self) -> bool:
        return self.lines >= self.compact_every

    def compact(self, snapshot: dict[str, Any]) -> None:
        """Write the snapshot atomically, then empty the journal (replay skips covered events)."""
        write_atomic(self.snapshot_path, json.dumps(snapshot, separators=(",", ":")).encode(), durable=True)
        self._fh.truncate(0)
        os.fsync(self._fh.fileno())
        self.lines = 0

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def read_metrics_tail(path: Path, tail_bytes: int = 1024 * 1024) -> dict[str, dict[str, Any]]:
    """Latest record per member from the end of metrics.jsonl (rebuilt after a restart)."""
    latest: dict[str, dict[str, Any]] = {}
    if not path.exists():
        return latest
    with open(path, "rb") as f:
        start = max(0, path.stat().st_size - tail_bytes)
        f.seek(start)
        lines = f.read().split(b"\n")[1 if start else 0 :]  # skip a partial first line
    for line in lines:
        try:
            rec = json.loads(line)
            mid, t = rec.pop("member_id"), rec.pop("time")
        except (ValueError, TypeError, AttributeError, KeyError):
            continue
        rec.pop("role", None)
        rec.pop("rank", None)
        latest[mid] = {"time": t, "record": rec}
    return latest
