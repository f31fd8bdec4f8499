"""One definition per setting (#27): a recipe key's name, type, default and meaning are the schema's
(``recipe.schema``), and the runtime configs the roles build from a recipe hold its sections as they
are, not copies of their keys with defaults of their own (PipelineConfig once ran tests and code
paths with group_size 4, global_batch 8 and reproducible sampling off, while every recipe had 8, 16
and on; the elastic section was defined twice, bridged by asdict/from_dict).

A runtime config is a dataclass named ``*Config`` outside ``recipe/``. Checked from the source (no
import of torch, vLLM, ...): each field named like a recipe key must be annotated with a schema
section, and no class may take the name of a schema section (a second definition of it).
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from streamrl_cli.recipe import schema

PACKAGE = Path(__file__).resolve().parents[3] / "streamrl_cli"

# Configs of something else than a run's settings, whose fields share names with recipe keys.
NOT_RUN_SETTINGS = {
    # The tune-split simulator's model of one run (planner.scenario fills it from a workload or a
    # what-if); its keys are the simulator's parameters, not a role's settings.
    "SimConfig",
}


def schema_classes() -> dict[str, type]:
    return {
        name: cls
        for name, cls in vars(schema).items()
        if isinstance(cls, type) and dataclasses.is_dataclass(cls) and cls.__module__ == schema.__name__
    }


def recipe_keys() -> set[str]:
    """Every field name of every schema dataclass: leaf keys and section names alike."""
    return {f.name for cls in schema_classes().values() for f in dataclasses.fields(cls)}


def _is_dataclass(node: ast.ClassDef) -> bool:
    for dec in node.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        if isinstance(target, ast.Name) and target.id == "dataclass":
            return True
        if isinstance(target, ast.Attribute) and target.attr == "dataclass":
            return True
    return False


def restated(files: list[Path], keys: set[str], sections: set[str]) -> tuple[list[str], set[str]]:
    """(problems, names of the runtime configs seen) in ``files``."""
    problems, seen = [], set()
    for f in files:
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if not isinstance(node, ast.ClassDef):
                continue
            where = f"{f.name}: {node.name}"
            if node.name in sections:
                problems.append(f"{where} has the name of a schema section: a second definition of it")
            if not (_is_dataclass(node) and node.name.endswith("Config")) or node.name in NOT_RUN_SETTINGS:
                continue
            seen.add(node.name)
            for st in node.body:
                if not (isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)):
                    continue
                name, annotation = st.target.id, ast.unparse(st.annotation).strip("'\"")
                if name in keys and annotation not in sections:
                    default = f" = {ast.unparse(st.value)}" if st.value is not None else ""
                    problems.append(
                        f"{where}.{name}: {annotation}{default} restates a recipe key (take its section)"
                    )
    return problems, seen


def test_runtime_configs_take_the_recipes_sections_instead_of_restating_keys():
    files = [f for f in PACKAGE.rglob("*.py") if f.relative_to(PACKAGE).parts[0] != "recipe"]
    problems, seen = restated(files, recipe_keys(), set(schema_classes()))
    assert not problems, "\n".join(problems)
    # The configs #27 was about are still looked at (a rename must not take them out of the check).
    assert {"PipelineConfig", "LossConfig", "OptimConfig", "EvalConfig"} <= seen, seen


def test_the_check_finds_a_restated_default_a_repacked_key_and_a_second_section(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "from dataclasses import dataclass, field\n"
        "@dataclass\n"
        "class PipeConfig:\n"
        "    group_size: int = 4\n"  # a default of its own
        "    clip_ratio: float\n"  # repacked, no default
        "    world: int = 1\n"  # not a recipe key: the runtime's own
        "    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)\n"  # the section
        "@dataclass(frozen=True)\n"
        "class ElasticConfig:\n"
        "    min: int = 1\n"
    )
    keys = {"group_size", "clip_ratio", "algorithm", "min"}
    problems, seen = restated([src], keys, {"AlgorithmConfig", "ElasticConfig"})
    assert seen == {"PipeConfig", "ElasticConfig"}
    assert [p.split(":")[1].strip() for p in problems] == [
        "PipeConfig.group_size", "PipeConfig.clip_ratio", "ElasticConfig has the name of a schema section",
        "ElasticConfig.min",
    ]  # fmt: skip
