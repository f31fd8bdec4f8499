"""Checks before anything is queued: the mistakes that would otherwise surface after the queue wait.

`streamrl run` and `run --dry-run` call :func:`before_submit` on the composed recipe. Every
problem is collected and reported at once (a RecipeError, exit 2) and nothing is written or
submitted. What is checked, where the submit host can see it:

- the task: through the tasks package's own loader (`make_task`), so the dataset is read, every
  row has the prompt field, and the reward imports and is callable exactly as the trainer will
  find them; a task that is not built-in must name a dataset;
- every dataset prompt's length, where the model directory is already there: rendered as the
  trainer renders it and counted with the model's tokenizer as the trainer counts it
  (`tasks.datasets.prompt_ids`), in batches; a prompt over task.max_prompt_len would otherwise end
  the run on the trainer, after the queue wait (not the built-in tasks: their prompts are made
  short, not worth importing transformers for on every dry run);
- the model directory: `config.json` and a tokenizer; the architecture numbers the recipe does
  not give are taken from `config.json`, and a number that contradicts it is an error;
- the distillation teacher's model directory, and that its tokenizer is the policy's (the teacher
  scores the policy's token ids), when both are on this host already;
- the loggers: their packages import.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from streamrl_cli.errors import RecipeError, StreamRLError
from streamrl_cli.models.architecture import TOKENIZER_FILES, architecture, context_length
from streamrl_cli.recipe.checks import is_moe
from streamrl_cli.recipe.load import Composed
from streamrl_cli.recipe.schema import ModelConfig, Recipe

if TYPE_CHECKING:
    from streamrl_cli.tasks.datasets import DatasetTask

LOGGER_MODULES = {"tensorboard": "torch.utils.tensorboard", "wandb": "wandb"}
PARAMS_TOLERANCE = 0.15  # params_b is an estimate from the shapes: ±15 % is agreement
LONG_ROWS_SHOWN = 5  # prompts over task.max_prompt_len named by row; the rest are counted


def before_submit(composed: Composed) -> Composed:
    """``composed`` with the model's architecture filled in from config.json; RecipeError otherwise."""
    r = composed.recipe
    problems: list[str] = []
    model = _model(r.model, composed.model_keys, problems)
    _context(r, problems)
    _routers(r, problems)
    _local_capacity(r, problems)
    _task(r, problems)
    _agent(r, problems)
    _teacher(r, problems)
    _loggers(r, problems)
    if problems:
        raise RecipeError(_where(composed, problems), source=str(composed.path))
    if model is r.model:
        return composed
    return dataclasses.replace(composed, recipe=dataclasses.replace(r, model=model))


_KEY = re.compile(r"([a-z_]+(?:\.[a-z_0-9]+)+): (.*)", re.DOTALL)


def _where(composed: Composed, problems: list[str]) -> list[str]:
    """Each problem ("key.path: message") with where its key was set, as the recipe's own checks say it."""
    from streamrl_cli.recipe.load import Provenance, shipped_recipes_dir

    prov = Provenance(composed.path, shipped_recipes_dir(), composed.choices, composed.overrides)
    return [prov.describe(*m.groups()) if (m := _KEY.fullmatch(p)) else p for p in problems]


