"""The workload W of one RL iteration, as the cost model sees it, derived from a recipe.

The planner must not depend on the whole recipe tree (or on OmegaConf): it gets the few numbers
that set the cost of an iteration — model shape, samples per iteration, prompt and output
lengths, algorithm and pipelining mode — in small frozen dataclasses, built here once.
"""

from __future__ import annotations

from dataclasses import dataclass

from streamrl_cli.planner import PlannerError
from streamrl_cli.planner.lengths import LengthDist
from streamrl_cli.recipe.presets import uses_critic
from streamrl_cli.recipe.schema import Recipe

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    """Architecture numbers the cost model needs."""

    name: str
    params: float  # parameter count
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    dtype_bytes: int  # bytes per weight and activation element

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V of every layer for one token (all KV heads)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def optimizer_bytes_per_param(self) -> int:
        # Adam's m and v in fp32, plus an fp32 master copy when training in 16-bit.
        return 8 if self.dtype_bytes == 4 else 12


@dataclass(frozen=True)
class Workload:
    """One iteration's work: `prompts × group_size` samples, lengths drawn from `lengths`."""

    model: ModelShape
    # ppo: actor and critic trained, a reference; any other name (grpo, dapo, ...): no critic.
    algorithm: str
    mode: str  # baseline | sync-stream | async
    prompts: int  # prompts per iteration (train.global_batch)
    group_size: int  # samples per prompt
    prompt_len: float  # mean prompt tokens
    max_prompt_len: int
    lengths: LengthDist  # output tokens
    micro_batch: int  # samples per forward/backward (sets the trainer's micro-batch token budget)
    staleness: int = 1  # async: policy versions a sample may lag

    @property
    def samples(self) -> int:
        return self.prompts * self.group_size

    @property
    def seq_mean(self) -> float:
        return self.prompt_len + self.lengths.mean

    @property
    def max_seq(self) -> int:
        return self.max_prompt_len + self.lengths.max_len

    @property
    def tokens(self) -> float:
        """Tokens the trainer processes per iteration."""
        return self.samples * self.seq_mean

    @property
    def attention_ctx(self) -> float:
        """Token-weighted mean causal context of training sequences: E[s²] / (2 E[s])."""
        p, d = self.prompt_len, self.lengths
        second = p * p + 2 * p * d.mean + d.second_moment
        return second / (2 * self.seq_mean)

    @property
    def trained_models(self) -> int:
        return 2 if self.algorithm == "ppo" else 1

    @property
    def frozen_forwards(self) -> int:
        # PPO: reference log-probs and the critic's values before its update; GRPO: reference only.
        return 2 if self.algorithm == "ppo" else 1


def _without_critic(name: str) -> str:
    """The algorithm's name for the cost model when it trains no critic (`ppo` means one)."""
    return "grpo" if name == "ppo" else name


def model_from_recipe(r: Recipe) -> ModelShape:
    m = r.model
    if m.params_b <= 0:
        raise PlannerError(f"model.params_b must be positive for tune-split, got {m.params_b}")
    if m.hidden_size % m.num_attention_heads:
        raise PlannerError(
            f"model.hidden_size {m.hidden_size} is not a multiple of {m.num_attention_heads} heads"
        )
    return ModelShape(
        name=m.name,
        params=m.params_b * 1e9,
        layers=m.num_layers,
        hidden=m.hidden_size,
        heads=m.num_attention_heads,
        kv_heads=m.num_kv_heads,
        dtype_bytes=DTYPE_BYTES[m.dtype],
    )


def workload_from_recipe(r: Recipe, mode: str | None = None) -> Workload:
    """The recipe's workload; ``mode`` overrides algorithm.mode (what-if comparisons)."""
    t = r.task
    mode_len = t.output_len_mode if t.output_len_mode is not None else max(1, t.max_output_len // 10)
    problems = []
    if not 0 < mode_len <= t.max_output_len:
        problems.append(
            f"task.output_len_mode: must be in 1..max_output_len={t.max_output_len}, got {mode_len}"
        )
    if not 0 <= t.output_len_tail <= 1:
        problems.append(f"task.output_len_tail: a fraction in [0, 1], got {t.output_len_tail}")
    if t.output_len_spread <= 0:
        problems.append(f"task.output_len_spread: must be positive, got {t.output_len_spread}")
    prompt = t.prompt_len_mean if t.prompt_len_mean is not None else t.max_prompt_len / 2
    if not 0 < prompt <= t.max_prompt_len:
        problems.append(
            f"task.prompt_len_mean: must be in 1..max_prompt_len={t.max_prompt_len}, got {prompt}"
        )
    if problems:
        raise PlannerError("the recipe's workload cannot be modelled:\n  - " + "\n  - ".join(problems))
    return Workload(
        model=model_from_recipe(r),
        algorithm="ppo" if uses_critic(r.algorithm) else _without_critic(r.algorithm.name),
        mode=mode or r.algorithm.mode,
        prompts=r.train.global_batch,
        group_size=r.algorithm.group_size,
        prompt_len=float(prompt),
        max_prompt_len=t.max_prompt_len,
        lengths=LengthDist(mode_len, t.max_output_len, t.output_len_tail, t.output_len_spread),
        micro_batch=r.train.micro_batch,
        staleness=max(1, r.algorithm.max_staleness),
    )
