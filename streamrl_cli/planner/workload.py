"""The workload W of one RL iteration, as the cost model sees it, derived from a recipe.

The planner must not depend on the whole recipe tree (or on OmegaConf): it gets the few numbers
that set the cost of an iteration — model shape, samples per iteration, prompt and output
lengths, algorithm and pipelining mode — in small frozen dataclasses, built here once.
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

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
    head_size: int = 0  # config.json's head_dim where it is not hidden / heads (Qwen3); 0: hidden / heads
    # Mixture of experts (0 experts: a dense model). `params` stays the TOTAL count (every expert):
    # memory (weights, gradients, optimizer states, the generators' copies, weight versions) counts
    # it; compute counts `active_params`, the weights one token goes through.
    experts: int = 0  # routed experts per MoE layer, E (num_experts / num_local_experts / n_routed_experts)
    experts_per_token: int = 0  # k experts each token is routed to (num_experts_per_tok)
    expert_intermediate: int = 0  # one routed expert's gated-MLP width (moe_intermediate_size)
    shared_intermediate: int = 0  # the always-on shared expert(s)' total width (0: none)
    dense_layers: int = 0  # layers with a dense MLP of `intermediate` instead of experts

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads

    @property
    def q_width(self) -> int:
        """Width of the queries and of the attention output: heads × head_dim (hidden in Qwen2.5)."""
        return self.heads * self.head_dim

    @property
    def attention_params_per_layer(self) -> int:
        """q and o (hidden × heads · head_dim), k and v (hidden × kv_heads · head_dim); biases left out."""
        return 2 * self.hidden * self.q_width + 2 * self.hidden * self.kv_heads * self.head_dim

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.moe else 0

    @property
    def expert_params(self) -> float:
        """Parameters of every routed expert (gate, up and down of width expert_intermediate, in each
        MoE layer): what expert parallelism splits."""
        return self.moe_layers * self.experts * 3 * self.hidden * self.expert_intermediate

    @property
    def active_params(self) -> float:
        """Parameters one token goes through: the total less the routed experts it is not sent to,
        params − moe_layers · (E − k) · 3 · hidden · expert_intermediate (the router, attention, shared
        experts, dense layers and embeddings all count). A dense model's is ``params``."""
        if not self.moe:
            return self.params
        idle = self.moe_layers * (self.experts - self.experts_per_token) * 3 * self.hidden
        return self.params - idle * self.expert_intermediate

    def distinct_experts(self, batch: float) -> float:
        """Expected distinct experts of one MoE layer that a decode step of ``batch`` tokens touches:
        each token picks k of E, taken here as k independent draws with probability k / E of hitting a
        given expert each, so an expert is missed by the whole batch with probability (1 − k/E)^b and

            distinct(b) = E · (1 − (1 − k/E)^b)

        which is k at b = 1 and tends to E as b grows (E · (1 − e^(−k·b/E)) for large E)."""
        if not self.moe:
            return 0.0
        e, k = self.experts, self.experts_per_token
        return e * (1 - (1 - k / e) ** max(1.0, batch))

    def decode_weight_bytes(self, batch: float) -> float:
        """Weight bytes one decode step of ``batch`` sequences reads from HBM: every weight of a dense
        model; for MoE every non-expert weight plus, per MoE layer, the distinct experts the batch is
        routed to (distinct_experts) — k experts' worth alone, all E for a large batch."""
        if not self.moe:
            return self.weight_bytes
        one = 3 * self.hidden * self.expert_intermediate
        read = self.params - self.expert_params + self.moe_layers * self.distinct_experts(batch) * one
        return read * self.dtype_bytes

    @property
    def mlp_width(self) -> int:
        """The gated MLP's width: ``intermediate`` when known, else what the parameter count leaves
        per layer after attention, over the MLP's 3 · hidden weights per unit of width. The recipe
        states no vocabulary, so the embeddings count as MLP there: an overestimate (+19% for
        Qwen2.5-7B's 18,944, +4% for 72B's 29,568), which only LoRA's adapter count uses."""
        if self.intermediate > 0:
            return self.intermediate
        if self.moe:  # a routed expert's width: what a gate/up/down projection is in an MoE block
            return self.expert_intermediate
        left = self.params / self.layers - self.attention_params_per_layer
        return max(1, round(left / (3 * self.hidden)))

    @property
    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear layer of one Llama/Qwen block, by its name (in an MoE
        block gate/up/down are one routed expert's, repeated ``mlp_copies`` times)."""
        h, kv, q = self.hidden, self.kv_heads * self.head_dim, self.q_width
        i = self.expert_intermediate if self.moe else self.mlp_width
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    @property
    def mlp_copies(self) -> int:
        """gate/up/down projections of one block that a LoRA target names: E routed experts' in an MoE
        block (PEFT adapts `mlp.experts.N.gate_proj` for each N), one in a dense block."""
        return self.experts if self.moe else 1

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
    mlp = ("gate_proj", "up_proj", "down_proj")
    return sum(rank * sum(shapes[leaf]) * (model.mlp_copies if leaf in mlp else 1) for _, leaf in adapted)


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
    tensor_parallel: int = 1  # the recipe's roles.trainer.tensor_parallel (what tune-split may change)

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


# Public config.json excerpts of models the planner may be asked about without their directory on this
# machine, by hub id (model.path): what the recipe cannot say (experts, head_dim, vocabulary).
CATALOGUE = Path(__file__).with_name("models.yaml")
# config.json keys of a mixture of experts, first found wins (Qwen2/3-MoE, Mixtral, DeepSeek); the
# same names as models.architecture.MOE_KEYS (the planner imports nothing of models).
MOE_KEYS = {
    "experts": ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"),
    "experts_per_token": ("num_experts_per_tok", "moe_topk"),
    "expert_intermediate": ("moe_intermediate_size",),
}


@functools.cache
def catalogue() -> dict[str, dict]:
    """The shipped config.json excerpts (planner/models.yaml), by hub id (read once: do not modify)."""
    data = yaml.safe_load(CATALOGUE.read_text()) or {}
    return {str(k): v for k, v in data.items() if isinstance(v, dict)}


def model_config(path: str) -> dict:
    """The model's config.json (its text model's, for a multimodal one): from the model directory
    where it is on this machine, else the catalogue's entry for the hub id, else {}."""
    file = Path(os.path.expanduser(path)) / "config.json"
    try:
        config = json.loads(file.read_text()) if file.is_file() else catalogue().get(path, {})
    except (OSError, ValueError):
        config = {}
    if not isinstance(config, dict):
        return {}
    text = config.get("text_config")
    return text if "num_hidden_layers" not in config and isinstance(text, dict) else config


def _int(config: dict, *names: str) -> int:
    for n in names:
        v = config.get(n)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return 0


def moe_shape(config: dict) -> dict[str, int]:
    """ModelShape's mixture-of-experts fields of a config.json ({} for a dense model): experts,
    experts per token, one expert's width, the shared experts' width (Qwen2-MoE's
    shared_expert_intermediate_size, or DeepSeek's n_shared_experts × moe_intermediate_size), the
    dense layers (DeepSeek's first_k_dense_replace; Qwen's mlp_only_layers and the layers
    decoder_sparse_step skips) and their MLP width (intermediate_size)."""
    shape = {key: _int(config, *names) for key, names in MOE_KEYS.items()}
    if not all(shape.values()):
        return {}
    layers = _int(config, "num_hidden_layers")
    only = config.get("mlp_only_layers") or []
    step = _int(config, "decoder_sparse_step") or 1
    dense = _int(config, "first_k_dense_replace") or sum(
        1 for i in range(layers) if i in only or (i + 1) % step != 0
    )
    shared = _int(config, "shared_expert_intermediate_size") or (
        _int(config, "n_shared_experts") * shape["expert_intermediate"]
    )
    return {
        **shape,
        "shared_intermediate": shared,
        "dense_layers": dense,
        "intermediate": _int(config, "intermediate_size") if dense else 0,
    }


def vocab_from_recipe(r: Recipe) -> int:
    """The model's vocabulary: its config.json's vocab_size where the model directory is on this
    machine (or the catalogue knows the hub id), the built-in builder's for a model made at start,
    else DEFAULT_VOCAB."""
    vocab = _int(model_config(r.model.path), "vocab_size")
    if vocab:
        return vocab
    if r.model.builder is not None:
        return BUILDER_VOCAB
    return DEFAULT_VOCAB


def model_from_recipe(r: Recipe) -> ModelShape:
    """The recipe's model: its architecture keys, with what only config.json says (vocabulary,
    head_dim, experts) from the model directory or the catalogue. ``model.params_b`` is the total
    parameter count, experts and all."""
    m = r.model
    if m.params_b <= 0:
        raise PlannerError(f"model.params_b must be positive for tune-split, got {m.params_b}")
    if m.hidden_size % m.num_attention_heads:
        raise PlannerError(
            f"model.hidden_size {m.hidden_size} is not a multiple of {m.num_attention_heads} heads"
        )
    config = model_config(m.path)
    moe = moe_shape(config)
    stated = {"num_layers": _int(config, "num_hidden_layers"), "hidden_size": _int(config, "hidden_size")}
    wrong = [
        f"model.{k} {getattr(m, k)} but its config.json says {v}"
        for k, v in stated.items()
        if v and v != getattr(m, k)
    ]
    if moe and wrong:
        raise PlannerError(f"{m.path}: the recipe and the model's experts disagree: {'; '.join(wrong)}")
    head_dim = _int(config, "head_dim")
    shape = ModelShape(
        name=m.name,
        params=m.params_b * 1e9,
        layers=m.num_layers,
        hidden=m.hidden_size,
        heads=m.num_attention_heads,
        kv_heads=m.num_kv_heads,
        dtype_bytes=DTYPE_BYTES[m.dtype],
        vocab=vocab_from_recipe(r),
        head_size=head_dim if head_dim and head_dim != m.hidden_size // m.num_attention_heads else 0,
        **moe,
    )
    if shape.moe and shape.active_params <= 0:
        raise PlannerError(
            f"model.params_b {m.params_b} is less than the experts of {m.path} alone "
            f"({shape.expert_params / 1e9:.3g}B): params_b is the total, every expert counted"
        )
    return shape


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
        tensor_parallel=t_.tensor_parallel,
    )
