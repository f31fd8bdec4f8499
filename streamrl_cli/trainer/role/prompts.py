"""A prompt's token ids as the trainer counts them, and the guard on task.max_prompt_len that names
the prompt past it (the check before submission counts them the same way)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from streamrl_cli.errors import StreamRLError


def prompt_tokenizer(tok: Any, max_prompt: int, task: Any, key: str) -> Callable[[str], list[int]]:
    """A prompt's token ids, counted as the check before submission counts them
    (``tasks.datasets.prompt_ids``); a StreamRLError naming the prompt past task.max_prompt_len.
    That check finds such a prompt before submission where the model was there; this is the last
    guard, for a model made at start. ``key``: the task's recipe key (task.dataset, task.eval_dataset)."""
    from streamrl_cli.tasks.datasets import prompt_ids

    def tokenize(text: str) -> list[int]:
        ids = prompt_ids(tok, [text])[0]
        if len(ids) > max_prompt:
            raise StreamRLError(
                f"a prompt has {len(ids)} tokens, more than task.max_prompt_len={max_prompt}"
                + _which_prompt(task, key, text)
            )
        return ids

    return tokenize


def _which_prompt(task: Any, key: str, text: str) -> str:
    """`` (task.dataset row 3, ...)``: where ``text`` is in ``task``, looked up only as the run fails."""
    from streamrl_cli.tasks.datasets import DatasetTask

    for i, p in enumerate(task.prompts()):
        if p.text == text:
            if isinstance(task, DatasetTask):
                row = f"{key} row {task.rows[i]}, counting from 0, of {task.path}"
                return f" ({row}; prompt id {p.prompt_id!r})"
            return f" (prompt id {p.prompt_id!r})"
    return ""
