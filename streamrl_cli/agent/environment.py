"""The environment interface a multi-turn task implements, and the tool environment built on it.

An environment is a class the recipe names (``agent.env``: ``module:Class`` or
``path/to/file.py:Class``), constructed with ``agent.env_args`` once per trajectory::

    class MyEnv:
        def reset(self, row: dict) -> str | list[dict] | None: ...
        def step(self, turn: str) -> StepResult | tuple[observation, reward, done]: ...
        def close(self) -> None: ...          # optional

``reset`` gets the task's row (the prompt's dataset columns, and ``prompt``: its text) and returns
what is added after the prompt before the model's first turn: nothing (None), a user message (a
string) or chat messages (dicts with ``role`` and ``content``). ``step`` gets the model's turn as
text and returns the observation (None, a string: a user message, or messages), a reward (summed
over the trajectory: the environment's reward) and whether the episode is over. Every method may
be ``async``. Environments run in worker processes (:mod:`.env_host`), one instance per trajectory,
so an environment that blocks, hangs or crashes costs its own trajectories only.

Tools (``agent.tools``: Python functions, ``module:function``) are offered through
:class:`ToolEnvironment`: a turn with tool calls (in the syntax of the model's chat template,
:mod:`.tools`) gets the tools' answers as ``tool`` messages; a turn without one goes to the
environment (if the recipe names one) or ends the episode. A call that cannot be parsed or fails
is answered with the error, as the tool's answer, for the model to read: never raised.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from streamrl_cli.agent.tools import Tool, parse_tool_calls

Message = dict[str, Any]


@dataclass
class StepResult:
    """What an environment answers to a model turn."""

    observation: list[Message] = field(default_factory=list)  # appended before the next model turn
    reward: float = 0.0
    done: bool = False
    tool_calls: int = 0
    tool_errors: int = 0


def messages(observation: Any, *, role: str = "user") -> list[Message]:
    """An observation as chat messages: None → none, a string → one message of `role`, a dict →
    that message, a list → each of its items."""
    if observation is None:
        return []
    if isinstance(observation, str):
        return [{"role": role, "content": observation}]
    if isinstance(observation, Mapping):
        if "role" not in observation or "content" not in observation:
            raise TypeError(
                f"an observation message needs 'role' and 'content', got keys {sorted(observation)}"
            )
        return [dict(observation)]
    if isinstance(observation, Sequence):
        return [m for item in observation for m in messages(item, role=role)]
    raise TypeError(
        f"an observation must be None, a string, a message dict or a list, not {type(observation).__name__}"
    )


def step_result(out: Any) -> StepResult:
    """An environment's ``step`` return value, checked: a StepResult or (observation, reward, done)."""
    if isinstance(out, StepResult):
        return out
    if isinstance(out, tuple) and len(out) == 3:
        observation, reward, done = out
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            raise TypeError(f"step() returned reward {reward!r}; a number is needed")
        return StepResult(observation=messages(observation), reward=float(reward), done=bool(done))
    raise TypeError(
        f"step() returned {type(out).__name__}; return a StepResult or a tuple (observation, reward, done)"
    )


async def call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call a method that may be sync or async; sync ones in a thread, so one blocking environment
    does not stop the others of its process."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args, **kwargs)
    out = await asyncio.to_thread(fn, *args, **kwargs)
    if inspect.isawaitable(out):
        out = await out
    return out


class ToolEnvironment:
    """Tools answer the turns that call them; other turns go to `env` (or end the episode)."""

    def __init__(self, tools: Sequence[Tool], env: Any = None, *, tool_format: str | None = None):
        if tools and tool_format is None:
            raise ValueError("tools need a tool-call syntax to read their calls in (tool_format)")
        self.tools = {t.name: t for t in tools}
        self.env = env
        self.tool_format = tool_format

    async def reset(self, row: dict[str, Any]) -> list[Message]:
        if self.env is None:
            return []
        return messages(await call(self.env.reset, row))

    async def step(self, turn: str) -> StepResult:
        calls = parse_tool_calls(turn, self.tool_format) if self.tool_format and self.tools else []
        if not calls:
            if self.env is None:
                return StepResult(done=True)  # the answer: the task's reward scores it
            return step_result(await call(self.env.step, turn))
        answers, errors = [], 0
        for c in calls:
            content, ok = await self._answer(c)
            errors += not ok
            # The call's id too: templates that pair answers with calls need it (Mistral's insists).
            answers.append({"role": "tool", "name": c.name or "?", "content": content, "tool_call_id": c.id})
        return StepResult(observation=answers, tool_calls=len(calls), tool_errors=errors)

    async def _answer(self, c: Any) -> tuple[str, bool]:
        if c.error:
            return f"error: {c.error}", False
        tool = self.tools.get(c.name)
        if tool is None:
            return f"error: unknown tool {c.name!r}; tools: {', '.join(sorted(self.tools)) or 'none'}", False
        try:
            return str(await call(tool.fn, **c.arguments)), True
        except Exception as e:  # noqa: BLE001 - the model reads what went wrong
            return f"error: {type(e).__name__}: {e}", False

    async def close(self) -> None:
        close = getattr(self.env, "close", None)
        if close is not None:
            await call(close)
