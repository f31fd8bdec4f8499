"""The sbatch script of a role job: submitit's own renderer, given the job's parameters.

Pure: what the script says follows from the job and the run directory (a staged job's script
carries the staged files, read from the run directory; see .staging). Submission (.submission)
hands submitit the same parameters, so the script written in jobs/ is the one that is queued.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any

from streamrl_cli.launch.plan import JobSpec
from streamrl_cli.launch.slurm.staging import stage_lines, staged_run
from streamrl_cli.recipe.checks import templates_dir
from streamrl_cli.rundir import RunDir

SUBMITIT_COMMAND = "{python} -u -m submitit.core._submit {folder}"
SRUN_ARGS = ("--kill-on-bad-exit=1", "--cpu-bind=cores")
# Site options that submitit renders itself: set through its parameter, so one line comes out.
SUBMITIT_NAMES = {
    "mem": "mem",
    "wckey": "wckey",
    "account": "account",
    "qos": "qos",
    "comment": "comment",
    "constraint": "constraint",
    "exclude": "exclude",
    "mem-per-gpu": "mem_per_gpu",
    "mem-per-cpu": "mem_per_cpu",
}


def setup_lines(job: JobSpec, run_dir: Path) -> list[str]:
    """The job's setup: the cluster's template (Jinja, shell `${...}` left alone) then its env."""
    lines: list[str] = []
    if job.setup_template:
        import jinja2

        text = (templates_dir() / job.setup_template).read_text()
        tmpl = jinja2.Template(text, undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
        rendered = tmpl.render(site=job.site, cluster=job.cluster, role=job.role, run_dir=str(run_dir))
        lines += rendered.rstrip("\n").splitlines()
    lines += [f"export {k}={shlex.quote(str(v))}" for k, v in sorted(job.env.items())]
    return lines


def sbatch_parameters(job: JobSpec, run_name: str, run_dir: Path) -> dict[str, Any]:
    """submitit SlurmExecutor parameters for ``job`` (names as `_make_sbatch_string` takes them)."""
    extra: dict[str, Any] = {}
    if job.slurm_cluster:
        extra["clusters"] = job.slurm_cluster
    there = staged_run(job, run_dir)
    setup = setup_lines(job, there.path if there else run_dir)
    params: dict[str, Any] = {
        "job_name": f"streamrl-{run_name}-{job.role}",
        "partition": job.partition,
        "time": job.time_min,
        "nodes": job.nodes,
        "ntasks_per_node": job.tasks_per_node,
        "cpus_per_task": job.cpus_per_task,
        "setup": [*stage_lines(job, run_dir), *setup] if there else setup,
        "stderr_to_stdout": True,
        "signal_delay_s": job.signal_lead_s,
        "wckey": None,  # submitit's default ("submitit") is dropped: sites that want one set `sbatch.wckey`
        # One dead rank ends the step at once, instead of leaving the others in a collective until
        # its timeout; cores bound per task so that ranks do not migrate across each other's cores.
        "srun_args": [*SRUN_ARGS, *job.srun_args],
    }
    if job.gpus_per_node:
        params["gpus_per_node"] = job.gpus_per_node
    if job.mem_gb is not None:
        params["mem"] = f"{job.mem_gb}GB" if job.mem_gb else "0"
    if job.account:
        params["account"] = job.account
    if job.qos:
        params["qos"] = job.qos
    if job.exclusive:
        extra["exclusive"] = True
    if job.array:
        params["array_parallelism"] = job.max_running or job.array
    for key, value in job.sbatch.items():  # the site's options last: they may override ours (mem, time)
        if value is None or value is False:
            continue
        name = key.replace("_", "-")
        if name in SUBMITIT_NAMES:
            params[SUBMITIT_NAMES[name]] = value
        else:
            extra[name] = value
    if extra:
        params["additional_parameters"] = extra
    return params


def job_python(job: JobSpec) -> str:
    """The interpreter the job's nodes run: the cluster's own, else this host's (shared software)."""
    return job.python or shlex.quote(sys.executable)


def log_folder(run_dir: Path, job: JobSpec) -> Path:
    """Where the job's logs go: the role's log folder of the run (of its staged copy when staged)."""
    return (staged_run(job, run_dir) or RunDir(run_dir)).role_logs(job.role)


def job_command(job: JobSpec, run_dir: Path, python: str | None = None) -> str:
    """What each task of the job runs under srun.

    submitit's runner unpickles the role's entry from the log folder, which only a shared
    filesystem brings to the nodes; a staged job runs the role's own command on its staged spec.
    """
    py = job.python or python or job_python(job)
    there = staged_run(job, run_dir)
    if there is not None:
        return f"{py} -u -m streamrl_cli.roles {shlex.quote(str(there.role_spec(job.role)))}"
    return SUBMITIT_COMMAND.format(python=py, folder=shlex.quote(str(log_folder(run_dir, job))))


def render(job: JobSpec, run_name: str, run_dir: Path, python: str | None = None) -> str:
    """The sbatch script submitit will submit for ``job`` (same function, same parameters)."""
    from submitit.slurm.slurm import _make_sbatch_string

    text = _make_sbatch_string(
        command=job_command(job, run_dir, python),
        folder=log_folder(run_dir, job),
        map_count=job.array,
        **sbatch_parameters(job, run_name, run_dir),
    )
    return batch_log_in_run_root(text, job, run_dir)


def batch_log_in_run_root(text: str, job: JobSpec, run_dir: Path) -> str:
    """A staged job's own log (`#SBATCH --output`) goes directly in ``run_root``: SLURM opens it
    before the script runs, so its directory must already exist there, and the run's directory
    under it is made by the script. The roles' logs (srun's) go in the run's log folder there."""
    if not job.run_root:
        return text
    folder, root = log_folder(run_dir, job), Path(job.run_root)
    for flag in ("output", "error"):
        text = text.replace(f"#SBATCH --{flag}={folder}/", f"#SBATCH --{flag}={root}/{Path(run_dir).name}-")
    return text


def script_mode(job: JobSpec) -> int:
    """A staged job's script carries the run's secret: readable by its owner only."""
    return 0o600 if job.run_root else 0o644
