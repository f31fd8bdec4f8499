"""Tasks: the built-in repeat task, reward loading and verifiers, datasets, the prompt sampler."""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import replace

import pytest

from streamrl_cli.errors import StreamRLError
from streamrl_cli.recipe.schema import TaskConfig
from streamrl_cli.tasks import Prompt, TaskError, make_task
from streamrl_cli.tasks.builtin import WORDS, RepeatTask, repeat_score
from streamrl_cli.tasks.datasets import DatasetTask
from streamrl_cli.tasks.rewards import Reward, exact_match, extract_answer, load_reward, math_answer
from streamrl_cli.tasks.sampler import PromptSampler

BUILTIN = TaskConfig(name="builtin", dataset=None, num_prompts=4096, max_prompt_len=64, max_output_len=64)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from streamrl_cli.models.tiny import build_tiny_model

    return AutoTokenizer.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("m") / "tiny"))


# -- the built-in task ---------------------------------------------------------------------------


def test_builtin_is_deterministic_from_its_seed():
    a, b = make_task(BUILTIN, seed=3), make_task(BUILTIN, seed=3)
    assert isinstance(a, RepeatTask) and a.prompts() == b.prompts()
    assert make_task(BUILTIN, seed=4).prompts() != a.prompts()
    assert len(a.prompts()) == 4096 and len({p.prompt_id for p in a.prompts()}) == 4096
    assert a.prompts()[17].prompt_id == "repeat/00017"
    json.dumps([p.columns for p in a.prompts()])  # reward columns are JSON-serialisable


def test_builtin_lengths_are_long_tailed():
    task = make_task(BUILTIN)
    lengths = sorted(task.expected_length(p) for p in task.prompts())
    median = statistics.median(lengths)
    p90 = lengths[int(0.9 * len(lengths))]
    assert 4 <= median <= 8
    assert p90 >= 3 * median
    assert max(lengths) <= BUILTIN.max_output_len
    assert statistics.mode(lengths) <= 6


def test_builtin_lengths_fit_a_smaller_max_output_len():
    task = make_task(replace(BUILTIN, max_output_len=16, num_prompts=500))
    assert max(task.expected_length(p) for p in task.prompts()) <= 16


def test_filler_words_make_a_long_context_before_the_same_instruction(tokenizer):
    plain = RepeatTask(num_prompts=6, seed=2).prompts()
    long = RepeatTask(num_prompts=6, seed=2, filler_words=3000).prompts()
    assert [p.prompt_id for p in long] == [p.prompt_id for p in plain]
    assert [p.columns for p in long] == [p.columns for p in plain]  # the same instructions and answers
    for p, q in zip(plain, long, strict=True):
        assert q.text.endswith(" " + p.text) and q.text != p.text
        n = len(tokenizer(q.text).input_ids)
        assert 3000 <= n <= 3000 + 16  # one token a word, then the instruction (the recipe check's room)
    assert len({q.text for q in long}) == 6  # each prompt its own context
    assert RepeatTask(num_prompts=6, seed=2, filler_words=3000).prompts() == long  # from the seed
    with pytest.raises(TaskError, match="filler_words"):
        RepeatTask(num_prompts=1, filler_words=-1)


def test_expected_length_is_the_tokenized_reference_plus_eos(tokenizer):
    for word in WORDS:
        assert len(tokenizer(f" {word}", add_special_tokens=False).input_ids) == 1, word
    task = make_task(replace(BUILTIN, num_prompts=300))
    for p in task.prompts():
        ids = tokenizer(task.reference_completion(p)).input_ids  # as vLLM would (special tokens on)
        assert len(ids) + 1 == task.expected_length(p), p
        assert len(tokenizer(p.text).input_ids) <= BUILTIN.max_prompt_len
    assert tokenizer.eos_token == "<|endoftext|>"


