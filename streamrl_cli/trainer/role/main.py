"""The trainer role: ``roles.trainer.program=streamrl_cli.trainer.main:main`` (the default).

Rank 0 is the hub of the run's data plane::

    rendezvous ◄── register (addresses: samples, weights|relay, dist), progress, metrics
    task + sampler ──► Pipeline ──► DispatchService ══ requests/samples ══ generators
                           │  micro-batch rounds, step, full state      ▲
                           ▼                                            │ weights
                      RankDriver ── commands ──► ranks 1..W-1      WeightPublisher

Ranks > 0 register (so `streamrl status` shows them), join the trainer's default group at the
address rank 0 published, and follow its commands. The run ends when the last iteration is
trained and its weights are delivered: rank 0 leaves the rendezvous, which tells the generators
to finish.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import random
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from streamrl_cli.errors import StreamRLError
from streamrl_cli.recipe.schema import TaskConfig
from streamrl_cli.roles.spec import TrainerSpec
from streamrl_cli.rundir import RunDir
from streamrl_cli.trainer.role.prompts import prompt_tokenizer

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from streamrl_cli.elastic.control import ElasticController
    from streamrl_cli.metrics.sinks import MetricsSink
    from streamrl_cli.ranker.base import Ranker
    from streamrl_cli.rendezvous import RendezvousClient
    from streamrl_cli.roles.requeue import EndSignals
    from streamrl_cli.skew.dispatch_plan import PTL
    from streamrl_cli.tasks import Task
    from streamrl_cli.trainer.loop.collaborators import SampleService
    from streamrl_cli.trainer.loop.evaluation import Evaluator
    from streamrl_cli.trainer.loop.pipeline import Stopped
    from streamrl_cli.trainer.role.learner import Learner
    from streamrl_cli.trainer.role.publish import WeightPublisher
    from streamrl_cli.trainer.role.ranks import RankDriver
    from streamrl_cli.trainer.role.records import Reporter
    from streamrl_cli.transport.routing import DispatchService

log = logging.getLogger("streamrl.trainer")


class Closable(Protocol):
    def close(self) -> None: ...


WAIT_S = 600.0


def main(spec: TrainerSpec, rank: int) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per rendezvous call otherwise
    return TrainerRole(spec, rank).run()


class TrainerRole:
    def __init__(self, spec: TrainerSpec, rank: int):
        self.spec, self.rank = spec, rank
        self.run_dir = Path(spec.run_dir)
        self.rdv: RendezvousClient
        self.closers: list[Closable] = []  # closed in reverse order at the end
        self.teachers: DispatchService | None = None  # on-policy distillation: the teachers' stream
        self.ends: EndSignals  # SLURM's warnings before the job ends

    def run(self) -> int:
        from streamrl_cli.rendezvous import RendezvousClient, read_secret
        from streamrl_cli.roles.preflight import wait_for_file
        from streamrl_cli.roles.requeue import EndSignals

        # Before anything slow: a signal during start-up must not kill us (rank 0 checks it later).
        warn = lambda name: log.warning("%s: ending after this iteration's checkpoint", name)  # noqa: E731
        self.ends = EndSignals(warn, ignore=self.rank != 0)
        wait_for_file(Path(self.spec.rendezvous_file), WAIT_S)
        self.rdv = RendezvousClient.from_run_dir(self.run_dir, tls_ca=self.spec.rendezvous_ca)
        self.token = read_secret(self.run_dir)
        try:
            return self._run()
        except Exception as e:
            # Said to the rendezvous as we go: `streamrl status` shows it as this member's last error.
            log.error("trainer rank %d failed: %s", self.rank, e)
            with contextlib.suppress(Exception):
                self.rdv.leave(self._failed(e))
            raise
        finally:
            for c in reversed(self.closers):
                try:
                    c.close()
                except Exception as e:  # closing is best effort; the run's outcome is already decided
                    log.warning("closing %s: %s", type(c).__name__, e)
            self.rdv.close()

    def _run(self) -> int:
        import torch

        cuda = torch.cuda.is_available()
        if not cuda:  # as many threads as the job's cores: more only fight the generators for them
            torch.set_num_threads(max(1, self.spec.settings.cpus_per_task))
        backend = "nccl" if cuda else "gloo"
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
        world = self.spec.world
        host = socket.gethostname()
        addresses: dict[str, str] = {}
        store: Any = None  # rank 0's store for the trainer group (a torch.distributed.TCPStore)
        info: dict[str, Any] = {"program": "trainer", "pid": os.getpid(), "device": str(device)}
        if self.rank == 0:
            from streamrl_cli.models.warmup import ensure_model

            ensure_model(self.spec.model, self.spec.task)
            svc, publisher = self._data_plane(backend if cuda else "gloo")
            addresses.update(samples=svc.address.replace("0.0.0.0", host), **publisher.addresses())
            if self.teachers is not None:
                addresses["teacher"] = self.teachers.address.replace("0.0.0.0", host)
            info.update(publisher.info())
            from streamrl_cli.trainer.role.learner import open_group_store

            store, addresses["dist"] = open_group_store(world, host if world > 1 else "127.0.0.1")
        self.rdv.register("trainer", self.rank, cluster=self.spec.cluster, site=self.spec.site, host=host,
                          addresses=addresses, info=info)  # fmt: skip
        self.rdv.start_heartbeat()
        self.rdv.set_status(state="starting")
        master = addresses["dist"] if self.rank == 0 else self._rank0()["addresses"]["dist"]
        from streamrl_cli.roles.extlock import LockWatch
        from streamrl_cli.trainer.role.learner import init_distributed, leave_group

        # DeepSpeed builds and loads its ops here; a build lock a killed run left must not block us.
        with LockWatch(on_error=self._fatal):
            init_distributed(self.rank, world, master, backend, store if self.rank == 0 else None)
            learner = self._learner(device)
        from streamrl_cli.trainer.role.ranks import RankDriver, follow

        if self.rank != 0:
            self.rdv.set_status(state="training")
            code = follow(learner, self.rank)
            leave_group()
            self.rdv.leave("stopped")
            return code
        from streamrl_cli.trainer.loop.pipeline import Stopped

        driver = RankDriver(learner, world)
        stopped: Stopped | None = None
        try:
            self._train(driver, svc, publisher)
        except Stopped as e:
            stopped = e
        finally:
            driver.stop()
        leave_group()
        self.rdv.leave("stopped" if stopped is None else self._end_early(stopped))
        return 0

    def _failed(self, error: Exception) -> str:
        """Why we leave after ``error``. When a process of ours will be started again (the restart
        budget allows: see `roles.restart`), the reason says so and the generators wait for it."""
        from streamrl_cli.roles.restart import RESTARTING, trainer_restarts_left

        reason = f"failed: {type(error).__name__}: {error}"
        try:
            again = self.rank == 0 and trainer_restarts_left(RunDir(self.run_dir)) > 0
        except Exception as e:  # the budget cannot be read: say so, and let the generators finish
            log.warning("trainer restart budget not read (%s): the generators finish", e)
            again = False
        if not again:
            return reason
        self.rdv.set_status(state="failed", error=reason)  # `streamrl status` shows it meanwhile
        log.info("trainer: a new process will be started (roles.trainer.restarts); generators wait")
        return f"{RESTARTING}: {reason}"

    def _end_early(self, stopped: Stopped) -> str:
        """After the checkpoint SLURM's warning asked for: requeue our job after USR2; say why we leave
        (a reason starting `requeued`/`preempted` keeps the generators waiting for us to come back)."""
        from streamrl_cli.roles.requeue import PREEMPTED, REQUEUED, own_job_id, requeue_self

        why = f"{self.ends.signal_name}; checkpointed, resumes at iteration {stopped.next_iteration}"
        if self.ends.requeue:
            # Logged first: SLURM ends the job once it is back in the queue, and may lose later output.
            log.info("requeuing job %s: %s", own_job_id(), why)
            requeue_self()
            return f"{REQUEUED}: {why}"
        if RunDir(self.run_dir).info().get("state") in ("cancelling", "cancelled"):
            return "stopped"  # `streamrl cancel`: the run is over
        # SIGTERM otherwise: a preemption (the site's SLURM requeues the job) or a cancel by hand.
        log.info("ending on %s", why)
        return f"{PREEMPTED}: {why}"

    def _data_plane(self, backend: str) -> tuple[DispatchService, WeightPublisher]:
        from streamrl_cli.trainer.role.publish import WeightPublisher
        from streamrl_cli.transport.routing import DispatchService
        from streamrl_cli.transport.samples import StreamConfig

        gen = self.spec.generator
        svc = DispatchService(StreamConfig(), self.token)
        self.closers.append(svc)
        workers = gen.instances * gen.tensor_parallel
        publisher = WeightPublisher(
            self.rdv, self.token, transport=self.spec.generator_transport, generator_workers=workers,
            backend=backend, relay_deltas=gen.relay_sync == "delta",
        )  # fmt: skip
        self.closers.append(publisher)
        self.generators = gen.instances
        self.elastic = gen.elastic
        if self.spec.teacher.instances > 0:  # on-policy distillation: the teachers' own stream
            self.teachers = DispatchService(StreamConfig(), self.token)
            self.closers.append(self.teachers)
        return svc, publisher

    def _rank0(self) -> dict[str, Any]:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            for m in self.rdv.members("trainer"):
                if m["rank"] == 0 and m["state"] == "alive" and m.get("addresses", {}).get("dist"):
                    return m
            time.sleep(0.5)
        raise StreamRLError(f"trainer rank 0 did not publish its address within {WAIT_S:.0f}s")

    def _fatal(self, error: Exception) -> None:
        """A failure found off the main thread while the main thread is blocked on it: say why, end."""
        log.critical("trainer rank %d: %s", self.rank, error)
        with contextlib.suppress(Exception):
            self.rdv.set_status(state="failed", error=str(error))
            self.rdv.heartbeat()
            self.rdv.leave("failed")
        os._exit(3)

    def _learner(self, device: torch.device) -> Learner:
        import torch

        from streamrl_cli.trainer.role.learner import Learner, LossConfig, OptimConfig
        from streamrl_cli.trainer.role.models import torch_dtype

        a = self.spec.algorithm
        torch.manual_seed(self.spec.train.seed + self.rank)
        loss = LossConfig.from_recipe(a, self.spec.task.max_output_len)
        opt = OptimConfig(algorithm=a, trainer=self.spec.settings)
        path = os.path.expanduser(self.spec.model.path)
        dtype = torch_dtype(self.spec.model.dtype, device)
        return Learner(path, loss, opt, device, dtype, lora=self.spec.model.lora)

    def _train(self, driver: RankDriver, svc: DispatchService, publisher: WeightPublisher) -> None:
        from transformers import AutoTokenizer

        from streamrl_cli.tasks import make_task
        from streamrl_cli.tasks.sampler import PromptSampler
        from streamrl_cli.trainer.loop.pipeline import Pipeline, PipelineConfig
        from streamrl_cli.trainer.role.records import Checkpoints, Reporter

        t, task_cfg = self.spec.train, self.spec.task
        path = os.path.expanduser(self.spec.model.path)
        random.seed(t.seed)
        task = make_task(task_cfg, t.seed, model_path=path, agentic=self.spec.agent.enabled)
        sampler = PromptSampler(list(task.prompts()), t.global_batch, t.seed, shuffle=task_cfg.shuffle)
        tok = AutoTokenizer.from_pretrained(path)
        checkpoints = Checkpoints(driver, self.run_dir, t.checkpoint_every, t.keep_checkpoints, t.iterations)
        start = checkpoints.resume(sampler, self.rdv.versions()["current"])
        reporter = Reporter(self.rdv, self._sinks(), t.iterations, self._elastic(svc))
        self.closers.append(reporter)
        ranker = self._ranker(task, t.seed)
        if ranker is not None:
            self.closers.append(ranker)
        evaluator = self._evaluator(task_cfg, t.seed, tok, reporter)
        # What can fail on the recipe's files fails before the wait for the generators.
        tokenize = prompt_tokenizer(tok, task_cfg.max_prompt_len, task, "task.dataset")
        ptl = self._ptl()

        self._wait_serving("generator", self.generators)
        svc.watch(self.rdv)
        data: SampleService = svc
        if self.teachers is not None:
            from streamrl_cli.trainer.loop.distill import TeacherScoring

            self._wait_serving("teacher", self.spec.teacher.instances)
            self.teachers.watch(self.rdv, role="teacher")
            data = TeacherScoring(svc, self.teachers, no_teacher_s=t.stall_after_s)
        self.rdv.set_status(state="training")
        pipe = Pipeline(
            PipelineConfig.from_spec(self.spec), task=task, sampler=sampler,
            tokenize=tokenize,
            detokenize=lambda ids: tok.decode(ids, skip_special_tokens=True), svc=data, driver=driver,
            publisher=publisher, on_record=reporter.iteration, on_checkpoint=checkpoints.save,
            ranker=ranker, ptl=ptl, evaluator=evaluator, stop_requested=self.ends.requested.is_set,
        )  # fmt: skip
        pipe.run(start.iteration, t.iterations, start.version, push_first=start.push_first)
        if t.export_final:
            self._export_final()

    def _elastic(self, svc: DispatchService) -> ElasticController | None:
        """The elastic rule (roles.generator.elastic), or None when it is off."""
        from streamrl_cli.elastic.control import ElasticController

        if not self.elastic.enabled:
            return None
        return ElasticController(self.elastic, self.rdv, lambda: len(svc.generators()))

    def _export_final(self) -> None:
        """The last checkpoint (the final iteration's: always saved) as a HF model in the run directory."""
        from streamrl_cli.trainer.role import checkpoint as ckpt
        from streamrl_cli.trainer.role.export import export_checkpoint

        last = ckpt.latest(self.run_dir)
        if last is None:
            raise StreamRLError(f"train.export_final: {self.run_dir} has no complete checkpoint to export")
        self.rdv.set_status(state="exporting")
        m = self.spec.model
        out = export_checkpoint(last, m.path, RunDir(self.run_dir).exported_model, m.dtype)
        log.info("exported %s as a Hugging Face model to %s", last.name, out)

    def _evaluator(
        self, task_cfg: TaskConfig, seed: int, tok: PreTrainedTokenizerBase, reporter: Reporter
    ) -> Evaluator | None:
        """The held-out evaluation (task.eval_dataset), or None."""
        if not task_cfg.eval_dataset:
            return None
        from streamrl_cli.tasks import make_task
        from streamrl_cli.trainer.loop.evaluation import EvalConfig, Evaluator

        path = os.path.expanduser(self.spec.model.path)
        held_out = make_task(
            dataclasses.replace(task_cfg, dataset=task_cfg.eval_dataset), seed, model_path=path,
            agentic=self.spec.agent.enabled,
        )  # fmt: skip
        cfg = EvalConfig(
            task=task_cfg, algorithm=self.spec.algorithm, train=self.spec.train, agent=self.spec.agent
        )
        tokenize = prompt_tokenizer(tok, task_cfg.max_prompt_len, held_out, "task.eval_dataset")
        return Evaluator(
            held_out, cfg, tokenize=tokenize, on_eval=reporter.evaluation, clock=time.time,
            detokenize=lambda ids: tok.decode(ids, skip_special_tokens=True),
        )  # fmt: skip

    def _ranker(self, task: Task, seed: int) -> Ranker | None:
        from streamrl_cli.ranker.factory import make_ranker

        skew = self.spec.skewness
        base = skew.ranker_model or self.spec.model.path
        return make_ranker(
            skew, model_path=os.path.expanduser(base), task=task, seed=seed, turns=self.spec.agent.enabled
        )

    def _ptl(self) -> PTL | None:
        """The generators' measured decode curve for Algorithm 2 (planner.profile_file), or None."""
        path = self.spec.planner.profile_file
        if not path or self.spec.skewness.dispatch != "skewness-aware":
            return None
        from streamrl_cli.planner.costmodel import ptl_from_profile
        from streamrl_cli.planner.profile import load_profile

        profile = load_profile(path)
        if not profile.decode:
            log.info("%s has no decode curve: Algorithm 2 uses the paper's PTL shape", path)
            return None
        log.info("Algorithm 2 uses the decode curve of %s (%s on %s)", path, profile.model, profile.hardware)
        return ptl_from_profile(profile)

    def _wait_serving(self, role: str, expected: int) -> None:
        """Iteration 0's clock starts when every generator (and distillation teacher) serves (engine
        up, stream connected).

        One that is still starting (not registered yet, or loading its engine) after `WAIT_S` does
        not hold the run: it starts with those serving, and the late one joins a run in progress
        (as a scaled-up instance does). Only a run with none of the role serving fails then.

        A member that left (it failed and said why) is gone, and so is one the server marked lost
        after it had served (killed or stalled: a restarted trainer must not wait for it). One lost
        while still starting is not, yet: a process starting its engine on busy cores can miss its
        heartbeats and come back at its next one; one that died is seen by the run's supervisor,
        which fails the run once none of the role is left.
        """
        deadline = time.monotonic() + WAIT_S
        while True:
            members = self.rdv.members(role)
            # "waiting for weights": up, joined a run in progress; it gets the version pushed first
            served = [m for m in members if m.get("reported_state") in ("generating", "waiting for weights")]
            starting_lost = [m for m in members if m["state"] == "lost" and m not in served]
            alive = [m for m in members if m["state"] == "alive"] + starting_lost
            gone = [m for m in members if m["state"] in ("lost", "left") and m not in starting_lost]
            serving = [m for m in served if m["state"] == "alive"]
            if len(serving) >= expected:
                return
            if serving and len(serving) + len(gone) >= expected and len(alive) == len(serving):
                # One failed at start: the run goes on without it (it may come back, restarted).
                log.warning("starting without %s: failed at start", ", ".join(m["member_id"] for m in gone))
                return
            if gone and not alive and len(gone) >= expected:
                raise StreamRLError(
                    f"no {role} left: every {role} failed at start ("
                    + "; ".join(f"{m['member_id']}: {m.get('last_error') or m['state']}" for m in gone)
                    + ")"
                )
            if time.monotonic() > deadline:
                starting = [f"{m['member_id']} ({m.get('reported_state') or 'registered'})"
                            for m in alive if m not in serving]  # fmt: skip
                missing = expected - len(members)
                if missing > 0:
                    starting.append(f"{missing} not registered")
                if serving:
                    log.warning(
                        "starting with %d of %d %ss serving after %.0fs; still starting: %s "
                        "(they join when they serve)",
                        len(serving), expected, role, WAIT_S, ", ".join(starting),
                    )  # fmt: skip
                    return
                raise StreamRLError(
                    f"no {role} serving after {WAIT_S:.0f}s of {expected} expected; "
                    f"still starting: {', '.join(starting) or '-'}"
                    + "".join(f"; {m['member_id']}: {m.get('last_error') or m['state']}" for m in gone)
                )
            time.sleep(0.5)

    def _sinks(self) -> list[MetricsSink]:
        names = list(self.spec.train.loggers)
        if not names:
            return []
        from streamrl_cli.metrics.sinks import make_sinks

        return make_sinks(names, self.run_dir, self.spec.run_name, self.spec.train.wandb_project)
