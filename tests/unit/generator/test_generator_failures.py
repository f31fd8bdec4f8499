"""A generator that cannot do its job fails loudly, with its reason at the rendezvous, never hangs.

The real role (a fake engine stands in for vLLM: the failure is elsewhere), a real rendezvous
server, and a trainer whose sample stream nobody answers. The liveness bound is `wait_for`'s.
A weight version whose group cannot be joined or that cannot be loaded is skipped, its reason
reported, and the next one served (the real weight swap and worker extension, real gloo).
"""

from __future__ import annotations

import asyncio
import gc
import importlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch
from support.admission import FakeEngine
from support.helpers import REPO

from streamrl_cli.errors import StreamRLError
from streamrl_cli.generator import main as generator_main
from streamrl_cli.generator.engine import EngineError, EngineHealth
from streamrl_cli.generator.main import GeneratorRole
from streamrl_cli.generator.vllm_engine import VLLMEngine
from streamrl_cli.generator.worker_ext import WeightSyncExtension
from streamrl_cli.recipe.schema import GeneratorConfig, ModelConfig, TaskConfig, TrainConfig
from streamrl_cli.rendezvous import RendezvousClient, create_secret, read_secret
from streamrl_cli.roles.spec import GeneratorSpec
from streamrl_cli.trainer.role.publish import WeightPublisher
from streamrl_cli.transport.routing import DispatchService
from streamrl_cli.transport.samples import StreamConfig
from streamrl_cli.weights import WeightTransferError
from streamrl_cli.weights.broadcast import host_weight_store
from streamrl_cli.weights.layout import WAITING


class StartingEngine(FakeEngine):
    weights_intact = True

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass


def generator_spec(run_dir: Path) -> GeneratorSpec:
    (run_dir / "model").mkdir(exist_ok=True)
    return GeneratorSpec(
        run_name="t", run_dir=str(run_dir), role="generator", cluster="local", site="local", world=1,
        expected={"trainer": 1, "generator": 1}, program="streamrl_cli.generator.main:main",
        weight_transport="broadcast", rendezvous_file=str(run_dir / "rendezvous.json"),
        secret_file=str(run_dir / "secret"), settings=GeneratorConfig(cluster="local", gpus_per_instance=0),
        model=ModelConfig(name="m", path=str(run_dir / "model")), train=TrainConfig(seed=0),
        task=TaskConfig(name="builtin", max_prompt_len=64, max_output_len=128),
    )  # fmt: skip


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


def test_a_generator_that_cannot_reach_the_sample_stream_fails_with_its_reason(
    rendezvous, monkeypatch, refused_port
):
    run_dir = rendezvous
    trainer = RendezvousClient.from_run_dir(run_dir)
    trainer.register("trainer", 0, cluster="local", site="local",
                     addresses={"samples": f"tcp://127.0.0.1:{refused_port}"})  # fmt: skip
    trainer.start_heartbeat()
    spec = generator_spec(run_dir)
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


class BlockingStartEngine(StartingEngine):
    """An engine whose start blocks the loop for a minute, as vLLM's (AsyncLLM.from_engine_args)
    does for as long as its processes take to start; says when it began and whether it finished."""

    def __init__(self) -> None:
        super().__init__()
        self.began, self.finished = threading.Event(), False

    async def start(self) -> None:
        self.began.set()
        time.sleep(60)
        self.finished = True


def test_sigterm_while_the_engine_starts_abandons_the_start_and_leaves_as_stopped(rendezvous):
    # A run that ends (or a scale-in) stops a generator still starting its engine: it must not
    # finish a start nobody will use first (minutes on a busy host: the launcher's grace is 10 s).
    trainer = RendezvousClient.from_run_dir(rendezvous)
    engine = BlockingStartEngine()
    role = GeneratorRole(generator_spec(rendezvous), 0, engine=engine)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

    def stop_once_starting() -> None:
        if engine.began.wait(60):
            os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_once_starting, daemon=True).start()
    try:
        assert generator_main.run_role(role) == 0  # a clean exit, as when stopped while serving
        assert engine.began.is_set() and not engine.finished
        (member,) = trainer.members("generator")
        assert member["state"] == "left" and member["last_error"] is None, member  # stopped, not failed
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        trainer.close()


# ---- weight versions: a group that cannot be joined, a version that cannot be loaded ----
#
# The real VLLMEngine (its weight swap: pause, `weights_intact`, resume) and the real worker
# extension (its group join, the bucketed receive, the partial-load mark) over a fake
# AsyncLLM with one fake worker; the trainer side is the trainer's own WeightPublisher on real gloo.


