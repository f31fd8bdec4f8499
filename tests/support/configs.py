"""The trainer's runtime configs as the trainer builds them: from the recipe's own sections.

Tests name recipe keys by their key alone (``group_size=2, global_batch=4, dispatch="random"``);
:func:`sections` puts each in the schema section that defines it, so a test states only what it
sets and every other key has the schema's default, as in a recipe.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from streamrl_cli.recipe import presets
from streamrl_cli.recipe.schema import (
    AlgorithmConfig,
    GeneratorConfig,
    RolloutConfig,
    SkewnessConfig,
    TaskConfig,
    TrainConfig,
)

SECTIONS: dict[str, type] = {
    "algorithm": AlgorithmConfig,
    "task": TaskConfig,
    "train": TrainConfig,
    "skewness": SkewnessConfig,
    "rollout": RolloutConfig,
    "generator": GeneratorConfig,
}


def sections(**keys: Any) -> dict[str, Any]:
    """{section: its dataclass with the given keys} for every section of SECTIONS."""
    values: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    for key, value in keys.items():
        owners = [n for n, cls in SECTIONS.items() if key in {f.name for f in dataclasses.fields(cls)}]
        assert len(owners) == 1, f"recipe key {key!r} is defined by {owners or 'no section'}: name it alone"
        values[owners[0]][key] = value
    out = {name: cls(**values[name]) for name, cls in SECTIONS.items()}
    presets.fill(out["algorithm"], out["task"].max_output_len)  # as the recipe's checks resolve it
    return out


def pipeline_config(*, world: int = 1, **keys: Any):  # type: ignore[no-untyped-def]
    """A PipelineConfig of recipe keys by name (and the runtime's own no_generator_s, if given)."""
    from streamrl_cli.trainer.loop.pipeline import PipelineConfig

    runtime = {k: keys.pop(k) for k in ("no_generator_s",) if k in keys}
    return PipelineConfig(**sections(**keys), world=world, **runtime)


def optim_config(  # type: ignore[no-untyped-def]
    *,
    zero_stage: int,
    sequence_parallel: int = 1,
    logits_chunk: int | None = None,
    tensor_parallel: int = 1,
    **algorithm: Any,
):
    """The learner's OptimConfig of a ZeRO stage (roles.trainer.zero_stage), a sequence-parallel
    degree, a logits chunk (None: the schema's), a tensor-parallel degree and algorithm keys (lr, ...)."""
    from streamrl_cli.recipe.schema import TrainerConfig
    from streamrl_cli.trainer.role.learner import OptimConfig

    chunk = {} if logits_chunk is None else {"logits_chunk": logits_chunk}
    trainer = TrainerConfig(
        zero_stage=zero_stage, sequence_parallel=sequence_parallel, tensor_parallel=tensor_parallel, **chunk
    )
    return OptimConfig(algorithm=AlgorithmConfig(**algorithm), trainer=trainer)


def sampling(**keys: Any):  # type: ignore[no-untyped-def]
    """A request's Sampling as the trainer builds it from a recipe with the schema's defaults, with
    the given fields (temperature, max_tokens, seed, ignore_eos, ...) set."""
    import msgspec

    from streamrl_cli.trainer.loop.seeds import request_sampling

    return msgspec.structs.replace(request_sampling(AlgorithmConfig(), TaskConfig().max_output_len), **keys)
