"""What the trainer's loop runs by (``PipelineConfig``): the recipe's sections as the trainer spec
carries them, and what follows from them (the requests' sampling, refill and over-sampling budgets,
how far dispatch runs ahead). Its own module so that the parts of the loop read it without
importing the loop (``trainer.loop.pipeline``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from streamrl_cli.recipe import presets
from streamrl_cli.recipe.schema import (
    AgentConfig,
    AlgorithmConfig,
    GeneratorConfig,
    RolloutConfig,
    SkewnessConfig,
    TaskConfig,
    TrainConfig,
)
from streamrl_cli.trainer.loop.seeds import request_sampling
from streamrl_cli.transport.wire import Sampling

if TYPE_CHECKING:
    from streamrl_cli.roles.spec import TrainerSpec


@dataclass(kw_only=True)
class PipelineConfig:
    """What the loop runs by: the recipe's sections as they are (each setting's name, type, default
    and meaning are the schema's, ``recipe.schema``), and what only the trainer knows at run time.
    Build it with :meth:`from_spec`; a section left out has the schema's defaults (tests)."""

    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)  # preset resolved (checks.resolve)
    task: TaskConfig = field(default_factory=TaskConfig)  # max_output_len
    train: TrainConfig = field(default_factory=TrainConfig)  # batch sizes, seed, reproducible_sampling
    skewness: SkewnessConfig = field(default_factory=SkewnessConfig)  # dispatch, schedule, long_tail
    rollout: RolloutConfig = field(default_factory=RolloutConfig)  # oversample, partial
    agent: AgentConfig = field(default_factory=AgentConfig)  # multi-turn: reward, on_failure
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)  # max_num_seqs: admission bound
    # Micro-batches per round: the trainer's data-parallel width (its ranks / sequence_parallel /
    # tensor_parallel: the ranks of one sequence- or tensor-parallel group share a micro-batch).
    world: int = 1
    # No generator connected for this long ends the run (not at once: a restarted array task, or an
    # elastic scale-up after scaling to zero, comes back): train.stall_after_s unless set (tests set
    # it apart from the sample timeout, which would end the run first).
    no_generator_s: float | None = None

    def __post_init__(self) -> None:
        presets.require_resolved(self.algorithm, "the trainer's loop")
        if self.no_generator_s is None:
            self.no_generator_s = self.train.stall_after_s

    @property
    def sample_timeout_s(self) -> float:
        """No sample at all for this long: something is wrong (train.stall_after_s)."""
        return self.train.stall_after_s

    @classmethod
    def from_spec(cls, spec: TrainerSpec) -> PipelineConfig:
        """The pipeline of the trainer's typed sections."""
        return cls(
            algorithm=spec.algorithm, task=spec.task, train=spec.train, skewness=spec.skewness,
            rollout=spec.rollout, generator=spec.generator, agent=spec.agent,
            world=spec.world // (spec.settings.sequence_parallel * spec.settings.tensor_parallel),
        )  # fmt: skip

    @property
    def sampling(self) -> Sampling:
        """A training request's sampling (unseeded, the whole output budget): the recipe's keys."""
        return request_sampling(self.algorithm, self.task.max_output_len)

    @property
    def refill_budget(self) -> int:
        """Groups an iteration may draw to replace dropped ones (algorithm.max_refill)."""
        return math.floor(self.train.global_batch * self.algorithm.max_refill + 1e-9)

    @property
    def extra_groups(self) -> int:
        """Groups dispatched beyond global_batch per iteration (rollout.oversample)."""
        over = self.rollout.oversample
        return math.ceil(self.train.global_batch * over - 1e-9) if over > 0 else 0

    @property
    def ahead(self) -> int:
        return self.algorithm.max_staleness if self.algorithm.mode == "async" else 0

    @property
    def bound(self) -> int:
        """The most versions a trained sample's oldest token may lag its batch's policy."""
        return self.algorithm.max_staleness if self.rollout.partial else self.ahead
