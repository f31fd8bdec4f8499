"""The workload W of one RL iteration, as the cost model sees it, derived from a recipe.

The planner must not depend on the whole recipe tree (or on OmegaConf): it gets the few numbers
that set the cost of an iteration — model shape, samples per iteration, prompt and output
lengths, algorithm and pipelining mode — in small frozen dataclasses, built here once.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from streamrl_cli.planner import PlannerError
from streamrl_cli.planner.lengths import LengthDist
from streamrl_cli.recipe.presets import require_resolved, uses_critic
from streamrl_cli.recipe.schema import Recipe

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# The vocabulary the planner assumes when the model's config.json is not on this machine: Qwen2.5's
# (Llama 3's is 128,256). It sizes the LM head's logits (planner.training.logits_bytes).
DEFAULT_VOCAB = 152_064
# The builders' models' vocabulary (models.tiny.TinySpec.vocab_size: the planner stands beside models
# and imports none of it; a test keeps the two equal).
BUILDER_VOCAB = 512
LOGITS_CHUNK = 1024  # roles.trainer.logits_chunk's default, for a workload built without a recipe


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
    intermediate: int = 0  # MLP width (gate/up outputs, down input); 0: inferred, see mlp_width
    vocab: int = 0  # LM head outputs (0: unknown, its logits are not counted)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def attention_params_per_layer(self) -> int:
        """q and o (hidden × hidden), k and v (hidden × kv_heads · head_dim); biases left out."""
        return 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads * self.head_dim

    @property
    def mlp_width(self) -> int:
        """The gated MLP's width: ``intermediate`` when known, else what the parameter count leaves
        per layer after attention, over the MLP's 3 · hidden weights per unit of width. The recipe
        states no vocabulary, so the embeddings count as MLP there: an overestimate (+19% for
        Qwen2.5-7B's 18,944, +4% for 72B's 29,568), which only LoRA's adapter count uses."""
        if self.intermediate > 0:
            return self.intermediate
        left = self.params / self.layers - self.attention_params_per_layer
        return max(1, round(left / (3 * self.hidden)))

    @property
    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear layer of one Llama/Qwen block, by its name."""
        h, kv, i = self.hidden, self.kv_heads * self.head_dim, self.mlp_width
        return {
            "q_proj": (h, h),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (h, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

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


LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def adapter_params(model: ModelShape, rank: int, targets: tuple[str, ...]) -> int:
    """Parameters of LoRA adapters of rank ``rank`` on ``targets`` (PEFT's target_modules): each
    adapted linear layer of (in, out) features gets A (rank × in) and B (out × rank), so
    rank · (in + out). A target names a layer kind of every block (``q_proj``, ``self_attn.q_proj``)
    or, with its index, of one block (``model.layers.3.self_attn.q_proj``); a layer two targets
    name is adapted once, as in PEFT."""
    shapes = model.linear_shapes
    adapted: set[tuple[int, str]] = set()
    for t in targets:
        leaf = t.rsplit(".", 1)[-1]
        if leaf not in shapes:
            raise PlannerError(
                f"model.lora.target_modules: {t!r} is no layer whose shape the planner knows "
                f"({', '.join(shapes)})"
            )
        index = LAYER_INDEX.search(t)
        layers = [int(index[1])] if index else range(model.layers)
        adapted.update((layer, leaf) for layer in layers if layer < model.layers)
    return sum(rank * sum(shapes[leaf]) for _, leaf in adapted)


@dataclass(frozen=True)
class Workload:
    """One iteration's work: `prompts × group_size` samples, lengths drawn from `lengths`."""

    model: ModelShape
    # ppo: actor and critic trained; any other name (grpo, dapo, ...): no critic.
    algorithm: str
    mode: str  # baseline | sync-stream | async
    prompts: int  # prompts per iteration (train.global_batch)
    group_size: int  # samples per prompt
    prompt_len: float  # mean prompt tokens
    max_prompt_len: int
    lengths: LengthDist  # output tokens
    micro_batch: int  # samples per forward/backward (sets the trainer's micro-batch token budget)
    staleness: int = 1  # async: policy versions a sample may lag
    # A KL term against the reference (algorithm.kl_coef ≠ 0 and kl_mode ≠ none): its log-probs cost
    # a forward per micro-batch, and without LoRA a frozen copy of the model in memory.
    reference: bool = True
    lora_rank: int = 0  # model.lora.rank (0: every weight of the actor trains)
    lora_targets: tuple[str, ...] = ()  # model.lora.target_modules
    lora_sync: str = "merged"  # model.lora.sync: "adapter" sends the adapters alone inside a site
    # Long contexts (planner.training): the LM head's tokens per chunk (0: unchunked), the token
    # budget of a micro-batch (0: none), the recipe's activation checkpointing and Ulysses degree
    # (on, or above 1, they are fixed; at their defaults tune-split may propose them), the attention.
    logits_chunk: int = LOGITS_CHUNK
    micro_batch_tokens: int = 0
    activation_checkpointing: bool = False
    sequence_parallel: int = 1
    attention: str = "sdpa"

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
    def micro_tokens(self) -> int:
        """Tokens of one packed micro-batch, the memory bound: one maximum-length sequence, or with
        train.micro_batch_tokens min(micro_batch_tokens, micro_batch × max_seq), at least one
        maximum-length sequence (the trainer cuts micro-batches by rows and by tokens)."""
        if self.micro_batch_tokens <= 0:
            return self.max_seq
        return max(self.max_seq, min(self.micro_batch_tokens, self.micro_batch * self.max_seq))

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
    def critic(self) -> bool:
        """PPO (GAE advantages) trains a critic of the policy's size, in full even with LoRA."""
        return self.algorithm == "ppo"

    @property
    def trained_models(self) -> int:
        return 2 if self.critic else 1

    @property
    def frozen_forwards(self) -> int:
        """Forwards without backward per micro-batch: the reference's log-probs (with a KL term;
        with LoRA the actor's own base, adapters off) and PPO's critic values before its update."""
        return int(self.reference) + int(self.critic)

    @property
    def lora(self) -> bool:
        return self.lora_rank > 0

    @property
    def training_label(self) -> str:
        """What the trainer trains, for titles and messages: ``GRPO``, ``PPO + LoRA r8``."""
        return self.algorithm.upper() + (f" + LoRA r{self.lora_rank}" if self.lora else "")

    @property
    def adapter_params(self) -> int:
        """The actor's LoRA adapter parameters (0 without LoRA)."""
        return adapter_params(self.model, self.lora_rank, self.lora_targets) if self.lora else 0

    @property
    def version_bytes(self) -> float:
        """Bytes of one weight version as the generators receive it, on the broadcast and through the
        cross-site relay alike: the whole model (with LoRA the merged weights,
        trainer.role.lora.merged_state), or with model.lora.sync adapter the adapters alone."""
        if self.lora and self.lora_sync == "adapter":
            return self.adapter_params * self.model.dtype_bytes
        return self.model.weight_bytes

    @property
    def actor_trainable(self) -> float:
        """Parameters the actor's optimizer holds: the adapters with LoRA, else every weight."""
        return self.adapter_params if self.lora else self.model.params

    @property
    def reference_copies(self) -> int:
        """Frozen reference models in memory: one with a KL term, none with LoRA (the actor's base,
        its adapters switched off, is the reference: trainer.role.learner.Learner.reference_logp)."""
        return int(self.reference and not self.lora)


def _without_critic(name: str) -> str:
    """The algorithm's name for the cost model when it trains no critic (`ppo` means one)."""
    return "grpo" if name == "ppo" else name


def vocab_from_recipe(r: Recipe) -> int:
    """The model's vocabulary: its config.json's vocab_size where the model directory is on this
    machine, the built-in builder's for a model made at start, else DEFAULT_VOCAB."""
    path = Path(os.path.expanduser(r.model.path)) / "config.json"
    try:
        config = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        config = {}
    if not isinstance(config, dict):
        config = {}
    vocab = config.get("vocab_size", (config.get("text_config") or {}).get("vocab_size"))
    if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 0:
        return vocab
    if r.model.builder is not None:
        return BUILDER_VOCAB
    return DEFAULT_VOCAB


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
        vocab=vocab_from_recipe(r),
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
    a = require_resolved(r.algorithm, "the planner's workload")  # checks.resolve filled its preset
    lora = r.model.lora
    t_ = r.roles.trainer
    return Workload(
        model=model_from_recipe(r),
        algorithm="ppo" if uses_critic(a) else _without_critic(a.name),
        mode=mode or r.algorithm.mode,
        prompts=r.train.global_batch,
        group_size=a.group_size,
        prompt_len=float(prompt),
        max_prompt_len=t.max_prompt_len,
        lengths=LengthDist(mode_len, t.max_output_len, t.output_len_tail, t.output_len_spread),
        micro_batch=r.train.micro_batch,
        staleness=max(1, r.algorithm.max_staleness),
        # As trainer.role.learner.LossConfig decides: a zero coefficient turns the KL (and reference) off.
        reference=a.kl_coef != 0 and a.kl_mode != "none",
        lora_rank=max(0, lora.rank),
        lora_targets=tuple(lora.target_modules) if lora.rank > 0 else (),
        lora_sync=lora.sync if lora.rank > 0 else "merged",
        logits_chunk=t_.logits_chunk,
        micro_batch_tokens=r.train.micro_batch_tokens,
        activation_checkpointing=t_.activation_checkpointing,
        # roles.trainer.sequence_parallel is read where the recipe schema has it (the trainer's key).
        sequence_parallel=t_.sequence_parallel,
        attention=t_.attention,
    )
