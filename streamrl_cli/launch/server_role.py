"""The rendezvous role: the run's control-plane server (streamrl_cli.rendezvous), plus, when it
serves a SLURM run, a watcher that stops it once every other job of the run has ended, so
that no server outlives its run (on the submitting host or as its own job)."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

from streamrl_cli import environ
from streamrl_cli.errors import ClusterError
from streamrl_cli.launch import slurm
from streamrl_cli.launch.supervisor import CANCELLED, COMPLETED, FAILED, RUNNING, Member, Outcome, supervise
from streamrl_cli.roles.spec import RendezvousSpec
from streamrl_cli.rundir import POOL_ROLES, RunDir

log = logging.getLogger("streamrl.rendezvous")

POLL_S = 15.0  # between polls of the run's jobs; $STREAMRL_JOB_POLL_S overrides (environ.JOB_POLL)
# After the trainer ended, how long generators get to hand over and leave before what is left of
# the run's jobs is cancelled (longer than for local processes: SLURM reports ends a poll late).
SLURM_EXIT_S = 180.0
# A trainer job that ended in one of these did not finish the run: it is submitted again.
TRAINER_DIED = {"FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "TIMEOUT", "PREEMPTED"}


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


class SlurmSide:
    """The supervisor's side for a run's SLURM jobs (jobs.json, their tasks' states from squeue and
    sacct): the same decisions as `streamrl run` makes for local processes (launch.supervisor)."""

    confirm = 2  # polls in a row: a job array can look ended for a moment between its tasks' records
    grace_s = SLURM_EXIT_S

    def __init__(self, run: RunDir) -> None:
        self.run = run
        self.poll_s = environ.job_poll_s(POLL_S)
        self.states: list[dict] = []

    def interrupted(self) -> bool:
        return not self.run.run_json.exists()  # the run directory was deleted: nothing to serve

    def may_restart(self) -> bool:
        return True

    def members(self) -> list[Member] | None:
        jobs = [j for j in self.run.jobs() if j["role"] != "rendezvous"]
        if not jobs:
            return None  # a local run (streamrl run watches it), or jobs not submitted yet
        self.states = slurm.run_job_states(jobs)
        return [_member(j, t) for j in self.states for t in j["tasks"]]

    def lost(self, member: Member) -> None:
        self.run.event(
            "member_failed", role=member.role, rank=member.rank, job=member.key, state=member.detail
        )
        log.warning("%s %s (job %s) ended %s: the run goes on without it",
                    member.role, member.rank, member.key, member.detail)  # fmt: skip

    def restart_trainer(self, members: list[Member], dead: list[Member]) -> bool:
        """A SLURM trainer job that died (a rank killed or crashed, its node lost) is submitted again;
        the new job resumes from the newest checkpoint. Its record takes the place of the old job's."""
        from streamrl_cli.errors import StreamRLError
        from streamrl_cli.launch import launcher
        from streamrl_cli.launch.run_state import role_job
        from streamrl_cli.roles.restart import mark_trainer_start

        old = dead[0].ref
        ended = sorted({m.detail for m in dead})
        n = int(self.run.info().get("trainer_restarts") or 0) + 1
        try:
            job_id = launcher.submit(
                self.run, role_job(self.run, "trainer"), replaces=old, announce=False, restart=n
            ).job_id
        except StreamRLError as e:
            log.error(
                "the trainer job %s ended %s and could not be submitted again: %s", old["job_id"], ended, e
            )
            self.run.event("trainer_restart_failed", job_id=old["job_id"], error=str(e))
            return  # the next poll sees the same dead job: with no restart left it ends the run
        self.run.update_info(trainer_restarts=n)
        mark_trainer_start(self.run)
        self.run.event("trainer_restarted", restart=n, job_id=job_id, replaces=old["job_id"], states=ended)
        log.warning("the trainer job %s ended %s: submitted it again as job %s (restart %d)",
                    old["job_id"], ended, job_id, n)  # fmt: skip
        return True

    def wait(self) -> None:
        time.sleep(self.poll_s)

    def pools_ended(self) -> bool:
        members = self.members() or []
        return all(m.state != RUNNING for m in members if m.role in POOL_ROLES)

    def stop_leftovers(self) -> list[str]:
        """Scancel what is still queued or running of the run's role jobs (never this job)."""
        done = []
        for j in slurm.unfinished(self.states):
            try:
                slurm.cancel(j.get("slurm_cluster"), j["job_id"])
                done.append(f"scancel {j['job_id']} ({j['role']})")
            except ClusterError as e:
                log.error("%s", e)
        return done

    def ended(self, outcome: Outcome) -> None:
        log.info("the run %s: stopping the rendezvous server", outcome.state)
        os.kill(os.getpid(), signal.SIGTERM)  # the server's own handler stops it cleanly


def _member(job: dict, task: dict) -> Member:
    state = task["state"]
    if state not in slurm.TERMINAL:
        kind = RUNNING  # pending, running, requeued, or not known right now
    elif state == "COMPLETED":
        kind = COMPLETED
    elif state == "CANCELLED":
        kind = CANCELLED
    else:
        kind = FAILED
    t = task["task"]
    array_task = t if isinstance(t, int) else None
    rank = 0 if job["role"] == "trainer" else None
    if array_task is not None:
        rank = int(job.get("rank_base", 0)) + array_task
    return Member(
        role=job["role"],
        key=f"{job['job_id']}_{t}" if t is not None else str(job["job_id"]),
        rank=rank,
        state=kind,
        detail=state,
        released=array_task is not None and array_task in job.get("released", []),
        restartable=state in TRAINER_DIED,
        ref=job,
    )


def _apply_scale_requests(run: RunDir, spec: RendezvousSpec) -> None:
    """For a run whose generators no `streamrl run` watches (SLURM jobs), this process applies scale
    requests (scale_follow)."""
    from streamrl_cli.errors import StreamRLError
    from streamrl_cli.launch import launcher
    from streamrl_cli.launch.scale_follow import ScaleFollower
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
