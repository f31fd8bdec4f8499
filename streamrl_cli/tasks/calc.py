"""The built-in multi-turn task ``calc``: add two numbers with a calculator tool, on two CPU cores.

A 2-layer, 64-wide model cannot add two-digit numbers in its head; it can learn to call a tool
and copy the tool's answer. A trajectory (the chat template is :data:`CHAT_TEMPLATE`, Qwen2.5's
layout in miniature)::

    <|im_start|>user\\nWhat is 47 + 28?<|im_end|>\\n                       the task's prompt
    <|im_start|>assistant\\n                                                 environment (mask 0)
    <tool_call>{"name": "add", "arguments": {"a": 47, "b": 28}}</tool_call><|im_end|>   model
    \\n<|im_start|>user\\n<tool_response>\\n75\\n</tool_response><|im_end|>\\n
    <|im_start|>assistant\\n                                                 environment (mask 0)
    75<|im_end|>                                                             model: the answer

The environment (:class:`CalcEnv`) rewards the final answer (a turn without a tool call): 1 if it
is the sum, else 0; the tool :func:`add` answers calls. The supervised warm-up teaches the format
from references of which only half use the tool (the other half guess, mostly wrongly), so the
warmed policy calls the tool about half the time, and reinforcement learning has a clear thing to
learn: always call it, and copy its answer.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence
from typing import Any

from streamrl_cli.tasks import Prompt, Task, TaskError

# Qwen2.5's chat layout (tool answers as a user turn in <tool_response>), without the tool list in
# the system prompt (the tiny model learns its one tool in the warm-up). The comment names the
# tool-call syntax, which is how StreamRL recognises a template's (streamrl_cli.agent.tools).
CHAT_TEMPLATE = (
    '{#- tool calls: <tool_call>{"name": ..., "arguments": {...}}</tool_call> -#}'
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] -}}"
    "{{- '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
SPECIAL_TOKENS = ("<tool_call>", "</tool_call>")  # single tokens, as in Qwen2.5's tokenizer
LOW, HIGH = 10, 99  # the numbers added
TOOL_SHARE = 0.5  # warm-up references that use the tool
_INT = re.compile(r"-?\d+")


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return int(a) + int(b)


def tool_call(a: int, b: int) -> str:
    return f'<tool_call>{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'


def final_answer(text: str) -> int | None:
    """The number a final turn gives (its last integer), or None."""
    found = _INT.findall(text)
    return int(found[-1]) if found else None


class CalcEnv:
    """Rewards the final answer: 1.0 if it is a + b. Tool calls never reach it (the tool answers)."""

    def reset(self, row: Mapping[str, Any]) -> None:
        self.answer = int(row["a"]) + int(row["b"])
        return None  # the task's prompt is the whole opening

    def step(self, turn: str) -> tuple[None, float, bool]:
        return None, float(final_answer(turn) == self.answer), True


class CalcTask(Task):
    """``num_prompts`` additions "What is a + b?" drawn from ``seed``."""

    name = "calc"
    chat_template = CHAT_TEMPLATE
    special_tokens = SPECIAL_TOKENS

    def __init__(self, num_prompts: int = 4096, seed: int = 0):
        if num_prompts < 1:
            raise TaskError(f"task.num_prompts must be at least 1, got {num_prompts}")
        rng = random.Random(f"calc-{seed}")
        self._prompts = tuple(self._draw(i, rng) for i in range(num_prompts))

    @staticmethod
    def _draw(index: int, rng: random.Random) -> Prompt:
        a, b = rng.randint(LOW, HIGH), rng.randint(LOW, HIGH)
        text = f"<|im_start|>user\nWhat is {a} + {b}?<|im_end|>\n"  # CHAT_TEMPLATE's user turn
        return Prompt(f"calc/{index:05d}", text, {"a": a, "b": b})

    def prompts(self) -> Sequence[Prompt]:
        return self._prompts

    def reward(self, prompts: Sequence[Prompt], completions: Sequence[str]) -> list[float | None]:
        """On the whole conversation after the prompt (agent.reward=task): its last number is the
        sum. Coarser than the environment's reward (a conversation that ends on the tool's answer
        counts too): the recipe trains on the environment's."""
        return [
            float(final_answer(c) == int(p.columns["a"]) + int(p.columns["b"]))
            for p, c in zip(prompts, completions, strict=True)
        ]

    @staticmethod
    def warmup_episode(prompt: Prompt, rng: random.Random) -> list[dict[str, str]]:
        """A reference conversation after the prompt: the tool called and its answer copied, or
        (1 - TOOL_SHARE of them) a guess, right only by chance."""
        a, b = int(prompt.columns["a"]), int(prompt.columns["b"])
        if rng.random() < TOOL_SHARE:
            return [
                {"role": "assistant", "content": tool_call(a, b)},
                {"role": "tool", "content": str(a + b)},
                {"role": "assistant", "content": str(a + b)},
            ]
        guess = a + b + rng.choice([-100, -10, -1, 1, 10, 100, 0])
        return [{"role": "assistant", "content": str(guess)}]
