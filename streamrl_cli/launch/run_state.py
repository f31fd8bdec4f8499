"""A run's state read back from its directory, typed, in one place: the resolved recipe
(config.yaml), the jobs `streamrl run` planned from it, and the role specs (roles/<role>.yaml).

Whatever acts on a run after its launch reads it here: `--resume`, scaling, the trainer restart,
the launchers (which cluster a role is on, what a staged job carries) and `streamrl status`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from streamrl_cli.errors import ClusterError, RecipeError
from streamrl_cli.launch import plan
from streamrl_cli.roles.spec import RoleSpec, load_spec
from streamrl_cli.rundir import RunDir

if TYPE_CHECKING:
    from streamrl_cli.launch.plan import JobSpec
    from streamrl_cli.recipe.schema import Recipe


def recipe(run: RunDir) -> Recipe:
    """The run's resolved recipe, from its config.yaml. A file that cannot be read, parsed (with
    the recipe loader's bounds) or typed raises RecipeError, saying what is wrong with it."""
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from streamrl_cli.recipe import safe_yaml
    from streamrl_cli.recipe.schema import Recipe

    config = run.config
    try:
        safe_yaml.check_document(config, safe_yaml.read_text(config))
        tree = OmegaConf.load(config)
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Recipe), tree))  # type: ignore[return-value]
    except RecipeError:
        raise
    except (OSError, ValueError, OmegaConfBaseException, yaml.YAMLError) as e:
        raise RecipeError([f"{config} is damaged: {e}"]) from None


def jobs(run: RunDir) -> list[JobSpec]:
    """The run's jobs as `streamrl run` planned them (from its resolved config)."""
    try:
        return plan.jobs(recipe(run))
    except RecipeError as e:
        raise ClusterError(f"cannot read {run.config}: {'; '.join(e.problems)}") from None


def role_job(run: RunDir, role: str) -> JobSpec:
    """A role's job as the run launched it (from its resolved config)."""
    return next(j for j in jobs(run) if j.role == role)


def role_spec(run: RunDir, role: str) -> RoleSpec:
    """A role's typed spec (roles/<role>.yaml); StreamRLError when it is missing or does not fit."""
    return load_spec(run.role_spec(role))
