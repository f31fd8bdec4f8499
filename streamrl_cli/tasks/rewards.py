"""Reward functions: the batched interface, loading one by name, and the rule-based verifiers shipped.

A reward function is ``fn(prompts: list[Prompt], completions: list[str]) -> list[float]``. It is
batched because real verifiers (a reward model, a sandbox running code) are far cheaper per batch
than per sample. A recipe names one as ``module:function``; :func:`load_reward` imports it and
wraps it so that a function returning the wrong thing fails with its own name in the message
rather than deep in the trainer.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

from streamrl_cli.tasks import Prompt, TaskError

RewardFn = Callable[[Sequence[Prompt], Sequence[str]], list[float]]

_NUMBER = r"[-+]?(?:\d[\d,]*)?\.?\d+(?:[eE][-+]?\d+)?"


def load_reward(spec: str) -> RewardFn:
    """The reward function named ``module:function`` (e.g. ``streamrl_cli.tasks.rewards:math_answer``)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr or ":" in attr:
        raise TaskError(
            f"task.reward: {spec!r} is not `module:function` "
            "(e.g. streamrl_cli.tasks.rewards:exact_match or mypkg.verify:score)"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise TaskError(
            f"task.reward: cannot import module {module_name!r} of {spec!r}: {e} "
            "(is it installed, or on PYTHONPATH on every node?)"
        ) from e
    fn: Any = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            public = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n)))
            raise TaskError(
                f"task.reward: module {module_name!r} has no attribute {attr!r}; "
                f"callables there: {', '.join(public) or 'none'}"
            )
        fn = getattr(fn, part)
    if not callable(fn):
        raise TaskError(f"task.reward: {spec!r} is a {type(fn).__name__}, not a function")
    return checked(fn, spec)


def checked(fn: Callable[..., Any], name: str | None = None) -> RewardFn:
    """``fn`` wrapped to check it returns one finite float per completion."""
    label = name or getattr(fn, "__qualname__", repr(fn))

    def reward(prompts: Sequence[Prompt], completions: Sequence[str]) -> list[float]:
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
        out = fn(list(prompts), list(completions))
        try:
            values = [float(v) for v in out]
        except (TypeError, ValueError) as e:
            raise TaskError(
                f"reward function {label} must return a list of floats, got {type(out).__name__}: {e}"
            ) from e
        if len(values) != len(completions):
            raise TaskError(
                f"reward function {label} returned {len(values)} values for {len(completions)} completions "
                "(it must return one float per completion)"
            )
        bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
        if bad:
            raise TaskError(f"reward function {label} returned non-finite values at positions {bad[:5]}")
        return values

    reward.__qualname__ = reward.__name__ = f"checked({label})"
    return reward


def exact_match(prompts: Sequence[Prompt], completions: Sequence[str]) -> list[float]:
    """1.0 where the stripped completion equals the (stringified, stripped) answer."""
    return [
        float(p.answer is not None and c.strip() == str(p.answer).strip())
        for p, c in zip(prompts, completions, strict=True)
    ]


def extract_answer(text: str) -> str | None:
    r"""The final answer of a solution: the last ``\boxed{...}``, else the last number after
    ``Answer:``, else the last number in the text (None if there is none)."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    idx = text.rfind("Answer:")
    if idx >= 0:
        numbers = re.findall(_NUMBER, text[idx + len("Answer:") :])
        if numbers:
            return numbers[-1]
    numbers = re.findall(_NUMBER, text)
    return numbers[-1] if numbers else None


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None  # unbalanced: no answer


def _to_number(s: Any) -> float | None:
    if isinstance(s, int | float) and not isinstance(s, bool):
        return float(s)
    if not isinstance(s, str):
        return None
    s = s.strip().replace(",", "").replace("$", "").rstrip(".")
    m = re.fullmatch(r"([-+]?\d+)\s*/\s*(\d+)", s)  # a plain fraction such as 3/4
    if m and int(m.group(2)):
        return int(m.group(1)) / int(m.group(2))
    m = re.fullmatch(r"\\[dt]?frac\{([-+]?\d+)\}\{(\d+)\}", s)
    if m and int(m.group(2)):
        return int(m.group(1)) / int(m.group(2))
    try:
        return float(s)
    except ValueError:
        return None


def math_answer(prompts: Sequence[Prompt], completions: Sequence[str]) -> list[float]:
    """1.0 where the completion's final answer equals the prompt's answer numerically, else 0.0."""
    out = []
    for p, c in zip(prompts, completions, strict=True):
        got, want = _to_number(extract_answer(c)), _to_number(p.answer)
        ok = got is not None and want is not None and math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9)
        out.append(float(ok))
    return out


def repeat_verifier(prompts: Sequence[Prompt], completions: Sequence[str]) -> list[float]:
    """The built-in repeat task's graded verifier (see :func:`streamrl_cli.tasks.builtin.repeat_score`)."""
    from streamrl_cli.tasks.builtin import repeat_score

    return [repeat_score(p.answer, c) for p, c in zip(prompts, completions, strict=True)]
