"""LoRA on the actor under real DeepSpeed (CPU, gloo, tiny model): only the adapters train and sit in
the optimizer, the reference is the base with the adapters off (no second copy), the generators get
the merged weights under the plain Hugging Face names, and checkpoints hold the adapters and their
optimizer state only and resume exactly."""

from __future__ import annotations

import random

import pytest
import torch
from support.configs import optim_config

from streamrl_cli.models.tiny import build_tiny_model
from streamrl_cli.recipe import presets
from streamrl_cli.recipe.schema import AlgorithmConfig, LoraConfig
from streamrl_cli.trainer.loop.batch import Rollout, collate
from streamrl_cli.trainer.role import lora as lora_
from streamrl_cli.trainer.role.checkpoint import CheckpointMismatch, load_engines, save_engines
from streamrl_cli.trainer.role.export import ExportError, export_checkpoint
from streamrl_cli.trainer.role.learner import Learner, LossConfig, init_distributed, open_group_store
from streamrl_cli.trainer.role.models import load_policy, policy_forward
from streamrl_cli.transport.wire import Sample

pytestmark = pytest.mark.slow

LORA = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])
CFG = LossConfig.from_recipe(
    presets.filled(AlgorithmConfig(name="grpo", kl_coef=0.05, is_correction="off"), 16), 16
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("lora") / "tiny")
    store, address = open_group_store(1, "127.0.0.1")
    init_distributed(0, 1, address, "gloo", store)
    return str(path)


def rollouts(n: int, seed: int) -> list[Rollout]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        resp = [rng.randrange(1, 400) for _ in range(rng.randint(2, 10))]
        sample = Sample(prompt_id=f"p{i // 2}", sample_index=i % 2, token_ids=resp,
                        logprobs=[-1.0] * len(resp), finish_reason="stop", weight_version=0)  # fmt: skip
        prompt = [rng.randrange(1, 400) for _ in range(rng.randint(2, 8))]
        out.append(Rollout(prompt_tokens=prompt, sample=sample, reward=0.0, advantage=rng.gauss(0, 1)))
    return out


def learner(path: str, stage: int, lora: LoraConfig | None = LORA) -> Learner:
    opt = optim_config(zero_stage=stage, lr=0.05)
    return Learner(path, CFG, opt, torch.device("cpu"), torch.float32, lora=lora)


def train(lrn: Learner, seed: int) -> dict[str, float]:
    rows = rollouts(6, seed)
    lrn.micro_step(collate(rows[:4]), last=False)
    lrn.micro_step(collate(rows[4:]), last=True)
    return lrn.step()


def optimizer_elements(lrn: Learner, stage: int) -> int:
    """Elements the optimizer updates (and holds Adam states for), as DeepSpeed laid them out."""
    opt = lrn.actor.optimizer
    if stage == 0:
        return sum(p.numel() for g in opt.param_groups for p in g["params"])
    flat = opt.fp32_partitioned_groups_flat if stage == 3 else opt.single_partition_of_fp32_groups
    return sum(t.numel() for t in flat)


def logp(model: torch.nn.Module, rows: list[Rollout]) -> torch.Tensor:
    mb = collate(rows)
    with torch.no_grad():
        out, _ = policy_forward(model.eval(), mb, CFG.sampling)
    return out[mb.mask.bool()]


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_only_the_adapters_train_and_the_reference_is_the_base_with_them_off(model_dir, stage):
    base = load_policy(model_dir, torch.float32)
    everything = sum(p.numel() for p in base.parameters())
    lrn = learner(model_dir, stage)
    assert lrn.ref is None  # KL is on (kl_coef 0.05), yet no frozen copy is loaded
    module = lrn.actor.module
    adapters = {n: p for n, p in module.named_parameters() if p.requires_grad}
    assert adapters and all(lora_.is_adapter(n) for n in adapters)
    n_adapter = sum(p.ds_numel if stage == 3 else p.numel() for p in adapters.values())
    held = optimizer_elements(lrn, stage)
    # the optimizer holds the adapters, not the base (ZeRO pads its flat partition a little)
    assert n_adapter <= held < n_adapter + 64, (held, n_adapter)
    assert stage != 0 or held == n_adapter
    assert held < everything / 10
    print(f"stage {stage}: optimizer {held} elements with LoRA, {everything} without")
    train(lrn, seed=1)
    stats = train(lrn, seed=2)  # a second step: B is no longer 0, the policy has left the base
    assert stats["loss/kl"] > 0
    rows = rollouts(5, seed=99)
    base_logp = logp(base, rows)
    mb = collate(rows)
    ref = lrn.reference_logp(mb)[mb.mask.bool()]
    torch.testing.assert_close(ref, base_logp, atol=1e-6, rtol=0)  # the base model's log-probs
    assert module.training  # the reference's forward put the actor back in training mode
    state = lrn.full_state()
    for name, p in base.named_parameters():  # the base weights the adapters do not touch are unchanged
        if not any(t in name for t in LORA.target_modules):
            assert torch.equal(state[name], p.detach()), name
    with torch.no_grad():
        if stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(module.parameters())):
                actor_logp = logp(module, rows)
        else:
            actor_logp = logp(module, rows)
    assert (actor_logp - base_logp).abs().max() > 1e-3  # the trained adapters do change the policy


