"""The generator role: one process per generator instance (a SLURM array task, or a local process).

Selected in a recipe with ``roles.generator.program=streamrl_cli.generator.main:main``. Data flow
of one instance (docs/architecture.md):

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
SIGTERM while it is still starting (importing vLLM, starting its engine: a minute or more on a
busy host, and blocking the loop) abandons the start at once (`StoppedStarting`) instead of
finishing it first: a run that ends, or a scale-in, does not wait for an engine nobody will use.

A generator that joins a run in progress (a restarted array task, elastic scale-out: the run has
proposed versions already) must not serve the checkpoint's weights: it reports ``waiting for
weights`` and connects its sample stream only once it loaded the version the trainer sends it
next (``weights.layout``), before confirming it, so the dispatcher knows it by the time the
version is current. Until that hello the trainer dispatches nothing to it.
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
from streamrl_cli.generator.engine import (
    EngineError,
    GenerationEngine,
    GenerationRequest,
    GenerationResult,
    SamplingSpec,
    make_engine,
)
from streamrl_cli.generator.stream import Meter, prompt_of, to_engine_request, to_samples, unstarted_samples
from streamrl_cli.generator.weights import WeightPath, make_weight_path
from streamrl_cli.rendezvous.client import RendezvousClient, RendezvousRequestError
from streamrl_cli.roles.entry import cpu_slot
from streamrl_cli.roles.requeue import requeue_leave_reason, under_slurm
from streamrl_cli.roles.serving import serve_until_stopped
from streamrl_cli.roles.spec import GeneratorSpec, TeacherSpec
from streamrl_cli.weights.layout import STARTING, WAITING

if TYPE_CHECKING:
    from streamrl_cli.transport.wire import Sample

log = logging.getLogger("streamrl.generator")

WAIT_S = 600.0  # for the rendezvous file, the trainer's registration, its hello answer
METRICS_S = 5.0  # metrics report interval
HEALTH_S = 2.0  # how often the engine's health is checked while we serve
POLL_S = 0.5  # how long one blocking call in a thread may wait before checking for a stop
TRAINER_EVENTS = ("member_left", "member_lost", "member_registered")  # about trainer rank 0


class StoppedStarting(BaseException):
    """SIGTERM or SIGINT before the generator served: raised by the signal handler wherever the
    start-up is (a BaseException, like KeyboardInterrupt, so that no `except Exception` on the way
    takes it for a failure of the start)."""


def main(spec: GeneratorSpec, rank: int) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per rendezvous call otherwise
    return run_role(GeneratorRole(spec, rank))


def run_role(role: GeneratorRole) -> int:
    """Run a pool member's loop; stopped while starting, it ends cleanly (exit 0) like one stopped
    while it served."""
    try:
        return asyncio.run(role.run())
    except StoppedStarting as e:
        log.info("%s: %s while starting: start-up abandoned", role.member_id, e)
        return 0


def _stop_starting(signum: int, _frame: object) -> None:
    """The start-up's handler of SIGTERM/SIGINT: once, then later ones are ignored (the way out,
    leaving the rendezvous, must not be cut short again)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    raise StoppedStarting(signal.Signals(signum).name)


def engine_kwargs(spec: GeneratorSpec, rank: int = 0) -> dict[str, Any]:
    """Engine settings from the recipe: the model, its dtype, the longest prompt + output, the batch bound,
    and the cores this instance's worker runs on if vLLM runs on CPUs (the engine ignores them on
    GPUs; a recipe's GPU count does not say which, as the test clusters' GPUs are only counted)."""
    length = spec.task.max_prompt_len + spec.task.max_output_len
    return {
        **instance_engine(spec, rank, spec.model.path, length),
        "lora": lora_serving(spec, rank),
        "routed_experts": spec.routing_replay,
    }


