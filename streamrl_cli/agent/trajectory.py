"""A multi-turn trajectory as the trainer will see it: token ids appended, never re-rendered.

The trainer trains on the tokens a model produced, with the log-probs it produced them with; any
re-rendering of a conversation (a chat template applied to the whole history each turn) can change
earlier tokens (a template that strips past reasoning, a tokenizer that merges across a boundary)
and so train the model on text it never wrote. Here a trajectory only ever grows at its end:

* a **model turn** appends the sampled tokens, their behaviour log-probs and the weight version that
  sampled them, with loss mask 1;
* an **environment turn** (an observation, a tool's answer, the template's turn markers around
  them) appends tokens with loss mask 0 and log-prob 0: they are in the context the next turn sees,
  and out of the loss, the KL and the importance ratios.

Budgets: ``max_tokens`` bounds everything after the prompt (model and environment tokens: it is
what the trainer's batch and the engine's context hold), ``max_turns`` the model turns,
``max_turn_tokens`` one model turn. A trajectory that hits one ends with that reason; one the
environment ended says ``done``; one whose environment failed says why (``env_error``,
``env_timeout``, ``env_died``), and the recipe decides whether it is scored or dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Why a trajectory ended (the `agent/stop/<reason>` metrics count them).
DONE = "done"  # the environment said so
MAX_TURNS = "max_turns"
MAX_TOKENS = "max_tokens"  # the trajectory's token budget (task.max_output_len) is spent
ENV_ERROR = "env_error"  # reset or step raised
ENV_TIMEOUT = "env_timeout"  # reset or step took longer than agent.step_timeout_s
ENV_DIED = "env_died"  # the process hosting the environment exited
ABORTED = "abort"  # the trainer cancelled or paused it
FAILURES = (ENV_ERROR, ENV_TIMEOUT, ENV_DIED)
STOPS = (DONE, MAX_TURNS, MAX_TOKENS, *FAILURES, ABORTED)


@dataclass
class Trajectory:
    """Everything after the prompt, token by token, and what happened on the way."""

    max_tokens: int  # model + environment tokens after the prompt
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # behaviour log-probs; 0.0 on environment tokens
    loss_mask: list[int] = field(default_factory=list)  # 1: the model's token, 0: the environment's
    versions: list[int] = field(default_factory=list)  # weight version per token (see token_versions)
    turns: int = 0  # model turns
    turns_cut: int = 0  # model turns cut at their token budget
    tool_calls: int = 0
    tool_errors: int = 0
    env_reward: float = 0.0  # sum of the environment's step rewards
    env_s: float = 0.0  # seconds spent in reset and step
    stop: str = ""  # why it ended (STOPS); "" while it runs
    error: str = ""  # the environment's failure, if any
    parked: bool = False  # paused between turns, its environment kept to go on with (partial rollout)
    resumed: bool = False  # went on after such a pause, where it was kept

    @property
    def room(self) -> int:
        """Tokens still allowed after the prompt."""
        return self.max_tokens - len(self.token_ids)

    @property
    def model_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def env_tokens(self) -> int:
        return len(self.loss_mask) - self.model_tokens

    @property
    def first_version(self) -> int:
        """The oldest version that sampled a token of it (environment tokens have none of their own)."""
        model = [v for v, m in zip(self.versions, self.loss_mask, strict=True) if m]
        return min(model) if model else 0

    @property
    def token_versions(self) -> list[int]:
        """The version of each token; environment tokens take the model turn's before them (the
        opening, before any model turn: the first turn's)."""
        first = next((v for v, m in zip(self.versions, self.loss_mask, strict=True) if m), 0)
        return [first if v < 0 else v for v in self.versions]

    def add_model_turn(self, token_ids: list[int], logprobs: list[float], version: int) -> None:
        if len(token_ids) != len(logprobs):
            raise ValueError(f"a model turn of {len(token_ids)} tokens with {len(logprobs)} log-probs")
        if len(token_ids) > self.room:
            raise ValueError(f"a model turn of {len(token_ids)} tokens with room for {self.room}")
        self.turns += 1
        self.token_ids += token_ids
        self.logprobs += logprobs
        self.loss_mask += [1] * len(token_ids)
        self.versions += [version] * len(token_ids)

    def fits(self, env_token_ids: list[int]) -> bool:
        """Whether an environment turn fits and leaves the model at least one token to answer it."""
        return len(env_token_ids) < self.room

    def add_env_turn(self, token_ids: list[int]) -> None:
        if not self.fits(token_ids):
            raise ValueError(f"an environment turn of {len(token_ids)} tokens with room for {self.room}")
        version = self.versions[-1] if self.versions else -1  # -1: before any model turn
        self.token_ids += token_ids
        self.logprobs += [0.0] * len(token_ids)
        self.loss_mask += [0] * len(token_ids)
        self.versions += [version] * len(token_ids)

    def end(self, stop: str, error: str = "") -> None:
        if stop not in STOPS:
            raise ValueError(f"unknown stop reason {stop!r} (valid: {', '.join(STOPS)})")
        if not self.stop:  # the first reason wins (an abort after a failure stays the failure)
            self.stop, self.error = stop, error

    def go_on(self) -> None:
        """A trajectory paused between turns is resumed: it runs again from where it stopped."""
        if self.stop != ABORTED or not self.parked:
            raise ValueError(f"only a paused trajectory goes on (this one: stop {self.stop!r})")
        self.stop, self.error, self.parked, self.resumed = "", "", False, True

    @property
    def failed(self) -> bool:
        return self.stop in FAILURES
