"""`streamrl tune-split` as a user runs it: table, JSON, written overrides that `run` accepts, errors."""

from __future__ import annotations

import json
import subprocess
import sys

from support.helpers import REPO, streamrl


def test_help_lists_the_commands_and_importing_the_cli_stays_light():
    out = streamrl("--help")
    assert out.returncode == 0 and "tune-split" in out.stdout and "profile" in out.stdout
    heavy = "('torch', 'vllm', 'omegaconf', 'streamrl_cli.planner.search')"
    probe = f"import sys, streamrl_cli.cli; print(sorted(m for m in {heavy} if m in sys.modules))"
    mods = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO)
    assert mods.stdout.strip() == "[]", mods.stdout + mods.stderr


def test_json_document_for_the_32b_paper_recipe():
    out = streamrl("tune-split", "paper/qwen2.5-32b-ppo", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    rec = doc["recommended"]
    assert rec["generation"]["gpus"] > rec["training"]["gpus"]
    assert rec["generation"]["hardware"] == rec["training"]["hardware"] == "h800"
    assert rec["generation"]["gpus"] + rec["training"]["gpus"] <= 64
    for key in ("iteration_s", "generation_s", "training_s", "samples_per_s", "samples_per_cost"):
        assert rec[key] > 0
    assert 0 <= rec["bubble_fraction"] < 1
    assert doc["options"][0] == rec and len(doc["options"]) > 1
    assert {o["label"] for o in doc["options"]} >= {"split", "even split"}
    assert doc["cost_model"] == "analytic" and doc["workload"]["samples_per_iteration"] == 1024


def test_table_marks_the_recommendation():
    out = streamrl("tune-split", "two-site-h800-h20", "--top", "4")
    assert out.returncode == 0, out.stderr
    assert "★" in out.stdout and "recommended: generation" in out.stdout
    assert "h20 @site-b" in out.stdout and "h800 @site-a" in out.stdout


def dataset(tmp_path) -> list[str]:
    """A prompts file and its reward: `run` refuses a paper recipe without one (no silent toy task)."""
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "What is 2+3?", "answer": "5"}\n')
    return [f"task.dataset={data}", "task.reward=streamrl_cli.tasks.rewards:math_answer"]


def test_written_yaml_recipe_is_accepted_by_run_dry_run(tmp_path, runs_root):
    target = tmp_path / "tuned.yaml"
    out = streamrl("tune-split", "paper/qwen2.5-72b-ppo", "--write", str(target))
    assert out.returncode == 0, out.stderr
    assert target.read_text().startswith("# written by `streamrl tune-split paper/qwen2.5-72b-ppo`")
    run = streamrl("run", str(target), *dataset(tmp_path), "--dry-run", "--root", str(runs_root))
    assert run.returncode == 0, run.stderr
    doc = json.loads(streamrl("tune-split", "paper/qwen2.5-72b-ppo", "--json").stdout)["recommended"]
    cfg = next(runs_root.glob("*/config.yaml")).read_text()
    assert f"instances: {doc['generation']['instances']}" in cfg
    assert f"nodes: {doc['training']['gpus'] // 8}" in cfg


def test_written_overrides_are_accepted_by_run_dry_run(tmp_path, runs_root):
    target = tmp_path / "tuned.overrides"
    out = streamrl("tune-split", "two-site-h800-h20", "--sites", "a=32", "--write", str(target))
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in target.read_text().splitlines() if ln and not ln.startswith("#")]
    assert "roles.generator.cluster=a" in lines and "roles.trainer.cluster=a" in lines
    run = streamrl(
        "run", "two-site-h800-h20", *lines, *dataset(tmp_path), "--dry-run", "--root", str(runs_root)
    )
    assert run.returncode == 0, run.stderr


def test_impossible_inputs_exit_2_without_a_traceback():
    for args, words in (
        (("paper/qwen2.5-72b-ppo", "--gpus", "8"), "budget too small"),
        (("paper/qwen2.5-72b-ppo", "--sites", "h900:16"), "no hardware spec"),
        (("paper/qwen2.5-72b-ppo", "model.params_b=900"), "do not fit one generator instance"),
    ):
        out = streamrl("tune-split", *args)
        assert out.returncode == 2, out
        assert "PlannerError" in out.stderr and words in out.stderr.replace("\n", " ")
        assert "Traceback" not in out.stderr


def test_profile_refuses_a_model_that_is_not_on_this_machine():
    out = streamrl("profile", "paper/qwen2.5-7b-ppo")
    assert out.returncode == 1 and "ProfileError" in out.stderr and "Traceback" not in out.stderr
    assert "not a local model directory" in out.stderr.replace("\n", " ")


def test_profile_refuses_bad_options_before_it_builds_or_measures_anything(tmp_path):
    """A model the recipe builds (builder set) under a path that does not exist yet: a bad --out,
    --batches or --trainer is said before the model is made (the folder stays empty)."""
    model = tmp_path / "model"
    base = ("profile", "local", f"model.path={model}", "--local")
    cases = (
        (("--out", str(tmp_path / "missing" / "p.json")), "does not exist"),
        (("--batches", "1,x"), "comma-separated integers"),
        (("--trainer", "jax"), "valid: torch, deepspeed"),
    )
    (tmp_path / "file").write_text("")
    cases += ((("--out", str(tmp_path / "file" / "p.json")), "does not exist"),)
    for args, words in cases:
        out = streamrl(*base, *args)
        text = " ".join(out.stderr.split())
        assert out.returncode in (1, 2) and words in text and "Traceback" not in text, out.stderr
        assert not model.exists()  # nothing was built
