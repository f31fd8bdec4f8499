"""The ranker a recipe's ``skewness`` section names, built from its kind, its cache and whether the
task is multi-turn. Its own module: it knows every kind of ranker, and they all know the interface
(``ranker.base``), so keeping it there made a circle of the package."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from streamrl_cli.ranker.base import KINDS, OracleRanker, RandomRanker, Ranker, RankerError
from streamrl_cli.tasks import Task

if TYPE_CHECKING:
    from streamrl_cli.recipe.schema import SkewnessConfig


def make_ranker(
    cfg: SkewnessConfig,
    *,
    model_path: str | None,
    task: Task,
    seed: int = 0,
    device: str = "cpu",
    turns: bool = False,
) -> Ranker | None:
    """The ranker of a recipe's ``skewness`` section, or None for ``ranker: none``.

    ``model_path`` is the policy's model, the learned ranker's base unless ``ranker_model`` names
    another. With ``cache`` set, the cached scores (``streamrl rank``) answer for the prompts they
    cover and the ranker for the rest; a history ranker's observations still come first. ``turns``
    (multi-turn trajectories): prompts seen before are predicted turn by turn (:mod:`.turns`), the
    ranker made here predicts the others (the oracle, exact already, is left as it is).
    """
    kind = cfg.ranker
    if kind not in KINDS:
        raise RankerError(f"skewness.ranker: unknown ranker {kind!r} (valid: {', '.join(KINDS)})")
    if kind == "none":
        return None
    if kind == "oracle":
        ranker: Ranker = OracleRanker(task)
    elif kind == "random":
        ranker = RandomRanker(seed)
    else:
        ranker = _learned(cfg, model_path, seed, device)
    if cfg.cache:
        from streamrl_cli.ranker.cache import CachedRanker, load_cache

        ranker = CachedRanker(load_cache(cfg.cache), ranker)
    if kind == "history":
        from streamrl_cli.ranker.history import HistoryRanker

        ranker = HistoryRanker(ranker)
    if turns and kind != "oracle":
        from streamrl_cli.ranker.turns import TurnRanker

        ranker = TurnRanker(ranker)
    return ranker


def _learned(cfg: SkewnessConfig, model_path: str | None, seed: int, device: str) -> Ranker:
    from streamrl_cli.ranker.learned import LearnedRanker

    base = cfg.ranker_model or model_path
    key = "skewness.ranker_model" if cfg.ranker_model else "model.path"
    if not base:
        raise RankerError(
            f"skewness.ranker={cfg.ranker}: no base model; set skewness.ranker_model (or model.path)"
        )
    path = Path(str(base)).expanduser()
    if not (path / "config.json").is_file():
        raise RankerError(
            f"{key}: the learned ranker's base model {path} does not exist (no config.json there); "
            "point skewness.ranker_model at a local model directory (a small LM, e.g. Qwen2.5-0.5B)"
        )
    return LearnedRanker(path, device=device, seed=seed, refresh_every=cfg.refresh_every)
