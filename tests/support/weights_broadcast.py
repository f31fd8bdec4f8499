"""Weight broadcast helpers: spawn context, digests of state dicts."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import socket

import torch

SPAWN = mp.get_context("spawn")


def digests(sd: dict[str, torch.Tensor]) -> dict[str, tuple[str, tuple, str]]:
    out = {}
    for k, v in sd.items():
        raw = v.contiguous().view(-1).view(torch.uint8) if v.dim() else v.reshape(1).view(torch.uint8)
        out[k] = (str(v.dtype), tuple(v.shape), hashlib.sha256(raw.numpy().tobytes()).hexdigest())
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