def test_repeat_reward_is_graded():
    p = Prompt("repeat/0", "repeat fox 8:", {"word": "fox", "count": 8})
    task = RepeatTask(num_prompts=1)
    ref = task.reference_completion(p)
    assert ref == " fox" * 8

    def score(completion: str) -> float:
        return task.reward([p], [completion])[0]

    assert score(ref) == 1.0
    assert score(ref + "<|endoftext|> junk after eos") == 1.0
    assert score("") == 0.0
    assert score(" the quick brown dog jumps") < 0.2
    assert score(" model" * 8) == 0.0
    off_by_one, off_by_two, off_by_four = score(" fox" * 9), score(" fox" * 10), score(" fox" * 12)
    one_wrong = score(" fox" * 7 + " dog")
    assert 0.1 < off_by_four < off_by_two < off_by_one < 1.0
    assert 0.2 < one_wrong < 1.0
    assert score(" fox" * 6) < score(" fox" * 7)
    assert 0.0 <= score(" fox" * 60) < 0.01


def test_repeat_reward_can_be_replaced_by_the_recipe():
    task = make_task(replace(BUILTIN, num_prompts=4, reward="streamrl_cli.tasks.rewards:repeat_verifier"))
    p = task.prompts()[0]
    assert task.reward([p], [task.reference_completion(p)]) == [1.0]
    # exact_match reads an `answer` column, which the built-in task does not have: said at once
    with pytest.raises(TaskError, match=r"exact_match.*columns \(count, word\).*'answer'"):
        make_task(replace(BUILTIN, num_prompts=4, reward="streamrl_cli.tasks.rewards:exact_match"))


def test_reward_of_the_builtin_verifier_by_name():
    fn = load_reward("streamrl_cli.tasks.rewards:repeat_verifier")
    p = Prompt("r", "repeat step 3:", {"word": "step", "count": 3})
    assert fn([p, p], [" step step step", " fox"]) == [1.0, 0.0]
    assert repeat_score(p.columns, " step step step step") < 1.0


# -- loading reward functions --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("nocolon", "is not `module:function`"),
        ("mod:not-an-identifier", "is not `module:function`"),
        ("missing/file.py:score", "no such file"),
        (":f", "is not `module:function`"),
        ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
        ("streamrl_cli.tasks.rewards:nope", "has no attribute 'nope'"),
        ("streamrl_cli.tasks.rewards:_NUMBER", "not a function"),
    ],
)
def test_load_reward_errors(spec, needle):
    with pytest.raises(TaskError, match="task.reward") as e:
        load_reward(spec)
    assert needle in str(e.value)


def test_has_no_attribute_lists_what_is_there():
    with pytest.raises(TaskError, match="math_answer"):
        load_reward("streamrl_cli.tasks.rewards:nope")


def test_reward_names_the_function_that_misbehaves():
    p = Prompt("a", "x")

    def too_short(prompts, completions):
        return [1.0]

    def not_floats(prompts, completions):
        return ["yes" for _ in completions]

    def not_a_list(prompts, completions):
        return 1.0

    def nan(prompts, completions):
        return [float("nan")] * len(completions)

    for fn in (too_short, not_floats, not_a_list, nan):
        with pytest.raises(TaskError, match=fn.__name__):
            Reward(fn)([p, p], ["a", "b"])
    assert Reward(lambda prompts, completions: [1] * len(completions))([p], ["a"]) == [1.0]


def test_exact_match():
    ps = [Prompt("a", "q", {"answer": "Paris"}), Prompt("b", "q", {"answer": 4}), Prompt("c", "q")]
    fn = load_reward("streamrl_cli.tasks.rewards:exact_match")
    assert fn(ps, ["  Paris\n", "4", "x"]) == [1.0, 1.0, 0.0]
    assert exact_match(["q"], ["4"], answer=[4]) == [1.0]


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("so the result is \\boxed{42}.", 42, 1.0),
        ("\\boxed{\\frac{3}{4}}", "0.75", 1.0),
        ("\\boxed{3/4}", 0.75, 1.0),
        ("first \\boxed{1} then \\boxed{2}", 2, 1.0),
        ("12 times 12 is 144. Answer: 144", "144", 1.0),
        ("Answer: 1,000 apples", 1000, 1.0),
        ("Answer: -3.5", "-3.5", 1.0),
        ("we get 7 and then 9", 9, 1.0),
        ("we get 7 and then 9", 7, 0.0),
        ("3 + 4 = 7 so Answer: 7", 7, 1.0),
        ("Answer: 12, not 13", 13, 1.0),  # the last number after "Answer:"
        ("no number here", 1, 0.0),
        ("\\boxed{x+1}", 1, 0.0),
        ("\\boxed{5", 5, 1.0),  # unbalanced box: fall back to the last number
        ("42", None, 0.0),
    ],
)
def test_math_answer(completion, answer, expected):
    assert math_answer(["q"], [completion], answer=[answer]) == [expected]


