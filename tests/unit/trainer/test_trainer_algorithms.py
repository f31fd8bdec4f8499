"""The algorithm registry against numbers worked out by hand: each preset's advantages, ratios,
masks, loss value and gradient on a tiny batch, and the off-policy corrections.

Each algorithm is run the way the trainer runs it: its preset (``recipe.presets``) names an advantage
estimator, a policy loss and an aggregation, looked up in the registries of ``trainer.algo``; the expected
numbers are written out in the comments, not computed with the functions under test.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from streamrl_cli.recipe import presets, schema
from streamrl_cli.recipe.schema import AlgorithmConfig
from streamrl_cli.trainer import algo as A
from streamrl_cli.trainer.algo.losses import aggregate
from streamrl_cli.trainer.loop.batch import Rollout, collate
from streamrl_cli.trainer.role.learner import Learner, LossConfig
from streamrl_cli.trainer.role.models import critic_forward, policy_forward
from streamrl_cli.trainer.role.moe import Routers
from streamrl_cli.transport.wire import Sample


def close(actual, expected, atol: float = 1e-5) -> None:
    actual = torch.as_tensor(actual)
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


def run(name: str, logp, old, adv, mask, max_len: int = 4, **override):
    """The loss of algorithm `name` (its preset, `override` on top) on one micro-batch: (loss, gradient
    with respect to logp, the loss's stats). The preset names the loss and aggregation to use."""
    p = {**presets.preset(name), **override}
    high = p["clip_ratio_high"] if p["clip_ratio_high"] is not None else p["clip_ratio"]
    logp = logp.clone().requires_grad_()
    per_token, stats = A.policy_loss(p["policy_loss"])(logp, old, adv, mask, p["clip_ratio"], high)
    num, units = aggregate(per_token, mask, p["loss_agg"], max_len)
    loss = num / units
    loss.backward()
    return loss.item(), logp.grad, stats


# A batch of two sequences: 2 and 3 response tokens (the third position of the first is padding).
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
LOGP = torch.tensor([[-1.0, -2.0, -7.0], [-0.5, -1.5, -3.0]])


# --- the registry ------------------------------------------------------------------------------


def test_the_registry_holds_exactly_the_names_a_recipe_may_give():
    assert set(A.ADVANTAGES) == set(schema.ADVANTAGES)
    assert set(A.POLICY_LOSSES) == set(schema.POLICY_LOSSES)
    assert set(A.CORRECTIONS) == set(schema.IS_LEVELS)
    assert set(schema.IS_MASKS) == {"off", *schema.IS_LEVELS}
    assert set(A.KL_ESTIMATORS) == set(schema.KL_ESTIMATORS)
    assert set(presets.PRESETS) == set(schema.ALGORITHMS)
    for name in schema.ALGORITHMS:  # every preset names registered parts
        p = presets.preset(name)
        assert p["advantage"] in A.ADVANTAGES and p["policy_loss"] in A.POLICY_LOSSES


def test_unknown_names_are_refused_with_the_valid_ones():
    with pytest.raises(ValueError, match="'vtrace'.*valid: gae, grpo, rloo, reinforce\\+\\+"):
        A.estimator("vtrace")
    with pytest.raises(ValueError, match="'dpo'.*valid: clip, gspo, cispo"):
        A.policy_loss("dpo")
    with pytest.raises(ValueError, match="'drpo'.*valid: ppo, grpo, dr-grpo, dapo"):
        presets.preset("drpo")
    with pytest.raises(ValueError, match="valid: token, sequence, geometric"):
        A.is_weights(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), 2.0, "batch")


# --- a new algorithm: one registered function ----------------------------------------------------


@pytest.fixture
def toy_loss():
    """REINFORCE's loss, -A · log π per token, registered as the policy loss "toy" for one test."""
    calls = []

    @A.POLICY_LOSSES.register("toy")
    def reinforce(logp, old_logp, advantages, mask, clip_low, clip_high, is_weights=None):
        calls.append(tuple(logp.shape))
        adv = A.per_token(advantages.detach(), logp)
        return -adv * logp * mask, {"tokens": (mask > 0).to(logp.dtype).sum()}

    yield calls
    A.POLICY_LOSSES.remove("toy")


