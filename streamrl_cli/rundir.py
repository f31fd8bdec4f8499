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
      model/                   the final iteration as a Hugging Face model (export)  RunDir.exported_model
      plots/                   `streamrl plot`'s default output                     RunDir.plots
      attempts/<n>/            what an earlier attempt left (--resume)              RunDir.attempt()

The catalog ($STREAMRL_HOME/catalog.jsonl, default ~/.streamrl) lists run directories so that
`streamrl status NAME` works from any directory.
"""

from __future__ import annotations

import json
import os
import sys
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
    return read_json_checked(path, default)[0]


def read_json_checked(path: Path, default: Any = None) -> tuple[Any, str | None]:
    """(content, None), or (default, what is wrong) when the file exists but cannot be read as JSON.

    The files of a run directory are written atomically, so a damaged one was damaged from outside
    (a full disk, a hand edit, a copy cut short): callers say so rather than read it as "empty".
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return default, None
    except OSError as e:
        return default, f"{path}: cannot read: {e.strerror or e}"
    try:
        return json.loads(data), None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        return default, f"{path}: damaged (not JSON: {e}; {len(data)} bytes)"


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
    def staged_ca(self) -> Path:
        """The rendezvous server's CA, as a cluster without the submit host's filesystem gets it."""
        return self.path / "rendezvous-ca.pem"

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
    def exported_model(self) -> Path:
        return self.path / "model"

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
        info, problem = read_json_checked(self.run_json, {})
        if problem:
            warn_once(problem + "; the run's name, recipe and state are unknown")
        return info if isinstance(info, dict) else {}

    def damage(self) -> list[str]:
        """What is wrong with the run directory's own files (none of them damaged: [])."""
        out = []
        for name, typ in (("run.json", dict), ("local.json", list), ("jobs.json", list)):
            value, problem = read_json_checked(self.path / name)
            if problem is None and value is not None and not isinstance(value, typ):
                problem = f"{self.path / name}: damaged (a {type(value).__name__}, not a {typ.__name__})"
            if problem:
                out.append(problem)
        return out

    def update_info(self, **changes: Any) -> dict:
        path = self.run_json
        problem = read_json_checked(path)[1]
        if problem and not path.with_suffix(".json.damaged").exists():
            # Keep the damaged bytes for a person to look at; the new run.json starts without them.
            os.replace(path, path.with_suffix(".json.damaged"))
            warn_once(f"{problem}; kept as run.json.damaged, a new run.json is written")
        info = {**self.info(), **changes}
        write_json(path, info)
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

    def jobs(self, replaced: bool = False) -> list[dict]:
        """The run's SLURM jobs; those ``replace_job`` replaced (an ended trainer job submitted
        again) only with ``replaced``."""
        jobs = read_json(self.jobs_json, [])
        return jobs if replaced else [j for j in jobs if not j.get("replaced")]

    def add_job(self, record: dict) -> None:
        write_json(self.jobs_json, [*self.jobs(replaced=True), record])

    def replace_job(self, old: dict, new: dict) -> None:
        """Mark job ``old`` replaced (it stays listed, ignored when telling whether the run ended)
        and add ``new`` in its place."""
        jobs = self.jobs(replaced=True)
        for j in jobs:
            if str(j["job_id"]) == str(old["job_id"]) and j.get("slurm_cluster") == old.get("slurm_cluster"):
                j["replaced"] = True
        write_json(self.jobs_json, [*jobs, new])


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
    where = streamrl_home() / "catalog.jsonl"
    try:
        lines = where.read_bytes().splitlines()
    except OSError:
        return []
    seen: dict[str, RunDir] = {}
    skipped = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            path = Path(json.loads(line.decode("utf-8"))["path"])
        except (ValueError, UnicodeDecodeError, KeyError, TypeError):
            skipped.append(n)  # a torn or damaged line must not hide every other run
            continue
        if RunDir(path).run_json.exists():
            seen[str(path)] = RunDir(path)
    if skipped and skipped != [len(lines)]:  # a torn last line is a crash mid-append: not worth a word
        warn_once(f"{where}: skipped unreadable line(s) {', '.join(map(str, skipped[:10]))}")
    return list(seen.values())


_warned: set[str] = set()


def warn_once(message: str) -> None:
    """A warning on stderr (once per message per process): damaged files are said, not hidden."""
    if message not in _warned:
        _warned.add(message)
        print(f"warning: {message}", file=sys.stderr)


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
