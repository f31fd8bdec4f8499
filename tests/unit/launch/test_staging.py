"""Clusters without the submit host's filesystem (`clusters.X.run_root`): what their jobs read
travels inside the job script and is unpacked under `run_root/<run id>`.

Here without SLURM: the rendered script is run by bash up to the role's command, and what it
wrote is read back. The real far-site run is tests/slurm/test_two_sites.py.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
from pathlib import Path

import pytest
from support.helpers import streamrl

from streamrl_cli.errors import RecipeError
from streamrl_cli.launch import slurm
from streamrl_cli.launch.run import prepare
from streamrl_cli.recipe.load import load
from streamrl_cli.roles.spec import load_spec
from streamrl_cli.rundir import RunDir, write_atomic


def staged_run(tmp_path: Path, *extra: str):
    far = tmp_path / "far-site"
    composed = load("two-site-testbed", [f"+clusters.remote.run_root={far}", *extra])
    p = prepare(composed, root=tmp_path / "runs", dry_run=True)
    return p, far / p.run.name


def setup_part(script: str) -> str:
    """The script's lines before srun (its #SBATCH header and setup), as bash runs them."""
    return script.split("\n# command\n")[0]


def test_the_far_script_names_nothing_of_the_run_directory(tmp_path):
    p, there = staged_run(tmp_path)
    script = p.scripts["remote-generator"]
    text = script.read_text()
    assert str(p.run.path) not in text  # its roles cannot read what they are not told of
    # SLURM opens the job's own log before the script runs: in run_root, which exists there.
    assert f"#SBATCH --output={there.parent}/{there.name}-%A_%a_0_log.out" in text
    assert f"--output {there}/logs/generator/%A_%a_%t_log.out" in text  # the role's, made by the script
    assert f"-m streamrl_cli.roles {there}/roles/generator.yaml" in text
    assert "submitit.core._submit" not in text  # submitit's runner reads a pickle from the run dir
    assert stat.S_IMODE(script.stat().st_mode) == 0o600  # it carries the run's secret
    # The trainer's cluster shares the run directory: its job is as before.
    trainer = p.scripts["local-trainer"].read_text()
    assert f"submitit.core._submit {p.run.path}/logs/trainer" in trainer
    assert "STREAMRL_STAGED" not in trainer


def test_the_script_unpacks_the_spec_secret_and_address_there(tmp_path):
    p, there = staged_run(tmp_path)
    run = p.run
    write_atomic(run.endpoint, '{"url": "http://127.0.0.1:1234"}')  # the server published it
    (job,) = [j for j in p.jobs if j.role == "generator"]
    text = slurm.render(job, "two-site-testbed", run.path)
    env = {**os.environ, "SLURM_JOB_ID": "77"}
    for _ in range(2):  # a requeued job unpacks again over its first copy
        out = subprocess.run(["bash", "-c", setup_part(text)], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
    staged = RunDir(there)
    assert staged.secret.read_bytes() == run.secret.read_bytes()
    assert stat.S_IMODE(staged.secret.stat().st_mode) == 0o600
    assert staged.endpoint.read_text() == run.endpoint.read_text()
    spec = load_spec(staged.role_spec("generator"))
    assert spec.run_dir == str(there)
    assert (spec.secret_file, spec.rendezvous_file) == (str(staged.secret), str(staged.endpoint))
    original = load_spec(run.role_spec("generator"))
    assert spec.settings == original.settings and spec.model == original.model
    assert staged.role_logs("generator").is_dir() and staged.members.is_dir()
    assert not list(there.rglob("*.part-*"))


def test_the_rendezvous_ca_travels_too(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\nnot checked here\n-----END CERTIFICATE-----\n")
    p, there = staged_run(tmp_path, f"roles.rendezvous.tls_ca={ca}")
    (job,) = [j for j in p.jobs if j.role == "generator"]
    files = slurm.staged_files(job, p.run.path)
    staged = RunDir(there)
    assert files[staged.staged_ca][0] == ca.read_bytes()
    assert f"rendezvous_ca: {staged.staged_ca}" in files[staged.role_spec("generator")][0].decode()


def test_a_scaled_array_job_is_staged_the_same_way(tmp_path):
    from streamrl_cli.launch.scale.executor import generator_job

    p, there = staged_run(tmp_path)
    job = generator_job(p.run)  # what `streamrl scale` submits, from the run's own config
    assert job.run_root == str(there.parent)
    text = slurm.render(job, "two-site-testbed", p.run.path)
    assert str(p.run.path) not in text and "STREAMRL_STAGED" in text


@pytest.mark.parametrize(
    ("overrides", "key", "says"),
    [
        (["+clusters.remote.run_root=relative/runs"], "clusters.remote.run_root", "absolute path"),
        (["+clusters.local.run_root=/scratch/runs"], "clusters.local.run_root", "generators only"),
        (["+clusters.local.run_root=/scratch/runs", "clusters.local.launcher=local"],
         "clusters.local", "launcher=slurm only"),
    ],
)  # fmt: skip
def test_run_roots_that_cannot_work_are_refused(overrides, key, says):
    with pytest.raises(RecipeError) as e:
        load("two-site-testbed", overrides)
    assert any(key in p and says in p for p in e.value.problems), e.value.problems


def test_dry_run_shows_the_staged_script(tmp_path, runs_root):
    far = tmp_path / "far"
    out = streamrl("run", "two-site-testbed", f"+clusters.remote.run_root={far}", "--dry-run",
                   "--root", str(runs_root))  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    (run,) = list(runs_root.iterdir())
    assert re.search(r"STREAMRL_STAGED", (run / "jobs" / "remote-generator.sbatch").read_text())
    assert not far.exists()  # nothing is written on the far cluster before its job runs
