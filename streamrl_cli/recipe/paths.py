"""User files a recipe names, made absolute once, where the recipe is loaded.

Role processes start in other directories (a SLURM job starts wherever sbatch put it, possibly on
another node), so a relative ``task.dataset`` or ``task.reward=rewards/mine.py:score`` must not be
resolved there. Relative paths are taken from the directory ``streamrl`` is started in, as
``run.root`` and every path on the command line are: that is where a user who typed
``task.dataset=data/train.jsonl`` is. The absolute paths are what the run directory records, so
a resumed run (started from anywhere) finds the same files.
"""

from __future__ import annotations

from pathlib import Path

from streamrl_cli.recipe.schema import Recipe


def is_reward_file(target: str) -> bool:
    """Whether the part of task.reward before ':' names a file (else a module)."""
    return target.endswith(".py") or "/" in target or "\\" in target


def _object(spec: str, base: Path) -> str:
    """A `file.py:name` spec with its file made absolute (a `module:name` stays as it is)."""
    target, sep, attr = spec.rpartition(":")
    if sep and target and is_reward_file(target):
        return f"{absolute(target, base)}:{attr}"
    return spec


def absolute(path: str, base: Path) -> str:
    p = Path(path).expanduser()
    return str(p if p.is_absolute() else (base / p).resolve())


def resolve(r: Recipe, base: Path) -> None:
    """Make the task's and the agent's file paths absolute against ``base`` (in place)."""
    t = r.task
    if t.dataset:
        t.dataset = absolute(t.dataset, base)
    if t.eval_dataset:
        t.eval_dataset = absolute(t.eval_dataset, base)
    if t.reward:
        t.reward = _object(t.reward, base)
    a = r.agent
    if a.env:
        a.env = _object(a.env, base)
    a.tools = [_object(spec, base) for spec in a.tools]
    if t.chat_template and t.chat_template.endswith(".jinja"):
        t.chat_template = absolute(t.chat_template, base)
