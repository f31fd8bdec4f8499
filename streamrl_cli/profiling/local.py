"""Measuring on this machine: the profile worker runs in a child process.

vLLM spawns its own engine core and holds gigabytes, so the caller — the CLI on this machine
(``--local``, or a recipe whose roles run locally), or the SLURM job of one hardware kind
(``profiling.jobs``) — stays light and keeps reporting progress while the child
(``profiling.worker``) works. The child reports progress as JSON lines on stdout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from streamrl_cli.planner import ProfileError
from streamrl_cli.planner.profile import Profile, ProfileRequest, load_profile
from streamrl_cli.recipe.schema import SEQS

if TYPE_CHECKING:
    from streamrl_cli.recipe.schema import Recipe


def request_from_recipe(r: Recipe, *, trainer: str, batches: str, where: str) -> ProfileRequest:
    """What every measurement of this recipe shares (hardware, out and measure are per profile).

    ``where`` says for the error message where the engines will read the model from.
    """
    # The options first: a mistake in them is said before the model is built (minutes, maybe).
    if trainer not in ("torch", "deepspeed"):
        raise ProfileError(f"--trainer {trainer!r}: valid: torch, deepspeed")
    try:
        sizes = tuple(sorted({int(b) for b in batches.split(",")}))
    except ValueError:
        raise ProfileError(f"--batches {batches!r}: expected comma-separated integers") from None
    if not sizes or sizes[0] < 1 or sizes[-1] > SEQS:
        raise ProfileError(
            f"--batches {batches!r}: batch sizes must be in 1..{SEQS:,} (an engine's sequences)"
        )
    model_dir = Path(r.model.path).expanduser()
    build = False
    if not (model_dir / "config.json").is_file():
        if not r.model.builder:
            raise ProfileError(
                f"model.path {r.model.path!r} is not a local model directory: `streamrl profile` runs the "
                f"engines {where} on the model's files (on this machine: `streamrl profile local`)"
            )
        # A recipe that says how to make its model (the tiny one, maybe warmed up): made here, once,
        # exactly as `streamrl run` makes it, so a later run finds the same model at model.path.
        from streamrl_cli.models.warmup import ensure_model

        ensure_model(r.model, r.task)
    return ProfileRequest(
        model_dir=str(model_dir),
        model=r.model.name,
        batches=sizes,
        trainer=trainer,
        zero_stage=max(1, r.roles.trainer.zero_stage),
        build_tiny=build,
        dtype=r.model.dtype,
        decode_tp=r.roles.generator.tensor_parallel,
    )


def run_profile(
    req: ProfileRequest,
    on_event: Callable[[dict], None] = lambda e: None,
    timeout_s: float = 1800,
    log_path: str | os.PathLike | None = None,
) -> Profile:
    """Run the measuring child; ``on_event`` gets each progress record. Returns the saved profile.

    The child's stderr (vLLM's logs) goes to ``log_path`` if given, else to a temporary file; its
    last lines make the error message when the child fails.
    """
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
    }
    cmd = [sys.executable, "-m", "streamrl_cli.profiling.worker", json.dumps(asdict(req))]
    error = None
    # vLLM logs plenty to stderr: a file, not a pipe nobody drains while stdout is read.
    with open(log_path, "w+") if log_path else tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                event = _event(line)
                if event is None:
                    continue
                if event.get("event") == "error":
                    error = event.get("message")
                on_event(event)
            proc.wait(timeout=timeout_s)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        log.seek(0)
        tail = log.read().splitlines()[-15:]
    if proc.returncode != 0 or error:
        detail = error or "\n    ".join(tail) or f"exit code {proc.returncode}"
        raise ProfileError(f"profiling failed: {detail}")
    return load_profile(req.out)


def _event(line: str) -> dict | None:
    if not line.startswith("{"):
        return None
    try:
        event = json.loads(line)
    except json.JSONDecodeError:
        return None
    return event if isinstance(event, dict) else None
