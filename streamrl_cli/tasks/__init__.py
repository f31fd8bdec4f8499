"""What the policy is trained on: prompts, and how completions are scored.

A task is the one place where "what problem are we solving" lives, so that the generator, the
trainer and the length ranker never parse datasets or verify answers themselves. Two kinds:

- the built-in ``repeat`` task (:mod:`.builtin`), generated from a seed: the embedded default's
  task, learnable by a tiny model on two CPU cores and with output lengths predictable from the
  prompt (for the output-length ranker);
- a :class:`~.datasets.DatasetTask`: prompts from a JSONL/Parquet file or a Hugging Face
  ``save_to_disk`` directory, optionally through a chat template, scored by a reward function
  the recipe names (:mod:`.rewards`, called in TRL's convention).

:func:`make_task` turns the recipe's ``task`` section (``recipe.schema.TaskConfig``) into one of them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from streamrl_cli.errors import StreamRLError

if TYPE_CHECKING:
    from streamrl_cli.recipe.schema import TaskConfig


# The recipe's task names that :func:`make_task` makes without a dataset: the repeat task
# (recipes/task/builtin.yaml, :mod:`.builtin`) and the multi-turn ``calc`` (:mod:`.calc`).
BUILTIN_TASKS = ("builtin", "calc")


class TaskError(StreamRLError):
    """A task could not be made: bad dataset, bad reward function, bad task settings."""

    exit_code = 2


@dataclass(frozen=True)
class Prompt:
    """One prompt of a task."""

    prompt_id: str  # stable within the dataset, e.g. "repeat/00017"
    text: str  # the prompt as the policy sees it (chat template applied where the task has one)
    # Every other field of the record: the reward function's keyword arguments (JSON-serialisable).
    columns: Mapping[str, Any] = field(default_factory=dict)


class Task(ABC):
    """Prompts and a batched reward over completions of them."""

    name: str

    @abstractmethod
    def prompts(self) -> Sequence[Prompt]:
        """Every prompt of the task, in a fixed order."""

    @abstractmethod
    def reward(self, prompts: Sequence[Prompt], completions: Sequence[str]) -> list[float | None]:
        """One float per (prompt, completion) pair, or None where the reward cannot score it;
        ``completions`` exclude the prompt and EOS."""


def make_task(
    task: TaskConfig, seed: int = 0, *, model_path: str | None = None, agentic: bool = False
) -> Task:
    """The task of a recipe's ``task`` section.

    ``dataset`` null: a built-in task, ``seed`` drawing its prompts: ``calc`` (multi-turn, with a
    calculator tool: :mod:`.calc`) by that name, else the repeat task, with its verifier unless
    ``reward`` names another. Else a :class:`DatasetTask`, which needs ``reward``. ``model_path``:
    where the tokenizer of the chat template comes from (only read when the dataset is rendered
    through one). ``agentic``: a multi-turn run, whose chat prompts end without the generation
    prompt (the generator adds it, after whatever the environment adds at its reset)."""
    dataset, reward = task.dataset, task.reward
    if dataset is None and task.name == "calc":
        from streamrl_cli.tasks.calc import CalcTask

        return CalcTask(num_prompts=task.num_prompts, seed=seed)
    if dataset is None:
        from streamrl_cli.tasks.builtin import RepeatTask
        from streamrl_cli.tasks.rewards import load_reward

        return RepeatTask(
            num_prompts=task.num_prompts,
            max_output_len=task.max_output_len,
            seed=seed,
            reward_fn=load_reward(reward) if reward else None,
            filler_words=task.filler_words,
        )
    if not reward:
        raise TaskError(
            f"task.reward: a dataset task ({dataset}) needs a reward function, e.g. "
            "task.reward=streamrl_cli.tasks.rewards:exact_match or "
            "streamrl_cli.tasks.rewards:math_answer (or your own `module:function` / `file.py:function`)"
        )
    from streamrl_cli.tasks.datasets import ChatFormat, DatasetTask

    return DatasetTask(
        dataset,
        prompt_key=task.prompt_key,
        reward=reward,
        name=task.name or None,
        chat=ChatFormat(
            template=task.chat_template,
            system_prompt=task.system_prompt,
            model_path=model_path,
            generation_prompt=not agentic,
        ),  # fmt: skip
    )
