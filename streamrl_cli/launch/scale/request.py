"""`streamrl scale RUN --generators N|+N|-N`: ask the run for a number of generator instances.

The request goes through the run's rendezvous; the process that watches the run applies it
(``launch.scale.follow``) and writes the outcome to ``events.jsonl``, which is what this waits for.
"""

from __future__ import annotations

import re
from typing import Any

from streamrl_cli.errors import ClusterError, StreamRLError
from streamrl_cli.launch.scale import executor
from streamrl_cli.launch.scale.follow import wait_applied
from streamrl_cli.recipe.schema import INSTANCES
from streamrl_cli.rundir import RunDir

SPEC = re.compile(r"^([+-]?)(\d+)$")


class ScaleUsageError(StreamRLError):
    exit_code = 2


def target_count(spec: str, current: int) -> int:
    """`N` (absolute), `+N` or `-N` (relative to `current`) -> the instance count wanted."""
    m = SPEC.match(spec.strip())
    if m is None:
        raise ScaleUsageError(
            f"--generators {spec!r}: expected a count N, +N (add) or -N (release), e.g. 3, +1, -1"
        )
    sign, n = m.group(1), int(m.group(2))
    target = current + n if sign == "+" else current - n if sign == "-" else n
    if target < 0:
        raise ScaleUsageError(f"--generators {spec}: the run has {current} generator(s); cannot go below 0")
    if target > INSTANCES:
        raise ScaleUsageError(f"--generators {spec}: {target} instances, past the bound of {INSTANCES:,}")
    return target


def request(run: RunDir, spec: str, *, wait_s: float, reason: str = "") -> dict[str, Any]:
    """Post the request and wait for its outcome (the `scaled` / `scale_failed` event)."""
    from streamrl_cli.launch import run_state
    from streamrl_cli.rendezvous import RendezvousClient

    state = run.info().get("state")
    if state != "running":
        raise ClusterError(f"run {run.name} is {state or 'not started'}: only a running run can be scaled")
    target = target_count(spec, len(executor.instances(run)))
    ca = run_state.role_spec(run, "rendezvous").rendezvous_ca
    with RendezvousClient.from_run_dir(run.path, tls_ca=ca, retry_s=5.0) as client:
        seq = client.request_scale(
            target, source="user", reason=reason or f"streamrl scale --generators {spec}"
        )
    outcome = wait_applied(run, seq, wait_s)
    if outcome is None:
        raise ClusterError(
            f"scale request {seq} ({target} generators) was not applied within {wait_s:.0f}s; it is "
            f"applied by `streamrl run` (local generators) or the run's rendezvous process (SLURM): "
            f"is it still running? "
            f"See {run.events_jsonl}"
        )
    if outcome["event"] == "scale_failed":
        raise ClusterError(f"scale request {seq} failed: {outcome['error']}")
    return outcome
