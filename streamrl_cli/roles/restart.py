"""The trainer's restart budget (roles.trainer.restarts), read by whoever starts it again (`streamrl
run` for a local trainer, the rendezvous role's job watcher on SLURM) and by the trainer itself, which
tells the generators whether to wait for its next process."""

from __future__ import annotations

from streamrl_cli.roles.spec import TrainerSpec, load_spec
from streamrl_cli.rundir import RunDir

# Leave reason (prefix) of a trainer that failed and will be started again: the generators wait.
RESTARTING = "restarting"


def trainer_restarts_left(run: RunDir) -> int:
    """How many more times this attempt of the run may start its trainer again (roles.trainer.restarts).

    None once the trainer died without training an iteration since it (re)started: a failure at
    start (a bad program, a reward that cannot run) would fail the same way again.
    """
    from streamrl_cli.metrics.read import count_iteration_records

    spec = load_spec(run.role_spec("trainer"))
    assert isinstance(spec, TrainerSpec)
    info = run.info()
    if count_iteration_records(run.path) <= int(info.get("trainer_started_after") or 0):
        return 0
    return spec.settings.restarts - int(info.get("trainer_restarts") or 0)


def mark_trainer_start(run: RunDir) -> None:
    """Remember how many iterations were recorded when the trainer (re)started (see above)."""
    from streamrl_cli.metrics.read import count_iteration_records

    run.update_info(trainer_started_after=count_iteration_records(run.path))