def instance_engine(
    spec: GeneratorSpec | TeacherSpec, rank: int, model: str, max_model_len: int
) -> dict[str, Any]:
    """The engine settings every instance of a pool (generators, teachers) takes from its role's
    section: `model` in the policy's dtype (float32 on CPUs), its TP and batch bound, the run's seed,
    and its worker's CPU cores."""
    s = spec.settings
    cpu = s.tensor_parallel == 1
    return {
        "model": os.path.expanduser(model),
        "dtype": None if s.gpus_per_instance == 0 else spec.model.dtype,  # CPU: float32
        "max_model_len": max_model_len,
        "tensor_parallel": s.tensor_parallel,
        "seed": spec.train.seed,
        "max_num_seqs": s.max_num_seqs,
        "cpu_cores": cpu_binding(
            *cpu_slot(rank, spec.world), sorted(os.sched_getaffinity(0)), os.cpu_count() or 1
        )
        if cpu
        else None,
    }


def lora_serving(spec: GeneratorSpec, rank: int = 0) -> dict[str, Any] | None:
    """With ``model.lora.sync: adapter``, how the engine serves the adapters each version carries:
    their PEFT config, vLLM's LoRA limits (rank, adapters at once: ``weights.adapter.lora_slots``)
    and the directory it writes them to (ours alone: several instances may share a host); None
    otherwise (each version is the whole model, loaded in place)."""
    from streamrl_cli.weights.adapter import lora_slots, peft_config, vllm_max_lora_rank

    lora = spec.model.lora
    if lora.rank <= 0 or lora.sync != "adapter":
        return None
    return {
        "config": peft_config(lora, os.path.expanduser(spec.model.path)),
        "max_rank": vllm_max_lora_rank(lora.rank),
        "slots": lora_slots(spec.max_staleness),
        "directory": str(Path(spec.run_dir) / "adapters" / f"generator-{rank}"),
    }


