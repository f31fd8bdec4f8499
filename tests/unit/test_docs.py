"""The docs site: the recipe-key reference says what the schema says, and the site builds with
every link and anchor resolved (mkdocs --strict, as `make docs` and CI build it)."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from streamrl_cli.recipe import schema

ROOT = Path(__file__).resolve().parents[2]


def reference_module():
    spec = importlib.util.spec_from_file_location("recipe_reference", ROOT / "docs/hooks/recipe_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rows(page: str) -> dict[str, list[str]]:
    """key -> its cells (type, default, bound, meaning), from the reference's tables."""
    out = {}
    for line in page.splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            out[cells[0].strip("`")] = cells[1:]
    return out


def test_the_reference_has_every_key_with_its_default_bound_and_meaning():
    page = reference_module().render()
    keys = rows(page)
    assert keys["roles.generator.instances"] == [
        "`int`",
        "`1`",
        "at most 100,000",
        "generator instances (array tasks)",
    ]
    name = keys["algorithm.name"]
    assert name[1] == "`grpo`"
    assert name[2] == "one of " + ", ".join(f"`{a}`" for a in schema.ALGORITHMS)
    assert keys["model.path"][1] == "*required*"
    assert keys["roles.teacher.cluster"][0] == "`str` or null"
    # a comment above the field, continued over lines, and one on a field's last line
    assert keys["clusters.<name>.run_root"][3].startswith("This cluster's own directory for runs")
    assert keys["clusters.<name>.srun_args"][3].startswith("extra `srun` arguments")
    assert keys["clusters.<name>.partitions.<name>.gpus_per_node"][1] == "`0`"
    assert "`# type: ignore" not in page and "type: ignore" not in page
    # every field of every section, each with its meaning
    assert set(keys) == set(schema_keys(schema.Recipe, ""))
    assert all(cells[3] for cells in keys.values()), [k for k, c in keys.items() if not c[3]]


def schema_keys(cls: type, path: str):
    """Every key below cls, walking the schema itself (sections: dataclasses, or dicts of them)."""
    hints = typing.get_type_hints(cls, vars(schema))
    for f in dataclasses.fields(cls):
        key = f"{path}.{f.name}" if path else f.name
        hint, args = hints[f.name], typing.get_args(hints[f.name])
        if dataclasses.is_dataclass(hint):
            yield from schema_keys(hint, key)
        elif typing.get_origin(hint) is dict and dataclasses.is_dataclass(args[1]):
            yield from schema_keys(args[1], f"{key}.<name>")
        else:
            yield key


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="mkdocs is not installed (dev extra)")
def test_the_site_builds_strictly(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    reference = (tmp_path / "site" / "reference" / "index.html").read_text()
    assert "roles.generator.instances" in reference
