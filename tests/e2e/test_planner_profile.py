"""`streamrl profile` against the real CPU engines (slow: one vLLM start shared by the module), the
profile file format, and the tiny model it builds."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from support.helpers import REPO, streamrl

from streamrl_cli.curves import monotone
from streamrl_cli.planner import ProfileError
from streamrl_cli.planner.costmodel import ProfiledCostModel
from streamrl_cli.planner.hardware import load_hardware
from streamrl_cli.planner.profile import Profile, load_profile, save_profile
from streamrl_cli.planner.workload import model_from_recipe
from streamrl_cli.recipe.load import load


def test_profile_file_round_trip(tmp_path):
    p = Profile(hardware="cpu", model="m", decode=((1.0, 0.002), (8.0, 0.003)), train=((256.0, 0.02),))
    assert load_profile(save_profile(p, tmp_path / "sub" / "p.json")) == p


HEAD = {"streamrl_profile": 1, "hardware": "cpu", "model": "m"}


def test_bad_profile_files(tmp_path):
    cases = {
        "x.json": ("{not json", "not JSON"),
        "y.json": (json.dumps({"hardware": "cpu"}), "not a StreamRL profile"),
        "z.json": (
            json.dumps({"streamrl_profile": 1, "hardware": "cpu", "model": "m", "decode": []}),
            "decode",
        ),
        "w.json": (
            json.dumps({"streamrl_profile": 1, "hardware": "cpu", "model": "m", "oops": 1}),
            "unknown keys",
        ),
    }
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ProfileError, match=message):
            load_profile(tmp_path / name)
    with pytest.raises(ProfileError, match="cannot read"):
        load_profile(tmp_path / "missing.json")


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """One `streamrl profile local` run (one vLLM engine start) for every slow test below."""
    tmp = tmp_path_factory.mktemp("profile")
    model_dir, out = tmp / "tiny-qwen2", tmp / "cpu.json"
    res = streamrl(
        "profile",
        "local",
        f"model.path={model_dir}",
        "model.builder=tiny",
        "--out",
        str(out),
        "--batches",
        "1,4,16",
        timeout=600,
    )
    return res, model_dir, out


@pytest.mark.slow
def test_profile_measures_the_real_cpu_engines(profiled):
    res, model_dir, out = profiled
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"wrote {out}" in res.stdout
    prof = load_profile(out)
    assert (prof.hardware, prof.model, prof.decode_tp) == ("cpu", "tiny-qwen2", 1)
    assert [b for b, _ in prof.decode] == [1.0, 4.0, 16.0]
    # Seconds, measured: positive and finite. How long each took depends on the machine's load (a
    # step of 2048 tokens measured shorter than one of 256 beside other tests), so no ordering or
    # speed is asserted here; bench/ measures speed. The bound only catches a unit mistake (ms).
    assert all(0 < s < 60 for _, s in prof.decode)
    assert prof.engine.startswith("vllm ") and prof.trainer.startswith("torch ")
    assert [t for t, _ in prof.train] == [256.0, 512.0, 1024.0, 2048.0]
    assert all(0 < s < 600 for _, s in prof.train)
    assert prof.optimizer_s > 0 and prof.prefill_s_per_token > 0


@pytest.mark.slow
def test_tune_split_plans_the_local_recipe_from_the_profile(profiled):
    _, model_dir, out = profiled
    res = streamrl(
        "tune-split", "local", f"model.path={model_dir}", "--profile", str(out), "--gpus", "4", "--json"
    )
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["cost_model"] == "profiled" and doc["profiles"] == [str(out)]
    rec = doc["recommended"]
    assert rec["generation"]["hardware"] == rec["training"]["hardware"] == "cpu"
    assert rec["generation"]["gpus"] + rec["training"]["gpus"] <= 4
    # The profiled model answers the measured points themselves (after smoothing out noise).
    prof = load_profile(out)
    cm = ProfiledCostModel([prof])
    model = model_from_recipe(load("local").recipe)
    for batch, step in monotone(prof.decode):
        assert cm.decode_step_s(load_hardware().get("cpu"), model, 1, batch, 50) == pytest.approx(step)


@pytest.mark.slow
def test_the_tiny_model_is_built_locally_and_reused(profiled):
    _, model_dir, _ = profiled
    from transformers import AutoConfig, AutoTokenizer

    from streamrl_cli.models.tiny import build_tiny_model, is_built

    assert is_built(model_dir)
    cfg = AutoConfig.from_pretrained(model_dir)
    assert cfg.model_type == "qwen2" and cfg.hidden_size // cfg.num_attention_heads >= 32
    assert str(cfg.dtype).endswith("float32")
    tok = AutoTokenizer.from_pretrained(model_dir)
    text = "Solve 3x + 5 = 20, then check: 3 * 5 + 5 = 20."
    assert tok.decode(tok(text)["input_ids"]) == text
    assert len(tok) == cfg.vocab_size
    stamp = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model(model_dir) == model_dir.resolve()
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == stamp  # cached, not rebuilt


@pytest.mark.slow
def test_deepspeed_zero_on_cpu_trainer_timing(profiled):
    # The DeepSpeed path of the profiler (ZeRO-1, gloo, one process), outside pytest's process.
    _, model_dir, _ = profiled
    code = (
        "from streamrl_cli.profiling.worker import measure_train\n"
        "from streamrl_cli.planner.profile import ProfileRequest\n"
        f"req = ProfileRequest(model_dir={str(model_dir)!r}, model='tiny-qwen2', trainer='deepspeed',"
        " zero_stage=1, train_tokens=(256, 512))\n"
        "points, opt_s, label = measure_train(req, 0, 2)\n"
        "print('RESULT', len(points), all(s > 0 for _, s in points), opt_s > 0, label)\n"
    )
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=600, env=env
    )
    assert res.returncode == 0, res.stderr[-3000:]
    result = next(line for line in res.stdout.splitlines() if line.startswith("RESULT"))
    assert result.startswith("RESULT 2 True True deepspeed ") and result.endswith("zero-1")
