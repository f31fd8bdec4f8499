"""The run directory and the catalog of runs.

A run directory holds everything a later command (status, cancel, plot, resume) needs, so that
no command depends on the process that launched the run:

    runs/<name>-<YYYYmmdd-HHMMSS>/
      run.json          what was launched, how, and its lifecycle state
      config.yaml       the fully resolved recipe
      roles/<role>.yaml each role's typed spec (see roles.spec)
      secret            the run's token (mode 0600; never in argv, env or job scripts)
      jobs/             rendered job scripts (sbatch, or the local command lines)
      jobs.json         submitted jobs keyed by (cluster, job id)
      logs/<role>/      per-role logs
      members/          start records written by each role process
      events.jsonl      lifecycle events (submitted, cancelled, finished, ...)

The catalog ($STREAMRL_HOME/catalog.jsonl, default ~/.streamrl) lists run directories so that
`streamrl status NAME` works from any directory.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from streamrl_cli.errors import RunNotFoundError


def streamrl_home() -> Path:
    return Path(os.environ.get("STREAMRL_HOME", Path.home() / ".streamrl")).expanduser()


def write_atomic(path: Path, data: str | bytes, mode: int = 0o644, durable: bool = False) -> None:
    """Write via a temporary file + rename, so readers see the old or the new file, never a mix.

    ``durable`` also fsyncs the file and its directory, for state that must survive a crash.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if durable:
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def write_json(path: Path, data: Any) -> None:
    write_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def read_json(path: Path, default: Any = None) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return default


@dataclass
class RunDir:
    path: Path

    @property
    def name(self) -> str:
        return self.path.name

    def info(self) -> dict:
        return read_json(self.path / "run.json", {})

    def update_info(self, **changes: Any) -> dict:
        info = {**self.info(), **changes}
        write_json(self.path / "run.json", info)
        return info

    def event(self, kind: str, **fields: Any) -> None:
        """Append a lifecycle event (one JSON line; appends of one line are atomic enough here)."""
        rec = {"time": time.time(), "event": kind, **fields}
        with open(self.path / "events.jsonl", "a") as f:
            f.write(json.dumps(rec, sort_keys=True) + "\n")

    def events(self) -> list[dict]:
        try:
            lines = (self.path / "events.jsonl").read_text().splitlines()
        except OSError:
            return []
        return [json.loads(line) for line in lines if line.strip()]

    def jobs(self) -> list[dict]:
        return read_json(self.path / "jobs.json", [])

    def add_job(self, record: dict) -> None:
        write_json(self.path / "jobs.json", [*self.jobs(), record])

    def ensure_secret(self) -> str:
        """The run's token, created (mode 0600, never overwritten) on first use."""
        from streamrl_cli.rendezvous import SECRET_FILE, create_secret, read_secret

        if (self.path / SECRET_FILE).exists():
            return read_secret(self.path)
        return create_secret(self.path)


def create(root: Path, name: str, now: float | None = None) -> RunDir:
    """A new, empty run directory `<root>/<name>-<timestamp>` (suffixed if that exists)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    root = root.expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    for i in range(100):
        path = root / (f"{name}-{stamp}" + (f"-{i}" if i else ""))
        try:
            path.mkdir()
        except FileExistsError:
            continue
        for sub in ("roles", "jobs", "logs", "members"):
            (path / sub).mkdir()
        return RunDir(path)
    raise RuntimeError(f"could not create a run directory under {root}")


def catalog_add(run: RunDir) -> None:
    home = streamrl_home()
    home.mkdir(parents=True, exist_ok=True)
    with open(home / "catalog.jsonl", "a") as f:
        f.write(json.dumps({"run": run.name, "path": str(run.path), "created": time.time()}) + "\n")


def catalog() -> list[RunDir]:
    """Known runs whose directory still exists, oldest first (no duplicates)."""
    try:
        lines = (streamrl_home() / "catalog.jsonl").read_text().splitlines()
    except OSError:
        return []
    seen: dict[str, RunDir] = {}
    for line in lines:
        try:
            path = Path(json.loads(line)["path"])
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # a torn last line must not hide every other run
        if (path / "run.json").exists():
            seen[str(path)] = RunDir(path)
    return list(seen.values())


def find(query: str) -> RunDir:
    """A run by directory path, full run id, unique id prefix, or run name (the newest of that name)."""
    p = Path(query).expanduser()
    if (p / "run.json").exists():
        return RunDir(p.resolve())
    runs = catalog()
    exact = [r for r in runs if r.name == query]
    if exact:
        return exact[-1]
    named = [r for r in runs if r.info().get("name") == query]
    if named:
        return named[-1]
    prefixed = [r for r in runs if r.name.startswith(query)]
    if len(prefixed) == 1:
        return prefixed[0]
    if prefixed:
        listing = ", ".join(r.name for r in prefixed[-10:])
        raise RunNotFoundError(f"{query!r} matches {len(prefixed)} runs: {listing}; give more of the run id")
    known = ", ".join(r.name for r in runs[-5:]) or "none yet"
    raise RunNotFoundError(
        f"no run matches {query!r} (by path, run id, prefix or name); latest runs: {known}"
    )
