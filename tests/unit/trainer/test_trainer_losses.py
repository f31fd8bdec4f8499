"""The RL loss math against hand-computed numbers on small tensors."""

from __future__ import annotations

import math

import pytest
import torch

from streamrl_cli.trainer.algo import clip_loss as policy_loss
from streamrl_cli.trainer.algo import grpo_advantages, is_weights, kl_estimate
from streamrl_cli.trainer.algo.losses import (
    LOSS_AGGS,
    aggregate,
    entropy_from_logits,
    gae,
    rollout_mismatch,
    token_logprobs,
    token_rewards,
    value_loss,
)


def close(actual: torch.Tensor, expected, atol: float = 1e-5) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


# --- GRPO ---------------------------------------------------------------------------------------


def test_grpo_advantages_population_std():
    # mean 0.5, population std 0.5 (the sample std would be 0.577 and give ±0.866)
    close(grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0])), [1.0, -1.0, -1.0, 1.0])


def test_grpo_advantages_uneven_group():
    # [3, 0, 0, 0, 0, 0]: mean 0.5, population std sqrt((2.5² + 5·0.5²)/6) = sqrt(7.5/6) = 1.118034
    adv = grpo_advantages(torch.tensor([3.0, 0.0, 0.0, 0.0, 0.0, 0.0]))
    close(adv, [2.5 / 1.118034] + [-0.5 / 1.118034] * 5)


def test_grpo_advantages_without_std_norm():
    close(grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), std_norm=False), [0.5, -0.5, -0.5, 0.5])


def test_grpo_advantages_identical_rewards_are_zero():
    adv = grpo_advantages(torch.tensor([0.7, 0.7, 0.7]))
    assert torch.isfinite(adv).all()
    close(adv, [0.0, 0.0, 0.0])
    close(grpo_advantages(torch.tensor([1.0])), [0.0])


# --- KL estimators ------------------------------------------------------------------------------


def test_kl_estimators_at_one_point():
    logp, ref = torch.tensor([-1.0]), torch.tensor([-2.0])  # log ratio = 1
    close(kl_estimate(logp, ref, "k1"), [1.0])
    close(kl_estimate(logp, ref, "k2"), [0.5])
    close(kl_estimate(logp, ref, "k3"), [math.exp(-1.0)])  # e^-1 - (-1) - 1


def test_kl_estimators_negative_log_ratio():
    logp, ref = torch.tensor([-2.0]), torch.tensor([-1.5])  # log ratio = -0.5
    close(kl_estimate(logp, ref, "k1"), [-0.5])
    close(kl_estimate(logp, ref, "k2"), [0.125])
    close(kl_estimate(logp, ref, "k3"), [math.exp(0.5) - 0.5 - 1.0])  # 0.148721, >= 0 unlike k1


def test_kl_unknown_kind_names_valid_ones():
    with pytest.raises(ValueError, match="k1, k2, k3") as err:
        kl_estimate(torch.zeros(1), torch.zeros(1), "k4")
    assert "'k4'" in str(err.value)


# --- PPO rewards and GAE -----------------------------------------------------------------------


def test_token_rewards_score_at_last_valid_token():
    mask = torch.tensor(
        [[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 1.0, 0.0]]
    )
    kl = torch.full((4, 4), 0.5)
    out = token_rewards(torch.tensor([1.0, 2.0, 3.0, 4.0]), kl, 0.1, mask)
    close(
        out,
        [
            [-0.05, 0.95, 0.0, 0.0],
            [-0.05, -0.05, -0.05, 1.95],
            [0.0, 0.0, 0.0, 0.0],  # an empty sequence gets nothing, not even its score
            [-0.05, 0.0, 3.95, 0.0],  # a hole in the mask: the score goes to the last valid token
        ],
    )


def test_token_rewards_without_kl():
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    close(token_rewards(torch.tensor([-1.0]), None, 0.1, mask), [[0.0, 0.0, -1.0, 0.0]])


