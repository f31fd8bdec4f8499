"""Mixture-of-experts models in the trainer: the tiny Qwen3-MoE the builders make, the routers'
load-balancing loss (against transformers' own formula), which tokens count (a packed row's tail does
not), and the loss term through the Learner: it reaches the routers' weights, its metrics are logged,
and a dense model with the key set is refused."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from support.rollouts import random_rollouts

from streamrl_cli.models.architecture import moe
from streamrl_cli.models.tiny import MOE_SPEC, TinySpec, build_tiny_model
from streamrl_cli.trainer.loop.batch import Rollout, collate
from streamrl_cli.trainer.role.models import Packed, load_policy, policy_forward
from streamrl_cli.trainer.role.moe import Routers, routers


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("moe") / "moe", TinySpec(**MOE_SPEC)))


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("moe") / "dense"))


def rollouts(n: int, seed: int) -> list[Rollout]:
    return random_rollouts(n, seed, scored=True)


def test_the_moe_builder_makes_a_qwen3_moe_that_the_checks_read(moe_dir, dense_dir):
    config = json.loads(open(f"{moe_dir}/config.json").read())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    # (transformers 5 writes the expert count as num_local_experts)
    assert moe(config)["experts"] == 8 and moe(config)["experts_per_token"] == 2
    assert moe(json.loads(open(f"{dense_dir}/config.json").read())) == {}
    model = load_policy(moe_dir, torch.float32)
    assert len(routers(model)) == 2  # one per layer
    assert not Routers(load_policy(dense_dir, torch.float32))
    with pytest.raises(ValueError, match="experts_per_token"):
        TinySpec(experts=4, experts_per_token=5)


def test_the_aux_loss_is_transformers_load_balancing_loss_and_counts_only_real_tokens(moe_dir, monkeypatch):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    model = load_policy(moe_dir, torch.float32)
    hooked = Routers(model)
    # One unpadded row: every token is real, so transformers' loss over its router logits applies.
    mb = collate(rollouts(1, seed=3))
    policy_forward(model, mb, 1.0, routers=hooked)
    ours = hooked.aux_loss()
    out = model(input_ids=mb.input_ids, output_router_logits=True)
    # transformers sums f_e over the k choices of each token (k × ours) and pools the layers' tokens
    # (the same as averaging per layer when every layer routes the same tokens).
    per_layer = [load_balancing_loss_func((lg,), 8, 2) / 2 for lg in out.router_logits]
    torch.testing.assert_close(ours, torch.stack(per_layer).mean(), atol=1e-6, rtol=1e-6)
    assert 1.0 <= float(ours) <= 8.0
    imbalance = hooked.imbalance()
    assert sorted(imbalance) == [0, 1] and all(1.0 <= v <= 4.0 for v in imbalance.values())

    # Packed rows of uneven sequences, each row as long as the longest: the rows' tails are not
    # tokens of any sequence.
    monkeypatch.setattr("streamrl_cli.trainer.role.models.PACK_TOKENS", 1)
    mb = collate(rollouts(5, seed=7))
    packed = Packed.of(mb)
    assert packed is not None and int(packed.real.sum()) < packed.ids.numel()
    policy_forward(model, mb, 1.0, routers=hooked)
    counted = [chosen.shape[0] for _logits, chosen in hooked._seen.values()]
    assert counted == [int(mb.attention_mask.sum())] * 2


LEARNER = """
import json, sys, torch
from streamrl_cli.errors import StreamRLError
from streamrl_cli.recipe import presets
from streamrl_cli.recipe.schema import AlgorithmConfig, TrainerConfig
from streamrl_cli.trainer.loop.batch import collate
from streamrl_cli.trainer.role.learner import Learner, LossConfig, OptimConfig
from streamrl_cli.trainer.role.learner import init_distributed, open_group_store
sys.path.insert(0, sys.argv[3])  # tests/
from support.rollouts import random_rollouts

path, dense = sys.argv[1], sys.argv[2]
store, address = open_group_store(1, "127.0.0.1")
init_distributed(0, 1, address, "gloo", store)
rows = random_rollouts(6, seed=4, scored=True)
out = {}
for coef in (0.0, 0.5):
    keys = dict(name="grpo", router_aux_loss_coef=coef, is_correction="off")
    algorithm = presets.filled(AlgorithmConfig(**keys), 16)
    torch.manual_seed(0)
    opt = OptimConfig(algorithm=algorithm, trainer=TrainerConfig(zero_stage=1, logits_chunk=0))
    learner = Learner(path, LossConfig.from_recipe(algorithm, 16), opt, torch.device("cpu"), torch.float32)
    learner.micro_step(collate(rows[:3]), last=False)
    learner.micro_step(collate(rows[3:]), last=True)
    stats = learner.finish_gradients()
    grads = learner.full_gradients()
    out[coef] = (grads, stats)
router = "model.layers.0.mlp.gate.weight"
(g0, s0), (g1, s1) = out[0.0], out[0.5]
refused = ""
try:
    keys = dict(name="grpo", router_aux_loss_coef=0.01, is_correction="off")
    algorithm = presets.filled(AlgorithmConfig(**keys), 16)
    opt = OptimConfig(algorithm=algorithm, trainer=TrainerConfig(zero_stage=1))
    Learner(dense, LossConfig.from_recipe(algorithm, 16), opt, torch.device("cpu"), torch.float32)
except StreamRLError as e:
    refused = str(e)
