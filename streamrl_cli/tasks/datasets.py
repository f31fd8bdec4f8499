"""Prompts from a file: JSONL, Parquet, or a Hugging Face ``datasets`` directory (``save_to_disk``).

A user's dataset is the most likely thing to be wrong in a run, and the least pleasant place to
find out is a trainer that has waited an hour in the queue. Everything is read and checked when
the task is made, and a bad record is reported with its line (or row) number and the fields it
does have. Parquet needs ``pyarrow`` and a ``save_to_disk`` directory the ``datasets`` package;
both are imported only when such a dataset is read.

The prompt field (``task.prompt_key``) holds either the prompt text or a chat: a list of
``{"role", "content"}`` messages, as in TRL's conversational datasets. A chat is rendered through
the tokenizer's own chat template (``apply_chat_template(..., add_generation_prompt=True)``), so
the policy sees exactly the format it was instruction-tuned on. :class:`ChatFormat` says when and
with which template; every other field of a record becomes a reward column.

How many tokens a prompt is, is one definition here (:func:`prompt_ids`): the trainer counts with it,
and so does the check before submission (:func:`long_prompts`, in batches), so that a prompt found
too long for ``task.max_prompt_len`` there is the one the trainer would refuse, by its row.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from streamrl_cli.tasks import Prompt, Task, TaskError
from streamrl_cli.tasks.rewards import Reward, load_reward

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")
TOKENIZER_TEMPLATE = "tokenizer"  # task.chat_template: the tokenizer's own template for every prompt
# Prompts per batched tokenizer call: large enough that the Rust tokenizer spreads a batch over every
# core, small enough that a batch's ids (Python lists) stay a few MB.
TOKENIZE_CHUNK = 4096


@dataclass(kw_only=True)
class ChatFormat:
    """How prompts become the policy's input text (the recipe's task.chat_template, task.system_prompt).

    - ``template`` null: text prompts are used as they are; chat prompts (message lists) go through
      the tokenizer's own template;
    - ``"tokenizer"``: every prompt goes through the tokenizer's own template (a text prompt
      becomes one user message);
    - any other string: a Jinja chat template (inline, or the path of a ``.jinja`` file) used instead
      of the tokenizer's, for every prompt.

    ``system_prompt``: a system message put first in every rendered chat that has none of its own.
    """

    template: str | None = None
    system_prompt: str | None = None
    model_path: str | None = None  # the tokenizer's directory (the policy's model.path)
    tokenizer: Any = None  # a loaded tokenizer (tests, or a caller that has one): wins over model_path
    # End with the assistant's generation prompt (single-turn). A multi-turn run's generator adds it
    # itself, after what the environment adds at its reset (streamrl_cli.agent.render).
    generation_prompt: bool = True

    def applies_to_text(self) -> bool:
        return self.template is not None

    def render(self, messages: list[dict[str, Any]]) -> str:
        if self.system_prompt and not (messages and messages[0].get("role") == "system"):
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        tok = self.load_tokenizer()
        template = None if self.template in (None, TOKENIZER_TEMPLATE) else self._template_text()
        if template is None and not getattr(tok, "chat_template", None):
            raise TaskError(
                f"task.chat_template: the tokenizer of {self.model_path or 'the model'} has no chat "
                "template; set task.chat_template to a Jinja template (inline or a .jinja file)"
            )
        try:
            return tok.apply_chat_template(
                messages, chat_template=template, tokenize=False, add_generation_prompt=self.generation_prompt
            )
        except Exception as e:  # jinja2's TemplateError family, or a template that raises on this chat
            raise TaskError(f"task.chat_template: rendering {messages!r:.200} failed: {e}") from e

    def _template_text(self) -> str:
        assert self.template is not None
        if self.template.endswith(".jinja"):
            path = Path(self.template).expanduser()
            if not path.is_file():
                raise TaskError(f"task.chat_template: no such file {self.template!r}")
            return path.read_text(encoding="utf-8")
        return self.template

    def load_tokenizer(self) -> Any:
        """The tokenizer (``tokenizer``, else loaded from ``model_path`` once, as the trainer loads it)."""
        if self.tokenizer is None:
            if self.model_path is None:
                raise TaskError(
                    "task.chat_template: rendering chats needs the model's tokenizer (model.path)"
                )
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(os.path.expanduser(self.model_path))
        return self.tokenizer


class DatasetTask(Task):
    """Prompts of a dataset, scored by ``reward`` (a function, or a ``module:function`` /
    ``file.py:function`` name) called with the records' other fields as columns.

    ``prompt_id`` is the record's ``id`` field where present, else ``<dataset stem>/<index>`` with the
    0-based line (JSONL) or row index; ``rows`` holds that index for every prompt, in order.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        prompt_key: str = "prompt",
        reward: Reward | Any = None,
        name: str | None = None,
        chat: ChatFormat | None = None,
    ):
        self.path = Path(path).expanduser()
        if reward is None:
            raise TaskError(
                f"task.reward: the dataset {self.path} needs a reward function "
                "(module:function or file.py:function)"
            )
        if isinstance(reward, str):
            reward = load_reward(reward)
        self._reward = reward if isinstance(reward, Reward) else Reward(reward)
        self.name = name or self.path.stem
        self.chat = chat or ChatFormat()
        loaded = _load(self.path, prompt_key, self.chat)
        self._prompts = tuple(p for _, p in loaded)
        self.rows = tuple(index for index, _ in loaded)  # each prompt's 0-based line or row in the file
        if not self._prompts:
            raise TaskError(f"task.dataset: {self.path} holds no prompts")
        self._reward.check_columns({k for p in self._prompts for k in p.columns})

    def prompts(self) -> Sequence[Prompt]:
        return self._prompts

    def reward(self, prompts: Sequence[Prompt], completions: Sequence[str]) -> list[float | None]:
        return self._reward(prompts, completions)


