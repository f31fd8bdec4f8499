"""Rendered job scripts and role specs (roles/<role>.yaml, the typed contract every role reads)
of every shipped recipe, compared with checked-in golden files.

To accept a deliberate change: STREAMRL_UPDATE_GOLDEN=1 python -m pytest tests/unit/launch/test_golden.py
then review `git diff tests/unit/launch/golden`.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from streamrl_cli.launch import local, plan, slurm
from streamrl_cli.recipe.load import list_recipes, load
from streamrl_cli.roles.spec import spec_yaml

GOLDEN = Path(__file__).parent / "golden"
RUN_DIR = Path("/RUN_DIR")
PYTHON = "PYTHON"


# Site options as an HPC site would set them (a cluster with a container runtime, a reservation,
# a wckey of its own): golden files show exactly what they add to the scripts.
SITE_OPTIONS = [
    "+clusters.a.sbatch.constraint='h800&ib'",
    "+clusters.a.sbatch.reservation=rl-week",
    "+clusters.a.sbatch.gres_flags=enforce-binding",
    "+clusters.a.sbatch.wckey=llm-post-training",
    "+clusters.a.sbatch.exclusive=true",
    "+clusters.a.srun_args=['--mpi=pmix','--container-image=/shared/images/streamrl.sqsh']",
    "+clusters.a.python=/opt/conda/envs/streamrl/bin/python",
    "+clusters.b.sbatch.account=gen-pool",
    "roles.generator.mem_gb=200",
]
# On-policy distillation: a teacher pool (an array job like the generators', on their cluster and
# partition unless set) and the trainer's teacher settings.
TEACHER = [
    "algorithm.distill_coef=1.0",
    "roles.teacher.instances=2",
    "roles.teacher.model.path=/models/teacher",
]
# Multi-turn environments on servers of their own: an array job on a CPU partition of the trainer's
# cluster (not the generators'), and the generators' spec says there are servers to find.
ENV_SERVER = [
    "agent.env=my_project.envs:Sandbox",
    "roles.env_server.instances=4",
    "roles.env_server.cluster=a",
    "+clusters.a.partitions.cpu={gpus_per_node:0,cpus_per_node:64,mem_gb_per_node:256}",
    "roles.env_server.partition=cpu",
    "roles.env_server.cpus_per_task=8",
    "roles.env_server.workers=16",
]
CASES = {name: (name, []) for name in list_recipes()} | {
    "two-site-h800-h20+site-options": ("two-site-h800-h20", SITE_OPTIONS),
    "two-site-h800-h20+teacher": ("two-site-h800-h20", TEACHER),
    "two-site-h800-h20+env-server": ("two-site-h800-h20", ENV_SERVER),
}


def rendered(name: str, overrides: list[str] | None = None) -> dict[str, str]:
    r = load(name, overrides).recipe
    out = {}
    for job in plan.jobs(r):
        if job.launcher == "slurm":
            out[f"{job.key}.sbatch"] = slurm.render(job, r.run.name, RUN_DIR, python=PYTHON)
        else:
            out[f"{job.key}.sh"] = local.render(job, RUN_DIR / "roles" / f"{job.role}.yaml", python=PYTHON)
    for role, spec in plan.role_specs(r, RUN_DIR).items():
        out[f"role-{role}.yaml"] = spec_yaml(spec)
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_rendered_scripts_match_golden(name):
    folder = GOLDEN / name.replace("/", "__")
    scripts = rendered(*CASES[name])
    if os.environ.get("STREAMRL_UPDATE_GOLDEN"):
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.iterdir():
            old.unlink()
        for fname, text in scripts.items():
            (folder / fname).write_text(text)
    expected = {p.name: p.read_text() for p in folder.iterdir()} if folder.is_dir() else {}
    assert sorted(scripts) == sorted(expected), (
        f"scripts of {name} changed; if deliberate: STREAMRL_UPDATE_GOLDEN=1 pytest {__file__}"
    )
    for fname, text in scripts.items():
        assert text == expected[fname], (
            f"{folder / fname} differs from what is rendered now; if deliberate, accept with "
            f"STREAMRL_UPDATE_GOLDEN=1 pytest {__file__} and review git diff"
        )


def test_two_site_scripts_route_each_role_to_its_cluster():
    scripts = rendered("two-site-h800-h20")
    assert "#SBATCH --clusters=site-a" in scripts["a-trainer.sbatch"]
    assert "#SBATCH --clusters=site-b" in scripts["b-generator.sbatch"]
    assert "#SBATCH --array=0-31%32" in scripts["b-generator.sbatch"]
    assert "#SBATCH --gpus-per-node=8" in scripts["a-trainer.sbatch"]
    assert "#SBATCH --ntasks-per-node=8" in scripts["a-trainer.sbatch"]


def test_secret_never_appears_in_scripts(tmp_path):
    from streamrl_cli.launch import run as launcher

    prepared = launcher.prepare(load("slurm-local"), root=tmp_path, dry_run=True)
    token = (prepared.run.path / "secret").read_text().strip()
    assert oct((prepared.run.path / "secret").stat().st_mode & 0o777) == "0o600"
    for f in prepared.run.path.rglob("*"):
        if f.is_file() and f.name != "secret":
            assert token not in f.read_text(), f
