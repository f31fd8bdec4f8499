"""Weights and settings shared by the cross-site relay tests."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import torch

TOKEN = "relay-test-token-0123456789"


CHUNK = 64 << 10


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(300, 128, generator=g),  # 150 KiB: spans chunks
        "layer.0.w": torch.randn(256, 256, generator=g).to(torch.bfloat16),
        "layer.0.b": torch.randn(7, generator=g),  # odd size: the next offset is realigned
        "steps": torch.tensor(41, dtype=torch.int64),
        "mask": torch.rand(33, generator=g) > 0.5,
        "empty": torch.empty(0, 3),
        "head": torch.randn(64, 300, generator=g).t(),  # non-contiguous at the source
    }


@contextlib.contextmanager
def relay_server(version: int = 1) -> Iterator:
    """A relay WeightServer on loopback serving ``weights()`` as ``version``."""
    from streamrl_cli.weights.relay import WeightServer

    srv = WeightServer(TOKEN, host="127.0.0.1", chunk_bytes=CHUNK, checksum="crc32", timeout_s=2)
    srv.publish(version, weights())
    try:
        yield srv
    finally:
        srv.close()


def connect(address: str, timeout: float = 5.0) -> socket.socket:
    """A plain TCP connection to a relay's ``host:port``, with a timeout on every call."""
    s = socket.create_connection(("127.0.0.1", int(address.rsplit(":", 1)[1])), timeout=timeout)
    s.settimeout(timeout)
    return s
