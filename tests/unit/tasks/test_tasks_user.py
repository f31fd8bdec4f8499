"""Tasks as users bring them: TRL-style rewards from files, columns, async and None; datasets in
JSONL, Parquet and save_to_disk form; chat prompts through a chat template; relative paths."""

from __future__ import annotations

import json

import pytest

from streamrl_cli.errors import RecipeError
from streamrl_cli.recipe.load import load
from streamrl_cli.recipe.schema import TaskConfig as TC  # tasks spelled as their recipe keys
from streamrl_cli.tasks import Prompt, TaskError, make_task
from streamrl_cli.tasks.datasets import ChatFormat, DatasetTask
from streamrl_cli.trainer.loop.batch import Rollout, collate
from streamrl_cli.transport.wire import Sample

# A reward written for TRL's GRPOTrainer: prompts and completions as strings, the dataset's other
# fields as keyword columns, in a file next to a helper module it imports (nothing on PYTHONPATH).
TRL_REWARD = """
from grading import normalise

def score(prompts, completions, solution, difficulty, **kwargs):
    return [
        (1.0 if normalise(c) == normalise(s) else 0.0) * (2.0 if d == "hard" else 1.0)
        for p, c, s, d in zip(prompts, completions, solution, difficulty)
    ]

def accuracy(completions, solution, **kwargs):  # TRL's own examples leave prompts to **kwargs
    return [float(c.strip().lower() == s.lower()) for c, s in zip(completions, solution)]

def seen_kwargs(prompts, completions, **kwargs):
    return [float(len(kwargs)) for _ in completions]

async def judge(prompts, completions, solution, **kwargs):
    import asyncio
    await asyncio.sleep(0)
    return [None if c == "?" else float(c.strip() == s) for c, s in zip(completions, solution)]
"""


@pytest.fixture
def project(tmp_path):
    """A user's project: rewards/ with a reward and its helper, data/ with a JSONL dataset."""
    (tmp_path / "rewards").mkdir()
    (tmp_path / "rewards" / "my_reward.py").write_text(TRL_REWARD)
    (tmp_path / "rewards" / "grading.py").write_text("def normalise(s):\n    return s.strip().lower()\n")
    (tmp_path / "data").mkdir()
    rows = [
        {"prompt": "capital of France?", "solution": "Paris", "difficulty": "easy"},
        {"prompt": "capital of Burkina Faso?", "solution": "Ouagadougou", "difficulty": "hard"},
        {"prompt": "capital of Chile?", "solution": "Santiago"},  # no difficulty: None in its column
    ]
    (tmp_path / "data" / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return tmp_path


def test_a_trl_style_reward_with_extra_columns_scores_right(project):
    task = make_task(
        TC(**{"name": "capitals", "dataset": str(project / "data" / "train.jsonl"),
         "reward": f"{project}/rewards/my_reward.py:score"})
    )  # fmt: skip
    ps = list(task.prompts())
    assert ps[2].columns == {"solution": "Santiago"}
    got = task.reward(ps, [" paris", "Ouagadougou ", "Lima"])
    assert got == [1.0, 2.0, 0.0]  # columns aligned with the batch, the "hard" one doubled
    # a batch in another order gets its own rows' columns
    assert task.reward([ps[1], ps[0]], ["ouagadougou", "nope"]) == [2.0, 0.0]


def test_arguments_are_passed_by_keyword_as_trl_passes_them(project, tmp_path):
    task = make_task(
        TC(**{"dataset": str(project / "data" / "train.jsonl"),
         "reward": f"{project}/rewards/my_reward.py:accuracy"})
    )  # fmt: skip
    assert task.reward(list(task.prompts()), ["Paris", "Lima", "santiago"]) == [1.0, 0.0, 1.0]
    (tmp_path / "clash.jsonl").write_text(json.dumps({"prompt": "x", "completions": 1}) + "\n")
    with pytest.raises(TaskError, match="field named 'completions'.*rename"):
        make_task(
            TC(
                **{
                    "dataset": str(tmp_path / "clash.jsonl"),
                    "reward": f"{project}/rewards/my_reward.py:accuracy",
                }
            )
        )


def test_every_field_but_the_prompt_is_a_column(project):
    task = make_task(
        TC(**{"dataset": str(project / "data" / "train.jsonl"),
         "reward": f"{project}/rewards/my_reward.py:seen_kwargs"})
    )  # fmt: skip
    assert task.reward(list(task.prompts()), ["a", "b", "c"]) == [2.0, 2.0, 2.0]  # solution, difficulty


def test_async_rewards_are_awaited_and_none_means_cannot_score(project):
    task = make_task(
        TC(
            **{
                "dataset": str(project / "data" / "train.jsonl"),
                "reward": f"{project}/rewards/my_reward.py:judge",
            }
        )
    )
    assert task.reward(list(task.prompts()), ["Paris", "?", "Lima"]) == [1.0, None, 0.0]


def test_a_reward_that_needs_a_column_the_dataset_lacks_fails_before_the_run(project, tmp_path):
    (tmp_path / "q.jsonl").write_text(json.dumps({"prompt": "x", "answer": 1}) + "\n")
    with pytest.raises(TaskError, match=r"my_reward.py:score.*columns \(answer\).*'solution'"):
        make_task(
            TC(**{"dataset": str(tmp_path / "q.jsonl"), "reward": f"{project}/rewards/my_reward.py:score"})
        )


def test_relative_dataset_and_reward_file_are_resolved_where_streamrl_starts(project, monkeypatch):
    monkeypatch.chdir(project)
    r = load("local", ["task.dataset=data/train.jsonl", "task.reward=rewards/my_reward.py:score"]).recipe
    assert r.task.dataset == str(project / "data" / "train.jsonl")
    assert r.task.reward == f"{project / 'rewards' / 'my_reward.py'}:score"
    r = load("local", ["task.dataset=data/train.jsonl", "task.reward=rewards/my_reward.py:score",
                       "task.eval_dataset=data/train.jsonl"]).recipe  # fmt: skip
    assert r.task.eval_dataset == str(project / "data" / "train.jsonl")
    # a module name is left as it is
    r = load("local", ["task.dataset=data/train.jsonl", "task.reward=streamrl_cli.tasks.rewards:exact_match"])
    assert r.recipe.task.reward == "streamrl_cli.tasks.rewards:exact_match"


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        (["task.dataset=data/nope.jsonl", "task.reward=rewards/my_reward.py:score"],
         ["task.dataset", "no such file or directory", "nope.jsonl"]),
        (["task.dataset=data/train.jsonl", "task.reward=rewards/missing.py:score"],
         ["task.reward", "no such file", "missing.py"]),
        (["task.dataset=data/train.jsonl"], ["task.reward", "needs a reward function"]),
        (["task.dataset=data/train.jsonl", "task.reward=justaname"], ["task.reward", "module:function"]),
        (["task.chat_template=tpl/missing.jinja"], ["task.chat_template", "no such file"]),
        (["task.chat_template=' '"], ["task.chat_template", "empty"]),
        (["task.system_prompt=hi"], ["task.system_prompt", "built-in task"]),
        (["task.answer_key=gold"], ["answer_key"]),  # not a key (the columns carry every field)
        (["task.eval_every=2"], ["task.eval_every", "no effect without task.eval_dataset"]),
        (["task.dataset=data/train.jsonl", "task.reward=rewards/my_reward.py:score",
          "task.eval_dataset=data/held.jsonl"], ["task.eval_dataset", "no such file", "held.jsonl"]),
        (["task.dataset=data/train.jsonl", "task.reward=rewards/my_reward.py:score",
          "task.eval_dataset=data/train.jsonl", "task.eval_samples=0", "task.eval_temperature=-1"],
         ["task.eval_samples", "at least 1", "task.eval_temperature"]),
    ],
)  # fmt: skip
def test_bad_task_keys_are_reported_at_load(project, monkeypatch, overrides, needles):
    monkeypatch.chdir(project)
    with pytest.raises(RecipeError) as e:
        load("local", overrides)
    for needle in needles:
        assert needle in str(e.value)


