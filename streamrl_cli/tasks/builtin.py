"""The built-in ``repeat`` task: the embedded default's task, learnable on two CPU cores.

``streamrl run local`` has to show a reward that rises within minutes with a 2-layer, 64-wide
model, and the output-length ranker needs outputs whose length is predictable from the prompt.
A prompt asks for a word repeated a number of times::

    prompt:  "repeat fox 7:"
    ideal:   " fox fox fox fox fox fox fox" then <|endoftext|>

- Every word in :data:`WORDS` is one token of the tiny tokenizer with its leading space, so the
  ideal answer takes exactly ``count + 1`` tokens (EOS included): :meth:`RepeatTask.expected_length`
  is an exact oracle for the ranker.
- The count is long-tailed like reasoning outputs: a log-normal body around 4 plus a flat tail
  up to 40 (so answers fit the task's 64 output tokens).
- The reward is graded (:func:`repeat_score`): the fraction of output words that are the word,
  times a factor that decays with the relative count error. Copying the word is learnt during the
  warm-up; counting is what reinforcement learning then improves.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from streamrl_cli.tasks import Prompt, Task, TaskError
from streamrl_cli.tasks.rewards import Reward, repeat_score

# Single tokens (with a leading space) of streamrl_cli.models.tiny's tokenizer; tests check it.
WORDS = ("fox", "brown", "model", "policy", "stream", "step", "every", "over")
MODE = 4  # most common count
TAIL = 0.2  # fraction of prompts in the flat tail
TAIL_MIN = 10  # the tail's counts are uniform in [TAIL_MIN, max_count]
MAX_COUNT = 40


class RepeatTask(Task):
    """``num_prompts`` prompts "repeat <word> <count>:" drawn from ``seed``."""

    name = "repeat"

    def __init__(
        self,
        num_prompts: int = 4096,
        max_output_len: int = 64,
        seed: int = 0,
        max_count: int = MAX_COUNT,
        reward_fn: Reward | None = None,
        filler_words: int = 0,
    ):
        if num_prompts < 1:
            raise TaskError(f"task.num_prompts must be at least 1, got {num_prompts}")
        if max_output_len < 2:
            raise TaskError(
                f"task.max_output_len must be at least 2 for the repeat task, got {max_output_len}"
            )
        if filler_words < 0:
            raise TaskError(f"task.filler_words must be 0 or more, got {filler_words}")
        self.seed = seed
        self.filler_words = filler_words  # random words before each instruction (a long context)
        self._reward_fn = reward_fn  # the recipe's task.reward, if it replaces the verifier
        if reward_fn is not None:
            reward_fn.check_columns(("word", "count"))
        # count copies + EOS must fit in max_output_len
        self.max_count = max(1, min(max_count, max_output_len - 1))
        rng = random.Random(f"repeat-{seed}")
        self._prompts = tuple(self._draw(i, rng) for i in range(num_prompts))

    def _draw(self, index: int, rng: random.Random) -> Prompt:
        word = rng.choice(WORDS)
        if rng.random() < TAIL and self.max_count > TAIL_MIN:
            count = rng.randint(TAIL_MIN, self.max_count)
        else:
            count = round(math.exp(rng.gauss(math.log(MODE + 0.5), 0.45)))
        count = min(max(count, 1), self.max_count)
        # The filler has its own random stream: the instructions are the same with or without it.
        words = random.Random(f"repeat-filler-{self.seed}-{index}")
        filler = "".join(f"{words.choice(WORDS)} " for _ in range(self.filler_words))
        return Prompt(
            f"repeat/{index:05d}", f"{filler}repeat {word} {count}:", {"word": word, "count": count}
        )

    def prompts(self) -> Sequence[Prompt]:
        return self._prompts

    def reward(self, prompts: Sequence[Prompt], completions: Sequence[str]) -> list[float | None]:
        if self._reward_fn is not None:  # its columns: word, count
            return self._reward_fn(prompts, completions)
        return [repeat_score(p.columns, c) for p, c in zip(prompts, completions, strict=True)]

    @staticmethod
    def reference_completion(prompt: Prompt) -> str:
        """The ideal completion (without EOS, which the tokenizer's side appends)."""
        return f" {prompt.columns['word']}" * int(prompt.columns["count"])

    @staticmethod
    def expected_length(prompt: Prompt) -> int:
        """Tokens of the ideal answer, EOS included: the oracle for output-length ranking."""
        return int(prompt.columns["count"]) + 1

    @staticmethod
    def warmup_completion(prompt: Prompt, rng: random.Random) -> str:
        """A noisy reference for the supervised warm-up: the format is right, the count is off by
        a few in most examples and now and then a word is wrong, so the warmed policy is a
        rough counter that reinforcement learning has to sharpen."""
        word, count = prompt.columns["word"], int(prompt.columns["count"])
        spread = max(1.0, 0.3 * count)
        noisy = max(1, count + round(rng.gauss(0.0, spread)))
        words = [rng.choice(WORDS) if rng.random() < 0.1 else word for _ in range(noisy)]
        return "".join(f" {w}" for w in words)
