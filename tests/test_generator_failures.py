"""A generator that cannot do its job fails loudly, with its reason at the rendezvous, never hangs.

The real role (a fake engine stands in for vLLM: the failure is elsewhere), a real rendezvous
server, and a trainer whose sample stream nobody answers. The liveness bound is `wait_for`'s.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time

import pytest
from conftest import REPO
from test_generator_admission import FakeEngine

from streamrl_cli.errors import StreamRLError
from streamrl_cli.generator import main as generator_main
from streamrl_cli.generator.main import GeneratorRole
from streamrl_cli.recipe.schema import GeneratorConfig, ModelConfig, TaskConfig, TrainConfig
from streamrl_cli.rendezvous import RendezvousClient, create_secret
from streamrl_cli.roles.spec import GeneratorSpec


class StartingEngine(FakeEngine):
    weights_intact = True

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed on return: nothing listens there


@pytest.fixture
def rendezvous(tmp_path):
    run_dir = tmp_path / "run"
    create_secret(run_dir)
    server = subprocess.Popen(
        [sys.executable, "-m", "streamrl_cli.rendezvous", "--run-dir", str(run_dir), "--lease-s", "5"],
        cwd=REPO,
    )
    try:
        deadline = time.monotonic() + 30
        while not (run_dir / "rendezvous.json").exists():
            assert time.monotonic() < deadline and server.poll() is None, "rendezvous server did not start"
            time.sleep(0.1)
        yield run_dir
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_a_generator_that_cannot_reach_the_sample_stream_fails_with_its_reason(rendezvous, monkeypatch):
    run_dir = rendezvous
    (run_dir / "model").mkdir()
    trainer = RendezvousClient.from_run_dir(run_dir)
    trainer.register("trainer", 0, cluster="local", site="local",
                     addresses={"samples": f"tcp://127.0.0.1:{closed_port()}"})  # fmt: skip
    trainer.start_heartbeat()
    spec = GeneratorSpec(
        run_name="t", run_dir=str(run_dir), role="generator", cluster="local", site="local", world=1,
        expected={"trainer": 1, "generator": 1}, program="streamrl_cli.generator.main:main",
        weight_transport="broadcast", rendezvous_file=str(run_dir / "rendezvous.json"),
        secret_file=str(run_dir / "secret"), settings=GeneratorConfig(cluster="local", gpus_per_instance=0),
        model=ModelConfig(name="m", path=str(run_dir / "model")), train=TrainConfig(seed=0),
        task=TaskConfig(name="builtin", max_prompt_len=64, max_output_len=128),
    )  # fmt: skip
    monkeypatch.setattr(generator_main, "WAIT_S", 3.0)  # the bound on reaching the trainer
    role = GeneratorRole(spec, 0, engine=StartingEngine())
    try:
        with pytest.raises(StreamRLError, match="no answer from the trainer"):
            asyncio.run(asyncio.wait_for(role.run(), 120))  # liveness bound: never a hang
        (member,) = trainer.members("generator")
        assert member["state"] == "left"
        assert (
            member["last_error"].startswith("failed: ")
            and "no answer from the trainer" in member["last_error"]
        )
    finally:
        trainer.close()