def test_a_new_policy_loss_is_one_registered_function(toy_loss):
    # token-mean of -A·logp over the 5 valid tokens, A = [1, -1]: (1 + 2 - 0.5 - 1.5 - 3) / 5 = -0.4;
    # its gradient -A/5 on each valid token
    loss, grad, _ = run("grpo", LOGP, LOGP, torch.tensor([1.0, -1.0]), MASK, policy_loss="toy")
    close(loss, -0.4)
    close(grad, [[-0.2, -0.2, 0.0], [0.2, 0.2, 0.2]])
    # and the learner runs it by name, as a preset naming it would
    lrn = learner(policy_loss="toy")
    lrn.micro_step(collate([rollout([-math.log(8)] * 3, advantage=1.0)]), last=True)
    assert len(toy_loss) == 2 and lrn.sums["pg/tokens"] == 3.0  # run() above, then the learner
    assert lrn.actor.module.table.grad.abs().sum() > 0


# --- GRPO ---------------------------------------------------------------------------------------


def test_grpo_normalised_advantages_token_mean_loss_and_gradient():
    # rewards [1, 0]: mean 0.5, population std 0.5 -> advantages (±0.5)/(0.5 + 1e-6) = ±0.999998
    adv = A.estimator("grpo").group(torch.tensor([1.0, 0.0]), True)
    close(adv, [0.999998, -0.999998])
    # ratio 1 (old = logp): per token -A; token-mean over 5 tokens: (2·(-1) + 3·(+1)) / 5 = 0.2
    loss, grad, stats = run("grpo", LOGP, LOGP, torch.tensor([1.0, -1.0]), MASK)
    assert loss == pytest.approx(0.2)
    close(grad, [[-0.2, -0.2, 0.0], [0.2, 0.2, 0.2]])  # d(-r·A)/dlogp / 5 = -A/5
    close(stats["clip_frac"], 0.0)
    close(stats["tokens"], 5.0)


# --- Dr. GRPO -----------------------------------------------------------------------------------


def test_dr_grpo_drops_the_std_and_the_length_normalisation():
    p = presets.preset("dr-grpo")
    assert (p["grpo_std_norm"], p["loss_agg"]) == (False, "seq-mean-token-sum-norm")
    # rewards [1, 0] without std: [0.5, -0.5]; [3, 0, 0]: mean 1 -> [2, -1, -1] (GRPO: ±1.41, ∓0.71)
    close(A.estimator("grpo").group(torch.tensor([1.0, 0.0]), p["grpo_std_norm"]), [0.5, -0.5])
    close(A.estimator("grpo").group(torch.tensor([3.0, 0.0, 0.0]), False), [2.0, -1.0, -1.0])
    # Σ over tokens of -A / max_len (4) / sequences (2): (2·(-0.5) + 3·0.5) / 4 / 2 = 0.0625, whatever
    # the sequences' lengths; each token's gradient -A / 8, a long sequence's tokens count as much.
    loss, grad, _ = run("dr-grpo", LOGP, LOGP, torch.tensor([0.5, -0.5]), MASK, max_len=4)
    assert loss == pytest.approx(0.0625)
    close(grad, [[-0.0625, -0.0625, 0.0], [0.0625, 0.0625, 0.0625]])


# --- DAPO ---------------------------------------------------------------------------------------


