"""Look at recipe files before Hydra does: UTF-8, bounded YAML, no cycle in `defaults`.

Hydra and PyYAML trust their input: a self-including ``defaults`` list recurses until Python
gives up, a recursive alias (``x: &a [*a]``) does the same in OmegaConf, a "billion laughs"
document (aliases of aliases, 9 levels of 9) expands to 10^9 nodes at 100% CPU, and a file that
is not UTF-8 ends in a UnicodeDecodeError. Each of these is checked here first on the node graph
PyYAML composes (aliases are shared nodes there, so nothing is expanded), and reported as a
recipe error naming the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from streamrl_cli.errors import RecipeError

MAX_BYTES = 1 << 20  # a recipe is a few KiB
MAX_NODES = 100_000  # nodes after alias expansion: the largest shipped recipe has a few hundred
MAX_DEPTH = 64  # nesting of mappings and lists


def read_text(path: Path) -> str:
    """The file as text, or a RecipeError saying why it cannot be a recipe."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise RecipeError([f"{path}: cannot read: {e.strerror or e}"]) from None
    if len(data) > MAX_BYTES:
        raise RecipeError([f"{path}: {len(data)} bytes; a recipe may be at most {MAX_BYTES} bytes"])
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise RecipeError(
            [f"{path}: line {line}: byte 0x{data[e.start]:02x} is not UTF-8; save the recipe as UTF-8"]
        ) from None


def check_document(path: Path, text: str) -> Any:
    """Parse `text` (from `path`) with bounded work; returns the plain data."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        raise RecipeError([f"{path}: not valid YAML: {e}"]) from None
    if node is not None:
        _check_graph(path, node)
    try:
        return yaml.safe_load(text)
    except (yaml.YAMLError, RecursionError) as e:  # both ruled out above; kept as the last guard
        raise RecipeError([f"{path}: not valid YAML: {e}"]) from None


def _check_graph(path: Path, root: yaml.Node) -> None:
    """Count the nodes `root` expands to (memoised per shared node) and find alias cycles."""
    size: dict[int, int] = {}
    on_path: set[int] = set()
    # Iterative post-order walk: (node, depth, children visited?).
    stack: list[tuple[yaml.Node, int, bool]] = [(root, 1, False)]
    while stack:
        node, depth, done = stack.pop()
        key = id(node)
        if depth > MAX_DEPTH:
            raise RecipeError([f"{path}: nests deeper than {MAX_DEPTH} levels"])
        kids = _children(node)
        if done:
            on_path.discard(key)
            size[key] = 1 + sum(size[id(k)] for k in kids)
            if size[key] > MAX_NODES:
                raise RecipeError(
                    [
                        f"{path}: expands to more than {MAX_NODES} values through YAML aliases "
                        "(a 'billion laughs' document?); write the values out instead"
                    ]
                )
            continue
        if key in size:
            continue
        if key in on_path:
            raise RecipeError(
                [f"{path}: line {node.start_mark.line + 1}: a YAML alias refers to the node that contains it"]
            )
        on_path.add(key)
        stack.append((node, depth, True))
        for k in kids:
            if id(k) in on_path:
                raise RecipeError(
                    [f"{path}: line {k.start_mark.line + 1}: a YAML alias refers to a node that contains it"]
                )
            if id(k) not in size:
                stack.append((k, depth + 1, False))


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def check_recipe_files(path: Path, roots: list[Path]) -> None:
    """Check `path` and every file its `defaults` reach (through `roots`), and that they form no cycle."""
    seen: set[Path] = set()

    def visit(f: Path, chain: list[Path]) -> None:
        f = f.resolve()
        if f in chain:
            loop = " -> ".join(p.name for p in [*chain[chain.index(f) :], f])
            raise RecipeError([f"{chain[-1]}: `defaults` form a cycle: {loop}"])
        if f in seen:
            return
        seen.add(f)
        data = check_document(f, read_text(f))
        for entry in (data.get("defaults") or []) if isinstance(data, dict) else []:
            for target in _targets(entry, f.parent, roots):
                visit(target, [*chain, f])

    visit(path, [])


def _targets(entry: Any, here: Path, roots: list[Path]) -> list[Path]:
    """The files a defaults entry names that exist (Hydra reports the ones that do not)."""
    if isinstance(entry, str):
        if entry in ("_self_",) or entry.startswith("optional "):
            return []
        names = [entry.lstrip("/")]
    elif isinstance(entry, dict) and len(entry) == 1:
        ((group, option),) = entry.items()
        if not isinstance(group, str) or not isinstance(option, str):
            return []
        group = group.removeprefix("override ").removeprefix("optional ").split("@")[0].lstrip("/")
        names = [f"{group}/{option}"]
    else:
        return []
    out = []
    for name in names:
        for root in [here, *roots]:
            f = root / f"{name}.yaml"
            if f.is_file():
                out.append(f)
                break
    return out
