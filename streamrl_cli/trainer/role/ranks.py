"""Data-parallel trainer ranks in lockstep: rank 0 decides, every rank computes.

Only rank 0 receives the sample stream. Each *round* it hands one micro-batch to every rank
(an empty one where there is nothing left: ZeRO's collectives need every rank in every
backward), then steps, gathers weights, checkpoints — by broadcasting a small command on the
trainer's default group that the other ranks follow in :func:`follow`. With one rank this is a
direct call and nothing is broadcast.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from streamrl_cli.trainer.loop.batch import Rollout, collate
from streamrl_cli.trainer.role.checkpoint import load_engines, save_engines
from streamrl_cli.trainer.role.learner import Learner


def _bcast(obj: Any = None) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class RankDriver:
    """Rank 0's handle on all ranks' learners."""

    def __init__(self, learner: Learner, world: int):
        self.learner, self.world = learner, world

    def _cmd(self, *cmd: Any) -> None:
        if self.world > 1:
            _bcast(cmd)

    def round(self, micro_batches: Sequence[Sequence[Rollout]], *, last: bool) -> None:
        """One micro-batch per data-parallel rank (len(micro_batches) <= world / (sequence_parallel ×
        tensor_parallel); missing ones are empty). The ranks of a sequence- or tensor-parallel group
        share theirs."""
        width = self.world // self.learner.shared_by
        shares = [list(m) for m in micro_batches] + [[] for _ in range(width - len(micro_batches))]
        self._cmd("round", shares, last)
        self.learner.micro_step(collate(shares[0], self.learner.device), last=last)

    def step(self) -> dict[str, float]:
        self._cmd("step")
        return self.learner.step()

    def full_state(self) -> dict[str, torch.Tensor]:
        self._cmd("state")
        return self.learner.full_state()

    def gradients(self) -> dict[str, torch.Tensor]:
        """Finish the accumulation and return the full gradient instead of stepping (verification)."""
        self._cmd("grads")
        self.learner.finish_gradients()
        return self.learner.full_gradients()

    def save(self, path: Path, client_state: dict[str, Any]) -> None:
        self._cmd("save", str(path))
        save_engines(self.learner, path, client_state)

    def load(self, path: Path) -> dict[str, Any]:
        self._cmd("load", str(path))
        return load_engines(self.learner, path)

    def stop(self) -> None:
        self._cmd("stop")


def follow(learner: Learner, rank: int) -> int:
    """Ranks > 0: do what rank 0 says until it says stop."""
    while True:
        cmd = _bcast()
        kind = cmd[0]
        if kind == "round":
            share = cmd[1][rank // learner.shared_by]  # an SP or TP group's ranks share one
            learner.micro_step(collate(share, learner.device), last=cmd[2])
        elif kind == "step":
            learner.step()
        elif kind == "state":
            learner.full_state()
        elif kind == "grads":
            learner.finish_gradients()
            learner.full_gradients()
        elif kind == "save":
            save_engines(learner, Path(cmd[1]), {})
        elif kind == "load":
            load_engines(learner, Path(cmd[1]))
        elif kind == "stop":
            return 0
        else:
            raise AssertionError(f"unknown trainer command {kind!r}")
