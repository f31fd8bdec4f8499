"""Who applies scale requests: the process that watches the run.

`streamrl scale` and the trainer's elastic policy only *ask*, through the rendezvous
(`POST /v1/scale`, event `scale_requested` with an absolute instance count). One process per run
follows those events and applies them with :mod:`streamrl_cli.launch.scale.executor`:

- a run whose generators are local processes: `streamrl run` itself, in its watch loop (it started
  the roles, so it also collects the new processes' exit codes);
- a run whose generators are SLURM jobs: the rendezvous role's job watcher (on the submitting host,
  or in its own job with `placement=job`, where `sbatch` must then work from the compute node).

Requests are absolute, so a burst of them is applied as its newest one, and a repeated one changes
nothing. Every request ends as one line in `events.jsonl`: `scaled` (before, after, ranks added and
released, jobs submitted) or `scale_failed` (the error), with the request's `seq`, which is what
`streamrl scale` waits for.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from streamrl_cli.errors import StreamRLError
from streamrl_cli.launch.scale import executor
from streamrl_cli.rundir import RunDir

log = logging.getLogger("streamrl.elastic")


class ScaleFollower:
    def __init__(self, run: RunDir, client: Any, since: int | None = None):
        self.run, self.client = run, client
        self.since = client.versions()["event_seq"] if since is None else since
        self.released: set[int] = set()  # ranks this follower released (their exits are no failure)

    def poll(self, timeout: float = 0.0) -> list[dict[str, Any]]:
        """Apply the scale requests that arrived since the last poll; returns the events written."""
        doc = self.client.events(self.since, timeout=timeout)
        self.since = doc["next_since"]
        requests = [
            e
            for e in doc["events"]
            if e["type"] == "scale_requested" and e["data"].get("role") == "generator"
        ]
        if not requests:
            return []
        written = []
        for old in requests[:-1]:
            written.append(self._event("scale_superseded", old, by=requests[-1]["seq"]))
        written.append(self.apply(requests[-1]))
        return written

    def apply(self, request: dict[str, Any]) -> dict[str, Any]:
        d = request["data"]
        t0 = time.time()
        try:
            r = executor.apply(self.run, int(d["instances"]))
        except StreamRLError as e:
            log.error("scale request %d (%s instances) failed: %s", request["seq"], d["instances"], e)
            return self._event("scale_failed", request, error=str(e))
        self.released.update(r.released)
        log.info("scaled generators %d -> %d (%s)", r.before, r.after, d.get("source"))
        return self._event(
            "scaled", request, before=r.before, after=r.after, added=r.added, released=r.released,
            jobs=r.jobs, applied_s=round(time.time() - t0, 3),
        )  # fmt: skip

    def _event(self, kind: str, request: dict[str, Any], **fields: Any) -> dict[str, Any]:
        d = request["data"]
        rec = {
            "request": request["seq"], "requested": d["instances"], "source": d.get("source", "user"),
            "reason": d.get("reason", ""), "requested_at": request["time"], **fields,
        }  # fmt: skip
        self.run.event(kind, **rec)
        return {"event": kind, **rec}


def wait_applied(run: RunDir, seq: int, timeout: float, poll_s: float = 0.2) -> dict[str, Any] | None:
    """The events.jsonl line that closed scale request `seq` (None if none within `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        for ev in reversed(run.events()):
            if ev.get("request") == seq and ev.get("event") in ("scaled", "scale_failed", "scale_superseded"):
                return ev
        if time.monotonic() > deadline:
            return None
        time.sleep(poll_s)
