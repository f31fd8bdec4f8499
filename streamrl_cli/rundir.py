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
import re
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from streamrl_cli import environ
from streamrl_cli.errors import RecipeError, RunNotFoundError
from streamrl_cli.recipe.schema import RUN_NAME

_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # <run name>-<timestamp>[-<n>]


def streamrl_home() -> Path:
    return Path(os.environ.get(environ.HOME) or Path.home() / ".streamrl").expanduser()


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
class JsonLines:
    """What :func:`read_jsonl` read: the valid records, and the lines it had to skip."""

    path: Path
    records: list[dict] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)  # 1-based numbers of the lines skipped
    lines: int = 0  # lines in the file, blank ones included
    error: str | None = None  # the file exists but could not be read at all

    def problem(self) -> str | None:
        """What is wrong with the file, in one line (None: nothing)."""
        if self.error:
            return f"{self.path}: cannot read: {self.error}"
        if not self.skipped:
            return None
        n, s = len(self.skipped), "" if len(self.skipped) == 1 else "s"
        lines = ", ".join(map(str, self.skipped[:10])) + (", ..." if n > 10 else "")
        return f"{self.path}: {n} damaged line{s} skipped (line{s} {lines})"


def read_jsonl(path: Path, valid: Callable[[dict], bool] = lambda rec: True) -> JsonLines:
    """The records of a JSON-lines file that decode (UTF-8, a JSON object) and pass ``valid``; the
    others are skipped and counted, never fatal: one torn or hand-damaged line must not hide the rest."""
    out = JsonLines(Path(path))
    try:
        data = out.path.read_bytes()
    except FileNotFoundError:
        return out
    except OSError as e:
        out.error = e.strerror or str(e)
        return out
    lines = data.splitlines()
    out.lines = len(lines)
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line.decode("utf-8"))
        except (ValueError, UnicodeDecodeError):  # JSONDecodeError is a ValueError
            rec = None
        if isinstance(rec, dict) and valid(rec):
            out.records.append(rec)
        else:
            out.skipped.append(n)
    return out


def is_event(rec: dict) -> bool:
    """An events.jsonl record as :meth:`RunDir.event` writes it: its kind and its time."""
    t = rec.get("time")
    return isinstance(rec.get("event"), str) and isinstance(t, int | float) and not isinstance(t, bool)


# What marks a directory as a run directory when its run.json is gone: files only `streamrl run`
# writes there. config.yaml alone is too common a name, so it counts only beside the secret.
RUN_MARKERS = ("run.json", "local.json", "jobs.json", "events.jsonl", "rendezvous.json")
ROLE_NAMES = ("trainer", "generator", "teacher", "env_server", "rendezvous")
# Roles of many instances (array tasks on SLURM): a run goes on while one of each pool is left.
POOL_ROLES = ("generator", "teacher", "env_server")


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

    def evidence(self) -> list[str]:
        """The files that say this directory is a run directory (empty: it is none), so that a run
        whose run.json was lost can still be found, shown and cancelled."""
        found = [name for name in RUN_MARKERS if (self.path / name).is_file()]
        found += [f"roles/{r}.yaml" for r in ROLE_NAMES if self.role_spec(r).is_file()]
        if self.config.is_file() and self.secret.is_file():
            found += ["config.yaml", "secret"]
        return found

    def is_run(self) -> bool:
        return self.run_json.is_file() or bool(self.evidence())

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
        if not self.run_json.exists() and self.path.is_dir():
            out.append(f"{self.run_json}: missing; the run's name, recipe and recorded state are unknown")
        events = self.events_checked().problem()
        if events:
            out.append(events)
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

    def events_checked(self) -> JsonLines:
        """The lifecycle events, with the lines that were not one (torn, hand-damaged) counted."""
        return read_jsonl(self.events_jsonl, is_event)

    def events(self) -> list[dict]:
        """The lifecycle events that can be read; damaged lines are skipped with a warning."""
        read = self.events_checked()
        problem = read.problem()
        if problem:
            warn_once(problem)
        return read.records

    def jobs(self, replaced: bool = False) -> list[dict]:
        """The run's SLURM jobs; those ``replace_job`` replaced (an ended trainer job submitted
        again) only with ``replaced``. A damaged jobs.json reads as none (``damage`` names it)."""
        jobs = read_json(self.jobs_json, [])
        jobs = [j for j in jobs if isinstance(j, dict) and "job_id" in j] if isinstance(jobs, list) else []
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
    """A new, empty run directory `<root>/<name>-<timestamp>` (suffixed if that exists); `name` must
    be a run name (recipe.schema.RUN_NAME), so the directory is always directly inside `root`."""
    if not RUN_NAME.fullmatch(name):
        raise RecipeError([f"run.name: {name!r} is not a run name (1-64 letters, digits, '.', '_', '-')"])
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    root = root.expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    for i in range(100):
        path = root / (f"{name}-{stamp}" + (f"-{i}" if i else ""))
        if path.resolve().parent != root:  # a name rule that let one through would be a bug: say so
            raise RuntimeError(f"run directory {path} would not lie directly under {root}")
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
        rec = {"run": run.name, "path": str(run.path), "root": str(run.path.parent), "created": time.time()}
        f.write(json.dumps(rec) + "\n")


