"""Every environment variable StreamRL reads or sets, in one module.

Two kinds:

- The launcher ↔ role contract: what a launcher puts in a role process's environment and the role
  reads back. SLURM's own variables (SLURM_PROCID, SLURM_ARRAY_TASK_ID, ...) complete it; a local
  launch stands in for them with these.
- Settings of the operator's environment rather than of a run (where runs are listed, where recipes
  are looked up, how often job states are polled): the same for every recipe on a machine, so not
  recipe keys.

Values are read when they are needed, not when a module is imported, so a process (or a test) that
sets one before a call gets it; a malformed value is an error naming the variable.
"""

from __future__ import annotations

import os

from streamrl_cli.errors import StreamRLError

# -- launcher -> role ---------------------------------------------------------------------------
# A local launch's rank of the process in its role (SLURM: SLURM_PROCID of the job's task).
RANK = "STREAMRL_RANK"
# An array job added by scaling starts its task ids at 0 again: its ranks start after the run's.
RANK_BASE = "STREAMRL_RANK_BASE"
# "index/count": the place of a generator instance `streamrl scale` added among the instances that
# will share its host, and their number; an array task adds its task id to the index (the array's
# first task takes `index`). A launch's instances take their rank of its world.
CPU_SLOT = "STREAMRL_CPU_SLOT"

# -- the operator's environment -----------------------------------------------------------------
HOME = "STREAMRL_HOME"  # the catalog of runs (default ~/.streamrl)
RECIPES = "STREAMRL_RECIPES"  # where shipped recipes are looked up (default: the package's)
TRACEBACK = "STREAMRL_TRACEBACK"  # set: an internal error prints its traceback
# Seconds between polls of SLURM job states (squeue/sacct) by whoever watches jobs. Each watcher has
# its own default (`job_poll_s`): `streamrl profile` polls every 5 s, someone waits at the terminal;
# the rendezvous job polls the run's jobs every 15 s, in the background, for the whole run.
JOB_POLL = "STREAMRL_JOB_POLL_S"
# How long members wait for a rendezvous server whose job requeued itself (SLURM holds a requeued
# job for a while before it may start, then it queues like any job). Default 1800 s.
REQUEUE_WAIT = "STREAMRL_RENDEZVOUS_REQUEUE_WAIT_S"
# Seconds a waiting reader in vLLM's processes spins after its last message before it sleeps until
# woken (streamrl_cli/generator/vllm_idle.py, a vLLM plugin). The generator sets 0.05 unless it is
# set already; 1 is vLLM's own.
VLLM_IDLE_SPIN = "STREAMRL_VLLM_IDLE_SPIN_S"


def nonnegative(raw: str) -> float | None:
    """`raw` as a number ≥ 0 (inf included), or None when it is not one (NaN, negative, not a number)."""
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if value >= 0 else None


def seconds(name: str, default: float) -> float:
    """A duration in seconds from the environment variable `name` (`default` when unset or empty)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    value = nonnegative(raw)
    if value is None or value == float("inf"):
        raise StreamRLError(f"{name}={raw!r}: expected a number of seconds ≥ 0 (unset: {default:g})")
    return value


def job_poll_s(default: float) -> float:
    """Seconds between job-state polls: $STREAMRL_JOB_POLL_S, else the caller's `default`."""
    return seconds(JOB_POLL, default)


def requeue_wait_s() -> float:
    return seconds(REQUEUE_WAIT, 1800.0)


def rank(default: int = 0) -> int:
    """This process's rank from a local launch (SLURM's rank variables are read by the caller)."""
    return int(os.environ.get(RANK, str(default)))


def rank_base() -> int:
    return int(os.environ.get(RANK_BASE, "0"))
