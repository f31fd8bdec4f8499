"""Weight broadcast helpers: spawn context, digests of state dicts, forming a group on a port nobody picked
for it (rank 0 hosts the store on port 0 and hands the port on), a port held closed."""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing as mp
import socket
from collections.abc import Iterator
from typing import Any

import torch

SPAWN = mp.get_context("spawn")


def digests(sd: dict[str, torch.Tensor]) -> dict[str, tuple[str, tuple, str]]:
    out = {}
    for k, v in sd.items():
        raw = v.contiguous().view(-1).view(torch.uint8) if v.dim() else v.reshape(1).view(torch.uint8)
        out[k] = (str(v.dtype), tuple(v.shape), hashlib.sha256(raw.numpy().tobytes()).hexdigest())
    return out


def group_port(rank: int, world: int, ports: Any, timeout_s: float = 60.0) -> tuple[int, Any]:
    """The weight group's port for `rank`, and rank 0's store. Rank 0 hosts the store on port 0 (the
    kernel picks a port and it stays bound) and puts the port in `ports` (a queue) for each other
    rank; they take it from there. No port is picked, closed, and hoped to be free still."""
    from streamrl_cli.weights.broadcast import host_weight_store

    if rank == 0:
        store = host_weight_store("127.0.0.1", world, timeout_s=timeout_s)
        for _ in range(world - 1):
            ports.put(store.port)
        return store.port, store
    return ports.get(timeout=timeout_s), None


def form_group(rank: int, world: int, ports: Any, timeout_s: float = 60.0) -> Any:
    """Join (or, rank 0, host) a weight group whose port rank 0 hands out through `ports`."""
    from streamrl_cli.weights.broadcast import init_weight_group

    port, store = group_port(rank, world, ports, timeout_s)
    return init_weight_group(f"127.0.0.1:{port}", rank, world, timeout_s=timeout_s, store=store)


@contextlib.contextmanager
def closed_port() -> Iterator[int]:
    """A port where nothing listens, held for the block: bound, never listening, so connections to
    it are refused and no other process can take it meanwhile."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]