def test_dapo_clips_higher_above_than_below_at_the_token_level():
    p = presets.preset("dapo")
    assert (p["clip_ratio"], p["clip_ratio_high"], p["kl_coef"]) == (0.2, 0.28, 0.0) and p["dynamic_sampling"]
    # Ratios against the old policy (old_policy=behaviour makes them differ from 1); range [0.8, 1.28].
    ratios = torch.tensor([[1.5, 1.2, 0.7, 0.9]])
    old = torch.full((1, 4), -1.0)
    logp = old + ratios.log()
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    loss, grad, stats = run("dapo", logp, old, adv, torch.ones(1, 4))
    # A>0 r=1.5: -1.28 (clipped, no gradient); A>0 r=1.2: -1.2 (inside 1.28: GRPO's 1.2 bound would
    # have clipped it); A<0 r=0.7: -min(-0.7, -0.8) = 0.8 (clipped); A<0 r=0.9: 0.9.
    # token-mean: (-1.28 - 1.2 + 0.8 + 0.9) / 4 = -0.195; gradients -r·A / 4 where unclipped.
    assert loss == pytest.approx(-0.195)
    close(grad, [[0.0, -0.3, 0.0, 0.225]])
    close(stats["clip_frac"], 2.0)


def test_dapo_soft_overlong_punishment():
    # L_max 20, buffer 4: nothing up to 16 tokens, then -(len - 16) / 4, -1 at 20
    assert [A.overlong_penalty(n, 20, 4, 1.0) for n in (5, 16, 17, 18, 20)] == [0.0, 0.0, -0.25, -0.5, -1.0]
    assert A.overlong_penalty(18, 20, 4, 0.5) == -0.25  # scaled by overlong_penalty
    assert A.overlong_penalty(20, 20, 0, 1.0) == 0.0  # buffer 0: off
    # The preset's buffer is a fifth of task.max_output_len (the paper: 4,096 of 20,480).
    a = presets.fill(AlgorithmConfig(name="dapo"), 20480)
    assert a.overlong_buffer == 4096


def test_dynamic_sampling_keeps_groups_whose_rewards_differ():
    assert A.informative([1.0, 0.0, 1.0])
    assert not A.informative([1.0, 1.0, 1.0])  # all solved
    assert not A.informative([0.0, 0.0])  # none solved
    assert not A.informative([0.3])  # one scored sample: no spread


# --- GSPO ---------------------------------------------------------------------------------------


def test_gspo_sequence_ratio_clipped_per_sequence():
    p = presets.preset("gspo")
    assert (p["loss_agg"], p["clip_ratio"], p["clip_ratio_high"]) == ("seq-mean-token-mean", 3e-4, 4e-4)
    # log-ratios: sequence 0 [0.1, 0.3] (mean 0.2: s = e^0.2 = 1.221403), sequence 1 [-0.1, 0, 0.1]
    # (mean 0: s = 1); the padding's log-ratio (5.0) must not count.
    old = LOGP - torch.tensor([[0.1, 0.3, 5.0], [-0.1, 0.0, 0.1]])
    adv = torch.tensor([1.0, -1.0])
    # Clip range [0.8, 1.2]: s_0 > 1.2 with A > 0 is clipped: its tokens -1.2 each, no gradient.
    # Sequence 1: -(1 · -1) = 1 per token, gradient -A·s = 1 per token.
    # seq-mean-token-mean: ((-1.2 - 1.2)/2 + (1 + 1 + 1)/3) / 2 = (-1.2 + 1) / 2 = -0.1
    loss, grad, stats = run("gspo", LOGP, old, adv, MASK, clip_ratio=0.2, clip_ratio_high=0.2)
    assert loss == pytest.approx(-0.1, abs=1e-6)
    close(grad, [[0.0, 0.0, 0.0], [1 / 6, 1 / 6, 1 / 6]])
    close(stats["clip_frac"], 2.0)  # both tokens of the clipped sequence
    # Wider clipping: s_0 is not clipped: each of its tokens -s_0 = -1.221403, and the gradient is
    # the paper's s_0·A_0 · (1/|y_0|) Σ ∇logp / 2 sequences: -1.221403 / 2 / 2 = -0.305351 per token.
    loss, grad, _ = run("gspo", LOGP, old, adv, MASK, clip_ratio=0.5, clip_ratio_high=0.5)
    assert loss == pytest.approx((-math.exp(0.2) + 1.0) / 2, abs=1e-6)
    close(grad, [[-0.305351, -0.305351, 0.0], [1 / 6, 1 / 6, 1 / 6]])


