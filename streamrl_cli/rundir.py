"""The run directory and the catalog of runs.

A run directory holds everything a later command (status, cancel, plot, resume) needs, so that
no command depends on the process that launched the run. :class:`RunDir` is the one owner of its
layout: every path inside a run directory comes from it, nowhere else spells a file name::

    runs/<name>-<YYYYmmdd-HHMMSS>/
      run.json                 what was launched, how, and its lifecycle state      RunDir.run_json
      config.yaml              the fully resolved recipe                            RunDir.config
      roles/<role>.yaml        each role's typed spec (see roles.spec)              RunDir.role_spec()
      secret                   the run's token (mode 0600; never in argv or env)    RunDir.secret
      rendezvous.json          where the rendezvous server listens                  RunDir.endpoint
      rendezvous/              the server's journal and snapshot                    RunDir.rendezvous_state
      metrics.jsonl            every metrics record posted to the server            RunDir.metrics
      jobs/                    rendered job scripts (sbatch, or the local commands) RunDir.job_script()
      jobs.json                submitted jobs keyed by (cluster, job id)            RunDir.jobs_json
      local.json               processes started on this machine                    RunDir.local_json
      logs/<role>/             per-role logs                                        RunDir.role_logs()
      members/<role>-<rank>.json  start records written by each role process        RunDir.member_record()
      events.jsonl             lifecycle events (submitted, cancelled, finished)    RunDir.events_jsonl
      checkpoints/             the trainer's checkpoints                            RunDir.checkpoints
      plots/                   `streamrl plot`'s default output                     RunDir.plots
      attempts/<n>/            what an earlier attempt left (--resume)              RunDir.attempt()

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

    # ---- the layout (see the module docstring) ----

    @property
    def run_json(self) -> Path:
        return self.path / "run.json"

    @property
    def config(self) -> Path:
        return self.path / "config.yaml"

    @property
    def roles(self) -> Path:
        return self.path / "roles"

    def role_spec(self, role: str) -> Path:
        return self.roles / f"{role}.yaml"

    @property
    def secret(self) -> Path:
        return self.path / "secret"

    @property
    def endpoint(self) -> Path:
        return self.path / "rendezvous.json"

    @property
    def rendezvous_state(self) -> Path:
        return self.path / "rendezvous"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def jobs_dir(self) -> Path:
        return self.path / "jobs"

    def job_script(self, key: str, launcher: str) -> Path:
        return self.jobs_dir / f"{key}.{'sbatch' if launcher == 'slurm' else 'sh'}"

    @property
    def jobs_json(self) -> Path:
        return self.path / "jobs.json"

    @property
    def local_json(self) -> Path:
        return self.path / "local.json"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    def role_logs(self, role: str) -> Path:
        return self.logs / role

    def local_log(self, role: str, rank: int) -> Path:
        return self.role_logs(role) / f"{role}-{rank}.log"

    @property
    def members(self) -> Path:
        return self.path / "members"

    def member_record(self, role: str, rank: int) -> Path:
        return self.members / f"{role}-{rank}.json"

    @property
    def events_jsonl(self) -> Path:
        return self.path / "events.jsonl"

    @property
    def plots(self) -> Path:
        return self.path / "plots"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def attempts(self) -> Path:
        return self.path / "attempts"

    def attempt(self, n: int) -> Path:
        return self.attempts / str(n)

    # What a new attempt moves aside: the old process table, job list and server address.
    def attempt_leftovers(self) -> list[Path]:
        return [self.local_json, self.jobs_json, self.endpoint]

    # ---- records ----

    def info(self) -> dict:
        return read_json(self.run_json, {})

    def update_info(self, **changes: Any) -> dict:
        info = {**self.info(), **changes}
        write_json(self.run_json, info)
        return info

    def event(self, kind: str, **fields: Any) -> None:
        """Append a lifecycle event (one JSON line; appends of one line are atomic enough here)."""
        rec = {"time": time.time(), "event": kind, **fields}
        with open(self.events_jsonl, "a") as f:
            f.write(json.dumps(rec, sort_keys=True) + "\n")

    def events(self) -> list[dict]:
        try:
            lines = self.events_jsonl.read_text().splitlines()
        except OSError:
            return []
        return [json.loads(line) for line in lines if line.strip()]

    def jobs(self) -> list[dict]:
        return read_json(self.jobs_json, [])

    def add_job(self, record: dict) -> None:
        write_json(self.jobs_json, [*self.jobs(), record])


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
        run = RunDir(path)
        for sub in (run.roles, run.jobs_dir, run.logs, run.members):
            sub.mkdir()
        return run
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
        if RunDir(path).run_json.exists():
            seen[str(path)] = RunDir(path)
    return list(seen.values())


def find(query: str) -> RunDir:
    """A run by directory path, full run id, unique id prefix, or run name (the newest of that name)."""
    p = Path(query).expanduser()
    if RunDir(p).run_json.exists():
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