class FakeWorker(WeightSyncExtension):
    """A vLLM worker as the extension sees it: rank 0 of its instance, a two-tensor model, and a
    checkpoint reload that refuses a tensor of the wrong shape, as vLLM's weight loaders do."""

    rank = 0

    def __init__(self) -> None:
        self.model = torch.nn.ParameterDict({"a": torch.zeros(4), "b": torch.zeros(2, 3)})
        self.model_runner = SimpleNamespace(get_model=lambda: self.model)
        # A test's step between the generator's own check that the store listens and the next join
        # (what happens meanwhile in a run); it returns the source the join gets.
        self.before_join: Callable[[dict], dict] | None = None

    def streamrl_join_weight_group(self, source: dict) -> int:
        step, self.before_join = self.before_join, None
        return super().streamrl_join_weight_group(step(source) if step else source)

    def reload_weights(self, weights_iterator, is_checkpoint_format: bool) -> None:
        for name, tensor in weights_iterator:  # in name order: "a" is loaded before "b" is refused
            param = self.model[name]
            if param.shape != tensor.shape:  # in the words of vLLM's default_weight_loader
                raise AssertionError(
                    f"Attempted to load weight ({tensor.size()}) into parameter ({param.size()})"
                )
            with torch.no_grad():
                param.copy_(tensor)


class FakeLLM:
    """vLLM's AsyncLLM as VLLMEngine drives it: collective RPCs on the one worker, in a thread."""

    errored = False  # the engine core died (never, here)

    def __init__(self, worker: FakeWorker) -> None:
        self.worker, self.paused = worker, False

    async def check_health(self) -> None:
        pass

    async def is_paused(self) -> bool:
        return self.paused

    def get_num_unfinished_requests(self) -> int:
        return 0

    async def collective_rpc(self, method: str, args: tuple = ()) -> list:
        return [await asyncio.to_thread(getattr(self.worker, method), *args)]

    async def pause_generation(self, mode: str = "keep", clear_cache: bool = True) -> None:
        self.paused = True

    async def resume_generation(self) -> None:
        self.paused = False

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return True

    def shutdown(self) -> None:
        self.worker.streamrl_leave_weight_group()


class ExtensionEngine(VLLMEngine):
    """VLLMEngine with the fake AsyncLLM: no model, no process; nothing is dispatched to it here."""

    def __init__(self) -> None:
        super().__init__("unused")
        self.worker = FakeWorker()

    async def start(self) -> None:
        # A vLLM worker has vLLM loaded; here the extension's first join would pay its import (seconds
        # on a busy host) inside the trainer's transfer timeout.
        await asyncio.to_thread(importlib.import_module, "vllm.distributed.utils")
        self._llm = FakeLLM(self.worker)


def weights(version: int, b_shape: tuple[int, ...] = (2, 3)) -> dict[str, torch.Tensor]:
    return {"a": torch.full((4,), float(version)), "b": torch.full(b_shape, float(version))}


class Trainer:
    """Trainer rank 0 as generators see it: registered, its sample stream, its weight publisher."""

    def __init__(self, run_dir: Path, sync_timeout_s: float):
        token = read_secret(run_dir)
        self.svc = DispatchService(StreamConfig(bind="tcp://127.0.0.1:0", max_delay_s=0.001), token)
        self.rdv = RendezvousClient.from_run_dir(run_dir)
        self.publisher = WeightPublisher(
            self.rdv, token, transport="broadcast", generator_workers=1, backend="gloo", host="127.0.0.1",
            transfer_timeout_s=10.0, sync_timeout_s=sync_timeout_s, retries=0,
        )  # fmt: skip
        self.rdv.register("trainer", 0, cluster="local", site="local",
                          addresses={"samples": self.svc.address}, info=self.publisher.info())  # fmt: skip
        self.rdv.start_heartbeat()
        self.svc.watch(self.rdv)

    def generator(self) -> dict:
        """generator-0's member record ({} before it registered)."""
        members = self.rdv.members("generator")
        return members[0] if members else {}

    def close(self) -> None:
        self.publisher.close()
        self.svc.close()
        self.rdv.close()


async def until(role_task: asyncio.Task, check, what: str, timeout: float = 60.0):
    """Poll `check` (a rendezvous read, in a thread) until true; the role must not end meanwhile."""
    deadline = time.monotonic() + timeout
    while True:
        value = await asyncio.to_thread(check)
        if value:
            return value
        if role_task.done():
            role_task.result()  # raises why it ended
            raise AssertionError(f"the generator ended while waiting for {what}")
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        await asyncio.sleep(0.2)


