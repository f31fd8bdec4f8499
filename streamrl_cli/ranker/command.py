"""`streamrl rank`: score a recipe's prompts once with its ranker and write the cache file.

The command line (``cli.rank``) only parses and prints; this is what it does.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from streamrl_cli.ranker import cache as rc
from streamrl_cli.ranker.base import RankerError
from streamrl_cli.ranker.factory import make_ranker

if TYPE_CHECKING:
    from rich.console import Console

    from streamrl_cli.recipe.schema import Recipe


def rank_recipe(
    r: Recipe, *, out: Path | None, limit: int | None, fit: Path | None, device: str, console: Console
) -> tuple[Path, int, str]:
    """Score the prompts of ``r``'s task with ``r.skewness.ranker`` (taught first with ``fit``'s
    lengths), write them to ``out``; returns (file, scores, ranker kind). Progress goes to ``console``."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from streamrl_cli.tasks import make_task

    skew = dataclasses.replace(r.skewness, cache=None)  # scoring from a cache would only copy it
    kind = skew.ranker
    if kind == "none":
        raise RankerError(
            "skewness.ranker is none: name the ranker to score with, e.g. skewness.ranker=learned "
            "(or skewness.ranker=oracle with the built-in task)"
        )
    if fit is not None and kind not in ("learned", "history"):
        raise RankerError(f"--fit teaches a learned or history ranker, not skewness.ranker={kind}")
    task = make_task(r.task, r.train.seed, model_path=r.model.path)
    model = r.skewness.ranker_model or r.model.path
    if kind in ("learned", "history") and not r.skewness.ranker_model:
        from streamrl_cli.models.warmup import ensure_model

        with console.status(f"preparing {r.model.name} (once, cached)"):
            model = str(ensure_model(r.model, r.task))
    prompts = list(task.prompts())[:limit]
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"))
    with make_ranker(skew, model_path=model, task=task, seed=r.train.seed, device=device) as ranker:
        if fit is not None:
            pairs = rc.read_lengths(fit, task)
            with console.status(f"fitting the {kind} ranker on {len(pairs[0])} lengths from {fit}"):
                ranker.fit(*pairs)
        with Progress(*columns, TimeElapsedColumn(), console=console, transient=True) as progress:
            bar = progress.add_task(f"scoring with the {kind} ranker", total=len(prompts))
            scores = rc.score(ranker, prompts, progress=lambda done, _: progress.update(bar, completed=done))
    out = out or Path(f"rank-{task.name}-{kind}.json")
    meta = {
        "ranker": kind,
        "model": model if kind in ("learned", "history") else None,
        "task": task.name,
        "seed": r.train.seed,
        "prompts": len(scores),
        "fit": str(fit) if fit else None,
    }
    rc.write_cache(out, scores, meta)
    return out, len(scores), kind
