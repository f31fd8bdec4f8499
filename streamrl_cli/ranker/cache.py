"""Ranker scores computed once, offline (``streamrl rank``), and a ranker that starts from them.

Scoring a large dataset with an LM ranker costs GPU time the first iteration should not pay, and a
ranker fitted offline on lengths from an earlier run knows more than a fresh one. ``streamrl rank``
scores the recipe's dataset once and writes a cache; ``skewness.cache`` points a run at it:
:class:`CachedRanker` answers from the cache where it can and asks its ranker for the rest.

Two formats, by suffix: ``.jsonl`` (a ``{"meta": ...}`` line, then one ``{"prompt_id", "score"}``
per line: streams, appends) and anything else JSON (``{"meta": ..., "scores": {id: score}}``).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from streamrl_cli.ranker.base import Ranker, RankerError
from streamrl_cli.tasks import Prompt, Task

FORMAT = "streamrl-rank-cache/1"


@dataclass
class RankCache:
    """Scores (predicted output tokens) by prompt id, and how they were made."""

    scores: dict[str, float]
    meta: dict = field(default_factory=dict)


def load_cache(path: str | os.PathLike) -> RankCache:
    """Read a cache written by :func:`write_cache`; a :class:`RankerError` says what is wrong."""
    p = Path(path).expanduser()
    where = f"skewness.cache: {p}"
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise RankerError(f"{where} cannot be read: {e.strerror or e} (make one with `streamrl rank`)") from e
    try:
        if p.suffix == ".jsonl":
            meta, scores = {}, {}
            for n, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                rec = json.loads(line)
                if not isinstance(rec, dict):
                    raise ValueError(f"line {n} is not an object")
                if "meta" in rec:
                    meta = rec["meta"]
                    continue
                if "prompt_id" not in rec or "score" not in rec:
                    raise ValueError(f"line {n} has no prompt_id or score")
                scores[str(rec["prompt_id"])] = float(rec["score"])
        else:
            doc = json.loads(text)
            if not isinstance(doc, dict) or not isinstance(doc.get("scores"), dict):
                raise ValueError('not an object with a "scores" object')
            meta = doc.get("meta") or {}
            scores = {str(k): float(v) for k, v in doc["scores"].items()}
    except (ValueError, TypeError) as e:  # JSONDecodeError is a ValueError
        raise RankerError(f"{where} is not a ranker cache: {e}") from e
    bad = [k for k, v in scores.items() if not math.isfinite(v)]
    if bad:
        raise RankerError(f"{where}: non-finite scores for {bad[:5]}")
    return RankCache(scores, meta)


def write_cache(path: str | os.PathLike, scores: Mapping[str, float], meta: Mapping) -> Path:
    """Write atomically (temporary file renamed into place); ``meta`` gains format and created."""
    p = Path(path).expanduser()
    full = {"format": FORMAT, "created": datetime.now(UTC).isoformat(timespec="seconds"), **meta}
    if p.suffix == ".jsonl":
        lines = [json.dumps({"meta": full})] + [
            json.dumps({"prompt_id": k, "score": v}) for k, v in scores.items()
        ]
        text = "\n".join(lines) + "\n"
    else:
        text = json.dumps({"meta": full, "scores": dict(scores)}, indent=1) + "\n"
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}-", dir=p.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p


class CachedRanker(Ranker):
    """Cached scores for the prompts the cache holds, ``ranker`` for the others.

    The cache is static: once the ranker has learned from the current policy, scores computed for
    an earlier one can be stale; a history ranker on top still puts observed lengths first."""

    kind = "cached"

    def __init__(self, cache: RankCache, ranker: Ranker):
        self.cache, self.ranker = cache, ranker

    def rank(self, prompts: Sequence[Prompt]) -> list[float]:
        scores = [self.cache.scores.get(p.prompt_id) for p in prompts]
        missing = [i for i, s in enumerate(scores) if s is None]
        if missing:
            for i, s in zip(missing, self.ranker.rank([prompts[i] for i in missing]), strict=True):
                scores[i] = s
        return [float(s) for s in scores]  # type: ignore[arg-type]

    def update(self, prompts: Sequence[Prompt], lengths: Sequence[float]) -> None:
        self.ranker.update(prompts, lengths)

    def fit(self, prompts: Sequence[Prompt], lengths: Sequence[float]) -> None:
        self.ranker.fit(prompts, lengths)

    def wait_idle(self, timeout: float | None = None) -> bool:
        return self.ranker.wait_idle(timeout)

    def close(self) -> None:
        self.ranker.close()


def score(
    ranker: Ranker,
    prompts: Sequence[Prompt],
    batch: int = 256,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, float]:
    """Every prompt's score by ``ranker``, ``batch`` at a time; ``progress(done, total)`` after each."""
    out: dict[str, float] = {}
    for start in range(0, len(prompts), batch):
        chunk = prompts[start : start + batch]
        out.update(zip((p.prompt_id for p in chunk), ranker.rank(chunk), strict=True))
        if progress is not None:
            progress(min(start + batch, len(prompts)), len(prompts))
    return out


def read_lengths(path: str | os.PathLike, task: Task) -> tuple[list[Prompt], list[float]]:
    """(prompt, length) pairs of a JSONL file for ``streamrl rank --fit``: each line holds
    ``length`` and either ``prompt_id`` (of the task's dataset) or ``prompt`` (the text)."""
    p = Path(path).expanduser()
    by_id = {q.prompt_id: q for q in task.prompts()}
    prompts: list[Prompt] = []
    lengths: list[float] = []
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise RankerError(f"--fit: {p} cannot be read: {e.strerror or e}") from e
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        at = f"--fit: {p}, line {n}"
        try:
            rec = json.loads(line)
            length = float(rec["length"])
        except (ValueError, TypeError, KeyError) as e:
            raise RankerError(f'{at}: expected {{"prompt_id" or "prompt": ..., "length": N}} ({e})') from e
        if "prompt_id" in rec:
            pid = str(rec["prompt_id"])
            if pid not in by_id:
                raise RankerError(f"{at}: prompt_id {pid!r} is not in task {task.name!r}")
            prompts.append(by_id[pid])
        elif isinstance(rec.get("prompt"), str):
            prompts.append(Prompt(f"fit/{n:06d}", rec["prompt"]))
        else:
            raise RankerError(f'{at}: no "prompt_id" or "prompt" (text) field')
        lengths.append(length)
    if not prompts:
        raise RankerError(f"--fit: {p} holds no (prompt, length) pairs")
    return prompts, lengths
