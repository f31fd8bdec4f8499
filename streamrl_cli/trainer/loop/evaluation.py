"""Held-out evaluation on the generators, between iterations, without a pause of its own.

::

    iteration i trained ──► weights v = i + 1 confirmed ──► eval requests (low priority) ──► generators
                                                                   │ interleaved with batch i + 1
    metrics.jsonl ◄── eval record ◄── score (task.reward) ◄── every eval sample in ◄──────┘

The pipeline does not wait for an evaluation: its requests go out with the next batch's, at a
priority that lets training requests be admitted first, so they fill the generators' slack (the
trainer's step, the weight transfer, the batch's long tail) instead of a pause. Their samples come
back on the same stream and are set aside here. The one evaluation that is waited for is the final
one, after the last iteration's weights are on the generators.

An eval record stands apart from the iteration records (it has no ``iteration`` key, so readers of
per-iteration records are not confused)::

    {"eval/iteration": 9, "eval/weight_version": 10, "eval/reward_mean": 0.41, "eval/reward_std": 0.2,
     "eval/length_mean": 17.5, "eval/samples": 64, "eval/unscored": 0, "eval/final": false, "eval/t": 3.2}

``eval/iteration`` is the iteration whose weights were evaluated; ``eval/weight_version`` the oldest
version that produced a sample (a sample admitted after the next update runs on newer weights).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from streamrl_cli.recipe.schema import AgentConfig, AlgorithmConfig, TaskConfig, TrainConfig
from streamrl_cli.tasks import Prompt, Task
from streamrl_cli.trainer.loop.seeds import request_sampling, sample_seed
from streamrl_cli.transport.wire import Request, Sample

PREFIX = "eval"
PRIORITY = 1 << 40  # after every training request (vLLM: lower values are admitted first)


@dataclass(kw_only=True)
class EvalConfig:
    """The recipe's sections evaluation runs by (each setting is the schema's, ``recipe.schema``)."""

    # eval_every, eval_samples (the first ones, the same every time), eval_temperature, max_output_len
    task: TaskConfig = field(default_factory=TaskConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)  # the run's other sampling keys
    # seed: each eval prompt is seeded from it, so that evaluations differ only by the weights
    train: TrainConfig = field(default_factory=TrainConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)  # multi-turn: the environment's row, the reward


@dataclass
class _Round:
    iteration: int
    final: bool
    prompts: dict[str, Prompt]  # request id -> prompt
    dispatched_at: float
    samples: dict[str, Sample] = field(default_factory=dict)


class Evaluator:
    """Dispatches evaluation rounds, collects their samples, scores them and emits one record each."""

    def __init__(
        self,
        task: Task,
        cfg: EvalConfig,
        *,
        tokenize: Callable[[str], list[int]],
        detokenize: Callable[[list[int]], str],
        on_eval: Callable[[dict[str, Any]], None],
        clock: Callable[[], float],
    ):
        prompts = list(task.prompts())
        self.task, self.cfg = task, cfg
        self.prompts = prompts[: cfg.task.eval_samples] if cfg.task.eval_samples else prompts
        self.tokenize, self.detokenize = tokenize, detokenize
        self.on_eval, self.clock = on_eval, clock
        self.rounds: dict[str, _Round] = {}
        # Tokenized now: a prompt too long for task.max_prompt_len fails the run before it trains.
        self._tokens = {p.prompt_id: tokenize(p.text) for p in self.prompts}

    def due(self, iteration: int, iterations: int) -> bool:
        """An evaluation after ``iteration`` (the last one always gets the final evaluation instead)."""
        e = self.cfg.task.eval_every
        return e > 0 and (iteration + 1) % e == 0 and iteration + 1 < iterations

    def dispatch(self, iteration: int, *, final: bool = False) -> list[Request]:
        key = f"{PREFIX}{iteration}"
        rnd = _Round(iteration=iteration, final=final, prompts={}, dispatched_at=self.clock())
        requests = []
        task, seed = self.cfg.task, self.cfg.train.seed
        common = msgspec.structs.replace(
            request_sampling(self.cfg.algorithm, task.max_output_len), temperature=task.eval_temperature
        )
        for p in self.prompts:
            tokens = self._tokens[p.prompt_id]
            rid = f"{key}/{p.prompt_id}"
            rnd.prompts[rid] = p
            sampling = msgspec.structs.replace(common, seed=sample_seed(seed, f"{PREFIX}/{p.prompt_id}", 0))
            requests.append(
                Request(
                    prompt_id=rid,
                    prompt_token_ids=tokens,
                    sample_indices=[0],
                    group_id=rid,
                    priority=PRIORITY,
                    sampling=sampling,
                    env={**p.columns, "prompt": p.text} if self.cfg.agent.enabled else {},
                )  # fmt: skip
            )
        self.rounds[key] = rnd
        return requests

    @staticmethod
    def owns(prompt_id: str) -> bool:
        head = prompt_id.split("/", 1)[0]
        return head.startswith(PREFIX) and head[len(PREFIX) :].isdigit()

    @property
    def pending(self) -> bool:
        return bool(self.rounds)

    def add(self, sample: Sample) -> None:
        rnd = self.rounds.get(sample.prompt_id.split("/", 1)[0])
        if rnd is None or sample.prompt_id not in rnd.prompts:
            return  # a duplicate of a round already recorded
        rnd.samples[sample.prompt_id] = sample
        if len(rnd.samples) == len(rnd.prompts):
            del self.rounds[sample.prompt_id.split("/", 1)[0]]
            self.on_eval(self._record(rnd))

    def _record(self, rnd: _Round) -> dict[str, Any]:
        rids = list(rnd.prompts)
        samples = [rnd.samples[r] for r in rids]
        from streamrl_cli.trainer.loop.samples import trajectory_rewards

        texts = [self.detokenize(s.token_ids) for s in samples]
        scores = trajectory_rewards(self.cfg.agent, self.task, [rnd.prompts[r] for r in rids], samples, texts)
        scored = [float(x) for x in scores if x is not None]
        lengths = [len(s.token_ids) for s in samples]
        return {
            "eval/iteration": rnd.iteration,
            "eval/weight_version": min(s.weight_version for s in samples),
            "eval/reward_mean": statistics.fmean(scored) if scored else None,
            "eval/reward_std": statistics.pstdev(scored) if scored else None,
            "eval/length_mean": statistics.fmean(lengths),
            "eval/samples": len(samples),
            "eval/unscored": len(samples) - len(scored),
            "eval/final": rnd.final,
            "eval/t": self.clock() - rnd.dispatched_at,
        }
