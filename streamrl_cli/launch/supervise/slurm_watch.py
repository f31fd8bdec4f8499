"""The supervisor's side for a run's SLURM jobs: the rendezvous role's job watcher.

It feeds launch.supervise.supervisor what squeue and sacct say of the run's jobs (jobs.json),
submits a trainer job that died again, and cancels what is left once the run ended; the decisions
are the supervisor's, the same as for local processes (launch.supervise.local_watch). It runs in
the rendezvous role's process (launch.server_role), beside the server it stops at the end.
"""

from __future__ import annotations

import logging
import os
import signal
import time

from streamrl_cli import environ
from streamrl_cli.errors import ClusterError
from streamrl_cli.launch import slurm
from streamrl_cli.launch.supervise.supervisor import CANCELLED, COMPLETED, FAILED, RUNNING, Member, Outcome
from streamrl_cli.rundir import POOL_ROLES, RunDir

log = logging.getLogger("streamrl.rendezvous")

POLL_S = 15.0  # between polls of the run's jobs; $STREAMRL_JOB_POLL_S overrides (environ.JOB_POLL)
# After the trainer ended, how long generators get to hand over and leave before what is left of
# the run's jobs is cancelled (longer than for local processes: SLURM reports ends a poll late).
SLURM_EXIT_S = 180.0
# A trainer job that ended in one of these did not finish the run: it is submitted again.
TRAINER_DIED = {"FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "TIMEOUT", "PREEMPTED"}


class SlurmSide:
    """The supervisor's side for a run's SLURM jobs (jobs.json, their tasks' states from squeue and
    sacct): the same decisions as `streamrl run` makes for local processes (launch.supervise.supervisor)."""

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
