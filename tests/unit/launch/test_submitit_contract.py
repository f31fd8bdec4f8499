"""The parts of submitit's private API that launch/slurm/ and profiling/jobs.py rely on.

setup.cfg pins submitit below the next minor release because of them; a new submitit that renames
or reshapes one fails here, with the name, rather than at the first `sbatch` of a real run.
"""

from __future__ import annotations

import importlib.util
import inspect

import pytest
import submitit
from submitit.core import utils
from submitit.slurm import slurm as submitit_slurm

from streamrl_cli.launch.slurm import SUBMITIT_COMMAND, SUBMITIT_NAMES

UPGRADE = "submitit changed what streamrl_cli/launch/slurm/ relies on (see setup.cfg's pin): "

# Every keyword launch.slurm.script.sbatch_parameters and render, and launch.slurm.submission
# ._staged_executor, pass to _make_sbatch_string.
SBATCH_KEYWORDS = {
    "command",
    "folder",
    "map_count",
    "job_name",
    "partition",
    "time",
    "nodes",
    "ntasks_per_node",
    "cpus_per_task",
    "setup",
    "stderr_to_stdout",
    "signal_delay_s",
    "wckey",
    "srun_args",
    "gpus_per_node",
    "mem",
    "account",
    "qos",
    "array_parallelism",
    "additional_parameters",
    *SUBMITIT_NAMES.values(),
}

# SlurmExecutor members our subclasses override or call, with the parameters they take.
EXECUTOR_METHODS = {
    "_make_submission_command": ["self", "submission_file_path"],
    "_internal_process_submissions": ["self", "delayed_submissions"],
    "_submit_command": ["self", "command"],
    "_make_submission_file_text": ["self", "command", "uid"],
    "update_parameters": None,
    "submit": None,
    "map_array": None,
}


def test_make_sbatch_string_takes_every_keyword_we_pass():
    fn = getattr(submitit_slurm, "_make_sbatch_string", None)
    assert fn is not None, UPGRADE + "submitit.slurm.slurm._make_sbatch_string is gone"
    params = inspect.signature(fn).parameters
    missing = sorted(SBATCH_KEYWORDS - set(params))
    assert not missing, UPGRADE + f"_make_sbatch_string no longer takes {missing}"


def test_the_job_runner_module_is_importable():
    module = SUBMITIT_COMMAND.split(" -m ")[1].split()[0]
    assert module == "submitit.core._submit"
    assert importlib.util.find_spec(module) is not None, UPGRADE + f"`python -m {module}` has no module"


@pytest.mark.parametrize("name", sorted(EXECUTOR_METHODS))
def test_executor_members_we_override_exist_in_the_base_class(name):
    member = inspect.getattr_static(submitit.SlurmExecutor, name, None)
    assert member is not None, UPGRADE + f"SlurmExecutor.{name} is gone (our subclass would be ignored)"
    want = EXECUTOR_METHODS[name]
    if want is not None:
        got = list(inspect.signature(member).parameters)
        assert got == want, UPGRADE + f"SlurmExecutor.{name}{tuple(got)} now, we override it as {tuple(want)}"


def test_executor_attributes_we_read():
    command_str = inspect.getattr_static(submitit.SlurmExecutor, "_submitit_command_str", None)
    assert isinstance(command_str, property), (
        UPGRADE + "SlurmExecutor._submitit_command_str is no longer a property (StagedExecutor overrides it)"
    )
    params = inspect.signature(submitit.SlurmExecutor.__init__).parameters
    for name in ("folder", "python", "max_num_timeout"):
        assert name in params, UPGRADE + f"SlurmExecutor() no longer takes {name!r}"


def test_job_and_paths_as_we_build_them(tmp_path):
    job_params = inspect.signature(submitit_slurm.SlurmJob.__init__).parameters
    for name in ("folder", "job_id", "tasks"):
        assert name in job_params, UPGRADE + f"SlurmJob() no longer takes {name!r}"
    paths = utils.JobPaths(tmp_path, job_id="7", task_id=0)
    assert paths.stdout.parent == tmp_path, UPGRADE + "JobPaths.stdout moved"
    for name in ("get_first_id_independent_folder", "move_temporary_file"):
        assert callable(getattr(utils.JobPaths, name, None)), UPGRADE + f"JobPaths.{name} is gone"
    for name in ("set_timeout", "dump"):
        assert callable(getattr(utils.DelayedSubmission, name, None)), (
            UPGRADE + f"DelayedSubmission.{name} is gone"
        )
    assert issubclass(utils.FailedJobError, Exception), UPGRADE + "submitit.core.utils.FailedJobError"
