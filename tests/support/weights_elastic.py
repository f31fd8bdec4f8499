"""A run of engine-less weight peers (tests/support/weight_peer.py) around a real publisher."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from streamrl_cli.rendezvous import RendezvousClient, create_secret
from streamrl_cli.trainer.role.publish import WeightPublisher
from streamrl_cli.weights.layout import eligible
from support.generator_harness import wait_until
from support.helpers import REPO

LEASE_S = 2.0  # members heartbeat every third of it: long enough for a machine busy with other tests

PEER = REPO / "tests" / "support" / "weight_peer.py"
TRANSFER_TIMEOUT_S = 3.0


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g).bfloat16()}


def digest(tensors: dict[str, torch.Tensor]) -> str:
    return f"{sum(float(t.double().sum()) for t in tensors.values()):.6f}"


class Run:
    """Rendezvous server, a trainer with its WeightPublisher, engine-less generator processes."""

    def __init__(self, root: Path):
        self.start_rendezvous(root)
        self.rdv.register("trainer", 0)
        self.rdv.start_heartbeat()
        self.publisher = WeightPublisher(
            self.rdv, self.token, transport="broadcast", generator_workers=3, backend="gloo",
            host="127.0.0.1", transfer_timeout_s=TRANSFER_TIMEOUT_S, sync_timeout_s=30.0,
        )  # fmt: skip
        self.root, self.peers = root, {}

    def start_rendezvous(self, root: Path) -> None:
        self.run_dir = root / "run"
        self.token = create_secret(self.run_dir)
        self.server = subprocess.Popen(
            [sys.executable, "-m", "streamrl_cli.rendezvous", "--run-dir", str(self.run_dir),
             "--lease-s", str(LEASE_S)],
            stderr=(root / "rendezvous.log").open("w"), cwd=REPO,
        )  # fmt: skip
        wait_until(lambda: (self.run_dir / "rendezvous.json").exists(), 30, "the rendezvous server")
        self.rdv = RendezvousClient.from_run_dir(self.run_dir)

    def start(self, rank: int, *extra: str) -> None:
        log = (self.root / f"peer-{rank}.log").open("w")
        self.peers[rank] = subprocess.Popen(
            [sys.executable, "-u", str(PEER), str(self.run_dir), str(rank),
             *extra],
            stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
        )  # fmt: skip

    def eligible(self) -> list[str]:
        return [m["member_id"] for m in eligible(self.rdv.members("generator"))]

    def lines(self, rank: int) -> list[str]:
        return (self.root / f"peer-{rank}.log").read_text().splitlines()

    def got(self, rank: int) -> list[str]:
        return [line for line in self.lines(rank) if line.startswith("GOT ")]

    def publish(self, version: int) -> dict:
        return self.publisher.publish(state(version), version).result(timeout=60)

    def close(self) -> None:
        self.rdv.leave("done")
        for p in self.peers.values():
            if p.poll() is None:
                p.kill()
            p.wait()
        self.publisher.close()
        self.rdv.close()
        self.server.terminate()
        self.server.wait(timeout=10)
