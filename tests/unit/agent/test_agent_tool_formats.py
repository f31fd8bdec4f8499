# ruff: noqa: E501 - model turns and template output are quoted whole, as one string each
"""Tool calls in each supported syntax, read from real chat templates' layouts, and their answers
rendered as each template puts a tool message (docs/agents.md, "Tools")."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from support.agent import LLAMA31, MISTRAL, QWEN3_CODER, SPECIAL_TOKENS, Scripted

from streamrl_cli.agent.env_host import AgentError, EnvSettings
from streamrl_cli.agent.render import Renderer
from streamrl_cli.agent.tools import FORMATS, parse_tool_calls, template_format
from streamrl_cli.generator.engine import GenerationRequest, SamplingSpec
from streamrl_cli.generator.multiturn import AgentEngine
from streamrl_cli.tasks.calc import CHAT_TEMPLATE as HERMES

ENVS = Path(__file__).with_name("envs.py")
TEMPLATES = {"hermes": HERMES, "llama3_json": LLAMA31, "mistral": MISTRAL, "qwen3_coder": QWEN3_CODER}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import AutoTokenizer

    from streamrl_cli.models.tiny import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("formats") / "tiny")
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS)})
    out = tmp_path_factory.mktemp("formats") / "tok"
    tok.save_pretrained(out)
    return out


def test_each_template_is_read_in_its_own_syntax():
    assert {name: template_format(t) for name, t in TEMPLATES.items()} == {n: n for n in TEMPLATES}
    assert set(TEMPLATES) == set(FORMATS)
    # Llama 3.2's template has no built-in tools (no <|python_tag|>): its ipython role says it.
    assert template_format(LLAMA31.replace("<|python_tag|>", "")) == "llama3_json"
    plain = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    assert template_format(plain) is None and template_format(None) is None


def test_llama3_json_calls():
    (c,) = parse_tool_calls('{"name": "add", "parameters": {"a": 2, "b": 3}}', "llama3_json")
    assert (c.name, c.arguments, c.error) == ("add", {"a": 2, "b": 3}, "")
    a, b = parse_tool_calls('<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "arguments": {"x": 1}}', "llama3_json")  # fmt: skip
    assert (a.name, b.name, b.arguments) == ("f", "g", {"x": 1})
    assert parse_tool_calls("The answer is 5.", "llama3_json") == []
    assert parse_tool_calls('{"answer": 5}', "llama3_json") == []  # JSON, but not a call
    (c,) = parse_tool_calls('{"name": "add", "parameters": {"a": 2', "llama3_json")  # cut at the budget
    assert "not valid JSON" in c.error
    (c,) = parse_tool_calls("<|python_tag|>add(a=2)", "llama3_json")
    assert c.error.startswith("a tool call needs") and '"parameters"' in c.error
    (c,) = parse_tool_calls('{"name": "add", "parameters": [2, 3]}', "llama3_json")
    assert c.name == "add" and "parameters must be a JSON object" in c.error
    # Prose after a call is not a second, broken one.
    (c,) = parse_tool_calls('{"name": "f", "parameters": {}} Let me check.', "llama3_json")
    assert c.name == "f" and not c.error


def test_mistral_calls():
    a, b = parse_tool_calls(
        '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 2}, "id": "Ab3dE6gH9"}, {"name": "g", "arguments": {}}]',
        "mistral",
    )
    assert (a.name, a.arguments, a.id, b.name) == ("add", {"a": 2}, "Ab3dE6gH9", "g")
    assert b.id == "call00001"  # no id of its own: one the template accepts (9 characters)
    (c,) = parse_tool_calls('[TOOL_CALLS]add[ARGS]{"a": 2, "b": 3}', "mistral")  # newer tokenizers
    assert (c.name, c.arguments) == ("add", {"a": 2, "b": 3})
    assert parse_tool_calls("5", "mistral") == []
    (c,) = parse_tool_calls('[TOOL_CALLS] [{"name": "add", "argu', "mistral")
    assert "not valid JSON" in c.error and c.id == "call00000"
    (c,) = parse_tool_calls("[TOOL_CALLS] add two numbers", "mistral")
    assert c.error.startswith("a tool call needs [TOOL_CALLS]")
    (c,) = parse_tool_calls('[TOOL_CALLS] [{"arguments": {}}]', "mistral")
    assert c.error and c.name == ""


def test_qwen3_coder_calls():
    turn = (
        "I will add them.\n<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n"
        "<parameter=note>\nline one\nline two\n</parameter>\n</function>\n</tool_call>"
    )
    (c,) = parse_tool_calls(turn, "qwen3_coder")
    assert (c.name, c.arguments, c.error) == ("add", {"a": 2, "note": "line one\nline two"}, "")
    assert parse_tool_calls("5", "qwen3_coder") == []
    (c,) = parse_tool_calls("<tool_call>\n<function=add>\n<parameter=a>\n2", "qwen3_coder")
    assert c.name == "add" and "cut off" in c.error
    (c,) = parse_tool_calls(
        "<tool_call>\n<function=add>\n<parameter=a>\n2</function></tool_call>", "qwen3_coder"
    )
    assert "'a' is cut off" in c.error
    (c,) = parse_tool_calls('<tool_call>{"name": "add"}</tool_call>', "qwen3_coder")
    assert "<function=NAME>" in c.error
    with pytest.raises(ValueError, match="valid: hermes, llama3_json, mistral, qwen3_coder"):
        parse_tool_calls("x", "xml")


# One call, one that cannot be read, then an answer: in each syntax, as its template writes a call.
TURNS = {
    "hermes": (
        '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call><|im_end|>',
        '<tool_call>{"name": "add", "arguments": {"a": 2</tool_call><|im_end|>',
        "5<|im_end|>",
    ),
    "llama3_json": (
        '<|python_tag|>{"name": "add", "parameters": {"a": 2, "b": 3}}<|eot_id|>',
        '{"name": "add", "parameters": {"a": 2<|eot_id|>',
        "5<|eot_id|>",
    ),
    "mistral": (
        '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 2, "b": 3}, "id": "Ab3dE6gH9"}]<|endoftext|>',
        '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 2<|endoftext|>',
        " 5<|endoftext|>",
    ),
    "qwen3_coder": (
        "<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n<parameter=b>\n3\n</parameter>\n"
        "</function>\n</tool_call><|im_end|>",
        "<tool_call>\n<function=add>\n<parameter=a>\n2<|im_end|>",
        "5<|im_end|>",
    ),
}
# What each template puts after the model's call for the tool's answer, up to the next turn.
ANSWERS = {
    "hermes": "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
    "llama3_json": '<|start_header_id|>ipython<|end_header_id|>\n\n"5"<|eot_id|>'
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "mistral": '[TOOL_RESULTS] {"content": 5, "call_id": "Ab3dE6gH9"}[/TOOL_RESULTS]',
    "qwen3_coder": "\n<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<|im_end|>\n<|im_start|>assistant\n",
}
ERRORS = {
    "hermes": "<tool_response>\nerror: the tool call is not valid JSON",
    "llama3_json": '<|start_header_id|>ipython<|end_header_id|>\n\n"error: the tool call is not valid JSON',
    "mistral": '[TOOL_RESULTS] {"content": error: the tool call is not valid JSON',
    "qwen3_coder": "<tool_response>\nerror: the tool call is cut off (no </function>)",
}


def _engine(model_dir, template, turns, tool_format=None):
    settings = EnvSettings(tools=[f"{ENVS}:add"], tool_format=tool_format, workers=1, timeout_s=30)
    inner = Scripted(turns)
    engine = AgentEngine(
        inner, settings, model_path=str(model_dir), max_turns=4, max_turn_tokens=64, chat_template=template
    )
    return inner, engine


def _run(engine, prompt):
    req = GenerationRequest(
        request_id="it0/p1#0", prompt_token_ids=prompt, sampling=SamplingSpec(n=1, max_tokens=600, seed=7),
        meta={"prompt_id": "it0/p1", "group_id": "it0/p1", "sample_indices": [0], "env": {}},
    )  # fmt: skip

    async def go():
        await engine.start()
        try:
            return [r async for r in engine.generate([req])]
        finally:
            await engine.close()

    (result,) = asyncio.run(go())
    return result


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_tool_episode_in_each_syntax(model_dir, fmt):
    """The model's calls are read in its template's syntax, the tool answers, and the answers are
    rendered as the template renders a tool message, the error of the unreadable call included."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = TEMPLATES[fmt]
    turns = [tok(t, add_special_tokens=False).input_ids for t in TURNS[fmt]]
    prompt = tok.apply_chat_template([{"role": "user", "content": "2 + 3?"}], tokenize=False)
    inner, engine = _engine(model_dir, TEMPLATES[fmt], [(t, [-0.1] * len(t), 1, "stop") for t in turns])
    (c,) = _run(engine, tok(prompt, add_special_tokens=False).input_ids).completions
    text = tok.decode(c.token_ids, skip_special_tokens=False)
    assert engine.settings.tool_format == fmt  # detected from the template
    assert (c.episode["tool_calls"], c.episode["tool_errors"], c.episode["turns"]) == (2, 1, 3)
    assert c.episode["stop"] == "done"  # the answer without a call ends it (tools only)
    after_call = text.index(TURNS[fmt][0]) + len(TURNS[fmt][0])
    assert text[after_call:].startswith(ANSWERS[fmt])
    assert ERRORS[fmt] in text
    # Each turn stops at the template's end of turn (a special token where the tokenizer has one).
    end = {"llama3_json": "<|eot_id|>", "mistral": "<|endoftext|>"}.get(fmt, "<|im_end|>")
    assert tok.convert_tokens_to_ids(end) in inner.requests[0].sampling.stop_token_ids


