"""The one entry point of every role process, on SLURM (through submitit) and locally.

It loads the role's slice of the config (`run_dir/roles/<role>.yaml`), works out its rank from
the launcher's environment, writes a start record in `run_dir/members/`, then runs the role's
program (`module:function`, called with the RoleSpec and the rank).
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import NoReturn

from streamrl_cli import environ
from streamrl_cli.errors import StreamRLError
from streamrl_cli.roles.spec import RoleSpec, load_spec
from streamrl_cli.rundir import POOL_ROLES, RunDir, write_atomic

__all__ = ["load_spec", "run_role"]


def rank_from_env(role: str) -> int:
    """Generator instances are array tasks; trainer ranks are the tasks of one job."""
    if role in POOL_ROLES and "SLURM_ARRAY_TASK_ID" in os.environ:
        # An array job added by scaling starts its task ids at 0 again: its ranks start after the run's.
        return environ.rank_base() + int(os.environ["SLURM_ARRAY_TASK_ID"])
    return int(os.environ["SLURM_PROCID"]) if "SLURM_PROCID" in os.environ else environ.rank()


def cpu_slot(rank: int, world: int) -> tuple[int, int]:
    """This instance's place among the local instances sharing the host, and their number."""
    first, _, count = os.environ.get(environ.CPU_SLOT, "").partition("/")
    task = os.environ.get("SLURM_ARRAY_TASK_ID", "0")
    if first.isdigit() and count.isdigit() and task.isdigit() and int(first) + int(task) < int(count):
        return int(first) + int(task), int(count)
    return rank, world


def start_record(spec: RoleSpec, rank: int) -> dict:
    env = os.environ
    return {
        "role": spec.role,
        "rank": rank,
        "cluster": spec.cluster,
        "site": spec.site,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": time.time(),
        "program": spec.program,
        "slurm_job_id": env.get("SLURM_JOB_ID"),
        "slurm_array_job_id": env.get("SLURM_ARRAY_JOB_ID"),
        "slurm_array_task_id": env.get("SLURM_ARRAY_TASK_ID"),
        "slurm_cluster": env.get("SLURM_CLUSTER_NAME"),
        "partition": env.get("SLURM_JOB_PARTITION"),
    }


def record_path(spec: RoleSpec, rank: int) -> Path:
    return RunDir(Path(spec.run_dir)).member_record(spec.role, rank)


def update_record(spec: RoleSpec, rank: int, **fields: object) -> None:
    path = record_path(spec, rank)
    try:
        rec = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        rec = start_record(spec, rank)
    write_atomic(path, json.dumps({**rec, **fields}, indent=2, sort_keys=True) + "\n")


def run_role(spec_path: str, rank: int | None = None) -> int:
    from streamrl_cli.roles.placement import apply, gpus_per_process, placement

    spec = load_spec(spec_path)
    rank = rank_from_env(spec.role) if rank is None else rank
    record = start_record(spec, rank)
    try:
        # Before anything imports torch: the GPUs this process uses (LOCAL_RANK, CUDA_VISIBLE_DEVICES).
        where = placement(
            os.environ,
            gpus_per_process(spec.role, spec.settings),
            narrow=spec.role in POOL_ROLES,
        )
    except StreamRLError as e:
        return _failed(spec, rank, record, e, e.exit_code or 1)
    apply(where, os.environ)
    record.update(where.record(), cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"))
    write_atomic(record_path(spec, rank), json.dumps(record, indent=2, sort_keys=True) + "\n")
    if spec.role != "rendezvous":  # roles that start processes (vLLM's engine): none outlives the role
        from streamrl_cli.roles import reaper

        reaper.start()
    module, _, func = spec.program.partition(":")
    program = getattr(importlib.import_module(module), func)
    try:
        code = int(program(spec, rank) or 0)
    except StreamRLError as e:
        # A user-facing error (a peer missing, a server unreachable): its message is the whole story.
        return _failed(spec, rank, record, e, e.exit_code or 1)
    except Exception as e:
        # Anything else still leaves its reason where `streamrl status` reads it, then fails the task
        # with its traceback in the log (and srun --kill-on-bad-exit ends the other ranks).
        update_record(spec, rank, finished=time.time(), exit_code=1, error=f"{type(e).__name__}: {e}"[:2000])
        raise
    update_record(spec, rank, finished=time.time(), exit_code=code)
    if code:
        raise SystemExit(code)
    return code


def _failed(spec: RoleSpec, rank: int, record: dict, e: BaseException, code: int) -> NoReturn:
    print(f"error: {spec.role} rank {rank}: {e}", file=sys.stderr, flush=True)
    if not record_path(spec, rank).exists():
        write_atomic(record_path(spec, rank), json.dumps(record, indent=2, sort_keys=True) + "\n")
    update_record(spec, rank, finished=time.time(), exit_code=code, error=str(e)[:2000])
    raise SystemExit(code)