def test_gae_by_hand():
    # rewards [0, 0, 1], values [0.5, 0.4, 0.3], gamma 0.9, lam 0.8 (gamma·lam = 0.72), V(after end) = 0
    # t=2: delta = 1 + 0.9·0     - 0.3 =  0.7    A2 = 0.7
    # t=1: delta = 0 + 0.9·0.3   - 0.4 = -0.13   A1 = -0.13 + 0.72·0.7   = 0.374
    # t=0: delta = 0 + 0.9·0.4   - 0.5 = -0.14   A0 = -0.14 + 0.72·0.374 = 0.12928
    # returns = A + V = [0.62928, 0.774, 1.0]
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.4, 0.3]])
    adv, ret = gae(rewards, values, torch.ones(1, 3), gamma=0.9, lam=0.8)
    close(adv, [[0.12928, 0.374, 0.7]])
    close(ret, [[0.62928, 0.774, 1.0]])


def test_gae_right_padding_ignores_what_lies_past_the_end():
    # The same sequence padded to 5 with garbage rewards and values in the padding.
    rewards = torch.tensor([[0.0, 0.0, 1.0, 7.0, -3.0], [0.0, 0.0, 1.0, 0.0, 0.0]])
    values = torch.tensor([[0.5, 0.4, 0.3, 9.0, 9.0], [0.5, 0.4, 0.3, 0.2, 0.1]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    close(adv[0], [0.12928, 0.374, 0.7, 0.0, 0.0])
    close(ret[0], [0.62928, 0.774, 1.0, 0.0, 0.0])
    # The unpadded row of length 5 bootstraps from V = 0.2 at t=3: t=2 delta = 1 + 0.18 - 0.3 = 0.88, ...
    # t=4: delta = 0 - 0.1 = -0.1; t=3: delta = 0.09 - 0.2 = -0.11, A3 = -0.11 + 0.72·(-0.1) = -0.182
    # t=2: A2 = 0.88 + 0.72·(-0.182) = 0.74896
    close(adv[1, 2:], [0.74896, -0.182, -0.1])


def test_gae_gamma_lam_one_is_reward_to_go_minus_value():
    rewards = torch.tensor([[1.0, 2.0, 3.0, 0.0]])
    values = torch.tensor([[1.0, 1.0, 1.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    close(ret, [[6.0, 5.0, 3.0, 0.0]])
    close(adv, [[5.0, 4.0, 2.0, 0.0]])


# --- policy loss --------------------------------------------------------------------------------


def test_policy_loss_clips_positive_high_and_negative_low():
    # clip_low 0.2, clip_high 0.28: the ratio is clipped to [0.8, 1.28]
    ratios = torch.tensor([[1.5, 1.5, 0.5, 0.5, 1.0, 1.25, 1.5]])
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0, 2.0, 1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0]])
    old = torch.full((1, 7), -1.0)
    logp = (old + ratios.log()).requires_grad_()
    loss, stats = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    # A>0, r=1.5: -min(1.5, 1.28) = -1.28 (clipped at 1+eps_high)
    # A<0, r=1.5: -min(-1.5, -1.28) = 1.5 (not clipped: pessimistic side)
    # A<0, r=0.5: -min(-0.5, -0.8) = 0.8 (clipped at 1-eps_low)
    # A>0, r=0.5: -min(0.5, 0.4) = -0.5 (not clipped)
    # r=1, A=2: -2
    # A>0, r=1.25: -1.25 (inside [0.8, 1.28]: asymmetric clip, above 1+eps_low but not clipped)
    # the masked token: 0
    close(loss, [[-1.28, 1.5, 0.8, -0.5, -2.0, -1.25, 0.0]])
    close(stats["clip_frac"], 2.0)
    close(stats["tokens"], 6.0)
    # approx_kl = Σ (r - 1) - log r over valid tokens
    expected_kl = 2 * (0.5 - math.log(1.5)) + 2 * (-0.5 - math.log(0.5)) + 0.0 + (0.25 - math.log(1.25))
    close(stats["approx_kl"], expected_kl)
    loss.sum().backward()
    # d(-r·A)/dlogp = -r·A where unclipped; zero where clipping is active or masked
    close(logp.grad, [[0.0, 1.5, 0.0, -0.5, -2.0, -1.25, 0.0]])
    assert all(not v.requires_grad for v in stats.values())


def test_policy_loss_sequence_advantages_broadcast_and_is_weights():
    logp = torch.zeros(2, 3)
    old = torch.zeros(2, 3)  # ratio 1 everywhere
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    is_w = torch.tensor([[0.5, 2.0, 9.0], [1.0, 1.0, 0.25]])
    loss, stats = policy_loss(logp, old, torch.tensor([1.0, -2.0]), mask, 0.2, 0.2, is_weights=is_w)
    close(loss, [[-0.5, -2.0, 0.0], [2.0, 2.0, 0.5]])
    close(stats["clip_frac"], 0.0)
    close(stats["approx_kl"], 0.0)
    close(stats["tokens"], 5.0)


def test_policy_loss_stats_are_sums_across_micro_batches():
    gen = torch.Generator().manual_seed(0)
    logp = torch.randn(6, 5, generator=gen) * 0.3 - 1.0
    old = torch.randn(6, 5, generator=gen) * 0.3 - 1.0
    adv = torch.randn(6, 5, generator=gen)
    mask = (torch.arange(5) < torch.tensor([5, 3, 0, 1, 4, 2]).unsqueeze(1)).float()
    _, whole = policy_loss(logp, old, adv, mask, 0.2, 0.2)
    parts = [
        policy_loss(logp[i : i + 2], old[i : i + 2], adv[i : i + 2], mask[i : i + 2], 0.2, 0.2)[1]
        for i in (0, 2, 4)
    ]
    for key in ("clip_frac", "approx_kl", "tokens"):
        close(sum(p[key] for p in parts), whole[key].item())
    assert whole["tokens"].item() == 15.0
    assert 0 < whole["clip_frac"].item() < 15


# --- importance weights, value loss ------------------------------------------------------------


def test_importance_weights_truncated_at_cap():
    old = torch.tensor([[math.log(0.5), math.log(3.0), math.log(1.5), 0.0]])
    behaviour = torch.zeros(1, 4)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w = is_weights(old.requires_grad_(), behaviour, mask, cap=2.0, level="token")
    close(w, [[0.5, 2.0, 1.5, 0.0]])
    assert not w.requires_grad


def test_value_loss_clipped_and_unclipped():
    values = torch.tensor([[1.5, 1.5, 1.1, 3.0]])
    old = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    returns = torch.tensor([[2.0, 0.0, 2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    # clip 0.2: v=1.5 clips to 1.2
    #   R=2: max(0.5², 0.8²) = 0.64 → 0.32 (the clipped term is the larger one)
    #   R=0: max(1.5², 1.2²) = 2.25 → 1.125
    #   v=1.1 within the band, R=2: 0.9² = 0.81 → 0.405; masked token: 0
    close(value_loss(values, old, returns, mask, clip=0.2), [[0.32, 1.125, 0.405, 0.0]])
    # clip <= 0: plain 0.5·(v - R)²
    close(value_loss(values, old, returns, mask, clip=0.0), [[0.125, 1.125, 0.405, 0.0]])
    close(value_loss(values, old, returns, mask, clip=-1.0), [[0.125, 1.125, 0.405, 0.0]])


# --- logits -------------------------------------------------------------------------------------


def test_entropy_uniform_is_log_vocab():
    close(entropy_from_logits(torch.full((2, 3, 7), 3.0)), torch.full((2, 3), math.log(7)))


def test_entropy_by_hand_and_stable_for_large_logits():
    # p = [0.25, 0.75]: H = -(0.25·ln 0.25 + 0.75·ln 0.75) = 0.562335
    logits = torch.tensor([[[0.0, math.log(3.0)]]])
    close(entropy_from_logits(logits), [[0.562335]])
    close(entropy_from_logits(logits + 1000.0), [[0.562335]], atol=1e-3)
    # a near one-hot distribution: entropy ~ 0, finite
    out = entropy_from_logits(torch.tensor([[[1000.0, 0.0, 0.0]]]))
    assert torch.isfinite(out).all()
    close(out, [[0.0]])


def test_token_logprobs_temperature_by_hand():
    # logits [2, 4, 0] / 2 = [1, 2, 0]: log p(1) = 2 - ln(e + e² + 1) = 2 - ln(11.107337) = -0.407606
    logits = torch.tensor([[[2.0, 4.0, 0.0], [2.0, 4.0, 0.0]]])
    out = token_logprobs(logits, torch.tensor([[1, 2]]), temperature=2.0)
    close(out, [[-0.407606, -2.407606]])


def test_token_logprobs_matches_manual_softmax():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 4, 11, generator=gen) * 5
    tokens = torch.randint(0, 11, (3, 4), generator=gen)
    for temperature in (1.0, 2.0, 0.7):
        probs = torch.exp(logits / temperature)
        probs = probs / probs.sum(-1, keepdim=True)
        expected = probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).log()
        close(token_logprobs(logits, tokens, temperature), expected)


# --- aggregation --------------------------------------------------------------------------------


def test_aggregate_modes_by_hand():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    num, units = aggregate(per_token, mask, "token-mean", max_len=3)
    close(num, 7.0)
    assert units == 3.0
    num, units = aggregate(per_token, mask, "seq-mean-token-mean", max_len=3)
    close(num, 3.0 / 2 + 4.0 / 1)
    assert units == 2.0
    num, units = aggregate(per_token, mask, "seq-mean-token-sum-norm", max_len=3)
    close(num, 7.0 / 3)
    assert units == 2.0


def test_aggregate_empty_sequence_counts_but_adds_nothing():
    per_token = torch.tensor([[1.0, 2.0], [5.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    num, units = aggregate(per_token, mask, "seq-mean-token-mean", max_len=2)
    close(num, 1.5)
    assert units == 2.0


@pytest.mark.parametrize("mode", LOSS_AGGS)
def test_aggregate_micro_batches_equal_whole_batch(mode):
    gen = torch.Generator().manual_seed(2)
    batch, length = 9, 7
    per_token = torch.randn(batch, length, generator=gen)
    lengths = torch.tensor([7, 1, 0, 4, 6, 2, 7, 3, 5])
    mask = (torch.arange(length) < lengths.unsqueeze(1)).float()
    num, units = aggregate(per_token, mask, mode, max_len=length)
    whole = num / units
    splits = [(0, 2), (2, 3), (3, 7), (7, 9)]
    parts = [aggregate(per_token[a:b], mask[a:b], mode, max_len=length) for a, b in splits]
    streamed = sum(p[0] for p in parts) / sum(p[1] for p in parts)
    close(streamed, whole.item(), atol=1e-6)
    # the naive mean of micro-batch losses differs: the pairing is what makes streaming exact
    # (the one-row micro-batch (2, 3) is an empty sequence: for token-mean it brings (0, 0))
    losses = [p[0] / p[1] for p in parts if p[1] > 0]
    naive = sum(losses) / len(losses)
    assert abs(naive.item() - whole.item()) > 1e-3


def test_aggregate_gradients_follow_the_mode():
    per_token = torch.ones(2, 4, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    num, _ = aggregate(per_token, mask, "seq-mean-token-mean", max_len=4)
    num.backward()
    close(per_token.grad, [[0.25, 0.25, 0.25, 0.25], [1.0, 0.0, 0.0, 0.0]])


def test_aggregate_unknown_mode_lists_valid_modes():
    with pytest.raises(ValueError, match="token-mean, seq-mean-token-mean, seq-mean-token-sum-norm"):
        aggregate(torch.zeros(1, 2), torch.ones(1, 2), "sum", max_len=2)


def test_rollout_mismatch_by_hand():
    """|Δ log p| and k3 KL(behaviour ‖ trainer) summed over response tokens only."""
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, -7.0]])
    behaviour = torch.tensor([[-1.5, -2.0, -9.0], [-0.3, -2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])  # the last column is padding
    got = rollout_mismatch(logp, behaviour, mask)
    deltas = [0.5, 0.0, 0.2, -1.0]
    assert got["logp_abs_diff"].item() == pytest.approx(sum(abs(d) for d in deltas))
    assert got["kl"].item() == pytest.approx(sum(math.exp(d) - 1 - d for d in deltas))
    same = rollout_mismatch(behaviour, behaviour, mask)
    assert same["logp_abs_diff"].item() == 0.0 and same["kl"].item() == 0.0
