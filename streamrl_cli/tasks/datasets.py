"""Prompts from a file: JSONL (one object per line) or Parquet (one row per prompt).

A user's dataset is the most likely thing to be wrong in a run, and the least pleasant place to
find out is a trainer that has waited an hour in the queue. Everything is read and checked when
the task is made, and a bad record is reported with its line (or row) number and the fields it
does have. Parquet needs ``pyarrow``, which is large, so it is an optional extra
(``pip install 'streamrl[parquet]'``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from streamrl_cli.tasks import Prompt, Task, TaskError
from streamrl_cli.tasks.rewards import RewardFn, checked, load_reward

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")


class DatasetTask(Task):
    """Prompts of a JSONL/Parquet file, scored by ``reward`` (a function or a ``module:function``).

    ``prompt_id`` is the record's ``id`` field where present, else ``<file stem>/<index>`` with the
    0-based line (JSONL) or row (Parquet) index.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        reward: RewardFn | str | None = None,
        name: str | None = None,
    ):
        self.path = Path(path).expanduser()
        if reward is None:
            raise TaskError(f"task.reward: the dataset {self.path} needs a reward function (module:function)")
        self._reward = load_reward(reward) if isinstance(reward, str) else checked(reward)
        self.name = name or self.path.stem
        self._prompts = tuple(_load(self.path, prompt_key, answer_key))
        if not self._prompts:
            raise TaskError(f"task.dataset: {self.path} holds no prompts")

    def prompts(self) -> Sequence[Prompt]:
        return self._prompts

    def reward(self, prompts: Sequence[Prompt], completions: Sequence[str]) -> list[float]:
        return self._reward(prompts, completions)


def _load(path: Path, prompt_key: str, answer_key: str) -> list[Prompt]:
    if not path.is_file():
        raise TaskError(f"task.dataset: {path} does not exist (or is not a file)")
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        records, where = _jsonl(path), "line"
    elif suffix in PARQUET_SUFFIXES:
        records, where = _parquet(path), "row"
    else:
        valid = ", ".join(JSONL_SUFFIXES + PARQUET_SUFFIXES)
        raise TaskError(f"task.dataset: {path} has an unknown file type {suffix!r} (valid: {valid})")
    prompts: list[Prompt] = []
    seen: dict[str, int] = {}
    for index, record in records:
        at = f"{path}, {where} {index + 1}"
        if prompt_key not in record:
            keys = ", ".join(map(str, record)) or "none"
            raise TaskError(f"task.prompt_key: {at} has no field {prompt_key!r} (fields there: {keys})")
        text = record[prompt_key]
        if not isinstance(text, str):
            raise TaskError(f"{at}: field {prompt_key!r} must be a string, got {type(text).__name__}")
        raw_id = record.get("id")
        prompt_id = str(raw_id) if raw_id is not None else f"{path.stem}/{index:05d}"
        if prompt_id in seen:
            raise TaskError(f"{at}: id {prompt_id!r} already used at {where} {seen[prompt_id] + 1}")
        seen[prompt_id] = index
        prompts.append(Prompt(prompt_id, text, record.get(answer_key)))
    return prompts


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
