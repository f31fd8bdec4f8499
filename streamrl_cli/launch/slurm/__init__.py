"""SLURM jobs through submitit, made cluster-aware.

submitit renders the sbatch script and pickles the role's entry function; what it lacks is
`--clusters`: it submits with `sbatch FILE` (the `#SBATCH --clusters=` line routes the job) but
polls state with `sacct -j ID` on the local cluster only. So here jobs are keyed by
(cluster, job id), and state and cancel go through `squeue -M` / `scancel -M` ourselves.

    script      the sbatch script of a job (pure: submitit's renderer, our parameters)
    staging     a job's files for a cluster without the submit host's filesystem (``run_root``)
    submission  sbatch through submitit's executor, from a login node or inside a job
    queue       squeue / sacct / scancel on the job's cluster, and how a run's jobs ended
    launcher    SlurmLauncher: the four above behind launch.launcher's interface, jobs.json
"""

from streamrl_cli.launch.slurm.launcher import SlurmLauncher
from streamrl_cli.launch.slurm.queue import TERMINAL, cancel, ending, query, run_job_states, unfinished
from streamrl_cli.launch.slurm.script import SUBMITIT_COMMAND, SUBMITIT_NAMES, log_folder, render, script_mode
from streamrl_cli.launch.slurm.staging import staged_files
from streamrl_cli.launch.slurm.submission import outside_job_env, submit

__all__ = [
    "SUBMITIT_COMMAND",
    "SUBMITIT_NAMES",
    "TERMINAL",
    "SlurmLauncher",
    "cancel",
    "ending",
    "log_folder",
    "outside_job_env",
    "query",
    "render",
    "run_job_states",
    "script_mode",
    "staged_files",
    "submit",
    "unfinished",
]