async def the_next_version_is_served(trainer: Trainer, role_task: asyncio.Task, engine: ExtensionEngine):
    """The member stayed alive and takes the next version: loaded, confirmed, its error cleared."""
    published = trainer.publisher.publish(weights(2), 2)
    stats = await asyncio.to_thread(published.result, 60)
    assert stats["members"] == 1 and trainer.rdv.versions()["current"] == 2
    await until(role_task, lambda: trainer.generator()["last_error"] is None, "the error to clear")
    member = trainer.generator()
    assert (member["state"], member["reported_state"], member["weight_version"]) == ("alive", "generating", 2)
    assert engine.weights_intact and not engine._llm.paused
    assert all(bool((p == 2.0).all()) for p in engine.worker.model.values())


@pytest.mark.parametrize("store", ["refuses", "source never forms the group", "dropped before the join"])
def test_a_generator_that_cannot_join_a_versions_group_reports_why_and_takes_the_next(
    rendezvous, store, refused_port
):
    run_dir = rendezvous
    trainer = Trainer(run_dir, sync_timeout_s=30.0)
    engine = ExtensionEngine()
    role = GeneratorRole(generator_spec(run_dir), 0, engine=engine)
    hosted = None  # a store that listens, for a rank 0 that never joins

    async def scenario() -> None:
        nonlocal hosted
        task = asyncio.create_task(role.run())
        await until(
            task, lambda: trainer.generator().get("reported_state") == "generating", "the generator serving"
        )
        if store == "refuses":
            address, timeout_s = f"127.0.0.1:{refused_port}", 30.0
            why = f"the weight group's store at {address} is gone: "
        elif store == "source never forms the group":  # the store listens, its rank 0 never joins:
            hosted = host_weight_store("127.0.0.1", 2, timeout_s=30.0)  # the group timeout bounds the wait
            address, timeout_s = f"127.0.0.1:{hosted.port}", 3.0
            why = f"cannot join the weight group at {address} as rank 1/2 (gloo) within 3s: "
        else:  # the source drops its group after the generator saw its store listen, before the workers
            # connect (a failed try; a relay that died): their connect's own bound ends the join, not the
            # group timeout (here an hour: the liveness bound below catches a join that waits for it)
            hosted = host_weight_store("127.0.0.1", 2, timeout_s=30.0)
            address, timeout_s = f"127.0.0.1:{hosted.port}", 3600.0

            def drop(source: dict) -> dict:
                nonlocal hosted
                hosted = None
                gc.collect()  # its last reference: the store stops listening
                return {**source, "connect_timeout_s": 1.0}

            engine.worker.before_join = drop
            why = (
                f"cannot join the weight group at {address} as rank 1/2 (gloo): its store accepted no "
                "connection (connect timeout 1s"
            )
        member = trainer.generator()
        trainer.rdv.propose_version(
            1, ["generator"], members={member["member_id"]: member["incarnation"]},
            transfer={"group": "deadbeef", "address": address, "world_size": 2, "backend": "gloo",
                      "timeout_s": timeout_s, "ranks": {member["member_id"]: 1}},
        )  # fmt: skip
        error = await until(task, lambda: trainer.generator()["last_error"], "the generator's error")
        assert error.startswith(f"weight version 1 not received: {why}"), error
        member = trainer.generator()
        assert (member["state"], member["reported_state"], member["weight_version"]) == (
            "alive",
            "generating",
            0,
        )
        await the_next_version_is_served(trainer, task, engine)
        role._stop.set()
        assert await task == 0

    try:
        asyncio.run(asyncio.wait_for(scenario(), 150))  # liveness bound: never a hang
    finally:
        trainer.close()


def test_a_generator_that_cannot_load_a_version_reports_why_and_takes_the_next(rendezvous):
    run_dir = rendezvous
    trainer = Trainer(run_dir, sync_timeout_s=8.0)  # how long it waits for the confirmation that never comes
    engine = ExtensionEngine()
    role = GeneratorRole(generator_spec(run_dir), 0, engine=engine)

    async def scenario() -> None:
        task = asyncio.create_task(role.run())
        await until(
            task, lambda: trainer.generator().get("reported_state") == "generating", "the generator serving"
        )
        bad = trainer.publisher.publish(weights(1, b_shape=(3, 2)), 1)  # "b" transposed: the load refuses it
        error = await until(task, lambda: trainer.generator()["last_error"], "the generator's error")
        assert error.startswith(
            "weight version 1 not received: loading weight version 1 into the model failed at 'b' "
            "(AssertionError: Attempted to load weight (torch.Size([3, 2])) into parameter "
            "(torch.Size([2, 3]))); check that the trainer sends this model's weights"
        ), error
        # Half loaded ("a" is in): the engine stays paused, the member takes no work until a full version.
        member = trainer.generator()
        assert (member["state"], member["reported_state"], member["weight_version"]) == ("alive", WAITING, 0)
        assert not engine.weights_intact and (await engine.health()).paused
        with pytest.raises(WeightTransferError, match="waiting for weight version 1 to be confirmed"):
            await asyncio.to_thread(bad.result, 60)
        await the_next_version_is_served(trainer, task, engine)
        role._stop.set()
        assert await task == 0

    try:
        asyncio.run(asyncio.wait_for(scenario(), 150))  # liveness bound: never a hang
    finally:
        trainer.close()