def test_a_template_without_a_tool_syntax_is_refused_naming_the_valid_ones(model_dir):
    plain = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    _, engine = _engine(model_dir, plain, [])
    with pytest.raises(AgentError) as e:
        asyncio.run(engine.start())
    assert all(name in str(e.value) for name in FORMATS) and "agent.tool_format" in str(e.value)
    # agent.tool_format names the syntax such a template's model writes: then it is read in it.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    call = tok('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call><|im_end|>').input_ids
    answer = tok("5<|im_end|>").input_ids
    _, engine = _engine(model_dir, plain, [(t, [0.0] * len(t), 1, "stop") for t in (call, answer)], "hermes")
    (c,) = _run(engine, tok("<|im_start|>user\nhi<|im_end|>\n").input_ids).completions
    assert c.episode["tool_calls"] == 1 and c.episode["tool_errors"] == 0


def test_the_renderer_renders_each_templates_tool_messages_alone(model_dir):
    """Several answers of one turn go out together, as the template groups them."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    answers = [
        {"role": "tool", "name": "add", "content": "5", "tool_call_id": "call00000"},
        {"role": "tool", "name": "add", "content": "7", "tool_call_id": "call00001"},
    ]
    expected = {
        "hermes": "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
        "llama3_json": '<|start_header_id|>ipython<|end_header_id|>\n\n"5"<|eot_id|>'
        '<|start_header_id|>ipython<|end_header_id|>\n\n"7"<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n',
        "mistral": '[TOOL_RESULTS] {"content": 5, "call_id": "call00000"}[/TOOL_RESULTS]'
        '[TOOL_RESULTS] {"content": 7, "call_id": "call00001"}[/TOOL_RESULTS]',
        "qwen3_coder": "<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n7\n"
        "</tool_response>\n<|im_end|>\n<|im_start|>assistant\n",
    }
    for fmt, template in TEMPLATES.items():
        tok.chat_template = template
        r = Renderer(tok, tools=[{"type": "function", "function": {"name": "add", "parameters": {}}}])
        closed = r.turn_end_ids[:1]  # a model turn that stopped at the template's end of turn
        got = tok.decode(r.env_turn(answers, [11, *closed]), skip_special_tokens=False)
        assert got.lstrip("\n") == expected[fmt], fmt


def test_the_submit_check_reads_each_syntax_and_names_them_when_none(tmp_path):
    import json

    from streamrl_cli.launch.presubmit import _agent_template
    from streamrl_cli.recipe.schema import AgentConfig, ModelConfig, Recipe

    def problems(template, tool_format=None):
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
        r = Recipe(
            model=ModelConfig(path=str(tmp_path)),
            agent=AgentConfig(tools=["envs.py:add"], tool_format=tool_format, reward="task"),
        )
        out: list[str] = []
        _agent_template(r, out)
        return out

    assert all(problems(t) == [] for t in TEMPLATES.values())
    plain = "{% for m in messages %}{{ m.content }}{% endfor %}"
    (problem,) = problems(plain)
    assert problem.startswith("agent.tools: the chat template of") and all(f in problem for f in FORMATS)
    assert problems(plain, tool_format="mistral") == []  # the recipe says which syntax the model writes


def test_the_recipe_key_names_a_known_syntax_for_tools_that_exist():
    from streamrl_cli.errors import RecipeError
    from streamrl_cli.recipe.load import load

    assert load("local-agent", ["agent.tool_format=mistral"]).recipe.agent.tool_format == "mistral"
    assert load("local-agent", []).recipe.agent.tool_format is None  # the template's
    with pytest.raises(RecipeError, match="not one of hermes, llama3_json, mistral, qwen3_coder"):
        load("local-agent", ["agent.tool_format=xml"])
    with pytest.raises(RecipeError, match="agent.tool_format.*agent.tools names no tool"):
        load("local", ["agent.tool_format=hermes"])
