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


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement anywhere in `tree` (functions included), but not under `if TYPE_CHECKING:`."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def package_graph(root: Path = PACKAGE, name: str = "streamrl_cli") -> dict[str, set[str]]:
    """Top-level package (or module) of `name` -> those it imports, counting imports inside functions.

    `streamrl_cli.a.b` counts as `a`; relative imports are resolved against the importing module.
    """
    graph: dict[str, set[str]] = {}
    # `from streamrl_cli import __version__` names an attribute, not a package
    known = {f.stem for f in root.glob("*.py")} | {
        d.name for d in root.glob("*/") if (d / "__init__.py").exists()
    }
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root).with_suffix("").parts
        if rel[-1] == "__init__":
            rel = rel[:-1]
        if not rel:
            continue  # the root __init__ is no package of its own
        src = rel[0]
        module = (name, *rel)
        is_pkg = f.name == "__init__.py"
        deps = graph.setdefault(src, set())
        for node in _imports(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif node.level:
                base = module if is_pkg else module[:-1]
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join(base + ((node.module,) if node.module else ()))
                targets = [stem] if node.module else [f"{stem}.{a.name}" for a in node.names]
            else:
                targets = [node.module or ""]
                if node.module == name:  # `from streamrl_cli import x`
                    targets = [f"{name}.{a.name}" for a in node.names]
            for t in targets:
                parts = t.split(".")
                if parts[0] == name and len(parts) > 1 and parts[1] != src and parts[1] in known:
                    deps.add(parts[1])
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_package_imports_another_that_imports_it_back_even_inside_functions():
    # import-linter sees modules; a circle between packages can hide behind imports in function
    # bodies that no module-level chain joins up (elastic -> launch -> recipe -> elastic did).
    graph = package_graph()
    cycle = find_cycle(graph)
    assert cycle is None, "packages import each other: " + " -> ".join(cycle or [])


def test_the_graph_sees_imports_in_functions_and_relative_ones(tmp_path):
    pkg = tmp_path / "p"
    for sub, text in {
        "a/__init__.py": "",
        "a/m.py": "def f():\n    from p.b import x\n",
        "b/__init__.py": "from ..c import y\n",
        "c/__init__.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p import a\n",
    }.items():
        (pkg / sub).parent.mkdir(parents=True, exist_ok=True)
        (pkg / sub).write_text(text)
    graph = package_graph(pkg, "p")
    assert graph == {"a": {"b"}, "b": {"c"}, "c": set()}
    assert find_cycle(graph) is None
    assert find_cycle({**graph, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_environment_variables_are_named_in_one_module():
    """The launcher ↔ role contract and the operator's settings: every STREAMRL_* variable is spelled
    in streamrl_cli/environ.py only (STREAMRL_STAGED is a shell here-document's delimiter)."""
    import re

    spelled = re.compile(r"""["']STREAMRL_[A-Z0-9_]+["']""")
    elsewhere = {
        f"{path.relative_to(REPO)}: {m.group(0)}"
        for path in (REPO / "streamrl_cli").rglob("*.py")
        if path.name != "environ.py"
        for m in spelled.finditer(path.read_text())
        if m.group(0).strip("\"'") != "STREAMRL_STAGED"
    }
    assert not elsewhere, sorted(elsewhere)