@pytest.mark.parametrize("stage", [1, 3])
def test_the_published_weights_are_peft_merge_and_unload_under_the_hf_names(model_dir, stage):
    lrn = learner(model_dir, stage)
    train(lrn, seed=3)
    module = lrn.actor.module
    if stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters())):
            everything = {n: p.detach().clone() for n, p in module.named_parameters()}
    else:
        everything = {n: p.detach().clone() for n, p in module.named_parameters()}
    got = lrn.full_state()
    # PEFT's own merge, on a copy built from the same weights
    copy = lora_.apply(load_policy(model_dir, torch.float32), LORA)
    missing, unexpected = copy.load_state_dict(everything, strict=False)
    assert not unexpected and not [m for m in missing if "lm_head" not in m]
    rows = rollouts(4, seed=5)
    adapted = logp(copy, rows)  # W·x + (alpha / rank)·B·A·x, before merging
    merged = copy.merge_and_unload()
    want = {n: p.detach() for n, p in merged.named_parameters()}
    assert set(got) == set(want) == {n for n, _ in load_policy(model_dir, torch.float32).named_parameters()}
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=0)
    # the trained model is not changed by publishing: its base weights are still the base's
    after = lrn.full_state()
    assert all(torch.equal(after[n], got[n]) for n in got)
    base = load_policy(model_dir, torch.float32).state_dict()
    q = "model.layers.0.self_attn.q_proj.weight"
    assert (got[q] - base[q]).abs().max() > 1e-4  # merged: not the base weight
    if stage != 3:
        assert torch.equal(
            module.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight, base[q]
        )
    # a plain transformers model with these weights computes what the adapted model computes
    plain = load_policy(model_dir, torch.float32)
    plain.load_state_dict(got, strict=False)
    torch.testing.assert_close(logp(plain, rows), adapted, atol=1e-5, rtol=0)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_checkpoint_holds_the_adapters_and_resumes_to_the_same_next_step(model_dir, tmp_path, stage):
    ckpt = tmp_path / "iter-000001"
    first = learner(model_dir, stage)
    train(first, seed=10)
    save_engines(first, ckpt, {"iteration": 1})
    train(first, seed=11)
    uninterrupted = first.full_state()
    saved = {}
    for f in (ckpt / "actor" / "ckpt").glob("*model_states.pt"):
        saved.update(torch.load(f, map_location="cpu", weights_only=False)["module"] or {})
    assert saved and all(lora_.is_adapter(n) for n in saved)  # no base weight in the checkpoint
    assert (ckpt / "actor" / lora_.CONFIG_FILE).is_file()
    size = sum(f.stat().st_size for f in (ckpt / "actor").rglob("*") if f.is_file())
    full = sum(p.numel() * 4 for p in load_policy(model_dir, torch.float32).parameters())
    assert size < full / 2, (size, full)  # adapters and their Adam states: far below the model alone
    resumed = learner(model_dir, stage)
    assert load_engines(resumed, ckpt) == {"iteration": 1}
    train(resumed, seed=11)
    got = resumed.full_state()
    worst = max((got[n] - uninterrupted[n]).abs().max().item() for n in got)
    assert worst < 1e-6, worst
    # a fresh learner that did not load the checkpoint ends elsewhere (the check can fail)
    fresh = learner(model_dir, stage)
    train(fresh, seed=11)
    assert max((fresh.full_state()[n] - uninterrupted[n]).abs().max().item() for n in got) > 1e-3
    # a full-weight run cannot resume from adapters, nor the other way round
    with pytest.raises(CheckpointMismatch, match="trained LoRA adapters"):
        load_engines(learner(model_dir, stage, lora=None), ckpt)


