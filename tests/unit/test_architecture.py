"""The package's shape, checked: import rules (import-linter, `.importlinter`) and that every
recipe key is read by code (a key that changes nothing would lie to the user)."""

from __future__ import annotations

import ast
import dataclasses
import shutil
import subprocess
import sys
from pathlib import Path

from streamrl_cli.recipe import schema

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "streamrl_cli"

# Keys read only by the recipe checks, which is how they act: they describe a cluster's nodes, and
# recipe.checks rejects a job that asks for more than a node has (so they decide what may run).
CHECKED_ONLY = {
    ("PartitionConfig", "cpus_per_node"),
    ("ClusterConfig", "local_gpus"),
}


def test_import_rules_hold():
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert exe, "import-linter is a dev dependency: pip install -e '.[dev]'"
    res = subprocess.run([exe, "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert "broken" in res.stdout and "0 broken" in res.stdout  # it ran the contracts


def attribute_reads(files: list[Path]) -> set[str]:
    """Names read as attributes (``x.name`` in a load context) anywhere in ``files``."""
    names: set[str] = set()
    for f in files:
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                names.add(node.attr)
    return names


def schema_keys() -> list[tuple[str, str]]:
    """(section class, field) for every dataclass field of the recipe schema."""
    return [
        (name, f.name)
        for name, cls in vars(schema).items()
        if isinstance(cls, type) and dataclasses.is_dataclass(cls) and cls.__module__ == schema.__name__
        for f in dataclasses.fields(cls)
    ]


def unread(keys: list[tuple[str, str]], reads: set[str]) -> list[str]:
    return [f"{cls}.{key}" for cls, key in keys if key not in reads]


def test_every_schema_key_is_read_by_code():
    # Outside recipe/: the schema declares keys, load/walk validate them by reflection and checks
    # constrains them; none of that is a use. A key counts as read when code reads an attribute of
    # its name (roles get typed sections, so that is how a key reaches them).
    code = [f for f in PACKAGE.rglob("*.py") if f.relative_to(PACKAGE).parts[0] != "recipe"]
    reads = attribute_reads(code)
    keys = [k for k in schema_keys() if k not in CHECKED_ONLY]
    assert not unread(keys, reads), "recipe keys no code reads (remove them, or use them)"
    # The allow-list stays honest: its keys are read by the checks, and by nothing else yet.
    checks = attribute_reads([PACKAGE / "recipe" / "checks.py"])
    assert not unread(sorted(CHECKED_ONLY), checks)
    assert unread(sorted(CHECKED_ONLY), reads) == [f"{c}.{k}" for c, k in sorted(CHECKED_ONLY)]


def test_the_key_check_finds_a_key_nobody_reads(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f(cfg):\n    cfg.used = 1\n    return cfg.other\n")  # `used` is only written
    assert unread([("S", "used"), ("S", "other")], attribute_reads([src])) == ["S.used"]
