"""A brief supervised warm-up of the tiny model on a task, and making the recipe's model on first use.

Reinforcement learning from a randomly initialised 2-layer model would spend the whole demo
discovering the output format. A few hundred supervised steps on the task's references teach the
format (copy the word, stop with EOS) and a rough sense of the count; they are kept brief (tens of
seconds on two cores) and, for the built-in task, trained on deliberately noisy references, so
that the policy is clearly imperfect and RL has something to improve. Measured on two cores:
400 steps take ~15 s and leave a sampled reward of ~0.3 (clean references: ~0.67 already);
GRPO with lr 1e-3, 8 prompts × 4 samples then reaches ~0.6 within 20-40 steps.

The result is written like :mod:`streamrl_cli.models.tiny` writes models: into a temporary sibling
directory renamed into place, with a marker file (task, steps, seed, final loss) written last. A
directory whose marker matches is reused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from streamrl_cli.errors import StreamRLError
from streamrl_cli.tasks import Task, make_task

if TYPE_CHECKING:
    from streamrl_cli.recipe.schema import ModelConfig, TaskConfig, TeacherModelConfig

MARKER = "streamrl-warmup.json"
BATCH = 32  # prompts per supervised step
LR = 3e-3  # AdamW learning rate: high, the model is tiny and starts from random weights

Progress = Callable[[int, int, float], None]  # (step, steps, loss)


def _marker(out: Path) -> dict | None:
    try:
        return json.loads((out / MARKER).read_text())
    except (OSError, ValueError):
        return None


def warm_up(
    base: Path,
    out: Path,
    task: Task,
    steps: int,
    seed: int = 0,
    progress: Progress | None = None,
    *,
    exact: bool = False,
    lr: float = LR,
) -> Path:
    """Fine-tune the model at ``base`` on ``task``'s references for ``steps`` steps, save it at ``out``.
    ``exact``: on the task's exact answers (a distillation teacher's), not its noisy warm-up ones."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out).expanduser().resolve()
    wanted = {"task": task.name, "steps": steps, "seed": seed, **({"exact": True, "lr": lr} if exact else {})}
    done = _marker(out)
    if done is not None and all(done.get(k) == v for k, v in wanted.items()):
        return out
    # exact: none of the noisy ones; the loop below falls back to task.reference_completion
    reference = None if exact else getattr(task, "warmup_completion", None)
    episode = None if exact else getattr(task, "warmup_episode", None)  # multi-turn reference conversations
    if reference is None and episode is None and not hasattr(task, "reference_completion"):
        raise StreamRLError(
            f"model.builder=tiny-warm: task {task.name!r} has no reference completions to warm up on "
            "(the built-in task has; with a dataset use model.builder=tiny)"
        )

    tokenizer = AutoTokenizer.from_pretrained(base)
    extra = list(getattr(task, "special_tokens", ()))
    if extra:  # single tokens the task's format needs (tool-call tags), as real chat tokenizers have
        tokenizer.add_special_tokens({"additional_special_tokens": extra})
    if getattr(task, "chat_template", None):
        tokenizer.chat_template = task.chat_template
    eos = tokenizer.eos_token_id
    if eos is None:
        raise StreamRLError(f"the tokenizer of {base} has no EOS token; the warm-up needs one")
    rng = random.Random(f"warmup-{seed}")
    prompts = list(task.prompts())
    t0, loss_value = time.monotonic(), float("nan")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
            model.resize_token_embeddings(len(tokenizer))
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
        for step in range(1, steps + 1):
            batch = [rng.choice(prompts) for _ in range(BATCH)]
            if episode is not None:
                input_ids, labels, mask = _encode_episodes(tokenizer, batch, [episode(p, rng) for p in batch])
            elif reference is not None:
                completions = [reference(p, rng) for p in batch]
            else:
                completions = [task.reference_completion(p) for p in batch]  # type: ignore[attr-defined]
            if episode is None:
                input_ids, labels, mask = _encode(tokenizer, batch, completions, eos)
            logits = model(input_ids=input_ids, attention_mask=mask).logits[:, :-1]
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
            )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            loss_value = float(loss.detach())
            if progress is not None:
                progress(step, steps, loss_value)
    model.eval()
    info = {**wanted, "final_loss": loss_value, "base": str(base), "seconds": round(time.monotonic() - t0, 1)}
    _save_atomically(model, tokenizer, out, info, wanted)
    return out


def _encode(tokenizer, prompts, completions, eos: int):  # type: ignore[no-untyped-def]
    """Right-padded ids, labels (-100 on prompt and padding: loss on completion + EOS only), mask."""
    rows = []
    for p, c in zip(prompts, completions, strict=True):
        prompt_ids = tokenizer(p.text, add_special_tokens=False).input_ids
        completion_ids = tokenizer(c, add_special_tokens=False).input_ids + [eos]
        rows.append((prompt_ids + completion_ids, [-100] * len(prompt_ids) + completion_ids))
    return _pad(tokenizer, rows, eos)


