"""Checkpoints: policy, critic and optimizer states (DeepSpeed's own format), data position, RNG.

Layout: ``run_dir/checkpoints/iter-<N>/{actor,critic}/`` written by ``engine.save_checkpoint``
(every rank writes its ZeRO shards), plus ``state.json`` with what the trainer needs to continue
(iteration, weight version, the prompt sampler's position, RNG states), written last: a
directory without it is incomplete and ignored. ``latest`` names the newest complete one.

With LoRA the actor's checkpoint holds the adapters and their optimizer state only (the base
weights are the model directory's, unchanged), and ``actor/adapter_config.json`` says so.

With tensor parallelism DeepSpeed writes each TP rank's shards (``mp_rank_NN``), which only a trainer
of the same ``tensor_parallel`` resumes from; the actor's weights gathered whole go beside them
(``actor/whole_model.safetensors``, trainer.role.tensor_parallel.WHOLE) for ``streamrl export``.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from streamrl_cli.errors import StreamRLError
from streamrl_cli.rundir import RunDir, write_atomic
from streamrl_cli.trainer.role import lora as lora_

STATE = "state.json"


class CheckpointMismatch(StreamRLError):
    """A checkpoint of another kind of run (LoRA vs. every weight) than the one resuming it."""


def checkpoint_dir(run_dir: Path, iteration: int) -> Path:
    return RunDir(run_dir).checkpoints / f"iter-{iteration:06d}"


def rng_state() -> dict[str, Any]:
    return {"python": repr(random.getstate()), "torch": torch.get_rng_state().tolist()}


def set_rng_state(state: dict[str, Any]) -> None:
    import ast

    random.setstate(ast.literal_eval(state["python"]))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


def save_engines(learner: Any, path: Path, client_state: dict[str, Any]) -> None:
    """Every rank: DeepSpeed checkpoints of actor (and critic); rank 0 then writes state.json."""
    import torch.distributed as dist

    adapters = getattr(learner, "lora", None) is not None
    # LoRA: the frozen base weights stay out (the optimizer holds the adapters only anyway).
    learner.actor.save_checkpoint(str(path / "actor"), tag="ckpt", exclude_frozen_parameters=adapters)
    if adapters and (not dist.is_initialized() or dist.get_rank() == 0):
        lora_.save_config(learner.actor.module, path / "actor")
    if learner.critic is not None:
        learner.critic.save_checkpoint(str(path / "critic"), tag="ckpt")
    if getattr(learner, "tp", None) is not None:
        learner.tp.save_whole(learner.actor, path / "actor")
    if dist.is_initialized():
        dist.barrier()
    if client_state:
        write_atomic(path / STATE, json.dumps(client_state, indent=2) + "\n", durable=True)
        write_atomic(path.parent / "latest", path.name + "\n", durable=True)


def load_engines(learner: Any, path: Path) -> dict[str, Any]:
    adapters = getattr(learner, "lora", None) is not None
    saved = (path / "actor" / lora_.CONFIG_FILE).is_file()
    if adapters != saved:
        kind = {True: "LoRA adapters (model.lora.rank > 0)", False: "every weight (model.lora.rank = 0)"}
        raise CheckpointMismatch(
            f"{path} trained {kind[saved]} but this run trains {kind[adapters]}: resume with the "
            "model.lora the checkpoint was written with"
        )
    tp = learner.tp.degree if getattr(learner, "tp", None) is not None else 1
    written = tp_degree(path / "actor")
    if written != tp:
        raise CheckpointMismatch(
            f"{path} was written by a trainer with roles.trainer.tensor_parallel={written}, and this "
            f"one has {tp}: DeepSpeed resumes tensor-parallel shards only into the same layout; resume "
            "with the tensor_parallel the checkpoint was written with"
        )
    # LoRA: the checkpoint has no base weights, which the model directory gave already.
    learner.actor.load_checkpoint(str(path / "actor"), tag="ckpt", load_module_strict=not adapters)
    if learner.critic is not None:
        learner.critic.load_checkpoint(str(path / "critic"), tag="ckpt")
    return json.loads((path / STATE).read_text())


def tp_degree(engine_dir: Path) -> int:
    """The tensor-parallel degree of the trainer that wrote a DeepSpeed checkpoint: how many TP ranks'
    files (``mp_rank_NN``) it has; 1 for one that has none."""
    ranks = {
        m.group(1) for f in (engine_dir / "ckpt").glob("*") if (m := re.search(r"mp_rank_(\d+)", f.name))
    }
    return max(len(ranks), 1)


def latest(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run, or None."""
    root = RunDir(run_dir).checkpoints
    done = sorted(p for p in root.glob("iter-*") if (p / STATE).is_file()) if root.is_dir() else []
    return done[-1] if done else None


def prune(run_dir: Path, keep: int) -> None:
    """Delete all but the newest `keep` complete checkpoints (and incomplete older ones)."""
    root = RunDir(run_dir).checkpoints
    if keep < 1 or not root.is_dir():
        return
    complete = sorted(p for p in root.glob("iter-*") if (p / STATE).is_file())
    if not complete:
        return
    newest_kept = complete[-keep:]
    for p in root.glob("iter-*"):
        if p not in newest_kept and p.name < newest_kept[-1].name:
            shutil.rmtree(p, ignore_errors=True)
