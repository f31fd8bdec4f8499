"""Tools: Python functions offered to the model, and the tool-call syntax of its chat template.

A tool is a plain (sync or async) function with type hints and a Google-style docstring; its JSON
schema is what ``transformers.utils.get_json_schema`` derives from them, the same schema a chat
template renders when it is given ``tools=``. The recipe names tools like rewards
(``agent.tools: [module:function, path/to/file.py:function]``).

Calls are read in the syntax the model's chat template defines (``agent.tool_format`` overrides
the detection):

* ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Qwen2/2.5/3,
  Hermes and many others; the template mentions ``<tool_call>``);
* ``llama3_json``: a turn that is a JSON object ``{"name": ..., "parameters": {...}}``, possibly
  after ``<|python_tag|>``, several separated by ``;`` (Llama 3.1/3.2/3.3; the template has an
  ``ipython`` role or ``<|python_tag|>``);
* ``mistral``: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}, "id": ...}, ...]`` (Mistral 7B v0.3,
  Nemo, Small) or ``[TOOL_CALLS]name[ARGS]{...}`` (newer Mistral tokenizers); their answers carry
  the call's 9-character id, which the template requires;
* ``qwen3_coder``: ``<tool_call><function=NAME><parameter=P>value</parameter></function></tool_call>``
  (Qwen3-Coder); a value is taken as JSON where it reads as JSON (``3``, ``true``, ``[1]``), else
  as text.

A call that cannot be read (not valid JSON, no name, cut off at the turn's budget) becomes a call
with an ``error``: the tool environment answers it with the error, so the model learns from it and
the run goes on.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from streamrl_cli.recipe.schema import AGENT_TOOL_FORMATS
from streamrl_cli.tasks import TaskError

FORMATS = AGENT_TOOL_FORMATS
# What each looks like, for error messages (the formats a template or agent.tool_format may name).
SYNTAXES = {
    "hermes": '<tool_call>{"name": ..., "arguments": {...}}</tool_call> (Qwen2/2.5/3, Hermes)',
    "llama3_json": '{"name": ..., "parameters": {...}}, <|python_tag|> optional (Llama 3.1/3.2/3.3)',
    "mistral": '[TOOL_CALLS] [{"name": ..., "arguments": {...}}] (Mistral)',
    "qwen3_coder": "<tool_call><function=NAME><parameter=P>value</parameter></function></tool_call> "
    "(Qwen3-Coder)",
}
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(</parameter>|$)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"
_MISTRAL_TAG = "[TOOL_CALLS]"
_ID_CHARS = re.compile(r"[A-Za-z0-9]{9}")


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
    id: str = ""  # the call's id, which its answer names (9 letters or digits: Mistral's rule)


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
    """The tool-call syntax a chat template defines (None: none that is supported). Checked from
    the most specific mark: Qwen3-Coder's templates also mention ``<tool_call>``."""
    t = chat_template or ""
    if "<function=" in t and "<parameter=" in t:
        return "qwen3_coder"
    if _MISTRAL_TAG in t:
        return "mistral"
    if (
        _PYTHON_TAG in t
        or "<|start_header_id|>ipython" in t
        or ("<|start_header_id|>" in t and '"parameters"' in t)
    ):
        return "llama3_json"
    if "<tool_call>" in t:
        return "hermes"
    return None


def unreadable(where: str) -> str:
    """The error for a template with no tool-call syntax StreamRL reads: what would be valid."""
    valid = "; ".join(f"{name}: {SYNTAXES[name]}" for name in FORMATS)
    return (
        f"agent.tools: {where} defines no tool-call syntax StreamRL reads (valid: {valid}); use a model "
        "whose template defines one, or set agent.tool_format to the syntax the model writes"
    )


def parse_tool_calls(text: str, fmt: str = "hermes") -> list[ToolCall]:
    """The tool calls in a model turn (none: the turn is an answer, not a call)."""
    parser = _PARSERS.get(fmt)
    if parser is None:
        raise ValueError(f"unknown tool-call format {fmt!r} (valid: {', '.join(FORMATS)})")
    calls = parser(text)
    for k, c in enumerate(calls):  # every answer names its call; Mistral's template insists on 9 characters
        if not _ID_CHARS.fullmatch(c.id):
            c.id = f"call{k:05d}"
    return calls


