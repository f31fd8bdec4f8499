"""A prompt longer than task.max_prompt_len is found before submission, by row, with the model's
tokenizer counting as the trainer counts: not by the trainer, after the queue wait, without the row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.helpers import streamrl

# A SLURM recipe: were the check missed, `run` would queue jobs; `--dry-run` would write a run dir.
RECIPE = "slurm-local"
LIMIT = 32
SHORT = "What is 2 + 2?"
LONG = " ".join(["The quick brown fox jumps over the lazy dog."] * 6)  # well over 32 tokens


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from streamrl_cli.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


def tokens(model: Path, text: str) -> int:
    """What the trainer counts: the model's tokenizer, no special tokens added."""
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(model)(text, add_special_tokens=False)["input_ids"])


def dataset(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"prompt": p, "answer": "4"}) + "\n" for p in prompts))
    return path


def dry_run(model: Path, data: Path, runs: Path, *over: str):
    return streamrl(
        "run", RECIPE, "--dry-run", f"model.path={model}", f"task.dataset={data}", "task.name=mine",
        "task.reward=streamrl_cli.tasks.rewards:exact_match", f"task.max_prompt_len={LIMIT}", *over,
        "--root", str(runs),
    )  # fmt: skip


def test_a_long_row_is_named_before_anything_is_written(tiny, tmp_path, runs_root):
    assert tokens(tiny, SHORT) <= LIMIT < tokens(tiny, LONG)
    data = dataset(tmp_path / "prompts.jsonl", [SHORT] * 3 + [LONG] + [SHORT] * 6)
    out = dry_run(tiny, data, runs_root)
    text = " ".join(out.stderr.split())
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in text
    n = tokens(tiny, LONG)
    assert (
        f"task.dataset: 1 of 10 prompts in {data} is longer than task.max_prompt_len={LIMIT} tokens "
        f"(row 3: {n} tokens; rows count from 0)" in text
    ), text
    assert f"raise task.max_prompt_len to {n} or shorten it" in text, text
    assert not runs_root.exists() or not any(runs_root.iterdir())

    # All within the limit: the dry run goes through and writes its run directory.
    ok = dataset(tmp_path / "ok.jsonl", [SHORT] * 10)
    out = dry_run(tiny, ok, runs_root)
    assert out.returncode == 0, out.stdout + out.stderr
    assert len(list(runs_root.iterdir())) == 1


def test_many_long_rows_name_the_first_few_and_the_count_for_both_datasets(tiny, tmp_path, runs_root):
    long_rows = [4, 9, 10, 17, 18, 25, 31]
    rows = [LONG if i in long_rows else SHORT for i in range(40)]
    # A blank line keeps the numbering: rows are the file's lines, counted from 0.
    train = tmp_path / "train.jsonl"
    lines = [json.dumps({"prompt": p, "answer": "4"}) for p in rows]
    train.write_text("\n".join(lines[:2] + [""] + lines[2:]) + "\n")
    held_out = dataset(tmp_path / "eval.jsonl", [SHORT, LONG, SHORT, SHORT, LONG])
    out = dry_run(tiny, train, runs_root, f"task.eval_dataset={held_out}")
    text = " ".join(out.stderr.split())
    assert out.returncode == 2, out.stdout + out.stderr
    n = tokens(tiny, LONG)
    lines_at = [r + (r >= 2) for r in long_rows]  # 5, 10, 11, ...: after the blank line
    shown = ", ".join(f"row {r}: {n}" for r in lines_at[1:5])
    assert (
        f"task.dataset: 7 of 40 prompts in {train} are longer than task.max_prompt_len={LIMIT} tokens "
        f"(row 5: {n} tokens, {shown}, ...; rows count from 0)" in text
    ), text
    assert (
        f"task.eval_dataset: 2 of 5 prompts in {held_out} are longer than task.max_prompt_len={LIMIT} "
        f"tokens (row 1: {n} tokens, row 4: {n}; rows count from 0)" in text
    ), text
    assert not runs_root.exists() or not any(runs_root.iterdir())

    # Only the first task.eval_samples held-out prompts are ever evaluated: only those count.
    ok = dataset(tmp_path / "ok.jsonl", [SHORT] * 4)
    out = dry_run(tiny, ok, runs_root, f"task.eval_dataset={held_out}", "task.eval_samples=1")
    assert out.returncode == 0, out.stdout + out.stderr


