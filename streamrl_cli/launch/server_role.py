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
from streamrl_cli.launch import slurm
from streamrl_cli.roles.spec import RendezvousSpec
from streamrl_cli.rundir import RunDir

log = logging.getLogger("streamrl.rendezvous")

POLL_S = 15.0  # between polls of the run's jobs; $STREAMRL_JOB_POLL_S overrides (environ.JOB_POLL)


def main(spec: RendezvousSpec, rank: int) -> int:
    from streamrl_cli.rendezvous.server import serve
    from streamrl_cli.roles.requeue import EndSignals

    s = spec.settings
    run = RunDir(Path(spec.run_dir))
    # As its own SLURM job (placement=job) the server gets USR2 signal_lead_s before its time limit:
    # it stops (the journal holds the run's state) and the job requeues itself; the requeued job
    # serves again from the journal, and members wait for it meanwhile (rendezvous.json says so).
    ends = EndSignals(on_signal=_stop_on_usr2)
    threading.Thread(target=_stop_when_jobs_end, args=(run,), daemon=True).start()
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


def _stop_when_jobs_end(run: RunDir) -> None:
    ended_polls = 0
    while True:
        time.sleep(environ.job_poll_s(POLL_S))
        if not run.run_json.exists():  # the run directory was deleted: nothing to serve
            os.kill(os.getpid(), signal.SIGTERM)
            return
        jobs = [j for j in run.jobs() if j["role"] != "rendezvous"]
        if not jobs:
            continue  # a local run (streamrl run watches it), or jobs not submitted yet
        states = slurm.run_job_states(jobs)
        if _restart_trainer(run, states):
            ended_polls = 0
            continue
        # Two polls in a row: a job array can look ended for a moment between its tasks' records.
        ended_polls = ended_polls + 1 if slurm.all_ended(states) else 0
        if ended_polls >= 2:
            # Tasks released by scaling were cancelled on purpose: they say nothing about the run.
            final = {t["state"] for j in states for t in j["tasks"] if t["task"] not in j.get("released", [])}
            # The trainer's job says how the run ended: a generator task lost on the way (killed,
            # its node failed) was replaced by the others and does not fail a run that trained.
            trainer = {t["state"] for j in states if j["role"] == "trainer" for t in j["tasks"]} or final
            lost = sorted(
                f"{j['job_id']}_{t['task']}" if t["task"] is not None else str(j["job_id"])
                for j in states
                if j["role"] == "generator"
                for t in j["tasks"]
                if t["task"] not in j.get("released", []) and t["state"] not in ("COMPLETED", "CANCELLED")
            )
            info = run.info()
            if info.get("state") not in ("cancelling", "cancelled"):
                state = (
                    "finished"
                    if trainer == {"COMPLETED"}
                    else "cancelled"
                    if "CANCELLED" in final
                    else "failed"
                )
                run.update_info(state=state, ended=time.time())
                run.event(state, job_states=sorted(final), **({"lost_generators": lost} if lost else {}))
            os.kill(os.getpid(), signal.SIGTERM)
            return


# A trainer job that ended in one of these did not finish the run: it is submitted again.
TRAINER_DIED = {"FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "TIMEOUT", "PREEMPTED"}


def _restart_trainer(run: RunDir, states: list[dict]) -> bool:
    """A SLURM trainer job that died (a rank killed or crashed, its node lost) is submitted again
    while roles.trainer.restarts allows; the new job resumes from the newest checkpoint. True when
    it was. A cancelled run, or a trainer job SLURM requeues itself, is left alone."""
    from streamrl_cli.errors import StreamRLError
    from streamrl_cli.launch import launcher
    from streamrl_cli.launch.run_state import role_job
    from streamrl_cli.roles.restart import mark_trainer_start, trainer_restarts_left

    trainer = [j for j in states if j["role"] == "trainer"]
    if len(trainer) != 1 or not trainer[0]["tasks"]:
        return False
    (old,) = trainer
    ended = {t["state"] for t in old["tasks"]}
    if not ended <= slurm.TERMINAL or not ended & TRAINER_DIED:
        return False
    if run.info().get("state") in ("cancelling", "cancelled") or trainer_restarts_left(run) <= 0:
        return False
    n = int(run.info().get("trainer_restarts") or 0) + 1
    try:
        # Its record takes the place of the old job's; the restart is the run's event, said below.
        job_id = launcher.submit(
            run, role_job(run, "trainer"), replaces=old, announce=False, restart=n
        ).job_id
    except StreamRLError as e:
        log.error("the trainer job %s ended %s and could not be submitted again: %s", old["job_id"], ended, e)
        return False
    run.update_info(trainer_restarts=n)
    mark_trainer_start(run)
    run.event("trainer_restarted", restart=n, job_id=job_id, replaces=old["job_id"], states=sorted(ended))
    log.warning("the trainer job %s ended %s: submitted it again as job %s (restart %d)",
                old["job_id"], sorted(ended), job_id, n)  # fmt: skip
    return True


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
