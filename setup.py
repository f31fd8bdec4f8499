"""Packaging beyond setup.cfg: recipes/ and slurm_templates/ ship inside the wheel.

They stay at the top of the checkout, where users read and copy them, and are installed as
``streamrl_cli/recipes`` and ``streamrl_cli/slurm_templates`` (streamrl_cli.resources finds
either place). Everything else about the package is declared in setup.cfg.
"""

from setuptools import find_packages, setup

DATA_DIRS = {"streamrl_cli.recipes": "recipes", "streamrl_cli.slurm_templates": "slurm_templates"}

setup(
    packages=[*find_packages(include=["streamrl_cli", "streamrl_cli.*"]), *DATA_DIRS],
    package_dir=DATA_DIRS,
    package_data={
        "streamrl_cli.recipes": ["**/*.yaml"],
        "streamrl_cli.slurm_templates": ["*"],
        "streamrl_cli.planner": ["*.yaml"],
    },
)
