"""`algorithm.name` presets: what each fills in, that the user's own keys win however they are set,
that unknown names and keys that go nowhere are refused before anything runs, and that the
resolved values are what the trainer's loss and pipeline read."""

from __future__ import annotations

import pytest

from streamrl_cli.errors import RecipeError
from streamrl_cli.recipe.load import load
from streamrl_cli.recipe.schema import ALGORITHMS


def algo(*overrides: str, recipe: str = "local"):
    return load(recipe, list(overrides)).recipe.algorithm


def problems(*overrides: str, recipe: str = "local") -> str:
    with pytest.raises(RecipeError) as e:
        load(recipe, list(overrides))
    return " ".join(str(e.value).split())


def test_a_name_brings_its_presets_keys():
    a = algo("algorithm.name=dapo")  # the local recipe: task.max_output_len 64
    assert (a.advantage, a.policy_loss, a.loss_agg) == ("grpo", "clip", "token-mean")
    assert (a.clip_ratio, a.clip_ratio_high, a.kl_coef) == (0.2, 0.28, 0.0)
    assert (a.overlong_buffer, a.dynamic_sampling) == (12, True)  # a fifth of 64 tokens
    g = algo("algorithm.name=gspo")
    assert (g.policy_loss, g.loss_agg, g.clip_ratio, g.clip_ratio_high, g.is_level) == (
        "gspo", "seq-mean-token-mean", 3e-4, 4e-4, "geometric",
    )  # fmt: skip
    d = algo("algorithm.name=dr-grpo")
    assert (d.grpo_std_norm, d.loss_agg, d.clip_ratio_high) == (False, "seq-mean-token-sum-norm", 0.2)
    p = algo("algorithm=ppo")
    assert (p.advantage, p.kl_mode, p.kl_estimator, p.group_size) == ("gae", "penalty", "k1", 4)
    plain = algo()
    assert (plain.name, plain.advantage, plain.kl_mode, plain.kl_coef, plain.dynamic_sampling) == (
        "grpo", "grpo", "loss", 0.001, False,
    )  # fmt: skip


@pytest.mark.parametrize("name", ALGORITHMS)
def test_every_algorithm_has_a_config_group_that_names_it(name):
    assert algo(f"algorithm={name}").name == name


def test_the_users_own_keys_win_over_the_preset(tmp_path):
    # On the command line, even at the value every other preset has (kl_coef 0.001).
    a = algo("algorithm.name=dapo", "algorithm.kl_coef=0.001", "algorithm.clip_ratio_high=0.25")
    assert (a.kl_coef, a.clip_ratio_high, a.overlong_buffer) == (0.001, 0.25, 12)
    # In a recipe file: GSPO's clipping replaced by the file's own, its loss kept.
    f = tmp_path / "mine.yaml"
    f.write_text("defaults:\n  - local\n  - _self_\nalgorithm:\n  name: gspo\n  clip_ratio: 0.2\n")
    g = load(str(f)).recipe.algorithm
    assert (g.policy_loss, g.clip_ratio, g.clip_ratio_high) == ("gspo", 0.2, 4e-4)
    # A key set to null, or deleted, is the preset's again.
    f.write_text("defaults:\n  - local\n  - _self_\nalgorithm:\n  name: dapo\n  kl_coef: 0.01\n")
    assert load(str(f), ["~algorithm.kl_coef"]).recipe.algorithm.kl_coef == 0.0
    assert load(str(f), ["algorithm.kl_coef=null"]).recipe.algorithm.kl_coef == 0.0
    assert load(str(f)).recipe.algorithm.kl_coef == 0.01


def test_unknown_names_are_refused_with_the_valid_ones():
    text = problems("algorithm.name=dapoo")
    assert "algorithm.name: 'dapoo' is not one of ppo, grpo, dr-grpo, dapo, gspo, cispo, rloo" in text
    assert "did you mean 'dapo'" in text
    assert "'vtrace' is not one of gae, grpo, rloo, reinforce++, reinforce++-baseline" in problems(
        "algorithm.advantage=vtrace"
    )
    assert "'ppo' is not one of clip, gspo, cispo" in problems("algorithm.policy_loss=ppo")
    assert "'batch' is not one of off, token, sequence, geometric" in problems("algorithm.is_mask=batch")


