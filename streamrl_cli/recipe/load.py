"""Compose a recipe Hydra-style and convert it, once, into the typed :class:`Recipe`.

    recipe file ──► Hydra compose (defaults: groups under recipes/, group overrides `model=...`)
                ──► value overrides (`a.b=1`, `+a.b=1`, `++a.b=1`, `~a.b`) applied here
                ──► schema walk (unknown keys, types, choices, missing values)
                ──► OmegaConf.structured merge + to_object ──► cross-field checks

Hydra stops at the first problem and suggests nothing; users fixing a recipe want every problem
at once, each with the file it comes from and the closest valid name. So Hydra only does what it
is good at (the defaults list and the override grammar) and the rest is checked here.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from streamrl_cli import environ
from streamrl_cli.errors import RecipeError
from streamrl_cli.recipe import checks, paths, safe_yaml
from streamrl_cli.recipe.schema import Recipe
from streamrl_cli.recipe.walk import walk


def shipped_recipes_dir() -> Path:
    """Shipped recipes: in the installed package, else recipes/ of the checkout ($STREAMRL_RECIPES wins)."""
    from streamrl_cli.resources import data_dir

    env = os.environ.get(environ.RECIPES)
    return Path(env) if env else data_dir("recipes")


def list_recipes(root: Path | None = None) -> list[str]:
    """Names of the runnable recipes (config groups excluded)."""
    root = root or shipped_recipes_dir()
    groups = _group_names(root)
    names = []
    for p in sorted(root.rglob("*.yaml")):
        rel = p.relative_to(root)
        if rel.parts[0] in groups:
            continue
        names.append(str(rel.with_suffix("")))
    return names


def resolve_recipe_path(recipe: str) -> Path:
    """A path to a YAML file, or the name of a shipped recipe (`local`, `paper/qwen2.5-7b-ppo`)."""
    p = Path(recipe)
    if p.suffix in (".yaml", ".yml") and p.is_file():
        return p.resolve()
    shipped = shipped_recipes_dir() / (recipe if recipe.endswith(".yaml") else recipe + ".yaml")
    if shipped.is_file():
        return shipped.resolve()
    names = list_recipes()
    close = difflib.get_close_matches(recipe, names, n=3, cutoff=0.4)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    raise RecipeError(
        [f"no recipe file or shipped recipe named {recipe!r}.{hint} Shipped: {', '.join(names)}"]
    )


@dataclass
class Composed:
    """A loaded recipe with where it came from (written to the run directory)."""

    recipe: Recipe
    path: Path
    overrides: list[str]
    choices: dict[str, str]  # config group (with @package) -> option chosen
    # `model` keys the recipe or its overrides set (the rest are schema defaults, which the
    # architecture of the model's config.json may replace before a run).
    model_keys: frozenset[str] = frozenset()


def load(recipe: str, overrides: list[str] | None = None) -> Composed:
    """Compose, validate and convert. Raises RecipeError listing every problem found."""
    overrides = list(overrides or [])
    path = resolve_recipe_path(recipe)
    shipped = shipped_recipes_dir()
    groups = _group_names(shipped) | _group_names(path.parent)
    problems: list[str] = []

    parsed = _parse_overrides(overrides, problems)
    group_ovr = [o for o in parsed if o.key_or_group.split("@")[0] in groups]
    value_ovr = [o for o in parsed if o not in group_ovr]
    for o in group_ovr:
        _check_group_option(o, [shipped, path.parent], problems)
    ok_groups = [o.input_line for o in group_ovr if not o.__dict__.get("_bad")]

    try:
        safe_yaml.check_recipe_files(path, [path.parent, shipped])
        cfg, choices = _compose(path, shipped, ok_groups)
    except RecipeError as e:
        raise RecipeError(problems + e.problems, source=str(path)) from None

    value_lines = [o.input_line for o in value_ovr]
    prov = Provenance(path, shipped, choices, value_lines)
    tree = _merge(_schema_defaults(), cfg)
    for o in value_ovr:
        _apply_override(tree, o, problems)
    bad: dict[str, str] = {}
    walk(tree, Recipe, "", bad.__setitem__)
    problems += [prov.describe(p, msg) for p, msg in bad.items()]
    # Convert what is left (bad values fall back to defaults) so that cross-field rules run too:
    # the user sees every problem at once, not one round of fixes after another.
    typed = _convert(_without(tree, bad), problems)
    if typed is not None:
        paths.resolve(typed, Path.cwd())  # role processes start elsewhere: hand them absolute paths
        for p, msg in checks.check(typed):
            if not any(p == b or p.startswith(b + ".") for b in bad):
                problems.append(prov.describe(p, msg))
    if problems or typed is None:
        raise RecipeError(problems, source=str(path))
    model_keys = set((cfg.get("model") or {}) if isinstance(cfg, dict) else ())
    for o in value_ovr:
        if o.key_or_group.startswith("model."):
            (model_keys.discard if o.is_delete() else model_keys.add)(o.key_or_group.split(".")[1])
    return Composed(
        recipe=checks.resolve(typed),
        path=path,
        overrides=overrides,
        choices=choices,
        model_keys=frozenset(model_keys),
    )


def _schema_defaults() -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(Recipe))  # MISSING fields come out as "???"


def _merge(base: Any, top: Any) -> Any:
    if isinstance(base, dict) and isinstance(top, dict):
        return {**base, **{k: _merge(base.get(k), v) for k, v in top.items()}}
    return top


def _without(tree: dict, bad: dict[str, str]) -> dict:
    """A copy of ``tree`` with the bad keys removed; required values left missing become ''."""
    import copy

    out = copy.deepcopy(tree)
    for path in bad:
        keys = path.split(".")
        node = out
        for k in keys[:-1]:
            node = node.get(k) if isinstance(node, dict) else None
        if isinstance(node, dict) and keys[-1] in node:
            if node[keys[-1]] == "???" or _required(keys):
                node[keys[-1]] = ""  # a required value left missing would stop the conversion
            else:
                del node[keys[-1]]
    return out


def _required(keys: list[str]) -> bool:
    """Whether the schema has no default for ``keys`` (``???``)."""
    node: Any = _schema_defaults()
    for k in keys:
        node = node.get(k) if isinstance(node, dict) else None
    return node == "???"


def _convert(tree: dict, problems: list[str]) -> Recipe | None:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Recipe), tree))  # type: ignore[return-value]
    except OmegaConfBaseException as e:
        problems.append(f"{e.full_key or '<root>'}: {str(e).splitlines()[0]}")
        return None


# Directories of runnable recipes (scenarios); every other directory of recipes/ is a config group.
SCENARIO_DIRS = ("paper", "moe")


def _group_names(root: Path) -> set[str]:
    return (
        {p.name for p in root.iterdir() if p.is_dir() and p.name not in SCENARIO_DIRS}
        if root.is_dir()
        else set()
    )


def _parse_overrides(overrides: list[str], problems: list[str]) -> list[Any]:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    out = []
    for text in overrides:
        try:
            o = parser.parse_override(text)
        except HydraException as e:
            problems.append(
                f"command line: cannot parse override {text!r}: {str(e).splitlines()[0]} "
                "(valid forms: key=value, +key=value, ++key=value, ~key, group=option)"
            )
            continue
        if o.is_sweep_override():
            problems.append(f"command line: {text!r} is a sweep; give one value per key")
            continue
        out.append(o)
    return out


def _check_group_option(o: Any, roots: list[Path], problems: list[str]) -> None:
    group = o.key_or_group
    if o.is_delete():
        return
    value = o.value()
    options = sorted({p.stem for r in roots if (r / group).is_dir() for p in (r / group).glob("*.yaml")})
    if not isinstance(value, str) or value not in options:
        close = difflib.get_close_matches(str(value), options, n=1, cutoff=0.4)
        hint = f" (did you mean `{o.key_or_group}={close[0]}`?)" if close else ""
        problems.append(
            f"command line: {o.input_line}: no option {value!r} in config group {group!r}{hint}; "
            f"valid: {', '.join(options)}"
        )
        o.__dict__["_bad"] = True


def _compose(path: Path, shipped: Path, group_overrides: list[str]) -> tuple[dict, dict[str, str]]:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    GlobalHydra.instance().clear()
    search = f"hydra.searchpath=[file://{shipped}]"
    try:
        with initialize_config_dir(config_dir=str(path.parent), version_base=None):
            cfg = compose(path.stem, overrides=[search, *group_overrides], return_hydra_config=True)
    except (HydraException, OmegaConfBaseException, yaml.YAMLError) as e:
        raise RecipeError([f"{path}: {str(e).strip()}"]) from None
    except (RecursionError, UnicodeDecodeError) as e:  # what the checks before should have caught
        raise RecipeError([f"{path}: cannot compose this recipe: {type(e).__name__}: {e}"]) from None
    finally:
        GlobalHydra.instance().clear()
    choices = {
        k: v
        for k, v in OmegaConf.to_container(cfg.hydra.runtime.choices).items()
        if not k.startswith("hydra/") and v is not None
    }
    with_hydra = OmegaConf.to_container(cfg, resolve=False)
    with_hydra.pop("hydra", None)
    return with_hydra, choices


def _apply_override(cfg: dict, o: Any, problems: list[str]) -> None:
    keys = o.key_or_group.split(".")
    adding = o.is_add() or o.is_force_add()
    parent = cfg
    for i, k in enumerate(keys[:-1]):
        nxt = parent.get(k) if isinstance(parent, dict) else None
        if not isinstance(nxt, dict):
            if nxt is None and _in_schema(keys[: i + 1]) and isinstance(parent, dict):
                if not adding:  # a new entry of an open mapping (clusters, env): added with +
                    problems.append(_not_yet(o))
                    return
                nxt = parent.setdefault(k, {})
            else:
                problems.append(_unknown(cfg, o, keys[: i + 1]))
                return
        parent = nxt
    last = keys[-1]
    exists = last in parent
    if o.is_delete():
        if not exists:
            problems.append(_unknown(cfg, o, keys, "cannot delete"))
        else:
            del parent[last]
    elif not exists and not _in_schema(keys):
        # Only names the schema allows can be added: never suggest `+` for any other.
        problems.append(_unknown(cfg, o, keys))
    elif o.is_force_add():
        parent[last] = o.value()
    elif o.is_add():
        if exists:
            problems.append(
                f"command line: {o.input_line}: {o.key_or_group} already exists; "
                f"use `{_retyped(o, o.key_or_group, add='')}` to change it"
            )
        else:
            parent[last] = o.value()
    elif not exists:
        problems.append(_not_yet(o))
    else:
        parent[last] = o.value()


def _not_yet(o: Any) -> str:
    return (
        f"command line: {o.input_line}: no {o.key_or_group!r} yet; "
        f"to add it use `{_retyped(o, o.key_or_group, add='+')}`"
    )


def _in_schema(keys: list[str]) -> bool:
    """Whether the schema has a place for ``keys`` (any name is allowed in a ``dict[str, ...]``)."""
    import dataclasses
    import types
    import typing

    typ: Any = Recipe
    for k in keys:
        if typing.get_origin(typ) in (typing.Union, types.UnionType):
            typ = next(a for a in typing.get_args(typ) if a is not type(None))
        if dataclasses.is_dataclass(typ):
            hints = typing.get_type_hints(typ)
            if k not in hints:
                return False
            typ = hints[k]
        elif typing.get_origin(typ) is dict:
            typ = typing.get_args(typ)[1]
        else:
            return False
    return True


def _retyped(o: Any, key: str, add: str | None = None) -> str:
    """The override ``o`` as the user would type it with ``key`` (and prefix ``add`` if given)."""
    text = o.input_line
    prefix = "~" if o.is_delete() else "++" if o.is_force_add() else "+" if o.is_add() else ""
    rest = text[len(prefix) + len(o.key_or_group) :]
    return f"{prefix if add is None else add}{key}{rest}"


def _unknown(cfg: dict, o: Any, keys: list[str], doing: str = "") -> str:
    """Unknown key: the corrected override, ready to run, when every part has a close match."""
    where = f"command line: {o.input_line}" + (f": {doing}" if doing else "")
    full = o.key_or_group.split(".")
    fixed = _closest_path(cfg, full)
    if fixed is not None:
        add = "" if o.is_add() or o.is_force_add() else None  # a key that exists is set, not added
        hint = f"; did you mean `{_retyped(o, '.'.join(fixed), add=add)}`?"
    else:
        node: Any = cfg
        for k in keys[:-1]:
            node = node.get(k) if isinstance(node, dict) else None
        names = sorted(node) if isinstance(node, dict) else []
        hint = f"; valid keys of {'.'.join(keys[:-1]) or 'the recipe'}: {', '.join(names)}" if names else ""
    return f"{where}: unknown key {'.'.join(keys)!r}{hint}"


def _closest_path(cfg: dict, keys: list[str]) -> list[str] | None:
    """``keys`` with each unknown part replaced by its closest existing name, or None."""
    node: Any = cfg
    out = []
    for k in keys:
        if not isinstance(node, dict):
            return None
        if k not in node:
            close = difflib.get_close_matches(k, [str(n) for n in node], n=1, cutoff=0.5)
            if not close:
                return None
            k = close[0]
        out.append(k)
        node = node[k]
    return out if out != keys else None


class Provenance:
    """Says which file (or override) a key path came from, for error messages."""

    def __init__(self, path: Path, shipped: Path, choices: dict[str, str], overrides: list[str]):
        self.overrides = overrides
        self.sources: list[tuple[str, Path, dict]] = [("", path, _read_yaml(path))]
        for group_pkg, option in choices.items():
            group, _, package = group_pkg.partition("@")
            for root in (path.parent, shipped):
                f = root / group / f"{option}.yaml"
                if f.is_file():
                    self.sources.append((package or group.replace("/", "."), f, _read_yaml(f)))
                    break

    def describe(self, keypath: str, msg: str) -> str:
        for text in self.overrides:
            key = text.lstrip("+~").split("=", 1)[0]
            if keypath == key or keypath.startswith(key + "."):
                return f"command line `{text}`: {keypath}: {msg}"
        for prefix, f, raw in self.sources:
            rel = (
                keypath
                if not prefix
                else keypath[len(prefix) + 1 :]
                if keypath.startswith(prefix + ".")
                else None
            )
            if rel is not None and _has_path(raw, rel.split(".") if rel else []):
                return f"{_short(f)}: {keypath}: {msg}"
        return f"{_short(self.sources[0][1])} (with defaults): {keypath or '<root>'}: {msg}"


def _read_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def _has_path(raw: Any, keys: list[str]) -> bool:
    node = raw
    for k in keys:
        if not isinstance(node, dict) or k not in node:
            return False
        node = node[k]
    return True


def _short(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)