def _task(r: Recipe, problems: list[str]) -> None:
    from streamrl_cli.tasks import BUILTIN_TASKS, make_task
    from streamrl_cli.tasks.datasets import DatasetTask

    t = r.task
    if t.dataset is None and t.name not in BUILTIN_TASKS:
        problems.append(
            f"task.dataset: task {t.name!r} is not built-in and names no dataset: set "
            "task.dataset=/path/to/prompts.jsonl (with a task.reward), or task=builtin for the "
            "built-in toy task"
        )
        return
    # The chat template's tokenizer is the model's: only where the model is already there.
    model = Path(os.path.expanduser(r.model.path))
    model_path = str(model) if model.is_dir() else None
    sets = [("task.dataset", t)]
    if t.eval_dataset:
        sets.append(("task.eval_dataset", dataclasses.replace(t, dataset=t.eval_dataset)))
    # Prompt lengths too, with the model's tokenizer: not where the model is made at start, nor where
    # `_model` finds it incomplete (it says so).
    countable, tokenizer = model_path is not None and _has_tokenizer(model), None
    for key, cfg in sets:
        try:
            task = make_task(cfg, seed=r.train.seed, model_path=model_path, agentic=r.agent.enabled)
        except StreamRLError as e:
            problems.append(str(e) if cfg is t else f"task.eval_dataset: {e}")
            continue
        except Exception as e:  # a user's reward module failing at import time
            problems.append(f"task: {type(e).__name__}: {e}")
            continue
        if not countable or not isinstance(task, DatasetTask):
            continue
        try:
            tokenizer = tokenizer or task.chat.load_tokenizer()
        except Exception as e:  # transformers' own errors for a tokenizer it cannot read
            problems.append(f"model.path: the tokenizer of {model} does not load: {type(e).__name__}: {e}")
            countable = False
            continue
        # Only the first task.eval_samples held-out prompts are ever evaluated.
        first = t.eval_samples if key == "task.eval_dataset" else None
        _prompt_lengths(key, task, tokenizer, t.max_prompt_len, first, problems)


def _has_tokenizer(model: Path) -> bool:
    return (model / "config.json").is_file() and any((model / f).is_file() for f in TOKENIZER_FILES)


def _prompt_lengths(
    key: str, task: DatasetTask, tokenizer: Any, max_len: int, first: int | None, problems: list[str]
) -> None:
    """Every prompt of ``task`` within ``max_len`` tokens, counted as the trainer counts; the
    offending rows named (the first few of them) and counted."""
    from streamrl_cli.tasks.datasets import long_prompts

    prompts = task.prompts()[:first] if first else task.prompts()
    found = long_prompts([p.text for p in prompts], tokenizer, max_len)
    if not found:
        return
    rows = [(task.rows[i], n) for i, n in found]
    shown = [f"row {row}: {n}" for row, n in rows[:LONG_ROWS_SHOWN]]
    shown[0] += " tokens"
    more = ", ..." if len(rows) > LONG_ROWS_SHOWN else ""
    one = len(rows) == 1
    of = f"{len(rows):,} of {len(prompts):,} prompt{'' if len(prompts) == 1 else 's'} in {task.path}"
    problems.append(
        f"{key}: {of} {'is' if one else 'are'} longer than task.max_prompt_len={max_len} tokens "
        f"({', '.join(shown)}{more}; rows count from 0); raise task.max_prompt_len to "
        f"{max(n for _, n in rows)} or shorten {'it' if one else 'them'}"
    )


def _agent(r: Recipe, problems: list[str]) -> None:
    """The environment class and the tools load here as the generators will load them, and each
    tool has the JSON schema its chat template needs (not found out on a generator, after the queue)."""
    a = r.agent
    if a.env:
        try:
            from streamrl_cli.tasks.rewards import load_object

            cls = load_object(a.env, "agent.env", kind="Class", example="my_env.py:GuessNumber")
            if not callable(cls):
                problems.append(f"agent.env: {a.env!r} is a {type(cls).__name__}, not a class")
            else:
                missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
                if missing:
                    problems.append(
                        f"agent.env: {a.env} has no {' or '.join(missing)} method (docs/agents.md)"
                    )
        except StreamRLError as e:
            problems.append(str(e))
        except Exception as e:  # an environment module failing at import time
            problems.append(f"agent.env: importing {a.env} failed: {type(e).__name__}: {e}")
    if a.enabled and r.task.chat_template is None:
        _agent_template(r, problems)
    for spec in a.tools:
        try:
            from streamrl_cli.agent.tools import load_tool

            load_tool(spec)
        except StreamRLError as e:
            problems.append(str(e))
        except Exception as e:
            problems.append(f"agent.tools: importing {spec} failed: {type(e).__name__}: {e}")


