"""Bad recipes: one clear message listing every problem, exit code 2, no traceback, nothing written."""

from __future__ import annotations

import json

import pytest
from support.helpers import streamrl

BASE = """defaults:
  - local
  - override /cluster@clusters.local: testbed-local
  - _self_
roles:
  trainer: {cluster: local, partition: h800, nodes: 1, gpus_per_node: 1}
  generator: {cluster: local, partition: h20, instances: 2, gpus_per_instance: 1}
"""

# (what is wrong, extra recipe text or overrides, fragments the message must contain)
MISTAKES = [
    ("unknown key with the closest name", "run: {nmae: x}\n", [], ["run.nmae", "did you mean 'run.name'"]),
    ("wrong type", "train: {iterations: lots}\n", [], ["train.iterations", "expected an integer", "'lots'"]),
    ("value outside choices", "algorithm: {name: dpo}\n", [], ["algorithm.name", "not one of ppo, grpo"]),
    ("missing required value", "", ["model.path=???"], ["model.path", "missing required value"]),
    (
        "more GPUs per node than the partition has",
        "",
        ["roles.trainer.gpus_per_node=8"],
        ["roles.trainer.gpus_per_node", "partition 'h800' has 4"],
    ),
    (
        "a trainer layout the trainer does not run (pipeline parallel), tensor parallelism beyond its ranks",
        "",
        [
            "roles.trainer.gpus_per_node=2",
            "roles.trainer.tensor_parallel=4",
            "roles.trainer.pipeline_parallel=2",
        ],
        [
            "roles.trainer.pipeline_parallel: 2",
            "ZeRO data parallel",
            "roles.trainer.tensor_parallel: 4 does not divide the trainer's 2 ranks",
        ],
    ),  # fmt: skip
    (
        "sequence parallelism that does not divide the ranks or the heads, with eager attention",
        "",
        [
            "roles.trainer.gpus_per_node=2",
            "roles.trainer.sequence_parallel=4",
            "roles.trainer.attention=eager",
        ],
        [
            "roles.trainer.sequence_parallel: 4 does not divide the trainer's 2 ranks",
            "4 does not split the model's 2 attention heads and 2 KV heads evenly",
            "valid: 1, 2",
            "Ulysses needs sdpa or flash_attention_2",
        ],
    ),  # fmt: skip
    (
        "routing replay where its experts cannot be replayed (sequence parallel rows, multi-turn), a "
        "load-balancing weight out of range",
        "",
        [
            "roles.trainer.gpus_per_node=2",
            "roles.trainer.sequence_parallel=2",
            "algorithm.routing_replay=true",
            "agent.tools=[streamrl_cli.agent.tools:calculator]",
            "algorithm.router_aux_loss_coef=2",
        ],
        [
            "algorithm.routing_replay",
            "sequence parallelism",
            "multi-turn trajectories (agent.env, agent.tools)",
            "algorithm.router_aux_loss_coef",
            "must be from 0 (off) to 1, got 2",
        ],
    ),  # fmt: skip
    (
        "a time-limit warning that would come at the job's start",
        "",
        ["roles.trainer.time_min=2", "roles.trainer.signal_lead_s=120", "roles.generator.signal_lead_s=5"],
        [
            "roles.trainer.signal_lead_s",
            "less than the time limit (time_min=2: 120 s), got 120",
            "roles.generator.signal_lead_s",
            "at least 10 s",
        ],
    ),  # fmt: skip
    (
        "generator TP does not divide its GPUs",
        "",
        ["roles.generator.gpus_per_instance=2", "roles.generator.tensor_parallel=4"],
        ["roles.generator.tensor_parallel", "does not divide gpus_per_instance=2"],
    ),
    (
        "a long context the prompt bound cannot hold, and builder positions for a model no builder makes",
        "",
        [
            "task.filler_words=5000",
            "task.max_prompt_len=4096",
            "model.builder=null",
            "model.builder_positions=8192",
        ],
        [
            "task.filler_words",
            "raise task.max_prompt_len to at least 5016",
            "model.builder_positions",
            "only a model a builder makes",
        ],
    ),  # fmt: skip
    (
        "unknown cluster",
        "",
        ["roles.generator.cluster=locl"],
        ["roles.generator.cluster", "did you mean 'local'"],
    ),
    (
        "unknown partition",
        "",
        ["roles.trainer.partition=h100"],
        ["roles.trainer.partition", "partitions: h800, h20"],
    ),
    ("unknown config group option", "", ["model=qwen2.5-8b"], ["model=qwen2.5-8b", "valid:", "qwen2.5-7b"]),
    (
        "override of a key that does not exist",
        "",
        ["train.itterations=3"],
        ["train.itterations", "did you mean `train.iterations=3`"],
    ),
    ("adding a key that exists", "", ["+train.iterations=3"], ["already exists"]),
    ("deleting a key that does not exist", "", ["~train.foo"], ["cannot delete", "train.foo"]),
    ("GRPO with a group of one", "", ["algorithm.group_size=1"], ["algorithm.group_size", "group_size ≥ 2"]),
    (
        "an advantage estimator that does not exist",
        "",
        ["algorithm.advantage=vtrace"],
        ["algorithm.advantage", "not one of gae, grpo, rloo, reinforce++, reinforce++-baseline"],
    ),
    (
        "the behaviour policy corrected twice",
        "",
        ["algorithm.old_policy=behaviour", "algorithm.is_correction=on"],
        ["algorithm.is_correction", "would correct it twice"],
    ),
    ("negative learning rate", "", ["algorithm.lr=-1e-6"], ["algorithm.lr", "must be ≥ 0"]),
    (
        "a generator that runs no sequence",
        "",
        ["roles.generator.max_num_seqs=0"],
        ["roles.generator.max_num_seqs", "at least 1 sequence"],
    ),
    (
        "TLS certificate without its key",
        "",
        ["roles.rendezvous.tls_cert=/etc/hostname"],
        ["roles.rendezvous.tls_key", "set both or neither"],
    ),
    (
        "more nodes than the partition allows",
        "",
        ["roles.trainer.nodes=3"],
        ["roles.trainer.nodes", "allows 1"],
    ),
    (
        "more CPUs per node than the partition has",
        "",
        ["roles.trainer.gpus_per_node=2", "roles.trainer.cpus_per_task=2"],
        ["roles.trainer.cpus_per_task", "× 2 task(s) per node", "has 2 CPUs per node"],
    ),
    ("unparsable override", "", ["train.iterations=[1,"], ["cannot parse override"]),
    (
        "a mapping where a number goes",
        "train: {iterations: {a: 1}}\n",
        [],
        ["train.iterations", "expected an integer"],
    ),
    (
        "tensor parallel does not divide the heads",
        "",
        [
            "model.num_attention_heads=6",
            "model.num_kv_heads=6",
            "roles.generator.gpus_per_instance=4",
            "roles.generator.tensor_parallel=4",
        ],
        ["does not divide the model's 6 attention heads"],
    ),
    (
        "a site option that StreamRL sets from the roles",
        "",
        ["+clusters.local.sbatch.ntasks_per_node=3"],
        ["clusters.local.sbatch.ntasks_per_node", "--ntasks-per-node is set by StreamRL"],
    ),
    (
        "over-sampling beyond double the batch",
        "",
        ["rollout.oversample=1.5", "train.reproducible_sampling=false"],
        ["rollout.oversample", "must be in [0, 1]", "got 1.5"],
    ),
    (
        "over-sampling with reproducible sampling",
        "",
        ["rollout.oversample=0.25"],
        ["rollout.oversample", "set train.reproducible_sampling=false"],
    ),
    (
        "partial rollout resumes over-sampled groups: none without over-sampling",
        "",
        ["rollout.partial=true", "train.reproducible_sampling=false"],
        ["rollout.partial", "set rollout.oversample above 0"],
    ),
    (  # found by tests/unit/test_fuzz.py: an internal error (OverflowError) in the schema walk
        "an integer given as an overflowing float",
        "",
        ["roles.trainer.time_min=1e400"],
        ["roles.trainer.time_min", "expected an integer, got inf"],
    ),
    (  # found by tests/unit/test_fuzz.py: with no instance the cluster was not checked, and the plan
        # looked it up (KeyError)
        "a pool's cluster that does not exist, with no instance of it",
        "",
        ["roles.env_server.cluster=nope", "roles.teacher.cluster=nope"],
        ["roles.env_server.cluster: no cluster 'nope'", "roles.teacher.cluster: no cluster 'nope'"],
    ),
    (
        "a site option written with dashes",
        "clusters: {local: {sbatch: {'--constraint': a100}}}\n",
        [],
        ["clusters.local.sbatch", "without dashes"],
    ),
]


