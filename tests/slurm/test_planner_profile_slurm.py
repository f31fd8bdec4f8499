"""`streamrl profile` of a SLURM recipe: real jobs on the real test cluster measuring the real CPU
engines (which kinds become which jobs, without SLURM: tests/unit/planner/test_profile_jobs.py).

The test cluster's GPUs are placeholders, so the jobs' workers see no CUDA and use the CPU
settings; what is under test is the job per kind, its placement, progress, failure and cancel.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest
from support.helpers import REPO, STREAMRL, streamrl
from support.local_runs import wait_until

from streamrl_cli.launch import slurm as sbatch
from streamrl_cli.planner.profile import load_profile, summary
from streamrl_cli.profiling.jobs import JOBS_FILE


# Profiles this machine's engines for real (the recipe is a SLURM one, profiled here): slow.
def test_kind_and_out_file_are_for_profiling_here(tmp_path):
    res = streamrl("profile", "slurm-local", "--kind", "h20")
    assert res.returncode == 1 and "--kind names the profile of this machine" in res.stderr
    # --out is checked before the model at model.path is built (minutes) or anything is submitted
    res = streamrl("profile", "slurm-local", f"model.path={tmp_path}/m", "--out", str(tmp_path / "p.json"))
    assert res.returncode == 1 and "names a directory" in res.stderr
    assert not (tmp_path / "m").exists()
    (tmp_path / "a-file").write_text("kept\n")
    res = streamrl("profile", "slurm-local", f"model.path={tmp_path}/m", "--out", str(tmp_path / "a-file"))
    assert res.returncode == 1 and "names a directory" in res.stderr
    assert (tmp_path / "a-file").read_text() == "kept\n" and not (tmp_path / "m").exists()
    assert "Traceback" not in res.stderr + res.stdout
    # --local measures this machine even for a SLURM recipe (and then --kind names its profile)
    res = streamrl("profile", "slurm-local", "--local", "--kind", "h20", "--trainer", "jax")
    assert res.returncode == 1 and "--trainer 'jax': valid: torch, deepspeed" in res.stderr


FAST = {"STREAMRL_JOB_POLL_S": "1"}


@pytest.mark.slurm
@pytest.mark.slow
def test_profile_runs_one_job_per_kind_on_slurm(slurm, tmp_path):
    out, model_dir = tmp_path / "profiles", tmp_path / "tiny-qwen2"
    t0 = time.monotonic()
    res = streamrl(
        "profile", "slurm-local", f"model.path={model_dir}", "model.builder=tiny", "--out", str(out),
        "--batches", "1,4,16", timeout=600, env=FAST,
    )  # fmt: skip
    took = time.monotonic() - t0
    assert res.returncode == 0, res.stderr[-4000:]
    jobs = {j["kind"]: j for j in json.loads((out / JOBS_FILE).read_text())}
    assert {k: (j["partition"], j["measure"]) for k, j in jobs.items()} == {
        "h20": ("h20", ["decode"]),
        "h800": ("h800", ["train"]),
    }
    for kind in ("h20", "h800"):
        assert f"submitted profile-{kind}" in res.stderr and f"job {jobs[kind]['job_id']}" in res.stderr
    gen, train = (
        load_profile(out / "profile-tiny-qwen2-h20.json"),
        load_profile(out / "profile-tiny-qwen2-h800.json"),
    )
    # the same lines as a profile of this machine, one per profile
    assert res.stdout.splitlines() == [
        summary(out / "profile-tiny-qwen2-h20.json", gen),
        summary(out / "profile-tiny-qwen2-h800.json", train),
    ]
    # the generator's kind has the decode curve, the trainer's the training curve
    assert (gen.hardware, gen.model, gen.train) == ("h20", "tiny-qwen2", ())
    # measured seconds, positive and finite; no speed or ordering asserted (they follow the load)
    assert [b for b, _ in gen.decode] == [1.0, 4.0, 16.0] and all(0 < s < 60 for _, s in gen.decode)
    assert gen.engine.endswith("(cpu)") and gen.prefill_s_per_token > 0
    assert (train.hardware, train.decode) == ("h800", ())
    assert [t for t, _ in train.train] == [256.0, 512.0, 1024.0, 2048.0]
    assert all(0 < s < 600 for _, s in train.train) and train.optimizer_s > 0
    # measured inside the SLURM jobs, on the partitions of their kinds (no CUDA behind fake GPUs)
    for prof in (gen, train):
        where = prof.notes["slurm"]
        assert where["job_id"] == jobs[prof.hardware]["job_id"]
        assert where["partition"] == prof.hardware and where["cluster"] == "local"
        assert prof.notes["device"] == "cpu"
    ids = ",".join(j["job_id"] for j in jobs.values())
    acct = subprocess.run(
        ["sacct", "-X", "-n", "-P", "-o", "JobID,JobName,State", "-j", ids], capture_output=True, text=True
    )
    assert sorted(acct.stdout.split()) == sorted(
        f"{j['job_id']}|streamrl-slurm-local-profile-{k}|COMPLETED" for k, j in jobs.items()
    )
    # tune-split reads the two profiles for the recipe's two pools
    res = streamrl(
        "tune-split", "slurm-local", "--profile", str(out / "profile-tiny-qwen2-h20.json"),
        "--profile", str(out / "profile-tiny-qwen2-h800.json"), "--json",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["cost_model"] == "profiled"
    print(f"profile on SLURM took {took:.1f} s")


@pytest.mark.slurm
@pytest.mark.slow
def test_a_failed_job_ends_with_its_log_tail(slurm, tmp_path):
    model_dir = tmp_path / "broken"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{not json")  # both engines refuse it at once
    res = streamrl(
        "profile",
        "slurm-local",
        f"model.path={model_dir}",
        "model.builder=tiny",
        "--out",
        str(tmp_path),
        env=FAST,
        timeout=300,
    )
    assert res.returncode == 1, res.stderr
    jobs = json.loads((tmp_path / JOBS_FILE).read_text())
    assert len(jobs) == 2 and res.stdout == ""
    assert "error: ProfileError: profile job" in res.stderr
    for j in jobs:
        assert (
            f"profile job {j['job_id']} ({j['kind']} on default cluster/{j['partition']}) ended FAILED"
            in res.stderr
        )
        assert f"last lines of {j['folder']}/{j['job_id']}_0_log.out" in res.stderr
    assert "config.json' is not a valid JSON file" in res.stderr
    assert "streamrl_cli/cli.py" not in res.stderr  # no traceback of ours: the job's log says it all


@pytest.mark.slurm
@pytest.mark.slow
def test_ctrl_c_cancels_the_jobs_on_both_clusters(slurm_remote, tmp_path):
    # two-site: the generator's kind is profiled on cluster `remote` (-M remote for state and cancel)
    # builder tiny (no warm-up): the jobs are cancelled before they profile anything, and a warm-up
    # on a loaded machine took minutes (363 s once) before anything was submitted
    args = ["profile", "two-site-testbed", f"model.path={tmp_path}/tiny-qwen2", "model.builder=tiny",
            "--out", str(tmp_path)]  # fmt: skip
    # stderr to a file: a pipe nobody reads while the tiny model is built could fill and block it
    err_path = tmp_path / "profile.stderr"
    with err_path.open("w") as err:
        proc = subprocess.Popen(
            [*STREAMRL, *args], stdout=subprocess.DEVNULL, stderr=err, text=True, cwd=REPO
        )
    jobs_file = tmp_path / JOBS_FILE

    def both_submitted():
        if proc.poll() is not None:  # an event, not a deadline: the command ended before submitting
            raise AssertionError(f"profile ended ({proc.returncode}) early:\n{err_path.read_text()[-4000:]}")
        return jobs_file.exists() and len(json.loads(jobs_file.read_text())) == 2

    # the tiny model is built before anything is submitted (600 s: a liveness bound only)
    wait_until(both_submitted, timeout=600, what="both profile jobs submitted")
    jobs = json.loads(jobs_file.read_text())
    assert [(j["kind"], j["slurm_cluster"]) for j in jobs] == [("h20", "remote"), ("h800", None)]
    assert int(jobs[0]["job_id"]) >= 1_000_000  # the remote cluster's ids
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=120)
    stderr = err_path.read_text()
    assert proc.returncode == 130, stderr
    for j in jobs:
        assert f"cancelled profile job {j['job_id']} ({j['kind']})" in stderr

    def states() -> list[str]:
        return [sbatch.query(j["slurm_cluster"], [j["job_id"]])[j["job_id"]][0]["state"] for j in jobs]

    deadline = time.monotonic() + 120  # ends as soon as both say so
    while time.monotonic() < deadline and states() != ["CANCELLED", "CANCELLED"]:
        time.sleep(0.5)
    assert states() == ["CANCELLED", "CANCELLED"]
