"""The supervised warm-up of the tiny model, and ensure_model's builders."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from streamrl_cli.errors import StreamRLError
from streamrl_cli.models.tiny import build_tiny_model, is_built
from streamrl_cli.models.warmup import MARKER, ensure_model, warm_up
from streamrl_cli.recipe.schema import ModelConfig, TaskConfig
from streamrl_cli.tasks import make_task

TASK = TaskConfig(name="builtin", dataset=None, num_prompts=256, max_prompt_len=64, max_output_len=64)


def test_warm_up_lowers_the_loss_and_is_reused(tmp_path):
    losses: list[float] = []
    model = ModelConfig(path=str(tmp_path / "warm"), builder="tiny-warm", warmup_steps=25)
    # Two roles starting at once: one warms up, the other waits for it and reuses the result.
    with ThreadPoolExecutor(2) as pool:
        calls = [
            pool.submit(ensure_model, model, TASK, lambda step, steps, loss: losses.append(loss))
            for _ in range(2)
        ]
        out, other = (c.result() for c in calls)
    assert out == other == tmp_path / "warm"
    assert is_built(tmp_path / "warm-base")
    assert len(losses) == 25
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5
    marker = json.loads((out / MARKER).read_text())
    assert marker["task"] == "repeat" and marker["steps"] == 25 and marker["seed"] == 0
    assert marker["final_loss"] == pytest.approx(losses[-1])
    assert not _temp_dirs(tmp_path)

    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.eos_token == "<|endoftext|>"
    assert AutoConfig.from_pretrained(out).eos_token_id == tokenizer.eos_token_id  # vLLM stops there

    # Same task, steps and seed: reused without training; other steps: trained again, replaced.
    again: list[float] = []
    task = make_task(TASK)
    assert warm_up(tmp_path / "warm-base", out, task, 25, progress=lambda *a: again.append(a[2])) == out
    assert again == [] and ensure_model(model, TASK) == out
    warm_up(tmp_path / "warm-base", out, task, 2, progress=lambda *a: again.append(a[2]))
    assert len(again) == 2 and json.loads((out / MARKER).read_text())["steps"] == 2
    assert not _temp_dirs(tmp_path)


def _temp_dirs(path):
    return [p for p in path.iterdir() if p.name.startswith(".") and p.is_dir()]


def test_ensure_model_builders(tmp_path):
    assert ensure_model(ModelConfig(path=str(tmp_path / "t"), builder="tiny"), TASK) == tmp_path / "t"
    assert is_built(tmp_path / "t")
    existing = build_tiny_model(tmp_path / "x")
    assert ensure_model(ModelConfig(path=str(existing), builder=None), TASK) == existing
    with pytest.raises(StreamRLError, match=r"does not exist.*model.builder=tiny"):
        ensure_model(ModelConfig(path=str(tmp_path / "nope"), builder=None), TASK)
    with pytest.raises(StreamRLError, match=r"unknown builder 'big'.*tiny-warm"):
        ensure_model(ModelConfig(path=str(tmp_path / "nope"), builder="big"), TASK)
    with pytest.raises(StreamRLError, match="warmup_steps"):
        ensure_model(ModelConfig(path=str(tmp_path / "nope"), builder="tiny-warm", warmup_steps=0), TASK)


def test_building_a_model_leaves_stdout_to_the_command(tmp_path):
    """Saving a model imports DeepSpeed (through accelerate), which logs to stdout from its first
    import on: a fresh process (no DS_ACCELERATOR, as in a user's shell) that builds the tiny model
    and saves a warmed one prints nothing there (`streamrl profile` lists its results on stdout)."""
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    code = (
        "import sys; from pathlib import Path\n"
        "from streamrl_cli.models.tiny import build_tiny_model\n"
        "from streamrl_cli.models.warmup import ensure_model\n"
        "from streamrl_cli.recipe.schema import ModelConfig, TaskConfig\n"
        f"build_tiny_model(Path({str(tmp_path / 'tiny')!r}))\n"
        "task = TaskConfig(name='builtin', dataset=None, num_prompts=16, max_output_len=16)\n"
        f"warm = ModelConfig(path={str(tmp_path / 'warm')!r}, builder='tiny-warm', warmup_steps=2)\n"
        "ensure_model(warm, task)\n"
        "import deepspeed; assert 'deepspeed' in sys.modules\n"
        "deepspeed.utils.logger.warning('a later DeepSpeed log line')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout == "", out.stdout
    assert "Setting accelerator to CPU" in out.stderr and "a later DeepSpeed log line" in out.stderr
