"""One interface to what starts a run's roles: a cluster's ``launcher`` key names its implementation.

    local  (launch/local.py)  role processes on this machine, recorded in local.json
    slurm  (launch/slurm/)    SLURM jobs and job arrays through submitit, recorded in jobs.json

Everything that starts, stops or looks at a run's roles goes through it, whatever the launcher:

- :func:`submit`: the one path that starts a role job and records it in the run directory, used by
  `streamrl run` (every role), `streamrl scale` (generator instances added, :class:`Added`) and the
  trainer restart (a job that replaces the one that died);
- ``Launcher.report``: what the launcher knows of the run now (`streamrl status`, `cancel`, `--resume`);
- ``Launcher.cancel``, ``instances``, ``release``, ``ranks``: cancel, and scaling a role in and out.

``Launcher.foreground`` says who watches the roles: `streamrl run` itself, which stays in the
foreground (local processes), or the rendezvous role's job watcher (SLURM jobs, see
launch.server_role), which also applies scale requests and restarts the trainer there.
"""

from __future__ import annotations

from typing import Any

from streamrl_cli.errors import ClusterError
from streamrl_cli.launch.base import Added, Instance, Launcher, Report, Submission
from streamrl_cli.launch.plan import JobSpec
from streamrl_cli.rundir import RunDir

__all__ = [  # the interface (launch.base), named here too: where every launcher is reached
    "Added",
    "Instance",
    "Launcher",
    "Report",
    "Submission",
    "every",
    "get",
    "of_role",
    "registry",
    "reports",
    "submit",
]


def registry() -> dict[str, type[Launcher]]:
    """Launcher name (a cluster's ``launcher`` key, recipe.schema.LAUNCHERS) -> its class, in the
    order they are asked: queued jobs are cancelled before local processes (the local rendezvous
    server goes last)."""
    from streamrl_cli.launch.local import LocalLauncher
    from streamrl_cli.launch.slurm.launcher import SlurmLauncher

    return {"slurm": SlurmLauncher, "local": LocalLauncher}


def get(name: str) -> Launcher:
    known = registry()
    if name not in known:
        raise ClusterError(f"unknown launcher {name!r}; valid: {', '.join(known)}")
    return known[name]()


def every() -> list[Launcher]:
    return [cls() for cls in registry().values()]


def of_role(run: RunDir, role: str) -> Launcher:
    """The launcher of ``role``'s cluster in this run (from its spec and run.json; local when unknown)."""
    from streamrl_cli.launch import run_state

    cluster = run_state.role_spec(run, role).cluster
    return get(run.info().get("clusters", {}).get(cluster, {}).get("launcher", "local"))


def reports(run: RunDir) -> list[Report]:
    """What every launcher knows of the run now."""
    return [launcher.report(run) for launcher in every()]


def submit(
    run: RunDir,
    job: JobSpec,
    *,
    added: Added | None = None,
    replaces: dict[str, Any] | None = None,
    announce: bool = True,
    **note: Any,
) -> Submission:
    """Start a role job with its cluster's launcher and record it in the run directory: the one way
    `streamrl run`, `streamrl scale` (``added``) and a trainer restart (``replaces``, with
    ``announce`` off: the restart is its own event) start roles."""
    sub = get(job.launcher).start(
        run, job, run.role_spec(job.role), added=added, replaces=replaces, note=note
    )
    if announce:
        run.event(sub.event[0], **sub.event[1])
    return sub
