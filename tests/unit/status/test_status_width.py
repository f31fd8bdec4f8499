"""The live tables of `streamrl run` and `streamrl status` read whole in an 80-column terminal:
every line fits, and no cell is cut with an ellipsis."""

from __future__ import annotations

import json
import os
import time

import psutil
from rich.console import Console
from support.helpers import streamrl
from support.metric_runs import make_run, simulate

from streamrl_cli.launch.supervise.live_view import live_view
from streamrl_cli.rundir import RunDir, write_json
from streamrl_cli.status.view import run_view
from streamrl_cli.weights.relay_wire import FULL_REASONS

WIDTH = 80
LONGEST_REASON = max(FULL_REASONS, key=len)  # why a version crossed sites whole
NAME = "qwen2.5-7b-grpo-reasoning-with-a-long-name"


def rendered(renderable, width: int = WIDTH) -> str:
    console = Console(
        width=width, record=True, force_terminal=False, color_system=None, file=open(os.devnull, "w")
    )
    console.print(renderable)
    return console.export_text()


def assert_readable(text: str, *whole: str) -> None:
    assert "…" not in text, text
    too_wide = [line for line in text.splitlines() if len(line) > WIDTH]
    assert not too_wide, text
    for value in whole:  # on one line, not folded in two
        assert any(value in line for line in text.splitlines()), f"{value!r} not whole in:\n{text}"


def local_run(tmp_path) -> RunDir:
    """A local run 30 iterations in: its processes (this test's own pid stands in for them, so that
    they show as running), their start records and the trainer's metrics."""
    run = RunDir(make_run(tmp_path, simulate("sync-stream", iterations=30, reward0=0.23), name=NAME))
    info = json.loads(run.run_json.read_text())
    write_json(
        run.run_json,
        {
            **info,
            "state": "running",
            "iterations": 40,
            "created": time.time() - 600,
            "recipe": "recipes/paper/qwen2.5-7b-ppo.yaml",
        },
    )
    me = psutil.Process()
    roles = [("rendezvous", 0), ("trainer", 0), ("generator", 0), ("generator", 1)]
    write_json(
        run.local_json,
        [
            {
                "role": r,
                "rank": k,
                "pid": me.pid,
                "created": me.create_time(),
                "log": str(run.local_log(r, k)),
            }
            for r, k in roles
        ],
    )
    for role, rank in roles[1:]:
        peers = {"trainer": 1, "generator": 2, "rendezvous": 1}
        write_json(
            run.member_record(role, rank),
            {"role": role, "rank": rank, "host": "gpu-node-017", "preflight_ok": True, "peers": peers},
        )
    return run


def test_the_live_table_of_streamrl_run_reads_whole_in_80_columns(tmp_path):
    text = rendered(live_view(local_run(tmp_path)))
    assert_readable(
        text,
        "iteration 30/40",
        "mode sync-stream",
        "reward 0.23 → 2.55",
        "samples/s",
        "idle trainer 20%",
        "idle generator 5%",
        "length p50/p90 395/1280",
        "generator-1",
        "running",
    )


def test_status_of_a_local_run_reads_whole_in_80_columns(tmp_path):
    run = local_run(tmp_path)
    out = streamrl("status", str(run.path), env={"COLUMNS": str(WIDTH)})
    assert out.returncode == 0, out.stderr
    assert_readable(out.stdout, "step 30/40", "trainer (cluster", "gpu-node-017", "pid")


def member(role: str, rank: int, site: str, host: str, beat: float, version: int) -> dict:
    return {
        "rank": rank,
        "member_id": f"{role}-{rank}",
        "state": "alive",
        "host": host,
        "cluster": site,
        "site": site,
        "last_error": None,
        "last_heartbeat_s": beat,
        "weight_version": version,
        "incarnation": 1,
        "reported_state": "serving",
        "metrics": {},
    }


def job(role: str, job_id: str, tasks: list[tuple], slurm_cluster: str | None = None) -> dict:
    """A jobs.json record with its tasks' states, as `status` gets them from squeue."""
    return {
        "role": role,
        "cluster": slurm_cluster or "main",
        "slurm_cluster": slurm_cluster,
        "job_id": job_id,
        "array": len(tasks) if tasks[0][0] is not None else None,
        "partition": "h800",
        "script": "x.sbatch",
        "tasks": [
            {
                "job_id": job_id,
                "task": t,
                "state": state,
                "nodes": nodes,
                "reason": reason,
                "partition": "h800",
            }
            for t, state, nodes, reason in tasks
        ],
    }


