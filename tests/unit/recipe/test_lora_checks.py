"""model.lora is checked before anything is queued: its numbers, and targets that exist in the model
(read from the model's safetensors headers, else from its architecture's known linear names)."""

from __future__ import annotations

import json
import struct

import pytest
from support.helpers import streamrl

from streamrl_cli.recipe import checks
from streamrl_cli.recipe.lora import linear_modules
from streamrl_cli.recipe.schema import LoraConfig, ModelConfig, Recipe


def write_safetensors(path, shapes: dict[str, list[int]]) -> None:
    """A safetensors file's header (and zero bytes of data): all that the check reads."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = 4 * (shape[0] * (shape[1] if len(shape) > 1 else 1))
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * offset)


# A gpt2-like model (fused c_attn, c_fc) written as safetensors: names unlike the Llama family's.
GPT2_LIKE = {
    "transformer.wte.weight": [50, 8],
    "transformer.wpe.weight": [16, 8],
    "transformer.h.0.attn.c_attn.weight": [8, 24],
    "transformer.h.0.attn.c_proj.weight": [8, 8],
    "transformer.h.0.mlp.c_fc.weight": [8, 32],
    "transformer.h.0.ln_1.weight": [8],
    "lm_head.weight": [50, 8],
}


def lora_problems(model: ModelConfig) -> list[tuple[str, str]]:
    return [p for p in checks.check(Recipe(model=model)) if p[0].startswith("model.lora")]


def test_lora_off_is_not_checked_further():
    off = ModelConfig(path="/nowhere", lora=LoraConfig(rank=0, alpha=-1, dropout=3, target_modules=["x"]))
    assert lora_problems(off) == []


@pytest.mark.parametrize(
    ("lora", "key", "fragment"),
    [
        (LoraConfig(rank=-1), "model.lora.rank", "must be 0 (LoRA off) or a positive adapter rank"),
        (LoraConfig(rank=8, alpha=0), "model.lora.alpha", "must be positive, got 0"),
        (LoraConfig(rank=8, dropout=1.0), "model.lora.dropout", "must be in [0, 1), got 1.0"),
        (LoraConfig(rank=8, dropout=-0.1), "model.lora.dropout", "must be in [0, 1)"),
        (LoraConfig(rank=8, target_modules=[]), "model.lora.target_modules", "names no module"),
    ],
)
def test_bad_numbers_name_the_key_and_what_is_valid(lora, key, fragment):
    problems = lora_problems(ModelConfig(path="/nowhere", lora=lora))
    assert [p[0] for p in problems] == [key]
    assert fragment in problems[0][1]


def test_targets_are_checked_against_the_models_own_weights(tmp_path):
    write_safetensors(tmp_path / "model.safetensors", GPT2_LIKE)
    assert linear_modules(tmp_path) == [
        "transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj", "transformer.h.0.mlp.c_fc",
    ]  # fmt: skip
    good = LoraConfig(rank=4, target_modules=["c_attn", "mlp.c_fc"])  # last parts, as PEFT matches them
    assert lora_problems(ModelConfig(path=str(tmp_path), lora=good)) == []
    # the Llama default names are not in this model; embeddings and the output head are not targets
    for targets, missing in ((["q_proj", "c_attn"], "'q_proj'"), (["wte", "lm_head"], "'wte', 'lm_head'")):
        bad = ModelConfig(path=str(tmp_path), lora=LoraConfig(rank=4, target_modules=targets))
        [(key, msg)] = lora_problems(bad)
        assert key == "model.lora.target_modules"
        assert f"{missing} match(es) no linear layer" in msg
        assert msg.endswith("valid: c_attn, c_fc, c_proj")


def test_without_weights_the_architecture_names_the_targets(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    ok = ModelConfig(path=str(tmp_path), lora=LoraConfig(rank=4))  # the default: every projection
    assert lora_problems(ok) == []
    bad = ModelConfig(path=str(tmp_path), lora=LoraConfig(rank=4, target_modules=["qkv_proj"]))
    [(_, msg)] = lora_problems(bad)
    assert (
        "'qkv_proj'" in msg and "valid: down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj" in msg
    )
    # a model built at run time (builder: tiny) is a Qwen2 as well
    built = ModelConfig(
        path=str(tmp_path / "later"), builder="tiny", lora=LoraConfig(rank=4, target_modules=["x"])
    )
    assert len(lora_problems(built)) == 1
    # a hub id (no local directory) or an unknown architecture: left to PEFT at the trainer's start
    assert lora_problems(ModelConfig(path="org/model", lora=LoraConfig(rank=4, target_modules=["x"]))) == []


def test_a_bad_lora_section_stops_streamrl_run_before_anything_is_written(tmp_path, runs_root):
    out = streamrl(
        "run", "local", "model.lora.rank=8", "model.lora.dropout=1.5",
        "model.lora.target_modules=[q_proj,qkv]", "train.export_final=false", "--root", str(runs_root),
        "--dry-run",
    )  # fmt: skip
    assert out.returncode == 2, out.stdout + out.stderr
    text = " ".join((out.stdout + out.stderr).split())
    assert "model.lora.dropout" in text and "model.lora.target_modules" in text and "'qkv'" in text
    assert "Traceback" not in text
    assert not runs_root.exists()


def test_a_good_lora_section_reaches_the_trainers_spec(runs_root):
    from pathlib import Path

    from streamrl_cli.roles.spec import load_spec

    out = streamrl(
        "run", "local", "model.lora.rank=8", "model.lora.target_modules=[q_proj,v_proj]",
        "--root", str(runs_root), "--dry-run",
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    run_dir = Path(out.stdout.strip().splitlines()[-1])
    [trainer_yaml] = run_dir.glob("roles/trainer*.yaml")
    lora = load_spec(trainer_yaml).model.lora  # the trainer parses its slice back into LoraConfig
    assert (lora.rank, lora.alpha, lora.target_modules) == (8, 16.0, ["q_proj", "v_proj"])


# ---- model.lora.sync: what each weight version sends the generators ----


def sync_problems(recipe: Recipe) -> list[tuple[str, str]]:
    return [p for p in checks.check(recipe) if p[0].startswith("model.lora")]


def two_sites(lora: LoraConfig) -> Recipe:
    from streamrl_cli.recipe.schema import ClusterConfig

    r = Recipe(model=ModelConfig(path="/nowhere", lora=lora))
    r.clusters = {
        "a": ClusterConfig(launcher="local", site="north"),
        "b": ClusterConfig(launcher="local", site="south"),
    }
    r.roles.trainer.cluster, r.roles.generator.cluster = "a", "b"
    return r


def test_either_sync_is_accepted_inside_the_trainers_site_and_across_sites():
    for sync in ("merged", "adapter"):
        lora = LoraConfig(rank=8, sync=sync)
        assert lora_problems(ModelConfig(path="/nowhere", lora=lora)) == []
        # the cross-site relay carries merged and adapter versions alike
        assert sync_problems(two_sites(lora)) == []


def test_adapter_sync_needs_lora_on():
    [(key, msg)] = lora_problems(ModelConfig(path="/nowhere", lora=LoraConfig(rank=0, sync="adapter")))
    assert key == "model.lora.sync"
    assert "model.lora.rank is 0 (LoRA off)" in msg and "valid: merged, adapter" in msg


def test_adapter_sync_refuses_a_rank_vllm_cannot_serve():
    assert lora_problems(ModelConfig(path="/nowhere", lora=LoraConfig(rank=512, sync="adapter"))) == []
    [(key, msg)] = lora_problems(ModelConfig(path="/nowhere", lora=LoraConfig(rank=513, sync="adapter")))
    assert key == "model.lora.rank"
    assert "above the largest adapter rank vLLM serves (512)" in msg and "sync: merged" in msg
    # merged versions are whole models: any rank goes
    assert lora_problems(ModelConfig(path="/nowhere", lora=LoraConfig(rank=1024))) == []


def test_an_unknown_sync_names_the_valid_values(runs_root):
    out = streamrl(
        "run", "local", "model.lora.rank=8", "model.lora.sync=delta", "--root", str(runs_root), "--dry-run"
    )
    assert out.returncode == 2, out.stdout + out.stderr
    text = " ".join((out.stdout + out.stderr).split())
    assert "model.lora.sync" in text and "merged" in text and "adapter" in text and "Traceback" not in text


def test_adapter_sync_reaches_both_roles_and_the_generator_serves_adapters(runs_root):
    from pathlib import Path

    from streamrl_cli.generator.main import engine_kwargs
    from streamrl_cli.roles.spec import load_spec

    out = streamrl(
        "run", "local", "model.lora.rank=4", "model.lora.sync=adapter", "algorithm.max_staleness=2",
        "--root", str(runs_root), "--dry-run",
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    run_dir = Path(out.stdout.strip().splitlines()[-1])
    [trainer_yaml] = run_dir.glob("roles/trainer*.yaml")
    [generator_yaml] = run_dir.glob("roles/generator*.yaml")
    assert load_spec(trainer_yaml).model.lora.sync == "adapter"
    gen = load_spec(generator_yaml)
    assert gen.model.lora.sync == "adapter" and gen.max_staleness == 2
    lora = engine_kwargs(gen, rank=1)["lora"]
    assert lora["max_rank"] == 8 and lora["slots"] == 4  # vLLM's next rank; staleness 2 + 2
    assert lora["directory"] == str(run_dir / "adapters" / "generator-1")
    assert (lora["config"]["r"], lora["config"]["lora_alpha"], lora["config"]["bias"]) == (4, 16.0, "none")
    # merged (the default): the engine loads whole versions in place, no LoRA
    gen.model.lora.sync = "merged"
    assert engine_kwargs(gen)["lora"] is None
