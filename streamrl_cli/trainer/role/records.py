"""What rank 0 does with each iteration once the loop is done with it: its record goes to the
rendezvous, the metrics sinks and the log (``Reporter``), and its checkpoint to the run directory
(``Checkpoints``, which also finds where a started-again trainer resumes).

The loop (``trainer.loop.pipeline``) calls them through its ``on_record``/``on_checkpoint`` hooks
and the evaluator through ``on_eval``; they hold the little state those need between calls (the
latest iteration recorded, the checkpoint cadence), so the trainer role wires objects, not closures.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from streamrl_cli.trainer.role import checkpoint as ckpt

if TYPE_CHECKING:
    from streamrl_cli.elastic.control import ElasticController
    from streamrl_cli.metrics.sinks import MetricsSink
    from streamrl_cli.rendezvous import RendezvousClient
    from streamrl_cli.tasks.sampler import PromptSampler
    from streamrl_cli.trainer.role.ranks import RankDriver

log = logging.getLogger("streamrl.trainer")


def _round(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits)


class Reporter:
    """Iteration and evaluation records: to the rendezvous (metrics, and the progress `streamrl
    status` shows), to the metrics sinks, and one log line each. The elastic rule, when on, runs
    after each iteration and its decision joins the record."""

    def __init__(
        self, rdv: RendezvousClient, sinks: list[MetricsSink], iterations: int,
        elastic: ElasticController | None,
    ):  # fmt: skip
        self.rdv, self.sinks, self.iterations, self.elastic = rdv, sinks, iterations, elastic
        self.last_step = 0  # the latest iteration recorded (an evaluation is logged at it)

    def iteration(self, rec: dict[str, Any]) -> None:
        i = rec["iteration"]
        if self.elastic is not None:
            rec = {**rec, **self.elastic.after_iteration(rec)}
        bad = [k for k, v in rec.items() if isinstance(v, float) and not math.isfinite(v)]
        if bad:  # JSON has no NaN/inf: recorded as null, and said once in the log
            log.warning("iteration %d: non-finite %s", i, ", ".join(f"{k}={rec[k]}" for k in bad))
            rec = {**rec, **dict.fromkeys(bad)}
        self.rdv.post_metrics(rec)
        self.rdv.post_progress(
            i + 1, iterations=self.iterations, reward=_round(rec["reward_mean"], 4),
            samples_per_s=round(rec["samples_per_s"], 2), trainer_idle=round(rec["idle/trainer"], 3),
            generator_idle=round(rec["idle/generator"], 3), mode=rec["mode"],
            **({"ranker_recall20": round(rec["ranker/recall@20"], 3)} if "ranker/recall@20" in rec else {}),
        )  # fmt: skip
        self.last_step = i
        for sink in self.sinks:
            sink.log(rec, i)
        log.info("iteration %d: reward %s, %.1f samples/s, trainer idle %.0f%%, generator idle %.0f%%",
                 i, _round(rec["reward_mean"], 3), rec["samples_per_s"], 100 * rec["idle/trainer"],
                 100 * rec["idle/generator"])  # fmt: skip

    def evaluation(self, rec: dict[str, Any]) -> None:
        self.rdv.post_metrics(rec)
        # progress is merged, not replaced: `streamrl status` shows the latest eval reward
        self.rdv.post_progress(
            self.last_step + 1, eval_reward=_round(rec["eval/reward_mean"], 4),
            eval_iteration=rec["eval/iteration"],
        )  # fmt: skip
        # W&B drops steps older than its latest: an evaluation finishes during a later iteration
        step = max(rec["eval/iteration"], self.last_step)
        for sink in self.sinks:
            sink.log(rec, step)
        kind = "final" if rec["eval/final"] else "periodic"
        log.info("evaluation of iteration %d (%s): reward %s over %d prompts, mean length %.1f",
                 rec["eval/iteration"], kind, _round(rec["eval/reward_mean"], 3), rec["eval/samples"],
                 rec["eval/length_mean"])  # fmt: skip

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


@dataclass(frozen=True)
class ResumePoint:
    """Where the loop starts: its first iteration, the weight version it publishes next, and whether
    it pushes its weights before dispatching (the generators serve others than its own)."""

    iteration: int = 0
    version: int = 0
    push_first: bool = False


@dataclass
class Checkpoints:
    """The run's checkpoints: saved every `every` iterations, at the last one, and when the run is
    stopping (SLURM's warning, a cancel); the newest `keep` kept."""

    driver: RankDriver
    run_dir: Path
    every: int
    keep: int
    iterations: int

    def save(self, i: int, state: dict[str, Any], stopping: bool) -> None:
        if stopping or (self.every and (i + 1) % self.every == 0) or i + 1 == self.iterations:
            path = ckpt.checkpoint_dir(self.run_dir, i)
            self.driver.save(path, {**state, "rng": ckpt.rng_state()})
            ckpt.prune(self.run_dir, self.keep)

    def resume(self, sampler: PromptSampler, current_version: int | None) -> ResumePoint:
        """From the newest checkpoint (the engines, the sampler's position, the RNGs), or from the
        model on disk. `current_version`: the newest weight version the rendezvous has seen (None:
        none yet). A trainer started again serves after it, as a newer version."""
        latest = ckpt.latest(self.run_dir)
        if latest is not None:
            state = self.driver.load(latest)
            sampler.load_state(state["sampler"])
            ckpt.set_rng_state(state["rng"])
            # The rendezvous may have seen newer versions than the checkpoint's (the run went on after it).
            version = max(int(state["weight_version"]), (current_version or 0) + 1)
            log.info(
                "resuming from %s: iteration %d, weight version %d", latest, state["next_iteration"], version
            )
            return ResumePoint(int(state["next_iteration"]), version, True)
        if current_version:
            # Restarted before any checkpoint: the generators serve weights this process no longer
            # has, so it starts over from the model on disk and pushes it first, as a newer version.
            log.info(
                "starting over (no checkpoint yet): the model on disk as weight version %d",
                current_version + 1,
            )
            return ResumePoint(0, current_version + 1, True)
        return ResumePoint()
