"""Which GPUs one role process uses, from what SLURM (or the local launcher) put in its environment.

A trainer job asks `--gpus-per-node=G --ntasks-per-node=G`: SLURM gives every task of the step
the same `CUDA_VISIBLE_DEVICES` (all G GPUs of the node) and no `LOCAL_RANK`. As torchrun and
submitit's distributed environment do, each rank then takes the GPU at its node-local index
(`SLURM_LOCALID`) and keeps the others visible, so that NCCL can still reach them peer to peer.
Where the site binds GPUs per task itself (`--gpus-per-task`, `--gpu-bind`), a task sees exactly
its own GPUs and uses them from index 0. A generator instance is one array task with its own
GPUs (`--gpus-per-node=gpus_per_instance`): vLLM's tensor-parallel workers use all of them.

Pure: a mapping in, a Placement out; the caller applies it to ``os.environ``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from streamrl_cli.errors import ClusterError
from streamrl_cli.recipe.schema import GeneratorConfig, RendezvousConfig, TeacherConfig, TrainerConfig


@dataclass(frozen=True, kw_only=True)
class Placement:
    local_rank: int  # the process's index among its job's processes on this node
    devices: tuple[str, ...]  # the GPUs it uses, as CUDA_VISIBLE_DEVICES names them (empty: CPU)
    cuda_index: int  # torch's index of its first device (`cuda:N`), within what is visible
    visible: str | None  # CUDA_VISIBLE_DEVICES it runs with (None: left as it is)

    def record(self) -> dict:
        return {"local_rank": self.local_rank, "gpus": list(self.devices), "cuda_index": self.cuda_index}


def _ids(value: str | None) -> list[str] | None:
    if value is None or value.strip() in ("", "NoDevFiles"):
        return None
    return [v.strip() for v in value.split(",") if v.strip()]


def placement(env: Mapping[str, str], gpus: int, *, narrow: bool = False) -> Placement:
    """The GPUs of the process whose environment is ``env``, which needs ``gpus`` of them.

    ``narrow``: make only its own GPUs visible (a generator: vLLM takes every visible GPU); the
    trainer keeps its node's GPUs visible and picks ``cuda:cuda_index``.
    """
    local = int(env.get("SLURM_LOCALID") or env.get("LOCAL_RANK") or 0)
    if gpus <= 0:
        return Placement(local_rank=local, devices=(), cuda_index=0, visible=None)
    visible = _ids(env.get("CUDA_VISIBLE_DEVICES"))
    if visible is None:
        visible = _ids(env.get("SLURM_STEP_GPUS") or env.get("SLURM_JOB_GPUS"))
        if visible is None:
            # Nothing says which GPUs (the local launcher): the machine's own numbering, left as it is.
            first = local * gpus
            devices = tuple(str(i) for i in range(first, first + gpus))
            return Placement(local_rank=local, devices=devices, cuda_index=first, visible=None)
    if len(visible) == gpus:  # bound per task already (--gpus-per-task, --gpu-bind, an array task)
        return Placement(local_rank=local, devices=tuple(visible), cuda_index=0, visible=None)
    first = local * gpus
    if len(visible) < first + gpus:
        raise ClusterError(
            f"process {local} on this node needs {gpus} GPU(s) but only GPUs {','.join(visible)} are "
            f"visible (CUDA_VISIBLE_DEVICES); the job must ask {gpus} GPU(s) per task on each node"
        )
    devices = tuple(visible[first : first + gpus])
    if narrow:
        return Placement(local_rank=local, devices=devices, cuda_index=0, visible=",".join(devices))
    return Placement(local_rank=local, devices=devices, cuda_index=first, visible=None)


def gpus_per_process(
    role: str, settings: TrainerConfig | GeneratorConfig | TeacherConfig | RendezvousConfig
) -> int:
    """GPUs one process of ``role`` uses: one per trainer rank, an instance's GPUs per generator or
    teacher (``settings``: the role's own section of its typed spec)."""
    if isinstance(settings, TrainerConfig):
        return 1 if settings.gpus_per_node > 0 else 0
    if isinstance(settings, GeneratorConfig | TeacherConfig):
        return settings.gpus_per_instance
    return 0


def apply(p: Placement, environ: dict) -> None:
    """Export the placement the way torch, DeepSpeed and vLLM read it."""
    environ["LOCAL_RANK"] = str(p.cuda_index if p.devices else p.local_rank)
    if p.visible is not None:
        environ["CUDA_VISIBLE_DEVICES"] = p.visible