print(json.dumps({
    "router_diff": (g1[router] - g0[router]).abs().max().item(),
    "other_diff": (g1["model.embed_tokens.weight"] - g0["model.embed_tokens.weight"]).abs().max().item(),
    "stats": {k: v for k, v in s1.items() if k.startswith("moe/")},
    "same_policy_loss": abs(s1["loss/policy"] - s0["loss/policy"]),
    "refused": refused,
}))
"""


@pytest.mark.slow
def test_the_learner_adds_the_routers_loss_and_logs_their_load(moe_dir, dense_dir, tmp_path):
    script = tmp_path / "learner.py"
    script.write_text(LEARNER)
    here = str(__import__("pathlib").Path(__file__).parents[2])  # tests/
    out = subprocess.run(
        [sys.executable, str(script), moe_dir, dense_dir, here], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    # The load-balancing term's gradient reaches the routers (and, through them, what feeds them).
    assert r["router_diff"] > 1e-4, r
    assert r["same_policy_loss"] < 1e-6, r  # the policy's loss itself is unchanged
    stats = r["stats"]
    assert set(stats) == {"moe/aux_loss", "moe/imbalance/layer0", "moe/imbalance/layer1"}, stats
    assert 1.0 <= stats["moe/aux_loss"] <= 8.0 and all(
        1.0 <= stats[f"moe/imbalance/layer{i}"] <= 4.0 for i in (0, 1)
    )
    assert "algorithm.router_aux_loss_coef=0.01" in r["refused"] and "dense" in r["refused"], r


# ---- routing replay: the generator's experts in the trainer's forward ----


def own_routing(model, rollout: Rollout) -> bytes:
    """The experts `model`'s routers choose at each input position of one rollout but the last, as a
    generator would send them (uint8 [positions, layers, k])."""
    hooked = Routers(model)
    mb = collate([rollout])
    policy_forward(model, mb, 1.0, routers=hooked)
    hooked.close()
    layers = [chosen for _logits, chosen in sorted(hooked._seen.items(), key=lambda kv: kv[0])]
    stacked = torch.stack([c[1] for c in layers], dim=1)[:-1]  # [positions, layers, k]
    return stacked.to(torch.uint8).numpy().tobytes()


def with_routing(rollout: Rollout, routed: bytes) -> Rollout:
    import msgspec

    return Rollout(prompt_tokens=rollout.prompt_tokens, sample=msgspec.structs.replace(rollout.sample,
                   routed_experts=routed), reward=rollout.reward, advantage=rollout.advantage)  # fmt: skip


def test_replaying_the_trainers_own_routing_changes_nothing_and_another_changes_the_experts(
    moe_dir, monkeypatch
):
    monkeypatch.setattr("streamrl_cli.trainer.role.models.PACK_TOKENS", 1)  # packed rows with tails
    model = load_policy(moe_dir, torch.float32)
    rows = rollouts(4, seed=11)
    plain, _ = policy_forward(model, collate(rows), 1.0)
    replayed = [with_routing(r, own_routing(model, r)) for r in rows]
    mb = collate(replayed)
    assert mb.routed is not None and mb.routed.shape[-1] == 2 * 2  # layers × k
    hooked = Routers(model)
    logp, _ = policy_forward(model, mb, 1.0, routers=hooked)
    torch.testing.assert_close(logp, plain, atol=1e-6, rtol=1e-6)
    differ, replayed_n = hooked.replay_differ()
    real_positions = sum(len(r.prompt_tokens) + r.response_len - 1 for r in rows)
    assert differ == 0 and replayed_n == 2 * real_positions  # every layer of every routed position

    # Other experts (each choice moved to the next expert): the same tokens through other weights.
    other = []
    for r in replayed:
        ids = torch.frombuffer(bytearray(r.sample.routed_experts), dtype=torch.uint8).view(-1, 2, 2)
        other.append(with_routing(r, ((ids.long() + 1) % 8).to(torch.uint8).numpy().tobytes()))
    logp2, _ = policy_forward(model, collate(other), 1.0, routers=hooked)
    assert (logp2 - plain).abs().max() > 1e-3
    differ, replayed_n = hooked.replay_differ()
    assert differ == replayed_n > 0  # every replayed choice differs from the router's own
    # Its gradient still reaches the routers (their weights of the replayed experts) and the experts.
    model.zero_grad()
    logp3, _ = policy_forward(model, collate(other), 1.0, routers=hooked)
    logp3.sum().backward()
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0

    # Positions the generator did not compute (255) keep the trainer's own routing.
    unknown = [with_routing(r, bytes([255]) * len(r.sample.routed_experts)) for r in rows]
    logp4, _ = policy_forward(model, collate(unknown), 1.0, routers=hooked)
    torch.testing.assert_close(logp4, plain, atol=1e-6, rtol=1e-6)
    assert hooked.replay_differ() == (0.0, 0.0)


def test_routed_experts_that_do_not_fit_the_sample_or_the_model_are_refused(moe_dir):
    row = rollouts(1, seed=2)[0]
    positions = len(row.prompt_tokens) + row.response_len - 1
    with pytest.raises(ValueError, match="do not divide over its"):
        collate([with_routing(row, bytes(positions * 4 + 1))])
    model = load_policy(moe_dir, torch.float32)
    hooked = Routers(model)
    with pytest.raises(ValueError, match="this model routes 2 layers × 2 experts"):
        policy_forward(model, collate([with_routing(row, bytes(positions * 6))]), 1.0, routers=hooked)
    with pytest.raises(ValueError, match="was sent expert 9, and it has 8"):
        policy_forward(model, collate([with_routing(row, bytes([9]) * (positions * 4))]), 1.0, routers=hooked)