# ---- the engine dies ----


class DyingEngine(StartingEngine):
    """Serves until `die()`; then its health says so, as VLLMEngine's does once its engine core died."""

    dead = False

    async def health(self) -> EngineHealth:
        detail = "EngineDeadError: EngineCore encountered an issue" if self.dead else ""
        return EngineHealth(ok=not self.dead, weight_version=0, running=0, paused=False, detail=detail)


def test_a_generator_whose_engine_died_fails_with_its_reason(rendezvous, monkeypatch):
    # Waiting for weights, nothing else would notice: every version would fail to load, quietly.
    monkeypatch.setattr(generator_main, "HEALTH_S", 0.2)
    trainer = Trainer(rendezvous, sync_timeout_s=30.0)
    engine = DyingEngine()
    role = GeneratorRole(generator_spec(rendezvous), 0, engine=engine)

    async def scenario() -> None:
        task = asyncio.create_task(role.run())
        await until(
            task, lambda: trainer.generator().get("reported_state") == "generating", "the generator serving"
        )
        engine.dead = True
        with pytest.raises(EngineError, match="the generation engine died: EngineDeadError"):
            await asyncio.wait_for(task, 30)

    try:
        asyncio.run(asyncio.wait_for(scenario(), 120))  # liveness bound: never a hang
        member = trainer.generator()
        assert member["state"] == "left"
        assert member["last_error"].startswith("failed: EngineError: the generation engine died"), member
    finally:
        trainer.close()


class StuckLLM(FakeLLM):
    """vLLM's AsyncLLM after its engine core died: the calls in flight never return."""

    async def collective_rpc(self, method: str, args: tuple = ()) -> list:
        await asyncio.Event().wait()
        return []


def test_an_engine_call_in_flight_fails_once_the_engine_core_died():
    engine = ExtensionEngine()
    llm = engine._llm = StuckLLM(engine.worker)

    async def scenario() -> None:
        call = asyncio.create_task(engine.collective_rpc("streamrl_weights_intact"))
        await asyncio.sleep(1.5)
        assert not call.done()  # a slow call is waited for while the engine lives
        llm.errored = True
        with pytest.raises(EngineError, match="engine core died while streamrl_weights_intact"):
            await asyncio.wait_for(call, 10)

    asyncio.run(scenario())


@pytest.mark.slow
def test_vllms_processes_outlive_the_usr2_meant_for_the_generator(tmp_path):
    # SLURM's time-limit warning goes to every process of the job step: vLLM's engine core and worker
    # must not die of it (its default action), the generator hands its work back and requeues itself.
    from streamrl_cli.generator.engine import GenerationRequest, SamplingSpec
    from streamrl_cli.models.tiny import TinySpec, build_tiny_model

    model = build_tiny_model(tmp_path / "tiny", TinySpec())
    engine = VLLMEngine(str(model), max_model_len=256, max_num_seqs=4)
    got: list[int] = []

    async def scenario() -> list:
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR2, got.append, 1)
        # Only the processes vLLM starts: a process an earlier test in this worker left behind (or
        # Python's resource tracker) was not started under the engine's signal mask.
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        await engine.start()
        try:
            children = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
            assert children, "vLLM started no process"
            for p in [psutil.Process(), *children]:
                os.kill(p.pid, signal.SIGUSR2)
            await asyncio.sleep(3)
            dead = [p for p in children if not p.is_running() or p.status() == psutil.STATUS_ZOMBIE]
            assert not dead, f"vLLM processes died of SIGUSR2: {dead}"
            assert (await engine.health()).ok
            req = GenerationRequest(
                request_id="after-usr2", prompt_token_ids=[1, 2, 3], sampling=SamplingSpec(max_tokens=4)
            )
            return [r async for r in engine.generate([req])]
        finally:
            await engine.close()
            asyncio.get_running_loop().remove_signal_handler(signal.SIGUSR2)

    (result,) = asyncio.run(asyncio.wait_for(scenario(), 300))
    assert got == [1]  # the generator's own handler got it
    assert len(result.completions[0].token_ids) == 4 and not result.error
