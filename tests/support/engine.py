"""Reference computations on the tiny model (transformers) and a trainer stand-in, for the real vLLM
engine tests."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import torch

from streamrl_cli.generator.engine import (
    WeightSource,
)


def load_hf(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding without stopping at EOS (what vLLM does with ignore_eos)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int, scale: float = 0.3) -> dict[str, torch.Tensor]:
    """New weights, different enough that greedy outputs change (the builder's init is near-uniform).
    Tied parameters appear once (named_parameters dedups them), like a trainer's update would."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g)
        p.copy_(noise * scale if p.ndim == 2 else 1.0 + 0.1 * noise if "norm" in name else 0.1 * noise)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


LONG_PROMPT = [(i * 7) % 500 + 1 for i in range(200)]  # > one 128-token KV block on CPU


class Trainer:
    """The trainer's end of the weight group (rank 0, the data plane's broadcast) in a thread."""

    def __init__(self, world_size: int):
        from streamrl_cli.weights.broadcast import host_weight_store

        # hosted on port 0 now, listening: the engines are told this port before the group forms
        self.store = host_weight_store("127.0.0.1", world_size, timeout_s=120)
        self.port = self.store.port
        self.world_size = world_size
        self.group = None
        self._pool = concurrent.futures.ThreadPoolExecutor(1)

    def source(self, first_rank: int) -> WeightSource:
        return WeightSource(
            host="127.0.0.1", port=self.port, world_size=self.world_size, first_rank=first_rank
        )

    def send(self, state: dict, version: int) -> concurrent.futures.Future:
        return self._pool.submit(self._send, state, version)

    def _send(self, state: dict, version: int) -> dict:
        from streamrl_cli.weights.broadcast import BroadcastSender, init_weight_group

        if self.group is None:  # formed once, kept for every later version
            self.group = init_weight_group(
                f"127.0.0.1:{self.port}", 0, self.world_size, timeout_s=120, store=self.store
            )
        return BroadcastSender(self.group, bucket_bytes=64 << 10).send(state, version)

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
        self._pool.shutdown()
