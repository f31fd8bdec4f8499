"""Submitting a role job through submitit: sbatch, from a login node or from inside a job.

submitit renders, submits and numbers the job; its executor is specialised here for what it does
not do itself: submitting from inside a SLURM job (`outside_job_env`), a one-element job array
(`_array_executor`), and a staged job's own command and script (`_staged_executor`).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

from streamrl_cli.errors import ClusterError
from streamrl_cli.launch.plan import JobSpec
from streamrl_cli.launch.slurm.script import (
    batch_log_in_run_root,
    job_command,
    job_python,
    log_folder,
    sbatch_parameters,
)
from streamrl_cli.rundir import RunDir


def submit(job: JobSpec, run_name: str, run_dir: Path, entry: Any, spec_path: Path) -> str:
    """Submit ``entry(spec_path)`` as ``job``; returns the SLURM job id (the array id for arrays).

    A staged job (``run_root``) runs ``python -m streamrl_cli.roles`` on its staged spec instead
    of submitit's runner; submitit still renders, submits and numbers it.
    """
    import submitit

    cls = _array_executor() if job.array else _executor()
    if job.run_root:
        cls = _staged_executor(job, run_dir, cls)
    executor = cls(folder=RunDir(run_dir).role_logs(job.role), python=job_python(job))
    executor.update_parameters(**sbatch_parameters(job, run_name, run_dir))
    try:
        if job.array:
            jobs = executor.map_array(entry, [str(spec_path)] * job.array)
            return jobs[0].job_id.split("_")[0]
        return executor.submit(entry, str(spec_path)).job_id
    except (submitit.core.utils.FailedJobError, subprocess.CalledProcessError, OSError) as e:
        raise ClusterError(
            f"sbatch refused the {job.role} job on cluster {job.cluster!r}: {_stderr(e)}"
        ) from None


# Variables of the job a submission is made from that the new job must not inherit: sbatch passes
# the environment on, and srun in the new job then refuses e.g. the old job's SLURM_MEM_PER_CPU
# beside its own SLURM_MEM_PER_NODE ("mutually exclusive"). SLURM_CONF names the cluster: kept.
KEPT_SLURM_VARS = frozenset({"SLURM_CONF"})


def outside_job_env(environ: Any = None) -> list[str]:
    """`env -u ...` that runs a command without the SLURM job variables of the job we are in (none
    outside a job): a trainer submitted again by the rendezvous role's job watcher, or a generator
    array added by scaling, starts from a clean environment as one submitted from a login node."""
    environ = os.environ if environ is None else environ
    if "SLURM_JOB_ID" not in environ:
        return []
    drop = sorted(k for k in environ if k.startswith(("SLURM_", "SRUN_")) and k not in KEPT_SLURM_VARS)
    return ["env", *(arg for k in drop for arg in ("-u", k))]


def _executor() -> type:
    import submitit

    class Executor(submitit.SlurmExecutor):
        """submitit's executor, submitting outside the job it may be called from (`outside_job_env`)."""

        def _make_submission_command(self, submission_file_path):  # type: ignore[no-untyped-def]
            return [*outside_job_env(), *super()._make_submission_command(submission_file_path)]

    return Executor


def _array_executor() -> type:
    import uuid

    from submitit.core.utils import JobPaths
    from submitit.slurm.slurm import SlurmJob

    class ArrayExecutor(_executor()):
        """submitit's array branch, run by this executor itself: submitit submits a one-element map
        as a plain job (a generator stays an array even with one instance, so that elastic scaling
        is always adding or cancelling array tasks), and it submits larger arrays through a plain
        copy of the executor, which would drop a subclass's script (see `_staged_executor`)."""

        def _internal_process_submissions(self, delayed):  # type: ignore[no-untyped-def]
            folder = JobPaths.get_first_id_independent_folder(self.folder)
            folder.mkdir(parents=True, exist_ok=True)
            pickles = []
            for d in delayed:
                pickles.append(folder / f"{uuid.uuid4().hex}.pkl")
                d.set_timeout(self.parameters.get("time", 5), self.max_num_timeout)
                d.dump(pickles[-1])
            self.parameters["map_count"] = len(delayed)
            try:
                first = self._submit_command(self._submitit_command_str)
            finally:
                del self.parameters["map_count"]
            tasks = list(range(first.num_tasks))
            jobs = [
                SlurmJob(folder=self.folder, job_id=f"{first.job_id}_{a}", tasks=tasks)
                for a in range(len(delayed))
            ]
            for job, path in zip(jobs, pickles, strict=True):
                job.paths.move_temporary_file(path, "submitted_pickle")
            return jobs

    return ArrayExecutor


def _staged_executor(job: JobSpec, run_dir: Path, base: type) -> type:
    from submitit.slurm.slurm import _make_sbatch_string

    command, folder = job_command(job, run_dir), log_folder(run_dir, job)

    class StagedExecutor(base):  # type: ignore[misc, valid-type]
        """Submits from the run's log folder here; the job runs ``command`` and logs to ``folder``,
        on its own cluster's filesystem."""

        @property
        def _submitit_command_str(self) -> str:
            return command

        def _make_submission_file_text(self, command: str, uid: str) -> str:
            return batch_log_in_run_root(
                _make_sbatch_string(command=command, folder=folder, **self.parameters), job, run_dir
            )

    return StagedExecutor


def _stderr(e: BaseException) -> str:
    out = getattr(e, "stderr", None) or getattr(e, "output", None) or str(e)
    return out.decode(errors="replace").strip() if isinstance(out, bytes) else str(out).strip()
