"""The distillation teacher role: a generator instance that scores the policy's tokens instead of sampling.

On-policy distillation (``algorithm.distill_coef``) gives each token the policy sampled a dense
signal: how likely the teacher model finds it. The teacher is a pool of its own
(``roles.teacher``: any cluster, any GPU kind), and each instance is this role: the generator's
process (rendezvous membership, sample stream, trainer restarts, SIGTERM and SLURM's USR2, engine
health) with three differences:

* its model is fixed: it never loads weight versions, and serves from its start;
* a request's prompt is the policy's prompt followed by the tokens it sampled; the engine
  generates one token and scores the prompt (``SamplingSpec.prompt_logprobs``), and the answer is
  one sample whose ``logprobs`` are those scores, one per sequence token;
* it streams to the trainer's ``teacher`` address, where the trainer's own dispatcher keeps what
  each teacher owes: a teacher lost has its requests dispatched again to the others.

Before it serves, it checks that its tokenizer is the policy's: it scores token ids, which mean the
same only under one vocabulary.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from streamrl_cli.errors import StreamRLError
from streamrl_cli.generator.engine import GenerationResult, SamplingSpec, make_engine
from streamrl_cli.generator.main import GeneratorRole, instance_engine, run_role
from streamrl_cli.roles.spec import TeacherSpec
from streamrl_cli.transport.wire import Sample

log = logging.getLogger("streamrl.teacher")


def main(spec: TeacherSpec, rank: int) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    return run_role(TeacherRole(spec, rank))


def engine_kwargs(spec: TeacherSpec, rank: int = 0) -> dict[str, Any]:
    """The teacher's engine: its own model, the policy's dtype, room for the longest prompt plus the
    longest output plus the one token it generates."""
    length = spec.task.max_prompt_len + spec.task.max_output_len + 1
    return instance_engine(spec, rank, spec.settings.model.path or "", length)


class FixedWeights:
    """The teacher's weights never change: no weight group to join, no version to take part in."""

    def addresses(self) -> dict[str, str]:
        return {}

    def concerns_us(self, proposal: dict[str, Any]) -> bool:
        return False

    def takes_part(self, proposal: dict[str, Any]) -> bool:
        return False

    def orphaned(self) -> dict[str, Any] | None:
        return None

    async def update(self, version: int, proposal: dict[str, Any] | None = None) -> dict[str, Any]:
        raise StreamRLError("a distillation teacher serves a fixed model: it loads no weight versions")

    def close(self) -> None:
        pass


class TeacherRole(GeneratorRole):
    """One teacher instance (see the module docstring)."""

    role = "teacher"
    stream = "teacher"
    follows_weights = False

    def __init__(self, spec: TeacherSpec, rank: int, *, engine: Any = None):
        if engine is None:
            engine = make_engine("vllm", **engine_kwargs(spec, rank))
        super().__init__(spec, rank, engine=engine)
        # One token is generated (an engine request must generate something); the prompt is scored.
        # At temperature 1: the teacher's own distribution, whatever the policy samples at.
        self.scoring = SamplingSpec(max_tokens=1, temperature=1.0, prompt_logprobs=True)

    def ensure_model(self) -> None:
        from streamrl_cli.models.fingerprint import vocabulary_fingerprint
        from streamrl_cli.models.warmup import ensure_model, ensure_teacher

        teacher = ensure_teacher(self.spec.settings.model, self.spec.task)
        policy = ensure_model(self.spec.model, self.spec.task)  # a built-in policy is made by the first role
        if vocabulary_fingerprint(teacher) != vocabulary_fingerprint(policy):
            raise StreamRLError(
                f"the teacher's tokenizer ({teacher}) differs from the policy's ({policy}): on-policy "
                "distillation scores the policy's token ids, so both models must share one vocabulary"
            )

    def make_weights(self, token: str) -> Any:
        return FixedWeights()

    def samples(self, result: GenerationResult) -> list[Sample]:
        """One answer per scoring request: the log-prob of every token of the sequence it was sent."""
        meta = result.meta
        # A request the engine refused (say, longer than its context) is answered as an error: the
        # trainer must not wait for it for ever, nor train on made-up scores; it fails loudly there.
        failed = bool(result.error) or not result.prompt_logprobs
        return [
            Sample(
                prompt_id=meta["prompt_id"],
                sample_index=i,
                group_id=meta.get("group_id", ""),
                token_ids=[],
                logprobs=[] if failed else list(result.prompt_logprobs),
                finish_reason="error" if failed else "stop",
                weight_version=0,
                generator=self.member_id,
                queued_at=result.queued_at,
                first_token_at=result.first_token_at,
                finished_at=result.finished_at,
            )
            for i in meta["sample_indices"]
        ]

    def _info(self) -> dict[str, Any]:
        return {
            "program": "teacher",
            "engine": "vllm",
            "model": self.spec.settings.model.name,
            "model_path": str(Path(self.spec.settings.model.path or "").expanduser()),
            "pid": os.getpid(),
        }
