"""The rendezvous role: the run's control-plane server (streamrl_cli.rendezvous), plus, when it
serves a SLURM run, a watcher (launch.supervise.slurm_watch) that stops it once every other job of
the run has ended, so that no server outlives its run (on the submitting host or as its own job),
and the follower of its scale requests (launch.scale.follow)."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

from streamrl_cli import environ
from streamrl_cli.launch.supervise.slurm_watch import POLL_S, SlurmSide
from streamrl_cli.launch.supervise.supervisor import supervise
from streamrl_cli.roles.spec import RendezvousSpec
from streamrl_cli.rundir import RunDir

log = logging.getLogger("streamrl.rendezvous")


def main(spec: RendezvousSpec, rank: int) -> int:
    from streamrl_cli.rendezvous.server import serve
    from streamrl_cli.roles.requeue import EndSignals

    s = spec.settings
    run = RunDir(Path(spec.run_dir))
    # As its own SLURM job (placement=job) the server gets USR2 signal_lead_s before its time limit:
    # it stops (the journal holds the run's state) and the job requeues itself; the requeued job
    # serves again from the journal, and members wait for it meanwhile (rendezvous.json says so).
    ends = EndSignals(on_signal=_stop_on_usr2)
    threading.Thread(target=supervise, args=(run, SlurmSide(run)), daemon=True).start()
    threading.Thread(target=_apply_scale_requests, args=(run, spec), daemon=True).start()
    serve(
        Path(spec.run_dir),
        host=s.bind_host,
        port=s.port,
        lease_s=s.lease_s,
        tls_cert=Path(s.tls_cert).expanduser() if s.tls_cert else None,
        tls_key=Path(s.tls_key).expanduser() if s.tls_key else None,
    )
    if ends.requeue and run.info().get("state") not in ("finished", "failed", "cancelling", "cancelled"):
        _requeue(run)
    return 0


def _stop_on_usr2(name: str) -> None:
    if name == "SIGUSR2":
        os.kill(os.getpid(), signal.SIGTERM)  # the server's own handler stops it cleanly


def _requeue(run: RunDir) -> None:
    """Put this job back in the queue after the server stopped on USR2, telling members to wait."""
    from streamrl_cli.roles.requeue import own_job_id, requeue_self
    from streamrl_cli.rundir import read_json, write_atomic

    endpoint = {k: v for k, v in (read_json(run.endpoint) or {}).items() if k != "stopped"}
    write_atomic(run.endpoint, json.dumps({**endpoint, "requeued": time.time()}).encode(), durable=True)
    run.event("rendezvous_requeued", job_id=own_job_id())
    # Said before the requeue: SLURM ends this job as soon as it is back in the queue, and a line
    # logged after that can be lost with the job's last output (it was, once, in CI).
    log.warning("rendezvous server stopped on SIGUSR2 (time limit near): requeuing job %s", own_job_id())
    requeue_self()


def _apply_scale_requests(run: RunDir, spec: RendezvousSpec) -> None:
    """For a run whose generators no `streamrl run` watches (SLURM jobs), this process applies scale
    requests (launch.scale.follow)."""
    from streamrl_cli.errors import StreamRLError
    from streamrl_cli.launch import launcher
    from streamrl_cli.launch.scale.follow import ScaleFollower
    from streamrl_cli.rendezvous import RendezvousClient
    from streamrl_cli.roles.preflight import wait_for_file

    try:
        if launcher.of_role(run, "generator").foreground:
            return  # generators `streamrl run` watches (local processes): it applies them
        wait_for_file(Path(spec.rendezvous_file), 60.0)
        follower = ScaleFollower(run, RendezvousClient.from_run_dir(run.path, tls_ca=spec.rendezvous_ca))
    except (StreamRLError, OSError) as e:
        log.error("scale requests will not be applied: %s", e)
        return
    while True:
        try:
            follower.poll(timeout=10.0)
        except StreamRLError as e:  # the server stopping, or a moment unreachable
            log.warning("scale requests: %s", e)
            time.sleep(environ.job_poll_s(POLL_S))