# -- datasets ------------------------------------------------------------------------------------


def test_a_save_to_disk_directory_is_a_dataset(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list(
        [{"question": "2+2?", "answer": "4"}, {"question": "3+3?", "answer": "6"}]
    )
    ds.save_to_disk(str(tmp_path / "arith"))
    task = make_task(
        TC(**{"dataset": str(tmp_path / "arith"), "prompt_key": "question",
         "reward": "streamrl_cli.tasks.rewards:math_answer"})
    )  # fmt: skip
    assert [(p.prompt_id, p.text, p.columns) for p in task.prompts()] == [
        ("arith/00000", "2+2?", {"answer": "4"}),
        ("arith/00001", "3+3?", {"answer": "6"}),
    ]
    assert task.reward(list(task.prompts()), ["Answer: 4", "5"]) == [1.0, 0.0]
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "splits"))
    with pytest.raises(TaskError, match=r"several splits \(train, test\).*splits/train"):
        make_task(
            TC(**{"dataset": str(tmp_path / "splits"), "reward": "streamrl_cli.tasks.rewards:exact_match"})
        )
    (tmp_path / "plain").mkdir()
    with pytest.raises(TaskError, match="not one written by datasets' save_to_disk"):
        make_task(
            TC(**{"dataset": str(tmp_path / "plain"), "reward": "streamrl_cli.tasks.rewards:exact_match"})
        )


# -- chat prompts --------------------------------------------------------------------------------

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from streamrl_cli.models.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("m") / "tiny"))


def _chat_rows(path):
    rows = [
        {"messages": [{"role": "user", "content": "add 2 and 2"}], "answer": "4"},
        {"messages": [{"role": "system", "content": "be terse"}, {"role": "user", "content": "3+3"}],
         "answer": "6"},
    ]  # fmt: skip
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def ZERO(prompts, completions, **columns):
    return [0.0] * len(completions)


