"""What the policy is trained on: prompts, and how completions are scored.

A task is the one place where "what problem are we solving" lives, so that the generator, the
trainer and the length ranker never parse datasets or verify answers themselves. Two kinds:

- the built-in ``repeat`` task (:mod:`.builtin`), generated from a seed: the embedded default's
  task, learnable by a tiny model on two CPU cores and with output lengths predictable from the
  prompt (for the output-length ranker);
- a :class:`~.datasets.DatasetTask`: prompts from a JSONL/Parquet file, scored by a reward
  function named ``module:function`` in the recipe (:mod:`.rewards`).

:func:`make_task` turns the recipe's ``task`` section (``recipe.schema.TaskConfig``) into one of them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from streamrl_cli.errors import StreamRLError

if TYPE_CHECKING:
    from streamrl_cli.recipe.schema import TaskConfig


class TaskError(StreamRLError):
    """A task could not be made: bad dataset, bad reward function, bad task settings."""

    exit_code = 2


@dataclass(frozen=True)
class Prompt:
    """One prompt of a task."""

    prompt_id: str  # stable within the dataset, e.g. "repeat/00017"
    text: str  # the prompt text as given to the tokenizer (no chat template)
    answer: Any = None  # whatever the verifier needs (JSON-serialisable)


class Task(ABC):
    """Prompts and a batched reward over completions of them."""

    name: str

    @abstractmethod
    def prompts(self) -> Sequence[Prompt]:
        """Every prompt of the task, in a fixed order."""

    @abstractmethod
    def reward(self, prompts: Sequence[Prompt], completions: Sequence[str]) -> list[float]:
        """One float per (prompt, completion) pair; ``completions`` exclude the prompt and EOS."""


def make_task(task: TaskConfig, seed: int = 0) -> Task:
    """The task of a recipe's ``task`` section.

    ``dataset`` null: the built-in repeat task (whatever ``name`` says), ``seed`` drawing its
    prompts; its verifier unless ``reward`` names another. Else a :class:`DatasetTask`, which needs
    ``reward``."""
    dataset, reward = task.dataset, task.reward
    if dataset is None:
        from streamrl_cli.tasks.builtin import RepeatTask
        from streamrl_cli.tasks.rewards import load_reward

        return RepeatTask(
            num_prompts=task.num_prompts,
            max_output_len=task.max_output_len,
            seed=seed,
            reward_fn=load_reward(reward) if reward else None,
        )
    if not reward:
        raise TaskError(
            f"task.reward: a dataset task ({dataset}) needs a reward function, e.g. "
            "task.reward=streamrl_cli.tasks.rewards:exact_match or "
            "streamrl_cli.tasks.rewards:math_answer (or your own `module:function`)"
        )
    from streamrl_cli.tasks.datasets import DatasetTask
    from streamrl_cli.tasks.rewards import load_reward

    return DatasetTask(
        dataset,
        prompt_key=task.prompt_key,
        reward=load_reward(reward),
        name=task.name or None,
    )
