"""Files shipped with streamrl: the recipes and the SLURM setup templates.

In a checkout they are the top-level ``recipes/`` and ``slurm_templates/``; an installed wheel
carries them inside the package (``streamrl_cli/recipes``, see setup.py). Both are real
directories, which Hydra needs to compose recipes from.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent


def data_dir(name: str) -> Path:
    """``name`` (``recipes`` or ``slurm_templates``) as installed, else as in the checkout."""
    installed = PACKAGE / name
    return installed if installed.is_dir() else PACKAGE.parent / name