def test_chat_prompts_are_counted_as_rendered(tiny, tmp_path, runs_root):
    """The chat template's own tokens count: a prompt short as text is too long once rendered."""
    template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    template += "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    (tmp_path / "chat.jinja").write_text(template)
    words = SHORT
    while tokens(tiny, words + " 1") <= LIMIT - 4:
        words += " 1"
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    chat = [{"role": "user", "content": words}]
    rendered = tok.apply_chat_template(
        chat, chat_template=template, tokenize=False, add_generation_prompt=True
    )
    n = len(tok(rendered, add_special_tokens=False)["input_ids"])
    assert tokens(tiny, words) <= LIMIT < n
    data = dataset(tmp_path / "chat.jsonl", [SHORT, words])
    out = dry_run(tiny, data, runs_root, f"task.chat_template={tmp_path / 'chat.jinja'}")
    text = " ".join(out.stderr.split())
    assert out.returncode == 2, out.stdout + out.stderr
    expected = (
        f"1 of 2 prompts in {data} is longer than task.max_prompt_len={LIMIT} tokens (row 1: {n} tokens;"
    )
    assert expected in text, text


def test_batched_counts_are_the_trainers_one_by_one_counts(tiny):
    from transformers import AutoTokenizer

    from streamrl_cli.tasks.datasets import long_prompts, prompt_ids

    tok = AutoTokenizer.from_pretrained(tiny)
    special = "<|im_start|>user\nhi<|im_end|>\n"  # a special token written in the text: one token
    texts = [SHORT, LONG, "", " spaces\n\nand lines ", special, "Ünïcödé 测试 ﬁ"] * 7
    one_by_one = [len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    assert [len(ids) for ids in prompt_ids(tok, texts)] == one_by_one
    limit = sorted(one_by_one)[len(texts) // 2]
    expected = [(i, n) for i, n in enumerate(one_by_one) if n > limit]
    assert expected and long_prompts(texts, tok, limit, chunk=4) == expected


def test_the_trainers_own_check_names_the_row(tiny, tmp_path):
    """The last guard, for a model made at start (not there to check before submission)."""
    from transformers import AutoTokenizer

    from streamrl_cli.errors import StreamRLError
    from streamrl_cli.tasks.builtin import RepeatTask
    from streamrl_cli.tasks.datasets import DatasetTask
    from streamrl_cli.trainer.role.main import prompt_tokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    data = dataset(tmp_path / "d.jsonl", [SHORT] * 3 + [LONG])
    task = DatasetTask(data, reward=lambda prompts, completions, **_: [0.0] * len(completions))
    tokenize = prompt_tokenizer(tok, LIMIT, task, "task.eval_dataset")
    assert tokenize(SHORT) == tok(SHORT, add_special_tokens=False)["input_ids"]
    with pytest.raises(StreamRLError) as e:
        tokenize(LONG)
    n = tokens(tiny, LONG)
    assert str(e.value) == (
        f"a prompt has {n} tokens, more than task.max_prompt_len={LIMIT} (task.eval_dataset row 3, "
        f"counting from 0, of {data}; prompt id 'd/00003')"
    )
    builtin = RepeatTask(num_prompts=4, max_output_len=8, seed=0)
    first = builtin.prompts()[0]
    with pytest.raises(StreamRLError, match=f"prompt id '{first.prompt_id}'"):
        prompt_tokenizer(tok, 1, builtin, "task.dataset")(first.text)


def test_the_trainers_evaluation_names_the_held_out_row(tiny, tmp_path):
    from transformers import AutoTokenizer

    from streamrl_cli.errors import StreamRLError
    from streamrl_cli.launch.plan import role_specs
    from streamrl_cli.recipe.load import load
    from streamrl_cli.trainer.role.main import TrainerRole
    from streamrl_cli.trainer.role.records import Reporter

    train = dataset(tmp_path / "train.jsonl", [SHORT] * 4)
    held_out = dataset(tmp_path / "held_out.jsonl", [SHORT, LONG])
    r = load("local", [
        f"model.path={tiny}", f"task.dataset={train}", f"task.eval_dataset={held_out}", "task.name=mine",
        "task.reward=streamrl_cli.tasks.rewards:exact_match", f"task.max_prompt_len={LIMIT}",
    ]).recipe  # fmt: skip
    role = TrainerRole(role_specs(r, tmp_path)["trainer"], 0)
    where = r"\(task\.eval_dataset row 1, counting from 0, of .*held_out\.jsonl"
    with pytest.raises(StreamRLError, match=where):
        role._evaluator(role.spec.task, 0, AutoTokenizer.from_pretrained(tiny), Reporter(None, [], 1, None))


def test_a_tokenizer_that_does_not_load_is_said_and_a_missing_model_is_not_counted(tiny, tmp_path, runs_root):
    data = dataset(tmp_path / "prompts.jsonl", [SHORT, LONG])
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((tiny / "config.json").read_text())
    (broken / "tokenizer.json").write_text("{}")
    out = dry_run(broken, data, runs_root)
    text = " ".join(out.stderr.split())
    assert out.returncode == 2 and f"model.path: the tokenizer of {broken} does not load" in text, text
    assert "Traceback" not in text
    # A model made at start (its builder's): nothing to count with here, the trainer checks.
    out = dry_run(tmp_path / "later", data, tmp_path / "runs2", "model.builder=tiny")
    assert out.returncode == 0, out.stdout + out.stderr
