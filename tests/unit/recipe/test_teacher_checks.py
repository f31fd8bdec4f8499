"""On-policy distillation's recipe keys are checked before anything is queued: a teacher exactly when
the loss uses it, placed where it can run, with a model that shares the policy's tokenizer."""

from __future__ import annotations

import pytest
from support.helpers import streamrl

from streamrl_cli.models.tiny import TinySpec, build_tiny_model


def dry_run(runs_root, *overrides: str):
    out = streamrl("run", "local", "--dry-run", *overrides, "--root", str(runs_root), timeout=180)
    return out.returncode, out.stdout + out.stderr


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        (["algorithm.distill_coef=1.0"], ["roles.teacher.instances", "needs a teacher"]),
        (
            ["roles.teacher.instances=1", "roles.teacher.cluster=nope",
             "algorithm.distill_task_reward=false"],
            [
                "their scores would change nothing",  # a teacher the loss never reads
                "roles.teacher.model.path: required",
                "no cluster 'nope'",
                "algorithm.distill_task_reward: has no effect with distill_coef=0",
            ],
        ),
        (
            ["algorithm.distill_coef=-0.5", "roles.teacher.instances=1", "roles.teacher.model.path=/x"],
            ["must be ≥ 0 (0: off), got -0.5",
             "1 GPUs per instance (on one node) but local cluster 'local' has 0"],
        ),
        (
            ["algorithm.distill_coef=1", "roles.teacher.instances=1", "roles.teacher.gpus_per_instance=0",
             "roles.teacher.model.path=/no/such/teacher"],
            ["roles.teacher.model.path: /no/such/teacher does not exist"],
        ),
        (  # the teacher's scores are of its plain distribution: the policy must sample from its own
            ["algorithm.distill_coef=1", "roles.teacher.instances=1", "roles.teacher.gpus_per_instance=0",
             "roles.teacher.model.path=/x", "algorithm.temperature=0.7", "algorithm.top_k=8"],
            ["needs the policy to sample the same way: temperature=1, top_p=1, top_k=0, min_p=0",
             "got temperature=0.7, top_p=1.0, top_k=8, min_p=0.0"],
        ),
    ],
)  # fmt: skip
def test_every_mistake_is_named_with_what_would_be_valid_and_nothing_runs(runs_root, overrides, fragments):
    code, text = dry_run(runs_root, *overrides)
    assert code == 2, text
    assert "Traceback" not in text
    for fragment in fragments:
        assert fragment in text, (fragment, text)
    assert not runs_root.exists() or not any(runs_root.iterdir())


def test_a_teacher_must_share_the_policys_tokenizer(tmp_path, runs_root):
    policy = build_tiny_model(tmp_path / "policy")
    same = build_tiny_model(
        tmp_path / "wide", TinySpec(hidden_size=128, num_attention_heads=4, num_kv_heads=4)
    )
    other = build_tiny_model(tmp_path / "other", TinySpec(vocab_size=300))
    common = ["algorithm.distill_coef=1", "roles.teacher.instances=1", "roles.teacher.gpus_per_instance=0",
              f"model.path={policy}"]  # fmt: skip
    code, text = dry_run(runs_root, *common, f"roles.teacher.model.path={other}")
    assert code == 2, text
    assert "the teacher's tokenizer" in text and "share one vocabulary" in text, text
    code, text = dry_run(runs_root, *common, f"roles.teacher.model.path={same}")
    assert code == 0, text
    assert "teacher" in text  # its job is in the plan: on the generators' cluster, one instance