def test_gspo_at_ratio_one_is_the_sequence_mean_of_grpo():
    # The trainer's own log-probs as the old policy (one step): s = 1, gradient -A / |y| / B.
    loss, grad, _ = run("gspo", LOGP, LOGP, torch.tensor([1.0, -1.0]), MASK)
    assert loss == pytest.approx(0.0)  # (-1 + 1) / 2
    close(grad, [[-0.25, -0.25, 0.0], [1 / 6, 1 / 6, 1 / 6]])


# --- CISPO --------------------------------------------------------------------------------------


def test_cispo_clips_the_weight_and_keeps_every_tokens_gradient():
    p = presets.preset("cispo")
    assert (p["policy_loss"], p["clip_ratio"], p["clip_ratio_high"]) == ("cispo", 1.0, 1.0)
    logp = torch.tensor([[-1.0, -2.0, -0.5]])
    ratios = torch.tensor([[1.5, 0.5, 1.0]])
    old = logp - ratios.log()
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    # weights clip(r, 1 - 1.0, 1 + 0.2) = [1.2, 0.5, 1.0]; loss -w·A·logp = [1.2, 1.0, -0.5];
    # token-mean 1.7 / 3; gradient -w·A / 3 = [-0.4, -0.166667, 0.333333]: the clipped first token
    # keeps a gradient (PPO's clip would give it none: A > 0, r above 1 + 0.2).
    loss, grad, stats = run("cispo", logp, old, adv, torch.ones(1, 3), clip_ratio_high=0.2)
    assert loss == pytest.approx(1.7 / 3)
    close(grad, [[-0.4, -0.5 / 3, 1.0 / 3]])
    close(stats["clip_frac"], 1.0)


# --- RLOO ---------------------------------------------------------------------------------------


def test_rloo_leave_one_out_baseline():
    # [1, 0, 0, 1]: 1 - (0 + 0 + 1)/3 = 2/3, 0 - (1 + 0 + 1)/3 = -2/3
    close(A.estimator("rloo").group(torch.tensor([1.0, 0.0, 0.0, 1.0]), True), [2 / 3, -2 / 3, -2 / 3, 2 / 3])
    # [3, 0, 0]: 3 - 0 = 3, 0 - 1.5 = -1.5 (no std: grpo_std_norm does not apply)
    close(A.estimator("rloo").group(torch.tensor([3.0, 0.0, 0.0]), True), [3.0, -1.5, -1.5])
    close(A.estimator("rloo").group(torch.tensor([0.7]), True), [0.0])  # no other sample, no baseline
    # The loss is the clipped surrogate: at ratio 1 the same as GRPO's with these advantages.
    loss, grad, _ = run("rloo", LOGP, LOGP, torch.tensor([2 / 3, -2 / 3]), MASK)
    assert loss == pytest.approx((-2 * 2 / 3 + 3 * 2 / 3) / 5)
    close(grad, [[-2 / 15, -2 / 15, 0.0], [2 / 15, 2 / 15, 2 / 15]])


# --- REINFORCE++ --------------------------------------------------------------------------------


def test_reinforce_pp_normalises_over_the_whole_batch_token_weighted():
    assert A.estimator("reinforce++").whiten and A.estimator("reinforce++-baseline").whiten
    assert not A.estimator("grpo").whiten
    # No group baseline: the rewards as they are, then over the batch. Rewards [1, 2, 3] with 1, 2, 3
    # tokens: token mean (1 + 4 + 9)/6 = 7/3, variance (1·(4/3)² + 2·(1/3)² + 3·(2/3)²)/6 = 5/9,
    # std √5/3: advantages (-4/3, -1/3, 2/3) / (√5/3) = -4/√5, -1/√5, 2/√5.
    raw = A.estimator("reinforce++").group(torch.tensor([1.0, 2.0, 3.0]), True)
    close(raw, [1.0, 2.0, 3.0])
    white = A.batch_whiten(raw, torch.tensor([1.0, 2.0, 3.0]))
    close(white, [-4 / math.sqrt(5), -1 / math.sqrt(5), 2 / math.sqrt(5)], atol=1e-5)
    # A sequence of length 0 (unscored) takes no part and gets 0.
    close(A.batch_whiten(torch.tensor([1.0, 9.0, 3.0]), torch.tensor([1.0, 0.0, 1.0])), [-1.0, 0.0, 1.0])


