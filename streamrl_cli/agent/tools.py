"""Tools: Python functions offered to the model, and the tool-call syntax of its chat template.

A tool is a plain (sync or async) function with type hints and a Google-style docstring; its JSON
schema is what ``transformers.utils.get_json_schema`` derives from them, the same schema a chat
template renders when it is given ``tools=``. The recipe names tools like rewards
(``agent.tools: [module:function, path/to/file.py:function]``).

Calls are read in the syntax the model's chat template defines. Supported: ``hermes``, the
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks of Qwen2/2.5/3, Hermes and
many others (the template mentions ``<tool_call>``). A block that is not valid JSON, or lacks a
name, becomes a call with an ``error``: the tool environment answers it with the error, so the
model learns from it and the run goes on.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from streamrl_cli.tasks import TaskError

FORMATS = ("hermes",)
_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@dataclass
class Tool:
    name: str
    fn: Callable[..., Any]
    schema: dict[str, Any]  # {"type": "function", "function": {name, description, parameters}}


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str = ""  # why the call could not be read ("" if it could)


def make_tool(fn: Callable[..., Any], spec: str = "") -> Tool:
    """A tool from a function; its schema from the type hints and docstring (what chat templates render)."""
    from transformers.utils import get_json_schema
    from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

    if not callable(fn):
        raise TaskError(f"agent.tools: {spec or fn!r} is a {type(fn).__name__}, not a function")
    try:
        schema = get_json_schema(fn)
    except (DocstringParsingException, TypeHintParsingException, ValueError) as e:
        raise TaskError(
            f"agent.tools: {spec or fn.__name__}: no JSON schema can be derived ({e}); a tool needs type "
            "hints on every argument and a docstring with an Args: section describing each"
        ) from None
    return Tool(name=schema["function"]["name"], fn=fn, schema=schema)


def load_tool(spec: str) -> Tool:
    from streamrl_cli.tasks.rewards import load_object

    fn = load_object(spec, "agent.tools", kind="function", example="my_tools.py:calculator")
    return make_tool(fn, spec)


def template_format(chat_template: str | None) -> str | None:
    """The tool-call syntax a chat template defines (None: none that is supported)."""
    if chat_template and "<tool_call>" in chat_template:
        return "hermes"
    return None


def parse_tool_calls(text: str, fmt: str = "hermes") -> list[ToolCall]:
    """The tool calls in a model turn (none: the turn is an answer, not a call)."""
    if fmt != "hermes":
        raise ValueError(f"unknown tool-call format {fmt!r} (valid: {', '.join(FORMATS)})")
    calls = []
    for body in _HERMES.findall(text):
        try:
            data = json.loads(body.strip())
        except json.JSONDecodeError as e:
            calls.append(ToolCall(name="", error=f"the tool call is not valid JSON ({e.msg} at {e.pos})"))
            continue
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            calls.append(ToolCall(name="", error='a tool call needs {"name": ..., "arguments": {...}}'))
            continue
        args = data.get("arguments", {})
        if isinstance(args, str):  # some models send the arguments JSON-encoded
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            calls.append(ToolCall(name=data["name"], error="the tool call's arguments must be a JSON object"))
            continue
        calls.append(ToolCall(name=data["name"], arguments=args))
    return calls
