"""Helpers the tests share: the CLI as a subprocess, SLURM's state, a rendezvous in a thread, run records.

Imported as ``from support.helpers import ...`` (pytest puts tests/ on the path: setup.cfg's
``pythonpath``); fixtures stay in tests/conftest.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
STREAMRL = [sys.executable, "-m", "streamrl_cli.cli"]

# Launch tests check the mechanics (jobs, rendezvous, status), not RL: their roles run the
# preflight program (register, see every peer, leave) instead of the trainer and generators.
PREFLIGHT = (
    "roles.trainer.program=streamrl_cli.roles.preflight:main",
    "roles.generator.program=streamrl_cli.roles.preflight:main",
)


def streamrl(*args: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    """Run the real CLI in a subprocess, as a user would."""
    env = {**os.environ, "COLUMNS": "200", **kw.pop("env", {})}
    return subprocess.run(
        [*STREAMRL, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=kw.pop("cwd", REPO),
        **kw,
    )


def slurm_up(cluster: str | None = None) -> bool:
    if shutil.which("sinfo") is None:
        return False
    cmd = ["sinfo", "-h", "-o", "%t"] + (["-M", cluster] if cluster else [])
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    states = out.stdout.split()
    return (
        out.returncode == 0
        and bool(states)
        and not any(bad in s for s in states for bad in ("down", "drain", "fail", "inval", "unk"))
    )


@contextlib.contextmanager
def rendezvous_in_thread(run_dir: Path, lease_s: float = 30.0):
    """A real rendezvous server of ``run_dir`` on loopback, in a thread of this process: yields an
    httpx client that carries the run's token (stopped when the block ends)."""
    import asyncio
    import json
    import threading
    import time

    import httpx

    from streamrl_cli.rendezvous import create_secret, read_secret
    from streamrl_cli.rendezvous.server import run

    again = (run_dir / "secret").exists()  # a server restarted on the same run directory
    token = read_secret(run_dir) if again else create_secret(run_dir)
    (run_dir / "rendezvous.json").unlink(missing_ok=True)  # the last server's, now stopped
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    coro = run(run_dir, host="127.0.0.1", port=0, lease_s=lease_s, ssl_context=None, token=token, stop=stop)
    thread = threading.Thread(target=loop.run_until_complete, args=(coro,), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not (run_dir / "rendezvous.json").exists():
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    url = json.loads((run_dir / "rendezvous.json").read_text())["url"]
    try:
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=5) as http:
            yield http
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=10)
        loop.close()


def none_alive(recs: list[dict]) -> bool:
    """No process of these `local.json` records still runs (a zombie has ended: it is only unreaped)."""
    for r in recs:
        try:
            p = psutil.Process(r["pid"])
            if abs(p.create_time() - r["created"]) < 0.05 and p.status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.Error:
            pass
    return True


def metrics_records(run: Path, role: str) -> list[dict]:
    """A run's metrics.jsonl records of `role`, read while the run writes it (none before the file
    exists; a line still being written is skipped)."""
    from streamrl_cli.rundir import read_jsonl

    return [r for r in read_jsonl(run / "metrics.jsonl").records if r.get("role") == role]


def relay_fetches(run: Path) -> dict[int, set[str]]:
    """version -> the far-site members that fetched it across sites through the relay (generators
    report relay fetches in their periodic records)."""
    fetched: dict[int, set[str]] = {}
    for r in metrics_records(run, "generator"):
        if r.get("weights/relay"):
            fetched.setdefault(r["weights/version"], set()).add(r["member_id"])
    return fetched


def job_logs(run: Path, tail: int | None = 2500) -> str:
    """Every SLURM job log of a run: the last `tail` characters of each (None: whole)."""
    files = sorted((run / "logs").rglob("*.out"))
    return "\n".join(f"== {p}\n" + p.read_text(errors="replace")[-(tail or 0) :] for p in files)


def wait_on_run(pred, timeout: float, what: str, run: Path):  # type: ignore[no-untyped-def]
    """Poll `pred` until it holds and return what it gave; if the run failed first, or past
    `timeout` (a liveness bound), fail with the run's job logs."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        info = run / "run.json"
        if info.exists() and json.loads(info.read_text()).get("state") == "failed":
            raise AssertionError(f"the run failed before {what}\n{job_logs(run)}")
        time.sleep(2)
    raise AssertionError(f"timed out waiting for {what}\n{job_logs(run)}")


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    """Two connected TCP sockets on loopback (the relay's Conn sets TCP options: no socketpair())."""
    listener = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(listener.getsockname())
    b, _ = listener.accept()
    listener.close()
    return a, b


# Overrides that run the built-in reward on a dataset file written by `shrinking_dataset`.
SHRINKING = (
    "task.shuffle=false",
    "task.reward=streamrl_cli.tasks.rewards:repeat_verifier",
)

# The short phase made short by construction (`shrinking_dataset(..., short_word=SHORT_WORD)`): its
# prompts are all "repeat fox 1:", the long phase never asks for fox, and the stop string " fox" ends
# a completion at its first fox. The warmed policy copies the prompt's word first (and the long phase
# rewards copying it), so a short answer is that one word, from the first short iteration on: no
# waiting for the policy to unlearn the long answers the long phase taught it. With a short phase of
# a bounded length the dataset comes round again (epochs, in file order): a run whose one instance
# happened to keep up through a long phase (measured times on a loaded machine vary) gets another
# long phase, instead of a short one for ever.
SHORT_WORD = "fox"
ENDS_AT_SHORT_WORD = (f"algorithm.stop=[' {SHORT_WORD}']",)


def shrinking_dataset(
    path: Path, long_prompts: int, short_prompts: int = 4000, short_word: str | None = None
) -> str:
    """A "repeat <word> <count>:" dataset whose outputs shrink: `long_prompts` asking for 60 copies,
    then `short_prompts` asking for one (a word and EOS). Trained in file order (task.shuffle=false),
    a run is generation-bound first and training-bound after: the elastic rule's grow-then-release
    workload. With `short_word`, every short prompt asks for that word and no long one does (see
    ENDS_AT_SHORT_WORD). Returns the `task.dataset=` override."""
    import json

    from streamrl_cli.tasks.builtin import WORDS

    long_words = [w for w in WORDS if w != short_word]
    with path.open("w") as f:
        for phase, n, count in (("long", long_prompts, 60), ("short", short_prompts, 1)):
            for k in range(n):
                word = short_word if short_word and phase == "short" else long_words[k % len(long_words)]
                prompt = f"repeat {word} {count}:"
                f.write(
                    json.dumps({"id": f"{phase}/{k}", "prompt": prompt, "word": word, "count": count}) + "\n"
                )
    return f"task.dataset={path}"


class Clock:
    """A clock for pipelines under test: each reading is 1 ms after the one before."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 0.001
        return self.t
