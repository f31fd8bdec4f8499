"""The real generator role driven by a test harness (rendezvous, weights, sample stream)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from streamrl_cli.models.tiny import build_tiny_model
from streamrl_cli.recipe.schema import GeneratorConfig, ModelConfig, TaskConfig, TrainConfig
from streamrl_cli.rendezvous import RendezvousClient, create_secret
from streamrl_cli.roles.spec import GeneratorSpec, spec_yaml
from streamrl_cli.transport.routing import DispatchService
from streamrl_cli.transport.samples import StreamConfig
from streamrl_cli.transport.wire import Request
from support.configs import sampling as make_sampling
from support.engine import Trainer, load_hf
from support.helpers import REPO

LEASE_S = 2.0

START_S = 240.0  # guard against a hang (two vLLM starts share 2 cores), not a timing assertion


def wait_until(predicate, timeout: float, what: str, poll: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(poll)


class Harness:
    """Rendezvous server + trainer rank 0 (sample receiver, dispatcher, weight group) + generators.

    `transport`: "broadcast" (one fixed group, sent by hand), "relay" (the far-site path), or
    "elastic" (the trainer's own WeightPublisher: groups re-formed as generators come and go).
    """

    def __init__(self, root: Path, instances: int = 2, transport: str = "broadcast"):
        self.run_dir = root / "run"
        self.token = create_secret(self.run_dir)
        self.logs = self.run_dir / "logs"
        self.logs.mkdir(parents=True)
        self.server = subprocess.Popen(
            [sys.executable, "-m", "streamrl_cli.rendezvous", "--run-dir", str(self.run_dir),
             "--lease-s", str(LEASE_S)],
            stderr=(self.logs / "rendezvous.log").open("w"), cwd=REPO,
        )  # fmt: skip
        wait_until(lambda: (self.run_dir / "rendezvous.json").exists(), 30, "the rendezvous server")
        self.model = build_tiny_model(root / "tiny")  # untied (tied is covered by the engine tests)
        self.hf = load_hf(self.model)
        self.svc = DispatchService(StreamConfig(bind="tcp://127.0.0.1:0", max_delay_s=0.001), self.token)
        addresses, info = {"samples": self.svc.address}, {}
        self.weights = self.relay = self.publisher = None
        self.rdv = RendezvousClient.from_run_dir(self.run_dir)
        if transport == "elastic":
            from streamrl_cli.trainer.role.publish import WeightPublisher

            self.publisher = WeightPublisher(
                self.rdv, self.token, transport="broadcast", generator_workers=instances, backend="gloo",
                host="127.0.0.1", transfer_timeout_s=15.0, sync_timeout_s=180.0,
            )  # fmt: skip
        elif transport == "broadcast":  # the trainer hosts its site's weight group
            self.weights = Trainer(world_size=1 + instances)
            addresses["weights"] = f"127.0.0.1:{self.weights.port}"
            info["weight_group"] = {"world_size": 1 + instances, "backend": "gloo"}
        else:  # the generators are at another site: one copy goes to their relay
            from streamrl_cli.weights.relay import WeightServer

            self.relay = WeightServer(self.token, host="127.0.0.1", chunk_bytes=64 << 10)
            addresses["relay"] = self.relay.address
        self.rdv.register("trainer", 0, cluster="local", site="local", addresses=addresses, info=info)
        self.rdv.start_heartbeat()
        self.svc.watch(self.rdv)
        self.spec_path = self.write_spec(instances, "relay" if transport == "relay" else "broadcast")
        self.generators = [self.start_generator(r) for r in range(instances)]
        self.serial = 0

    def start_generator(self, rank: int) -> subprocess.Popen:
        """One generator process, started as `streamrl run` starts an array task."""
        return subprocess.Popen(
            [sys.executable, "-u", "-m", "streamrl_cli.roles", str(self.spec_path), "--rank", str(rank)],
            stdout=(self.logs / f"generator-{rank}.log").open("w"),
            stderr=subprocess.STDOUT,
            cwd=REPO,
            start_new_session=True,  # its own group: a kill takes vLLM's processes along
        )  # fmt: skip

    def write_spec(self, instances: int, transport: str) -> Path:
        spec = GeneratorSpec(
            run_name="gen-test", run_dir=str(self.run_dir), role="generator", cluster="local", site="local",
            world=instances, expected={"trainer": 1, "generator": instances},
            program="streamrl_cli.generator.main:main", weight_transport=transport,
            rendezvous_file=str(self.run_dir / "rendezvous.json"), secret_file=str(self.run_dir / "secret"),
            settings=GeneratorConfig(cluster="local", engine="vllm", tensor_parallel=1, gpus_per_instance=0),
            model=ModelConfig(name="tiny-test", path=str(self.model), dtype="float32"),
            task=TaskConfig(name="builtin", max_prompt_len=256, max_output_len=256),
            train=TrainConfig(seed=0),
        )  # fmt: skip
        path = self.run_dir / "roles" / "generator.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(spec_yaml(spec))
        return path

    def generating(self) -> list[str]:
        return [m["member_id"] for m in self.rdv.members("generator")
                if m["state"] == "alive" and m["reported_state"] == "generating"]  # fmt: skip

    def submit(self, prompts: list[list[int]], n: int = 1, **sampling) -> list[str]:
        ids = []
        for p in prompts:
            self.serial += 1
            ids.append(f"p{self.serial}")
            self.svc.submit([Request(prompt_id=ids[-1], prompt_token_ids=p, sample_indices=list(range(n)),
                                     group_id=ids[-1], sampling=make_sampling(**sampling))])  # fmt: skip
        return ids

    def receive(self, count: int, timeout: float = 180.0, on_sample=None) -> list:
        out = []
        deadline = time.monotonic() + timeout
        while len(out) < count:
            assert time.monotonic() < deadline, f"received {len(out)} of {count} samples\n{self.log_tails()}"
            s = self.svc.get(timeout=0.5)
            if s is not None:
                out.append(s)
                if on_sample:
                    on_sample(s)
        return out

    def log_tails(self) -> str:
        return "\n".join(f"--- {p.name}\n" + "\n".join(p.read_text().splitlines()[-15:])
                         for p in sorted(self.logs.glob("generator-*.log")))  # fmt: skip

    def close(self) -> None:
        for g in self.generators:
            if g.poll() is None:
                os.killpg(g.pid, signal.SIGKILL)
            g.wait()
        self.svc.close()
        for weights in (self.weights, self.relay, self.publisher):
            if weights is not None:
                weights.close()
        self.rdv.close()
        self.server.terminate()
        self.server.wait(timeout=10)


def serving(h: Harness):
    """Wait until every generator serves, hand the harness over, stop everything after."""
    try:
        wait_until(lambda: len(h.generating()) == 2 or any(g.poll() is not None for g in h.generators),
                   START_S, "two generators serving")  # fmt: skip
        assert len(h.generating()) == 2, h.log_tails()
        yield h
    finally:
        h.close()