def _records(path: Path) -> tuple[Iterator[tuple[int, dict[str, Any]]], str]:
    if path.is_dir():
        return _saved(path), "row"
    if not path.is_file():
        raise TaskError(f"task.dataset: {path} does not exist")
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return _jsonl(path), "line"
    if suffix in PARQUET_SUFFIXES:
        return _parquet(path), "row"
    valid = ", ".join(JSONL_SUFFIXES + PARQUET_SUFFIXES)
    raise TaskError(
        f"task.dataset: {path} has an unknown file type {suffix!r} "
        f"(valid: {valid}, or a directory written by datasets' save_to_disk)"
    )


def prompt_ids(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    """The token ids of prompts as the policy is given them: the model's tokenizer, adding no special
    tokens (a chat template writes its own, a text prompt is used as it is). The trainer tokenizes
    every prompt with this, and the check before submission counts with it."""
    return tokenizer(list(texts), add_special_tokens=False, return_attention_mask=False)["input_ids"]


def long_prompts(
    texts: Sequence[str], tokenizer: Any, limit: int, chunk: int = TOKENIZE_CHUNK
) -> list[tuple[int, int]]:
    """``(position, tokens)`` of every text of more than ``limit`` tokens (:func:`prompt_ids`'s count),
    tokenized in batches: a fast tokenizer encodes a batch in Rust on every core, where one call per
    prompt pays Python's overhead each time (bench/dataset_check.py)."""
    found = []
    for start in range(0, len(texts), chunk):
        for i, ids in enumerate(prompt_ids(tokenizer, texts[start : start + chunk]), start):
            if len(ids) > limit:
                found.append((i, len(ids)))
    return found


def _load(path: Path, prompt_key: str, chat: ChatFormat) -> list[tuple[int, Prompt]]:
    records, where = _records(path)
    prompts: list[tuple[int, Prompt]] = []
    seen: dict[str, int] = {}
    for index, record in records:
        at = f"{path}, {where} {index + 1}"
        if prompt_key not in record:
            keys = ", ".join(map(str, record)) or "none"
            raise TaskError(f"task.prompt_key: {at} has no field {prompt_key!r} (fields there: {keys})")
        text = _prompt_text(record[prompt_key], chat, f"{at}: field {prompt_key!r}")
        raw_id = record.get("id")
        prompt_id = str(raw_id) if raw_id is not None else f"{path.stem}/{index:05d}"
        if prompt_id in seen:
            raise TaskError(f"{at}: id {prompt_id!r} already used at {where} {seen[prompt_id] + 1}")
        seen[prompt_id] = index
        columns = {k: v for k, v in record.items() if k != prompt_key}
        prompts.append((index, Prompt(prompt_id, text, columns)))
    return prompts


def _prompt_text(value: Any, chat: ChatFormat, at: str) -> str:
    if isinstance(value, str):
        if chat.applies_to_text():
            return chat.render([{"role": "user", "content": value}])
        if chat.system_prompt:
            raise TaskError(
                f"task.system_prompt: {at} is text, which is used as it is without a chat template; "
                "set task.chat_template=tokenizer (the model's own) to give it a system message"
            )
        return value
    if not isinstance(value, list) or not value:
        raise TaskError(
            f"{at} must be a string or a non-empty list of chat messages, got {type(value).__name__}"
        )
    for m in value:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise TaskError(f'{at}: every message must be {{"role": ..., "content": ...}}, got {m!r:.120}')
    if value[-1]["role"] == "assistant":
        raise TaskError(
            f"{at}: the chat ends with an assistant message; an RL prompt ends with the turn the "
            "policy answers (drop the reference answer from the chat, keep it in another field)"
        )
    return chat.render(value)


def _jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with path.open(encoding="utf-8") as f:
        for index, line in enumerate(f):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskError(f"task.dataset: {path}, line {index + 1} is not valid JSON: {e}") from e
            if not isinstance(record, dict):
                raise TaskError(
                    f"task.dataset: {path}, line {index + 1} is a JSON {type(record).__name__}, "
                    "not an object (one {...} per line)"
                )
            yield index, record


def _parquet(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    pq = _import_parquet()
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises its own ArrowInvalid/OSError family
        raise TaskError(f"task.dataset: cannot read {path} as Parquet: {e}") from e
    yield from enumerate(table.to_pylist())


def _saved(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Rows of a directory written by ``Dataset.save_to_disk`` (one split)."""
    try:
        import datasets
    except ImportError as e:
        raise TaskError(
            f"task.dataset: {path} is a directory; reading a Hugging Face save_to_disk directory needs "
            "the `datasets` package (`pip install datasets`)"
        ) from e
    try:
        ds = datasets.load_from_disk(str(path))
    except FileNotFoundError as e:
        raise TaskError(
            f"task.dataset: {path} is a directory but not one written by datasets' save_to_disk "
            f"(no dataset_info.json/state.json): {e}"
        ) from e
    if isinstance(ds, datasets.DatasetDict):
        splits = ", ".join(ds)
        raise TaskError(
            f"task.dataset: {path} holds several splits ({splits}); point task.dataset at one of them, "
            f"e.g. {path / next(iter(ds))}"
        )
    yield from enumerate(ds)


def _import_parquet() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise TaskError(
            "task.dataset: reading Parquet needs pyarrow, which is not installed; "
            "install it with `pip install 'streamrl[parquet]'` (or `pip install pyarrow`), "
            "or convert the dataset to JSONL"
        ) from e
    return pq
