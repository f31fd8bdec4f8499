"""What the trainer reads off a sample it received: the tokens its model generated, a trajectory's
turns and reward, each token's weight version, and one sample made of a paused start and what its
resumption generated."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from streamrl_cli.agent.trajectory import FAILURES
from streamrl_cli.tasks import Prompt, Task
from streamrl_cli.transport.wire import Sample

if TYPE_CHECKING:
    from streamrl_cli.recipe.schema import AgentConfig


def trajectory_rewards(
    agent: AgentConfig, task: Task, prompts: list[Prompt], samples: list[Sample], texts: list[str]
) -> list[float | None]:
    """A group's rewards: the task's on each completion, or for multi-turn trajectories what
    ``agent.reward`` says (the environment's, the task's on the whole conversation, their sum); a
    trajectory whose environment failed is unscored (not learnt from) with ``agent.on_failure=drop``."""
    if not agent.enabled:
        return task.reward(prompts, texts)
    env = [s.episode.env_reward if s.episode is not None else 0.0 for s in samples]
    scores: list[float | None]
    if agent.reward == "env":
        scores = list(env)
    else:
        on_text = task.reward(prompts, texts)
        scores = on_text if agent.reward == "task" else [
            None if t is None else t + e for t, e in zip(on_text, env, strict=True)
        ]  # fmt: skip
    if agent.on_failure == "drop":
        scores = [None if failed(s) else r for s, r in zip(samples, scores, strict=True)]
    return scores


def generated(sample: Sample) -> int:
    """Tokens the model generated: all of a single-turn sample's, a trajectory's model turns'."""
    return sum(sample.loss_mask) if sample.loss_mask else len(sample.token_ids)


def trajectory_turns(samples: list[Sample]) -> list[tuple[int, int]]:
    """(model turns, model tokens) of each multi-turn trajectory of a group (none for single-turn)."""
    return [(s.episode.turns, s.episode.model_tokens) for s in samples if s.episode is not None]


def failed(sample: Sample) -> bool:
    """A trajectory whose environment raised, timed out or died."""
    return sample.episode is not None and sample.episode.stop in FAILURES


def token_versions(sample: Sample) -> list[int]:
    """The weight version of each of a sample's tokens."""
    return list(sample.token_versions) or [sample.weight_version] * len(sample.token_ids)


def join(start: Sample, rest: Sample) -> Sample:
    """A paused sample's tokens so far followed by what its resumption generated: one sample whose
    tokens keep their versions and behaviour log-probs (the loss's importance weights are per token)."""
    if not start.token_ids:
        return rest
    versions = token_versions(start) + token_versions(rest)
    # Distillation: each part was scored by a teacher in its own request's context.
    teacher = [*start.teacher_logprobs, *rest.teacher_logprobs]
    return msgspec.structs.replace(
        rest, token_ids=[*start.token_ids, *rest.token_ids], logprobs=[*start.logprobs, *rest.logprobs],
        weight_version=min(versions), token_versions=versions, queued_at=start.queued_at,
        first_token_at=start.first_token_at,
        teacher_logprobs=teacher if len(teacher) == len(versions) else [],
    )  # fmt: skip
