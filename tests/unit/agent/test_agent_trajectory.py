"""Multi-turn trajectories are built token-exact: what the engine sampled and the environment answered.

The inference engine is scripted (a GenerationEngine that returns given turns with given log-probs
and versions: the exact values are the point); the environment runs for real in its worker
process, the tokenizer and chat template are real.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from support.agent import Scripted

from streamrl_cli.agent.env_host import EnvSettings
from streamrl_cli.agent.render import Renderer
from streamrl_cli.agent.tools import parse_tool_calls
from streamrl_cli.agent.trajectory import DONE, MAX_TOKENS, MAX_TURNS, Trajectory
from streamrl_cli.generator.engine import GenerationRequest, GenerationResult, SamplingSpec
from streamrl_cli.generator.multiturn import AgentEngine
from streamrl_cli.generator.stream import to_samples
from streamrl_cli.tasks.calc import CHAT_TEMPLATE, SPECIAL_TOKENS

ENVS = Path(__file__).with_name("envs.py")

# Qwen3-style: earlier assistant messages are rendered differently (their reasoning stripped) once
# a later message follows. Re-rendering the conversation with it would rewrite turn 1.
REWRITING_TEMPLATE = CHAT_TEMPLATE.replace(
    "{%- else -%}",
    "{%- elif message['role'] == 'assistant' and not loop.last -%}"
    "{{- '<|im_start|>assistant\\n' + message['content'].split('</think>')[-1] + '<|im_end|>\\n' -}}"
    "{%- else -%}",
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import AutoTokenizer

    from streamrl_cli.models.tiny import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("agent") / "tiny")
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS)})
    tok.chat_template = CHAT_TEMPLATE
    out = tmp_path_factory.mktemp("agent") / "tok"
    tok.save_pretrained(out)
    return out


def _run(engine: AgentEngine, request: GenerationRequest) -> GenerationResult:
    async def go():
        await engine.start()
        try:
            return [r async for r in engine.generate([request])]
        finally:
            await engine.close()

    (result,) = asyncio.run(go())
    return result


def _tok(model_dir, template=CHAT_TEMPLATE):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = template
    return tok


def _episode(model_dir, template, turns, *, max_tokens=200, max_turns=4, env="Scripted", tools=()):
    inner = Scripted(turns)
    settings = EnvSettings(env=f"{ENVS}:{env}", tools=[f"{ENVS}:{t}" for t in tools], workers=1, timeout_s=30)
    engine = AgentEngine(
        inner, settings, model_path=str(model_dir), max_turns=max_turns, max_turn_tokens=16,
        chat_template=template,
    )  # fmt: skip
    prompt = _tok(model_dir)("<|im_start|>user\nplay<|im_end|>\n", add_special_tokens=False).input_ids
    req = GenerationRequest(
        request_id="it0/p1#0", prompt_token_ids=prompt,
        sampling=SamplingSpec(n=1, max_tokens=max_tokens, seed=7),
        meta={"prompt_id": "it0/p1", "group_id": "it0/p1", "sample_indices": [0], "env": {"k": 1}},
    )  # fmt: skip
    return prompt, inner, _run(engine, req)


def test_a_three_turn_trajectory_is_exactly_what_was_sampled_and_answered(model_dir):
    tok = _tok(model_dir)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    t1, t2, t3 = [11, 12, end], [21, 22, 23, end], [31, end]
    lp1, lp2, lp3 = [-0.5, -0.25, -0.125], [-1.0, -2.0, -3.0, -0.5], [-0.75, -0.0625]

    def env(text):  # the environment's answer, rendered as the template puts it after a closed turn
        return tok(text, add_special_tokens=False).input_ids

    opening = env("<|im_start|>assistant\n")
    e1 = env("\n<|im_start|>user\nobs1<|im_end|>\n<|im_start|>assistant\n")
    e2 = env("\n<|im_start|>user\nobs2<|im_end|>\n<|im_start|>assistant\n")
    expect_ids = opening + t1 + e1 + t2 + e2 + t3
    expect_mask = [0] * len(opening) + [1] * 3 + [0] * len(e1) + [1] * 4 + [0] * len(e2) + [1] * 2
    expect_lp = [0.0] * len(opening) + lp1 + [0.0] * len(e1) + lp2 + [0.0] * len(e2) + lp3
    # Versions: turn 1 under 4, turns 2 and 3 under 5 (an update between turns); environment tokens
    # take the turn before theirs (the opening: the first turn's).
    expect_versions = [4] * (len(opening) + 3 + len(e1)) + [5] * (4 + len(e2) + 2)

    results = {}
    for name, template in (("plain", CHAT_TEMPLATE), ("rewriting", REWRITING_TEMPLATE)):
        turns = [(t1, lp1, 4, "stop"), (t2, lp2, 5, "stop"), (t3, lp3, 5, "stop")]
        prompt, inner, result = _episode(model_dir, template, turns)
        (c,) = result.completions
        assert c.token_ids == expect_ids, name
        assert c.loss_mask == expect_mask, name
        assert c.logprobs == expect_lp, name
        assert c.token_versions == expect_versions, name
        assert (result.weight_version, result.weight_version_end) == (4, 5)
        # Each turn was asked on exactly the tokens so far: the past is never re-rendered.
        assert inner.prompts == [
            prompt + opening,
            prompt + opening + t1 + e1,
            prompt + opening + t1 + e1 + t2 + e2,
        ]
        # Samples of one group's turns are seeded apart; each turn stops at the template's end of turn.
        assert len({r.sampling.seed for r in inner.requests}) == 3
        assert end in inner.requests[0].sampling.stop_token_ids
        assert c.episode["turns"] == 3 and c.episode["stop"] == DONE
        assert c.episode["env_reward"] == pytest.approx(0.25 + 0.25 + 1.0)
        assert (c.episode["model_tokens"], c.episode["env_tokens"]) == (9, len(expect_ids) - 9)
        assert c.finish_reason == "stop"
        results[name] = c
        # On the wire, as the trainer receives it.
        (s,) = to_samples(result, "generator-0")
        assert (s.token_ids, s.loss_mask, s.logprobs, s.token_versions) == (
            expect_ids,
            expect_mask,
            expect_lp,
            expect_versions,
        )
        assert s.weight_version == 4 and s.episode.turns == 3
    for c in results.values():
        c.episode.pop("env_s")  # seconds measured, not a property of the trajectory
    assert results["plain"] == results["rewriting"]


def test_budgets_end_a_trajectory_with_their_reason(model_dir):
    tok = _tok(model_dir)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    # max_turns=2: the environment still judges the second turn, then the trajectory ends.
    turns = [([11, end], [-0.1, -0.1], 1, "stop"), ([12, end], [-0.1, -0.1], 1, "stop")]
    _, inner, result = _episode(model_dir, CHAT_TEMPLATE, turns, max_turns=2)
    (c,) = result.completions
    assert c.episode["stop"] == MAX_TURNS and c.episode["turns"] == 2
    assert c.episode["env_reward"] == pytest.approx(0.5)  # both turns judged; no answer appended after
    assert c.token_ids[-1] == end
    # A token budget that the first observation does not fit: ends after the first turn ("length").
    opening = len(tok("<|im_start|>assistant\n", add_special_tokens=False).input_ids)
    _, inner, result = _episode(
        model_dir, CHAT_TEMPLATE, [([11, 12, end], [-0.1] * 3, 1, "stop")], max_tokens=opening + 5
    )
    (c,) = result.completions
    assert c.episode["stop"] == MAX_TOKENS and c.finish_reason == "length"
    assert len(c.token_ids) <= opening + 5
    # The turn's own budget is what remains of the trajectory's, never more.
    assert inner.requests[0].sampling.max_tokens == 5


def test_tool_calls_are_answered_and_their_errors_shown_to_the_model(model_dir):
    tok = _tok(model_dir)

    def ids(text):
        return tok(text, add_special_tokens=False).input_ids

    end = tok.convert_tokens_to_ids("<|im_end|>")
    call = ids('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>') + [end]
    bad = ids('<tool_call>{"name": "add", "arguments": {"a": 2</tool_call>') + [end]
    raises = ids('<tool_call>{"name": "divide", "arguments": {"a": 1, "b": 0}}</tool_call>') + [end]
    answer = ids("5") + [end]
    turns = [(t, [-0.1] * len(t), 1, "stop") for t in (call, bad, raises, answer)]
    _, inner, result = _episode(
        model_dir, CHAT_TEMPLATE, turns, max_tokens=400, max_turns=4, env="Scripted", tools=("add", "divide")
    )
    (c,) = result.completions
    text = tok.decode(c.token_ids, skip_special_tokens=False)
    assert "<tool_response>\n5\n</tool_response>" in text
    assert "<tool_response>\nerror: the tool call is not valid JSON" in text
    assert "<tool_response>\nerror: ZeroDivisionError: division by zero\n</tool_response>" in text
    assert (c.episode["tool_calls"], c.episode["tool_errors"]) == (3, 2)
    # The turn without a call went to the environment: its first step (reward 0.25, not done).
    assert c.episode["env_reward"] == pytest.approx(0.25) and c.episode["turns"] == 4
    assert c.episode["stop"] == MAX_TURNS


def test_tool_call_parsing():
    (c,) = parse_tool_calls('x <tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>')
    assert (c.name, c.arguments, c.error) == ("f", {"a": 1}, "")
    assert parse_tool_calls("no call here") == []
    (c,) = parse_tool_calls('<tool_call>{"arguments": {}}</tool_call>')
    assert c.error and c.name == ""
    (c,) = parse_tool_calls('<tool_call>{"name": "f", "arguments": [1]}</tool_call>')
    assert "JSON object" in c.error
    # A call cut off at the turn's budget (no closing tag) is still read, and fails to parse.
    (c,) = parse_tool_calls('<tool_call>{"name": "f", "argu')
    assert "not valid JSON" in c.error


def test_renderer_closes_a_turn_cut_at_its_budget(model_dir):
    tok = _tok(model_dir)
    r = Renderer(tok)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert end in r.turn_end_ids and tok.eos_token_id in r.turn_end_ids
    msg = [{"role": "user", "content": "hi"}]
    stopped = tok.decode(r.env_turn(msg, [11, end]), skip_special_tokens=False)
    cut = tok.decode(r.env_turn(msg, [11, 12]), skip_special_tokens=False)
    assert stopped == "\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert cut == "<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_trajectory_refuses_what_does_not_fit():
    t = Trajectory(max_tokens=4)
    t.add_model_turn([1, 2], [-0.1, -0.2], 3)
    assert not t.fits([5, 6]) and t.fits([5])  # the model must keep one token to answer
    with pytest.raises(ValueError):
        t.add_model_turn([1, 2, 3], [0.0] * 3, 3)
    with pytest.raises(ValueError):
        t.end("bored")
