"""Export round-trips: a DeepSpeed checkpoint of every ZeRO stage, exported as a Hugging Face model
directory, loads with `transformers` and gives the trainer's log-probs (real DeepSpeed on CPU)."""

from __future__ import annotations

import json
import random

import pytest
import torch
from support.configs import optim_config

from streamrl_cli.models.tiny import TinySpec, build_tiny_model
from streamrl_cli.recipe import presets
from streamrl_cli.recipe.schema import AlgorithmConfig
from streamrl_cli.trainer.loop.batch import Rollout, collate
from streamrl_cli.trainer.role.checkpoint import save_engines
from streamrl_cli.trainer.role.export import MARKER, ExportError, export_checkpoint
from streamrl_cli.trainer.role.learner import Learner, LossConfig, init_distributed, open_group_store
from streamrl_cli.trainer.role.models import policy_forward
from streamrl_cli.transport.wire import Sample

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    store, address = open_group_store(1, "127.0.0.1")
    init_distributed(0, 1, address, "gloo", store)
    return {
        "untied": str(build_tiny_model(root / "untied")),
        "tied": str(build_tiny_model(root / "tied", TinySpec(tie_word_embeddings=True))),
    }


def rollouts(n: int, seed: int) -> list[Rollout]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        resp = [rng.randrange(1, 400) for _ in range(rng.randint(2, 10))]
        sample = Sample(prompt_id=f"p{i}", sample_index=0, token_ids=resp, logprobs=[-1.0] * len(resp),
                        finish_reason="stop", weight_version=0)  # fmt: skip
        prompt = [rng.randrange(1, 400) for _ in range(rng.randint(2, 8))]
        out.append(Rollout(prompt_tokens=prompt, sample=sample, reward=0.0, advantage=rng.gauss(0, 1)))
    return out


@pytest.mark.parametrize(("stage", "kind"), [(0, "untied"), (1, "tied"), (2, "untied"), (3, "tied")])
def test_an_exported_checkpoint_gives_the_trainers_logprobs(models, tmp_path, stage, kind):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = models[kind]
    cfg = LossConfig.from_recipe(
        presets.filled(AlgorithmConfig(name="grpo", kl_mode="none", is_correction="off"), 16), 16
    )
    learner = Learner(base, cfg, optim_config(zero_stage=stage, lr=0.05), torch.device("cpu"), torch.float32)
    learner.micro_step(collate(rollouts(6, seed=stage)), last=True)
    learner.step()  # the weights move away from the base model's
    batch = collate(rollouts(5, seed=100 + stage))
    learner.actor.eval()
    with torch.no_grad():
        trainer_logp, _ = policy_forward(learner.actor, batch, 1.0)
    ckpt = tmp_path / "checkpoints" / "iter-000000"
    save_engines(learner, ckpt, {"iteration": 0, "next_iteration": 1})
    out = export_checkpoint(ckpt, base, tmp_path / "hf")
    assert {"config.json", "model.safetensors", "tokenizer.json", MARKER} <= {p.name for p in out.iterdir()}
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        exported_logp, _ = policy_forward(hf, batch, 1.0)
        base_logp, _ = policy_forward(AutoModelForCausalLM.from_pretrained(base).eval(), batch, 1.0)
    m = batch.mask.bool()
    torch.testing.assert_close(exported_logp[m], trainer_logp[m], atol=1e-5, rtol=0)
    assert (base_logp[m] - trainer_logp[m]).abs().max() > 1e-3  # the trained weights, not the base's
    assert AutoTokenizer.from_pretrained(out).get_vocab() == AutoTokenizer.from_pretrained(base).get_vocab()
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] == (kind == "tied")
    # a second export into the same directory replaces its own earlier export ...
    assert export_checkpoint(ckpt, base, out) == out
    # ... but never a directory it did not write
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ExportError, match="not empty"):
        export_checkpoint(ckpt, base, tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_a_directory_without_a_checkpoint_is_a_clear_error(tmp_path, models):
    (tmp_path / "actor").mkdir()
    with pytest.raises(ExportError, match="no DeepSpeed checkpoint"):
        export_checkpoint(tmp_path, models["tied"], tmp_path / "out")
