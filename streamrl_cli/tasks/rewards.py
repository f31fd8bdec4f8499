"""Reward functions: TRL's calling convention, loading one by name or file, the verifiers shipped.

A reward function is called on a batch, the way TRL (and, in spirit, verl and OpenRLHF) call it::

    def reward(prompts: list[str], completions: list[str], **columns) -> list[float | None]

Every argument is passed by keyword, as TRL passes them, so ``def reward(completions, solution,
**kwargs)`` works too. ``prompts`` are the prompts as the policy saw them (chat template applied,
if any); ``completions`` the generated text without the prompt or EOS; ``columns`` every other
field of the dataset, one list per field aligned with the batch (a field a record lacks is ``None``
there). So a reward written for TRL's ``GRPOTrainer`` works unchanged. It is batched because real
verifiers (a reward model, a sandbox running code) are far cheaper per batch than per sample.

- ``async def`` rewards are awaited (a reward calling a remote judge can overlap its requests).
- ``None`` for a completion means "cannot score this one" (TRL's convention): the trainer does not
  learn from that sample (``trainer.loop``) and counts it in the ``reward/unscored`` metric.
- A recipe names a function as ``module:function`` (importable) or ``path/to/file.py:function``
  (loaded from the file; no ``PYTHONPATH`` needed, and the file's directory becomes importable so it
  can import its neighbours). Relative file paths are resolved against the directory ``streamrl``
  is started in, when the recipe is loaded (``recipe.paths``), so role processes and SLURM jobs get
  an absolute path.

:class:`Reward` wraps the function so that a wrong signature or a wrong return value fails with the
function's name and what would be valid, not deep in the trainer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import importlib
import importlib.util
import inspect
import math
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from streamrl_cli.tasks import TaskError

if TYPE_CHECKING:
    from streamrl_cli.tasks import Prompt

_NUMBER = r"[-+]?(?:\d[\d,]*)?\.?\d+(?:[eE][-+]?\d+)?"


class Reward:
    """A user's reward function, called in TRL's convention with a task's prompts and their columns."""

    def __init__(self, fn: Callable[..., Any], name: str | None = None):
        if not callable(fn):
            raise TaskError(f"task.reward: {name or fn!r} is a {type(fn).__name__}, not a function")
        self.fn = fn
        self.name = name or getattr(fn, "__qualname__", repr(fn))

    def check_columns(self, columns: Iterable[str]) -> None:
        """Fail now (not at the first scored group) if the function needs a column the data lacks."""
        names = sorted(set(columns))
        clash = sorted({"prompts", "completions"} & set(names))
        if clash:
            raise TaskError(
                f"task.reward: the dataset has a field named {clash[0]!r}, which is also the reward's own "
                "argument; rename that field"
            )
        try:
            sig = inspect.signature(self.fn)
        except (TypeError, ValueError):  # a builtin or C callable: nothing to check against
            return
        try:
            sig.bind(prompts=[], completions=[], **dict.fromkeys(names, []))
        except TypeError as e:
            raise TaskError(
                f"task.reward: {self.name} cannot be called as reward(prompts=, completions=, **columns) "
                f"with this dataset's columns ({', '.join(names) or 'none'}): {e}. "
                "Every field of a record except the prompt reaches the function as a keyword argument; "
                "accept **kwargs to ignore the ones it does not use"
            ) from None

    def __call__(self, prompts: Sequence[Prompt], completions: Sequence[str]) -> list[float | None]:
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
        keys = sorted({k for p in prompts for k in p.columns})
        columns = {k: [p.columns.get(k) for p in prompts] for k in keys}
        # By keyword, as TRL calls it: `def reward(completions, solution, **kwargs)` is common there.
        out = self.fn(prompts=[p.text for p in prompts], completions=list(completions), **columns)
        if inspect.isawaitable(out):
            out = _wait(out)
        return self._values(out, len(completions))

    def _values(self, out: Any, n: int) -> list[float | None]:
        if isinstance(out, str | bytes) or not isinstance(out, Iterable):
            raise TaskError(
                f"reward function {self.name} must return a list of floats (or None for "
                f"'cannot score'), got {type(out).__name__}"
            )
        values: list[float | None] = []
        for i, v in enumerate(out):
            if v is None:
                values.append(None)
                continue
            try:
                x = float(v)
            except (TypeError, ValueError):
                raise TaskError(
                    f"reward function {self.name} returned {v!r} at position {i}: "
                    "expected a float (or None for 'cannot score')"
                ) from None
            if not math.isfinite(x):
                raise TaskError(
                    f"reward function {self.name} returned {x} at position {i}; "
                    "return None for a completion it cannot score"
                )
            values.append(x)
        if len(values) != n:
            raise TaskError(
                f"reward function {self.name} returned {len(values)} values for {n} completions "
                "(it must return one float, or None, per completion)"
            )
        return values