def _agent_template(r: Recipe, problems: list[str]) -> None:
    """Turns are rendered with the tokenizer's chat template: it must have one (where the model is
    already there to look), and one whose tool-call syntax StreamRL reads if there are tools."""
    from streamrl_cli.agent.tools import template_format, unreadable

    model = Path(os.path.expanduser(r.model.path))
    if not (model / "tokenizer_config.json").is_file():
        return
    try:
        template = json.loads((model / "tokenizer_config.json").read_text()).get("chat_template")
    except (OSError, ValueError):
        return
    if template is None and (model / "chat_template.jinja").is_file():
        template = (model / "chat_template.jinja").read_text()
    if not template:
        problems.append(
            f"agent: the tokenizer of {model} has no chat template, and multi-turn rollouts render each "
            "observation as a chat message: use a chat model, or set task.chat_template"
        )
    elif r.agent.tools and r.agent.tool_format is None and template_format(template) is None:
        problems.append(unreadable(f"the chat template of {model}"))


def _loggers(r: Recipe, problems: list[str]) -> None:
    for name in r.train.loggers:
        module = LOGGER_MODULES.get(name)
        if module is None:
            continue  # the recipe's own validation names the valid loggers
        try:
            importlib.import_module(module)
        except Exception as e:
            problems.append(
                f"train.loggers: {name!r} needs the package behind {module!r}, which does not import "
                f"here ({type(e).__name__}: {e}); pip install {name} or drop it from train.loggers"
            )


def _teacher(r: Recipe, problems: list[str]) -> None:
    from streamrl_cli.models.fingerprint import vocabulary_fingerprint

    t = r.roles.teacher
    if t.instances < 1 or not t.model.path:
        return
    teacher = Path(t.model.path).expanduser()
    if not teacher.exists():
        if t.model.builder is None and _looks_like_path(t.model.path):
            problems.append(
                f"roles.teacher.model.path: {t.model.path} does not exist (the teacher's model directory, "
                "with config.json and the policy's tokenizer), and no roles.teacher.model.builder makes it"
            )
        return
    student = Path(r.model.path).expanduser()
    if not student.is_dir():
        return  # made by its builder at start: the teacher compares the two when it starts
    try:
        same = vocabulary_fingerprint(student) == vocabulary_fingerprint(teacher)
    except StreamRLError as e:
        problems.append(f"roles.teacher.model.path: {e}")
        return
    if not same:
        problems.append(
            f"roles.teacher.model.path: the teacher's tokenizer ({teacher}) differs from the policy's "
            f"(model.path={student}); on-policy distillation scores the policy's token ids, so both "
            "models must share one vocabulary"
        )


def _model(m: ModelConfig, given: frozenset[str], problems: list[str]) -> ModelConfig:
    path = Path(os.path.expanduser(m.path))
    if not path.exists():
        if m.builder is None and _looks_like_path(m.path):
            problems.append(
                f"model.path: {m.path} does not exist (a directory with config.json and a tokenizer, "
                "or a hub id such as Qwen/Qwen2.5-7B on clusters with a model cache)"
            )
        return m  # a hub id, or a model the builder makes: nothing to read here
    if not path.is_dir():
        problems.append(f"model.path: {m.path} is a file, not a model directory")
        return m
    config_file = path / "config.json"
    missing = []
    if not config_file.is_file():
        missing.append("config.json")
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        missing.append(f"tokenizer (one of {', '.join(TOKENIZER_FILES)})")
    if missing:
        problems.append(f"model.path: {m.path} has no {' and no '.join(missing)}")
    if not config_file.is_file():
        return m
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        problems.append(f"model.path: cannot read {config_file}: {e}")
        return m
    return _architecture(m, config, given, str(config_file), problems)


def _looks_like_path(p: str) -> bool:
    return p.startswith(("/", "./", "../", "~")) or os.sep in p and p.count("/") != 1


def _architecture(
    m: ModelConfig, config: dict[str, Any], given: frozenset[str], where: str, problems: list[str]
) -> ModelConfig:
    stated = architecture(config)
    fill: dict[str, Any] = {}
    for key, value in stated.items():
        ours = getattr(m, key)
        if key not in given:
            fill[key] = value
        elif key == "params_b":
            if ours > 0 and abs(ours - value) > PARAMS_TOLERANCE * value:
                problems.append(
                    f"model.params_b: {ours} but {where} describes a model of about {value:.3g} B "
                    "parameters; fix the recipe or leave params_b out to use the config's"
                )
        elif ours != value:
            problems.append(
                f"model.{key}: {ours} but {where} says {value}; fix the recipe or leave "
                f"model.{key} out to use the config's"
            )
    return dataclasses.replace(m, **fill) if fill else m