def test_chat_rows_render_the_recipes_template_with_the_system_prompt(tmp_path, tiny_dir):
    task = make_task(
        TC(**{"dataset": str(_chat_rows(tmp_path / "chat.jsonl")), "prompt_key": "messages",
         "chat_template": TEMPLATE, "system_prompt": "You are a calculator.",
         "reward": "streamrl_cli.tasks.rewards:exact_match"}),
        model_path=tiny_dir,
    )  # fmt: skip
    assert [p.text for p in task.prompts()] == [
        "<|system|>You are a calculator.\n<|user|>add 2 and 2\n<|assistant|>",
        "<|system|>be terse\n<|user|>3+3\n<|assistant|>",  # a chat's own system message is kept
    ]
    assert task.prompts()[0].columns == {"answer": "4"}


def test_the_tokenizers_own_template_is_used_and_text_prompts_can_go_through_it(tmp_path, tiny_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    rows = tmp_path / "chat.jsonl"
    _chat_rows(rows)
    # The tiny tokenizer ships no template: asking for it says so and how to give one.
    with pytest.raises(TaskError, match="has no chat template; set task.chat_template"):
        DatasetTask(
            rows,
            prompt_key="messages",
            reward=lambda p, c, **k: [0.0] * len(c),
            chat=ChatFormat(tokenizer=tok),
        )
    tok.chat_template = TEMPLATE.replace("<|", "[").replace("|>", "]")
    task = DatasetTask(rows, prompt_key="messages", reward=ZERO, chat=ChatFormat(tokenizer=tok))
    assert task.prompts()[0].text == "[user]add 2 and 2\n[assistant]"
    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"prompt": "hello"}) + "\n")
    plain = DatasetTask(text, reward=ZERO, chat=ChatFormat(tokenizer=tok))
    assert plain.prompts()[0].text == "hello"  # no template asked for: text as it is
    with pytest.raises(TaskError, match="system_prompt.*chat_template=tokenizer"):
        DatasetTask(text, reward=ZERO, chat=ChatFormat(system_prompt="be brief", tokenizer=tok))
    chat = DatasetTask(text, reward=ZERO, chat=ChatFormat(template="tokenizer", tokenizer=tok))
    assert chat.prompts()[0].text == "[user]hello\n[assistant]"


def test_a_template_file_and_bad_chats(tmp_path, tiny_dir):
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    rows = _chat_rows(tmp_path / "chat.jsonl")
    task = make_task(
        TC(**{"dataset": str(rows), "prompt_key": "messages", "chat_template": str(tmp_path / "t.jinja"),
         "reward": "streamrl_cli.tasks.rewards:exact_match"}), model_path=tiny_dir,
    )  # fmt: skip
    assert task.prompts()[1].text.endswith("<|user|>3+3\n<|assistant|>")
    bad = tmp_path / "bad.jsonl"
    for row, needle in [
        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
         "ends with an assistant message"),
        ({"messages": [{"content": "no role"}]}, "every message must be"),
        ({"messages": []}, "non-empty list of chat messages"),
    ]:  # fmt: skip
        bad.write_text(json.dumps(row) + "\n")
        with pytest.raises(TaskError, match=needle):
            DatasetTask(
                bad,
                prompt_key="messages",
                reward=lambda p, c, **k: [0.0],
                chat=ChatFormat(template=TEMPLATE, model_path=tiny_dir),
            )


# -- what the trainer does with None ---------------------------------------------------------------


def test_an_unscored_sample_is_masked_out_of_the_loss():
    def rollout(scored: bool) -> Rollout:
        s = Sample(prompt_id="p", sample_index=0, token_ids=[7, 8], logprobs=[-1.0, -1.0],
                   finish_reason="stop", weight_version=0)  # fmt: skip
        return Rollout(prompt_tokens=[1, 2], sample=s, reward=0.0, scored=scored)

    mb = collate([rollout(True), rollout(False)])
    assert mb.mask[0].sum().item() == 2 and mb.mask[1].sum().item() == 0


def test_prompt_columns_default_to_none_where_a_record_lacks_them():
    seen = {}

    def fn(prompts, completions, **columns):
        seen.update(columns)
        return [0.0] * len(completions)

    from streamrl_cli.tasks.rewards import Reward

    Reward(fn)([Prompt("a", "x", {"k": 1}), Prompt("b", "y", {"j": 2})], ["1", "2"])
    assert seen == {"j": [None, 2], "k": [1, None]}


def test_slurm_jobs_get_the_users_files_as_absolute_paths(project, tmp_path):
    """Role processes start elsewhere (a SLURM job on another node): their specs carry absolute paths."""
    from pathlib import Path

    import yaml
    from support.helpers import streamrl

    root = tmp_path / "runs"
    out = streamrl(
        "run", "slurm-local", "--dry-run", "--root", str(root), "task.dataset=data/train.jsonl",
        "task.reward=rewards/my_reward.py:score", "task.eval_dataset=data/train.jsonl", cwd=project,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    run_dir = Path(out.stdout.strip().splitlines()[-1])
    for role in ("trainer", "generator"):
        task = yaml.safe_load((run_dir / "roles" / f"{role}.yaml").read_text())["task"]
        assert task["dataset"] == task["eval_dataset"] == str(project / "data" / "train.jsonl")
        assert task["reward"] == f"{project / 'rewards' / 'my_reward.py'}:score"
