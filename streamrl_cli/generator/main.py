"""The generator role: one process per generator instance (a SLURM array task, or a local process).

Selected in a recipe with ``roles.generator.program=streamrl_cli.generator.main:main``. Data flow
of one instance (DESIGN.md §1, §4):

    trainer rank 0 ── requests ──► sample sender ──► admission ──► engine.generate ──► finished group
         ▲                           (ZeroMQ)      (LPT, batch size)     (vLLM)               │
         └─────────────────── samples, acked ◄── sample sender ◄──────────────────────────────┘
    trainer rank 0 ── version_proposed (rendezvous) ──► weights.update ── broadcast group of the
                                                       site (trainer's, or the relay's: weights.py)
    rendezvous ◄── register, heartbeat (weight version, state), metrics, confirm_version

Everything runs on one asyncio loop (the engine is async); the blocking clients (rendezvous
long-polls, the sender's request queue) are called in threads. A generator finishes when the
trainer leaves, or on SIGTERM (`streamrl cancel`, SLURM); it then aborts what is in flight and
leaves the rendezvous, so the trainer re-dispatches what it still owed without waiting a lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import signal
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from streamrl_cli.errors import StreamRLError
from streamrl_cli.generator.admission import Admission
from streamrl_cli.generator.engine import GenerationEngine, GenerationRequest, make_engine
from streamrl_cli.generator.stream import Meter, to_engine_request, to_samples
from streamrl_cli.generator.weights import WeightPath, make_weight_path
from streamrl_cli.launch.plan import RoleSpec
from streamrl_cli.rendezvous.client import RendezvousClient, RendezvousRequestError

if TYPE_CHECKING:
    from streamrl_cli.transport.wire import Sample

log = logging.getLogger("streamrl.generator")

WAIT_S = 600.0  # for the rendezvous file, the trainer's registration, its hello answer
METRICS_S = 5.0  # metrics report interval
POLL_S = 0.5  # how long one blocking call in a thread may wait before checking for a stop


def main(spec: RoleSpec, rank: int) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per rendezvous call otherwise
    return asyncio.run(GeneratorRole(spec, rank).run())


def engine_kwargs(spec: RoleSpec) -> dict[str, Any]:
    """Engine settings from the recipe: the model, its dtype, the longest prompt + output."""
    path = os.path.expanduser(spec.model["path"])
    dtype = spec.model.get("dtype")
    return {
        "model": path,
        "dtype": None if spec.settings.get("gpus_per_instance", 1) == 0 else dtype,  # CPU: float32
        "max_model_len": int(spec.task["max_prompt_len"]) + int(spec.task["max_output_len"]),
        "tensor_parallel": int(spec.settings.get("tensor_parallel", 1)),
        "seed": int(spec.train.get("seed", 0)),
    }


def ensure_model(spec: RoleSpec) -> None:
    """The model must exist; a recipe with a builder (the embedded default's) makes it on first use."""
    from streamrl_cli.models.warmup import ensure_model as make

    make(spec.model, spec.task)


class GeneratorRole:
    """One generator instance: engine, rendezvous membership, sample stream, weight updates."""

    def __init__(self, spec: RoleSpec, rank: int, *, engine: GenerationEngine | None = None):
        if spec.weight_transport not in ("broadcast", "relay"):
            raise StreamRLError(
                f"generator: unknown weight transport {spec.weight_transport!r} (broadcast or relay)"
            )
        self.spec, self.rank = spec, rank
        self.member_id = f"generator-{rank}"
        self.engine = engine or make_engine(spec.settings.get("engine", "vllm"), **engine_kwargs(spec))
        self.meter = Meter(time.time())
        self.defaults = {"max_tokens": int(spec.task["max_output_len"]), "temperature": 1.0}
        self._stop = asyncio.Event()
        self._serial = itertools.count()
        # Requests wait here until they fit in the batch their dispatcher chose (generator.admission);
        # `_wake` tells `_incoming` that one arrived or one finished.
        self.admission: Admission[GenerationRequest] = Admission()
        self._wake = asyncio.Event()
        self.rdv: Any = None
        self.sender: Any = None
        self.weights: WeightPath | None = None
        self._confirmed: set[int] = set()
        self.trainer: dict[str, Any] = {}

    async def run(self) -> int:
        from streamrl_cli.rendezvous import read_secret
        from streamrl_cli.roles.preflight import wait_for_file
        from streamrl_cli.transport.samples import StreamConfig, make_sender

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        run_dir = Path(self.spec.run_dir)
        await asyncio.to_thread(wait_for_file, Path(self.spec.rendezvous_file), WAIT_S)
        self.rdv = RendezvousClient.from_run_dir(run_dir, tls_ca=self.spec.rendezvous_ca)
        token = read_secret(run_dir)
        try:
            self.weights = make_weight_path(self.spec, self.rank, self.engine, self.rdv, token)
            self.rdv.register(
                "generator",
                self.rank,
                cluster=self.spec.cluster,
                site=self.spec.site,
                host=socket.gethostname(),
                addresses=self.weights.addresses(),
                info=self._info(),
            )
            self.rdv.set_status(state="starting", weight_version=self.engine.weight_version)
            self.rdv.start_heartbeat()
            await asyncio.to_thread(ensure_model, self.spec)
            await self.engine.start()
            versions = self.rdv.versions()
            since = versions["event_seq"]  # proposals from here on are ours to follow
            if versions["current"]:
                # Joining a run in progress: until the trainer sends its next version we serve the
                # checkpoint's weights (catching a late joiner up is the trainer's side of the protocol).
                log.warning(
                    "%s: the run serves weight version %s; starting from the checkpoint",
                    self.member_id,
                    versions["current"],
                )
            self.trainer = await asyncio.to_thread(self._find_trainer)
            self.sender = make_sender(
                StreamConfig(),
                address=self.trainer["addresses"]["samples"],
                token=token,
                generator=self.member_id,
            )
            await asyncio.to_thread(self.sender.wait_connected, WAIT_S)
            self.rdv.set_status(state="generating")
            log.info(
                "%s serving %s, streaming to %s",
                self.member_id,
                self.spec.model.get("name"),
                self.trainer["addresses"]["samples"],
            )
            return await self._serve(since)
        finally:
            await self._shutdown()

    async def _serve(self, since: int) -> int:
        tasks = [
            asyncio.create_task(self._receive(), name="receive"),
            asyncio.create_task(self._deliver(), name="deliver"),
            asyncio.create_task(self._follow_events(since), name="events"),
            asyncio.create_task(self._report(), name="metrics"),
        ]
        stop = asyncio.create_task(self._stop.wait(), name="stop")
        done, _ = await asyncio.wait([*tasks, stop], return_when=asyncio.FIRST_COMPLETED)
        for t in [*tasks, stop]:
            t.cancel()
        await asyncio.gather(*tasks, stop, return_exceptions=True)
        for t in done:
            if t is not stop and not t.cancelled() and t.exception() is not None:
                raise t.exception()
        return 0

    async def _receive(self) -> None:
        """Requests dispatched to us join the admission queue, in their priority order."""
        while True:
            reqs = await asyncio.to_thread(self.sender.requests, POLL_S)
            for req in reqs:
                self.meter.submitted(time.time())
                er = to_engine_request(req, next(self._serial), self.defaults)
                self.admission.add(
                    er.request_id, er, size=er.sampling.n, priority=req.priority, limit=req.batch_limit
                )
            if reqs:
                self._wake.set()

    async def _incoming(self) -> AsyncIterator[GenerationRequest]:
        """The engine's input stream: what the admission queue lets in (ends when we stop)."""
        while not self._stop.is_set():
            self._wake.clear()  # before looking, so that a wake-up after the look is not lost
            admitted = self.admission.ready()
            for er in admitted:
                yield er
            if not admitted:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), POLL_S)

    async def _deliver(self) -> None:
        """Each finished group goes to the trainer at once (the sender owns it until acked)."""
        async for result in self.engine.generate(self._incoming()):
            self.admission.finish(result.request_id)  # its place goes to the next one right away
            self._wake.set()
            samples = [] if result.aborted else to_samples(result, self.member_id)
            self.meter.finished(time.time(), len(samples), sum(len(s.token_ids) for s in samples))
            if samples:
                await asyncio.to_thread(self._send_all, samples)

    def _send_all(self, samples: list[Sample]) -> None:
        # In a thread: send() blocks while the trainer has the window full (back-pressure).
        for s in samples:
            self.sender.send(s)

    async def _follow_events(self, since: int) -> None:
        """Weight versions proposed for generators, and the trainer leaving (the run is over)."""
        trainer_id = self.trainer["member_id"]
        while True:
            doc = await asyncio.to_thread(self.rdv.events, since, 10.0)
            since = doc["next_since"]
            for ev in doc["events"]:
                data = ev.get("data", {})
                if ev["type"] == "version_proposed" and "generator" in data.get("required_roles", []):
                    log.info("%s: version %s proposed %.3fs ago", self.member_id, data["version"],
                             time.time() - ev["time"])  # fmt: skip
                    await self._update_weights(int(data["version"]))
                elif ev["type"] == "member_left" and data.get("member_id") == trainer_id:
                    log.info("%s: the trainer left; finishing", self.member_id)
                    self._stop.set()
                    return

    async def _update_weights(self, version: int) -> None:
        if version > self.engine.weight_version:
            self.rdv.set_status(state=f"loading weights v{version}")
            started = time.monotonic()
            stats = await self.weights.update(version)
            self.rdv.set_status(state="generating", weight_version=self.engine.weight_version)
            log.info(
                "%s: serving weight version %d (%.2fs): %s",
                self.member_id, self.engine.weight_version, time.monotonic() - started, stats,
            )  # fmt: skip
        # A relay superseded mid-fetch brings a newer version than proposed: it can be confirmed
        # only once the trainer proposes it too (then this runs again, with nothing to load).
        served = self.engine.weight_version
        if served >= version and served not in self._confirmed:
            try:
                await asyncio.to_thread(self.rdv.confirm_version, served)
                self._confirmed.add(served)
            except RendezvousRequestError as e:
                if e.code != "unknown_version":
                    raise

    async def _report(self) -> None:
        while True:
            await asyncio.sleep(METRICS_S)
            record = {**self.meter.report(time.time()), "weight_version": self.engine.weight_version}
            try:
                await asyncio.to_thread(self.rdv.post_metrics, record)
            except StreamRLError as e:  # metrics are not worth dying for
                log.warning("%s: metrics not posted: %s", self.member_id, e)

    def _find_trainer(self) -> dict[str, Any]:
        """Trainer rank 0's member record: it receives the samples and hosts the weight group."""
        self.rdv.wait_for("trainer", 1, timeout=WAIT_S)
        ranks = {m["rank"]: m for m in self.rdv.members("trainer") if m["state"] == "alive"}
        if 0 not in ranks:
            raise StreamRLError(f"trainer rank 0 is not alive (alive trainer ranks: {sorted(ranks)})")
        if not ranks[0].get("addresses", {}).get("samples"):
            program = ranks[0].get("info", {}).get("program", "?")
            raise StreamRLError(
                f"trainer rank 0 (program {program!r}) published no sample address (addresses.samples): the "
                "generator role needs a trainer that receives samples (the preflight program does not)"
            )
        return ranks[0]

    def _info(self) -> dict[str, Any]:
        return {
            "program": "generator",
            "engine": self.spec.settings.get("engine", "vllm"),
            "model": self.spec.model.get("name"),
            # Ranks it takes in its site's weight group (one per worker).
            "workers": int(self.spec.settings.get("tensor_parallel", 1)),
            "pid": os.getpid(),
        }

    async def _shutdown(self) -> None:
        # Order: stop producing, hand over what was produced, then say we left (the trainer
        # re-dispatches the rest at once), then free the engine.
        if self.sender is not None:
            await asyncio.to_thread(self.sender.close, 5.0)
        if self.rdv is not None:
            try:
                self.rdv.leave("stopped" if self._stop.is_set() else "failed")
            except StreamRLError as e:
                log.warning("%s: could not leave the rendezvous: %s", self.member_id, e)
            self.rdv.close()
        if self.weights is not None:
            self.weights.close()
        await self.engine.close()