def test_a_lora_checkpoint_exports_merged_and_as_a_peft_adapter_with_the_trainers_logprobs(
    model_dir, tmp_path
):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    lrn = learner(model_dir, 1)
    train(lrn, seed=20)
    ckpt = tmp_path / "iter-000001"
    save_engines(lrn, ckpt, {"iteration": 1})
    rows = rollouts(6, seed=21)
    want = logp(lrn.actor.module, rows)
    base = logp(load_policy(model_dir, torch.float32), rows)
    assert (want - base).abs().max() > 1e-3  # the adapters changed the policy: the checks can fail

    merged = export_checkpoint(ckpt, model_dir, tmp_path / "merged")
    plain = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    assert not any(".lora_" in n for n, _ in plain.named_parameters())  # a plain HF model
    torch.testing.assert_close(logp(plain, rows), want, atol=1e-5, rtol=1e-5)

    adapter = export_checkpoint(ckpt, model_dir, tmp_path / "adapter", adapter=True)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in adapter.iterdir()}
    size = sum(p.stat().st_size for p in adapter.glob("adapter_model.*"))
    assert size < sum(p.stat().st_size for p in merged.glob("*.safetensors")) / 4  # the adapters only
    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), adapter
    )
    torch.testing.assert_close(logp(peft_model, rows), want, atol=1e-5, rtol=1e-5)

    full = learner(model_dir, 1, lora=None)
    train(full, seed=20)
    save_engines(full, tmp_path / "iter-full", {"iteration": 1})
    with pytest.raises(ExportError, match="no adapter to export"):
        export_checkpoint(tmp_path / "iter-full", model_dir, tmp_path / "nothing", adapter=True)
    assert not (tmp_path / "nothing").exists()


@pytest.mark.parametrize("stage", [1, 3])
def test_with_adapter_sync_the_published_weights_are_the_adapters_as_peft_saves_them(model_dir, stage):
    """model.lora.sync adapter: each version is the adapters alone (gathered under ZeRO-3), by the names
    of PEFT's saved adapter (what vLLM's LoRA loader reads), and they give the trained policy."""
    import dataclasses

    from peft.utils import get_peft_model_state_dict

    lrn = learner(model_dir, stage, lora=dataclasses.replace(LORA, sync="adapter"))
    train(lrn, seed=30)
    got = lrn.full_state()
    module = lrn.actor.module
    if stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters())):
            want = {n: t.detach().clone() for n, t in get_peft_model_state_dict(module).items()}
            everything = {n: p.detach().clone() for n, p in module.named_parameters()}
    else:
        want = get_peft_model_state_dict(module)
        everything = {n: p.detach().clone() for n, p in module.named_parameters()}
    assert set(got) == set(want) and all(lora_.is_adapter(n) for n in got)
    for name in want:
        assert got[name].shape == want[name].shape and torch.equal(got[name], want[name]), name
    assert any(t.abs().max() > 0 for n, t in got.items() if "lora_B" in n)  # trained: B left 0
    base = sum(p.numel() for p in load_policy(model_dir, torch.float32).parameters())
    assert sum(t.numel() for t in got.values()) < base / 10
    # the base with these adapters loaded (as a generator would) is the trained policy
    copy = lora_.apply(load_policy(model_dir, torch.float32), LORA)
    copy.load_state_dict(everything, strict=False)
    from peft.utils import set_peft_model_state_dict

    fresh = lora_.apply(load_policy(model_dir, torch.float32), LORA)
    set_peft_model_state_dict(fresh, got)
    rows = rollouts(4, seed=31)
    torch.testing.assert_close(logp(fresh, rows), logp(copy, rows), atol=1e-6, rtol=0)