def _listed(rec: dict) -> bool:
    """A catalog record of a run directory `streamrl run` made: an absolute, normal path directly inside
    the record's root, whose last part is the record's run id (a run name and its timestamp)."""
    path, run = rec["path"], rec.get("run")
    return (
        isinstance(run, str)
        and _RUN_ID.fullmatch(run) is not None
        and os.path.isabs(path)
        and os.path.normpath(path) == path
        and os.path.basename(path) == run
        and rec.get("root", os.path.dirname(path)) == os.path.dirname(path)
    )


def catalog() -> list[RunDir]:
    """Known runs whose directory still exists, oldest first (no duplicates)."""
    read = read_jsonl(streamrl_home() / "catalog.jsonl", lambda r: isinstance(r.get("path"), str))
    seen: dict[str, RunDir] = {}
    for rec in read.records:
        if not _listed(rec):
            continue
        run = RunDir(Path(rec["path"]))
        if run.is_run():  # one that lost its run.json still is: status and cancel must find it
            seen[str(run.path)] = run
    # A torn last line is a crash mid-append: not worth a word; any other damage is said.
    if read.skipped and read.skipped != [read.lines]:
        warn_once(f"{read.path}: skipped unreadable line(s) {', '.join(map(str, read.skipped[:10]))}")
    return list(seen.values())


_warned: set[str] = set()


def warn_once(message: str) -> None:
    """A warning on stderr (once per message per process): damaged files are said, not hidden."""
    if message not in _warned:
        _warned.add(message)
        print(f"warning: {message}", file=sys.stderr)


def find(query: str) -> RunDir:
    """A run by directory path, full run id, unique id prefix, or run name (the newest of that name).

    A directory that lost its run.json but holds what `streamrl run` writes (local.json, jobs.json,
    roles/...) is still that run: its processes and jobs must stay reachable by status and cancel.
    """
    p = Path(query).expanduser()
    if p.is_dir():
        run = RunDir(p.resolve())
        if run.run_json.exists():
            return run
        evidence = run.evidence()
        if evidence:
            warn_once(
                f"{run.run_json} is missing; {run.path} is taken as a run directory because it holds "
                f"{', '.join(evidence)}; the run's name, recipe and recorded state are unknown"
            )
            return run
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
    if p.is_dir():
        raise RunNotFoundError(_not_a_run(p, known))
    raise RunNotFoundError(
        f"no run matches {query!r} (by path, run id, prefix or name); latest runs: {known}"
    )


def _not_a_run(path: Path, known: str) -> str:
    """Why a directory given as a run is none, and where runs are."""
    try:
        inside = sorted(c.name for c in path.iterdir() if c.is_dir() and RunDir(c).run_json.is_file())
    except OSError:
        inside = []
    where = (
        f"; it holds run directories: {', '.join(inside[:5])}{', ...' if len(inside) > 5 else ''}"
        if inside
        else ""
    )
    return (
        f"{path} is not a run directory: it has no run.json (nor local.json, jobs.json, events.jsonl or "
        f"roles/*.yaml){where}. A run directory is made by `streamrl run` under run.root, as "
        f"<root>/<name>-<YYYYmmdd-HHMMSS>; give one, or a run id, prefix or name (`streamrl status` "
        f"lists them); latest runs: {known}"
    )