def _wait(awaitable: Any) -> Any:
    """The result of an async reward, whether or not this thread already runs an event loop."""

    async def run() -> Any:
        return await awaitable

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(run())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # cannot nest loops: use a fresh thread's
        return pool.submit(asyncio.run, run()).result()


def load_reward(spec: str) -> Reward:
    """The reward named ``module:function`` or ``path/to/file.py:function``."""
    fn = load_object(
        spec, "task.reward", kind="function",
        example="streamrl_cli.tasks.rewards:math_answer or rewards/my_reward.py:score",
    )  # fmt: skip
    if not callable(fn):
        raise TaskError(f"task.reward: {spec!r} is a {type(fn).__name__}, not a function")
    return Reward(fn, spec)


def load_object(spec: str, key: str, *, kind: str = "name", example: str) -> Any:
    """What ``module:attr`` or ``path/to/file.py:attr`` names (a reward, an environment class, a tool);
    `key` is the recipe key it came from, named in the errors with an `example` of a valid value."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr or not re.fullmatch(r"[A-Za-z_][\w.]*", attr):
        raise TaskError(
            f"{key}: {spec!r} is not `module:{kind}` or `path/to/file.py:{kind}` (e.g. {example})"
        )
    module = _load_file(target, spec, key) if _is_file(target) else _import(target, spec, key)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n)))
            raise TaskError(
                f"{key}: {target!r} has no attribute {attr!r}; callables there: {', '.join(public) or 'none'}"
            )
        obj = getattr(obj, part)
    return obj


def _is_file(target: str) -> bool:
    return target.endswith(".py") or "/" in target or "\\" in target


def _import(module_name: str, spec: str, key: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ImportError as e:
        raise TaskError(
            f"{key}: cannot import module {module_name!r} of {spec!r}: {e} "
            "(is it installed on every node? A file can be named directly: path/to/file.py:name)"
        ) from e


def _load_file(target: str, spec: str, key: str) -> Any:
    path = Path(target).expanduser()
    if not path.is_file():
        raise TaskError(f"{key}: {spec!r}: no such file {str(path)!r}")
    path = path.resolve()
    # One module per file (by its absolute path), so two rewards named score.py do not collide.
    name = f"streamrl_reward_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))  # the file's own helper modules next to it
    loader_spec = importlib.util.spec_from_file_location(name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise TaskError(f"{key}: {spec!r}: {path} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module
    try:
        loader_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise TaskError(f"{key}: loading {path} failed: {type(e).__name__}: {e}") from e
    return module


# -- the verifiers shipped: TRL-style, reading the dataset's `answer` column ---------------------


def exact_match(prompts: list[str], completions: list[str], answer: list[Any], **_: Any) -> list[float]:
    """1.0 where the stripped completion equals the (stringified, stripped) ``answer`` column."""
    return [
        float(a is not None and c.strip() == str(a).strip()) for c, a in zip(completions, answer, strict=True)
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


def math_answer(prompts: list[str], completions: list[str], answer: list[Any], **_: Any) -> list[float]:
    """1.0 where the completion's final answer equals the ``answer`` column numerically, else 0.0."""
    out = []
    for c, a in zip(completions, answer, strict=True):
        got, want = _to_number(extract_answer(c)), _to_number(a)
        ok = got is not None and want is not None and math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9)
        out.append(float(ok))
    return out


EOS_TEXT = "<|endoftext|>"  # the tiny tokenizer's EOS, in case a caller decodes it into the text


def repeat_score(answer: Mapping[str, Any], completion: str, tolerance: float = 0.25) -> float:
    """Reward in [0, 1]: (share of output words equal to the word) × exp(-|words - count| / scale),
    scale = max(1, tolerance × count). 1.0 only for exactly ``count`` copies of the word."""
    word, count = answer["word"], int(answer["count"])
    words = completion.split(EOS_TEXT, 1)[0].split()  # text after an (undecoded) EOS is not output
    if not words:
        return 0.0
    share = sum(w == word for w in words) / len(words)
    scale = max(1.0, tolerance * count)
    return share * math.exp(-abs(len(words) - count) / scale)


def repeat_verifier(
    prompts: list[str], completions: list[str], word: list[str], count: list[int], **_: Any
) -> list[float]:
    """The built-in repeat task's verifier as a recipe's ``task.reward`` (:func:`repeat_score`)."""
    return [
        repeat_score({"word": w, "count": n}, c) for c, w, n in zip(completions, word, count, strict=True)
    ]