def _call(data: Any, args_keys: tuple[str, ...] = ("arguments",)) -> ToolCall:
    """A call from its decoded JSON object, checked."""
    shape = '{"name": ..., "' + args_keys[0] + '": {...}}'
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return ToolCall(name="", error=f"a tool call needs {shape}")
    key = next((k for k in args_keys if k in data), args_keys[0])
    args = data.get(key, {})
    if isinstance(args, str):  # some models send the arguments JSON-encoded
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    call_id = data.get("id") if isinstance(data.get("id"), str) else ""
    if not isinstance(args, dict):
        return ToolCall(name=data["name"], error=f"the tool call's {key} must be a JSON object", id=call_id)
    return ToolCall(name=data["name"], arguments=args, id=call_id)


def _not_json(e: json.JSONDecodeError) -> ToolCall:
    return ToolCall(name="", error=f"the tool call is not valid JSON ({e.msg} at {e.pos})")


def _hermes(text: str) -> list[ToolCall]:
    calls = []
    for body in _BLOCK.findall(text):
        try:
            calls.append(_call(json.loads(body.strip())))
        except json.JSONDecodeError as e:
            calls.append(_not_json(e))
    return calls


def _json_objects(text: str, args_keys: tuple[str, ...]) -> list[ToolCall]:
    """Calls written as JSON values one after another (objects, or lists of them), apart by ``;``,
    commas or spaces; what follows the last one that is not JSON is prose and is left alone."""
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while pos < len(text) and text[pos] in "[{":
        try:
            value, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            calls.append(_not_json(e))
            break
        for item in value if isinstance(value, list) else [value]:
            calls.append(_call(item, args_keys))
        while pos < len(text) and text[pos] in " \t\r\n;,":
            pos += 1
    return calls


def _llama3_json(text: str) -> list[ToolCall]:
    s = text.strip()
    if s.startswith(_PYTHON_TAG):
        s = s[len(_PYTHON_TAG) :].lstrip()
        if not s.startswith("{"):
            return [ToolCall(name="", error='a tool call needs {"name": ..., "parameters": {...}}')]
    elif not re.match(r'\{\s*"name"', s):
        return []  # an answer, not a call
    return _json_objects(s, ("parameters", "arguments"))


def _mistral(text: str) -> list[ToolCall]:
    if _MISTRAL_TAG not in text:
        return []
    calls = []
    for part in text.split(_MISTRAL_TAG)[1:]:
        s = part.strip()
        name, sep, args = s.partition("[ARGS]")
        if sep and not name.lstrip().startswith(("[", "{")):  # [TOOL_CALLS]name[ARGS]{...}
            try:
                value, _ = json.JSONDecoder().raw_decode(args.strip())
            except json.JSONDecodeError as e:
                calls.append(_not_json(e))
                continue
            calls.append(_call({"name": name.strip(), "arguments": value}))
        elif s.startswith(("[", "{")):
            calls += _json_objects(s, ("arguments", "parameters"))
        else:
            calls.append(
                ToolCall(name="", error='a tool call needs [TOOL_CALLS] [{"name": ..., "arguments": {...}}]')
            )
    return calls


def _qwen3_coder(text: str) -> list[ToolCall]:
    calls = []
    for body in _BLOCK.findall(text):
        m = _FUNCTION.match(body)
        if m is None:
            calls.append(ToolCall(name="", error="a tool call needs <function=NAME> inside <tool_call>"))
            continue
        name, rest = m.group(1).strip(), m.group(2)
        if "</function>" not in rest:
            calls.append(ToolCall(name=name, error="the tool call is cut off (no </function>)"))
            continue
        args: dict[str, Any] = {}
        error = ""
        for key, value, closed in _PARAMETER.findall(rest[: rest.index("</function>")]):
            if not closed:
                error = f"the parameter {key.strip()!r} is cut off (no </parameter>)"
                break
            args[key.strip()] = _value(value)
        calls.append(ToolCall(name=name, error=error) if error else ToolCall(name=name, arguments=args))
    return calls


def _value(text: str) -> Any:
    """A parameter's value: JSON where it reads as JSON, else the text (one newline each side,
    which the template puts there, removed)."""
    text = text.removeprefix("\n").removesuffix("\n")
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


_PARSERS = {"hermes": _hermes, "llama3_json": _llama3_json, "mistral": _mistral, "qwen3_coder": _qwen3_coder}