def cpu_binding(rank: int, instances: int, cores: list[int], host_cores: int) -> str | None:
    """The cores for the worker of CPU instance `rank` of `instances` (VLLM_CPU_OMP_THREADS_BIND).

    vLLM's automatic binding keeps one core for its scheduler and binds the worker to the rest: every
    instance on a 2-core host then decodes on core 0, and whichever runs second is several times
    slower. So when nothing confined this process (`cores`, its affinity, is the whole host: the
    instances of a local run share it), each instance gets its own share of the cores, round-robin
    when there are more instances than cores. A lone instance, a process already confined (a SLURM
    task given its own CPUs) or one left a single core keeps vLLM's choice (None), which also
    leaves a core to the engine's scheduler (without it, decoding here was 3× slower).
    """
    if instances < 2 or len(cores) < 2 or len(cores) < host_cores:
        return None
    share = max(1, len(cores) // max(1, instances))
    first = (rank % max(1, instances)) * share % len(cores)
    return ",".join(str(c) for c in cores[first : first + share])


def ensure_model(spec: GeneratorSpec) -> None:
    """The model must exist; a recipe with a builder (the embedded default's) makes it on first use."""
    from streamrl_cli.models.warmup import ensure_model as make

    make(spec.model, spec.task)


def transfer_metrics(version: int, seconds: float, stats: dict[str, Any]) -> dict[str, Any]:
    """The last weight transfer as metrics: what `streamrl status` shows per site. A relay's stats
    carry what it fetched across sites (`relay`) besides what its own workers loaded."""
    relay = stats.get("relay") or {}
    loaded = stats.get("bytes")
    if loaded is None and isinstance(stats.get("workers"), list):
        loaded = sum(int(w.get("bytes", 0)) for w in stats["workers"])
    out: dict[str, Any] = {
        "weights/version": version,
        "weights/at": round(time.time(), 3),
        "weights/transfer_s": round(seconds, 3),
        "weights/bytes": int(loaded or relay.get("bytes_received", 0)),
        "weights/relay": 1 if relay else 0,
    }
    if relay:  # what crossed sites for this version: bytes, seconds, delta or full (and why full)
        wan = int(relay.get("bytes_received", 0))
        whole = int(relay.get("full_bytes", wan))
        out["weights/wan_bytes"] = wan
        out["weights/wan_s"] = round(float(relay.get("seconds", 0.0)), 3)
        out["weights/wan_mode"] = relay.get("mode", "full")
        out["weights/wan_reason"] = relay.get("reason", "")  # FULL_REASONS key; "" for a delta
        out["weights/wan_full_bytes"] = whole  # the whole version's size
        out["weights/wan_ratio"] = round(whole / wan, 2) if wan else None  # whole / what crossed
    return out


class GeneratorRole:
    """One generator instance: engine, rendezvous membership, sample stream, weight updates."""

    role = "generator"  # its rendezvous role: member ids are "<role>-<rank>"
    stream = "samples"  # the trainer's address (in its rendezvous record) this role streams to
    follows_weights = True  # serves the trainer's weight versions (a distillation teacher does not)

    def __init__(
        self, spec: GeneratorSpec | TeacherSpec, rank: int, *, engine: GenerationEngine | None = None
    ):
        if self.follows_weights and spec.weight_transport not in ("broadcast", "relay"):
            raise StreamRLError(
                f"generator: unknown weight transport {spec.weight_transport!r} (broadcast or relay)"
            )
        self.spec, self.rank = spec, rank
        self.member_id = f"{self.role}-{rank}"
        if engine is None:
            from streamrl_cli.generator.multiturn import (
                wrap,  # multi-turn trajectories, if the recipe has them
            )

            engine = wrap(make_engine(spec.settings.engine, **engine_kwargs(spec, rank)), spec)
        self.engine = engine
        self.meter = Meter(time.time())
        # A role that scores rather than samples (the teacher) sets its fixed settings here; a
        # generator samples as each request says.
        self.scoring: SamplingSpec | None = None
        self._stop = asyncio.Event()
        self._serial = itertools.count()
        self.cancelled = 0  # requests the trainer cancelled while we still had them (over-sampling)
        self._keep: set[str] = set()  # engine ids paused (partial rollout): their samples go back as they are
        # Requests wait here until they fit in the batch their dispatcher chose (generator.admission);
        # `_wake` tells `_incoming` that one arrived or one finished.
        self.admission: Admission[GenerationRequest] = Admission()
        self._wake = asyncio.Event()
        self.rdv: Any = None
        self.sender: Any = None
        self.weights: WeightPath | None = None
        self._confirmed: set[int] = set()
        self.trainer: dict[str, Any] = {}
        self.token = ""
        self._serving = asyncio.Event()  # the sample stream is connected: requests come in
        self.transfer: dict[str, Any] = {}  # the last weight transfer, as metrics (`streamrl status`)
        self._failure: BaseException | None = None  # why the role ends, if it fails
        self._requeue = False  # SLURM's USR2 (time limit near): requeue our task once we left

    async def run(self) -> int:
        from streamrl_cli.rendezvous import read_secret
        from streamrl_cli.roles.preflight import wait_for_file

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):  # until we serve: the start-up is abandoned at once
            signal.signal(sig, _stop_starting)
        if under_slurm():  # hand our work back now, and come back in the requeued task
            loop.add_signal_handler(signal.SIGUSR2, self._requeue_requested)
        run_dir = Path(self.spec.run_dir)
        await asyncio.to_thread(wait_for_file, Path(self.spec.rendezvous_file), WAIT_S)
        self.rdv = RendezvousClient.from_run_dir(run_dir, tls_ca=self.spec.rendezvous_ca)
        self.token = token = read_secret(run_dir)
        try:
            self.weights = self.make_weights(token)
            self.rdv.register(
                self.role,
                self.rank,
                cluster=self.spec.cluster,
                site=self.spec.site,
                host=socket.gethostname(),
                addresses=self.weights.addresses(),
                info=self._info(),
            )
            self.rdv.set_status(state=STARTING, weight_version=self.engine.weight_version)
            self.rdv.start_heartbeat()
            await asyncio.to_thread(self.ensure_model)
            await self.engine.start()
            versions = self.rdv.versions()
            since = versions["event_seq"]  # proposals from here on are ours to follow
            newest = max([versions["current"] or 0] + [p["version"] for p in versions["pending"]])
            self.trainer = await asyncio.to_thread(self._find_trainer)
            if self.follows_weights and newest > self.engine.weight_version:
                # Joining a run in progress: no work before we serve the trainer's weights. Said at
                # once, as past start-up we follow proposals: the trainer includes us in the next one.
                log.info("%s: the run is at weight version %d; waiting for weights", self.member_id, newest)
                self.rdv.set_status(state=WAITING)
                await asyncio.to_thread(self.rdv.heartbeat)
            else:
                await self._connect()
            for sig in (signal.SIGTERM, signal.SIGINT):  # from here on a stop hands over first
                loop.add_signal_handler(sig, self._stop.set)
            return await self._serve(since)
        except StoppedStarting:
            self._stop.set()  # we leave the rendezvous as stopped, not failed
            raise
        except BaseException as e:
            self._failure = e
            raise
        finally:
            await self._shutdown()

    def _requeue_requested(self) -> None:
        log.warning("%s: SIGUSR2: handing the work back; the task requeues itself", self.member_id)
        self._requeue = True
        self._stop.set()

    def ensure_model(self) -> None:
        ensure_model(self.spec)

    def make_weights(self, token: str) -> WeightPath:
        """How weights reach us (the trainer's group, or our site's relay); tests tune its timeouts."""
        return make_weight_path(self.spec, self.rank, self.engine, self.rdv, token)

    async def _connect(self) -> None:
        """Open the sample stream: the trainer's hello answer makes us a generator it dispatches to."""
        from streamrl_cli.transport.samples import StreamConfig, make_sender

        address = self.trainer["addresses"][self.stream]
        self.sender = make_sender(StreamConfig(), address=address, token=self.token, generator=self.member_id)
        await asyncio.to_thread(self.sender.wait_connected, WAIT_S)
        self.rdv.set_status(state="generating", weight_version=self.engine.weight_version)
        self._serving.set()
        log.info("%s serving %s, streaming to %s", self.member_id, self._info()["model"], address)

    async def _serve(self, since: int) -> int:
        await serve_until_stopped(
            {
                "receive": self._receive(),
                "deliver": self._deliver(),
                "events": self._follow_events(since),
                "metrics": self._report(),
                "health": self._watch_engine(),
            },
            self._stop,
        )
        return 0

    async def _watch_engine(self) -> None:
        """Fail (loudly: the reason is our leave reason) once the engine died, whatever we were doing:
        waiting for weights, a dead engine would otherwise fail every version quietly."""
        while True:
            await asyncio.sleep(HEALTH_S)
            health = await self.engine.health()
            if not health.ok:
                raise EngineError(f"the generation engine died: {health.detail}")

    async def _receive(self) -> None:
        """Requests dispatched to us join the admission queue, in their priority order."""
        while True:
            await self._serving.wait()
            sender = self.sender
            try:
                reqs = await asyncio.to_thread(sender.requests, POLL_S)
            except Exception:
                if self._serving.is_set() and self.sender is sender:
                    raise
                continue  # the trainer we served is gone (see _follow_trainer): its stream was closed
            if self.sender is not sender:
                continue  # dispatched by the trainer that went: the new one dispatches again
            for req in reqs:
                if req.cancel:
                    await self._cancel(req.prompt_id, keep=req.keep)
                    continue
                self.meter.submitted(time.time())
                er = to_engine_request(req, next(self._serial), self.scoring)
                self.admission.add(
                    er.request_id, er, size=er.sampling.n, priority=req.priority, limit=req.batch_limit
                )
            if reqs:
                self._wake.set()

    async def _cancel(self, prompt_id: str, *, keep: bool = False) -> None:
        """The trainer wants no more of `prompt_id` (an over-sampled group it will not train):
        drop it from the admission queue, abort it in the engine (its places go to the next).
        `keep` (partial rollout pauses it): what it generated so far goes back to the trainer, as
        samples cut short (finish_reason "abort"; no tokens for one still queued)."""
        waiting = self.admission.drop({k for k in self.admission.waiting_keys() if prompt_of(k) == prompt_id})
        running = [k for k in self.admission.running_keys() if prompt_of(k) == prompt_id]
        if not waiting and not running:
            return  # finished already (its samples are on their way: dropped, or trained if kept)
        now = time.time()
        for _ in waiting:  # never reached the engine: out of the queue depth
            self.meter.finished(now, 0, 0)
        if keep:
            self._keep.update(running)
            for er in waiting:
                await self._send(unstarted_samples(er, self.engine.weight_version, self.member_id, now))
        if running and keep:
            await self.engine.pause_requests(running)
        elif running:
            await self.engine.abort(running)
        self.cancelled += 1
        log.debug(
            "%s: %s %s (%d queued, %d running)",
            self.member_id, "paused" if keep else "cancelled", prompt_id, len(waiting), len(running),
        )  # fmt: skip
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
        await self._serving.wait()
        async for result in self.engine.generate(self._incoming()):
            self.admission.finish(result.request_id)  # its place goes to the next one right away
            self._wake.set()
            # An aborted request's samples are dropped, unless the trainer paused it (partial rollout).
            kept = result.request_id in self._keep
            self._keep.discard(result.request_id)
            samples = [] if result.aborted and not kept else self.samples(result)
            self.meter.finished(time.time(), len(samples), sum(len(s.token_ids) for s in samples))
            await self._send(samples)

    def samples(self, result: GenerationResult) -> list[Sample]:
        """What a finished engine request sends back: one sample per completion."""
        return to_samples(result, self.member_id)

    async def _send(self, samples: list[Sample]) -> None:
        sender = self.sender if self._serving.is_set() else None
        if samples and sender is not None:
            try:
                if sender.room() >= len(samples):
                    self._send_all(sender, samples)  # on the engine's thread: no other takes the GIL
                else:  # in a thread: send() blocks while the trainer has the window full (back-pressure)
                    await asyncio.to_thread(self._send_all, sender, samples)
            except Exception:
                if self.sender is sender:
                    raise
                # for the trainer that went (its stream closed under us): the new one dispatches again

    def _send_all(self, sender: Any, samples: list[Sample]) -> None:
        for s in samples:
            sender.send(s)

    async def _follow_events(self, since: int) -> None:
        """Weight versions proposed for generators, the trainer leaving (the run is over) or going and
        coming back (see `_follow_trainer`), and generators lost or leaving (at a far site, the
        relay may be gone: we may be the next)."""
        trainer_id = self.trainer["member_id"]
        await self._deliver_orphaned()  # a version our site's lost relay left pending may be ours now
        gone_since: float | None = None  # when the trainer went, while we wait for it to come back
        while True:
            doc = await asyncio.to_thread(self.rdv.events, since, 10.0)
            since = doc["next_since"]
            for ev in doc["events"]:
                data = ev.get("data", {})
                if ev["type"] == "version_proposed" and self.role in data.get("required_roles", []):
                    log.info("%s: version %s proposed %.3fs ago", self.member_id, data["version"],
                             time.time() - ev["time"])  # fmt: skip
                    await self._update_weights(int(data["version"]), data)
                elif data.get("member_id") == trainer_id and ev["type"] in TRAINER_EVENTS:
                    gone_since = await self._follow_trainer(ev["type"], data, gone_since)
                    if self._stop.is_set():
                        return
                elif ev["type"] in ("member_lost", "member_left") and data["member_id"].startswith(
                    "generator-"
                ):
                    await self._deliver_orphaned()
            wait_s = self.spec.train.stall_after_s
            if gone_since is not None and time.monotonic() - gone_since > wait_s:
                raise StreamRLError(
                    f"the trainer went and did not come back within train.stall_after_s={wait_s:.0f}s"
                )

    async def _follow_trainer(
        self, kind: str, data: dict[str, Any], gone_since: float | None
    ) -> float | None:
        """The trainer left, was lost or registered (again); returns since when we wait for it, if we do.

        It leaves for good (the run is over, or failed): we finish. It leaves to come back (its job
        requeued itself after SLURM's time-limit warning, or was preempted, or it failed and will
        be started again within roles.trainer.restarts) or is lost: we wait up
        to `train.stall_after_s` for it. A trainer process that registers anew (a requeued job, a
        restart) dispatches from its checkpoint and pushes its weights first: what the old one
        dispatched is dropped, and we serve the new one once we loaded its weights.
        """
        from streamrl_cli.roles.requeue import PREEMPTED, REQUEUED
        from streamrl_cli.roles.restart import RESTARTING

        if kind == "member_left":
            reason = str(data.get("reason") or "")
            if not reason.startswith((REQUEUED, PREEMPTED, RESTARTING)):
                log.info("%s: the trainer left (%s); finishing", self.member_id, reason or "stopped")
                self._stop.set()
                return None
            log.info("%s: the trainer left (%s); waiting for it to come back", self.member_id, reason)
            await self._drop_trainer()
            return time.monotonic()
        if kind == "member_lost":
            log.warning("%s: the trainer is lost; waiting for it to come back", self.member_id)
            return gone_since or time.monotonic()
        same = data.get("host") == self.trainer.get("host") and (data.get("info") or {}).get("pid") == (
            self.trainer.get("info") or {}
        ).get("pid")
        if same:  # the same process, registered again after a lapse of its heartbeats: nothing changed
            return None
        await self._drop_trainer()
        self.trainer = await asyncio.to_thread(self._find_trainer)
        if not self.follows_weights:  # nothing to wait for: serve it at once
            log.info("%s: a new trainer process (incarnation %s) leads the run; connecting",
                     self.member_id, self.trainer.get("incarnation"))  # fmt: skip
            await self._connect()
            return None
        log.info("%s: a new trainer process (incarnation %s) leads the run; waiting for its weights",
                 self.member_id, self.trainer.get("incarnation"))  # fmt: skip
        return None

    async def _drop_trainer(self) -> None:
        """Stop serving the trainer that went: what it dispatched is dropped (waiting and running),
        its sample stream closed; we wait for weights (the new trainer pushes them first)."""
        if self.sender is None and not self._serving.is_set():
            return
        self._serving.clear()
        dropped = self.admission.drop_waiting()
        running = self.admission.running_keys()
        await self.engine.abort(running)
        sender, self.sender = self.sender, None
        if sender is not None:
            await asyncio.to_thread(sender.close, 0.0)
        self.rdv.set_status(state=WAITING)
        await asyncio.to_thread(self.rdv.heartbeat)
        log.info("%s: dropped %d queued and %d running requests of the trainer that went",
                 self.member_id, dropped, len(running))  # fmt: skip

    async def _deliver_orphaned(self) -> None:
        proposal = await asyncio.to_thread(self.weights.orphaned)
        if proposal is not None:
            await self._update_weights(int(proposal["version"]), proposal)

    async def _update_weights(self, version: int, proposal: dict[str, Any]) -> None:
        if not self.weights.concerns_us(proposal):  # the group was planned without us: the next one
            log.info("%s: version %d goes to a group without us", self.member_id, version)
            return
        grouped = self.weights.takes_part(proposal)  # a group member must, even if it has the version
        if grouped or version > self.engine.weight_version:
            self.rdv.set_status(state=f"loading weights v{version}")
            started = time.monotonic()
            try:
                stats = await self.weights.update(version, proposal)
            except Exception as e:
                if not grouped:
                    raise
                # The trainer sends it again on a new group of the members still there.
                healthy = self._serving.is_set() and self.engine.weights_intact
                self.rdv.set_status(
                    state="generating" if healthy else WAITING,
                    error=f"weight version {version} not received: {e}",
                )
                log.warning("%s: weight version %d not received: %s", self.member_id, version, e)
                return
            if not self._serving.is_set():
                await self._connect()  # before confirming: known to the dispatcher once it is current
            self.rdv.set_status(state="generating", weight_version=self.engine.weight_version, error="")
            self.transfer = transfer_metrics(self.engine.weight_version, time.monotonic() - started, stats)
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
                # unknown: never proposed (a relay's newer version, see above); stale: a newer version
                # became current while this one was loading (a slow transfer; a trainer started again
                # with a newer one): nothing to confirm, the newer one comes as its own proposal.
                if e.code not in ("unknown_version", "stale_version"):
                    raise
                log.info("%s: weight version %d not confirmed: %s", self.member_id, served, e)

    async def _report(self) -> None:
        while True:
            await asyncio.sleep(METRICS_S)
            record = {**self._metrics(), "weight_version": self.engine.weight_version, **self.transfer}
            try:
                await asyncio.to_thread(self.rdv.post_metrics, record)
            except StreamRLError as e:  # metrics are not worth dying for
                log.warning("%s: metrics not posted: %s", self.member_id, e)

    def _metrics(self) -> dict[str, Any]:
        agent = getattr(self.engine, "stats", None)  # a multi-turn engine: its environment processes
        return {
            **self.meter.report(time.time()), "cancelled_requests": self.cancelled,
            **(agent() if callable(agent) else {}),
        }  # fmt: skip

    def _find_trainer(self) -> dict[str, Any]:
        """Trainer rank 0's member record: it receives the samples and hosts the weight group."""
        self.rdv.wait_for("trainer", 1, timeout=WAIT_S)
        ranks = {m["rank"]: m for m in self.rdv.members("trainer") if m["state"] == "alive"}
        if 0 not in ranks:
            raise StreamRLError(f"trainer rank 0 is not alive (alive trainer ranks: {sorted(ranks)})")
        if not ranks[0].get("addresses", {}).get(self.stream):
            program = ranks[0].get("info", {}).get("program", "?")
            raise StreamRLError(
                f"trainer rank 0 (program {program!r}) published no address for this role's stream "
                f"(addresses.{self.stream}): the {self.role} role needs a trainer that receives its "
                "stream (the preflight program does not; a teacher needs algorithm.distill_coef > 0)"
            )
        return ranks[0]

    def _info(self) -> dict[str, Any]:
        return {
            "program": "generator",
            "engine": self.spec.settings.engine,
            "model": self.spec.model.name,
            # Ranks it takes in its site's weight group (one per worker).
            "workers": self.spec.settings.tensor_parallel,
            "pid": os.getpid(),
        }

    async def _shutdown(self) -> None:
        # Order: stop producing, hand over what was produced, then say we left (the trainer
        # re-dispatches the rest at once), then free the engine.
        if self.sender is not None:
            await asyncio.to_thread(self.sender.close, 5.0)
        if self.rdv is not None:
            failure = self._failure
            if self._requeue and failure is None:
                reason = requeue_leave_reason(self.member_id)
            elif self._stop.is_set() or failure is None or isinstance(failure, asyncio.CancelledError):
                reason = "stopped"
            else:  # said loudly: `streamrl status` shows it as this member's last error
                reason = f"failed: {type(failure).__name__}: {failure}"
                log.error("%s: %s", self.member_id, reason)
            try:
                # The last counts (and transfer's figures) stay visible after we left.
                self.rdv.post_metrics({**self._metrics(), **self.transfer})
                self.rdv.leave(reason)
            except StreamRLError as e:
                log.warning("%s: could not leave the rendezvous: %s", self.member_id, e)
            self.rdv.close()
        if self.weights is not None:
            self.weights.close()
        await self.engine.close()
