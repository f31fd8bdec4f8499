"""The docs' "Bring your own model, data and reward" example (docs/getting-started.md) works as
printed: its recipe loads from the project directory, and its reward file, data and chat template
score and render right."""

from __future__ import annotations

import json
import re
from pathlib import Path

from streamrl_cli.recipe.load import load
from streamrl_cli.tasks import make_task

PAGE = Path(__file__).resolve().parents[2] / "docs" / "getting-started.md"


def section() -> str:
    text = PAGE.read_text()
    start = text.index("## Bring your own model, data and reward")
    return text[start : text.index("\n## ", start + 10)]


def block(lang: str) -> str:
    (code,) = re.findall(rf"```{lang}\n(.*?)```", section(), flags=re.S)
    return code


def test_the_getting_started_example_runs_as_printed(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from streamrl_cli.models.tiny import build_tiny_model

    # the model: a HF directory with a chat template (the tiny one, given a template)
    model = tmp_path / "model"
    build_tiny_model(model)
    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"
    tok.save_pretrained(model)

    project = tmp_path / "my-project"
    (project / "data").mkdir(parents=True)
    (project / "rewards").mkdir()
    rows = [
        {"prompt": "What is 12 * 7?", "solution": "84", "level": "easy"},
        {"prompt": "What is 9 - 10?", "solution": "-1", "level": "easy"},
        {"prompt": "Name a prime.", "solution": "7", "level": "hard"},
    ]
    for name in ("train", "test"):
        (project / "data" / f"{name}.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (project / "rewards" / "math.py").write_text(block("python"))
    (project / "recipe.yaml").write_text(block("yaml"))
    monkeypatch.chdir(project)
    # this machine has no GPUs: the same recipe with CPU roles and the tiny model
    r = load(
        "recipe.yaml",
        [f"model.path={model}", "roles.trainer.gpus_per_node=0", "roles.generator.gpus_per_instance=0"],
    ).recipe
    assert r.task.dataset == str(project / "data" / "train.jsonl")
    assert r.task.eval_dataset == str(project / "data" / "test.jsonl")
    task = make_task(r.task, model_path=str(model))
    ps = list(task.prompts())
    assert ps[0].text == (
        "[system] Think step by step, then give the final number.\n[user] What is 12 * 7?\n[assistant]"
    )
    assert task.reward(ps, ["12 * 7 = 84", "so it is 1", "I cannot say"]) == [1.0, 0.0, None]