def test_reinforce_pp_baseline_subtracts_the_group_mean_first():
    # Two groups: [1, 3] -> [-1, 1] and [10, 10] -> [0, 0] (without the baseline the second group's
    # large rewards would dominate). Equal lengths: batch mean 0, population std √(2/4) = 0.7071.
    baseline = A.estimator("reinforce++-baseline").group
    groups = [baseline(torch.tensor(g), True) for g in ([1.0, 3.0], [10.0, 10.0])]
    close(torch.cat(groups), [-1.0, 1.0, 0.0, 0.0])
    white = A.batch_whiten(torch.cat(groups), torch.ones(4))
    close(white, [-math.sqrt(2), math.sqrt(2), 0.0, 0.0], atol=1e-5)


# --- PPO ----------------------------------------------------------------------------------------


def test_ppo_preset_trains_a_critic_with_the_kl_in_the_reward():
    p = presets.preset("ppo")
    assert (p["advantage"], p["kl_mode"], p["kl_estimator"]) == ("gae", "penalty", "k1")
    assert A.estimator("gae").critic and A.estimator("gae").group is None
    # Per-token advantages (GAE's) into the clipped surrogate: ratios [1.5, 1.0] against the generators'
    # log-probs, A_t = [2, -1]: -min(3, 2.4) = -2.4 (clipped: no gradient), 1.0 (gradient -r·A = 1).
    old = torch.tensor([[-1.0, -1.0]])
    logp = old + torch.tensor([[1.5, 1.0]]).log()
    loss, grad, _ = run("ppo", logp, old, torch.tensor([[2.0, -1.0]]), torch.ones(1, 2))
    assert loss == pytest.approx((-2.4 + 1.0) / 2)
    close(grad, [[0.0, 0.5]])


# --- off-policy corrections ---------------------------------------------------------------------


