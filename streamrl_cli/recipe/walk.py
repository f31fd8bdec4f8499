"""Check a plain (composed) config tree against the dataclass schema, reporting every problem.

OmegaConf would raise on the first bad key; this walk goes through the whole tree and reports
unknown keys with the closest valid name, wrong types, values outside a field's choices and
required values left as ``???``. It accepts what OmegaConf would convert (``"3"`` for an int).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Callable
from typing import Any

Report = Callable[[str, str], None]

INT_MIN, INT_MAX = -(2**63), 2**63 - 1  # every integer of a recipe fits in 64 bits
_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def walk(value: Any, typ: Any, path: str, report: Report) -> None:
    """Report every mismatch between ``value`` and the annotation ``typ`` below ``path``."""
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if value is None:
            return
        walk(value, args[0], path, report)
        return
    if value == "???":
        report(path, "missing required value (set it in the recipe or as `key=value` on the command line)")
        return
    if dataclasses.is_dataclass(typ):
        _walk_dataclass(value, typ, path, report)
    elif origin is dict:
        if not isinstance(value, dict):
            report(path, f"expected a mapping of names to values, got {_show(value)}")
            return
        _, item_type = typing.get_args(typ)
        for k, v in value.items():
            walk(v, item_type, _join(path, str(k)), report)
    elif origin is list:
        if not isinstance(value, list):
            report(path, f"expected a list, got {_show(value)}")
            return
        (item_type,) = typing.get_args(typ)
        for i, v in enumerate(value):
            walk(v, item_type, f"{path}[{i}]", report)
    elif typ in _TYPE_NAMES and not _scalar_ok(value, typ):
        report(path, f"expected {_TYPE_NAMES[typ]}, got {_show(value)}")
    elif typ is str and "\x00" in str(value):
        # No path, name or argument can hold one (the OS ends a C string there).
        report(path, f"contains a NUL character: {_show(value)}")
    elif typ is int and not INT_MIN <= int(value) <= INT_MAX:
        report(path, f"{_show(value)} is out of range: a recipe's integers are at most 2**63 - 1 in size")
    elif typ is float and not math.isfinite(float(value)):
        # nan passes every comparison a later check would make; inf overflows the first update.
        report(path, f"expected a finite number, got {_show(value)}")


def _walk_dataclass(value: Any, typ: type, path: str, report: Report) -> None:
    if not isinstance(value, dict):
        report(
            path or "<root>",
            f"expected a mapping with keys {', '.join(_field_names(typ))}, got {_show(value)}",
        )
        return
    hints = typing.get_type_hints(typ)
    fields = {f.name: f for f in dataclasses.fields(typ)}
    for key, v in value.items():
        sub = _join(path, str(key))
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.5)
            hint = f"did you mean {_join(path, close[0])!r}? " if close else ""
            report(sub, f"unknown key; {hint}valid keys here: {', '.join(fields)}")
            continue
        walk(v, hints[key], sub, report)
        bound = fields[key].metadata.get("max")
        if bound is not None and _over(v, bound):
            report(sub, f"{_show(v)} is above this key's bound of {bound:,} (past what the largest clusters, "
                   "models and runs need); use a smaller value")  # fmt: skip
        allowed = fields[key].metadata.get("choices")
        if allowed and isinstance(v, str) and v != "???" and v not in allowed:
            close = difflib.get_close_matches(v, allowed, n=1, cutoff=0.5)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            report(sub, f"{v!r} is not one of {', '.join(allowed)}{hint}")
    for name, f in fields.items():
        if name not in value and f.default == "???":
            report(_join(path, name), "missing required value")


def _scalar_ok(value: Any, typ: type) -> bool:
    if typ is bool:
        return isinstance(value, bool) or (isinstance(value, str) and value.lower() in ("true", "false"))
    if isinstance(value, bool) or isinstance(value, (dict, list)) or value is None:
        return False
    if typ is str:
        return True
    try:
        typ(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: int(1e400), an infinity
        return False
    return not (typ is int and isinstance(value, float) and not value.is_integer())


def _over(value: Any, bound: float) -> bool:
    """Whether a number (or its string form) is above ``bound``; other values are the type check's."""
    if isinstance(value, bool) or value is None:
        return False
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        return False
    return math.isfinite(number) and number > bound  # an infinity is the type check's to name


def _field_names(typ: type) -> list[str]:
    return [f.name for f in dataclasses.fields(typ)]


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
