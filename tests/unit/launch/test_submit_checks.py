"""Checks before submission: every mistake that would surface only after the queue wait is
reported by `run --dry-run` (and `run`) at once, exit 2, with no run directory written."""

from __future__ import annotations

import json
from pathlib import Path

from support.helpers import streamrl

# A SLURM recipe: were a check missed, `run` would queue jobs; `--dry-run` would write a run dir.
RECIPE = "slurm-local"


def qwen_config(**over) -> dict:
    return {
        "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28,
        "num_hidden_layers": 28, "num_key_value_heads": 4, "vocab_size": 152064,
        "tie_word_embeddings": False, **over,
    }  # fmt: skip


def model_dir(tmp_path: Path, config: dict | None, tokenizer: bool = True) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    if config is not None:
        (d / "config.json").write_text(json.dumps(config))
    if tokenizer:
        (d / "tokenizer.json").write_text("{}")
    return d


def test_every_mistake_at_once_and_nothing_written(tmp_path, runs_root):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"question": "1+1?", "answer": "2"}\n')
    model = model_dir(tmp_path, None, tokenizer=False)
    for dry in (["--dry-run"], []):
        out = streamrl(
            "run", RECIPE, *dry, f"task.dataset={data}", "task.prompt_key=prompt",
            "task.reward=no_such_module:score", "task.name=mine", f"model.path={model}",
            "~model.builder", "train.loggers=[wandb]", "--root", str(runs_root),
        )  # fmt: skip
        text = out.stdout + out.stderr
        assert out.returncode == 2, text
        assert "Traceback" not in text
        for fragment in [
            "no_such_module",  # the reward does not import
            "has no config.json and no tokenizer",
            "'wandb'",
        ]:
            assert fragment in text, (fragment, text)
        assert not runs_root.exists() or not any(runs_root.iterdir())


def test_dataset_rows_without_the_prompt_field(tmp_path, runs_root):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"question": "1+1?", "answer": "2"}\n')
    out = streamrl(
        "run", RECIPE, "--dry-run", f"task.dataset={data}",
        "task.reward=streamrl_cli.tasks.rewards:exact_match", "task.name=mine", "--root", str(runs_root),
    )  # fmt: skip
    assert out.returncode == 2
    assert "has no field 'prompt' (fields there: question, answer)" in " ".join(out.stderr.split())


def test_a_missing_dataset_and_a_task_that_is_not_built_in(tmp_path, runs_root):
    out = streamrl(
        "run", RECIPE, "--dry-run", f"task.dataset={tmp_path}/nope.jsonl", "task.name=mine",
        "task.reward=streamrl_cli.tasks.rewards:exact_match", "--root", str(runs_root),
    )  # fmt: skip
    # Found when the recipe is loaded (its paths are made absolute there), before any other check.
    text = " ".join(out.stderr.split())
    assert out.returncode == 2 and f"no such file or directory: {tmp_path}/nope.jsonl" in text
    # A paper recipe without a dataset must not train a 7B model on the toy task.
    out = streamrl("run", "paper/qwen2.5-7b-grpo", "--dry-run", "--root", str(runs_root))
    text = " ".join(out.stderr.split())
    assert out.returncode == 2 and "task 'reasoning' is not built-in and names no dataset" in text
    assert not runs_root.exists() or not any(runs_root.iterdir())


def test_architecture_comes_from_config_json_and_contradictions_are_errors(tmp_path, runs_root):
    model = model_dir(tmp_path, qwen_config())
    recipe = tmp_path / "r.yaml"
    # A recipe that gives only the path: the numbers come from config.json into the run's config.
    recipe.write_text(
        f"defaults:\n  - slurm-local\n  - _self_\nmodel: {{name: mine, path: {model}, builder: null}}\n"
    )
    # What the slurm-local recipe's model group gave is taken away: only the path stays.
    unset = [
        f"~model.{k}"
        for k in ("params_b", "num_layers", "hidden_size", "num_attention_heads", "num_kv_heads")
    ]
    out = streamrl("run", str(recipe), "--dry-run", *unset, "--root", str(runs_root))
    assert out.returncode == 0, out.stdout + out.stderr
    (run,) = list(runs_root.iterdir())
    import yaml

    m = yaml.safe_load((run / "config.yaml").read_text())["model"]
    assert (m["num_layers"], m["hidden_size"], m["num_attention_heads"], m["num_kv_heads"]) == (
        28,
        3584,
        28,
        4,
    )
    assert abs(m["params_b"] - 7.6) < 0.1
    spec = yaml.safe_load((run / "roles" / "trainer.yaml").read_text())
    assert spec["model"]["num_layers"] == 28

    out = streamrl("run", str(recipe), "--dry-run", *unset[2:], "model.num_layers=32", "model.params_b=70",
                   "--root", str(tmp_path / "other"))  # fmt: skip
    text = " ".join(out.stderr.split())
    assert out.returncode == 2
    assert "model.num_layers: 32 but" in text and "says 28" in text
    assert "model.params_b: 70.0 but" in text and "about 7.62 B" in text


def test_a_routers_loss_on_a_dense_model_is_refused_before_anything_is_written(tmp_path, runs_root):
    """algorithm.router_aux_loss_coef and routing_replay are about a mixture of experts' routers: a
    dense model (its config.json, or a dense builder) has none, and a MoE model's config.json is
    accepted."""
    dense = model_dir(tmp_path, qwen_config())
    for model in ([f"model.path={dense}", "~model.builder"], ["model.builder=tiny-warm"]):
        out = streamrl(
            "run", RECIPE, "--dry-run", "algorithm.router_aux_loss_coef=0.01",
            "algorithm.routing_replay=true", *model, "--root", str(runs_root),
        )  # fmt: skip
        text = out.stdout + out.stderr
        assert out.returncode == 2 and "Traceback" not in text, text
        assert "algorithm.router_aux_loss_coef: 0.01" in text and "dense" in text, text
        assert "algorithm.routing_replay: True replays" in text, text
    assert not runs_root.exists() or not any(runs_root.iterdir())
    (tmp_path / "moe").mkdir()
    experts = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 2560}
    moe = model_dir(tmp_path / "moe", qwen_config(model_type="qwen3_moe", **experts))
    out = streamrl(
        "run", RECIPE, "--dry-run", "algorithm.router_aux_loss_coef=0.01", "algorithm.routing_replay=true",
        f"model.path={moe}", "~model.builder", "--root", str(runs_root),
    )  # fmt: skip
    text = out.stdout + out.stderr
    assert "router_aux_loss_coef" not in text and "routing_replay" not in text, text