# Local role processes per core of this machine: past it they only take turns (an engine, the trainer
# and a few environment processes share 2 cores in the tests); a user asking for more wants SLURM.
LOCAL_PROCESSES_PER_CORE = 4


def _local_capacity(r: Recipe, problems: list[str]) -> None:
    """Pools on a local cluster start one process per instance on this machine: bounded by its cores."""
    from streamrl_cli.recipe.checks import env_server_placed, teacher_placed

    cores = os.cpu_count() or 1
    bound = LOCAL_PROCESSES_PER_CORE * cores
    g = r.roles.generator
    pools = [
        ("generator", "instances", g.instances, g.cluster),
        ("generator", "elastic.max", g.elastic.max if g.elastic.enabled else 0, g.cluster),
        ("teacher", "instances", r.roles.teacher.instances, teacher_placed(r).cluster),
        ("env_server", "instances", r.roles.env_server.instances, env_server_placed(r).cluster),
    ]
    for role, key, n, cluster in pools:
        c = r.clusters.get(cluster or "")
        if c is not None and c.launcher == "local" and n > bound:
            problems.append(
                f"roles.{role}.{key}: {n} local {role} processes on this machine's {cores} core(s); at "
                f"most {bound} ({LOCAL_PROCESSES_PER_CORE} per core) run here, on cluster {cluster!r} "
                "(launcher: local); put the role on a SLURM cluster for more"
            )


def _routers(r: Recipe, problems: list[str]) -> None:
    """algorithm.router_aux_loss_coef and routing_replay need a mixture-of-experts model (config.json's
    experts, or a MoE builder's model)."""
    a = r.algorithm
    keys = [
        (k, v)
        for k, v in (("router_aux_loss_coef", a.router_aux_loss_coef), ("routing_replay", a.routing_replay))
        if v
    ]
    if not keys:
        return
    if is_moe(r.model) is not False:
        return  # a MoE; or it cannot tell here (a hub id: the trainer checks when it loads the model)
    path = Path(os.path.expanduser(r.model.path)) / "config.json"
    where = str(path) if path.is_file() else f"the {r.model.builder} builder's model"
    what = {
        "router_aux_loss_coef": "weighs the routers' load-balancing loss",
        "routing_replay": "replays the generators' choice of experts in the trainer",
    }
    for key, value in keys:
        off = "0" if key == "router_aux_loss_coef" else "false"
        problems.append(
            f"algorithm.{key}: {value} {what[key]}, and the model ({where}) is dense, with no experts to "
            f"route to; set it to {off}, or train a mixture-of-experts model"
        )


def _context(r: Recipe, problems: list[str]) -> None:
    """The longest prompt plus the longest output fit the model's positions (config.json, or the
    built-in builder's architecture for a model made at start)."""
    path = Path(os.path.expanduser(r.model.path)) / "config.json"
    where = f"{path}'s max_position_embeddings"
    if path.is_file():
        try:
            n = context_length(json.loads(path.read_text()))
        except (OSError, ValueError, AttributeError):
            return  # `_model` says what is wrong with it
    elif r.model.builder is not None:
        from streamrl_cli.models.tiny import TinySpec

        n = r.model.builder_positions or TinySpec().max_position_embeddings
        where = f"the {r.model.builder} builder's model (model.builder_positions)"
    else:
        return  # a hub id: its config is read on the cluster
    t = r.task
    if n is not None and t.max_prompt_len + t.max_output_len > n:
        problems.append(
            f"task.max_output_len: task.max_prompt_len={t.max_prompt_len} + task.max_output_len="
            f"{t.max_output_len} = {t.max_prompt_len + t.max_output_len} tokens, more than the {n} positions "
            f"of the model ({where}); lower task.max_output_len to at most {max(n - t.max_prompt_len, 0)} "
            "(or task.max_prompt_len), or use a model with a longer context"
        )
