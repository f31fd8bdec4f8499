"""The recipe-key reference, generated from ``streamrl_cli/recipe/schema.py`` when the site is built.

Why generated: the schema is the one definition of every key (its type, default, bound and
choices in the dataclasses, its meaning in the comment beside or above each field); a page written
by hand would drift from it. The values come from the dataclasses themselves, the meanings from the
source's comments (read with ``tokenize``, so schema.py needs nothing added for the docs).

``render()`` is the whole page as Markdown (``tests/unit/test_docs.py`` runs it); ``on_files`` is the
MkDocs hook (``hooks:`` in mkdocs.yml) that adds it to the site as ``reference.md``, a page that
exists only in the built site.
"""

from __future__ import annotations

import ast
import dataclasses
import html
import importlib
import io
import re
import sys
import tokenize
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "streamrl_cli" / "recipe" / "schema.py"
PAGE = "reference.md"
# Comments that are for tools, not readers.
TOOL_COMMENT = re.compile(r"^(type:\s*ignore(\[[^\]]*\])?|fmt:\s*(skip|off|on)|noqa\b\S*)\s*")

INTRO = """# Recipe-key reference

Every key a recipe may set, by section: its type, its default, its bound or its choices, and what it
means. This page is generated from `streamrl_cli/recipe/schema.py` each time the site is built
(`docs/hooks/recipe_reference.py`), so it says what the schema says; the meanings are the comments
beside the fields there. *required* marks a value with no default (`???`); *null* is YAML's null.
Keys set to *null* by default that say "the algorithm's" are filled by the algorithm preset
([Algorithms](algorithms.md)). How recipes are composed and overridden: [Recipes](recipes.md).
"""


def field_comments(source: str) -> dict[tuple[str, str], str]:
    """(class name, field name) -> the field's comment: the comment lines right above it, then the
    comment on its own lines (a field written over several lines may carry it on the last). A field
    with none, right below a field with a comment above it, shares that one (one comment for a pair
    such as clip_ratio and clip_ratio_high)."""
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            while (m := TOOL_COMMENT.match(text)) is not None and m.end():
                text = text[m.end() :].lstrip("#").strip()
            comments[tok.start[0]] = text
    lines = source.splitlines()
    out: dict[tuple[str, str], str] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        shared, prev_end = "", -1
        for stmt in node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            above: list[str] = []
            n = stmt.lineno - 1
            while n >= 1 and lines[n - 1].strip().startswith("#"):
                above.insert(0, comments.get(n, ""))
                n -= 1
            beside = [comments[i] for i in range(stmt.lineno, stmt.end_lineno + 1) if comments.get(i)]
            text = " ".join(t for t in above + beside if t)
            if not text and stmt.lineno == prev_end + 1:
                text = shared
            shared = " ".join(t for t in above if t) if above else (shared if not text else "")
            prev_end = stmt.end_lineno
            out[(node.name, stmt.target.id)] = text
    return out


def _schema():
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return importlib.import_module("streamrl_cli.recipe.schema")


def _doc(cls: type) -> str:
    """The first paragraph of a class's docstring, on one line."""
    doc = (cls.__dict__.get("__doc__") or "").replace("``", "`")
    return " ".join(doc.strip().split("\n\n")[0].split())


def _type(annotation: str) -> str:
    parts = [p.strip() for p in annotation.split("|")]
    names = ["null" if p == "None" else p for p in parts]
    return " or ".join(f"`{n}`" if n != "null" else "null" for n in names)


def _value(v: object) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "`true`" if v else "`false`"
    if v == "???":
        return "*required*"
    if isinstance(v, list):
        return "`[" + ", ".join(str(x) for x in v) + "]`" if v else "`[]`"
    if isinstance(v, dict):
        return "`{}`" if not v else f"`{v}`"
    return f"`{v}`"


def _bound(f: dataclasses.Field) -> str:
    if "max" in f.metadata:
        return f"at most {f.metadata['max']:,}"
    if "choices" in f.metadata:
        return "one of " + ", ".join(f"`{c}`" for c in f.metadata["choices"])
    return ""


def _text(s: str) -> str:
    """Markdown of a comment: code spans as they are, the rest with HTML and table pipes escaped."""
    parts = re.split(r"(`[^`]*`)", s)
    return "".join(p if p.startswith("`") else html.escape(p, quote=False) for p in parts).replace("|", "\\|")


def _comment(comments: dict, cls: type, name: str) -> str:
    for klass in cls.__mro__:  # the class that defines (or last redefines) the field
        if (klass.__name__, name) in comments:
            return comments[(klass.__name__, name)]
    return ""


def _sections(schema, comments, cls: type, path: str, doc: str):
    """(path, docstring, rows) of cls and every section below it, depth first in schema order."""
    hints = typing.get_type_hints(cls, vars(schema))
    rows, below = [], []
    for f in dataclasses.fields(cls):
        key = f"{path}.{f.name}" if path else f.name
        meaning = _comment(comments, cls, f.name)
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            below.append((hint, key, meaning))
            continue
        args = typing.get_args(hint)
        if typing.get_origin(hint) is dict and dataclasses.is_dataclass(args[1]):
            below.append((args[1], f"{key}.<name>", meaning))
            continue
        default = f.default
        if default is dataclasses.MISSING and f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        annotation = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        rows.append((key, _type(annotation), _value(default), _bound(f), meaning))
    yield path, doc, rows
    for sub, key, meaning in below:
        yield from _sections(schema, comments, sub, key, _doc(sub) or meaning)


def render() -> str:
    """The reference page, Markdown."""
    schema = _schema()
    comments = field_comments(SCHEMA.read_text())
    out = [INTRO]
    for path, doc, rows in _sections(schema, comments, schema.Recipe, "", ""):
        if not rows:  # a section of sections only (the top, `roles`): its sections follow
            continue
        out.append(f"\n## `{path}`\n")
        if doc:
            out.append(f"{_text(doc)}\n")
        out.append("\n| key | type | default | bound | meaning |\n| --- | --- | --- | --- | --- |")
        for key, type_, default, bound, meaning in rows:
            out.append(f"| `{key}` | {type_} | {default} | {bound} | {_text(meaning)} |")
        out.append("")
    return "\n".join(out) + "\n"


def on_files(files, config):
    """MkDocs hook: the reference joins the site's pages, generated now from the schema."""
    from mkdocs.structure.files import File

    files.append(File.generated(config, PAGE, content=render()))
    return files
