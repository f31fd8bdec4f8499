"""A role's own SLURM job: the signals that say it must end soon, and requeueing it.

SLURM warns a job before it ends: USR2 `roles.<role>.signal_lead_s` before the time limit (the
job's `--signal`, or `scancel --signal=USR2` by hand), SIGTERM when it is cancelled, preempted
or requeued (then SIGKILL after the site's KillWait). submitit's own handlers would treat USR2 as
"timed out and not checkpointable" and bypass SIGTERM; a role that knows how to end cleanly
installs :class:`EndSignals` instead. After USR2 the role requeues its own job (the trainer
resumes from the checkpoint it just wrote; a generator task rejoins); after SIGTERM, SLURM
decides (a preemption with requeue, or a cancel).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
from collections.abc import Callable

from streamrl_cli.errors import ClusterError

log = logging.getLogger("streamrl.roles")

# Leave reasons (prefixes) of a member whose job comes back (requeued by itself, or by SLURM after a
# preemption): its peers wait for it instead of ending.
REQUEUED = "requeued"
PREEMPTED = "preempted"


def under_slurm() -> bool:
    """A role submitted as a SLURM job (submitit's), not a local run started inside an allocation,
    whose job is the user's to requeue or not."""
    return os.environ.get("SUBMITIT_EXECUTOR") == "slurm" and "SLURM_JOB_ID" in os.environ


def own_job_id() -> str:
    """This task's job as scontrol names it: `array_task` for an array task, else the job id."""
    env = os.environ
    if "SLURM_ARRAY_JOB_ID" in env and "SLURM_ARRAY_TASK_ID" in env:
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env["SLURM_JOB_ID"]


def requeue_self(timeout_s: float = 60.0) -> str:
    """Put this job (or array task) back in the queue; it starts again from the top. Returns its id."""
    job = own_job_id()
    cluster = os.environ.get("SLURM_CLUSTER_NAME")
    cmd = ["scontrol", *(["-M", cluster] if cluster else []), "requeue", job]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ClusterError(f"cannot requeue job {job}: {e}") from None
    if res.returncode != 0:
        raise ClusterError(f"cannot requeue job {job}: {(res.stderr or res.stdout).strip()}")
    return job


def requeue_leave_reason(member_id: str) -> str:
    """Put this pool member's task back in the queue (after USR2); the leave reason that says so,
    or why it could not be. Logged first: SLURM ends the task once it is back in the queue, and
    may lose later output."""
    log.info("%s: requeuing task %s", member_id, own_job_id())
    try:
        job = requeue_self()
    except ClusterError as e:
        log.error("%s: %s", member_id, e)
        return f"failed: {e}"
    return f"{REQUEUED}: SIGUSR2, task {job}"


class EndSignals:
    """USR2 and SIGTERM under SLURM: remembered (`requested`, `signal_name`) for the role to act
    on at its next safe point, not acted on inside the handler. `on_signal` is also called (from
    the handler: keep it short). Outside SLURM it installs nothing: local runs keep their
    SIGTERM/Ctrl-C behaviour."""

    def __init__(self, on_signal: Callable[[str], None] | None = None, *, ignore: bool = False):
        self.requested = threading.Event()
        self.signal_name = ""
        self._on_signal = on_signal
        if not under_slurm():
            return
        for sig in (signal.SIGUSR2, signal.SIGTERM):
            # Ranks other than the trainer's rank 0 ignore them: rank 0 leads the checkpoint, which
            # needs every rank, then tells them to stop.
            signal.signal(sig, signal.SIG_IGN if ignore else self._handle)

    def _handle(self, signum: int, _frame: object) -> None:
        if not self.requested.is_set():
            self.signal_name = signal.Signals(signum).name
        self.requested.set()
        if self._on_signal is not None:
            self._on_signal(signal.Signals(signum).name)

    @property
    def requeue(self) -> bool:
        """USR2 (time limit near, or asked by hand): the role requeues its own job once it ended cleanly."""
        return self.signal_name == "SIGUSR2"