def test_truncated_importance_weights_per_token_sequence_and_geometric():
    behaviour = torch.zeros(2, 3)
    trainer = torch.tensor([[math.log(1.5), math.log(1.2), 9.0], [math.log(3.0), math.log(0.5), 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    # token: min(r, 2) = [1.5, 1.2 | 2, 0.5, 1]; the padding (ratio e^9) gets 0
    close(A.is_weights(trainer, behaviour, mask, 2.0, "token"), [[1.5, 1.2, 0.0], [2.0, 0.5, 1.0]])
    # sequence: products 1.8 and 1.5 (both under the cap) for every token of their sequence
    close(A.is_weights(trainer, behaviour, mask, 2.0, "sequence"), [[1.8, 1.8, 0.0], [1.5, 1.5, 1.5]])
    close(A.is_weights(trainer, behaviour, mask, 1.6, "sequence"), [[1.6, 1.6, 0.0], [1.5, 1.5, 1.5]])
    # geometric: 1.8^(1/2) = 1.341641 and 1.5^(1/3) = 1.144714
    close(
        A.is_weights(trainer, behaviour, mask, 2.0, "geometric"),
        [[1.341641, 1.341641, 0.0], [1.144714, 1.144714, 1.144714]],
    )


def test_masking_outside_the_bounds_per_token_and_per_sequence():
    behaviour = torch.zeros(2, 4)
    ratios = torch.tensor([[3.0, 1.2, 0.4, 0.5], [1.1, 1.1, 1.1, 1.0]])
    trainer = ratios.log()
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    # token, [0.5, 2]: 3 and 0.4 are out (0.5 is kept: the bounds are inclusive) -> IcePop
    icepop = A.keep_mask(trainer, behaviour, mask, "token", 0.5, 2.0)
    close(icepop, [[0.0, 1.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    # sequence (product): 3·1.2·0.4·0.5 = 0.72 kept; 1.1³ = 1.331 kept; with high 1.3 the second goes
    close(A.keep_mask(trainer, behaviour, mask, "sequence", 0.5, 2.0), [[1.0] * 4, [1.0, 1.0, 1.0, 0.0]])
    close(A.keep_mask(trainer, behaviour, mask, "sequence", 0.5, 1.3), [[1.0] * 4, [0.0] * 4])
    # geometric: 0.72^(1/4) = 0.921 is under 0.95 (masked), 1.331^(1/3) = 1.1 is inside [0.95, 1.2]
    close(A.keep_mask(trainer, behaviour, mask, "geometric", 0.95, 1.2), [[0.0] * 4, [1.0, 1.0, 1.0, 0.0]])


class Bigram(torch.nn.Module):
    """A stand-in policy: the logits of the next token are a row of a table (all zeros: uniform)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.table = torch.nn.Parameter(torch.zeros(vocab, vocab))

    def forward(self, input_ids, **_):
        return SimpleNamespace(logits=self.table[input_ids])


class Engine:
    """What the learner asks of a DeepSpeed engine, for one process and no ZeRO."""

    def __init__(self, module):
        self.module = module

    def __call__(self, **kw):
        return self.module(**kw)

    def train(self):
        self.module.train()

    def set_gradient_accumulation_boundary(self, last):
        pass

    def backward(self, loss, scale_wrt_gas=False):
        loss.backward()


def learner(**algorithm) -> Learner:
    c = LossConfig.from_recipe(
        presets.filled(AlgorithmConfig(kl_coef=0.0, is_correction="off", **algorithm), 16), 16
    )
    out = Learner.__new__(Learner)
    out.loss, out.world, out.device = c, 1, torch.device("cpu")
    out.actor, out.critic, out.ref = Engine(Bigram(8)), None, None
    # No DeepSpeed, no chunked head, no sequence parallelism: the plain forwards.
    out.chunk, out.sp = 0, None
    out._policy_forward, out._critic_forward = policy_forward, critic_forward
    out.routers = Routers(out.actor.module)  # a dense model: no routers
    out._begin()
    return out


def rollout(behaviour: list[float], advantage: float) -> Rollout:
    sample = Sample(prompt_id="p", sample_index=0, token_ids=[3] * len(behaviour), logprobs=behaviour,
                    finish_reason="stop", weight_version=0)  # fmt: skip
    return Rollout(prompt_tokens=[1, 2], sample=sample, reward=1.0, advantage=advantage)


def test_the_learner_masks_tokens_out_of_the_loss_and_records_the_share():
    # A uniform policy over 8 tokens: the trainer's log-prob is -ln 8 for every token. The generators'
    # give ratios 1, 3 (over 2: masked) and 1/4 (under 0.5: masked) -> 2 of 3 tokens masked.
    u = -math.log(8)
    rows = [rollout([u, u - math.log(3.0), u + math.log(4.0)], advantage=1.0)]
    lrn = learner(is_mask="token")
    lrn.micro_step(collate(rows), last=True)
    assert lrn.sums["offpolicy/masked"] == 2.0 and lrn.sums["offpolicy/tokens"] == 3.0
    assert lrn.units == 1.0  # token-mean: the masked tokens leave the denominator too
    assert lrn.sums["pg/tokens"] == 1.0
    # The gradient is the kept token's alone: -A · ∇logp of one token (the first prediction, from the
    # prompt's last token, 2); with the sequence masked (product 3/4 inside [0.5, 2]) all three count.
    grad = lrn.actor.module.table.grad
    assert grad[2].abs().sum() > 0 and grad[3].abs().sum() == 0
    whole = learner(is_mask="sequence")
    whole.micro_step(collate(rows), last=True)
    assert whole.sums["offpolicy/masked"] == 0.0 and whole.units == 3.0
    assert whole.actor.module.table.grad[3].abs().sum() > 0


def test_the_learner_takes_the_generators_log_probs_as_old_policy_when_asked():
    # Ratio 3 against the generators' log-probs, A > 0: clipped at 1.2, so no gradient; against the
    # trainer's own log-probs (ratio 1) the same token has one.
    u = -math.log(8)
    rows = [rollout([u - math.log(3.0)], advantage=1.0)]
    bypass = learner(old_policy="behaviour")
    bypass.micro_step(collate(rows), last=True)
    assert bypass.sums["pg/clip_frac"] == 1.0
    assert bypass.actor.module.table.grad.abs().sum() == 0
    own = learner()
    own.micro_step(collate(rows), last=True)
    assert own.sums["pg/clip_frac"] == 0.0 and own.actor.module.table.grad.abs().sum() > 0


# --- on-policy distillation ---------------------------------------------------------------------


def test_distillation_adds_the_teachers_log_ratio_per_token_or_replaces_the_task_advantage():
    # Sequence advantages [1, -1] per token; teacher minus behaviour log-probs per token:
    # row 0: (-0.5 - -1.0, -1.0 - -2.0) = (0.5, 1.0), padding 0; row 1: (-1.0 - -0.5, -1.5 - -1.5,
    # -2.0 - -3.0) = (-0.5, 0.0, 1.0). With coef 2: added -> row 0 (2, 3, 0), row 1 (-2, -1, 1).
    adv = torch.tensor([[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0]])
    teacher = torch.tensor([[-0.5, -1.0, -9.0], [-1.0, -1.5, -2.0]])
    out = A.distilled_advantages(adv, teacher, LOGP, MASK, 2.0, task=True)
    close(out, [[2.0, 3.0, 0.0], [-2.0, -1.0, 1.0]])
    alone = A.distilled_advantages(adv, teacher, LOGP, MASK, 2.0, task=False)
    close(alone, [[1.0, 2.0, 0.0], [-1.0, 0.0, 2.0]])


def test_the_learner_trains_toward_the_teacher_and_records_the_reverse_kl():
    # A uniform policy: every behaviour log-prob is -ln 8. The teacher finds the first token twice as
    # likely (log 2 above) and the second half as likely: reverse KL per token (behaviour - teacher)
    # = (-ln 2, +ln 2), mean 0. With the task's advantage off (distill_task_reward false) the first
    # token's advantage is +ln 2 and the second's -ln 2: the loss raises one and lowers the other.
    u = -math.log(8)
    rows = [rollout([u, u], advantage=5.0)]
    rows[0].sample.teacher_logprobs = [u + math.log(2.0), u - math.log(2.0)]
    lrn = learner(distill_coef=1.0, distill_task_reward=False)
    lrn.micro_step(collate(rows), last=True)
    assert lrn.sums["distill/tokens"] == 2.0 and lrn.sums["distill/unscored"] == 0.0
    assert abs(lrn.sums["distill/reverse_kl"]) < 1e-6
    grad = lrn.actor.module.table.grad
    # The first token (3, predicted from the prompt's last token 2) is pushed up: a negative loss
    # gradient on table[2, 3]; the second (predicted from 3) down: positive on table[3, 3].
    assert grad[2, 3] < 0 < grad[3, 3]
    # The task's advantage alone (5 for both) would push both up; unscored tokens are counted.
    plain = [rollout([u, u], advantage=5.0)]
    unscored = learner(distill_coef=1.0)
    unscored.micro_step(collate(plain), last=True)
    assert unscored.sums["distill/unscored"] == 2.0
    assert unscored.actor.module.table.grad[2, 3] < 0 and unscored.actor.module.table.grad[3, 3] < 0
