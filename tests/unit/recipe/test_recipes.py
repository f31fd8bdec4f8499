"""Every shipped recipe composes, validates and plans; overrides behave as Hydra's do."""

from __future__ import annotations

import pytest

from streamrl_cli.errors import RecipeError
from streamrl_cli.launch import plan
from streamrl_cli.recipe.load import list_recipes, load

RECIPES = list_recipes()


def test_the_required_recipes_are_shipped():
    required = {"local", "slurm-local", "two-site-h800-h20"} | {
        f"paper/qwen2.5-{size}-{algo}" for size in ("7b", "32b", "72b") for algo in ("ppo", "grpo")
    }
    assert required <= set(RECIPES)


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_loads_and_plans(name):
    composed = load(name)
    r = composed.recipe
    jobs = plan.jobs(r)
    assert {j.role for j in jobs} >= {"trainer", "generator"}
    gen = next(j for j in jobs if j.role == "generator")
    assert gen.array == r.roles.generator.instances  # generators are always an array
    for job in jobs:
        assert job.cluster in r.clusters


def test_paper_recipes_describe_the_papers_even_split():
    # 7B on 32 GPUs, 32B on 64, 72B on 128: half generation, half training, all H800.
    for size, total in (("7b", 32), ("32b", 64), ("72b", 128)):
        r = load(f"paper/qwen2.5-{size}-ppo").recipe
        train = r.roles.trainer.nodes * r.roles.trainer.gpus_per_node
        gen = r.roles.generator.instances * r.roles.generator.gpus_per_instance
        assert (train, gen) == (total // 2, total // 2)
        assert r.task.max_output_len == 20480


def test_two_site_recipe_puts_roles_on_different_sites_and_relays_weights(tmp_path):
    r = load("two-site-h800-h20").recipe
    specs = plan.role_specs(r, tmp_path)
    assert r.clusters[r.roles.trainer.cluster].site != r.clusters[r.roles.generator.cluster].site
    assert specs["generator"].weight_transport == "relay"
    assert r.clusters["a"].partitions["h800"].gpu_type == "h800"
    assert r.clusters["b"].partitions["h20"].gpu_type == "h20"


def test_value_group_add_and_delete_overrides():
    c = load(
        "local",
        [
            "roles.generator.instances=3",
            "algorithm=ppo",
            "+clusters.local.env.FOO=bar",
            "~clusters.local.env.FOO",
            "++run.name=x",
        ],
    )
    assert c.recipe.roles.generator.instances == 3
    assert c.recipe.algorithm.name == "ppo"
    assert c.recipe.clusters["local"].env == {}
    assert c.recipe.run.name == "x"
    assert c.choices["algorithm"] == "ppo"


def test_recipe_from_a_user_directory_uses_shipped_groups(tmp_path):
    f = tmp_path / "mine.yaml"
    f.write_text("defaults:\n  - local\n  - _self_\nrun: {name: mine}\ntrain: {iterations: 3}\n")
    r = load(str(f)).recipe
    assert (r.run.name, r.train.iterations, r.roles.generator.instances) == ("mine", 3, 1)


def test_an_integer_given_as_text_is_converted_as_omegaconf_would():
    assert load("local", ["train.iterations='7'"]).recipe.train.iterations == 7


def test_unknown_recipe_suggests_close_names():
    with pytest.raises(RecipeError) as e:
        load("locl")
    assert "did you mean local" in str(e.value).lower()


def test_a_fixed_policy_and_the_generators_batch_bound_reach_the_roles(tmp_path):
    # lr 0 keeps the policy fixed (generation benchmarks); the trainer bounds its dispatch by the
    # generators' max_num_seqs, which the generators hand to their engine.
    from streamrl_cli.generator.main import engine_kwargs
    from streamrl_cli.recipe.checks import check

    r = load("local", ["algorithm.lr=0", "roles.generator.max_num_seqs=12"]).recipe
    assert not check(r)
    specs = plan.role_specs(r, tmp_path)
    assert specs["trainer"].generator.max_num_seqs == 12
    assert engine_kwargs(specs["generator"])["max_num_seqs"] == 12


@pytest.mark.parametrize("name", list_recipes())
def test_role_specs_come_back_typed_from_their_files(name, tmp_path):
    from streamrl_cli.recipe.schema import GeneratorConfig, ModelConfig, TrainerConfig
    from streamrl_cli.roles.spec import GeneratorSpec, TrainerSpec, load_spec, spec_yaml

    specs = plan.role_specs(load(name).recipe, tmp_path)
    for role, spec in specs.items():
        (tmp_path / f"{role}.yaml").write_text(spec_yaml(spec))
        assert load_spec(tmp_path / f"{role}.yaml") == spec
    trainer, gen = load_spec(tmp_path / "trainer.yaml"), load_spec(tmp_path / "generator.yaml")
    assert isinstance(trainer, TrainerSpec) and isinstance(trainer.settings, TrainerConfig)
    assert isinstance(trainer.model, ModelConfig) and trainer.generator == specs["generator"].settings
    assert isinstance(gen, GeneratorSpec) and isinstance(gen.settings, GeneratorConfig)
    assert trainer.algorithm.is_correction in ("on", "off")  # resolved once, by the recipe checks


def test_a_role_spec_that_does_not_fit_is_refused_by_name(tmp_path):
    from streamrl_cli.errors import StreamRLError
    from streamrl_cli.roles.spec import load_spec, spec_yaml

    spec = plan.role_specs(load("local").recipe, tmp_path)["generator"]
    bad = tmp_path / "g.yaml"
    bad.write_text(spec_yaml(spec).replace("role: generator", "role: juggler"))
    with pytest.raises(
        StreamRLError, match="unknown role 'juggler'.*trainer, generator, teacher, env_server, rendezvous"
    ):
        load_spec(bad)
    bad.write_text(spec_yaml(spec).replace("max_num_seqs: 64", "max_num_seqs: lots"))
    with pytest.raises(StreamRLError, match=r"version of streamrl: settings.max_num_seqs: Value .lots."):
        load_spec(bad)
