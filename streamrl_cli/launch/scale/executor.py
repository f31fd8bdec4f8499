"""Applying a generator instance count to a run, through the generators' launcher (launch.launcher).

An instance is identified by its rank (`generator-<rank>` in the rendezvous). Ranks are never
reused: a new instance takes the next rank after every rank the run ever had, so the trainer sees
a new member, not a restart of an old one.

Instances are added by the one path that starts role jobs (`launcher.submit`, with `Added`): one
more role process each for `launcher: local` (recorded in `local.json` like the others), a new
array job of the generator role for `launcher: slurm` (recorded in `jobs.json` with `rank_base`),
so `status` shows them and `cancel` stops them. A released instance gets SIGTERM from its launcher
(SLURM's scancel of its task sends it first): it aborts what is in flight, hands over what
finished, leaves the rendezvous (the trainer re-dispatches what it still owed, at once), and exits.

The newest instances go first when releasing: at a far site the relay is the lowest rank, so it
stays.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from streamrl_cli.errors import ClusterError
from streamrl_cli.launch import launcher, run_state
from streamrl_cli.launch.base import Added, Instance
from streamrl_cli.launch.plan import JobSpec
from streamrl_cli.rundir import RunDir


@dataclass(kw_only=True)
class ScaleResult:
    before: int
    after: int
    added: list[int] = field(default_factory=list)
    released: list[int] = field(default_factory=list)
    jobs: list[str] = field(default_factory=list)  # jobs submitted (SLURM array jobs)


def generator_job(run: RunDir) -> JobSpec:
    """The generator role's job as the run launched it (from its resolved config)."""
    return run_state.role_job(run, "generator")


def instances(run: RunDir) -> list[Instance]:
    """The generator instances the run has now (started or queued, not released, not ended)."""
    out = [i for each in launcher.every() for i in each.instances(run, "generator")]
    return sorted(out, key=lambda i: i.rank)


def next_rank(run: RunDir) -> int:
    """One past every generator rank the run ever had (processes, array tasks, start records)."""
    ranks = [rank for each in launcher.every() for rank in each.ranks(run, "generator")]
    for f in run.members.glob("generator-*.json"):
        suffix = f.stem.removeprefix("generator-")
        if suffix.isdigit():
            ranks.append(int(suffix))
    return max(ranks, default=-1) + 1


def apply(run: RunDir, target: int, *, job: JobSpec | None = None) -> ScaleResult:
    """Start or release generator instances until the run has `target`."""
    if target < 0:
        raise ClusterError(f"cannot scale to {target} generator instances (0 or more)")
    have = instances(run)
    result = ScaleResult(before=len(have), after=len(have))
    if target > len(have):
        job = job or generator_job(run)
        base, k = next_rank(run), target - len(have)
        # k more instances of the role's job, ranked from `base`, in places len(have).. of `target`.
        sub = launcher.submit(
            run, dataclasses.replace(job, array=k), added=Added(rank=base, slot=len(have), slots=target)
        )
        if sub.job_id is not None:
            result.jobs.append(sub.job_id)
        result.added = list(range(base, base + k))
    elif target < len(have):
        going = have[target:][::-1]  # the newest first; the lowest ranks (a site's relay) stay
        release(run, going)
        result.released = [i.rank for i in going]
    result.after = len(have) + len(result.added) - len(result.released)
    return result


def release(run: RunDir, going: list[Instance], grace_s: float = 30.0) -> None:
    by_launcher: dict[str, list[Instance]] = {}
    for i in going:
        by_launcher.setdefault(i.launcher, []).append(i)
    errors = []
    for name, theirs in by_launcher.items():
        errors += launcher.get(name).release(run, theirs, grace_s)
    if errors:
        raise ClusterError("; ".join(errors))