@pytest.mark.parametrize("what,extra,overrides,fragments", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_mistake_is_reported_clearly(tmp_path, runs_root, what, extra, overrides, fragments):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(BASE + extra)
    out = streamrl("run", str(recipe), *overrides, "--root", str(runs_root), "--dry-run")
    assert out.returncode == 2, out.stdout + out.stderr
    text = " ".join((out.stdout + out.stderr).split())  # rich wraps lines
    for fragment in fragments:
        assert fragment in text, f"{what}: {fragment!r} not in {text}"
    assert "Traceback" not in text
    assert "r.yaml" in text or "command line" in text  # says where the problem is
    assert not runs_root.exists(), "nothing may be written for a bad recipe"


def test_every_problem_is_reported_at_once(tmp_path, runs_root):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(BASE + "run: {nmae: x}\nalgorithm: {name: dpo}\n")
    out = streamrl(
        "run",
        str(recipe),
        "roles.trainer.gpus_per_node=8",
        "train.iterations=x",
        "model=nope",
        "--root",
        str(runs_root),
    )
    assert out.returncode == 2
    text = " ".join(out.stderr.split())
    assert "6 problem(s)" in text  # 8 GPUs per node is also 8 tasks of 1 CPU on 2-CPU nodes
    for key in (
        "run.nmae",
        "algorithm.name",
        "roles.trainer.gpus_per_node",
        "train.iterations",
        "model=nope",
    ):
        assert key in text


def test_bad_recipe_leaves_existing_runs_alone(tmp_path, runs_root):
    ok = streamrl("run", "local", "--dry-run", "--root", str(runs_root))
    assert ok.returncode == 0, ok.stderr
    before = sorted(p.name for p in runs_root.iterdir())
    bad = streamrl("run", "local", "train.iterations=x", "--root", str(runs_root))
    assert bad.returncode == 2
    assert sorted(p.name for p in runs_root.iterdir()) == before


def test_unknown_run_and_recipe_get_clear_errors(runs_root):
    out = streamrl("cancel", "no-such-run")
    assert (
        out.returncode == 2 and "no run matches 'no-such-run'" in out.stderr and "Traceback" not in out.stderr
    )
    out = streamrl("run", "no-such-recipe", "--root", str(runs_root))
    assert out.returncode == 2 and "Shipped:" in out.stderr


@pytest.mark.parametrize(
    "where,name",
    [
        ("command line", "../../evil"),
        ("command line", "/tmp/streamrl-absolute"),
        ("command line", "a/b"),
        ("command line", "x" * 65),
        ("recipe file", "a\nb"),
        ("recipe file", "\x1b[31mred"),
        ("recipe file", "a\x00b"),
        ("recipe file", ".."),
    ],
    ids=["parent", "absolute", "slash", "too-long", "newline", "ansi", "nul", "dots"],
)
def test_a_run_name_that_is_not_a_name_is_refused_before_anything_is_written(
    tmp_path, runs_root, where, name
):
    """A run name became a path: `../../evil` made <root>/../../evil-<time> (its secret included) outside
    the root, an absolute name too; a newline or an escape went into the directory's name, a NUL was an
    internal error."""
    recipe = tmp_path / "r.yaml"
    overrides = []
    if where == "recipe file":
        recipe.write_text(BASE + "run:\n  name: " + json.dumps(name) + "\n")
    else:
        recipe.write_text(BASE)
        overrides = [f"run.name={name}"]
    out = streamrl("run", str(recipe), *overrides, "--root", str(runs_root), "--dry-run")
    text = " ".join((out.stdout + out.stderr).split())
    assert out.returncode == 2 and "Traceback" not in text and "internal error" not in text, text
    said = "is not a run name" in text and "letters, digits" in text or "NUL character" in text
    assert "run.name" in text and said, text
    assert "\x1b[31m" not in out.stderr and "\x00" not in out.stderr  # shown escaped, never painted
    assert not runs_root.exists() and not list(tmp_path.rglob("evil*"))


def test_sizes_past_any_cluster_are_refused_with_their_key_and_where_they_were_set(tmp_path, runs_root):
    """Each of these was accepted and a real run started (or `--dry-run` grew to 3 GB and never
    returned, for a 2**80 instances); a negative prompt length was blamed on task.max_output_len."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        BASE + '  rendezvous: {lease_s: 1.2e24}\nmodel:\n  path: "/tmp/x\\0y"\n'
    )  # under roles:
    big = str(2**80)
    out = streamrl(
        "run", str(recipe), "--root", str(runs_root), "--dry-run",
        f"roles.generator.instances={big}", f"train.iterations={big}", f"train.global_batch={2**40}",
        f"task.max_output_len={2**40}", "task.max_prompt_len=-100", f"train.seed={2**64}",
    )  # fmt: skip
    text = " ".join((out.stdout + out.stderr).split())
    assert out.returncode == 2 and "Traceback" not in text, text
    for key, bound in [
        ("roles.generator.instances", "100,000"),
        ("train.iterations", "10,000,000"),
        ("train.global_batch", "1,048,576"),
        ("task.max_output_len", "16,777,216"),
        ("roles.rendezvous.lease_s", "604,800"),
    ]:
        assert f"{key}: " in text and f"bound of {bound}" in text, (key, text)
    assert f"command line `roles.generator.instances={big}`" in text
    assert "r.yaml: roles.rendezvous.lease_s" in text  # where it was set: the recipe file
    assert "task.max_prompt_len: must be at least 1 token, got -100" in text
    assert "task.max_output_len: must be at least 1" not in text
    assert "train.seed" in text and "2**63 - 1" in text
    assert "model.path: contains a NUL character" in text
    assert not runs_root.exists()


def test_what_the_machine_or_the_model_cannot_hold_is_refused_with_the_key(runs_root):
    """100,000 local generators on a 2-core machine started a run; so did task.max_output_len past the
    model's 4,096 positions. The bounds come from this machine's cores and the model's config (or
    the builder's, for a model made at start)."""
    import os

    too_many = 4 * (os.cpu_count() or 1) + 1
    out = streamrl(
        "run", "local", "--root", str(runs_root), "--dry-run",
        f"roles.generator.instances={too_many}", "task.max_output_len=5000",
    )  # fmt: skip
    text = " ".join((out.stdout + out.stderr).split())
    assert out.returncode == 2 and "Traceback" not in text, text
    assert (
        f"command line `roles.generator.instances={too_many}`: roles.generator.instances: {too_many} local"
        in text
    )
    assert "(4 per core)" in text
    assert "command line `task.max_output_len=5000`: task.max_output_len:" in text
    assert "more than the 4096 positions of the model" in text and "at most 4032" in text
    assert not runs_root.exists()


def test_a_models_context_is_what_its_config_and_rope_scaling_say():
    from streamrl_cli.launch.presubmit import context_length

    assert context_length({"max_position_embeddings": 4096}) == 4096
    rope = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    yarn = {"max_position_embeddings": 32768, "rope_scaling": rope}
    assert context_length(yarn) == 131072
    assert context_length({"text_config": {"max_position_embeddings": 8192}}) == 8192
    assert context_length({"max_position_embeddings": "lots"}) is None and context_length({}) is None