def test_extract_answer_nested_braces():
    assert extract_answer("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert extract_answer("nothing") is None


# -- datasets ------------------------------------------------------------------------------------


def _jsonl(path, *lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_dataset(tmp_path):
    path = _jsonl(
        tmp_path / "math.jsonl",
        json.dumps({"prompt": "1+1?", "answer": 2}),
        "",
        json.dumps({"prompt": "2+2?", "answer": 4, "extra": True}),
    )
    task = make_task(
        TaskConfig(name="math", dataset=str(path), reward="streamrl_cli.tasks.rewards:math_answer")
    )
    assert isinstance(task, DatasetTask) and task.name == "math"
    assert [(p.prompt_id, p.text, p.columns) for p in task.prompts()] == [
        ("math/00000", "1+1?", {"answer": 2}),
        ("math/00002", "2+2?", {"answer": 4, "extra": True}),
    ]
    assert task.reward(task.prompts(), ["Answer: 2", "5"]) == [1.0, 0.0]


def test_jsonl_ids_and_keys(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", json.dumps({"id": "q7", "question": "hi", "gold": "yo"}))
    task = DatasetTask(path, prompt_key="question", reward=lambda prompts, completions, gold, **kw: [1.0])
    assert task.prompts() == (Prompt("q7", "hi", {"id": "q7", "gold": "yo"}),)
    assert task.name == "d"


@pytest.mark.parametrize(
    ("lines", "needles"),
    [
        (['{"prompt": "a"}', '{"question": "b", "answer": 1}'], ["line 2", "'prompt'", "question, answer"]),
        (['{"prompt": "a"}', "{not json"], ["line 2", "not valid JSON"]),
        (['["a list"]'], ["line 1", "not an object"]),
        (['{"prompt": 5}'], ["line 1", "must be a string"]),
        (['{"id": 1, "prompt": "a"}', '{"id": 1, "prompt": "b"}'], ["line 2", "already used at line 1"]),
        ([""], ["holds no prompts"]),
    ],
)
def test_jsonl_errors(tmp_path, lines, needles):
    path = _jsonl(tmp_path / "bad.jsonl", *lines)
    with pytest.raises(TaskError) as e:
        DatasetTask(path, reward=exact_match)
    for needle in needles:
        assert needle in str(e.value)


def test_dataset_path_and_reward_errors(tmp_path):
    with pytest.raises(TaskError, match="does not exist"):
        DatasetTask(tmp_path / "missing.jsonl", reward=exact_match)
    (tmp_path / "d.csv").write_text("prompt\nx\n")
    with pytest.raises(TaskError, match=r"unknown file type '\.csv'.*\.jsonl"):
        DatasetTask(tmp_path / "d.csv", reward=exact_match)
    path = _jsonl(tmp_path / "d.jsonl", '{"prompt": "a"}')
    with pytest.raises(TaskError, match="task.reward.*exact_match"):
        make_task(TaskConfig(name="d", dataset=str(path), reward=None))
    assert issubclass(TaskError, StreamRLError)


def test_parquet_without_pyarrow_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    with pytest.raises(TaskError, match=r"pyarrow.*not installed.*streamrl\[parquet\]"):
        DatasetTask(tmp_path / "d.parquet", reward=exact_match)


def test_parquet_dataset(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": ["x", "y"]}), path)
    task = DatasetTask(path, reward=exact_match)
    assert [(p.prompt_id, p.text, p.columns) for p in task.prompts()] == [
        ("rows/00000", "a", {"answer": "x"}),
        ("rows/00001", "b", {"answer": "y"}),
    ]
    pq.write_table(pa.table({"text": ["a"]}), path)
    with pytest.raises(TaskError, match="row 1 has no field 'prompt' \\(fields there: text\\)"):
        DatasetTask(path, reward=exact_match)


# -- the prompt sampler --------------------------------------------------------------------------


def _prompts(n):
    return [Prompt(f"p/{i}", str(i)) for i in range(n)]


def test_sampler_resumes_with_the_same_order():
    prompts = _prompts(11)
    original = PromptSampler(prompts, batch_size=4, seed=5)
    batches, states = [], []
    for _ in range(5):
        states.append(original.state())
        batches.append(original.next_batch())
    resumed = PromptSampler(prompts, batch_size=4, seed=0)
    resumed.load_state(json.loads(json.dumps(states[2])))  # as saved in a checkpoint
    assert [resumed.next_batch() for _ in range(3)] == batches[2:]


def test_sampler_epochs_are_shuffled_permutations():
    prompts = _prompts(10)
    s = PromptSampler(prompts, batch_size=5, seed=1)
    epoch0 = s.next_batch() + s.next_batch()
    epoch1 = s.next_batch() + s.next_batch()
    assert sorted(p.text for p in epoch0) == sorted(p.text for p in prompts)
    assert epoch0 != prompts and epoch0 != epoch1
    assert s.state() == {"epoch": 1, "index": 10, "seed": 1}
    assert PromptSampler(prompts, 5, seed=1).next_batch() == epoch0[:5]
    assert PromptSampler(prompts, 5, seed=2).next_batch() != epoch0[:5]


def test_sampler_without_shuffle_keeps_the_dataset_order_epoch_after_epoch_and_on_resume():
    prompts = _prompts(7)
    s = PromptSampler(prompts, batch_size=3, seed=4, shuffle=False)
    seen = [p for _ in range(5) for p in s.next_batch()]  # 15 prompts: two epochs and one more
    assert seen == prompts + prompts + prompts[:1]
    resumed = PromptSampler(prompts, batch_size=3, seed=0, shuffle=False)
    resumed.load_state(json.loads(json.dumps(s.state())))
    assert resumed.next_batch() == prompts[1:4]


def test_handed_back_prompts_come_first_and_survive_a_resume():
    prompts = _prompts(10)
    s = PromptSampler(prompts, batch_size=3, seed=0, shuffle=False)
    first = s.next_batch(5)  # over-sampled: 5 drawn for a batch of 3
    assert first == prompts[:5]
    assert s.give_back([first[4], first[1]]) == [4, 1]  # the two that did not finish
    saved = json.loads(json.dumps(s.state()))
    assert saved == {"epoch": 0, "index": 5, "seed": 0, "returned": [4, 1]}
    assert s.next_batch(3) == [prompts[4], prompts[1], prompts[5]]  # handed back first, in order
    assert s.next_batch() == prompts[6:9] and "returned" not in s.state()
    resumed = PromptSampler(prompts, batch_size=3, seed=0, shuffle=False)
    resumed.load_state(saved)
    assert resumed.next_batch(3) == [prompts[4], prompts[1], prompts[5]]
    with pytest.raises(TaskError, match="not one of the task's"):
        s.give_back([Prompt("elsewhere/0", "x")])
    with pytest.raises(TaskError, match="dataset change"):
        resumed.load_state({**saved, "returned": [10]})


def test_sampler_errors():
    with pytest.raises(TaskError, match="global_batch"):
        PromptSampler(_prompts(3), batch_size=0)
    with pytest.raises(TaskError, match="no prompts"):
        PromptSampler([], batch_size=1)
    s = PromptSampler(_prompts(3), batch_size=1)
    with pytest.raises(TaskError, match="dataset change"):
        s.load_state({"epoch": 0, "index": 9, "seed": 0})
    with pytest.raises(TaskError, match="epoch, index, seed"):
        s.load_state({"epoch": 0})