@pytest.mark.parametrize(
    "overrides,fragments",
    [
        (["algorithm.kl_mode=penalty"], ["algorithm.kl_mode", "only advantage=gae reads"]),
        (["algorithm=ppo", "algorithm.kl_mode=loss"], ["algorithm.kl_mode", "use penalty (or none)"]),
        (
            ["algorithm=ppo", "algorithm.policy_loss=gspo"],
            ["algorithm.policy_loss", "one advantage per sequence"],
        ),
        (["algorithm=rloo", "algorithm.group_size=1"], ["algorithm.group_size", "needs group_size ≥ 2"]),
        (
            ["algorithm=ppo", "algorithm.group_size=1", "algorithm.dynamic_sampling=true"],
            ["algorithm.dynamic_sampling", "a group of one always is"],
        ),
        (
            ["algorithm.old_policy=behaviour", "algorithm.is_correction=on"],
            ["algorithm.is_correction", "would correct it twice"],
        ),
        (
            ["algorithm.is_mask=token", "algorithm.is_mask_low=1.5"],
            ["algorithm.is_mask_low", "must contain 1"],
        ),
        (["algorithm.is_mask_high=5"], ["algorithm.is_mask_low", "has no effect with is_mask=off"]),
        (["algorithm.overlong_buffer=65"], ["algorithm.overlong_buffer", "must be in [0, 64]"]),
        (
            ["algorithm.overlong_penalty=0.5"],
            ["algorithm.overlong_penalty", "has no effect with overlong_buffer=0"],
        ),
        (["algorithm=dapo", "algorithm.overlong_penalty=-1"], ["algorithm.overlong_penalty", "must be ≥ 0"]),
        (["algorithm.max_refill=2"], ["algorithm.max_refill", "has no effect without dynamic_sampling=true"]),
        (["algorithm=dapo", "algorithm.max_refill=-1"], ["algorithm.max_refill", "must be ≥ 0"]),
    ],
)
def test_keys_that_cannot_go_together_are_refused(overrides, fragments):
    text = problems(*overrides)
    for fragment in fragments:
        assert fragment in text, f"{fragment!r} not in {text}"


def test_the_config_group_and_the_name_give_the_same_recipe():
    # local.yaml sets its own group_size (4); null leaves it to the algorithm, as a recipe that
    # does not set it: PPO's preset then gives one sample per prompt, by either path.
    for extra in ([], ["algorithm.group_size=null"]):
        group = load("local", ["algorithm=ppo", *extra]).recipe
        assert group == load("local", ["algorithm.name=ppo", *extra]).recipe
    assert group.algorithm.group_size == 1
    assert algo("algorithm.group_size=null").group_size == 8  # every other algorithm's


def test_runtime_code_reads_a_resolved_preset_and_says_so_otherwise():
    from streamrl_cli.errors import StreamRLError
    from streamrl_cli.recipe import presets
    from streamrl_cli.recipe.schema import AlgorithmConfig
    from streamrl_cli.trainer.role.learner import LossConfig

    with pytest.raises(StreamRLError, match="algorithm.group_size, algorithm.advantage.*not resolved"):
        LossConfig.from_recipe(AlgorithmConfig(is_correction="off"), 16)
    a = presets.filled(AlgorithmConfig(is_correction="off"), 16)
    assert LossConfig.from_recipe(a, 16).algorithm is a  # read as it is, not filled again


def test_the_importance_correction_follows_the_old_policy():
    assert algo("algorithm.mode=async").is_correction == "on"
    assert algo("algorithm.mode=async", "algorithm.old_policy=behaviour").is_correction == "off"
    assert algo("algorithm.old_policy=behaviour").is_correction == "off"


def test_the_trainer_reads_the_resolved_algorithm(tmp_path):
    from streamrl_cli.launch import plan
    from streamrl_cli.planner.workload import workload_from_recipe
    from streamrl_cli.roles.spec import load_spec, spec_yaml
    from streamrl_cli.trainer.loop.pipeline import PipelineConfig
    from streamrl_cli.trainer.role.learner import LossConfig

    r = load("local", ["algorithm=dapo", "algorithm.is_mask=token", "algorithm.max_refill=0.5"]).recipe
    (tmp_path / "trainer.yaml").write_text(spec_yaml(plan.role_specs(r, tmp_path)["trainer"]))
    spec = load_spec(tmp_path / "trainer.yaml")  # what the trainer process parses back
    loss = LossConfig.from_recipe(spec.algorithm, spec.task.max_output_len)
    a = loss.algorithm
    assert (a.advantage, a.policy_loss, a.clip_ratio, a.clip_ratio_high) == ("grpo", "clip", 0.2, 0.28)
    assert (loss.kl, a.is_mask, loss.critic) == (False, "token", False)  # DAPO: kl_coef 0, no KL term
    pipe = PipelineConfig.from_spec(spec)
    a = pipe.algorithm
    assert (a.dynamic_sampling, pipe.refill_budget, a.overlong_buffer) == (True, 4, 12)  # batch 8
    assert workload_from_recipe(r).algorithm == "dapo"
    assert workload_from_recipe(load("local", ["algorithm=ppo"]).recipe).algorithm == "ppo"
