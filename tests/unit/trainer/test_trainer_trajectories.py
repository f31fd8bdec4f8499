"""The trainer's side of multi-turn trajectories: environment tokens are context, not trained; the
reward is the one `agent.reward` names; a failed trajectory is dropped when the recipe says so."""

from __future__ import annotations

import pytest

from streamrl_cli.recipe.schema import AgentConfig
from streamrl_cli.tasks import Prompt, Task
from streamrl_cli.trainer.loop.batch import Rollout, collate
from streamrl_cli.trainer.loop.samples import generated, trajectory_rewards, trajectory_turns
from streamrl_cli.transport.wire import Episode, Sample


def trajectory(mask, reward=0.0, stop="done"):
    n = len(mask)
    return Sample(
        prompt_id="it0/p", sample_index=0, token_ids=list(range(10, 10 + n)),
        logprobs=[-0.5 if m else 0.0 for m in mask], finish_reason="stop", weight_version=3,
        loss_mask=list(mask), episode=Episode(turns=2, env_reward=reward, stop=stop, model_tokens=sum(mask)),
    )  # fmt: skip


class Lengths(Task):
    """Rewards a completion by its number of characters (to tell the task's reward apart)."""

    name = "lengths"

    def prompts(self):
        return [Prompt("p", "q")]

    def reward(self, prompts, completions):
        return [float(len(c)) for c in completions]


def test_environment_tokens_are_in_the_context_and_out_of_the_loss():
    mask = [1, 1, 0, 0, 0, 1]
    s = trajectory(mask)
    mb = collate([Rollout(prompt_tokens=[1, 2, 3], sample=s, reward=1.0)])
    assert mb.input_ids[0].tolist() == [1, 2, 3, *s.token_ids]
    assert mb.attention_mask[0].tolist() == [1] * 9  # every token is attended to
    # position j predicts token j + 1: the response starts at target position 2
    assert mb.mask[0].tolist() == [0, 0, *map(float, mask)]
    assert mb.behaviour_logp[0].tolist() == [0, 0, -0.5, -0.5, 0, 0, 0, -0.5]
    unscored = collate([Rollout(prompt_tokens=[1, 2, 3], sample=s, reward=0.0, scored=False)])
    assert unscored.mask.sum() == 0
    assert generated(s) == 3 and Rollout(prompt_tokens=[1], sample=s, reward=0.0).trained_tokens == 3


@pytest.mark.parametrize(
    ("reward", "on_failure", "expect"),
    [
        ("env", "score", [0.5, 0.0]),
        ("task", "score", [3.0, 3.0]),
        ("sum", "score", [3.5, 3.0]),
        ("env", "drop", [0.5, None]),
    ],
)
def test_the_reward_is_the_one_the_recipe_names(reward, on_failure, expect):
    agent = AgentConfig(env="m:E", reward=reward, on_failure=on_failure)
    samples = [trajectory([1, 0, 1], reward=0.5), trajectory([1, 0, 1], reward=0.0, stop="env_timeout")]
    texts = ["abc", "xyz"]
    assert trajectory_rewards(agent, Lengths(), [Prompt("p", "q")] * 2, samples, texts) == expect


def test_single_turn_samples_keep_the_task_reward():
    s = Sample(prompt_id="p", sample_index=0, token_ids=[5, 6], logprobs=[-1.0, -1.0], finish_reason="stop",
               weight_version=0)  # fmt: skip
    assert trajectory_rewards(AgentConfig(), Lengths(), [Prompt("p", "q")], [s], ["ab"]) == [2.0]
    assert generated(s) == 2


def test_a_groups_turns_are_what_the_ranker_learns_turn_by_turn():
    s = trajectory([1, 1, 0, 1])
    assert trajectory_turns([s, trajectory([1, 0])]) == [(2, 3), (2, 1)]
    single = Sample(prompt_id="p", sample_index=0, token_ids=[5], logprobs=[-1.0], finish_reason="stop",
                    weight_version=0)  # fmt: skip
    assert trajectory_turns([single]) == []  # single-turn groups: totals only, as before