def _encode_episodes(tokenizer, prompts, episodes):  # type: ignore[no-untyped-def]
    """Reference conversations tokenized exactly as a multi-turn rollout builds them (the same
    renderer: the assistant's turns as the model would sample them, each closed by the template's
    end-of-turn token, the tool answers rendered on their own); loss on the assistant's tokens only."""
    from streamrl_cli.agent.render import Renderer

    r = Renderer(tokenizer)
    end = r.turn_end_ids[0]
    rows = []
    for p, messages in zip(prompts, episodes, strict=True):
        ids = tokenizer(p.text, add_special_tokens=False).input_ids + r.first_turn([])
        labels = [-100] * len(ids)
        last: list[int] = []
        for m in messages:
            if m["role"] == "assistant":
                last = tokenizer(m["content"], add_special_tokens=False).input_ids + [end]
                ids, labels = ids + last, labels + last
            else:
                env = r.env_turn([m], last)
                ids, labels = ids + env, labels + [-100] * len(env)
        rows.append((ids, labels))
    return _pad(tokenizer, rows, end)


def _pad(tokenizer, rows, eos: int):  # type: ignore[no-untyped-def]
    import torch

    width = max(len(ids) for ids, _ in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in rows])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows])
    mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in rows])
    return input_ids, labels, mask


def _save_atomically(model, tokenizer, out: Path, info: dict, wanted: dict) -> None:  # type: ignore[no-untyped-def]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    old = None
    try:
        from streamrl_cli.models.tiny import library_output_to_stderr

        with library_output_to_stderr():
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
        (tmp / MARKER).write_text(json.dumps(info, indent=2) + "\n")  # last: marks it complete
        done = _marker(out)
        if done is not None and all(done.get(k) == v for k, v in wanted.items()):
            return  # someone else finished the same warm-up first: theirs may be in use, keep it
        if out.exists():  # a stale warm-up (other steps or seed): move it aside, then replace
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}-old-", dir=out.parent))
            os.replace(out, old / "model")
        try:
            tmp.rename(out)
        except OSError:
            if _marker(out) is None:  # nobody else finished one either
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


TEACHER_SPEC = {"hidden_size": 128, "num_layers": 4, "num_attention_heads": 4, "num_kv_heads": 4,
                "intermediate_size": 256}  # fmt: skip  # twice the tiny policy's width and depth
# The wider, deeper model diverges at the policy's LR. Measured here (200 held-out prompts, sampled at
# temperature 1): 600 steps at 1e-3 reach a reward of 0.98; at 3e-3, 0.33 (the warmed policy: 0.38).
TEACHER_LR = 1e-3


def ensure_teacher(model: TeacherModelConfig, task: TaskConfig) -> Path:
    """The distillation teacher's model directory, made first if its ``builder`` says how: builder
    ``tiny-teacher`` is a tiny Qwen2 twice as wide and deep as the policy, with the same tokenizer,
    trained on the task's exact answers."""
    from streamrl_cli.models.tiny import TinySpec, build_tiny_model

    if not model.path:
        raise StreamRLError("roles.teacher.model.path: the teacher's model directory is not set")
    path = Path(os.path.expanduser(model.path))
    if path.exists():
        return path
    if model.builder is None:
        raise StreamRLError(
            f"roles.teacher.model.path: the teacher's model directory {path} does not exist; point it at "
            "a model that shares the policy's tokenizer, or set roles.teacher.model.builder=tiny-teacher"
        )
    if model.builder != "tiny-teacher":
        raise StreamRLError(
            f"roles.teacher.model.builder: unknown builder {model.builder!r} (valid: tiny-teacher)"
        )
    with _locked(path):  # every teacher instance of a local run calls this at start
        if path.exists():
            return path
        base = build_tiny_model(Path(f"{path}-base"), TinySpec(**TEACHER_SPEC))
        return warm_up(base, path, make_task(task), model.warmup_steps, exact=True, lr=TEACHER_LR)


def ensure_model(model: ModelConfig, task: TaskConfig, progress: Progress | None = None) -> Path:
    """The recipe's model directory, made first if its ``builder`` says how."""
    from streamrl_cli.models.tiny import MOE_SPEC, TinySpec, build_tiny_model
    from streamrl_cli.recipe.schema import MODEL_BUILDERS, MOE_BUILDERS

    path = Path(os.path.expanduser(model.path))
    if path.exists():
        return path
    builder = model.builder
    shape: dict = dict(MOE_SPEC) if builder in MOE_BUILDERS else {}
    if model.builder_positions:
        shape["max_position_embeddings"] = model.builder_positions
    spec = TinySpec(**shape) if shape else None
    if builder in ("tiny", "tiny-moe"):
        return build_tiny_model(path, spec)
    if builder in ("tiny-warm", "tiny-moe-warm"):
        steps = model.warmup_steps
        if steps < 1:
            raise StreamRLError(
                f"model.warmup_steps must be at least 1 with model.builder={builder}, got {steps}"
            )
        # Every role of a local run calls this at start: one warms up, the others wait for it
        # rather than running the same training side by side on the same two cores.
        with _locked(path):
            if path.exists():
                return path
            base = build_tiny_model(Path(f"{path}-base"), spec)
            # On the instructions alone: the format is what the warm-up teaches, and a long context's
            # filler (task.filler_words) would only make each step longer.
            short = dataclasses.replace(task, filler_words=0)
            return warm_up(base, path, make_task(short), steps, progress=progress)
    if builder is None:
        raise StreamRLError(
            f"model.path: the model directory {path} does not exist; download or copy the model there, "
            "point model.path at an existing directory, or set model.builder=tiny (or tiny-warm; tiny-moe, "
            "tiny-moe-warm for the mixture of experts) to build the tiny test model"
        )
    raise StreamRLError(
        f"model.builder: unknown builder {builder!r} (valid: {', '.join(MODEL_BUILDERS)}, or null)"
    )


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock (flock on a sibling file) held while ``path`` is being made."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
