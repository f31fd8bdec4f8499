"""TextArena's GuessTheNumber, unchanged, through the adapter, on an environment server that is a
SLURM job on the second cluster, serving a local run's generator.

`local-agent` with the game, its trainer and generator local, its environment server a job of
cluster `remote` (another site, `-M remote`) asking no GPU: it finds the run's rendezvous,
registers, serves every reset, step and close of every trajectory (none runs beside the generator)
and ends with the run. No existing SLURM run is multi-turn, and the preflight runs could not carry
one (their roles wait for every member to report the preflight's OK), hence a run of its own; it is
short (2 iterations of 4 trajectories). A local run whose only environment server fails:
tests/e2e/test_agent_e2e.py.
"""

from __future__ import annotations

import json

import pytest
from support.helpers import streamrl
from support.member_runs import assert_nothing_left
from support.slurm_jobs import FAST, tasks, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def records(run_dir, role: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("role") == role]


def test_an_environment_server_job_on_the_far_cluster_serves_a_local_run(slurm_remote, runs_root):
    out = streamrl(
        "run", "local-agent", "--root", str(runs_root), "train.iterations=2", "train.global_batch=2",
        "algorithm.group_size=2", "algorithm.name=rloo", "agent.tools=[]", "agent.max_turns=3",
        "agent.env=streamrl_cli.agent.textarena:TextArenaEnv", "agent.env_args={env_id:GuessTheNumber-v0}",
        "agent.max_turn_tokens=12", "task.max_output_len=512", "+cluster@clusters.remote=testbed-remote",
        "roles.env_server.instances=1", "roles.env_server.cluster=remote", "roles.env_server.partition=h20",
        "roles.env_server.workers=1", env=FAST, timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (run_dir,) = [p for p in runs_root.iterdir() if p.is_dir()]
    (job,) = [j for j in json.loads((run_dir / "jobs.json").read_text()) if j["role"] == "env_server"]
    assert (job["partition"], job["array"]) == ("h20", 1)
    started = json.loads((run_dir / "members" / "env_server-0.json").read_text())
    assert (started["slurm_cluster"], started["partition"]) == ("remote", "h20") and started["slurm_job_id"]
    assert started["cuda_visible_devices"] in (None, "")  # a CPU job: no GPU asked, none given
    # Every environment call of the run went to that job: every reset, step and close of every
    # trajectory, each trajectory closing its environment (the generator hosted none).
    trajectories = 2 * 2 * 2  # iterations × prompts × group
    server = records(run_dir, "env_server")[-1]  # its last counts
    assert server["member_id"] == "env_server-0"
    assert server["env_server/calls/reset"] == server["env_server/calls/close"] == trajectories
    assert server["env_server/calls/step"] >= trajectories and server["env_server/processes"] == 1
    assert server["env_server/sessions"] == 0
    generator = records(run_dir, "generator")[-1]
    assert generator["agent/env_servers_used"] == 1 and "agent/env_processes" not in generator
    assert generator["agent/env_calls"] == 2 * trajectories + server["env_server/calls/step"]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert not [e for e in events if e.get("event") == "member_failed"], events
    trainer = [r for r in records(run_dir, "trainer") if "iteration" in r]
    assert len(trainer) == 2
    for r in trainer:
        assert r["agent/trajectories"] == 4 and r["agent/failures"] == 0
        # The game's rules came from its reset (environment tokens), and it answered each turn
        # (higher, lower, or an invalid move) until it ended or the turns ran out.
        assert r["agent/env_tokens"] > 100 and r["agent/turns_mean"] >= 1
        assert {k for k in r if k.startswith("agent/stop/")} <= {
            "agent/stop/done", "agent/stop/max_turns", "agent/stop/max_tokens",
        }  # fmt: skip
        assert r["rollout/logp_abs_diff"] < 1e-5
    # It ends with the run, on its own: its task completes, its record says it exited cleanly.
    doc = wait_for(
        run_dir, lambda d: [t["state"] for t in tasks(d, "env_server")] == ["COMPLETED"],
        timeout=120, what="the environment server's task completed",
    )  # fmt: skip
    assert doc["state"] == "finished"
    roles = {r["role"]: r for r in doc["roles"]}
    (member,) = roles["env_server"]["members"]
    assert (member["state"], member["last_error"]) == ("exited", None), member
    log = "".join(p.read_text(errors="replace") for p in (run_dir / "logs" / "env_server").glob("*"))
    assert "serving streamrl_cli.agent.textarena:TextArenaEnv" in log, log[-3000:]
    assert "the trainer left" in log, log[-3000:]
    assert_nothing_left(run_dir)  # the local roles