def slurm_doc() -> dict:
    """`streamrl status --json` of a two-site SLURM run in full swing (one generator lost, one waiting)."""
    now = time.time()
    trainer = member("trainer", 0, "main", "gpu-node-017", 1.2, 12)
    gens = [
        member("generator", i, "main" if i < 2 else "far", f"gpu-node-02{i}", 0.8 + i, 12) for i in range(4)
    ]
    gens[3].update(state="lost", last_error="CUDA error: an illegal memory access was encountered")
    moved = {"version": 12, "at": now - 42, "seconds": 0.52, "bytes": 14.23 * 2**20}
    # Across sites, the longest way a transfer is told: whole, with the longest reason.
    crossed = {
        **moved,
        "mode": "full",
        "reason": LONGEST_REASON,
        "full_bytes": 14.23 * 2**20,
        "ratio": 1.0,
    }
    site_members = [[gens[0], gens[1], trainer], gens[2:]]
    return {
        "run": f"{NAME}-20261124-101500",
        "state": "running",
        "age_s": 3600.0,
        "outcome": None,
        "recipe": "recipes/paper/qwen2.5-7b-ppo.yaml",
        "problems": ["generator job 123457[3] on remote: FAILED"],
        "rendezvous": {
            "url": "https://login-node-03.cluster.example.org:43127",
            "reachable": True,
            "error": None,
            "uptime_s": 3590.0,
            "versions": {"current": 12},
            "counts": {"trainer": {"alive": 1, "lost": 0}, "generator": {"alive": 3, "lost": 1}},
        },
        "progress": {
            "step": 30,
            "iterations": 40,
            "reward": 0.6123,
            "eval_reward": 0.5831,
            "samples_per_s": 12.08,
            "trainer_idle": 0.212,
            "generator_idle": 0.051,
            "tail_s": 1.532,
            "aborted_groups": 2,
            "paused_groups": 3,
            "resumed_samples": 17,
            "token_staleness": 0.413,
        },
        "sites": [
            {
                "site": site,
                "trainer_site": site == "main",
                "relay": None if site == "main" else "generator-2",
                "members": [{"member_id": m["member_id"], "state": m["state"]} for m in ms],
                "weight_version": 12,
                "last_transfer": moved,
                "last_wan_transfer": None if site == "main" else crossed,
            }
            for site, ms in zip(("main", "far"), site_members, strict=True)
        ],
        "roles": [
            {
                "role": "rendezvous",
                "cluster": "main",
                "processes": [],
                "members": [],
                "jobs": [job("rendezvous", "123455", [(None, "RUNNING", "login-node-03", "")])],
            },
            {
                "role": "trainer",
                "cluster": "main",
                "processes": [],
                "members": [trainer],
                "jobs": [job("trainer", "123456", [(None, "RUNNING", "gpu-node-[017-018]", "")])],
            },
            {
                "role": "generator",
                "cluster": "main",
                "processes": [],
                "members": gens,
                "jobs": [
                    job(
                        "generator",
                        "123458",
                        [(0, "RUNNING", "gpu-node-020", ""), (1, "RUNNING", "gpu-node-021", "")],
                    ),
                    job(
                        "generator",
                        "123457",
                        [
                            (2, "RUNNING", "far-gpu-002", ""),
                            (3, "FAILED", "far-gpu-003", ""),
                            (4, "PENDING", "", "Resources"),
                        ],
                        slurm_cluster="remote",
                    ),
                ],
            },
        ],
    }


def test_status_of_a_two_site_slurm_run_reads_whole_in_80_columns():
    text = rendered(run_view(slurm_doc()))
    assert_readable(
        text,
        "generator (cluster main)",
        "remote:123457_3",
        "123458_1",
        "gpu-node-[017-018]",
        "far-gpu-002",
        "alive 3s",
        "lost 4s",
        "RUNNING",
        "PENDING",
        "Resources",
        "samples_per_s 12.08",
        "token_staleness 0.413",
        f"({LONGEST_REASON})",
    )
