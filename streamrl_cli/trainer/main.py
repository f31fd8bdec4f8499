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

import logging
import math
import os
import random
import socket
import time
from pathlib import Path
from typing import Any

from streamrl_cli.errors import StreamRLError
from streamrl_cli.launch.plan import RoleSpec

log = logging.getLogger("streamrl.trainer")

WAIT_S = 600.0


def main(spec: RoleSpec, rank: int) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per rendezvous call otherwise
    return TrainerRole(spec, rank).run()


def sampling_keys(a: dict[str, Any]) -> dict[str, Any]:
    """The recipe's sampling keys beyond temperature that differ from "off", as requests carry them."""
    out: dict[str, Any] = {}
    if int(a.get("top_k", 0)) > 0:
        out["top_k"] = int(a["top_k"])
    if float(a.get("top_p", 1.0)) < 1.0:
        out["top_p"] = float(a["top_p"])
    if float(a.get("min_p", 0.0)) > 0.0:
        out["min_p"] = float(a["min_p"])
    if a.get("stop"):
        out["stop"] = [str(x) for x in a["stop"]]
    return out


def _round(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class TrainerRole:
    def __init__(self, spec: RoleSpec, rank: int):
        self.spec, self.rank = spec, rank
        self.run_dir = Path(spec.run_dir)
        self.rdv: Any = None
        self.closers: list[Any] = []
        self._last_step = 0  # the latest iteration recorded (eval records are logged at it)

    def run(self) -> int:
        from streamrl_cli.rendezvous import RendezvousClient, read_secret
        from streamrl_cli.roles.preflight import wait_for_file

        wait_for_file(Path(self.spec.rendezvous_file), WAIT_S)
        self.rdv = RendezvousClient.from_run_dir(self.run_dir, tls_ca=self.spec.rendezvous_ca)
        self.token = read_secret(self.run_dir)
        try:
            return self._run()
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
            torch.set_num_threads(max(1, int(self.spec.settings.get("cpus_per_task", 1))))
        backend = "nccl" if cuda else "gloo"
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
        world = self.spec.world
        host = socket.gethostname()
        addresses: dict[str, str] = {}
        info: dict[str, Any] = {"program": "trainer", "pid": os.getpid(), "device": str(device)}
        if self.rank == 0:
            from streamrl_cli.models.warmup import ensure_model

            ensure_model(self.spec.model, self.spec.task)
            svc, publisher = self._data_plane(backend if cuda else "gloo")
            addresses.update(samples=svc.address.replace("0.0.0.0", host), **publisher.addresses())
            info.update(publisher.info())
            addresses["dist"] = f"{host if world > 1 else '127.0.0.1'}:{free_port()}"
        self.rdv.register("trainer", self.rank, cluster=self.spec.cluster, site=self.spec.site, host=host,
                          addresses=addresses, info=info)  # fmt: skip
        self.rdv.start_heartbeat()
        self.rdv.set_status(state="starting")
        master = addresses["dist"] if self.rank == 0 else self._rank0()["addresses"]["dist"]
        from streamrl_cli.trainer.learner import init_distributed, leave_group

        init_distributed(self.rank, world, master, backend)
        learner = self._learner(device)
        from streamrl_cli.trainer.ranks import RankDriver, follow

        if self.rank != 0:
            self.rdv.set_status(state="training")
            code = follow(learner, self.rank)
            leave_group()
            self.rdv.leave("stopped")
            return code
        driver = RankDriver(learner, world)
        try:
            self._train(driver, svc, publisher)
        finally:
            driver.stop()
        leave_group()
        self.rdv.leave("stopped")
        return 0

    def _data_plane(self, backend: str) -> tuple[Any, Any]:
        from streamrl_cli.roles.entry import load_spec
        from streamrl_cli.trainer.publish import WeightPublisher
        from streamrl_cli.transport.dispatch import DispatchService
        from streamrl_cli.transport.samples import StreamConfig

        gen = load_spec(self.run_dir / "roles" / "generator.yaml")
        svc = DispatchService(StreamConfig(), self.token)
        self.closers.append(svc)
        workers = gen.world * int(gen.settings.get("tensor_parallel", 1))
        publisher = WeightPublisher(
            self.rdv, self.token, transport=gen.weight_transport, generator_workers=workers, backend=backend
        )
        self.closers.append(publisher)
        self.generators = gen.world
        return svc, publisher

    def _rank0(self) -> dict[str, Any]:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            for m in self.rdv.members("trainer"):
                if m["rank"] == 0 and m["state"] == "alive" and m.get("addresses", {}).get("dist"):
                    return m
            time.sleep(0.5)
        raise StreamRLError(f"trainer rank 0 did not publish its address within {WAIT_S:.0f}s")

    def _learner(self, device: Any) -> Any:
        import torch

        from streamrl_cli.trainer.learner import Learner, LossConfig, OptimConfig
        from streamrl_cli.trainer.models import torch_dtype

        a, settings = self.spec.algorithm, self.spec.settings
        torch.manual_seed(int(self.spec.train.get("seed", 0)) + self.rank)
        loss = LossConfig.from_recipe(a, int(self.spec.task["max_output_len"]))
        opt = OptimConfig(
            zero_stage=int(settings.get("zero_stage", 1)), lr=float(a["lr"]), critic_lr=float(a["critic_lr"]),
            weight_decay=float(a["weight_decay"]), max_grad_norm=float(a["max_grad_norm"]),
        )  # fmt: skip
        path = os.path.expanduser(self.spec.model["path"])
        return Learner(path, loss, opt, device, torch_dtype(self.spec.model.get("dtype", "float32"), device))

    def _train(self, driver: Any, svc: Any, publisher: Any) -> None:
        from transformers import AutoTokenizer

        from streamrl_cli.tasks import make_task
        from streamrl_cli.tasks.sampler import PromptSampler
        from streamrl_cli.trainer import checkpoint as ckpt
        from streamrl_cli.trainer.pipeline import Pipeline, PipelineConfig

        a, t, task_cfg, skew = self.spec.algorithm, self.spec.train, self.spec.task, self.spec.skewness
        seed = int(t.get("seed", 0))
        random.seed(seed)
        task = make_task(task_cfg, seed, model_path=os.path.expanduser(self.spec.model["path"]))
        sampler = PromptSampler(list(task.prompts()), int(t["global_batch"]), seed)
        tok = AutoTokenizer.from_pretrained(os.path.expanduser(self.spec.model["path"]))
        max_prompt = int(task_cfg["max_prompt_len"])

        def tokenize(text: str) -> list[int]:
            ids = tok(text, add_special_tokens=False)["input_ids"]
            if len(ids) > max_prompt:
                raise StreamRLError(
                    f"a prompt has {len(ids)} tokens, more than task.max_prompt_len={max_prompt}"
                )
            return ids

        start, version, push = 0, 0, False
        latest = ckpt.latest(self.run_dir)
        if latest is not None:
            state = driver.load(latest)
            sampler.load_state(state["sampler"])
            ckpt.set_rng_state(state["rng"])
            start, push = int(state["next_iteration"]), True
            # The rendezvous may have seen newer versions than the checkpoint's (the run went on after it).
            current = self.rdv.versions()["current"]
            version = max(int(state["weight_version"]), (current or 0) + 1)
            log.info("resuming from %s: iteration %d, weight version %d", latest, start, version)
        iterations = int(t["iterations"])
        cfg = PipelineConfig(
            mode=a["mode"], algorithm=a["name"], group_size=int(a["group_size"]),
            global_batch=int(t["global_batch"]), micro_batch=int(t["micro_batch"]), world=self.spec.world,
            max_staleness=int(a["max_staleness"]), max_output_len=int(task_cfg["max_output_len"]),
            temperature=float(a.get("temperature", 1.0)), sampling=sampling_keys(a),
            grpo_std_norm=bool(a.get("grpo_std_norm", True)),
            seed=seed, dispatch=skew.get("dispatch", "random"), schedule=skew.get("schedule", "fifo"),
            long_tail=float(skew.get("long_tail", 0.2)), engine_max_seqs=self.spec.generator_max_seqs,
            reproducible=bool(t.get("reproducible_sampling", False)),
        )  # fmt: skip
        ranker = self._ranker(task, seed)
        sinks = self._sinks()
        evaluator = self._evaluator(task_cfg, seed, tokenize, tok, sinks)
        every, keep = int(t.get("checkpoint_every", 0)), int(t.get("keep_checkpoints", 2))

        def on_record(rec: dict[str, Any]) -> None:
            i = rec["iteration"]
            bad = [k for k, v in rec.items() if isinstance(v, float) and not math.isfinite(v)]
            if bad:  # JSON has no NaN/inf: recorded as null, and said once in the log
                log.warning("iteration %d: non-finite %s", i, ", ".join(f"{k}={rec[k]}" for k in bad))
                rec = {**rec, **dict.fromkeys(bad)}
            self.rdv.post_metrics(rec)
            self.rdv.post_progress(
                i + 1, iterations=iterations, reward=_round(rec["reward_mean"], 4),
                samples_per_s=round(rec["samples_per_s"], 2), trainer_idle=round(rec["idle/trainer"], 3),
                generator_idle=round(rec["idle/generator"], 3), mode=rec["mode"],
                **({"ranker_recall20": round(rec["ranker/recall@20"], 3)} if "ranker/recall@20" in rec
                   else {}),
            )  # fmt: skip
            self._last_step = i
            for sink in sinks:
                sink.log(rec, i)
            log.info("iteration %d: reward %s, %.1f samples/s, trainer idle %.0f%%, generator idle %.0f%%",
                     i, _round(rec["reward_mean"], 3), rec["samples_per_s"], 100 * rec["idle/trainer"],
                     100 * rec["idle/generator"])  # fmt: skip

        def on_checkpoint(i: int, state: dict[str, Any]) -> None:
            if (every and (i + 1) % every == 0) or i + 1 == iterations:
                path = ckpt.checkpoint_dir(self.run_dir, i)
                driver.save(path, {**state, "rng": ckpt.rng_state()})
                ckpt.prune(self.run_dir, keep)

        self._wait_generators_serving()
        svc.watch(self.rdv)
        self.rdv.set_status(state="training")
        pipe = Pipeline(
            cfg, task=task, sampler=sampler, tokenize=tokenize,
            detokenize=lambda ids: tok.decode(ids, skip_special_tokens=True), svc=svc, driver=driver,
            publisher=publisher, on_record=on_record, on_checkpoint=on_checkpoint, ranker=ranker,
            evaluator=evaluator,
        )  # fmt: skip
        try:
            pipe.run(start, iterations, version, push_first=push)
            if t.get("export_final", True):
                self._export_final()
        finally:
            for sink in sinks:
                sink.close()
            if ranker is not None:
                ranker.close()

    def _export_final(self) -> None:
        """The last checkpoint (the final iteration's: always saved) as a HF model in the run directory."""
        from streamrl_cli.trainer import checkpoint as ckpt
        from streamrl_cli.trainer.export import EXPORT_DIR, export_checkpoint

        last = ckpt.latest(self.run_dir)
        if last is None:
            raise StreamRLError(f"train.export_final: {self.run_dir} has no complete checkpoint to export")
        self.rdv.set_status(state="exporting")
        m = self.spec.model
        out = export_checkpoint(last, m["path"], self.run_dir / EXPORT_DIR, m.get("dtype") or "float32")
        log.info("exported %s as a Hugging Face model to %s", last.name, out)

    def _evaluator(self, task_cfg: dict, seed: int, tokenize: Any, tok: Any, sinks: list[Any]) -> Any:
        """The held-out evaluation (task.eval_dataset), or None."""
        if not task_cfg.get("eval_dataset"):
            return None
        from streamrl_cli.tasks import make_task
        from streamrl_cli.trainer.evaluation import EvalConfig, Evaluator

        a = self.spec.algorithm
        path = os.path.expanduser(self.spec.model["path"])
        held_out = make_task({**task_cfg, "dataset": task_cfg["eval_dataset"]}, seed, model_path=path)
        cfg = EvalConfig(
            every=int(task_cfg.get("eval_every", 0)), samples=task_cfg.get("eval_samples"),
            temperature=float(task_cfg.get("eval_temperature", 0.0)),
            max_tokens=int(task_cfg["max_output_len"]), sampling=sampling_keys(a), seed=seed,
        )  # fmt: skip

        def on_eval(rec: dict[str, Any]) -> None:
            self.rdv.post_metrics(rec)
            # progress is merged, not replaced: `streamrl status` shows the latest eval reward
            self.rdv.post_progress(
                self._last_step + 1, eval_reward=_round(rec["eval/reward_mean"], 4),
                eval_iteration=rec["eval/iteration"],
            )  # fmt: skip
            # W&B drops steps older than its latest: an evaluation finishes during a later iteration
            step = max(rec["eval/iteration"], self._last_step)
            for sink in sinks:
                sink.log(rec, step)
            kind = "final" if rec["eval/final"] else "periodic"
            log.info("evaluation of iteration %d (%s): reward %s over %d prompts, mean length %.1f",
                     rec["eval/iteration"], kind, _round(rec["eval/reward_mean"], 3), rec["eval/samples"],
                     rec["eval/length_mean"])  # fmt: skip

        def detokenize(ids: list[int]) -> str:
            return tok.decode(ids, skip_special_tokens=True)

        return Evaluator(
            held_out, cfg, tokenize=tokenize, detokenize=detokenize, on_eval=on_eval, clock=time.time
        )

    def _ranker(self, task: Any, seed: int) -> Any:
        from streamrl_cli.ranker.base import make_ranker

        skew = self.spec.skewness
        base = skew.get("ranker_model") or self.spec.model["path"]
        return make_ranker(skew, model_path=os.path.expanduser(base), task=task, seed=seed)

    def _wait_generators_serving(self) -> None:
        """Iteration 0's clock starts when every generator serves (engine up, stream connected)."""
        self.rdv.wait_for("generator", self.generators, timeout=WAIT_S)
        deadline = time.monotonic() + WAIT_S
        while True:
            alive = [m for m in self.rdv.members("generator") if m["state"] == "alive"]
            # "waiting for weights": up, joined a run in progress; it gets the version pushed first
            serving = [m for m in alive if m.get("reported_state") in ("generating", "waiting for weights")]
            if len(serving) >= self.generators:
                return
            if time.monotonic() > deadline:
                raise StreamRLError(
                    f"{len(serving)} of {self.generators} generators serving after {WAIT_S:.0f}s "
                    f"(states: {sorted(m.get('reported_state') or '-' for m in alive)})"
                )
            time.sleep(0.5)

    def _sinks(self) -> list[Any]:
        names = list(self.spec.train.get("loggers") or [])
        if not names:
            return []
        from streamrl_cli.metrics.sinks import make_sinks

        return make_sinks(
            names, self.run_dir, self.spec.run_name, self.spec.train.get("wandb_project", "streamrl")
        )
