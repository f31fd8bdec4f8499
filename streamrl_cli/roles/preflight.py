"""The preflight program: proves that every process of a run can find the others, then exits.

Each process registers with the run's rendezvous server, heartbeats, waits until every role
has the number of members the run expects, reports what it saw, and leaves. It is what the
trainer and generator roles run until their real programs are chosen in the recipe (and a quick
check of a cluster set-up at any time: `roles.trainer.program=streamrl_cli.roles.preflight:main`).

`check` is the check itself and returns with the member still registered and heartbeating, for a
program that goes on from there (the test suite's holds it, to look at a live run); `main` leaves.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

from streamrl_cli.errors import RendezvousError
from streamrl_cli.roles.entry import update_record
from streamrl_cli.roles.spec import RoleSpec

WAIT_S = 300.0
OK = "preflight-ok"


def wait_for_file(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise RendezvousError(f"the rendezvous server did not publish {path} within {timeout:.0f} s")
        time.sleep(0.2)


def wait_all_ok(client, expected: dict[str, int], timeout: float) -> None:  # type: ignore[no-untyped-def]
    """Until every expected member has reported OK (or has already left, after doing so)."""
    deadline = time.monotonic() + timeout
    while True:
        doc = client.status()
        done = {role: 0 for role in expected}
        for m in doc["members"]:
            if m["role"] in done and (m["state"] == "left" or m.get("reported_state") == OK):
                done[m["role"]] += 1
        if all(done[r] >= n for r, n in expected.items()):
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise RendezvousError(
                f"preflight: timed out waiting for every member to finish its check: {done}"
            )
        client.events(doc["event_seq"], timeout=min(left, 30.0), limit=1)


def main(spec: RoleSpec, rank: int) -> int:
    client = check(spec, rank)
    try:
        client.leave()
    finally:
        client.close()
    return 0


def check(spec: RoleSpec, rank: int) -> Any:
    """Register, see every expected member, report OK once all have: the client, still registered
    and heartbeating (the caller leaves and closes it; on failure it is closed here)."""
    from streamrl_cli.rendezvous.client import RendezvousClient

    wait_for_file(Path(spec.rendezvous_file), WAIT_S)
    client = RendezvousClient.from_run_dir(Path(spec.run_dir), tls_ca=spec.rendezvous_ca)
    try:
        client.register(
            role=spec.role,
            rank=rank,
            cluster=spec.cluster,
            site=spec.site,
            host=socket.gethostname(),
            info={"program": "preflight", "pid": os.getpid()},
        )
        client.start_heartbeat()
        seen = {}
        for role, count in spec.expected.items():
            members = client.wait_for(role, count, timeout=WAIT_S)
            seen[role] = len(members)
        # A barrier before anyone leaves: a member that saw everyone and left at once would be
        # missing for a slower peer still waiting to see it alive.
        client.set_status(state=OK)
        client.heartbeat()
        wait_all_ok(client, spec.expected, WAIT_S)
        client.post_metrics({"preflight": 1, **{f"peers_{r}": n for r, n in seen.items()}})
        update_record(spec, rank, preflight_ok=True, peers=seen)
        print(f"preflight: {spec.role} rank {rank} sees {seen} (expected {spec.expected})", flush=True)
    except BaseException:
        client.close()
        raise
    return client
