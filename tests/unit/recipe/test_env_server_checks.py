"""roles.env_server is checked before anything is queued: environment servers only for a multi-turn
task, placed on a cluster and partition that exist (a CPU partition will do), with sane numbers."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.helpers import streamrl

from streamrl_cli.errors import RecipeError
from streamrl_cli.launch import plan
from streamrl_cli.recipe.load import load

CPU_PARTITION = "+clusters.b.partitions.cpu={gpus_per_node:0,cpus_per_node:32,mem_gb_per_node:64}"


def problems(recipe: str, *overrides: str) -> str:
    with pytest.raises(RecipeError) as e:
        load(recipe, list(overrides))
    return str(e.value)


@pytest.mark.parametrize(
    ("recipe", "overrides", "fragments"),
    [
        ("local", ["roles.env_server.instances=1"], ["roles.env_server.instances", "no multi-turn task"]),
        ("local-agent", ["roles.env_server.instances=-1"], ["must be 0 (environments beside each generator"]),
        (
            "local-agent",
            ["roles.env_server.instances=1", "roles.env_server.cluster=nope", "roles.env_server.workers=0",
             "roles.env_server.cpus_per_task=0", "roles.env_server.time_min=0"],
            ["no cluster 'nope'", "roles.env_server.workers: environment processes per server: at least 1",
             "roles.env_server.cpus_per_task: must be at least 1", "roles.env_server.time_min"],
        ),
        (  # another cluster than the generators': its partition must be named, and exist
            "two-site-h800-h20",
            ["agent.env=x.py:Env", "roles.env_server.instances=1", "roles.env_server.cluster=a"],
            ["roles.env_server.partition: required on SLURM cluster 'a'"],
        ),
        (
            "two-site-h800-h20",
            ["agent.env=x.py:Env", "roles.env_server.instances=1", "roles.env_server.partition=cpus",
             "roles.env_server.cpus_per_task=64"],
            ["cluster 'b' has no partition 'cpus'"],
        ),
        (
            "two-site-h800-h20",
            ["agent.env=x.py:Env", "roles.env_server.instances=1", CPU_PARTITION,
             "roles.env_server.partition=cpu", "roles.env_server.cpus_per_task=64"],
            ["64 CPUs per task × 1 task(s) per node but partition 'cpu' has 32 CPUs per node"],
        ),
    ],
)  # fmt: skip
def test_every_mistake_is_named(recipe, overrides, fragments):
    text = problems(recipe, *overrides)
    for fragment in fragments:
        assert fragment in text, (fragment, text)


def test_placed_beside_the_generators_unless_set_and_a_cpu_partition_is_fine():
    r = load("two-site-h800-h20", ["agent.env=x.py:Env", "roles.env_server.instances=3"]).recipe
    es = r.roles.env_server
    assert (es.cluster, es.partition, es.workers) == ("b", "h20", r.agent.env_workers)
    (job,) = [j for j in plan.jobs(r) if j.role == "env_server"]
    assert (job.array, job.gpus_per_node, job.partition) == (3, 0, "h20")
    r = load(
        "two-site-h800-h20",
        ["agent.env=x.py:Env", "roles.env_server.instances=2", CPU_PARTITION,
         "roles.env_server.partition=cpu", "roles.env_server.workers=8", "roles.env_server.cpus_per_task=16"],
    ).recipe  # fmt: skip
    (job,) = [j for j in plan.jobs(r) if j.role == "env_server"]
    assert (job.cluster, job.partition, job.gpus_per_node, job.cpus_per_task) == ("b", "cpu", 0, 16)
    specs = plan.role_specs(r, Path("/RUN"))
    assert specs["env_server"].settings.workers == 8 and specs["generator"].env_servers == 2
    assert specs["trainer"].expected["env_server"] == 2


def test_off_by_default_the_generators_host_their_environments():
    r = load("local-agent").recipe
    assert r.roles.env_server.instances == 0
    assert "env_server" not in plan.roles_of(r) and not [j for j in plan.jobs(r) if j.role == "env_server"]
    assert plan.role_specs(r, Path("/RUN"))["generator"].env_servers == 0


def test_the_cli_says_so_without_a_traceback(runs_root):
    args = ["run", "local", "--dry-run", "roles.env_server.instances=1", "--root", str(runs_root)]
    out = streamrl(*args, timeout=180)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "no multi-turn task" in out.stdout + out.stderr and "Traceback" not in out.stdout + out.stderr
    assert not runs_root.exists() or not any(runs_root.iterdir())
