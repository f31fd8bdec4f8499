"""Tensor parallelism for the trainer (``roles.trainer.tensor_parallel``): each layer's weights split
over ``degree`` ranks, by DeepSpeed's AutoTP.

The trainer's N ranks form N / degree *tensor-parallel (TP) groups* of consecutive ranks (DeepSpeed's
mesh ``(data_parallel, tensor_parallel)``, TP the inner dimension: ranks ``[g·t, (g+1)·t)``). As
``deepspeed.initialize`` makes an engine it replaces the model's linear layers by AutoTP's, following
the model's own tensor-parallel plan (transformers' ``base_model_tp_plan``; Qwen2: q/k/v, gate and up
projections split by output rows, o and down projections by input columns with an all-reduce after
them, the LM head split by rows with its logits gathered). Embeddings and norms stay whole on every
rank. The ranks of a group run the SAME micro-batch (DeepSpeed checks this on the first forward); each
holds 1/degree of every split weight, its gradient and optimizer state, and ZeRO (any stage) shards
those over the data-parallel ranks of the same TP position: a ZeRO-3 engine holds 1/N of the model.

What the caller does differently (``trainer.role.learner``): engines get :meth:`TensorParallel.ds_config`;
losses and stats, summed over all ranks, count each micro-batch once per rank of its group (divide by
``degree``); DeepSpeed averages each gradient over the data-parallel width (:attr:`dp_world`), not the
world; the rank driver hands one micro-batch per TP group (:attr:`dp_rank`); the weights the
generators get, a checkpoint's exported model and the export read the whole tensors, gathered from the
shards (:meth:`gathered`), under the model's own names and shapes.

Not with sequence parallelism (DeepSpeed makes one model-parallel layout per engine: AutoTP's groups
replace the ``mpu`` Ulysses needs) nor with LoRA (PEFT wraps the layers AutoTP would split): the recipe
checks refuse both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

# Beside a tensor-parallel checkpoint's DeepSpeed shards (actor/): its weights gathered whole, which
# `streamrl export` reads (DeepSpeed's zero_to_fp32 knows no tensor-parallel shards).
WHOLE = "whole_model.safetensors"


class TensorParallel:
    """This rank's place in the TP layout. ``degree`` 1 is not built: the trainer then runs as before."""

    def __init__(self, degree: int, world: int):
        if degree < 2:
            raise ValueError(f"tensor parallelism needs a degree of 2 or more, got {degree}")
        if world % degree:
            raise ValueError(f"tensor_parallel {degree} does not divide the trainer's {world} ranks")
        self.degree = degree
        self.dp_world = world // degree  # micro-batches per round: one per TP group
        self.dp_rank = (dist.get_rank() if dist.is_initialized() else 0) // degree

    def ds_config(self) -> dict[str, Any]:
        """The DeepSpeed config's part that makes AutoTP split the engine's model as it is made."""
        return {"tensor_parallel": {"autotp_size": self.degree}}

    @staticmethod
    def gathered(engine: Any) -> dict[str, torch.Tensor]:
        """Every weight of `engine`'s model, whole, by its HF name (every rank must call it; ZeRO-3's
        partitions are gathered too): on rank 0; the other ranks get {}. DeepSpeed's own consolidation,
        one layer at a time (``GatherReplacedLayerParams``), in the weights' dtype."""
        state = engine._consolidated_16bit_state_dict()
        if state is None:
            return {}
        return {name: t.detach().clone() for name, t in state.items()}

    def save_whole(self, engine: Any, actor_dir: Path) -> None:
        """Every rank: gather `engine`'s weights; rank 0 writes them to ``actor_dir/WHOLE``."""
        from safetensors.torch import save_file

        state = self.gathered(engine)
        if dist.get_rank() == 0:
            actor_dir.mkdir(parents=True, exist_ok=True)
            tmp = actor_dir / f".{WHOLE}.tmp"
            save_file({k: v.contiguous() for k, v in state.items()}, str(tmp))
            tmp.rename(actor_dir / WHOLE)

    @staticmethod
    def grad_norm(params: list[torch.nn.Parameter]) -> float:
        """The whole model's gradient norm from this rank's parameters (every rank calls it): the
        split weights' squares summed over the TP group, the whole ones (the same on every rank of
        it) counted once, as DeepSpeed's clipping counts them (``runtime.utils.clip_grad_norm_``)."""
        from deepspeed.utils import groups

        split = torch.zeros((), dtype=torch.float64)
        whole = torch.zeros((), dtype=torch.float64)
        for p in params:
            if p.grad is None:
                continue
            sq = p.grad.detach().double().pow(2).sum()
            if getattr(p, "tensor_model_parallel", False):
                split += sq
            else:
                whole += sq
        dist.all_reduce(split, group=groups.get_tensor_model_parallel_group())
        return float((split + whole).sqrt())
